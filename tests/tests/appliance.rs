//! `capybara run` (switchd + REST API from one config file, one process) in
//! the lab (root; release binaries, or `CAPYBARA_BIN_DIR`): Linux clients
//! hold established connections through the appliance, one of them is
//! migrated through the API (so its owner is no longer the one Maglev would
//! pick), the appliance gets SIGTERM and is started again from the same
//! config: every flow mapping is back, with the same owners, and every
//! established connection keeps working byte-exact.

use capybara_systests::{bin, deployment_key, hostagent_migrating_config, output_dir, Lab};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

const SERVERS: u32 = 2;
const CONNS: usize = 20;
const API: &str = "http://127.0.0.1:18081";
const CLIENT_IP: &str = "198.18.0.11";

fn appliance_config(dir: &Path, key: &Path) -> PathBuf {
    capybara_systests::appliance_config(dir, SERVERS, key, "127.0.0.1:18081")
}

/// `capybara run CONFIG` inside the switch namespace, logging to `log`.
fn start_appliance(lab: &Lab, config: &Path, log: &Path) -> Child {
    let f = std::fs::File::create(log).expect("create log");
    lab.command("sw", bin("capybara"))
        .args(["run", config.to_str().unwrap()])
        .stdout(f.try_clone().unwrap())
        .stderr(f)
        .spawn()
        .expect("start capybara run")
}

/// SIGTERM, then waits (bounded) for a clean exit.
fn stop_appliance(child: &mut Child) -> std::process::ExitStatus {
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let start = Instant::now();
    loop {
        if let Some(st) = child.try_wait().expect("wait") {
            return st;
        }
        if start.elapsed() > Duration::from_secs(15) {
            let _ = child.kill();
            panic!("capybara run did not stop within 15 s of SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn log_of(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
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
        if !rest.starts_with("198.18.100.1:7\"") {
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
    let dir = output_dir("appliance");
    let mut lab = Lab::up("ap", SERVERS);
    let key = deployment_key(&dir);
    let config = appliance_config(&dir, &key);
    let check = Command::new(bin("capybara"))
        .args(["--check", config.to_str().unwrap()])
        .output()
        .expect("capybara --check");
    assert!(
        check.status.success(),
        "--check: {}",
        String::from_utf8_lossy(&check.stderr)
    );

    let log1 = dir.join("capybara-1.log");
    let mut app = start_appliance(&lab, &config, &log1);
    for j in 1..=SERVERS {
        let cfg = hostagent_migrating_config(&dir, j, &key, None);
        // Only this test moves connections: a policy's move would race the
        // explicit migration below.
        capybara_systests::disable_policies(&cfg);
        lab.spawn_hostagent(j, &cfg, &dir.join(format!("hostagent-s{j}.log")));
    }
    lab.wait_for("every server to register", Duration::from_secs(30), || {
        let l = log_of(&log1);
        (1..=SERVERS).all(|j| l.contains(&format!("registered s{j}")))
    });
    lab.wait_for("the API", Duration::from_secs(30), || {
        api(&lab, "", "GET", "/healthz").0 == 200
    });
    let token = std::fs::read_to_string(dir.join("admin-token"))
        .expect("admin token file")
        .trim()
        .to_string();

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
    let mut app = start_appliance(&lab, &config, &log2);
    lab.wait_for("the restarted switchd", Duration::from_secs(30), || {
        log_of(&log2).contains("flows from the store")
    });
    lab.wait_for("the restarted API", Duration::from_secs(30), || {
        api(&lab, "", "GET", "/healthz").0 == 200
    });
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
