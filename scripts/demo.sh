#!/usr/bin/env bash
# `make demo`: the appliance in the namespace lab, on embedded defaults.
#
#   lab (prefix demo): client c1, switch sw, servers s1..s3
#   sw: `capybara run` (switchd with XDP on cl1, sv1..sv3 and its HTTP
#       endpoint on 127.0.0.1:9102 there; the REST API + dashboard on
#       127.0.0.1:8080 there; SQLite store in the state dir). Started with
#       `nsenter --net` (network namespace only: `ip netns exec` would
#       mount a fresh /sys without bpffs), so switchd pins its XDP links
#       in /sys/fs/bpf/capybara-lab-PREFIX/switchd: a restart takes them
#       over in place; `capybara lab down` (the teardown) removes them.
#   s1..s3: nginx on 127.0.0.1:8081 (the demo application, a page naming
#       the server) behind the hostagent sidecar (app = "sidecar",
#       protocol = "http1") on VIP 198.18.100.1:80; migration, control and
#       the migration policies on
#   c1: capybara-loadgen, Zipf load over long-lived connections, in rounds
#   root namespace: a TCP relay 127.0.0.1:8080 -> the API in sw (loopback only)
#
# Keeps running until Ctrl-C, `make demo-stop` or CAPYBARA_DEMO_SECONDS;
# tears everything down on any exit (also on error).
# State and logs: target/demo/ (wiped at start); the admin token is also
# written to test-output/demo/admin-token.
# Knobs (tests run a second demo beside a developer's): CAPYBARA_LAB_PREFIX,
# CAPYBARA_DEMO_PORT, CAPYBARA_DEMO_DIR, CAPYBARA_DEMO_OUT,
# CAPYBARA_DEMO_SECONDS, CAPYBARA_DEMO_ROUND, CAPYBARA_DEMO_RATE,
# CAPYBARA_BIN_DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PREFIX=${CAPYBARA_LAB_PREFIX:-demo}
# Tests run a second demo beside a developer's: these move its state and port.
DIR=${CAPYBARA_DEMO_DIR:-$ROOT/target/demo}
OUT=${CAPYBARA_DEMO_OUT:-$ROOT/test-output/demo}
API_PORT=${CAPYBARA_DEMO_PORT:-8080}
VIP=198.18.100.1
SERVERS=3
ROUND=${CAPYBARA_DEMO_ROUND:-20s}
# Requests per second of the client load (keep-alive, 100 connections).
RATE=${CAPYBARA_DEMO_RATE:-1000}
APP_PORT=8081
# The lab's bpffs directory (`capybara lab down --prefix` removes it) and
# switchd's pin directory in it.
LAB_BPF=/sys/fs/bpf/capybara-lab-$PREFIX
PIN_DIR=$LAB_BPF/switchd

# Binaries: target/release (what `make setup` builds); CAPYBARA_BIN_DIR
# overrides, per binary, when it holds that binary.
bin() {
  if [ -n "${CAPYBARA_BIN_DIR:-}" ] && [ -x "$CAPYBARA_BIN_DIR/$1" ]; then
    echo "$CAPYBARA_BIN_DIR/$1"
  else
    echo "$ROOT/target/release/$1"
  fi
}
CAPYBARA=$(bin capybara)
HOSTAGENT=$(bin hostagent)
LOADGEN=$(bin capybara-loadgen)
for b in "$CAPYBARA" "$HOSTAGENT" "$LOADGEN"; do
  [ -x "$b" ] || { echo "demo: missing $b (run \`make setup\`)" >&2; exit 1; }
done
NGINX=$(command -v nginx || echo /usr/sbin/nginx)
[ -x "$NGINX" ] || { echo "demo: missing nginx (run \`make setup\`, or apt-get install nginx-light)" >&2; exit 1; }
[ -f "$ROOT/web-ui/dist/index.html" ] || { echo "demo: missing web-ui/dist (run \`make setup\`)" >&2; exit 1; }
if [ "$(id -u)" != 0 ]; then echo "demo: needs root (network namespaces, eBPF)" >&2; exit 1; fi
command -v nsenter >/dev/null || { echo "demo: missing nsenter (util-linux)" >&2; exit 1; }

PIDS=()
# Per pid: what it is, its log, the command that starts it again, and
# whether the demo can go on without it (see the watch loop at the end).
declare -A PNAME=() PLOG=() PCMD=() PVITAL=()
# track PID VITAL NAME LOG COMMAND...: records the process started last.
track() {
  local pid=$1 vital=$2 name=$3 log=$4; shift 4
  PIDS+=("$pid")
  PVITAL[$pid]=$vital PNAME[$pid]=$name PLOG[$pid]=$log
  PCMD[$pid]="$(printf '%q ' "$@")>> $(printf '%q' "$log") 2>&1 &"
  # Out of bash's job table: the watch loop below (kill -0) and the
  # teardown (kill) follow it by pid, and bash would otherwise print its own
  # `scripts/demo.sh: line N: PID Killed  ip netns exec ...` for every one
  # that dies of a signal (a `kill -9` of an nginx, the teardown's).
  disown "$pid" 2>/dev/null || true
}
LOADGEN_LOOP=
cleaned=
owned=
cleanup() {
  local rc=$?
  [ -n "$cleaned" ] && return
  cleaned=1
  # Failed before it built anything (e.g. another demo is running): leave it.
  [ -n "$owned" ] || exit "$rc"
  trap '' INT TERM
  echo
  echo "demo: tearing down..."
  touch "$DIR/stop" 2>/dev/null || true
  [ -n "$LOADGEN_LOOP" ] && kill "$LOADGEN_LOOP" 2>/dev/null || true
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  sleep 0.5
  for p in "${PIDS[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  for f in "$DIR"/nginx-s*/nginx.pid; do
    [ -f "$f" ] && kill "$(cat "$f")" 2>/dev/null || true
  done
  # Also kills whatever is left inside the lab's namespaces, and removes
  # the lab's pins (a switchd killed above leaves its XDP links pinned:
  # their program forwards on until the pins go).
  "$CAPYBARA" lab down --prefix "$PREFIX" >/dev/null 2>&1 || "$CAPYBARA" lab down --prefix "$PREFIX" || true
  if [ -e "$LAB_BPF" ]; then rm -rf "$LAB_BPF" || echo "demo: cannot remove $LAB_BPF" >&2; fi
  rm -f "$DIR/demo.pid"
  echo "demo: stopped (lab $PREFIX removed)"
  exit "$rc"
}
trap cleanup EXIT
# Ctrl-C and `make demo-stop` (TERM) are how an operator ends the demo:
# after the teardown it exits 0 (before, `make demo` then printed
# `Error 143` as if it had failed).
trap 'exit 0' INT TERM

fail() { echo "demo: $*" >&2; exit 1; }

# wait_until SECONDS WHAT COMMAND...: polls every 0.2 s.
wait_until() {
  local limit=$1 what=$2; shift 2
  local end=$((SECONDS + limit))
  until "$@" >/dev/null 2>&1; do
    [ $SECONDS -lt $end ] || fail "timed out after ${limit}s waiting for $what (logs: $DIR)"
    sleep 0.2
  done
}

if ss -ltn "sport = :$API_PORT" | grep -q LISTEN; then
  fail "127.0.0.1:$API_PORT is already in use (another demo? \`make demo-stop\`)"
fi

# ---- state directory, keys, configs -------------------------------------
owned=1
"$CAPYBARA" lab down --prefix "$PREFIX" >/dev/null 2>&1 || true
rm -rf "$DIR" "$OUT"
mkdir -p "$DIR" "$OUT"
echo $$ > "$DIR/demo.pid"
od -An -tx1 -N32 /dev/urandom | tr -d ' \n' > "$DIR/deployment.key"
chmod 600 "$DIR/deployment.key"

# One appliance config: switchd (data plane + control plane) and the API with
# the dashboard, sharing the SQLite store in the state dir.
{
  cat <<EOF
state_dir = "$DIR"

[store]
sqlite = "$DIR/store.db"

[api]
listen = "127.0.0.1:$API_PORT"
static_dir = "$ROOT/web-ui/dist"
admin_token_file = "$OUT/admin-token"
switchd = ["http://127.0.0.1:9102"]

[switchd]
control_listen = "198.18.1.1:7692"
key_file = "$DIR/deployment.key"
placement = "maglev"
target_selection = "round_robin"
load_interval_us = 1000
heartbeat_interval_ms = 100
dead_after_ms = 1000
closed_linger_ms = 5000
metrics_listen = "127.0.0.1:9102"

[switchd.ha]
enabled = false
pin_dir = "$PIN_DIR"

[[switchd.interfaces]]
name = "cl1"
role = "client"
EOF
  for j in $(seq 1 $SERVERS); do printf '\n[[switchd.interfaces]]\nname = "sv%d"\nrole = "server"\n' "$j"; done
  cat <<EOF

[[switchd.services]]
name = "web"
vip = "$VIP:80"
pool = []
EOF
} > "$DIR/capybara.toml"
"$CAPYBARA" --check "$DIR/capybara.toml" > "$DIR/check.log" 2>&1 || { cat "$DIR/check.log" >&2; fail "invalid appliance config"; }

for j in $(seq 1 $SERVERS); do
  # The demo application: nginx on the server's loopback, a page naming it.
  nd="$DIR/nginx-s$j"
  mkdir -p "$nd/html" "$nd/tmp"
  cat > "$nd/html/index.html" <<EOF
<!doctype html>
<title>Capybara demo: s$j</title>
<p>Served by <b>s$j</b> (nginx behind the hostagent sidecar).</p>
EOF
  # One process (no master): the pid the demo watches is the server, so a
  # `kill -9` of it takes the application down as the health checks and
  # docs/OPERATIONS.md expect. With a master, SIGKILL left its worker
  # serving (and holding the port, so the printed restart command failed).
  cat > "$nd/nginx.conf" <<EOF
daemon off;
master_process off;
user root;
pid $nd/nginx.pid;
error_log $nd/error.log warn;
events { worker_connections 1024; }
http {
  access_log off;
  client_body_temp_path $nd/tmp/body;
  proxy_temp_path $nd/tmp/proxy;
  fastcgi_temp_path $nd/tmp/fastcgi;
  uwsgi_temp_path $nd/tmp/uwsgi;
  scgi_temp_path $nd/tmp/scgi;
  keepalive_timeout 600s;
  keepalive_requests 100000000;
  default_type text/html;
  server {
    listen 127.0.0.1:$APP_PORT;
    root $nd/html;
    location / { index index.html; }
  }
}
EOF
  cat > "$DIR/hostagent-s$j.toml" <<EOF
name = "s$j"
[interface]
name = "eth0"
[stack]
address = "198.18.2.$((10 + j))"
gateway = "198.18.1.1"
[[service]]
listen = "$VIP:80"
app = "sidecar"
backend = "127.0.0.1:$APP_PORT"
protocol = "http1"
[migration]
key_file = "$DIR/deployment.key"
switch = "198.18.1.1"
[control]
switch = "198.18.1.1:7692"
server_id = $j
management = "198.18.1.$((10 + j))"
[policy]
enabled = true
EOF
done

# ---- lab and processes --------------------------------------------------
echo "demo: building the lab ($PREFIX: c1, sw, s1..s$SERVERS)"
"$CAPYBARA" lab up --prefix "$PREFIX" --servers "$SERVERS" > "$DIR/lab-up.log" 2>&1 || { cat "$DIR/lab-up.log" >&2; fail "lab up failed"; }
NS() { echo "$PREFIX-$1"; }

echo "demo: starting nginx on s1..s$SERVERS (127.0.0.1:$APP_PORT)"
for j in $(seq 1 $SERVERS); do
  ip netns exec "$(NS s$j)" "$NGINX" -p "$DIR/nginx-s$j" -c "$DIR/nginx-s$j/nginx.conf" \
    > "$DIR/nginx-s$j.log" 2>&1 &
  track $! 0 "nginx of s$j in namespace $(NS s$j)" "$DIR/nginx-s$j.log" \
    ip netns exec "$(NS s$j)" "$NGINX" -p "$DIR/nginx-s$j" -c "$DIR/nginx-s$j/nginx.conf"
done
for j in $(seq 1 $SERVERS); do
  wait_until 30 "nginx on s$j" ip netns exec "$(NS s$j)" curl -sf -m 1 -o /dev/null "http://127.0.0.1:$APP_PORT/"
done

echo "demo: starting the appliance (capybara run: switchd + API + dashboard)"
nsenter --net="/run/netns/$(NS sw)" "$CAPYBARA" run "$DIR/capybara.toml" > "$DIR/capybara.log" 2>&1 &
track $! 1 "the appliance (capybara run in namespace $(NS sw))" "$DIR/capybara.log" :
wait_until 60 "the API" ip netns exec "$(NS sw)" curl -sf -m 1 -o /dev/null "http://127.0.0.1:$API_PORT/healthz"

echo "demo: starting hostagents (sidecar -> nginx) on s1..s$SERVERS"
for j in $(seq 1 $SERVERS); do
  ip netns exec "$(NS s$j)" "$HOSTAGENT" --config "$DIR/hostagent-s$j.toml" --metrics "198.18.1.$((10 + j)):9100" \
    > "$DIR/hostagent-s$j.log" 2>&1 &
  track $! 0 "hostagent of s$j in namespace $(NS s$j)" "$DIR/hostagent-s$j.log" \
    ip netns exec "$(NS s$j)" "$HOSTAGENT" --config "$DIR/hostagent-s$j.toml" --metrics "198.18.1.$((10 + j)):9100"
done
registered() { for j in $(seq 1 $SERVERS); do grep -q "registered s$j" "$DIR/capybara.log" || return 1; done; }
wait_until 60 "every server to register with switchd" registered
wait_until 60 "the VIP to answer from c1" ip netns exec "$(NS c1)" curl -sf -m 1 -o /dev/null "http://$VIP/"

python3 "$ROOT/scripts/demo-relay.py" "127.0.0.1:$API_PORT" "/run/netns/$(NS sw)" "127.0.0.1:$API_PORT" > "$DIR/relay.log" 2>&1 &
track $! 1 "the API relay to the host (demo-relay.py)" "$DIR/relay.log" :
wait_until 20 "the API from the host" curl -sf -m 1 -o /dev/null "http://127.0.0.1:$API_PORT/healthz"
cp "$OUT/admin-token" "$DIR/admin-token"
TOKEN=$(cat "$OUT/admin-token")

echo "demo: starting the client load (Zipf over 100 long-lived connections, $RATE req/s, rounds of $ROUND)"
(
  round=0
  while [ ! -e "$DIR/stop" ]; do
    round=$((round + 1))
    ip netns exec "$(NS c1)" "$LOADGEN" --target "$VIP:80" --rate "$RATE" --conns 100 --dist zipf --zipf-alpha 1.2 \
      --duration "$ROUND" --seed "$round" >> "$DIR/loadgen.log" 2>&1 || sleep 1
  done
) &
LOADGEN_LOOP=$!

# `make demo-stop` knows only target/demo/demo.pid and $CAPYBARA_LAB_PREFIX:
# a demo with other knobs is stopped through its own pid file.
if [ "$DIR" = "$ROOT/target/demo" ] && [ "$PREFIX" = demo ]; then
  STOP='`make demo-stop`'
else
  STOP="\`kill \$(cat $DIR/demo.pid)\`"
fi

cat <<TXT

Capybara demo is up.
  Dashboard:    http://127.0.0.1:$API_PORT
  Admin token:  $TOKEN
                (also in $OUT/admin-token)
  API:          curl -H "Authorization: Bearer \$(cat $OUT/admin-token)" http://127.0.0.1:$API_PORT/v1/servers
  switchd:      ip netns exec $(NS sw) curl -s 127.0.0.1:9102/status
  A server:     ip netns exec $(NS c1) curl -s http://$VIP/
  Logs, state:  $DIR/
Press Ctrl-C (or run $STOP elsewhere) to stop it and tear everything down.
TXT

START=$SECONDS
while true; do
  sleep 1
  if [ -n "${CAPYBARA_DEMO_SECONDS:-}" ] && [ $((SECONDS - START)) -ge "$CAPYBARA_DEMO_SECONDS" ]; then
    echo "demo: CAPYBARA_DEMO_SECONDS=$CAPYBARA_DEMO_SECONDS elapsed"
    exit 0
  fi
  # A server's hostagent or nginx dying is one of the failures the demo is
  # for (docs/OPERATIONS.md): the appliance notices, the dashboard shows it,
  # and the demo goes on. Without the appliance or the relay there is no
  # demo left to watch.
  for p in "${PIDS[@]}"; do
    kill -0 "$p" 2>/dev/null && continue
    [ "${PVITAL[$p]}" = 1 ] && fail "${PNAME[$p]} (pid $p) exited; the demo cannot go on without it (log: ${PLOG[$p]})"
    [ "${PVITAL[$p]}" = gone ] && continue
    PVITAL[$p]=gone
    echo "demo: ${PNAME[$p]} (pid $p) exited (log: ${PLOG[$p]}); the demo goes on without it. Start it again:" >&2
    echo "  ${PCMD[$p]}" >&2
  done
done
