#!/usr/bin/env bash
# Table: SmolLM2 3-stage ring, TPOT and per-stage compute
# bash experiments/ring_tpot.sh [OUT]      (run from the repository root; see experiments/README.md)
set -euo pipefail
exec bash "$(dirname "$0")/_run.sh" ring_tpot "${1:-outputs/experiments/ring_tpot}"
