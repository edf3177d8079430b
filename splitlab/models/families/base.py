"""The family adapter contract: everything splitlab needs to know about one model family.

A family adapter maps an *unmodified* transformers model onto splitlab's vocabulary: which
module paths are the embeddings, the blocks and the head; how to run one block given a padding
mask and positions (rebuilding the attention mask and, for rotary models, the cos/sin on the
part itself); how to compute the loss from the batch; and which modules LoRA targets. Parts,
schedulers and the ring only talk to this interface, so a new family is one subclass plus one
`register_family` call.

Legend: B batch, T tokens in this call, K = past + T tokens, H hidden size, V vocabulary /
number of classes.

    .venv/bin/pytest tests/equivalence/test_partition_equivalence.py
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn
from transformers import PreTrainedConfig, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache

from splitlab.config.enums import TaskKind
from splitlab.config.schema import ModelConfig
from splitlab.models.tokens import causal_lm_labels, causal_lm_loss

if TYPE_CHECKING:
    from splitlab.models.parts import Part

# Batch keys every data pipeline produces (the label key is per family, see `label_key`).
INPUT_IDS = "input_ids"  # B x T long token ids
PAD_MASK = "attention_mask"  # B x T, 1 = real token, 0 = padding
LABELS = "labels"  # B long class ids (classification)


class FamilyAdapter(ABC):
    """Structure, forward pieces and loss of one model family.

    Class attributes describe the upstream module layout with the upstream names, so partition
    state dicts keep the original checkpoint keys (`model.layers.3.mlp.up_proj.weight`).
    """

    name: ClassVar[str]  # registry key, e.g. "llama"
    task: ClassVar[TaskKind]  # what the model's head computes
    label_key: ClassVar[str]  # batch key the loss reads its targets from
    model_types: ClassVar[frozenset[str]]  # accepted `config.model_type` values
    block_prefix: ClassVar[str]  # path of the block list, e.g. "model.layers"
    embedding_paths: ClassVar[tuple[str, ...]]  # modules the first part runs before block 0
    head_paths: ClassVar[tuple[str, ...]]  # modules the last part runs after the last block
    lora_targets: ClassVar[tuple[str, ...]]  # default LoRA target module names
    lora_fan_in_fan_out: ClassVar[bool] = False  # True where the targets are GPT-2 Conv1D
    ties_head: ClassVar[bool] = False  # a random-init model's head is its embedding tensor
    ffn_in_paths: ClassVar[tuple[str, ...]]  # FFN input projections inside a block (SFT cut)
    ffn_out_path: ClassVar[str]  # FFN output projection inside a block
    ffn_conv1d: ClassVar[bool] = False  # True where the FFN projections are GPT-2 Conv1D
    # Low-rank cut (splitlab.models.lowrank): block submodules on each side of the R-dim code,
    # besides `<ffn_in_paths[0]>.lowrank_in` (sender) and `.lowrank_out` (receiver).
    cut_sender_paths: ClassVar[tuple[str, ...]] = ()
    cut_receiver_paths: ClassVar[tuple[str, ...]] = ()
    dropout_keys: ClassVar[tuple[str, ...]]  # config attributes that are dropout probabilities

    # --- building and loading ----------------------------------------------------------------

    @abstractmethod
    def make_config(self, cfg: ModelConfig) -> PreTrainedConfig:
        """A transformers config with the dimensions in `cfg` (random init)."""

    @abstractmethod
    def model_class(self, config: PreTrainedConfig) -> type[PreTrainedModel]:
        """The transformers class (with head) that this family loads for `config`."""

    @abstractmethod
    def block_factory(self, config: PreTrainedConfig, layer_idx: int) -> nn.Module:
        """A freshly initialised block `layer_idx` (the shard loader fills it from safetensors)."""

    def num_layers(self, config: PreTrainedConfig) -> int:
        return int(config.num_hidden_layers)

    def hidden_size(self, config: PreTrainedConfig) -> int:
        return int(config.hidden_size)

    def set_dropout(self, config: PreTrainedConfig, p: float) -> None:
        """Override every dropout probability in `config` (before the model is built)."""
        for key in self.dropout_keys:
            if hasattr(config, key):
                setattr(config, key, p)

    def block_path(self, layer_idx: int) -> str:
        return f"{self.block_prefix}.{layer_idx}"

    def tied_head(self, model: nn.Module) -> bool:
        """Whether the head's weight is the embedding tensor itself (GPT-2, SmolLM2)."""
        return False

    def aux_modules(self, model: nn.Module) -> dict[str, nn.Module]:
        """Parameter-free helpers every part with blocks needs its own copy of (rotary tables)."""
        return {}

    # --- forward pieces, called by `Part.forward` ---------------------------------------------

    @abstractmethod
    def embed(
        self, part: Part, input_ids_BT: torch.Tensor, positions_BT: torch.Tensor
    ) -> torch.Tensor:
        """Token ids -> hidden_BTH (including any position embeddings and embedding dropout)."""

    @abstractmethod
    def block_context(
        self,
        part: Part,
        hidden_BTH: torch.Tensor,
        pad_mask_BK: torch.Tensor,
        positions_BT: torch.Tensor,
        cache: Cache | None,
    ) -> dict[str, Any]:
        """What every block of this call shares: attention mask(s) rebuilt here, rotary cos/sin."""

    @abstractmethod
    def run_block(
        self,
        block: nn.Module,
        layer_idx: int,
        hidden_BTH: torch.Tensor,
        context: Mapping[str, Any],
        cache: Cache | None,
    ) -> torch.Tensor:
        """One block forward; `cache` (if any) is indexed by the global `layer_idx`."""

    # --- a block cut inside its FFN (low-rank cut), called by `Part.forward` --------------------

    def ffn_input(
        self,
        block: nn.Module,
        layer_idx: int,
        hidden_BTH: torch.Tensor,
        context: Mapping[str, Any],
        cache: Cache | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The block up to its FFN's first projection: (ffn_input_BTH, residual_BTH).

        `residual_BTH` is what the FFN's residual add adds back. `block` may be a container
        holding only `cut_sender_paths` (a part on the sending side of a cut).
        """
        raise NotImplementedError(f"model family {self.name!r} does not support low-rank cuts")

    def ffn_output(self, block: nn.Module, proj_BTF: torch.Tensor) -> torch.Tensor:
        """The FFN after its first projection (activation, gating, output projection, dropout);
        `proj_BTF` is the projection's output (gated families: gate and up concatenated)."""
        raise NotImplementedError(f"model family {self.name!r} does not support low-rank cuts")

    def add_residual(
        self, block: nn.Module, ffn_BTH: torch.Tensor, residual_BTH: torch.Tensor | None
    ) -> torch.Tensor:
        """The block's end: the FFN's residual add; None = dropped. This default is the pre-norm
        block's `residual + ffn` (GPT-2, Llama); post-norm families add their norm."""
        return ffn_BTH if residual_BTH is None else residual_BTH + ffn_BTH

    @abstractmethod
    def head(self, part: Part, hidden_BTH: torch.Tensor) -> torch.Tensor:
        """Final norm + head: logits B x T x V (causal LM) or B x V (classification)."""

    def new_cache(self, config: PreTrainedConfig) -> Cache:
        """An empty KV cache for one part; layers are created lazily at their global index."""
        return DynamicCache()

    # --- loss ----------------------------------------------------------------------------------

    @abstractmethod
    def labels(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The loss targets for a batch with `input_ids`, `attention_mask` (and `labels`)."""

    @abstractmethod
    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean loss of this batch (what the unsplit model returns for the same labels)."""


class CausalLMAdapter(FamilyAdapter):
    """Shared by decoder-only families: next-token loss on the ids, padding read from the mask."""

    task = TaskKind.causal_lm
    label_key = INPUT_IDS

    def mask_kwargs(
        self,
        part: Part,
        hidden_BTH: torch.Tensor,
        pad_mask_BK: torch.Tensor,
        positions_BT: torch.Tensor,
        cache: Cache | None,
    ) -> dict[str, Any]:
        """Arguments for transformers' public `create_*causal_mask` functions on this part."""
        return {
            "config": part.config,
            "inputs_embeds": hidden_BTH,
            "attention_mask": pad_mask_BK,
            "cache": cache,
            "position_ids": positions_BT,
            # The part's cache holds only its own layers, at their global indices.
            "layer_idx": part.span.start,
        }

    def labels(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return causal_lm_labels(batch[INPUT_IDS], batch[PAD_MASK])

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return causal_lm_loss(logits, labels)
