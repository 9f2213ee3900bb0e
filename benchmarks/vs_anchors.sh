#!/usr/bin/env bash
# tokenfab serve against the anchors: llama.cpp's llama-server (the bundled Q4_1 GGUF) and, when it
# is built, vLLM for CPU (a bf16 copy of the same weights, served as bf16 and as float32); same load generator (tokenfab bench
# serve), one server after the other on this machine:
#   1 stream       4 requests, 128-token prompts, 128 output tokens, one at a time
#   C streams     2C requests, same lengths, C in flight, for C in $CONC (default: 8 32 64); each level's
#                 prompts are its own (seed 3 + C), so no level hits the prefix cache of the one before
#   prefill        4 requests, 512-token prompts, 1 output token, one at a time (prefill tok/s = 512/TTFT)
#   warm prefix    6 requests of 1,016 tokens sharing their first 1,000, one at a time, after a warm-up
#                  request that fills the prefix (bench's --dataset shared-prefix): TTFT of a prefix hit
# and for each server the seconds from launch until /health answers, and its VmRSS after the runs and
# VmHWM (the peak) from /proc (the memory table at the end). With MODEL, both servers hold the same slots
# and context: llama-server -np 32 -c 65536, tokenfab --max-num-seqs 32 and 65,536 tokens of KV blocks.
# Needs llama-server built first: ../shared/anchors/llama-server.sh build (about 6 minutes);
# vLLM is measured only if ../shared/anchors/vllm-cpu.sh build has run (about 500 MB of downloads)
# and VLLM is not 0. VLLM=fp32 measures only its float32 run, VLLM=bf16 only its bf16 run (the anchor's
# setting on CPUs with bf16 units: avx512_bf16 / amx_bf16), anything else both.
#   bash benchmarks/vs_anchors.sh [OUT_DIR]
#   VLLM=0 bash benchmarks/vs_anchors.sh [OUT_DIR]      # llama.cpp and tokenfab only
#   INT8ACT=1 bash benchmarks/vs_anchors.sh [OUT_DIR]   # also tokenfab --int8-activations
#   LLAMA=0 BASELINE=/tmp/old-checkout bash benchmarks/vs_anchors.sh [OUT_DIR]   # no llama.cpp; old tokenfab first
#   MODEL=gemma3-270m CONC=32 bash benchmarks/vs_anchors.sh [OUT_DIR]
#       another GGUF (any name or path `tokenfab serve MODEL` takes) in both llama-server and tokenfab;
#       vLLM is skipped (its anchor serves SmolLM2 only). THREADS=N runs both servers on N threads (on a
#       loaded 2-core VM llama.cpp's 2-thread barrier decoded Gemma 3 at 0.3 tok/s); NREQ=N sends N
#       requests per level of C > 1 streams instead of 2C, OUTLEN=N asks N output tokens instead of 128
set -euo pipefail
# llama.cpp's AMX kernels (chosen through weight repacking where the CPU reports AMX) die with SIGILL on
# VMs that report AMX but do not enable its tile state; LLAMA_ARG_REPACK=0 (--no-repack) avoids them.
OUT=${1:-/tmp/tokenfab-vs-anchors}
ANCHORS=${ANCHORS:-$(dirname "$0")/../../shared/anchors}
ANCHORS_DIR=${ANCHORS_DIR:-$HOME/.cache/tokenfab-anchors}
mkdir -p "$OUT"
PORT=8765

# Waits for the server started last ($PID); stops the script at once if it died (a crash, a bad flag).
T0=0
started() { T0=$(date +%s.%N); }
wait_up() {  # NAME
  for _ in $(seq 1200); do curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && {
                                        echo "$(date +%s.%N) - $T0" | bc >"$OUT/$1-up-s.txt"; return; }
                                      kill -0 "$PID" 2>/dev/null || { echo "server exited: see $OUT/*.log" >&2; exit 1; }
                                      sleep 0.5; done; exit 1; }
CONC=(1 ${CONC:-8 32 64})
add_label() { LABELS=${LABELS:+$LABELS,}$1; }
load() {  # NAME
  for c in "${CONC[@]}"; do
    n=$([ "$c" = 1 ] && echo 4 || echo "${NREQ:-$((2 * c))}")
    tokenfab bench serve --base-url "http://127.0.0.1:$PORT" --num-prompts "$n" --max-concurrency "$c" \
      --input-len 128 --output-len "${OUTLEN:-128}" --no-progress --seed $((3 + c)) --out "$OUT/$1-c$c.json" >/dev/null
  done
  tokenfab bench serve --base-url "http://127.0.0.1:$PORT" --num-prompts 4 --max-concurrency 1 \
    --input-len 512 --output-len 1 --no-progress --seed 5 --out "$OUT/$1-prefill.json" >/dev/null
  tokenfab bench serve --base-url "http://127.0.0.1:$PORT" --dataset shared-prefix --num-prefixes 1 \
    --prefix-len 1000 --input-len 16 --output-len 8 --num-prompts 6 --max-concurrency 1 --no-progress --seed 5 \
    --out "$OUT/$1-prefix.json" >/dev/null
  grep -E '^Vm(RSS|HWM)' "/proc/$(largest "$PID")/status" >"$OUT/$1-mem.txt"
}
# the process with the largest VmRSS among PID and its descendants (the anchors' scripts start the server
# as a child; vLLM's engine core is a child of its API server)
descendants() { echo "$1"; for c in $(pgrep -P "$1"); do descendants "$c"; done; }
largest() { for p in $(descendants "$1"); do echo "$(awk '/VmRSS/ {print $2}' "/proc/$p/status" 2>/dev/null || echo 0) $p"
            done | sort -n | tail -1 | cut -d' ' -f2; }
# stop() NAME: stops the server started last; run() NAME: waits for it, runs the loads, stops it
stop() { kill "$PID"; wait "$PID" 2>/dev/null || true; }
run() { wait_up "$1"; load "$1"; stop; }
lscpu | grep -E '^Model name'; grep -m1 -o -E 'avx2|avx512f|avx512_vnni|avx_vnni|avx512_bf16|amx_bf16' /proc/cpuinfo | sort -u | tr '\n' ' '; echo
# The one-stream bandwidth limit: the weight bytes a decode step reads (every tensor of the file but an
# untied token embedding, whose rows are gathered) over this machine's measured read bandwidth.
python3 - "${MODEL:-}" <<'PY'
import sys
import gguf
from tokenfab.files.bundled import resolve_model_path
from tokenfab.plan.probe import ProbeSettings, measure_bandwidth
r = gguf.GGUFReader(resolve_model_path(sys.argv[1] or None))
names = {t.name for t in r.tensors}
step = sum(int(t.n_bytes) for t in r.tensors if t.name != "token_embd.weight" or "output.weight" not in names)
bw = measure_bandwidth(ProbeSettings()) * 1e9
print(f"bandwidth limit: {step / 1e6:,.0f} MB of weights per token at {bw / 1e9:.1f} GB/s read = "
      f"{bw / step:.1f} tok/s for one stream")
PY

MODEL=${MODEL:-}
RUNS=(); LABELS=
# LLAMA=0 skips llama.cpp (on a loaded 2-core VM its 32- and 64-stream runs take ~10 minutes)
if [ "${LLAMA:-1}" != 0 ]; then
  if [ -n "$MODEL" ]; then     # the anchor's build and flags, on the model's own file
    GGUF=$(python3 -c 'import sys; from tokenfab.files.bundled import resolve_model_path as r; print(r(sys.argv[1]))' "$MODEL")
    started; "$ANCHORS_DIR/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-server" -m "$GGUF" -t "${THREADS:-$(nproc)}" -tb "${THREADS:-$(nproc)}" \
      -np 32 -c 65536 --host 127.0.0.1 --port "$PORT" >"$OUT/llama-server.log" 2>&1 & PID=$!
  else
    started; bash "$ANCHORS/llama-server.sh" serve "$PORT" 32 >"$OUT/llama-server.log" 2>&1 & PID=$!
  fi
  run llamacpp
  RUNS=(llamacpp); LABELS=llama.cpp
fi

if [ -z "$MODEL" ] && [ "${VLLM:-1}" != 0 ] && [ -x "$ANCHORS_DIR/vllm-venv/bin/python" ]; then
  if [ "${VLLM:-1}" != fp32 ]; then
    started; bash "$ANCHORS/vllm-cpu.sh" serve "$PORT" >"$OUT/vllm.log" 2>&1 & PID=$!
    run vllm
    RUNS+=(vllm); add_label vLLM-bf16
  fi
  # The anchor serves bf16, which CPUs without bf16 units run slowly; vLLM's float32 is its better
  # setting there, so it is measured too, with the anchor's other flags.
  if [ "${VLLM:-1}" != bf16 ]; then
  started; VLLM_CPU_KVCACHE_SPACE=4 HF_HUB_OFFLINE=1 VLLM_USE_USAGE_STATS=0 DO_NOT_TRACK=1 \
    "$ANCHORS_DIR/vllm-venv/bin/python" -m vllm.entrypoints.openai.api_server --model "$ANCHORS_DIR/smollm2-hf-bf16" \
    --served-model-name smol --host 127.0.0.1 --port "$PORT" --max-model-len 4096 --dtype float32 \
    >"$OUT/vllm-fp32.log" 2>&1 & PID=$!
  run vllm-fp32
  RUNS+=(vllm-fp32); add_label vLLM-fp32
  fi
fi

# BASELINE=DIR first serves the tokenfab checkout in DIR (e.g. `git worktree`/`git archive` of an earlier
# commit) with the same flags: a before/after in one run.
# tokenfab with llama-server's slots and context when MODEL is given (-np 32 -c 65536)
SLOTS=(); [ -n "$MODEL" ] && SLOTS=(--max-num-seqs 32 --num-kv-blocks 4096 --block-size 16)
if [ -n "${BASELINE:-}" ]; then
  started; PYTHONPATH="$BASELINE" tokenfab serve ${MODEL:+"$MODEL"} "${SLOTS[@]}" ${THREADS:+--num-threads "$THREADS"} --port "$PORT" --no-access-log \
    --log-level warning >"$OUT/tokenfab-base.log" 2>&1 & PID=$!
  run tokenfab-base
  RUNS+=(tokenfab-base); add_label tokenfab-baseline
fi
started; tokenfab serve ${MODEL:+"$MODEL"} "${SLOTS[@]}" ${THREADS:+--num-threads "$THREADS"} --port "$PORT" --no-access-log --log-level warning >"$OUT/tokenfab.log" 2>&1 & PID=$!
run tokenfab
RUNS+=(tokenfab); add_label tokenfab
# INT8ACT=1 adds a run with llama.cpp's activation scheme (int8 blocks of 32, --int8-activations; opt-in, docs/quant.md).
if [ "${INT8ACT:-0}" = 1 ]; then
  started; tokenfab serve ${MODEL:+"$MODEL"} "${SLOTS[@]}" ${THREADS:+--num-threads "$THREADS"} --port "$PORT" --no-access-log --log-level warning --int8-activations >"$OUT/tokenfab-i8.log" 2>&1 & PID=$!
  run tokenfab-i8
  RUNS+=(tokenfab-i8); add_label tokenfab-int8act
fi


for c in "${CONC[@]}" prefill prefix; do
  echo "== $c$([[ "$c" = pre* ]] || echo ' stream(s)'): ${LABELS//,/ vs }"
  tokenfab bench compare $(for r in "${RUNS[@]}"; do echo "$OUT/$r-$([[ "$c" = pre* ]] || echo c)$c.json"; done) --labels "$LABELS"
done
echo "== start-up and memory"
printf '%-16s %12s %14s %14s\n' server up_s VmRSS_MiB VmHWM_MiB
for r in "${RUNS[@]}"; do
  printf '%-16s %12.1f %14.0f %14.0f\n' "$r" "$(cat "$OUT/$r-up-s.txt")" \
    "$(awk '/VmRSS/ {print $2 / 1024}' "$OUT/$r-mem.txt")" "$(awk '/VmHWM/ {print $2 / 1024}' "$OUT/$r-mem.txt")"
done
