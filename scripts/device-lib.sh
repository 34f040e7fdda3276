# Sourced by the device scripts (scripts/device-run.sh, scripts/device-spec.sh) on the H200, from
# the repo root with `.carry` carried: finds the CUDA libraries cudarc loads by name, and unpacks
# the binaries scripts/device-build.sh packed into $BIN. Expects $OUT, $BIN and the `summary` and
# `fail` functions of its caller.
# --- libraries: cudarc loads libcuda (driver), libnvrtc and libcublas by name at run time.
libdirs=()
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/local/nvidia/lib64; do
    [ -d "$d" ] && libdirs+=("$d")
done
pydirs=$(python3 - <<'EOF' 2>/dev/null
import glob, os
dirs = []
def add(pattern):
    for f in sorted(glob.glob(pattern, recursive=True)):
        d = os.path.dirname(f)
        if d not in dirs:
            dirs.append(d)
try:
    import nvidia
    for p in nvidia.__path__:
        add(os.path.join(p, "**", "libnvrtc.so*"))
        add(os.path.join(p, "**", "libcublas.so*"))
except Exception:
    pass
try:
    import importlib.util
    spec = importlib.util.find_spec("torch")
    if spec and spec.origin:
        add(os.path.join(os.path.dirname(spec.origin), "lib", "libcublas.so*"))
except Exception:
    pass
print(":".join(dirs))
EOF
)
LD_LIBRARY_PATH="$(IFS=:; echo "${libdirs[*]:-}")${pydirs:+:$pydirs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export LD_LIBRARY_PATH="${LD_LIBRARY_PATH#:}"
summary "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
for lib in libcuda.so.1 libnvrtc.so.13 libcublas.so.13; do
    found=$( (ldconfig -p 2>/dev/null | grep -o "/[^ ]*/$lib\$"; IFS=:; for d in $LD_LIBRARY_PATH; do ls "$d/$lib" 2>/dev/null; done) | head -1)
    summary "library $lib: ${found:-NOT FOUND}"
done
export K3_KERNEL_CACHE=/tmp/k3-kernel-cache


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
