"""load_model: random init, local folders, dimension checks, dtype, dropout and tokenizers.

.venv/bin/pytest tests/unit/test_models_load.py
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from model_helpers import tiny_config
from torch import nn

from splitlab.config.enums import DType, ModelSource, TaskKind
from splitlab.errors import AssetError, ConfigError
from splitlab.models.load import load_model


def same_state(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("family", ["bert", "gpt2", "llama"])
def test_random_init_is_deterministic_under_the_seed(family: str) -> None:
    cfg = tiny_config(family)

    torch.manual_seed(3)
    first, tokenizer = load_model(cfg, load_tokenizer=False)
    torch.manual_seed(3)
    second, _ = load_model(cfg, load_tokenizer=False)
    torch.manual_seed(4)
    other, _ = load_model(cfg, load_tokenizer=False)

    assert tokenizer is None
    assert same_state(first, second)
    assert not same_state(first, other)
    assert not first.training


def test_random_init_follows_the_config_dimensions() -> None:
    model, _ = load_model(tiny_config("llama"), load_tokenizer=False)

    assert model.config.num_hidden_layers == 4
    assert model.config.hidden_size == 32
    assert model.config.num_key_value_heads == 2
    assert model.config.vocab_size == 96


def test_a_local_folder_loads_the_saved_weights(tmp_path: Path) -> None:
    saved, _ = load_model(tiny_config("gpt2"), load_tokenizer=False)
    saved.save_pretrained(tmp_path)
    cfg = dataclasses.replace(tiny_config("gpt2"), source=ModelSource.hub, id=str(tmp_path))

    loaded, _ = load_model(cfg, load_tokenizer=False)

    assert same_state(saved, loaded)
    assert loaded.lm_head.weight is loaded.transformer.wte.weight


def test_a_folder_whose_depth_differs_from_the_config_is_refused(tmp_path: Path) -> None:
    saved, _ = load_model(tiny_config("llama"), load_tokenizer=False)
    saved.save_pretrained(tmp_path)
    cfg = dataclasses.replace(
        tiny_config("llama"), source=ModelSource.hub, id=str(tmp_path), num_layers=6
    )

    with pytest.raises(ConfigError, match="model.num_layers=6 .* has 4"):
        load_model(cfg, load_tokenizer=False)


def test_a_folder_of_another_family_is_refused(tmp_path: Path) -> None:
    saved, _ = load_model(tiny_config("gpt2"), load_tokenizer=False)
    saved.save_pretrained(tmp_path)
    cfg = dataclasses.replace(tiny_config("llama"), source=ModelSource.hub, id=str(tmp_path))

    with pytest.raises(ConfigError, match="model_type='gpt2'"):
        load_model(cfg, load_tokenizer=False)


def test_a_hub_id_missing_offline_is_an_asset_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = dataclasses.replace(
        tiny_config("gpt2"), source=ModelSource.hub, id="splitlab-tests/no-such-model"
    )

    with pytest.raises(AssetError, match="no-such-model"):
        load_model(cfg, load_tokenizer=False)


def test_hub_source_without_an_id_is_a_config_error() -> None:
    cfg = dataclasses.replace(tiny_config("gpt2"), source=ModelSource.hub, id=None)

    with pytest.raises(ConfigError, match="model.id"):
        load_model(cfg, load_tokenizer=False)


def test_a_task_the_head_cannot_do_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="model.family=bert .* causal_lm"):
        load_model(tiny_config("bert"), task=TaskKind.causal_lm, load_tokenizer=False)


def test_bf16_casts_the_weights() -> None:
    cfg = dataclasses.replace(tiny_config("llama"), dtype=DType.bf16)

    model, _ = load_model(cfg, load_tokenizer=False)

    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


@pytest.mark.parametrize("family", ["bert", "gpt2"])
def test_dropout_override_reaches_every_dropout_module(family: str) -> None:
    model, _ = load_model(tiny_config(family, dropout=0.25), load_tokenizer=False)

    probabilities = {m.p for m in model.modules() if isinstance(m, nn.Dropout)}

    assert probabilities == {0.25}


def test_dropout_none_keeps_the_model_default() -> None:
    cfg = dataclasses.replace(tiny_config("bert"), dropout=None)

    model, _ = load_model(cfg, load_tokenizer=False)

    assert model.config.hidden_dropout_prob == 0.1


@pytest.mark.assets
def test_tiny_gpt2_gets_the_real_gpt2_tokenizer_with_eos_as_pad() -> None:
    cfg = dataclasses.replace(tiny_config("gpt2"), vocab_size=50257, tokenizer="gpt2_tokenizer")

    _, tokenizer = load_model(cfg)

    assert tokenizer is not None and len(tokenizer) == 50257
    assert tokenizer.pad_token_id == tokenizer.eos_token_id == 50256


@pytest.mark.assets
def test_a_vocabulary_smaller_than_the_tokenizer_is_refused() -> None:
    cfg = dataclasses.replace(tiny_config("gpt2"), tokenizer="gpt2_tokenizer")

    with pytest.raises(ConfigError, match="model.vocab_size=96"):
        load_model(cfg)
