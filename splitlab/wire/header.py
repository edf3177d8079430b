"""The frame header in its two forms, JSON and binary: types, encoders and validating parsers.

Every frame carries `u32 big-endian length | header (<= 16 KiB)` before its tensor bytes. The
header's fields are `v` (protocol version), `kind`, `lane`, `src`, `prio`, `ids` (routing),
`meta` and `tensors`, a list of `{name, dtype, shape, bytes}`, in one of two forms told apart
by the first byte:

- JSON (`{`): one JSON object, `meta` free JSON. Encoding fills a fixed template (string
  fields escaped by the json C helpers, `meta` and the routing ids through one reusable
  encoder), so a frame costs no dict building.
- binary (`0xB1`, what a data-lane frame whose `meta` values are all integers travels with:
  the ring's hidden states, training's activations and gradients): `0xB1 | u16 n | n static
  bytes | one i64 per integer routing id, then per meta value`. The static bytes hold the rest
  (lane, prio, kind, src, session, which ids are present, the meta keys, each tensor's name,
  dtype and shape; strings as `u8 length | UTF-8`); they repeat from frame to frame, so both
  ends cache them (bounded) and a frame costs one lookup and one pack or unpack of its
  integers, no JSON. JSON costs ~70 us a
  frame on cold caches (a ring stage sends right after its compute has streamed its weights
  through the caches), struct ~15 us (tools/bench_transport.py, `header_cold_us`).

Parsing checks every field (version, kind, lane, src, ids, meta, dtype allow-list, rank 1..8,
dimensions, byte counts, total size before any allocation) and raises a `FrameError` naming
the field and value; a binary header's static bytes are parsed into the JSON form's object
and validated by the same code, once per distinct static part. The encoders and the parser
are views of one schema: the round-trip and fuzz tests in test_wire_frame.py hold them
together. `read_header` reads one header from a stream. Nothing here imports torch (the control
plane reads these frames too); the torch dtype table lives in `frame.py`.

    .venv/bin/pytest tests/unit/test_wire_frame.py -q
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from functools import cached_property
from json.encoder import encode_basestring_ascii as _quote
from typing import TYPE_CHECKING, Any, NamedTuple

from splitlab.wire.errors import FrameError, TruncatedFrameError

if TYPE_CHECKING:
    import torch

PROTOCOL_VERSION = 1
MAX_HEADER_BYTES = 16 * 1024
MAX_RANK = 8
MAX_TENSORS = 64
MAX_DIM = 1 << 40
DEFAULT_MAX_FRAME_BYTES = 1 << 30
PREFIX = struct.Struct(">I")
_I64 = (-(1 << 63), (1 << 63) - 1)

# The dtype allow-list: wire name -> bytes per element (frame.DTYPES maps the names to torch).
DTYPE_ITEMSIZE: dict[str, int] = {
    "float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "int8": 1, "int16": 2,
    "int32": 4, "int64": 8, "uint8": 1, "bool": 1,
}  # fmt: skip
_ITEMSIZE = DTYPE_ITEMSIZE
ROUTING_IDS = ("session", "window", "microbatch", "owner", "worker", "stage", "token")
_INT_IDS = frozenset(ROUTING_IDS[1:])

_ENCODER = json.JSONEncoder(separators=(",", ":"), allow_nan=False)
_DECODER = json.JSONDecoder()


class Lane(StrEnum):
    """Separate sockets, queues and pools, so a full lane never blocks another: a full
    activation lane never blocks a gradient, a multi-megabyte KV migration never delays the
    ring's hidden states, and the control star's small frames never wait behind either."""

    ACTIVATION = "activation"  # forward activations; the ring's hidden states and token ids
    GRADIENT = "gradient"  # backward gradients
    KV = "kv"  # KV cache migrating between neighbouring ring stages
    CONTROL = "control"  # control messages (kind + JSON meta, no tensors)


_LANES = {lane.value: lane for lane in Lane}


@dataclass(frozen=True)
class Routing:
    """Who and where a frame belongs to; any id may be None. `session` is a string."""

    session: str | None = None
    window: int | None = None
    microbatch: int | None = None
    owner: int | None = None
    worker: int | None = None
    stage: int | None = None
    token: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k in ROUTING_IDS if (v := getattr(self, k)) is not None}

    @cached_property
    def ids_json(self) -> str:
        """The `ids` object as JSON (computed once per Routing; senders reuse theirs)."""
        return _ENCODER.encode(self.to_dict())

    @cached_property
    def binary_ids(self) -> tuple[str | None, tuple[str, ...] | None, tuple[int, ...]]:
        """(session, the integer ids present, their values) for the binary header (computed
        once per Routing); names None where an id is not an integer in i64, which only the
        JSON form's parser words."""
        ids = self.to_dict()
        session = ids.pop("session", None)
        ints = tuple(ids.values())
        fit = all(type(v) is int and _I64[0] <= v <= _I64[1] for v in ints)
        return session, tuple(ids) if fit else None, ints


class TensorSpec(NamedTuple):
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int

    @property
    def key(self) -> tuple[torch.dtype, tuple[int, ...]]:
        """(torch dtype, shape): the receive pool's key for this tensor."""
        return _torch_dtypes()[self.dtype], self.shape


_DTYPES: dict[str, torch.dtype] = {}


def _torch_dtypes() -> dict[str, torch.dtype]:
    """frame.DTYPES, imported on first use: torch only where tensors are made."""
    if not _DTYPES:
        from splitlab.wire.frame import DTYPES

        _DTYPES.update(DTYPES)
    return _DTYPES


@dataclass(frozen=True)
class FrameHeader:
    """The JSON header; `tensors` is filled by `encode_frame` from the tensors it sends."""

    kind: str
    lane: Lane = Lane.ACTIVATION
    routing: Routing = field(default_factory=Routing)
    src: str | None = None
    priority: int = 0
    meta: dict[str, Any] = field(default_factory=dict)
    tensors: tuple[TensorSpec, ...] = ()
    version: int = PROTOCOL_VERSION

    def to_dict(self) -> dict[str, Any]:
        return {
            "v": self.version,
            "kind": self.kind,
            "lane": self.lane.value,
            "src": self.src,
            "prio": self.priority,
            "ids": self.routing.to_dict(),
            "meta": self.meta,
            "tensors": [
                {"name": t.name, "dtype": t.dtype, "shape": list(t.shape), "bytes": t.nbytes}
                for t in self.tensors
            ],
        }

    @classmethod
    def from_dict(cls, d: Any, *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> FrameHeader:
        """Validate a decoded JSON header; unknown top-level fields are tolerated."""
        return _validate(d, max_frame_bytes)


def encode_header(kind: str, lane: Lane, routing: Routing, src: str | None, priority: int,
                  meta: dict[str, Any] | None, specs: list[TensorSpec]) -> bytes:  # fmt: skip
    """`u32 length | JSON header` for these fields (what `FrameHeader.to_dict` would give)."""
    lane_name = _LANES.get(lane) if isinstance(lane, str) else None
    if lane_name is None:
        raise FrameError("lane", lane, f"must be one of {[x.value for x in Lane]}")
    try:
        src_json = "null" if src is None else _quote(src)
        prio_json = priority if type(priority) is int else _ENCODER.encode(priority)
        meta_json = _ENCODER.encode(meta) if meta else "{}"
        parts = [
            f'{{"v":{PROTOCOL_VERSION},"kind":{_quote(kind)},"lane":"{lane_name.value}",'
            f'"src":{src_json},"prio":{prio_json},"ids":{routing.ids_json},"meta":{meta_json},'
            '"tensors":['
        ]
        for i, s in enumerate(specs):
            shape = ",".join([str(d) for d in s.shape])
            sep = "," if i else ""
            parts.append(f'{sep}{{"name":{_quote(s.name)},"dtype":"{s.dtype}","shape":[{shape}],'
                         f'"bytes":{s.nbytes}}}')  # fmt: skip
    except (TypeError, ValueError) as exc:  # a non-string name/kind, a NaN or an object in meta
        raise FrameError("header", kind, f"not encodable as the JSON header: {exc}") from None
    parts.append("]}")
    text = "".join(parts).encode()
    if len(text) > MAX_HEADER_BYTES:
        raise FrameError("header_bytes", len(text), f"over the {MAX_HEADER_BYTES}-byte header cap")
    return PREFIX.pack(len(text)) + text


RecvInto = Callable[[memoryview, int], int]


def header_length(prefix: bytes | bytearray | memoryview, max_header_bytes: int = MAX_HEADER_BYTES) -> int:  # fmt: skip
    """The header length a frame's 4-byte prefix announces, checked against the cap."""
    (n,) = PREFIX.unpack_from(prefix)
    if not 0 < n <= max_header_bytes:
        raise FrameError("header_bytes", n, f"must be 1..{max_header_bytes}: over the header cap")
    return n


def recv_exact(recv_into: RecvInto, view: memoryview, *, what: str) -> None:
    """Fill `view` completely; a stream that ends first raises TruncatedFrameError."""
    n = len(view)
    got = 0
    while got < n:
        k = recv_into(view[got:], n - got)
        if not k:
            raise TruncatedFrameError(what, got, f"stream ended after {got} of {n} bytes")
        got += k


def read_header(
    recv_into: RecvInto,
    scratch: bytearray,
    *,
    max_frame_bytes: int,
    have_bytes: int = 0,
    max_header_bytes: int = MAX_HEADER_BYTES,
) -> FrameHeader:
    """Read and validate the length prefix and JSON header (nothing is allocated for tensors).

    `have_bytes` prefix bytes may already sit at the start of `scratch` (a non-blocking probe).
    `max_header_bytes` below the cap bounds what an unauthenticated peer can make us read.
    """
    mv = memoryview(scratch)
    recv_exact(recv_into, mv[have_bytes:4], what="prefix")
    n = header_length(scratch, max_header_bytes)
    recv_exact(recv_into, mv[4 : 4 + n], what="header")
    return parse_header(mv[4 : 4 + n], max_frame_bytes=max_frame_bytes)


def parse_header(text: bytes | bytearray | memoryview, *,
                 max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> FrameHeader:  # fmt: skip
    """Decode and validate the header bytes (without the length prefix), either form."""
    if text and text[0] == BINARY_MAGIC:
        return _parse_binary(text, max_frame_bytes)
    try:
        s = str(text, "utf-8")
        try:  # the C scanner directly; json.loads handles (and words) everything else
            obj, end = _DECODER.scan_once(s, 0)
            if end != len(s):
                raise StopIteration(end)
        except StopIteration:
            obj = json.loads(s)
    except (ValueError, RecursionError) as exc:  # JSON, UTF-8 and int-digit errors are ValueErrors
        raise FrameError("header", bytes(text[:40]), f"not valid JSON: {exc}") from None
    return _validate(obj, max_frame_bytes)


def _validate(d: Any, max_frame_bytes: int) -> FrameHeader:
    if type(d) is not dict:
        raise FrameError("header", type(d).__name__, "must be a JSON object")
    if d.get("v") != PROTOCOL_VERSION or type(d.get("v")) is not int:
        raise FrameError("v", d.get("v"), f"protocol version must be {PROTOCOL_VERSION}")
    kind = d.get("kind")
    if type(kind) is not str or not 0 < len(kind) <= 64:
        raise FrameError("kind", kind, "must be a string of 1..64 characters")
    lane = d.get("lane")
    lane = _LANES.get(lane) if type(lane) is str else None
    if lane is None:
        raise FrameError("lane", d.get("lane"), f"must be one of {[x.value for x in Lane]}")
    src = d.get("src")
    if src is not None and (type(src) is not str or len(src) > 256):
        raise FrameError("src", src, "must be null or a string of <= 256 characters")
    prio = d.get("prio", 0)
    if type(prio) is not int or not _I64[0] <= prio <= _I64[1]:
        raise FrameError("prio", prio, f"must be an integer in [{_I64[0]}, {_I64[1]}]")
    meta = d.get("meta", {})
    if type(meta) is not dict:
        raise FrameError("meta", meta, "must be a JSON object")
    return FrameHeader(kind, lane, _routing(d.get("ids", {})), src, prio, meta,
                       _tensor_specs(d.get("tensors"), max_frame_bytes))  # fmt: skip


_NO_ROUTING = Routing()
# Validated routings by their ids: a stream's frames repeat a few, and a Routing shared between
# them keeps its `ids_json` (a reply reuses it). Bounded: a peer sending ever-new ids only
# refills it.
_ROUTINGS: dict[tuple[tuple[str, Any], ...], Routing] = {}
_MAX_ROUTINGS = 512


def _routing(ids: Any) -> Routing:
    if type(ids) is not dict:
        raise FrameError("ids", ids, "must be a JSON object")
    if not ids:
        return _NO_ROUTING
    values: dict[str, Any] = {}
    for name, v in ids.items():  # unknown ids are tolerated and dropped
        if v is None:
            continue
        if name == "session":
            if type(v) is not str or len(v) > 256:
                raise FrameError("ids.session", v, "must be null or a string of <= 256 characters")
        elif name in _INT_IDS:
            if type(v) is not int or not _I64[0] <= v <= _I64[1]:
                raise FrameError(f"ids.{name}", v, f"must be an integer in [{_I64[0]}, {_I64[1]}]")
        else:
            continue
        values[name] = v
    key = tuple(values.items())  # only exact ints and strings: True and 1 never share a key
    routing = _ROUTINGS.get(key)
    if routing is None:
        if len(_ROUTINGS) >= _MAX_ROUTINGS:
            _ROUTINGS.clear()
        routing = _ROUTINGS[key] = Routing(**values)
    return routing


def _tensor_specs(items: Any, max_frame_bytes: int) -> tuple[TensorSpec, ...]:
    if type(items) is not list or len(items) > MAX_TENSORS:
        raise FrameError("tensors", items, f"must be a list of at most {MAX_TENSORS} entries")
    specs: list[TensorSpec] = []
    names: set[str] = set()
    total = 0
    for i, item in enumerate(items):
        if type(item) is not dict:
            raise FrameError(f"tensors[{i}]", item, "must be a JSON object")
        name, dtype, shape = item.get("name"), item.get("dtype"), item.get("shape")
        if type(name) is not str or not 0 < len(name) <= 128:
            raise FrameError(f"tensors[{i}].name", name, "must be a string of 1..128 characters")
        if name in names:
            raise FrameError(f"tensors[{i}].name", name, "duplicate tensor name")
        itemsize = _ITEMSIZE.get(dtype) if type(dtype) is str else None  # type: ignore[arg-type]
        if itemsize is None:
            raise FrameError(
                f"tensors[{i}].dtype", dtype, f"not in the allow-list {sorted(DTYPE_ITEMSIZE)}"
            )
        if type(shape) is not list or not 1 <= len(shape) <= MAX_RANK:
            raise FrameError(f"tensors[{i}].shape", shape, f"must be a list of 1..{MAX_RANK} dims")
        expected = itemsize
        for d in shape:
            if type(d) is not int or not 0 <= d <= MAX_DIM:
                raise FrameError(f"tensors[{i}].shape", d, f"must be an integer in [0, {MAX_DIM}]")
            expected *= d
        nbytes = item.get("bytes")
        if nbytes != expected or type(nbytes) is not int:
            raise FrameError(
                f"tensors[{i}].bytes", nbytes, f"{dtype}{shape} takes {expected} bytes"
            )
        total += expected
        if total > max_frame_bytes:
            raise FrameError(
                "tensors", total, f"frame payload over max_frame_bytes={max_frame_bytes}"
            )
        names.add(name)
        specs.append(TensorSpec(name, dtype, tuple(shape), expected))
    return tuple(specs)


# --- the binary form (see the module docstring) ------------------------------------------------

BINARY_MAGIC = 0xB1  # a binary header's first byte; a JSON one starts with `{` (0x7B)
_BIN_START = struct.Struct(">BH")  # magic, length of the static bytes
_U8, _U16 = struct.Struct(">B"), struct.Struct(">H")
_I64S, _U64 = struct.Struct(">q"), struct.Struct(">Q")
_LANE_ORDER = tuple(Lane)
_LANE_CODE = {lane: i for i, lane in enumerate(_LANE_ORDER)}
_DTYPE_ORDER = tuple(DTYPE_ITEMSIZE)
_DTYPE_CODE = {name: i for i, name in enumerate(_DTYPE_ORDER)}
_NULL = 0xFF  # a null string (src)
_MAX_CACHED = 256
_UNCAPPED = float("inf")  # a cached static part is valid for any cap: each parse checks its own


class _Static(NamedTuple):
    """A parsed static part: the header without routing and meta, and how to read the rest."""

    header: FrameHeader
    session: str | None
    id_names: tuple[str, ...]  # the integer routing ids present, in ROUTING_IDS order
    keys: tuple[str, ...]  # the meta keys
    values: struct.Struct  # one i64 per integer id, then one per meta key
    payload: int  # the tensors' bytes


# (kind, lane, session, integer id names, src, prio, meta keys, specs) -> (u32 prefix + start +
# static bytes, values) or None (the JSON form carries it); static bytes -> _Static
_ENCODED: dict[tuple[Any, ...], tuple[bytes, struct.Struct] | None] = {}
_PARSED: dict[bytes, _Static] = {}
# (session, integer id names, their values) -> Routing
_BIN_ROUTINGS: dict[tuple[Any, ...], Routing] = {}


class _Unfit(Exception):
    """A field the binary form cannot carry (the JSON form carries the frame)."""


def encode_binary_header(kind: str, lane: Lane, routing: Routing, src: str | None,
                         priority: int, meta: dict[str, Any] | None,
                         specs: list[TensorSpec]) -> bytes | None:  # fmt: skip
    """`u32 length | binary header` for these fields, or None where the JSON form must carry
    them: the control lane (control messages stay JSON), a meta value that is not an integer
    in i64 (bool included), a string over 254 UTF-8 bytes."""
    session, names, ints = routing.binary_ids
    if names is None:
        return None
    if meta:
        for v in meta.values():
            if type(v) is not int or not _I64[0] <= v <= _I64[1]:
                return None
        keys: tuple[str, ...] = tuple(meta)
        ints = (*ints, *meta.values())
    else:
        keys = ()
    key = (kind, lane, session, names, src, priority, keys, tuple(specs))
    try:
        cached = _ENCODED[key]
    except KeyError:
        if len(_ENCODED) >= _MAX_CACHED:
            _ENCODED.clear()
        cached = _ENCODED[key] = _encode_static(key, len(ints))
    except TypeError:  # an unhashable field: the JSON form words what is wrong with it
        return None
    if cached is None:
        return None
    head, values = cached
    return head + values.pack(*ints) if ints else head


def _encode_static(key: tuple[Any, ...], num_ints: int) -> tuple[bytes, struct.Struct] | None:
    kind, lane, session, names, src, priority, keys, specs = key
    code = _LANE_CODE.get(lane)  # a Lane, or its value as a plain string
    if code is None or _LANE_ORDER[code] is Lane.CONTROL or type(priority) is not int:
        return None
    try:
        parts = [_U8.pack(code), _I64S.pack(priority), _str8(kind),
                 b"\xff" if src is None else _str8(src)]  # fmt: skip
        present = set(names) | ({"session"} if session is not None else set())
        parts.append(_U8.pack(sum(1 << i for i, name in enumerate(ROUTING_IDS) if name in present)))
        if session is not None:
            parts.append(_str8(session))
        parts.append(_U8.pack(len(keys)))
        parts += [_str8(k) for k in keys]
        parts.append(_U8.pack(len(specs)))
        for s in specs:
            parts += [_str8(s.name), _U8.pack(_DTYPE_CODE[s.dtype]), _U8.pack(len(s.shape))]
            parts += [_U64.pack(d) for d in s.shape]
    except (_Unfit, KeyError, TypeError, struct.error):
        return None
    static = b"".join(parts)
    values = struct.Struct(f">{num_ints}q")
    size = _BIN_START.size + len(static) + values.size
    if len(static) > 0xFFFF or size > MAX_HEADER_BYTES:
        return None
    return PREFIX.pack(size) + _BIN_START.pack(BINARY_MAGIC, len(static)) + static, values


def _str8(text: Any) -> bytes:
    if type(text) is not str:
        raise _Unfit
    b = text.encode()
    if len(b) >= _NULL:
        raise _Unfit
    return _U8.pack(len(b)) + b


def _parse_binary(text: bytes | bytearray | memoryview, max_frame_bytes: int) -> FrameHeader:
    n = len(text)
    if n < _BIN_START.size:
        raise FrameError("header_bytes", n, "a binary header starts with 3 bytes")
    (size,) = _U16.unpack_from(text, 1)
    end = _BIN_START.size + size
    if end > n:
        raise FrameError("header_bytes", n, f"the binary header announces {size} static bytes")
    static = bytes(text[_BIN_START.size : end])
    st = _PARSED.get(static)
    if st is None:
        st = _parse_static(static)
        if len(_PARSED) >= _MAX_CACHED:
            _PARSED.clear()
        _PARSED[static] = st
    if n - end != st.values.size:
        raise FrameError("meta", n - end,
                         f"{len(st.id_names) + len(st.keys)} integer values take {st.values.size} bytes")  # fmt: skip
    if st.payload > max_frame_bytes:
        raise FrameError(
            "tensors", st.payload, f"frame payload over max_frame_bytes={max_frame_bytes}"
        )
    h = st.header
    ints = st.values.unpack_from(text, end)
    num_ids = len(st.id_names)
    routing = h.routing
    if num_ids:
        rkey = (st.session, st.id_names, ints[:num_ids])
        routing = _BIN_ROUTINGS.get(rkey)
        if routing is None:
            if len(_BIN_ROUTINGS) >= _MAX_ROUTINGS:
                _BIN_ROUTINGS.clear()
            ids = dict(zip(st.id_names, rkey[2], strict=True))
            if st.session is not None:
                ids["session"] = st.session
            routing = _BIN_ROUTINGS[rkey] = _routing(ids)
    meta = dict(zip(st.keys, ints[num_ids:], strict=True)) if st.keys else {}
    return FrameHeader(h.kind, h.lane, routing, h.src, h.priority, meta, h.tensors)


def _parse_static(static: bytes) -> _Static:
    """The static bytes as the JSON form's object, validated by `_validate` (the one schema)."""
    at = 0

    def take(fmt: struct.Struct, what: str) -> Any:
        nonlocal at
        if at + fmt.size > len(static):
            raise FrameError("header", what, "the binary header ends inside this field")
        (v,) = fmt.unpack_from(static, at)
        at += fmt.size
        return v

    def text(what: str, *, nullable: bool = False) -> str | None:
        nonlocal at
        size = take(_U8, what)
        if size == _NULL and nullable:
            return None
        if at + size > len(static):
            raise FrameError("header", what, "the binary header ends inside this field")
        try:
            out = static[at : at + size].decode()
        except UnicodeDecodeError:
            raise FrameError(what, static[at : at + size][:40], "not valid UTF-8") from None
        at += size
        return out

    lane = take(_U8, "lane")
    if lane >= len(_LANE_ORDER):
        raise FrameError("lane", lane, f"binary lane code must be 0..{len(_LANE_ORDER) - 1}")
    d: dict[str, Any] = {"v": PROTOCOL_VERSION, "lane": _LANE_ORDER[lane].value}
    d["prio"] = take(_I64S, "prio")
    d["kind"] = text("kind")
    d["src"] = text("src", nullable=True)
    mask = take(_U8, "ids")
    if mask >> len(ROUTING_IDS):
        raise FrameError("ids", mask, f"binary routing mask has bits past {len(ROUTING_IDS)} ids")
    session = text("ids.session") if mask & 1 else None
    id_names = tuple(name for i, name in enumerate(ROUTING_IDS) if i and mask >> i & 1)
    d["ids"] = {} if session is None else {"session": session}  # the integers come per frame
    keys = tuple(text("meta") for _ in range(take(_U8, "meta")))
    if len(set(keys)) != len(keys):
        raise FrameError("meta", list(keys), "duplicate meta key")
    d["meta"] = {}
    tensors = []
    for i in range(take(_U8, "tensors")):
        name = text(f"tensors[{i}].name")
        dtype = take(_U8, f"tensors[{i}].dtype")
        if dtype >= len(_DTYPE_ORDER):
            raise FrameError(f"tensors[{i}].dtype", dtype,
                             f"binary dtype code must be 0..{len(_DTYPE_ORDER) - 1}")  # fmt: skip
        shape = [take(_U64, f"tensors[{i}].shape") for _ in range(take(_U8, f"tensors[{i}]"))]
        nbytes = DTYPE_ITEMSIZE[_DTYPE_ORDER[dtype]]
        for dim in shape:
            nbytes *= dim
        tensors.append({"name": name, "dtype": _DTYPE_ORDER[dtype], "shape": shape,
                        "bytes": nbytes})  # fmt: skip
    d["tensors"] = tensors
    if at != len(static):
        raise FrameError("header_bytes", len(static) - at, "trailing bytes in the binary header")
    header = _validate(d, _UNCAPPED)  # type: ignore[arg-type]
    values = struct.Struct(f">{len(id_names) + len(keys)}q")
    payload = sum(s.nbytes for s in header.tensors)
    return _Static(header, session, id_names, keys, values, payload)
