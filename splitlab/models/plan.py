"""Partition plans: which contiguous blocks (and which ends of the model) each part owns.

Pure values, no torch: a plan is computed from the block count and the architecture's cut
settings, validated where the config enters, and handed to `splitlab.models.parts` which cuts
a loaded model accordingly. The same `Span` describes a U-shape part, a two-stage stage and a
ring stage, so the shard loader and migration code speak one vocabulary.

    .venv/bin/pytest tests/unit/test_models_plan.py
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from splitlab.config.enums import ResidualMode, SftCut, SftFactors
from splitlab.errors import ConfigError


@dataclass(frozen=True)
class CutSpec:
    """A low-rank cut inside block `block`: the FFN's first projection is split at rank R.

    The sending part runs the block up to the R-dim code (`lowrank_in`); the receiving part
    runs the rest of it (`lowrank_out`, activation, output projection, residual add). See
    `splitlab.models.lowrank` for what crosses.

    Attributes:
        block: global index of the decomposed block.
        rank: R, the width of the code that crosses the wire.
        residual: keep (the residual stream crosses too) or drop (the FFN's residual add is
            removed, as in the SFT paper).
        factors: two (the sender holds S_R V_R) or three (the sender holds V_R, the receiver
            a trainable S_R before U_R).
    """

    block: int
    rank: int
    residual: ResidualMode = ResidualMode.drop
    factors: SftFactors = SftFactors.two

    def __post_init__(self) -> None:
        assert self.block >= 0 and self.rank >= 1, (self.block, self.rank)

    @property
    def keeps_residual(self) -> bool:
        return ResidualMode(self.residual) is ResidualMode.keep


@dataclass(frozen=True)
class Span:
    """Blocks `[start, stop)` of the model, plus the ends this part owns.

    Attributes:
        start: index of the first block (0-based, the upstream `layers.N` index).
        stop: one past the last block; `stop == start` is a part with no blocks (a U-shape
            tail with `tail_blocks=0` still owns the final norm and head).
        has_embeddings: the part takes token ids and runs the embeddings first.
        has_head: the part ends with the final norm and head (BERT: pooler + classifier)
            and returns logits instead of hidden states.
        code_in: the part starts by finishing block `start - 1` from its low-rank code
            (receiving side of a cut); None = it starts from hidden_BTH or token ids.
        code_out: the part's last block `stop - 1` stops at its low-rank code (sending side
            of a cut); None = every block runs whole.
    """

    start: int
    stop: int
    has_embeddings: bool = False
    has_head: bool = False
    code_in: CutSpec | None = None
    code_out: CutSpec | None = None

    def __post_init__(self) -> None:
        assert 0 <= self.start <= self.stop, (self.start, self.stop)
        if self.code_in is not None:
            assert not self.has_embeddings and self.code_in.block == self.start - 1, self
        if self.code_out is not None:
            assert not self.has_head and self.code_out.block == self.stop - 1, self

    @property
    def num_blocks(self) -> int:
        return self.stop - self.start

    @property
    def layer_ids(self) -> range:
        """The global block indices, in execution order."""
        return range(self.start, self.stop)


@dataclass(frozen=True)
class PartitionPlan:
    """A training split: front on the owner, body on a worker, tail (U-shape only) on the owner.

    U-shape: front = embeddings + blocks `[0, cut_layers)`; body = the middle; tail = the last
    `tail_blocks` blocks + final norm + head. Two-stage: `tail` is None and the body ends with
    the head (labels travel to the worker).
    """

    num_layers: int
    front: Span
    body: Span
    tail: Span | None

    @property
    def spans(self) -> tuple[Span, ...]:
        """Every part in forward order."""
        return (self.front, self.body) if self.tail is None else (self.front, self.body, self.tail)

    @property
    def owner_spans(self) -> tuple[Span, ...]:
        """The parts the data owner keeps (front, and in U-shape the tail)."""
        return (self.front,) if self.tail is None else (self.front, self.tail)


def with_lowrank_cuts(
    plan: PartitionPlan,
    *,
    rank: int,
    residual: ResidualMode | str = ResidualMode.drop,
    cuts: SftCut | str = SftCut.front,
    factors: SftFactors | str = SftFactors.two,
) -> PartitionPlan:
    """`plan` with low-rank cuts: front -> body at block `cut_layers - 1`, body -> tail at the
    body's last block (U-shape only), or both.

    Raises:
        ConfigError: naming `finetune.sft.cuts` / `architecture.cut_layers` when the plan has no
            block on the sending side of a requested cut, or `finetune.sft.rank` below 1.
    """
    if rank < 1:
        raise ConfigError(f"finetune.sft.rank={rank}: must be >= 1")
    which = SftCut(cuts)
    residual, factors = ResidualMode(residual), SftFactors(factors)
    front, body, tail = plan.front, plan.body, plan.tail
    if which in (SftCut.front, SftCut.both):
        if front.num_blocks < 1:
            raise ConfigError(
                f"finetune.sft.cuts={which.value} needs architecture.cut_layers >= 1: the front "
                "must own the block whose FFN is decomposed"
            )
        cut = CutSpec(front.stop - 1, rank, residual, factors)
        front, body = replace(front, code_out=cut), replace(body, code_in=cut)
    if which in (SftCut.tail, SftCut.both):
        if tail is None:
            raise ConfigError(
                f"finetune.sft.cuts={which.value}: a two-stage plan has no body -> tail cut "
                "(use cuts=front)"
            )
        cut = CutSpec(body.stop - 1, rank, residual, factors)
        body, tail = replace(body, code_out=cut), replace(tail, code_in=cut)
    return PartitionPlan(num_layers=plan.num_layers, front=front, body=body, tail=tail)


def lowrank_cuts(plan: PartitionPlan) -> tuple[CutSpec, ...]:
    """The plan's low-rank cuts in forward order (each once)."""
    return tuple(span.code_out for span in plan.spans if span.code_out is not None)


def _check_num_layers(num_layers: int) -> None:
    if num_layers < 1:
        raise ConfigError(f"model.num_layers={num_layers}: a model needs at least one block")


def u_shape_plan(*, num_layers: int, cut_layers: int, tail_blocks: int) -> PartitionPlan:
    """The U-shape split; at least one block must stay remote on the worker.

    Raises:
        ConfigError: naming `architecture.cut_layers` / `architecture.tail_blocks` and values.
    """
    _check_num_layers(num_layers)
    if cut_layers < 0:
        raise ConfigError(f"architecture.cut_layers={cut_layers}: must be >= 0")
    if tail_blocks < 0:
        raise ConfigError(f"architecture.tail_blocks={tail_blocks}: must be >= 0")
    body_blocks = num_layers - cut_layers - tail_blocks
    if body_blocks < 1:
        raise ConfigError(
            f"architecture.cut_layers={cut_layers} + architecture.tail_blocks={tail_blocks} "
            f"leaves {body_blocks} of model.num_layers={num_layers} blocks for the worker: "
            "at least one body block must be remote"
        )
    tail_start = num_layers - tail_blocks
    return PartitionPlan(
        num_layers=num_layers,
        front=Span(0, cut_layers, has_embeddings=True),
        body=Span(cut_layers, tail_start),
        tail=Span(tail_start, num_layers, has_head=True),
    )


def two_stage_plan(*, num_layers: int, cut_layers: int) -> PartitionPlan:
    """The legacy split: front = embeddings + `[0, cut_layers)`; the rest ends with the head.

    Raises:
        ConfigError: naming `architecture.cut_layers` and its value.
    """
    _check_num_layers(num_layers)
    if not 0 <= cut_layers < num_layers:
        raise ConfigError(
            f"architecture.cut_layers={cut_layers}: must be in [0, {num_layers - 1}] so the "
            f"second stage keeps at least one of model.num_layers={num_layers} blocks"
        )
    return PartitionPlan(
        num_layers=num_layers,
        front=Span(0, cut_layers, has_embeddings=True),
        body=Span(cut_layers, num_layers, has_head=True),
        tail=None,
    )


def even_cuts(*, num_layers: int, stages: int) -> list[int]:
    """Cuts that give `stages` contiguous spans whose sizes differ by at most one block.

    Earlier stages get the extra blocks (the head stage also embeds; the tail stage also runs
    the head, so neither end is favoured).

    Raises:
        ConfigError: naming `architecture.stages` when there are fewer blocks than stages.
    """
    _check_num_layers(num_layers)
    if not 1 <= stages <= num_layers:
        raise ConfigError(
            f"architecture.stages={stages}: must be in [1, {num_layers}] "
            f"(model.num_layers={num_layers}, one block per stage at least)"
        )
    base, extra = divmod(num_layers, stages)
    cuts, start = [], 0
    for stage in range(stages - 1):
        start += base + (1 if stage < extra else 0)
        cuts.append(start)
    return cuts


def ring_plan(num_layers: int, cuts: list[int] | tuple[int, ...]) -> tuple[Span, ...]:
    """Ring stages: stage i owns blocks `[cuts[i-1], cuts[i])`; stage 0 embeds, the last has the head.

    Every stage owns at least one block, so cuts must be strictly increasing inside
    `[1, num_layers - 1]`.

    Raises:
        ConfigError: naming `architecture.cuts` and the offending value.
    """
    _check_num_layers(num_layers)
    bounds = [0, *cuts, num_layers]
    for i, cut in enumerate(cuts):
        if not 1 <= cut <= num_layers - 1:
            raise ConfigError(
                f"architecture.cuts[{i}]={cut}: out of range [1, {num_layers - 1}] "
                f"for model.num_layers={num_layers}"
            )
    for i in range(1, len(bounds)):
        if bounds[i] <= bounds[i - 1]:
            raise ConfigError(
                f"architecture.cuts={list(cuts)}: must be strictly increasing "
                "(every stage owns at least one block)"
            )
    last = len(bounds) - 2
    return tuple(
        Span(bounds[i], bounds[i + 1], has_embeddings=i == 0, has_head=i == last)
        for i in range(last + 1)
    )


def cuts_of(spans: tuple[Span, ...] | list[Span]) -> list[int]:
    """The inverse of `ring_plan`: the first block of every stage after the first."""
    return [span.start for span in spans[1:]]
