"""Plan arithmetic of shifting k blocks across boundary s (splitlab.infer.reshard)."""

from __future__ import annotations

import itertools

import pytest

from splitlab.errors import ConfigError
from splitlab.infer.reshard import Move, moves_between, owners, shift_cuts, span_bounds, stage_moves


@pytest.mark.parametrize(
    ("boundary", "k", "expected"),
    [(1, 1, (4, 6)), (1, -1, (2, 6)), (1, 2, (5, 6)), (1, -2, (1, 6)),
     (2, 1, (3, 7)), (2, -1, (3, 5)), (2, 2, (3, 8)), (2, -2, (3, 4))],
)  # fmt: skip
def test_shift_moves_the_boundary(boundary: int, k: int, expected: tuple[int, ...]) -> None:
    assert shift_cuts([3, 6], boundary=boundary, k=k, num_layers=9) == expected


@pytest.mark.parametrize("boundary", [0, 3, -1])
def test_first_and_last_boundaries_never_move(boundary: int) -> None:
    with pytest.raises(ConfigError, match="planner.boundary"):
        shift_cuts([3, 6], boundary=boundary, k=1, num_layers=9)


@pytest.mark.parametrize(("boundary", "k"), [(1, -3), (1, 3), (2, -3), (2, 3), (1, 0)])
def test_a_stage_never_loses_its_last_block(boundary: int, k: int) -> None:
    with pytest.raises(ConfigError, match="planner.shift_k"):
        shift_cuts([3, 6], boundary=boundary, k=k, num_layers=9)


def test_positive_k_pulls_blocks_back_from_the_higher_stage() -> None:
    (move,) = moves_between([3, 6], [5, 6], 9)
    assert move == Move(boundary=1, donor=1, receiver=0, layer_ids=(3, 4))
    assert move.k == 2


def test_negative_k_pushes_blocks_forward() -> None:
    (move,) = moves_between([3, 6], [3, 5], 9)
    assert move == Move(boundary=2, donor=1, receiver=2, layer_ids=(5,))
    assert move.k == -1


def test_two_boundaries_at_once_and_stage_roles() -> None:
    moves = moves_between([3, 6], [4, 7], 9)
    assert [(m.boundary, m.donor, m.receiver, m.layer_ids) for m in moves] == [
        (1, 1, 0, (3,)), (2, 2, 1, (6,))]  # fmt: skip
    incoming, outgoing = stage_moves(1, moves)
    assert [m.layer_ids for m in incoming] == [(6,)] and [m.layer_ids for m in outgoing] == [(3,)]


def test_no_change_no_moves() -> None:
    assert moves_between([3, 6], [3, 6], 9) == ()


def test_blocks_move_between_neighbours_only() -> None:
    with pytest.raises(ConfigError, match="neighbours only"):
        moves_between([3, 6], [7, 8], 9)


def test_exhaustive_every_valid_pair_of_cuts_conserves_blocks() -> None:
    """For every pair of valid 3-stage configurations on 7 blocks: either the moves rebuild the
    new ownership exactly, or the plan is refused for skipping a stage."""
    valid = list(itertools.combinations(range(1, 7), 2))
    for old, new in itertools.product(valid, valid):
        before = owners(old, 7)
        try:
            moves = moves_between(old, new, 7)
        except ConfigError:
            assert any(abs(a - b) > 1 for a, b in zip(before, owners(new, 7), strict=True))
            continue
        after = list(before)
        for m in moves:
            assert abs(m.donor - m.receiver) == 1
            for i in m.layer_ids:
                assert after[i] == m.donor
                after[i] = m.receiver
        assert after == owners(new, 7)
        for stage in range(3):
            start, stop = span_bounds(new, 7, stage)
            assert [i for i, s in enumerate(after) if s == stage] == list(range(start, stop))
