"""Storage faults of a fine-tuning run, end to end through the real launcher: the disk fills
during a checkpoint write (a small tmpfs over RUN/checkpoints), and the newest checkpoint is
corrupted or truncated before a resume. Each is named by its cause and file, nothing partial
is left or loaded, and the run resumes from the last intact checkpoint where one exists.

    .venv/bin/pytest tests/faults/test_storage_faults.py -q
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from tool_helpers import load_tool

from splitlab.errors import ExitCode

fm = load_tool("fault_matrix")
CHECKPOINT_BYTES = 4_136_408  # one tiny_bert checkpoint of fm.CONFIG: 3.9 MiB
DISK = "6m"  # room for one checkpoint and a part of the next


def _launch(run_dir: Path, *extra: str) -> tuple[int, str]:
    log_path = run_dir.parent / f"{run_dir.name}.log"
    proc = fm.launcher(run_dir, *extra, log_path=log_path)
    code = proc.wait(timeout=fm.RESUME_WAIT_S)
    return code, log_path.read_text()


def _needs_root() -> None:
    if os.geteuid() != 0:
        message = "mounting a small tmpfs needs root"
        if os.environ.get("SPLITLAB_REQUIRE_TESTBED") == "1":  # CI runs as root
            pytest.fail(message + " and SPLITLAB_REQUIRE_TESTBED=1", pytrace=False)
        pytest.skip(message)


@contextlib.contextmanager
def _tmpfs(folder: Path, options: str) -> Iterator[None]:
    """A small tmpfs mounted (as root) over `folder` for the block."""
    _needs_root()
    folder.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)], check=True)
    try:
        yield
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=True)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run of fm.CONFIG's two rounds with both checkpoints kept."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    code, log = _launch(run_dir)
    assert code == 0, log[-3000:]
    assert fm.check_checkpoints(run_dir / "checkpoints")["files"] == [
        "round-000001.safetensors", "round-000002.safetensors"]  # fmt: skip
    return run_dir


def _copy(run_dir: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    return copy


@pytest.mark.slow
def test_a_full_disk_during_a_checkpoint_write_is_named_and_the_run_resumes(
    tmp_path: Path,
) -> None:
    _needs_root()
    run_dir = tmp_path / "run"
    disk = run_dir / "checkpoints"
    disk.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK}", "tmpfs", str(disk)],
                   check=True)  # fmt: skip
    try:
        # Execute: round 1's checkpoint fits, round 2's fills the disk
        code, log = _launch(run_dir)

        # Assert: exit 9 from the coordinator naming the file and the cause; round 1 intact
        assert code == ExitCode.STORAGE, log[-3000:]
        assert "coordinator failed first with exit code 9 (storage)" in log, log[-3000:]
        assert "round-000002.safetensors': cannot be written" in log
        assert "No space left on device" in log
        assert "the newest earlier one is round-000001.safetensors" in log
        assert fm.check_checkpoints(disk) == {
            "files": ["round-000001.safetensors"], "corrupt": {}, "temps": [], "ok": True}  # fmt: skip

        # Execute: room again, then resume
        subprocess.run(["mount", "-o", "remount,size=32m", str(disk)], check=True)
        outcome = fm.resume_outcome(run_dir, 1, run_dir.parent / "resume.log")

        # Assert: it continued with round 2 and wrote its checkpoint
        assert outcome["ok"], (outcome, (run_dir.parent / "resume.log").read_text()[-3000:])
        assert fm.check_checkpoints(disk)["ok"]
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


@pytest.mark.slow
def test_a_corrupted_newest_checkpoint_falls_back_to_the_last_intact_one(
    finished_run: Path, tmp_path: Path
) -> None:
    # Prepare: finite noise over 4 KiB of round 2's tensor data (its header stays valid)
    run_dir = _copy(finished_run, tmp_path)
    newest = run_dir / "checkpoints" / "round-000002.safetensors"
    with newest.open("r+b") as f:
        header = int.from_bytes(f.read(8), "little")
        f.seek(8 + header + 64 * 1024)
        f.write(bytes(range(256)) * 16)

    # Execute
    outcome = fm.resume_outcome(run_dir, 1, tmp_path / "resume.log")

    # Assert: round 2 is skipped with one line naming it and why, round 1's state resumes
    log = (tmp_path / "resume.log").read_text()
    assert outcome["ok"], (outcome, log[-3000:])
    said = [line for line in log.splitlines() if "resuming from round-000001" in line]
    assert len(said) == 1, log[-3000:]
    assert "round-000002.safetensors" in said[0] and "checksum (corrupted)" in said[0]
    assert fm.check_checkpoints(run_dir / "checkpoints")["ok"]  # round 2 written anew


@pytest.mark.slow
def test_a_truncated_only_checkpoint_is_refused_naming_the_file(
    finished_run: Path, tmp_path: Path
) -> None:
    # Prepare: round 1's file gone, round 2's cut in half: no intact checkpoint is left
    run_dir = _copy(finished_run, tmp_path)
    (run_dir / "checkpoints" / "round-000001.safetensors").unlink()
    newest = run_dir / "checkpoints" / "round-000002.safetensors"
    os.truncate(newest, CHECKPOINT_BYTES // 2)
    trace = run_dir / "traces" / f"{fm.TRACE['coordinator']}.jsonl"
    starts_before = trace.read_text().count('"round_start"')

    # Execute
    code, log = _launch(run_dir, "task.resume=true")

    # Assert: exit 7 naming the file; never a fresh start from round 1 over the user's run
    assert code == ExitCode.ASSETS, log[-3000:]
    assert f"checkpoint {str(newest)!r}: cannot be read" in log, log[-3000:]
    records = [json.loads(line) for line in trace.read_text().splitlines() if line]
    assert sum(r.get("kind") == "round_start" for r in records) == starts_before


@pytest.mark.slow
def test_a_full_disk_under_the_traces_is_named_by_the_node_that_hit_it(tmp_path: Path) -> None:
    """The trace writer's thread used to die with a traceback on ENOSPC while its node went on
    without traces (and the launcher then reported that no owner traced a round)."""
    run_dir = tmp_path / "run"
    with _tmpfs(run_dir / "traces", "size=12k"):
        # Execute: the traces outgrow 12 KiB (three pages) during the first round
        code, log = _launch(run_dir)

    # Assert: exit 9 naming a node's trace file and the cause; no traceback
    assert code == ExitCode.STORAGE, log[-3000:]
    assert re.search(r"(\w+) failed first with exit code 9 \(storage\)", log), log[-3000:]
    assert re.search(r"trace '[^']+/traces/\w+-\d\.jsonl': cannot be written: .*No space left", log)
    assert "Traceback" not in log, log[-3000:]
    assert fm.node_pids(run_dir) == {}


@pytest.mark.slow
def test_a_launcher_output_that_cannot_be_written_is_named(tmp_path: Path) -> None:
    """The launcher's own writes after training (metrics, plot, report) ended in a traceback
    and exit 1 on a full or read-only disk."""
    run_dir = tmp_path / "run"
    with _tmpfs(run_dir / "analysis", "ro,size=1m"):
        code, log = _launch(run_dir)

    assert code == ExitCode.STORAGE, log[-3000:]
    named = r"/analysis/\w+\.\w+': cannot be written: \[Errno 30\] Read-only"
    assert re.search(named, log), log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    assert fm.check_checkpoints(run_dir / "checkpoints")["ok"]  # the run itself is whole
