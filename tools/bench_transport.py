"""Tensor data plane benchmark: raw sockets (the ceiling) vs the TCP transport vs RabbitMQ.

For each payload size: one-way throughput (a stream of frames, then one small ack) and the
round-trip latency of one frame echoed back, for (a) raw `sendall`/`recv_into` sockets, (b) the
TCP transport and (c) the RabbitMQ transport. The parent process is the client and a spawned
child the server; methods alternate within every repetition, and medians are reported.

    .venv/bin/python tools/bench_transport.py --quick --out outputs/bench/transport.json
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from splitlab.telemetry.bench import BenchReport, bench_arg_parser, median  # noqa: E402
from splitlab.wire.frame import Lane  # noqa: E402
from splitlab.wire.tcp import TcpTransport  # noqa: E402

KIB, MIB = 1 << 10, 1 << 20
SIZES = [4 * KIB, 64 * KIB, 1 * MIB, 4 * MIB, 16 * MIB]
KEY, SESSION = b"bench-key", "bench"
LANE = Lane.ACTIVATION


def _counts(size: int, quick: bool) -> tuple[int, int]:
    """(frames per throughput run, pings per latency run)."""
    stream_bytes = (48 if quick else 256) * MIB
    frames = max(8, min(2000 if quick else 8000, stream_bytes // size))
    pings = max(5, min(200 if quick else 1000, (32 if quick else 128) * MIB // size))
    return frames, pings


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        k = sock.recv_into(view[got:], len(view) - got)
        if not k:
            raise ConnectionError("raw peer closed")
        got += k


# ---- server side (child process) ----
class _Server:
    def __init__(self, broker: bool) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.tcp = TcpTransport(
            "srv", key=KEY, session=SESSION, bind_host="127.0.0.1", pinned="off"
        )
        self.amqp = None
        if broker:
            from splitlab.wire.amqp import AmqpTransport

            self.amqp = AmqpTransport("srv", session=SESSION)
        self.raw: socket.socket | None = None

    def addresses(self) -> dict[str, Any]:
        return {"raw": self.listener.getsockname()[:2], "tcp": self.tcp.address}

    def accept_raw(self) -> None:
        self.raw, _ = self.listener.accept()
        self.raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def run(self, method: str, mode: str, size: int, count: int) -> None:
        if method == "raw":
            assert self.raw is not None
            buf = bytearray(size)
            view = memoryview(buf)
            for _ in range(count):
                _recv_exact(self.raw, view)
                if mode == "rtt":
                    self.raw.sendall(view)
            if mode == "stream":
                self.raw.sendall(b"k")
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


def _serve(pipe: Any, broker: bool) -> None:
    torch.set_num_threads(1)
    server = _Server(broker)
    pipe.send(server.addresses())
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
    server.raw and server.raw.close()


# ---- client side (parent) ----
class _Client:
    def __init__(self, addresses: dict[str, Any], broker: bool) -> None:
        self.raw = socket.create_connection(tuple(addresses["raw"]))
        self.raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.tcp = TcpTransport(
            "cli", key=KEY, session=SESSION, bind_host="127.0.0.1", pinned="off"
        )
        self.tcp.connect("srv", *addresses["tcp"], timeout_s=10)
        self.amqp = None
        if broker:
            from splitlab.wire.amqp import AmqpTransport

            self.amqp = AmqpTransport("cli", session=SESSION)
            self.amqp.connect("srv", timeout_s=30)

    def stream_s(self, method: str, payload: torch.Tensor, count: int) -> float:
        start = time.perf_counter()
        if method == "raw":
            view = memoryview(payload.numpy()).cast("B")
            for _ in range(count):
                self.raw.sendall(view)
            _recv_exact(self.raw, memoryview(bytearray(1)))
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
                self.raw.sendall(view)
                _recv_exact(self.raw, back)
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


def main(argv: list[str] | None = None) -> int:
    parser = bench_arg_parser(__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=None, help="repetitions per size and method")
    parser.add_argument("--no-amqp", action="store_true", help="skip the RabbitMQ transport")
    args = parser.parse_args(argv)
    reps = args.reps or (3 if args.quick else 7)
    broker = not args.no_amqp and _broker_up()
    methods = ["raw", "tcp"] + (["amqp"] if broker else [])
    torch.set_num_threads(1)

    ctx = mp.get_context("spawn")
    pipe, child_pipe = ctx.Pipe()
    child = ctx.Process(target=_serve, args=(child_pipe, broker), daemon=True)
    child.start()
    try:
        client = _Client(pipe.recv(), broker)
        report = BenchReport("transport", config={
            "quick": args.quick, "reps": reps, "sizes_bytes": SIZES, "methods": methods,
            "host": "127.0.0.1 loopback, client and server in two processes",
        })  # fmt: skip
        tput: dict[tuple[str, int], float] = {}
        rtt: dict[tuple[str, int], float] = {}
        for size in SIZES:
            frames, pings = _counts(size, args.quick)
            payload = torch.randint(0, 255, (size,), dtype=torch.uint8)
            samples: dict[str, dict[str, list[float]]] = {
                m: {"tput": [], "rtt": []} for m in methods
            }
            for rep in range(reps):
                for m in methods[rep % len(methods) :] + methods[: rep % len(methods)]:
                    pipe.send((m, "stream", size, frames))
                    pipe.recv()
                    seconds = client.stream_s(m, payload, frames)
                    pipe.recv()
                    samples[m]["tput"].append(frames * size / seconds)
                    pipe.send((m, "rtt", size, pings))
                    pipe.recv()
                    samples[m]["rtt"].extend(client.rtts_s(m, payload, pings))
                    pipe.recv()
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
        for size in SIZES:
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
                if broker:
                    report.add_target(
                        f"tcp_vs_amqp_throughput_{label}",
                        report.ratios[f"tcp_vs_amqp_throughput_{label}"],
                        5.0,
                        ">=",
                    )
        report.add_target("tcp_vs_raw_rtt_4KiB", report.ratios["tcp_vs_raw_rtt_4KiB"], 1.5, "<=")
        report.config["tcp_counters"] = client.tcp.counters()
        report.write(args.out)
        pipe.send(None)
        client.tcp.close()
        if client.amqp is not None:
            client.amqp.close()
        client.raw.close()
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.terminate()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
