"""Cut a loaded, unmodified transformers model into parts that share its parameters.

A `Part` holds only the modules its `Span` owns (embeddings, blocks, final norm and head),
attached under their upstream paths, so `part.state_dict()` has the original checkpoint keys
and a part built from a meta skeleton can be filled with `load_state_dict(..., assign=True)`.
Nothing is copied: in U-shape the owner's front and tail reference the same embedding tensor
that a tied head uses, so its gradient accumulates from both ends exactly as in one model.

Between parts only `hidden_BTH`, the padding mask and positions travel; each part rebuilds its
attention mask (and rotary cos/sin) itself.

Legend: B batch, T tokens in this call, K = past + T tokens, H hidden size, V vocabulary.

    .venv/bin/pytest tests/equivalence/test_partition_equivalence.py
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import nn
from transformers import PreTrainedConfig
from transformers.cache_utils import Cache

from splitlab.errors import ConfigError
from splitlab.models.families import FamilyAdapter, family_for_model
from splitlab.models.plan import PartitionPlan, Span


def _attach(root: nn.Module, path: str, module: nn.Module) -> None:
    """Register `module` under dotted `path`, creating empty containers along the way."""
    *parents, leaf = path.split(".")
    node = root
    for name in parents:
        child = node._modules.get(name)
        if child is None:
            child = nn.Module()
            node.add_module(name, child)
        node = child
    node.add_module(leaf, module)


class PartGroup(nn.Module):
    """Several modules of one model under their upstream paths (one parameter per tensor).

    `state_dict()` keys are the original checkpoint keys; `parameters()` yields a tied tensor
    once. Used for a U-shape owner (front + tail) and as the base of `Part`.
    """

    def __init__(self, modules: Mapping[str, nn.Module]) -> None:
        super().__init__()
        for path, module in modules.items():
            _attach(self, path, module)
        self.paths: tuple[str, ...] = tuple(modules)


class Part(PartGroup):
    """The modules of one `Span` and the forward that runs them.

    Attributes:
        adapter: the family adapter that knows how to run these modules.
        config: the model's transformers config (dimensions, attention implementation).
        span: the blocks and ends this part owns.
        aux: parameter-free helpers this part needs its own copy of (Llama: rotary tables).
    """

    def __init__(
        self,
        *,
        adapter: FamilyAdapter,
        config: PreTrainedConfig,
        span: Span,
        modules: Mapping[str, nn.Module],
        aux: Mapping[str, nn.Module] | None = None,
    ) -> None:
        super().__init__(modules)
        self.adapter = adapter
        self.config = config
        self.span = span
        self.aux = nn.ModuleDict(dict(aux or {}))

    def module(self, path: str) -> nn.Module:
        """The module at upstream `path` (e.g. `model.embed_tokens`)."""
        return self.get_submodule(path)

    @property
    def blocks(self) -> list[nn.Module]:
        """This part's blocks in execution order (looked up each time: LoRA/SFT may wrap them)."""
        return [self.get_submodule(self.adapter.block_path(i)) for i in self.span.layer_ids]

    def new_cache(self) -> Cache:
        """An empty KV cache for this part's blocks (indexed by global block index)."""
        return self.adapter.new_cache(self.config)

    def forward(
        self,
        x: torch.Tensor,
        pad_mask_BK: torch.Tensor,
        positions_BT: torch.Tensor,
        cache: Cache | None = None,
    ) -> torch.Tensor:
        """Run this span.

        Args:
            x: token ids B x T (if the span has the embeddings) or hidden_BTH.
            pad_mask_BK: 1 = real token, over past + this call (K = T without a cache).
            positions_BT: absolute positions of this call's tokens (see
                `splitlab.models.tokens.positions_from_pad_mask`); never restarted per part.
            cache: this part's KV cache (decode); None for training.

        Returns:
            logits if the span has the head, else hidden_BTH.
        """
        hidden_BTH = self.adapter.embed(self, x, positions_BT) if self.span.has_embeddings else x
        if self.span.num_blocks:
            context = self.adapter.block_context(self, hidden_BTH, pad_mask_BK, positions_BT, cache)
            for layer_idx, block in zip(self.span.layer_ids, self.blocks, strict=True):
                hidden_BTH = self.adapter.run_block(block, layer_idx, hidden_BTH, context, cache)
        if self.span.has_head:
            return self.adapter.head(self, hidden_BTH)
        return hidden_BTH

    def extra_repr(self) -> str:
        span = self.span
        return (
            f"family={self.adapter.name}, blocks=[{span.start}, {span.stop}), "
            f"embeddings={span.has_embeddings}, head={span.has_head}"
        )


def part_modules(adapter: FamilyAdapter, model: nn.Module, span: Span) -> dict[str, nn.Module]:
    """Upstream path -> module for everything `span` owns in `model`."""
    paths: list[str] = []
    if span.has_embeddings:
        paths.extend(adapter.embedding_paths)
    paths.extend(adapter.block_path(i) for i in span.layer_ids)
    if span.has_head:
        paths.extend(adapter.head_paths)
    return {path: model.get_submodule(path) for path in paths}


def build_part(model: nn.Module, span: Span, *, adapter: FamilyAdapter | None = None) -> Part:
    """One part of `model` sharing its parameters (no copies).

    Raises:
        ConfigError: the span reaches past the model's blocks.
    """
    adapter = adapter or family_for_model(model)
    config = model.config
    num_layers = adapter.num_layers(config)
    if span.stop > num_layers:
        raise ConfigError(
            f"partition needs blocks [{span.start}, {span.stop}) but the loaded model has "
            f"num_layers={num_layers}"
        )
    aux = adapter.aux_modules(model) if span.num_blocks else {}
    return Part(
        adapter=adapter,
        config=config,
        span=span,
        modules=part_modules(adapter, model, span),
        aux=aux,
    )


def build_parts(
    model: nn.Module, plan: PartitionPlan, *, adapter: FamilyAdapter | None = None
) -> tuple[Part, ...]:
    """The plan's parts in forward order: (front, body, tail) or (front, rest) for two-stage.

    Raises:
        ConfigError: the plan and the loaded model disagree on the number of blocks.
    """
    adapter = adapter or family_for_model(model)
    num_layers = adapter.num_layers(model.config)
    if plan.num_layers != num_layers:
        raise ConfigError(
            f"model.num_layers={plan.num_layers} in the plan but the loaded model has {num_layers}"
        )
    return tuple(build_part(model, span, adapter=adapter) for span in plan.spans)


def build_stages(
    model: nn.Module, spans: Sequence[Span], *, adapter: FamilyAdapter | None = None
) -> list[Part]:
    """Ring stages (from `splitlab.models.plan.ring_plan`), each with its own rotary copy."""
    adapter = adapter or family_for_model(model)
    return [build_part(model, span, adapter=adapter) for span in spans]


def group(parts: Iterable[Part]) -> PartGroup:
    """The union of several parts' modules under upstream paths (e.g. a U-shape owner).

    Its `state_dict()` is the owner's share of the checkpoint with original keys, and its
    `parameters()` yields a tied embedding/head tensor once (one optimizer entry).
    """
    modules: dict[str, nn.Module] = {}
    for part in parts:
        for path in part.paths:
            modules[path] = part.get_submodule(path)
    return PartGroup(modules)


def tied_keys(model: nn.Module) -> dict[str, str]:
    """Parameter names that alias an earlier parameter: `{"lm_head.weight": "model.embed_tokens.weight"}`.

    `save_pretrained` writes a tied tensor once, under the first name, so a shard loader filling
    a part that owns the head but not the embeddings reads the alias's source key instead.
    """
    first_name: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        source = first_name.setdefault(id(param), name)
        if source != name:
            aliases[name] = source
    return aliases


def shared_across(parts: Sequence[Part]) -> list[tuple[tuple[int, str], tuple[int, str]]]:
    """Tensors that two different parts hold, as ((part index, name), (part index, name)).

    In U-shape a tied embedding/head is shared by front and tail, both on the owner: one
    tensor, one gradient, nothing to do. In two-stage (front | rest + head) it is shared by
    parts on different processes, whose two gradients the caller must combine (or untie).
    """
    owner: dict[int, tuple[int, str]] = {}
    shared = []
    for index, part in enumerate(parts):
        for name, param in part.named_parameters():
            first = owner.setdefault(id(param), (index, name))
            if first[0] != index:
                shared.append((first, (index, name)))
    return shared
