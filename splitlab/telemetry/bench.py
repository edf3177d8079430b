"""Shared shape of every `tools/bench_*.py` result (see DESIGN.md, Benchmarks).

A benchmark builds a `BenchReport`, adds raw medians with `add_result`, ratios with
`add_ratio` and targets with `add_target` (whose `met` is computed here, never by hand),
then `write(path)`.

    python tools/bench_transport.py --quick --out /tmp/bench.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


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
        return {
            "bench": self.bench,
            "machine": self.machine,
            "config": self.config,
            "results": self.results,
            "ratios": self.ratios,
            "targets": self.targets,
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


def bench_arg_parser(description: str) -> argparse.ArgumentParser:
    """The flags every benchmark takes: --quick and --out."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--quick", action="store_true", help="short run (about a minute on 2 cores)"
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="write the JSON here (default: stdout)"
    )
    return parser
