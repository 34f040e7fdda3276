# Sourced by the device scripts (scripts/device-run.sh, scripts/device-spec.sh, …) on the H200, from
# the repo root with `.carry` carried: finds the CUDA libraries cudarc loads by name, and unpacks
# the binaries scripts/device-build.sh packed into $BIN. Expects $OUT and $BIN. `summary` prints a
# line and appends it to $OUT/summary.txt; `fail` also records it in `failures` (for the caller's
# exit status); a caller's own functions of those names are used where it has them.
declare -p failures &>/dev/null || failures=()
declare -F summary >/dev/null || summary() { echo "$*" | tee -a "$OUT/summary.txt"; }
declare -F fail >/dev/null || fail() {
    failures+=("$1")
    summary "FAIL: $1"
}
source "$(dirname "${BASH_SOURCE[0]}")/device-libs.sh"
# Nsight Compute, for the profiling scripts (device-step-profile.sh, device-kernel-profile.sh).
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)

# --- unpack the binaries (xz; Python's lzma where the xz tool is missing).
mkdir -p "$BIN"
unpack() {
    if command -v xz >/dev/null; then
        xz -dc "$1" >"$2"
    else
        python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' "$1" "$2"
    fi && chmod +x "$2"
}
for b in k3serve device-test; do
    if ! unpack ".carry/$b.xz" "$BIN/$b"; then
        fail "unpacking .carry/$b.xz (run scripts/device-build.sh and carry .carry)"
        exit 1
    fi
done
[ -f .carry/BUILD_INFO ] && summary "build: $(tr '\n' ' ' <.carry/BUILD_INFO)"
