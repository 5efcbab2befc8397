//! Host CPU per migration with warm caches and no other job: the floor of
//! `make bench-migration`'s `host_cpu_p50_us` (docs/BENCHMARKS.md).
//!
//! The deterministic four-party harness (`common`: production `Interface`,
//! `Transports`, `Endpoint`, `Engine` and `Migrator`, in one process on a
//! virtual clock) moves one echo connection with data in flight back and
//! forth ~2,000 times. Each server's `Migrator` times its TCPMig calls as in
//! the lab (`CAPYBARA_MIGRATION_TELEMETRY`: `migrate_out`, every datagram
//! received with the export/import it triggers, every datagram encoded);
//! the test sums origin + target per migration from the two dump files and
//! prints the percentiles. Timing, not behaviour: ignored by default. Run:
//! `cargo test --release -p capybara-hostagent --test migration_cpu --
//! --ignored --nocapture`.

mod common;

use capybara_hostagent::migration::Outcome;
use capybara_proto::time::{Duration, Instant};
use common::*;
use std::collections::HashMap;

#[test]
#[ignore]
fn host_cpu_per_migration_warm() {
    let dir = std::env::temp_dir().join(format!("capybara-migration-cpu-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // Read by `Migrator::new` (each server writes DIR/telemetry-ADDR.log).
    std::env::set_var("CAPYBARA_MIGRATION_TELEMETRY", &dir);
    // Small queues keep the snapshot near the lab's (~250 bytes: 64-byte
    // echoes every millisecond): this client streams as fast as it can.
    let mut w = echo_world_with_queues(2 * 1024);
    let wanted = 2_000;
    let mut next = Instant::from_millis(1);
    let limit = Instant::from_millis(600_000);
    while w.started.len() < wanted + 50 {
        if w.run_until(next, |w| w.client.done()) || w.now >= limit {
            break;
        }
        if !w.any_migrating() {
            let _ = w.migrate(w.started.len() % 2 == 0);
        }
        next = w.now + Duration::from_micros(200);
    }
    let moved = w
        .outcomes()
        .iter()
        .filter(|(_, _, o)| *o == Outcome::MigratedOut)
        .count();
    drop(w);
    // The dump's writer thread ends once its channel closes.
    std::thread::sleep(std::time::Duration::from_millis(500));
    let mut per_id: HashMap<String, [u64; 2]> = HashMap::new();
    // Per step, origin then target: start, rx by kind, tx by kind.
    let mut steps: HashMap<String, Vec<u64>> = HashMap::new();
    let mut snap_bytes = Vec::new();
    for entry in std::fs::read_dir(&dir).unwrap() {
        let text = std::fs::read_to_string(entry.unwrap().path()).unwrap();
        for line in text.lines().filter(|l| l.starts_with("mig ")) {
            let field = |k: &str| {
                line.split_whitespace()
                    .find_map(|w| w.strip_prefix(k))
                    .unwrap_or("")
                    .to_string()
            };
            if field("outcome=") != "MigratedOut" && field("outcome=") != "MigratedIn" {
                continue;
            }
            let sum = |s: String| {
                s.split(',')
                    .filter_map(|x| x.parse::<u64>().ok())
                    .sum::<u64>()
            };
            let ns =
                sum(field("cpu_start_ns=")) + sum(field("cpu_rx_ns=")) + sum(field("cpu_tx_ns="));
            let role = usize::from(field("role=") == "in");
            for (k, v) in [("start", field("cpu_start_ns="))]
                .into_iter()
                .chain([("rx", field("cpu_rx_ns=")), ("tx", field("cpu_tx_ns="))])
            {
                for (i, x) in v.split(',').enumerate() {
                    let x: u64 = x.parse().unwrap_or(0);
                    if x > 0 {
                        steps
                            .entry(format!("{} {k}[{i}]", field("role=")))
                            .or_default()
                            .push(x);
                    }
                }
            }
            if role == 1 {
                snap_bytes.push(field("snapshot_bytes=").parse::<u64>().unwrap_or(0));
            }
            per_id.entry(field("id=")).or_default()[role] = ns;
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    let mut totals: Vec<u64> = per_id
        .values()
        .filter(|[o, t]| *o > 0 && *t > 0)
        .map(|[o, t]| o + t)
        .collect();
    let mut origin: Vec<u64> = per_id.values().map(|v| v[0]).filter(|&x| x > 0).collect();
    let mut target: Vec<u64> = per_id.values().map(|v| v[1]).filter(|&x| x > 0).collect();
    assert!(
        totals.len() >= 1_000,
        "only {} migrations joined ({moved} migrated out)",
        totals.len()
    );
    let pct = |v: &mut Vec<u64>, p: f64| {
        v.sort_unstable();
        v[((v.len() - 1) as f64 * p) as usize] as f64 / 1000.0
    };
    let mut keys: Vec<_> = steps.keys().cloned().collect();
    keys.sort();
    for k in keys {
        let v = steps.get_mut(&k).unwrap();
        println!("step {k:12} p50_us={:.2} n={}", pct(v, 0.5), v.len());
    }
    println!("snapshot bytes p50 {}", pct(&mut snap_bytes, 0.5) * 1000.0);
    println!(
        "RESULT warm_host_cpu_p50_us={:.2} warm_host_cpu_p90_us={:.2} warm_host_cpu_p99_us={:.2} \
         origin_p50_us={:.2} target_p50_us={:.2} migrations={}",
        pct(&mut totals, 0.5),
        pct(&mut totals, 0.9),
        pct(&mut totals, 0.99),
        pct(&mut origin, 0.5),
        pct(&mut target, 0.5),
        totals.len()
    );
}
