#!/usr/bin/env bash
# `make demo`: brings up the lab on embedded defaults and keeps it until
# Ctrl-C, then tears it down.
set -euo pipefail
cd "$(dirname "$0")/.."
CAPYBARA=target/release/capybara
PREFIX=${CAPYBARA_LAB_PREFIX:-cpb}
cleanup() { "$CAPYBARA" lab down --prefix "$PREFIX" || true; }
trap cleanup EXIT INT TERM
"$CAPYBARA" lab up --prefix "$PREFIX" --servers 3
"$CAPYBARA" lab status --prefix "$PREFIX"
cat <<TXT

The lab is up: one client (c1), the switch (sw) and three servers (s1..s3),
each in its own network namespace. Try:
  $CAPYBARA lab exec c1 -- ping -c 3 198.18.1.11
  $CAPYBARA lab fault c1 --drop 5%        # eBPF loss injector
  $CAPYBARA lab exec sw -- ip route
Press Ctrl-C (or run \`make demo-stop\` elsewhere) to tear it down.
TXT
if [ -n "${CAPYBARA_DEMO_SECONDS:-}" ]; then
  sleep "$CAPYBARA_DEMO_SECONDS"
else
  while true; do sleep 3600; done
fi
