"""Smooth WRR and adaptive weights: proportions, interleaving, persistence, EWMA, cap."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from splitlab.errors import ConfigError
from splitlab.train.wrr import AdaptiveWeights, SmoothWRR, capped, shares


def test_three_to_one_gives_75_25_over_full_cycles() -> None:
    wrr = SmoothWRR({"fast": 3.0, "slow": 1.0})

    picks = wrr.assign(400)

    assert shares(picks) == {"fast": 0.75, "slow": 0.25}


def test_three_to_one_is_interleaved_not_blocked() -> None:
    wrr = SmoothWRR({"a": 3.0, "b": 1.0})

    picks = wrr.assign(8)

    assert picks == ["a", "a", "b", "a", "a", "a", "b", "a"]


def test_state_persists_across_windows() -> None:
    one_shot = SmoothWRR({"a": 3.0, "b": 1.0}).assign(12)
    windowed = SmoothWRR({"a": 3.0, "b": 1.0})

    picks = windowed.assign(2) + windowed.assign(2) + windowed.assign(5) + windowed.assign(3)

    assert picks == one_shot
    assert picks.count("b") == 3  # windows of 2 do not starve the slow worker


def test_reset_restarts_the_sequence() -> None:
    wrr = SmoothWRR({"a": 2.0, "b": 1.0})
    first = wrr.assign(5)

    wrr.reset()

    assert wrr.assign(5) == first


def test_empty_window_assigns_nothing_and_keeps_state() -> None:
    wrr = SmoothWRR({"a": 1.0, "b": 1.0})
    wrr.assign(1)

    assert wrr.assign(0) == []
    assert wrr.assign(1) == ["b"]


def test_pick_among_eligible_only_moves_eligible() -> None:
    wrr = SmoothWRR({"a": 3.0, "b": 1.0})

    picks = [wrr.pick({"b"}) for _ in range(3)]

    assert picks == ["b", "b", "b"]
    assert wrr.assign(4).count("a") == 3


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf])
def test_rejects_bad_weights_naming_the_worker(bad: float) -> None:
    with pytest.raises(ConfigError, match="'w1'"):
        SmoothWRR({"w0": 1.0, "w1": bad})


def test_rejects_empty_and_unknown() -> None:
    with pytest.raises(ConfigError):
        SmoothWRR({})
    wrr = SmoothWRR({"a": 1.0})
    with pytest.raises(ValueError):
        wrr.pick({"zz"})
    with pytest.raises(ValueError):
        wrr.pick(set())
    with pytest.raises(ValueError):
        wrr.assign(-1)


def test_set_weights_keeps_members() -> None:
    wrr = SmoothWRR({"a": 1.0, "b": 1.0})
    wrr.set_weights({"b": 1.0, "a": 3.0})

    assert shares(wrr.assign(400))["a"] == pytest.approx(0.75, abs=0.01)
    with pytest.raises(ValueError):
        wrr.set_weights({"a": 1.0})


weights_st = st.dictionaries(
    st.sampled_from(["w0", "w1", "w2", "w3", "w4"]),
    st.integers(min_value=1, max_value=9),
    min_size=1,
)


@settings(max_examples=200, deadline=None)
@given(weights=weights_st, cycles=st.integers(min_value=1, max_value=5))
def test_exact_proportions_over_whole_cycles(weights: dict[str, int], cycles: int) -> None:
    wrr = SmoothWRR({k: float(v) for k, v in weights.items()})
    total = sum(weights.values())

    picks = wrr.assign(total * cycles)

    assert {k: picks.count(k) for k in weights} == {k: v * cycles for k, v in weights.items()}


@settings(max_examples=200, deadline=None)
@given(weights=weights_st, n=st.integers(min_value=0, max_value=60))
def test_every_prefix_stays_within_one_of_its_share(weights: dict[str, int], n: int) -> None:
    wrr = SmoothWRR({k: float(v) for k, v in weights.items()})
    total = sum(weights.values())

    picks = wrr.assign(n)

    for name, weight in weights.items():
        assert abs(picks.count(name) - n * weight / total) < 1.0 + 1e-9


@settings(max_examples=100, deadline=None)
@given(weights=weights_st, sizes=st.lists(st.integers(0, 7), max_size=8))
def test_window_split_never_changes_the_sequence(weights: dict[str, int], sizes: list[int]) -> None:
    one = SmoothWRR({k: float(v) for k, v in weights.items()})
    split = SmoothWRR({k: float(v) for k, v in weights.items()})

    together = one.assign(sum(sizes))
    pieces = [name for size in sizes for name in split.assign(size)]

    assert pieces == together


def test_adaptive_uses_initial_until_every_worker_measured() -> None:
    weights = AdaptiveWeights({"a": 3.0, "b": 1.0})
    weights.observe("a", padded_tokens=1000, seconds=1.0)

    assert weights.weights() == {"a": 3.0, "b": 1.0}

    weights.observe("b", padded_tokens=500, seconds=1.0)

    assert weights.measured
    assert weights.weights() == {"a": 1000.0, "b": 500.0}


def test_adaptive_ewma_takes_twenty_percent_new() -> None:
    weights = AdaptiveWeights({"a": 1.0})
    weights.observe("a", padded_tokens=100, seconds=1.0)

    weights.observe("a", padded_tokens=200, seconds=1.0)

    assert weights.weights()["a"] == pytest.approx(0.8 * 100 + 0.2 * 200)


def test_adaptive_caps_ratio_at_twenty_to_one() -> None:
    weights = AdaptiveWeights({"fast": 1.0, "slow": 1.0})
    weights.observe("fast", padded_tokens=10_000, seconds=1.0)
    weights.observe("slow", padded_tokens=1, seconds=1.0)

    result = weights.weights()

    assert result["fast"] / result["slow"] == pytest.approx(20.0)


def test_fixed_weights_ignore_measurements() -> None:
    weights = AdaptiveWeights({"a": 3.0, "b": 1.0}, adaptive=False)
    weights.observe("a", padded_tokens=1, seconds=1.0)
    weights.observe("b", padded_tokens=1000, seconds=1.0)

    assert weights.weights() == {"a": 3.0, "b": 1.0}


def test_reset_returns_to_initial_weights() -> None:
    weights = AdaptiveWeights({"a": 3.0})
    weights.observe("a", padded_tokens=7, seconds=1.0)

    weights.reset()

    assert weights.weights() == {"a": 3.0}


def test_empty_measurement_is_ignored_and_bad_one_rejected() -> None:
    weights = AdaptiveWeights({"a": 1.0})
    weights.observe("a", padded_tokens=0, seconds=1.0)
    weights.observe("a", padded_tokens=10, seconds=0.0)

    assert not weights.measured
    with pytest.raises(ValueError):
        weights.observe("a", padded_tokens=10, seconds=math.nan)
    with pytest.raises(ValueError):
        weights.observe("zz", padded_tokens=10, seconds=1.0)


@settings(max_examples=100, deadline=None)
@given(rates=st.dictionaries(st.sampled_from("abcd"), st.floats(1e-3, 1e6), min_size=1))
def test_capped_ratio_never_exceeds_cap(rates: dict[str, float]) -> None:
    result = capped(rates)

    assert max(result.values()) / min(result.values()) <= 20.0 * (1 + 1e-12)
    assert max(result.values()) == max(rates.values())


def test_observe_rate_is_the_commit_path_of_observe() -> None:
    by_rate = AdaptiveWeights({"a": 1.0, "b": 1.0})
    by_time = AdaptiveWeights({"a": 1.0, "b": 1.0})
    for rate in (100.0, 300.0):
        by_rate.observe_rate("a", rate)
        by_time.observe("a", padded_tokens=int(rate), seconds=1.0)
    by_rate.observe_rate("b", None)  # a worker that ran nothing reports no rate

    assert not by_rate.measured
    by_rate.observe_rate("b", 50.0)
    by_time.observe("b", padded_tokens=50, seconds=1.0)
    assert by_rate.weights() == pytest.approx(by_time.weights())
    with pytest.raises(ValueError):
        by_rate.observe_rate("a", -1.0)
