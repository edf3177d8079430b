"""The JSONL drift trace: one header line, then one ground-truth record per (token, stage).

    python tools/make_drift_trace.py --profile thermal_ramp --stages 3 --tokens 400 --seed 77 --out /tmp/d.jsonl
    .venv/bin/pytest tests/unit/test_drift_replay.py -q

Line 1 (header):
    {"kind": "drift_header", "version": 1, "profile": "thermal_ramp", "num_stages": 3,
     "length_tokens": 400, "seed": 77, "params": {"slow_stage": 1, "phi": 1.5, "period_tokens": 60}}
Lines 2.. (records, ordered by token then stage; fields as in `profiles.DriftRecord`):
    {"kind": "drift", "token": 0, "stage": 0, "theta_c": 44.1, "phi": 1.0, "q_cmp": 0.52,
     "q_mem": 0.41, "link_factor": 1.0, "phi_link": 1.0}

Every stage must have records for tokens 0..N-1 with the same N, so a replay can index by
token. Unknown keys are ignored (a newer writer may add some); missing or out-of-range fields
are errors naming the file, the line and the field.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from splitlab.drift.profiles import RECORD_FIELDS, DriftRecord, ProfileParams
from splitlab.errors import ConfigError

TRACE_VERSION = 1
HEADER_KIND = "drift_header"
RECORD_KIND = "drift"


class TraceFormatError(ConfigError):
    """A drift trace file is malformed; the message names file, line and field."""


@dataclass(frozen=True)
class TraceHeader:
    profile: str
    num_stages: int
    length_tokens: int
    seed: int
    version: int = TRACE_VERSION
    params: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": HEADER_KIND,
            "version": self.version,
            "profile": self.profile,
            "num_stages": self.num_stages,
            "length_tokens": self.length_tokens,
            "seed": self.seed,
            "params": dict(self.params),
        }

    @classmethod
    def for_profile(cls, profile: str, params: ProfileParams) -> TraceHeader:
        return cls(
            profile=profile,
            num_stages=params.num_stages,
            length_tokens=params.length_tokens,
            seed=params.seed,
            params={
                "slow_stage": params.slow_stage,
                "phi": params.phi,
                "period_tokens": params.period_tokens,
            },
        )


@dataclass(frozen=True)
class DriftTrace:
    """A parsed trace: `by_stage[s][t]` is the record of stage s at token t."""

    header: TraceHeader
    by_stage: tuple[tuple[DriftRecord, ...], ...]

    @property
    def num_tokens(self) -> int:
        return len(self.by_stage[0]) if self.by_stage else 0


def write_trace(path: str | Path, header: TraceHeader, records: Sequence[DriftRecord]) -> Path:
    """Write atomically (temp file + rename), so stages generating the same trace never race."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(json.dumps(header.to_dict(), separators=(",", ":")) + "\n")
            for rec in records:
                line = {"kind": RECORD_KIND, **rec.to_dict()}
                f.write(json.dumps(line, separators=(",", ":")) + "\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _fail(path: Path, lineno: int, what: str) -> TraceFormatError:
    return TraceFormatError(f"drift trace {path}:{lineno}: {what}")


def _int_field(obj: dict[str, Any], key: str, path: Path, lineno: int, minimum: int) -> int:
    if key not in obj:
        raise _fail(path, lineno, f"missing field {key!r}")
    value = obj[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _fail(path, lineno, f"field {key!r} must be an integer >= {minimum}, got {value!r}")
    return value


# field -> (lowest, highest, lowest is inclusive)
_RANGES: dict[str, tuple[float, float, bool]] = {
    "theta_c": (-273.15, 1000.0, True),
    "phi": (1.0, math.inf, True),
    "q_cmp": (0.0, 1.0, True),
    "q_mem": (0.0, 1.0, True),
    "link_factor": (0.0, 1.0, False),
    "phi_link": (1.0, math.inf, True),
}
assert set(_RANGES) | {"token", "stage"} == set(RECORD_FIELDS), "trace fields out of step"


def _float_field(obj: dict[str, Any], key: str, path: Path, lineno: int) -> float:
    if key not in obj:
        raise _fail(path, lineno, f"missing field {key!r}")
    value = obj[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _fail(path, lineno, f"field {key!r} must be a number, got {value!r}")
    value = float(value)
    lo, hi, lo_inclusive = _RANGES[key]
    above_lo = value >= lo if lo_inclusive else value > lo
    if not (math.isfinite(value) and above_lo and value <= hi):
        bracket = "[" if lo_inclusive else "("
        raise _fail(path, lineno, f"field {key!r} must be in {bracket}{lo}, {hi}], got {value!r}")
    return value


def _parse_header(obj: Any, path: Path) -> TraceHeader:
    if not isinstance(obj, dict) or obj.get("kind") != HEADER_KIND:
        raise _fail(path, 1, f"first line must be a header with kind {HEADER_KIND!r}")
    version = _int_field(obj, "version", path, 1, 1)
    if version != TRACE_VERSION:
        raise _fail(path, 1, f"field 'version' is {version}; this reader knows {TRACE_VERSION}")
    profile = obj.get("profile")
    if not isinstance(profile, str):
        raise _fail(path, 1, f"field 'profile' must be a string, got {profile!r}")
    params = obj.get("params", {})
    if not isinstance(params, dict):
        raise _fail(path, 1, f"field 'params' must be an object, got {params!r}")
    return TraceHeader(
        profile=profile,
        num_stages=_int_field(obj, "num_stages", path, 1, 1),
        length_tokens=_int_field(obj, "length_tokens", path, 1, 1),
        seed=_int_field(obj, "seed", path, 1, 0),
        version=version,
        params=params,
    )


def read_trace(path: str | Path) -> DriftTrace:
    """Parse and validate a trace file.

    Raises:
        TraceFormatError: the file is missing, empty or malformed (file, line and field named).
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise TraceFormatError(f"drift trace {path}: cannot read ({exc})") from exc
    lines = text.splitlines()
    if not lines:
        raise _fail(path, 1, "empty file, expected a header line")
    try:
        header = _parse_header(json.loads(lines[0]), path)
    except json.JSONDecodeError as exc:
        raise _fail(path, 1, f"not JSON ({exc.msg})") from exc
    columns: list[list[DriftRecord]] = [[] for _ in range(header.num_stages)]
    for lineno, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise _fail(path, lineno, f"not JSON ({exc.msg})") from exc
        if not isinstance(obj, dict):
            raise _fail(path, lineno, "a record must be a JSON object")
        if obj.get("kind", RECORD_KIND) != RECORD_KIND:
            continue  # tolerate other kinds a newer writer may interleave
        stage = _int_field(obj, "stage", path, lineno, 0)
        if stage >= header.num_stages:
            raise _fail(
                path, lineno, f"field 'stage' is {stage}; header says {header.num_stages} stages"
            )
        token = _int_field(obj, "token", path, lineno, 0)
        if token != len(columns[stage]):
            raise _fail(
                path,
                lineno,
                f"field 'token' is {token}; stage {stage} expected {len(columns[stage])} next",
            )
        values = {k: _float_field(obj, k, path, lineno) for k in _RANGES}
        columns[stage].append(DriftRecord(token=token, stage=stage, **values))
    counts = {s: len(c) for s, c in enumerate(columns)}
    if len(set(counts.values())) != 1 or counts[0] == 0:
        raise _fail(path, len(lines), f"every stage needs the same, non-zero token count: {counts}")
    return DriftTrace(header=header, by_stage=tuple(tuple(c) for c in columns))
