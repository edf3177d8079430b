"""In-process transport: the same interface and the same frames, between threads of one process.

Peers register on an `InProcHub`; a send encodes the frame (so unit tests exercise the codec
and its validation) and queues the bytes in the receiver's bounded mailbox; `recv` decodes them
into the receiver's pool.

    .venv/bin/pytest tests/unit/test_wire_inproc.py -q
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import torch

from splitlab.errors import PeerLostError
from splitlab.telemetry.trace import Tracer
from splitlab.wire.base import DEFAULT_TIMEOUT_S, SENT, Message, Priority, SendTicket, Transport
from splitlab.wire.counters import WireCounters
from splitlab.wire.frame import (
    DEFAULT_MAX_FRAME_BYTES,
    FrameHeader,
    Lane,
    Routing,
    decode_frame,
    encode_frame,
    frame_bytes,
)
from splitlab.wire.mailbox import Mailbox
from splitlab.wire.pool import BufferPool


class InProcHub:
    """Directory of in-process peers (one per test or per simulated cluster)."""

    def __init__(self) -> None:
        self._peers: dict[str, InProcTransport] = {}
        self._lock = threading.Lock()

    def register(self, transport: InProcTransport) -> None:
        with self._lock:
            if transport.peer_id in self._peers:
                raise ValueError(f"peer id {transport.peer_id!r} already registered")
            self._peers[transport.peer_id] = transport

    def unregister(self, peer_id: str) -> None:
        with self._lock:
            self._peers.pop(peer_id, None)
            others = list(self._peers.values())
        for other in others:
            other._mailbox.peer_lost(peer_id)

    def lookup(self, peer_id: str) -> InProcTransport | None:
        with self._lock:
            return self._peers.get(peer_id)


class InProcTransport(Transport):
    def __init__(
        self,
        peer_id: str,
        hub: InProcHub,
        *,
        session: str | None = None,
        queue_frames: int = 64,
        pool_bytes: int = 256 << 20,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        check_finite: bool = False,
        tracer: Tracer | None = None,
    ) -> None:
        self.peer_id, self.hub, self.session = peer_id, hub, session
        self.max_frame_bytes, self.check_finite = min(max_frame_bytes, pool_bytes), check_finite
        self.tracer = tracer or Tracer.null()
        self._mailbox = Mailbox(max_frames=queue_frames, name=f"inproc:{peer_id}")
        self._pools = {
            lane.value: BufferPool(pool_bytes=pool_bytes, name=lane.value) for lane in Lane
        }
        self._counters = WireCounters()
        self._closed = False
        hub.register(self)

    @property
    def address(self) -> tuple[str, int]:
        return ("inproc", 0)

    def connect(
        self, peer_id: str, host: str = "", port: int = 0, *, timeout_s: float = 10.0
    ) -> None:
        if self.hub.lookup(peer_id) is None:
            raise PeerLostError(f"in-process peer {peer_id!r} is not registered")

    def send(
        self,
        peer_id: str,
        lane: Lane,
        kind: str,
        tensors: Mapping[str, torch.Tensor],
        *,
        meta: dict[str, Any] | None = None,
        routing: Routing | None = None,
        priority: int = Priority.FORWARD,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> SendTicket:
        header = FrameHeader(
            kind=kind, lane=lane, routing=routing or Routing(session=self.session),
            src=self.peer_id, priority=int(priority), meta=meta or {},
        )  # fmt: skip
        data = frame_bytes(encode_frame(header, {k: t.cpu() for k, t in tensors.items()}))
        target = self.hub.lookup(peer_id)
        if target is None or self._closed:
            raise PeerLostError(f"in-process peer {peer_id!r} is gone")
        target._mailbox.put(lane, self.peer_id, int(priority), data, timeout_s=timeout_s)
        self._counters.sent(lane, len(data))
        return SENT

    def recv(
        self, lane: Lane, *, timeout_s: float = DEFAULT_TIMEOUT_S, peer_id: str | None = None
    ) -> Message:
        peer, data = self._mailbox.get(lane, timeout_s=timeout_s, peer=peer_id)
        header, tensors, lease = decode_frame(
            data, pool=self._pools[lane.value], max_frame_bytes=self.max_frame_bytes,
            check_finite=self.check_finite, timeout_s=timeout_s,
        )  # fmt: skip
        self._counters.received(lane, len(data))
        return Message(header, tensors, lease, peer)

    def queued(self, lane: Lane) -> int:
        """Frames waiting in this peer's receive queue for `lane`."""
        return self._mailbox.depth(lane)

    def counters(self) -> dict[str, Any]:
        return self._counters.snapshot(self._pools)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.hub.unregister(self.peer_id)
        self._mailbox.close()
        self._counters.emit(self.tracer, self._pools, transport="inproc", peer=self.peer_id)
