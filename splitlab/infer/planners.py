"""Planners: at each window barrier, the ring configuration (cuts) to move to, and why.

Pure: a planner takes a `WindowView` (the current cuts, the token, and what every stage
reported on its last ACK: window compute statistics and its drift observation) and returns a
`Decision`. Registered by name in `PLANNERS`.

- `noop`: never moves.
- `forced_shift`: at the first barrier at or after token `at_token`, shift boundary
  `boundary` by `shift_k` blocks (see `splitlab.infer.reshard.shift_cuts`); once.
- `adaptive`: moves boundaries toward the cuts with the lowest predicted TPOT. Each stage's time is
  modelled as `T_s(n) = F_s + n * r_s`: a fixed part (embeddings, final norm, head) and a
  per-block rate, both measured over the last window (block time from hooks around the
  blocks, scaled by the stage's observed slowdown compute_ms / real_ms, so injected drift
  counts). With a calibrated cost model (`CostModel`, from a calibration JSON's decode fit
  `c0 + c1 * context`), the per-block rate is the model's, scaled by that slowdown. The ring
  carries one sequence, so a token visits every stage in turn and TPOT is the SUM of the
  stage times (plus links, which the cuts do not change): the target is the cuts minimising
  that sum, every stage keeping >= 1 block (ties: the smallest largest stage time, so equally
  fast stages share blocks evenly). Equalising stage times (min max) would be the objective
  of a pipelined ring with several sequences in flight; for one sequence it stops early: with
  rates 1, 3, 1 over 30 blocks min-max settles at 13/4/13 (38 units), min-sum goes on to
  14/1/15 (32). The planner moves only if the target beats the current sum by more than
  `hysteresis` (relative), and then by one block at one boundary per window, so it cannot
  oscillate on noise (between equally fast stages noise of +-e moves the sum by at most ~e).

    .venv/bin/pytest tests/unit/test_planner_core.py -q
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from splitlab.errors import ConfigError
from splitlab.infer.reshard import check_cuts, shift_cuts

MAX_CANDIDATES = 200_000  # exhaustive target search up to this many cut sets, else local search


@dataclass(frozen=True)
class StageStats:
    """One stage's window statistics (means over the window's decode tokens, in ms)."""

    stage: int
    num_blocks: int
    compute_ms: float  # measured compute incl. injected drift (what the ring pays)
    real_ms: float  # the real forward alone
    blocks_ms: float  # the part of real_ms spent inside the blocks
    tokens: int = 0  # decode tokens the means cover

    @classmethod
    def from_dict(cls, stage: int, d: Mapping[str, Any]) -> StageStats | None:
        try:
            stats = cls(stage=stage, num_blocks=int(d["num_blocks"]),
                        compute_ms=float(d["compute_ms"]), real_ms=float(d["real_ms"]),
                        blocks_ms=float(d["blocks_ms"]), tokens=int(d.get("tokens", 0)))  # fmt: skip
        except (KeyError, TypeError, ValueError):
            return None
        values = (stats.compute_ms, stats.real_ms, stats.blocks_ms)
        if stats.tokens < 1 or not all(math.isfinite(v) and v >= 0 for v in values):
            return None
        return stats


@dataclass(frozen=True)
class WindowView:
    token: int  # last token decoded under the current cuts
    cuts: tuple[int, ...]
    num_layers: int
    stats: tuple[StageStats | None, ...] = ()  # per stage, from the last barrier's ACKs
    obs: tuple[dict[str, float] | None, ...] = ()  # per stage drift observation (or None)
    context: int = 0  # tokens in the KV cache


@dataclass(frozen=True)
class Decision:
    cuts: tuple[int, ...]
    reason: str
    predicted_ms: tuple[float, ...] = ()  # per stage under `cuts` (adaptive only)

    def moves(self, current: Sequence[int]) -> bool:
        return tuple(current) != self.cuts


class Planner(Protocol):
    name: str

    def decide(self, view: WindowView) -> Decision: ...


class Noop:
    name = "noop"

    def decide(self, view: WindowView) -> Decision:
        return Decision(view.cuts, "noop")


@dataclass
class ForcedShift:
    at_token: int
    shift_k: int
    boundary: int
    fired: bool = False
    name: str = "forced_shift"

    def check(self, cuts: Sequence[int], num_layers: int) -> None:
        """Raises ConfigError now if the shift cannot apply to the starting cuts."""
        shift_cuts(cuts, boundary=self.boundary, k=self.shift_k, num_layers=num_layers)

    def decide(self, view: WindowView) -> Decision:
        if self.fired or view.token < self.at_token:
            return Decision(
                view.cuts, "forced_shift: waiting" if not self.fired else "forced_shift: done"
            )
        self.fired = True
        cuts = shift_cuts(
            view.cuts, boundary=self.boundary, k=self.shift_k, num_layers=view.num_layers
        )
        return Decision(cuts, f"forced_shift: b{self.boundary} {self.shift_k:+d} at token {view.token}")  # fmt: skip


@dataclass
class Scripted:
    """Tests and tools: a list of (at_token, boundary, shift_k) shifts, each applied once, in order."""

    shifts: list[tuple[int, int, int]]
    name: str = "scripted"

    def decide(self, view: WindowView) -> Decision:
        if not self.shifts or view.token < self.shifts[0][0]:
            return Decision(view.cuts, "scripted: waiting")
        at, boundary, k = self.shifts.pop(0)
        cuts = shift_cuts(view.cuts, boundary=boundary, k=k, num_layers=view.num_layers)
        return Decision(cuts, f"scripted: b{boundary} {k:+d} at token {view.token}")


@dataclass(frozen=True)
class CostModel:
    """Per-block decode time `c0 + c1 * context` (ms), from a calibration record's decode fit."""

    c0_ms: float
    c1_ms_per_token: float = 0.0

    def block_ms(self, context: int) -> float:
        return self.c0_ms + self.c1_ms_per_token * context

    @classmethod
    def from_calibration(cls, path: str | Path) -> CostModel:
        """Read `fits.decode.params` {c0, c1} of a calibration JSON (analysis.fits).

        Raises:
            ConfigError: naming planner.cost_model when the file or the fit is unusable.
        """
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
            params = (data.get("fits") or {}).get("decode") or data.get("decode") or {}
            params = params.get("params", params)
            model = cls(float(params["c0"]), float(params.get("c1", 0.0)))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ConfigError(f"planner.cost_model={path}: no usable decode fit ({exc})") from None
        if not (math.isfinite(model.c0_ms) and model.c0_ms > 0):
            raise ConfigError(f"planner.cost_model={path}: decode c0={model.c0_ms} must be > 0")
        return model


def stage_model(stats: StageStats, *, cost: CostModel | None, context: int) -> tuple[float, float]:
    """(fixed_ms, per_block_ms) of one stage, with its observed slowdown applied."""
    slowdown = max(1.0, stats.compute_ms / stats.real_ms) if stats.real_ms > 0 else 1.0
    blocks_ms = min(stats.blocks_ms, stats.real_ms)
    fixed = (stats.real_ms - blocks_ms) * slowdown
    if cost is not None:
        return fixed, cost.block_ms(context) * slowdown
    return fixed, blocks_ms / max(1, stats.num_blocks) * slowdown


def predict(cuts: Sequence[int], models: Sequence[tuple[float, float]], num_layers: int) -> tuple[float, ...]:  # fmt: skip
    bounds = [0, *cuts, num_layers]
    return tuple(f + (bounds[s + 1] - bounds[s]) * r for s, (f, r) in enumerate(models))


def _score(times: Sequence[float]) -> tuple[float, float]:
    """Predicted TPOT (the sum over stages) first, then the bottleneck."""
    return (sum(times), max(times))


def best_cuts(models: Sequence[tuple[float, float]], num_layers: int, *,
              start: Sequence[int]) -> tuple[int, ...]:  # fmt: skip
    """Cuts minimising (sum, max) of predicted stage times; exhaustive when affordable."""
    num_cuts = len(models) - 1
    if math.comb(num_layers - 1, num_cuts) <= MAX_CANDIDATES:
        candidates = itertools.combinations(range(1, num_layers), num_cuts)
        return min(candidates, key=lambda c: (*_score(predict(c, models, num_layers)), c != tuple(start)))  # fmt: skip
    current = tuple(start)  # local search by single-block steps (very deep rings)
    while True:
        step = min(_neighbours(current, num_layers), key=lambda c: _score(predict(c, models, num_layers)),
                   default=current)  # fmt: skip
        if _score(predict(step, models, num_layers)) >= _score(
            predict(current, models, num_layers)
        ):
            return current
        current = step


def _neighbours(cuts: tuple[int, ...], num_layers: int) -> list[tuple[int, ...]]:
    out = []
    for b in range(len(cuts)):
        for d in (-1, 1):
            c = list(cuts)
            c[b] += d
            try:
                out.append(check_cuts(c, num_layers))
            except ConfigError:
                pass
    return out


@dataclass
class Adaptive:
    hysteresis: float = 0.15
    cost: CostModel | None = None
    name: str = "adaptive"
    history: list[tuple[int, ...]] = field(default_factory=list)

    def decide(self, view: WindowView) -> Decision:
        stats = list(view.stats)
        if len(stats) != len(view.cuts) + 1 or any(s is None for s in stats):
            return Decision(view.cuts, "adaptive: waiting for every stage's window statistics")
        models = [stage_model(s, cost=self.cost, context=view.context) for s in stats]  # type: ignore[arg-type]
        now = predict(view.cuts, models, view.num_layers)
        target = best_cuts(models, view.num_layers, start=view.cuts)
        then = predict(target, models, view.num_layers)
        gain = (sum(now) - sum(then)) / sum(now) if sum(now) > 0 else 0.0
        if target == tuple(view.cuts) or gain <= self.hysteresis:
            return Decision(view.cuts, f"adaptive: hold (target {list(target)} gains {gain:.1%} "
                            f"<= hysteresis {self.hysteresis:.0%})", now)  # fmt: skip
        steps = []
        for b, (c, t) in enumerate(zip(view.cuts, target, strict=True)):
            if c != t:
                step = list(view.cuts)
                step[b] += 1 if t > c else -1
                steps.append(tuple(step))
        step = min(steps, key=lambda c: _score(predict(c, models, view.num_layers)))
        after = predict(step, models, view.num_layers)
        if sum(after) > sum(now):
            return Decision(view.cuts, f"adaptive: hold (a step toward {list(target)} raises the predicted TPOT)", now)  # fmt: skip
        self.history.append(step)
        return Decision(step, f"adaptive: toward {list(target)} (predicted TPOT {sum(now):.2f} -> "
                        f"{sum(then):.2f} ms, gain {gain:.1%})", after)  # fmt: skip


PLANNERS: dict[str, Callable[..., Planner]] = {
    "noop": lambda **_: Noop(),
    "forced_shift": lambda *, at_token, shift_k, boundary, **_: ForcedShift(at_token, shift_k, boundary),
    "scripted": lambda *, shifts, **_: Scripted([tuple(x) for x in shifts]),
    "adaptive": lambda *, hysteresis, cost_model=None, **_: Adaptive(
        hysteresis=hysteresis, cost=CostModel.from_calibration(cost_model) if cost_model else None),
}  # fmt: skip


def make_planner(name: str, **params: Any) -> Planner:
    """A planner by its registered name (params: the PlannerConfig fields).

    Raises:
        ConfigError: naming planner.name when it is not registered.
    """
    if name not in PLANNERS:
        raise ConfigError(f"planner.name={name!r}: choose from {sorted(PLANNERS)}")
    if name == "adaptive" and not 0 <= float(params.get("hysteresis", 0.15)) < 1:
        raise ConfigError(f"planner.hysteresis={params.get('hysteresis')}: must be in [0, 1)")
    return PLANNERS[name](**params)
