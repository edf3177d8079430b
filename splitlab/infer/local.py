"""A whole ring inside one process: one thread per stage over the in-process transport.

Same runtime, same frames, no sockets: the fast suite's equivalence tests and the unit test of
per-stage positions run on it. Stage threads' errors are re-raised in the caller. With
`window > 0` the stages also run the window barrier on the control lane and migrate KV on the
KV lane of the same transports (`splitlab.infer.ring_wire.ring_links`, as over TCP).

`decode_in_turn` is the ring's work with no ring at all: every stage's compute called in turn
on one thread, per token. `tools/bench_ring.py` times it beside the ring and the unsplit model,
to tell what the partition costs from what separate processes and the hops cost.

    .venv/bin/pytest tests/equivalence/test_ring_equivalence.py -q
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import torch

from splitlab.drift.contract import DriftSource
from splitlab.errors import PeerLostError, WaitTimeoutError
from splitlab.infer.compute import StageCompute
from splitlab.infer.migration import Migrator
from splitlab.infer.planners import Noop, Planner
from splitlab.infer.ring import GenParams, RingResult, RingStage, StageIdentity
from splitlab.infer.ring_wire import RingLinks, ring_links, stage_peer
from splitlab.infer.sampling import new_generator, sample_token
from splitlab.infer.window import HeadControl, StageControl
from splitlab.models.shard import CheckpointIndex
from splitlab.telemetry.trace import Tracer
from splitlab.wire.inproc import InProcHub, InProcTransport


@torch.inference_mode()
def decode_in_turn(
    computes: Sequence[StageCompute], prompt_ids: torch.Tensor, gen: GenParams
) -> tuple[RingResult, list[list[float]]]:
    """Prefill `prompt_ids` (1 x T) and decode through every stage's compute in turn, sampling
    as the head does; returns the result and, per decode token, each stage's compute (ms)."""
    generator = new_generator(gen.seed)
    x = prompt_ids.reshape(1, -1).to(torch.long)
    tokens: list[int] = []
    tpot: list[float] = []
    compute: list[list[float]] = []
    ttft_ms, reason, pos = 0.0, "max_new_tokens", 0
    for step in range(gen.max_new_tokens):
        t0 = time.perf_counter()
        hidden, stage_ms = x, []
        for stage in computes:
            t1 = time.perf_counter()
            hidden = stage.forward(hidden, pos)
            stage_ms.append((time.perf_counter() - t1) * 1e3)
        token = sample_token(
            hidden[0], temperature=gen.temperature, top_k=gen.top_k, generator=generator
        )
        trip_ms = (time.perf_counter() - t0) * 1e3
        if step == 0:
            ttft_ms = trip_ms
        else:
            tpot.append(trip_ms)
            compute.append(stage_ms)
        pos += x.shape[1]
        tokens.append(token)
        if token in gen.eos_ids:
            reason = "eos"
            break
        x = torch.tensor([[token]], dtype=torch.long)
    return RingResult(tokens, prompt_ids.shape[-1], reason, ttft_ms, tpot), compute


def run_local_ring(
    computes: Sequence[StageCompute],
    identities: Sequence[StageIdentity],
    prompt_ids: torch.Tensor,
    gen: GenParams,
    *,
    tracers: Sequence[Tracer] | None = None,
    strict_parity: bool = True,
    timeout_s: float = 60.0,
    window: int = 0,
    planner: Planner | None = None,
    index: CheckpointIndex | None = None,
    dtype: str = "auto",
    drifts: Sequence[DriftSource | None] | None = None,
    ctrl_timeout_s: float = 10.0,
    faults: dict[int, str] | None = None,
    bypass: bool = False,
) -> RingResult:
    """Run the ring's stages as threads; returns the head's result (with its window records).
    `bypass`: a barrier may leave a middle stage without blocks (the planner's cuts say)."""
    n = len(computes)
    hub = InProcHub()
    transports = [InProcTransport(stage_peer(i), hub, session="local") for i in range(n)]
    bypass = bypass and window > 0 and n > 1
    links = [ring_links(transports[i], stage=i, num_stages=n, window=window if n > 1 else 0,
                        timeout_s=timeout_s, ctrl_timeout_s=ctrl_timeout_s, bypass=bypass)
             for i in range(n)]  # fmt: skip
    controls = _controls(computes, identities, links, window=window, planner=planner, index=index,
                         dtype=dtype, drifts=drifts, tracers=tracers, ctrl_timeout_s=ctrl_timeout_s,
                         timeout_s=timeout_s, faults=faults or {}, bypass=bypass)  # fmt: skip
    stages = [
        RingStage(
            identity=identities[i],
            compute=computes[i],
            up=links[i].up,
            down=links[i].down,
            tracer=tracers[i] if tracers else None,
            strict_parity=strict_parity,
            timeout_s=timeout_s,
            session="local",
            control=controls[i],
            drift=drifts[i] if drifts else None,
            peers=links[i].peers,
        )  # fmt: skip
        for i in range(n)
    ]
    errors: list[BaseException] = []

    def member(stage: RingStage) -> None:
        try:
            stage.serve(stage.handshake())
        except BaseException as exc:  # surfaced in the caller
            errors.append(exc)
            transports[stage.index].close()  # neighbours see a lost peer instead of hanging

    threads = [threading.Thread(target=member, args=(s,), daemon=True) for s in stages[1:]]
    for t in threads:
        t.start()
    try:
        head = stages[0]
        result = head.generate(prompt_ids, head.handshake(gen))
    except (PeerLostError, WaitTimeoutError) as exc:
        transports[0].close()
        for t in threads:
            t.join(timeout=timeout_s)
        raise (errors[0] if errors else exc) from None  # a member's failure is the root cause
    except BaseException:
        transports[0].close()
        raise
    finally:
        for t in threads:
            t.join(timeout=timeout_s)
        for tr in transports:
            tr.close()
    if errors:
        raise errors[0]
    if controls[0] is not None:
        result.windows = list(controls[0].decisions)
    return result


def _controls(computes, identities, links: Sequence[RingLinks], *, window, planner, index, dtype,
              drifts, tracers, ctrl_timeout_s, timeout_s, faults, bypass=False) -> list:  # fmt: skip
    """Per stage: HeadControl / StageControl on its links, or None without a window."""
    n = len(computes)
    if window <= 0 or n < 2:
        return [None] * n
    num_layers = identities[0].num_layers
    cuts = [ident.start for ident in identities[1:]]
    migrators = [
        Migrator(stage=i, compute=computes[i], cuts=cuts, num_layers=num_layers, index=index,
                 dtype=dtype, timeout_s=ctrl_timeout_s, kv_prev=links[i].kv_prev,
                 kv_next=links[i].kv_next, bypass=bypass)
        for i in range(n)
    ]  # fmt: skip
    tracer = (lambda i: tracers[i]) if tracers else (lambda i: None)
    drift = (lambda i: drifts[i]) if drifts else (lambda i: None)
    head = HeadControl(window=window, ctrls=links[0].ctrls, migrator=migrators[0],
                       planner=planner or Noop(), drift=drift(0), tracer=tracer(0),
                       timeout_s=ctrl_timeout_s)  # fmt: skip
    return [head] + [
        StageControl(
            stage=i,
            window=window,
            ctrl=links[i].ctrl,
            migrator=migrators[i],
            drift=drift(i),
            tracer=tracer(i),
            timeout_s=ctrl_timeout_s,
            entry_timeout_s=timeout_s,
            fault=faults.get(i),
        )  # fmt: skip
        for i in range(1, n)
    ]
