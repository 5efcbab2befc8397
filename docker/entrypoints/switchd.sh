#!/usr/bin/env bash
# One switchd of the active/standby pair: `capybara run` with the pair's
# config (docker/config/switchd-*.toml: switchd only, etcd store, HA on).
. /usr/local/lib/capybara/common.sh
: "${CAPYBARA_CONFIG:?}"
write_key
# The namespace holder renames the interfaces first.
for _ in $(seq 1 100); do
  ip link show client >/dev/null 2>&1 && ip link show server >/dev/null 2>&1 && break
  sleep 0.1
done
capybara --check "$CAPYBARA_CONFIG"
exec capybara run "$CAPYBARA_CONFIG"
