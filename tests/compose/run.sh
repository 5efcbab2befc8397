#!/usr/bin/env bash
# `make test-compose`: the docker compose deployment (docker/compose.yml),
# end to end, with real containers:
#   1. build the base image (once) and capybara:local; `compose up`
#   2. k6 sends traffic to the service address while server 1 is drained
#      through the REST API: the drain completes, zero failed k6 requests
#   3. k6 again while the active switchd gets `docker kill`: the standby
#      takes over the pinned XDP links in place (its takeover time is
#      printed), zero failed requests
#   4. k6 again while one etcd member is stopped: nothing visible changes
#      (zero failed requests, the API answers, the same switchd is active)
#   5. the killed switchd started again stands by; every etcd member frozen
#      (docker pause) for three lease TTLs: when etcd resumes, whichever
#      switchd lost the lease and stepped down (it exits 1) is started
#      again by Docker (restart: on-failure) and stands by: the pair has
#      its standby back
#   6. the api's main process is killed from inside its container (a crash
#      that exits non-zero, not a `docker kill`, which Docker does not
#      undo): Docker starts the container again (restart: unless-stopped)
#      and the API answers within 60 s with the same admin token
#   7. `compose down -v` (always, also on failure) leaves no container,
#      network or volume of the project behind, and no pin on the host's
#      bpffs (/sys/fs/bpf/capybara-compose-PROJECT)
# Prints `N passed, N failed` at the end; exit status 1 on any failure.
#
# Environment: CAPYBARA_BIN_DIR / CARGO_TARGET_DIR (binaries, see
# build-image.sh), COMPOSE_K6_SECONDS (default 30), COMPOSE_API_PORT
# (default 18080), COMPOSE_PROJECT (default cpbcompose).
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
PROJECT=${COMPOSE_PROJECT:-cpbcompose}
API_PORT=${COMPOSE_API_PORT:-18080}
K6_SECONDS=${COMPOSE_K6_SECONDS:-30}
OUT=$ROOT/test-output/compose
mkdir -p "$OUT"
rm -f "$OUT"/*.log "$OUT"/*.json

if docker compose version >/dev/null 2>&1; then
  COMPOSE=(docker compose)
elif command -v docker-compose >/dev/null; then
  COMPOSE=(docker-compose)
else
  echo "compose: neither \`docker compose\` nor docker-compose found" >&2
  exit 1
fi
# COMPOSE_PROJECT_NAME: the project's pin directory in compose.yml (`-p`
# alone does not reach compose v1's interpolation).
export CAPYBARA_KEY CAPYBARA_API_PORT=$API_PORT COMPOSE_PROJECT_NAME=$PROJECT
PIN_DIR=/sys/fs/bpf/capybara-compose-$PROJECT
CAPYBARA_KEY=$(od -An -tx1 -N32 /dev/urandom | tr -d ' \n')
dc() { "${COMPOSE[@]}" -p "$PROJECT" -f "$ROOT/docker/compose.yml" "$@"; }
cname() { docker ps -aq --filter "label=com.docker.compose.project=$PROJECT" --filter "label=com.docker.compose.service=$1" | head -1; }

passed=0
failed=0
ok() { echo "compose: PASS $*"; passed=$((passed + 1)); }
bad() { echo "compose: FAIL $*"; failed=$((failed + 1)); }

teardown() {
  local rc=$?
  trap - EXIT
  echo "compose: collecting logs into $OUT and tearing down"
  # A run stopped while phase 5 froze etcd leaves its members paused.
  for s in etcd1 etcd2 etcd3; do
    c=$(cname "$s")
    [ -n "$c" ] && docker unpause "$c" >/dev/null 2>&1 || true
  done
  for s in $(dc ps --services 2>/dev/null); do
    c=$(cname "$s")
    [ -n "$c" ] && docker logs "$c" > "$OUT/$s.log" 2>&1 || true
  done
  dc down -v --remove-orphans > "$OUT/down.log" 2>&1 || { cat "$OUT/down.log"; }
  local left
  left=$( (docker ps -aq --filter "label=com.docker.compose.project=$PROJECT"
           docker network ls -q --filter "label=com.docker.compose.project=$PROJECT"
           docker volume ls -q --filter "label=com.docker.compose.project=$PROJECT") | wc -l)
  if [ "$left" = 0 ]; then ok "compose down left no container, network or volume"; else bad "compose down left $left object(s) behind"; rc=1; fi
  if [ ! -e "$PIN_DIR" ]; then
    ok "compose down left no pin in $PIN_DIR"
  else
    bad "compose down left pins behind: $(find "$PIN_DIR" | tr '\n' ' ')"
    rm -rf "$PIN_DIR" || true
    rc=1
  fi
  echo "$passed passed, $failed failed"
  [ "$failed" = 0 ] || rc=1
  exit "$rc"
}

fail_now() { bad "$*"; exit 1; }

# wait_until SECONDS WHAT COMMAND...: polls every 0.5 s.
wait_until() {
  local limit=$1 what=$2; shift 2
  local end=$((SECONDS + limit))
  until "$@" >/dev/null 2>&1; do
    [ $SECONDS -lt $end ] || fail_now "timed out after ${limit}s waiting for $what"
    sleep 0.5
  done
}

# wait_until_quiet SECONDS COMMAND...: like wait_until, but returns 1 instead of failing.
wait_until_quiet() {
  local end=$((SECONDS + $1)); shift
  until "$@" >/dev/null 2>&1; do
    [ $SECONDS -lt $end ] || return 1
    sleep 0.5
  done
}

echo "compose: building images"
bash tests/compose/build-image.sh

# Leftovers of an interrupted run of this project.
dc down -v --remove-orphans >/dev/null 2>&1 || true
rm -rf "$PIN_DIR"
trap teardown EXIT

echo "compose: up (project $PROJECT)"
start=$SECONDS
dc up -d > "$OUT/up.log" 2>&1 || { cat "$OUT/up.log"; fail_now "compose up failed"; }

all_healthy() {
  local s c h
  for s in etcd1 etcd2 etcd3 switch-net switchd-a switchd-b api s1 s2 s3 k6; do
    c=$(cname "$s"); [ -n "$c" ] || return 1
    h=$(docker inspect -f '{{.State.Health.Status}}' "$c" 2>/dev/null) || return 1
    [ "$h" = healthy ] || return 1
  done
}
wait_until 120 "every container to be healthy" all_healthy
ok "compose up: every container healthy after $((SECONDS - start)) s"

API=http://127.0.0.1:$API_PORT
TOKEN=$(docker exec "$(cname api)" cat /var/lib/capybara/admin-token)
api_get() { curl -sf -m 5 -H "Authorization: Bearer $TOKEN" "$API$1"; }
ctl() { docker exec "$(cname api)" capybara ctl --api http://127.0.0.1:8080 --token "$TOKEN" "$@"; }

# The switchd HTTP endpoints live in switch-net's namespace (server side).
sw_status() { docker exec "$(cname switch-net)" curl -sf -m 2 "http://172.28.20.10:$1/status"; }
role_of() { sw_status "$1" | python3 -c 'import json,sys; print(json.load(sys.stdin)["role"])' 2>/dev/null || echo down; }
active_port() { for p in 9102 9103; do [ "$(role_of $p)" = active ] && { echo $p; return 0; }; done; return 1; }
servers_up() { [ "$(api_get /v1/servers | python3 -c 'import json,sys; d=json.load(sys.stdin); d=d.get("items", d) if isinstance(d, dict) else d; print(sum(1 for s in d if s.get("state") == "active"))')" = 3 ]; }
wait_until 60 "three active servers in the API" servers_up
wait_until 30 "the service address to answer from the client" docker exec "$(cname k6)" curl -sf -m 2 -o /dev/null http://172.28.100.1/
ok "three servers registered, the service answers"

# k6_run NAME: runs the steady load for K6_SECONDS in the background; sets K6_PID.
k6_run() {
  docker exec -i -e DURATION="${K6_SECONDS}s" -e VUS=20 "$(cname k6)" \
    k6 run --quiet --no-color --summary-export "/tmp/$1.json" - < tests/compose/steady.js > "$OUT/k6-$1.log" 2>&1 &
  K6_PID=$!
}
# k6_check NAME WHAT: waits for the run; passes when k6 succeeded with zero failed requests.
k6_check() {
  local rc=0
  wait "$K6_PID" || rc=$?
  docker exec "$(cname k6)" cat "/tmp/$1.json" > "$OUT/k6-$1.json" 2>/dev/null || true
  local line
  line=$(python3 - "$OUT/k6-$1.json" <<'PY' 2>/dev/null || echo "no k6 summary"
import json, sys
m = json.load(open(sys.argv[1]))["metrics"]
reqs = int(m["http_reqs"]["count"])
failed = int(m["http_req_failed"].get("passes", 0))
d = m["http_req_duration"]
print(f"requests={reqs} failed={failed} p99_ms={d['p(99)']:.1f} max_ms={d['max']:.1f}")
PY
)
  echo "compose: k6 $1: $line (exit $rc)"
  if [ "$rc" = 0 ] && [[ "$line" == *" failed=0 "* ]]; then ok "$2: $line"; else bad "$2: $line, k6 exit $rc (log $OUT/k6-$1.log)"; fi
}

# ---- 2. drain through the REST API under load ---------------------------
echo "compose: drain of server 1 under load"
k6_run drain
sleep 5
drain_rc=0
ctl drain 1 --deadline 20s --wait > "$OUT/drain.log" 2>&1 || drain_rc=$?
tail -2 "$OUT/drain.log"
if [ "$drain_rc" = 0 ]; then ok "REST drain of server 1 completed"; else bad "drain exit status $drain_rc (log $OUT/drain.log)"; fi
k6_check drain "k6 across the drain"
ctl undrain 1 > "$OUT/undrain.log" 2>&1 || bad "undrain of server 1 (log $OUT/undrain.log)"

# ---- 3. docker kill of the active switchd --------------------------------
echo "compose: docker kill of the active switchd under load"
port=$(active_port) || fail_now "no active switchd"
if [ "$port" = 9102 ]; then victim=switchd-a standby=9103; else victim=switchd-b standby=9102; fi
k6_run failover
sleep 5
docker kill "$(cname "$victim")" >/dev/null
wait_until 30 "the standby to become active" test "$(role_of "$standby")" = active
takeover=$(sw_status "$standby" | python3 -c 'import json,sys; print("%.1f" % json.load(sys.stdin)["takeover_ms"])')
echo "compose: takeover by the standby after docker kill of $victim: takeover_ms=$takeover"
ok "standby took over (takeover_ms=$takeover)"
# Both interfaces' links were pinned (the host's bpffs) and replaced in place.
pins=$(sw_status "$standby" | python3 -c 'import json,sys; s=json.load(sys.stdin); print(s["links_taken_over"], s["pin_dir"])')
case "$pins" in
  "2 $PIN_DIR/"*) ok "the standby took the 2 pinned XDP links over in place ($pins)" ;;
  *) bad "the standby did not take 2 pinned links in $PIN_DIR over: links_taken_over, pin_dir = $pins" ;;
esac
k6_check failover "k6 across the switchd kill"
# The API follows the new active switchd: live server stats come from it.
live_stats() { api_get /v1/servers | grep -q '"data_source":"switchd"'; }
if wait_until_quiet 10 live_stats; then ok "API serves live stats from the new active switchd"; else bad "API has no live stats after the takeover"; fi

# ---- 4. one etcd member stopped ------------------------------------------
echo "compose: stopping etcd member e2 under load"
k6_run etcd
sleep 3
docker stop -t 5 "$(cname etcd2)" >/dev/null
sleep 5
if api_get /v1/servers >/dev/null; then ok "API answers with an etcd member down"; else bad "API does not answer with an etcd member down"; fi
if [ "$(role_of "$standby")" = active ]; then ok "the same switchd stays active with an etcd member down"; else bad "switchd role changed with an etcd member down"; fi
k6_check etcd "k6 across the etcd member stop"
docker start "$(cname etcd2)" >/dev/null
etcd2_healthy() { [ "$(docker inspect -f '{{.State.Health.Status}}' "$(cname etcd2)")" = healthy ]; }
wait_until 60 "etcd2 to be healthy again" etcd2_healthy

# ---- 5. a store outage longer than the lease: the pair keeps a standby ----
# The killed switchd, started again, stands by.
dc up -d --no-deps "$victim" >> "$OUT/up.log" 2>&1 || fail_now "compose up -d $victim failed"
pair_ok() {
  local a b
  a=$(role_of 9102) b=$(role_of 9103)
  [ "$a $b" = "active standby" ] || [ "$a $b" = "standby active" ]
}
wait_until 60 "$victim to stand by again" pair_ok
ok "the killed switchd, started again, stands by"
restarts() { docker inspect -f '{{.RestartCount}}' "$(cname "$1")"; }
before="$(restarts switchd-a) $(restarts switchd-b)"
active_before=$(active_port)
echo "compose: freezing every etcd member for 15 s (lease_ttl_ms = 5000)"
for e in etcd1 etcd2 etcd3; do docker pause "$(cname $e)" >/dev/null; done
sleep 15
for e in etcd1 etcd2 etcd3; do docker unpause "$(cname $e)" >/dev/null; done
# Give a step-down time to happen (the campaigns run every 100 ms; in the
# runs of 2026-11-24 it came within 5 s) and a restarted switchd time to
# stand by.
sleep 10
if wait_until_quiet 60 pair_ok; then
  ok "after the etcd freeze the pair has an active and a standby (active was :$active_before, now :$(active_port); restarts a b: $before -> $(restarts switchd-a) $(restarts switchd-b))"
else
  bad "after the etcd freeze: switchd-a $(role_of 9102) ($(docker inspect -f '{{.State.Status}} exit {{.State.ExitCode}}' "$(cname switchd-a)")), switchd-b $(role_of 9103) ($(docker inspect -f '{{.State.Status}} exit {{.State.ExitCode}}' "$(cname switchd-b)")): a switchd that stepped down was not started again"
fi
grep -h "stepping down" <(docker logs "$(cname switchd-a)" 2>&1) <(docker logs "$(cname switchd-b)" 2>&1) | cut -c1-160 || echo "compose: no switchd stepped down (the active renewed its lease)"

# ---- 6. a crashed api is started again by Docker --------------------------
# SIGKILL of `capybara run` (the child of the container's init; `docker
# exec` processes are not): the container exits 137, as after a crash.
echo "compose: killing the api's main process inside its container"
api_before=$(restarts api)
docker exec "$(cname api)" sh -c 'kill -KILL $(pgrep -P 1 -x capybara)' \
  || bad "could not kill the api's main process"
api_back() { [ "$(restarts api)" -gt "$api_before" ] && api_get /v1/servers; }
start=$SECONDS
if wait_until_quiet 60 api_back; then
  ok "the crashed api was started again by Docker and answers after $((SECONDS - start)) s (restarts $api_before -> $(restarts api))"
else
  bad "the crashed api is not back after 60 s: $(docker inspect -f '{{.State.Status}} exit {{.State.ExitCode}} restarts {{.RestartCount}}' "$(cname api)")"
fi

exit 0
