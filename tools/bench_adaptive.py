"""Adaptive planner vs noop on one slow stage: same drift trace, same seed, alternating runs.

Runs the 3-stage ring over TCP (127.0.0.1/.2/.3) with the window barrier twice per repetition,
noop then adaptive (the order alternates by repetition so machine load hits both arms), on one
replay trace of the `one_slow_node` profile written once up front. The slow stage sleeps
(phi - 1) x its compute per token, which costs no CPU, so the slowdown holds on a busy host.

One sequence is in flight, so TPOT is the SUM of the stage times: moving a block off the slow
stage saves (phi - 1) block times per token. With phi = 1.5 the best cuts gain ~4% (lost in
the noise of a shared host); the default phi = 3 makes the 10/10/10 split cost 10 + 30 + 10 =
50 block units against 32 at the cuts the planner aims for (14/1/15), ~38 for equal stage times.

Reported: per arm the median over repetitions of the mean TPOT over the decode tokens after
the first window (the planner has no statistics before it), also with the barrier and migration
pauses added (`effective`), the ratio adaptive / noop (target <= 1.0), the adaptive arm's final
cuts and blocks on the slow stage before/after, and whether every run emitted the same tokens.

`--steady` adds a third arm per repetition: noop on the same profile at phi = 1 (no slowdown),
and reports what phi does to the slow stage and to the head (`phi_effect`): the slow stage's
mean compute_ms and the head's mean TPOT, each as noop-at-phi over steady, next to the TPOT
ratio the stage times predict, (TPOT + (phi - 1) x slow compute) / TPOT. With `--phi 1.5` that
is the issue's "compute_ms about 1.5x and the head's TPOT accordingly".

    python tools/bench_adaptive.py --quick --out /tmp/bench_adaptive.json
    python tools/bench_adaptive.py --reps 3 --tokens 160 --out outputs/bench_adaptive.json
    python tools/bench_adaptive.py --model tiny --quick
    python tools/bench_adaptive.py --phi 1.5 --steady --reps 2 --tokens 60 --window 20
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path

from splitlab.config.enums import DriftName, DriftSource
from splitlab.config.schema import DriftConfig
from splitlab.drift.source import generate_trace
from splitlab.infer.stage import resolve_model_folder
from splitlab.infer.tiny import save_tiny
from splitlab.launch.ring import RingLayout, pick_base_port, run_ring
from splitlab.telemetry.bench import BenchReport, bench_arg_parser, median

PROMPT = "Write a long story about a dragon who learns to cook."
HOSTS = ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
TINY_LAYERS = 12


def head_records(run_dir: Path, kind: str, stage: int = 0) -> list[dict]:
    path = run_dir / "traces" / f"stage-{stage}.jsonl"
    return [r for r in map(json.loads, path.open()) if r["kind"] == kind]


def write_trace(folder: Path, *, phi: float, slow_stage: int, seed: int, tokens: int) -> dict:
    """One replay trace for both arms; returns the drift config fields every stage gets."""
    fields = {"name": DriftName.one_slow_node.value, "source": DriftSource.replay.value,
              "seed": seed, "slow_stage": slow_stage, "phi": phi, "length_tokens": tokens + 8}  # fmt: skip
    path = folder / "one_slow_node.jsonl"
    generate_trace(DriftConfig(**fields), num_stages=len(HOSTS), out=path)
    return {**fields, "trace": str(path)}


def run_arm(model: str, *, cuts: list[int], tokens: int, window: int, planner: dict,
            drift: dict, extra: list[str], tag: str) -> dict:  # fmt: skip
    """One ring run; the arm's figures from the head's result and trace."""
    run_dir = Path(tempfile.mkdtemp(prefix=f"bench_adaptive-{tag}-"))
    layout = RingLayout(model=model, cuts=cuts, hosts=HOSTS, base_port=pick_base_port(HOSTS),
                        run_id=f"bench-{tag}", window=window, planner=planner, drift=drift,
                        extra=extra)  # fmt: skip
    group, result = run_ring(layout, run_dir=run_dir, timeout_s=900, head_args=[
        "--prompt", PROMPT, "--max-new-tokens", str(tokens), "--ignore-eos"])  # fmt: skip
    if group.exit_code != 0 or result is None:
        raise SystemExit(f"ring failed ({tag}): {group.diagnosis()}")
    windows = [w for w in head_records(run_dir, "window") if w.get("barrier_ms") is not None]
    tpot = result["tpot_ms"][window:]  # tpot_ms[i] is decode step i + 1: skip the first window
    pauses = sum(w["barrier_ms"] for w in windows if w["token"] >= window)
    decode = [[r for r in head_records(run_dir, "token", s) if r["token"] > window] for s in range(len(HOSTS))]  # fmt: skip
    return {
        "tag": tag, "run_dir": str(run_dir), "token_ids": result["token_ids"],
        "tpot_mean_ms": statistics.fmean(tpot), "tpot_median_ms": statistics.median(tpot),
        "effective_mean_ms": (sum(tpot) + pauses) / len(tpot), "barrier_total_ms": pauses,
        "stage_compute_mean_ms": [statistics.fmean(r["compute_ms"] for r in rs) for rs in decode],
        "stage_real_mean_ms": [statistics.fmean(r["real_ms"] for r in rs) for rs in decode],
        "cuts": [w["cuts"] for w in windows],
        "moves": sum(1 for i, w in enumerate(windows) if w["cuts"] != (windows[i - 1]["cuts"] if i else cuts)),
        "decisions": [w["decision"] for w in windows],
    }  # fmt: skip


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
    bounds = [0, *cuts, num_layers]
    return bounds[stage + 1] - bounds[stage]


def main(argv: list[str] | None = None) -> int:
    p = bench_arg_parser(__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2_135m", help="asset, folder, or 'tiny'")
    p.add_argument("--cuts", default=None, help="default: 10,20 (SmolLM2), 4,8 (tiny)")
    p.add_argument("--tokens", type=int, default=160)
    p.add_argument("--window", type=int, default=10)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--phi", type=float, default=3.0)
    p.add_argument("--slow-stage", type=int, default=1)
    p.add_argument("--hysteresis", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=77)
    p.add_argument("--steady", action="store_true", help="add a noop arm at phi = 1 (phi_effect)")
    args = p.parse_args(argv)
    tokens, reps = (100, 2) if args.quick else (args.tokens, args.reps)
    extra: list[str] = []
    if args.model == "tiny":
        folder = save_tiny("tiny_llama", Path(tempfile.mkdtemp(prefix="bench_adaptive-tiny-")),
                           overrides=(f"model.num_layers={TINY_LAYERS}", "model.hidden_size=256",
                                      "model.intermediate_size=1024"))  # fmt: skip
        extra, num_layers, default_cuts = ["--tokenizer", "gpt2_tokenizer"], TINY_LAYERS, "4,8"
    else:
        folder = resolve_model_folder(args.model)
        num_layers = json.loads((Path(folder) / "config.json").read_text())["num_hidden_layers"]
        default_cuts = "10,20"
    cuts = [int(c) for c in (args.cuts or default_cuts).split(",")]
    drift = write_trace(Path(tempfile.mkdtemp(prefix="bench_adaptive-trace-")), phi=args.phi,
                        slow_stage=args.slow_stage, seed=args.seed, tokens=tokens)  # fmt: skip
    arms = {
        "noop": {"name": "noop"},
        "adaptive": {"name": "adaptive", "hysteresis": args.hysteresis},
    }
    drifts = dict.fromkeys(arms, drift)
    if args.steady:
        arms["steady"] = arms["noop"]
        drifts["steady"] = write_trace(Path(tempfile.mkdtemp(prefix="bench_adaptive-steady-")),
                                       phi=1.0, slow_stage=args.slow_stage, seed=args.seed,
                                       tokens=tokens)  # fmt: skip
    report = BenchReport(bench="adaptive", config={
        "model": args.model, "cuts": cuts, "hosts": HOSTS, "tokens": tokens, "window": args.window,
        "reps": reps, "drift": {k: v for k, v in drift.items() if k != "trace"}, "planners": arms,
    })  # fmt: skip
    runs: dict[str, list[dict]] = {arm: [] for arm in arms}
    for rep in range(reps):
        order = list(arms) if rep % 2 == 0 else list(reversed(arms))
        for arm in order:
            row = run_arm(str(folder), cuts=cuts, tokens=tokens, window=args.window,
                          planner=arms[arm], drift=drifts[arm], extra=extra, tag=f"{arm}-{rep}")  # fmt: skip
            runs[arm].append(row)
            report.add_result(
                rep=rep, arm=arm, **{k: v for k, v in row.items() if k != "token_ids"}
            )
            print(f"rep {rep} {arm:8s}: mean TPOT {row['tpot_mean_ms']:.2f} ms (effective "
                  f"{row['effective_mean_ms']:.2f}), final cuts {row['cuts'][-1]}, {row['moves']} moves",
                  file=sys.stderr)  # fmt: skip
    first = runs["noop"][0]["token_ids"]
    identical = all(r["token_ids"] == first for arm in runs.values() for r in arm)
    final = runs["adaptive"][-1]["cuts"][-1]
    med = {arm: median([r["tpot_mean_ms"] for r in rows]) for arm, rows in runs.items()}
    eff = {arm: median([r["effective_mean_ms"] for r in rows]) for arm, rows in runs.items()}
    paired = [a["tpot_mean_ms"] / n["tpot_mean_ms"] for n, a in zip(runs["noop"], runs["adaptive"], strict=True)]  # fmt: skip
    summary = {
        "tpot_noop_median_ms": med["noop"], "tpot_adaptive_median_ms": med["adaptive"],
        "effective_noop_median_ms": eff["noop"], "effective_adaptive_median_ms": eff["adaptive"],
        "paired_ratios": paired, "paired_ratio_median": median(paired), "tokens_identical": identical,
        "cuts_before": cuts, "cuts_after_adaptive": final,
        "slow_stage_blocks_before": blocks_on(cuts, args.slow_stage, num_layers),
        "slow_stage_blocks_after": blocks_on(final, args.slow_stage, num_layers),
        "adaptive_cut_trajectory": runs["adaptive"][-1]["cuts"],
    }  # fmt: skip
    if args.steady:
        summary["phi_effect"] = phi_effect(runs["noop"], runs["steady"], phi=args.phi,
                                           slow_stage=args.slow_stage)  # fmt: skip
    report.add_result(**summary)
    ratio = med["adaptive"] / med["noop"]
    report.add_ratio("adaptive_over_noop_tpot", ratio)
    report.add_ratio("adaptive_over_noop_effective", eff["adaptive"] / eff["noop"])
    report.add_target("adaptive_over_noop_tpot", ratio, 1.0, "<=")
    report.write(args.out)
    print(json.dumps({**summary, "ratio": ratio}, indent=1), file=sys.stderr)
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
