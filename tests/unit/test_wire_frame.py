"""Frame codec: bit-exact round trips and a decoder fuzz that only ever raises FrameError.

.venv/bin/pytest tests/unit/test_wire_frame.py -q
"""

from __future__ import annotations

import json
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from splitlab.wire.errors import FrameError, NonFiniteFrameError, TruncatedFrameError
from splitlab.wire.frame import (
    DTYPES,
    MAX_HEADER_BYTES,
    FrameHeader,
    Lane,
    Routing,
    decode_frame,
    encode_frame,
    frame_bytes,
)
from splitlab.wire.pool import BufferPool

FUZZ_MAX_FRAME_BYTES = 1 << 16


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Integer view of a tensor's bytes, so NaN payloads compare bit for bit."""
    return t.contiguous().view(torch.uint8)


def _sample(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    raw = torch.randint(
        0, 256, (int(torch.tensor(shape).prod()) * dtype.itemsize,), dtype=torch.uint8
    )
    if dtype is torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def _frame(tensors: dict[str, torch.Tensor], **kw: object) -> bytes:
    return frame_bytes(encode_frame(FrameHeader(kind="test", **kw), tensors))  # type: ignore[arg-type]


def _raw_frame(header: object, payload: bytes = b"") -> bytes:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack(">I", len(text)) + text + payload


def _header(
    dtype: str = "float32", shape: list[int] | None = None, nbytes: int | None = None
) -> dict:
    shape = shape or [2, 2]
    if nbytes is None:
        nbytes = 4 * DTYPES.get(dtype, torch.float32).itemsize
    return {
        "v": 1,
        "kind": "t",
        "lane": "activation",
        "ids": {},
        "meta": {},
        "tensors": [{"name": "x", "dtype": dtype, "shape": shape, "bytes": nbytes}],
    }


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_every_allowed_dtype_round_trips_bit_exact(dtype: torch.dtype) -> None:
    t = _sample(dtype, (3, 5, 2))
    _, out, _ = decode_frame(_frame({"x": t}))
    assert out["x"].dtype == dtype and out["x"].shape == t.shape
    assert torch.equal(_bits(out["x"]), _bits(t))


def test_non_contiguous_tensors_round_trip_bit_exact() -> None:
    base = _sample(torch.bfloat16, (4, 6, 8))
    tensors = {"t": base.transpose(0, 2), "s": base[:, ::2, 1], "e": base.expand(2, 4, 6, 8)[1]}
    _, out, _ = decode_frame(_frame(tensors))
    for name, t in tensors.items():
        assert out[name].shape == t.shape
        assert torch.equal(_bits(out[name]), _bits(t))


def test_header_fields_and_routing_ids_round_trip() -> None:
    ids = Routing(session="s1", window=3, microbatch=7, owner=0, worker=2, stage=None, token=11)
    header, out, _ = decode_frame(
        _frame(
            {"a": torch.ones(1), "b": torch.zeros(2, 0)},
            lane=Lane.GRADIENT,
            routing=ids,
            src="w0",
            priority=-1,
            meta={"loss_scale": 2.5},
        )
    )
    assert (header.kind, header.lane, header.routing, header.src) == (
        "test",
        Lane.GRADIENT,
        ids,
        "w0",
    )
    assert header.priority == -1 and header.meta == {"loss_scale": 2.5}
    assert list(out) == ["a", "b"] and out["b"].shape == (2, 0)


def test_decode_into_pool_reuses_buffers() -> None:
    pool = BufferPool(pool_bytes=1 << 20)
    data = _frame({"x": torch.ones(4, 4)})
    for _ in range(3):
        _, _, lease = decode_frame(data, pool=pool)
        lease.release()
    assert (pool.stats.misses, pool.stats.hits) == (1, 2)


def test_unknown_dtype_names_field_and_value() -> None:
    with pytest.raises(FrameError) as err:
        decode_frame(_raw_frame(_header(dtype="complex32")))
    assert err.value.field == "tensors[0].dtype" and err.value.value == "complex32"


def test_lying_byte_count_is_refused() -> None:
    with pytest.raises(FrameError) as err:
        decode_frame(_raw_frame(_header(nbytes=8), b"\0" * 8))
    assert err.value.field == "tensors[0].bytes"


def test_oversize_frame_is_refused_before_any_allocation() -> None:
    pool = BufferPool(pool_bytes=1 << 20)
    huge = _header(shape=[1 << 20, 1 << 20], nbytes=4 << 40)
    with pytest.raises(FrameError) as err:
        decode_frame(_raw_frame(huge), pool=pool, max_frame_bytes=1 << 20)
    assert err.value.field == "tensors"
    assert pool.stats.allocated_bytes == 0 and pool.stats.misses == 0


def test_oversize_header_length_is_refused() -> None:
    data = struct.pack(">I", MAX_HEADER_BYTES + 1) + b"{}"
    with pytest.raises(FrameError) as err:
        decode_frame(data)
    assert err.value.field == "header_bytes" and err.value.value == MAX_HEADER_BYTES + 1


@pytest.mark.parametrize("shape", [[], [1] * 9, [-1], [2.0], [True], "2x2"])
def test_bad_rank_or_dimension_is_refused(shape: object) -> None:
    header = _header() | {
        "tensors": [{"name": "x", "dtype": "float32", "shape": shape, "bytes": 0}]
    }
    with pytest.raises(FrameError) as err:
        decode_frame(_raw_frame(header))
    assert err.value.field == "tensors[0].shape"


def test_truncated_frame_raises_truncated_error() -> None:
    data = _frame({"x": torch.ones(8)})
    with pytest.raises(TruncatedFrameError):
        decode_frame(data[:-3])


def test_trailing_bytes_are_refused() -> None:
    with pytest.raises(FrameError) as err:
        decode_frame(_frame({"x": torch.ones(2)}) + b"\0")
    assert err.value.field == "frame"


def test_nan_payload_is_refused_when_finiteness_is_asked() -> None:
    data = _frame({"x": torch.tensor([1.0, float("nan")], dtype=torch.bfloat16)})
    decode_frame(data)  # allowed when not asked
    with pytest.raises(NonFiniteFrameError) as err:
        decode_frame(data, check_finite=True)
    assert err.value.field == "tensors.x"


def test_bool_bytes_other_than_zero_or_one_are_refused() -> None:
    with pytest.raises(FrameError):
        decode_frame(_raw_frame(_header(dtype="bool", nbytes=4), b"\0\1\2\0"))


def test_encode_refuses_dtype_outside_allow_list_naming_it() -> None:
    with pytest.raises(FrameError) as err:
        encode_frame(FrameHeader(kind="x"), {"c": torch.zeros(2, dtype=torch.complex64)})
    assert err.value.field == "tensors.c.dtype"


# ---- fuzz: every input gets a FrameError or decodes; nothing else, nothing unbounded ----

_FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _decode_or_frame_error(data: bytes) -> None:
    pool = BufferPool(pool_bytes=FUZZ_MAX_FRAME_BYTES)
    try:
        _, _, lease = decode_frame(
            data, pool=pool, max_frame_bytes=FUZZ_MAX_FRAME_BYTES, check_finite=True, timeout_s=0.0
        )
        lease.release()
    except FrameError:
        pass
    assert pool.stats.allocated_bytes <= FUZZ_MAX_FRAME_BYTES


@_FUZZ
@given(st.binary(max_size=256))
def test_fuzz_arbitrary_bytes(data: bytes) -> None:
    _decode_or_frame_error(data)


@_FUZZ
@given(st.binary(max_size=512))
def test_fuzz_garbage_json_header(text: bytes) -> None:
    _decode_or_frame_error(_raw_frame(text))


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


@_FUZZ
@given(
    dtype=st.sampled_from([*DTYPES, "complex32", "float8", "", 3]),
    shape=st.lists(st.integers(-2, 1 << 45) | _json, max_size=10) | _json,
    nbytes=st.integers(-1, 1 << 50) | _json,
    payload=st.binary(max_size=64),
    extra=st.dictionaries(
        st.sampled_from(["v", "kind", "lane", "ids", "meta", "prio", "src"]), _json
    ),
)
def test_fuzz_lying_headers(
    dtype: object, shape: object, nbytes: object, payload: bytes, extra: dict
) -> None:
    header = _header() | {
        "tensors": [{"name": "x", "dtype": dtype, "shape": shape, "bytes": nbytes}]
    }
    _decode_or_frame_error(_raw_frame(header | extra, payload))


@_FUZZ
@given(
    dtype=st.sampled_from(list(DTYPES.values())),
    n=st.integers(1, 16),
    cut=st.integers(0, 10_000),
    flips=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), max_size=4),
)
def test_fuzz_truncated_and_corrupted_frames(
    dtype: torch.dtype, n: int, cut: int, flips: list
) -> None:
    data = bytearray(_frame({"x": _sample(dtype, (n,)), "y": torch.tensor([float("nan")])}))
    for pos, byte in flips:
        data[pos % len(data)] = byte
    _decode_or_frame_error(bytes(data[: cut % (len(data) + 1)]))
