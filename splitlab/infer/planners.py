"""Planners: at each window barrier, the ring configuration (cuts) to move to, and why.

Pure: a planner takes a `WindowView` (the current cuts, the token, and what every stage
reported on its last ACK: window compute statistics and its drift observation) and returns a
`Decision`. Registered by name in `PLANNERS` (`register_planner`) with the schema of its
parameters (`splitlab.config.schema`); `make_planner(cfg)` builds one from that typed config.

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
  With `architecture.bypass` it also reads `link_obs`: a middle stage behind a link below
  `link_low` gives all its blocks to its neighbours at once (the ring then skips it), balancing
  runs over the stages that own blocks, and a skipped stage takes a block back at `link_high`.
  `planner.links=false` keeps it compute-only (the link rule never runs, bypass or not).
- `model` (`ModelPlanner`): the same stage model from a calibration (`Calibration`: decode fit,
  L_n, link latency and per-byte time; defaults named where the file is silent) corrected by
  the observations (compute trend from q_cmp_obs, each hop's bytes over its link at link_obs
  carried on over the horizon at its trend, a shaped link's token bucket, no blocks to a stage
  at q_mem_obs >= `mem_high`), and a migration cost (L_n summed over
  receivers, the moved KV over each donor's link) against the gain over `horizon_tokens` or
  the tokens left; it jumps to the best cuts one reconfiguration reaches, not one block.

    .venv/bin/pytest tests/unit/test_planner_core.py tests/unit/test_planner_model.py -q
"""

from __future__ import annotations

import functools
import itertools
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from splitlab.analysis.fits import load_cost, select_record
from splitlab.config.schema import (
    AdaptivePlannerConfig,
    ForcedShiftPlannerConfig,
    ModelPlannerConfig,
    NoopPlannerConfig,
    PlannerConfig,
)
from splitlab.errors import ConfigError, registered
from splitlab.infer.reshard import check_cuts, moves_between, shift_cuts
from splitlab.infer.route import stage_blocks

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
    send_bytes: float = 0.0  # payload bytes the stage sent on the ring per token (its hop)
    kv_bytes_per_block_token: int = 0  # KV bytes of one block per cached token (0: unknown)
    link_rise_per_token: float | None = None  # its link slowdown's rise since its last observation
    link_obs_token: int | None = None  # the token its observation (link_obs, the rise) is from
    cpu_cores: float | None = None  # its host's CPU budget (cgroup quota; None: unlimited)
    threads: int = 1  # threads its compute runs on

    @classmethod
    def from_dict(cls, stage: int, d: Mapping[str, Any]) -> StageStats | None:
        try:
            stats = cls(stage=stage, num_blocks=int(d["num_blocks"]),
                        compute_ms=float(d["compute_ms"]), real_ms=float(d["real_ms"]),
                        blocks_ms=float(d["blocks_ms"]), tokens=int(d.get("tokens", 0)),
                        send_bytes=float(d.get("send_bytes", 0.0)),
                        kv_bytes_per_block_token=int(d.get("kv_bytes_per_block_token", 0)),
                        link_rise_per_token=(None if d.get("link_rise_per_token") is None
                                             else float(d["link_rise_per_token"])),
                        link_obs_token=(None if d.get("link_obs_token") is None
                                        else int(d["link_obs_token"])),
                        cpu_cores=None if d.get("cpu_cores") is None else float(d["cpu_cores"]),
                        threads=int(d.get("threads", 1)))  # fmt: skip
        except (KeyError, TypeError, ValueError):
            return None
        if stats.link_rise_per_token is not None and not math.isfinite(stats.link_rise_per_token):
            return None
        if stats.threads < 1 or (stats.cpu_cores is not None
                                 and not (math.isfinite(stats.cpu_cores) and stats.cpu_cores > 0)):  # fmt: skip
            return None
        values = (stats.compute_ms, stats.real_ms, stats.blocks_ms, stats.send_bytes)
        if (stats.tokens < 1 or stats.kv_bytes_per_block_token < 0
                or not all(math.isfinite(v) and v >= 0 for v in values)):  # fmt: skip
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
    remaining: int | None = None  # decode tokens left after this barrier at most (None: unknown)


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
    bypass: bool = False  # the ring can skip a stage left without blocks

    def check(self, cuts: Sequence[int], num_layers: int) -> None:
        """Raises ConfigError now if the shift cannot apply to the starting cuts."""
        shift_cuts(cuts, boundary=self.boundary, k=self.shift_k, num_layers=num_layers,
                   bypass=self.bypass)  # fmt: skip

    def decide(self, view: WindowView) -> Decision:
        if self.fired or view.token < self.at_token:
            return Decision(
                view.cuts, "forced_shift: waiting" if not self.fired else "forced_shift: done"
            )
        self.fired = True
        cuts = shift_cuts(view.cuts, boundary=self.boundary, k=self.shift_k,
                          num_layers=view.num_layers, bypass=self.bypass)  # fmt: skip
        return Decision(cuts, f"forced_shift: b{self.boundary} {self.shift_k:+d} at token {view.token}")  # fmt: skip


@dataclass
class Scripted:
    """Tests and tools: a list of (at_token, boundary, shift_k) shifts, each applied once, in order."""

    shifts: list[tuple[int, int, int]]
    name: str = "scripted"
    bypass: bool = False  # the ring can skip a stage left without blocks

    def decide(self, view: WindowView) -> Decision:
        if not self.shifts or view.token < self.shifts[0][0]:
            return Decision(view.cuts, "scripted: waiting")
        at, boundary, k = self.shifts.pop(0)
        cuts = shift_cuts(view.cuts, boundary=boundary, k=k, num_layers=view.num_layers,
                          bypass=self.bypass)  # fmt: skip
        return Decision(cuts, f"scripted: b{boundary} {k:+d} at token {view.token}")


@dataclass(frozen=True)
class CostModel:
    """Per-block decode time `c0 + c1 * context` (ms), from a calibration record's decode fit."""

    c0_ms: float
    c1_ms_per_token: float = 0.0

    def block_ms(self, context: int) -> float:
        return self.c0_ms + self.c1_ms_per_token * context

    @classmethod
    def from_calibration(cls, path: str | Path, *, key: str = "planner.cost_model",
                         record_key: str | None = None) -> CostModel:  # fmt: skip
        """Read the decode fit {c0, c1} of a calibration JSON's record `record_key`
        (`calibration_record`).

        Raises:
            ConfigError: naming `key` when the file or the fit is unusable.
        """
        try:
            record = calibration_record(path, record_key)
            params = (record.get("fits") or {}).get("decode") or record.get("decode") or {}
            params = params.get("params", params)
            model = cls(float(params["c0"]), float(params.get("c1", 0.0)))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ConfigError(f"{key}={path}: no usable decode fit ({exc})") from None
        if not (math.isfinite(model.c0_ms) and model.c0_ms > 0):
            raise ConfigError(f"{key}={path}: decode c0={model.c0_ms} must be > 0")
        return model


def calibration_record(path: str | Path, key: str | None = None) -> dict[str, Any]:
    """One record of a calibration JSON: calibrate.py's `{"records": {key: record}}` holds one
    per model/device/dtype, chosen by `key` (`planner.calibration_key`; None = the file's only
    record: a file of several is refused, never read by position); a bare record is itself.

    Raises:
        OSError, ValueError: the file cannot be read or parsed, or the record is not clear
            (callers name their config key).
    """
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"a calibration is a JSON object, got {type(data).__name__}")
    return dict(select_record(data, key))


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
        cuts, blocks = all_cuts(num_layers, num_cuts)
        times = np.array([m[0] for m in models]) + blocks * np.array([m[1] for m in models])
        moved = (cuts != np.asarray(start, dtype=np.int64)).any(axis=1)
        # the first minimum of (sum, max, moved) in combinations' order: lexsort is stable
        best = np.lexsort((moved, times.max(axis=1), times.sum(axis=1)))[0]
        return tuple(cuts[best].tolist())
    current = tuple(start)  # local search by single-block steps (very deep rings)
    while True:
        step = min(_neighbours(current, num_layers), key=lambda c: _score(predict(c, models, num_layers)),
                   default=current)  # fmt: skip
        if _score(predict(step, models, num_layers)) >= _score(
            predict(current, models, num_layers)
        ):
            return current
        current = step


@functools.lru_cache(maxsize=16)
def all_cuts(num_layers: int, num_cuts: int) -> tuple[np.ndarray, np.ndarray]:
    """Every cut set of `num_cuts` cuts over `num_layers` blocks in `itertools.combinations`
    order, and each one's blocks per stage (read-only; cached per ring shape: enumerating and
    scoring them in Python was ~4 ms of a 4-stage adaptive decision)."""
    grid = np.array(list(itertools.combinations(range(1, num_layers), num_cuts)), dtype=np.int64)
    grid = grid.reshape(-1, num_cuts)
    blocks = blocks_per_stage(grid, num_layers)
    grid.flags.writeable = blocks.flags.writeable = False
    return grid, blocks


def blocks_per_stage(grid: np.ndarray, num_layers: int) -> np.ndarray:
    """(candidates, stages): the blocks each stage holds under each row of cuts."""
    edge = np.ones((len(grid), 1), dtype=np.int64)
    return np.diff(np.hstack([0 * edge, grid, num_layers * edge]), axis=1)


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


def _moves_ok(old: Sequence[int], new: Sequence[int], num_layers: int) -> bool:
    """Whether `new` is one reconfiguration from `old` in the full ring (a block cannot jump
    over a skipped stage: KV moves between neighbours only)."""
    try:
        moves_between(old, new, num_layers, bypass=True)
    except ConfigError:
        return False
    return True


MAX_BACKOFF = 8  # barriers adaptive holds at most after moves that did not commit


def active_ring(cuts: Sequence[int], num_layers: int) -> tuple[list[int], tuple[int, ...]]:
    """(the stages that own blocks, the cuts of the ring of those stages alone)."""
    blocks = stage_blocks(cuts, num_layers)
    bounds = [0, *cuts, num_layers]
    active = [i for i, b in enumerate(blocks) if b > 0]
    return active, tuple(bounds[a] for a in active[1:])


def expand_cuts(reduced: Sequence[int], active: Sequence[int], num_stages: int,
                num_layers: int) -> tuple[int, ...]:  # fmt: skip
    """The full ring's cuts for `reduced` cuts of its `active` stages (the others stay empty,
    each at the start of the next active stage)."""
    bounds = [0, *reduced, num_layers]
    return tuple(bounds[next(j for j, a in enumerate(active) if a >= i)]
                 for i in range(1, num_stages))  # fmt: skip


@dataclass
class Adaptive:
    """See the module docstring; with `bypass` (`architecture.bypass`) also the link rule:
    a middle stage whose observed link factor (`link_obs`) fell below `link_low` gives all its
    blocks to its neighbours in one reconfiguration (the ring then skips it: no cut removes a
    hop otherwise), and a skipped stage whose link is back at `link_high` or better takes one
    block back; compute balancing runs over the stages that own blocks. With `links` False
    (`planner.links=false`) it reads no link_obs: compute balancing only, bypass or not."""

    hysteresis: float = 0.15
    cost: CostModel | None = None
    name: str = "adaptive"
    links: bool = True  # False: compute only (`planner.links=false`), the link rule never runs
    history: list[tuple[int, ...]] = field(default_factory=list)
    bypass: bool = False
    link_low: float = 0.5
    link_high: float = 0.9
    expected: tuple[int, ...] | None = None  # the cuts the last move proposed
    backoff: int = 0  # barriers to hold after an aborted move (doubles per abort, at most 8)
    holding: int = 0

    def decide(self, view: WindowView) -> Decision:
        """`_decide`, held for `backoff` barriers after a move that did not commit (a NACK:
        e.g. a KV transfer over a slowed link that outlasted `architecture.ctrl_timeout_s`),
        so a move that keeps failing does not cost a timed-out barrier every window."""
        cuts = tuple(view.cuts)
        if self.expected is not None:
            aborted = cuts != self.expected
            self.backoff = min(2 * self.backoff or 1, MAX_BACKOFF) if aborted else 0
            self.holding, self.expected = self.backoff, None
        if self.holding > 0:
            self.holding -= 1
            return Decision(view.cuts, f"adaptive: hold (backing off {self.backoff} barriers "
                            "after a move that did not commit)")  # fmt: skip
        decision = self._decide(view)
        if tuple(decision.cuts) != cuts:
            self.expected = tuple(decision.cuts)
        return decision

    def _decide(self, view: WindowView) -> Decision:
        n, num_layers = len(view.cuts) + 1, view.num_layers
        stats = list(view.stats) + [None] * (n - len(view.stats))
        obs = list(view.obs) + [None] * (n - len(view.obs))
        models = [None if s is None else stage_model(s, cost=self.cost, context=view.context)
                  for s in stats]  # fmt: skip
        if self.bypass and self.links and n > 2:
            link = self._link_rule(view, models, obs)
            if link is not None:
                return link
        active, reduced = active_ring(view.cuts, num_layers)
        if any(models[a] is None for a in active):
            return Decision(view.cuts, "adaptive: waiting for every stage's window statistics")
        sub = [models[a] for a in active]

        def full(cuts: Sequence[int]) -> tuple[int, ...]:
            return expand_cuts(cuts, active, n, num_layers)

        now = predict(reduced, sub, num_layers)  # type: ignore[arg-type]
        target = best_cuts(sub, num_layers, start=reduced)  # type: ignore[arg-type]
        then = predict(target, sub, num_layers)  # type: ignore[arg-type]
        gain = (sum(now) - sum(then)) / sum(now) if sum(now) > 0 else 0.0
        if target == tuple(reduced) or gain <= self.hysteresis:
            return Decision(view.cuts, f"adaptive: hold (target {list(full(target))} gains "
                            f"{gain:.1%} <= hysteresis {self.hysteresis:.0%})", now)  # fmt: skip
        steps = []
        for b, (c, t) in enumerate(zip(reduced, target, strict=True)):
            if c != t:
                step = list(reduced)
                step[b] += 1 if t > c else -1
                steps.append(tuple(step))
        steps = [c for c in steps if c in _neighbours(tuple(reduced), num_layers)
                 and _moves_ok(view.cuts, full(c), num_layers)]  # fmt: skip
        if not steps:  # every step toward the target would empty a stage
            return Decision(view.cuts, f"adaptive: hold (no valid step toward {list(full(target))})", now)  # fmt: skip
        step = min(steps, key=lambda c: _score(predict(c, sub, num_layers)))  # type: ignore[arg-type]
        after = predict(step, sub, num_layers)  # type: ignore[arg-type]
        if sum(after) > sum(now):
            return Decision(view.cuts, f"adaptive: hold (a step toward {list(full(target))} raises the predicted TPOT)", now)  # fmt: skip
        self.history.append(full(step))
        return Decision(full(step), f"adaptive: toward {list(full(target))} (predicted TPOT "
                        f"{sum(now):.2f} -> {sum(then):.2f} ms, gain {gain:.1%})", after)  # fmt: skip

    def _link_rule(self, view: WindowView, models: Sequence[tuple[float, float] | None],
                   obs: Sequence[Mapping[str, float] | None]) -> Decision | None:  # fmt: skip
        """Route around a stage behind a slow link, or give a recovered one a block back."""
        n, num_layers = len(view.cuts) + 1, view.num_layers
        blocks = stage_blocks(view.cuts, num_layers)
        bounds = [0, *view.cuts, num_layers]
        for s in range(1, n - 1):
            factor = link_factor(obs[s])
            if blocks[s] > 0 and factor < self.link_low:
                start, stop = bounds[s], bounds[s + 1]
                splits = ([start] if blocks[s - 1] == 0 else [stop] if blocks[s + 1] == 0
                          else list(range(start, stop + 1)))  # fmt: skip

                def cost(m: int, s: int = s, start: int = start, stop: int = stop) -> float:
                    """The slower of the two neighbours after the split (balanced, not the
                    sum: a host under a CPU quota slows more than linearly past its share)."""
                    out = []
                    for d, n_blocks in ((s - 1, blocks[s - 1] + m - start),
                                        (s + 1, blocks[s + 1] + stop - m)):  # fmt: skip
                        model = models[d]
                        out.append(n_blocks if model is None else model[0] + n_blocks * model[1])
                    return max(out)

                m = min(splits, key=lambda m: (cost(m), abs(2 * m - start - stop)))
                cuts = list(view.cuts)
                cuts[s - 1] = cuts[s] = m
                self.history.append(tuple(cuts))
                return Decision(tuple(cuts), f"adaptive: route around stage {s} (link_obs "
                                f"{factor:.2f} < planner.link_low {self.link_low:g}): its "
                                f"{blocks[s]} blocks to stages {s - 1} and {s + 1}")  # fmt: skip
            if blocks[s] == 0 and factor >= self.link_high:
                donors = [d for d in (s - 1, s + 1) if blocks[d] > 1]
                if not donors:
                    continue
                known = {d: models[d] for d in donors if models[d] is not None}
                donor = max(donors, key=lambda d: (known[d][0] + blocks[d] * known[d][1])
                            if d in known else blocks[d])  # fmt: skip
                cuts = list(view.cuts)
                if donor == s - 1:
                    cuts[s - 1] -= 1  # its last block moves up into stage s
                else:
                    cuts[s] += 1  # stage s+1's first block moves down into stage s
                self.history.append(tuple(cuts))
                return Decision(tuple(cuts), f"adaptive: stage {s}'s link is back (link_obs "
                                f"{factor:.2f} >= planner.link_high {self.link_high:g}): one "
                                f"block from stage {donor}")  # fmt: skip
        return None


DEFAULT_LOAD_MS_PER_BLOCK = 20.0  # L_n slope when the calibration has no load fit (said so)
DEFAULT_LINK_ALPHA_MS = 0.5  # per-hop latency when the calibration has no link figures
DEFAULT_LINK_BETA_MS_PER_BYTE = 8e-6  # ... and per byte: 1 Gbit/s
Q_SATURATED = 0.99  # a compute load at or above this says nothing more about the slowdown


@dataclass(frozen=True)
class Calibration:
    """What `planner=model` predicts from: a calibrate.py record, defaults where it is silent.

    `decode` is the per-block decode fit (how a block's time grows with context; None: flat);
    `load_c0_ms + load_c1_ms * n` is L_n, the cost of loading n blocks (the record's `load`
    fit, read by `analysis.fits.load_cost`; else its one-block `weight_load_ms`; else a
    default); `link_alpha_ms + bytes * link_beta_ms_per_byte` a message over a nominal link
    (the record's `link` fit: calibrate a testbed host with `calibrate.py --testbed`, since
    the loopback probe measures memcpy, not a link). `link_bucket_bytes` is the depth of the
    token bucket that shapes the link (the record's `link.bucket_bytes`; 0: none, a serial
    link): see `hop_ms`. `defaults` names each part that is not from the file.
    """

    decode: CostModel | None = None
    load_c0_ms: float = 0.0
    load_c1_ms: float = DEFAULT_LOAD_MS_PER_BLOCK
    link_alpha_ms: float = DEFAULT_LINK_ALPHA_MS
    link_beta_ms_per_byte: float = DEFAULT_LINK_BETA_MS_PER_BYTE
    link_bucket_bytes: float = 0.0
    defaults: tuple[str, ...] = ("decode", "load", "link")

    def load_ms(self, num_blocks: int) -> float:
        return self.load_c0_ms + self.load_c1_ms * num_blocks if num_blocks > 0 else 0.0

    def message_ms(self, nbytes: float, link: float) -> float:
        """One message of `nbytes` over a link at `link` (0, 1] of its nominal rate: the
        latency stays, the bytes take 1/link as long."""
        return self.link_alpha_ms + nbytes * self.link_beta_ms_per_byte / link

    def hop_ms(self, nbytes: float, link: float) -> tuple[float, float]:
        """One hop's message of `nbytes` per token at `link` of the nominal rate, as (the time
        it adds to every token's path, the shortest token period the link sustains).

        A serial link (no bucket) adds the whole message, latency and bytes. A token bucket
        `link_bucket_bytes` deep fills at the link's rate while the rest of the ring works: a
        message that fits in it passes at line speed once the bucket has refilled, so it adds
        only the latency, and the link bounds the token period at bytes / rate instead (what
        a shaper does to a ring: at 1/1000 of 100 Mbit/s a 2.3 KB hidden state allows one token
        per ~190 ms, but costs nothing while tokens take longer than that). A message deeper than
        the bucket adds what overflows it."""
        per_byte = self.link_beta_ms_per_byte / link
        if self.link_bucket_bytes <= 0:
            return self.message_ms(nbytes, link), 0.0
        over = max(0.0, nbytes - self.link_bucket_bytes)
        return self.link_alpha_ms + over * per_byte, nbytes * per_byte

    def context_growth(self, context: int, horizon_tokens: int) -> float:
        """A block's decode time over the next half horizon relative to now (1.0 uncalibrated)."""
        if self.decode is None:
            return 1.0
        return self.decode.block_ms(context + horizon_tokens // 2) / self.decode.block_ms(context)

    @classmethod
    def read(cls, path: str | Path | None, record_key: str | None = None) -> Calibration:
        """The calibration at `path`, its record `record_key` (None: every part a default).

        Raises:
            ConfigError: naming planner.calibration when the file or one of its fits is unusable.
        """
        if path is None:
            return cls()
        key = "planner.calibration"
        try:
            record = calibration_record(path, record_key)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{key}={path}: cannot read it ({exc}; planner.calibration_key "
                              "names the record)") from None  # fmt: skip
        decode = CostModel.from_calibration(path, key=key, record_key=record_key)
        defaults = []
        try:  # calibrate.py's fitted L_n (its "load" record)
            fitted = load_cost(record)
            l0, l1 = fitted.fixed_ms, fitted.per_block_ms
        except ValueError:
            one_block = (record.get("weight_load_ms") or {}).get("ms")
            if one_block is not None:
                l0, l1 = 0.0, float(one_block)
            else:
                l0, l1 = 0.0, DEFAULT_LOAD_MS_PER_BLOCK
                defaults.append("load")
        if not all(math.isfinite(v) and v >= 0 for v in (l0, l1)):
            raise ConfigError(f"{key}={path}: L_n {l0} + {l1} n ms must be finite and >= 0")
        link = record.get("link") or {}
        try:
            alpha, beta = float(link["alpha_ms"]), float(link["beta_ms_per_byte"])
        except (KeyError, TypeError, ValueError):
            alpha, beta = math.nan, math.nan
        if not all(math.isfinite(v) and v >= 0 for v in (alpha, beta)):
            alpha, beta = DEFAULT_LINK_ALPHA_MS, DEFAULT_LINK_BETA_MS_PER_BYTE
            defaults.append("link")
        try:
            bucket = float(link.get("bucket_bytes") or 0.0)
        except (TypeError, ValueError):
            bucket = math.nan
        if not (math.isfinite(bucket) and bucket >= 0):
            raise ConfigError(f"{key}={path}: link.bucket_bytes={link.get('bucket_bytes')!r} "
                              "must be a number >= 0")  # fmt: skip
        return cls(decode=decode, load_c0_ms=l0, load_c1_ms=l1, link_alpha_ms=alpha,
                   link_beta_ms_per_byte=beta, link_bucket_bytes=bucket,
                   defaults=tuple(defaults))  # fmt: skip


def compute_trend(prev: Mapping[str, float] | None, now: Mapping[str, float] | None) -> float:
    """How much slower a stage is now than the last observation said: q_cmp_obs now over then.

    The window's measured slowdown is a mean over the window before; a compute load that rose
    (or fell) since says the next window will be slower (faster) by about that ratio. A
    saturated or missing load says nothing (1.0).
    """
    if not prev or not now:
        return 1.0
    q0, q1 = prev.get("q_cmp_obs", math.nan), now.get("q_cmp_obs", math.nan)
    if not (math.isfinite(q0) and math.isfinite(q1)) or q0 <= 0 or max(q0, q1) >= Q_SATURATED:
        return 1.0
    return q1 / q0


def link_factor(obs: Mapping[str, float] | None) -> float:
    """A stage's outgoing link quality (0, 1] from its observation (1.0 when unknown)."""
    value = (obs or {}).get("link_obs", math.nan)
    return min(1.0, value) if math.isfinite(value) and value > 0 else 1.0


def reachable(old: Sequence[int], new: Sequence[int], num_layers: int) -> bool:
    """True when every block moves at most one stage (one reconfiguration)."""
    bounds = [0, *old, num_layers]
    return all(bounds[i] <= c <= bounds[i + 2] for i, c in enumerate(new))


@dataclass
class ModelPlanner:
    """`planner=model`: predicted TPOT from a calibration corrected by the live observations.

    Each stage's time is `F_s + n_s * r_s` (`stage_model`: the window's measured fixed part and
    per-block time, times its injected slowdown compute_ms / real_ms), scaled by its compute
    trend (`compute_trend`: q_cmp_obs now over the barrier before) and, for the blocks, by the
    calibrated decode fit's growth with context over the next half horizon. The measured block
    time, not the calibrated one, carries a real slowdown (a CPU quota cut, contention), which a
    calibration taken elsewhere cannot know. Each hop is one message of the bytes its sender
    put on the ring per token (measured) over the sender's link at its link_obs
    (`Calibration.hop_ms`: on a serial link it adds latency and bytes to the token's path; on
    a shaped one, a token bucket, it adds the latency and bounds the token period at bytes /
    rate), and a link is priced over the whole horizon, its slowdown carried on at the rise it
    showed since the barrier before (`link_outlook`). The ring carries every token over every
    hop whatever the cuts, so a slow link adds to the predicted TPOT but no cut set removes it
    (unless `bypass` lets the ring skip the stage behind it): the planner holds rather than pay
    a migration for nothing. A stage whose q_mem_obs is at or over `mem_high` is given no
    blocks (its memory is what is short). Among the cut sets one reconfiguration reaches
    (every block moves at most one stage, so several blocks and both boundaries at once), the
    target minimises `horizon x mean TPOT + migration`: the migration is L_n summed over the
    receivers plus the moved blocks' KV (blocks x context x KV bytes per block and token, as
    the donors report) crossing each donor's own link at its rate a token on, and the horizon
    is `horizon_tokens`, or the tokens the generation has left when fewer (a move that pays
    back over 200 tokens is a loss in the last 50). It moves only when the gain beats
    `hysteresis` (relative) and, over the horizon, the migration cost.
    """

    calibration: Calibration = field(default_factory=Calibration)
    hysteresis: float = 0.05
    horizon_tokens: int = 64
    mem_high: float = 0.9
    name: str = "model"
    last_obs: tuple[dict[str, float] | None, ...] = ()
    bypass: bool = False  # `architecture.bypass`: a middle stage may be left without blocks
    confirm: int = 1  # barriers in a row that must pick the same target before it moves
    pending: tuple[tuple[int, ...], int] | None = None  # (target, barriers it was picked at)
    last_token: int | None = None  # the barrier before's token: the link outlook's slope

    def decide(self, view: WindowView) -> Decision:
        """`_decide`, moving only once a move paid `confirm` barriers in a row: one window's
        measurements on a loaded host can mislead a planner that jumps (a tail whose block time
        read low took eight blocks, then ran 3x slower). A move that would not pay with every
        link at its nominal rate is made at once: it is the links' observed rates that ask for
        it, not a window's timings (waiting a barrier on a falling link sends the moved KV
        over a slower one). What must hold again is the move, not
        the argmin: when this barrier's best differs from the pending target but the pending
        one still pays (gain over `hysteresis` and the migration, on this barrier's figures),
        the count goes on toward the pending target; near-equal cut sets that trade places
        from one noisy window to the next would otherwise never be confirmed."""
        prev, self.last_obs = self.last_obs, tuple(view.obs)
        since = None if self.last_token is None else view.token - self.last_token
        self.last_token = view.token
        decision = self._decide(view, prev, since)
        if not decision.moves(view.cuts):
            self.pending = None
            return decision
        if not self._decide(view, prev, since, only=decision.cuts, nominal_links=True).moves(
            view.cuts
        ):  # it pays only for the links: their rates are readings, not one window's timings
            self.pending = None
            return decision
        seen = 1
        if self.pending is not None:
            target, count = self.pending
            if target == decision.cuts:
                seen = count + 1
            else:
                again = self._decide(view, prev, since, only=target)
                if again.moves(view.cuts):
                    decision, seen = again, count + 1
        if seen < self.confirm:
            self.pending = (decision.cuts, seen)
            return Decision(tuple(view.cuts), f"model: hold (target {list(decision.cuts)} at "
                            f"{seen} of planner.confirm={self.confirm} barriers in a row; "
                            f"{decision.reason.removeprefix('model: ')})")  # fmt: skip
        self.pending = None
        return decision

    def _decide(
        self,
        view: WindowView,
        prev: tuple[dict[str, float] | None, ...],
        since: int | None,
        only: tuple[int, ...] | None = None,
        nominal_links: bool = False,
    ) -> Decision:
        """The best target on this barrier's figures (`prev`: the observations of the barrier
        before, `since` tokens ago); with `only`, whether moving to that one cut set pays; with
        `nominal_links`, as if every link were at its nominal rate."""
        stats = list(view.stats)
        current, num_layers = tuple(view.cuts), view.num_layers
        held = stage_blocks(current, num_layers)  # 0: a skipped stage (bypass), no statistics
        if len(stats) != len(current) + 1 or any(
            st is None and b for st, b in zip(stats, held, strict=True)
        ):
            return Decision(view.cuts, "model: waiting for every stage's window statistics")
        obs = list(view.obs) + [None] * (len(stats) - len(view.obs))
        prev_obs = list(prev) + [None] * (len(stats) - len(prev))
        horizon = (self.horizon_tokens if view.remaining is None
                   else max(0, min(self.horizon_tokens, view.remaining)))  # fmt: skip
        growth = self.calibration.context_growth(view.context, horizon)
        measured: list[tuple[float, float] | None] = []
        for s, st in enumerate(stats):
            if not held[s]:
                measured.append(None)
                continue
            fixed, rate = stage_model(st, cost=None, context=view.context)  # type: ignore[arg-type]
            trend = compute_trend(prev_obs[s], obs[s])
            measured.append((fixed * trend, rate * trend * growth))
        models = [m if m is not None else (0.0, _neighbour_rate(measured, s))
                  for s, m in enumerate(measured)]  # fmt: skip
        outlook = [(1.0, 0.0) if nominal_links else _from_now(
                       link_outlook(p, o, since, None if st is None else st.link_rise_per_token),
                       view.token - st.link_obs_token if st and st.link_obs_token is not None
                       else 0)
                   for p, o, st in zip(prev_obs, obs, stats, strict=True)]  # fmt: skip
        offsets = horizon_samples(horizon)
        # a skipped stage sent nothing in the window: back on the ring it sends a hidden state
        hidden = max((st.send_bytes for st in stats[:-1] if st is not None), default=0.0)
        sent = [hidden if st is None else st.send_bytes for st in stats]
        hops = [[self.calibration.hop_ms(b, 1.0 / (slow + rise * t)) for t in offsets]
                for b, (slow, rise) in zip(sent, outlook, strict=True)]  # fmt: skip
        full = [q for q, o in enumerate(obs) if (o or {}).get("q_mem_obs", 0.0) >= self.mem_high]
        # a stage on a CPU budget (a cgroup quota under its threads) computes at most `cores`
        # of a core's time per token period: its compute bounds the period at time x threads
        # / cores (20 SmolLM2 blocks, 57 ms, on a 0.5-core host: tokens of >= 114 ms)
        duty = [st.threads / st.cpu_cores if st is not None and st.cpu_cores is not None
                and st.cpu_cores < st.threads else 0.0 for st in stats]  # fmt: skip
        reach = reachable_arrays(current, num_layers, self.bypass)
        rows = (np.arange(len(reach.cuts)) if only is None
                else np.array([reach.row[c] for c in dict.fromkeys((current, only)) if c in reach.row]))  # fmt: skip
        if full:  # no blocks to a stage whose memory is short
            rows = rows[~(reach.received[rows][:, full] > 0).any(axis=1)]
        kv_per_block = np.array([view.context * st.kv_bytes_per_block_token if st is not None
                                 else 0.0 for st in stats])  # fmt: skip
        kv_link = np.array([1.0 / (slow + rise) for slow, rise in outlook])
        scored = score_cuts(reach, rows, models=models, hops=hops, duty=duty,
                            bypass=self.bypass, calibration=self.calibration,
                            kv_per_block=kv_per_block, kv_link=kv_link)  # fmt: skip
        cost = horizon * scored.tpot + scored.migration
        moved = scored.moved.astype(float)
        # the first minimum in the candidates' order, as `min` would: lexsort is stable
        i_target = int(np.lexsort((moved, scored.bottleneck, cost))[0])
        i_ideal = int(np.lexsort((moved, scored.bottleneck, scored.tpot))[0])
        i_now = scored.index(current)
        target, ideal = scored.cuts[i_target], scored.cuts[i_ideal]
        tpot = scored.tpot.tolist()
        now = tuple(scored.times[i_now].tolist())
        said = (
            f"; defaults: {', '.join(self.calibration.defaults)}"
            if self.calibration.defaults
            else ""
        )
        if target == current and ideal != current:  # the horizon does not pay for the move
            return Decision(current, f"model: hold ({list(ideal)} saves {tpot[i_now] - tpot[i_ideal]:.2f} "
                            f"ms x {horizon} tokens <= migration {scored.migration[i_ideal]:.1f} ms"
                            f"{said})", now)  # fmt: skip
        gain = (tpot[i_now] - tpot[i_target]) / tpot[i_now] if tpot[i_now] > 0 else 0.0
        links_said = ("links cost the same whatever the cuts" if not self.bypass
                      else f"links {scored.link_ms(i_now):.2f} -> {scored.link_ms(i_target):.2f} ms")  # fmt: skip
        if target == current or gain <= self.hysteresis:
            return Decision(current, f"model: hold (best {list(target)} gains {gain:.1%} <= hysteresis "
                            f"{self.hysteresis:.0%}; {links_said}{said})", now)  # fmt: skip
        return Decision(target, f"model: to {list(target)} (predicted TPOT {tpot[i_now]:.2f} -> "
                        f"{tpot[i_target]:.2f} ms, {links_said}, migration "
                        f"{scored.migration[i_target]:.1f} ms{said})",
                        tuple(scored.times[i_target].tolist()))  # fmt: skip


@functools.lru_cache(maxsize=64)
def reachable_cuts(
    current: tuple[int, ...], num_layers: int, bypass: bool
) -> list[tuple[int, ...]]:
    """Cut sets one reconfiguration reaches: every block moves at most one stage; with bypass
    a middle stage may be emptied (never moving a block over a skipped stage). Cached: the
    cuts change at a move, not at every barrier (enumerating them was ~half of a decision)."""
    if not bypass:
        return [c for c in itertools.combinations(range(1, num_layers), len(current))
                if reachable(current, c, num_layers)]  # fmt: skip
    return [c for c in itertools.combinations_with_replacement(range(1, num_layers), len(current))
            if reachable(current, c, num_layers) and _moves_ok(current, c, num_layers)]  # fmt: skip


@dataclass(frozen=True)
class Reach:
    """The cut sets one reconfiguration reaches from `current` (`reachable_cuts`), as arrays:
    per candidate its blocks per stage and the blocks each stage gains and gives (read-only;
    cached with the cuts)."""

    current: tuple[int, ...]
    cuts: list[tuple[int, ...]]
    row: dict[tuple[int, ...], int]
    blocks: np.ndarray  # (candidates, stages)
    received: np.ndarray  # (candidates, stages)
    given: np.ndarray  # (candidates, stages)


@functools.lru_cache(maxsize=64)
def reachable_arrays(current: tuple[int, ...], num_layers: int, bypass: bool) -> Reach:
    cuts = reachable_cuts(current, num_layers, bypass)
    grid = np.asarray(cuts, dtype=np.int64).reshape(len(cuts), len(current))
    blocks = blocks_per_stage(grid, num_layers)
    up = np.maximum(grid - np.asarray(current, dtype=np.int64), 0)  # boundary s moved up
    down = np.maximum(np.asarray(current, dtype=np.int64) - grid, 0)  # ... or down
    received = np.zeros_like(blocks)
    given = np.zeros_like(blocks)
    received[:, :-1] += up  # stage s-1 took blocks [a, b) from stage s
    given[:, 1:] += up
    received[:, 1:] += down  # stage s took blocks [b, a) from stage s-1
    given[:, :-1] += down
    for a in (blocks, received, given):
        a.flags.writeable = False
    return Reach(current, cuts, {c: i for i, c in enumerate(cuts)}, blocks, received, given)


@dataclass(frozen=True)
class Scored:
    """`ModelPlanner`'s figures for the candidates `rows` of a `Reach`, in that order."""

    cuts: list[tuple[int, ...]]
    times: np.ndarray  # (candidates, stages): each stage's predicted time (ms)
    tpot: np.ndarray  # predicted mean TPOT over the horizon, links and CPU budgets included
    migration: np.ndarray  # L_n over the receivers plus the moved KV over the donors' links
    bottleneck: np.ndarray  # the slowest stage's time
    moved: np.ndarray  # whether the candidate is not the current cuts

    def index(self, cuts: tuple[int, ...]) -> int:
        return self.cuts.index(cuts)

    def link_ms(self, i: int) -> float:
        return float(self.tpot[i] - self.times[i].sum())


def score_cuts(reach: Reach, rows: np.ndarray, *, models: Sequence[tuple[float, float]],
               hops: Sequence[Sequence[tuple[float, float]]], duty: Sequence[float],
               bypass: bool, calibration: Calibration, kv_per_block: np.ndarray,
               kv_link: np.ndarray) -> Scored:  # fmt: skip
    """Every candidate at once (a decision over ~300 cut sets of SmolLM2's ring was ~2.5 ms
    of Python per barrier on the head's token path; this is ~0.2 ms): each stage's time
    `F_s + n_s r_s` (0 for a skipped stage with bypass), the TPOT over the horizon's samples
    (`hops[s][k]`: what stage s's hop adds to the path and the period its link allows, the
    ring's stages only), and the migration."""
    blocks, received, given = reach.blocks[rows], reach.received[rows], reach.given[rows]
    fixed = np.array([m[0] for m in models])
    rate = np.array([m[1] for m in models])
    times = fixed + blocks * rate
    on = blocks > 0 if bypass else np.ones_like(blocks, dtype=bool)
    if bypass:
        times = np.where(on, times, 0.0)
    hop = np.asarray(hops, dtype=float)  # (stages, samples, 2)
    # the hops depend only on which stages a token visits: a few rings, not one per candidate
    code = on @ (1 << np.arange(on.shape[1]))
    rings, ring = np.unique(code, return_inverse=True)
    visits = (rings[:, None] >> np.arange(on.shape[1])) & 1 > 0  # (rings, stages)
    path = np.where(visits[:, :, None], hop[None, :, :, 0], 0.0).sum(axis=1)[ring]
    bound = np.where(visits[:, :, None], hop[None, :, :, 1], -np.inf).max(axis=1)[ring]
    quota = (times * np.asarray(duty, dtype=float)).max(axis=1)
    period = np.maximum(np.maximum(times.sum(axis=1)[:, None] + path, bound), quota[:, None])
    load = np.where(received > 0, calibration.load_c0_ms + calibration.load_c1_ms * received, 0.0)
    kv = np.where(given > 0, calibration.message_ms(given * kv_per_block, kv_link), 0.0)
    cuts = reach.cuts if len(rows) == len(reach.cuts) else [reach.cuts[i] for i in rows.tolist()]
    return Scored(cuts=cuts, times=times, tpot=period.mean(axis=1),
                  migration=load.sum(axis=1) + kv.sum(axis=1), bottleneck=times.max(axis=1),
                  moved=rows != reach.row[reach.current])  # fmt: skip


def _neighbour_rate(models: Sequence[tuple[float, float] | None], s: int) -> float:
    """The per-block rate of a skipped stage `s` (it measures none while it holds no blocks):
    its faster neighbour's that holds blocks, as a guess."""
    rates = [m[1] for d in (s - 1, s + 1) if 0 <= d < len(models) and (m := models[d])]
    return min(rates, default=0.0)


def link_outlook(prev: Mapping[str, float] | None, now: Mapping[str, float] | None,
                 since: int | None, rise: float | None = None) -> tuple[float, float]:  # fmt: skip
    """A stage's link over the tokens ahead: (its slowdown 1 / link_obs now, the slowdown's
    rise per token), the link at `1 / (slowdown + rise x t)` t tokens on. The rise is what
    the stage measured between its last two observations (`rise`, its ACK's
    `link_rise_per_token`: from decode start at the first barrier), else the slowdown's
    change since the barrier before, `since` tokens ago; it is carried on in a straight line:
    a falling link keeps falling (drift=link_degrade's slowdown rises linearly), and over a
    long horizon most of its cost is still to come. A rise in rate is not projected: a
    recovering link is trusted only as far as it has recovered."""
    slow = 1.0 / link_factor(now)
    if rise is not None:
        return slow, max(0.0, rise)
    if not since or since <= 0 or not math.isfinite((prev or {}).get("link_obs", math.nan)):
        return slow, 0.0  # nothing to compare with
    return slow, max(0.0, (slow - 1.0 / link_factor(prev)) / since)


def _from_now(outlook: tuple[float, float], lag: int) -> tuple[float, float]:
    """An outlook observed `lag` tokens before the barrier a decision is for (a decision taken
    a window ahead sees the ACKs of the barrier before), carried on to that barrier."""
    slow, rise = outlook
    return slow + rise * max(0, lag), rise


HORIZON_SAMPLES = 16  # tokens of the horizon at which the link outlook is priced


def horizon_samples(horizon: int) -> list[float]:
    """Token offsets (midpoints of equal parts) at which a `horizon`-token outlook is priced:
    exact for a cost linear in the token, close for one with a kink; [0] for no horizon."""
    if horizon <= 0:
        return [0.0]
    k = min(horizon, HORIZON_SAMPLES)
    return [(j + 0.5) * horizon / k for j in range(k)]


PlannerFactory = Callable[[Any], Planner]

# name -> (schema of its parameters in `splitlab.config.schema`, builder from that typed config)
PLANNERS: dict[str, tuple[type[PlannerConfig], PlannerFactory]] = {}


def register_planner(name: str, schema: type[PlannerConfig], build: PlannerFactory) -> None:
    """Make `planner.name=<name>` available; `build` takes a `schema` instance."""
    PLANNERS[name] = (schema, build)


def _adaptive(cfg: AdaptivePlannerConfig) -> Adaptive:
    if not 0 <= cfg.hysteresis < 1:
        raise ConfigError(f"planner.hysteresis={cfg.hysteresis}: must be in [0, 1)")
    cost = (CostModel.from_calibration(cfg.cost_model, record_key=cfg.calibration_key)
            if cfg.cost_model else None)  # fmt: skip
    if not 0 < cfg.link_low < cfg.link_high <= 1:
        raise ConfigError(
            f"planner.link_low={cfg.link_low}, planner.link_high={cfg.link_high}: need "
            "0 < link_low < link_high <= 1"
        )
    return Adaptive(hysteresis=cfg.hysteresis, cost=cost, link_low=cfg.link_low,
                    link_high=cfg.link_high, links=cfg.links)  # fmt: skip


register_planner("noop", NoopPlannerConfig, lambda cfg: Noop())
register_planner("forced_shift", ForcedShiftPlannerConfig,
                 lambda cfg: ForcedShift(cfg.at_token, cfg.shift_k, cfg.boundary))  # fmt: skip
register_planner("adaptive", AdaptivePlannerConfig, _adaptive)


def _model(cfg: ModelPlannerConfig) -> ModelPlanner:
    if not 0 <= cfg.hysteresis < 1:
        raise ConfigError(f"planner.hysteresis={cfg.hysteresis}: must be in [0, 1)")
    if cfg.horizon_tokens < 1:
        raise ConfigError(f"planner.horizon_tokens={cfg.horizon_tokens}: must be >= 1")
    if not 0 < cfg.mem_high <= 1:
        raise ConfigError(f"planner.mem_high={cfg.mem_high}: must be in (0, 1]")
    if cfg.confirm < 1:
        raise ConfigError(f"planner.confirm={cfg.confirm}: must be >= 1")
    return ModelPlanner(calibration=Calibration.read(cfg.calibration, cfg.calibration_key),
                        hysteresis=cfg.hysteresis, horizon_tokens=cfg.horizon_tokens,
                        mem_high=cfg.mem_high, confirm=cfg.confirm)  # fmt: skip


register_planner("model", ModelPlannerConfig, _model)


@dataclass
class ScriptedPlannerConfig(PlannerConfig):
    """Tests and tools only (no config option): the shifts `Scripted` applies."""

    name: str = "scripted"
    shifts: list[list[int]] = field(default_factory=list)  # [at_token, boundary, shift_k] each


register_planner("scripted", ScriptedPlannerConfig,
                 lambda cfg: Scripted([tuple(x) for x in cfg.shifts]))  # fmt: skip


def planner_schema(name: str) -> type[PlannerConfig]:
    """The parameter schema of planner `name`.

    Raises:
        ConfigError: naming planner.name and the registered names.
    """
    return registered(PLANNERS, name, "planner.name")[0]


def make_planner(cfg: PlannerConfig, *, bypass: bool = False) -> Planner:
    """The planner `cfg.name` names, built from its typed config; with `bypass` (the ring can
    skip a stage left without blocks) a planner that has the switch may propose such cuts.

    Raises:
        ConfigError: naming planner.name (unknown, or `cfg` is not its schema) or a bad value.
    """
    schema = planner_schema(cfg.name)
    if not isinstance(cfg, schema):
        raise ConfigError(
            f"planner.name={cfg.name!r} takes a {schema.__name__}, got {type(cfg).__name__}"
        )
    planner = PLANNERS[cfg.name][1](cfg)
    if bypass and hasattr(planner, "bypass"):
        planner.bypass = True
    return planner
