"""InFlight: sends not yet finished, kept alive with their tensors; errors surface later.

.venv/bin/pytest tests/unit/test_wire_inflight.py -q
"""

from __future__ import annotations

import pytest
import torch

from splitlab.errors import PeerLostError, WaitTimeoutError
from splitlab.wire.base import SENT, InFlight, SendTicket


def test_unfinished_sends_keep_their_tensors_until_finished() -> None:
    sends, ticket, tensors = InFlight(), SendTicket(), {"x": torch.ones(2)}

    sends.add(SENT, {"y": torch.zeros(1)})
    sends.add(ticket, tensors)
    assert len(sends) == 1

    ticket.finish()
    sends.add(SENT, {})
    assert len(sends) == 0


def test_a_failed_send_raises_at_the_next_add() -> None:
    sends, failed = InFlight(), SendTicket()
    sends.add(failed, {})
    failed.finish(PeerLostError("peer 'w0' lost"))

    with pytest.raises(PeerLostError, match="w0"):
        sends.add(SendTicket(), {})


def test_wait_all_raises_the_first_error_and_bounds_the_wait() -> None:
    failed, stuck = SendTicket(), SendTicket()
    sends = InFlight()
    sends.add(failed, {})
    failed.finish(PeerLostError("peer 'w1' lost"))
    with pytest.raises(PeerLostError, match="w1"):
        sends.wait_all(1.0)

    sends.add(stuck, {})
    with pytest.raises(WaitTimeoutError):
        sends.wait_all(0.01)
