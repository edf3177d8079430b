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
from splitlab.wire.header import (
    BINARY_MAGIC,
    TensorSpec,
    encode_binary_header,
    encode_header,
    parse_header,
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


# ---- the binary header form: data-lane frames whose meta is integers ----


def _binary_start(frame: bytes) -> int:
    return frame[4]


def test_integer_meta_on_a_data_lane_travels_binary_and_decodes_as_the_json_form() -> None:
    ids = Routing(session="s1", window=3, microbatch=7, owner=0, worker=2, token=-11)
    tensors = {"h": _sample(torch.bfloat16, (1, 3, 8)), "m": _sample(torch.bool, (2,))}
    fields = {"lane": Lane.GRADIENT, "routing": ids, "src": "stage-0", "priority": -1,
              "meta": {"step": 5, "pos": -(1 << 63)}}  # fmt: skip
    data = _frame(tensors, **fields)
    assert _binary_start(data) == BINARY_MAGIC
    header, out, _ = decode_frame(data)
    specs = header.tensors
    # the JSON form of the same fields parses to the same header
    text = encode_header("test", Lane.GRADIENT, ids, "stage-0", -1, fields["meta"], list(specs))
    assert text[4:5] == b"{" and parse_header(text[4:]) == header
    assert header.meta == {"step": 5, "pos": -(1 << 63)} and header.routing == ids
    assert all(torch.equal(_bits(out[k]), _bits(t)) for k, t in tensors.items())
    # the second frame of the same shape differs only in its integers
    again = _frame(tensors, **(fields | {"meta": {"step": 6, "pos": 0}}))
    assert again[: -8 * 2 - sum(t.nbytes for t in tensors.values())] == data[: -16 - 50]
    assert decode_frame(again)[0].meta == {"step": 6, "pos": 0}


@pytest.mark.parametrize(
    ("lane", "meta", "src"),
    [
        (Lane.CONTROL, {"epoch": 1}, None),  # control messages stay JSON
        ("control", {"epoch": 1}, None),  # the lane's value as a plain string too
        (Lane.ACTIVATION, {"loss": 2.5}, None),
        (Lane.ACTIVATION, {"last": True}, None),  # a bool is not an integer here
        (Lane.ACTIVATION, {"n": 1 << 63}, None),  # outside i64
        (Lane.ACTIVATION, {"ids": [1, 2]}, None),
        (Lane.ACTIVATION, {}, "é" * 200),  # 200 characters, 400 UTF-8 bytes
    ],
)
def test_the_json_form_carries_what_the_binary_cannot(lane: Lane, meta: dict, src: str) -> None:
    data = _frame({"x": torch.ones(2)}, lane=lane, meta=meta, src=src)
    assert data[4:5] == b"{"
    header, _, _ = decode_frame(data)
    assert header.meta == meta and header.src == src


def _binary_header(**fields: object) -> bytes:
    """The header bytes (no prefix) of a binary frame with one float32 [2, 2] tensor `x`."""
    fields = {"lane": Lane.ACTIVATION, "routing": Routing(), "src": None, "priority": 0,
              "meta": {"step": 1}} | fields  # fmt: skip
    head = encode_binary_header("t", fields["lane"], fields["routing"], fields["src"],  # type: ignore[arg-type]
                                fields["priority"], fields["meta"],  # type: ignore[arg-type]
                                [TensorSpec("x", "float32", (2, 2), 16)])  # fmt: skip
    assert head is not None
    return head[4:]


def _static(header: bytes) -> tuple[int, bytes, bytes]:
    (n,) = struct.unpack_from(">H", header, 1)
    return n, header[3 : 3 + n], header[3 + n :]


def _rebuilt(static: bytes, values: bytes) -> bytes:
    return struct.pack(">BH", BINARY_MAGIC, len(static)) + static + values


@pytest.mark.parametrize(
    ("corrupt", "field"),
    [
        (lambda s, v: (s, v[:-1]), "meta"),  # one value byte short
        (lambda s, v: (s, v + b"\0" * 8), "meta"),  # a value too many
        (lambda s, v: (b"\x09" + s[1:], v), "lane"),  # no lane 9
        (lambda s, v: (s[:-1], v), "header"),  # the last dimension cut
        (lambda s, v: (s + b"\0", v), "header_bytes"),  # trailing static bytes
        (lambda s, v: (s[:-18] + b"\x0a" + s[-17:], v), "tensors[0].dtype"),  # no dtype 10
        (lambda s, v: (s[:-16] + struct.pack(">QQ", 1 << 41, 1), v), "tensors[0].shape"),
        (lambda s, v: (s[:-16] + struct.pack(">QQ", 2, 3), v), None),  # another shape: valid
    ],
)
def test_a_bad_binary_header_names_its_field(corrupt: object, field: str | None) -> None:
    _, static, values = _static(_binary_header())
    static, values = corrupt(static, values)  # type: ignore[operator]
    if field is None:
        assert parse_header(_rebuilt(static, values)).tensors[0].shape == (2, 3)
        return
    with pytest.raises(FrameError) as err:
        parse_header(_rebuilt(static, values))
    assert err.value.field == field


def test_a_binary_header_with_bad_strings_or_ids_is_refused() -> None:
    _, static, values = _static(_binary_header(src="ab"))
    # src "ab" sits after lane (1) + prio (8) + kind "t" (2): make it invalid UTF-8
    bad = static[:11] + b"\x02\xff\xfe" + static[14:]
    with pytest.raises(FrameError, match="UTF-8"):
        parse_header(_rebuilt(bad, values))
    # the routing mask right after src: bit 7 names no id
    mask_at = 14
    with pytest.raises(FrameError) as err:
        parse_header(_rebuilt(static[:mask_at] + b"\x80" + static[mask_at + 1 :], values))
    assert err.value.field == "ids"
    with pytest.raises(FrameError) as err:
        parse_header(b"\xb1\x00")
    assert err.value.field == "header_bytes"


def test_a_cached_binary_header_still_checks_each_callers_cap() -> None:
    header = _binary_header(meta={"step": 2})
    assert parse_header(header, max_frame_bytes=16).tensors[0].nbytes == 16
    with pytest.raises(FrameError) as err:
        parse_header(header, max_frame_bytes=15)  # the same static part, now cached
    assert err.value.field == "tensors"


@_FUZZ
@given(st.binary(max_size=256))
def test_fuzz_garbage_binary_header(static: bytes) -> None:
    _decode_or_frame_error(_raw_frame(_rebuilt(static, b"")))
    _decode_or_frame_error(_raw_frame(b"\xb1" + static))


def test_binary_frames_share_their_static_part_across_routing_ids_and_meta_values() -> None:
    """Training's frames differ by microbatch: the integers travel apart from the cached part."""
    spec = [TensorSpec("x", "float32", (2, 2), 16)]
    heads = [
        encode_binary_header(
            "act",
            Lane.ACTIVATION,
            Routing(session="s", window=w, microbatch=m),
            "owner-0",
            1,
            {"n": m},
            spec,
        )  # fmt: skip
        for w, m in [(0, 1), (3, -7)]
    ]
    assert heads[0] is not None and heads[1] is not None
    size = struct.unpack_from(">H", heads[0], 5)[0]
    assert heads[0][: 7 + size] == heads[1][: 7 + size]  # prefix, start, static part
    a, b = (parse_header(h[4:]) for h in heads)
    assert (b.routing, b.meta) == (Routing(session="s", window=3, microbatch=-7), {"n": -7})
    assert a.routing == Routing(session="s", window=0, microbatch=1)
    again = parse_header(heads[0][4:])
    assert again == a and again.meta is not a.meta  # every frame gets its own meta dict
    # a routing id that is not an integer (a bool here) is the JSON form's to refuse
    assert (
        encode_binary_header("act", Lane.ACTIVATION, Routing(window=True), None, 0, {}, spec)
        is None
    )
