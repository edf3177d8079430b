"""A fine-tuning run's final evaluation: the last merged checkpoint, unsplit, in this process,
on examples nobody trained or validated on.

`checkpoint_model` builds the architecture a checkpoint of the config holds (the FFNs at
`finetune.sft`'s low-rank cuts stay decomposed: a checkpoint of an SFT run keeps the trained
factors, not a product folded back), so `model.load_state_dict(checkpoint.state, strict=True)`
works; `evaluate_checkpoint` runs it through the same parts and metrics the owners validate with.

    .venv/bin/pytest tests/integration/test_finetune_task.py -q -k final
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from splitlab.config.schema import Config, TwoStageConfig
from splitlab.data.owners import build_owner_datasets, build_test_shard
from splitlab.models.load import load_model
from splitlab.models.lowrank import decompose_plan
from splitlab.models.parts import build_parts
from splitlab.models.plan import PartitionPlan, two_stage_plan, u_shape_plan
from splitlab.telemetry.progress import track
from splitlab.telemetry.records import round_number
from splitlab.train.checkpoint import latest_checkpoint
from splitlab.train.parts import sft_plan
from splitlab.train.validate import evaluate, part_chain


def partition_plan(cfg: Config) -> PartitionPlan:
    """The plan `cfg.architecture` cuts the model with (u_shape or two_stage)."""
    arch, layers = cfg.architecture, cfg.model.num_layers
    if isinstance(arch, TwoStageConfig):
        return two_stage_plan(num_layers=layers, cut_layers=arch.cut_layers)
    return u_shape_plan(num_layers=layers, cut_layers=arch.cut_layers, tail_blocks=arch.tail_blocks)


def checkpoint_model(cfg: Config) -> tuple[Any, Any]:
    """(model, tokenizer) with the architecture a checkpoint of this config holds."""
    torch.manual_seed(cfg.task.seed)
    model, tokenizer = load_model(cfg.model)
    if cfg.finetune.sft.enabled:
        decompose_plan(model, sft_plan(partition_plan(cfg), cfg.finetune.sft))
    return model, tokenizer


def evaluate_checkpoint(cfg: Config, checkpoint_dir: Path) -> dict[str, Any] | None:
    """The last merged checkpoint in `checkpoint_dir` on `data.test_samples` held-out examples
    (or, when that is 0, on the per-round held-out split); None when there is no checkpoint.
    `round` is the checkpoint's round as the logs count it (1..N)."""
    checkpoint = latest_checkpoint(checkpoint_dir)
    if checkpoint is None:
        return None
    model, tokenizer = checkpoint_model(cfg)
    model.load_state_dict(checkpoint.state, strict=True)
    parts = build_parts(model, partition_plan(cfg))  # the decomposed FFNs run inside their blocks
    held = build_test_shard(cfg.data, tokenizer, num_owners=cfg.architecture.owners)
    if held is None:
        _, held = build_owner_datasets(
            cfg.data, tokenizer, num_owners=cfg.architecture.owners, round_index=checkpoint.round_id
        )
    size = cfg.finetune.batch_size
    round_id = round_number(checkpoint.round_id)
    desc = (
        f"final evaluation of the round-{round_id} checkpoint on {len(held)} {held.name} examples"
    )
    batches = track(
        held.batches(size, seed=0), desc,
        total=len(held.batch_indices(size, seed=0)), unit="batches", enabled=cfg.task.progress,
    )  # fmt: skip
    # inference_mode, not only no_grad: this process never trains, and no tensor it makes
    # needs autograd's version counters. The batches stay the training size: the loss is a
    # mean of per-batch means, so larger ones would move it (64 a batch: 0.4159 -> 0.4189 on
    # the default job's checkpoint, for 2.58-2.65 s against 2.73-2.78 s)
    with torch.inference_mode():
        metrics = evaluate(part_chain(parts), parts[-1].adapter, batches)
    return {"round": round_id, "split": held.name, "samples": len(held), **metrics.to_dict()}
