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
    CalibrateProbe,
    DataDistribution,
    DataSource,
    DriftSource,
    DType,
    FinetuneMethod,
    KeepCheckpoints,
    LoaderKind,
    ModelSource,
    Objective,
    ResidualMode,
    SftCut,
    SftFactors,
    TaskKind,
    TaskName,
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
    keep_checkpoints: KeepCheckpoints = KeepCheckpoints.last_and_best  # which rounds' files stay
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
    prompt_ids: list[int] = field(default_factory=list)  # token ids instead of prompt; [] = off
    ignore_eos: bool = False  # always generate max_new_tokens (benchmarks, equivalence checks)


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
    only: list[CalibrateProbe] = field(default_factory=list)  # probes to run; [] = every probe
    contexts: list[int] = field(default_factory=list)  # decode contexts (tokens); [] = geometric


@dataclass
class AnalyzeTaskConfig(TaskConfig):
    name: TaskName = TaskName.analyze
    run_dir: str = MISSING  # a finished run folder (with traces/ and .hydra/)


@dataclass
class SftRankTaskConfig(TaskConfig):
    """One arm of the low-rank cut study (`splitlab.sft.study`) at `seed`, into the study folder
    `out`; the budget keys are `splitlab.sft.study.Study`'s (a folder holds one budget)."""

    name: TaskName = TaskName.sft_rank
    arm: str = "baseline"  # baseline, or DEPTH/RESIDUAL/R[/3f]: upper/drop/8, lower/keep/1/3f
    out: str = "outputs/sft_rank"  # the study folder every arm and seed shares (resumable)
    samples: int = 8530  # training examples (Rotten Tomatoes' train split)
    val_samples: int = 1066  # held-out examples (its validation split)
    epochs: int = 3
    batch_size: int = 16
    lr: float = 1e-4  # peak rate of the pre-trained weights (full fine-tuning; 0 = frozen)
    head_lr: float = 1e-4  # the classifier's peak rate
    factor_lr: float = 1e-4  # the low-rank factors' peak rate (0 = frozen)
    warmup: float = 0.06  # fraction of the steps warming up linearly; then linear decay to 0
    eval_every: int = 100  # steps between held-out evaluations (the learning curve)
    data_seed: int = 1  # which examples are train and held-out (the same for every seed)


# --- model ----------------------------------------------------------------------------------


@dataclass
class ModelConfig:
    """Which weights, which family, and (for random init) which dimensions."""

    name: str = MISSING  # option name, e.g. minilm, tiny_llama
    family: str = MISSING  # adapter in the family registry (register_family): bert, gpt2, llama
    source: ModelSource = MISSING  # packaged (asset cache), hub (id or local path), random
    id: str | None = None  # packaged asset name, hub id, or a local model folder (any source)
    path: str | None = None  # a local model folder; set, it overrides source and id
    tokenizer: str | None = None  # asset name, hub id or folder; None = the model's own
    # For a local folder the next facts are read from its config.json (splitlab.models.folder).
    num_layers: int = MISSING  # transformer blocks (validated against the loaded config)
    hidden_size: int = MISSING  # H: width of the tensor that crosses a cut
    tie_word_embeddings: bool | None = None  # head is the embedding tensor; None = not read
    untie_embeddings: bool = False  # a tied head becomes its own copy at load (two_stage)
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
    startup_timeout_s: float = 0.0  # first START and REGISTER waits (model loads); 0 = timeout_s
    worker_device: str | None = None  # the workers' device (cpu, cuda, cuda:N); None = device


@dataclass
class TwoStageConfig(ArchitectureConfig):
    """Legacy mode: first stage = front, last stage = the rest with the head (labels travel)."""

    name: ArchitectureName = ArchitectureName.two_stage
    owners: int = 1  # first-stage processes (hold the data)
    workers: int = 1  # last-stage processes (receive labels)
    cut_layers: int = 2  # blocks on the first stage
    control_count: int = 1  # live first-stage graphs per window (one step per window)
    timeout_s: float = 120.0  # any single wait before aborting
    startup_timeout_s: float = 0.0  # first START and REGISTER waits (model loads); 0 = timeout_s


@dataclass
class RingConfig(ArchitectureConfig):
    """Pipeline inference ring: stage i owns blocks [cuts[i-1], cuts[i])."""

    name: ArchitectureName = ArchitectureName.ring
    cuts: list[int] = field(default_factory=list)  # first block of stages 1..S-1; [] = equal
    stages: int = 3  # number of stages when cuts is empty
    window: int = 20  # W: decode tokens per control window (barrier cadence); 0 = no barriers
    ctrl_timeout_s: float = 5.0  # control waits inside a barrier (control star, KV channel)
    data_timeout_s: float = 300.0  # longest blocked wait on the data ring (a token's hop)
    connect_timeout_s: float = 180.0  # ring set-up: every link up, model loads included
    peer_hosts: list[str] = field(default_factory=list)  # per-stage addresses; [] = loopback
    ctrl_host: str | None = None  # the head's address (control star); None = peer_hosts[0]
    base_port: int = 0  # stage i listens on base_port+i; 0 = the launcher picks free ports
    stage_devices: list[str] = field(default_factory=list)  # per stage; [] = device for all
    loader: LoaderKind = LoaderKind.shard  # shard (strict residency) or hf (whole, then prune)
    strict_parity: bool = True  # refuse stages whose torch/transformers/python/dtype differ
    bypass: bool = False  # a re-partition may leave a middle stage no blocks: the ring skips it
    prepare_ahead: bool = True  # decide a barrier one window early, build moved blocks meanwhile


# --- transport and control ------------------------------------------------------------------


# How long a TCP receive may look for a frame before it sleeps (`TcpTransport.recv`, where the
# measurements are): the ring's (conf/task/infer.yaml) and the benchmarks' value, and the bound.
SPIN_US = 200.0
MAX_SPIN_US = 100_000.0  # a longer spin is a busy wait, not a wake-up saved


@dataclass
class TransportConfig:
    """The tensor data plane (activations, gradients, hidden states, KV)."""

    name: str = MISSING  # a registered transport (splitlab.wire.registry): tcp, rabbitmq, inproc
    bind_host: str = "127.0.0.1"  # address the data listener binds
    advertise_host: str | None = None  # address peers dial; None = route to broker, else bind
    port: int = 0  # data listener port; 0 = pick a free one
    pool_bytes: int = 64 * 1024 * 1024  # budget per buffer pool (bytes)
    send_queue_frames: int = 64  # frames queued per peer and lane before a send blocks
    max_frame_bytes: int = 256 * 1024 * 1024  # refuse larger frames before allocating
    spin_us: float = 0.0  # tcp: a receive looks this long for a frame before it sleeps; 0 =
    # sleep at once (fine-tuning waits on compute); task=infer sets 200 (wire/tcp.py)
    url: str = "amqp://guest:guest@127.0.0.1:5672/%2F"  # broker (rabbitmq transport only)


@dataclass
class ControlConfig:
    """The control bus (window protocol, membership, model updates)."""

    name: str = MISSING  # a registered control bus (splitlab.control.bus): embedded, rabbitmq
    url: str = "amqp://guest:guest@127.0.0.1:5672/%2F"  # broker URL (rabbitmq only)
    prefetch: int = 32  # unacked deliveries per consumer
    heartbeat_s: int = 30  # AMQP heartbeat (rabbitmq only)
    # rabbitmq only: a vhost of the session's own and one broker user per node, each reading
    # only its own queues, every message's sender checked (splitlab.control.broker_users)
    node_users: bool = False


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
    factors: SftFactors = SftFactors.two  # two (S V | U) or three (V | S, U: S on the receiver)


@dataclass
class FinetuneConfig:
    method: FinetuneMethod = MISSING  # lora or full
    lr: float = 5e-4  # AdamW learning rate
    weight_decay: float = 0.01  # AdamW decoupled weight decay
    eps: float = 1e-8  # AdamW denominator epsilon
    batch_size: int = 16  # sequences per microbatch
    compute_dtype: DType = DType.auto  # torch.autocast: bf16, fp32 (none), auto = bf16 with AMX
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
    samples_per_owner: Any = 512  # training examples per owner: one count, or one per owner
    quantity_skew_alpha: float | None = None  # Dirichlet share of the examples; None = as given
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
    name: str = MISSING  # none, live, or a registered profile (splitlab.drift.profiles)
    source: DriftSource = DriftSource.none  # none, replay (JSONL trace) or live (sensors)
    trace: str | None = None  # replay trace path; None = generate from `name` into the run dir
    seed: int = 77  # sensor-noise seed (combined with run id and stage)
    noise_var_degc2: float = 0.5  # Gaussian temperature noise variance (never zero)
    slow_stage: int = 1  # stage slowed by one_slow_node
    phi: float = 1.5  # slowdown factor (1.0 = none) applied as sleep (phi - 1) x compute_ms
    period_tokens: int = 60  # oscillating / ramp time scale; cpu_throttle's step token
    length_tokens: int = 400  # generated trace length (tokens)


@dataclass
class PlannerConfig:
    """Shared by every planner option; each option's parameters live in its own schema."""

    name: str = MISSING  # a registered planner (splitlab.infer.planners)


@dataclass
class NoopPlannerConfig(PlannerConfig):
    name: str = "noop"


@dataclass
class ForcedShiftPlannerConfig(PlannerConfig):
    name: str = "forced_shift"
    at_token: int = 100  # token at which the shift happens
    shift_k: int = 1  # blocks moved (+ pulls back from the higher stage)
    boundary: int = 1  # which movable boundary (1..S-1)


@dataclass
class AdaptivePlannerConfig(PlannerConfig):
    name: str = "adaptive"
    hysteresis: float = 0.15  # minimum relative gain before moving, in [0, 1)
    cost_model: str | None = None  # calibration JSON; None = observed times only
    calibration_key: str | None = None  # its record (model/device/dtype); None = its only one
    link_low: float = 0.5  # architecture.bypass: skip a middle stage whose link_obs falls below
    link_high: float = 0.9  # ... and give a skipped one a block back at link_obs >= this
    links: bool = True  # false: compute only, link_obs never read (no route-around with bypass)


@dataclass
class ModelPlannerConfig(PlannerConfig):
    name: str = "model"
    hysteresis: float = 0.05  # minimum relative gain in predicted TPOT before moving, in [0, 1)
    calibration: str | None = None  # calibrate.py JSON (decode, link, L_n); None = defaults
    calibration_key: str | None = None  # its record (model/device/dtype); None = its only one
    horizon_tokens: int = (
        64  # tokens a move's gain is counted over against its migration (at most those left)
    )
    mem_high: float = 0.9  # q_mem_obs at or above which a stage receives no more blocks
    confirm: int = 2  # barriers in a row that must pick the same target before a move (1 = at once)


# --- testbed --------------------------------------------------------------------------------


@dataclass
class TestbedHostConfig:
    """One emulated host: a network namespace with cgroup budgets (splitlab/testbed)."""

    cpu: float = 0.0  # CPU budget in cores (0.5 = half of one core); 0 = no quota
    memory_mib: int = 0  # memory limit (MiB); 0 = no limit
    threads: int = 0  # OpenMP/torch threads of processes on the host; 0 = ceil(cpu), 1 at least


@dataclass
class TestbedLinkConfig:
    """A host's link to the testbed switch; a path between two hosts crosses both their links."""

    up_mbit: float = 0.0  # host -> switch rate (Mbit/s); 0 = unshaped
    down_mbit: float = 0.0  # switch -> host rate (Mbit/s); 0 = unshaped
    burst_kib: float = 0.0  # token-bucket depth (KiB); 0 = 2 ms at the rate, at least 16 KiB capped at 50 ms of it, 4 KiB at least
    queue_kib: float = (
        0.0  # bytes queued before drops (KiB); 0 = 50 ms at the rate, 64 KiB at least
    )
    delay_ms: float = 0.0  # one-way delay added on this link (ms)
    jitter_ms: float = 0.0  # delay varies uniformly by +- this much (ms)


@dataclass
class TestbedConfig:
    """Emulated hosts, links and role placement; `none` (no hosts) changes nothing."""

    name: str = MISSING  # option name
    hosts: dict[str, TestbedHostConfig] = field(default_factory=dict)  # {} = no testbed
    links: dict[str, TestbedLinkConfig] = field(
        default_factory=dict
    )  # host -> its link; absent = unshaped
    placement: dict[str, list[str]] = field(default_factory=dict)  # role -> host of rank 0, 1, ...
    root_ports: list[int] = field(
        default_factory=lambda: [5672]
    )  # loopback ports (broker) hosts reach at the root address
    probe_s: float = 0.5  # bulk-throughput probe per link direction at start-up (s)
    probe_tolerance: float = 0.1  # refuse to start when a probed rate is further off (fraction)
    probe_attempts: int = 3  # probes of a direction that reads off nominal before refusing


# --- logger -------------------------------------------------------------------------------


@dataclass
class CsvLoggerConfig:
    """RUN/metrics.csv: one row per round and owner (the run's JSON records are always written)."""


@dataclass
class TensorboardLoggerConfig:
    """Event files the TensorBoard UI reads (needs the `loggers` extra)."""

    dir: str = "tensorboard"  # event folder; relative = under the run dir


@dataclass
class MlflowLoggerConfig:
    """One MLflow run in a local tracking store (needs the `loggers` extra)."""

    tracking_uri: str | None = None  # None = sqlite:///<run dir>/mlflow/mlflow.db
    experiment: str = "splitlab"  # MLflow experiment the run is filed under
    run_name: str | None = None  # None = the run folder's name


@dataclass
class LoggerConfig:
    """Where round metrics, final metrics, ring TPOT and the resolved config go; each selected
    option (`logger=[csv,tensorboard,mlflow]`) sets its field, the others stay None."""

    csv: CsvLoggerConfig | None = None
    tensorboard: TensorboardLoggerConfig | None = None
    mlflow: MlflowLoggerConfig | None = None


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
    planner: Any = MISSING
    testbed: TestbedConfig = MISSING
    logger: LoggerConfig = field(default_factory=LoggerConfig)  # none selected = no logger
    device: str = "cpu"  # cpu, cuda or cuda:N for every local process
    run_dir: str | None = None  # set by the CLI to Hydra's output folder


# group -> option -> schema: each YAML in conf/<group>/ extends `/schema/<group>/<option>`.
GROUP_SCHEMAS: dict[str, dict[str, type]] = {
    "task": {
        "finetune": FinetuneTaskConfig,
        "infer": InferTaskConfig,
        "calibrate": CalibrateTaskConfig,
        "analyze": AnalyzeTaskConfig,
        "sft_rank": SftRankTaskConfig,
    },
    "model": {"model": ModelConfig},
    "architecture": {"u_shape": UShapeConfig, "two_stage": TwoStageConfig, "ring": RingConfig},
    "transport": {"transport": TransportConfig},
    "control": {"control": ControlConfig},
    "finetune": {"finetune": FinetuneConfig},
    "data": {"data": DataConfig},
    "drift": {"drift": DriftConfig},
    "planner": {
        "noop": NoopPlannerConfig,
        "forced_shift": ForcedShiftPlannerConfig,
        "adaptive": AdaptivePlannerConfig,
        "model": ModelPlannerConfig,
    },
    "testbed": {"testbed": TestbedConfig},
    "logger": {
        "csv": CsvLoggerConfig,
        "tensorboard": TensorboardLoggerConfig,
        "mlflow": MlflowLoggerConfig,
    },
}
