"""Frame reader of one TCP socket: a read-ahead buffer for prefix and header, payload in place.

One `recv_into` fills a small read-ahead buffer, so a small frame (prefix, JSON header and
tensor bytes) usually arrives in one system call and several back-to-back frames in one call
between them. The header is validated from the buffer before any allocation; then the tensor
bytes already buffered are copied into pooled buffers and the rest is received straight into
them (`recv_into`, no intermediate copy). The socket's receive timeout (SO_RCVTIMEO) is a short
`WAIT_SLICE_S`: the first read of a frame either does not block (the caller waits on many
sockets with poll) or blocks one slice at most (the caller waits on this socket alone and
re-checks its deadline and the lane between slices); once a frame has started, reads block
slice after slice until `stall_timeout_s` passes without a byte, so a peer that stalls
mid-frame surfaces as an error rather than a hang.

A frame whose payload still has to cross the link when its header is read is timed
(`last_stream`): the bytes that arrive while the reader waits (the rest of the payload less
what the kernel had already queued, FIONREAD) over that wait. On a shaped link the sender has
the whole frame in flight, so this is the link's rate; frames under `STREAM_MIN_BYTES` (or
mostly queued already) are not timed, since a token bucket's burst passes them at line speed.
Nor is a frame that found `STREAM_MIN_BYTES` or more already queued: its reader was behind the
link (busy computing), and on a busy host so was the kernel's receive path, whose backlog
FIONREAD does not count and which then arrives at memory speed. On a 20 Mbit/s testbed path
such frames (225-398 KB queued) read 20.1-26.0 Mbit/s, while frames that found at most 123 KB
queued read 19.09-19.16, the payload's share of the rate at MTU 1500 (0.956).

    .venv/bin/pytest tests/unit/test_wire_reader.py -q
"""

from __future__ import annotations

import array
import fcntl
import socket
import termios
import time

import torch

from splitlab.wire.errors import FrameError, PeerClosedError, TruncatedFrameError
from splitlab.wire.frame import MAX_HEADER_BYTES, PREFIX, FrameHeader, check_payload, parse_header
from splitlab.wire.pool import BufferPool, Lease

READ_AHEAD_BYTES = 4 + MAX_HEADER_BYTES + (16 << 10)  # a largest header, or several small frames
WAIT_SLICE_S = 0.02  # SO_RCVTIMEO of data sockets: how often a blocked reader looks up
STREAM_MIN_BYTES = 128 << 10  # time a frame's arrival only when this much crosses the link
_WAITALL = socket.MSG_WAITALL


def queued_bytes(sock: socket.socket) -> int:
    """Bytes the kernel has received on `sock` that no read has taken yet (FIONREAD)."""
    out = array.array("i", [0])
    fcntl.ioctl(sock.fileno(), termios.FIONREAD, out, True)
    return int(out[0])


class FrameReader:
    """Reads whole, validated frames from `sock` (see module docstring). Not thread-safe: the
    owner serialises calls (the transport holds the connection's read lock)."""

    def __init__(self, sock: socket.socket, *, max_frame_bytes: int, check_finite: bool,
                 stall_timeout_s: float) -> None:  # fmt: skip
        self.sock, self.stall_timeout_s = sock, stall_timeout_s
        self.max_frame_bytes, self.check_finite = max_frame_bytes, check_finite
        self._buf = bytearray(READ_AHEAD_BYTES)
        self._view = memoryview(self._buf)
        self._start = self._end = 0  # unread bytes are _buf[_start:_end]
        self.pending: FrameHeader | None = None  # header read, payload not yet (pool was full)
        self.pending_bytes = 0  # wire size of the pending frame's prefix and header
        self.last_stream: tuple[int, float] | None = None  # the last read's (bytes, ms) timed

    @property
    def buffered(self) -> int:
        """Bytes received but not yet consumed (a socket poll cannot see these)."""
        return self._end - self._start

    def read(self, pool: BufferPool, *, timeout_s: float, block: bool = False) -> tuple[FrameHeader, dict[str, torch.Tensor], Lease, int] | None:  # fmt: skip
        """The next frame as (header, tensors, lease, wire bytes), or None if none has started
        (at once, or within one `WAIT_SLICE_S` when `block`).

        Raises FrameError (the stream is out of step: drop the connection), NonFiniteFrameError
        (the frame was read whole, the stream is still in step), PoolExhaustedError (the header
        stays pending and the next call resumes with its payload), PeerClosedError (the peer
        closed between frames), TruncatedFrameError or OSError (the peer closed mid-frame, reset
        or stalled past the receive timeout).
        """
        header = self.pending
        if header is None:
            header = self._header(block)
            if header is None:
                return None
        specs = header.tensors
        lease = pool.lease([s.key for s in specs], timeout_s=timeout_s)
        self.last_stream = None
        payload, has_bool = 0, False
        for spec in specs:
            payload += spec.nbytes
            has_bool = has_bool or spec.dtype == "bool"
        to_come = payload - (self._end - self._start)
        timed = to_come >= STREAM_MIN_BYTES
        if timed:
            started_s = time.perf_counter()
            queued = queued_bytes(self.sock)
            to_come -= queued
            timed = queued < STREAM_MIN_BYTES and to_come >= STREAM_MIN_BYTES
        try:
            tensors = {}
            for spec, buf in zip(specs, lease.buffers, strict=True):
                n = spec.nbytes
                if n:
                    at = self._start
                    if self._end - at >= n:  # the whole tensor came with the header (a small frame)
                        buf.view[:] = self._view[at : at + n]
                        self._start = at + n
                    else:
                        self._payload_into(buf.view, spec.name)
                tensors[spec.name] = buf.tensor
            if self._start == self._end:
                self._start = self._end = 0
            self.pending = None  # the frame is consumed whole: the stream is in step again
            if timed:
                self.last_stream = (to_come, (time.perf_counter() - started_s) * 1e3)
            if self.check_finite or has_bool:  # else there is nothing to check
                check_payload(tensors, check_finite=self.check_finite)
        except BaseException:
            lease.release()
            raise
        return header, tensors, lease, self.pending_bytes + payload

    def _header(self, block: bool) -> FrameHeader | None:
        started = self._end > self._start
        if self._end - self._start < 4 and not self._fill(4, started=started, block=block):
            return None
        (n,) = PREFIX.unpack_from(self._buf, self._start)
        if not 0 < n <= MAX_HEADER_BYTES:
            raise FrameError("header_bytes", n, f"must be 1..{MAX_HEADER_BYTES}")
        if self._end - self._start < 4 + n:
            self._fill(4 + n, started=True, block=True)
        at = self._start + 4
        header = parse_header(self._view[at : at + n], max_frame_bytes=self.max_frame_bytes)
        self._consume(4 + n)
        self.pending, self.pending_bytes = header, 4 + n
        return header

    def _fill(self, need: int, *, started: bool, block: bool) -> bool:
        """Buffer at least `need` unread bytes; False if nothing came and not `started`."""
        if self._start + need > len(self._buf):  # compact: move the unread tail to the front
            have = self._end - self._start
            self._buf[:have] = self._view[self._start : self._end]
            self._start, self._end = 0, have
        flags = 0 if block or started else socket.MSG_DONTWAIT
        last = None
        while self._end - self._start < need:
            try:
                k = self.sock.recv_into(self._view[self._end :], len(self._buf) - self._end, flags)
            except BlockingIOError:
                if not started:
                    return False
                last = self._check_stall(last)
                continue
            if not k:
                if self._end == self._start:  # at a frame boundary: the peer said goodbye
                    raise PeerClosedError("prefix", 0, "connection closed by the peer")
                what = "prefix" if self._end - self._start < 4 else "header"
                raise TruncatedFrameError(
                    what, self._end - self._start, "connection closed by the peer"
                )
            self._end += k
            started, flags, last = True, 0, None
        return True

    def _check_stall(self, last: float | None) -> float:
        """Called when a slice passed mid-frame with no byte; raises past `stall_timeout_s`."""
        now = time.monotonic()
        if last is None:
            return now - WAIT_SLICE_S
        if now - last >= self.stall_timeout_s:
            raise TimeoutError(f"stalled mid-frame for stall_timeout_s={self.stall_timeout_s}")
        return last

    def _consume(self, n: int) -> None:
        self._start += n
        if self._start == self._end:
            self._start = self._end = 0

    def _payload_into(self, view: memoryview, name: str) -> None:
        n = len(view)
        got = min(self._end - self._start, n)
        if got:
            view[:got] = self._view[self._start : self._start + got]
            self._consume(got)
        last = None
        while got < n:  # the rest goes straight from the socket into the pooled buffer
            try:
                k = self.sock.recv_into(view[got:], n - got, _WAITALL)
            except BlockingIOError:
                last = self._check_stall(last)
                continue
            last = None
            if not k:
                raise TruncatedFrameError(
                    f"tensors.{name}", got, f"stream ended after {got} of {n} bytes"
                )
            got += k
