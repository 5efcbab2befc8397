#!/usr/bin/env bash
# Regenerates the TypeScript client in src/generated from api/openapi.yaml
# (the single source of truth of the REST contract) with openapi-generator's
# `typescript-fetch` generator. The output is committed; scripts/check-client.sh
# fails when it is stale.
#   usage: scripts/gen-client.sh [OUT_DIR]   (default: src/generated)
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
root="$(cd "$here/.." && pwd)"
out="${1:-$here/src/generated}"
gen="${OPENAPI_GENERATOR_CLI:-$root/.venv/bin/openapi-generator-cli}"
if [[ ! -x "$gen" ]]; then
    echo "gen-client: openapi-generator-cli not found at $gen (set OPENAPI_GENERATOR_CLI)" >&2
    exit 2
fi
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
# Only the code: no docs, no README, no metadata files that carry a date.
cat > "$tmp/.openapi-generator-ignore" <<'IGN'
docs/**
README.md
.gitignore
.npmignore
.openapi-generator/**
IGN
"$gen" generate \
    -i "$root/api/openapi.yaml" -g typescript-fetch -o "$tmp" \
    --ignore-file-override "$tmp/.openapi-generator-ignore" \
    --additional-properties=supportsES6=true,modelPropertyNaming=original,enumPropertyNaming=original,withInterfaces=false \
    >"$tmp.log" 2>&1 || { cat "$tmp.log" >&2; rm -f "$tmp.log"; exit 1; }
rm -f "$tmp.log"
rm -rf "$out"
mkdir -p "$out"
cp -r "$tmp/apis" "$tmp/models" "$tmp/index.ts" "$tmp/runtime.ts" "$out/"
"$root/.venv/bin/python" "$here/scripts/extract-policy-schema.py" "$root/api/openapi.yaml" "$out/policySchema.ts"
