#!/usr/bin/env bash
# On the H200: one `k3serve bench` command line timed for several builds in the same run, in turn
# (A, B, C, A, B, C…) so drift hits all alike. The builds: every .carry-ab/NAME.xz (xz'd release
# k3serve binaries made here with scripts/device-build-ab.sh REF…, named for their refs), or
# without that folder .carry-base/k3serve.xz as "base"; then .carry/k3serve.xz as "carry" (the
# build scripts/device-build.sh packed, with its device tests). Carry the folders used.
#   K3_AB_ROUNDS=2 bash scripts/device-ab.sh bench --device cuda --model models/k3-slice …
# Output: every run's full bench report under $OUT/ab.txt, then its summary lines to stdout.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/k3-ab}"
mkdir -p "$OUT" /tmp/k3ab
export LD_LIBRARY_PATH="/usr/local/cuda/lib64:/usr/local/cuda/targets/x86_64-linux/lib:/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export K3_KERNEL_CACHE=/tmp/k3-kernel-cache
builds=()
if [ -d .carry-ab ]; then
    for f in .carry-ab/*.xz; do
        builds+=("$(basename "$f" .xz):$f")
    done
else
    builds=(base:.carry-base/k3serve.xz)
fi
builds+=(carry:.carry/k3serve.xz)
names=()
for b in "${builds[@]}"; do
    name=${b%%:*} file=${b#*:}
    xz -dc "$file" >"/tmp/k3ab/$name" && chmod +x "/tmp/k3ab/$name" || { echo "no $file"; exit 1; }
    names+=("$name")
done
rc=0
for round in $(seq 1 "${K3_AB_ROUNDS:-2}"); do
    for name in "${names[@]}"; do
        echo "== round $round, build $name: $*" | tee -a "$OUT/ab.txt"
        timeout "${K3_AB_S:-120}" "/tmp/k3ab/$name" "$@" >>"$OUT/ab.txt" 2>&1 || { echo "build $name failed"; rc=1; }
    done
done
grep -vE "INFO|compil|^\s*$" "$OUT/ab.txt"
exit $rc
