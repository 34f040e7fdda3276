#!/usr/bin/env bash
# Talk to a running `k3serve serve` with plain curl.
#   bash examples/clients/curl.sh [BASE_URL]        (default http://127.0.0.1:8000)
# Set K3SERVE_API_KEY if the server was started with --api-key, K3SERVE_ADMIN_TOKEN for /admin.
set -euo pipefail
BASE=${1:-http://127.0.0.1:8000}
AUTH=()
if [[ -n "${K3SERVE_API_KEY:-}" ]]; then AUTH=(-H "Authorization: Bearer $K3SERVE_API_KEY"); fi
MODEL=$(curl -sf "${AUTH[@]}" "$BASE/v1/models" | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')
echo "== model: $MODEL"

echo "== chat (non-streaming, thinking on)"
curl -sf "${AUTH[@]}" "$BASE/v1/chat/completions" -H 'Content-Type: application/json' -d @- <<JSON
{"model": "$MODEL", "temperature": 0, "max_tokens": 400,
 "messages": [{"role": "user", "content": "What is 123 + 456?"}]}
JSON
echo

echo "== chat (streaming, thinking off, usage at the end)"
curl -sfN "${AUTH[@]}" "$BASE/v1/chat/completions" -H 'Content-Type: application/json' -d @- <<JSON
{"model": "$MODEL", "temperature": 0, "max_tokens": 100, "reasoning_effort": "none",
 "stream": true, "stream_options": {"include_usage": true},
 "messages": [{"role": "user", "content": "What is 7 + 8?"}]}
JSON

echo "== tool call"
curl -sf "${AUTH[@]}" "$BASE/v1/chat/completions" -H 'Content-Type: application/json' -d @- <<JSON
{"model": "$MODEL", "temperature": 0, "max_tokens": 400,
 "messages": [{"role": "user", "content": "What is the weather in Tokyo in celsius?"}],
 "tools": [{"type": "function", "function": {"name": "get_weather", "description": "Current weather for a city.",
   "parameters": {"type": "object", "properties": {"city": {"type": "string"},
     "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}}}]}
JSON
echo

echo "== Anthropic messages"
curl -sf "${AUTH[@]}" "$BASE/v1/messages" -H 'Content-Type: application/json' -H 'anthropic-version: 2023-06-01' -d @- <<JSON
{"model": "$MODEL", "max_tokens": 300, "temperature": 0,
 "messages": [{"role": "user", "content": "What is 20 - 7?"}]}
JSON
echo

echo "== metrics (excerpt)"
curl -sf "$BASE/metrics" | grep -E '^k3serve_(num_requests|prompt_tokens|generation_tokens|prefix_cache_hit_rate)'

if [[ -n "${K3SERVE_ADMIN_TOKEN:-}" ]]; then
  echo "== plugins"
  curl -sf -H "Authorization: Bearer $K3SERVE_ADMIN_TOKEN" "$BASE/admin/plugins"
  echo
  # Swap the tool parser live, then roll back:
  #   curl -X PUT -H "Authorization: Bearer $K3SERVE_ADMIN_TOKEN" -H 'Content-Type: application/wasm' \
  #        --data-binary @plugins/target/wasm32-wasip2/release/kimi_k2_tools.wasm "$BASE/admin/plugins/tool-parser"
  #   curl -X POST -H "Authorization: Bearer $K3SERVE_ADMIN_TOKEN" "$BASE/admin/plugins/tool-parser/rollback"
fi
