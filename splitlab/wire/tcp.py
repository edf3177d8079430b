"""TCP tensor transport: persistent authenticated connections, one socket per (peer, lane).

Each process listens once; `connect` opens one socket per lane (or per lane asked for) to a
peer, retrying a peer that is still starting for up to `retry_s`, and authenticates it
(auth.py); accepted sockets are authenticated on a helper thread, at most `max_handshakes` at
once (wire/accept.py: beyond that a connection is closed at once), and `wait_connected` waits
for a peer that dials us. Sockets run with TCP_NODELAY, a receive timeout of
`stall_timeout_s` (a peer that stalls mid-frame is dropped) and a send timeout per call.
Sending (tcp_conn.py): a frame on an idle lane is written from the caller's thread with
non-blocking `sendmsg` of header and tensor views (no copies; what the socket does not take at
once goes to the sender thread, so `send` never waits for the peer to read); a busy lane
queues it by priority (backward before forward) in a bounded queue drained by a sender
thread. Frames up to `inline_max_bytes` may go inline; `inline_max_bytes=0` always queues, so
`send` returns at once. With a `delay` line (a testbed link's one-way delay, wire/delay.py)
every frame takes that path at its due time instead, in order. Receiving is pulled by the
caller: `recv` reads the next frame of a lane (from one peer, if asked) from a ready socket
through its read-ahead buffer into a pooled buffer (tcp_reader.py). Where the lane's last
wait ended within `spin_us` it first looks for one without sleeping for that long (below); then
it waits in that socket's `recv` when it is the only one to read and with `poll` otherwise. The lane's own sockets,
kernel buffers, send queues and pool are the receive queue, so a lane that nobody drains fills
up and pushes back on its senders without touching the other lanes. A closed or reset peer
raises PeerLostError naming it (one pending loss per peer and lane); every wait is bounded.
Peers that connect and leave never wedge a lane: a new connection lets go of the lane's
connections whose peers closed between frames, and waking a reader never waits.

Why spin: a thread woken from sleep pays the kernel's wake-up and runs its next tens of
microseconds on cold caches. A 4 KiB echo between two processes took ~250 us a round trip with
receivers that sleep at once and ~55-120 us with receivers that look for 100-200 us first (AMD
EPYC, 2 cores). A receive spins only where the last wait on its lane ended within the spin,
and a poll that outlasted it stops that: replies, barrier messages and streams spin; a stage
waiting on a peer's compute sleeps. The ring (`task=infer`) spins SPIN_US; fine-tuning does
not (`transport.spin_us=0`): its owners and workers poll their lanes while 4 processes compute
on 2 cores, and the default job ran 3-6% slower spinning (19% spinning on every receive).

    .venv/bin/pytest tests/integration/test_wire_tcp.py -q
"""

from __future__ import annotations

import logging
import select
import socket
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from splitlab.config.schema import MAX_SPIN_US
from splitlab.errors import PeerLostError, ProtocolError, WaitTimeoutError
from splitlab.telemetry.trace import Tracer
from splitlab.wire.accept import MAX_HANDSHAKES, Acceptor, Done
from splitlab.wire.auth import ReplayGuard, client_handshake, server_handshake
from splitlab.wire.base import DEFAULT_TIMEOUT_S, Message, Priority, SendTicket, Transport
from splitlab.wire.counters import WireCounters
from splitlab.wire.delay import DelayLine
from splitlab.wire.endpoint import WILDCARDS, listen
from splitlab.wire.errors import (
    FrameError,
    NonFiniteFrameError,
    PeerClosedError,
    PoolExhaustedError,
    TruncatedFrameError,
)
from splitlab.wire.frame import Lane, Routing, encode_parts
from splitlab.wire.pool import BufferPool
from splitlab.wire.staging import Pinned, Stager
from splitlab.wire.tcp_conn import Connection, timeval
from splitlab.wire.tcp_reader import WAIT_SLICE_S, FrameReader

log = logging.getLogger(__name__)

# Lost peers remembered so that a send or recv naming one fails at once with why; older
# losses (churned strangers with made-up ids, mostly) are forgotten, so they cannot pile up.
MAX_LOST_PEERS = 1024


class TcpTransport(Transport):
    """The TCP data plane of one process (see module docstring).

    `key` is the per-session secret from the control plane (bytes, or text encoded as UTF-8).
    """

    def __init__(
        self,
        peer_id: str,
        *,
        key: bytes | str,
        session: str,
        bind_host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        broker_host: str | None = None,
        pool_bytes: int = 256 << 20,
        max_frame_bytes: int | None = None,
        send_queue_frames: int = 64,
        inline_max_bytes: int = 64 << 20,
        check_finite: bool = False,
        stall_timeout_s: float = 60.0,
        handshake_timeout_s: float = 10.0,
        max_handshakes: int = MAX_HANDSHAKES,
        pinned: Pinned | str = Pinned.AUTO,
        tracer: Tracer | None = None,
        delay: DelayLine | None = None,
        spin_us: float = 0.0,
    ) -> None:
        self.peer_id, self.session = peer_id, session
        self._key = key.encode() if isinstance(key, str) else bytes(key)
        self.bind_host = bind_host
        self.max_frame_bytes = min(max_frame_bytes or pool_bytes, pool_bytes)
        self.send_queue_frames, self.inline_max_bytes = send_queue_frames, inline_max_bytes
        self.check_finite, self.stall_timeout_s = check_finite, stall_timeout_s
        self.handshake_timeout_s = handshake_timeout_s
        self.tracer = tracer or Tracer.null()
        self.delay = delay  # a testbed link's one-way delay, where the kernel cannot add it
        if not 0 <= spin_us <= MAX_SPIN_US:
            raise ValueError(f"spin_us must be in [0, {MAX_SPIN_US}], got {spin_us}")
        self.spin_s = spin_us / 1e6
        self._spin_pays = {lane: True for lane in Lane}  # the last wait ended within spin_s
        self._counters = WireCounters()
        self._stager = Stager(pinned=pinned, pool_bytes=pool_bytes, counters=self._counters)
        self._pools = {
            lane.value: BufferPool(
                pool_bytes=pool_bytes, name=lane.value, pin_memory=self._stager.pinned
            )
            for lane in Lane
        }
        self._routing = Routing(session=session)
        self._guard = ReplayGuard()
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._conns: dict[Lane, list[Connection]] = {lane: [] for lane in Lane}
        # Read without the lock on the hot path; rebuilt under it whenever connections change.
        self._send_to: dict[tuple[str, Lane], Connection] = {}
        self._by_lane: dict[Lane, tuple[Connection, ...]] = {lane: () for lane in Lane}
        self._from_peer: dict[tuple[str, Lane], tuple[Connection, ...]] = {}
        self._lost: dict[str, str] = {}
        self._unreported: dict[Lane, list[str]] = {lane: [] for lane in Lane}
        self._wake = {lane: socket.socketpair() for lane in Lane}
        for r, w in self._wake.values():
            r.setblocking(False)
            w.setblocking(False)  # a full pipe already holds a wake-up: never wait to add one
        self._closed = False
        listener, self.endpoint = listen(
            bind_host, port, advertise_host=advertise_host, broker_host=broker_host
        )
        self._acceptor = Acceptor(listener, self._serve_handshake, name=f"wire-{peer_id}",
                                  max_handshakes=max_handshakes,
                                  counters=self._counters).start()  # fmt: skip

    @property
    def address(self) -> tuple[str, int]:
        return self.endpoint.address

    # ---- connections ----
    def connect(self, peer_id: str, host: str = "", port: int = 0, *, timeout_s: float = 10.0,
                lanes: Iterable[Lane] | None = None, retry_s: float = 0.0) -> None:  # fmt: skip
        """Open one authenticated socket per lane to `peer_id` (every lane, or only `lanes`).

        A refused or unreachable address is retried with backoff for up to `retry_s` (a peer
        that is still starting); past that, WaitTimeoutError names the address.
        """
        source = None if self.bind_host in WILDCARDS else (self.bind_host, 0)
        for lane in tuple(Lane) if lanes is None else tuple(lanes):
            sock = self._dial(peer_id, host, port, source, timeout_s=timeout_s, retry_s=retry_s)
            try:
                client_handshake(sock, key=self._key, session=self.session, client_id=self.peer_id,
                                 server_id=peer_id, lane=lane.value, timeout_s=timeout_s)  # fmt: skip
            except (ProtocolError, OSError) as exc:
                sock.close()
                self._counters.add("auth_refused")
                if isinstance(exc, ProtocolError) and not isinstance(exc, TruncatedFrameError):
                    raise
                raise PeerLostError(
                    f"peer {peer_id!r} closed during the handshake: {exc}"
                ) from None
            self._register(peer_id, lane, sock)

    @staticmethod
    def _dial(peer_id: str, host: str, port: int, source: tuple[str, int] | None, *,
              timeout_s: float, retry_s: float) -> socket.socket:  # fmt: skip
        deadline = time.monotonic() + retry_s
        delay_s = 0.05
        while True:
            try:
                return socket.create_connection((host, port), timeout=timeout_s,
                                                source_address=source)  # fmt: skip
            except OSError as exc:
                if time.monotonic() + delay_s > deadline:
                    if retry_s <= 0:
                        raise PeerLostError(
                            f"cannot connect to peer {peer_id!r} at {host}:{port}: {exc}"
                        ) from None
                    raise WaitTimeoutError(
                        f"cannot connect to peer {peer_id!r} at {host}:{port} within "
                        f"retry_s={retry_s} ({exc}): is it started and bound to that address?"
                    ) from None
            time.sleep(delay_s)
            delay_s = min(1.0, delay_s * 1.5)

    def wait_connected(self, peer_id: str, lanes: Iterable[Lane], *, timeout_s: float) -> None:
        """Return once `peer_id` has a connection on each of `lanes` (it dialled us, or we it).

        Raises:
            WaitTimeoutError: a lane still has no connection after timeout_s (named).
            PeerLostError: the peer's connection was lost meanwhile.
        """
        deadline = time.monotonic() + timeout_s
        for lane in lanes:
            self._send_conn(peer_id, lane, max(deadline - time.monotonic(), 0.0))

    def _serve_handshake(self, sock: socket.socket, done: Done) -> None:
        """An accepted socket (on its own thread): authenticate it, then hand it to the lanes."""
        sock.settimeout(self.handshake_timeout_s)
        try:
            server_handshake(
                sock, key=self._key, session=self.session, server_id=self.peer_id, guard=self._guard,
                on_accept=lambda hello: self._register(hello.client_id, Lane(hello.lane), sock),
                timeout_s=self.handshake_timeout_s,
            )  # fmt: skip
            done()
        except (ProtocolError, OSError, ValueError) as exc:
            self._counters.add("auth_refused")
            log.debug("data connection not accepted: %s", exc)
            sock.close()

    def _register(self, peer: str, lane: Lane, sock: socket.socket) -> None:
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        slice_s = min(WAIT_SLICE_S, self.stall_timeout_s)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval(slice_s))
        reader = FrameReader(sock, max_frame_bytes=self.max_frame_bytes,
                             check_finite=self.check_finite,
                             stall_timeout_s=self.stall_timeout_s)  # fmt: skip
        conn = Connection(peer, lane, sock, max_queued=self.send_queue_frames, reader=reader,
                          counters=self._counters, on_lost=self._forget)  # fmt: skip
        for old in self._by_lane[lane]:  # peers gone from an undrained lane do not pile up
            if old.ended_quietly():
                old.lost(PeerClosedError("prefix", 0, "connection closed by the peer"))
                if old.read_lock.acquire(blocking=False):
                    try:
                        old.close_if_idle()
                    finally:
                        old.read_lock.release()
        with self._cond:
            if self._closed:
                sock.close()
                return
            self._conns[lane].append(conn)
            self._lost.pop(peer, None)
            self._reindex()
            self._cond.notify_all()
        self._counters.add("auth_ok")
        self._nudge(lane)

    def _nudge(self, lane: Lane) -> None:
        """Wake a `recv` waiting on `lane`; a pipe already full holds a wake-up, so drop this."""
        try:
            self._wake[lane][1].send(b"\0")
        except OSError:
            pass

    def _reindex(self) -> None:
        """Rebuild the lock-free lookups (caller holds the lock); the newest socket wins."""
        self._send_to = {(c.peer, c.lane): c for cs in self._conns.values() for c in cs}
        self._by_lane = {lane: tuple(cs) for lane, cs in self._conns.items()}
        from_peer: dict[tuple[str, Lane], list[Connection]] = {}
        for lane, cs in self._conns.items():
            for c in cs:
                from_peer.setdefault((c.peer, lane), []).append(c)
        self._from_peer = {k: tuple(v) for k, v in from_peer.items()}

    def _forget(self, conn: Connection) -> None:
        with self._cond:
            if conn in self._conns[conn.lane]:
                self._conns[conn.lane].remove(conn)
                self._reindex()
                why = str(conn.error)
                if not isinstance(conn.error, PeerLostError):
                    why = f"peer {conn.peer!r} dropped on the {conn.lane.value} lane: {why}"
                self._lost.pop(conn.peer, None)  # the newest loss goes last
                self._lost[conn.peer] = why
                if len(self._lost) > MAX_LOST_PEERS:
                    del self._lost[next(iter(self._lost))]
                self._drop_unreported(conn.lane, conn.peer)  # one pending loss per peer
                self._unreported[conn.lane].append(why)
                self._counters.add("peers_lost")
                # a close between frames is how a peer says goodbye at the end of a run
                log.log(logging.INFO if conn.closed_by_peer else logging.WARNING, "%s", why)
        self._nudge(conn.lane)

    def _drop_unreported(self, lane: Lane, peer: str) -> None:
        """Forget `peer`'s pending loss on `lane` (caller holds the lock)."""
        unreported = self._unreported[lane]
        unreported[:] = [w for w in unreported if not w.startswith(f"peer {peer!r}")]

    def _send_conn(self, peer: str, lane: Lane, timeout_s: float) -> Connection:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                if self._closed:
                    raise PeerLostError(f"transport of {self.peer_id!r} is closed")
                for conn in reversed(self._conns[lane]):
                    if conn.peer == peer and conn.error is None:
                        return conn
                if peer in self._lost:
                    raise PeerLostError(self._lost[peer])
                left = deadline - time.monotonic()
                if left <= 0:
                    raise WaitTimeoutError(
                        f"no {lane.value} connection to peer {peer!r} within timeout_s={timeout_s}; "
                        "call connect() or wait for the peer to connect"
                    )
                self._cond.wait(left)

    # ---- data ----
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
        args = (peer_id, lane, kind, tensors, meta, routing, priority, timeout_s)
        if self.delay is not None:
            return self.delay.submit((peer_id, lane), peer_id, lambda: self._send(*args),
                                     timeout_s=timeout_s)  # fmt: skip
        return self._send(*args)

    def _send(self, peer_id: str, lane: Lane, kind: str, tensors: Mapping[str, torch.Tensor],
              meta: dict[str, Any] | None, routing: Routing | None, priority: int,
              timeout_s: float) -> SendTicket:  # fmt: skip
        conn = self._send_to.get((peer_id, lane))
        if conn is None or conn.error is not None:
            conn = self._send_conn(peer_id, lane, timeout_s)
        wait = staging = None
        for t in tensors.values():
            if t.is_cuda:
                tensors, wait, staging = self._stager.to_host(tensors, timeout_s=timeout_s)
                break
        try:
            views = encode_parts(kind, lane, routing or self._routing, self.peer_id, int(priority),
                                 meta, tensors)  # fmt: skip
            nbytes = 0
            for v in views:
                nbytes += v.nbytes
            inline = wait is None and nbytes <= self.inline_max_bytes
            return conn.submit(views, nbytes, int(priority), timeout_s=timeout_s, inline=inline,
                               wait=wait, staging=staging)  # fmt: skip
        except BaseException:
            if staging is not None:
                staging.release()
            raise

    def recv(
        self, lane: Lane, *, timeout_s: float = DEFAULT_TIMEOUT_S, peer_id: str | None = None
    ) -> Message:
        start = time.monotonic()
        deadline = start + timeout_s
        # Look once without waiting. Then, if the last wait on this lane ended within spin_s,
        # look again and again without sleeping for spin_s: a frame that comes meanwhile is
        # read by a thread that never slept (no wake-up, warm caches); waits longer than
        # that (a peer computing) sleep at once and leave the CPU to whoever computes.
        # Sleeping, the only socket to read (the lane's, or the asked peer's on it) is
        # waited on in its recv, one slice at a time (no poll, no wake-up hand-off); a peer
        # connecting meanwhile is seen within a slice.
        spin_until = start + self.spin_s if self._spin_pays[lane] else start
        looked = False
        while True:
            conns = self._recv_conns(lane, peer_id)
            now = time.monotonic()
            spinning = not looked or now < spin_until
            block = not spinning and len(conns) == 1 and deadline - now > WAIT_SLICE_S
            for conn in conns:
                if conn.read_lock.acquire(blocking=False):
                    try:
                        msg = self._read(conn, deadline, block)
                    finally:
                        conn.read_lock.release()
                    if msg is not None:
                        if looked:  # it was waited for: would a spin have caught it?
                            self._spin_pays[lane] = time.monotonic() - start <= self.spin_s
                        return msg
                    if block:
                        break
            else:
                block = False
            looked = True
            left = deadline - time.monotonic()
            if left <= 0:
                if timeout_s > self.spin_s:  # a poll that outlasted the spin: it did not pay
                    self._spin_pays[lane] = False
                src = f" from {peer_id!r}" if peer_id else ""
                raise WaitTimeoutError(f"no {lane.value} frame{src} within timeout_s={timeout_s}")
            if not block and not spinning:
                self._wait_readable(lane, conns, left)

    def _wait_readable(self, lane: Lane, conns: tuple[Connection, ...], left_s: float) -> None:
        """Sleep until a socket of `conns` is readable or the lane's connections change."""
        wake = self._wake[lane][0]
        poller = select.poll()
        poller.register(wake, select.POLLIN)
        for conn in conns:
            if conn.reader.buffered:
                return  # another reader left a frame in the read-ahead buffer: look again
            poller.register(conn.fd, select.POLLIN)
        for fd, _ in poller.poll(left_s * 1e3):
            if fd == wake.fileno():
                try:
                    wake.recv(4096)
                except BlockingIOError:
                    pass

    def _recv_conns(self, lane: Lane, peer: str | None) -> tuple[Connection, ...]:
        if peer is not None:  # one peer's sockets on the lane, whatever else the lane holds
            conns = self._from_peer.get((peer, lane))
            if conns is None or self._closed:
                return self._recv_conns_slow(lane, peer)
            return conns
        conns = self._by_lane[lane]
        if self._closed or self._unreported[lane] or len(conns) > 1:
            return self._recv_conns_slow(lane, peer)
        return conns

    def _recv_conns_slow(self, lane: Lane, peer: str | None) -> tuple[Connection, ...]:
        with self._cond:
            if self._closed:
                raise PeerLostError(f"transport of {self.peer_id!r} is closed")
            conns = tuple(c for c in self._conns[lane] if peer is None or c.peer == peer)
            if peer is not None and not conns and peer in self._lost:
                raise PeerLostError(self._lost[peer])
            if peer is None and self._unreported[lane]:
                raise PeerLostError(self._unreported[lane].pop(0))
            if len(self._conns[lane]) > 1:  # rotate so one busy peer cannot starve the others
                self._conns[lane].append(self._conns[lane].pop(0))
                self._reindex()
            return conns

    def _read(self, conn: Connection, deadline: float, block: bool) -> Message | None:
        """One frame from `conn`, or None when nothing came (at once, or within a slice when
        `block`). Caller holds read_lock."""
        try:
            got = conn.reader.read(self._pools[conn.lane.value], block=block,
                                   timeout_s=max(deadline - time.monotonic(), 0.0))  # fmt: skip
        except (PoolExhaustedError, NonFiniteFrameError):
            raise  # pool full: the header stays pending; non-finite: the stream is in step
        except TruncatedFrameError as exc:
            raise self._lose(conn, exc) from None
        except FrameError as exc:
            self._lose(conn, exc)
            raise
        except OSError as exc:
            raise self._lose(conn, exc) from None
        if got is None:
            return None
        header, tensors, lease, nbytes = got
        self._counters.received(conn.lane, nbytes)
        if conn.reader.last_stream is not None:  # a frame timed as it crossed the link
            streamed, ms = conn.reader.last_stream
            self._counters.add(f"rx.{conn.peer}.stream_bytes", streamed)
            self._counters.add(f"rx.{conn.peer}.stream_ms", ms)
            self._counters.add(f"rx.{conn.peer}.stream_frames")
            if ms > 0:  # per frame: a starved sender slows one, a batched receive path speeds one
                rate = streamed * 8 / (ms * 1e3)
                self._counters.sample(f"rx.{conn.peer}.stream_median_mbit", rate)
                self._counters.peak(f"rx.{conn.peer}.stream_peak_mbit", rate)
        return Message(header, tensors, lease, conn.peer)

    def _lose(self, conn: Connection, exc: BaseException) -> BaseException:
        if isinstance(exc, BlockingIOError):
            exc = TimeoutError(f"stalled mid-frame for stall_timeout_s={self.stall_timeout_s}")
        error = conn.lost(exc)
        conn.close_if_idle()  # the caller holds its read lock
        with self._cond:  # the caller sees this loss now; do not report it twice
            self._drop_unreported(conn.lane, conn.peer)
        return error

    def connections(self) -> list[dict[str, Any]]:
        """Live connections: peer, lane, local and remote (host, port)."""
        with self._cond:
            conns = [c for cs in self._conns.values() for c in cs]
        out = []
        for c in conns:
            try:
                local, remote = c.sock.getsockname()[:2], c.sock.getpeername()[:2]
            except OSError:
                continue
            out.append({"peer": c.peer, "lane": c.lane, "local": local, "remote": remote})
        return out

    def to_device(self, msg: Message, device: torch.device | str) -> dict[str, torch.Tensor]:
        """Copy a message's tensors to a CUDA `device` on a receive stream (see staging.py);
        elsewhere, copied like any transport's."""
        if torch.device(device).type != "cuda":
            return super().to_device(msg, device)
        return self._stager.to_device(msg.tensors, msg.lease, device)

    def counters(self) -> dict[str, Any]:
        pools = dict(self._pools)
        if self._stager._send_pool is not None:
            pools["d2h"] = self._stager._send_pool
        return self._counters.snapshot(pools)

    def close(self, *, drain_timeout_s: float = 5.0) -> None:
        """Send what is queued (up to drain_timeout_s), then stop threads and close sockets."""
        with self._cond:
            if self._closed:
                return
            conns = [c for cs in self._conns.values() for c in cs]
        if self.delay is not None:
            self.delay.close(drain_timeout_s=drain_timeout_s)
        for conn in conns:
            conn.drain(drain_timeout_s)
        with self._cond:
            self._closed = True
            conns = [c for cs in self._conns.values() for c in cs]
            for cs in self._conns.values():
                cs.clear()
            self._cond.notify_all()
        self._acceptor.close()
        for conn in conns:
            conn.close()
        self._acceptor.join()
        for lane, (r, w) in self._wake.items():
            self._nudge(lane)
            r.close()
            w.close()
        delay = self.delay.describe() if self.delay is not None else None
        self._counters.emit(self.tracer, self._pools, transport="tcp", peer=self.peer_id,
                            delay=delay)  # fmt: skip
