#!/usr/bin/env bash
# Smoke test of the whole path (tiny ring + analyze)
# bash experiments/debug.sh [OUT]      (run from the repository root; see experiments/README.md)
set -euo pipefail
exec bash "$(dirname "$0")/_run.sh" debug "${1:-outputs/experiments/debug}"
