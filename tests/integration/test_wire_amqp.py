"""RabbitMQ tensor transport against the real broker (marker `rabbitmq`).

SPLITLAB_REQUIRE_BROKER=1 .venv/bin/pytest tests/integration/test_wire_amqp.py -q
"""

from __future__ import annotations

import logging
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pika
import pytest
import torch

from splitlab.errors import WaitTimeoutError
from splitlab.wire.amqp import AmqpTransport, queue_name
from splitlab.wire.frame import DTYPES, Lane

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ is not a package yet

pytestmark = pytest.mark.rabbitmq


@pytest.fixture
def pair() -> Iterator[tuple[AmqpTransport, AmqpTransport]]:
    session = f"test-{uuid.uuid4().hex[:8]}"
    a = AmqpTransport("a", session=session)
    b = AmqpTransport("b", session=session, queue_frames=4)
    a.connect("b", timeout_s=5)
    yield a, b
    a.close()
    b.close()


def test_every_dtype_and_non_contiguous_tensor_round_trips_bit_exact(
    pair: tuple[AmqpTransport, AmqpTransport],
) -> None:
    a, b = pair
    sent = {name: torch.randint(0, 2, (3, 4)).to(dt) for name, dt in DTYPES.items()}
    sent["bf16_t"] = torch.randn(5, 7, dtype=torch.bfloat16).t()
    a.send("b", Lane.ACTIVATION, "all", sent).wait(5)
    with b.recv(Lane.ACTIVATION, timeout_s=5) as msg:
        assert msg.peer == "a"
        for name, t in sent.items():
            assert torch.equal(
                msg.tensors[name].contiguous().view(torch.uint8), t.contiguous().view(torch.uint8)
            )


def test_unconsumed_activations_do_not_hold_back_a_gradient(
    pair: tuple[AmqpTransport, AmqpTransport],
) -> None:
    a, b = pair
    for i in range(20):  # b's activation prefetch is 4: the rest waits in the broker
        a.send("b", Lane.ACTIVATION, f"fwd{i}", {"x": torch.ones(1024)})
    a.send("b", Lane.GRADIENT, "bwd", {"g": torch.ones(4)}).wait(5)
    with b.recv(Lane.GRADIENT, timeout_s=5) as msg:
        assert msg.kind == "bwd"
    kinds = [b.recv(Lane.ACTIVATION, timeout_s=5).kind for _ in range(20)]
    assert sorted(kinds) == sorted(f"fwd{i}" for i in range(20))


def test_recv_times_out(pair: tuple[AmqpTransport, AmqpTransport]) -> None:
    _, b = pair
    with pytest.raises(WaitTimeoutError):
        b.recv(Lane.GRADIENT, timeout_s=0.05)


def test_close_deletes_own_queues_only() -> None:
    session = f"test-{uuid.uuid4().hex[:8]}"
    a = AmqpTransport("a", session=session)
    b = AmqpTransport("b", session=session)
    a.close()
    conn = pika.BlockingConnection()
    try:
        conn.channel().queue_declare(queue_name(session, "b", Lane.GRADIENT), passive=True)
        with pytest.raises(pika.exceptions.ChannelClosedByBroker):
            conn.channel().queue_declare(queue_name(session, "a", Lane.GRADIENT), passive=True)
    finally:
        conn.close()
        b.close()


def test_closing_cancels_its_consumers_without_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    session = f"test-{uuid.uuid4().hex[:8]}"
    a, b = AmqpTransport("a", session=session), AmqpTransport("b", session=session)
    a.connect("b", timeout_s=5)
    a.send("b", Lane.ACTIVATION, "x", {"x": torch.ones(2)}).wait(5)
    with b.recv(Lane.ACTIVATION, timeout_s=5):
        pass
    caplog.set_level(logging.WARNING)

    a.close()
    b.close()

    assert [r.getMessage() for r in caplog.records if r.name.startswith("pika")] == []
