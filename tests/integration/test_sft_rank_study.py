"""The SFT rank study script in --quick mode writes a table and a plot with real numbers, and
`task=analyze` on its folder draws the accuracy-vs-rank figure into RUN/analysis.

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


@pytest.mark.slow
@pytest.mark.assets
def test_quick_study_writes_csv_table_and_plot(tmp_path: Path) -> None:
    out = tmp_path / "run"

    subprocess.run(
        [sys.executable, str(ROOT / "experiments/sft_rank/run.py"), "--quick", "--out", str(out)],
        check=True, cwd=ROOT, timeout=600,
    )  # fmt: skip

    table = pd.read_csv(out / "sft_rank.csv")
    assert set(table["label"]) == {
        "baseline",
        "lower/keep",
        "lower/drop",
        "upper/keep",
        "upper/drop",
    }
    assert table["accuracy"].between(0, 1).all() and (table["wall_s"] > 0).all()
    drop = table[table["residual"] == "drop"]
    baseline = table[table["label"] == "baseline"].iloc[0]
    # measured on the wire: a dropped-residual cut at R=8 moves ~H/R = 48x fewer bytes
    for _, row in drop.iterrows():
        column = "front" if row["depth"] == "lower" else "tail"
        ratio = baseline[f"bytes_per_step_{column}_cut"] / row["bytes_per_step_studied_cut"]
        assert ratio > 30, (row.to_dict(), baseline.to_dict())
    assert (out / "sft_rank.md").read_text().count("\n|") >= len(table) + 1
    assert (out / "sft_rank.png").stat().st_size > 1000
    report = analyze_run(out)
    assert "sft_rank" in report.figures and "Table: sft_rank" in report.path.read_text()
