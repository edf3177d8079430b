"""The transport benchmark still runs and writes the shared report shape (--quick, no broker),
over a testbed link (as root, with the broker) reaches the link's shaped rate, and tears the
testbed down when interrupted.

.venv/bin/pytest tests/integration/test_wire_bench.py -q -m slow
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from splitlab.testbed import session

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
    assert {r["payload_bytes"] for r in report["results"] if "payload_bytes" in r} == {
        4 << 10,
        64 << 10,
        1 << 20,
        4 << 20,
        16 << 20,
    }
    assert {"tcp_vs_raw_throughput_1MiB", "tcp_vs_raw_rtt_4KiB"} <= set(report["targets"])
    # the per-frame costs on cold caches: both header forms, a hop through both arms
    cold = next(r["header_cold_us"] for r in report["results"] if "header_cold_us" in r)
    hop = next(r["hop_cold_us"] for r in report["results"] if "hop_cold_us" in r)
    assert all(v > 0 for v in [*cold.values(), *hop.values()])
    assert {"binary_vs_json_header_cold", "tcp_vs_raw_hop_cold"} <= set(report["ratios"])


@pytest.mark.slow
@pytest.mark.testbed
@pytest.mark.rabbitmq
def test_bench_transport_over_a_testbed_link_gets_the_shaped_rate(tmp_path: Path) -> None:
    # wifi_good (50 Mbit/s, 2 ms) is the smallest preset whose 1 MiB runs last about a second.
    # The targets' 1 MiB, a small frame, and 16 MiB, which the link's rate leaves out.
    out = tmp_path / "bench.json"
    subprocess.run(
        [sys.executable, str(ROOT / "tools" / "bench_transport.py"), "--quick", "--reps", "1",
         "--sizes-kib", "4,1024,16384", "--testbed", "wifi_good", "--out", str(out)],
        check=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    report = json.loads(out.read_text())
    config = report["config"]
    assert config["methods"] == ["raw", "tcp", "amqp"]
    assert config["path"] == {"client_host": "edge1", "server_host": "server", "rate_mbit": 50.0,
                              "delay_ms": 2.0, "jitter_ms": 0.0, "delay_source": "transport",
                              "delayed_methods": ["raw", "tcp"]}  # fmt: skip
    link = config["testbed"]["links"]["edge1"]
    assert link["nominal"]["up_mbit"] == 50 and link["delay_source"] == "transport"
    assert abs(link["probed"]["up_mbit"] / 50 - 1) <= 0.10
    assert config["sizes_bytes"] == [4 << 10, 1 << 20]  # 16 MiB left out at 50 Mbit/s
    assert {"tcp_vs_amqp_throughput_1MiB", "amqp_vs_shaped_rate_1MiB"} <= set(report["ratios"])
    shaped = report["targets"]["tcp_vs_shaped_rate_1MiB"]
    assert 0.9 <= shaped["value"] <= 1.05, shaped  # the link's rate, not loopback's
    assert shaped["goal"] == 0.9 and shaped["met"] is True
    assert config["testbed"]["session"] not in session.sessions()  # torn down


def _session_held_by(pid: int) -> str | None:
    """The live testbed session whose holder is process `pid` (its state file says so)."""
    for s in session.sessions():
        state = session.load_state(s)
        if state is not None and state.get("pid") == pid:
            return s
    return None


@pytest.mark.testbed
def test_bench_transport_interrupted_on_a_testbed_leaves_nothing_behind() -> None:
    bench = subprocess.Popen(
        [sys.executable, str(ROOT / "tools" / "bench_transport.py"), "--quick", "--no-amqp",
         "--testbed", "wifi_good"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        s = None
        while s is None or len(session.session_pids(s)) < 2:  # the client and the server run
            assert bench.poll() is None, bench.stderr.read() if bench.stderr else ""
            assert time.monotonic() < deadline, "the bench never started both sides"
            time.sleep(0.2)
            s = _session_held_by(bench.pid)
        bench.send_signal(signal.SIGINT)
        assert bench.wait(60) == 128 + signal.SIGINT
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait(10)
    assert s not in session.sessions() and session.session_pids(s) == set()
