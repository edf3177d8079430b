"""Partition plans: every block exactly once, in order, with the ends where they belong.

.venv/bin/pytest tests/unit/test_models_plan.py
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from splitlab.errors import ConfigError
from splitlab.models.plan import (
    Span,
    cuts_of,
    even_cuts,
    ring_plan,
    two_stage_plan,
    u_shape_plan,
)


def assert_tiles(spans: tuple[Span, ...], num_layers: int) -> None:
    """Contiguous, in order, covering [0, num_layers); embeddings first, head last, once each."""
    assert spans[0].start == 0
    assert spans[-1].stop == num_layers
    for left, right in zip(spans, spans[1:], strict=False):
        assert left.stop == right.start
    assert [s.has_embeddings for s in spans] == [True] + [False] * (len(spans) - 1)
    assert [s.has_head for s in spans] == [False] * (len(spans) - 1) + [True]


@st.composite
def u_shapes(draw: st.DrawFn) -> tuple[int, int, int]:
    num_layers = draw(st.integers(1, 64))
    cut_layers = draw(st.integers(0, num_layers - 1))
    tail_blocks = draw(st.integers(0, num_layers - 1 - cut_layers))
    return num_layers, cut_layers, tail_blocks


@given(u_shapes())
def test_u_shape_tiles_the_model_with_a_remote_body(shape: tuple[int, int, int]) -> None:
    num_layers, cut_layers, tail_blocks = shape

    plan = u_shape_plan(num_layers=num_layers, cut_layers=cut_layers, tail_blocks=tail_blocks)

    assert_tiles(plan.spans, num_layers)
    assert plan.front.num_blocks == cut_layers
    assert plan.tail is not None and plan.tail.num_blocks == tail_blocks
    assert plan.body.num_blocks >= 1
    assert plan.owner_spans == (plan.front, plan.tail)


@given(st.integers(1, 64).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n - 1))))
def test_two_stage_tiles_the_model_and_the_rest_has_the_head(shape: tuple[int, int]) -> None:
    num_layers, cut_layers = shape

    plan = two_stage_plan(num_layers=num_layers, cut_layers=cut_layers)

    assert_tiles(plan.spans, num_layers)
    assert plan.tail is None and plan.owner_spans == (plan.front,)
    assert plan.front.num_blocks == cut_layers


@pytest.mark.parametrize(
    ("num_layers", "cut_layers", "tail_blocks", "named"),
    [
        (4, 4, 0, "cut_layers=4"),
        (4, 2, 2, "tail_blocks=2"),
        (4, 3, 1, "leaves 0"),
        (4, -1, 0, "cut_layers=-1"),
        (4, 1, -1, "tail_blocks=-1"),
        (0, 0, 0, "num_layers=0"),
    ],
)
def test_u_shape_rejects_plans_without_a_remote_block(
    num_layers: int, cut_layers: int, tail_blocks: int, named: str
) -> None:
    with pytest.raises(ConfigError, match=named):
        u_shape_plan(num_layers=num_layers, cut_layers=cut_layers, tail_blocks=tail_blocks)


@pytest.mark.parametrize("cut_layers", [-1, 4, 9])
def test_two_stage_rejects_cuts_outside_the_model(cut_layers: int) -> None:
    with pytest.raises(ConfigError, match=f"architecture.cut_layers={cut_layers}"):
        two_stage_plan(num_layers=4, cut_layers=cut_layers)


@given(st.integers(1, 64).flatmap(lambda n: st.tuples(st.just(n), st.integers(1, n))))
def test_even_cuts_balance_stages_within_one_block(shape: tuple[int, int]) -> None:
    num_layers, stages = shape

    spans = ring_plan(num_layers, even_cuts(num_layers=num_layers, stages=stages))

    assert len(spans) == stages
    assert_tiles(spans, num_layers)
    sizes = [s.num_blocks for s in spans]
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)


@given(st.integers(2, 64).flatmap(lambda n: st.tuples(st.just(n), st.sets(st.integers(1, n - 1)))))
def test_ring_plan_accepts_any_increasing_cuts_and_cuts_of_inverts_it(
    shape: tuple[int, set[int]],
) -> None:
    num_layers, cut_set = shape
    cuts = sorted(cut_set)

    spans = ring_plan(num_layers, cuts)

    assert_tiles(spans, num_layers)
    assert all(s.num_blocks >= 1 for s in spans)
    assert cuts_of(spans) == cuts


@pytest.mark.parametrize(
    ("cuts", "named"),
    [
        ([0, 2], r"architecture.cuts\[0\]=0"),
        ([2, 4], r"architecture.cuts\[1\]=4"),
        ([3, 2], r"architecture.cuts=\[3, 2\]"),
        ([2, 2], r"architecture.cuts=\[2, 2\]"),
    ],
)
def test_ring_plan_rejects_bad_cuts_naming_them(cuts: list[int], named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        ring_plan(4, cuts)


@pytest.mark.parametrize("stages", [0, 5])
def test_even_cuts_rejects_more_stages_than_blocks(stages: int) -> None:
    with pytest.raises(ConfigError, match=f"architecture.stages={stages}"):
        even_cuts(num_layers=4, stages=stages)


def test_single_stage_ring_owns_everything() -> None:
    assert ring_plan(3, []) == (Span(0, 3, has_embeddings=True, has_head=True),)
