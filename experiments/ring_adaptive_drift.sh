#!/usr/bin/env bash
# Figure: adaptive planner under one slow stage
# bash experiments/ring_adaptive_drift.sh [OUT]      (run from the repository root; see experiments/README.md)
set -euo pipefail
exec bash "$(dirname "$0")/_run.sh" ring_adaptive_drift "${1:-outputs/experiments/ring_adaptive_drift}"
