"""Keeps tools/bench_ushape.py working: unsplit vs U-shape over TCP vs over RabbitMQ, --quick.

.venv/bin/pytest tests/integration/test_ushape_bench.py -q
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "tools" / "bench_ushape.py"


@pytest.mark.slow
@pytest.mark.rabbitmq
def test_quick_bench_writes_rates_ratios_and_targets(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"

    subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--model", "tiny_bert", "--out", str(out)],
        check=True, timeout=600,
    )  # fmt: skip

    report = json.loads(out.read_text())
    assert report["bench"] == "ushape"
    medians = report["results"][-1]
    for name in ("unsplit", "tcp", "rabbitmq"):
        assert medians[f"{name}_samples_per_s"] > 0
    assert set(report["targets"]) == {"tcp_over_unsplit", "tcp_over_rabbitmq"}
    for target in report["targets"].values():
        assert target["met"] == (target["value"] >= target["goal"])
