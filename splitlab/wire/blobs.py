"""Frames whose payload is raw byte strings: the control plane's view of the one frame codec.

A blob is a rank-1 `uint8` tensor on the wire (`u32 | JSON header | bytes`, the header listing
each blob as `{name, dtype: "uint8", shape: [n], bytes: n}`), so a tensor reader can read any
of these frames too; here blobs stay `bytes`/`memoryview` and nothing imports torch. Control
messages (`control.messages`: fields in `meta`, UPDATE's safetensors weights as a blob) and
the embedded control bus's requests and replies are such frames.

    .venv/bin/pytest tests/unit/test_wire_blobs.py tests/unit/test_control_messages.py -q
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from splitlab.wire.errors import FrameError
from splitlab.wire.header import (
    PREFIX,
    FrameHeader,
    Lane,
    RecvInto,
    Routing,
    TensorSpec,
    encode_header,
    header_length,
    parse_header,
    read_header,
    recv_exact,
)

Blob = bytes | bytearray | memoryview
GROW_FROM_BYTES = 64 << 10  # a blob's first buffer; it doubles as its bytes arrive
_NO_ROUTING = Routing()


def encode_blob_frame(kind: str, meta: dict[str, Any], blobs: Mapping[str, Blob] = {}) -> list[Blob]:  # noqa: B006  # fmt: skip
    """`[prefix+header, *blobs]`: send with one `sendall(b"".join(...))` or `sendmsg`."""
    specs = [TensorSpec(name, "uint8", (len(b),), len(b)) for name, b in blobs.items()]
    head = encode_header(kind, Lane.ACTIVATION, _NO_ROUTING, None, 0, meta, specs)
    return [head, *blobs.values()]


def blob_frame_bytes(kind: str, meta: dict[str, Any], blobs: Mapping[str, Blob] = {}) -> bytes:  # noqa: B006  # fmt: skip
    """One contiguous frame (a message body for a queue)."""
    return b"".join(encode_blob_frame(kind, meta, blobs))


def _check_blobs(header: FrameHeader) -> None:
    for i, spec in enumerate(header.tensors):
        if spec.dtype != "uint8" or len(spec.shape) != 1:
            raise FrameError(f"tensors[{i}]", spec.name, "a blob is a rank-1 uint8 tensor")


def split_blobs(header: FrameHeader, payload: memoryview) -> dict[str, memoryview]:
    """The blobs of a validated header, as views of `payload` (which must hold exactly them)."""
    if not header.tensors and not payload:  # most control frames: nothing to split
        return {}
    _check_blobs(header)
    announced = sum(s.nbytes for s in header.tensors)
    if announced != len(payload):
        raise FrameError("tensors", announced, f"payload bytes announced, {len(payload)} carried")
    out: dict[str, memoryview] = {}
    offset = 0
    for spec in header.tensors:
        out[spec.name] = payload[offset : offset + spec.nbytes]
        offset += spec.nbytes
    return out


def decode_blob_frame(data: Blob, *, max_frame_bytes: int) -> tuple[FrameHeader, dict[str, memoryview]]:  # fmt: skip
    """One whole frame held in memory: its header and its blobs (views of `data`)."""
    mv = memoryview(data).cast("B")
    if len(mv) < PREFIX.size:
        raise FrameError("prefix", len(mv), f"a frame of {len(mv)} bytes has no length prefix")
    n = header_length(mv)
    if PREFIX.size + n > len(mv):
        raise FrameError("header_bytes", n, f"does not fit a {len(mv)}-byte frame")
    header = parse_header(mv[PREFIX.size : PREFIX.size + n], max_frame_bytes=max_frame_bytes)
    return header, split_blobs(header, mv[PREFIX.size + n :])


def read_blob_frame(recv_into: RecvInto, scratch: bytearray, *,
                    max_frame_bytes: int) -> tuple[FrameHeader, dict[str, bytearray]]:  # fmt: skip
    """Read one frame from a stream; sizes are checked against `max_frame_bytes` before any
    blob is allocated."""
    header = read_header(recv_into, scratch, max_frame_bytes=max_frame_bytes)
    _check_blobs(header)
    return header, {
        s.name: _recv_blob(recv_into, s.nbytes, f"tensors.{s.name}") for s in header.tensors
    }


def _recv_blob(recv_into: RecvInto, nbytes: int, what: str) -> bytearray:
    """`nbytes` from the stream in a buffer that grows (doubling) as they arrive: a header
    that announces a large blob and sends nothing makes the reader allocate (and zero) no
    more than `GROW_FROM_BYTES`, never the whole announced size."""
    buf = bytearray(min(nbytes, GROW_FROM_BYTES))
    got = 0
    while True:
        recv_exact(recv_into, memoryview(buf)[got:], what=what)
        got = len(buf)
        if got == nbytes:
            return buf
        buf[got:] = bytes(min(got, nbytes - got))
