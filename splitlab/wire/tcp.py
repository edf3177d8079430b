"""TCP tensor transport: persistent authenticated connections, one socket per (peer, lane).

Sending: each connection has a priority queue (lowest value first, FIFO within a value) and a
sender thread. A frame (up to `inline_max_bytes`) on an idle connection is written straight from
the caller's thread, waiting for socket space up to `timeout_s` like a raw `sendall` (the sender
thread takes over whatever is left), so an uncontended lane pays no thread hand-off. Frames that
find the lane busy, and frames staged from CUDA, go through the queue, which is bounded
(`send_queue_frames`): `send` waits up to `timeout_s` for room, then raises WaitTimeoutError.
Set `inline_max_bytes=0` to always return at once and let the sender thread write.
Frames leave as one `sendmsg` of memoryviews of the header and the tensor storage (no copies).

Receiving is pulled by the caller: `recv` reads the next frame of a lane straight from a ready
socket into a pooled buffer (`recv_into`, no receive thread hand-off). The lane's own sockets,
kernel buffers, send queues and pool are the receive queue, so a lane that nobody drains
fills up and pushes back on its senders without touching the other lane. A closed or reset
peer raises PeerLostError naming it; every wait is bounded.

    .venv/bin/pytest tests/integration/test_wire_tcp.py -q
"""

from __future__ import annotations

import heapq
import itertools
import logging
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from splitlab.errors import PeerLostError, ProtocolError, WaitTimeoutError
from splitlab.telemetry.trace import Tracer
from splitlab.wire.auth import ReplayGuard, client_handshake, server_handshake
from splitlab.wire.base import DEFAULT_TIMEOUT_S, SENT, Message, Priority, SendTicket, Transport
from splitlab.wire.counters import WireCounters
from splitlab.wire.endpoint import WILDCARDS, listen
from splitlab.wire.errors import (
    FrameError,
    NonFiniteFrameError,
    PoolExhaustedError,
    TruncatedFrameError,
)
from splitlab.wire.frame import (
    MAX_HEADER_BYTES,
    PREFIX,
    FrameHeader,
    Lane,
    Routing,
    encode_frame,
    read_header,
    read_payload,
)
from splitlab.wire.pool import BufferPool, Lease
from splitlab.wire.staging import Pinned, Stager

log = logging.getLogger(__name__)

_CARRY = -(1 << 62)  # priority of a frame's unsent remainder: it must go out before anything


def send_views(
    sock: socket.socket, views: list[memoryview], *, nonblocking: bool
) -> list[memoryview]:
    """`sendmsg` until done (or until the socket would block); returns what is left unsent."""
    views = [v for v in views if v.nbytes]
    flags = socket.MSG_DONTWAIT if nonblocking else 0
    while views:
        try:
            n = sock.sendmsg(views, (), flags)
        except BlockingIOError:
            return views
        while n:
            if n >= views[0].nbytes:
                n -= views[0].nbytes
                views.pop(0)
            else:
                views[0] = views[0].cast("B")[n:]
                n = 0
    return views


@dataclass(eq=False)
class _Job:
    views: list[memoryview]
    nbytes: int
    ticket: SendTicket
    wait: Callable[[], None] | None = None
    staging: Lease | None = None

    def finish(self, error: BaseException | None = None) -> None:
        if self.staging is not None:
            self.staging.release()
        self.ticket.finish(error)


class _Conn:
    """One authenticated socket to one peer on one lane, with its sender queue and thread."""

    def __init__(self, peer: str, lane: Lane, sock: socket.socket, *, max_queued: int,
                 counters: WireCounters, on_lost: Callable[[_Conn], None]) -> None:  # fmt: skip
        self.peer, self.lane, self.sock = peer, lane, sock
        self.fd = sock.fileno()
        self.max_queued, self.counters, self.on_lost = max_queued, counters, on_lost
        self.scratch = bytearray(4 + MAX_HEADER_BYTES)
        self.prefix_view = memoryview(self.scratch)[:4]
        self.read_lock = threading.Lock()
        self.pending_header: FrameHeader | None = None  # header read, payload not (pool full)
        self.error: PeerLostError | ProtocolError | None = None
        self._cond = threading.Condition()
        self._heap: list[tuple[int, int, _Job]] = []
        self._seq = itertools.count()
        self._busy = False
        self._stopping = False
        self._thread: threading.Thread | None = None

    # ---- sending ----
    def submit(self, views: list[memoryview], nbytes: int, priority: int, *, timeout_s: float,
               inline: bool, wait: Callable[[], None] | None = None,
               staging: Lease | None = None) -> SendTicket:  # fmt: skip
        with self._cond:
            if self.error is not None:
                raise self.error
            if inline and not self._heap and not self._busy:
                self._busy = True
            else:
                return self._enqueue(
                    _Job(views, nbytes, SendTicket(), wait, staging), priority, timeout_s
                )
        try:
            rest = self._write_inline(views, timeout_s)
        except OSError as exc:
            with self._cond:
                self._busy = False
            raise self.lost(exc) from None
        with self._cond:
            self._busy = False
            if not rest:
                if self._heap:
                    self._cond.notify_all()
                self.counters.sent(self.lane, nbytes)
                return SENT
            job = _Job(rest, nbytes, SendTicket())
            heapq.heappush(self._heap, (_CARRY, next(self._seq), job))
            self._start_thread()
            self._cond.notify_all()
            return job.ticket

    def _write_inline(self, views: list[memoryview], timeout_s: float) -> list[memoryview]:
        """Write from the caller's thread, waiting for buffer space up to timeout_s (no thread
        hand-off, like a raw `sendall`); returns the unsent rest for the sender thread."""
        rest = send_views(self.sock, views, nonblocking=True)
        if rest:
            deadline = time.monotonic() + timeout_s
            poller = select.poll()
            poller.register(self.fd, select.POLLOUT)
            while rest:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                poller.poll(left * 1e3)
                rest = send_views(self.sock, rest, nonblocking=True)
        return rest

    def _enqueue(self, job: _Job, priority: int, timeout_s: float) -> SendTicket:
        deadline = time.monotonic() + timeout_s
        while len(self._heap) >= self.max_queued and self.error is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WaitTimeoutError(
                    f"send to {self.peer!r}: {self.lane.value} lane queue full "
                    f"({self.max_queued} frames) for timeout_s={timeout_s}"
                )
            self._cond.wait(left)
        if self.error is not None:
            raise self.error
        heapq.heappush(self._heap, (priority, next(self._seq), job))
        self._start_thread()
        self._cond.notify_all()
        return job.ticket

    def _start_thread(self) -> None:
        if self._thread is None:
            name = f"wire-send-{self.peer}-{self.lane.value}"
            self._thread = threading.Thread(target=self._run, name=name, daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            with self._cond:
                while (not self._heap or self._busy) and not self._stopping and self.error is None:
                    self._cond.wait()
                if self.error is not None or not self._heap:
                    return
                _, _, job = heapq.heappop(self._heap)
                self._busy = True
                self._cond.notify_all()
            try:
                if job.wait is not None:
                    job.wait()
                send_views(self.sock, job.views, nonblocking=False)
            except OSError as exc:
                job.finish(self.lost(exc))
                return
            except BaseException as exc:  # a failed device copy fails this frame only
                job.finish(exc)
            else:
                self.counters.sent(self.lane, job.nbytes)
                job.finish()
            with self._cond:
                self._busy = False
                self._cond.notify_all()

    # ---- failure and shutdown ----
    def lost(self, exc: BaseException) -> PeerLostError | ProtocolError:
        """Mark the connection dead (once), fail queued sends, and return the error to raise."""
        with self._cond:
            if self.error is None:
                if isinstance(exc, ProtocolError) and not isinstance(exc, TruncatedFrameError):
                    self.error = exc
                else:
                    self.error = PeerLostError(
                        f"peer {self.peer!r} lost on the {self.lane.value} lane: "
                        f"{type(exc).__name__}: {exc}"
                    )
                pending, self._heap = self._heap, []
                self._cond.notify_all()
            else:
                pending = []
            error = self.error
        for _, _, job in pending:
            job.finish(error)
        _shutdown(self.sock)
        self.on_lost(self)
        return error

    def drain(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while (self._heap or self._busy) and self.error is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self._cond.wait(left)

    def close(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        _shutdown(self.sock)
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._cond:
            pending, self._heap = self._heap, []
        for _, _, job in pending:
            job.finish(PeerLostError(f"transport closed before sending to {self.peer!r}"))
        self.sock.close()


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


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
        pinned: Pinned | str = Pinned.AUTO,
        tracer: Tracer | None = None,
    ) -> None:
        self.peer_id, self.session = peer_id, session
        self._key = key.encode() if isinstance(key, str) else bytes(key)
        self.bind_host = bind_host
        self.max_frame_bytes = min(max_frame_bytes or pool_bytes, pool_bytes)
        self.send_queue_frames, self.inline_max_bytes = send_queue_frames, inline_max_bytes
        self.check_finite, self.stall_timeout_s = check_finite, stall_timeout_s
        self.handshake_timeout_s = handshake_timeout_s
        self.tracer = tracer or Tracer.null()
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
        self._conns: dict[Lane, list[_Conn]] = {lane: [] for lane in Lane}
        self._lost: dict[str, str] = {}
        self._unreported: dict[Lane, list[str]] = {lane: [] for lane in Lane}
        self._wake = {lane: socket.socketpair() for lane in Lane}
        for r, _ in self._wake.values():
            r.setblocking(False)
        self._closed = False
        self._helpers: list[threading.Thread] = []
        self._listener, self.endpoint = listen(
            bind_host, port, advertise_host=advertise_host, broker_host=broker_host
        )
        self._listener.settimeout(0.25)
        self._accepter = threading.Thread(
            target=self._accept_loop, name=f"wire-accept-{peer_id}", daemon=True
        )
        self._accepter.start()

    @property
    def address(self) -> tuple[str, int]:
        return self.endpoint.address

    # ---- connections ----
    def connect(
        self, peer_id: str, host: str = "", port: int = 0, *, timeout_s: float = 10.0
    ) -> None:
        source = None if self.bind_host in WILDCARDS else (self.bind_host, 0)
        for lane in Lane:
            try:
                sock = socket.create_connection(
                    (host, port), timeout=timeout_s, source_address=source
                )
            except OSError as exc:
                raise PeerLostError(
                    f"cannot connect to peer {peer_id!r} at {host}:{port}: {exc}"
                ) from None
            try:
                client_handshake(sock, key=self._key, session=self.session, client_id=self.peer_id,
                                 server_id=peer_id, lane=lane.value)  # fmt: skip
            except (ProtocolError, OSError) as exc:
                sock.close()
                self._counters.add("auth_refused")
                if isinstance(exc, ProtocolError) and not isinstance(exc, TruncatedFrameError):
                    raise
                raise PeerLostError(
                    f"peer {peer_id!r} closed during the handshake: {exc}"
                ) from None
            self._register(peer_id, lane, sock)

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                sock, _ = self._listener.accept()
            except OSError:  # timeout tick, or the listener closed
                continue
            t = threading.Thread(target=self._serve_handshake, args=(sock,), daemon=True)
            t.start()
            self._helpers = [h for h in self._helpers if h.is_alive()] + [t]

    def _serve_handshake(self, sock: socket.socket) -> None:
        sock.settimeout(self.handshake_timeout_s)
        try:
            server_handshake(
                sock, key=self._key, session=self.session, server_id=self.peer_id, guard=self._guard,
                on_accept=lambda hello: self._register(hello.client_id, Lane(hello.lane), sock),
            )  # fmt: skip
        except (ProtocolError, OSError, ValueError) as exc:
            self._counters.add("auth_refused")
            log.debug("data connection not accepted: %s", exc)
            sock.close()

    def _register(self, peer: str, lane: Lane, sock: socket.socket) -> None:
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        secs = int(self.stall_timeout_s)
        usecs = int((self.stall_timeout_s - secs) * 1e6)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", secs, usecs))
        conn = _Conn(peer, lane, sock, max_queued=self.send_queue_frames,
                     counters=self._counters, on_lost=self._forget)  # fmt: skip
        with self._cond:
            if self._closed:
                sock.close()
                return
            self._conns[lane].append(conn)
            self._lost.pop(peer, None)
            self._cond.notify_all()
        self._counters.add("auth_ok")
        self._wake[lane][1].send(b"\0")

    def _forget(self, conn: _Conn) -> None:
        with self._cond:
            if conn in self._conns[conn.lane]:
                self._conns[conn.lane].remove(conn)
                why = str(conn.error)
                if not isinstance(conn.error, PeerLostError):
                    why = f"peer {conn.peer!r} dropped on the {conn.lane.value} lane: {why}"
                self._lost[conn.peer] = why
                self._unreported[conn.lane].append(why)
                self._counters.add("peers_lost")
                log.warning("%s", why)
        try:
            self._wake[conn.lane][1].send(b"\0")
        except OSError:
            pass

    def _send_conn(self, peer: str, lane: Lane, timeout_s: float) -> _Conn:
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
        conn = self._send_conn(peer_id, lane, timeout_s)
        wait = staging = None
        if any(t.is_cuda for t in tensors.values()):
            tensors, wait, staging = self._stager.to_host(tensors, timeout_s=timeout_s)
        header = FrameHeader(
            kind=kind, lane=lane, routing=routing or self._routing, src=self.peer_id,
            priority=int(priority), meta=meta or {},
        )  # fmt: skip
        try:
            views = encode_frame(header, tensors)
            nbytes = sum(v.nbytes for v in views)
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
        deadline = time.monotonic() + timeout_s
        wake = self._wake[lane][0]
        while True:
            conns = self._recv_conns(lane, peer_id)
            for conn in conns:
                if conn.read_lock.acquire(blocking=False):
                    try:
                        msg = self._read(conn, max(deadline - time.monotonic(), 0.0))
                    finally:
                        conn.read_lock.release()
                    if msg is not None:
                        return msg
            left = deadline - time.monotonic()
            if left <= 0:
                src = f" from {peer_id!r}" if peer_id else ""
                raise WaitTimeoutError(f"no {lane.value} frame{src} within timeout_s={timeout_s}")
            poller = select.poll()
            poller.register(wake, select.POLLIN)
            for conn in conns:
                poller.register(conn.fd, select.POLLIN)
            if any(fd == wake.fileno() for fd, _ in poller.poll(left * 1e3)):
                try:
                    wake.recv(4096)
                except BlockingIOError:
                    pass

    def _recv_conns(self, lane: Lane, peer: str | None) -> list[_Conn]:
        with self._cond:
            if self._closed:
                raise PeerLostError(f"transport of {self.peer_id!r} is closed")
            conns = [c for c in self._conns[lane] if peer is None or c.peer == peer]
            if peer is not None and not conns and peer in self._lost:
                raise PeerLostError(self._lost[peer])
            if peer is None and self._unreported[lane]:
                raise PeerLostError(self._unreported[lane].pop(0))
            if len(conns) > 1:  # rotate so one busy peer cannot starve the others
                self._conns[lane].append(self._conns[lane].pop(0))
            return conns

    def _read(self, conn: _Conn, timeout_s: float) -> Message | None:
        """One frame from `conn`, or None when nothing is waiting. Caller holds read_lock."""
        sock, header = conn.sock, conn.pending_header
        try:
            if header is None:
                try:
                    have = sock.recv_into(conn.prefix_view, 4, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    return None
                if have == 0:
                    raise TruncatedFrameError("prefix", 0, "connection closed by the peer")
                header = read_header(sock.recv_into, conn.scratch, max_frame_bytes=self.max_frame_bytes,
                                     have_bytes=have)  # fmt: skip
                conn.pending_header = header
            tensors, lease = read_payload(sock.recv_into, header, pool=self._pools[conn.lane.value],
                                          timeout_s=timeout_s, check_finite=self.check_finite)  # fmt: skip
        except PoolExhaustedError:
            raise  # the header stays pending; the next recv resumes with its payload
        except NonFiniteFrameError:
            conn.pending_header = None  # the frame was read whole: the stream is still in step
            raise
        except TruncatedFrameError as exc:
            raise self._lose(conn, exc) from None
        except FrameError as exc:
            self._lose(conn, exc)
            raise
        except OSError as exc:
            raise self._lose(conn, exc) from None
        conn.pending_header = None
        (hlen,) = PREFIX.unpack_from(conn.scratch)
        self._counters.received(conn.lane, 4 + hlen + lease.nbytes)
        return Message(header, tensors, lease, conn.peer)

    def _lose(self, conn: _Conn, exc: BaseException) -> BaseException:
        if isinstance(exc, BlockingIOError):
            exc = TimeoutError(f"stalled mid-frame for stall_timeout_s={self.stall_timeout_s}")
        error = conn.lost(exc)
        with self._cond:  # the caller sees this loss now; do not report it twice
            unreported = self._unreported[conn.lane]
            unreported[:] = [w for w in unreported if not w.startswith(f"peer {conn.peer!r}")]
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
        """Copy a message's tensors to `device` on a receive stream (see staging.py)."""
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
        for conn in conns:
            conn.drain(drain_timeout_s)
        with self._cond:
            self._closed = True
            conns = [c for cs in self._conns.values() for c in cs]
            for cs in self._conns.values():
                cs.clear()
            self._cond.notify_all()
        _shutdown(self._listener)
        self._listener.close()
        self._accepter.join(timeout=5)
        for conn in conns:
            conn.close()
        for t in self._helpers:
            t.join(timeout=5)
        for r, w in self._wake.values():
            w.send(b"\0")
            r.close()
            w.close()
        self._counters.emit(self.tracer, self._pools, transport="tcp", peer=self.peer_id)
