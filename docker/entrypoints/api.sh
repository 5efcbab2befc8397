#!/usr/bin/env bash
# The appliance's REST API and dashboard: `capybara run` with [api] only.
. /usr/local/lib/capybara/common.sh
: "${CAPYBARA_CONFIG:?}"
capybara --check "$CAPYBARA_CONFIG"
exec capybara run "$CAPYBARA_CONFIG"
