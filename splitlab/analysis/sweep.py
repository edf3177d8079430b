"""Aggregate a Hydra multirun: one CSV row per job (its overrides + key figures) and one plot.

    splitlab -m +sweep=ring_cuts task.max_new_tokens=4 hydra.sweep.dir=outputs/sweeps/ring_cuts
    .venv/bin/python tools/aggregate_sweep.py outputs/sweeps/ring_cuts
    .venv/bin/pytest tests/integration/test_sweep_multirun.py -q

Each job folder (`SWEEP/<n>/`, Hydra's `hydra.sweep.subdir`) holds `.hydra/overrides.yaml` and
`traces/` (and, for fine-tuning jobs, `final_metrics.json`). `sweep_table` reads them into one frame (columns: `job`, `status`, one per override
key, then every key figure of `splitlab.analysis.summary.key_figures`); `write_aggregate` writes
SWEEP/sweep.csv and SWEEP/sweep.png (the first metric the jobs hold, against the first override
that varies, a line per value of the second). A job without traces is a row with its status and
no figures, never a dropped row.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import yaml

from splitlab.analysis.plots import plot_sweep
from splitlab.analysis.summary import key_figures
from splitlab.analysis.traces import load_traces

# The y axis when none is asked for: the first of these the jobs hold.
DEFAULT_METRICS: tuple[str, ...] = (
    "tpot_ms_median", "test_accuracy", "final_accuracy", "final_loss", "fwd_ms_median",
    "transport_bytes_sent",
)  # fmt: skip


def job_dirs(sweep_dir: str | Path) -> list[Path]:
    """Job folders of a multirun (those with `.hydra/overrides.yaml`), in job-number order."""
    found = [p.parent.parent for p in Path(sweep_dir).glob("*/.hydra/overrides.yaml")]
    return sorted(
        found, key=lambda p: (not p.name.isdigit(), int(p.name) if p.name.isdigit() else 0, p.name)
    )


def parse_overrides(lines: list[str]) -> dict[str, str]:
    """`key=value` overrides as a dict; `+`/`++`/`~` prefixes dropped, `hydra.*` skipped."""
    out: dict[str, str] = {}
    for line in lines:
        key, sep, value = str(line).partition("=")
        key = key.lstrip("+~")
        if sep and not key.startswith("hydra."):
            out[key] = value
    return out


def job_row(job_dir: Path) -> dict[str, object]:
    overrides = yaml.safe_load((job_dir / ".hydra" / "overrides.yaml").read_text()) or []
    row: dict[str, object] = {"job": job_dir.name, **parse_overrides(overrides)}
    try:
        frame = load_traces(job_dir)
    except FileNotFoundError:
        return {**row, "status": "no traces"}
    figures = {**key_figures(frame), **final_figures(job_dir)}
    return {**row, "status": "ok" if figures else "no figures", **figures}


def final_figures(job_dir: Path) -> dict[str, object]:
    """A fine-tuning job's merged-model evaluation (`final_metrics.json`: the launcher's test
    split) as `test_loss` / `test_accuracy`; `final_accuracy` from the traces is the owners'
    local models before the last FedAvg, which non-IID owners bias toward their own classes."""
    path = job_dir / "final_metrics.json"
    if not path.is_file():
        return {}
    final = json.loads(path.read_text())
    return {"test_loss": final.get("val_loss"), "test_accuracy": final.get("val_accuracy")}


def sweep_table(sweep_dir: str | Path) -> pd.DataFrame:
    """One row per job (see module docstring).

    Raises:
        FileNotFoundError: no job folder under `sweep_dir`.
    """
    jobs = job_dirs(sweep_dir)
    if not jobs:
        raise FileNotFoundError(f"no job folders with .hydra/overrides.yaml in {sweep_dir}")
    rows = [job_row(job) for job in jobs]
    overrides = list(dict.fromkeys(k for job in jobs for k in parse_overrides(
        yaml.safe_load((job / ".hydra" / "overrides.yaml").read_text()) or [])))  # fmt: skip
    table = pd.DataFrame(rows)
    first = ["job", "status", *overrides]
    table = table[first + [c for c in table.columns if c not in first]]
    table.attrs["overrides"] = overrides
    return table


def varying_overrides(table: pd.DataFrame) -> list[str]:
    """Override columns whose value differs between jobs, in column order."""
    overrides = table.attrs.get("overrides") or [c for c in table.columns if "." in c]
    return [c for c in overrides if c in table and table[c].astype(str).nunique() > 1]


@dataclass(frozen=True)
class Aggregate:
    csv: Path
    plot: Path | None
    table: pd.DataFrame
    x: str | None
    y: str | None


def write_aggregate(
    sweep_dir: str | Path, *, x: str | None = None, y: str | None = None, label: str | None = None
) -> Aggregate:
    """Writes SWEEP/sweep.csv and (when a metric and a varying override exist) SWEEP/sweep.png."""
    sweep_dir = Path(sweep_dir)
    table = sweep_table(sweep_dir)
    csv = sweep_dir / "sweep.csv"
    table.to_csv(csv, index=False)
    varying = varying_overrides(table)
    x = x or (varying[0] if varying else None)
    if label is None and len(varying) > 1:
        label = next(c for c in varying if c != x)
    y = y or next(
        (m for m in DEFAULT_METRICS if m in table.columns and table[m].notna().any()), None
    )
    if x is None or y is None:
        return Aggregate(csv=csv, plot=None, table=table, x=x, y=y)
    plot = sweep_dir / "sweep.png"
    plot_sweep(table, x=x, y=y, label=label).savefig(plot, dpi=100)
    return Aggregate(csv=csv, plot=plot, table=table, x=x, y=y)
