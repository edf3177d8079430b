"""Control-plane messages: frozen dataclasses with a `kind` tag, encoded as JSON, never pickle.

A message from the network is data, not code: `decode` checks the framing, the protocol
version, the kind and the type of every known field, ignores unknown fields (so a newer peer
can add some) and raises `ProtocolError` naming the offending key and value.

Encoding (one layout for every kind, the same shape as the data-plane frame):

    u32 big-endian header length | UTF-8 JSON header | blob bytes

The header is `to_dict()` plus `blob_bytes`; only UPDATE has a blob (its safetensors
`weights`), so a model update never goes through base64.

    .venv/bin/pytest tests/unit/test_control_messages.py -q
"""

from __future__ import annotations

import json
import struct
import types
import typing
from dataclasses import MISSING, dataclass, field, fields
from enum import StrEnum
from typing import Any, ClassVar, Self

from splitlab.errors import ProtocolError

PROTOCOL_VERSION = 1
MAX_HEADER_BYTES = 1 << 20  # START carries the roster and plan; 1 MiB is far above any run
_LEN = struct.Struct(">I")


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


# Kinds scoped to one window: the inbox applies the stale / future window rules to these only.
WINDOW_KINDS: frozenset[Kind] = frozenset({Kind.PLAN, Kind.OPEN, Kind.DRAINED, Kind.COMMIT})


@dataclass(frozen=True, kw_only=True)
class Message:
    """Fields every message carries. `sender` is the stable node id of the publisher."""

    KIND: ClassVar[Kind]
    BLOB_FIELD: ClassVar[str | None] = None

    session_id: str
    sender: str
    window_id: int = 0  # monotonic within a session; 0 for messages not tied to a window
    microbatch_id: int = -1  # -1 where no microbatch is concerned

    @property
    def kind(self) -> Kind:
        return self.KIND

    def dedup_key(self) -> tuple[Any, ...]:
        """Deliveries with equal keys are the same message delivered twice."""
        return (self.session_id, self.window_id, self.KIND, self.sender, self.microbatch_id)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"v": PROTOCOL_VERSION, "kind": self.KIND.value}
        for f in fields(self):
            if f.name != self.BLOB_FIELD:
                out[f.name] = getattr(self, f.name)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any], blob: bytes = b"") -> Self:
        """Build from a decoded header, checking every known field and ignoring unknown ones."""
        hints = typing.get_type_hints(cls)
        kwargs: dict[str, Any] = {}
        for f in fields(cls):
            if f.name == cls.BLOB_FIELD:
                kwargs[f.name] = blob
                continue
            if f.name not in data:
                if f.default is not MISSING or f.default_factory is not MISSING:
                    continue  # optional field: keep the default
                raise ProtocolError(f"{cls.KIND.value} message lacks field {f.name!r}")
            kwargs[f.name] = _checked(data[f.name], hints[f.name], f"{cls.KIND.value}.{f.name}")
        return cls(**kwargs)


def _checked(value: Any, tp: Any, where: str) -> Any:
    """Return `value` if it matches the annotation `tp` (JSON types only), else raise."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        for arg in args:
            try:
                return _checked(value, arg, where)
            except ProtocolError:
                pass
        raise ProtocolError(f"{where}: {value!r} is not {tp}")
    if tp is type(None):
        if value is None:
            return None
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp in (str, bool):
        if isinstance(value, tp):
            return value
    elif origin is dict:
        if isinstance(value, dict):
            return {
                _checked(k, args[0], where): _checked(v, args[1], f"{where}[{k!r}]")
                for k, v in value.items()
            }
    elif origin is list:
        if isinstance(value, list):
            return [_checked(v, args[0], f"{where}[{i}]") for i, v in enumerate(value)]
    else:  # pragma: no cover - a field annotated with a type this codec does not know
        raise TypeError(f"{where}: unsupported annotation {tp}")
    raise ProtocolError(f"{where}: expected {getattr(tp, '__name__', tp)}, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class Register(Message):
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


@dataclass(frozen=True, kw_only=True)
class Start(Message):
    """Coordinator -> every node: the round begins with this plan, roster and data-plane key."""

    KIND = Kind.START
    round_id: int
    plan: dict[str, Any]
    data_key_hex: str  # per-session HMAC key for the data plane, 64 hex digits
    roster: list[dict[str, Any]]

    def dedup_key(self) -> tuple[Any, ...]:
        return (self.session_id, self.round_id, self.KIND, self.sender)


@dataclass(frozen=True, kw_only=True)
class Plan(Message):
    """Owner -> workers: how many microbatches each worker gets from me in this window."""

    KIND = Kind.PLAN
    counts_by_worker: dict[str, int]
    num_targets: int = 0  # this owner's loss targets in the window (token-weighted objective)


@dataclass(frozen=True, kw_only=True)
class Open(Message):
    """Worker -> owners: the window is open; group total and the per-owner credit."""

    KIND = Kind.OPEN
    group_total: int
    credit: int
    group_targets: int = 0  # sum of the PLANs' num_targets (token-weighted objective)


@dataclass(frozen=True, kw_only=True)
class Drained(Message):
    """Owner -> workers: all my microbatches of this window finished backward."""

    KIND = Kind.DRAINED
    num_microbatches: int = 0


@dataclass(frozen=True, kw_only=True)
class Commit(Message):
    """Worker -> owners: I stepped my body replica for this window."""

    KIND = Kind.COMMIT
    num_microbatches: int = 0
    tokens_per_s: float | None = None  # measured body throughput, for adaptive weights


@dataclass(frozen=True, kw_only=True)
class Abort(Message):
    """Anyone -> everyone: the round is over; `cause_node` failed for `reason`."""

    KIND = Kind.ABORT
    reason: str
    cause_node: str


@dataclass(frozen=True, kw_only=True)
class Update(Message):
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


@dataclass(frozen=True, kw_only=True)
class Failed(Message):
    """Node -> coordinator: I am exiting with this code."""

    KIND = Kind.FAILED
    reason: str
    exit_code: int


@dataclass(frozen=True, kw_only=True)
class Stop(Message):
    """Coordinator -> every node: leave after this round."""

    KIND = Kind.STOP
    reason: str = ""


MESSAGE_TYPES: dict[Kind, type[Message]] = {
    cls.KIND: cls
    for cls in (Register, Start, Plan, Open, Drained, Commit, Abort, Update, Failed, Stop)
}


def encode(msg: Message) -> bytes:
    header = msg.to_dict()
    blob = getattr(msg, msg.BLOB_FIELD) if msg.BLOB_FIELD else b""
    header["blob_bytes"] = len(blob)
    raw = json.dumps(header, separators=(",", ":"), allow_nan=False).encode("utf-8")
    if len(raw) > MAX_HEADER_BYTES:
        raise ProtocolError(f"{msg.KIND.value} header is {len(raw)} bytes, over {MAX_HEADER_BYTES}")
    return b"".join((_LEN.pack(len(raw)), raw, blob))


def decode(data: bytes) -> Message:
    """Parse and validate one encoded message; raises `ProtocolError` on anything malformed."""
    if len(data) < _LEN.size:
        raise ProtocolError(
            f"control message of {len(data)} bytes is shorter than its length prefix"
        )
    (header_bytes,) = _LEN.unpack_from(data)
    if header_bytes > MAX_HEADER_BYTES or _LEN.size + header_bytes > len(data):
        raise ProtocolError(
            f"control header length {header_bytes} does not fit a {len(data)}-byte message"
        )
    try:
        header = json.loads(data[_LEN.size : _LEN.size + header_bytes])
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolError(f"control header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise ProtocolError(f"control header must be an object, got {type(header).__name__}")
    version = header.get("v")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"control protocol version {version!r} from sender {header.get('sender')!r}; "
            f"this build speaks {PROTOCOL_VERSION}"
        )
    try:
        kind = Kind(header.get("kind"))
    except ValueError:
        raise ProtocolError(f"unknown control message kind {header.get('kind')!r}") from None
    blob = data[_LEN.size + header_bytes :]
    if header.get("blob_bytes", 0) != len(blob):
        raise ProtocolError(
            f"{kind.value} message announces blob_bytes={header.get('blob_bytes')!r} "
            f"but carries {len(blob)} bytes"
        )
    cls = MESSAGE_TYPES[kind]
    if blob and cls.BLOB_FIELD is None:
        raise ProtocolError(f"{kind.value} message carries {len(blob)} unexpected blob bytes")
    if cls.BLOB_FIELD == "weights" and blob:
        _check_safetensors(blob, str(header.get("sender")))
    return cls.from_dict(header, blob)


def _check_safetensors(blob: bytes, sender: str) -> None:
    """Cheap structural check of a safetensors payload: u64 LE header length + JSON object."""
    (n,) = struct.unpack_from("<Q", blob) if len(blob) >= 8 else (None,)
    if n is None or 8 + n > len(blob):
        raise ProtocolError(
            f"update from {sender!r}: weights are not safetensors (bad header length)"
        )
    try:
        ok = isinstance(json.loads(blob[8 : 8 + n]), dict)
    except (UnicodeDecodeError, json.JSONDecodeError):
        ok = False
    if not ok:
        raise ProtocolError(f"update from {sender!r}: weights are not safetensors (bad header)")
