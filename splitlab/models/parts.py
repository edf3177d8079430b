"""Cut a loaded, unmodified transformers model into parts that share its parameters.

A `Part` holds only the modules its `Span` owns (embeddings, blocks, final norm and head),
attached under their upstream paths, so `part.state_dict()` has the original checkpoint keys
and a part built from a meta skeleton can be filled with `load_state_dict(..., assign=True)`.
Nothing is copied: in U-shape the owner's front and tail reference the same embedding tensor
that a tied head uses, so its gradient accumulates from both ends exactly as in one model.

Between parts only `hidden_BTH`, the padding mask and positions travel; each part rebuilds its
attention mask (and rotary cos/sin) itself. At a low-rank cut (`Span.code_out` on the sender,
`Span.code_in` on the receiver, see `splitlab.models.lowrank`) the sender's last block stops at
its FFN's R-dim code and the part returns the named tensors that cross instead:
`{"code_BTR": ...}` (residual drop) or `{"code_BTR": ..., "residual_BTH": ...}` (keep); the
receiver takes that mapping as `x`, finishes the block and runs on. Each side of a cut block
holds only its own submodules (`FamilyAdapter.cut_sender_paths` / `cut_receiver_paths`).

Legend: B batch, T tokens in this call, K = past + T tokens, H hidden size, V vocabulary,
R rank of a low-rank cut.

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
from splitlab.models.plan import CutSpec, PartitionPlan, Span

HIDDEN = "hidden_BTH"  # what crosses an ordinary cut
CODE = "code_BTR"  # the low-rank code at a low-rank cut
RESIDUAL = "residual_BTH"  # the residual stream at a low-rank cut with residual=keep
LOWRANK_IN = "lowrank_in"  # submodule of the decomposed projection on the sending side
LOWRANK_OUT = "lowrank_out"  # ... and on the receiving side


def crossing_names(cut: CutSpec | None) -> tuple[str, ...]:
    """What crosses a boundary between parts: hidden_BTH, or the code (+ residual with keep)."""
    if cut is None:
        return (HIDDEN,)
    return (CODE, RESIDUAL) if cut.keeps_residual else (CODE,)


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

    @property
    def sends(self) -> tuple[str, ...]:
        """Names of the tensors `forward` returns to the next part (empty: it returns logits)."""
        if self.span.has_head:
            return ()
        return crossing_names(self.span.code_out)

    @property
    def receives(self) -> tuple[str, ...]:
        """Names of the tensors `forward` takes from the previous part (empty: token ids)."""
        if self.span.has_embeddings:
            return ()
        return crossing_names(self.span.code_in)

    def input_of(
        self, crossing: Mapping[str, torch.Tensor]
    ) -> torch.Tensor | Mapping[str, torch.Tensor]:
        """What `forward` takes from a received crossing (its `receives` tensors): the mapping
        itself after a low-rank cut, else the hidden state."""
        return crossing if self.span.code_in is not None else crossing[HIDDEN]

    def forward(
        self,
        x: torch.Tensor | Mapping[str, torch.Tensor],
        pad_mask_BK: torch.Tensor,
        positions_BT: torch.Tensor,
        cache: Cache | None = None,
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """Run this span.

        Args:
            x: token ids B x T (if the span has the embeddings), hidden_BTH, or (after a
                low-rank cut) the mapping of `receives` names to tensors.
            pad_mask_BK: 1 = real token, over past + this call (K = T without a cache).
            positions_BT: absolute positions of this call's tokens (see
                `splitlab.models.tokens.positions_from_pad_mask`); never restarted per part.
            cache: this part's KV cache (decode); None for training.

        Returns:
            logits if the span has the head; the `sends` mapping if it ends at a low-rank cut;
            else hidden_BTH.
        """
        span, adapter = self.span, self.adapter
        if span.code_in is not None:
            assert isinstance(x, Mapping), "a part after a low-rank cut takes the crossing tensors"
            hidden_BTH = self._finish_cut(span.code_in, x)
        elif span.has_embeddings:
            hidden_BTH = adapter.embed(self, x, positions_BT)
        else:
            hidden_BTH = x
        if span.num_blocks:
            context = adapter.block_context(self, hidden_BTH, pad_mask_BK, positions_BT, cache)
            for layer_idx, block in zip(span.layer_ids, self.blocks, strict=True):
                if span.code_out is not None and layer_idx == span.code_out.block:
                    return self._start_cut(span.code_out, block, hidden_BTH, context, cache)
                hidden_BTH = adapter.run_block(block, layer_idx, hidden_BTH, context, cache)
        if span.has_head:
            return adapter.head(self, hidden_BTH)
        return hidden_BTH

    def _start_cut(
        self,
        cut: CutSpec,
        block: nn.Module,
        hidden_BTH: torch.Tensor,
        context: Mapping[str, object],
        cache: Cache | None,
    ) -> dict[str, torch.Tensor]:
        ffn_in_BTH, residual_BTH = self.adapter.ffn_input(
            block, cut.block, hidden_BTH, context, cache
        )
        lowrank_in = block.get_submodule(f"{self.adapter.ffn_in_paths[0]}.{LOWRANK_IN}")
        out = {CODE: lowrank_in(ffn_in_BTH)}
        if cut.keeps_residual:
            out[RESIDUAL] = residual_BTH
        return out

    def _finish_cut(self, cut: CutSpec, crossing: Mapping[str, torch.Tensor]) -> torch.Tensor:
        block = self.get_submodule(self.adapter.block_path(cut.block))
        lowrank_out = block.get_submodule(f"{self.adapter.ffn_in_paths[0]}.{LOWRANK_OUT}")
        ffn_BTH = self.adapter.ffn_output(block, lowrank_out(crossing[CODE]))
        residual_BTH = crossing[RESIDUAL] if cut.keeps_residual else None
        return self.adapter.add_residual(block, ffn_BTH, residual_BTH)

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
    if span.code_in is not None:
        paths.extend(cut_paths(adapter, model, span.code_in, sender=False))
    for i in span.layer_ids:
        if span.code_out is not None and i == span.code_out.block:
            paths.extend(cut_paths(adapter, model, span.code_out, sender=True))
        else:
            paths.append(adapter.block_path(i))
    if span.has_head:
        paths.extend(adapter.head_paths)
    return {path: model.get_submodule(path) for path in paths}


def cut_paths(adapter: FamilyAdapter, model: nn.Module, cut: CutSpec, *, sender: bool) -> list[str]:
    """Upstream paths of the cut block's submodules on one side of its low-rank code.

    Raises:
        ConfigError: the block is not decomposed at rank `cut.rank` (see
            `splitlab.models.lowrank.decompose_plan`).
    """
    block_path = adapter.block_path(cut.block)
    projection = f"{block_path}.{adapter.ffn_in_paths[0]}"
    try:
        lowrank_in = model.get_submodule(f"{projection}.{LOWRANK_IN}")
    except AttributeError:
        lowrank_in = None
    if lowrank_in is None or lowrank_in.out_features != cut.rank:
        raise ConfigError(
            f"low-rank cut at block {cut.block} (finetune.sft.rank={cut.rank}): {projection} is "
            "not decomposed at that rank; call splitlab.models.lowrank.decompose_plan first"
        )
    if sender:
        return [f"{block_path}.{p}" for p in adapter.cut_sender_paths] + [
            f"{projection}.{LOWRANK_IN}"
        ]
    return [f"{projection}.{LOWRANK_OUT}"] + [
        f"{block_path}.{p}" for p in adapter.cut_receiver_paths
    ]


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
