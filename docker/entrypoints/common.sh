# Sourced by every entrypoint: shared helpers.
set -euo pipefail

die() { echo "$(basename "$0"): $*" >&2; exit 1; }

# The deployment secret (MACs of TCPMig and control messages) comes from
# the environment (docker/compose.yml: CAPYBARA_KEY), never from the image.
write_key() {
  [ -n "${CAPYBARA_KEY:-}" ] || die "CAPYBARA_KEY is not set (hex, >= 32 hex digits; see README)"
  mkdir -p /run/capybara
  umask 077
  printf '%s\n' "$CAPYBARA_KEY" > /run/capybara/deployment.key
}

# User-space stacks read raw frames, and the switch rewrites headers with
# incremental checksums: no checksum/segmentation offloads on the links
# (as in the lab). Needs NET_ADMIN.
offloads_off() {
  ethtool -K "$1" rx off tx off sg off tso off gso off gro off >/dev/null 2>&1 \
    || ethtool -K "$1" tx off >/dev/null 2>&1 \
    || echo "$(basename "$0"): warning: cannot turn offloads off on $1" >&2
}

# The interface that holds IPv4 address $1.
iface_of() {
  ip -o -4 addr show | awk -v a="$1" '{ split($4, x, "/"); if (x[1] == a) print $2 }'
}
