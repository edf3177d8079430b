"""Delivery rules of the window protocol, as a pure state machine (no bus, no clock).

A node feeds every decoded delivery to `Inbox.offer` and takes messages out with `pop`:

- duplicates are suppressed per `BusMessage.dedup_key()`, which for window messages is
  (session, window, kind, sender, microbatch);
- a window message (PLAN, OPEN, DRAINED, COMMIT) for a window before the current one is
  stale: `offer` says so and the shell acks and drops it;
- a window message for a window after the current one is a `ProtocolError`: the protocol
  is lockstep, so it means a peer skipped a barrier;
- ABORT ends the session whatever its window, and `pop` returns it before anything else;
- a message from another session is a `ProtocolError` (queues are session-scoped, so it is a bug);
- given the session's `peers`, a message from any other sender (an ABORT from a node that is
  not in the run, say) is refused: `offer` says UNKNOWN, it is logged once per sender, and the
  shell acks and drops it (so a stranger can neither abort the run nor make it fail).

Advance the window *before* publishing the message that lets peers move on (a worker
advances, then sends COMMIT), or their next message arrives as a "future" one.

    .venv/bin/pytest tests/unit/test_control_inbox.py -q
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Collection
from enum import StrEnum
from typing import Any

from splitlab.control.messages import WINDOW_KINDS, Abort, BusMessage, Kind
from splitlab.errors import ProtocolError

log = logging.getLogger(__name__)


class Verdict(StrEnum):
    ACCEPTED = "accepted"  # buffered; `pop` will return it
    DUPLICATE = "duplicate"  # same dedup key seen before: ack and drop
    STALE = "stale"  # window message for a window already closed: ack and drop
    UNKNOWN = "unknown"  # from a sender that is not one of the session's peers: ack and drop


class Inbox:
    """Per-node buffer applying the delivery rules for one session."""

    def __init__(self, session_id: str, *, window_id: int = 0,
                 peers: Collection[str] | None = None) -> None:  # fmt: skip
        """`peers`: the node ids that may send to this node (None: anyone)."""
        self.session_id = session_id
        self.peers = None if peers is None else frozenset(peers)
        self.unknown_senders: dict[str, int] = {}  # refused sender -> messages dropped
        self._window_id = window_id
        self._pending: deque[BusMessage] = deque()
        self._aborts: deque[Abort] = deque()
        self._first_abort: Abort | None = None
        self._seen_window: set[tuple[Any, ...]] = set()  # keys of the current window only
        self._seen_other: set[tuple[Any, ...]] = set()  # keys of session-scoped kinds
        self.num_duplicates = 0
        self.num_stale = 0

    @property
    def window_id(self) -> int:
        return self._window_id

    @property
    def aborted(self) -> Abort | None:
        """The first ABORT received, if any (it stays set: the session is over)."""
        return self._first_abort

    def __len__(self) -> int:
        return len(self._pending) + len(self._aborts)

    def advance(self, window_id: int) -> None:
        """Enter `window_id`; buffered messages of earlier windows become stale and are dropped."""
        if window_id < self._window_id:
            raise ValueError(f"window must not go back: {self._window_id} -> {window_id}")
        if window_id == self._window_id:
            return
        self._window_id = window_id
        self._seen_window.clear()  # earlier windows are rejected as stale before dedup
        kept = [m for m in self._pending if not self._is_stale(m)]
        self.num_stale += len(self._pending) - len(kept)
        self._pending = deque(kept)

    def offer(self, msg: BusMessage) -> Verdict:
        """Apply the delivery rules to one message; raises `ProtocolError` for a future window."""
        if msg.session_id != self.session_id:
            raise ProtocolError(
                f"{msg.kind.value} from {msg.sender!r} belongs to session {msg.session_id!r}, "
                f"this node runs session {self.session_id!r}"
            )
        if self.peers is not None and msg.sender not in self.peers:
            if msg.sender not in self.unknown_senders:
                log.warning("refused %s from %r: not a node of session %r", msg.kind.value,
                            msg.sender, self.session_id)  # fmt: skip
            self.unknown_senders[msg.sender] = self.unknown_senders.get(msg.sender, 0) + 1
            return Verdict.UNKNOWN
        if msg.kind in WINDOW_KINDS:
            if msg.window_id < self._window_id:
                self.num_stale += 1
                return Verdict.STALE
            if msg.window_id > self._window_id:
                raise ProtocolError(
                    f"{msg.kind.value} from {msg.sender!r} is for window {msg.window_id} "
                    f"but this node is in window {self._window_id}"
                )
            seen = self._seen_window
        else:
            seen = self._seen_other
        key = msg.dedup_key()
        if key in seen:
            self.num_duplicates += 1
            return Verdict.DUPLICATE
        seen.add(key)
        if isinstance(msg, Abort):
            self._aborts.append(msg)
            if self._first_abort is None:
                self._first_abort = msg
        else:
            self._pending.append(msg)
        return Verdict.ACCEPTED

    def has(self, kinds: Collection[Kind] | None = None) -> bool:
        """Whether `pop(kinds)` would return a message now."""
        return bool(self._aborts) or any(kinds is None or m.kind in kinds for m in self._pending)

    def pop(self, kinds: Collection[Kind] | None = None) -> BusMessage | None:
        """Next message: any ABORT first, then the oldest message whose kind is in `kinds`."""
        if self._aborts:
            return self._aborts.popleft()
        for i, msg in enumerate(self._pending):
            if kinds is None or msg.kind in kinds:
                del self._pending[i]
                return msg
        return None

    def _is_stale(self, msg: BusMessage) -> bool:
        return msg.kind in WINDOW_KINDS and msg.window_id < self._window_id
