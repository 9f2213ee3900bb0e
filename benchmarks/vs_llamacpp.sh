#!/usr/bin/env bash
# tokenfab serve against llama.cpp's llama-server, same model (the bundled Q4_1 GGUF), same load
# generator (tokenfab bench serve), one server after the other on this machine:
#   1 stream      8 requests, 128-token prompts, 128 output tokens, one at a time
#   32 streams   64 requests, same lengths, 32 in flight
# Needs llama-server built first: ../shared/anchors/llama-server.sh build (about 6 minutes).
#   bash benchmarks/vs_llamacpp.sh [OUT_DIR]
set -euo pipefail
OUT=${1:-/tmp/tokenfab-vs-llamacpp}
ANCHORS=${ANCHORS:-$(dirname "$0")/../../shared/anchors}
mkdir -p "$OUT"
PORT=8765

wait_up() { for _ in $(seq 600); do curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && return; sleep 0.5; done; exit 1; }
load() {  # NAME
  for c in 1 32; do
    n=$([ "$c" = 1 ] && echo 8 || echo 64)
    tokenfab bench serve --base-url "http://127.0.0.1:$PORT" --num-prompts "$n" --max-concurrency "$c" \
      --input-len 128 --output-len 128 --no-progress --seed 3 --out "$OUT/$1-c$c.json" >/dev/null
  done
}

bash "$ANCHORS/llama-server.sh" serve "$PORT" 32 >"$OUT/llama-server.log" 2>&1 & PID=$!
wait_up; load llamacpp; kill $PID; wait $PID 2>/dev/null || true

tokenfab serve --port "$PORT" --no-access-log --log-level warning >"$OUT/tokenfab.log" 2>&1 & PID=$!
wait_up; load tokenfab; kill $PID; wait $PID 2>/dev/null || true

for c in 1 32; do
  echo "== $c stream(s): llama.cpp vs tokenfab"
  tokenfab bench compare "$OUT/llamacpp-c$c.json" "$OUT/tokenfab-c$c.json" --labels llama.cpp,tokenfab
done
