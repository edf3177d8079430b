"""Fault matrix for a fine-tuning run: fault x role x moment, and what the launcher made of it.

Each cell starts the real launcher (`python -m splitlab`, task=finetune) on the smallest config
that has every moment (tiny_bert, 2 owners x 1 worker, 2 rounds, checkpoints on, short
timeouts), watches the run's live traces (RUN/traces/*.jsonl) and node logs (RUN/logs/) for
the moment, then SIGKILLs or freezes (SIGSTOP, never continued) one node. It records every
node's exit code and the launcher's diagnosis (the supervisor's "first cause" line), the time
from the fault to the launcher's exit, the node processes still alive after it (orphans,
found by the run folder in /proc/*/cmdline), whether every checkpoint in RUN/checkpoints loads
and verifies its checksum, and the outcome of a resumed run (`task.resume=true`): exit 0,
continuing from the round after the last checkpoint on disk, up to the last round.

Moments and how they are seen (the fault goes in as soon as the trigger is seen, and `hit`
says whether the run was still in that moment when the signal landed, as far as the files
show: traces are written by a thread, a few ms behind; `CAVEATS` names the cells whose
trigger cannot promise the moment):
  start             the victim logged "starting" and the coordinator traced no round yet
  mid_window        worker0 traced `open` of a round-1 window, and not yet its `commit`
  checkpoint_write  the round-0 temp file is in RUN/checkpoints (after the coordinator's
                    `fedavg` records), and the final file is not there yet
  validation        owner0 traced `step` of round 0's last window, and not yet `validation`
  between_rounds    the coordinator traced `round_end` of round 0, worker0 no round-1 `open`

    python tools/fault_matrix.py --out outputs/bench/faults.json
    python tools/fault_matrix.py --only worker:mid_window --faults kill --out /tmp/f.json
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from splitlab.errors import SplitlabError  # noqa: E402
from splitlab.launch.supervisor import exit_meaning, shell_code  # noqa: E402
from splitlab.telemetry.bench import BenchReport, bench_arg_parser  # noqa: E402
from splitlab.telemetry.log import leave  # noqa: E402
from splitlab.train.checkpoint import (  # noqa: E402
    checkpoint_path,
    completed_rounds,
    load_checkpoint,
)

FAULTS = ("kill", "freeze")
ROLES = ("coordinator", "owner", "worker")
MOMENTS = ("start", "mid_window", "checkpoint_write", "validation", "between_rounds")
VICTIM = {"coordinator": "coordinator", "owner": "owner0", "worker": "worker0"}
NODES = ("coordinator", "worker0", "owner0", "owner1")
TRACE = {"coordinator": "coordinator-0", "worker0": "worker-0", "owner0": "owner-0",
         "owner1": "owner-1"}  # fmt: skip
ROUNDS = 2
TIMEOUT_S = 12.0  # architecture.timeout_s: every wait, so a freeze is diagnosed fast
SLACK_S = 10.0  # the target: the launcher exits within timeout_s + SLACK_S of the fault
CONFIG = [
    "model=tiny_bert", "data.samples_per_owner=16", "data.val_samples=64",
    "data.test_samples=0", "task.steps_per_round=0", "finetune.batch_size=4",
    f"task.rounds={ROUNDS}", "task.keep_checkpoints=all", f"architecture.timeout_s={TIMEOUT_S:g}",
]  # fmt: skip  # the test's TINY, more validation examples (a wider moment), every checkpoint
MOMENT_WAIT_S = 300.0  # a bound on waiting for a moment on a loaded host, not a speed check
EXIT_WAIT_S = 180.0  # a bound on the launcher's exit after the fault
RESUME_WAIT_S = 600.0  # a bound on the whole resumed run
POLL_S = 0.01
CAVEATS = {  # (role, moment) -> what the trigger cannot promise
    ("coordinator", "between_rounds"): "the coordinator sends the next START right after it "
    "traces round_end, so by the time the trace is read it has usually started round 1: the "
    "freeze or kill lands while the others run round 1's windows",
    ("owner", "checkpoint_write"): "the coordinator's moment: the owner is waiting for the "
    "merged update",
    ("worker", "checkpoint_write"): "the coordinator's moment: the worker is waiting for the "
    "merged update",
}


# --- what the run shows (pure) ------------------------------------------------------------------


Records = dict[str, list[dict[str, Any]]]  # node name -> its trace records so far


def _has(records: Records, node: str, kind: str, **match: Any) -> bool:
    return any(
        r.get("kind") == kind and all(r.get(k) == v for k, v in match.items())
        for r in records.get(node, [])
    )


def _windows(records: Records) -> int | None:
    starts = [r for r in records.get("coordinator", []) if r.get("kind") == "round_start"]
    return int(starts[0]["num_windows"]) if starts else None


def moment_state(moment: str, records: Records, *, started: bool, temp: bool, final: bool
                 ) -> tuple[bool, bool]:  # fmt: skip
    """(reached, inside): whether `moment`'s trigger has been seen, and whether the run is
    still inside the moment. `started`: the victim logged "starting"; `temp`/`final`: round
    0's checkpoint temp file / final file is in RUN/checkpoints."""
    n = _windows(records)
    if moment == "start":
        return started, not _has(records, "coordinator", "round_start")
    if moment == "checkpoint_write":
        return temp or final, temp and not final
    if n is None:
        return False, False
    if moment == "mid_window":
        opened = [r["window"] for r in records.get("worker0", [])
                  if r.get("kind") == "open" and r["window"] >= n]  # fmt: skip
        if not opened:
            return False, False
        return True, not _has(records, "worker0", "commit", window=opened[0])
    if moment == "validation":
        reached = _has(records, "owner0", "step", window=n - 1)
        return reached, reached and not _has(records, "owner0", "validation", round=0)
    if moment == "between_rounds":
        reached = _has(records, "coordinator", "round_end", round=0)
        return reached, reached and not _has(records, "worker0", "open", window=n)
    raise ValueError(f"moment must be one of {MOMENTS}, got {moment!r}")


@dataclass(frozen=True)
class Diagnosis:
    line: str  # the launcher's "fine-tuning failed: ..." line, or "" when there is none
    cause: str | None  # the node (or "supervisor") it names first
    cause_code: int | None  # its shell exit code
    text: str  # the whole diagnosis, the cause's last lines included
    also_failed: dict[str, int] = field(default_factory=dict)  # name -> shell exit code
    torn_down: list[str] = field(default_factory=list)
    hung: bool = False  # the torn-down nodes were still running after the cause timed out


_FIRST = re.compile(r"fine-tuning failed: (\S+) (?:failed first|stopped the group) with exit "
                    r"code (-?\d+)")  # fmt: skip
_ALSO = re.compile(r"(\S+) \(exit (-?\d+), [^)]*\)")


def parse_diagnosis(output: str) -> Diagnosis:
    """The supervisor's diagnosis as the launcher printed it (`GroupResult.diagnosis`)."""
    lines = output.splitlines()
    start = next((i for i, line in enumerate(lines) if "fine-tuning failed: " in line), None)
    if start is None:
        return Diagnosis(line="", cause=None, cause_code=None, text="")
    block = [lines[start]]
    block += [line for line in lines[start + 1:] if line.startswith(" ")]  # fmt: skip
    first = _FIRST.search(lines[start])
    also: dict[str, int] = {}
    torn: list[str] = []
    hung = False
    for line in block[1:]:
        if line.startswith("  also failed (consequences): "):
            also = {m[1]: shell_code(int(m[2])) for m in _ALSO.finditer(line)}
        elif line.startswith(("  torn down: ", "  still running after ")):
            torn = [name.strip() for name in line.rsplit(": ", 1)[1].split(",")]
            hung = line.startswith("  still running after ")
    return Diagnosis(
        line=lines[start].split("fine-tuning failed: ", 1)[1],
        cause=first[1] if first else None,
        cause_code=shell_code(int(first[2])) if first else None,
        text="\n".join(block), also_failed=also, torn_down=torn, hung=hung,
    )  # fmt: skip


def exit_codes(diagnosis: Diagnosis, nodes: Iterable[str]) -> dict[str, int | str]:
    """Every node's exit as the diagnosis tells it: a shell code, or "torn down" (stopped by
    the launcher's SIGTERM/SIGKILL; the diagnosis does not give those codes). A node it does
    not name exited 0."""
    codes: dict[str, int | str] = {}
    for node in nodes:
        if node == diagnosis.cause and diagnosis.cause_code is not None:
            codes[node] = diagnosis.cause_code
        elif node in diagnosis.also_failed:
            codes[node] = diagnosis.also_failed[node]
        elif node in diagnosis.torn_down:
            codes[node] = "torn down"
        else:
            codes[node] = 0
    return codes


def victim_named_as(diagnosis: Diagnosis, victim: str) -> str | None:
    """How the diagnosis leads to the victim: "first cause"; "cause's last lines" (the peer
    that waited on it names it); "hung" (the only node still running after the cause timed
    out); None when it does not."""
    if diagnosis.cause == victim:
        return "first cause"
    quoted = (
        diagnosis.text.split("\n  ", 1)[0]
        + "\n"
        + "\n".join(line for line in diagnosis.text.splitlines()[1:] if line.startswith("    "))
    )
    if re.search(rf"\b{re.escape(victim)}\b", quoted.split("\n", 1)[-1]):
        return "cause's last lines"
    if diagnosis.hung and diagnosis.torn_down == [victim]:
        return "hung"
    return None


# --- the shell: processes, files ----------------------------------------------------------------


class TraceTail:
    """The run's trace records, read incrementally as the nodes append them."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.records: Records = {node: [] for node in NODES}
        self._offsets = dict.fromkeys(NODES, 0)

    def poll(self) -> Records:
        for node in NODES:
            path = self.run_dir / "traces" / f"{TRACE[node]}.jsonl"
            try:
                with path.open("rb") as f:
                    f.seek(self._offsets[node])
                    chunk = f.read()
            except FileNotFoundError:
                continue
            complete = chunk[: chunk.rfind(b"\n") + 1]
            self._offsets[node] += len(complete)
            self.records[node] += [json.loads(line) for line in complete.splitlines() if line]
        return self.records


def node_pids(run_dir: Path) -> dict[int, str]:
    """pid -> node name of every `splitlab.node` process of this run (its --run-dir)."""
    found = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            argv = Path(entry.path, "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if "splitlab.node" in argv and str(run_dir) in argv and "--role" in argv:
            role, rank = argv[argv.index("--role") + 1], argv[argv.index("--rank") + 1]
            found[int(entry.name)] = role if role == "coordinator" else f"{role}{rank}"
    return found


def check_checkpoints(directory: Path) -> dict[str, Any]:
    """Every finished checkpoint loads and verifies; temps a killed write left are listed."""
    files = sorted(p.name for p in directory.glob("round-*.safetensors"))
    corrupt = {}
    for round_id in completed_rounds(directory):
        path = checkpoint_path(directory, round_id)
        try:
            load_checkpoint(path)
        except SplitlabError as exc:
            corrupt[path.name] = str(exc)
    temps = sorted(p.name for p in directory.glob(".round-*.tmp-*"))
    return {"files": files, "corrupt": corrupt, "temps": temps, "ok": not corrupt}


def launcher(run_dir: Path, *extra: str, log_path: Path) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "splitlab", *CONFIG, *extra, f"hydra.run.dir={run_dir}"]
    root = str(Path(__file__).resolve().parents[1])
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path}
    with log_path.open("ab") as out:  # the child holds its own copy of the descriptor
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)  # fmt: skip


def _started(run_dir: Path, victim: str) -> bool:
    try:
        return " starting (session " in (run_dir / "logs" / f"{victim}.log").read_text()
    except FileNotFoundError:
        return False


def _inject(fault: str, pid: int) -> None:
    os.kill(pid, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)


def _reap(pids: Iterable[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _wait_diagnosis(proc: subprocess.Popen[bytes], log_path: Path, timeout_s: float
                    ) -> float | None:  # fmt: skip
    """When the launcher printed its diagnosis (monotonic), watching until it exits; None
    when it exited without one."""
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None and time.monotonic() < deadline:
        if b"fine-tuning failed: " in log_path.read_bytes():
            return time.monotonic()
        time.sleep(0.05)
    return None


def resume_outcome(run_dir: Path, expected_round: int, log_path: Path) -> dict[str, Any]:
    """Re-run with task.resume=true: it must exit 0, start at `expected_round` (the round after
    the last checkpoint on disk) and checkpoint the last round."""
    trace = run_dir / "traces" / f"{TRACE['coordinator']}.jsonl"
    offset = trace.stat().st_size if trace.exists() else 0
    proc = launcher(run_dir, "task.resume=true", log_path=log_path)
    try:
        code = proc.wait(timeout=RESUME_WAIT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        code = proc.wait()
    text = trace.read_bytes() if trace.exists() else b""
    if len(text) < offset:  # the trace was rewritten, not appended
        offset = 0
    starts = [
        r for r in (json.loads(line) for line in text[offset:].splitlines() if line)
        if r.get("kind") == "round_start"
    ]  # fmt: skip
    first = starts[0]["round"] if starts else None
    rounds = completed_rounds(run_dir / "checkpoints")
    ok = (code == 0 and first == expected_round and bool(rounds) and rounds[-1] == ROUNDS - 1
          and (starts[0]["resumed"] == (expected_round > 0)))  # fmt: skip
    return {"exit_code": code, "expected_round": expected_round, "first_round": first,
            "last_checkpoint_round": rounds[-1] if rounds else None, "ok": ok}  # fmt: skip


def run_cell(fault: str, role: str, moment: str, *, work_dir: Path, resume: bool = True
             ) -> dict[str, Any]:  # fmt: skip
    """One cell: a run, the fault at the moment, the launcher's verdict, the aftermath."""
    if fault not in FAULTS:
        raise ValueError(f"fault must be one of {FAULTS}, got {fault!r}")
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    victim = VICTIM[role]
    run_dir = (work_dir / f"{fault}-{role}-{moment}").resolve()
    run_dir.mkdir(parents=True, exist_ok=False)
    log_path = run_dir.parent / f"{run_dir.name}.launcher.log"
    cell: dict[str, Any] = {"fault": fault, "role": role, "moment": moment, "victim": victim,
                            "run_dir": str(run_dir)}  # fmt: skip
    if (role, moment) in CAVEATS:
        cell["caveat"] = CAVEATS[role, moment]
    tail, ckpts = TraceTail(run_dir), run_dir / "checkpoints"
    temp_glob = f".{checkpoint_path(ckpts, 0).name}.tmp-*"  # round 0's write in progress
    proc = launcher(run_dir, log_path=log_path)
    victim_pid = None
    fault_at = diagnosed_at = None
    deadline = time.monotonic() + MOMENT_WAIT_S
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            if victim_pid is None:
                victim_pid = next((p for p, n in node_pids(run_dir).items() if n == victim), None)
            temp = any(ckpts.glob(temp_glob))
            final = checkpoint_path(ckpts, 0).exists()
            reached, _ = moment_state(moment, tail.poll(), started=_started(run_dir, victim),
                                      temp=temp, final=final)  # fmt: skip
            if reached and victim_pid is not None:
                _inject(fault, victim_pid)
                fault_at = time.monotonic()
                temp = any(ckpts.glob(temp_glob))
                final = checkpoint_path(ckpts, 0).exists()
                _, inside = moment_state(moment, tail.poll(), started=True, temp=temp,
                                         final=final)  # fmt: skip
                cell["hit"] = inside
                break
            time.sleep(POLL_S)
        if fault_at is None:
            cell["hit"] = False
            cell["note"] = "the moment was never seen: no fault injected"
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)  # the launcher tears its nodes down
        diagnosed_at = _wait_diagnosis(proc, log_path, EXIT_WAIT_S)
        code, exited_at = proc.wait(timeout=EXIT_WAIT_S), time.monotonic()
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        code, exited_at = proc.wait(), time.monotonic()
        cell["note"] = f"the launcher did not exit within {EXIT_WAIT_S:g} s of the fault"
    orphans = node_pids(run_dir)
    _reap(orphans)
    diagnosis = parse_diagnosis(log_path.read_text(errors="replace"))
    cell.update(
        launcher_exit_code=shell_code(code), launcher_exit=exit_meaning(code),
        diagnosis=diagnosis.line, first_cause=diagnosis.cause,
        exit_codes=exit_codes(diagnosis, NODES),
        victim_named_as=victim_named_as(diagnosis, victim),
        exit_after_fault_s=None if fault_at is None else round(exited_at - fault_at, 2),
        diagnosis_after_fault_s=None if fault_at is None or diagnosed_at is None
        else round(diagnosed_at - fault_at, 2),
        orphans=[{"pid": p, "node": n} for p, n in sorted(orphans.items())],
        checkpoints=check_checkpoints(ckpts) if ckpts.is_dir() else {"files": [], "ok": True,
                                                                     "corrupt": {}, "temps": []},
    )  # fmt: skip
    bound_s = TIMEOUT_S + SLACK_S
    cell["diagnosed"] = bool(
        fault_at is not None and code != 0 and cell["victim_named_as"] is not None
        and cell["exit_after_fault_s"] <= bound_s
    )  # fmt: skip
    if resume and fault_at is not None:
        before = completed_rounds(ckpts)
        expected = before[-1] + 1 if before else 0
        cell["resume"] = resume_outcome(run_dir, expected, log_path.with_suffix(".resume.log"))
    return cell


def cell_line(cell: dict[str, Any]) -> str:
    """One progress line per cell."""
    head = f"{cell['fault']:>6} {cell['role']:<11} {cell['moment']:<16}"
    if cell.get("exit_after_fault_s") is None:
        return f"{head} not run: {cell.get('note', '')}"
    resume = cell.get("resume")
    resumed = ("" if resume is None else
               f", resume from {resume['first_round']} (want {resume['expected_round']}) "
               f"{'ok' if resume['ok'] else 'WRONG'}")  # fmt: skip
    return (
        f"{head} {'hit ' if cell['hit'] else 'MISS'} first cause {cell['first_cause']} "
        f"({cell['exit_codes'].get(cell['first_cause'], '?')}), victim named as "
        f"{cell['victim_named_as']}, diagnosis {cell['diagnosis_after_fault_s']} s and exit "
        f"{cell['exit_after_fault_s']:.1f} s after the fault: "
        f"{'diagnosed' if cell['diagnosed'] else 'NOT DIAGNOSED'}"
        f", orphans {len(cell['orphans'])}, checkpoints "
        f"{'ok' if cell['checkpoints']['ok'] else 'CORRUPT'} ({len(cell['checkpoints']['files'])})"
        f"{resumed}"
    )


def select(only: Sequence[str], faults: Sequence[str]) -> list[tuple[str, str, str]]:
    """The cells `--only ROLE[:MOMENT],...` and `--faults` ask for, in matrix order."""
    for fault in faults:
        if fault not in FAULTS:
            raise ValueError(f"--faults: {fault!r} is not one of {', '.join(FAULTS)}")
    wanted = set()
    for item in only or ROLES:
        role, _, moment = item.partition(":")
        if role not in ROLES:
            raise ValueError(f"--only: role {role!r} is not one of {', '.join(ROLES)}")
        if moment and moment not in MOMENTS:
            raise ValueError(f"--only: moment {moment!r} is not one of {', '.join(MOMENTS)}")
        wanted |= {(role, m) for m in ([moment] if moment else MOMENTS)}
    return [(f, r, m) for f in faults for r in ROLES for m in MOMENTS if (r, m) in wanted]


def summarize(report: BenchReport, cells: list[dict[str, Any]]) -> None:
    ran = [c for c in cells if c.get("exit_after_fault_s") is not None]
    resumed = [c for c in ran if "resume" in c]
    report.add_ratio("cells_run", len(ran))
    report.add_ratio("cells_hit", sum(bool(c["hit"]) for c in ran))
    report.add_target("diagnosed_share", sum(c["diagnosed"] for c in ran) / max(1, len(ran)),
                      1.0, ">=")  # fmt: skip
    report.add_target("orphans", sum(len(c["orphans"]) for c in ran), 0, "<=")
    report.add_target("corrupt_checkpoints",
                      sum(len(c["checkpoints"]["corrupt"]) for c in ran), 0, "<=")  # fmt: skip
    if resumed:
        report.add_target("resume_right_round_share",
                          sum(c["resume"]["ok"] for c in resumed) / len(resumed), 1.0, ">=")  # fmt: skip
    if ran:
        report.add_ratio("max_exit_after_fault_s", max(c["exit_after_fault_s"] for c in ran))
        printed = [c["diagnosis_after_fault_s"] for c in ran if c.get("diagnosis_after_fault_s")]
        if printed:
            report.add_ratio("max_diagnosis_after_fault_s", max(printed))


def main(argv: list[str] | None = None) -> int:
    parser = bench_arg_parser(__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="ROLE[:MOMENT],... (default: every cell)")
    parser.add_argument("--faults", default=",".join(FAULTS), help="kill,freeze")
    parser.add_argument("--work-dir", type=Path, default=Path("outputs/faults"),
                        help="where each cell's run folder goes (one sub-folder per cell)")  # fmt: skip
    parser.add_argument("--no-resume", action="store_true", help="skip the resumed runs")
    args = parser.parse_args(argv)
    try:
        cells_wanted = select([s for s in args.only.split(",") if s],
                              [s for s in args.faults.split(",") if s])  # fmt: skip
    except ValueError as exc:
        parser.error(str(exc))
    work_dir = args.work_dir / time.strftime("%Y%m%d-%H%M%S")
    report = BenchReport("fault_matrix", config={
        "overrides": CONFIG, "timeout_s": TIMEOUT_S, "bound_s": TIMEOUT_S + SLACK_S,
        "victims": VICTIM, "work_dir": str(work_dir), "resume": not args.no_resume,
        "cells": [list(c) for c in cells_wanted],
    })  # fmt: skip
    cells = []
    for fault, role, moment in cells_wanted:
        cell = run_cell(fault, role, moment, work_dir=work_dir, resume=not args.no_resume)
        cells.append(cell)
        report.add_result(**cell)
        print(cell_line(cell), flush=True)
    summarize(report, cells)
    report.write(args.out)
    return report.exit_code(require_quiet=args.require_quiet)


if __name__ == "__main__":
    leave(main())
