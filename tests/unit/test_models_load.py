"""load_model: random init, local folders, dimension checks, dtype, dropout and tokenizers.

.venv/bin/pytest tests/unit/test_models_load.py
"""

from __future__ import annotations

import dataclasses
import logging
import re
from pathlib import Path

import pytest
import torch
from model_helpers import tiny_config
from torch import nn
from transformers.utils import logging as hf_logging

from splitlab.config.enums import DType, ModelSource, TaskKind
from splitlab.errors import AssetError, ConfigError
from splitlab.models.families import get_family
from splitlab.models.load import load_model, untie_head


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


def test_a_fresh_head_is_one_splitlab_line_not_a_transformers_report(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    full, _ = load_model(tiny_config("bert"), load_tokenizer=False)
    full.bert.save_pretrained(tmp_path)  # an encoder without the classifier, as MiniLM ships
    cfg = dataclasses.replace(tiny_config("bert"), source=ModelSource.hub, id=str(tmp_path))
    hf_root = logging.getLogger("transformers")  # its own handler; it does not propagate
    hf_root.addHandler(hf_records := _Records())
    try:
        with caplog.at_level("INFO", logger="splitlab.models.load"):
            loaded, _ = load_model(cfg, load_tokenizer=False)
    finally:
        hf_root.removeHandler(hf_records)

    assert torch.equal(loaded.bert.embeddings.word_embeddings.weight,
                       full.bert.embeddings.word_embeddings.weight)  # fmt: skip
    lines = [r.getMessage() for r in caplog.records if r.name == "splitlab.models.load"]
    assert len(lines) == 1
    assert re.fullmatch(rf"loaded {cfg.name} weights from {re.escape(str(tmp_path))} in \d+\.\d s; "
                        "newly initialised: classifier", lines[0])  # fmt: skip
    assert not [r.getMessage() for r in hf_records.records if "LOAD REPORT" in r.getMessage()]
    assert hf_logging.get_verbosity() == hf_logging.WARNING  # put back after the load
    assert hf_logging.is_progress_bar_enabled()


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_untie_embeddings_gives_the_head_its_own_copy() -> None:
    torch.manual_seed(5)
    reference, _ = load_model(tiny_config("gpt2"), load_tokenizer=False)  # GPT-2 ties its head
    torch.manual_seed(5)
    untied = dataclasses.replace(tiny_config("gpt2"), untie_embeddings=True)
    model, _ = load_model(untied, load_tokenizer=False)
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()

    assert reference.get_output_embeddings().weight is reference.get_input_embeddings().weight
    assert head.weight is not embedding.weight
    assert torch.equal(head.weight, embedding.weight)
    assert model.config.tie_word_embeddings is False
    ids = torch.tensor([[1, 2, 3, 4]])
    torch.testing.assert_close(model(ids).logits, reference(ids).logits)  # same function
    model.tie_weights()  # what a later load step may call: the copy stays its own
    assert model.get_output_embeddings().weight is not model.get_input_embeddings().weight
    head.weight.data.add_(1.0)
    assert not torch.equal(head.weight, embedding.weight)
    assert untie_head(model) is False  # nothing left to untie


def test_untie_head_unties_a_tied_llama_like_smollm2() -> None:
    adapter = get_family("llama")
    config = adapter.make_config(tiny_config("llama"))
    config.tie_word_embeddings = True  # SmolLM2 and Llama-3.2 ship tied
    model = adapter.model_class(config)(config)
    assert model.lm_head.weight is model.model.embed_tokens.weight

    assert untie_head(model) is True
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    names = [name for name, _ in model.named_parameters()]
    assert "lm_head.weight" in names  # its own optimizer entry now
