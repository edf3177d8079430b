"""Fuzz every network listener splitlab has with malformed input, then check it still serves.

Listeners: `data` (a `TcpTransport`: wire/accept.py, the wire/auth.py handshake, frames read
by wire/tcp_reader.py), `bus` (the `EmbeddedBusServer`) and `ctrl` (a ring head's transport,
`stage-0`, whose control lane is read as barrier messages through `ring_wire.ctrl_message`).
Each listener runs in a spawned child process (the host), so its RSS, threads and open
descriptors are read from /proc/PID; the data and ctrl hosts drain every lane the way a stage
does. The parent sends `--inputs` malformed inputs per listener over real sockets, a few
connections at once, each input one connection: pre-auth garbage, truncated and trickled
handshakes, huge length prefixes, wrong-key handshakes, and after a correct handshake
malformed frames (bad JSON, NaN/inf in meta, wrong tensor specs, lengths that disagree with
the payload, unknown kinds and lanes, bit flips of a valid frame). Inputs are built by pure
functions of a seeded RNG (`make_input`), so a run is reproducible.

Per listener it reports inputs sent, crashes (the host died or stopped accepting), RSS growth
(MB; also after `malloc_trim`, which tells live memory from heap kept for reuse), threads and
fds before vs after a settle, inputs the application received although malformed, and
whether a legitimate client is served afterwards. Exit 1 when any of these
fails (`FAILS` below), else 0. The JSON follows DESIGN.md's benchmark shape.

    nice -n 19 .venv/bin/python tools/fuzz_listeners.py --out outputs/bench/fuzz.json
    nice -n 19 .venv/bin/python tools/fuzz_listeners.py --inputs 500 --only bus --seed 3
"""

from __future__ import annotations

import ctypes
import json
import logging
import math
import multiprocessing as mp
import os
import random
import re
import socket
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from splitlab.control.embedded import _REALM, _SERVER_ID, EmbeddedBus, EmbeddedBusServer  # noqa: E402
from splitlab.control.messages import Ack, Kind, Plan, Propose  # noqa: E402
from splitlab.errors import PeerLostError, ProtocolError, WaitTimeoutError, tool_exit  # noqa: E402
from splitlab.infer.ring_wire import CtrlChannel, ctrl_frame, ctrl_message, stage_peer  # noqa: E402
from splitlab.telemetry.bench import BenchReport, bench_arg_parser  # noqa: E402
from splitlab.telemetry.log import leave
from splitlab.wire.auth import client_handshake  # noqa: E402
from splitlab.wire.blobs import read_blob_frame  # noqa: E402
from splitlab.wire.errors import AuthError  # noqa: E402
from splitlab.wire.frame import Lane  # noqa: E402
from splitlab.wire.header import MAX_HEADER_BYTES, PREFIX  # noqa: E402
from splitlab.wire.session_key import node_key  # noqa: E402
from splitlab.wire.tcp import TcpTransport  # noqa: E402

LISTENERS = ("data", "bus", "ctrl")
KEY, WRONG_KEY, SESSION = b"fuzz-key-" * 4, b"not-the-key-" * 3, "fuzz"
SERVER_ID = {"data": "host", "ctrl": stage_peer(0), "bus": _SERVER_ID}
REALM = {"data": SESSION, "ctrl": SESSION, "bus": _REALM}
PRE_AUTH = ("garbage", "truncated_handshake", "huge_prefix", "slow_partial", "wrong_key")
POST_AUTH = ("bad_json", "nan_meta", "bad_tensor_spec", "length_mismatch", "unknown_kind_lane",
             "bit_flip", "huge_announce")  # fmt: skip
FAMILIES = PRE_AUTH + POST_AUTH
# Families the application may legitimately receive: a data frame's kind and meta are free
# JSON that its consumer checks (the wire refuses only what breaks framing), and a bit flip
# may leave a frame valid. Every other family must never reach the application.
MAY_DELIVER = {"data": {"nan_meta", "unknown_kind_lane", "bit_flip"}, "ctrl": {"bit_flip"},
               "bus": {"bit_flip"}}  # fmt: skip
FAILS = {"rss_growth_mb": 20.0}
SETTLE_S = 15.0  # how long threads and fds may take to return to their baseline
CLOSE_WAIT_S = 5.0  # an input the host has not closed by then (after our FIN) is a hang


# ---- inputs: pure functions of (listener, family, rng) ----
@dataclass(frozen=True)
class Input:
    """One connection's worth: an optional handshake, then `chunks` sent `pause_s` apart."""

    family: str
    handshake: str | None  # None, "right" or "wrong" (key)
    lane: str  # the lane the handshake names
    chunks: tuple[bytes, ...]
    pause_s: float = 0.0
    bus_hello: bool = False  # bus: a well-formed hello first (its reply is owed), then the rest


def raw_header(obj: Any) -> bytes:
    """`u32 length | JSON` of `obj` (NaN and Infinity written as JSON's extensions allow)."""
    text = obj if isinstance(obj, bytes) else json.dumps(obj, allow_nan=True).encode()
    return PREFIX.pack(len(text)) + text


def _header(kind: str, lane: str, meta: dict[str, Any], tensors: list[dict[str, Any]]) -> dict[str, Any]:  # fmt: skip
    return {"v": 1, "kind": kind, "lane": lane, "src": None, "prio": 0, "ids": {}, "meta": meta,
            "tensors": tensors}  # fmt: skip


def _hello_frame(rng: random.Random, listener: str) -> bytes:
    return raw_header(_header("hello", "activation", {
        "session": REALM[listener], "client_id": f"c{rng.randrange(1 << 30)}", "lane": "control",
        "client_nonce": rng.randbytes(16).hex()}, []))  # fmt: skip


def _valid_frame(rng: random.Random, listener: str, lane: str) -> tuple[dict[str, Any], bytes]:
    """A well-formed frame for `listener`: its header dict and payload."""
    if listener == "data":
        n = rng.randrange(1, 64)
        spec = {"name": "x", "dtype": "float32", "shape": [n], "bytes": 4 * n}
        return _header("act", lane, {"step": rng.randrange(100)}, [spec]), rng.randbytes(4 * n)
    if listener == "ctrl":
        kind, meta = ctrl_frame(Propose(epoch=rng.randrange(9), token=rng.randrange(99), cuts=(2,)))
        return _header(kind, "control", meta, []), b""
    if rng.random() < 0.5:
        return _header("consume", "activation", {"max": 1, "timeout_s": 0}, []), b""
    body = rng.randbytes(rng.randrange(1, 64))
    spec = {"name": "body", "dtype": "uint8", "shape": [len(body)], "bytes": len(body)}
    return _header("publish", "activation", {"queue": "splitlab.fuzz.x"}, [spec]), body


_NANS = ("NaN", "Infinity", "-Infinity", "1e999", "-1e999")
_BAD_SPECS = (
    {"name": "x", "dtype": "complex64", "shape": [4], "bytes": 32},
    {"name": "x", "dtype": "float32", "shape": [-1], "bytes": -4},
    {"name": "x", "dtype": "float32", "shape": [1] * 9, "bytes": 4},
    {"name": "x", "dtype": "float32", "shape": [1 << 41], "bytes": 1 << 43},
    {"name": "x", "dtype": "float32", "shape": [4], "bytes": 15},
    {"name": "", "dtype": "int8", "shape": [1], "bytes": 1},
    {"name": "x", "dtype": "float32", "shape": "4", "bytes": 16},
    {"name": "x", "dtype": "float32", "shape": [4.0], "bytes": 16},
    {"name": "x", "dtype": ["float32"], "shape": [4], "bytes": 16},
    {"name": "x", "dtype": "float32", "shape": [4], "bytes": True},
    [1, 2, 3],
)


def _post_auth(rng: random.Random, listener: str, family: str, lane: str) -> list[bytes]:
    """The malformed frame (as chunks) of a post-auth family."""
    header, payload = _valid_frame(rng, listener, lane)
    if family == "bad_json":
        text = json.dumps(header).encode()
        bad = rng.choice([
            text[: rng.randrange(1, len(text))], b"[1,2,3]", b'"str"', b"\xff\xfe" + text[2:],
            b"[" * 5000 + b"]" * 5000, text.replace(b'"v": 1', b'"v": 2'), b"{" + text,
            text + b" trailing", b"null", text.replace(b'"meta"', b'"meta":{}, "meta"', 1)[:-3],
        ])  # fmt: skip
        return [raw_header(bad[:MAX_HEADER_BYTES]), payload]
    if family == "nan_meta":  # a number of the meta becomes NaN or +-inf (or overflows)
        if listener == "bus":
            header, payload = _header("consume", "activation", {"max": 1, "timeout_s": 0}, []), b""
        field = {"data": "step", "ctrl": rng.choice(["epoch", "token"]),
                 "bus": rng.choice(["max", "timeout_s"])}[listener]  # fmt: skip
        text = json.dumps(header).encode()
        text = re.sub(
            rb'("%s": )-?[0-9.]+' % field.encode(), rb"\g<1>" + rng.choice(_NANS).encode(), text
        )
        return [raw_header(text), payload]
    if family == "bad_tensor_spec":
        specs = [
            dict(s) if isinstance(s, dict) else s
            for s in rng.sample(_BAD_SPECS, rng.randrange(1, 3))
        ]
        if listener == "bus" and rng.random() < 0.5:  # a blob must be rank-1 uint8
            specs = [{"name": "body", "dtype": "float32", "shape": [2], "bytes": 8}]
        if listener == "ctrl" and rng.random() < 0.3:  # a barrier message carries no tensors
            specs = [{"name": "x", "dtype": "uint8", "shape": [4], "bytes": 4}]
            return [raw_header({**header, "tensors": specs}), rng.randbytes(4)]
        if rng.random() < 0.2:
            specs = {"x": 1}  # type: ignore[assignment]
        return [raw_header({**header, "tensors": specs}), rng.randbytes(rng.randrange(0, 64))]
    if family == "length_mismatch":
        head = raw_header(header)
        n = len(head) - 4
        how = rng.randrange(4)
        if how == 0:  # the prefix announces more header than comes
            return [PREFIX.pack(n + rng.randrange(1, 512)) + head[4:]]
        if how == 1:  # less: the header is cut and the rest reads as the next frame
            return [PREFIX.pack(rng.randrange(1, n)) + head[4:], payload]
        if how == 2 and payload:  # the payload stops short of its spec
            return [head, payload[: rng.randrange(len(payload))]]
        # a spec whose byte count disagrees with its shape, and a payload of that count
        k = rng.randrange(1, 256)
        spec = {"name": "x", "dtype": "uint8", "shape": [k], "bytes": k + rng.choice([-1, 1, k])}
        return [raw_header({**header, "tensors": [spec]}), rng.randbytes(max(spec["bytes"], 0))]
    if family == "unknown_kind_lane":
        header = dict(header)
        which = rng.randrange(3)
        if which == 0:
            header["kind"] = rng.choice(["", "x" * 65, 7, None, "reboot", "\u0000"])
        elif which == 1:
            header["lane"] = rng.choice(["bogus", "", 3, None, "ACTIVATION"])
        else:
            header["kind"] = rng.choice(["reboot", "frobnicate", "stop_everything"])
        return [raw_header(header), payload]
    if family == "bit_flip":
        frame = bytearray(raw_header(header))
        for _ in range(rng.randrange(1, 9)):
            bit = rng.randrange(len(frame) * 8)
            frame[bit // 8] ^= 1 << (bit % 8)
        return [bytes(frame), payload]
    if family == "huge_announce":
        if rng.random() < 0.5:
            return [PREFIX.pack(rng.randrange(MAX_HEADER_BYTES + 1, 1 << 32)) + rng.randbytes(64)]
        size = rng.choice([1 << 20, 64 << 20, 200 << 20, 1 << 30, 1 << 40])
        dtype = "uint8" if listener == "bus" else "float32"
        n = size if dtype == "uint8" else size // 4
        name = "body" if listener == "bus" else "x"
        spec = {"name": name, "dtype": dtype, "shape": [n], "bytes": size}
        return [raw_header({**header, "tensors": [spec]}), rng.randbytes(rng.randrange(0, 4096))]
    raise ValueError(f"unknown post-auth family {family!r}")


def make_input(listener: str, family: str, rng: random.Random) -> Input:
    """One malformed input of `family` for `listener` (a pure function of the RNG state)."""
    if listener not in LISTENERS:
        raise ValueError(f"listener must be one of {LISTENERS}, got {listener!r}")
    lane = "control" if listener != "data" else rng.choice([x.value for x in Lane])
    if family == "garbage":
        size = rng.choice(
            [rng.randrange(0, 64), rng.randrange(64, 4096), rng.randrange(4096, 65536)]
        )
        return Input(family, None, lane, (rng.randbytes(size),))
    if family == "truncated_handshake":
        hello = _hello_frame(rng, listener)
        return Input(family, None, lane, (hello[: rng.randrange(0, len(hello))],))
    if family == "huge_prefix":
        n = rng.choice([rng.randrange(4097, 1 << 16), rng.randrange(1 << 16, 1 << 32), 0])
        return Input(family, None, lane, (PREFIX.pack(n) + rng.randbytes(rng.randrange(0, 256)),))
    if family == "slow_partial":
        hello = _hello_frame(rng, listener)
        cut = rng.randrange(1, len(hello))
        parts = (
            sorted(rng.sample(range(1, cut), min(rng.randrange(1, 6), cut - 1))) if cut > 1 else []
        )
        edges = [0, *parts, cut]
        chunks = tuple(hello[a:b] for a, b in zip(edges, edges[1:], strict=False))
        return Input(family, None, lane, chunks, pause_s=rng.uniform(0.002, 0.02))
    if family == "wrong_key":
        return Input(family, "wrong", lane, ())
    if family not in POST_AUTH:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    if family == "unknown_kind_lane" and rng.random() < 0.3:  # a lane the handshake names
        return Input(family, "right", rng.choice(["bogus", "ACTIVATION", "x" * 200]), ())
    bus_hello = listener == "bus" and rng.random() < 0.5  # past the bus's own hello
    chunks = tuple(c for c in _post_auth(rng, listener, family, lane) if c)
    return Input(family, "right", lane, chunks, bus_hello=bus_hello)


def make_inputs(listener: str, n: int, seed: int) -> list[Input]:
    rng = random.Random(f"{seed}-{listener}")
    return [make_input(listener, FAMILIES[i % len(FAMILIES)], rng) for i in range(n)]


# ---- sending one input ----
def _bus_hello(node_id: str) -> bytes:
    return raw_header(_header("hello", "activation", {"session": SESSION, "node_id": node_id,
                                                      "prefetch": 1}, []))  # fmt: skip


def send_input(address: tuple[str, int], listener: str, inp: Input, client_id: str) -> tuple[str, int]:  # fmt: skip
    """Send one input, then half-close and wait for the host to close: ("closed", replies
    that were not errors beyond those owed), ("hang", 0) when it keeps the connection open,
    ("refused", 0) when the connection could not be made."""
    try:
        sock = socket.create_connection(address, timeout=CLOSE_WAIT_S)
    except OSError:
        return "refused", 0
    with sock:
        try:
            if inp.handshake is not None:
                key = KEY if inp.handshake == "right" else WRONG_KEY
                if listener == "bus":  # the bus checks the credential of the node named
                    key = node_key(client_id, key)
                client_handshake(sock, key=key, session=REALM[listener], client_id=client_id,
                                 server_id=SERVER_ID[listener], lane=inp.lane,
                                 timeout_s=CLOSE_WAIT_S)  # fmt: skip
            if inp.bus_hello:
                sock.sendall(_bus_hello(client_id))
            for i, chunk in enumerate(inp.chunks):
                if i and inp.pause_s:
                    time.sleep(inp.pause_s)
                sock.sendall(chunk)
            sock.shutdown(socket.SHUT_WR)
        except (AuthError, OSError, ProtocolError):
            pass  # refused during the handshake or reset while sending: read what is left
        return _await_close(sock, listener, inp)


def _await_close(sock: socket.socket, listener: str, inp: Input) -> tuple[str, int]:
    deadline = time.monotonic() + CLOSE_WAIT_S
    replies = 0
    if listener == "bus" and inp.handshake == "right":
        scratch = bytearray(4 + MAX_HEADER_BYTES)
        while time.monotonic() < deadline:
            sock.settimeout(max(deadline - time.monotonic(), 1e-3))
            try:
                header, _ = read_blob_frame(sock.recv_into, scratch, max_frame_bytes=1 << 20)
            except TimeoutError:
                return "hang", 0
            except (ProtocolError, OSError):
                return "closed", max(0, replies - inp.bus_hello)
            replies += header.kind == "reply"
        return "hang", 0
    while time.monotonic() < deadline:
        sock.settimeout(max(deadline - time.monotonic(), 1e-3))
        try:
            if not sock.recv(65536):
                return "closed", 0
        except TimeoutError:
            return "hang", 0
        except OSError:
            return "closed", 0
    return "hang", 0


# ---- the host process ----
def _drain(t: TcpTransport, lane: Lane, listener: str, stop: threading.Event,
           delivered: Counter) -> None:  # fmt: skip
    """Read `lane` as a stage does; answer the legitimate client; count what got through."""
    while not stop.is_set():
        try:
            msg = t.recv(lane, timeout_s=0.2)
        except (WaitTimeoutError, PeerLostError, ProtocolError):
            continue
        with msg:
            try:
                got = ctrl_message(msg.header) if listener == "ctrl" else msg.kind
            except ProtocolError:
                continue  # refused: the stream is in step, the connection goes on
            if msg.peer.startswith("legit"):
                if listener == "ctrl":
                    reply = Ack(epoch=got.epoch, stage=0)  # type: ignore[union-attr]
                    CtrlChannel(t.channel(msg.peer, Lane.CONTROL, timeout_s=5)).send(reply)
                else:
                    t.send(msg.peer, lane, "echo", {"x": msg.tensors["x"] * 2}, timeout_s=5)
            else:
                delivered[msg.peer.rsplit("-", 1)[-1]] += 1


def host_main(listener: str, pipe: Any) -> None:
    """The child: host `listener` until the parent says stop; report what it received."""
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.ERROR)  # a refusal per input is logged: keep errors only
    stop, delivered = threading.Event(), Counter()
    if listener == "bus":
        server = EmbeddedBusServer(authkey=KEY)
        address = (server.start().host, server.address.port)
    else:
        t = TcpTransport(SERVER_ID[listener], key=KEY, session=SESSION, stall_timeout_s=2.0,
                         handshake_timeout_s=2.0, pool_bytes=256 << 20)  # fmt: skip
        address = t.address
        lanes = [Lane.CONTROL] if listener == "ctrl" else list(Lane)
        for lane in lanes:
            threading.Thread(target=_drain, args=(t, lane, listener, stop, delivered),
                             daemon=True, name=f"drain-{lane.value}").start()  # fmt: skip
    pipe.send({"pid": os.getpid(), "address": address})
    while pipe.recv() == "trim":  # hand freed heap back to the kernel: what stays is live
        ctypes.CDLL(None).malloc_trim(0)
        pipe.send("trimmed")
    stop.set()
    pipe.send(dict(delivered))
    if listener == "bus":
        pipe.send({"queues": len(server.queue_names())})
        server.close()
    else:
        pipe.send({**t.counters(), "connections": len(t.connections())})
        t.close(drain_timeout_s=0)


def legit_served(listener: str, address: tuple[str, int]) -> bool:
    """Whether a well-behaved client gets its answer from the host within a few seconds."""
    try:
        if listener == "bus":
            kw = {"host": address[0], "port": address[1], "authkey": KEY, "session": SESSION,
                  "timeout_s": 5.0}  # fmt: skip
            a = EmbeddedBus.connect(node_id="legit-a", **kw)  # type: ignore[arg-type]
            b = EmbeddedBus.connect(node_id="legit-b", **kw)  # type: ignore[arg-type]
            try:
                a.publish("legit-b", Plan(session_id=SESSION, sender="legit-a",
                                          counts_by_worker={"w0": 1}))  # fmt: skip
                got = b.consume(5.0)
                ok = got is not None and got.message.kind is Kind.PLAN
                if got is not None:
                    got.ack()
                b.cleanup()
                a.cleanup()
                return ok
            finally:
                a.close()
                b.close()
        me = "legit-" + ("stage" if listener == "ctrl" else "data")
        with TcpTransport(me, key=KEY, session=SESSION) as c:
            lane = Lane.CONTROL if listener == "ctrl" else Lane.ACTIVATION
            c.connect(SERVER_ID[listener], *address, lanes=[lane], timeout_s=5)
            if listener == "ctrl":
                ch = CtrlChannel(c.channel(SERVER_ID[listener], lane, timeout_s=5))
                ch.send(Propose(epoch=7, token=1, cuts=(2,)))
                return ch.recv() == Ack(epoch=7, stage=0)
            c.send(SERVER_ID[listener], lane, "legit", {"x": torch.arange(4.0)}, timeout_s=5)
            with c.recv(lane, timeout_s=5) as msg:
                return torch.equal(msg.tensors["x"], torch.arange(4.0) * 2)
    except (PeerLostError, ProtocolError, WaitTimeoutError, OSError) as exc:
        print(f"fuzz_listeners: legitimate {listener} client not served: {exc}", file=sys.stderr)
        return False


def proc_stats(pid: int) -> dict[str, float]:
    """RSS (MB), threads and open fds of process `pid` from /proc."""
    out = {}
    with open(f"/proc/{pid}/status", encoding="utf-8") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                out["rss_mb"] = int(line.split()[1]) / 1024
            elif line.startswith("Threads:"):
                out["threads"] = int(line.split()[1])
    out["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
    return out


def _settled(pid: int, base: dict[str, float]) -> dict[str, float]:
    deadline = time.monotonic() + SETTLE_S
    while True:
        now = proc_stats(pid)
        if (
            now["threads"] <= base["threads"] and now["fds"] <= base["fds"]
        ) or time.monotonic() > deadline:
            return now
        time.sleep(0.25)


def fuzz_listener(listener: str, n: int, seed: int, concurrency: int) -> dict[str, Any]:
    """Host `listener` in a child, throw `n` inputs at it, and return its figures."""
    ctx = mp.get_context("spawn")
    pipe, child_pipe = ctx.Pipe()
    child = ctx.Process(target=host_main, args=(listener, child_pipe), daemon=True)
    child.start()
    try:
        hello = pipe.recv()
        pid, address = hello["pid"], tuple(hello["address"])
        served_before = legit_served(listener, address)  # warms lazily built state first
        before = _settled(pid, proc_stats(pid))
        inputs = make_inputs(listener, n, seed)
        started = time.monotonic()
        outcomes: Counter = Counter()
        leaked: Counter = Counter()
        lock = threading.Lock()

        def one(i: int) -> None:
            inp = inputs[i]
            outcome, extra = send_input(address, listener, inp, f"fz{i}-{inp.family}")
            with lock:
                count(outcome, extra, inp.family)

        def count(outcome: str, extra: int, family: str) -> None:
            outcomes[outcome] += 1
            if extra:
                leaked[family] += extra
            if outcome != "closed":
                outcomes[f"{outcome}.{family}"] += 1

        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(one, range(n)))
        elapsed_s = time.monotonic() - started
        alive = child.is_alive()
        after = _settled(pid, before) if alive else {}
        served_after = alive and legit_served(listener, address)
        host: dict[str, Any] = {}
        trimmed = {}
        if alive:
            pipe.send("trim")
            pipe.recv()
            trimmed = proc_stats(pid)
            pipe.send("stop")
            delivered = pipe.recv()
            host = pipe.recv()
            for fam, k in delivered.items():
                leaked[fam] += k
    finally:
        child.join(timeout=15)
        if child.is_alive():
            child.terminate()
    refused_families = [f for f in FAMILIES if f not in MAY_DELIVER[listener]]
    return {
        "listener": listener, "host": "child process (spawn)", "inputs": n,
        "inputs_per_s": n / elapsed_s, "elapsed_s": elapsed_s,
        "families": {f: sum(1 for x in inputs if x.family == f) for f in FAMILIES},
        "outcomes": dict(outcomes), "crashes": int(not alive or outcomes["refused"] > 0),
        "hangs": outcomes["hang"],
        "rss_before_mb": before["rss_mb"], "rss_after_mb": after.get("rss_mb", math.nan),
        "rss_growth_mb": after.get("rss_mb", math.nan) - before["rss_mb"],
        # the same after malloc_trim: growth that is live memory, not heap kept for reuse
        "rss_growth_after_trim_mb": trimmed.get("rss_mb", math.nan) - before["rss_mb"],
        "threads_before": before["threads"], "threads_after": after.get("threads", -1),
        "fds_before": before["fds"], "fds_after": after.get("fds", -1),
        "delivered_by_family": dict(leaked),
        "malformed_delivered": sum(leaked[f] for f in refused_families),
        "legit_served_before": served_before, "legit_served_after": bool(served_after),
        "host_state": {k: v for k, v in host.items() if k in ("queues", "auth_refused",
                                                               "auth_ok", "peers_lost", "connections")},
    }  # fmt: skip


def failures(r: dict[str, Any]) -> list[str]:
    """What makes a listener's run fail, named; empty when it passed."""
    out = []
    if r["crashes"]:
        out.append("crashed or stopped accepting")
    if r["hangs"]:
        out.append(f"{r['hangs']} inputs left hanging")
    if not r["rss_growth_mb"] < FAILS["rss_growth_mb"]:
        out.append(f"RSS grew {r['rss_growth_mb']:.1f} MB")
    if r["threads_after"] > r["threads_before"] or r["fds_after"] > r["fds_before"]:
        out.append("threads or fds above baseline")
    if r["malformed_delivered"]:
        out.append(f"{r['malformed_delivered']} malformed inputs reached the application")
    if not r["legit_served_after"]:
        out.append("legitimate client not served")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = bench_arg_parser(__doc__.splitlines()[0])
    parser.add_argument("--inputs", type=int, default=10_000, help="malformed inputs per listener")
    parser.add_argument("--only", choices=LISTENERS, default=None, help="fuzz one listener")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--concurrency", type=int, default=16, help="connections at once")
    args = parser.parse_args(argv)
    if args.quick:
        args.inputs = min(args.inputs, 500)
    listeners = [args.only] if args.only else list(LISTENERS)
    report = BenchReport("fuzz_listeners", config={
        "inputs_per_listener": args.inputs, "seed": args.seed, "concurrency": args.concurrency,
        "listeners": listeners, "families": list(FAMILIES), "settle_s": SETTLE_S,
        "fail_when": {"rss_growth_mb": FAILS["rss_growth_mb"], "crashes": 1, "hangs": 1,
                      "threads_or_fds_above_baseline": True, "malformed_delivered": 1,
                      "legit_not_served": True},
    })  # fmt: skip
    failed = False
    print(f"{'listener':<9}{'inputs':>7}{'in/s':>7}{'crash':>6}{'hang':>5}{'rss MB':>8}{'trim':>7}"
          f"{'threads':>10}{'fds':>9}{'leak':>6}  legit  verdict")  # fmt: skip
    for listener in listeners:
        r = fuzz_listener(listener, args.inputs, args.seed, args.concurrency)
        bad = failures(r)
        r["failures"] = bad
        failed |= bool(bad)
        report.add_result(**r)
        report.add_target(
            f"{listener}_rss_growth_mb", r["rss_growth_mb"], FAILS["rss_growth_mb"], "<="
        )
        print(f"{listener:<9}{r['inputs']:>7}{r['inputs_per_s']:>7.0f}{r['crashes']:>6}{r['hangs']:>5}"
              f"{r['rss_growth_mb']:>8.1f}{r['rss_growth_after_trim_mb']:>7.1f}{r['threads_before']:>5}->{r['threads_after']:<3}"
              f"{r['fds_before']:>4}->{r['fds_after']:<3}{r['malformed_delivered']:>6}  "
              f"{'yes' if r['legit_served_after'] else 'NO':<5}  {'; '.join(bad) or 'ok'}")  # fmt: skip
    report.write(args.out)
    return 1 if failed else 0


if __name__ == "__main__":
    leave(tool_exit("fuzz_listeners", main))
