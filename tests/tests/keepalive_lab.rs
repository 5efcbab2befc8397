//! TCP keep-alive drops the connections of a client that vanished without
//! FIN or RST (lab, root; release binaries, or `CAPYBARA_BIN_DIR`): a real
//! Linux client in c1 holds echo connections to a hostagent whose `[tcp]`
//! keep-alive is short (idle 1 s, interval 300 ms, 3 probes). While the
//! client answers, idle connections stay open however long they idle (the
//! probes are answered by the client's kernel). Then some of them go
//! silent: every packet of theirs is dropped inside c1, both ways, as when
//! the client host crashed or a NAT forgot them. The hostagent drops
//! exactly those within idle + probes x interval: its metrics count the
//! probes and the timed-out connections, and switchd's `/status` (what the
//! API, the dashboard and the policies see) no longer lists them; the
//! connection whose client answers still echoes. Before, nothing probed an
//! idle connection and such connections were reported forever.

use capybara_systests::{
    appliance_lab, disable_policies, metric_sum, start_appliance, stop_appliance,
    switchd_status_server, wait_appliance_ready, EchoHolder, Lab,
};
use std::time::{Duration, Instant};

const API: &str = "http://127.0.0.1:18098";
const IDLE_MS: u64 = 1000;
const INTERVAL_MS: u64 = 300;
const PROBES: u64 = 3;
/// Connections whose client goes silent.
const SILENT: usize = 4;

/// Server 1's connections in its heartbeats (switchd's `/status`).
fn reported(lab: &Lab) -> Option<u64> {
    switchd_status_server(lab, 1).and_then(|s| s["connections"].as_u64())
}

/// A counter or gauge of server 1's hostagent metrics (0 when absent).
fn metric(lab: &Lab, name: &str, label: &str) -> f64 {
    metric_sum(&lab.server_metrics(1), name, label).unwrap_or(0.0)
}

#[test]
fn keepalive_drops_connections_whose_client_vanished() {
    let (mut lab, dir, key, config) = appliance_lab("keepalive_lab", "kal", 1, "127.0.0.1:18098");
    let log = dir.join("capybara.log");
    let mut app = start_appliance(&lab, &config, &log);
    lab.start_hostagents_with(&dir, &key, 1, |_, cfg| {
        disable_policies(cfg);
        let mut t = std::fs::read_to_string(cfg).unwrap();
        t.push_str(&format!(
            "[tcp]\nkeepalive = true\nkeepalive_idle_ms = {IDLE_MS}\n\
             keepalive_interval_ms = {INTERVAL_MS}\nkeepalive_probes = {PROBES}\n"
        ));
        std::fs::write(cfg, t).unwrap();
    });
    wait_appliance_ready(&lab, &log, 1, API, &dir);

    let mut silent = EchoHolder::start(&lab, SILENT);
    let mut answering = EchoHolder::start(&lab, 1);
    let all = (SILENT + 1) as u64;
    lab.wait_for(
        "the connections in /status",
        Duration::from_secs(10),
        || reported(&lab) == Some(all),
    );

    // Idle for several keep-alive periods while the client answers: the
    // probes are sent and answered, nothing is dropped.
    let probes0 = metric(&lab, "capybara_tcp_keepalive_probes_total", "");
    std::thread::sleep(Duration::from_millis(4 * IDLE_MS));
    let probes1 = metric(&lab, "capybara_tcp_keepalive_probes_total", "");
    eprintln!("keep-alive probes while idle 4 s: {}", probes1 - probes0);
    assert!(
        probes1 - probes0 >= all as f64 * 2.0,
        "idle connections are probed: {probes0} -> {probes1}"
    );
    assert_eq!(reported(&lab), Some(all), "answered probes keep them");
    assert_eq!(
        metric(&lab, "capybara_tcp_connections_timed_out_total", ""),
        0.0
    );
    assert_eq!(answering.round_trip(), "ok");
    assert_eq!(silent.round_trip(), "ok");
    let last_activity = Instant::now();

    // The silent client's packets vanish both ways inside c1: no FIN, no
    // RST, no answer to a probe (its kernel never sees them).
    let mut rules = String::new();
    for p in &silent.ports {
        rules.push_str(&format!(
            "iptables -A INPUT -p tcp --dport {p} -j DROP && \
             iptables -A OUTPUT -p tcp --sport {p} -j DROP && "
        ));
    }
    rules.push_str("true");
    let out = lab.run("c1", "sh", &["-c", &rules], Duration::from_secs(20));
    assert!(
        out.status.success(),
        "iptables: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let cut = last_activity.elapsed();

    let bound = Duration::from_millis(IDLE_MS + PROBES * INTERVAL_MS);
    lab.wait_for(
        "the silent connections to leave /status",
        bound + Duration::from_secs(10),
        || reported(&lab) == Some(1),
    );
    let gone = last_activity.elapsed();
    eprintln!(
        "silent connections gone from /status {:.2} s after their last activity \
         (rules in place after {:.2} s; keep-alive bound {:.2} s)",
        gone.as_secs_f64(),
        cut.as_secs_f64(),
        bound.as_secs_f64()
    );
    // Never before the configured probes ran out; within the bound plus
    // the heartbeat and the polling here (a few hundred ms; more when the
    // machine is loaded).
    assert!(
        gone >= bound - Duration::from_millis(200),
        "dropped after {gone:?}, before idle + probes x interval ({bound:?})"
    );
    assert!(
        gone <= bound + Duration::from_secs(5),
        "dropped after {gone:?}: keep-alive bound {bound:?}"
    );
    let timed_out = metric(&lab, "capybara_tcp_connections_timed_out_total", "");
    assert_eq!(timed_out, SILENT as f64, "the silent ones timed out");
    assert_eq!(
        metric(&lab, "capybara_tcp_connections", "state=\"Established\""),
        1.0
    );

    // The answering connection idles on, probed and answering, and echoes.
    std::thread::sleep(Duration::from_millis(3 * IDLE_MS));
    assert_eq!(reported(&lab), Some(1));
    assert_eq!(answering.round_trip(), "ok");
    assert_eq!(
        metric(&lab, "capybara_tcp_connections_timed_out_total", ""),
        SILENT as f64
    );
    assert_eq!(answering.close(), "closed");
    drop(silent);
    assert!(stop_appliance(&mut app).success());
}
