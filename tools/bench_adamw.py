"""One AdamW step of a fully fine-tuned node: PyTorch's per-tensor loop against its fused kernel.

`splitlab.train.optim.adamw` builds every node's and study's AdamW fused where the parameters
allow; PyTorch's own default on CPU is the per-tensor Python loop. This benchmark builds the
U-shape parts of the configured model (default `model=minilm`, the SFT study's: the owner
holds the embeddings, the front blocks, the tail and the classifier; the worker the body), gives
every trainable tensor a gradient, and times `step()` of both forms on the same partition,
alternating every repetition under one thread policy. It also steps both forms from the same
weights and gradients and reports the largest difference of the weights they reach (the same
update up to rounding).

    python tools/bench_adamw.py --quick --out /tmp/bench_adamw.json
    python tools/bench_adamw.py --threads 2 --reps 9 model=tiny_gpt2
"""

from __future__ import annotations

import copy
import sys
import time
from typing import Any

import torch

from splitlab.config.schema import SftConfig
from splitlab.configure import compose_config
from splitlab.errors import tool_exit
from splitlab.models.load import load_model
from splitlab.models.plan import u_shape_plan
from splitlab.telemetry.bench import BenchReport, bench_arg_parser, median, thread_policy
from splitlab.telemetry.log import leave
from splitlab.train.nodes import partition_parameters
from splitlab.train.optim import adamw

FUSED_OVER_LOOP_GOAL = 0.5  # the fused step at most half the loop's
MAX_ABS_DIFF_GOAL = 1e-5  # fp32 rounding after a few steps, not a different update


def with_grads(params: list[torch.nn.Parameter], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype) * 1e-2


def optimizer(params: list[torch.nn.Parameter], arm: str) -> torch.optim.Optimizer:
    if arm == "fused":
        return adamw(params, lr=1e-4)
    return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, foreach=False)


def step_ms(params: list[torch.nn.Parameter], arm: str, steps: int) -> float:
    """Median ms of `steps` steps after one warm-up (which allocates the state)."""
    opt = optimizer(params, arm)
    opt.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        opt.step()
        times.append((time.perf_counter() - t0) * 1e3)
    return median(times)


def max_abs_diff(part: torch.nn.Module, steps: int) -> float:
    """Both forms from the same weights and gradients for `steps` steps: the largest |diff|."""
    weights = {}
    for arm in ("loop", "fused"):
        twin = copy.deepcopy(part)
        params = partition_parameters(twin)
        with_grads(params, seed=1)
        opt = optimizer(params, arm)
        for _ in range(steps):
            opt.step()
        weights[arm] = [p.detach() for p in params]
    return max(
        float((a - b).abs().max()) for a, b in zip(weights["loop"], weights["fused"], strict=True)
    )


def main(argv: list[str] | None = None) -> int:
    p = bench_arg_parser(__doc__.split("\n")[0])
    p.add_argument("overrides", nargs="*", help="Hydra overrides (model=...)")
    p.add_argument("--reps", type=int, default=5, help="alternating repetitions per arm")
    p.add_argument("--steps", type=int, default=10, help="timed steps per repetition")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = p.parse_args(argv)
    reps, steps = (2, 4) if args.quick else (args.reps, args.steps)
    torch.set_num_threads(args.threads)
    cfg = compose_config(["model=minilm", *args.overrides])
    model, _ = load_model(cfg.model, load_tokenizer=False)
    model.train()
    plan = u_shape_plan(num_layers=model.config.num_hidden_layers, cut_layers=2, tail_blocks=1)
    from splitlab.train.parts import build_training_parts

    front, body, tail = build_training_parts(model, plan, sft=SftConfig())
    nodes = {"owner": partition_parameters(front, tail), "worker": partition_parameters(body)}
    report = BenchReport(bench="adamw", config={
        "model": cfg.model.name, "reps": reps, "steps": steps, "threads": args.threads,
        "parameters": {node: sum(p.numel() for p in ps) for node, ps in nodes.items()},
    })  # fmt: skip
    for arm in ("loop", "fused"):
        report.add_arm(arm, thread_policy(torch_threads=torch.get_num_threads()))
    runs: dict[tuple[str, str], list[float]] = {}
    for _ in range(reps):
        for node, params in nodes.items():
            with_grads(params, seed=0)
            for arm in ("loop", "fused"):
                runs.setdefault((node, arm), []).append(step_ms(params, arm, steps))
    rows: dict[str, Any] = {}
    for (node, arm), values in runs.items():
        rows[f"{node}_{arm}_ms"] = median(values)
        report.add_result(node=node, arm=arm, step_ms_median=median(values), reps=len(values))
    diff = max(max_abs_diff(part, steps) for part in (copy.deepcopy(front), body))
    report.add_result(max_abs_diff=diff, diff_steps=steps)
    for node in nodes:
        report.add_ratio(
            f"{node}_fused_over_loop", rows[f"{node}_fused_ms"] / rows[f"{node}_loop_ms"]
        )
    report.add_target("owner_fused_over_loop", report.ratios["owner_fused_over_loop"],
                      FUSED_OVER_LOOP_GOAL, "<=")  # fmt: skip
    report.add_target("max_abs_diff", diff, MAX_ABS_DIFF_GOAL, "<=")
    print(
        "; ".join(f"{node}: loop {rows[f'{node}_loop_ms']:.1f} ms, fused "
                  f"{rows[f'{node}_fused_ms']:.1f} ms" for node in nodes)
        + f"; max |diff| after {steps} steps {diff:.2e}",
        file=sys.stderr,
    )  # fmt: skip
    report.write(args.out)
    return report.exit_code(require_quiet=args.require_quiet)


if __name__ == "__main__":
    leave(tool_exit("bench_adamw", main))
