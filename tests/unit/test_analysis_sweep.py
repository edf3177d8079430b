"""Sweep aggregation over fake job folders: overrides become columns, a job without traces stays
a row, the plot picks the varying override and the first metric the jobs hold.

.venv/bin/pytest tests/unit/test_analysis_sweep.py -q
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from splitlab.analysis.sweep import parse_overrides, sweep_table, write_aggregate
from splitlab.analysis.synthetic import ring_records, write_traces


def _job(root: Path, number: int, overrides: list[str], *, traces: bool = True) -> None:
    job = root / str(number)
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    if traces:
        write_traces(ring_records(num_requests=1, decode_tokens=4, seed=number), job / "traces")


def test_parse_overrides_drops_prefixes_and_hydra_keys() -> None:
    parsed = parse_overrides(["+sweep=ring_cuts", "architecture.cuts=[1,2]", "hydra.verbose=true"])
    assert parsed == {"sweep": "ring_cuts", "architecture.cuts": "[1,2]"}


def test_rows_in_job_order_with_status(tmp_path: Path) -> None:
    for n in (10, 2, 1):
        _job(tmp_path, n, [f"finetune.sft.rank={n}", "task.seed=0"], traces=n != 2)
    table = sweep_table(tmp_path)
    assert table["job"].tolist() == ["1", "2", "10"]
    assert table["status"].tolist() == ["ok", "no traces", "ok"]
    assert pd.isna(table.loc[1, "tpot_ms_median"])


def test_aggregate_writes_csv_and_plot_of_the_varying_override(tmp_path: Path) -> None:
    for n, rank in enumerate((1, 8, 32)):
        _job(tmp_path, n, [f"finetune.sft.rank={rank}", "task.seed=0"])
    result = write_aggregate(tmp_path)
    assert result.x == "finetune.sft.rank" and result.y == "tpot_ms_median"
    assert result.plot is not None and result.plot.is_file()
    assert len(pd.read_csv(result.csv)) == 3


def test_fine_tuning_jobs_report_the_merged_models_test_accuracy(tmp_path: Path) -> None:
    for n in range(2):
        _job(tmp_path, n, [f"data.alpha={n + 1}"])
    final = {"round": 5, "split": "test", "val_loss": 0.41, "val_accuracy": 0.8}
    (tmp_path / "1" / "final_metrics.json").write_text(json.dumps(final))
    table = sweep_table(tmp_path)
    assert table["test_accuracy"].tolist()[1] == 0.8
    assert pd.isna(table["test_accuracy"].tolist()[0])


def test_empty_sweep_folder_is_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        sweep_table(tmp_path)
