"""Trace record types: registry, one type per field name, stamping, spread fields, the tracer.

.venv/bin/pytest tests/unit/test_telemetry_records.py -q
"""

from __future__ import annotations

import json
import time
from dataclasses import FrozenInstanceError, dataclass
from pathlib import Path
from typing import ClassVar

import pytest

from splitlab.telemetry.records import (
    BASE_FIELDS,
    RECORD_TYPES,
    Record,
    TokenRecord,
    TransportRecord,
    WindowRecord,
    check_record,
    field_types,
    register_record,
    required_fields,
    stamp,
)
from splitlab.telemetry.trace import Tracer


def test_every_kind_is_registered_under_its_own_tag() -> None:
    assert RECORD_TYPES and all(cls.KIND == kind for kind, cls in RECORD_TYPES.items())
    assert {"token", "stage_meta", "window", "migration", "microbatch", "round", "wrr",
            "transport", "fedavg", "validation"} <= set(RECORD_TYPES)  # fmt: skip


def test_one_field_name_has_one_type_across_every_kind() -> None:
    seen: dict[str, tuple[type, ...]] = {}
    clashes = []
    for kind in RECORD_TYPES:
        for name, declared in field_types(kind).items():
            if seen.setdefault(name, declared.kinds) != declared.kinds:
                clashes.append(f"{kind}.{name}: {declared.kinds} vs {seen[name]}")
    assert not clashes


def test_misspelt_field_fails_at_construction() -> None:
    with pytest.raises(TypeError, match="recv_ms"):
        TokenRecord(stage=0, token=0, compute_ms=1.0, recv_ms=1.0, send_ms=0.0, bytes=1)  # type: ignore[call-arg]  # fmt: skip


def test_records_are_frozen() -> None:
    record = TransportRecord(transport="tcp", peer="w0")
    with pytest.raises(FrozenInstanceError):
        record.peer = "w1"  # type: ignore[misc]


def test_stamp_puts_base_fields_first_and_omits_unset_optionals() -> None:
    token = TokenRecord(stage=1, token=3, compute_ms=1.5, recv_wait_ms=0.5, send_ms=0.1, bytes=64)
    line = stamp(token, ts_us=10, role="stage", rank=1)
    assert list(line)[:4] == list(BASE_FIELDS)
    assert line["kind"] == "token" and "tpot_ms" not in line and line["prefill"] is False


def test_a_nullable_field_without_default_is_written_as_null() -> None:
    window = WindowRecord(epoch=1, aborted=True, decision="fatal: x", barrier_ms=None,
                          prestage_ms=None, commit_ms=None)  # fmt: skip
    assert window.to_dict()["barrier_ms"] is None
    assert required_fields("window") == ("epoch", "aborted", "decision")


def test_spread_field_is_written_flat_and_declared_names_win() -> None:
    counters = {"gradient.bytes_sent": 5, "peer": "x", "ts_us": 0}
    record = TransportRecord(transport="tcp", counters=counters)
    assert record.to_dict() == {"kind": "transport", "transport": "tcp",
                                "gradient.bytes_sent": 5}  # fmt: skip


def test_check_record_names_the_field_and_tolerates_the_unknown() -> None:
    line = stamp(TokenRecord(stage=0, token=0, compute_ms=1.0, recv_wait_ms=0.0, send_ms=0.0,
                             bytes=8), ts_us=1, role="stage", rank=0)  # fmt: skip
    assert check_record({**line, "new_field": object()}) == []
    assert check_record({**line, "compute_ms": None, "send_ms": "inf", "bytes": 8}) == []
    problems = check_record({**line, "stage": True, "bytes": 1.5})
    named = [p.split(" is ")[0] for p in problems]
    assert named == ["'token' field 'stage'", "'token' field 'bytes'"]
    assert check_record({"ts_us": 1, "role": "x", "rank": 0, "kind": "unheard_of", "a": 1}) == []


def test_register_refuses_a_base_field_and_a_second_class_for_a_kind() -> None:
    @dataclass(frozen=True, kw_only=True)
    class Clash(Record):
        KIND: ClassVar[str] = "test_clash"
        rank: int

    with pytest.raises(TypeError, match="rank"):
        register_record(Clash)

    @dataclass(frozen=True, kw_only=True)
    class Again(Record):
        KIND: ClassVar[str] = "token"

    with pytest.raises(TypeError, match="already TokenRecord"):
        register_record(Again)


def test_tracer_writes_stamped_lines_and_off_is_a_no_op(tmp_path: Path) -> None:
    token = TokenRecord(stage=2, token=0, compute_ms=1.0, recv_wait_ms=0.0, send_ms=0.0, bytes=8)
    with Tracer.open(tmp_path / "stage-2.jsonl", role="stage", rank=2) as tracer:
        tracer.write(token)
    (line,) = (tmp_path / "stage-2.jsonl").read_text().splitlines()
    record = json.loads(line)
    assert record["role"] == "stage" and record["rank"] == 2 and record["stage"] == 2
    assert check_record(record) == []
    off = Tracer.null()
    off.write(token)
    assert not off.enabled


def test_a_trace_that_cannot_be_written_is_a_storage_error_in_the_callers_thread() -> None:
    """/dev/full fails every write with ENOSPC, as a full disk would: the writer thread used
    to die with a traceback while the node trained on without traces (and its queue grew)."""
    from splitlab.errors import ExitCode, StorageError
    from splitlab.telemetry.records import AbortRecord

    tracer = Tracer.open("/dev/full", role="owner", rank=0)
    tracer.write(AbortRecord(reason="first"))
    deadline = time.monotonic() + 10
    while tracer.error is None and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(
        StorageError, match="trace '/dev/full': cannot be written: .*No space left"
    ) as err:
        tracer.write(AbortRecord(reason="second"))
    assert err.value.exit_code == ExitCode.STORAGE
    tracer.close()  # already raised: closes quietly


def test_a_failure_in_the_last_flush_is_raised_by_close() -> None:
    from splitlab.errors import StorageError
    from splitlab.telemetry.records import AbortRecord

    tracer = Tracer.open("/dev/full", role="owner", rank=0)
    tracer.write(AbortRecord(reason="only"))
    with pytest.raises(StorageError, match="/dev/full"):
        tracer.close()
    tracer.close()  # idempotent


def test_a_trace_folder_that_cannot_be_made_is_a_storage_error(tmp_path: Path) -> None:
    from splitlab.errors import StorageError

    (tmp_path / "file").write_text("x")
    with pytest.raises(StorageError, match="cannot be opened"):
        Tracer.for_run(tmp_path / "file", role="owner", rank=0)  # RUN is a file: no traces/
