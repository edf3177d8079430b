"""Plan arithmetic of live re-partitioning: shift k blocks across boundary s, and what moves.

Pure values over the ring's cuts (`cuts[s-1]` is boundary b_s, the first block of stage s).
b_0 = 0 and b_S = num_layers never move: the embeddings and the head stay where they are.
A positive k moves b_s up, pulling blocks [b_s, b_s + k) back from stage s to stage s-1; a
negative k moves it down, pushing blocks [b_s - |k|, b_s) forward from stage s-1 to stage s.
Every block moves at most one stage per reconfiguration (neighbours only), and every stage
keeps at least one block, except with `bypass` (`architecture.bypass`): then a middle stage may
be left with none (the data ring skips it, `splitlab.infer.route`); the head and the tail keep
at least one.

    .venv/bin/pytest tests/unit/test_migration_plan.py -q
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from splitlab.errors import ConfigError


@dataclass(frozen=True)
class Move:
    """Blocks `layer_ids` go from stage `donor` to its neighbour `receiver` across `boundary`."""

    boundary: int
    donor: int
    receiver: int
    layer_ids: tuple[int, ...]

    @property
    def k(self) -> int:
        """Signed as in `shift_cuts`: positive when blocks go back to the lower stage."""
        return len(self.layer_ids) if self.receiver < self.donor else -len(self.layer_ids)


def check_cuts(cuts: Sequence[int], num_layers: int, *, what: str = "cuts",
               bypass: bool = False) -> tuple[int, ...]:  # fmt: skip
    """`cuts` as a tuple if every stage owns >= 1 block (with `bypass`: the head and the tail
    do, the middle stages >= 0), else ConfigError naming `what`."""
    bounds = [0, *cuts, num_layers]
    if bypass:
        ends = len(bounds) < 2 or (bounds[1] > 0 and bounds[-1] > bounds[-2])
        if not ends or any(b < a for a, b in zip(bounds, bounds[1:], strict=False)):
            raise ConfigError(
                f"{what}={list(cuts)}: the head and the tail must own at least one of "
                f"{num_layers} blocks, a middle stage none or more (cuts non-decreasing inside "
                "[1, num_layers - 1])"
            )
    elif any(b <= a for a, b in zip(bounds, bounds[1:], strict=False)):
        raise ConfigError(
            f"{what}={list(cuts)}: every stage must own at least one of {num_layers} blocks "
            "(cuts strictly increasing inside [1, num_layers - 1])"
        )
    return tuple(int(c) for c in cuts)


def shift_cuts(cuts: Sequence[int], *, boundary: int, k: int, num_layers: int,
               bypass: bool = False) -> tuple[int, ...]:  # fmt: skip
    """The cuts after moving boundary b_`boundary` by `k` blocks (see module docstring).

    Raises:
        ConfigError: naming `planner.boundary` (not a movable boundary 1..S-1) or
            `planner.shift_k` (zero, or a stage would be left without blocks).
    """
    num_stages = len(cuts) + 1
    if not 1 <= boundary <= num_stages - 1:
        raise ConfigError(
            f"planner.boundary={boundary}: movable boundaries of a {num_stages}-stage ring are "
            f"1..{num_stages - 1} (b_0 and b_{num_stages} never move)"
        )
    if k == 0:
        raise ConfigError("planner.shift_k=0: a shift moves at least one block")
    new = list(cuts)
    new[boundary - 1] += k
    try:
        return check_cuts(new, num_layers, bypass=bypass)
    except ConfigError:
        raise ConfigError(
            f"planner.shift_k={k} at planner.boundary={boundary}: cuts {list(cuts)} -> {new} "
            f"leaves a stage without blocks (num_layers={num_layers})"
        ) from None


def owners(cuts: Sequence[int], num_layers: int) -> list[int]:
    """Stage index owning each block."""
    bounds = [0, *cuts, num_layers]
    return [s for s in range(len(bounds) - 1) for _ in range(bounds[s], bounds[s + 1])]


def moves_between(old: Sequence[int], new: Sequence[int], num_layers: int, *,
                  bypass: bool = False) -> tuple[Move, ...]:  # fmt: skip
    """The neighbour-to-neighbour moves that turn `old` cuts into `new` (boundary order).

    Raises:
        ConfigError: different stage counts, an invalid plan, or a block that would skip a stage.
    """
    if len(old) != len(new):
        raise ConfigError(f"plan cuts {list(new)}: the ring has cuts {list(old)}")
    check_cuts(old, num_layers, bypass=bypass)
    check_cuts(new, num_layers, what="plan cuts", bypass=bypass)
    before, after = owners(old, num_layers), owners(new, num_layers)
    by_pair: dict[tuple[int, int], list[int]] = {}
    for layer_idx, (a, b) in enumerate(zip(before, after, strict=True)):
        if a == b:
            continue
        if abs(a - b) != 1:
            raise ConfigError(
                f"plan cuts {list(new)}: block {layer_idx} would move from stage {a} to {b}; "
                "blocks move between neighbours only"
            )
        by_pair.setdefault((a, b), []).append(layer_idx)
    moves = [
        Move(boundary=max(a, b), donor=a, receiver=b, layer_ids=tuple(ids))
        for (a, b), ids in by_pair.items()
    ]
    return tuple(sorted(moves, key=lambda m: m.boundary))


def stage_moves(stage: int, moves: Sequence[Move]) -> tuple[list[Move], list[Move]]:
    """(incoming, outgoing) moves of `stage`."""
    return [m for m in moves if m.receiver == stage], [m for m in moves if m.donor == stage]


def span_bounds(cuts: Sequence[int], num_layers: int, stage: int) -> tuple[int, int]:
    """[start, stop) of `stage` under `cuts`."""
    bounds = [0, *cuts, num_layers]
    return bounds[stage], bounds[stage + 1]
