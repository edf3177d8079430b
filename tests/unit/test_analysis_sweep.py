"""Sweep aggregation over fake job folders: overrides become columns, a job without traces stays
a row, the plot picks the varying override and the first metric the jobs hold.

.venv/bin/pytest tests/unit/test_analysis_sweep.py -q
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from splitlab.analysis.formatting import format_value
from splitlab.analysis.summary import key_figures
from splitlab.analysis.sweep import parse_overrides, side_by_side, sweep_table, write_aggregate
from splitlab.analysis.synthetic import ring_records, write_traces
from splitlab.analysis.traces import load_traces


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


def test_sweep_report_puts_varying_overrides_and_results_side_by_side(tmp_path: Path) -> None:
    for n, rank in enumerate((1, 8)):
        _job(tmp_path, n, [f"finetune.sft.rank={rank}", "task.seed=0"])
    result = write_aggregate(tmp_path)
    jobs = side_by_side(result.table, y=result.y)
    assert list(jobs.columns)[:3] == ["job", "status", "finetune.sft.rank"]  # task.seed is fixed
    assert {"tpot_ms_median", "trace_span_s", "num_tokens"} <= set(jobs.columns)
    page = result.report.read_text(encoding="utf-8")
    assert page.count("data:image/png;base64,") == 1
    tpot = format_value("tpot_ms_median", result.table["tpot_ms_median"][0])
    assert tpot.endswith(" ms") and f"<td>{tpot}</td>" in page


def test_fine_tuning_jobs_report_the_merged_models_test_accuracy(tmp_path: Path) -> None:
    for n in range(2):
        _job(tmp_path, n, [f"data.alpha={n + 1}"])
    final = {"round": 5, "split": "test", "val_loss": 0.41, "val_accuracy": 0.8, "wall_s": 190.0}
    (tmp_path / "1" / "final_metrics.json").write_text(json.dumps(final))
    table = sweep_table(tmp_path)
    assert table["test_accuracy"].tolist()[1] == 0.8
    assert table["wall_s"].tolist()[1] == 190.0  # the launcher's, not the traces' span
    traced = key_figures(load_traces(tmp_path / "0"))["trace_span_s"]
    assert pd.isna(table["wall_s"][0]) and table["trace_span_s"][0] == traced
    assert pd.isna(table["test_accuracy"].tolist()[0])


def test_empty_sweep_folder_is_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        sweep_table(tmp_path)


def test_slurm_jobs_that_failed_are_rows_with_their_state(tmp_path: Path) -> None:
    from splitlab.cluster.slurm_jobs import SlurmJobRecord, write_record

    _job(tmp_path, 0, ["task.seed=0"])
    _job(tmp_path, 1, ["task.seed=1"])
    write_record(tmp_path / "0", SlurmJobRecord(job_num=0, job_id="7_0", state="COMPLETED"))
    write_record(
        tmp_path / "1",
        SlurmJobRecord(
            job_num=1,
            job_id="7_1",
            state="TIMEOUT",
            exit_code="0:15",
            log_tail="CANCELLED DUE TO TIME",
        ),
    )
    # a job cancelled while pending: Slurm's record is all its folder holds
    write_record(tmp_path / "2", SlurmJobRecord(job_num=2, job_id="7_2", state="CANCELLED",
                                                overrides=["task.seed=2"]))  # fmt: skip

    table = sweep_table(tmp_path)

    assert table["job"].tolist() == ["0", "1", "2"]
    assert table["task.seed"].tolist() == ["0", "1", "2"]
    assert table["status"].tolist() == ["ok", "failed", "failed"]
    assert pd.isna(table.loc[0, "slurm_state"])
    assert table["slurm_state"].tolist()[1:] == ["TIMEOUT", "CANCELLED"]
    assert table.loc[1, "log_tail"] == "CANCELLED DUE TO TIME"
    assert table.loc[1, "slurm_job_id"] == "7_1"


def test_a_completed_slurm_sweep_reads_as_any_other(tmp_path: Path) -> None:
    from splitlab.cluster.slurm_jobs import SlurmJobRecord, write_record

    _job(tmp_path, 0, ["task.seed=0"])
    local = sweep_table(tmp_path)
    write_record(tmp_path / "0", SlurmJobRecord(job_num=0, job_id="3", state="COMPLETED"))

    assert sweep_table(tmp_path).columns.tolist() == local.columns.tolist()
