#!/usr/bin/env bash
# tokenfab serve against llama.cpp's llama-server on the speculative workloads (benchmarks/speculative_http.py),
# each server plain and with its own speculative decoding, one server at a time on the same cores.
#
#   ../shared/anchors/llama-server.sh build          # once: llama.cpp from the llama-cpp-python sdist
#   benchmarks/speculative_vs_llama.sh [TOKENS]      # default 48 new tokens per request
#
# llama-server's speculative options in that build (common/arg.cpp): --spec-type with ngram-simple
# (prompt lookup: --spec-ngram-simple-size-n N, the lookup n-gram; --spec-ngram-simple-size-m M, the
# draft length), ngram-map-k / ngram-map-k4v / ngram-mod / ngram-cache, and draft-simple with
# --spec-draft-model FILE (a separate draft model; -md) and --spec-draft-n-max N. The old --draft /
# --draft-max flags are removed there. We compare ngram (ours: prompt lookup, k=4) with ngram-simple
# (n=4, m=4), and the draft method with the bundled model drafting for itself on both sides (an
# upper bound on acceptance, not a realistic pairing: no smaller model with SmolLM2's vocabulary
# ships here).
set -euo pipefail
cd "$(dirname "$0")/.."
TOKENS="${1:-48}"; THREADS="$(nproc)"
ANCHORS="$(cd ../shared/anchors 2>/dev/null && pwd || echo /work/shared/anchors)"
BIN="${ANCHORS_DIR:-$HOME/.cache/tokenfab-anchors}/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-server"
[ -x "$BIN" ] || { echo "no llama-server at $BIN: run $ANCHORS/llama-server.sh build first" >&2; exit 2; }
GGUF="$("$ANCHORS/llama-server.sh" path)"
PORT=8765; OUT="${OUT:-speculative_vs_llama.jsonl}"; : > "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

wait_up() { for _ in $(seq 600); do curl -sf "http://127.0.0.1:$PORT/v1/models" >/dev/null && return 0; sleep 1; done
            echo "server on $PORT did not come up" >&2; return 1; }
run() {  # label, then the server command
  local label="$1"; shift
  "$@" > "/tmp/spec_vs_llama_$label.log" 2>&1 & local pid=$!
  wait_up && python3 benchmarks/speculative_http.py --url "http://127.0.0.1:$PORT" --label "$label" \
      --tokens "$TOKENS" | tee -a "$OUT"
  kill "$pid"; wait "$pid" 2>/dev/null || true
}
NG='{"method": "ngram", "num_speculative_tokens": 4}'
DR="{\"method\": \"draft\", \"model\": \"$GGUF\", \"num_speculative_tokens\": 4}"
run tokenfab-plain  python3 -m tokenfab serve --port $PORT --num-threads "$THREADS"
run tokenfab-ngram  python3 -m tokenfab serve --port $PORT --num-threads "$THREADS" --speculative-config "$NG"
run tokenfab-draft  python3 -m tokenfab serve --port $PORT --num-threads "$THREADS" --speculative-config "$DR"
LS=("$BIN" -m "$GGUF" -t "$THREADS" -tb "$THREADS" -np 8 -c 8192 --host 127.0.0.1 --port $PORT)
run llama-plain     "${LS[@]}"
run llama-ngram     "${LS[@]}" --spec-type ngram-simple --spec-ngram-simple-size-n 4 --spec-ngram-simple-size-m 4
run llama-draft     "${LS[@]}" --spec-type draft-simple --spec-draft-model "$GGUF" --spec-draft-n-max 4
echo "results: $OUT (output tok/s, 1 stream and 8 concurrent; the machine's other load shows in every number)"
