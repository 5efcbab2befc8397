#!/usr/bin/env bash
# Builds the capybara:local image from the release binaries: the base image
# first (scripts/build-base-image.sh, skipped when it exists), then the
# Dockerfile over a staged build context holding exactly what .dockerignore
# lets through (binaries from CAPYBARA_BIN_DIR, default target/release, or
# $CARGO_TARGET_DIR/release when set).
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
TAG=${CAPYBARA_IMAGE:-capybara:local}
BIN=${CAPYBARA_BIN_DIR:-${CARGO_TARGET_DIR:-$ROOT/target}/release}
for b in capybara switchd hostagent; do
  [ -x "$BIN/$b" ] || { echo "build-image: missing $BIN/$b (run \`make build\`)" >&2; exit 1; }
done
[ -x .venv/bin/k6 ] || { echo "build-image: missing .venv/bin/k6 (run \`make setup\`)" >&2; exit 1; }
[ -f web-ui/dist/index.html ] || { echo "build-image: missing web-ui/dist (bash web-ui/build.sh)" >&2; exit 1; }

bash scripts/build-base-image.sh

STAGE=$(mktemp -d /tmp/capybara-context.XXXXXX)
trap 'rm -rf "$STAGE"' EXIT
mkdir -p "$STAGE/target/release" "$STAGE/.venv/bin" "$STAGE/web-ui"
# Hard links where possible: the binaries are large.
for b in capybara switchd hostagent; do
  ln "$BIN/$b" "$STAGE/target/release/$b" 2>/dev/null || cp "$BIN/$b" "$STAGE/target/release/$b"
done
cp .venv/bin/k6 "$STAGE/.venv/bin/k6"
cp -r web-ui/dist "$STAGE/web-ui/dist"
cp -r docker Dockerfile .dockerignore "$STAGE/"
echo "build-image: docker build -t $TAG (binaries from $BIN)"
DOCKER_BUILDKIT=0 docker build -q -t "$TAG" "$STAGE" >/dev/null
# The image this build replaced, now untagged.
docker image prune -f --filter label=org.capybara.image=appliance >/dev/null 2>&1 || true
echo "build-image: $TAG built"
