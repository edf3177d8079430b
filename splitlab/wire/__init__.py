"""splitlab.wire: the tensor data plane (frame codec, TCP lanes, pools, auth, in-process, AMQP).

    .venv/bin/pytest tests/unit/test_wire_frame.py tests/integration/test_wire_tcp.py -q

`splitlab.wire.amqp.AmqpTransport` is imported from its module (it pulls in pika).
"""

from splitlab.wire.base import Channel, Message, Priority, SendTicket, Transport
from splitlab.wire.frame import FrameHeader, Lane, Routing, decode_frame, encode_frame
from splitlab.wire.inproc import InProcHub, InProcTransport
from splitlab.wire.tcp import TcpTransport

__all__ = [
    "Channel",
    "FrameHeader",
    "InProcHub",
    "InProcTransport",
    "Lane",
    "Message",
    "Priority",
    "Routing",
    "SendTicket",
    "TcpTransport",
    "Transport",
    "decode_frame",
    "encode_frame",
]
