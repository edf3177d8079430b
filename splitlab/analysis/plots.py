"""Figures from trace frames: each function takes pandas frames and returns a matplotlib Figure.

    .venv/bin/pytest tests/unit/test_analysis_plots.py -q

Figures are built with `matplotlib.figure.Figure` directly, never pyplot, so no global state or
GUI backend is involved; `fig.savefig(path)` writes PNG/PDF/SVG. Frames are the `select`ed
records of `splitlab.analysis.traces` (columns as in its contract). A frame that lacks the data
a figure is about raises ValueError naming it, rather than returning empty axes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.collections import Collection
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Rectangle
from matplotlib.ticker import MaxNLocator

from splitlab.analysis.fits import Fit, NoFit
from splitlab.analysis.formatting import bytes_scale, unit_of
from splitlab.analysis.result import loss_unit, merged_figures
from splitlab.telemetry.records import round_number

_X_LABELS = {
    "decode": "context P + t (tokens)",
    "prefill": "prompt length P (tokens)",
    "link": "payload (bytes)",
    "load": "blocks loaded n",
}
_COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple")


def _require(frame: pd.DataFrame | None, columns: Iterable[str], what: str) -> pd.DataFrame:
    if frame is None or frame.empty:
        raise ValueError(f"{what}: no records to plot")
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise ValueError(f"{what}: frame lacks columns {missing}")
    return frame


def _name(value: object) -> str:
    """A label for an id that pandas may have widened to float (stage 1.0 -> "1")."""
    if isinstance(value, (float, np.floating)) and float(value).is_integer():
        return str(int(value))
    return str(value)


def _artist_has_data(artist: object) -> bool:
    if isinstance(artist, Line2D):
        y = np.asarray(artist.get_ydata(), dtype=float)
        return bool(y.size and np.isfinite(y).any())
    if isinstance(artist, Collection):
        return len(artist.get_offsets()) > 0 or any(len(p.vertices) for p in artist.get_paths())
    if isinstance(artist, Rectangle):
        return artist.get_width() != 0 and artist.get_height() != 0
    return False


def axes_has_data(ax: Axes) -> bool:
    """True when a line, collection or bar on `ax` holds at least one finite value."""
    return any(_artist_has_data(a) for a in (*ax.lines, *ax.collections, *ax.patches))


def figure_has_data(fig: Figure) -> bool:
    """True when the figure has axes and every one of them holds data."""
    return bool(fig.axes) and all(axes_has_data(ax) for ax in fig.axes)


def _token_positions(events: pd.DataFrame, head: pd.DataFrame) -> np.ndarray:
    """Token index of each barrier/migration: its `token` field, else by `ts_us` at the head."""
    by_time = head["token"].to_numpy()[
        np.clip(
            np.searchsorted(head["ts_us"].to_numpy(), events["ts_us"].to_numpy()), 0, len(head) - 1
        )
    ]
    if "token" not in events.columns:
        return by_time.astype(float)
    return events["token"].astype(float).fillna(pd.Series(by_time, index=events.index)).to_numpy()


def plot_ring_timeline(
    tokens: pd.DataFrame,
    windows: pd.DataFrame | None = None,
    migrations: pd.DataFrame | None = None,
) -> Figure:
    """Head TPOT and per-stage compute along the run, with barrier and migration markers.

    Barriers are dotted grey lines (red when aborted), migrations solid orange lines labelled
    with the boundary and the number of blocks moved.
    """
    _require(tokens, ("stage", "token", "compute_ms", "ts_us"), "ring timeline")
    head = tokens[tokens["stage"] == 0].sort_values("ts_us")
    if "tpot_ms" not in head.columns or head["tpot_ms"].isna().all():
        raise ValueError("ring timeline: the head's token records carry no tpot_ms")
    fig = Figure(figsize=(10, 6), layout="constrained")
    ax_tpot, ax_compute = fig.subplots(2, 1, sharex=True)
    ax_tpot.plot(head["token"], head["tpot_ms"], lw=1, label="head TPOT")
    ax_tpot.set_ylabel("TPOT (ms)")
    for stage, rows in tokens.groupby("stage", sort=True):
        ax_compute.plot(rows["token"], rows["compute_ms"], lw=1, label=f"stage {_name(stage)}")
    ax_compute.set_ylabel("compute per token (ms)")
    ax_compute.set_xlabel("token")
    ax_compute.legend(loc="upper right", fontsize="small")
    if windows is not None and not windows.empty:
        aborted = windows.get("aborted", pd.Series(False, index=windows.index)).fillna(False)
        for x, bad in zip(_token_positions(windows, head), aborted.astype(bool), strict=True):
            for ax in (ax_tpot, ax_compute):
                ax.axvline(x, color="tab:red" if bad else "0.6", ls=":", lw=0.8)
    if migrations is not None and not migrations.empty:
        for x, row in zip(
            _token_positions(migrations, head), migrations.to_dict("records"), strict=True
        ):
            for ax in (ax_tpot, ax_compute):
                ax.axvline(x, color="tab:orange", lw=1.2)
            ax_tpot.annotate(f"b{_name(row.get('boundary'))} k={_name(row.get('k'))}", (x, 1), xycoords=("data", "axes fraction"),
                             fontsize="x-small", color="tab:orange", va="top")  # fmt: skip
    ax_tpot.set_title(
        "ring: TPOT and per-stage compute (dotted: barrier, red: aborted, orange: migration)"
    )
    return fig


def _node(value: object) -> str:
    """A legend label for an owner or worker id: "owner0" as it is, a bare rank 0 as "owner 0"."""
    name = _name(value)
    return name if name[:1].isalpha() else f"owner {name}"


def plot_training_rounds(rounds: pd.DataFrame, final: Mapping[str, object] | None = None) -> Figure:
    """The owners' validation loss per round, one line per owner, beside their accuracy (a
    classifier) or perplexity (a causal LM); with `final` (final_metrics.json) the merged
    model's test figures are a black star at its round."""
    _require(rounds, ("round", "owner", "loss"), "training rounds")
    accuracy = rounds.get("accuracy", pd.Series(dtype=float))
    perplexity = rounds.get("perplexity", pd.Series(dtype=float))
    second = ("accuracy", "accuracy (fraction)") if accuracy.notna().any() else (
        ("perplexity", "perplexity (exp of nats per token)") if perplexity.notna().any() else None
    )  # fmt: skip
    fig = Figure(figsize=(10, 4) if second else (6, 4), layout="constrained")
    axes = list(np.atleast_1d(fig.subplots(1, 2 if second else 1, sharex=True)))
    unit = loss_unit(accuracy=accuracy, perplexity=perplexity)
    panels = [(axes[0], "loss", f"loss (cross-entropy, {unit})")]
    if second:
        panels.append((axes[1], *second))
    test = merged_figures(final)
    for ax, column, ylabel in panels:
        for owner, rows in rounds.sort_values("round").groupby("owner", sort=True):
            x = rows["round"].map(round_number)  # traces count from 0, people from 1
            ax.plot(x, rows[column], marker="o", label=_node(owner))
        if f"test_{column}" in test and final is not None:
            ax.plot([final["round"]], [test[f"test_{column}"]], marker="*", ms=14, ls="none",
                    color="black", label="merged model (test)")  # fmt: skip
        ax.set(xlabel="round", ylabel=ylabel, title=f"{column} per round")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[-1].legend(fontsize="small")
    fig.suptitle("owners' validation before each FedAvg", fontsize="medium")
    return fig


def plot_wrr(wrr: pd.DataFrame) -> Figure:
    """Microbatches each worker was allocated per window, stacked by worker; one panel per owner."""
    _require(wrr, ("window", "owner", "worker", "count"), "WRR allocation")
    workers = wrr["worker"].unique()
    if len(workers) < 2:
        raise ValueError(f"WRR allocation: one worker ({_name(workers[0])}) takes every "
                         "microbatch, there is nothing to allocate")  # fmt: skip
    owners = sorted(wrr["owner"].unique())
    fig = Figure(figsize=(10, 2.5 * len(owners) + 0.5), layout="constrained")
    axes = np.atleast_1d(fig.subplots(len(owners), 1, sharex=True, squeeze=False)[:, 0])
    for ax, owner in zip(axes, owners, strict=True):
        table = wrr[wrr["owner"] == owner].pivot_table(
            index="window", columns="worker", values="count", aggfunc="sum", fill_value=0
        )
        bottom = np.zeros(len(table))
        for worker in table.columns:
            ax.bar(table.index, table[worker], bottom=bottom, label=_name(worker))
            bottom += table[worker].to_numpy()
        ax.set(ylabel="microbatches", title=f"WRR allocation, {_node(owner)}")
        ax.legend(fontsize="small", loc="upper right")
    axes[-1].set_xlabel("window")
    return fig


def plot_bytes_per_microbatch(microbatches: pd.DataFrame) -> Figure:
    """Payload bytes of each microbatch in trace order, one panel per lane (an activation and
    its gradient have the same shape, so on one axis their lines would hide each other)."""
    _require(microbatches, ("bytes", "lane"), "bytes per microbatch")
    order = "ts_us" if "ts_us" in microbatches.columns else "microbatch"
    lanes = list(microbatches.sort_values(order).groupby("lane", sort=True))
    divisor, unit = bytes_scale(pd.to_numeric(microbatches["bytes"]).max())
    fig = Figure(figsize=(10, 1.2 + 2.2 * len(lanes)), layout="constrained")
    axes = np.atleast_1d(fig.subplots(len(lanes), 1, squeeze=False)[:, 0])
    for i, (ax, (lane, rows)) in enumerate(zip(axes, lanes, strict=True)):
        ax.plot(np.arange(1, len(rows) + 1), rows["bytes"].to_numpy() / divisor, marker=".",
                lw=0.8, color=_COLORS[i % len(_COLORS)], label=_name(lane))  # fmt: skip
        ax.set(ylabel=f"payload ({unit})", title=f"{_name(lane)} lane")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[-1].set_xlabel("microbatch (trace order, per lane)")
    fig.suptitle("bytes per microbatch", fontsize="medium")
    return fig


def plot_sft_rank(table: pd.DataFrame) -> Figure:
    """Accuracy against the SFT rank R; one line per `label` when the table has one.

    Rows labelled `baseline` (no low-rank cut, e.g. `experiments/sft_rank`'s `sft_rank.csv`)
    are drawn as a dashed horizontal line instead of a point.
    """
    _require(table, ("rank", "accuracy"), "SFT accuracy against rank")
    fig = Figure(figsize=(6, 4), layout="constrained")
    ax = fig.subplots()
    if "label" in table.columns:
        is_baseline = table["label"] == "baseline"
        for accuracy in table.loc[is_baseline, "accuracy"]:
            ax.axhline(accuracy, color="black", linestyle="--", label="baseline (no low-rank cut)")
        table = table[~is_baseline]
    _require(table, ("rank", "accuracy"), "SFT accuracy against rank (low-rank runs)")
    groups = table.groupby("label", sort=True) if "label" in table.columns else [("", table)]
    for label, rows in groups:
        rows = rows.sort_values("rank")
        err = rows["accuracy_std"] if "accuracy_std" in rows.columns else None
        ax.errorbar(rows["rank"], rows["accuracy"], yerr=err, marker="o", capsize=3,
                    label=str(label) or None)  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set(xlabel="SFT rank R", ylabel="accuracy (fraction)", title="SFT accuracy against rank")
    if "label" in table.columns:
        ax.legend(fontsize="small")
    return fig


def plot_sft_curves(curves: pd.DataFrame) -> Figure:
    """Held-out accuracy against the optimizer step, a panel per `label` (the low-rank arms of
    one depth/residual/form, a line per rank) with the baseline in each; a line is the mean over
    seeds with their min-max as a band (`splitlab.sft.study`'s `sft_rank_curves.csv`)."""
    _require(curves, ("label", "rank", "seed", "step", "accuracy"), "SFT learning curves")
    mean = curves.groupby(["label", "rank", "step"])["accuracy"].agg(["mean", "min", "max"])
    mean = mean.reset_index()
    baseline = mean[mean["label"] == "baseline"]
    labels = sorted(set(mean["label"]) - {"baseline"}) or ["baseline"]
    cols = min(2, len(labels))
    rows = -(-len(labels) // cols)
    fig = Figure(figsize=(6 * cols, 3.6 * rows), layout="constrained")
    axes = np.atleast_1d(fig.subplots(rows, cols, sharex=True, sharey=True, squeeze=False)).ravel()
    for ax, label in zip(axes, labels, strict=False):
        if len(baseline):
            ax.plot(baseline["step"], baseline["mean"], color="black", linestyle="--",
                    label="baseline")  # fmt: skip
        if label != "baseline":
            for i, (rank, line) in enumerate(mean[mean["label"] == label].groupby("rank")):
                color = _COLORS[i % len(_COLORS)]
                ax.plot(line["step"], line["mean"], color=color, marker=".", label=f"R={rank}")
                ax.fill_between(line["step"], line["min"], line["max"], color=color, alpha=0.15)
        ax.set(title=str(label), xlabel="optimizer step", ylabel="held-out accuracy")
        ax.legend(fontsize="small")
    for ax in axes[len(labels) :]:
        ax.set_visible(False)
    fig.suptitle("SFT learning curves (mean over seeds, band min-max)", fontsize="medium")
    return fig


def plot_calibration(points: pd.DataFrame, fit: Fit | NoFit) -> Figure:
    """Measured points (`x`, `ms`) with the fitted curve and its coefficients and r^2."""
    _require(points, ("x", "ms"), f"{fit.model} calibration")
    fig = Figure(figsize=(6, 4), layout="constrained")
    ax = fig.subplots()
    ax.scatter(points["x"], points["ms"], s=12, label="measured")
    if isinstance(fit, Fit):
        grid = np.linspace(float(points["x"].min()), float(points["x"].max()), 200)
        ax.plot(grid, fit.predict(grid), color="tab:red", label="fit")
        params = ", ".join(f"{k}={v:.3g}" for k, v in fit.params.items())
        r2 = "n/a" if fit.r2 is None else f"{fit.r2:.3f}"
        ax.set_title(f"{fit.model}: {params}, r2={r2}, n={fit.n}", fontsize="small")
    else:
        ax.set_title(f"{fit.model}: no fit ({fit.reason})", fontsize="small")
    ax.set(xlabel=_X_LABELS.get(fit.model, "x"), ylabel="time (ms)")
    ax.legend(fontsize="small")
    return fig


def plot_stage_breakdown(stages: pd.DataFrame) -> Figure:
    """Median decode compute, receive wait and send time per stage (the `stages` table)."""
    parts = ("compute_ms_median", "recv_wait_ms_median", "send_ms_median")
    _require(stages, ("stage", *parts), "per-stage breakdown")
    fig = Figure(figsize=(7, 4), layout="constrained")
    ax = fig.subplots()
    x = np.arange(len(stages))
    width = 0.8 / len(parts)
    for offset, column in enumerate(parts):
        values = pd.to_numeric(stages[column], errors="coerce").fillna(0).to_numpy()
        ax.bar(x + (offset - 1) * width, values, width, label=column.removesuffix("_median"))
    ax.set_xticks(x, [f"stage {_name(s)}" for s in stages["stage"]])
    ax.set(ylabel="median per decode token (ms)", title="where each stage spends a token")
    ax.legend(fontsize="small")
    return fig


def plot_transport(totals: pd.DataFrame) -> Figure:
    """Bytes each process moved per lane (last counter snapshot), one bar per process and lane."""
    _require(totals, ("role", "rank", "lane", "direction", "bytes"), "transport bytes")
    fig = Figure(figsize=(8, 4), layout="constrained")
    ax = fig.subplots()
    labels = [f"{r}{_name(k)} {lane} {d}" for r, k, lane, d in
              totals[["role", "rank", "lane", "direction"]].itertuples(index=False)]  # fmt: skip
    values = pd.to_numeric(totals["bytes"], errors="coerce").fillna(0)
    divisor, unit = bytes_scale(values.max())
    ax.barh(labels, values / divisor)
    ax.set(xlabel=f"bytes ({unit})", title="bytes per process and lane")
    return fig


def plot_sweep(table: pd.DataFrame, *, x: str, y: str, label: str | None = None) -> Figure:
    """One metric `y` against one swept value `x` over a sweep's jobs, a line per `label` value.

    A non-numeric `x` (e.g. `transport=tcp`) is drawn as categories in job order.
    """
    _require(table, [c for c in (x, y, label) if c], f"sweep {y} against {x}")
    data = table.dropna(subset=[y])
    if data.empty:
        raise ValueError(f"sweep {y} against {x}: every job lacks {y}")
    fig = Figure(figsize=(7, 4), layout="constrained")
    ax = fig.subplots()
    numeric = pd.to_numeric(data[x], errors="coerce").notna().all()
    unit = unit_of(y)
    divisor, shown = bytes_scale(data[y].max()) if unit == "bytes" else (1.0, unit)
    positions = {v: i for i, v in enumerate(dict.fromkeys(data[x].astype(str)))}
    groups = data.groupby(label, sort=True) if label else [("", data)]
    for name, rows in groups:
        xs = (pd.to_numeric(rows[x]) if numeric else rows[x].astype(str).map(positions)).to_numpy()
        order = np.argsort(xs, kind="stable")
        ax.plot(xs[order], rows[y].to_numpy(dtype=float)[order] / divisor, marker="o",
                label=f"{label}={_name(name)}" if label else None)  # fmt: skip
    if not numeric:
        ax.set_xticks(list(positions.values()), list(positions), rotation=20, fontsize="small")
    ax.set(xlabel=x, ylabel=f"{y} ({shown})" if shown else y,
           title=f"{y} over the sweep ({len(data)} jobs)")  # fmt: skip
    if label:
        ax.legend(fontsize="small")
    return fig
