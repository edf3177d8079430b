"""In-process transport: the Transport contract (lanes, priorities, bounds, timeouts, peers lost).

.venv/bin/pytest tests/unit/test_wire_inproc.py -q
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from splitlab.errors import PeerLostError, WaitTimeoutError
from splitlab.wire.base import Priority
from splitlab.wire.counters import WireCounters
from splitlab.wire.errors import NonFiniteFrameError
from splitlab.wire.frame import Lane, Routing
from splitlab.wire.inproc import InProcHub, InProcTransport


@pytest.fixture
def pair() -> Iterator[tuple[InProcTransport, InProcTransport]]:
    hub = InProcHub()
    a = InProcTransport("a", hub, session="s", queue_frames=4)
    b = InProcTransport("b", hub, session="s", queue_frames=4, check_finite=True)
    yield a, b
    a.close()
    b.close()


def test_message_arrives_with_routing_meta_and_sender(
    pair: tuple[InProcTransport, InProcTransport],
) -> None:
    a, b = pair
    x = torch.randn(2, 3, 4, dtype=torch.bfloat16)
    a.send("b", Lane.ACTIVATION, "body_forward", {"hidden_BTH": x}, meta={"n": 1},
           routing=Routing(session="s", window=2, microbatch=5))  # fmt: skip
    with b.recv(Lane.ACTIVATION, timeout_s=1) as msg:
        assert (msg.peer, msg.kind, msg.meta, msg.routing.microbatch) == (
            "a",
            "body_forward",
            {"n": 1},
            5,
        )
        assert torch.equal(msg.tensors["hidden_BTH"].view(torch.int16), x.view(torch.int16))


def test_backward_is_delivered_before_forward(
    pair: tuple[InProcTransport, InProcTransport],
) -> None:
    a, b = pair
    a.send("b", Lane.ACTIVATION, "fwd", {"x": torch.ones(1)}, priority=Priority.FORWARD)
    a.send("b", Lane.ACTIVATION, "bwd", {"x": torch.ones(1)}, priority=Priority.BACKWARD)
    assert [b.recv(Lane.ACTIVATION, timeout_s=1).kind for _ in range(2)] == ["bwd", "fwd"]


def test_full_activation_lane_still_lets_a_gradient_through(
    pair: tuple[InProcTransport, InProcTransport],
) -> None:
    a, b = pair
    for _ in range(4):
        a.send("b", Lane.ACTIVATION, "fwd", {"x": torch.ones(8)})
    with pytest.raises(WaitTimeoutError, match="activation queue full"):
        a.send("b", Lane.ACTIVATION, "fwd", {"x": torch.ones(8)}, timeout_s=0.05)
    a.send("b", Lane.GRADIENT, "bwd", {"g": torch.ones(8)}, timeout_s=0.05)
    assert b.recv(Lane.GRADIENT, timeout_s=1).kind == "bwd"


def test_recv_times_out_with_wait_timeout_error(
    pair: tuple[InProcTransport, InProcTransport],
) -> None:
    _, b = pair
    with pytest.raises(WaitTimeoutError):
        b.recv(Lane.GRADIENT, timeout_s=0.02)


def test_recv_from_a_closed_peer_raises_peer_lost(
    pair: tuple[InProcTransport, InProcTransport],
) -> None:
    a, b = pair
    a.close()
    with pytest.raises(PeerLostError, match="'a'"):
        b.recv(Lane.ACTIVATION, timeout_s=1, peer_id="a")


def test_non_finite_tensor_is_refused_when_receiver_checks(
    pair: tuple[InProcTransport, InProcTransport],
) -> None:
    a, b = pair
    a.send("b", Lane.GRADIENT, "bwd", {"g": torch.tensor([float("inf")])})
    with pytest.raises(NonFiniteFrameError):
        b.recv(Lane.GRADIENT, timeout_s=1)


def test_channel_is_a_blocking_point_to_point_pipe(
    pair: tuple[InProcTransport, InProcTransport],
) -> None:
    a, b = pair
    a.channel("b").send("hidden", {"h": torch.arange(6.0).view(1, 2, 3)})
    with b.channel("a").recv() as msg:
        assert msg.tensors["h"].sum().item() == 15.0


def test_counters_count_frames_bytes_and_pool_use(
    pair: tuple[InProcTransport, InProcTransport],
) -> None:
    a, b = pair
    for _ in range(2):
        a.send("b", Lane.ACTIVATION, "fwd", {"x": torch.ones(16)})
        b.recv(Lane.ACTIVATION, timeout_s=1).release()
    sent, got = a.counters(), b.counters()
    assert sent["activation.frames_sent"] == 2 and got["activation.frames_recv"] == 2
    assert sent["activation.bytes_sent"] == got["activation.bytes_recv"] > 128
    assert (got["pool.activation.misses"], got["pool.activation.hits"]) == (1, 1)


def test_counters_peak_keeps_the_largest_value_seen() -> None:
    counters = WireCounters()
    for value in (12.0, 29.5, 3.0):
        counters.peak("rx.owner0.stream_peak_mbit", value)
    assert counters.snapshot()["rx.owner0.stream_peak_mbit"] == 29.5


def test_counters_sample_reports_the_median_of_the_values() -> None:
    counters = WireCounters()
    for value in (30.0, 12.0, 29.0, 31.0, 45.0):  # one starved frame, one batched one
        counters.sample("rx.owner0.stream_median_mbit", value)
    assert counters.snapshot()["rx.owner0.stream_median_mbit"] == 30.0
