"""The Llama family adapter: Llama, Qwen2 and SmolLM2 (causal LM, rotary positions).

Upstream layout: `model.embed_tokens`, `model.layers.N`, `model.norm`, `lm_head`,
`model.rotary_emb`. Every part with blocks carries its own rotary module and computes cos/sin
from the absolute positions it is given, so a stage in the middle of a ring rotates keys at the
true sequence offset. Qwen2's optional sliding-window layers get their own mask.

    .venv/bin/pytest tests/equivalence/test_partition_equivalence.py -k "llama or qwen2"
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedConfig,
    PreTrainedModel,
    Qwen2ForCausalLM,
)
from transformers.cache_utils import Cache
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.models.llama.modeling_llama import LlamaDecoderLayer
from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

from splitlab.config.schema import ModelConfig
from splitlab.models.families.base import CausalLMAdapter

if TYPE_CHECKING:
    from splitlab.models.parts import Part

_CLASSES: dict[str, tuple[type[PreTrainedModel], type[nn.Module]]] = {
    "llama": (LlamaForCausalLM, LlamaDecoderLayer),
    "qwen2": (Qwen2ForCausalLM, Qwen2DecoderLayer),
}
FULL = "full_attention"
SLIDING = "sliding_attention"


class LlamaAdapter(CausalLMAdapter):
    name = "llama"
    model_types = frozenset(_CLASSES)
    block_prefix = "model.layers"
    embedding_paths = ("model.embed_tokens",)
    head_paths = ("model.norm", "lm_head")
    lora_targets = ("q_proj", "v_proj")
    ffn_in_paths = ("mlp.gate_proj", "mlp.up_proj")
    ffn_out_path = "mlp.down_proj"
    cut_sender_paths = ("input_layernorm", "self_attn", "post_attention_layernorm")
    cut_receiver_paths = ("mlp.act_fn", "mlp.down_proj")
    dropout_keys = ("attention_dropout",)

    def make_config(self, cfg: ModelConfig) -> PreTrainedConfig:
        return LlamaConfig(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_hidden_layers=cfg.num_layers,
            num_attention_heads=cfg.num_heads,
            num_key_value_heads=cfg.num_kv_heads or cfg.num_heads,
            max_position_embeddings=cfg.max_position_embeddings,
        )

    def model_class(self, config: PreTrainedConfig) -> type[PreTrainedModel]:
        return _CLASSES[config.model_type][0]

    def block_factory(self, config: PreTrainedConfig, layer_idx: int) -> nn.Module:
        return _CLASSES[config.model_type][1](config, layer_idx)

    def tied_head(self, model: nn.Module) -> bool:
        return (
            model.get_submodule("lm_head").weight
            is model.get_submodule("model.embed_tokens").weight
        )

    def aux_modules(self, model: nn.Module) -> dict[str, nn.Module]:
        rotary = model.get_submodule("model.rotary_emb")
        if rotary.inv_freq.is_meta:
            # A meta skeleton (shard loader) has no rotary tables: they are not in the
            # checkpoint, so compute them from the config like the model's own __init__ does.
            return {"rotary": type(rotary)(config=model.config)}
        return {"rotary": copy.deepcopy(rotary)}

    def embed(
        self, part: Part, input_ids_BT: torch.Tensor, positions_BT: torch.Tensor
    ) -> torch.Tensor:
        return part.module("model.embed_tokens")(input_ids_BT)

    def block_context(
        self,
        part: Part,
        hidden_BTH: torch.Tensor,
        pad_mask_BK: torch.Tensor,
        positions_BT: torch.Tensor,
        cache: Cache | None,
    ) -> dict[str, Any]:
        config = part.config
        layer_types = getattr(config, "layer_types", None) or [FULL] * self.num_layers(config)
        mask_kwargs = self.mask_kwargs(part, hidden_BTH, pad_mask_BK, positions_BT, cache)
        masks = {FULL: create_causal_mask(**mask_kwargs)}
        if any(layer_types[i] == SLIDING for i in part.span.layer_ids):
            masks[SLIDING] = create_sliding_window_causal_mask(**mask_kwargs)
        return {
            "masks": masks,
            "layer_types": layer_types,
            "positions": positions_BT,
            "rotary": part.aux["rotary"](hidden_BTH, position_ids=positions_BT),
        }

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
            attention_mask=context["masks"][context["layer_types"][layer_idx]],
            position_ids=context["positions"],
            cache=cache,
            use_cache=cache is not None,
            position_embeddings=context["rotary"],
        )

    def ffn_input(
        self,
        block: nn.Module,
        layer_idx: int,
        hidden_BTH: torch.Tensor,
        context: Mapping[str, Any],
        cache: Cache | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        attn_BTH, _ = block.self_attn(
            hidden_states=block.input_layernorm(hidden_BTH),
            attention_mask=context["masks"][context["layer_types"][layer_idx]],
            position_ids=context["positions"],
            cache=cache,
            use_cache=cache is not None,
            position_embeddings=context["rotary"],
        )
        residual_BTH = hidden_BTH + attn_BTH
        return block.post_attention_layernorm(residual_BTH), residual_BTH

    def ffn_output(self, block: nn.Module, proj_BTF: torch.Tensor) -> torch.Tensor:
        # One shared code feeds both projections: proj is [gate | up] along the last dim.
        gate_BTF, up_BTF = proj_BTF.chunk(2, dim=-1)
        return block.mlp.down_proj(block.mlp.act_fn(gate_BTF) * up_BTF)

    def head(self, part: Part, hidden_BTH: torch.Tensor) -> torch.Tensor:
        return part.module("lm_head")(part.module("model.norm")(hidden_BTH))
