"""What the kernel says about this process's testbed host: its link's shaper and CPU budget.

On a testbed a node runs inside its host's network namespace and cgroups
(`splitlab.testbed.session.host_command`), so it can read its own host's figures: the token
bucket on its end of the link (`tc -s qdisc show`: rate, bytes sent, drops, overlimits: the
up direction) and its cgroup's CPU budget and throttling (`cpu.cfs_quota_us`,
`cpu.cfs_period_us`, `cpu.stat`). `live.LiveSource` samples them beside the psutil readings;
the parsers here are pure, `KernelSensors` is the thin reader. Off a testbed (no
`$SPLITLAB_HOST_CPU_CGROUP`, which `host_command` sets to the directory it holds open on a
descriptor) `kernel_sensors()` is None and nothing changes.

    .venv/bin/pytest tests/unit/test_drift_host_kernel.py -q
    .venv/bin/pytest tests/integration/test_testbed.py -q -k live_source      (as root)
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

HOST_CPU_CGROUP_ENV = "SPLITLAB_HOST_CPU_CGROUP"  # this host's CPU cgroup directory
TC_TIMEOUT_S = 5.0
_UNITS = {"bit": 1e-6, "kbit": 1e-3, "mbit": 1.0, "gbit": 1e3, "tbit": 1e6}
_QDISC = re.compile(r"^qdisc (tbf|htb) \S+ dev (\S+)")
_RATE = re.compile(r" rate (\d+(?:\.\d+)?)([KMGT]?bit)\b", re.IGNORECASE)
_SENT = re.compile(r"Sent (\d+) bytes (\d+) pkt \(dropped (\d+), overlimits (\d+)")


def parse_tc_stats(text: str) -> dict[str, Any] | None:
    """The first shaping qdisc (tbf or htb) in `tc -s qdisc show` output: its device, rate
    (Mbit/s), bytes and packets sent, drops and overlimits; None when there is none."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        m = _QDISC.match(line.strip())
        if not m:
            continue
        out: dict[str, Any] = {"qdisc": m.group(1), "dev": m.group(2), "rate_mbit": None}
        rate = _RATE.search(line)
        if rate:
            out["rate_mbit"] = float(rate.group(1)) * _UNITS[rate.group(2).lower()]
        sent = _SENT.search(lines[i + 1]) if i + 1 < len(lines) else None
        if sent:
            out.update(sent_bytes=int(sent.group(1)), sent_pkts=int(sent.group(2)),
                       dropped=int(sent.group(3)), overlimits=int(sent.group(4)))  # fmt: skip
        return out
    return None


def parse_cpu_cgroup(quota_us: str, period_us: str, stat: str) -> dict[str, Any]:
    """A cgroup v1 CPU budget (cores; None = unlimited) and its throttling counters."""
    quota, period = int(quota_us), int(period_us)
    fields = dict(line.split() for line in stat.splitlines() if len(line.split()) == 2)
    return {
        "cpu_quota_cores": quota / period if quota > 0 and period > 0 else None,
        "nr_periods": int(fields.get("nr_periods", 0)),
        "nr_throttled": int(fields.get("nr_throttled", 0)),
        "throttled_ms": int(fields.get("throttled_time", 0)) / 1e6,
    }


def throttled_fraction(before: dict[str, Any], after: dict[str, Any]) -> float | None:
    """Share of the CFS periods between two readings in which the host ran out of quota
    (1 = compute-bound at its budget); None when no period passed."""
    periods = after["nr_periods"] - before["nr_periods"]
    if periods <= 0:
        return None
    return min(1.0, max(0.0, (after["nr_throttled"] - before["nr_throttled"]) / periods))


class KernelSensors:
    """Reads this host's shaper (in this namespace) and CPU cgroup; see module docstring."""

    def __init__(self, cpu_dir: Path) -> None:
        self.cpu_dir = cpu_dir

    def __call__(self) -> dict[str, Any]:
        out = parse_cpu_cgroup((self.cpu_dir / "cpu.cfs_quota_us").read_text(),
                               (self.cpu_dir / "cpu.cfs_period_us").read_text(),
                               (self.cpu_dir / "cpu.stat").read_text())  # fmt: skip
        done = subprocess.run(["tc", "-s", "qdisc", "show"], capture_output=True, text=True,
                              timeout=TC_TIMEOUT_S, check=False)  # fmt: skip
        link = parse_tc_stats(done.stdout) if done.returncode == 0 else None
        return {**out, **({f"link_{k}": v for k, v in link.items()} if link else {})}


def cpu_budget_cores(env: Mapping[str, str] = os.environ) -> float | None:
    """This process's host's CPU budget in cores (its cgroup's quota over period), read now;
    None off a testbed, for an unlimited host, or when the files cannot be read."""
    where = env.get(HOST_CPU_CGROUP_ENV)
    if not where:
        return None
    try:
        quota = int(Path(where, "cpu.cfs_quota_us").read_text())
        period = int(Path(where, "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None


def kernel_sensors(env: Mapping[str, str] = os.environ) -> KernelSensors | None:
    """This process's host's kernel sensors when it runs on a testbed host, else None."""
    where = env.get(HOST_CPU_CGROUP_ENV)
    if not where or not Path(where, "cpu.cfs_quota_us").is_file():
        return None
    return KernelSensors(Path(where))
