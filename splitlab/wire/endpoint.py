"""Where a data plane listens and what address it tells its peers.

The advertised host is, in order: the one given; the bind host when it is a specific address;
the local address of the route to the broker (found with a UDP `connect`, which sends no
packets); else 127.0.0.1.

    .venv/bin/pytest tests/integration/test_wire_tcp.py -q -k address
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

WILDCARDS = ("", "0.0.0.0", "::")


def route_address(host: str, port: int = 5672) -> str | None:
    """Local IP of the route to `host` (no packet leaves: UDP connect only picks a route)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, port))
            return str(s.getsockname()[0])
    except OSError:
        return None


def advertised_host(
    bind_host: str, *, advertise_host: str | None = None, broker_host: str | None = None
) -> str:
    if advertise_host:
        return advertise_host
    if bind_host not in WILDCARDS:
        return bind_host
    if broker_host:
        found = route_address(broker_host)
        if found and found != "0.0.0.0":
            return found
    return "127.0.0.1"


@dataclass(frozen=True)
class Endpoint:
    """A bound listening address: `port` is the real one even when 0 was asked for."""

    bind_host: str
    port: int
    advertise_host: str

    @property
    def address(self) -> tuple[str, int]:
        return self.advertise_host, self.port


def listen(bind_host: str = "127.0.0.1", port: int = 0, *, advertise_host: str | None = None,
           broker_host: str | None = None, backlog: int = 64) -> tuple[socket.socket, Endpoint]:  # fmt: skip
    """Bind and listen (port 0 picks a free port); returns the socket and its endpoint."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((bind_host, port))
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    host = advertised_host(bind_host, advertise_host=advertise_host, broker_host=broker_host)
    return sock, Endpoint(bind_host, sock.getsockname()[1], host)
