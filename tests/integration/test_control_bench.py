"""Keeps tools/bench_control.py working: a --quick run writes the shared JSON shape.

.venv/bin/pytest tests/integration/test_control_bench.py -q
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "tools" / "bench_control.py"


def _run(tmp_path: Path, bus: str) -> dict:
    out = tmp_path / "bench.json"
    subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--bus", bus, "--out", str(out)],
        check=True,
        timeout=120,
    )
    return json.loads(out.read_text())


def test_quick_embedded_bench_reports_median_and_p99(tmp_path: Path) -> None:
    report = _run(tmp_path, "embedded")
    (result,) = report["results"]
    assert (
        report["bench"] == "control"
        and result["plan_open_p99_ms"] >= result["plan_open_median_ms"] > 0
    )
    assert "embedded_plan_open_median_ms" in report["targets"]


@pytest.mark.rabbitmq
def test_quick_bench_measures_both_buses(tmp_path: Path) -> None:
    report = _run(tmp_path, "both")
    assert [r["bus"] for r in report["results"]] == ["embedded", "rabbitmq"]
    assert "rabbitmq_over_embedded_median" in report["ratios"]
