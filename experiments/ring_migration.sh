#!/usr/bin/env bash
# Figure: ring timeline with a forced 1-block shift at token 40
# bash experiments/ring_migration.sh [OUT]      (run from the repository root; see experiments/README.md)
set -euo pipefail
exec bash "$(dirname "$0")/_run.sh" ring_migration "${1:-outputs/experiments/ring_migration}"
