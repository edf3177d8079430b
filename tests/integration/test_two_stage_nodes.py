"""`splitlab architecture=two_stage` across real processes (loopback TCP, embedded bus).

The owner runs the first stage with `control_count` live graphs per window, the worker the last
stage with the head (labels travel to it); one round of FedAvg, then the run folder holds
metrics.csv, the traces (the owner's live-graph peak equals control_count) and a checkpoint
that loads strictly into the model the config builds, with and without a low-rank cut.

    .venv/bin/pytest tests/integration/test_two_stage_nodes.py -q
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from splitlab.analysis.report import analyze_run
from splitlab.configure import compose_config
from splitlab.launch.train import run_finetune
from splitlab.train.checkpoint import latest_checkpoint
from splitlab.train.final_eval import checkpoint_model

TWO_STAGE = [
    "model=tiny_bert",
    "architecture=two_stage",
    "architecture.cut_layers=1",
    "architecture.control_count=2",
    "data.samples_per_owner=12",
    "data.val_samples=8",
    "data.test_samples=0",  # the final evaluation on the held-out split
    "task.steps_per_round=0",  # one pass over the tiny shard
    "finetune.batch_size=4",
    "task.rounds=1",
]


def records(run_dir: Path, name: str, kind: str) -> list[dict]:
    lines = (run_dir / "traces" / f"{name}.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


@pytest.mark.slow
@pytest.mark.assets
@pytest.mark.parametrize("sft", [False, True], ids=["plain", "lowrank"])
def test_two_stage_trains_across_processes(tmp_path: Path, sft: bool) -> None:
    extra = ["finetune.sft.enabled=true", "finetune.sft.rank=4", "finetune.sft.residual=drop"]
    cfg = compose_config([*TWO_STAGE, *(extra if sft else [])])
    cfg.run_dir = str(tmp_path / "run")

    assert run_finetune(cfg) == 0

    run_dir = Path(cfg.run_dir)
    rows = list(csv.DictReader((run_dir / "metrics.csv").open()))
    assert [(r["round"], r["owner"], r["samples"]) for r in rows] == [("1", "owner0", "12")]
    assert float(rows[0]["train_loss"]) > 0 and int(rows[0]["bytes"]) > 0
    assert float(rows[0]["loss"]) > 0 and 0 <= float(rows[0]["accuracy"]) <= 1  # via the last stage
    checkpoint = latest_checkpoint(run_dir / "checkpoints")
    assert checkpoint is not None and checkpoint.round_id == 0
    model, _ = checkpoint_model(cfg)
    model.load_state_dict(checkpoint.state, strict=True)
    assert all(torch.isfinite(t).all() for t in checkpoint.state.values())
    assert any(".lowrank_" in k for k in checkpoint.state) == sft
    # 3 microbatches in windows of 2 and 1: the owner held 2 graphs at once, stepped twice
    assert [r["peak"] for r in records(run_dir, "owner-0", "live_graphs")] == [2]
    steps = [r for r in records(run_dir, "owner-0", "step") if r.get("part") == "first"]
    assert [s["num_microbatches"] for s in steps] == [2, 1]
    assert len([r for r in records(run_dir, "worker-0", "step")]) == 3  # one per microbatch
    weights = {r["node"]: r["weight"] for r in records(run_dir, "coordinator-0", "fedavg")}
    assert weights == {"owner0": 12, "worker0": 12}
    assert (run_dir / "final_metrics.json").exists()
    assert "training_rounds" in analyze_run(run_dir).figures  # task=analyze reads the folder


@pytest.mark.slow
@pytest.mark.assets
def test_tied_gpt2_trains_two_stage_through_the_cli_once_untied(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    overrides = [
        "model=tiny_gpt2", "architecture=two_stage", "model.untie_embeddings=true", "finetune=full",
        "data.samples_per_owner=8", "data.val_samples=4", "data.test_samples=0",
        "data.max_length=16", "task.steps_per_round=0", "finetune.batch_size=4", "task.rounds=1",
    ]  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "splitlab", *overrides, f"hydra.run.dir={run_dir}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip

    assert done.returncode == 0, done.stderr[-3000:]
    checkpoint = latest_checkpoint(run_dir / "checkpoints")
    assert checkpoint is not None and checkpoint.round_id == 0
    head, embedding = checkpoint.state["lm_head.weight"], checkpoint.state["transformer.wte.weight"]
    assert not torch.equal(head, embedding)  # each stage trained its own copy (finetune=full)
    model, _ = checkpoint_model(compose_config(overrides))
    model.load_state_dict(checkpoint.state, strict=True)
    assert model.lm_head.weight is not model.transformer.wte.weight
    weights = {r["node"]: r["weight"] for r in records(run_dir, "coordinator-0", "fedavg")}
    assert weights == {"owner0": 8, "worker0": 8}
