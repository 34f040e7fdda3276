#!/usr/bin/env bash
# Train and export k3-mini on the lent H200 in one call (see reference/README.md):
#   bash reference/scripts/device_train.sh <train-seconds> [extra train args]
# Writes to $OUT: train log + summary, config.json and model.safetensors split in 15 MB parts.
set -euo pipefail
export PYTHONUNBUFFERED=1
TRAIN_S=${1:-420}; shift || true
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/reference
RUN=/tmp/run
python3 -m k3ref.train --out $RUN --time-budget "$TRAIN_S" --kda-impl fast --moe dense "$@" 2>&1 \
  | grep -v -i warning | tee "$OUT/train_stdout.log"
python3 -m k3ref.export --checkpoint $RUN/model.pt --out /tmp/k3-mini --tokenizer-dir models/k3-mini
cp $RUN/train_log.jsonl $RUN/train_summary.json /tmp/k3-mini/config.json "$OUT/"
[ -f $RUN/profile.txt ] && cp $RUN/profile.txt "$OUT/"
split -b 15M -d /tmp/k3-mini/model.safetensors "$OUT/model.safetensors.part"
ls -la "$OUT"
