"""FedAvg: sample-weighted means, skipped empty nodes, loud non-finite values, partitions."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from splitlab.errors import NonFiniteError, ProtocolError
from splitlab.train.fedavg import Contribution, merge_partitions, weighted_by_num_samples


def _state(value: float, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    return {"layers.0.weight": torch.full((2, 3), value, dtype=dtype), "step": torch.tensor([7])}


def test_weights_by_processed_samples() -> None:
    contributions = [Contribution("a", _state(1.0), 3), Contribution("b", _state(5.0), 1)]

    merged = weighted_by_num_samples(contributions)

    torch.testing.assert_close(merged["layers.0.weight"], torch.full((2, 3), 2.0))
    assert merged["layers.0.weight"].dtype == torch.float32
    assert torch.equal(merged["step"], torch.tensor([7]))


def test_zero_sample_node_is_skipped_even_if_garbage() -> None:
    garbage = {"layers.0.weight": torch.full((2, 3), math.nan), "step": torch.tensor([0])}
    contributions = [Contribution("a", _state(1.0), 2), Contribution("empty", garbage, 0)]

    merged = weighted_by_num_samples(contributions)

    torch.testing.assert_close(merged["layers.0.weight"], torch.full((2, 3), 1.0))


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_names_node_and_key(bad: float) -> None:
    poisoned = _state(1.0)
    poisoned["layers.0.weight"][1, 2] = bad
    contributions = [Contribution("a", _state(1.0), 2), Contribution("w1", poisoned, 1)]

    with pytest.raises(NonFiniteError, match=r"'w1'.*'layers\.0\.weight'"):
        weighted_by_num_samples(contributions)


def test_all_empty_is_an_error() -> None:
    with pytest.raises(ValueError, match="no samples"):
        weighted_by_num_samples([Contribution("a", _state(1.0), 0)])


def test_negative_count_is_an_error() -> None:
    with pytest.raises(ValueError, match="num_samples=-1"):
        weighted_by_num_samples([Contribution("a", _state(1.0), -1)])


def test_mismatched_keys_shapes_and_buffers_are_protocol_errors() -> None:
    base = Contribution("a", _state(1.0), 1)
    missing = Contribution("b", {"layers.0.weight": torch.zeros(2, 3)}, 1)
    shaped = Contribution("c", {**_state(1.0), "layers.0.weight": torch.zeros(3, 2)}, 1)
    buffer = Contribution("d", {**_state(1.0), "step": torch.tensor([8])}, 1)

    with pytest.raises(ProtocolError, match="missing \\['step'\\]"):
        weighted_by_num_samples([base, missing])
    with pytest.raises(ProtocolError, match="'c' sends"):
        weighted_by_num_samples([base, shaped])
    with pytest.raises(ProtocolError, match="differs on 'd'"):
        weighted_by_num_samples([base, buffer])


def test_bf16_is_averaged_in_high_precision_and_returned_as_bf16() -> None:
    contributions = [Contribution("a", _state(1.0, torch.bfloat16), 1)] * 3

    merged = weighted_by_num_samples(contributions)

    assert merged["layers.0.weight"].dtype == torch.bfloat16
    assert torch.equal(merged["layers.0.weight"], torch.ones(2, 3, dtype=torch.bfloat16))


@settings(max_examples=100, deadline=None)
@given(
    rows=st.lists(
        st.tuples(st.floats(-100, 100), st.integers(0, 50)), min_size=1, max_size=6
    ).filter(lambda rows: any(n > 0 for _, n in rows))
)
def test_matches_the_definition(rows: list[tuple[float, int]]) -> None:
    contributions = [
        Contribution(f"n{i}", {"w": torch.tensor([v], dtype=torch.float64)}, n)
        for i, (v, n) in enumerate(rows)
    ]

    merged = weighted_by_num_samples(contributions)

    expected = sum(v * n for v, n in rows) / sum(n for _, n in rows)
    assert merged["w"].item() == pytest.approx(expected, abs=1e-9)


def test_partitions_are_averaged_separately_and_merged() -> None:
    owners = [
        Contribution("o0", {"embed.weight": torch.tensor([0.0])}, 5),
        Contribution("o1", {"embed.weight": torch.tensor([6.0])}, 1),
    ]
    bodies = [
        Contribution("w0", {"layers.1.weight": torch.tensor([2.0])}, 4),
        Contribution("w1", {"layers.1.weight": torch.tensor([4.0])}, 2),
    ]

    merged = merge_partitions(weighted_by_num_samples(owners), weighted_by_num_samples(bodies))

    torch.testing.assert_close(merged["embed.weight"], torch.tensor([1.0]))
    torch.testing.assert_close(merged["layers.1.weight"], torch.tensor([8.0 / 3.0]))


def test_merge_rejects_conflicting_shared_key() -> None:
    with pytest.raises(ProtocolError, match="'k'"):
        merge_partitions({"k": torch.zeros(1)}, {"k": torch.ones(1)})
