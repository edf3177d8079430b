"""The parts a training node builds, with the low-rank cut(s) of `finetune.sft` applied.

Order matters and is the same in every process: decompose the cut blocks' FFNs (the SVD of the
pre-trained weights, no random draws), cut the model into parts, then inject LoRA (random
adapter init) if asked. `apply_lora` freezes everything but the adapters and keeps the
`lowrank_in` / `lowrank_out` factors trainable, so with LoRA or full fine-tuning the code's
factors learn, as in the SFT paper.

    .venv/bin/pytest tests/equivalence/test_train_sft.py -q
"""

from __future__ import annotations

from torch import nn

from splitlab.config.schema import LoraConfig, SftConfig
from splitlab.models.lowrank import decompose_plan
from splitlab.models.parts import Part, build_parts
from splitlab.models.plan import PartitionPlan, with_lowrank_cuts
from splitlab.train.lora import apply_lora


def sft_plan(plan: PartitionPlan, sft: SftConfig) -> PartitionPlan:
    """`plan` with the low-rank cuts `sft` asks for (unchanged when `sft.enabled` is false)."""
    if not sft.enabled:
        return plan
    return with_lowrank_cuts(plan, rank=sft.rank, residual=sft.residual, cuts=sft.cuts,
                             factors=sft.factors)  # fmt: skip


def build_training_parts(
    model: nn.Module, plan: PartitionPlan, *, sft: SftConfig, lora: LoraConfig | None = None
) -> tuple[Part, ...]:
    """Decompose (if `sft.enabled`), cut `model` by `plan`, inject LoRA (if `lora`), in place.

    Returns the parts in forward order: (front, body, tail) for U-shape, (first, last) for
    two-stage.

    Raises:
        ConfigError: the cuts do not fit the plan or the rank the model (see
            `splitlab.models.plan.with_lowrank_cuts`, `splitlab.models.lowrank.decompose`).
    """
    plan = sft_plan(plan, sft)
    decompose_plan(model, plan)
    parts = build_parts(model, plan)
    if lora is not None:
        apply_lora(parts, lora)
    return parts
