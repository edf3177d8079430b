"""Control-star messages of the window barrier: frozen dataclasses, JSON, capped at 8 KiB.

The head and every other stage exchange these over one control connection per stage (a star,
separate from the data ring). Encoding: `u32 big-endian length | UTF-8 JSON`, where the JSON is
`to_dict()` with a `kind` tag and the protocol version. `decode` checks the cap, the version,
the kind and the type of every known field, ignores unknown fields (a newer peer may add some)
and raises `ProtocolError` naming the key.

    PROPOSE {epoch, token, cuts, decision}     head -> stage   pre-stage configuration `cuts`
    ACK     {epoch, stage, obs, stats, ...}    stage -> head   ready (with its observation)
    NACK    {epoch, stage, reason}             stage -> head   cannot pre-stage
    COMMIT  {epoch}                            head -> stage   apply epoch (only after every ACK)
    ABORT   {epoch, reason, fatal}             head -> stage   drop what was pre-staged
    CLOSE   {reason}                           head -> stage   no barrier: generation ends

    .venv/bin/pytest tests/unit/test_barrier_messages.py -q
"""

from __future__ import annotations

import functools
import json
import math
import struct
import types
import typing
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, ClassVar, Self

from splitlab.errors import ProtocolError

VERSION = 1
MAX_CTRL_BYTES = 8 * 1024  # one control message, length prefix excluded
_LEN = struct.Struct(">I")
_ENCODER = json.JSONEncoder(separators=(",", ":"), allow_nan=False)  # built once, not per message


def _jsonable(value: Any) -> Any:
    """NaN/Inf become null (JSON has no NaN; the observation contract reads null as NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


@dataclass(frozen=True)
class CtrlMessage:
    KIND: ClassVar[str] = ""

    @property
    def kind(self) -> str:
        return self.KIND

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"v": VERSION, "kind": self.KIND}
        for field_ in _schema(type(self)):
            value = getattr(self, field_.name)
            out[field_.name] = list(value) if isinstance(value, tuple) else value
        return _jsonable(out)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Self:
        """Known fields checked by type; unknown fields ignored; a missing required one named."""
        kwargs: dict[str, Any] = {}
        for field_ in _schema(cls):
            if field_.name not in data:
                if field_.required:
                    raise ProtocolError(f"control {cls.KIND}: missing field {field_.name!r}")
                continue
            kwargs[field_.name] = field_.check(cls.KIND, data[field_.name])
        return cls(**kwargs)


@dataclass(frozen=True)
class _Field:
    """One message field's type, resolved once per class (`get_type_hints` evaluates every
    annotation string: ~0.1 ms a message, on the barrier's critical path)."""

    name: str
    hint: Any  # without Optional
    optional: bool  # None is accepted
    required: bool

    def check(self, kind: str, value: Any) -> Any:
        hint = self.hint
        if value is None and self.optional:
            return None
        if hint is bool:
            ok = isinstance(value, bool)
        elif hint is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif hint is float:
            if value is None:
                return math.nan
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            value = float(value) if ok else value
        elif hint is str:
            ok = isinstance(value, str)
        elif typing.get_origin(hint) is tuple:
            ok = isinstance(value, list) and all(
                isinstance(v, int) and not isinstance(v, bool) for v in value
            )
            value = tuple(value) if ok else value
        elif typing.get_origin(hint) is dict or hint is dict:
            ok = isinstance(value, dict)
        else:
            raise AssertionError(f"unhandled hint {hint}")
        if not ok:  # the message (a repr of the value) is built only for a bad field
            raise ProtocolError(f"control {kind}: field {self.name!r}={value!r} is not a {hint}")
        return value


@functools.cache
def _schema(cls: type[CtrlMessage]) -> tuple[_Field, ...]:
    hints = typing.get_type_hints(cls)
    out = []
    for f in fields(cls):
        hint, optional = hints[f.name], False
        if typing.get_origin(hint) in (types.UnionType, typing.Union):
            optional = type(None) in typing.get_args(hint)
            hint = next(o for o in typing.get_args(hint) if o is not type(None))
        required = f.default is MISSING and f.default_factory is MISSING
        out.append(_Field(f.name, hint, optional, required))
    return tuple(out)


@dataclass(frozen=True)
class Propose(CtrlMessage):
    KIND: ClassVar[str] = "propose"
    epoch: int
    token: int  # the last token decoded under the current configuration
    cuts: tuple[int, ...]  # the configuration to pre-stage (unchanged = a no-move barrier)
    decision: str = ""  # the planner's reason, for the window record


@dataclass(frozen=True)
class Ack(CtrlMessage):
    KIND: ClassVar[str] = "ack"
    epoch: int
    stage: int
    obs: dict[str, Any] | None = None  # the drift observation (the four-key contract) or None
    stats: dict[str, Any] = field(default_factory=dict)  # window compute statistics
    prestage_ms: float = 0.0


@dataclass(frozen=True)
class Nack(CtrlMessage):
    KIND: ClassVar[str] = "nack"
    epoch: int
    stage: int
    reason: str


@dataclass(frozen=True)
class Commit(CtrlMessage):
    KIND: ClassVar[str] = "commit"
    epoch: int


@dataclass(frozen=True)
class Abort(CtrlMessage):
    KIND: ClassVar[str] = "abort"
    epoch: int
    reason: str
    fatal: bool = False  # a participant was lost or timed out: every stage stops after this


@dataclass(frozen=True)
class Close(CtrlMessage):
    KIND: ClassVar[str] = "close"
    reason: str = "end"


KINDS: dict[str, type[CtrlMessage]] = {
    c.KIND: c for c in (Propose, Ack, Nack, Commit, Abort, Close)
}


def encode(msg: CtrlMessage) -> bytes:
    """Length-prefixed JSON.

    Raises:
        ProtocolError: the message is over MAX_CTRL_BYTES (named, with its size).
    """
    body = _ENCODER.encode(msg.to_dict()).encode()
    if len(body) > MAX_CTRL_BYTES:
        raise ProtocolError(
            f"control {msg.KIND} is {len(body)} bytes, over the {MAX_CTRL_BYTES}-byte cap"
        )
    return _LEN.pack(len(body)) + body


def decode_length(prefix: bytes) -> int:
    (n,) = _LEN.unpack(prefix)
    if n > MAX_CTRL_BYTES:
        raise ProtocolError(f"control message announces {n} bytes, over {MAX_CTRL_BYTES}")
    return n


def decode_body(body: bytes) -> CtrlMessage:
    """One message from its JSON body.

    Raises:
        ProtocolError: not JSON, wrong version, unknown kind or a bad field.
    """
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolError(f"control message is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ProtocolError(f"control message must be an object, got {type(data).__name__}")
    if data.get("v") != VERSION:
        raise ProtocolError(f"control message version {data.get('v')!r}, expected {VERSION}")
    cls = KINDS.get(data.get("kind"))  # type: ignore[arg-type]
    if cls is None:
        raise ProtocolError(f"control message kind {data.get('kind')!r} is unknown")
    return cls.from_dict(data)


def decode(frame: bytes) -> CtrlMessage:
    """A whole frame (prefix + body), as `encode` wrote it."""
    if len(frame) < _LEN.size:
        raise ProtocolError("control frame shorter than its length prefix")
    n = decode_length(frame[: _LEN.size])
    if len(frame) != _LEN.size + n:
        raise ProtocolError(f"control frame holds {len(frame) - _LEN.size} bytes, announced {n}")
    return decode_body(frame[_LEN.size :])
