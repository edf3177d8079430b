"""FrameReader over a real socket pair: frames split across many recvs, coalesced in one, stalls.

.venv/bin/pytest tests/unit/test_wire_reader.py -q
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from splitlab.wire.errors import FrameError, PeerClosedError, TruncatedFrameError
from splitlab.wire.frame import FrameHeader, Lane, Routing, encode_frame, frame_bytes
from splitlab.wire.pool import BufferPool
from splitlab.wire.tcp_conn import timeval
from splitlab.wire.tcp_reader import READ_AHEAD_BYTES, STREAM_MIN_BYTES, FrameReader


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, FrameReader]]:
    a, b = socket.socketpair()
    b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval(0.02))
    yield a, FrameReader(b, max_frame_bytes=1 << 26, check_finite=False, stall_timeout_s=0.3)
    a.close()
    b.close()


def _frame(i: int, n: int) -> bytes:
    x = torch.arange(n, dtype=torch.int32) + i
    header = FrameHeader(kind="t", lane=Lane.GRADIENT, routing=Routing(microbatch=i), src="a")
    return frame_bytes(encode_frame(header, {"x": x, "m": torch.ones(2, 3, dtype=torch.bool)}))


def _read(reader: FrameReader, pool: BufferPool) -> tuple[int, torch.Tensor]:
    got = reader.read(pool, timeout_s=1, block=True)
    assert got is not None
    header, tensors, lease, _ = got
    x = tensors["x"].clone()
    lease.release()
    return header.routing.microbatch, x  # type: ignore[return-value]


def test_frame_split_across_byte_sized_sends_reads_whole(
    pair: tuple[socket.socket, FrameReader],
) -> None:
    a, reader = pair
    data = _frame(7, 3000)  # prefix, header and payload each arrive in pieces
    pool = BufferPool(pool_bytes=1 << 20)

    def drip() -> None:
        for i in range(0, len(data), 997):
            a.sendall(data[i : i + 997])
            time.sleep(0.001)

    t = threading.Thread(target=drip)
    t.start()
    mb, x = _read(reader, pool)
    t.join()
    assert mb == 7 and torch.equal(x, torch.arange(3000, dtype=torch.int32) + 7)
    assert reader.buffered == 0


def test_many_small_frames_coalesced_in_one_send_all_come_out_in_order(
    pair: tuple[socket.socket, FrameReader],
) -> None:
    a, reader = pair
    frames = [_frame(i, 200 + i) for i in range(40)]
    assert sum(map(len, frames)) > READ_AHEAD_BYTES  # also crosses read-ahead refills
    a.sendall(b"".join(frames))
    pool = BufferPool(pool_bytes=1 << 20)
    for i in range(40):
        mb, x = _read(reader, pool)
        assert mb == i and torch.equal(x, torch.arange(200 + i, dtype=torch.int32) + i)
    assert reader.read(pool, timeout_s=1) is None and reader.buffered == 0


def test_nothing_waiting_returns_none_without_blocking_or_within_a_slice(
    pair: tuple[socket.socket, FrameReader],
) -> None:
    _, reader = pair
    pool = BufferPool(pool_bytes=1 << 20)
    start = time.monotonic()
    assert reader.read(pool, timeout_s=1) is None
    assert reader.read(pool, timeout_s=1, block=True) is None
    assert time.monotonic() - start < 0.5


def test_peer_stalling_mid_frame_raises_after_stall_timeout(
    pair: tuple[socket.socket, FrameReader],
) -> None:
    a, reader = pair
    a.sendall(_frame(1, 5000)[:-100])
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="stalled mid-frame"):
        reader.read(BufferPool(pool_bytes=1 << 20), timeout_s=1, block=True)
    assert 0.25 <= time.monotonic() - start < 2


def test_peer_closing_mid_frame_raises_truncated(pair: tuple[socket.socket, FrameReader]) -> None:
    a, reader = pair
    a.sendall(_frame(1, 5000)[:-100])
    a.shutdown(socket.SHUT_WR)
    with pytest.raises(TruncatedFrameError) as caught:
        reader.read(BufferPool(pool_bytes=1 << 20), timeout_s=1, block=True)
    assert not isinstance(caught.value, PeerClosedError)  # a fault, not a goodbye


@pytest.mark.parametrize("cut", [1, 3, 6])  # inside the prefix, inside the header
def test_peer_closing_inside_prefix_or_header_is_not_a_goodbye(
    pair: tuple[socket.socket, FrameReader], cut: int
) -> None:
    a, reader = pair
    a.sendall(_frame(1, 8)[:cut])
    a.shutdown(socket.SHUT_WR)
    with pytest.raises(TruncatedFrameError) as caught:
        reader.read(BufferPool(pool_bytes=1 << 20), timeout_s=1, block=True)
    assert not isinstance(caught.value, PeerClosedError)


def test_peer_closing_between_frames_is_a_goodbye(pair: tuple[socket.socket, FrameReader]) -> None:
    a, reader = pair
    pool = BufferPool(pool_bytes=1 << 20)
    a.sendall(_frame(4, 16))
    a.shutdown(socket.SHUT_WR)
    assert _read(reader, pool)[0] == 4  # the last whole frame still arrives
    with pytest.raises(PeerClosedError, match="closed by the peer"):
        reader.read(pool, timeout_s=1, block=True)


def test_oversized_header_length_is_refused_before_reading_it(
    pair: tuple[socket.socket, FrameReader],
) -> None:
    a, reader = pair
    a.sendall((1 << 20).to_bytes(4, "big") + b"{}")
    with pytest.raises(FrameError, match="header_bytes"):
        reader.read(BufferPool(pool_bytes=1 << 20), timeout_s=1)


def test_a_large_frame_is_timed_as_its_payload_arrives_and_a_small_one_is_not(
    pair: tuple[socket.socket, FrameReader],
) -> None:
    a, reader = pair
    pool = BufferPool(pool_bytes=8 << 20)
    a.sendall(_frame(1, 1000))
    _read(reader, pool)
    assert reader.last_stream is None  # under STREAM_MIN_BYTES

    data, chunk, pause_s = _frame(2, 128 << 10), 32 << 10, 0.01  # a 512 KiB payload

    def paced() -> None:
        a.sendall(data[:4096])
        time.sleep(0.05)
        for i in range(4096, len(data), chunk):
            a.sendall(data[i : i + chunk])
            time.sleep(pause_s)

    t = threading.Thread(target=paced)
    t.start()
    _read(reader, pool)
    t.join()
    assert reader.last_stream is not None
    streamed, ms = reader.last_stream
    assert STREAM_MIN_BYTES <= streamed <= len(data) - 4096 + READ_AHEAD_BYTES
    chunks = (len(data) - 4096) // chunk
    assert ms >= (chunks - 1) * pause_s * 1e3  # the wait for the paced bytes, not a memcpy


def test_a_frame_found_mostly_queued_is_not_timed(pair: tuple[socket.socket, FrameReader]) -> None:
    """Its reader was behind the link: what it would time is partly the host's backlog."""
    a, reader = pair
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)  # room to queue 256 KiB
    pool = BufferPool(pool_bytes=8 << 20)
    data = _frame(3, 128 << 10)  # a 512 KiB payload
    sent = threading.Event()

    def behind() -> None:
        # the header and 256 KiB queue before the read starts: ~224 KiB past the read-ahead
        a.sendall(data[: (256 << 10)])
        sent.set()
        time.sleep(0.05)
        a.sendall(data[(256 << 10) :])

    t = threading.Thread(target=behind)
    t.start()
    sent.wait(5)
    time.sleep(0.05)  # ... and reach the receiver's queue
    microbatch, x = _read(reader, pool)
    t.join()
    assert reader.last_stream is None
    assert microbatch == 3 and torch.equal(x, torch.arange(128 << 10, dtype=torch.int32) + 3)
