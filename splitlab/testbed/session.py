"""One testbed session: build it, probe it, run commands inside its hosts, change it, remove it.

`Testbed(topology)` used as a context manager builds every namespace, link, shaper and cgroup
(named after a fresh 6-character session id), probes each link and refuses to start (a
TestbedError naming the link, exit 2) when a probed rate is off nominal by more than
`probe_tolerance`. On leaving the block, on an exception, on SIGINT and on SIGTERM it kills
the session's processes and removes all it built; after a SIGKILL, `teardown(session)` (what
`tools/testbed.py down` runs) finds the leftovers by name and removes them. A state file in
STATE_DIR lets other processes (`tools/testbed.py exec`) find a live session.

Loopback services of the root namespace (the broker, `root_ports`) are relayed to the root
address while the session's holder lives (relay.py). `command(host, argv)` wraps a command
line so that it runs inside a host: the shell joins the host's cgroups, then `ip netns exec`
enters its namespace with the host's thread count set.

    python tools/testbed.py up --testbed edge_cloud_wan --hold     (as root; Ctrl-C removes it)
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shlex
import signal
import subprocess
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

from splitlab.drift.host_kernel import HOST_CPU_CGROUP_ENV
from splitlab.testbed import cgroup
from splitlab.testbed.netns import (
    TestbedError,
    list_netns,
    netns_pids,
    require_privileges,
    root_links,
    run,
    taken_subnets,
)
from splitlab.testbed.plan import setup_commands, shape_command, tbf_for
from splitlab.testbed.probe import RttProbe, judge, probe_links
from splitlab.testbed.relay import Relay
from splitlab.testbed.topology import Layout, Topology, num_threads, subnet_for
from splitlab.wire.delay import PathDelay

log = logging.getLogger(__name__)

STATE_DIR = Path("/run/splitlab-testbed")
DELAY_SOURCE = "transport"  # this kernel has no netem: splitlab's transports add the delay
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
CGROUP_FD = 9  # a process in a host holds its CPU cgroup's directory open on this descriptor
CGROUP_FD_PATH = f"/proc/self/fd/{CGROUP_FD}"


def new_session() -> str:
    return secrets.token_hex(3)


class Testbed:
    """See module docstring."""

    def __init__(self, topology: Topology, *, session: str | None = None, probe: bool = True,
                 state_dir: Path = STATE_DIR) -> None:  # fmt: skip
        if topology.empty:
            raise TestbedError(f"testbed {topology.name!r} has no hosts: nothing to build")
        self.topology, self.probe, self.state_dir = topology, probe, state_dir
        self.session = session or new_session()
        self.layout: Layout | None = None
        self.probes: list[dict[str, Any]] = []
        self.rtts: dict[str, RttProbe] = {}
        self._cgroups: dict[str, cgroup.HostCgroups] = {}
        self._relays: list[Relay] = []
        self._old_handlers: dict[int, Any] = {}

    # ---- life cycle ----
    def __enter__(self) -> Testbed:
        self._catch_signals()
        try:
            self.up()
        except BaseException:
            self._ignore_signals()
            if self.layout is not None:  # something was built
                self.down()
            self._restore_signals()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._ignore_signals()
        try:
            self.down()
        finally:
            self._restore_signals()

    def up(self) -> None:
        """Build, then probe (see module docstring); the caller tears down on failure."""
        require_privileges()
        hosts = tuple(self.topology.hosts)
        self.layout = Layout(session=self.session, subnet=subnet_for(self.session, taken_subnets()),
                             hosts=hosts)  # fmt: skip
        self._write_state()
        t0 = time.monotonic()
        for argv in setup_commands(self.topology, self.layout):
            run(argv)
        for name, h in self.topology.hosts.items():
            cg = cgroup.HostCgroups(self.layout.cgroup, name)
            cg.create(cpu=h.cpu, memory_mib=h.memory_mib)
            self._cgroups[name] = cg
        self._relays = [Relay(self.layout.root_address, p, delays=self.relay_delays())
                        for p in self.topology.root_ports]  # fmt: skip
        log.info(
            "testbed %s (%s) up in %.1f s: %s",
            self.session,
            self.topology.name,
            time.monotonic() - t0,
            ", ".join(f"{h}={self.layout.address(h)}" for h in hosts),
        )
        if self.probe:
            probes, self.rtts = probe_links(self.topology, self.layout)
            self.probes = [p.to_dict() for p in probes]
            self._write_state()
            bad = judge(probes, self.topology.probe_tolerance)
            if bad:
                raise TestbedError(
                    f"testbed {self.topology.name!r} (session {self.session}) refused: "
                    + "; ".join(bad)
                )
        self._write_state()

    def down(self) -> None:
        for relay in self._relays:
            relay.close()
        self._relays = []
        left = teardown(self.session, state_dir=self.state_dir)
        if left:
            raise TestbedError(f"testbed {self.session} left {left} behind")

    def _catch_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return

        def stop(signum: int, frame: FrameType | None) -> None:
            raise SystemExit(128 + signum)  # unwinds through __exit__, which tears down

        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old_handlers[sig] = signal.signal(sig, stop)

    def _ignore_signals(self) -> None:
        """While tearing down: a second Ctrl-C must not cut the clean-up short."""
        for sig in self._old_handlers:
            signal.signal(sig, signal.SIG_IGN)

    def _restore_signals(self) -> None:
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)
        self._old_handlers.clear()

    def relay_delays(self) -> dict[str, PathDelay]:
        """Each delayed host's address -> its one-way link delay, for the broker relay."""
        layout = self._layout()
        return {layout.address(h): PathDelay(delay_ms=lk.delay_ms, jitter_ms=lk.jitter_ms)
                for h, lk in self.topology.links.items() if lk.delay_ms > 0}  # fmt: skip

    # ---- running inside hosts ----
    def _layout(self) -> Layout:
        if self.layout is None:
            raise TestbedError(f"testbed {self.session} is not up")
        return self.layout

    def address(self, host: str) -> str:
        return self._layout().address(host)

    @property
    def root_address(self) -> str:
        """The root namespace's address on the testbed (where the broker relay listens)."""
        return self._layout().root_address

    def command(self, host: str, argv: list[str]) -> list[str]:
        """`argv` wrapped to run inside `host` (its cgroups, namespace and thread count)."""
        return host_command(self._layout(), host, num_threads(self.topology.host(host)), argv)

    def spawn(self, host: str, argv: list[str], **popen: Any) -> subprocess.Popen[Any]:
        return subprocess.Popen(self.command(host, argv), **popen)

    # ---- run-time changes ----
    def set_link_rate(self, host: str, direction: str, rate_mbit: float) -> None:
        """Change one direction of `host`'s link mid-run (tc replaces the shaper in place)."""
        link = self.topology.links[host]
        tbf = tbf_for(rate_mbit, burst_kib=link.burst_kib, queue_kib=link.queue_kib)
        run(shape_command(self._layout(), host, direction, tbf))

    def set_cpu(self, host: str, cpu: float) -> None:
        """Change `host`'s CPU budget (cores; 0 = none) mid-run."""
        self._cgroups[host].set_cpu(cpu)

    def cpu(self, host: str) -> float:
        """`host`'s CPU budget in force (cores; 0 = none), read back from its cgroup."""
        return self._cgroups[host].cpu()

    # ---- records ----
    def record(self) -> dict[str, Any]:
        """Nominal and probed figures of every link, for the run's metadata."""
        layout = self._layout()
        links = {}
        for host in layout.hosts:
            lk = self.topology.links[host]
            links[host] = {
                "nominal": {
                    "up_mbit": lk.up_mbit,
                    "down_mbit": lk.down_mbit,
                    "delay_ms": lk.delay_ms,
                    "jitter_ms": lk.jitter_ms,
                    "burst_kib": lk.burst_kib,
                },  # fmt: skip
                "probed": {
                    **(self.rtts[host].to_dict() if host in self.rtts else {"rtt_ms": None}),
                    **{
                        f"{p['direction']}_mbit": p["measured_mbit"]
                        for p in self.probes
                        if p["host"] == host
                    },
                },  # fmt: skip
                "delay_source": DELAY_SOURCE if lk.delay_ms > 0 else None,
                # control: the embedded bus's delay line, or the broker relay (relay.py)
                "control_delay_source": DELAY_SOURCE if lk.delay_ms > 0 else None,
            }
        hosts = {n: {"address": layout.address(n), "netns": layout.netns(n), "cpu": h.cpu,
                     "memory_mib": h.memory_mib, "threads": num_threads(h)}
                 for n, h in self.topology.hosts.items()}  # fmt: skip
        return {"session": self.session, "testbed": self.topology.name, "subnet": layout.subnet,
                "root_address": layout.root_address, "root_ports": list(self.topology.root_ports),
                "hosts": hosts, "links": links,
                "placement": {r: list(h) for r, h in self.topology.placement.items()},
                "probes": self.probes, "pid": os.getpid()}  # fmt: skip

    def _write_state(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        path = self.state_dir / f"{self.session}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.record(), indent=1))
        tmp.replace(path)


def host_command(layout: Layout, host: str, threads: int, argv: list[str]) -> list[str]:
    """See `Testbed.command`; pure, so a state file alone can rebuild it."""
    join = " && ".join(
        f"echo $$ > {shlex.quote(str(cgroup.CGROUP_ROOT / c / layout.cgroup / host / 'cgroup.procs'))}"
        for c in cgroup.CONTROLLERS
    )
    env = [*(f"{v}={threads}" for v in THREAD_VARS), f"{HOST_CPU_CGROUP_ENV}={CGROUP_FD_PATH}"]
    # `ip netns exec` mounts a fresh /sys without the cgroup hierarchies: the host's CPU cgroup
    # stays readable through an open descriptor (drift/host_kernel.py reads it)
    cpu_dir = shlex.quote(str(cgroup.CGROUP_ROOT / "cpu" / layout.cgroup / host))
    script = (
        f"{join} && exec {CGROUP_FD}<{cpu_dir} && "
        f'exec ip netns exec {shlex.quote(layout.netns(host))} env {" ".join(env)} "$@"'
    )
    return ["sh", "-c", script, "sh", *argv]


def load_state(session: str, state_dir: Path = STATE_DIR) -> dict[str, Any] | None:
    path = state_dir / f"{session}.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None


def sessions(state_dir: Path = STATE_DIR) -> set[str]:
    """Every session with a state file, a namespace or a cgroup on this machine."""
    found = {p.stem for p in state_dir.glob("*.json")} if state_dir.exists() else set()
    found |= {n.split("-")[1] for n in list_netns() if n.startswith("sl-") and n.count("-") >= 2}
    return found | cgroup.session_groups()


def session_pids(session: str) -> set[int]:
    pids: set[int] = set()
    for ns in list_netns():
        if ns.startswith(f"sl-{session}-"):
            pids |= netns_pids(ns)
    for c in cgroup.CONTROLLERS:
        top = cgroup.CGROUP_ROOT / c / f"splitlab-{session}"
        for procs in top.glob("*/cgroup.procs"):
            try:
                pids.update(int(p) for p in procs.read_text().split())
            except FileNotFoundError:
                pass
    pids.discard(os.getpid())
    return pids


def teardown(session: str, *, state_dir: Path = STATE_DIR) -> list[str]:
    """Kill the session's processes, remove its namespaces, veths, qdiscs and cgroups (found by
    name, so a SIGKILLed owner's leftovers go too); returns whatever could not be removed."""
    cgroup.kill_all(lambda: session_pids(session))
    for ns in list_netns():
        if ns.startswith(f"sl-{session}-"):
            run(["ip", "netns", "del", ns], check=False)  # its veths and qdiscs go with it
    for name in root_links(f"sl{session}"):
        run(["ip", "link", "del", name], check=False)
    left = cgroup.remove_session_groups(f"splitlab-{session}")
    left += [f"netns {n}" for n in list_netns() if n.startswith(f"sl-{session}-")]
    left += [f"link {n}" for n in root_links(f"sl{session}")]
    if not left:
        (state_dir / f"{session}.json").unlink(missing_ok=True)
        (state_dir / f"{session}.tmp").unlink(missing_ok=True)
    return left
