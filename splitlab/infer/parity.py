"""Version parity across ring stages: what each stage reports at HELLO and what the head enforces.

A version skew across nodes produces exactly the token differences the equivalence checks
exist to catch, with no hint which node is at fault, so the head refuses to start when an
enforced field differs and names the stage and field. Device, CUDA, L4T, JetPack and the power
mode are recorded, never enforced: on a heterogeneous testbed they are meant to differ.

    .venv/bin/pytest tests/unit/test_infer_parity.py -q
"""

from __future__ import annotations

import platform
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch

ENFORCED = ("python", "torch", "transformers", "dtype")
RECORDED = ("device", "cuda", "l4t", "jetpack", "power_mode")


def _l4t() -> str | None:
    path = Path("/etc/nv_tegra_release")
    try:
        return path.read_text(encoding="utf-8").splitlines()[0].strip() if path.is_file() else None
    except OSError:
        return None


def _power_mode() -> str | None:
    tool = shutil.which("nvpmodel")
    if tool is None:
        return None
    try:
        out = subprocess.run([tool, "-q"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    return " ".join(out.split()) or None


def _jetpack() -> str | None:
    tool = shutil.which("dpkg-query")
    if tool is None or _l4t() is None:
        return None
    try:
        out = subprocess.run(
            [tool, "-W", "-f=${Version}", "nvidia-jetpack"],
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.strip() or None


def stage_versions(*, dtype: torch.dtype | str, device: str) -> dict[str, Any]:
    """This process's parity report (enforced fields first)."""
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": version("transformers"),  # not imported: an echo stage never loads it
        "dtype": str(dtype).removeprefix("torch."),
        "device": device,
        "cuda": torch.version.cuda,
        "l4t": _l4t(),
        "jetpack": _jetpack(),
        "power_mode": _power_mode(),
    }


def parity_mismatches(
    roster: Sequence[Mapping[str, Any]], *, fields: Sequence[str] = ENFORCED
) -> list[str]:
    """One line per (stage, field) whose value differs from the head's (roster[0]).

    Each roster entry has `stage` and `versions`.
    """
    if not roster:
        return []
    head = roster[0]["versions"]
    problems = []
    for entry in roster[1:]:
        versions = entry["versions"]
        for name in fields:
            if versions.get(name) != head.get(name):
                problems.append(
                    f"stage {entry['stage']} {name}={versions.get(name)!r} "
                    f"but the head has {name}={head.get(name)!r}"
                )
    return problems
