"""A fine-tuning run's round table: the owners' `round` records read from its traces, drawn as
the loss/accuracy plot and (for the csv logger) written as metrics.csv, plus one summary line
per round.

Reads files and writes files; nothing here starts a process or trains anything.

    .venv/bin/pytest tests/unit/test_analysis_rounds.py -q
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

from splitlab.telemetry.records import RoundRecord, round_number

METRIC_COLUMNS = (
    "round",
    "owner",
    "loss",
    "accuracy",
    "perplexity",
    "train_loss",
    "samples",
    "bytes",
)


def round_records(trace_dir: Path) -> list[dict[str, Any]]:
    """The owners' `round` records of a run, in (round, owner) order."""
    # here, not at the top: traces.py imports pandas (~0.25 s), and every launcher imports
    # this module (loggers.points) for its column names, ring runs that never read a round too
    from splitlab.analysis.traces import read_trace_file

    rows = [
        record
        for path in sorted(trace_dir.glob("owner-*.jsonl"))
        for record in read_trace_file(path)
        if record.get("kind") == RoundRecord.KIND
    ]
    return sorted(rows, key=lambda r: (r["round"], str(r["owner"])))


def write_metrics(rows: list[dict[str, Any]], path: Path) -> None:
    """One CSV row per (round, owner) with `METRIC_COLUMNS` (a field a record lacks is empty);
    `round` is 1..N, as the logs say it."""
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=METRIC_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({**{k: row.get(k) for k in METRIC_COLUMNS},
                             "round": round_number(row["round"])})  # fmt: skip


def write_plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Loss and accuracy (causal LMs: perplexity) per round, one line per owner."""
    import pandas as pd  # pandas and matplotlib: ~0.7 s that a launcher writing CSV skips

    from splitlab.analysis.plots import plot_training_rounds

    plot_training_rounds(pd.DataFrame(rows)).savefig(path, dpi=110)


def weighted_means(rows: list[dict[str, Any]], names: tuple[str, ...]) -> dict[str, float]:
    """Sample-weighted mean of each of `names` over one round's owner rows (a name no row
    holds is left out); the weights are every row's `samples`, as the owners' FedAvg weighs."""
    total = sum(r.get("samples") or 0 for r in rows) or 1
    means = {}
    for name in names:
        values = [(r[name], r.get("samples") or 0) for r in rows if r.get(name) is not None]
        if values:
            means[name] = sum(v * w for v, w in values) / total
    return means


def summarize(rows: list[dict[str, Any]]) -> list[str]:
    """Per round: sample-weighted held-out loss, accuracy and perplexity over the owners."""
    lines = []
    indexes = sorted({r["round"] for r in rows})
    for round_id in indexes:
        means = weighted_means([r for r in rows if r["round"] == round_id],
                               ("loss", "accuracy", "perplexity"))  # fmt: skip
        parts = [f"round {round_number(round_id)}/{round_number(indexes[-1])}"]
        parts += [f"{name} {value:.4f}" for name, value in means.items()]
        lines.append(", ".join(parts))
    return lines


def write_round_outputs(run_dir: Path) -> list[dict[str, Any]]:
    """training_rounds.png in `run_dir` from its traces; returns the rows (the csv logger
    writes them as metrics.csv: `splitlab.loggers`); nothing drawn when no owner traced a round."""
    rows = round_records(run_dir / "traces")
    if rows:
        write_plot(rows, run_dir / "training_rounds.png")
    return rows
