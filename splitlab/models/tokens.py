"""Positions, labels and the causal-LM loss from a B x T padding mask.

Only the padding mask (B x T, 1 = real token) and positions ever travel between parts; every
part rebuilds its own attention mask from them, so these helpers are the single definition of
"where a token sits" shared by training, the two-stage mode and the ring.

Legend: B batch, T tokens in this call, K = past + T tokens seen so far, V vocabulary.

    .venv/bin/pytest tests/unit/test_models_tokens.py
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

IGNORE_INDEX = -100  # label value the loss skips (torch and transformers agree on it)


def positions_from_pad_mask(
    pad_mask_BK: torch.Tensor, *, query_len: int | None = None
) -> torch.Tensor:
    """Absolute positions of the last `query_len` tokens of each row.

    A row's first real token sits at position 0, whether the row is right- or left-padded, so
    right padding gives `arange(K)` (what transformers uses by default) and left padding gives
    what `generate` uses. Leading pads get 0 (they are masked everywhere anyway).

    Args:
        pad_mask_BK: 1/True for real tokens over everything seen so far (past + this call).
        query_len: how many trailing tokens this call processes (decode: 1); None = all K.

    Returns:
        Long tensor B x query_len.
    """
    real = pad_mask_BK.to(torch.bool)
    width = real.shape[1]
    # argmax finds the first True; an all-pad row yields 0, i.e. plain arange.
    first_real_B = real.to(torch.int8).argmax(dim=1)
    positions = torch.arange(width, device=real.device).unsqueeze(0) - first_real_B.unsqueeze(1)
    positions = positions.clamp_(min=0)
    if query_len is not None:
        positions = positions[:, width - query_len :]
    return positions


def causal_lm_labels(input_ids_BT: torch.Tensor, pad_mask_BT: torch.Tensor) -> torch.Tensor:
    """Labels for next-token loss: the ids themselves, with padded positions ignored.

    Padding is read from the mask, never from the token id: GPT-2 pads with its EOS id, which
    is also a real target at the end of a sequence.
    """
    return input_ids_BT.masked_fill(~pad_mask_BT.to(torch.bool), IGNORE_INDEX)


def causal_lm_loss(logits_BTV: torch.Tensor, labels_BT: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy: position t predicts label t + 1; `IGNORE_INDEX` skipped.

    Same number as transformers' `ForCausalLMLoss` without `num_items_in_batch`: logits are
    upcast to fp32 and the mean is over the non-ignored targets of this batch.
    """
    shifted_logits = logits_BTV[:, :-1, :].float()
    shifted_labels = labels_BT[:, 1:].to(logits_BTV.device)
    return F.cross_entropy(
        shifted_logits.reshape(-1, shifted_logits.shape[-1]),
        shifted_labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
    )


def classification_loss(logits_BC: torch.Tensor, labels_B: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over `C` classes (single-label classification)."""
    return F.cross_entropy(logits_BC.float(), labels_B.to(logits_BC.device).reshape(-1))
