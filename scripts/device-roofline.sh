#!/usr/bin/env bash
# On the H200: k3-slice prefill and decode against their rooflines, every rate measured in the
# same run. 1. PyTorch measures the bf16 tensor-core rate (dense GEMMs at prefill shapes and a
# square one) and the device copy rate. 2. `k3serve bench` on k3-slice (dummy weights) prints
# prefill tok/s with its FLOPs per token (docs/performance.md, "Prefill FLOPs") and decode TPOT.
# 3. One per-op profile (K3_PROFILE=1, synchronised: shares only) of the same runs.
# Build here first (`bash scripts/device-build.sh`), carry .carry. Results: $OUT/roofline.txt.
# K3_ROOFLINE_FLAGS: extra `bench` flags (e.g. "--dtype float32"); K3_ROOFLINE_PROFILE=0 skips 3.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/k3-roofline}"
BIN=/tmp/k3bin
mkdir -p "$OUT"
R="$OUT/roofline.txt"
summary() { echo "$*" | tee -a "$R"; }
fail() { summary "FAIL: $*"; }
source scripts/device-lib.sh
export K3_KERNEL_CACHE=/tmp/k3-kernel-cache

summary "== rates (PyTorch): bf16 GEMM TFLOP/s and copy TB/s"
python3 - <<'EOF' 2>&1 | tee -a "$R"
import torch
def gemm(m, n, k, reps=20):
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps):
        a @ b
    e.record()
    torch.cuda.synchronize()
    return 2 * m * n * k * reps / (s.elapsed_time(e) / 1e3) / 1e12
for m, n, k in [(8192, 8192, 8192), (2048, 12288, 7168), (2048, 7168, 12288), (2048, 3072, 3584)]:
    print(f"bf16 gemm {m}x{n}x{k}: {gemm(m, n, k):.0f} TFLOP/s")
x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
y = torch.empty_like(x)
for _ in range(3):
    y.copy_(x)
s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
s.record()
for _ in range(10):
    y.copy_(x)
e.record()
torch.cuda.synchronize()
print(f"copy: {2 * x.numel() * 10 / (s.elapsed_time(e) / 1e3) / 1e12:.2f} TB/s (read + write)")
EOF

SLICE=(bench --device cuda --model models/k3-slice --load-format dummy --prefill-tokens 2048)
summary "== k3-slice bench ${K3_ROOFLINE_FLAGS:-}"
timeout 200 "$BIN/k3serve" "${SLICE[@]}" --repeats 3 --decode-tokens 32 --batch-sizes 16,64 \
    ${K3_ROOFLINE_FLAGS:-} 2>"$OUT/bench.err" | tee -a "$R"
if [ "${K3_ROOFLINE_PROFILE:-1}" != 0 ]; then
    summary "== k3-slice per-op profile (K3_PROFILE=1) ${K3_ROOFLINE_FLAGS:-}"
    K3_PROFILE=1 timeout 200 "$BIN/k3serve" "${SLICE[@]}" --repeats 2 --decode-tokens 8 \
        --batch-sizes 16 ${K3_ROOFLINE_FLAGS:-} >>"$R" 2>"$OUT/profile.txt"
    grep -A60 "op profile" "$OUT/profile.txt" | head -70 | tee -a "$R"
fi
