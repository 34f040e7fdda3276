#!/usr/bin/env bash
# On the H200: where one kernel's issue slots go, during a k3-slice `bench` (dummy weights).
# Nsight Compute profiles two launches of the kernels matching REGEX (after SKIP matching
# launches) with `--set full --import-source yes`; its details and SASS source pages are kept as
# CSV and summarised by scripts/kernel_profile.py (per-launch utilisation, opcodes, stall
# reasons, loop-body sizes). Carry .carry.
#   bash scripts/device-kernel-profile.sh REGEX [BATCH] [SKIP]
#   e.g. bash scripts/device-kernel-profile.sh 'few_tokens_(up|down)' 16 4
# Note: the 64-token prompt of `bench` runs first; SKIP counts its launches too.
# Output: $OUT/details.csv, $OUT/source.csv, $OUT/kernel-profile.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/k3-kernel-profile}"
BIN=/tmp/k3bin
mkdir -p "$OUT"
source scripts/device-lib.sh
regex="${1:?kernel name regex}"
timeout 300 "$NCU" --clock-control none --set full --import-source yes --kernel-name "regex:$regex" \
    --launch-skip "${3:-4}" --launch-count 2 -o "$OUT/report" -f \
    "$BIN/k3serve" bench --device cuda --model models/k3-slice --load-format dummy --prefill-tokens 64 \
    --decode-tokens 3 --batch-sizes "${2:-16}" --repeats 1 >"$OUT/bench.txt" 2>&1 ||
    { fail "ncu run (see $OUT/bench.txt)"; exit 1; }
"$NCU" --import "$OUT/report.ncu-rep" --page details --csv >"$OUT/details.csv" 2>&1
"$NCU" --import "$OUT/report.ncu-rep" --page source --csv --print-source sass >"$OUT/source.csv" 2>&1
rm -f "$OUT/report.ncu-rep"
python3 scripts/kernel_profile.py --details "$OUT/details.csv" --source "$OUT/source.csv" | tee "$OUT/kernel-profile.txt"
