#!/usr/bin/env bash
# The dashboard's tests: the generated client is current, the UI typechecks
# and builds, and the browser tests (pytest + playwright, headless Debian
# chromium) pass against the real capybara-api serving web-ui/dist.
# test_lab_dashboard.py drives the same browser against a running lab (the
# demo deployment; needs root and the release binaries of `make build`).
# Exits non-zero on any failure. Screenshots: test-output/ui/.
#   env: CAPYBARA_API_BIN (skip the cargo build), SKIP_CLIENT_CHECK=1, PYTEST_ARGS
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/.." && pwd)"
cd "$here"

if [[ "${SKIP_CLIENT_CHECK:-0}" != 1 ]]; then
    bash scripts/check-client.sh
fi
bash build.sh

if [[ -z "${CAPYBARA_API_BIN:-}" ]]; then
    (cd "$root" && cargo build --quiet -p capybara-api --bin capybara-api)
    export CAPYBARA_API_BIN="$root/target/debug/capybara-api"
fi

export PYTHONDONTWRITEBYTECODE=1
mkdir -p "$root/test-output/ui"
# Bounded: the fixture's waits are bounded too; this is the backstop.
timeout 600 "$root/.venv/bin/python" -m pytest -p no:cacheprovider -q \
    "$here/tests/test_dashboard.py" "$here/tests/test_lab_dashboard.py" ${PYTEST_ARGS:-}
