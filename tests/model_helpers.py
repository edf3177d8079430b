"""Tiny models, padded batches and the split-vs-unsplit runners the model tests share.

The split runner does what the U-shape does across processes: each cut detaches the hidden
state into a fresh leaf, and backward is driven by hand from the tail back to the front with
the gradient that crossed each cut.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import nn
from transformers import PreTrainedModel, Qwen2Config, Qwen2ForCausalLM

from splitlab.config.enums import DType, ModelSource
from splitlab.config.schema import ModelConfig
from splitlab.models.families import INPUT_IDS, LABELS, PAD_MASK, FamilyAdapter, get_family
from splitlab.models.load import load_model
from splitlab.models.parts import Part
from splitlab.models.tokens import positions_from_pad_mask

TINY_VOCAB = 96
TINY_LAYERS = 4


def tiny_config(family: str, *, num_layers: int = TINY_LAYERS, dropout: float = 0.0) -> ModelConfig:
    """A random-init config small enough for a 2-core CI box."""
    return ModelConfig(
        name=f"tiny_{family}",
        family=family,
        source=ModelSource.random,
        num_layers=num_layers,
        hidden_size=32,
        num_heads=4,
        num_kv_heads=2 if family == "llama" else None,
        intermediate_size=64,
        vocab_size=TINY_VOCAB,
        max_position_embeddings=64,
        num_labels=3,
        dtype=DType.fp32,
        dropout=dropout,
    )


def tiny_model(
    family: str,
    *,
    seed: int = 0,
    tied: bool = False,
    attn: str | None = None,
    num_layers: int = TINY_LAYERS,
    dropout: float = 0.0,
) -> PreTrainedModel:
    """A random tiny model; family "qwen2" is the Llama adapter on a Qwen2 model."""
    torch.manual_seed(seed)
    if family == "qwen2":
        config = Qwen2Config(
            vocab_size=TINY_VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=num_layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            tie_word_embeddings=tied,
            attention_dropout=dropout,
        )
        if attn is not None:
            config._attn_implementation = attn
        return Qwen2ForCausalLM(config).eval()
    if tied and family == "llama":
        adapter = get_family(family)
        config = adapter.make_config(tiny_config(family, num_layers=num_layers))
        config.tie_word_embeddings = True
        if attn is not None:
            config._attn_implementation = attn
        return adapter.model_class(config)(config).eval()
    model, _ = load_model(
        tiny_config(family, num_layers=num_layers, dropout=dropout),
        load_tokenizer=False,
        attn_implementation=attn,
    )
    return model


def adapter_of(family: str) -> FamilyAdapter:
    return get_family("llama" if family == "qwen2" else family)


def padded_batch(
    family: str,
    *,
    lengths: Sequence[int] = (8, 5, 3),
    left: bool = False,
    num_labels: int = 3,
    seed: int = 1,
) -> dict[str, torch.Tensor]:
    """Token ids, padding mask (and class labels for BERT) with ragged lengths."""
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    pad_id = TINY_VOCAB - 1  # GPT-2 style: the pad id is a real token id (its EOS)
    ids = torch.full((len(lengths), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(lengths), width), dtype=torch.long)
    for row, length in enumerate(lengths):
        cols = slice(width - length, width) if left else slice(0, length)
        ids[row, cols] = torch.randint(0, TINY_VOCAB - 1, (length,), generator=gen)
        mask[row, cols] = 1
    batch = {INPUT_IDS: ids, PAD_MASK: mask}
    if family == "bert":
        batch[LABELS] = torch.randint(0, num_labels, (len(lengths),), generator=gen)
    return batch


def grads_of(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {name: p.grad for name, p in model.named_parameters()}


def run_unsplit(
    model: PreTrainedModel, adapter: FamilyAdapter, batch: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' own forward with its own loss, then backward: the reference numbers."""
    positions = positions_from_pad_mask(batch[PAD_MASK])
    out = model(
        input_ids=batch[INPUT_IDS],
        attention_mask=batch[PAD_MASK],
        position_ids=positions,
        labels=adapter.labels(batch),
    )
    out.loss.backward()
    return out.loss.detach(), out.logits.detach()


def run_split(
    parts: Sequence[Part], batch: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Parts in sequence with a detach at every cut and the backward handed across by hand."""
    adapter = parts[0].adapter
    pad_mask = batch[PAD_MASK]
    positions = positions_from_pad_mask(pad_mask)
    x: torch.Tensor = batch[INPUT_IDS]
    sent: list[
        tuple[torch.Tensor, torch.Tensor]
    ] = []  # (output on the sender, leaf on the receiver)
    for i, part in enumerate(parts):
        out = part(x, pad_mask, positions)
        if i == len(parts) - 1:
            logits = out
        else:
            leaf = out.detach().requires_grad_()
            sent.append((out, leaf))
            x = leaf
    loss = adapter.loss(logits, adapter.labels(batch))
    loss.backward()
    for out, leaf in reversed(sent):
        out.backward(leaf.grad)
    return loss.detach(), logits.detach()


def twin(model: PreTrainedModel) -> PreTrainedModel:
    """An identical independent copy (ties preserved), so two runs keep separate gradients."""
    return copy.deepcopy(model)


def model_option(name: str, *overrides: str) -> ModelConfig:
    """The composed `model=NAME` config (conf/model/NAME.yaml) with `overrides` applied."""
    from splitlab.configure import compose_config

    return compose_config([f"model={name}", *overrides]).model
