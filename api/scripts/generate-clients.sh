#!/usr/bin/env bash
# Generates the Python and Rust clients from api/openapi.yaml into OUT_DIR
# (default: api/clients, i.e. regenerates the committed code in place).
# Usage: api/scripts/generate-clients.sh [OUT_DIR]
set -euo pipefail
API_DIR="$(cd "$(dirname "$0")/.." && pwd)"
ROOT="$(cd "$API_DIR/.." && pwd)"
OUT="${1:-$API_DIR/clients}"
GEN="${OPENAPI_GENERATOR:-$ROOT/.venv/bin/openapi-generator-cli}"
mkdir -p "$OUT/python" "$OUT/rust"
cp "$API_DIR/clients/python/.openapi-generator-ignore" "$OUT/python/" 2>/dev/null || true
cp "$API_DIR/clients/rust/.openapi-generator-ignore" "$OUT/rust/" 2>/dev/null || true
"$GEN" generate -i "$API_DIR/openapi.yaml" -g python -o "$OUT/python" \
  --package-name capybara_client \
  --additional-properties=packageVersion=1.0.0,projectName=capybara-client >/dev/null
"$GEN" generate -i "$API_DIR/openapi.yaml" -g rust -o "$OUT/rust" \
  --package-name capybara-api-client \
  --additional-properties=packageVersion=1.0.0,reqwestDefaultFeatures=,supportAsync=true,avoidBoxedModels=true >/dev/null
# The Rust client is committed as `cargo fmt` leaves it, so that formatting
# the workspace never touches generated code (rustfmt follows the modules).
rustfmt --edition "$(sed -n 's/^edition = "\(.*\)"/\1/p' "$OUT/rust/Cargo.toml")" "$OUT/rust/src/lib.rs"
