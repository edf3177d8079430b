"""Shared helpers of the wire tests: transports on distinct loopback addresses, broker probe.

.venv/bin/pytest tests/integration/test_wire_tcp.py -q
"""

from __future__ import annotations

import os
import socket

import pytest

from splitlab.wire.tcp import TcpTransport

KEY = b"k" * 32
SESSION = "sess-1"
BROKER = ("127.0.0.1", 5672)


def tcp_transport(peer_id: str, host: str, **kw: object) -> TcpTransport:
    opts: dict[str, object] = {
        "key": KEY,
        "session": SESSION,
        "bind_host": host,
        "stall_timeout_s": 5.0,
    }
    opts.update(kw)
    return TcpTransport(peer_id, **opts)  # type: ignore[arg-type]


def require_broker() -> None:
    """Skip when no broker answers, unless SPLITLAB_REQUIRE_BROKER=1 (then fail)."""
    try:
        socket.create_connection(BROKER, timeout=1.0).close()
    except OSError as exc:
        message = f"no RabbitMQ broker at {BROKER[0]}:{BROKER[1]}: {exc}"
        if os.environ.get("SPLITLAB_REQUIRE_BROKER") == "1":
            pytest.fail(message)
        pytest.skip(message)
