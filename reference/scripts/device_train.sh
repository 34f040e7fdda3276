#!/usr/bin/env bash
# Train, export and evaluate k3-mini on the lent H200 in one call (see reference/README.md).
#   device run: bash reference/scripts/device_train.sh <train-seconds> <eval-seconds> [extra train args]
set -euo pipefail
export PYTHONUNBUFFERED=1
TRAIN_S=${1:-420}; EVAL_S=${2:-90}; shift 2 || true
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD/reference
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader || true
RUN=/tmp/run
python3 -m k3ref.train --out $RUN --time-budget "$TRAIN_S" "$@" 2>&1 | tee "$OUT/train_stdout.log"
python3 -m k3ref.export --checkpoint $RUN/model.pt --out /tmp/k3-mini --tokenizer-dir models/k3-mini
python3 -m k3ref.evaluate --model /tmp/k3-mini --per-kind 40 --time-budget "$EVAL_S" --out "$OUT/eval.json" \
  2>&1 | tee "$OUT/eval_stdout.log"
cp $RUN/train_log.jsonl $RUN/train_summary.json "$OUT/"
cp /tmp/k3-mini/config.json "$OUT/"
split -b 15M -d /tmp/k3-mini/model.safetensors "$OUT/model.safetensors.part"
ls -la "$OUT"
