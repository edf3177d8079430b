"""Endpoints: port 0 picks a free port; the advertised host follows bind, option, broker route.

.venv/bin/pytest tests/unit/test_wire_endpoint.py -q
"""

from __future__ import annotations

from splitlab.wire.endpoint import advertised_host, listen, route_address


def test_port_zero_binds_a_free_port_on_the_given_address() -> None:
    sock, ep = listen("127.0.0.3", 0)
    try:
        assert ep.port > 0 and sock.getsockname() == ("127.0.0.3", ep.port)
        assert ep.address == ("127.0.0.3", ep.port)
    finally:
        sock.close()


def test_route_to_a_loopback_broker_is_loopback() -> None:
    assert route_address("127.0.0.1") == "127.0.0.1"


def test_advertised_host_prefers_option_then_bind_then_broker_route() -> None:
    assert advertised_host("0.0.0.0", advertise_host="10.0.0.7") == "10.0.0.7"
    assert advertised_host("127.0.0.2", broker_host="127.0.0.1") == "127.0.0.2"
    assert advertised_host("0.0.0.0", broker_host="127.0.0.1") == "127.0.0.1"
    assert advertised_host("0.0.0.0") == "127.0.0.1"
