#!/usr/bin/env bash
# Build, here (no GPU needed), what scripts/device-run.sh runs on the H200: the release k3serve
# binary and the tests/device.rs test binary of k3-backend-cuda, stripped and xz-compressed
# into .carry/ (ignored by git; pass `.carry` in the device tool's `carry`), plus the default
# plugins (.wasm) the server loads.
#   bash scripts/device-build.sh
set -euo pipefail
cd "$(dirname "$0")/.."
CARRY=.carry
mkdir -p "$CARRY"
source scripts/device-build-env.sh
ignore_carry .carry

echo "== cargo build --release -p k3serve (kernels built in: ${K3_KERNEL_ARCHS:-none})"
cargo build --release -p k3serve
target_dir=$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')
server="$target_dir/release/k3serve"

echo "== cargo test --release -p k3-backend-cuda --test device --no-run"
test_bin=$(cargo test --release -p k3-backend-cuda --test device --no-run --message-format=json |
    python3 -c '
import json, sys
exe = None
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "device":
        exe = m["executable"]
if not exe:
    sys.exit("no executable for the device test in cargo output")
print(exe)
')

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cp "$server" "$tmp/k3serve"
cp "$test_bin" "$tmp/device-test"
strip "$tmp/k3serve" "$tmp/device-test"
# xz: the device decompresses with the xz tool or, failing that, Python's lzma module.
rm -f "$CARRY"/k3serve.* "$CARRY"/device-test.*
xz -9 -T0 -c "$tmp/k3serve" >"$CARRY/k3serve.xz"
xz -9 -T0 -c "$tmp/device-test" >"$CARRY/device-test.xz"

# The default plugins, built by k3-plugin-host's build.rs (needed by `k3serve serve`).
plugin_dir=plugins/target/wasm32-wasip2/release
rm -rf "$CARRY/plugins"
mkdir -p "$CARRY/plugins"
if ls "$plugin_dir"/*.wasm >/dev/null 2>&1; then
    cp "$plugin_dir"/*.wasm "$CARRY/plugins/"
else
    echo "warning: no plugins in $plugin_dir (run scripts/build-plugins); serve will fail" >&2
fi
git rev-parse --short HEAD >"$CARRY/BUILD_INFO" 2>/dev/null || true
date -u +%FT%TZ >>"$CARRY/BUILD_INFO"

echo "== sizes"
ls -l "$tmp/k3serve" "$tmp/device-test"
du -b "$CARRY"/* "$CARRY"/plugins/* | sort -k2
total=$(du -sb "$CARRY" | cut -f1)
echo "total in $CARRY: $((total / 1024 / 1024)) MiB ($total bytes)"
if [ "$total" -gt $((30 * 1024 * 1024)) ]; then
    echo "error: $CARRY is over 30 MiB" >&2
    exit 1
fi
