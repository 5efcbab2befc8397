//! An operator's drain outlives the processes (lab, root; release binaries,
//! or `CAPYBARA_BIN_DIR`): three servers serve the echo service; s1 is
//! drained through the REST API until `drained`, then a real Linux client's
//! new connections must miss s1 after each of: s1's hostagent restarting
//! (a REGISTER of a new instance), s1's hostagent stopped for longer than
//! `dead_after_ms` and started again (a maintenance stop), and the
//! appliance (switchd) restarting from its store. The API says `drained`
//! throughout; `undrain` puts s1 back into placement. s1's hostagent
//! restarted after its drain completed (within the drain's deadline) is
//! not sent DRAIN again: switchd learned the completion from the store
//! (before, it re-sent DRAIN until the deadline; a drain that still runs
//! is sent again: unit test `the_active_follows_the_operators_drains_in_the_store`).
//!
//! Before: each of the three put s1 back into placement while the API
//! still said `drained` (a REGISTER made it live; a restored `drained`
//! record was skipped and the next REGISTER placed it; its death wrote
//! `dead` over `drained`).

use capybara_systests::{
    appliance_lab, log_of, place_echo_connections, start_appliance, stop_appliance,
    switchd_status_state, wait_appliance_ready, Lab,
};
use std::time::Duration;

const SERVERS: u32 = 3;
const API: &str = "http://127.0.0.1:18085";
/// New connections per round: with s1 at a third of the placement, all of
/// them miss it with probability (2/3)^24 < 1e-4.
const N: usize = 24;

fn place_new_connections(lab: &Lab, token: &str) -> Vec<usize> {
    place_echo_connections(lab, API, token, N, SERVERS)
}

#[test]
fn a_drained_server_stays_out_of_placement_across_restarts_until_undrain() {
    let (mut lab, dir, key, config) =
        appliance_lab("drain-persist-lab", "dpl", SERVERS, "127.0.0.1:18085");
    let log1 = dir.join("capybara-1.log");
    let mut app = start_appliance(&lab, &config, &log1);
    let mut agents = lab.start_hostagents(&dir, &key, SERVERS);
    let token = wait_appliance_ready(&lab, &log1, SERVERS, API, &dir);
    let c = place_new_connections(&lab, &token);
    assert!(c[0] > 0, "s1 takes connections before the drain: {c:?}");

    // Drain s1 (no connection left on it: it completes at once). The
    // deadline outlasts the restart below: switchd learns the completion
    // from the store and sends no DRAIN to the restarted hostagent.
    lab.start_drain(API, &token, 1, 120);
    lab.wait_for("s1 drained", Duration::from_secs(15), || {
        lab.api_server(API, &token, 1).0 == "drained"
    });
    lab.wait_switchd_state(1, "draining", "after the drain");
    lab.wait_for(
        "switchd to learn that s1's drain completed",
        Duration::from_secs(5),
        || log_of(&log1).contains("the drain of s1 is over"),
    );
    let c = place_new_connections(&lab, &token);
    assert_eq!(c[0], 0, "new connections on drained s1: {c:?}");

    // 1. s1's hostagent restarts (a new instance registers).
    lab.kill_and_wait(agents[0].pid);
    agents[0].pid = lab.spawn_hostagent(1, &agents[0].config, &dir.join("hostagent-s1-2.log"));
    lab.wait_for("s1 to register again", Duration::from_secs(30), || {
        log_of(&log1).matches("registered s1").count() >= 2
    });
    std::thread::sleep(Duration::from_millis(500));
    lab.wait_switchd_state(1, "draining", "after a restart of s1's hostagent");
    let c = place_new_connections(&lab, &token);
    assert_eq!(c[0], 0, "new connections on s1 after its restart: {c:?}");
    // By now its heartbeats would have carried a re-sent DRAIN.
    assert!(
        !log_of(&dir.join("hostagent-s1-2.log")).contains("hostagent: drain started"),
        "the restarted s1 hostagent was sent DRAIN for a completed drain"
    );
    assert_eq!(lab.api_server(API, &token, 1).0, "drained");

    // 2. A maintenance stop: s1 dies (dead_after_ms), then comes back.
    lab.kill_and_wait(agents[0].pid);
    lab.wait_for(
        "switchd to declare s1 dead",
        Duration::from_secs(10),
        || switchd_status_state(&lab, 1).as_deref() == Some("dead"),
    );
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(
        lab.api_server(API, &token, 1).0,
        "drained",
        "the record keeps the operator's drain while the server is down"
    );
    agents[0].pid = lab.spawn_hostagent(1, &agents[0].config, &dir.join("hostagent-s1-3.log"));
    lab.wait_for("s1 back", Duration::from_secs(30), || {
        switchd_status_state(&lab, 1).is_some_and(|s| s != "dead")
    });
    lab.wait_switchd_state(1, "draining", "back from a stop");
    let c = place_new_connections(&lab, &token);
    assert_eq!(c[0], 0, "new connections on s1 back from a stop: {c:?}");

    // 3. The appliance restarts from its store.
    let st = stop_appliance(&mut app);
    assert!(st.success(), "capybara run exited with {st}");
    let log2 = dir.join("capybara-2.log");
    let mut app = start_appliance(&lab, &config, &log2);
    lab.wait_for("the restarted switchd", Duration::from_secs(30), || {
        log_of(&log2).contains("flows from the store")
    });
    lab.wait_for("the restarted API", Duration::from_secs(30), || {
        lab.api_call(API, "", "GET", "/healthz", None).0 == 200
    });
    lab.wait_for(
        "s1 live in the restarted switchd",
        Duration::from_secs(10),
        || switchd_status_state(&lab, 1).is_some_and(|s| s != "dead"),
    );
    lab.wait_switchd_state(1, "draining", "after a switchd restart");
    let c = place_new_connections(&lab, &token);
    assert_eq!(
        c[0], 0,
        "new connections on s1 after a switchd restart: {c:?}"
    );
    assert_eq!(lab.api_server(API, &token, 1).0, "drained");

    // Undrain: s1 takes new connections again.
    let (code, body) = lab.api_call(API, &token, "POST", "/v1/servers/1/undrain", None);
    assert!(code == 200 || code == 204, "undrain: {code} {body}");
    lab.wait_switchd_state(1, "live", "after undrain");
    let c = place_new_connections(&lab, &token);
    assert!(c[0] > 0, "s1 takes new connections after undrain: {c:?}");
    assert_eq!(lab.api_server(API, &token, 1).0, "active");
    lab.assert_no_resets(2..=SERVERS);
    let st = stop_appliance(&mut app);
    assert!(st.success(), "second run exited with {st}");
}
