"""Federated averaging as a pure function over (node, state, num_samples) contributions.

Owner partitions (embeddings, front, tail, head) and body partitions are averaged separately:
call `weighted_by_num_samples` once per partition with that partition's contributions, then
`merge_partitions` to get the full model's state under its original key names.

Rules:
- the weight of a contribution is the number of samples the node processed this round;
- a node with zero samples is skipped (its state carries no information this round);
- a NaN or Inf anywhere aborts with `NonFiniteError` naming the node and the key; it never
  turns into zeros or is quietly dropped;
- floating tensors are averaged in float64 and returned in their own dtype; integer tensors
  (buffers such as position ids) must be equal on every node and pass through.

    .venv/bin/pytest tests/unit/test_train_fedavg.py -q
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from splitlab.errors import NonFiniteError, ProtocolError


@dataclass(frozen=True)
class Contribution:
    """One node's partition state at round end and the samples it processed."""

    node: str
    state: Mapping[str, torch.Tensor]
    num_samples: int


def check_finite(node: str, state: Mapping[str, torch.Tensor]) -> None:
    """Raises: NonFiniteError naming `node` and the first key with a NaN or Inf."""
    for key, tensor in state.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise NonFiniteError(f"non-finite values in the update from {node!r}, key {key!r}")


def weighted_by_num_samples(contributions: Sequence[Contribution]) -> dict[str, torch.Tensor]:
    """The sample-weighted mean of the contributing states (Flower's FedAvg).

    Raises:
        ValueError: no node processed any samples, or a count is negative.
        NonFiniteError: a contributing state holds NaN/Inf (names node and key).
        ProtocolError: contributions disagree on keys, shapes, dtypes or integer buffers.
    """
    for c in contributions:
        if c.num_samples < 0:
            raise ValueError(f"{c.node!r} reports num_samples={c.num_samples}")
    active = [c for c in contributions if c.num_samples > 0]
    if not active:
        nodes = [c.node for c in contributions]
        raise ValueError(f"no samples processed by any of {nodes}: nothing to average")
    for c in active:
        check_finite(c.node, c.state)
    reference = active[0]
    keys = set(reference.state)
    for c in active[1:]:
        if set(c.state) != keys:
            missing, extra = sorted(keys - set(c.state)), sorted(set(c.state) - keys)
            raise ProtocolError(
                f"update from {c.node!r} differs from {reference.node!r}: "
                f"missing {missing}, unexpected {extra}"
            )
    total = float(sum(c.num_samples for c in active))
    out: dict[str, torch.Tensor] = {}
    for key, first in reference.state.items():
        for c in active[1:]:
            other = c.state[key]
            if other.shape != first.shape or other.dtype != first.dtype:
                raise ProtocolError(
                    f"key {key!r}: {c.node!r} sends {other.dtype}{tuple(other.shape)}, "
                    f"{reference.node!r} sends {first.dtype}{tuple(first.shape)}"
                )
        if not first.is_floating_point():
            for c in active[1:]:
                if not torch.equal(c.state[key], first):
                    raise ProtocolError(f"key {key!r}: integer buffer differs on {c.node!r}")
            out[key] = first.detach().clone()
            continue
        acc = torch.zeros(first.shape, dtype=torch.float64, device=first.device)
        for c in active:
            acc.add_(c.state[key].detach().to(torch.float64), alpha=c.num_samples / total)
        out[key] = acc.to(first.dtype)
    return out


def merge_partitions(*states: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One state from disjoint partition states (owner + body).

    A key in two partitions must hold the same values (a tied tensor that both keep).

    Raises:
        ProtocolError: a shared key whose values differ.
    """
    merged: dict[str, torch.Tensor] = {}
    for state in states:
        for key, tensor in state.items():
            if key in merged and not torch.equal(merged[key], tensor):
                raise ProtocolError(f"key {key!r} is in two partitions with different values")
            merged[key] = tensor
    return merged
