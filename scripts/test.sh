#!/usr/bin/env bash
# The whole test suite: formatting, every crate's unit, property, fuzz and
# lab tests. Lab tests need root (network namespaces, eBPF); they use unique
# name prefixes and clean up after themselves.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p test-output
echo "== cargo fmt --check"
cargo fmt --all -- --check
echo "== cargo test (workspace)"
cargo test --workspace --no-fail-fast 2>&1 | tee test-output/cargo-test.log
