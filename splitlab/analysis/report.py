"""`splitlab task=analyze task.run_dir=RUN`: every applicable plot and a one-page report.html.

    splitlab task=analyze task.run_dir=outputs/2025-01-01/12-00-00-infer
    .venv/bin/pytest tests/integration/test_analysis_report.py -q

The I/O shell around `summary` and `plots`: reads RUN/traces/*.jsonl (and RUN/.hydra/config.yaml,
RUN/calibration.json, RUN/sft_rank.csv of `experiments/sft_rank/run.py` when present; a folder
with either of the last two needs no traces), renders each figure the run's record kinds support
to RUN/analysis/<name>.png, and writes RUN/analysis/report.html: self-contained (PNGs inlined as
base64), with the resolved config, the key figures, the tables and the plots. A figure that
cannot be drawn from this run (its records are absent) is skipped and listed under "not drawn"
with the reason; nothing is drawn empty.
"""

from __future__ import annotations

import base64
import html
import io
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure

from splitlab.analysis import plots
from splitlab.analysis.fits import fit_decode, fit_link, fit_prefill
from splitlab.analysis.summary import (
    FIGURE_DOCS,
    head_records,
    key_figures,
    kinds_present,
    tables,
    transport_totals,
    unique_migrations,
)
from splitlab.analysis.traces import load_traces, select
from splitlab.config.schema import Config
from splitlab.errors import ConfigError

log = logging.getLogger(__name__)

_CALIBRATION_FITS = {"decode": fit_decode, "prefill": fit_prefill, "link": fit_link}
SFT_RANK_TABLE = "sft_rank.csv"  # experiments/sft_rank/run.py's table (a run folder, no traces)


@dataclass
class Report:
    """What `analyze_run` wrote: the report path, the PNGs, and the figures it skipped and why."""

    path: Path
    figures: dict[str, Path] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    kinds: list[str] = field(default_factory=list)


def calibration_figures(record: dict) -> dict[str, Callable[[], Figure]]:
    """A plot per fit whose measured points a calibration JSON kept (`fits.<name>.points`)."""
    out: dict[str, Callable[[], Figure]] = {}
    fits = {**(record.get("fits") or {}), "link": record.get("link")}
    for name, fit_fn in _CALIBRATION_FITS.items():
        points = (fits.get(name) or {}).get("points")
        if not points:
            continue
        frame = pd.DataFrame(points, columns=["x", "ms"])

        def draw(frame: pd.DataFrame = frame, fit_fn: Callable = fit_fn) -> Figure:
            return plots.plot_calibration(frame, fit_fn(frame["x"], frame["ms"]))

        out[f"calibration_{name}"] = draw
    return out


def figure_builders(frame: pd.DataFrame) -> dict[str, Callable[[], Figure]]:
    """Every figure this run's records could support, as zero-argument builders."""
    tokens, windows = select(frame, "token"), head_records(select(frame, "window"))
    migrations = unique_migrations(select(frame, "migration"))
    run_tables = tables(frame)
    return {
        "ring_timeline": lambda: plots.plot_ring_timeline(tokens, windows, migrations),
        "stage_breakdown": lambda: plots.plot_stage_breakdown(run_tables.get("stages")),
        "training_rounds": lambda: plots.plot_training_rounds(select(frame, "round")),
        "wrr": lambda: plots.plot_wrr(select(frame, "wrr")),
        "bytes_per_microbatch": lambda: plots.plot_bytes_per_microbatch(
            select(frame, "microbatch")
        ),
        "transport": lambda: plots.plot_transport(transport_totals(frame)),
    }


def _png(fig: Figure, path: Path) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    data = buffer.getvalue()
    path.write_bytes(data)
    return data


def _format(value: object) -> str:
    if value is None or (isinstance(value, float) and pd.isna(value)):
        return "n/a"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def render_html(
    *,
    run_dir: Path,
    kinds: list[str],
    config_text: str | None,
    figures: dict[str, float | int | None],
    run_tables: dict[str, pd.DataFrame],
    images: dict[str, bytes],
    skipped: dict[str, str],
) -> str:
    """The report page as one HTML string (pure)."""
    esc = html.escape
    rows = "".join(
        f"<tr><td>{esc(k)}</td><td>{esc(_format(v))}</td><td>{esc(FIGURE_DOCS.get(k, ''))}</td></tr>"
        for k, v in figures.items()
    )
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>splitlab report: {esc(run_dir.name)}</title>",
        "<style>body{font-family:sans-serif;max-width:1100px;margin:auto}"
        "table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ccc;"
        "padding:2px 6px}img{max-width:100%}pre{background:#f6f6f6;padding:8px;"
        "font-size:12px;max-height:400px;overflow:auto}</style></head><body>",
        f"<h1>{esc(run_dir.name)}</h1><p>run folder: <code>{esc(str(run_dir))}</code><br>"
        f"record kinds: {esc(', '.join(kinds) or 'none')}</p>",
        "<h2>Key figures</h2>",
        f"<table><tr><th>figure</th><th>value</th><th>meaning</th></tr>{rows}</table>",
    ]
    for name, table in run_tables.items():
        parts += [f"<h2>Table: {esc(name)}</h2>", table.to_html(index=False, na_rep="n/a")]
    for name, data in images.items():
        encoded = base64.b64encode(data).decode("ascii")
        parts += [f"<h2>Figure: {esc(name)}</h2>",
                  f"<img alt='{esc(name)}' src='data:image/png;base64,{encoded}'>"]  # fmt: skip
    if skipped:
        items = "".join(f"<li>{esc(k)}: {esc(v)}</li>" for k, v in skipped.items())
        parts.append(f"<h2>Not drawn</h2><ul>{items}</ul>")
    config = config_text if config_text is not None else "(no .hydra/config.yaml in the run folder)"
    parts += ["<h2>Resolved config</h2>", f"<pre>{esc(config)}</pre>", "</body></html>"]
    return "\n".join(parts)


def analyze_run(run_dir: str | Path, *, out_dir: str | Path | None = None) -> Report:
    """Plots and report.html for the run in `run_dir` (into RUN/analysis unless `out_dir`).

    Raises:
        ConfigError: `run_dir` holds no traces.
    """
    run_dir = Path(run_dir)
    calibration = run_dir / "calibration.json"
    try:
        frame = load_traces(run_dir)
    except FileNotFoundError as exc:
        # a calibrate run has its JSON and no traces, the SFT rank study its table
        if not calibration.is_file() and not (run_dir / SFT_RANK_TABLE).is_file():
            raise ConfigError(f"task.run_dir={str(run_dir)!r}: {exc}") from None
        frame = pd.DataFrame(columns=["ts_us", "role", "rank", "kind"])
    out = Path(out_dir) if out_dir is not None else run_dir / "analysis"
    out.mkdir(parents=True, exist_ok=True)
    builders = figure_builders(frame)
    if calibration.is_file():
        for record in (
            json.loads(calibration.read_text(encoding="utf-8")).get("records", {}).values()
        ):
            builders.update(calibration_figures(record))
    run_tables = tables(frame)
    if (run_dir / SFT_RANK_TABLE).is_file():
        study = pd.read_csv(run_dir / SFT_RANK_TABLE)
        builders["sft_rank"] = lambda: plots.plot_sft_rank(study)
        run_tables["sft_rank"] = study
    report = Report(path=out / "report.html", kinds=kinds_present(frame))
    images: dict[str, bytes] = {}
    for name, build in builders.items():
        try:
            fig = build()
        except ValueError as exc:  # the run has no records for this figure
            report.skipped[name] = str(exc)
            continue
        if not plots.figure_has_data(fig):
            report.skipped[name] = "the figure would have empty axes"
            continue
        path = out / f"{name}.png"
        images[name] = _png(fig, path)
        report.figures[name] = path
    config = run_dir / ".hydra" / "config.yaml"
    page = render_html(
        run_dir=run_dir, kinds=report.kinds,
        config_text=config.read_text(encoding="utf-8") if config.is_file() else None,
        figures=key_figures(frame), run_tables=run_tables, images=images,
        skipped=report.skipped,
    )  # fmt: skip
    report.path.write_text(page, encoding="utf-8")
    return report


def run_analyze(cfg: Config) -> int:
    """The `task=analyze` runner: analyse `task.run_dir`, print the report's path."""
    report = analyze_run(cfg.task.run_dir)
    log.info("drew %s; skipped %s", sorted(report.figures), sorted(report.skipped))
    print(report.path)
    return 0
