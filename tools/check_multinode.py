"""Model-free check of ring addressing, channels and parity over 127.0.0.1, .2 and .3.

127.0.0.0/8 is all loopback, so three stages on three addresses exercise distinct bind and
connect addresses on one machine (a 127.0.0.1-only run cannot tell them apart). Every stage
runs the echo model: no weights, a few seconds per scenario.

    python tools/check_multinode.py                 # happy, parity, relaxed, kill
    python tools/check_multinode.py --only parity
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
from splitlab.errors import ExitCode, tool_exit
from splitlab.infer.folders import RESULT_FILE
from splitlab.launch.ring import spawn_stages
from splitlab.telemetry.log import leave

HOSTS = ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
START_S = 180.0  # spawn -> ring done: three torch imports take most of a minute on a busy host


def _config(max_new_tokens: int, *overrides: str) -> Config:
    """Three echo stages of one block each on three loopback addresses, no control plane."""
    return compose_config([
        "task=infer", "model=tiny_llama", "model.num_layers=3", "architecture.cuts=[1,2]",
        f"architecture.peer_hosts=[{','.join(HOSTS)}]", f"architecture.ctrl_host={HOSTS[0]}",
        "architecture.window=0", f"task.max_new_tokens={max_new_tokens}", *overrides,
    ])  # fmt: skip


def _wait(procs, timeout_s: float) -> list[int | None]:
    deadline = time.monotonic() + timeout_s
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except Exception:
            pass
    codes = [p.poll() for p in procs]
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    return codes


def _log(run_dir: Path, i: int) -> str:
    return (run_dir / "logs" / f"stage-{i}.log").read_text(encoding="utf-8", errors="replace")


def happy(run_dir: Path) -> str | None:
    result = run_dir / RESULT_FILE
    procs = spawn_stages(_config(8), run_dir=run_dir, echo=True)
    codes = _wait(procs, START_S)
    if codes != [0, 0, 0]:
        return f"exit codes {codes}; head log:\n{_log(run_dir, 0)[-2000:]}"
    out = json.loads(result.read_text())
    if out["token_ids"] != [4, 5, 6, 7, 8, 9, 10, 11]:
        return f"echo tokens {out['token_ids']} (expected 4..11)"
    bound = [r["address"] for r in out["roster"]]
    if bound != HOSTS:
        return f"stages report bind addresses {bound}, expected {HOSTS}"
    for i in range(3):
        records = [json.loads(line) for line in (run_dir / "traces" / f"stage-{i}.jsonl").open()]
        (links,) = [r for r in records if r["kind"] == "links"]
        up_host, down_host = links["up"].split(":")[0], links["down"].split(":")[0]
        if (up_host, down_host) != (HOSTS[i - 1], HOSTS[(i + 1) % 3]):
            return f"stage {i} linked from {up_host} to {down_host}: expected {HOSTS[i - 1]} -> {HOSTS[(i + 1) % 3]}"
    return None


def parity(run_dir: Path, *, relaxed: bool = False) -> str | None:
    cfg = _config(4, *(["architecture.strict_parity=false"] if relaxed else []))
    procs = spawn_stages(cfg, run_dir=run_dir, echo=True,
                         stage_args={1: ["--parity-override", "torch=0.0-skewed"]})  # fmt: skip
    codes = _wait(procs, START_S)
    if relaxed:
        return None if codes == [0, 0, 0] else f"relaxed parity: exit codes {codes}"
    head = _log(run_dir, 0)
    if codes[0] != ExitCode.CONFIG or "stage 1 torch='0.0-skewed'" not in head:
        return f"head exit {codes[0]} (expected {int(ExitCode.CONFIG)}) naming stage 1 torch; log:\n{head[-2000:]}"
    if codes[1:] != [ExitCode.ABORTED, ExitCode.ABORTED]:
        return f"stages 1, 2 exit {codes[1:]} (expected {int(ExitCode.ABORTED)} after the head's abort)"
    return None


def kill(run_dir: Path) -> str | None:
    procs = spawn_stages(_config(1000000), run_dir=run_dir, echo=True)
    trace = run_dir / "traces" / "stage-0.jsonl"
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        if trace.is_file() and trace.read_text().count('"kind":"token"') >= 20:
            break
        time.sleep(0.1)
    else:
        _wait(procs, 0)
        return "the ring never reached 20 tokens"
    procs[1].send_signal(signal.SIGKILL)
    t0 = time.monotonic()
    codes = _wait([procs[0], procs[2]], 30)
    took_s = time.monotonic() - t0
    procs[1].wait()
    if any(c in (None, 0) for c in codes):
        return f"survivors exit codes {codes} after stage 1 was killed (expected non-zero)"
    for i in (0, 2):
        if "lost stage-1" not in _log(run_dir, i):
            return f"stage {i} log does not name the lost stage-1:\n{_log(run_dir, i)[-1500:]}"
    print(f"  survivors exited {codes} within {took_s:.1f} s")
    return None


SCENARIOS = {
    "happy": happy,
    "parity": parity,
    "relaxed": lambda d: parity(d, relaxed=True),
    "kill": kill,
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", choices=list(SCENARIOS), action="append")
    args = p.parse_args(argv)
    failed = 0
    for name in args.only or list(SCENARIOS):
        run_dir = Path(tempfile.mkdtemp(prefix=f"check_multinode-{name}-"))
        t0 = time.monotonic()
        problem = SCENARIOS[name](run_dir)
        status = "ok" if problem is None else f"FAIL: {problem}"
        print(f"{name:8s} {time.monotonic() - t0:5.1f} s  {status}  ({run_dir})")
        failed += problem is not None
    return 1 if failed else 0


if __name__ == "__main__":
    leave(tool_exit("check_multinode", main))
