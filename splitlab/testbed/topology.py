"""The testbed's topology as plain values, and every name and address a session gives it.

A testbed is a star: each host is a network namespace whose one link (a veth pair) joins a
switch (a bridge in a hub namespace); the hub also reaches the root namespace (the broker,
the probe peer) over an unshaped veth. A host's link is shaped per direction (`up`: host ->
switch, `down`: switch -> host), so a path between two hosts crosses both their links: its
rate is the lower of the two and its one-way delay the sum.

`topology_from_config` validates the `testbed` config group, `Layout` derives the session's
namespace, interface and cgroup names and private addresses (both pure), and
`delay_line_for` builds the send-side delay line of a process on one host.

    .venv/bin/pytest tests/unit/test_testbed_topology.py -q
"""

from __future__ import annotations

import ipaddress
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

from splitlab.config.schema import TestbedConfig, TestbedHostConfig, TestbedLinkConfig
from splitlab.errors import ConfigError
from splitlab.wire.delay import DelayLine, PathDelay

SESSION_RE = re.compile(r"^[a-z0-9]{6}$")  # keeps every interface name within IFNAMSIZ
HOST_RE = re.compile(r"^[a-z][a-z0-9_]{0,15}$")
SUBNET_BASE = ipaddress.ip_network("10.211.0.0/16")  # one /24 per session inside it
MAX_HOSTS = 200  # host i gets .(10 + i) in the session's /24


def shaped(link: TestbedLinkConfig) -> bool:
    """Whether either direction of `link` is shaped (rate 0 = unshaped)."""
    return link.up_mbit > 0 or link.down_mbit > 0


def num_threads(host: TestbedHostConfig) -> int:
    """Threads for processes on `host`: as configured, else its CPU budget rounded up."""
    if host.threads > 0:
        return host.threads
    return max(1, math.ceil(host.cpu)) if host.cpu > 0 else 1


@dataclass(frozen=True, kw_only=True)
class Topology:
    """A validated `testbed` group; every host has a link (unshaped when not configured)."""

    name: str
    hosts: dict[str, TestbedHostConfig]
    links: dict[str, TestbedLinkConfig]
    placement: dict[str, tuple[str, ...]]  # role -> host of each rank
    root_ports: tuple[int, ...] = ()  # loopback ports relayed to the root address
    probe_s: float = 0.5
    probe_tolerance: float = 0.1
    probe_attempts: int = 3

    @property
    def empty(self) -> bool:
        return not self.hosts

    def host(self, name: str) -> TestbedHostConfig:
        if name not in self.hosts:
            raise ConfigError(f"testbed {self.name!r} has no host {name!r} ({sorted(self.hosts)})")
        return self.hosts[name]

    def host_of(self, role: str, rank: int) -> str:
        """The host that runs `role` rank `rank` (ranks beyond the list wrap around)."""
        hosts = self.placement.get(role)
        if not hosts:
            raise ConfigError(
                f"testbed.placement has no entry for role {role!r} (roles: {sorted(self.placement)})"
            )
        return hosts[rank % len(hosts)]

    def path_rate_mbit(self, a: str, b: str) -> float:
        """The shaped rate from host `a` to host `b` (a's up, b's down: the lower one counts);
        0.0 when neither is shaped."""
        rates = [r for r in (self.links[a].up_mbit, self.links[b].down_mbit) if r > 0]
        return min(rates) if a != b and rates else 0.0

    def path_delay_ms(self, a: str, b: str) -> tuple[float, float]:
        """One-way (delay, jitter) from host `a` to host `b`: both links add up."""
        if a == b:
            return 0.0, 0.0
        la, lb = self.links[a], self.links[b]
        return la.delay_ms + lb.delay_ms, la.jitter_ms + lb.jitter_ms


def _positive(key: str, value: float) -> float:
    if not math.isfinite(value) or value < 0:
        raise ConfigError(f"{key}={value!r} must be a finite number >= 0")
    return float(value)


def topology_from_config(cfg: TestbedConfig) -> Topology:
    """Validate the `testbed` group; every error names the key and the value."""
    if len(cfg.hosts) > MAX_HOSTS:
        raise ConfigError(f"testbed.hosts: {len(cfg.hosts)} hosts, at most {MAX_HOSTS}")
    for name, h in cfg.hosts.items():
        if not HOST_RE.match(name):
            raise ConfigError(
                f"testbed.hosts: host name {name!r} must match {HOST_RE.pattern} (it names a namespace)"
            )
        key = f"testbed.hosts.{name}"
        _positive(f"{key}.cpu", h.cpu)
        if h.memory_mib < 0 or h.threads < 0:
            raise ConfigError(
                f"{key}: memory_mib={h.memory_mib} and threads={h.threads} must be >= 0"
            )
    names = set(cfg.hosts)
    for host, lk in cfg.links.items():
        if host not in names:
            raise ConfigError(f"testbed.links.{host}: no such host (hosts: {sorted(names)})")
        key = f"testbed.links.{host}"
        for f in ("up_mbit", "down_mbit", "burst_kib", "queue_kib", "delay_ms", "jitter_ms"):
            _positive(f"{key}.{f}", getattr(lk, f))
        if lk.jitter_ms > lk.delay_ms:
            raise ConfigError(
                f"{key}.jitter_ms={lk.jitter_ms} exceeds delay_ms={lk.delay_ms} (delays cannot go negative)"
            )
    links = {h: cfg.links.get(h, TestbedLinkConfig()) for h in cfg.hosts}
    placement = {}
    for role, where in cfg.placement.items():
        for i, host in enumerate(where):
            if host not in names:
                raise ConfigError(
                    f"testbed.placement.{role}[{i}]={host!r} is not a host (hosts: {sorted(names)})"
                )
        placement[role] = tuple(where)
    for port in cfg.root_ports:
        if not 0 < port < 65536:
            raise ConfigError(f"testbed.root_ports: {port} is not a TCP port")
    if not 0 < cfg.probe_tolerance < 1:
        raise ConfigError(f"testbed.probe_tolerance={cfg.probe_tolerance} must be in (0, 1)")
    _positive("testbed.probe_s", cfg.probe_s)
    if cfg.probe_attempts < 1:
        raise ConfigError(f"testbed.probe_attempts={cfg.probe_attempts} must be at least 1")
    return Topology(name=cfg.name, hosts=dict(cfg.hosts), links=links, placement=placement,
                    root_ports=tuple(cfg.root_ports), probe_s=cfg.probe_s,
                    probe_tolerance=cfg.probe_tolerance,
                    probe_attempts=cfg.probe_attempts)  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class Layout:
    """Names and addresses of one session's testbed (all derived from the session id).

    Namespaces `sl-<session>-<host>` and `sl-<session>-hub`; in the root namespace only the
    veth end `sl<session>rt`; cgroups `splitlab-<session>/<host>` under each controller.
    """

    session: str
    subnet: int  # the session's /24 is 10.211.<subnet>.0/24
    hosts: tuple[str, ...]

    def __post_init__(self) -> None:
        if not SESSION_RE.match(self.session):
            raise ConfigError(f"session={self.session!r} must be 6 characters of [a-z0-9]")
        if not 0 <= self.subnet < 256:
            raise ConfigError(f"subnet={self.subnet} must be in 0..255")

    @property
    def prefix(self) -> str:
        return f"sl-{self.session}-"

    @property
    def hub_ns(self) -> str:
        return f"{self.prefix}hub"

    def netns(self, host: str) -> str:
        return f"{self.prefix}{host}"

    def index(self, host: str) -> int:
        return self.hosts.index(host)

    def host_if(self, host: str) -> str:
        """The host's end of its link (inside the host namespace)."""
        return f"sl{self.session}h{self.index(host)}"

    def switch_if(self, host: str) -> str:
        """The switch's end of the host's link (inside the hub namespace)."""
        return f"sl{self.session}s{self.index(host)}"

    @property
    def bridge(self) -> str:
        return f"sl{self.session}br"

    @property
    def root_if(self) -> str:
        return f"sl{self.session}rt"

    @property
    def uplink_if(self) -> str:
        """The hub's end of the root veth."""
        return f"sl{self.session}up"

    @property
    def network(self) -> ipaddress.IPv4Network:
        return ipaddress.ip_network(f"10.211.{self.subnet}.0/24")

    @property
    def root_address(self) -> str:
        """The root namespace's address on the testbed (broker, probe peer)."""
        return f"10.211.{self.subnet}.1"

    def address(self, host: str) -> str:
        return f"10.211.{self.subnet}.{10 + self.index(host)}"

    @property
    def cgroup(self) -> str:
        return f"splitlab-{self.session}"


def subnet_for(session: str, taken: set[int]) -> int:
    """A /24 index for `session` not in `taken` (deterministic first choice, then the next free)."""
    first = int.from_bytes(session.encode(), "big") % 256
    for k in range(256):
        candidate = (first + k) % 256
        if candidate not in taken:
            return candidate
    raise ConfigError(f"every /24 of {SUBNET_BASE} is in use by other testbed sessions")


def delay_line_for(topology: Topology, host: str, peer_hosts: Mapping[str, str], *,
                   seed: int = 0) -> DelayLine | None:  # fmt: skip
    """The send-side delay line of a process on `host` whose peers (peer id -> host) are
    `peer_hosts`; None when no path has a delay (the transport then runs unchanged)."""
    paths = {}
    for peer, peer_host in peer_hosts.items():
        delay_ms, jitter_ms = topology.path_delay_ms(host, peer_host)
        if delay_ms > 0:
            paths[peer] = PathDelay(delay_ms=delay_ms, jitter_ms=jitter_ms)
    if not paths:
        return None
    return DelayLine(default=PathDelay(), paths=paths, seed=seed)
