//! The API's readiness (`GET /readyz`) with a real switchd in the lab:
//! `capybara-api --switchd` and switchd share the store in the switch
//! namespace. While switchd runs, readiness says `switchd: reachable`;
//! switchd killed, it stays 200 (the store answers: the API serves reads
//! from it) and says `switchd: unreachable` with the reason, within a
//! second; switchd started again, `reachable` again. The same through an
//! API-only `capybara run` given two switchd endpoints (an active/standby
//! pair's API; here the second endpoint has nothing listening): reachable
//! while the active one answers.
//!
//! Needs root and curl (`make setup`). Run:
//! `cargo test --release -p capybara-systests --test readyz_lab`.

use capybara_systests::{bin, switchd_lab, Lab};
use serde_json::Value;
use std::time::Duration;

const API: &str = "http://127.0.0.1:18090";
/// The API-only appliance with two switchd endpoints.
const PAIR_API: &str = "http://127.0.0.1:18091";
/// switchd's `metrics_listen` in `switchd_config`.
const SWITCHD: &str = "http://127.0.0.1:9102";

/// `GET /readyz` with curl in the switch namespace: (status, body, seconds
/// curl took); status 0 when there was no answer.
fn readyz_of(lab: &Lab, api: &str) -> (u16, Value, f64) {
    let url = format!("{api}/readyz");
    let Some(out) = lab.try_run(
        "sw",
        "curl",
        &["-s", "-m", "5", "-w", "\n%{http_code} %{time_total}", &url],
        Duration::from_secs(10),
    ) else {
        return (0, Value::Null, 0.0);
    };
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let (body, tail) = text.rsplit_once('\n').unwrap_or(("", "0 0"));
    let mut w = tail.split_whitespace();
    let code = w.next().and_then(|c| c.parse().ok()).unwrap_or(0);
    let took = w.next().and_then(|t| t.parse().ok()).unwrap_or(0.0);
    (
        code,
        serde_json::from_str(body).unwrap_or(Value::Null),
        took,
    )
}

fn readyz(lab: &Lab) -> (u16, Value, f64) {
    readyz_of(lab, API)
}

#[test]
fn readyz_stays_ready_from_the_store_and_says_whether_switchd_answers() {
    let (mut lab, dir, _key, sw) = switchd_lab("readyz_lab", "rz", 1);
    let switchd = lab.spawn_switchd(&sw, &dir.join("switchd.log"));
    let store = format!("sqlite:{}", dir.join("store.db").display());
    let token_file = dir.join("admin-token");
    lab.spawn_logged(
        "sw",
        bin("capybara-api"),
        &[
            "--store",
            &store,
            "--listen",
            "127.0.0.1:18090",
            "--switchd",
            SWITCHD,
            "--admin-token-file",
            token_file.to_str().unwrap(),
        ],
        &dir.join("api.log"),
    );
    // `capybara run` with only an API, for the pair 9102 (switchd) + 9103
    // (nothing).
    let pair = dir.join("pair");
    std::fs::create_dir_all(&pair).unwrap();
    let pair_cfg = pair.join("capybara.toml");
    std::fs::write(
        &pair_cfg,
        format!(
            "state_dir = \"{}\"\n[store]\nsqlite = \"{}\"\n[api]\nlisten = \"127.0.0.1:18091\"\n\
             admin_token_file = \"{}\"\nswitchd = [\"{SWITCHD}\", \"http://127.0.0.1:9103\"]\n",
            pair.display(),
            dir.join("store.db").display(),
            pair.join("admin-token").display()
        ),
    )
    .unwrap();
    lab.spawn_logged(
        "sw",
        bin("capybara"),
        &["run", pair_cfg.to_str().unwrap()],
        &dir.join("pair-api.log"),
    );
    let log = |name: &str| std::fs::read_to_string(dir.join(name)).unwrap_or_default();
    lab.wait_for(
        "switchd reachable in readyz",
        Duration::from_secs(30),
        || readyz(&lab).1["switchd"] == "reachable",
    );
    lab.wait_for(
        "the active switchd reachable in the pair API's readyz",
        Duration::from_secs(30),
        || readyz_of(&lab, PAIR_API).1["switchd"] == "reachable",
    );
    let (code, v, _) = readyz(&lab);
    assert_eq!(code, 200, "{v}");
    assert_eq!(v["control_plane"], "switchd", "{v}");
    assert!(v.get("switchd_error").is_none(), "{v}");

    // switchd dies: still ready (the store answers), switchd unreachable,
    // answered within a second.
    lab.kill_and_wait(switchd);
    let (code, v, took) = readyz(&lab);
    assert_eq!(code, 200, "the store answers: {v}\n{}", log("api.log"));
    assert_eq!(v["status"], "ok", "{v}");
    assert_eq!(v["switchd"], "unreachable", "{v}");
    let err = v["switchd_error"].as_str().unwrap_or_default();
    assert!(
        err.contains(SWITCHD) && err.to_lowercase().contains("connection refused"),
        "{v}"
    );
    assert!(took < 1.0, "readyz took {took} s: {v}");
    eprintln!("switchd down: readyz 200 in {took:.3} s: {v}");
    let (code, v, took) = readyz_of(&lab, PAIR_API);
    assert_eq!(code, 200, "{v}\n{}", log("pair-api.log"));
    assert_eq!(v["switchd"], "unreachable", "{v}");
    let err = v["switchd_error"].as_str().unwrap_or_default();
    assert!(
        err.contains("no active switchd")
            && err.contains(SWITCHD)
            && err.contains("http://127.0.0.1:9103"),
        "{v}"
    );
    assert!(took < 1.0, "the pair API's readyz took {took} s: {v}");
    eprintln!("switchd down: the pair API's readyz 200 in {took:.3} s: {v}");
    // Reads keep working from the store meanwhile.
    let token = std::fs::read_to_string(&token_file).expect("admin token file");
    let (code, body) = lab.api_call(API, token.trim(), "GET", "/v1/servers", None);
    assert_eq!(code, 200, "{body}");

    // switchd back: reachable again.
    lab.spawn_switchd(&sw, &dir.join("switchd-2.log"));
    lab.wait_for(
        "switchd reachable again in readyz",
        Duration::from_secs(30),
        || readyz(&lab).1["switchd"] == "reachable",
    );
    lab.wait_for(
        "the active switchd reachable again in the pair API's readyz",
        Duration::from_secs(30),
        || readyz_of(&lab, PAIR_API).1["switchd"] == "reachable",
    );
}
