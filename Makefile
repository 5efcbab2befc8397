# Capybara: the commands that matter.
#   make demo   set up (if needed) and run the demo on embedded defaults
#   make test   the whole test suite (what CI runs, via .ci/run)
# Benchmarks: one `bench-NAME` target each; the last line they print is
# `RESULT key=value ...`.

SHELL := /bin/bash
CARGO ?= cargo
export CARGO_TERM_COLOR ?= never
CAPYBARA := target/release/capybara
STAMP := target/.setup-done

.PHONY: setup build demo demo-stop test

# Installs what the project needs on a fresh Debian machine, then builds.
# Idempotent: a second run installs nothing.
setup:
	@bash scripts/setup.sh
	@$(MAKE) --no-print-directory build
	@mkdir -p target && touch $(STAMP)

build:
	$(CARGO) build --release --workspace --bins
	bash web-ui/build.sh

$(STAMP):
	@$(MAKE) --no-print-directory setup

# The demo on embedded defaults: the lab (prefix demo) with the appliance
# (`capybara run`: switchd + API + dashboard on http://127.0.0.1:8080), three
# servers running nginx behind the hostagent sidecar, and a skewed
# client load; Ctrl-C (or `make demo-stop`) tears it all down.
demo: $(STAMP)
	@bash scripts/demo.sh

# Stops a running `make demo` (its own teardown), then removes the lab in
# any case (e.g. after the script was killed with SIGKILL).
demo-stop:
	@pid=$$(cat target/demo/demo.pid 2>/dev/null || true); \
	if [ -n "$$pid" ] && grep -qs demo.sh /proc/$$pid/cmdline; then \
	  kill $$pid; for i in $$(seq 1 100); do kill -0 $$pid 2>/dev/null || break; sleep 0.2; done; \
	fi
	@$(CAPYBARA) lab down --prefix $${CAPYBARA_LAB_PREFIX:-demo}

# Everything, as CI runs it.
test: $(STAMP)
	@bash scripts/test.sh

# The docker compose deployment end to end (needs a Docker engine; `make
# test` runs it when `docker info` works): images built locally, compose up,
# k6 across a REST drain, a `docker kill` of the active switchd and a
# stopped etcd member, then compose down leaving nothing behind.
.PHONY: test-compose
test-compose: $(STAMP)
	@bash tests/compose/run.sh

# ---- benchmarks (last line of each: RESULT key=value ...) ----
.PHONY: bench-stack bench-switch

# HTTP/1.1 keep-alive req/s and latency: user-space stack vs Linux kernel TCP.
bench-stack: $(STAMP)
	@bash bench/scripts/bench-stack.sh

# Data-plane packets/s, plain vs migrated flows, 1M flows / 200K migrated entries.
bench-switch: $(STAMP)
	@$(CARGO) run --release -q -p capybara-switchd --bin bench-switch

# Server monitor + policy engine cost with 100,000 connections (docs/POLICIES.md).
.PHONY: bench-monitor
bench-monitor: $(STAMP)
	@$(CARGO) run --release -q -p capybara-hostagent --example monitor_bench

.PHONY: bench-export-import
# Connection snapshot export+import vs Linux TCP_REPAIR dump+restore.
bench-export-import: $(STAMP)
	@$(CARGO) run --release -q -p capybara-bench-export-import

.PHONY: bench-tls-snapshot
# TLS session snapshot export/import (keys, sequence numbers, partial record) and record seal/open throughput: docs/TLS.md.
bench-tls-snapshot: $(STAMP)
	@$(CARGO) run --release -q -p capybara-tls --example snapshot_bench

.PHONY: bench-store
# Batched flow writes per second and batch latency, SQLite and a real etcd.
bench-store: $(STAMP)
	@$(CARGO) run --release -q -p capybara-store --features testing --example bench_store

.PHONY: bench-api
# k6 against the running api: mixed reads/writes at 500 req/s plus 50 SSE streams.
bench-api: $(STAMP)
	@PROFILE=release bash api/scripts/bench.sh

.PHONY: bench-failover
# SIGKILL of the active switchd with established connections: takeover time.
bench-failover: $(STAMP)
	@$(CARGO) run --release -q -p capybara-switchd --bin bench-failover

.PHONY: bench-maintenance
# Drain of a Redis primary (sidecar, TLS) under GET load: 10 ms throughput bins, Capybara drain vs close-and-reconnect, and the drain again under a paced (open-loop) load at CAPYBARA_BENCH_PACE (default 0.5) of the closed-loop rate (root, ~1.5 min).
bench-maintenance: $(STAMP)
	@$(CARGO) build --release -q -p capybara-appliance -p capybara-hostagent -p capybara-switchd --bins
	@$(CARGO) run --release -q -p capybara-bench-maintenance

.PHONY: bench-migration
# TCPMig end to end in the lab: latency by phase and host CPU per migration over >= 10,000 migrations (root, ~30 s; options via BENCH_ARGS).
bench-migration: $(STAMP)
	@$(CARGO) build --release -q -p capybara-appliance -p capybara-hostagent -p capybara-switchd --bins
	@$(CARGO) run --release -q -p capybara-bench-migration -- $(BENCH_ARGS)

# Seed 000 §8.1 experiments in the namespace lab (bench/experiments/, root):
# each writes its plot to docs/img/ and its table to docs/BENCHMARKS.md.
# Extra flags through EXP_ARGS, e.g. EXP_ARGS="--modes lwrr,envoy".
.PHONY: bench-skew bench-step bench-target bench-scale
EXPERIMENT := .venv/bin/python bench/experiments/run.py
# p99 under skewed long-lived load: Capybara vs LWRR vs Envoy (Figure 7; ~10 min).
bench-skew: $(STAMP)
	@$(EXPERIMENT) skew --write-docs $(EXP_ARGS)
# Step-function load on one server: reactive, proactive, both (Figure 8; ~1 min).
bench-step: $(STAMP)
	@$(EXPERIMENT) step --write-docs $(EXP_ARGS)
# Round-robin vs least-loaded migration targets (Figure 17; ~2 min).
bench-target: $(STAMP)
	@$(EXPERIMENT) target --write-docs $(EXP_ARGS)
# Peak throughput under Zipf 1.2 as servers grow (Figure 10; ~5 min).
bench-scale: $(STAMP)
	@$(EXPERIMENT) scale --write-docs $(EXP_ARGS)
