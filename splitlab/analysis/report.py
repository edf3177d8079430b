"""`splitlab task=analyze task.run_dir=RUN`: every applicable plot and a one-page report.html.

    splitlab task=analyze task.run_dir=outputs/2025-01-01/12-00-00-infer
    .venv/bin/pytest tests/integration/test_analysis_report.py tests/integration/test_report_browser.py -q

The I/O shell around `result`, `summary` and `plots`: reads RUN/traces/*.jsonl (and, when
present, RUN/final_metrics.json, RUN/testbed.json, the resolved config RUN/.hydra/config.yaml or
RUN/config.yaml, RUN/calibration.json and a study script's RUN/<name>.csv for each name in
`STUDY_TABLES`; a folder with either of the last two needs no traces), renders each figure the
run's records support to RUN/analysis/<name>.png, and writes RUN/analysis/report.html:
self-contained (PNGs inlined as base64). It leads with the run's result
(`splitlab.analysis.result.headline`: the merged model's test metrics, wall time, bytes moved,
what ran where), then the key figures, the tables, the plots and the resolved config, every
number formatted by `splitlab.analysis.formatting`. A figure that cannot be drawn from this run
or would carry no information in it (its records are absent; WRR with one worker) is skipped
and listed under "not drawn" with the reason; nothing is drawn empty. The main job
(`splitlab.launch.train`) writes the same report at its end.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import yaml
from matplotlib.figure import Figure

from splitlab.analysis import plots
from splitlab.analysis.fits import fit_decode, fit_link, fit_load, fit_prefill
from splitlab.analysis.formatting import format_value
from splitlab.analysis.pages import (
    esc,
    figure_png,
    headline_html,
    image_html,
    page,
    table_html,
)
from splitlab.analysis.result import (
    FINAL_METRICS_FILE,
    TESTBED_FILE,
    Headline,
    headline,
    loss_unit,
    node_names,
    placement,
)
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

_CALIBRATION_FITS = {"decode": fit_decode, "prefill": fit_prefill, "link": fit_link,
                     "load": fit_load}  # fmt: skip
# A study script's table RUN/<name>.csv (a run folder with no traces) -> the figure drawn from
# it; the table and the figure go into the report under <name>.
STUDY_TABLES: dict[str, Callable[[pd.DataFrame], Figure]] = {
    "sft_rank": plots.plot_sft_rank,  # splitlab.sft.study (experiments/sft_rank, task=sft_rank)
    "sft_rank_curves": plots.plot_sft_curves,
}


@dataclass
class Report:
    """What `analyze_run` wrote: the report path, the PNGs, and the figures it skipped and why."""

    path: Path
    figures: dict[str, Path] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    kinds: list[str] = field(default_factory=list)


def calibration_figures(record: dict) -> dict[str, Callable[[], Figure]]:
    """A plot per fit whose measured points a calibration JSON kept (`fits.<name>.points`,
    `link.points`, `load.points`)."""
    out: dict[str, Callable[[], Figure]] = {}
    fits = {**(record.get("fits") or {}), "link": record.get("link"), "load": record.get("load")}
    for name, fit_fn in _CALIBRATION_FITS.items():
        points = (fits.get(name) or {}).get("points")
        if not points:
            continue
        frame = pd.DataFrame(points, columns=["x", "ms"])

        def draw(frame: pd.DataFrame = frame, fit_fn: Callable = fit_fn) -> Figure:
            return plots.plot_calibration(frame, fit_fn(frame["x"], frame["ms"]))

        out[f"calibration_{name}"] = draw
    return out


def figure_builders(
    frame: pd.DataFrame, final: Mapping[str, Any] | None = None
) -> dict[str, Callable[[], Figure]]:
    """Every figure this run's records could support, as zero-argument builders (`final`, the
    run's final_metrics.json, marks the merged model on the round plot)."""
    tokens, windows = select(frame, "token"), head_records(select(frame, "window"))
    migrations = unique_migrations(select(frame, "migration"))
    run_tables = tables(frame)
    return {
        "ring_timeline": lambda: plots.plot_ring_timeline(tokens, windows, migrations),
        "stage_breakdown": lambda: plots.plot_stage_breakdown(run_tables.get("stages")),
        "training_rounds": lambda: plots.plot_training_rounds(select(frame, "round"), final),
        "wrr": lambda: plots.plot_wrr(select(frame, "wrr")),
        "bytes_per_microbatch": lambda: plots.plot_bytes_per_microbatch(
            select(frame, "microbatch")
        ),
        "transport": lambda: plots.plot_transport(transport_totals(frame)),
    }


def render_html(
    *,
    run_dir: Path,
    kinds: list[str],
    config_text: str | None,
    result: list[Headline],
    where: Mapping[str, str],
    figures: dict[str, float | int | None],
    run_tables: dict[str, pd.DataFrame],
    images: dict[str, bytes],
    skipped: dict[str, str],
) -> str:
    """The report page as one HTML string (pure): the result first, then the rest."""
    # each value is formatted by its own figure's name (the column holds many units)
    key_table = pd.DataFrame({"figure": list(figures),
                              "value": [format_value(k, v) for k, v in figures.items()],
                              "meaning": [FIGURE_DOCS.get(k, "") for k in figures]})  # fmt: skip
    parts = [
        f"<h1>{esc(run_dir.name)}</h1><p>run folder: <code>{esc(str(run_dir))}</code></p>",
        "<h2>Result</h2>",
        headline_html(result),
    ]
    if len(set(where.values())) > 1:  # one place is said in full by the result's line
        frame = pd.DataFrame({"node": list(where), "where": list(where.values())})
        parts += ["<h2>What ran where</h2>", table_html(frame, table_id="where")]
    parts += ["<h2>Key figures</h2>", f"<p>record kinds: {esc(', '.join(kinds) or 'none')}</p>",
              table_html(key_table, table_id="key-figures")]  # fmt: skip
    for name, table in run_tables.items():
        parts += [f"<h2>Table: {esc(name)}</h2>", table_html(table)]
    parts += [image_html(name, data) for name, data in images.items()]
    if skipped:
        items = "".join(f"<li>{esc(k)}: {esc(v)}</li>" for k, v in skipped.items())
        parts.append(f"<h2>Not drawn</h2><ul>{items}</ul>")
    config = config_text if config_text is not None else "(no resolved config in the run folder)"
    parts += ["<h2>Resolved config</h2>", f"<pre>{esc(config)}</pre>"]
    return page(f"splitlab report: {run_dir.name}", parts)


def read_json(path: Path) -> dict[str, Any] | None:
    """A JSON object file, or None when it is absent."""
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def resolved_config(run_dir: Path) -> str | None:
    """The run's resolved config: Hydra's RUN/.hydra/config.yaml, else the launcher's copy."""
    for path in (run_dir / ".hydra" / "config.yaml", run_dir / "config.yaml"):
        if path.is_file():
            return path.read_text(encoding="utf-8")
    return None


def run_placement(frame: pd.DataFrame, testbed: dict[str, Any] | None) -> dict[str, str]:
    """Where each traced node ran (`result.placement`), ring stages by their bound address."""
    if "role" not in frame.columns or frame.empty:
        return {}
    pairs = frame[["role", "rank"]].dropna().drop_duplicates().itertuples(index=False)
    meta = select(frame, "stage_meta")
    stage_hosts = {f"stage{int(r['stage'])}": str(r["host"]) for r in meta.to_dict("records")}
    return placement(node_names(pairs), testbed=testbed, stage_hosts=stage_hosts)


def analyze_run(run_dir: str | Path, *, out_dir: str | Path | None = None) -> Report:
    """Plots and report.html for the run in `run_dir` (into RUN/analysis unless `out_dir`).

    Raises:
        ConfigError: `run_dir` holds no traces.
    """
    run_dir = Path(run_dir)
    calibration = run_dir / "calibration.json"
    study_tables = {
        name: pd.read_csv(run_dir / f"{name}.csv")
        for name in STUDY_TABLES
        if (run_dir / f"{name}.csv").is_file()
    }
    try:
        frame = load_traces(run_dir)
    except FileNotFoundError as exc:
        # a calibrate run has its JSON and no traces, a study script its table
        if not calibration.is_file() and not study_tables:
            raise ConfigError(f"task.run_dir={str(run_dir)!r}: {exc}") from None
        frame = pd.DataFrame(columns=["ts_us", "role", "rank", "kind"])
    out = Path(out_dir) if out_dir is not None else run_dir / "analysis"
    out.mkdir(parents=True, exist_ok=True)
    final = read_json(run_dir / FINAL_METRICS_FILE)
    builders = figure_builders(frame, final)
    if calibration.is_file():
        for record in (
            json.loads(calibration.read_text(encoding="utf-8")).get("records", {}).values()
        ):
            builders.update(calibration_figures(record))
    run_tables = tables(frame)
    for name, table in study_tables.items():
        builders[name] = functools.partial(STUDY_TABLES[name], table)
        run_tables[name] = table
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
        images[name] = figure_png(fig)
        path.write_bytes(images[name])
        report.figures[name] = path
    config_text = resolved_config(run_dir)
    figures = key_figures(frame)
    testbed = read_json(run_dir / TESTBED_FILE)
    where = run_placement(frame, testbed)
    result = run_result(frame, figures=figures, final=final, where=where, testbed=testbed,
                        config=yaml.safe_load(config_text) if config_text else None)  # fmt: skip
    html_page = render_html(
        run_dir=run_dir, kinds=report.kinds, config_text=config_text, result=result, where=where,
        figures=figures, run_tables=run_tables, images=images, skipped=report.skipped,
    )  # fmt: skip
    report.path.write_text(html_page, encoding="utf-8")
    return report


def run_result(
    frame: pd.DataFrame,
    *,
    figures: Mapping[str, Any],
    final: Mapping[str, Any] | None,
    where: Mapping[str, str],
    testbed: Mapping[str, Any] | None,
    config: Mapping[str, Any] | None,
) -> list[Headline]:
    """`result.headline` with the loss unit this run's task has (from its round records, else
    its final metrics)."""
    rounds = select(frame, "round")
    accuracy = [*rounds.get("accuracy", []), (final or {}).get("val_accuracy")]
    perplexity = [*rounds.get("perplexity", []), (final or {}).get("val_perplexity")]
    return headline(figures=figures, final=final, where=where, testbed=testbed, config=config,
                    loss_per=loss_unit(accuracy=accuracy, perplexity=perplexity))  # fmt: skip


def run_analyze(cfg: Config) -> int:
    """The `task=analyze` runner: analyse `task.run_dir`, print the report's path."""
    report = analyze_run(cfg.task.run_dir)
    log.info("drew %s; skipped %s", sorted(report.figures), sorted(report.skipped))
    print(report.path)
    return 0
