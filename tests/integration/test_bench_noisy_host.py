"""A benchmark run on a host loaded by a co-runner (one spinning process per core, bounded in
time) is marked noisy, its targets are not trusted, and `--require-quiet` fails it.

.venv/bin/pytest tests/integration/test_bench_noisy_host.py -q -m slow
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from splitlab.telemetry.bench import BenchExit

ROOT = Path(__file__).resolve().parents[2]
SPIN_S = 90  # the co-runner's bound: it ends by itself even if the test is killed
SPIN = (
    "import sys, time\n"
    "end = time.monotonic() + float(sys.argv[1])\n"
    "while time.monotonic() < end: pass\n"
)


@pytest.fixture
def co_runner() -> Iterator[list[subprocess.Popen]]:
    """One busy-looping process per core for at most SPIN_S seconds."""
    spinners = [subprocess.Popen([sys.executable, "-c", SPIN, str(SPIN_S)])
                for _ in range(os.cpu_count() or 1)]  # fmt: skip
    time.sleep(1.0)  # let them reach the run queue before the benchmark starts
    try:
        yield spinners
    finally:
        for p in spinners:
            p.kill()
            p.wait(10)


@pytest.mark.slow
def test_bench_under_a_co_runner_is_noisy_and_require_quiet_fails(
    tmp_path: Path, co_runner: list[subprocess.Popen]
) -> None:
    out = tmp_path / "bench.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "bench_transport.py"), "--quick", "--no-amqp",
         "--reps", "1", "--require-quiet", "--out", str(out)],
        timeout=120, cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    assert all(p.poll() is None for p in co_runner), "the co-runner ended before the benchmark"
    assert done.returncode == BenchExit.NOISY, done.stderr[-2000:]
    report = json.loads(out.read_text())
    machine = report["machine"]
    assert machine["noisy"] is True and machine["samples_during"] >= 1
    # the spinners were seen (each sample subtracts the bench's own tasks, read a moment
    # apart from procs_running, so a sample can miss one: 1.5 with 2 spinners on 2 cores)
    assert machine["runnable_during_mean"] >= 1.0, machine
    assert report["targets"] and all(t["trusted"] is False for t in report["targets"].values())
    assert report["targets_trusted"] is False
    assert report["ratios"]["tcp_vs_raw_rtt_4KiB"] > 0  # a noisy run still reports its ratios
