#!/usr/bin/env bash
# One switchd of the active/standby pair: `capybara run` with the pair's
# config (docker/config/switchd-*.toml: switchd only, etcd store, HA on).
#
# XDP links pinned: the host's bpffs is bind-mounted at /sys/fs/bpf
# (docker/compose.yml) and the config gets `pin_dir = $CAPYBARA_PIN_DIR`
# (one directory per compose project), so that the program keeps forwarding
# when the active dies and the standby replaces it in place: a takeover
# loses no packet. switchd removes its pins when it stops with no standby
# waiting; when both stop at once (`compose down`) the active hands its
# links over to a standby that is leaving too, so whichever exits last
# removes the pins nobody holds (below): `compose down` leaves none on the
# host. A container killed (`docker kill`) leaves its pins to the standby.
. /usr/local/lib/capybara/common.sh
: "${CAPYBARA_CONFIG:?}" "${CAPYBARA_PIN_DIR:?}"
write_key
# The namespace holder renames the interfaces first.
for _ in $(seq 1 100); do
  ip link show client >/dev/null 2>&1 && ip link show server >/dev/null 2>&1 && break
  sleep 0.1
done
mountpoint -q /sys/fs/bpf && [ "$(stat -f -c %T /sys/fs/bpf)" = bpf_fs ] \
  || echo "switchd.sh: warning: /sys/fs/bpf is not the host's bpffs (compose.yml mounts it): XDP links not pinned, a takeover stalls ~200 ms" >&2
case "$CAPYBARA_PIN_DIR" in
  /sys/fs/bpf/?*) ;;
  *) die "CAPYBARA_PIN_DIR must be a directory under /sys/fs/bpf, not ${CAPYBARA_PIN_DIR@Q}" ;;
esac
config=/run/capybara/capybara.toml
grep -q '^\[switchd\.ha\]$' "$CAPYBARA_CONFIG" || die "$CAPYBARA_CONFIG has no [switchd.ha] table"
sed "/^\[switchd\.ha\]\$/a pin_dir = \"$CAPYBARA_PIN_DIR\"" "$CAPYBARA_CONFIG" > "$config"
capybara --check "$config"

# Removes this network namespace's pin directories
# (<pin_dir>/net<inode>-<election>) that no switchd holds: no owner lock
# (exclusive flock on the directory, held by the switchd whose program the
# links run) and no standby mark (shared flock on <dir>/standby). The owner
# lock is held while removing, so a switchd starting meanwhile waits for it
# and pins anew.
remove_unused_pins() {
  local ino d
  ino=$(stat -L -c %i /proc/self/ns/net) || return 0
  for d in "$CAPYBARA_PIN_DIR"/net"$ino"-*; do
    [ -d "$d" ] || continue
    flock -n -x "$d" sh -c \
      '[ -d "$1/standby" ] && ! flock -n -x "$1/standby" true && exit 0; rm -rf "$1" && echo "switchd.sh: removed the pins in $1 (no switchd holds them)"' \
      _ "$d" || true
  done
  rmdir "$CAPYBARA_PIN_DIR" 2>/dev/null || true
}

# Not `exec`: the pins are checked after capybara exits. SIGTERM (docker
# stop; tini forwards it here) goes on to capybara.
capybara run "$config" &
pid=$!
trap 'kill -TERM "$pid" 2>/dev/null || true' TERM INT
set +e
wait "$pid"
rc=$?
# A trapped signal ends `wait` early: wait again until capybara is gone.
while kill -0 "$pid" 2>/dev/null; do
  wait "$pid"
  rc=$?
done
remove_unused_pins
exit "$rc"
