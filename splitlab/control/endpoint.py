"""A node's control endpoint: a bus plus the delivery rules of `inbox.py`.

Every poll first takes everything already waiting on the bus into the inbox (acking each
one: accepted messages are buffered, duplicates and stale windows are dropped), so an
ABORT that arrived behind other messages is still seen first. A message for a future
window, or from another session, is acked (it must not come back) and raised as
`ProtocolError`.

    .venv/bin/pytest tests/integration/test_control_protocol.py -q
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterable

from splitlab.control.bus import ControlBus
from splitlab.control.inbox import Inbox
from splitlab.control.messages import Abort, BusMessage, Kind
from splitlab.errors import AbortedError, ProtocolError, WaitTimeoutError


class ControlEndpoint:
    """Send and receive protocol messages for one node of one session."""

    def __init__(self, bus: ControlBus, *, window_id: int = 0, batch: int = 64,
                 peers: Collection[str] | None = None) -> None:  # fmt: skip
        """`peers`: the session's node ids; messages from any other sender are dropped."""
        self.bus = bus
        self.inbox = Inbox(bus.session, window_id=window_id, peers=peers)
        self._batch = batch

    @property
    def session(self) -> str:
        return self.bus.session

    @property
    def node_id(self) -> str:
        return self.bus.node_id

    @property
    def window_id(self) -> int:
        return self.inbox.window_id

    def advance(self, window_id: int) -> None:
        """Enter a window; do it before sending the message that lets peers move on."""
        self.inbox.advance(window_id)

    def send(self, to_node: str, msg: BusMessage, timeout_s: float | None = None) -> None:
        self.bus.publish(to_node, msg, timeout_s)

    def send_all(
        self, to_nodes: Iterable[str], msg: BusMessage, timeout_s: float | None = None
    ) -> None:
        for node in to_nodes:
            self.bus.publish(node, msg, timeout_s)

    def poll(self, timeout_s: float, kinds: Collection[Kind] | None = None) -> BusMessage | None:
        """Next message (ABORT first, else the oldest of `kinds`), waiting up to `timeout_s`."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        while True:
            # Something to return already: only look at what is waiting (an ABORT may be).
            # Nothing: block; the bus returns everything waiting once the first arrives.
            ready = self.inbox.has(kinds)
            self._pull(0.0 if ready else max(0.0, deadline - time.monotonic()))
            msg = self.inbox.pop(kinds)
            if msg is not None or time.monotonic() >= deadline:
                return msg

    def wait_for(self, kinds: Collection[Kind], timeout_s: float) -> BusMessage:
        """Like `poll`, but an ABORT raises `AbortedError` and running out raises `WaitTimeoutError`."""
        msg = self.poll(timeout_s, kinds)
        if isinstance(msg, Abort) and Kind.ABORT not in kinds:
            raise AbortedError(
                f"session {self.session} aborted by {msg.cause_node!r}: {msg.reason}"
            )
        if msg is None:
            names = ", ".join(sorted(k.value for k in kinds))
            raise WaitTimeoutError(
                f"node {self.node_id!r} waited {timeout_s:.1f} s for {names} in window {self.window_id}"
            )
        return msg

    def collect(
        self, kind: Kind, senders: Collection[str], timeout_s: float
    ) -> dict[str, BusMessage]:
        """One `kind` message from each of `senders` in the current window (a barrier)."""
        deadline = time.monotonic() + timeout_s
        got: dict[str, BusMessage] = {}
        while len(got) < len(senders):
            remaining_s = deadline - time.monotonic()
            try:
                msg = self.wait_for((kind,), max(0.0, remaining_s))
            except WaitTimeoutError:
                missing = sorted(set(senders) - set(got))
                raise WaitTimeoutError(
                    f"node {self.node_id!r}: no {kind.value} from {missing} in window "
                    f"{self.window_id} within {timeout_s:.1f} s"
                ) from None
            if msg.sender in senders:
                got[msg.sender] = msg
        return got

    def close(self) -> None:
        self.bus.close()

    def _pull(self, timeout_s: float) -> None:
        first_error: ProtocolError | None = None
        for delivery in self.bus.consume_batch(self._batch, timeout_s):
            try:
                self.inbox.offer(delivery.message)
            except ProtocolError as exc:
                first_error = first_error or exc
            delivery.ack()  # accepted: buffered here; duplicate, stale or invalid: must not return
        if first_error is not None:
            raise first_error
