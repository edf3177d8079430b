"""Prompt ids and stop ids from a tokenizer: the chat template when it has one, else plain text.

.venv/bin/pytest tests/unit/test_infer_ring.py -q
"""

from __future__ import annotations

import torch
from transformers import PreTrainedConfig
from transformers.tokenization_utils_base import PreTrainedTokenizerBase


def encode_prompt(
    tokenizer: PreTrainedTokenizerBase, prompt: str, *, chat: bool = True
) -> torch.Tensor:
    """1 x T long ids of `prompt` (as a user message when `chat` and a template exist)."""
    if chat and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        ids = tokenizer(prompt)["input_ids"]
    return torch.tensor([ids], dtype=torch.long)


def eos_ids(
    config: PreTrainedConfig, tokenizer: PreTrainedTokenizerBase | None = None
) -> tuple[int, ...]:
    """Every id that ends generation: the config's eos id(s) and the tokenizer's."""
    found: list[int] = []
    raw = getattr(config, "eos_token_id", None)
    found += raw if isinstance(raw, list) else ([raw] if raw is not None else [])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        found.append(int(tokenizer.eos_token_id))
    return tuple(sorted({int(i) for i in found}))
