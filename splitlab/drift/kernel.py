"""Drift on a testbed, for real: a profile's slowdowns become CPU quotas and link rates.

Without a testbed a stage *simulates* its drift (`inject` sleeps (phi - 1) x its compute). On
a testbed the launcher, which owns the `Testbed` (root), applies it to the kernel instead and
the stages inject nothing: a stage's compute slowdown phi becomes its host's CPU quota
(nominal cpu / phi, a cgroup write) and its outgoing link factor becomes its host's up rate
(nominal up_mbit x link_factor, a tc change). So `drift=cpu_throttle` cuts a host's quota
mid-run and `drift=link_degrade` drops a link's rate. Every stage's `stage_meta` trace record
says which (`drift_applied: simulated | kernel`).

Two parts: `kernel_schedule` (pure: which change at which decode token, from the profile's
records) and `KernelDrift` (thin: a thread that follows the head's trace and calls
`Testbed.set_cpu` / `Testbed.set_link_rate` when the head reaches a change's token, and
writes each change to RUN/drift/kernel.jsonl, a CPU change with the quota read back from the
cgroup).

    .venv/bin/pytest tests/unit/test_drift_kernel.py -q
    .venv/bin/pytest tests/integration/test_ring_testbed.py -q -k drift      (as root)
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from splitlab.config.schema import DriftConfig
from splitlab.drift.contract import DriftSource
from splitlab.drift.profiles import DriftRecord
from splitlab.errors import ConfigError

log = logging.getLogger(__name__)

KERNEL_LOG = Path("drift") / "kernel.jsonl"  # the changes applied, in the run dir
MIN_STEP = 0.2  # a target within this relative distance of the one in force is not applied
POLL_S = 0.02  # how often the applier reads the head's trace for its decode token
CPU, LINK_UP = "cpu", "link_up"  # what a change sets: cores, or the up rate in Mbit/s


def drift_applied(cfg: DriftConfig, *, on_testbed: bool) -> str | None:
    """How a run applies its drift: kernel (a replayed profile on a testbed), simulated (a
    replayed profile without one: the stage sleeps), or None (no drift, or live sensors)."""
    name, source = (str(getattr(v, "value", v)) for v in (cfg.name, cfg.source))
    if name == "none" or source != "replay":
        return None
    return "kernel" if on_testbed else "simulated"


class KernelApplied(DriftSource):
    """A stage's drift source when the kernel applies its slowdowns: nothing to inject (phi and
    phi_link are 1), the observations unchanged."""

    def __init__(self, source: DriftSource) -> None:
        self.source, self.stage = source, source.stage

    def observe(self, token: int) -> dict[str, float]:
        return self.source.observe(token)

    def phi(self, token: int) -> float:
        return 1.0

    @property
    def exhausted(self) -> bool:
        return self.source.exhausted

    def close(self) -> None:
        self.source.close()


@dataclass(frozen=True)
class KernelChange:
    """Set `kind` of `host` to `value` when the head starts decode token `token`."""

    token: int
    stage: int
    host: str
    kind: str  # CPU (cores) or LINK_UP (Mbit/s)
    value: float


def kernel_schedule(records: Sequence[DriftRecord], *, hosts: Sequence[str],
                    cpu: Mapping[str, float], up_mbit: Mapping[str, float],
                    min_step: float = MIN_STEP) -> list[KernelChange]:  # fmt: skip
    """The kernel changes that realise `records` on stage i's host `hosts[i]`, in token order.

    A stage's host starts at its nominal `cpu` / `up_mbit`; a record's phi asks for
    cpu / phi cores and its link_factor for up_mbit x link_factor. A change is emitted when the
    target moves more than `min_step` (relative) from the value in force, so a smooth ramp
    becomes a few steps.

    Raises:
        ConfigError: a drifting host without a CPU budget or an up rate to scale (names it).
    """
    now: dict[tuple[str, str], float] = {}
    out = []
    for rec in sorted(records, key=lambda r: (r.token, r.stage)):
        host = hosts[rec.stage]
        for kind, nominal, factor in ((CPU, cpu[host], 1.0 / rec.phi),
                                      (LINK_UP, up_mbit[host], rec.link_factor)):  # fmt: skip
            key = (host, kind)
            if factor == 1.0 and key not in now:
                continue  # never drifted: nothing to change, nominal may be unset
            if nominal <= 0:
                name = f"hosts.{host}.cpu" if kind == CPU else f"links.{host}.up_mbit"
                raise ConfigError(f"drift on a testbed: stage {rec.stage} drifts but "
                                  f"testbed.{name} is {nominal}; set it > 0")  # fmt: skip
            target = nominal * factor
            if abs(target - now.get(key, nominal)) > min_step * now.get(key, nominal):
                now[key] = target
                out.append(KernelChange(token=rec.token, stage=rec.stage, host=host, kind=kind,
                                        value=round(target, 6)))  # fmt: skip
    return out


class HeadProgress:
    """The last decode token the head's trace records (-1 before the first), read as it grows."""

    def __init__(self, trace: Path) -> None:
        self.trace, self.offset, self.token = trace, 0, -1

    def poll(self) -> int:
        if not self.trace.is_file():
            return self.token
        with self.trace.open("rb") as f:
            f.seek(self.offset)
            data = f.read()
        end = data.rfind(b"\n") + 1  # complete lines only
        self.offset += end
        for line in data[:end].splitlines():
            if b'"kind":"token"' in line:
                self.token = max(self.token, int(json.loads(line)["token"]))
        return self.token


class KernelDrift:
    """Applies a schedule to a live testbed as the head decodes (a thread; use as a context).

    `testbed` needs `set_cpu(host, cores)`, `set_link_rate(host, direction, mbit)` and
    `cpu(host)` (the quota read back).
    """

    def __init__(self, testbed: Any, schedule: Sequence[KernelChange], run_dir: Path, *,
                 nominal: Mapping[tuple[str, str], float]) -> None:  # fmt: skip
        self.testbed, self.schedule, self.nominal = testbed, list(schedule), dict(nominal)
        self.trace = Path(run_dir) / "traces" / "stage-0.jsonl"
        self.log_path = Path(run_dir) / KERNEL_LOG
        self.applied: list[dict[str, Any]] = []
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kernel-drift", daemon=True)

    def __enter__(self) -> KernelDrift:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        """Stop, and put every host the run changed back to nominal (a bench reuses the
        testbed for its next run)."""
        self._stop.set()
        self._thread.join(timeout=10)
        for host, kind in {(r["host"], r["kind"]) for r in self.applied}:
            self._set(host, kind, self.nominal[(host, kind)])

    def _set(self, host: str, kind: str, value: float) -> None:
        if kind == CPU:
            self.testbed.set_cpu(host, value)
        else:
            self.testbed.set_link_rate(host, "up", value)

    def apply(self, change: KernelChange) -> dict[str, Any]:
        t0 = time.perf_counter()
        self._set(change.host, change.kind, change.value)
        readback = self.testbed.cpu(change.host) if change.kind == CPU else None
        row = {**asdict(change), "apply_ms": (time.perf_counter() - t0) * 1e3,
               "cpu_readback": readback, "wall_s": time.time()}  # fmt: skip
        self.applied.append(row)
        with self.log_path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        log.info("drift applied to the kernel: %s", row)
        return row

    def _run(self) -> None:
        pending, head = list(self.schedule), HeadProgress(self.trace)
        try:
            while pending and not self._stop.is_set():
                token = head.poll()
                while pending and pending[0].token <= token + 1:  # before the head's next token
                    self.apply(pending.pop(0))
                self._stop.wait(POLL_S)
        except BaseException as e:  # reported by the launcher after the run
            self.error = e
            log.error("kernel drift stopped: %s", e)


def kernel_drift(cfg: DriftConfig, testbed: Any, run_dir: Path,
                 *, num_stages: int) -> KernelDrift | None:  # fmt: skip
    """The applier of a run on `testbed` (None when its drift is not applied to the kernel):
    stage i drifts on its host (`testbed.placement.stage`), from its nominal budget."""
    from splitlab.drift.source import generate_trace
    from splitlab.drift.trace_io import read_trace

    if testbed is None or drift_applied(cfg, on_testbed=True) != "kernel":
        return None
    if cfg.trace is not None:
        trace = read_trace(cfg.trace)
    else:
        trace, _ = generate_trace(cfg, num_stages=num_stages, out=None)
    topo = testbed.topology
    hosts = [topo.host_of("stage", i) for i in range(num_stages)]
    cpu = {h: topo.host(h).cpu for h in hosts}
    up = {h: topo.links[h].up_mbit for h in hosts}
    records = [r for column in trace.by_stage for r in column]
    schedule = kernel_schedule(records, hosts=hosts, cpu=cpu, up_mbit=up)
    nominal = {**{(h, CPU): c for h, c in cpu.items()}, **{(h, LINK_UP): u for h, u in up.items()}}
    return KernelDrift(testbed, schedule, run_dir, nominal=nominal)
