"""What each training role does in its process: coordinator, U-shape owner or worker.

`run_train_role` runs one role to its end; `python -m splitlab.node` calls it after reading the
run's config into a `TrainRole` (`splitlab.train.role`). Every process builds the same replica
from the same seed, with the same low-rank cuts and LoRA. The control bus is RabbitMQ
(`control.url`) or the embedded bus at the node's `--control` address; the data-plane key
is derived from `$SPLITLAB_SESSION_KEY` and the session id (or handed as `$SPLITLAB_DATA_KEY`),
so no key crosses the bus and no secret is on a command line.

Start-up (`splitlab.train.member.open_data_plane`): a worker opens its listener and sends
REGISTER (host, port, compute weight) to its owners; an owner dials every worker that
registered and answers with its own REGISTER. Then, U-shape (here): the windows run
(`OwnerScheduler` / `WorkerScheduler`); two-stage: `splitlab.train.two_stage_node`. The windows
repeat per round between START and the FedAvg exchange (`splitlab.train.member.run_rounds`)
until STOP; the coordinator traces its rounds and FedAvg weights. Any failure exits with the
error's code (timeout, peer lost, non-finite, aborted, ...) after telling its peers why.

    .venv/bin/pytest tests/equivalence/test_train_processes.py -q
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

import torch
from safetensors.torch import save_file

from splitlab.config.schema import UShapeConfig
from splitlab.control.endpoint import ControlEndpoint
from splitlab.control.messages import Start
from splitlab.errors import ConfigError
from splitlab.models.parts import group
from splitlab.telemetry.progress import Progress
from splitlab.telemetry.records import ValidationRecord
from splitlab.train.checkpoint import unshared
from splitlab.train.coordinator import Coordinator, DenseView
from splitlab.train.exchange import ADAPTERS
from splitlab.train.fedavg import merge_partitions
from splitlab.train.member import RoundResult, open_data_plane, run_rounds
from splitlab.train.node_setup import (
    adamw,
    build_node_parts,
    compute_dtype,
    control_endpoint,
    control_record,
    load_batches,
    node_exchange,
    node_tracer,
    owner_feed,
    transport_record,
)
from splitlab.train.nodes import Batch, OwnerNode, WorkerNode, partition_parameters
from splitlab.train.owner import OwnerScheduler, SchedulerSettings
from splitlab.train.protocol import abort_peers
from splitlab.train.remote_eval import serve_validation, validate_owner
from splitlab.train.role import TrainRole
from splitlab.train.two_stage_node import run_stage
from splitlab.train.window import effective_credit, owner_window_counts
from splitlab.train.worker import WorkerScheduler
from splitlab.train.wrr import AdaptiveWeights
from splitlab.wire.base import Transport

log = logging.getLogger(__name__)


def run_train_role(spec: TrainRole) -> None:
    """Run one node to its end (see the module docstring)."""
    control = control_endpoint(spec)
    try:
        if spec.role == "coordinator":
            tracer = node_tracer(spec)  # coordinator-0.jsonl: rounds, FedAvg weights, aborts
            coordinator = Coordinator(
                control=control, owners=spec.owners, workers=spec.workers,
                num_windows=spec.num_windows, timeout_s=spec.timeout_s,
                checkpoint_dir=spec.checkpoint_dir, keep_checkpoints=spec.task.keep_checkpoints,
                dense_view=_dense_view(spec),
                emit=tracer.write,
            )  # fmt: skip
            try:
                coordinator.run(rounds=spec.task.rounds, resume=spec.task.resume)
            finally:
                tracer.close()
            if spec.fixture.out_path is not None:
                spec.fixture.out_path.write_text(
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
            raise ConfigError(f"--role={spec.role}: coordinator, owner or worker")
    finally:
        control.close()


def _dense_view(spec: TrainRole) -> DenseView | None:
    """The coordinator's checkpoint view: averaged adapters need a replica's base to merge into."""
    exchange = node_exchange(spec)
    if exchange is not ADAPTERS:
        return None
    parts = build_node_parts(spec)

    def dense(averaged: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        for part in parts:
            exchange.load(part, averaged)
        return merge_partitions(*(exchange.dense(part) for part in parts))

    return dense


def _run_member(spec: TrainRole, control: ControlEndpoint) -> None:
    if spec.two_stage:
        run_stage(spec, control)
        return
    tokenizer: list[Any] = []
    owner_data = spec.role == "owner" and spec.data
    front, body, tail = build_node_parts(spec, tokenizer if owner_data else None)
    exchange = node_exchange(spec)
    feed = owner_feed(spec, tokenizer[0] if tokenizer else None)
    arch = spec.arch
    assert isinstance(arch, UShapeConfig)
    settings = SchedulerSettings(
        max_inflight=arch.max_inflight,
        clip_grad_norm=spec.finetune.clip_grad_norm,
        timeout_s=spec.timeout_s,
        objective=arch.objective,
    )
    tracer = node_tracer(spec)
    transport: Transport | None = None
    try:
        is_worker = spec.role == "worker"
        first, transport, registers = open_data_plane(
            spec, control, announce_to=spec.owners if is_worker else [],
            dial=[] if is_worker else spec.workers,
        )  # fmt: skip
        if transport is None:
            return  # STOP before any round (e.g. resuming a finished run)
        node: OwnerNode | WorkerNode
        if is_worker:
            node = WorkerNode(spec.name, body, adamw(spec, partition_parameters(body)),
                              compute_dtype=compute_dtype(spec))  # fmt: skip
            modules: list[torch.nn.Module] = [body]
            worker = WorkerScheduler(
                node=node, transport=transport, control=control, owners=spec.owners,
                credit=effective_credit(
                    max_inflight=arch.max_inflight, worker_max_inflight=arch.worker_max_inflight,
                    num_owners=len(spec.owners),
                ),
                worker_max_inflight=arch.worker_max_inflight, settings=settings, emit=tracer.write,
            )  # fmt: skip
            scheduler: OwnerScheduler | WorkerScheduler = worker

            def run_windows(first_window: int, batches: list[Batch]) -> list[float]:
                for offset in range(spec.num_windows):
                    worker.run_window(first_window + offset)
                return []

        else:
            node = OwnerNode(spec.name, front, tail, adamw(spec, partition_parameters(front, tail)),
                             compute_dtype=compute_dtype(spec))  # fmt: skip
            modules = [front, tail]
            announced = {n: float(m.compute_weight) for n, m in registers.items()}  # type: ignore[attr-defined]
            weights = AdaptiveWeights(
                {w: announced.get(w, 1.0) for w in spec.workers}, adaptive=arch.adaptive_weights
            )
            owner = OwnerScheduler(
                node=node, transport=transport, control=control, workers=spec.workers,
                weights=weights, settings=settings, emit=tracer.write,
            )  # fmt: skip
            scheduler = owner

            def run_windows(first_window: int, batches: list[Batch]) -> list[float]:
                counts = owner_window_counts(len(batches), spec.quota, spec.num_windows)
                start, losses = 0, []
                # the coordinator logs each round's line: the bar ends silently (logger=None)
                with Progress(f"{spec.name} window {first_window}", total=len(batches),
                              unit="microbatches", enabled=spec.task.progress,
                              logger=None) as bar:  # fmt: skip
                    for offset, count in enumerate(counts):
                        chunk = batches[start : start + count]
                        losses += owner.run_window(first_window + offset, chunk)
                        start += count
                        bar.update(count)
                return losses

        idle = None
        if is_worker:
            idle = lambda: serve_validation(node, transport)  # noqa: E731 - a closure on purpose
        fixed = load_batches(spec.fixture.batches_path)
        fixed_val = load_batches(spec.fixture.val_batches_path)

        def train_round(start: Start) -> RoundResult:
            node.optimizer = adamw(spec, node.params)  # a round starts from the averaged model
            node.num_samples = 0
            scheduler.peak_live = 0
            round_id = start.round_id
            batches = _fit(spec, feed.round_batches(round_id) if feed is not None else fixed)
            if not is_worker:
                owner.weights.reset()
                owner.wrr.reset()
                if not arch.adaptive_weights:  # fixed weights: go on from earlier rounds' picks
                    owner.wrr.assign(round_id * len(batches))
            losses = run_windows(int(start.plan["first_window"]), batches)
            metrics: dict[str, Any] = {}
            val_batches = fixed_val
            if feed is not None and spec.task.validate:
                val_batches = feed.val_batches(round_id)
            if not is_worker and val_batches:  # local metrics, before FedAvg
                ranked = owner.weights.weights()
                via = max(ranked, key=lambda name: ranked[name])
                result = validate_owner(node, transport, via, val_batches, spec.timeout_s)
                tracer.write(ValidationRecord(round=round_id, worker=via, **result.to_dict()))
                metrics.update(
                    loss=result.loss, accuracy=result.accuracy, perplexity=result.perplexity,
                    val_samples=result.num_samples,
                )  # fmt: skip
            return RoundResult(node.num_samples, scheduler.peak_live, losses, metrics)

        if first is None:
            run_windows(0, _fit(spec, fixed))
        else:
            view = group(modules) if not is_worker else body  # what FedAvg sees
            run_rounds(
                spec, control, transport, tracer, first, modules=modules, view=view,
                exchange=exchange, train_round=train_round, idle=idle,
            )  # fmt: skip
        if spec.fixture.out_path is not None:  # original key names, dense, whatever the method
            final = exchange.dense(group(modules) if not is_worker else body)
            save_file(unshared(final), str(spec.fixture.out_path))
    finally:
        if transport is not None:
            tracer.write(transport_record(transport))
            transport.close()
        tracer.write(control_record(spec, control))
        tracer.close()


def _fit(spec: TrainRole, batches: list[Batch]) -> list[Batch]:
    """At most what the round's windows hold (every process agreed on `num_windows`)."""
    room = spec.quota * spec.num_windows
    if len(batches) > room:
        log.warning(
            "%s: %d microbatches, the round holds %d (%d windows x %d); the rest wait",
            spec.name, len(batches), room, spec.num_windows, spec.quota,
        )  # fmt: skip
    return batches[:room] if spec.role == "owner" else batches
