#!/usr/bin/env bash
# Speculative decoding on the H200 (device tool, repo root, `.carry` carried; build it here first
# with scripts/device-build.sh):
#   bash scripts/device-spec.sh
# 1. the ReplaySSM device tests (CUDA verify/commit against CUDA and CPU decoding; K3_SPEC_TESTS=0
#    leaves them out);
# 2. scripts/spec_bench.py on k3-mini with CUDA: plain vs DSpark, then plain vs prompt lookup,
#    concurrency 1 / 4 / 16 / 64 (K3_SPEC_CONCURRENCY), the held-out task prompts.
# Results in $OUT: summary.txt, replay-test.log, spec-dspark.json, spec-ngram.json.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/k3-device-spec}"
mkdir -p "$OUT"
BIN=/tmp/k3bin
source scripts/device-lib.sh
python3 -c 'import httpx' 2>/dev/null || pip install -q --no-index --find-links .carry/wheels httpx

if [ "${K3_SPEC_TESTS:-1}" = 1 ]; then
    summary "== ReplaySSM device tests"
    K3_ROOT="$PWD" timeout --foreground 240 "$BIN/device-test" kda_replay --nocapture --test-threads=1 \
        >"$OUT/replay-test.log" 2>&1 || fail "kda_replay device tests (see replay-test.log)"
    grep -E '^(op=|test )|panicked|FAIL' "$OUT/replay-test.log" | tee -a "$OUT/summary.txt"
fi

levels="${K3_SPEC_CONCURRENCY:-1,4,16,64}"
serve=(--serve-arg=--device --serve-arg=cuda --serve-arg=--plugin-dir --serve-arg=.carry/plugins)
for method in dspark ngram; do
    case $method in
        dspark) spec='{"method": "dspark", "model": "models/k3-mini-dspark", "num_speculative_tokens": 7}' ;;
        ngram) spec='{"method": "ngram", "num_speculative_tokens": 5}' ;;
    esac
    summary "== spec_bench $method"
    timeout --foreground 300 python3 scripts/spec_bench.py --bin "$BIN/k3serve" "${serve[@]}" \
        --spec "$spec" --concurrency "$levels" --per-kind 4 --max-tokens 256 \
        --out "$OUT/spec-$method.json" 2>&1 | tail -14 | tee -a "$OUT/summary.txt"
    [ "${PIPESTATUS[0]}" -eq 0 ] || fail "spec_bench $method"
done
summary "failures: ${#failures[@]} ${failures[*]:-}"
[ ${#failures[@]} -eq 0 ]
