"""Embedded control bus: a small broker the launcher hosts, so one machine needs no RabbitMQ.

`EmbeddedBusServer` runs in threads of the launcher process and listens on TCP; node
processes open an `EmbeddedBus` to it with the session's auth key. Semantics follow the
RabbitMQ bus (see `bus.py`): per-node queues, confirmed publish, manual ack, redelivery of
unacked messages when a consumer nacks or disconnects, prefetch, bounded waits, and a
`PeerLostError` naming the host when it is gone.

Why not `multiprocessing.managers`: its proxies pickle arguments and results, so anyone
holding the auth key could make the host unpickle arbitrary objects, and it offers no hook
to requeue a consumer's unacked messages when that consumer's connection drops. So this
module uses only the stdlib's framing (`multiprocessing.connection.Connection.send_bytes`
/ `recv_bytes`, which never unpickle) over a socket, carries JSON headers and the
already-encoded message bytes, and authenticates both ends with an HMAC-SHA256
challenge-response (Python 3.11's `deliver_challenge` still uses HMAC-MD5). One thread per
client connection; a consumer blocks on a condition variable, so a publish wakes it at once.

    .venv/bin/python tools/bench_control.py --quick --bus embedded
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from splitlab.control.bus import ControlBus, Delivery, check_name, decode_delivery, queue_name
from splitlab.control.messages import Message, encode
from splitlab.errors import PeerLostError, ProtocolError

log = logging.getLogger(__name__)

MAX_FRAME_BYTES = 1 << 30  # one UPDATE of a large model fits; anything bigger is refused
_LEN = struct.Struct(">I")
_HELLO = b"splitlab-embedded-bus-v1"
_NONCE_BYTES = 32
_MAX_WAIT_S = 3600.0  # a consume never parks a server thread longer than this
ENV_HOST, ENV_PORT, ENV_AUTHKEY = (
    "SPLITLAB_CONTROL_HOST",
    "SPLITLAB_CONTROL_PORT",
    "SPLITLAB_CONTROL_AUTHKEY",
)


@dataclass(frozen=True)
class EmbeddedAddress:
    host: str
    port: int
    authkey: bytes

    def to_env(self) -> dict[str, str]:
        """Environment for child processes (the key stays out of their command lines)."""
        return {ENV_HOST: self.host, ENV_PORT: str(self.port), ENV_AUTHKEY: self.authkey.hex()}

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> EmbeddedAddress:
        env = dict(os.environ if env is None else env)
        return cls(env[ENV_HOST], int(env[ENV_PORT]), bytes.fromhex(env[ENV_AUTHKEY]))


def _pack(header: dict[str, Any], body: bytes = b"") -> bytes:
    raw = json.dumps(header, separators=(",", ":")).encode()
    return b"".join((_LEN.pack(len(raw)), raw, body))


def _unpack(frame: bytes) -> tuple[dict[str, Any], bytes]:
    if len(frame) < _LEN.size:
        raise ProtocolError(f"embedded bus frame of {len(frame)} bytes is too short")
    (n,) = _LEN.unpack_from(frame)
    if _LEN.size + n > len(frame):
        raise ProtocolError(f"embedded bus header length {n} exceeds the {len(frame)}-byte frame")
    header = json.loads(frame[_LEN.size : _LEN.size + n])
    if not isinstance(header, dict):
        raise ProtocolError("embedded bus header must be a JSON object")
    return header, frame[_LEN.size + n :]


def _mac(authkey: bytes, label: bytes, nonce: bytes) -> bytes:
    return hmac.new(authkey, label + nonce, hashlib.sha256).digest()


def _recv(conn: Connection, wait_s: float, peer: str) -> bytes:
    """One frame within `wait_s`, or `PeerLostError` naming the peer."""
    try:
        if not conn.poll(wait_s):
            raise PeerLostError(f"embedded control bus {peer} did not answer within {wait_s:.1f} s")
        return conn.recv_bytes(MAX_FRAME_BYTES)
    except (EOFError, OSError) as exc:
        raise PeerLostError(f"embedded control bus {peer} is gone: {exc!r}") from None


def _shutdown(conn: Connection) -> None:
    """Wake a thread blocked reading `conn` (closing the fd alone does not) and tell the peer."""
    try:
        s = socket.socket(fileno=os.dup(conn.fileno()))
    except OSError:
        return
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        s.close()


def _connection(sock: socket.socket) -> Connection:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # small frames go out at once
    sock.settimeout(None)
    return Connection(sock.detach())


class _Queues:
    """The broker state: ready messages per queue, guarded by one lock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ready: dict[str, deque[tuple[bytes, bool]]] = {}
        self.conds: dict[str, threading.Condition] = {}
        self.closed = False

    def _queue(self, name: str) -> deque[tuple[bytes, bool]]:
        if name not in self.ready:
            self.ready[name] = deque()
            self.conds[name] = threading.Condition(self.lock)
        return self.ready[name]

    def put(self, name: str, body: bytes) -> None:
        with self.lock:
            self._queue(name).append((body, False))
            self.conds[name].notify()

    def requeue(self, name: str, bodies: list[bytes]) -> None:
        """Put unacked bodies back at the head, in their original order, marked redelivered."""
        with self.lock:
            if name not in self.ready and self.closed:
                return
            q = self._queue(name)
            q.extendleft((b, True) for b in reversed(bodies))
            self.conds[name].notify()

    def take(self, name: str, max_count: int, timeout_s: float) -> list[tuple[bytes, bool]]:
        with self.lock:
            q = self._queue(name)
            cond = self.conds[name]
            if max_count > 0:
                cond.wait_for(lambda: bool(q) or self.closed, timeout_s)
            else:  # prefetch exhausted: like RabbitMQ, nothing arrives until something is acked
                cond.wait_for(lambda: self.closed, timeout_s)
            return [q.popleft() for _ in range(min(max_count, len(q)))]

    def delete(self, names: Iterable[str]) -> None:
        with self.lock:
            for name in names:
                self.ready.pop(name, None)
                cond = self.conds.pop(name, None)
                if cond is not None:
                    cond.notify_all()

    def close(self) -> None:
        with self.lock:
            self.closed = True
            for cond in self.conds.values():
                cond.notify_all()


class EmbeddedBusServer:
    """The broker, hosted by the launcher: `address = server.start()`, then `server.close()`."""

    def __init__(
        self, host: str = "127.0.0.1", port: int = 0, authkey: bytes | None = None
    ) -> None:
        self.host, self._port = host, port
        self.authkey = authkey if authkey is not None else secrets.token_bytes(32)
        self.queues = _Queues()
        self._sock: socket.socket | None = None
        self._conns: set[Connection] = set()
        self._conns_lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self.handshake_timeout_s = 10.0

    def start(self) -> EmbeddedAddress:
        self._sock = socket.create_server((self.host, self._port))
        self._port = self._sock.getsockname()[1]
        t = threading.Thread(target=self._accept_loop, name="embedded-bus-accept", daemon=True)
        t.start()
        self._threads.append(t)
        return self.address

    @property
    def address(self) -> EmbeddedAddress:
        return EmbeddedAddress(self.host, self._port, self.authkey)

    def clients(self) -> int:
        """Clients connected now (a host that outlives its run waits for them to leave)."""
        with self._conns_lock:
            return len(self._conns)

    def queue_names(self) -> list[str]:
        with self.queues.lock:
            return sorted(self.queues.ready)

    def close(self) -> None:
        """Stop accepting, wake every waiter and drop every client: they see `PeerLostError`."""
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._sock.close()
        self.queues.close()
        with self._conns_lock:
            conns = list(self._conns)
        for conn in conns:
            _shutdown(conn)
        for t in self._threads:
            t.join(timeout=5.0)

    def __enter__(self) -> EmbeddedBusServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept_loop(self) -> None:
        assert self._sock is not None
        while True:
            try:
                sock, _ = self._sock.accept()
            except OSError:
                return  # closed
            t = threading.Thread(target=self._serve, args=(_connection(sock),), daemon=True)
            t.name = "embedded-bus-client"
            with self._conns_lock:
                self._threads = [x for x in self._threads if x.is_alive()]
                self._threads.append(t)
            t.start()

    def _serve(self, conn: Connection) -> None:
        with self._conns_lock:
            self._conns.add(conn)
        client = _ClientState()
        try:
            self._handshake(conn)
            while True:
                header, body = _unpack(_recv(conn, _MAX_WAIT_S * 2, "client"))
                reply = self._handle(client, header, body)
                if reply is None or self.queues.closed:
                    break  # closing: the client sees the connection drop, not an empty reply
                conn.send_bytes(reply)
        except (PeerLostError, ProtocolError, OSError, ValueError) as exc:
            log.debug("embedded bus client %s left: %r", client.queue, exc)
        finally:
            for name, bodies in client.unacked_by_queue().items():
                self.queues.requeue(name, bodies)
            with self._conns_lock:
                self._conns.discard(conn)
            conn.close()

    def _handshake(self, conn: Connection) -> None:
        nonce = secrets.token_bytes(_NONCE_BYTES)
        conn.send_bytes(_HELLO + nonce)
        answer = _recv(conn, self.handshake_timeout_s, "client")
        mac, client_nonce = answer[:32], answer[32:]
        if len(client_nonce) != _NONCE_BYTES or not hmac.compare_digest(
            mac, _mac(self.authkey, b"client", nonce)
        ):
            conn.send_bytes(b"denied")
            raise ProtocolError("embedded bus client failed authentication")
        conn.send_bytes(_mac(self.authkey, b"server", client_nonce))

    def _handle(self, client: _ClientState, header: dict[str, Any], body: bytes) -> bytes | None:
        client.settle(header.get("acks", ()), header.get("nacks", ()), self.queues)
        op = header.get("op")
        if op == "hello":
            client.queue = queue_name(header["session"], header["node_id"])
            client.prefetch = int(header["prefetch"])
            return _pack({"ok": True})
        if op == "publish":
            self.queues.put(str(header["queue"]), body)
            return _pack({"ok": True})
        if op == "consume":
            if client.queue is None:
                raise ProtocolError("consume before hello")
            room = client.prefetch - len(client.unacked)
            wait_s = min(float(header["timeout_s"]), _MAX_WAIT_S)
            items = self.queues.take(client.queue, min(int(header["max"]), room), wait_s)
            out = []
            for item_body, redelivered in items:
                client.next_tag += 1
                client.unacked[client.next_tag] = (client.queue, item_body)
                out.append(
                    {"tag": client.next_tag, "redelivered": redelivered, "size": len(item_body)}
                )
            return _pack({"deliveries": out}, b"".join(b for b, _ in items))
        if op == "delete":
            self.queues.delete(str(q) for q in header["queues"])
            return _pack({"ok": True})
        if op == "settle":
            return _pack({"ok": True})
        if op == "close":
            return None
        raise ProtocolError(f"unknown embedded bus op {op!r}")


class _ClientState:
    def __init__(self) -> None:
        self.queue: str | None = None
        self.prefetch = 1
        self.next_tag = 0
        self.unacked: dict[int, tuple[str, bytes]] = {}

    def settle(self, acks: Iterable[int], nacks: Iterable[list[Any]], queues: _Queues) -> None:
        for tag in acks:
            self.unacked.pop(int(tag), None)
        for tag, requeue in nacks:
            item = self.unacked.pop(int(tag), None)
            if item is not None and requeue:
                queues.requeue(item[0], [item[1]])

    def unacked_by_queue(self) -> dict[str, list[bytes]]:
        out: dict[str, list[bytes]] = {}
        for _, (name, body) in sorted(self.unacked.items()):
            out.setdefault(name, []).append(body)
        self.unacked.clear()
        return out


class EmbeddedBus(ControlBus):
    """A node's connection to the embedded broker. Use from the thread that opened it."""

    def __init__(
        self, conn: Connection, *, peer: str, session: str, node_id: str, timeout_s: float
    ) -> None:
        self._conn: Connection | None = conn
        self._peer = peer
        self.session, self.node_id, self.timeout_s = session, node_id, timeout_s
        self._queue = queue_name(session, node_id)
        self._published: set[str] = set()
        self._acks: list[int] = []
        self._nacks: list[list[Any]] = []
        self._thread = threading.get_ident()

    @classmethod
    def connect(
        cls,
        *,
        host: str,
        port: int,
        authkey: bytes,
        session: str,
        node_id: str,
        prefetch: int = 16,
        timeout_s: float = 30.0,
    ) -> EmbeddedBus:
        """Connect and authenticate within `timeout_s`; `PeerLostError` if the host is not there."""
        check_name("session", session)
        check_name("node_id", node_id)
        peer = f"host {host}:{port}"
        try:
            sock = socket.create_connection((host, port), timeout=timeout_s)
        except OSError as exc:
            raise PeerLostError(f"cannot reach the embedded control bus {peer}: {exc!r}") from None
        conn = _connection(sock)
        try:
            hello = _recv(conn, timeout_s, peer)
            if not hello.startswith(_HELLO):
                raise ProtocolError(f"{peer} is not an embedded control bus")
            nonce = secrets.token_bytes(_NONCE_BYTES)
            conn.send_bytes(_mac(authkey, b"client", hello[len(_HELLO) :]) + nonce)
            if not hmac.compare_digest(
                _recv(conn, timeout_s, peer), _mac(authkey, b"server", nonce)
            ):
                raise PeerLostError(
                    f"embedded control bus {peer} rejected the auth key (or is not ours)"
                )
        except BaseException:
            conn.close()
            raise
        bus = cls(conn, peer=peer, session=session, node_id=node_id, timeout_s=timeout_s)
        bus._call({"op": "hello", "session": session, "node_id": node_id, "prefetch": prefetch})
        return bus

    def publish(self, to_node: str, msg: Message, timeout_s: float | None = None) -> None:
        name = queue_name(self.session, to_node)
        self._call({"op": "publish", "queue": name}, encode(msg), timeout_s=timeout_s)
        self._published.add(name)

    def consume_batch(self, max_count: int, timeout_s: float) -> list[Delivery]:
        header, body = self._call(
            {"op": "consume", "max": max_count, "timeout_s": max(0.0, timeout_s)},
            timeout_s=self.timeout_s + max(0.0, timeout_s),
        )
        out, offset = [], 0
        for d in header["deliveries"]:
            chunk = body[offset : offset + d["size"]]
            offset += d["size"]
            out.append(decode_delivery(chunk, bool(d["redelivered"]), self._settler(int(d["tag"]))))
        return out

    def flush(self) -> None:
        """Send pending acks and nacks now (they otherwise ride on the next request)."""
        if self._acks or self._nacks:
            self._call({"op": "settle"})

    def close(self) -> None:
        if self._conn is None:
            return
        try:
            self._conn.send_bytes(_pack({"op": "close", "acks": self._acks, "nacks": self._nacks}))
            self._conn.poll(min(self.timeout_s, 5.0))  # the host closes after settling
        except OSError:
            pass
        self._conn.close()
        self._conn = None

    def cleanup(self, node_ids: Iterable[str] = ()) -> None:
        names = {self._queue, *self._published, *(queue_name(self.session, n) for n in node_ids)}
        self._call({"op": "delete", "queues": sorted(names)})

    def _settler(self, tag: int) -> Any:
        def settle(ack: bool, requeue: bool) -> None:
            if ack:
                self._acks.append(tag)
            else:
                self._nacks.append([tag, requeue])

        return settle

    def _call(
        self, header: dict[str, Any], body: bytes = b"", timeout_s: float | None = None
    ) -> tuple[dict[str, Any], bytes]:
        if self._conn is None:
            raise PeerLostError(f"embedded control bus connection of {self.node_id!r} is closed")
        if threading.get_ident() != self._thread:
            raise RuntimeError("an EmbeddedBus is used only by the thread that opened it")
        header["acks"], header["nacks"] = self._acks, self._nacks
        self._acks, self._nacks = [], []
        started = time.monotonic()
        try:
            self._conn.send_bytes(_pack(header, body))
        except OSError as exc:
            raise PeerLostError(f"embedded control bus {self._peer} is gone: {exc!r}") from None
        wait_s = self.timeout_s if timeout_s is None else timeout_s
        remaining_s = max(0.0, wait_s - (time.monotonic() - started))
        return _unpack(_recv(self._conn, remaining_s, self._peer))
