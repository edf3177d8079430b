"""The process-group supervisor: first failure wins, the rest are torn down, logs are kept."""

from __future__ import annotations

import itertools
import sys
import time
from pathlib import Path

import pytest
from process_helpers import alive

from splitlab.errors import ExitCode
from splitlab.launch.supervisor import (
    ChildResult,
    ChildSpec,
    GroupResult,
    cause_rank,
    exit_meaning,
    root_cause,
    run_group,
)

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


def test_a_stopped_child_dies_of_its_sigterm_without_the_grace() -> None:
    # a frozen node (SIGSTOP) keeps a SIGTERM pending: without a SIGCONT the teardown waited
    # the whole grace for the SIGKILL (tools/fault_matrix.py, freeze cells)
    frozen = "import os, signal; os.kill(os.getpid(), signal.SIGSTOP)"
    crasher = "import time, sys; time.sleep(1); sys.exit(2)"
    start = time.monotonic()
    result = run_group(
        [_child("frozen", frozen), _child("crasher", crasher)], sink=None, grace_s=30
    )
    assert time.monotonic() - start < 15
    assert result.children["frozen"].killed
    assert result.children["frozen"].exit_code == -15  # SIGTERM, not the grace's SIGKILL


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


# ---- the root cause wins, not whoever exited first (issue 18, F4) ----


@pytest.mark.parametrize(
    ("code", "rank"),
    [(0, None), (8, 2), (3, 1), (4, 1), (1, 0), (2, 0), (5, 0), (6, 0), (7, 0), (137, 0),
     (-9, 0), (143, 0), (99, 0)],
)  # fmt: skip
def test_cause_rank_puts_relayed_aborts_last(code: int, rank: int | None) -> None:
    assert cause_rank(code) == rank


def test_cause_rank_covers_every_exit_code() -> None:
    ranks = {code: cause_rank(code) for code in range(-64, 256)}
    assert ranks[0] is None
    assert {c for c, r in ranks.items() if r == 2} == {int(ExitCode.ABORTED)}
    assert {c for c, r in ranks.items() if r == 1} == {
        int(ExitCode.PEER_LOST),
        int(ExitCode.TIMEOUT),
    }
    assert all(r == 0 for c, r in ranks.items() if c not in (0, 3, 4, 8))


@pytest.mark.parametrize(
    ("exits", "cause"),
    [
        ([], None),
        ([("coordinator", 8), ("owner0", 4), ("owner1", 4)], "owner0"),  # frozen worker
        ([("coordinator", 8), ("owner1", 8), ("owner0", 2)], "owner0"),  # missing label column
        ([("coordinator", 8), ("owner0", 3), ("worker0", 5)], "worker0"),  # lr=1e6
        ([("owner0", 3), ("owner1", 4)], "owner0"),  # same rank: earliest
        ([("worker0", 137), ("owner0", 3)], "worker0"),  # a SIGKILL is a cause
        ([("coordinator", 8), ("owner0", 8)], "coordinator"),  # only consequences: earliest
        ([("a", 1), ("b", 2)], "a"),  # two root causes: earliest
    ],
    ids=["none", "frozen", "config", "nonfinite", "earliest", "killed", "aborts", "two-roots"],
)
def test_root_cause_is_the_earliest_of_the_best_rank(
    exits: list[tuple[str, int]], cause: str | None
) -> None:
    assert root_cause(exits) == cause


def test_root_cause_of_every_order_of_a_mixed_group() -> None:
    group = [("coordinator", 8), ("owner0", 3), ("worker0", 5), ("owner1", 8)]
    for order in itertools.permutations(group):
        assert root_cause(list(order)) == "worker0"
    for order in itertools.permutations([e for e in group if e[0] != "worker0"]):
        assert root_cause(list(order)) == "owner0"


def _exit_after(delay_s: float, code: int, line: str) -> str:
    return f"import sys, time; time.sleep({delay_s}); print({line!r}); sys.exit({code})"


def test_a_relayed_abort_exiting_first_does_not_hide_the_root_cause() -> None:
    result = run_group(
        [
            _child("coordinator", _exit_after(0.2, 8, "aborted by owner0")),
            _child("owner0", _exit_after(1.5, 2, "data.label_column 'label' is missing")),
            _child("worker0", "import time; time.sleep(60)"),
        ],
        sink=None,
        grace_s=1,
    )

    assert result.first_failure == "owner0" and result.exit_code == 2
    assert "label_column" in result.diagnosis()
    assert "coordinator" in result.diagnosis()  # the consequences are listed too
    assert result.children["worker0"].killed


def test_the_grace_for_a_root_cause_is_bounded() -> None:
    start = time.monotonic()
    result = run_group(
        [
            _child("coordinator", _exit_after(0.2, 8, "aborted")),
            _child("late", _exit_after(30, 2, "too late")),
        ],
        sink=None,
        grace_s=1,
        cause_grace_s=1.0,
    )

    assert result.first_failure == "coordinator" and result.exit_code == 8
    assert time.monotonic() - start < 10


def test_a_root_cause_stops_the_group_without_waiting_for_the_grace() -> None:
    start = time.monotonic()
    result = run_group(
        [_child("crasher", _exit_after(0.1, 5, "nan")), _child("s", "import time; time.sleep(60)")],
        sink=None,
        grace_s=1,
        cause_grace_s=30.0,
    )

    assert result.exit_code == 5
    assert time.monotonic() - start < 10


@pytest.mark.parametrize(
    ("code", "meaning"),
    [(None, "still running"), (0, "ok"), (8, "aborted"), (5, "non_finite"),
     (-9, "killed by SIGKILL"), (143, "killed by SIGTERM"), (42, "unclassified")],
)  # fmt: skip
def test_exit_meaning_names_the_code(code: int | None, meaning: str) -> None:
    assert exit_meaning(code) == meaning


def test_diagnosis_names_the_cause_the_consequences_and_the_torn_down() -> None:
    result = GroupResult(
        exit_code=5,
        first_failure="worker0",
        children={
            "coordinator": ChildResult("coordinator", 8, ["aborted by worker0"]),
            "worker0": ChildResult("worker0", 5, ["non-finite gradient in layers.1"]),
            "owner0": ChildResult("owner0", -15, [], killed=True),
        },
    )

    text = result.diagnosis()

    assert text.startswith("worker0 failed first with exit code 5 (non_finite)")
    assert "non-finite gradient in layers.1" in text
    assert "also failed (consequences): coordinator (exit 8, aborted)" in text
    assert text.endswith("torn down: owner0")


def test_diagnosis_names_the_nodes_still_running_after_a_timeout_as_hung() -> None:
    # a frozen owner: its peers time out, it logs nothing (tools/fault_matrix.py, freeze cells)
    children = {
        "worker0": ChildResult("worker0", 4, ["'worker0' waited 12.0 s for update"]),
        "owner0": ChildResult("owner0", -15, [], killed=True),
    }

    timed_out = GroupResult(exit_code=4, first_failure="worker0", children=children).diagnosis()
    children["worker0"] = ChildResult("worker0", 1, ["Traceback"])
    crashed = GroupResult(exit_code=1, first_failure="worker0", children=children).diagnosis()

    assert timed_out.endswith("still running after the others failed (hung?), torn down: owner0")
    assert crashed.endswith("\n  torn down: owner0")


def test_when_up_runs_once_after_every_child_has_printed_its_first_line() -> None:
    calls: list[float] = []
    start = time.monotonic()
    result = run_group(
        [
            _child("quick", "print('up', flush=True)"),
            _child(
                "slow", "import time; time.sleep(1.0); print('up', flush=True); time.sleep(0.5)"
            ),
        ],
        sink=None,
        when_up=lambda: calls.append(time.monotonic() - start),
    )
    assert result.exit_code == 0
    assert len(calls) == 1 and calls[0] >= 1.0  # not before the slow child spoke


def test_when_up_is_not_called_when_a_child_never_speaks() -> None:
    calls: list[int] = []
    result = run_group(
        [_child("quiet", "import sys; sys.exit(2)"), _child("talker", "print('up')")],
        sink=None,
        when_up=lambda: calls.append(1),
    )
    assert result.exit_code == 2 and calls == []


@pytest.mark.parametrize("armed", [True, False])
def test_a_killed_supervisor_takes_its_armed_children_and_keeps_their_lines(
    tmp_path: Path, armed: bool
) -> None:
    import os
    import signal
    import subprocess

    arm = (
        "from splitlab.launch.supervisor import die_with_launcher; die_with_launcher(); "
        if armed
        else ""
    )
    child = arm + "import os, time; print('child', os.getpid(), flush=True); time.sleep(120)"
    parent = (
        "import sys, pathlib\n"
        "from splitlab.launch.supervisor import ChildSpec, run_group\n"
        f"run_group([ChildSpec('c', [sys.executable, '-c', {child!r}], "
        "log_path=pathlib.Path(sys.argv[1]))], sink=None)\n"
    )
    log_path = tmp_path / "c.log"
    proc = subprocess.Popen([PY, "-c", parent, str(log_path)])
    deadline = time.monotonic() + 60
    while not (log_path.exists() and "child" in log_path.read_text()):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    pid = int(log_path.read_text().split()[1])
    proc.send_signal(signal.SIGKILL)  # the supervisor dies without a word
    proc.wait()
    deadline = time.monotonic() + 5
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        assert alive(pid) is not armed  # armed: gone with its supervisor; else left running
        assert log_path.read_text() == f"child {pid}\n"  # written by the child itself
    finally:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
