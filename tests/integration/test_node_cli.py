"""By-hand start of every fine-tuning process: the README's "Across hosts" example, run as it is
written (separate commands, one process each) on loopback with a tiny model.

The commands come from README.md (the block after `<!-- node-cli-example -->`), so the README
cannot drift from what is tested; only addresses, ports, paths and the device are replaced.

    .venv/bin/pytest tests/integration/test_node_cli.py -q
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from splitlab.configure import load_resolved_config
from splitlab.train.checkpoint import latest_checkpoint
from splitlab.train.final_eval import checkpoint_model
from splitlab.wire.session_key import SESSION_KEY_ENV

README = Path(__file__).resolve().parents[2] / "README.md"
MARKER = "<!-- node-cli-example -->"
TINY = [
    "model=tiny_bert",
    "data.samples_per_owner=8",
    "data.val_samples=8",
    "data.test_samples=0",  # the final evaluation on the held-out split
    "task.steps_per_round=0",  # one pass over the tiny shard
    "finetune.batch_size=4",
    "task.rounds=1",
]
BROKER = "amqp://guest:guest@127.0.0.1:5672/%2F"
WAIT_S = 300.0


def readme_example() -> list[str]:
    """The commands of the README's by-hand example, comments and blank lines dropped."""
    text = README.read_text(encoding="utf-8")
    block = text[text.index(MARKER) :].split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip() and not line.startswith("#")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_config(command: str, path: Path, *extra: str) -> None:
    """Run the README's config command (plus the tiny model) into `path`."""
    argv = shlex.split(command.split(">", 1)[0])
    assert argv[0] == "splitlab" and argv[-2:] == ["--cfg", "job"], command
    exe = Path(sys.executable).with_name("splitlab")
    out = subprocess.run(
        [str(exe), *argv[1:-2], *TINY, *extra, "--cfg", "job"],
        capture_output=True, text=True, check=True, cwd=path.parent,
    )  # fmt: skip
    path.write_text(out.stdout)


def node_argv(command: str, subs: dict[str, str], *, broker: bool) -> list[str]:
    argv = [subs.get(arg, arg) for arg in shlex.split(command)]
    assert argv[:3] == ["python", "-m", "splitlab.node"], command
    argv[0] = sys.executable
    if broker:  # the README's RabbitMQ variant: --broker instead of --control [--host-control]
        i = argv.index("--control")
        argv[i : i + 2] = ["--broker", BROKER]
        argv = [a for a in argv if a != "--host-control"]
    return argv


def wait_for_port(port: int, proc: subprocess.Popen) -> None:
    """Until the coordinator's bus accepts connections (or the coordinator has died)."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1.0).close()
            return
        except OSError:
            time.sleep(0.05)
    raise AssertionError(f"the coordinator's control bus never listened (exit {proc.poll()})")


def run_by_hand(tmp_path: Path, *, broker: bool) -> tuple[dict[str, int], Path]:
    lines = readme_example()
    config_line = next(line for line in lines if line.startswith("splitlab "))
    assert any(line.startswith(f"export {SESSION_KEY_ENV}=") for line in lines)
    nodes = [line for line in lines if line.startswith("python -m splitlab.node ")]
    roles = [shlex.split(n)[shlex.split(n).index("--role") + 1] for n in nodes]
    assert roles == ["coordinator", "worker", "owner"]
    config, run_dir = tmp_path / "config.yaml", tmp_path / "runs" / "exp1"
    write_config(config_line, config)
    bus_port = free_port()
    subs = {
        "config.yaml": str(config), "runs/exp1": str(run_dir), "exp1": f"t{uuid.uuid4().hex[:8]}",
        "10.0.0.1:29400": f"127.0.0.1:{bus_port}", "0.0.0.0": "127.0.0.1",
        "10.0.0.7": "127.0.0.1", "29500": str(free_port()), "cuda": "cpu",
    }  # fmt: skip
    env = {**os.environ, SESSION_KEY_ENV: secrets.token_hex(32), "PYTHONUNBUFFERED": "1"}
    procs: dict[str, subprocess.Popen] = {}
    try:
        for line in nodes:
            argv = node_argv(line, subs, broker=broker)
            role = argv[argv.index("--role") + 1]
            log = (tmp_path / f"{role}.log").open("w")
            procs[role] = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
            if role == "coordinator" and not broker:
                wait_for_port(bus_port, procs[role])
        codes = {role: p.wait(timeout=WAIT_S) for role, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    for role, code in codes.items():
        assert code == 0, f"{role} exited {code}:\n{(tmp_path / f'{role}.log').read_text()[-3000:]}"
    return codes, run_dir


def assert_run_folder(run_dir: Path, config: Path) -> None:
    checkpoint = latest_checkpoint(run_dir / "checkpoints")
    assert checkpoint is not None and checkpoint.round_id == 0
    model, _ = checkpoint_model(load_resolved_config(config))
    model.load_state_dict(checkpoint.state, strict=True)
    assert all(torch.isfinite(t).all() for t in checkpoint.state.values())
    traces = sorted(p.name for p in (run_dir / "traces").glob("*.jsonl"))
    assert traces == ["coordinator-0.jsonl", "owner-0.jsonl", "worker-0.jsonl"]
    records = [
        json.loads(line)
        for line in (run_dir / "traces" / "coordinator-0.jsonl").read_text().splitlines()
    ]
    weights = {r["node"]: r["weight"] for r in records if r["kind"] == "fedavg"}
    assert weights == {"owner0": 8, "worker0": 8}  # processed samples: 2 microbatches of 4


@pytest.mark.slow
@pytest.mark.assets
def test_readme_by_hand_example_embedded_bus(tmp_path: Path) -> None:
    _, run_dir = run_by_hand(tmp_path, broker=False)
    assert_run_folder(run_dir, tmp_path / "config.yaml")


@pytest.mark.slow
@pytest.mark.assets
@pytest.mark.rabbitmq
def test_readme_by_hand_example_rabbitmq(tmp_path: Path) -> None:
    _, run_dir = run_by_hand(tmp_path, broker=True)
    assert_run_folder(run_dir, tmp_path / "config.yaml")
