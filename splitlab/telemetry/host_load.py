"""How busy the host was while a benchmark ran: load average, runnable tasks and CPU steal.

Pure parsers of `/proc/loadavg` and `/proc/stat` and a pure verdict (`noisy_reasons`), around a
thin shell, `HostLoadMonitor`: it reads both files when started, at once and then once per
`interval_s` from a daemon thread while the run goes on, and again when stopped. Every `BenchReport` runs one and
puts its summary in the report's `machine`.

    python tools/bench_transport.py --quick --no-amqp --require-quiet --out /tmp/bench.json
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any

LOADAVG_PATH = "/proc/loadavg"
STAT_PATH = "/proc/stat"
STEAL_LIMIT = 0.05  # fraction of CPU time stolen by the hypervisor above which a run is noisy


@dataclass(frozen=True, kw_only=True)
class HostSample:
    """One reading: load averages, runnable tasks now, and cumulative CPU jiffies."""

    load_1m: float
    load_5m: float
    load_15m: float
    procs_running: int  # runnable tasks at the moment of reading, this reader included
    cpu_total_jiffies: int  # user..steal over all CPUs since boot
    cpu_steal_jiffies: int
    own_running: int = 1  # of procs_running, the benchmark's own tasks (this reader included)
    others_running: int | None = None  # other processes' runnable threads, counted directly


def parse_loadavg(text: str) -> tuple[float, float, float]:
    """The 1, 5 and 15 minute load averages of a `/proc/loadavg` text."""
    fields = text.split()
    if len(fields) < 3:
        raise ValueError(f"{LOADAVG_PATH}: expected three load averages, got {text!r}")
    return float(fields[0]), float(fields[1]), float(fields[2])


def parse_stat(text: str) -> tuple[int, int, int]:
    """(total jiffies, steal jiffies, procs_running) of a `/proc/stat` text. The total sums
    user, nice, system, idle, iowait, irq, softirq and steal (guest time is inside user)."""
    total = steal = running = None
    for line in text.splitlines():
        fields = line.split()
        if fields and fields[0] == "cpu":
            jiffies = [int(x) for x in fields[1:9]]
            jiffies += [0] * (8 - len(jiffies))
            total, steal = sum(jiffies), jiffies[7]
        elif fields and fields[0] == "procs_running":
            running = int(fields[1])
    if total is None or steal is None or running is None:
        raise ValueError(f"{STAT_PATH}: no aggregate 'cpu' line or no 'procs_running' line")
    return total, steal, running


def parse_proc_stat(text: str) -> tuple[int, int, str]:
    """(pid, ppid, state) of a `/proc/PID/stat` or `/proc/PID/task/TID/stat` text. The command
    name sits in parentheses and may hold spaces or parentheses itself."""
    head, _, rest = text.rpartition(")")
    fields = rest.split()
    if not head or len(fields) < 2:
        raise ValueError(f"not a /proc stat line: {text[:80]!r}")
    return int(head.split("(", 1)[0]), int(fields[1]), fields[0]


def descendants(root: int, parents: dict[int, int]) -> set[int]:
    """`root` and every process below it, from a pid -> ppid map."""
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    tree, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid not in tree:
            tree.add(pid)
            todo.extend(children.get(pid, ()))
    return tree


def steal_fraction(before: HostSample, after: HostSample) -> float:
    """Share of all CPU time between two samples that the hypervisor stole."""
    total = after.cpu_total_jiffies - before.cpu_total_jiffies
    if total <= 0:
        return 0.0
    return (after.cpu_steal_jiffies - before.cpu_steal_jiffies) / total


def noisy_reasons(
    *,
    cores: int,
    load_1m_before: float,
    load_1m_after: float,
    runnable_mean: float,
    steal: float,
    steal_limit: float = STEAL_LIMIT,
) -> list[str]:
    """Why a run cannot be trusted for a target; empty when the host was quiet. `runnable_mean`
    is the mean of other processes' tasks runnable during the run: once they fill all cores but
    one the benchmark shares a core (2 spinners on 2 cores read 2, or 1.5 when a sample misses
    one, and passed as quiet while the limit was the core count)."""
    reasons = []
    if load_1m_before > cores:
        reasons.append(f"load_1m before the run {load_1m_before:.2f} > {cores} cores")
    if load_1m_after > cores:
        reasons.append(f"load_1m after the run {load_1m_after:.2f} > {cores} cores")
    if runnable_mean > cores - 1:  # other tasks left the benchmark less than one free core
        reasons.append(
            f"mean runnable tasks of other processes during the run "
            f"{runnable_mean:.2f} > {cores - 1} (cores less one for the benchmark)"
        )
    if steal > steal_limit:
        reasons.append(f"CPU steal {steal:.3f} > {steal_limit}")
    return reasons


def summarize(*, cores: int, before: HostSample, after: HostSample,
              during: list[HostSample]) -> dict[str, Any]:  # fmt: skip
    """The `machine` fields of a report: load and steal before and after, the samples' mean
    runnable tasks of other processes (the benchmark's own tree, reader included, not counted),
    `noisy` and why. The load after the run is judged less the benchmark's own mean runnable
    tasks: a benchmark whose stages fill the cores is not noise to itself."""
    during = during or [after]
    runnable = [s.others_running if s.others_running is not None
                else max(0, s.procs_running - s.own_running) for s in during]  # fmt: skip
    runnable_mean = sum(runnable) / len(runnable)
    own_mean = sum(max(0, s.own_running - 1) for s in during) / len(during)
    steal = steal_fraction(before, after)
    reasons = noisy_reasons(cores=cores, load_1m_before=before.load_1m,
                            load_1m_after=max(0.0, after.load_1m - own_mean),
                            runnable_mean=runnable_mean, steal=steal)  # fmt: skip
    return {
        "cores": cores,
        "load_before": [before.load_1m, before.load_5m, before.load_15m],
        "load_after": [after.load_1m, after.load_5m, after.load_15m],
        "load_1m_during_mean": sum(s.load_1m for s in during) / len(during) if during else None,
        "runnable_during_mean": runnable_mean,
        "runnable_during_max": max(runnable),
        "own_runnable_during_mean": own_mean,
        "samples_during": len(during),
        "cpu_steal_fraction": steal,
        "noisy": bool(reasons),
        "noisy_reasons": reasons,
    }


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read()
    except OSError:  # the task ended between listing and reading
        return None


def running_tasks(root: int) -> tuple[int, int]:
    """(own, others): runnable threads of `root`'s process tree (at least 1: the reader) and of
    every other process, each thread's state read once from /proc. Both come from one walk, so
    a thread is never counted on one side at one moment and missed on the other a moment later
    (subtracting the tree from /proc/stat's procs_running did that: 2 spinners read 1)."""
    parents: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (text := _read(f"/proc/{name}/stat")) is not None:
            pid, ppid, _ = parse_proc_stat(text)
            parents[pid] = ppid
    tree = descendants(root, parents)
    own = others = 0
    for pid in parents:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            text = _read(f"/proc/{pid}/task/{tid}/stat")
            if text is not None and parse_proc_stat(text)[2] == "R":
                own, others = (own + 1, others) if pid in tree else (own, others + 1)
    return max(1, own), others


def read_sample(root: int | None = None) -> HostSample:
    """One reading; with `root`, the runnable threads of its process tree and of every other
    process are counted apart."""
    with open(LOADAVG_PATH, encoding="ascii") as f:
        load = parse_loadavg(f.read())
    with open(STAT_PATH, encoding="ascii") as f:
        total, steal, running = parse_stat(f.read())
    own, others = running_tasks(root) if root is not None else (1, None)
    return HostSample(load_1m=load[0], load_5m=load[1], load_15m=load[2], procs_running=running,
                      cpu_total_jiffies=total, cpu_steal_jiffies=steal, own_running=own,
                      others_running=others)  # fmt: skip


class HostLoadMonitor:
    """Samples the host from a daemon thread between `start()` and `stop()`; runnable threads of
    the process that built it and of its children (the benchmark's own nodes) are its own."""

    def __init__(self, *, interval_s: float = 1.0, cores: int | None = None) -> None:
        self.interval_s = interval_s
        self.cores = cores or os.cpu_count() or 1
        self._root = os.getpid()  # the benchmark's own tree: this process and its children
        self._before: HostSample | None = None
        self._during: list[HostSample] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._summary: dict[str, Any] | None = None

    def start(self) -> HostLoadMonitor:
        self._before = read_sample()
        self._thread = threading.Thread(target=self._sample, name="host-load", daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        # The first reading is taken at once, so a run shorter than one interval is seen too.
        while True:
            self._during.append(read_sample(self._root))
            if self._stop.wait(self.interval_s):
                return

    def stop(self) -> dict[str, Any]:
        """The summary (see `summarize`); the first call ends sampling, later ones repeat it."""
        if self._summary is None:
            if self._before is None:
                raise RuntimeError("HostLoadMonitor.stop() before start()")
            self._stop.set()
            if self._thread is not None:
                self._thread.join(timeout=5 * self.interval_s)
            # A thread starved until now never read: the end reading then stands for the run.
            self._summary = summarize(cores=self.cores, before=self._before,
                                      after=read_sample(self._root),
                                      during=list(self._during))  # fmt: skip
        return self._summary
