//! A retired service address keeps its open connections across a restart
//! of the appliance (lab, root; release binaries, or `CAPYBARA_BIN_DIR`):
//! a real Linux client holds echo connections to a service created through
//! the REST API; the service's port is changed (`PUT`: the old address
//! retires, no new connection there, the open ones go on), more
//! connections are held at the new port, then the service is deleted (the
//! new address retires too: the store keeps one retiring record per
//! address, not one per name); `capybara run` gets SIGTERM and starts
//! again from the same config and store. The restarted switchd restores
//! both addresses as retiring from the store's records, so every held
//! connection still answers byte-exact, with no reset, and new ones are
//! still refused; the retire timeout counts from the retire, not from the
//! restart. Closed, each address goes and exactly its record is forgotten.

use capybara_systests::{appliance_lab, echo_once, log_of, start_appliance, stop_appliance, Lab};
use std::path::Path;
use std::time::Duration;

const SERVERS: u32 = 2;
const API: &str = "http://127.0.0.1:18082";
/// A VIP the config does not name (both servers serve echo there).
const NEW: &str = "198.18.100.2:17";
/// The port the service moves to (served there too).
const MOVED: &str = "198.18.100.2:18";

fn api(lab: &Lab, token: &str, method: &str, path: &str, json: Option<&str>) -> (u16, String) {
    lab.api_call(API, token, method, path, json)
}

/// The store's retiring records (name, address, deleted_unix_ms), read
/// from the appliance's SQLite file (another process may have it open:
/// SQLite shares it).
fn retiring_records(db: &Path) -> Vec<(String, String, u64)> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let store = capybara_store::SqliteStore::open(capybara_store::SqliteConfig::at(db))
            .await
            .expect("open the appliance's store");
        use capybara_store::Store;
        store
            .list_retiring_services()
            .await
            .expect("list retiring services")
            .into_iter()
            .map(|r| {
                (
                    r.service.name.clone(),
                    r.addr().to_string(),
                    r.deleted_unix_ms,
                )
            })
            .collect()
    })
}

/// The `retiring_for_ms` of service `name` in switchd's `/status`
/// (`metrics_listen` of the lab's switchd config).
fn retiring_for_ms(lab: &Lab, name: &str) -> Option<u64> {
    let out = lab.try_run(
        "sw",
        "curl",
        &["-s", "-m", "5", "http://127.0.0.1:9102/status"],
        Duration::from_secs(10),
    )?;
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).ok()?;
    v["services"]
        .as_array()?
        .iter()
        .find(|s| s["name"] == name && s["retiring"] == true)?["retiring_for_ms"]
        .as_u64()
}

#[test]
fn retired_addresses_keep_their_open_connections_across_a_restart() {
    let (mut lab, dir, key, config) =
        appliance_lab("appliance-retiring", "art", SERVERS, "127.0.0.1:18082");
    let db = dir.join("store.db");
    let log1 = dir.join("capybara-1.log");
    let mut app = start_appliance(&lab, &config, &log1);
    // Policies off, and echo on the two addresses this test retires.
    lab.start_hostagents_with(&dir, &key, SERVERS, |_, cfg| {
        capybara_systests::disable_policies(cfg);
        let mut t = std::fs::read_to_string(cfg).expect("read hostagent config");
        for addr in [NEW, MOVED] {
            t.push_str(&format!(
                "[[service]]\nlisten = \"{addr}\"\napp = \"echo\"\n"
            ));
        }
        std::fs::write(cfg, t).expect("write hostagent config");
    });
    lab.wait_for("every server to register", Duration::from_secs(30), || {
        let l = log_of(&log1);
        (1..=SERVERS).all(|j| l.contains(&format!("registered s{j}")))
    });
    lab.wait_for("the API", Duration::from_secs(30), || {
        api(&lab, "", "GET", "/healthz", None).0 == 200
    });
    let token = std::fs::read_to_string(dir.join("admin-token"))
        .expect("admin token file")
        .trim()
        .to_string();

    let (code, body) = api(
        &lab,
        &token,
        "POST",
        "/v1/services",
        Some(r#"{"name": "echo2", "vip": "198.18.100.2", "port": 17, "pool": []}"#),
    );
    assert_eq!(code, 201, "create: {body}");
    lab.wait_for("the new service to answer", Duration::from_secs(10), || {
        echo_once(&lab, NEW)
    });
    let mut open = capybara_systests::EchoHolder::start_to(&lab, NEW, 2);
    lab.wait_for(
        "the open connections' flow mappings in the store",
        Duration::from_secs(10),
        || {
            let (_, body) = api(&lab, &token, "GET", "/v1/connections?limit=10000", None);
            body.matches(&format!("-{NEW}\"")).count() == 2
        },
    );

    // Moved to another port: the old address retires (its connections go
    // on, nothing new there), recorded in the store with the update.
    let (code, body) = api(
        &lab,
        &token,
        "PUT",
        "/v1/services/echo2",
        Some(r#"{"vip": "198.18.100.2", "port": 18, "pool": []}"#),
    );
    assert_eq!(code, 200, "update: {body}");
    lab.wait_for(
        "switchd to serve the new port",
        Duration::from_secs(10),
        || echo_once(&lab, MOVED),
    );
    let l1 = log_of(&log1);
    assert!(
        l1.contains("service \"echo2\" deleted from the store: retiring"),
        "{l1}"
    );
    let records = retiring_records(&db);
    assert_eq!(records.len(), 1, "{records:?}");
    assert_eq!(
        (records[0].0.as_str(), records[0].1.as_str()),
        ("echo2", NEW)
    );
    assert_eq!(open.round_trip(), "ok", "open connections after the move");
    assert!(!echo_once(&lab, NEW), "a new connection to the old port");
    let mut moved = capybara_systests::EchoHolder::start_to(&lab, MOVED, 2);
    lab.wait_for(
        "the moved connections' flow mappings in the store",
        Duration::from_secs(10),
        || {
            let (_, body) = api(&lab, &token, "GET", "/v1/connections?limit=10000", None);
            body.matches(&format!("-{MOVED}\"")).count() == 2
        },
    );

    // Deleted: the new address retires too; both records are kept (one
    // per address, the old one is not overwritten).
    let (code, body) = api(&lab, &token, "DELETE", "/v1/services/echo2", None);
    assert_eq!(code, 204, "delete: {body}");
    lab.wait_for(
        "switchd to retire echo2's port 18",
        Duration::from_secs(10),
        || {
            log_of(&log1)
                .matches("service \"echo2\" deleted from the store: retiring")
                .count()
                == 2
        },
    );
    let records = retiring_records(&db);
    let addrs: Vec<&str> = records.iter().map(|r| r.1.as_str()).collect();
    assert_eq!(addrs, [NEW, MOVED], "{records:?}");
    assert!(records.iter().all(|r| r.0 == "echo2"), "{records:?}");
    assert!(records[0].2 <= records[1].2, "{records:?}");
    assert_eq!(open.round_trip(), "ok", "open connections after the delete");
    assert_eq!(
        moved.round_trip(),
        "ok",
        "moved connections after the delete"
    );
    assert!(
        !echo_once(&lab, MOVED),
        "a new connection to a deleted service"
    );

    // Restart: both retiring addresses are restored from the store.
    std::thread::sleep(Duration::from_secs(2));
    let st = stop_appliance(&mut app);
    assert!(
        st.success(),
        "capybara run exited with {st}: {}",
        log_of(&log1)
    );
    let log2 = dir.join("capybara-2.log");
    let mut app = start_appliance(&lab, &config, &log2);
    lab.wait_for("the restarted switchd", Duration::from_secs(30), || {
        log_of(&log2).contains("flows from the store")
    });
    lab.wait_for("the restarted API", Duration::from_secs(30), || {
        api(&lab, "", "GET", "/healthz", None).0 == 200
    });
    // The open connections go on, byte-exact, with no reset: those of the
    // port changed away from (reset before: no record of the old
    // address) and those of the deleted service.
    for _ in 0..2 {
        assert_eq!(
            open.round_trip(),
            "ok",
            "connections to the old port after the restart; logs in {}",
            dir.display()
        );
        assert_eq!(
            moved.round_trip(),
            "ok",
            "connections to the new port after the restart; logs in {}",
            dir.display()
        );
    }
    let l2 = log_of(&log2);
    for addr in [NEW, MOVED] {
        assert!(
            l2.contains(&format!(
                "restored retiring service \"echo2\" ({addr}) from the store"
            )),
            "{l2}"
        );
    }
    assert!(!l2.contains("serving service \"echo2\""), "{l2}");
    // Still retiring: a new connection is refused; the clock counts from
    // the retire (over 2 s before the restart), not from the restart.
    assert!(!echo_once(&lab, NEW), "a new connection after the restart");
    assert!(
        !echo_once(&lab, MOVED),
        "a new connection after the restart"
    );
    let mut age = None;
    lab.wait_for("echo2 retiring in /status", Duration::from_secs(5), || {
        age = retiring_for_ms(&lab, "echo2");
        age.is_some()
    });
    assert!(
        age.unwrap() >= 2000,
        "retiring_for_ms {age:?} counts from the delete"
    );
    assert_eq!(retiring_records(&db).len(), 2, "kept while they retire");

    // The old port's connections close: that address goes, and exactly
    // its record with it.
    assert_eq!(open.close(), "closed");
    lab.wait_for(
        "the old port to go with its last connection",
        Duration::from_secs(30),
        || {
            log_of(&log2).contains(
                "retired service \"echo2\" (198.18.100.2:17) removed: its last connection ended",
            )
        },
    );
    lab.wait_for(
        "the old port's record to be forgotten",
        Duration::from_secs(10),
        || retiring_records(&db).len() == 1,
    );
    let left = retiring_records(&db);
    assert_eq!(left[0].1, MOVED, "{left:?}");
    assert_eq!(moved.round_trip(), "ok", "the other address still retires");

    // Then the rest.
    assert_eq!(moved.close(), "closed");
    lab.wait_for(
        "the retired service to go with its last connection",
        Duration::from_secs(30),
        || {
            log_of(&log2).contains(
                "retired service \"echo2\" (198.18.100.2:18) removed: its last connection ended",
            )
        },
    );
    lab.wait_for(
        "the record to be forgotten",
        Duration::from_secs(10),
        || retiring_records(&db).is_empty(),
    );
    assert!(!echo_once(&lab, NEW), "after the retired service went");
    assert!(!echo_once(&lab, MOVED), "after the retired service went");
    assert!(echo_once(&lab, "198.18.100.1:7"), "configured echo service");
    let st = stop_appliance(&mut app);
    assert!(st.success(), "second run exited with {st}");
}
