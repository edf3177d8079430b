"""The transport interface every data plane implements (TCP, in-process, tensor-over-AMQP).

A transport belongs to one process (`peer_id`). `send` hands named tensors to a peer on a lane
and returns a `SendTicket`; the tensors must not be modified in place until the ticket is done.
`recv` returns the next `Message` on a lane (optionally from one peer only); its tensors are
views of pooled buffers, valid until `message.release()` (or the end of a `with` block).
`channel(peer, lane)` wraps both into a blocking point-to-point pipe (the ring's hidden states).

    .venv/bin/pytest tests/unit/test_wire_inproc.py -q
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import torch

from splitlab.errors import PeerLostError
from splitlab.wire.frame import FrameHeader, Lane, Routing
from splitlab.wire.pool import Lease
from splitlab.wire.tickets import DEFAULT_TIMEOUT_S, SENT, SendTicket  # noqa: F401 (re-exported)


class Priority(IntEnum):
    """Lower goes first within a lane's send queue: backward before forward."""

    BACKWARD = 0
    MIGRATION = 5
    FORWARD = 10


@dataclass(eq=False)
class Message:
    """A received frame: header, tensor views of pooled buffers, and the lease on them."""

    header: FrameHeader
    tensors: dict[str, torch.Tensor]
    lease: Lease
    peer: str

    @property
    def kind(self) -> str:
        return self.header.kind

    @property
    def lane(self) -> Lane:
        return self.header.lane

    @property
    def routing(self) -> Routing:
        return self.header.routing

    @property
    def meta(self) -> dict[str, Any]:
        return self.header.meta

    def release(self) -> None:
        """Give the buffers back; the tensors must not be used afterwards (clone to keep)."""
        self.lease.release()

    def __enter__(self) -> Message:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class InFlight:
    """Sends not known to be finished, with their tensors kept alive (and unmodified) until
    they are, so a caller can go on computing instead of waiting on every ticket.

    `send` (or `add` for a ticket sent elsewhere) surfaces the error of any send that already
    failed; `wait_all` bounds the rest.
    """

    def __init__(self, transport: Transport | None = None, *, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.transport, self.timeout_s = transport, timeout_s
        self._items: list[tuple[SendTicket, Mapping[str, torch.Tensor]]] = []

    def __len__(self) -> int:
        return len(self._items)

    def send(self, peer_id: str, lane: Lane, kind: str, tensors: Mapping[str, torch.Tensor], *,
             routing: Routing, priority: int = Priority.FORWARD) -> None:  # fmt: skip
        assert self.transport is not None, "InFlight.send needs the transport"
        ticket = self.transport.send(peer_id, lane, kind, tensors, routing=routing,
                                     priority=priority, timeout_s=self.timeout_s)  # fmt: skip
        self.add(ticket, tensors)

    def add(self, ticket: SendTicket, tensors: Mapping[str, torch.Tensor]) -> None:
        for done, _ in [item for item in self._items if item[0].done()]:
            done.wait(0.0)  # re-raises that send's error
        self._items = [item for item in self._items if not item[0].done()]
        if not ticket.done():
            self._items.append((ticket, tensors))
        else:
            ticket.wait(0.0)

    def wait_all(self, timeout_s: float | None = None) -> None:
        """Every send finished, within `timeout_s` each; re-raises the first error."""
        items, self._items = self._items, []
        for ticket, _ in items:
            ticket.wait(self.timeout_s if timeout_s is None else timeout_s)


class Transport(ABC):
    """Point-to-point tensor transport between named peers (see module docstring)."""

    peer_id: str

    @property
    @abstractmethod
    def address(self) -> tuple[str, int]:
        """(advertised host, port) peers pass to `connect`."""

    @abstractmethod
    def connect(
        self, peer_id: str, host: str = "", port: int = 0, *, timeout_s: float = 10.0
    ) -> None:
        """Open both lanes to `peer_id` (a peer that connected to us needs no `connect`)."""

    @abstractmethod
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
        """Queue a frame; blocks only while the lane's send queue is full (up to timeout_s)."""

    @abstractmethod
    def recv(
        self, lane: Lane, *, timeout_s: float = DEFAULT_TIMEOUT_S, peer_id: str | None = None
    ) -> Message:
        """Next message on `lane` (from `peer_id` only, if given); WaitTimeoutError after timeout_s."""

    @abstractmethod
    def counters(self) -> dict[str, Any]:
        """Frames, bytes, pool and copy figures so far (also written to the trace on close)."""

    @abstractmethod
    def close(self) -> None:
        """Stop threads and close connections (idempotent)."""

    def to_device(self, msg: Message, device: torch.device | str) -> dict[str, torch.Tensor]:
        """A message's tensors copied to `device`, kept past its release (the TCP transport
        copies to CUDA on a receive stream; this copies in the caller's stream)."""
        return {name: t.to(device, copy=True) for name, t in msg.tensors.items()}

    def channel(
        self, peer_id: str, lane: Lane = Lane.ACTIVATION, *, timeout_s: float = DEFAULT_TIMEOUT_S
    ) -> Channel:
        return Channel(self, peer_id, lane, timeout_s=timeout_s)

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Channel:
    """Blocking point-to-point pipe to one peer on one lane (e.g. ring stage -> next stage).

    A lost peer is a PeerLostError that starts with `lost <peer>`, whatever the transport.
    """

    def __init__(self, transport: Transport, peer_id: str, lane: Lane, *, timeout_s: float) -> None:
        self.transport, self.peer_id, self.lane, self.timeout_s = (
            transport,
            peer_id,
            lane,
            timeout_s,
        )

    def send(
        self,
        kind: str,
        tensors: Mapping[str, torch.Tensor],
        *,
        meta: dict[str, Any] | None = None,
        routing: Routing | None = None,
        priority: int = Priority.FORWARD,
    ) -> None:
        """Send and wait until the bytes are handed to the network (tensors reusable after)."""
        try:
            ticket = self.transport.send(
                self.peer_id, self.lane, kind, tensors, meta=meta, routing=routing,
                priority=priority, timeout_s=self.timeout_s,
            )  # fmt: skip
            ticket.wait(self.timeout_s)
        except PeerLostError as exc:
            raise self._lost(f"sending {kind!r}", exc) from exc

    def recv(self, *, timeout_s: float | None = None) -> Message:
        try:
            return self.transport.recv(
                self.lane,
                timeout_s=self.timeout_s if timeout_s is None else timeout_s,
                peer_id=self.peer_id,
            )
        except PeerLostError as exc:
            raise self._lost("receiving", exc) from exc

    def _lost(self, what: str, exc: PeerLostError) -> PeerLostError:
        return PeerLostError(f"lost {self.peer_id} ({self.lane.value} lane) while {what}: {exc}")
