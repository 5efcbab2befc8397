#!/usr/bin/env bash
# Idempotent installer for everything Capybara needs on a fresh Debian 12 machine.
# Prints what it installed; a second run installs nothing and says so.
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PACKAGES=(
  build-essential pkg-config clang llvm libbpf-dev libelf-dev zlib1g-dev bpftool
  protobuf-compiler iproute2 iputils-ping curl ethtool tcpdump
  etcd-server etcd-client nginx redis-server redis-tools wrk haproxy
  dpdk libdpdk-dev
  chromium default-jre-headless python3-venv
  node-react node-react-dom node-chart.js esbuild node-typescript
  debootstrap sqlite3 iptables nftables
)
installed=()

missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: apt installing: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  # Debian starts these daemons on install; tests start their own instances.
  for svc in etcd nginx redis-server haproxy; do
    systemctl disable --now "$svc" >/dev/null 2>&1 || service "$svc" stop >/dev/null 2>&1 || true
  done
  pkill -x etcd 2>/dev/null || true
  installed+=("apt: ${missing[*]}")
fi

# Python tools, pinned, in a project-local virtual environment.
VENV=.venv
PY_REQS=scripts/requirements.txt
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  installed+=("venv: $VENV")
fi
# The stamp records which requirements file the venv was built from, so a
# second run installs nothing and a changed pin reinstalls.
STAMP="$VENV/.capybara-requirements.sha256"
want=$(sha256sum "$PY_REQS" | cut -d' ' -f1)
if [ "$(cat "$STAMP" 2>/dev/null)" != "$want" ]; then
  echo "setup: pip installing from $PY_REQS"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check -r "$PY_REQS"
  echo "$want" > "$STAMP"
  installed+=("pip: $(tr '\n' ' ' < "$PY_REQS")")
fi

# bpffs for pinned maps (lab fault injector, switchd).
if ! mountpoint -q /sys/fs/bpf; then
  mount -t bpf bpf /sys/fs/bpf && installed+=("mount: bpffs at /sys/fs/bpf")
fi

if ((${#installed[@]})); then
  echo "setup: installed:"; printf '  - %s\n' "${installed[@]}"
else
  echo "setup: nothing to install, everything already present"
fi
