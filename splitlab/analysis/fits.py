"""Cost-model fits (decode, prefill, link, load) by least squares, and the calibration record.

    .venv/bin/pytest tests/unit/test_analysis_fits.py -q

Pure: every function takes arrays or dicts and returns values. A fit that the data cannot
support (no more distinct x values than the model has parameters, so the curve would pass
through every point and r^2 = 1 would say nothing; non-finite values) returns a `NoFit` that
says why instead of inventing coefficients. A fit that succeeds but is unphysical (a negative
quadratic prefill term, a negative per-byte cost) carries a warning.

`load_cost(record)` reads L_n, the time to load n blocks from the checkpoint (`"load"` of a
calibration record: `fixed_ms + per_block_ms * n`), for a planner's migration-cost term;
`select_record(document, key)` picks a record out of a calibration file's document.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

CALIBRATION_VERSION = 1
MIN_POINTS = 3

# Model name -> (parameter names, polynomial degree in x). Units: x in tokens or bytes, y in ms.
MODELS: dict[str, tuple[tuple[str, ...], int]] = {
    "decode": (("c0", "c1"), 1),  # ms per block per step = c0 + c1 * (P + t)
    "prefill": (("d0", "d1", "d2"), 2),  # ms per block = d0 + d1 * P + d2 * P^2
    "link": (("alpha_ms", "beta_ms_per_byte"), 1),  # ms per message = alpha + beta * bytes
    "load": (("fixed_ms", "per_block_ms"), 1),  # L_n: ms to load n blocks = fixed + per_block * n
}


@dataclass(frozen=True)
class Fit:
    """Coefficients of `model` (names in `MODELS`), r^2 (None when y is constant) and n."""

    model: str
    params: dict[str, float]
    r2: float | None
    n: int
    warnings: tuple[str, ...] = ()
    ok: bool = field(default=True, init=False)

    def predict(self, x: Sequence[float] | np.ndarray) -> np.ndarray:
        coefficients = list(self.params.values())
        x_arr = np.asarray(x, dtype=float)
        return sum(c * x_arr**power for power, c in enumerate(coefficients))

    def to_dict(self) -> dict[str, Any]:
        return {"params": dict(self.params), "r2": self.r2, "n": self.n,
                "warnings": list(self.warnings)}  # fmt: skip


@dataclass(frozen=True)
class NoFit:
    """Why `model` could not be fitted from these n points."""

    model: str
    reason: str
    n: int
    ok: bool = field(default=False, init=False)


def _polyfit(
    model: str, x: Sequence[float] | np.ndarray, y: Sequence[float] | np.ndarray
) -> Fit | NoFit:
    names, degree = MODELS[model]
    x_arr, y_arr = np.asarray(x, dtype=float).ravel(), np.asarray(y, dtype=float).ravel()
    if x_arr.shape != y_arr.shape:
        raise ValueError(f"{model} fit: {x_arr.size} x values but {y_arr.size} y values")
    n = int(x_arr.size)
    # More points than parameters, or the curve interpolates and r^2 = 1 says nothing; points
    # at one x only repeat a value, so they count once.
    need = max(MIN_POINTS, degree + 2)
    if n < need:
        return NoFit(model, f"{n} points; a {model} fit needs at least {need}, more than its "
                     f"{degree + 1} parameters", n)  # fmt: skip
    if not (np.isfinite(x_arr).all() and np.isfinite(y_arr).all()):
        return NoFit(model, "non-finite x or y values", n)
    distinct = int(np.unique(x_arr).size)
    if distinct < need:
        return NoFit(model, f"{distinct} distinct x values; a {model} fit needs at least {need}, "
                     f"more than its {degree + 1} parameters", n)  # fmt: skip
    # Columns scaled to [-1, 1] so P^2 ~ 1e8 next to 1 does not wreck the conditioning.
    scale = float(np.max(np.abs(x_arr))) or 1.0
    design = np.vander(x_arr / scale, degree + 1, increasing=True)
    solution, _, rank, _ = np.linalg.lstsq(design, y_arr, rcond=None)
    if rank < degree + 1:
        return NoFit(model, f"rank-deficient design (rank {rank} < {degree + 1})", n)
    coefficients = [float(c) / scale**power for power, c in enumerate(solution)]
    residual = y_arr - design @ solution
    ss_res = float(residual @ residual)
    ss_tot = float(((y_arr - y_arr.mean()) ** 2).sum())
    r2 = None if ss_tot == 0.0 else 1.0 - ss_res / ss_tot
    params = dict(zip(names, coefficients, strict=True))
    return Fit(model, params, r2, n, _physical_warnings(model, params))


def _physical_warnings(model: str, params: Mapping[str, float]) -> tuple[str, ...]:
    out: list[str] = []
    if model == "decode" and params["c1"] < 0:
        out.append("c1 < 0: decode time falls with context; time batches of >= 24 steps")
    if model == "prefill" and params["d2"] < 0:
        out.append("d2 < 0: unphysical; prompts shorter than ~512 do not show the P^2 term")
    if model == "link" and params["beta_ms_per_byte"] < 0:
        out.append("beta < 0: unphysical; the sizes do not span enough bytes to see the link")
    if model == "link" and params["alpha_ms"] < 0:
        out.append("alpha < 0: unphysical latency intercept")
    if model == "load" and params["per_block_ms"] <= 0:
        out.append("per_block_ms <= 0: unphysical; loading more blocks cannot take less time")
    return tuple(out)


def fit_decode(
    p_plus_t: Sequence[float] | np.ndarray, ms: Sequence[float] | np.ndarray
) -> Fit | NoFit:
    """Per-block decode time `c0 + c1 * (P + t)` against context length in tokens."""
    return _polyfit("decode", p_plus_t, ms)


def fit_prefill(p: Sequence[float] | np.ndarray, ms: Sequence[float] | np.ndarray) -> Fit | NoFit:
    """Per-block prefill time `d0 + d1 * P + d2 * P^2` against prompt length in tokens."""
    return _polyfit("prefill", p, ms)


def fit_link(nbytes: Sequence[float] | np.ndarray, ms: Sequence[float] | np.ndarray) -> Fit | NoFit:
    """Link time `alpha_ms + beta_ms_per_byte * bytes` (latency intercept, per-byte cost)."""
    return _polyfit("link", nbytes, ms)


def fit_load(num_blocks: Sequence[float] | np.ndarray, ms: Sequence[float] | np.ndarray
             ) -> Fit | NoFit:  # fmt: skip
    """L_n = `fixed_ms + per_block_ms * n`: the time to load n blocks from the checkpoint."""
    return _polyfit("load", num_blocks, ms)


def fit_or_null(result: Fit | NoFit) -> dict[str, Any] | None:
    """The JSON value of a fit: its dict, or null when it was not (or could not be) observed."""
    return result.to_dict() if isinstance(result, Fit) else None


def calibration_key(model: str, device: str, dtype: str) -> str:
    """The key a calibration file stores one record under."""
    return f"{model}|{device}|{dtype}"


@dataclass(frozen=True)
class CalibrationResult:
    """One calibration record. Every measurement is null unless it was observed.

    `weight_load_ms` is `{"ms": float, "cache": "cold" | "warm" | "unknown"}`; `link` is
    `{"alpha_ms", "beta_ms_per_byte", "r2", "n", "loopback"}`; `load` is L_n, the fit of the
    time to load n blocks: `{"fixed_ms", "per_block_ms", "params", "r2", "n", "points": [[n,
    ms], ...], "cache", "warnings"}` (read it with `load_cost`); `swap_ms`, `contention` and
    `thermal` are whatever the calibrator observed, else None.
    """

    model: str
    device: str
    dtype: str
    calibrated: bool = False
    warnings: tuple[str, ...] = ()
    decode: dict[str, Any] | None = None
    prefill: dict[str, Any] | None = None
    weight_load_ms: dict[str, Any] | None = None
    swap_ms: float | None = None
    link: dict[str, Any] | None = None
    load: dict[str, Any] | None = None
    contention: dict[str, Any] | None = None
    thermal: dict[str, Any] | None = None
    version: int = CALIBRATION_VERSION

    def __post_init__(self) -> None:
        if not self.calibrated and not self.warnings:
            raise ValueError("an uncalibrated record must name why in `warnings`")
        cache = (self.weight_load_ms or {}).get("cache", "unknown")
        if cache not in ("cold", "warm", "unknown"):
            raise ValueError(f"weight_load_ms.cache must be cold, warm or unknown, not {cache!r}")

    @property
    def key(self) -> str:
        return calibration_key(self.model, self.device, self.dtype)

    def to_dict(self) -> dict[str, Any]:
        return _finite({
            "version": self.version, "model": self.model, "device": self.device,
            "dtype": self.dtype, "calibrated": self.calibrated, "warnings": list(self.warnings),
            "fits": {"decode": self.decode, "prefill": self.prefill},
            "weight_load_ms": self.weight_load_ms, "swap_ms": self.swap_ms, "link": self.link,
            "load": self.load, "contention": self.contention, "thermal": self.thermal,
        })  # fmt: skip

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CalibrationResult:
        """Reads a record, ignoring fields this version does not know."""
        fits = data.get("fits") or {}
        return cls(
            model=data["model"], device=data["device"], dtype=data["dtype"],
            calibrated=bool(data.get("calibrated", False)),
            warnings=tuple(data.get("warnings") or ()), decode=fits.get("decode"),
            prefill=fits.get("prefill"), weight_load_ms=data.get("weight_load_ms"),
            swap_ms=data.get("swap_ms"), link=data.get("link"), load=data.get("load"),
            contention=data.get("contention"), thermal=data.get("thermal"),
            version=int(data.get("version", CALIBRATION_VERSION)),
        )  # fmt: skip


@dataclass(frozen=True)
class LoadCost:
    """L_n = `fixed_ms + per_block_ms * n`: ms to load n blocks (a migration's weight term)."""

    fixed_ms: float
    per_block_ms: float
    r2: float | None = None
    cache: str = "unknown"  # the page cache when it was timed: cold, warm or unknown

    def ms(self, num_blocks: int) -> float:
        """Predicted load time of `num_blocks` blocks; 0 for none."""
        return self.fixed_ms + self.per_block_ms * num_blocks if num_blocks > 0 else 0.0


def load_cost(record: Mapping[str, Any]) -> LoadCost:
    """L_n of one calibration record (its `"load"`, written by `task=calibrate`).

    Raises:
        ValueError: naming `load` when the record has no usable fit (not measured, refused
            for too few points, or non-finite / negative coefficients).
    """
    load = record.get("load")
    if not isinstance(load, Mapping):
        raise ValueError(f"record {record.get('model')}|{record.get('device')}: no `load` fit "
                         "(calibrate with the load probe: --only load)")  # fmt: skip
    fixed, per_block = load.get("fixed_ms"), load.get("per_block_ms")
    if not isinstance(fixed, (int, float)) or not isinstance(per_block, (int, float)):
        why = "; ".join(load.get("warnings") or ()) or "fixed_ms/per_block_ms missing"
        raise ValueError(f"load: no fit ({why})")
    if not (math.isfinite(fixed) and math.isfinite(per_block)) or per_block <= 0:
        raise ValueError(f"load: fixed_ms={fixed}, per_block_ms={per_block}: need finite, "
                         "per_block_ms > 0")  # fmt: skip
    cache = str(load.get("cache", "unknown"))
    return LoadCost(float(fixed), float(per_block), load.get("r2"), cache)


def select_record(document: Mapping[str, Any], key: str | None = None) -> Mapping[str, Any]:
    """The record under `key` (`calibration_key`) in a calibration file's document, or its only
    record when `key` is None; a bare record (no `records`) is returned as is.

    Raises:
        ValueError: naming the key, or the keys there are, when the choice is not clear.
    """
    records = document.get("records")
    if not isinstance(records, Mapping):
        return document
    if key is not None:
        if key not in records:
            raise ValueError(f"calibration key {key!r} not in {sorted(records)}")
        return records[key]
    if len(records) != 1:
        raise ValueError(f"{len(records)} calibration records {sorted(records)}: name a key")
    return next(iter(records.values()))


def _finite(value: Any) -> Any:
    """NaN and inf become null: JSON has no spelling for them and a fit never means them."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


def schema_diff(a: Mapping[str, Any], b: Mapping[str, Any], prefix: str = "") -> list[str]:
    """Key paths present in one document but not the other, sorted.

    Lines read `only in a: fits.decode.r2`, `only in b: ...` or `type differs: path (dict vs
    float)`. Recurses through dicts only. A null on either side matches any value, because
    null means "not observed", which is not a schema difference.
    """
    out: list[str] = []
    for key in sorted(set(a) | set(b), key=str):
        path = f"{prefix}{key}"
        if key not in b:
            out.append(f"only in a: {path}")
        elif key not in a:
            out.append(f"only in b: {path}")
        else:
            left, right = a[key], b[key]
            if left is None or right is None:
                continue
            if isinstance(left, Mapping) and isinstance(right, Mapping):
                out.extend(schema_diff(left, right, prefix=f"{path}."))
            elif isinstance(left, Mapping) != isinstance(right, Mapping):
                kinds = (type(left).__name__, type(right).__name__)
                out.append(f"type differs: {path} ({kinds[0]} vs {kinds[1]})")
    return out
