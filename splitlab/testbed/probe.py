"""Link probes at start-up: bulk throughput per direction and small-message RTT per link.

Each host's link is probed against the root namespace, which sits behind the unshaped side
of the switch: `up` sends from a thread inside the host's namespace to a listener in the root
namespace, `down` the other way, each for `probe_s` seconds; the receiver counts the bytes
that arrive after a short warm-up (which the token bucket's initial burst would inflate).
Throughput is TCP goodput, which cannot exceed `TCP_GOODPUT` of the shaped rate (the token
bucket charges whole Ethernet frames: 1,448 payload bytes per 1,514 at MTU 1500 with TCP
timestamps), so a direction is judged against that expected goodput: `judge` refuses a testbed
whose probed goodput is further from it than the tolerance. (Judged against the nominal rate
itself, a 100 Mbit/s link read 91-95.5 quiet, 88-89 with CI's load beside it: 4.5-9% of the
10% tolerance was gone to headers before any load.)
A direction that reads too low is probed again, up to `probe_attempts` times in all, and
keeps the reading closest to nominal: on a loaded host the probe's own threads can be starved
(a 20 Mbit/s link read 14.9 once in CI, 2 cores busy), which reads low on one try, while a
link shaped too slow reads low on every try and is still refused. A reading too high is
refused at once: load cannot speed a link up, and a bucket too deep (a burst that lets the
first megabytes through unshaped) drains in the first probe and would read right on a second.

The RTT is probed twice: over the bare kernel path (`wire_rtt_ms`: veths and a bridge, tens
of microseconds, since this kernel has no netem to delay it) and through the link's delay
(`rtt_ms`): each ping and each echo go through a `wire.delay.DelayLine` with the link's
one-way delay, the same line that delays a transport's frames, so `rtt_ms` is what a small
message on that link takes (`rtt_delay_source: transport`; None on a link without delay).

    .venv/bin/pytest tests/integration/test_testbed.py -q -k probe
"""

from __future__ import annotations

import socket
import statistics
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from functools import partial

from splitlab.testbed.netns import TestbedError, in_netns
from splitlab.testbed.topology import Layout, Topology
from splitlab.wire.delay import DELAY_SOURCE, DelayLine, PathDelay, sendall_through

CHUNK = 256 << 10
TCP_GOODPUT = 1448 / 1514  # payload per Ethernet frame, MTU 1500, TCP timestamps on
RTT_ROUNDS = 20
RTT_BYTES = 64


@dataclass(frozen=True, kw_only=True)
class DirectionProbe:
    host: str
    direction: str  # up: host -> switch, down: switch -> host
    nominal_mbit: float
    measured_mbit: float
    attempts: int = 1

    @property
    def expected_mbit(self) -> float:
        """The goodput a link shaped at nominal carries (see the module docstring)."""
        return self.nominal_mbit * TCP_GOODPUT

    @property
    def off(self) -> float:
        """Relative distance from the expected goodput (0.05 = 5% off)."""
        return abs(self.measured_mbit / self.expected_mbit - 1.0)

    def to_dict(self) -> dict[str, float | str]:
        return {"host": self.host, "direction": self.direction, "nominal_mbit": self.nominal_mbit,
                "measured_mbit": round(self.measured_mbit, 3), "off": round(self.off, 4),
                "attempts": self.attempts}  # fmt: skip


def goodput_mbit(marks: list[tuple[float, int]], warm_s: float) -> float:
    """Mbit/s from (time, cumulative bytes) marks, counting only what came after `warm_s`."""
    if len(marks) < 2:
        return 0.0
    start = next((m for m in marks if m[0] - marks[0][0] >= warm_s), marks[0])
    t0, b0 = start
    t1, b1 = marks[-1]
    return 0.0 if t1 <= t0 else (b1 - b0) * 8 / (t1 - t0) / 1e6


def judge(probes: list[DirectionProbe], tolerance: float) -> list[str]:
    """One line per link direction whose probed goodput is more than `tolerance` off what a
    link at nominal carries."""
    return [f"link {p.host} ({p.direction}): probed {p.measured_mbit:.2f} Mbit/s vs nominal "
            f"{p.nominal_mbit:g} Mbit/s, {p.expected_mbit:.2f} of TCP goodput "
            f"({p.off:.0%} off, more than {tolerance:.0%})"
            for p in probes if p.off > tolerance]  # fmt: skip


def _ns(name: str | None) -> AbstractContextManager[None]:
    return in_netns(name) if name else nullcontext()


def _in_thread(fn: Callable[[], None], errors: list[BaseException]) -> threading.Thread:
    def body() -> None:
        try:
            fn()
        except BaseException as exc:  # surfaced by the caller after join
            errors.append(exc)

    t = threading.Thread(target=body, daemon=True)
    t.start()
    return t


def bulk_mbit(*, recv_ns: str | None, send_ns: str | None, recv_host: str,
              duration_s: float, timeout_s: float = 30.0) -> float:  # fmt: skip
    """Goodput of one TCP stream from `send_ns` to a listener on `recv_host` in `recv_ns`."""
    ready, errors = threading.Event(), []
    port: list[int] = []
    marks: list[tuple[float, int]] = []

    def receive() -> None:
        with _ns(recv_ns), socket.create_server((recv_host, 0)) as srv:
            srv.settimeout(timeout_s)
            port.append(srv.getsockname()[1])
            ready.set()
            conn, _ = srv.accept()
            with conn:
                conn.settimeout(timeout_s)
                buf, total = bytearray(CHUNK), 0
                while n := conn.recv_into(buf):
                    total += n
                    marks.append((time.monotonic(), total))

    def send() -> None:
        if not ready.wait(timeout_s):
            return
        payload = bytes(CHUNK)
        with _ns(send_ns), socket.create_connection((recv_host, port[0]), timeout=timeout_s) as s:
            end = time.monotonic() + duration_s
            while time.monotonic() < end:
                s.sendall(payload)

    threads = [_in_thread(receive, errors), _in_thread(send, errors)]
    for t in threads:
        t.join(timeout_s + duration_s)
    if errors:
        raise TestbedError(f"bulk probe to {recv_host} failed: {errors[0]}")
    return goodput_mbit(marks, warm_s=min(0.1, duration_s / 5))


def rtt_ms(*, client_ns: str, server_host: str, delay: PathDelay | None = None,
           timeout_s: float = 10.0) -> float:  # fmt: skip
    """Median round trip of a small message between `client_ns` and the root namespace; with
    `delay`, the ping and the echo each wait out that one-way delay in a delay line."""
    errors: list[BaseException] = []
    lines = [DelayLine(default=delay, seed=k) for k in range(2)] if delay else [None, None]
    with socket.create_server((server_host, 0)) as srv:
        srv.settimeout(timeout_s)
        port = srv.getsockname()[1]
        samples: list[float] = []

        def client() -> None:
            with in_netns(client_ns), socket.create_connection((server_host, port), timeout_s) as s:
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                send, msg = sendall_through(lines[0], s.sendall, "rtt"), bytes(RTT_BYTES)
                for _ in range(RTT_ROUNDS):
                    t0 = time.perf_counter()
                    send(msg)
                    got = 0
                    while got < RTT_BYTES:
                        got += len(s.recv(RTT_BYTES - got))
                    samples.append((time.perf_counter() - t0) * 1e3)

        t = _in_thread(client, errors)
        try:
            conn, _ = srv.accept()
            with conn:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                conn.settimeout(timeout_s)
                echo = sendall_through(lines[1], conn.sendall, "rtt")
                while data := conn.recv(RTT_BYTES):
                    echo(data)
                t.join(timeout_s)
        finally:
            for line in lines:
                if line is not None:
                    line.close(drain_timeout_s=0)
    if errors or not samples:
        raise TestbedError(
            f"RTT probe from {client_ns} failed: {errors[0] if errors else 'no reply'}"
        )
    return statistics.median(samples)


@dataclass(frozen=True, kw_only=True)
class RttProbe:
    """A link's small-message round trip: over the bare kernel path, and through its delay."""

    wire_rtt_ms: float  # veths and bridge alone (no netem here: no delay)
    rtt_ms: float  # through the link's one-way delay each way (= wire_rtt_ms without delay)
    delay_source: str | None  # where `rtt_ms`'s delay came from; None: the link has none

    def to_dict(self) -> dict[str, float | str | None]:
        return {"rtt_ms": round(self.rtt_ms, 4), "wire_rtt_ms": round(self.wire_rtt_ms, 4),
                "rtt_delay_source": self.delay_source}  # fmt: skip


def probe_rtt(*, client_ns: str, server_host: str, delay_ms: float, jitter_ms: float) -> RttProbe:
    """Both RTTs of one link whose one-way delay is `delay_ms` (+- `jitter_ms`)."""
    wire = rtt_ms(client_ns=client_ns, server_host=server_host)
    if delay_ms <= 0:
        return RttProbe(wire_rtt_ms=wire, rtt_ms=wire, delay_source=None)
    path = PathDelay(delay_ms=delay_ms, jitter_ms=jitter_ms)
    through = rtt_ms(client_ns=client_ns, server_host=server_host, delay=path)
    return RttProbe(wire_rtt_ms=wire, rtt_ms=through, delay_source=DELAY_SOURCE)


def probe_direction(measure: Callable[[], float], *, host: str, direction: str, nominal: float,
                    tolerance: float, attempts: int) -> DirectionProbe:  # fmt: skip
    """Measure until a reading is within `tolerance` of `nominal`, above it, or `attempts` are
    spent; the reading closest to nominal stands (see module docstring)."""
    best: DirectionProbe | None = None
    for n in range(1, attempts + 1):
        got = DirectionProbe(host=host, direction=direction, nominal_mbit=nominal,
                             measured_mbit=measure(), attempts=n)  # fmt: skip
        if best is None or got.off < best.off:
            best = got
        if got.off <= tolerance or got.measured_mbit > nominal:
            break
    assert best is not None
    return replace(best, attempts=n)


def probe_links(
    topology: Topology, layout: Layout
) -> tuple[list[DirectionProbe], dict[str, RttProbe]]:
    """Bulk probes of every shaped direction and the RTTs of every link, one at a time."""
    probes, rtts = [], {}
    for host in layout.hosts:
        link, ns = topology.links[host], layout.netns(host)
        rtts[host] = probe_rtt(client_ns=ns, server_host=layout.root_address,
                               delay_ms=link.delay_ms, jitter_ms=link.jitter_ms)  # fmt: skip
        for direction, nominal in (("up", link.up_mbit), ("down", link.down_mbit)):
            if nominal <= 0:
                continue
            if direction == "up":
                measure = partial(bulk_mbit, recv_ns=None, send_ns=ns,
                                  recv_host=layout.root_address, duration_s=topology.probe_s)  # fmt: skip
            else:
                measure = partial(bulk_mbit, recv_ns=ns, send_ns=None,
                                  recv_host=layout.address(host), duration_s=topology.probe_s)  # fmt: skip
            probes.append(probe_direction(measure, host=host, direction=direction, nominal=nominal,
                                          tolerance=topology.probe_tolerance,
                                          attempts=topology.probe_attempts))  # fmt: skip
    return probes, rtts
