"""Trace loading: concatenation, a truncated last line tolerated, garbage named by file and line,
known fields checked by type, unknown fields and kinds read as they are.

.venv/bin/pytest tests/unit/test_analysis_traces.py -q
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from splitlab.analysis.synthetic import ring_records, write_traces
from splitlab.analysis.traces import TraceFormatError, load_traces, select, transport_by_lane
from splitlab.telemetry.records import StageMetaRecord
from splitlab.telemetry.trace import Tracer


def test_loads_every_file_of_a_run_folder(tmp_path: Path) -> None:
    write_traces(ring_records(num_stages=3, num_requests=2, decode_tokens=3), tmp_path / "traces")
    frame = load_traces(tmp_path)
    assert set(frame["file"]) == {"stage-0.jsonl", "stage-1.jsonl", "stage-2.jsonl"}
    assert frame["ts_us"].is_monotonic_increasing
    assert len(select(frame, "token")) == 3 * 2 * 4
    assert len(select(frame, "stage_meta")) == 3


def test_reads_what_the_tracer_writes(tmp_path: Path) -> None:
    with Tracer.for_run(tmp_path, role="stage", rank=1) as tracer:
        tracer.write(StageMetaRecord(stage=1, host="10.0.0.2", peer_host="10.0.0.3"))
    meta = select(load_traces(tmp_path / "traces"), "stage_meta")
    assert meta.loc[0, ["role", "rank", "host"]].tolist() == ["stage", 1, "10.0.0.2"]


def test_truncated_final_line_is_dropped(tmp_path: Path) -> None:
    good = json.dumps({"ts_us": 1, "role": "stage", "rank": 0, "kind": "x"})
    (tmp_path / "stage-0.jsonl").write_text(good + "\n" + good[:20], encoding="utf-8")
    assert len(load_traces(tmp_path)) == 1


def test_garbage_line_names_file_and_line(tmp_path: Path) -> None:
    good = json.dumps({"ts_us": 1, "role": "stage", "rank": 0, "kind": "x"})
    (tmp_path / "stage-0.jsonl").write_text(f"{good}\n{{oops\n{good}\n", encoding="utf-8")
    with pytest.raises(TraceFormatError, match=r"stage-0\.jsonl:2: not JSON"):
        load_traces(tmp_path)


def test_complete_garbage_last_line_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "owner-0.jsonl").write_text("not json\n", encoding="utf-8")
    with pytest.raises(TraceFormatError, match=r"owner-0\.jsonl:1"):
        load_traces(tmp_path)


def test_record_without_base_fields_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "owner-0.jsonl").write_text('{"kind": "round"}\n', encoding="utf-8")
    with pytest.raises(TraceFormatError, match=r"owner-0\.jsonl:1: record lacks"):
        load_traces(tmp_path)


def test_missing_folder_is_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        load_traces(tmp_path)


def test_select_checks_the_contract(tmp_path: Path) -> None:
    record = {"ts_us": 1, "role": "stage", "rank": 0, "kind": "token", "stage": 0, "token": 0}
    write_traces([record], tmp_path)
    with pytest.raises(TraceFormatError, match="'token' records in \\['stage-0.jsonl'\\] lack"):
        select(load_traces(tmp_path), "token")


def test_transport_counters_in_both_shapes(tmp_path: Path) -> None:
    base = {"ts_us": 1, "role": "owner", "rank": 0, "kind": "transport"}
    write_traces([
        {**base, "lane": "activation", "frames": 3, "bytes": 300},
        {**base, "ts_us": 2, "activation.frames_sent": 4, "activation.bytes_sent": 400,
         "gradient.frames_recv": 1, "gradient.bytes_recv": 10, "d2h_ms": 0.5},
    ], tmp_path)  # fmt: skip
    lanes = transport_by_lane(load_traces(tmp_path))
    assert lanes[["lane", "direction", "frames", "bytes"]].values.tolist() == [
        ["activation", "total", 3, 300],
        ["activation", "sent", 4, 400],
        ["gradient", "recv", 1, 10],
    ]


def test_unknown_fields_and_kinds_from_a_newer_writer_are_read(tmp_path: Path) -> None:
    base = {"role": "stage", "rank": 0}
    write_traces([
        {**base, "ts_us": 1, "kind": "token", "stage": 0, "token": 0, "compute_ms": 1.0,
         "recv_wait_ms": 2.0, "send_ms": 0.1, "bytes": 128, "future_ms": [1, 2]},
        {**base, "ts_us": 2, "kind": "future_kind", "stage": "anything", "n": {"x": 1}},
    ], tmp_path)  # fmt: skip
    frame = load_traces(tmp_path)
    tokens = select(frame, "token")
    assert tokens.loc[0, "future_ms"] == [1, 2] and tokens.loc[0, "bytes"] == 128
    assert select(frame, "future_kind").loc[0, "stage"] == "anything"


def test_a_known_field_of_the_wrong_type_is_named(tmp_path: Path) -> None:
    record = {"ts_us": 1, "role": "stage", "rank": 0, "kind": "token", "stage": 0, "token": 0,
              "compute_ms": "fast", "recv_wait_ms": 2.0, "send_ms": 0.1, "bytes": 128}  # fmt: skip
    write_traces([record], tmp_path)
    named = r"stage-0\.jsonl:1: 'token' field 'compute_ms' is str"
    with pytest.raises(TraceFormatError, match=named):
        load_traces(tmp_path)


def test_a_base_field_of_the_wrong_type_is_named(tmp_path: Path) -> None:
    write_traces([{"ts_us": 1, "role": "stage", "rank": "0", "kind": "x"}], tmp_path)
    with pytest.raises(TraceFormatError, match=r"field 'rank' is str '0', expected int"):
        load_traces(tmp_path)


def test_select_types_declared_int_columns(tmp_path: Path) -> None:
    write_traces(ring_records(num_stages=2, num_requests=1, decode_tokens=2,
                              alpha_ms=[0.4], beta_ms_per_byte=[1e-5]), tmp_path)  # fmt: skip
    tokens = select(load_traces(tmp_path), "token")  # stage_meta rows leave token NaN in the frame
    assert tokens["token"].dtype == "int64" and tokens["prefill"].dtype == bool
