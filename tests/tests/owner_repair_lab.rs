//! A switch that lost the owner of a migrated connection is repaired by the
//! server the connection left (lab, root; release binaries, or
//! `CAPYBARA_BIN_DIR`): the real switchd with its XDP data plane, two real
//! hostagents, a real Linux client.
//!
//! Every connection a migration moved off its placement is routed by a
//! final entry in the switch's migration table. Should the switch lose that
//! entry (a standby that took over from the store while the migration's
//! CONN_STATE_ACK passed, a switchd restarted without pinned links, an
//! operator's mistake with bpftool), the flow's segments go back to its
//! placement server, the origin, which gave the connection away: it
//! forwards them to the target for `GONE_LINGER` (5 s) and then, not
//! knowing the connection, resets the client. The origin knows where the
//! connection is, so once late segments keep coming after
//! `OWNER_REPAIR_AFTER` (200 ms) it tells the switch (SET_OWNER naming the
//! target; the switch accepts it from the flow's current owner) and the
//! flow goes to its owner again.
//!
//! The test: s1 migrates every connection it serves to s2 (the churn
//! option, s2 does not churn), so all [`CONNS`] echo connections of the
//! client end up on s2, those placed on s1 through a final migration entry.
//! Then every migration entry is deleted from the running program's map
//! (bpftool), and the client echoes on every connection for 7 s: every echo
//! must come back byte-exact, the switch must route every flow to s2 again,
//! and s1 must count its repairs. With a hostagent that does not repair,
//! the connections placed on s1 are reset after ~5 s.
//!
//! Bounded: every wait has a limit; ~15 s. Every process is killed and the
//! lab (namespaces, pins) removed on every exit path ([`Lab`],
//! [`EchoHolder`] guards).

use capybara_systests::{
    disable_policies, hostagent_migrating_config, metric_sum, switchd_lab, switchd_status_server,
    EchoHolder, Lab, SwitchMaps,
};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// Echo connections: none placed on s1 has probability 2^-12.
const CONNS: usize = 12;
const STATUS: u16 = 9102;

/// Per client port of the echo service: (flow entry's server index,
/// migration entry's server index if any) in the running program's maps.
fn echo_routes(maps: &SwitchMaps) -> BTreeMap<u16, (u32, Option<u32>)> {
    // struct capy_flow_key: client_ip, service_ip (network order), then
    // client_port, service_port (network order); values start with the
    // server index (host order, u32).
    let echo_port = |k: &[u8]| {
        (k.len() >= 12 && k[10..12] == 7u16.to_be_bytes()).then(|| u16::from_be_bytes([k[8], k[9]]))
    };
    let index = |v: &[u8]| u32::from_le_bytes([v[0], v[1], v[2], v[3]]);
    let mut r: BTreeMap<u16, (u32, Option<u32>)> = BTreeMap::new();
    for (k, v) in maps.dump("flows") {
        if let Some(p) = echo_port(&k) {
            r.entry(p).or_insert((0, None)).0 = index(&v);
        }
    }
    for (k, v) in maps.dump("migrations") {
        if let Some(p) = echo_port(&k) {
            r.entry(p).or_insert((u32::MAX, None)).1 = Some(index(&v));
        }
    }
    r
}

/// Server `id`'s index in the switch's tables (switchd's `/status`, which
/// lists a server a few hundred ms after it registered).
fn server_index(lab: &Lab, id: u32) -> u32 {
    let mut index = None;
    lab.wait_for(
        &format!("s{id}'s index in switchd's /status"),
        Duration::from_secs(10),
        || {
            index = switchd_status_server(lab, id).and_then(|s| s["index"].as_u64());
            index.is_some()
        },
    );
    index.unwrap() as u32
}

#[test]
fn the_origin_repairs_a_switch_that_lost_a_migrated_connections_owner() {
    let (mut lab, dir, key, sw) = switchd_lab("owner-repair-lab", "orl", 2);
    let sw_log = dir.join("switchd.log");
    lab.spawn_switchd(&sw, &sw_log);
    for j in 1..=2u32 {
        let churn = (j == 1).then_some((20, 2));
        let cfg = hostagent_migrating_config(&dir, j, &key, churn);
        disable_policies(&cfg);
        lab.spawn_hostagent(j, &cfg, &dir.join(format!("hostagent-s{j}.log")));
    }
    lab.wait_registered(&sw_log, 2);
    let (i1, i2) = (server_index(&lab, 1), server_index(&lab, 2));
    let mut held = EchoHolder::start_reporting(&lab, "198.18.100.1:7", CONNS);
    let ports = held.ports.clone();
    let maps = SwitchMaps::of(&lab, STATUS);
    // Everything on s2: those placed on s1 through a final entry.
    let mut routes = BTreeMap::new();
    lab.wait_for("every connection on s2", Duration::from_secs(20), || {
        routes = echo_routes(&maps);
        ports
            .iter()
            .all(|p| routes.get(p).is_some_and(|&(f, m)| m.unwrap_or(f) == i2))
    });
    let moved: Vec<u16> = ports
        .iter()
        .copied()
        .filter(|p| routes[p].0 == i1)
        .collect();
    assert!(
        !moved.is_empty(),
        "no connection was placed on s1: {routes:?}"
    );
    let out = held.round_outcomes(Duration::from_secs(3));
    assert!(out.values().all(|o| o.what == "ok"), "{out:?}");

    // The switch forgets every migration entry of the echo flows.
    for (k, _) in maps.dump("migrations") {
        if k.len() >= 12 && k[10..12] == 7u16.to_be_bytes() {
            maps.delete("migrations", &k);
        }
    }
    let t0 = Instant::now();
    let mut failed = BTreeMap::new();
    let mut rounds = 0;
    while t0.elapsed() < Duration::from_secs(7) {
        rounds += 1;
        for (port, o) in held.round_outcomes(Duration::from_secs(3)) {
            if o.what != "ok" {
                failed.entry(port).or_insert((rounds, o));
            }
        }
    }
    let routes = echo_routes(&maps);
    let repairs = metric_sum(
        &lab.server_metrics(1),
        "capybara_migration_owner_repairs_total",
        "",
    );
    eprintln!(
        "OWNER-REPAIR-LAB: {} of {CONNS} connections placed on s1, {rounds} rounds, repairs {repairs:?}",
        moved.len()
    );
    assert!(
        failed.is_empty(),
        "connections broken after the switch lost their owner (placed on s1: {moved:?}): {failed:?}"
    );
    for p in &ports {
        let (f, m) = routes[p];
        assert_eq!(m.unwrap_or(f), i2, "port {p} routed to index {routes:?}");
    }
    assert!(
        repairs.is_some_and(|r| r >= moved.len() as f64),
        "s1's owner repairs {repairs:?} for {} connections",
        moved.len()
    );
    lab.assert_no_resets([1, 2]);
}
