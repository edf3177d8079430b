"""The zygote: nodes forked from one interpreter that imported once (`splitlab.launch.zygote`).

Real processes: a zygote preloading a cheap module forks a probe module written here, which
reports what a started node would see (environment, threads, session, command line)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from splitlab.launch import zygote as zy
from splitlab.launch.supervisor import LAUNCHER_PID_ENV, ChildSpec, run_group

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux fork/proc")

PROBE = textwrap.dedent(
    """
    import json, os, sys, time


    def report():
        from splitlab.launch.supervisor import die_with_launcher

        die_with_launcher()
        threads = sys.modules["torch"].get_num_threads() if "torch" in sys.modules else None
        cmdline = open("/proc/self/cmdline", "rb").read().split(b"\\0")
        print(json.dumps({
            "argv": sys.argv[1:], "name": __name__, "marker": os.environ.get("PROBE_MARKER"),
            "omp": os.environ.get("OMP_NUM_THREADS"), "threads": threads, "cwd": os.getcwd(),
            "sid": os.getsid(0), "pid": os.getpid(), "ppid": os.getppid(),
            "cmdline": [a.decode() for a in cmdline if a],
        }), flush=True)
        if "--sleep" in sys.argv:
            time.sleep(60)
        sys.exit(int(sys.argv[sys.argv.index("--exit") + 1]) if "--exit" in sys.argv else 0)


    if __name__ == "__main__":
        report()
    """
)


@pytest.fixture
def probe_env(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "zprobe").mkdir()  # a package: runpy warns about a preloaded submodule
    (tmp_path / "zprobe" / "__init__.py").write_text("")
    (tmp_path / "zprobe" / "main.py").write_text(PROBE)
    root = str(Path(__file__).resolve().parents[2])
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), root])}


def _spawn(z: zy.Zygote, env: dict[str, str], out: Path, *args: str, **extra: str):
    argv = [sys.executable, "-m", "zprobe.main", *args]
    with open(out, "ab") as f:
        return z.spawn(
            argv, {**env, LAUNCHER_PID_ENV: str(z.pid), **extra}, f.fileno(), str(out.parent)
        )


def _report(out: Path) -> dict:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        text = out.read_text()
        if text.strip():
            return json.loads(text.splitlines()[0])
        time.sleep(0.02)
    raise AssertionError(f"no report in {out}")


def test_pure_helpers() -> None:
    node = [sys.executable, "-m", "splitlab.node", "--config", "c.yaml", "--role"]
    assert zy.forkable([*node, "owner"])
    assert not zy.forkable(["ip", "netns", "exec", "h1", *node, "owner"])
    assert not zy.forkable([sys.executable, "-c", "pass"])
    env = {
        "A": "1",
        "OMP_NUM_THREADS": "2",
        "PYTEST_CURRENT_TEST": "tests/x.py::test_y (call)",
        "SPLITLAB_NODE_KEY": "ab",
        "OMP_WAIT_POLICY": "PASSIVE",
    }
    assert zy.import_env(env) == {"A": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    assert zy.preload([[*node, "stage"], [*node, "owner"], [*node, "worker"]]) == [
        "splitlab.configure", "splitlab.infer.stage", "splitlab.models.shard", "splitlab.node",
        "splitlab.train.roles",
    ]  # fmt: skip
    assert zy.preload([[*node, "stage", "--echo"]]) == [  # model-free: no shard loader
        "splitlab.configure", "splitlab.infer.stage", "splitlab.node",
    ]  # fmt: skip
    assert not zy.enabled({zy.FORK_ENV: "0"})


def test_fork_gets_its_own_env_threads_session_and_title(tmp_path, probe_env) -> None:
    z = zy.Zygote.start(probe_env, ["torch", "zprobe.main"], pid_env=LAUNCHER_PID_ENV)
    try:
        a = _spawn(z, probe_env, tmp_path / "a.log", "--x", "1", "--exit", "3",
                   PROBE_MARKER="alpha", OMP_NUM_THREADS="1")  # fmt: skip
        b = _spawn(z, probe_env, tmp_path / "b.log", "--exit", "0", PROBE_MARKER="beta")
        assert a.wait(timeout=30) == 3 and b.wait(timeout=30) == 0
        ra, rb = _report(tmp_path / "a.log"), _report(tmp_path / "b.log")
    finally:
        z.close()
    assert z.proc.returncode == 0  # it exits once the control socket closes
    assert ra["name"] == "__main__" and ra["argv"] == ["--x", "1", "--exit", "3"]
    assert "RuntimeWarning" not in (tmp_path / "a.log").read_text()  # preloaded, run once
    assert (ra["marker"], rb["marker"]) == ("alpha", "beta")
    assert ra["omp"] == "1" and ra["threads"] == 1
    assert ra["sid"] == ra["pid"] and ra["ppid"] == z.pid  # its own session, the zygote's child
    assert ra["cwd"] == str(tmp_path)
    assert ra["cmdline"] == [sys.executable, "-m", "zprobe.main", "--x", "1", "--exit", "3"]


def test_kill_and_wait_timeout_are_reported(tmp_path, probe_env) -> None:
    z = zy.Zygote.start(probe_env, ["json"], pid_env=LAUNCHER_PID_ENV)
    try:
        node = _spawn(z, probe_env, tmp_path / "n.log", "--sleep")
        _report(tmp_path / "n.log")
        assert node.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            node.wait(timeout=0.2)
        errors: list[BaseException] = []

        def poll_until_exit() -> None:  # as a child's log reader does, beside the loop
            try:
                while node.poll() is None:
                    pass
            except BaseException as exc:
                errors.append(exc)

        pollers = [threading.Thread(target=poll_until_exit) for _ in range(3)]
        for t in pollers:
            t.start()
        node.kill()
        assert node.wait(timeout=10) == -signal.SIGKILL
        node.terminate()  # gone: no signal to a pid that may be reused
        for t in pollers:
            t.join(timeout=10)
        assert errors == []
    finally:
        z.close()


def test_node_dies_with_its_zygote(tmp_path, probe_env) -> None:
    """The zygote killed outright: its node gets SIGTERM (parent-death signal) and the
    supervisor's view reports that, instead of waiting forever."""
    z = zy.Zygote.start(probe_env, ["json"], pid_env=LAUNCHER_PID_ENV)
    node = _spawn(z, probe_env, tmp_path / "n.log", "--sleep")
    _report(tmp_path / "n.log")
    z.kill()
    assert node.wait(timeout=10) == -signal.SIGTERM
    assert not zy._alive(node.pid)  # gone, or a zombie its new parent has yet to reap


def test_a_zygote_that_cannot_import_names_the_module(probe_env) -> None:
    with pytest.raises(RuntimeError, match="no_such_module_here"):
        zy.Zygote.start(probe_env, ["no_such_module_here"], pid_env=LAUNCHER_PID_ENV)


def test_zygotes_fall_back_to_plain_starts(tmp_path, monkeypatch, caplog) -> None:
    monkeypatch.delenv(zy.FORK_ENV, raising=False)  # a user's own 0 would skip the failure
    node = [sys.executable, "-m", "splitlab.node", "--role", "owner"]
    assert zy.Zygotes([node], pid_env=LAUNCHER_PID_ENV).spawn(["ip", "netns"], {}, 1) is None
    monkeypatch.setattr(zy, "preload", lambda argvs: ["no_such_module_here"])
    pool = zy.Zygotes([node], pid_env=LAUNCHER_PID_ENV)
    assert pool.spawn(node, dict(os.environ), 1) is None
    assert "no_such_module_here" in caplog.text
    assert pool.spawn(node, dict(os.environ), 1) is None  # no second try
    monkeypatch.setenv(zy.FORK_ENV, "0")
    assert zy.Zygotes([node], pid_env=LAUNCHER_PID_ENV).spawn(node, {}, 1) is None


def test_retitle_rewrites_the_command_line() -> None:
    code = (
        "from splitlab.launch.zygote import retitle; "
        "print(retitle(['python', '-m', 'x', '--a', 'b']), "
        "open('/proc/self/cmdline','rb').read().rstrip(b'\\0').split(b'\\0')); "
        "print(retitle(['y' * 10000]))"
    )
    out = subprocess.run([sys.executable, "-c", code, " " * 200], capture_output=True,
                         text=True, timeout=30, check=True).stdout.splitlines()  # fmt: skip
    assert out == ["True [b'python', b'-m', b'x', b'--a', b'b']", "False"]


def test_a_released_zygote_exits_once_its_children_have(tmp_path, probe_env) -> None:
    z = zy.Zygote.start(probe_env, ["json"], pid_env=LAUNCHER_PID_ENV)
    node = _spawn(z, probe_env, tmp_path / "n.log", "--sleep")
    _report(tmp_path / "n.log")
    z.release()  # as spawn_stages leaves it: no more forks, the node still runs
    time.sleep(0.3)
    assert z.proc.poll() is None and node.poll() is None
    node.terminate()
    assert node.wait(timeout=10) == -signal.SIGTERM
    assert z.proc.wait(timeout=10) == 0


def test_a_group_without_log_files_forks_and_reads_its_nodes_over_pipes(
    tmp_path, probe_env, monkeypatch
) -> None:
    """`run_group` children with no `log_path` (the tests' process groups) fork too: each
    node's output comes over a pipe whose write end went to the zygote."""
    monkeypatch.setattr(zy, "NODE_MODULE", "zprobe.main")
    monkeypatch.setattr(zy, "preload", lambda argvs: ["json"])
    monkeypatch.delenv(zy.FORK_ENV, raising=False)
    for key, value in probe_env.items():
        monkeypatch.setenv(key, value)
    node = [sys.executable, "-m", "zprobe.main"]
    specs = [
        ChildSpec("ok", [*node, "--exit", "0"]),
        ChildSpec("bad", [*node, "--exit", "3"]),
    ]

    result = run_group(specs, timeout_s=60, sink=None)

    assert (result.exit_code, result.first_failure) == (3, "bad")
    reports = {name: json.loads(c.last_lines[0]) for name, c in result.children.items()}
    assert reports["ok"]["argv"] == ["--exit", "0"] and reports["bad"]["argv"] == ["--exit", "3"]
    assert reports["ok"]["ppid"] == reports["bad"]["ppid"] != os.getpid()  # one zygote's
    assert reports["ok"]["cmdline"] == [*node, "--exit", "0"]


def test_a_later_group_forks_from_the_kept_zygote(tmp_path, probe_env, monkeypatch) -> None:
    """A process that launches again forks from the zygote its last group started (the same
    import environment and modules); a dead one is replaced, and a group launched from
    another thread starts (and ends) a zygote of its own."""
    monkeypatch.setattr(zy, "NODE_MODULE", "zprobe.main")
    monkeypatch.setattr(zy, "preload", lambda argvs: ["json"])
    monkeypatch.delenv(zy.FORK_ENV, raising=False)
    for key, value in probe_env.items():
        monkeypatch.setenv(key, value)
    node = [sys.executable, "-m", "zprobe.main", "--exit", "0"]

    def parent_of_node() -> int:
        result = run_group([ChildSpec("n", node)], timeout_s=60, sink=None)
        assert result.exit_code == 0, result.diagnosis()
        return json.loads(result.children["n"].last_lines[0])["ppid"]

    try:
        first = parent_of_node()
        assert parent_of_node() == first != os.getpid()  # no second zygote
        assert zy._alive(first)  # kept between groups
        from_thread: list[int] = []
        worker = threading.Thread(target=lambda: from_thread.append(parent_of_node()))
        worker.start()
        worker.join(timeout=60)
        assert from_thread and from_thread[0] != first
        deadline = time.monotonic() + 10
        while zy._alive(from_thread[0]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not zy._alive(from_thread[0])  # not kept: it ended with its group
        os.kill(first, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while zy._alive(first) and time.monotonic() < deadline:
            time.sleep(0.05)
        replaced = parent_of_node()
        assert replaced not in (first, os.getpid())
        child = os.fork()
        if child == 0:  # a forked copy keeps none and holds no copy of their sockets
            time.sleep(30)
            os._exit(0)
        try:
            zy.release_kept()  # the copy still runs: the zygote ends all the same
            deadline = time.monotonic() + 10
            while zy._alive(replaced) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not zy._alive(replaced)
        finally:
            os.kill(child, signal.SIGKILL)
            os.waitpid(child, 0)
    finally:
        zy.release_kept()
