"""What a ring stage computes per call: a model span with its own KV cache, or a model-free echo.

`PartCompute` runs a `splitlab.models.parts.Part` with one KV cache keyed by *global* block
index, and takes the absolute position of the call's first token from the ring frame, never from
the cache: a non-head stage never fills layer 0 of its cache, so reading the sequence length
there (the predecessor's bug) would restart its positions at 0 every step. After each call it
checks that every block it owns holds exactly `pos + T` cached tokens.

The block set is a list of global indices (`layer_ids`), so a migration can hand a block and its
KV layer to a neighbour between tokens: the receiver pre-stages fresh blocks (`stage_blocks`,
weights resident first) and then their KV (`stage_kv`), the donor exports KV (`export_kv`)
and keeps everything until `commit`, which swaps pointers on both sides; `drop_staged` undoes
a pre-stage on abort, and `release` frees what a commit dropped (references, empty_cache), timed apart.
`blocks_ms` is the time the last call spent inside the blocks (hooks around them), which the
adaptive planner separates from the fixed embedding/head cost.

`EchoCompute` is the model-free stand-in `tools/check_multinode.py` uses: the head turns a token
id into a hidden row, middle stages pass it on, and the tail answers `(id + 1) % vocab`.

Legend: B batch (1 in the ring), T tokens in this call, H hidden size, V vocabulary.

    .venv/bin/pytest tests/unit/test_infer_positions.py -q
"""

from __future__ import annotations

import gc
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from splitlab.errors import ProtocolError
from splitlab.models.plan import Span

if TYPE_CHECKING:
    from transformers.cache_utils import DynamicLayer

    from splitlab.models.parts import Part


def _kv_layer() -> DynamicLayer:
    """An empty KV layer; transformers is imported here, so an echo stage never loads it."""
    from transformers.cache_utils import DynamicLayer

    return DynamicLayer()


class StageCompute(Protocol):
    span: Span

    def forward(self, x: torch.Tensor, pos: int) -> torch.Tensor:
        """ids_BT (head) or hidden_BTH -> hidden_BTH, or logits_BV of the last token (tail)."""
        ...

    def kv_lengths(self) -> dict[int, int]:
        """Cached tokens per owned global block index."""
        ...


class PartCompute:
    """A model span plus its per-stage KV cache (see module docstring)."""

    def __init__(self, part: Part, *, device: str | torch.device = "cpu") -> None:
        self.part = part.to(device)
        self.span = part.span
        self.device = torch.device(device)
        self.cache = part.new_cache()
        self.layer_ids: list[int] = list(part.span.layer_ids)
        self.positions_seen: list[int] = []  # first position of every call (tests read it)
        self.blocks_ms = 0.0  # time the last call spent inside the blocks
        self._t_first: float | None = None
        self._t_last = 0.0
        self._hooks: dict[int, list[Any]] = {}
        self._staged_blocks: dict[int, nn.Module] = {}
        self._staged_kv: dict[int, Any] = {}
        self._dropped: list[Any] = []
        for i in self.layer_ids:
            self._hook(i)

    def reset(self) -> None:
        self.cache = self.part.new_cache()
        self.positions_seen.clear()

    @torch.inference_mode()
    def forward(self, x: torch.Tensor, pos: int) -> torch.Tensor:
        x = x.to(self.device)
        num_tokens = x.shape[1]
        pad_mask_BK = torch.ones(1, pos + num_tokens, dtype=torch.long, device=self.device)
        positions_BT = torch.arange(pos, pos + num_tokens, device=self.device).unsqueeze(0)
        self.positions_seen.append(pos)
        self._t_first = None
        out = self.part(x, pad_mask_BK, positions_BT, self.cache)
        self.blocks_ms = 0.0 if self._t_first is None else (self._t_last - self._t_first) * 1e3
        lengths = self.kv_lengths()
        if any(n != pos + num_tokens for n in lengths.values()):
            raise ProtocolError(
                f"stage blocks [{self.span.start}, {self.span.stop}): KV cache lengths {lengths} "
                f"after a call at pos={pos} with {num_tokens} tokens (expected {pos + num_tokens})"
            )
        if self.span.has_head:
            return out[:, -1, :]
        return out

    def kv_lengths(self) -> dict[int, int]:
        layers = self.cache.layers
        return {i: (layers[i].get_seq_length() if i < len(layers) else 0) for i in self.layer_ids}

    # --- migration (issue 8): a block and its KV layer move together between tokens ---------

    def _block(self, layer_idx: int) -> nn.Module:
        return self.part.get_submodule(self.part.adapter.block_path(layer_idx))

    def _hook(self, layer_idx: int) -> None:
        def pre(_module: nn.Module, _args: Any) -> None:
            if self._t_first is None:
                self._t_first = time.perf_counter()

        def post(_module: nn.Module, _args: Any, _out: Any) -> None:
            self._t_last = time.perf_counter()

        block = self._block(layer_idx)
        self._hooks[layer_idx] = [
            block.register_forward_pre_hook(pre),
            block.register_forward_hook(post),
        ]

    def _container(self) -> nn.Module:
        """The module holding the blocks (`model.layers`, ...): it stays when a commit takes
        every block away (`architecture.bypass`), so blocks can come back into it."""
        return self.part.get_submodule(self.part.adapter.block_path(0).rsplit(".", 1)[0])

    def take_block(self, layer_idx: int) -> tuple[nn.Module, Any]:
        """Block `layer_idx` and its KV layer (read-only view for tests and tools)."""
        return self._block(layer_idx), self.cache.layers[layer_idx]

    def bytes_per_token_kv(self) -> int:
        """KV bytes per cached token per block (2 x kv heads x head dim x dtype bytes)."""
        layers = self.cache.layers
        for i in self.layer_ids:
            if i < len(layers) and getattr(layers[i], "keys", None) is not None:
                k = layers[i].keys
                return 2 * k.shape[1] * k.shape[3] * k.element_size()
        return 0

    def export_kv(self, layer_ids: Sequence[int]) -> dict[str, torch.Tensor]:
        """The donor's KV of `layer_ids` (`k<i>`, `v<i>`: 1 x kv heads x T x head dim); no copy."""
        out: dict[str, torch.Tensor] = {}
        for i in layer_ids:
            if i not in self.layer_ids:
                raise ProtocolError(f"export_kv: block {i} is not on this stage {self.layer_ids}")
            layer = self.cache.layers[i]
            out[f"k{i}"], out[f"v{i}"] = layer.keys, layer.values
        return out

    def stage_blocks(self, blocks: Mapping[int, nn.Module]) -> None:
        """Pre-stage fresh blocks (moved to this stage's device); the live part is untouched."""
        for i, block in blocks.items():
            if i in self.layer_ids:
                raise ProtocolError(f"stage_blocks: block {i} is already on this stage")
            self._staged_blocks[i] = block.to(self.device)

    def stage_kv(self, tensors: Mapping[str, torch.Tensor], layer_ids: Sequence[int], *,
                 copy: bool = True) -> int:  # fmt: skip
        """Pre-stage received KV for `layer_ids` (copied, unless `copy=False` hands over
        tensors the caller owns); returns its bytes.

        The weights must already be resident: KV for a block that is not staged is refused.
        """
        nbytes = 0
        for i in layer_ids:
            if i not in self._staged_blocks:
                raise ProtocolError(f"stage_kv: block {i} has no resident weights yet")
            try:
                k, v = tensors[f"k{i}"], tensors[f"v{i}"]
            except KeyError:
                raise ProtocolError(f"stage_kv: no k{i}/v{i} among {sorted(tensors)}") from None
            layer = _kv_layer()
            k, v = k.to(self.device, copy=copy), v.to(self.device, copy=copy)
            layer.lazy_initialization(k, v)
            layer.keys, layer.values = k, v
            self._staged_kv[i] = layer
            nbytes += k.numel() * k.element_size() + v.numel() * v.element_size()
        return nbytes

    def drop_staged(self) -> None:
        """Abort: forget what was pre-staged (the live blocks and cache never changed)."""
        self._staged_blocks.clear()
        self._staged_kv.clear()

    def commit(self, start: int, stop: int) -> None:
        """Own blocks [start, stop): attach the staged blocks and KV, detach the given-away ones.

        Pointer swaps only; the detached modules and KV wait in `_dropped` for `release`.
        """
        new_ids = list(range(start, stop))
        added = [i for i in new_ids if i not in self.layer_ids]
        removed = [i for i in self.layer_ids if i not in new_ids]
        if sorted(added) != sorted(self._staged_blocks) or set(added) != set(self._staged_kv):
            raise ProtocolError(
                f"commit to blocks [{start}, {stop}) needs {added} staged, have weights "
                f"{sorted(self._staged_blocks)} and KV {sorted(self._staged_kv)}"
            )
        adapter = self.part.adapter
        container = self._container()
        cache = self.cache
        for i in removed:
            for handle in self._hooks.pop(i):
                handle.remove()
            self._dropped.append(container._modules.pop(str(i)))
            self._dropped.append(cache.layers[i])
            cache.layers[i] = _kv_layer()
        for i in added:
            container.add_module(str(i), self._staged_blocks.pop(i))
            while len(cache.layers) <= i:
                cache.layers.append(_kv_layer())
            cache.layers[i] = self._staged_kv.pop(i)
            self._hook(i)
        container._modules = dict(sorted(container._modules.items(), key=lambda kv: int(kv[0])))
        paths = [p for p in self.part.paths if p not in {adapter.block_path(i) for i in removed}]
        paths += [adapter.block_path(i) for i in added]
        self.part.paths = tuple(paths)
        self.span = replace(self.span, start=start, stop=stop)
        self.part.span = self.span
        self.layer_ids = new_ids
        self.check_cache_order()

    def check_cache_order(self) -> None:
        """The cache holds KV exactly for the owned blocks, all of one length, in block order."""
        lengths = self.kv_lengths()
        if len(set(lengths.values())) > 1:
            raise ProtocolError(f"after commit: unequal KV lengths {lengths}")
        stray = [
            i for i, layer in enumerate(self.cache.layers)
            if i not in self.layer_ids and layer.get_seq_length() > 0
        ]  # fmt: skip
        if stray:
            raise ProtocolError(f"after commit: KV left for blocks {stray} not on this stage")
        blocks = [int(name) for name in self._container()._modules]
        if blocks != self.layer_ids:
            raise ProtocolError(f"after commit: blocks {blocks} but the span is {self.layer_ids}")

    @property
    def release_pending(self) -> bool:
        return bool(self._dropped)

    def release(self) -> float:
        """Free what commits detached, then the device cache; returns the time it took (ms).

        Dropping the references frees a block and its KV by reference counting (a decoder
        block holds no cycle). A full `gc.collect` walks every object of the loaded model
        (~150 ms on a quiet 2-core host, over a second on a busy one) and, on a host where
        stages share cores, that lands on a neighbour's token path; it runs only when a
        dropped module outlived its references (a cycle in some other model family).
        Reported apart, never inside a shift's pause.
        """
        t0 = time.perf_counter()
        watch = [weakref.ref(m) for m in self._dropped if isinstance(m, nn.Module)]
        self._dropped.clear()
        if any(ref() is not None for ref in watch):
            gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return (time.perf_counter() - t0) * 1e3


class EchoCompute:
    """Model-free stage: exercises addressing, channels and parity without weights."""

    def __init__(self, span: Span, *, hidden_size: int = 8, vocab_size: int = 1000) -> None:
        self.span, self.hidden_size, self.vocab_size = span, hidden_size, vocab_size
        self._pos = 0

    def forward(self, x: torch.Tensor, pos: int) -> torch.Tensor:
        if pos != self._pos:
            raise ProtocolError(f"echo stage at position {self._pos} got a call at pos={pos}")
        if self.span.has_embeddings:
            x = x.to(torch.float32).unsqueeze(-1).expand(*x.shape, self.hidden_size).contiguous()
        self._pos = pos + x.shape[1]
        if self.span.has_head:
            last_id = int(x[0, -1, 0])
            logits = torch.full((1, self.vocab_size), -1.0)
            logits[0, (last_id + 1) % self.vocab_size] = 1.0
            return logits
        return x

    def kv_lengths(self) -> dict[int, int]:
        return {i: self._pos for i in self.span.layer_ids}

    blocks_ms = 0.0  # no blocks to time
