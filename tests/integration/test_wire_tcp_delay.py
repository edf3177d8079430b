"""The TCP transport with a delay line (a testbed link's one-way delay) over real sockets.

.venv/bin/pytest tests/integration/test_wire_tcp_delay.py -q
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from splitlab.telemetry.trace import Tracer
from splitlab.wire.delay import DelayLine, PathDelay
from splitlab.wire.frame import Lane

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ is not a package yet
from wire_helpers import tcp_transport  # noqa: E402

DELAY_S = 0.040
SLACK_S = 0.100  # loopback transfer plus scheduling on a loaded 2-core host


def test_frames_arrive_after_the_path_delay_in_order(tmp_path: Path) -> None:
    tracer = Tracer.open(tmp_path / "a.jsonl", role="a", rank=0)
    line = DelayLine(
        default=PathDelay(), paths={"b": PathDelay(delay_ms=DELAY_S * 1e3, jitter_ms=10)}
    )
    a = tcp_transport("a", "127.0.0.2", delay=line, tracer=tracer)
    b = tcp_transport("b", "127.0.0.3")
    try:
        a.connect("b", *b.address, timeout_s=5)
        sent_at, got = [], []
        tensors = [{"x": torch.full((64, 64), float(i))} for i in range(8)]
        for t in tensors:
            sent_at.append(time.monotonic())
            a.send("b", Lane.ACTIVATION, "act", t)
            time.sleep(0.005)
        for _ in tensors:
            with b.recv(Lane.ACTIVATION, timeout_s=5) as msg:
                got.append((time.monotonic(), int(msg.tensors["x"][0, 0])))
    finally:
        a.close(drain_timeout_s=2)
        b.close(drain_timeout_s=2)
        tracer.close()
    assert [i for _, i in got] == list(range(8))
    lags = [t - t0 for (t, _), t0 in zip(got, sent_at, strict=True)]
    assert min(lags) >= DELAY_S - 0.010, lags  # jitter may take 10 ms off
    assert max(lags) <= DELAY_S + 0.010 + SLACK_S, lags
    records = [json.loads(line) for line in (tmp_path / "a.jsonl").read_text().splitlines()]
    transport = [r for r in records if r["kind"] == "transport"]
    assert transport and transport[0]["delay_source"] == "transport"
    assert transport[0]["path_delay_ms"] == {"b": DELAY_S * 1e3}


def test_without_a_delay_line_the_transport_adds_none() -> None:
    a = tcp_transport("a", "127.0.0.2")
    b = tcp_transport("b", "127.0.0.3")
    try:
        a.connect("b", *b.address, timeout_s=5)
        assert a.delay is None
        t0 = time.monotonic()
        a.send("b", Lane.ACTIVATION, "act", {"x": torch.zeros(4)}).wait(5)
        with b.recv(Lane.ACTIVATION, timeout_s=5) as msg:
            assert msg.kind == "act"
        assert time.monotonic() - t0 < DELAY_S + SLACK_S
    finally:
        a.close(drain_timeout_s=1)
        b.close(drain_timeout_s=1)
