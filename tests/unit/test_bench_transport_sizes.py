"""`tools/bench_transport.py --sizes-kib`: the sizes a run measures, and those a shaped link
leaves out (pure functions of the tool; the runs are in tests/integration/test_wire_bench.py).

    .venv/bin/pytest tests/unit/test_bench_transport_sizes.py -q
"""

from __future__ import annotations

import argparse

import pytest
from tool_helpers import load_tool

bt = load_tool("bench_transport")
KIB, MIB = 1 << 10, 1 << 20


def test_sizes_in_kib_are_sorted_bytes_and_bad_ones_are_named() -> None:
    assert bt.size_list("1024,4,4") == [4 * KIB, MIB]
    for bad in ("0", "4,x", "-4", "", "1.5"):
        with pytest.raises(argparse.ArgumentTypeError, match="whole number of KiB"):
            bt.size_list(bad)


def test_a_shaped_link_leaves_out_only_large_sizes_that_take_too_long() -> None:
    asked = [4 * KIB, MIB, 16 * MIB]
    assert bt._sizes(True, bt._Link(), asked) == asked  # loopback: every size
    wifi = bt._Link(bytes_per_s=50e6 / 8, delay_s=0.002)  # 50 Mbit/s
    assert bt._sizes(True, wifi, asked) == [4 * KIB, MIB]
    assert bt._sizes(True, wifi) == [4 * KIB, 64 * KIB, MIB, 4 * MIB]  # the default sizes


def test_short_loopback_streams_are_lengthened_within_a_bound() -> None:
    slow = bt.MIN_STREAM_S[False]
    assert bt.scaled_frames(256, slow, quick=False) == 256  # long enough already
    assert bt.scaled_frames(256, slow / 4, quick=False) == 1024
    assert bt.scaled_frames(256, 1e-9, quick=False) == 256 * bt.MAX_STREAM_SCALE
    assert bt.scaled_frames(256, bt.MIN_STREAM_S[True] / 2, quick=True) == 512
