"""`splitlab` (console_main): the job's exit code, at once after its last line, unless a
non-daemon thread still runs, which the normal exit then waits for.

    .venv/bin/pytest tests/unit/test_console_main.py -q
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = """
import atexit, sys, threading, time
from pathlib import Path
out = Path(sys.argv[1])
atexit.register(lambda: out.with_suffix(".atexit").write_text("ran"))
if sys.argv[2] == "thread":
    def late():  # still running when the job ends, even on a loaded host
        time.sleep(4.0)
        out.with_suffix(".thread").write_text("done")
    threading.Thread(target=late).start()
sys.argv = ["splitlab", *sys.argv[3:]]
from splitlab.cli import console_main
console_main()
"""


def _run(tmp_path: Path, thread: str, *argv: str) -> tuple[int, set[str]]:
    out = tmp_path / "mark"
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(out), thread, *argv], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    return done.returncode, {p.suffix for p in tmp_path.iterdir()}


def test_a_refused_config_exits_2_without_finalising(tmp_path: Path) -> None:
    code, marks = _run(tmp_path, "none", "transport.prot=1", f"hydra.run.dir={tmp_path}/run")
    assert code == 2
    assert ".atexit" not in marks  # left with os._exit after flushing, no finalisation


def test_a_success_exits_0(tmp_path: Path) -> None:
    code, marks = _run(tmp_path, "none", "--cfg", "job")
    assert code == 0 and ".atexit" not in marks


def test_a_running_non_daemon_thread_is_waited_for(tmp_path: Path) -> None:
    code, marks = _run(tmp_path, "thread", "--cfg", "job")
    assert code == 0
    assert {".thread", ".atexit"} <= marks  # the normal exit: the thread finished its write
