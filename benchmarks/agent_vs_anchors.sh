#!/usr/bin/env bash
# The agent workload (bench serve --dataset agent) against tokenfab serve and llama.cpp's llama-server on
# the bundled model, one server after the other on this machine: SESSIONS concurrent sessions (default 16)
# of TURNS turns (default 8), a 2,048-token system prompt with tools, 64-token user messages, 256-token
# tool results, 128 output tokens, exponential think times of 1 s (docs/bench.md, "The agent workload").
# Prints each server's TTFT P50 / P99 at turn 1 and at the last turn, and its session time P50 / P99.
# llama-server holds one slot per session with 8,192 tokens each (-np SESSIONS -c SESSIONS*8192).
#   bash benchmarks/agent_vs_anchors.sh [OUT_DIR]
set -euo pipefail
OUT=${1:-/tmp/tokenfab-agent-vs-anchors}
ANCHORS_DIR=${ANCHORS_DIR:-$HOME/.cache/tokenfab-anchors}
SESSIONS=${SESSIONS:-16}; TURNS=${TURNS:-8}; PORT=8766
mkdir -p "$OUT"
wait_up() { for _ in $(seq 1200); do curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && return
                                      kill -0 "$PID" 2>/dev/null || { echo "server exited: see $OUT/*.log" >&2; exit 1; }
                                      sleep 0.5; done; exit 1; }
load() {  # NAME
  tokenfab bench serve --base-url "http://127.0.0.1:$PORT" --dataset agent --turns "$TURNS" --num-sessions="$SESSIONS" \
    --system-len 2048 --user-len 64 --tool-len 256 --output-len 128 --think-time exp:1 \
    --max-concurrency "$SESSIONS" --seed 7 --no-progress --out "$OUT/$1.json" >/dev/null
}
lscpu | grep -E '^Model name'
GGUF=$(python3 -c 'from tokenfab.files.bundled import resolve_model_path as r; print(r(None))')
"$ANCHORS_DIR/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-server" -m "$GGUF" -t "$(nproc)" -tb "$(nproc)" \
  -np "$SESSIONS" -c $((SESSIONS * 8192)) --host 127.0.0.1 --port "$PORT" >"$OUT/llama-server.log" 2>&1 & PID=$!
wait_up; load llamacpp; kill $PID; wait $PID 2>/dev/null || true
tokenfab serve --port "$PORT" --no-access-log --log-level warning >"$OUT/tokenfab.log" 2>&1 & PID=$!
wait_up; load tokenfab; kill $PID; wait $PID 2>/dev/null || true
python3 - "$OUT" "$TURNS" <<'PY'
import json, sys
out, last = sys.argv[1], int(sys.argv[2])
print(f"{'server':<10}{'TTFT P50/P99 turn 1 (ms)':>28}{f'TTFT P50/P99 turn {last} (ms)':>28}{'P99 ratio':>11}"
      f"{'session P50/P99 (s)':>22}{'completed':>11}")
for name in ("llamacpp", "tokenfab"):
    s = json.load(open(f"{out}/{name}.json"))["runs"][0]["sessions"]
    t = {row["turn"]: row for row in s["by_turn"]}
    a, b = t[1], t[last]
    print(f"{name:<10}{a['median_ttft_ms']:>14.0f} / {a['p99_ttft_ms']:<11.0f}{b['median_ttft_ms']:>14.0f} / {b['p99_ttft_ms']:<11.0f}"
          f"{b['p99_ttft_ms'] / a['p99_ttft_ms']:>9.2f}x{s['median_session_ms'] / 1e3:>12.1f} / {s['p99_session_ms'] / 1e3:<8.1f}"
          f"{s['completed']:>6}/{s['num_sessions']}")
PY
