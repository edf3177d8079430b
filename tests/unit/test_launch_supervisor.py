"""The process-group supervisor: first failure wins, the rest are torn down, logs are kept."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from splitlab.launch.supervisor import ChildSpec, run_group

PY = sys.executable


def _child(name: str, code: str, **kw: object) -> ChildSpec:
    return ChildSpec(name=name, argv=[PY, "-c", code], **kw)  # type: ignore[arg-type]


def test_all_children_exiting_zero_gives_zero() -> None:
    result = run_group([_child("a", "print('hi')"), _child("b", "print('there')")], sink=None)
    assert result.exit_code == 0 and result.first_failure is None
    assert result.children["a"].last_lines == ["hi"]


def test_first_failure_is_reported_with_its_code_and_last_lines() -> None:
    result = run_group(
        [
            _child("sleeper", "import time; time.sleep(60)"),
            _child("crasher", "import sys; print('diagnosis: peer lost'); sys.exit(3)"),
        ],
        sink=None,
        grace_s=2,
    )
    assert result.exit_code == 3
    assert result.first_failure == "crasher"
    assert "diagnosis: peer lost" in result.diagnosis()
    assert result.children["sleeper"].killed


def test_teardown_is_prompt_and_reaches_children_that_ignore_sigterm() -> None:
    stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"
    start = time.monotonic()
    result = run_group(
        [
            _child("stubborn", stubborn),
            _child("crasher", "import time, sys; time.sleep(0.5); sys.exit(2)"),
        ],
        sink=None,
        grace_s=1,
    )
    assert result.exit_code == 2
    assert time.monotonic() - start < 20
    assert result.children["stubborn"].exit_code is not None


def test_group_timeout_tears_everything_down() -> None:
    result = run_group(
        [_child("sleeper", "import time; time.sleep(60)")], sink=None, timeout_s=1, grace_s=1
    )
    assert result.exit_code == 4 and result.first_failure == "supervisor"


def test_child_log_is_written_to_its_file(tmp_path: Path) -> None:
    log = tmp_path / "a.log"
    run_group([_child("a", "print('line one'); print('line two')", log_path=log)], sink=None)
    assert log.read_text().splitlines() == ["line one", "line two"]


def test_signal_death_is_reported_like_a_shell() -> None:
    result = run_group(
        [_child("victim", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")], sink=None
    )
    assert result.exit_code == 128 + 9
