#!/usr/bin/env bash
# On the H200 (device tool, from the repo root, with `.carry` carried; build it here first with
# scripts/device-build.sh):
#   bash scripts/device-run.sh
# 1. the CUDA-vs-CPU device tests (tests/device.rs: every op, k3-mini end to end, the engine);
# 2. `k3serve serve --device cuda` on models/k3-mini, smoke requests (chat/completions, stream
#    and not), and `k3serve generate` on CUDA vs CPU (greedy, informational).
# 4. the model card's evaluation through `serve --device cuda` in bfloat16 and float32.
# Results in $OUT: summary.txt, device-test.log, server.log, smoke.log, generate.log,
# nvidia-smi.txt, eval-bfloat16.json, eval-float32.json. Exit status: non-zero if anything failed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/k3-device-run}"
mkdir -p "$OUT"
BIN=/tmp/k3bin
PORT=8011
BASE="http://127.0.0.1:$PORT"

nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1 || echo "nvidia-smi failed" >>"$OUT/nvidia-smi.txt"

# --- libraries and the unpacked binaries ($BIN/k3serve, $BIN/device-test).
source scripts/device-lib.sh

# --- 1. device tests.
summary "== device tests"
# K3_DEVICE_TEST_SKIP: a test-name filter to leave out (a kernel a first probe found hanging).
K3_ROOT="$PWD" timeout --foreground 420 "$BIN/device-test" --nocapture --test-threads=1 \
    ${K3_DEVICE_TEST_SKIP:+--skip "$K3_DEVICE_TEST_SKIP"} >"$OUT/device-test.log" 2>&1
rc=$?
grep -E '^(op=|e2e |engine |test |graph_decode )|skipped|seed|FAIL|panicked|near tie' "$OUT/device-test.log" | tee -a "$OUT/summary.txt"
[ $rc -eq 0 ] || fail "device tests (exit $rc; see device-test.log)"
grep -q 'skipped: no CUDA device' "$OUT/device-test.log" && fail "device tests skipped: no CUDA device opened"

# Whether the server (pid $1) answers /health within two minutes; fails at once if it exits.
wait_healthy() {
    for _ in $(seq 1 240); do
        curl -sf "$BASE/health" >/dev/null 2>&1 && return 0
        kill -0 "$1" 2>/dev/null || return 1
        sleep 0.5
    done
    return 1
}

# --- 2. the server on CUDA.
summary "== k3serve serve --device cuda"
"$BIN/k3serve" serve --device cuda --model models/k3-mini --host 127.0.0.1 --port $PORT \
    --plugin-dir .carry/plugins --max-model-len 2048 >"$OUT/server.log" 2>&1 &
server=$!
if ! wait_healthy $server; then
    fail "server did not become healthy (see server.log)"
    tail -20 "$OUT/server.log" | tee -a "$OUT/summary.txt"
else
    summary "server healthy; device line: $(grep -iE 'device|cuda' "$OUT/server.log" | head -3 | tr '\n' ' ')"
    S="$OUT/smoke.log"
    req() { # name, path, json body, [stream]
        local name=$1 path=$2 body=$3
        echo "== $name" >>"$S"
        if ! curl -sfN --max-time 120 "$BASE$path" -H 'Content-Type: application/json' -d "$body" >"$BIN/resp" 2>>"$S"; then
            cat "$BIN/resp" >>"$S"
            fail "smoke: $name (curl error)"
            return
        fi
        cat "$BIN/resp" >>"$S"
        echo >>"$S"
        if [ "${4:-}" = stream ]; then
            grep -q '^data: \[DONE\]' "$BIN/resp" || fail "smoke: $name (no [DONE])"
            summary "smoke $name: $(grep -c '^data: ' "$BIN/resp") SSE events"
        else
            local text
            text=$(python3 -c 'import json,sys; c=json.load(open(sys.argv[1]))["choices"][0]; print(repr((c.get("message") or {}).get("content") or c.get("text"))[:160], c.get("finish_reason"))' "$BIN/resp") \
                || fail "smoke: $name (bad JSON)"
            summary "smoke $name: $text"
        fi
    }
    req models-probe /v1/completions '{"model":"k3-mini","prompt":"1, 2, 3,","max_tokens":1}'
    req "chat" /v1/chat/completions '{"model":"k3-mini","temperature":0,"max_tokens":64,"messages":[{"role":"user","content":"What is 47 + 85?"}]}'
    req "chat stream" /v1/chat/completions '{"model":"k3-mini","temperature":0,"max_tokens":64,"stream":true,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"What is 7 + 8?"}]}' stream
    req "completions" /v1/completions '{"model":"k3-mini","temperature":0,"max_tokens":48,"prompt":"The capital of France is"}'
    req "completions stream" /v1/completions '{"model":"k3-mini","temperature":0,"max_tokens":48,"stream":true,"prompt":"The capital of France is"}' stream
    req "completions n=3 sampled" /v1/completions '{"model":"k3-mini","temperature":0.8,"seed":1,"n":3,"max_tokens":32,"prompt":"Once upon a time"}'
    # Constrained decoding on the GPU (token masks applied by the device top-k): the outputs must
    # match their constraint whatever the model would have written.
    constrained() { # name, path, json body, python check of the response `r` (a dict)
        local name=$1 path=$2 body=$3 check=$4
        echo "== $name" >>"$S"
        if curl -sf --max-time 120 "$BASE$path" -H 'Content-Type: application/json' -d "$body" >"$BIN/resp" 2>>"$S" &&
            python3 -c "import json,re,sys; r=json.load(open(sys.argv[1])); $check" "$BIN/resp" >>"$S" 2>&1; then
            summary "smoke $name: ok"
        else
            cat "$BIN/resp" >>"$S"
            fail "smoke: $name"
        fi
        echo >>"$S"
    }
    constrained "json_schema chat" /v1/chat/completions '{"model":"k3-mini","temperature":0,"max_tokens":120,"reasoning_effort":"none","messages":[{"role":"user","content":"Describe a cat."}],"response_format":{"type":"json_schema","json_schema":{"name":"pet","strict":true,"schema":{"type":"object","properties":{"name":{"type":"string","maxLength":12},"legs":{"type":"integer","minimum":0,"maximum":8}},"required":["name","legs"],"additionalProperties":false}}}}' \
        'v=json.loads(r["choices"][0]["message"]["content"]); assert set(v)=={"name","legs"} and isinstance(v["legs"],int), v; print(v)'
    constrained "guided_regex completion" /v1/completions '{"model":"k3-mini","temperature":0,"max_tokens":24,"prompt":"Email:","guided_regex":"[a-z]{3,8}@example\\.(com|org)"}' \
        't=r["choices"][0]["text"]; assert re.fullmatch(r"[a-z]{3,8}@example[.](com|org)", t), t; print(t)'
    constrained "tool_choice required" /v1/chat/completions '{"model":"k3-mini","temperature":0,"max_tokens":120,"reasoning_effort":"none","messages":[{"role":"user","content":"Hello!"}],"tool_choice":"required","tools":[{"type":"function","function":{"name":"get_weather","parameters":{"type":"object","properties":{"city":{"type":"string","maxLength":20}},"required":["city"]}}}]}' \
        'c=r["choices"][0]; assert c["finish_reason"]=="tool_calls", c; a=json.loads(c["message"]["tool_calls"][0]["function"]["arguments"]); assert isinstance(a["city"],str), a; print(a)'
    # Concurrent requests through the batching engine on the GPU.
    pids=()
    for i in 1 2 3 4 5 6; do
        curl -sf --max-time 120 "$BASE/v1/chat/completions" -H 'Content-Type: application/json' \
            -d "{\"model\":\"k3-mini\",\"temperature\":0,\"max_tokens\":48,\"messages\":[{\"role\":\"user\",\"content\":\"Count to $i.\"}]}" \
            >"$BIN/conc$i" 2>&1 &
        pids+=($!)
    done
    conc_ok=1
    for p in "${pids[@]}"; do wait "$p" || conc_ok=0; done
    for i in 1 2 3 4 5 6; do
        echo "== concurrent $i" >>"$S"
        cat "$BIN/conc$i" >>"$S"
        echo >>"$S"
    done
    [ $conc_ok -eq 1 ] && summary "smoke concurrent x6: ok" || fail "smoke: concurrent chat requests"
    if [ -f examples/clients/curl.sh ]; then
        echo "== examples/clients/curl.sh" >>"$S"
        if timeout --foreground 180 bash examples/clients/curl.sh "$BASE" >>"$S" 2>&1; then
            summary "examples/clients/curl.sh: ok"
        else
            fail "examples/clients/curl.sh"
        fi
    fi
    curl -sf "$BASE/metrics" | grep -E '^k3serve_(num_requests|generation_tokens)' >>"$S" 2>&1
fi
kill $server 2>/dev/null
for _ in $(seq 1 40); do kill -0 $server 2>/dev/null || break; sleep 0.25; done
kill -9 $server 2>/dev/null
wait $server 2>/dev/null
grep -iE 'panick|error' "$OUT/server.log" | head -5 | sed 's/^/server.log: /' | tee -a "$OUT/summary.txt"

# --- 3. generate: CUDA vs CPU, greedy (informational: near-ties can flip a token).
G="$OUT/generate.log"
prompt='<|open|>message role="user"<|sep|>What is 47 + 85?<|close|>message<|sep|><|end_of_msg|><|open|>message role="assistant"<|sep|>'
for dev in cuda cpu; do
    echo "== generate --device $dev" >>"$G"
    if ! timeout --foreground 120 "$BIN/k3serve" generate --device $dev --model models/k3-mini --prompt "$prompt" \
        --max-tokens 48 --ignore-eos >"$BIN/gen-$dev" 2>>"$G"; then
        fail "generate --device $dev"
    fi
    cat "$BIN/gen-$dev" >>"$G"
done
if cmp -s "$BIN/gen-cuda" "$BIN/gen-cpu"; then
    summary "generate: CUDA and CPU greedy texts are identical"
else
    summary "generate: CUDA and CPU greedy texts differ (see generate.log; device tests judge near-ties)"
fi

# --- 4. the model card's evaluation through the CUDA server, per --dtype (scripts/eval_server.py):
# every cell must equal the card's CPU table. K3_DEVICE_EVAL=0 skips it.
if [ "${K3_DEVICE_EVAL:-1}" != 0 ]; then
    for dtype in bfloat16 float32; do
        "$BIN/k3serve" serve --device cuda --dtype $dtype --model models/k3-mini --host 127.0.0.1 \
            --port $PORT --plugin-dir .carry/plugins >"$BIN/eval-server-$dtype.log" 2>&1 &
        server=$!
        if wait_healthy $server &&
            timeout --foreground 300 python3 scripts/eval_server.py --base-url "$BASE" --per-kind 30 \
                --compare reference/runs-log/k3-mini-eval-after-vision.json \
                --out "$OUT/eval-$dtype.json" >"$BIN/eval-$dtype.txt" 2>&1; then
            summary "model-card eval ($dtype): all $(grep -c ' vs ' "$BIN/eval-$dtype.txt") cells equal the card's"
        else
            fail "model-card eval ($dtype)"
            grep -E 'DIFFERS|Error|error' "$BIN/eval-$dtype.txt" | head -20 | tee -a "$OUT/summary.txt"
        fi
        kill $server 2>/dev/null
        wait $server 2>/dev/null
    done
fi

if [ ${#failures[@]} -gt 0 ]; then
    summary "== ${#failures[@]} failure(s): ${failures[*]}"
    exit 1
fi
summary "== all passed"
