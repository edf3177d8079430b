#!/usr/bin/env bash
# The CUDA path in one prepared script (under 5 minutes on one GPU):
#   1. the U-shape main job with the worker on the GPU (owners on CPU), 2 rounds:
#      activations and gradients received straight into device memory on a receive stream,
#      sent from the device through a copy stream (splitlab/wire/staging.py)
#   2. the ring with every stage on the GPU, fp32 and bf16, token-exact against one process
#      on the same device (tools/check_equivalence.py)
#   3. the ring with one stage on the GPU (architecture.stage_devices), against one CPU
#      process: tokens compared and reported (CPU and CUDA kernels may round apart)
#   4. bench_ring with every stage and its one-process arm on the GPU; bench_ushape with the
#      unsplit arm and the worker on it
# Steps 1-2 fail the script; 3-4 report. Everything lands under OUT (default
# outputs/gpu_check): one log per step and summary.txt. DEVICE=cpu on 2 AMD EPYC cores: 187 s.
#
#   bash tools/gpu_check.sh                  # DEVICE=cuda
#   DEVICE=cpu bash tools/gpu_check.sh       # the same steps on CPU: checks the script itself
set -u -o pipefail

DEVICE=${DEVICE:-cuda}
OUT=${OUT:-outputs/gpu_check}
PY=${PY:-.venv/bin/python}
SPLITLAB=${SPLITLAB:-.venv/bin/splitlab}
TOKENS=${TOKENS:-32}
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
failed=0

say() { echo "$*" | tee -a "$SUMMARY"; }

# step NAME MUST(1|0) COMMAND...: run, log, time, and record the exit code
step() {
    local name=$1 must=$2
    shift 2
    local started=$SECONDS rc=0
    echo "== $name: $*" >"$OUT/$name.log"
    "$@" >>"$OUT/$name.log" 2>&1 || rc=$?
    say "$name: exit $rc in $((SECONDS - started)) s ($OUT/$name.log)"
    if [[ $rc -ne 0 && $must == 1 ]]; then
        failed=1
        tail -n 20 "$OUT/$name.log" | sed 's/^/    /' | tee -a "$SUMMARY"
    fi
    return 0
}

say "gpu_check on $(hostname) at $(date -u +%FT%TZ): DEVICE=$DEVICE"
if [[ $DEVICE == cuda* ]]; then
    "$PY" - <<'EOF' | tee -a "$SUMMARY" || exit 2
import torch
if not torch.cuda.is_available():
    raise SystemExit("torch sees no CUDA device: run with DEVICE=cpu, or on a GPU machine")
print(f"torch {torch.__version__} CUDA {torch.version.cuda}: {torch.cuda.get_device_name(0)}, "
      f"bf16 {torch.cuda.is_bf16_supported()}")
EOF
fi

# 1. U-shape, the worker on the device
step ushape_worker 1 "$SPLITLAB" "architecture.worker_device=$DEVICE" task.rounds=2 \
    "hydra.run.dir=$OUT/ushape_worker"
grep -h "on the test split" "$OUT/ushape_worker.log" | tail -n 1 | sed 's/^/    /' | tee -a "$SUMMARY"

# 2. the ring on the device, fp32 and bf16, token-exact against one process there
for dtype in fp32 bf16; do
    step "ring_${dtype}" 1 "$PY" tools/check_equivalence.py "device=$DEVICE" \
        "model.dtype=$dtype" "task.max_new_tokens=$TOKENS" --run-dir "$OUT/ring_${dtype}"
    grep -h "^OK:\|^FAIL" "$OUT/ring_${dtype}.log" | tail -n 1 | sed 's/^/    /' | tee -a "$SUMMARY"
done

# 3. one stage on the device, the others and the reference on CPU
step ring_one_stage 0 "$PY" tools/check_equivalence.py device=cpu \
    "architecture.stage_devices=[cpu,$DEVICE,cpu]" "task.max_new_tokens=$TOKENS" \
    --run-dir "$OUT/ring_one_stage"
grep -h "^OK:\|^FAIL" "$OUT/ring_one_stage.log" | tail -n 1 | sed 's/^/    /' | tee -a "$SUMMARY"

# 4. benchmarks with the device arm
step bench_ring 0 "$PY" tools/bench_ring.py --quick --tokens "$TOKENS" --reps 1 \
    "device=$DEVICE" --out "$OUT/bench_ring.json"
step bench_ushape 0 "$PY" tools/bench_ushape.py --quick --reps 1 --device "$DEVICE" \
    --out "$OUT/bench_ushape.json"
grep -h "^rep " "$OUT/bench_ring.log" "$OUT/bench_ushape.log" | sed 's/^/    /' | tee -a "$SUMMARY"

if [[ $failed -ne 0 ]]; then
    say "gpu_check: FAILED (a must-pass step above)"
    exit 1
fi
say "gpu_check: passed in $SECONDS s"
