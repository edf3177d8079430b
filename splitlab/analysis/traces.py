"""Trace loading: every `RUN/traces/<role>-<rank>.jsonl` into one pandas frame, plus the contract.

    .venv/bin/pytest tests/unit/test_analysis_traces.py -q

The record contract
-------------------
Every line is a record of `splitlab.telemetry.records`, the classes every writer builds: base
fields `ts_us` (int, wall clock), `role` (str), `rank` (int), `kind` (str), then the kind's
fields. Reading checks each known field of a known kind by name and type (a wrong type is a
`TraceFormatError` naming file, line, kind and field); unknown fields and kinds, from a newer
writer, load as they are. `select` checks the kind's required fields (declared without a
default and not nullable) have values.

The analysis reads: ring `token`, `stage_meta`, `window` and `migration` (`window` and
`migration` records come from every stage; the head's, rank 0, are the decisions, and donor and
receiver each write a `migration`); training `microbatch`, `round` and `wrr`; and `transport`,
the wire counters' flat snapshot (`<lane>.frames_sent`, `<lane>.bytes_sent`, ...), which
`transport_by_lane` reads together with the older `lane`/`frames`/`bytes` shape.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import pandas as pd

from splitlab.errors import SplitlabError
from splitlab.telemetry.records import BASE_FIELDS, check_record, field_types, required_fields

log = logging.getLogger(__name__)

# The kinds the analysis reads, in the order a report lists them.
ANALYSED_KINDS: tuple[str, ...] = (
    "token", "stage_meta", "window", "migration", "microbatch", "round", "wrr", "transport",
)  # fmt: skip

_FLAT_COUNTER = re.compile(r"^(?P<lane>[a-z_]+)\.(?P<what>frames|bytes)_(?P<dir>sent|recv)$")


class TraceFormatError(SplitlabError, ValueError):
    """A trace file holds something that is not a record; the message names file and line."""


def traces_dir(path: str | Path) -> Path:
    """`path` itself when it holds `*.jsonl` files, else `path/traces`."""
    path = Path(path)
    if path.is_dir() and any(path.glob("*.jsonl")):
        return path
    if (path / "traces").is_dir():
        return path / "traces"
    raise FileNotFoundError(f"no *.jsonl traces in {path} nor in {path / 'traces'}")


def read_trace_file(path: Path) -> list[dict[str, Any]]:
    """Records of one JSONL file; a truncated final line (a crash mid-write) is dropped.

    Raises:
        TraceFormatError: a line before the last, or a complete last line, is not a JSON
            object with the base fields, or a field the record's kind declares has the wrong
            type.
    """
    text = path.read_text(encoding="utf-8")
    lines = text.split("\n")
    truncated_tail = not text.endswith("\n")  # the last element is a partial line, if any
    records: list[dict[str, Any]] = []
    for index, line in enumerate(lines):
        if not line.strip():
            continue
        is_last = index == len(lines) - 1
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            if is_last and truncated_tail:
                log.warning("%s:%d: dropping truncated final line", path, index + 1)
                continue
            raise TraceFormatError(
                f"{path}:{index + 1}: not JSON ({exc.msg}): {line[:80]!r}"
            ) from exc
        if not isinstance(record, dict):
            raise TraceFormatError(f"{path}:{index + 1}: not a JSON object: {line[:80]!r}")
        missing = [key for key in BASE_FIELDS if key not in record]
        if missing:
            raise TraceFormatError(f"{path}:{index + 1}: record lacks {missing}: {line[:80]!r}")
        problems = check_record(record)
        if problems:
            raise TraceFormatError(f"{path}:{index + 1}: " + "; ".join(problems))
        records.append(record)
    return records


def load_traces(path: str | Path) -> pd.DataFrame:
    """All records of a run (or a traces folder) in one frame, sorted by `ts_us`.

    Columns are the union of every record's fields plus `file` (the trace file's name).
    Fields a record does not carry are NaN/None.
    """
    folder = traces_dir(path)
    rows: list[dict[str, Any]] = []
    for file in sorted(folder.glob("*.jsonl")):
        for record in read_trace_file(file):
            record["file"] = file.name
            rows.append(record)
    if not rows:
        return pd.DataFrame(columns=[*BASE_FIELDS, "file"])
    frame = pd.DataFrame.from_records(rows)
    return frame.sort_values("ts_us", kind="stable").reset_index(drop=True)


def select(frame: pd.DataFrame, kind: str) -> pd.DataFrame:
    """Records of one kind, with only the columns they use, after checking the contract.

    Columns the kind declares as int or bool get that dtype where every row has a value (in the
    frame of every kind they are float or object: other kinds leave them NaN).

    Raises:
        TraceFormatError: records of this kind lack a value for a required field of its
            record class (`splitlab.telemetry.records.required_fields`).
    """
    if "kind" not in frame.columns:
        return pd.DataFrame(columns=list(BASE_FIELDS))
    rows = frame[frame["kind"] == kind].dropna(axis=1, how="all").reset_index(drop=True)
    if rows.empty:
        return rows
    for field in required_fields(kind):
        if field not in rows.columns or rows[field].isna().any():
            files = sorted(set(rows.get("file", pd.Series(["?"]))))
            raise TraceFormatError(f"{kind!r} records in {files} lack field {field!r}")
    dtypes = {int: "int64", bool: "bool"}
    for name, declared in field_types(kind).items():
        dtype = dtypes.get(declared.kinds[0]) if len(declared.kinds) == 1 else None
        if dtype is not None and name in rows.columns and rows[name].notna().all():
            rows[name] = rows[name].astype(dtype)
    return rows


def transport_by_lane(frame: pd.DataFrame) -> pd.DataFrame:
    """Transport counters as rows of (role, rank, ts_us, lane, direction, frames, bytes).

    Reads both the `lane`/`frames`/`bytes` shape (direction "total") and the flat
    `<lane>.<frames|bytes>_<sent|recv>` snapshot; counters are cumulative, as emitted.
    """
    rows = select(frame, "transport")
    out: list[dict[str, Any]] = []
    for record in rows.to_dict("records"):
        key = {name: record.get(name) for name in ("role", "rank", "ts_us")}
        if record.get("lane") is not None and not pd.isna(record.get("lane")):
            out.append({**key, "lane": record["lane"], "direction": "total",
                        "frames": record.get("frames"), "bytes": record.get("bytes")})  # fmt: skip
            continue
        flat: dict[tuple[str, str], dict[str, Any]] = {}
        for column, value in record.items():
            match = _FLAT_COUNTER.match(str(column))
            if match is None or value is None or pd.isna(value):
                continue
            entry = flat.setdefault((match["lane"], match["dir"]), {})
            entry[match["what"]] = value
        for (lane, direction), values in sorted(flat.items()):
            out.append({**key, "lane": lane, "direction": direction, **values})
    columns = ["role", "rank", "ts_us", "lane", "direction", "frames", "bytes"]
    return pd.DataFrame(out, columns=columns)
