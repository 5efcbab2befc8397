#!/usr/bin/env bash
# The whole test suite: formatting, every crate's unit, property and fuzz
# tests, and the system tests in the lab (real namespaces, real Linux
# clients, real etcd). Lab tests need root; they use unique name prefixes
# and clean up after themselves. Everything runs on the release profile, so
# the binaries `make setup` built are the ones under test and nothing is
# compiled twice.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p test-output
echo "== cargo fmt --check (workspace members; the generated API client is left as generated)"
members=$(cargo metadata --no-deps --format-version 1 | python3 -c 'import json,sys; print(" ".join("-p " + p["name"] for p in json.load(sys.stdin)["packages"] if p["name"] != "capybara-api-client"))')
# shellcheck disable=SC2086
cargo fmt $members -- --check
echo "== build (release)"
cargo build --release --workspace --bins
status=0
echo "== cargo test (workspace, release)"
cargo test --release --workspace --no-fail-fast 2>&1 | tee test-output/cargo-test.log || status=1
echo "== REST API: pytest on the generated client, schemathesis, generated-code check"
CAPYBARA_API_BIN="$PWD/target/release/capybara-api" bash api/scripts/test.sh 2>&1 | tee test-output/api.log || status=1
echo "== dashboard in a real browser (playwright + chromium)"
bash web-ui/build.sh
CAPYBARA_API_BIN="$PWD/target/release/capybara-api" bash web-ui/test.sh 2>&1 | tee test-output/web-ui.log || status=1
exit $status
