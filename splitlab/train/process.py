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

import torch
from safetensors.torch import load_file, save_file

from splitlab.config.enums import DType, Family, FinetuneMethod, ModelSource
from splitlab.config.schema import LoraConfig, ModelConfig
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
from splitlab.train.lora import apply_lora
from splitlab.train.nodes import OwnerNode, WorkerNode, partition_parameters
from splitlab.train.owner import OwnerScheduler, SchedulerSettings
from splitlab.train.protocol import abort_peers
from splitlab.train.remote_eval import serve_validation, validate_owner
from splitlab.train.window import effective_credit, owner_window_counts
from splitlab.train.worker import WorkerScheduler
from splitlab.train.wrr import AdaptiveWeights
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
    model: dict[str, Any]  # ModelConfig fields (random source)
    out_path: str  # where the partition state goes at the end
    num_windows: int
    quota: int  # microbatches per owner per window
    seed: int = 0  # torch seed before building the model
    cut_layers: int = 1
    tail_blocks: int = 1
    weights: dict[str, float] = field(default_factory=dict)  # worker -> compute weight
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
    trace_dir: str | None = None  # JSONL traces: <trace_dir>/<role>-<name>.jsonl
    val_path: str | None = None  # owners: held-out microbatches, validated before each FedAvg
    lora: dict[str, Any] | None = None  # LoraConfig fields; None = full fine-tuning
    merge_for_fedavg: bool = False  # LoRA: average merged dense weights instead of adapters

    @classmethod
    def from_json(cls, text: str) -> NodeSpec:
        data = json.loads(text)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"node spec: unknown keys {unknown}")
        return cls(**data)


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
    address = EmbeddedAddress.from_env()
    bus = make_bus(
        "embedded", host=address.host, port=address.port, authkey=address.authkey,
        session=spec.session, node_id=spec.name, timeout_s=spec.timeout_s,
    )  # fmt: skip
    return ControlEndpoint(bus)


def run_node(spec: NodeSpec) -> None:
    """Run one node to its end (see the module docstring)."""
    control = _control(spec)
    try:
        if spec.role == "coordinator":
            coordinator = Coordinator(
                control=control, owners=spec.owners, workers=spec.workers,
                num_windows=spec.num_windows, timeout_s=spec.timeout_s,
                checkpoint_dir=Path(spec.checkpoint_dir) if spec.checkpoint_dir else None,
                dense_view=_dense_view(spec),
            )  # fmt: skip
            coordinator.run(rounds=spec.rounds, resume=spec.resume)
            Path(spec.out_path).write_text(json.dumps({"fedavg_weights": coordinator.history}))
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


def _parts(spec: NodeSpec) -> tuple[Part, Part, Part]:
    """Every process builds the same replica: same seed, same order of random draws (model,
    then LoRA adapters on front, body and tail), whatever its role."""
    torch.manual_seed(spec.seed)
    model, _ = load_model(model_config(spec.model), load_tokenizer=False)
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


def _run_member(spec: NodeSpec, control: ControlEndpoint) -> None:
    front, body, tail = _parts(spec)
    exchange = _exchange(spec)

    def adamw(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=spec.lr, weight_decay=spec.weight_decay, eps=spec.eps)

    settings = SchedulerSettings(
        max_inflight=spec.max_inflight, clip_grad_norm=spec.clip_grad_norm, timeout_s=spec.timeout_s
    )
    peers = spec.owners if spec.role == "owner" else spec.workers
    rank = peers.index(spec.name) if spec.name in peers else 0
    tracer = (
        Tracer.open(
            Path(spec.trace_dir) / f"{spec.role}-{spec.name}.jsonl", role=spec.role, rank=rank
        )
        if spec.trace_dir
        else Tracer.null()
    )
    transport = TcpTransport(
        spec.name, key=bytes.fromhex(os.environ[DATA_KEY_ENV]), session=spec.session
    )
    try:
        node: OwnerNode | WorkerNode
        if spec.role == "worker":
            host, port = transport.address
            hello = Register(
                session_id=spec.session, sender=spec.name, role="worker", host=host, port=port
            )
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

            def run_windows(first_window: int) -> None:
                for offset in range(spec.num_windows):
                    worker.run_window(first_window + offset)

        else:
            registers = control.collect(Kind.REGISTER, spec.workers, spec.timeout_s)
            for name, msg in registers.items():
                transport.connect(name, msg.host, msg.port)  # type: ignore[attr-defined]
            batches = load_batches(Path(spec.data_path)) if spec.data_path else []
            node = OwnerNode(spec.name, front, tail, adamw(partition_parameters(front, tail)))
            modules = [front, tail]
            weights = AdaptiveWeights(
                spec.weights or dict.fromkeys(spec.workers, 1.0), adaptive=False
            )
            owner = OwnerScheduler(
                node=node, transport=transport, control=control, workers=spec.workers,
                weights=weights, settings=settings, emit=tracer.emit,
            )  # fmt: skip
            counts = owner_window_counts(len(batches), spec.quota, spec.num_windows)

            def run_windows(first_window: int) -> None:
                start = 0
                for offset, count in enumerate(counts):
                    owner.run_window(first_window + offset, batches[start : start + count])
                    start += count

        idle = None
        if spec.role == "worker":
            idle = lambda: serve_validation(node, transport)  # noqa: E731 - a closure on purpose
        val_batches = load_batches(Path(spec.val_path)) if spec.val_path else []
        if spec.coordinator is None:
            run_windows(0)
        else:
            partition = "owner" if spec.role == "owner" else "body"
            view = group(modules) if spec.role == "owner" else body  # what FedAvg sees
            loaders = {"load": exchange.load, "restore": exchange.restore}
            while (
                start := wait_start(control, spec.coordinator, spec.timeout_s, idle)
            ) is not None:
                if start.plan.get("load"):
                    receive_merged(control, modules, spec.timeout_s, idle, **loaders)
                node.optimizer = adamw(node.params)  # a round starts from the averaged model
                node.num_samples = 0
                if spec.role == "owner":
                    owner.weights.reset()
                    owner.wrr.reset()
                run_windows(int(start.plan["first_window"]))
                if spec.role == "owner" and val_batches:  # local metrics, before FedAvg
                    ranked = owner.weights.weights()
                    via = max(ranked, key=lambda name: ranked[name])
                    metrics = validate_owner(node, transport, via, val_batches, spec.timeout_s)
                    tracer.emit("validation", round=start.round_id, worker=via, **metrics.to_dict())
                send_update(
                    control, spec.coordinator, round_id=start.round_id, partition=partition,
                    state=exchange.export(view), num_samples=node.num_samples,
                )  # fmt: skip
                tracer.emit("update", round=start.round_id, num_samples=node.num_samples)
                receive_merged(control, modules, spec.timeout_s, idle, **loaders)
        # original key names, dense (LoRA merged in), whatever the fine-tuning method
        final = exchange.dense(group(modules) if spec.role == "owner" else body)
        save_file(unshared(final), spec.out_path)
    finally:
        transport.close()
        tracer.close()


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
