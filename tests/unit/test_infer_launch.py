"""Ring topology from the composed config: cuts, addresses, ports; the one stage command."""

from __future__ import annotations

from pathlib import Path

import pytest

from splitlab.configure import compose_config
from splitlab.errors import ConfigError
from splitlab.hosts import is_loopback
from splitlab.infer.stage import stage_run
from splitlab.infer.topology import resolve_ring
from splitlab.launch.ring import base_port_range, prepare_ring, ring_on_testbed, stage_children
from splitlab.testbed import session
from splitlab.testbed.topology import Layout, topology_from_config
from splitlab.wire.session_key import SESSION_KEY_ENV


def test_task_infer_defaults_to_three_even_stages_on_loopback() -> None:
    ring = resolve_ring(compose_config(["task=infer"]))
    assert ring.cuts == [10, 20]
    assert ring.peer_hosts == ["127.0.0.1"] * 3
    assert ring.loader.value == "shard"


def test_peer_hosts_must_match_stage_count() -> None:
    with pytest.raises(ConfigError, match="architecture.peer_hosts"):
        cfg = compose_config(["task=infer", "architecture.peer_hosts=[127.0.0.1,127.0.0.2]"])
        resolve_ring(cfg)


def test_key_travels_in_env_not_argv(tmp_path: Path) -> None:
    children = stage_children(tmp_path / "config.yaml", 3, run_dir=tmp_path, session="s",
                              key_hex="ab" * 32)  # fmt: skip
    assert all(child.env[SESSION_KEY_ENV] == "ab" * 32 for child in children)
    assert all("ab" * 32 not in " ".join(child.argv) for child in children)
    argv = next(c.argv for c in children if c.name == "stage-1")
    assert argv[1:] == ["-m", "splitlab.node", "--config", str(tmp_path / "config.yaml"),
                        "--role", "stage", "--rank", "1", "--run-dir", str(tmp_path),
                        "--session", "s"]  # fmt: skip


def test_a_stage_reads_its_address_port_and_timeouts_from_the_config(tmp_path: Path) -> None:
    cfg = compose_config([
        "task=infer", "model=tiny_llama", "architecture.peer_hosts=[127.0.0.1,127.0.0.2,127.0.0.3]",
        "architecture.base_port=29500", "architecture.data_timeout_s=7",
        "architecture.connect_timeout_s=9", "task.prompt_ids=[1,2]",
        "architecture.stage_devices=[cpu,cpu,cuda:1]", "transport.spin_us=50",
    ])  # fmt: skip
    run = stage_run(cfg, 2, session="s", run_dir=tmp_path, echo=True)
    assert (run.bind, run.ring.base_port, run.ring.cuts) == ("127.0.0.3", 29500, [2, 3])
    assert (run.ring.data_timeout_s, run.ring.connect_timeout_s) == (7.0, 9.0)
    assert run.generation.prompt_ids == [1, 2]
    assert (run.device, run.spin_us) == ("cuda:1", 50.0)
    assert stage_run(cfg, 1, session="s", run_dir=tmp_path, echo=True).device == "cpu"


def test_a_stage_without_the_rings_ports_is_refused_naming_the_key(tmp_path: Path) -> None:
    cfg = compose_config(["task=infer", "model=tiny_llama"])
    with pytest.raises(ConfigError, match="architecture.base_port"):
        stage_run(cfg, 0, session="s", run_dir=tmp_path, echo=True)


def test_loopback_detection() -> None:
    assert is_loopback("127.0.0.3") and is_loopback("localhost")
    assert not is_loopback("10.0.0.2")


def _laid_out(cfg) -> session.Testbed:
    """A Testbed with its names and addresses derived but nothing built (no root needed)."""
    tb = session.Testbed(topology_from_config(cfg.testbed), session="abc123")
    tb.layout = Layout(session="abc123", subnet=7, hosts=tuple(cfg.testbed.hosts))
    return tb


def test_testbed_ring_puts_every_stage_and_the_head_on_its_host() -> None:
    cfg = compose_config(
        ["task=infer", "testbed=ring3_edge", "testbed.placement.stage=[dev2,dev0,dev1]"]
    )
    ring = ring_on_testbed(cfg, _laid_out(cfg))
    assert ring.peer_hosts == ["10.211.7.12", "10.211.7.10", "10.211.7.11"]
    assert ring.ctrl_host == "10.211.7.12"


def test_testbed_ring_refuses_addresses_set_by_hand() -> None:
    cfg = compose_config(["task=infer", "testbed=ring3_edge",
                          "architecture.peer_hosts=[127.0.0.1,127.0.0.2,127.0.0.3]"])  # fmt: skip
    with pytest.raises(ConfigError, match="architecture.peer_hosts.*testbed.placement.stage"):
        ring_on_testbed(cfg, _laid_out(cfg))


def test_a_testbed_config_needs_its_testbed_up(tmp_path: Path) -> None:
    cfg = compose_config(["task=infer", "testbed=ring3_edge"])
    with pytest.raises(ConfigError, match="testbed=ring3_edge: the ring's testbed is not up"):
        prepare_ring(cfg, tmp_path, echo=True)


def test_stage_children_run_inside_their_hosts(tmp_path: Path) -> None:
    cfg = compose_config(["task=infer", "testbed=ring3_edge"])
    children = stage_children(tmp_path / "config.yaml", 3, run_dir=tmp_path, session="s",
                              key_hex="ab" * 32, testbed=_laid_out(cfg))  # fmt: skip
    argv = " ".join(next(c.argv for c in children if c.name == "stage-2"))
    assert "ip netns exec sl-abc123-dev2 env OMP_NUM_THREADS=1" in argv
    assert argv.endswith("--bind 10.211.7.12")  # the stage binds its host's address
    assert "splitlab-abc123/dev2/cgroup.procs" in argv


def test_stage_on_a_testbed_delays_only_paths_with_a_delay(tmp_path: Path) -> None:
    cfg = compose_config(["task=infer", "testbed=ring3_edge", "testbed.links.dev1.delay_ms=3",
                          "architecture.base_port=30000"])  # fmt: skip
    run = stage_run(cfg, 0, session="s", run_dir=tmp_path, echo=True)
    assert run.testbed_host == "dev0"
    line = run.delay_line()
    try:
        assert line is not None and line.describe()["path_delay_ms"] == {"stage-1": 3.0}
    finally:
        line.close()
    plain = compose_config(["task=infer", "testbed=ring3_edge", "architecture.base_port=30000"])
    assert stage_run(plain, 0, session="s", run_dir=tmp_path, echo=True).delay_line() is None


def test_base_ports_are_drawn_below_the_ephemeral_range() -> None:
    assert base_port_range(3, (32768, 60999)) == (20000, 32765)  # Linux's default range
    assert base_port_range(3, (20500, 60999)) == (20000, 59997)  # no room below: as before
    assert base_port_range(3, None) == (20000, 59997)
