"""Where a scheduler's window time goes: wall milliseconds per phase, plus the CPU it got.

Owners and workers wrap each part of their loop (compute, sends, receives, idle polls, barrier
waits, the optimizer step) in `phase(name)`; at the window's end `take()` returns
`{"<name>_ms": ..., "wall_ms": ..., "cpu_ms": ...}` for a `window_profile` trace record and
starts over. `cpu_ms` is this process's CPU time over the same span: on a loaded machine,
wall >> cpu says the process waited for a core rather than for a peer. Timing uses
`perf_counter` only, so nothing synchronises a CUDA stream (GPU compute shows up where its
result is first read on the host).

    .venv/bin/pytest tests/unit/test_train_phases.py -q
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class PhaseTimes:
    """Accumulates wall milliseconds per named phase over one window."""

    def __init__(
        self,
        clock: Callable[[], float] = time.perf_counter,
        cpu_clock: Callable[[], float] = time.process_time,
    ) -> None:
        self.clock, self.cpu_clock = clock, cpu_clock
        self._ms: defaultdict[str, float] = defaultdict(float)
        self._began, self._cpu_began = clock(), cpu_clock()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        began = self.clock()
        try:
            yield
        finally:
            self._ms[name] += (self.clock() - began) * 1e3

    def take(self) -> dict[str, float]:
        """This window's phases (`<name>_ms`), `wall_ms` and `cpu_ms`; then start over."""
        now, cpu = self.clock(), self.cpu_clock()
        out = {f"{name}_ms": round(ms, 3) for name, ms in self._ms.items()}
        out["wall_ms"] = round((now - self._began) * 1e3, 3)
        out["cpu_ms"] = round((cpu - self._cpu_began) * 1e3, 3)
        self._ms.clear()
        self._began, self._cpu_began = now, cpu
        return out
