"""TCP transport over real sockets between distinct loopback addresses.

.venv/bin/pytest tests/integration/test_wire_tcp.py -q
"""

from __future__ import annotations

import contextlib
import json
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from splitlab.errors import PeerLostError, WaitTimeoutError
from splitlab.telemetry.trace import Tracer
from splitlab.wire.base import Priority
from splitlab.wire.errors import FrameError, NonFiniteFrameError, PoolExhaustedError
from splitlab.wire.frame import DTYPES, Lane
from splitlab.wire.tcp import TcpTransport

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ is not a package yet
from wire_helpers import tcp_transport  # noqa: E402


@pytest.fixture
def pair() -> Iterator[tuple[TcpTransport, TcpTransport]]:
    a = tcp_transport("a", "127.0.0.2")
    b = tcp_transport("b", "127.0.0.3", check_finite=True, pool_bytes=64 << 20)
    a.connect("b", *b.address, timeout_s=5)
    yield a, b
    a.close(drain_timeout_s=0.5)
    b.close(drain_timeout_s=0.5)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def test_right_key_connects_across_loopback_addresses(
    pair: tuple[TcpTransport, TcpTransport],
) -> None:
    a, b = pair
    assert a.address[0] == "127.0.0.2" and b.address[0] == "127.0.0.3"
    accepted = b.connections()
    assert {c["lane"] for c in accepted} == set(Lane) and {c["peer"] for c in accepted} == {"a"}
    assert all(c["remote"][0] == "127.0.0.2" and c["local"][0] == "127.0.0.3" for c in accepted)


def test_every_dtype_and_non_contiguous_tensor_round_trips_bit_exact(
    pair: tuple[TcpTransport, TcpTransport],
) -> None:
    a, b = pair
    sent = {name: torch.randint(0, 2, (3, 4)).to(dt) for name, dt in DTYPES.items()}
    sent["bf16_t"] = torch.randn(5, 7, dtype=torch.bfloat16).t()
    sent["big"] = torch.randn(256, 1024)[:, ::2]
    a.send("b", Lane.ACTIVATION, "all", sent).wait(5)
    with b.recv(Lane.ACTIVATION, timeout_s=5) as msg:
        assert msg.peer == "a" and list(msg.tensors) == list(sent)
        for name, t in sent.items():
            assert msg.tensors[name].dtype == t.dtype and msg.tensors[name].shape == t.shape
            assert torch.equal(_bits(msg.tensors[name]), _bits(t)), name


def test_full_activation_lane_still_lets_a_gradient_through() -> None:
    a = tcp_transport("a", "127.0.0.2", send_queue_frames=2)
    b = tcp_transport("b", "127.0.0.3")
    try:
        a.connect("b", *b.address, timeout_s=5)
        x = torch.zeros(1 << 18)  # 1 MiB
        with pytest.raises(WaitTimeoutError, match="activation lane queue full"):
            for _ in range(256):  # far beyond queue + kernel buffers: b never reads activations
                a.send("b", Lane.ACTIVATION, "fwd", {"x": x}, timeout_s=0.2)
        a.send("b", Lane.GRADIENT, "bwd", {"g": x}, timeout_s=1).wait(5)
        with b.recv(Lane.GRADIENT, timeout_s=5) as msg:
            assert msg.kind == "bwd"
    finally:
        a.close(drain_timeout_s=0)
        b.close(drain_timeout_s=0)


def test_backward_overtakes_queued_forward(pair: tuple[TcpTransport, TcpTransport]) -> None:
    a, b = pair
    blocker = torch.zeros(4 << 20)  # 16 MiB: the sender thread stays inside it while b waits
    # b is not reading: the caller writes what fits at once, then the sender thread takes over
    a.send("b", Lane.ACTIVATION, "blocker", {"x": blocker}, timeout_s=0.1)
    a.send("b", Lane.ACTIVATION, "fwd", {"x": torch.ones(1)}, priority=Priority.FORWARD)
    a.send("b", Lane.ACTIVATION, "bwd", {"x": torch.ones(1)}, priority=Priority.BACKWARD)
    kinds = []
    for _ in range(3):
        with b.recv(Lane.ACTIVATION, timeout_s=5) as msg:
            kinds.append(msg.kind)
    assert kinds == ["blocker", "bwd", "fwd"]


def test_send_hands_what_the_socket_cannot_take_to_the_sender_thread(
    pair: tuple[TcpTransport, TcpTransport],
) -> None:
    a, b = pair
    big = torch.randn(4 << 20)  # 16 MiB, far above the kernel's buffers

    # One thread sends, then reads: with a send that waited for room (the peer reading), this
    # would hang until the send timeout; instead the rest goes out from the sender thread.
    ticket = a.send("b", Lane.ACTIVATION, "big", {"x": big}, timeout_s=600)
    unfinished = not ticket.done()
    with b.recv(Lane.ACTIVATION, timeout_s=30) as msg:
        received = msg.tensors["x"].clone()
    ticket.wait(30)

    assert unfinished
    assert torch.equal(received, big)


def test_dead_peer_surfaces_as_peer_lost_naming_it(pair: tuple[TcpTransport, TcpTransport]) -> None:
    a, b = pair
    b.close()
    start = time.monotonic()
    with pytest.raises(PeerLostError, match="'b'"):
        a.recv(Lane.GRADIENT, timeout_s=10, peer_id="b")
    assert time.monotonic() - start < 5
    with pytest.raises(PeerLostError, match="'b'"):
        for _ in range(100):
            a.send("b", Lane.GRADIENT, "g", {"g": torch.ones(1 << 16)}).wait(5)


def test_recv_timeout_raises_wait_timeout(pair: tuple[TcpTransport, TcpTransport]) -> None:
    _, b = pair
    with pytest.raises(WaitTimeoutError):
        b.recv(Lane.ACTIVATION, timeout_s=0.05)


def test_non_finite_frame_is_refused_and_the_connection_survives(
    pair: tuple[TcpTransport, TcpTransport],
) -> None:
    a, b = pair
    a.send("b", Lane.GRADIENT, "bad", {"g": torch.tensor([1.0, float("nan")])})
    a.send("b", Lane.GRADIENT, "good", {"g": torch.ones(2)})
    with pytest.raises(NonFiniteFrameError):
        b.recv(Lane.GRADIENT, timeout_s=5)
    assert b.recv(Lane.GRADIENT, timeout_s=5).kind == "good"


def test_oversize_frame_is_a_protocol_error_and_drops_the_connection() -> None:
    a = tcp_transport("a", "127.0.0.2")
    b = tcp_transport("b", "127.0.0.3", max_frame_bytes=1024)
    try:
        a.connect("b", *b.address, timeout_s=5)
        a.send("b", Lane.ACTIVATION, "big", {"x": torch.zeros(1024)})
        with pytest.raises(FrameError, match="max_frame_bytes"):
            b.recv(Lane.ACTIVATION, timeout_s=5)
        with pytest.raises(PeerLostError, match="'a' dropped.*max_frame_bytes"):
            b.recv(Lane.ACTIVATION, timeout_s=1, peer_id="a")
    finally:
        a.close(drain_timeout_s=0)
        b.close(drain_timeout_s=0)


def test_pool_exhaustion_times_out_then_resumes_after_release() -> None:
    a = tcp_transport("a", "127.0.0.2")
    b = tcp_transport("b", "127.0.0.3", pool_bytes=5000)
    try:
        a.connect("b", *b.address, timeout_s=5)
        for i in range(2):
            a.send("b", Lane.ACTIVATION, f"m{i}", {"x": torch.full((1000,), float(i))})
        held = b.recv(Lane.ACTIVATION, timeout_s=5)
        with pytest.raises(PoolExhaustedError):
            b.recv(Lane.ACTIVATION, timeout_s=0.1)
        held.release()
        with b.recv(Lane.ACTIVATION, timeout_s=5) as msg:
            assert msg.kind == "m1" and msg.tensors["x"][0].item() == 1.0
    finally:
        a.close(drain_timeout_s=0)
        b.close(drain_timeout_s=0)


def test_channel_ping_pong_both_directions(pair: tuple[TcpTransport, TcpTransport]) -> None:
    a, b = pair
    to_b, to_a = a.channel("b"), b.channel("a")
    for token in range(20):
        to_b.send("hidden", {"h_1TH": torch.full((1, 1, 64), float(token))})
        with to_a.recv() as msg:
            to_a.send("echo", {"h_1TH": msg.tensors["h_1TH"] + 1})
        with to_b.recv() as back:
            assert back.tensors["h_1TH"][0, 0, 0].item() == token + 1


def test_counters_reach_the_trace_on_close(tmp_path: Path) -> None:
    a = tcp_transport(
        "a", "127.0.0.2", tracer=Tracer.open(tmp_path / "a.jsonl", role="owner", rank=0)
    )
    b = tcp_transport("b", "127.0.0.3")
    a.connect("b", *b.address, timeout_s=5)
    a.send("b", Lane.GRADIENT, "g", {"g": torch.ones(10)}).wait(5)
    b.recv(Lane.GRADIENT, timeout_s=5).release()
    assert b.counters()["gradient.frames_recv"] == 1 and b.counters()["pool.gradient.misses"] == 1
    a.close()
    b.close()
    a.tracer.close()
    records = [json.loads(line) for line in (tmp_path / "a.jsonl").read_text().splitlines()]
    assert records[-1]["kind"] == "transport" and records[-1]["gradient.frames_sent"] == 1


def test_recv_waiting_on_the_only_socket_still_serves_a_peer_that_connects_later() -> None:
    a = tcp_transport("a", "127.0.0.2")
    b = tcp_transport("b", "127.0.0.3")
    c = tcp_transport("c", "127.0.0.4")
    got: list[tuple[str, float]] = []
    try:
        a.connect("b", *b.address, timeout_s=5)

        def wait() -> None:
            with b.recv(Lane.ACTIVATION, timeout_s=5) as msg:
                got.append((msg.peer, time.monotonic()))

        waiter = threading.Thread(target=wait)
        waiter.start()
        time.sleep(0.1)  # b now waits inside a's socket
        c.connect("b", *b.address, timeout_s=5)
        sent_at = time.monotonic()
        c.send("b", Lane.ACTIVATION, "late", {"x": torch.ones(3)}).wait(5)
        waiter.join(timeout=5)
        assert got and got[0][0] == "c" and got[0][1] - sent_at < 1.0
    finally:
        for t in (a, b, c):
            t.close(drain_timeout_s=0)


def _wait_then_send(a: TcpTransport, b: TcpTransport, wait_s: float) -> float:
    """CPU time of b's `recv` that waits `wait_s` for a's frame."""
    cpu: list[float] = []

    def wait() -> None:
        start = time.thread_time()
        with b.recv(Lane.ACTIVATION, timeout_s=5) as msg:
            assert msg.kind == "late"
        cpu.append(time.thread_time() - start)

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(wait_s)
    a.send("b", Lane.ACTIVATION, "late", {"x": torch.ones(3)}).wait(5)
    waiter.join(timeout=5)
    assert cpu, "the waiting recv got nothing"
    return cpu[0]


@contextlib.contextmanager
def _linked(spin_us: float) -> Iterator[tuple[TcpTransport, TcpTransport]]:
    """a -> b on the activation lane, b receiving under `spin_us`."""
    a = tcp_transport("a", "127.0.0.2")
    b = tcp_transport("b", "127.0.0.3", spin_us=spin_us)
    try:
        a.connect("b", *b.address, timeout_s=5)
        b.wait_connected("a", [Lane.ACTIVATION], timeout_s=5)
        yield a, b
    finally:
        a.close(drain_timeout_s=0)
        b.close(drain_timeout_s=0)


def test_recv_spins_where_the_last_wait_was_short_and_sleeps_where_it_was_long() -> None:
    with _linked(100_000) as (a, b):
        # 100 ms of spinning burns CPU for most of it (a share of it on a loaded host)
        assert _wait_then_send(a, b, 0.3) > 0.01
        # that wait outlasted the spin: the next one sleeps at once
        assert _wait_then_send(a, b, 0.3) < 0.01
        # a wait within the spin makes the lane spin again
        _wait_then_send(a, b, 0.01)
        assert _wait_then_send(a, b, 0.3) > 0.01
        # a poll that times out after the spin (a loop polling an idle lane) spins no more
        _wait_then_send(a, b, 0.01)
        with pytest.raises(WaitTimeoutError):
            b.recv(Lane.ACTIVATION, timeout_s=0.2)
        assert _wait_then_send(a, b, 0.3) < 0.01


def test_spin_us_zero_never_spins() -> None:
    with _linked(0) as (a, b):
        assert _wait_then_send(a, b, 0.3) < 0.01
