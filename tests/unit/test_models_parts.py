"""Parts: upstream keys, no copies, meta-skeleton loading, LoRA injection, and bad spans.

.venv/bin/pytest tests/unit/test_models_parts.py
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from model_helpers import adapter_of, padded_batch, tiny_model
from peft import LoraConfig, inject_adapter_in_model
from safetensors import safe_open

from splitlab.errors import ConfigError
from splitlab.models.families import INPUT_IDS, PAD_MASK
from splitlab.models.parts import build_part, build_parts, shared_across, tied_keys
from splitlab.models.plan import Span, two_stage_plan, u_shape_plan
from splitlab.models.tokens import positions_from_pad_mask

FAMILIES = ["bert", "gpt2", "llama", "qwen2"]


@pytest.mark.parametrize("family", FAMILIES)
def test_body_state_dict_is_exactly_its_blocks_under_upstream_keys(family: str) -> None:
    model = tiny_model(family)
    adapter = adapter_of(family)
    body = build_part(model, Span(1, 3))

    prefixes = tuple(f"{adapter.block_path(i)}." for i in (1, 2))
    expected = {k for k in model.state_dict() if k.startswith(prefixes)}

    assert set(body.state_dict()) == expected


@pytest.mark.parametrize("family", FAMILIES)
def test_parts_share_the_model_tensors(family: str) -> None:
    model = tiny_model(family)
    model_tensors = {id(p) for p in model.parameters()}

    parts = build_parts(model, u_shape_plan(num_layers=4, cut_layers=1, tail_blocks=1))

    for part in parts:
        assert {id(p) for p in part.parameters()} <= model_tensors


@pytest.mark.parametrize("family", FAMILIES)
def test_block_factory_builds_blocks_with_the_checkpoint_layout(family: str) -> None:
    model = tiny_model(family)
    adapter = adapter_of(family)

    block = adapter.block_factory(model.config, 2)
    original = model.get_submodule(adapter.block_path(2))

    assert {k: v.shape for k, v in block.state_dict().items()} == {
        k: v.shape for k, v in original.state_dict().items()
    }


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen2"])
@torch.no_grad()
def test_a_part_cut_from_a_meta_skeleton_loads_from_safetensors(
    family: str, tmp_path: Path
) -> None:
    model = tiny_model(family)
    model.save_pretrained(tmp_path)
    with torch.device("meta"):
        skeleton = type(model)(model.config)
    span = Span(1, 3)

    part = build_part(skeleton, span)
    wanted = set(part.state_dict())
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys() if k in wanted}  # noqa: SIM118
    part.load_state_dict(tensors, strict=True, assign=True)

    reference = build_part(model, span)
    batch = padded_batch(family, left=True)
    positions = positions_from_pad_mask(batch[PAD_MASK])
    hidden = torch.randn(3, batch[INPUT_IDS].shape[1], model.config.hidden_size)
    torch.testing.assert_close(
        part(hidden, batch[PAD_MASK], positions), reference(hidden, batch[PAD_MASK], positions)
    )


@pytest.mark.parametrize("family", ["bert", "gpt2", "llama"])
def test_lora_injects_into_a_part_with_the_family_targets(family: str) -> None:
    model = tiny_model(family)
    adapter = adapter_of(family)
    body = build_part(model, Span(1, 3))
    lora = LoraConfig(
        r=2, target_modules=list(adapter.lora_targets), fan_in_fan_out=adapter.lora_fan_in_fan_out
    )

    inject_adapter_in_model(lora, body)
    hidden = torch.randn(2, 5, model.config.hidden_size)
    out = body(hidden, torch.ones(2, 5, dtype=torch.long), torch.arange(5).expand(2, 5))

    lora_names = [n for n, _ in body.named_parameters() if "lora_" in n]
    assert len(lora_names) == 2 * 2 * len(adapter.lora_targets)  # A and B per target per block
    assert out.shape == hidden.shape


def test_a_span_past_the_model_is_a_config_error() -> None:
    model = tiny_model("llama")

    with pytest.raises(ConfigError, match=r"blocks \[2, 6\) .* num_layers=4"):
        build_part(model, Span(2, 6))


def test_a_plan_for_another_depth_is_a_config_error() -> None:
    model = tiny_model("gpt2")

    with pytest.raises(ConfigError, match="model.num_layers=6"):
        build_parts(model, u_shape_plan(num_layers=6, cut_layers=1, tail_blocks=1))


def test_only_parts_with_blocks_carry_rotary_tables() -> None:
    model = tiny_model("llama")

    front, body, tail = build_parts(model, u_shape_plan(num_layers=4, cut_layers=0, tail_blocks=0))

    assert "rotary" not in front.aux and "rotary" not in tail.aux
    assert "rotary" in body.aux


def test_tied_keys_name_the_head_alias_that_checkpoints_omit(tmp_path: Path) -> None:
    gpt2, llama = tiny_model("gpt2"), tiny_model("llama")
    gpt2.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        saved = set(f.keys())

    assert tied_keys(gpt2) == {"lm_head.weight": "transformer.wte.weight"}
    assert "lm_head.weight" not in saved
    assert tied_keys(llama) == {}


@torch.no_grad()
def test_a_tied_tail_loads_its_head_through_the_alias(tmp_path: Path) -> None:
    model = tiny_model("gpt2")
    model.save_pretrained(tmp_path)
    with torch.device("meta"):
        skeleton = type(model)(model.config)
    aliases = tied_keys(skeleton)
    part = build_part(skeleton, Span(3, 4, has_head=True))

    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(aliases.get(k, k)) for k in part.state_dict()}
    part.load_state_dict(tensors, strict=True, assign=True)

    torch.testing.assert_close(part.module("lm_head").weight, model.lm_head.weight)


def test_two_stage_reports_the_tied_head_split_from_its_embeddings() -> None:
    model = tiny_model("gpt2")

    u_parts = build_parts(model, u_shape_plan(num_layers=4, cut_layers=1, tail_blocks=1))
    two_parts = build_parts(model, two_stage_plan(num_layers=4, cut_layers=2))

    assert shared_across(u_parts) == [((0, "transformer.wte.weight"), (2, "lm_head.weight"))]
    assert shared_across(two_parts) == [((0, "transformer.wte.weight"), (1, "lm_head.weight"))]
