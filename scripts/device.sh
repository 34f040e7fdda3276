#!/usr/bin/env bash
# Everything on the H200 in one device call (build here first: `bash scripts/device-build.sh`;
# then the device tool with carry [".carry", ".whl"] runs `bash scripts/device.sh`):
#   1. kernels vs the PyTorch reference + kernel benchmarks vs floors and fla (scripts/device-check.sh)
#   2. the Rust CUDA backend vs the CPU backend: ops, k3-mini golden prompts, the engine; then
#      `k3serve serve --device cuda` smoke requests (scripts/device-run.sh)
#   3. end-to-end throughput: k3-mini on CUDA and on the CPU, and k3-slice (K3's per-layer shapes,
#      dummy weights) on CUDA (`k3serve bench`)
# Each stage has its own time limit so one slow stage leaves the others their share of the call.
# Results under $OUT; exit status non-zero if a check failed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/k3-device}"
mkdir -p "$OUT"
export OUT
rc=0
timeout "${K3_CHECK_S:-200}" bash scripts/device-check.sh >"$OUT/check_stdout.txt" 2>&1 || rc=1
grep -E "^(FAIL|checks:|bench )" "$OUT/check_stdout.txt"
timeout "${K3_RUN_S:-150}" bash scripts/device-run.sh >/dev/null 2>&1 || rc=1
grep -vE "^op=.* ok$" "$OUT/summary.txt" | grep -vE "^(LD_LIBRARY_PATH|library )"
# device-run.sh unpacked the binaries and set up nothing global: find the libraries the same way.
BIN=/tmp/k3bin/k3serve
export LD_LIBRARY_PATH="/usr/local/cuda/lib64:/usr/local/cuda/targets/x86_64-linux/lib:/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export K3_KERNEL_CACHE=/tmp/k3-kernel-cache
B="$OUT/bench.txt"
{
    echo "== k3-mini, CUDA"
    timeout 40 "$BIN" bench --device cuda --model models/k3-mini --prefill-tokens 2048 --decode-tokens 256 --repeats 2
    if [ -n "${K3_CPU_BENCH:-}" ]; then
        echo "== k3-mini, CPU ($(nproc) threads)"
        timeout 60 "$BIN" bench --device cpu --model models/k3-mini --prefill-tokens 2048 --decode-tokens 256
    fi
    echo "== k3-slice (dummy weights), CUDA"
    timeout "${K3_SLICE_S:-150}" "$BIN" bench --device cuda --model models/k3-slice --load-format dummy \
        --prefill-tokens 2048 --decode-tokens 32 --repeats 1
} >"$B" 2>&1
grep -vE "^\s*$" "$B" | grep -vE "INFO|compil" | tail -30
exit $rc
