"""Embedded control bus: a small broker the launcher hosts, so one machine needs no RabbitMQ.

`EmbeddedBusServer` runs in threads of the launcher process and listens on TCP; node
processes open an `EmbeddedBus` to it with the session's auth key. Semantics follow the
RabbitMQ bus (see `bus.py`): per-node queues, confirmed publish, manual ack, redelivery of
unacked messages when a consumer nacks or disconnects, prefetch, bounded waits, and a
`PeerLostError` naming the host when it is gone.

Why not `multiprocessing.managers`: its proxies pickle arguments and results, so anyone
holding the auth key could make the host unpickle arbitrary objects, and it offers no hook
to requeue a consumer's unacked messages when that consumer's connection drops. So this
module speaks the one wire: a connection opens with `wire.auth`'s HMAC-SHA256 handshake
(small frames before the proof, one deadline for the whole exchange), then every request and
reply is one `wire.blobs` frame: `kind` the operation, `meta` its arguments, the payload the
already-encoded message bodies. One thread per client connection; a consumer blocks on a
condition variable, so a publish wakes it at once.

On a testbed whose path from a node to the bus's host has a delay (this kernel has no netem),
the node's `EmbeddedBus` takes a `wire.delay.DelayLine` to the bus (peer `BUS_PEER`): each
request waits out the one-way delay before it is sent and each reply after it arrives, so a
message from node a to node b through the bus on host c takes delay(a, c) + delay(c, b), as
data frames between them do.

A connection is one node: its `hello` must name the node id it authenticated as, only one
connection holds a node's queue at a time (a second is refused while the first is alive; a
restart after a crash takes over at once), it consumes only that queue, and every message it
publishes must carry that node as `sender` and its session as `session_id`. The handshake
proves that node's own key, `node_key(node id)` derived from the session key the bus holds:
a launcher hands each node only its own (`wire.session_key`), so no node can claim another's
queue or send in its name, and a START from "coordinator" is the coordinator's.
`ControlEndpoint(peers=...)` drops messages from senders outside the run. A publish reaches
only queues of the publisher's session, and creates at most `MAX_QUEUES` queues in all; a
node's queue that is empty when its connection ends is forgotten (declared again on its next
hello or a publish to it), so node ids that come and go do not pile up queues. A
malformed or refused operation gets an `error` reply naming the field (`ProtocolError` on
the client) and the connection goes on.

    .venv/bin/python tools/bench_control.py --quick --bus embedded
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from splitlab.control.bus import (
    QUEUE_PREFIX,
    ControlBus,
    Delivery,
    check_name,
    decode_delivery,
    queue_name,
)
from splitlab.control.messages import MAX_MESSAGE_BYTES, BusMessage, encode
from splitlab.errors import ConfigError, PeerLostError, ProtocolError
from splitlab.wire.accept import MAX_HANDSHAKES, Acceptor, Done
from splitlab.wire.auth import ReplayGuard, client_handshake, server_handshake
from splitlab.wire.blobs import Blob, encode_blob_frame, read_blob_frame
from splitlab.wire.delay import DelayLine
from splitlab.wire.errors import AuthError, FrameError, TruncatedFrameError
from splitlab.wire.header import MAX_HEADER_BYTES, header_length, parse_header
from splitlab.wire.session_key import SESSION_KEY_ENV, node_key
from splitlab.wire.tickets import SENT, SendTicket

log = logging.getLogger(__name__)

MAX_FRAME_BYTES = MAX_MESSAGE_BYTES + (1 << 20)  # one message and the reply's bookkeeping
_MAX_WAIT_S = 3600.0  # a consume never parks a server thread longer than this
MAX_QUEUES = 1024  # queues the host keeps at once: publishes to made-up names cannot grow it
MAX_PREFETCH = 65536
# The handshake's identities: the key belongs to the bus (the launcher made it), not to a run.
_REALM, _SERVER_ID, _LANE = "splitlab-embedded-bus", "embedded-bus", "control"
ENV_HOST, ENV_PORT = "SPLITLAB_CONTROL_HOST", "SPLITLAB_CONTROL_PORT"
BUS_PEER = "bus"  # the peer name of a node's path to the bus host in its delay line


@dataclass(frozen=True)
class EmbeddedAddress:
    host: str
    port: int
    authkey: bytes

    def to_env(self) -> dict[str, str]:
        """Environment for child processes (the key stays out of their command lines)."""
        return {ENV_HOST: self.host, ENV_PORT: str(self.port), SESSION_KEY_ENV: self.authkey.hex()}

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> EmbeddedAddress:
        env = dict(os.environ if env is None else env)
        return cls(env[ENV_HOST], int(env[ENV_PORT]), bytes.fromhex(env[SESSION_KEY_ENV]))


class _Conn:
    """One authenticated socket carrying blob frames; reads are bounded by `timeout_s`."""

    def __init__(self, sock: socket.socket, peer: str) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # small frames go out at once
        self.sock, self.peer = sock, peer
        self._scratch = bytearray(4 + MAX_HEADER_BYTES)

    def send(self, op: str, meta: dict[str, Any], blobs: dict[str, Blob] | None = None) -> None:
        self.sock.sendall(b"".join(encode_blob_frame(op, meta, blobs or {})))

    def recv(self, wait_s: float) -> tuple[str, dict[str, Any], dict[str, bytearray]]:
        """One frame within `wait_s`, or `PeerLostError` naming the peer."""
        self.sock.settimeout(max(wait_s, 1e-3))
        try:
            header, blobs = read_blob_frame(
                self.sock.recv_into, self._scratch, max_frame_bytes=MAX_FRAME_BYTES
            )
        except TimeoutError:
            raise PeerLostError(
                f"embedded control bus {self.peer} did not answer within {wait_s:.1f} s"
            ) from None
        except (TruncatedFrameError, OSError) as exc:
            raise PeerLostError(f"embedded control bus {self.peer} is gone: {exc!r}") from None
        return header.kind, header.meta, blobs

    def peer_closed(self) -> bool:
        """Whether the peer has closed its end (seen without reading what it sent, and
        without waiting: a non-blocking probe on a duplicate descriptor; the socket's own
        timeout stays as it is, and a socket with a timeout is non-blocking already)."""
        try:
            with socket.socket(fileno=os.dup(self.sock.fileno())) as probe:
                probe.setblocking(False)
                return probe.recv(1, socket.MSG_PEEK) == b""
        except BlockingIOError:
            return False
        except OSError:
            return True

    def shutdown(self) -> None:
        """Wake a thread blocked reading this socket (closing the fd alone does not)."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        self.sock.close()


class _Queues:
    """The broker state: ready messages per queue, guarded by one lock. A publish may create
    at most `max_queues` queues in all (a node's own queue and requeues are never refused)."""

    def __init__(self, max_queues: int = MAX_QUEUES) -> None:
        self.lock = threading.Lock()
        self.ready: dict[str, deque[tuple[bytes, bool]]] = {}
        self.conds: dict[str, threading.Condition] = {}
        self.closed = False
        self.max_queues = max_queues

    def _queue(self, name: str, *, capped: bool = False) -> deque[tuple[bytes, bool]]:
        if name not in self.ready:
            if capped and len(self.ready) >= self.max_queues:
                raise ProtocolError(
                    f"queue {name!r} refused: the bus holds max_queues={self.max_queues} queues"
                )
            self.ready[name] = deque()
            self.conds[name] = threading.Condition(self.lock)
        return self.ready[name]

    def declare(self, name: str) -> None:
        with self.lock:
            self._queue(name)

    def put(self, name: str, body: bytes) -> None:
        with self.lock:
            self._queue(name, capped=True).append((body, False))
            self.conds[name].notify()

    def wake(self, name: str) -> None:
        """Wake a consumer of `name` so it looks at its own stop flag."""
        with self.lock:
            cond = self.conds.get(name)
            if cond is not None:
                cond.notify_all()

    def requeue(self, name: str, bodies: list[bytes]) -> None:
        """Put unacked bodies back at the head, in their original order, marked redelivered."""
        with self.lock:
            if name not in self.ready and self.closed:
                return
            q = self._queue(name)
            q.extendleft((b, True) for b in reversed(bodies))
            self.conds[name].notify()

    def take(self, name: str, max_count: int, timeout_s: float,
             stop: Callable[[], bool]) -> list[tuple[bytes, bool]]:  # fmt: skip
        """Up to `max_count` messages, waiting up to `timeout_s` for one (or until `stop()`)."""
        with self.lock:
            q = self._queue(name)
            cond = self.conds[name]
            if max_count > 0:
                cond.wait_for(lambda: bool(q) or self.closed or stop(), timeout_s)
            else:  # prefetch exhausted: like RabbitMQ, nothing arrives until something is acked
                cond.wait_for(lambda: self.closed or stop(), timeout_s)
            if stop():
                return []
            return [q.popleft() for _ in range(min(max_count, len(q)))]

    def delete(self, names: Iterable[str]) -> None:
        with self.lock:
            for name in names:
                self.ready.pop(name, None)
                cond = self.conds.pop(name, None)
                if cond is not None:
                    cond.notify_all()

    def forget_if_empty(self, name: str) -> None:
        """Drop `name` if it holds nothing (its node left): a publish or hello declares it
        again, and node ids that come and go cannot grow the broker."""
        with self.lock:
            if name in self.ready and not self.ready[name]:
                del self.ready[name]
                self.conds.pop(name).notify_all()

    def close(self) -> None:
        with self.lock:
            self.closed = True
            for cond in self.conds.values():
                cond.notify_all()


def _dial(host: str, port: int, timeout_s: float, peer: str) -> socket.socket:
    """Connect within `timeout_s`; a refused connection (a host started at the same time as
    its clients, not listening yet) is retried with back-off until then."""
    deadline = time.monotonic() + timeout_s
    pause_s = 0.05
    while True:
        try:
            return socket.create_connection((host, port), timeout=timeout_s)
        except ConnectionRefusedError as exc:
            if time.monotonic() + pause_s > deadline:
                raise PeerLostError(f"cannot reach the embedded control bus {peer} "
                                    f"within {timeout_s:.0f} s: {exc!r}") from None  # fmt: skip
            time.sleep(pause_s)
            pause_s = min(1.0, pause_s * 1.5)
        except OSError as exc:
            raise PeerLostError(f"cannot reach the embedded control bus {peer}: {exc!r}") from None


class EmbeddedBusServer:
    """The broker, hosted by the launcher: `address = server.start()`, then `server.close()`."""

    def __init__(
        self, host: str = "127.0.0.1", port: int = 0, authkey: bytes | None = None
    ) -> None:
        self.host, self._port = host, port
        self.authkey = authkey if authkey is not None else secrets.token_bytes(32)
        self.queues = _Queues()
        self._conns: set[_Conn] = set()
        self._conns_lock = threading.Lock()
        self._holders: dict[str, _ClientState] = {}  # queue -> the connection of its node
        self._acceptor: Acceptor | None = None
        self._guard = ReplayGuard()
        self.handshake_timeout_s = 10.0
        self.max_handshakes = MAX_HANDSHAKES

    def start(self) -> EmbeddedAddress:
        sock = socket.create_server((self.host, self._port))
        self._port = sock.getsockname()[1]
        self._acceptor = Acceptor(sock, self._serve, name="embedded-bus",
                                  max_handshakes=self.max_handshakes).start()  # fmt: skip
        return self.address

    @property
    def address(self) -> EmbeddedAddress:
        return EmbeddedAddress(self.host, self._port, self.authkey)

    def _node_key(self, node_id: str) -> bytes:
        """The credential a connection claiming `node_id` must prove (`node_key`)."""
        return node_key(node_id, self.authkey)

    def clients(self) -> int:
        """Clients connected now (a host that outlives its run waits for them to leave)."""
        with self._conns_lock:
            return len(self._conns)

    def queue_names(self) -> list[str]:
        with self.queues.lock:
            return sorted(self.queues.ready)

    def close(self) -> None:
        """Stop accepting, wake every waiter and drop every client: they see `PeerLostError`."""
        if self._acceptor is not None:
            self._acceptor.close()
        self.queues.close()
        with self._conns_lock:
            conns = list(self._conns)
        for conn in conns:
            conn.shutdown()
        if self._acceptor is not None:
            self._acceptor.join()

    def __enter__(self) -> EmbeddedBusServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _serve(self, sock: socket.socket, done: Done) -> None:
        """One client connection, on its own thread: the handshake, then its requests. A bad
        request is answered with an error naming the field; nothing a client sends ends this
        thread with a traceback."""
        conn = _Conn(sock, "client")
        with self._conns_lock:
            self._conns.add(conn)
        client = _ClientState(conn)
        try:
            hello = server_handshake(conn.sock, key=self._node_key, session=_REALM,
                                     server_id=_SERVER_ID, guard=self._guard,
                                     timeout_s=self.handshake_timeout_s)  # fmt: skip
            done()
            client.identity = hello.client_id
            conn.peer = f"client {hello.client_id!r}"
            while True:
                op, meta, blobs = conn.recv(_MAX_WAIT_S * 2)
                try:
                    reply = self._handle(client, op, meta, blobs)
                except ProtocolError as exc:
                    log.warning("embedded bus: refused %r from %s: %s", op, conn.peer, exc)
                    conn.send("error", {"reason": str(exc)})
                    continue
                if reply is None or self.queues.closed or client.evicted:
                    break  # closing: the client sees the connection drop, not an empty reply
                conn.send("reply", *reply)
        except (PeerLostError, ProtocolError, OSError) as exc:
            log.debug("embedded bus client %s left: %r", client.queue, exc)
        except Exception as exc:  # a bug here must not leave a traceback per client
            log.error("embedded bus: dropped %s after an unexpected error: %r", conn.peer, exc)
        finally:
            for name, bodies in client.unacked_by_queue().items():
                self.queues.requeue(name, bodies)
            with self._conns_lock:
                self._conns.discard(conn)
                held = client.queue is not None and self._holders.get(client.queue) is client
                if held:
                    del self._holders[client.queue]
                    self.queues.forget_if_empty(client.queue)
            conn.close()

    def _handle(
        self, client: _ClientState, op: str, meta: dict[str, Any], blobs: dict[str, bytearray]
    ) -> tuple[dict[str, Any], dict[str, Blob]] | None:
        """One request; returns the reply's (meta, blobs), or None to end the connection.

        Raises:
            ProtocolError: a malformed or refused request (named); the connection goes on.
        """
        acks, nacks = _settlements(meta)
        client.settle(acks, nacks, self.queues)
        if op == "close":
            return None
        if op == "hello":
            self._hello(client, meta)
            return _OK
        if op == "settle":
            return _OK
        if client.queue is None or client.session is None:
            raise ProtocolError(f"{op!r} before hello")
        if op == "publish":
            name = _own_queue(client.session, _arg(meta, "queue", str))
            body = blobs.get("body")
            if body is None:
                raise ProtocolError(f"publish to {name!r} carries no body")
            _check_sender(client, name, body)
            self.queues.put(name, body)
            return _OK
        if op == "consume":
            max_count = _arg(meta, "max", int)
            if max_count < 0:
                raise ProtocolError(f"consume: field 'max' = {max_count} must be >= 0")
            wait_s = _seconds(meta, "timeout_s")
            room = client.prefetch - len(client.unacked)
            items = self.queues.take(client.queue, min(max_count, room), min(wait_s, _MAX_WAIT_S),
                                     lambda: client.evicted)  # fmt: skip
            out = []
            for item_body, redelivered in items:
                client.next_tag += 1
                client.unacked[client.next_tag] = (client.queue, item_body)
                out.append(
                    {"tag": client.next_tag, "redelivered": redelivered, "size": len(item_body)}
                )
            bodies = {"bodies": b"".join(b for b, _ in items)} if items else {}
            return {"deliveries": out}, bodies
        if op == "delete":
            names = _arg(meta, "queues", list)
            if len(names) > self.queues.max_queues:
                raise ProtocolError(f"delete: {len(names)} queues, over max_queues")
            self.queues.delete(_own_queue(client.session, n) for n in names)
            return _OK
        raise ProtocolError(f"unknown embedded bus op {op!r}")

    def _hello(self, client: _ClientState, meta: dict[str, Any]) -> None:
        """Bind the connection to its node: the id it authenticated as, one connection each."""
        if client.queue is not None:
            raise ProtocolError(f"hello again from {client.node_id!r}")
        session, node_id = _arg(meta, "session", str), _arg(meta, "node_id", str)
        prefetch = _arg(meta, "prefetch", int)
        if not 1 <= prefetch <= MAX_PREFETCH:
            raise ProtocolError(f"hello: field 'prefetch' = {prefetch} must be 1..{MAX_PREFETCH}")
        if node_id != client.identity:
            raise ProtocolError(
                f"hello as {node_id!r} on a connection authenticated as {client.identity!r}"
            )
        name = _queue_of(session, node_id)
        with self._conns_lock:
            holder = self._holders.get(name)
            if holder is not None and not holder.conn.peer_closed():
                raise ProtocolError(f"node {node_id!r} of session {session!r} is already connected")
            self._holders[name] = client
        if holder is not None:  # its process died and its thread waits in a consume: end it
            holder.evicted = True
            holder.conn.shutdown()
            self.queues.wake(name)
        self.queues.declare(name)
        client.session, client.node_id, client.queue = session, node_id, name
        client.prefetch = prefetch


_OK: tuple[dict[str, Any], dict[str, Blob]] = ({"ok": True}, {})


def _arg(meta: dict[str, Any], name: str, tp: type) -> Any:
    value = meta.get(name)
    if type(value) is not tp:
        raise ProtocolError(f"field {name!r} = {value!r:.80} is not {tp.__name__}")
    return value


def _seconds(meta: dict[str, Any], name: str) -> float:
    value = meta.get(name)
    if type(value) not in (int, float) or not 0 <= value < math.inf:  # NaN fails too
        raise ProtocolError(f"field {name!r} = {value!r:.80} must be a finite number >= 0")
    return float(value)


def _settlements(meta: dict[str, Any]) -> tuple[list[int], list[tuple[int, bool]]]:
    acks, nacks = meta.get("acks", []), meta.get("nacks", [])
    if type(acks) is not list or not all(type(t) is int for t in acks):
        raise ProtocolError(f"field 'acks' = {acks!r:.80} is not a list of delivery tags")
    if type(nacks) is not list or not all(
        type(n) is list and len(n) == 2 and type(n[0]) is int and type(n[1]) is bool for n in nacks
    ):
        raise ProtocolError(f"field 'nacks' = {nacks!r:.80} is not a list of [tag, requeue]")
    return acks, [(t, r) for t, r in nacks]


def _queue_of(session: str, node_id: str) -> str:
    try:
        return queue_name(session, node_id)
    except ConfigError as exc:
        raise ProtocolError(str(exc)) from None


def _own_queue(session: str, name: Any) -> str:
    """A queue of the client's own session, by its full name; any other is refused, named."""
    prefix = f"{QUEUE_PREFIX}.{session}."
    if type(name) is not str or not name.startswith(prefix):
        raise ProtocolError(f"queue {name!r:.80} is not a queue of session {session!r}")
    return _queue_of(session, name[len(prefix) :])


def _check_sender(client: _ClientState, queue: str, body: bytearray) -> None:
    """The message's `sender` and `session_id` must be the connection's own node."""
    try:
        n = header_length(body[:4])
        meta = parse_header(memoryview(body)[4 : 4 + n], max_frame_bytes=MAX_MESSAGE_BYTES).meta
    except (FrameError, struct.error) as exc:
        raise ProtocolError(f"publish to {queue!r}: the body is not a message: {exc}") from None
    sender, session = meta.get("sender"), meta.get("session_id")
    if (sender, session) != (client.node_id, client.session):
        raise ProtocolError(
            f"publish to {queue!r}: a message from {sender!r:.80} of session {session!r:.80} "
            f"on the connection of node {client.node_id!r} of session {client.session!r}"
        )


class _ClientState:
    def __init__(self, conn: _Conn) -> None:
        self.conn = conn
        self.identity: str | None = None  # the node id the handshake authenticated
        self.session: str | None = None
        self.node_id: str | None = None
        self.queue: str | None = None
        self.evicted = False  # a reconnect of the same node took over (this one's peer died)
        self.prefetch = 1
        self.next_tag = 0
        self.unacked: dict[int, tuple[str, bytes]] = {}

    def settle(self, acks: Iterable[int], nacks: Iterable[tuple[int, bool]],
               queues: _Queues) -> None:  # fmt: skip
        for tag in acks:
            self.unacked.pop(tag, None)
        for tag, requeue in nacks:
            item = self.unacked.pop(tag, None)
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

    def __init__(self, conn: _Conn, *, session: str, node_id: str, timeout_s: float,
                 delay: DelayLine | None = None) -> None:  # fmt: skip
        self._conn: _Conn | None = conn
        self.delay = delay  # a testbed path's delay to the bus host (module docstring)
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
        session: str,
        node_id: str,
        authkey: bytes | None = None,
        credential: bytes | None = None,
        prefetch: int = 16,
        timeout_s: float = 30.0,
        delay: DelayLine | None = None,
    ) -> EmbeddedBus:
        """Connect and authenticate as `node_id` within `timeout_s` (a host not listening yet is
        retried until then); `PeerLostError` if the host is not there or refuses the key.

        The connection proves `credential`, the node's own key (`wire.session_key.node_key`:
        what a launcher hands each node), or the one derived from `authkey`, the bus's session
        key, for a caller that holds it.
        """
        check_name("session", session)
        check_name("node_id", node_id)
        if credential is None:
            if authkey is None:
                raise ValueError("EmbeddedBus.connect needs authkey or credential")
            credential = node_key(node_id, authkey)
        peer = f"host {host}:{port}"
        sock = _dial(host, port, timeout_s, peer)
        conn = _Conn(sock, peer)
        try:
            client_handshake(sock, key=credential, session=_REALM, client_id=node_id,
                             server_id=_SERVER_ID, lane=_LANE, timeout_s=timeout_s)  # fmt: skip
        except AuthError as exc:
            conn.close()
            raise PeerLostError(
                f"embedded control bus {peer} rejected the key of {node_id!r} "
                f"(or is not ours): {exc}"
            ) from None
        except (TruncatedFrameError, OSError) as exc:
            conn.close()
            raise PeerLostError(
                f"embedded control bus {peer} left the handshake: {exc!r}"
            ) from None
        bus = cls(conn, session=session, node_id=node_id, timeout_s=timeout_s, delay=delay)
        try:
            bus._call("hello", {"session": session, "node_id": node_id, "prefetch": prefetch})
        except BaseException:
            bus._conn = None
            conn.close()
            if delay is not None:
                delay.close(drain_timeout_s=0)
            raise
        return bus

    def publish(self, to_node: str, msg: BusMessage, timeout_s: float | None = None) -> None:
        name = queue_name(self.session, to_node)
        self._call("publish", {"queue": name}, {"body": encode(msg)}, timeout_s=timeout_s)
        self._published.add(name)

    def consume_batch(self, max_count: int, timeout_s: float) -> list[Delivery]:
        meta, blobs = self._call(
            "consume", {"max": max_count, "timeout_s": max(0.0, timeout_s)},
            timeout_s=self.timeout_s + max(0.0, timeout_s),
        )  # fmt: skip
        body = memoryview(blobs.get("bodies", b""))
        out, offset = [], 0
        for d in meta["deliveries"]:
            chunk = body[offset : offset + d["size"]]
            offset += d["size"]
            out.append(decode_delivery(chunk, bool(d["redelivered"]), self._settler(int(d["tag"]))))
        return out

    def flush(self) -> None:
        """Send pending acks and nacks now (they otherwise ride on the next request)."""
        if self._acks or self._nacks:
            self._call("settle", {})

    def close(self) -> None:
        if self._conn is None:
            return
        try:
            self._conn.send("close", {"acks": self._acks, "nacks": self._nacks})
            self._conn.recv(min(self.timeout_s, 5.0))  # the host closes after settling
        except (OSError, PeerLostError, ProtocolError):
            pass  # the expected end: the host dropped the connection
        self._conn.close()
        self._conn = None
        if self.delay is not None:
            self.delay.close(drain_timeout_s=0)

    def cleanup(self, node_ids: Iterable[str] = ()) -> None:
        names = {self._queue, *self._published, *(queue_name(self.session, n) for n in node_ids)}
        self._call("delete", {"queues": sorted(names)})

    def _through_delay(self, hand_on: Callable[[], None], timeout_s: float) -> None:
        """`hand_on()` now, or once the delay line to the bus has held it its one-way delay."""
        if self.delay is None:
            hand_on()
            return

        def deliver() -> SendTicket:
            hand_on()
            return SENT

        self.delay.submit(BUS_PEER, BUS_PEER, deliver, timeout_s=timeout_s).wait(timeout_s)

    def _settler(self, tag: int) -> Any:
        def settle(ack: bool, requeue: bool) -> None:
            if ack:
                self._acks.append(tag)
            else:
                self._nacks.append([tag, requeue])

        return settle

    def _call(
        self, op: str, meta: dict[str, Any], blobs: dict[str, Blob] | None = None,
        timeout_s: float | None = None,
    ) -> tuple[dict[str, Any], dict[str, bytearray]]:  # fmt: skip
        if self._conn is None:
            raise PeerLostError(f"embedded control bus connection of {self.node_id!r} is closed")
        if threading.get_ident() != self._thread:
            raise RuntimeError("an EmbeddedBus is used only by the thread that opened it")
        meta["acks"], meta["nacks"] = self._acks, self._nacks
        self._acks, self._nacks = [], []
        started = time.monotonic()
        wait_s = self.timeout_s if timeout_s is None else timeout_s
        try:
            self._through_delay(lambda conn=self._conn: conn.send(op, meta, blobs), wait_s)
        except OSError as exc:
            raise PeerLostError(
                f"embedded control bus {self._conn.peer} is gone: {exc!r}"
            ) from None
        remaining_s = max(0.0, wait_s - (time.monotonic() - started))
        kind, reply, reply_blobs = self._conn.recv(remaining_s)
        self._through_delay(lambda: None, wait_s)  # the reply's way back
        if kind == "error":
            raise ProtocolError(f"embedded control bus refused {op!r}: {reply.get('reason')}")
        if kind != "reply":
            raise ProtocolError(
                f"embedded control bus {self._conn.peer} answered {kind!r} to {op!r}"
            )
        return reply, reply_blobs
