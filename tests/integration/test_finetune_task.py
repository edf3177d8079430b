"""task=finetune end to end: real processes, real data pipeline, loopback TCP, embedded bus or
RabbitMQ; the run folder; a worker SIGKILLed mid-window and the resume after it.

    .venv/bin/pytest tests/integration/test_finetune_task.py -q
"""

from __future__ import annotations

import csv
import json
import logging
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from control_helpers import require_rabbitmqctl
from report_helpers import headline_rows

from splitlab.analysis.report import analyze_run
from splitlab.config.load import save_resolved_config
from splitlab.configure import compose_config, load_resolved_config
from splitlab.control import broker_users
from splitlab.control.embedded import EmbeddedBusServer
from splitlab.control.membership import new_session_key_hex
from splitlab.errors import ExitCode
from splitlab.launch.supervisor import LAUNCHER_PID_ENV
from splitlab.launch.train import node_children, run_finetune
from splitlab.launch.zygote import Zygotes
from splitlab.models.load import load_model
from splitlab.train.checkpoint import completed_rounds, latest_checkpoint
from splitlab.wire.session_key import SESSION_KEY_ENV

TINY = [
    "model=tiny_bert",
    "data.samples_per_owner=16",
    "data.val_samples=16",
    "data.test_samples=0",  # the final evaluation on the held-out split
    "task.steps_per_round=0",  # one pass over the tiny shard
    "finetune.batch_size=4",
    "task.rounds=2",
]


def config(tmp_path: Path, *overrides: str):
    cfg = compose_config([*TINY, *overrides])
    cfg.run_dir = str(tmp_path / "run")
    return cfg


def assert_merged_loads_strictly(cfg, run_dir: Path, rounds: int) -> None:
    checkpoint = latest_checkpoint(run_dir / "checkpoints")
    assert checkpoint is not None and checkpoint.round_id == rounds - 1
    model, _ = load_model(cfg.model, load_tokenizer=False)
    model.load_state_dict(checkpoint.state, strict=True)  # original keys, nothing missing
    for value in checkpoint.state.values():
        assert torch.isfinite(value).all()


@pytest.mark.slow
def test_default_shape_writes_the_run_folder(tmp_path: Path) -> None:
    cfg = config(tmp_path)

    code = run_finetune(cfg)

    run_dir = Path(cfg.run_dir)
    assert code == 0
    rows = list(csv.DictReader((run_dir / "metrics.csv").open()))
    assert [(r["round"], r["owner"]) for r in rows] == [
        ("1", "owner0"), ("1", "owner1"), ("2", "owner0"), ("2", "owner1"),
    ]  # fmt: skip
    assert all(float(r["accuracy"]) >= 0 and int(r["samples"]) == 16 for r in rows)
    assert all(int(r["bytes"]) > 0 for r in rows)
    assert (run_dir / "training_rounds.png").stat().st_size > 0
    assert load_resolved_config(run_dir / "config.yaml").architecture.owners == 2
    traces = sorted(p.name for p in (run_dir / "traces").glob("*.jsonl"))
    assert traces == ["coordinator-0.jsonl", "owner-0.jsonl", "owner-1.jsonl", "worker-0.jsonl"]
    peaks = [
        json.loads(line)
        for line in (run_dir / "traces" / "worker-0.jsonl").read_text().splitlines()
        if '"live_graphs"' in line
    ]
    assert len(peaks) == 2 and all(1 <= p["peak"] <= 8 for p in peaks)
    assert_merged_loads_strictly(cfg, run_dir, rounds=2)
    # the main job wrote report.html, led by final_metrics.json; task=analyze redraws it: every
    # training figure holds data, but WRR, which one worker makes a wall of identical bars
    final = json.loads((run_dir / "final_metrics.json").read_text())
    written = headline_rows((run_dir / "analysis" / "report.html").read_text(encoding="utf-8"))
    assert written["test_accuracy"]["value"] == final["val_accuracy"]
    assert written["wall_s"]["value"] == final["wall_s"] > 0
    report = analyze_run(run_dir)
    training = {"training_rounds", "bytes_per_microbatch", "transport"}
    assert training <= set(report.figures), report.skipped
    assert "one worker" in report.skipped["wrr"]
    assert all(report.figures[name].stat().st_size > 0 for name in training)
    assert "<img" in report.path.read_text(encoding="utf-8")


@pytest.mark.slow
def test_a_normal_run_is_quiet_and_keeps_only_what_it_is_told(tmp_path: Path) -> None:
    cfg = config(tmp_path, "task.rounds=3", "task.keep_checkpoints=last")
    run_dir, ckpts = Path(cfg.run_dir), Path(cfg.run_dir) / "checkpoints"

    assert run_finetune(cfg) == 0
    assert completed_rounds(ckpts) == [2]  # rounds 0 and 1 were pruned after round 2's save
    stale = ckpts / ".round-000004.safetensors.tmp-99999"  # what a killed write leaves
    stale.write_bytes(b"\0" * 4096)
    resumed = config(tmp_path, "task.rounds=4", "task.resume=true", "task.keep_checkpoints=last")
    assert run_finetune(resumed) == 0

    assert not stale.exists()
    assert sorted(p.name for p in ckpts.iterdir()) == ["round-000004.safetensors"]  # round 4 of 4
    logs = sorted((run_dir / "logs").glob("*.log"))
    assert [p.stem for p in logs] == ["coordinator", "final-eval", "owner0", "owner1", "worker0"]
    for path in logs:  # both runs, appended: an orderly start, run and shutdown say no more
        lines = path.read_text().splitlines()
        noisy = [line for line in lines if re.search(r"\b(WARNING|ERROR|Traceback)\b", line)]
        assert not noisy, f"{path.name}: {noisy}"
    coordinator = (run_dir / "logs" / "coordinator.log").read_text()
    assert "round 4/4 done" in coordinator
    assert re.search(r"checkpoints \(keep_checkpoints=last\): 1 files, [\d.]+ MiB", coordinator)


@pytest.mark.slow
def test_four_owners_two_workers_embedded(tmp_path: Path) -> None:
    cfg = config(tmp_path, "architecture.owners=4", "architecture.workers=2")

    code = run_finetune(cfg)

    assert code == 0
    rows = list(csv.DictReader((Path(cfg.run_dir) / "metrics.csv").open()))
    assert len(rows) == 8
    assert_merged_loads_strictly(cfg, Path(cfg.run_dir), rounds=2)


@pytest.mark.slow
@pytest.mark.rabbitmq
def test_four_owners_two_workers_rabbitmq_as_node_users(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Over the broker with one broker user per node (control.node_users): the run trains
    as with a shared login and leaves no vhost or user behind."""
    cfg = config(
        tmp_path, "architecture.owners=4", "architecture.workers=2",
        "control=rabbitmq", "transport=rabbitmq", "control.node_users=true",
    )  # fmt: skip
    require_rabbitmqctl()
    caplog.set_level(logging.INFO, logger="splitlab.launch.train")

    code = run_finetune(cfg)

    assert code == 0
    assert "with 7 node users" in caplog.text
    session = re.search(r"session (ft-[0-9a-f]+)", caplog.text)
    assert session is not None, caplog.text
    # this run's vhost and users only: a test on the other worker may hold its own meanwhile
    # (tests/faults/test_broker_faults.py leaves a killed launcher's until it removes them)
    assert session.group(1) not in broker_users.leftovers()
    rows = list(csv.DictReader((Path(cfg.run_dir) / "metrics.csv").open()))
    assert len(rows) == 8
    assert_merged_loads_strictly(cfg, Path(cfg.run_dir), rounds=2)


def _opens(trace: Path, after_ts: int) -> int:
    if not trace.exists():
        return 0
    lines = trace.read_text().splitlines()
    return sum(1 for line in lines if '"open"' in line and json.loads(line)["ts_us"] > after_ts)


@pytest.mark.slow
def test_sigkill_worker_mid_window_then_resume(tmp_path: Path) -> None:
    cfg = config(
        tmp_path, "architecture.owners=2", "architecture.workers=2", "task.rounds=3",
        "task.steps_per_round=48", "architecture.timeout_s=15",
    )  # fmt: skip
    run_dir = Path(cfg.run_dir)
    save_resolved_config(cfg, run_dir / "config.yaml")
    key_hex = new_session_key_hex()
    server = EmbeddedBusServer(authkey=bytes.fromhex(key_hex))
    address = server.start()
    env = {**os.environ, SESSION_KEY_ENV: key_hex, "PYTHONUNBUFFERED": "1"}
    children = node_children(
        cfg, run_dir / "config.yaml", run_dir=run_dir, session="killtest",
        control=(address.host, address.port), env={},
    )  # fmt: skip
    # forked from one zygote, as the launcher starts them (one torch import, not five)
    zygotes = Zygotes([c.argv for c in children], pid_env=LAUNCHER_PID_ENV)
    procs = {}
    for c in children:
        with c.log_path.open("w") as out:
            procs[c.name] = zygotes.spawn(list(c.argv), env, out.fileno()) or subprocess.Popen(
                list(c.argv), env=env, stdout=out, stderr=subprocess.STDOUT
            )
    try:
        deadline = (
            time.monotonic() + 600
        )  # a bound on waiting (a loaded 2-core machine), not a speed check
        while not completed_rounds(run_dir / "checkpoints"):  # round 0 is on disk
            assert time.monotonic() < deadline, "round 0 never finished"
            time.sleep(0.05)
        saved = latest_checkpoint(run_dir / "checkpoints")
        assert saved is not None
        after = time.time_ns() // 1000
        while _opens(run_dir / "traces" / "worker-1.jsonl", after) < 1:  # inside a window
            assert time.monotonic() < deadline, "round 1 never opened a window"
            time.sleep(0.01)

        os.kill(procs["worker1"].pid, signal.SIGKILL)

        killed_at = time.monotonic()
        codes = {n: p.wait(timeout=60) for n, p in procs.items() if n != "worker1"}
        waited_s = time.monotonic() - killed_at
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        zygotes.close()
        server.close()

    assert all(code != 0 for code in codes.values()), codes
    assert waited_s < 15 + 10
    for name in codes:
        text = (run_dir / "logs" / f"{name}.log").read_text()
        assert "worker1" in text, f"{name} does not name the dead worker:\n{text[-2000:]}"
    after_kill = latest_checkpoint(run_dir / "checkpoints")
    assert after_kill is not None and after_kill.round_id == saved.round_id  # intact, not torn
    assert after_kill.state.keys() == saved.state.keys()

    resumed = config(
        tmp_path, "architecture.owners=2", "architecture.workers=2", "task.rounds=3",
        "task.steps_per_round=48", "task.resume=true",
    )  # fmt: skip
    assert run_finetune(resumed) == 0
    assert completed_rounds(run_dir / "checkpoints")[-1] == 2
    rows = list(csv.DictReader((run_dir / "metrics.csv").open()))
    assert {r["round"] for r in rows} >= {"2", "3"}
    assert ExitCode.OK == 0
