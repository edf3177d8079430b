"""Testbed pure cores: config -> topology, session names and addresses, the command plan,
probe arithmetic, privilege parsing, the hosts a two-sided benchmark runs on.

    .venv/bin/pytest tests/unit/test_testbed_topology.py -q
"""

from __future__ import annotations

from pathlib import Path

import pytest

from splitlab.config import schema
from splitlab.config.load import CONF_DIR
from splitlab.configure import compose_config
from splitlab.errors import ConfigError
from splitlab.testbed.cgroup import quota_us
from splitlab.testbed.netns import missing_privileges
from splitlab.testbed.pair import pair_hosts
from splitlab.testbed.plan import setup_commands, shape_command, tbf_for
from splitlab.testbed.probe import DirectionProbe, goodput_mbit, judge, probe_direction
from splitlab.testbed.session import host_command
from splitlab.testbed.topology import (
    Layout,
    delay_line_for,
    num_threads,
    shaped,
    subnet_for,
    topology_from_config,
)

PRESETS = sorted(p.stem for p in (CONF_DIR / "testbed").glob("*.yaml"))


def _cfg(**links: schema.TestbedLinkConfig) -> schema.TestbedConfig:
    return schema.TestbedConfig(
        name="t",
        hosts={"edge": schema.TestbedHostConfig(cpu=0.5), "cloud": schema.TestbedHostConfig()},
        links=dict(links),
        placement={"owner": ["edge"], "worker": ["cloud"]},
    )


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_composes_to_a_valid_topology(preset: str) -> None:
    topo = topology_from_config(compose_config([f"testbed={preset}"]).testbed)
    assert topo.name == preset
    assert topo.empty == (preset == "none")
    assert "# Numbers:" in (CONF_DIR / "testbed" / f"{preset}.yaml").read_text() or preset == "none"


def test_default_testbed_is_none_and_empty() -> None:
    cfg = compose_config()
    assert cfg.testbed.name == "none" and topology_from_config(cfg.testbed).empty


def test_unconfigured_host_gets_an_unshaped_link_and_threads_follow_cpu() -> None:
    topo = topology_from_config(_cfg(edge=schema.TestbedLinkConfig(up_mbit=2, down_mbit=8)))
    assert not shaped(topo.links["cloud"]) and shaped(topo.links["edge"])
    assert num_threads(topo.host("edge")) == 1 and num_threads(topo.host("cloud")) == 1
    assert num_threads(schema.TestbedHostConfig(cpu=1.5)) == 2
    assert num_threads(schema.TestbedHostConfig(cpu=0.5, threads=4)) == 4
    assert topo.host_of("owner", 3) == "edge"


def test_path_delay_adds_both_links() -> None:
    topo = topology_from_config(_cfg(edge=schema.TestbedLinkConfig(delay_ms=25, jitter_ms=2),
                                     cloud=schema.TestbedLinkConfig(delay_ms=1)))  # fmt: skip
    assert topo.path_delay_ms("edge", "cloud") == (26.0, 2.0)
    assert topo.path_delay_ms("edge", "edge") == (0.0, 0.0)


def test_path_rate_is_the_lower_of_the_senders_up_and_the_receivers_down() -> None:
    topo = topology_from_config(_cfg(edge=schema.TestbedLinkConfig(up_mbit=2, down_mbit=8),
                                     cloud=schema.TestbedLinkConfig(down_mbit=5)))  # fmt: skip
    assert topo.path_rate_mbit("edge", "cloud") == 2.0
    assert topo.path_rate_mbit("cloud", "edge") == 8.0  # cloud has no up shaper
    assert topo.path_rate_mbit("edge", "edge") == 0.0
    assert topology_from_config(_cfg()).path_rate_mbit("edge", "cloud") == 0.0


def test_pair_hosts_are_the_first_owner_and_worker_and_must_differ() -> None:
    assert pair_hosts(topology_from_config(_cfg())) == ("edge", "cloud")
    for preset, pair in (("lan_1g", ("edge1", "server")), ("edge_cloud_wan", ("edge1", "cloud"))):
        topo = topology_from_config(compose_config([f"testbed={preset}"]).testbed)
        assert pair_hosts(topo) == pair
    same = _cfg()
    same.placement["worker"] = ["edge"]
    with pytest.raises(ConfigError, match="owner and worker both run on 'edge'"):
        pair_hosts(topology_from_config(same))


@pytest.mark.parametrize(
    ("cfg", "key"),
    [
        (_cfg(nowhere=schema.TestbedLinkConfig()), "testbed.links.nowhere"),
        (_cfg(edge=schema.TestbedLinkConfig(up_mbit=-1)), "testbed.links.edge.up_mbit=-1"),
        (
            _cfg(edge=schema.TestbedLinkConfig(delay_ms=1, jitter_ms=2)),
            "testbed.links.edge.jitter_ms=2",
        ),
    ],
)
def test_bad_links_name_the_key(cfg: schema.TestbedConfig, key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.").replace("[", r"\[")):
        topology_from_config(cfg)


def test_bad_placement_and_host_names_name_the_key() -> None:
    cfg = _cfg()
    cfg.placement["stage"] = ["edge", "moon"]
    with pytest.raises(ConfigError, match=r"testbed\.placement\.stage\[1\]='moon'"):
        topology_from_config(cfg)
    ports = _cfg()
    ports.root_ports = [5672, 70000]
    with pytest.raises(ConfigError, match=r"testbed\.root_ports: 70000"):
        topology_from_config(ports)
    bad = schema.TestbedConfig(name="t", hosts={"Edge-1": schema.TestbedHostConfig()})
    with pytest.raises(ConfigError, match="'Edge-1'"):
        topology_from_config(bad)


def test_layout_names_fit_ifnamsiz_and_carry_the_session() -> None:
    hosts = tuple(f"h{i}" for i in range(200))
    layout = Layout(session="ab12cd", subnet=7, hosts=hosts)
    names = [layout.bridge, layout.root_if, layout.uplink_if]
    names += [n for h in hosts for n in (layout.host_if(h), layout.switch_if(h))]
    assert all(len(n) <= 15 and "ab12cd" in n for n in names)
    assert len(set(names)) == len(names)
    assert layout.address("h0") == "10.211.7.10" and layout.address("h199") == "10.211.7.209"
    assert layout.root_address == "10.211.7.1" and layout.netns("h0") == "sl-ab12cd-h0"
    with pytest.raises(ConfigError, match="session='Bad'"):
        Layout(session="Bad", subnet=0, hosts=())


def test_subnet_skips_taken_ones() -> None:
    first = subnet_for("ab12cd", set())
    assert subnet_for("ab12cd", {first}) == (first + 1) % 256
    with pytest.raises(ConfigError, match="in use"):
        subnet_for("ab12cd", set(range(256)))


def test_tbf_defaults_scale_with_rate_and_keep_minimums() -> None:
    slow, fast = tbf_for(2), tbf_for(1000)
    assert slow.rate_bit == 2_000_000 and slow.burst_bytes == 12_500  # 50 ms at the rate
    assert tbf_for(20).burst_bytes == 16 << 10  # room for timer slack
    assert tbf_for(0.0333).burst_bytes == 4 << 10  # a degraded link: no deep free bursts
    assert fast.burst_bytes == 250_000 and fast.limit_bytes == 6_250_000
    assert tbf_for(20, burst_kib=32, queue_kib=8).limit_bytes == 32 << 10  # never below burst
    with pytest.raises(ConfigError, match="rate_mbit=0"):
        tbf_for(0)


def test_plan_shapes_each_direction_on_its_own_end_and_leaves_unshaped_links_alone() -> None:
    topo = topology_from_config(_cfg(edge=schema.TestbedLinkConfig(up_mbit=2, down_mbit=8)))
    layout = Layout(session="ab12cd", subnet=3, hosts=("edge", "cloud"))
    cmds = setup_commands(topo, layout)
    tcs = [c for c in cmds if c[0] == "tc"]
    assert tcs == [shape_command(layout, "edge", "up", tbf_for(2)),
                   shape_command(layout, "edge", "down", tbf_for(8))]  # fmt: skip
    assert tcs[0][2] == "sl-ab12cd-edge" and tcs[0][6] == "slab12cdh0"
    assert tcs[1][2] == "sl-ab12cd-hub" and tcs[1][6] == "slab12cds0"
    ethtool = [c for c in cmds if "ethtool" in c]
    assert {c[3] for c in ethtool} == {"sl-ab12cd-edge", "sl-ab12cd-hub"}
    assert all("gso" in c and "tso" in c for c in ethtool)
    assert cmds[0] == ["ip", "netns", "add", "sl-ab12cd-hub"]
    # one segment a packet from every stack that sends in, shaped or not (a tbf wedges on a
    # queued packet longer than a bucket a rate change shrank)
    segs = {c[-3] for c in cmds if c[-2:] == ["gso_max_segs", "1"]}
    assert segs == {"slab12cdh0", "slab12cdh1", layout.root_if}


def test_host_command_joins_cgroups_then_enters_the_namespace() -> None:
    layout = Layout(session="ab12cd", subnet=3, hosts=("edge",))
    argv = host_command(layout, "edge", 2, ["python", "-c", "print(1)"])
    assert argv[:2] == ["sh", "-c"] and argv[-3:] == ["python", "-c", "print(1)"]
    script = argv[2]
    assert "/sys/fs/cgroup/cpu/splitlab-ab12cd/edge/cgroup.procs" in script
    assert "/sys/fs/cgroup/memory/splitlab-ab12cd/edge/cgroup.procs" in script
    assert script.index("cgroup.procs") < script.index("ip netns exec sl-ab12cd-edge")
    assert "OMP_NUM_THREADS=2" in script


def test_goodput_skips_the_warm_up() -> None:
    marks = [(0.0, 0), (0.05, 1_000_000), (0.1, 1_000_000), (1.1, 3_500_000)]
    assert goodput_mbit(marks, warm_s=0.1) == pytest.approx(20.0)
    assert goodput_mbit(marks[:1], warm_s=0.1) == 0.0


def test_judge_names_each_link_off_by_more_than_the_tolerance() -> None:
    probes = [DirectionProbe(host="edge1", direction="up", nominal_mbit=20, measured_mbit=19.0),
              DirectionProbe(host="edge2", direction="down", nominal_mbit=20, measured_mbit=17.0)]  # fmt: skip
    bad = judge(probes, 0.1)  # against 20 x 1448/1514 = 19.13 Mbit/s of TCP goodput
    assert len(bad) == 1 and "link edge2 (down)" in bad[0] and "11% off" in bad[0]
    # a link at nominal reads ~4.4% under it in headers alone: that is not counted as off
    at_nominal = DirectionProbe(host="e", direction="up", nominal_mbit=100, measured_mbit=95.0)
    assert at_nominal.off < 0.01 and not judge([at_nominal], 0.05)


def test_a_direction_reading_low_is_probed_again_and_keeps_the_closest_reading() -> None:
    def readings(*values: float):
        it = iter(values)
        return lambda: next(it)

    kw = {"host": "edge1", "direction": "up", "nominal": 20.0, "tolerance": 0.1, "attempts": 3}
    starved = probe_direction(readings(14.9, 19.2), **kw)  # a loaded host: low once, then fine
    assert (starved.measured_mbit, starved.attempts, starved.off <= 0.1) == (19.2, 2, True)
    too_slow = probe_direction(readings(10.0, 12.0, 11.0), **kw)  # low on every try: refused
    assert (too_slow.measured_mbit, too_slow.attempts) == (12.0, 3) and judge([too_slow], 0.1)
    too_fast = probe_direction(readings(40.0, 20.0), **kw)  # load cannot speed a link up
    assert (too_fast.measured_mbit, too_fast.attempts) == (40.0, 1) and judge([too_fast], 0.1)
    assert probe_direction(readings(19.5), **kw).attempts == 1


def test_missing_privileges_names_the_capabilities() -> None:
    missing = missing_privileges("Name:\tx\nCapEff:\t0000000000000000\n")
    assert any("CAP_NET_ADMIN" in m for m in missing) and any("CAP_SYS_ADMIN" in m for m in missing)
    everything = missing_privileges("CapEff:\t000001ffffffffff\n")
    assert not any("CAP_" in m for m in everything)


def test_cpu_quota() -> None:
    assert quota_us(0.5) == 50_000 and quota_us(2) == 200_000 and quota_us(0) == -1
    with pytest.raises(ConfigError, match="cpu=-1"):
        quota_us(-1)


def test_delay_line_only_where_a_path_has_delay() -> None:
    topo = topology_from_config(_cfg(edge=schema.TestbedLinkConfig(delay_ms=25)))
    assert delay_line_for(topo, "cloud", {"w2": "cloud"}) is None
    line = delay_line_for(topo, "cloud", {"owner0": "edge", "w2": "cloud"})
    assert line is not None
    try:
        assert line.path("owner0").delay_ms == 25.0 and line.path("w2").delay_ms == 0.0
        assert line.describe()["delay_source"] == "transport"
    finally:
        line.close()


def test_conf_dir_has_the_presets_the_issue_names() -> None:
    want = {"none", "lan_1g", "wifi_good", "edge_cloud_wan", "edge_cloud_constrained",
            "cellular_poor", "ring3_edge"}  # fmt: skip
    assert want <= set(PRESETS)
    assert Path(CONF_DIR / "config.yaml").read_text().count("testbed: none") == 1
