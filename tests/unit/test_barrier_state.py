"""The two-phase barrier state machines (splitlab.infer.barrier), no sockets."""

from __future__ import annotations

import pytest

from splitlab.control.messages import Ack, BarrierAbort, BarrierCommit, Close, Nack, Propose
from splitlab.errors import ProtocolError
from splitlab.infer.barrier import HeadBarrier, Phase, StageAction, StageBarrier


def _head() -> HeadBarrier:
    return HeadBarrier(frozenset({0, 1, 2}))


def test_commit_only_after_every_ack() -> None:
    head = _head()
    p = head.propose(token=20, cuts=(3, 6))
    assert head.on_answer(Ack(epoch=p.epoch, stage=0)) is None
    assert head.on_answer(Ack(epoch=p.epoch, stage=2)) is None
    assert head.missing == [1]
    assert head.on_answer(Ack(epoch=p.epoch, stage=1)) == BarrierCommit(epoch=1)
    assert head.phase is Phase.COMMITTED


def test_a_nack_aborts_and_later_answers_are_ignored() -> None:
    head = _head()
    p = head.propose(token=20, cuts=(3, 6))
    abort = head.on_answer(Nack(epoch=p.epoch, stage=1, reason="no"))
    assert isinstance(abort, BarrierAbort) and "stage 1" in abort.reason
    assert head.on_answer(Ack(epoch=p.epoch, stage=0)) is None
    assert head.on_answer(Ack(epoch=p.epoch, stage=2)) is None
    assert head.phase is Phase.ABORTED


def test_timeout_is_an_abort() -> None:
    head = _head()
    head.propose(token=20, cuts=(3, 6))
    head.on_answer(Ack(epoch=1, stage=0))
    assert head.on_failure("stage 1 timed out") == BarrierAbort(epoch=1, reason="stage 1 timed out")
    assert head.on_failure("again") is None  # nothing open any more


def test_epochs_increase_and_stale_answers_do_not_count() -> None:
    head = _head()
    head.propose(token=20, cuts=(3, 6))
    head.on_failure("x")
    p2 = head.propose(token=40, cuts=(3, 6))
    assert p2.epoch == 2
    for stage in (0, 1, 2):
        assert head.on_answer(Ack(epoch=1, stage=stage)) is None  # epoch 1 is over
    assert head.acks == {}


def test_cannot_propose_while_open_or_answer_from_a_stranger() -> None:
    head = _head()
    head.propose(token=20, cuts=(3, 6))
    with pytest.raises(ProtocolError, match="still open"):
        head.propose(token=40, cuts=(3, 6))
    with pytest.raises(ProtocolError, match="not a participant"):
        head.on_answer(Ack(epoch=1, stage=7))


def _stage_after_propose(epoch: int = 1) -> StageBarrier:
    st = StageBarrier(stage=1)
    assert st.on_message(Propose(epoch=epoch, token=20, cuts=(3, 6))) is StageAction.PRESTAGE
    return st


def test_stage_applies_only_on_commit_of_its_pending_epoch() -> None:
    st = _stage_after_propose()
    st.answered(Ack(epoch=1, stage=1))
    assert st.on_message(BarrierCommit(epoch=1)) is StageAction.APPLY
    assert st.applied_epoch == 1 and st.pending is None


def test_commit_without_ack_or_for_unknown_epoch_is_refused() -> None:
    st = _stage_after_propose()
    st.answered(Nack(epoch=1, stage=1, reason="no"))
    with pytest.raises(ProtocolError, match="without this stage's ACK"):
        st.on_message(BarrierCommit(epoch=1))
    st2 = _stage_after_propose()
    st2.answered(Ack(epoch=1, stage=1))
    with pytest.raises(ProtocolError, match="pending epoch is 1"):
        st2.on_message(BarrierCommit(epoch=2))


def test_retries_are_idempotent() -> None:
    st = _stage_after_propose()
    st.answered(Ack(epoch=1, stage=1))
    assert st.on_message(Propose(epoch=1, token=20, cuts=(3, 6))) is StageAction.REANSWER
    assert st.on_message(BarrierCommit(epoch=1)) is StageAction.APPLY
    assert st.on_message(BarrierCommit(epoch=1)) is StageAction.IGNORE  # duplicate commit


def test_abort_drops_pending_and_unrelated_abort_is_ignored() -> None:
    st = _stage_after_propose()
    assert st.on_message(BarrierAbort(epoch=3, reason="x")) is StageAction.IGNORE
    assert st.on_message(BarrierAbort(epoch=1, reason="x")) is StageAction.DROP
    assert st.pending is None and st.applied_epoch == 0
    assert st.on_message(Propose(epoch=2, token=40, cuts=(3, 6))) is StageAction.PRESTAGE


def test_old_epochs_are_refused() -> None:
    st = _stage_after_propose(epoch=5)
    st.on_message(BarrierAbort(epoch=5, reason="x"))
    with pytest.raises(ProtocolError, match="monotonically"):
        st.on_message(Propose(epoch=4, token=40, cuts=(3, 6)))


def test_a_newer_propose_replaces_an_unanswered_one() -> None:
    st = _stage_after_propose(epoch=1)
    assert st.on_message(Propose(epoch=2, token=20, cuts=(3, 6))) is StageAction.PRESTAGE
    assert st.pending.epoch == 2


def test_other_kinds_are_protocol_errors() -> None:
    with pytest.raises(ProtocolError):
        StageBarrier(stage=1).on_message(Close())
