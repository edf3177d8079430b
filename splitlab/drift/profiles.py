"""Drift profiles: seeded ground truth per token and stage, as a pure function of its inputs.

A profile says what each stage of the ring *really* experiences at each decode token: its
temperature, the compute slowdown factor phi that the ring will apply, its compute load, memory
pressure and the quality of its outgoing link. The replay source adds sensor noise on top; this
module never does. The drifting stage (the one that heats, is slow, oscillates, whose CPU is
throttled, or whose outgoing link degrades) is `slow_stage`; every other stage stays nominal.
On a testbed the launcher applies phi and link_factor to the kernel (splitlab.drift.kernel).

    .venv/bin/pytest tests/unit/test_drift_profiles.py -q

Fields of a `DriftRecord` (units in the names where they have one):
    token        decode token index, 0-based
    stage        ring stage index, 0-based
    theta_c      temperature, degC
    phi          compute slowdown factor (>= 1; applied as a sleep of (phi - 1) x compute_ms)
    q_cmp        compute load fraction, 0..1 (1 = saturated), the analogue of cpu percent / 100
    q_mem        memory pressure fraction, 0..1, the analogue of memory percent / 100
    link_factor  outgoing link quality, (0, 1] (1 = nominal bandwidth)
    phi_link     link slowdown factor, 1 / link_factor (>= 1)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np

from splitlab.config.schema import DriftConfig
from splitlab.errors import ConfigError

AMBIENT_C = 45.0  # nominal operating temperature of an idle-ish edge device
AMBIENT_SPREAD_C = 3.0  # stages differ by up to +-this (seeded), so they are not clones
THROTTLE_C = 70.0  # thermal_ramp: phi starts rising above this
PEAK_C = 85.0  # thermal_ramp: plateau temperature; phi reaches `phi` here
OSC_C_PER_PHI = 20.0  # oscillating: degC gained per unit of phi above 1 (load heats the chip)
BASE_Q_CMP = (0.45, 0.65)  # seeded per-stage nominal compute load range
BASE_Q_MEM = (0.30, 0.50)  # seeded per-stage nominal memory pressure range


@dataclass(frozen=True)
class DriftRecord:
    """Ground truth for one (token, stage)."""

    token: int
    stage: int
    theta_c: float
    phi: float
    q_cmp: float
    q_mem: float
    link_factor: float
    phi_link: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DriftRecord:
        """Build from a dict, ignoring unknown keys (validation lives in trace_io)."""
        return cls(**{f.name: data[f.name] for f in fields(cls)})


RECORD_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(DriftRecord))


@dataclass(frozen=True)
class ProfileParams:
    """Everything a profile depends on; the same params always give the same records.

    The parameters are the `drift` group's (`DriftConfig`, their one schema, defaults included)
    plus the ring's stage count.
    """

    num_stages: int
    length_tokens: int
    seed: int = DriftConfig.seed
    slow_stage: int = DriftConfig.slow_stage
    phi: float = DriftConfig.phi
    period_tokens: int = DriftConfig.period_tokens

    @classmethod
    def from_config(cls, cfg: DriftConfig, *, num_stages: int) -> ProfileParams:
        return cls(num_stages=num_stages, length_tokens=cfg.length_tokens, seed=cfg.seed,
                   slow_stage=cfg.slow_stage, phi=cfg.phi, period_tokens=cfg.period_tokens)  # fmt: skip

    def validate(self) -> None:
        if self.num_stages < 1:
            raise ConfigError(f"drift: num_stages must be >= 1, got {self.num_stages}")
        if self.length_tokens < 1:
            raise ConfigError(f"drift.length_tokens must be >= 1, got {self.length_tokens}")
        if not 0 <= self.slow_stage < self.num_stages:
            raise ConfigError(
                f"drift.slow_stage must be in [0, {self.num_stages - 1}] for "
                f"{self.num_stages} stages, got {self.slow_stage}"
            )
        if not (math.isfinite(self.phi) and self.phi >= 1.0):
            raise ConfigError(f"drift.phi must be a finite factor >= 1, got {self.phi}")
        if self.period_tokens < 1:
            raise ConfigError(f"drift.period_tokens must be >= 1, got {self.period_tokens}")


@dataclass(frozen=True)
class _Nominal:
    """A stage's seeded resting point."""

    theta_c: float
    q_cmp: float
    q_mem: float


def _nominals(p: ProfileParams) -> list[_Nominal]:
    rng = np.random.default_rng([p.seed, p.num_stages])
    out = []
    for _ in range(p.num_stages):
        out.append(
            _Nominal(
                theta_c=AMBIENT_C + float(rng.uniform(-AMBIENT_SPREAD_C, AMBIENT_SPREAD_C)),
                q_cmp=float(rng.uniform(*BASE_Q_CMP)),
                q_mem=float(rng.uniform(*BASE_Q_MEM)),
            )
        )
    return out


def _record(
    token: int,
    stage: int,
    nominal: _Nominal,
    *,
    theta_c: float | None = None,
    phi: float = 1.0,
    link_factor: float = 1.0,
) -> DriftRecord:
    # A slowed stage spends phi times as long busy per token, so its load rises with phi.
    return DriftRecord(
        token=token,
        stage=stage,
        theta_c=round(nominal.theta_c if theta_c is None else theta_c, 6),
        phi=round(phi, 9),
        q_cmp=round(min(1.0, nominal.q_cmp * phi), 6),
        q_mem=round(nominal.q_mem, 6),
        link_factor=round(link_factor, 9),
        phi_link=round(1.0 / link_factor, 9),
    )


def _steady(p: ProfileParams, t: int, s: int, nom: _Nominal) -> DriftRecord:
    return _record(t, s, nom)


def _thermal_ramp(p: ProfileParams, t: int, s: int, nom: _Nominal) -> DriftRecord:
    if s != p.slow_stage:
        return _record(t, s, nom)
    # First-order heating towards PEAK_C with time constant period_tokens; phi rises linearly
    # from 1 at THROTTLE_C to `phi` at PEAK_C (the throttle governor stepping clocks down).
    theta = PEAK_C - (PEAK_C - nom.theta_c) * math.exp(-t / p.period_tokens)
    frac = min(1.0, max(0.0, (theta - THROTTLE_C) / (PEAK_C - THROTTLE_C)))
    return _record(t, s, nom, theta_c=theta, phi=1.0 + (p.phi - 1.0) * frac)


def _one_slow_node(p: ProfileParams, t: int, s: int, nom: _Nominal) -> DriftRecord:
    return _record(t, s, nom, phi=p.phi if s == p.slow_stage else 1.0)


def _oscillating(p: ProfileParams, t: int, s: int, nom: _Nominal) -> DriftRecord:
    if s != p.slow_stage:
        return _record(t, s, nom)
    # Raised cosine: phi is 1 at token 0, `phi` at half a period, back to 1 at a full period.
    phase = 0.5 * (1.0 - math.cos(2.0 * math.pi * t / p.period_tokens))
    phi = 1.0 + (p.phi - 1.0) * phase
    theta = min(PEAK_C, nom.theta_c + OSC_C_PER_PHI * (phi - 1.0))  # a chip tops out
    return _record(t, s, nom, theta_c=theta, phi=phi)


def _link_degrade(p: ProfileParams, t: int, s: int, nom: _Nominal) -> DriftRecord:
    if s != p.slow_stage:
        return _record(t, s, nom)
    # The link slowdown grows linearly from 1 at the first token to `phi` at the last.
    frac = t / (p.length_tokens - 1) if p.length_tokens > 1 else 1.0
    return _record(t, s, nom, link_factor=1.0 / (1.0 + (p.phi - 1.0) * frac))


def _cpu_throttle(p: ProfileParams, t: int, s: int, nom: _Nominal) -> DriftRecord:
    # A step: the slow stage's CPU budget is cut by `phi` from token `period_tokens` on (on a
    # testbed the launcher writes its host's cgroup quota then; see splitlab.drift.kernel).
    slowed = s == p.slow_stage and t >= p.period_tokens
    return _record(t, s, nom, phi=p.phi if slowed else 1.0)


ProfileFn = Callable[[ProfileParams, int, int, _Nominal], DriftRecord]

PROFILES: dict[str, ProfileFn] = {}


def register_profile(name: str, fn: ProfileFn) -> None:
    """Make `drift.name=<name>` a replayable profile; `fn(params, token, stage, nominal)`."""
    PROFILES[name] = fn


register_profile("steady", _steady)
register_profile("thermal_ramp", _thermal_ramp)
register_profile("one_slow_node", _one_slow_node)
register_profile("oscillating", _oscillating)
register_profile("link_degrade", _link_degrade)
register_profile("cpu_throttle", _cpu_throttle)


def generate(profile: str, params: ProfileParams) -> list[DriftRecord]:
    """All records of `profile`, ordered by token then stage.

    Raises:
        ConfigError: unknown profile name or invalid params (the message names the key).
    """
    if profile not in PROFILES:
        raise ConfigError(
            f"drift.name: no trace profile {profile!r}; choose from {sorted(PROFILES)}"
        )
    params.validate()
    fn = PROFILES[profile]
    nominals = _nominals(params)
    return [
        fn(params, t, s, nominals[s])
        for t in range(params.length_tokens)
        for s in range(params.num_stages)
    ]
