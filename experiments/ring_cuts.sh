#!/usr/bin/env bash
# Figure: TPOT against where the ring is cut (conf/sweep/ring_cuts.yaml, 4 jobs), then sweep.csv/png
# bash experiments/ring_cuts.sh [SWEEP_DIR]      (run from the repository root)
set -euo pipefail
sweep=${1:-outputs/experiments/ring_cuts}
python=${PYTHON:-.venv/bin/python}
"$python" -m splitlab -m +sweep=ring_cuts task.max_new_tokens=16 "hydra.sweep.dir=$sweep"
"$python" tools/aggregate_sweep.py "$sweep"
