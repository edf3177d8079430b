"""Planners (splitlab.infer.planners): noop, forced_shift, adaptive with hysteresis, cost model."""

from __future__ import annotations

import json

import pytest

from splitlab.config.schema import AdaptivePlannerConfig, NoopPlannerConfig, PlannerConfig
from splitlab.errors import ConfigError
from splitlab.infer.planners import (
    Adaptive,
    CostModel,
    ForcedShift,
    StageStats,
    WindowView,
    best_cuts,
    make_planner,
    predict,
    stage_model,
)
from splitlab.infer.reshard import check_cuts


def _stats(
    stage: int, n: int, *, per_block: float = 1.0, fixed: float = 0.0, phi: float = 1.0
) -> StageStats:
    real = fixed + n * per_block
    return StageStats(stage=stage, num_blocks=n, compute_ms=real * phi, real_ms=real,
                      blocks_ms=n * per_block, tokens=20)  # fmt: skip


def _view(cuts, stats, token=40, num_layers=30) -> WindowView:
    return WindowView(token=token, cuts=tuple(cuts), num_layers=num_layers, stats=tuple(stats))


def test_noop_never_moves() -> None:
    d = make_planner(NoopPlannerConfig()).decide(_view([10, 20], []))
    assert d.cuts == (10, 20) and not d.moves((10, 20))


def test_forced_shift_fires_once_at_or_after_its_token() -> None:
    p = ForcedShift(at_token=100, shift_k=-2, boundary=2)
    assert p.decide(_view([10, 20], [], token=80)).cuts == (10, 20)
    assert p.decide(_view([10, 20], [], token=100)).cuts == (10, 18)
    assert p.decide(_view([10, 18], [], token=120)).cuts == (10, 18)


def test_forced_shift_check_refuses_an_impossible_plan_up_front() -> None:
    with pytest.raises(ConfigError, match="planner.boundary"):
        ForcedShift(at_token=1, shift_k=1, boundary=3).check((10, 20), 30)


def test_stage_model_separates_fixed_cost_and_applies_the_slowdown() -> None:
    fixed, rate = stage_model(
        _stats(2, 10, per_block=1.0, fixed=8.0, phi=1.5), cost=None, context=0
    )
    assert fixed == pytest.approx(12.0) and rate == pytest.approx(1.5)
    fixed, rate = stage_model(_stats(1, 10, phi=2.0), cost=CostModel(0.5, 0.01), context=100)
    assert rate == pytest.approx((0.5 + 1.0) * 2.0)


def test_best_cuts_minimises_predicted_tpot() -> None:
    """One sequence in flight: TPOT is the sum of stage times, so blocks leave the slow stage
    down to one; equally fast stages share the rest evenly (ties go to the smaller max)."""
    models = [(0.0, 1.0), (0.0, 3.0), (0.0, 1.0)]
    cuts = best_cuts(models, 30, start=(10, 20))
    assert cuts == (14, 15)
    assert sum(predict(cuts, models, 30)) == pytest.approx(32.0)  # min-max would stop at 38
    assert sum(predict((13, 17), models, 30)) == pytest.approx(38.0)


def test_best_cuts_balances_the_max_when_every_block_costs_the_same() -> None:
    models = [(2.0, 1.0), (0.0, 1.0), (3.0, 1.0)]
    # the sum is the same for every cut set: the tie goes to the smallest max (12, 12, 12)
    assert best_cuts(models, 30, start=(10, 20)) == (9, 21)


def test_adaptive_moves_one_block_per_window_off_the_slow_stage() -> None:
    planner = Adaptive(hysteresis=0.05)
    cuts = (10, 20)
    seen, tpot = [], []
    for _ in range(14):
        n = [cuts[0], cuts[1] - cuts[0], 30 - cuts[1]]
        stats = [_stats(0, n[0]), _stats(1, n[1], phi=3.0), _stats(2, n[2])]
        tpot.append(n[0] + 3 * n[1] + n[2])
        d = planner.decide(_view(cuts, stats))
        assert sum(abs(a - b) for a, b in zip(d.cuts, cuts, strict=True)) <= 1
        seen.append(d.cuts)
        cuts = d.cuts
    assert cuts[1] - cuts[0] < 4  # past min-max's 13/4/13: the sum is what one token pays
    assert all(b <= a for a, b in zip(tpot, tpot[1:], strict=False))  # never a step back
    assert tpot[-1] < 0.7 * tpot[0]
    assert seen[-1] == seen[-2]  # settled, no oscillation


def test_adaptive_holds_inside_hysteresis() -> None:
    stats = [_stats(0, 10), _stats(1, 10, phi=1.05), _stats(2, 10)]
    d = Adaptive(hysteresis=0.15).decide(_view([10, 20], stats))
    assert d.cuts == (10, 20) and "hold" in d.reason


def test_adaptive_waits_for_every_stage() -> None:
    d = Adaptive().decide(_view([10, 20], [_stats(0, 10), None, _stats(2, 10)]))
    assert d.cuts == (10, 20) and "waiting" in d.reason


def test_adaptive_does_not_oscillate_under_noise() -> None:
    """Balanced stages with +-5% noise: the planner holds on every window."""
    import random

    rng = random.Random(0)
    planner = Adaptive(hysteresis=0.15)
    for _ in range(50):
        stats = [_stats(s, 10, per_block=1.0 + rng.uniform(-0.05, 0.05)) for s in range(3)]
        assert planner.decide(_view([10, 20], stats)).cuts == (10, 20)


def test_cost_model_from_calibration_json(tmp_path) -> None:
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"fits": {"decode": {"params": {"c0": 0.8, "c1": 0.001}}}}))
    assert CostModel.from_calibration(path) == CostModel(0.8, 0.001)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"fits": {"decode": None}}))
    with pytest.raises(ConfigError, match="planner.cost_model"):
        CostModel.from_calibration(bad)


def test_make_planner_names_bad_values() -> None:
    with pytest.raises(ConfigError, match="planner.name"):
        make_planner(PlannerConfig(name="greedy"))
    with pytest.raises(ConfigError, match="planner.hysteresis"):
        make_planner(AdaptivePlannerConfig(hysteresis=1.5))
    assert make_planner(AdaptivePlannerConfig(hysteresis=0.2, cost_model=None)).hysteresis == 0.2


def test_make_planner_refuses_another_planners_schema() -> None:
    with pytest.raises(ConfigError, match="AdaptivePlannerConfig"):
        make_planner(NoopPlannerConfig(name="adaptive"))


def test_adaptive_never_proposes_a_stage_without_blocks() -> None:
    """From 5/1/6 toward 10/1/1 the one-block step at b_1 would empty stage 1: not proposed."""
    stats = [_stats(0, 5), _stats(1, 1, phi=3.0), _stats(2, 6, per_block=2.0)]
    d = Adaptive(hysteresis=0.05).decide(_view([5, 6], stats, num_layers=12))
    check_cuts(d.cuts, 12)


def _link(factor: float) -> dict[str, float]:
    return {"theta_obs": 1.0, "q_cmp_obs": 0.5, "q_mem_obs": 0.1, "link_obs": factor}


def test_adaptive_with_bypass_routes_around_a_stage_behind_a_slow_link() -> None:
    stats = [_stats(0, 10), _stats(1, 10), _stats(2, 10)]
    slow = [_link(1.0), _link(0.3), _link(1.0)]
    view = WindowView(token=20, cuts=(10, 20), num_layers=30, stats=tuple(stats), obs=tuple(slow))
    assert Adaptive().decide(view).cuts == (10, 20)  # without bypass no cut removes a hop

    d = Adaptive(bypass=True).decide(view)
    assert d.cuts == (15, 15) and "route around stage 1" in d.reason  # split evenly
    check_cuts(d.cuts, 30, bypass=True)
    # a slower left neighbour gets fewer of the blocks
    stats[0] = _stats(0, 10, per_block=3.0)
    d = Adaptive(bypass=True).decide(
        WindowView(token=20, cuts=(10, 20), num_layers=30, stats=tuple(stats), obs=tuple(slow))
    )
    assert d.cuts == (10, 10)
    # compute-only (planner.links=false): blind to the link, bypass or not
    only = make_planner(AdaptivePlannerConfig(links=False), bypass=True)
    assert only.decide(view).cuts == (10, 20)


def test_adaptive_balances_the_stages_that_own_blocks_while_one_is_skipped() -> None:
    planner = Adaptive(bypass=True, hysteresis=0.05)
    # four stages, stage 2 skipped (no stats): blocks move between 0 and 1, never over stage 2
    stats = (_stats(0, 8, per_block=3.0), _stats(1, 7), None, _stats(3, 15))
    slow = (_link(1.0), _link(1.0), _link(0.3), _link(1.0))
    d = planner.decide(WindowView(token=40, cuts=(8, 15, 15), num_layers=30, stats=stats, obs=slow))
    assert d.cuts == (7, 15, 15) and "toward" in d.reason
    # three stages, stage 1 skipped: the head and the tail are not neighbours, nothing moves
    stats3 = (_stats(0, 15, per_block=3.0), None, _stats(2, 15))
    view = WindowView(token=40, cuts=(15, 15), num_layers=30, stats=stats3, obs=slow[1:])
    assert planner.decide(view).cuts == (15, 15)


def test_adaptive_gives_a_skipped_stage_a_block_back_when_its_link_recovers() -> None:
    planner = Adaptive(bypass=True)
    stats = (_stats(0, 15), None, _stats(2, 15, per_block=2.0))
    back = (_link(1.0), _link(0.95), _link(1.0))
    d = planner.decide(WindowView(token=60, cuts=(15, 15), num_layers=30, stats=stats, obs=back))
    assert d.cuts == (15, 16) and "link is back" in d.reason  # from the slower stage 2
    held = (_link(1.0), _link(0.6), _link(1.0))  # between link_low and link_high: stays skipped
    d = planner.decide(WindowView(token=60, cuts=(15, 15), num_layers=30, stats=stats, obs=held))
    assert d.cuts[0] == d.cuts[1]


def test_adaptive_link_thresholds_are_checked() -> None:
    with pytest.raises(ConfigError, match="planner.link_low"):
        make_planner(AdaptivePlannerConfig(link_low=0.9, link_high=0.5))
    planner = make_planner(AdaptivePlannerConfig(), bypass=True)
    assert isinstance(planner, Adaptive) and planner.bypass


def test_adaptive_backs_off_after_a_move_that_did_not_commit() -> None:
    planner = Adaptive(bypass=True)
    stats = (_stats(0, 10), _stats(1, 10), _stats(2, 10))
    slow = (_link(1.0), _link(0.3), _link(1.0))
    view = WindowView(token=20, cuts=(10, 20), num_layers=30, stats=stats, obs=slow)
    reasons = [planner.decide(view).reason for _ in range(7)]  # every proposal NACKed
    moves = [i for i, r in enumerate(reasons) if "route around" in r]
    assert moves == [0, 2, 5], reasons  # held 1, then 2 barriers (then 4, ...)
    done = WindowView(token=20, cuts=(15, 15), num_layers=30, stats=stats, obs=slow)
    planner = Adaptive(bypass=True)
    planner.decide(view)
    assert "backing off" not in planner.decide(done).reason  # committed: no back-off
