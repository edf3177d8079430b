"""The window protocol over each bus: reorder and duplicates, ABORT first, lockstep windows.

SPLITLAB_REQUIRE_BROKER=1 .venv/bin/pytest tests/integration/test_control_protocol.py -q
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator

import pytest
from control_helpers import BUS_KINDS, BusFactory, open_buses

from splitlab.control.bus import make_bus
from splitlab.control.endpoint import ControlEndpoint
from splitlab.control.messages import Abort, Commit, Drained, Kind, Open, Plan
from splitlab.errors import AbortedError, ProtocolError, WaitTimeoutError

WORKERS = ["w0", "w1", "w2"]


@pytest.fixture(params=BUS_KINDS)
def buses(request: pytest.FixtureRequest) -> Iterator[BusFactory]:
    yield from open_buses(request.param)


def _open(session: str, worker: str, window: int) -> Open:
    return Open(session_id=session, sender=worker, window_id=window, group_total=6, credit=2)


def test_reordered_and_duplicated_opens_complete_the_barrier_once(buses: BusFactory) -> None:
    # Prepare: the owner is in window 2; workers' OPENs arrive shuffled, duplicated and
    # mixed with stale ones from window 1.
    owner = ControlEndpoint(buses.open("o0"), window_id=2)
    senders = {w: buses.open(w) for w in WORKERS}  # each publishes as itself
    current = [_open(buses.session, w, 2) for w in WORKERS]
    stale = [_open(buses.session, w, 1) for w in WORKERS]
    deliveries = current * 2 + stale
    random.Random(7).shuffle(deliveries)
    for msg in deliveries:
        senders[msg.sender].publish("o0", msg)
    # Execute
    got = owner.collect(Kind.OPEN, WORKERS, timeout_s=10.0)
    leftover = owner.poll(0.5)
    # Assert
    assert got == {m.sender: m for m in current}
    assert leftover is None
    assert (owner.inbox.num_duplicates, owner.inbox.num_stale) == (3, 3)


def test_late_duplicates_after_the_window_moved_on_are_dropped(buses: BusFactory) -> None:
    owner = ControlEndpoint(buses.open("o0"), window_id=2)
    sender = buses.open("w0")
    sender.publish("o0", _open(buses.session, "w0", 2))
    owner.collect(Kind.OPEN, ["w0"], timeout_s=10.0)
    owner.advance(3)
    sender.publish("o0", _open(buses.session, "w0", 2))
    assert owner.poll(0.5) is None and owner.inbox.num_stale == 1


def test_abort_behind_other_messages_is_seen_first(buses: BusFactory) -> None:
    worker = ControlEndpoint(buses.open("w0"))
    owner = buses.open("o0")
    for mb in range(3):
        owner.publish(
            "w0",
            Plan(
                session_id=buses.session, sender="o0", microbatch_id=mb, counts_by_worker={"w0": 1}
            ),
        )
    buses.open("o1").publish(
        "w0", Abort(session_id=buses.session, sender="o1", reason="loss is NaN", cause_node="o1")
    )
    # All four buffered first: on RabbitMQ the abort comes over another connection, and the
    # worker's first pull can return before the broker has pushed it (the plans alone).
    deadline = time.monotonic() + 10.0
    while len(worker.inbox) < 4:
        assert time.monotonic() < deadline, f"{len(worker.inbox)} of 4 messages arrived"
        worker._pull(0.1)
    with pytest.raises(AbortedError, match="o1"):
        worker.wait_for((Kind.PLAN,), timeout_s=10.0)


def test_future_window_message_is_a_protocol_error_and_does_not_come_back(
    buses: BusFactory,
) -> None:
    owner = ControlEndpoint(buses.open("o0"), window_id=1)
    buses.open("w0").publish("o0", _open(buses.session, "w0", 5))
    with pytest.raises(ProtocolError, match="window 5"):
        owner.poll(10.0)
    owner.close()
    assert buses.open("o0").consume(0.5) is None


def test_barrier_times_out_naming_the_missing_senders(buses: BusFactory) -> None:
    owner = ControlEndpoint(buses.open("o0"))
    buses.open("w0").publish("o0", _open(buses.session, "w0", 0))
    with pytest.raises(WaitTimeoutError, match=r"\['w1', 'w2'\]"):
        owner.collect(Kind.OPEN, WORKERS, timeout_s=0.5)


def test_plan_open_commit_windows_run_in_lockstep(buses: BusFactory) -> None:
    # One owner, one worker thread (its own bus, opened in its thread), three windows.
    num_windows = 3
    worker_bus_kwargs = buses.connect_kwargs(buses.session, "w0")
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            ep = ControlEndpoint(make_bus(buses.kind, **worker_bus_kwargs))
            for w in range(num_windows):
                ep.advance(w)
                plan = ep.wait_for((Kind.PLAN,), 10.0)
                n = plan.counts_by_worker["w0"]  # type: ignore[attr-defined]
                ep.send(
                    "o0",
                    Open(
                        session_id=buses.session, sender="w0", window_id=w, group_total=n, credit=1
                    ),
                )
                ep.wait_for((Kind.DRAINED,), 10.0)
                ep.advance(w + 1)  # before COMMIT, so the next PLAN is not "future"
                ep.send(
                    "o0",
                    Commit(session_id=buses.session, sender="w0", window_id=w, num_microbatches=n),
                )
            ep.close()
        except BaseException as exc:  # surfaced by the assert below
            errors.append(exc)

    thread = threading.Thread(target=worker)
    thread.start()
    owner = ControlEndpoint(buses.open("o0"))
    commits = []
    for w in range(num_windows):
        owner.advance(w)
        owner.send(
            "w0",
            Plan(
                session_id=buses.session, sender="o0", window_id=w, counts_by_worker={"w0": w + 1}
            ),
        )
        assert owner.wait_for((Kind.OPEN,), 10.0).group_total == w + 1  # type: ignore[attr-defined]
        owner.send(
            "w0",
            Drained(session_id=buses.session, sender="o0", window_id=w, num_microbatches=w + 1),
        )
        commits.append(owner.wait_for((Kind.COMMIT,), 10.0))
    thread.join(timeout=20.0)
    buses.used.setdefault(buses.session, set()).add("w0")
    assert not errors, errors
    assert [c.window_id for c in commits] == [0, 1, 2]
