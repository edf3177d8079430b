#!/usr/bin/env bash
# bash experiments/_run.sh PRESET OUT [OVERRIDES...]
# Shared by the study scripts: run one conf/experiment preset into OUT, then `task=analyze` on it
# (plots and report.html in OUT/analysis). Run from the repository root.
set -euo pipefail
preset=$1 out=$2
shift 2
python=${PYTHON:-.venv/bin/python}
"$python" -m splitlab "experiment=$preset" "hydra.run.dir=$out" "$@"
if [ -d "$out/traces" ] || [ -f "$out/calibration.json" ]; then
  "$python" -m splitlab task=analyze "task.run_dir=$out" "hydra.run.dir=$out/analysis/job"
fi
