"""Pick a stage's drift source from the `drift` config group.

    splitlab task=infer drift=one_slow_node          # replay, trace generated into the run dir
    splitlab task=infer drift=steady drift.trace=/tmp/d.jsonl
    splitlab task=infer drift=live
    .venv/bin/pytest tests/unit/test_drift_replay.py -q -k make_source

`drift.source` decides the backend: none (no source; the ring applies nothing and reports no
observation), replay (a JSONL trace: `drift.trace`, or generated from the profile `drift.name`
when that is None) or live (this host's sensors).
"""

from __future__ import annotations

import logging
from enum import Enum
from pathlib import Path

from splitlab.config.schema import DriftConfig
from splitlab.drift.contract import DriftSource
from splitlab.drift.live import LiveSource
from splitlab.drift.profiles import PROFILES, ProfileParams, generate
from splitlab.drift.replay import ReplaySource, validate_noise_var
from splitlab.drift.trace_io import DriftTrace, TraceHeader, read_trace, write_trace
from splitlab.errors import ConfigError

log = logging.getLogger(__name__)

TRACE_RELPATH = Path("drift") / "trace.jsonl"  # where a generated trace lands in the run dir
LIVE_PERIOD_S = 0.5  # sensor sampling period of the live backend


def drift_names() -> list[str]:
    """Every valid `drift.name`: none, live, and the registered profiles."""
    return sorted({"none", "live", *PROFILES})


def _value(choice: Enum | str) -> str:
    return choice.value if isinstance(choice, Enum) else str(choice)


def generate_trace(
    cfg: DriftConfig, *, num_stages: int, out: Path | None
) -> tuple[DriftTrace, Path | None]:
    """Generate the profile `cfg.name`; write it to `out` when given (atomically)."""
    name = _value(cfg.name)
    params = ProfileParams.from_config(cfg, num_stages=num_stages)
    records = generate(name, params)
    header = TraceHeader.for_profile(name, params)
    if out is not None:
        write_trace(out, header, records)
        return read_trace(out), out  # replay exactly what the file says
    columns = tuple(tuple(r for r in records if r.stage == s) for s in range(num_stages))
    return DriftTrace(header=header, by_stage=columns), None


def make_source(
    cfg: DriftConfig,
    *,
    stage: int,
    num_stages: int,
    run_id: str,
    run_dir: Path | None,
) -> DriftSource | None:
    """The drift source for one stage, or None when drift is off.

    Raises:
        ConfigError: a name/source combination that cannot work, zero noise, a trace whose
            stage count differs from the ring's, or a malformed trace (file, line, field).
    """
    name, backend = _value(cfg.name), _value(cfg.source)
    if not 0 <= stage < num_stages:
        raise ConfigError(f"drift: stage {stage} is not in a ring of {num_stages} stages")
    if backend == "none" or name == "none":
        if backend != name:
            log.info("drift: name=%s source=%s -> no drift source", name, backend)
        return None
    if backend == "live" or name == "live":
        if backend != name:
            raise ConfigError(
                f"drift.source={backend} with drift.name={name}: the live backend has no "
                "profile and a profile cannot be read live; use drift=live or a replay profile"
            )
        return LiveSource(stage=stage, period_s=LIVE_PERIOD_S)
    if backend != "replay":
        raise ConfigError(f"drift.source: unknown backend {backend!r}")
    validate_noise_var(cfg.noise_var_degc2)  # before generating anything
    if cfg.trace is not None:
        trace = read_trace(cfg.trace)
        if trace.header.profile != name:
            log.warning(
                "drift: trace %s holds profile %s, config says %s; replaying the trace",
                cfg.trace,
                trace.header.profile,
                name,
            )
    else:
        if name not in PROFILES:
            raise ConfigError(
                f"drift.name={name} has no trace profile; choose from {sorted(PROFILES)}"
            )
        out = None if run_dir is None else Path(run_dir) / TRACE_RELPATH
        trace, _ = generate_trace(cfg, num_stages=num_stages, out=out)
    if trace.header.num_stages != num_stages:
        raise ConfigError(
            f"drift.trace={cfg.trace} has {trace.header.num_stages} stages; the ring has {num_stages}"
        )
    return ReplaySource.from_trace(
        trace, stage=stage, seed=cfg.seed, run_id=run_id, noise_var_degc2=cfg.noise_var_degc2
    )
