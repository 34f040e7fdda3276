#!/usr/bin/env bash
# On the H200, after scripts/device-run.sh unpacked the binaries into /tmp/k3bin (scripts/device.sh
# runs this as its last stage with K3_SERVING=1): the seeds' serving workload on k3-slice (K3's
# per-layer shapes, dummy weights, k3-mini's tokenizer for the text side) through the HTTP server:
# prompts of K3_SERVING_PROMPT tokens (8192), K3_SERVING_OUTPUT output tokens (1024, ignore_eos),
# concurrency K3_SERVING_LEVELS (1,4,16), one request per slot per level; TTFT, TPOT and
# throughput by scripts/bench_serving.py (K3_SERVING_SAMPLING: its --sampling JSON, e.g.
# '{"temperature": 1.0, "top_k": 50}' so dummy weights route like a trained model); K3_SERVING_FLAGS adds serve flags (e.g. "--dtype float32"
# for a before/after pair in one call); K3_SERVING_BIN the server binary (default /tmp/k3bin/k3serve:
# for two builds in one call, unpack each to its own path and run this once per path). The server
# has exited when this returns, so the next run can take its port. Results: $OUT/serving.json,
# $OUT/serving.log, $OUT/serving-server.log. Needs httpx (carried as wheels in .whl/, installed by
# device-check.sh into /tmp/site).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/k3-device-serving}"
mkdir -p "$OUT"
BIN=${K3_SERVING_BIN:-/tmp/k3bin/k3serve}
PORT=8012
BASE="http://127.0.0.1:$PORT"
export LD_LIBRARY_PATH="/usr/local/cuda/lib64:/usr/local/cuda/targets/x86_64-linux/lib:/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export K3_KERNEL_CACHE=/tmp/k3-kernel-cache
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
prompt=${K3_SERVING_PROMPT:-8192}
output=${K3_SERVING_OUTPUT:-1024}
levels=${K3_SERVING_LEVELS:-1,4,16}
sampling=${K3_SERVING_SAMPLING:-"{}"}
max_seqs=$(tr ',' '\n' <<<"$levels" | sort -n | tail -1)
"$BIN" serve --device cuda --model models/k3-slice --load-format dummy --tokenizer models/k3-mini \
    --host 127.0.0.1 --port $PORT --plugin-dir .carry/plugins --max-model-len $((prompt + output + 64)) \
    --max-num-seqs "$max_seqs" --max-num-batched-tokens "${K3_SERVING_STEP_TOKENS:-2048}" \
    --no-enable-prefix-caching ${K3_SERVING_FLAGS:-} >"$OUT/serving-server.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null' EXIT
for _ in $(seq 1 240); do
    curl -sf "$BASE/health" >/dev/null 2>&1 && break
    kill -0 $server 2>/dev/null || { echo "serving: server exited"; tail -20 "$OUT/serving-server.log"; exit 1; }
    sleep 0.5
done
# Peak device memory while serving (nvidia-smi every 0.5 s): the KV/state arena is sized to the
# --gpu-memory-utilization budget minus a 6 GiB work reserve, and this shows whether the work buffers
# (KDA prefill records, MoE scratch, CUDA graphs) stayed inside it.
( peak=0; while kill -0 $server 2>/dev/null; do
      m=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits 2>/dev/null | head -1)
      [ -n "$m" ] && [ "$m" -gt "$peak" ] && peak=$m && echo "$peak" >"$OUT/serving-peak-mib.txt"
      sleep 0.5
  done ) &
# Each level runs as many requests as it has slots (the 8k x 1k requests take minutes each).
rc=0
for c in ${levels//,/ }; do
    python3 scripts/bench_serving.py --base-url "$BASE" --prompt-tokens "$prompt" --output-tokens "$output" \
        --sampling "$sampling" \
        --concurrency "$c" --requests "$c" --out "$OUT/serving-c$c.json" 2>&1 | tee -a "$OUT/serving.log" || rc=1
done
total=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
echo "serving: peak device memory used $(cat "$OUT/serving-peak-mib.txt" 2>/dev/null || echo '?') MiB of ${total:-?} MiB" \
    "(cache arena: $(sed 's/\x1b\[[0-9;]*m//g' "$OUT/serving-server.log" | grep -oE 'arena_mb=[0-9.]+' | head -1) MB)" | tee -a "$OUT/serving.log"
exit $rc
