//! The C structs and constants of bpf/capybara_maps.h must match the Rust
//! mirror in src/abi.rs: compile a probe against the header with the system
//! C compiler, print every sizeof/offsetof/constant, compare.

use std::collections::HashMap;
use std::mem::{offset_of, size_of};
use std::process::Command;

use capybara_switchd::abi::*;

const PROBE: &str = r#"
#include <stdio.h>
#include <stddef.h>
#define CAPY_USERSPACE 1
#include "capybara_maps.h"
#define S(t) printf("sizeof %s %zu\n", #t, sizeof(struct t));
#define O(t, f) printf("offsetof %s.%s %zu\n", #t, #f, offsetof(struct t, f));
#define C(c) printf("const %s %llu\n", #c, (unsigned long long)(c));
int main(void) {
  S(capy_flow_key) O(capy_flow_key, client_ip) O(capy_flow_key, service_ip) O(capy_flow_key, client_port) O(capy_flow_key, service_port)
  S(capy_flow) O(capy_flow, server) O(capy_flow, service) O(capy_flow, flags) O(capy_flow, created_ns)
  S(capy_migration) O(capy_migration, server) O(capy_migration, pending) O(capy_migration, pad) O(capy_migration, migration_id)
  S(capy_server) O(capy_server, data_ip) O(capy_server, ifindex) O(capy_server, mac) O(capy_server, src_mac) O(capy_server, state) O(capy_server, flags) O(capy_server, weight)
  S(capy_service_key) O(capy_service_key, vip) O(capy_service_key, port) O(capy_service_key, proto)
  S(capy_service) O(capy_service, index) O(capy_service, placement) O(capy_service, flags)
  S(capy_ring) O(capy_ring, len) O(capy_ring, mode) O(capy_ring, servers)
  S(capy_iface) O(capy_iface, role) O(capy_iface, mac)
  S(capy_config) O(capy_config, switch_server_ip) O(capy_config, flags)
  S(capy_server_stats) O(capy_server_stats, packets) O(capy_server_stats, bytes) O(capy_server_stats, requests)
  S(capy_flow_event) O(capy_flow_event, key) O(capy_flow_event, kind) O(capy_flow_event, server) O(capy_flow_event, prev_server) O(capy_flow_event, ts_ns)
  C(CAPY_MAX_SERVERS) C(CAPY_MAX_SERVICES) C(CAPY_MAGLEV_SIZE) C(CAPY_MAX_FLOWS) C(CAPY_MAX_MIGRATIONS) C(CAPY_RING_SIZE) C(CAPY_MAX_IFACES) C(CAPY_HASH_SEED)
  C(CAPY_SERVER_EMPTY) C(CAPY_SERVER_LIVE) C(CAPY_SERVER_DRAINING) C(CAPY_SERVER_DEAD)
  C(CAPY_IFACE_CLIENT) C(CAPY_IFACE_SERVER) C(CAPY_PLACE_MAGLEV) C(CAPY_PLACE_RING) C(CAPY_PLACE_NONE)
  C(CAPY_FLOW_MIGRATED) C(CAPY_FLOW_CLOSING) C(CAPY_FLOW_ESTABLISHED) C(CAPY_FLOW_UNPREPARED) C(CAPY_EV_NEW) C(CAPY_EV_MIGRATED) C(CAPY_EV_RETURNED) C(CAPY_EV_CLOSED)
  C(CAPY_RING_PLACEMENT) C(CAPY_RING_TARGET) C(CAPY_RING_KINDS) C(CAPY_RING_ROTATE) C(CAPY_RING_FIRST) C(CAPY_RING_PAIRED)
  C(CAPY_STAT_MAX) C(CAPY_STAT_FWD_MIGRATED) C(CAPY_STAT_DROP_TCPMIG_FROM_CLIENT) C(CAPY_STAT_EVENT_LOST) C(CAPY_STAT_RESET_RETIRED) C(CAPY_STAT_RESET_NO_SERVER) C(CAPY_SVC_REFUSE)
  C(CAPY_STAT_DROP_PREPARE_ACK_STALE) C(CAPY_STAT_DROP_ABORT_UNMATCHED) C(CAPY_MIG_FINAL) C(CAPY_MIG_PENDING) C(CAPY_PREPARE_MEMORY) C(CAPY_ORIGIN_IDS) C(CAPY_UNMATCHED_OUTCOMES)
  return 0;
}
"#;

fn probe() -> HashMap<String, u64> {
    let dir = std::env::temp_dir().join(format!("capy-abi-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let src = dir.join("probe.c");
    let bin = dir.join("probe");
    std::fs::write(&src, PROBE).unwrap();
    let manifest = env!("CARGO_MANIFEST_DIR");
    let st = Command::new("cc")
        .arg(format!("-I{manifest}/bpf"))
        .arg(&src)
        .arg("-o")
        .arg(&bin)
        .status()
        .expect("cc");
    assert!(st.success(), "probe did not compile");
    let out = Command::new(&bin).output().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| {
            let mut it = l.split_whitespace();
            let kind = it.next().unwrap();
            let name = it.next().unwrap();
            (
                format!("{kind} {name}"),
                it.next().unwrap().parse().unwrap(),
            )
        })
        .collect()
}

#[test]
fn c_structs_match_rust() {
    let c = probe();
    let mut checks: Vec<(String, u64)> = Vec::new();
    macro_rules! s {
        ($c:literal, $r:ty, [$($f:ident),*]) => {
            checks.push((format!("sizeof {}", $c), size_of::<$r>() as u64));
            $( checks.push((format!("offsetof {}.{}", $c, stringify!($f)), offset_of!($r, $f) as u64)); )*
        };
    }
    s!(
        "capy_flow_key",
        CFlowKey,
        [client_ip, service_ip, client_port, service_port]
    );
    s!("capy_flow", CFlow, [server, service, flags, created_ns]);
    s!(
        "capy_migration",
        CMigration,
        [server, pending, pad, migration_id]
    );
    s!(
        "capy_server",
        CServer,
        [data_ip, ifindex, mac, src_mac, state, flags, weight]
    );
    s!("capy_service_key", CServiceKey, [vip, port, proto]);
    s!("capy_service", CService, [index, placement, flags]);
    s!("capy_ring", CRing, [len, mode, servers]);
    s!("capy_iface", CIface, [role, mac]);
    s!("capy_config", CConfig, [switch_server_ip, flags]);
    s!(
        "capy_server_stats",
        CServerStats,
        [packets, bytes, requests]
    );
    s!(
        "capy_flow_event",
        CFlowEvent,
        [key, kind, server, prev_server, ts_ns]
    );
    let consts: &[(&str, u64)] = &[
        ("CAPY_MAX_SERVERS", MAX_SERVERS as u64),
        ("CAPY_MAX_SERVICES", MAX_SERVICES as u64),
        ("CAPY_MAGLEV_SIZE", MAGLEV_SIZE as u64),
        ("CAPY_MAX_FLOWS", MAX_FLOWS as u64),
        ("CAPY_MAX_MIGRATIONS", MAX_MIGRATIONS as u64),
        ("CAPY_RING_SIZE", RING_SIZE as u64),
        ("CAPY_MAX_IFACES", MAX_IFACES as u64),
        ("CAPY_HASH_SEED", HASH_SEED as u64),
        ("CAPY_SERVER_EMPTY", SERVER_EMPTY as u64),
        ("CAPY_SERVER_LIVE", SERVER_LIVE as u64),
        ("CAPY_SERVER_DRAINING", SERVER_DRAINING as u64),
        ("CAPY_SERVER_DEAD", SERVER_DEAD as u64),
        ("CAPY_IFACE_CLIENT", IFACE_CLIENT as u64),
        ("CAPY_IFACE_SERVER", IFACE_SERVER as u64),
        ("CAPY_PLACE_MAGLEV", PLACE_MAGLEV as u64),
        ("CAPY_PLACE_RING", PLACE_RING as u64),
        ("CAPY_PLACE_NONE", PLACE_NONE as u64),
        ("CAPY_FLOW_MIGRATED", FLOW_MIGRATED as u64),
        ("CAPY_FLOW_CLOSING", FLOW_CLOSING as u64),
        ("CAPY_FLOW_ESTABLISHED", FLOW_ESTABLISHED as u64),
        ("CAPY_FLOW_UNPREPARED", FLOW_UNPREPARED as u64),
        ("CAPY_EV_NEW", EV_NEW as u64),
        ("CAPY_EV_MIGRATED", EV_MIGRATED as u64),
        ("CAPY_EV_RETURNED", EV_RETURNED as u64),
        ("CAPY_EV_CLOSED", EV_CLOSED as u64),
        ("CAPY_RING_PLACEMENT", RING_PLACEMENT as u64),
        ("CAPY_RING_TARGET", RING_TARGET as u64),
        ("CAPY_RING_KINDS", RING_KINDS as u64),
        ("CAPY_RING_ROTATE", RING_ROTATE as u64),
        ("CAPY_RING_FIRST", RING_FIRST as u64),
        ("CAPY_RING_PAIRED", RING_PAIRED as u64),
        ("CAPY_STAT_MAX", STAT_MAX as u64),
        ("CAPY_STAT_FWD_MIGRATED", stat("fwd_migrated") as u64),
        (
            "CAPY_STAT_DROP_TCPMIG_FROM_CLIENT",
            stat("drop_tcpmig_from_client") as u64,
        ),
        ("CAPY_STAT_EVENT_LOST", stat("event_lost") as u64),
        ("CAPY_STAT_RESET_RETIRED", stat("reset_retired") as u64),
        ("CAPY_STAT_RESET_NO_SERVER", stat("reset_no_server") as u64),
        ("CAPY_SVC_REFUSE", SVC_REFUSE as u64),
        (
            "CAPY_STAT_DROP_PREPARE_ACK_STALE",
            stat("drop_prepare_ack_stale") as u64,
        ),
        (
            "CAPY_STAT_DROP_ABORT_UNMATCHED",
            stat("drop_abort_unmatched") as u64,
        ),
        ("CAPY_MIG_FINAL", MIG_FINAL as u64),
        ("CAPY_MIG_PENDING", MIG_PENDING as u64),
        ("CAPY_PREPARE_MEMORY", PREPARE_MEMORY as u64),
        ("CAPY_ORIGIN_IDS", ORIGIN_IDS as u64),
        ("CAPY_UNMATCHED_OUTCOMES", UNMATCHED_OUTCOMES as u64),
    ];
    for (n, v) in consts {
        checks.push((format!("const {n}"), *v));
    }
    for (name, rust) in checks {
        assert_eq!(c.get(&name).copied(), Some(rust), "{name}: C vs Rust");
    }
}
