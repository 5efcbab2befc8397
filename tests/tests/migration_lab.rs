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
    let sw = switchd_config(lab, dir, servers, &key);
    lab.spawn_switchd(&sw, &dir.join("switchd.log"));
    for j in 1..=servers {
        // Each server hands its connections to the next one.
        let churn = (churn_ms > 0).then_some((churn_ms, j % servers + 1));
        let cfg = hostagent_migrating_config(dir, j, &key, churn);
        if churn.is_some() {
            // The churn alone decides what migrates: the load policies would
            // move connections too and make runs differ.
            capybara_systests::disable_policies(&cfg);
        }
        let log = dir.join(format!("hostagent-s{j}.log"));
        lab.spawn_hostagent(j, &cfg, &log);
    }
    lab.wait_registered(&dir.join("switchd.log"), servers);
    lab.wait_vip_http();
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

/// Server `j`'s Prometheus metrics (`Lab::server_metrics`), also kept in
/// the output directory.
fn metrics(lab: &Lab, dir: &std::path::Path, j: u32) -> String {
    let text = lab.server_metrics(j);
    let _ = std::fs::write(dir.join(format!("metrics-s{j}.txt")), &text);
    text
}

/// Keeps every server's metrics in the output directory, then checks that
/// none sent a reset (`Lab::assert_no_resets`).
fn assert_no_resets(lab: &Lab, dir: &std::path::Path, servers: u32) {
    for j in 1..=servers {
        metrics(lab, dir, j);
    }
    lab.assert_no_resets(1..=servers);
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
    assert_no_resets(&lab, &dir, 2);
}

/// 1,000 concurrent connections, each migrated at least once while in use.
///
/// The client starts 1,000 echo streams (one process each; starting them
/// takes a few seconds) of 200,000 bytes, 4 KiB every
/// `CAPYBARA_THOUSAND_PACE_MS` (default 400 ms): each stream is in use for
/// ~20 s, so all 1,000 are open at once for most of the run. Both servers
/// churn every connection they serve to the other one, those that
/// completed fewest migrations first. Asserted: every stream byte-exact
/// (the client checks), every connection migrated at least once while its
/// echo task served it (its origin's "migrated to" line), no RST from
/// either server.
///
/// Fixed on the way (2026-11-22, see docs/MIGRATION.md "Closing
/// connections"): switchd reaped a migrated flow 5 s after the *client's*
/// FIN while the server still streamed; engine decisions reached the stack
/// only after a whole receive batch; a released connection was exported in
/// LAST-ACK; the churn counted failed attempts as moves (a connection whose
/// migration resumed went to the back of the queue) and the client's
/// streams did not overlap (the old unpaced streams ended before the last
/// ones started, so a connection had a few hundred ms to be picked).
///
/// Under load the servers fall ~0.5 s behind (their echoed TSecr lags),
/// resend data the client has long acknowledged, and the client answers
/// each resend with a duplicate ACK; the duplicates still queued when the
/// final ACK closes the LAST-ACK connection used to find no connection and
/// draw a RST (the CI flake: 10 RSTs after 10 `unexpected` drops). The
/// endpoint now drops non-SYN segments of a tuple it closed from LAST-ACK
/// for 2 s (`recently_closed` drops; docs/MIGRATION.md "Closing
/// connections"). Still open: at load averages above ~40 a starved server
/// misses its heartbeats for 1 s, switchd declares it dead, and the flows
/// it took in are reset by their placement server.
///
/// `CAPYBARA_THOUSAND_PACE_MS=0` is the unpaced overload variant (full
/// queues, 2 shared cores): only about a third of the connections migrate
/// before their stream ends. `CAPYBARA_LAB_PCAP=1` keeps pcaps (tcpdump)
/// in the output directory.
#[test]
fn thousand_connections_each_migrate_while_in_use() {
    let dir = output_dir("migration_lab_thousand");
    let mut lab = Lab::up("mt", 2);
    start(
        &mut lab,
        &dir,
        2,
        env_u64("CAPYBARA_THOUSAND_CHURN_MS", 200),
    );
    if std::env::var_os("CAPYBARA_LAB_PCAP").is_some() {
        // Diagnosis: TCP headers as the client sees them, and TCP + TCPMig
        // as each server sees them.
        for (node, filter) in [
            ("c1", "tcp"),
            ("s1", "tcp or udp port 7690"),
            ("s2", "tcp or udp port 7690"),
        ] {
            let pcap = dir.join(format!("{node}.pcap"));
            lab.spawn_logged(
                node,
                "tcpdump",
                &[
                    "-i",
                    "any",
                    "-n",
                    "-s",
                    "128",
                    "-U",
                    "-B",
                    "32768",
                    "-w",
                    pcap.to_str().unwrap(),
                    filter,
                ],
                &dir.join(format!("tcpdump-{node}.log")),
            );
        }
        std::thread::sleep(Duration::from_secs(1));
    }
    let conns = env_u64("CAPYBARA_MIGRATION_CONNECTIONS", 1000);
    // 49 chunks of 4 KiB, one every `pace` ms: each stream is in use for
    // ~20 s, longer than starting all of them takes, so all overlap.
    let pace = env_u64("CAPYBARA_THOUSAND_PACE_MS", 400);
    let out = lab.run(
        "c1",
        bin("capybara-echo-client").to_str().unwrap(),
        &[
            "198.18.100.1:7",
            "200000",
            "--chunk",
            "4096",
            "--pace-ms",
            &pace.to_string(),
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
    let tcpmig: Vec<String> = (1..=2)
        .flat_map(|j| {
            metrics(&lab, &dir, j)
                .lines()
                .filter(|l| {
                    l.starts_with("capybara_tcpmig_events_total")
                        || l.starts_with("capybara_tcp_resets_sent_total")
                        || l.starts_with("capybara_tcp_segment_drops_total")
                })
                .map(str::to_string)
                .collect::<Vec<_>>()
        })
        .collect();
    println!(
        "{} of {conns} connections migrated ({n} migrations)\n{}",
        peers.len(),
        tcpmig.join("\n")
    );
    assert!(
        peers.len() as u64 >= conns,
        "only {} of {conns} connections migrated ({n} migrations)",
        peers.len()
    );
    assert_no_resets(&lab, &dir, 2);
}
