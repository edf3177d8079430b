"""Control-star messages: JSON round trips, unknown fields, the 8 KiB cap, the in-process pipe."""

from __future__ import annotations

import math

import pytest

from splitlab.errors import PeerLostError, ProtocolError, WaitTimeoutError
from splitlab.infer.ctrl import (
    MAX_CTRL_BYTES,
    Abort,
    Ack,
    Close,
    Commit,
    Nack,
    Propose,
    decode,
    encode,
)
from splitlab.infer.ctrl_link import queue_pair

OBS = {"theta_obs": 41.2, "q_cmp_obs": 0.5, "q_mem_obs": 0.25, "link_obs": math.nan}


@pytest.mark.parametrize("msg", [
    Propose(epoch=3, token=60, cuts=(10, 20), decision="noop"),
    Ack(epoch=3, stage=2, obs={**OBS, "link_obs": 1.0}, stats={"compute_ms": 4.5}, prestage_ms=0.1),
    Nack(epoch=3, stage=1, reason="cannot"), Commit(epoch=3),
    Abort(epoch=3, reason="lost", fatal=True), Close(reason="end"),
])  # fmt: skip
def test_round_trip(msg) -> None:
    assert decode(encode(msg)) == msg


def test_nan_observation_travels_as_null_and_reads_back_as_none() -> None:
    got = decode(encode(Ack(epoch=1, stage=1, obs=OBS)))
    assert got.obs["link_obs"] is None  # the observation contract reads null as NaN


def test_unknown_fields_are_ignored() -> None:
    import json
    import struct

    body = json.dumps({"v": 1, "kind": "commit", "epoch": 4, "future": [1, 2]}).encode()
    assert decode(struct.pack(">I", len(body)) + body) == Commit(epoch=4)


@pytest.mark.parametrize(("patch", "match"), [
    ({"v": 2}, "version"), ({"kind": "reboot"}, "unknown"), ({"epoch": "4"}, "'epoch'"),
    ({"epoch": True}, "'epoch'"),
])  # fmt: skip
def test_bad_messages_are_named(patch, match) -> None:
    import json
    import struct

    body = json.dumps({"v": 1, "kind": "commit", "epoch": 4, **patch}).encode()
    with pytest.raises(ProtocolError, match=match):
        decode(struct.pack(">I", len(body)) + body)


def test_missing_required_field_is_named() -> None:
    import json
    import struct

    body = json.dumps({"v": 1, "kind": "propose", "epoch": 1}).encode()
    with pytest.raises(ProtocolError, match="missing field 'token'"):
        decode(struct.pack(">I", len(body)) + body)


def test_cap_is_enforced_both_ways() -> None:
    with pytest.raises(ProtocolError, match="cap"):
        encode(Nack(epoch=1, stage=1, reason="x" * MAX_CTRL_BYTES))
    import struct

    with pytest.raises(ProtocolError, match="over"):
        decode(struct.pack(">I", MAX_CTRL_BYTES + 1) + b"{}")


def test_queue_pair_times_out_and_reports_a_closed_peer() -> None:
    head, stage = queue_pair("stage-0", "stage-1", timeout_s=0.05)
    head.send(Commit(epoch=1))
    assert stage.recv() == Commit(epoch=1)
    with pytest.raises(WaitTimeoutError):
        stage.recv()
    head.close()
    with pytest.raises(PeerLostError, match="stage-0"):
        stage.recv()
