"""The transport delay line: frames leave at arrival + delay (+ jitter), in order per key.

.venv/bin/pytest tests/unit/test_wire_delay.py -q
"""

from __future__ import annotations

import threading
import time

import pytest

from splitlab.wire.base import SENT, SendTicket
from splitlab.wire.delay import DelayLine, PathDelay, due_s

TOLERANCE_S = 0.050  # scheduling slack on a loaded 2-core host; the lower bound is exact


def test_due_time_adds_delay_and_jitter_within_bounds() -> None:
    path = PathDelay(delay_ms=20.0, jitter_ms=5.0)
    assert due_s(1.0, 0.0, path, 0.5) == pytest.approx(1.020)
    assert due_s(1.0, 0.0, path, 0.0) == pytest.approx(1.015)
    assert due_s(1.0, 0.0, path, 0.999999) == pytest.approx(1.025, abs=1e-6)


def test_due_time_never_precedes_the_frame_ahead() -> None:
    path = PathDelay(delay_ms=20.0, jitter_ms=10.0)
    assert due_s(1.0, 1.029, path, 0.0) == 1.029  # jittered early, held behind the previous


def test_path_delay_refuses_jitter_above_delay() -> None:
    with pytest.raises(ValueError, match="jitter_ms=5"):
        PathDelay(delay_ms=2.0, jitter_ms=5.0)


def _recorder(log: list[tuple[str, int, float]], key: str, i: int):
    def deliver() -> SendTicket:
        log.append((key, i, time.monotonic()))
        return SENT

    return deliver


def test_frames_leave_after_their_delay_within_tolerance() -> None:
    line = DelayLine(default=PathDelay(delay_ms=30.0))
    log: list[tuple[str, int, float]] = []
    sent_at = []
    try:
        for i in range(5):
            sent_at.append(time.monotonic())
            ticket = line.submit("a", "peer", _recorder(log, "a", i))
            time.sleep(0.01)
        ticket.wait(5.0)
    finally:
        line.close()
    assert [i for _, i, _ in log] == list(range(5))
    for (_, i, t), t0 in zip(log, sent_at, strict=True):
        assert 0.030 <= t - t0 <= 0.030 + TOLERANCE_S, (i, t - t0)


def test_jittered_frames_stay_in_order_per_key() -> None:
    line = DelayLine(default=PathDelay(delay_ms=10.0, jitter_ms=10.0), seed=3)
    log: list[tuple[str, int, float]] = []
    try:
        tickets = [line.submit(k, "peer", _recorder(log, k, i)) for i in range(100) for k in "ab"]
        for t in tickets:
            t.wait(5.0)
    finally:
        line.close()
    for key in "ab":
        assert [i for k, i, _ in log if k == key] == list(range(100))


def test_peer_paths_override_the_default() -> None:
    line = DelayLine(default=PathDelay(), paths={"far": PathDelay(delay_ms=40.0)})
    log: list[tuple[str, int, float]] = []
    try:
        t0 = time.monotonic()
        far = line.submit("f", "far", _recorder(log, "far", 0))
        near = line.submit("n", "near", _recorder(log, "near", 0))
        near.wait(5.0)
        far.wait(5.0)
    finally:
        line.close()
    when = {k: t - t0 for k, _, t in log}
    assert when["near"] < 0.040 <= when["far"]
    assert [k for k, _, _ in log] == ["near", "far"]


def test_ticket_waits_for_the_inner_send_and_carries_its_error() -> None:
    inner = SendTicket()
    line = DelayLine(default=PathDelay(delay_ms=1.0))
    try:
        ticket = line.submit("a", "p", lambda: inner)
        time.sleep(0.05)
        assert not ticket.done()
        threading.Timer(0.05, inner.finish, args=(ConnectionError("peer gone"),)).start()
        with pytest.raises(ConnectionError, match="peer gone"):
            ticket.wait(5.0)
        failing = line.submit("a", "p", lambda: (_ for _ in ()).throw(OSError("no route")))
        with pytest.raises(OSError, match="no route"):
            failing.wait(5.0)
    finally:
        line.close()


def test_close_hands_on_what_is_queued() -> None:
    line = DelayLine(default=PathDelay(delay_ms=20.0))
    log: list[tuple[str, int, float]] = []
    for i in range(3):
        line.submit("a", "p", _recorder(log, "a", i))
    line.close(drain_timeout_s=5.0)
    assert [i for _, i, _ in log] == [0, 1, 2]
    with pytest.raises(RuntimeError, match="closed"):
        line.submit("a", "p", _recorder(log, "a", 9))


def test_describe_reports_how_long_frames_were_held_per_peer() -> None:
    line = DelayLine(default=PathDelay(delay_ms=0.0), paths={"b": PathDelay(delay_ms=30.0)})
    try:
        tickets = [line.submit(("b", 0), "b", lambda: SENT) for _ in range(3)]
        for ticket in tickets:
            ticket.wait(5.0)
        held = line.describe()["held_ms"]["b"]
    finally:
        line.close()
    assert held["frames"] == 3
    assert 30.0 <= held["min_ms"] <= held["mean_ms"] <= 30.0 + TOLERANCE_S * 1e3
