"""What a barrier's decision costs: each planner's `decide` over a ring's barriers.

The head decides the next barrier on its own thread, between tokens (`infer.window`), so a
decision's time is paid once a window on the token path. This benchmark replays a
`link_degrade`-like run in memory (no processes: the decision is a pure function): a ring of
`--stages` stages over a SmolLM2-sized model (30 blocks), one barrier every `--window` tokens,
the last stage's link falling linearly, each stage's block time with noise, and times every
planner's `decide` per barrier (one thread; the same views for every planner). `model` scores
every cut set one reconfiguration reaches (~300 for 3 stages, ~2,000 for 4) as arrays.

    python tools/bench_planner.py --quick --out /tmp/bench_planner.json
    python tools/bench_planner.py --stages 4 --bypass
"""

from __future__ import annotations

import random
import sys
import time

from splitlab.errors import tool_exit
from splitlab.infer.planners import (
    Adaptive,
    Calibration,
    ModelPlanner,
    Noop,
    Planner,
    StageStats,
    WindowView,
)
from splitlab.infer.route import stage_blocks
from splitlab.telemetry.bench import BenchReport, bench_arg_parser, median, thread_policy
from splitlab.telemetry.log import leave

NUM_LAYERS = 30  # SmolLM2-135M's blocks
HIDDEN_BYTES, TOKEN_BYTES, KV_BYTES = 2304, 8, 1536  # its fp32 hidden state, a token id, KV
MODEL_DECIDE_GOAL_MS = 1.0  # a decision well under a token's ~40 ms on 2 cores


def views(num_stages: int, barriers: int, window: int, seed: int) -> list[WindowView]:
    """A run's barriers on even cuts: the last stage's link from 1.0 down to 0.1."""
    rng = random.Random(seed)
    per = NUM_LAYERS // num_stages
    cuts = tuple(per * (s + 1) for s in range(num_stages - 1))
    out = []
    for b in range(barriers):
        token = (b + 1) * window
        link = max(0.1, 1.0 - 0.9 * b / max(1, barriers - 1))
        stats = tuple(
            StageStats(stage=s, num_blocks=n, compute_ms=(2.0 + n) * rng.uniform(0.95, 1.05),
                       real_ms=2.0 + n, blocks_ms=float(n), tokens=window,
                       send_bytes=TOKEN_BYTES if s == num_stages - 1 else HIDDEN_BYTES,
                       kv_bytes_per_block_token=KV_BYTES, link_obs_token=token)
            for s, n in enumerate(stage_blocks(cuts, NUM_LAYERS))
        )  # fmt: skip
        obs = tuple({"q_cmp_obs": 0.5, "q_mem_obs": 0.4,
                     "link_obs": link if s == num_stages - 1 else 1.0}
                    for s in range(num_stages))  # fmt: skip
        out.append(WindowView(token=token, cuts=cuts, num_layers=NUM_LAYERS, stats=stats,
                              obs=obs, context=16 + token))  # fmt: skip
    return out


def decide_ms(planner: Planner, run: list[WindowView]) -> list[float]:
    times = []
    for view in run:
        t0 = time.perf_counter()
        planner.decide(view)
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def main(argv: list[str] | None = None) -> int:
    p = bench_arg_parser(__doc__.split("\n")[0])
    p.add_argument("--stages", type=int, default=3, help="ring stages")
    p.add_argument("--bypass", action="store_true", help="planners may skip a middle stage")
    p.add_argument("--barriers", type=int, default=48, help="barriers in the replayed run")
    p.add_argument("--window", type=int, default=8, help="tokens between barriers")
    p.add_argument("--reps", type=int, default=5, help="replays per planner (alternating)")
    args = p.parse_args(argv)
    if args.stages < 2:
        p.error(f"--stages={args.stages}: a ring has at least 2 stages")
    reps, barriers = (2, 12) if args.quick else (args.reps, args.barriers)
    run = views(args.stages, barriers, args.window, seed=0)
    calibration = Calibration(load_c1_ms=30.0, link_alpha_ms=0.5, link_beta_ms_per_byte=8e-5,
                              link_bucket_bytes=16384.0, defaults=())  # fmt: skip
    planners = {
        "noop": lambda: Noop(),
        "adaptive": lambda: Adaptive(bypass=args.bypass),
        "model": lambda: ModelPlanner(calibration=calibration, bypass=args.bypass),
    }
    report = BenchReport(bench="planner", config={
        "stages": args.stages, "bypass": args.bypass, "barriers": barriers,
        "window": args.window, "reps": reps, "num_layers": NUM_LAYERS,
    })  # fmt: skip
    for name in planners:
        report.add_arm(name, thread_policy(torch_threads=None))
    samples: dict[str, list[float]] = {name: [] for name in planners}
    for _ in range(reps):
        for name, build in planners.items():
            samples[name] += decide_ms(build(), run)[1:]  # the first fills the cuts' cache
    for name, values in samples.items():
        report.add_result(planner=name, decide_ms_median=median(values),
                          decide_ms_max=max(values), decisions=len(values))  # fmt: skip
    per_token = median(samples["model"]) / args.window
    report.add_result(model_ms_per_token=per_token)
    report.add_target("model_decide_ms", median(samples["model"]), MODEL_DECIDE_GOAL_MS, "<=")
    print("; ".join(f"{name} {median(v):.3f} ms (max {max(v):.2f})"
                    for name, v in samples.items()) + " a decision", file=sys.stderr)  # fmt: skip
    report.write(args.out)
    return report.exit_code(require_quiet=args.require_quiet)


if __name__ == "__main__":
    leave(tool_exit("bench_planner", main))
