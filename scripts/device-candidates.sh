#!/usr/bin/env bash
# On the H200, in one call: the device tests of the build in .carry (scripts/device-build.sh on the
# branch to validate, e.g. device-candidates), then k3-slice decode timed for that build beside every
# .carry-ab build (scripts/device-build-ab.sh main), alternating (scripts/device-ab.sh).
#   bash scripts/device-candidates.sh
# Carry .carry (without plugins) and .carry-ab; the tests read models/k3-mini and tests/golden/
# golden.json, not the other large files, which may be left out to fit the carry. Results in $OUT:
# summary.txt, device-test.log, ab/ab.txt. Exit status: non-zero if a test failed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/k3-candidates}"
mkdir -p "$OUT"
BIN=/tmp/k3bin
source scripts/device-lib.sh

summary "== device tests (vision and ReplaySSM left out)"
K3_ROOT="$PWD" timeout --foreground "${K3_TEST_S:-300}" "$BIN/device-test" --nocapture --test-threads=1 \
    --skip vision --skip kda_replay ${K3_DEVICE_TEST_SKIP:+--skip "$K3_DEVICE_TEST_SKIP"} \
    >"$OUT/device-test.log" 2>&1
rc=$?
grep -E '^(op=|e2e |engine |test |graph_decode )|skipped|seed|FAIL|panicked|near tie' "$OUT/device-test.log" |
    tee -a "$OUT/summary.txt" >/dev/null
grep -E '^test |FAIL|panicked' "$OUT/device-test.log" | tail -40
[ $rc -eq 0 ] || fail "device tests (exit $rc; see device-test.log)"
grep -q 'skipped: no CUDA device' "$OUT/device-test.log" && fail "device tests skipped: no CUDA device opened"

summary "== k3-slice decode, each build in turn"
OUT="$OUT/ab" K3_AB_ROUNDS="${K3_AB_ROUNDS:-2}" K3_AB_S="${K3_AB_S:-100}" bash scripts/device-ab.sh \
    bench --device cuda --model models/k3-slice --load-format dummy --prefill-tokens 256 \
    --decode-tokens 32 --batch-sizes 16,64,1 --repeats 2 >>"$OUT/summary.txt" 2>&1 ||
    fail "timing (a build failed; see ab/ab.txt)"
grep -E '^== round|TPOT|host per step|graph nodes|failed' "$OUT/summary.txt" | tail -40

[ ${#failures[@]} -eq 0 ] || { summary "${#failures[@]} failure(s)"; exit 1; }
