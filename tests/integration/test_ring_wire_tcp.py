"""The ring's connections over real TCP: every stage dials at once, then the ring's hidden
states, KV in both directions and the control star all flow, on distinct loopback addresses.

.venv/bin/pytest tests/integration/test_ring_wire_tcp.py -q
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest
import torch

from splitlab.control.messages import Ack, BarrierCommit
from splitlab.infer.ring_wire import RingLinks, link_addresses, link_tcp_ring, stage_peer
from splitlab.launch.ring import pick_base_port
from splitlab.wire.frame import Lane
from splitlab.wire.tcp import TcpTransport

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ is not a package yet
from wire_helpers import tcp_transport  # noqa: E402

HOSTS = ["127.0.0.1", "127.0.0.2", "127.0.0.3"]


def _ring(hosts: list[str], *, window: int) -> tuple[list[TcpTransport], list[RingLinks]]:
    """Every stage's transport and links, linked concurrently (as separate processes would)."""
    base = pick_base_port(hosts)
    transports = [tcp_transport(stage_peer(i), h, port=base + i) for i, h in enumerate(hosts)]
    links: list[RingLinks | BaseException | None] = [None] * len(hosts)

    def link(i: int) -> None:
        try:
            links[i] = link_tcp_ring(transports[i], stage=i, hosts=hosts, base_port=base,
                                     ctrl_host=hosts[0], window=window, connect_timeout_s=20,
                                     timeout_s=10, ctrl_timeout_s=5)  # fmt: skip
        except BaseException as exc:  # re-raised below
            links[i] = exc

    threads = [threading.Thread(target=link, args=(i,)) for i in reversed(range(len(hosts)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for got in links:
        if isinstance(got, BaseException):
            raise got
    return transports, links  # type: ignore[return-value]


@pytest.fixture
def ring3():
    transports, links = _ring(HOSTS, window=2)
    yield transports, links
    for t in transports:
        t.close(drain_timeout_s=0)


def test_hidden_states_go_around_and_links_name_the_neighbours(ring3) -> None:
    transports, links = ring3
    links[0].down.send("hidden", {"hidden_BTH": torch.ones(1, 1, 8)}, meta={"step": 0})
    for i in (1, 2):
        with links[i].up.recv() as msg:
            h = msg.tensors["hidden_BTH"] + i
        links[i].down.send("hidden", {"hidden_BTH": h}, meta={"step": 0})
    with links[0].up.recv() as msg:
        assert msg.tensors["hidden_BTH"].flatten().tolist() == [4.0] * 8
    for i in range(3):
        got = link_addresses(transports[i], stage=i, num_stages=3)
        assert got["up"].split(":")[0] == HOSTS[i - 1]
        assert got["down"].split(":")[0] == HOSTS[(i + 1) % 3]


def test_kv_moves_both_ways_between_neighbours(ring3) -> None:
    _, links = ring3
    links[1].kv_next.send("kv", {"k0": torch.full((1, 2, 3, 4), 1.0)}, meta={"epoch": 1})
    links[2].kv_prev.send("kv", {"k0": torch.full((1, 2, 3, 4), 2.0)}, meta={"epoch": 1})
    with links[2].kv_prev.recv() as down, links[1].kv_next.recv() as up:
        assert down.tensors["k0"].mean().item() == 1.0 and up.tensors["k0"].mean().item() == 2.0
    assert links[0].kv_prev is None and links[2].kv_next is None


def test_control_star_carries_messages_both_ways(ring3) -> None:
    _, links = ring3
    for i in (1, 2):
        links[0].ctrls[i].send(BarrierCommit(epoch=i))
    for i in (1, 2):
        assert links[i].ctrl.recv() == BarrierCommit(epoch=i)
        links[i].ctrl.send(Ack(epoch=i, stage=i))
    assert [links[0].ctrls[i].recv() for i in (1, 2)] == [
        Ack(epoch=1, stage=1),
        Ack(epoch=2, stage=2),
    ]


def test_two_stages_share_one_activation_connection() -> None:
    transports, links = _ring(HOSTS[:2], window=0)
    try:
        assert [c["lane"] for c in transports[1].connections()] == [Lane.ACTIVATION]
        links[0].down.send("hidden", {"h": torch.ones(2)})
        with links[1].up.recv() as msg:
            links[1].down.send("token", {"t": msg.tensors["h"].long()})
        with links[0].up.recv() as msg:
            assert msg.kind == "token"
    finally:
        for t in transports:
            t.close(drain_timeout_s=0)
