"""Replay backend: a stage's observations and slowdowns read from a JSONL drift trace.

The planner sees the trace's temperature plus Gaussian sensor noise (variance
`noise_var_degc2`, never zero: feeding a planner clean values tests a system nobody deploys);
the ground truth stays in the trace and in `truth()`, which is for telemetry only. Noise is
seeded per (seed, run_id, stage) and is a pure function of the token, so the same seed gives
the same observation sequence however often and in whatever order tokens are observed. A
trace shorter than the run holds its last record and sets `exhausted` instead of wrapping
(wrapping would make a short trace look like a long stationary run).

    .venv/bin/pytest tests/unit/test_drift_replay.py -q
    .venv/bin/python tools/check_drift_source.py
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import numpy as np

from splitlab.drift.contract import DriftSource, Observation
from splitlab.drift.profiles import DriftRecord
from splitlab.drift.trace_io import DriftTrace, read_trace
from splitlab.errors import ConfigError

NOISE_BLOCK_TOKENS = 256  # noise is drawn a block at a time; each block has its own stream


def run_key(run_id: str) -> int:
    """A stable 64-bit integer for a run id (Python's `hash` is salted per process)."""
    return int.from_bytes(hashlib.blake2b(run_id.encode("utf-8"), digest_size=8).digest(), "big")


def validate_noise_var(noise_var_degc2: float) -> float:
    """Raises ConfigError unless the variance is finite and strictly positive."""
    value = float(noise_var_degc2)
    if not (math.isfinite(value) and value > 0.0):
        raise ConfigError(
            f"drift.noise_var_degc2 must be > 0 (sensor noise is never zero), got {noise_var_degc2}"
        )
    return value


class ReplaySource(DriftSource):
    """One stage's replayed drift."""

    def __init__(
        self,
        path: str | Path,
        *,
        stage: int,
        seed: int,
        run_id: str,
        noise_var_degc2: float = 0.5,
    ) -> None:
        self._init(read_trace(path), stage, seed, run_id, noise_var_degc2, str(path))

    @classmethod
    def from_trace(
        cls,
        trace: DriftTrace,
        *,
        stage: int,
        seed: int,
        run_id: str,
        noise_var_degc2: float = 0.5,
    ) -> ReplaySource:
        """Replay an already parsed (or generated in memory) trace."""
        self = cls.__new__(cls)
        self._init(trace, stage, seed, run_id, noise_var_degc2, "<in-memory trace>")
        return self

    def _init(
        self,
        trace: DriftTrace,
        stage: int,
        seed: int,
        run_id: str,
        noise_var_degc2: float,
        origin: str,
    ) -> None:
        self._sigma_c = math.sqrt(validate_noise_var(noise_var_degc2))
        if not 0 <= stage < trace.header.num_stages:
            raise ConfigError(
                f"drift: stage {stage} is not in trace {origin}, which has "
                f"{trace.header.num_stages} stages"
            )
        self.stage = stage
        self.header = trace.header
        self._records: tuple[DriftRecord, ...] = trace.by_stage[stage]
        self._entropy = [int(seed), int(stage), run_key(run_id)]
        self._noise_blocks: dict[int, np.ndarray] = {}
        self._exhausted = False

    @property
    def num_tokens(self) -> int:
        return len(self._records)

    @property
    def exhausted(self) -> bool:
        return self._exhausted

    def truth(self, token: int) -> DriftRecord:
        """Ground truth at `token` (last record past the end) - for telemetry, never the planner."""
        if token < 0:
            raise ValueError(f"token must be >= 0, got {token}")
        if token >= len(self._records):
            self._exhausted = True
            return self._records[-1]
        return self._records[token]

    def noise_c(self, token: int) -> float:
        """The sensor-noise sample (degC) added to the temperature at `token`."""
        block, offset = divmod(token, NOISE_BLOCK_TOKENS)
        draws = self._noise_blocks.get(block)
        if draws is None:
            rng = np.random.default_rng([*self._entropy, block])
            draws = rng.standard_normal(NOISE_BLOCK_TOKENS) * self._sigma_c
            self._noise_blocks[block] = draws
        return float(draws[offset])

    def observation(self, token: int) -> Observation:
        rec = self.truth(token)
        return Observation(
            theta_obs=rec.theta_c + self.noise_c(token),
            q_cmp_obs=rec.q_cmp,
            q_mem_obs=rec.q_mem,
            link_obs=rec.link_factor,
        )

    def observe(self, token: int) -> dict[str, float]:
        return self.observation(token).to_dict()

    def phi(self, token: int) -> float:
        return self.truth(token).phi

    def phi_link(self, token: int) -> float:
        return self.truth(token).phi_link
