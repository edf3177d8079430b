"""The U-shape training step, every node in one process: the reference the distributed run keeps.

Owners hold front (embeddings + first blocks) and tail (last blocks + head + loss); workers hold
a body replica. One window runs the protocol of `splitlab.train.window` with direct calls in
place of messages:

    PLAN     each owner pins its window's microbatches to workers by smooth WRR
    OPEN     each worker grants every owner `credit` live microbatches
    run      per microbatch: front forward -> cut (detach, fresh leaf) -> body forward on the
             pinned worker -> cut -> tail forward -> loss x objective scale; later its
             backward: tail -> grad at the cut -> body -> grad at the cut -> front; the graph
             and the credit are released right after; a freed slot is refilled at once
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

import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from splitlab.config.enums import Objective
from splitlab.errors import NonFiniteError
from splitlab.models.families import INPUT_IDS, PAD_MASK
from splitlab.models.parts import Part, group
from splitlab.models.tokens import positions_from_pad_mask
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

Batch = Mapping[str, torch.Tensor]
Emit = Callable[..., None]  # `Tracer.emit(kind, **fields)` or a test's recorder


def partition_parameters(*modules: nn.Module) -> list[nn.Parameter]:
    """Trainable parameters of `modules`, each tensor once (a tied head appears once)."""
    seen: set[int] = set()
    params: list[nn.Parameter] = []
    for module in modules:
        for param in module.parameters():
            if param.requires_grad and id(param) not in seen:
                seen.add(id(param))
                params.append(param)
    return params


def check_finite_tensor(tensor: torch.Tensor, what: str) -> None:
    """Raises: NonFiniteError with `what` (which tensor, from which node, which microbatch)."""
    if not bool(torch.isfinite(tensor).all()):
        raise NonFiniteError(f"non-finite values in {what}")


def clip_and_step(
    params: Sequence[nn.Parameter], optimizer: torch.optim.Optimizer, clip: float
) -> None:
    """Clip this partition's gradients on their own (if `clip` > 0), step, zero."""
    if clip > 0.0:
        torch.nn.utils.clip_grad_norm_(params, clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


@dataclass
class OwnerNode:
    """A data owner's partition: front + tail, one optimizer over both (tied tensors once)."""

    name: str
    front: Part
    tail: Part
    optimizer: torch.optim.Optimizer
    num_samples: int = 0  # sequences processed this round (the FedAvg weight)

    @property
    def params(self) -> list[nn.Parameter]:
        return partition_parameters(self.front, self.tail)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The owner partition under the original checkpoint keys."""
        return group([self.front, self.tail]).state_dict()


@dataclass
class WorkerNode:
    """A compute worker's body replica and its optimizer."""

    name: str
    body: Part
    optimizer: torch.optim.Optimizer
    num_samples: int = 0  # sequences processed this round (the FedAvg weight)
    padded_tokens: int = 0  # this window, for the throughput report
    compute_s: float = 0.0  # this window's body forward + backward time

    @property
    def params(self) -> list[nn.Parameter]:
        return partition_parameters(self.body)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.body.state_dict()


@dataclass
class _Live:
    """One microbatch between its forward and its backward: the graphs and both cuts."""

    owner: OwnerNode
    worker: WorkerNode
    microbatch: int
    front_out: torch.Tensor
    body_in: torch.Tensor
    body_out: torch.Tensor
    tail_in: torch.Tensor
    scaled_loss: torch.Tensor
    loss: float  # unscaled, for reports and validation


@dataclass
class WindowReport:
    window_id: int
    group_total: int
    assignment: dict[str, list[str]]  # owner -> worker per microbatch, in plan order
    losses: dict[str, list[float]]  # owner -> unscaled microbatch losses, in backward order
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
        emit: trace sink, called as `emit(kind, **fields)`.
        clock: seconds for body timing (perf_counter; injectable for tests).
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
        clock: Callable[[], float] = time.perf_counter,
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
        self.emit: Emit = emit or (lambda kind, **fields: None)
        self.clock = clock

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
            self.emit("plan", window=window_id, owner=owner.name, counts_by_worker=counts)
        for worker in self.workers.values():
            barrier.open(worker.name)
            worker.padded_tokens, worker.compute_s = 0, 0.0
            self.emit(
                "open",
                window=window_id,
                worker=worker.name,
                group_total=barrier.group_total,
                credit=self.credit,
            )
        report = WindowReport(window_id, barrier.group_total, assignment, {n: [] for n in names})
        if barrier.group_total:
            self._run_microbatches(window_id, batches, assignment, report)
        for owner in self.owners:
            barrier.drain(owner.name, len(batches[owner.name]))
            self.emit(
                "drained",
                window=window_id,
                owner=owner.name,
                num_microbatches=len(batches[owner.name]),
            )
        assert barrier.phase is Phase.DRAINED
        for worker in self.workers.values():
            if barrier.steps(worker.name):
                clip_and_step(worker.params, worker.optimizer, self.clip_grad_norm)
                report.stepped.append(worker.name)
            tokens_per_s = worker.padded_tokens / worker.compute_s if worker.compute_s > 0 else None
            barrier.commit(worker.name, barrier.worker_total(worker.name))
            self.emit(
                "commit",
                window=window_id,
                worker=worker.name,
                num_microbatches=barrier.worker_total(worker.name),
                tokens_per_s=tokens_per_s,
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
                self.emit("step", window=window_id, owner=owner.name)
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
        live: list[_Live] = []
        while live or any(pending.values()):
            dispatched = False
            for owner in self.owners:  # one forward per owner per turn: owners share workers fairly
                queue = pending[owner.name]
                index = next_dispatch(
                    [assignment[owner.name][mb] for mb in queue], ledgers[owner.name]
                )
                if index is None:
                    continue
                microbatch = queue.pop(index)
                worker = self.workers[assignment[owner.name][microbatch]]
                ledgers[owner.name].admit(microbatch, worker.name)
                batch = batches[owner.name][microbatch]
                scale = loss_scale(
                    self.objective,
                    group_microbatches=report.group_total,
                    num_targets=num_targets(owner.front.adapter, batch) if group_targets else 0,
                    group_targets=group_targets,
                )
                live.append(self._forward(window_id, owner, worker, microbatch, batch, scale))
                report.peak_live = max(report.peak_live, len(live))
                dispatched = True
            if not dispatched:
                item = live.pop(0 if self.backward_order == "fifo" else -1)
                report.losses[item.owner.name].append(self._backward(window_id, item))
                ledgers[item.owner.name].release(item.microbatch)
                del item  # the last reference to this microbatch's graphs

    def _forward(
        self,
        window_id: int,
        owner: OwnerNode,
        worker: WorkerNode,
        microbatch: int,
        batch: Batch,
        scale: float,
    ) -> _Live:
        where = f"window {window_id} microbatch {microbatch} of owner {owner.name!r}"
        pad_mask = batch[PAD_MASK]
        positions = positions_from_pad_mask(pad_mask)
        front_out = owner.front(batch[INPUT_IDS], pad_mask, positions)
        check_finite_tensor(front_out, f"front output sent by {owner.name!r}, {where}")
        body_in = front_out.detach().requires_grad_()
        start = self.clock()
        body_out = worker.body(body_in, pad_mask, positions)
        worker.compute_s += self.clock() - start
        check_finite_tensor(body_out, f"body output sent by {worker.name!r}, {where}")
        tail_in = body_out.detach().requires_grad_()
        logits = owner.tail(tail_in, pad_mask, positions)
        loss = owner.tail.adapter.loss(logits, owner.tail.adapter.labels(batch))
        loss_value = float(loss.detach())
        if not math.isfinite(loss_value):
            raise NonFiniteError(f"loss {loss_value} on owner {owner.name!r}, {where}")
        size = int(pad_mask.shape[0])
        owner.num_samples += size
        worker.num_samples += size
        worker.padded_tokens += int(pad_mask.numel())
        self.emit(
            "forward", window=window_id, microbatch=microbatch, owner=owner.name, worker=worker.name
        )
        return _Live(
            owner,
            worker,
            microbatch,
            front_out,
            body_in,
            body_out,
            tail_in,
            loss * scale,
            loss_value,
        )

    def _backward(self, window_id: int, item: _Live) -> float:
        where = f"window {window_id} microbatch {item.microbatch} of owner {item.owner.name!r}"
        item.scaled_loss.backward()
        assert item.tail_in.grad is not None
        check_finite_tensor(
            item.tail_in.grad, f"tail gradient sent by {item.owner.name!r}, {where}"
        )
        start = self.clock()
        item.body_out.backward(item.tail_in.grad)
        item.worker.compute_s += self.clock() - start
        assert item.body_in.grad is not None
        check_finite_tensor(
            item.body_in.grad, f"body gradient sent by {item.worker.name!r}, {where}"
        )
        item.front_out.backward(item.body_in.grad)
        self.emit(
            "backward",
            window=window_id,
            microbatch=item.microbatch,
            owner=item.owner.name,
            worker=item.worker.name,
        )
        return item.loss

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


def reset_round(nodes: Iterable[OwnerNode | WorkerNode]) -> None:
    """Zero the per-round sample counts (after FedAvg has read them)."""
    for node in nodes:
        node.num_samples = 0
