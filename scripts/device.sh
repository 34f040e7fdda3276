#!/usr/bin/env bash
# Everything on the H200 in one device call (build here first: `bash scripts/device-build.sh`;
# then the device tool with carry [".carry", ".whl"] runs `bash scripts/device.sh`):
#   1. kernels vs the PyTorch reference + kernel benchmarks vs floors and fla (scripts/device-check.sh)
#   2. the Rust CUDA backend vs the CPU backend: ops, k3-mini golden prompts, the engine; then
#      `k3serve serve --device cuda` smoke requests (scripts/device-run.sh)
#   3. end-to-end throughput (`k3serve bench`): k3-mini on CUDA (and the CPU with K3_CPU_BENCH=1),
#      k3-slice (K3's per-layer shapes, dummy weights) on CUDA at decode batch 16/64, then one
#      per-op profile (K3_PROFILE=1)
# K3_BENCH_ONLY (e.g. "mla,moe"; "none") limits stage 1's kernel benchmarks to those sections
# (kda_decode, kda_prefill, mla, mla_prefill, attn_res, moe, gemv, sampling; the probes mla_diag,
# mla_steady and moe_few_tokens_diag run only when named);
# K3_SLICE_RUNS (default "default profile"; also "nogemm", "nographs", "candidates" = the
# backend flags in K3_SLICE_CANDIDATES, e.g. "--dtype float32") picks stage 3's
# k3-slice runs.
# K3_SERVING=1 adds stage 4, the seeds' serving workload on k3-slice (scripts/device-serving.sh).
# Each stage has its own time limit so one slow stage leaves the others their share of the call.
# Results under $OUT; exit status non-zero if a check failed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/k3-device}"
mkdir -p "$OUT"
export OUT
rc=0
# A stage past its limit must not leave a process (and a spinning kernel) behind to share the GPU
# with the next stage: inner timeouts use --foreground (they stay in the stage's process group,
# which the stage's timeout signals), and this reaps whatever still runs.
reap() { pkill -9 -f "harness/device_check.py|/tmp/k3bin/device-test|/tmp/k3bin/k3serve" 2>/dev/null; sleep 1; }
# K3_CHECK_ARGS: extra device-check.sh arguments, e.g. "--checks check_mla_bf16" for a short call.
timeout "${K3_CHECK_S:-200}" bash scripts/device-check.sh ${K3_CHECK_ARGS:-} >"$OUT/check_stdout.txt" 2>&1 || rc=1
reap
grep -E "^(FAIL|checks:|bench )" "$OUT/check_stdout.txt"
timeout "${K3_RUN_S:-150}" bash scripts/device-run.sh >/dev/null 2>&1 || rc=1
reap
grep -vE "^op=.* ok$" "$OUT/summary.txt" | grep -vE "^(LD_LIBRARY_PATH|library )"
# device-run.sh unpacked the binaries and set up nothing global: find the libraries the same way.
BIN=/tmp/k3bin/k3serve
export LD_LIBRARY_PATH="/usr/local/cuda/lib64:/usr/local/cuda/targets/x86_64-linux/lib:/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export K3_KERNEL_CACHE=/tmp/k3-kernel-cache
B="$OUT/bench.txt"
SLICE=(bench --device cuda --model models/k3-slice --load-format dummy --prefill-tokens 2048 --repeats 2)
{
    if [ "${K3_MINI_BENCH:-1}" = 1 ]; then  # K3_MINI_BENCH=0 skips the k3-mini throughput runs
        echo "== k3-mini, CUDA"
        timeout 60 "$BIN" bench --device cuda --model models/k3-mini --prefill-tokens 2048 --decode-tokens 256 \
            --repeats 2 --batch-sizes 16,64
        echo "== k3-mini, CUDA, decode without CUDA graphs (--cuda-graphs false)"
        timeout 60 "$BIN" bench --device cuda --model models/k3-mini --prefill-tokens 2048 \
            --decode-tokens 256 --repeats 2 --batch-sizes 16,64 --cuda-graphs false
    fi
    if [ -n "${K3_CPU_BENCH:-}" ]; then
        echo "== k3-mini, CPU ($(nproc) threads)"
        timeout 60 "$BIN" bench --device cpu --model models/k3-mini --prefill-tokens 2048 --decode-tokens 256
    fi
    runs=" ${K3_SLICE_RUNS:-default profile} "
    if [[ $runs == *" default "* ]]; then
        echo "== k3-slice (dummy weights), CUDA, default kernels"
        timeout "${K3_SLICE_S:-120}" "$BIN" "${SLICE[@]}" --decode-tokens 32 --batch-sizes 16,64
    fi
    if [[ $runs == *" nographs "* ]]; then
        echo "== k3-slice, CUDA, decode without CUDA graphs (--cuda-graphs false)"
        timeout "${K3_SLICE_S:-120}" "$BIN" "${SLICE[@]}" --decode-tokens 32 --batch-sizes 16,64 --cuda-graphs false
    fi
    if [[ $runs == *" nogemm "* ]]; then
        echo "== k3-slice, CUDA, MoE without the many-assignment path (--moe-gemm-min-assignments huge)"
        timeout "${K3_SLICE_S:-120}" "$BIN" "${SLICE[@]}" --decode-tokens 32 --batch-sizes 16,64 \
            --moe-gemm-min-assignments 1000000000
    fi
    if [[ $runs == *" candidates "* ]]; then
        # Backend options other than the defaults, all at once (K3_SLICE_CANDIDATES: flags).
        echo "== k3-slice, CUDA, options: ${K3_SLICE_CANDIDATES:-none}"
        timeout "${K3_SLICE_S:-120}" "$BIN" "${SLICE[@]}" --decode-tokens 32 --batch-sizes 16,64 ${K3_SLICE_CANDIDATES:-}
    fi
    if [[ $runs == *" profile "* ]]; then
        echo "== k3-slice, CUDA, per-op profile (K3_PROFILE=1: synchronised, for shares only)"
        K3_PROFILE=1 timeout "${K3_SLICE_S:-120}" "$BIN" "${SLICE[@]}" --decode-tokens 8 --batch-sizes 16
    fi
} >"$B" 2>&1
grep -vE "^\s*$" "$B" | grep -vE "INFO|compil" | tail -80
if [ -n "${K3_SERVING:-}" ]; then
    echo "== serving: k3-slice through HTTP (scripts/device-serving.sh)"
    timeout "${K3_SERVING_S:-420}" bash scripts/device-serving.sh || rc=1
    grep -iE "warn|error|panic" "$OUT/serving-server.log" | grep -v "vocabulary is wider" | tail -5
fi
exit $rc
