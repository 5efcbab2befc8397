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
echo "== cargo fmt --check (the whole workspace; the generated API client is committed formatted)"
cargo fmt --all -- --check
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
echo "== docker compose deployment (make test-compose; only where a Docker engine runs)"
if docker info >/dev/null 2>&1; then
  bash tests/compose/run.sh 2>&1 | tee test-output/compose.log || status=1
else
  echo "skipped: no Docker engine here (docker info failed)"
fi
echo "== experiment harness (bench/experiments): unit tests, no lab"
.venv/bin/python -m pytest -p no:cacheprovider bench/experiments/tests -q 2>&1 | tee test-output/experiments.log || status=1
exit $status
