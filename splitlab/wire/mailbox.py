"""Bounded per-lane receive queues with priorities and per-peer selection.

The in-process and AMQP transports deliver whole frames here; `get` hands out the most urgent
(lowest priority value, then oldest) item of a lane, from one peer if asked. Each lane has its
own bound, so a full activation queue never blocks a gradient.

    .venv/bin/pytest tests/unit/test_wire_inproc.py -q
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any

from splitlab.errors import PeerLostError, WaitTimeoutError
from splitlab.wire.frame import Lane

Entry = tuple[int, int, str, Any]  # priority, sequence, peer, item


class Mailbox:
    def __init__(self, *, max_frames: int, name: str = "mailbox") -> None:
        self.max_frames, self.name = max_frames, name
        self._items: dict[Lane, list[Entry]] = {lane: [] for lane in Lane}
        self._lost: set[str] = set()
        self._closed = False
        self._seq = itertools.count()
        self._cond = threading.Condition()

    def put(self, lane: Lane, peer: str, priority: int, item: Any, *, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while len(self._items[lane]) >= self.max_frames and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise WaitTimeoutError(
                        f"{self.name}: {lane.value} queue full ({self.max_frames} frames) "
                        f"for timeout_s={timeout_s}"
                    )
                self._cond.wait(left)
            if self._closed:
                raise PeerLostError(f"{self.name} is closed")
            self._items[lane].append((priority, next(self._seq), peer, item))
            self._cond.notify_all()

    def get(self, lane: Lane, *, timeout_s: float, peer: str | None = None) -> tuple[str, Any]:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                items = self._items[lane]
                matching = [e for e in items if peer is None or e[2] == peer]
                if matching:
                    best = min(matching)
                    items.remove(best)
                    self._cond.notify_all()
                    return best[2], best[3]
                if self._closed:
                    raise PeerLostError(f"{self.name} is closed")
                if peer is not None and peer in self._lost:
                    raise PeerLostError(f"peer {peer!r} closed its connection")
                left = deadline - time.monotonic()
                if left <= 0:
                    src = f" from {peer!r}" if peer else ""
                    raise WaitTimeoutError(
                        f"{self.name}: no {lane.value} frame{src} within timeout_s={timeout_s}"
                    )
                self._cond.wait(left)

    def depth(self, lane: Lane) -> int:
        with self._cond:
            return len(self._items[lane])

    def peer_lost(self, peer: str) -> None:
        with self._cond:
            self._lost.add(peer)
            self._cond.notify_all()

    def close(self) -> list[Any]:
        """Wake every waiter with PeerLostError; returns the undelivered items."""
        with self._cond:
            self._closed = True
            left = [e[3] for items in self._items.values() for e in items]
            for items in self._items.values():
                items.clear()
            self._cond.notify_all()
        return left
