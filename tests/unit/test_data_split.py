"""IID and Dirichlet(alpha) splits, the held-out split and per-round seeds.

.venv/bin/pytest tests/unit/test_data_split.py
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from splitlab.data.split import (
    dirichlet_split,
    holdout_sets,
    holdout_split,
    iid_split,
    label_proportions,
    owner_sizes,
    rebalance_mixes,
    round_seed,
)

# 70% class 0, 20% class 1, 10% class 2: unbalanced, so "global proportions" is not uniform.
LABELS = [0] * 1400 + [1] * 400 + [2] * 200
GLOBAL = np.array([0.7, 0.2, 0.1])


def _max_gap(shards: list[list[int]]) -> float:
    """Largest |owner proportion - global proportion| over owners and classes."""
    return max(
        float(np.abs(label_proportions([LABELS[i] for i in s], 3) - GLOBAL).max()) for s in shards
    )


def test_dirichlet_same_seed_is_identical() -> None:
    assert dirichlet_split(LABELS, 4, 0.5, 100, seed=3) == dirichlet_split(
        LABELS, 4, 0.5, 100, seed=3
    )


def test_dirichlet_different_seeds_differ() -> None:
    assert dirichlet_split(LABELS, 4, 0.5, 100, seed=3) != dirichlet_split(
        LABELS, 4, 0.5, 100, seed=4
    )


def test_dirichlet_approaches_global_proportions_as_alpha_grows() -> None:
    gaps = [
        np.mean([_max_gap(dirichlet_split(LABELS, 8, alpha, 200, seed=s)) for s in range(5)])
        for alpha in (0.1, 1.0, 10.0, 1000.0)
    ]
    assert gaps == sorted(gaps, reverse=True)
    assert gaps[0] > 0.3  # small alpha: owners are far from the global mix
    assert gaps[-1] < 0.06  # large alpha: every owner is close to 70/20/10


def test_keep_global_mix_keeps_the_union_at_the_pool_mix_and_owners_apart() -> None:
    for seed in range(5):
        shards = dirichlet_split(LABELS, 2, 0.5, 500, seed=seed, keep_global_mix=True)
        union = label_proportions([LABELS[i] for s in shards for i in s], 3)
        assert np.abs(union - GLOBAL).max() < 0.05
    gaps = [
        _max_gap(dirichlet_split(LABELS, 8, 0.1, 200, seed=s, keep_global_mix=True))
        for s in range(5)
    ]
    assert np.mean(gaps) > 0.3  # still non-IID: owners far from the global mix


def test_rebalance_mixes_fits_rows_and_column_means() -> None:
    mixes = np.array([[0.9, 0.1], [0.8, 0.2]])
    fitted = rebalance_mixes(mixes, np.array([0.5, 0.5]))
    np.testing.assert_allclose(fitted.sum(axis=1), 1.0)
    np.testing.assert_allclose(fitted.mean(axis=0), [0.5, 0.5], atol=1e-6)
    odds = lambda m: (m[0, 0] * m[1, 1]) / (m[0, 1] * m[1, 0])  # noqa: E731
    assert odds(fitted) == pytest.approx(odds(mixes))


def test_dirichlet_small_alpha_concentrates_owners_on_few_classes() -> None:
    top_share = [
        label_proportions([LABELS[i] for i in shard], 3).max()
        for seed in range(5)
        for shard in dirichlet_split(LABELS, 8, 0.05, 100, seed=seed)
    ]
    assert np.mean(top_share) > 0.8  # the global mix puts only 0.7 on its top class


def test_dirichlet_fills_every_owner_when_classes_run_out() -> None:
    # 8 owners x 240 = 1920 of 2000: most owners must borrow from other classes.
    shards = dirichlet_split(LABELS, 8, 0.1, 240, seed=1)
    assert [len(s) for s in shards] == [240] * 8


@settings(max_examples=60, deadline=None)
@given(
    labels=st.lists(st.integers(0, 4), min_size=1, max_size=300),
    num_owners=st.integers(1, 6),
    alpha=st.floats(0.01, 100.0),
    seed=st.integers(0, 2**32 - 1),
    data=st.data(),
)
def test_dirichlet_uses_every_index_at_most_once(
    labels: list[int], num_owners: int, alpha: float, seed: int, data: st.DataObject
) -> None:
    per_owner = data.draw(st.integers(1, max(1, len(labels) // num_owners)))
    if per_owner * num_owners > len(labels):
        return
    shards = dirichlet_split(labels, num_owners, alpha, per_owner, seed)
    flat = [i for s in shards for i in s]
    assert [len(s) for s in shards] == [per_owner] * num_owners
    assert len(flat) == len(set(flat))
    assert all(0 <= i < len(labels) for i in flat)


def test_dirichlet_rejects_more_samples_than_the_pool() -> None:
    with pytest.raises(ValueError, match="examples available"):
        dirichlet_split(LABELS, 3, 1.0, 700, seed=0)


def test_dirichlet_rejects_non_positive_alpha() -> None:
    with pytest.raises(ValueError, match="alpha"):
        dirichlet_split(LABELS, 2, 0.0, 10, seed=0)


def test_iid_is_disjoint_sized_and_seeded() -> None:
    shards = iid_split(2000, 5, 300, seed=9)
    flat = [i for s in shards for i in s]
    assert [len(s) for s in shards] == [300] * 5
    assert len(set(flat)) == len(flat)
    assert shards == iid_split(2000, 5, 300, seed=9)
    assert shards != iid_split(2000, 5, 300, seed=10)


def test_iid_owners_are_near_global_proportions() -> None:
    shards = iid_split(len(LABELS), 4, 500, seed=0)
    assert _max_gap(shards) < 0.06


def test_holdout_is_disjoint_complete_and_seeded() -> None:
    held, rest = holdout_split(100, 20, seed=5)
    assert len(held) == 20
    assert sorted(held + rest) == list(range(100))
    assert holdout_split(100, 20, seed=5) == (held, rest)
    assert holdout_split(100, 20, seed=6)[0] != held


def test_holdout_sets_are_disjoint_and_an_added_set_moves_no_earlier_one() -> None:
    (val, test), rest = holdout_sets(100, [20, 15], seed=5)
    assert (len(val), len(test)) == (20, 15)
    assert sorted(val + test + rest) == list(range(100))
    assert val == holdout_split(100, 20, seed=5)[0]
    with pytest.raises(ValueError, match="cannot hold out"):
        holdout_sets(10, [6, 5], seed=0)


def test_round_seeds_differ_across_rounds_and_repeat() -> None:
    seeds = [round_seed(1, r) for r in range(20)]
    assert len(set(seeds)) == 20
    assert seeds == [round_seed(1, r) for r in range(20)]
    assert round_seed(2, 0) not in seeds


def test_owner_sizes_one_count_a_list_or_a_seeded_skew() -> None:
    assert owner_sizes(8, 3) == [8, 8, 8]
    assert owner_sizes([10, 4, 0], 3) == [10, 4, 0]
    skewed = owner_sizes(100, 4, skew_alpha=0.3, seed=2)
    assert sum(skewed) == 400 and min(skewed) >= 0
    assert max(skewed) - min(skewed) > 100  # alpha 0.3 is far from equal shares
    assert skewed == owner_sizes(100, 4, skew_alpha=0.3, seed=2)
    assert skewed != owner_sizes(100, 4, skew_alpha=0.3, seed=3)
    even = owner_sizes(100, 4, skew_alpha=1e4, seed=2)
    assert max(even) - min(even) <= 6  # a large alpha gives near-equal shares


@pytest.mark.parametrize(
    ("counts", "skew", "match"),
    [([5, 2], None, "2 counts"), ([5, -1, 2], None, ">= 0"), ([0, 0, 0], None, ">= 1 example"),
     ([5, 2, 0], 1.0, "draws the counts itself"), (4, 0.0, "skew alpha")],
)  # fmt: skip
def test_owner_sizes_refuses(counts, skew, match) -> None:
    with pytest.raises(ValueError, match=match):
        owner_sizes(counts, 3, skew_alpha=skew)


def test_splits_take_one_count_per_owner_and_an_empty_owner() -> None:
    iid = iid_split(2000, 3, [500, 200, 0], seed=1)
    assert [len(s) for s in iid] == [500, 200, 0]
    assert iid[0] == iid_split(2000, 3, 500, seed=1)[0]  # the first shard does not move
    skewed = dirichlet_split(LABELS, 3, 0.5, [500, 200, 0], seed=1)
    assert [len(s) for s in skewed] == [500, 200, 0]
    flat = [i for s in skewed for i in s]
    assert len(flat) == len(set(flat))
    with pytest.raises(ValueError, match="examples available"):
        iid_split(600, 3, [500, 200, 0], seed=1)
