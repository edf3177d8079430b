"""The ring's channels: which peer and lane each one uses, and control messages as frames.

.venv/bin/pytest tests/unit/test_infer_ring_wire.py -q
"""

from __future__ import annotations

import pytest

from splitlab.control.messages import Ack, Propose
from splitlab.errors import ProtocolError
from splitlab.infer.ring_wire import ctrl_frame, ctrl_message, ring_links
from splitlab.wire.frame import FrameHeader, Lane, TensorSpec
from splitlab.wire.inproc import InProcHub, InProcTransport


def _ends(channel) -> tuple[str, Lane] | None:
    return None if channel is None else (channel.peer_id, channel.lane)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_three_stage_ring_channels_name_neighbours_and_head(stage: int) -> None:
    hub = InProcHub()
    t = InProcTransport(f"stage-{stage}", hub)
    links = ring_links(t, stage=stage, num_stages=3, window=2, timeout_s=9, ctrl_timeout_s=1)
    prev, nxt = f"stage-{(stage - 1) % 3}", f"stage-{(stage + 1) % 3}"
    assert _ends(links.up) == (prev, Lane.ACTIVATION) and links.up.timeout_s == 9
    assert _ends(links.down) == (nxt, Lane.ACTIVATION)
    assert _ends(links.kv_prev) == (None if stage == 0 else (prev, Lane.KV))
    assert _ends(links.kv_next) == (None if stage == 2 else (nxt, Lane.KV))
    if stage == 0:
        assert links.ctrl is None
        assert {i: _ends(c.channel) for i, c in links.ctrls.items()} == {
            1: ("stage-1", Lane.CONTROL), 2: ("stage-2", Lane.CONTROL)}  # fmt: skip
    else:
        assert links.ctrls == {} and _ends(links.ctrl.channel) == ("stage-0", Lane.CONTROL)
    t.close()


def test_without_a_window_there_is_no_kv_or_control() -> None:
    t = InProcTransport("stage-1", InProcHub())
    links = ring_links(t, stage=1, num_stages=3, window=0, timeout_s=9, ctrl_timeout_s=1)
    assert (links.kv_prev, links.kv_next, links.ctrl, links.ctrls) == (None, None, None, {})
    t.close()


@pytest.mark.parametrize("msg", [
    Ack(epoch=2, stage=1, obs=None, stats={"compute_ms": 1.5}, prestage_ms=0.25),
    Propose(epoch=1, token=4, cuts=(2,)),
])  # fmt: skip
def test_a_control_message_is_a_frame_kind_and_json_meta(msg) -> None:
    kind, meta = ctrl_frame(msg)
    assert kind == msg.KIND.value and meta["epoch"] == msg.epoch
    assert ctrl_message(FrameHeader(kind=kind, lane=Lane.CONTROL, meta=meta)) == msg


def test_a_control_frame_that_carries_tensors_is_refused_naming_them() -> None:
    kind, meta = ctrl_frame(Propose(epoch=1, token=4, cuts=(2,)))
    header = FrameHeader(kind=kind, lane=Lane.CONTROL, meta=meta,
                         tensors=(TensorSpec("x", "uint8", (4,), 4),))  # fmt: skip
    with pytest.raises(ProtocolError, match=r"propose message .* carries tensors \['x'\]"):
        ctrl_message(header)
