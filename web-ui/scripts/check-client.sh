#!/usr/bin/env bash
# Fails when src/generated differs from what api/openapi.yaml generates now.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
bash "$here/scripts/gen-client.sh" "$tmp/generated"
if ! diff -r -u "$here/src/generated" "$tmp/generated" >"$tmp/diff"; then
    head -50 "$tmp/diff" >&2
    echo "check-client: web-ui/src/generated is stale; run web-ui/scripts/gen-client.sh and commit" >&2
    exit 1
fi
echo "check-client: web-ui/src/generated matches api/openapi.yaml"
