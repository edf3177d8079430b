"""Low-rank cuts (SFT) in training: the split decomposed model == the unsplit decomposed model.

U-shape engine (one owner, one worker) with the cut at front, tail or both, residual keep or
drop, full fine-tuning or LoRA, against the same decomposed model's parts chained without any
detach and trained with AdamW on the same windows (fp32). Two-stage with a front cut against
the two-optimizer reference (last stage steps per microbatch, first per window).

.venv/bin/pytest tests/equivalence/test_train_sft.py -q
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from model_helpers import tiny_model, twin
from test_train_engine import WINDOW, adamw, assert_same_parameters, batches
from test_train_two_stage import data as two_stage_data
from test_train_two_stage import untied
from torch import nn

from splitlab.config.enums import ResidualMode, SftCut
from splitlab.config.schema import LoraConfig, SftConfig
from splitlab.models.families import INPUT_IDS, PAD_MASK
from splitlab.models.parts import CODE, RESIDUAL, Part
from splitlab.models.plan import two_stage_plan, u_shape_plan
from splitlab.models.tokens import positions_from_pad_mask
from splitlab.reference.two_stage import TwoStageEngine, reversed_order
from splitlab.reference.ushape import UShapeEngine
from splitlab.train.nodes import OwnerNode, WorkerNode, partition_parameters
from splitlab.train.parts import build_training_parts

FAMILIES = ["bert", "gpt2", "llama"]
RANK = 4  # tiny models: H = 32
U_PLAN = u_shape_plan(num_layers=4, cut_layers=1, tail_blocks=1)


def chain_loss(parts: Sequence[Part], batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The parts run in sequence without any detach: the unsplit decomposed model's loss."""
    pad_mask = batch[PAD_MASK]
    positions = positions_from_pad_mask(pad_mask)
    x: object = batch[INPUT_IDS]
    for part in parts:
        x = part(x, pad_mask, positions)
    adapter = parts[-1].adapter
    return adapter.loss(x, adapter.labels(batch))


def train_chained(
    parts: Sequence[Part], data: Sequence[dict[str, torch.Tensor]], window: int = WINDOW
) -> None:
    """One AdamW over every trainable tensor, mean loss per window, one step per window."""
    optimizer = adamw(partition_parameters(*parts))
    for start in range(0, len(data), window):
        chunk = data[start : start + window]
        for batch in chunk:
            (chain_loss(parts, batch) / len(chunk)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def sft(cuts: str, residual: str) -> SftConfig:
    return SftConfig(enabled=True, rank=RANK, residual=ResidualMode(residual), cuts=SftCut(cuts))


def lora_config() -> LoraConfig:
    return LoraConfig(r=4, alpha=8, dropout=0.0)


def u_shape_pair(
    family: str, cfg: SftConfig, lora: LoraConfig | None
) -> tuple[nn.Module, tuple[Part, ...], nn.Module, tuple[Part, ...]]:
    """(reference model, its parts, split model, its parts): same weights, same adapter init."""
    base = tiny_model(family)
    ref, split = twin(base), twin(base)
    torch.manual_seed(7)
    ref_parts = build_training_parts(ref, U_PLAN, sft=cfg, lora=lora)
    torch.manual_seed(7)
    split_parts = build_training_parts(split, U_PLAN, sft=cfg, lora=lora)
    return ref, ref_parts, split, split_parts


def run_engine(parts: tuple[Part, ...], data: list) -> None:
    front, body, tail = parts
    owner = OwnerNode("o0", front, tail, adamw(partition_parameters(front, tail)))
    worker = WorkerNode("w0", body, adamw(partition_parameters(body)))
    engine = UShapeEngine(owners=[owner], workers=[worker], max_inflight=2, credit=2)
    engine.run_round({"o0": data}, quota=WINDOW)


@pytest.mark.parametrize("residual", ["keep", "drop"])
@pytest.mark.parametrize("cuts", ["front", "tail", "both"])
@pytest.mark.parametrize("family", FAMILIES)
def test_u_shape_full_matches_unsplit_decomposed(family: str, cuts: str, residual: str) -> None:
    ref, ref_parts, split, split_parts = u_shape_pair(family, sft(cuts, residual), None)
    data = batches(family)

    train_chained(ref_parts, data)
    run_engine(split_parts, data)

    assert_same_parameters(ref, split)


@pytest.mark.parametrize("family", FAMILIES)
def test_u_shape_lora_matches_and_trains_the_lowrank_factors(family: str) -> None:
    ref, ref_parts, split, split_parts = u_shape_pair(family, sft("both", "keep"), lora_config())
    before = {n: p.detach().clone() for n, p in split.named_parameters() if "lowrank_" in n}
    data = batches(family)

    train_chained(ref_parts, data)
    run_engine(split_parts, data)

    assert_same_parameters(ref, split)
    after = dict(split.named_parameters())
    assert len(before) >= 4  # in and out at two cuts
    assert all(after[n].requires_grad and not torch.equal(after[n], b) for n, b in before.items())


def test_crossing_names_follow_the_cut() -> None:
    _, _, _, (front, body, tail) = u_shape_pair("gpt2", sft("tail", "keep"), None)
    owner = OwnerNode("o0", front, tail, adamw(partition_parameters(front, tail)))
    worker = WorkerNode("w0", body, adamw(partition_parameters(body)))
    batch = batches("gpt2", n=1)[0]

    sent = owner.front_forward(0, batch)
    returned = worker.body_forward(("o0", 0), sent, batch[PAD_MASK])
    grads, _ = owner.tail_step(0, returned, batch, 1.0)
    back = worker.body_backward(("o0", 0), grads)

    assert list(sent) == ["hidden_BTH"] and sent["hidden_BTH"].shape[-1] == 32
    assert sorted(returned) == [CODE, RESIDUAL] and returned[CODE].shape[-1] == RANK
    assert sorted(grads) == ["grad_code_BTR", "grad_residual_BTH"]
    assert list(back) == ["grad_BTH"]


def train_two_stage_reference(parts: Sequence[Part], data: list, control_count: int) -> None:
    first, last = parts
    first_params, last_params = partition_parameters(first), partition_parameters(last)
    first_opt, last_opt = adamw(first_params), adamw(last_params)
    for start in range(0, len(data), control_count):
        chunk = data[start : start + control_count]
        for batch in chunk:
            chain_loss(parts, batch).backward()
            last_opt.step()
            last_opt.zero_grad(set_to_none=True)
        for param in first_params:
            if param.grad is not None:
                param.grad.div_(len(chunk))
        first_opt.step()
        first_opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("residual", ["keep", "drop"])
@pytest.mark.parametrize("family", FAMILIES)
def test_two_stage_front_cut_matches_reference(family: str, residual: str) -> None:
    base = untied(family)
    ref, split = twin(base), twin(base)
    plan = two_stage_plan(num_layers=4, cut_layers=2)
    ref_parts = build_training_parts(ref, plan, sft=sft("front", residual))
    first, last = build_training_parts(split, plan, sft=sft("front", residual))
    data = two_stage_data(family)

    train_two_stage_reference(ref_parts, data, control_count=2)
    TwoStageEngine(
        first=first, last=last, control_count=2, return_order=reversed_order,
        first_optimizer=adamw(partition_parameters(first)),
        last_optimizer=adamw(partition_parameters(last)),
    ).run(data)  # fmt: skip

    assert first.span.code_out is not None
    assert_same_parameters(ref, split)
