#!/usr/bin/env bash
# One capybara-mode bench-maintenance run with a system-wide perf recording
# (cpu-clock, 4 kHz per CPU, CLOCK_MONOTONIC timestamps) of the whole run,
# for bin_attribution.py. Root; needs `perf` (Debian: linux-perf).
# usage: bench/maintenance/scripts/traced_run.sh OUT_DIR   (from the repo root,
# after `cargo build --release -p capybara-bench-maintenance` and the lab
# binaries; CAPYBARA_BIN_DIR as for the bench)
set -euo pipefail
out=${1:?usage: traced_run.sh OUT_DIR}
mkdir -p "$out"
run_dir=test-output/bench-maintenance-capybara
rm -f "$run_dir/pids"
CAPYBARA_BENCH_MODES=capybara timeout 120 target/release/bench-maintenance >"$out/bench.out" 2>&1 &
bench=$!
# Start recording once the lab is up (the bench writes the pids then).
for _ in $(seq 1 600); do [ -s "$run_dir/pids" ] && break; sleep 0.05; done
perf record -q -a -F 4000 -k CLOCK_MONOTONIC -o "$out/perf.data" -- sleep 4.6 >/dev/null 2>&1 || true
wait "$bench"
cp -a "$run_dir/." "$out/"
tail -n 1 "$out/bench.out"
