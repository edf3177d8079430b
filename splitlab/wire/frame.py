"""Frame codec: `u32 big-endian header length | header (<= 16 KiB) | tensor bytes`.

One codec for every channel (TCP lanes, in-process, tensor-over-AMQP, handshakes). Tensors of
any allowed dtype, bfloat16 included, travel as their raw bytes: encoding takes memoryviews of
the tensor storage (a non-contiguous tensor is made contiguous once) and decoding `recv_into`s
pooled buffers and returns typed views of them. The header is JSON or binary (`header.py`).
The decoder validates everything it reads (header size and fields, dtype allow-list, rank
1..8, dimensions, byte counts, total size before any allocation, finiteness when asked) and
raises a `FrameError` naming field and value.

    .venv/bin/pytest tests/unit/test_wire_frame.py -q
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from splitlab.wire.errors import FrameError, NonFiniteFrameError
from splitlab.wire.header import (
    DEFAULT_MAX_FRAME_BYTES,
    DTYPE_ITEMSIZE,
    MAX_DIM,
    MAX_HEADER_BYTES,
    MAX_RANK,
    MAX_TENSORS,
    PREFIX,
    PROTOCOL_VERSION,
    ROUTING_IDS,
    FrameHeader,
    Lane,
    RecvInto,
    Routing,
    TensorSpec,
    encode_binary_header,
    encode_header,
    parse_header,
    read_header,
    recv_exact,
)
from splitlab.wire.pool import BufferPool, Lease, unpooled_lease

__all__ = [
    "DEFAULT_MAX_FRAME_BYTES", "DTYPES", "DTYPE_NAMES", "MAX_DIM", "MAX_HEADER_BYTES",
    "MAX_RANK", "MAX_TENSORS", "PREFIX", "PROTOCOL_VERSION", "ROUTING_IDS", "FrameHeader",
    "Lane", "Routing", "TensorSpec", "check_payload", "decode_frame", "encode_frame",
    "encode_parts", "frame_bytes", "parse_header", "read_frame", "read_header", "read_payload",
    "recv_exact", "tensor_views",
]  # fmt: skip

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
assert {k: v.itemsize for k, v in DTYPES.items()} == DTYPE_ITEMSIZE  # one allow-list
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
_EMPTY = memoryview(b"")


def tensor_views(
    tensors: Mapping[str, torch.Tensor],
) -> tuple[list[TensorSpec], list[memoryview]]:
    """Spec and zero-copy byte view of each CPU tensor (a non-contiguous one is copied once)."""
    if len(tensors) > MAX_TENSORS:
        raise FrameError("tensors", len(tensors), f"at most {MAX_TENSORS} tensors per frame")
    specs: list[TensorSpec] = []
    views: list[memoryview] = []
    for name, t in tensors.items():
        dtype = DTYPE_NAMES.get(t.dtype)
        if dtype is None:
            raise FrameError(
                f"tensors.{name}.dtype", str(t.dtype), f"not in the allow-list {sorted(DTYPES)}"
            )
        shape = tuple(t.shape)
        if not 1 <= len(shape) <= MAX_RANK:
            raise FrameError(f"tensors.{name}.shape", list(shape), f"rank must be 1..{MAX_RANK}")
        if not t.is_cpu:
            raise ValueError(f"tensor {name!r} is on {t.device}; stage it to host memory first")
        if t.requires_grad:
            t = t.detach()
        if not t.is_contiguous():
            t = t.contiguous()
        if t.dtype is torch.bfloat16:  # numpy has no bfloat16: same bytes as int16
            t = t.view(torch.int16)
        nbytes = t.nbytes
        specs.append(TensorSpec(name, dtype, shape, nbytes))
        # The ndarray keeps the tensor alive for as long as the memoryview lives.
        views.append(memoryview(t.numpy()).cast("B") if nbytes else _EMPTY)
    return specs, views


def encode_parts(kind: str, lane: Lane, routing: Routing, src: str | None, priority: int,
                 meta: dict[str, Any] | None,
                 tensors: Mapping[str, torch.Tensor]) -> list[memoryview]:  # fmt: skip
    """Prefix+header bytes followed by one zero-copy byte view per tensor (CPU tensors only)."""
    specs, views = tensor_views(tensors)
    head = encode_binary_header(kind, lane, routing, src, priority, meta, specs)
    if head is None:
        head = encode_header(kind, lane, routing, src, priority, meta, specs)
    return [memoryview(head), *views]


def encode_frame(header: FrameHeader, tensors: Mapping[str, torch.Tensor]) -> list[memoryview]:
    """Prefix+header bytes followed by one zero-copy byte view per tensor (CPU tensors only)."""
    h = header
    return encode_parts(h.kind, h.lane, h.routing, h.src, h.priority, h.meta, tensors)


def frame_bytes(views: list[memoryview]) -> bytes:
    """One contiguous copy of an encoded frame (message bodies for in-process and AMQP)."""
    return b"".join(views)


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
