"""One bus suite, run on the embedded bus and on a real RabbitMQ broker (marker `rabbitmq`).

SPLITLAB_REQUIRE_BROKER=1 .venv/bin/pytest tests/integration/test_control_bus.py -q
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Iterator

import pytest
from control_helpers import BUS_KINDS, BusFactory, close_broker_connection, open_buses

from splitlab.control.bus import make_bus
from splitlab.control.embedded import EmbeddedBus
from splitlab.control.messages import Kind, Plan, Update
from splitlab.control.rabbitmq import RabbitMQBus
from splitlab.errors import ConfigError, PeerLostError


@pytest.fixture(params=BUS_KINDS)
def buses(request: pytest.FixtureRequest) -> Iterator[BusFactory]:
    yield from open_buses(request.param)


def _plan(session: str, window: int = 0) -> Plan:
    return Plan(session_id=session, sender="o0", window_id=window, counts_by_worker={"w0": 2})


def test_published_message_is_consumed(buses: BusFactory) -> None:
    owner, worker = buses.open("o0"), buses.open("w0")
    owner.publish("w0", _plan(buses.session))
    d = worker.consume(5.0)
    assert d is not None and d.message == _plan(buses.session) and not d.redelivered


def test_message_sent_before_the_consumer_connects_is_kept(buses: BusFactory) -> None:
    buses.open("o0").publish("w0", _plan(buses.session))
    d = buses.open("w0").consume(5.0)
    assert d is not None and d.message.kind is Kind.PLAN


def test_consume_on_an_empty_queue_returns_none_within_its_timeout(buses: BusFactory) -> None:
    worker = buses.open("w0")
    started = time.monotonic()
    assert worker.consume(0.3) is None
    assert 0.25 <= time.monotonic() - started < 2.0


def test_nack_with_requeue_redelivers(buses: BusFactory) -> None:
    owner, worker = buses.open("o0"), buses.open("w0")
    owner.publish("w0", _plan(buses.session))
    worker.consume(5.0).nack(requeue=True)
    again = worker.consume(5.0)
    assert again is not None and again.redelivered and again.message == _plan(buses.session)


def test_nack_without_requeue_drops(buses: BusFactory) -> None:
    owner, worker = buses.open("o0"), buses.open("w0")
    owner.publish("w0", _plan(buses.session))
    worker.consume(5.0).nack(requeue=False)
    assert worker.consume(0.3) is None


def test_unacked_message_is_redelivered_after_its_consumer_closes(buses: BusFactory) -> None:
    owner, first = buses.open("o0"), buses.open("w0")
    owner.publish("w0", _plan(buses.session))
    assert first.consume(5.0) is not None
    first.close()  # no ack: a crashed consumer
    d = buses.open("w0").consume(5.0)
    assert d is not None and d.redelivered


def test_acked_message_is_not_redelivered_after_close(buses: BusFactory) -> None:
    owner, first = buses.open("o0"), buses.open("w0")
    owner.publish("w0", _plan(buses.session))
    first.consume(5.0).ack()
    first.close()
    assert buses.open("w0").consume(0.3) is None


def test_prefetch_bounds_unacked_deliveries(buses: BusFactory) -> None:
    owner, worker = buses.open("o0"), buses.open("w0", prefetch=2)
    for w in range(3):
        owner.publish("w0", _plan(buses.session, w))
    time.sleep(0.2)
    held = worker.consume_batch(10, 1.0)
    assert len(held) == 2
    held[0].ack()
    assert [d.message.window_id for d in worker.consume_batch(10, 2.0)] == [2]


def test_batch_returns_every_waiting_message_in_order(buses: BusFactory) -> None:
    owner, worker = buses.open("o0"), buses.open("w0")
    for w in range(5):
        owner.publish("w0", _plan(buses.session, w))
    got: list[int] = []
    while len(got) < 5 and (batch := worker.consume_batch(10, 2.0)):
        got += [d.message.window_id for d in batch]
    assert got == [0, 1, 2, 3, 4]


def test_sessions_do_not_see_each_other(buses: BusFactory) -> None:
    other = "x" + buses.session
    buses.open("o0", session=other).publish("w0", _plan(other))
    assert buses.open("w0").consume(0.3) is None


def test_cleanup_deletes_only_this_sessions_queues(buses: BusFactory) -> None:
    other = "x" + buses.session
    buses.open("o0", session=other).publish("w0", _plan(other))
    mine = buses.open("o0")
    mine.publish("w0", _plan(buses.session))
    mine.cleanup()
    assert buses.open("w0").consume(0.3) is None  # this session's queue went with its message
    assert buses.open("w0", session=other).consume(5.0) is not None


def test_update_weights_cross_as_bytes(buses: BusFactory) -> None:
    header = b'{"w":{"dtype":"F32","shape":[262144],"data_offsets":[0,1048576]}}'
    weights = struct.pack("<Q", len(header)) + header + bytes(range(256)) * 4096
    upd = Update(
        session_id=buses.session,
        sender="o0",
        round_id=1,
        num_samples=8,
        partition="owner",
        weights=weights,
    )
    buses.open("o0").publish("coord", upd)
    d = buses.open("coord").consume(5.0)
    assert d is not None and d.message == upd


def test_a_bus_belongs_to_the_thread_that_opened_it(buses: BusFactory) -> None:
    bus = buses.open("o0")
    errors: list[BaseException] = []

    def use() -> None:
        try:
            bus.publish("w0", _plan(buses.session))
        except RuntimeError as exc:
            errors.append(exc)

    t = threading.Thread(target=use)
    t.start()
    t.join()
    assert errors and "thread" in str(errors[0])


def test_unknown_bus_kind_names_the_choices() -> None:
    with pytest.raises(ConfigError, match="embedded"):
        make_bus("zeromq", session="s", node_id="n")


def test_bad_node_id_is_a_config_error(buses: BusFactory) -> None:
    with pytest.raises(ConfigError, match="node_id"):
        buses.open("a.b")


def test_embedded_host_gone_mid_consume_is_peer_lost_within_the_timeout() -> None:
    factory = BusFactory("embedded")
    try:
        worker = factory.open("w0")
        threading.Timer(0.3, factory.server.close).start()
        started = time.monotonic()
        with pytest.raises(PeerLostError, match="embedded control bus host"):
            worker.consume(10.0)
        assert time.monotonic() - started < 5.0
    finally:
        factory.teardown()


def test_embedded_bus_rejects_a_wrong_auth_key() -> None:
    factory = BusFactory("embedded")
    try:
        a = factory.server.address
        with pytest.raises(PeerLostError, match="rejected the key of"):
            EmbeddedBus.connect(
                host=a.host, port=a.port, authkey=b"wrong", session="s", node_id="n", timeout_s=5
            )
    finally:
        factory.teardown()


def test_embedded_host_drops_a_stranger_announcing_a_large_frame() -> None:
    factory = BusFactory("embedded")
    try:
        a = factory.server.address
        with socket.create_connection((a.host, a.port), timeout=5.0) as stranger:
            stranger.sendall(struct.pack(">I", 1 << 30))  # before any proof of the key
            assert stranger.recv(1) == b""  # the host hung up instead of reading on
        assert factory.server.clients() == 0
    finally:
        factory.teardown()


def test_embedded_host_not_running_is_peer_lost() -> None:
    factory = BusFactory("embedded")
    a = factory.server.address
    factory.teardown()
    with pytest.raises(PeerLostError, match=f"{a.port}"):
        EmbeddedBus.connect(
            host=a.host, port=a.port, authkey=a.authkey, session="s", node_id="n", timeout_s=2
        )


@pytest.mark.rabbitmq
def test_broker_closing_the_connection_mid_consume_is_peer_lost_within_the_timeout() -> None:
    factory = BusFactory("rabbitmq")
    try:
        worker = factory.open("w0")
        assert isinstance(worker, RabbitMQBus)
        worker.consume(0.0)  # the consumer is registered
        closer = threading.Thread(target=close_broker_connection, args=(worker.connection_name(),))
        closer.start()
        started = time.monotonic()
        with pytest.raises(PeerLostError, match="amqp://127.0.0.1:5672"):
            worker.consume(30.0)
        closer.join()
        assert time.monotonic() - started < 30.0
    finally:
        factory.teardown()


@pytest.mark.rabbitmq
def test_unreachable_broker_is_peer_lost_naming_it_without_the_password() -> None:
    with pytest.raises(PeerLostError, match="amqp://127.0.0.1:1/") as info:
        RabbitMQBus(
            url="amqp://guest:secret@127.0.0.1:1/%2F", session="s", node_id="n", timeout_s=2
        )
    assert "secret" not in str(info.value)
