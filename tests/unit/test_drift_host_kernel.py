"""Pure parsers of the kernel figures a testbed host's live drift source reads.

.venv/bin/pytest tests/unit/test_drift_host_kernel.py -q
"""

from __future__ import annotations

import pytest

from splitlab.drift.host_kernel import (
    HOST_CPU_CGROUP_ENV,
    cpu_budget_cores,
    parse_cpu_cgroup,
    parse_tc_stats,
    throttled_fraction,
)

TC = """qdisc noqueue 0: dev lo root refcnt 2
 Sent 0 bytes 0 pkt (dropped 0, overlimits 0 requeues 0)
 backlog 0b 0p requeues 0
qdisc tbf 8020: dev sld83823h0 root refcnt 3 rate 50Mbit burst 16Kb lat 47.4ms
 Sent 4467250 bytes 4095 pkt (dropped 2, overlimits 5526 requeues 0)
 backlog 0b 0p requeues 0
"""


def test_tc_stats_read_the_shaper_rate_bytes_and_drops() -> None:
    got = parse_tc_stats(TC)
    assert got == {"qdisc": "tbf", "dev": "sld83823h0", "rate_mbit": 50.0,
                   "sent_bytes": 4467250, "sent_pkts": 4095, "dropped": 2,
                   "overlimits": 5526}  # fmt: skip
    assert parse_tc_stats(TC.replace("50Mbit", "500Kbit"))["rate_mbit"] == pytest.approx(0.5)
    assert parse_tc_stats(TC.split("qdisc tbf")[0]) is None  # no shaper: nothing to report


def test_cpu_cgroup_reads_quota_in_cores_and_throttling() -> None:
    stat = "nr_periods 200\nnr_throttled 150\nthrottled_time 2500000000\n"
    got = parse_cpu_cgroup("50000", "100000", stat)
    assert got == {"cpu_quota_cores": 0.5, "nr_periods": 200, "nr_throttled": 150,
                   "throttled_ms": 2500.0}  # fmt: skip
    assert parse_cpu_cgroup("-1", "100000", stat)["cpu_quota_cores"] is None


def test_cpu_budget_is_read_from_the_hosts_cgroup_at_each_call(tmp_path) -> None:
    env = {HOST_CPU_CGROUP_ENV: str(tmp_path)}
    (tmp_path / "cpu.cfs_period_us").write_text("100000\n")
    (tmp_path / "cpu.cfs_quota_us").write_text("50000\n")
    assert cpu_budget_cores(env) == pytest.approx(0.5)
    (tmp_path / "cpu.cfs_quota_us").write_text("-1\n")  # drift lifted the quota
    assert cpu_budget_cores(env) is None
    assert cpu_budget_cores({}) is None  # off a testbed
    assert cpu_budget_cores({HOST_CPU_CGROUP_ENV: str(tmp_path / "gone")}) is None


def test_throttled_fraction_is_per_period_between_readings() -> None:
    a = {"nr_periods": 100, "nr_throttled": 10}
    assert throttled_fraction(a, {"nr_periods": 200, "nr_throttled": 85}) == 0.75
    assert throttled_fraction(a, a) is None
