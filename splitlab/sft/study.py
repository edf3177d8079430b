"""The low-rank cut study: one arm trained at one seed, resumable, and the table and learning
curves of every finished arm in a study folder.

An arm is `baseline` (no low-rank cut) or `DEPTH/RESIDUAL/R`, with `/3f` for the three-factor
form (`finetune.sft.factors=three`): `upper/drop/8`, `lower/keep/1/3f`. DEPTH `lower` is the
front -> body cut (after block 1), `upper` the body -> tail cut (before the last block); both
cuts exist in every run (U-shape: front = blocks 0-1, tail = the last block + head), only the
studied one is compressed. Owner and worker run their real schedulers in two threads over
loopback TCP (`splitlab.train.loopback`), one AdamW step per microbatch, full fine-tuning with
a linear warm-up then a linear decay to 0; the held-out set is evaluated every `eval_every`
steps (the learning curve) and at the end. The bytes per step at each cut are the owner's
transport frame counters.

A study folder holds:
    study.json                the budget (a folder holds one: another is refused, naming the key)
    arms/<arm>-s<seed>.json   one finished run (its row, its curve and the budget it ran at)
    sft_rank.csv              one row per arm: accuracy mean and spread over its seeds
    sft_rank_runs.csv         one row per arm and seed
    sft_rank_curves.csv       held-out accuracy against step, per arm and seed
    sft_rank.md               the table
A run whose file exists is not run again (an interrupted study resumes at the arms it had not
finished). Every table
is rewritten (atomically) after each run, so jobs of a Hydra multirun or a Slurm array can share
one folder. Drivers: `experiments/sft_rank/run.py` (the grid in one process) and
`splitlab task=sft_rank task.arm=ARM task.seed=S` (one arm per job).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import math
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from splitlab.config.enums import DataDistribution, ResidualMode, SftCut, SftFactors
from splitlab.config.schema import DataConfig, ModelConfig, SftConfig
from splitlab.errors import ConfigError

log = logging.getLogger(__name__)

DEPTHS = {"lower": SftCut.front, "upper": SftCut.tail}  # cut after block 1, before the last
CUT_BYTES = {  # owner-side counters of each cut: what it sends forward + the gradient back
    SftCut.front: ("activation.bytes_sent", "gradient.bytes_recv"),
    SftCut.tail: ("activation.bytes_recv", "gradient.bytes_sent"),
}
THREE = "3f"
BASELINE = "baseline"
TABLE, RUNS, CURVES = "sft_rank.csv", "sft_rank_runs.csv", "sft_rank_curves.csv"
BUDGET = "study.json"


@dataclass(frozen=True)
class Study:
    """The budget every arm of a study trains at (a finished run records it)."""

    samples: int = 8530  # training examples (Rotten Tomatoes' train split is 8,530)
    val_samples: int = 1066  # held-out examples (its validation split is 1,066)
    epochs: int = 3
    batch_size: int = 16
    lr: float = 1e-4  # peak rate of the pre-trained weights (full fine-tuning; 0 = frozen)
    head_lr: float = 1e-4  # the classifier (new in every run)
    factor_lr: float = 1e-4  # the low-rank factors, and sigma in the three-factor form (0 = frozen)
    warmup: float = 0.06  # fraction of the steps with a linear warm-up; then linear decay to 0
    eval_every: int = 100  # steps between held-out evaluations (the learning curve)
    data_seed: int = 1  # which examples are train and held-out (the same for every seed)

    def check(self) -> None:
        for key in ("samples", "val_samples", "epochs", "batch_size", "eval_every"):
            if getattr(self, key) < 1:
                raise ConfigError(f"task.{key}={getattr(self, key)} must be >= 1")
        if not self.head_lr > 0:
            raise ConfigError(f"task.head_lr={self.head_lr} must be > 0")
        for key in ("lr", "factor_lr"):  # 0 freezes those tensors (an ablation)
            if not getattr(self, key) >= 0:
                raise ConfigError(f"task.{key}={getattr(self, key)} must be >= 0 (0: frozen)")
        if not 0 <= self.warmup < 1:
            raise ConfigError(f"task.warmup={self.warmup} must be in [0, 1)")


@dataclass(frozen=True)
class Arm:
    """`baseline`, or a low-rank cut at `depth` with the residual kept or dropped."""

    depth: str | None = None  # lower | upper; None = the baseline
    residual: ResidualMode = ResidualMode.keep
    rank: int = 0
    factors: SftFactors = SftFactors.two

    @classmethod
    def parse(cls, text: str) -> Arm:
        """`baseline` or `DEPTH/RESIDUAL/R[/3f]`; ConfigError naming `task.arm` otherwise."""
        if text == BASELINE:
            return cls()
        parts = text.split("/")
        form = SftFactors.three if parts[-1] == THREE else SftFactors.two
        if form is SftFactors.three:
            parts = parts[:-1]
        residuals = [r.value for r in ResidualMode]
        ok = (
            len(parts) == 3
            and parts[0] in DEPTHS
            and parts[1] in residuals
            and parts[2].isdigit()
            and int(parts[2]) >= 1
        )
        if not ok:
            raise ConfigError(
                f"task.arm={text!r}: expected {BASELINE} or DEPTH/RESIDUAL/R[/{THREE}] with DEPTH "
                f"in {sorted(DEPTHS)}, RESIDUAL in {residuals} and R >= 1 (e.g. upper/drop/8)"
            )
        return cls(parts[0], ResidualMode(parts[1]), int(parts[2]), form)

    @property
    def is_baseline(self) -> bool:
        return self.depth is None

    @property
    def label(self) -> str:
        """The arm without its rank: a line of the figure (`upper/drop`, `upper/drop/3f`)."""
        return self._spell(with_rank=False)

    @property
    def name(self) -> str:
        return self._spell(with_rank=True)

    def _spell(self, *, with_rank: bool) -> str:
        if self.is_baseline:
            return BASELINE
        parts = [self.depth, self.residual.value, *([str(self.rank)] if with_rank else [])]
        return "/".join(parts + ([THREE] if self.factors is SftFactors.three else []))

    def sft(self) -> SftConfig:
        if self.is_baseline:
            return SftConfig(enabled=False)
        return SftConfig(enabled=True, rank=self.rank, residual=self.residual,
                         cuts=DEPTHS[self.depth], factors=self.factors)  # fmt: skip

    def check(self, hidden: int) -> None:
        if not self.is_baseline and self.rank > hidden:
            raise ConfigError(f"task.arm={self.name!r}: R={self.rank} exceeds the hidden {hidden}")


def grid(
    ranks: Sequence[int],
    *,
    factors: Sequence[SftFactors] = (SftFactors.two,),
    arms: Sequence[str] = (),
) -> list[Arm]:
    """The baseline, then every depth x residual x rank x form whose `DEPTH/RESIDUAL` is in
    `arms` (all when empty)."""
    out = [Arm()]
    for depth in DEPTHS:
        for residual in ResidualMode:
            if arms and f"{depth}/{residual.value}" not in arms:
                continue
            out += [Arm(depth, residual, rank, form) for rank in ranks for form in factors]
    return out


def lr_factor(step: int, total: int, warmup_steps: int) -> float:
    """The multiplier of every peak rate at optimizer step `step` (0-based) of `total`: linear
    from 1/warmup_steps to 1 over the warm-up, then linear down to 0 after the last step."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    return max(0.0, (total - step) / max(1, total - warmup_steps))


def run_file(folder: Path, arm: Arm, seed: int) -> Path:
    return folder / "arms" / f"{arm.name.replace('/', '-')}-s{seed}.json"


def finished(folder: Path, arm: Arm, seed: int, study: Study) -> dict | None:
    """The run's record when it has finished at this budget; ConfigError when it ran at
    another (a study folder holds one budget)."""
    path = run_file(folder, arm, seed)
    if not path.is_file():
        return None
    record = json.loads(path.read_text(encoding="utf-8"))
    ran = record.get("study", {})
    for key, value in dataclasses.asdict(study).items():
        if ran.get(key) != value:
            raise ConfigError(
                f"{path}: this run was trained with {key}={ran.get(key)!r}, the study asks "
                f"{key}={value!r}; use another study folder (task.out) or remove the file"
            )
    return record


def claim(folder: Path, study: Study) -> None:
    """Make `folder` a study folder at this budget: write its `study.json`, or check the one
    there (ConfigError naming the first key that differs: a folder holds one budget)."""
    path = folder / BUDGET
    wanted = dataclasses.asdict(study)
    if path.is_file():
        held = json.loads(path.read_text(encoding="utf-8"))
        for key, value in wanted.items():
            if held.get(key) != value:
                raise ConfigError(
                    f"{folder} is a study at {key}={held.get(key)!r}, this run asks "
                    f"{key}={value!r}; use another study folder (task.out / --out)"
                )
        return
    folder.mkdir(parents=True, exist_ok=True)
    _write_atomic(path, json.dumps(wanted, indent=1))


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


# --- training -------------------------------------------------------------------------------


@dataclass
class Inputs:
    """What every arm of one seed starts from: the model (its classifier drawn from the seed),
    the training microbatches in the seed's order and the held-out batches."""

    base: Any
    train: list
    val: list
    hidden: int
    num_layers: int
    seed: int


def load_inputs(model_cfg: ModelConfig, data_cfg: DataConfig, study: Study, seed: int) -> Inputs:
    import torch

    from splitlab.data.owners import build_owner_datasets
    from splitlab.models.load import load_model

    data_cfg = dataclasses.replace(
        data_cfg, samples_per_owner=study.samples, val_samples=study.val_samples,
        test_samples=0, seed=study.data_seed, distribution=DataDistribution.iid,
    )  # fmt: skip
    torch.manual_seed(seed)
    base, tokenizer = load_model(model_cfg)
    (shard,), val_shard = build_owner_datasets(data_cfg, tokenizer, num_owners=1)
    train = [
        batch
        for epoch in range(study.epochs)
        for batch in shard.batches(study.batch_size, seed=1000 * seed + epoch)
    ]
    val = list(val_shard.batches(64, seed=0, bucket=False))
    return Inputs(base, train, val, base.config.hidden_size, base.config.num_hidden_layers, seed)


def _param_groups(study: Study, *parts: Any) -> list[dict]:
    """AdamW groups: the classifier at `head_lr`, the low-rank factors at `factor_lr`, the rest
    at `lr` (each trainable tensor once); a tensor whose rate is 0 is frozen (no gradient)."""
    from splitlab.models.parts import LOWRANK_IN, LOWRANK_OUT
    from splitlab.train.nodes import partition_parameters

    rates: dict[int, float] = {}
    for part in parts:
        for name, param in part.named_parameters():
            if name.startswith("classifier."):
                rates[id(param)] = study.head_lr
            elif f".{LOWRANK_IN}." in name or f".{LOWRANK_OUT}." in name:
                rates[id(param)] = study.factor_lr
    groups: dict[float, list] = {}
    for param in partition_parameters(*parts):
        rate = rates.get(id(param), study.lr)
        if rate == 0:
            param.requires_grad_(False)
        else:
            groups.setdefault(rate, []).append(param)
    return [{"params": params, "lr": lr} for lr, params in groups.items()]


def train_arm(arm: Arm, inputs: Inputs, study: Study) -> dict:
    """Train one arm from `inputs`; its row (accuracy, losses, bytes per step) and curve."""
    import torch

    from splitlab.models.plan import u_shape_plan
    from splitlab.train.loopback import run_loopback
    from splitlab.train.nodes import OwnerNode, WorkerNode
    from splitlab.train.optim import adamw as build_adamw
    from splitlab.train.owner import SchedulerSettings
    from splitlab.train.parts import build_training_parts
    from splitlab.train.validate import evaluate, part_chain

    arm.check(inputs.hidden)
    torch.manual_seed(inputs.seed)
    plan = u_shape_plan(num_layers=inputs.num_layers, cut_layers=2, tail_blocks=1)
    parts = build_training_parts(copy.deepcopy(inputs.base), plan, sft=arm.sft())
    front, body, tail = parts
    total = len(inputs.train)
    warmup_steps = max(1, round(study.warmup * total))

    def adamw(*owned: torch.nn.Module) -> torch.optim.Optimizer:
        opt = build_adamw(_param_groups(study, *owned), weight_decay=0.01)
        schedule = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda step: lr_factor(step, total, warmup_steps)
        )
        opt.register_step_post_hook(lambda *_: schedule.step())
        return opt

    owner = OwnerNode("o0", front, tail, adamw(front, tail))
    worker = WorkerNode("w0", body, adamw(body))
    settings = SchedulerSettings(max_inflight=1, timeout_s=120.0)

    def held_out() -> Any:
        for part in parts:
            part.eval()
        metrics = evaluate(part_chain(parts), tail.adapter, inputs.val)
        for part in parts:
            part.train()
        return metrics

    for part in parts:
        part.train()
    losses: list[float] = []
    counters: dict[str, float] = {}
    first = held_out()
    curve = [{"step": 0, "accuracy": first.accuracy, "val_loss": first.loss, "train_loss": None}]
    train_s = 0.0
    for start in range(0, total, study.eval_every):
        chunk = inputs.train[start : start + study.eval_every]
        began = time.perf_counter()
        # one window per microbatch: one AdamW step each; the chunk's threads have joined
        # before the parts are evaluated
        result = run_loopback(owner, worker, [[b] for b in chunk], settings=settings)
        train_s += time.perf_counter() - began
        losses += result.losses
        for key in (k for keys in CUT_BYTES.values() for k in keys):
            counters[key] = counters.get(key, 0) + result.owner_counters[key]
        metrics = held_out()
        step = start + len(chunk)
        curve.append({"step": step, "accuracy": metrics.accuracy, "val_loss": metrics.loss,
                      "train_loss": sum(result.losses) / len(result.losses)})  # fmt: skip
        log.info("%s seed %d: step %d/%d, held-out accuracy %.4f, train loss %.3f, %.0f s",
                 arm.name, inputs.seed, step, total, metrics.accuracy, curve[-1]["train_loss"],
                 train_s)  # fmt: skip
    front_b, tail_b = (sum(counters[k] for k in CUT_BYTES[c]) / total for c in CUT_BYTES)
    last = curve[-1]
    return {
        "arm": arm.name,
        "label": arm.label,
        "depth": arm.depth or "-",
        "residual": arm.residual.value if not arm.is_baseline else "-",
        "rank": arm.rank if not arm.is_baseline else inputs.hidden,
        "factors": arm.factors.value if not arm.is_baseline else "-",
        "seed": inputs.seed,
        "accuracy": last["accuracy"],
        "val_loss": last["val_loss"],
        "best_accuracy": max(p["accuracy"] for p in curve),
        "final_train_loss": sum(losses[-8:]) / min(8, len(losses)),
        "bytes_per_step_front_cut": front_b,
        "bytes_per_step_tail_cut": tail_b,
        "bytes_per_step_studied_cut": (
            front_b if not arm.is_baseline and DEPTHS[arm.depth] is SftCut.front else tail_b
        ),
        "train_s": train_s,
        "steps": total,
        "curve": curve,
    }


def run_arm(folder: Path, arm: Arm, inputs: Inputs, study: Study) -> dict:
    """Train the arm and save its record (the drivers ask `finished` first: a run whose file
    exists is not trained again)."""
    record = train_arm(arm, inputs, study) | {"study": dataclasses.asdict(study)}
    path = run_file(folder, arm, inputs.seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_atomic(path, json.dumps(record, indent=1))
    return record


# --- the tables -------------------------------------------------------------------------------


def summarize(records: Iterable[dict]) -> tuple[Any, Any, Any]:
    """(per arm, per run, curves) tables of finished runs: per arm the mean and the sample
    standard deviation over its seeds (0 for one seed); arms in grid order, the baseline first."""
    import pandas as pd

    records = list(records)
    curves = pd.DataFrame(
        [
            {"arm": r["arm"], "label": r["label"], "rank": r["rank"], "seed": r["seed"], **p}
            for r in records
            for p in r["curve"]
        ]
    )
    runs = pd.DataFrame([{k: v for k, v in r.items() if k not in ("curve", "study")}
                         for r in records])  # fmt: skip
    if runs.empty:
        return runs, runs, curves
    order = {a.name: i for i, a in enumerate(_grid_order(runs["arm"]))}
    runs = runs.assign(_order=runs["arm"].map(order)).sort_values(["_order", "seed"])
    runs = runs.drop(columns="_order").reset_index(drop=True)
    keys = ["arm", "label", "depth", "residual", "rank", "factors"]
    stats = runs.groupby(keys, sort=False).agg(
        seeds=("seed", "count"),
        accuracy=("accuracy", "mean"),
        accuracy_std=("accuracy", "std"),
        accuracy_min=("accuracy", "min"),
        accuracy_max=("accuracy", "max"),
        best_accuracy=("best_accuracy", "mean"),
        final_train_loss=("final_train_loss", "mean"),
        bytes_per_step_studied_cut=("bytes_per_step_studied_cut", "mean"),
        bytes_per_step_front_cut=("bytes_per_step_front_cut", "mean"),
        bytes_per_step_tail_cut=("bytes_per_step_tail_cut", "mean"),
        steps=("steps", "max"),
        train_s=("train_s", "mean"),
    )
    table = stats.reset_index()
    table["accuracy_std"] = table["accuracy_std"].fillna(0.0)
    return table, runs, curves


def _grid_order(names: Iterable[str]) -> list[Arm]:
    arms = {Arm.parse(n) for n in names}
    depth = {d: i for i, d in enumerate(DEPTHS)}

    def key(a: Arm) -> tuple:
        if a.is_baseline:
            return (-1,)
        return (depth[a.depth], list(ResidualMode).index(a.residual), a.factors.value, a.rank)

    return sorted(arms, key=key)


def collect(folder: Path) -> Any:
    """Rewrite the study's tables from every finished run under `folder`/arms; the per-arm
    table (empty when nothing has finished)."""
    records = [json.loads(p.read_text(encoding="utf-8"))
               for p in sorted((folder / "arms").glob("*.json"))]  # fmt: skip
    table, runs, curves = summarize(records)
    if table.empty:
        return table
    _write_atomic(folder / TABLE, table.to_csv(index=False))
    _write_atomic(folder / RUNS, runs.to_csv(index=False))
    _write_atomic(folder / CURVES, curves.to_csv(index=False))
    _write_atomic(folder / "sft_rank.md", markdown(table, records[0]["study"]))
    return table


def markdown(table: Any, study: dict) -> str:
    """The per-arm table with the budget it ran at, deltas against the baseline."""
    base = table[table["arm"] == BASELINE]
    ref = base.iloc[0] if len(base) else None
    steps = int(table["steps"].max())
    lines = [
        f"{len(table)} arms, {steps} AdamW steps each ({study['samples']} examples x "
        f"{study['epochs']} epochs, batch {study['batch_size']}; peak lr {study['lr']:g} "
        f"pre-trained weights, {study['head_lr']:g} classifier, {study['factor_lr']:g} low-rank "
        f"factors; {study['warmup']:.0%} linear warm-up, then linear decay to 0); accuracy on "
        f"{study['val_samples']} held-out examples after the last step, mean +- sample std "
        "over the seeds; train loss = mean of the last 8 steps.",
        "",
        "| arm | R | seeds | accuracy | delta vs baseline (points) | best on the curve | "
        "train loss | bytes/step at the cut | ratio | train s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for _, row in table.iterrows():
        delta = ratio = math.nan
        if ref is not None:
            delta = 100 * (row["accuracy"] - ref["accuracy"])
            cut = "front" if row["depth"] == "lower" else "tail"
            ratio = ref[f"bytes_per_step_{cut}_cut"] / row["bytes_per_step_studied_cut"]
        lines.append(
            f"| {row['arm']} | {row['rank']} | {row['seeds']} | {row['accuracy']:.4f} +- "
            f"{row['accuracy_std']:.4f} | {_or_dash(delta, '{:+.1f}')} | "
            f"{row['best_accuracy']:.4f} | {row['final_train_loss']:.3f} | "
            f"{row['bytes_per_step_studied_cut']:,.0f} | {_or_dash(ratio, '{:.1f}x')} | "
            f"{row['train_s']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def _or_dash(value: float, fmt: str) -> str:
    return "-" if math.isnan(value) else fmt.format(value)


# --- `splitlab task=sft_rank` -----------------------------------------------------------------


def study_of(task: Any) -> Study:
    """The budget in a `task=sft_rank` config."""
    fields = {f.name for f in dataclasses.fields(Study)}
    return Study(**{k: v for k, v in dataclasses.asdict(task).items() if k in fields})


def run_sft_rank(cfg: Any) -> int:
    """One arm at `task.seed` into the study folder `task.out`, then the folder's tables."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # owner and worker share the cores
    task = cfg.task
    study = study_of(task)
    study.check()
    arm = Arm.parse(task.arm)
    folder = Path(task.out)
    claim(folder, study)
    if finished(folder, arm, task.seed, study) is None:
        inputs = load_inputs(cfg.model, cfg.data, study, task.seed)
        record = run_arm(folder, arm, inputs, study)
        log.info("%s seed %d: accuracy %.4f after %d steps, %.0f s", arm.name, task.seed,
                 record["accuracy"], record["steps"], record["train_s"])  # fmt: skip
    else:
        log.info("%s seed %d: finished before; tables only", arm.name, task.seed)
    collect(folder)
    log.info("study tables in %s (splitlab task=analyze task.run_dir=%s)", folder, folder)
    return 0
