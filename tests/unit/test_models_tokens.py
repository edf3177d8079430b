"""Positions, labels and losses from the padding mask.

.venv/bin/pytest tests/unit/test_models_tokens.py
"""

from __future__ import annotations

import torch
from transformers.loss.loss_utils import ForCausalLMLoss

from splitlab.models.tokens import (
    IGNORE_INDEX,
    causal_lm_labels,
    causal_lm_loss,
    positions_from_pad_mask,
)


def test_right_padding_gives_plain_arange() -> None:
    pad_mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])

    assert positions_from_pad_mask(pad_mask).tolist() == [[0, 1, 2, 3], [0, 1, 2, 3]]


def test_left_padding_starts_each_row_at_its_first_real_token() -> None:
    pad_mask = torch.tensor([[0, 0, 1, 1], [0, 1, 1, 1]])

    assert positions_from_pad_mask(pad_mask).tolist() == [[0, 0, 0, 1], [0, 0, 1, 2]]


def test_decode_positions_are_the_true_offsets() -> None:
    # Two prompt tokens after one pad, then two generated tokens: the next one sits at 4.
    pad_mask = torch.tensor([[0, 1, 1, 1, 1, 1]])

    assert positions_from_pad_mask(pad_mask, query_len=1).tolist() == [[4]]
    assert positions_from_pad_mask(pad_mask, query_len=2).tolist() == [[3, 4]]


def test_labels_ignore_padding_by_mask_even_when_the_pad_id_is_a_real_token() -> None:
    eos = 50256
    ids = torch.tensor([[10, 11, eos, eos]])  # the first eos is a real target, the second pads
    pad_mask = torch.tensor([[1, 1, 1, 0]])

    assert causal_lm_labels(ids, pad_mask).tolist() == [[10, 11, eos, IGNORE_INDEX]]


def test_causal_lm_loss_is_transformers_loss() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=gen)
    labels = torch.randint(0, 11, (2, 5), generator=gen)
    labels[1, 3:] = IGNORE_INDEX

    torch.testing.assert_close(
        causal_lm_loss(logits, labels), ForCausalLMLoss(logits, labels, vocab_size=11)
    )
