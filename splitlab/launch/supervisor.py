"""Run a group of child processes as one job: stream their logs, stop at the first failure.

The launcher turns a config into node specs and hands their command lines here. The
supervisor prefixes every child's output lines with its name, keeps each child's last lines,
and when any child exits non-zero it terminates the others (SIGTERM, then SIGKILL after a
grace period) and reports which child failed first, with its exit code and last log lines.
Children are always torn down, whatever happens to the supervisor.

    python -m pytest tests/unit/test_launch_supervisor.py -q
"""

from __future__ import annotations

import collections
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChildSpec:
    """One process: its display name, argv, extra environment and optional log file."""

    name: str
    argv: Sequence[str]
    env: Mapping[str, str] = field(default_factory=dict)
    log_path: Path | None = None


@dataclass
class ChildResult:
    name: str
    exit_code: int | None  # None: still running when torn down
    last_lines: list[str]
    killed: bool = False  # torn down by the supervisor, not exited by itself


@dataclass
class GroupResult:
    exit_code: int  # 0 when every child exited 0; else the first failure's code
    first_failure: str | None
    children: dict[str, ChildResult]

    def diagnosis(self) -> str:
        if self.first_failure is None:
            return "all processes exited 0"
        child = self.children[self.first_failure]
        tail = "\n    ".join(child.last_lines[-10:]) or "(no output)"
        return f"{child.name} failed first with exit code {child.exit_code}; its last lines:\n    {tail}"


class _Child:
    def __init__(self, spec: ChildSpec, sink: IO[str] | None, tail_lines: int) -> None:
        self.spec = spec
        env = {**os.environ, **spec.env, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            list(spec.argv),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            text=True,
            bufsize=1,
            start_new_session=True,  # its own process group: teardown reaches grandchildren
        )
        self.lines: collections.deque[str] = collections.deque(maxlen=tail_lines)
        self.killed = False
        self._sink = sink
        self._log_file = open(spec.log_path, "a", encoding="utf-8") if spec.log_path else None  # noqa: SIM115
        self.reader = threading.Thread(target=self._pump, name=f"log-{spec.name}", daemon=True)
        self.reader.start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            self.lines.append(line)
            if self._log_file is not None:
                self._log_file.write(line + "\n")
                self._log_file.flush()
            if self._sink is not None:
                self._sink.write(f"{self.spec.name:>12} | {line}\n")
                self._sink.flush()
        if self._log_file is not None:
            self._log_file.close()

    def signal_group(self, sig: int) -> None:
        if self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass


def run_group(
    specs: Sequence[ChildSpec],
    *,
    timeout_s: float | None = None,
    grace_s: float = 5.0,
    sink: IO[str] | None = sys.stderr,
    tail_lines: int = 40,
    poll_s: float = 0.05,
) -> GroupResult:
    """Start every child, wait for all to exit 0 or for the first failure, tear down the rest.

    Args:
        specs: the children, started in order.
        timeout_s: wall-clock bound for the whole group; on expiry every child is torn down
            and the result carries exit code 4 (timeout) naming the group.
        grace_s: seconds between SIGTERM and SIGKILL during teardown.
        sink: where prefixed child output goes (None: only kept in memory / log files).
    """
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"child names must be unique: {names}")
    children: list[_Child] = []
    first_failure: str | None = None
    exit_code = 0
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        for spec in specs:
            children.append(_Child(spec, sink, tail_lines))
        while True:
            running = [c for c in children if c.proc.poll() is None]
            failed = [c for c in children if c.proc.returncode not in (None, 0)]
            if failed:
                first = failed[0]
                first_failure, exit_code = first.spec.name, int(first.proc.returncode)
                if exit_code < 0:  # killed by a signal: report it as 128 + signal, like a shell
                    exit_code = 128 - exit_code
                break
            if not running:
                break
            if deadline is not None and time.monotonic() > deadline:
                first_failure, exit_code = "supervisor", 4
                log.error("process group timed out after %.1f s", timeout_s)
                break
            time.sleep(poll_s)
    finally:
        _teardown(children, grace_s)
    results = {
        c.spec.name: ChildResult(c.spec.name, c.proc.returncode, list(c.lines), c.killed)
        for c in children
    }
    if first_failure == "supervisor":
        results["supervisor"] = ChildResult("supervisor", 4, [f"timed out after {timeout_s} s"])
    return GroupResult(exit_code=exit_code, first_failure=first_failure, children=results)


def _teardown(children: list[_Child], grace_s: float) -> None:
    alive = [c for c in children if c.proc.poll() is None]
    for child in alive:
        child.killed = True
        child.signal_group(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for child in alive:
        try:
            child.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.signal_group(signal.SIGKILL)
            child.proc.wait(timeout=10)
    for child in children:
        child.reader.join(timeout=5)
