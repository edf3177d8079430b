"""The data ring's route under the current cuts, and the cuts `architecture.bypass` allows."""

from __future__ import annotations

import pytest

from splitlab.errors import ConfigError
from splitlab.infer.reshard import check_cuts, moves_between, shift_cuts
from splitlab.infer.ring_wire import bypass_dials
from splitlab.infer.route import Route, route, stage_blocks


def test_every_stage_with_blocks_is_the_fixed_ring() -> None:
    got = [route(i, [3, 6], 9) for i in range(3)]
    assert [(r.source, r.target, r.skipped, r.active) for r in got] == [
        (2, 1, (), True), (0, 2, (), True), (1, 0, (), True),
    ]  # fmt: skip


def test_an_empty_middle_stage_is_skipped_and_reads_from_the_stage_before() -> None:
    head, empty, tail = (route(i, [6, 6], 9) for i in range(3))
    assert (head.target, head.skipped, head.fan_out()) == (2, (1,), (1, 2))
    assert (empty.active, empty.source, empty.target) == (False, 0, 2)
    assert (tail.source, tail.target) == (0, 0)
    # five stages, 2 and 3 empty: stage 1 sends to 4 and fans stop/abort out to 2, 3, 4
    r = route(1, [2, 4, 4, 4], 8)
    assert (r.target, r.skipped, route(4, [2, 4, 4, 4], 8).source) == (4, (2, 3), 1)
    assert stage_blocks([2, 4, 4, 4], 8) == [2, 2, 0, 0, 4]


def test_an_abort_fans_out_up_to_where_it_started() -> None:
    r = Route(stage=1, active=True, source=0, target=4, skipped=(2, 3))
    assert r.fan_out() == (2, 3, 4)
    assert r.fan_out(origin=3) == (2,)  # 3 started it: it has come round
    assert r.fan_out(origin=2) == () and r.fan_out(origin=0) == (2, 3, 4)


def test_the_head_and_the_tail_must_own_blocks() -> None:
    with pytest.raises(ValueError, match="head and the tail"):
        route(1, [0, 6], 9)


def test_bypass_lets_a_middle_stage_empty_and_nothing_else() -> None:
    assert check_cuts([6, 6], 9, bypass=True) == (6, 6)
    for bad in ([0, 6], [3, 9], [6, 5]):
        with pytest.raises(ConfigError, match="head and the tail"):
            check_cuts(bad, 9, bypass=True)
    with pytest.raises(ConfigError, match="every stage must own"):
        check_cuts([6, 6], 9)
    assert shift_cuts([3, 6], boundary=1, k=3, num_layers=9, bypass=True) == (6, 6)
    with pytest.raises(ConfigError, match="leaves a stage without blocks"):
        shift_cuts([3, 6], boundary=1, k=3, num_layers=9)
    (move,) = moves_between([3, 6], [3, 3], 9, bypass=True)
    assert (move.donor, move.receiver, move.layer_ids) == (1, 2, (3, 4, 5))
    with pytest.raises(ConfigError, match="neighbours only"):  # 0 -> 2 would skip stage 1
        moves_between([6, 6], [5, 5], 9, bypass=True)


def test_bypass_dials_every_later_stage_but_the_tail_from_the_head() -> None:
    assert [bypass_dials(i, 3) for i in range(3)] == [[], [], []]
    assert [bypass_dials(i, 5) for i in range(5)] == [[2, 3], [3, 4], [4], [], []]
