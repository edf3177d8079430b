"""The cost of releasing migrated blocks: the donor's release after a commit, with and without gc.

After a commit the donor frees the blocks (and KV) it gave away, off the token path
(`splitlab.infer.compute.PartCompute.release`): it drops their references, which frees a
decoder block by reference counting, runs `gc.collect` only when a dropped module outlived its
references, and empties the CUDA cache. A release that always runs `gc.collect` (the inference
seed's) pays for a walk over every tracked object of the process instead. This benchmark, in
one process, alternating every repetition:

- `release`: a donor stage (blocks 1..L-1 with a prefilled KV cache) commits away its first n
  blocks and releases them: the time, and whether every dropped block was freed (weakrefs);
- `release_gc`: the same, then a full `gc.collect` (the seed's release);
- `gc_heap`: `gc.collect` alone with the model loaded, and with the heap's tracked objects
  doubled by ballast: does its cost follow the heap rather than what was dropped?

    python tools/bench_release.py --quick --out /tmp/bench_release.json
    python tools/bench_release.py model=tiny_llama --quick          # Hydra overrides
    python tools/bench_release.py --reps 7 --out outputs/bench_release.json
"""

from __future__ import annotations

import gc
import sys
import time
import weakref
from typing import Any

import torch

from splitlab.configure import compose_config
from splitlab.errors import tool_exit
from splitlab.infer.compute import PartCompute
from splitlab.measure.calibrate import model_checkpoint
from splitlab.models.plan import Span
from splitlab.models.shard import load_part
from splitlab.telemetry.bench import BenchReport, bench_arg_parser, median, thread_policy
from splitlab.telemetry.log import leave

RELEASE_GOAL_MS = 5.0  # a release shares cores with a neighbour's token path


def drop_counts(num_donor_blocks: int) -> list[int]:
    """n = 1, 2, 4, ... blocks given away, leaving the donor at least one."""
    out, n = [], 1
    while n < num_donor_blocks:
        out.append(n)
        n *= 2
    return out


def donor(index, *, dtype: str, context: int, device: str) -> PartCompute:  # noqa: ANN001
    """Blocks 1..L-1 of the checkpoint, their KV cache filled with `context` tokens."""
    part, _ = load_part(index, Span(1, index.config.num_hidden_layers), dtype=dtype)
    stage = PartCompute(part, device=device)
    dtype_t = next(part.parameters()).dtype
    stage.forward(torch.randn(1, context, index.config.hidden_size).to(dtype_t), 0)
    return stage


def release_once(index, n: int, *, with_gc: bool, dtype: str, context: int,  # noqa: ANN001
                 device: str) -> dict[str, Any]:  # fmt: skip
    """Commit away the donor's first `n` blocks and time their release (plus gc.collect)."""
    stage = donor(index, dtype=dtype, context=context, device=device)
    start, stop = stage.span.start, stage.span.stop
    watch = [weakref.ref(stage.take_block(i)[0]) for i in range(start, start + n)]
    stage.commit(start + n, stop)
    t0 = time.perf_counter()
    reported_ms = stage.release()
    if with_gc:
        gc.collect()
    ms = (time.perf_counter() - t0) * 1e3
    freed = sum(ref() is None for ref in watch)
    del stage
    return {"ms": ms, "release_ms": reported_ms, "freed": freed, "dropped": n}


def gc_ms(ballast: int) -> tuple[float, int]:
    """One full gc.collect with `ballast` extra tracked objects alive; (ms, tracked objects)."""
    extra = [[] for _ in range(ballast)]
    tracked = len(gc.get_objects())
    t0 = time.perf_counter()
    gc.collect()
    ms = (time.perf_counter() - t0) * 1e3
    del extra
    return ms, tracked


def main(argv: list[str] | None = None) -> int:
    p = bench_arg_parser(__doc__.split("\n")[0])
    p.add_argument("overrides", nargs="*", help="Hydra overrides (model=..., model.dtype=...)")
    p.add_argument("--reps", type=int, default=5, help="alternating repetitions per arm")
    p.add_argument("--context", type=int, default=128, help="tokens of KV per dropped block")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    reps = 3 if args.quick else args.reps
    torch.set_num_threads(args.threads)
    cfg = compose_config(["task=calibrate", "model=smollm2_135m", *args.overrides])
    index = model_checkpoint(cfg.model, tag="bench_release")
    dtype = cfg.model.dtype.value
    counts = drop_counts(index.config.num_hidden_layers - 1)
    if not counts:
        raise SystemExit(f"bench_release: {cfg.model.name} has too few blocks to give one away")
    report = BenchReport(bench="release", config={
        "model": cfg.model.name, "dtype": dtype, "device": args.device, "reps": reps,
        "context": args.context, "threads": args.threads, "dropped_blocks": counts,
        "donor_blocks": [1, index.config.num_hidden_layers],
    })  # fmt: skip
    for arm in ("release", "release_gc", "gc_heap"):
        report.add_arm(arm, thread_policy(torch_threads=torch.get_num_threads()))
    kw = {"dtype": dtype, "context": args.context, "device": args.device}
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {}
    heap: dict[str, list[tuple[float, int]]] = {"1x": [], "2x": []}
    for _ in range(reps):
        for n in counts:
            for arm in ("release", "release_gc"):
                runs.setdefault((arm, n), []).append(
                    release_once(index, n, with_gc=arm == "release_gc", **kw)
                )
        stage = donor(index, **kw)  # the model resident while gc walks the heap
        base = len(gc.get_objects())
        heap["1x"].append(gc_ms(0))
        heap["2x"].append(gc_ms(base))
        del stage
    for (arm, n), rows in runs.items():
        report.add_result(arm=arm, dropped=n, ms_median=median([r["ms"] for r in rows]),
                          freed_min=min(r["freed"] for r in rows), reps=len(rows))  # fmt: skip
    for size, rows in heap.items():
        report.add_result(arm="gc_heap", heap=size, ms_median=median([ms for ms, _ in rows]),
                          tracked_objects=int(median([t for _, t in rows])))  # fmt: skip
    release_ms = median([r["ms"] for (arm, _), rows in runs.items() if arm == "release"
                         for r in rows])  # fmt: skip
    gc_release_ms = median([r["ms"] for (arm, _), rows in runs.items() if arm == "release_gc"
                            for r in rows])  # fmt: skip
    gc1, gc2 = (median([ms for ms, _ in heap[k]]) for k in ("1x", "2x"))
    objects1, objects2 = (median([t for _, t in heap[k]]) for k in ("1x", "2x"))
    freed = min(r["freed"] / r["dropped"] for rows in runs.values() for r in rows)
    report.add_result(release_median_ms=release_ms, release_gc_median_ms=gc_release_ms,
                      gc_1x_ms=gc1, gc_2x_ms=gc2, freed_fraction_min=freed)  # fmt: skip
    if release_ms > 0:
        report.add_ratio("release_gc_over_release", gc_release_ms / release_ms)
    if gc1 > 0:
        report.add_ratio("gc_2x_heap_over_1x", gc2 / gc1)
        report.add_ratio("tracked_objects_2x_over_1x", objects2 / objects1)
    report.add_target("release_median_ms", release_ms, RELEASE_GOAL_MS, "<=")
    report.add_target("dropped_blocks_freed_fraction", freed, 1.0, ">=")
    print(f"release {release_ms:.3f} ms, with gc.collect {gc_release_ms:.1f} ms; gc.collect "
          f"{gc1:.1f} ms at {objects1:.0f} tracked objects, {gc2:.1f} ms at {objects2:.0f}; "
          f"freed {freed:.0%} of dropped blocks", file=sys.stderr)  # fmt: skip
    report.write(args.out)
    return report.exit_code(require_quiet=args.require_quiet)


if __name__ == "__main__":
    leave(tool_exit("bench_release", main))
