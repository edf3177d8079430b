"""Shared helpers of the wire tests: transports on distinct loopback addresses.

.venv/bin/pytest tests/integration/test_wire_tcp.py -q
"""

from __future__ import annotations

from splitlab.wire.tcp import TcpTransport

KEY = b"k" * 32
SESSION = "sess-1"


def tcp_transport(peer_id: str, host: str, **kw: object) -> TcpTransport:
    opts: dict[str, object] = {
        "key": KEY,
        "session": SESSION,
        "bind_host": host,
        "stall_timeout_s": 5.0,
    }
    opts.update(kw)
    return TcpTransport(peer_id, **opts)  # type: ignore[arg-type]
