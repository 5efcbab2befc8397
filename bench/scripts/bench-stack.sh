#!/usr/bin/env bash
# make bench-stack: HTTP/1.1 keep-alive requests/s and latency against the
# user-space stack and against the same HTTP server on Linux kernel TCP, in
# the same lab, same run, same client (wrk in the client namespace).
# Last line: RESULT stack_rps=... kernel_rps=... rps_ratio=... stack_p99_us=... kernel_p99_us=...
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=target/release
DURATION=${BENCH_DURATION:-10}
CONNS=${BENCH_CONNECTIONS:-50}
P=bst$$
OUT=test-output/bench-stack; mkdir -p "$OUT"
cleanup() { "$BIN/capybara" lab down --prefix "$P" >/dev/null 2>&1 || true; }
trap cleanup EXIT
"$BIN/capybara" lab up --prefix "$P" --servers 1 >/dev/null
cat > "$OUT/hostagent.toml" <<TOML
name = "s1"
[interface]
name = "eth0"
poll = "${STACK_POLL:-sleep}"
[stack]
address = "198.18.2.11"
gateway = "198.18.1.1"
[[service]]
listen = "198.18.2.11:80"
app = "http"
TOML
wait_up() { # url
  for _ in $(seq 100); do
    ip netns exec "$P-c1" curl -s -m 1 -o /dev/null "$1" && return 0
    sleep 0.1
  done
  echo "bench-stack: $1 did not come up" >&2; return 1
}
run_wrk() { # url -> "rps p50_us p99_us"
  local out; out=$(ip netns exec "$P-c1" wrk -t1 -c"$CONNS" -d"${DURATION}s" --latency "$1")
  echo "$out" >&2
  echo "$out" | awk '
    function us(v) { if (v ~ /us$/) return v+0; if (v ~ /ms$/) return (v+0)*1000; if (v ~ /s$/) return (v+0)*1000000; return v }
    /Requests\/sec/ { rps=$2 } $1=="50%" { p50=us($2) } $1=="99%" { p99=us($2) }
    END { printf "%d %d %d\n", rps, p50, p99 }'
}
# Each server runs alone during its measurement, so neither steals the
# other's CPU (the lab's nodes share the machine's cores).
echo "== user-space stack (hostagent, AF_PACKET) at http://198.18.2.11/" >&2
ip netns exec "$P-s1" "$BIN/hostagent" --config "$OUT/hostagent.toml" > "$OUT/hostagent.log" 2>&1 &
pid=$!
wait_up http://198.18.2.11/
read -r s_rps s_p50 s_p99 < <(run_wrk http://198.18.2.11/)
kill "$pid"; wait "$pid" 2>/dev/null || true
echo "== Linux kernel TCP (same server code) at http://198.18.1.11:8080/" >&2
ip netns exec "$P-s1" "$BIN/capybara-kernel-http" 198.18.1.11:8080 s1 > "$OUT/kernel.log" 2>&1 &
pid=$!
wait_up http://198.18.1.11:8080/
read -r k_rps k_p50 k_p99 < <(run_wrk http://198.18.1.11:8080/)
kill "$pid"; wait "$pid" 2>/dev/null || true
ratio=$(awk -v a="$s_rps" -v b="$k_rps" 'BEGIN { printf "%.3f", (b > 0 ? a / b : 0) }')
echo "stack: ${s_rps} req/s p50=${s_p50}us p99=${s_p99}us; kernel: ${k_rps} req/s p50=${k_p50}us p99=${k_p99}us"
echo "RESULT stack_rps=$s_rps kernel_rps=$k_rps rps_ratio=$ratio stack_p50_us=$s_p50 kernel_p50_us=$k_p50 stack_p99_us=$s_p99 kernel_p99_us=$k_p99"
