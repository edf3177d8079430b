"""Federated rounds with every node in one process: train, validate, FedAvg, save, resume.

The round loop the coordinator runs across processes, with direct calls for messages:

    for each round (from 0, or one past the last completed checkpoint when resuming):
        fresh optimizers (AdamW moments of a local trajectory do not describe the averaged
        model), WRR back to the configured weights
        windows until every owner has run its microbatches        (`UShapeEngine.run_round`)
        owners validate locally, before FedAvg                     (`evaluate`)
        FedAvg owner and body partitions by processed samples, redistribute to every node
        (also when saving is off), save the merged model + RNG state atomically if asked

A restart with `resume=True` loads the last completed round's weights into every node and
restores the RNG, so rounds after it are the ones an uninterrupted run would have produced.

    .venv/bin/pytest tests/unit/test_reference_rounds.py -q
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from splitlab.models.parts import group
from splitlab.reference.ushape import UShapeEngine
from splitlab.train.checkpoint import (
    capture_rng,
    latest_checkpoint,
    remove_stale_temps,
    restore_rng,
    save_checkpoint,
)
from splitlab.train.exchange import FULL, Exchange
from splitlab.train.fedavg import merge_partitions
from splitlab.train.nodes import Batch
from splitlab.train.rounds import NodeUpdate, aggregate
from splitlab.train.validate import Metrics, evaluate, part_chain

MakeOptimizer = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
RoundData = Callable[[int], Mapping[str, Sequence[Batch]]]  # round -> owner -> microbatches


@dataclass(frozen=True)
class RoundSummary:
    round_id: int
    num_windows: int
    weights: dict[str, int]  # node -> processed samples (its FedAvg weight)
    validation: dict[str, Metrics]  # owner -> local metrics before FedAvg
    checkpoint: Path | None


class LocalRounds:
    """Drives rounds over an engine's nodes.

    Args:
        engine: owners and workers (each with its own replica).
        make_optimizer: a fresh optimizer for a partition's parameters, called every round.
        checkpoint_dir: where round checkpoints go (and where `resume` reads them).
        save_checkpoint: False still averages and redistributes, just writes nothing.
        validation: owner -> held-out microbatches; owners without any skip validation.
        exchange: what FedAvg averages (`splitlab.train.exchange`: FULL, ADAPTERS, MERGED).
    """

    def __init__(
        self,
        *,
        engine: UShapeEngine,
        make_optimizer: MakeOptimizer,
        checkpoint_dir: Path | None = None,
        save_checkpoint: bool = True,
        validation: Mapping[str, Sequence[Batch]] | None = None,
        exchange: Exchange = FULL,
    ) -> None:
        self.engine = engine
        self.make_optimizer = make_optimizer
        self.checkpoint_dir = checkpoint_dir
        self.save_checkpoint = save_checkpoint and checkpoint_dir is not None
        self.validation = dict(validation or {})
        self.exchange = exchange

    @property
    def modules(self) -> list[nn.Module]:
        """Every node's partition modules (what redistribution loads into)."""
        owners = [m for o in self.engine.owners for m in (o.front, o.tail)]
        return owners + [w.body for w in self.engine.workers.values()]

    def resume(self) -> int:
        """Load the last completed round; returns the round to run next (0 if none)."""
        if self.checkpoint_dir is None:
            return 0
        shapes = {key: tensor.shape for key, tensor in self._dense().items()}
        checkpoint = latest_checkpoint(self.checkpoint_dir, expected=shapes)
        if checkpoint is None:
            return 0
        for module in self.modules:
            self.exchange.restore(module, checkpoint.state)
        restore_rng(checkpoint.rng)
        return checkpoint.round_id + 1

    def _dense(self) -> dict[str, torch.Tensor]:
        """The checkpoint view: one owner's and one worker's partitions under original keys."""
        engine, ex = self.engine, self.exchange
        owner, worker = engine.owners[0], next(iter(engine.workers.values()))
        return merge_partitions(ex.dense(group([owner.front, owner.tail])), ex.dense(worker.body))

    def run(
        self, *, rounds: int, data: RoundData, quota: int, resume: bool = False
    ) -> list[RoundSummary]:
        """Run rounds `[start, rounds)`; `start` is 0, or one past the last checkpoint."""
        if self.checkpoint_dir is not None:
            remove_stale_temps(self.checkpoint_dir)
        start = self.resume() if resume else 0
        return [self._round(round_id, data(round_id), quota) for round_id in range(start, rounds)]

    def _round(
        self, round_id: int, batches: Mapping[str, Sequence[Batch]], quota: int
    ) -> RoundSummary:
        engine = self.engine
        for node in [*engine.owners, *engine.workers.values()]:
            node.optimizer = self.make_optimizer(node.params)
            node.num_samples = 0
        for owner in engine.owners:
            engine.weights[owner.name].reset()
            engine.reset_wrr(owner.name)
        reports = engine.run_round(batches, quota=quota)
        validation = {
            owner.name: self._validate(owner.name)
            for owner in engine.owners
            if self.validation.get(owner.name)
        }
        ex = self.exchange
        owner_parts = {o.name: group([o.front, o.tail]) for o in engine.owners}
        updates = [
            NodeUpdate(o.name, "owner", ex.export(owner_parts[o.name]), o.num_samples)
            for o in engine.owners
        ]
        updates += [
            NodeUpdate(w.name, "body", ex.export(w.body), w.num_samples)
            for w in engine.workers.values()
        ]
        averaged = aggregate(updates)
        for module in [*owner_parts.values(), *(w.body for w in engine.workers.values())]:
            ex.load(module, averaged)  # also when saving is off: the next round starts global
        path = None
        if self.save_checkpoint:
            assert self.checkpoint_dir is not None
            path = save_checkpoint(
                self.checkpoint_dir, round_id=round_id, state=self._dense(), rng=capture_rng()
            )
        weights = {u.node: u.num_samples for u in updates}
        return RoundSummary(round_id, len(reports), weights, validation, path)

    def _validate(self, owner_name: str) -> Metrics:
        """The owner's chain through the worker it weighs most (bodies differ before FedAvg)."""
        owner = next(o for o in self.engine.owners if o.name == owner_name)
        weights = self.engine.weights[owner_name].weights()
        worker = self.engine.workers[max(weights, key=lambda name: weights[name])]
        parts = [owner.front, worker.body, owner.tail]
        modes = [part.training for part in parts]
        for part in parts:
            part.eval()
        try:
            return evaluate(part_chain(parts), owner.tail.adapter, self.validation[owner_name])
        finally:
            for part, mode in zip(parts, modes, strict=True):
                part.train(mode)
