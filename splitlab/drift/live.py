"""Live backend: observations from this host's sensors, sampled on a background thread.

A synchronous nvidia-smi costs tens of milliseconds, which would make the drift source the
overhead it exists to measure; so a daemon thread samples psutil (and nvidia-smi or tegrastats
where the binary exists) every `period_s` and `observe` only reads the cached sample (a few
microseconds; the budget is 2 ms). Live drift is observed, never injected: `phi` is 1.

    .venv/bin/pytest tests/unit/test_drift_live.py -q
    .venv/bin/python tools/check_drift_source.py   # prints the measured read cost

Missing sensors read as NaN rather than an invented value: theta_obs on a host with no
temperature sensor, and link_obs until the ring calls `report_link` with what it measured.

On a testbed host the kernel is sampled too (`host_kernel.KernelSensors`: the link's token
bucket and the host's CPU cgroup), and `kernel` holds the latest figures: link rate, bytes,
drops, overlimits, CPU quota and throttling. Then q_cmp_obs is the share of CFS periods the
host was throttled in (1 = compute-bound at its budget), and link_obs, until the ring
reports its own measure, the shaper's rate over the rate it had at start.
"""

from __future__ import annotations

import logging
import math
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from splitlab.drift import sensors
from splitlab.drift.contract import DriftSource, Observation
from splitlab.drift.host_kernel import kernel_sensors, throttled_fraction
from splitlab.drift.sensors import Reading
from splitlab.errors import ConfigError

log = logging.getLogger(__name__)


def _frac(pct: float | None) -> float:
    return math.nan if pct is None else min(1.0, max(0.0, pct / 100.0))


def observation_from(reading: Reading, link_factor: float) -> Observation:
    """Map a merged sensor reading onto the four-key contract."""
    return Observation(
        theta_obs=math.nan if reading.temp_c is None else float(reading.temp_c),
        q_cmp_obs=_frac(reading.util_pct),
        q_mem_obs=_frac(reading.mem_pct),
        link_obs=link_factor,
    )


class LiveSource(DriftSource):
    """One stage's live sensors; `observe` returns the latest cached sample."""

    def __init__(
        self,
        *,
        stage: int,
        period_s: float = 0.5,
        gpu_index: int | None = None,
        use_gpu_tools: bool = True,
        read_host: Callable[[], Reading] | None = None,
        read_kernel: Callable[[], dict[str, Any]] | None = None,
        use_kernel: bool = True,
    ) -> None:
        if not (math.isfinite(period_s) and period_s > 0):
            raise ConfigError(f"drift live period_s must be > 0, got {period_s}")
        self.stage = stage
        self.period_s = period_s
        self._gpu_index = gpu_index
        self._read_host = sensors.HostSensors() if read_host is None else read_host
        self._nvidia_smi = shutil.which("nvidia-smi") if use_gpu_tools else None
        tegrastats = shutil.which("tegrastats") if use_gpu_tools else None
        self._link_factor = math.nan
        self._read_kernel = read_kernel or (kernel_sensors() if use_kernel else None)
        self.kernel: dict[str, Any] = {}  # the latest kernel figures (testbed hosts only)
        self._throttled: float | None = None
        self._link_base_mbit: float | None = None
        self._gpu: Reading | None = None  # latest nvidia-smi / tegrastats reading
        self._stop = threading.Event()
        self._tegra: sensors.TegrastatsReader | None = None
        self._threads: list[threading.Thread] = []
        self.num_samples = 0

        self._sample()  # synchronous once, so observe never sees an empty cache
        self._threads.append(
            threading.Thread(target=self._poll, name=f"drift-live-{stage}", daemon=True)
        )
        if tegrastats is not None and self._nvidia_smi is None:
            self._tegra = sensors.TegrastatsReader(tegrastats, max(1, int(period_s * 1000)))
            self._threads.append(
                threading.Thread(
                    target=self._follow_tegra, name=f"drift-tegra-{stage}", daemon=True
                )
            )
        for thread in self._threads:
            thread.start()
        log.info(
            "live drift source: stage %d, every %.3f s, gpu tool %s",
            stage,
            period_s,
            self._nvidia_smi or tegrastats or "none",
        )

    @property
    def gpu_tool(self) -> str | None:
        """Path of nvidia-smi or tegrastats in use, or None on a CPU-only host."""
        if self._nvidia_smi is not None:
            return self._nvidia_smi
        return None if self._tegra is None else "tegrastats"

    def _sample(self) -> None:
        host = self._read_host()
        if self._nvidia_smi is not None:
            self._gpu = sensors.read_nvidia_smi(self._nvidia_smi, self._gpu_index)
        if self._read_kernel is not None:
            kernel = self._read_kernel()
            if self.kernel:
                self._throttled = throttled_fraction(self.kernel, kernel)
            if self._link_base_mbit is None:
                self._link_base_mbit = kernel.get("link_rate_mbit")
            self.kernel = kernel
        readings = [host] if self._gpu is None else [host, self._gpu]
        # One reference assignment: readers see the old sample or the new one, never a mix.
        self._reading = sensors.merge(readings)
        self._sampled_at = time.monotonic()
        self.num_samples += 1

    def _poll(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self._sample()
            except Exception:  # a flaky sensor must not kill the sampler; keep the last sample
                log.exception("live drift sample failed; keeping the previous one")

    def _follow_tegra(self) -> None:
        assert self._tegra is not None
        while not self._stop.is_set():
            reading = self._tegra.read_line()
            if reading is None:
                return
            self._gpu = reading

    @property
    def sample_age_s(self) -> float:
        """Seconds since the cached sample was taken (for telemetry)."""
        return time.monotonic() - self._sampled_at

    def report_link(self, link_factor: float) -> None:
        """Record the ring's own measure of the outgoing link, (0, 1] with 1 = nominal."""
        self._link_factor = float(link_factor)

    def _kernel_link_factor(self) -> float:
        rate, base = self.kernel.get("link_rate_mbit"), self._link_base_mbit
        return rate / base if rate and base else math.nan

    def observe(self, token: int) -> dict[str, float]:
        link = (
            self._link_factor if not math.isnan(self._link_factor) else self._kernel_link_factor()
        )
        obs = observation_from(self._reading, link)
        if self._throttled is not None:
            obs = replace(obs, q_cmp_obs=self._throttled)
        return obs.to_dict()

    def phi(self, token: int) -> float:
        return 1.0

    @property
    def exhausted(self) -> bool:
        return False

    def close(self) -> None:
        self._stop.set()
        if self._tegra is not None:
            self._tegra.close()  # ends the blocking readline in _follow_tegra
        for thread in self._threads:
            thread.join(timeout=max(2.0, 2 * self.period_s))
        self._threads = []
