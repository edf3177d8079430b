"""A migrating move's KV in frames a slow link carries within the barrier's timeout.

A move's KV (`k<i>`, `v<i>` per block, 1 x kv heads x pos x head dim) crosses as consecutive
chunks along the position axis, each at most `KV_CHUNK_BYTES` of tensor bytes; the receiver
puts them back together (`KvAssembly`), checking that each is the next one. Why: a transport
reads a frame it has started to its end, so a receiver checks its deadline only between
frames, and one frame's crossing time is how far past its deadline a slow link can hold it.
A one-block SmolLM2 move's KV (~430 KB, one frame) took ~70 s at the ~0.05 Mbit/s of
`link_degrade`'s end on `ring3_edge`: the receiver could not NACK, and the head gave it up
as lost. 32 KiB is ~5 s at that rate, inside the second timeout the head waits for an
answer (`splitlab.infer.window.ANSWER_TIMEOUTS`), and ~30 us of framing on loopback.

    .venv/bin/pytest tests/unit/test_kv_chunks.py -q
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from splitlab.errors import ProtocolError

KV_CHUNK_BYTES = 32 << 10
POS_DIM = 2  # k/v tensors are 1 x kv heads x positions x head dim


def chunk_spans(pos: int, bytes_per_token: int, chunk_bytes: int | None = None) -> list[tuple[int, int]]:  # fmt: skip
    """(first position, positions) of each chunk of a move's KV; `bytes_per_token` is the
    move's KV bytes per position (all its blocks, k and v), `chunk_bytes` defaults to
    `KV_CHUNK_BYTES`. At least one chunk, empty at pos 0; a position larger than
    `chunk_bytes` travels alone."""
    chunk_bytes = KV_CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    if pos < 0:
        raise ValueError(f"pos must be >= 0, got {pos}")
    if pos == 0:
        return [(0, 0)]
    step = max(1, chunk_bytes // max(1, bytes_per_token))
    return [(at, min(step, pos - at)) for at in range(0, pos, step)]


def chunk_of(kv: Mapping[str, torch.Tensor], at: int, n: int) -> dict[str, torch.Tensor]:
    """The positions [at, at + n) of every tensor of a move's KV (views, no copy)."""
    return {name: t.narrow(POS_DIM, at, n) for name, t in kv.items()}


class KvAssembly:
    """A move's KV put back together from its chunks (fresh tensors, owned by the caller).

    `add` raises ProtocolError naming what is wrong with a chunk: not the next positions,
    past `pos`, missing or unexpected tensors, or a shape or dtype unlike the first chunk's.
    """

    def __init__(self, layer_ids: Sequence[int], pos: int) -> None:
        self.pos = pos
        self.names = [f"{kv}{i}" for i in layer_ids for kv in ("k", "v")]
        self.tensors: dict[str, torch.Tensor] = {}
        self.filled = 0
        self.chunks = 0

    @property
    def done(self) -> bool:
        return self.chunks > 0 and self.filled == self.pos

    def add(self, tensors: Mapping[str, torch.Tensor], *, at: int, n: int) -> None:
        if at != self.filled:
            raise ProtocolError(f"KV chunk at position {at}, expected {self.filled}")
        if n < 0 or at + n > self.pos or (n == 0 and self.pos > 0):
            raise ProtocolError(f"KV chunk of {n} positions at {at}: the move holds {self.pos}")
        if sorted(tensors) != sorted(self.names):
            raise ProtocolError(
                f"KV chunk carries {sorted(tensors)}, expected {sorted(self.names)}"
            )
        for name in self.names:
            t = tensors[name]
            if t.dim() != 4 or t.shape[POS_DIM] != n:
                raise ProtocolError(
                    f"KV chunk {name}: shape {list(t.shape)}, expected 4 dims with {n} positions"
                )
            whole = self.tensors.get(name)
            if whole is None:
                shape = (*t.shape[:POS_DIM], self.pos, *t.shape[POS_DIM + 1 :])
                whole = self.tensors[name] = torch.empty(shape, dtype=t.dtype)
            elif t.dtype != whole.dtype or _but_pos(t) != _but_pos(whole):
                raise ProtocolError(
                    f"KV chunk {name}: {t.dtype} {list(t.shape)} unlike the move's first "
                    f"chunk ({whole.dtype} {list(whole.shape)})"
                )
            whole.narrow(POS_DIM, at, n).copy_(t)
        self.filled += n
        self.chunks += 1


def _but_pos(t: torch.Tensor) -> tuple[int, ...]:
    return (*t.shape[:POS_DIM], *t.shape[POS_DIM + 1 :])
