"""Partition plans: which contiguous blocks (and which ends of the model) each part owns.

Pure values, no torch: a plan is computed from the block count and the architecture's cut
settings, validated where the config enters, and handed to `splitlab.models.parts` which cuts
a loaded model accordingly. The same `Span` describes a U-shape part, a two-stage stage and a
ring stage, so the shard loader and migration code speak one vocabulary.

    .venv/bin/pytest tests/unit/test_models_plan.py
"""

from __future__ import annotations

from dataclasses import dataclass

from splitlab.errors import ConfigError


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
    """

    start: int
    stop: int
    has_embeddings: bool = False
    has_head: bool = False

    def __post_init__(self) -> None:
        assert 0 <= self.start <= self.stop, (self.start, self.stop)

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
