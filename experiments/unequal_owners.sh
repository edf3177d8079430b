#!/usr/bin/env bash
# Trace check: unequal owners (5, 2, 0 microbatches) x 2 workers 3:1
# bash experiments/unequal_owners.sh [OUT]      (run from the repository root; see experiments/README.md)
set -euo pipefail
exec bash "$(dirname "$0")/_run.sh" unequal_owners "${1:-outputs/experiments/unequal_owners}"
