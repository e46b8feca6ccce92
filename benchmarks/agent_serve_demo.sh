#!/usr/bin/env bash
# `cartspec serve` end to end, as the README shows it: start, ask, Ctrl-C, check nothing is left.
# Run alone on a shared machine:  flock /tmp/cartspec-heavy.lock bash benchmarks/agent_serve_demo.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/agent-serve-demo}
PORT=${PORT:-8080}
mkdir -p "$OUT"
CARTSPEC=${CARTSPEC:-.venv/bin/cartspec}
start=$(date +%s)
$CARTSPEC serve --port "$PORT" --trace "$OUT/trace.jsonl" --log-dir "$OUT/logs" "$@" > "$OUT/serve.log" 2>&1 &
SERVE=$!
trap 'kill -INT $SERVE 2>/dev/null || true' EXIT
until curl -sf "http://127.0.0.1:$PORT/ready" > /dev/null; do
  kill -0 $SERVE 2>/dev/null || { echo "serve exited:"; cat "$OUT/serve.log"; exit 1; }
  sleep 1
done
echo "ready after $(( $(date +%s) - start )) s"
ask() {  # endpoint, json body
  echo "\$ curl -s http://127.0.0.1:$PORT/v1/$1 -H 'content-type: application/json' -d '$2'"
  curl -s -D "$OUT/headers-$1.txt" "http://127.0.0.1:$PORT/v1/$1" -H 'content-type: application/json' -d "$2"
  echo
  grep -i -E '^(x-cartspec|server-timing)' "$OUT/headers-$1.txt" || true
}
ask search '{"query": "red trail runners under $120, size 10, no nike"}'
ask search '{"query": "red trail runners under $120, size 10, no nike"}'
ask support '{"query": "where is my order AB12345?"}'
ask search '{"query": ""}'
curl -s "http://127.0.0.1:$PORT/metrics" > "$OUT/metrics.txt"
VPORT=$(grep -o 'vLLM ready at http://127.0.0.1:[0-9]*' "$OUT/serve.log" | grep -o '[0-9]*$')
LEADER=$(pgrep -f -- "--port $VPORT" | head -1)
VLLM_PIDS=$(pgrep -g "$LEADER" | tr '\n' ' ' || true)  # the API server's group: engine workers too
echo "vLLM pids while serving: $VLLM_PIDS"
kill -INT $SERVE
wait $SERVE || true
trap - EXIT
sleep 2
LEFT=""
for p in $VLLM_PIDS; do kill -0 "$p" 2>/dev/null && LEFT="$LEFT $p"; done
echo "after Ctrl-C, vLLM processes left: ${LEFT:-none}"
