"""Tokenisation and collation: padding masks, pad ids, labels, truncation, EOS.

.venv/bin/pytest tests/unit/test_data_tokenize.py
"""

from __future__ import annotations

import torch
from data_helpers import word_tokenizer

from splitlab.config.enums import TaskKind
from splitlab.data.sources import Examples
from splitlab.data.tokenize import IGNORE_INDEX, collate, encode, ensure_pad_token


def test_collate_pads_to_the_longest_row_with_a_matching_mask() -> None:
    batch = collate([[5, 6, 7], [8]], [1, 0], pad_id=2, task=TaskKind.classification)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 2, 2]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["labels"].tolist() == [1, 0]
    assert batch["input_ids"].dtype == batch["attention_mask"].dtype == torch.long


def test_causal_labels_ignore_pads_found_from_the_mask() -> None:
    eos = 1  # pad shares the EOS id, as with GPT-2
    batch = collate([[5, 6, eos], [7]], None, pad_id=eos, task=TaskKind.causal_lm)
    assert batch["labels"].tolist() == [[5, 6, eos], [7, IGNORE_INDEX, IGNORE_INDEX]]


def test_ensure_pad_token_uses_eos_when_missing() -> None:
    tok = word_tokenizer(with_pad=False)
    assert ensure_pad_token(tok) == tok.eos_token_id


def test_ensure_pad_token_keeps_an_existing_pad() -> None:
    tok = word_tokenizer()
    assert ensure_pad_token(tok) == tok.convert_tokens_to_ids("[PAD]")


def test_classification_encode_truncates_and_keeps_labels() -> None:
    ex = Examples(
        texts=["the film was very very good", "bad"], labels=[1, 0], label_names=["n", "p"]
    )
    enc = encode(ex, [0, 1], word_tokenizer(), task=TaskKind.classification, max_length=4)
    assert [len(ids) for ids in enc.input_ids] == [4, 1]
    assert enc.labels == [1, 0]


def test_causal_encode_joins_target_and_appends_eos_when_it_fits() -> None:
    tok = word_tokenizer()
    ex = Examples(texts=["the plot", "a film"], targets=["was fun", "was very very long"])
    enc = encode(ex, [0, 1], tok, task=TaskKind.causal_lm, max_length=5)
    eos = tok.eos_token_id
    assert enc.input_ids[0] == tok("the plot was fun").input_ids + [eos]
    assert enc.input_ids[1] == tok("a film was very very").input_ids  # cut: no EOS
    assert enc.labels == []


def test_encode_selects_positions_in_order() -> None:
    ex = Examples(texts=["good", "bad", "dull"], labels=[0, 1, 2], label_names=["a", "b", "c"])
    enc = encode(ex, [2, 0], word_tokenizer(), task=TaskKind.classification, max_length=8)
    assert enc.labels == [2, 0]
    assert enc.input_ids == [word_tokenizer()("dull").input_ids, word_tokenizer()("good").input_ids]
