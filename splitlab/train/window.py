"""Window accounting for U-shape training: credits, quotas, and the PLAN -> COMMIT barrier.

A round is cut into windows. In each window every owner runs up to
`microbatches_per_window` of its microbatches (its quota; the last window may be partial and
an owner whose data ran out, or that has none, runs 0), and no parameter anywhere changes
until the window drains:

    PLAN     every owner -> workers: how many microbatches each worker gets from it (maybe 0)
    OPEN     every worker -> owners, once it has every owner's PLAN: group total and credit
    DRAINED  every owner -> workers, once all its microbatches finished backward
    COMMIT   every worker -> owners, once it has every DRAINED and stepped its body (if it ran any)
    (owners step front + tail once they have every COMMIT, if they ran any)

`WindowBarrier` checks that order for one window and says who steps; `InflightLedger` bounds
live microbatches (credits) and pins each one to the worker that ran its body until its
backward releases it. Everything here is pure bookkeeping: no clocks, no sockets.

    .venv/bin/pytest tests/unit/test_train_window.py -q
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from splitlab.errors import ConfigError, ProtocolError


def effective_credit(*, max_inflight: int, worker_max_inflight: int, num_owners: int) -> int:
    """Live microbatches one owner may have on one worker: min(max, worker_max // owners).

    Raises:
        ConfigError: naming the key when a limit is < 1 or a worker cannot give every owner
            of its group at least one slot.
    """
    if max_inflight < 1:
        raise ConfigError(f"architecture.max_inflight={max_inflight}: must be >= 1")
    if num_owners < 1:
        raise ConfigError(f"architecture.owners={num_owners}: must be >= 1")
    if worker_max_inflight < num_owners:
        raise ConfigError(
            f"architecture.worker_max_inflight={worker_max_inflight}: must be at least the "
            f"{num_owners} owners of the group, so every owner gets one live graph"
        )
    return min(max_inflight, worker_max_inflight // num_owners)


def num_windows(counts_by_owner: Mapping[str, int], quota: int) -> int:
    """Windows in a round: enough for the owner with the most microbatches (0 if none has any)."""
    if quota < 1:
        raise ConfigError(f"architecture.microbatches_per_window={quota}: must be >= 1")
    for owner, count in counts_by_owner.items():
        if count < 0:
            raise ValueError(f"owner {owner!r} has {count} microbatches")
    return max((math.ceil(count / quota) for count in counts_by_owner.values()), default=0)


def owner_window_counts(count: int, quota: int, windows: int) -> list[int]:
    """One owner's microbatches per window: full quotas, one partial window, then zeros."""
    if count > quota * windows:
        raise ValueError(f"{count} microbatches do not fit {windows} windows of {quota}")
    return [max(0, min(quota, count - w * quota)) for w in range(windows)]


def round_schedule(counts_by_owner: Mapping[str, int], quota: int) -> list[dict[str, int]]:
    """Per window, each owner's microbatch count (every owner appears in every window)."""
    windows = num_windows(counts_by_owner, quota)
    per_owner = {o: owner_window_counts(n, quota, windows) for o, n in counts_by_owner.items()}
    return [{owner: per_owner[owner][w] for owner in counts_by_owner} for w in range(windows)]


class Phase(StrEnum):
    PLAN = "plan"  # waiting for every owner's PLAN
    OPEN = "open"  # waiting for every worker's OPEN
    RUNNING = "running"  # microbatches flow; waiting for every owner's DRAINED
    DRAINED = "drained"  # waiting for every worker's COMMIT
    COMMITTED = "committed"  # every worker stepped; owners step and the window is over
    ABORTED = "aborted"


@dataclass
class WindowBarrier:
    """The protocol state of one window over a fixed group of owners and workers.

    Events arrive from peers, so an out-of-order or inconsistent one is a `ProtocolError`
    naming the node, the window and the phase.
    """

    window_id: int
    owners: tuple[str, ...]
    workers: tuple[str, ...]
    phase: Phase = Phase.PLAN
    counts: dict[str, dict[str, int]] = field(default_factory=dict)  # owner -> worker -> n
    opened: set[str] = field(default_factory=set)
    drained: set[str] = field(default_factory=set)
    committed: set[str] = field(default_factory=set)
    events: list[tuple[str, str]] = field(default_factory=list)  # (kind, node) in arrival order
    abort_reason: str | None = None

    def _fail(self, node: str, what: str) -> ProtocolError:
        return ProtocolError(f"window {self.window_id} ({self.phase.value}): {node!r} {what}")

    def _expect(self, phase: Phase, node: str, kind: str, members: Sequence[str]) -> None:
        if node not in members:
            raise self._fail(node, f"sent {kind} but is not in the group {list(members)}")
        if self.phase is not phase:
            raise self._fail(node, f"sent {kind} out of order (expected in phase {phase.value})")

    def plan(self, owner: str, counts_by_worker: Mapping[str, int]) -> None:
        self._expect(Phase.PLAN, owner, "PLAN", self.owners)
        if owner in self.counts:
            raise self._fail(owner, "sent a second PLAN")
        unknown = set(counts_by_worker) - set(self.workers)
        if unknown or any(n < 0 for n in counts_by_worker.values()):
            raise self._fail(owner, f"planned invalid counts {dict(counts_by_worker)}")
        self.counts[owner] = {w: int(counts_by_worker.get(w, 0)) for w in self.workers}
        self.events.append(("plan", owner))
        if len(self.counts) == len(self.owners):
            self.phase = Phase.OPEN

    def open(self, worker: str) -> None:
        self._expect(Phase.OPEN, worker, "OPEN", self.workers)
        if worker in self.opened:
            raise self._fail(worker, "sent a second OPEN")
        self.opened.add(worker)
        self.events.append(("open", worker))
        if len(self.opened) == len(self.workers):
            self.phase = Phase.RUNNING

    def drain(self, owner: str, num_microbatches: int) -> None:
        self._expect(Phase.RUNNING, owner, "DRAINED", self.owners)
        if owner in self.drained:
            raise self._fail(owner, "sent a second DRAINED")
        planned = self.owner_total(owner)
        if num_microbatches != planned:
            raise self._fail(owner, f"drained {num_microbatches} microbatches, planned {planned}")
        self.drained.add(owner)
        self.events.append(("drained", owner))
        if len(self.drained) == len(self.owners):
            self.phase = Phase.DRAINED

    def commit(self, worker: str, num_microbatches: int) -> None:
        self._expect(Phase.DRAINED, worker, "COMMIT", self.workers)
        if worker in self.committed:
            raise self._fail(worker, "sent a second COMMIT")
        planned = self.worker_total(worker)
        if num_microbatches != planned:
            raise self._fail(
                worker, f"committed {num_microbatches} microbatches, planned {planned}"
            )
        self.committed.add(worker)
        self.events.append(("commit", worker))
        if len(self.committed) == len(self.workers):
            self.phase = Phase.COMMITTED

    def abort(self, node: str, reason: str) -> None:
        """Any node may abort at any phase; the first reason is kept."""
        if self.abort_reason is None:
            self.abort_reason = f"{node}: {reason}"
        self.phase = Phase.ABORTED
        self.events.append(("abort", node))

    # --- derived values ----------------------------------------------------------------------

    def owner_total(self, owner: str) -> int:
        return sum(self.counts.get(owner, {}).values())

    def worker_total(self, worker: str) -> int:
        return sum(counts[worker] for counts in self.counts.values())

    @property
    def group_total(self) -> int:
        """Microbatches of the whole group in this window: the mean-of-means denominator."""
        return sum(self.owner_total(owner) for owner in self.counts)

    def steps(self, node: str) -> bool:
        """Whether `node` changes its parameters at the end of this window (it ran work)."""
        if node in self.owners:
            return self.owner_total(node) > 0
        return self.worker_total(node) > 0


def planned_counts(assignment: Iterable[str], workers: Sequence[str]) -> dict[str, int]:
    """A PLAN's `counts_by_worker` from an owner's WRR assignment (every worker named)."""
    counts = dict.fromkeys(workers, 0)
    for worker in assignment:
        counts[worker] += 1
    return counts


class InflightLedger:
    """Live microbatches per peer, bounded by a total and a per-peer credit.

    The owner keeps one (total = max_inflight, per worker = the credit from that worker's
    OPEN); a worker keeps one (total = worker_max_inflight, per owner = the credit it granted).
    A microbatch stays with the peer it was admitted for until `release` (its backward ran).
    """

    def __init__(self, *, total: int, credit_by_peer: Mapping[str, int]) -> None:
        if total < 1 or any(c < 1 for c in credit_by_peer.values()):
            raise ValueError(f"limits must be >= 1: total={total}, credits={dict(credit_by_peer)}")
        self.total = total
        self.credit_by_peer = dict(credit_by_peer)
        self._peer_of: dict[Hashable, str] = {}
        self._live: dict[str, int] = dict.fromkeys(credit_by_peer, 0)
        self.peak = 0

    @property
    def live(self) -> int:
        return len(self._peer_of)

    def live_on(self, peer: str) -> int:
        return self._live[peer]

    def can_admit(self, peer: str) -> bool:
        return self.live < self.total and self._live[peer] < self.credit_by_peer[peer]

    def admit(self, microbatch: Hashable, peer: str) -> None:
        """Raises: ProtocolError when the credit or total is exceeded or the id is live."""
        if peer not in self._live:
            raise ProtocolError(f"microbatch {microbatch!r}: unknown peer {peer!r}")
        if microbatch in self._peer_of:
            raise ProtocolError(f"microbatch {microbatch!r} is already live on {peer!r}")
        if not self.can_admit(peer):
            raise ProtocolError(
                f"microbatch {microbatch!r} exceeds credit on {peer!r}: "
                f"{self._live[peer]}/{self.credit_by_peer[peer]} live there, "
                f"{self.live}/{self.total} in all"
            )
        self._peer_of[microbatch] = peer
        self._live[peer] += 1
        self.peak = max(self.peak, self.live)

    def peer_of(self, microbatch: Hashable) -> str:
        """The peer that holds `microbatch`'s graph (where its backward must go)."""
        return self._peer_of[microbatch]

    def release(self, microbatch: Hashable) -> str:
        """Free the slot after backward; returns the peer it was pinned to."""
        try:
            peer = self._peer_of.pop(microbatch)
        except KeyError:
            raise ProtocolError(f"microbatch {microbatch!r} is not live") from None
        self._live[peer] -= 1
        return peer


def next_dispatch(pending: Sequence[str], ledger: InflightLedger) -> int | None:
    """Index of the first pending microbatch whose assigned worker has a free slot.

    `pending[i]` is the worker WRR pinned microbatch i to; an owner skips past a worker whose
    credits are busy rather than stalling the whole window behind it.
    """
    if ledger.live >= ledger.total:
        return None
    for index, worker in enumerate(pending):
        if ledger.can_admit(worker):
            return index
    return None
