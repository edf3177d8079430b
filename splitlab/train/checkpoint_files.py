"""Where a run's checkpoints lie and which rounds are complete, without loading any of them.

Torch-free, so the launcher can report a run's checkpoints (`checkpoint_bytes`) without
importing what reading them needs (`splitlab.train.checkpoint`).

    .venv/bin/pytest tests/unit/test_train_checkpoint.py -q
"""

from __future__ import annotations

import re
from pathlib import Path

from splitlab.telemetry.records import round_number

NAME = re.compile(r"^round-(\d{6})\.safetensors$")  # a finished checkpoint's file name


def checkpoint_path(directory: Path, round_id: int) -> Path:
    """Round index `round_id` (0-based) is saved as `round-<round_number>` (1..N, as logged)."""
    return Path(directory) / f"round-{round_number(round_id):06d}.safetensors"


def completed_rounds(directory: Path) -> list[int]:
    """Rounds with a finished checkpoint in `directory`, ascending (temps never count)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    rounds = [int(m.group(1)) - 1 for p in directory.iterdir() if (m := NAME.match(p.name))]
    return sorted(rounds)


def checkpoint_bytes(directory: Path) -> tuple[int, int]:
    """(number of checkpoint files, their total bytes) in `directory`."""
    paths = [checkpoint_path(directory, r) for r in completed_rounds(directory)]
    return len(paths), sum(p.stat().st_size for p in paths if p.exists())
