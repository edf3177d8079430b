"""SmolLM2, 3 stages, W = 20: shifts of +-1 and +-2 blocks at every movable boundary change no token."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[2] / "tools"


@pytest.mark.assets
@pytest.mark.slow
def test_smollm2_shift_matrix_100_tokens_in_process(tmp_path) -> None:
    """Every (boundary, k) at token 40 of 100 vs the no-shift run (threads, no sockets): the
    shifted KV (the prompt's positions and 40 decoded ones, several 32 KiB frames a move)
    then serves 60 tokens, three windows of W = 20."""
    out = tmp_path / "matrix.json"
    argv = [sys.executable, str(TOOLS / "check_migration.py"), "--tokens", "100", "--shift-at", "40",
            "--window", "20", "--out", str(out)]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    rows = json.loads(out.read_text())["results"]
    assert len(rows) == 8 and all(r["identical"] and r["moved"] for r in rows)


@pytest.mark.assets
@pytest.mark.slow
def test_smollm2_tcp_shift_against_noshift() -> None:
    argv = [sys.executable, str(TOOLS / "check_equivalence.py"), "task.max_new_tokens=120",
            "architecture.window=20", "planner=forced_shift", "planner.at_token=60",
            "planner.shift_k=-2", "planner.boundary=2", "--baseline", "noshift"]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "OK: " in done.stdout and "shift" in done.stdout
