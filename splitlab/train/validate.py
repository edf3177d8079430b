"""Validation at an owner before FedAvg: local mean loss, accuracy or perplexity.

`evaluate` takes a logits function, so the same metrics serve the in-process chain of parts
(`part_chain`) and the distributed owner, whose body forward goes over the wire (forward only,
no graphs kept). Metrics:
- `loss`: mean of per-batch mean losses (the training objective's default, unweighted);
- `accuracy`: classification only, correct predictions / sequences;
- `perplexity`: causal LMs only, exp of the token-weighted mean loss over every target token
  (the usual definition; it is not exp(`loss`) when batches differ in length).

    .venv/bin/pytest tests/unit/test_train_validate.py -q
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from splitlab.config.enums import TaskKind
from splitlab.models.families import INPUT_IDS, PAD_MASK, FamilyAdapter
from splitlab.models.parts import Part
from splitlab.models.tokens import positions_from_pad_mask
from splitlab.train.nodes import Batch
from splitlab.train.objective import num_targets


@dataclass(frozen=True)
class Metrics:
    loss: float  # mean of per-batch mean losses (nan without batches)
    num_samples: int  # sequences evaluated
    accuracy: float | None = None  # classification
    perplexity: float | None = None  # causal LM

    def to_dict(self) -> dict[str, float | int | None]:
        return {
            "val_loss": self.loss,
            "val_samples": self.num_samples,
            "val_accuracy": self.accuracy,
            "val_perplexity": self.perplexity,
        }


def part_chain(parts: Sequence[Part]) -> Callable[[Batch], torch.Tensor]:
    """Logits of the parts run in order, without gradients (the caller sets eval mode)."""

    def logits(batch: Batch) -> torch.Tensor:
        pad_mask = batch[PAD_MASK]
        positions = positions_from_pad_mask(pad_mask)
        x = batch[INPUT_IDS]
        with torch.no_grad():
            for part in parts:
                x = part(x, pad_mask, positions)
        return x

    return logits


def evaluate(
    logits_fn: Callable[[Batch], torch.Tensor], adapter: FamilyAdapter, batches: Iterable[Batch]
) -> Metrics:
    """Metrics of `logits_fn` over `batches` for the family's task."""
    losses: list[float] = []
    samples = correct = targets = 0
    token_loss_sum = 0.0
    for batch in batches:
        with torch.no_grad():
            logits = logits_fn(batch)
            labels = adapter.labels(batch)
            loss = float(adapter.loss(logits, labels))
        losses.append(loss)
        samples += int(batch[PAD_MASK].shape[0])
        if adapter.task is TaskKind.classification:
            correct += int((logits.argmax(dim=-1) == labels.reshape(-1)).sum())
        else:
            count = num_targets(adapter, batch)
            targets += count
            token_loss_sum += loss * count
    mean = sum(losses) / len(losses) if losses else math.nan
    if adapter.task is TaskKind.classification:
        return Metrics(mean, samples, accuracy=correct / samples if samples else None)
    perplexity = math.exp(token_loss_sum / targets) if targets else None
    return Metrics(mean, samples, perplexity=perplexity)
