"""Cross-field checks that Hydra's per-key typing cannot express, run before any process starts.

Every error is a ConfigError naming the keys and the values that clash. Checks that need a
registry (families, transports, buses, planners, drift profiles) live in `splitlab.choices`,
above every subpackage, so config imports nothing but itself and `splitlab.errors`.

    splitlab architecture.cut_layers=5 architecture.tail_blocks=1   # refused: no body block
"""

from __future__ import annotations

import math
import re

from splitlab.config.enums import ArchitectureName, DType, SftCut, TaskKind, TaskName
from splitlab.config.schema import (
    MAX_SPIN_US,
    Config,
    DataConfig,
    FinetuneConfig,
    FinetuneTaskConfig,
    ModelConfig,
    RingConfig,
    TransportConfig,
    TwoStageConfig,
    UShapeConfig,
)
from splitlab.errors import ConfigError

MAX_PORT = 65535
MIN_POOL_BYTES = 1 << 20  # a buffer pool smaller than this cannot hold a useful frame


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _positive(key: str, value: float) -> None:
    """A finite number > 0: an infinite timeout would make its wait unbounded."""
    _require(value > 0 and math.isfinite(value), f"{key}={value!r} must be finite and > 0")


def _startup_timeout(key: str, value: float) -> None:
    _require(
        value >= 0 and math.isfinite(value),
        f"{key}={value!r} must be finite and >= 0 (0 = timeout_s)",
    )


def _port(key: str, value: int) -> None:
    _require(
        0 <= value <= MAX_PORT, f"{key}={value} must be a TCP port in [0, {MAX_PORT}] (0 = any)"
    )


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def validate_u_shape(arch: UShapeConfig, model: ModelConfig) -> None:
    L = model.num_layers
    _positive("architecture.owners", arch.owners)
    _positive("architecture.workers", arch.workers)
    _require(
        arch.cut_layers >= 1,
        f"architecture.cut_layers={arch.cut_layers} must be >= 1: with no front block the "
        "embedding output crosses the wire and token ids are trivially recoverable",
    )
    _require(arch.tail_blocks >= 0, f"architecture.tail_blocks={arch.tail_blocks} must be >= 0")
    body = L - arch.cut_layers - arch.tail_blocks
    _require(
        body >= 1,
        f"no remote body block: model.num_layers={L} - architecture.cut_layers={arch.cut_layers}"
        f" - architecture.tail_blocks={arch.tail_blocks} = {body}; leave at least one block",
    )
    _positive("architecture.max_inflight", arch.max_inflight)
    _positive("architecture.microbatches_per_window", arch.microbatches_per_window)
    _require(
        arch.worker_max_inflight >= arch.owners,
        f"architecture.worker_max_inflight={arch.worker_max_inflight} is below the owner count "
        f"architecture.owners={arch.owners}: every owner needs at least one credit per worker",
    )
    _positive("architecture.timeout_s", arch.timeout_s)
    _startup_timeout("architecture.startup_timeout_s", arch.startup_timeout_s)
    if arch.compute_weights:
        _require(
            len(arch.compute_weights) == arch.workers,
            f"architecture.compute_weights has {len(arch.compute_weights)} entries "
            f"{list(arch.compute_weights)} but architecture.workers={arch.workers}",
        )
        for i, w in enumerate(arch.compute_weights):
            _positive(f"architecture.compute_weights[{i}]", w)


def validate_two_stage(arch: TwoStageConfig, model: ModelConfig) -> None:
    L = model.num_layers
    _positive("architecture.owners", arch.owners)
    _positive("architecture.workers", arch.workers)
    _require(
        1 <= arch.cut_layers <= L - 1,
        f"architecture.cut_layers={arch.cut_layers} out of range [1, {L - 1}] for "
        f"model.num_layers={L}: the last stage needs at least one block",
    )
    _positive("architecture.control_count", arch.control_count)
    _positive("architecture.timeout_s", arch.timeout_s)
    _startup_timeout("architecture.startup_timeout_s", arch.startup_timeout_s)


def validate_ring(arch: RingConfig, model: ModelConfig) -> None:
    L = model.num_layers
    _require(
        1 <= arch.stages <= L,
        f"architecture.stages={arch.stages} out of range [1, {L}] for model.num_layers={L}",
    )
    cuts = list(arch.cuts)
    for i, c in enumerate(cuts):
        _require(
            1 <= c <= L - 1,
            f"architecture.cuts[{i}]={c} out of range [1, {L - 1}] for model.num_layers={L} "
            f"(cuts={cuts})",
        )
    for a, b in zip(cuts, cuts[1:], strict=False):
        _require(
            a < b,
            f"architecture.cuts={cuts} must be strictly increasing (every stage owns >= 1 block)",
        )
    num_stages = len(cuts) + 1 if cuts else arch.stages
    if arch.stage_devices:
        _require(
            len(arch.stage_devices) == num_stages,
            f"architecture.stage_devices has {len(arch.stage_devices)} entries "
            f"{list(arch.stage_devices)} but the ring has {num_stages} stages",
        )
        for i, device in enumerate(arch.stage_devices):
            _device(f"architecture.stage_devices[{i}]", device)
    if arch.peer_hosts:
        _require(
            len(arch.peer_hosts) == num_stages,
            f"architecture.peer_hosts has {len(arch.peer_hosts)} entries {list(arch.peer_hosts)} "
            f"but the ring has {num_stages} stages",
        )
    _require(
        arch.window >= 0, f"architecture.window={arch.window} must be >= 0 (0 = no control plane)"
    )
    _require(
        not arch.bypass or arch.window > 0,
        "architecture.bypass=true needs architecture.window > 0: blocks move, and a stage can be "
        "left without them, only at the window barrier",
    )
    _positive("architecture.ctrl_timeout_s", arch.ctrl_timeout_s)
    _positive("architecture.data_timeout_s", arch.data_timeout_s)
    _positive("architecture.connect_timeout_s", arch.connect_timeout_s)
    if arch.base_port:
        _port("architecture.base_port", arch.base_port)
        last = arch.base_port + num_stages - 1
        _require(
            last <= MAX_PORT,
            f"architecture.base_port={arch.base_port}: the last of {num_stages} stages would "
            f"listen on port {last} > {MAX_PORT}",
        )


def validate_finetune(ft: FinetuneConfig, model: ModelConfig, arch_name: ArchitectureName) -> None:
    _positive("finetune.lr", ft.lr)
    _require(ft.weight_decay >= 0, f"finetune.weight_decay={ft.weight_decay} must be >= 0")
    _positive("finetune.batch_size", ft.batch_size)
    _require(
        DType(ft.compute_dtype) is not DType.bf16 or arch_name is ArchitectureName.u_shape,
        f"finetune.compute_dtype=bf16 runs in U-shape nodes only; architecture "
        f"{arch_name.value} computes in the weights' dtype (model.dtype): use auto or fp32",
    )
    _require(
        ft.clip_grad_norm >= 0,
        f"finetune.clip_grad_norm={ft.clip_grad_norm} must be >= 0 (0 = off)",
    )
    _positive("finetune.lora.r", ft.lora.r)
    _require(0 <= ft.lora.dropout < 1, f"finetune.lora.dropout={ft.lora.dropout} must be in [0, 1)")
    if ft.sft.enabled:
        H = model.hidden_size
        _require(
            1 <= ft.sft.rank < H,
            f"finetune.sft.rank={ft.sft.rank} must be in [1, model.hidden_size={H}): at rank >= H "
            "the cut sends no fewer values than the uncompressed hidden state",
        )
        _require(
            arch_name in (ArchitectureName.u_shape, ArchitectureName.two_stage),
            f"finetune.sft.enabled=true needs architecture u_shape or two_stage, not {arch_name.value}",
        )
        if arch_name is ArchitectureName.two_stage:
            _require(
                ft.sft.cuts is SftCut.front,
                f"finetune.sft.cuts={ft.sft.cuts.value}: two_stage has a single cut; use front",
            )


def validate_data(data: DataConfig, num_owners: int) -> None:
    counts = data.samples_per_owner
    if isinstance(counts, list):
        _require(
            len(counts) == num_owners,
            f"data.samples_per_owner has {len(counts)} entries {counts} but "
            f"architecture.owners={num_owners}",
        )
        for i, n in enumerate(counts):
            _require(_is_count(n) and n >= 0, f"data.samples_per_owner[{i}]={n!r} must be >= 0")
        _positive("sum(data.samples_per_owner)", sum(counts))
        _require(
            data.quantity_skew_alpha is None,
            f"data.quantity_skew_alpha={data.quantity_skew_alpha} draws each owner's count from "
            f"one data.samples_per_owner; got the list {counts}",
        )
    else:
        _require(
            _is_count(counts),
            f"data.samples_per_owner={counts!r} must be a count or a list of one per owner",
        )
        _positive("data.samples_per_owner", counts)
    if data.quantity_skew_alpha is not None:
        _positive("data.quantity_skew_alpha", data.quantity_skew_alpha)
    _require(data.val_samples >= 0, f"data.val_samples={data.val_samples} must be >= 0")
    _positive("data.alpha", data.alpha)
    _require(data.max_length >= 2, f"data.max_length={data.max_length} must be >= 2")


def validate_transport(transport: TransportConfig) -> None:
    _port("transport.port", transport.port)
    _require(
        transport.pool_bytes >= MIN_POOL_BYTES,
        f"transport.pool_bytes={transport.pool_bytes} must be >= {MIN_POOL_BYTES} (1 MiB): "
        "every received frame is read into a buffer of this pool",
    )
    _positive("transport.max_frame_bytes", transport.max_frame_bytes)
    _positive("transport.send_queue_frames", transport.send_queue_frames)
    _require(
        0 <= transport.spin_us <= MAX_SPIN_US,
        f"transport.spin_us={transport.spin_us} must be in [0, {MAX_SPIN_US:g}] (microseconds a "
        "receive looks for a frame before it sleeps; 0 = sleep at once)",
    )


def validate_rounds(task: FinetuneTaskConfig) -> None:
    _positive("task.rounds", task.rounds)
    _require(
        task.steps_per_round >= 0,
        f"task.steps_per_round={task.steps_per_round} must be >= 0 (0 = one pass over the data)",
    )


def validate_model(model: ModelConfig) -> None:
    _positive("model.num_layers", model.num_layers)
    _positive("model.hidden_size", model.hidden_size)
    if model.dropout is not None:
        _require(0 <= model.dropout < 1, f"model.dropout={model.dropout} must be in [0, 1)")
    if model.source.value in ("packaged", "hub"):
        _require(
            bool(model.id),
            f"model.id must name the asset or hub id for model.source={model.source.value}",
        )


def validate_config(cfg: Config) -> None:
    """Refuse invalid combinations before any process starts."""
    validate_model(cfg.model)
    validate_transport(cfg.transport)
    arch = cfg.architecture
    if isinstance(arch, UShapeConfig):
        validate_u_shape(arch, cfg.model)
    elif isinstance(arch, TwoStageConfig):
        validate_two_stage(arch, cfg.model)
    elif isinstance(arch, RingConfig):
        validate_ring(arch, cfg.model)
    task = cfg.task.name
    if task is TaskName.finetune:
        _require(
            not isinstance(arch, RingConfig),
            "task=finetune needs architecture=u_shape or two_stage, not ring",
        )
        validate_finetune(cfg.finetune, cfg.model, arch.name)
        validate_data(cfg.data, arch.owners)
        if isinstance(cfg.task, FinetuneTaskConfig):
            validate_rounds(cfg.task)
    elif task is TaskName.sft_rank:
        _require(
            TaskKind(cfg.data.task) is TaskKind.classification,
            f"task=sft_rank needs a classification data set, not data={cfg.data.name} "
            f"({TaskKind(cfg.data.task).value})",
        )
        _require(
            cfg.device == "cpu",
            f"device={cfg.device}: task=sft_rank trains on cpu only (its loopback study has no "
            "CUDA path; run its Hydra jobs on CPU nodes)",
        )
    elif task in (TaskName.infer, TaskName.calibrate):
        _require(
            isinstance(arch, RingConfig),
            f"task={task.value} needs architecture=ring, not {arch.name.value}",
        )
    _device("device", cfg.device)
    if isinstance(arch, UShapeConfig) and arch.worker_device is not None:
        _device("architecture.worker_device", arch.worker_device)


def _device(key: str, value: str) -> None:
    _require(
        value == "cpu" or re.fullmatch(r"cuda(:\d+)?", value) is not None,
        f"{key}={value!r} must be cpu, cuda or cuda:N",
    )
