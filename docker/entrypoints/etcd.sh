#!/usr/bin/env bash
# One member of the 3-member etcd cluster (Debian's etcd-server). The
# variables are MEMBER_*: etcd itself reads ETCD_* and refuses duplicates.
# Raft timings are relaxed (defaults 100/1000 ms) so that a busy host (CI on
# 2 shared cores) does not cause leader elections that stall lease renewals.
. /usr/local/lib/capybara/common.sh
: "${MEMBER_NAME:?}" "${MEMBER_ADDR:?}" "${MEMBER_CLUSTER:?}"
exec etcd --name "$MEMBER_NAME" --data-dir /var/lib/etcd \
  --listen-client-urls "http://$MEMBER_ADDR:2379,http://127.0.0.1:2379" \
  --advertise-client-urls "http://$MEMBER_ADDR:2379" \
  --listen-peer-urls "http://$MEMBER_ADDR:2380" \
  --initial-advertise-peer-urls "http://$MEMBER_ADDR:2380" \
  --initial-cluster "$MEMBER_CLUSTER" --initial-cluster-token capybara \
  --initial-cluster-state new \
  --heartbeat-interval 250 --election-timeout 2500
