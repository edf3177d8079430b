"""One two-stage node process (`architecture=two_stage`): an owner runs the first stage, a
worker the last stage (remaining blocks + head + loss, so labels travel to it).

Owner i trains with worker i mod W. Per round (START .. UPDATE, as in U-shape) the owner runs
its microbatches in windows of `control_count` live first-stage graphs (`FirstStage`, one
step per window) and ends with STAGE_END; the worker serves every owner assigned to it until
each one's STAGE_END (`LastStage`, one step per microbatch). FedAvg averages the first stages
("owner" partitions) and the last stages ("body" partitions) separately. Before STAGE_END the
owner validates on its held-out batches through the last stage (forward only, eval; the last
stage returns each batch's loss and correct count, never logits), so its round record has
held-out loss and accuracy or perplexity like a U-shape owner's, plus the training loss the
last stage returns with each gradient.

    .venv/bin/pytest tests/integration/test_two_stage_nodes.py -q
"""

from __future__ import annotations

from typing import Any

from safetensors.torch import save_file

from splitlab.control.endpoint import ControlEndpoint
from splitlab.control.messages import Start
from splitlab.models.families import INPUT_IDS
from splitlab.telemetry.records import ValidationRecord
from splitlab.train.checkpoint import unshared
from splitlab.train.member import RoundResult, open_data_plane, run_rounds
from splitlab.train.node_setup import (
    adamw,
    build_node_parts,
    control_record,
    load_batches,
    node_exchange,
    node_tracer,
    owner_feed,
    transport_record,
)
from splitlab.train.nodes import partition_parameters
from splitlab.train.role import TrainRole
from splitlab.train.two_stage_net import FirstStage, LastStage, check_untied
from splitlab.wire.base import Transport


def stage_peers(spec: TrainRole) -> list[str]:
    """An owner's last stage ([worker i mod W]) or a worker's owners."""
    if spec.role == "owner":
        return [spec.workers[spec.rank % len(spec.workers)]]
    return [o for i, o in enumerate(spec.owners) if i % len(spec.workers) == spec.rank]


def run_stage(spec: TrainRole, control: ControlEndpoint) -> None:
    """Run one two-stage owner or worker to its end (see the module docstring)."""
    tokenizer: list[Any] = []
    is_owner = spec.role == "owner"
    first_part, last_part = build_node_parts(spec, tokenizer if is_owner and spec.data else None)
    check_untied(first_part, last_part)  # each node builds both from the same model
    part = first_part if is_owner else last_part
    exchange = node_exchange(spec)
    feed = owner_feed(spec, tokenizer[0] if tokenizer else None)
    fixed = load_batches(spec.fixture.batches_path)
    fixed_val = load_batches(spec.fixture.val_batches_path)
    peers = stage_peers(spec)
    tracer = node_tracer(spec)
    transport: Transport | None = None
    try:
        first, transport, _ = open_data_plane(
            spec, control, announce_to=[] if is_owner else peers, dial=peers if is_owner else []
        )
        if transport is None:
            return  # STOP before any round (e.g. resuming a finished run)
        common = {"transport": transport, "clip_grad_norm": spec.finetune.clip_grad_norm,
                  "timeout_s": spec.timeout_s, "emit": tracer.write}  # fmt: skip
        stage: FirstStage | LastStage
        if is_owner:
            stage = FirstStage(
                part=part, optimizer=adamw(spec, partition_parameters(part)), last_stage=peers[0],
                control_count=spec.quota, **common,
            )  # fmt: skip
        else:
            stage = LastStage(
                part=part, optimizer=adamw(spec, partition_parameters(part)), **common
            )

        def train_round(start: Start) -> RoundResult:
            stage.optimizer = adamw(spec, stage.params)  # a round starts from the averaged model
            if isinstance(stage, LastStage):
                stage.num_samples = 0
                losses = stage.serve({owner: None for owner in peers})
                flat = [loss for owner in peers for loss in losses[owner]]
                return RoundResult(stage.num_samples, 1 if flat else 0, flat)
            stage.peak_live = 0
            batches = feed.round_batches(start.round_id) if feed is not None else fixed
            losses = stage.run(batches, first_window=int(start.plan["first_window"]))
            metrics: dict[str, Any] = {}
            validate = feed is not None and spec.task.validate
            val = feed.val_batches(start.round_id) if validate else []
            val = val or fixed_val
            if val:  # local metrics before FedAvg, through the last stage (it has the head)
                result = stage.validate(val)
                tracer.write(
                    ValidationRecord(round=start.round_id, worker=peers[0], **result.to_dict())
                )
                metrics.update(
                    loss=result.loss, accuracy=result.accuracy, perplexity=result.perplexity,
                    val_samples=result.num_samples,
                )  # fmt: skip
            stage.end_round(len(batches))
            samples = sum(int(b[INPUT_IDS].shape[0]) for b in batches)
            return RoundResult(samples, stage.peak_live, losses, metrics)

        if first is not None:
            run_rounds(
                spec, control, transport, tracer, first, modules=[part], view=part,
                exchange=exchange, train_round=train_round,
            )  # fmt: skip
        if spec.fixture.out_path is not None:
            save_file(unshared(exchange.dense(part)), str(spec.fixture.out_path))
    finally:
        if transport is not None:
            tracer.write(transport_record(transport))
            transport.close()
        tracer.write(control_record(spec, control))
        tracer.close()
