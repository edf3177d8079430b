#!/usr/bin/env bash
# Figure: WRR allocation 3 owners x 2 workers 3:1
# bash experiments/wrr_heterogeneous.sh [OUT]      (run from the repository root; see experiments/README.md)
set -euo pipefail
exec bash "$(dirname "$0")/_run.sh" wrr_heterogeneous "${1:-outputs/experiments/wrr_heterogeneous}"
