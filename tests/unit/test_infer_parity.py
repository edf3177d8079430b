"""Version parity: the head names the stage and field of every enforced mismatch."""

from __future__ import annotations

from splitlab.infer.parity import ENFORCED, parity_mismatches, stage_versions
from splitlab.infer.ring import check_roster


def _entry(stage: int, start: int, stop: int, **versions: str) -> dict:
    base = stage_versions(dtype="float32", device="cpu")
    return {
        "stage": stage, "num_stages": 3, "start": start, "stop": stop, "num_layers": 6,
        "model": {"model_type": "llama"}, "versions": {**base, **versions},
    }  # fmt: skip


def test_report_has_enforced_and_recorded_fields() -> None:
    versions = stage_versions(dtype="bfloat16", device="cpu")
    assert set(ENFORCED) <= set(versions)
    assert versions["dtype"] == "bfloat16"
    assert {"l4t", "jetpack", "power_mode"} <= set(versions)


def test_mismatch_names_stage_and_field() -> None:
    roster = [_entry(0, 0, 2), _entry(1, 2, 4, torch="0.0"), _entry(2, 4, 6)]
    (line,) = parity_mismatches(roster)
    assert line.startswith("stage 1 torch='0.0'")


def test_recorded_fields_are_not_enforced() -> None:
    roster = [_entry(0, 0, 2), _entry(1, 2, 4, power_mode="MAXN"), _entry(2, 4, 6, device="cuda")]
    assert parity_mismatches(roster) == []


def test_relaxed_parity_accepts_a_mismatch() -> None:
    roster = [_entry(0, 0, 2), _entry(1, 2, 4, transformers="4.0"), _entry(2, 4, 6)]
    assert check_roster(roster, num_stages=3, strict_parity=True)
    assert check_roster(roster, num_stages=3, strict_parity=False) == []


def test_gap_between_spans_is_refused() -> None:
    roster = [_entry(0, 0, 2), _entry(1, 3, 4), _entry(2, 4, 6)]
    (line,) = check_roster(roster, num_stages=3, strict_parity=True)
    assert "stage 1 owns blocks [3, 4)" in line
