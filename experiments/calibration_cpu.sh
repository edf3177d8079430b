#!/usr/bin/env bash
# Table: SmolLM2 per-block cost model (CPU)
# bash experiments/calibration_cpu.sh [OUT]      (run from the repository root; see experiments/README.md)
set -euo pipefail
exec bash "$(dirname "$0")/_run.sh" calibration_cpu "${1:-outputs/experiments/calibration_cpu}"
