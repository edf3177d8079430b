"""A calibration timed inside a testbed host becomes that emulated device's calibration.

.venv/bin/pytest tests/unit/test_measure_on_testbed.py -q
"""

from __future__ import annotations

import copy

import pytest

from splitlab.analysis.fits import CalibrationResult
from splitlab.measure.calibrate import on_testbed

TESTBED = {
    "testbed": "edge_cloud_wan",
    "hosts": {"edge1": {"cpu": 0.5, "threads": 1}, "cloud": {"cpu": 0.0, "threads": 2}},
    "links": {
        "edge1": {"nominal": {"up_mbit": 20.0, "down_mbit": 10.0, "delay_ms": 25.0},
                  "probed": {"up_mbit": 19.0, "down_mbit": 9.5, "rtt_ms": 50.2,
                             "wire_rtt_ms": 0.05, "rtt_delay_source": "transport"},
                  "delay_source": "transport"},
        "cloud": {"nominal": {"up_mbit": 0.0, "down_mbit": 0.0, "delay_ms": 0.0},
                  "probed": {"rtt_ms": 0.01}, "delay_source": None},
    },
}  # fmt: skip
LOOPBACK = CalibrationResult(
    model="m", device="cpu", dtype="float32", calibrated=False,
    warnings=("c0/c1 were timed on this host (x), not on the target device",
              "link alpha/beta come from a loopback probe: NOT A LINK MEASUREMENT",
              "thermal is null: no sensors"),
    decode={"params": {"c0": 1.0, "c1": 0.001}, "r2": 0.99, "n": 5},
    link={"params": {"alpha_ms": 0.04}, "loopback": True},
)  # fmt: skip


def test_a_shaped_host_is_calibrated_with_its_probed_link() -> None:
    result = on_testbed(LOOPBACK, host="edge1", testbed=TESTBED)
    assert result.calibrated and result.decode == LOOPBACK.decode
    link = result.link or {}
    assert link["loopback"] is False and link["host"] == "edge1"
    assert link["alpha_ms"] == pytest.approx(25.1)  # RTT / 2, the delay line in the probe's path
    assert link["beta_up_ms_per_byte"] == pytest.approx(8e-3 / 19.0)
    assert link["beta_ms_per_byte"] == pytest.approx(8e-3 / 9.5)  # the slower direction
    assert link["bucket_bytes"] == 4096  # the shaper's floor: no burst_kib configured
    deep = copy.deepcopy(TESTBED)
    deep["links"]["edge1"]["nominal"]["burst_kib"] = 64.0
    assert (on_testbed(LOOPBACK, host="edge1", testbed=deep).link or {})["bucket_bytes"] == 65536
    assert not any("NOT A LINK" in w or "target device" in w for w in result.warnings)
    assert "thermal is null: no sensors" in result.warnings
    assert any("host edge1 (cpu 0.5, 1 threads)" in w for w in result.warnings)


def test_an_unshaped_host_has_no_link_and_stays_uncalibrated() -> None:
    result = on_testbed(LOOPBACK, host="cloud", testbed=TESTBED)
    assert not result.calibrated and result.link is None
    assert any("host cloud has no shaped link" in w for w in result.warnings)
