"""The control plane over real processes with no model: happy, NACK, a stage killed mid-barrier."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "check_control_plane.py"


@pytest.mark.parametrize("check", ["happy", "nack", "kill"])
def test_check_control_plane(check: str) -> None:
    done = subprocess.run([sys.executable, str(TOOL), "--only", check],
                          capture_output=True, text=True, timeout=420)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert done.stdout.startswith(f"OK {check}")
