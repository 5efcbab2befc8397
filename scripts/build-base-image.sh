#!/usr/bin/env bash
# Builds the base image of the Capybara containers locally, for machines that
# cannot pull images (no registry): debootstraps Debian bookworm (minbase)
# with the run-time packages of docker/packages.txt and `docker import`s it
# under the tag the Dockerfile's FROM names, so the same Dockerfile works
# unchanged where debian:bookworm-slim can be pulled (there its apt step
# installs the same list).
#
#   scripts/build-base-image.sh            build unless the tag exists
#   scripts/build-base-image.sh --force    rebuild
#
# Environment: CAPYBARA_BASE_TAG (default debian:bookworm-slim),
# CAPYBARA_DEBIAN_MIRROR (default http://deb.debian.org/debian).
set -euo pipefail
cd "$(dirname "$0")/.."
TAG=${CAPYBARA_BASE_TAG:-debian:bookworm-slim}
MIRROR=${CAPYBARA_DEBIAN_MIRROR:-http://deb.debian.org/debian}
force=
[ "${1:-}" = "--force" ] && force=1

if [ -z "$force" ] && docker image inspect "$TAG" >/dev/null 2>&1; then
  echo "base image: $TAG exists, nothing to do (--force rebuilds)"
  exit 0
fi
command -v debootstrap >/dev/null || { echo "base image: needs debootstrap (apt-get install debootstrap)" >&2; exit 1; }
[ "$(id -u)" = 0 ] || { echo "base image: needs root (debootstrap)" >&2; exit 1; }

packages=$(grep -v '^\s*#' docker/packages.txt | grep -v '^\s*$' | tr '\n' ',' | sed 's/,$//')
ROOTFS=$(mktemp -d /tmp/capybara-rootfs.XXXXXX)
cleanup() { rm -rf --one-file-system "$ROOTFS"; }
trap cleanup EXIT

echo "base image: debootstrap bookworm into $ROOTFS (a few minutes)"
debootstrap --variant=minbase --include="$packages" bookworm "$ROOTFS" "$MIRROR" \
  > "$ROOTFS.log" 2>&1 || { tail -30 "$ROOTFS.log" >&2; echo "base image: debootstrap failed (log $ROOTFS.log)" >&2; exit 1; }
rm -f "$ROOTFS.log"
# Slim it like the official image: no apt lists, caches, docs or man pages.
rm -rf "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/cache/apt/*.bin "$ROOTFS"/var/cache/apt/archives/*.deb \
  "$ROOTFS"/usr/share/doc/* "$ROOTFS"/usr/share/man/* "$ROOTFS"/usr/share/info/*
# Debian starts no services in containers; keep apt working for derived images.
printf 'deb %s bookworm main\n' "$MIRROR" > "$ROOTFS/etc/apt/sources.list"

old=$(docker image inspect -f '{{.Id}}' "$TAG" 2>/dev/null || true)
echo "base image: docker import as $TAG"
tar -C "$ROOTFS" --numeric-owner -c . | docker import \
  -c 'CMD ["/bin/bash"]' -c 'ENV LANG=C.UTF-8' - "$TAG" >/dev/null
# The replaced one, unless images built on it still use it.
[ -n "$old" ] && docker rmi "$old" >/dev/null 2>&1 || true
echo "base image: $TAG built ($(docker image inspect -f '{{.Size}}' "$TAG" | awk '{printf "%.0f MB", $1/1e6}'))"
