"""Applying drift: a slowdown factor phi becomes a sleep of (phi - 1) x compute_ms.

The ring calls `inject` inside the region it measures as compute, right after the real
compute, so the stage's recorded compute_ms and the head's TPOT both move with phi. Reporting
drift without applying it (or applying without reporting) both look like a working replay;
this is the applying half.

    .venv/bin/pytest tests/unit/test_drift_replay.py -q -k inject

    t0 = time.perf_counter()
    hidden = stage(hidden)                                   # the real compute
    inject((time.perf_counter() - t0) * 1e3, source.phi(token))
    compute_ms = (time.perf_counter() - t0) * 1e3            # includes the injected sleep

A link slowdown (`phi_link`) is not injected: off a testbed it reaches the observations
(`link_obs`) only, and on one the kernel applies it as a rate (`splitlab.drift.kernel`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable


def sleep_ms_for(compute_ms: float, phi: float) -> float:
    """The extra time (ms) that makes `compute_ms` of work look like `phi` x as slow.

    Raises:
        ValueError: phi is not a finite factor >= 1, or compute_ms is negative or not finite.
    """
    if not (math.isfinite(phi) and phi >= 1.0):
        raise ValueError(f"phi must be a finite factor >= 1, got {phi}")
    if not (math.isfinite(compute_ms) and compute_ms >= 0.0):
        raise ValueError(f"compute_ms must be finite and >= 0, got {compute_ms}")
    return (phi - 1.0) * compute_ms


def inject(
    compute_ms: float,
    phi: float,
    *,
    sleep: Callable[[float], None] = time.sleep,
) -> float:
    """Sleep (phi - 1) x compute_ms and return the time actually spent, in ms.

    phi == 1 returns 0.0 at once without calling `sleep`, so the no-drift path costs nothing.
    """
    wait_ms = sleep_ms_for(compute_ms, phi)
    if wait_ms <= 0.0:
        return 0.0
    t0 = time.perf_counter()
    sleep(wait_ms / 1e3)
    return (time.perf_counter() - t0) * 1e3
