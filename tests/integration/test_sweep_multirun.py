"""A debug-sized Hydra multirun (4 tiny ring jobs, each in its own folder), the aggregate CSV and
plot over them, and the same sweep through hydra-submitit-launcher's local executor.

.venv/bin/pytest tests/integration/test_sweep_multirun.py -q
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from splitlab.analysis.plots import figure_has_data, plot_sweep

REPO = Path(__file__).resolve().parents[2]
PNG = b"\x89PNG\r\n\x1a\n"
CUTS = ["[1,2]", "[1,3]", "[2,3]", "[1,2,3]"]


def _run(argv: list[str], timeout_s: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *argv], cwd=REPO, text=True, capture_output=True,
                          timeout=timeout_s, check=False)  # fmt: skip


@pytest.mark.slow
def test_ring_cuts_multirun_then_aggregate(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    done = _run(["-m", "splitlab", "-m", "+sweep=ring_cuts", "task.max_new_tokens=4",
                 f"hydra.sweep.dir={sweep}"])  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    for job in range(4):
        assert (sweep / str(job) / "traces" / "stage-0.jsonl").is_file()
    done = _run(["tools/aggregate_sweep.py", str(sweep)])
    assert done.returncode == 0, done.stderr[-3000:]
    table = pd.read_csv(sweep / "sweep.csv")
    assert len(table) == 4 and (table["status"] == "ok").all()
    assert sorted(table["architecture.cuts"]) == sorted(CUTS)
    assert (table["tpot_ms_median"] > 0).all() and (table["num_tokens"] == 4).all()
    assert (
        table.loc[table["architecture.cuts"] == "[1,2,3]", "stage3_compute_ms_median"].notna().all()
    )
    assert (sweep / "sweep.png").read_bytes()[:8] == PNG
    assert figure_has_data(plot_sweep(table, x="architecture.cuts", y="tpot_ms_median"))


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is None,
    reason="hydra-submitit-launcher is not installed (the `cluster` extra)",
)
def test_submitit_local_launcher_runs_two_jobs(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    done = _run(["-m", "splitlab", "-m", "hydra/launcher=splitlab_local", "+sweep=ring_cuts",
                 "architecture.cuts=[1,2],[2,3]", "task.max_new_tokens=4",
                 f"hydra.sweep.dir={sweep}"])  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert (sweep / ".submitit").is_dir()
    done = _run(["tools/aggregate_sweep.py", str(sweep)])
    assert done.returncode == 0, done.stderr[-3000:]
    table = pd.read_csv(sweep / "sweep.csv")
    assert sorted(table["architecture.cuts"]) == ["[1,2]", "[2,3]"]
    assert (table["status"] == "ok").all()
