"""The embedded bus against authenticated but hostile clients: bad operations get an error
naming the field and the connection goes on; made-up queues are capped; a connection is one
node (its `sender`, its queue, one connection at a time).

.venv/bin/pytest tests/integration/test_control_bus_guard.py -q
"""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Iterator
from typing import Any

import pytest
from control_helpers import BusFactory, open_buses

from splitlab.control.embedded import _LANE, _REALM, _SERVER_ID, EmbeddedBus, _Conn
from splitlab.control.endpoint import ControlEndpoint
from splitlab.control.messages import Abort, Kind, Plan, Start
from splitlab.errors import PeerLostError, ProtocolError
from splitlab.wire.auth import client_handshake
from splitlab.wire.session_key import node_key


@pytest.fixture
def buses() -> Iterator[BusFactory]:
    yield from open_buses("embedded")


def _plan(session: str, sender: str = "o0") -> Plan:
    return Plan(session_id=session, sender=sender, counts_by_worker={"w0": 1})


def _raw_op(bus: EmbeddedBus, op: str, meta_json: str) -> tuple[str, dict[str, Any]]:
    """Send an operation whose meta is raw JSON text (NaN and Infinity included), as a hostile
    client could, and read the answer."""
    header = ('{"v":1,"kind":"%s","lane":"activation","src":null,"prio":0,"ids":{},'  # noqa: UP031
              '"meta":%s,"tensors":[]}' % (op, meta_json)).encode()  # fmt: skip
    assert bus._conn is not None
    bus._conn.sock.sendall(struct.pack(">I", len(header)) + header)
    kind, meta, _ = bus._conn.recv(10.0)
    return kind, meta


def _still_serves(buses: BusFactory, bus: EmbeddedBus) -> None:
    buses.open("o0").publish(bus.node_id, _plan(buses.session))
    delivery = bus.consume(5.0)
    assert delivery is not None and delivery.message.kind is Kind.PLAN
    delivery.ack()


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity", "-1", '"5"', "true", "null"])
def test_consume_with_a_bad_timeout_is_refused_naming_the_field(
    buses: BusFactory, value: str
) -> None:
    bus = buses.open("w0")
    began = time.monotonic()
    kind, meta = _raw_op(bus, "consume", '{"max":1,"timeout_s":%s}' % value)  # noqa: UP031 (JSON braces)
    assert time.monotonic() - began < 5.0
    assert kind == "error" and "'timeout_s'" in meta["reason"], meta
    _still_serves(buses, bus)


@pytest.mark.parametrize(
    ("op", "meta_json", "needle"),
    [
        ("consume", '{"max":"x","timeout_s":0}', "'max'"),
        ("consume", '{"max":-1,"timeout_s":0}', "'max'"),
        ("delete", '{"queues":5}', "'queues'"),
        ("delete", '{"queues":[7]}', "queue 7"),
        ("settle", '{"acks":[1e300]}', "'acks'"),
        ("settle", '{"nacks":[5]}', "'nacks'"),
        ("settle", '{"acks":{"a":1}}', "'acks'"),
        ("publish", '{"queue":["x"]}', "'queue'"),
        ("publish", "{}", "'queue'"),
        ("hello", '{"session":"s"}', "hello again"),
        ("frobnicate", "{}", "unknown embedded bus op"),
    ],
)
def test_malformed_operations_get_an_error_and_the_connection_goes_on(
    buses: BusFactory, op: str, meta_json: str, needle: str
) -> None:
    bus = buses.open("w0")
    kind, meta = _raw_op(bus, op, meta_json)
    assert kind == "error" and needle in meta["reason"], meta
    assert buses.server is not None and buses.server.clients() == 1
    _still_serves(buses, bus)


def test_publishing_to_made_up_queues_is_capped_and_named(buses: BusFactory) -> None:
    assert buses.server is not None
    buses.server.queues.max_queues = 8
    bus = buses.open("o0")
    refused = 0
    for i in range(40):
        try:
            bus.publish(f"made-up-{i}", _plan(buses.session))
        except ProtocolError as exc:
            assert f"made-up-{i}" in str(exc) and "max_queues=8" in str(exc)
            refused += 1
    assert len(buses.server.queue_names()) == 8 and refused == 40 - 7  # o0's own queue is one
    with pytest.raises(ProtocolError, match="not a queue of session"):
        bus._call("publish", {"queue": "splitlab.other-session.w0"}, {"body": b"x"})


def test_a_second_connection_as_a_connected_node_is_refused(buses: BusFactory) -> None:
    owner = buses.open("o0")
    with pytest.raises(ProtocolError, match="'o0' of session .* is already connected"):
        buses.open("o0")
    buses.open("coordinator").publish("o0", Start(
        session_id=buses.session, sender="coordinator", round_id=0, plan={}, roster=[],
    ))  # fmt: skip
    got = owner.consume(5.0)  # the START reached o0 only
    assert got is not None and isinstance(got.message, Start)
    owner.close()
    again = buses.open("o0")  # once it has left, the node may connect again (a restart)
    again.close()


def test_a_node_whose_process_died_mid_consume_can_reconnect_at_once(
    buses: BusFactory,
) -> None:
    dead = buses.open("o0")
    assert isinstance(dead, EmbeddedBus) and dead._conn is not None
    dead._conn.send("consume", {"max": 1, "timeout_s": 60.0})  # its server thread parks
    time.sleep(0.2)
    dead._conn.sock.shutdown(socket.SHUT_RDWR)  # as a SIGKILL would close it
    began = time.monotonic()
    again = buses.open("o0")
    assert time.monotonic() - began < 2.0
    buses.open("w0").publish("o0", _plan(buses.session, sender="w0"))
    got = again.consume(5.0)
    assert got is not None and got.message.sender == "w0"


def test_sender_is_bound_to_the_connection(buses: BusFactory) -> None:
    node = ControlEndpoint(buses.open("o0"))
    intruder = buses.open("w1")
    spoofed = Start(session_id=buses.session, sender="coordinator", round_id=0, plan={},
                    roster=[])  # fmt: skip
    with pytest.raises(ProtocolError, match="from 'coordinator' .* node 'w1'"):
        intruder.publish("o0", spoofed)
    with pytest.raises(ProtocolError, match="from 'o1' .* node 'w1'"):
        intruder.publish("o0", Abort(session_id=buses.session, sender="o1", reason="x",
                                     cause_node="o1"))  # fmt: skip
    assert node.poll(0.5) is None  # nothing reached o0


def test_hello_must_name_the_authenticated_node(buses: BusFactory) -> None:
    assert buses.server is not None
    a = buses.server.address
    bus = EmbeddedBus.connect(host=a.host, port=a.port, authkey=a.authkey,
                              session=buses.session, node_id="w1")  # fmt: skip
    try:
        # A fresh connection authenticated as w1 asking for o0's queue:
        sock = socket.create_connection((a.host, a.port), timeout=5)
        client_handshake(sock, key=node_key("w1", a.authkey), session=_REALM, client_id="w1",
                         server_id=_SERVER_ID, lane=_LANE, timeout_s=5)  # fmt: skip
        rogue = EmbeddedBus(_Conn(sock, "host"), session=buses.session, node_id="o0",
                            timeout_s=5.0)  # fmt: skip
        with pytest.raises(
            ProtocolError, match="hello as 'o0' on a connection authenticated as 'w1'"
        ):
            rogue._call("hello", {"session": buses.session, "node_id": "o0", "prefetch": 1})
        with pytest.raises(ProtocolError, match="'consume' before hello"):
            rogue._call("consume", {"max": 1, "timeout_s": 0.0})
        sock.close()
    finally:
        bus.close()


def test_a_node_key_opens_that_node_and_no_other(buses: BusFactory) -> None:
    """Each node holds only its own credential (the launcher hands out node_key(name)): owner1's
    key is refused for owner0, for the coordinator and for a made-up node, before any hello."""
    assert buses.server is not None
    a = buses.server.address
    o1_key = node_key("o1", a.authkey)

    def connect(node_id: str, credential: bytes) -> EmbeddedBus:
        return EmbeddedBus.connect(host=a.host, port=a.port, session=buses.session,
                                   node_id=node_id, credential=credential, timeout_s=5.0)  # fmt: skip

    for claimed in ("o0", "coordinator", "x9"):
        with pytest.raises(PeerLostError, match=f"rejected the key of '{claimed}'"):
            connect(claimed, o1_key)
    with pytest.raises(PeerLostError, match="rejected the key of 'o1'"):
        connect("o1", a.authkey)  # the session key itself is no node's credential
    o1 = connect("o1", o1_key)
    try:
        buses.open("o0").publish("o1", _plan(buses.session))
        delivery = o1.consume(5.0)
        assert delivery is not None and delivery.message.sender == "o0"
        delivery.ack()
    finally:
        o1.close()
    assert node_key("o0", a.authkey) != o1_key


def test_unknown_sender_abort_is_dropped_by_a_node_with_peers(buses: BusFactory) -> None:
    node = ControlEndpoint(buses.open("o0"), peers=["o0", "w0", "coordinator"])
    buses.open("x9").publish(
        "o0", Abort(session_id=buses.session, sender="x9", reason="bye", cause_node="x9")
    )
    buses.open("w0").publish("o0", _plan(buses.session, sender="w0"))
    msg = node.wait_for((Kind.PLAN,), timeout_s=5.0)  # no AbortedError: x9 is no peer
    assert msg.sender == "w0" and node.inbox.unknown_senders == {"x9": 1}


def test_node_ids_that_come_and_go_do_not_pile_up_queues(buses: BusFactory) -> None:
    """Each hello declares the node's queue; one left empty is forgotten when the node
    leaves (a key holder cycling made-up node ids used to grow the broker without bound)."""
    assert buses.server is not None
    before = set(buses.server.queue_names())
    for i in range(50):
        buses.open(f"n{i}").close()
    owner = buses.open("o0")
    owner.publish("w0", _plan(buses.session))  # w0 is not connected: its message waits
    owner.close()
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and len(buses.server.queue_names()) > len(before) + 1:
        time.sleep(0.05)  # a server thread forgets its queue as it ends
    assert set(buses.server.queue_names()) - before == {f"splitlab.{buses.session}.w0"}
    _still_serves(buses, buses.open("w0"))  # and w0 still gets what was published to it
