"""Drift profiles (pure): determinism, ranges, and each profile's shape.

.venv/bin/pytest tests/unit/test_drift_profiles.py -q
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from splitlab.config.load import CONF_DIR
from splitlab.drift.profiles import (
    PEAK_C,
    PROFILES,
    THROTTLE_C,
    DriftRecord,
    ProfileParams,
    generate,
)
from splitlab.errors import ConfigError

P = ProfileParams(num_stages=3, length_tokens=400, seed=77, slow_stage=1, phi=1.5, period_tokens=60)


def column(records: list[DriftRecord], stage: int) -> list[DriftRecord]:
    return [r for r in records if r.stage == stage]


def test_every_replayable_drift_option_has_a_profile() -> None:
    replayable = {p.stem for p in (CONF_DIR / "drift").glob("*.yaml")} - {"none", "live"}
    assert set(PROFILES) == replayable


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_same_params_give_identical_records(profile: str) -> None:
    assert generate(profile, P) == generate(profile, P)


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_records_cover_every_token_and_stage_in_order(profile: str) -> None:
    records = generate(profile, P)
    assert [(r.token, r.stage) for r in records] == [(t, s) for t in range(400) for s in range(3)]


@settings(max_examples=60, deadline=None)
@given(
    profile=st.sampled_from(sorted(PROFILES)),
    num_stages=st.integers(1, 5),
    length=st.integers(1, 80),
    seed=st.integers(0, 2**31),
    phi=st.floats(1.0, 4.0),
    period=st.integers(1, 100),
    data=st.data(),
)
def test_every_field_stays_in_range(
    profile: str,
    num_stages: int,
    length: int,
    seed: int,
    phi: float,
    period: int,
    data: st.DataObject,
) -> None:
    slow = data.draw(st.integers(0, num_stages - 1))
    params = ProfileParams(num_stages, length, seed, slow, phi, period)
    for r in generate(profile, params):
        assert 1.0 <= r.phi <= phi + 1e-9
        assert 0.0 <= r.q_cmp <= 1.0 and 0.0 <= r.q_mem <= 1.0
        assert 0.0 < r.link_factor <= 1.0
        assert r.phi_link == pytest.approx(1.0 / r.link_factor)
        assert math.isfinite(r.theta_c) and 20.0 < r.theta_c <= PEAK_C


def test_steady_is_nominal_everywhere() -> None:
    records = generate("steady", P)
    assert {(r.phi, r.link_factor) for r in records} == {(1.0, 1.0)}
    for s in range(3):
        assert len({r.theta_c for r in column(records, s)}) == 1


def test_seed_changes_the_stages_resting_points() -> None:
    other = ProfileParams(3, 400, seed=78)
    assert generate("steady", P)[0].theta_c != generate("steady", other)[0].theta_c


def test_one_slow_node_slows_only_slow_stage_throughout() -> None:
    records = generate("one_slow_node", P)
    assert {r.phi for r in column(records, 1)} == {1.5}
    assert {r.phi for r in column(records, 0) + column(records, 2)} == {1.0}


def test_thermal_ramp_heats_past_throttle_and_then_phi_rises() -> None:
    hot = column(generate("thermal_ramp", P), 1)
    temps = [r.theta_c for r in hot]
    assert temps == sorted(temps) and temps[-1] > THROTTLE_C
    assert all(r.phi == 1.0 for r in hot if r.theta_c <= THROTTLE_C)
    assert hot[-1].phi > 1.4 and hot[-1].phi <= 1.5


def test_thermal_ramp_leaves_other_stages_cool() -> None:
    records = generate("thermal_ramp", P)
    assert all(r.phi == 1.0 and r.theta_c < THROTTLE_C for r in column(records, 0))


def test_oscillating_phi_has_period_tokens() -> None:
    phis = [r.phi for r in column(generate("oscillating", P), 1)]
    assert phis[0] == pytest.approx(1.0) and phis[30] == pytest.approx(1.5)
    assert phis[60] == pytest.approx(1.0) and phis[90] == pytest.approx(1.5)


def test_link_degrade_worsens_monotonically_on_slow_stage_only() -> None:
    records = generate("link_degrade", P)
    links = [r.link_factor for r in column(records, 1)]
    assert links[0] == 1.0 and links == sorted(links, reverse=True)
    assert links[-1] == pytest.approx(1 / 1.5)
    assert {r.link_factor for r in column(records, 2)} == {1.0}


def test_cpu_throttle_steps_down_at_period_tokens_on_slow_stage_only() -> None:
    phis = [r.phi for r in column(generate("cpu_throttle", P), 1)]
    assert set(phis[:60]) == {1.0} and set(phis[60:]) == {1.5}
    assert {r.phi for r in column(generate("cpu_throttle", P), 0)} == {1.0}


def test_compute_load_rises_with_phi() -> None:
    slow, nominal = column(generate("one_slow_node", P), 1)[0], column(generate("steady", P), 1)[0]
    assert slow.q_cmp == pytest.approx(min(1.0, nominal.q_cmp * 1.5), abs=1e-6)


@pytest.mark.parametrize(
    ("field", "params"),
    [
        ("num_stages", ProfileParams(0, 10)),
        ("length_tokens", ProfileParams(3, 0)),
        ("slow_stage", ProfileParams(3, 10, slow_stage=3)),
        ("phi", ProfileParams(3, 10, phi=0.9)),
        ("phi", ProfileParams(3, 10, phi=math.nan)),
        ("period_tokens", ProfileParams(3, 10, period_tokens=0)),
    ],
)
def test_invalid_params_name_the_key(field: str, params: ProfileParams) -> None:
    with pytest.raises(ConfigError, match=field):
        generate("steady", params)


def test_unknown_profile_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="thermal_rmap"):
        generate("thermal_rmap", P)


def test_record_round_trips_through_dict_ignoring_unknown_keys() -> None:
    rec = generate("thermal_ramp", P)[-1]
    assert DriftRecord.from_dict({**rec.to_dict(), "extra": 1}) == rec
