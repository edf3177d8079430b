"""Enums for every closed set of choices in the config (omegaconf 2.3 rejects `Literal`)."""

from __future__ import annotations

from enum import Enum


class TaskName(str, Enum):
    finetune = "finetune"
    infer = "infer"
    calibrate = "calibrate"
    analyze = "analyze"


class Family(str, Enum):
    bert = "bert"
    gpt2 = "gpt2"
    llama = "llama"  # Llama, Qwen2, SmolLM2


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


class TransportName(str, Enum):
    tcp = "tcp"
    rabbitmq = "rabbitmq"
    inproc = "inproc"


class ControlName(str, Enum):
    embedded = "embedded"
    rabbitmq = "rabbitmq"


class PinnedMemory(str, Enum):
    auto = "auto"
    on = "on"
    off = "off"


class Objective(str, Enum):
    mean_of_means = "mean_of_means"  # mean of per-microbatch mean losses (the default)
    token_weighted = "token_weighted"  # every target token weighs the same across the group


class FinetuneMethod(str, Enum):
    lora = "lora"
    full = "full"


class ResidualMode(str, Enum):
    keep = "keep"
    drop = "drop"


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


class DriftName(str, Enum):
    none = "none"
    steady = "steady"
    thermal_ramp = "thermal_ramp"
    one_slow_node = "one_slow_node"
    oscillating = "oscillating"
    link_degrade = "link_degrade"
    live = "live"


class DriftSource(str, Enum):
    none = "none"
    replay = "replay"
    live = "live"


class PlannerName(str, Enum):
    noop = "noop"
    forced_shift = "forced_shift"
    adaptive = "adaptive"
