"""The ring's connections over the one wire: hidden states, KV migration, the control star.

Every stage owns one transport named `stage-<i>` (TCP across processes, in-process in one)
and reaches its neighbours and the head through channels on three lanes:

    activation  stage i -> i+1: hello, start, hidden, token, stop, abort     up / down
    kv          stage i <-> i+1: KV of migrating blocks                      kv_prev / kv_next
    control     stage i <-> head: the barrier's messages                     ctrl / ctrls

Over TCP (`stage_transport`, then `link_tcp_ring`) each stage dials its successor (activation;
kv with a window) and, with a window, the head (control), then waits for the peers that dial
it; a two-stage ring shares one activation connection both ways. With `bypass` (a stage left
without blocks is skipped, `splitlab.infer.route`) every stage also holds an activation
channel to every other stage (`peers`): stage i dials each j > i + 1 (the tail's connection to
the head serves the head -> tail pair), so a skip needs no new connection mid-run. A barrier message
(`splitlab.control.messages`) travels as one frame, its kind and its fields as the header's
meta, no tensors: `ctrl_frame`/`ctrl_message` are the only translation between the two.

    .venv/bin/pytest tests/unit/test_infer_ring_wire.py tests/integration/test_ring_tcp.py -q
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from splitlab.config.schema import SPIN_US
from splitlab.control.messages import BarrierMessage, frame_meta, from_frame
from splitlab.errors import ConfigError, ProtocolError
from splitlab.telemetry.trace import Tracer
from splitlab.wire.base import Channel, Transport
from splitlab.wire.delay import DelayLine
from splitlab.wire.frame import FrameHeader, Lane
from splitlab.wire.session_key import session_key
from splitlab.wire.tcp import TcpTransport


def stage_peer(index: int) -> str:
    """The transport id of stage `index`."""
    return f"stage-{index}"


def ctrl_frame(msg: BarrierMessage) -> tuple[str, dict[str, Any]]:
    """(frame kind, frame meta) of a barrier message."""
    return msg.KIND.value, frame_meta(msg)


def ctrl_message(header: FrameHeader) -> BarrierMessage:
    """The barrier message a control-lane frame carries (ProtocolError names a bad field, or
    a frame that carries tensors: a barrier message is its kind and meta only)."""
    if header.tensors:
        names = [s.name for s in header.tensors]
        raise ProtocolError(f"{header.kind} message on the control lane carries tensors {names}")
    msg = from_frame(header, {})
    if not isinstance(msg, BarrierMessage):
        raise ProtocolError(f"{header.kind} message on the control lane: not a barrier message")
    return msg


class CtrlChannel:
    """Control messages to and from one peer over a channel on the control lane."""

    def __init__(self, channel: Channel) -> None:
        self.channel, self.peer = channel, channel.peer_id

    def send(self, msg: BarrierMessage) -> None:
        kind, meta = ctrl_frame(msg)
        self.channel.send(kind, {}, meta=meta)

    def recv(self, *, timeout_s: float | None = None) -> BarrierMessage:
        with self.channel.recv(timeout_s=timeout_s) as frame:
            return ctrl_message(frame.header)


@dataclass
class RingLinks:
    """One stage's channels; None (or empty) where the stage has no such peer."""

    up: Channel | None = None
    down: Channel | None = None
    kv_prev: Channel | None = None
    kv_next: Channel | None = None
    ctrl: CtrlChannel | None = None  # a stage's line to the head
    ctrls: dict[int, CtrlChannel] = field(default_factory=dict)  # the head's lines, by stage
    peers: dict[int, Channel] = field(default_factory=dict)  # bypass: activation, every stage


def ring_links(transport: Transport, *, stage: int, num_stages: int, window: int,
               timeout_s: float, ctrl_timeout_s: float, bypass: bool = False) -> RingLinks:  # fmt: skip
    """Stage `stage`'s channels on `transport` (the control and KV ones only with a window,
    `peers` only with `bypass`)."""
    n = num_stages
    if n < 2:
        return RingLinks()

    def chan(peer: int, lane: Lane, wait_s: float) -> Channel:
        return transport.channel(stage_peer(peer), lane, timeout_s=wait_s)

    links = RingLinks(up=chan((stage - 1) % n, Lane.ACTIVATION, timeout_s),
                      down=chan((stage + 1) % n, Lane.ACTIVATION, timeout_s))  # fmt: skip
    if window > 0:
        if stage > 0:
            links.kv_prev = chan(stage - 1, Lane.KV, ctrl_timeout_s)
            links.ctrl = CtrlChannel(chan(0, Lane.CONTROL, ctrl_timeout_s))
        else:
            links.ctrls = {
                i: CtrlChannel(chan(i, Lane.CONTROL, ctrl_timeout_s)) for i in range(1, n)
            }
        if stage < n - 1:
            links.kv_next = chan(stage + 1, Lane.KV, ctrl_timeout_s)
    if bypass:
        links.peers = {j: chan(j, Lane.ACTIVATION, timeout_s) for j in range(n) if j != stage}
    return links


def bypass_dials(stage: int, num_stages: int) -> list[int]:
    """The stages `stage` dials on the activation lane beyond its successor (`bypass`)."""
    return [j for j in range(stage + 2, num_stages) if (stage, j) != (0, num_stages - 1)]


def stage_transport(*, stage: int, bind_host: str, base_port: int, session: str,
                    timeout_s: float, tracer: Tracer | None = None,
                    delay: DelayLine | None = None, spin_us: float = SPIN_US) -> TcpTransport:  # fmt: skip
    """Stage `stage`'s TCP transport on `bind_host:base_port + stage`, keyed from the
    environment (`splitlab.wire.session_key`); bind it before loading anything, so a
    stale port fails fast. `timeout_s` also bounds a peer stalling mid-frame; the transport
    writes its counters to `tracer` and sends through `delay` (a testbed path's delay line).

    Raises:
        ConfigError: the port is taken, or the key is missing.
    """
    port = base_port + stage
    try:
        return TcpTransport(stage_peer(stage), key=session_key(), session=session,
                            bind_host=bind_host, port=port, stall_timeout_s=timeout_s,
                            tracer=tracer, delay=delay, spin_us=spin_us)  # fmt: skip
    except OSError as exc:
        raise ConfigError(
            f"cannot bind {bind_host}:{port} ({exc}): a stale stage may still hold the port"
        ) from exc


def link_tcp_ring(transport: TcpTransport, *, stage: int, hosts: Sequence[str], base_port: int,
                  ctrl_host: str, window: int, connect_timeout_s: float, timeout_s: float,
                  ctrl_timeout_s: float, bypass: bool = False) -> RingLinks:  # fmt: skip
    """Connect stage `stage` to the ring (and the control star) and return its channels."""
    connect_tcp_ring(transport, stage=stage, hosts=hosts, base_port=base_port,
                     ctrl_host=ctrl_host, window=window, connect_timeout_s=connect_timeout_s,
                     bypass=bypass)  # fmt: skip
    return ring_links(transport, stage=stage, num_stages=len(hosts), window=window,
                      timeout_s=timeout_s, ctrl_timeout_s=ctrl_timeout_s, bypass=bypass)  # fmt: skip


def connect_tcp_ring(transport: TcpTransport, *, stage: int, hosts: Sequence[str], base_port: int,
                     ctrl_host: str, window: int, connect_timeout_s: float,
                     bypass: bool = False) -> None:  # fmt: skip
    """Dial this stage's successor (and the head), then wait until the peers that dial this
    stage have; stage i listens on `base_port + i` of `hosts[i]`, the head on `ctrl_host`.

    Raises:
        WaitTimeoutError: a peer did not answer or dial within connect_timeout_s (named).
    """
    n = len(hosts)
    if n < 2:
        return
    deadline = time.monotonic() + connect_timeout_s
    nxt, prev = (stage + 1) % n, (stage - 1) % n
    to_next = [] if n == 2 and stage == 1 else [Lane.ACTIVATION]  # two stages: one connection
    if window > 0 and stage < n - 1:
        to_next.append(Lane.KV)
    if to_next:
        transport.connect(stage_peer(nxt), hosts[nxt], base_port + nxt, lanes=to_next,
                          retry_s=connect_timeout_s)  # fmt: skip
    if window > 0 and stage > 0:
        transport.connect(stage_peer(0), ctrl_host, base_port, lanes=[Lane.CONTROL],
                          retry_s=max(deadline - time.monotonic(), 0.0))  # fmt: skip
    for j in bypass_dials(stage, n) if bypass else []:
        transport.connect(stage_peer(j), hosts[j], base_port + j, lanes=[Lane.ACTIVATION],
                          retry_s=max(deadline - time.monotonic(), 0.0))  # fmt: skip
    waits = [(prev, [Lane.ACTIVATION, *([Lane.KV] if window > 0 and stage > 0 else [])])]
    if bypass:
        waits += [(i, [Lane.ACTIVATION]) for i in range(stage) if stage in bypass_dials(i, n)]
    if window > 0 and stage == 0:
        waits += [(i, [Lane.CONTROL]) for i in range(1, n)]
    for peer, lanes in waits:
        transport.wait_connected(stage_peer(peer), lanes,
                                 timeout_s=max(deadline - time.monotonic(), 0.0))  # fmt: skip


def link_addresses(transport: TcpTransport, *, stage: int, num_stages: int) -> dict[str, str]:
    """{"up": host:port, "down": host:port}: the remote ends of the ring's activation sockets."""
    n = num_stages
    conns = transport.connections()
    remote = {c["peer"]: c["remote"] for c in conns if c["lane"] is Lane.ACTIVATION}
    out = {}
    for name, peer in (("up", (stage - 1) % n), ("down", (stage + 1) % n)):
        host, port = remote.get(stage_peer(peer), ("?", 0))
        out[name] = f"{host}:{port}"
    return out
