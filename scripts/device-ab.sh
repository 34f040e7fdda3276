#!/usr/bin/env bash
# On the H200: one `k3serve bench` command line timed for two builds in the same run, alternating
# A, B, A, B… so drift hits both alike. A = .carry-base/k3serve.xz (a build of the comparison
# commit, made here with `cargo build --release -p k3serve` and xz'd), B = .carry/k3serve.xz
# (scripts/device-build.sh). Carry both folders.
#   K3_AB_ROUNDS=2 bash scripts/device-ab.sh bench --device cuda --model models/k3-slice …
# Output: every run's full bench report under $OUT/ab.txt, then its summary lines to stdout.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/k3-ab}"
mkdir -p "$OUT" /tmp/k3ab
export LD_LIBRARY_PATH="/usr/local/cuda/lib64:/usr/local/cuda/targets/x86_64-linux/lib:/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export K3_KERNEL_CACHE=/tmp/k3-kernel-cache
for side in A:.carry-base B:.carry; do
    name=${side%%:*} dir=${side#*:}
    xz -dc "$dir/k3serve.xz" >"/tmp/k3ab/$name" && chmod +x "/tmp/k3ab/$name" || { echo "no $dir/k3serve.xz"; exit 1; }
done
rc=0
for round in $(seq 1 "${K3_AB_ROUNDS:-2}"); do
    for name in A B; do
        echo "== round $round, build $name: $*" | tee -a "$OUT/ab.txt"
        timeout "${K3_AB_S:-120}" "/tmp/k3ab/$name" "$@" >>"$OUT/ab.txt" 2>&1 || { echo "build $name failed"; rc=1; }
    done
done
grep -vE "INFO|compil|^\s*$" "$OUT/ab.txt"
exit $rc
