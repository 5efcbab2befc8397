//! Whether switchd applied each stored service, and why it refused one
//! (lab, root; release binaries, or `CAPYBARA_BIN_DIR`): `capybara run`
//! (switchd and the REST API) on a SQLite store that this test also
//! writes, as a second API process or a hand edit of the store can, past
//! the API's checks: a service at the VIP:port of the configured `echo`.
//! switchd cannot serve two services at one address and refuses it; the
//! API (`serving.state`, `serving.refused_reason`) and `capybara ctl
//! services` say so with switchd's reason, where both showed it "pending"
//! for ever (the API even showed it served, by `echo`'s pool). A service
//! created through the API meanwhile goes from pending to applied and
//! answers; the refused one, moved to a free address, is applied too.

use capybara_systests::{
    appliance_lab, bin, echo_once, log_of, start_appliance, stop_appliance, Lab,
};
use std::path::Path;
use std::time::{Duration, Instant};

const SERVERS: u32 = 2;
const API: &str = "http://127.0.0.1:18131";
/// The configured echo service's address (the lab's switchd config).
const ECHO: &str = "198.18.100.1:7";
/// A VIP the config does not name (both servers serve echo there).
const NEW: &str = "198.18.100.2:17";
/// What switchd says of a second service at `ECHO` (`apply_services`).
const REASON: &str = "198.18.100.1:7 is already the address of service \"echo\"";

fn api(lab: &Lab, token: &str, method: &str, path: &str, json: Option<&str>) -> (u16, String) {
    lab.api_call(API, token, method, path, json)
}

/// `serving` of `GET /v1/services/NAME`.
fn serving(lab: &Lab, token: &str, name: &str) -> serde_json::Value {
    let (code, body) = api(lab, token, "GET", &format!("/v1/services/{name}"), None);
    assert_eq!(code, 200, "GET /v1/services/{name}: {body}");
    let v: serde_json::Value = serde_json::from_str(&body).expect("a service view");
    v["serving"].clone()
}

/// Writes `name` at `addr` into the appliance's store directly (another
/// process may have it open: SQLite shares it), as a second API process
/// racing this one could, past the API's unique-address check.
fn put_stored_service(db: &Path, name: &str, addr: &str) {
    let a: std::net::SocketAddrV4 = addr.parse().unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        use capybara_store::Store;
        let store = capybara_store::SqliteStore::open(capybara_store::SqliteConfig::at(db))
            .await
            .expect("open the appliance's store");
        store
            .put_service(&capybara_store::Service {
                name: name.into(),
                vip: *a.ip(),
                port: a.port(),
                pool: Vec::new(),
            })
            .await
            .expect("put the service");
    });
}

/// `capybara ctl services` against the appliance's API.
fn ctl_services(lab: &Lab, token: &str) -> String {
    let out = capybara_systests::try_run_with_timeout(
        {
            let mut c = lab.command("sw", bin("capybara"));
            c.args(["ctl", "--api", API, "--token", token, "services"]);
            c
        },
        Duration::from_secs(20),
    )
    .expect("capybara ctl services");
    assert!(out.status.success(), "ctl services: {out:?}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn a_service_switchd_refuses_is_shown_refused_with_its_reason() {
    let (mut lab, dir, key, config) =
        appliance_lab("service-refused-lab", "srf", SERVERS, "127.0.0.1:18131");
    let db = dir.join("store.db");
    let log = dir.join("capybara.log");
    let mut app = start_appliance(&lab, &config, &log);
    lab.start_hostagents_with(&dir, &key, SERVERS, |_, cfg| {
        capybara_systests::disable_policies(cfg);
        let mut t = std::fs::read_to_string(cfg).expect("read hostagent config");
        t.push_str(&format!(
            "[[service]]\nlisten = \"{NEW}\"\napp = \"echo\"\n"
        ));
        std::fs::write(cfg, t).expect("write hostagent config");
    });
    lab.wait_for("every server to register", Duration::from_secs(30), || {
        let l = log_of(&log);
        (1..=SERVERS).all(|j| l.contains(&format!("registered s{j}")))
    });
    lab.wait_for("the API", Duration::from_secs(30), || {
        api(&lab, "", "GET", "/healthz", None).0 == 200
    });
    let token = std::fs::read_to_string(dir.join("admin-token"))
        .expect("admin token file")
        .trim()
        .to_string();
    lab.wait_for("echo applied", Duration::from_secs(10), || {
        serving(&lab, &token, "echo")["state"] == "applied"
    });

    // A second service at echo's address, past the API (which refuses it:
    // 409). switchd keeps echo (first by name) and refuses the other.
    let (code, body) = api(
        &lab,
        &token,
        "POST",
        "/v1/services",
        Some(r#"{"name": "zz-dup", "vip": "198.18.100.1", "port": 7, "pool": []}"#),
    );
    assert_eq!(code, 409, "the API refuses it itself: {body}");
    put_stored_service(&db, "zz-dup", ECHO);
    let mut v = serde_json::Value::Null;
    lab.wait_for("zz-dup shown refused", Duration::from_secs(5), || {
        v = serving(&lab, &token, "zz-dup");
        v["state"] == "refused"
    });
    assert_eq!(v["served"], false, "{v}");
    assert_eq!(v["refused_reason"], REASON, "{v}");
    assert!(
        log_of(&log).contains(&format!("stored service \"zz-dup\" not served: {REASON}")),
        "{}",
        log_of(&log)
    );
    // echo is untouched, and still answers.
    assert_eq!(serving(&lab, &token, "echo")["state"], "applied");
    assert!(echo_once(&lab, ECHO), "echo after the refusal");

    // A good one, created through the API meanwhile: pending until
    // switchd's next read of the store (every 250 ms), then applied; never
    // refused.
    let (code, body) = api(
        &lab,
        &token,
        "POST",
        "/v1/services",
        Some(r#"{"name": "echo2", "vip": "198.18.100.2", "port": 17, "pool": []}"#),
    );
    assert_eq!(code, 201, "create: {body}");
    let created = Instant::now();
    let mut states = Vec::new();
    loop {
        let v = serving(&lab, &token, "echo2");
        let state = v["state"].as_str().unwrap_or("(none)").to_string();
        assert!(
            state == "pending" || state == "applied",
            "echo2 {state} after {:?}: {v}",
            created.elapsed()
        );
        assert_eq!(v["served"], state == "applied", "{v}");
        if states.last() != Some(&state) {
            states.push(state.clone());
        }
        if state == "applied" {
            break;
        }
        assert!(
            created.elapsed() < Duration::from_secs(3),
            "echo2 still pending after {:?}",
            created.elapsed()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    eprintln!(
        "echo2 states {states:?}, applied {:?} after its creation",
        created.elapsed()
    );
    lab.wait_for("echo2 to answer", Duration::from_secs(10), || {
        echo_once(&lab, NEW)
    });

    // ctl says the same, with switchd's reason.
    let out = ctl_services(&lab, &token);
    let line = |name: &str| {
        out.lines()
            .find(|l| l.starts_with(&format!("{name} ")))
            .unwrap_or_else(|| panic!("{name} not listed: {out}"))
            .to_string()
    };
    assert!(
        line("zz-dup").ends_with(&format!("refused: {REASON}")),
        "{out}"
    );
    assert!(!line("echo2").contains("pending"), "{out}");
    assert!(!line("echo2").contains("refused"), "{out}");

    // The refusal holds until the service (or the one in its way)
    // changes: moved to a free address through the API, it is applied.
    let (code, body) = api(
        &lab,
        &token,
        "PUT",
        "/v1/services/zz-dup",
        Some(r#"{"vip": "198.18.100.3", "port": 7, "pool": []}"#),
    );
    assert_eq!(code, 200, "move: {body}");
    lab.wait_for("zz-dup applied", Duration::from_secs(5), || {
        serving(&lab, &token, "zz-dup")["state"] == "applied"
    });
    assert!(
        serving(&lab, &token, "zz-dup")["refused_reason"].is_null(),
        "no reason once applied"
    );
    assert!(echo_once(&lab, ECHO), "echo at the end");
    let st = stop_appliance(&mut app);
    assert!(st.success(), "capybara run exited with {st}");
}
