"""Aggregate a Hydra multirun: one CSV row per job (its overrides + key figures), one plot and a
report.html comparing the jobs side by side.

    splitlab -m +sweep=ring_cuts task.max_new_tokens=4 hydra.sweep.dir=outputs/sweeps/ring_cuts
    .venv/bin/python tools/aggregate_sweep.py outputs/sweeps/ring_cuts
    .venv/bin/pytest tests/unit/test_analysis_sweep.py tests/integration/test_sweep_multirun.py -q

Each job folder (`SWEEP/<n>/`, Hydra's `hydra.sweep.subdir`) holds `.hydra/overrides.yaml` and
`traces/` (and, for fine-tuning jobs, `final_metrics.json`). `sweep_table` reads them into one
frame (columns: `job`, `status`, one per override key, then every key figure of
`splitlab.analysis.summary.key_figures` and the merged model's `test_*` figures of
`splitlab.analysis.result.merged_figures`); `write_aggregate` writes SWEEP/sweep.csv,
SWEEP/sweep.png (the first metric the jobs hold, against the first override that varies, a line
per value of the second) and SWEEP/report.html (the jobs' varying overrides and results side by
side, the figure, then every column; numbers formatted as in a run's report). A job without
traces is a row with its status and no figures, never a dropped row.

A sweep run by the Slurm launcher (`hydra/launcher=slurm`) also leaves `SWEEP/<n>/slurm.json`
(`splitlab.cluster.slurm_jobs.SlurmJobRecord`), even for a job cancelled before it started: a job
Slurm did not complete is a row with status `failed` and its `slurm_state`, `slurm_exit_code`,
`slurm_job_id` and `log_tail`; completed jobs read as with any other launcher.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import yaml

from splitlab.analysis.pages import esc, figure_png, image_html, page, table_html
from splitlab.analysis.plots import plot_sweep
from splitlab.analysis.result import FINAL_METRICS_FILE, merged_figures
from splitlab.analysis.summary import key_figures
from splitlab.analysis.traces import load_traces
from splitlab.cluster.slurm_jobs import RECORD_FILE, SlurmJobRecord, read_record

# The y axis when none is asked for: the first of these the jobs hold.
DEFAULT_METRICS: tuple[str, ...] = (
    "tpot_ms_median", "test_accuracy", "test_perplexity", "test_loss", "owners_val_accuracy",
    "owners_val_loss", "fwd_ms_median", "transport_bytes_sent",
)  # fmt: skip
# The results a sweep report puts beside the jobs' overrides, in this order, where jobs hold them.
RESULT_COLUMNS: tuple[str, ...] = (
    "test_accuracy", "test_perplexity", "test_loss", "num_tokens", "ttft_ms", "tpot_ms_median",
    "tokens_per_s", "num_rounds", "wall_s", "trace_span_s", "transport_bytes_sent",
)  # fmt: skip


def job_dirs(sweep_dir: str | Path) -> list[Path]:
    """Job folders of a multirun (those with `.hydra/overrides.yaml` or a Slurm job record), in
    job-number order."""
    sweep_dir = Path(sweep_dir)
    found = {p.parent.parent for p in sweep_dir.glob("*/.hydra/overrides.yaml")}
    found |= {p.parent for p in sweep_dir.glob(f"*/{RECORD_FILE}")}
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


def job_overrides(job_dir: Path) -> list[str]:
    """The job's overrides: Hydra's record, else the Slurm record of a job that never started."""
    path = job_dir / ".hydra" / "overrides.yaml"
    if path.is_file():
        return list(yaml.safe_load(path.read_text()) or [])
    record = read_record(job_dir)
    return list(record.overrides) if record is not None else []


def job_row(job_dir: Path) -> dict[str, object]:
    row: dict[str, object] = {"job": job_dir.name, **parse_overrides(job_overrides(job_dir))}
    try:
        frame = load_traces(job_dir)
    except FileNotFoundError:
        row = {**row, "status": "no traces"}
    else:
        figures = {**key_figures(frame), **final_figures(job_dir)}
        row = {**row, "status": "ok" if figures else "no figures", **figures}
    record = read_record(job_dir)
    return {**row, **slurm_columns(record)} if record is not None and record.failed else row


def slurm_columns(record: SlurmJobRecord) -> dict[str, object]:
    """A failed Slurm job's row fields: status `failed`, its state, exit code, id and log tail."""
    return {
        "status": "failed", "slurm_state": record.state, "slurm_exit_code": record.exit_code,
        "slurm_job_id": record.job_id, "log_tail": record.log_tail or record.error,
    }  # fmt: skip


def final_figures(job_dir: Path) -> dict[str, object]:
    """A fine-tuning job's merged-model evaluation (`final_metrics.json`: the launcher's test
    split) as `test_*` figures; `owners_val_accuracy` from the traces is the owners' local
    models before the last FedAvg, which non-IID owners bias toward their own classes."""
    path = job_dir / FINAL_METRICS_FILE
    if not path.is_file():
        return {}
    final = json.loads(path.read_text())
    # the launcher's wall time of the whole job, beside the traces' trace_span_s
    wall = {"wall_s": final["wall_s"]} if final.get("wall_s") is not None else {}
    return {**merged_figures(final), **wall}


def sweep_table(sweep_dir: str | Path) -> pd.DataFrame:
    """One row per job (see module docstring).

    Raises:
        FileNotFoundError: no job folder under `sweep_dir`.
    """
    jobs = job_dirs(sweep_dir)
    if not jobs:
        raise FileNotFoundError(f"no job folders with .hydra/overrides.yaml in {sweep_dir}")
    rows = [job_row(job) for job in jobs]
    overrides = list(dict.fromkeys(
        k for job in jobs for k in parse_overrides(job_overrides(job))))  # fmt: skip
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
    report: Path | None = None


def side_by_side(table: pd.DataFrame, *, y: str | None = None) -> pd.DataFrame:
    """The jobs' comparison: job, status, the overrides that vary, then their results."""
    results = [c for c in (*RESULT_COLUMNS, y) if c and c in table and table[c].notna().any()]
    columns = ["job", "status", *varying_overrides(table), *dict.fromkeys(results)]
    return table[[c for c in dict.fromkeys(columns) if c in table]]


def render_sweep_html(
    *, sweep_dir: Path, table: pd.DataFrame, png: bytes | None, x: str | None, y: str | None
) -> str:
    """A sweep's report page (pure): the jobs side by side, the figure, every column."""
    ok = int((table["status"] == "ok").sum())
    parts = [
        f"<h1>sweep {esc(sweep_dir.name)}</h1><p>sweep folder: <code>{esc(str(sweep_dir))}"
        f"</code><br>{len(table)} jobs, {ok} with figures</p>",
        "<h2>Jobs side by side</h2>",
        table_html(side_by_side(table, y=y), table_id="jobs"),
    ]
    if png is not None:
        parts.append(image_html(f"{y} against {x}", png))
    else:
        parts.append(f"<p>no figure: x={esc(str(x))}, y={esc(str(y))} (no varying override "
                     "or no metric the jobs hold)</p>")  # fmt: skip
    parts += ["<h2>Every column</h2>", table_html(table, table_id="all-columns")]
    return page(f"splitlab sweep: {sweep_dir.name}", parts)


def write_aggregate(
    sweep_dir: str | Path, *, x: str | None = None, y: str | None = None, label: str | None = None
) -> Aggregate:
    """Writes SWEEP/sweep.csv, SWEEP/report.html and (when a metric and a varying override
    exist) SWEEP/sweep.png."""
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
    plot, png = None, None
    if x is not None and y is not None:
        plot = sweep_dir / "sweep.png"
        png = figure_png(plot_sweep(table, x=x, y=y, label=label))
        plot.write_bytes(png)
    report = sweep_dir / "report.html"
    html_page = render_sweep_html(sweep_dir=sweep_dir, table=table, png=png, x=x, y=y)
    report.write_text(html_page, encoding="utf-8")
    return Aggregate(csv=csv, plot=plot, table=table, x=x, y=y, report=report)
