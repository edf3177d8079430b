"""A move's KV in chunks along the positions, and put back together, refusing what is not the
next chunk of that move."""

from __future__ import annotations

import pytest
import torch

from splitlab.errors import ProtocolError
from splitlab.infer.kv_chunks import KvAssembly, chunk_of, chunk_spans


def _kv(layers: list[int], pos: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"{kv}{i}": torch.randn(1, 3, pos, 8, generator=g) for i in layers for kv in "kv"}


def test_spans_cover_the_positions_in_order_within_the_chunk_size() -> None:
    # 2 blocks x 2 x 3 heads x 8 dims x 4 B = 384 B a position; 1000 B: 2 positions a chunk
    spans = chunk_spans(7, 384, chunk_bytes=1000)
    assert spans == [(0, 2), (2, 2), (4, 2), (6, 1)]
    assert chunk_spans(7, 384, chunk_bytes=1 << 20) == [(0, 7)]
    assert chunk_spans(3, 4096, chunk_bytes=1000) == [(0, 1), (1, 1), (2, 1)]  # one at least
    assert chunk_spans(0, 384) == [(0, 0)]  # an empty move still sends one frame
    with pytest.raises(ValueError, match="pos"):
        chunk_spans(-1, 384)


def test_chunks_reassemble_to_the_move() -> None:
    kv = _kv([4, 5], pos=7)
    whole = KvAssembly([4, 5], pos=7)
    for at, n in chunk_spans(7, 384, chunk_bytes=1000):
        assert not whole.done
        whole.add({k: t.clone() for k, t in chunk_of(kv, at, n).items()}, at=at, n=n)
    assert whole.done and whole.chunks == 4
    assert all(torch.equal(whole.tensors[k], kv[k]) for k in kv)


def test_an_empty_move_is_done_after_its_one_frame() -> None:
    whole = KvAssembly([2], pos=0)
    whole.add(chunk_of(_kv([2], pos=0), 0, 0), at=0, n=0)
    assert whole.done and whole.tensors["k2"].shape == (1, 3, 0, 8)


@pytest.mark.parametrize(
    ("at", "n", "names", "shape", "match"),
    [
        (2, 2, ("k4", "v4"), (1, 3, 2, 8), "at position 2, expected 0"),
        (0, 9, ("k4", "v4"), (1, 3, 9, 8), "9 positions at 0: the move holds 7"),
        (0, 2, ("k4",), (1, 3, 2, 8), r"carries \['k4'\], expected \['k4', 'v4'\]"),
        (0, 2, ("k4", "v4"), (1, 3, 3, 8), "expected 4 dims with 2 positions"),
    ],
)
def test_a_chunk_that_is_not_the_next_of_the_move_is_refused(at, n, names, shape, match) -> None:  # noqa: ANN001
    whole = KvAssembly([4], pos=7)
    with pytest.raises(ProtocolError, match=match):
        whole.add({k: torch.zeros(shape) for k in names}, at=at, n=n)


def test_a_chunk_unlike_the_first_is_refused() -> None:
    whole = KvAssembly([4], pos=4)
    whole.add({k: torch.zeros(1, 3, 2, 8) for k in ("k4", "v4")}, at=0, n=2)
    with pytest.raises(ProtocolError, match="unlike the move's first chunk"):
        whole.add({k: torch.zeros(1, 3, 2, 8, dtype=torch.float16) for k in ("k4", "v4")},
                  at=2, n=2)  # fmt: skip
    with pytest.raises(ProtocolError, match="unlike the move's first chunk"):
        whole.add({k: torch.zeros(1, 2, 2, 8) for k in ("k4", "v4")}, at=2, n=2)
    assert not whole.done and whole.filled == 2
