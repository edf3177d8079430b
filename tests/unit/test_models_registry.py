"""The family registry: lookup, errors, and a new family added without touching any scheduler.

.venv/bin/pytest tests/unit/test_models_registry.py
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from model_helpers import grads_of, padded_batch, run_split, run_unsplit, tiny_config, twin
from torch import nn
from transformers import MistralConfig, MistralForCausalLM, PreTrainedConfig, PreTrainedModel
from transformers.models.mistral.modeling_mistral import MistralDecoderLayer

from splitlab.config.enums import TaskKind
from splitlab.config.schema import ModelConfig
from splitlab.errors import ConfigError
from splitlab.models.families import (
    BertAdapter,
    LlamaAdapter,
    family_for_model,
    family_kind,
    get_family,
    register_family,
    unregister_family,
)
from splitlab.models.parts import build_parts
from splitlab.models.plan import even_cuts, ring_plan, u_shape_plan


class MistralAdapter(LlamaAdapter):
    """Mistral has Llama's layout; only the classes differ (short test sequences never
    reach its sliding window, so the Llama masks are exact here)."""

    name = "mistral"
    model_types = frozenset({"mistral"})

    def make_config(self, cfg: ModelConfig) -> PreTrainedConfig:
        return MistralConfig(
            vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
            num_attention_heads=cfg.num_heads,
            num_key_value_heads=cfg.num_kv_heads or cfg.num_heads,
            max_position_embeddings=cfg.max_position_embeddings,
        )  # fmt: skip

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


def test_builtin_families_are_registered_by_name() -> None:
    assert isinstance(get_family("bert"), BertAdapter)
    assert {get_family(f).name for f in ("bert", "gpt2", "llama")} == {"bert", "gpt2", "llama"}


@pytest.mark.parametrize("name", ["bert", "gpt2", "llama"])
def test_registered_ties_head_is_what_a_random_model_does(name: str) -> None:
    # preflight reads ties_head from the registry to refuse a tied two-stage run without
    # importing transformers; it must say what building the random model does.
    from splitlab.models.folder import tied_head

    adapter = get_family(name)
    config = adapter.make_config(tiny_config(name))
    assert family_kind(name).ties_head is tied_head(adapter, config)
    assert adapter.ties_head is family_kind(name).ties_head
    model = adapter.model_class(config)(config)
    assert adapter.tied_head(model) is family_kind(name).ties_head


def test_unknown_family_is_a_config_error_naming_it() -> None:
    with pytest.raises(ConfigError, match="model.family='t5'"):
        get_family("t5")


def test_registering_a_taken_name_is_refused() -> None:
    with pytest.raises(ValueError, match="already registered"):
        register_family("llama", LlamaAdapter())


def test_a_family_registered_by_path_is_built_on_first_use_and_checked() -> None:
    path = "splitlab.models.families.llama:LlamaAdapter"
    register_family("llama_by_path", path, task=TaskKind.causal_lm, model_types={"llama", "qwen2"})
    register_family("llama_as_bert", path, task=TaskKind.classification, model_types={"bert"})
    try:
        kind = family_kind("llama_by_path")
        assert (kind.task, kind.model_types, kind.target) == (
            TaskKind.causal_lm,
            frozenset({"llama", "qwen2"}),
            path,
        )
        adapter = get_family("llama_by_path")
        assert isinstance(adapter, LlamaAdapter) and get_family("llama_by_path") is adapter
        with pytest.raises(ValueError, match="llama_as_bert.*task=classification"):
            get_family("llama_as_bert")
        with pytest.raises(ValueError, match="needs its task and model_types"):
            register_family("no_task", path)
    finally:
        unregister_family("llama_by_path")
        unregister_family("llama_as_bert")


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


def test_registered_family_is_a_config_name_that_loads_and_shards(
    mistral_registered: MistralAdapter, tmp_path
) -> None:
    from splitlab.configure import compose_config
    from splitlab.models.load import load_model
    from splitlab.models.shard import load_part, open_checkpoint

    cfg = compose_config(["task=infer", "model=tiny_llama", "model.family=mistral"]).model
    torch.manual_seed(0)
    model, _ = load_model(cfg, load_tokenizer=False)
    model.save_pretrained(tmp_path)
    index = open_checkpoint(tmp_path)
    spans = ring_plan(cfg.num_layers, even_cuts(num_layers=cfg.num_layers, stages=2))
    parts = [load_part(index, span, dtype="fp32")[0] for span in spans]

    assert isinstance(model, MistralForCausalLM) and index.family is mistral_registered
    want = model.state_dict()
    for part in parts:
        for key, tensor in part.state_dict().items():
            if key in want:
                torch.testing.assert_close(tensor, want[key])
    assert sum(len(s.layer_ids) for s in spans) == cfg.num_layers
