"""Every trace record kind: one frozen dataclass per kind, shared by the writers and the analysis.

    .venv/bin/pytest tests/unit/test_telemetry_records.py tests/unit/test_analysis_traces.py -q

Writers call `tracer.write(TokenRecord(...))`; `splitlab.analysis.traces` checks what it reads
against the same classes. One spelling per field name across kinds and studies: a name means
one thing with one type everywhere (`bytes` a payload size, `stage` a ring position,
`part` a two-stage half, `window` a training window id, `round` a federated round's 0-based
index: round 1 of N is `round` 0; what people read, logs, metrics.csv, final_metrics.json and
report.html, shows `round_number(round)`, 1..N). Times carry
`_ms`/`_s`, sizes `_bytes` (or are `bytes`), counts `num_` or a plain noun (`count`, `peak`).

Ring inference (role "stage", rank = ring position; stage 0 is the head): `token`, `stage_meta`,
`links`, `window` (one per control barrier; the head's are the decisions), `migration`.
U-shape and two-stage training: `plan`, `wrr`, `open`, `forward`, `backward`, `microbatch`,
`drained`, `commit`, `step`, `window_profile`, `live_graphs`, `round`, `update`, `validation`;
the coordinator: `round_start`, `fedavg`, `checkpoint`, `round_end`, `abort`, `stop`.
Every process: `transport` (the wire counters' flat snapshot, `<lane>.bytes_sent`, ...).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from splitlab.telemetry.schema import (
    BASE_FIELDS,
    RECORD_TYPES,
    Emit,
    Record,
    check_record,
    field_types,
    register_record,
    required_fields,
    stamp,
)

# The schema's machinery, re-exported: writers and readers import everything from here, which
# also guarantees every kind below is registered before anything is checked.
__all__ = [
    "BASE_FIELDS", "RECORD_TYPES", "Emit", "Record", "check_record", "field_types",
    "register_record", "required_fields", "stamp",
]  # fmt: skip

record = dataclass(frozen=True, kw_only=True)

# --- ring inference ------------------------------------------------------------------------------


@register_record
@record
class TokenRecord(Record):
    """One per stage per decoded token."""

    KIND: ClassVar[str] = "token"
    stage: int
    token: int  # decode step, 0 = prefill; increasing per stage (per `session` when set)
    compute_ms: float  # this stage's blocks for this token
    recv_wait_ms: float  # blocked receiving this token's input
    send_ms: float
    bytes: int  # payload this stage sent: hidden states, or the token id from the tail
    prefill: bool = False
    pos: int | None = None  # first position of this step's input
    num_tokens: int | None = None  # positions in this step's input
    real_ms: float | None = None  # compute before any injected drift
    tpot_ms: float | None = None  # head only: the token's whole trip round the ring
    token_id: int | None = None  # head and tail: the sampled id
    session: str | None = None


@register_record
@record
class StageMetaRecord(Record):
    """Once per stage, after loading its blocks."""

    KIND: ClassVar[str] = "stage_meta"
    stage: int
    host: str  # the address it binds
    peer_host: str | None  # the address it sends to (the next stage)
    start: int | None = None  # blocks [start, stop)
    stop: int | None = None
    base_port: int | None = None
    load_ms: float | None = None
    versions: dict[str, Any] | None = None
    run_id: str | None = None
    loader: str | None = None
    shard_load: dict[str, Any] | None = None
    owned_bytes: int | None = None
    model_folder: str | None = None
    testbed_host: str | None = None  # the testbed host it ran in (testbed.placement.stage)
    drift_applied: str | None = None  # kernel (testbed cgroup/tc) | simulated (sleep) | None


@register_record
@record
class LinksRecord(Record):
    KIND: ClassVar[str] = "links"
    up: str  # host:port this stage receives from
    down: str  # host:port it sends to


@register_record
@record
class WindowRecord(Record):
    """One per control barrier per stage; the head's (rank 0) carry the decision."""

    KIND: ClassVar[str] = "window"
    epoch: int
    aborted: bool
    decision: str
    barrier_ms: float | None  # None when a lost stage ended the barrier
    prestage_ms: float | None
    commit_ms: float | None
    token: int | None = None  # the decode step the barrier ran after
    n_acks: int | None = None  # head only
    release_ms: float = 0.0  # the donor's post-commit release, off the token path
    obs: dict[str, Any] | None = None  # head: by stage; others: their own
    cuts: list[int] | None = None  # after the barrier
    answer_ms: dict[str, float] | None = None  # head: PROPOSE sent -> each stage's answer read
    stats: dict[str, Any] | None = None  # head: each stage's window statistics
    predicted_ms: list[float] | None = None  # head: the planner's prediction
    wait_ms: float | None = None  # others: idle before PROPOSE arrived
    ack_ms: float | None = None
    reply_wait_ms: float | None = None
    gc_ms: float | None = None
    nack: bool | None = None
    # this stage's testbed host as its kernel reported it last (drift=live on a testbed:
    # `splitlab.drift.host_kernel`): link rate, bytes, drops, CPU quota, throttling
    kernel: dict[str, Any] | None = None


@register_record
@record
class MigrationRecord(Record):
    """One per committed move per side (donor and receiver both write one)."""

    KIND: ClassVar[str] = "migration"
    epoch: int
    boundary: int
    k: int  # blocks moved
    side: str  # "donor" or "receiver"
    layer_ids: list[int]
    weights_ms: float
    kv_ms: float
    commit_ms: float
    pause_ms: float
    kv_bytes: int
    token: int | None = None
    kv_bytes_per_block_token: int | None = None
    release_ms: float = 0.0
    prepared: bool = False  # receiver: weights built ahead, while the ring decoded
    prepare_ms: float = 0.0  # receiver: that background build (not part of pause_ms)
    kv_frames: int = 0  # the KV's frames, sent or received (splitlab.infer.kv_chunks)
    kv_stale_frames: int = 0  # receiver: frames of an aborted epoch dropped before them


# --- training ------------------------------------------------------------------------------------


@register_record
@record
class PlanRecord(Record):
    KIND: ClassVar[str] = "plan"
    window: int
    owner: str
    counts_by_worker: dict[str, int]


@register_record
@record
class WrrRecord(Record):
    """One per (window, owner, worker): the weighted round robin's allocation."""

    KIND: ClassVar[str] = "wrr"
    window: int
    owner: str
    worker: str
    count: int


@register_record
@record
class OpenRecord(Record):
    KIND: ClassVar[str] = "open"
    window: int
    worker: str
    group_total: int
    credit: int


@record
class _MicrobatchEvent(Record):
    window: int
    microbatch: int
    owner: str | None = None  # U-shape
    worker: str | None = None  # U-shape
    part: str | None = None  # two-stage: "first" or "last"


@register_record
@record
class ForwardRecord(_MicrobatchEvent):
    KIND: ClassVar[str] = "forward"


@register_record
@record
class BackwardRecord(_MicrobatchEvent):
    KIND: ClassVar[str] = "backward"


@register_record
@record
class MicrobatchRecord(Record):
    """One per microbatch per lane at the owner: what crossed the wire."""

    KIND: ClassVar[str] = "microbatch"
    window: int
    microbatch: int
    owner: str
    worker: str
    lane: str
    bytes: int
    fwd_ms: float | None = None
    bwd_ms: float | None = None


@register_record
@record
class DrainedRecord(Record):
    KIND: ClassVar[str] = "drained"
    window: int
    owner: str
    num_microbatches: int


@register_record
@record
class CommitRecord(Record):
    KIND: ClassVar[str] = "commit"
    window: int
    worker: str
    num_microbatches: int
    tokens_per_s: float | None


@register_record
@record
class StepRecord(Record):
    """An optimizer step: per window (owners, first part), per microbatch (last part)."""

    KIND: ClassVar[str] = "step"
    window: int | None = None
    microbatch: int | None = None
    owner: str | None = None
    part: str | None = None
    num_microbatches: int | None = None


@register_record
@record
class WindowProfileRecord(Record):
    KIND: ClassVar[str] = "window_profile"
    SPREAD: ClassVar[str] = "phases"
    window: int
    node: str
    num_microbatches: int
    phases: dict[str, float] = field(default_factory=dict)  # `<phase>_ms`, wall_ms, cpu_ms


@register_record
@record
class LiveGraphsRecord(Record):
    KIND: ClassVar[str] = "live_graphs"
    round: int
    node: str
    peak: int  # most autograd graphs alive at once


def round_number(index: int) -> int:
    """The round as people read it (1..N) for a trace's 0-based `round` index."""
    return index + 1


@register_record
@record
class RoundRecord(Record):
    """One per owner per round: its local metrics before FedAvg."""

    KIND: ClassVar[str] = "round"
    round: int
    owner: str
    samples: int
    bytes: int  # sent and received over the round
    loss: float | None
    accuracy: float | None
    perplexity: float | None
    train_loss: float | None = None


@register_record
@record
class UpdateRecord(Record):
    KIND: ClassVar[str] = "update"
    round: int
    num_samples: int


@register_record
@record
class ValidationRecord(Record):
    KIND: ClassVar[str] = "validation"
    round: int
    worker: str  # the worker that ran the body
    val_samples: int
    val_loss: float | None
    val_accuracy: float | None = None
    val_perplexity: float | None = None


# --- coordinator ---------------------------------------------------------------------------------


@register_record
@record
class RoundStartRecord(Record):
    KIND: ClassVar[str] = "round_start"
    round: int
    resumed: bool
    first_window: int
    num_windows: int
    load: bool


@register_record
@record
class FedavgRecord(Record):
    KIND: ClassVar[str] = "fedavg"
    round: int
    node: str
    partition: str
    weight: int  # samples the node processed
    metrics: dict[str, Any]


@register_record
@record
class CheckpointRecord(Record):
    KIND: ClassVar[str] = "checkpoint"
    round: int
    path: str
    num_tensors: int


@register_record
@record
class RoundEndRecord(Record):
    KIND: ClassVar[str] = "round_end"
    round: int
    round_s: float


@register_record
@record
class AbortRecord(Record):
    KIND: ClassVar[str] = "abort"
    reason: str


@register_record
@record
class StopRecord(Record):
    KIND: ClassVar[str] = "stop"
    num_rounds: int


# --- every process -------------------------------------------------------------------------------


@register_record
@record
class TransportRecord(Record):
    """Wire counters, cumulative: `<lane>.<frames|bytes>_<sent|recv>`, pool and copy figures."""

    KIND: ClassVar[str] = "transport"
    SPREAD: ClassVar[str] = "counters"
    transport: str | None = None
    peer: str | None = None
    counters: dict[str, Any] = field(default_factory=dict)
    delay_source: str | None = None  # "transport" (a delay line) or "kernel" (netem)
    delay_ms: float | None = None  # the delay line's default one-way delay
    jitter_ms: float | None = None
    path_delay_ms: dict[str, Any] | None = None  # per peer, where a path's delay differs
    held_ms: dict[str, Any] | None = None  # per peer: frames, mean_ms, min_ms held (measured)


@register_record
@record
class ControlLinkRecord(Record):
    """Where a node's control messages got their path delay: on a testbed whose kernel has no
    netem, the embedded bus's delay line (its measured `held_ms`) or the broker relay."""

    KIND: ClassVar[str] = "control_link"
    bus: str | None = None  # control.name: embedded or rabbitmq
    via: str | None = None  # "bus delay line" or "broker relay"
    delay_source: str | None = None  # "transport" (a delay line) or "kernel" (netem); None: none
    delay_ms: float | None = None  # the line's default one-way delay (relay: this host's link)
    jitter_ms: float | None = None
    path_delay_ms: dict[str, Any] | None = None  # per peer (the bus: "bus")
    held_ms: dict[str, Any] | None = None  # per peer: frames, mean_ms, min_ms held (measured)
