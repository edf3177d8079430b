"""Data-connection handshake: wrong key, replay and wrong session are refused and logged.

.venv/bin/pytest tests/integration/test_wire_tcp_auth.py -q
"""

from __future__ import annotations

import logging
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from splitlab.wire.auth import proof
from splitlab.wire.errors import AuthError
from splitlab.wire.frame import FrameHeader, Lane, encode_frame, frame_bytes, read_frame
from splitlab.wire.tcp import TcpTransport

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ is not a package yet
from wire_helpers import KEY, SESSION, tcp_transport  # noqa: E402


@pytest.fixture
def server() -> Iterator[TcpTransport]:
    b = tcp_transport("b", "127.0.0.2")
    yield b
    b.close(drain_timeout_s=0)


def _msg(kind: str, **fields: str) -> bytes:
    return frame_bytes(encode_frame(FrameHeader(kind=kind, meta=fields), {}))


def _answer(sock: socket.socket) -> FrameHeader:
    header, _, _ = read_frame(sock.recv_into, max_frame_bytes=0)
    return header


def test_right_key_connects_127_0_0_1_to_127_0_0_2(server: TcpTransport) -> None:
    a = tcp_transport("a", "127.0.0.1")
    try:
        a.connect("b", *server.address, timeout_s=5)
        assert {c["remote"][0] for c in server.connections()} == {"127.0.0.1"}
        assert server.counters()["auth_ok"] == len(Lane)  # one per lane
    finally:
        a.close(drain_timeout_s=0)


def test_wrong_key_is_refused_and_logged(
    server: TcpTransport, caplog: pytest.LogCaptureFixture
) -> None:
    a = tcp_transport("a", "127.0.0.1", key=b"not the key")
    try:
        with caplog.at_level(logging.WARNING), pytest.raises(AuthError):
            a.connect("b", *server.address, timeout_s=5)
        assert server.connections() == []
        assert any("refused" in r.message or "refused" in r.getMessage() for r in caplog.records)
    finally:
        a.close(drain_timeout_s=0)


def test_wrong_session_is_refused(server: TcpTransport) -> None:
    a = tcp_transport("a", "127.0.0.1", session="another-session")
    try:
        with pytest.raises(AuthError, match="wrong session"):
            a.connect("b", *server.address, timeout_s=5)
        assert server.connections() == []
    finally:
        a.close(drain_timeout_s=0)


def test_wrong_server_identity_is_refused(server: TcpTransport) -> None:
    a = tcp_transport("a", "127.0.0.1")
    try:
        with pytest.raises(AuthError, match="expected peer 'c'"):
            a.connect("c", *server.address, timeout_s=5)
    finally:
        a.close(drain_timeout_s=0)


def test_replayed_handshake_is_refused(server: TcpTransport) -> None:
    hello = _msg("hello", session=SESSION, client_id="a", lane="activation", client_nonce="n" * 32)
    with socket.create_connection(server.address, timeout=5) as sock:  # a genuine client
        sock.sendall(hello)
        challenge = _answer(sock).meta
        answer = _msg("proof", proof=proof(KEY, "client", session=SESSION, client_id="a", server_id="b",
                                           lane="activation", client_nonce="n" * 32,
                                           server_nonce=challenge["server_nonce"]))  # fmt: skip
        sock.sendall(answer)
        assert _answer(sock).kind == "accept"
    with socket.create_connection(server.address, timeout=5) as sock:  # an eavesdropper replays it
        sock.sendall(hello + answer)
        refusal = _answer(sock)
    assert refusal.kind == "refuse" and "replayed" in refusal.meta["reason"]
