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

# The demo on embedded defaults: the lab (prefix demo) with switchd, three
# hostagents, the API + dashboard on http://127.0.0.1:8080 and a skewed
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

# ---- benchmarks (last line of each: RESULT key=value ...) ----
.PHONY: bench-stack bench-switch

# HTTP/1.1 keep-alive req/s and latency: user-space stack vs Linux kernel TCP.
bench-stack: $(STAMP)
	@bash bench/scripts/bench-stack.sh

# Data-plane packets/s, plain vs migrated flows, 1M flows / 200K migrated entries.
bench-switch: $(STAMP)
	@$(CARGO) run --release -q -p capybara-switchd --bin bench-switch

.PHONY: bench-export-import
# Connection snapshot export+import vs Linux TCP_REPAIR dump+restore.
bench-export-import: $(STAMP)
	@$(CARGO) run --release -q -p capybara-bench-export-import

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
