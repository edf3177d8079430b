"""The ring's data links: one authenticated TCP connection per neighbour pair, blocking frames.

Each stage listens on its own bind address and dials the next stage's address; the connection
starts with the wire HMAC handshake (`splitlab.wire.auth`) on the per-session key, which comes
from the environment and never crosses the link. A `Link` offers the same `send`/`recv` as
`splitlab.wire.base.Channel`, so the ring runtime runs unchanged over in-process channels in
unit tests. Once `splitlab.wire.tcp` lands, its `Transport.channel` can replace `Link`.

A closed or reset connection is a `PeerLostError` naming the peer and its address; a receive
that outlives `timeout_s` is a `WaitTimeoutError`.

    .venv/bin/pytest tests/integration/test_ring_tcp.py -q
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Mapping
from typing import Any

import torch

from splitlab.errors import ConfigError, PeerLostError, WaitTimeoutError
from splitlab.wire.auth import ReplayGuard, client_handshake, server_handshake
from splitlab.wire.base import Message
from splitlab.wire.endpoint import listen
from splitlab.wire.errors import TruncatedFrameError
from splitlab.wire.frame import (
    MAX_HEADER_BYTES,
    FrameHeader,
    Lane,
    Routing,
    encode_frame,
    frame_bytes,
    read_frame,
)
from splitlab.wire.pool import BufferPool

log = logging.getLogger(__name__)

KEY_ENV = "SPLITLAB_SESSION_KEY"  # hex per-session data-plane key (never on argv)
LANE = Lane.ACTIVATION.value


def session_key() -> bytes:
    """The data-plane key from `$SPLITLAB_SESSION_KEY` (hex).

    Raises:
        ConfigError: the variable is missing or not hex.
    """
    text = os.environ.get(KEY_ENV, "")
    try:
        key = bytes.fromhex(text)
    except ValueError:
        raise ConfigError(f"${KEY_ENV} must be hex, got {len(text)} characters") from None
    if len(key) < 16:
        raise ConfigError(
            f"${KEY_ENV} is missing or shorter than 16 bytes: export the same key on every stage "
            "(e.g. `export SPLITLAB_SESSION_KEY=$(python -c 'import secrets;print(secrets.token_hex(32))')`)"
        )
    return key


class Link:
    """One authenticated connection to a neighbour; blocking, frames in order."""

    def __init__(self, sock: socket.socket, *, me: str, peer: str, peer_addr: str,
                 timeout_s: float | None, pool_bytes: int = 64 << 20) -> None:  # fmt: skip
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(timeout_s)
        self.sock, self.me, self.peer, self.peer_addr, self.timeout_s = (
            sock, me, peer, peer_addr, timeout_s,
        )  # fmt: skip
        self._pool = BufferPool(pool_bytes=pool_bytes, name=f"{me}<-{peer}")
        self._scratch = bytearray(4 + MAX_HEADER_BYTES)
        self.bytes_sent = 0
        self.bytes_received = 0

    def _lost(self, what: str, exc: BaseException | str) -> PeerLostError:
        return PeerLostError(f"lost {self.peer} ({self.peer_addr}) while {what}: {exc}")

    def send(self, kind: str, tensors: Mapping[str, torch.Tensor], *,
             meta: dict[str, Any] | None = None, routing: Routing | None = None) -> int:  # fmt: skip
        """Send one frame; returns its size in bytes."""
        header = FrameHeader(kind=kind, routing=routing or Routing(), src=self.me, meta=meta or {})
        data = frame_bytes(encode_frame(header, {k: t.detach().cpu() for k, t in tensors.items()}))
        try:
            self.sock.sendall(data)
        except TimeoutError as exc:
            raise WaitTimeoutError(
                f"sending {kind!r} to {self.peer} ({self.peer_addr}) blocked over "
                f"timeout_s={self.timeout_s}"
            ) from exc
        except OSError as exc:
            raise self._lost(f"sending {kind!r}", exc) from exc
        self.bytes_sent += len(data)
        return len(data)

    def _recv_into(self, view: memoryview, nbytes: int) -> int:
        return self.sock.recv_into(view, nbytes)

    def recv(self, *, timeout_s: float | None = None) -> Message:
        """Next frame (its tensors are pooled views: release the message when done)."""
        if timeout_s is not None:
            self.sock.settimeout(timeout_s)
        try:
            header, tensors, lease = read_frame(
                self._recv_into, pool=self._pool, scratch=self._scratch,
                timeout_s=self.timeout_s or 30.0,
            )  # fmt: skip
        except TruncatedFrameError as exc:
            raise self._lost("receiving", "connection closed") from exc
        except TimeoutError as exc:
            raise WaitTimeoutError(
                f"nothing from {self.peer} ({self.peer_addr}) within "
                f"timeout_s={timeout_s or self.timeout_s}"
            ) from exc
        except OSError as exc:
            raise self._lost("receiving", exc) from exc
        finally:
            if timeout_s is not None:
                self.sock.settimeout(self.timeout_s)
        self.bytes_received += lease.nbytes
        return Message(header, tensors, lease, self.peer)

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def dial(host: str, port: int, *, key: bytes, session: str, me: str, peer: str,
         connect_timeout_s: float, timeout_s: float | None,
         source_host: str | None = None) -> Link:  # fmt: skip
    """Connect to `peer` at host:port, retrying with backoff until connect_timeout_s.

    Raises:
        WaitTimeoutError: nobody accepted within connect_timeout_s (names the address).
    """
    deadline = time.monotonic() + connect_timeout_s
    delay_s, last = 0.05, None
    while True:
        try:
            sock = socket.create_connection(
                (host, port), timeout=min(5.0, connect_timeout_s),
                source_address=(source_host, 0) if source_host else None,
            )  # fmt: skip
            break
        except OSError as exc:
            last = exc
        if time.monotonic() + delay_s > deadline:
            raise WaitTimeoutError(
                f"{me}: could not connect to {peer} at {host}:{port} within "
                f"connect_timeout_s={connect_timeout_s} ({last}); is it started, bound to that "
                "address, and given the same base port?"
            )
        time.sleep(delay_s)
        delay_s = min(1.0, delay_s * 1.5)
    sock.settimeout(max(1.0, deadline - time.monotonic()))
    client_handshake(sock, key=key, session=session, client_id=me, server_id=peer, lane=LANE)
    return Link(sock, me=me, peer=peer, peer_addr=f"{host}:{port}", timeout_s=timeout_s)


class Listener:
    """This stage's bound listening socket (bound before any dialling starts)."""

    def __init__(self, bind_host: str, port: int) -> None:
        try:
            self.sock, self.endpoint = listen(bind_host, port)
        except OSError as exc:
            raise ConfigError(
                f"cannot bind {bind_host}:{port} ({exc}): a stale stage may still hold the port"
            ) from exc
        self._guard = ReplayGuard()

    @property
    def port(self) -> int:
        return self.endpoint.port

    def accept(self, *, key: bytes, session: str, me: str, expect: str,
               connect_timeout_s: float, timeout_s: float | None) -> Link:  # fmt: skip
        """Accept the previous stage's authenticated connection (others are refused)."""
        links = self.accept_many(key=key, session=session, me=me, expect={expect},
                                 connect_timeout_s=connect_timeout_s, timeout_s=timeout_s)  # fmt: skip
        return links[expect]

    def accept_many(self, *, key: bytes, session: str, me: str, expect: set[str],
                    connect_timeout_s: float, timeout_s: float | None) -> dict[str, Link]:  # fmt: skip
        """Accept one authenticated connection from each id in `expect`, in any order."""
        deadline = time.monotonic() + connect_timeout_s
        links: dict[str, Link] = {}
        while set(links) != expect:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WaitTimeoutError(
                    f"{me}: {sorted(expect - set(links))} did not connect to "
                    f"{self.endpoint.bind_host}:{self.port} within connect_timeout_s={connect_timeout_s}"
                )
            self.sock.settimeout(remaining)
            try:
                conn, addr = self.sock.accept()
            except TimeoutError:
                continue
            conn.settimeout(max(1.0, deadline - time.monotonic()))
            try:
                hello = server_handshake(
                    conn, key=key, session=session, server_id=me, guard=self._guard
                )
            except Exception as exc:  # a refused or broken handshake: keep listening
                log.warning("refused a connection from %s:%s: %s", addr[0], addr[1], exc)
                conn.close()
                continue
            if hello.client_id not in expect or hello.client_id in links:
                log.warning(
                    "refused %r from %s: expected one of %s",
                    hello.client_id,
                    addr[0],
                    sorted(expect),
                )
                conn.close()
                continue
            links[hello.client_id] = Link(conn, me=me, peer=hello.client_id,
                                          peer_addr=f"{addr[0]}:{addr[1]}", timeout_s=timeout_s)  # fmt: skip
        return links

    def close(self) -> None:
        self.sock.close()


def connect_all(listener: Listener, *, dials: list[tuple[str, int, str, str]], expect: set[str],
                key: bytes, session: str, me: str, connect_timeout_s: float,
                timeout_s: float | None) -> tuple[dict[str, Link], dict[str, Link]]:  # fmt: skip
    """Accept every id in `expect` while dialling each (host, port, as_id, peer_id) in `dials`.

    Returns (accepted links by client id, dialled links by our id). Accepting and dialling run
    at once, since every stage both waits for peers and connects to others (a cycle otherwise).
    """
    box: dict[str, Any] = {}

    def _accept() -> None:
        try:
            box["links"] = listener.accept_many(key=key, session=session, me=me, expect=expect,
                                                connect_timeout_s=connect_timeout_s, timeout_s=timeout_s)  # fmt: skip
        except BaseException as exc:  # re-raised in the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=_accept, name=f"accept-{me}", daemon=True)
    thread.start()
    bind = listener.endpoint.bind_host
    dialled: dict[str, Link] = {}
    try:
        for host, port, as_id, peer in dials:
            dialled[as_id] = dial(host, port, key=key, session=session, me=as_id, peer=peer,
                                  connect_timeout_s=connect_timeout_s, timeout_s=timeout_s,
                                  source_host=None if bind in ("", "0.0.0.0") else bind)  # fmt: skip
    except BaseException:
        for link in dialled.values():
            link.close()
        raise
    thread.join()
    if "error" in box:
        for link in dialled.values():
            link.close()
        raise box["error"]
    return box["links"], dialled


def connect_ring(listener: Listener, *, next_host: str, next_port: int, key: bytes, session: str,
                 me: str, prev: str, nxt: str, connect_timeout_s: float,
                 timeout_s: float | None) -> tuple[Link, Link]:  # fmt: skip
    """(up, down): accept from the previous stage while dialling the next (a cycle otherwise)."""
    box: dict[str, Any] = {}

    def _accept() -> None:
        try:
            box["up"] = listener.accept(key=key, session=session, me=me, expect=prev,
                                        connect_timeout_s=connect_timeout_s, timeout_s=timeout_s)  # fmt: skip
        except BaseException as exc:  # re-raised in the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=_accept, name=f"accept-{me}", daemon=True)
    thread.start()
    # Dial from our own bind address, so the peer sees (and logs) the address we bound.
    bind = listener.endpoint.bind_host
    down = dial(next_host, next_port, key=key, session=session, me=me, peer=nxt,
                connect_timeout_s=connect_timeout_s, timeout_s=timeout_s,
                source_host=None if bind in ("", "0.0.0.0") else bind)  # fmt: skip
    thread.join()
    if "error" in box:
        down.close()
        raise box["error"]
    return box["up"], down
