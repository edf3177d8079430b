"""Model-free check of the drift sources: contract, determinism, noise, exhaustion, injection
and the live read budget. Prints one PASS/FAIL line per check; exits 0 only if all pass.

    .venv/bin/python tools/check_drift_source.py
    .venv/bin/python tools/check_drift_source.py --profile thermal_ramp --noise-var 0   # must FAIL

Replay runs on a trace generated into a temporary folder; the live source reads this host's
sensors (psutil, plus nvidia-smi or tegrastats where installed).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from splitlab.config.schema import DriftConfig
from splitlab.drift.contract import OBS_KEYS
from splitlab.drift.inject import inject
from splitlab.drift.live import LiveSource
from splitlab.drift.profiles import PROFILES, ProfileParams, generate
from splitlab.drift.replay import ReplaySource
from splitlab.drift.trace_io import TraceHeader, write_trace
from splitlab.errors import SplitlabError
from splitlab.telemetry.log import leave

READ_BUDGET_MS = 2.0
NOISE_SAMPLES = 20_000
NOISE_REL_TOLERANCE = 0.1  # of the variance: its standard error at 20k samples is 1%


def check_replay(args: argparse.Namespace, trace: Path) -> list[tuple[str, bool, str]]:
    def source(seed: int, stage: int = args.slow_stage) -> ReplaySource:
        return ReplaySource(
            trace, stage=stage, seed=seed, run_id="check", noise_var_degc2=args.noise_var
        )

    def run(src: ReplaySource) -> list[dict[str, float]]:
        return [src.observe(t) for t in range(args.tokens)]

    results = []
    first = run(source(args.seed))
    results.append(("replay contract", tuple(first[0]) == OBS_KEYS, f"keys {list(first[0])}"))
    same = first == run(source(args.seed))
    results.append(("replay same seed", same, f"{args.tokens} observations identical: {same}"))
    differ = first != run(source(args.seed + 1))
    results.append(("replay other seed", differ, f"seed {args.seed + 1} differs: {differ}"))

    src = source(args.seed)
    noise = [src.observe(t)["theta_obs"] - src.truth(t).theta_c for t in range(NOISE_SAMPLES)]
    var = statistics.pvariance(noise)
    ok = var > 0 and abs(var - args.noise_var) <= NOISE_REL_TOLERANCE * args.noise_var
    results.append(
        (
            "replay noise",
            ok,
            f"variance {var:.4f} degC^2 over {NOISE_SAMPLES} (want {args.noise_var})",
        )
    )

    src = source(args.seed)
    last = src.truth(args.tokens - 1)
    before = src.exhausted
    held = src.truth(args.tokens + 50) == last and src.phi(args.tokens + 50) == last.phi
    ok = not before and src.exhausted and held
    results.append(
        (
            "replay exhaustion",
            ok,
            f"exhausted {before} -> {src.exhausted}, last record held: {held}",
        )
    )
    return results


def check_inject() -> tuple[str, bool, str]:
    slept = [inject(20.0, 1.5) for _ in range(5)]  # 10 ms each
    med = statistics.median(slept)
    ok = 10.0 <= med < 20.0
    return ("inject phi=1.5 x 20 ms", ok, f"median sleep {med:.2f} ms (want 10 ms, >= 10)")


def check_live(samples: int) -> list[tuple[str, bool, str]]:
    with LiveSource(stage=0, period_s=0.1) as live:
        assert isinstance(live, LiveSource)
        time.sleep(0.25)  # let the sampler thread run a couple of times
        obs = live.observe(0)
        costs_ms = []
        for t in range(samples):
            t0 = time.perf_counter()
            live.observe(t)
            costs_ms.append((time.perf_counter() - t0) * 1e3)
        tool = live.gpu_tool or "none"
    med = statistics.median(costs_ms)
    p99 = sorted(costs_ms)[int(0.99 * (len(costs_ms) - 1))]
    shown = ", ".join(f"{k}={v:.3f}" for k, v in obs.items())
    return [
        ("live contract", tuple(obs) == OBS_KEYS, f"{shown} (gpu tool: {tool})"),
        (
            "live read cost",
            med <= READ_BUDGET_MS,
            f"median {med * 1e3:.1f} us, p99 {p99 * 1e3:.1f} us over {samples} (budget {READ_BUDGET_MS} ms)",
        ),
    ]


def guarded(
    name: str, fn: Callable[[], list[tuple[str, bool, str]]]
) -> list[tuple[str, bool, str]]:
    try:
        return fn()
    except SplitlabError as exc:
        return [(name, False, f"{type(exc).__name__}: {exc}")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profile", default="one_slow_node", choices=sorted(PROFILES))
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=DriftConfig.length_tokens)
    ap.add_argument("--seed", type=int, default=DriftConfig.seed)
    ap.add_argument("--slow-stage", type=int, default=DriftConfig.slow_stage)
    ap.add_argument("--noise-var", type=float, default=DriftConfig.noise_var_degc2,
                    help="degC^2; 0 must fail")  # fmt: skip
    ap.add_argument("--live-samples", type=int, default=10_000)
    ap.add_argument("--no-live", action="store_true", help="skip the live-sensor checks")
    args = ap.parse_args(argv)

    params = ProfileParams(args.stages, args.tokens, args.seed, args.slow_stage)
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "drift.jsonl"
        write_trace(
            trace, TraceHeader.for_profile(args.profile, params), generate(args.profile, params)
        )
        results = guarded("replay", lambda: check_replay(args, trace))
    results.append(check_inject())
    if not args.no_live:
        results += guarded("live", lambda: check_live(args.live_samples))

    for name, ok, detail in results:
        print(f"{'PASS' if ok else 'FAIL'}  {name:<24} {detail}")
    failed = [name for name, ok, _ in results if not ok]
    print(f"{len(results) - len(failed)}/{len(results)} checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    leave(main())
