"""Cost of live re-partitioning: the barrier's protocol time and the pause of a 1-block shift.

Runs the 3-stage SmolLM2 ring over TCP (127.0.0.1/.2/.3) with the window barrier, alternating
a no-shift run and a run that shifts boundary 1 by +1 block at `--shift-at`, and reads the
stage traces:

- barrier time at the tail (stage S-1: PROPOSE received -> COMMIT applied; it waits for
  nobody, so this is the protocol cost), and at the head (PROPOSE sent -> COMMIT sent), over
  every barrier that moved nothing in both runs; the no-shift run takes a barrier every
  `--barrier-window` tokens (default 2: the cost per barrier does not depend on W, and a
  median of two or three barriers says nothing on a shared host), with median and p90;
- the shift's pause split into weights (receiver: taking the blocks it built while the ring
  decoded the window before, `architecture.prepare_ahead`, or with `--at-barrier` also a run
  that loads them from its own checkpoint copy inside the barrier), KV (receiver: waiting
  for, receiving and installing the donor's KV - an upper bound, it absorbs the skew between
  the two stages reaching the barrier) and commit (pointer swaps, the larger of both sides),
  with the background build (prepare) and release (dropping the detached block,
  empty_cache) off the token path and reported apart;
- KV bytes, checked against 2 x kv heads x head dim x dtype bytes x blocks x context;
- head TPOT median of both runs.

    python tools/bench_migration.py --quick --out /tmp/bench_migration.json
    python tools/bench_migration.py --tokens 200 --shift-at 100 --reps 2 --out outputs/bench_migration.json
    python tools/bench_migration.py model=tiny_llama architecture.cuts=[1,3] --quick  # overrides
    python tools/bench_migration.py --at-barrier --quick model=tiny_llama model.num_layers=12 \
        model.hidden_size=1152 model.num_heads=9 model.num_kv_heads=3 \
        model.intermediate_size=3072 architecture.cuts=[4,8]  # blocks 4x SmolLM2's
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from transformers import AutoConfig

from splitlab.configure import compose_config
from splitlab.errors import tool_exit
from splitlab.infer.topology import resolve_ring
from splitlab.launch.ring import model_ref, run_ring
from splitlab.telemetry.bench import BenchReport, bench_arg_parser, median
from splitlab.telemetry.log import leave

PROMPT = "Write a long story about a robot who learns to paint."
HOSTS = ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def records(run_dir: Path, stage: int, kind: str) -> list[dict]:
    path = run_dir / "traces" / f"stage-{stage}.jsonl"
    return [r for r in map(json.loads, path.open()) if r["kind"] == kind]


def still(windows: list[dict], cuts: list[int]) -> list[dict]:
    """The committed barriers that moved nothing (their cuts equal the previous barrier's)."""
    out, before = [], list(cuts)
    for w in windows:
        if not w["aborted"] and w["cuts"] == before:
            out.append(w)
        before = w["cuts"]
    return out


def p90(values: list[float]) -> float:
    return sorted(values)[int(0.9 * (len(values) - 1))]


def base_overrides(tokens: int, user: list[str]) -> list[str]:
    return [
        "task=infer", "model=smollm2_135m", "architecture.cuts=[10,20]",
        f"architecture.peer_hosts=[{','.join(HOSTS)}]", f"task.prompt={PROMPT}",
        f"task.max_new_tokens={tokens}", "task.ignore_eos=true", *user,
    ]  # fmt: skip


def run(base: list[str], arm: list[str], *, tag: str) -> Path:
    """One ring run of the base config plus this arm's overrides (planner, window)."""
    run_dir = Path(tempfile.mkdtemp(prefix=f"bench_migration-{tag}-"))
    group, result = run_ring(compose_config([*base, *arm]), run_dir=run_dir, timeout_s=900)
    if group.exit_code != 0 or result is None:
        raise SystemExit(f"ring failed: {group.diagnosis()}")
    (run_dir / "result.json").write_text(json.dumps(result))
    return run_dir


def main(argv: list[str] | None = None) -> int:
    p = bench_arg_parser(__doc__.split("\n")[0])
    p.add_argument("overrides", nargs="*", help="Hydra overrides on task=infer (model, cuts...)")
    p.add_argument("--tokens", type=int, default=200)
    p.add_argument("--shift-at", type=int, default=100)
    p.add_argument("--window", type=int, default=20)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--barrier-window", type=int, default=2, help="W of the no-shift run")
    p.add_argument("--at-barrier", action="store_true",
                   help="also a shift run that loads the weights inside the barrier "
                        "(architecture.prepare_ahead=false), side by side")  # fmt: skip
    args = p.parse_args(argv)
    tokens, shift_at, reps = (60, 40, 1) if args.quick else (args.tokens, args.shift_at, args.reps)
    base = base_overrides(tokens, args.overrides)
    cfg = compose_config(base)
    cuts = resolve_ring(cfg).cuts
    folder = Path(model_ref(cfg.model, Path(tempfile.mkdtemp(prefix="bench_migration-")), seed=0))
    config = AutoConfig.from_pretrained(folder)
    report = BenchReport(bench="migration", config={
        "model": cfg.model.name, "cuts": cuts, "hosts": HOSTS, "tokens": tokens, "shift_at": shift_at,
        "window": args.window, "barrier_window": args.barrier_window, "reps": reps, "shift": {"boundary": 1, "k": 1},
    })  # fmt: skip
    tail = len(cuts)
    shift = ["planner=forced_shift", f"planner.at_token={shift_at}", "planner.shift_k=1",
             "planner.boundary=1", f"architecture.window={args.window}"]  # fmt: skip
    arms = [
        ("noshift", ["planner=noop", f"architecture.window={args.barrier_window}"]),
        ("shift", [*shift, "architecture.prepare_ahead=true"]),
    ]
    if args.at_barrier:
        arms.append(("shift_at_barrier", [*shift, "architecture.prepare_ahead=false"]))
    tail_barrier, head_barrier, tpot = [], [], {tag: [] for tag, _ in arms}
    pauses: dict[str, list[dict]] = {tag: [] for tag, _ in arms[1:]}
    for rep in range(reps):
        for tag, arm in arms:
            run_dir = run(base, arm, tag=f"{tag}-{rep}")
            result = json.loads((run_dir / "result.json").read_text())
            tpot[tag].append(result["tpot_ms_median"])
            tail_barrier += [w["barrier_ms"] for w in still(records(run_dir, tail, "window"), cuts)]
            head_barrier += [w["barrier_ms"] for w in still(records(run_dir, 0, "window"), cuts)]
            if tag != "noshift":
                moves = {
                    m["side"]: m for s in range(tail + 1) for m in records(run_dir, s, "migration")
                }
                recv, donor = moves["receiver"], moves["donor"]
                commit_ms = max(recv["commit_ms"], donor["commit_ms"])
                dtype_bytes = DTYPE_BYTES[str(getattr(config, "dtype", None) or config.torch_dtype).removeprefix("torch.")]  # fmt: skip
                head_dim = (
                    getattr(config, "head_dim", None)
                    or config.hidden_size // config.num_attention_heads
                )
                per_token = 2 * config.num_key_value_heads * head_dim * dtype_bytes
                assert recv["kv_bytes_per_block_token"] == per_token, (recv, per_token)
                context = recv["kv_bytes"] // per_token
                row = {"arm": tag, "rep": rep, "token": recv["token"], "context_tokens": context,
                       "prepared": recv.get("prepared", False), "prepare_ms": recv.get("prepare_ms", 0.0),
                       "weights_ms": recv["weights_ms"], "kv_ms": recv["kv_ms"], "commit_ms": commit_ms,
                       "pause_ms": recv["weights_ms"] + recv["kv_ms"] + commit_ms,
                       "release_ms": donor["release_ms"], "kv_bytes": recv["kv_bytes"],
                       "kv_bytes_per_block_token": per_token, "donor_send_ms": donor["kv_ms"]}  # fmt: skip
                if row["prepared"] != (tag == "shift"):
                    raise SystemExit(f"{tag}: the receiver's blocks were {'' if row['prepared'] else 'not '}built ahead")  # fmt: skip
                pauses[tag].append(row)
                report.add_result(shift=row)
                print(f"rep {rep} {tag}: pause {row['pause_ms']:.2f} ms (weights {row['weights_ms']:.2f}, "
                      f"KV {row['kv_ms']:.2f}, commit {row['commit_ms']:.3f}), built ahead in "
                      f"{row['prepare_ms']:.1f} ms, release {row['release_ms']:.1f} ms", file=sys.stderr)  # fmt: skip
    summary = {
        "barrier_tail_median_ms": median(tail_barrier), "barrier_tail_p90_ms": p90(tail_barrier),
        "barrier_head_median_ms": median(head_barrier), "num_barriers_tail": len(tail_barrier),
        "tpot_noshift_median_ms": median(tpot["noshift"]), "tpot_shift_median_ms": median(tpot["shift"]),
    }  # fmt: skip
    for tag, rows in pauses.items():
        suffix = "" if tag == "shift" else "_at_barrier"  # shift: the blocks built ahead
        for key in ("pause", "weights", "kv", "commit", "release", "prepare"):
            summary[f"{key}{suffix}_median_ms"] = median([r[f"{key}_ms"] for r in rows])
    if args.at_barrier:
        summary["tpot_shift_at_barrier_median_ms"] = median(tpot["shift_at_barrier"])
    report.add_result(**summary)
    report.add_ratio(
        "shift_over_noshift_tpot",
        summary["tpot_shift_median_ms"] / summary["tpot_noshift_median_ms"],
    )
    report.add_target("barrier_tail_median_ms", summary["barrier_tail_median_ms"], 0.5, "<=")
    report.add_target("shift_pause_without_release_ms", summary["pause_median_ms"], 5.0, "<=")
    if args.at_barrier:
        report.add_ratio(
            "pause_prepared_over_at_barrier",
            summary["pause_median_ms"] / summary["pause_at_barrier_median_ms"],
        )
    report.write(args.out)
    print(json.dumps(summary, indent=1), file=sys.stderr)
    return report.exit_code(require_quiet=args.require_quiet)


if __name__ == "__main__":
    leave(tool_exit("bench_migration", main))
