//! Server weights set through the REST API reach placement (lab, root;
//! release binaries, or `CAPYBARA_BIN_DIR`): three servers serve the echo
//! service; `PUT /v1/servers/1/weight {"weight": 0}` and a real Linux
//! client's new connections land on s2 and s3 only, also after s1's
//! hostagent restarts (its REGISTER carries the config's weight 1) and after
//! the appliance (switchd) restarts; weight 1 again and s1 takes new
//! connections again.

use capybara_systests::{
    appliance_lab, log_of, place_echo_connections, start_appliance, stop_appliance,
    switchd_status_server, wait_appliance_ready, Lab,
};
use std::time::Duration;

const SERVERS: u32 = 3;
const API: &str = "http://127.0.0.1:18083";
/// New connections per round: with s1 at a third of the placement, all of
/// them miss it with probability (2/3)^24 < 1e-4.
const N: usize = 24;

/// Server `id` in switchd's `/status`: (state, weight, register_weight).
fn status_server(lab: &Lab, id: u32) -> Option<(String, u64, u64)> {
    let s = switchd_status_server(lab, id)?;
    Some((
        s["state"].as_str()?.to_string(),
        s["weight"].as_u64()?,
        s["register_weight"].as_u64()?,
    ))
}

fn place_new_connections(lab: &Lab, token: &str) -> Vec<usize> {
    place_echo_connections(lab, API, token, N, SERVERS)
}

#[test]
fn an_operator_weight_of_zero_takes_no_new_connections_across_restarts() {
    let (mut lab, dir, key, config) =
        appliance_lab("weights-lab", "wts", SERVERS, "127.0.0.1:18083");
    let log1 = dir.join("capybara-1.log");
    let mut app = start_appliance(&lab, &config, &log1);
    let mut agents = lab.start_hostagents(&dir, &key, SERVERS);
    let token = wait_appliance_ready(&lab, &log1, SERVERS, API, &dir);
    let c = place_new_connections(&lab, &token);
    assert!(
        c[0] > 0,
        "s1 takes connections at its REGISTER weight: {c:?}"
    );

    // Weight 0 through the REST API: switchd applies it within a second.
    lab.set_weight(API, &token, 1, 0);
    lab.wait_for("switchd to apply weight 0", Duration::from_secs(2), || {
        status_server(&lab, 1).is_some_and(|s| s.1 == 0)
    });
    let c = place_new_connections(&lab, &token);
    assert_eq!(c[0], 0, "new connections on s1 at weight 0: {c:?}");
    assert_eq!(status_server(&lab, 1).unwrap().0, "live", "still live");

    // s1's hostagent restarts: its REGISTER (config weight 1) keeps the 0.
    lab.kill_and_wait(agents[0].pid);
    agents[0].pid = lab.spawn_hostagent(1, &agents[0].config, &dir.join("hostagent-s1-2.log"));
    lab.wait_for("s1 to register again", Duration::from_secs(30), || {
        log_of(&log1).matches("registered s1").count() >= 2
            && status_server(&lab, 1).is_some_and(|s| s.0 == "live")
    });
    std::thread::sleep(Duration::from_secs(1));
    let s1 = status_server(&lab, 1).unwrap();
    assert_eq!(
        (s1.1, s1.2),
        (0, 1),
        "weight, register_weight after the REGISTER"
    );
    let (code, body) = lab.api_call(API, &token, "GET", "/v1/servers/1", None);
    assert_eq!(code, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).expect("server JSON");
    assert_eq!(
        v["weight"], 0,
        "the REGISTER kept the stored weight: {body}"
    );
    let c = place_new_connections(&lab, &token);
    assert_eq!(c[0], 0, "new connections on s1 after its restart: {c:?}");

    // The appliance restarts: the stored weight applies from the start.
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
    assert_eq!(
        status_server(&lab, 1).map(|s| s.1),
        Some(0),
        "after the restart"
    );
    let c = place_new_connections(&lab, &token);
    assert_eq!(
        c[0], 0,
        "new connections on s1 after a switchd restart: {c:?}"
    );

    // Weight 1 again: s1 takes new connections.
    lab.set_weight(API, &token, 1, 1);
    lab.wait_for("switchd to apply weight 1", Duration::from_secs(2), || {
        status_server(&lab, 1).is_some_and(|s| s.1 == 1)
    });
    let c = place_new_connections(&lab, &token);
    assert!(
        c[0] > 0,
        "s1 takes new connections again at weight 1: {c:?}"
    );
    assert!(
        log_of(&log2).contains("operator weights from the store: s1 -> 1"),
        "{}",
        log_of(&log2)
    );
    lab.assert_no_resets(2..=SERVERS);
    let st = stop_appliance(&mut app);
    assert!(st.success(), "second run exited with {st}");
}
