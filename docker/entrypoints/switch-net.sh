#!/usr/bin/env bash
# The switch's network namespace: joined to the client and the server
# networks, shared by the active and the standby switchd
# (network_mode: service:switch-net), so the standby re-attaches the data
# plane to the same interfaces. Names the interfaces by role (docker's
# eth0/eth1 order is not guaranteed), turns offloads off, then just holds
# the namespace. Needs NET_ADMIN.
. /usr/local/lib/capybara/common.sh
: "${CLIENT_ADDR:?}" "${SERVER_ADDR:?}"
for pair in "$CLIENT_ADDR client" "$SERVER_ADDR server"; do
  set -- $pair
  dev=$(iface_of "$1")
  [ -n "$dev" ] || die "no interface holds $1"
  if [ "$dev" != "$2" ]; then
    ip link set dev "$dev" down
    ip link set dev "$dev" name "$2"
    ip link set dev "$2" up
  fi
  offloads_off "$2"
done
# No default route: the switch reaches only its two networks (like the lab).
ip route del default >/dev/null 2>&1 || true
echo "switch-net: client=$CLIENT_ADDR server=$SERVER_ADDR ready"
touch /tmp/ready
exec sleep infinity
