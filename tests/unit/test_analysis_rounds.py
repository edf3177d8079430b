"""The round table of a fine-tuning run folder: read from owner traces, CSV, plot, summary.

.venv/bin/pytest tests/unit/test_analysis_rounds.py -q
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from splitlab.analysis.rounds import (
    METRIC_COLUMNS,
    round_records,
    summarize,
    write_metrics,
    write_round_outputs,
)


def _write(path: Path, records: list[dict]) -> None:
    base = {"ts_us": 1, "role": path.stem.split("-")[0], "rank": 0}
    path.write_text("".join(json.dumps({**base, **r}) + "\n" for r in records))


def _run(tmp_path: Path) -> Path:
    traces = tmp_path / "traces"
    traces.mkdir()
    _write(traces / "owner-1.jsonl", [
        {"kind": "round", "round": 0, "owner": "owner1", "loss": 0.9, "accuracy": 0.5, "samples": 30},
        {"kind": "microbatch", "window": 0, "microbatch": 0, "bytes": 8, "lane": "activation"},
    ])  # fmt: skip
    _write(traces / "owner-0.jsonl", [
        {"kind": "round", "round": 1, "owner": "owner0", "loss": 0.4, "accuracy": 0.8, "samples": 10},
        {"kind": "round", "round": 0, "owner": "owner0", "loss": 0.5, "accuracy": 0.7, "samples": 10},
    ])  # fmt: skip
    _write(traces / "worker-0.jsonl", [{"kind": "round", "round": 0, "owner": "nobody"}])
    return tmp_path


def test_round_records_are_the_owners_round_records_in_round_then_owner_order(tmp_path) -> None:
    rows = round_records(_run(tmp_path) / "traces")
    assert [(r["round"], r["owner"]) for r in rows] == [(0, "owner0"), (0, "owner1"), (1, "owner0")]


def test_summary_weights_owners_by_samples(tmp_path) -> None:
    lines = summarize(round_records(_run(tmp_path) / "traces"))
    assert lines == [
        "round 1/2, loss 0.8000, accuracy 0.5500", "round 2/2, loss 0.4000, accuracy 0.8000",
    ]  # fmt: skip


def test_round_outputs_draw_the_plot_and_the_table_counts_rounds_from_1(tmp_path) -> None:
    run_dir = _run(tmp_path)
    rows = write_round_outputs(run_dir)
    write_metrics(rows, run_dir / "metrics.csv")  # what the csv logger does with them
    table = list(csv.DictReader((run_dir / "metrics.csv").open()))
    assert len(rows) == len(table) == 3
    assert tuple(table[0]) == METRIC_COLUMNS and table[0]["perplexity"] == ""
    # traces hold the 0-based index; the CSV counts rounds 1..N as the logs do
    assert [(r["round"], r["owner"]) for r in table] == [
        ("1", "owner0"), ("1", "owner1"), ("2", "owner0"),
    ]  # fmt: skip
    assert (run_dir / "training_rounds.png").stat().st_size > 0


def test_no_round_records_write_nothing(tmp_path) -> None:
    (tmp_path / "traces").mkdir()
    assert write_round_outputs(tmp_path) == []
    assert not (tmp_path / "training_rounds.png").exists()


def test_metric_columns_are_round_record_fields() -> None:
    import dataclasses

    from splitlab.telemetry.records import RoundRecord

    assert set(METRIC_COLUMNS) <= {f.name for f in dataclasses.fields(RoundRecord)}
