"""Split vs unsplit: front -> body -> tail reproduces loss, logits and every gradient in fp32.

.venv/bin/pytest tests/equivalence/test_partition_equivalence.py
"""

from __future__ import annotations

import pytest
import torch
from model_helpers import (
    adapter_of,
    grads_of,
    padded_batch,
    run_split,
    run_unsplit,
    tiny_model,
    twin,
)

from splitlab.models.parts import build_parts, group
from splitlab.models.plan import two_stage_plan, u_shape_plan

FAMILIES = ["bert", "gpt2", "llama", "qwen2"]
# (cut_layers, tail_blocks) on 4 blocks: the extremes the issue names.
U_SHAPES = {
    "cut1-tail0": (1, 0),  # smallest front, no tail blocks (head only on the tail)
    "single-body-block": (2, 1),  # one remote block
    "cut1-tail2": (1, 2),  # tail with blocks, single body block
    "cut0-tail1": (0, 1),  # front = embeddings only
    "cut3-tail0": (3, 0),  # single body block, last block remote
}


def assert_same_run(
    ref: tuple[torch.Tensor, torch.Tensor],
    split: tuple[torch.Tensor, torch.Tensor],
    ref_model: torch.nn.Module,
    split_model: torch.nn.Module,
) -> None:
    torch.testing.assert_close(split[0], ref[0])
    torch.testing.assert_close(split[1], ref[1])
    ref_grads, split_grads = grads_of(ref_model), grads_of(split_model)
    assert ref_grads.keys() == split_grads.keys()
    for name, ref_grad in ref_grads.items():
        assert ref_grad is not None, f"{name} got no gradient in the unsplit run"
        torch.testing.assert_close(split_grads[name], ref_grad, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("shape", list(U_SHAPES), ids=list(U_SHAPES))
@pytest.mark.parametrize("family", FAMILIES)
def test_u_shape_matches_unsplit(family: str, shape: str) -> None:
    cut_layers, tail_blocks = U_SHAPES[shape]
    model = tiny_model(family)
    split_model = twin(model)
    adapter = adapter_of(family)
    batch = padded_batch(family)
    plan = u_shape_plan(num_layers=4, cut_layers=cut_layers, tail_blocks=tail_blocks)

    ref = run_unsplit(model, adapter, batch)
    split = run_split(build_parts(split_model, plan), batch)

    assert_same_run(ref, split, model, split_model)


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen2"])
def test_left_padded_causal_lm_matches_unsplit(family: str) -> None:
    model = tiny_model(family)
    split_model = twin(model)
    batch = padded_batch(family, left=True)
    plan = u_shape_plan(num_layers=4, cut_layers=1, tail_blocks=1)

    ref = run_unsplit(model, adapter_of(family), batch)
    split = run_split(build_parts(split_model, plan), batch)

    assert_same_run(ref, split, model, split_model)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_tied_llama_shares_one_tensor_and_matches_unsplit(family: str) -> None:
    model = tiny_model(family, tied=True)
    split_model = twin(model)
    batch = padded_batch(family)
    plan = u_shape_plan(num_layers=4, cut_layers=1, tail_blocks=0)

    ref = run_unsplit(model, adapter_of(family), batch)
    front, body, tail = build_parts(split_model, plan)
    split = run_split((front, body, tail), batch)

    assert tail.module("lm_head").weight is front.module("model.embed_tokens").weight
    assert_same_run(ref, split, model, split_model)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("family", FAMILIES)
def test_each_attention_implementation_matches_unsplit(family: str, attn: str) -> None:
    model = tiny_model(family, attn=attn)
    split_model = twin(model)
    batch = padded_batch(family)
    plan = u_shape_plan(num_layers=4, cut_layers=1, tail_blocks=1)

    ref = run_unsplit(model, adapter_of(family), batch)
    split = run_split(build_parts(split_model, plan), batch)

    assert_same_run(ref, split, model, split_model)


@pytest.mark.parametrize("family", FAMILIES)
def test_two_stage_matches_unsplit(family: str) -> None:
    model = tiny_model(family)
    split_model = twin(model)
    batch = padded_batch(family)

    ref = run_unsplit(model, adapter_of(family), batch)
    split = run_split(build_parts(split_model, two_stage_plan(num_layers=4, cut_layers=2)), batch)

    assert_same_run(ref, split, model, split_model)


@pytest.mark.parametrize("family", ["bert", "gpt2", "llama"])
def test_dropout_under_the_same_seed_matches_unsplit(family: str) -> None:
    # Parts call the same dropout modules in the same order, so one seed gives one mask set.
    model = tiny_model(family, dropout=0.1).train()
    split_model = twin(model).train()
    batch = padded_batch(family)
    plan = u_shape_plan(num_layers=4, cut_layers=1, tail_blocks=1)

    torch.manual_seed(7)
    ref = run_unsplit(model, adapter_of(family), batch)
    torch.manual_seed(7)
    split = run_split(build_parts(split_model, plan), batch)

    assert_same_run(ref, split, model, split_model)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_owner_group_keeps_original_keys_and_one_tied_tensor(family: str) -> None:
    model = tiny_model(family, tied=True)
    front, body, tail = build_parts(model, u_shape_plan(num_layers=4, cut_layers=1, tail_blocks=1))

    owner = group((front, tail))
    keys = set(owner.state_dict()) | set(body.state_dict())

    assert keys == set(model.state_dict())
    assert not set(owner.state_dict()) & set(body.state_dict())
    owner_params = list(owner.parameters())
    assert len(owner_params) == len({id(p) for p in owner_params})
    assert sum(p.numel() for p in owner_params) + sum(p.numel() for p in body.parameters()) == sum(
        p.numel() for p in model.parameters()
    )


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["bert", "gpt2", "llama"])
def test_u_shape_matches_unsplit_on_cuda(family: str) -> None:
    model = tiny_model(family).to("cuda")
    split_model = twin(model)
    batch = {k: v.to("cuda") for k, v in padded_batch(family).items()}
    plan = u_shape_plan(num_layers=4, cut_layers=1, tail_blocks=1)

    ref = run_unsplit(model, adapter_of(family), batch)
    split = run_split(build_parts(split_model, plan), batch)

    assert_same_run(ref, split, model, split_model)
