# Sourced by the device build scripts (scripts/device-build.sh, scripts/device-build-ab.sh), from the
# repo root: the H200's kernels built into the binaries (cubins, so a fresh device compiles nothing
# at start-up: host/backend-cuda/build.rs; K3_KERNEL_ARCHS= (empty) builds without them), and
# `ignore_carry DIR`, which keeps a carry folder out of git (also from a worktree).
export K3_KERNEL_ARCHS="${K3_KERNEL_ARCHS-sm_90a}"
if [ -n "$K3_KERNEL_ARCHS" ]; then
    K3_NVRTC_LIB="$(scripts/nvrtc-lib)"
    export K3_NVRTC_LIB
fi

ignore_carry() {
    local exclude
    exclude="$(git rev-parse --git-path info/exclude)"
    grep -qx "/$1/" "$exclude" 2>/dev/null || echo "/$1/" >>"$exclude"
}
