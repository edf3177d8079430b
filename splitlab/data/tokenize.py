"""Tokenisation to unpadded id lists, and collation into padded B x T batches.

Sequences stay unpadded until a batch is formed, so each microbatch pads only to its own
longest row (length bucketing makes that short). A batch is a dict of tensors:

- `input_ids` B x T (long), right-padded with the tokenizer's pad id (GPT-2: its EOS id);
- `attention_mask` B x T (long), the padding mask: 1 = real token, 0 = pad;
- `labels`: B class ids (classification), or B x T token ids with pads set to -100 (causal LM;
  transformers shifts them inside the loss).

Causal-LM sequences are `text`, or `text + "\\n" + target` (GSM: question and worked answer),
followed by EOS when it fits in `max_length`.

    .venv/bin/pytest tests/unit/test_data_tokenize.py
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from splitlab.config.enums import TaskKind
from splitlab.data.sources import Examples
from splitlab.errors import ConfigError

IGNORE_INDEX = -100  # label value the loss skips (torch and transformers agree on it)


@dataclass(frozen=True)
class Encoded:
    """Token ids per example (unpadded) and, for classification, class ids."""

    input_ids: list[list[int]]
    labels: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.input_ids)


def ensure_pad_token(tokenizer: Any) -> int:
    """The pad id, setting pad = EOS for tokenizers without one (GPT-2, Llama)."""
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token is None:
            raise ConfigError(f"tokenizer {type(tokenizer).__name__} has neither pad nor eos token")
        tokenizer.pad_token = tokenizer.eos_token
    return int(tokenizer.pad_token_id)


def encode(
    examples: Examples,
    positions: Sequence[int],
    tokenizer: Any,
    *,
    task: TaskKind,
    max_length: int,
) -> Encoded:
    """Tokenise the examples at `positions`, truncated to `max_length` tokens."""
    if max_length < 2:
        raise ConfigError(f"data.max_length must be >= 2, got {max_length}")
    if not positions:
        return Encoded(input_ids=[])  # an owner with no data (the tokenizer refuses no text)
    texts = [examples.texts[i] for i in positions]
    if TaskKind(task) is TaskKind.classification:
        pairs = [examples.text_pairs[i] for i in positions] if examples.text_pairs else None
        enc = tokenizer(texts, pairs, truncation=True, max_length=max_length)
        return Encoded(
            input_ids=[list(ids) for ids in enc["input_ids"]],
            labels=[examples.labels[i] for i in positions],
        )
    if examples.targets:
        texts = [f"{t}\n{examples.targets[i]}" for t, i in zip(texts, positions, strict=True)]
    enc = tokenizer(texts)
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    # EOS goes on before truncation, so a cut-off sequence never claims to have ended.
    return Encoded(input_ids=[(list(ids) + eos)[:max_length] for ids in enc["input_ids"]])


def collate(
    input_ids: Sequence[Sequence[int]],
    labels: Sequence[int] | None,
    *,
    pad_id: int,
    task: TaskKind,
) -> dict[str, torch.Tensor]:
    """Right-pad rows to the longest one and build the padding mask and labels."""
    if not input_ids:
        raise ValueError("cannot collate an empty batch")
    width = max(len(row) for row in input_ids)
    ids_BT = torch.full((len(input_ids), width), pad_id, dtype=torch.long)
    mask_BT = torch.zeros((len(input_ids), width), dtype=torch.long)
    for b, row in enumerate(input_ids):
        ids_BT[b, : len(row)] = torch.tensor(row, dtype=torch.long)
        mask_BT[b, : len(row)] = 1
    if TaskKind(task) is TaskKind.classification:
        if labels is None or len(labels) != len(input_ids):
            raise ValueError("classification batches need one label per row")
        labels_out = torch.tensor(list(labels), dtype=torch.long)
    else:
        # Pads are found from the mask, not the id: GPT-2 pads with EOS, a real target too.
        labels_out = ids_BT.masked_fill(mask_BT == 0, IGNORE_INDEX)
    return {"input_ids": ids_BT, "attention_mask": mask_BT, "labels": labels_out}
