#!/usr/bin/env bash
# Train, calibrate, evaluate and export the DSpark drafter for k3-mini on the lent H200 in one call
# (reference/README.md, k3ref/dspark_train.py):
#   bash reference/scripts/device_train_dspark.sh <train-seconds> [extra dspark_train args]
#   bash reference/scripts/device_train_dspark.sh 5 --smoke        # the whole pipeline in well under a minute
# Writes to $OUT: config.json, model.safetensors (the drafter, f32), dspark_train_log.jsonl, dspark_eval.json,
# dspark-golden.safetensors, dspark_stdout.log.
set -uo pipefail
export PYTHONUNBUFFERED=1
TRAIN_S=${1:-330}; shift || true
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/reference
python3 -m k3ref.dspark_train --target models/k3-mini --out "$OUT" --time-budget "$TRAIN_S" "$@" 2>&1 \
  | { grep --line-buffered -v -i warning || true; } | tee "$OUT/dspark_stdout.log"
rc=${PIPESTATUS[0]}
ls -la "$OUT"
exit "$rc"
