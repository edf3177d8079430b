"""Link alpha/beta from ring traces: recovery on a synthetic LAN ring, refusal on loopback.

.venv/bin/pytest tests/unit/test_analysis_links.py -q
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from splitlab.analysis.links import (
    NOT_A_LINK,
    derive_link_params,
    format_path,
    node_host,
    shaped_paths,
)
from splitlab.analysis.synthetic import LOOPBACK_HOST, ring_records, write_traces
from splitlab.analysis.traces import TraceFormatError, load_traces
from splitlab.hosts import is_loopback

REPO = Path(__file__).resolve().parents[2]
ALPHA_MS, BETA_MS_PER_BYTE = (0.4, 0.6, 0.3), (8e-6, 2e-5, 1e-6)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_recovers_alpha_and_beta_within_five_percent(tmp_path: Path, seed: int) -> None:
    records = ring_records(num_stages=4, alpha_ms=ALPHA_MS, beta_ms_per_byte=BETA_MS_PER_BYTE,
                           seed=seed)  # fmt: skip
    write_traces(records, tmp_path / "traces")
    estimates = derive_link_params(load_traces(tmp_path))
    assert [(e.src_stage, e.dst_stage) for e in estimates] == [(0, 1), (1, 2), (2, 3)]
    for estimate, alpha, beta in zip(estimates, ALPHA_MS, BETA_MS_PER_BYTE, strict=True):
        assert not estimate.loopback and estimate.is_measurement
        assert estimate.alpha_ms == pytest.approx(alpha, rel=0.05)
        assert estimate.beta_ms_per_byte == pytest.approx(beta, rel=0.05)


def test_loopback_ring_is_flagged(tmp_path: Path) -> None:
    write_traces(ring_records(hosts=[LOOPBACK_HOST] * 3), tmp_path)
    estimates = derive_link_params(load_traces(tmp_path))
    assert estimates and all(e.loopback and not e.is_measurement for e in estimates)
    assert all("loopback" in (e.note or "") for e in estimates)


def test_two_stages_on_one_lan_host_are_flagged() -> None:
    records = ring_records(hosts=["10.0.0.7", "10.0.0.7", "10.0.0.9"])
    estimates = derive_link_params(pd.DataFrame(records))
    assert [e.loopback for e in estimates] == [True, False]
    assert "both stages on host 10.0.0.7" in (estimates[0].note or "")


def test_decode_only_trace_gives_no_beta() -> None:
    records = [r for r in ring_records(decode_tokens=10) if r.get("bytes", 0) in (0, 8, 4096)]
    estimates = derive_link_params(pd.DataFrame(records))
    assert estimates and all(e.alpha_ms is None for e in estimates)
    assert "distinct x" in (estimates[0].note or "")


def test_duplicate_token_ids_are_an_error() -> None:
    records = ring_records(num_requests=1, decode_tokens=2)
    with pytest.raises(TraceFormatError, match="two token records"):
        derive_link_params(pd.DataFrame(records + records))


@pytest.mark.parametrize(
    ("host", "expected"),
    [("127.0.0.1", True), ("127.3.4.5", True), ("::1", True), ("[::1]:5000", True),
     ("localhost", True), ("localhost:5700", True), ("10.0.0.2", False), ("0.0.0.0", False),
     ("jetson-1", False), (None, False)],
)  # fmt: skip
def test_is_loopback(host: str | None, expected: bool) -> None:
    assert is_loopback(host) is expected


def _run_tool(traces: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(REPO / "tools" / "derive_link_params.py"), str(traces)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def test_tool_prints_warning_instead_of_numbers_on_loopback(tmp_path: Path) -> None:
    write_traces(ring_records(hosts=[LOOPBACK_HOST] * 3), tmp_path / "traces")
    result = _run_tool(tmp_path / "traces")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 2 and all(NOT_A_LINK in line for line in lines)
    assert "alpha_ms=" not in result.stdout


def test_tool_prints_a_row_per_real_link(tmp_path: Path) -> None:
    write_traces(ring_records(), tmp_path / "traces")
    result = _run_tool(tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("alpha_ms=") == 2 and NOT_A_LINK not in result.stdout


TESTBED = {
    "links": {
        "edge1": {"nominal": {"up_mbit": 20.0, "down_mbit": 8.0, "delay_ms": 25.0}},
        "cloud": {"nominal": {"up_mbit": 0.0, "down_mbit": 0.0, "delay_ms": 0.0}},
    },
    "placement": {"owner": ["edge1"], "worker": ["cloud"], "coordinator": ["cloud"]},
}


def _wire(role: str, rank: int, ts: int, **fields: object) -> dict:
    return {"ts_us": ts, "role": role, "rank": rank, "kind": "transport", **fields}


def test_shaped_paths_measure_rate_and_delay_per_direction_from_the_last_counters() -> None:
    frame = pd.DataFrame([
        _wire("worker", 0, 1, **{"rx.owner0.stream_bytes": 1.0, "rx.owner0.stream_ms": 1.0}),
        _wire("worker", 0, 2, **{"rx.owner0.stream_bytes": 2_000_000, "rx.owner0.stream_ms": 1000.0,
                                 "rx.owner0.stream_frames": 3, "rx.owner0.stream_median_mbit": 19.5,
                                 "rx.owner0.stream_peak_mbit": 21.0},
              held_ms={"owner0": {"frames": 4, "mean_ms": 27.0, "min_ms": 25.2}}),
        _wire("owner", 0, 3, **{"rx.worker0.stream_bytes": 1_000_000, "rx.worker0.stream_ms": 1000.0,
                                "rx.worker0.stream_frames": 2, "rx.worker0.stream_median_mbit": 8.1},
              held_ms={"worker0": {"frames": 4, "mean_ms": 26.0, "min_ms": 24.9}}),
    ])  # fmt: skip
    paths = {(p.src, p.dst): p for p in shaped_paths(frame, TESTBED)}
    up, down = paths[("owner0", "worker0")], paths[("worker0", "owner0")]
    assert (up.src_host, up.dst_host, up.frames) == ("edge1", "cloud", 3)
    # rate: the median frame; mean: all timed bytes over all timed ms; peak: the fastest frame
    assert up.rate_mbit == 19.5 and up.nominal_mbit == 20.0  # edge1 up: 20
    assert up.mean_mbit == pytest.approx(16.0) and up.peak_mbit == 21.0
    assert (up.delay_ms, up.delay_mean_ms, up.nominal_delay_ms) == (24.9, 26.0, 25.0)
    assert down.rate_mbit == 8.1 and down.mean_mbit == pytest.approx(8.0)  # edge1 down: 8
    assert down.peak_mbit is None
    assert down.frames == 2 and down.delay_ms == 25.2 and down.nominal_mbit == 8.0
    assert "0.975x" in format_path(up) and "(mean 16.00)" in format_path(up)


def test_node_host_wraps_ranks_and_knows_nothing_of_unplaced_roles() -> None:
    assert node_host(TESTBED, "owner3") == "edge1"
    assert node_host(TESTBED, "worker0") == "cloud"
    assert node_host(TESTBED, "stage0") is None and node_host(TESTBED, "cloud") is None
