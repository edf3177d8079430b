"""A training node's spec and what every role builds from it: parts, control, data plane.

`NodeSpec` is the JSON a launcher writes per process (`splitlab.launch.train`) or a by-hand
start derives from the run's config (`splitlab.launch.node`). Every process builds the same
replica from it (`build_node_parts`: same seed, same order of random draws), whatever its role,
so FedAvg and checkpoints agree on key names.

    .venv/bin/pytest tests/equivalence/test_train_processes.py -q
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch
from safetensors.torch import load_file, save_file

from splitlab.config.enums import (
    DataDistribution,
    DataSource,
    DType,
    Family,
    FinetuneMethod,
    ModelSource,
    ResidualMode,
    SftCut,
    TaskKind,
)
from splitlab.config.schema import DataConfig, LoraConfig, ModelConfig, SftConfig
from splitlab.control.bus import make_bus
from splitlab.control.embedded import EmbeddedAddress
from splitlab.control.endpoint import ControlEndpoint
from splitlab.errors import ConfigError
from splitlab.models.load import load_model
from splitlab.models.parts import Part
from splitlab.models.plan import PartitionPlan, two_stage_plan, u_shape_plan
from splitlab.sft.parts import build_training_parts
from splitlab.telemetry.trace import Tracer
from splitlab.train.exchange import Exchange, exchange_for
from splitlab.train.feed import OwnerFeed
from splitlab.wire.base import Transport
from splitlab.wire.tcp import TcpTransport

DATA_KEY_ENV = "SPLITLAB_DATA_KEY"
TWO_STAGE = "two_stage"


@dataclass
class NodeSpec:
    role: str  # "coordinator", "owner" or "worker"
    name: str
    session: str
    owners: list[str]
    workers: list[str]
    model: dict[str, Any]  # ModelConfig fields (random init from `seed`, or packaged/hub)
    out_path: str  # where the partition state goes at the end ("" = nowhere)
    num_windows: int
    quota: int  # microbatches per owner per window
    seed: int = 0  # torch seed before building the model
    cut_layers: int = 1
    tail_blocks: int = 1
    weights: dict[str, float] = field(default_factory=dict)  # worker -> weight; {} = REGISTER's
    data_path: str | None = None  # owners: safetensors with mb{i}.<batch key>
    lr: float = 1e-2
    weight_decay: float = 0.01
    eps: float = 1e-8
    max_inflight: int = 2
    worker_max_inflight: int = 8
    clip_grad_norm: float = 0.0
    timeout_s: float = 60.0
    startup_timeout_s: float = 0.0  # first START and REGISTER waits (model loads); 0 = timeout_s
    coordinator: str | None = None  # node id of the coordinator; None = one round, no FedAvg
    rounds: int = 1  # coordinator: rounds to run
    resume: bool = False  # coordinator: continue after the last checkpoint in checkpoint_dir
    checkpoint_dir: str | None = None  # coordinator: where round checkpoints go
    trace_dir: str | None = None  # JSONL traces: <trace_dir>/<role>-<rank>.jsonl
    val_path: str | None = None  # owners: held-out microbatches, validated before each FedAvg
    lora: dict[str, Any] | None = None  # LoraConfig fields; None = full fine-tuning
    merge_for_fedavg: bool = False  # LoRA: average merged dense weights instead of adapters
    rank: int = 0  # index among its role (trace file rank, owner's data shard)
    device: str = "cpu"  # where this node computes: cpu, cuda, cuda:N
    control: dict[str, Any] | None = None  # ControlConfig fields; None = embedded bus from env
    transport: dict[str, Any] | None = None  # TransportConfig fields; None = TCP on loopback
    data: dict[str, Any] | None = None  # owners: DataConfig fields (real data, per round)
    batch_size: int = 16  # owners with `data`: sequences per microbatch
    steps_per_round: int = 0  # owners with `data`: microbatches per round; 0 = one pass
    validate: bool = True  # owners with `data`: held-out metrics before every FedAvg
    compute_weight: float = 1.0  # worker: its WRR weight, announced in REGISTER
    adaptive_weights: bool = False  # owners: re-weight WRR from COMMIT throughput
    progress: bool = False  # owners: a tqdm bar per round when stderr is a terminal
    sft: dict[str, Any] | None = None  # SftConfig fields: the low-rank cut(s); None = none
    architecture: str = "u_shape"  # u_shape (front/body/tail) or two_stage (first/last)
    control_count: int = 1  # two_stage: first-stage microbatches per window (one step each)
    objective: str = "mean_of_means"  # u_shape: how microbatch losses combine (config.enums)

    @classmethod
    def from_json(cls, text: str) -> NodeSpec:
        data = json.loads(text)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"node spec: unknown keys {unknown}")
        return cls(**data)


def data_config(data: dict[str, Any]) -> DataConfig:
    cfg = DataConfig(**data)
    cfg.source, cfg.task = DataSource(cfg.source), TaskKind(cfg.task)
    cfg.distribution = DataDistribution(cfg.distribution)
    return cfg


def model_config(data: dict[str, Any]) -> ModelConfig:
    cfg = ModelConfig(**data)
    cfg.family, cfg.source, cfg.dtype = (
        Family(cfg.family),
        ModelSource(cfg.source),
        DType(cfg.dtype),
    )
    return cfg


def save_batches(path: Path, batches: list[dict[str, torch.Tensor]]) -> None:
    """Microbatches for an owner process (`mb{i}.<key>`)."""
    save_file(
        {f"mb{i}.{k}": t.contiguous() for i, b in enumerate(batches) for k, t in b.items()},
        str(path),
    )


def load_batches(path: Path) -> list[dict[str, torch.Tensor]]:
    flat = load_file(str(path))
    out: dict[int, dict[str, torch.Tensor]] = {}
    for key, tensor in flat.items():
        index, name = key.split(".", 1)
        out.setdefault(int(index[2:]), {})[name] = tensor
    return [out[i] for i in sorted(out)]


def control_endpoint(spec: NodeSpec) -> ControlEndpoint:
    """The control bus: RabbitMQ at `control.url`, or the embedded bus the environment names."""
    control = spec.control or {"name": "embedded"}
    if control.get("name", "embedded") == "rabbitmq":
        bus = make_bus(
            "rabbitmq", url=control["url"], session=spec.session, node_id=spec.name,
            timeout_s=spec.timeout_s, heartbeat_s=int(control.get("heartbeat_s", 30)),
            prefetch=int(control.get("prefetch", 32)),
        )  # fmt: skip
    else:
        address = EmbeddedAddress.from_env()
        bus = make_bus(
            "embedded", host=address.host, port=address.port, authkey=address.authkey,
            session=spec.session, node_id=spec.name, timeout_s=spec.timeout_s,
        )  # fmt: skip
    return ControlEndpoint(bus)


def data_transport(spec: NodeSpec, key_hex: str) -> Transport:
    """The data plane: TCP (HMAC on the session key) or tensors over AMQP."""
    cfg = spec.transport or {"name": "tcp"}
    if cfg.get("name", "tcp") == "rabbitmq":
        from splitlab.wire.amqp import AmqpTransport

        return AmqpTransport(
            spec.name, session=spec.session, url=cfg["url"], timeout_s=spec.timeout_s,
            pool_bytes=int(cfg.get("pool_bytes", 256 << 20)),
        )  # fmt: skip
    if not key_hex:
        raise ConfigError(
            f"{spec.name}: no data-plane key (START carried none, ${DATA_KEY_ENV} unset)"
        )
    broker = None
    if spec.control and spec.control.get("name") == "rabbitmq":
        broker = urlparse(spec.control["url"]).hostname
    return TcpTransport(
        spec.name, key=bytes.fromhex(key_hex), session=spec.session,
        bind_host=cfg.get("bind_host", "127.0.0.1"), port=int(cfg.get("port", 0)),
        advertise_host=cfg.get("advertise_host"), broker_host=broker,
        pool_bytes=int(cfg.get("pool_bytes", 256 << 20)),
        max_frame_bytes=cfg.get("max_frame_bytes"),
    )  # fmt: skip


def sft_config(data: dict[str, Any] | None) -> SftConfig:
    """The spec's low-rank cut settings (disabled when the spec carries none)."""
    if data is None:
        return SftConfig(enabled=False)
    cfg = SftConfig(**data)
    cfg.residual, cfg.cuts = ResidualMode(cfg.residual), SftCut(cfg.cuts)
    return cfg


def node_plan(spec: NodeSpec) -> PartitionPlan:
    """U-shape (front, body, tail) or two-stage (first, last) over the spec's model."""
    layers = spec.model["num_layers"]
    if spec.architecture == TWO_STAGE:
        return two_stage_plan(num_layers=layers, cut_layers=spec.cut_layers)
    return u_shape_plan(num_layers=layers, cut_layers=spec.cut_layers, tail_blocks=spec.tail_blocks)


def build_node_parts(spec: NodeSpec, tokenizer: list[Any] | None = None) -> tuple[Part, ...]:
    """Every process builds the same replica: same seed, same order of random draws (model,
    then the SVD of a low-rank cut, then LoRA adapters on every part), whatever its role. With
    `tokenizer` (a list) the model's tokenizer is loaded and appended to it."""
    torch.manual_seed(spec.seed)
    model, tok = load_model(model_config(spec.model), load_tokenizer=tokenizer is not None)
    if tokenizer is not None:
        tokenizer.append(tok)
    model.to(torch.device(spec.device))
    lora = LoraConfig(**spec.lora) if spec.lora is not None else None
    return build_training_parts(model, node_plan(spec), sft=sft_config(spec.sft), lora=lora)


def node_exchange(spec: NodeSpec) -> Exchange:
    method = FinetuneMethod.full if spec.lora is None else FinetuneMethod.lora
    return exchange_for(method, merge_for_fedavg=spec.merge_for_fedavg)


def node_tracer(spec: NodeSpec) -> Tracer:
    if not spec.trace_dir:
        return Tracer.null()
    path = Path(spec.trace_dir) / f"{spec.role}-{spec.rank}.jsonl"  # DESIGN: <role>-<rank>
    return Tracer.open(path, role=spec.role, rank=spec.rank)


def transport_bytes(transport: Transport) -> int:
    """Data-plane payload bytes sent and received so far."""
    counters = transport.counters()
    return sum(int(v) for k, v in counters.items() if k.endswith((".bytes_sent", ".bytes_recv")))


def adamw(spec: NodeSpec, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=spec.lr, weight_decay=spec.weight_decay, eps=spec.eps)


def owner_feed(spec: NodeSpec, tokenizer: Any) -> OwnerFeed | None:
    """An owner's real data, per round (None without `spec.data`: fixed or no microbatches)."""
    if spec.data is None:
        return None
    return OwnerFeed(
        data_config(spec.data), tokenizer, owner_index=spec.rank, num_owners=len(spec.owners),
        batch_size=spec.batch_size, steps_per_round=spec.steps_per_round, seed=spec.seed,
        device=spec.device,
    )  # fmt: skip


def startup_timeout(spec: NodeSpec) -> float:
    """How long a node waits for its peers to start (they load models first)."""
    return spec.startup_timeout_s or spec.timeout_s
