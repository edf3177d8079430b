"""One authenticated TCP socket to one peer on one lane: its send queue, sender thread and reader.

Sending: a frame on an idle connection is written straight from the caller's thread with
non-blocking `sendmsg` calls of [prefix+header, tensor views], as much as the socket takes now;
whatever is left unsent goes to the sender thread ahead of everything else. The caller never
waits for the peer to read: a 700 KB activation against a 128 KB receive buffer would otherwise
hold the owner until the worker finished its current body and read the frame (no overlap).
The sender thread writes with blocking calls bounded by `timeout_s` (SO_SNDTIMEO). Frames that find the lane busy, and frames staged
from CUDA, go through a priority queue (lowest value first, FIFO within a value; backward
before forward) bounded at `max_queued` frames: `submit` waits up to `timeout_s` for room, then
raises WaitTimeoutError. The sender thread starts on first use.

Receiving is the caller's (see tcp.py): the `FrameReader` here holds the read-ahead buffer and
`read_lock` makes one reader at a time. A send or read error marks the connection lost once,
fails its queued sends with PeerLostError naming the peer, and tells the transport; a peer that
closed between frames (`closed_by_peer`) is told apart from one lost mid-frame, and
`ended_quietly` finds such a peer without reading, so a lane nobody drains can let it go.

    .venv/bin/pytest tests/integration/test_wire_tcp.py -q
"""

from __future__ import annotations

import heapq
import itertools
import socket
import struct
import threading
import time
from collections.abc import Callable

from splitlab.errors import PeerLostError, ProtocolError, WaitTimeoutError
from splitlab.wire.base import SENT, SendTicket
from splitlab.wire.counters import WireCounters
from splitlab.wire.errors import PeerClosedError, TruncatedFrameError
from splitlab.wire.frame import Lane
from splitlab.wire.pool import Lease
from splitlab.wire.tcp_reader import FrameReader

_CARRY = -(1 << 62)  # priority of a frame's unsent remainder: it must go out before anything


def timeval(seconds: float) -> bytes:
    """A `struct timeval` for SO_RCVTIMEO / SO_SNDTIMEO (0 would mean "wait forever")."""
    secs = int(seconds)
    usecs = max(int((seconds - secs) * 1e6), 0 if secs else 1)
    return struct.pack("ll", secs, usecs)


def send_views(
    sock: socket.socket, views: list[memoryview], *, wait: bool = True
) -> list[memoryview]:
    """`sendmsg` until done or until the socket has no room (at once with `wait=False`, else
    after its send timeout); returns what is left unsent, in order."""
    flags = 0 if wait else socket.MSG_DONTWAIT
    while views:
        try:
            n = sock.sendmsg(views, [], flags)
        except BlockingIOError:  # no room: now (wait=False) or for SO_SNDTIMEO
            return views
        while n:
            first = views[0]
            if n >= first.nbytes:
                n -= first.nbytes
                views = views[1:]
            else:
                views = [first[n:], *views[1:]]
                n = 0
    return views


class _Job:
    __slots__ = ("views", "nbytes", "ticket", "wait", "staging")

    def __init__(self, views: list[memoryview], nbytes: int, ticket: SendTicket,
                 wait: Callable[[], None] | None = None, staging: Lease | None = None) -> None:  # fmt: skip
        self.views, self.nbytes, self.ticket = views, nbytes, ticket
        self.wait, self.staging = wait, staging

    def finish(self, error: BaseException | None = None) -> None:
        if self.staging is not None:
            self.staging.release()
        self.ticket.finish(error)


class Connection:
    """See module docstring."""

    def __init__(self, peer: str, lane: Lane, sock: socket.socket, *, max_queued: int,
                 reader: FrameReader, counters: WireCounters,
                 on_lost: Callable[[Connection], None]) -> None:  # fmt: skip
        self.peer, self.lane, self.sock, self.reader = peer, lane, sock, reader
        self.fd = sock.fileno()
        self.max_queued, self.counters, self.on_lost = max_queued, counters, on_lost
        self.read_lock = threading.Lock()
        self.error: PeerLostError | ProtocolError | None = None
        self.closed_by_peer = False  # the peer closed between frames: a goodbye, not a fault
        self._send_timeout_s: float | None = None
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
            if not inline or self._heap or self._busy:
                return self._enqueue(
                    _Job(views, nbytes, SendTicket(), wait, staging), priority, timeout_s
                )
            self._busy = True
        try:
            if timeout_s != self._send_timeout_s:  # what the sender thread waits per call
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval(timeout_s))
                self._send_timeout_s = timeout_s
            rest = send_views(self.sock, views, wait=False)
        except OSError as exc:
            with self._cond:
                self._busy = False
            raise self.lost(exc) from None
        with self._cond:
            self._busy = False
            if not rest:
                self.counters.sent(self.lane, nbytes)
                if self._heap:
                    self._cond.notify_all()
                return SENT
            job = _Job(rest, nbytes, SendTicket())
            heapq.heappush(self._heap, (_CARRY, next(self._seq), job))
            self._start_thread()
            self._cond.notify_all()
            return job.ticket

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
                rest = send_views(self.sock, job.views)
                while rest:  # the peer is slow, not gone: a close or reset ends this with OSError
                    rest = send_views(self.sock, rest)
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
    def ended_quietly(self) -> bool:
        """True when the peer closed between frames and nothing of it is left to read (looked
        at without waiting; False while another thread reads)."""
        if self.error is not None or not self.read_lock.acquire(blocking=False):
            return False
        try:
            if self.reader.pending is not None or self.reader.buffered:
                return False
            try:
                return self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
            except OSError:  # nothing yet (still open), or reset: left to the reader
                return False
        finally:
            self.read_lock.release()

    def lost(self, exc: BaseException) -> PeerLostError | ProtocolError:
        """Mark the connection dead (once), fail queued sends, and return the error to raise."""
        with self._cond:
            if self.error is None:
                if isinstance(exc, PeerClosedError):
                    self.closed_by_peer = True
                    self.error = PeerLostError(
                        f"peer {self.peer!r} closed the {self.lane.value} lane"
                    )
                elif isinstance(exc, ProtocolError) and not isinstance(exc, TruncatedFrameError):
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
        shutdown(self.sock)
        self.on_lost(self)
        return error

    def close_if_idle(self) -> None:
        """Close a lost connection's socket now if no send is in flight (the caller holds
        `read_lock`, so no read is either); else the last reference closes it. Waiting for the
        garbage collector instead would let a stream of bad peers hold one fd each: the stored
        error's traceback and the connection refer to each other."""
        with self._cond:
            if self.error is None or self._busy:
                return
        self.sock.close()  # no send starts once `error` is set, and the reader is the caller

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
        shutdown(self.sock)
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._cond:
            pending, self._heap = self._heap, []
        for _, _, job in pending:
            job.finish(PeerLostError(f"transport closed before sending to {self.peer!r}"))
        self.sock.close()


def shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
