"""Delivery rules: dedup, stale drop, future-window error, ABORT first, reorder tolerance.

.venv/bin/pytest tests/unit/test_control_inbox.py -q
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from splitlab.control.inbox import Inbox, Verdict
from splitlab.control.messages import (
    Abort,
    BusMessage,
    Commit,
    Kind,
    Open,
    Plan,
    Start,
    Update,
)
from splitlab.errors import ProtocolError


def _plan(window: int, sender: str = "o0", mb: int = -1) -> Plan:
    return Plan(
        session_id="s",
        sender=sender,
        window_id=window,
        microbatch_id=mb,
        counts_by_worker={"w0": 1},
    )


def _abort(window: int = 0) -> Abort:
    return Abort(session_id="s", sender="w1", window_id=window, reason="oom", cause_node="w1")


def test_first_delivery_is_accepted_and_popped() -> None:
    inbox = Inbox("s")
    assert inbox.offer(_plan(0)) is Verdict.ACCEPTED
    assert inbox.pop() == _plan(0)


def test_duplicate_is_suppressed() -> None:
    inbox = Inbox("s")
    inbox.offer(_plan(0))
    assert inbox.offer(_plan(0)) is Verdict.DUPLICATE
    assert len(inbox) == 1 and inbox.num_duplicates == 1


def test_same_kind_from_other_sender_or_microbatch_is_not_a_duplicate() -> None:
    inbox = Inbox("s")
    verdicts = [inbox.offer(m) for m in (_plan(0), _plan(0, "o1"), _plan(0, mb=2))]
    assert verdicts == [Verdict.ACCEPTED] * 3


def test_stale_window_is_dropped() -> None:
    inbox = Inbox("s", window_id=5)
    assert inbox.offer(_plan(4)) is Verdict.STALE
    assert inbox.pop() is None


def test_future_window_is_a_protocol_error() -> None:
    inbox = Inbox("s", window_id=5)
    with pytest.raises(ProtocolError, match="window 6"):
        inbox.offer(_plan(6))


def test_other_session_is_a_protocol_error() -> None:
    with pytest.raises(ProtocolError, match="session"):
        Inbox("t").offer(_plan(0))


def test_abort_is_popped_before_earlier_messages() -> None:
    inbox = Inbox("s")
    inbox.offer(_plan(0))
    inbox.offer(_abort())
    assert inbox.pop().kind is Kind.ABORT


def test_abort_of_any_window_is_honoured() -> None:
    inbox = Inbox("s", window_id=3)
    assert inbox.offer(_abort(window=1)) is Verdict.ACCEPTED
    assert (
        inbox.offer(Abort(session_id="s", sender="w2", window_id=9, reason="x", cause_node="w2"))
        is Verdict.ACCEPTED
    )
    assert inbox.aborted == _abort(window=1)


def test_abort_wins_over_a_kind_filter() -> None:
    inbox = Inbox("s")
    inbox.offer(_abort())
    assert inbox.pop((Kind.PLAN,)).kind is Kind.ABORT


def test_kind_filter_leaves_other_messages_buffered() -> None:
    inbox = Inbox("s")
    commit = Commit(session_id="s", sender="w0")
    inbox.offer(_plan(0))
    inbox.offer(commit)
    assert inbox.pop((Kind.COMMIT,)) == commit
    assert inbox.pop() == _plan(0)


def test_advance_drops_buffered_messages_of_the_old_window() -> None:
    inbox = Inbox("s")
    inbox.offer(_plan(0))
    inbox.advance(1)
    assert inbox.pop() is None and inbox.num_stale == 1


def test_advance_keeps_round_scoped_messages() -> None:
    inbox = Inbox("s")
    upd = Update(session_id="s", sender="o0", round_id=0, num_samples=1, partition="owner")
    inbox.offer(upd)
    inbox.advance(4)
    assert inbox.pop() == upd


def test_window_cannot_go_back() -> None:
    inbox = Inbox("s", window_id=2)
    with pytest.raises(ValueError):
        inbox.advance(1)


def test_round_scoped_duplicates_are_suppressed_across_windows() -> None:
    inbox = Inbox("s")
    start = Start(session_id="s", sender="c", round_id=0, plan={}, roster=[])
    inbox.offer(start)
    inbox.advance(3)
    assert inbox.offer(start) is Verdict.DUPLICATE


def _opens(window: int) -> list[BusMessage]:
    return [
        Open(session_id="s", sender=f"w{i}", window_id=window, group_total=4, credit=2)
        for i in range(3)
    ]


@given(st.data())
def test_reordered_and_duplicated_deliveries_yield_each_message_once(data: st.DataObject) -> None:
    # Prepare: a window's messages plus stale leftovers, duplicated and shuffled.
    current = _opens(2)
    stale = _opens(1)
    deliveries = data.draw(st.permutations(current * 2 + stale + current[:1]))
    inbox = Inbox("s", window_id=2)
    # Execute
    for msg in deliveries:
        inbox.offer(msg)
    popped = []
    while (msg := inbox.pop()) is not None:
        popped.append(msg)
    # Assert
    assert sorted(popped, key=lambda m: m.sender) == current
    assert inbox.num_stale == len(stale)


def test_has_sees_aborts_and_matching_kinds_only() -> None:
    inbox = Inbox("s")
    inbox.offer(_plan(0))
    assert inbox.has((Kind.PLAN,)) and not inbox.has((Kind.OPEN,))
    inbox.offer(_abort())
    assert inbox.has((Kind.OPEN,))


def test_messages_from_senders_outside_the_peers_are_refused_and_counted() -> None:
    inbox = Inbox("s", peers=["o0", "w1", "coordinator"])
    stranger = Abort(session_id="s", sender="intruder", reason="stop", cause_node="o0")
    assert inbox.offer(stranger) is Verdict.UNKNOWN
    assert inbox.offer(stranger) is Verdict.UNKNOWN
    assert inbox.offer(_plan(0, sender="o9")) is Verdict.UNKNOWN
    assert inbox.aborted is None and inbox.pop() is None
    assert inbox.unknown_senders == {"intruder": 2, "o9": 1}
    assert inbox.offer(_abort()) is Verdict.ACCEPTED  # from w1, a peer
    assert inbox.pop() == _abort()


def test_without_peers_any_sender_is_accepted() -> None:
    assert Inbox("s").offer(_plan(0, sender="anyone")) is Verdict.ACCEPTED
