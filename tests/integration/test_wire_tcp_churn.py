"""TCP transport under churn: hundreds of authenticated peers that connect and leave on a lane
nobody drains must not wedge the lane; a legitimate peer still connects and is read.

.venv/bin/pytest tests/integration/test_wire_tcp_churn.py -q
"""

from __future__ import annotations

import gc
import os
import socket
import struct
import threading
import time

import pytest
import torch
from wire_helpers import KEY, SESSION, tcp_transport

from splitlab.errors import PeerLostError, ProtocolError
from splitlab.wire.auth import client_handshake
from splitlab.wire.base import Message
from splitlab.wire.frame import Lane

CHURN = 500  # past the ~278 connect/close events that used to fill the lane's wake-up pipe


def _churn(address: tuple[str, int], lane: Lane, n: int) -> None:
    for _ in range(n):
        with socket.create_connection(address, timeout=5) as sock:
            client_handshake(sock, key=KEY, session=SESSION, client_id="churn", server_id="b",
                             lane=lane.value, timeout_s=5)  # fmt: skip


def _first_from(b, peer: str, lane: Lane, deadline: float) -> Message | None:  # noqa: ANN001
    """recv on the whole lane, skipping the churn peers' goodbyes, until `peer`'s frame."""
    while time.monotonic() < deadline:
        try:
            msg = b.recv(lane, timeout_s=max(deadline - time.monotonic(), 0.01))
        except PeerLostError:
            continue
        if msg.peer == peer:
            return msg
        msg.release()
    return None


def test_connect_close_churn_on_an_undrained_lane_never_wedges_it() -> None:
    lane = Lane.ACTIVATION
    a, b = tcp_transport("a", "127.0.0.2"), tcp_transport("b", "127.0.0.3")
    got: list[Message | None] = []
    done = False
    try:
        fds = len(os.listdir("/proc/self/fd"))
        _churn(b.address, lane, CHURN)  # nobody reads b's activation lane meanwhile
        assert len(os.listdir("/proc/self/fd")) - fds < 10, "churned sockets pile up"
        started = time.monotonic()
        a.connect("b", *b.address, timeout_s=5, lanes=[lane])
        a.send("b", lane, "act", {"x": torch.arange(4.0)}, timeout_s=5)
        # on a thread: a wedged recv must fail this test, not hang it
        reader = threading.Thread(
            target=lambda: got.append(_first_from(b, "a", lane, started + 10)), daemon=True
        )
        reader.start()
        reader.join(timeout=15)
        assert not reader.is_alive(), "recv wedged after connect/close churn"
        assert got[0] is not None, "the legitimate peer's frame never arrived"
        assert torch.equal(got[0].tensors["x"], torch.arange(4.0))
        got[0].release()
        assert time.monotonic() - started < 10
        # every churned connection was closed and forgotten: fds do not pile up
        assert [c["peer"] for c in b.connections()] == ["a"]
        done = True
    finally:
        a.close(drain_timeout_s=0)
        if done:  # a wedged transport cannot be closed
            b.close(drain_timeout_s=0)


def test_peers_dropped_for_bad_frames_release_their_sockets_at_once() -> None:
    """A connection dropped for a malformed frame closes its socket then, not when the garbage
    collector breaks the cycle through its stored error (a stream of bad peers held one fd
    each until then)."""
    lane = Lane.ACTIVATION
    b = tcp_transport("b", "127.0.0.3")
    gc.disable()
    try:
        fds = len(os.listdir("/proc/self/fd"))
        for i in range(40):
            with socket.create_connection(b.address, timeout=5) as sock:
                client_handshake(sock, key=KEY, session=SESSION, client_id=f"bad{i}",
                                 server_id="b", lane=lane.value, timeout_s=5)  # fmt: skip
                sock.sendall(struct.pack(">I", 5) + b"{bad}")
                with pytest.raises(ProtocolError, match="not valid JSON"):
                    b.recv(lane, timeout_s=5)
        assert len(os.listdir("/proc/self/fd")) - fds < 5, "dropped peers' sockets stay open"
    finally:
        gc.enable()
        b.close(drain_timeout_s=0)


def test_lost_peers_are_remembered_up_to_a_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    """Peers with made-up ids that connect and go cannot grow the transport: it remembers the
    newest MAX_LOST_PEERS losses (one each used to be kept forever)."""
    monkeypatch.setattr("splitlab.wire.tcp.MAX_LOST_PEERS", 8)
    lane = Lane.ACTIVATION
    b = tcp_transport("b", "127.0.0.3")
    try:
        for i in range(20):
            with socket.create_connection(b.address, timeout=5) as sock:
                client_handshake(sock, key=KEY, session=SESSION, client_id=f"gone{i}",
                                 server_id="b", lane=lane.value, timeout_s=5)  # fmt: skip
            with pytest.raises(PeerLostError, match=f"gone{i}"):
                b.recv(lane, timeout_s=5)
        assert list(b._lost) == [f"gone{i}" for i in range(12, 20)]
        with pytest.raises(PeerLostError, match="gone19"):
            b.send("gone19", lane, "x", {}, timeout_s=1)
    finally:
        b.close(drain_timeout_s=0)
