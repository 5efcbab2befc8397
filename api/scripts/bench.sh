#!/usr/bin/env bash
# `make bench-api`: starts capybara-api on a free loopback port with a temp
# SQLite store, seeds servers, runs api/bench/api.js with k6 (500 req/s mixed
# reads and writes for 30 s plus 50 SSE streams), stops the server. Last line:
#   RESULT api_p99_ms=... api_errors=... sse_clients=...
set -euo pipefail
API_DIR="$(cd "$(dirname "$0")/.." && pwd)"
ROOT="$(cd "$API_DIR/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
K6="${K6:-$(command -v k6 || echo "$VENV/bin/k6")}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$ROOT/target}"
DURATION="${DURATION:-30s}"
cd "$ROOT"
# PROFILE=release for numbers worth comparing (default debug, to spare the
# shared build machine).
PROFILE="${PROFILE:-debug}"
if [ "$PROFILE" = release ]; then
  cargo build -q --release -p capybara-api --bin capybara-api
else
  cargo build -q -p capybara-api --bin capybara-api
fi
BIN="$CARGO_TARGET_DIR/$PROFILE/capybara-api"
WORK="$(mktemp -d)"
"$BIN" --store "sqlite:$WORK/store.db" --listen 127.0.0.1:0 --admin-token-file "$WORK/admin.token" \
  --workers "${WORKERS:-2}" >"$WORK/stdout" 2>"$WORK/server.log" &
PID=$!
trap 'kill $PID 2>/dev/null; wait $PID 2>/dev/null; rm -rf "$WORK"' EXIT
URL=""
for _ in $(seq 1 100); do
  URL="$(grep -o 'http://[0-9.:]*' "$WORK/stdout" 2>/dev/null | head -1 || true)"; [ -n "$URL" ] && break; sleep 0.1
done
[ -n "$URL" ] || { cat "$WORK/server.log"; exit 1; }
TOKEN="$(cat "$WORK/admin.token")"
for i in 1 2 3; do
  curl -sf -o /dev/null -H "Authorization: Bearer $TOKEN" -H 'Content-Type: application/json' \
    -d "{\"name\":\"web$i\",\"mgmt_addr\":\"10.0.1.1$i:7000\",\"data_addr\":\"10.0.2.1$i\"}" "$URL/v1/servers"
done
curl -sf -o /dev/null -H "Authorization: Bearer $TOKEN" -H 'Content-Type: application/json' \
  -d '{"name":"web","vip":"10.0.0.100","port":80,"pool":[1,2,3]}' "$URL/v1/services"
curl -sf -o /dev/null -X POST -H "Authorization: Bearer $TOKEN" -H 'Content-Type: application/json' \
  -d '{"deadline_seconds":5}' "$URL/v1/servers/3/drain"

# Sample the server's open SSE streams in the middle of the run.
( sleep "$(( ${DURATION%s} / 2 ))"; curl -s "$URL/metrics" | awk '/^capybara_api_sse_clients /{print $2}' >"$WORK/sse" ) &
SAMPLER=$!
API_URL="$URL" API_TOKEN="$TOKEN" DURATION="$DURATION" SUMMARY="$WORK/summary.json" \
  "$K6" run --quiet --no-color "$API_DIR/bench/api.js" >"$WORK/k6.log" 2>&1 || { tail -20 "$WORK/k6.log"; }
wait $SAMPLER || true
python3 - "$WORK/summary.json" "$WORK/sse" <<'PY'
import json, sys
m = json.load(open(sys.argv[1]))["metrics"]
dur = m["http_req_duration{scenario:mixed}"]["values"]
failed = m["http_req_failed{scenario:mixed}"]["values"]
reqs = m["http_reqs{scenario:mixed}"]["values"]
errors = round(failed.get("rate", 0) * reqs.get("count", 0))
try:
    sse = int(float(open(sys.argv[2]).read().strip() or 0))
except (OSError, ValueError):
    sse = 0
print(f"mixed: {int(reqs['count'])} requests, {reqs['rate']:.0f}/s, p50 {dur['p(50)']:.2f} ms, p95 {dur['p(95)']:.2f} ms, max {dur['max']:.2f} ms")
print(f"RESULT api_p99_ms={dur['p(99)']:.2f} api_errors={errors} sse_clients={sse}")
PY
