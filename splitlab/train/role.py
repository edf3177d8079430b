"""One training process's place in its run: role, name, peers and the config sections it reads.

`train_role` derives a `TrainRole` from the run's resolved `Config` and the few facts only the
process knows (its rank, session, run folder, control address): node names, the number of
windows per round, the coordinator's longer wait, where traces and checkpoints go. Nothing
here has defaults of its own: every setting is the config's (`splitlab.config.schema`).

    python -m splitlab.node --config RUN/config.yaml --role owner --rank 0 ...
    .venv/bin/pytest tests/unit/test_train_role.py -q
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from splitlab.config.enums import FinetuneMethod
from splitlab.config.schema import (
    Config,
    ControlConfig,
    DataConfig,
    FinetuneConfig,
    FinetuneTaskConfig,
    LoraConfig,
    ModelConfig,
    TestbedConfig,
    TransportConfig,
    TwoStageConfig,
    UShapeConfig,
)
from splitlab.data.buckets import microbatches_per_round
from splitlab.data.split import owner_counts
from splitlab.errors import ConfigError

COORDINATOR = "coordinator"
EVALUATOR = "evaluator"  # the node role of a run's final evaluation (`splitlab.node`)
TRAIN_ROLES = (COORDINATOR, "owner", "worker")


def owner_names(num: int) -> list[str]:
    return [f"owner{i}" for i in range(num)]


def worker_names(num: int) -> list[str]:
    return [f"worker{i}" for i in range(num)]


@dataclass(frozen=True, kw_only=True)
class Fixture:
    """Testing only: fixed microbatches instead of the config's data, and where states go."""

    batches_path: Path | None = None  # owner: safetensors of microbatches (`mb{i}.<key>`)
    val_batches_path: Path | None = None  # owner: held-out microbatches, validated per round
    out_path: Path | None = None  # member: final partition state; coordinator: FedAvg JSON
    num_windows: int | None = None  # windows this process runs per round (a worker that leaves)
    no_coordinator: bool = False  # one round, no FedAvg, data key from $SPLITLAB_SESSION_KEY


@dataclass(frozen=True, kw_only=True)
class TrainRole:
    role: str  # coordinator, owner or worker
    rank: int  # index among its role (trace file, owner's data shard)
    name: str  # node id on the control bus: coordinator, owner<i>, worker<j>
    session: str  # the run's name on the bus and the data plane
    owners: list[str]
    workers: list[str]
    coordinator: str | None  # None: one round without FedAvg (Fixture.no_coordinator)
    model: ModelConfig
    arch: UShapeConfig | TwoStageConfig
    finetune: FinetuneConfig
    task: FinetuneTaskConfig
    data: DataConfig | None  # owners: the config's data (None with fixture batches)
    transport: TransportConfig
    control: ControlConfig
    control_address: tuple[str, int] | None  # the embedded bus (control=embedded)
    testbed: TestbedConfig  # hosts and links (no hosts: loopback); its paths' delays
    device: str
    compute_weight: float  # worker: its WRR weight, announced in REGISTER
    num_windows: int  # windows per round, the same in every process
    quota: int  # microbatches per owner per window (two-stage: live first-stage graphs)
    timeout_s: float  # any single wait; the coordinator's covers a whole round
    trace_dir: Path | None  # <trace_dir>/<role>-<rank>.jsonl
    checkpoint_dir: Path | None  # coordinator: round checkpoints; None = none written
    fixture: Fixture

    @property
    def two_stage(self) -> bool:
        return isinstance(self.arch, TwoStageConfig)

    @property
    def seed(self) -> int:
        return self.task.seed

    @property
    def lora(self) -> LoraConfig | None:
        """The adapters' settings, or None for full fine-tuning."""
        return self.finetune.lora if self.finetune.method is FinetuneMethod.lora else None

    @property
    def startup_timeout_s(self) -> float:
        """How long a node waits for its peers to start (they load models first)."""
        return self.arch.startup_timeout_s or self.timeout_s


def checkpoint_dir(cfg: Config, run_dir: Path) -> Path:
    task = cfg.task
    return Path(task.checkpoint_dir) if task.checkpoint_dir else run_dir / "checkpoints"


def check_finetune(cfg: Config) -> tuple[FinetuneTaskConfig, UShapeConfig | TwoStageConfig]:
    """The task and architecture of a fine-tuning run, or a `ConfigError` naming the key."""
    task, arch = cfg.task, cfg.architecture
    if not isinstance(task, FinetuneTaskConfig):
        raise ConfigError(f"task={task.name.value}: fine-tuning roles need task=finetune")
    if not isinstance(arch, UShapeConfig | TwoStageConfig):
        raise ConfigError(
            f"architecture={arch.name.value}: task=finetune across processes runs u_shape or "
            "two_stage"
        )
    if (
        isinstance(arch, UShapeConfig)
        and arch.compute_weights
        and (len(arch.compute_weights) != arch.workers)
    ):
        raise ConfigError(
            f"architecture.compute_weights={arch.compute_weights}: {arch.workers} workers"
        )
    return task, arch


def role_device(cfg: Config, role: str) -> str:
    """The device a role computes on: `architecture.worker_device` for workers where set."""
    arch = cfg.architecture
    if role == "worker" and isinstance(arch, UShapeConfig) and arch.worker_device is not None:
        return arch.worker_device
    return cfg.device


def role_names(cfg: Config) -> dict[str, list[str]]:
    """role -> node names, in rank order."""
    _, arch = check_finetune(cfg)
    return {
        COORDINATOR: [COORDINATOR],
        "owner": owner_names(arch.owners),
        "worker": worker_names(arch.workers),
    }


def train_role(
    cfg: Config,
    role: str,
    rank: int,
    *,
    session: str,
    run_dir: Path,
    control_address: tuple[str, int] | None = None,
    compute_weight: float | None = None,
    fixture: Fixture | None = None,
) -> TrainRole:
    """The role of one process (`role` coordinator|owner|worker, `rank` among its role)."""
    task, arch = check_finetune(cfg)
    names = role_names(cfg)
    if role not in names or not 0 <= rank < len(names[role]):
        raise ConfigError(
            f"--role={role} --rank={rank}: the config has {arch.owners} owners and "
            f"{arch.workers} workers (ranks from 0) and one coordinator"
        )
    fixture = fixture or Fixture()
    per_round = microbatches_per_round(
        samples_per_owner=max(owner_counts(cfg.data, arch.owners)),  # all wait for the longest
        batch_size=cfg.finetune.batch_size,
        steps_per_round=task.steps_per_round,
    )
    two_stage = isinstance(arch, TwoStageConfig)
    quota = arch.control_count if two_stage else arch.microbatches_per_window
    windows = max(1, math.ceil(per_round / quota))
    timeout_s = arch.timeout_s
    if role == COORDINATOR:  # it waits a whole round (all windows + validation) for UPDATEs
        timeout_s = arch.timeout_s * (windows + 2)
    weights = ([] if two_stage else list(arch.compute_weights)) or [1.0] * arch.workers
    if compute_weight is None:
        compute_weight = weights[rank] if role == "worker" else 1.0
    own_data = role == "owner" and fixture.batches_path is None
    return TrainRole(
        role=role, rank=rank, name=names[role][rank], session=session,
        owners=names["owner"], workers=names["worker"],
        coordinator=None if fixture.no_coordinator else COORDINATOR,
        model=cfg.model, arch=arch, finetune=cfg.finetune, task=task,
        data=cfg.data if own_data else None, transport=cfg.transport, control=cfg.control,
        control_address=control_address, testbed=cfg.testbed, device=role_device(cfg, role),
        compute_weight=compute_weight,
        num_windows=fixture.num_windows or windows, quota=quota, timeout_s=timeout_s,
        trace_dir=run_dir / "traces",
        checkpoint_dir=checkpoint_dir(cfg, run_dir) if task.save_checkpoint else None,
        fixture=fixture,
    )  # fmt: skip
