"""Per-process data-plane counters: frames and bytes per lane, copy times, handshakes, pools.

Transports own one `WireCounters`; `snapshot()` merges in their pools' hit/miss/eviction and
peak-lease figures, and `emit(tracer)` writes the snapshot as one `TransportRecord`.

    .venv/bin/pytest tests/unit/test_wire_inproc.py -q -k counters
"""

from __future__ import annotations

import statistics
import threading
from collections import deque
from collections.abc import Mapping
from typing import Any

from splitlab.telemetry.records import TransportRecord
from splitlab.telemetry.trace import Tracer
from splitlab.wire.frame import Lane
from splitlab.wire.pool import BufferPool

SAMPLES = 256  # per-frame values kept per name for a median


class WireCounters:
    """Thread-safe running totals; cheap enough to bump once per frame."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, float] = {}
        self._samples: dict[str, deque[float]] = {}
        self._keys: dict[Lane, tuple[str, str, str, str]] = {}
        for lane in Lane:
            names = ("frames_sent", "bytes_sent", "frames_recv", "bytes_recv")
            self._keys[lane] = tuple(f"{lane.value}.{name}" for name in names)  # type: ignore[assignment]
            for key in self._keys[lane]:
                self._values[key] = 0
        for name in ("d2h_ms", "h2d_ms", "auth_ok", "auth_refused", "peers_lost"):
            self._values[name] = 0

    def sent(self, lane: Lane, nbytes: int) -> None:
        frames, sent, _, _ = self._keys[lane]
        with self._lock:
            self._values[frames] += 1
            self._values[sent] += nbytes

    def received(self, lane: Lane, nbytes: int) -> None:
        _, _, frames, got = self._keys[lane]
        with self._lock:
            self._values[frames] += 1
            self._values[got] += nbytes

    def add(self, name: str, amount: float = 1) -> None:
        with self._lock:
            self._values[name] = self._values.get(name, 0) + amount

    def peak(self, name: str, value: float) -> None:
        """Keep the largest `value` seen under `name` (a per-frame best, e.g. a link's rate)."""
        with self._lock:
            self._values[name] = max(self._values.get(name, value), value)

    def sample(self, name: str, value: float) -> None:
        """Add a per-frame `value` under `name`; the snapshot reports the median of the last
        `SAMPLES` (robust where a busy host biases single frames either way)."""
        with self._lock:
            self._samples.setdefault(name, deque(maxlen=SAMPLES)).append(value)

    def snapshot(self, pools: Mapping[str, BufferPool] | None = None) -> dict[str, Any]:
        with self._lock:
            out: dict[str, Any] = dict(self._values)
            out.update({name: statistics.median(v) for name, v in self._samples.items()})
        for name, pool in (pools or {}).items():
            for key, value in pool.stats.as_dict().items():
                out[f"pool.{name}.{key}"] = value
        return out

    def emit(
        self,
        tracer: Tracer,
        pools: Mapping[str, BufferPool] | None = None,
        *,
        transport: str,
        peer: str,
        delay: Mapping[str, Any] | None = None,
    ) -> None:
        tracer.write(TransportRecord(transport=transport, peer=peer,
                                     counters=self.snapshot(pools), **(delay or {})))  # fmt: skip
