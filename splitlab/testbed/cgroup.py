"""CPU and memory budgets of testbed hosts as cgroup v1 groups (the I/O shell over sysfs).

Each host gets `splitlab-<session>/<host>` under the `cpu` controller (CFS quota per period:
a budget of 0.5 core is 50 ms of CPU per 100 ms) and under `memory` (`memory.limit_in_bytes`).
A process joins by writing its pid to `cgroup.procs` of both; its children inherit them.
A budget is a cap and, as far as the machine has the cores, a floor: the groups of budgeted
hosts (and the session's group above them) carry the highest CFS weight, so other load on
the machine cannot push an emulated device below its budget.
`set_cpu` rewrites the quota of a running host (drift profiles call it mid-run).

    .venv/bin/pytest tests/integration/test_testbed.py -q -k cpu
"""

from __future__ import annotations

import errno
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

from splitlab.errors import ConfigError

CGROUP_ROOT = Path("/sys/fs/cgroup")
CONTROLLERS = ("cpu", "memory")
PERIOD_US = 100_000
MAX_SHARES = 262_144  # the highest cpu.shares weight (the default is 1024)


def quota_us(cpu: float, period_us: int = PERIOD_US) -> int:
    """CFS quota for a budget of `cpu` cores; -1 (no quota) for 0."""
    if cpu < 0:
        raise ConfigError(f"cpu={cpu} must be >= 0 cores")
    return -1 if cpu == 0 else max(1000, int(round(cpu * period_us)))


def missing_controllers(root: Path = CGROUP_ROOT) -> list[str]:
    """The cgroup v1 controllers (and files) a testbed needs but this machine lacks."""
    need = {"cpu": "cpu.cfs_quota_us", "memory": "memory.limit_in_bytes"}
    return [f"{root / c / f}" for c, f in need.items() if not (root / c / f).exists()]


class HostCgroups:
    """One host's groups under every controller (see module docstring)."""

    def __init__(self, session_group: str, host: str, *, root: Path = CGROUP_ROOT) -> None:
        self.host = host
        self.dirs = {c: root / c / session_group / host for c in CONTROLLERS}

    def create(self, *, cpu: float, memory_mib: int) -> None:
        for d in self.dirs.values():
            d.mkdir(parents=True, exist_ok=True)
        (self.dirs["cpu"] / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        self.set_cpu(cpu)
        if cpu > 0:
            for d in (self.dirs["cpu"].parent, self.dirs["cpu"]):
                (d / "cpu.shares").write_text(str(MAX_SHARES))
        limit = str(memory_mib << 20) if memory_mib > 0 else "-1"
        (self.dirs["memory"] / "memory.limit_in_bytes").write_text(limit)

    def set_cpu(self, cpu: float) -> None:
        (self.dirs["cpu"] / "cpu.cfs_quota_us").write_text(str(quota_us(cpu)))

    def cpu(self) -> float:
        """The quota now in force, in cores (0 = none)."""
        quota = int((self.dirs["cpu"] / "cpu.cfs_quota_us").read_text())
        period = int((self.dirs["cpu"] / "cpu.cfs_period_us").read_text())
        return 0.0 if quota < 0 else quota / period

    def memory_limit_bytes(self) -> int:
        return int((self.dirs["memory"] / "memory.limit_in_bytes").read_text())

    def attach(self, pid: int) -> None:
        for d in self.dirs.values():
            (d / "cgroup.procs").write_text(str(pid))

    def pids(self) -> set[int]:
        out: set[int] = set()
        for d in self.dirs.values():
            try:
                out.update(int(p) for p in (d / "cgroup.procs").read_text().split())
            except FileNotFoundError:
                pass
        return out


def kill_all(pids_of: Callable[[], set[int]], *, timeout_s: float = 5.0) -> None:
    """SIGKILL every pid `pids_of()` returns until it returns none (new children included)."""
    deadline = time.monotonic() + timeout_s
    while pids := pids_of():
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"processes {sorted(pids)} survived SIGKILL for {timeout_s} s")
        time.sleep(0.05)


def remove_session_groups(session_group: str, *, root: Path = CGROUP_ROOT) -> list[str]:
    """rmdir every host group of a session, then the session group; returns what stays."""
    left = []
    for c in CONTROLLERS:
        top = root / c / session_group
        if not top.exists():
            continue
        for d in sorted(p for p in top.iterdir() if p.is_dir()):
            _rmdir(d, left)
        _rmdir(top, left)
    return left


def _rmdir(d: Path, left: list[str]) -> None:
    for _ in range(50):  # a just-killed task leaves its group a moment later
        try:
            d.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError as exc:
            if exc.errno != errno.EBUSY:
                raise
            time.sleep(0.05)
    left.append(str(d))


def session_groups(root: Path = CGROUP_ROOT) -> set[str]:
    """Session ids that have a `splitlab-<session>` group under any controller."""
    out = set()
    for c in CONTROLLERS:
        base = root / c
        if base.exists():
            out.update(p.name.removeprefix("splitlab-") for p in base.glob("splitlab-*"))
    return out
