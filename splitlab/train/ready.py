"""Which ready task a node runs next: returning work first, then peers by weight.

Owners and workers both see work arrive from several peers. Two rules decide the order:

1. Work that finishes a live microbatch (a body backward on a worker; a tail forward or a
   front backward on an owner) goes before work that starts a new one (a body or front
   forward), so graphs are released, and credits refilled, as early as possible.
2. Among peers with work of the chosen class, a smooth weighted round robin over the peers'
   registered weights decides, so a heavy owner cannot starve a light one.

    .venv/bin/pytest tests/unit/test_train_ready.py -q
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from enum import IntEnum
from typing import Generic, TypeVar

from splitlab.train.wrr import SmoothWRR

T = TypeVar("T")


class Work(IntEnum):
    """Task classes in service order (lower first)."""

    RETURNING = 0  # backward, or a tail forward: completes a live microbatch
    NEW = 1  # a forward that starts a microbatch


class ReadyQueues(Generic[T]):
    """FIFO queues per (class, peer), served returning-first then by peer weight."""

    def __init__(self, peer_weights: Mapping[str, float]) -> None:
        self._queues: dict[Work, dict[str, deque[T]]] = {
            work: {peer: deque() for peer in peer_weights} for work in Work
        }
        self._wrr = {work: SmoothWRR(peer_weights) for work in Work}

    def push(self, work: Work, peer: str, item: T) -> None:
        self._queues[work][peer].append(item)

    def __len__(self) -> int:
        return sum(len(q) for by_peer in self._queues.values() for q in by_peer.values())

    def pop(self) -> tuple[Work, str, T] | None:
        """The next task, or None when nothing is ready."""
        for work in Work:
            waiting = {peer for peer, queue in self._queues[work].items() if queue}
            if waiting:
                peer = self._wrr[work].pick(waiting)
                return work, peer, self._queues[work][peer].popleft()
        return None
