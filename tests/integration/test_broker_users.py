"""Node users on a real RabbitMQ broker (`control.node_users`): each node reads only its own
queues, speaks only as itself, other logins stay out of the session's vhost, and nothing is
left once the session is removed. Needs `rabbitmqctl` (root); marker `rabbitmq`.

    SPLITLAB_REQUIRE_BROKER=1 .venv/bin/pytest tests/integration/test_broker_users.py -q
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pika
import pika.exceptions
import pytest
import torch
from control_helpers import require_rabbitmqctl

from splitlab.control import broker_users
from splitlab.control.messages import Abort, Plan
from splitlab.control.rabbitmq import RabbitMQBus, control_queue_args
from splitlab.errors import PeerLostError, WaitTimeoutError
from splitlab.wire.amqp import AmqpTransport, queue_name
from splitlab.wire.broker_login import node_user, with_login
from splitlab.wire.frame import Lane

pytestmark = pytest.mark.rabbitmq

URL = "amqp://guest:guest@127.0.0.1:5672/%2F"
NODES = ["coordinator", "o0", "o1"]


@pytest.fixture(scope="module")
def session() -> Iterator[tuple[str, dict[str, str]]]:
    require_rabbitmqctl()
    name = f"t{uuid.uuid4().hex[:10]}"
    logins = broker_users.create(URL, name, NODES, control_queue_args())
    try:
        yield name, logins
    finally:
        assert broker_users.remove(name, NODES) == []


def _bus(session: tuple[str, dict[str, str]], node: str, login_of: str | None = None):
    name, logins = session
    return RabbitMQBus(url=with_login(URL, logins[login_of or node]), session=name,
                       node_id=node, timeout_s=5.0)  # fmt: skip


def _plan(session: str, sender: str, window: int) -> Plan:
    return Plan(session_id=session, sender=sender, window_id=window, counts_by_worker={"w0": 1})


def test_a_node_login_opens_only_that_nodes_queue(session) -> None:
    with pytest.raises(PeerLostError, match="ACCESS_REFUSED"):
        _bus(session, "coordinator", login_of="o0")  # o0's login reading the coordinator's


def test_the_urls_own_user_cannot_enter_the_session_vhost(session) -> None:
    name, logins = session
    params = pika.URLParameters(with_login(URL, f"guest:guest@{broker_users.vhost(name)}"))
    with pytest.raises(pika.exceptions.AMQPError, match="NOT_ALLOWED|access to vhost"):
        pika.BlockingConnection(params)


def test_a_message_naming_another_sender_is_dropped_and_the_real_one_delivered(session) -> None:
    name, _ = session
    coordinator, o0, o1 = (_bus(session, n) for n in NODES)
    try:
        o0.publish("coordinator", _plan(name, "o1", 1))  # o0 speaking as o1
        o0.publish("coordinator", Abort(session_id=name, sender="coordinator", window_id=1,
                                        reason="spoofed", cause_node="o1"))  # fmt: skip
        assert coordinator.consume(0.5) is None  # both dropped: nothing to deliver
        o1.publish("coordinator", _plan(name, "o1", 2))
        got = coordinator.consume(5.0)
        assert got is not None and got.message == _plan(name, "o1", 2)
        got.ack()
        assert coordinator.consume(0.5) is None
    finally:
        for bus in (coordinator, o0, o1):
            bus.close()


def test_the_broker_refuses_a_user_id_that_is_not_the_connections(session) -> None:
    name, logins = session
    conn = pika.BlockingConnection(pika.URLParameters(with_login(URL, logins["o0"])))
    try:
        channel = conn.channel()
        props = pika.BasicProperties(user_id=node_user(name, "coordinator"))
        with pytest.raises(pika.exceptions.ChannelClosedByBroker, match="PRECONDITION_FAILED"):
            channel.basic_publish("", node_user(name, "o1"), b"x", props)
            channel.queue_declare(node_user(name, "o0"), passive=True)  # the reply carries it
    finally:
        conn.close()


def test_the_tensor_transport_drops_frames_naming_another_peer(session) -> None:
    name, logins = session
    a = AmqpTransport("o0", session=name, url=with_login(URL, logins["o0"]))
    b = AmqpTransport("o1", session=name, url=with_login(URL, logins["o1"]))
    try:
        a.connect("o1", timeout_s=5)
        conn = pika.BlockingConnection(pika.URLParameters(with_login(URL, logins["o0"])))
        spoof = pika.BasicProperties(app_id="coordinator", user_id=node_user(name, "o0"))
        conn.channel().basic_publish("", queue_name(name, "o1", Lane.ACTIVATION), b"junk", spoof)
        conn.close()
        a.send("o1", Lane.ACTIVATION, "x", {"x": torch.ones(3)}).wait(5)
        with b.recv(Lane.ACTIVATION, timeout_s=5) as msg:
            assert msg.peer == "o0" and torch.equal(msg.tensors["x"], torch.ones(3))
        with pytest.raises(WaitTimeoutError):
            b.recv(Lane.ACTIVATION, timeout_s=0.5)
    finally:
        a.close()
        b.close()


def test_remove_leaves_no_vhost_user_or_queue() -> None:
    require_rabbitmqctl()
    name = f"t{uuid.uuid4().hex[:10]}"
    broker_users.create(URL, name, ["a", "b"], control_queue_args())
    assert sorted(broker_users.leftovers()[name]) == ["a", "b"]

    assert broker_users.remove(name, ["a", "b"]) == []

    assert name not in broker_users.leftovers()
