#!/usr/bin/env bash
# A server: hostagent (user-space TCP/IP stack over AF_PACKET on eth0) with
# the built-in HTTP app on the VIP. The kernel owns the management address
# (docker's); the data address DATA_ADDR is reserved out of docker's IPAM
# (ip_range) and owned by the stack only, which answers ARP for it.
# Needs NET_RAW (AF_PACKET) and NET_ADMIN (offloads).
. /usr/local/lib/capybara/common.sh
: "${SERVER_ID:?}" "${DATA_ADDR:?}" "${SWITCH_ADDR:?}" "${VIP:?}"
write_key
dev=eth0
MGMT=$(ip -o -4 addr show dev "$dev" | awk '{ split($4, x, "/"); print x[1]; exit }')
[ -n "$MGMT" ] || die "no IPv4 address on $dev"
offloads_off "$dev"
cat > /run/capybara/hostagent.toml <<TOML
name = "s$SERVER_ID"
[interface]
name = "$dev"
backend = "af_packet"
[stack]
address = "$DATA_ADDR"
gateway = "$SWITCH_ADDR"
[[service]]
listen = "$VIP"
app = "http"
[migration]
key_file = "/run/capybara/deployment.key"
switch = "$SWITCH_ADDR"
[control]
switch = "$SWITCH_ADDR:7692"
server_id = $SERVER_ID
management = "$MGMT"
TOML
hostagent --config /run/capybara/hostagent.toml --check
exec hostagent --config /run/capybara/hostagent.toml --metrics "$MGMT:9100"
