//! Weights and the migration policies in the lab (docs/POLICIES.md
//! "Weights"): two servers run the emulated `testserver` app behind the
//! real switch, s2 at weight 5 (its REGISTER's, `[control] weight`), s1 at
//! 1, both policies on (the store's defaults). The load generator's
//! connections land by weight (about five sixths on s2), a uniform load
//! well below either server's capacity: the pool is balanced per unit of
//! weight, so the proactive policy must not shed what the weight gave s2
//! (before 2026-11-24 it compared s2 with the unweighted average, shed
//! connections to s1, and in the demo they came back: ping-pong).
//!
//! Root only (namespaces, XDP). About 20 s.

use capybara_systests::{bin, metric_sum, switchd_lab, wait_loadgen_report};
use std::path::Path;
use std::time::Duration;

fn hostagent_config(dir: &Path, j: u32, key: &Path, weight: u32) -> std::path::PathBuf {
    let t = format!(
        "name = \"s{j}\"\n[interface]\nname = \"eth0\"\n[stack]\naddress = \"198.18.2.{d}\"\ngateway = \"198.18.1.1\"\n\
         [[service]]\nlisten = \"198.18.100.1:80\"\napp = \"testserver\"\nservice_time = \"100us\"\n\
         [migration]\nkey_file = \"{key}\"\nswitch = \"198.18.1.1\"\n\
         [control]\nswitch = \"198.18.1.1:7692\"\nserver_id = {j}\nmanagement = \"198.18.1.{d}\"\nweight = {weight}\n\
         [policy]\nenabled = true\n",
        d = 10 + j,
        key = key.display(),
    );
    let path = dir.join(format!("hostagent-s{j}.toml"));
    std::fs::write(&path, t).expect("write hostagent config");
    path
}

/// Responses per server (s1, s2) in the load generator's timeline rows
/// from `from_ms` on.
fn responses(report: &serde_json::Value, from_ms: f64) -> (u64, u64) {
    let servers: Vec<&str> = report["timeline"]["servers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap_or(""))
        .collect();
    let mut sums = [0u64; 2];
    for row in report["timeline"]["rows"].as_array().unwrap() {
        if row["t_ms"].as_f64().unwrap() < from_ms {
            continue;
        }
        for (name, v) in servers.iter().zip(row["per_server"].as_array().unwrap()) {
            match *name {
                "s1" => sums[0] += v.as_u64().unwrap_or(0),
                "s2" => sums[1] += v.as_u64().unwrap_or(0),
                _ => {}
            }
        }
    }
    (sums[0], sums[1])
}

#[test]
fn a_server_of_weight_five_keeps_the_load_its_weight_gives_it() {
    let (mut lab, dir, key, sw) = switchd_lab("weights_policy_lab", "wp", 2);
    lab.spawn_switchd(&sw, &dir.join("switchd.log"));
    for (j, w) in [(1, 1), (2, 5)] {
        let cfg = hostagent_config(&dir, j, &key, w);
        lab.spawn_hostagent(j, &cfg, &dir.join(format!("hostagent-s{j}.log")));
    }
    lab.wait_registered(&dir.join("switchd.log"), 2);
    lab.wait_vip_http();
    // 36 connections, 3,000 requests/s in all: s2 (~30 connections) at
    // ~25 % of its 10,000 rps, s1 at ~5 %.
    let json = dir.join("loadgen.json");
    lab.spawn_logged(
        "c1",
        bin("capybara-loadgen"),
        &[
            "--target",
            "198.18.100.1:80",
            "--conns",
            "36",
            "--rate",
            "3000",
            "--dist",
            "uniform",
            "--probe",
            "--duration",
            "10s",
            "--timeout",
            "3s",
            "--expect-body",
            "256",
            "--interval",
            "500ms",
            "--json",
            json.to_str().unwrap(),
        ],
        &dir.join("loadgen.log"),
    );
    let report = wait_loadgen_report(&lab, &dir, &json, Duration::from_secs(40));
    let total = |name: &str| -> f64 {
        (1..=2)
            .map(|j| metric_sum(&lab.server_metrics(j), name, "").unwrap_or(0.0))
            .sum()
    };
    let started = total("capybara_policy_migrations_started_total");
    let orders = total("capybara_policy_orders_total");
    let (s1, s2) = responses(&report, 2_000.0);
    println!(
        "policy migrations {started} (orders {orders}), responses from 2 s on: s1 {s1}, s2 {s2}"
    );
    assert_eq!(
        report["errors"].as_u64().unwrap(),
        0,
        "client errors: {}",
        report["errors_by_kind"]
    );
    assert!(s1 > 0 && s2 > 0, "both servers serve: s1 {s1}, s2 {s2}");
    // Balanced per unit of weight: at most a few noise orders in 10 s
    // (each server's Maglev share is what its weight gives it; 36
    // connections put more than 12 on s1 with probability < 0.3 %).
    // 0-1 on a quiet machine, 4 once in a CI with a build running beside
    // it (load skews the per-ms counts the policy reads); the engine
    // ignoring the weights made 12, and the ratio below fails then too.
    assert!(
        started <= 6.0,
        "{started} policy migrations in a pool balanced by weight"
    );
    assert!(
        s2 > 2 * s1,
        "the weight-5 server shed its share: s1 {s1}, s2 {s2}"
    );
}
