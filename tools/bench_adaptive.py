"""Planners (adaptive, model) vs noop under drift: same drift trace, same seed, alternating runs.

Runs the 3-stage ring over TCP (127.0.0.1/.2/.3) with the window barrier once per arm and
repetition, noop then each of `--planners` (the order alternates by repetition so machine load
hits every arm), on one replay trace per `--profiles` schedule (`one_slow_node`, `thermal_ramp`
with its ramp time scale at --throttle-at, `link_degrade` to 1 / --link-phi) written once up
front. The slow stage sleeps (phi - 1) x its compute per token, which costs no CPU, so the
slowdown holds on a busy host. Off a testbed a replayed link factor reaches the planners'
observations only: no transport applies it, so `link_degrade` there tests that a planner does
not pay migrations for a link no cut removes. `--calibration` gives `planner=model` its
calibrate.py JSON (else it uses defaults and says so in its decisions).

One sequence is in flight, so TPOT is the SUM of the stage times: moving a block off the slow
stage saves (phi - 1) block times per token. With phi = 1.5 the best cuts gain ~4% (lost in
the noise of a shared host); the default phi = 3 makes the 10/10/10 split cost 10 + 30 + 10 =
50 block units against 32 at the cuts the planner aims for (14/1/15), ~38 for equal stage times.

Reported: per arm the median over repetitions of the mean TPOT over the decode tokens after
the first window (the planner has no statistics before it), also with the barrier and migration
pauses added (`effective`), each planner's ratio over noop and model over adaptive on both (the
targets, <= 1.0, on `effective`: the pauses a planner causes are its cost), each planner's final cuts and blocks on the slow stage before/after, and
whether every run emitted the same tokens.

`--testbed ring3_edge` (as root) runs the stages inside the testbed's hosts (one testbed for
every run) and the slowdown is real: two scenarios (`--testbed-scenarios`) on the same arms,
`cpu_throttle` (the slow stage's host CPU quota cut by --phi at token --throttle-at, a cgroup
write) and `link_degrade` (the slow stage's host up link falling to 1 / --link-phi of its rate
over the run, tc changes); see splitlab.drift.kernel. Each scenario reports the same summary,
plus `blocks_moved_off_slow_host`.

`--steady` adds a third arm per repetition: noop on the same profile at phi = 1 (no slowdown),
and reports what phi does to the slow stage and to the head (`phi_effect`): the slow stage's
mean compute_ms and the head's mean TPOT, each as noop-at-phi over steady, next to the TPOT
ratio the stage times predict, (TPOT + (phi - 1) x slow compute) / TPOT. With `--phi 1.5` that
is the issue's "compute_ms about 1.5x and the head's TPOT accordingly".

    python tools/bench_adaptive.py --quick --out /tmp/bench_adaptive.json
    python tools/bench_adaptive.py --reps 3 --tokens 160 --out outputs/bench_adaptive.json
    python tools/bench_adaptive.py --tiny --quick
    python tools/bench_adaptive.py model=smollm2_135m architecture.cuts=[8,20]  # Hydra overrides
    python tools/bench_adaptive.py --phi 1.5 --steady --reps 2 --tokens 60 --window 20
    nice python tools/bench_adaptive.py --testbed ring3_edge --reps 1 --tokens 96 --out /tmp/ba.json
    python tools/bench_adaptive.py --profiles link_degrade,thermal_ramp,one_slow_node \
        --calibration cal.json --reps 2 --tokens 100 --out outputs/bench/planners.json
"""

from __future__ import annotations

import contextlib
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from splitlab.config.enums import DriftSource
from splitlab.config.schema import DriftConfig
from splitlab.configure import compose_config
from splitlab.drift.kernel import KERNEL_LOG
from splitlab.drift.source import generate_trace
from splitlab.errors import tool_exit
from splitlab.infer.route import stage_blocks
from splitlab.infer.topology import resolve_ring
from splitlab.launch.ring import run_ring
from splitlab.telemetry.bench import BenchReport, bench_arg_parser, median
from splitlab.telemetry.log import leave
from splitlab.testbed.placement import testbed_for

PROMPT = "Write a long story about a dragon who learns to cook."
HOSTS = ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
TINY = [  # --tiny: a random-init Llama wide enough that block compute dominates
    "model=tiny_llama", "model.num_layers=12", "model.hidden_size=256",
    "model.intermediate_size=1024", "architecture.cuts=[4,8]",
]  # fmt: skip


def head_records(run_dir: Path, kind: str, stage: int = 0) -> list[dict]:
    path = run_dir / "traces" / f"stage-{stage}.jsonl"
    return [r for r in map(json.loads, path.open()) if r["kind"] == kind]


def write_trace(folder: Path, *, phi: float, slow_stage: int, seed: int, tokens: int,
                profile: str = "one_slow_node", period_tokens: int | None = None) -> dict:  # fmt: skip
    """One replay trace for both arms; returns the drift config fields every stage gets (the
    run's `drift.*` overrides)."""
    fields = {"name": profile, "source": DriftSource.replay.value,
              "seed": seed, "slow_stage": slow_stage, "phi": phi, "length_tokens": tokens + 8}  # fmt: skip
    if period_tokens is not None:
        fields["period_tokens"] = period_tokens
    path = folder / f"{profile}.jsonl"
    generate_trace(DriftConfig(**fields), num_stages=len(HOSTS), out=path)
    return {**fields, "trace": str(path)}


def group_overrides(group: str, fields: dict) -> list[str]:
    """`group=NAME group.key=value ...` for a planner's or drift profile's fields."""
    return [
        f"{group}={fields['name']}",
        *(f"{group}.{k}={v}" for k, v in fields.items() if k != "name"),
    ]


def run_arm(base: list[str], *, window: int, planner: dict, drift: dict, tag: str,
            testbed: Any = None) -> dict:  # fmt: skip
    """One ring run (on `testbed` when given); the arm's figures from the head's result and
    trace, or {"tag", "run_dir", "failed": the group's diagnosis} when the ring failed."""
    run_dir = Path(tempfile.mkdtemp(prefix=f"bench_adaptive-{tag}-"))
    cfg = compose_config([*base, *group_overrides("planner", planner),
                          *group_overrides("drift", drift)])  # fmt: skip
    group, result = run_ring(cfg, run_dir=run_dir, timeout_s=900, testbed=testbed)
    if group.exit_code != 0 or result is None:
        return {"tag": tag, "run_dir": str(run_dir), "failed": group.diagnosis()}
    cuts = list(resolve_ring(cfg).cuts)  # where the run started
    windows = [w for w in head_records(run_dir, "window") if w.get("barrier_ms") is not None]
    tpot = result["tpot_ms"][window:]  # tpot_ms[i] is decode step i + 1: skip the first window
    pauses = sum(w["barrier_ms"] for w in windows if w["token"] >= window)
    decode = [[r for r in head_records(run_dir, "token", s) if r["token"] > window] for s in range(len(HOSTS))]  # fmt: skip
    compute = [statistics.fmean(r["compute_ms"] for r in rs) if rs else 0.0 for rs in decode]
    # per token, the compute of the stages it visited (a skipped stage, architecture.bypass,
    # has no record for the tokens it did not see); the rest of its TPOT is hops and waits
    per_token: dict[int, float] = {}
    for rs in decode:
        for r in rs:
            per_token[r["token"]] = per_token.get(r["token"], 0.0) + r["compute_ms"]
    steps = range(window + 1, window + 1 + len(tpot))
    link = statistics.fmean(t - per_token.get(s, 0.0) for t, s in zip(tpot, steps, strict=True))
    return {
        "tag": tag, "run_dir": str(run_dir), "token_ids": result["token_ids"],
        "tpot_mean_ms": statistics.fmean(tpot), "tpot_median_ms": statistics.median(tpot),
        "effective_mean_ms": (sum(tpot) + pauses) / len(tpot), "barrier_total_ms": pauses,
        "stage_compute_mean_ms": compute,
        "link_mean_ms": link,  # the hops and waits, per token
        "stage_real_mean_ms": [statistics.fmean(r["real_ms"] for r in rs) if rs else 0.0 for rs in decode],
        "cuts": [w["cuts"] for w in windows],
        "moves": sum(1 for i, w in enumerate(windows) if w["cuts"] != (windows[i - 1]["cuts"] if i else cuts)),
        "decisions": [w["decision"] for w in windows],
        "kernel_changes": kernel_changes(run_dir),
    }  # fmt: skip


def kernel_changes(run_dir: Path) -> list[dict]:
    """The drift changes the launcher applied to the testbed (none off a testbed)."""
    path = run_dir / KERNEL_LOG
    return [json.loads(line) for line in path.open()] if path.is_file() else []


def phi_effect(slowed: list[dict], steady: list[dict], *, phi: float, slow_stage: int) -> dict:
    """Medians over repetitions: the slow stage's compute and the head's TPOT, slowed / steady.

    Across arms both ratios carry the host's load drift between runs; two figures from the
    slowed runs alone do not: `compute_over_real` (the slow stage's compute_ms over its own
    forward) and `tpot_over_unslowed` (the head's TPOT over the same TPOT less the injected
    sleep), which holds because TPOT = the stages' compute + a fixed link cost (`link_ms`,
    about equal in both arms when the sleep lands on the head's TPOT one for one).
    """
    slow = median([r["stage_compute_mean_ms"][slow_stage] for r in slowed])
    real = median([r["stage_real_mean_ms"][slow_stage] for r in slowed])
    base = median([r["stage_compute_mean_ms"][slow_stage] for r in steady])
    tpot = median([r["tpot_mean_ms"] for r in slowed])
    tpot_base = median([r["tpot_mean_ms"] for r in steady])
    link = [median([r["tpot_mean_ms"] - sum(r["stage_compute_mean_ms"]) for r in rows]) for rows in (slowed, steady)]  # fmt: skip
    return {"phi": phi, "slow_compute_ms": slow, "steady_compute_ms": base, "compute_ratio": slow / base,
            "compute_over_real": slow / real, "tpot_over_unslowed": tpot / (tpot - (slow - real)),
            "link_ms": link[0], "steady_link_ms": link[1],
            "tpot_ms": tpot, "steady_tpot_ms": tpot_base, "tpot_ratio": tpot / tpot_base,
            "tpot_ratio_predicted": (tpot_base + (phi - 1.0) * base) / tpot_base}  # fmt: skip


def blocks_on(cuts: list[int], stage: int, num_layers: int) -> int:
    return stage_blocks(cuts, num_layers)[stage]


def planner_arms(args: Any) -> dict[str, dict]:
    """The planner fields of each arm `--planners` names (noop first: the baseline)."""
    fields = {"noop": {"name": "noop"},
              "adaptive": {"name": "adaptive", "hysteresis": args.hysteresis},
              # the compute-only controller #16 names: link_obs never read, bypass or not
              "adaptive_compute": {"name": "adaptive", "hysteresis": args.hysteresis,
                                   "links": False},
              "model": {"name": "model", "hysteresis": args.hysteresis,
                        "horizon_tokens": args.horizon_tokens,
                        **({"calibration": args.calibration} if args.calibration else {})}}  # fmt: skip
    names = ["noop", *(n for n in args.planners.split(",") if n and n != "noop")]
    unknown = [n for n in names if n not in fields]
    if unknown:
        raise SystemExit(f"--planners: unknown {unknown}; choose from {sorted(fields)}")
    return {n: fields[n] for n in names}


def run_scenario(base: list[str], *, args: Any, drift: dict, steady: dict | None, reps: int,
                 cuts: list[int], num_layers: int, report: BenchReport, name: str,
                 testbed: Any = None) -> dict:  # fmt: skip
    """noop vs each planner (and `steady`, when given) on one drift schedule; the summary."""
    arms = planner_arms(args)
    drifts = dict.fromkeys(arms, drift)
    if steady is not None:
        arms["steady"], drifts["steady"] = arms["noop"], steady
    runs: dict[str, list[dict]] = {arm: [] for arm in arms}
    failed: dict[str, list[str]] = {}  # a failed run is reported and left out of the figures
    for rep in range(reps):
        order = list(arms) if rep % 2 == 0 else list(reversed(arms))
        for arm in order:
            row = run_arm(base, window=args.window, planner=arms[arm], drift=drifts[arm],
                          tag=f"{name}-{arm}-{rep}", testbed=testbed)  # fmt: skip
            report.add_result(scenario=name, rep=rep, arm=arm,
                              **{k: v for k, v in row.items() if k != "token_ids"})  # fmt: skip
            if "failed" in row:
                failed.setdefault(arm, []).append(row["failed"])
                print(f"{name} rep {rep} {arm:8s}: FAILED: {row['failed']}", file=sys.stderr)
                continue
            runs[arm].append({**row, "rep": rep})
            print(f"{name} rep {rep} {arm:8s}: mean TPOT {row['tpot_mean_ms']:.2f} ms (effective "
                  f"{row['effective_mean_ms']:.2f}), final cuts {row['cuts'][-1]}, {row['moves']} moves",
                  file=sys.stderr)  # fmt: skip
    if not runs["noop"]:
        raise SystemExit(f"{name}: every noop run failed: {failed['noop'][0]}")
    runs = {arm: rows for arm, rows in runs.items() if rows}
    first = runs["noop"][0]["token_ids"]
    identical = all(r["token_ids"] == first for arm in runs.values() for r in arm)
    planners = [arm for arm in runs if arm not in ("noop", "steady")]
    by_rep = {r["rep"]: r for r in runs["noop"]}
    med = {arm: median([r["tpot_mean_ms"] for r in rows]) for arm, rows in runs.items()}
    eff = {arm: median([r["effective_mean_ms"] for r in rows]) for arm, rows in runs.items()}
    final = {arm: runs[arm][-1]["cuts"][-1] for arm in planners}
    before = blocks_on(cuts, args.slow_stage, num_layers)
    after = {arm: blocks_on(final[arm], args.slow_stage, num_layers) for arm in planners}
    summary = {
        "scenario": name, "drift": {k: v for k, v in drift.items() if k != "trace"},
        "tpot_median_ms": med, "effective_median_ms": eff,
        "link_median_ms": {arm: median([r["link_mean_ms"] for r in rows]) for arm, rows in runs.items()},
        "ratio_over_noop": {arm: med[arm] / med["noop"] for arm in planners},
        "paired_ratios": {arm: [a["tpot_mean_ms"] / by_rep[a["rep"]]["tpot_mean_ms"]
                                for a in runs[arm] if a["rep"] in by_rep] for arm in planners},
        "tokens_identical": identical, "cuts_before": cuts, "cuts_after": final,
        "slow_stage_blocks_before": before, "slow_stage_blocks_after": after,
        "blocks_moved_off_slow_host": {arm: after[arm] < before for arm in planners},
        "cut_trajectory": {arm: runs[arm][-1]["cuts"] for arm in planners},
        "moves": {arm: [r["moves"] for r in runs[arm]] for arm in planners},
        "kernel_changes": runs["noop"][-1]["kernel_changes"],
        "failed": failed,
    }  # fmt: skip
    if steady is not None and "steady" in runs:
        summary["phi_effect"] = phi_effect(runs["noop"], runs["steady"], phi=args.phi,
                                           slow_stage=args.slow_stage)  # fmt: skip
    report.add_result(**summary)
    suffix = "" if name == "one_slow_node" else f"_{name}"
    # targets on the effective TPOT: a planner's barrier and migration pauses are its cost (on
    # TPOT alone, a move that paused the ring for 20 s to save 5 ms a token would "win")
    for arm in planners:
        report.add_ratio(f"{arm}_over_noop_tpot{suffix}", med[arm] / med["noop"])
        report.add_ratio(f"{arm}_over_noop_effective{suffix}", eff[arm] / eff["noop"])
        report.add_target(f"{arm}_over_noop_effective{suffix}", eff[arm] / eff["noop"], 1.0, "<=")
    for other in ("adaptive", "adaptive_compute"):
        if {"model", other} <= set(planners):
            report.add_ratio(f"model_over_{other}_tpot{suffix}", med["model"] / med[other])
            report.add_ratio(f"model_over_{other}_effective{suffix}", eff["model"] / eff[other])
            report.add_target(f"model_over_{other}_effective{suffix}", eff["model"] / eff[other],
                              1.0, "<=")  # fmt: skip
    print(json.dumps(summary, indent=1), file=sys.stderr)
    return summary


def main(argv: list[str] | None = None) -> int:
    p = bench_arg_parser(__doc__.split("\n")[0])
    p.add_argument("overrides", nargs="*", help="Hydra overrides on task=infer (model, cuts...)")
    p.add_argument("--tiny", action="store_true", help="a random-init 12-block Llama")
    p.add_argument("--tokens", type=int, default=160)
    p.add_argument("--window", type=int, default=10)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--phi", type=float, default=3.0)
    p.add_argument("--slow-stage", type=int, default=1)
    p.add_argument("--hysteresis", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=77)
    p.add_argument("--steady", action="store_true", help="add a noop arm at phi = 1 (phi_effect)")
    p.add_argument("--testbed", help="run on this testbed (as root): cpu_throttle and link_degrade")
    p.add_argument(
        "--throttle-at",
        type=int,
        default=None,
        help="--testbed: cpu_throttle's token (default: a quarter of --tokens)",
    )
    p.add_argument("--link-phi", type=float, default=50.0,
                   help="link_degrade's final rate divisor")  # fmt: skip
    p.add_argument(
        "--planners",
        default="adaptive,model",
        help="arms beside noop, comma-separated: adaptive, adaptive_compute (links=false), model",
    )
    p.add_argument("--profiles", default="one_slow_node",
                   help="replayed drift profiles (off a testbed), comma-separated: "
                        "one_slow_node, thermal_ramp, link_degrade")  # fmt: skip
    p.add_argument("--calibration", help="planner=model's calibration JSON (calibrate.py)")
    p.add_argument("--horizon-tokens", type=int, default=64, help="planner=model's horizon")
    p.add_argument(
        "--testbed-scenarios",
        default="cpu_throttle,link_degrade",
        help="--testbed: which of cpu_throttle, link_degrade to run",
    )
    args = p.parse_args(argv)
    tokens, reps = (100, 2) if args.quick else (args.tokens, args.reps)
    where = ([f"testbed={args.testbed}"] if args.testbed
             else [f"architecture.peer_hosts=[{','.join(HOSTS)}]"])  # fmt: skip
    base = [
        "task=infer", "architecture.cuts=[10,20]", *where,
        f"architecture.window={args.window}", f"task.prompt={PROMPT}",
        f"task.max_new_tokens={tokens}", "task.ignore_eos=true",
        *(TINY if args.tiny else []), *args.overrides,
    ]  # fmt: skip
    cfg = compose_config(base)
    num_layers, cuts = cfg.model.num_layers, list(resolve_ring(cfg).cuts)

    def trace(profile: str, phi: float, **kw: Any) -> dict:
        return write_trace(Path(tempfile.mkdtemp(prefix=f"bench_adaptive-{profile}-")), phi=phi,
                           slow_stage=args.slow_stage, seed=args.seed, tokens=tokens,
                           profile=profile, **kw)  # fmt: skip

    at = args.throttle_at if args.throttle_at is not None else tokens // 4
    schedules = {"one_slow_node": lambda: trace("one_slow_node", args.phi),
                 "thermal_ramp": lambda: trace("thermal_ramp", args.phi, period_tokens=at),
                 "cpu_throttle": lambda: trace("cpu_throttle", args.phi, period_tokens=at),
                 "link_degrade": lambda: trace("link_degrade", args.link_phi)}  # fmt: skip
    names = (args.testbed_scenarios if args.testbed else args.profiles).split(",")
    unknown = [n for n in names if n not in schedules]
    if unknown:
        raise SystemExit(f"unknown drift schedules {unknown}; choose from {sorted(schedules)}")
    scenarios = {n: schedules[n]() for n in names}
    steady = trace("one_slow_node", 1.0) if args.steady else None
    report = BenchReport(bench="adaptive", config={
        "model": cfg.model.name, "cuts": cuts, "hosts": args.testbed or HOSTS, "tokens": tokens,
        "window": args.window, "reps": reps, "hysteresis": args.hysteresis,
        "planners": list(planner_arms(args)), "calibration": args.calibration,
        "horizon_tokens": args.horizon_tokens,
        "drift": {n: {k: v for k, v in d.items() if k != "trace"} for n, d in scenarios.items()},
    })  # fmt: skip
    summaries = []
    with testbed_for(cfg.testbed) if args.testbed else contextlib.nullcontext() as tb:
        for name, drift in scenarios.items():
            summaries.append(run_scenario(
                base, args=args, drift=drift, steady=steady, reps=reps, cuts=cuts,
                num_layers=num_layers, report=report, name=name, testbed=tb,
            ))  # fmt: skip
    report.write(args.out)
    identical = all(s["tokens_identical"] for s in summaries)
    ok = identical and not any(s["failed"] for s in summaries)
    return report.exit_code(require_quiet=args.require_quiet) or (0 if ok else 1)


if __name__ == "__main__":
    leave(tool_exit("bench_adaptive", main))
