"""PhaseTimes: wall milliseconds per phase of a scheduler window, and the CPU it got.

.venv/bin/pytest tests/unit/test_train_phases.py -q
"""

from __future__ import annotations

import pytest

from splitlab.train.phases import PhaseTimes


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_phases_add_up_per_name_and_wall_covers_the_window() -> None:
    wall, cpu = FakeClock(), FakeClock()
    times = PhaseTimes(clock=wall, cpu_clock=cpu)

    for seconds in (0.010, 0.030):
        with times.phase("body_fwd"):
            wall.now += seconds
    with times.phase("idle"):
        wall.now += 0.005
    wall.now += 0.001  # time outside any phase still counts in wall_ms
    cpu.now += 0.020
    out = times.take()

    assert out["body_fwd_ms"] == pytest.approx(40.0)
    assert out["idle_ms"] == pytest.approx(5.0)
    assert out["wall_ms"] == pytest.approx(46.0)
    assert out["cpu_ms"] == pytest.approx(20.0)


def test_take_starts_the_next_window_from_zero() -> None:
    wall = FakeClock()
    times = PhaseTimes(clock=wall, cpu_clock=FakeClock())
    with times.phase("send"):
        wall.now += 1.0
    times.take()

    with times.phase("recv"):
        wall.now += 0.5
    out = times.take()

    assert "send_ms" not in out
    assert out["recv_ms"] == pytest.approx(500.0)
    assert out["wall_ms"] == pytest.approx(500.0)


def test_a_failing_phase_is_still_counted() -> None:
    wall = FakeClock()
    times = PhaseTimes(clock=wall, cpu_clock=FakeClock())

    with pytest.raises(RuntimeError), times.phase("tail"):
        wall.now += 0.25
        raise RuntimeError("boom")

    assert times.take()["tail_ms"] == pytest.approx(250.0)
