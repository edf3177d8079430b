"""Round end: FedAvg of owner and body partitions, redistribution, and the round checkpoint.

This is the coordinator's arithmetic with the messaging taken out: it takes the nodes' partition
states and processed-sample counts (what their UPDATE messages carry), averages owner
partitions and body partitions separately, loads the result back into every node (also when
saving is off, so the next round starts from the global model) and optionally writes the
merged model under its original key names.

    .venv/bin/pytest tests/unit/test_train_rounds.py -q
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from splitlab.errors import ProtocolError
from splitlab.train.checkpoint import capture_rng, save_checkpoint
from splitlab.train.fedavg import Contribution, merge_partitions, weighted_by_num_samples


@dataclass(frozen=True)
class NodeUpdate:
    """What one node hands in at round end: its partition state and the samples behind it."""

    node: str
    partition: str  # "owner" or "body"
    state: Mapping[str, torch.Tensor]
    num_samples: int


@dataclass(frozen=True)
class RoundResult:
    round_id: int
    state: dict[str, torch.Tensor]  # the merged model, original key names
    weights: dict[str, int]  # node -> samples its update was weighted by (0 = skipped)
    checkpoint: Path | None


def aggregate(updates: Sequence[NodeUpdate]) -> dict[str, torch.Tensor]:
    """FedAvg per partition, then one merged state.

    Raises:
        ProtocolError: an unknown partition name.
        NonFiniteError / ValueError: from `weighted_by_num_samples`.
    """
    by_partition: dict[str, list[Contribution]] = {}
    for update in updates:
        if update.partition not in ("owner", "body"):
            raise ProtocolError(
                f"update from {update.node!r}: unknown partition {update.partition!r}"
            )
        by_partition.setdefault(update.partition, []).append(
            Contribution(update.node, update.state, update.num_samples)
        )
    return merge_partitions(*(weighted_by_num_samples(c) for c in by_partition.values()))


def copy_exact(pairs: Sequence[tuple[str, torch.Tensor, torch.Tensor]], what: str) -> None:
    """Copy each `(key, target, source)` in place once every shape is known to match exactly
    (`copy_` would broadcast a `[1]` into a `[384, 384]`); nothing is copied when one differs.

    Raises:
        ProtocolError: naming `what`, the key and both shapes.
    """
    for key, target, source in pairs:
        if target.shape != source.shape:
            raise ProtocolError(
                f"{what}: {key!r} has shape {list(source.shape)}, this node's is "
                f"{list(target.shape)}"
            )
    with torch.no_grad():
        for _, target, source in pairs:
            target.copy_(source)


def redistribute(merged: Mapping[str, torch.Tensor], modules: Sequence[nn.Module]) -> None:
    """Load each module's own keys from `merged` in place (strict: every key must be there,
    with exactly its shape).

    Raises:
        ProtocolError: `merged` lacks a key some module holds, or holds it with another shape.
    """
    for module in modules:
        own = module.state_dict()
        missing = sorted(set(own) - set(merged))
        if missing:
            raise ProtocolError(f"the merged model lacks keys {missing[:5]} (of {len(missing)})")
        copy_exact([(key, t, merged[key]) for key, t in own.items()], "the merged model")


def finish_round(
    *,
    round_id: int,
    updates: Sequence[NodeUpdate],
    modules: Sequence[nn.Module],
    checkpoint_dir: Path | None = None,
) -> RoundResult:
    """Average, redistribute into `modules` (every node's partition), then save if asked."""
    merged = aggregate(updates)
    redistribute(merged, modules)
    path = None
    if checkpoint_dir is not None:
        path = save_checkpoint(checkpoint_dir, round_id=round_id, state=merged, rng=capture_rng())
    weights = {u.node: u.num_samples for u in updates}
    return RoundResult(round_id=round_id, state=merged, weights=weights, checkpoint=path)
