#!/usr/bin/env bash
# Train, export and evaluate k3-mini's vision tower + projector on the lent H200 in one call; by default the
# decoder is fine-tuned too (lr 1e-4 after 100 tower-only steps, half the loss from its original text mix;
# --decoder-lr 0 keeps it frozen)
# (k3ref/vision_train.py; models/k3-mini/MODEL_CARD.md "Vision"):
#   bash reference/scripts/device_train_vision.sh <train-seconds> [extra vision_train args]
#   bash reference/scripts/device_train_vision.sh 420                # the recipe: ~9 minutes in all
#   bash reference/scripts/device_train_vision.sh 8 --smoke          # the whole pipeline in well under a minute
# Writes to $OUT: vision.safetensors (bf16), vision-golden.safetensors, vision_eval.json,
# vision_train_log.jsonl, vision_stdout.log, and (decoder trained) model.safetensors in export.py's layout
# (bf16, MXFP4 experts: copy over models/k3-mini/model.safetensors; vision_eval.json's text_eval holds the
# MODEL_CARD text table for it). Then, in the repository:
#   PYTHONPATH=reference python3 -m k3ref.vision_export --model models/k3-mini --from <OUT>/vision.safetensors
# regenerates models/k3-mini/vision.safetensors and host/model/tests/golden/vision-golden.safetensors (the
# same bytes as $OUT's golden file).
set -uo pipefail
export PYTHONUNBUFFERED=1
TRAIN_S=${1:-420}; shift || true
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/reference
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader 2>/dev/null || true
python3 -m k3ref.vision_train --model models/k3-mini --out "$OUT" --time-budget "$TRAIN_S" "$@" 2>&1 \
  | { grep --line-buffered -v -i warning || true; } | tee "$OUT/vision_stdout.log"
rc=${PIPESTATUS[0]}
ls -la "$OUT"
exit "$rc"
