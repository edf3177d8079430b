"""Numbers for people: the one place reports, tables and axes format counts, bytes and times.

    .venv/bin/pytest tests/unit/test_analysis_formatting.py -q

Pure. A figure's name says its unit (`*_bytes`/`bytes_*`, `*_ms[_median|_p90]`, `*_s`, as
`splitlab.telemetry.records` spells fields), so `format_value(name, value)` picks the format:
integers without ".0" and with thousands separators, bytes in B/KiB/MiB/GiB, times in ms or
s/min, everything else to four significant digits; a missing value is "n/a". `bytes_scale`
gives the unit an axis of byte values is drawn in, `unit_of` the unit of a named metric.
"""

from __future__ import annotations

import math
import re
from numbers import Number

import pandas as pd

MISSING = "n/a"
_BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")
_MS = re.compile(r"(^|_)ms(_median|_mean|_p\d+)?$")
_SECONDS = re.compile(r"(?<!_per)_s$")  # wall_s, not tokens_per_s
_BYTES = re.compile(r"(^|_)bytes($|_sent$|_recv$)")


def is_missing(value: object) -> bool:
    """None, NaN or pandas' NA."""
    if value is None:
        return True
    try:
        return bool(pd.isna(value))
    except (TypeError, ValueError):  # lists and dicts are values, not missing
        return False


def _mantissa(x: float) -> str:
    """Three significant figures without exponent: 1.23, 12.3, 123, 1023."""
    return f"{x:.2f}" if abs(x) < 10 else f"{x:.1f}" if abs(x) < 100 else f"{x:.0f}"


def format_count(value: float) -> str:
    """An integral number with thousands separators: 512 -> "512", 12345.0 -> "12,345"."""
    return f"{int(round(value)):,}"


def format_number(value: float) -> str:
    """An integral value as a count, any other to four significant digits."""
    if float(value).is_integer():
        return format_count(value)
    return f"{value:.4g}"


def bytes_scale(num_bytes: float) -> tuple[float, str]:
    """(divisor, unit) that shows `num_bytes` as 1..1023 of a binary unit."""
    size = abs(float(num_bytes))
    power = 0
    while size >= 1024 and power < len(_BYTE_UNITS) - 1:
        size /= 1024
        power += 1
    return float(1024**power), _BYTE_UNITS[power]


def format_bytes(num_bytes: float) -> str:
    """512 -> "512 B", 255820 -> "250 KiB", 8283648 -> "7.90 MiB"."""
    divisor, unit = bytes_scale(num_bytes)
    if divisor == 1:
        return f"{format_count(num_bytes)} B"
    return f"{_mantissa(num_bytes / divisor)} {unit}"


def format_ms(ms: float) -> str:
    """A duration given in ms: "0.42 ms", "12.3 ms", "1.23 s" from one second up."""
    if abs(ms) >= 1000:
        return format_seconds(ms / 1000)
    return f"{_mantissa(ms)} ms"


def format_seconds(seconds: float) -> str:
    """A duration given in s: "0.42 s" .. "59.9 s", "2 min 05 s", "1 h 02 min"."""
    if abs(seconds) < 60:
        return f"{_mantissa(seconds)} s"
    whole = int(round(seconds))
    if whole < 3600:
        return f"{whole // 60} min {whole % 60:02d} s"
    return f"{whole // 3600} h {whole % 3600 // 60:02d} min"


def unit_of(name: str) -> str | None:
    """The unit a metric's name says it is in: "bytes", "ms", "s", "fraction" (an accuracy),
    "nats" (a cross-entropy loss), or None."""
    if _BYTES.search(name):
        return "bytes"
    if _MS.search(name):
        return "ms"
    if _SECONDS.search(name):
        return "s"
    if name.endswith("accuracy"):
        return "fraction"
    if name.endswith("loss"):
        return "nats"
    return None


def format_value(name: str, value: object) -> str:
    """`value` of the figure or column `name`, formatted by the unit its name says."""
    if is_missing(value):
        return MISSING
    if isinstance(value, bool) or not isinstance(value, Number):
        return str(value)
    number = float(value)  # type: ignore[arg-type]
    if not math.isfinite(number):
        return str(number)
    unit = unit_of(name)
    if unit == "bytes":
        return format_bytes(number)
    if unit == "ms":
        return format_ms(number)
    if unit == "s":
        return format_seconds(number)
    return format_number(number)


def format_frame(frame: pd.DataFrame) -> pd.DataFrame:
    """`frame` as strings, every cell through `format_value` with its column's name (a column of
    ids that pandas widened to float, 512.0, prints as 512)."""
    return pd.DataFrame(
        {column: [format_value(str(column), v) for v in frame[column]] for column in frame.columns},
        index=frame.index,
    )
