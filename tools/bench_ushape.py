"""U-shape training throughput: the unsplit model in one process vs 1 owner x 1 worker over TCP
vs the same over the RabbitMQ tensor transport; same data, batch size and steps, one run.

(a) unsplit: the whole model, one process, AdamW over the same trainable tensors (LoRA by
    default, as the main job), on the owner's microbatches;
(b) U-shape over TCP: `splitlab.launch.train` nodes (coordinator, owner, worker), one round,
    no validation, no checkpoint; samples/s from the owner's trace (first PLAN to last step,
    so process start-up and model loading are left out);
(c) the same with `transport=rabbitmq` (control stays on the embedded bus, except on a testbed);
(d) with `--lowrank`: (b) with the low-rank cut (`finetune.sft`: R = `--rank`, residual
    dropped, at `--sft-cuts`), whose traffic saving should show as time saved on a slow link.
Repetitions alternate the arms so machine noise hits all of them; medians are reported, with
each arm's wall-clock seconds and wire bytes per step (one step = one microbatch).

With `--testbed NAME` (as root) the split arms run on that testbed (`testbed=NAME`: the owner
on an edge host, the worker on the cloud host, over the shaped link; the launcher builds and
removes it per run), the RabbitMQ arm with `control=rabbitmq` (the broker through the relay; the
AMQP transport has no delay line, so that arm crosses the rate but not the one-way delay). The
unsplit arm stays in the root namespace. `lowrank_time_saving` is (b)'s seconds per step over
(d)'s: the traffic saving measured as time.
(a) steps once per `--window` microbatches, like (b) and (c) step once per window.

Each split result carries a profile from the owner's and worker's `window_profile` records:
milliseconds per microbatch in each phase (front_fwd, tail, front_bwd, body_fwd, body_bwd,
send, recv, idle, barrier waits, step) and the CPU time the process got (`cpu_ms`), so a
loaded machine (wall >> cpu) and transport time (send + recv) show apart from compute.
`--node-env KEY=VALUE` sets the node processes' environment (the launcher already gives each
node its role's OpenMP threads, `splitlab.launch.threads.role_threads`). Every arm runs with idle
OpenMP threads sleeping after a short spin (`splitlab.launch.threads.omp_env` unless set): on a shared machine spinning threads
that wait for descheduled siblings cost the 2-thread unsplit arm and the nodes alike up to
~8x the CPU per sample, which would measure the load rather than the split.

    python tools/bench_ushape.py --quick --out /tmp/bench_ushape.json
    python tools/bench_ushape.py --steps 32 --reps 3 --out outputs/bench_ushape.json
    python tools/bench_ushape.py --testbed edge_cloud_constrained --lowrank --steps 8 --reps 1
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

from splitlab.launch.threads import omp_env  # noqa: E402 - imports no torch

os.environ.update(omp_env())  # before torch loads OpenMP; the nodes inherit it

import torch

from splitlab.config.enums import DType, FinetuneMethod
from splitlab.configure import compose_config
from splitlab.errors import tool_exit
from splitlab.launch.train import run_finetune
from splitlab.models.load import load_model
from splitlab.models.parts import build_parts, group
from splitlab.models.plan import u_shape_plan
from splitlab.telemetry.bench import BenchReport, bench_arg_parser, median
from splitlab.telemetry.log import leave
from splitlab.train.feed import OwnerFeed
from splitlab.train.lora import apply_lora
from splitlab.train.node_setup import autocast_dtype
from splitlab.train.nodes import autocast, partition_parameters


def overrides(args, transport: str, *, lowrank: bool = False) -> list[str]:
    testbed = [f"testbed={args.testbed}"] if args.testbed else []
    if args.testbed and transport == "rabbitmq":
        testbed.append("control=rabbitmq")  # the embedded bus is not reachable from the hosts
    sft = [
        "finetune.sft.enabled=true", f"finetune.sft.rank={args.rank}",
        "finetune.sft.residual=drop", f"finetune.sft.cuts={args.sft_cuts}",
    ] if lowrank else []  # fmt: skip
    return [
        f"model={args.model}", "architecture.owners=1", "architecture.workers=1",
        f"architecture.microbatches_per_window={args.window}", f"transport={transport}",
        "task.rounds=1", f"task.steps_per_round={args.steps}", "task.validate=false",
        "task.save_checkpoint=false", f"finetune.batch_size={args.batch_size}",
        "architecture.adaptive_weights=false", f"architecture.worker_device={args.device}",
        *testbed, *sft, *args.override,
    ]  # fmt: skip


def unsplit_samples_per_s(args) -> float:
    """(a): the same parts, the same trainable tensors, one process, no wire."""
    cfg = compose_config(overrides(args, "tcp"))
    torch.manual_seed(cfg.task.seed)
    model, tokenizer = load_model(cfg.model)
    arch = cfg.architecture
    plan = u_shape_plan(num_layers=cfg.model.num_layers, cut_layers=arch.cut_layers,
                        tail_blocks=arch.tail_blocks)  # fmt: skip
    parts = build_parts(model, plan)
    if cfg.finetune.method is FinetuneMethod.lora:
        apply_lora(parts, cfg.finetune.lora)
    device = torch.device(args.device)
    whole = group(parts).to(device)
    whole.train()
    feed = OwnerFeed(cfg.data, tokenizer, owner_index=0, num_owners=1,
                     batch_size=cfg.finetune.batch_size, steps_per_round=args.steps,
                     seed=cfg.task.seed, device=device)  # fmt: skip
    batches = feed.round_batches(0)
    optimizer = torch.optim.AdamW(partition_parameters(whole), lr=cfg.finetune.lr)
    front, body, tail = parts
    from splitlab.models.families import INPUT_IDS, PAD_MASK
    from splitlab.models.tokens import positions_from_pad_mask

    threads = torch.get_num_threads()
    # the dtype the split arms' nodes compute in (finetune.compute_dtype), so both arms match
    dtype = autocast_dtype(DType(cfg.finetune.compute_dtype), device)
    began, cpu_began = time.perf_counter(), time.process_time()
    for step, batch in enumerate(batches):
        pad = batch[PAD_MASK]
        pos = positions_from_pad_mask(pad)
        with autocast(dtype, device):
            logits = tail(body(front(batch[INPUT_IDS], pad, pos), pad, pos), pad, pos)
        loss = tail.adapter.loss(logits.float(), tail.adapter.labels(batch)) / args.window
        loss.backward()
        if (step + 1) % args.window == 0 or step + 1 == len(batches):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    seconds, cpu_s = time.perf_counter() - began, time.process_time() - cpu_began
    samples = sum(int(b[PAD_MASK].shape[0]) for b in batches)
    return samples / seconds, {"threads": threads, "cpu_ms_per_sample": 1e3 * cpu_s / samples,
                               "compute_dtype": str(dtype or "weights")}  # fmt: skip


def phase_profile(path: Path) -> dict[str, float]:
    """A node's `window_profile` records summed, in ms per microbatch (cpu_ms / wall_ms too)."""
    totals: dict[str, float] = {}
    microbatches = 0
    for line in path.open():
        record = json.loads(line)
        if record["kind"] != "window_profile":
            continue
        microbatches += record["num_microbatches"]
        for key, value in record.items():
            if key.endswith("_ms"):
                totals[key] = totals.get(key, 0.0) + value
    return {k: round(v / max(microbatches, 1), 2) for k, v in sorted(totals.items())}


def split_samples_per_s(args, transport: str, *, lowrank: bool = False) -> tuple[float, dict]:
    """(b)/(c)/(d): a real 1 x 1 run; samples/s between the owner's first PLAN and last step."""
    cfg = compose_config(overrides(args, transport, lowrank=lowrank))
    cfg.run_dir = tempfile.mkdtemp(prefix=f"bench_ushape-{transport}-")
    code = run_finetune(cfg)
    if code != 0:
        raise SystemExit(f"U-shape over {transport} failed with exit code {code} ({cfg.run_dir})")
    traces = Path(cfg.run_dir) / "traces"
    records = [json.loads(line) for line in (traces / "owner-0.jsonl").open()]
    plans = [r["ts_us"] for r in records if r["kind"] == "plan"]
    steps = [r["ts_us"] for r in records if r["kind"] == "step"]
    samples = next(r["samples"] for r in records if r["kind"] == "round")
    seconds = (max(steps) - min(plans)) / 1e6
    transport_rec = next((r for r in records if r["kind"] == "transport"), {})
    owner_ms = phase_profile(traces / "owner-0.jsonl")
    worker_ms = phase_profile(traces / "worker-0.jsonl")
    microbatches = sum(1 for r in records if r["kind"] == "forward")
    wire_bytes = next(r["bytes"] for r in records if r["kind"] == "round")
    profile = {
        "seconds": seconds,
        "s_per_step": seconds / max(microbatches, 1),
        "bytes_per_step": wire_bytes / max(microbatches, 1),
        "run_dir": cfg.run_dir,
        # owner + worker CPU (all threads) per sample: what the machine's load cannot inflate
        "cpu_ms_per_sample": (owner_ms["cpu_ms"] + worker_ms["cpu_ms"]) * microbatches / samples,
        "samples": samples,
        "bytes": wire_bytes,
        "copy_ms": {k: v for k, v in transport_rec.items() if k.endswith("_ms")},
        "owner_ms_per_microbatch": owner_ms,
        "worker_ms_per_microbatch": worker_ms,
    }
    return samples / seconds, profile


def main(argv: list[str] | None = None) -> int:
    p = bench_arg_parser(__doc__.split("\n")[0])
    p.add_argument("--model", default="minilm")
    p.add_argument("--steps", type=int, default=32, help="microbatches per repetition")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--window", type=int, default=8, help="microbatches per window")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--testbed", default=None, help="run the split arms on this testbed preset")
    p.add_argument("--lowrank", action="store_true", help="add the low-rank cut arm (d)")
    p.add_argument("--rank", type=int, default=8, help="R of the low-rank cut")
    p.add_argument("--sft-cuts", default="both", help="finetune.sft.cuts of the low-rank arm")
    p.add_argument("--override", action="append", default=[], help="extra config override")
    p.add_argument("--device", default="cpu",
                   help="the unsplit arm's and the workers' device (cpu, cuda, cuda:N)")  # fmt: skip
    p.add_argument("--node-env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment of the node processes (not of the unsplit arm)")  # fmt: skip
    args = p.parse_args(argv)
    os.environ.update(item.split("=", 1) for item in args.node_env)  # children inherit it
    if args.quick:
        args.steps, args.reps = 8, 1
    report = BenchReport(bench="ushape", config={
        "model": args.model, "steps": args.steps, "batch_size": args.batch_size,
        "window": args.window, "reps": args.reps, "overrides": args.override,
        "device": args.device,
        "node_env": args.node_env, "testbed": args.testbed, "lowrank": args.lowrank,
        "rank": args.rank, "sft_cuts": args.sft_cuts,
    })  # fmt: skip
    arms = [("tcp", "tcp", False), ("rabbitmq", "rabbitmq", False)]
    arms += [("tcp_lowrank", "tcp", True)] if args.lowrank else []
    runs: dict[str, list[float]] = {"unsplit": [], **{name: [] for name, _, _ in arms}}
    cpu: dict[str, list[float]] = {name: [] for name in runs}  # CPU ms per sample
    per_step: dict[str, list[float]] = {name: [] for name in runs}  # wall seconds per step
    wire: dict[str, list[float]] = {name: [] for name in runs}  # bytes per step
    for rep in range(args.reps):
        unsplit_rate, unsplit = unsplit_samples_per_s(args)
        runs["unsplit"].append(unsplit_rate)
        cpu["unsplit"].append(unsplit["cpu_ms_per_sample"])
        per_step["unsplit"].append(args.batch_size / unsplit_rate)
        wire["unsplit"].append(0.0)
        for name, transport, lowrank in arms:
            rate, profile = split_samples_per_s(args, transport, lowrank=lowrank)
            runs[name].append(rate)
            cpu[name].append(profile["cpu_ms_per_sample"])
            per_step[name].append(profile["s_per_step"])
            wire[name].append(profile["bytes_per_step"])
            report.add_result(rep=rep, transport=transport, arm=name, samples_per_s=rate, **profile)
        report.add_result(rep=rep, unsplit_samples_per_s=unsplit_rate, **unsplit)
        print(f"rep {rep}: " + ", ".join(f"{k} {v[-1]:.2f} samples/s" for k, v in runs.items()),
              file=sys.stderr)  # fmt: skip
    medians = {f"{k}_samples_per_s": median(v) for k, v in runs.items()}
    medians.update({f"{k}_cpu_ms_per_sample": median(v) for k, v in cpu.items()})
    medians.update({f"{k}_s_per_step": median(v) for k, v in per_step.items()})
    medians.update({f"{k}_bytes_per_step": median(v) for k, v in wire.items()})
    report.add_result(**medians)
    if args.lowrank:  # the low-rank cut's traffic saving, and what it buys in wall-clock time
        report.add_ratio(
            "lowrank_bytes_saving",
            medians["tcp_bytes_per_step"] / medians["tcp_lowrank_bytes_per_step"],
        )
        report.add_ratio("lowrank_time_saving",
                         medians["tcp_s_per_step"] / medians["tcp_lowrank_s_per_step"])  # fmt: skip
    # > 1: the split pair spends less CPU per sample than the unsplit process (load-proof)
    report.add_ratio("unsplit_cpu_over_tcp_cpu",
                     medians["unsplit_cpu_ms_per_sample"] / medians["tcp_cpu_ms_per_sample"])  # fmt: skip
    tcp_over_unsplit = medians["tcp_samples_per_s"] / medians["unsplit_samples_per_s"]
    tcp_over_amqp = medians["tcp_samples_per_s"] / medians["rabbitmq_samples_per_s"]
    report.add_ratio("tcp_over_unsplit", tcp_over_unsplit)
    report.add_ratio("tcp_over_rabbitmq", tcp_over_amqp)
    report.add_target("tcp_over_unsplit", tcp_over_unsplit, 1.0, ">=")
    report.add_target("tcp_over_rabbitmq", tcp_over_amqp, 3.0, ">=")
    report.write(args.out)
    print(json.dumps(medians, indent=1), file=sys.stderr)
    return report.exit_code(require_quiet=args.require_quiet)


if __name__ == "__main__":
    leave(tool_exit("bench_ushape", main))
