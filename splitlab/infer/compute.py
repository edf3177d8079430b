"""What a ring stage computes per call: a model span with its own KV cache, or a model-free echo.

`PartCompute` runs a `splitlab.models.parts.Part` with one KV cache keyed by *global* block
index, and takes the absolute position of the call's first token from the ring frame, never from
the cache: a non-head stage never fills layer 0 of its cache, so reading the sequence length
there (the predecessor's bug) would restart its positions at 0 every step. After each call it
checks that every block it owns holds exactly `pos + T` cached tokens.

The block set is a list of global indices (`layer_ids`), so a later migration can hand a block
and its KV layer to a neighbour between tokens (`take_block` / `install_block`).

`EchoCompute` is the model-free stand-in `tools/check_multinode.py` uses: the head turns a token
id into a hidden row, middle stages pass it on, and the tail answers `(id + 1) % vocab`.

Legend: B batch (1 in the ring), T tokens in this call, H hidden size, V vocabulary.

    .venv/bin/pytest tests/unit/test_infer_positions.py -q
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from splitlab.errors import ProtocolError
from splitlab.models.parts import Part
from splitlab.models.plan import Span


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
        out = self.part(x, pad_mask_BK, positions_BT, self.cache)
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

    # --- migration hooks (issue 8): a block and its KV layer move together between tokens ---

    def take_block(self, layer_idx: int) -> tuple[nn.Module, Any]:
        """Detach block `layer_idx` and its KV layer (the donor side); caller re-plans the span."""
        block = self.part.get_submodule(self.part.adapter.block_path(layer_idx))
        return block, self.cache.layers[layer_idx]

    def bytes_per_token_kv(self) -> int:
        """KV bytes per cached token per block (2 x kv heads x head dim x dtype bytes)."""
        layers = self.cache.layers
        for i in self.layer_ids:
            if i < len(layers) and getattr(layers[i], "keys", None) is not None:
                k = layers[i].keys
                return 2 * k.shape[1] * k.shape[3] * k.element_size()
        return 0


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
