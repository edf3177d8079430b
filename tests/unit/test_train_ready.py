"""Ready queues: returning work before new forwards; peers served by weight."""

from __future__ import annotations

from splitlab.train.ready import ReadyQueues, Work


def test_returning_work_goes_first() -> None:
    queues: ReadyQueues[str] = ReadyQueues({"o0": 1.0, "o1": 1.0})
    queues.push(Work.NEW, "o0", "fwd0")
    queues.push(Work.RETURNING, "o1", "bwd0")

    assert queues.pop() == (Work.RETURNING, "o1", "bwd0")
    assert queues.pop() == (Work.NEW, "o0", "fwd0")
    assert queues.pop() is None


def test_peers_served_by_weight_when_both_wait() -> None:
    queues: ReadyQueues[int] = ReadyQueues({"o0": 3.0, "o1": 1.0})
    for i in range(8):
        queues.push(Work.NEW, "o0", i)
        queues.push(Work.NEW, "o1", i)

    served = [queues.pop()[1] for _ in range(8)]  # type: ignore[index]

    assert served.count("o0") == 6 and served.count("o1") == 2
    assert len(queues) == 8


def test_fifo_within_a_peer() -> None:
    queues: ReadyQueues[int] = ReadyQueues({"o0": 1.0})
    for i in range(3):
        queues.push(Work.RETURNING, "o0", i)

    assert [queues.pop()[2] for _ in range(3)] == [0, 1, 2]  # type: ignore[index]
