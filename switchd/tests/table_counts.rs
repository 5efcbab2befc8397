//! The flow and migration counts of `/status` and `/metrics`
//! (`BpfDataPlane::table_counts`) on the real maps: exact from the kernel's
//! element counters (bpf/count.bpf.c) through bulk inserts, updates,
//! deletes, LRU evictions and the XDP program's own inserts, checked
//! against full walks of the maps; and the fallback walk, capped. Also the
//! removal of one service's entries (a service deleted at run time).
//!
//! Needs root (CAP_BPF) and Linux 6.6 or later for the exact counts. The
//! cost of a count against the walk, with an empty and a 1M-entry default
//! flow table: `cargo test -p capybara-switchd --test
//! table_counts -- --ignored --nocapture` (docs/BENCHMARKS.md).

#[allow(unused_imports)] // support re-exports what other data-plane tests use
mod support;

use std::time::{Duration, Instant};

use capybara_switchd::bpf::{TableCounts, TABLE_COUNT_CAP};
use capybara_switchd::dataplane::FlowScanCursor;
use support::*;

/// Flow `i` of a bulk load: distinct keys (198.18.0.0/16 clients, every
/// port), never sent anywhere.
fn key(i: u32) -> CFlowKey {
    CFlowKey::from(FlowKey {
        client_ip: Ipv4Addr::from(u32::from(Ipv4Addr::new(198, 18, 0, 0)) + (i >> 16)),
        client_port: (i & 0xffff) as u16,
        service_ip: VIP,
        service_port: 80,
    })
}

fn flows(range: std::ops::Range<u32>) -> (Vec<CFlowKey>, Vec<CFlow>) {
    range
        .map(|i| {
            (
                key(i),
                CFlow {
                    server: i % 4,
                    flags: FLOW_ESTABLISHED,
                    ..Default::default()
                },
            )
        })
        .unzip()
}

fn migrations(range: std::ops::Range<u32>) -> (Vec<CFlowKey>, Vec<CMigration>) {
    range
        .map(|i| (key(i), CMigration::owner(i % 4, u64::from(i) + 1)))
        .unzip()
}

/// Every entry of the flow table, by a full walk (no cap).
fn walk_flows(dp: &mut BpfDataPlane) -> Vec<(CFlowKey, CFlow)> {
    let mut cursor = FlowScanCursor::default();
    let mut out = Vec::new();
    while !dp.scan_flows(&mut cursor, usize::MAX, &mut out).unwrap() {}
    out
}

/// Entries of the flow table by a full walk, each seen once.
fn walked_flows(dp: &mut BpfDataPlane) -> usize {
    let out = walk_flows(dp);
    let keys: std::collections::HashSet<CFlowKey> = out.iter().map(|(k, _)| *k).collect();
    assert_eq!(
        keys.len(),
        out.len(),
        "a walk of a table at rest sees each key once"
    );
    out.len()
}

fn exact(flows: usize, migrations: usize) -> TableCounts {
    TableCounts {
        flows,
        migrations,
        exact: true,
    }
}

fn load(max_flows: u32) -> BpfDataPlane {
    let dp = BpfDataPlane::load(BpfOptions {
        max_flows,
        ..BpfOptions::small()
    })
    .expect("load XDP program (needs root)");
    assert!(
        dp.exact_counts(),
        "exact counts need Linux 6.6 or later (bpf_map_sum_elem_count); see switchd's stderr"
    );
    dp
}

#[test]
fn exact_counts_follow_bulk_loads_updates_and_deletes_past_the_old_cap() {
    let mut dp = load(262_144);
    assert_eq!(dp.table_counts().unwrap(), exact(0, 0));

    // 150,000 flows: more than the walk's cap.
    let (fk, fv) = flows(0..150_000);
    dp.insert_flows_batch(&fk, &fv).unwrap();
    let (mk, mv) = migrations(0..3_000);
    dp.insert_migrations_batch(&mk, &mv).unwrap();
    assert_eq!(dp.table_counts().unwrap(), exact(150_000, 3_000));
    assert_eq!(walked_flows(&mut dp), 150_000);

    // Rewriting existing entries (bulk and one by one) adds nothing.
    dp.insert_flows_batch(&fk[..50_000], &fv[..50_000]).unwrap();
    dp.insert_migrations_batch(&mk, &mv).unwrap();
    dp.insert_flow(fk[7], fv[8]).unwrap();
    dp.insert_migration(mk[7], mv[8]).unwrap();
    assert_eq!(dp.table_counts().unwrap(), exact(150_000, 3_000));

    // Deletes, including of keys that are not there.
    for i in 0..1_000 {
        dp.delete_flow(key(i * 3)).unwrap();
    }
    for i in 0..250 {
        dp.delete_migration(key(i * 2)).unwrap();
    }
    dp.delete_flow(key(999_999)).unwrap();
    dp.delete_migration(key(999_999)).unwrap();
    assert_eq!(dp.table_counts().unwrap(), exact(149_000, 2_750));
    assert_eq!(walked_flows(&mut dp), 149_000);

    // A dead server's flows removed: every flow of server 1 (migrated
    // flows stay with their server here: owner(i % 4)) and its migrations.
    let removed = dp.remove_flows_of(1).unwrap().len();
    let flows_left = (0..150_000u32)
        .filter(|i| !(i % 3 == 0 && *i < 3_000) && i % 4 != 1)
        .count();
    let migrations_left = (0..3_000u32)
        .filter(|i| !(i % 2 == 0 && *i < 500) && i % 4 != 1)
        .count();
    assert!(removed > 30_000, "{removed} removed");
    assert_eq!(
        dp.table_counts().unwrap(),
        exact(flows_left, migrations_left)
    );
    assert_eq!(walked_flows(&mut dp), flows_left);
    let c = dp.table_counts().unwrap();

    // The trait's view is the same count.
    assert_eq!(dp.table_sizes().unwrap(), (c.flows, c.migrations));
}

#[test]
fn exact_counts_follow_lru_evictions() {
    // A full LRU flow table evicts on insert: the count follows (a
    // counter that missed evictions would pass the capacity).
    let mut dp = load(4_096);
    let (fk, fv) = flows(0..20_000);
    for (k, v) in fk.chunks(1_000).zip(fv.chunks(1_000)) {
        dp.insert_flows_batch(k, v).unwrap();
        let c = dp.table_counts().unwrap();
        assert!(c.exact && c.flows <= 4_096, "{c:?}");
        assert_eq!(c.flows, walked_flows(&mut dp));
    }
    let c = dp.table_counts().unwrap();
    assert!(
        c.flows > 2_000,
        "the table holds most of its capacity: {c:?}"
    );
}

#[test]
fn exact_counts_see_the_xdp_programs_own_inserts() {
    let mut lab = setup();
    assert!(
        lab.dp.exact_counts(),
        "exact counts need Linux 6.6 or later"
    );
    for sport in 41_000..41_050u16 {
        let r = lab
            .dp
            .test_run(&client_tcp(VIP, sport, TCP_SYN), lab.cl, 1)
            .unwrap();
        assert_eq!(r.verdict, XDP_REDIRECT, "SYN {sport} placed");
    }
    // A retransmitted SYN finds its entry.
    lab.dp
        .test_run(&client_tcp(VIP, 41_000, TCP_SYN), lab.cl, 1)
        .unwrap();
    assert_eq!(lab.dp.table_counts().unwrap(), exact(50, 0));
    assert_eq!(walked_flows(&mut lab.dp), 50);
}

#[test]
fn walk_fallback_counts_up_to_the_cap() {
    let mut dp = load(262_144);
    dp.use_walk_counts();
    assert!(!dp.exact_counts());
    let (fk, fv) = flows(0..150_000);
    dp.insert_flows_batch(&fk, &fv).unwrap();
    let (mk, mv) = migrations(0..3_000);
    dp.insert_migrations_batch(&mk, &mv).unwrap();
    assert_eq!(
        dp.table_counts().unwrap(),
        TableCounts {
            flows: TABLE_COUNT_CAP,
            migrations: 3_000,
            exact: false,
        }
    );
    for i in 0..100_000 {
        dp.delete_flow(key(i)).unwrap();
    }
    assert_eq!(
        dp.table_counts().unwrap(),
        TableCounts {
            flows: 50_000,
            migrations: 3_000,
            exact: false,
        }
    );
}

/// switchd itself: `/status` and `/metrics` report exact counts, fresh
/// (taken every 200 ms): held connections show up without any reader
/// having asked before (the namespace lab of `labkit`, root).
#[test]
fn switchd_status_reports_exact_fresh_counts() {
    use capybara_switchd::labkit::{self, Lab};
    if let Err(why) = labkit::lab_available() {
        eprintln!("skipped: {why}");
        return;
    }
    let bin = std::path::PathBuf::from(env!("CARGO_BIN_EXE_switchd"));
    let mut lab = Lab::up("swc", 1).expect("lab up");
    let cfg = lab.switchd_config("a", 1, &[1], 9102, "").unwrap();
    lab.start_switchd(&bin, &cfg, "a.log").unwrap();
    lab.wait_status(9102, Duration::from_secs(10), "switchd active", |s| {
        s["role"] == "active"
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", lab.log("a.log")));
    let _agent = lab
        .register_server(1, 1)
        .unwrap_or_else(|e| panic!("{e}\n{}", lab.log("a.log")));
    lab.wait_status(9102, Duration::from_secs(5), "server live", |s| {
        s["servers"]
            .as_array()
            .is_some_and(|a| a.iter().any(|x| x["state"] == "live"))
    })
    .unwrap();
    let (s, _) = lab
        .wait_status(9102, Duration::from_secs(3), "empty tables", |s| {
            s["flows"] == 0
        })
        .unwrap();
    assert_eq!(s["counts_exact"], true, "{s}");
    let held = lab.connect_many(20, true).unwrap();
    lab.wait_status(9102, Duration::from_secs(3), "20 flows counted", |s| {
        s["flows"] == 20 && s["migrations"] == 0 && s["counts_exact"] == true
    })
    .unwrap();
    let m = lab.fetch(9102, "/metrics").unwrap();
    assert!(
        m.contains("capybara_switchd_flows 20\n")
            && m.contains("capybara_switchd_table_counts_exact 1\n"),
        "{m}"
    );
    drop(held);
}

/// Median time of `f` over `n` runs.
fn median(n: usize, mut f: impl FnMut()) -> Duration {
    let mut t: Vec<Duration> = (0..n)
        .map(|_| {
            let s = Instant::now();
            f();
            s.elapsed()
        })
        .collect();
    t.sort();
    t[n / 2]
}

/// The cost of one count, exact and walked, on the default-size tables
/// (2M-entry flow table, 512K-entry migration table) empty and with 1M
/// flows. Prints one RESULT line.
#[test]
#[ignore = "measurement: run with --ignored --nocapture"]
fn count_cost_exact_against_walk() {
    let mut exact_dp = BpfDataPlane::load(BpfOptions::default()).expect("load (needs root)");
    assert!(exact_dp.exact_counts());
    let mut walk_dp = BpfDataPlane::load(BpfOptions::default()).expect("load (needs root)");
    walk_dp.use_walk_counts();
    let mut line = String::from("RESULT");
    for (label, n) in [("empty", 0u32), ("1m", 1_000_000)] {
        let (fk, fv) = flows(0..n);
        for dp in [&mut exact_dp, &mut walk_dp] {
            dp.insert_flows_batch(&fk, &fv).unwrap();
        }
        assert_eq!(exact_dp.table_counts().unwrap(), exact(n as usize, 0));
        let e = median(1_001, || {
            exact_dp.table_counts().unwrap();
        });
        let w = median(21, || {
            walk_dp.table_counts().unwrap();
        });
        // The whole flow table, as a walk without the cap would read it.
        let full = median(5, || {
            assert_eq!(walk_flows(&mut walk_dp).len(), n as usize);
        });
        line += &format!(
            " exact_{label}_us={:.2} walk_capped_{label}_us={:.0} full_walk_{label}_us={:.0}",
            e.as_secs_f64() * 1e6,
            w.as_secs_f64() * 1e6,
            full.as_secs_f64() * 1e6
        );
    }
    println!("{line}");
}

#[test]
fn a_removed_services_flows_and_migrations_leave_the_real_maps() {
    // Two services, 20,000 flows each (several batches of a walk), 2,000
    // migrations of each: removing one service removes exactly
    // its entries, with the owner each connection had (the migration's
    // server where there is one).
    let mut dp = load(262_144);
    let other = |i: u32| {
        let mut k = key(i);
        k.service_port = 8080u16.to_be();
        k
    };
    let (fk, fv) = flows(0..20_000);
    dp.insert_flows_batch(&fk, &fv).unwrap();
    let ok: Vec<CFlowKey> = (0..20_000).map(other).collect();
    dp.insert_flows_batch(&ok, &fv).unwrap();
    let (mk, mv) = migrations(0..2_000);
    // Migrated to the next server: owner (i + 1) % 4, not the placement.
    let mv: Vec<CMigration> = mv
        .iter()
        .zip(0u32..)
        .map(|(m, i)| CMigration::owner((i + 1) % 4, m.migration_id))
        .collect();
    dp.insert_migrations_batch(&mk, &mv).unwrap();
    let omk: Vec<CFlowKey> = (0..2_000).map(other).collect();
    dp.insert_migrations_batch(&omk, &mv).unwrap();
    assert_eq!(dp.table_counts().unwrap(), exact(40_000, 4_000));

    let svc = CServiceKey::tcp(VIP, 80);
    let mut removed = dp.remove_flows_of_service(svc).unwrap();
    removed.sort_by_key(|(k, _)| {
        let f = FlowKey::from(*k);
        (f.client_ip, f.client_port)
    });
    assert_eq!(removed.len(), 20_000);
    for (i, (k, owner)) in (0u32..).zip(&removed) {
        assert_eq!(*k, key(i));
        let want = if i < 2_000 { (i + 1) % 4 } else { i % 4 };
        assert_eq!(*owner, want, "owner of flow {i}");
    }
    assert_eq!(dp.table_counts().unwrap(), exact(20_000, 2_000));
    assert!(walk_flows(&mut dp)
        .iter()
        .all(|(k, _)| k.service_port == 8080u16.to_be()));
    // Nothing left of it: a second removal finds nothing.
    assert!(dp.remove_flows_of_service(svc).unwrap().is_empty());
}
