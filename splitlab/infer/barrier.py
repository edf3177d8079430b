"""The two-phase window barrier as pure state machines (no sockets, no clocks).

Head (`HeadBarrier`): PROPOSE epoch e -> collect one answer per participant -> COMMIT{e} only
after every ACK; a NACK, a timeout or a lost participant aborts e. Epochs increase
monotonically; a late answer for an older epoch is ignored, never counted.

Stage (`StageBarrier`): pre-stage on PROPOSE{e} (e newer than anything applied), ACK or NACK;
apply e only on COMMIT{e}; drop the pre-staged state on ABORT{e}. A repeated PROPOSE{e} (a
retry) is answered again without pre-staging twice, a repeated COMMIT{e} of an applied epoch
is ignored: retries are idempotent. Anything else (a COMMIT for an epoch that was never
proposed, a PROPOSE older than the applied epoch) is a protocol error.

    .venv/bin/pytest tests/unit/test_barrier_state.py -q
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum

from splitlab.control.messages import (
    Ack,
    BarrierAbort,
    BarrierCommit,
    BarrierMessage,
    Nack,
    Propose,
)
from splitlab.errors import ProtocolError


class Phase(StrEnum):
    IDLE = "idle"
    PROPOSED = "proposed"
    COMMITTED = "committed"
    ABORTED = "aborted"


@dataclass
class HeadBarrier:
    """The coordinator's side (see module docstring)."""

    participants: frozenset[int]
    epoch: int = 0
    phase: Phase = Phase.IDLE
    acks: dict[int, Ack] = field(default_factory=dict)
    abort_reason: str = ""

    def propose(self, *, token: int, cuts: Iterable[int], decision: str = "") -> Propose:
        if self.phase is Phase.PROPOSED:
            raise ProtocolError(f"head: epoch {self.epoch} is still open; commit or abort it first")
        self.epoch += 1
        self.phase, self.acks, self.abort_reason = Phase.PROPOSED, {}, ""
        return Propose(epoch=self.epoch, token=token, cuts=tuple(cuts), decision=decision)

    def on_answer(self, msg: Ack | Nack) -> BarrierCommit | BarrierAbort | None:
        """Count an answer; returns the decision once it is made (COMMIT or ABORT), else None."""
        if msg.epoch != self.epoch or self.phase is not Phase.PROPOSED:
            return None  # stale (an older epoch) or after the decision: ignored
        if msg.stage not in self.participants:
            raise ProtocolError(f"head: answer from stage {msg.stage}, not a participant")
        if isinstance(msg, Nack):
            return self._abort(f"stage {msg.stage} refused epoch {msg.epoch}: {msg.reason}")
        self.acks[msg.stage] = msg
        if set(self.acks) == set(self.participants):
            self.phase = Phase.COMMITTED
            return BarrierCommit(epoch=self.epoch)
        return None

    def on_failure(self, reason: str) -> BarrierAbort | None:
        """A timeout or a lost participant: abort the open epoch (None if none is open)."""
        if self.phase is not Phase.PROPOSED:
            return None
        return self._abort(reason)

    def _abort(self, reason: str) -> BarrierAbort:
        self.phase, self.abort_reason = Phase.ABORTED, reason
        return BarrierAbort(epoch=self.epoch, reason=reason)

    @property
    def missing(self) -> list[int]:
        return sorted(self.participants - set(self.acks))


class StageAction(StrEnum):
    PRESTAGE = "prestage"  # new epoch: pre-stage, then answer
    REANSWER = "reanswer"  # a retried PROPOSE: send the same answer again
    APPLY = "apply"  # COMMIT of the pending epoch
    DROP = "drop"  # ABORT of the pending epoch
    IGNORE = "ignore"  # a duplicate of something already done


@dataclass
class StageBarrier:
    """One stage's side (see module docstring)."""

    stage: int
    applied_epoch: int = 0
    pending: Propose | None = None
    answer: Ack | Nack | None = None
    seen_epoch: int = 0  # newest epoch proposed to this stage (applied, aborted or pending)

    def on_message(self, msg: BarrierMessage) -> StageAction:
        if isinstance(msg, Propose):
            return self._on_propose(msg)
        if isinstance(msg, BarrierCommit):
            return self._on_commit(msg)
        if isinstance(msg, BarrierAbort):
            return self._on_abort(msg)
        raise ProtocolError(f"stage {self.stage}: unexpected '{msg.kind}' in a barrier")

    def _on_propose(self, msg: Propose) -> StageAction:
        if self.pending is not None and msg.epoch == self.pending.epoch:
            return StageAction.REANSWER
        if msg.epoch <= self.seen_epoch:
            raise ProtocolError(
                f"stage {self.stage}: PROPOSE epoch {msg.epoch} but epoch {self.seen_epoch} was "
                "already proposed (epochs increase monotonically)"
            )
        self.pending, self.answer, self.seen_epoch = msg, None, msg.epoch
        return StageAction.PRESTAGE

    def answered(self, answer: Ack | Nack) -> Ack | Nack:
        assert self.pending is not None and answer.epoch == self.pending.epoch, (
            answer,
            self.pending,
        )
        self.answer = answer
        return answer

    def _on_commit(self, msg: BarrierCommit) -> StageAction:
        if msg.epoch <= self.applied_epoch:
            return StageAction.IGNORE
        if self.pending is None or msg.epoch != self.pending.epoch:
            raise ProtocolError(
                f"stage {self.stage}: COMMIT epoch {msg.epoch} but the pending epoch is "
                f"{None if self.pending is None else self.pending.epoch}"
            )
        if not isinstance(self.answer, Ack):
            raise ProtocolError(
                f"stage {self.stage}: COMMIT epoch {msg.epoch} without this stage's ACK"
            )
        self.applied_epoch, self.pending, self.answer = msg.epoch, None, None
        return StageAction.APPLY

    def _on_abort(self, msg: BarrierAbort) -> StageAction:
        if self.pending is None or msg.epoch != self.pending.epoch:
            return StageAction.IGNORE
        self.pending, self.answer = None, None
        return StageAction.DROP
