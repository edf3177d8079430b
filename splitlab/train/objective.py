"""How per-microbatch losses combine into the window objective, as one scale per microbatch.

Each owner computes the mean loss of one microbatch (mean over its target tokens, or over its
sequences for classification) and multiplies it once by `loss_scale(...)` before backward.
Gradients then accumulate across the window on every partition, and nothing is rescaled later.

- `mean_of_means` (the default, and the prior system's): scale = 1 / group_total, where
  group_total is the number of microbatches all owners run in this window. The window
  objective is the plain mean of per-microbatch mean losses, so a microbatch of 3 short
  sequences weighs as much as one of 16 long ones.
- `token_weighted`: scale = num_targets / group_targets, so every target token of the group
  weighs the same; the objective equals the loss of one big batch made of the whole window.
  Across processes each owner puts its window's target count in its PLAN (`num_targets`; it
  knows it before the window), each worker sums the PLANs into its OPEN (`group_targets`), so
  every owner scales by the same group-wide denominator before any loss is computed.

The two agree when every microbatch has the same number of targets (e.g. classification with
equal batch sizes, or fixed-length LM batches without padding).

    .venv/bin/pytest tests/unit/test_train_objective.py -q
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from splitlab.config.enums import Objective, TaskKind
from splitlab.models.families import FamilyAdapter
from splitlab.models.tokens import IGNORE_INDEX


def num_targets(adapter: FamilyAdapter, batch: Mapping[str, torch.Tensor]) -> int:
    """How many terms the family's mean loss averages over for `batch`.

    Causal LMs predict token t + 1 at position t, so the first label of every row is never a
    target and padded labels are ignored; classification has one target per sequence.
    """
    labels = adapter.labels(batch)
    if adapter.task is TaskKind.causal_lm:
        return int((labels[:, 1:] != IGNORE_INDEX).sum())
    return int(labels.numel())


def loss_scale(
    objective: Objective | str,
    *,
    group_microbatches: int,
    num_targets: int = 0,
    group_targets: int = 0,
) -> float:
    """The factor one microbatch's mean loss is multiplied by before its backward.

    Args:
        objective: `mean_of_means` or `token_weighted`.
        group_microbatches: microbatches of every owner in this window (the OPEN's total).
        num_targets: this microbatch's targets (token_weighted only).
        group_targets: targets of every microbatch in the window (token_weighted only).

    Raises:
        ValueError: a count that makes the scale undefined.
    """
    objective = Objective(objective)
    if objective is Objective.mean_of_means:
        if group_microbatches < 1:
            raise ValueError(f"group_microbatches={group_microbatches}: no microbatch to average")
        return 1.0 / group_microbatches
    if group_targets < 1 or not 0 <= num_targets <= group_targets:
        raise ValueError(f"num_targets={num_targets} of group_targets={group_targets}")
    return num_targets / group_targets
