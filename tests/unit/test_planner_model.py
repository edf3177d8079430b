"""planner=model (splitlab.infer.planners.ModelPlanner): calibration, observations, migration cost.

.venv/bin/pytest tests/unit/test_planner_model.py -q
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from splitlab.config.schema import AdaptivePlannerConfig, ModelPlannerConfig
from splitlab.errors import ConfigError
from splitlab.infer.planners import (
    Adaptive,
    Calibration,
    CostModel,
    ModelPlanner,
    StageStats,
    WindowView,
    compute_trend,
    horizon_samples,
    link_outlook,
    make_planner,
    reachable,
    reachable_arrays,
)
from splitlab.infer.window import LinkRise

HIDDEN_BYTES, TOKEN_BYTES, KV_BYTES = 2304, 8, 1536  # SmolLM2's hidden state, token id, KV


def _stats(stage: int, n: int, *, per_block: float = 1.0, phi: float = 1.0,
           tail: bool = False) -> StageStats:  # fmt: skip
    return StageStats(stage=stage, num_blocks=n, compute_ms=n * per_block * phi,
                      real_ms=n * per_block, blocks_ms=n * per_block, tokens=10,
                      send_bytes=TOKEN_BYTES if tail else HIDDEN_BYTES,
                      kv_bytes_per_block_token=KV_BYTES)  # fmt: skip


def _obs(q_cmp: float = 0.5, q_mem: float = 0.4, link: float = 1.0) -> dict[str, float]:
    return {"theta_obs": 45.0, "q_cmp_obs": q_cmp, "q_mem_obs": q_mem, "link_obs": link}


def _view(cuts, phis=(1.0, 1.0, 1.0), obs=None, num_layers=30, context=8,
          remaining=None, token=40) -> WindowView:  # fmt: skip
    bounds = [0, *cuts, num_layers]
    stats = tuple(_stats(s, bounds[s + 1] - bounds[s], phi=p, tail=s == len(phis) - 1)
                  for s, p in enumerate(phis))  # fmt: skip
    return WindowView(token=token, cuts=tuple(cuts), num_layers=num_layers, stats=stats,
                      obs=tuple(obs or (_obs(),) * len(phis)), context=context,
                      remaining=remaining)  # fmt: skip


def _cheap() -> Calibration:
    """Loads at 1 ms a block; links of 0.5 ms + 1e-4 ms a byte (~80 Mbit/s) at nominal."""
    return Calibration(load_c1_ms=1.0, link_alpha_ms=0.5, link_beta_ms_per_byte=1e-4, defaults=())


def _moved(old: tuple[int, ...], new: tuple[int, ...], bypass: bool = False) -> tuple[list[int], list[int], list[int]]:  # fmt: skip
    """(blocks per stage, blocks each stage gains, blocks each gives) of `new` from `old`."""
    reach = reachable_arrays(old, 30, bypass)
    i = reach.row[new]
    return reach.blocks[i].tolist(), reach.received[i].tolist(), reach.given[i].tolist()


def test_blocks_received_and_reachable() -> None:
    assert _moved((10, 20), (14, 15)) == ([14, 1, 15], [4, 0, 5], [0, 9, 0])
    assert _moved((10, 20), (8, 22)) == ([8, 14, 8], [0, 4, 0], [2, 0, 2])
    assert _moved((10, 20), (15, 15), bypass=True) == ([15, 0, 15], [5, 0, 5], [0, 10, 0])
    assert (14, 15) in reachable_arrays((10, 20), 30, False).row
    assert (15, 15) not in reachable_arrays((10, 20), 30, False).row  # only with bypass
    with pytest.raises(ValueError):  # cached: read-only
        reachable_arrays((10, 20), 30, False).received[0, 0] = 1
    assert reachable((10, 20), (14, 15), 30) and reachable((10, 20), (20, 21), 30)
    assert not reachable((10, 20), (21, 25), 30)  # block 20 would go from stage 2 to 0


def test_model_jumps_to_the_best_reachable_cuts_in_one_reconfiguration() -> None:
    d = ModelPlanner(calibration=_cheap()).decide(_view((10, 20), phis=(1.0, 3.0, 1.0)))
    assert d.cuts == (14, 15)  # adaptive would take one block per window
    a = Adaptive(hysteresis=0.05).decide(_view((10, 20), phis=(1.0, 3.0, 1.0)))
    assert sum(abs(x - y) for x, y in zip(a.cuts, (10, 20), strict=True)) == 1


def test_model_sees_a_real_slowdown_that_a_calibration_cannot_know() -> None:
    """A CPU quota cut slows the blocks themselves (real_ms, no injected sleep): the measured
    block time carries it, the calibration only how it grows with context."""
    stats = (_stats(0, 10), _stats(1, 10, per_block=3.0), _stats(2, 10))
    view = WindowView(token=40, cuts=(10, 20), num_layers=30, stats=stats, context=48)
    cal = Calibration(decode=CostModel(1.0, 0.001), load_c1_ms=1.0, defaults=())
    assert ModelPlanner(calibration=cal).decide(view).cuts == (14, 15)


def test_model_holds_when_migration_costs_more_than_the_horizon_saves() -> None:
    dear = Calibration(load_c1_ms=1000.0, defaults=())
    planner = ModelPlanner(calibration=dear, horizon_tokens=16)
    d = planner.decide(_view((10, 20), phis=(1.0, 3.0, 1.0)))
    assert d.cuts == (10, 20) and "migration" in d.reason


def test_model_holds_on_a_slow_link_that_no_cut_removes() -> None:
    """Every token crosses every hop: a link at 2% of its rate raises the predicted TPOT but
    moving blocks would not lower it, so the planner does not pay a migration for it."""
    obs = (_obs(), _obs(link=0.02), _obs())
    d = ModelPlanner(calibration=_cheap()).decide(_view((10, 20), obs=obs))
    assert d.cuts == (10, 20) and "links" in d.reason


def test_model_with_bypass_routes_around_a_slow_link_in_one_reconfiguration() -> None:
    """With `architecture.bypass` the model can empty the stage behind the link: its blocks go
    to both neighbours (balanced: equal rates, ties by the smaller largest stage) and the ring
    skips it, one hop fewer. Each hop is its sender's bytes over its link: stage 1's hidden
    state at 5% of the rate costs 0.5 + 2304 x 1e-4 / 0.05 = 5.11 ms."""
    obs = (_obs(), _obs(link=0.05), _obs())
    planner = ModelPlanner(calibration=_cheap(), bypass=True)

    d = planner.decide(_view((10, 20), obs=obs))

    assert d.cuts == (15, 15) and "links 6.34 -> 1.23 ms" in d.reason, d.reason
    assert d.predicted_ms[1] == 0.0  # skipped: no time
    assert ModelPlanner(calibration=_cheap()).decide(_view((10, 20), obs=obs)).cuts == (10, 20)


def test_model_weighs_the_moved_kv_against_the_tokens_left() -> None:
    """Leaving the slow link sends the 10 moved blocks' KV over it: 10 x context x 1536 bytes
    against one hidden state (2304 bytes) saved per token, so it pays only over ~6.7 x context
    tokens. At context 8 the 64-token horizon pays; 30 tokens left do not; at context 40 it
    takes a horizon of ~270 tokens, which a long generation has and a short one does not."""
    obs = (_obs(), _obs(link=0.05), _obs())

    def decide(context: int, remaining: int | None, horizon: int = 64):
        planner = ModelPlanner(calibration=_cheap(), bypass=True, horizon_tokens=horizon)
        return planner.decide(_view((10, 20), obs=obs, context=context, remaining=remaining))

    assert decide(8, None).cuts == (15, 15)
    d = decide(8, 30)
    assert d.cuts == (10, 20) and "x 30 tokens <= migration" in d.reason, d.reason
    d = decide(40, None)
    assert d.cuts == (10, 20) and "x 64 tokens <= migration" in d.reason, d.reason
    assert decide(40, 400, horizon=512).cuts == (15, 15)
    assert decide(40, 200, horizon=512).cuts == (10, 20)


def test_model_leaves_a_falling_link_for_what_it_will_cost_over_the_horizon() -> None:
    """A link that fell 0.2 -> 0.1 over the last 5 tokens is projected on (`link_outlook`:
    its slowdown 5 -> 10 rises by 1 a token, 42 on average over the next 64): leaving it pays
    more than the hysteresis asks, where a link steady at 0.1 (a 2.8 ms hop of ~34) does not."""
    planner = ModelPlanner(calibration=_cheap(), bypass=True, hysteresis=0.1)
    planner.decide(_view((10, 20), obs=(_obs(), _obs(link=0.2), _obs()), token=35))
    d = planner.decide(_view((10, 20), obs=(_obs(), _obs(link=0.1), _obs()), token=40))
    assert d.cuts == (15, 15), d.reason
    steady = ModelPlanner(calibration=_cheap(), bypass=True, hysteresis=0.1)
    steady.decide(_view((10, 20), obs=(_obs(), _obs(link=0.1), _obs()), token=35))
    d = steady.decide(_view((10, 20), obs=(_obs(), _obs(link=0.1), _obs()), token=40))
    assert d.cuts == (10, 20) and "hysteresis" in d.reason, d.reason


def test_model_on_a_shaped_link_pays_a_hop_only_once_the_link_bounds_the_token() -> None:
    """Behind a token bucket (`link_bucket_bytes`) a hidden state that fits passes at line
    speed once the bucket refilled during the rest of the token: the hop costs its latency
    until bytes / rate exceeds the token's time, then the link sets the token period. At 0.05
    of the rate a serial link adds 4.6 ms to a ~31 ms token (leave it); the shaped one adds
    nothing but its latency (stay). At 0.005 the shaped link allows a token per 46 ms: leaving
    saves ~15 ms a token, which 512 tokens pay for and the moved KV's ~2.5 s (64 tokens) not."""
    shaped = Calibration(load_c1_ms=1.0, link_alpha_ms=0.5, link_beta_ms_per_byte=1e-4,
                         link_bucket_bytes=4096, defaults=())  # fmt: skip
    assert shaped.hop_ms(HIDDEN_BYTES, 0.05) == pytest.approx((0.5, 4.608))
    assert shaped.hop_ms(10_000, 0.05) == pytest.approx((0.5 + 5904 * 2e-3, 20.0))
    assert _cheap().hop_ms(HIDDEN_BYTES, 0.05) == pytest.approx((5.108, 0.0))

    def decide(cal: Calibration, link: float, horizon: int = 512):
        obs = (_obs(), _obs(link=link), _obs())
        planner = ModelPlanner(calibration=cal, bypass=True, horizon_tokens=horizon)
        return planner.decide(_view((10, 20), obs=obs))

    assert decide(_cheap(), 0.05).cuts == (15, 15)
    d = decide(shaped, 0.05)
    assert d.cuts == (10, 20) and "saves 0.50 ms" in d.reason, d.reason
    d = decide(shaped, 0.005)
    assert d.cuts == (15, 15) and "links 16.08 -> 1.00 ms" in d.reason, d.reason
    d = decide(shaped, 0.005, horizon=64)
    assert d.cuts == (10, 20) and "x 64 tokens <= migration" in d.reason, d.reason


def test_model_takes_the_link_trend_a_stage_measured_since_decode_start() -> None:
    """The first barrier's decision has one observation per stage; the stage's ACK carries its
    link slowdown's rise since decode start (`LinkRise`), so a link falling fast is priced
    at the first barrier, not the second. The live ring: test_planner_model_ring."""

    def view(rise: float | None) -> WindowView:
        stats = tuple(replace(st, link_rise_per_token=rise) if st else st
                      for st in _view((10, 20)).stats)  # fmt: skip
        return replace(_view((10, 20), obs=(_obs(), _obs(link=0.2), _obs())), stats=stats)

    hold = ModelPlanner(calibration=_cheap(), bypass=True, hysteresis=0.1).decide(view(None))
    assert hold.cuts == (10, 20), hold.reason
    move = ModelPlanner(calibration=_cheap(), bypass=True, hysteresis=0.1).decide(view(0.5))
    assert move.cuts == (15, 15), move.reason
    # observed at token 35 for the barrier of token 40 (a decision taken a window ahead): the
    # moved KV crosses the link at slowdown 5 + 0.5 x 6, not 5 + 0.5
    late = replace(view(0.5), stats=tuple(replace(st, link_obs_token=35)
                                          for st in view(0.5).stats))  # fmt: skip
    later = ModelPlanner(calibration=_cheap(), bypass=True, hysteresis=0.1).decide(late)

    def migration_ms(reason: str) -> float:
        return float(reason.split("migration ")[1].split(" ms")[0])

    assert migration_ms(later.reason) > 1.3 * migration_ms(move.reason), later.reason
    rise = LinkRise()
    assert rise.mark(0, _obs(link=1.0)) is None
    assert rise.mark(5, _obs(link=0.2)) == pytest.approx(0.8)  # slowdown 1 -> 5 in 5 tokens
    assert rise.mark(10, {"link_obs": float("nan")}) is None and rise.last is None
    assert StageStats.from_dict(0, {**_stats(0, 1).__dict__, "link_rise_per_token": 0.8})
    assert not StageStats.from_dict(0, {**_stats(0, 1).__dict__, "link_rise_per_token": "inf"})


def test_model_keeps_each_stage_within_its_cpu_budget() -> None:
    """Routing around stage 1, the faster tail would take all 10 blocks (sum 26 against 27
    at 15/15); on 0.5-core hosts a stage computing 16 ms a token needs tokens of >= 32 ms, so
    the blocks are shared so that neither stage's compute outruns its budget."""
    obs = (_obs(), _obs(link=0.05), _obs())

    def decide(cores: float | None):
        stats = (_stats(0, 10), _stats(1, 10), _stats(2, 10, per_block=0.8, tail=True))
        stats = tuple(replace(st, cpu_cores=cores) for st in stats)
        view = replace(_view((10, 20), obs=obs), stats=stats)
        return ModelPlanner(calibration=_cheap(), bypass=True).decide(view)

    assert decide(None).cuts == (10, 10)
    assert decide(2.0).cuts == (10, 10)  # a budget over its threads does not bind
    d = decide(0.5)
    assert d.cuts[0] == d.cuts[1] and 12 <= d.cuts[0] <= 14, d.reason
    assert StageStats.from_dict(0, {**_stats(0, 1).__dict__, "cpu_cores": 0.5}).cpu_cores == 0.5
    assert not StageStats.from_dict(0, {**_stats(0, 1).__dict__, "cpu_cores": 0})
    assert not StageStats.from_dict(0, {**_stats(0, 1).__dict__, "threads": 0})


def test_model_moves_at_once_when_only_the_links_make_the_move_pay() -> None:
    """`confirm` guards against one window's timings; a link's rate is an observation. A
    route-around that pays only because of the link is taken at the first barrier; a move a
    slow stage's timing asks for still waits for its second."""
    planner = ModelPlanner(calibration=_cheap(), bypass=True, confirm=2)
    d = planner.decide(_view((10, 20), obs=(_obs(), _obs(link=0.05), _obs())))
    assert d.cuts == (15, 15), d.reason
    planner = ModelPlanner(calibration=_cheap(), bypass=True, confirm=2)
    d = planner.decide(_view((10, 20), phis=(1.0, 3.0, 1.0)))
    assert d.cuts == (10, 20) and "1 of planner.confirm=2" in d.reason, d.reason


def test_model_with_a_skipped_stage_plans_without_its_statistics() -> None:
    """A skipped stage measures no block time: it is guessed at its faster neighbour's rate.
    Behind a link still slow it stays skipped (head and tail cannot trade blocks over it: KV
    moves between neighbours only); with its link back it takes the slow tail's blocks."""
    stats = (_stats(0, 15), None, _stats(2, 15, per_block=3.0, tail=True))

    def view(link: float) -> WindowView:
        return WindowView(token=40, cuts=(15, 15), num_layers=30, stats=stats,
                          obs=(_obs(), _obs(link=link), _obs()))  # fmt: skip

    d = ModelPlanner(calibration=_cheap(), bypass=True).decide(view(0.001))  # a 231 ms hop
    assert "waiting" not in d.reason and d.cuts == (15, 15), d.reason
    d = ModelPlanner(calibration=_cheap(), bypass=True).decide(view(1.0))
    assert d.cuts[0] == 15 and d.cuts[1] > 15, d.reason


def test_link_outlook_carries_a_fall_on_never_a_rise() -> None:
    assert link_outlook(_obs(link=1.0), _obs(link=0.5), 5) == pytest.approx((2.0, 0.2))
    assert link_outlook(_obs(link=0.5), _obs(link=0.8), 5) == pytest.approx((1.25, 0.0))
    assert link_outlook(None, _obs(link=0.5), 5) == pytest.approx((2.0, 0.0))
    assert link_outlook(_obs(link=1.0), _obs(link=0.5), None) == pytest.approx((2.0, 0.0))
    assert horizon_samples(0) == [0.0] and horizon_samples(2) == [0.5, 1.5]
    assert len(horizon_samples(1000)) == 16 and sum(horizon_samples(1000)) / 16 == 500


def test_model_moves_only_on_a_target_confirmed_barriers_in_a_row() -> None:
    planner = ModelPlanner(calibration=_cheap(), confirm=2)
    slow = _view((10, 20), phis=(1.0, 3.0, 1.0))

    first = planner.decide(slow)
    assert first.cuts == (10, 20) and "1 of planner.confirm=2" in first.reason
    assert planner.decide(slow).cuts == (14, 15)
    planner.decide(slow)  # picked once more, then one window says the stage is fine again
    assert planner.decide(_view((10, 20))).cuts == (10, 20)
    assert planner.decide(slow).cuts == (10, 20)  # the count starts over
    with pytest.raises(ConfigError, match="planner.confirm=0"):
        make_planner(ModelPlannerConfig(confirm=0))


def test_model_confirms_a_move_that_still_pays_when_near_equal_targets_trade_places() -> None:
    """Stage 1 is slow at both barriers; which neighbour should take its blocks flips with a
    10% reading (the old rule, the same argmin twice, held through all of link_degrade)."""
    lean_head, lean_tail = _view((10, 20), (1.1, 3.0, 1.0)), _view((10, 20), (1.0, 3.0, 1.1))
    assert ModelPlanner(calibration=_cheap()).decide(lean_head).cuts == (9, 10)
    assert ModelPlanner(calibration=_cheap()).decide(lean_tail).cuts == (20, 21)
    planner = ModelPlanner(calibration=_cheap(), confirm=2)

    assert planner.decide(lean_head).cuts == (10, 20)
    moved = planner.decide(lean_tail)  # (9, 10) still pays on these figures: it is confirmed
    assert moved.cuts == (9, 10) and moved.reason.startswith("model: to [9, 10]")
    assert planner.pending is None


def test_model_gives_no_blocks_to_a_stage_under_memory_pressure() -> None:
    obs = (_obs(q_mem=0.95), _obs(), _obs())
    d = ModelPlanner(calibration=_cheap()).decide(_view((10, 20), phis=(1.0, 3.0, 1.0), obs=obs))
    assert d.cuts[0] == 10 and d.cuts[1] < 20  # the slow stage sheds to stage 2 only


def test_compute_trend_reads_the_rise_of_q_cmp_until_it_saturates() -> None:
    assert compute_trend(_obs(q_cmp=0.4), _obs(q_cmp=0.6)) == pytest.approx(1.5)
    assert compute_trend(_obs(q_cmp=0.6), _obs(q_cmp=1.0)) == 1.0
    assert compute_trend(None, _obs()) == 1.0


def test_model_moves_earlier_than_the_window_mean_says_when_load_is_rising() -> None:
    """Measured slowdown 1.04 (inside hysteresis) but q_cmp rose 0.45 -> 0.72 since the last
    barrier: the model predicts the next window ~1.66x slow and moves now."""
    planner = ModelPlanner(calibration=_cheap(), hysteresis=0.05)
    planner.decide(_view((10, 20), obs=(_obs(), _obs(q_cmp=0.45), _obs())))
    rising = (_obs(), _obs(q_cmp=0.72), _obs())
    d = planner.decide(_view((10, 20), phis=(1.0, 1.04, 1.0), obs=rising))
    assert d.cuts[1] - d.cuts[0] < 10
    still = ModelPlanner(calibration=_cheap(), hysteresis=0.05)
    assert still.decide(_view((10, 20), phis=(1.0, 1.04, 1.0))).cuts == (10, 20)


def test_calibration_reads_calibrate_output_and_says_what_is_default(tmp_path) -> None:
    record = {"decode": {"params": {"c0": 0.8, "c1": 0.001}},
              "link": {"alpha_ms": 0.3, "beta_ms_per_byte": 2e-6},
              "weight_load_ms": {"ms": 12.0, "cache": "warm"}}  # fmt: skip
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"version": 1, "records": {"m|cpu|float32": record}}))
    cal = Calibration.read(path)
    assert cal.decode == CostModel(0.8, 0.001) and cal.link_alpha_ms == 0.3
    assert cal.message_ms(1000, 0.5) == pytest.approx(0.3 + 1000 * 2e-6 / 0.5)
    assert cal.load_ms(3) == pytest.approx(36.0) and cal.defaults == ()
    load = {"fixed_ms": 5.0, "per_block_ms": 10.0, "r2": 0.99, "cache": "cold"}
    path.write_text(json.dumps({**record, "load": load, "link": {}}))
    cal = Calibration.read(path)
    assert cal.load_ms(2) == pytest.approx(25.0) and cal.defaults == ("link",)
    assert Calibration.read(None).defaults == ("decode", "load", "link")


def test_a_calibration_of_several_records_needs_its_key(tmp_path) -> None:
    def record(c0: float) -> dict:
        return {"decode": {"params": {"c0": c0, "c1": 0.0}}, "link": {"alpha_ms": 0.3}}

    path = tmp_path / "cal.json"
    path.write_text(
        json.dumps(
            {"version": 1, "records": {"a|cpu|float32": record(0.8), "b|cpu|float32": record(2.0)}}
        )
    )
    with pytest.raises(
        ConfigError, match=r"planner.calibration=.*'a\|cpu\|float32'.*calibration_key"
    ):
        make_planner(ModelPlannerConfig(calibration=str(path)))  # never the first by position
    planner = make_planner(ModelPlannerConfig(calibration=str(path),
                                              calibration_key="b|cpu|float32"))  # fmt: skip
    assert planner.calibration.decode == CostModel(2.0, 0.0)
    with pytest.raises(ConfigError, match="'c' not in"):
        make_planner(ModelPlannerConfig(calibration=str(path), calibration_key="c"))
    adaptive = make_planner(
        AdaptivePlannerConfig(cost_model=str(path), calibration_key="a|cpu|float32")
    )
    assert adaptive.cost == CostModel(0.8, 0.0)


def test_make_planner_model_names_bad_values(tmp_path) -> None:
    with pytest.raises(ConfigError, match="planner.horizon_tokens"):
        make_planner(ModelPlannerConfig(horizon_tokens=0))
    with pytest.raises(ConfigError, match="planner.calibration"):
        make_planner(ModelPlannerConfig(calibration=str(tmp_path / "missing.json")))
    assert isinstance(make_planner(ModelPlannerConfig()), ModelPlanner)
