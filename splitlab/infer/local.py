"""A whole ring inside one process: one thread per stage over the in-process transport.

Same runtime, same frames, no sockets: the fast suite's equivalence tests and the unit test of
per-stage positions run on it. Stage threads' errors are re-raised in the caller.

    .venv/bin/pytest tests/equivalence/test_ring_equivalence.py -q
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from splitlab.errors import PeerLostError, WaitTimeoutError
from splitlab.infer.compute import StageCompute
from splitlab.infer.ring import GenParams, RingResult, RingStage, StageIdentity
from splitlab.telemetry.trace import Tracer
from splitlab.wire.inproc import InProcHub, InProcTransport


def stage_peer(index: int) -> str:
    return f"stage-{index}"


def run_local_ring(
    computes: Sequence[StageCompute],
    identities: Sequence[StageIdentity],
    prompt_ids: torch.Tensor,
    gen: GenParams,
    *,
    tracers: Sequence[Tracer] | None = None,
    strict_parity: bool = True,
    timeout_s: float = 60.0,
) -> RingResult:
    """Run the ring's stages as threads; returns the head's result."""
    n = len(computes)
    hub = InProcHub()
    transports = [InProcTransport(stage_peer(i), hub, session="local") for i in range(n)]
    stages = [
        RingStage(
            identity=identities[i],
            compute=computes[i],
            up=transports[i].channel(stage_peer((i - 1) % n), timeout_s=timeout_s)
            if n > 1
            else None,
            down=transports[i].channel(stage_peer((i + 1) % n), timeout_s=timeout_s)
            if n > 1
            else None,
            tracer=tracers[i] if tracers else None,
            strict_parity=strict_parity,
            timeout_s=timeout_s,
            session="local",
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
    return result
