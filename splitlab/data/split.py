"""Pure splits of example indices across data owners: IID and Dirichlet(alpha) non-IID, with
equal or unequal shard sizes (`owner_sizes`: a count per owner, or a Dirichlet quantity skew).

Every function takes its seed and returns positions (0..n-1) into the pool it was given; no
position is handed to two owners. Owner label proportions are drawn from
Dirichlet(alpha * K * q), q = the pool's own label proportions and K the number of classes: for
balanced labels that is the usual Dirichlet(alpha, ..., alpha); in general each owner's expected
mix is q and it concentrates on q as alpha grows (small alpha = few classes per owner).

    .venv/bin/pytest tests/unit/test_data_split.py
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from splitlab.errors import ConfigError

if TYPE_CHECKING:
    from splitlab.config.schema import DataConfig

QUANTITY_STREAM = 0x51CE  # keeps the quantity skew's draws apart from the label split's


def round_seed(seed: int, round_index: int) -> int:
    """A split seed for one round, independent across rounds and of the base seed's neighbours."""
    return int(np.random.SeedSequence([seed, round_index]).generate_state(1)[0])


def owner_sizes(
    samples_per_owner: int | Sequence[int],
    num_owners: int,
    *,
    skew_alpha: float | None = None,
    seed: int = 0,
) -> list[int]:
    """Examples each owner holds.

    One count is every owner's; a list is one count per owner (0 allowed: an owner with no
    data still joins every window). With `skew_alpha` the `num_owners x samples_per_owner`
    examples are shared out in Dirichlet(skew_alpha, ..., skew_alpha) proportions drawn from
    `seed` (largest remainder, so the total is kept): small alpha puts most data on few owners.

    Raises:
        ValueError: a list of the wrong length, a negative count, no example at all, or a
            skew with a list (the skew draws the counts itself).
    """
    if not isinstance(samples_per_owner, int):
        sizes = [int(n) for n in samples_per_owner]
        if len(sizes) != num_owners:
            raise ValueError(f"{len(sizes)} counts {sizes} for {num_owners} owners")
        if skew_alpha is not None:
            raise ValueError(f"a quantity skew draws the counts itself; got counts {sizes}")
    else:
        sizes = [samples_per_owner] * num_owners
    if num_owners < 1 or min(sizes) < 0 or sum(sizes) < 1:
        raise ValueError(f"need >= 1 owner, counts >= 0 and >= 1 example; got {sizes}")
    if skew_alpha is None:
        return sizes
    if skew_alpha <= 0:
        raise ValueError(f"skew alpha must be > 0, got {skew_alpha}")
    total = sum(sizes)
    shares = np.random.default_rng([seed, QUANTITY_STREAM]).dirichlet([skew_alpha] * num_owners)
    exact = shares * total
    counts = np.floor(exact).astype(np.int64)
    leftover = total - int(counts.sum())
    counts[np.argsort(counts - exact, kind="stable")[:leftover]] += 1  # largest remainders
    return counts.tolist()


def holdout_split(num_examples: int, num_held_out: int, seed: int) -> tuple[list[int], list[int]]:
    """Seeded (held-out, rest) positions; the held-out set depends on the seed alone."""
    (held,), rest = holdout_sets(num_examples, [num_held_out], seed)
    return held, rest


def holdout_sets(
    num_examples: int, sizes: list[int], seed: int
) -> tuple[list[list[int]], list[int]]:
    """Seeded disjoint held-out position sets of `sizes`, and the rest. Each set depends on the
    seed and the sizes before it alone, so adding a later set never moves an earlier one."""
    total = sum(sizes)
    if min(sizes, default=0) < 0 or total > num_examples:
        raise ValueError(f"cannot hold out {sizes} of {num_examples} examples")
    order = np.random.default_rng([seed, 0x5EED]).permutation(num_examples)
    bounds = np.cumsum([0, *sizes])
    held = [sorted(order[a:b].tolist()) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    return held, sorted(order[total:].tolist())


def iid_split(
    num_examples: int, num_owners: int, samples_per_owner: int | Sequence[int], seed: int
) -> list[list[int]]:
    """Disjoint uniform random shards of `samples_per_owner` positions each (one count for
    every owner, or one per owner)."""
    sizes = _check_sizes(num_examples, num_owners, samples_per_owner)
    order = np.random.default_rng(seed).permutation(num_examples)
    bounds = np.cumsum([0, *sizes])
    return [order[a:b].tolist() for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def dirichlet_split(
    labels: Sequence[int],
    num_owners: int,
    alpha: float,
    samples_per_owner: int | Sequence[int],
    seed: int,
    *,
    keep_global_mix: bool = False,
) -> list[list[int]]:
    """Disjoint label-skewed shards of `samples_per_owner` positions each.

    Each owner draws its class mix p ~ Dirichlet(alpha * K * q) and then class counts
    ~ Multinomial(samples_per_owner, p). A class that runs out hands its shortfall to the classes
    that still have examples, in proportion to p (or to what is left when p puts no mass there).
    With `keep_global_mix` the drawn mixes are rebalanced (`rebalance_mixes`) so that the owners
    together hold the pool's mix q: owners still differ as much (the same odds ratios between
    them), but few owners no longer make the union lopsided (2 owners at alpha 0.5 drew 97%
    of one class together for some seeds, a dataset shift no federated method can undo).

    Args:
        labels: the class (or stratum) of every position in the pool.
        num_owners: owners to fill, in order.
        alpha: concentration; > 0.
        samples_per_owner: examples per owner, or a list of one count per owner; their sum
            must fit the pool.
        seed: the only source of randomness.
    """
    if alpha <= 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    labels_arr = np.asarray(labels, dtype=np.int64)
    sizes = _check_sizes(len(labels_arr), num_owners, samples_per_owner)
    rng = np.random.default_rng(seed)
    classes, counts = np.unique(labels_arr, return_counts=True)
    pools = [rng.permutation(np.flatnonzero(labels_arr == c)).tolist() for c in classes]
    concentration = alpha * len(classes) * counts / counts.sum()
    drawn = None  # rebalanced mixes are drawn up front; otherwise each owner draws in turn
    if keep_global_mix:
        mixes = np.stack([rng.dirichlet(concentration) for _ in range(num_owners)])
        drawn = iter(rebalance_mixes(mixes, counts / counts.sum()))
    shards: list[list[int]] = []
    for size in sizes:
        mix = next(drawn) if drawn is not None else rng.dirichlet(concentration)
        want = rng.multinomial(size, mix)
        taken = _take(pools, want, mix, rng)
        shards.append(rng.permutation(taken).tolist())
    return shards


def rebalance_mixes(mixes: np.ndarray, target: np.ndarray, iterations: int = 200) -> np.ndarray:
    """Owner x class mixes whose rows sum to 1 and whose column means equal `target`, by
    iterative proportional fitting (alternately scale columns to the target and rows to 1),
    which keeps every odds ratio between owners and classes of the drawn `mixes`."""
    fitted = np.clip(np.asarray(mixes, dtype=np.float64), 1e-12, None)
    for _ in range(iterations):
        fitted *= target / fitted.mean(axis=0)
        fitted /= fitted.sum(axis=1, keepdims=True)
    return fitted


def label_proportions(labels: Sequence[int], num_classes: int) -> np.ndarray:
    """Fraction of each class id 0..num_classes-1 in `labels`."""
    counts = np.bincount(np.asarray(labels, dtype=np.int64), minlength=num_classes)
    return counts / max(1, counts.sum())


def _take(
    pools: list[list[int]], want: np.ndarray, mix: np.ndarray, rng: np.random.Generator
) -> list[int]:
    taken, short = _pop(pools, want)
    while short > 0:
        left = np.array([len(p) for p in pools], dtype=np.float64)
        weights = np.where(left > 0, mix, 0.0)
        weights = weights if weights.sum() > 0 else left
        more, short = _pop(pools, rng.multinomial(short, weights / weights.sum()))
        taken += more
    return taken


def _pop(pools: list[list[int]], counts: np.ndarray) -> tuple[list[int], int]:
    """Remove up to counts[c] positions from each class pool; return them and the shortfall."""
    taken: list[int] = []
    short = 0
    for c, n in enumerate(counts.tolist()):
        got = min(n, len(pools[c]))
        taken += pools[c][:got]
        del pools[c][:got]
        short += n - got
    return taken, short


def _check_sizes(
    num_examples: int, num_owners: int, samples_per_owner: int | Sequence[int]
) -> list[int]:
    """Each owner's count; raises ValueError when they do not fit `num_examples`."""
    sizes = owner_sizes(samples_per_owner, num_owners)
    if sum(sizes) > num_examples:
        raise ValueError(
            f"{num_owners} owners x {samples_per_owner} samples = {sum(sizes)} > "
            f"{num_examples} examples available"
        )
    return sizes


def owner_counts(cfg: DataConfig, num_owners: int) -> list[int]:
    """Training examples each owner holds: `data.samples_per_owner` (one count or one per
    owner), shared out by a Dirichlet(`data.quantity_skew_alpha`) draw from `data.seed` when set.

    Raises:
        ConfigError: naming data.samples_per_owner / data.quantity_skew_alpha.
    """
    try:
        return owner_sizes(
            cfg.samples_per_owner, num_owners, skew_alpha=cfg.quantity_skew_alpha, seed=cfg.seed
        )
    except ValueError as exc:
        raise ConfigError(
            f"data.samples_per_owner={cfg.samples_per_owner!r}, data.quantity_skew_alpha="
            f"{cfg.quantity_skew_alpha} for {num_owners} owners: {exc}"
        ) from None
