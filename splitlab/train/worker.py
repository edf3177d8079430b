"""The worker's U-shape scheduler: body forward/backward for every owner of its group.

Per window:

1. collect every owner's PLAN: how many microbatches each sends here, and the group total;
2. send OPEN (group total, the per-owner credit) to every owner;
3. serve until every planned microbatch finished its body backward: arrived frames go into
   ready queues (`splitlab.train.ready`) served backward first and, among owners, by their
   weights. A BODY_BACKWARD runs the kept graph, releases it and returns FRONT_BACKWARD; a
   BODY_FORWARD runs the body once, keeps its graph (pinned here until its backward) and
   returns TAIL_FORWARD. An owner exceeding its credit or its plan is a protocol error;
4. collect every owner's DRAINED, step the body (if it ran anything), enter the next window,
   then send COMMIT with the measured throughput (padded tokens / body seconds).

Any failure sends ABORT to every owner with the cause before it propagates.

    .venv/bin/pytest tests/equivalence/test_train_schedulers.py -q
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from splitlab.control.endpoint import ControlEndpoint
from splitlab.control.messages import Commit, Drained, Kind, Open, Plan
from splitlab.errors import ProtocolError
from splitlab.telemetry.records import CommitRecord, Emit, OpenRecord, WindowProfileRecord
from splitlab.train.nodes import WorkerNode, clip_and_step, device_of
from splitlab.train.owner import SchedulerSettings
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
from splitlab.train.ready import ReadyQueues, Work
from splitlab.train.window import InflightLedger
from splitlab.wire.base import InFlight, Message, Priority, Transport
from splitlab.wire.frame import Lane, Routing


class WorkerScheduler:
    """Runs one worker's windows for the owners of its group."""

    def __init__(
        self,
        *,
        node: WorkerNode,
        transport: Transport,
        control: ControlEndpoint,
        owners: Sequence[str],
        credit: int,
        worker_max_inflight: int,
        settings: SchedulerSettings,
        owner_weights: Mapping[str, float] | None = None,
        emit: Emit | None = None,
    ) -> None:
        self.node, self.transport, self.control = node, transport, control
        # Service weights of the owners' ready queues (their registered weights; equal by default).
        self.owner_weights = dict(owner_weights or dict.fromkeys(owners, 1.0))
        self.owners = list(owners)
        self.credit, self.worker_max_inflight = credit, worker_max_inflight
        self.settings = settings
        self.emit: Emit = emit or (lambda record: None)
        self.peak_live = 0  # most body graphs kept at once (reset by the caller)
        self.phases = PhaseTimes()

    def run_window(self, window_id: int) -> int:
        """One window; returns the microbatches this worker ran. Aborts the group on failure."""
        try:
            return self._window(window_id)
        except BaseException as exc:
            explain_peer_loss(self.control, exc)  # raises the ABORT's cause if there is one
            abort_peers(self.control, self.owners, exc)
            raise

    def _window(self, window_id: int) -> int:
        ctl, me, timeout_s = self.control, self.control.node_id, self.settings.timeout_s
        phase = self.phases.phase
        ctl.advance(window_id)
        with phase("plan_wait"):
            plans: dict[str, Plan] = ctl.collect(Kind.PLAN, self.owners, timeout_s)  # type: ignore[assignment]
        expected = {owner: int(plan.counts_by_worker.get(me, 0)) for owner, plan in plans.items()}
        planned_by_owner = {o: sum(p.counts_by_worker.values()) for o, p in plans.items()}
        group_total = sum(planned_by_owner.values())
        group_targets = sum(p.num_targets for p in plans.values())  # token-weighted denominator
        self.node.start_window()
        opened = Open(session_id=ctl.session, sender=me, window_id=window_id,
                      group_total=group_total, credit=self.credit,
                      group_targets=group_targets)  # fmt: skip
        ctl.send_all(self.owners, opened)
        self.emit(
            OpenRecord(window=window_id, worker=me, group_total=group_total, credit=self.credit)
        )
        total = sum(expected.values())
        if total:
            self._serve(window_id, expected)
        with phase("drained_wait"):
            drained: dict[str, Drained] = ctl.collect(Kind.DRAINED, self.owners, timeout_s)  # type: ignore[assignment]
        for owner, msg in drained.items():
            if msg.num_microbatches != planned_by_owner[owner]:
                raise ProtocolError(
                    f"{owner!r} drained {msg.num_microbatches} microbatches in window "
                    f"{window_id}, planned {planned_by_owner[owner]}"
                )
        if total:
            with phase("step"):
                clip_and_step(self.node.params, self.node.optimizer, self.settings.clip_grad_norm)
        tokens_per_s = self.node.tokens_per_s()
        ctl.advance(window_id + 1)  # before COMMIT: owners' next PLAN may follow at once
        commit = Commit(
            session_id=ctl.session,
            sender=me,
            window_id=window_id,
            num_microbatches=total,
            tokens_per_s=tokens_per_s,
        )
        self.emit(  # before sending: a trace must never show an owner's step before this
            CommitRecord(
                window=window_id, worker=me, num_microbatches=total, tokens_per_s=tokens_per_s
            )
        )
        ctl.send_all(self.owners, commit)
        self.emit(WindowProfileRecord(window=window_id, node=me, num_microbatches=total,
                                      phases=self.phases.take()))  # fmt: skip
        return total

    def _serve(self, window_id: int, expected: dict[str, int]) -> None:
        transport, timeout_s = self.transport, self.settings.timeout_s
        ledger = InflightLedger(
            total=self.worker_max_inflight, credit_by_peer=dict.fromkeys(self.owners, self.credit)
        )
        ready: ReadyQueues[tuple[int, dict[str, torch.Tensor]]] = ReadyQueues(self.owner_weights)
        arrived = dict.fromkeys(self.owners, 0)
        done, total = 0, sum(expected.values())
        watchdog = Watchdog(self.control, timeout_s=timeout_s, what=f"serving window {window_id}")
        device = device_of(self.node.body)  # received tensors go straight there

        def routing(microbatch: int) -> Routing:
            return Routing(session=self.control.session, window=window_id, microbatch=microbatch)

        phase = self.phases.phase
        sends = InFlight(transport, timeout_s=timeout_s)  # out while the next body computes

        def pull(lane: Lane, wait_s: float = 0.0) -> bool:
            """Move one arrived frame into the ready queues (tensors copied, buffer released)."""
            with phase("idle" if wait_s else "recv"):
                msg = try_recv(transport, lane, wait_s)
                if msg is None:
                    return False
                returning = lane is Lane.GRADIENT
                with msg:
                    microbatch = self._check(
                        msg, BODY_BACKWARD if returning else BODY_FORWARD, window_id
                    )
                    tensors = owned_on(msg, transport, device)
            if not returning:
                arrived[msg.peer] += 1
                if arrived[msg.peer] > expected[msg.peer]:
                    raise ProtocolError(
                        f"{msg.peer!r} sent more than its planned {expected[msg.peer]} "
                        f"microbatches in window {window_id}"
                    )
                ledger.admit((msg.peer, microbatch), msg.peer)  # over credit: protocol error
            ready.push(Work.RETURNING if returning else Work.NEW, msg.peer, (microbatch, tensors))
            return True

        def send(peer: str, lane: Lane, kind: str, tensors: dict, microbatch: int,
                 priority: Priority) -> None:  # fmt: skip
            with phase("send"):
                sends.send(
                    peer, lane, kind, tensors, routing=routing(microbatch), priority=priority
                )

        while done < total:
            while pull(Lane.GRADIENT):
                pass
            while pull(Lane.ACTIVATION):
                pass
            item = ready.pop()  # backward first; among owners, by their weights
            if item is None:
                watchdog.check(
                    o for o in self.owners if arrived[o] < expected[o] or ledger.live_on(o)
                )
                pull(Lane.ACTIVATION, IDLE_WAIT_S)
                continue
            work, owner, (microbatch, tensors) = item
            key = (owner, microbatch)
            if work is Work.RETURNING:
                ledger.release(key)
                with phase("body_bwd"):
                    grad_in = self.node.body_backward(key, tensors)
                send(owner, Lane.GRADIENT, FRONT_BACKWARD, grad_in, microbatch, Priority.BACKWARD)
                done += 1
            else:
                pad_mask = tensors[PAD_MASK].long()  # it travels as uint8
                with phase("body_fwd"):
                    out = self.node.body_forward(key, tensors, pad_mask)
                self.peak_live = max(self.peak_live, self.node.live)
                send(owner, Lane.ACTIVATION, TAIL_FORWARD, out, microbatch, Priority.FORWARD)
            watchdog.progress()
        with phase("send"):
            sends.wait_all()

    def _check(self, msg: Message, kind: str, window_id: int) -> int:
        microbatch = msg.routing.microbatch
        if msg.peer not in self.owners:
            raise ProtocolError(f"{msg.kind} from {msg.peer!r}, not an owner of this group")
        if msg.kind != kind or msg.routing.window != window_id or microbatch is None:
            raise ProtocolError(
                f"{self.control.node_id!r} got {msg.kind} for window {msg.routing.window} "
                f"microbatch {microbatch} from {msg.peer!r}, expected {kind} in window {window_id}"
            )
        return microbatch
