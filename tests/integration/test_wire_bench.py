"""The transport benchmark still runs and writes the shared report shape (--quick, no broker).

.venv/bin/pytest tests/integration/test_wire_bench.py -q -m slow
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_bench_transport_quick_writes_report(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    subprocess.run(
        [sys.executable, str(ROOT / "tools" / "bench_transport.py"), "--quick", "--no-amqp",
         "--reps", "1", "--out", str(out)],
        check=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    report = json.loads(out.read_text())
    assert report["bench"] == "transport"
    assert {r["payload_bytes"] for r in report["results"]} == {
        4 << 10,
        64 << 10,
        1 << 20,
        4 << 20,
        16 << 20,
    }
    assert {"tcp_vs_raw_throughput_1MiB", "tcp_vs_raw_rtt_4KiB"} <= set(report["targets"])
