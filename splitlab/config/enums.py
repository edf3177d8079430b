"""Enums for every closed set of choices in the config (omegaconf 2.3 rejects `Literal`).

Open sets are plain strings checked against their registries instead (`splitlab.choices`):
model families, transports, control buses, planners and drift profiles.
"""

from __future__ import annotations

from enum import Enum


class TaskName(str, Enum):
    finetune = "finetune"
    infer = "infer"
    calibrate = "calibrate"
    analyze = "analyze"
    sft_rank = "sft_rank"


class CalibrateProbe(str, Enum):
    """What `task=calibrate` can time (`task.only`); see `splitlab.measure.calibrate`."""

    decode = "decode"  # per-block decode c0 + c1 * (P + t)
    prefill = "prefill"  # per-block prefill d0 + d1 * P + d2 * P^2
    load = "load"  # L_n = fixed + per_block * n, and one block's cold/warm read
    swap = "swap"  # a block to the device and back (null on CPU)
    link = "link"  # alpha + beta * bytes over the framed-tensor path
    contention = "contention"  # decode beside a co-running process


class KeepCheckpoints(str, Enum):
    all = "all"  # every round's checkpoint
    last = "last"  # the newest only (what resume and the final evaluation read)
    last_and_best = "last_and_best"  # the newest and the one with the lowest validation loss


class ModelSource(str, Enum):
    packaged = "packaged"  # fetched from the package registry into the asset cache
    hub = "hub"  # a hub id (HF cache) or a local folder
    random = "random"  # random init from the dimensions in the config


class DType(str, Enum):
    auto = "auto"
    fp32 = "fp32"
    bf16 = "bf16"


class ArchitectureName(str, Enum):
    u_shape = "u_shape"
    two_stage = "two_stage"
    ring = "ring"


class LoaderKind(str, Enum):
    shard = "shard"
    hf = "hf"


class Objective(str, Enum):
    mean_of_means = "mean_of_means"  # mean of per-microbatch mean losses (the default)
    token_weighted = "token_weighted"  # every target token weighs the same across the group


class FinetuneMethod(str, Enum):
    lora = "lora"
    full = "full"


class ResidualMode(str, Enum):
    keep = "keep"
    drop = "drop"


class SftFactors(str, Enum):
    """How a low-rank cut holds the truncated SVD W ~ U_R S_R V_R (`splitlab.models.lowrank`)."""

    two = "two"  # sender S_R V_R, receiver U_R
    three = "three"  # sender V_R, receiver S_R (a trainable vector) then U_R


class SftCut(str, Enum):
    front = "front"  # the front -> body boundary
    tail = "tail"  # the body -> tail boundary
    both = "both"


class DataSource(str, Enum):
    packaged = "packaged"
    generator = "generator"
    file = "file"
    hub = "hub"


class TaskKind(str, Enum):
    classification = "classification"
    causal_lm = "causal_lm"


class DataDistribution(str, Enum):
    iid = "iid"
    dirichlet = "dirichlet"


class DriftSource(str, Enum):
    none = "none"
    replay = "replay"
    live = "live"
