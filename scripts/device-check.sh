#!/usr/bin/env bash
# On the H200 (device tool): `bash scripts/device-check.sh [--quick] [--no-bench]`.
# Builds nothing with Rust. Compiles kernels/*.cu with NVRTC (through CuPy), runs the op-level
# correctness checks against reference/k3ref, then the benchmarks (CUDA events) against their
# memory floors and fla (if its wheels were carried in .whl/). Results: $OUT/device_check.json,
# $OUT/device_check.log, $OUT/nvidia-smi.txt. Exit status: non-zero if any check failed.
# Without a GPU: `bash scripts/device-check.sh --dry-run` (signature checks + emulated kernels).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/k3-device-check}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
case " $* " in
*" --dry-run "*) ;;
*) nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1 || echo "device-check: nvidia-smi failed" ;;
esac
python3 host/backend-cuda/harness/device_check.py --out "$OUT" "$@" 2>&1 | tee "$OUT/device_check.stdout"
exit "${PIPESTATUS[0]}"
