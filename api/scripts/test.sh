#!/usr/bin/env bash
# The API's whole test run, for `make test`: builds capybara-api, runs the
# Rust tests, starts the server on a free loopback port with a temp SQLite
# store, runs pytest (generated Python client), schemathesis with and without
# a token, and the generated-code check; stops the server; non-zero on any
# failure.
set -uo pipefail
API_DIR="$(cd "$(dirname "$0")/.." && pwd)"
ROOT="$(cd "$API_DIR/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$ROOT/target}"
cd "$ROOT"
fail=0
step() { echo "=== api: $*"; }

step "python client dependencies"
"$VENV/bin/python" -c 'import pydantic, dateutil' 2>/dev/null \
  || "$VENV/bin/pip" install -q -r "$API_DIR/clients/python/requirements.txt" || exit 1

if [ -n "${CAPYBARA_API_BIN:-}" ]; then
  # `make test` already ran the Rust tests and built the release binary.
  BIN="$CAPYBARA_API_BIN"
else
  step "cargo test -p capybara-api"
  cargo test -p capybara-api || fail=1
  cargo build -p capybara-api --bins || exit 1
  BIN="$CARGO_TARGET_DIR/debug/capybara-api"
fi

step "pytest api/tests"
CAPYBARA_API_BIN="$BIN" "$VENV/bin/pytest" -q "$API_DIR/tests" || fail=1

WORK="$(mktemp -d)"
"$BIN" --store "sqlite:$WORK/store.db" --listen 127.0.0.1:0 --admin-token-file "$WORK/admin.token" \
  >"$WORK/stdout" 2>"$WORK/server.log" &
PID=$!
trap 'kill $PID 2>/dev/null; wait $PID 2>/dev/null; rm -rf "$WORK"' EXIT
URL=""
for _ in $(seq 1 100); do
  URL="$(grep -o 'http://[0-9.:]*' "$WORK/stdout" 2>/dev/null | head -1)"
  [ -n "$URL" ] && break
  sleep 0.1
done
if [ -z "$URL" ]; then echo "capybara-api did not start:"; cat "$WORK/server.log"; exit 1; fi
TOKEN="$(cat "$WORK/admin.token")"
ST=("$VENV/bin/schemathesis" --config-file "$API_DIR/schemathesis.toml" run "$API_DIR/openapi.yaml" --url "$URL"
    --exclude-path /v1/events --workers 1 --suppress-health-check all)
# Every check is enabled by default; api/schemathesis.toml lists the few
# per-operation exceptions with their reasons (a CLI --checks would override it).

step "schemathesis with an admin token ($URL)"
"${ST[@]}" -H "Authorization: Bearer $TOKEN" --max-time "${ST_TIME:-45}" || fail=1
step "schemathesis without a token"
"${ST[@]}" --max-time "${ST_TIME_ANON:-15}" || fail=1

step "generated clients are up to date"
bash "$API_DIR/scripts/check-generated.sh" || fail=1

if [ "$fail" -ne 0 ]; then echo "=== api: FAILED"; else echo "=== api: all passed"; fi
exit "$fail"
