"""Smooth weighted round robin and the adaptive compute weights that feed it.

`SmoothWRR` is nginx's smooth weighted round robin: every pick adds each candidate's weight
to its running score, takes the highest score and subtracts the total weight from the winner.
Over any run of `sum(weights)` picks each worker is chosen in proportion to its weight, and
picks are interleaved (3:1 gives a, a, b, a, ... not a, a, a, b). The running scores persist
across windows, so a window of 2 with weights 3:1 does not always hand the slow worker nothing.
A round starts from reset scores; with fixed weights the owner then replays the earlier rounds'
picks, so an owner with 2 microbatches a round still gives the slow worker its share over the
run, and a resumed round picks exactly as an uninterrupted one.

An owner calls `assign(count)` once per window to pin each of its microbatches to a worker
before the window opens. A worker serving ready queues from several owners calls
`pick(eligible)` to choose among the owners that have work waiting (peer-weighted fairness).

`AdaptiveWeights` turns measured body throughput (padded tokens / forward+backward seconds)
into weights: EWMA with 20% new measurement, the configured initial weights until every worker
has reported once, and a 20:1 cap on the ratio so a slow worker keeps getting work (and keeps
being measured). With `adaptive=False` the initial weights stay fixed.

    .venv/bin/pytest tests/unit/test_train_wrr.py -q
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence

from splitlab.errors import ConfigError

EWMA_NEW = 0.2  # share of a new throughput measurement in the running estimate
MAX_RATIO = 20.0  # the fastest weight is at most this many times the slowest


def _check_weights(weights: Mapping[str, float], what: str) -> dict[str, float]:
    if not weights:
        raise ConfigError(f"{what}: needs at least one worker")
    out: dict[str, float] = {}
    for name, weight in weights.items():
        value = float(weight)
        if not math.isfinite(value) or value <= 0.0:
            raise ConfigError(f"{what}[{name!r}]={weight!r}: weights must be finite and > 0")
        out[name] = value
    return out


class SmoothWRR:
    """Smooth weighted round robin over named members with persistent running scores.

    Ties go to the member listed first, so the sequence is a pure function of the weights,
    their order and the history of picks.
    """

    def __init__(self, weights: Mapping[str, float]) -> None:
        self._weights = _check_weights(weights, "wrr.weights")
        self._current: dict[str, float] = dict.fromkeys(self._weights, 0.0)

    @property
    def members(self) -> tuple[str, ...]:
        return tuple(self._weights)

    @property
    def weights(self) -> dict[str, float]:
        return dict(self._weights)

    def set_weights(self, weights: Mapping[str, float]) -> None:
        """Change the weights of the same members; running scores carry over."""
        checked = _check_weights(weights, "wrr.weights")
        if set(checked) != set(self._weights):
            raise ValueError(f"members changed: {sorted(self._weights)} -> {sorted(checked)}")
        self._weights = {name: checked[name] for name in self._weights}

    def reset(self) -> None:
        """Forget the running scores (a new round starts from a clean slate)."""
        self._current = dict.fromkeys(self._weights, 0.0)

    def pick(self, eligible: Collection[str] | None = None) -> str:
        """The next member among `eligible` (None = all); only eligible scores move.

        Raises:
            ValueError: `eligible` is empty or names a non-member.
        """
        names = self.members if eligible is None else [n for n in self.members if n in eligible]
        if eligible is not None:
            unknown = set(eligible) - set(self._weights)
            if unknown:
                raise ValueError(f"not members: {sorted(unknown)}")
        if not names:
            raise ValueError("no eligible member to pick")
        total = 0.0
        for name in names:
            self._current[name] += self._weights[name]
            total += self._weights[name]
        best = max(names, key=lambda n: self._current[n])  # first maximum wins ties
        self._current[best] -= total
        return best

    def assign(self, window_count: int) -> list[str]:
        """Pin each of a window's `window_count` microbatches to a member, in dispatch order."""
        if window_count < 0:
            raise ValueError(f"window_count={window_count} must be >= 0")
        return [self.pick() for _ in range(window_count)]


def capped(weights: Mapping[str, float], max_ratio: float = MAX_RATIO) -> dict[str, float]:
    """Raise every weight to at least `max(weights) / max_ratio`."""
    floor = max(weights.values()) / max_ratio
    return {name: max(weight, floor) for name, weight in weights.items()}


class AdaptiveWeights:
    """Per-worker compute weights: initial values, then capped EWMA of measured throughput.

    Args:
        initial: configured weights (`architecture.compute_weights`), one per worker.
        adaptive: False keeps `initial` forever (controlled experiments).
        ewma_new: share of each new measurement in the estimate.
        max_ratio: cap on fastest / slowest weight once measured weights are in use.
    """

    def __init__(
        self,
        initial: Mapping[str, float],
        *,
        adaptive: bool = True,
        ewma_new: float = EWMA_NEW,
        max_ratio: float = MAX_RATIO,
    ) -> None:
        if not 0.0 < ewma_new <= 1.0:
            raise ConfigError(f"ewma_new={ewma_new}: must be in (0, 1]")
        if not max_ratio >= 1.0:
            raise ConfigError(f"max_ratio={max_ratio}: must be >= 1")
        self._initial = _check_weights(initial, "architecture.compute_weights")
        self.adaptive = adaptive
        self.ewma_new = ewma_new
        self.max_ratio = max_ratio
        self._rate: dict[str, float] = {}

    def observe(self, worker: str, *, padded_tokens: int, seconds: float) -> None:
        """Fold one window's body measurement of `worker` into its estimate.

        A measurement with no tokens or no time carries no information and is ignored.

        Raises:
            ValueError: an unknown worker or a negative / non-finite measurement.
        """
        if worker not in self._initial:
            raise ValueError(f"unknown worker {worker!r}")
        if padded_tokens < 0 or not math.isfinite(seconds) or seconds < 0.0:
            raise ValueError(f"bad measurement for {worker!r}: {padded_tokens} tokens, {seconds} s")
        if padded_tokens == 0 or seconds == 0.0:
            return
        self.observe_rate(worker, padded_tokens / seconds)

    def observe_rate(self, worker: str, tokens_per_s: float | None) -> None:
        """Fold a rate as a COMMIT reports it (None or 0: the worker ran nothing, ignored).

        Raises:
            ValueError: an unknown worker or a negative / non-finite rate.
        """
        if worker not in self._initial:
            raise ValueError(f"unknown worker {worker!r}")
        if tokens_per_s is None or tokens_per_s == 0.0:
            return
        if not math.isfinite(tokens_per_s) or tokens_per_s < 0.0:
            raise ValueError(f"bad rate for {worker!r}: {tokens_per_s} tokens/s")
        old = self._rate.get(worker)
        new = self.ewma_new
        self._rate[worker] = tokens_per_s if old is None else (1.0 - new) * old + new * tokens_per_s

    @property
    def measured(self) -> bool:
        """Every worker has reported at least once."""
        return set(self._rate) == set(self._initial)

    def weights(self) -> dict[str, float]:
        """What the next window's `SmoothWRR` should use."""
        if not self.adaptive or not self.measured:
            return dict(self._initial)
        return capped({name: self._rate[name] for name in self._initial}, self.max_ratio)

    def reset(self) -> None:
        """A new round: back to the configured weights until everyone is measured again."""
        self._rate.clear()


def shares(assignment: Sequence[str]) -> dict[str, float]:
    """Fraction of microbatches per worker (for traces and tests)."""
    if not assignment:
        return {}
    counts: dict[str, int] = {}
    for name in assignment:
        counts[name] = counts.get(name, 0) + 1
    return {name: count / len(assignment) for name, count in counts.items()}
