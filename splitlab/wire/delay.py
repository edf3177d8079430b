"""A delay line for a transport's send path: each frame goes out at arrival + delay (+ jitter).

Where the kernel cannot add delay (no `netem`), a testbed link's one-way delay is added here:
`submit` takes a frame's hand-off to the socket as a callable and returns at once with a
ticket; a thread calls the hand-off when the frame is due. Frames to one key (a peer's lane)
leave in the order they came: a jittered due time is never earlier than the previous one's.
The tensors are not copied, so the ticket finishes only once the delayed send has (the
transport contract: tensors stay unmodified until their ticket is done). Traces that carry
frames delayed here say `delay_source: transport`.

Only the data plane's frames are delayed; TCP's own acknowledgements are not, so a window
limited by the bandwidth-delay product is not emulated.

    .venv/bin/pytest tests/unit/test_wire_delay.py -q
"""

from __future__ import annotations

import heapq
import itertools
import random
import threading
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any

from splitlab.errors import WaitTimeoutError
from splitlab.wire.tickets import DEFAULT_TIMEOUT_S, SENT, SendTicket

DELAY_SOURCE = "transport"


@dataclass(frozen=True, kw_only=True)
class PathDelay:
    """One-way delay to a peer, varying uniformly by +- `jitter_ms`."""

    delay_ms: float = 0.0
    jitter_ms: float = 0.0

    def __post_init__(self) -> None:
        if self.delay_ms < 0 or self.jitter_ms < 0 or self.jitter_ms > self.delay_ms:
            raise ValueError(
                f"delay_ms={self.delay_ms} and jitter_ms={self.jitter_ms}: need 0 <= jitter <= delay"
            )


def due_s(now_s: float, last_due_s: float, path: PathDelay, u: float) -> float:
    """When a frame arriving at `now_s` leaves: now + delay + jitter x (2u - 1), u in [0, 1),
    but never before the frame ahead of it (`last_due_s`)."""
    jitter = path.jitter_ms * (2.0 * u - 1.0)
    return max(now_s + (path.delay_ms + jitter) / 1e3, last_due_s)


class DelayedTicket(SendTicket):
    """Done when the delay line has handed the frame on and the transport has sent it."""

    __slots__ = ("_inner",)

    def __init__(self) -> None:
        super().__init__()
        self._inner: SendTicket | None = None

    def handed_on(self, inner: SendTicket | None, error: BaseException | None = None) -> None:
        self._inner = inner
        self.finish(error)

    def done(self) -> bool:
        return super().done() and (self._inner is None or self._inner.done())

    def wait(self, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        super().wait(timeout_s)
        if self._inner is not None:
            self._inner.wait(max(deadline - time.monotonic(), 0.0))


@dataclass(order=True)
class _Item:
    due_s: float
    seq: int
    deliver: Callable[[], SendTicket] = field(compare=False)
    ticket: DelayedTicket = field(compare=False)
    peer: str = field(compare=False, default="")
    arrival_s: float = field(compare=False, default=0.0)


class DelayLine:
    """See module docstring. `paths` gives per-peer delays; other peers get `default`."""

    def __init__(self, *, default: PathDelay, paths: Mapping[str, PathDelay] | None = None,
                 seed: int = 0, max_pending: int = 1024,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self.default, self.paths = default, dict(paths or {})
        self.max_pending, self.clock = max_pending, clock
        self._rng = random.Random(seed)
        self._cond = threading.Condition()
        self._heap: list[_Item] = []
        self._last: dict[Hashable, float] = {}
        self._seq = itertools.count()
        self._busy = False
        self._closed = False
        self._held: dict[str, list[float]] = {}  # per peer: [frames, total ms, least ms] held
        self._thread = threading.Thread(target=self._run, name="wire-delay-line", daemon=True)
        self._thread.start()

    def path(self, peer: str) -> PathDelay:
        return self.paths.get(peer, self.default)

    def submit(self, key: Hashable, peer: str, deliver: Callable[[], SendTicket], *,
               timeout_s: float = DEFAULT_TIMEOUT_S) -> SendTicket:  # fmt: skip
        """Queue `deliver` (the frame's hand-off to the socket) for its due time."""
        arrival = self.clock()
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while len(self._heap) >= self.max_pending and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise WaitTimeoutError(
                        f"delay line full ({self.max_pending} frames) for timeout_s={timeout_s}"
                    )
                self._cond.wait(left)
            if self._closed:
                raise RuntimeError("the delay line is closed")
            due = due_s(arrival, self._last.get(key, 0.0), self.path(peer), self._rng.random())
            self._last[key] = due
            ticket = DelayedTicket()
            heapq.heappush(self._heap, _Item(due, next(self._seq), deliver, ticket, peer, arrival))
            self._cond.notify_all()
            return ticket

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    if not self._heap:
                        if self._closed:
                            return
                        self._cond.wait()
                        continue
                    wait_s = self._heap[0].due_s - self.clock()
                    if wait_s <= 0:
                        break
                    self._cond.wait(wait_s)
                item = heapq.heappop(self._heap)
                held_ms = (self.clock() - item.arrival_s) * 1e3
                held = self._held.setdefault(item.peer, [0, 0.0, held_ms])
                held[0] += 1
                held[1] += held_ms
                held[2] = min(held[2], held_ms)
                self._busy = True
                self._cond.notify_all()
            try:
                item.ticket.handed_on(item.deliver())
            except BaseException as exc:  # the frame fails, the line goes on
                item.ticket.handed_on(None, exc)
            with self._cond:
                self._busy = False
                self._cond.notify_all()

    def pending(self) -> int:
        with self._cond:
            return len(self._heap) + int(self._busy)

    def close(self, *, drain_timeout_s: float = 5.0) -> None:
        """Hand on what is queued when due (up to drain_timeout_s), then stop the thread."""
        deadline = time.monotonic() + drain_timeout_s
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            while (self._heap or self._busy) and time.monotonic() < deadline:
                self._cond.wait(max(deadline - time.monotonic(), 0.0))
            dropped, self._heap = self._heap, []
            self._cond.notify_all()
        for item in dropped:
            item.ticket.handed_on(None, RuntimeError("delay line closed before the frame was due"))
        self._thread.join(timeout=5)

    def describe(self) -> dict[str, Any]:
        """Trace fields: where the delay came from, how large it is set, and per peer how long
        frames were actually held (`held_ms`: frames, mean and least ms). The least is the
        delay the line adds; the mean also has this thread's lateness on a busy host."""
        with self._cond:
            held = {p: {"frames": int(n), "mean_ms": round(ms / n, 3), "min_ms": round(least, 3)}
                    for p, (n, ms, least) in self._held.items()}  # fmt: skip
        return {"delay_source": DELAY_SOURCE, "delay_ms": self.default.delay_ms,
                "jitter_ms": self.default.jitter_ms,
                "path_delay_ms": {p: d.delay_ms for p, d in self.paths.items()},
                "held_ms": held}  # fmt: skip


def sendall_through(line: DelayLine | None, sendall: Callable[[bytes], Any],
                    key: str) -> Callable[[bytes], None]:  # fmt: skip
    """`sendall`, or a hand-off of each byte string to `line`, which sends it when due (in
    order, under `key`): a raw byte stream (a probe, a relay) with a link's delay."""
    if line is None:
        return sendall

    def send(data: bytes) -> None:
        def deliver() -> SendTicket:
            sendall(data)
            return SENT

        line.submit(key, key, deliver)

    return send
