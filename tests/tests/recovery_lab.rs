//! Recovery of the appliance's SQLite store (lab, root; release binaries,
//! or `CAPYBARA_BIN_DIR`; the `sqlite3` shell): the figures of
//! docs/OPERATIONS.md "## Recovery" come from here.
//!
//! - Backup and restore: servers with an operator weight, a drain and a
//!   service created through the REST API, a real Linux client holding
//!   echo connections, some migrated through the API before a live backup
//!   (`sqlite3 DB ".timeout 5000" ".backup OUT"`, `pragma integrity_check`
//!   ok), some after it; SIGTERM, the store files moved aside, the backup in
//!   place, start: weights, drains, services and flow mappings are those of
//!   the backup, then the hostagents report the connections they hold
//!   (FLOWS) and the store names the owners they had before the stop again;
//!   every connection goes on byte-exact, also the ones that migrated after
//!   the backup (before FLOWS reports they ended with a reset).
//! - Lost store: held echo connections, some migrated through the API; an
//!   operator weight and a service set after they were placed, and more
//!   connections placed at that weight; the store files moved aside and no
//!   backup: the hostagents register again and report the connections they
//!   hold (both timed), the weight and the service are gone, the store names
//!   every connection's owner again, and every connection goes on
//!   byte-exact: the ones that never migrated, the migrated ones and the
//!   ones placed at the lost weight (before FLOWS reports the migrated ones
//!   ended with a reset, and some of those placed at the lost weight too).
//!   Also counted: the connections the hostagents still report open.
//! - Corrupt file: `capybara run` exits 1 naming the file and the reason,
//!   for a file that is not SQLite, one with every page after the first
//!   damaged, and one with only the flows table damaged; `capybara --check`
//!   passes (it does not open the store).
//!
//! Each test prints `RECOVERY ...` lines with its figures (`-- --nocapture`).

use capybara_systests::{
    appliance_lab, assert_check_passes, bin, echo_once, log_of, output_ok, start_appliance,
    stop_appliance, switchd_status_server, wait_appliance_ready, EchoHolder, EchoOutcome, Lab,
};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

const SERVERS: u32 = 3;
const API: &str = "http://127.0.0.1:18096";
const CLIENT_IP: &str = "198.18.0.11";
const ECHO: &str = "198.18.100.1:7";
/// How long the origin of a migration forwards the connection's late
/// segments to its new owner (`GONE_LINGER` in hostagent/src/migration.rs):
/// a segment that reaches the origin later finds no connection there.
const GONE_LINGER: Duration = Duration::from_secs(5);
/// How long a client waits for its echo after a restart before the
/// connection counts as hung.
const HANG: Duration = Duration::from_secs(10);

/// One lab at a time (each runs an appliance and three hostagents on a
/// 2-core machine).
static ONE_LAB: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn one_lab() -> std::sync::MutexGuard<'static, ()> {
    ONE_LAB.lock().unwrap_or_else(|e| e.into_inner())
}

/// A `capybara run` process, killed if the test fails before it stopped it.
struct Appliance(Child);

impl Appliance {
    fn start(lab: &Lab, config: &Path, log: &Path) -> Appliance {
        Appliance(start_appliance(lab, config, log))
    }

    /// SIGTERM, then a clean exit (`stop_appliance`).
    fn stop(&mut self) -> std::process::ExitStatus {
        stop_appliance(&mut self.0)
    }
}

impl Drop for Appliance {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

fn api(lab: &Lab, token: &str, method: &str, path: &str, json: Option<&str>) -> (u16, String) {
    lab.api_call(API, token, method, path, json)
}

fn api_json(lab: &Lab, token: &str, path: &str) -> serde_json::Value {
    let (code, body) = api(lab, token, "GET", path, None);
    assert_eq!(code, 200, "GET {path}: {body}");
    serde_json::from_str(&body).expect("JSON")
}

/// Owners of the client's echo connections, from `GET /v1/connections`.
fn owners(lab: &Lab, token: &str) -> BTreeMap<u16, u32> {
    let (code, body) = api(lab, token, "GET", "/v1/connections?limit=10000", None);
    let mut m = BTreeMap::new();
    if code != 200 {
        return m;
    }
    let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
    for c in v["items"].as_array().into_iter().flatten() {
        if c["port"] == 7 {
            let port = c["client_port"].as_u64().unwrap_or(0) as u16;
            let server = c["server"].as_u64().unwrap_or(0) as u32;
            m.insert(port, server);
        }
    }
    m
}

/// Migrates the connection from client port `port` to `to` through the
/// REST API and waits until the store names its new owner.
fn migrate(lab: &Lab, token: &str, port: u16, to: u32) {
    let (code, body) = api(
        lab,
        token,
        "POST",
        &format!("/v1/connections/{CLIENT_IP}:{port}-{ECHO}/migrate"),
        Some(&format!("{{\"target\": {to}}}")),
    );
    assert!(
        code == 200 || code == 202,
        "migrate {port} to s{to}: {code} {body}"
    );
    lab.wait_for(
        &format!("connection {port} owned by s{to} in the store"),
        Duration::from_secs(10),
        || owners(lab, token).get(&port) == Some(&to),
    );
}

/// The appliance and a hostagent on every server (policies off: only this
/// test moves connections), once all registered and the API answers: the
/// appliance and its admin token.
fn start_all(
    lab: &mut Lab,
    dir: &Path,
    key: &Path,
    config: &Path,
    log: &Path,
) -> (Appliance, String) {
    let app = Appliance::start(lab, config, log);
    lab.start_hostagents(dir, key, SERVERS);
    let token = wait_appliance_ready(lab, log, SERVERS, API, dir);
    (app, token)
}

/// Moves `store.db`, `store.db-wal` and `store.db-shm` to `dir/aside/`.
fn move_store_aside(dir: &Path) {
    let aside = dir.join("aside");
    std::fs::create_dir_all(&aside).unwrap();
    for f in ["store.db", "store.db-wal", "store.db-shm"] {
        let p = dir.join(f);
        if p.exists() {
            std::fs::rename(&p, aside.join(f)).expect("move the store file aside");
        }
    }
}

/// The `sqlite3` shell with `args`: its stdout (trimmed); panics on failure.
fn sqlite3(args: &[&str]) -> String {
    let mut cmd = Command::new("sqlite3");
    cmd.args(args);
    output_ok(
        cmd,
        &format!("sqlite3 {args:?} (Debian package sqlite3, installed by make setup)"),
    )
}

/// Waits until the appliance logging to `log` has read its store: the
/// number of servers and flows it read, from its `active` line.
fn wait_store_read(lab: &Lab, log: &Path) -> (u64, u64) {
    lab.wait_for("switchd to read the store", Duration::from_secs(30), || {
        log_of(log).contains("flows from the store")
    });
    let l = log_of(log);
    let line = l
        .lines()
        .find(|l| l.contains("flows from the store"))
        .unwrap()
        .to_string();
    // "... attached to N interfaces, S servers and F flows from the store"
    let num_before = |word: &str| -> u64 {
        let i = line.find(word).unwrap();
        line[..i]
            .split_whitespace()
            .last()
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("a number before {word:?} in {line:?}"))
    };
    (num_before(" servers and"), num_before(" flows from"))
}

/// Every outcome of `ports` in `round`, checked to be `want`.
fn assert_outcomes(
    round: &BTreeMap<u16, EchoOutcome>,
    ports: &BTreeSet<u16>,
    want: &str,
    what: &str,
) {
    for p in ports {
        let o = round.get(p).unwrap_or_else(|| panic!("no outcome for {p}"));
        assert_eq!(o.what, want, "{what}: connection from port {p}: {o:?}");
    }
}

/// A round on `holder`: every one of `ports` echoes byte-exact (`what`).
fn assert_all_ok(holder: &mut EchoHolder, ports: &[u16], what: &str) {
    let r = holder.round_outcomes(HANG);
    assert_outcomes(&r, &except(ports, &BTreeSet::new()), "ok", what);
}

/// The slowest outcome among `ports`, in ms.
fn slowest(round: &BTreeMap<u16, EchoOutcome>, ports: &BTreeSet<u16>) -> f64 {
    ports.iter().map(|p| round[p].ms).fold(0.0, f64::max)
}

/// The connections the hostagents report in their heartbeats (switchd's
/// `/status`), per server (index 0: s1), once the reports agree twice in a
/// row.
fn reported_connections(lab: &Lab) -> Vec<u64> {
    let read = || -> Vec<u64> {
        (1..=SERVERS)
            .map(|j| {
                switchd_status_server(lab, j)
                    .and_then(|s| s["connections"].as_u64())
                    .unwrap_or(u64::MAX)
            })
            .collect()
    };
    let mut last = read();
    for _ in 0..20 {
        std::thread::sleep(Duration::from_millis(300));
        let now = read();
        if now == last && !now.contains(&u64::MAX) {
            break;
        }
        last = now;
    }
    last
}

fn server_json(lab: &Lab, token: &str, id: u32) -> serde_json::Value {
    api_json(lab, token, &format!("/v1/servers/{id}"))
}

/// Creates the service `echo2` (198.18.100.2:17) through the REST API.
fn create_echo2(lab: &Lab, token: &str) {
    let (code, body) = api(
        lab,
        token,
        "POST",
        "/v1/services",
        Some(r#"{"name": "echo2", "vip": "198.18.100.2", "port": 17, "pool": []}"#),
    );
    assert_eq!(code, 201, "create a service: {body}");
}

/// `n` echo connections held from `c1` ([`EchoHolder::start_reporting`]),
/// once the store has every one of them (`what`): the holder and the
/// connections' client ports.
fn hold(lab: &Lab, token: &str, n: usize, what: &str) -> (EchoHolder, Vec<u16>) {
    let holder = EchoHolder::start_reporting(lab, ECHO, n);
    let ports = holder.ports.clone();
    lab.wait_for(what, Duration::from_secs(10), || {
        let o = owners(lab, token);
        ports.iter().all(|p| o.contains_key(p))
    });
    (holder, ports)
}

/// The client ports of `ports` that are not in `gone`.
fn except(ports: &[u16], gone: &BTreeSet<u16>) -> BTreeSet<u16> {
    ports
        .iter()
        .copied()
        .filter(|p| !gone.contains(p))
        .collect()
}

/// SIGTERM to the appliance logging to `log`, checked to exit cleanly;
/// then its store files moved aside.
fn stop_and_move_aside(app: &mut Appliance, log: &Path, dir: &Path) {
    let st = app.stop();
    assert!(
        st.success(),
        "capybara run exited with {st}: {}",
        log_of(log)
    );
    move_store_aside(dir);
}

/// The appliance started again (`dir/capybara-2.log`), once it has read
/// its store: the appliance, its log, and the servers and flows it read.
fn restart(lab: &Lab, config: &Path, dir: &Path) -> (Appliance, PathBuf, u64, u64) {
    let log = dir.join("capybara-2.log");
    let app = Appliance::start(lab, config, &log);
    let (servers, flows) = wait_store_read(lab, &log);
    (app, log, servers, flows)
}

/// Waits until the API answers `/healthz`.
fn wait_api(lab: &Lab) {
    lab.wait_for("the API", Duration::from_secs(30), || {
        api(lab, "", "GET", "/healthz", None).0 == 200
    });
}

/// Sleeps until the origins of the connections migrated at `migrated_at`
/// forgot them (`GONE_LINGER`, and half a second).
fn wait_origins_forgot(migrated_at: Instant) {
    let wait = GONE_LINGER + Duration::from_millis(500);
    std::thread::sleep(wait.saturating_sub(migrated_at.elapsed()));
}

/// Waits until switchd (logging to `log`) has every server's complete
/// FLOWS report ("sN reported its connections"): milliseconds from `since`.
fn wait_flow_reports(lab: &Lab, log: &Path, since: Instant) -> u128 {
    let start = Instant::now();
    loop {
        let l = log_of(log);
        if (1..=SERVERS).all(|j| l.contains(&format!("s{j} reported its connections"))) {
            return since.elapsed().as_millis();
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "the hostagents did not report their connections: {l}"
        );
        let _ = lab;
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// switchd's `/status` `flow_claims` (FLOWS claims by outcome).
fn flow_claims(lab: &Lab) -> String {
    capybara_systests::switchd_status_at(lab, 9102)
        .map(|s| s["flow_claims"].to_string())
        .unwrap_or_default()
}

#[test]
fn a_live_backup_restored_after_a_stop_brings_back_what_it_held() {
    let _one = one_lab();
    const N: usize = 18;
    let (mut lab, dir, key, config) =
        appliance_lab("recovery-lab-backup", "rcb", SERVERS, "127.0.0.1:18096");
    let log1 = dir.join("capybara-1.log");
    let (mut app, token) = start_all(&mut lab, &dir, &key, &config, &log1);

    // What an operator set: a weight, a drain, a service.
    lab.set_weight(API, &token, 2, 2);
    lab.start_drain(API, &token, 3, 10);
    lab.wait_for("s3 drained", Duration::from_secs(15), || {
        server_json(&lab, &token, 3)["state"] == "drained"
    });
    create_echo2(&lab, &token);

    // Held connections (on s1 and s2: s3 is drained); three migrate before
    // the backup.
    let (mut holder, ports) = hold(&lab, &token, N, "every held connection in the store");
    let o = owners(&lab, &token);
    let before_backup: BTreeSet<u16> = ports[..3].iter().copied().collect();
    for p in &before_backup {
        migrate(&lab, &token, *p, 3 - o[p]);
    }
    let at_backup = owners(&lab, &token);

    // The live backup, checked.
    let backup = dir.join("backup.db");
    let db = dir.join("store.db");
    sqlite3(&[
        db.to_str().unwrap(),
        ".timeout 5000",
        &format!(".backup {}", backup.display()),
    ]);
    let b = backup.to_str().unwrap();
    assert_eq!(sqlite3(&[b, "pragma integrity_check"]), "ok");
    let backup_servers: u64 = sqlite3(&[b, "select count(*) from servers"])
        .parse()
        .unwrap();
    let backup_flows: u64 = sqlite3(&[b, "select count(*) from flows"]).parse().unwrap();
    let in_backup: BTreeMap<u16, u32> = sqlite3(&[
        b,
        "select client_port, server from flows where service_port = 7",
    ])
    .lines()
    .map(|l| {
        let (p, s) = l.split_once('|').unwrap();
        (p.parse().unwrap(), s.parse().unwrap())
    })
    .collect();
    for p in &ports {
        assert_eq!(
            in_backup.get(p),
            at_backup.get(p),
            "owner of {p} in the backup"
        );
    }

    // After the backup: three more migrate (the backup's mapping of them
    // is stale), s2's weight and s3's drain change.
    let after_backup: BTreeSet<u16> = ports[3..6].iter().copied().collect();
    for p in &after_backup {
        migrate(&lab, &token, *p, 3 - at_backup[p]);
    }
    lab.set_weight(API, &token, 2, 3);
    let (code, body) = api(&lab, &token, "POST", "/v1/servers/3/undrain", None);
    assert!(code == 200 || code == 204, "undrain: {code} {body}");
    lab.wait_for("s3 undrained", Duration::from_secs(10), || {
        server_json(&lab, &token, 3)["state"] == "active"
    });
    let migrated_at = Instant::now();
    assert_all_ok(&mut holder, &ports, "before the stop");
    let before_stop = owners(&lab, &token);

    // Restore, once the migrations' origins forgot them (GONE_LINGER: the
    // backup's stale mapping then reaches a server that no longer knows
    // the connection): stop, the store files aside, the backup in place,
    // start.
    wait_origins_forgot(migrated_at);
    stop_and_move_aside(&mut app, &log1, &dir);
    std::fs::copy(&backup, &db).expect("put the backup in place");
    let (mut app, log2, read_servers, read_flows) = restart(&lab, &config, &dir);
    let switchd_active = Instant::now();
    // A round at once; switchd asks the servers it restored for their
    // connections meanwhile.
    let all = except(&ports, &BTreeSet::new());
    let (window, reported) = std::thread::scope(|sc| {
        let round = sc.spawn(|| holder.round_outcomes(HANG));
        let reported = wait_flow_reports(&lab, &log2, switchd_active);
        (round.join().expect("the round"), reported)
    });
    assert_outcomes(
        &window,
        &all,
        "ok",
        "a connection sent to at once after the restore",
    );
    let window_ms = slowest(&window, &all);
    assert_eq!(read_servers, backup_servers, "servers read from the backup");
    assert_eq!(read_flows, backup_flows, "flows read from the backup");
    wait_api(&lab);

    // The backup's operator state (not the later one), through the API and
    // switchd's status.
    assert_eq!(server_json(&lab, &token, 2)["weight"], 2, "s2's weight");
    assert_eq!(
        server_json(&lab, &token, 3)["state"],
        "drained",
        "s3's drain"
    );
    lab.wait_for(
        "switchd to apply the restored state",
        Duration::from_secs(10),
        || {
            let s2 = switchd_status_server(&lab, 2);
            let s3 = switchd_status_server(&lab, 3);
            s2.is_some_and(|s| s["weight"] == 2 && s["state"] == "live")
                && s3.is_some_and(|s| s["state"] == "draining")
        },
    );
    let services = api_json(&lab, &token, "/v1/services");
    let mut names: Vec<String> = services["items"]
        .as_array()
        .or(services.as_array())
        .into_iter()
        .flatten()
        .filter_map(|s| s["name"].as_str().map(String::from))
        .collect();
    names.sort();
    assert_eq!(names, ["echo", "echo2", "web"], "services: {services}");
    // The hostagents reported the connections they hold (FLOWS): the store
    // names the owners they had before the stop again, the ones that
    // migrated after the backup included.
    lab.wait_for(
        "the store to name the owners before the stop",
        Duration::from_secs(10),
        || {
            let o = owners(&lab, &token);
            ports.iter().all(|p| o.get(p) == before_stop.get(p))
        },
    );
    let restored = owners(&lab, &token);
    for p in &after_backup {
        assert_ne!(
            at_backup.get(p),
            before_stop.get(p),
            "{p} migrated after the backup"
        );
    }

    // Every connection goes on, also the ones that migrated after the
    // backup.
    let r = holder.round_outcomes(HANG);
    let stay = except(&ports, &BTreeSet::new());
    assert_outcomes(
        &r,
        &stay,
        "ok",
        "a connection after the restore (migrated after the backup or not)",
    );
    let slow_ms = slowest(&r, &after_backup);

    // The restored appliance migrates again.
    let p = ports[6];
    migrate(&lab, &token, p, 3 - restored[&p]);
    let r = holder.round_outcomes(HANG);
    assert_outcomes(&r, &stay, "ok", "after a migration on the restored store");
    assert!(echo_once(&lab, ECHO), "a new connection after the restore");
    let held: u64 = reported_connections(&lab).iter().sum();
    let claims = flow_claims(&lab);

    println!(
        "RECOVERY backup: {} servers, {backup_flows} flow mappings in the backup and back after the restore; \
         the hostagents reported their connections {reported} ms after switchd was active \
         (flow_claims {claims}); {N} held echo connections, {} migrated before the backup, {} after it: \
         all {} go on byte-exact, in a round sent at once after the start (slowest {window_ms:.1} ms) \
         and later (slowest of those migrated after it {slow_ms:.1} ms); the hostagents \
         report {held} open connections",
        backup_servers,
        before_backup.len(),
        after_backup.len(),
        stay.len()
    );
    let st = app.stop();
    assert!(st.success(), "second run exited with {st}");
}

#[test]
fn on_a_lost_store_the_servers_register_again_and_unmigrated_connections_go_on() {
    let _one = one_lab();
    const N: usize = 24;
    const MIGRATED: usize = 6;
    const WEIGHTED: usize = 12;
    let (mut lab, dir, key, config) =
        appliance_lab("recovery-lab-lost", "rcl", SERVERS, "127.0.0.1:18096");
    let log1 = dir.join("capybara-1.log");
    let (mut app, token) = start_all(&mut lab, &dir, &key, &config, &log1);

    let (mut holder, ports) = hold(&lab, &token, N, "every held connection in the store");
    let o = owners(&lab, &token);
    let migrated: BTreeSet<u16> = ports[..MIGRATED].iter().copied().collect();
    for p in &migrated {
        migrate(&lab, &token, *p, o[p] % SERVERS + 1);
    }
    let migrated_at = Instant::now();
    assert_all_ok(&mut holder, &ports, "before the stop");
    let before_stop = owners(&lab, &token);
    // What an operator set after those were placed: a weight and a
    // service, and connections placed at that weight.
    lab.set_weight(API, &token, 2, 3);
    lab.wait_for("switchd to apply weight 3", Duration::from_secs(5), || {
        switchd_status_server(&lab, 2).is_some_and(|s| s["weight"] == 3)
    });
    create_echo2(&lab, &token);
    let (mut weighted, wports) = hold(
        &lab,
        &token,
        WEIGHTED,
        "the connections placed at weight 3 in the store",
    );
    assert_all_ok(
        &mut weighted,
        &wports,
        "placed at weight 3, before the stop",
    );
    let wbefore_stop = owners(&lab, &token);

    // Once the migrations' origins forgot them (GONE_LINGER: a segment
    // that reaches the origin finds no connection there), stop, the store
    // files aside, start on an empty store.
    wait_origins_forgot(migrated_at);
    stop_and_move_aside(&mut app, &log1, &dir);
    let (mut app, log2, read_servers, read_flows) = restart(&lab, &config, &dir);
    let active = Instant::now();
    assert_eq!((read_servers, read_flows), (0, 0), "an empty store");
    // A round at once, while the hostagents register again and report:
    // segments that find no server, or a server that does not hold their
    // connection, are dropped, never reset; the client retransmits. Polled
    // every 10 ms meanwhile: the hostagents' next heartbeats are refused
    // ("not registered") and they register again, then report the
    // connections they hold.
    let all = except(&ports, &BTreeSet::new());
    let (window, registered, reported) = std::thread::scope(|sc| {
        let round = sc.spawn(|| holder.round_outcomes(HANG));
        let start = Instant::now();
        let registered = loop {
            let l = log_of(&log2);
            if (1..=SERVERS).all(|j| l.contains(&format!("registered s{j}"))) {
                break active.elapsed();
            }
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "the hostagents did not register again: {l}"
            );
            std::thread::sleep(Duration::from_millis(10));
        };
        let reported = wait_flow_reports(&lab, &log2, active);
        (round.join().expect("the round"), registered, reported)
    });
    assert_outcomes(
        &window,
        &all,
        "ok",
        "a connection sent to at once after the restart",
    );
    let window_ms = slowest(&window, &all);
    wait_api(&lab);
    let services = api_json(&lab, &token, "/v1/services");
    let text = services.to_string();
    assert!(
        text.contains("\"echo\"") && text.contains("\"web\""),
        "the configured services written again: {text}"
    );
    // Lost with the file: the service created through the API and the
    // operator's weight (s2 is back at its REGISTER weight).
    assert!(!text.contains("echo2"), "{text}");
    assert_eq!(server_json(&lab, &token, 2)["weight"], 1, "s2's weight");

    // Their reports (FLOWS) named every owner: the store has them all
    // again, the migrated ones and those placed at the lost weight
    // included.
    lab.wait_for(
        "the store to name every owner again",
        Duration::from_secs(10),
        || {
            let o = owners(&lab, &token);
            ports.iter().all(|p| o.get(p) == before_stop.get(p))
                && wports.iter().all(|p| o.get(p) == wbefore_stop.get(p))
        },
    );

    // Every connection goes on, the migrated ones too.
    let r = holder.round_outcomes(HANG);
    let stay = except(&ports, &BTreeSet::new());
    assert_outcomes(&r, &stay, "ok", "a connection (migrated or not)");
    let migrated_ms = slowest(&r, &migrated);
    let r = holder.round_outcomes(HANG);
    assert_outcomes(&r, &stay, "ok", "a second round");
    // Placed at weight 3 and recovered at weight 1: their owners reported
    // them, none is reset.
    let r = weighted.round_outcomes(HANG);
    let weighted_reset = r.values().filter(|o| o.what == "reset").count();
    assert_outcomes(
        &r,
        &except(&wports, &BTreeSet::new()),
        "ok",
        "a connection placed at weight 3",
    );
    assert!(echo_once(&lab, ECHO), "a new connection on the empty store");
    // What the servers hold: every held connection, and no other.
    let held = reported_connections(&lab);
    let held_total: u64 = held.iter().sum();
    let claims = flow_claims(&lab);

    println!(
        "RECOVERY lost store: hostagents registered again {} ms and reported their connections \
         {reported} ms after switchd was active (flow_claims {claims}); {N} held echo connections, \
         {MIGRATED} migrated before: all {} go on byte-exact, in a round sent at once after the \
         restart (slowest {window_ms:.1} ms) and after the reports (slowest migrated {migrated_ms:.1} ms); \
         the hostagents report {held_total} open connections {held:?}; of {WEIGHTED} placed while \
         s2 had weight 3 (lost with the store), {weighted_reset} reset",
        registered.as_millis(),
        stay.len(),
    );
    let st = app.stop();
    assert!(st.success(), "second run exited with {st}");
}

/// `capybara run` in the lab's switch namespace that must stop on its own:
/// (exit code, output).
fn run_expecting_exit(lab: &Lab, config: &Path) -> (Option<i32>, String) {
    let out = lab.run(
        "sw",
        bin("capybara").to_str().unwrap(),
        &["run", config.to_str().unwrap()],
        Duration::from_secs(30),
    );
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code(), text)
}

/// `capybara run` on the store `db` as it is now: checked to exit 1
/// naming the file and `reason`, without a panic (`what`: the damage); its
/// output, also saved as `dir/save_as`.
fn assert_refused_start(
    lab: &Lab,
    config: &Path,
    db: &Path,
    reason: &str,
    what: &str,
    save_as: &str,
) -> String {
    let (code, text) = run_expecting_exit(lab, config);
    std::fs::write(db.with_file_name(save_as), &text).unwrap();
    assert_eq!(code, Some(1), "exit status for {what}: {text}");
    assert!(
        text.contains(&format!("SQLite store {}", db.display())) && text.contains(reason),
        "the file and the reason: {text}"
    );
    assert!(
        !text.contains("panicked") && !text.contains("500 Internal"),
        "{text}"
    );
    text
}

/// The last line of `text` that contains `word` (empty if none).
fn last_line_with(text: &str, word: &str) -> String {
    text.lines()
        .filter(|l| l.contains(word))
        .last()
        .unwrap_or("")
        .to_string()
}

#[test]
fn a_corrupt_store_file_stops_the_start_with_its_name_and_reason() {
    let _one = one_lab();
    let (lab, dir, _, config) = appliance_lab("recovery-lab-corrupt", "rcc", 1, "127.0.0.1:18096");
    let db: PathBuf = dir.join("store.db");

    // A file that is not SQLite.
    let garbage: Vec<u8> = (0..64 * 1024u32)
        .map(|i| (i * 2_654_435_761u32 >> 13) as u8)
        .collect();
    std::fs::write(&db, &garbage).unwrap();
    let text = assert_refused_start(
        &lab,
        &config,
        &db,
        "file is not a database",
        "a file that is not SQLite",
        "not-sqlite-run.txt",
    );
    // `capybara --check` does not open the store.
    assert_check_passes(&config, "a corrupt store");
    let not_db = text
        .lines()
        .find(|l| l.contains("not a database"))
        .unwrap_or("")
        .to_string();

    // A real store (the appliance wrote it) with its pages after the first
    // damaged: the header and the schema read, the tables do not.
    std::fs::remove_file(&db).unwrap();
    let log = dir.join("capybara-1.log");
    let mut app = Appliance::start(&lab, &config, &log);
    wait_store_read(&lab, &log);
    let st = app.stop();
    assert!(
        st.success(),
        "capybara run exited with {st}: {}",
        log_of(&log)
    );
    for f in ["store.db-wal", "store.db-shm"] {
        let _ = std::fs::remove_file(dir.join(f));
    }
    let good = std::fs::read(&db).unwrap();
    let page: usize = sqlite3(&[db.to_str().unwrap(), "pragma page_size"])
        .parse()
        .unwrap();
    let flows_page: usize = sqlite3(&[
        db.to_str().unwrap(),
        "select rootpage from sqlite_master where name = 'flows'",
    ])
    .parse()
    .unwrap();
    assert!(good.len() > page, "the store has more than one page");
    let mut bytes = good.clone();
    for (i, b) in bytes[page..].iter_mut().enumerate() {
        *b = garbage[i % garbage.len()];
    }
    std::fs::write(&db, &bytes).unwrap();
    let text = assert_refused_start(
        &lab,
        &config,
        &db,
        "database disk image is malformed",
        "damaged pages",
        "malformed-run.txt",
    );
    let malformed = last_line_with(&text, "malformed");

    // Only the flows table damaged (the one switchd alone reads at start).
    let mut bytes = good.clone();
    let at = (flows_page - 1) * page;
    for (i, b) in bytes[at..at + page].iter_mut().enumerate() {
        *b = garbage[i % garbage.len()];
    }
    std::fs::write(&db, &bytes).unwrap();
    let text = assert_refused_start(
        &lab,
        &config,
        &db,
        "database disk image is malformed",
        "a damaged flows table",
        "flows-run.txt",
    );
    let flows = last_line_with(&text, "malformed");
    println!(
        "RECOVERY corrupt store: not SQLite: exit 1: {not_db}\n\
         RECOVERY corrupt store: pages damaged: exit 1: {malformed}\n\
         RECOVERY corrupt store: flows table damaged: exit 1: {flows}"
    );
}
