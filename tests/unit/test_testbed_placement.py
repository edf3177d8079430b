"""Testbed placement as values: each role's host, its node command's host facts, the broker
URL through the relay, and the delay line a node gets from the topology. No kernel is touched
(the session's layout is set by hand, nothing is built).

    .venv/bin/pytest tests/unit/test_testbed_placement.py -q
"""

from __future__ import annotations

import shlex

import pytest

from splitlab.configure import compose_config
from splitlab.errors import ConfigError
from splitlab.testbed import session
from splitlab.testbed.placement import (
    CONTROL_PORT,
    broker_url,
    control_address,
    fetch_node_assets,
    node_argv,
    node_delay_line,
    place,
)
from splitlab.testbed.topology import Layout, topology_from_config

NODE = ["python", "-m", "splitlab.node", "--config", "c.yaml"]


def _testbed(preset: str = "edge_cloud_wan") -> session.Testbed:
    topology = topology_from_config(compose_config([f"testbed={preset}"]).testbed)
    tb = session.Testbed(topology, session="abc123")
    tb.layout = Layout(session="abc123", subnet=7, hosts=tuple(tb.topology.hosts))
    return tb


def test_each_role_lives_on_its_placed_host() -> None:
    tb = _testbed()
    assert [place(tb, "owner", r).host for r in range(3)] == ["edge1", "edge2", "edge1"]
    worker = place(tb, "worker", 0)
    assert (worker.host, worker.address, worker.threads) == ("cloud", "10.211.7.12", 1)
    assert control_address(tb) == ("10.211.7.12", CONTROL_PORT)
    with pytest.raises(ConfigError, match="no entry for role 'stage'"):
        place(tb, "stage", 0)


def test_node_argv_puts_every_address_on_the_testbed_inside_the_host() -> None:
    tb = _testbed()
    argv = node_argv(tb, "coordinator", 0, [*NODE, "--control", "10.211.7.12:29400"])
    script = argv[2]
    assert "ip netns exec sl-abc123-cloud" in script and "splitlab-abc123/cloud" in script
    inner = argv[4:]
    assert inner[-5:] == ["--bind", "10.211.7.12", "--advertise", "10.211.7.12", "--host-control"]
    owner = node_argv(tb, "owner", 1, NODE, broker="amqp://guest:guest@127.0.0.1:5672/%2F")[4:]
    assert owner[-6:] == ["--bind", "10.211.7.11", "--advertise", "10.211.7.11",
                          "--broker", "amqp://guest:guest@10.211.7.1:5672/%2F"]  # fmt: skip
    assert "--host-control" not in node_argv(tb, "worker", 0, [*NODE, "--control", "x:1"])
    stage = node_argv(_testbed("ring3_edge"), "stage", 2, NODE)
    assert stage[4:][-2:] == ["--bind", "10.211.7.12"] and "sl-abc123-dev2" in shlex.join(stage)


@pytest.mark.parametrize(
    ("url", "want"),
    [
        ("amqp://guest:guest@127.0.0.1:5672/%2F", "amqp://guest:guest@10.0.0.1:5672/%2F"),
        ("amqp://localhost/vh", "amqp://10.0.0.1/vh"),
        ("amqp://u:p@[::1]:5673/", "amqp://u:p@10.0.0.1:5673/"),
    ],
)
def test_broker_url_goes_to_the_relay(url: str, want: str) -> None:
    assert broker_url(url, "10.0.0.1") == want


def test_node_delay_line_is_the_path_delay_to_each_peer() -> None:
    cfg = compose_config(["testbed=edge_cloud_wan", "testbed.links.edge2.delay_ms=10.0",
                          "testbed.links.edge2.jitter_ms=2.0"]).testbed  # fmt: skip
    peers = {"owner0": ("owner", 0), "owner1": ("owner", 1), "worker0": ("worker", 0)}
    line = node_delay_line(cfg, "worker", 0, peers)
    assert line is not None
    try:
        described = line.describe()
        assert described["delay_source"] == "transport"
        assert described["path_delay_ms"] == {"owner0": 25.0, "owner1": 10.0}
        assert line.paths["owner1"].jitter_ms == 2.0
    finally:
        line.close()
    owner = node_delay_line(cfg, "owner", 0, peers)
    assert owner is not None
    owner.close()
    assert owner.describe()["path_delay_ms"] == {"owner1": 35.0, "worker0": 25.0}
    assert node_delay_line(compose_config([]).testbed, "owner", 0, peers) is None
    assert node_delay_line(compose_config(["testbed=ring3_edge"]).testbed, "stage", 0,
                           {"s1": ("stage", 1)}) is None  # fmt: skip


def test_a_testbed_run_fetches_its_packaged_assets_in_the_root_namespace(monkeypatch) -> None:
    from splitlab import assets

    fetched: list[str] = []
    monkeypatch.setattr(assets, "fetch", fetched.append)  # the registry is not a unit's to call
    fetch_node_assets(compose_config(["testbed=none"]))
    assert fetched == []  # on loopback every node reaches the registry itself
    cfg = compose_config(["testbed=edge_cloud_wan"])
    fetch_node_assets(cfg)
    expected = [cfg.model.id, cfg.model.tokenizer, cfg.data.name]  # the main job's: all assets
    assert fetched == [n for n in dict.fromkeys(expected) if n in assets.ASSETS]
    assert fetched and set(fetched) <= set(assets.ASSETS)
