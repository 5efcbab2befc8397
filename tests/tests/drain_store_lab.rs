//! The active switchd follows the operator's drains in the store, also
//! those the API recorded but could not deliver (lab, root; release
//! binaries, or `CAPYBARA_BIN_DIR`). The API records a drain or an undrain
//! in the store, then asks switchd over HTTP; when that request does not
//! arrive (switchd unreachable from the API, the API stopped in between),
//! switchd used to keep its old view until it restarted or a standby took
//! over: a server undrained through the API stayed out of placement, shown
//! `active`.
//!
//! Three servers serve the echo service, switchd and `capybara-api` share
//! the SQLite store in the switch namespace. s1 is drained through the API
//! (out of placement). The API restarted cut off from switchd (its
//! `--switchd` URL has nothing listening) undrains s1: it answers 503
//! (switchd unreachable) with the undrain recorded, and switchd puts s1
//! back into placement within a second: a real Linux client's new
//! connections reach s1 again. Then a drain of s2 is recorded the way the
//! API records one (a running `Drain` record) with no request to switchd
//! (an API that stopped before asking): switchd takes s2 out of placement
//! and sends it DRAIN; s2's connections move to the others while a client
//! keeps using them, byte-exact and without a reset.

use capybara_systests::{
    bin, log_of, place_echo_connections, switchd_lab, switchd_status_at, switchd_status_server,
    EchoHolder, Lab,
};
use std::path::Path;
use std::time::Duration;

const SERVERS: u32 = 3;
const API_LISTEN: &str = "127.0.0.1:18114";
const API: &str = "http://127.0.0.1:18114";
/// switchd's `metrics_listen` in `switchd_config`.
const SWITCHD: &str = "http://127.0.0.1:9102";
/// Nothing listens there: an API given it is cut off from switchd.
const NO_SWITCHD: &str = "http://127.0.0.1:9199";
/// New connections per round: with s1 at a third of the placement, all of
/// them miss it with probability (2/3)^24 < 1e-4.
const N: usize = 24;

/// Each service's `placing` in switchd's `/status` (the servers new
/// connections go to), in service order.
fn placing(lab: &Lab) -> Vec<Vec<u64>> {
    let s = switchd_status_at(lab, 9102).expect("switchd /status");
    s["services"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|v| {
            let mut ids: Vec<u64> = v["placing"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|i| i.as_u64())
                .collect();
            ids.sort();
            ids
        })
        .collect()
}

/// Starts `capybara-api` in the switch namespace on the lab's store, asking
/// switchd at `switchd`; returns its pid once it answers `/readyz`.
fn start_api(lab: &mut Lab, dir: &Path, switchd: &str, log: &str) -> u32 {
    let store = format!("sqlite:{}", dir.join("store.db").display());
    let token_file = dir.join("admin-token");
    let pid = lab.spawn_logged(
        "sw",
        bin("capybara-api"),
        &[
            "--store",
            &store,
            "--listen",
            API_LISTEN,
            "--switchd",
            switchd,
            "--admin-token-file",
            token_file.to_str().unwrap(),
        ],
        &dir.join(log),
    );
    lab.wait_for("the API ready", Duration::from_secs(30), || {
        lab.try_run(
            "sw",
            "curl",
            &["-sf", "-m", "2", &format!("{API}/readyz")],
            Duration::from_secs(5),
        )
        .is_some_and(|o| o.status.success())
    });
    pid
}

/// Records a running drain of `server` in the store as the API does (its
/// `Drain` record), without asking switchd.
fn record_drain(db: &Path, server: u32, deadline: Duration) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let cfg =
            capybara_store::StoreConfig::Sqlite(capybara_store::SqliteConfig::at(db.to_path_buf()));
        let store = capybara_store::open(&cfg).await.expect("open store");
        let now = capybara_store::unix_ms_now();
        let mut drain: capybara_store::Drain = serde_json::from_value(serde_json::json!({
            "server": server, "targets": [], "started_unix_ms": now,
            "deadline_unix_ms": now + deadline.as_millis() as u64,
            "state": "running", "progress": capybara_store::DrainProgress::default(),
        }))
        .expect("a drain record");
        drain.state = capybara_store::DrainState::Running;
        store.put_drain(&drain).await.expect("put drain");
    });
}

#[test]
fn the_active_switchd_follows_drains_the_api_recorded_but_could_not_deliver() {
    let (mut lab, dir, key, sw) = switchd_lab("drain_store_lab", "dsl", SERVERS);
    let sw_log = dir.join("switchd.log");
    lab.spawn_switchd(&sw, &sw_log);
    let _agents = lab.start_hostagents(&dir, &key, SERVERS);
    lab.wait_registered(&sw_log, SERVERS);
    let api = start_api(&mut lab, &dir, SWITCHD, "api.log");
    let token = std::fs::read_to_string(dir.join("admin-token")).expect("admin token file");
    let token = token.trim();

    // Drained through the API (nothing on it: completed at once).
    lab.start_drain(API, token, 1, 120);
    lab.wait_switchd_state(1, "draining", "after the API's drain");
    let c = place_echo_connections(&lab, API, token, N, SERVERS);
    assert_eq!(c[0], 0, "new connections miss the drained s1: {c:?}");
    assert_eq!(placing(&lab), vec![vec![2, 3], vec![2, 3]], "placing");

    // The API cut off from switchd: the undrain is recorded, the request
    // fails; switchd reads it from the store.
    lab.kill_and_wait(api);
    let _api = start_api(&mut lab, &dir, NO_SWITCHD, "api-cut-off.log");
    let (code, body) = lab.api_call(API, token, "POST", "/v1/servers/1/undrain", None);
    assert_eq!(code, 503, "undrain with switchd unreachable: {body}");
    let (code, body) = lab.api_call(API, token, "GET", "/v1/servers/1/drain", None);
    assert!(
        code == 200 && body.contains("\"cancelled\""),
        "the undrain is recorded: {code} {body}"
    );
    lab.wait_switchd_state(1, "live", "after an undrain switchd was not told of");
    assert!(
        log_of(&sw_log).contains("an undrain this switchd was not told of"),
        "switchd says why s1 is back"
    );
    let c = place_echo_connections(&lab, API, token, N, SERVERS);
    assert!(c[0] > 0, "s1 takes new connections again: {c:?}");
    assert_eq!(placing(&lab), vec![vec![1, 2, 3], vec![1, 2, 3]], "placing");

    // A drain recorded by an API that stopped before asking switchd, while
    // a client uses connections on every server.
    let mut held = EchoHolder::start(&lab, N);
    lab.wait_for("s2 to hold connections", Duration::from_secs(10), || {
        switchd_status_server(&lab, 2)
            .and_then(|s| s["connections"].as_u64())
            .is_some_and(|n| n > 0)
    });
    record_drain(&dir.join("store.db"), 2, Duration::from_secs(60));
    lab.wait_switchd_state(2, "draining", "after a drain recorded in the store only");
    lab.wait_for(
        "s2's connections to move away",
        Duration::from_secs(20),
        || switchd_status_server(&lab, 2).and_then(|s| s["connections"].as_u64()) == Some(0),
    );
    assert!(
        log_of(&dir.join("hostagent-s2.log")).contains("hostagent: drain started"),
        "s2's hostagent was sent DRAIN"
    );
    assert_eq!(held.round_trip(), "ok", "the moved connections echo");
    assert_eq!(held.close(), "closed");
    let c = place_echo_connections(&lab, API, token, N, SERVERS);
    assert_eq!(c[1], 0, "new connections miss the drained s2: {c:?}");
    lab.assert_no_resets(1..=SERVERS);
}
