"""The node entry's pure parts: host facts on top of the config, a training role from the config,
the test-only flags' parsing, the session key, and one real refusal of a missing config.

    .venv/bin/pytest tests/unit/test_node_args.py -q
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from splitlab.config.load import save_resolved_config
from splitlab.configure import compose_config, load_resolved_config
from splitlab.errors import ConfigError, ExitCode
from splitlab.node import apply_host_facts, control_address, parse_args, scripted_shifts
from splitlab.train.role import Fixture, train_role
from splitlab.wire.session_key import SESSION_KEY_ENV, session_key

TINY = [
    "model=tiny_bert",
    "data.samples_per_owner=32",
    "finetune.batch_size=4",
    "task.steps_per_round=0",
]


def test_control_address_parses_host_and_port() -> None:
    args = parse_args(["--config", "c.yaml", "--role", "owner", "--control", "10.0.0.1:29400"])
    assert control_address(args) == ("10.0.0.1", 29400)


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--role", "owner", "--control", "10.0.0.1"], "expected HOST:PORT"),
        (["--role", "owner", "--control", "h:1", "--host-control"], "for the coordinator"),
        (["--role", "coordinator", "--host-control"], "--host-control"),
    ],
)
def test_control_address_refuses_naming_the_flag(argv: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        control_address(parse_args(["--config", "c.yaml", *argv]))


def test_host_facts_override_only_this_hosts_keys() -> None:
    cfg = compose_config(TINY)
    argv = ["--config", "c.yaml", "--role", "worker", "--device", "cuda:1", "--bind", "0.0.0.0",
            "--advertise", "10.0.0.7", "--port", "29500", "--broker", "amqp://h/%2F"]  # fmt: skip
    apply_host_facts(cfg, parse_args(argv))
    assert (cfg.device, cfg.transport.bind_host, cfg.transport.advertise_host) == (
        "cuda:1", "0.0.0.0", "10.0.0.7",
    )  # fmt: skip
    assert cfg.transport.port == 29500
    assert cfg.control.name == "rabbitmq" and cfg.control.url == "amqp://h/%2F"


def test_a_training_role_takes_every_setting_from_the_config(tmp_path: Path) -> None:
    cfg = compose_config([*TINY, "finetune.lr=3e-3", "architecture.compute_weights=[2.0]",
                          "architecture.microbatches_per_window=3", "architecture.timeout_s=10"])  # fmt: skip
    worker = train_role(cfg, "worker", 0, session="s", run_dir=tmp_path)
    coordinator = train_role(cfg, "coordinator", 0, session="s", run_dir=tmp_path)
    assert (worker.name, worker.owners, worker.workers) == ("worker0", ["owner0", "owner1"],
                                                            ["worker0"])  # fmt: skip
    assert worker.finetune.lr == 3e-3 and worker.compute_weight == 2.0
    assert worker.num_windows == 3  # 32 samples / 4 per microbatch = 8, in windows of 3
    assert worker.timeout_s == 10.0 and coordinator.timeout_s == 10.0 * (3 + 2)
    assert worker.trace_dir == tmp_path / "traces"
    assert coordinator.checkpoint_dir == tmp_path / "checkpoints"


def test_worker_device_places_the_workers_only(tmp_path: Path) -> None:
    cfg = compose_config([*TINY, "architecture.worker_device=cuda:1"])
    assert train_role(cfg, "worker", 0, session="s", run_dir=tmp_path).device == "cuda:1"
    for role in ("owner", "coordinator"):
        assert train_role(cfg, role, 0, session="s", run_dir=tmp_path).device == "cpu"


def test_a_fixture_replaces_the_owners_data(tmp_path: Path) -> None:
    cfg = compose_config(TINY)
    fixture = Fixture(batches_path=tmp_path / "b.safetensors", no_coordinator=True, num_windows=1)
    owner = train_role(cfg, "owner", 1, session="s", run_dir=tmp_path, fixture=fixture)
    assert owner.data is None and owner.coordinator is None and owner.num_windows == 1
    assert train_role(cfg, "owner", 1, session="s", run_dir=tmp_path).data is cfg.data


def test_a_rank_outside_the_config_is_refused_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--rank=2"):
        train_role(compose_config(TINY), "owner", 2, session="s", run_dir=tmp_path)


def test_scripted_shifts_parse_and_refuse() -> None:
    assert scripted_shifts("4:1:1,6:2:-2") == [(4, 1, 1), (6, 2, -2)]
    with pytest.raises(ConfigError, match="TOKEN:BOUNDARY:K"):
        scripted_shifts("4:1")


def test_the_saved_config_reads_back_with_the_ring_timeouts(tmp_path: Path) -> None:
    cfg = compose_config(["task=infer", "architecture.data_timeout_s=42"])
    save_resolved_config(cfg, tmp_path / "config.yaml")
    back = load_resolved_config(tmp_path / "config.yaml")
    assert back.architecture.data_timeout_s == 42.0 and back.architecture.connect_timeout_s > 0


def test_the_session_key_must_be_long_hex(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SESSION_KEY_ENV, "ab" * 16)
    assert session_key() == bytes.fromhex("ab" * 16)
    monkeypatch.setenv(SESSION_KEY_ENV, "ab" * 8)
    with pytest.raises(ConfigError, match=SESSION_KEY_ENV):
        session_key()


def test_a_missing_config_exits_with_the_config_code_naming_it(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    done = subprocess.run(
        [sys.executable, "-m", "splitlab.node", "--config", str(missing), "--role", "owner"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == ExitCode.CONFIG, done.stderr
    assert f"--config={missing}" in done.stderr + done.stdout


def test_the_data_plane_key_is_derived_per_session_and_never_the_session_key() -> None:
    from splitlab.wire.session_key import data_plane_key

    key = bytes(range(32))
    a, b = data_plane_key("ft-1", key), data_plane_key("ft-2", key)
    assert a == data_plane_key("ft-1", key) and len(a) == 32  # every member derives the same
    assert a != b and key not in (a, b)  # one run's data plane refuses another run's peers


def test_a_node_holds_its_own_key_and_the_data_key_as_handed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from splitlab.wire.session_key import (
        DATA_KEY_ENV,
        NODE_KEY_ENV,
        data_plane_key,
        node_key,
        own_node_key,
    )

    key = bytes(range(32))
    monkeypatch.setenv(SESSION_KEY_ENV, key.hex())
    assert own_node_key("owner0") == node_key("owner0", key)  # the session key: derived
    assert node_key("owner0", key) != node_key("owner1", key) and len(node_key("o", key)) == 32
    assert data_plane_key("ft-1") == data_plane_key("ft-1", key)
    monkeypatch.delenv(SESSION_KEY_ENV)
    monkeypatch.setenv(NODE_KEY_ENV, node_key("owner1", key).hex())
    monkeypatch.setenv(DATA_KEY_ENV, data_plane_key("ft-1", key).hex())
    assert own_node_key("owner1") == node_key("owner1", key)  # as handed, nothing derived
    assert data_plane_key("ft-1") == data_plane_key("ft-1", key)
    with pytest.raises(ConfigError, match=SESSION_KEY_ENV):
        node_key("owner0")  # no session key here: no other node's credential either
    monkeypatch.setenv(NODE_KEY_ENV, "not hex")
    with pytest.raises(ConfigError, match=NODE_KEY_ENV):
        own_node_key("owner1")
