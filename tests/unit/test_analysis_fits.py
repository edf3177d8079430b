"""Cost-model fits: exact recovery, noise tolerance, degenerate inputs, the calibration record.

.venv/bin/pytest tests/unit/test_analysis_fits.py -q
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from splitlab.analysis.fits import (
    CalibrationResult,
    Fit,
    LoadCost,
    NoFit,
    fit_decode,
    fit_link,
    fit_load,
    fit_or_null,
    fit_prefill,
    load_cost,
    schema_diff,
    select_record,
)


def test_decode_recovers_exact_coefficients() -> None:
    context = np.array([128, 512, 1024, 2048, 4096, 8192], dtype=float)
    fit = fit_decode(context, 1.5 + 2e-4 * context)
    assert isinstance(fit, Fit)
    assert fit.params == pytest.approx({"c0": 1.5, "c1": 2e-4}, rel=1e-9)
    assert fit.r2 == pytest.approx(1.0) and fit.n == 6 and not fit.warnings


def test_prefill_recovers_quadratic_at_long_prompts() -> None:
    prompt = np.array([512, 1024, 1536, 2048, 4096, 8192], dtype=float)
    fit = fit_prefill(prompt, 3.0 + 0.01 * prompt + 2e-7 * prompt**2)
    assert isinstance(fit, Fit)
    assert fit.params == pytest.approx({"d0": 3.0, "d1": 0.01, "d2": 2e-7}, rel=1e-6)
    assert fit.r2 == pytest.approx(1.0)


def test_link_fit_within_tolerance_under_noise() -> None:
    rng = np.random.default_rng(3)
    nbytes = np.repeat([1e3, 1e4, 1e5, 1e6, 4e6], 30)
    ms = 0.25 + 8e-6 * nbytes + rng.normal(0, 0.01, nbytes.size)
    fit = fit_link(nbytes, ms)
    assert isinstance(fit, Fit)
    assert fit.params["alpha_ms"] == pytest.approx(0.25, rel=0.05)
    assert fit.params["beta_ms_per_byte"] == pytest.approx(8e-6, rel=0.01)
    assert fit.r2 is not None and fit.r2 > 0.99


def test_predict_matches_the_model() -> None:
    fit = fit_decode([1, 2, 3], [3, 5, 7])
    assert isinstance(fit, Fit)
    np.testing.assert_allclose(fit.predict([10.0]), [21.0])


@pytest.mark.parametrize(
    ("x", "y", "needle"),
    [
        ([1.0, 2.0], [1.0, 2.0], "at least 3"),
        ([5.0, 5.0, 5.0], [1.0, 2.0, 3.0], "distinct x"),
        ([1.0, 2.0, float("nan")], [1.0, 2.0, 3.0], "non-finite"),
    ],
)
def test_degenerate_link_data_gives_no_fit_with_reason(
    x: list[float], y: list[float], needle: str
) -> None:
    result = fit_link(x, y)
    assert isinstance(result, NoFit) and not result.ok
    assert needle in result.reason
    assert fit_or_null(result) is None


def test_prefill_needs_three_distinct_prompt_lengths() -> None:
    result = fit_prefill([512, 512, 1024, 1024], [1.0, 1.1, 2.0, 2.1])
    assert isinstance(result, NoFit) and "3" in result.reason


def test_prefill_needs_more_points_than_its_three_parameters() -> None:
    result = fit_prefill([512, 768, 1024], [1.0, 1.5, 2.1])  # would interpolate: r^2 = 1
    assert isinstance(result, NoFit) and "at least 4" in result.reason
    fit = fit_prefill([512, 640, 768, 1024], [1.0, 1.2, 1.5, 2.0])
    assert isinstance(fit, Fit) and fit.n == 4


def test_negative_quadratic_is_flagged_unphysical() -> None:
    prompt = np.array([16, 32, 64, 128, 256], dtype=float)
    fit = fit_prefill(prompt, 1.0 + 0.02 * prompt - 1e-5 * prompt**2)
    assert isinstance(fit, Fit) and any("d2 < 0" in w for w in fit.warnings)


def test_constant_y_has_undefined_r2() -> None:
    fit = fit_decode([1, 2, 3, 4], [2.0, 2.0, 2.0, 2.0])
    assert isinstance(fit, Fit) and fit.r2 is None


def test_mismatched_lengths_are_an_error() -> None:
    with pytest.raises(ValueError, match="3 x values but 2 y values"):
        fit_link([1, 2, 3], [1, 2])


def test_calibration_record_nulls_what_was_not_observed_and_round_trips() -> None:
    decode = fit_decode([128, 1024, 8192], [1.0, 1.2, 2.6])
    record = CalibrationResult(
        model="tiny", device="cpu", dtype="float32",
        warnings=("c0/c1 measured on a laptop CPU, not the target device",),
        decode=fit_or_null(decode), weight_load_ms={"ms": 41.0, "cache": "warm"},
    )  # fmt: skip
    data = json.loads(json.dumps(record.to_dict()))
    assert data["calibrated"] is False and data["warnings"]
    assert data["fits"]["prefill"] is None and data["thermal"] is None and data["link"] is None
    assert data["fits"]["decode"]["n"] == 3
    assert CalibrationResult.from_dict({**data, "future_field": 1}) == record
    assert record.key == "tiny|cpu|float32"


def test_uncalibrated_record_must_say_why() -> None:
    with pytest.raises(ValueError, match="warnings"):
        CalibrationResult(model="m", device="cpu", dtype="bf16")


def test_schema_diff_lists_paths_in_one_side_only() -> None:
    a = {"version": 1, "fits": {"decode": {"params": {"c0": 1, "c1": 2}, "r2": 1}}, "rho": None}
    b = {"version": 1, "fits": {"decode": {"params": {"c0": 1}, "n": 3}}, "theta": {"x": 1}}
    assert schema_diff(a, b) == [
        "only in b: fits.decode.n",
        "only in a: fits.decode.params.c1",
        "only in a: fits.decode.r2",
        "only in a: rho",
        "only in b: theta",
    ]


def test_schema_diff_treats_null_as_not_observed() -> None:
    assert schema_diff({"thermal": None}, {"thermal": {"theta_th": 80}}) == []
    assert schema_diff({"link": 1.0}, {"link": {"alpha_ms": 1}}) == [
        "type differs: link (float vs dict)"
    ]


def test_no_more_distinct_points_than_parameters_is_no_fit() -> None:
    # 4 points but 2 distinct contexts: the line passes through both means, r^2 says nothing
    result = fit_decode([128, 128, 2048, 2048], [1.0, 1.1, 2.0, 2.1])
    assert isinstance(result, NoFit) and "2 distinct x values" in result.reason
    assert "at least 3" in result.reason and fit_or_null(result) is None


def test_load_fit_recovers_fixed_and_per_block_cost() -> None:
    blocks = np.array([1, 2, 3, 4, 6, 8], dtype=float)
    fit = fit_load(blocks, 2.0 + 0.75 * blocks)
    assert isinstance(fit, Fit)
    assert fit.params == pytest.approx({"fixed_ms": 2.0, "per_block_ms": 0.75}, rel=1e-9)
    assert fit.r2 == pytest.approx(1.0) and fit.n == 6 and not fit.warnings


def test_load_fit_falling_with_blocks_is_flagged() -> None:
    fit = fit_load([1, 2, 3, 4], [9.0, 7.0, 6.0, 4.0])
    assert isinstance(fit, Fit) and any("per_block_ms <= 0" in w for w in fit.warnings)


def _load_record(load: dict | None) -> dict:
    record = CalibrationResult(model="tiny", device="cpu", dtype="float32", warnings=("cpu",),
                               load=load).to_dict()  # fmt: skip
    return json.loads(json.dumps(record))


def test_load_cost_reads_the_calibration_record() -> None:
    record = _load_record({"fixed_ms": 2.0, "per_block_ms": 0.5, "r2": 0.97, "n": 4,
                           "cache": "cold", "points": [[1, 2.5], [2, 3.0]]})  # fmt: skip
    cost = load_cost(select_record({"version": 1, "records": {"tiny|cpu|float32": record}}))
    assert cost == LoadCost(fixed_ms=2.0, per_block_ms=0.5, r2=0.97, cache="cold")
    assert cost.ms(3) == pytest.approx(3.5) and cost.ms(0) == 0.0


@pytest.mark.parametrize(
    ("load", "needle"),
    [(None, "no `load` fit"),
     ({"params": None, "r2": None, "n": 2, "warnings": ["2 points; a load fit needs at least 3"]},
      "at least 3"),
     ({"fixed_ms": 1.0, "per_block_ms": -0.5}, "per_block_ms > 0")],
)  # fmt: skip
def test_load_cost_refuses_a_missing_or_unphysical_fit(load: dict | None, needle: str) -> None:
    with pytest.raises(ValueError, match="load") as error:
        load_cost(_load_record(load))
    assert needle in str(error.value)


def test_select_record_names_the_keys_when_ambiguous() -> None:
    document = {"records": {"a|cpu|float32": {"x": 1}, "b|cpu|float32": {"x": 2}}}
    assert select_record(document, "b|cpu|float32") == {"x": 2}
    with pytest.raises(ValueError, match="name a key"):
        select_record(document)
    with pytest.raises(ValueError, match="'c' not in"):
        select_record(document, "c")
