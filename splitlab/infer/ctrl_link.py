"""Control-star connections: one per non-head stage to the head, timed, capped, authenticated.

`CtrlSocket` carries `splitlab.infer.ctrl` messages over a TCP socket that has passed the same
per-session HMAC handshake as the data links (the connection is accepted by the head's
listener as `ctrl-<stage>`). Every wait has a timeout; a closed or reset connection is a
`PeerLostError` naming the peer (on localhost a dead peer is an EOF or a reset, not a
timeout: both mean "peer state unknown, do not proceed"). `queue_pair` is the in-process twin
(the same codec, so the cap and validation are exercised without sockets).

    .venv/bin/pytest tests/unit/test_barrier_messages.py -q
"""

from __future__ import annotations

import queue
import socket

from splitlab.errors import PeerLostError, WaitTimeoutError
from splitlab.infer.ctrl import (
    MAX_CTRL_BYTES,
    CtrlMessage,
    decode,
    decode_body,
    decode_length,
    encode,
)

_PREFIX = 4
_RECV_BYTES = MAX_CTRL_BYTES + _PREFIX  # one read takes any whole message


class CtrlSocket:
    def __init__(self, sock: socket.socket, *, peer: str, timeout_s: float) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(timeout_s)
        self.sock, self.peer, self.timeout_s = sock, peer, timeout_s
        self._buf = bytearray()  # received bytes not yet decoded (a message may span reads)

    def send(self, msg: CtrlMessage) -> None:
        try:
            self.sock.sendall(encode(msg))
        except TimeoutError as exc:
            raise WaitTimeoutError(
                f"control send to {self.peer} blocked over {self.timeout_s} s"
            ) from exc
        except OSError as exc:
            raise PeerLostError(
                f"lost {self.peer} (control) while sending {msg.kind}: {exc}"
            ) from exc

    def _fill(self, n: int) -> None:
        """Read until the buffer holds >= n bytes (one recv usually brings a whole message)."""
        while len(self._buf) < n:
            chunk = self.sock.recv(_RECV_BYTES)
            if not chunk:
                raise PeerLostError(f"lost {self.peer} (control): connection closed")
            self._buf += chunk

    def recv(self, *, timeout_s: float | None = None) -> CtrlMessage:
        self.sock.settimeout(self.timeout_s if timeout_s is None else max(1e-3, timeout_s))
        try:
            self._fill(_PREFIX)
            n = decode_length(bytes(self._buf[:_PREFIX]))
            self._fill(_PREFIX + n)
        except TimeoutError as exc:
            raise WaitTimeoutError(
                f"nothing from {self.peer} (control) within {timeout_s or self.timeout_s:.1f} s"
            ) from exc
        except OSError as exc:
            raise PeerLostError(f"lost {self.peer} (control): {exc}") from exc
        body = bytes(self._buf[_PREFIX : _PREFIX + n])
        del self._buf[: _PREFIX + n]
        return decode_body(body)

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


_CLOSED = b""


class QueueCtrl:
    """One end of an in-process control connection (see `queue_pair`)."""

    def __init__(self, inbox: queue.Queue, outbox: queue.Queue, *, peer: str, timeout_s: float) -> None:  # fmt: skip
        self.inbox, self.outbox, self.peer, self.timeout_s = inbox, outbox, peer, timeout_s

    def send(self, msg: CtrlMessage) -> None:
        self.outbox.put(encode(msg))

    def recv(self, *, timeout_s: float | None = None) -> CtrlMessage:
        try:
            frame = self.inbox.get(timeout=self.timeout_s if timeout_s is None else timeout_s)
        except queue.Empty:
            raise WaitTimeoutError(f"nothing from {self.peer} (control) within {timeout_s or self.timeout_s:.1f} s") from None  # fmt: skip
        if frame == _CLOSED:
            self.inbox.put(_CLOSED)  # stays closed
            raise PeerLostError(f"lost {self.peer} (control): connection closed")
        return decode(frame)

    def close(self) -> None:
        self.outbox.put(_CLOSED)


def queue_pair(a: str, b: str, *, timeout_s: float) -> tuple[QueueCtrl, QueueCtrl]:
    """(end held by `a` talking to `b`, end held by `b` talking to `a`)."""
    ab, ba = queue.Queue(), queue.Queue()
    return QueueCtrl(ba, ab, peer=b, timeout_s=timeout_s), QueueCtrl(
        ab, ba, peer=a, timeout_s=timeout_s
    )
