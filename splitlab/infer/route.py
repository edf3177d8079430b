"""Where a stage's data-ring frames come from and go to, under the ring's current cuts.

Without `architecture.bypass` every stage owns at least one block and the ring is fixed: stage
i reads from i - 1 and sends to i + 1 (the tail to the head). With bypass a re-partition may
leave a middle stage no blocks; the data ring then skips it, so its links carry nothing on a
token's path (the point: a stage whose link has become slow stops costing its two hops):

- an *active* stage (>= 1 block; the head and the tail always are) sends hidden states to the
  next active stage (`target`) and a `tick` (step and position, no tensors) to every skipped
  stage in between (`skipped`), off the token's critical path;
- a skipped stage reads ticks from the nearest active stage before it (`source`), counts
  positions and steps into the window barrier with everyone else, so it can take blocks back
  at a later barrier (its KV then arrives from the donor like any migration);
- stop and abort travel the same way: the target and the skipped stages get them, and only an
  active stage passes them on.

Pure values; `splitlab.infer.ring.RingStage` asks for a new `Route` after every barrier.

    .venv/bin/pytest tests/unit/test_infer_route.py -q
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Route:
    """One stage's view of the data ring (see module docstring)."""

    stage: int
    active: bool  # owns at least one block
    source: int  # the stage this one reads every data-ring frame from
    target: int  # the next active stage: hidden states, tokens, stop and abort go there
    skipped: tuple[int, ...]  # the block-less stages between this one and `target`, in order

    def fan_out(self, origin: int | None = None) -> tuple[int, ...]:
        """Who a stop or an abort goes to from here: the skipped stages then the target, cut
        short before `origin` (an abort that has come round to where it started)."""
        ring = (*self.skipped, self.target)
        if origin is not None and origin in ring:
            return ring[: ring.index(origin)]
        return ring


def stage_blocks(cuts: Sequence[int], num_layers: int) -> list[int]:
    """Blocks per stage under `cuts`."""
    bounds = [0, *cuts, num_layers]
    return [b - a for a, b in zip(bounds, bounds[1:], strict=False)]


def route(stage: int, cuts: Sequence[int], num_layers: int) -> Route:
    """Stage `stage`'s route under `cuts` (the head and the tail must own blocks)."""
    blocks = stage_blocks(cuts, num_layers)
    n = len(blocks)
    if n < 2:
        return Route(stage=stage, active=True, source=stage, target=stage, skipped=())
    if blocks[0] < 1 or blocks[-1] < 1:
        raise ValueError(f"cuts {list(cuts)}: the head and the tail must own blocks ({blocks})")
    source = next(s for s in ((stage - d) % n for d in range(1, n)) if blocks[s] > 0)
    after = [(stage + d) % n for d in range(1, n)]
    target = next(s for s in after if blocks[s] > 0)
    skipped = tuple(after[: after.index(target)])
    return Route(stage=stage, active=blocks[stage] > 0, source=source, target=target,
                 skipped=skipped)  # fmt: skip
