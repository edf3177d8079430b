"""Drift: seeded profiles, replay and live sources behind one four-key observation contract,
and the injection that turns a slowdown factor into time.

    .venv/bin/pytest tests/unit/test_drift_profiles.py tests/unit/test_drift_replay.py tests/unit/test_drift_live.py -q
    .venv/bin/python tools/check_drift_source.py

Modules: profiles (pure ground truth), trace_io (JSONL trace), contract (Observation,
DriftSource), replay, sensors + live, inject, source (make_source from the drift config).
"""

from splitlab.drift.contract import OBS_KEYS, DriftSource, Observation
from splitlab.drift.inject import inject, sleep_ms_for
from splitlab.drift.live import LiveSource
from splitlab.drift.replay import ReplaySource
from splitlab.drift.source import make_source

__all__ = [
    "OBS_KEYS",
    "DriftSource",
    "LiveSource",
    "Observation",
    "ReplaySource",
    "inject",
    "make_source",
    "sleep_ms_for",
]
