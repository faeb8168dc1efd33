#!/usr/bin/env bash
# gpu_serve_check.sh — the OpenAI-client test of `strata-exec PLAN --serve` on any backend
# (meant for the GPU machine with the CUDA engine): starts the server on PORT, runs
# tests/serve_openai.py against it, stops it with SIGINT and checks it exits 0.
# Invariant: the server it starts is always stopped (trap), and the exit status is non-zero
# when any client check failed, the server never became healthy, or it did not exit 0.
#
# usage: scripts/gpu_serve_check.sh STRATA_EXEC PLAN PORT [extra strata-exec flags...]
#   e.g. scripts/gpu_serve_check.sh target/release/strata-exec tiny-chat-h200.plan 8181
#        scripts/gpu_serve_check.sh target/release/strata-exec big.plan 8181 --backend cuda
# The plan's model needs a tokenizer with a chat template (or pass --tokenizer DIR as an
# extra flag); tests/data/tiny-chat-moe is the small one:
#   strata-plan --model tests/data/tiny-chat-moe --hardware plans/hardware/h200.toml \
#       --max-context 256 --batch 2 --ubatch 8 -o tiny-chat-h200.plan
# Needs python3 with the `openai` and `jsonschema` packages (pip install openai jsonschema).
set -euo pipefail

if [ $# -lt 3 ]; then
    sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
fi
BIN=$1
PLAN=$2
PORT=$3
shift 3
ROOT=$(cd "$(dirname "$0")/.." && pwd)
KEY=test-key
LOG=$(mktemp -t strata-serve-XXXXXX.log)

"$BIN" "$PLAN" --serve --host 127.0.0.1 --port "$PORT" --api-key "$KEY" \
    --model-name strata-tiny --max-body 65536 --queue 8 --shutdown-grace 5 "$@" \
    >"$LOG" 2>&1 &
PID=$!
stop_server() {
    if kill -0 "$PID" 2>/dev/null; then
        kill -INT "$PID" 2>/dev/null || true
        for _ in $(seq 1 100); do
            kill -0 "$PID" 2>/dev/null || break
            sleep 0.1
        done
        kill -KILL "$PID" 2>/dev/null || true
    fi
}
trap stop_server EXIT

echo "== server: $BIN $PLAN --serve --port $PORT $* (log: $LOG)"
# Loading a large model takes a while: wait up to 10 minutes for /health.
for i in $(seq 1 6000); do
    if ! kill -0 "$PID" 2>/dev/null; then
        echo "the server exited before it was ready:"; cat "$LOG"; exit 1
    fi
    if python3 -c "import urllib.request,sys; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:$PORT/health', timeout=2).status == 200 else 1)" 2>/dev/null; then
        break
    fi
    if [ "$i" = 6000 ]; then echo "the server never became healthy:"; cat "$LOG"; exit 1; fi
    sleep 0.1
done
grep -m1 "ready on" "$LOG" || true

status=0
python3 "$ROOT/tests/serve_openai.py" --url "http://127.0.0.1:$PORT" --api-key "$KEY" \
    --model strata-tiny --max-body 65536 || status=$?

echo "== SIGINT"
kill -INT "$PID"
code=0
wait "$PID" || code=$?
trap - EXIT
if [ "$code" -ne 0 ]; then
    echo "FAIL the server exited $code after SIGINT"; tail -20 "$LOG"; exit 1
fi
echo "ok   the server exited 0 after SIGINT"
tail -3 "$LOG"
exit "$status"
