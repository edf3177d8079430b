"""Numbers for people: counts without ".0", bytes in binary units, times in ms/s, by the name.

.venv/bin/pytest tests/unit/test_analysis_formatting.py -q
"""

from __future__ import annotations

import math

import pandas as pd
import pytest

from splitlab.analysis.formatting import (
    bytes_scale,
    format_bytes,
    format_frame,
    format_ms,
    format_seconds,
    format_value,
    unit_of,
)


@pytest.mark.parametrize(("value", "text"), [
    (0, "0 B"), (512, "512 B"), (1023, "1,023 B"), (1024, "1.00 KiB"), (255820, "250 KiB"),
    (1535546, "1.46 MiB"), (545 * 2**20, "545 MiB"), (3 * 2**30 + 2**29, "3.50 GiB"),
])  # fmt: skip
def test_bytes_in_binary_units(value: int, text: str) -> None:
    assert format_bytes(value) == text


@pytest.mark.parametrize(("ms", "text"), [
    (0.4213, "0.42 ms"), (12.34, "12.3 ms"), (123.4, "123 ms"), (1234.0, "1.23 s"),
])  # fmt: skip
def test_milliseconds(ms: float, text: str) -> None:
    assert format_ms(ms) == text


@pytest.mark.parametrize(("s", "text"), [
    (12.96, "13.0 s"), (125.2, "2 min 05 s"), (3725.0, "1 h 02 min"),
])  # fmt: skip
def test_seconds(s: float, text: str) -> None:
    assert format_seconds(s) == text


@pytest.mark.parametrize(("name", "unit"), [
    ("bytes", "bytes"), ("kv_bytes", "bytes"), ("stage0_bytes_sent", "bytes"),
    ("transport_bytes_sent", "bytes"), ("tpot_ms_median", "ms"), ("tpot_ms_p90", "ms"),
    ("ttft_ms", "ms"), ("wall_s", "s"), ("tokens_per_s", None), ("beta_ms_per_byte", None),
    ("test_accuracy", "fraction"), ("owners_val_loss", "nats"), ("num_rounds", None),
])  # fmt: skip
def test_unit_follows_the_name(name: str, unit: str | None) -> None:
    assert unit_of(name) == unit


def test_values_by_name_integers_without_point_and_missing_as_na() -> None:
    assert format_value("samples", 512.0) == "512"
    assert format_value("num_microbatches", 12345) == "12,345"
    assert format_value("test_accuracy", 0.80125) == "0.8013"
    assert format_value("bytes", 2048.0) == "2.00 KiB"
    assert format_value("tpot_ms_median", 3.21) == "3.21 ms"
    assert format_value("loss", None) == format_value("loss", math.nan) == "n/a"
    assert format_value("owner", "owner0") == "owner0"


def test_frame_columns_widened_to_float_print_as_integers() -> None:
    frame = pd.DataFrame({"stage": [0.0, 1.0, None], "bytes_sent": [512.0, 4096.0, 2**21]})
    assert format_frame(frame).to_dict("list") == {
        "stage": ["0", "1", "n/a"], "bytes_sent": ["512 B", "4.00 KiB", "2.00 MiB"],
    }  # fmt: skip


def test_bytes_scale_picks_the_unit_of_the_largest_value() -> None:
    assert bytes_scale(24064) == (1024.0, "KiB")
    assert bytes_scale(100) == (1.0, "B")
