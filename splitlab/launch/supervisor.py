"""Run a group of child processes as one job: stream their logs, stop at the root cause.

The launcher turns a config into node specs and hands their command lines here. The
supervisor prefixes every child's output lines with its name, keeps each child's last lines,
and when any child exits non-zero it terminates the others (SIGTERM, then SIGKILL after a
grace period) and reports the root cause, with its exit code and last log lines.

The first process to exit is often not the cause: a coordinator relaying an abort exits 8
before the node that failed has finished exiting, and peers see a lost connection. So exits are
ranked (`cause_rank`: a cause, then a lost peer or timeout, then a relayed abort), and after a
failure that is not a cause the group keeps running for `cause_grace_s` to let the cause's own
exit arrive; `root_cause` picks the earliest exit of the best rank (pure, tested exhaustively).
When that cause only timed out or lost a peer, the children still running after the grace are
named as possibly hung: a frozen node logs nothing, its peers only see their waits run out.

Local node commands (`python -m splitlab.node ...` with a log file) are forked from a zygote
that imported torch and transformers once (`splitlab.launch.zygote`); the rest are started as
their own interpreters. Either way a child is its own session leader with its own log.

SIGTERM and SIGINT to the supervisor are handled alike: every child is torn down and the result
names the signal, with exit code 128 + its number, like a shell. Children are always torn
down, whatever happens to the supervisor.

    python -m pytest tests/unit/test_launch_supervisor.py -q
"""

from __future__ import annotations

import collections
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import IO, Any

from splitlab.errors import ExitCode
from splitlab.launch.zygote import ForkedNode, Zygotes

log = logging.getLogger(__name__)

SUPERVISOR = "supervisor"  # the name a group timeout or a signal is reported under
LAUNCHER_PID_ENV = "SPLITLAB_LAUNCHER_PID"  # a child's supervisor (`die_with_launcher`)
FOLLOW_POLL_S = 0.02  # how often a child's log file is read for new lines


@dataclass(frozen=True)
class ChildSpec:
    """One process: its display name, argv, extra environment and optional log file (the
    child writes its output there itself; see `_Child`)."""

    name: str
    argv: Sequence[str]
    env: Mapping[str, str] = field(default_factory=dict)
    log_path: Path | None = None


@dataclass
class ChildResult:
    name: str
    exit_code: int | None  # None: still running when torn down
    last_lines: list[str]
    killed: bool = False  # torn down by the supervisor, not exited by itself


@dataclass
class GroupResult:
    exit_code: int  # 0 when every child exited 0; else the root cause's code
    first_failure: str | None  # the root cause: a child's name, or SUPERVISOR
    children: dict[str, ChildResult]

    def diagnosis(self) -> str:
        if self.first_failure is None:
            return "all processes exited 0"
        child = self.children[self.first_failure]
        if child.name == SUPERVISOR:
            text = f"{SUPERVISOR} stopped the group with exit code {child.exit_code}: "
            text += "; ".join(child.last_lines)
        else:
            tail = "\n    ".join(child.last_lines[-10:]) or "(no output)"
            text = (
                f"{child.name} failed first with exit code {child.exit_code} "
                f"({exit_meaning(child.exit_code)}); its last lines:\n    {tail}"
            )
        others = [
            f"{c.name} (exit {c.exit_code}, {exit_meaning(c.exit_code)})"
            for c in self.children.values()
            if c.name not in (child.name, SUPERVISOR) and not c.killed and c.exit_code
        ]
        if others:
            text += "\n  also failed (consequences): " + ", ".join(others)
        torn_down = [c.name for c in self.children.values() if c.killed]
        if torn_down and child.name != SUPERVISOR and cause_rank(child.exit_code or 0) == 1:
            # the cause only timed out or lost a peer, and these were still running a grace
            # later: a hung node shows up here, not in any log line
            text += "\n  still running after the others failed (hung?), torn down: "
            text += ", ".join(torn_down)
        elif torn_down:
            text += "\n  torn down: " + ", ".join(torn_down)
        return text


def shell_code(returncode: int) -> int:
    """A child's return code as a shell reports it: death by signal N is 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


def exit_meaning(code: int | None) -> str:
    if code is None:
        return "still running"
    code = shell_code(code)
    if code > 128:
        try:
            return f"killed by {signal.Signals(code - 128).name}"
        except ValueError:
            return f"killed by signal {code - 128}"
    try:
        return ExitCode(code).name.lower()
    except ValueError:
        return "unclassified"


def cause_rank(code: int) -> int | None:
    """How much an exit looks like the root cause: 0 a cause (bad config, NaN, a crash, a
    death by signal, ...), 1 a lost peer or a timeout (often the symptom of another failure),
    2 a relayed abort (always a consequence); None for a clean exit."""
    code = shell_code(code)
    if code == ExitCode.OK:
        return None
    if code == ExitCode.ABORTED:
        return 2
    if code in (ExitCode.PEER_LOST, ExitCode.TIMEOUT):
        return 1
    return 0


def root_cause(exits: Sequence[tuple[str, int]]) -> str | None:
    """The root cause among `(name, exit code)` pairs in the order their exits were seen: the
    earliest of the best `cause_rank`; None when none failed."""
    failed = [
        (rank, order, name)
        for order, (name, code) in enumerate(exits)
        if (rank := cause_rank(code)) is not None
    ]
    return min(failed)[2] if failed else None


class _Child:
    """One started child and the thread that reads its output line by line.

    A child with a `log_path` writes its stdout and stderr into that file itself (its own
    descriptor, appended), and the reader follows the file: whatever a node wrote is on disk
    even when the supervisor dies with it (SIGKILL). Without one, the output comes over a pipe,
    whose write end goes to the zygote when the child forks from one.
    """

    def __init__(
        self, spec: ChildSpec, sink: IO[str] | None, tail_lines: int, zygotes: Zygotes
    ) -> None:
        self.spec = spec
        env = {
            **os.environ,
            **spec.env,
            "PYTHONUNBUFFERED": "1",
            LAUNCHER_PID_ENV: str(os.getpid()),
        }
        self._offset = 0
        self._pipe: IO[bytes] | None = None  # the read end of a forked child's output pipe
        if spec.log_path is not None:
            out: Any = open(spec.log_path, "ab")  # noqa: SIM115 - the child keeps its own copy
            self._offset = out.tell()
            try:
                forked = zygotes.spawn(spec.argv, env, out.fileno())
                self.proc: subprocess.Popen[bytes] | ForkedNode = forked or self._popen(env, out)
            finally:
                out.close()
        else:
            read, write = os.pipe()
            try:
                forked = zygotes.spawn(spec.argv, env, write)
            finally:
                os.close(write)  # the child holds the only write end: EOF when it is gone
            if forked is None:
                os.close(read)
                self.proc = self._popen(env, subprocess.PIPE)
            else:
                self.proc = forked
                self._pipe = os.fdopen(read, "rb")
        self.lines: collections.deque[str] = collections.deque(maxlen=tail_lines)
        self.spoke = threading.Event()  # its first line arrived: it is up (imports done)
        self.killed = False
        self._sink = sink
        target = self._follow if spec.log_path is not None else self._pump
        self.reader = threading.Thread(target=target, name=f"log-{spec.name}", daemon=True)
        self.reader.start()

    def _popen(self, env: dict[str, str], out: Any) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            list(self.spec.argv),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,  # its own process group: teardown reaches grandchildren
        )

    def _line(self, raw: bytes) -> None:
        line = raw.decode("utf-8", errors="replace").rstrip("\r")
        self.spoke.set()
        self.lines.append(line)
        if self._sink is not None:
            self._sink.write(f"{self.spec.name:>12} | {line}\n")
            self._sink.flush()

    def _pump(self) -> None:
        stream = self._pipe or self.proc.stdout
        assert stream is not None
        with stream:
            for raw in stream:
                self._line(raw.rstrip(b"\n"))

    def _follow(self) -> None:
        """Read the child's log file from where it started, until the child has exited and
        the file holds nothing more."""
        assert self.spec.log_path is not None
        pending = b""
        with open(self.spec.log_path, "rb") as f:
            f.seek(self._offset)
            while True:
                chunk = f.read(1 << 16)
                if chunk:
                    *lines, pending = (pending + chunk).split(b"\n")
                    for raw in lines:
                        self._line(raw)
                    continue
                if self.proc.poll() is not None:
                    chunk = f.read()  # written between the last read and the exit
                    if not chunk:
                        break
                    pending += chunk
                    continue
                time.sleep(FOLLOW_POLL_S)
        if pending:
            self._line(pending)

    def signal_group(self, sig: int) -> None:
        if self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_launcher() -> None:
    """Called first thing in a node: when the supervisor named in `$SPLITLAB_LAUNCHER_PID` is
    this process's parent, have the kernel send this process SIGTERM when that parent dies,
    however it dies (Linux `PR_SET_PDEATHSIG`; SIGKILL included). A launcher killed outright
    used to leave its nodes running unsupervised (over RabbitMQ they trained on, their output
    lost); now they go with it, and their log files (`_Child`) keep every line they wrote.
    A process whose parent is not that supervisor (started by hand, or by a tool) is left as
    it is."""
    pid = os.environ.get(LAUNCHER_PID_ENV, "")
    if not pid.isdigit() or os.getppid() != int(pid) or not sys.platform.startswith("linux"):
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
        log.warning("cannot tie this node to its launcher (prctl: errno %d)", ctypes.get_errno())
        return
    if os.getppid() != int(pid):  # the launcher died before the signal was armed
        os.kill(os.getpid(), signal.SIGTERM)


def run_group(
    specs: Sequence[ChildSpec],
    *,
    timeout_s: float | None = None,
    grace_s: float = 5.0,
    sink: IO[str] | None = sys.stderr,
    tail_lines: int = 40,
    poll_s: float = 0.05,
    cause_grace_s: float = 5.0,
    when_up: Callable[[], object] | None = None,
    zygotes: Zygotes | None = None,
) -> GroupResult:
    """Start every child, wait for all to exit 0 or for the root cause, tear down the rest.

    Args:
        specs: the children, started in order.
        timeout_s: wall-clock bound for the whole group; on expiry every child is torn down
            and the result carries exit code 4 (timeout) naming the group.
        grace_s: seconds between SIGTERM and SIGKILL during teardown.
        sink: where prefixed child output goes (None: only kept in memory / log files).
        cause_grace_s: after a failure that is not a cause (`cause_rank` > 0), how long the
            others keep running so that a root cause still exiting is seen.
        when_up: called once, from this thread, when every child has printed its first line
            (a node logs nothing before its imports are done): work for the caller's process
            that should not compete with the children's start.
        zygotes: where local node commands fork from; the caller's, kept open for a later
            group (the final evaluation), or by default the group's own, closed at the end.
    """
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"child names must be unique: {names}")
    children: list[_Child] = []
    exits: list[tuple[str, int]] = []  # (name, shell exit code) in the order seen
    first_failure: str | None = None
    exit_code = 0
    supervisor_line = ""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    failed_at: float | None = None
    received: list[int] = []
    previous = _catch_signals(received)
    own_zygotes = zygotes is None
    if zygotes is None:
        zygotes = Zygotes([s.argv for s in specs], pid_env=LAUNCHER_PID_ENV)
    else:
        zygotes.plan([s.argv for s in specs])
    try:
        for spec in specs:
            children.append(_Child(spec, sink, tail_lines, zygotes))
        while True:
            if when_up is not None and all(c.spoke.is_set() for c in children):
                when_up()
                when_up = None
            seen = {name for name, _ in exits}
            exits += [
                (c.spec.name, shell_code(c.proc.returncode))
                for c in children
                if c.spec.name not in seen and c.proc.poll() is not None
            ]
            now = time.monotonic()
            running = len(exits) < len(children)
            cause = root_cause(exits)
            if received:
                sig = signal.Signals(received[0])
                first_failure, exit_code = SUPERVISOR, 128 + sig
                supervisor_line = f"received {sig.name}"
                log.error("received %s, tearing every process down", sig.name)
                break
            if cause is not None:
                failed_at = now if failed_at is None else failed_at
                if cause_rank(dict(exits)[cause]) == 0 or not running:
                    break
                if now - failed_at >= cause_grace_s:
                    break
            elif not running:
                break
            if deadline is not None and now > deadline:
                if cause is None:
                    first_failure, exit_code = SUPERVISOR, int(ExitCode.TIMEOUT)
                    supervisor_line = f"timed out after {timeout_s} s"
                    log.error("process group timed out after %.1f s", timeout_s)
                break
            time.sleep(poll_s)
        if first_failure is None and cause is not None:
            first_failure, exit_code = cause, dict(exits)[cause]
    finally:
        try:
            _teardown(children, grace_s)
        finally:
            if own_zygotes:
                zygotes.close()
            _restore_signals(previous)
    results = {
        c.spec.name: ChildResult(c.spec.name, c.proc.returncode, list(c.lines), c.killed)
        for c in children
    }
    if first_failure == SUPERVISOR:
        results[SUPERVISOR] = ChildResult(SUPERVISOR, exit_code, [supervisor_line])
    return GroupResult(exit_code=exit_code, first_failure=first_failure, children=results)


_Handlers = dict[signal.Signals, Callable[[int, FrameType | None], Any] | int | None]


def _catch_signals(received: list[int]) -> _Handlers:
    """SIGTERM and SIGINT only record themselves: the loop stops and tears down (main thread
    only; elsewhere Python cannot install handlers and the caller's stay)."""
    if threading.current_thread() is not threading.main_thread():
        return {}

    def record(signum: int, frame: FrameType | None) -> None:
        received.append(signum)

    return {sig: signal.signal(sig, record) for sig in (signal.SIGTERM, signal.SIGINT)}


def _restore_signals(previous: _Handlers) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)


def _teardown(children: list[_Child], grace_s: float) -> None:
    alive = [c for c in children if c.proc.poll() is None]
    for child in alive:
        child.killed = True
        child.signal_group(signal.SIGTERM)
        child.signal_group(signal.SIGCONT)  # a stopped child acts on its SIGTERM only once resumed
    deadline = time.monotonic() + grace_s
    for child in alive:
        try:
            child.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.signal_group(signal.SIGKILL)
            child.proc.wait(timeout=10)
    for child in children:
        child.reader.join(timeout=5)
