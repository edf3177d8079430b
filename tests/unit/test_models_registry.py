"""The family registry: lookup, errors, and a new family added without touching any scheduler.

.venv/bin/pytest tests/unit/test_models_registry.py
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from model_helpers import grads_of, padded_batch, run_split, run_unsplit, twin
from torch import nn
from transformers import MistralConfig, MistralForCausalLM, PreTrainedConfig, PreTrainedModel
from transformers.models.mistral.modeling_mistral import MistralDecoderLayer

from splitlab.config.enums import Family
from splitlab.errors import ConfigError
from splitlab.models.families import (
    BertAdapter,
    LlamaAdapter,
    family_for_model,
    get_family,
    register_family,
    unregister_family,
)
from splitlab.models.parts import build_parts
from splitlab.models.plan import u_shape_plan


class MistralAdapter(LlamaAdapter):
    """Mistral has Llama's layout; only the classes differ (short test sequences never
    reach its sliding window, so the Llama masks are exact here)."""

    name = "mistral"
    model_types = frozenset({"mistral"})

    def model_class(self, config: PreTrainedConfig) -> type[PreTrainedModel]:
        return MistralForCausalLM

    def block_factory(self, config: PreTrainedConfig, layer_idx: int) -> nn.Module:
        return MistralDecoderLayer(config, layer_idx)


@pytest.fixture
def mistral_registered() -> Iterator[MistralAdapter]:
    adapter = MistralAdapter()
    register_family("mistral", adapter)
    yield adapter
    unregister_family("mistral")


def test_builtin_families_are_registered_by_enum_and_name() -> None:
    assert isinstance(get_family(Family.bert), BertAdapter)
    assert {get_family(f.value).name for f in Family} == {"bert", "gpt2", "llama"}


def test_unknown_family_is_a_config_error_naming_it() -> None:
    with pytest.raises(ConfigError, match="model.family='t5'"):
        get_family("t5")


def test_registering_a_taken_name_is_refused() -> None:
    with pytest.raises(ValueError, match="already registered"):
        register_family("llama", LlamaAdapter())


def test_registered_family_splits_exactly_like_builtins(mistral_registered: MistralAdapter) -> None:
    torch.manual_seed(0)
    config = MistralConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = MistralForCausalLM(config).eval()
    split_model = twin(model)
    batch = padded_batch("mistral")

    assert family_for_model(model) is mistral_registered
    ref = run_unsplit(model, mistral_registered, batch)
    split = run_split(
        build_parts(split_model, u_shape_plan(num_layers=4, cut_layers=1, tail_blocks=1)), batch
    )

    torch.testing.assert_close(split[0], ref[0])
    for name, grad in grads_of(model).items():
        torch.testing.assert_close(grads_of(split_model)[name], grad)


def test_model_of_an_unregistered_type_is_a_config_error() -> None:
    model = MistralForCausalLM(
        MistralConfig(
            hidden_size=16,
            intermediate_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            vocab_size=8,
        )
    )
    with pytest.raises(ConfigError, match="model_type='mistral'"):
        family_for_model(model)
