"""Tensor data plane benchmark: raw sockets (the ceiling) vs the TCP transport vs RabbitMQ.

For each payload size: one-way throughput (a stream of frames, then one small ack) and the
round-trip latency of one frame echoed back, for (a) raw `sendall`/`recv_into` sockets, (b) the
TCP transport and (c) the RabbitMQ transport. The parent process is the client and a spawned
child the server; methods alternate within every repetition, and medians are reported.

With `--testbed NAME` (as root) the process builds the preset's testbed and re-runs itself
twice: the server inside the worker's host, the client inside the first owner's host
(splitlab/testbed/pair.py), so every arm crosses the preset's shaped links; raw and TCP sends
go through the path's delay line (the kernel has no netem), the broker is reached through
the testbed's relay at the root address (the AMQP transport has no delay line: its arm
carries the shaped rate but not the delay). Runs are sized by time at the shaped rate, and
sizes whose frames take too long at that rate are left out. The JSON's config carries the
testbed's record (nominal and probed links, delay_source); the targets are the TCP
transport's share of the shaped rate (>= 1 MiB frames) and TCP vs raw over the same path.

    .venv/bin/python tools/bench_transport.py --quick --out outputs/bench/transport.json
    .venv/bin/python tools/bench_transport.py --quick --testbed edge_cloud_wan   (as root)
    .venv/bin/python tools/bench_transport.py --quick --sizes-kib 4,1024 --no-amqp
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing as mp
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from splitlab.config.schema import MAX_SPIN_US, SPIN_US  # noqa: E402
from splitlab.errors import tool_exit  # noqa: E402
from splitlab.telemetry.bench import (  # noqa: E402
    BenchReport,
    bench_arg_parser,
    median,
    thread_policy,
)
from splitlab.testbed.pair import CONTROL_FD_FLAG  # noqa: E402
from splitlab.testbed.topology import Topology, delay_line_for  # noqa: E402
from splitlab.wire.base import SENT, SendTicket  # noqa: E402
from splitlab.wire.delay import DelayLine  # noqa: E402
from splitlab.wire.frame import Lane, TensorSpec  # noqa: E402
from splitlab.wire.header import (  # noqa: E402
    Routing,
    encode_binary_header,
    encode_header,
    parse_header,
)
from splitlab.wire.tcp import TcpTransport  # noqa: E402

KIB, MIB = 1 << 10, 1 << 20
SIZES = [4 * KIB, 64 * KIB, 1 * MIB, 4 * MIB, 16 * MIB]
KEY, SESSION = b"bench-key", "bench"
LANE = Lane.ACTIVATION
BROKER_URL = "amqp://guest:guest@{host}:5672/%2F"
SHAPED_RATE_GOAL = 0.9  # the TCP transport's share of a shaped link's rate, >= 1 MiB frames
LOOPBACK = "127.0.0.1 loopback, client and server in two processes"
RUN_S = {True: (1.5, 0.5), False: (6.0, 3.0)}  # on a link: seconds of (stream, pings), by --quick
MIN_STREAM_S = {True: 0.05, False: 0.25}  # loopback: the raw arm's shortest stream, by --quick
MAX_STREAM_SCALE = 16


@dataclass(frozen=True, kw_only=True)
class _Link:
    """The measured path's shaped rate and one-way delay; zeros on loopback."""

    bytes_per_s: float = 0.0
    delay_s: float = 0.0


def _counts(size: int, quick: bool, link: _Link) -> tuple[int, int]:
    """(frames per throughput run, pings per latency run); on a shaped link each run is sized
    to last about RUN_S at the link's rate and delay."""
    stream_bytes = (48 if quick else 256) * MIB
    ping_bytes, min_pings = (32 if quick else 128) * MIB, 5
    if link.bytes_per_s > 0:
        stream_s, ping_s = RUN_S[quick]
        stream_bytes = min(stream_bytes, int(link.bytes_per_s * stream_s))
        ping_round_s = 2 * (link.delay_s + size / link.bytes_per_s)
        ping_bytes, min_pings = min(ping_bytes, int(ping_s / ping_round_s) * size), 3
    frames = max(_min_frames(link), min(2000 if quick else 8000, stream_bytes // size))
    pings = max(min_pings, min(200 if quick else 1000, ping_bytes // size))
    return frames, pings


def scaled_frames(frames: int, pilot_s: float, quick: bool) -> int:
    """Frames per loopback throughput run: `frames`, or more (at most MAX_STREAM_SCALE times)
    where a raw stream of them took `pilot_s` < MIN_STREAM_S. 256 frames of 1 MiB pass in
    ~50 ms at 5 GB/s, and one scheduler hiccup in so short a run moved the TCP / raw ratio
    from 0.85 to 0.60 (Intel Xeon, 2 cores)."""
    want = MIN_STREAM_S[quick]
    if pilot_s >= want:
        return frames
    return int(frames * min(MAX_STREAM_SCALE, want / max(pilot_s, 1e-6)))


def _min_frames(link: _Link) -> int:
    return 4 if link.bytes_per_s > 0 else 8


def _sizes(quick: bool, link: _Link, sizes: list[int] = SIZES) -> list[int]:
    """Payload sizes (of `sizes`); on a shaped link, above 1 MiB (the targets' size) only those
    whose shortest stream lasts at most twice a run's time at the link's rate."""
    if link.bytes_per_s <= 0:
        return list(sizes)
    budget_bytes = 2 * RUN_S[quick][0] * link.bytes_per_s
    return [s for s in sizes if s <= MIB or _min_frames(link) * s <= budget_bytes]


def size_list(text: str) -> list[int]:
    """`--sizes-kib 4,1024`: payload sizes in KiB, as bytes (argparse names a bad one)."""
    out = []
    for part in text.split(","):
        if not part.strip().isdigit() or int(part) < 1:
            raise argparse.ArgumentTypeError(f"{part!r} is not a whole number of KiB >= 1")
        out.append(int(part) * KIB)
    return sorted(set(out))


@dataclass(frozen=True, kw_only=True)
class _Side:
    """Where one side binds and what its sends cross: loopback, or its testbed host's path."""

    bind_host: str = "127.0.0.1"
    broker_url: str = BROKER_URL.format(host="127.0.0.1")
    topology: Topology | None = None
    host: str = ""
    peer_host: str = ""
    spin_us: float = SPIN_US  # both arms' receive policy (see splitlab/wire/tcp.py)

    def delay_line(self, peer_id: str) -> DelayLine | None:
        if self.topology is None:
            return None
        return delay_line_for(self.topology, self.host, {peer_id: self.peer_host})


class _RawSender:
    """A raw socket's sends, handed on by the path's delay line where it has one."""

    def __init__(self, sock: socket.socket, line: DelayLine | None, peer_id: str) -> None:
        self.sock, self.line, self.peer_id = sock, line, peer_id

    def _sendall(self, data: memoryview | bytes) -> SendTicket:
        self.sock.sendall(data)
        return SENT

    def send(self, data: memoryview | bytes) -> SendTicket:
        if self.line is None:
            return self._sendall(data)
        return self.line.submit("raw", self.peer_id, lambda: self._sendall(data))

    def close(self) -> None:
        if self.line is not None:
            self.line.close(drain_timeout_s=1)
        self.sock.close()


def _recv_exact(sock: socket.socket, view: memoryview, spin_s: float) -> None:
    """Fill `view`; the first bytes are looked for without sleeping for `spin_s` (the TCP
    transport's receive policy, so the raw ceiling is measured under the same one), the rest
    waited for whole (MSG_WAITALL, as the transport reads a payload: one call, not one per
    arriving segment, so raw stays the ceiling for large frames)."""
    got, n = 0, len(view)
    spin_until = time.monotonic() + spin_s
    while got < n:
        spinning = got == 0 and time.monotonic() < spin_until
        try:
            flags = socket.MSG_DONTWAIT if spinning else socket.MSG_WAITALL
            k = sock.recv_into(view[got:], n - got, flags)
        except BlockingIOError:
            continue
        if not k:
            raise ConnectionError("raw peer closed")
        got += k


# ---- server side (child process) ----
class _Server:
    def __init__(self, broker: bool, side: _Side) -> None:
        self.side = side
        self.listener = socket.create_server((side.bind_host, 0))
        self.tcp = TcpTransport("srv", key=KEY, session=SESSION, bind_host=side.bind_host,
                                pinned="off", delay=side.delay_line("cli"),
                                spin_us=side.spin_us)  # fmt: skip
        self.amqp = None
        if broker:
            from splitlab.wire.amqp import AmqpTransport

            self.amqp = AmqpTransport("srv", session=SESSION, url=side.broker_url)
        self.raw: _RawSender | None = None

    def addresses(self) -> dict[str, Any]:
        return {"raw": self.listener.getsockname()[:2], "tcp": self.tcp.address}

    def accept_raw(self) -> None:
        sock, _ = self.listener.accept()
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.raw = _RawSender(sock, self.side.delay_line("cli"), "cli")

    def run(self, method: str, mode: str, size: int, count: int) -> None:
        if method == "raw":
            assert self.raw is not None
            buf = bytearray(size)
            view = memoryview(buf)
            for _ in range(count):
                _recv_exact(self.raw.sock, view, self.side.spin_us / 1e6)
                if mode == "rtt":
                    self.raw.send(view).wait(60)
            if mode == "stream":
                self.raw.send(b"k").wait(60)
            return
        t = self.tcp if method == "tcp" else self.amqp
        assert t is not None
        for _ in range(count):
            msg = t.recv(LANE, timeout_s=60)
            if mode == "rtt":
                t.send("cli", LANE, "echo", msg.tensors).wait(60)
            msg.release()
        if mode == "stream":
            t.send("cli", LANE, "ack", {"k": torch.zeros(1)}).wait(60)


def _serve(pipe: Any, broker: bool, side: _Side) -> None:
    torch.set_num_threads(1)
    server = _Server(broker, side)
    policy = thread_policy(torch_threads=torch.get_num_threads())
    pipe.send({**server.addresses(), "threads": policy})
    server.accept_raw()
    if server.amqp is not None:
        server.amqp.connect("cli", timeout_s=30)
    while True:
        cmd = pipe.recv()
        if cmd is None:
            break
        pipe.send("ready")
        server.run(*cmd)
        pipe.send("done")
    server.tcp.close()
    if server.amqp is not None:
        server.amqp.close()
    if server.raw is not None:
        server.raw.close()


# ---- client side (parent) ----
class _Client:
    def __init__(self, addresses: dict[str, Any], broker: bool, side: _Side) -> None:
        sock = socket.create_connection(tuple(addresses["raw"]))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.raw = _RawSender(sock, side.delay_line("srv"), "srv")
        self.tcp = TcpTransport("cli", key=KEY, session=SESSION, bind_host=side.bind_host,
                                pinned="off", delay=side.delay_line("srv"),
                                spin_us=side.spin_us)  # fmt: skip
        self.spin_s = side.spin_us / 1e6
        self.tcp.connect("srv", *addresses["tcp"], timeout_s=10)
        self.amqp = None
        if broker:
            from splitlab.wire.amqp import AmqpTransport

            self.amqp = AmqpTransport("cli", session=SESSION, url=side.broker_url)
            self.amqp.connect("srv", timeout_s=30)

    def stream_s(self, method: str, payload: torch.Tensor, count: int) -> float:
        start = time.perf_counter()
        if method == "raw":
            view = memoryview(payload.numpy()).cast("B")
            for _ in range(count):
                self.raw.send(view)
            _recv_exact(self.raw.sock, memoryview(bytearray(1)), self.spin_s)
        else:
            t = self.tcp if method == "tcp" else self.amqp
            assert t is not None
            for _ in range(count):
                t.send("srv", LANE, "x", {"x": payload}, timeout_s=60)
            t.recv(LANE, timeout_s=60, peer_id="srv").release()
        return time.perf_counter() - start

    def rtts_s(self, method: str, payload: torch.Tensor, count: int) -> list[float]:
        out = []
        if method == "raw":
            view = memoryview(payload.numpy()).cast("B")
            back = memoryview(bytearray(len(view)))
            for _ in range(count):
                start = time.perf_counter()
                self.raw.send(view)
                _recv_exact(self.raw.sock, back, self.spin_s)
                out.append(time.perf_counter() - start)
            return out
        t = self.tcp if method == "tcp" else self.amqp
        assert t is not None
        for _ in range(count):
            start = time.perf_counter()
            t.send("srv", LANE, "x", {"x": payload}, timeout_s=60)
            t.recv(LANE, timeout_s=60, peer_id="srv").release()
            out.append(time.perf_counter() - start)
        return out


def _broker_up() -> bool:
    try:
        socket.create_connection(("127.0.0.1", 5672), timeout=1).close()
        return True
    except OSError:
        return False


def _topology(name: str) -> Topology:
    from splitlab.configure import compose_config
    from splitlab.testbed.topology import topology_from_config

    return topology_from_config(compose_config([f"testbed={name}"]).testbed)


def _testbed_side(args: argparse.Namespace) -> tuple[_Side, dict[str, Any], _Link]:
    """This side's place on the live testbed session `args.session`: the side, the report's
    testbed config (the session's record and the measured path), and the path."""
    from splitlab.testbed.netns import TestbedError
    from splitlab.testbed.pair import pair_hosts
    from splitlab.testbed.session import DELAY_SOURCE, load_state

    topo = _topology(args.testbed)
    state = load_state(args.session)
    if state is None:
        raise TestbedError(f"testbed session {args.session!r} has no state file: it is not up")
    client, server = pair_hosts(topo)
    host, peer = (client, server) if args.side == "client" else (server, client)
    side = _Side(bind_host=state["hosts"][host]["address"], topology=topo, host=host,
                 peer_host=peer,
                 broker_url=BROKER_URL.format(host=state["root_address"]))  # fmt: skip
    rate_mbit = topo.path_rate_mbit(client, server)
    delay_ms, jitter_ms = topo.path_delay_ms(client, server)
    path = {"client_host": client, "server_host": server, "rate_mbit": rate_mbit,
            "delay_ms": delay_ms, "jitter_ms": jitter_ms,
            "delay_source": DELAY_SOURCE if delay_ms > 0 else None,
            "delayed_methods": ["raw", "tcp"] if delay_ms > 0 else []}  # fmt: skip
    where = (f"testbed {topo.name}: client on {client} ({state['hosts'][client]['address']}), "
             f"server on {server} ({state['hosts'][server]['address']})")  # fmt: skip
    link = _Link(bytes_per_s=rate_mbit * 1e6 / 8, delay_s=delay_ms / 1e3)
    return side, {"host": where, "testbed": state, "path": path}, link


def _over_testbed(args: argparse.Namespace, argv: list[str]) -> int:
    """Build the testbed, run the server and the client inside their hosts, tear it down."""
    from splitlab.testbed.pair import pair_hosts, run_pair
    from splitlab.testbed.session import Testbed

    topo = _topology(args.testbed)
    client, server = pair_hosts(topo)
    again = [sys.executable, str(Path(__file__).resolve()), *argv]
    if args.no_amqp or not _broker_up() or 5672 not in topo.root_ports:
        again.append("--no-amqp")
    with Testbed(topo) as tb:
        sides = {s: [*again, "--side", s, "--session", tb.session] for s in ("client", "server")}
        return run_pair(tb, client=(client, sides["client"]), server=(server, sides["server"]),
                        timeout_s=900 if args.quick else 7200)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = bench_arg_parser(__doc__.splitlines()[0], testbed=True)
    parser.add_argument("--reps", type=int, default=None, help="repetitions per size and method")
    parser.add_argument("--no-amqp", action="store_true", help="skip the RabbitMQ transport")
    parser.add_argument("--sizes-kib", type=size_list, default=SIZES, metavar="KIB,...",
                        help="payload sizes in KiB (default "
                             f"{','.join(str(s // KIB) for s in SIZES)}); on a shaped link those "
                             "over 1 MiB that take too long are left out")  # fmt: skip
    parser.add_argument("--spin-us", type=float, default=SPIN_US,
                        help="how long raw and TCP receives look for a frame before they sleep "
                             f"(transport.spin_us; default {SPIN_US:g}, 0 = sleep at once)")  # fmt: skip
    # set by a testbed run for the two processes it starts inside its hosts
    parser.add_argument("--side", choices=["client", "server"], help=argparse.SUPPRESS)
    parser.add_argument("--session", help=argparse.SUPPRESS)
    parser.add_argument(CONTROL_FD_FLAG, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.testbed != "none" and args.side is None:
        return _over_testbed(args, sys.argv[1:] if argv is None else list(argv))
    return _run(args)


def _cold_us(sweep: torch.Tensor, call: Callable[[], object]) -> float:
    """Microseconds of `call` right after streaming `sweep` through the caches."""
    sweep.add_(1.0)
    t0 = time.perf_counter()
    call()
    return (time.perf_counter() - t0) * 1e6


def header_cold_us(samples: int) -> dict[str, float]:
    """Median microseconds to encode and to parse a ring hidden state's header (float32
    [1, 1, 576], meta step and pos) in each form, each call right after streaming 128 MiB
    through the caches (as a stage's compute streams its weights before it sends and after
    it receives): the per-frame cost that cold caches multiply."""
    sweep = torch.zeros(32 << 20)  # 128 MiB of float32
    routing, specs = (
        Routing(session=SESSION, stage=1),
        [TensorSpec("h", "float32", (1, 1, 576), 2304)],
    )
    meta = {"step": 7, "pos": 49}
    binary = encode_binary_header("hidden", LANE, routing, "stage-0", 0, meta, specs)
    text = encode_header("hidden", LANE, routing, "stage-0", 0, meta, specs)
    assert binary is not None and parse_header(binary[4:]) == parse_header(text[4:])
    calls = {
        "json_encode": lambda: encode_header("hidden", LANE, routing, "stage-0", 0, meta, specs),
        "json_parse": lambda: parse_header(text[4:]),
        "binary_encode": lambda: encode_binary_header(
            "hidden", LANE, routing, "stage-0", 0, meta, specs
        ),  # fmt: skip
        "binary_parse": lambda: parse_header(binary[4:]),
        "nothing": lambda: None,  # the timer and a call on cold caches
    }
    times: dict[str, list[float]] = {k: [] for k in calls}
    for _ in range(samples):
        for name, call in calls.items():
            times[name].append(_cold_us(sweep, call))
    return {name: median(v) for name, v in times.items()}


def hop_cold_us(samples: int) -> dict[str, float]:
    """Median microseconds of one ring hop's send and receive (a hidden state, float32
    [1, 1, 576], meta step and pos), each right after streaming 128 MiB through the caches,
    through the TCP transport and through raw `sendmsg` / `recv_into` of the same bytes plus
    a 64-byte stand-in header; both in this process over loopback, the frame already there
    when the receive starts. What a stage pays per hop after its compute, beyond the kernel."""
    sweep = torch.zeros(32 << 20)
    hidden = torch.randn(1, 1, 576)
    a = TcpTransport("hop-a", key=KEY, session=SESSION, bind_host="127.0.0.1", pinned="off")
    b = TcpTransport("hop-b", key=KEY, session=SESSION, bind_host="127.0.0.1", pinned="off")
    server = socket.create_server(("127.0.0.1", 0))
    out = socket.create_connection(server.getsockname())
    inn, _ = server.accept()
    try:
        a.connect("hop-b", *b.address, timeout_s=10)
        b.wait_connected("hop-a", [LANE], timeout_s=10)
        send, recv = a.channel("hop-b", LANE), b.channel("hop-a", LANE)
        out.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        parts = [b"h" * 64, memoryview(hidden.numpy()).cast("B")]
        buf = bytearray(64 + hidden.nbytes)
        view = memoryview(buf)

        def tcp_send(step: int) -> None:
            send.send("hidden", {"h": hidden}, meta={"step": step, "pos": step})

        def tcp_recv() -> None:
            msg = recv.recv()
            msg.tensors["h"].sum()
            msg.release()

        def raw_send(step: int) -> None:
            out.sendmsg(parts)

        def raw_recv() -> None:
            inn.recv_into(view, len(buf), socket.MSG_WAITALL)
            torch.frombuffer(buf, dtype=torch.float32, offset=64).sum()

        times: dict[str, list[float]] = {
            k: [] for k in ("tcp_send", "tcp_recv", "raw_send", "raw_recv")
        }
        for step in range(samples):
            for arm, sender, receiver in (("tcp", tcp_send, tcp_recv), ("raw", raw_send, raw_recv)):
                times[f"{arm}_send"].append(_cold_us(sweep, partial(sender, step)))
                time.sleep(0.001)  # the frame is there when the receive starts
                times[f"{arm}_recv"].append(_cold_us(sweep, receiver))
        return {k: median(v) for k, v in times.items()}
    finally:
        a.close(drain_timeout_s=0)
        b.close(drain_timeout_s=0)
        for sock in (out, inn, server):
            sock.close()


def _paired(pipe: Any, cmd: tuple[str, str, int, int], run: Callable[[], Any]) -> Any:
    """Have the server side do `cmd` (method, mode, size, count) while this side does `run`;
    returns what `run` returned."""
    pipe.send(cmd)
    pipe.recv()  # the server is ready
    out = run()
    pipe.recv()  # the server is done
    return out


def _run(args: argparse.Namespace) -> int:
    """One side of a testbed run (--side), or the whole loopback run."""
    reps = args.reps or (3 if args.quick else 7)
    on_testbed = args.side is not None
    broker = not args.no_amqp and (on_testbed or _broker_up())
    methods = ["raw", "tcp"] + (["amqp"] if broker else [])
    torch.set_num_threads(1)
    side, where, link = _Side(), {"host": LOOPBACK}, _Link()
    if on_testbed:
        side, where, link = _testbed_side(args)
    if not 0 <= args.spin_us <= MAX_SPIN_US:
        print(f"bench_transport: --spin-us={args.spin_us} must be in [0, {MAX_SPIN_US:g}]",
              file=sys.stderr)  # fmt: skip
        return 2
    side = dataclasses.replace(side, spin_us=args.spin_us)
    if args.side == "server":
        _serve(Connection(args.control_fd), broker, side)
        return 0
    sizes = _sizes(args.quick, link, args.sizes_kib)

    child = None
    if on_testbed:
        pipe = Connection(args.control_fd)  # this side's end of run_pair's socket pair
    else:
        ctx = mp.get_context("spawn")
        pipe, child_pipe = ctx.Pipe()
        child = ctx.Process(target=_serve, args=(child_pipe, broker, side), daemon=True)
        child.start()
    try:
        addresses = pipe.recv()
        client = _Client(addresses, broker, side)
        report = BenchReport("transport", config={
            "quick": args.quick, "reps": reps, "sizes_bytes": sizes, "methods": methods,
            "spin_us": args.spin_us, **where,
        })  # fmt: skip
        # every arm runs in these two processes: their policies are the arms' policies
        report.add_arm("client", thread_policy(torch_threads=torch.get_num_threads()))
        report.add_arm("server", addresses["threads"])
        tput: dict[tuple[str, int], float] = {}
        rtt: dict[tuple[str, int], float] = {}
        for size in sizes:
            frames, pings = _counts(size, args.quick, link)
            payload = torch.randint(0, 255, (size,), dtype=torch.uint8)
            if link.bytes_per_s <= 0:  # loopback: a raw pilot (and warm-up) sizes the streams
                pilot_s = _paired(pipe, ("raw", "stream", size, frames),
                                  partial(client.stream_s, "raw", payload, frames))  # fmt: skip
                frames = scaled_frames(frames, pilot_s, args.quick)
            samples: dict[str, dict[str, list[float]]] = {
                m: {"tput": [], "rtt": []} for m in methods
            }
            for rep in range(reps):
                for m in methods[rep % len(methods) :] + methods[: rep % len(methods)]:
                    seconds = _paired(pipe, (m, "stream", size, frames),
                                      partial(client.stream_s, m, payload, frames))  # fmt: skip
                    samples[m]["tput"].append(frames * size / seconds)
                    samples[m]["rtt"].extend(_paired(pipe, (m, "rtt", size, pings),
                                                     partial(client.rtts_s, m, payload, pings)))  # fmt: skip
            for m in methods:
                tput[m, size] = median(samples[m]["tput"])
                rtt[m, size] = median(samples[m]["rtt"])
                report.add_result(
                    method=m, payload_bytes=size, frames_per_run=frames, pings_per_run=pings,
                    throughput_bytes_per_s=tput[m, size], rtt_ms=rtt[m, size] * 1e3,
                )  # fmt: skip
            print(
                f"{size >> 10:>6} KiB  " + "  ".join(
                    f"{m}: {tput[m, size] / MIB:8.1f} MiB/s {rtt[m, size] * 1e6:9.1f} us" for m in methods
                ),
                file=sys.stderr,
            )  # fmt: skip
        for size in sizes:
            label = f"{size >> 10}KiB" if size < MIB else f"{size >> 20}MiB"
            report.add_ratio(
                f"tcp_vs_raw_throughput_{label}", tput["tcp", size] / tput["raw", size]
            )
            report.add_ratio(f"tcp_vs_raw_rtt_{label}", rtt["tcp", size] / rtt["raw", size])
            if broker:
                report.add_ratio(
                    f"tcp_vs_amqp_throughput_{label}", tput["tcp", size] / tput["amqp", size]
                )
            if size >= MIB:
                report.add_target(
                    f"tcp_vs_raw_throughput_{label}",
                    report.ratios[f"tcp_vs_raw_throughput_{label}"],
                    0.95,
                    ">=",
                )
                if broker and not on_testbed:  # on a link both arms meet its rate
                    report.add_target(
                        f"tcp_vs_amqp_throughput_{label}",
                        report.ratios[f"tcp_vs_amqp_throughput_{label}"],
                        5.0,
                        ">=",
                    )
        if 4 * KIB in sizes:  # the small-frame targets (`--sizes-kib` may leave 4 KiB out)
            for name, goal, op in (("rtt", 1.5, "<="), ("throughput", 0.7, ">=")):
                key = f"tcp_vs_raw_{name}_4KiB"
                report.add_target(key, report.ratios[key], goal, op)
        if link.bytes_per_s > 0:
            _add_shaped_rate(report, tput, sizes, methods, link.bytes_per_s)
        if not on_testbed:  # per-frame costs, in this process: loopback runs only
            cold = header_cold_us(10 if args.quick else 60)
            report.add_result(header_cold_us=cold)
            report.add_ratio(
                "binary_vs_json_header_cold",
                (cold["binary_encode"] + cold["binary_parse"])
                / (cold["json_encode"] + cold["json_parse"]),
            )
            print("header on cold caches (us): " + ", ".join(f"{k} {v:.1f}" for k, v in cold.items()),
                  file=sys.stderr)  # fmt: skip
            hop = hop_cold_us(10 if args.quick else 60)
            report.add_result(hop_cold_us=hop)
            report.add_ratio(
                "tcp_vs_raw_hop_cold",
                (hop["tcp_send"] + hop["tcp_recv"]) / (hop["raw_send"] + hop["raw_recv"]),
            )
            print("a ring hop on cold caches (us): " + ", ".join(f"{k} {v:.1f}" for k, v in hop.items()),
                  file=sys.stderr)  # fmt: skip
        report.config["tcp_counters"] = client.tcp.counters()
        report.write(args.out)
        pipe.send(None)
        client.tcp.close()
        if client.amqp is not None:
            client.amqp.close()
        client.raw.close()
    finally:
        if child is not None:
            child.join(timeout=30)
            if child.is_alive():
                child.terminate()
    return report.exit_code(require_quiet=args.require_quiet)


def _add_shaped_rate(report: BenchReport, tput: dict[tuple[str, int], float], sizes: list[int],
                     methods: list[str], link_bytes_per_s: float) -> None:  # fmt: skip
    """Each arm's share of the path's shaped rate; the TCP transport's is a target."""
    for size in sizes:
        label = f"{size >> 10}KiB" if size < MIB else f"{size >> 20}MiB"
        for m in methods:
            report.add_ratio(f"{m}_vs_shaped_rate_{label}", tput[m, size] / link_bytes_per_s)
        if size >= MIB:
            name = f"tcp_vs_shaped_rate_{label}"
            report.add_target(name, report.ratios[name], SHAPED_RATE_GOAL, ">=")


if __name__ == "__main__":
    raise SystemExit(tool_exit("bench_transport", main))
