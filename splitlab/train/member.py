"""What every owner and worker process does around its training, whatever the architecture.

`open_data_plane`: wait for the first START, build the transport (its key derived from the
session key, `data_plane_key`), announce this worker's address (REGISTER) or dial the workers that announced theirs.
`run_rounds`: per START, load the coordinator's weights when asked, train one round (the
architecture's `train_round`), trace it, send the UPDATE for FedAvg, load the average back,
until STOP. Used by `splitlab.train.roles` (U-shape) and `splitlab.train.two_stage_node`.

    .venv/bin/pytest tests/integration/test_finetune_task.py -q
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from splitlab.control.endpoint import ControlEndpoint
from splitlab.control.messages import BusMessage, Kind, Register, Start
from splitlab.telemetry.records import LiveGraphsRecord, RoundRecord, UpdateRecord
from splitlab.telemetry.trace import Tracer
from splitlab.train.coordinator import Idle, receive_merged, send_update, wait_start
from splitlab.train.exchange import Exchange
from splitlab.train.node_setup import data_transport, transport_bytes
from splitlab.train.role import TrainRole
from splitlab.wire.base import Transport
from splitlab.wire.session_key import data_plane_key

log = logging.getLogger(__name__)


@dataclass
class RoundResult:
    num_samples: int  # sequences this node trained on (its FedAvg weight)
    peak_live: int  # most autograd graphs this node held at once
    losses: list[float] = field(default_factory=list)  # training losses seen here
    metrics: dict[str, Any] = field(default_factory=dict)  # e.g. held-out loss and accuracy


TrainRound = Callable[[Start], RoundResult]


def open_data_plane(
    spec: TrainRole, control: ControlEndpoint, *, announce_to: Sequence[str], dial: Sequence[str]
) -> tuple[Start | None, Transport | None, dict[str, BusMessage]]:
    """(the first START, the transport, the REGISTERs of the dialled workers).

    A worker sends REGISTER (its data-plane address and compute weight) to `announce_to`; an
    owner collects those of `dial`, dials them and answers each with its own REGISTER, which
    the worker waits for: so neither starts its first window (and its per-wait `timeout_s`)
    before the other has loaded its model. These waits use `startup_timeout_s`.

    The data plane's key is derived from `$SPLITLAB_SESSION_KEY` and the session id on every
    member, or handed by the launcher as `$SPLITLAB_DATA_KEY` (`data_plane_key`). Without a
    coordinator the START is None; a STOP before any round (a resumed run that is already
    complete) returns (None, None, {}).
    """
    first = None
    wait_s = spec.startup_timeout_s
    if spec.coordinator is not None:
        first = wait_start(control, spec.coordinator, wait_s)
        if first is None:
            return None, None, {}
        control.advance(int(first.plan["first_window"]))  # a resumed run starts further on
    transport = data_transport(spec, data_plane_key(spec.session).hex())
    host, port = transport.address
    log.info("%s: data plane at %s:%d", spec.name, host, port)
    hello = Register(
        session_id=spec.session, sender=spec.name, role=spec.role, host=host, port=port,
        compute_weight=spec.compute_weight,
    )  # fmt: skip
    if announce_to:
        control.send_all(list(announce_to), hello)
    registers = control.collect(Kind.REGISTER, list(dial), wait_s) if dial else {}
    for name, msg in registers.items():
        log.info("%s: dialling %s at %s:%d", spec.name, name, msg.host, msg.port)
        transport.connect(name, msg.host, msg.port)  # type: ignore[attr-defined]
    if dial:
        control.send_all(list(dial), hello)  # connected: the worker may start its windows
    if announce_to:
        control.collect(Kind.REGISTER, list(announce_to), wait_s)
    return first, transport, registers


def run_rounds(
    spec: TrainRole,
    control: ControlEndpoint,
    transport: Transport,
    tracer: Tracer,
    first: Start,
    *,
    modules: Sequence[nn.Module],
    view: nn.Module,
    exchange: Exchange,
    train_round: TrainRound,
    idle: Idle | None = None,
) -> None:
    """Rounds from `first` until the coordinator's STOP (see the module docstring)."""
    assert spec.coordinator is not None
    partition = "owner" if spec.role == "owner" else "body"
    loaders = {"load": exchange.load, "restore": exchange.restore}
    start: Start | None = first
    while start is not None:
        if start.plan.get("load"):
            receive_merged(control, modules, spec.timeout_s, idle, **loaders)
        round_id = start.round_id
        bytes_before = transport_bytes(transport)
        result = train_round(start)
        metrics = dict(result.metrics)
        if result.losses:
            metrics["train_loss"] = sum(result.losses) / len(result.losses)
        metrics["bytes"] = transport_bytes(transport) - bytes_before
        metrics["peak_live_graphs"] = result.peak_live
        tracer.write(LiveGraphsRecord(round=round_id, peak=result.peak_live, node=spec.name))
        if spec.role == "owner":
            tracer.write(RoundRecord(
                round=round_id, owner=spec.name, loss=metrics.get("loss"),
                accuracy=metrics.get("accuracy"), perplexity=metrics.get("perplexity"),
                train_loss=metrics.get("train_loss"), samples=result.num_samples,
                bytes=metrics["bytes"],
            ))  # fmt: skip
        send_update(
            control, spec.coordinator, round_id=round_id, partition=partition,
            state=exchange.export(view), num_samples=result.num_samples, metrics=metrics,
        )  # fmt: skip
        tracer.write(UpdateRecord(round=round_id, num_samples=result.num_samples))
        receive_merged(control, modules, spec.timeout_s, idle, **loaders)
        start = wait_start(control, spec.coordinator, spec.timeout_s, idle)
