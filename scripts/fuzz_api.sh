#!/usr/bin/env bash
# Fuzz `tokenfab serve` (the bundled model) from its own /openapi.json with schemathesis: the longer
# run beside tests/test_server_fuzz.py. Passes when no request gets a 5xx and every response matches
# the spec. Needs the test extra (pip install -e ".[test]").
#
#   bash scripts/fuzz_api.sh            # 200 examples per operation (tens of minutes on a busy 2-core VM)
#   EXAMPLES=1000 bash scripts/fuzz_api.sh
set -euo pipefail
cd "$(dirname "$0")/.."
EXAMPLES=${EXAMPLES:-200}
PORT=${PORT:-8917}
LOG=$(mktemp /tmp/tokenfab-fuzz.XXXXXX.log)

# Short context and few choices per request, so a fuzzed max_tokens or n stays cheap.
python3 -m tokenfab.cli serve --port "$PORT" --max-model-len 128 --max-n 4 --max-request-sequences 16 \
    --no-access-log >"$LOG" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 1 240); do
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
    kill -0 $SERVER 2>/dev/null || { echo "the server exited:"; cat "$LOG"; exit 1; }
    sleep 0.5
done

status=0
schemathesis run "http://127.0.0.1:$PORT/openapi.json" \
    --checks not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance \
    --max-examples "$EXAMPLES" --phases examples,fuzzing --request-timeout 120 --workers 1 || status=$?
if grep -q "Traceback" "$LOG"; then
    echo "the server logged tracebacks (see $LOG):"; grep -B2 -A20 "Traceback" "$LOG" | head -60
    status=1
fi
exit $status
