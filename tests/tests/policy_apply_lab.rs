//! The store policy's liveness and migration-engine keys apply (lab, root;
//! release binaries, or `CAPYBARA_BIN_DIR`): two hostagents behind the
//! appliance (switchd + API, SQLite store).
//!
//! - The store holds no policy at the start: switchd seeds it with its
//!   config's `heartbeat_interval_ms` / `dead_after_ms` (100 / 1200 here,
//!   not the defaults), and `GET /v1/policy` shows them.
//! - `PATCH /v1/policy {"heartbeat_interval_ms": 400}`: the servers beat
//!   about every 400 ms (switchd's count of accepted heartbeats).
//! - Then `{"heartbeat_interval_ms": 100, "dead_after_ms": 350}`: 350 ms
//!   is less than the interval the servers beat at until the new
//!   REGISTER_ACK reaches them; switchd holds 1200 ms in force for two of
//!   its periods (`/status` liveness), no server is declared dead, the
//!   servers beat every 100 ms again, and afterwards 350 ms is in force: a
//!   hostagent frozen (SIGSTOP) is declared dead after 350 ms (the log
//!   names it) and comes back when continued.
//! - `{"migration_deadline_ms": 80, "buffer_mode": "drop"}` reaches both
//!   hostagents (their logs) and switchd's `/status`.

use capybara_systests::{
    appliance_lab, log_of, start_appliance, stop_appliance, wait_appliance_ready, Lab,
};
use std::time::{Duration, Instant};

const SERVERS: u32 = 2;
const API: &str = "http://127.0.0.1:18084";

fn status(lab: &Lab) -> serde_json::Value {
    let out = lab.try_run(
        "sw",
        "curl",
        &["-s", "-m", "5", "http://127.0.0.1:9102/status"],
        Duration::from_secs(10),
    );
    out.and_then(|o| serde_json::from_slice(&o.stdout).ok())
        .unwrap_or_default()
}

fn heartbeats_accepted(lab: &Lab) -> u64 {
    status(lab)["control_accepted"]["heartbeat"]
        .as_u64()
        .unwrap_or(0)
}

/// Heartbeats per second per server over `over`.
fn heartbeat_rate(lab: &Lab, over: Duration) -> f64 {
    let (t0, n0) = (Instant::now(), heartbeats_accepted(lab));
    std::thread::sleep(over);
    let n1 = heartbeats_accepted(lab);
    (n1 - n0) as f64 / t0.elapsed().as_secs_f64() / f64::from(SERVERS)
}

fn signal(pid: u32, sig: libc::c_int) {
    // SAFETY: signalling a hostagent this test started (`ip netns exec`
    // execs it, so the pid is the hostagent's).
    unsafe { libc::kill(pid as i32, sig) };
}

fn patch(lab: &Lab, token: &str, body: &str) -> serde_json::Value {
    let (code, out) = lab.api_call(API, token, "PATCH", "/v1/policy", Some(body));
    assert_eq!(code, 200, "PATCH /v1/policy {body}: {out}");
    serde_json::from_str(&out).expect("policy JSON")
}

#[test]
fn stored_liveness_timing_and_engine_settings_apply() {
    let (mut lab, dir, key, config) =
        appliance_lab("policy-apply-lab", "pap", SERVERS, "127.0.0.1:18084");
    // Config values the defaults do not have: the seed must take them.
    let text = std::fs::read_to_string(&config).unwrap();
    assert!(text.contains("dead_after_ms = 1000\n"), "{text}");
    std::fs::write(
        &config,
        text.replace("dead_after_ms = 1000\n", "dead_after_ms = 1200\n"),
    )
    .unwrap();
    let log = dir.join("capybara.log");
    let mut app = start_appliance(&lab, &config, &log);
    // Policies on: what this test checks is how they apply.
    let pids: Vec<u32> = lab
        .start_hostagents_with(&dir, &key, SERVERS, |_, _| {})
        .iter()
        .map(|a| a.pid)
        .collect();
    let token = wait_appliance_ready(&lab, &log, SERVERS, API, &dir);

    // The seed: the config's liveness timing, stored and shown.
    let (code, body) = lab.api_call(API, &token, "GET", "/v1/policy", None);
    assert_eq!(code, 200, "{body}");
    let p: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        (&p["heartbeat_interval_ms"], &p["dead_after_ms"]),
        (&serde_json::json!(100), &serde_json::json!(1200)),
        "seeded from switchd's config: {body}"
    );
    assert_eq!(
        p["migration_deadline_ms"], 50,
        "what the engines run: {body}"
    );
    assert!(
        log_of(&log).contains("the store held no policy"),
        "{}",
        log_of(&log)
    );
    let st = status(&lab);
    assert_eq!(st["liveness"]["dead_after_ms"], 1200, "{st}");
    let before = heartbeat_rate(&lab, Duration::from_secs(2));
    eprintln!("heartbeats per server and second at 100 ms: {before:.1}");
    assert!(before > 6.0, "{before}");

    // A longer interval: the servers are told at once.
    patch(&lab, &token, r#"{"heartbeat_interval_ms": 400}"#);
    lab.wait_for("switchd to apply 400 ms", Duration::from_secs(3), || {
        status(&lab)["liveness"]["heartbeat_interval_ms"] == 400
    });
    std::thread::sleep(Duration::from_millis(500));
    let slow = heartbeat_rate(&lab, Duration::from_secs(3));
    eprintln!("heartbeats per server and second at 400 ms: {slow:.1}");
    assert!(
        (1.5..=4.0).contains(&slow),
        "servers beat every 400 ms: {slow}"
    );

    // Faster again, and dead_after below the interval the servers beat at
    // until their REGISTER_ACK comes: 1200 ms stays in force for a while.
    let died_before = status(&lab)["liveness"]["died_total"].as_u64().unwrap();
    patch(
        &lab,
        &token,
        r#"{"heartbeat_interval_ms": 100, "dead_after_ms": 350}"#,
    );
    let mut held_seen = false;
    lab.wait_for("switchd to apply 350 ms", Duration::from_secs(3), || {
        let l = status(&lab)["liveness"].clone();
        if l["dead_after_ms"] == 350 && l["dead_after_in_force_ms"] == 1200 {
            held_seen = true;
        }
        l["dead_after_ms"] == 350
    });
    let l = status(&lab)["liveness"].clone();
    held_seen |= l["dead_after_in_force_ms"] == 1200;
    assert!(held_seen, "the lowered dead_after is held off first: {l}");
    assert!(l["register_acks_resent"].as_u64().unwrap() >= 2, "{l}");
    lab.wait_for("350 ms in force", Duration::from_secs(5), || {
        status(&lab)["liveness"]["dead_after_in_force_ms"] == 350
    });
    let fast = heartbeat_rate(&lab, Duration::from_secs(2));
    eprintln!("heartbeats per server and second at 100 ms again: {fast:.1}");
    assert!(fast > 6.0, "{fast}");
    let st = status(&lab);
    assert_eq!(
        st["liveness"]["died_total"].as_u64().unwrap(),
        died_before,
        "no live server declared dead by the change: {st}"
    );
    for s in st["servers"].as_array().unwrap() {
        assert_eq!(s["state"], "live", "{s}");
    }

    // 350 ms is what declares a silent server dead now.
    let stopped = Instant::now();
    signal(pids[1], libc::SIGSTOP);
    let dead = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        lab.wait_for("s2 declared dead", Duration::from_secs(5), || {
            log_of(&log).contains("server s2 missed heartbeats for 350ms")
        });
        stopped.elapsed()
    }));
    signal(pids[1], libc::SIGCONT);
    let dead = dead.unwrap_or_else(|e| std::panic::resume_unwind(e));
    eprintln!("s2 frozen, declared dead after {dead:?}");
    assert!(dead < Duration::from_millis(1200), "{dead:?}");
    lab.wait_for("s2 back", Duration::from_secs(10), || {
        status(&lab)["servers"]
            .as_array()
            .is_some_and(|a| a.iter().all(|s| s["state"] == "live"))
    });

    // The migration engine's keys reach the hostagents.
    let p = patch(
        &lab,
        &token,
        r#"{"migration_deadline_ms": 80, "buffer_mode": "drop"}"#,
    );
    assert_eq!(p["migration_deadline_ms"], 80);
    lab.wait_for(
        "both hostagents to apply them",
        Duration::from_secs(5),
        || {
            (1..=SERVERS).all(|j| {
                log_of(&dir.join(format!("hostagent-s{j}.log"))).contains(
                    "migration deadline 80 ms (cap 280 ms, target 130 ms), buffer mode drop",
                )
            })
        },
    );
    // switchd publishes its /status periodically.
    lab.wait_for("/status to show them", Duration::from_secs(5), || {
        let st = status(&lab);
        st["policy"]["migration_deadline_ms"] == 80 && st["policy"]["buffer_mode"] == "drop"
    });
    lab.wait_for(
        "the servers to report the generation",
        Duration::from_secs(5),
        || {
            let st = status(&lab);
            st["servers"].as_array().is_some_and(|a| {
                a.iter()
                    .all(|s| s["policy_generation"] == st["policy"]["generation"])
            })
        },
    );
    // And back to buffering.
    patch(&lab, &token, r#"{"buffer_mode": "buffer"}"#);
    lab.wait_for(
        "both hostagents to buffer again",
        Duration::from_secs(5),
        || {
            (1..=SERVERS).all(|j| {
                log_of(&dir.join(format!("hostagent-s{j}.log"))).contains(
                    "migration deadline 80 ms (cap 280 ms, target 130 ms), buffer mode buffer",
                )
            })
        },
    );
    let st = stop_appliance(&mut app);
    assert!(st.success(), "capybara run exited with {st}");
}
