"""`task=analyze` on an SFT rank study folder: the accuracy-vs-rank figure and the table.

The study (`experiments/sft_rank/run.py`) writes `sft_rank.csv` and no traces; analyze must still
draw the figure (lines per depth/residual, the baseline as a dashed line) and put the table
in report.html.

    .venv/bin/pytest tests/sft/test_sft_rank_analyze.py -q
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from splitlab.analysis import plots
from splitlab.analysis.report import analyze_run
from splitlab.errors import ConfigError


def study_table() -> pd.DataFrame:
    rows = [("baseline", "-", "-", 384, 0.76, 1_364_965)]
    for depth in ("lower", "upper"):
        for residual in ("keep", "drop"):
            for rank, accuracy in ((1, 0.60), (8, 0.72), (32, 0.75)):
                cut = 28_804 * rank / 8 if residual == "drop" else 1_389_859
                rows.append((f"{depth}/{residual}", depth, residual, rank, accuracy, cut))
    columns = ["label", "depth", "residual", "rank", "accuracy", "bytes_per_step_studied_cut"]
    return pd.DataFrame(rows, columns=columns)


def test_plot_draws_one_line_per_arm_and_the_baseline_dashed() -> None:
    fig = plots.plot_sft_rank(study_table())

    ax = fig.axes[0]
    labels = [line.get_label() for line in ax.get_lines()]
    assert labels.count("baseline (no low-rank cut)") == 1
    baseline = next(line for line in ax.get_lines() if line.get_label().startswith("baseline"))
    assert baseline.get_linestyle() == "--" and list(baseline.get_ydata()) == [0.76, 0.76]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert {"lower/keep", "lower/drop", "upper/keep", "upper/drop"} <= set(legend)
    assert plots.figure_has_data(fig)


def test_plot_without_low_rank_runs_raises() -> None:
    with pytest.raises(ValueError, match="low-rank runs"):
        plots.plot_sft_rank(study_table().iloc[:1])


def test_analyze_draws_the_study_figure_and_table(tmp_path: Path) -> None:
    study_table().to_csv(tmp_path / "sft_rank.csv", index=False)

    report = analyze_run(tmp_path)

    assert report.figures["sft_rank"] == tmp_path / "analysis" / "sft_rank.png"
    assert report.figures["sft_rank"].stat().st_size > 1000
    page = report.path.read_text(encoding="utf-8")
    assert "Table: sft_rank" in page and "upper/drop" in page and "Figure: sft_rank" in page


def test_analyze_refuses_a_folder_without_traces_or_a_study_table(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="run_dir"):
        analyze_run(tmp_path)


def test_curves_draw_a_panel_per_arm_with_the_baseline_in_each() -> None:
    rows = [
        {"label": label, "rank": rank, "seed": seed, "step": step, "accuracy": acc + seed / 100}
        for label, rank, acc in (("baseline", 384, 0.7), ("upper/drop", 8, 0.6),
                                 ("upper/drop", 32, 0.65), ("lower/keep", 1, 0.5))
        for seed in (0, 1)
        for step in (0, 100, 200)
    ]  # fmt: skip

    fig = plots.plot_sft_curves(pd.DataFrame(rows))

    panels = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title() for ax in panels] == ["lower/keep", "upper/drop"]
    upper = panels[1]
    assert [line.get_label() for line in upper.get_lines()] == ["baseline", "R=8", "R=32"]
    assert list(upper.get_lines()[1].get_ydata()) == pytest.approx([0.605] * 3)  # seed mean
    assert plots.figure_has_data(fig)


def test_analyze_draws_the_curves_beside_the_table(tmp_path: Path) -> None:
    study_table().to_csv(tmp_path / "sft_rank.csv", index=False)
    pd.DataFrame(
        {"label": ["baseline"] * 2 + ["upper/drop"] * 2, "rank": [384, 384, 8, 8],
         "seed": [0] * 4, "step": [0, 50, 0, 50], "accuracy": [0.5, 0.8, 0.5, 0.7]}
    ).to_csv(tmp_path / "sft_rank_curves.csv", index=False)  # fmt: skip

    report = analyze_run(tmp_path)

    assert report.figures["sft_rank_curves"].stat().st_size > 1000
    assert "Figure: sft_rank_curves" in report.path.read_text(encoding="utf-8")
