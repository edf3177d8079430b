"""Generate a ground-truth drift trace (JSONL) for the replay backend.

    .venv/bin/python tools/make_drift_trace.py --profile one_slow_node --stages 3 --tokens 400 --seed 77 --out drift.jsonl
    splitlab task=infer drift=one_slow_node drift.trace=drift.jsonl

Profiles: steady | thermal_ramp | one_slow_node | oscillating | link_degrade | cpu_throttle.
The drifting stage is --slow-stage (it heats, is slow, oscillates with --period tokens, its CPU
is cut from token --period on, or its outgoing link degrades); --phi is the slowdown it
reaches. Every other stage stays nominal.

Schema (documented in full in splitlab/drift/trace_io.py):
    line 1   {"kind": "drift_header", "version": 1, "profile", "num_stages", "length_tokens",
              "seed", "params": {"slow_stage", "phi", "period_tokens"}}
    line 2.. {"kind": "drift", "token", "stage", "theta_c" (degC), "phi" (>= 1),
              "q_cmp" (0..1 compute load), "q_mem" (0..1 memory pressure),
              "link_factor" ((0, 1], 1 = nominal), "phi_link" (1 / link_factor)}
    ordered by token, then stage; every stage has tokens 0..N-1.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from splitlab.config.schema import DriftConfig
from splitlab.drift.profiles import PROFILES, ProfileParams, generate
from splitlab.drift.trace_io import TraceHeader, write_trace
from splitlab.errors import ConfigError
from splitlab.telemetry.log import leave


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profile", required=True, choices=sorted(PROFILES))
    ap.add_argument("--out", required=True, type=Path, help="trace path to write (JSONL)")
    ap.add_argument("--stages", type=int, default=3, help="ring stages")
    d = DriftConfig  # the drift group's schema holds every default
    ap.add_argument("--tokens", type=int, default=d.length_tokens, help="trace length (tokens)")
    ap.add_argument("--seed", type=int, default=d.seed, help="seeds each stage's resting point")
    ap.add_argument("--slow-stage", type=int, default=d.slow_stage, help="the drifting stage")
    ap.add_argument("--phi", type=float, default=d.phi, help="slowdown factor reached (>= 1)")
    ap.add_argument("--period", type=int, default=d.period_tokens, help="oscillation / ramp tokens")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    params = ProfileParams(
        num_stages=args.stages,
        length_tokens=args.tokens,
        seed=args.seed,
        slow_stage=args.slow_stage,
        phi=args.phi,
        period_tokens=args.period,
    )
    try:
        records = generate(args.profile, params)
    except ConfigError as exc:
        print(f"make_drift_trace: {exc}", file=sys.stderr)
        return int(exc.exit_code)
    path = write_trace(args.out, TraceHeader.for_profile(args.profile, params), records)
    print(f"wrote {path}: {args.profile}, {args.stages} stages x {args.tokens} tokens")
    return 0


if __name__ == "__main__":
    leave(main())
