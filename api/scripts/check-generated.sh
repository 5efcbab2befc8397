#!/usr/bin/env bash
# Fails (naming the files) when the committed clients in api/clients are not
# what openapi-generator makes from api/openapi.yaml now.
set -euo pipefail
API_DIR="$(cd "$(dirname "$0")/.." && pwd)"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
bash "$API_DIR/scripts/generate-clients.sh" "$TMP"
stale=0
for lang in python rust; do
  # Compare generated files only (the generator's own FILES list names them).
  while IFS= read -r f; do
    [ -n "$f" ] || continue
    if ! cmp -s "$TMP/$lang/$f" "$API_DIR/clients/$lang/$f"; then
      echo "stale: api/clients/$lang/$f" >&2
      stale=1
    fi
  done < <(cat "$TMP/$lang/.openapi-generator/FILES" "$API_DIR/clients/$lang/.openapi-generator/FILES" 2>/dev/null | sort -u)
done
if [ "$stale" -ne 0 ]; then
  echo "generated clients are stale: run api/scripts/generate-clients.sh and commit api/clients" >&2
  exit 1
fi
echo "generated clients are up to date"
