"""Validation metrics: mean loss, accuracy for classification, perplexity for causal LMs."""

from __future__ import annotations

import math

import torch
from model_helpers import adapter_of, padded_batch, tiny_model

from splitlab.models.families import INPUT_IDS, PAD_MASK
from splitlab.models.parts import build_parts
from splitlab.models.plan import u_shape_plan
from splitlab.train.validate import evaluate, part_chain

PLAN = u_shape_plan(num_layers=4, cut_layers=1, tail_blocks=1)


def unsplit_logits(model: torch.nn.Module):  # noqa: ANN201 - a test-local closure
    return lambda batch: model(input_ids=batch[INPUT_IDS], attention_mask=batch[PAD_MASK]).logits


def test_classification_accuracy_and_mean_loss() -> None:
    model = tiny_model("bert")
    adapter = adapter_of("bert")
    batches = [padded_batch("bert", lengths=(5, 3, 4), seed=s) for s in range(3)]

    metrics = evaluate(part_chain(build_parts(model, PLAN)), adapter, batches)

    with torch.no_grad():
        logits = [unsplit_logits(model)(b) for b in batches]
        losses = [float(adapter.loss(x, b["labels"])) for x, b in zip(logits, batches, strict=True)]
        correct = sum(
            int((x.argmax(-1) == b["labels"]).sum()) for x, b in zip(logits, batches, strict=True)
        )
    assert metrics.num_samples == 9
    assert metrics.accuracy == correct / 9
    assert metrics.perplexity is None
    assert math.isclose(metrics.loss, sum(losses) / 3, rel_tol=1e-5)


def test_perplexity_is_exp_of_the_token_weighted_loss() -> None:
    model = tiny_model("llama")
    adapter = adapter_of("llama")
    batches = [
        padded_batch("llama", lengths=(8, 2)),
        padded_batch("llama", lengths=(8, 7, 8), seed=3),
    ]
    combined = {k: torch.cat([b[k] for b in batches]) for k in (INPUT_IDS, PAD_MASK)}

    metrics = evaluate(part_chain(build_parts(model, PLAN)), adapter, batches)

    with torch.no_grad():
        total = float(adapter.loss(unsplit_logits(model)(combined), adapter.labels(combined)))
    assert metrics.accuracy is None
    assert math.isclose(metrics.perplexity, math.exp(total), rel_tol=1e-5)
    assert not math.isclose(metrics.perplexity, math.exp(metrics.loss), rel_tol=1e-3)


def test_no_batches_gives_nan_loss_and_no_metric() -> None:
    metrics = evaluate(lambda b: b, adapter_of("gpt2"), [])

    assert math.isnan(metrics.loss) and metrics.perplexity is None and metrics.num_samples == 0
