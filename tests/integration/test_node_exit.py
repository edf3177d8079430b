"""A node leaves as soon as it is done: no interpreter finalisation after its last line.

Tearing down torch's module graph at exit cost a CPU-second per process, which a loaded host
stretched into a multi-second stall between each node's "done" and its exit (every launcher,
testbed runs included, waits for that exit). CPU time, unlike wall time, does not depend on
the load, so the test counts the CPU the process spends after its last line.

    .venv/bin/pytest tests/integration/test_node_exit.py -q
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

# torch first, as every real node has it, then the node entry exactly as launchers run it
NODE = ("import runpy, sys, torch; sys.argv = ['splitlab.node', *sys.argv[1:]]; "
        "runpy.run_module('splitlab.node', run_name='__main__', alter_sys=True)")  # fmt: skip


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_node_spends_no_cpu_after_its_last_line(tmp_path: Path) -> None:
    argv = [sys.executable, "-c", NODE, "--config", str(tmp_path / "absent.yaml"),
            "--role", "owner"]  # fmt: skip
    child = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True)
    assert child.stderr is not None
    last = child.stderr.readline()  # its one line: the missing config, then it leaves
    at_last_line = _cpu_s(child.pid)  # a zombie keeps its times until it is reaped
    _, status, usage = os.wait4(child.pid, 0)
    after_s = usage.ru_utime + usage.ru_stime - at_last_line

    assert os.waitstatus_to_exitcode(status) == 2, last
    assert "absent.yaml" in last
    assert after_s < 0.25, f"{after_s:.2f} CPU s between the node's last line and its exit"
