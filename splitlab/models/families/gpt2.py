"""The GPT-2 family adapter (causal LM, learned absolute positions, tied head).

Upstream layout: `transformer.wte`, `transformer.wpe`, `transformer.drop` (embeddings),
`transformer.h.N`, `transformer.ln_f`, `lm_head` (whose weight is `wte`'s). GPT-2 has no pad
token: the data side pads with EOS (50256) and the loss ignores padding by the mask, never by
token id.

    .venv/bin/pytest tests/equivalence/test_partition_equivalence.py -k gpt2
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedConfig, PreTrainedModel
from transformers.cache_utils import Cache
from transformers.masking_utils import create_causal_mask
from transformers.models.gpt2.modeling_gpt2 import GPT2Block

from splitlab.config.schema import ModelConfig
from splitlab.models.families.base import CausalLMAdapter

if TYPE_CHECKING:
    from splitlab.models.parts import Part

GPT2_EOS_ID = 50256  # end of text; also the pad id on the data side


class GPT2Adapter(CausalLMAdapter):
    name = "gpt2"
    model_types = frozenset({"gpt2"})
    ties_head = True  # GPT2Config's tie_word_embeddings default
    block_prefix = "transformer.h"
    embedding_paths = ("transformer.wte", "transformer.wpe", "transformer.drop")
    head_paths = ("transformer.ln_f", "lm_head")
    lora_targets = ("c_attn",)
    lora_fan_in_fan_out = True  # GPT-2 projections are Conv1D (weight stored in x out)
    ffn_in_paths = ("mlp.c_fc",)
    ffn_out_path = "mlp.c_proj"
    ffn_conv1d = True
    cut_sender_paths = ("ln_1", "attn", "ln_2")
    cut_receiver_paths = ("mlp.act", "mlp.c_proj", "mlp.dropout")
    dropout_keys = ("resid_pdrop", "embd_pdrop", "attn_pdrop", "summary_first_dropout")

    def make_config(self, cfg: ModelConfig) -> PreTrainedConfig:
        eos_id = min(GPT2_EOS_ID, cfg.vocab_size - 1)
        return GPT2Config(
            vocab_size=cfg.vocab_size,
            n_embd=cfg.hidden_size,
            n_layer=cfg.num_layers,
            n_head=cfg.num_heads,
            n_inner=cfg.intermediate_size,
            n_positions=cfg.max_position_embeddings,
            bos_token_id=eos_id,
            eos_token_id=eos_id,
        )

    def model_class(self, config: PreTrainedConfig) -> type[PreTrainedModel]:
        return GPT2LMHeadModel

    def block_factory(self, config: PreTrainedConfig, layer_idx: int) -> nn.Module:
        return GPT2Block(config, layer_idx=layer_idx)

    def tied_head(self, model: nn.Module) -> bool:
        return (
            model.get_submodule("lm_head").weight is model.get_submodule("transformer.wte").weight
        )

    def embed(
        self, part: Part, input_ids_BT: torch.Tensor, positions_BT: torch.Tensor
    ) -> torch.Tensor:
        hidden_BTH = part.module("transformer.wte")(input_ids_BT)
        hidden_BTH = hidden_BTH + part.module("transformer.wpe")(positions_BT)
        return part.module("transformer.drop")(hidden_BTH)

    def block_context(
        self,
        part: Part,
        hidden_BTH: torch.Tensor,
        pad_mask_BK: torch.Tensor,
        positions_BT: torch.Tensor,
        cache: Cache | None,
    ) -> dict[str, Any]:
        mask = create_causal_mask(
            **self.mask_kwargs(part, hidden_BTH, pad_mask_BK, positions_BT, cache)
        )
        return {"mask": mask, "positions": positions_BT}

    def run_block(
        self,
        block: nn.Module,
        layer_idx: int,
        hidden_BTH: torch.Tensor,
        context: Mapping[str, Any],
        cache: Cache | None,
    ) -> torch.Tensor:
        return block(
            hidden_BTH,
            cache=cache,
            attention_mask=context["mask"],
            use_cache=cache is not None,
            position_ids=context["positions"],
        )

    def ffn_input(
        self,
        block: nn.Module,
        layer_idx: int,
        hidden_BTH: torch.Tensor,
        context: Mapping[str, Any],
        cache: Cache | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        attn_BTH, _ = block.attn(
            block.ln_1(hidden_BTH),
            cache=cache,
            attention_mask=context["mask"],
            use_cache=cache is not None,
            position_ids=context["positions"],
        )
        residual_BTH = attn_BTH + hidden_BTH
        return block.ln_2(residual_BTH), residual_BTH

    def ffn_output(self, block: nn.Module, proj_BTF: torch.Tensor) -> torch.Tensor:
        mlp = block.mlp
        return mlp.dropout(mlp.c_proj(mlp.act(proj_BTF)))

    def head(self, part: Part, hidden_BTH: torch.Tensor) -> torch.Tensor:
        return part.module("lm_head")(part.module("transformer.ln_f")(hidden_BTH))
