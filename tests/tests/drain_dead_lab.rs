//! An operator who finished the maintenance of a drained server that is
//! still down lifts its drain, and the server takes new connections when
//! its hostagent comes back (lab, root; release binaries, or
//! `CAPYBARA_BIN_DIR`): three servers serve the echo service; s1 is
//! drained through the REST API until `drained`, its hostagent stopped
//! until switchd says `dead`, then undrained: the API answers `200` with
//! `state` `dead`. s1's hostagent started again registers, and a real
//! Linux client's new connections reach s1 again; the API says `active`.
//! An undrain retried while s1 is dead, with no drain holding it, is
//! answered the same (before: `409` "re-register it instead").

use capybara_systests::{
    appliance_lab, log_of, place_echo_connections, start_appliance, stop_appliance,
    switchd_status_state, wait_appliance_ready, Lab,
};
use std::time::Duration;

const SERVERS: u32 = 3;
const API: &str = "http://127.0.0.1:18113";
/// New connections per round: with s1 at a third of the placement, all of
/// them miss it with probability (2/3)^24 < 1e-4.
const N: usize = 24;

/// `POST /v1/servers/{id}/undrain`: its answer's `state`, checked `200`.
fn undrain(lab: &Lab, token: &str, id: u32) -> String {
    let (code, body) = lab.api_call(
        API,
        token,
        "POST",
        &format!("/v1/servers/{id}/undrain"),
        None,
    );
    assert_eq!(code, 200, "undrain s{id}: {body}");
    let v: serde_json::Value = serde_json::from_str(&body).expect("server JSON");
    v["state"].as_str().unwrap_or("").to_string()
}

#[test]
fn a_dead_drained_server_undrained_is_placed_again_when_it_comes_back() {
    let (mut lab, dir, key, config) =
        appliance_lab("drain-dead-lab", "ddl", SERVERS, "127.0.0.1:18113");
    let log1 = dir.join("capybara-1.log");
    let mut app = start_appliance(&lab, &config, &log1);
    let mut agents = lab.start_hostagents(&dir, &key, SERVERS);
    let token = wait_appliance_ready(&lab, &log1, SERVERS, API, &dir);

    // Drained (no connection on it: it completes at once), then down.
    lab.start_drain(API, &token, 1, 120);
    lab.wait_for("s1 drained", Duration::from_secs(15), || {
        lab.api_server(API, &token, 1).0 == "drained"
    });
    lab.kill_and_wait(agents[0].pid);
    lab.wait_for(
        "switchd to declare s1 dead",
        Duration::from_secs(10),
        || switchd_status_state(&lab, 1).as_deref() == Some("dead"),
    );
    assert_eq!(
        lab.api_server(API, &token, 1),
        ("drained".into(), "dead".into())
    );

    // Maintenance done while it is down: undrained, shown dead; a retry
    // (no drain holds it now) is answered the same.
    assert_eq!(undrain(&lab, &token, 1), "dead");
    assert_eq!(undrain(&lab, &token, 1), "dead");
    let (code, body) = lab.api_call(API, &token, "GET", "/v1/servers/1/drain", None);
    assert!(
        code == 200 && body.contains("\"cancelled\""),
        "GET drain: {code} {body}"
    );

    // Its hostagent comes back: placed again.
    agents[0].pid = lab.spawn_hostagent(1, &agents[0].config, &dir.join("hostagent-s1-2.log"));
    lab.wait_for("s1 live again", Duration::from_secs(30), || {
        switchd_status_state(&lab, 1).as_deref() == Some("live")
    });
    let c = place_echo_connections(&lab, API, &token, N, SERVERS);
    assert!(c[0] > 0, "s1 takes new connections once back: {c:?}");
    assert_eq!(
        lab.api_server(API, &token, 1),
        ("active".into(), "live".into())
    );
    assert!(
        !log_of(&dir.join("hostagent-s1-2.log")).contains("hostagent: drain started"),
        "the undrained s1 was sent DRAIN"
    );
    lab.assert_no_resets(1..=SERVERS);
    let st = stop_appliance(&mut app);
    assert!(st.success(), "capybara run exited with {st}");
}
