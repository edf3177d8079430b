"""Dataclass schemas for every config group; each YAML option in conf/ extends one of them.

The CLI composes conf/ with Hydra, then converts once with `OmegaConf.to_object` into these
dataclasses; nothing below the CLI sees omegaconf. Units live in the field names.

    splitlab --cfg job          # print the composed default config
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from splitlab.config.enums import (
    ArchitectureName,
    ControlName,
    DataDistribution,
    DataSource,
    DriftName,
    DriftSource,
    DType,
    Family,
    FinetuneMethod,
    LoaderKind,
    ModelSource,
    Objective,
    PinnedMemory,
    PlannerName,
    ResidualMode,
    SftCut,
    TaskKind,
    TaskName,
    TransportName,
)

MISSING: Any = "???"  # omegaconf's marker for a required value (kept import-free here)

# --- task -----------------------------------------------------------------------------------


@dataclass
class TaskConfig:
    """Shared by every task option; `name` selects the entry point."""

    name: TaskName = MISSING
    seed: int = 0  # global seed: model init, data splits, dropout, sampling
    progress: bool = True  # progress bars on an interactive terminal (always off in CI)


@dataclass
class FinetuneTaskConfig(TaskConfig):
    name: TaskName = TaskName.finetune
    rounds: int = 2  # federated rounds (FedAvg at the end of each)
    steps_per_round: int = 0  # microbatches per owner per round; 0 = one pass over its data
    resume: bool = False  # continue from the last completed round's checkpoint in run_dir
    save_checkpoint: bool = True  # write the merged model after every round (atomic)
    validate: bool = True  # owners evaluate their held-out split before FedAvg
    checkpoint_dir: str | None = None  # where checkpoints live; None = <run dir>/checkpoints


@dataclass
class InferTaskConfig(TaskConfig):
    name: TaskName = TaskName.infer
    prompt: str = "What is the capital of France?"  # user message (chat template applied if any)
    chat: bool = True  # apply the tokenizer's chat template when it has one
    max_new_tokens: int = 64  # stop after this many generated tokens (or at EOS)
    temperature: float = 0.0  # 0 = greedy, the reproducible mode
    top_k: int = 0  # 0 = no top-k filtering (sampling only)


@dataclass
class CalibrateTaskConfig(TaskConfig):
    name: TaskName = TaskName.calibrate
    out: str | None = None  # JSON path; None = <run dir>/calibration.json
    max_context: int = 8192  # longest decode context timed (tokens)
    decode_steps: int = 24  # decode steps per timed batch (>= 24)
    prefill_min_tokens: int = 512  # shortest prompt in the prefill fit
    probe_round_trips: int = 30  # link probe: round trips per payload size (median taken)
    schema_from: str | None = None  # another device file whose keys are diffed against ours
    quick: bool = False  # short sweep: contexts to 2048, fewer prefill/link sizes and repeats
    threads: int = 0  # torch intra-op threads while timing; 0 = torch's default
    blocks: int = 4  # consecutive middle blocks timed together (times are per block)


@dataclass
class AnalyzeTaskConfig(TaskConfig):
    name: TaskName = TaskName.analyze
    run_dir: str = MISSING  # a finished run folder (with traces/ and .hydra/)


# --- model ----------------------------------------------------------------------------------


@dataclass
class ModelConfig:
    """Which weights, which family, and (for random init) which dimensions."""

    name: str = MISSING  # option name, e.g. minilm, tiny_llama
    family: Family = MISSING  # adapter in the family registry: bert, gpt2, llama
    source: ModelSource = MISSING  # packaged (asset cache), hub (id or local path), random
    id: str | None = None  # packaged asset name, or hub id / local folder for source=hub
    tokenizer: str | None = None  # asset name, hub id or folder; None = the model's own
    num_layers: int = MISSING  # transformer blocks (validated against the loaded config)
    hidden_size: int = MISSING  # H: width of the tensor that crosses a cut
    num_heads: int = 4  # attention heads (random init)
    num_kv_heads: int | None = None  # grouped-query KV heads (Llama; random init)
    intermediate_size: int = 128  # FFN width F (random init)
    vocab_size: int = 1024  # vocabulary (random init without a tokenizer)
    max_position_embeddings: int = 512  # longest sequence (random init)
    num_labels: int = 2  # classification heads (BERT)
    dtype: DType = DType.auto  # weights: the checkpoint's own (auto), fp32 or bf16
    dropout: float | None = None  # override every dropout probability; None = the model's own


# --- architecture ---------------------------------------------------------------------------


@dataclass
class ArchitectureConfig:
    name: ArchitectureName = MISSING


@dataclass
class UShapeConfig(ArchitectureConfig):
    """Owners keep embeddings, the first `cut_layers` blocks, the last `tail_blocks`, head, loss."""

    name: ArchitectureName = ArchitectureName.u_shape
    owners: int = 2  # data owners (each keeps its data and labels)
    workers: int = 1  # compute workers (each runs a body replica)
    cut_layers: int = 2  # blocks on the owner before the body
    tail_blocks: int = 0  # final blocks kept on the owner (head and final norm always are)
    compute_weights: list[float] = field(default_factory=list)  # per worker; [] = all 1.0
    adaptive_weights: bool = True  # re-weight WRR from measured tokens/s (EWMA, capped 20:1)
    max_inflight: int = 2  # live microbatches per owner
    worker_max_inflight: int = 8  # live body graphs per worker across its owners
    microbatches_per_window: int = 8  # per-owner update quota per window
    objective: Objective = Objective.mean_of_means  # how per-microbatch losses combine
    timeout_s: float = 120.0  # any single wait (peer, window, commit) before aborting the round


@dataclass
class TwoStageConfig(ArchitectureConfig):
    """Legacy mode: first stage = front, last stage = the rest with the head (labels travel)."""

    name: ArchitectureName = ArchitectureName.two_stage
    owners: int = 1  # first-stage processes (hold the data)
    workers: int = 1  # last-stage processes (receive labels)
    cut_layers: int = 2  # blocks on the first stage
    control_count: int = 1  # live first-stage graphs per window (one step per window)
    timeout_s: float = 120.0  # any single wait before aborting


@dataclass
class RingConfig(ArchitectureConfig):
    """Pipeline inference ring: stage i owns blocks [cuts[i-1], cuts[i])."""

    name: ArchitectureName = ArchitectureName.ring
    cuts: list[int] = field(default_factory=list)  # first block of stages 1..S-1; [] = equal
    stages: int = 3  # number of stages when cuts is empty
    window: int = 20  # W: decode tokens per control window (barrier cadence)
    ctrl_timeout_s: float = 5.0  # control sockets only; the data ring stays blocking
    peer_hosts: list[str] = field(default_factory=list)  # per-stage addresses; [] = loopback
    ctrl_host: str | None = None  # the head's address (control star)
    base_port: int = 0  # data ports base_port+i; 0 = pick free ports
    loader: LoaderKind = LoaderKind.shard  # shard (strict residency) or hf (whole, then prune)
    strict_parity: bool = True  # refuse stages whose torch/transformers/python/dtype differ


# --- transport and control ------------------------------------------------------------------


@dataclass
class TransportConfig:
    """The tensor data plane (activations, gradients, hidden states, KV)."""

    name: TransportName = MISSING
    bind_host: str = "127.0.0.1"  # address the data listener binds
    advertise_host: str | None = None  # address peers dial; None = route to broker, else bind
    port: int = 0  # data listener port; 0 = pick a free one
    pinned_memory: PinnedMemory = PinnedMemory.auto  # CUDA staging buffers
    pool_bytes: int = 64 * 1024 * 1024  # budget per buffer pool (bytes)
    queue_size: int = 32  # frames queued per lane before senders block
    max_frame_bytes: int = 256 * 1024 * 1024  # refuse larger frames before allocating
    url: str = "amqp://guest:guest@127.0.0.1:5672/%2F"  # broker (rabbitmq transport only)


@dataclass
class ControlConfig:
    """The control bus (window protocol, membership, model updates)."""

    name: ControlName = MISSING
    url: str = "amqp://guest:guest@127.0.0.1:5672/%2F"  # broker URL (rabbitmq only)
    prefetch: int = 32  # unacked deliveries per consumer
    timeout_s: float = 60.0  # any single control wait
    heartbeat_s: int = 30  # AMQP heartbeat (rabbitmq only)


# --- fine-tuning ----------------------------------------------------------------------------


@dataclass
class LoraConfig:
    r: int = 8  # adapter rank
    alpha: float = 16.0  # scaling numerator (scale = alpha / r)
    dropout: float = 0.0  # dropout on the adapter input
    targets: list[str] = field(default_factory=list)  # module names; [] = the family's default


@dataclass
class SftConfig:
    """Low-rank cut: the FFN's first projection at a cut is replaced by its truncated SVD."""

    enabled: bool = False  # decompose the FFN at the chosen cut(s)
    rank: int = 8  # R: width of the code that crosses the wire
    residual: ResidualMode = ResidualMode.keep  # keep (residual stream crosses too) or drop
    cuts: SftCut = SftCut.front  # front (front -> body), tail (body -> tail) or both


@dataclass
class FinetuneConfig:
    method: FinetuneMethod = MISSING  # lora or full
    lr: float = 5e-4  # AdamW learning rate
    weight_decay: float = 0.01  # AdamW decoupled weight decay
    batch_size: int = 16  # sequences per microbatch
    clip_grad_norm: float = 0.0  # > 0 clips each partition separately; 0 = off
    lora: LoraConfig = field(default_factory=LoraConfig)
    sft: SftConfig = field(default_factory=SftConfig)
    merge_for_fedavg: bool = False  # average merged dense weights instead of adapters


# --- data -----------------------------------------------------------------------------------


@dataclass
class DataConfig:
    name: str = MISSING  # option name
    source: DataSource = MISSING  # packaged, generator, file or hub
    task: TaskKind = MISSING  # classification or causal_lm
    path: str | None = None  # local CSV / JSONL / Parquet file (source=file)
    hub_id: str | None = None  # dataset id (source=hub; needs the `datasets` extra)
    hub_config: str | None = None  # dataset configuration name on the hub (e.g. gsm8k "main")
    hub_split: str = "train"  # split read from the hub
    text_column: str = "text"  # the input text
    label_column: str | None = "label"  # class label or answer (None for plain LM text)
    text_pair_column: str | None = None  # second sentence for pair tasks (GLUE MRPC/RTE/MNLI)
    labels: list[str] = field(default_factory=list)  # class names in id order; [] = infer
    max_length: int = 64  # tokens per sequence (truncate)
    samples_per_owner: int = 512  # training examples per owner
    val_samples: int = 256  # held-out examples (shared by all owners), validated every round
    test_samples: int = 0  # examples kept apart for the run's final evaluation; 0 = use val
    distribution: DataDistribution = DataDistribution.dirichlet  # iid or dirichlet (non-IID)
    alpha: float = 0.5  # Dirichlet concentration (small = skewed)
    keep_global_mix: bool = True  # dirichlet: owners together keep the pool's class mix
    refresh_each_round: bool = False  # draw a fresh split every round
    bucket_by_length: bool = True  # microbatches group similar lengths
    seed: int = 1  # data split seed (independent of task.seed)


# --- drift and planner ----------------------------------------------------------------------


@dataclass
class DriftConfig:
    name: DriftName = MISSING
    source: DriftSource = DriftSource.none  # none, replay (JSONL trace) or live (sensors)
    trace: str | None = None  # replay trace path; None = generate from `name` into the run dir
    seed: int = 77  # sensor-noise seed (combined with run id and stage)
    noise_var_degc2: float = 0.5  # Gaussian temperature noise variance (never zero)
    slow_stage: int = 1  # stage slowed by one_slow_node
    phi: float = 1.5  # slowdown factor (1.0 = none) applied as sleep (phi - 1) x compute_ms
    period_tokens: int = 60  # oscillating / ramp time scale (tokens)
    length_tokens: int = 400  # generated trace length (tokens)


@dataclass
class PlannerConfig:
    name: PlannerName = MISSING
    at_token: int = 100  # forced_shift: token at which the shift happens
    shift_k: int = 1  # forced_shift: blocks moved (+ pulls back from the higher stage)
    boundary: int = 1  # forced_shift: which movable boundary (1..S-1)
    hysteresis: float = 0.15  # adaptive: minimum relative gain before moving
    cost_model: str | None = None  # adaptive: calibration JSON; None = observed times only


# --- root -----------------------------------------------------------------------------------


@dataclass
class Config:
    task: Any = MISSING
    model: ModelConfig = MISSING
    architecture: Any = MISSING
    transport: TransportConfig = MISSING
    control: ControlConfig = MISSING
    finetune: FinetuneConfig = MISSING
    data: DataConfig = MISSING
    drift: DriftConfig = MISSING
    planner: PlannerConfig = MISSING
    device: str = "cpu"  # cpu, cuda or cuda:N for every local process
    run_dir: str | None = None  # set by the CLI to Hydra's output folder


# group -> option -> schema: each YAML in conf/<group>/ extends `/schema/<group>/<option>`.
GROUP_SCHEMAS: dict[str, dict[str, type]] = {
    "task": {
        "finetune": FinetuneTaskConfig,
        "infer": InferTaskConfig,
        "calibrate": CalibrateTaskConfig,
        "analyze": AnalyzeTaskConfig,
    },
    "model": {"model": ModelConfig},
    "architecture": {"u_shape": UShapeConfig, "two_stage": TwoStageConfig, "ring": RingConfig},
    "transport": {"transport": TransportConfig},
    "control": {"control": ControlConfig},
    "finetune": {"finetune": FinetuneConfig},
    "data": {"data": DataConfig},
    "drift": {"drift": DriftConfig},
    "planner": {"planner": PlannerConfig},
}
