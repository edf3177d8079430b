"""SFT rank study: MiniLM on Rotten Tomatoes, U-shape over loopback TCP, baseline vs low-rank cuts.

The grid in one process, over seeds then arms (`splitlab.sft.study` trains one arm and writes
the tables; `splitlab -m task=sft_rank task.arm=... task.seed=0,1,2` runs the same arms one per
Hydra job, locally or on Slurm, into the same kind of folder). Every run of a seed starts from
the same weights (MiniLM + one random classifier head drawn from the seed), sees the same
microbatches in the same order and takes the same AdamW steps (full fine-tuning, one step per
microbatch, peak lr 1e-4 for every tensor, 6% linear warm-up then linear decay). Grid: the
baseline and R x depth {lower: the front -> body cut after block 1, upper: the body -> tail cut
after block 4, of blocks 0..5} x residual {keep, drop}; `--factors two,three` runs every
low-rank arm in both SVD forms (`finetune.sft.factors`; three-factor arms are `.../3f`).

Budgets (`--budget`): `real` (the default: Rotten Tomatoes' 8,530 training examples x 3 epochs,
1,066 held out, R in {1, 8, 16, 32}, seeds 0-2: 51 runs of 1,600 steps, ~12 min a run on
2 quiet cores), `short` (1,024 examples x 1 epoch, 512 held out, R in {1, 8, 32}, seed 0),
`quick` (the test). `--arms`, `--ranks`, `--seeds`, `--epochs` narrow or change the grid (the
baseline always runs). A run already in OUT/arms is not run again: rerun the same command to
resume an interrupted study.

Writes OUT/arms/*.json, OUT/sft_rank.csv (per arm, mean and spread over seeds),
sft_rank_runs.csv, sft_rank_curves.csv, sft_rank.md (all rewritten after every run),
sft_rank.png and sft_rank_curves.png; `splitlab task=analyze task.run_dir=OUT` draws both
figures into report.html.

    .venv/bin/python experiments/sft_rank/run.py --out outputs/sft_rank        # the real budget
    .venv/bin/python experiments/sft_rank/run.py --budget short --out /tmp/sft_short  # ~10 min
    .venv/bin/python experiments/sft_rank/run.py --quick --out /tmp/sft_quick  # ~1 min
    .venv/bin/python experiments/sft_rank/run.py --out /tmp/sft_3f --arms upper/drop \
        --ranks 8 --factors two,three --seeds 0
"""

from __future__ import annotations

import os

# Owner and worker share 2 cores; spinning OpenMP threads starve the other one (as in the ring).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import logging
from dataclasses import replace
from pathlib import Path

from splitlab.analysis.plots import plot_sft_curves, plot_sft_rank
from splitlab.config.enums import (
    DataDistribution,
    DataSource,
    DType,
    ModelSource,
    ResidualMode,
    SftFactors,
    TaskKind,
)
from splitlab.config.schema import DataConfig, ModelConfig
from splitlab.sft.study import (
    CURVES,
    DEPTHS,
    Study,
    claim,
    collect,
    finished,
    grid,
    load_inputs,
    run_arm,
)

LOG = logging.getLogger("sft_rank")
NUM_LAYERS, HIDDEN = 6, 384
# budget -> (the study, ranks, seeds)
BUDGETS = {
    "real": (Study(), (1, 8, 16, 32), (0, 1, 2)),
    "short": (Study(samples=1024, val_samples=512, epochs=1, eval_every=16), (1, 8, 32), (0,)),
    "quick": (Study(samples=64, val_samples=32, epochs=1, eval_every=2), (8,), (0,)),
}
MODEL = ModelConfig(
    name="minilm", family="bert", source=ModelSource.packaged, id="minilm",
    num_layers=NUM_LAYERS, hidden_size=HIDDEN, num_labels=2, dtype=DType.fp32,
)  # fmt: skip
DATA = DataConfig(
    name="rotten_tomatoes", source=DataSource.packaged, task=TaskKind.classification,
    labels=["rotten", "fresh"], max_length=64, distribution=DataDistribution.iid,
)  # fmt: skip


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="study folder (resumable)")
    parser.add_argument("--budget", choices=sorted(BUDGETS), default="real")
    parser.add_argument("--quick", action="store_true", help="--budget quick (the test)")
    parser.add_argument("--factors", default="two", help="SVD forms, comma-separated: two,three")
    parser.add_argument("--arms", default="", help="depth/residual arms, e.g. upper/drop (all)")
    parser.add_argument("--ranks", default="", help="ranks, comma-separated (the budget's)")
    parser.add_argument("--seeds", default="", help="seeds, comma-separated (the budget's)")
    parser.add_argument("--epochs", type=int, default=0, help="passes over the data (the budget's)")
    parser.add_argument(
        "--factor-lr", type=float, default=None, help="low-rank factors' peak lr (0: frozen)"
    )
    parser.add_argument(
        "--lr",
        type=float,
        default=None,
        help="pre-trained weights' peak lr (0: frozen; only factors + head train)",
    )
    parser.add_argument(
        "--no-baseline",
        action="store_true",
        help="low-rank arms only (an ablation beside a folder that has one)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[sft_rank] %(message)s")
    study, ranks, seeds = BUDGETS["quick" if args.quick else args.budget]
    try:
        factors = tuple(SftFactors(f) for f in args.factors.split(","))
    except ValueError:
        parser.error(f"--factors={args.factors}: each must be one of two, three")
    arms = tuple(a for a in args.arms.split(",") if a)
    known = [f"{d}/{r.value}" for d in DEPTHS for r in ResidualMode]
    if bad := [a for a in arms if a not in known]:
        parser.error(f"--arms: {bad} not among {known}")
    ranks = _ints(args.ranks) or ranks
    seeds = _ints(args.seeds) or seeds
    if args.epochs:
        study = replace(study, epochs=args.epochs)
    if args.factor_lr is not None:
        study = replace(study, factor_lr=args.factor_lr)
    if args.lr is not None:
        study = replace(study, lr=args.lr)
    study.check()
    claim(args.out, study)
    plan = grid(ranks, factors=factors, arms=arms)[1 if args.no_baseline else 0 :]
    LOG.info("%d runs (%d arms x %d seeds) into %s", len(plan) * len(seeds), len(plan),
             len(seeds), args.out)  # fmt: skip
    for seed in seeds:
        todo = [arm for arm in plan if finished(args.out, arm, seed, study) is None]
        if len(todo) < len(plan):
            LOG.info("seed %d: %d of %d runs finished before", seed, len(plan) - len(todo),
                     len(plan))  # fmt: skip
        inputs = load_inputs(MODEL, DATA, study, seed) if todo else None
        for arm in todo:
            record = run_arm(args.out, arm, inputs, study)
            LOG.info("%s seed %d: accuracy %.4f, %.0f B/step at the cut, %.0f s", arm.name,
                     seed, record["accuracy"], record["bytes_per_step_studied_cut"],
                     record["train_s"])  # fmt: skip
            collect(args.out)
    table = collect(args.out)
    plot_sft_rank(table).savefig(args.out / "sft_rank.png")
    import pandas as pd

    plot_sft_curves(pd.read_csv(args.out / CURVES)).savefig(args.out / "sft_rank_curves.png")
    LOG.info("wrote %s", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
