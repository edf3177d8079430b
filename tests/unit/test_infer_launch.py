"""Ring topology from the composed config: cuts, addresses, ports; the stage CLI's addressing."""

from __future__ import annotations

import pytest

from splitlab.cli import compose_config
from splitlab.errors import ConfigError
from splitlab.infer.link import KEY_ENV
from splitlab.infer.stage import is_loopback, parse_args
from splitlab.launch.ring import layout_from_config, ring_specs, stage_argv


def test_task_infer_defaults_to_three_even_stages_on_loopback() -> None:
    cfg = compose_config(["task=infer"])
    layout = layout_from_config(cfg, "model-folder", run_id="r")
    assert layout.cuts == [10, 20]
    assert layout.hosts == ["127.0.0.1"] * 3
    assert layout.loader == "shard"


def test_peer_hosts_must_match_stage_count() -> None:
    with pytest.raises(ConfigError, match="architecture.peer_hosts"):
        cfg = compose_config(["task=infer", "architecture.peer_hosts=[127.0.0.1,127.0.0.2]"])
        layout_from_config(cfg, "m", run_id="r")


def test_key_travels_in_env_not_argv() -> None:
    cfg = compose_config(["task=infer", "architecture.peer_hosts=[127.0.0.1,127.0.0.2,127.0.0.3]"])
    layout = layout_from_config(cfg, "m", run_id="r")
    specs = ring_specs(layout, run_dir=None, key_hex="ab" * 32)
    assert all(spec.env[KEY_ENV] == "ab" * 32 for spec in specs)
    assert all("ab" * 32 not in " ".join(spec.argv) for spec in specs)
    assert stage_argv(layout, 1, run_dir=None)[
        stage_argv(layout, 1, run_dir=None).index("--hosts") + 1
    ] == ("127.0.0.1,127.0.0.2,127.0.0.3")


def test_loopback_detection() -> None:
    assert is_loopback("127.0.0.3") and is_loopback("localhost")
    assert not is_loopback("10.0.0.2")


def test_stage_cli_accepts_a_block_range() -> None:
    args = parse_args(["--stage", "1", "--model", "echo", "--blocks", "2:5", "--stages", "3",
                       "--hosts", "a,b,c", "--base-port", "1"])  # fmt: skip
    assert (args.blocks, args.stages) == ("2:5", 3)
