"""`task=analyze` on a real tiny ring run (with a barrier and a migration) and on synthetic
U-shape training traces: every applicable plot is a PNG with data, report.html is self-contained.

.venv/bin/pytest tests/integration/test_analysis_report.py -q
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from report_helpers import FINAL_METRICS, headline_rows, write_training_run

from splitlab.analysis import plots
from splitlab.analysis.links import derive_link_params
from splitlab.analysis.report import analyze_run, figure_builders
from splitlab.analysis.summary import key_figures
from splitlab.analysis.synthetic import training_records, transport_records, write_traces
from splitlab.analysis.traces import load_traces

REPO = Path(__file__).resolve().parents[2]
PNG = b"\x89PNG\r\n\x1a\n"
RING_FIGURES = {"ring_timeline", "stage_breakdown"}
TRAINING_FIGURES = {"training_rounds", "wrr", "bytes_per_microbatch", "transport"}


def _splitlab(*args: str, timeout_s: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "splitlab", *args], cwd=REPO, text=True,
                          capture_output=True, timeout=timeout_s, check=False)  # fmt: skip


@pytest.fixture(scope="module")
def ring_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished `splitlab task=infer` run: tiny Llama, 3 stages, one forced 1-block shift."""
    run = tmp_path_factory.mktemp("ring") / "run"
    done = _splitlab("task=infer", "model=tiny_llama", "task.max_new_tokens=16",
                     "architecture.cuts=[1,2]", "architecture.window=5", "planner=forced_shift",
                     "planner.at_token=6", "planner.boundary=2", f"hydra.run.dir={run}")  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return run


@pytest.mark.slow  # shares one ~15-35 s ring run
def test_every_ring_figure_holds_data(ring_run: Path) -> None:
    frame = load_traces(ring_run)
    builders = figure_builders(frame)
    for name in RING_FIGURES:
        assert plots.figure_has_data(builders[name]()), name


@pytest.mark.slow  # shares one ~15-35 s ring run
def test_ring_report_has_plots_figures_and_config(ring_run: Path) -> None:
    report = analyze_run(ring_run)
    assert RING_FIGURES <= set(report.figures)
    for path in report.figures.values():
        assert path.read_bytes()[:8] == PNG
    assert {"token", "stage_meta", "window", "migration"} <= set(report.kinds)
    page = report.path.read_text(encoding="utf-8")
    assert page.count("data:image/png;base64,") == len(report.figures)
    assert "tpot_ms_median" in page and "max_new_tokens: 16" in page
    assert "Table: migrations" in page and "Table: links" in page


@pytest.mark.slow  # shares one ~15-35 s ring run
def test_ring_key_figures(ring_run: Path) -> None:
    figures = key_figures(load_traces(ring_run))
    assert figures["num_tokens"] == 16 and figures["tpot_ms_median"] > 0
    assert figures["num_migrations"] == 1 and figures["num_barriers"] >= 2
    assert {f"stage{s}_compute_ms_median" for s in range(3)} <= set(figures)


@pytest.mark.slow  # shares one ~15-35 s ring run
def test_real_loopback_ring_is_not_a_link_measurement(ring_run: Path) -> None:
    estimates = derive_link_params(load_traces(ring_run))
    assert [(e.src_stage, e.dst_stage) for e in estimates] == [(0, 1), (1, 2)]
    assert all(e.loopback and not e.is_measurement for e in estimates)


@pytest.mark.slow  # shares one ~15-35 s ring run
def test_cli_task_analyze_prints_the_report_path(ring_run: Path, tmp_path: Path) -> None:
    done = _splitlab("task=analyze", f"task.run_dir={ring_run}", f"hydra.run.dir={tmp_path}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("analysis/report.html")
    assert Path(done.stdout.strip().splitlines()[-1]).is_file()


def test_cli_task_analyze_without_traces_is_a_config_error(tmp_path: Path) -> None:
    done = _splitlab("task=analyze", f"task.run_dir={tmp_path}", f"hydra.run.dir={tmp_path}/a")
    assert done.returncode == 2
    assert "task.run_dir=" in done.stderr


def test_training_report_from_synthetic_u_shape_traces(tmp_path: Path) -> None:
    records = training_records(num_owners=2, num_workers=2, num_rounds=3)
    write_traces(records + transport_records(records), tmp_path / "traces")
    report = analyze_run(tmp_path)
    assert TRAINING_FIGURES <= set(report.figures)
    assert not RING_FIGURES & set(report.figures)
    assert set(report.skipped) == RING_FIGURES
    page = report.path.read_text(encoding="utf-8")
    assert "owners_val_accuracy" in page and "Table: rounds" in page and "Table: transport" in page
    assert "no resolved config" in page


def test_report_leads_with_the_merged_models_test_result(tmp_path: Path) -> None:
    run = write_training_run(tmp_path / "run", num_workers=1)

    report = analyze_run(run)

    page = report.path.read_text(encoding="utf-8")
    rows = headline_rows(page)
    assert list(rows)[:2] == ["test_accuracy", "test_loss"]
    assert rows["test_accuracy"]["value"] == FINAL_METRICS["val_accuracy"]
    assert rows["test_accuracy"]["text"] == "0.801"
    assert rows["test_loss"]["value"] == FINAL_METRICS["val_loss"]
    assert rows["test_loss"]["label"] == "test loss (cross-entropy, nats per example)"
    assert rows["where"]["text"] == "owner0, owner1 on this machine"  # the traced nodes
    assert rows["transport_bytes_sent"]["text"].endswith("MiB")
    assert rows["wall_s"]["value"] == FINAL_METRICS["wall_s"]
    assert rows["wall_s"]["text"] == "3 min 05 s"
    assert page.index("id='headline'") < page.index("Key figures")
    # one worker: the WRR figure would be a wall of identical bars
    assert "wrr" in report.skipped and "one worker" in report.skipped["wrr"]
    assert "owner owner0" not in page and "nats per token" not in page
    assert not re.search(r"<td>\d+\.0</td>", page)  # integer columns print as integers
