"""Slurm job records: sacct output parsed, records written and read back, log tails.

.venv/bin/pytest tests/unit/test_slurm_jobs.py -q
"""

from __future__ import annotations

import json
from pathlib import Path

from splitlab.cluster.slurm_jobs import (
    SlurmJobRecord,
    log_tail,
    parse_sacct,
    query_sacct,
    read_record,
    write_record,
)

SACCT = """\
12_0|COMPLETED|0:0
12_1|CANCELLED by 0|0:15
12_[2-3]|PENDING|0:0
13|TIMEOUT|0:0

14|FAILED|4:0
"""


def test_parse_sacct_keeps_first_word_and_skips_unstarted_array_tasks() -> None:
    assert parse_sacct(SACCT) == {
        "12_0": ("COMPLETED", "0:0"),
        "12_1": ("CANCELLED", "0:15"),
        "13": ("TIMEOUT", "0:0"),
        "14": ("FAILED", "4:0"),
    }


def test_record_round_trips_and_tolerates_unknown_fields(tmp_path: Path) -> None:
    record = SlurmJobRecord(job_num=3, job_id="12_3", state="FAILED", exit_code="4:0",
                            overrides=["task.seed=1"], log_tail="boom")  # fmt: skip
    path = write_record(tmp_path / "3", record)
    assert read_record(tmp_path / "3") == record
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "from_a_newer_version": 1}))
    assert read_record(tmp_path / "3") == record
    assert read_record(tmp_path / "missing") is None


def test_failed_means_not_completed_or_an_error_of_its_own() -> None:
    assert not SlurmJobRecord(job_num=0, job_id="1", state="COMPLETED").failed
    assert SlurmJobRecord(job_num=0, job_id="1", state="COMPLETED", error="ValueError()").failed
    assert SlurmJobRecord(job_num=0, job_id="1", state="NODE_FAIL").failed


def test_log_tail_takes_the_last_lines_of_each_existing_log(tmp_path: Path) -> None:
    err = tmp_path / "1_0_log.err"
    err.write_text("".join(f"line {i}\n" for i in range(30)))
    (tmp_path / "empty.out").write_text("")
    tail = log_tail([err, tmp_path / "empty.out", tmp_path / "missing.out", None], 3)
    assert tail == "==> 1_0_log.err <==\nline 27\nline 28\nline 29"


def test_query_sacct_is_none_when_sacct_cannot_answer(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "no-such-slurm.conf"))
    monkeypatch.setenv("PATH", str(tmp_path))  # no sacct on PATH
    assert query_sacct(["12_0"]) is None
    assert query_sacct([]) == {}
