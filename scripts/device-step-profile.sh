#!/usr/bin/env bash
# On the H200: each kernel's own GPU time in k3-slice decode steps, from Nsight Compute (one
# metric per kernel, CUDA graph nodes included), summed per kernel name for one step of each
# batch size (scripts/step_profile.py). Kernels run one at a time under ncu: the figures leave
# out the gaps between kernels and any overlap, so they are shares, not a step time. Carry .carry.
#   bash scripts/device-step-profile.sh [BATCH_SIZES]     (default 16,64; batch 1 always runs)
# K3_STEP_BYTES=1 also collects each kernel's DRAM bytes and lists every kernel of 20 µs or more
# with its rate (ncu replays each kernel for the extra metrics: slower).
# Output: $OUT/step-times.csv (ncu's CSV), $OUT/step-profile.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/k3-step-profile}"
BIN=/tmp/k3bin
mkdir -p "$OUT"
source scripts/device-lib.sh
metrics=gpu__time_duration.sum
each=()
if [ "${K3_STEP_BYTES:-0}" = 1 ]; then
    metrics+=,dram__bytes_read.sum,dram__bytes_write.sum
    each=(--each 20)
fi
timeout 400 "$NCU" --clock-control none --cache-control none --metrics "$metrics" --csv \
    --log-file "$OUT/step-times.csv" "$BIN/k3serve" bench --device cuda --model models/k3-slice --load-format dummy \
    --prefill-tokens 64 --decode-tokens 4 --batch-sizes "${1:-16,64}" --repeats 1 >"$OUT/step-bench.txt" 2>&1 ||
    { fail "ncu run (see $OUT/step-bench.txt)"; exit 1; }
python3 scripts/step_profile.py "$OUT/step-times.csv" "${each[@]}" | tee "$OUT/step-profile.txt"
