"""The `ip` / `tc` / `ethtool` command lines that build, shape and tear down a testbed (pure).

`setup_commands` lists, in order, every command that turns a `Topology` and its `Layout` into
namespaces, veth links, a bridge and `tbf` shapers on both ends of each shaped link (one per
direction); `shape_command` is the one `tc` line that sets (or, mid-run, changes) a direction's
rate. Generic segmentation and receive offloads are switched off on shaped links: a 64 KiB
super-packet would otherwise pass the token bucket as one lump. The shell that runs these
lines is netns.py.

    .venv/bin/pytest tests/unit/test_testbed_topology.py -q
"""

from __future__ import annotations

from dataclasses import dataclass

from splitlab.config.schema import TestbedLinkConfig
from splitlab.errors import ConfigError
from splitlab.testbed.topology import Layout, Topology, shaped

# Bucket depth floor: under 2 ms at the rate, the bucket is 16 KiB (room for timer slack: at
# 20 Mbit/s a 5 KB bucket lost 12% of the rate under load), but never more than 50 ms at the
# rate, and 4 KiB (2.7 full-size frames) at least. The cap is because the kernel refills the
# bucket whenever the shaper is changed: a drifting link (drift=link_degrade, a rate change
# every few tokens) would hand out the whole bucket at line rate after every change. With a
# flat 16 KiB (until stop 30) a link falling to 0.07 Mbit/s passed a ring's 2.3 KB hidden
# states in ~65 ms a token where its rate allows one per 250 ms.
SLACK_BURST_BYTES = 16 << 10
MAX_BURST_S = 0.050
MIN_BURST_BYTES = 4 << 10
MIN_QUEUE_BYTES = 64 << 10
BURST_S = 0.002  # default bucket depth: this long at the link's rate
QUEUE_S = 0.050  # default queue bound: this long at the link's rate
OFFLOADS = ("tso", "gso", "gro")
# TCP hands the qdisc GSO super-packets even with gso off on the device (it segments after the
# qdisc), sized by the device's gso_max_segs. A tbf can never send a packet longer than its
# bucket: it waits for tokens it cannot hold and re-arms its timer forever. So a rate change
# that shrinks the bucket under a queued super-packet wedged the link for good (ring3_edge,
# link_degrade 2.2 -> 1.2 Mbit/s: a 13.8 KB bucket became 7.6 KB under 15 queued packets of
# ~3.2 KB on average, and the KV of a migration never crossed). One segment per packet from every
# stack that sends into the testbed (each host's veth, the root's) keeps every packet within
# MIN_BURST_BYTES.
GSO_MAX_SEGS = "1"


@dataclass(frozen=True, kw_only=True)
class Tbf:
    """One token-bucket shaper: `rate_bit` bits/s, `burst_bytes` deep, `limit_bytes` queued."""

    rate_bit: int
    burst_bytes: int
    limit_bytes: int

    def args(self) -> list[str]:
        return ["tbf", "rate", f"{self.rate_bit}bit", "burst", str(self.burst_bytes),
                "limit", str(self.limit_bytes)]  # fmt: skip


def tbf_for(rate_mbit: float, *, burst_kib: float = 0.0, queue_kib: float = 0.0) -> Tbf:
    """The shaper for `rate_mbit` (Mbit/s = 1e6 bit/s); 0 burst/queue picks the defaults."""
    if rate_mbit <= 0:
        raise ConfigError(f"rate_mbit={rate_mbit} must be > 0 to shape a link")
    rate_bit = int(round(rate_mbit * 1e6))
    bytes_per_s = rate_bit / 8
    floor = max(MIN_BURST_BYTES, min(SLACK_BURST_BYTES, int(bytes_per_s * MAX_BURST_S)))
    burst = int(burst_kib * 1024) if burst_kib > 0 else max(floor, int(bytes_per_s * BURST_S))
    limit = (
        int(queue_kib * 1024) if queue_kib > 0 else max(MIN_QUEUE_BYTES, int(bytes_per_s * QUEUE_S))
    )
    return Tbf(rate_bit=rate_bit, burst_bytes=burst, limit_bytes=max(limit, burst))


def direction_end(layout: Layout, host: str, direction: str) -> tuple[str, str]:
    """(namespace, interface) whose egress carries `direction` ("up" or "down") of `host`'s link."""
    if direction == "up":
        return layout.netns(host), layout.host_if(host)
    if direction == "down":
        return layout.hub_ns, layout.switch_if(host)
    raise ConfigError(f"direction={direction!r} must be 'up' or 'down'")


def shape_command(layout: Layout, host: str, direction: str, tbf: Tbf) -> list[str]:
    ns, dev = direction_end(layout, host, direction)
    return ["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", *tbf.args()]


def _link_commands(layout: Layout, host: str, link: TestbedLinkConfig) -> list[list[str]]:
    ns, hub = layout.netns(host), layout.hub_ns
    h_if, s_if = layout.host_if(host), layout.switch_if(host)
    cmds = [
        [
            "ip",
            "link",
            "add",
            h_if,
            "netns",
            ns,
            "type",
            "veth",
            "peer",
            "name",
            s_if,
            "netns",
            hub,
        ],  # fmt: skip
        ["ip", "-n", ns, "link", "set", h_if, "gso_max_segs", GSO_MAX_SEGS],
        ["ip", "-n", ns, "addr", "add", f"{layout.address(host)}/24", "dev", h_if],
        ["ip", "-n", ns, "link", "set", h_if, "up"],
        ["ip", "-n", hub, "link", "set", s_if, "master", layout.bridge, "up"],
    ]
    if shaped(link):
        for n, dev in ((ns, h_if), (hub, s_if)):
            cmds.append(["ip", "netns", "exec", n, "ethtool", "-K", dev,
                         *[w for o in OFFLOADS for w in (o, "off")]])  # fmt: skip
    for direction, rate in (("up", link.up_mbit), ("down", link.down_mbit)):
        if rate > 0:
            tbf = tbf_for(rate, burst_kib=link.burst_kib, queue_kib=link.queue_kib)
            cmds.append(shape_command(layout, host, direction, tbf))
    return cmds


def setup_commands(topology: Topology, layout: Layout) -> list[list[str]]:
    """Every command that builds the testbed, in order (namespaces first, shapers last)."""
    hub, br = layout.hub_ns, layout.bridge
    cmds = [["ip", "netns", "add", hub]]
    cmds += [["ip", "netns", "add", layout.netns(h)] for h in layout.hosts]
    cmds += [["ip", "-n", n, "link", "set", "lo", "up"]
             for n in (hub, *map(layout.netns, layout.hosts))]  # fmt: skip
    cmds += [
        ["ip", "-n", hub, "link", "add", br, "type", "bridge"],
        ["ip", "-n", hub, "link", "set", br, "up"],
        [
            "ip",
            "link",
            "add",
            layout.root_if,
            "type",
            "veth",
            "peer",
            "name",
            layout.uplink_if,
            "netns",
            hub,
        ],  # fmt: skip
        ["ip", "link", "set", layout.root_if, "gso_max_segs", GSO_MAX_SEGS],
        ["ip", "addr", "add", f"{layout.root_address}/24", "dev", layout.root_if],
        ["ip", "link", "set", layout.root_if, "up"],
        ["ip", "-n", hub, "link", "set", layout.uplink_if, "master", br, "up"],
    ]
    for host in layout.hosts:
        cmds += _link_commands(layout, host, topology.links[host])
    return cmds
