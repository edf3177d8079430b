"""tools/fault_matrix.py: its pure readers of a run, and two real cells of the matrix (a worker
SIGKILLed mid-window, then resumed; an owner frozen while it validates).

    .venv/bin/pytest tests/faults/test_fault_matrix.py -q
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tool_helpers import load_tool

fm = load_tool("fault_matrix")

FROZEN_OWNER = """\
13:19:16 [cli:0] INFO splitlab.launch.train: something before
13:19:16 [cli:0] ERROR splitlab.launch.train: fine-tuning failed: worker0 failed first with exit \
code 4 (timeout); its last lines:
    13:19:04 [worker:0] ERROR splitlab.node: worker 0 failed: WaitTimeoutError: 'worker0' waited \
12.0 s for update
  also failed (consequences): coordinator (exit 8, aborted), owner1 (exit 4, timeout)
  still running after the others failed (hung?), torn down: owner0
"""
KILLED_WORKER = """\
13:17:28 [cli:0] ERROR splitlab.launch.train: fine-tuning failed: worker0 failed first with exit \
code -9 (killed by SIGKILL); its last lines:
    13:17:23 [worker:0] INFO splitlab.node: worker0 starting (session ft-3c96f52960, device cpu)
  torn down: coordinator, owner0, owner1
"""


def test_the_diagnosis_gives_every_exit_and_the_hung_node() -> None:
    frozen = fm.parse_diagnosis(FROZEN_OWNER)
    killed = fm.parse_diagnosis(KILLED_WORKER)

    assert fm.exit_codes(frozen, fm.NODES) == {
        "coordinator": 8, "worker0": 4, "owner0": "torn down", "owner1": 4,
    }  # fmt: skip
    assert fm.victim_named_as(frozen, "owner0") == "hung"
    assert fm.victim_named_as(frozen, "worker0") == "first cause"
    assert fm.exit_codes(killed, fm.NODES)["worker0"] == 128 + 9
    assert fm.victim_named_as(killed, "owner0") is None  # torn down after a crash: no suspect
    assert fm.parse_diagnosis("all fine\n").cause is None


def _records(**nodes: list[dict]) -> dict[str, list[dict]]:
    start = {"kind": "round_start", "round": 0, "num_windows": 4}
    return {"coordinator": [start], **nodes}


@pytest.mark.parametrize(
    ("moment", "records", "files", "state"),
    [
        ("start", {}, {"started": True}, (True, True)),
        ("start", _records(), {"started": True}, (True, False)),
        ("mid_window", _records(worker0=[{"kind": "open", "window": 3}]), {}, (False, False)),
        ("mid_window", _records(worker0=[{"kind": "open", "window": 4}]), {}, (True, True)),
        ("mid_window", _records(worker0=[{"kind": "open", "window": 4},
                                         {"kind": "commit", "window": 4}]), {}, (True, False)),
        ("checkpoint_write", {}, {"temp": True}, (True, True)),
        ("checkpoint_write", {}, {"temp": True, "final": True}, (True, False)),
        ("validation", _records(owner0=[{"kind": "step", "window": 3}]), {}, (True, True)),
        ("validation", _records(owner0=[{"kind": "step", "window": 3},
                                        {"kind": "validation", "round": 0}]), {}, (True, False)),
        ("between_rounds", _records(), {}, (False, False)),
    ],
)  # fmt: skip
def test_moments_are_read_from_the_traces(moment, records, files, state) -> None:
    flags = {"started": False, "temp": False, "final": False, **files}
    assert fm.moment_state(moment, records, **flags) == state


def test_only_and_faults_select_cells() -> None:
    assert fm.select(["worker:validation", "owner"], ["freeze"]) == [
        ("freeze", "owner", m) for m in fm.MOMENTS
    ] + [("freeze", "worker", "validation")]
    assert len(fm.select([], list(fm.FAULTS))) == 30
    with pytest.raises(ValueError, match="'ownr'"):
        fm.select(["ownr"], ["kill"])
    with pytest.raises(ValueError, match="'pause'"):
        fm.select([], ["pause"])


def _assert_cell(cell: dict) -> None:
    assert cell["diagnosed"], cell
    assert cell["exit_after_fault_s"] <= fm.TIMEOUT_S + fm.SLACK_S
    assert cell["orphans"] == []
    assert cell["checkpoints"]["ok"] and not cell["checkpoints"]["corrupt"]


@pytest.mark.slow
def test_a_worker_killed_mid_window_is_named_and_the_run_resumes(tmp_path: Path) -> None:
    cell = fm.run_cell("kill", "worker", "mid_window", work_dir=tmp_path)

    _assert_cell(cell)
    assert cell["first_cause"] == "worker0" and cell["exit_codes"]["worker0"] == 128 + 9
    assert cell["checkpoints"]["files"] == ["round-000001.safetensors"]  # round 0's, intact
    assert cell["resume"] == {
        "exit_code": 0, "expected_round": 1, "first_round": 1, "last_checkpoint_round": 1,
        "ok": True,
    }  # fmt: skip


@pytest.mark.slow
def test_an_owner_frozen_in_validation_is_named_as_hung(tmp_path: Path) -> None:
    cell = fm.run_cell("freeze", "owner", "validation", work_dir=tmp_path, resume=False)

    _assert_cell(cell)
    assert cell["victim_named_as"] in ("hung", "cause's last lines")
    assert cell["exit_codes"]["owner0"] == "torn down"
