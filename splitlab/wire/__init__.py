"""splitlab.wire: the one wire (frame codec, handshake, TCP lanes, pools, in-process, AMQP).

    .venv/bin/pytest tests/unit/test_wire_frame.py tests/integration/test_wire_tcp.py -q

The names below load on first use: the control plane reads frames through `wire.header`,
`wire.blobs` and `wire.auth`, which need no torch, and importing this package must not pull
torch into a process that never touches a tensor. `splitlab.wire.amqp.AmqpTransport` is
imported from its module (it pulls in pika).
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS = {
    "Channel": "base", "Message": "base", "Priority": "base", "SendTicket": "base",
    "Transport": "base", "FrameHeader": "frame", "Lane": "frame", "Routing": "frame",
    "decode_frame": "frame", "encode_frame": "frame", "InProcHub": "inproc",
    "InProcTransport": "inproc", "TcpTransport": "tcp",
}  # fmt: skip
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'splitlab.wire' has no attribute {name!r}")
    return getattr(import_module(f"splitlab.wire.{module}"), name)
