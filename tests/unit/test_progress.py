"""Progress of a phase: one line and no redraws in a log file, a tqdm bar on a terminal.

.venv/bin/pytest tests/unit/test_progress.py -q
"""

from __future__ import annotations

import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from splitlab.telemetry.progress import Progress, end_line, foreign_bars, track

ROOT = Path(__file__).resolve().parents[2]
# A phase of 3 batches in a child process, its stderr a terminal or a file as the test decides.
PHASE = (
    "import logging, time; from splitlab.telemetry.progress import track\n"
    "logging.basicConfig(level=logging.INFO, format='%(levelname)s %(message)s')\n"
    "for _ in track(range(3), 'final evaluation', unit='batches'): time.sleep(0.2)\n"
)


def _run_on_terminal(env: dict[str, str]) -> str:
    """What the phase writes to stderr when stderr is a pseudo-terminal."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))  # 80 columns
    proc = subprocess.Popen([sys.executable, "-c", PHASE], stderr=slave, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT), **env})  # fmt: skip
    os.close(slave)
    chunks: list[bytes] = []
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(master)
    assert proc.wait(timeout=60) == 0
    return b"".join(chunks).decode()


def test_end_line_counts_what_was_done_against_the_total() -> None:
    assert end_line("eval", count=32, total=32, unit="batches", elapsed_s=1.25) == (
        "eval: 32 batches in 1.2 s"
    )
    assert end_line("eval", count=3, total=32, unit="batches", elapsed_s=0.0) == (
        "eval: 3/32 batches in 0.0 s"
    )
    assert end_line("fetch", count=2, total=None, unit="steps", elapsed_s=9.04) == (
        "fetch: 2 steps in 9.0 s"
    )


def test_in_a_log_file_a_phase_is_one_line_and_no_redraws(tmp_path: Path) -> None:
    log_file = tmp_path / "launcher.log"
    with log_file.open("w") as fh:
        subprocess.run([sys.executable, "-c", PHASE], stderr=fh, cwd=ROOT, check=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60)  # fmt: skip

    text = log_file.read_text()
    assert text.splitlines() == [text.splitlines()[0]]
    assert text.startswith("INFO final evaluation: 3 batches in ")
    assert "\r" not in text and "\x1b" not in text


def test_on_a_terminal_a_bar_draws_then_the_same_line_ends_it() -> None:
    out = _run_on_terminal({})

    bar, _, rest = out.replace("\r\n", "\n").rpartition("\r")  # redraws, then the line
    assert "final evaluation:" in bar and "3/3 [" in bar  # tqdm: n/total [elapsed<eta]
    assert rest.startswith("INFO final evaluation: 3 batches in ")


def test_tqdm_disable_keeps_a_terminal_to_the_line() -> None:
    out = _run_on_terminal({"TQDM_DISABLE": "1"})

    assert "\r" not in out.replace("\r\n", "\n")
    assert out.replace("\r\n", "\n").startswith("INFO final evaluation: 3 batches in ")


def test_a_failed_phase_ends_without_its_line(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("INFO"), pytest.raises(ValueError):
        with Progress("loading", total=2) as progress:
            progress.update()
            raise ValueError("bad folder")
    assert not [r for r in caplog.records if "loading" in r.getMessage()]


def test_a_silent_phase_still_counts(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("INFO"):
        with Progress("owner0 window 0", total=4, logger=None) as progress:
            progress.update(4)
    assert progress.count == 4
    assert not caplog.records


def test_track_yields_every_item_and_sizes_the_total_from_a_sequence(
    caplog: pytest.LogCaptureFixture,
) -> None:
    began = time.monotonic()
    with caplog.at_level("INFO"):
        items = list(track([1, 2, 3, 4], "tokenising", unit="rows"))
    assert items == [1, 2, 3, 4]
    assert time.monotonic() - began < 5
    assert [r.getMessage().split(" in ")[0] for r in caplog.records] == ["tokenising: 4 rows"]


def test_foreign_bars_off_a_terminal_write_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    from tqdm import tqdm

    with foreign_bars():
        for _ in tqdm(range(3), desc="Converting and de-quantizing GGUF tensors..."):
            pass
    assert capsys.readouterr().err == ""
    for _ in tqdm(range(3), desc="outside"):  # the same bar outside still writes
        pass
    assert "outside" in capsys.readouterr().err
