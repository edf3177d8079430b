"""Message codec: round trips, unknown fields tolerated, malformed input rejected by name.

.venv/bin/pytest tests/unit/test_control_messages.py -q
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from splitlab.control.messages import (
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    Abort,
    BusMessage,
    Commit,
    Kind,
    Message,
    Plan,
    Register,
    Start,
    Update,
    _schema,
    decode,
    encode,
)
from splitlab.errors import ProtocolError

_SAFETENSORS_EMPTY = struct.pack("<Q", 2) + b"{}"


BUS_KINDS = [k for k, cls in MESSAGE_TYPES.items() if issubclass(cls, BusMessage)]


def _frame(header: dict, blob: bytes = b"", tensors: list | None = None) -> bytes:
    """A frame as a peer could write it: `v` and `kind` on top, every other field in `meta`."""
    meta = {k: v for k, v in header.items() if k not in ("v", "kind")}
    raw = json.dumps({"v": header["v"], "kind": header["kind"], "lane": "activation", "src": None,
                      "prio": 0, "ids": {}, "meta": meta, "tensors": tensors or []}).encode()  # fmt: skip
    return struct.pack(">I", len(raw)) + raw + blob


def _sample(kind: Kind) -> Message:
    common = {"session_id": "s1", "sender": "n0", "window_id": 3, "microbatch_id": 1}
    extra = {
        Kind.REGISTER: {
            "role": "owner",
            "compute_weight": 2.5,
            "host": "10.0.0.1",
            "port": 20000,
            "incarnation": 7,
        },
        Kind.START: {
            "round_id": 0,
            "plan": {"a": [1, 2]},
            "roster": [{"node_id": "n0"}],
        },
        Kind.PLAN: {"counts_by_worker": {"w0": 3, "w1": 1}},
        Kind.OPEN: {"group_total": 4, "credit": 2},
        Kind.DRAINED: {"num_microbatches": 4},
        Kind.COMMIT: {"num_microbatches": 4, "tokens_per_s": 123.5},
        Kind.ABORT: {"reason": "timeout", "cause_node": "w1"},
        Kind.UPDATE: {
            "round_id": 2,
            "num_samples": 10,
            "partition": "body",
            "weights": _SAFETENSORS_EMPTY,
        },
        Kind.FAILED: {"reason": "oom", "exit_code": 1},
        Kind.STOP: {"reason": "done"},
    }[kind]
    return MESSAGE_TYPES[kind](**common, **extra)


@pytest.mark.parametrize("kind", BUS_KINDS)
def test_every_kind_round_trips(kind: Kind) -> None:
    msg = _sample(kind)
    assert decode(encode(msg)) == msg


def test_header_is_json_with_kind_and_version() -> None:
    data = encode(_sample(Kind.PLAN))
    header = json.loads(data[4:])
    assert (header["kind"], header["v"]) == ("plan", PROTOCOL_VERSION)


def test_update_weights_travel_as_raw_bytes_not_in_the_header() -> None:
    msg = _sample(Kind.UPDATE)
    data = encode(msg)
    assert data.endswith(_SAFETENSORS_EMPTY)
    header = json.loads(data[4 : 4 + struct.unpack(">I", data[:4])[0]])
    assert "weights" not in header and "weights" not in header["meta"]


def test_unknown_fields_are_ignored() -> None:
    header = _sample(Kind.OPEN).to_dict() | {"from_the_future": {"x": 1}}
    assert decode(_frame(header)) == _sample(Kind.OPEN)


def test_missing_optional_field_takes_its_default() -> None:
    header = {"v": 1, "kind": "commit", "session_id": "s", "sender": "w"}
    assert decode(_frame(header)) == Commit(session_id="s", sender="w")


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"v": 2}, "version"),
        ({"kind": "exec"}, "unknown control message kind"),
        ({"credit": "2"}, "open.credit"),
        ({"credit": True}, "open.credit"),
    ],
)
def test_malformed_header_names_the_problem(change: dict, needle: str) -> None:
    header = _sample(Kind.OPEN).to_dict() | change
    with pytest.raises(ProtocolError, match=needle):
        decode(_frame(header))


@pytest.mark.parametrize(("kind", "blob", "needle"), [
    (Kind.UPDATE, b"", "payload bytes announced"), (Kind.OPEN, b"\0" * 5, "unexpected payload"),
])  # fmt: skip
def test_payload_must_be_what_the_header_announces(kind: Kind, blob: bytes, needle: str) -> None:
    spec = {"name": "weights", "dtype": "uint8", "shape": [5], "bytes": 5}
    with pytest.raises(ProtocolError, match=needle):
        decode(_frame(_sample(kind).to_dict(), blob, [spec]))


def test_missing_required_field_is_named() -> None:
    header = _sample(Kind.ABORT).to_dict()
    del header["cause_node"]
    with pytest.raises(ProtocolError, match="cause_node"):
        decode(_frame(header))


def test_nested_types_are_checked() -> None:
    header = _sample(Kind.PLAN).to_dict() | {"counts_by_worker": {"w0": 1.5}}
    with pytest.raises(ProtocolError, match="counts_by_worker"):
        decode(_frame(header))


def test_update_with_non_safetensors_weights_is_rejected() -> None:
    bad = Update(
        session_id="s",
        sender="o",
        round_id=0,
        num_samples=1,
        partition="owner",
        weights=b"\x80\x04pickle",
    )
    with pytest.raises(ProtocolError, match="safetensors"):
        decode(encode(bad))


@pytest.mark.parametrize(
    "data",
    [b"", b"\x00\x00", b"\x00\x00\x00\x05ab", b"\x00\x00\x00\x02[]", b"\x00\x00\x00\x01\xff"],
)
def test_garbage_is_a_protocol_error(data: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode(data)


@given(st.binary(max_size=64))
def test_decode_never_raises_anything_but_protocol_error(data: bytes) -> None:
    try:
        message = decode(data)
    except ProtocolError:
        return
    assert message.kind in MESSAGE_TYPES  # anything that decodes is a known message


@given(
    st.dictionaries(st.text(max_size=8), st.integers(0, 10**6), max_size=5),
    st.integers(0, 10**9),
    st.text(max_size=20),
)
def test_plan_round_trips_any_counts(counts: dict[str, int], window: int, sender: str) -> None:
    msg = Plan(session_id="s", sender=sender, window_id=window, counts_by_worker=counts)
    assert decode(encode(msg)) == msg


def test_dedup_key_of_window_messages_has_session_window_kind_sender_microbatch() -> None:
    msg = _sample(Kind.COMMIT)
    assert msg.dedup_key() == ("s1", 3, Kind.COMMIT, "n0", 1)


def test_register_and_start_keys_distinguish_incarnation_and_round() -> None:
    r0, r1 = (Register(session_id="s", sender="n", role="owner", incarnation=i) for i in (0, 1))
    s0 = Start(session_id="s", sender="c", round_id=0, plan={}, roster=[])
    s1 = Start(session_id="s", sender="c", round_id=1, plan={}, roster=[])
    assert r0.dedup_key() != r1.dedup_key() and s0.dedup_key() != s1.dedup_key()


def test_field_checks_are_resolved_once_per_class() -> None:
    data = encode(_sample(Kind.OPEN))
    decode(data)
    misses = _schema.cache_info().misses
    decode(data)
    assert _schema.cache_info().misses == misses


def test_non_finite_metrics_travel_as_null() -> None:
    msg = Update(session_id="s", sender="o", round_id=0, num_samples=1, partition="owner",
                 metrics={"loss": float("nan"), "acc": 0.5})  # fmt: skip
    assert decode(encode(msg)).metrics == {"loss": None, "acc": 0.5}


def test_abort_kind_property() -> None:
    assert Abort(session_id="s", sender="a", reason="r", cause_node="a").kind is Kind.ABORT


@pytest.mark.parametrize(
    ("kind", "change", "needle"),
    [
        (Kind.REGISTER, {"compute_weight": math.nan}, "'compute_weight' = nan"),
        (Kind.REGISTER, {"compute_weight": -1e308}, "'compute_weight' = -1e+308"),
        (Kind.REGISTER, {"compute_weight": 0.0}, "'compute_weight' = 0.0"),
        (Kind.REGISTER, {"port": 70000}, "'port' = 70000"),
        (Kind.REGISTER, {"port": -1}, "'port' = -1"),
        (Kind.REGISTER, {"incarnation": -1}, "'incarnation' = -1"),
        (Kind.UPDATE, {"num_samples": -5}, "'num_samples' = -5"),
        (Kind.UPDATE, {"round_id": -1}, "'round_id' = -1"),
        (Kind.START, {"round_id": -2}, "'round_id' = -2"),
        (Kind.PLAN, {"counts_by_worker": {"w0": -1}}, "'counts_by_worker'"),
        (Kind.OPEN, {"credit": -3}, "'credit' = -3"),
        (Kind.DRAINED, {"num_microbatches": -1}, "'num_microbatches' = -1"),
        (Kind.COMMIT, {"tokens_per_s": -1.0}, "'tokens_per_s' = -1.0"),
        (Kind.STOP, {"window_id": -1}, "'window_id' = -1"),
        (Kind.ABORT, {"microbatch_id": -2}, "'microbatch_id' = -2"),
    ],
)
def test_out_of_range_fields_are_refused_at_decode_by_name(
    kind: Kind, change: dict, needle: str
) -> None:
    data = encode(dataclasses.replace(_sample(kind), **change))  # the sender checks nothing
    with pytest.raises(ProtocolError, match=re.escape(f"{kind.value}: field {needle}")):
        decode(data)


def test_edge_values_in_range_are_accepted() -> None:
    cases = [(Kind.REGISTER, {"port": 0}), (Kind.REGISTER, {"port": 65535}),
             (Kind.REGISTER, {"compute_weight": 1e-9}), (Kind.UPDATE, {"num_samples": 0}),
             (Kind.COMMIT, {"tokens_per_s": None})]  # fmt: skip
    for kind, change in cases:
        msg = dataclasses.replace(_sample(kind), **change)
        assert decode(encode(msg)) == msg
