"""Every plot renders from synthetic trace frames, holds data and saves to PNG.

.venv/bin/pytest tests/unit/test_analysis_plots.py -q
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from matplotlib.figure import Figure

from splitlab.analysis import plots
from splitlab.analysis.fits import fit_decode, fit_prefill
from splitlab.analysis.synthetic import barrier_records, ring_records, training_records
from splitlab.analysis.traces import select


@pytest.fixture(scope="module")
def ring() -> pd.DataFrame:
    tokens = ring_records(num_requests=3, decode_tokens=40)
    return pd.DataFrame(tokens + barrier_records(tokens, window=20))


@pytest.fixture(scope="module")
def training() -> pd.DataFrame:
    return pd.DataFrame(training_records())


def _saves_png(fig: Figure, path: Path) -> None:
    fig.savefig(path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_ring_timeline_has_tpot_compute_and_markers(ring: pd.DataFrame, tmp_path: Path) -> None:
    windows, migrations = select(ring, "window"), select(ring, "migration")
    assert not migrations.empty
    fig = plots.plot_ring_timeline(select(ring, "token"), windows, migrations)
    assert plots.figure_has_data(fig)
    ax_tpot, ax_compute = fig.axes
    # 1 TPOT line + one line per barrier and per migration
    assert len(ax_tpot.lines) == 1 + len(windows) + len(migrations)
    assert len(ax_compute.lines) == 3 + len(windows) + len(migrations)
    assert ax_tpot.get_ylabel() == "TPOT (ms)"
    _saves_png(fig, tmp_path / "ring.png")


def test_ring_markers_fall_back_to_timestamps(ring: pd.DataFrame) -> None:
    windows = select(ring, "window").drop(columns=["token"])
    fig = plots.plot_ring_timeline(select(ring, "token"), windows)
    expected = select(ring, "window")["token"].to_numpy(dtype=float)
    marker_x = [line.get_xdata()[0] for line in fig.axes[0].lines[1:]]
    np.testing.assert_allclose(marker_x, expected)


def test_training_rounds(training: pd.DataFrame, tmp_path: Path) -> None:
    fig = plots.plot_training_rounds(select(training, "round"))
    assert plots.figure_has_data(fig) and all(len(ax.lines) == 2 for ax in fig.axes)
    _saves_png(fig, tmp_path / "rounds.png")


def test_wrr_allocation(training: pd.DataFrame, tmp_path: Path) -> None:
    wrr = select(training, "wrr")
    fig = plots.plot_wrr(wrr)
    assert plots.figure_has_data(fig) and len(fig.axes) == 2
    heights = sum(p.get_height() for ax in fig.axes for p in ax.patches)
    assert heights == wrr["count"].sum()
    _saves_png(fig, tmp_path / "wrr.png")


def test_bytes_per_microbatch(training: pd.DataFrame, tmp_path: Path) -> None:
    fig = plots.plot_bytes_per_microbatch(select(training, "microbatch"))
    assert plots.figure_has_data(fig)
    # one panel per lane: an activation and its gradient have the same size, one axis hid one
    assert [[line.get_label() for line in ax.lines] for ax in fig.axes] == [
        ["activation"], ["gradient"],
    ]  # fmt: skip
    assert all(ax.get_ylabel() == "payload (KiB)" for ax in fig.axes)
    _saves_png(fig, tmp_path / "bytes.png")


def test_wrr_with_one_worker_is_not_drawn(training: pd.DataFrame) -> None:
    one = pd.DataFrame(training_records(num_workers=1))
    with pytest.raises(ValueError, match="one worker .worker0. takes every microbatch"):
        plots.plot_wrr(select(one, "wrr"))


def test_round_legend_names_owners_once_and_marks_the_merged_model(training: pd.DataFrame) -> None:
    final = {"round": 4, "split": "test", "val_loss": 0.5, "val_accuracy": 0.75}
    fig = plots.plot_training_rounds(select(training, "round"), final)
    ax_loss, ax_acc = fig.axes
    assert [line.get_label() for line in ax_acc.lines] == [
        "owner0",
        "owner1",
        "merged model (test)",
    ]
    star = ax_acc.lines[-1]
    assert (list(star.get_xdata()), list(star.get_ydata())) == ([4], [0.75])
    assert ax_loss.get_ylabel() == "loss (cross-entropy, nats per example)"


def test_causal_lm_rounds_show_perplexity_and_loss_per_token() -> None:
    rounds = pd.DataFrame({"round": [0, 1], "owner": ["owner0"] * 2, "loss": [3.0, 2.5],
                           "accuracy": [None, None], "perplexity": [20.1, 12.2]})  # fmt: skip
    fig = plots.plot_training_rounds(rounds)
    assert plots.figure_has_data(fig)
    assert fig.axes[0].get_ylabel() == "loss (cross-entropy, nats per token)"
    assert fig.axes[1].get_ylabel().startswith("perplexity")


def test_sft_rank(tmp_path: Path) -> None:
    table = pd.DataFrame({"rank": [4, 8, 16, 4, 8, 16], "accuracy": [0.5, 0.6, 0.65, 0.4, 0.5, 0.6],
                          "label": ["split"] * 3 + ["local"] * 3})  # fmt: skip
    fig = plots.plot_sft_rank(table)
    assert plots.figure_has_data(fig) and len(fig.axes[0].lines) >= 2
    _saves_png(fig, tmp_path / "rank.png")


def test_calibration_fit_over_its_data(tmp_path: Path) -> None:
    prompt = np.array([512, 1024, 2048, 4096, 8192], dtype=float)
    ms = 3 + 0.01 * prompt + 2e-7 * prompt**2
    fig = plots.plot_calibration(pd.DataFrame({"x": prompt, "ms": ms}), fit_prefill(prompt, ms))
    assert plots.figure_has_data(fig) and "r2=1.000" in fig.axes[0].get_title()
    assert fig.axes[0].get_xlabel() == "prompt length P (tokens)"
    _saves_png(fig, tmp_path / "prefill.png")


def test_calibration_without_a_fit_still_shows_the_points() -> None:
    points = pd.DataFrame({"x": [128.0, 256.0], "ms": [1.0, 1.1]})
    fig = plots.plot_calibration(points, fit_decode(points["x"], points["ms"]))
    assert plots.figure_has_data(fig) and "no fit" in fig.axes[0].get_title()


def test_empty_axes_hold_no_data() -> None:
    fig = Figure()
    assert not plots.figure_has_data(fig)
    fig.subplots().plot([], [])
    assert not plots.figure_has_data(fig)


def test_empty_frame_is_refused() -> None:
    with pytest.raises(ValueError, match="training rounds: no records"):
        plots.plot_training_rounds(pd.DataFrame())


def test_stage_breakdown_and_transport(ring: pd.DataFrame, tmp_path: Path) -> None:
    from splitlab.analysis.summary import tables, transport_totals
    from splitlab.analysis.synthetic import transport_records

    fig = plots.plot_stage_breakdown(tables(ring)["stages"])
    assert plots.figure_has_data(fig)
    _saves_png(fig, tmp_path / "stages.png")
    training = training_records()
    fig = plots.plot_transport(transport_totals(pd.DataFrame(transport_records(training))))
    assert plots.figure_has_data(fig)


@pytest.mark.parametrize("x", ["rank", "transport"])
def test_sweep_plot_numeric_and_categorical(x: str, tmp_path: Path) -> None:
    table = pd.DataFrame({"rank": [1, 8, 1, 8], "transport": ["tcp", "tcp", "amqp", "amqp"],
                          "cut": [1, 1, 2, 2], "tpot_ms_median": [3.0, 4.0, 5.0, np.nan]})  # fmt: skip
    fig = plots.plot_sweep(table, x=x, y="tpot_ms_median", label="cut")
    assert plots.figure_has_data(fig)
    assert fig.axes[0].get_ylabel() == "tpot_ms_median (ms)"
    _saves_png(fig, tmp_path / "sweep.png")
