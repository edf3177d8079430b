"""Control-star messages: JSON round trips, unknown fields, the header cap, the in-process pipe."""

from __future__ import annotations

import json
import math
import struct

import pytest

from splitlab.control.messages import (
    Ack,
    BarrierAbort,
    BarrierCommit,
    Close,
    Nack,
    Propose,
    decode,
    encode,
)
from splitlab.errors import PeerLostError, ProtocolError, WaitTimeoutError
from splitlab.infer.ring_wire import CtrlChannel
from splitlab.wire.frame import Lane
from splitlab.wire.header import MAX_HEADER_BYTES
from splitlab.wire.inproc import InProcHub, InProcTransport

OBS = {"theta_obs": 41.2, "q_cmp_obs": 0.5, "q_mem_obs": 0.25, "link_obs": math.nan}


def _frame(fields: dict, *, v: int = 1, kind: str = "barrier_commit") -> bytes:
    """A frame as a peer could write it: the message's fields in the header's meta."""
    header = {"v": v, "kind": kind, "lane": "activation", "src": None, "prio": 0, "ids": {},
              "meta": fields, "tensors": []}  # fmt: skip
    body = json.dumps(header).encode()
    return struct.pack(">I", len(body)) + body


@pytest.mark.parametrize("msg", [
    Propose(epoch=3, token=60, cuts=(10, 20), decision="noop"),
    Ack(epoch=3, stage=2, obs={**OBS, "link_obs": 1.0}, stats={"compute_ms": 4.5}, prestage_ms=0.1),
    Nack(epoch=3, stage=1, reason="cannot"), BarrierCommit(epoch=3),
    BarrierAbort(epoch=3, reason="lost", fatal=True), Close(reason="end"),
])  # fmt: skip
def test_round_trip(msg) -> None:
    assert decode(encode(msg)) == msg


def test_nan_observation_travels_as_null_and_reads_back_as_none() -> None:
    got = decode(encode(Ack(epoch=1, stage=1, obs=OBS)))
    assert got.obs["link_obs"] is None  # the observation contract reads null as NaN


def test_a_nan_float_field_travels_as_null_and_reads_back_as_nan() -> None:
    got = decode(encode(Ack(epoch=1, stage=1, prestage_ms=math.nan)))
    assert isinstance(got, Ack) and math.isnan(got.prestage_ms)


def test_unknown_fields_are_ignored() -> None:
    assert decode(_frame({"epoch": 4, "future": [1, 2]})) == BarrierCommit(epoch=4)


@pytest.mark.parametrize(("patch", "match"), [
    ({"v": 2}, "version"), ({"kind": "reboot"}, "unknown"), ({"epoch": "4"}, "'epoch'"),
    ({"epoch": True}, "'epoch'"),
])  # fmt: skip
def test_bad_messages_are_named(patch, match) -> None:
    top = {k: patch.pop(k) for k in ("v", "kind") if k in patch}
    with pytest.raises(ProtocolError, match=match):
        decode(_frame({"epoch": 4, **patch}, **top))


def test_missing_required_field_is_named() -> None:
    with pytest.raises(ProtocolError, match="missing field 'token'"):
        decode(_frame({"epoch": 1}, kind="propose"))


def test_cap_is_enforced_both_ways() -> None:
    with pytest.raises(ProtocolError, match="cap"):
        encode(Nack(epoch=1, stage=1, reason="x" * MAX_HEADER_BYTES))
    with pytest.raises(ProtocolError, match="over"):
        decode(struct.pack(">I", MAX_HEADER_BYTES + 1) + b"{}")


def test_window_and_barrier_commits_are_distinct_kinds() -> None:
    with pytest.raises(ProtocolError, match="missing field 'session_id'"):
        decode(_frame({"epoch": 4}, kind="commit"))  # the window COMMIT is a bus message


def test_control_lane_pipe_times_out_and_reports_a_closed_peer() -> None:
    hub = InProcHub()
    a, b = InProcTransport("stage-0", hub), InProcTransport("stage-1", hub)
    head = CtrlChannel(a.channel("stage-1", Lane.CONTROL, timeout_s=0.05))
    stage = CtrlChannel(b.channel("stage-0", Lane.CONTROL, timeout_s=0.05))
    head.send(BarrierCommit(epoch=1))
    assert stage.recv() == BarrierCommit(epoch=1)
    with pytest.raises(WaitTimeoutError):
        stage.recv()
    a.close()
    with pytest.raises(PeerLostError, match="stage-0"):
        stage.recv()
    b.close()


def test_a_nan_observation_crosses_the_control_lane_as_null() -> None:
    hub = InProcHub()
    a, b = InProcTransport("stage-0", hub), InProcTransport("stage-1", hub)
    CtrlChannel(b.channel("stage-0", Lane.CONTROL, timeout_s=1)).send(
        Ack(epoch=1, stage=1, obs=OBS)
    )
    got = CtrlChannel(a.channel("stage-1", Lane.CONTROL, timeout_s=1)).recv()
    assert got == Ack(epoch=1, stage=1, obs={**OBS, "link_obs": None})
    a.close()
    b.close()
