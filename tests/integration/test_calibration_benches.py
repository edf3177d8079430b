"""Keeps tools/bench_ln.py, bench_release.py and bench_adamw.py working on tiny_llama with --quick,
and bench_planner.py (no model) with --quick.

.venv/bin/pytest tests/integration/test_calibration_benches.py -q
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[2] / "tools"


def _bench(name: str, out: Path, *args: str) -> dict:
    done = subprocess.run(
        [sys.executable, str(TOOLS / f"{name}.py"), *(args or ("model=tiny_llama",)), "--quick",
         "--out", str(out)],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text(encoding="utf-8"))
    assert {"bench", "machine", "config", "results", "ratios", "targets"} <= set(report)
    for target in report["targets"].values():
        value, goal = target["value"], target["goal"]
        assert target["met"] == (value <= goal if target["direction"] == "<=" else value >= goal)
    return report


@pytest.mark.slow
def test_bench_ln_fits_every_arm_over_all_block_counts(tmp_path: Path) -> None:
    report = _bench("bench_ln", tmp_path / "ln.json")
    assert report["bench"] == "ln" and report["config"]["counts"] == [1, 2, 3, 4]
    arms = {row["arm"]: row for row in report["results"]}
    assert set(arms) == {"cold_idle", "warm_idle", "cold_loaded", "warm_loaded"}
    for row in arms.values():
        assert [n for n, _ in row["points"]] == [1, 2, 3, 4] and row["n"] == 4
        assert all(ms > 0 for _, ms in row["points"])
    assert arms["cold_idle"]["cache"] in ("cold", "not cold")


@pytest.mark.slow
def test_bench_release_frees_every_dropped_block_by_reference_counting(tmp_path: Path) -> None:
    report = _bench("bench_release", tmp_path / "release.json")
    assert report["bench"] == "release" and report["config"]["dropped_blocks"] == [1, 2]
    summary = report["results"][-1]
    assert summary["freed_fraction_min"] == 1.0  # no dropped block outlived its release
    assert summary["release_median_ms"] < summary["release_gc_median_ms"]
    assert report["ratios"]["tracked_objects_2x_over_1x"] == pytest.approx(2.0, rel=0.05)


def test_bench_adamw_times_both_forms_and_finds_the_same_update(tmp_path: Path) -> None:
    report = _bench("bench_adamw", tmp_path / "adamw.json")
    assert report["bench"] == "adamw" and set(report["arms"]) == {"loop", "fused"}
    rows = {(r["node"], r["arm"]): r for r in report["results"] if "node" in r}
    assert set(rows) == {(n, a) for n in ("owner", "worker") for a in ("loop", "fused")}
    assert all(r["step_ms_median"] > 0 for r in rows.values())
    assert report["results"][-1]["max_abs_diff"] < 1e-5  # rounding, not another update
    assert report["config"]["parameters"]["owner"] > report["config"]["parameters"]["worker"]


def test_bench_planner_times_every_planner_on_the_same_barriers(tmp_path: Path) -> None:
    report = _bench("bench_planner", tmp_path / "planner.json", "--stages", "4", "--bypass")
    assert report["bench"] == "planner" and set(report["arms"]) == {"noop", "adaptive", "model"}
    rows = {r["planner"]: r for r in report["results"] if "planner" in r}
    assert all(r["decisions"] == 2 * 11 and r["decide_ms_median"] > 0 for r in rows.values())
    assert report["config"] == {"stages": 4, "bypass": True, "barriers": 12, "window": 8,
                                "reps": 2, "num_layers": 30}  # fmt: skip
    assert "model_decide_ms" in report["targets"]
