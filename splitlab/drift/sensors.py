"""Host sensors for the live backend: pure parsers plus thin readers (psutil, nvidia-smi,
tegrastats). Every reader returns a `Reading` whose missing fields are None; nothing here
caches or threads - `live.LiveSource` does that.

    .venv/bin/pytest tests/unit/test_drift_live.py -q

The tegrastats parser follows the documented line format of Jetson Linux and is checked
against sample lines only: it has never run on a Jetson here (grep UNVERIFIED-JETSON).
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import psutil

# Chips whose readings are the CPU package, preferred over board / NVMe / wifi sensors.
CPU_TEMP_CHIPS = ("coretemp", "k10temp", "zenpower", "cpu_thermal", "cpu-thermal", "soc_thermal")
NVIDIA_SMI_QUERY = "temperature.gpu,utilization.gpu,memory.used,memory.total"
NVIDIA_SMI_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Reading:
    """One sample from one sensor family; None = this family does not report it."""

    temp_c: float | None = None
    util_pct: float | None = None
    mem_pct: float | None = None


def _max_present(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return max(present) if present else None


def merge(readings: Sequence[Reading]) -> Reading:
    """The worst of each field across families (the hottest, busiest, fullest device)."""
    return Reading(
        temp_c=_max_present(r.temp_c for r in readings),
        util_pct=_max_present(r.util_pct for r in readings),
        mem_pct=_max_present(r.mem_pct for r in readings),
    )


# --- nvidia-smi -------------------------------------------------------------------------------


def _number(text: str) -> float | None:
    try:
        return float(text.strip())
    except ValueError:  # "[N/A]", "[Not Supported]"
        return None


def parse_nvidia_smi(text: str, gpu_index: int | None = None) -> Reading | None:
    """Parse `nvidia-smi --query-gpu=<NVIDIA_SMI_QUERY> --format=csv,noheader,nounits`.

    One line per GPU; `gpu_index` picks one, None takes the worst across all of them.
    """
    per_gpu = []
    for line in text.strip().splitlines():
        parts = line.split(",")
        if len(parts) != 4:
            continue
        temp, util, used, total = (_number(p) for p in parts)
        mem = 100.0 * used / total if used is not None and total else None
        per_gpu.append(Reading(temp_c=temp, util_pct=util, mem_pct=mem))
    if not per_gpu:
        return None
    if gpu_index is not None:
        return per_gpu[gpu_index] if 0 <= gpu_index < len(per_gpu) else None
    return merge(per_gpu)


def read_nvidia_smi(binary: str, gpu_index: int | None = None) -> Reading | None:
    """One synchronous nvidia-smi call (tens of ms: call it from the sampler thread only)."""
    try:
        out = subprocess.run(
            [binary, f"--query-gpu={NVIDIA_SMI_QUERY}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=NVIDIA_SMI_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return parse_nvidia_smi(out.stdout, gpu_index) if out.returncode == 0 else None


# --- tegrastats (UNVERIFIED-JETSON) ----------------------------------------------------------

_RAM = re.compile(r"\bRAM (\d+)/(\d+)MB")
_CPU = re.compile(r"\bCPU \[([^\]]*)\]")
_GR3D = re.compile(r"\bGR3D_FREQ (\d+)%")
_TEMP = re.compile(r"\b([A-Za-z][\w-]*)@(-?\d+(?:\.\d+)?)C\b")
# Die sensors only: PMIC reads a constant 100C on some boards, thermal/AO are board zones.
_DIE_TEMPS = re.compile(r"^(cpu|gpu|tj|soc\d*)$", re.IGNORECASE)


def parse_tegrastats(line: str) -> Reading:
    """Parse one tegrastats line (UNVERIFIED-JETSON: checked on sample lines only).

    Utilisation is the larger of the mean online CPU core load and GR3D (the GPU).
    """
    mem = None
    if m := _RAM.search(line):
        used, total = float(m.group(1)), float(m.group(2))
        mem = 100.0 * used / total if total else None
    loads = []
    if m := _CPU.search(line):
        for core in m.group(1).split(","):
            pct = core.split("%", 1)[0].strip()
            if pct.replace(".", "", 1).isdigit():  # "off" cores are skipped
                loads.append(float(pct))
    util = _max_present(
        [
            sum(loads) / len(loads) if loads else None,
            float(g.group(1)) if (g := _GR3D.search(line)) else None,
        ]
    )
    temps = [float(t) for name, t in _TEMP.findall(line) if _DIE_TEMPS.match(name)]
    return Reading(temp_c=max(temps) if temps else None, util_pct=util, mem_pct=mem)


class TegrastatsReader:
    """Keeps one `tegrastats --interval` child and hands back its latest parsed line."""

    def __init__(self, binary: str, interval_ms: int) -> None:
        self._proc = subprocess.Popen(
            [binary, "--interval", str(interval_ms)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )

    def read_line(self) -> Reading | None:
        """Blocks for the next line (one interval); None once the child has gone."""
        if self._proc.stdout is None:
            return None
        line = self._proc.stdout.readline()
        return parse_tegrastats(line) if line else None

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout=2.0)
        if self._proc.stdout is not None:
            self._proc.stdout.close()


# --- psutil ----------------------------------------------------------------------------------


def cpu_temp_c(temps: dict[str, list[object]]) -> float | None:
    """Hottest CPU-package reading from `psutil.sensors_temperatures()`, else hottest of all."""
    preferred = [c for c in CPU_TEMP_CHIPS if temps.get(c)]
    chips = preferred or list(temps)
    values = [
        float(getattr(entry, "current", None))
        for chip in chips
        for entry in temps.get(chip, [])
        if isinstance(getattr(entry, "current", None), (int, float))
    ]
    return max(values) if values else None


def busy_and_total_s(times: Any) -> tuple[float, float]:
    """CPU seconds spent busy and in all, from a `psutil.cpu_times()` tuple."""
    fields = times._asdict()
    # Linux counts guest time inside user/nice already (psutil's cpu_percent drops it too).
    total = sum(fields.values()) - fields.get("guest", 0.0) - fields.get("guest_nice", 0.0)
    idle = fields.get("idle", 0.0) + fields.get("iowait", 0.0)
    return total - idle, total


class HostSensors:
    """psutil readings with a CPU load counter of its own.

    `psutil.cpu_percent(interval=None)` keeps one module-wide reference point, so any other
    caller in the process would shorten our interval; each instance here keeps its own. The
    first call reports the average since boot rather than a meaningless zero.
    """

    def __init__(self) -> None:
        self._last = (0.0, 0.0)

    def cpu_load_pct(self) -> float:
        busy, total = busy_and_total_s(psutil.cpu_times())
        d_busy, d_total = busy - self._last[0], total - self._last[1]
        self._last = (busy, total)
        return min(100.0, max(0.0, 100.0 * d_busy / d_total)) if d_total > 0 else 0.0

    def __call__(self) -> Reading:
        """CPU temperature (where the platform exposes one), CPU load since the last call, memory."""
        temp = None
        if hasattr(psutil, "sensors_temperatures"):
            try:
                temp = cpu_temp_c(psutil.sensors_temperatures())
            except (OSError, RuntimeError):
                temp = None
        return Reading(
            temp_c=temp,
            util_pct=self.cpu_load_pct(),
            mem_pct=float(psutil.virtual_memory().percent),
        )
