"""Byte-payload frames: the same frame a tensor reader reads, blobs kept as bytes, no torch.

.venv/bin/pytest tests/unit/test_wire_blobs.py -q
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from splitlab.wire.blobs import (
    blob_frame_bytes,
    decode_blob_frame,
    encode_blob_frame,
    read_blob_frame,
)
from splitlab.wire.errors import FrameError, TruncatedFrameError
from splitlab.wire.frame import DTYPES, decode_frame, encode_frame, frame_bytes
from splitlab.wire.header import MAX_HEADER_BYTES, FrameHeader


class _Stream:
    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def recv_into(self, view: memoryview, nbytes: int) -> int:
        k = min(nbytes, len(self.data) - self.pos, 3)  # short reads, as a socket gives them
        view[:k] = self.data[self.pos : self.pos + k]
        self.pos += k
        return k


def test_blobs_round_trip_in_memory_and_from_a_stream() -> None:
    data = blob_frame_bytes("publish", {"queue": "q"}, {"body": b"abc", "empty": b""})
    header, blobs = decode_blob_frame(data, max_frame_bytes=1 << 10)
    assert (header.kind, header.meta) == ("publish", {"queue": "q"})
    assert {k: bytes(v) for k, v in blobs.items()} == {"body": b"abc", "empty": b""}
    header, read = read_blob_frame(_Stream(data).recv_into, bytearray(4 + MAX_HEADER_BYTES),
                                   max_frame_bytes=1 << 10)  # fmt: skip
    assert read == {"body": bytearray(b"abc"), "empty": bytearray()}


def test_a_blob_frame_is_a_tensor_frame_of_uint8() -> None:
    _, tensors, lease = decode_frame(blob_frame_bytes("k", {}, {"b": b"\x01\x02"}))
    assert tensors["b"].dtype is torch.uint8 and tensors["b"].tolist() == [1, 2]
    lease.release()


def test_a_tensor_that_is_not_a_byte_string_is_refused() -> None:
    data = frame_bytes(encode_frame(FrameHeader(kind="k"), {"x": torch.zeros(2, dtype=DTYPES["int16"])}))  # fmt: skip
    with pytest.raises(FrameError, match="rank-1 uint8"):
        decode_blob_frame(data, max_frame_bytes=1 << 10)


@pytest.mark.parametrize(("cut", "extra"), [(1, b""), (0, b"z")])
def test_payload_must_be_exactly_what_the_header_announces(cut: int, extra: bytes) -> None:
    data = blob_frame_bytes("k", {}, {"b": b"abc"})
    with pytest.raises(FrameError, match="announced"):
        decode_blob_frame(data[: len(data) - cut] + extra, max_frame_bytes=1 << 10)


def test_size_is_refused_before_anything_is_allocated() -> None:
    head = encode_blob_frame("k", {}, {"b": b"x" * 100})[0]
    with pytest.raises(FrameError, match="max_frame_bytes"):
        read_blob_frame(_Stream(bytes(head)).recv_into, bytearray(4 + MAX_HEADER_BYTES),
                        max_frame_bytes=10)  # fmt: skip


def test_a_stream_that_ends_inside_a_blob_is_truncated() -> None:
    data = blob_frame_bytes("k", {}, {"b": b"abc"})[:-1]
    with pytest.raises(TruncatedFrameError):
        read_blob_frame(_Stream(data).recv_into, bytearray(4 + MAX_HEADER_BYTES),
                        max_frame_bytes=1 << 10)  # fmt: skip


def test_the_control_plane_reads_frames_without_importing_torch() -> None:
    code = ("import sys, splitlab.control.embedded, splitlab.control.messages, splitlab.wire.auth; "
            "sys.exit('torch' in sys.modules)")  # fmt: skip
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_a_blob_announced_large_is_allocated_only_as_its_bytes_arrive() -> None:
    """A peer announcing a 1 GiB blob and sending 10 bytes must not make the reader allocate
    (and zero) 1 GiB: that was seconds of CPU and a GiB of RSS per such request on the bus."""
    import resource

    from splitlab.wire.blobs import GROW_FROM_BYTES
    from splitlab.wire.header import Lane, Routing, TensorSpec, encode_header

    big = 1 << 30
    head = encode_header("publish", Lane.ACTIVATION, Routing(), None, 0, {},
                         [TensorSpec("body", "uint8", (big,), big)])  # fmt: skip
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(TruncatedFrameError, match=f"after 10 of {GROW_FROM_BYTES} bytes"):
        read_blob_frame(_Stream(head + b"x" * 10).recv_into, bytearray(4 + MAX_HEADER_BYTES),
                        max_frame_bytes=2 * big)  # fmt: skip
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kib < 64 << 10, f"peak RSS grew {grown_kib} KiB"


def test_a_blob_over_the_first_buffer_grows_and_round_trips() -> None:
    from splitlab.wire.blobs import GROW_FROM_BYTES

    body = bytes(range(256)) * ((3 * GROW_FROM_BYTES) // 256) + b"tail"
    data = memoryview(blob_frame_bytes("publish", {}, {"body": body}))
    pos = 0

    def recv_into(view: memoryview, nbytes: int) -> int:  # reads of up to 64 KiB
        nonlocal pos
        k = min(nbytes, len(data) - pos, 1 << 16)
        view[:k] = data[pos : pos + k]
        pos += k
        return k

    _, blobs = read_blob_frame(recv_into, bytearray(4 + MAX_HEADER_BYTES), max_frame_bytes=1 << 30)
    assert bytes(blobs["body"]) == body
