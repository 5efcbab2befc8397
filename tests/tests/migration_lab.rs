//! Live migration in the lab, through the real switch data plane (switchd's
//! XDP program) and the real user-space stacks: connections move between
//! servers while the client streams, and the client never notices.

use capybara_systests::{
    bin, deployment_key, hostagent_migrating_config, output_dir, switchd_config, Lab,
};
use std::time::Duration;

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Starts switchd and one migrating hostagent per server; returns when
/// every server answers through the VIP.
fn start(lab: &mut Lab, dir: &std::path::Path, servers: u32, churn_ms: u64) {
    let key = deployment_key(dir);
    let sw = switchd_config(dir, servers, &key);
    lab.spawn_logged(
        "sw",
        bin("switchd"),
        &["--config", sw.to_str().unwrap()],
        &dir.join("switchd.log"),
    );
    for j in 1..=servers {
        // Each server hands its connections to the next one.
        let churn = (churn_ms > 0).then_some((churn_ms, j % servers + 1));
        let cfg = hostagent_migrating_config(dir, j, &key, churn);
        let log = dir.join(format!("hostagent-s{j}.log"));
        let metrics = format!("198.18.1.{}:9100", 10 + j);
        lab.spawn_logged(
            &format!("s{j}"),
            bin("hostagent"),
            &["--config", cfg.to_str().unwrap(), "--metrics", &metrics],
            &log,
        );
    }
    let registered = || {
        let log = std::fs::read_to_string(dir.join("switchd.log")).unwrap_or_default();
        (1..=servers).all(|j| log.contains(&format!("registered s{j}")))
    };
    lab.wait_for(
        "every server to register with switchd",
        Duration::from_secs(30),
        registered,
    );
    let answers = || {
        lab.run(
            "c1",
            "curl",
            &["-s", "-m", "1", "-o", "/dev/null", "http://198.18.100.1/"],
            Duration::from_secs(5),
        )
        .status
        .success()
    };
    lab.wait_for("the VIP to answer", Duration::from_secs(30), answers);
}

fn migrations_out(
    dir: &std::path::Path,
    servers: u32,
) -> (usize, std::collections::HashSet<String>) {
    let mut n = 0;
    let mut peers = std::collections::HashSet::new();
    for j in 1..=servers {
        let log =
            std::fs::read_to_string(dir.join(format!("hostagent-s{j}.log"))).unwrap_or_default();
        for l in log.lines().filter(|l| l.contains(" migrated to ")) {
            n += 1;
            if let Some(p) = l.split_whitespace().find_map(|w| w.strip_prefix("peer=")) {
                peers.insert(p.to_string());
            }
        }
    }
    (n, peers)
}

fn assert_no_resets(lab: &Lab, servers: u32) {
    for j in 1..=servers {
        let out = lab.run(
            &format!("s{j}"),
            "curl",
            &[
                "-s",
                "-m",
                "2",
                &format!("http://198.18.1.{}:9100/metrics", 10 + j),
            ],
            Duration::from_secs(5),
        );
        let text = String::from_utf8_lossy(&out.stdout);
        for l in text
            .lines()
            .filter(|l| l.starts_with("capybara_tcp_resets_sent_total"))
        {
            assert!(l.ends_with(" 0"), "server s{j} sent resets: {l}");
        }
    }
}

/// A connection migrated back and forth between two servers every
/// `CAPYBARA_CHURN_MS` (default 1 ms) while the client streams
/// `CAPYBARA_MIGRATION_BYTES` (default 1 GiB) of bidirectional echo.
#[test]
fn echo_stream_survives_migration_back_and_forth() {
    let dir = output_dir("migration_lab_churn");
    let mut lab = Lab::up("mc", 2);
    let churn = env_u64("CAPYBARA_CHURN_MS", 1);
    start(&mut lab, &dir, 2, churn);
    let bytes = env_u64("CAPYBARA_MIGRATION_BYTES", 1 << 30);
    let out = lab.run(
        "c1",
        bin("capybara-echo-client").to_str().unwrap(),
        &["198.18.100.1:7", &bytes.to_string(), "--timeout-s", "60"],
        Duration::from_secs(1800),
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "echo failed: {stdout} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("ok=true"), "{stdout}");
    let (n, _) = migrations_out(&dir, 2);
    assert!(n >= 10, "only {n} migrations happened");
    println!("{bytes} bytes echoed byte-exact across {n} migrations");
    assert_no_resets(&lab, 2);
}

/// 1,000 concurrent connections, each migrated at least once while in use.
///
/// Ignored until fixed: with 1,000 concurrent connections churning every
/// 200 ms, a few connections that migrate while closing (LAST-ACK /
/// FIN-WAIT) get reset or stall (seen 2026-11-22: 22 RSTs sent, one client
/// stuck in FIN-WAIT-1). Run it with `cargo test --release -p
/// capybara-systests --test migration_lab -- --ignored`.
#[test]
#[ignore = "known bug: migrations of closing connections under 1,000-connection churn reset a few of them"]
fn thousand_connections_each_migrate_while_in_use() {
    let dir = output_dir("migration_lab_thousand");
    let mut lab = Lab::up("mt", 2);
    start(
        &mut lab,
        &dir,
        2,
        env_u64("CAPYBARA_THOUSAND_CHURN_MS", 200),
    );
    let conns = env_u64("CAPYBARA_MIGRATION_CONNECTIONS", 1000);
    let out = lab.run(
        "c1",
        bin("capybara-echo-client").to_str().unwrap(),
        &[
            "198.18.100.1:7",
            "200000",
            "--chunk",
            "4096",
            "--connections",
            &conns.to_string(),
            "--timeout-s",
            "60",
        ],
        Duration::from_secs(900),
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "echo failed: {stdout} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (n, peers) = migrations_out(&dir, 2);
    assert!(
        peers.len() as u64 >= conns,
        "only {} of {conns} connections migrated ({n} migrations)",
        peers.len()
    );
    assert_no_resets(&lab, 2);
}
