"""The logger group after real runs: a tiny fine-tuning run and a tiny ring with
`logger=[csv,tensorboard,mlflow]`, read back with TensorBoard's EventAccumulator and MLflow's
own client on the run's SQLite store.

    .venv/bin/pytest tests/integration/test_loggers_run.py -q
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from splitlab.configure import compose_config
from splitlab.launch.ring import run_infer
from splitlab.launch.train import run_finetune

TINY = [
    "model=tiny_bert",
    "data.samples_per_owner=8",
    "data.val_samples=8",
    "data.test_samples=0",
    "task.steps_per_round=0",
    "finetune.batch_size=4",
    "task.rounds=2",
]
ALL = "logger=[csv,tensorboard,mlflow]"


def read_events(folder: Path) -> tuple[dict[str, list[tuple[int, float]]], str]:
    """The scalars (tag -> [(step, value)]) and the config text of a TensorBoard folder."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    scalars = {tag: [(e.step, e.value) for e in events.Scalars(tag)]
               for tag in events.Tags()["scalars"]}  # fmt: skip
    text = events.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    return scalars, text


def mlflow_run(run_dir: Path):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow' / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("splitlab")
    (found,) = client.search_runs([experiment.experiment_id])
    return client, found


@pytest.mark.slow
def test_finetune_metrics_and_config_reach_every_logger(tmp_path: Path) -> None:
    cfg = compose_config([*TINY, ALL])
    run_dir = tmp_path / "run"
    cfg.run_dir = str(run_dir)

    assert run_finetune(cfg) == 0

    table = list(csv.DictReader((run_dir / "metrics.csv").open()))
    final = json.loads((run_dir / "final_metrics.json").read_text())
    loss_by_round = {int(r["round"]): float(r["loss"]) for r in table if r["owner"] == "owner0"}
    board, text = read_events(run_dir / "tensorboard")
    assert [s for s, _ in board["round/loss"]] == [1, 2]
    assert dict(board["round/owner0/loss"]) == pytest.approx(loss_by_round)
    assert board["final/val_accuracy"] == [(2, pytest.approx(final["val_accuracy"]))]
    assert "architecture:" in text

    client, run = mlflow_run(run_dir)
    history = client.get_metric_history(run.info.run_id, "round/owner0/loss")
    assert {m.step: m.value for m in history} == pytest.approx(loss_by_round)
    assert run.data.metrics["final/val_loss"] == pytest.approx(final["val_loss"])
    assert run.data.params["architecture.owners"] == "2"
    assert run.data.params["model.name"] == "tiny_bert"
    assert run.info.run_name == "run" and run.info.status == "FINISHED"
    saved = Path(client.download_artifacts(run.info.run_id, "config.yaml", str(tmp_path)))
    assert saved.read_text() == (run_dir / "config.yaml").read_text()


@pytest.mark.slow
def test_ring_tpot_reaches_tensorboard_and_mlflow(tmp_path: Path) -> None:
    cfg = compose_config(["task=infer", "model=tiny_llama", "task.max_new_tokens=4",
                          "task.ignore_eos=true", "logger=[tensorboard,mlflow]"])  # fmt: skip
    cfg.run_dir = str(tmp_path)

    assert run_infer(cfg) == 0

    result = json.loads((tmp_path / "ring_result.json").read_text())
    board, text = read_events(tmp_path / "tensorboard")
    assert "name: infer" in text
    assert board["ring/tpot_ms_median"] == [(0, pytest.approx(result["tpot_ms_median"]))]
    assert [v for _, v in board["ring/tpot_ms"]] == pytest.approx(result["tpot_ms"])
    assert len(result["tpot_ms"]) == 3  # 4 tokens: the first is TTFT
    client, run = mlflow_run(tmp_path)
    assert run.data.metrics["ring/ttft_ms"] == pytest.approx(result["ttft_ms"])
    assert run.data.params["task.name"] == "infer"
    assert not (tmp_path / "metrics.csv").exists()  # csv not selected
