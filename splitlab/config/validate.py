"""Cross-field checks that Hydra's per-key typing cannot express, run before any process starts.

Every error is a ConfigError naming the keys and the values that clash.

    splitlab architecture.cut_layers=5 architecture.tail_blocks=1   # refused: no body block
"""

from __future__ import annotations

from splitlab.config.enums import ArchitectureName, Family, SftCut, TaskKind, TaskName
from splitlab.config.schema import (
    Config,
    DataConfig,
    FinetuneConfig,
    ModelConfig,
    RingConfig,
    TwoStageConfig,
    UShapeConfig,
)
from splitlab.errors import ConfigError
from splitlab.models.plan import even_cuts


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _positive(key: str, value: float) -> None:
    _require(value > 0, f"{key}={value!r} must be > 0")


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


def ring_cuts(arch: RingConfig, num_layers: int) -> list[int]:
    """The explicit cuts, or `stages` near-equal spans when `cuts` is empty."""
    return list(arch.cuts) if arch.cuts else even_cuts(num_layers=num_layers, stages=arch.stages)


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
    if arch.peer_hosts:
        _require(
            len(arch.peer_hosts) == num_stages,
            f"architecture.peer_hosts has {len(arch.peer_hosts)} entries {list(arch.peer_hosts)} "
            f"but the ring has {num_stages} stages",
        )
    _positive("architecture.window", arch.window)
    _positive("architecture.ctrl_timeout_s", arch.ctrl_timeout_s)


def validate_finetune(ft: FinetuneConfig, model: ModelConfig, arch_name: ArchitectureName) -> None:
    _positive("finetune.lr", ft.lr)
    _require(ft.weight_decay >= 0, f"finetune.weight_decay={ft.weight_decay} must be >= 0")
    _positive("finetune.batch_size", ft.batch_size)
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


def validate_data(data: DataConfig, model: ModelConfig) -> None:
    _positive("data.samples_per_owner", data.samples_per_owner)
    _require(data.val_samples >= 0, f"data.val_samples={data.val_samples} must be >= 0")
    _positive("data.alpha", data.alpha)
    _require(data.max_length >= 2, f"data.max_length={data.max_length} must be >= 2")
    if model.family is Family.bert:
        _require(
            data.task is TaskKind.classification,
            f"model={model.name} (family bert) classifies sequences; data={data.name} has "
            f"data.task={data.task.value}",
        )
    if data.task is TaskKind.classification and data.labels and model.family is Family.bert:
        _require(
            len(data.labels) == model.num_labels,
            f"data.labels has {len(data.labels)} classes {list(data.labels)} but "
            f"model.num_labels={model.num_labels}",
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
        validate_data(cfg.data, cfg.model)
    elif task in (TaskName.infer, TaskName.calibrate):
        _require(
            cfg.model.family is not Family.bert,
            f"task={task.value} generates text: model={cfg.model.name} is a BERT classifier",
        )
        _require(
            isinstance(arch, RingConfig),
            f"task={task.value} needs architecture=ring, not {arch.name.value}",
        )
    _require(
        cfg.device == "cpu" or cfg.device.startswith("cuda"),
        f"device={cfg.device!r} must be cpu, cuda or cuda:N",
    )
