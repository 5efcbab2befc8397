//! Bad inputs give clear errors naming the cause: corrupt and foreign SQLite
//! files, schema versions, malformed keys and values, unreachable etcd.

mod support;

use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use capybara_proto::flow::ServerId;
use capybara_store::testing::EtcdCluster;
use capybara_store::*;

fn tmp() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("capybara-store-err-")
        .tempdir()
        .unwrap()
}

#[tokio::test]
async fn garbage_file_is_reported_as_corrupt_with_its_path() {
    let dir = tmp();
    let path = dir.path().join("store.db");
    std::fs::write(
        &path,
        b"this is not a database, it is a text file\n".repeat(200),
    )
    .unwrap();
    let e = SqliteStore::open(SqliteConfig::at(&path))
        .await
        .unwrap_err();
    assert!(matches!(e, StoreError::Corrupt { .. }), "{e}");
    let msg = e.to_string();
    assert!(
        msg.contains(&path.display().to_string()) && msg.contains("not a database"),
        "{msg}"
    );
}

#[tokio::test]
async fn damaged_pages_are_reported_as_corrupt() {
    let dir = tmp();
    let path = dir.path().join("store.db");
    {
        let s = SqliteStore::open(SqliteConfig::at(&path)).await.unwrap();
        let ops: Vec<FlowOp> = (0..20_000u32)
            .map(|i| FlowOp::Put {
                key: capybara_proto::flow::FlowKey {
                    client_ip: Ipv4Addr::from(i),
                    client_port: 1,
                    service_ip: Ipv4Addr::LOCALHOST,
                    service_port: 2,
                },
                server: ServerId(1),
            })
            .collect();
        s.apply_flows(&ops).await.unwrap();
    }
    // Checkpoint the WAL into the main file, then overwrite pages past the header.
    {
        let c = rusqlite::Connection::open(&path).unwrap();
        c.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(()))
            .unwrap();
    }
    let mut bytes = std::fs::read(&path).unwrap();
    assert!(bytes.len() > 64 * 1024);
    let end = bytes.len() - 4096;
    for b in &mut bytes[8192..end] {
        *b = 0xA5;
    }
    std::fs::write(&path, &bytes).unwrap();
    let res = match SqliteStore::open(SqliteConfig::at(&path)).await {
        Err(e) => Err(e),
        Ok(s) => s.scan_flows().await.map(|_| ()),
    };
    let e = res.unwrap_err();
    assert!(matches!(e, StoreError::Corrupt { .. }), "{e}");
    assert!(e.to_string().contains(&path.display().to_string()), "{e}");
}

#[tokio::test]
async fn foreign_sqlite_files_are_refused() {
    let dir = tmp();
    let path = dir.path().join("app.db");
    rusqlite::Connection::open(&path)
        .unwrap()
        .execute_batch("CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT); INSERT INTO users VALUES (1, 'x');")
        .unwrap();
    let e = SqliteStore::open(SqliteConfig::at(&path))
        .await
        .unwrap_err();
    assert!(matches!(e, StoreError::ForeignDatabase { .. }), "{e}");
    assert!(e.to_string().contains("users"), "{e}");

    let path2 = dir.path().join("other.db");
    rusqlite::Connection::open(&path2)
        .unwrap()
        .execute_batch("PRAGMA application_id = 1234;")
        .unwrap();
    let e = SqliteStore::open(SqliteConfig::at(&path2))
        .await
        .unwrap_err();
    assert!(e.to_string().contains("0x4d2"), "{e}");
}

#[tokio::test]
async fn newer_schema_is_refused_and_older_is_migrated() {
    let dir = tmp();
    let path = dir.path().join("store.db");
    drop(SqliteStore::open(SqliteConfig::at(&path)).await.unwrap());
    rusqlite::Connection::open(&path)
        .unwrap()
        .execute_batch("PRAGMA user_version = 99;")
        .unwrap();
    let e = SqliteStore::open(SqliteConfig::at(&path))
        .await
        .unwrap_err();
    assert!(
        matches!(e, StoreError::SchemaTooNew { found: 99, .. }),
        "{e}"
    );

    // A version-1 file with data is migrated on open, data intact.
    let old = dir.path().join("v1.db");
    capybara_store::sqlite::create_at_schema_version(&old, 1).unwrap();
    rusqlite::Connection::open(&old)
        .unwrap()
        .execute(
            "INSERT INTO flows VALUES (167772161, 1000, 3232235521, 443, 4)",
            [],
        )
        .unwrap();
    let s = SqliteStore::open(SqliteConfig::at(&old)).await.unwrap();
    let v: i64 = rusqlite::Connection::open(&old)
        .unwrap()
        .query_row("PRAGMA user_version", [], |r| r.get(0))
        .unwrap();
    assert_eq!(v, capybara_store::sqlite::SCHEMA_VERSION);
    let flows = s.list_flows_by_server(ServerId(4)).await.unwrap();
    assert_eq!(flows.len(), 1);
    assert_eq!(flows[0].to_string(), "10.0.0.1:1000->192.168.0.1:443");
    s.put_server(&Server::new(
        ServerId(1),
        "a",
        "127.0.0.1:1".parse().unwrap(),
        Ipv4Addr::LOCALHOST,
    ))
    .await
    .unwrap();
}

/// A file written before seeded marks existed (no `seeded_services`
/// table) opens with no marks and takes them, without a schema version
/// bump (an older build still opens it); a bad stored mark names its key.
#[tokio::test]
async fn sqlite_file_without_seeded_marks_opens_and_takes_them() {
    let dir = tmp();
    let path = dir.path().join("pre-seeded.db");
    let version = capybara_store::sqlite::SCHEMA_VERSION;
    capybara_store::sqlite::create_at_schema_version(&path, version).unwrap();
    let tables = |p: &std::path::Path| -> Vec<String> {
        let c = rusqlite::Connection::open(p).unwrap();
        let mut st = c
            .prepare("SELECT name FROM sqlite_master WHERE type = 'table'")
            .unwrap();
        let names = st.query_map([], |r| r.get(0)).unwrap();
        names.map(|n| n.unwrap()).collect()
    };
    assert!(!tables(&path).contains(&"seeded_services".to_string()));
    let s = SqliteStore::open(SqliteConfig::at(&path)).await.unwrap();
    assert!(tables(&path).contains(&"seeded_services".to_string()));
    assert_eq!(s.seeded_services().await.unwrap(), Vec::<String>::new());
    s.mark_seeded(&["web".to_string()]).await.unwrap();
    drop(s);
    let s = SqliteStore::open(SqliteConfig::at(&path)).await.unwrap();
    assert_eq!(s.seeded_services().await.unwrap(), vec!["web".to_string()]);
    let v: i64 = rusqlite::Connection::open(&path)
        .unwrap()
        .query_row("PRAGMA user_version", [], |r| r.get(0))
        .unwrap();
    assert_eq!(v, version, "no schema version bump");
    rusqlite::Connection::open(&path)
        .unwrap()
        .execute("INSERT INTO seeded_services VALUES ('bad name')", [])
        .unwrap();
    let e = s.seeded_services().await.unwrap_err();
    assert!(
        matches!(e, StoreError::MalformedKey { ref key, .. } if key == "seeded/bad name"),
        "{e}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_malformed_seeded_marks_name_the_key() {
    let cluster = EtcdCluster::start(1).unwrap();
    let s = EtcdStore::connect(cluster.store_config()).await.unwrap();
    s.mark_seeded(&["web".to_string()]).await.unwrap();
    s.inject_raw("seeded/echo", b"garbage".to_vec())
        .await
        .unwrap();
    let e = s.seeded_services().await.unwrap_err();
    assert!(
        matches!(e, StoreError::MalformedValue { ref key, .. } if key == "seeded/echo"),
        "{e}"
    );
    s.inject_raw("seeded/echo", br#"{"v":1,"data":{}}"#.to_vec())
        .await
        .unwrap();
    assert_eq!(s.seeded_services().await.unwrap(), ["echo", "web"]);
    s.inject_raw("seeded/bad name", br#"{"v":1,"data":{}}"#.to_vec())
        .await
        .unwrap();
    let e = s.seeded_services().await.unwrap_err();
    assert!(
        matches!(e, StoreError::MalformedKey { ref key, .. } if key == "seeded/bad name"),
        "{e}"
    );
}

/// A file written before retiring records existed (no
/// `retiring_services` table) opens with none and takes them, without a
/// schema version bump; a bad stored record names its key.
#[tokio::test]
async fn sqlite_file_without_retiring_records_opens_and_takes_them() {
    let dir = tmp();
    let path = dir.path().join("pre-retiring.db");
    let version = capybara_store::sqlite::SCHEMA_VERSION;
    capybara_store::sqlite::create_at_schema_version(&path, version).unwrap();
    let service = Service {
        name: "web".into(),
        vip: Ipv4Addr::new(198, 18, 100, 2),
        port: 17,
        pool: vec![ServerId(1)],
    };
    {
        // A service stored by the older build.
        let c = rusqlite::Connection::open(&path).unwrap();
        let value = r#"{"v":1,"data":{"name":"web","vip":"198.18.100.2","port":17,"pool":[1]}}"#;
        c.execute(
            "INSERT INTO services (name, value) VALUES ('web', ?1)",
            [value.as_bytes()],
        )
        .unwrap();
        let mut st = c
            .prepare("SELECT name FROM sqlite_master WHERE type = 'table'")
            .unwrap();
        let names: Vec<String> = st
            .query_map([], |r| r.get(0))
            .unwrap()
            .map(|n| n.unwrap())
            .collect();
        assert!(!names.contains(&"retiring_services".to_string()));
    }
    let s = SqliteStore::open(SqliteConfig::at(&path)).await.unwrap();
    assert!(s.list_retiring_services().await.unwrap().is_empty());
    assert!(s.delete_service("web").await.unwrap());
    drop(s);
    let s = SqliteStore::open(SqliteConfig::at(&path)).await.unwrap();
    let got = s.list_retiring_services().await.unwrap();
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].service, service);
    let v: i64 = rusqlite::Connection::open(&path)
        .unwrap()
        .query_row("PRAGMA user_version", [], |r| r.get(0))
        .unwrap();
    assert_eq!(v, version, "no schema version bump");
    let c = rusqlite::Connection::open(&path).unwrap();
    c.execute(
        "INSERT INTO retiring_services VALUES ('echo', 1, x'676172626167')",
        [],
    )
    .unwrap();
    let e = s.list_retiring_services().await.unwrap_err();
    assert!(
        matches!(e, StoreError::MalformedValue { ref key, .. } if key == "retiring/echo"),
        "{e}"
    );
    c.execute(
        "UPDATE retiring_services SET value = (SELECT value FROM retiring_addresses WHERE name = 'web') WHERE name = 'echo'",
        [],
    )
    .unwrap();
    let e = s.list_retiring_services().await.unwrap_err();
    assert!(
        matches!(e, StoreError::MalformedValue { ref key, ref reason } if key == "retiring/echo" && reason.contains("\"web\"")),
        "{e}"
    );
    c.execute("DELETE FROM retiring_services WHERE name = 'echo'", [])
        .unwrap();
    c.execute(
        "INSERT INTO retiring_services VALUES ('bad name', 1, x'00')",
        [],
    )
    .unwrap();
    let e = s.list_retiring_services().await.unwrap_err();
    assert!(
        matches!(e, StoreError::MalformedKey { ref key, .. } if key == "retiring/bad name"),
        "{e}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_malformed_retiring_records_name_the_key() {
    let cluster = EtcdCluster::start(1).unwrap();
    let s = EtcdStore::connect(cluster.store_config()).await.unwrap();
    s.inject_raw("retiring/echo", b"garbage".to_vec())
        .await
        .unwrap();
    let e = s.list_retiring_services().await.unwrap_err();
    assert!(
        matches!(e, StoreError::MalformedValue { ref key, .. } if key == "retiring/echo"),
        "{e}"
    );
    // The exact-record forget does not remove what it cannot read.
    let echo_at: std::net::SocketAddrV4 = "198.18.100.2:17".parse().unwrap();
    let e = s
        .forget_retiring_service("echo", echo_at, 1)
        .await
        .unwrap_err();
    assert!(e.to_string().contains("retiring/echo"), "{e}");
    s.inject_raw(
        "retiring/echo",
        br#"{"v":1,"data":{"service":{"name":"web","vip":"198.18.100.2","port":17,"pool":[]},"deleted_unix_ms":5}}"#.to_vec(),
    )
    .await
    .unwrap();
    let e = s.list_retiring_services().await.unwrap_err();
    assert!(
        matches!(e, StoreError::MalformedValue { ref key, ref reason } if key == "retiring/echo" && reason.contains("\"web\"")),
        "{e}"
    );
    s.inject_raw("retiring/echo", br#"{"v":2,"data":{}}"#.to_vec())
        .await
        .unwrap();
    let e = s.list_retiring_services().await.unwrap_err();
    assert!(
        matches!(e, StoreError::UnsupportedVersion { found: 2, .. }),
        "{e}"
    );
    s.inject_raw(
        "retiring/echo",
        br#"{"v":1,"data":{"service":{"name":"echo","vip":"198.18.100.2","port":17,"pool":[]},"deleted_unix_ms":5}}"#.to_vec(),
    )
    .await
    .unwrap();
    let got = s.list_retiring_services().await.unwrap();
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].deleted_unix_ms, 5);
    assert!(!s
        .forget_retiring_service("echo", "198.18.100.2:18".parse().unwrap(), 5)
        .await
        .unwrap());
    assert!(s.forget_retiring_service("echo", echo_at, 5).await.unwrap());
    s.inject_raw("retiring/bad name", b"{}".to_vec())
        .await
        .unwrap();
    let e = s.list_retiring_services().await.unwrap_err();
    assert!(
        matches!(e, StoreError::MalformedKey { ref key, .. } if key == "retiring/bad name"),
        "{e}"
    );
}

#[tokio::test]
async fn sqlite_malformed_values_and_keys_name_the_key() {
    let dir = tmp();
    let s = SqliteStore::open(SqliteConfig::at(dir.path().join("s.db")))
        .await
        .unwrap();
    s.inject_raw_server(5, b"{not json".to_vec()).await.unwrap();
    let e = s.get_server(ServerId(5)).await.unwrap_err();
    assert!(
        matches!(e, StoreError::MalformedValue { ref key, .. } if key == "servers/5"),
        "{e}"
    );
    let e = s.list_servers().await.unwrap_err();
    assert!(e.to_string().contains("servers/5"), "{e}");
    s.inject_raw_server(5, br#"{"v":9,"data":{}}"#.to_vec())
        .await
        .unwrap();
    let e = s.get_server(ServerId(5)).await.unwrap_err();
    assert!(
        matches!(e, StoreError::UnsupportedVersion { found: 9, .. }),
        "{e}"
    );
    s.inject_raw_server(5, br#"{"v":1,"data":{"id":5}}"#.to_vec())
        .await
        .unwrap();
    let e = s.get_server(ServerId(5)).await.unwrap_err();
    assert!(e.to_string().contains("missing field"), "{e}");
    s.inject_raw_flow([1, 70_000, 1, 1, 1]).await.unwrap();
    let e = s.scan_flows().await.unwrap_err();
    assert!(
        matches!(e, StoreError::MalformedKey { ref key, .. } if key.starts_with("flows/")),
        "{e}"
    );
    assert!(e.to_string().contains("70000"), "{e}");
}

/// A server record as written before records had `instance` and
/// `register_seq` (docs/STORE.md, "Server records").
const PRE_INSTANCE_SERVER: &[u8] = br#"{"v":1,"data":{"id":5,"name":"s5","mgmt_addr":"198.18.1.15:40000","data_addr":"198.18.2.15","state":"dead","weight":1,"registered_unix_ms":1763800000000,"updated_unix_ms":1763800000000,"data_mac":"02:00:00:00:00:05"}}"#;

/// `s` holds [`PRE_INSTANCE_SERVER`]: it loads, read alone or listed,
/// without instance id, and a read-modify-write adds none.
async fn assert_pre_instance_record_loads(s: &dyn Store) {
    let got = s.get_server(ServerId(5)).await.unwrap().unwrap();
    assert_eq!(s.list_servers().await.unwrap(), vec![got.clone()]);
    assert_eq!(
        (got.id, got.state, got.data_mac.as_deref()),
        (ServerId(5), ServerState::Dead, Some("02:00:00:00:00:05"))
    );
    assert_eq!((got.instance, got.register_seq), (None, None));
    let w = s.set_server_weight(ServerId(5), 2).await.unwrap();
    assert_eq!((w.weight, w.instance, w.register_seq), (2, None, None));
}

#[tokio::test]
async fn sqlite_server_records_without_instance_still_load() {
    let dir = tmp();
    let s = SqliteStore::open(SqliteConfig::at(dir.path().join("s.db")))
        .await
        .unwrap();
    s.inject_raw_server(5, PRE_INSTANCE_SERVER.to_vec())
        .await
        .unwrap();
    assert_pre_instance_record_loads(&s).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_server_records_without_instance_still_load() {
    let cluster = EtcdCluster::start(1).unwrap();
    let s = EtcdStore::connect(cluster.store_config()).await.unwrap();
    s.inject_raw("servers/5", PRE_INSTANCE_SERVER.to_vec())
        .await
        .unwrap();
    assert_pre_instance_record_loads(&s).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_malformed_values_and_keys_name_the_key() {
    let cluster = EtcdCluster::start(1).unwrap();
    let s = EtcdStore::connect(cluster.store_config()).await.unwrap();
    s.inject_raw("servers/5", b"\x00\x01binary".to_vec())
        .await
        .unwrap();
    let e = s.get_server(ServerId(5)).await.unwrap_err();
    assert!(
        matches!(e, StoreError::MalformedValue { ref key, .. } if key == "servers/5"),
        "{e}"
    );
    assert!(s
        .list_servers()
        .await
        .unwrap_err()
        .to_string()
        .contains("servers/5"));
    s.inject_raw("servers/abc", br#"{"v":1,"data":{}}"#.to_vec())
        .await
        .unwrap();
    s.inject_raw("servers/5", Vec::new()).await.unwrap();
    let e = s.list_servers().await.unwrap_err();
    assert!(e.to_string().contains("servers/"), "{e}");
    s.inject_raw("policy", br#"{"v":2,"data":{}}"#.to_vec())
        .await
        .unwrap();
    let e = s.get_policy().await.unwrap_err();
    assert!(
        matches!(e, StoreError::UnsupportedVersion { found: 2, ref key, .. } if key == "policy"),
        "{e}"
    );
    s.inject_raw(
        "flows/not-a-flow",
        br#"{"v":1,"data":{"server":1}}"#.to_vec(),
    )
    .await
    .unwrap();
    let e = s.scan_flows().await.unwrap_err();
    assert!(
        matches!(e, StoreError::MalformedKey { ref key, .. } if key == "flows/not-a-flow"),
        "{e}"
    );
    s.inject_raw(
        "flows/1.2.3.4:5->6.7.8.9:10",
        br#"{"v":1,"data":{"server":-1}}"#.to_vec(),
    )
    .await
    .unwrap();
    let e = s
        .get_flow(&capybara_store::codec::parse_flow("", "1.2.3.4:5->6.7.8.9:10").unwrap())
        .await
        .unwrap_err();
    assert!(e.to_string().contains("flows/1.2.3.4:5->6.7.8.9:10"), "{e}");
}

#[tokio::test]
async fn unreachable_etcd_names_the_endpoints() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let endpoint = format!("http://127.0.0.1:{port}");
    let start = Instant::now();
    let e = EtcdStore::connect(EtcdConfig {
        endpoints: vec![endpoint.clone()],
        connect_timeout_ms: 500,
        request_timeout_ms: 500,
        ..Default::default()
    })
    .await
    .unwrap_err();
    assert!(matches!(e, StoreError::Unreachable { .. }), "{e}");
    assert!(e.to_string().contains(&endpoint), "{e}");
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "bounded: {:?}",
        start.elapsed()
    );
    readable_outage(&e.to_string());
}

/// What an operator reads during an etcd outage (`/readyz`, `ctl`, logs):
/// the gRPC code, its message and its cause, not the status's debug dump
/// (it was `grpc request error: status: Unavailable, message: "tcp connect
/// error", details: [], metadata: MetadataMap { headers: {} }`).
fn readable_outage(msg: &str) {
    for noise in ["MetadataMap", "details: [", "metadata:", "status: "] {
        assert!(!msg.contains(noise), "{noise:?} in {msg:?}");
    }
    assert!(msg.contains("Unavailable"), "no gRPC code in {msg:?}");
    assert!(
        msg.to_lowercase().contains("connection refused"),
        "no cause in {msg:?}"
    );
}

/// The same outage met by a connected store: etcd stopped under it.
#[tokio::test]
async fn an_etcd_outage_is_named_plainly() {
    let mut cluster = EtcdCluster::start(1).expect("start etcd");
    let store = EtcdStore::connect(EtcdConfig {
        connect_timeout_ms: 500,
        request_timeout_ms: 1000,
        ..cluster.store_config()
    })
    .await
    .expect("connect etcd");
    store.get_policy().await.expect("etcd answers");
    cluster.stop_member(0);
    // The first request after the stop can meet the dying connection
    // (`Unknown: transport error: ... broken pipe`); the next ones find
    // nobody listening. Every message is plain.
    for _ in 0..10 {
        let e = store.get_policy().await.unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("get_policy"), "{msg}");
        for noise in ["MetadataMap", "details: [", "metadata:", "status: "] {
            assert!(!msg.contains(noise), "{noise:?} in {msg:?}");
        }
        if matches!(e, StoreError::Unreachable { .. }) {
            readable_outage(&msg);
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("etcd stopped, yet no request failed as unreachable");
}

#[tokio::test]
async fn bad_configs_are_named() {
    let e = EtcdStore::connect(EtcdConfig {
        endpoints: vec![],
        ..Default::default()
    })
    .await
    .unwrap_err();
    assert!(e.to_string().contains("endpoints"), "{e}");
    let e = EtcdStore::connect(EtcdConfig {
        endpoints: vec!["127.0.0.1:2379".into()],
        ..Default::default()
    })
    .await
    .unwrap_err();
    assert!(e.to_string().contains("127.0.0.1:2379"), "{e}");
    let e = SqliteStore::open(SqliteConfig::at("/nonexistent-dir-capybara/x.db"))
        .await
        .unwrap_err();
    assert!(e.to_string().contains("/nonexistent-dir-capybara"), "{e}");
    let cfg: Result<StoreConfig, _> =
        serde_json::from_str(r#"{"backend":"etcd","endpoint":["x"]}"#);
    assert!(cfg.unwrap_err().to_string().contains("endpoint"));
}

/// A retiring record in the one-per-name layout (SQLite table
/// `retiring_services`, as the build before per-address records wrote it)
/// is still listed and forgotten; a newer record of the same name and
/// address replaces it, one of another address keeps it. A per-address
/// row that holds another address, or an address out of range, is an
/// error naming its key.
#[tokio::test]
async fn sqlite_one_per_name_retiring_records_stay_readable() {
    let dir = tmp();
    let path = dir.path().join("s.db");
    let s = SqliteStore::open(SqliteConfig::at(&path)).await.unwrap();
    let old = |name: &str, port: u16, at: u64| {
        format!(
            r#"{{"v":1,"data":{{"service":{{"name":"{name}","vip":"198.18.100.2","port":{port},"pool":[1]}},"deleted_unix_ms":{at}}}}}"#
        )
    };
    let c = rusqlite::Connection::open(&path).unwrap();
    for (name, port, at) in [("web", 17, 5), ("api", 18, 6)] {
        c.execute(
            "INSERT INTO retiring_services (name, deleted_unix_ms, value) VALUES (?1, ?2, ?3)",
            rusqlite::params![name, at, old(name, port, at as u64).as_bytes()],
        )
        .unwrap();
    }
    let got = s.list_retiring_services().await.unwrap();
    let seen: Vec<(String, String, u64)> = got
        .iter()
        .map(|r| {
            (
                r.service.name.clone(),
                r.addr().to_string(),
                r.deleted_unix_ms,
            )
        })
        .collect();
    assert_eq!(
        seen,
        [
            ("api".into(), "198.18.100.2:18".into(), 6),
            ("web".into(), "198.18.100.2:17".into(), 5)
        ]
    );
    // web is created again at its old address and moved away: the newer
    // record replaces the older one. api at another address keeps its own.
    let web = Service {
        name: "web".into(),
        vip: Ipv4Addr::new(198, 18, 100, 2),
        port: 17,
        pool: vec![ServerId(1)],
    };
    s.put_service(&web).await.unwrap();
    s.put_service(&Service {
        port: 19,
        ..web.clone()
    })
    .await
    .unwrap();
    let api = Service {
        name: "api".into(),
        port: 20,
        ..web.clone()
    };
    s.put_service(&api).await.unwrap();
    assert!(s.delete_service("api").await.unwrap());
    let got = s.list_retiring_services().await.unwrap();
    let seen: Vec<(String, u16, bool)> = got
        .iter()
        .map(|r| {
            (
                r.service.name.clone(),
                r.service.port,
                r.deleted_unix_ms > 6,
            )
        })
        .collect();
    assert_eq!(
        seen,
        [
            ("api".into(), 18, false),
            ("api".into(), 20, true),
            ("web".into(), 17, true)
        ]
    );
    let legacy: i64 = c
        .query_row("SELECT COUNT(*) FROM retiring_services", [], |r| r.get(0))
        .unwrap();
    assert_eq!(legacy, 1, "web's old row replaced, api's kept");
    // The old row is forgotten exactly (name, address, time).
    let api18: std::net::SocketAddrV4 = "198.18.100.2:18".parse().unwrap();
    assert!(!s.forget_retiring_service("api", api18, 7).await.unwrap());
    assert!(!s
        .forget_retiring_service("api", "198.18.100.2:20".parse().unwrap(), 6)
        .await
        .unwrap());
    assert!(s.forget_retiring_service("api", api18, 6).await.unwrap());
    assert_eq!(s.list_retiring_services().await.unwrap().len(), 2);

    // Bad per-address rows name their key.
    c.execute(
        "INSERT INTO retiring_addresses VALUES ('echo', ?1, 21, 1, ?2)",
        rusqlite::params![
            i64::from(u32::from(Ipv4Addr::new(198, 18, 100, 2))),
            old("echo", 17, 1).as_bytes()
        ],
    )
    .unwrap();
    let e = s.list_retiring_services().await.unwrap_err();
    assert!(
        matches!(e, StoreError::MalformedValue { ref key, ref reason } if key == "retiring/echo/198.18.100.2:21" && reason.contains("198.18.100.2:17")),
        "{e}"
    );
    c.execute(
        "UPDATE retiring_addresses SET port = 70000 WHERE name = 'echo'",
        [],
    )
    .unwrap();
    let e = s.list_retiring_services().await.unwrap_err();
    assert!(
        matches!(e, StoreError::MalformedKey { ref key, .. } if key.starts_with("retiring/echo/")),
        "{e}"
    );
}

/// etcd: a record under the one-per-name key (`retiring/NAME`) is listed
/// and forgotten with the per-address ones; a per-address key whose record
/// holds another address, or whose address does not parse, is an error
/// naming the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_one_per_name_retiring_records_stay_readable() {
    let cluster = EtcdCluster::start(1).unwrap();
    let s = EtcdStore::connect(cluster.store_config()).await.unwrap();
    let rec = |name: &str, port: u16, at: u64| {
        format!(
            r#"{{"v":1,"data":{{"service":{{"name":"{name}","vip":"198.18.100.2","port":{port},"pool":[]}},"deleted_unix_ms":{at}}}}}"#
        )
        .into_bytes()
    };
    s.inject_raw("retiring/web", rec("web", 17, 5))
        .await
        .unwrap();
    let web = Service {
        name: "web".into(),
        vip: Ipv4Addr::new(198, 18, 100, 2),
        port: 18,
        pool: vec![],
    };
    s.put_service(&web).await.unwrap();
    assert!(s.delete_service("web").await.unwrap());
    let got = s.list_retiring_services().await.unwrap();
    let ports: Vec<(u16, u64)> = got
        .iter()
        .map(|r| (r.service.port, r.deleted_unix_ms.min(5)))
        .collect();
    assert_eq!(ports, [(17, 5), (18, 5)], "{got:?}");
    assert!(got[1].deleted_unix_ms > 5);
    // Created again at the old key's address and deleted: replaced.
    s.put_service(&Service {
        port: 17,
        ..web.clone()
    })
    .await
    .unwrap();
    assert!(s.delete_service("web").await.unwrap());
    let got = s.list_retiring_services().await.unwrap();
    assert_eq!(got.len(), 2, "{got:?}");
    assert!(got.iter().all(|r| r.deleted_unix_ms > 5), "{got:?}");
    for r in &got {
        assert!(s
            .forget_retiring_service("web", r.addr(), r.deleted_unix_ms)
            .await
            .unwrap());
    }
    // An old key forgotten by name, address and time.
    s.inject_raw("retiring/web", rec("web", 17, 5))
        .await
        .unwrap();
    let at: std::net::SocketAddrV4 = "198.18.100.2:17".parse().unwrap();
    assert!(!s
        .forget_retiring_service("web", "198.18.100.2:18".parse().unwrap(), 5)
        .await
        .unwrap());
    assert!(s.forget_retiring_service("web", at, 5).await.unwrap());
    assert!(s.list_retiring_services().await.unwrap().is_empty());

    s.inject_raw("retiring/web/198.18.100.2:21", rec("web", 17, 5))
        .await
        .unwrap();
    let e = s.list_retiring_services().await.unwrap_err();
    assert!(
        matches!(e, StoreError::MalformedValue { ref key, ref reason } if key == "retiring/web/198.18.100.2:21" && reason.contains("198.18.100.2:17")),
        "{e}"
    );
    s.inject_raw("retiring/web/198.18.100.2:21", rec("web", 21, 5))
        .await
        .unwrap();
    assert_eq!(s.list_retiring_services().await.unwrap().len(), 1);
    s.inject_raw("retiring/web/nowhere", rec("web", 21, 5))
        .await
        .unwrap();
    let e = s.list_retiring_services().await.unwrap_err();
    assert!(
        matches!(e, StoreError::MalformedKey { ref key, .. } if key == "retiring/web/nowhere"),
        "{e}"
    );
}

/// switchd and the API of one appliance open the same new file at once:
/// every opener succeeds (before, one could read the application id before
/// the other's schema migration committed and the tables after it, and
/// refused the file as a foreign database; seen in CI in readyz_lab).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn openers_racing_on_a_new_file_all_succeed() {
    let dir = tmp();
    for round in 0..40 {
        let path = dir.path().join(format!("store-{round}.db"));
        let opens: Vec<_> = (0..4)
            .map(|_| tokio::spawn(SqliteStore::open(SqliteConfig::at(&path))))
            .collect();
        for o in opens {
            if let Err(e) = o.await.unwrap() {
                panic!("round {round}: {e}");
            }
        }
    }
}
