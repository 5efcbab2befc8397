//! A service whose every server the operator took out refuses new
//! connections at once (lab, root; release binaries, or `CAPYBARA_BIN_DIR`):
//! three servers serve the echo service; every one drained through the REST
//! API, and a real Linux client's connect fails with "connection refused"
//! well within a second (the switch answers the SYN with a reset, counter
//! `reset_no_server`), as does curl's; the connections held open across the
//! drains still echo; one server undrained and new connections work again.
//! Then the same with an operator weight of 0 on every server, and with
//! every hostagent stopped once the servers' dead_flow_grace_ms is over
//! (within it a SYN is still dropped: a stalled server may come back).
//! Before, the switch dropped such a SYN and the client retransmitted it
//! for minutes.

use capybara_systests::{
    appliance_lab, echo_once, start_appliance, stop_appliance, switchd_status_at,
    switchd_status_server, wait_appliance_ready, EchoHolder, Lab,
};
use std::time::Duration;

const SERVERS: u32 = 3;
const API: &str = "http://127.0.0.1:18087";
const ECHO: &str = "198.18.100.1:7";
/// switchd's `metrics_listen` port in the lab config.
const STATUS_PORT: u16 = 9102;

/// One TCP connect from client c1 to the echo service: its outcome and
/// how long it took in seconds ([`Lab::connect_outcome`]).
fn connect_once(lab: &Lab) -> (String, f64) {
    lab.connect_outcome("c1", ECHO)
}

/// Asserts that a new connection is refused within a second, by the small
/// client and by curl, and that switchd counted the resets.
fn assert_refused(lab: &Lab, when: &str) {
    let before = counter(lab, "reset_no_server");
    let (r, secs) = connect_once(lab);
    eprintln!("{when}: connect: {r} after {secs:.3} s");
    assert_eq!(
        r, "refused",
        "{when}: a new connection must be refused, not left to time out ({secs:.3} s)"
    );
    assert!(secs < 1.0, "{when}: refused after {secs:.3} s");
    let out = lab.run(
        "c1",
        "curl",
        &["-sS", "-m", "5", &format!("http://{ECHO}/")],
        Duration::from_secs(15),
    );
    // Exit 7, "Failed to connect to ... after N ms: Couldn't connect to
    // server" (a timeout would be 28).
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(7), "{when}: curl: {err}");
    let ms: Option<u64> = err
        .split_once("after ")
        .and_then(|(_, r)| r.split_once(" ms"))
        .and_then(|(n, _)| n.trim().parse().ok());
    assert!(ms.is_some_and(|ms| ms < 1000), "{when}: curl: {err}");
    // `/status` is published every few hundred ms.
    let mut after = before;
    lab.wait_for(
        &format!("{when}: reset_no_server to count both resets (from {before})"),
        Duration::from_secs(5),
        || {
            after = counter(lab, "reset_no_server");
            after >= before + 2
        },
    );
    assert_eq!(service_refusing(lab), Some(true), "{when}: /status");
}

/// switchd's data-plane counter `name` (`/status` `dataplane`; 0 where it
/// has no such counter), waiting for an answer.
fn counter(lab: &Lab, name: &str) -> u64 {
    let mut v = None;
    lab.wait_for("switchd's /status", Duration::from_secs(10), || {
        v = switchd_status_at(lab, STATUS_PORT)
            .filter(|s| s["dataplane"].is_object())
            .map(|s| s["dataplane"][name].as_u64().unwrap_or(0));
        v.is_some()
    });
    v.unwrap_or(0)
}

/// The echo service's `refusing` in switchd's `/status`.
fn service_refusing(lab: &Lab) -> Option<bool> {
    let s = switchd_status_at(lab, STATUS_PORT)?;
    s["services"]
        .as_array()?
        .iter()
        .find(|v| v["vip"] == ECHO)?["refusing"]
        .as_bool()
}

/// The echo service's `serving.refusing` in the REST API (what `ctl
/// services` and the dashboard's Services page show).
fn api_refusing(lab: &Lab, token: &str) -> Option<bool> {
    let (code, text) = lab.api_call(API, token, "GET", "/v1/services", None);
    assert_eq!(code, 200, "GET /v1/services: {text}");
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
    let vip = ECHO.split(':').next()?;
    v["items"].as_array()?.iter().find(|s| s["vip"] == vip)?["serving"]["refusing"].as_bool()
}

/// Waits until switchd's `/status` says `pred` of every server.
fn wait_servers(lab: &Lab, what: &str, pred: impl Fn(&serde_json::Value) -> bool) {
    lab.wait_for(what, Duration::from_secs(10), || {
        (1..=SERVERS).all(|j| switchd_status_server(lab, j).is_some_and(|s| pred(&s)))
    });
}

fn call(lab: &Lab, token: &str, method: &str, path: &str, body: Option<&str>) -> u16 {
    let (code, text) = lab.api_call(API, token, method, path, body);
    assert!((200..300).contains(&code), "{method} {path}: {code} {text}");
    code
}

/// The appliance process, killed if the test fails before it stops it.
struct Appliance(Option<std::process::Child>);

impl Drop for Appliance {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

#[test]
fn a_service_without_a_server_to_take_connections_refuses_them_at_once() {
    let (mut lab, dir, key, config) =
        appliance_lab("refuse-lab", "rfl", SERVERS, "127.0.0.1:18087");
    let log = dir.join("capybara.log");
    let mut app = Appliance(Some(start_appliance(&lab, &config, &log)));
    let agents = lab.start_hostagents(&dir, &key, SERVERS);
    let token = wait_appliance_ready(&lab, &log, SERVERS, API, &dir);
    assert!(echo_once(&lab, ECHO), "the echo service answers");
    assert_eq!(connect_once(&lab).0, "ok");
    assert_ne!(service_refusing(&lab), Some(true));

    // Connections held open across everything below.
    let mut held = EchoHolder::start(&lab, 6);

    // 1. Every server drained by the operator. The held connections have
    // nowhere to go once all three drain (no migration target): the drains
    // time out and leave them where they are.
    for j in 1..=SERVERS {
        call(
            &lab,
            &token,
            "POST",
            &format!("/v1/servers/{j}/drain"),
            Some(r#"{"deadline_seconds": 3, "mode": "migrate"}"#),
        );
    }
    wait_servers(&lab, "every server draining in switchd's /status", |s| {
        s["state"] == "draining"
    });
    assert_refused(&lab, "every server drained");
    assert_eq!(api_refusing(&lab, &token), Some(true), "GET /v1/services");
    assert_eq!(held.round_trip(), "ok", "held connections after the drains");

    // One undrained: new connections work again.
    call(&lab, &token, "POST", "/v1/servers/2/undrain", None);
    lab.wait_for(
        "s2 live in switchd's /status",
        Duration::from_secs(10),
        || switchd_status_server(&lab, 2).is_some_and(|s| s["state"] == "live"),
    );
    assert_eq!(connect_once(&lab).0, "ok", "after undrain of s2");
    assert!(echo_once(&lab, ECHO), "echo after undrain of s2");
    assert_eq!(service_refusing(&lab), Some(false));
    assert_eq!(api_refusing(&lab, &token), Some(false), "GET /v1/services");

    // 2. Every server live at an operator weight of 0.
    for j in [1, 3] {
        call(
            &lab,
            &token,
            "POST",
            &format!("/v1/servers/{j}/undrain"),
            None,
        );
    }
    for j in 1..=SERVERS {
        lab.set_weight(API, &token, j, 0);
    }
    wait_servers(&lab, "every server live at weight 0", |s| {
        s["state"] == "live" && s["weight"] == 0
    });
    assert_refused(&lab, "every server at weight 0");
    assert_eq!(held.round_trip(), "ok", "held connections at weight 0");

    // One back to its REGISTER's weight: new connections work again.
    call(&lab, &token, "DELETE", "/v1/servers/3/weight", None);
    lab.wait_for("s3 weighted again", Duration::from_secs(10), || {
        switchd_status_server(&lab, 3).is_some_and(|s| s["weight"].as_u64() > Some(0))
    });
    assert_eq!(connect_once(&lab).0, "ok", "after s3's weight is back");
    assert!(echo_once(&lab, ECHO), "echo after s3's weight is back");
    assert_eq!(held.round_trip(), "ok");
    assert_eq!(held.close(), "closed");

    // 3. Every hostagent stopped: DEAD after dead_after_ms (1 s). Within
    // dead_flow_grace_ms (10 s, the default) a server may be stalling and
    // come back: a SYN is dropped, not refused (the client's
    // retransmission would reach it); past the grace, refused.
    for a in agents {
        lab.kill_and_wait(a.pid);
    }
    wait_servers(&lab, "every server dead in switchd's /status", |s| {
        s["state"] == "dead"
    });
    let (r, secs) = connect_once(&lab);
    eprintln!("every server dead, within the grace: connect: {r} after {secs:.3} s");
    assert_eq!(r, "timeout", "within the grace a SYN is dropped");
    lab.wait_for(
        "the grace to end and the service to refuse",
        Duration::from_secs(15),
        || service_refusing(&lab) == Some(true),
    );
    assert_refused(&lab, "every server dead past its grace");
    let mut child = app.0.take().expect("the appliance runs");
    assert!(stop_appliance(&mut child).success(), "clean stop");
}
