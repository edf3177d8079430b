"""The U-shape training step, every node in one process: the oracle the real schedulers match.

Owners hold front (embeddings + first blocks) and tail (last blocks + head + loss); workers hold
a body replica. One window runs the protocol of `splitlab.train.window` with direct calls in
place of messages:

    PLAN     each owner pins its window's microbatches to workers by smooth WRR
    OPEN     each worker grants every owner `credit` live microbatches
    run      per microbatch (`splitlab.train.nodes`): front forward -> cut -> body forward on
             the pinned worker -> cut -> tail forward, loss x objective scale and tail backward
             at once; later body backward -> grad at the cut -> front backward, after which
             the graphs and the credit are released and the slot is refilled at once
    DRAINED  every owner's microbatches are all backward
    COMMIT   each worker that ran work clips and steps its body, reports its throughput
    step     each owner that ran work clips and steps front + tail together

Each forward runs once (dropout masks are drawn once and reused by the backward), forwards run
in microbatch order front -> body -> tail, and no parameter changes inside a window, so with
one owner and one worker this is exactly the unsplit model trained with AdamW on the same
windows. Compute that a distributed run overlaps is serialised here.

    .venv/bin/pytest tests/equivalence/test_train_engine.py -q
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from splitlab.config.enums import Objective
from splitlab.models.families import PAD_MASK
from splitlab.telemetry.records import (
    BackwardRecord,
    CommitRecord,
    DrainedRecord,
    Emit,
    ForwardRecord,
    OpenRecord,
    PlanRecord,
    StepRecord,
)
from splitlab.train.nodes import (
    Batch,
    Crossing,
    OwnerNode,
    WorkerNode,
    clip_and_step,
)
from splitlab.train.objective import loss_scale, num_targets
from splitlab.train.window import (
    InflightLedger,
    Phase,
    WindowBarrier,
    next_dispatch,
    planned_counts,
    round_schedule,
)
from splitlab.train.wrr import AdaptiveWeights, SmoothWRR


@dataclass
class WindowReport:
    window_id: int
    group_total: int
    assignment: dict[str, list[str]]  # owner -> worker per microbatch, in plan order
    losses: dict[str, list[float]]  # owner -> unscaled microbatch losses, in forward order
    stepped: list[str] = field(default_factory=list)  # nodes whose parameters changed
    peak_live: int = 0  # most microbatches live at once in the group


class UShapeEngine:
    """Runs U-shape windows over owners and workers that live in this process.

    Args:
        owners, workers: the nodes; each worker's body replica is independent.
        max_inflight: live microbatches per owner.
        credit: live microbatches per (owner, worker), see `effective_credit`.
        weights: per owner, the compute weights its WRR uses (default: all 1.0, fixed).
        objective: how microbatch losses combine (`splitlab.train.objective`).
        clip_grad_norm: > 0 clips owner and body partitions separately.
        backward_order: "fifo" (oldest live microbatch first) or "lifo" (newest first, i.e.
            gradients coming back out of order); the parameters end up the same.
        emit: trace sink, called with each record (`Tracer.write`).
    """

    def __init__(
        self,
        *,
        owners: Sequence[OwnerNode],
        workers: Sequence[WorkerNode],
        max_inflight: int,
        credit: int,
        weights: Mapping[str, AdaptiveWeights] | None = None,
        objective: Objective | str = Objective.mean_of_means,
        clip_grad_norm: float = 0.0,
        backward_order: str = "fifo",
        emit: Emit | None = None,
    ) -> None:
        if backward_order not in ("fifo", "lifo"):
            raise ValueError(f"backward_order={backward_order!r}: fifo or lifo")
        self.owners = list(owners)
        self.workers = {w.name: w for w in workers}
        self.max_inflight = max_inflight
        self.credit = credit
        uniform = dict.fromkeys(self.workers, 1.0)
        self.weights = dict(
            weights or {o.name: AdaptiveWeights(uniform, adaptive=False) for o in owners}
        )
        self._wrr = {o.name: SmoothWRR(self.weights[o.name].weights()) for o in owners}
        self.objective = Objective(objective)
        self.clip_grad_norm = clip_grad_norm
        self.backward_order = backward_order
        self.emit: Emit = emit or (lambda record: None)

    def reset_wrr(self, owner: str) -> None:
        """Forget an owner's WRR scores (a new round starts from the configured weights)."""
        self._wrr[owner].reset()

    # --- one window --------------------------------------------------------------------------

    def run_window(
        self, window_id: int, batches_by_owner: Mapping[str, Sequence[Batch]]
    ) -> WindowReport:
        """Run one window; every owner takes part (an owner with no batches runs 0)."""
        names = tuple(o.name for o in self.owners)
        barrier = WindowBarrier(window_id=window_id, owners=names, workers=tuple(self.workers))
        batches = {o.name: list(batches_by_owner.get(o.name, ())) for o in self.owners}
        assignment: dict[str, list[str]] = {}
        for owner in self.owners:
            wrr = self._wrr[owner.name]
            wrr.set_weights(self.weights[owner.name].weights())
            assignment[owner.name] = wrr.assign(len(batches[owner.name]))
            counts = planned_counts(assignment[owner.name], list(self.workers))
            barrier.plan(owner.name, counts)
            self.emit(PlanRecord(window=window_id, owner=owner.name, counts_by_worker=counts))
        for worker in self.workers.values():
            barrier.open(worker.name)
            worker.start_window()
            self.emit(
                OpenRecord(
                    window=window_id,
                    worker=worker.name,
                    group_total=barrier.group_total,
                    credit=self.credit,
                )
            )
        report = WindowReport(window_id, barrier.group_total, assignment, {n: [] for n in names})
        if barrier.group_total:
            self._run_microbatches(window_id, batches, assignment, report)
        for owner in self.owners:
            barrier.drain(owner.name, len(batches[owner.name]))
            self.emit(
                DrainedRecord(
                    window=window_id,
                    owner=owner.name,
                    num_microbatches=len(batches[owner.name]),
                )
            )
        assert barrier.phase is Phase.DRAINED
        for worker in self.workers.values():
            if barrier.steps(worker.name):
                clip_and_step(worker.params, worker.optimizer, self.clip_grad_norm)
                report.stepped.append(worker.name)
            tokens_per_s = worker.tokens_per_s()
            barrier.commit(worker.name, barrier.worker_total(worker.name))
            self.emit(
                CommitRecord(
                    window=window_id,
                    worker=worker.name,
                    num_microbatches=barrier.worker_total(worker.name),
                    tokens_per_s=tokens_per_s,
                )
            )
            for weights in self.weights.values():
                weights.observe(
                    worker.name, padded_tokens=worker.padded_tokens, seconds=worker.compute_s
                )
        assert barrier.phase is Phase.COMMITTED
        for owner in self.owners:
            if barrier.steps(owner.name):
                clip_and_step(owner.params, owner.optimizer, self.clip_grad_norm)
                report.stepped.append(owner.name)
                self.emit(StepRecord(window=window_id, owner=owner.name))
        return report

    def _run_microbatches(
        self,
        window_id: int,
        batches: Mapping[str, list[Batch]],
        assignment: Mapping[str, list[str]],
        report: WindowReport,
    ) -> None:
        group_targets = 0
        if self.objective is Objective.token_weighted:
            group_targets = sum(
                num_targets(o.front.adapter, b) for o in self.owners for b in batches[o.name]
            )
        ledgers = {
            o.name: InflightLedger(
                total=self.max_inflight, credit_by_peer=dict.fromkeys(self.workers, self.credit)
            )
            for o in self.owners
        }
        pending = {o.name: list(range(len(batches[o.name]))) for o in self.owners}
        live: list[tuple[OwnerNode, WorkerNode, int, Crossing]] = []  # awaiting body backward
        while live or any(pending.values()):
            dispatched = False
            for owner in self.owners:  # one forward per owner per turn: owners share workers fairly
                queue = pending[owner.name]
                workers = [assignment[owner.name][mb] for mb in queue]
                index = next_dispatch(workers, ledgers[owner.name])
                if index is None:
                    continue
                microbatch = queue.pop(index)
                worker = self.workers[workers[index]]
                ledgers[owner.name].admit(microbatch, worker.name)
                batch = batches[owner.name][microbatch]
                scale = loss_scale(
                    self.objective,
                    group_microbatches=report.group_total,
                    num_targets=num_targets(owner.front.adapter, batch) if group_targets else 0,
                    group_targets=group_targets,
                )
                sent = owner.front_forward(microbatch, batch)
                returned = worker.body_forward((owner.name, microbatch), sent, batch[PAD_MASK])
                grad, loss = owner.tail_step(microbatch, returned, batch, scale)
                report.losses[owner.name].append(loss)
                live.append((owner, worker, microbatch, grad))
                report.peak_live = max(report.peak_live, len(live))
                self.emit(
                    ForwardRecord(
                        window=window_id,
                        microbatch=microbatch,
                        owner=owner.name,
                        worker=worker.name,
                    )
                )
                dispatched = True
            if not dispatched:
                owner, worker, microbatch, grad = live.pop(
                    0 if self.backward_order == "fifo" else -1
                )
                owner.front_backward(
                    microbatch, worker.body_backward((owner.name, microbatch), grad)
                )
                ledgers[owner.name].release(microbatch)
                self.emit(
                    BackwardRecord(
                        window=window_id,
                        microbatch=microbatch,
                        owner=owner.name,
                        worker=worker.name,
                    )
                )

    # --- a round -----------------------------------------------------------------------------

    def run_round(
        self, batches_by_owner: Mapping[str, Sequence[Batch]], *, quota: int, first_window: int = 0
    ) -> list[WindowReport]:
        """All of a round's windows: `quota` microbatches per owner per window, partial last."""
        schedule = round_schedule(
            {o.name: len(batches_by_owner.get(o.name, ())) for o in self.owners}, quota
        )
        reports = []
        for index, counts in enumerate(schedule):
            window = {
                name: list(batches_by_owner[name][index * quota : index * quota + count])
                for name, count in counts.items()
            }
            reports.append(self.run_window(first_window + index, window))
        return reports
