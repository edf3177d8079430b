"""The window barrier with no model loaded: happy path, a NACK, a stage killed mid-barrier.

Three model-free (echo) stage processes over TCP with the control star (W=2):
- happy: every barrier commits with 3 ACKs and the ring finishes;
- nack: stage 1 refuses every epoch; each is aborted and decoding goes on to the end;
- kill: stage 1 stalls inside its pre-stage and is SIGKILLed; the head and stage 2 must stop
  with a diagnostic (non-zero exit, naming the lost stage) and no token after the barrier.

    python tools/check_control_plane.py                 # happy, nack, kill
    python tools/check_control_plane.py --only kill
"""

from __future__ import annotations

import argparse
import json
import signal
import tempfile
import time
from pathlib import Path

from splitlab.config.schema import Config
from splitlab.configure import compose_config
from splitlab.errors import tool_exit
from splitlab.launch.ring import spawn_stages
from splitlab.telemetry.log import leave

HOSTS = ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
WINDOW = 2
START_S = 180.0  # spawn -> first barrier / ring done: three imports of torch take ~40 s on a busy 2-core host


def _config(max_new_tokens: int) -> Config:
    """Three echo stages of one block each on three loopback addresses, a barrier every W."""
    return compose_config([
        "task=infer", "model=tiny_llama", "model.num_layers=3", "architecture.cuts=[1,2]",
        f"architecture.peer_hosts=[{','.join(HOSTS)}]", f"architecture.window={WINDOW}",
        "architecture.ctrl_timeout_s=2.0", "planner=noop", f"task.max_new_tokens={max_new_tokens}",
    ])  # fmt: skip


def _records(run_dir: Path, stage: int, kind: str) -> list[dict]:
    path = run_dir / "traces" / f"stage-{stage}.jsonl"
    if not path.is_file():
        return []
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["kind"] == kind]


def _wait(procs: list, timeout_s: float) -> list[int | None]:
    deadline = time.monotonic() + timeout_s
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(0.1, deadline - time.monotonic())))
        except Exception:
            codes.append(None)
    return codes


def _kill_all(procs: list) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def happy(run_dir: Path, *, tokens: int = 12, fault: str | None = None) -> tuple[bool, str]:
    stage_args = {1: ["--ctrl-fault", fault]} if fault else None
    procs = spawn_stages(_config(tokens), run_dir=run_dir, stage_args=stage_args, echo=True)
    try:
        codes = _wait(procs, START_S)
    finally:
        _kill_all(procs)
    windows = _records(run_dir, 0, "window")
    expected = (tokens - 1) // WINDOW - (1 if (tokens - 1) % WINDOW == 0 else 0)
    if codes != [0, 0, 0]:
        return False, f"exit codes {codes}"
    if len(windows) != expected:
        return False, f"{len(windows)} barriers, expected {expected}"
    if fault == "nack":
        ok = all(w["aborted"] and w["n_acks"] == 2 for w in windows)
        return ok, f"{len(windows)} barriers, all aborted on stage 1's NACK; ring finished"
    ok = all(not w["aborted"] and w["n_acks"] == 3 for w in windows)
    tail = [w["barrier_ms"] for w in _records(run_dir, 2, "window")]
    return ok, f"{len(windows)} barriers committed with 3 ACKs; tail barrier median {sorted(tail)[len(tail) // 2]:.3f} ms"  # fmt: skip


def kill(run_dir: Path) -> tuple[bool, str]:
    procs = spawn_stages(_config(1000), run_dir=run_dir, stage_args={1: ["--ctrl-fault", "hang"]},
                         echo=True)  # fmt: skip
    try:
        deadline = time.monotonic() + START_S
        while len(_records(run_dir, 0, "token")) < WINDOW + 1:  # the head reached the barrier
            if time.monotonic() > deadline:
                return False, "the ring never reached the first barrier"
            time.sleep(0.05)
        time.sleep(0.3)  # stage 1 is inside its pre-stage (it hangs there)
        procs[1].send_signal(signal.SIGKILL)
        killed_at = time.time()
        codes = _wait([procs[0], procs[2]], 30)
    finally:
        _kill_all(procs)
    stalled_s = time.time() - killed_at
    tokens = _records(run_dir, 0, "token")
    logs = {i: (run_dir / "logs" / f"stage-{i}.log").read_text() for i in (0, 2)}
    problems = []
    if None in codes or 0 in codes:
        problems.append(f"survivor exit codes {codes} (expected non-zero exits)")
    if max(t["token"] for t in tokens) != WINDOW:
        problems.append(
            f"the head emitted token {max(t['token'] for t in tokens)} after the barrier at {WINDOW}"
        )
    if "stage 1" not in logs[0] or "stage 1" not in logs[2]:
        problems.append("a survivor's log does not name stage 1")
    return not problems, "; ".join(problems) or (
        f"survivors exited {codes} within {stalled_s:.1f} s naming stage 1; last head token {WINDOW}")  # fmt: skip


CHECKS = {"happy": happy, "nack": lambda d: happy(d, fault="nack"), "kill": kill}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", choices=sorted(CHECKS), default=None)
    args = p.parse_args(argv)
    ok_all = True
    for name in [args.only] if args.only else list(CHECKS):
        run_dir = Path(tempfile.mkdtemp(prefix=f"check_control_plane-{name}-"))
        t0 = time.perf_counter()
        ok, detail = CHECKS[name](run_dir)
        ok_all &= ok
        print(
            f"{'OK' if ok else 'FAIL'} {name} ({time.perf_counter() - t0:.1f} s): {detail}; {run_dir}",
            flush=True,
        )
    return 0 if ok_all else 1


if __name__ == "__main__":
    leave(tool_exit("check_control_plane", main))
