"""The owner's U-shape scheduler over a tensor transport and a control endpoint.

Per window (see `splitlab.train.window` for the protocol and `splitlab.train.nodes` for the
compute):

1. pin this window's microbatches to workers by smooth WRR and send PLAN to every worker
   (zeros included, so an empty owner still joins the barrier);
2. collect every worker's OPEN: the group total (the objective's denominator) and the credit;
3. loop until every microbatch finished backward, serving returning work first:
   a FRONT_BACKWARD (front backward, release the slot), then a TAIL_FORWARD (tail forward,
   scaled loss, backward, BODY_BACKWARD to the same worker), then a new BODY_FORWARD to the
   first pending microbatch whose worker has a free slot (others are skipped, not waited on);
4. send DRAINED, collect every worker's COMMIT (with its throughput for adaptive weights),
   then step front + tail (if this owner ran anything).

Any failure sends ABORT to every worker with the cause before it propagates.

    .venv/bin/pytest tests/equivalence/test_train_schedulers.py -q
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from splitlab.config.enums import Objective
from splitlab.control.endpoint import ControlEndpoint
from splitlab.control.messages import Commit, Drained, Kind, Open, Plan
from splitlab.errors import ProtocolError
from splitlab.models.families import PAD_MASK as ATTENTION_MASK
from splitlab.telemetry.records import (
    BackwardRecord,
    DrainedRecord,
    Emit,
    ForwardRecord,
    MicrobatchRecord,
    PlanRecord,
    StepRecord,
    WindowProfileRecord,
    WrrRecord,
)
from splitlab.train.nodes import Batch, OwnerNode, clip_and_step, device_of
from splitlab.train.objective import loss_scale, num_targets
from splitlab.train.phases import PhaseTimes
from splitlab.train.protocol import (
    BODY_BACKWARD,
    BODY_FORWARD,
    FRONT_BACKWARD,
    IDLE_WAIT_S,
    PAD_MASK,
    TAIL_FORWARD,
    Watchdog,
    abort_peers,
    explain_peer_loss,
    owned_on,
    try_recv,
)
from splitlab.train.window import InflightLedger, next_dispatch, planned_counts
from splitlab.train.wrr import AdaptiveWeights, SmoothWRR
from splitlab.wire.base import InFlight, Message, Priority, Transport
from splitlab.wire.frame import Lane, Routing


def payload_bytes(tensors: Mapping[str, torch.Tensor]) -> int:
    """Tensor bytes a frame carries (its JSON header aside)."""
    return sum(t.numel() * t.element_size() for t in tensors.values())


def agreed(opens: Mapping[str, Open], name: str, window_id: int) -> int:
    """A value every worker's OPEN must carry alike (the group total, the group's targets)."""
    values = {getattr(msg, name) for msg in opens.values()}
    if len(values) != 1:
        raise ProtocolError(f"window {window_id}: workers disagree on {name} {sorted(values)}")
    return values.pop()


@dataclass(frozen=True)
class SchedulerSettings:
    max_inflight: int = 2  # live microbatches per owner
    clip_grad_norm: float = 0.0  # > 0 clips this node's partition on its own
    timeout_s: float = 120.0  # any wait without progress before the round aborts
    objective: Objective = Objective.mean_of_means


class OwnerScheduler:
    """Runs one owner's windows against the workers of its group."""

    def __init__(
        self,
        *,
        node: OwnerNode,
        transport: Transport,
        control: ControlEndpoint,
        workers: Sequence[str],
        weights: AdaptiveWeights,
        settings: SchedulerSettings,
        emit: Emit | None = None,
    ) -> None:
        self.objective = Objective(settings.objective)
        self.node, self.transport, self.control = node, transport, control
        self.workers = list(workers)
        self.weights, self.settings = weights, settings
        self.wrr = SmoothWRR(weights.weights())
        self.emit: Emit = emit or (lambda record: None)
        self.peak_live = 0  # most front graphs kept at once (reset by the caller)
        self.phases = PhaseTimes()

    def run_window(self, window_id: int, batches: Sequence[Batch]) -> list[float]:
        """One window; returns this owner's microbatch losses. Aborts the group on failure."""
        try:
            return self._window(window_id, list(batches))
        except BaseException as exc:
            explain_peer_loss(self.control, exc)  # raises the ABORT's cause if there is one
            abort_peers(self.control, self.workers, exc)
            raise

    def _window(self, window_id: int, batches: list[Batch]) -> list[float]:
        ctl, me, timeout_s = self.control, self.control.node_id, self.settings.timeout_s
        phase = self.phases.phase
        ctl.advance(window_id)
        self.wrr.set_weights(self.weights.weights())
        assignment = self.wrr.assign(len(batches))
        counts = planned_counts(assignment, self.workers)
        targets = [0] * len(batches)
        if self.objective is Objective.token_weighted:  # this owner's terms of the objective
            targets = [num_targets(self.node.tail.adapter, b) for b in batches]
        plan = Plan(session_id=ctl.session, sender=me, window_id=window_id,
                    counts_by_worker=counts, num_targets=sum(targets))  # fmt: skip
        with phase("open_wait"):
            ctl.send_all(self.workers, plan)
            self.emit(PlanRecord(window=window_id, owner=me, counts_by_worker=counts))
            for worker, count in counts.items():  # the analysis contract's per-worker allocation
                self.emit(WrrRecord(window=window_id, owner=me, worker=worker, count=count))
            opens: dict[str, Open] = ctl.collect(Kind.OPEN, self.workers, timeout_s)  # type: ignore[assignment]
        group_total = agreed(opens, "group_total", window_id)
        scales = [loss_scale(Objective.mean_of_means, group_microbatches=group_total)] * len(
            batches
        )
        if self.objective is Objective.token_weighted and batches:
            group_targets = agreed(opens, "group_targets", window_id)
            scales = [loss_scale(self.objective, group_microbatches=group_total, num_targets=n,
                                 group_targets=group_targets) for n in targets]  # fmt: skip
        losses = self._run(window_id, batches, assignment, opens, scales) if batches else []
        drained = Drained(
            session_id=ctl.session, sender=me, window_id=window_id, num_microbatches=len(batches)
        )
        with phase("commit_wait"):
            # Traced before sending, so no worker's COMMIT can carry an earlier timestamp.
            self.emit(DrainedRecord(window=window_id, owner=me, num_microbatches=len(batches)))
            ctl.send_all(self.workers, drained)
            commits: dict[str, Commit] = ctl.collect(Kind.COMMIT, self.workers, timeout_s)  # type: ignore[assignment]
        for worker, msg in commits.items():
            self.weights.observe_rate(worker, msg.tokens_per_s)
        if batches:
            with phase("step"):
                clip_and_step(self.node.params, self.node.optimizer, self.settings.clip_grad_norm)
            self.emit(StepRecord(window=window_id, owner=me))
        self.emit(WindowProfileRecord(window=window_id, node=me, num_microbatches=len(batches),
                                      phases=self.phases.take()))  # fmt: skip
        return losses

    def _run(
        self,
        window_id: int,
        batches: list[Batch],
        assignment: list[str],
        opens: dict[str, Open],
        scales: list[float],
    ) -> list[float]:
        me, transport, timeout_s = self.control.node_id, self.transport, self.settings.timeout_s
        phase = self.phases.phase
        ledger = InflightLedger(
            total=self.settings.max_inflight,
            credit_by_peer={w: msg.credit for w, msg in opens.items()},
        )
        pending = list(range(len(batches)))
        done, losses = 0, []
        sends = InFlight(transport, timeout_s=timeout_s)  # out while the next microbatch computes
        watchdog = Watchdog(self.control, timeout_s=timeout_s, what=f"running window {window_id}")
        device = device_of(self.node.front)  # received tensors go straight there

        def routing(microbatch: int) -> Routing:
            return Routing(session=self.control.session, window=window_id, microbatch=microbatch)

        def receive(lane: Lane, wait_s: float = 0.0) -> tuple[Message, dict] | None:
            with phase("idle" if wait_s else "recv"):
                msg = try_recv(transport, lane, wait_s)
                if msg is None:
                    return None
                with msg:
                    kind = FRONT_BACKWARD if lane is Lane.GRADIENT else TAIL_FORWARD
                    self._check(msg, kind, window_id, ledger)
                    return msg, owned_on(msg, transport, device)

        def front_backward(msg: Message, grad: dict[str, torch.Tensor]) -> None:
            microbatch = msg.routing.microbatch
            with phase("front_bwd"):
                self.node.front_backward(microbatch, grad)
            ledger.release(microbatch)
            self.emit(
                BackwardRecord(window=window_id, microbatch=microbatch, owner=me, worker=msg.peer)
            )
            self.emit(MicrobatchRecord(window=window_id, microbatch=microbatch, owner=me,
                      worker=msg.peer, lane="gradient", bytes=payload_bytes(grad)))  # fmt: skip

        def send(peer: str, lane: Lane, kind: str, tensors: dict, microbatch: int,
                 priority: Priority) -> None:  # fmt: skip
            with phase("send"):
                sends.send(
                    peer, lane, kind, tensors, routing=routing(microbatch), priority=priority
                )

        while done < len(batches):
            busy = False
            got = receive(Lane.GRADIENT)
            if got is not None:  # returning work first: it frees a slot
                front_backward(*got)
                done += 1
                busy = True
            got = receive(Lane.ACTIVATION)
            if got is not None:
                msg, hidden = got
                microbatch = msg.routing.microbatch
                with phase("tail"):
                    grad, loss = self.node.tail_step(
                        microbatch, hidden, batches[microbatch], scales[microbatch]
                    )
                losses.append(loss)
                send(msg.peer, Lane.GRADIENT, BODY_BACKWARD, grad, microbatch, Priority.BACKWARD)
                busy = True
            index = next_dispatch([assignment[mb] for mb in pending], ledger)
            if index is not None:
                microbatch = pending.pop(index)
                worker = assignment[microbatch]
                ledger.admit(microbatch, worker)
                batch = batches[microbatch]
                with phase("front_fwd"):
                    hidden = self.node.front_forward(microbatch, batch)
                self.peak_live = max(self.peak_live, self.node.live)
                # 1 byte per position instead of int64: the worker widens it again
                tensors = {**hidden, PAD_MASK: batch[ATTENTION_MASK].to(torch.uint8)}
                send(worker, Lane.ACTIVATION, BODY_FORWARD, tensors, microbatch, Priority.FORWARD)
                self.emit(
                    ForwardRecord(window=window_id, microbatch=microbatch, owner=me, worker=worker)
                )
                self.emit(MicrobatchRecord(window=window_id, microbatch=microbatch, owner=me,
                          worker=worker, lane="activation", bytes=payload_bytes(tensors)))  # fmt: skip
                busy = True
            if busy:
                watchdog.progress()
                continue
            watchdog.check(w for w in self.workers if ledger.live_on(w))
            got = receive(Lane.GRADIENT, IDLE_WAIT_S)  # idle: block briefly
            if got is not None:
                front_backward(*got)
                done += 1
                watchdog.progress()
        with phase("send"):
            sends.wait_all()
        return losses

    def _check(self, msg: Message, kind: str, window_id: int, ledger: InflightLedger) -> int:
        """The microbatch a frame is about, after checking it belongs here and now."""
        microbatch = msg.routing.microbatch
        if msg.kind != kind or msg.routing.window != window_id or microbatch is None:
            raise ProtocolError(
                f"{self.control.node_id!r} got {msg.kind} for window {msg.routing.window} "
                f"microbatch {microbatch} from {msg.peer!r}, expected {kind} in window {window_id}"
            )
        try:
            pinned = ledger.peer_of(microbatch)
        except KeyError:
            raise ProtocolError(
                f"{msg.kind} from {msg.peer!r} for microbatch {microbatch}, which is not live"
            ) from None
        if pinned != msg.peer:
            raise ProtocolError(
                f"{msg.kind} for microbatch {microbatch} came from {msg.peer!r}, "
                f"but it is pinned to {pinned!r}"
            )
        return microbatch
