"""Whether a process is still running, as the tests that kill launchers and nodes ask it."""

from __future__ import annotations

from pathlib import Path


def alive(pid: int) -> bool:
    """True while `pid` runs; a zombie nobody has reaped yet (an orphan whose new parent does
    not reap, as PID 1 in a container may not) counts as gone."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state != "Z"
