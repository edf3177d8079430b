"""One U-shape training node as its own process: coordinator, owner or worker, from a JSON spec.

    python -m splitlab.train.process SPEC.json

The spec names the node, its group, the model (random init from a seed, so every process
builds the same weights), the partition, the optimizer, the scheduler limits and, for an
owner, a safetensors file of its microbatches. The control bus address comes from the
environment (`EmbeddedAddress.to_env`), as does the data-plane key (`SPLITLAB_DATA_KEY`, hex),
so no secret is on a command line.

Start-up: a worker opens its TCP listener and sends REGISTER (host, port) to every owner; an
owner collects every worker's REGISTER and dials them. Then the windows run
(`OwnerScheduler` / `WorkerScheduler`), the node writes its partition state (original key
names) to `out_path` and exits 0. With a `coordinator` in the spec, the windows repeat per
round between START and the FedAvg exchange (`splitlab.train.coordinator`) until STOP; the
coordinator writes its per-round FedAvg weights to its `out_path` as JSON. Any failure exits with the error's code (timeout, peer lost,
non-finite, aborted, ...) after telling its peers why.

    .venv/bin/pytest tests/equivalence/test_train_processes.py -q
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Mapping
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
    TaskKind,
)
from splitlab.config.schema import DataConfig, LoraConfig, ModelConfig
from splitlab.control.bus import make_bus
from splitlab.control.embedded import EmbeddedAddress
from splitlab.control.endpoint import ControlEndpoint
from splitlab.control.messages import Kind, Register
from splitlab.errors import ConfigError, ExitCode, SplitlabError
from splitlab.models.load import load_model
from splitlab.models.parts import Part, build_parts, group
from splitlab.models.plan import u_shape_plan
from splitlab.telemetry.trace import Tracer
from splitlab.train.checkpoint import unshared
from splitlab.train.coordinator import (
    Coordinator,
    DenseView,
    receive_merged,
    send_update,
    wait_start,
)
from splitlab.train.exchange import ADAPTERS, Exchange, exchange_for
from splitlab.train.fedavg import merge_partitions
from splitlab.train.feed import OwnerFeed
from splitlab.train.lora import apply_lora
from splitlab.train.nodes import Batch, OwnerNode, WorkerNode, partition_parameters
from splitlab.train.owner import OwnerScheduler, SchedulerSettings
from splitlab.train.protocol import abort_peers
from splitlab.train.remote_eval import serve_validation, validate_owner
from splitlab.train.window import effective_credit, owner_window_counts
from splitlab.train.worker import WorkerScheduler
from splitlab.train.wrr import AdaptiveWeights
from splitlab.wire.base import Transport
from splitlab.wire.tcp import TcpTransport

log = logging.getLogger(__name__)
DATA_KEY_ENV = "SPLITLAB_DATA_KEY"


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


def _control(spec: NodeSpec) -> ControlEndpoint:
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


def _transport(spec: NodeSpec, key_hex: str) -> Transport:
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


def run_node(spec: NodeSpec) -> None:
    """Run one node to its end (see the module docstring)."""
    control = _control(spec)
    try:
        if spec.role == "coordinator":
            coordinator = Coordinator(
                control=control, owners=spec.owners, workers=spec.workers,
                num_windows=spec.num_windows, timeout_s=spec.timeout_s,
                checkpoint_dir=Path(spec.checkpoint_dir) if spec.checkpoint_dir else None,
                dense_view=_dense_view(spec), data_key_hex=os.environ.get(DATA_KEY_ENV) or None,
            )  # fmt: skip
            coordinator.run(rounds=spec.rounds, resume=spec.resume)
            if spec.out_path:
                Path(spec.out_path).write_text(
                    json.dumps(
                        {"fedavg_weights": coordinator.history, "metrics": coordinator.metrics}
                    )
                )
        elif spec.role in ("owner", "worker"):
            try:
                _run_member(spec, control)
            except BaseException as exc:
                if spec.coordinator is not None:  # the coordinator waits for our UPDATE
                    abort_peers(control, [spec.coordinator], exc)
                raise
        else:
            raise ConfigError(f"node spec role={spec.role!r}: coordinator, owner or worker")
    finally:
        control.close()


def _parts(spec: NodeSpec, tokenizer: list[Any] | None = None) -> tuple[Part, Part, Part]:
    """Every process builds the same replica: same seed, same order of random draws (model,
    then LoRA adapters on front, body and tail), whatever its role. With `tokenizer` (a list)
    the model's tokenizer is loaded and appended to it."""
    torch.manual_seed(spec.seed)
    model, tok = load_model(model_config(spec.model), load_tokenizer=tokenizer is not None)
    if tokenizer is not None:
        tokenizer.append(tok)
    model.to(torch.device(spec.device))
    plan = u_shape_plan(
        num_layers=spec.model["num_layers"],
        cut_layers=spec.cut_layers,
        tail_blocks=spec.tail_blocks,
    )
    front, body, tail = build_parts(model, plan)
    if spec.lora is not None:
        apply_lora([front, body, tail], LoraConfig(**spec.lora))
    return front, body, tail


def _exchange(spec: NodeSpec) -> Exchange:
    method = FinetuneMethod.full if spec.lora is None else FinetuneMethod.lora
    return exchange_for(method, merge_for_fedavg=spec.merge_for_fedavg)


def _dense_view(spec: NodeSpec) -> DenseView | None:
    """The coordinator's checkpoint view: averaged adapters need a replica's base to merge into."""
    exchange = _exchange(spec)
    if exchange is not ADAPTERS:
        return None
    parts = _parts(spec)

    def dense(averaged: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        for part in parts:
            exchange.load(part, averaged)
        return merge_partitions(*(exchange.dense(part) for part in parts))

    return dense


def _tracer(spec: NodeSpec) -> Tracer:
    if not spec.trace_dir:
        return Tracer.null()
    path = Path(spec.trace_dir) / f"{spec.role}-{spec.rank}.jsonl"  # DESIGN: <role>-<rank>
    return Tracer.open(path, role=spec.role, rank=spec.rank)


def _bytes(transport: Transport) -> int:
    """Data-plane payload bytes sent and received so far."""
    counters = transport.counters()
    return sum(int(v) for k, v in counters.items() if k.endswith((".bytes_sent", ".bytes_recv")))


def _feed(spec: NodeSpec, tokenizer: Any) -> OwnerFeed | None:
    if spec.data is None:
        return None
    return OwnerFeed(
        data_config(spec.data), tokenizer, owner_index=spec.rank, num_owners=len(spec.owners),
        batch_size=spec.batch_size, steps_per_round=spec.steps_per_round, seed=spec.seed,
        device=spec.device,
    )  # fmt: skip


def _run_member(spec: NodeSpec, control: ControlEndpoint) -> None:
    tokenizer: list[Any] = []
    front, body, tail = _parts(spec, tokenizer if spec.role == "owner" and spec.data else None)
    exchange = _exchange(spec)
    feed = _feed(spec, tokenizer[0] if tokenizer else None)

    def adamw(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=spec.lr, weight_decay=spec.weight_decay, eps=spec.eps)

    settings = SchedulerSettings(
        max_inflight=spec.max_inflight, clip_grad_norm=spec.clip_grad_norm, timeout_s=spec.timeout_s
    )
    tracer = _tracer(spec)
    transport: Transport | None = None
    try:
        first = None
        if spec.coordinator is None:
            key_hex = os.environ.get(DATA_KEY_ENV, "")
        else:  # the data-plane key comes with the first START over the control plane
            first = wait_start(control, spec.coordinator, spec.timeout_s)
            if first is None:
                return  # STOP before any round (e.g. resuming a finished run)
            key_hex = first.data_key_hex or os.environ.get(DATA_KEY_ENV, "")
        transport = _transport(spec, key_hex)
        node: OwnerNode | WorkerNode
        if spec.role == "worker":
            host, port = transport.address
            hello = Register(
                session_id=spec.session, sender=spec.name, role="worker", host=host, port=port,
                compute_weight=spec.compute_weight,
            )  # fmt: skip
            control.send_all(spec.owners, hello)
            node = WorkerNode(spec.name, body, adamw(partition_parameters(body)))
            modules: list[torch.nn.Module] = [body]
            worker = WorkerScheduler(
                node=node, transport=transport, control=control, owners=spec.owners,
                credit=effective_credit(
                    max_inflight=spec.max_inflight, worker_max_inflight=spec.worker_max_inflight,
                    num_owners=len(spec.owners),
                ),
                worker_max_inflight=spec.worker_max_inflight, settings=settings, emit=tracer.emit,
            )  # fmt: skip
            scheduler: OwnerScheduler | WorkerScheduler = worker

            def run_windows(first_window: int, batches: list[Batch]) -> list[float]:
                for offset in range(spec.num_windows):
                    worker.run_window(first_window + offset)
                return []

        else:
            registers = control.collect(Kind.REGISTER, spec.workers, spec.timeout_s)
            for name, msg in registers.items():
                transport.connect(name, msg.host, msg.port)  # type: ignore[attr-defined]
            node = OwnerNode(spec.name, front, tail, adamw(partition_parameters(front, tail)))
            modules = [front, tail]
            announced = {n: float(m.compute_weight) for n, m in registers.items()}  # type: ignore[attr-defined]
            weights = AdaptiveWeights(
                spec.weights or {w: announced.get(w, 1.0) for w in spec.workers},
                adaptive=spec.adaptive_weights,
            )
            owner = OwnerScheduler(
                node=node, transport=transport, control=control, workers=spec.workers,
                weights=weights, settings=settings, emit=tracer.emit,
            )  # fmt: skip
            scheduler = owner

            def run_windows(first_window: int, batches: list[Batch]) -> list[float]:
                counts = owner_window_counts(len(batches), spec.quota, spec.num_windows)
                start, losses = 0, []
                bar = _progress(spec, len(batches), first_window)
                for offset, count in enumerate(counts):
                    chunk = batches[start : start + count]
                    losses += owner.run_window(first_window + offset, chunk)
                    start += count
                    if bar is not None:
                        bar.update(count)
                if bar is not None:
                    bar.close()
                return losses

        idle = None
        if spec.role == "worker":
            idle = lambda: serve_validation(node, transport)  # noqa: E731 - a closure on purpose
        fixed = load_batches(Path(spec.data_path)) if spec.data_path else []
        fixed_val = load_batches(Path(spec.val_path)) if spec.val_path else []
        if spec.coordinator is None:
            run_windows(0, _fit(spec, fixed))
        else:
            partition = "owner" if spec.role == "owner" else "body"
            view = group(modules) if spec.role == "owner" else body  # what FedAvg sees
            loaders = {"load": exchange.load, "restore": exchange.restore}
            start = first
            while start is not None:
                if start.plan.get("load"):
                    receive_merged(control, modules, spec.timeout_s, idle, **loaders)
                node.optimizer = adamw(node.params)  # a round starts from the averaged model
                node.num_samples = 0
                scheduler.peak_live = 0
                bytes_before = _bytes(transport)
                round_id = start.round_id
                batches = feed.round_batches(round_id) if feed is not None else fixed
                if spec.role == "owner":
                    owner.weights.reset()
                    owner.wrr.reset()
                losses = run_windows(int(start.plan["first_window"]), _fit(spec, batches))
                metrics: dict[str, Any] = {}
                if losses:
                    metrics["train_loss"] = sum(losses) / len(losses)
                val_batches = fixed_val
                if feed is not None and spec.validate:
                    val_batches = feed.val_batches(round_id)
                if spec.role == "owner" and val_batches:  # local metrics, before FedAvg
                    ranked = owner.weights.weights()
                    via = max(ranked, key=lambda name: ranked[name])
                    result = validate_owner(node, transport, via, val_batches, spec.timeout_s)
                    tracer.emit("validation", round=round_id, worker=via, **result.to_dict())
                    metrics.update(
                        loss=result.loss, accuracy=result.accuracy, perplexity=result.perplexity,
                        val_samples=result.num_samples,
                    )  # fmt: skip
                metrics["bytes"] = _bytes(transport) - bytes_before
                metrics["peak_live_graphs"] = scheduler.peak_live
                tracer.emit("live_graphs", round=round_id, peak=scheduler.peak_live, node=spec.name)
                if spec.role == "owner":
                    tracer.emit(
                        "round", round=round_id, owner=spec.name, loss=metrics.get("loss"),
                        accuracy=metrics.get("accuracy"), perplexity=metrics.get("perplexity"),
                        train_loss=metrics.get("train_loss"), samples=node.num_samples,
                        bytes=metrics["bytes"],
                    )  # fmt: skip
                send_update(
                    control, spec.coordinator, round_id=round_id, partition=partition,
                    state=exchange.export(view), num_samples=node.num_samples, metrics=metrics,
                )  # fmt: skip
                tracer.emit("update", round=round_id, num_samples=node.num_samples)
                receive_merged(control, modules, spec.timeout_s, idle, **loaders)
                start = wait_start(control, spec.coordinator, spec.timeout_s, idle)
        if spec.out_path:  # original key names, dense (LoRA merged in), whatever the method
            final = exchange.dense(group(modules) if spec.role == "owner" else body)
            save_file(unshared(final), spec.out_path)
    finally:
        if transport is not None:
            tracer.emit("transport", **transport.counters())
            transport.close()
        tracer.close()


def _fit(spec: NodeSpec, batches: list[Batch]) -> list[Batch]:
    """At most what the round's windows hold (every process agreed on `num_windows`)."""
    room = spec.quota * spec.num_windows
    if len(batches) > room:
        log.warning(
            "%s: %d microbatches, the round holds %d (%d windows x %d); the rest wait",
            spec.name, len(batches), room, spec.num_windows, spec.quota,
        )  # fmt: skip
    return batches[:room] if spec.role == "owner" else batches


def _progress(spec: NodeSpec, total: int, first_window: int) -> Any:
    """A tqdm bar over this round's microbatches on an interactive terminal, else None."""
    if not (spec.progress and sys.stderr.isatty()):
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=f"{spec.name} window {first_window}", leave=False)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    spec = NodeSpec.from_json(Path(args[0]).read_text())
    try:
        run_node(spec)
    except SplitlabError as exc:
        log.error("[%s:%s] %s: %s", spec.role, spec.name, type(exc).__name__, exc)
        return int(exc.exit_code)
    except Exception:
        log.exception("[%s:%s] failed", spec.role, spec.name)
        return int(ExitCode.ERROR)
    return 0


if __name__ == "__main__":
    sys.exit(main())
