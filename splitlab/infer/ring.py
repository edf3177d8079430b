"""The ring stage runtime: HELLO roster and parity, then prefill and greedy/sampled decode.

Stage 0 (head) embeds and runs its blocks, every stage forwards hidden states to the next, and
the tail computes logits, picks the token and returns its id to the head. The data ring is
blocking: each stage holds one channel from its predecessor (`up`) and one to its successor
(`down`), `splitlab.wire.base.Channel`s on the activation lane of its transport (TCP across
processes, in-process in one; see `splitlab.infer.ring_wire`). Frames (kind, meta):

    hello  {roster: [...]}                       head -> ... -> tail -> head (each appends itself)
    start  {gen: {...}} | abort {reason}         head -> ... -> head (tail samples with gen)
    hidden {step, pos} + hidden_BTH              stage i -> i+1
    token  {step} + token_id_1                   tail -> head
    stop   {reason}                              head -> ... -> head, then everyone exits 0

Every frame carries the absolute position of its first token; each stage checks it against
its own count, so a position can never silently restart. One trace record per token per stage:
`compute_ms` (this stage's forward only, plus injected drift), `real_ms` (the forward alone),
`recv_wait_ms` (blocked receiving), `send_ms`, `bytes` sent, and on the head `tpot_ms` (one
full trip around the ring).

With a `control` (`splitlab.infer.window`), every stage steps into the window barrier after
decode step s when s % W == 0, on the control star, never on the ring. With a `drift` source,
phi(step) becomes a sleep of (phi - 1) x compute_ms inside the measured compute region.

With `peers` (a channel to every other stage; `architecture.bypass`) the ring follows the
current cuts (`splitlab.infer.route`): a stage a barrier left without blocks is skipped (its
predecessor sends straight to the next stage that has blocks) and waits on the control star
for the next PROPOSE instead of the data ring; when the head ends generation with such a stage,
it sends CLOSE to the star before STOP goes round, and STOP (or an abort) reaches the skipped
stages from the stage before them.

    .venv/bin/pytest tests/unit/test_infer_ring.py -q
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import torch

from splitlab.drift.contract import DriftSource
from splitlab.drift.host_kernel import cpu_budget_cores
from splitlab.drift.inject import inject
from splitlab.errors import AbortedError, ConfigError, ExitCode, PeerLostError, ProtocolError
from splitlab.infer.compute import StageCompute
from splitlab.infer.parity import parity_mismatches
from splitlab.infer.route import Route, route, stage_blocks
from splitlab.infer.sampling import check_sampling, new_generator, sample_token
from splitlab.telemetry.records import TokenRecord
from splitlab.telemetry.trace import Tracer
from splitlab.wire.base import Message
from splitlab.wire.frame import Routing

log = logging.getLogger(__name__)

HIDDEN, TOKEN = "hidden_BTH", "token_id_1"


class Pipe(Protocol):
    """What a stage needs from a link (`wire.base.Channel` fits)."""

    def send(self, kind: str, tensors: Mapping[str, torch.Tensor], *,
             meta: dict[str, Any] | None = None, routing: Routing | None = None) -> Any: ...  # fmt: skip

    def recv(self, *, timeout_s: float | None = None) -> Message: ...


@dataclass(frozen=True)
class GenParams:
    """What the head decides and sends to every stage in START."""

    max_new_tokens: int
    temperature: float = 0.0
    top_k: int = 0
    seed: int = 0
    eos_ids: tuple[int, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["eos_ids"] = list(self.eos_ids)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> GenParams:
        gen = cls(
            max_new_tokens=int(d["max_new_tokens"]), temperature=float(d.get("temperature", 0.0)),
            top_k=int(d.get("top_k", 0)), seed=int(d.get("seed", 0)),
            eos_ids=tuple(int(i) for i in d.get("eos_ids", ())),
        )  # fmt: skip
        if gen.max_new_tokens < 1:
            raise ConfigError(f"task.max_new_tokens={gen.max_new_tokens}: must be >= 1")
        check_sampling(temperature=gen.temperature, top_k=gen.top_k)
        return gen


@dataclass
class RingResult:
    """What the head reports after a generation."""

    token_ids: list[int]
    prompt_len: int
    stop_reason: str  # "max_new_tokens" or "eos"
    ttft_ms: float
    tpot_ms: list[float] = field(default_factory=list)  # decode steps only
    windows: list[dict[str, Any]] = field(default_factory=list)  # the head's window records

    @property
    def tpot_ms_median(self) -> float:
        return float(statistics.median(self.tpot_ms)) if self.tpot_ms else float("nan")

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens over the generation's wall time (TTFT plus every decode step)."""
        total_ms = self.ttft_ms + sum(self.tpot_ms)
        return len(self.token_ids) * 1000.0 / total_ms if total_ms > 0 else float("nan")


@dataclass(frozen=True)
class StageIdentity:
    """Who a stage is, as reported in the HELLO roster."""

    stage: int
    num_stages: int
    start: int
    stop: int
    num_layers: int
    model: dict[str, Any]  # model_type, hidden_size, vocab_size (model-free: "echo")
    versions: dict[str, Any]
    address: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def check_roster(
    roster: Sequence[Mapping[str, Any]], *, num_stages: int, strict_parity: bool
) -> list[str]:
    """Problems with a complete HELLO roster; parity problems only when strict (else logged)."""
    problems: list[str] = []
    stages = [int(r["stage"]) for r in roster]
    if stages != list(range(num_stages)):
        return [f"roster stages {stages}: expected 0..{num_stages - 1} in ring order"]
    head = roster[0]
    expected_start = 0
    for r in roster:
        if r["start"] != expected_start:
            problems.append(
                f"stage {r['stage']} owns blocks [{r['start']}, {r['stop']}) but the previous stage "
                f"ends at {expected_start}: spans must be contiguous"
            )
        expected_start = r["stop"]
        for name in ("num_stages", "num_layers", "model"):
            if r[name] != head[name]:
                problems.append(
                    f"stage {r['stage']} {name}={r[name]!r} but the head has {head[name]!r}"
                )
    if expected_start != head["num_layers"]:
        problems.append(
            f"the last stage ends at block {expected_start}, not num_layers={head['num_layers']}"
        )
    parity = parity_mismatches(roster)
    if strict_parity:
        problems += parity
    for line in [] if strict_parity else parity:
        log.warning("parity relaxed: %s", line)
    return problems


class RingStage:
    """One stage of the ring (see module docstring)."""

    def __init__(self, *, identity: StageIdentity, compute: StageCompute, up: Pipe | None,
                 down: Pipe | None, tracer: Tracer | None = None, strict_parity: bool = True,
                 timeout_s: float | None = None, session: str | None = None,
                 control: Any = None, drift: DriftSource | None = None,
                 peers: Mapping[int, Pipe] | None = None) -> None:  # fmt: skip
        from splitlab.infer.window import WindowStats

        self.identity, self.compute, self.up, self.down = identity, compute, up, down
        self.peers = dict(peers) if peers else None  # bypass: a channel to every other stage
        self.control, self.drift = control, drift
        self.stats = WindowStats(
            kv_bytes_per_block_token=getattr(compute, "bytes_per_token_kv", None),
            cpu_cores=cpu_budget_cores,
            threads=torch.get_num_threads(),
        )
        self.tracer = tracer or Tracer.null()
        self.strict_parity, self.timeout_s, self.session = strict_parity, timeout_s, session
        self.index, self.num_stages = identity.stage, identity.num_stages
        self._routing = Routing(session=session, stage=self.index)  # its ids encoded once
        self.is_head, self.is_tail = self.index == 0, self.index == self.num_stages - 1
        self.pos = 0  # tokens this stage has processed (the next call's first position)
        self.step = 0  # the last decode step this stage took part in
        self._routes: tuple[tuple[int, ...], Route] | None = None
        self.roster: list[dict[str, Any]] = []
        self.aborted_by_peer = False  # an abort already went (or came) around the ring

    # --- plumbing ----------------------------------------------------------------------------

    def route(self) -> Route:
        """This stage's place in the data ring under the current cuts (fixed without `peers`)."""
        n, i = self.num_stages, self.index
        if self.peers is None or self.control is None:
            return Route(stage=i, active=True, source=(i - 1) % n, target=(i + 1) % n,
                         skipped=())  # fmt: skip
        cuts = tuple(self.control.migrator.cuts)
        if self._routes is None or self._routes[0] != cuts:
            self._routes = (cuts, route(i, cuts, self.identity.num_layers))
        return self._routes[1]

    def _any_skipped(self) -> bool:
        """Whether some stage owns no blocks under the current cuts (`architecture.bypass`)."""
        if self.peers is None or self.control is None:
            return False
        return 0 in stage_blocks(self.control.migrator.cuts, self.identity.num_layers)

    def _pipe(self, stage: int, *, inbound: bool) -> Pipe:
        pipe = self.peers.get(stage) if self.peers else (self.up if inbound else self.down)
        if pipe is None:
            raise ProtocolError(f"stage {self.index}: no data channel to stage {stage}")
        return pipe

    def _recv(self, expect: Sequence[str]) -> tuple[Message, float]:
        pipe = self._pipe(self.route().source, inbound=True)
        t0 = time.perf_counter()
        msg = pipe.recv(timeout_s=self.timeout_s)
        wait_ms = (time.perf_counter() - t0) * 1e3
        if msg.kind == "abort":
            meta = dict(msg.meta)
            msg.release()
            origin = int(meta.get("origin", 0))
            self.aborted_by_peer = True
            here = self.route()
            if here.active:
                self._forward_abort(meta, here.fan_out(origin))
            reason = f"stage {self.index}: stage {origin} aborted the run: {meta.get('reason')}"
            if meta.get("code") == int(ExitCode.PEER_LOST):
                raise PeerLostError(reason)
            raise AbortedError(reason)
        if msg.kind not in expect:
            msg.release()
            raise ProtocolError(
                f"stage {self.index}: expected {list(expect)} from upstream, got {msg.kind!r}"
            )
        return msg, wait_ms

    def _send(self, kind: str, tensors: Mapping[str, torch.Tensor], *, to: int | None = None,
              **meta: Any) -> tuple[float, int]:  # fmt: skip
        """Send to stage `to` (default: the next stage with blocks)."""
        pipe = self._pipe(self.route().target if to is None else to, inbound=False)
        t0 = time.perf_counter()
        pipe.send(kind, tensors, meta=meta, routing=self._routing)
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        return (time.perf_counter() - t0) * 1e3, nbytes

    def _forward_abort(self, meta: Mapping[str, Any], targets: Sequence[int]) -> None:
        for stage in targets:
            try:
                self._send("abort", {}, to=stage, **meta)
            except Exception:  # best effort: the next stage may be gone too
                pass

    def abort_downstream(self, exc: BaseException) -> None:
        """Tell the rest of the ring why this stage is stopping (best effort, once).

        A stage that lost a neighbour is the only one that knows which; forwarding the reason
        lets every survivor exit with a diagnosis naming the dead stage, not just its neighbour.
        """
        if (self.down is None and not self.peers) or self.aborted_by_peer:
            return
        self.aborted_by_peer = True
        code = int(getattr(exc, "exit_code", ExitCode.ERROR))
        meta = {"origin": self.index, "code": code, "reason": str(exc)}
        self._forward_abort(meta, self.route().fan_out())

    def _forward(self, x: torch.Tensor, pos: int, step: int) -> tuple[torch.Tensor, float, float]:
        """(output, compute_ms incl. injected drift, real_ms of the forward alone)."""
        t0 = time.perf_counter()
        out = self.compute.forward(x, pos)
        real_ms = (time.perf_counter() - t0) * 1e3
        if self.drift is not None:
            inject(real_ms, self.drift.phi(step))
        compute_ms = (time.perf_counter() - t0) * 1e3
        if step > 0:
            blocks_ms = float(getattr(self.compute, "blocks_ms", 0.0))
            self.stats.add(compute_ms=compute_ms, real_ms=real_ms, blocks_ms=blocks_ms)
        return out, compute_ms, real_ms

    def _at_barrier(self, step: int) -> bool:
        """True at a window barrier; after prefill (step 0), the control's link observation
        that the first window's trend starts from."""
        if self.control is None:
            return False
        if step == 0:
            self.control.begin(step)
        return step > 0 and step % self.control.window == 0

    def _after_send(self) -> None:
        if self.control is not None:
            self.control.after_send()

    # --- setup ---------------------------------------------------------------------------------

    def handshake(self, gen: GenParams | None = None) -> GenParams:
        """HELLO around the ring, then START (or ABORT); returns the run's generation params.

        Raises:
            ConfigError: (head) the roster is inconsistent or an enforced parity field differs.
            AbortedError: (others) the head refused the roster.
        """
        me = self.identity.to_dict()
        if self.num_stages == 1:
            assert gen is not None
            self.roster = [me]
            return gen
        if self.is_head:
            assert gen is not None
            self._send("hello", {}, roster=[me])
            msg, _ = self._recv(["hello"])
            self.roster = list(msg.meta["roster"])
            msg.release()
            problems = check_roster(
                self.roster, num_stages=self.num_stages, strict_parity=self.strict_parity
            )
            if problems:
                reason = "; ".join(problems)
                self.aborted_by_peer = True  # nothing more to tell the ring after this abort
                self._send("abort", {}, origin=0, code=int(ExitCode.ABORTED), reason=reason)
                raise ConfigError(f"ring refused at HELLO: {reason}")
            self._send("start", {}, gen=gen.to_dict(), roster=self.roster)
            msg, _ = self._recv(["start"])
            msg.release()
            return gen
        msg, _ = self._recv(["hello"])
        roster = [*msg.meta["roster"], me]
        msg.release()
        self._send("hello", {}, roster=roster)
        msg, _ = self._recv(["start"])
        meta = dict(msg.meta)
        msg.release()
        self._send("start", {}, **meta)
        self.roster = list(meta.get("roster", roster))
        return GenParams.from_dict(meta["gen"])

    # --- the head ------------------------------------------------------------------------------

    def generate(self, prompt_ids: torch.Tensor, gen: GenParams) -> RingResult:
        """Prefill `prompt_ids` (1 x T) and decode until max_new_tokens or EOS (head only)."""
        assert self.is_head
        generator = new_generator(gen.seed)
        x = prompt_ids.reshape(1, -1).to(torch.long)
        prompt_len = x.shape[1]
        tokens: list[int] = []
        tpot: list[float] = []
        ttft_ms, reason, closed = 0.0, "max_new_tokens", False
        for step in range(gen.max_new_tokens):
            t0 = time.perf_counter()
            pos = self.pos
            out, compute_ms, real_ms = self._forward(x, pos, step)
            self.pos += x.shape[1]
            send_ms, nbytes, wait_ms = 0.0, 0, 0.0
            if self.num_stages == 1:
                token = sample_token(
                    out[0], temperature=gen.temperature, top_k=gen.top_k, generator=generator
                )
            else:
                send_ms, nbytes = self._send("hidden", {HIDDEN: out}, step=step, pos=pos)
                if step > 0:
                    self.stats.sent(nbytes)
                self._after_send()
                msg, wait_ms = self._recv(["token"])
                if msg.meta.get("step") != step:
                    raise ProtocolError(
                        f"head: token for step {msg.meta.get('step')} arrived at step {step}"
                    )
                token = int(msg.tensors[TOKEN][0])
                msg.release()
            trip_ms = (time.perf_counter() - t0) * 1e3
            if step == 0:
                ttft_ms = trip_ms
            else:
                tpot.append(trip_ms)
            self.tracer.write(TokenRecord(
                stage=self.index, token=step, pos=pos, num_tokens=x.shape[1], compute_ms=compute_ms,
                real_ms=real_ms, recv_wait_ms=wait_ms, send_ms=send_ms, bytes=nbytes,
                tpot_ms=trip_ms, prefill=step == 0, token_id=token,
            ))  # fmt: skip
            tokens.append(token)
            done = token in gen.eos_ids
            self.step = step
            if self._at_barrier(step):
                if done or step + 1 >= gen.max_new_tokens:
                    self.control.close("end of generation")
                    closed = True
                else:
                    # the tokens left: a planner weighs a move against them, and no blocks
                    # are built ahead for a barrier that will not be held
                    left = gen.max_new_tokens - step - 1
                    self.control.barrier(step=step, pos=self.pos, stats=self.stats, remaining=left)
                    self.stats.reset()
            if done:
                reason = "eos"
                break
            x = torch.tensor([[token]], dtype=torch.long)
        self._finish(reason, closed=closed)
        return RingResult(tokens, prompt_len, reason, ttft_ms, tpot)

    def _finish(self, reason: str, *, closed: bool = False) -> None:
        if self.num_stages > 1:
            here = self.route()
            if not closed and self._any_skipped():  # they wait on the star, not the ring
                self.control.close("end of generation")
            for stage in here.fan_out():
                self._send("stop", {}, to=stage, reason=reason)
            msg, _ = self._recv(["stop"])
            msg.release()

    # --- every other stage ---------------------------------------------------------------------

    def serve(self, gen: GenParams) -> int:
        """Forward hidden states (middle) or return token ids (tail) until STOP; returns tokens served."""
        assert not self.is_head
        generator = new_generator(gen.seed)
        served = 0
        while True:
            here = self.route()
            if not here.active:  # skipped: nothing comes on the ring until blocks come back
                if self._idle():
                    continue
                msg, _ = self._recv(["stop"])  # after CLOSE: STOP from the stage before
                msg.release()
                return served
            msg, wait_ms = self._recv(["hidden", "stop"])
            if msg.kind == "stop":
                meta = dict(msg.meta)
                msg.release()
                for stage in here.fan_out():
                    self._send("stop", {}, to=stage, **meta)
                return served
            step, pos = int(msg.meta["step"]), int(msg.meta["pos"])
            if pos != self.pos:
                msg.release()
                raise ProtocolError(
                    f"stage {self.index}: hidden states for position {pos} but this stage has "
                    f"processed {self.pos} tokens"
                )
            hidden = msg.tensors[HIDDEN]
            out, compute_ms, real_ms = self._forward(hidden, pos, step)
            num_tokens = hidden.shape[1]
            self.pos += num_tokens
            if self.is_tail:
                token = sample_token(
                    out[0], temperature=gen.temperature, top_k=gen.top_k, generator=generator
                )
                send_ms, nbytes = self._send(
                    "token", {TOKEN: torch.tensor([token], dtype=torch.long)}, step=step
                )
            else:
                token = None
                send_ms, nbytes = self._send("hidden", {HIDDEN: out}, step=step, pos=pos)
            msg.release()  # after the send: a pass-through output may still view the buffer
            if step > 0:
                self.stats.sent(nbytes)
            self.tracer.write(TokenRecord(
                stage=self.index, token=step, pos=pos, num_tokens=num_tokens, compute_ms=compute_ms,
                real_ms=real_ms, recv_wait_ms=wait_ms, send_ms=send_ms, bytes=nbytes,
                prefill=step == 0, token_id=token,
            ))  # fmt: skip
            served += 1
            self.step = step
            self._after_send()
            if self._at_barrier(step):
                self.control.barrier(step=step, pos=self.pos, stats=self.stats)
                self.stats.reset()

    def _idle(self) -> bool:
        """A stage without blocks: take part in the next barrier, whatever its token (the
        ring's position advanced one per step meanwhile); False when the head closed."""
        self._after_send()  # the release of the blocks this stage gave away
        got = self.control.idle_barrier(last_step=self.step, pos=self.pos, stats=self.stats)
        self.stats.reset()
        if got is None:
            return False
        self.step, self.pos = got
        return True
