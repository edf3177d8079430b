"""Trace loading: every `RUN/traces/<role>-<rank>.jsonl` into one pandas frame, plus the contract.

    .venv/bin/pytest tests/unit/test_analysis_traces.py -q

The record contract
-------------------
Every record carries `ts_us` (int, wall clock), `role` (str), `rank` (int) and `kind` (str),
written by `splitlab.telemetry.trace.Tracer`. The analysis reads these kinds and fields (the
fields in `REQUIRED_FIELDS` must be present; the others may be missing or null):

Ring inference (role "stage", rank = stage index, stage 0 is the head):
- `token`: one per stage per token. `stage` (int), `token` (int, increasing per stage; with a
  `session` field, unique per session), `compute_ms` (this stage's blocks for this token),
  `recv_wait_ms` (time blocked receiving this token's input), `send_ms`, `bytes` (payload
  bytes this stage sent for this token: hidden states, or the token id from the tail),
  `tpot_ms` (head only, time per output token), optionally `prefill` (bool).
- `stage_meta`: once per stage. `stage`, `host` (its bind address), `peer_host` (the address it
  sends to, i.e. the next stage), `blocks` ([first, last) span or list), load timings such as
  `weights_ms`, `resident_bytes`.
- `window` and `migration` records may come from every stage; the head's (rank 0) are the
  decisions, the others are each stage's own view of the same barrier.

The ring runtime (`splitlab.infer`) writes some of these under its own names; `select`
normalises them (`normalize_ring`): a `token` record without `stage` takes its `rank` (role
"stage"), a `stage_meta` record's `bind` becomes `host` and `peers[(stage + 1) % S]` becomes
`peer_host`.
- `window`: one per control barrier. `epoch`, `barrier_ms`, `prestage_ms`, `commit_ms`,
  `release_ms`, `n_acks`, `aborted` (bool), `decision`, `obs` (dict); optionally `token` (first
  token decoded under the new epoch; plots fall back to `ts_us` against the head's tokens).
- `migration`: one per committed move. `epoch`, `boundary`, `k` (blocks moved), `weights_ms`,
  `kv_ms`, `commit_ms`, `kv_bytes`; optionally `token` as for `window`.

U-shape training:
- `microbatch`: `window`, `microbatch`, `owner`, `worker`, `fwd_ms`, `bwd_ms`, `bytes`, `lane`.
- `round`: one per owner per round. `round`, `owner`, `loss`, `accuracy`, `perplexity`,
  `samples`, `bytes`.
- `wrr`: one per (window, owner, worker). `window`, `owner`, `worker`, `count`.

Transport counters:
- `transport`: either `lane`, `frames`, `bytes`, or the flat snapshot that
  `splitlab.wire.counters.WireCounters.emit` writes (`<lane>.frames_sent`, `<lane>.bytes_sent`,
  `<lane>.frames_recv`, `<lane>.bytes_recv`, ...); `transport_by_lane` reads both.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import pandas as pd

from splitlab.errors import SplitlabError

log = logging.getLogger(__name__)

BASE_FIELDS: tuple[str, ...] = ("ts_us", "role", "rank", "kind")

REQUIRED_FIELDS: dict[str, tuple[str, ...]] = {
    "token": ("stage", "token", "compute_ms", "recv_wait_ms", "bytes"),
    "stage_meta": ("stage", "host"),
    "window": ("epoch", "barrier_ms", "aborted"),
    "migration": ("epoch", "boundary", "k"),
    "microbatch": ("window", "microbatch", "bytes", "lane"),
    "round": ("round", "owner", "loss", "accuracy"),
    "wrr": ("window", "owner", "worker", "count"),
    "transport": (),
}

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
            object with the base fields.
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

    Raises:
        TraceFormatError: records of this kind lack a field in `REQUIRED_FIELDS[kind]`.
    """
    if "kind" not in frame.columns:
        return pd.DataFrame(columns=list(BASE_FIELDS))
    rows = frame[frame["kind"] == kind].dropna(axis=1, how="all").reset_index(drop=True)
    if rows.empty:
        return rows
    rows = normalize_ring(rows, kind)
    for field in REQUIRED_FIELDS.get(kind, ()):
        if field not in rows.columns or rows[field].isna().any():
            files = sorted(set(rows.get("file", pd.Series(["?"]))))
            raise TraceFormatError(f"{kind!r} records in {files} lack field {field!r}")
    return rows


def _peer_of(peers: Any, stage: Any) -> str | None:
    if not isinstance(peers, (list, tuple)) or not peers or pd.isna(stage):
        return None
    return str(peers[(int(stage) + 1) % len(peers)])


def normalize_ring(rows: pd.DataFrame, kind: str) -> pd.DataFrame:
    """Fill the contract's ring fields from the ring runtime's spellings (see module docstring).

    Values already present win; `rows` holds records of one `kind`.
    """
    rows = rows.copy()
    if kind == "token" and "role" in rows.columns:
        from_rank = rows["rank"].where(rows["role"] == "stage")
        rows["stage"] = rows["stage"].fillna(from_rank) if "stage" in rows.columns else from_rank
    if kind == "stage_meta":
        if "bind" in rows.columns:
            rows["host"] = (
                rows["host"].fillna(rows["bind"]) if "host" in rows.columns else rows["bind"]
            )
        if "peers" in rows.columns and "stage" in rows.columns:
            peer = pd.Series([_peer_of(p, s) for p, s in zip(rows["peers"], rows["stage"],
                                                              strict=True)], index=rows.index)  # fmt: skip
            rows["peer_host"] = (
                rows["peer_host"].fillna(peer) if "peer_host" in rows.columns else peer
            )
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
