# Sourced on the H200 by the device scripts: finds the CUDA libraries cudarc loads by name at run
# time and exports LD_LIBRARY_PATH (and the kernel cache directory). Expects the `summary`
# function of its caller.
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


