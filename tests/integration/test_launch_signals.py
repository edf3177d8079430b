"""The launcher under SIGTERM and SIGINT: every child torn down, a diagnosis, exit 128 + signal.

A real launcher process (a small script around `run_group`, and the `splitlab` console script
itself) with real children, signalled from outside as a scheduler or `kill` would.

    .venv/bin/pytest tests/integration/test_launch_signals.py -q
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from process_helpers import alive

from splitlab.telemetry.host_load import descendants, parse_proc_stat

LAUNCHER = """
import sys
from splitlab.launch.supervisor import ChildSpec, run_group

pid_dir = sys.argv[1]
child = (
    "import os, signal, sys, time\\n"
    "if sys.argv[2] == 'stubborn': signal.signal(signal.SIGTERM, signal.SIG_IGN)\\n"
    "open(os.path.join(sys.argv[1], sys.argv[2] + '.pid'), 'w').write(str(os.getpid()))\\n"
    "print('up', flush=True)\\n"
    "time.sleep(120)\\n"
)
specs = [
    ChildSpec(name=name, argv=[sys.executable, "-c", child, pid_dir, name])
    for name in ("polite", "stubborn")
]
result = run_group(specs, grace_s=1)
print("diagnosis:", result.diagnosis(), file=sys.stderr, flush=True)
sys.exit(result.exit_code)
"""


def _wait_for(predicate, timeout_s: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.1)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signalled_launcher_tears_down_diagnoses_and_exits_128_plus_signal(
    tmp_path: Path, sig: signal.Signals
) -> None:
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(tmp_path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        pid_files = [tmp_path / "polite.pid", tmp_path / "stubborn.pid"]
        _wait_for(lambda: all(p.is_file() and p.read_text() for p in pid_files), 60, "children")
        pids = [int(p.read_text()) for p in pid_files]

        launcher.send_signal(sig)
        _, stderr = launcher.communicate(timeout=30)
    finally:
        launcher.kill()

    assert launcher.returncode == 128 + sig
    assert f"diagnosis: supervisor stopped the group with exit code {128 + sig}: " in stderr
    assert f"received {sig.name}" in stderr
    assert "torn down: polite, stubborn" in stderr
    for pid in pids:
        _wait_for(lambda pid=pid: not alive(pid), 5, f"child {pid} to be gone")


def _nodes_under(pid: int) -> list[int]:
    """The `splitlab.node` processes below `pid`: its children, or, forked from its zygote
    (`splitlab.launch.zygote`), its grandchildren."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            child, parent, _ = parse_proc_stat((entry / "stat").read_text())
        except OSError:
            continue
        parents[child] = parent
    found = []
    for p in descendants(pid, parents) - {pid}:
        try:
            if b"splitlab.node" in Path(f"/proc/{p}/cmdline").read_bytes():
                found.append(p)
        except OSError:
            continue
    return found


@pytest.mark.slow
def test_sigterm_to_the_splitlab_launcher_mid_run(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    splitlab = Path(sys.executable).with_name("splitlab")
    launcher = subprocess.Popen(
        [str(splitlab), "model=tiny_bert", "data.samples_per_owner=16", "data.val_samples=16",
         "data.test_samples=0", "task.steps_per_round=0", "finetune.batch_size=4",
         "task.rounds=50", f"hydra.run.dir={run_dir}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        _wait_for(lambda: (run_dir / "checkpoints").is_dir(), 300, "the first round")
        nodes = _nodes_under(launcher.pid)
        assert len(nodes) >= 3  # coordinator, owner(s), worker(s)

        launcher.send_signal(signal.SIGTERM)
        _, stderr = launcher.communicate(timeout=60)
    finally:
        launcher.kill()

    assert launcher.returncode == 143
    assert "received SIGTERM" in stderr
    for pid in nodes:
        _wait_for(lambda pid=pid: not alive(pid), 5, f"node {pid} to be gone")
