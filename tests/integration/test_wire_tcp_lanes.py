"""TCP transport: chosen lanes, dialling a peer that starts late, waiting for a peer that dials,
reading one peer of a shared lane, and channels that name a lost peer.

.venv/bin/pytest tests/integration/test_wire_tcp_lanes.py -q
"""

from __future__ import annotations

import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from splitlab.errors import PeerLostError, WaitTimeoutError
from splitlab.wire.frame import Lane
from splitlab.wire.tcp import TcpTransport

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ is not a package yet
from wire_helpers import tcp_transport  # noqa: E402


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@contextmanager
def _pair(lanes: list[Lane]) -> Iterator[tuple[TcpTransport, TcpTransport]]:
    """a dialled b on `lanes`; b has seen it."""
    a, b = tcp_transport("a", "127.0.0.2"), tcp_transport("b", "127.0.0.3")
    try:
        a.connect("b", *b.address, timeout_s=5, lanes=lanes)
        b.wait_connected("a", lanes, timeout_s=5)
        yield a, b
    finally:
        a.close(drain_timeout_s=0)
        b.close(drain_timeout_s=0)


def test_connect_opens_only_the_lanes_asked_for() -> None:
    with _pair([Lane.KV, Lane.CONTROL]) as (a, b):
        assert sorted(c["lane"] for c in b.connections()) == [Lane.CONTROL, Lane.KV]
        with pytest.raises(WaitTimeoutError, match="activation"):
            a.send("b", Lane.ACTIVATION, "x", {}, timeout_s=0.1)


def test_connect_retries_a_peer_that_starts_late() -> None:
    port = _free_port("127.0.0.3")
    a = tcp_transport("a", "127.0.0.2")
    box: dict[str, object] = {}

    def start_late() -> None:
        time.sleep(0.5)
        box["b"] = tcp_transport("b", "127.0.0.3", port=port)

    starter = threading.Thread(target=start_late)
    starter.start()
    try:
        a.connect("b", "127.0.0.3", port, timeout_s=5, lanes=[Lane.ACTIVATION], retry_s=10)
        starter.join()
        a.send("b", Lane.ACTIVATION, "hi", {"x": torch.ones(2)}).wait(5)
        with box["b"].recv(Lane.ACTIVATION, timeout_s=5) as msg:  # type: ignore[attr-defined]
            assert msg.kind == "hi" and msg.peer == "a"
    finally:
        starter.join()
        a.close(drain_timeout_s=0)
        if "b" in box:
            box["b"].close(drain_timeout_s=0)  # type: ignore[attr-defined]


def test_connect_without_a_listener_times_out_naming_the_address() -> None:
    port = _free_port("127.0.0.3")
    a = tcp_transport("a", "127.0.0.2")
    try:
        with pytest.raises(WaitTimeoutError, match=f"127.0.0.3:{port}"):
            a.connect("b", "127.0.0.3", port, timeout_s=1, retry_s=0.3)
    finally:
        a.close(drain_timeout_s=0)


def test_wait_connected_sees_a_peer_that_dials_and_names_a_missing_lane() -> None:
    with _pair([Lane.KV]) as (_, b):
        with pytest.raises(WaitTimeoutError, match="control"):
            b.wait_connected("a", [Lane.KV, Lane.CONTROL], timeout_s=0.2)


def test_recv_from_one_peer_leaves_the_other_peers_frames_on_a_shared_lane() -> None:
    mid = tcp_transport("mid", "127.0.0.2")
    prev, nxt = tcp_transport("prev", "127.0.0.1"), tcp_transport("next", "127.0.0.3")
    try:
        prev.connect("mid", *mid.address, timeout_s=5, lanes=[Lane.ACTIVATION])
        mid.connect("next", *nxt.address, timeout_s=5, lanes=[Lane.ACTIVATION])
        mid.wait_connected("prev", [Lane.ACTIVATION], timeout_s=5)
        nxt.send("mid", Lane.ACTIVATION, "from-next", {"x": torch.zeros(1)}).wait(5)
        prev.send("mid", Lane.ACTIVATION, "from-prev", {"x": torch.ones(1)}).wait(5)
        with mid.recv(Lane.ACTIVATION, timeout_s=5, peer_id="prev") as msg:
            assert (msg.kind, msg.peer) == ("from-prev", "prev")
        with pytest.raises(WaitTimeoutError):
            mid.recv(Lane.ACTIVATION, timeout_s=0.1, peer_id="prev")
        with mid.recv(Lane.ACTIVATION, timeout_s=5, peer_id="next") as msg:
            assert (msg.kind, msg.peer) == ("from-next", "next")
    finally:
        for t in (prev, mid, nxt):
            t.close(drain_timeout_s=0)


def test_a_channel_names_its_lost_peer() -> None:
    with _pair([Lane.ACTIVATION]) as (a, b):
        from_a = b.channel("a", Lane.ACTIVATION, timeout_s=5)
        a.close(drain_timeout_s=0)
        with pytest.raises(PeerLostError, match="^lost a "):
            from_a.recv()
