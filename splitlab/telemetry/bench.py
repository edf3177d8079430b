"""Shared shape of every `tools/bench_*.py` result (see DESIGN.md, Benchmarks).

A benchmark builds a `BenchReport` before its run (the report samples the host's load from
then on, `host_load.HostLoadMonitor`), adds raw medians with `add_result`, ratios with
`add_ratio`, targets with `add_target` (whose `met` is computed here, never by hand), bounds
that physics sets with `check_physics`, and each arm's thread policy with `add_arm`; then
`write(path)` and exits with `exit_code(require_quiet=...)`. A run on a noisy host (load above
the core count, or CPU steal) or with arms under different thread policies keeps its ratios,
but its targets say `"trusted": false`; a physics violation fails the run.

    python tools/bench_transport.py --quick --out /tmp/bench.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import IntEnum
from pathlib import Path
from typing import Any

from splitlab.telemetry.host_load import HostLoadMonitor


class BenchExit(IntEnum):
    """A benchmark's exit codes beyond splitlab's ExitCode."""

    OK = 0
    PHYSICS = 20  # a ratio broke a physical bound: the run measured something else
    NOISY = 21  # --require-quiet and the host was noisy (or the arms' thread policies differ)


def machine_info() -> dict[str, Any]:
    """cpu, cores, torch, transformers, python and device of this process."""
    info: dict[str, Any] = {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
    }
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        import torch

        info["torch"] = torch.__version__
        info["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    except ImportError:  # pragma: no cover - torch is a hard dependency
        info["torch"], info["device"] = None, "cpu"
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:  # pragma: no cover
        info["transformers"] = None
    return info


def thread_policy(*, torch_threads: int | None, env: Mapping[str, str] | None = None
                  ) -> dict[str, Any]:  # fmt: skip
    """One arm's thread policy: its OpenMP environment (None where unset) and torch threads."""
    env = os.environ if env is None else env
    return {
        "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS"),
        "OMP_WAIT_POLICY": env.get("OMP_WAIT_POLICY"),
        "GOMP_SPINCOUNT": env.get("GOMP_SPINCOUNT"),
        "torch_threads": torch_threads,
    }


def physics_violation(name: str, value: float, *, floor: float, tolerance: float
                      ) -> dict[str, Any] | None:  # fmt: skip
    """The record of `value` breaking a bound it physically cannot go below (`floor`, less a
    relative `tolerance` for timing noise), or None when it holds."""
    if not 0 <= tolerance < 1:
        raise ValueError(f"physics check {name!r}: tolerance must be in [0, 1), got {tolerance!r}")
    limit = floor * (1 - tolerance)
    if value >= limit:
        return None
    return {"name": name, "value": float(value), "floor": float(floor),
            "tolerance": float(tolerance), "limit": float(limit)}  # fmt: skip


def median(values: list[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile, q in [0, 100]."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1))))
    return float(ordered[k])


@dataclass
class BenchReport:
    bench: str
    config: dict[str, Any] = field(default_factory=dict)
    results: list[dict[str, Any]] = field(default_factory=list)
    ratios: dict[str, float] = field(default_factory=dict)
    targets: dict[str, dict[str, Any]] = field(default_factory=dict)
    machine: dict[str, Any] = field(default_factory=machine_info)
    arms: dict[str, dict[str, Any]] = field(default_factory=dict)
    physics_violations: list[dict[str, Any]] = field(default_factory=list)
    host: HostLoadMonitor = field(default_factory=lambda: HostLoadMonitor().start(), repr=False)

    def add_arm(self, name: str, policy: dict[str, Any]) -> None:
        """Record an arm's (or one of its processes') `thread_policy`."""
        self.arms[name] = dict(policy)

    def check_physics(self, name: str, value: float, *, floor: float, tolerance: float) -> bool:
        """Whether `value` respects its physical floor; a violation fails the run."""
        violation = physics_violation(name, value, floor=floor, tolerance=tolerance)
        if violation is not None:
            self.physics_violations.append(violation)
        return violation is None

    def thread_policies_match(self) -> bool:
        return len({json.dumps(p, sort_keys=True) for p in self.arms.values()}) <= 1

    def targets_trusted(self) -> bool:
        """False once the run ends on a noisy host, with arms under different thread
        policies, or with a physics violation."""
        noisy = self.host.stop()["noisy"]
        return not noisy and self.thread_policies_match() and not self.physics_violations

    def exit_code(self, *, require_quiet: bool) -> int:
        if self.physics_violations:
            return int(BenchExit.PHYSICS)
        if require_quiet and not self.targets_trusted():
            return int(BenchExit.NOISY)
        return int(BenchExit.OK)

    def add_result(self, **raw: Any) -> None:
        self.results.append(raw)

    def add_ratio(self, name: str, value: float) -> None:
        self.ratios[name] = float(value)

    def add_target(self, name: str, value: float, goal: float, direction: str) -> None:
        if direction not in ("<=", ">="):
            raise ValueError(f"target {name!r}: direction must be '<=' or '>=', got {direction!r}")
        met = value <= goal if direction == "<=" else value >= goal
        self.targets[name] = {
            "value": float(value),
            "goal": float(goal),
            "direction": direction,
            "met": bool(met),
        }

    def to_dict(self) -> dict[str, Any]:
        """The report; the first call ends the host's sampling."""
        trusted = self.targets_trusted()
        return {
            "bench": self.bench,
            "machine": {**self.machine, **self.host.stop()},
            "config": self.config,
            "arms": self.arms,
            "thread_policies_match": self.thread_policies_match(),
            "results": self.results,
            "ratios": self.ratios,
            "targets": {k: {**t, "trusted": trusted} for k, t in self.targets.items()},
            "targets_trusted": trusted,
            "physics_violations": self.physics_violations,
        }

    def write(self, path: str | Path | None) -> None:
        text = json.dumps(self.to_dict(), indent=2, default=str)
        if path is None:
            sys.stdout.write(text + "\n")
            return
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(text + "\n", encoding="utf-8")
        tmp.replace(path)


def bench_arg_parser(description: str, *, testbed: bool = False) -> argparse.ArgumentParser:
    """The flags every benchmark takes: --quick, --out and --require-quiet; where a link
    matters (`testbed`), also --testbed NAME (an option of conf/testbed/; `none`, the default,
    is loopback)."""
    parser = argparse.ArgumentParser(description=description)
    if testbed:
        parser.add_argument(
            "--testbed", default="none", metavar="NAME",
            help="run over a testbed preset's emulated links (conf/testbed/NAME.yaml; as root)",
        )  # fmt: skip
    parser.add_argument(
        "--quick", action="store_true", help="short run (about a minute on 2 cores)"
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="write the JSON here (default: stdout)"
    )
    parser.add_argument(
        "--require-quiet", action="store_true",
        help=f"exit {int(BenchExit.NOISY)} when the targets cannot be trusted (noisy host)",
    )  # fmt: skip
    return parser
