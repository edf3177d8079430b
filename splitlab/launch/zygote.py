"""Start a job's node processes by forking one interpreter that imported torch once.

A node process spends ~3-6 s of CPU importing torch and transformers before it does anything
(`python -c "import splitlab.train.roles"`: 6.0-6.7 s wall, 5.5 s CPU on 2 loaded cores), and
a job starts one per node: the main job's four nodes spent ~10 s on 2 cores before the first
of them ran, and the test suite's ~220 node starts ~1,000 CPU-s. The zygote imports what the
job's roles need once (`preload`), never computes, and forks a node per request; each child
sets its own environment, threads and output, and runs `splitlab.node`'s `main` as
`python -m splitlab.node` would.

What a forked node keeps from a started one:
- Its command line: the child rewrites its argv area (`retitle`), so `ps`, `pgrep -f` and
  `tools/fault_matrix.py` see `python -m splitlab.node --config ... --role ...`. The zygote is
  started with `TITLE_ROOM` bytes of room for it.
- Its environment: `os.environ` is the node's own. Only `POST_FORK_KEYS` and `SPLITLAB_*`
  may differ between the zygote and its children (nothing reads them at import); children
  whose other variables differ get a zygote of their own (`import_env`). OpenMP reads
  `OMP_NUM_THREADS`, `OMP_WAIT_POLICY` and `GOMP_SPINCOUNT` when torch loads it, so the wait
  policy is part of the zygote's environment and the thread count is applied with
  `torch.set_num_threads`.
- Its signals and exit: it is its own session leader, as a started node is; its exit status
  reaches the supervisor through the zygote (`ForkedNode`, a `Popen` look-alike). It dies
  with the zygote (`die_with_launcher`, `$SPLITLAB_LAUNCHER_PID` naming the zygote), and the
  zygote dies with the supervisor, so a launcher killed outright still takes its nodes along.

Only plain local node commands (`sys.executable -m splitlab.node ...`) are forked; testbed
nodes (`ip netns exec ...`) and anything else are started as before, and so is everything
when the zygote cannot start (its error is logged). `SPLITLAB_FORK_NODES=0` turns it off.

A process that launches again keeps its zygotes (`KEEP` of them, the most recently used): a
later group whose import environment matches, and whose roles' modules one of them has
imported, forks from it instead of paying the imports again (Hydra multirun's jobs in one
process, a test worker's runs). A zygote started with 4 s of CPU is otherwise spent on one
run: `tests/integration/test_finetune_task.py` started 7 of them for 5 tests (~27 of its ~82
CPU-s). Only launches from the main thread keep theirs, since the parent-death signal that
ties a zygote to its launcher fires when the thread that started it ends; a forked copy of
the process starts with none. A kept zygote exits with its process.

    .venv/bin/pytest tests/unit/test_launch_zygote.py -q
"""

from __future__ import annotations

import collections
import json
import logging
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

from splitlab.telemetry.host_load import parse_proc_stat

log = logging.getLogger(__name__)

NODE_MODULE = "splitlab.node"
FORK_ENV = "SPLITLAB_FORK_NODES"  # "0": start every node as its own interpreter
# Read at run time only, so they may differ between a zygote and its children: the thread
# count, every SPLITLAB_* variable, and the name of the running test that pytest keeps in
# PYTEST_CURRENT_TEST (a test worker's launches would otherwise never share a kept zygote).
POST_FORK_KEYS = ("OMP_NUM_THREADS", "PYTEST_CURRENT_TEST")
# what a role imports; other roles: ROLE_DEFAULT
ROLE_MODULES = {"stage": "splitlab.infer.stage", "evaluator": "splitlab.train.final_eval"}
EVERY_NODE = (NODE_MODULE, "splitlab.configure")  # the node, and what reads its config
ROLE_DEFAULT = "splitlab.train.roles"
# A stage with a model (no `--echo`) also imports the shard loader: ~2 s of transformers
# imports per stage, paid once in the zygote instead. A model-free stage never imports it.
MODEL_STAGE_MODULE = "splitlab.models.shard"
KEEP = 3  # zygotes a process keeps for later groups, ~0.3 GB resident each (module docstring)
TITLE_ROOM = 4096  # bytes of argv area a child can write its own command line into
READY_TIMEOUT_S = 120.0  # the preload on a loaded host; longer means the zygote is stuck
MESSAGE_BYTES = 1 << 20


def enabled(env: Mapping[str, str] = os.environ) -> bool:
    return sys.platform.startswith("linux") and env.get(FORK_ENV, "1") != "0"


def forkable(argv: Sequence[str]) -> bool:
    """Whether `argv` is a plain local node command that a zygote can run."""
    return list(argv[:3]) == [sys.executable, "-m", NODE_MODULE]


def import_env(env: Mapping[str, str]) -> dict[str, str]:
    """The part of a child's environment its zygote must have had when it imported: all but
    `POST_FORK_KEYS` and `SPLITLAB_*`. Children with equal import environments share one."""
    return {
        k: v for k, v in env.items() if k not in POST_FORK_KEYS and not k.startswith("SPLITLAB_")
    }


def preload(argvs: Sequence[Sequence[str]]) -> list[str]:
    """The modules the nodes `argvs` import for their roles (`--role`), in a stable order."""
    modules = set(EVERY_NODE)
    for argv in argvs:
        role = argv[argv.index("--role") + 1] if "--role" in argv[:-1] else ""
        modules.add(ROLE_MODULES.get(role, ROLE_DEFAULT))
        if role == "stage" and "--echo" not in argv:
            modules.add(MODEL_STAGE_MODULE)
    return sorted(modules)


# --- the supervisor's side ---------------------------------------------------------------


class ForkedNode:
    """A node forked by a zygote, seen through what `subprocess.Popen` offers the supervisor:
    `pid`, `poll`, `wait` and `returncode`. The exit status arrives on `reply`, the node's own
    socket to the zygote; if the zygote vanishes first, the node has been sent SIGTERM with it
    (its parent-death signal), and that is the status reported once the node is gone.
    Thread-safe: the supervisor's loop and a child's log reader both poll."""

    stdout = None

    def __init__(self, argv: Sequence[str], pid: int, reply: socket.socket) -> None:
        self.args = list(argv)
        self.pid = pid
        self.returncode: int | None = None
        self._reply = reply
        self._zygote_gone = False
        self._lock = threading.Lock()

    def poll(self) -> int | None:
        if self.returncode is None:
            self._read(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            self._read(0.1 if left is None else min(0.1, left))
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # as Popen: never signal a pid that may have been reused
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _read(self, timeout: float) -> None:
        with self._lock:  # the supervisor's loop and the log reader both poll
            if self.returncode is None:
                self._read_locked(timeout)

    def _read_locked(self, timeout: float) -> None:
        if self._zygote_gone:
            if not _alive(self.pid):
                self.returncode = -signal.SIGTERM
            else:
                time.sleep(timeout)
            return
        if not select.select([self._reply], [], [], timeout)[0]:
            return
        data = self._reply.recv(MESSAGE_BYTES)
        if not data:
            self._zygote_gone = True
            return
        self.returncode = int(json.loads(data)["returncode"])
        self._reply.close()


def _alive(pid: int) -> bool:
    """True while `pid` runs; a zombie its new parent has yet to reap counts as gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return parse_proc_stat(stat)[2] != "Z"


class Zygote:
    """One zygote process and the control socket requests go over (`spawn`). `start` waits
    until it has imported `modules`; after `release` it exits once its children have, and
    `close` waits for that."""

    def __init__(self, proc: subprocess.Popen[bytes], control: socket.socket) -> None:
        self.proc = proc
        self.pid = proc.pid
        self._control = control

    @classmethod
    def start(cls, env: Mapping[str, str], modules: Sequence[str], *, pid_env: str) -> Zygote:
        """Start a zygote with environment `env` (`pid_env` naming this process: it dies with
        it) and wait until it has imported `modules`."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        argv = [sys.executable, "-m", __name__, str(theirs.fileno()), *modules, " " * TITLE_ROOM]
        try:
            proc = subprocess.Popen(
                argv,
                env={**env, "PYTHONUNBUFFERED": "1", pid_env: str(os.getpid())},
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                pass_fds=[theirs.fileno()],
                start_new_session=True,  # the terminal's Ctrl-C goes to the supervisor only
            )
        finally:
            theirs.close()
        zygote = cls(proc, ours)
        if not select.select([ours], [], [], READY_TIMEOUT_S)[0]:
            zygote.kill()
            raise RuntimeError(f"still importing {', '.join(modules)} after {READY_TIMEOUT_S} s")
        answer = json.loads(ours.recv(MESSAGE_BYTES) or b'{"error": "exited while importing"}')
        if "error" in answer:
            zygote.kill()
            raise RuntimeError(answer["error"])
        return zygote

    def spawn(
        self, argv: Sequence[str], env: Mapping[str, str], output: int, cwd: str | None = None
    ) -> ForkedNode:
        """Fork node `argv` with environment `env`, writing its stdout and stderr to the
        descriptor `output`."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        request = {"argv": list(argv), "env": dict(env), "cwd": cwd or os.getcwd()}
        try:
            socket.send_fds(
                self._control, [json.dumps(request).encode()], [output, theirs.fileno()]
            )
        finally:
            theirs.close()
        if not select.select([ours], [], [], READY_TIMEOUT_S)[0]:
            ours.close()
            raise RuntimeError("the zygote did not answer a fork request")
        answer = json.loads(ours.recv(MESSAGE_BYTES) or b'{"error": "the zygote exited"}')
        if "error" in answer:
            ours.close()
            raise RuntimeError(answer["error"])
        return ForkedNode(argv, int(answer["pid"]), ours)

    def release(self) -> None:
        """No more requests: the zygote exits once its children have."""
        self._control.close()

    def close(self, timeout_s: float = 10.0) -> None:
        """`release`, then wait `timeout_s` for the zygote to exit, or kill it."""
        self.release()
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        self._control.close()
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


# (pid_env, import environment as JSON, preloaded modules) -> a zygote this process keeps
_kept: collections.OrderedDict[tuple[str, str, frozenset[str]], Zygote] = collections.OrderedDict()


def _let_go_in_child() -> None:
    """In a forked copy of this process: close its copies of the kept zygotes' control
    sockets and forget them, so that the parent's release still ends them (a zygote exits
    when no copy of its control socket is left open)."""
    for zygote in _kept.values():
        zygote.release()
    _kept.clear()


os.register_at_fork(after_in_child=_let_go_in_child)


def _keeping() -> bool:
    return threading.current_thread() is threading.main_thread()


def _kept_zygote(pid_env: str, key: str, modules: Sequence[str]) -> Zygote | None:
    """A live kept zygote of this import environment that has imported `modules`."""
    for entry, zygote in reversed(list(_kept.items())):
        if zygote.proc.poll() is not None:
            del _kept[entry]
        elif entry[:2] == (pid_env, key) and entry[2].issuperset(modules):
            _kept.move_to_end(entry)
            return zygote
    return None


def _keep(pid_env: str, key: str, modules: Sequence[str], zygote: Zygote) -> None:
    _kept[(pid_env, key, frozenset(modules))] = zygote
    while len(_kept) > KEEP:
        _kept.popitem(last=False)[1].release()  # it exits once its children have


def _forget(zygote: Zygote) -> None:
    for entry in [e for e, z in _kept.items() if z is zygote]:
        del _kept[entry]


def release_kept() -> None:
    """Let every kept zygote go: each exits once its children have."""
    while _kept:
        _kept.popitem()[1].release()


class Zygotes:
    """The zygotes of one process group, started on its first forkable child: one per import
    environment (`import_env`), each preloading what all of the group's roles import, or a
    kept one that did (see module docstring). After a zygote fails, the rest of the group is
    started as before."""

    def __init__(self, argvs: Sequence[Sequence[str]], *, pid_env: str) -> None:
        self._argvs = [list(a) for a in argvs if forkable(a)]
        self._pid_env = pid_env
        self._zygotes: dict[str, Zygote] = {}
        self._kept_keys: set[str] = set()  # keys whose zygote outlives this group
        self._failed = not enabled()

    def plan(self, argvs: Sequence[Sequence[str]]) -> None:
        """Add what `argvs` import to the preload of zygotes not yet started (a caller's pool
        handed to a group: its zygote serves this group and the caller's later ones)."""
        self._argvs += [list(a) for a in argvs if forkable(a)]

    def spawn(self, argv: Sequence[str], env: Mapping[str, str], output: int) -> ForkedNode | None:
        """Fork node `argv` (full environment `env`, output to descriptor `output`), or None
        when it must be started as its own interpreter."""
        if self._failed or not forkable(argv):
            return None
        key = json.dumps(import_env(env), sort_keys=True)
        zygote = self._zygotes.get(key)
        try:
            if zygote is None:
                zygote = self._zygotes[key] = self._start(key, import_env(env))
            return zygote.spawn(argv, {**env, self._pid_env: str(zygote.pid)}, output)
        except (OSError, RuntimeError, ValueError) as exc:
            log.warning("starting nodes as their own interpreters: the zygote failed: %s", exc)
            if zygote is not None:
                _forget(zygote)
            self._failed = True
            return None

    def _start(self, key: str, env: Mapping[str, str]) -> Zygote:
        modules = preload(self._argvs)
        if not _keeping():
            return Zygote.start(env, modules, pid_env=self._pid_env)
        zygote = _kept_zygote(self._pid_env, key, modules)
        if zygote is None:
            zygote = Zygote.start(env, modules, pid_env=self._pid_env)
            _keep(self._pid_env, key, modules, zygote)
        self._kept_keys.add(key)
        return zygote

    def close(self) -> None:
        """Wait for every zygote not kept to exit (their children have, or they are killed)."""
        for key, zygote in self._zygotes.items():
            if key not in self._kept_keys:
                zygote.close()
        self._zygotes.clear()

    def release(self) -> None:
        """No more forks: each zygote not kept exits by itself once its children have."""
        for key, zygote in self._zygotes.items():
            if key not in self._kept_keys:
                zygote.release()
        self._zygotes.clear()


# --- the zygote's side -------------------------------------------------------------------


def retitle(argv: Sequence[str]) -> bool:
    """Make `/proc/self/cmdline` read `argv`, by writing it over this process's argv area
    (Linux; what `setproctitle` does for C programs): Python keeps its own copy of the
    arguments, nothing else reads that memory. False when it does not fit."""
    stat = Path("/proc/self/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()  # fields from the 3rd (state) on
    start, end = int(fields[47 - 2]), int(fields[48 - 2])  # arg_start, arg_end: 48th, 49th
    title = "\0".join(argv).encode() + b"\0"
    if len(title) > end - start:
        return False
    with open("/proc/self/mem", "r+b", buffering=0) as mem:
        mem.seek(start)
        mem.write(title.ljust(end - start, b"\0"))
    return True


def serve(control: socket.socket) -> tuple[dict[str, Any], list[int]] | None:
    """Fork a child per request until the control socket closes and every child has been
    reaped. Returns None in the zygote; in a forked child, its request and descriptors."""
    children: dict[int, socket.socket] = {}
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    open_ = True
    while True:
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            reply = children.pop(pid, None)
            if reply is not None:
                code = os.waitstatus_to_exitcode(status)
                _send(reply, {"returncode": code})
                reply.close()
        if not open_ and not children:
            return None
        watched = [wake_r, control] if open_ else [wake_r]
        ready = select.select(watched, [], [], 1.0)[0]
        if wake_r in ready:
            while True:
                try:
                    if not os.read(wake_r, 512):
                        break
                except BlockingIOError:
                    break
        if control not in ready:
            continue
        message, fds, _, _ = socket.recv_fds(control, MESSAGE_BYTES, 2)
        if not message:
            open_ = False
            continue
        request = json.loads(message)
        reply = socket.socket(fileno=fds[1])
        try:
            pid = os.fork()
        except OSError as exc:
            _send(reply, {"error": f"fork: {exc}"})
            reply.close()
            os.close(fds[0])
            continue
        if pid == 0:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for other in (*children.values(), control, reply):
                other.close()
            os.close(wake_r)
            os.close(wake_w)
            return request, [fds[0]]
        os.close(fds[0])
        children[pid] = reply
        _send(reply, {"pid": pid})


def _send(sock: socket.socket, message: dict[str, Any]) -> None:
    try:
        sock.send(json.dumps(message).encode())
    except OSError:  # the supervisor has gone: nobody waits for this answer
        pass


def become_node(request: dict[str, Any], output: int) -> NoReturn:
    """In a forked child: take on the request's session, output, directory, environment,
    threads and command line, then run its `python -m MODULE ARGS...` as the interpreter
    would (`runpy`); never returns."""
    from splitlab.telemetry.log import exit_now

    os.setsid()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(output, 1)
    os.dup2(output, 2)
    os.close(devnull)
    os.close(output)
    argv = request["argv"]
    try:
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        threads = os.environ.get("OMP_NUM_THREADS", "")
        if threads.isdigit() and int(threads) > 0 and "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(int(threads))
        retitle(argv)
        sys.argv = [argv[2], *argv[3:]]  # runpy puts the module's path first
        sys.modules.pop(argv[2], None)  # as under `python -m`: only __main__ runs it
        runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    exit_now(code)


def main(argv: list[str]) -> None:
    """`python -m splitlab.launch.zygote FD MODULE... ROOM`: import the modules, say ready on
    the control socket FD, serve it."""
    from splitlab.launch.supervisor import die_with_launcher
    from splitlab.telemetry.log import exit_now

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_launcher()
    control = socket.socket(fileno=int(argv[0]))
    try:
        for module in argv[1:-1]:
            __import__(module)
    except BaseException:
        _send(control, {"error": traceback.format_exc(limit=4)})
        sys.exit(1)
    _send(control, {"ready": True})
    child = serve(control)
    if child is None:  # every child reaped: skip tearing down the preloaded torch (~1.4 s)
        exit_now(0)
    request, (output,) = child
    become_node(request, output)


if __name__ == "__main__":
    main(sys.argv[1:])
