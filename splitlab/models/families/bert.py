"""The BERT family adapter (sequence classification; MiniLM is a small BERT).

Upstream layout: `bert.embeddings`, `bert.encoder.layer.N`, and the head `bert.pooler`,
`dropout`, `classifier` (BERT has no final norm: its blocks are post-norm). Attention is
bidirectional; every part rebuilds the padding mask from the B x T padding mask.

    .venv/bin/pytest tests/equivalence/test_partition_equivalence.py -k bert
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    PreTrainedConfig,
    PreTrainedModel,
)
from transformers.cache_utils import Cache
from transformers.masking_utils import create_bidirectional_mask
from transformers.models.bert.modeling_bert import BertLayer

from splitlab.config.enums import TaskKind
from splitlab.config.schema import ModelConfig
from splitlab.models.families.base import LABELS, FamilyAdapter
from splitlab.models.tokens import classification_loss

if TYPE_CHECKING:
    from splitlab.models.parts import Part


class BertAdapter(FamilyAdapter):
    name = "bert"
    task = TaskKind.classification
    label_key = LABELS
    model_types = frozenset({"bert"})
    block_prefix = "bert.encoder.layer"
    embedding_paths = ("bert.embeddings",)
    head_paths = ("bert.pooler", "dropout", "classifier")
    lora_targets = ("query", "value")
    ffn_in_paths = ("intermediate.dense",)
    ffn_out_path = "output.dense"
    cut_sender_paths = ("attention",)
    cut_receiver_paths = ("intermediate.intermediate_act_fn", "output")
    dropout_keys = ("hidden_dropout_prob", "attention_probs_dropout_prob", "classifier_dropout")

    def make_config(self, cfg: ModelConfig) -> PreTrainedConfig:
        return BertConfig(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            num_hidden_layers=cfg.num_layers,
            num_attention_heads=cfg.num_heads,
            intermediate_size=cfg.intermediate_size,
            max_position_embeddings=cfg.max_position_embeddings,
            num_labels=cfg.num_labels,
        )

    def model_class(self, config: PreTrainedConfig) -> type[PreTrainedModel]:
        return BertForSequenceClassification

    def block_factory(self, config: PreTrainedConfig, layer_idx: int) -> nn.Module:
        return BertLayer(config, layer_idx=layer_idx)

    def embed(
        self, part: Part, input_ids_BT: torch.Tensor, positions_BT: torch.Tensor
    ) -> torch.Tensor:
        # Single-segment inputs: token type 0 everywhere, as the unsplit model defaults to.
        return part.module("bert.embeddings")(
            input_ids=input_ids_BT,
            token_type_ids=torch.zeros_like(input_ids_BT),
            position_ids=positions_BT,
        )

    def block_context(
        self,
        part: Part,
        hidden_BTH: torch.Tensor,
        pad_mask_BK: torch.Tensor,
        positions_BT: torch.Tensor,
        cache: Cache | None,
    ) -> dict[str, Any]:
        mask = create_bidirectional_mask(
            config=part.config, inputs_embeds=hidden_BTH, attention_mask=pad_mask_BK
        )
        return {"mask": mask}

    def run_block(
        self,
        block: nn.Module,
        layer_idx: int,
        hidden_BTH: torch.Tensor,
        context: Mapping[str, Any],
        cache: Cache | None,
    ) -> torch.Tensor:
        return block(hidden_BTH, attention_mask=context["mask"])

    def ffn_input(
        self,
        block: nn.Module,
        layer_idx: int,
        hidden_BTH: torch.Tensor,
        context: Mapping[str, Any],
        cache: Cache | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Post-norm: the attention sublayer ends with its own add & norm; its output is both
        # the FFN's input and what the FFN's residual add adds back.
        attention_BTH, _ = block.attention(hidden_BTH, context["mask"], cache=cache)
        return attention_BTH, attention_BTH

    def ffn_output(self, block: nn.Module, proj_BTF: torch.Tensor) -> torch.Tensor:
        output = block.output
        return output.dropout(output.dense(block.intermediate.intermediate_act_fn(proj_BTF)))

    def add_residual(
        self, block: nn.Module, ffn_BTH: torch.Tensor, residual_BTH: torch.Tensor | None
    ) -> torch.Tensor:
        summed_BTH = ffn_BTH if residual_BTH is None else ffn_BTH + residual_BTH
        return block.output.LayerNorm(summed_BTH)

    def head(self, part: Part, hidden_BTH: torch.Tensor) -> torch.Tensor:
        pooled_BH = part.module("bert.pooler")(hidden_BTH)
        return part.module("classifier")(part.module("dropout")(pooled_BH))

    def labels(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return batch[LABELS]

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return classification_loss(logits, labels)
