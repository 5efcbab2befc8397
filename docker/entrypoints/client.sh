#!/usr/bin/env bash
# The client container (k6): routes the service addresses via the switch's
# client-side address and turns offloads off. Needs NET_ADMIN. Tests run
# k6 in it with `docker exec` (tests/compose/run.sh).
. /usr/local/lib/capybara/common.sh
: "${SWITCH_ADDR:?}" "${SERVICE_NET:?}"
offloads_off eth0
ip route replace "$SERVICE_NET" via "$SWITCH_ADDR"
echo "client: $SERVICE_NET via $SWITCH_ADDR"
exec sleep infinity
