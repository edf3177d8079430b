"""Length bucketing: every example once, similar lengths per batch, seeded order.

.venv/bin/pytest tests/unit/test_data_buckets.py
"""

from __future__ import annotations

import numpy as np

from splitlab.data.buckets import bucket_batches, padded_tokens

LENGTHS = np.random.default_rng(0).integers(3, 64, size=1000).tolist()


def test_every_position_appears_exactly_once() -> None:
    batches = bucket_batches(LENGTHS, 16, seed=1)
    assert sorted(i for b in batches for i in b) == list(range(len(LENGTHS)))


def test_batches_are_full_except_chunk_tails() -> None:
    batches = bucket_batches(LENGTHS, 16, seed=1, chunk_batches=8)
    short = [b for b in batches if len(b) < 16]
    assert all(1 <= len(b) <= 16 for b in batches)
    assert len(short) <= -(-len(LENGTHS) // (16 * 8))  # at most one per chunk


def test_bucketing_cuts_padding() -> None:
    bucketed = padded_tokens(LENGTHS, bucket_batches(LENGTHS, 16, seed=1))
    shuffled = padded_tokens(LENGTHS, bucket_batches(LENGTHS, 16, seed=1, bucket=False))
    assert bucketed < 0.7 * shuffled
    assert bucketed >= sum(LENGTHS)


def test_same_seed_same_batches_other_seed_other_order() -> None:
    assert bucket_batches(LENGTHS, 16, seed=1) == bucket_batches(LENGTHS, 16, seed=1)
    assert bucket_batches(LENGTHS, 16, seed=1) != bucket_batches(LENGTHS, 16, seed=2)


def test_batch_order_is_not_sorted_by_length() -> None:
    batches = bucket_batches(LENGTHS, 16, seed=1)
    longest = [max(LENGTHS[i] for i in b) for b in batches]
    assert longest != sorted(longest) and longest != sorted(longest, reverse=True)


def test_unbucketed_batches_cover_all_positions() -> None:
    batches = bucket_batches(LENGTHS, 10, seed=3, bucket=False)
    assert [len(b) for b in batches] == [10] * 100
    assert sorted(i for b in batches for i in b) == list(range(len(LENGTHS)))


def test_empty_input_gives_no_batches() -> None:
    assert bucket_batches([], 4, seed=0) == []
