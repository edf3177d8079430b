"""Loss scaling: mean of means vs token weighting, and target counts per family."""

from __future__ import annotations

import pytest
import torch
from model_helpers import adapter_of, padded_batch, tiny_model

from splitlab.config.enums import Objective
from splitlab.models.families import INPUT_IDS, PAD_MASK
from splitlab.train.objective import loss_scale, num_targets


def test_mean_of_means_scale_is_one_over_group_total() -> None:
    assert loss_scale(Objective.mean_of_means, group_microbatches=4) == 0.25
    with pytest.raises(ValueError):
        loss_scale(Objective.mean_of_means, group_microbatches=0)


def test_token_weighted_scale_is_target_share() -> None:
    scale = loss_scale("token_weighted", group_microbatches=2, num_targets=3, group_targets=12)

    assert scale == 0.25
    with pytest.raises(ValueError):
        loss_scale("token_weighted", group_microbatches=2, num_targets=13, group_targets=12)


def test_num_targets_causal_counts_shifted_real_tokens() -> None:
    batch = padded_batch("gpt2", lengths=(8, 5, 3))

    assert num_targets(adapter_of("gpt2"), batch) == 7 + 4 + 2


def test_num_targets_classification_counts_sequences() -> None:
    assert num_targets(adapter_of("bert"), padded_batch("bert", lengths=(4, 2))) == 2


def test_token_weighted_sum_equals_loss_of_the_combined_batch() -> None:
    adapter = adapter_of("gpt2")
    model = tiny_model("gpt2")
    batches = [
        padded_batch("gpt2", lengths=(8, 5, 3), seed=1),
        padded_batch("gpt2", lengths=(8, 2)),
    ]
    combined = {k: torch.cat([b[k] for b in batches]) for k in (INPUT_IDS, PAD_MASK)}
    targets = [num_targets(adapter, b) for b in batches]

    def loss_of(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = model(input_ids=batch[INPUT_IDS], attention_mask=batch[PAD_MASK]).logits
        return adapter.loss(logits, adapter.labels(batch))

    with torch.no_grad():
        weighted = sum(
            loss_of(b)
            * loss_scale(
                "token_weighted",
                group_microbatches=2,
                num_targets=n,
                group_targets=sum(targets),
            )
            for b, n in zip(batches, targets, strict=True)
        )
        mean_of_means = sum(loss_of(b) for b in batches) / 2

        torch.testing.assert_close(weighted, loss_of(combined))
        assert not torch.allclose(mean_of_means, loss_of(combined))
