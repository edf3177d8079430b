"""Length bucketing: microbatches of similar lengths, in a seeded order.

A batch pads to its own longest row, so mixing a 10-token and a 60-token review wastes most of
the batch on pads. `bucket_batches` shuffles the positions, cuts them into chunks of
`chunk_batches` batches, sorts each chunk by length, cuts the chunk into batches and finally
shuffles the batch order: batches hold similar lengths while which examples meet, and the order
batches arrive in, stay random (seeded).

    .venv/bin/pytest tests/unit/test_data_buckets.py
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

CHUNK_BATCHES = 32  # batches per sorted chunk: larger = tighter lengths, less randomness


def bucket_batches(
    lengths: Sequence[int],
    batch_size: int,
    seed: int,
    *,
    bucket: bool = True,
    chunk_batches: int = CHUNK_BATCHES,
) -> list[list[int]]:
    """Positions 0..len(lengths)-1 grouped into batches of at most `batch_size`.

    Args:
        lengths: tokens per example.
        batch_size: rows per batch; only the last batch of a chunk may be short.
        seed: the only source of randomness.
        bucket: False gives plain shuffled batches.
        chunk_batches: how many batches' worth of examples are sorted together.
    """
    if batch_size < 1 or chunk_batches < 1:
        raise ValueError(
            f"batch_size and chunk_batches must be >= 1: {batch_size}, {chunk_batches}"
        )
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(lengths))
    if not bucket:
        return [order[i : i + batch_size].tolist() for i in range(0, len(order), batch_size)]
    lengths_arr = np.asarray(lengths)
    chunk = batch_size * chunk_batches
    batches: list[list[int]] = []
    for start in range(0, len(order), chunk):
        part = order[start : start + chunk]
        part = part[np.argsort(lengths_arr[part], kind="stable")]
        batches += [part[i : i + batch_size].tolist() for i in range(0, len(part), batch_size)]
    return [batches[i] for i in rng.permutation(len(batches))]


def padded_tokens(lengths: Sequence[int], batches: Sequence[Sequence[int]]) -> int:
    """Total B x T cells the batches occupy once each is padded to its longest row."""
    return sum(len(b) * max(lengths[i] for i in b) for b in batches if b)


def microbatches_per_round(*, samples_per_owner: int, batch_size: int, steps_per_round: int) -> int:
    """Microbatches each owner runs per round (`steps_per_round` 0 = one pass over its shard)."""
    return steps_per_round if steps_per_round > 0 else math.ceil(samples_per_owner / batch_size)
