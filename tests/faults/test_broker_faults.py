"""A fine-tuning run over a real RabbitMQ broker: the broker closes a node's connection mid-run
(`rabbitmqctl close_connection`, as an operator or a broker restart would), and the run is
diagnosed by that node and cause within the timeout, with no orphan and no queue left behind;
a run that ends well leaves no queue either (control bus and tensor transport).

    SPLITLAB_REQUIRE_BROKER=1 .venv/bin/pytest tests/faults/test_broker_faults.py -q
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from control_helpers import REPO, close_broker_connection, require_rabbitmqctl
from tool_helpers import load_tool

from splitlab.control import broker_users
from splitlab.errors import ExitCode

fm = load_tool("fault_matrix")
pytestmark = [pytest.mark.rabbitmq, pytest.mark.slow]
_SESSION = re.compile(r"session (ft-[0-9a-f]+)")


def _rabbitmqctl(*args: str) -> list[list[str]]:
    """Rows of a `rabbitmqctl ... -q` listing (tab-separated), header dropped."""
    require_rabbitmqctl()
    done = subprocess.run(["rabbitmqctl", *args, "-q"], capture_output=True, text=True,
                          timeout=60, check=True)  # fmt: skip
    rows = [line.split("\t") for line in done.stdout.splitlines() if line.strip()]
    return rows[1:] if rows and rows[0][0] == "name" else rows


def _session_queues(session: str) -> list[str]:
    return [row[0] for row in _rabbitmqctl("list_queues", "name")
            if row[0].startswith(f"splitlab.{session}.")]  # fmt: skip


def _session(log_path: Path, proc: subprocess.Popen[bytes], timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        if match := _SESSION.search(log_path.read_text()):
            return match.group(1)
        time.sleep(0.1)
    raise AssertionError(f"no session line in {log_path}:\n{log_path.read_text()[-3000:]}")


def _after_round_one(run_dir: Path, log_path: Path, proc: subprocess.Popen[bytes]) -> str:
    """The run's session, once its coordinator has traced the end of a round."""
    session = _session(log_path, proc, fm.MOMENT_WAIT_S)
    trace = run_dir / "traces" / f"{fm.TRACE['coordinator']}.jsonl"
    deadline = time.monotonic() + fm.MOMENT_WAIT_S
    while not (trace.exists() and '"round_end"' in trace.read_text()):
        assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
        time.sleep(0.1)
    return session


def test_a_finished_run_leaves_no_queue_on_the_broker(tmp_path: Path) -> None:
    log_path = tmp_path / "run.log"
    proc = fm.launcher(tmp_path / "run", "control=rabbitmq", "transport=rabbitmq",
                       log_path=log_path)  # fmt: skip
    session = _session(log_path, proc, fm.MOMENT_WAIT_S)
    code = proc.wait(timeout=fm.RESUME_WAIT_S)

    assert code == 0, log_path.read_text()[-3000:]
    assert _session_queues(session) == []


def test_a_connection_closed_by_the_broker_is_named_within_the_timeout(tmp_path: Path) -> None:
    # Prepare: a run long enough to be cut mid-way
    run_dir, log_path = tmp_path / "run", tmp_path / "run.log"
    proc = fm.launcher(run_dir, "control=rabbitmq", "task.rounds=40", log_path=log_path)
    try:
        session = _after_round_one(run_dir, log_path, proc)

        # Execute
        close_broker_connection(f"splitlab.{session}.owner0")
        closed = time.monotonic()
        code = proc.wait(timeout=fm.EXIT_WAIT_S)
        took_s = time.monotonic() - closed
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    # Assert: owner0 named first with a lost peer and the broker's reason; nothing left behind
    log = log_path.read_text()
    assert code == ExitCode.PEER_LOST, log[-3000:]
    assert "owner0 failed first with exit code 3 (peer_lost)" in log, log[-3000:]
    assert "CONNECTION_FORCED - splitlab test" in log  # the reason the broker was given
    assert took_s <= fm.TIMEOUT_S + fm.SLACK_S, took_s
    assert fm.node_pids(run_dir) == {}
    assert fm.check_checkpoints(run_dir / "checkpoints")["ok"]
    assert _session_queues(session) == []


def test_a_killed_launcher_takes_its_nodes_with_it(tmp_path: Path) -> None:
    """Over RabbitMQ nothing else tells the nodes that their launcher is gone: a SIGKILLed
    launcher used to leave them training unsupervised, their output lost. Now each node dies
    with it (`die_with_launcher`) and its log file keeps what it wrote. Run with node users,
    the session's vhost and users outlive the launcher until tools/broker_users.py removes
    them."""
    # Prepare: a long run over the broker, mid-way through its first rounds
    require_rabbitmqctl()
    run_dir, log_path = tmp_path / "run", tmp_path / "run.log"
    proc = fm.launcher(run_dir, "control=rabbitmq", "control.node_users=true", "task.rounds=40",
                       log_path=log_path)  # fmt: skip
    try:
        session = _after_round_one(run_dir, log_path, proc)
        nodes = fm.node_pids(run_dir)
        assert sorted(nodes.values()) == ["coordinator", "owner0", "owner1", "worker0"]

        # Execute
        proc.kill()
        proc.wait()
        killed = time.monotonic()
        while (left := fm.node_pids(run_dir)) and time.monotonic() - killed < 10:
            time.sleep(0.05)
        took_s = time.monotonic() - killed
    finally:
        for pid in fm.node_pids(run_dir):
            os.kill(pid, signal.SIGKILL)

    # Assert: every node gone within seconds; each one's own lines in its log file
    assert left == {}, f"{sorted(left.values())} still running {took_s:.1f} s after the kill"
    assert took_s < 5, took_s
    for name in nodes.values():
        assert (
            f"{name} starting (session {session}" in (run_dir / "logs" / f"{name}.log").read_text()
        )
    assert "round 1/40 done" in (run_dir / "logs" / "coordinator.log").read_text()
    assert sorted(broker_users.leftovers()[session]) == sorted(nodes.values())
    tool = subprocess.run([sys.executable, str(REPO / "tools" / "broker_users.py"), "remove",
                           session], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert tool.returncode == 0, tool.stderr
    assert session not in broker_users.leftovers()
