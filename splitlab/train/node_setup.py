"""What every training role builds from its `TrainRole`: parts, control bus, data plane, tracer.

Every process builds the same replica (`build_node_parts`: same seed, same order of random
draws), whatever its role, so FedAvg and checkpoints agree on key names.

    .venv/bin/pytest tests/equivalence/test_train_processes.py -q
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch
from safetensors.torch import load_file, save_file

from splitlab.config.enums import DType, FinetuneMethod
from splitlab.config.schema import TwoStageConfig
from splitlab.control.bus import bus_kind, open_bus
from splitlab.control.embedded import BUS_PEER
from splitlab.control.endpoint import ControlEndpoint
from splitlab.errors import ConfigError
from splitlab.models.load import load_model
from splitlab.models.parts import Part
from splitlab.models.plan import PartitionPlan, two_stage_plan, u_shape_plan
from splitlab.telemetry.records import ControlLinkRecord, TransportRecord
from splitlab.telemetry.trace import Tracer
from splitlab.testbed.placement import node_delay_line
from splitlab.testbed.topology import topology_from_config
from splitlab.train.exchange import Exchange, exchange_for
from splitlab.train.feed import OwnerFeed
from splitlab.train.optim import adamw as build_adamw
from splitlab.train.parts import build_training_parts
from splitlab.train.role import COORDINATOR, TrainRole
from splitlab.wire.base import Transport
from splitlab.wire.delay import DELAY_SOURCE
from splitlab.wire.registry import TransportFacts, open_transport
from splitlab.wire.session_key import own_node_key


def save_batches(path: Path, batches: list[dict[str, torch.Tensor]]) -> None:
    """Microbatches for an owner process (`mb{i}.<key>`)."""
    save_file(
        {f"mb{i}.{k}": t.contiguous() for i, b in enumerate(batches) for k, t in b.items()},
        str(path),
    )


def load_batches(path: Path | None) -> list[dict[str, torch.Tensor]]:
    """The microbatches `save_batches` wrote (none without a path)."""
    if path is None:
        return []
    flat = load_file(str(path))
    out: dict[int, dict[str, torch.Tensor]] = {}
    for key, tensor in flat.items():
        index, name = key.split(".", 1)
        out.setdefault(int(index[2:]), {})[name] = tensor
    return [out[i] for i in sorted(out)]


def control_endpoint(role: TrainRole) -> ControlEndpoint:
    """The control bus `control.name` names, from the bus registry; the embedded one at the
    node's `--control` address, authenticated with this node's own key (`own_node_key`),
    through the delay line of the path to the coordinator's host on a testbed (control
    crosses the links as data does; the broker's relay delays RabbitMQ's bytes,
    `splitlab.testbed.relay`)."""
    cfg = role.control
    peers = [*role.owners, *role.workers, *([role.coordinator] if role.coordinator else [])]
    if cfg.name != "embedded":
        return ControlEndpoint(open_bus(cfg, session=role.session, node_id=role.name,
                                        timeout_s=role.timeout_s), peers=peers)  # fmt: skip
    if role.control_address is None:
        raise ConfigError(
            f"{role.name}: control=embedded needs the bus address (--control HOST:PORT)"
        )
    host, port = role.control_address
    delay = node_delay_line(role.testbed, role.role, role.rank, {BUS_PEER: (COORDINATOR, 0)},
                            seed=role.seed) if role.coordinator else None  # fmt: skip
    bus = bus_kind(cfg.name).connect(
        session=role.session, node_id=role.name, timeout_s=role.timeout_s, host=host, port=port,
        credential=own_node_key(role.name), prefetch=cfg.prefetch, delay=delay,
    )  # fmt: skip
    return ControlEndpoint(bus, peers=peers)


def control_record(role: TrainRole, control: ControlEndpoint) -> ControlLinkRecord:
    """Where this node's control messages got their delay (none off a testbed)."""
    delay = getattr(control.bus, "delay", None)
    if delay is not None:
        return ControlLinkRecord(bus=role.control.name, via="bus delay line", **delay.describe())
    topology = topology_from_config(role.testbed)
    if role.control.name != "rabbitmq" or topology.empty:
        return ControlLinkRecord(bus=role.control.name)
    link = topology.links[topology.host_of(role.role, role.rank)]
    return ControlLinkRecord(bus=role.control.name, via="broker relay",
                             delay_source=DELAY_SOURCE if link.delay_ms > 0 else None,
                             delay_ms=link.delay_ms, jitter_ms=link.jitter_ms)  # fmt: skip


def data_transport(role: TrainRole, key_hex: str) -> Transport:
    """The data plane `transport.name` names, from the transport registry; on a testbed whose
    paths have a delay, with the delay line of this node's host (`node_delay_line`)."""
    control = role.control
    broker = urlparse(control.url).hostname if control.name == "rabbitmq" else None
    peers = {name: ("owner", i) for i, name in enumerate(role.owners)}
    peers |= {name: ("worker", j) for j, name in enumerate(role.workers)}
    delay = node_delay_line(role.testbed, role.role, role.rank, peers, seed=role.seed)
    facts = TransportFacts(node_id=role.name, session=role.session, key=bytes.fromhex(key_hex),
                           timeout_s=role.timeout_s, broker_host=broker, delay=delay)  # fmt: skip
    return open_transport(role.transport, facts)


def transport_record(transport: Transport) -> TransportRecord:
    """The transport's cumulative counters, and where its delay came from (a delay line)."""
    delay = getattr(transport, "delay", None)
    return TransportRecord(counters=transport.counters(),
                           **(delay.describe() if delay is not None else {}))  # fmt: skip


def node_plan(role: TrainRole) -> PartitionPlan:
    """U-shape (front, body, tail) or two-stage (first, last) over the role's model."""
    layers, arch = role.model.num_layers, role.arch
    if isinstance(arch, TwoStageConfig):
        return two_stage_plan(num_layers=layers, cut_layers=arch.cut_layers)
    return u_shape_plan(num_layers=layers, cut_layers=arch.cut_layers, tail_blocks=arch.tail_blocks)


def build_node_parts(role: TrainRole, tokenizer: list[Any] | None = None) -> tuple[Part, ...]:
    """Every process builds the same replica: same seed, same order of random draws (model,
    then the SVD of a low-rank cut, then LoRA adapters on every part), whatever its role. With
    `tokenizer` (a list) the model's tokenizer is loaded and appended to it."""
    torch.manual_seed(role.seed)
    model, tok = load_model(role.model, load_tokenizer=tokenizer is not None)
    if tokenizer is not None:
        tokenizer.append(tok)
    model.to(torch.device(role.device))
    return build_training_parts(model, node_plan(role), sft=role.finetune.sft, lora=role.lora)


def node_exchange(role: TrainRole) -> Exchange:
    method = FinetuneMethod.full if role.lora is None else FinetuneMethod.lora
    return exchange_for(method, merge_for_fedavg=role.finetune.merge_for_fedavg)


def node_tracer(role: TrainRole) -> Tracer:
    if role.trace_dir is None:
        return Tracer.null()
    path = role.trace_dir / f"{role.role}-{role.rank}.jsonl"  # DESIGN: <role>-<rank>
    return Tracer.open(path, role=role.role, rank=role.rank)


def transport_bytes(transport: Transport) -> int:
    """Data-plane payload bytes sent and received so far."""
    counters = transport.counters()
    return sum(int(v) for k, v in counters.items() if k.endswith((".bytes_sent", ".bytes_recv")))


def adamw(role: TrainRole, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    ft = role.finetune
    return build_adamw(params, lr=ft.lr, weight_decay=ft.weight_decay, eps=ft.eps)


def compute_dtype(role: TrainRole) -> torch.dtype | None:
    """The dtype the node's parts compute in under `torch.autocast` (None: the weights' own),
    from `finetune.compute_dtype` (`autocast_dtype`)."""
    return autocast_dtype(DType(role.finetune.compute_dtype), torch.device(role.device))


def autocast_dtype(choice: DType, device: torch.device) -> torch.dtype | None:
    """bf16 for `bf16`; for `auto`, bf16 on a CPU with AMX tiles (a bf16 matrix unit: the main
    job's windows 1.2x faster, its validation 1.5x) and the weights' own dtype elsewhere (a
    CPU without one emulates bf16, slower than fp32); None (no autocast) for `fp32`."""
    if choice is DType.bf16:
        return torch.bfloat16
    if choice is DType.auto and device.type == "cpu" and _has_amx():
        return torch.bfloat16
    return None


def _has_amx() -> bool:
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)  # torch's own dispatch check
    return bool(probe()) if probe is not None else False


def owner_feed(role: TrainRole, tokenizer: Any) -> OwnerFeed | None:
    """An owner's real data, per round (None without `role.data`: fixture or no batches)."""
    if role.data is None:
        return None
    return OwnerFeed(
        role.data, tokenizer, owner_index=role.rank, num_owners=len(role.owners),
        batch_size=role.finetune.batch_size, steps_per_round=role.task.steps_per_round,
        seed=role.seed, device=role.device,
    )  # fmt: skip
