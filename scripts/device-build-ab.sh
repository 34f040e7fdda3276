#!/usr/bin/env bash
# Build, here, one release k3serve per git ref for scripts/device-ab.sh to time side by side on the
# H200: each ref is checked out in its own worktree under /tmp/k3ab-src and built into the shared
# target folder (its dependencies reused), with the H200's kernels built in, then stripped and
# xz'd into .carry-ab/NAME.xz (NAME: the ref with / turned into -), replacing what the folder held.
# Carry `.carry-ab`.
#   bash scripts/device-build-ab.sh main device-candidates
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -gt 0 ] || { echo "usage: $0 REF..." >&2; exit 2; }
source scripts/device-build-env.sh
ignore_carry .carry-ab
target_dir=$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')
export CARGO_TARGET_DIR="$target_dir"
rm -rf .carry-ab
mkdir -p .carry-ab /tmp/k3ab-src
for ref in "$@"; do
    name=${ref//\//-}
    src=/tmp/k3ab-src/$name
    git worktree remove --force "$src" 2>/dev/null || rm -rf "$src"
    git worktree add --detach "$src" "$ref" >/dev/null
    echo "== $ref ($(git -C "$src" rev-parse --short HEAD))"
    (cd "$src" && cargo build --release -p k3serve)
    tmp=$(mktemp)
    cp "$CARGO_TARGET_DIR/release/k3serve" "$tmp"
    strip "$tmp"
    xz -9 -T0 -c "$tmp" >".carry-ab/$name.xz"
    rm -f "$tmp"
    git worktree remove --force "$src"
done
git worktree prune
du -b .carry-ab/*
