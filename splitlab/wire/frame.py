"""Frame codec: `u32 big-endian header length | UTF-8 JSON header (<= 16 KiB) | tensor bytes`.

One codec for every channel (TCP lanes, in-process, tensor-over-AMQP, handshakes). Tensors of
any allowed dtype, bfloat16 included, travel as their raw bytes: encoding takes memoryviews of
the tensor storage (a non-contiguous tensor is made contiguous once) and decoding `recv_into`s
pooled buffers and returns typed views of them. The decoder validates everything it reads
(header size, JSON shape, dtype allow-list, rank 1..8, dimensions, byte counts, total size
before any allocation, finiteness when asked) and raises a `FrameError` naming field and value.

    .venv/bin/pytest tests/unit/test_wire_frame.py -q
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import torch

from splitlab.wire.errors import FrameError, NonFiniteFrameError, TruncatedFrameError
from splitlab.wire.pool import BufferPool, Key, Lease, unpooled_lease

PROTOCOL_VERSION = 1
MAX_HEADER_BYTES = 16 * 1024
MAX_RANK = 8
MAX_TENSORS = 64
MAX_DIM = 1 << 40
DEFAULT_MAX_FRAME_BYTES = 1 << 30
PREFIX = struct.Struct(">I")

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
ROUTING_IDS = ("session", "window", "microbatch", "owner", "worker", "stage", "token")

RecvInto = Callable[[memoryview, int], int]


class Lane(StrEnum):
    """Separate sockets, queues and pools, so a full activation lane never blocks a gradient."""

    ACTIVATION = "activation"
    GRADIENT = "gradient"


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


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int

    @property
    def key(self) -> Key:
        return DTYPES[self.dtype], self.shape


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
        if not isinstance(d, dict):
            raise FrameError("header", type(d).__name__, "must be a JSON object")
        if d.get("v") != PROTOCOL_VERSION:
            raise FrameError("v", d.get("v"), f"protocol version must be {PROTOCOL_VERSION}")
        kind = d.get("kind")
        if not isinstance(kind, str) or not 0 < len(kind) <= 64:
            raise FrameError("kind", kind, "must be a string of 1..64 characters")
        try:
            lane = Lane(d.get("lane"))
        except ValueError:
            raise FrameError(
                "lane", d.get("lane"), f"must be one of {[x.value for x in Lane]}"
            ) from None
        src = d.get("src")
        if src is not None and (not isinstance(src, str) or len(src) > 256):
            raise FrameError("src", src, "must be null or a string of <= 256 characters")
        prio = _int_field("prio", d.get("prio", 0))
        meta = d.get("meta", {})
        if not isinstance(meta, dict):
            raise FrameError("meta", meta, "must be a JSON object")
        return cls(
            kind=kind,
            lane=lane,
            routing=_routing(d.get("ids", {})),
            src=src,
            priority=prio,
            meta=meta,
            tensors=_tensor_specs(d.get("tensors"), max_frame_bytes),
        )


def _int_field(name: str, value: Any, lo: int = -(1 << 63), hi: int = (1 << 63) - 1) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise FrameError(name, value, f"must be an integer in [{lo}, {hi}]")
    return value


def _routing(ids: Any) -> Routing:
    if not isinstance(ids, dict):
        raise FrameError("ids", ids, "must be a JSON object")
    session = ids.get("session")
    if session is not None and (not isinstance(session, str) or len(session) > 256):
        raise FrameError("ids.session", session, "must be null or a string of <= 256 characters")
    values: dict[str, Any] = {"session": session}
    for name in ROUTING_IDS[1:]:
        v = ids.get(name)
        values[name] = None if v is None else _int_field(f"ids.{name}", v)
    return Routing(**values)


def _tensor_specs(items: Any, max_frame_bytes: int) -> tuple[TensorSpec, ...]:
    if not isinstance(items, list) or len(items) > MAX_TENSORS:
        raise FrameError("tensors", items, f"must be a list of at most {MAX_TENSORS} entries")
    specs: list[TensorSpec] = []
    total = 0
    for i, item in enumerate(items):
        where = f"tensors[{i}]"
        if not isinstance(item, dict):
            raise FrameError(where, item, "must be a JSON object")
        name = item.get("name")
        if not isinstance(name, str) or not 0 < len(name) <= 128:
            raise FrameError(f"{where}.name", name, "must be a string of 1..128 characters")
        if any(s.name == name for s in specs):
            raise FrameError(f"{where}.name", name, "duplicate tensor name")
        dtype = item.get("dtype")
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise FrameError(f"{where}.dtype", dtype, f"not in the allow-list {sorted(DTYPES)}")
        shape = item.get("shape")
        if not isinstance(shape, list) or not 1 <= len(shape) <= MAX_RANK:
            raise FrameError(f"{where}.shape", shape, f"must be a list of 1..{MAX_RANK} dims")
        dims = tuple(_int_field(f"{where}.shape", d, 0, MAX_DIM) for d in shape)
        expected = math.prod(dims) * DTYPES[dtype].itemsize
        nbytes = item.get("bytes")
        if nbytes != expected or isinstance(nbytes, bool):
            raise FrameError(
                f"{where}.bytes", nbytes, f"{dtype}{list(dims)} takes {expected} bytes"
            )
        total += expected
        if total > max_frame_bytes:
            raise FrameError(
                "tensors", total, f"frame payload over max_frame_bytes={max_frame_bytes}"
            )
        specs.append(TensorSpec(name, dtype, dims, expected))
    return tuple(specs)


def _byte_view(name: str, t: torch.Tensor) -> tuple[TensorSpec, memoryview]:
    dtype = DTYPE_NAMES.get(t.dtype)
    if dtype is None:
        raise FrameError(
            f"tensors.{name}.dtype", str(t.dtype), f"not in the allow-list {sorted(DTYPES)}"
        )
    if not 1 <= t.dim() <= MAX_RANK:
        raise FrameError(f"tensors.{name}.shape", list(t.shape), f"rank must be 1..{MAX_RANK}")
    if t.device.type != "cpu":
        raise ValueError(f"tensor {name!r} is on {t.device}; stage it to host memory first")
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    spec = TensorSpec(name, dtype, tuple(t.shape), t.numel() * t.element_size())
    if spec.nbytes == 0:
        return spec, memoryview(b"")
    # The ndarray keeps the tensor alive for as long as the memoryview lives.
    return spec, memoryview(t.reshape(-1).view(torch.uint8).numpy())


def encode_frame(header: FrameHeader, tensors: Mapping[str, torch.Tensor]) -> list[memoryview]:
    """Prefix+header bytes followed by one zero-copy byte view per tensor (CPU tensors only)."""
    if len(tensors) > MAX_TENSORS:
        raise FrameError("tensors", len(tensors), f"at most {MAX_TENSORS} tensors per frame")
    views: list[memoryview] = [memoryview(b"")]
    specs: list[TensorSpec] = []
    for name, t in tensors.items():
        spec, view = _byte_view(name, t)
        specs.append(spec)
        views.append(view)
    d = header.to_dict()
    d["tensors"] = [
        {"name": s.name, "dtype": s.dtype, "shape": list(s.shape), "bytes": s.nbytes} for s in specs
    ]
    text = json.dumps(d, separators=(",", ":"), allow_nan=False).encode()
    if len(text) > MAX_HEADER_BYTES:
        raise FrameError("header_bytes", len(text), f"header over {MAX_HEADER_BYTES} bytes")
    views[0] = memoryview(PREFIX.pack(len(text)) + text)
    return views


def frame_bytes(views: list[memoryview]) -> bytes:
    """One contiguous copy of an encoded frame (message bodies for in-process and AMQP)."""
    return b"".join(views)


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
    recv_into: RecvInto, scratch: bytearray, *, max_frame_bytes: int, have_bytes: int = 0
) -> FrameHeader:
    """Read and validate the length prefix and JSON header (nothing is allocated for tensors).

    `have_bytes` prefix bytes may already sit at the start of `scratch` (a non-blocking probe).
    """
    mv = memoryview(scratch)
    recv_exact(recv_into, mv[have_bytes:4], what="prefix")
    (n,) = PREFIX.unpack_from(scratch)
    if not 0 < n <= MAX_HEADER_BYTES:
        raise FrameError("header_bytes", n, f"must be 1..{MAX_HEADER_BYTES}")
    recv_exact(recv_into, mv[4 : 4 + n], what="header")
    try:
        obj = json.loads(bytes(mv[4 : 4 + n]))
    except (ValueError, RecursionError) as exc:  # JSON, UTF-8 and int-digit errors are ValueErrors
        raise FrameError(
            "header", bytes(mv[4 : 4 + min(n, 40)]), f"not valid JSON: {exc}"
        ) from None
    return FrameHeader.from_dict(obj, max_frame_bytes=max_frame_bytes)


def read_payload(
    recv_into: RecvInto,
    header: FrameHeader,
    *,
    pool: BufferPool | None,
    timeout_s: float,
    check_finite: bool = False,
) -> tuple[dict[str, torch.Tensor], Lease]:
    """Receive the tensors of a validated header into pooled (or fresh) buffers."""
    keys = [s.key for s in header.tensors]
    lease = pool.lease(keys, timeout_s=timeout_s) if pool is not None else unpooled_lease(keys)
    try:
        for spec, buf in zip(header.tensors, lease.buffers, strict=True):
            recv_exact(recv_into, buf.view, what=f"tensors.{spec.name}")
        tensors = {s.name: b.tensor for s, b in zip(header.tensors, lease.buffers, strict=True)}
        check_payload(tensors, check_finite=check_finite)
    except BaseException:
        lease.release()
        raise
    return tensors, lease


def check_payload(tensors: Mapping[str, torch.Tensor], *, check_finite: bool) -> None:
    """Bool tensors must hold 0/1 bytes; floating tensors must be finite when asked."""
    for name, t in tensors.items():
        if t.numel() == 0:
            continue
        if t.dtype is torch.bool and int(t.view(torch.uint8).max()) > 1:
            raise FrameError(f"tensors.{name}", "bool", "bool bytes must be 0 or 1")
        if check_finite and t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise NonFiniteFrameError(f"tensors.{name}", "nan/inf", "non-finite values")


def read_frame(
    recv_into: RecvInto,
    *,
    pool: BufferPool | None = None,
    scratch: bytearray | None = None,
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    check_finite: bool = False,
    timeout_s: float = 30.0,
) -> tuple[FrameHeader, dict[str, torch.Tensor], Lease]:
    """Read one whole frame from a `recv_into(view, nbytes) -> int` source."""
    scratch = scratch if scratch is not None else bytearray(4 + MAX_HEADER_BYTES)
    header = read_header(recv_into, scratch, max_frame_bytes=max_frame_bytes)
    tensors, lease = read_payload(
        recv_into, header, pool=pool, timeout_s=timeout_s, check_finite=check_finite
    )
    return header, tensors, lease


class _BytesSource:
    def __init__(self, data: bytes | bytearray | memoryview) -> None:
        self.data = memoryview(data).cast("B")
        self.pos = 0

    def recv_into(self, view: memoryview, nbytes: int) -> int:
        k = min(nbytes, len(self.data) - self.pos)
        view[:k] = self.data[self.pos : self.pos + k]
        self.pos += k
        return k


def decode_frame(
    data: bytes | bytearray | memoryview,
    *,
    pool: BufferPool | None = None,
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    check_finite: bool = False,
    timeout_s: float = 30.0,
) -> tuple[FrameHeader, dict[str, torch.Tensor], Lease]:
    """Decode one frame held in memory; bytes past its end are an error."""
    src = _BytesSource(data)
    header, tensors, lease = read_frame(
        src.recv_into,
        pool=pool,
        max_frame_bytes=max_frame_bytes,
        check_finite=check_finite,
        timeout_s=timeout_s,
    )
    if src.pos != len(src.data):
        lease.release()
        raise FrameError("frame", len(src.data) - src.pos, "trailing bytes after the last tensor")
    return header, tensors, lease
