"""The SFT rank study: the script in --quick mode writes the table, the curves and the figures
with real numbers and resumes without retraining; `splitlab -m task=sft_rank` runs arms as
Hydra jobs into one study folder; `task=analyze` on a folder draws both figures.

.venv/bin/pytest tests/integration/test_sft_rank_study.py -q -m "slow"
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from splitlab.analysis.report import analyze_run

ROOT = Path(__file__).resolve().parents[2]
SPLITLAB = [sys.executable, "-m", "splitlab"]


@pytest.mark.slow
@pytest.mark.assets
def test_quick_study_writes_table_curves_and_plots_and_resumes(tmp_path: Path) -> None:
    out = tmp_path / "run"
    script = [
        sys.executable,
        str(ROOT / "experiments/sft_rank/run.py"),
        "--quick",
        "--out",
        str(out),
    ]

    subprocess.run(script, check=True, cwd=ROOT, timeout=600)

    table = pd.read_csv(out / "sft_rank.csv")
    assert list(table["label"]) == [
        "baseline",
        "lower/keep",
        "lower/drop",
        "upper/keep",
        "upper/drop",
    ]
    assert table["accuracy"].between(0, 1).all() and (table["train_s"] > 0).all()
    assert (table["seeds"] == 1).all() and (table["steps"] == 4).all()
    drop = table[table["residual"] == "drop"]
    baseline = table[table["label"] == "baseline"].iloc[0]
    # measured on the wire: a dropped-residual cut at R=8 moves ~H/R = 48x fewer bytes
    for _, row in drop.iterrows():
        column = "front" if row["depth"] == "lower" else "tail"
        ratio = baseline[f"bytes_per_step_{column}_cut"] / row["bytes_per_step_studied_cut"]
        assert ratio > 30, (row.to_dict(), baseline.to_dict())
    curves = pd.read_csv(out / "sft_rank_curves.csv")
    assert sorted(set(curves["step"])) == [0, 2, 4]  # held out at the start and every 2 steps
    assert len(curves) == 3 * len(table)
    assert (out / "sft_rank.md").read_text().count("\n|") >= len(table) + 1
    assert (out / "sft_rank.png").stat().st_size > 1000
    assert (out / "sft_rank_curves.png").stat().st_size > 1000
    runs = sorted((out / "arms").glob("*.json"))
    assert len(runs) == 5
    stamps = [p.stat().st_mtime_ns for p in runs]

    again = subprocess.run(script, check=True, cwd=ROOT, timeout=600, capture_output=True,
                           text=True)  # fmt: skip

    assert "5 of 5 runs finished before" in again.stderr
    assert [p.stat().st_mtime_ns for p in runs] == stamps  # nothing trained again
    report = analyze_run(out)
    assert {"sft_rank", "sft_rank_curves"} <= set(report.figures)
    assert "Table: sft_rank" in report.path.read_text()


@pytest.mark.slow
@pytest.mark.assets
def test_hydra_multirun_runs_one_arm_per_job_into_one_folder(tmp_path: Path) -> None:
    out = tmp_path / "study"
    budget = ["task.samples=32", "task.val_samples=16", "task.epochs=1", "task.eval_every=1",
              f"task.out={out}", f"hydra.sweep.dir={tmp_path / 'sweep'}"]  # fmt: skip

    subprocess.run([*SPLITLAB, "-m", "task=sft_rank", "task.arm=baseline,upper/drop/8/3f",
                    "task.seed=0,1", *budget], check=True, cwd=ROOT, timeout=600)  # fmt: skip

    table = pd.read_csv(out / "sft_rank.csv")
    assert list(table["arm"]) == ["baseline", "upper/drop/8/3f"]
    assert list(table["seeds"]) == [2, 2] and list(table["factors"]) == ["-", "three"]
    assert len(list((out / "arms").glob("*.json"))) == 4
    other = subprocess.run([*SPLITLAB, "task=sft_rank", "task.arm=upper/drop/8", "task.epochs=2",
                            *budget[:2], *budget[3:]], cwd=ROOT, timeout=600,
                           capture_output=True, text=True)  # fmt: skip
    assert other.returncode == 2, other.stderr  # a folder holds one budget
    assert "a study at epochs=1, this run asks epochs=2" in other.stderr
    assert len(list((out / "arms").glob("*.json"))) == 4
