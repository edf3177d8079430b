"""Live backend: sensor parsers (pure), the cached background sampler and its read cost.

.venv/bin/pytest tests/unit/test_drift_live.py -q
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections import namedtuple
from collections.abc import Iterator

import pytest

from splitlab.drift.contract import OBS_KEYS
from splitlab.drift.live import LiveSource, observation_from
from splitlab.drift.sensors import (
    HostSensors,
    Reading,
    busy_and_total_s,
    cpu_temp_c,
    merge,
    parse_nvidia_smi,
    parse_tegrastats,
)
from splitlab.errors import ConfigError

Temp = namedtuple("Temp", "label current high critical")

# Lines in the documented formats (no Jetson here: these stand in for UNVERIFIED-JETSON).
TEGRA_ORIN = (
    "RAM 2448/7620MB (lfb 1x4MB) SWAP 0/3810MB (cached 0MB) CPU [2%@1190,10%@1190,off,off] "
    "EMC_FREQ 0% GR3D_FREQ 37% cpu@46.5C soc2@45.25C soc0@46.75C gpu@45.843C tj@47.062C "
    "soc1@46.593C VDD_IN 4126mW/4126mW"
)
TEGRA_NANO = (
    "RAM 1484/3964MB (lfb 137x4MB) SWAP 0/1982MB (cached 0MB) IRAM 0/252kB(lfb 252kB) "
    "CPU [3%@102,2%@102,1%@102,1%@102] EMC_FREQ 0%@1600 GR3D_FREQ 0%@76 APE 25 PLL@28C "
    "CPU@30.5C PMIC@100C GPU@29C AO@37.5C thermal@29.75C POM_5V_IN 1361/1361"
)


# --- parsers ---------------------------------------------------------------------------------


def test_nvidia_smi_line_becomes_a_reading() -> None:
    reading = parse_nvidia_smi("61, 87, 40960, 81920\n")
    assert reading == Reading(temp_c=61.0, util_pct=87.0, mem_pct=50.0)


def test_nvidia_smi_takes_the_worst_gpu_or_the_one_asked_for() -> None:
    text = "40, 10, 1000, 10000\n70, 5, 9000, 10000\n"
    assert parse_nvidia_smi(text) == Reading(temp_c=70.0, util_pct=10.0, mem_pct=90.0)
    assert parse_nvidia_smi(text, gpu_index=0) == Reading(40.0, 10.0, 10.0)
    assert parse_nvidia_smi(text, gpu_index=5) is None


def test_nvidia_smi_not_supported_fields_are_none() -> None:
    reading = parse_nvidia_smi("[N/A], [Not Supported], 100, 1000")
    assert reading == Reading(temp_c=None, util_pct=None, mem_pct=10.0)


def test_nvidia_smi_garbage_gives_no_reading() -> None:
    assert parse_nvidia_smi("NVIDIA-SMI has failed") is None


def test_tegrastats_orin_line() -> None:
    reading = parse_tegrastats(TEGRA_ORIN)
    assert reading.temp_c == pytest.approx(47.062)  # tj, the hottest die sensor
    assert reading.util_pct == 37.0  # GR3D beats the 6% mean of online cores
    assert reading.mem_pct == pytest.approx(100 * 2448 / 7620)


def test_tegrastats_nano_line_ignores_board_sensors() -> None:
    reading = parse_tegrastats(TEGRA_NANO)
    assert reading.temp_c == 30.5  # PMIC@100C and AO/thermal are not the die
    assert reading.util_pct == pytest.approx(1.75)


def test_cpu_temp_prefers_the_package_chip() -> None:
    temps = {"nvme": [Temp("", 70.0, 80, 90)], "coretemp": [Temp("p", 50.0, 80, 90)]}
    assert cpu_temp_c(temps) == 50.0
    assert cpu_temp_c({"acpitz": [Temp("", 41.0, None, None)]}) == 41.0
    assert cpu_temp_c({}) is None


def test_merge_takes_the_worst_present_field() -> None:
    merged = merge([Reading(50.0, 20.0, None), Reading(None, 80.0, 30.0)])
    assert merged == Reading(50.0, 80.0, 30.0)


def test_missing_sensors_read_as_nan_not_invented() -> None:
    obs = observation_from(Reading(None, 250.0, 40.0), link_factor=math.nan)
    assert math.isnan(obs.theta_obs) and math.isnan(obs.link_obs)
    assert obs.q_cmp_obs == 1.0 and obs.q_mem_obs == 0.4


# --- the source ------------------------------------------------------------------------------


class FakeHost:
    """A host reader that counts calls; the sampler thread calls it."""

    def __init__(self) -> None:
        self.calls = 0
        self.called = threading.Event()

    def __call__(self) -> Reading:
        self.calls += 1
        if self.calls > 1:
            self.called.set()
        return Reading(temp_c=40.0 + self.calls, util_pct=50.0, mem_pct=25.0)


@pytest.fixture
def fake_live() -> Iterator[tuple[LiveSource, FakeHost]]:
    host = FakeHost()
    source = LiveSource(stage=0, period_s=0.01, use_gpu_tools=False, read_host=host)
    yield source, host
    source.close()


def test_live_observation_has_exactly_the_four_keys(fake_live: tuple[LiveSource, FakeHost]) -> None:
    source, _ = fake_live
    assert tuple(source.observe(0)) == OBS_KEYS


def test_live_has_a_sample_before_the_thread_runs(fake_live: tuple[LiveSource, FakeHost]) -> None:
    source, host = fake_live
    assert host.calls >= 1 and source.observe(0)["q_mem_obs"] == 0.25


def test_live_background_thread_refreshes_the_cache(fake_live: tuple[LiveSource, FakeHost]) -> None:
    source, host = fake_live
    assert host.called.wait(timeout=5.0)
    deadline = time.monotonic() + 5.0
    while source.observe(1)["theta_obs"] <= 41.0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert source.observe(1)["theta_obs"] > 41.0


def test_live_never_injects_and_never_exhausts(fake_live: tuple[LiveSource, FakeHost]) -> None:
    source, _ = fake_live
    assert source.phi(10_000) == 1.0 and source.phi_link(10_000) == 1.0
    assert not source.exhausted


def test_live_link_is_what_the_ring_reports(fake_live: tuple[LiveSource, FakeHost]) -> None:
    source, _ = fake_live
    assert math.isnan(source.observe(0)["link_obs"])
    source.report_link(0.8)
    assert source.observe(0)["link_obs"] == 0.8


def test_live_close_stops_the_sampler(fake_live: tuple[LiveSource, FakeHost]) -> None:
    source, host = fake_live
    source.close()
    calls = host.calls
    time.sleep(0.05)
    assert host.calls == calls
    source.close()  # idempotent


def test_live_read_is_cheap_with_real_sensors() -> None:
    with LiveSource(stage=0, period_s=0.05) as source:
        costs_ms = []
        for t in range(2000):
            t0 = time.perf_counter()
            source.observe(t)
            costs_ms.append((time.perf_counter() - t0) * 1e3)
    # Budget is 2 ms; a cached read is microseconds, so the median has huge headroom.
    assert statistics.median(costs_ms) < 2.0


def test_live_refuses_a_non_positive_period() -> None:
    with pytest.raises(ConfigError, match="period_s"):
        LiveSource(stage=0, period_s=0.0)


def test_host_cpu_load_is_a_percentage_of_its_own_interval() -> None:
    host = HostSensors()
    first = host().util_pct  # since boot
    end = time.perf_counter() + 0.05
    while time.perf_counter() < end:  # keep one core busy
        pass
    second = host().util_pct
    assert first is not None and second is not None
    assert 0.0 <= first <= 100.0 and 0.0 < second <= 100.0


def test_busy_time_excludes_idle_and_iowait() -> None:
    Times = namedtuple("Times", "user nice system idle iowait guest guest_nice")
    assert busy_and_total_s(Times(3.0, 1.0, 1.0, 4.0, 1.0, 0.5, 0.0)) == (5.0, 10.0)
