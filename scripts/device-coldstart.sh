#!/usr/bin/env bash
# On the H200: time to ready of `k3serve serve --device cuda`, fresh (empty kernel and plugin
# caches, as on a new machine) and warm (the same caches again), for k3-mini and for k3-slice with
# dummy weights, for each binary given as LABEL=PATH (PATH may be .xz). Ready = the first 200 from
# /health, timed from the process start by polling every 20 ms. Also checks that every binary
# gives k3-mini the same greedy answer on the GPU. Results: $OUT/coldstart.tsv (label, model,
# cache, seconds) and $OUT/coldstart.log (each run's start-up lines).
#   bash scripts/device-coldstart.sh before=.carry/before.xz after=.carry/k3serve.xz
# K3_COLDSTART_MODELS (default "k3-mini k3-slice") picks the models.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/k3-coldstart}"
mkdir -p "$OUT" /tmp/k3cs
summary() { echo "$*" | tee -a "$OUT/coldstart.log"; }
fail() { summary "FAIL: $*"; exit 1; }
source scripts/device-libs.sh
# The driver's own first start (persistence off) is paid once here, by no binary under test.
nvidia-smi --query-gpu=name,driver_version,persistence_mode --format=csv,noheader | tee -a "$OUT/coldstart.log"
python3 -c 'import torch; torch.zeros(1).cuda(); print("driver warmed by torch")' 2>&1 | tail -1
printf 'label\tmodel\tcache\tready_s\n' >"$OUT/coldstart.tsv"
declare -A bins
labels=()
for spec in "$@"; do
    label=${spec%%=*}; path=${spec#*=}
    dst=/tmp/k3cs/$label
    case $path in
        *.xz) python3 -c 'import lzma,sys; open(sys.argv[2],"wb").write(lzma.open(sys.argv[1]).read())' "$path" "$dst" ;;
        *) cp "$path" "$dst" ;;
    esac
    chmod +x "$dst"; bins[$label]=$dst; labels+=("$label")
done
port=8400
run() { # label model cache-dir cache-kind extra-args...
    local label=$1 model=$2 cache=$3 kind=$4; shift 4
    port=$((port + 1))
    local log=/tmp/k3cs/$label-$model-$kind.log
    local t0; t0=$(date +%s.%N)
    env -u K3_KERNEL_CACHE XDG_CACHE_HOME="$cache" "${bins[$label]}" serve --device cuda \
        --host 127.0.0.1 --port $port --plugin-dir .carry/plugins "$@" >"$log" 2>&1 &
    local pid=$! ready=""
    for _ in $(seq 1 9000); do
        if curl -sf -o /dev/null "http://127.0.0.1:$port/health" 2>/dev/null; then
            ready=$(python3 -c "import time; print(f'{time.time() - $t0:.2f}')"); break
        fi
        kill -0 $pid 2>/dev/null || break
        sleep 0.02
    done
    summary "== $label $model $kind: ready ${ready:-NEVER} s"
    grep -E '^\[|^      |warm-up|ready in|device:' "$log" | tee -a "$OUT/coldstart.log"
    printf '%s\t%s\t%s\t%s\n' "$label" "$model" "$kind" "${ready:-NaN}" >>"$OUT/coldstart.tsv"
    if [ "$model" = k3-mini ] && [ -n "$ready" ]; then
        curl -s "http://127.0.0.1:$port/v1/chat/completions" -H 'content-type: application/json' \
            -d '{"model":"k3-mini","messages":[{"role":"user","content":"What is 17 plus 25?"}],"max_tokens":48,"temperature":0,"reasoning_effort":"none"}' |
            python3 -c 'import json,sys; m=json.load(sys.stdin)["choices"][0]["message"]; print(m.get("reasoning_content") or "", m["content"])' \
            >/tmp/k3cs/answer-$label-$kind.txt 2>&1
        summary "   answer: $(tr '\n' ' ' </tmp/k3cs/answer-$label-$kind.txt)"
    fi
    kill $pid 2>/dev/null; wait $pid 2>/dev/null
    [ -n "$ready" ] || { tail -30 "$log" | tee -a "$OUT/coldstart.log"; }
}
for label in "${labels[@]}"; do
    for model in ${K3_COLDSTART_MODELS:-k3-mini k3-slice}; do
        cache=/tmp/k3cs/cache-$label-$model
        rm -rf "$cache"
        if [ "$model" = k3-mini ]; then
            args=(--model models/k3-mini)
        else
            args=(--model models/k3-slice --load-format dummy --tokenizer models/k3-mini --max-model-len 4096 --max-num-seqs 4)
        fi
        run "$label" "$model" "$cache" fresh "${args[@]}"
        run "$label" "$model" "$cache" warm "${args[@]}"
    done
done
first=${labels[0]}
for label in "${labels[@]}"; do
    cmp -s /tmp/k3cs/answer-$first-fresh.txt /tmp/k3cs/answer-$label-fresh.txt &&
        summary "answer of $label equals $first's" || summary "ANSWER DIFFERS: $label vs $first"
done
cat "$OUT/coldstart.tsv" >>"$OUT/coldstart.log"
