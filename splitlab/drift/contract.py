"""The observation contract: what a stage reports to the planner, whatever the backend.

An observation has exactly four keys - theta_obs, q_cmp_obs, q_mem_obs, link_obs - and both
backends (replay from a trace, live from sensors) emit the same dict, so a planner runs
unmodified against either. A sensor with no analogue here belongs in telemetry, not in the
contract. `DriftSource` is what the ring holds per stage.

    .venv/bin/pytest tests/unit/test_drift_replay.py -q -k contract

Meaning of the keys (units follow `profiles.DriftRecord`):
    theta_obs  temperature, degC, noisy (NaN on a live host with no temperature sensor)
    q_cmp_obs  compute load fraction 0..1 (1 = saturated)
    q_mem_obs  memory pressure fraction 0..1
    link_obs   outgoing link quality (0, 1], 1 = nominal (NaN on live until the ring reports it)
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from splitlab.errors import ProtocolError

OBS_KEYS: tuple[str, ...] = ("theta_obs", "q_cmp_obs", "q_mem_obs", "link_obs")


@dataclass(frozen=True)
class Observation:
    theta_obs: float
    q_cmp_obs: float
    q_mem_obs: float
    link_obs: float

    def to_dict(self) -> dict[str, float]:
        return {
            "theta_obs": self.theta_obs,
            "q_cmp_obs": self.q_cmp_obs,
            "q_mem_obs": self.q_mem_obs,
            "link_obs": self.link_obs,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Observation:
        """Strict: exactly the four keys, numbers (None, as JSON writes NaN, reads as NaN).

        Unlike wire messages this does not tolerate extra keys: an extra key is the contract
        growing, which is the one thing it must not do silently.

        Raises:
            ProtocolError: wrong key set or a non-numeric value (named).
        """
        if not isinstance(data, dict) or set(data) != set(OBS_KEYS):
            keys = sorted(data) if isinstance(data, dict) else type(data).__name__
            raise ProtocolError(f"observation must have exactly keys {list(OBS_KEYS)}, got {keys}")
        values: dict[str, float] = {}
        for key in OBS_KEYS:
            value = data[key]
            if value is None:
                values[key] = math.nan
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                values[key] = float(value)
            else:
                raise ProtocolError(f"observation {key!r} must be a number, got {value!r}")
        return cls(**values)


class DriftSource(ABC):
    """One stage's view of drift: what it observes, and the slowdown to apply.

    `observe` is the planner's input (noisy, never ground truth); `phi` and `phi_link` are
    what the ring applies (via `splitlab.drift.inject`) and are never sent to the planner.
    """

    stage: int

    @abstractmethod
    def observe(self, token: int) -> dict[str, float]:
        """The observation at `token`: a dict with exactly the keys in `OBS_KEYS`."""

    @abstractmethod
    def phi(self, token: int) -> float:
        """Compute slowdown factor (>= 1) to apply at `token`."""

    def phi_link(self, token: int) -> float:
        """Slowdown factor (>= 1) for the outgoing transfer at `token`; 1 unless replayed."""
        return 1.0

    @property
    @abstractmethod
    def exhausted(self) -> bool:
        """True once a token past the end of a finite source was asked for."""

    def close(self) -> None:  # noqa: B027 - a no-op default; live sources override it
        """Release threads or subprocesses (idempotent)."""

    def __enter__(self) -> DriftSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
