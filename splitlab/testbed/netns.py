"""The kernel side of a testbed: run `ip`/`tc` lines, enter namespaces, find and remove leftovers.

`ip` and `tc` run as subprocesses: the lines are the same a researcher types to inspect a
testbed by hand (`ip -n sl-<session>-edge1 addr`, `tc -n ... qdisc`), and iproute2 is on
every Linux host, where pyroute2 would be one more dependency to pin. A thread enters a
namespace with setns(2) (`in_netns`), so probes need no child process.

    .venv/bin/pytest tests/integration/test_testbed.py -q
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from splitlab.errors import ConfigError, SplitlabError
from splitlab.testbed.cgroup import missing_controllers

CAP_NET_ADMIN, CAP_SYS_ADMIN = 12, 21
CLONE_NEWNET = 0x40000000
TOOLS = ("ip", "tc", "ethtool")


class TestbedError(SplitlabError):
    """The testbed cannot be built, probed or removed; the message names what and why."""

    exit_code = ConfigError.exit_code  # exit 2, as for a config the machine cannot honour


def effective_caps(status_text: str) -> int:
    """The CapEff bit mask from the text of /proc/<pid>/status."""
    m = re.search(r"^CapEff:\s*([0-9a-fA-F]+)$", status_text, re.M)
    return int(m.group(1), 16) if m else 0


def missing_privileges(status_text: str | None = None) -> list[str]:
    """What this process lacks to build a testbed: capabilities, tools, cgroup controllers."""
    if status_text is None:
        with open("/proc/self/status", encoding="utf-8") as f:
            status_text = f.read()
    caps = effective_caps(status_text)
    missing = [f"{name} (run as root)" for name, bit in
               (("CAP_NET_ADMIN", CAP_NET_ADMIN), ("CAP_SYS_ADMIN", CAP_SYS_ADMIN))
               if not caps >> bit & 1]  # fmt: skip
    missing += [f"the `{t}` command (apt-get install iproute2 ethtool)" for t in TOOLS
                if shutil.which(t) is None]  # fmt: skip
    missing += [f"cgroup v1 file {p}" for p in missing_controllers()]
    return missing


def require_privileges() -> None:
    missing = missing_privileges()
    if missing:
        raise TestbedError("a testbed needs " + "; ".join(missing))


def run(argv: Sequence[str], *, check: bool = True, timeout_s: float = 30.0) -> str:
    """Run one command line; a failure names the line and its stderr."""
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise TestbedError(f"`{' '.join(argv)}` failed: {exc}") from None
    if check and done.returncode != 0:
        raise TestbedError(f"`{' '.join(argv)}` exited {done.returncode}: {done.stderr.strip()}")
    return done.stdout


_libc = ctypes.CDLL(None, use_errno=True)


@contextmanager
def in_netns(name: str) -> Iterator[None]:
    """Move the calling thread into network namespace `name`, and back on exit.

    Sockets created inside stay in that namespace for good. Only the calling thread moves.
    """
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        target = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
        try:
            _setns(target, name)
        finally:
            os.close(target)
        try:
            yield
        finally:
            _setns(home, "the original namespace")
    finally:
        os.close(home)


def _setns(fd: int, what: str) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise TestbedError(f"setns into {what}: {os.strerror(err)}")


def list_netns() -> list[str]:
    out = run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def netns_pids(name: str) -> set[int]:
    return {int(p) for p in run(["ip", "netns", "pids", name], check=False).split()}


def root_links(prefix: str) -> list[str]:
    """Interfaces in the root namespace whose name starts with `prefix`."""
    names = []
    for line in run(["ip", "-o", "link", "show"], check=False).splitlines():
        parts = line.split(":", 2)
        if len(parts) >= 2:
            name = parts[1].strip().split("@", 1)[0]
            if name.startswith(prefix):
                names.append(name)
    return names


def taken_subnets() -> set[int]:
    """The /24 indexes of 10.211.0.0/16 already addressed in the root namespace."""
    out = run(["ip", "-4", "-o", "addr", "show"], check=False)
    return {int(m.group(1)) for m in re.finditer(r"inet 10\.211\.(\d+)\.", out)}


def qdiscs(ns: str) -> str:
    return run(["tc", "-n", ns, "qdisc", "show"], check=False)
