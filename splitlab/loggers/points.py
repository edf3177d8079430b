"""Pure: a finished run's records -> the metric points and flat params every logger receives.

Inputs are what the launchers already hold: the owners' `round` trace records, the merged
model's `final_metrics.json` dict, the ring head's `ring_result.json` dict and the Config.
Names are slash-separated so TensorBoard and MLflow group them: `round/loss` (sample-weighted
over owners), `round/owner0/loss`, `final/val_accuracy`, `ring/tpot_ms`.

    .venv/bin/pytest tests/unit/test_loggers.py -q
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping, Sequence
from typing import Any

from splitlab.analysis.rounds import METRIC_COLUMNS, weighted_means
from splitlab.telemetry.records import round_number

ROUND_METRICS = tuple(c for c in METRIC_COLUMNS if c not in ("round", "owner"))
WEIGHTED = ("loss", "accuracy", "perplexity", "train_loss")  # averaged over owners by samples
RING_FIGURES = ("ttft_ms", "tpot_ms_median", "tokens_per_s", "prompt_len")


@dataclasses.dataclass(frozen=True)
class MetricPoint:
    """One scalar at one step (a round 1..N, a generated token 1..T, or 0 for run totals)."""

    name: str
    value: float
    step: int


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def round_points(rows: Sequence[Mapping[str, Any]]) -> list[MetricPoint]:
    """Per round: each owner's metrics and the sample-weighted means over owners."""
    points = []
    for index in sorted({r["round"] for r in rows}):
        got = [dict(r) for r in rows if r["round"] == index]
        step = round_number(index)
        for name, value in weighted_means(got, WEIGHTED).items():
            points.append(MetricPoint(f"round/{name}", value, step))
        for row in got:
            for name in ROUND_METRICS:
                value = _number(row.get(name))
                if value is not None:
                    points.append(MetricPoint(f"round/{row['owner']}/{name}", value, step))
    return points


def final_points(final: Mapping[str, Any] | None) -> list[MetricPoint]:
    """The merged model's final evaluation, at the step of the round it was taken after."""
    if not final:
        return []
    step = int(final.get("round") or 0)
    return [
        MetricPoint(f"final/{key}", number, step)
        for key, value in final.items()
        if key != "round" and (number := _number(value)) is not None
    ]


def ring_points(result: Mapping[str, Any] | None) -> list[MetricPoint]:
    """The ring's figures at step 0 and each generated token's TPOT at steps 1..T-1."""
    if not result:
        return []
    points = [
        MetricPoint(f"ring/{name}", number, 0)
        for name in RING_FIGURES
        if (number := _number(result.get(name))) is not None
    ]
    points.append(MetricPoint("ring/num_tokens", float(len(result.get("token_ids") or ())), 0))
    tpot_ms = result.get("tpot_ms") or ()
    points += [MetricPoint("ring/tpot_ms", float(v), i) for i, v in enumerate(tpot_ms, 1)]
    return points


def _plain(value: Any) -> Any:
    return value.value if isinstance(value, enum.Enum) else value


def config_params(cfg: Any, prefix: str = "") -> dict[str, str]:
    """A config dataclass flattened to dotted keys -> string values (lists and None as text);
    a group left unset (None) is one key."""
    params: dict[str, str] = {}
    for f in dataclasses.fields(cfg):
        key = f"{prefix}{f.name}"
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            params.update(config_params(value, f"{key}."))
        elif isinstance(value, dict) and value:
            for k, v in value.items():
                if dataclasses.is_dataclass(v):
                    params.update(config_params(v, f"{key}.{k}."))
                else:
                    params[f"{key}.{k}"] = str(_plain(v))
        elif isinstance(value, list | tuple):
            params[key] = str([_plain(v) for v in value])
        else:
            params[key] = str(_plain(value))
    return params
