#!/usr/bin/env bash
# make bench-stack: HTTP/1.1 keep-alive requests/s and latency against the
# user-space stack and against the same HTTP server on Linux kernel TCP, in
# the same lab, same run, same client (wrk in the client namespace).
#
# The lab shares two cores with everything else on the machine, so one run
# of each side mostly measures the load of the moment. The sides therefore
# alternate in BENCH_ROUNDS paired rounds (S K, K S, S K, ...), each
# BENCH_DURATION seconds; rps and latencies are the medians over rounds and
# rps_ratio the median of the per-round ratios. CPU time per request (user +
# system of the server process, including the softirq work the kernel
# charges to it) is summed over the rounds: it is the steadier measure of
# cost when the machine is loaded.
# Last line: RESULT stack_rps=... kernel_rps=... rps_ratio=... stack_p50_us=...
#   kernel_p50_us=... stack_p99_us=... kernel_p99_us=... stack_cpu_us_per_req=...
#   kernel_cpu_us_per_req=... rounds=...
set -euo pipefail
cd "$(dirname "$0")/../.."
# Binaries: BENCH_BIN, else $CARGO_TARGET_DIR/release, else target/release.
BIN=${BENCH_BIN:-${CARGO_TARGET_DIR:-target}/release}
DURATION=${BENCH_DURATION:-5}
ROUNDS=${BENCH_ROUNDS:-3}
CONNS=${BENCH_CONNECTIONS:-50}
P=bst$$
OUT=test-output/bench-stack; mkdir -p "$OUT"
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -CONT "$p" 2>/dev/null; kill "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  "$BIN/capybara" lab down --prefix "$P" >/dev/null 2>&1 || true
}
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
TCK=$(getconf CLK_TCK)
cpu_ticks() { awk '{ print $14 + $15 }' "/proc/$1/stat"; }
run_wrk() { # pid url -> "rps p50_us p99_us requests cpu_ticks"
  local c0 out c1
  c0=$(cpu_ticks "$1")
  out=$(ip netns exec "$P-c1" wrk -t1 -c"$CONNS" -d"${DURATION}s" --latency "$2")
  c1=$(cpu_ticks "$1")
  echo "$out" >&2
  echo "$out" | awk -v cpu=$((c1 - c0)) '
    function us(v) { if (v ~ /us$/) return v+0; if (v ~ /ms$/) return (v+0)*1000; if (v ~ /s$/) return (v+0)*1000000; return v }
    /Requests\/sec/ { rps=$2 } $1=="50%" { p50=us($2) } $1=="99%" { p99=us($2) }
    / requests in / { n=$1 }
    END { printf "%d %d %d %d %d\n", rps, p50, p99, n, cpu }'
}
# Both servers run for the whole benchmark; the one not being measured is
# stopped (SIGSTOP), so it neither competes for the cores nor wakes for the
# other's frames (the stack's AF_PACKET socket taps every frame on eth0).
echo "== user-space stack (hostagent, AF_PACKET) at http://198.18.2.11/" >&2
ip netns exec "$P-s1" "$BIN/hostagent" --config "$OUT/hostagent.toml" > "$OUT/hostagent.log" 2>&1 &
spid=$!; pids+=("$spid")
echo "== Linux kernel TCP (same server code) at http://198.18.1.11:8080/" >&2
ip netns exec "$P-s1" "$BIN/capybara-kernel-http" 198.18.1.11:8080 s1 > "$OUT/kernel.log" 2>&1 &
kpid=$!; pids+=("$kpid")
wait_up http://198.18.2.11/
wait_up http://198.18.1.11:8080/
: > "$OUT/rounds"
for r in $(seq "$ROUNDS"); do
  order="stack kernel"; [ $((r % 2)) -eq 0 ] && order="kernel stack"
  for side in $order; do
    echo "== round $r: $side" >&2
    if [ "$side" = stack ]; then
      kill -STOP "$kpid"; kill -CONT "$spid"
      read -r rps p50 p99 n cpu < <(run_wrk "$spid" http://198.18.2.11/)
    else
      kill -STOP "$spid"; kill -CONT "$kpid"
      read -r rps p50 p99 n cpu < <(run_wrk "$kpid" http://198.18.1.11:8080/)
    fi
    echo "$r $side $rps $p50 $p99 $n $cpu" >> "$OUT/rounds"
  done
done
kill -CONT "$spid" "$kpid" 2>/dev/null || true
kill -0 "$spid" 2>/dev/null || { echo "bench-stack: hostagent died:" >&2; cat "$OUT/hostagent.log" >&2; exit 1; }
# Medians over rounds; CPU per request over all rounds.
summary=$(awk -v tck="$TCK" '
  function median(a, k,   i, j, t) {
    for (i = 2; i <= k; i++) { t = a[i]; for (j = i - 1; j >= 1 && a[j] > t; j--) a[j+1] = a[j]; a[j+1] = t }
    return (k % 2) ? a[(k+1)/2] : (a[k/2] + a[k/2+1]) / 2
  }
  { side[$1, $2] = $3; rps[$2, ++k[$2]] = $3; p50[$2, k[$2]] = $4; p99[$2, k[$2]] = $5
    n[$2] += $6; cpu[$2] += $7; rounds[$1] = 1 }
  END {
    for (s in k) ; # touch
    split("stack kernel", sides, " ")
    for (si = 1; si <= 2; si++) {
      s = sides[si]
      for (i = 1; i <= k[s]; i++) { a[i] = rps[s, i] } ; mr[s] = median(a, k[s])
      for (i = 1; i <= k[s]; i++) { a[i] = p50[s, i] } ; m50[s] = median(a, k[s])
      for (i = 1; i <= k[s]; i++) { a[i] = p99[s, i] } ; m99[s] = median(a, k[s])
      cpr[s] = n[s] > 0 ? cpu[s] * 1000000 / tck / n[s] : 0
    }
    m = 0; for (r in rounds) if (side[r, "kernel"] > 0) b[++m] = side[r, "stack"] / side[r, "kernel"]
    printf "%d %d %.3f %d %d %d %d %.1f %.1f %d\n", mr["stack"], mr["kernel"], m ? median(b, m) : 0,
      m50["stack"], m50["kernel"], m99["stack"], m99["kernel"], cpr["stack"], cpr["kernel"], m
  }' "$OUT/rounds")
read -r s_rps k_rps ratio s_p50 k_p50 s_p99 k_p99 s_cpu k_cpu rounds <<< "$summary"
echo "rounds (round side rps p50_us p99_us requests cpu_ticks):" && cat "$OUT/rounds"
echo "stack: ${s_rps} req/s p50=${s_p50}us p99=${s_p99}us cpu=${s_cpu}us/req; kernel: ${k_rps} req/s p50=${k_p50}us p99=${k_p99}us cpu=${k_cpu}us/req (medians of $rounds rounds; load: $(cut -d' ' -f1-3 /proc/loadavg))"
echo "RESULT stack_rps=$s_rps kernel_rps=$k_rps rps_ratio=$ratio stack_p50_us=$s_p50 kernel_p50_us=$k_p50 stack_p99_us=$s_p99 kernel_p99_us=$k_p99 stack_cpu_us_per_req=$s_cpu kernel_cpu_us_per_req=$k_cpu rounds=$rounds"
