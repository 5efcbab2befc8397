//! The operators' migration feed (issue #9) end to end (root; release
//! binaries, or `CAPYBARA_BIN_DIR`): `capybara run` (switchd + API) in the
//! lab, two hostagents, a real Linux client holding established echo
//! connections. Server 1's churn option migrates everything it serves to
//! server 2; one connection is also migrated through the API. Nobody asks
//! the API about the churn, yet `GET /v1/migrations` lists those migrations
//! (trigger `churn`, outcome `succeeded`, phase timings from both hosts),
//! the requested one is completed by its origin's report (trigger
//! `manual`, phases), and `/metrics` counts them in the outcome counter and
//! the per-phase histograms. The connections keep working byte-exact. A
//! migration requested for a connection its server does not serve (a
//! handshake that never completed: the switch and the store know the flow,
//! the server has accepted no connection) ends `rejected` with the server's
//! reason within a report poll, not after the API's 5 s store watch.
//!
//! Path under test: hostagent MIGRATION_REPORT -> switchd ring ->
//! `GET /migrations` -> the API's poller -> log, SSE, metrics.

use capybara_systests::{bin, deployment_key, hostagent_migrating_config, output_dir, Lab};
use std::path::{Path, PathBuf};
use std::time::Duration;

const SERVERS: u32 = 2;
const CONNS: usize = 8;
const API: &str = "http://127.0.0.1:18082";
const CLIENT_IP: &str = "198.18.0.11";
/// Source of the half-open flow: on the client link, but no host has it, so
/// the server's SYN-ACKs go nowhere (and no client kernel resets them).
const GHOST_IP: &str = "198.18.0.99";
const GHOST_PORT: u16 = 40999;

/// One SYN from `GHOST_IP:GHOST_PORT` to the VIP's echo port, sent from the
/// client node (raw socket, its own IPv4 header).
const GHOST_SYN: &str = r#"
import socket, struct, sys
src, dst, sport = sys.argv[1], "198.18.100.1", int(sys.argv[2])
def csum(b):
    if len(b) % 2:
        b += b"\0"
    s = sum(struct.unpack("!%dH" % (len(b) // 2), b))
    s = (s >> 16) + (s & 0xFFFF)
    s += s >> 16
    return ~s & 0xFFFF
tcp = struct.pack("!HHIIBBHHH", sport, 7, 0x12345678, 0, 5 << 4, 0x02, 64240, 0, 0)
pseudo = socket.inet_aton(src) + socket.inet_aton(dst) + struct.pack("!BBH", 0, 6, len(tcp))
tcp = tcp[:16] + struct.pack("!H", csum(pseudo + tcp)) + tcp[18:]
ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(tcp), 0, 0, 64, 6, 0,
                 socket.inet_aton(src), socket.inet_aton(dst))
s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
s.sendto(ip + tcp, (dst, 0))
"#;

fn appliance_config(lab: &Lab, dir: &Path, key: &Path) -> PathBuf {
    capybara_systests::appliance_config(lab, dir, SERVERS, key, "127.0.0.1:18082")
}

/// `curl` inside the switch namespace: (status, body).
fn api(lab: &Lab, token: &str, method: &str, path: &str, json: Option<&str>) -> (u16, String) {
    lab.api_call(API, token, method, path, json)
}

/// The `items` of a `GET /v1/migrations` body.
fn items(body: &str) -> Vec<serde_json::Value> {
    serde_json::from_str::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v.get("items").and_then(|i| i.as_array().cloned()))
        .unwrap_or_default()
}

/// Migration `id` from `GET /v1/migrations` (`Null` while it is not listed).
fn migration(lab: &Lab, token: &str, id: u64) -> serde_json::Value {
    let (_, body) = api(
        lab,
        token,
        "GET",
        &format!("/v1/migrations?after={}&limit=1000", id - 1),
        None,
    );
    items(&body)
        .into_iter()
        .find(|m| m["id"].as_u64() == Some(id))
        .unwrap_or_default()
}

fn phase(m: &serde_json::Value, p: &str) -> Option<u64> {
    m["phases"][p].as_u64()
}

/// A Prometheus sample's value (exact label set).
fn sample(metrics: &str, series: &str) -> Option<f64> {
    metrics.lines().find_map(|l| {
        l.strip_prefix(series)?
            .strip_prefix(' ')?
            .trim()
            .parse()
            .ok()
    })
}

#[test]
fn churn_and_requested_migrations_reach_the_api_with_phase_timings() {
    let dir = output_dir("migration_feed");
    let mut lab = Lab::up("mf", SERVERS);
    let key = deployment_key(&dir);
    let config = appliance_config(&lab, &dir, &key);
    let log = dir.join("capybara.log");
    lab.spawn_logged(
        "sw",
        bin("capybara"),
        &["run", config.to_str().unwrap()],
        &log,
    );
    // Server 1 moves everything it serves to server 2 every 300 ms.
    for j in 1..=SERVERS {
        let churn = (j == 1).then_some((300, 2));
        let cfg = hostagent_migrating_config(&dir, j, &key, churn);
        // Only the churn and the test move connections: a load policy
        // moving the connection the test picked would make its MIGRATE
        // find nothing to move.
        capybara_systests::disable_policies(&cfg);
        lab.spawn_hostagent(j, &cfg, &dir.join(format!("hostagent-s{j}.log")));
    }
    let read_log = || std::fs::read_to_string(&log).unwrap_or_default();
    lab.wait_for("every server to register", Duration::from_secs(30), || {
        let l = read_log();
        (1..=SERVERS).all(|j| l.contains(&format!("registered s{j}")))
    });
    lab.wait_for("the API", Duration::from_secs(30), || {
        api(&lab, "", "GET", "/healthz", None).0 == 200
    });
    let token = std::fs::read_to_string(dir.join("admin-token"))
        .expect("admin token file")
        .trim()
        .to_string();

    let mut holder = capybara_systests::EchoHolder::start(&lab, CONNS);

    // Churn migrations, listed without anyone asking the API for them.
    let mut listed = Vec::new();
    lab.wait_for(
        "churn migrations with phase timings in GET /v1/migrations",
        Duration::from_secs(30),
        || {
            let (code, body) = api(&lab, &token, "GET", "/v1/migrations?limit=1000", None);
            listed = items(&body);
            code == 200
                && listed.iter().any(|m| {
                    m["trigger"] == "churn"
                        && m["outcome"] == "succeeded"
                        && phase(m, "import_us").is_some()
                })
        },
    );
    let churned: Vec<&serde_json::Value> = listed
        .iter()
        .filter(|m| m["trigger"] == "churn" && m["outcome"] == "succeeded")
        .collect();
    println!(
        "{} migrations listed, {} churn successes; first: {}",
        listed.len(),
        churned.len(),
        churned[0]
    );
    for m in &churned {
        assert_eq!(
            (m["origin"].as_u64(), m["target"].as_u64()),
            (Some(1), Some(2)),
            "{m}"
        );
        for p in ["prepare_us", "export_us", "transfer_us", "total_us"] {
            assert!(phase(m, p).is_some(), "{p} missing: {m}");
        }
        let conn = m["connection"].as_str().unwrap_or("");
        assert!(
            conn.starts_with(&format!("{CLIENT_IP}:")) && conn.ends_with("-198.18.100.1:7"),
            "{m}"
        );
        // The total covers the origin's phases.
        let total = phase(m, "total_us").unwrap();
        assert!(total >= phase(m, "prepare_us").unwrap(), "{m}");
        assert!(
            m["finished_unix_ms"].as_u64() >= m["started_unix_ms"].as_u64(),
            "{m}"
        );
    }
    assert_eq!(
        holder.round_trip(),
        "ok",
        "echo round trip over every connection"
    );

    // A migration requested through the API is completed by its report.
    // Churn empties server 1: take a connection on server 2 back to 1.
    let (_, conns) = api(
        &lab,
        &token,
        "GET",
        "/v1/connections?server=2&limit=100",
        None,
    );
    let conns: serde_json::Value = serde_json::from_str(&conns).expect("connections JSON");
    let conn = conns["items"]
        .as_array()
        .and_then(|a| a.first())
        .and_then(|c| c["id"].as_str())
        .expect("a connection on server 2")
        .to_string();
    let (code, body) = api(
        &lab,
        &token,
        "POST",
        &format!("/v1/connections/{conn}/migrate"),
        Some("{\"target\": 1}"),
    );
    assert!(code == 200 || code == 202, "migrate: {code} {body}");
    let requested: serde_json::Value = serde_json::from_str(&body).expect("migration JSON");
    let id = requested["id"].as_u64().expect("migration id");
    let mut manual = serde_json::Value::Null;
    lab.wait_for(
        "the requested migration completed with phase timings",
        Duration::from_secs(15),
        || {
            manual = migration(&lab, &token, id);
            manual["outcome"] == "succeeded" && phase(&manual, "prepare_us").is_some()
        },
    );
    println!("requested: {manual}");
    assert_eq!(manual["trigger"], "manual");
    assert_eq!(manual["connection"], conn.as_str());
    assert_eq!(
        (manual["origin"].as_u64(), manual["target"].as_u64()),
        (Some(2), Some(1))
    );

    // A migration the server cannot start: a flow the switch placed and
    // stored (its SYN passed) but no connection the server serves (the
    // handshake never completes). The origin's NOT_STARTED report ends the
    // entry as `rejected`, naming why, well before the 5 s store watch.
    let ghost = format!("{GHOST_IP}:{GHOST_PORT}-198.18.100.1:7");
    let out = lab.run(
        "c1",
        "python3",
        &["-c", GHOST_SYN, GHOST_IP, &GHOST_PORT.to_string()],
        Duration::from_secs(10),
    );
    assert!(
        out.status.success(),
        "raw SYN: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut asked = None;
    lab.wait_for(
        "the half-open flow in the store",
        Duration::from_secs(5),
        || {
            let (code, body) = api(
                &lab,
                &token,
                "POST",
                &format!("/v1/connections/{ghost}/migrate"),
                Some("{}"),
            );
            if code == 200 || code == 202 {
                asked = Some((std::time::Instant::now(), body));
            }
            asked.is_some()
        },
    );
    let (t0, body) = asked.unwrap();
    let requested: serde_json::Value = serde_json::from_str(&body).expect("migration JSON");
    let id = requested["id"].as_u64().expect("migration id");
    let mut refused = serde_json::Value::Null;
    lab.wait_for(
        "the migration that could not start to end",
        Duration::from_secs(10),
        || {
            refused = migration(&lab, &token, id);
            refused["outcome"] != "in_progress" && !refused.is_null()
        },
    );
    let took = t0.elapsed();
    println!("not started: {refused} (ended {took:?} after the request)");
    assert_eq!(refused["outcome"], "rejected", "{refused}");
    assert_eq!(refused["trigger"], "manual");
    assert_eq!(refused["connection"], ghost.as_str());
    let reason = refused["reason"].as_str().unwrap_or("");
    assert!(
        reason.contains("did not start it: no such connection is served there"),
        "{refused}"
    );
    assert!(
        took < Duration::from_secs(3),
        "took {took:?}: the report should end it, not the store watch"
    );

    // /metrics: outcome counter and per-phase histograms.
    let (code, metrics) = api(&lab, "", "GET", "/metrics", None);
    assert_eq!(code, 200);
    let succeeded = sample(&metrics, "capybara_migrations_total{outcome=\"succeeded\"}");
    assert!(
        succeeded.unwrap_or(0.0) >= churned.len() as f64,
        "{succeeded:?}"
    );
    for p in ["prepare", "export", "transfer", "import", "total"] {
        let n = sample(
            &metrics,
            &format!("capybara_migration_phase_seconds_count{{phase=\"{p}\"}}"),
        );
        assert!(n.unwrap_or(0.0) >= 1.0, "phase {p}: {n:?}");
    }
    let rejected = sample(&metrics, "capybara_migrations_total{outcome=\"rejected\"}");
    assert!(rejected.unwrap_or(0.0) >= 1.0, "{rejected:?}");
    let fast = sample(
        &metrics,
        "capybara_migration_phase_seconds_bucket{phase=\"total\",le=\"0.1\"}",
    );
    println!("total <= 100 ms: {fast:?} of {succeeded:?} succeeded");

    // switchd's own view: reports received, none rejected.
    let status = lab.run(
        "sw",
        "curl",
        &["-s", "-m", "5", "http://127.0.0.1:9102/migrations?limit=1"],
        Duration::from_secs(10),
    );
    let page: serde_json::Value =
        serde_json::from_slice(&status.stdout).expect("switchd /migrations JSON");
    assert!(page["received"].as_u64().unwrap_or(0) >= 2, "{page}");

    assert_eq!(
        holder.round_trip(),
        "ok",
        "echo round trip over every connection"
    );
    lab.assert_no_resets(1..=SERVERS);
    drop(holder);
}
