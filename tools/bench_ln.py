"""L_n, the cost of loading n blocks from the checkpoint: cold vs warm page cache, idle vs loaded.

A migration's weight term: the receiver reads the blocks it takes over from its own copy of
the checkpoint (`splitlab.models.shard.load_blocks`). This times `load_blocks` of layers
0..n-1 for several n, in one process, alternating every repetition between

- cold: the checkpoint's pages dropped first (`posix_fadvise(DONTNEED)`; `mincore` checks
  what really stayed resident: a cold figure is only reported as cold when no page was), and
- warm: the same read straight after, the pages resident (a memory copy, not a disk read),

each idle and beside a co-running busy process (paused with SIGSTOP while the idle arm runs,
so both arms share one process tree). Each arm's L_n = fixed_ms + per_block_ms * n is fitted
(`splitlab.analysis.fits.fit_load`: more distinct n than its two parameters, or no fit); the
ratios say how much a cold read and a co-runner cost per block. If a loaded host changes L_n,
a cost model's weight term needs a drift factor of its own. There is no physical floor on
cold over warm here: on a small model a block's time is its construction, not its bytes.

    python tools/bench_ln.py --quick --out /tmp/bench_ln.json
    python tools/bench_ln.py model=tiny_llama --quick          # Hydra overrides pick the model
    python tools/bench_ln.py --reps 9 --out outputs/bench_ln.json
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from splitlab.analysis.fits import Fit, fit_load
from splitlab.configure import compose_config
from splitlab.errors import tool_exit
from splitlab.measure import probes
from splitlab.measure.calibrate import model_checkpoint
from splitlab.models.shard import load_blocks
from splitlab.telemetry.bench import BenchReport, bench_arg_parser, thread_policy
from splitlab.telemetry.log import leave

ARMS = ("cold_idle", "warm_idle", "cold_loaded", "warm_loaded")
R2_GOAL = 0.9


def block_bytes(index, dtype: str) -> int:  # noqa: ANN001 - CheckpointIndex
    """Bytes of one loaded block (layers.0) in the loaded dtype."""
    (block,) = load_blocks(index, [0], dtype=dtype).values()
    return sum(t.numel() * t.element_size() for t in block.state_dict().values())


def arm_record(name: str, points: list[tuple[float, float]], cache: str | None,
               bytes_per_block: int) -> dict[str, Any]:  # fmt: skip
    fit = fit_load(*zip(*points, strict=True))
    row: dict[str, Any] = {"arm": name, "points": [list(p) for p in points], "cache": cache}
    if isinstance(fit, Fit):
        per_block = fit.params["per_block_ms"]
        mb_per_s = bytes_per_block / per_block / 1e3 if per_block > 0 else None
        row.update(fit.params, r2=fit.r2, n=fit.n, warnings=list(fit.warnings), mb_per_s=mb_per_s)
    else:
        row.update(fixed_ms=None, per_block_ms=None, r2=None, n=fit.n, warnings=[fit.reason])
    return row


def main(argv: list[str] | None = None) -> int:
    p = bench_arg_parser(__doc__.split("\n")[0])
    p.add_argument("overrides", nargs="*", help="Hydra overrides (model=..., model.dtype=...)")
    p.add_argument("--reps", type=int, default=7, help="alternating repetitions per arm")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = p.parse_args(argv)
    reps = 3 if args.quick else args.reps
    torch.set_num_threads(args.threads)
    cfg = compose_config(["task=calibrate", "model=smollm2_135m", *args.overrides])
    index = model_checkpoint(cfg.model, tag="bench_ln")
    files = sorted(set(index.key_files.values()))
    counts = probes.load_counts(index.config.num_hidden_layers)
    dtype = cfg.model.dtype.value
    nbytes = block_bytes(index, dtype)
    report = BenchReport(bench="ln", config={
        "model": cfg.model.name, "dtype": dtype, "counts": list(counts), "reps": reps,
        "threads": args.threads, "bytes_per_block": nbytes, "corunner": probes.CORUNNER_WHAT,
        "what": "load_blocks of layers 0..n-1 from the checkpoint",
    })  # fmt: skip
    for arm in ARMS:
        report.add_arm(arm, thread_policy(torch_threads=torch.get_num_threads()))

    def load(n: int) -> None:
        load_blocks(index, range(n), dtype=dtype)

    samples: dict[str, dict[float, list[float]]] = {arm: {} for arm in ARMS}
    caches: dict[str, list[str]] = {"idle": [], "loaded": []}
    with probes.corunner(max_s=3600) as proc:
        if proc is None:
            raise SystemExit("bench_ln: the co-runner did not start")
        for _ in range(reps):
            for load_state in ("idle", "loaded"):
                (probes.pause if load_state == "idle" else probes.resume)(proc)
                timed = probes.time_load_n(load, counts, files, repeats=1)
                caches[load_state].append(timed["cache"])
                for cache in ("cold", "warm"):
                    for n, ms in timed[cache]:
                        samples[f"{cache}_{load_state}"].setdefault(n, []).append(ms)
    rows = {}
    for arm in ARMS:
        cache, load_state = arm.split("_")
        points = [(n, min(ms)) for n, ms in samples[arm].items()]  # fastest: noise only adds
        met = None
        if cache == "cold":
            met = "cold" if set(caches[load_state]) == {"cold"} else "not cold"
        rows[arm] = arm_record(arm, points, met or "warm", nbytes)
        report.add_result(**rows[arm])
        print(f"{arm}: fixed {rows[arm]['fixed_ms']} ms, per block {rows[arm]['per_block_ms']} ms,"
              f" r2 {rows[arm]['r2']}, cache {rows[arm]['cache']}", file=sys.stderr)  # fmt: skip

    def per_block(arm: str) -> float | None:
        return rows[arm]["per_block_ms"]

    pairs = {"cold_over_warm_per_block": ("cold_idle", "warm_idle"),
             "loaded_over_idle_warm_per_block": ("warm_loaded", "warm_idle"),
             "loaded_over_idle_cold_per_block": ("cold_loaded", "cold_idle")}  # fmt: skip
    for name, (a, b) in pairs.items():
        if (per_block(a) or 0) > 0 and (per_block(b) or 0) > 0:  # unphysical fits: no ratio
            report.add_ratio(name, per_block(a) / per_block(b))
    for arm in ("cold_idle", "warm_idle"):  # the fits a planner's L_n term would read
        if rows[arm]["r2"] is not None:
            report.add_target(f"{arm}_r2", rows[arm]["r2"], R2_GOAL, ">=")
    report.write(args.out)
    return report.exit_code(require_quiet=args.require_quiet)


if __name__ == "__main__":
    leave(tool_exit("bench_ln", main))
