"""Window accounting: credits, quotas, partial windows, the barrier order and the ledger."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from splitlab.errors import ConfigError, ProtocolError
from splitlab.train.window import (
    InflightLedger,
    Phase,
    WindowBarrier,
    effective_credit,
    next_dispatch,
    num_windows,
    owner_window_counts,
    planned_counts,
    round_schedule,
)
from splitlab.train.wrr import SmoothWRR


@pytest.mark.parametrize(
    ("max_inflight", "worker_max", "owners", "expected"),
    [(2, 8, 4, 2), (2, 8, 1, 2), (8, 8, 3, 2), (3, 3, 3, 1), (1, 100, 2, 1)],
)
def test_credit_is_min_of_owner_limit_and_worker_share(
    max_inflight: int, worker_max: int, owners: int, expected: int
) -> None:
    credit = effective_credit(
        max_inflight=max_inflight, worker_max_inflight=worker_max, num_owners=owners
    )

    assert credit == expected


def test_credit_rejects_worker_limit_below_owner_count() -> None:
    with pytest.raises(ConfigError, match="worker_max_inflight=2"):
        effective_credit(max_inflight=2, worker_max_inflight=2, num_owners=3)
    with pytest.raises(ConfigError, match="max_inflight=0"):
        effective_credit(max_inflight=0, worker_max_inflight=2, num_owners=1)


def test_schedule_with_partial_and_empty_owners() -> None:
    schedule = round_schedule({"o0": 5, "o1": 2, "o2": 0}, quota=3)

    assert schedule == [{"o0": 3, "o1": 2, "o2": 0}, {"o0": 2, "o1": 0, "o2": 0}]


def test_schedule_with_no_data_has_no_windows() -> None:
    assert round_schedule({"o0": 0}, quota=3) == []
    with pytest.raises(ConfigError):
        num_windows({"o0": 1}, quota=0)


@settings(max_examples=200, deadline=None)
@given(
    counts=st.dictionaries(st.sampled_from("abcde"), st.integers(0, 40), min_size=1),
    quota=st.integers(1, 9),
)
def test_schedule_properties(counts: dict[str, int], quota: int) -> None:
    schedule = round_schedule(counts, quota)

    for owner, count in counts.items():
        per_window = [window[owner] for window in schedule]
        assert sum(per_window) == count
        assert all(0 <= n <= quota for n in per_window)
        # full windows, at most one partial, then empty windows
        assert per_window == sorted(per_window, reverse=True)
        assert sum(0 < n < quota for n in per_window) <= 1
    assert all(any(window.values()) for window in schedule)  # no window is empty for everyone


def test_owner_window_counts_rejects_overflow() -> None:
    with pytest.raises(ValueError):
        owner_window_counts(7, 3, 2)


def _barrier() -> WindowBarrier:
    return WindowBarrier(window_id=4, owners=("o0", "o1", "o2"), workers=("w0", "w1"))


def _run_to_drained(barrier: WindowBarrier) -> None:
    barrier.plan("o0", {"w0": 2, "w1": 1})
    barrier.plan("o1", {"w0": 1, "w1": 1})
    barrier.plan("o2", {})
    barrier.open("w1")
    barrier.open("w0")
    barrier.drain("o2", 0)
    barrier.drain("o0", 3)
    barrier.drain("o1", 2)


def test_full_window_reaches_committed_with_commits_after_all_drained() -> None:
    barrier = _barrier()

    _run_to_drained(barrier)
    barrier.commit("w0", 3)
    barrier.commit("w1", 2)

    assert barrier.phase is Phase.COMMITTED
    kinds = [kind for kind, _ in barrier.events]
    assert kinds.index("commit") > max(i for i, k in enumerate(kinds) if k == "drained")
    assert barrier.group_total == 5


def test_empty_owner_joins_the_barrier_without_a_step() -> None:
    barrier = _barrier()
    _run_to_drained(barrier)

    assert not barrier.steps("o2")
    assert barrier.steps("o0") and barrier.steps("w1")


def test_worker_without_work_does_not_step() -> None:
    barrier = WindowBarrier(window_id=1, owners=("o0",), workers=("w0", "w1"))
    barrier.plan("o0", {"w0": 1})

    assert barrier.worker_total("w1") == 0
    assert not barrier.steps("w1")


def test_commit_before_every_drained_is_a_protocol_error() -> None:
    barrier = _barrier()
    barrier.plan("o0", {"w0": 1})
    barrier.plan("o1", {"w0": 1})
    barrier.plan("o2", {})
    barrier.open("w0")
    barrier.open("w1")
    barrier.drain("o0", 1)

    with pytest.raises(ProtocolError, match="'w0' sent COMMIT out of order"):
        barrier.commit("w0", 2)


@pytest.mark.parametrize(
    ("action", "match"),
    [
        (lambda b: b.open("w0"), "OPEN out of order"),
        (lambda b: b.plan("zz", {}), "not in the group"),
        (lambda b: b.plan("o0", {"w9": 1}), "invalid counts"),
        (lambda b: b.plan("o0", {"w0": -1}), "invalid counts"),
    ],
)
def test_bad_events_name_the_node(action: object, match: str) -> None:
    barrier = _barrier()

    with pytest.raises(ProtocolError, match=match):
        action(barrier)  # type: ignore[operator]


def test_duplicate_and_miscounted_events_are_rejected() -> None:
    barrier = _barrier()
    barrier.plan("o0", {"w0": 1})
    with pytest.raises(ProtocolError, match="second PLAN"):
        barrier.plan("o0", {"w0": 1})
    barrier.plan("o1", {})
    barrier.plan("o2", {})
    barrier.open("w0")
    barrier.open("w1")
    with pytest.raises(ProtocolError, match="drained 2 microbatches, planned 1"):
        barrier.drain("o0", 2)


def test_abort_keeps_first_reason() -> None:
    barrier = _barrier()
    barrier.abort("w1", "timeout waiting for o0")
    barrier.abort("o0", "peer lost")

    assert barrier.phase is Phase.ABORTED
    assert barrier.abort_reason == "w1: timeout waiting for o0"


def test_planned_counts_from_wrr_assignment() -> None:
    assignment = SmoothWRR({"w0": 3.0, "w1": 1.0}).assign(4)

    assert planned_counts(assignment, ["w0", "w1", "w2"]) == {"w0": 3, "w1": 1, "w2": 0}


def test_ledger_pins_and_releases() -> None:
    ledger = InflightLedger(total=2, credit_by_peer={"w0": 1, "w1": 2})
    ledger.admit("mb0", "w0")

    assert not ledger.can_admit("w0")
    assert ledger.can_admit("w1")
    assert ledger.peer_of("mb0") == "w0"
    assert ledger.release("mb0") == "w0"
    assert ledger.can_admit("w0")


def test_ledger_rejects_over_credit_and_double_release() -> None:
    ledger = InflightLedger(total=3, credit_by_peer={"w0": 1})
    ledger.admit("mb0", "w0")

    with pytest.raises(ProtocolError, match="exceeds credit on 'w0'"):
        ledger.admit("mb1", "w0")
    with pytest.raises(ProtocolError, match="already live"):
        ledger.admit("mb0", "w0")
    ledger.release("mb0")
    with pytest.raises(ProtocolError, match="not live"):
        ledger.release("mb0")


def test_next_dispatch_skips_a_busy_worker() -> None:
    ledger = InflightLedger(total=4, credit_by_peer={"w0": 1, "w1": 1})
    ledger.admit("mb0", "w0")

    assert next_dispatch(["w0", "w0", "w1"], ledger) == 2
    ledger.admit("mb1", "w1")
    assert next_dispatch(["w0", "w1"], ledger) is None


def test_next_dispatch_respects_owner_total() -> None:
    ledger = InflightLedger(total=1, credit_by_peer={"w0": 2, "w1": 2})
    ledger.admit("mb0", "w0")

    assert next_dispatch(["w1"], ledger) is None


@settings(max_examples=100, deadline=None)
@given(
    credits=st.lists(st.integers(1, 3), min_size=1, max_size=3),
    total=st.integers(1, 6),
    order=st.lists(st.integers(0, 2), max_size=30),
    seed=st.randoms(use_true_random=False),
)
def test_ledger_never_exceeds_limits(
    credits: list[int], total: int, order: list[int], seed: object
) -> None:
    peers = [f"w{i}" for i in range(len(credits))]
    ledger = InflightLedger(total=total, credit_by_peer=dict(zip(peers, credits, strict=True)))
    pending = [peers[i % len(peers)] for i in order]
    live: list[int] = []
    next_id = 0

    while pending or live:
        index = next_dispatch(pending, ledger)
        if index is not None and (not live or seed.random() < 0.6):  # type: ignore[attr-defined]
            ledger.admit(next_id, pending.pop(index))
            live.append(next_id)
            next_id += 1
        else:
            assert live, "stalled with nothing live"
            ledger.release(live.pop(seed.randrange(len(live))))  # type: ignore[attr-defined]
        assert ledger.live <= total
        assert all(ledger.live_on(p) <= c for p, c in zip(peers, credits, strict=True))
    assert next_id == len(order)
