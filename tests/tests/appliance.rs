//! `capybara run` (switchd + REST API from one config file, one process) in
//! the lab (root; release binaries, or `CAPYBARA_BIN_DIR`): Linux clients
//! hold established connections through the appliance, one of them is
//! migrated through the API (so its owner is no longer the one Maglev would
//! pick), the appliance gets SIGTERM and is started again from the same
//! config: every flow mapping is back, with the same owners, and every
//! established connection keeps working byte-exact. And services: the
//! config's are written to the store, and a service created through the
//! REST API is served by the data plane (also after a restart) until it is
//! deleted.

use capybara_systests::{
    assert_check_passes, deployment_key, echo_once, hostagent_migrating_config, log_of, output_dir,
    start_appliance, stop_appliance, Lab,
};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::{Duration, Instant};

const SERVERS: u32 = 2;
const CONNS: usize = 20;
const API: &str = "http://127.0.0.1:18081";
const CLIENT_IP: &str = "198.18.0.11";

/// The two labs run one at a time (each runs an appliance and two
/// hostagents on a 2-core machine).
static ONE_LAB: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn one_lab() -> std::sync::MutexGuard<'static, ()> {
    ONE_LAB.lock().unwrap_or_else(|e| e.into_inner())
}

fn appliance_config(lab: &Lab, dir: &Path, key: &Path) -> PathBuf {
    capybara_systests::appliance_config(lab, dir, SERVERS, key, "127.0.0.1:18081")
}

/// The appliance, then a hostagent on every server (policies off; `extra`
/// appended to each config), once all registered and the API answers:
/// the appliance and its admin token.
fn start_with_servers(
    lab: &mut Lab,
    dir: &Path,
    key: &Path,
    config: &Path,
    log: &Path,
    extra: &str,
) -> (Child, String) {
    let app = start_appliance(lab, config, log);
    for j in 1..=SERVERS {
        let cfg = hostagent_migrating_config(dir, j, key, None);
        capybara_systests::disable_policies(&cfg);
        let mut t = std::fs::read_to_string(&cfg).expect("read hostagent config");
        t.push_str(extra);
        std::fs::write(&cfg, t).expect("write hostagent config");
        lab.spawn_hostagent(j, &cfg, &dir.join(format!("hostagent-s{j}.log")));
    }
    lab.wait_for("every server to register", Duration::from_secs(30), || {
        let l = log_of(log);
        (1..=SERVERS).all(|j| l.contains(&format!("registered s{j}")))
    });
    lab.wait_for("the API", Duration::from_secs(30), || {
        api(lab, "", "GET", "/healthz").0 == 200
    });
    let token = std::fs::read_to_string(dir.join("admin-token"))
        .expect("admin token file")
        .trim()
        .to_string();
    (app, token)
}

/// [`start_appliance`] again (same config and store), once its switchd has
/// read the store and its API answers.
fn restart_appliance(lab: &Lab, config: &Path, log: &Path) -> Child {
    let app = start_appliance(lab, config, log);
    lab.wait_for("the restarted switchd", Duration::from_secs(30), || {
        log_of(log).contains("flows from the store")
    });
    lab.wait_for("the restarted API", Duration::from_secs(30), || {
        api(lab, "", "GET", "/healthz").0 == 200
    });
    app
}

/// `curl` inside the switch namespace: (status, body).
fn api(lab: &Lab, token: &str, method: &str, path: &str) -> (u16, String) {
    api_with(lab, token, method, path, None)
}

fn api_with(lab: &Lab, token: &str, method: &str, path: &str, json: Option<&str>) -> (u16, String) {
    lab.api_call(API, token, method, path, json)
}

/// Owners of the client's connections to the echo service, from
/// `GET /v1/connections` (ids `198.18.0.11:PORT-198.18.100.1:7`).
fn owners(lab: &Lab, token: &str) -> BTreeMap<u16, u32> {
    owners_of(lab, token, "198.18.100.1:7")
}

/// [`owners`] of the connections to the service at `addr` (VIP:port).
fn owners_of(lab: &Lab, token: &str, addr: &str) -> BTreeMap<u16, u32> {
    let (code, body) = api(lab, token, "GET", "/v1/connections?limit=10000");
    let mut m = BTreeMap::new();
    if code != 200 {
        return m;
    }
    let prefix = format!("\"id\":\"{CLIENT_IP}:");
    for item in body.split(&prefix).skip(1) {
        let Some((port, rest)) = item.split_once('-') else {
            continue;
        };
        if !rest.starts_with(&format!("{addr}\"")) {
            continue;
        }
        let server = rest
            .split_once("\"server\":")
            .map(|(_, s)| {
                s.chars()
                    .take_while(|c| c.is_ascii_digit())
                    .collect::<String>()
            })
            .and_then(|s| s.parse().ok());
        if let (Ok(p), Some(s)) = (port.parse(), server) {
            m.insert(p, s);
        }
    }
    m
}

#[test]
fn restart_keeps_flow_mappings_and_established_connections() {
    let _one = one_lab();
    let dir = output_dir("appliance");
    let mut lab = Lab::up("ap", SERVERS);
    let key = deployment_key(&dir);
    let config = appliance_config(&lab, &dir, &key);
    assert_check_passes(&config, "the test's config");

    let log1 = dir.join("capybara-1.log");
    // Only this test moves connections: a policy's move would race the
    // explicit migration below (policies are off).
    let (mut app, token) = start_with_servers(&mut lab, &dir, &key, &config, &log1, "");

    // Established connections from a real Linux client.
    let mut holder = capybara_systests::EchoHolder::start(&lab, CONNS);
    let ports = holder.ports.clone();

    lab.wait_for(
        "every connection's flow mapping in the store",
        Duration::from_secs(10),
        || {
            let o = owners(&lab, &token);
            ports.iter().all(|p| o.contains_key(p))
        },
    );
    // Move one connection off its Maglev server: after the restart it only
    // reaches its owner if the mapping itself was restored.
    let o = owners(&lab, &token);
    let moved = ports[0];
    let from = o[&moved];
    let to = from % SERVERS + 1;
    let (code, body) = api_with(
        &lab,
        &token,
        "POST",
        &format!("/v1/connections/{CLIENT_IP}:{moved}-198.18.100.1:7/migrate"),
        Some(&format!("{{\"target\": {to}}}")),
    );
    assert!(code == 200 || code == 202, "migrate: {code} {body}");
    lab.wait_for(
        "the migrated connection's new owner in the store",
        Duration::from_secs(10),
        || owners(&lab, &token).get(&moved) == Some(&to),
    );
    let before = owners(&lab, &token);

    // Graceful stop, then the same config again.
    let st = stop_appliance(&mut app);
    assert!(
        st.success(),
        "capybara run exited with {st}: {}",
        log_of(&log1)
    );
    assert!(
        log_of(&log1).contains("capybara: stopped"),
        "{}",
        log_of(&log1)
    );

    let log2 = dir.join("capybara-2.log");
    let mut app = restart_appliance(&lab, &config, &log2);
    let after = owners(&lab, &token);
    for p in &ports {
        assert_eq!(
            after.get(p),
            before.get(p),
            "owner of connection from port {p} after the restart"
        );
    }

    // The established connections go on, the migrated one included.
    let start = Instant::now();
    let done = holder.round_trip();
    assert_eq!(
        done,
        "ok",
        "established connections after the restart (after {:?}); logs in {}",
        start.elapsed(),
        dir.display()
    );
    let st = stop_appliance(&mut app);
    assert!(st.success(), "second run exited with {st}");
}

#[test]
fn services_created_through_the_api_are_served() {
    let _one = one_lab();
    let dir = output_dir("appliance-services");
    let mut lab = Lab::up("asv", SERVERS);
    let key = deployment_key(&dir);
    let config = appliance_config(&lab, &dir, &key);
    // Both servers also serve echo on a VIP the appliance's config does not
    // name: nothing reaches it until an operator creates the service.
    const NEW: &str = "198.18.100.2:17";
    let log1 = dir.join("capybara-1.log");
    let extra = format!("[[service]]\nlisten = \"{NEW}\"\napp = \"echo\"\n");
    let (mut app, token) = start_with_servers(&mut lab, &dir, &key, &config, &log1, &extra);

    // The config's services are in the store, so the API lists them.
    let (code, body) = api(&lab, &token, "GET", "/v1/services");
    assert_eq!(code, 200, "{body}");
    for name in ["echo", "web"] {
        assert!(
            body.contains(&format!("\"name\":\"{name}\"")),
            "configured service {name} not listed: {body}"
        );
    }
    assert!(echo_once(&lab, "198.18.100.1:7"), "configured echo service");
    assert!(
        !echo_once(&lab, NEW),
        "{NEW} answered before any service named it"
    );

    // Created through the API: served within a store poll.
    let (code, body) = api_with(
        &lab,
        &token,
        "POST",
        "/v1/services",
        Some(r#"{"name": "echo2", "vip": "198.18.100.2", "port": 17, "pool": []}"#),
    );
    assert_eq!(code, 201, "create: {body}");
    // Until switchd's next read of the store (every 250 ms) and status
    // (every 200 ms), the API shows it not served: what `ctl services`
    // shows as `pending: switchd applies it within 1 s` (measured here:
    // 190-300 ms; the bound leaves a loaded machine some margin).
    let created = Instant::now();
    let mut pending_seen = false;
    let applied_after = loop {
        let (code, body) = api(&lab, &token, "GET", "/v1/services/echo2");
        assert_eq!(code, 200, "{body}");
        if body.contains("\"served\":true") {
            break created.elapsed();
        }
        pending_seen |= body.contains("\"served\":false");
        assert!(
            created.elapsed() < Duration::from_secs(3),
            "echo2 still not served after {:?}: {body}",
            created.elapsed()
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    eprintln!("echo2 served {applied_after:?} after its creation (pending seen: {pending_seen})");
    assert!(
        applied_after < Duration::from_millis(1500),
        "switchd applied echo2 after {applied_after:?}"
    );
    lab.wait_for("the new service to answer", Duration::from_secs(10), || {
        echo_once(&lab, NEW)
    });
    assert!(
        log_of(&log1).contains("serving service \"echo2\" at 198.18.100.2:17"),
        "{}",
        log_of(&log1)
    );
    // The API shows what the data plane does with it (switchd's status is
    // published a few times a second).
    let mut body = String::new();
    lab.wait_for(
        "the API to show echo2 served",
        Duration::from_secs(5),
        || {
            body = api(&lab, &token, "GET", "/v1/services/echo2").1;
            body.contains("\"served\":true")
        },
    );
    assert!(
        body.contains("\"members\":[1,2]"),
        "GET /v1/services/echo2: {body}"
    );
    // A pool edit reaches switchd.
    let (code, body) = api_with(
        &lab,
        &token,
        "PUT",
        "/v1/services/echo2",
        Some(r#"{"vip": "198.18.100.2", "port": 17, "pool": [1, 2]}"#),
    );
    assert_eq!(code, 200, "update: {body}");
    lab.wait_for("switchd to apply the pool", Duration::from_secs(10), || {
        log_of(&log1).contains("service \"echo2\" updated from the store")
    });
    assert!(echo_once(&lab, NEW), "after the pool edit");

    // A restart serves it from the store (the config does not name it),
    // and writes no second copy of the configured services.
    let st = stop_appliance(&mut app);
    assert!(st.success(), "capybara run exited with {st}");
    let log2 = dir.join("capybara-2.log");
    let mut app = restart_appliance(&lab, &config, &log2);
    assert!(
        log_of(&log2).contains("serving service \"echo2\""),
        "{}",
        log_of(&log2)
    );
    assert!(
        !log_of(&log2).contains("wrote configured service"),
        "{}",
        log_of(&log2)
    );
    lab.wait_for(
        "the new service after the restart",
        Duration::from_secs(10),
        || echo_once(&lab, NEW),
    );

    // Deleted: new connections are refused at once, the open ones go on
    // (and still migrate) until they close; then it is gone. The
    // configured services are untouched.
    let mut open = capybara_systests::EchoHolder::start_to(&lab, NEW, 2);
    lab.wait_for(
        "the open connections in the store",
        Duration::from_secs(10),
        || owners_of(&lab, &token, NEW).len() == 2,
    );
    let (code, body) = api(&lab, &token, "DELETE", "/v1/services/echo2");
    assert_eq!(code, 204, "delete: {body}");
    let (_, body) = api(&lab, &token, "GET", "/v1/services");
    assert!(body.contains("\"served\":true"), "{body}");
    lab.wait_for("switchd to retire echo2", Duration::from_secs(10), || {
        log_of(&log2).contains("service \"echo2\" deleted from the store: retiring")
    });
    let refused = Instant::now();
    assert!(
        !echo_once(&lab, NEW),
        "a new connection to a deleted service"
    );
    assert!(
        refused.elapsed() < Duration::from_secs(1),
        "refused at once (the switch's reset), not left to time out: {:?}",
        refused.elapsed()
    );
    assert_eq!(open.round_trip(), "ok", "open connections after the delete");
    // One of them moves to the other server and goes on there.
    let o = owners_of(&lab, &token, NEW);
    let (&moved, &from) = o.iter().next().expect("an open connection");
    let to = from % SERVERS + 1;
    let (code, body) = api_with(
        &lab,
        &token,
        "POST",
        &format!("/v1/connections/{CLIENT_IP}:{moved}-{NEW}/migrate"),
        Some(&format!("{{\"target\": {to}}}")),
    );
    assert!(code == 200 || code == 202, "migrate: {code} {body}");
    lab.wait_for(
        "the retiring service's connection on its new server",
        Duration::from_secs(10),
        || owners_of(&lab, &token, NEW).get(&moved) == Some(&to),
    );
    assert_eq!(open.round_trip(), "ok", "open connections after the move");
    assert!(
        !log_of(&log2).contains("retired service \"echo2\""),
        "removed while connections were open: {}",
        log_of(&log2)
    );
    assert_eq!(open.close(), "closed");
    lab.wait_for(
        "the retired service to go with its last connection",
        Duration::from_secs(30),
        || {
            log_of(&log2).contains(
                "retired service \"echo2\" (198.18.100.2:17) removed: its last connection ended",
            )
        },
    );
    assert!(!echo_once(&lab, NEW), "after the retired service went");
    assert!(echo_once(&lab, "198.18.100.1:7"), "configured echo service");
    let st = stop_appliance(&mut app);
    assert!(st.success(), "second run exited with {st}");
}

/// A configured service deleted through the API stays deleted: the store
/// remembers that switchd seeded it, so a restart with the same config
/// neither serves nor lists it, and says why in its log; created again
/// through the API, it is served again.
#[test]
fn a_configured_service_deleted_through_the_api_stays_deleted() {
    let _one = one_lab();
    let dir = output_dir("appliance-seeded");
    let mut lab = Lab::up("asd", SERVERS);
    let key = deployment_key(&dir);
    let config = appliance_config(&lab, &dir, &key);
    const ECHO: &str = "198.18.100.1:7";
    let log1 = dir.join("capybara-1.log");
    let (mut app, token) = start_with_servers(&mut lab, &dir, &key, &config, &log1, "");
    assert!(
        log_of(&log1).contains("wrote configured service \"echo\""),
        "{}",
        log_of(&log1)
    );
    lab.wait_for(
        "the configured echo service",
        Duration::from_secs(10),
        || echo_once(&lab, ECHO),
    );

    let (code, body) = api(&lab, &token, "DELETE", "/v1/services/echo");
    assert_eq!(code, 204, "delete: {body}");
    lab.wait_for("switchd to retire echo", Duration::from_secs(10), || {
        log_of(&log1).contains("service \"echo\" deleted from the store: retiring")
    });
    assert!(!echo_once(&lab, ECHO), "a deleted service answered");
    // Gone (no connection was open), its retiring record with it: a
    // restart before then would keep it retiring (appliance_retiring.rs).
    lab.wait_for(
        "echo to go, and its record",
        Duration::from_secs(10),
        || {
            let l = log_of(&log1);
            l.contains(
                "retired service \"echo\" (198.18.100.1:7) removed: its last connection ended",
            ) && l.contains("forgot the retiring record of service \"echo\"")
        },
    );
    let st = stop_appliance(&mut app);
    assert!(st.success(), "capybara run exited with {st}");

    // The same config again: "echo" is not written back.
    let log2 = dir.join("capybara-2.log");
    let mut app = restart_appliance(&lab, &config, &log2);
    let l2 = log_of(&log2);
    let why = "configured service \"echo\" not written: deleted through the API earlier (create it again through the API to serve it)";
    assert_eq!(l2.matches(why).count(), 1, "said once, at the start: {l2}");
    assert!(!l2.contains("wrote configured service"), "{l2}");
    assert!(!l2.contains("serving service \"echo\""), "{l2}");
    let (code, body) = api(&lab, &token, "GET", "/v1/services");
    assert_eq!(code, 200, "{body}");
    assert!(!body.contains("\"name\":\"echo\""), "echo listed: {body}");
    assert!(body.contains("\"name\":\"web\""), "web not listed: {body}");
    let (code, body) = api(&lab, &token, "GET", "/v1/services/echo");
    assert_eq!(code, 404, "GET /v1/services/echo: {body}");
    assert!(
        !echo_once(&lab, ECHO),
        "the deleted service answered after the restart"
    );

    // Created again through the API: served again.
    let (code, body) = api_with(
        &lab,
        &token,
        "POST",
        "/v1/services",
        Some(r#"{"name": "echo", "vip": "198.18.100.1", "port": 7, "pool": []}"#),
    );
    assert_eq!(code, 201, "create: {body}");
    lab.wait_for(
        "the service created again to answer",
        Duration::from_secs(10),
        || echo_once(&lab, ECHO),
    );
    assert!(
        log_of(&log2).contains("serving service \"echo\" at 198.18.100.1:7"),
        "{}",
        log_of(&log2)
    );
    let st = stop_appliance(&mut app);
    assert!(st.success(), "second run exited with {st}");
}
