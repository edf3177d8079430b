"""Every control message of splitlab: frozen dataclasses with a `kind` tag, one codec.

Two protocols share this module (Petals keeps its wire types in one `data_structures.py`):

- the fine-tuning control bus (`BusMessage`: session, sender, window, microbatch), routed per
  node through a `ControlBus`:
      REGISTER START PLAN OPEN DRAINED COMMIT ABORT UPDATE FAILED STOP
- the ring's window barrier (`BarrierMessage`) over the control star, head <-> stage:
      PROPOSE {epoch, token, cuts, decision}   head -> stage   pre-stage configuration `cuts`
      ACK     {epoch, stage, obs, stats, ...}  stage -> head   ready (with its observation)
      NACK    {epoch, stage, reason}           stage -> head   cannot pre-stage
      BARRIER_COMMIT {epoch, prepare}          head -> stage   apply epoch (after every ACK)
      BARRIER_ABORT  {epoch, reason, fatal, prepare}  head -> stage   drop what was pre-staged
  (`prepare`: the cuts the next barrier will propose, when they move blocks: a stage builds
  the blocks it would receive while the ring decodes the window; None = nothing to prepare)
      CLOSE   {reason}                         head -> stage   no barrier: generation ends
  (the window COMMIT says a worker stepped, the barrier's commits an epoch: two kinds).

Encoding is the wire's one frame (`splitlab.wire.blobs`): `u32 | JSON header | blobs`, the
header's `kind` is the message kind, its `v` the protocol version, its `meta` the fields, and a
message with a byte field (UPDATE's safetensors `weights`) carries it as the payload, never in
base64. Non-finite floats travel as null and a float field reads null back as NaN. `decode`
checks the frame, the version, the kind and every known field (each field's check is resolved
once per class) and its range (`Message.check`: counts >= 0, ports, finite positive
weights), ignores unknown fields (a newer peer may add some) and raises
`ProtocolError` naming the field and value.

    .venv/bin/pytest tests/unit/test_control_messages.py tests/unit/test_barrier_messages.py -q
"""

from __future__ import annotations

import functools
import json
import math
import struct
import types
import typing
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields
from enum import StrEnum
from typing import Any, ClassVar, NamedTuple, Self

from splitlab.errors import ProtocolError
from splitlab.wire.blobs import Blob, decode_blob_frame, encode_blob_frame
from splitlab.wire.errors import FrameError
from splitlab.wire.header import PROTOCOL_VERSION, FrameHeader, parse_header

MAX_MESSAGE_BYTES = 1 << 30  # one UPDATE of a large model fits; anything bigger is refused


class Kind(StrEnum):
    REGISTER = "register"
    START = "start"
    PLAN = "plan"
    OPEN = "open"
    DRAINED = "drained"
    COMMIT = "commit"
    ABORT = "abort"
    UPDATE = "update"
    FAILED = "failed"
    STOP = "stop"
    PROPOSE = "propose"
    ACK = "ack"
    NACK = "nack"
    BARRIER_COMMIT = "barrier_commit"
    BARRIER_ABORT = "barrier_abort"
    CLOSE = "close"


# Kinds scoped to one window: the inbox applies the stale / future window rules to these only.
WINDOW_KINDS: frozenset[Kind] = frozenset({Kind.PLAN, Kind.OPEN, Kind.DRAINED, Kind.COMMIT})


@dataclass(frozen=True, kw_only=True)
class Message:
    """What every message is: a kind, fields checked on the way in, and at most one blob."""

    KIND: ClassVar[Kind]
    BLOB_FIELD: ClassVar[str | None] = None

    @property
    def kind(self) -> Kind:
        return self.KIND

    def fields_dict(self) -> dict[str, Any]:
        """The JSON fields (the blob excluded); tuples become lists."""
        out: dict[str, Any] = {}
        for f in _schema(type(self)):
            value = getattr(self, f.name)
            out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"v": PROTOCOL_VERSION, "kind": self.KIND.value, **self.fields_dict()}

    @classmethod
    def from_dict(cls, data: dict[str, Any], blob: Blob = b"") -> Self:
        """Known fields checked by type; unknown fields ignored; a missing required one named."""
        kwargs: dict[str, Any] = {}
        for f in _schema(cls):
            if f.name not in data:
                if f.required:
                    raise ProtocolError(f"{cls.KIND.value} message: missing field {f.name!r}")
                continue
            kwargs[f.name] = f.checker(data[f.name], f.where)
        if cls.BLOB_FIELD is not None:
            kwargs[cls.BLOB_FIELD] = bytes(blob)
        msg = cls(**kwargs)
        msg.check()
        return msg

    def check(self) -> None:
        """Range checks beyond the types (counts, ports, finite numbers), run at decode;
        raises `ProtocolError` naming the field and value."""

    def _need(self, name: str, ok: bool, what: str) -> None:
        if not ok:
            value = getattr(self, name)
            raise ProtocolError(f"{self.KIND.value}: field {name!r} = {value!r} {what}")

    def _counts(self, *names: str) -> None:
        for name in names:
            self._need(name, getattr(self, name) >= 0, "must be >= 0")


Check = Callable[[Any, str], Any]  # (value, where) -> the value to keep, or ProtocolError


def _bad(value: Any, tp: Any, where: str) -> ProtocolError:
    """Built only for a bad field: a repr of a large value is not free."""
    name = getattr(tp, "__name__", str(tp))
    return ProtocolError(f"{where}: field {where.rsplit('.', 1)[-1]!r} = {value!r} is not {name}")


def _compile(tp: Any) -> Check:
    """A checker for annotation `tp` (JSON types only), built once per field."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return lambda v, where: v
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        if len(inner) != 1 or len(args) != 2:  # pragma: no cover - schema authoring error
            raise TypeError(f"only `X | None` unions are supported, got {tp}")
        check = _compile(inner[0])
        return lambda v, where: None if v is None else check(v, where)
    if tp is float:

        def check_float(v: Any, where: str) -> float:
            if type(v) is float:
                return v
            if v is None:  # how a non-finite float travels
                return math.nan
            if type(v) is int:
                return float(v)
            raise _bad(v, tp, where)

        return check_float
    if tp is int:

        def check_int(v: Any, where: str) -> int:
            if type(v) is not int:
                raise _bad(v, tp, where)
            return v

        return check_int
    if tp in (str, bool):

        def check_exact(v: Any, where: str) -> Any:
            if type(v) is not tp:
                raise _bad(v, tp, where)
            return v

        return check_exact
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        item = _compile(args[0])

        def check_tuple(v: Any, where: str) -> tuple[Any, ...]:
            if type(v) is not list:
                raise _bad(v, tp, where)
            return tuple([item(x, f"{where}[{i}]") for i, x in enumerate(v)])

        return check_tuple
    if origin is list:
        item = _compile(args[0])

        def check_list(v: Any, where: str) -> list[Any]:
            if type(v) is not list:
                raise _bad(v, tp, where)
            return [item(x, f"{where}[{i}]") for i, x in enumerate(v)]

        return check_list
    if origin is dict:
        key, val = _compile(args[0]), _compile(args[1])
        if args == (str, Any):  # the common case: only the keys need a look

            def check_dict_any(v: Any, where: str) -> dict[str, Any]:
                if type(v) is not dict or not all(type(k) is str for k in v):
                    raise _bad(v, tp, where)
                return v

            return check_dict_any

        def check_dict(v: Any, where: str) -> dict[Any, Any]:
            if type(v) is not dict:
                raise _bad(v, tp, where)
            return {key(k, where): val(x, f"{where}[{k!r}]") for k, x in v.items()}

        return check_dict
    raise TypeError(f"unsupported annotation {tp}")  # pragma: no cover - schema authoring error


class _Field(NamedTuple):
    name: str
    where: str  # "kind.name", for errors
    required: bool
    checker: Check


@functools.cache
def _schema(cls: type[Message]) -> tuple[_Field, ...]:
    """The JSON fields of `cls`, each with its checker (`get_type_hints` evaluates every
    annotation string: resolved once per class, not once per message)."""
    hints = typing.get_type_hints(cls)
    return tuple(
        _Field(f.name, f"{cls.KIND.value}.{f.name}",
               f.default is MISSING and f.default_factory is MISSING, _compile(hints[f.name]))
        for f in fields(cls) if f.name != cls.BLOB_FIELD
    )  # fmt: skip


# --- the fine-tuning control bus ------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class BusMessage(Message):
    """Fields every bus message carries. `sender` is the stable node id of the publisher."""

    session_id: str
    sender: str
    window_id: int = 0  # monotonic within a session; 0 for messages not tied to a window
    microbatch_id: int = -1  # -1 where no microbatch is concerned

    def dedup_key(self) -> tuple[Any, ...]:
        """Deliveries with equal keys are the same message delivered twice."""
        return (self.session_id, self.window_id, self.KIND, self.sender, self.microbatch_id)

    def check(self) -> None:
        self._counts("window_id")
        self._need("microbatch_id", self.microbatch_id >= -1, "must be >= -1")


@dataclass(frozen=True, kw_only=True)
class Register(BusMessage):
    """Node -> coordinator: who I am and where my data plane listens."""

    KIND = Kind.REGISTER
    role: str
    compute_weight: float = 1.0
    host: str = ""
    port: int = 0
    incarnation: int = 0  # grows across restarts of the same node id

    @property
    def node_id(self) -> str:
        return self.sender

    def dedup_key(self) -> tuple[Any, ...]:
        return (self.session_id, self.KIND, self.sender, self.incarnation)

    def check(self) -> None:
        super().check()
        w = self.compute_weight
        self._need("compute_weight", math.isfinite(w) and w > 0, "must be finite and > 0")
        self._need("port", 0 <= self.port <= 65535, "is not a TCP port (0-65535)")
        self._counts("incarnation")


@dataclass(frozen=True, kw_only=True)
class Start(BusMessage):
    """Coordinator -> every node: the round begins with this plan and roster. No key rides
    along: each member derives the data plane's from the session key (`data_plane_key`)."""

    KIND = Kind.START
    round_id: int
    plan: dict[str, Any]
    roster: list[dict[str, Any]]

    def dedup_key(self) -> tuple[Any, ...]:
        return (self.session_id, self.round_id, self.KIND, self.sender)

    def check(self) -> None:
        super().check()
        self._counts("round_id")


@dataclass(frozen=True, kw_only=True)
class Plan(BusMessage):
    """Owner -> workers: how many microbatches each worker gets from me in this window."""

    KIND = Kind.PLAN
    counts_by_worker: dict[str, int]
    num_targets: int = 0  # this owner's loss targets in the window (token-weighted objective)

    def check(self) -> None:
        super().check()
        self._counts("num_targets")
        self._need("counts_by_worker", all(n >= 0 for n in self.counts_by_worker.values()),
                   "holds a negative count")  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class Open(BusMessage):
    """Worker -> owners: the window is open; group total and the per-owner credit."""

    KIND = Kind.OPEN
    group_total: int
    credit: int
    group_targets: int = 0  # sum of the PLANs' num_targets (token-weighted objective)

    def check(self) -> None:
        super().check()
        self._counts("group_total", "credit", "group_targets")


@dataclass(frozen=True, kw_only=True)
class Drained(BusMessage):
    """Owner -> workers: all my microbatches of this window finished backward."""

    KIND = Kind.DRAINED
    num_microbatches: int = 0

    def check(self) -> None:
        super().check()
        self._counts("num_microbatches")


@dataclass(frozen=True, kw_only=True)
class Commit(BusMessage):
    """Worker -> owners: I stepped my body replica for this window."""

    KIND = Kind.COMMIT
    num_microbatches: int = 0
    tokens_per_s: float | None = None  # measured body throughput, for adaptive weights

    def check(self) -> None:
        super().check()
        self._counts("num_microbatches")
        rate = self.tokens_per_s
        self._need("tokens_per_s", rate is None or (math.isfinite(rate) and rate >= 0),
                   "must be finite and >= 0")  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class Abort(BusMessage):
    """Anyone -> everyone: the round is over; `cause_node` failed for `reason`."""

    KIND = Kind.ABORT
    reason: str
    cause_node: str


@dataclass(frozen=True, kw_only=True)
class Update(BusMessage):
    """Node -> coordinator at round end: one partition's weights as safetensors bytes."""

    KIND = Kind.UPDATE
    BLOB_FIELD = "weights"
    round_id: int
    num_samples: int
    partition: str  # e.g. "owner" or "body"
    weights: bytes = b""
    metrics: dict[str, Any] = field(default_factory=dict)  # e.g. held-out loss/accuracy, bytes

    def dedup_key(self) -> tuple[Any, ...]:
        return (self.session_id, self.round_id, self.KIND, self.sender, self.partition)

    def check(self) -> None:
        super().check()
        self._counts("round_id", "num_samples")


@dataclass(frozen=True, kw_only=True)
class Failed(BusMessage):
    """Node -> coordinator: I am exiting with this code."""

    KIND = Kind.FAILED
    reason: str
    exit_code: int


@dataclass(frozen=True, kw_only=True)
class Stop(BusMessage):
    """Coordinator -> every node: leave after this round."""

    KIND = Kind.STOP
    reason: str = ""


# --- the ring's window barrier --------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class BarrierMessage(Message):
    """A message of the control star (one connection per stage, so no routing fields)."""


@dataclass(frozen=True, kw_only=True)
class Propose(BarrierMessage):
    KIND = Kind.PROPOSE
    epoch: int
    token: int  # the last token decoded under the current configuration
    cuts: tuple[int, ...]  # the configuration to pre-stage (unchanged = a no-move barrier)
    decision: str = ""  # the planner's reason, for the window record


@dataclass(frozen=True, kw_only=True)
class Ack(BarrierMessage):
    KIND = Kind.ACK
    epoch: int
    stage: int
    obs: dict[str, Any] | None = None  # the drift observation (the four-key contract) or None
    stats: dict[str, Any] = field(default_factory=dict)  # window compute statistics
    prestage_ms: float = 0.0

    def check(self) -> None:
        self._counts("epoch", "stage")


@dataclass(frozen=True, kw_only=True)
class Nack(BarrierMessage):
    KIND = Kind.NACK
    epoch: int
    stage: int
    reason: str

    def check(self) -> None:
        self._counts("epoch", "stage")


@dataclass(frozen=True, kw_only=True)
class BarrierCommit(BarrierMessage):
    """Apply epoch `epoch` (every stage ACKed it)."""

    KIND = Kind.BARRIER_COMMIT
    epoch: int
    prepare: tuple[int, ...] | None = None  # the next barrier's cuts, to build ahead


@dataclass(frozen=True, kw_only=True)
class BarrierAbort(BarrierMessage):
    """Drop what epoch `epoch` pre-staged; `fatal`: a participant was lost, every stage stops."""

    KIND = Kind.BARRIER_ABORT
    epoch: int
    reason: str
    fatal: bool = False
    prepare: tuple[int, ...] | None = None  # the next barrier's cuts, to build ahead


@dataclass(frozen=True, kw_only=True)
class Close(BarrierMessage):
    KIND = Kind.CLOSE
    reason: str = "end"


MESSAGE_TYPES: dict[Kind, type[Message]] = {
    cls.KIND: cls
    for cls in (
        Register, Start, Plan, Open, Drained, Commit, Abort, Update, Failed, Stop,
        Propose, Ack, Nack, BarrierCommit, BarrierAbort, Close,
    )
}  # fmt: skip
_BY_NAME: dict[str, type[Message]] = {k.value: c for k, c in MESSAGE_TYPES.items()}


# --- the codec ------------------------------------------------------------------------------


def _jsonable(value: Any) -> Any:
    """NaN/Inf become null (JSON has no NaN; a float field reads null back as NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def encode_parts(msg: Message) -> list[Blob]:
    """`[prefix+header, blob?]`, for a writer that sends the parts without joining them.

    Raises:
        ProtocolError: the header is over MAX_HEADER_BYTES (named, with its size and the cap),
            or a field holds something JSON cannot carry.
    """
    blobs = {msg.BLOB_FIELD: getattr(msg, msg.BLOB_FIELD)} if msg.BLOB_FIELD else {}
    meta = msg.fields_dict()
    try:
        return encode_blob_frame(msg.KIND.value, meta, blobs)
    except FrameError as exc:
        if exc.field == "header_bytes":
            raise ProtocolError(f"{msg.KIND.value} message: {exc.reason}") from None
        try:  # the rare message with a NaN: walk it once, only then
            return encode_blob_frame(msg.KIND.value, _jsonable(meta), blobs)
        except FrameError as again:
            raise ProtocolError(f"{msg.KIND.value} message: {again.reason}") from None


def frame_meta(msg: Message) -> dict[str, Any]:
    """The header meta that carries `msg` for a transport that builds the frame itself (the
    ring's control lane): its JSON fields, NaN/Inf as null; the frame kind is `msg.KIND`."""
    return _jsonable(msg.fields_dict())


def encode(msg: Message) -> bytes:
    """One frame, as bytes (a queue's message body)."""
    return b"".join(encode_parts(msg))


def from_frame(header: FrameHeader, blobs: dict[str, Any]) -> Message:
    """The message a validated frame header (and its blobs) carries.

    Raises:
        ProtocolError: unknown kind, unexpected blobs, or a bad field (named).
    """
    cls = _BY_NAME.get(header.kind)
    if cls is None:
        raise ProtocolError(f"unknown control message kind {header.kind!r}")
    blob: Blob = b""
    if blobs:
        if cls.BLOB_FIELD is None or set(blobs) != {cls.BLOB_FIELD}:
            raise ProtocolError(
                f"{header.kind} message carries unexpected payload {sorted(blobs)} "
                f"({sum(len(b) for b in blobs.values())} bytes)"
            )
        blob = blobs[cls.BLOB_FIELD]
        if cls is Update and len(blob):
            _check_safetensors(blob, str(header.meta.get("sender")))
    return cls.from_dict(header.meta, blob)


def decode(data: Blob) -> Message:
    """Parse and validate one encoded message; raises `ProtocolError` on anything malformed."""
    header, blobs = decode_blob_frame(data, max_frame_bytes=MAX_MESSAGE_BYTES)
    return from_frame(header, blobs)


def decode_body(header_bytes: Blob) -> Message:
    """One message from the header bytes a stream reader took after the prefix (whose length
    `wire.blobs.header_length` checked): a frame without payload."""
    return from_frame(parse_header(header_bytes, max_frame_bytes=0), {})


def _check_safetensors(blob: Blob, sender: str) -> None:
    """Cheap structural check of a safetensors payload: u64 LE header length + JSON object."""
    (n,) = struct.unpack_from("<Q", blob) if len(blob) >= 8 else (None,)
    if n is None or 8 + n > len(blob):
        raise ProtocolError(
            f"update from {sender!r}: weights are not safetensors (bad header length)"
        )
    try:
        ok = isinstance(json.loads(bytes(blob[8 : 8 + n])), dict)
    except (UnicodeDecodeError, json.JSONDecodeError):
        ok = False
    if not ok:
        raise ProtocolError(f"update from {sender!r}: weights are not safetensors (bad header)")
