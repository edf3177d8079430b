"""Data-connection handshake: HMAC-SHA256 challenge-response over both sides' nonces.

The per-session key comes from the control plane and never crosses the data connection. The
client says hello (session, its id, lane, client nonce); the server refuses a wrong session or
a client nonce it has already seen (a replay), else answers with its id and nonce; the client
answers with its proof; the server checks it (refusing a wrong key, logged) and accepts with
its own proof, which the client checks in turn.
Both proofs cover the session, both ids, the lane and both nonces, with distinct role labels,
so no proof can be reused for another connection or for the other side. `session_key` reads
the key a launcher hands its children in the environment (never on argv).

Before the proof is checked a peer is a stranger: every handshake frame is one header of at
most `MAX_HANDSHAKE_HEADER_BYTES` with no payload, and `timeout_s` bounds the whole exchange
(not each read), so a peer trickling bytes cannot hold a server thread. The same handshake
opens the data lanes (`wire.tcp`) and the embedded control bus (`control.embedded`).

    .venv/bin/pytest tests/unit/test_wire_auth.py -q
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from splitlab.wire.errors import AuthError, FrameError
from splitlab.wire.header import Lane, Routing, encode_header, read_header

log = logging.getLogger(__name__)

LABEL = "splitlab-wire-v1"
MAX_HANDSHAKE_HEADER_BYTES = 4096  # a hello: four fields of <= 256 characters, JSON-escaped
_NO_ROUTING = Routing()


def new_nonce() -> str:
    return secrets.token_hex(16)


def proof(key: bytes, role: str, *, session: str, client_id: str, server_id: str, lane: str,
          client_nonce: str, server_nonce: str) -> str:  # fmt: skip
    """HMAC-SHA256 over the whole transcript; `role` is "client" or "server"."""
    text = "\n".join([LABEL, role, session, client_id, server_id, lane, client_nonce, server_nonce])
    return hmac.new(key, text.encode(), hashlib.sha256).hexdigest()


class ReplayGuard:
    """Remembers the last `max_nonces` client nonces a server has seen."""

    def __init__(self, max_nonces: int = 65536) -> None:
        self.max_nonces = max_nonces
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()

    def first_use(self, nonce: str) -> bool:
        with self._lock:
            if nonce in self._seen:
                return False
            self._seen[nonce] = None
            if len(self._seen) > self.max_nonces:
                self._seen.popitem(last=False)
            return True


@dataclass(frozen=True)
class Hello:
    session: str
    client_id: str
    lane: str
    client_nonce: str


class _Deadline:
    """One clock for the whole handshake: each read waits at most what is left of it, and the
    socket keeps the timeout its owner gave it (an `on_accept` may set a new one)."""

    def __init__(self, sock: socket.socket, timeout_s: float | None) -> None:
        self.sock, self.timeout_s = sock, timeout_s
        self.end = None if timeout_s is None else time.monotonic() + timeout_s

    def recv_into(self, view: memoryview, nbytes: int) -> int:
        if self.end is None:
            return self.sock.recv_into(view, nbytes)
        left_s = self.end - time.monotonic()
        if left_s <= 0:
            raise TimeoutError(f"handshake took over timeout_s={self.timeout_s}")
        before_s = self.sock.gettimeout()
        self.sock.settimeout(left_s if before_s is None else min(left_s, before_s))
        try:
            return self.sock.recv_into(view, nbytes)
        finally:
            self.sock.settimeout(before_s)


def _send(sock: socket.socket, kind: str, **fields: Any) -> None:
    sock.sendall(encode_header(kind, Lane.ACTIVATION, _NO_ROUTING, None, 0, fields, []))


def _recv(clock: _Deadline, kind: str) -> dict[str, Any]:
    try:
        header = read_header(clock.recv_into, bytearray(4 + MAX_HANDSHAKE_HEADER_BYTES),
                             max_frame_bytes=0, max_header_bytes=MAX_HANDSHAKE_HEADER_BYTES)  # fmt: skip
    except FrameError as exc:
        raise AuthError(f"handshake: expected {kind!r}: {exc}") from None
    if header.kind == "refuse":
        raise AuthError(f"handshake refused by peer: {header.meta.get('reason')}")
    if header.kind != kind:
        raise AuthError(f"handshake: expected {kind!r}, got {header.kind!r}")
    meta = header.meta
    if not all(isinstance(v, str) for v in meta.values()):
        raise AuthError(f"handshake: {kind!r} fields must be strings")
    return meta


def _field(meta: dict[str, Any], name: str) -> str:
    value = meta.get(name)
    if not isinstance(value, str) or not 0 < len(value) <= 256:
        raise AuthError(f"handshake: field {name!r} = {value!r} is missing or invalid")
    return value


def client_handshake(sock: socket.socket, *, key: bytes, session: str, client_id: str,
                     server_id: str, lane: str, timeout_s: float | None = None) -> None:  # fmt: skip
    """Prove the key to the server, then check its proof; raises AuthError on refusal.

    `timeout_s` bounds the whole handshake (then `TimeoutError`).
    """
    clock = _Deadline(sock, timeout_s)
    cn = new_nonce()
    _send(sock, "hello", session=session, client_id=client_id, lane=lane, client_nonce=cn)
    challenge = _recv(clock, "challenge")
    sn, got_server = _field(challenge, "server_nonce"), _field(challenge, "server_id")
    if got_server != server_id:
        raise AuthError(f"handshake: expected peer {server_id!r} but {got_server!r} answered")
    ids = dict(session=session, client_id=client_id, server_id=server_id, lane=lane,
               client_nonce=cn, server_nonce=sn)  # fmt: skip
    _send(sock, "proof", proof=proof(key, "client", **ids))
    accept = _recv(clock, "accept")
    if not hmac.compare_digest(_field(accept, "proof"), proof(key, "server", **ids)):
        raise AuthError(f"handshake: peer {server_id!r} does not hold the session key")


def server_handshake(sock: socket.socket, *, key: bytes | Callable[[str], bytes], session: str,
                     server_id: str, guard: ReplayGuard,
                     on_accept: Callable[[Hello], None] | None = None,
                     timeout_s: float | None = None) -> Hello:  # fmt: skip
    """Check a connecting client; returns its hello or refuses (logged) with AuthError.

    `key` is the shared key, or a function of the client id the hello names giving that
    client's own key (the embedded bus: one credential per node, `wire.session_key.node_key`).

    `on_accept` runs before the client hears "accept", so the connection is usable on this
    side by the time the client's `connect` returns. `timeout_s` bounds the whole handshake
    (then `TimeoutError`).
    """
    clock = _Deadline(sock, timeout_s)
    meta = _recv(clock, "hello")
    hello = Hello(*(_field(meta, f) for f in ("session", "client_id", "lane", "client_nonce")))
    reason = None
    if hello.session != session:
        reason = f"wrong session {hello.session!r}"
    elif not guard.first_use(hello.client_nonce):
        reason = f"replayed handshake (client nonce {hello.client_nonce[:8]}... seen before)"
    if reason is None:
        if callable(key):
            key = key(hello.client_id)
        sn = new_nonce()
        ids = dict(session=session, client_id=hello.client_id, server_id=server_id,
                   lane=hello.lane, client_nonce=hello.client_nonce, server_nonce=sn)  # fmt: skip
        _send(sock, "challenge", server_id=server_id, server_nonce=sn)
        answer = _recv(clock, "proof")
        if hmac.compare_digest(_field(answer, "proof"), proof(key, "client", **ids)):
            if on_accept is not None:
                on_accept(hello)
            _send(sock, "accept", proof=proof(key, "server", **ids))
            return hello
        reason = "wrong key (client proof does not match)"
    log.warning(
        "refused data connection from %r (%s): %s", hello.client_id, _peer_name(sock), reason
    )
    try:
        _send(sock, "refuse", reason=reason)
    except OSError:
        pass
    raise AuthError(f"refused {hello.client_id!r}: {reason}")


def _peer_name(sock: socket.socket) -> str:
    try:
        host, port = sock.getpeername()[:2]
        return f"{host}:{port}"
    except OSError:
        return "?"
