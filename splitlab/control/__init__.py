"""splitlab.control: the control bus (RabbitMQ or embedded), protocol messages and rules.

.venv/bin/pytest tests/unit/test_control_*.py tests/integration/test_control_*.py -q
"""

from splitlab.control.bus import ControlBus, Delivery, make_bus, queue_name, register_bus
from splitlab.control.endpoint import ControlEndpoint
from splitlab.control.inbox import Inbox, Verdict
from splitlab.control.membership import Membership, NodeInfo, Outcome, new_session_key_hex
from splitlab.control.messages import (
    Abort,
    BusMessage,
    Commit,
    Drained,
    Failed,
    Kind,
    Open,
    Plan,
    Register,
    Start,
    Stop,
    Update,
    decode,
    encode,
)

__all__ = [
    "Abort",
    "BusMessage",
    "Commit",
    "ControlBus",
    "ControlEndpoint",
    "Delivery",
    "Drained",
    "Failed",
    "Inbox",
    "Kind",
    "Membership",
    "NodeInfo",
    "Open",
    "Outcome",
    "Plan",
    "Register",
    "Start",
    "Stop",
    "Update",
    "Verdict",
    "decode",
    "encode",
    "make_bus",
    "new_session_key_hex",
    "queue_name",
    "register_bus",
]
