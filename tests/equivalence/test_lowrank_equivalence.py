"""Low-rank cut (SFT): full-rank SVD equals the original; split at the code equals unsplit.

- decomposed at R = min(F, H) == the original model: loss, logits, every gradient (fp32);
- merge_lowrank / merged_state_dict give back the original modules and keys;
- front/body/tail with the low-rank cut at front, tail or both (residual keep and drop)
  == the unsplit decomposed model run in one piece (loss, logits, gradients);
- what crosses: code_BTR of shape B x T x R (+ residual_BTH with keep).

.venv/bin/pytest tests/equivalence/test_lowrank_equivalence.py -q
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pytest
import torch
from model_helpers import (
    adapter_of,
    grads_of,
    padded_batch,
    run_unsplit,
    tiny_model,
    twin,
)
from peft import LoraConfig, inject_adapter_in_model

from splitlab.config.enums import ResidualMode, SftFactors
from splitlab.models.families import INPUT_IDS, PAD_MASK
from splitlab.models.lowrank import (
    LowRankLinear,
    decompose,
    decompose_plan,
    merge_lowrank,
    merged_state_dict,
)
from splitlab.models.parts import CODE, RESIDUAL, Part, build_parts, group
from splitlab.models.plan import PartitionPlan, two_stage_plan, u_shape_plan, with_lowrank_cuts
from splitlab.models.tokens import positions_from_pad_mask

FAMILIES = ["bert", "gpt2", "llama", "qwen2"]
HIDDEN, FFN = 32, 64  # tiny_model dimensions; llama stacks gate and up: 2 x FFN outputs
FULL_RANK = HIDDEN  # min(F, H) for every family here


def detach_crossing(
    out: torch.Tensor | Mapping[str, torch.Tensor],
) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor | dict[str, torch.Tensor]]:
    """(sent tensors, receiver leaves, what the receiver gets) for a tensor or a named mapping."""
    if isinstance(out, Mapping):
        leaves = {name: t.detach().requires_grad_() for name, t in out.items()}
        return list(out.values()), list(leaves.values()), leaves
    leaf = out.detach().requires_grad_()
    return [out], [leaf], leaf


def run_split_named(
    parts: Sequence[Part], batch: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Parts in sequence, every crossing detached, backward handed across by hand."""
    adapter = parts[0].adapter
    pad_mask = batch[PAD_MASK]
    positions = positions_from_pad_mask(pad_mask)
    x: object = batch[INPUT_IDS]
    crossings = []
    for part in parts[:-1]:
        sent, leaves, x = detach_crossing(part(x, pad_mask, positions))
        crossings.append((sent, leaves))
    logits = parts[-1](x, pad_mask, positions)
    loss = adapter.loss(logits, adapter.labels(batch))
    loss.backward()
    for sent, leaves in reversed(crossings):
        torch.autograd.backward(sent, [leaf.grad for leaf in leaves])
    return loss.detach(), logits.detach()


def run_whole(
    parts: Sequence[Part], batch: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same parts chained without any detach: the unsplit decomposed model."""
    adapter = parts[0].adapter
    pad_mask = batch[PAD_MASK]
    positions = positions_from_pad_mask(pad_mask)
    x: object = batch[INPUT_IDS]
    for part in parts:
        x = part(x, pad_mask, positions)
    loss = adapter.loss(x, adapter.labels(batch))
    loss.backward()
    return loss.detach(), x.detach()


def assert_same(ref, got, ref_model: torch.nn.Module, got_model: torch.nn.Module) -> None:
    torch.testing.assert_close(got[0], ref[0])
    torch.testing.assert_close(got[1], ref[1])
    ref_grads, got_grads = grads_of(ref_model), grads_of(got_model)
    assert ref_grads.keys() == got_grads.keys()
    for name, ref_grad in ref_grads.items():
        assert ref_grad is not None, f"{name} got no gradient in the reference run"
        torch.testing.assert_close(got_grads[name], ref_grad, msg=lambda m, n=name: f"{n}: {m}")


def assert_split_matches_whole(family: str, plan: PartitionPlan) -> None:
    """Decompose per `plan`, then split-at-every-cut == the same parts chained undetached."""
    adapter = adapter_of(family)
    model = tiny_model(family)
    decompose_plan(model, plan, adapter=adapter)
    split_model = twin(model)
    batch = padded_batch(family)

    ref = run_whole(build_parts(model, plan, adapter=adapter), batch)
    got = run_split_named(build_parts(split_model, plan, adapter=adapter), batch)

    assert_same(ref, got, model, split_model)


@pytest.mark.parametrize("family", FAMILIES)
def test_full_rank_decomposition_matches_the_original(family: str) -> None:
    model = tiny_model(family)
    decomposed = twin(model)
    adapter = adapter_of(family)
    batch = padded_batch(family)
    for block in (0, 3):
        decompose(decomposed, block, FULL_RANK, adapter=adapter)

    ref = run_unsplit(model, adapter, batch)
    got = run_unsplit(decomposed, adapter, batch)

    torch.testing.assert_close(got[0], ref[0])
    torch.testing.assert_close(got[1], ref[1])
    ref_grads, got_grads = grads_of(model), grads_of(decomposed)
    for name, grad in got_grads.items():
        if name in ref_grads:
            torch.testing.assert_close(grad, ref_grads[name], msg=lambda m, n=name: f"{n}: {m}")
    # The factors' gradients are the chain rule through W = U (S V): dL/dU = dL/dW (S V)^T.
    for block in (0, 3):
        first = f"{adapter.block_path(block)}.{adapter.ffn_in_paths[0]}"
        owner = decomposed.get_submodule(first)
        grad_w = torch.cat(
            [
                grad.t() if adapter.ffn_conv1d else grad
                for grad in (
                    ref_grads[f"{adapter.block_path(block)}.{p}.weight"]
                    for p in adapter.ffn_in_paths
                )
            ]
        )
        expected = grad_w @ owner.lowrank_in.weight.detach().t()
        torch.testing.assert_close(owner.lowrank_out.weight.grad, expected)


@pytest.mark.parametrize("family", FAMILIES)
def test_state_dict_keys_and_merge_restore_the_original(family: str) -> None:
    model = tiny_model(family)
    adapter = adapter_of(family)
    decomposed = twin(model)
    decompose(decomposed, 1, FULL_RANK, adapter=adapter)
    first = f"{adapter.block_path(1)}.{adapter.ffn_in_paths[0]}"

    keys = set(decomposed.state_dict())
    folded = merged_state_dict(decomposed.state_dict(), adapter=adapter)
    merge_lowrank(decomposed, adapter=adapter)

    assert f"{first}.lowrank_in.weight" in keys and f"{first}.lowrank_out.weight" in keys
    assert not any(f"{adapter.block_path(1)}.{p}.weight" in keys for p in adapter.ffn_in_paths)
    for state in (decomposed.state_dict(), folded):
        assert state.keys() == model.state_dict().keys()
        for key, value in model.state_dict().items():
            torch.testing.assert_close(state[key], value, msg=lambda m, k=key: f"{k}: {m}")
    assert type(decomposed.get_submodule(first)) is type(model.get_submodule(first))


@pytest.mark.parametrize("family", ["bert", "gpt2", "llama"])
def test_code_has_rank_r_and_truncation_keeps_the_top_singular_values(family: str) -> None:
    model = tiny_model(family)
    adapter = adapter_of(family)
    plan = with_lowrank_cuts(two_stage_plan(num_layers=4, cut_layers=2), rank=3, residual="keep")
    decompose_plan(model, plan, adapter=adapter)
    front, rest = build_parts(model, plan, adapter=adapter)
    batch = padded_batch(family)

    out = front(batch[INPUT_IDS], batch[PAD_MASK], positions_from_pad_mask(batch[PAD_MASK]))

    batch_size, width = batch[INPUT_IDS].shape
    assert front.sends == (CODE, RESIDUAL) == rest.receives
    assert out[CODE].shape == (batch_size, width, 3)
    assert out[RESIDUAL].shape == (batch_size, width, HIDDEN)
    owner = model.get_submodule(f"{adapter.block_path(1)}.{adapter.ffn_in_paths[0]}")
    assert isinstance(owner, LowRankLinear) and owner.lowrank_out.weight.shape[1] == 3
    row_norms = owner.lowrank_in.weight.detach().norm(dim=1)  # = the kept singular values
    assert torch.all(row_norms[:-1] >= row_norms[1:])


def test_parts_own_disjoint_halves_of_the_cut_block() -> None:
    model = tiny_model("llama")
    plan = with_lowrank_cuts(
        u_shape_plan(num_layers=4, cut_layers=1, tail_blocks=1), rank=4, cuts="both"
    )
    decompose_plan(model, plan)
    front, body, tail = build_parts(model, plan)

    owner_keys = set(group((front, tail)).state_dict())
    body_keys = set(body.state_dict())

    assert not owner_keys & body_keys
    assert owner_keys | body_keys == set(model.state_dict())
    assert "model.layers.0.mlp.gate_proj.lowrank_in.weight" in owner_keys
    assert "model.layers.0.mlp.gate_proj.lowrank_out.weight" in body_keys
    assert "model.layers.2.mlp.gate_proj.lowrank_in.weight" in body_keys
    assert "model.layers.2.mlp.down_proj.weight" in owner_keys


CUTS = ["front", "tail", "both"]


@pytest.mark.parametrize("residual", ["keep", "drop"])
@pytest.mark.parametrize("cuts", CUTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_u_shape_low_rank_cut_matches_unsplit(family: str, cuts: str, residual: str) -> None:
    plan = with_lowrank_cuts(
        u_shape_plan(num_layers=4, cut_layers=1, tail_blocks=1),
        rank=5,
        residual=residual,
        cuts=cuts,
    )

    assert_split_matches_whole(family, plan)


@pytest.mark.parametrize("family", FAMILIES)
def test_full_rank_keep_split_matches_the_original_model(family: str) -> None:
    # The whole chain: original model == decomposed (R = full) == split at the code, keep.
    adapter = adapter_of(family)
    model = tiny_model(family)
    plan = with_lowrank_cuts(
        u_shape_plan(num_layers=4, cut_layers=2, tail_blocks=1),
        rank=FULL_RANK,
        residual=ResidualMode.keep,
        cuts="both",
    )
    split_model = twin(model)
    decompose_plan(split_model, plan, adapter=adapter)
    batch = padded_batch(family)

    ref = run_unsplit(model, adapter, batch)
    got = run_split_named(build_parts(split_model, plan, adapter=adapter), batch)

    torch.testing.assert_close(got[0], ref[0])
    torch.testing.assert_close(got[1], ref[1])
    ref_grads = grads_of(model)
    for name, grad in grads_of(split_model).items():
        if name in ref_grads:
            torch.testing.assert_close(grad, ref_grads[name], msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("residual", ["keep", "drop"])
@pytest.mark.parametrize("family", ["bert", "gpt2", "llama"])
def test_two_stage_low_rank_cut_matches_unsplit(family: str, residual: str) -> None:
    plan = with_lowrank_cuts(two_stage_plan(num_layers=4, cut_layers=3), rank=2, residual=residual)

    assert_split_matches_whole(family, plan)


@pytest.mark.parametrize("family", ["bert", "gpt2", "llama"])
def test_lora_on_a_low_rank_split_matches_unsplit(family: str) -> None:
    adapter = adapter_of(family)
    plan = with_lowrank_cuts(
        u_shape_plan(num_layers=4, cut_layers=2, tail_blocks=1), rank=4, cuts="both"
    )
    lora = LoraConfig(
        r=2, target_modules=list(adapter.lora_targets), fan_in_fan_out=adapter.lora_fan_in_fan_out
    )
    model = tiny_model(family)
    decompose_plan(model, plan, adapter=adapter)
    inject_adapter_in_model(lora, model)
    torch.manual_seed(3)
    for name, param in model.named_parameters():  # LoRA B starts at 0: give it a gradient path
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.1)
        param.requires_grad_("lora_" in name or "lowrank_" in name)
    split_model = twin(model)
    batch = padded_batch(family)

    ref = run_whole(build_parts(model, plan, adapter=adapter), batch)
    got = run_split_named(build_parts(split_model, plan, adapter=adapter), batch)

    torch.testing.assert_close(got[0], ref[0])
    ref_grads, got_grads = grads_of(model), grads_of(split_model)
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert any("lora_" in n for n in trained) and any("lowrank_" in n for n in trained)
    for name in trained:
        torch.testing.assert_close(got_grads[name], ref_grads[name])


@pytest.mark.parametrize("family", ["bert", "gpt2", "llama"])
def test_three_factor_form_computes_the_two_factor_function_with_sigma_trainable(
    family: str,
) -> None:
    adapter = adapter_of(family)
    model = tiny_model(family)
    two, three, full = twin(model), twin(model), twin(model)
    decompose(two, 1, 5, adapter=adapter)
    owner = decompose(three, 1, 5, adapter=adapter, factors=SftFactors.three)
    decompose(full, 1, FULL_RANK, adapter=adapter, factors="three")
    batch = padded_batch(family)

    # Same function at initialisation (truncated), the original model at full rank.
    torch.testing.assert_close(
        run_unsplit(three, adapter, batch)[0], run_unsplit(two, adapter, batch)[0]
    )
    torch.testing.assert_close(
        run_unsplit(full, adapter, batch)[0], run_unsplit(model, adapter, batch)[0]
    )
    # The sender holds V_R (orthonormal rows), the receiver S_R, descending, and it trains.
    v = owner.lowrank_in.weight.detach()
    torch.testing.assert_close(v @ v.t(), torch.eye(5), atol=1e-5, rtol=0)
    sigma = owner.lowrank_out.sigma
    assert sigma.grad is not None and sigma.grad.abs().sum() > 0
    assert torch.all(sigma.detach()[:-1] >= sigma.detach()[1:])
    # Merging folds sigma in: the full-rank three-factor model merges back to the original.
    folded = merged_state_dict(full.state_dict(), adapter=adapter)
    assert not any(".sigma" in k for k in folded) and folded.keys() == model.state_dict().keys()
    for key, value in model.state_dict().items():
        torch.testing.assert_close(folded[key], value, msg=lambda m, k=key: f"{k}: {m}")
    merged = merge_lowrank(full, adapter=adapter).state_dict()
    for key, value in model.state_dict().items():
        torch.testing.assert_close(merged[key], value, msg=lambda m, k=key: f"{k}: {m}")


@pytest.mark.parametrize("residual", ["keep", "drop"])
@pytest.mark.parametrize("family", ["bert", "gpt2", "llama"])
def test_three_factor_u_shape_cut_matches_unsplit_and_sigma_sits_on_the_receiver(
    family: str, residual: str
) -> None:
    plan = with_lowrank_cuts(u_shape_plan(num_layers=4, cut_layers=1, tail_blocks=1), rank=5,
                             residual=residual, cuts="both", factors="three")  # fmt: skip
    assert_split_matches_whole(family, plan)

    adapter = adapter_of(family)
    model = tiny_model(family)
    decompose_plan(model, plan, adapter=adapter)
    front, body, tail = build_parts(model, plan, adapter=adapter)
    first = adapter.ffn_in_paths[0]
    front_sigma = f"{adapter.block_path(0)}.{first}.lowrank_out.sigma"  # front -> body cut
    tail_sigma = f"{adapter.block_path(2)}.{first}.lowrank_out.sigma"  # body -> tail cut
    assert front_sigma in body.state_dict() and front_sigma not in front.state_dict()
    assert tail_sigma in tail.state_dict() and tail_sigma not in body.state_dict()
