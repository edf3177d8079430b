"""The window barrier in the ring: the head coordinates, every other stage participates.

Every W decode tokens (after decode step s with s % W == 0) every stage steps off the data
ring into the barrier; the data ring is drained at that point (the head only proposes after
the token of step s came back), so nothing is in flight while blocks move.

Head (`HeadControl`): asks the planner for the next cuts (from the statistics and observations
of the previous barrier's ACKs), sends PROPOSE{e} to every stage, pre-stages its own share,
collects one answer per stage, then sends COMMIT{e} (every ACK) or ABORT{e} (a NACK: the ring
keeps its configuration and decodes on), each carrying the next barrier's cuts when they move
blocks (`prepare`: decided now, from these ACKs, for the token W steps on; every stage builds
the blocks it will receive while the ring decodes the window). A stage that times out or is
lost aborts e as fatal: the survivors hear ABORT{fatal} and stop, the head raises, no further
token is emitted.

Timing (`timeout_s`: `architecture.ctrl_timeout_s`): a stage's pre-stage receives its KV within
one timeout and joins its KV sends within another (`Migrator.prestage`), so it answers within
`ANSWER_TIMEOUTS` timeouts of PROPOSE, a NACK when a transfer did not make it. The head waits
that long for every answer (at least one timeout after its own pre-stage), and a stage waits
one timeout more than that for COMMIT/ABORT. With equal waits everywhere a stage whose KV
crossed a slow link NACKed just as the head gave it up (fatal), or a stage that ACKed at once
gave up on the head while the head still waited for another stage's KV.
When generation ends at a barrier step the head sends CLOSE instead.

Stage (`StageControl`): waits for PROPOSE or CLOSE, pre-stages (`Migrator.prestage`), answers
ACK with its drift observation and window statistics (or NACK), applies only on COMMIT{e},
then starts preparing what COMMIT/ABORT names (`Migrator.prepare`).

Telemetry: one `window` record per barrier per stage (epoch, barrier_ms, prestage_ms,
commit_ms, release_ms, n_acks, aborted, decision, obs, cuts, token; a stage adds ack_ms,
PROPOSE read -> its answer sent, and reply_wait_ms, answer sent -> COMMIT/ABORT read; the head
adds answer_ms, PROPOSE sent -> each stage's answer read) and one `migration` record
per move a stage takes part in (boundary, k, role, weights_ms, kv_ms, commit_ms, pause_ms,
kv_bytes, kv_bytes_per_block_token, release_ms, prepared, prepare_ms, kv_frames,
kv_stale_frames). Release (dropping the detached blocks and KV, then empty_cache) runs after
the stage's next send, while it would otherwise wait on the ring, and is reported on its own.

    .venv/bin/pytest tests/integration/test_barrier_control_plane.py -q
"""

from __future__ import annotations

import gc
import logging
import math
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Protocol

from splitlab.control.messages import (
    Ack,
    BarrierAbort,
    BarrierCommit,
    BarrierMessage,
    Close,
    Nack,
    Propose,
)
from splitlab.drift.contract import DriftSource, Observation
from splitlab.errors import (
    AbortedError,
    PeerLostError,
    ProtocolError,
    SplitlabError,
    WaitTimeoutError,
)
from splitlab.infer.barrier import HeadBarrier, StageAction, StageBarrier
from splitlab.infer.migration import Migrator, PrestageReport, prestage_error
from splitlab.infer.planners import Decision, Planner, StageStats, WindowView
from splitlab.infer.route import stage_blocks
from splitlab.telemetry.records import MigrationRecord, WindowRecord
from splitlab.telemetry.trace import Tracer

log = logging.getLogger(__name__)
ANSWER_TIMEOUTS = 2  # timeouts after PROPOSE within which a stage answers (KV in, KV sends out)


class CtrlPipe(Protocol):
    def send(self, msg: BarrierMessage) -> None: ...

    def recv(self, *, timeout_s: float | None = None) -> BarrierMessage: ...


@dataclass
class WindowStats:
    """Per-token compute of one stage over the current window (decode tokens only)."""

    compute_ms: list[float] = field(default_factory=list)
    real_ms: list[float] = field(default_factory=list)
    blocks_ms: list[float] = field(default_factory=list)

    send_bytes: list[int] = field(default_factory=list)  # payload sent on the ring per token
    # KV bytes of one block per cached token (the stage's compute knows; None: a model-free one)
    kv_bytes_per_block_token: Callable[[], int] | None = None
    # the host's CPU budget in cores, read at each barrier (a testbed host's cgroup quota, which
    # drift may change mid-run; None: unlimited), and the threads its compute runs on
    cpu_cores: Callable[[], float | None] | None = None
    threads: int = 1

    def add(self, *, compute_ms: float, real_ms: float, blocks_ms: float) -> None:
        self.compute_ms.append(compute_ms)
        self.real_ms.append(real_ms)
        self.blocks_ms.append(blocks_ms)

    def sent(self, nbytes: int) -> None:
        self.send_bytes.append(nbytes)

    def summary(self, num_blocks: int) -> dict[str, Any]:
        if not self.compute_ms:
            return {}
        mean = statistics.fmean
        kv = self.kv_bytes_per_block_token() if self.kv_bytes_per_block_token and num_blocks else 0
        cores = self.cpu_cores() if self.cpu_cores else None
        return {"num_blocks": num_blocks, "tokens": len(self.compute_ms),
                "compute_ms": mean(self.compute_ms), "real_ms": mean(self.real_ms),
                "blocks_ms": mean(self.blocks_ms),
                "send_bytes": mean(self.send_bytes) if self.send_bytes else 0.0,
                "kv_bytes_per_block_token": kv, "threads": self.threads,
                **({"cpu_cores": cores} if cores else {})}  # fmt: skip

    def reset(self) -> None:
        self.compute_ms.clear()
        self.real_ms.clear()
        self.blocks_ms.clear()
        self.send_bytes.clear()


class GcClock:
    """Milliseconds this process spent in the cyclic garbage collector (via gc.callbacks).

    A full collection walks every tracked object (a loaded model: hundreds of thousands), so
    one landing inside a barrier shows up as milliseconds of "protocol" time.
    """

    total_ms = 0.0
    _t0 = 0.0
    _installed = False

    @classmethod
    def install(cls) -> None:
        if not cls._installed:
            gc.callbacks.append(cls._tick)
            cls._installed = True

    @classmethod
    def _tick(cls, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            cls._t0 = time.perf_counter()
        else:
            cls.total_ms += (time.perf_counter() - cls._t0) * 1e3


class LinkRise:
    """How fast a stage's link is falling: the rise per token of its slowdown (1 / link_obs)
    between two of its observations, which the ACK carries (`link_rise_per_token`) so that
    `planner=model` sees a trend at the first barrier, from the observation at decode start."""

    def __init__(self) -> None:
        self.last: tuple[int, float] | None = None  # (token, slowdown) of the last observation

    def mark(self, step: int, obs: Mapping[str, float] | None) -> float | None:
        """Record the observation at `step`; the rise since the one before (None: no link
        observed, or nothing to compare with)."""
        value = (obs or {}).get("link_obs", math.nan)
        if not (math.isfinite(value) and value > 0):
            self.last = None
            return None
        slow, last = 1.0 / min(1.0, value), self.last
        self.last = (step, slow)
        return (slow - last[1]) / (step - last[0]) if last and step > last[0] else None


def with_rise(summary: dict[str, Any], rise: float | None, step: int) -> dict[str, Any]:
    """A window summary with the link's rise and the token it was observed at (the planner
    projects from there to the barrier its decision is for) added, when both exist."""
    if not summary or rise is None:
        return summary
    return {**summary, "link_rise_per_token": rise, "link_obs_token": step}


def observe(drift: DriftSource | None, token: int) -> dict[str, float] | None:
    """The stage's observation at `token`, checked against the four-key contract."""
    if drift is None:
        return None
    return Observation.from_dict(drift.observe(token)).to_dict()


def host_kernel(drift: DriftSource | None) -> dict[str, Any] | None:
    """The host's latest kernel figures when the drift source samples them (the live source
    on a testbed host), for the window record; None elsewhere."""
    kernel = getattr(drift, "kernel", None)
    return dict(kernel) if kernel else None


def _migration_records(report: PrestageReport, *, stage: int, epoch: int, token: int,
                       commit_ms: float) -> list[MigrationRecord]:  # fmt: skip
    out = []
    for move in report.moves:
        receiver = move["receiver"] == stage
        weights_ms = report.weights_ms if receiver else 0.0
        kv_ms = report.kv_ms if receiver else report.send_ms
        out.append(MigrationRecord(
            epoch=epoch, token=token, boundary=move["boundary"], k=move["k"],
            layer_ids=move["layer_ids"], side="receiver" if receiver else "donor",
            weights_ms=weights_ms, kv_ms=kv_ms, commit_ms=commit_ms,
            pause_ms=weights_ms + kv_ms + commit_ms,
            kv_bytes=report.kv_bytes_in if receiver else report.kv_bytes_out,
            kv_bytes_per_block_token=report.kv_bytes_per_block_token,
            prepared=receiver and report.prepared,
            prepare_ms=report.prepare_ms if receiver else 0.0,
            kv_frames=report.kv_frames_in if receiver else report.kv_frames_out,
            kv_stale_frames=report.kv_stale_frames if receiver else 0,
        ))  # fmt: skip
    return out


class _Deferred:
    """Records held until the post-commit release ran (its time goes into them)."""

    def __init__(self, tracer: Tracer, migrator: Migrator) -> None:
        self.tracer, self.migrator = tracer, migrator
        self.records: list[WindowRecord | MigrationRecord] = []

    def emit(self, records: list[WindowRecord | MigrationRecord]) -> None:
        if self.migrator.release_pending:
            self.records.extend(records)
        else:
            for rec in records:
                self.tracer.write(rec)

    def after_send(self) -> None:
        if not self.records and not self.migrator.release_pending:
            return
        release_ms = self.migrator.release()
        for rec in self.records:
            self.tracer.write(replace(rec, release_ms=release_ms))
        self.records.clear()


class StageControl:
    """A non-head stage's side of the barrier."""

    def __init__(self, *, stage: int, window: int, ctrl: CtrlPipe, migrator: Migrator,
                 drift: DriftSource | None = None, tracer: Tracer | None = None,
                 timeout_s: float = 5.0, entry_timeout_s: float = 300.0,
                 fault: str | None = None) -> None:  # fmt: skip
        self.stage, self.window, self.ctrl, self.migrator = stage, window, ctrl, migrator
        self.drift, self.tracer = drift, tracer or Tracer.null()
        self.timeout_s, self.entry_timeout_s = timeout_s, entry_timeout_s
        self.fault = fault  # testing only: "nack" refuses every epoch, "hang" stalls in pre-stage,
        # "slow_kv" sends its first KV transfer's first chunk 1.5 timeouts late (a link too slow
        # for a barrier; the next transfer goes on time and finds that chunk stale)
        if fault == "slow_kv":
            migrator.send_delay_s = 1.5 * timeout_s
        self.state = StageBarrier(stage)
        self.deferred = _Deferred(self.tracer, migrator)
        self.link = LinkRise()
        GcClock.install()

    def begin(self, step: int) -> None:
        """Decode starts at `step`: the link observation the first window's trend starts from."""
        self.link.mark(step, observe(self.drift, step))

    def _await_propose(self) -> Propose | None:
        """The next PROPOSE, or None on CLOSE."""
        msg = self.ctrl.recv(timeout_s=self.entry_timeout_s)
        if isinstance(msg, Close):
            return None
        if not isinstance(msg, Propose):
            raise ProtocolError(f"stage {self.stage}: expected PROPOSE or CLOSE, got '{msg.kind}'")
        return msg

    def barrier(self, *, step: int, pos: int, stats: WindowStats) -> bool:
        """Run one barrier; False when the head closed instead (generation is ending)."""
        obs = observe(self.drift, step)  # sampled while idle, before PROPOSE: off its critical path
        t_wait = time.perf_counter()
        msg = self._await_propose()
        if msg is None:
            return False
        if msg.token != step:
            raise ProtocolError(f"stage {self.stage}: PROPOSE at token {msg.token}, this stage is at {step}")  # fmt: skip
        self._run(msg, step=step, pos=pos, stats=stats, obs=obs, t_wait=t_wait)
        return True

    def idle_barrier(
        self, *, last_step: int, pos: int, stats: WindowStats
    ) -> tuple[int, int] | None:
        """A stage without blocks (`architecture.bypass`): the next barrier, whatever its token.

        The ring decoded one position per step meanwhile, so at PROPOSE{token} this stage's
        position is `pos + token - last_step`; its observation is sampled at that token (it
        is idle, nothing to keep off a critical path). Returns (token, position), or None on
        CLOSE.
        """
        t_wait = time.perf_counter()
        msg = self._await_propose()
        if msg is None:
            return None
        if msg.token < last_step:
            raise ProtocolError(f"stage {self.stage}: PROPOSE at token {msg.token}, before this stage's last step {last_step}")  # fmt: skip
        obs = observe(self.drift, msg.token)
        pos += msg.token - last_step
        self._run(msg, step=msg.token, pos=pos, stats=stats, obs=obs, t_wait=t_wait)
        return msg.token, pos

    def _run(self, msg: Propose, *, step: int, pos: int, stats: WindowStats,
             obs: dict[str, float] | None, t_wait: float) -> None:  # fmt: skip
        """Pre-stage, answer, then apply on COMMIT or drop on ABORT (raises on a fatal one)."""
        t0, gc0 = time.perf_counter(), GcClock.total_ms
        wait_ms = (t0 - t_wait) * 1e3
        action = self.state.on_message(msg)
        assert action is StageAction.PRESTAGE, action
        propose, report, answer = msg, PrestageReport(), None
        rise = self.link.mark(step, obs)
        try:
            if self.fault == "hang":
                time.sleep(3600)
            report = self.migrator.prestage(msg.cuts, pos=pos, epoch=msg.epoch)
            if self.fault == "nack":  # pre-staged (its KV went out), then refuses
                raise ProtocolError("refusing every epoch (fault injection)")
            blocks = stage_blocks(self.migrator.cuts, self.migrator.num_layers)[self.stage]
            answer = Ack(epoch=msg.epoch, stage=self.stage, obs=obs,
                         stats=with_rise(stats.summary(blocks), rise, step),
                         prestage_ms=(time.perf_counter() - t0) * 1e3)  # fmt: skip
        except Exception as exc:
            self.migrator.abort()
            answer = Nack(epoch=msg.epoch, stage=self.stage, reason=prestage_error(self.stage, exc))
        prestage_ms = (time.perf_counter() - t0) * 1e3
        self.ctrl.send(self.state.answered(answer))
        t_acked = time.perf_counter()
        while True:
            try:
                reply = self.ctrl.recv(timeout_s=(ANSWER_TIMEOUTS + 1) * self.timeout_s)
            except SplitlabError as exc:
                self.migrator.abort()
                raise type(exc)(f"stage {self.stage}: epoch {msg.epoch} neither committed nor aborted ({exc}); stopping") from exc  # fmt: skip
            action = self.state.on_message(reply)
            if action is StageAction.REANSWER:
                self.ctrl.send(answer)
            elif action in (StageAction.APPLY, StageAction.DROP):
                break
        reply_wait_ms = (time.perf_counter() - t_acked) * 1e3  # the head's round trip + other ACKs
        commit_ms, aborted = 0.0, action is StageAction.DROP
        if aborted:
            self.migrator.abort()
        else:
            commit_ms = self.migrator.commit()
        if reply.prepare is not None:  # never on a fatal ABORT (the head sends none there)
            self.migrator.prepare(reply.prepare)  # built while the ring decodes the window
        record = {"epoch": msg.epoch, "token": step, "barrier_ms": (time.perf_counter() - t0) * 1e3,
                  "wait_ms": wait_ms, "prestage_ms": prestage_ms, "commit_ms": commit_ms,
                  "ack_ms": (t_acked - t0) * 1e3, "reply_wait_ms": reply_wait_ms,
                  "gc_ms": GcClock.total_ms - gc0,
                  "n_acks": None, "aborted": aborted, "decision": propose.decision, "obs": obs,
                  "cuts": list(self.migrator.cuts), "nack": isinstance(answer, Nack),
                  "kernel": host_kernel(self.drift)}  # fmt: skip
        records: list[WindowRecord | MigrationRecord] = [WindowRecord(**record)]
        if not aborted:
            records += _migration_records(
                report, stage=self.stage, epoch=msg.epoch, token=step, commit_ms=commit_ms)  # fmt: skip
        self.deferred.emit(records)
        if aborted and isinstance(reply, BarrierAbort) and reply.fatal:
            raise AbortedError(
                f"stage {self.stage}: the head aborted epoch {msg.epoch}: {reply.reason}"
            )

    def after_send(self) -> None:
        self.deferred.after_send()

    def close(self) -> None:
        pass


class HeadControl:
    """The head's side: planner, PROPOSE/COMMIT, and its own pre-stage."""

    def __init__(self, *, window: int, ctrls: Mapping[int, CtrlPipe], migrator: Migrator,
                 planner: Planner, drift: DriftSource | None = None,
                 tracer: Tracer | None = None, timeout_s: float = 5.0,
                 prepare_ahead: bool = True) -> None:  # fmt: skip
        self.window, self.ctrls, self.migrator, self.planner = (
            window,
            dict(ctrls),
            migrator,
            planner,
        )
        self.drift, self.tracer, self.timeout_s = drift, tracer or Tracer.null(), timeout_s
        self.num_stages = len(migrator.cuts) + 1
        check = getattr(planner, "check", None)
        if check is not None:  # a plan that can never apply fails at start, not mid-run
            check(migrator.cuts, migrator.num_layers)
        self.state = HeadBarrier(frozenset(range(self.num_stages)))
        self.last_stats: dict[int, StageStats | None] = {}
        self.last_obs: dict[int, dict[str, float] | None] = {}
        self.deferred = _Deferred(self.tracer, migrator)
        self.decisions: list[dict[str, Any]] = []  # (for tools) every barrier's outcome
        # The next barrier's decision, taken when the previous one ends: its inputs (that
        # barrier's ACKs, the cuts it left, the token and context W steps on) are all known
        # then, so the planner sees what it would see W tokens later, and the stages can
        # build the blocks it moves while the ring decodes (`Migrator.prepare`).
        self.prepare_ahead = prepare_ahead
        self._ahead: tuple[int, int, tuple[int, ...], Decision] | None = None
        self.link = LinkRise()

    def begin(self, step: int) -> None:
        """Decode starts at `step`: the link observation the first window's trend starts from."""
        self.link.mark(step, observe(self.drift, step))

    def _view(self, *, token: int, cuts: tuple[int, ...], context: int,
              remaining: int | None) -> WindowView:  # fmt: skip
        return WindowView(
            token=token, cuts=cuts, num_layers=self.migrator.num_layers, context=context,
            stats=tuple(self.last_stats.get(s) for s in range(self.num_stages)),
            obs=tuple(self.last_obs.get(s) for s in range(self.num_stages)),
            remaining=remaining,
        )  # fmt: skip

    def _decide(self, *, step: int, pos: int, remaining: int | None) -> Decision:
        """This barrier's decision: the one taken ahead if it was for this token, context and
        cuts (always, unless generation was not where the last barrier expected), else now."""
        ahead, self._ahead = self._ahead, None
        cuts = tuple(self.migrator.cuts)
        if ahead is not None and ahead[:3] == (step, pos, cuts):
            return ahead[3]
        view = self._view(token=step, cuts=cuts, context=pos, remaining=remaining)
        return self.planner.decide(view)

    def _plan_ahead(self, *, step: int, pos: int, cuts: tuple[int, ...],
                    remaining: int | None) -> tuple[int, ...] | None:  # fmt: skip
        """Decide the next barrier (W tokens on, from `cuts`, this barrier's outcome) now;
        its cuts when they move blocks."""
        if not self.prepare_ahead:
            return None
        token, context, cuts = step + self.window, pos + self.window, tuple(cuts)
        left = None if remaining is None else remaining - self.window
        view = self._view(token=token, cuts=cuts, context=context, remaining=left)
        decision = self.planner.decide(view)
        self._ahead = (token, context, cuts, decision)
        return tuple(decision.cuts) if tuple(decision.cuts) != cuts else None

    def _broadcast(self, msg: BarrierMessage, *, best_effort: bool = False) -> None:
        for stage, ctrl in self.ctrls.items():
            try:
                ctrl.send(msg)
            except SplitlabError as exc:
                if not best_effort:
                    raise PeerLostError(f"head: stage {stage} lost while sending {msg.kind}: {exc}") from exc  # fmt: skip

    def _fail(self, epoch: int, reason: str, exc: SplitlabError) -> SplitlabError:
        abort = self.state.on_failure(reason) or BarrierAbort(epoch=epoch, reason=reason)
        self._broadcast(
            BarrierAbort(epoch=abort.epoch, reason=reason, fatal=True), best_effort=True
        )
        self.migrator.abort()
        self.tracer.write(WindowRecord(epoch=epoch, barrier_ms=None, prestage_ms=None, commit_ms=None,
                          n_acks=len(self.state.acks), aborted=True,
                          decision=f"fatal: {reason}", obs=None, cuts=list(self.migrator.cuts)))  # fmt: skip
        return type(exc)(reason)

    def barrier(self, *, step: int, pos: int, stats: WindowStats,
                remaining: int | None = None) -> None:  # fmt: skip
        """One barrier at token `step`; `remaining`: the tokens generation has left after
        this one at most (None: unknown), which the planner may weigh a move against. When
        they end within the window no barrier follows, so nothing is decided or built ahead
        for one."""
        migrator = self.migrator
        decision = self._decide(step=step, pos=pos, remaining=remaining)
        t0 = time.perf_counter()
        propose = self.state.propose(token=step, cuts=decision.cuts, decision=decision.reason)
        epoch = propose.epoch
        try:
            self._broadcast(propose)
        except PeerLostError as exc:
            raise self._fail(epoch, str(exc), exc) from exc
        obs = observe(self.drift, step)
        rise = self.link.mark(step, obs)
        t1 = time.perf_counter()
        report = PrestageReport()
        try:
            report = migrator.prestage(decision.cuts, pos=pos, epoch=epoch)
            blocks = stage_blocks(migrator.cuts, migrator.num_layers)[0]
            own: Ack | Nack = Ack(epoch=epoch, stage=0, obs=obs,
                                  stats=with_rise(stats.summary(blocks), rise, step))  # fmt: skip
        except Exception as exc:
            migrator.abort()
            own = Nack(epoch=epoch, stage=0, reason=prestage_error(0, exc))
        prestage_ms = (time.perf_counter() - t1) * 1e3
        verdict = self.state.on_answer(own)
        answers: dict[int, Ack | Nack] = {0: own}
        answer_ms: dict[str, float] = {}  # per stage: PROPOSE sent -> its answer read
        # every stage answers within ANSWER_TIMEOUTS of PROPOSE (see the module docstring)
        deadline = max(time.monotonic() + self.timeout_s, t0 + ANSWER_TIMEOUTS * self.timeout_s)
        for stage, ctrl in self.ctrls.items():
            while stage not in answers:
                try:
                    msg = ctrl.recv(timeout_s=max(1e-3, deadline - time.monotonic()))
                except (PeerLostError, WaitTimeoutError) as exc:
                    reason = f"stage {stage} lost mid-barrier (epoch {epoch}): {exc}"
                    log.error("%s; aborting and stopping the ring", reason)
                    raise self._fail(epoch, reason, exc) from exc
                if not isinstance(msg, (Ack, Nack)):
                    raise ProtocolError(
                        f"head: expected ACK/NACK from stage {stage}, got '{msg.kind}'"
                    )
                if msg.epoch == epoch:
                    answers[stage] = msg
                    answer_ms[str(stage)] = (time.perf_counter() - t0) * 1e3
                    verdict = self.state.on_answer(msg) or verdict
        for stage, answer in answers.items():
            if isinstance(answer, Ack):
                self.last_stats[stage] = StageStats.from_dict(stage, answer.stats)
                self.last_obs[stage] = answer.obs
        commit_ms, aborted = 0.0, not isinstance(verdict, BarrierCommit)
        after = migrator.cuts if aborted else tuple(decision.cuts)
        last = remaining is not None and remaining <= self.window
        prepare = (None if last
                   else self._plan_ahead(step=step, pos=pos, cuts=after, remaining=remaining))  # fmt: skip
        self._broadcast(replace(verdict, prepare=prepare))
        if aborted:
            assert isinstance(verdict, BarrierAbort), verdict
            migrator.abort()
            log.warning("epoch %d aborted: %s", epoch, verdict.reason)
        else:
            commit_ms = migrator.commit()
        if prepare is not None:
            migrator.prepare(prepare)
        barrier_ms = (time.perf_counter() - t0) * 1e3
        n_acks = sum(isinstance(a, Ack) for a in answers.values())
        record = {"epoch": epoch, "token": step, "barrier_ms": barrier_ms, "prestage_ms": prestage_ms,
                  "commit_ms": commit_ms, "n_acks": n_acks, "aborted": aborted,
                  "answer_ms": answer_ms,
                  "decision": decision.reason + (f"; aborted: {verdict.reason}" if aborted else ""),
                  "obs": {str(s): a.obs for s, a in answers.items() if isinstance(a, Ack)},
                  "stats": {str(s): a.stats for s, a in answers.items() if isinstance(a, Ack)},
                  "cuts": list(migrator.cuts), "predicted_ms": list(decision.predicted_ms),
                  "kernel": host_kernel(self.drift)}  # fmt: skip
        self.decisions.append(record)
        records: list[WindowRecord | MigrationRecord] = [WindowRecord(**record)]
        if not aborted:
            records += _migration_records(
                report, stage=0, epoch=epoch, token=step, commit_ms=commit_ms)  # fmt: skip
        self.deferred.emit(records)

    def close(self, reason: str = "end") -> None:
        self._broadcast(Close(reason=reason), best_effort=True)

    def after_send(self) -> None:
        self.deferred.after_send()


def report_dict(report: PrestageReport) -> dict[str, Any]:
    return asdict(report)
