"""The handshake: proofs bind every transcript field, the replay guard is bounded, and a
stranger is held to small frames and one deadline (over a real socket pair).

.venv/bin/pytest tests/unit/test_wire_auth.py -q
"""

from __future__ import annotations

import socket
import struct
import threading
import time

import pytest

from splitlab.wire.auth import MAX_HANDSHAKE_HEADER_BYTES, ReplayGuard, proof, server_handshake
from splitlab.wire.errors import AuthError
from splitlab.wire.header import Lane, Routing, encode_header

IDS = dict(
    session="s", client_id="a", server_id="b", lane="activation", client_nonce="c", server_nonce="n"
)


@pytest.mark.parametrize("field", sorted(IDS))
def test_proof_changes_with_every_transcript_field(field: str) -> None:
    assert proof(b"k", "client", **IDS) != proof(b"k", "client", **(IDS | {field: "other"}))


def test_client_and_server_proofs_differ() -> None:
    assert proof(b"k", "client", **IDS) != proof(b"k", "server", **IDS)


def test_replay_guard_refuses_a_seen_nonce_and_forgets_the_oldest() -> None:
    guard = ReplayGuard(max_nonces=2)
    assert guard.first_use("x") and not guard.first_use("x")
    guard.first_use("y")
    guard.first_use("z")
    assert guard.first_use("x")


def _server_on(sock: socket.socket, timeout_s: float) -> BaseException | None:
    try:
        server_handshake(sock, key=b"k", session="s", server_id="b", guard=ReplayGuard(),
                         timeout_s=timeout_s)  # fmt: skip
    except BaseException as exc:  # noqa: BLE001 - the test inspects what it was
        return exc
    return None


def test_one_deadline_bounds_the_whole_handshake_not_each_read() -> None:
    server, client = socket.socketpair()
    server.settimeout(5.0)  # each read alone would wait this long
    try:
        hello = encode_header("hello", Lane.ACTIVATION, Routing(), None, 0,
                              {"session": "s", "client_id": "a", "lane": "x",
                               "client_nonce": "n"}, [])  # fmt: skip

        def trickle() -> None:
            for i in range(len(hello)):
                try:
                    client.send(hello[i : i + 1])
                except OSError:
                    return
                time.sleep(0.05)

        threading.Thread(target=trickle, daemon=True).start()
        started = time.monotonic()
        exc = _server_on(server, timeout_s=0.5)
        assert isinstance(exc, TimeoutError) and time.monotonic() - started < 2.0
    finally:
        server.close()
        client.close()


def test_a_stranger_cannot_announce_a_large_frame_before_the_proof() -> None:
    server, client = socket.socketpair()
    try:
        client.sendall(struct.pack(">I", MAX_HANDSHAKE_HEADER_BYTES + 1))
        exc = _server_on(server, timeout_s=2.0)
        assert isinstance(exc, AuthError) and "header cap" in str(exc)
    finally:
        server.close()
        client.close()
