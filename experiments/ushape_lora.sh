#!/usr/bin/env bash
# Table: U-shape LoRA fine-tuning
# bash experiments/ushape_lora.sh [OUT]      (run from the repository root; see experiments/README.md)
set -euo pipefail
exec bash "$(dirname "$0")/_run.sh" ushape_lora "${1:-outputs/experiments/ushape_lora}"
