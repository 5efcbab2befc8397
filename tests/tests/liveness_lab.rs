//! What the API says about a server's liveness, and what the switch does
//! with it (lab, root; release binaries, or `CAPYBARA_BIN_DIR`): the
//! appliance (switchd + API) and real hostagents, real Linux TCP clients.
//!
//! - A server created through the REST API that no hostagent registers is
//!   `never_seen` (before: `active` forever, as if it served), and
//!   switchd places no connection on it even when a service's pool names
//!   it: every new connection lands on a live server and echoes.
//! - A weight set just before a drain does not put the drained server
//!   back into placement: new connections opened right after the drain
//!   miss it.

use capybara_systests::{
    appliance_lab, place_echo_connections, start_appliance, stop_appliance, wait_appliance_ready,
    EchoHolder, Lab,
};
use std::time::Duration;

const SERVERS: u32 = 2;
const API: &str = "http://127.0.0.1:18087";
/// New connections per round: with s1 at half of the placement, all of
/// them miss it with probability 2^-24.
const N: usize = 24;

fn server(lab: &Lab, token: &str, id: u32) -> serde_json::Value {
    let (code, body) = lab.api_call(API, token, "GET", &format!("/v1/servers/{id}"), None);
    assert_eq!(code, 200, "GET /v1/servers/{id}: {body}");
    serde_json::from_str(&body).expect("server JSON")
}

#[test]
fn liveness_and_drains_in_placement() {
    let (mut lab, dir, key, config) =
        appliance_lab("liveness-lab", "lvl", SERVERS, "127.0.0.1:18087");
    let log = dir.join("capybara.log");
    let mut app = start_appliance(&lab, &config, &log);
    let _agents = lab.start_hostagents(&dir, &key, SERVERS);
    let token = wait_appliance_ready(&lab, &log, SERVERS, API, &dir);

    // A server created through the API, in the echo service's pool, whose
    // hostagent never comes.
    let (code, body) = lab.api_call(
        API,
        &token,
        "POST",
        "/v1/servers",
        Some(r#"{"id": 9, "name": "ghost", "mgmt_addr": "198.18.1.19:7000", "data_addr": "198.18.2.19"}"#),
    );
    assert_eq!(code, 201, "POST /v1/servers: {body}");
    let (code, body) = lab.api_call(
        API,
        &token,
        "PUT",
        "/v1/services/echo",
        Some(r#"{"vip": "198.18.100.1", "port": 7, "pool": [1, 2, 9]}"#),
    );
    assert_eq!(code, 200, "PUT /v1/services/echo: {body}");
    let ghost = server(&lab, &token, 9);
    assert_eq!(ghost["liveness"], "never_seen", "{ghost}");
    for id in 1..=SERVERS {
        let s = server(&lab, &token, id);
        assert_eq!(
            (&s["state"], &s["liveness"]),
            (&"active".into(), &"live".into()),
            "{s}"
        );
    }
    // switchd applies the pool within a second; then every new connection
    // echoes (none waits on the ghost) and lands on s1 or s2.
    std::thread::sleep(Duration::from_millis(1500));
    let c = place_echo_connections(&lab, API, &token, N, SERVERS);
    assert_eq!(c.iter().sum::<usize>(), N, "connections on s1, s2: {c:?}");
    assert!(
        c.iter().all(|n| *n > 0),
        "both live servers take connections: {c:?}"
    );

    // A weight, then a drain at once: s1 takes no new connection from
    // the drain on, while the weight is being applied.
    for round in 0..3 {
        // In the last round s1 holds connections: the drain runs
        // (migrates them) instead of completing at once.
        let mut held = (round == 2).then(|| EchoHolder::start(&lab, 8));
        let w = 150 + round;
        let (code, body) = lab.api_call(
            API,
            &token,
            "PUT",
            "/v1/servers/1/weight",
            Some(&format!(r#"{{"weight": {w}}}"#)),
        );
        assert_eq!(code, 200, "PUT weight: {body}");
        lab.start_drain(API, &token, 1, 30);
        let c = place_echo_connections(&lab, API, &token, N, SERVERS);
        assert_eq!(
            c[0], 0,
            "round {round}: new connections on s1 right after its drain: {c:?}"
        );
        if let Some(h) = held.as_mut() {
            let out = h.round_trip();
            assert!(
                out.starts_with("ok"),
                "held connections across the drain: {out}"
            );
            h.close();
        }
        let (code, body) = lab.api_call(API, &token, "POST", "/v1/servers/1/undrain", None);
        assert_eq!(code, 200, "undrain: {body}");
        lab.wait_for("s1 back in placement", Duration::from_secs(10), || {
            server(&lab, &token, 1)["state"] == "active"
        });
        std::thread::sleep(Duration::from_millis(500));
    }
    lab.assert_no_resets(1..=SERVERS);
    let st = stop_appliance(&mut app);
    assert!(st.success(), "capybara run exited with {st}");
}
