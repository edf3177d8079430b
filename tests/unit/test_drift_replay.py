"""Replay backend, trace file, observation contract, injection and the config factory.

.venv/bin/pytest tests/unit/test_drift_replay.py -q
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from tool_helpers import load_tool

from splitlab.config.enums import DriftSource
from splitlab.config.schema import DriftConfig
from splitlab.drift.contract import OBS_KEYS, Observation
from splitlab.drift.inject import inject, sleep_ms_for
from splitlab.drift.profiles import ProfileParams, generate
from splitlab.drift.replay import ReplaySource
from splitlab.drift.source import TRACE_RELPATH, make_source
from splitlab.drift.trace_io import TraceFormatError, TraceHeader, read_trace, write_trace
from splitlab.errors import ConfigError, ProtocolError

PARAMS = ProfileParams(num_stages=3, length_tokens=50, seed=77, slow_stage=1, phi=1.5)


@pytest.fixture
def trace_path(tmp_path: Path) -> Path:
    header = TraceHeader.for_profile("one_slow_node", PARAMS)
    return write_trace(tmp_path / "d.jsonl", header, generate("one_slow_node", PARAMS))


def replay(path: Path, *, stage: int = 1, seed: int = 77, run_id: str = "r1") -> ReplaySource:
    return ReplaySource(path, stage=stage, seed=seed, run_id=run_id, noise_var_degc2=0.5)


def observations(source: ReplaySource, n: int = 50) -> list[dict[str, float]]:
    return [source.observe(t) for t in range(n)]


# --- trace file ------------------------------------------------------------------------------


def test_trace_round_trips_through_the_file(trace_path: Path) -> None:
    trace = read_trace(trace_path)
    assert trace.header.profile == "one_slow_node" and trace.num_tokens == 50
    assert list(trace.by_stage[1]) == [r for r in generate("one_slow_node", PARAMS) if r.stage == 1]


def edit_line(path: Path, lineno: int, **changes: object) -> None:
    lines = path.read_text().splitlines()
    obj = json.loads(lines[lineno - 1])
    obj.update(changes)
    for key in [k for k, v in changes.items() if v is ...]:
        del obj[key]
    lines[lineno - 1] = json.dumps(obj)
    path.write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize(
    ("lineno", "changes", "match"),
    [
        (5, {"phi": 0.5}, r":5: field 'phi'"),
        (5, {"q_mem": ...}, r":5: missing field 'q_mem'"),
        (5, {"link_factor": 0.0}, r":5: field 'link_factor'"),
        (5, {"stage": 7}, r":5: field 'stage'"),
        (5, {"token": 9}, r":5: field 'token'"),
        (1, {"version": 99}, r":1: field 'version'"),
        (1, {"kind": "drift"}, r":1: first line must be a header"),
    ],
)
def test_malformed_trace_names_file_line_and_field(
    trace_path: Path, lineno: int, changes: dict[str, object], match: str
) -> None:
    edit_line(trace_path, lineno, **changes)
    with pytest.raises(TraceFormatError, match=str(trace_path.name) + ".*" + match):
        read_trace(trace_path)


def test_truncated_stage_is_rejected(trace_path: Path) -> None:
    lines = trace_path.read_text().splitlines()
    trace_path.write_text("\n".join(lines[:-1]) + "\n")
    with pytest.raises(TraceFormatError, match="same, non-zero token count"):
        read_trace(trace_path)


def test_missing_trace_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="nope.jsonl"):
        read_trace(tmp_path / "nope.jsonl")


# --- contract --------------------------------------------------------------------------------


def test_contract_observation_has_exactly_four_keys(trace_path: Path) -> None:
    assert tuple(replay(trace_path).observe(0)) == OBS_KEYS
    assert OBS_KEYS == ("theta_obs", "q_cmp_obs", "q_mem_obs", "link_obs")


def test_contract_from_dict_rejects_a_fifth_key() -> None:
    obs = Observation(50.0, 0.5, 0.4, 1.0).to_dict()
    with pytest.raises(ProtocolError, match="exactly keys"):
        Observation.from_dict({**obs, "gpu_power_w": 3.0})


def test_contract_from_dict_reads_json_null_as_nan() -> None:
    obs = Observation.from_dict(
        {"theta_obs": None, "q_cmp_obs": 1, "q_mem_obs": 0.2, "link_obs": 1.0}
    )
    assert math.isnan(obs.theta_obs) and obs.q_cmp_obs == 1.0


# --- replay ----------------------------------------------------------------------------------


def test_same_seed_gives_identical_observation_sequences(trace_path: Path) -> None:
    assert observations(replay(trace_path)) == observations(replay(trace_path))


def test_observation_does_not_depend_on_call_order(trace_path: Path) -> None:
    forward = observations(replay(trace_path))
    source = replay(trace_path)
    backward = [source.observe(t) for t in reversed(range(50))]
    assert backward[::-1] == forward


@pytest.mark.parametrize("change", [{"seed": 78}, {"run_id": "r2"}, {"stage": 2}])
def test_seed_run_and_stage_each_change_the_noise(trace_path: Path, change: dict) -> None:
    base = replay(trace_path, stage=1)
    other = replay(trace_path, **{"stage": 1, **change})
    noise = [base.noise_c(t) for t in range(50)]
    assert noise != [other.noise_c(t) for t in range(50)]


def test_noise_is_non_zero_and_only_on_temperature(trace_path: Path) -> None:
    source = replay(trace_path)
    truth = [source.truth(t) for t in range(50)]
    obs = observations(source)
    assert all(o["theta_obs"] != r.theta_c for o, r in zip(obs, truth, strict=True))
    assert all(
        o["q_cmp_obs"] == r.q_cmp and o["link_obs"] == r.link_factor
        for o, r in zip(obs, truth, strict=True)
    )


def test_noise_variance_matches_config(trace_path: Path) -> None:
    source = replay(trace_path)
    noise = np.array([source.noise_c(t) for t in range(20_000)])
    # Sample variance of N normals has sd var*sqrt(2/N) ~ 0.005 here; 0.05 is 10 sd.
    assert abs(noise.var() - 0.5) < 0.05 and abs(noise.mean()) < 0.05


@pytest.mark.parametrize("var", [0.0, -1.0, math.nan])
def test_zero_or_invalid_noise_is_refused(trace_path: Path, var: float) -> None:
    with pytest.raises(ConfigError, match="noise_var_degc2"):
        ReplaySource(trace_path, stage=1, seed=77, run_id="r1", noise_var_degc2=var)


def test_short_trace_holds_last_record_and_flags_exhaustion(trace_path: Path) -> None:
    source = replay(trace_path)
    last = source.truth(49)
    assert not source.exhausted
    assert source.truth(120) == last and source.phi(120) == last.phi
    assert source.exhausted


def test_exhaustion_is_flagged_by_observe_too(trace_path: Path) -> None:
    source = replay(trace_path)
    obs = source.observe(50)
    assert source.exhausted and obs["q_cmp_obs"] == source.truth(49).q_cmp


def test_phi_is_the_traces_ground_truth(trace_path: Path) -> None:
    assert replay(trace_path, stage=1).phi(3) == 1.5 and replay(trace_path, stage=0).phi(3) == 1.0


def test_stage_outside_trace_is_a_config_error(trace_path: Path) -> None:
    with pytest.raises(ConfigError, match="stage 3"):
        replay(trace_path, stage=3)


# --- inject ----------------------------------------------------------------------------------


def test_sleep_is_phi_minus_one_times_compute() -> None:
    assert sleep_ms_for(20.0, 1.5) == pytest.approx(10.0) and sleep_ms_for(20.0, 1.0) == 0.0


@pytest.mark.parametrize(("compute_ms", "phi"), [(10.0, 0.9), (10.0, math.inf), (-1.0, 1.5)])
def test_invalid_injection_is_refused(compute_ms: float, phi: float) -> None:
    with pytest.raises(ValueError):
        sleep_ms_for(compute_ms, phi)


def test_inject_sleeps_the_computed_time() -> None:
    asked: list[float] = []
    inject(20.0, 1.5, sleep=asked.append)
    assert asked == [pytest.approx(0.010)]


def test_inject_really_sleeps() -> None:
    slept_ms = inject(40.0, 1.5)  # 20 ms; only the lower bound is tight on a busy machine
    assert 19.0 <= slept_ms < 500.0


def test_inject_without_drift_does_not_sleep() -> None:
    asked: list[float] = []
    assert inject(20.0, 1.0, sleep=asked.append) == 0.0 and asked == []


# --- make_source -----------------------------------------------------------------------------


def config(**kw: object) -> DriftConfig:
    base = {"name": "one_slow_node", "source": DriftSource.replay, "length_tokens": 40}
    return DriftConfig(**{**base, **kw})


def test_make_source_generates_the_trace_into_the_run_dir(tmp_path: Path) -> None:
    source = make_source(config(), stage=1, num_stages=3, run_id="r", run_dir=tmp_path)
    assert isinstance(source, ReplaySource) and source.phi(0) == 1.5
    assert read_trace(tmp_path / TRACE_RELPATH).header.profile == "one_slow_node"


def test_make_source_without_run_dir_replays_in_memory() -> None:
    a = make_source(config(), stage=0, num_stages=3, run_id="r", run_dir=None)
    b = make_source(config(), stage=0, num_stages=3, run_id="r", run_dir=None)
    assert a is not None and b is not None and a.observe(7) == b.observe(7)


def test_make_source_reads_a_given_trace(trace_path: Path) -> None:
    source = make_source(
        config(trace=str(trace_path)), stage=1, num_stages=3, run_id="r", run_dir=None
    )
    assert isinstance(source, ReplaySource) and source.num_tokens == 50


def test_make_source_rejects_a_trace_for_another_ring(trace_path: Path) -> None:
    with pytest.raises(ConfigError, match="3 stages; the ring has 4"):
        make_source(config(trace=str(trace_path)), stage=1, num_stages=4, run_id="r", run_dir=None)


def test_make_source_is_none_when_drift_is_off() -> None:
    cfg = config(name="none", source=DriftSource.none)
    assert make_source(cfg, stage=0, num_stages=3, run_id="r", run_dir=None) is None


def test_make_source_refuses_zero_noise() -> None:
    with pytest.raises(ConfigError, match="noise_var_degc2"):
        make_source(config(noise_var_degc2=0.0), stage=0, num_stages=3, run_id="r", run_dir=None)


def test_make_source_refuses_a_profile_read_live() -> None:
    with pytest.raises(ConfigError, match="live"):
        make_source(
            config(source=DriftSource.live), stage=0, num_stages=3, run_id="r", run_dir=None
        )


# --- tools -----------------------------------------------------------------------------------


def test_make_drift_trace_tool_writes_a_readable_trace(tmp_path: Path) -> None:
    out = tmp_path / "t.jsonl"
    argv = ["--profile", "oscillating", "--stages", "2", "--tokens", "30", "--out", str(out)]
    assert load_tool("make_drift_trace").main(argv) == 0
    trace = read_trace(out)
    assert (trace.header.profile, trace.header.num_stages, trace.num_tokens) == (
        "oscillating",
        2,
        30,
    )


def test_check_drift_source_passes_and_fails_on_zero_noise() -> None:
    tool = load_tool("check_drift_source")
    assert tool.main(["--no-live", "--tokens", "40"]) == 0
    assert tool.main(["--no-live", "--tokens", "40", "--noise-var", "0"]) == 1
