"""LoRA on parts: only adapters (and a classifier) train, the U-shape engine matches the unsplit
LoRA model, merged weights keep the original keys, and both FedAvg modes do what they say.

.venv/bin/pytest tests/equivalence/test_train_lora.py -q
"""

from __future__ import annotations

import pytest
import torch
from model_helpers import padded_batch, tiny_model, twin
from test_train_engine import WINDOW, adamw, assert_same_parameters, batches, train_unsplit
from torch import nn

from splitlab.config.schema import LoraConfig
from splitlab.errors import ConfigError
from splitlab.models.families import INPUT_IDS, PAD_MASK
from splitlab.models.parts import build_parts
from splitlab.models.plan import u_shape_plan
from splitlab.models.tokens import positions_from_pad_mask
from splitlab.reference.ushape import UShapeEngine
from splitlab.train.fedavg import Contribution, weighted_by_num_samples
from splitlab.train.lora import (
    apply_lora,
    fold_into_base,
    load_trainable_state,
    merged_state,
    trainable_state,
)
from splitlab.train.nodes import OwnerNode, WorkerNode, partition_parameters

FAMILIES = ["bert", "gpt2", "llama"]
PLAN = u_shape_plan(num_layers=4, cut_layers=1, tail_blocks=1)
LORA = LoraConfig(r=4, alpha=8.0)


def lora_model(family: str, seed: int = 0) -> tuple[nn.Module, tuple]:
    model = tiny_model(family, seed=seed)
    parts = build_parts(model, PLAN)
    apply_lora(parts, LORA)
    with torch.no_grad():  # B starts at zero; make the adapters matter from step one
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.05)
    return model, parts


def logits_of(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(
        input_ids=batch[INPUT_IDS],
        attention_mask=batch[PAD_MASK],
        position_ids=positions_from_pad_mask(batch[PAD_MASK]),
    ).logits


@pytest.mark.parametrize("family", FAMILIES)
def test_only_adapters_and_classifier_heads_train(family: str) -> None:
    model, _ = lora_model(family)

    trainable = [n for n, p in model.named_parameters() if p.requires_grad]

    allowed = ("lora_A", "lora_B") + (("bert.pooler", "classifier") if family == "bert" else ())
    assert trainable and all(any(a in n for a in allowed) for n in trainable)
    assert any("lora_A" in n for n in trainable)


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_engine_matches_unsplit_lora_model(family: str) -> None:
    split, parts = lora_model(family)
    ref = twin(split)  # the same injected adapters, same init
    data = batches(family)
    front, body, tail = parts
    owner = OwnerNode("o0", front, tail, adamw(partition_parameters(front, tail)))
    worker = WorkerNode("w0", body, adamw(partition_parameters(body)))

    train_unsplit(ref, family, data)
    UShapeEngine(owners=[owner], workers=[worker], max_inflight=2, credit=2).run_round(
        {"o0": data}, quota=WINDOW
    )

    assert_same_parameters(ref, split)


@pytest.mark.parametrize("family", FAMILIES)
def test_merged_state_has_original_keys_and_same_outputs(family: str) -> None:
    model, _ = lora_model(family)
    plain = tiny_model(family, seed=5)
    batch = padded_batch(family)

    merged = merged_state(model)
    plain.load_state_dict(merged)

    assert set(merged) == set(plain.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(logits_of(plain, batch), logits_of(model.eval(), batch))


def test_adapter_fedavg_averages_only_trainable_tensors() -> None:
    a, _ = lora_model("llama", seed=0)
    b, _ = lora_model("llama", seed=0)
    with torch.no_grad():
        for param in b.parameters():
            if param.requires_grad:
                param.add_(1.0)

    averaged = weighted_by_num_samples(
        [Contribution("a", trainable_state(a), 3), Contribution("b", trainable_state(b), 1)]
    )
    load_trainable_state(a, averaged)

    assert all("lora_" in key for key in averaged)
    for name, param in a.named_parameters():
        if param.requires_grad:
            torch.testing.assert_close(param, b.get_parameter(name) - 0.75)


def test_merged_fedavg_folds_dense_average_into_base() -> None:
    a, _ = lora_model("gpt2", seed=0)
    b, _ = lora_model("gpt2", seed=0)
    with torch.no_grad():
        for name, param in b.named_parameters():
            if "lora_B" in name:
                param.mul_(-2.0)
    dense = weighted_by_num_samples(
        [Contribution("a", merged_state(a), 1), Contribution("b", merged_state(b), 1)]
    )
    batch = padded_batch("gpt2")

    fold_into_base(a, dense)

    plain = tiny_model("gpt2", seed=9)
    plain.load_state_dict(dense)
    with torch.no_grad():
        torch.testing.assert_close(logits_of(a.eval(), batch), logits_of(plain, batch))
    assert all(not p.any() for n, p in a.named_parameters() if "lora_B" in n)


def test_unknown_targets_are_a_config_error() -> None:
    parts = build_parts(tiny_model("llama"), PLAN)

    with pytest.raises(ConfigError, match="finetune.lora.targets"):
        apply_lora(parts, LoraConfig(targets=["no_such_proj"]))
