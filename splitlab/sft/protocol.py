"""What the edge and the cloud agree on: the split (`SplitSpec`) and the frame kinds.

One edge process talks to one cloud process over `splitlab.wire.TcpTransport`, strictly
request/response (the edge waits for every answer), so the cloud handles frames in order:

    edge -> cloud  ACTIVATION  sft.hello     meta: SplitSpec; tensors: every lowrank_* factor
    cloud -> edge  ACTIVATION  sft.ready     (or sft.error, meta: message)
    edge -> cloud  ACTIVATION  sft.forward   front's crossing tensors + pad_mask (bool B x T);
                                             meta: grad, training, ops (queued step/zero_grad)
    cloud -> edge  ACTIVATION  sft.output    body's crossing tensors (or logits)
    edge -> cloud  GRADIENT    sft.backward  gradients of sft.output's tensors
    cloud -> edge  GRADIENT    sft.grad      gradients of sft.forward's crossing tensors
    edge -> cloud  ACTIVATION  sft.bye       meta: ops; the cloud answers sft.closed

The SVD is computed once, on the edge, and its factors cross in sft.hello, so both halves of
a cut come from one decomposition (two machines' LAPACK may pick different signs).

    .venv/bin/pytest tests/integration/test_sft_two_lines.py -q
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from splitlab.config.enums import ResidualMode, SftCut, SftFactors
from splitlab.errors import ConfigError
from splitlab.models.plan import (
    PartitionPlan,
    two_stage_plan,
    u_shape_plan,
    with_lowrank_cuts,
)

HELLO, READY, ERROR = "sft.hello", "sft.ready", "sft.error"
FORWARD, OUTPUT = "sft.forward", "sft.output"
BACKWARD, GRAD = "sft.backward", "sft.grad"
BYE, CLOSED = "sft.bye", "sft.closed"
PAD_MASK = "pad_mask"  # bool B x T; positions are rebuilt from it on the cloud
LOGITS = "logits"  # what crosses back when the cloud owns the head (tail_blocks=None)
EDGE, CLOUD = "edge", "cloud"


@dataclass(frozen=True)
class SplitSpec:
    """Where the model is cut and how.

    Attributes:
        family: the model family (checked on the cloud against its own model).
        num_layers: block count (checked likewise).
        layer: the split layer: the edge runs blocks [0, layer] (the last up to its code).
        rank: R of the low-rank cut; None = an ordinary cut (hidden_BTH crosses).
        residual: keep or drop (see `splitlab.models.lowrank`).
        cuts: front, tail or both (tail and both need `tail_blocks`).
        tail_blocks: U-shape: the edge keeps the last `tail_blocks` blocks and the head, so
            labels and logits never leave it; None = the cloud runs to the head and returns
            logits (the loss is still computed on the edge).
        factors: two or three (three: the receiver holds a trainable S_R, which crosses in
            sft.hello with the other factors).
    """

    family: str
    num_layers: int
    layer: int
    rank: int | None = None
    residual: str = ResidualMode.drop.value
    cuts: str = SftCut.front.value
    tail_blocks: int | None = None
    factors: str = SftFactors.two.value

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SplitSpec:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def plan(self) -> PartitionPlan:
        """The partition (and low-rank cuts) this spec names.

        Raises:
            ConfigError: naming the offending argument.
        """
        if not 0 <= self.layer < self.num_layers:
            raise ConfigError(f"layer={self.layer}: must be in [0, {self.num_layers - 1}]")
        if self.tail_blocks is None:
            plan = two_stage_plan(num_layers=self.num_layers, cut_layers=self.layer + 1)
        else:
            plan = u_shape_plan(
                num_layers=self.num_layers,
                cut_layers=self.layer + 1,
                tail_blocks=self.tail_blocks,
            )
        if self.rank is None:
            return plan
        return with_lowrank_cuts(plan, rank=self.rank, residual=self.residual, cuts=self.cuts,
                                 factors=self.factors)  # fmt: skip
