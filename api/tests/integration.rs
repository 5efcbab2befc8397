//! The real server on 127.0.0.1 (free port) with a real SQLite store file:
//! auth and roles, validation, audit, drains that survive a restart of the
//! API, and the `capybara ctl` command line.

use std::net::Ipv4Addr;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use capybara_api::{ApiConfig, ApiDb, Role, RunningApi, StoreControlPlane};
use capybara_proto::flow::{FlowKey, ServerId};
use capybara_store::{FlowOp, SqliteConfig, SqliteStore, Store};
use serde_json::{json, Value};

struct Api {
    running: RunningApi,
    cp: Arc<StoreControlPlane>,
    store: Arc<dyn Store>,
    db: Arc<ApiDb>,
    url: String,
}

/// A fresh SQLite store and token database in `dir`.
async fn store_and_db(dir: &Path) -> (Arc<dyn Store>, Arc<ApiDb>) {
    let store: Arc<dyn Store> = Arc::new(
        SqliteStore::open(SqliteConfig {
            path: dir.join("store.db"),
            ..SqliteConfig::default()
        })
        .await
        .unwrap(),
    );
    let db = Arc::new(ApiDb::open(&dir.join("api.db")).unwrap());
    (store, db)
}

async fn start(dir: &Path) -> Api {
    start_with_switch_addrs(dir, Vec::new()).await
}

async fn start_with_switch_addrs(dir: &Path, switch_addrs: Vec<(Ipv4Addr, String)>) -> Api {
    let (store, db) = store_and_db(dir).await;
    let cp = StoreControlPlane::new(store.clone(), db.clone())
        .await
        .unwrap();
    let running = capybara_api::start(ApiConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        store: store.clone(),
        control_plane: Arc::new(cp.clone()),
        db: db.clone(),
        static_dir: None,
        workers: 1,
        switch_addrs: capybara_api::server::fixed_switch_addrs(switch_addrs),
    })
    .await
    .unwrap();
    let url = format!("http://{}", running.addr);
    Api {
        running,
        cp,
        store,
        db,
        url,
    }
}

impl Api {
    async fn stop(self) {
        self.cp.shutdown();
        self.running.stop().await;
    }
    fn token(&self, name: &str, role: Role) -> String {
        self.db.create(name, role, "test").unwrap().1
    }
}

async fn call(
    method: &str,
    url: String,
    token: Option<&str>,
    body: Option<Value>,
) -> (u16, Value, String) {
    let c = reqwest::Client::new();
    let mut r = c.request(method.parse().unwrap(), url);
    if let Some(t) = token {
        r = r.bearer_auth(t);
    }
    if let Some(b) = body {
        r = r.json(&b);
    }
    let resp = r.timeout(Duration::from_secs(10)).send().await.unwrap();
    let status = resp.status().as_u16();
    let ct = resp
        .headers()
        .get("content-type")
        .map(|v| v.to_str().unwrap().to_string())
        .unwrap_or_default();
    let text = resp.text().await.unwrap();
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::Null),
        ct,
    )
}

fn flow(port: u16) -> FlowKey {
    FlowKey {
        client_ip: Ipv4Addr::new(192, 0, 2, 1),
        client_port: port,
        service_ip: Ipv4Addr::new(10, 0, 0, 100),
        service_port: 80,
    }
}

/// The data address `register` gives server `name`: one per name (two
/// servers cannot share one).
fn data_addr_of(name: &str) -> String {
    let sum: u32 = name.bytes().map(u32::from).sum();
    format!("10.0.{}.{}", 2 + sum / 250, 1 + sum % 250)
}

async fn register(api: &Api, token: &str, name: &str) -> u64 {
    let body =
        json!({ "name": name, "mgmt_addr": "10.0.1.11:7000", "data_addr": data_addr_of(name) });
    let (s, v, _) = call(
        "POST",
        format!("{}/v1/servers", api.url),
        Some(token),
        Some(body),
    )
    .await;
    assert_eq!(s, 201, "{v}");
    v["id"].as_u64().unwrap()
}

/// Marks server `id` as its hostagent's REGISTER would (switchd writes the
/// record with the data MAC): no longer `never_seen`.
async fn hostagent_registers(api: &Api, id: u64) {
    let mut rec = api
        .store
        .get_server(ServerId(id as u32))
        .await
        .unwrap()
        .unwrap();
    rec.data_mac = Some(format!("02:00:00:00:00:{:02x}", id & 0xff));
    api.store.put_registered_server(&rec).await.unwrap();
}

async fn wait_drain(api: &Api, token: &str, id: u64, state: &str) -> Value {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let (_, d, _) = call(
            "GET",
            format!("{}/v1/servers/{id}/drain", api.url),
            Some(token),
            None,
        )
        .await;
        if d["state"] == state {
            return d;
        }
        assert!(
            Instant::now() < deadline,
            "drain never reached {state}: {d}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn roles_validation_and_audit() {
    let dir = tempfile::tempdir().unwrap();
    let api = start(dir.path()).await;
    let admin = api.token("root", Role::Admin);
    let viewer = api.token("watcher", Role::Viewer);
    let operator = api.token("bob", Role::Operator);

    let (s, v, ct) = call("GET", format!("{}/v1/servers", api.url), None, None).await;
    assert_eq!((s, ct.as_str()), (401, "application/problem+json"), "{v}");
    let (s, _, _) = call(
        "GET",
        format!("{}/v1/servers", api.url),
        Some("capy_nope"),
        None,
    )
    .await;
    assert_eq!(s, 401);
    let (s, _, _) = call(
        "GET",
        format!("{}/v1/servers", api.url),
        Some(&viewer),
        None,
    )
    .await;
    assert_eq!(s, 200);
    let body = json!({ "name": "web1", "mgmt_addr": "10.0.1.11:7000", "data_addr": "10.0.2.11" });
    let (s, v, _) = call(
        "POST",
        format!("{}/v1/servers", api.url),
        Some(&viewer),
        Some(body.clone()),
    )
    .await;
    assert_eq!(s, 403, "{v}");
    let (s, _, _) = call(
        "POST",
        format!("{}/v1/servers", api.url),
        Some(&operator),
        Some(body),
    )
    .await;
    assert_eq!(s, 201);
    let (s, _, _) = call(
        "POST",
        format!("{}/v1/tokens", api.url),
        Some(&operator),
        Some(json!({"name": "x", "role": "viewer"})),
    )
    .await;
    assert_eq!(s, 403);
    let svc = json!({ "name": "web", "vip": "10.0.0.100", "port": 80, "pool": [1] });
    let (s, _, _) = call(
        "POST",
        format!("{}/v1/services", api.url),
        Some(&operator),
        Some(svc.clone()),
    )
    .await;
    assert_eq!(s, 403);
    let (s, _, _) = call(
        "POST",
        format!("{}/v1/services", api.url),
        Some(&admin),
        Some(svc),
    )
    .await;
    assert_eq!(s, 201);

    // Validation names the field; bad input is never a 5xx.
    let (s, v, ct) = call(
        "PATCH",
        format!("{}/v1/policy", api.url),
        Some(&operator),
        Some(json!({"heartbeat_interval_ms": 0})),
    )
    .await;
    assert_eq!((s, ct.as_str()), (422, "application/problem+json"));
    assert_eq!(v["field"], "heartbeat_interval_ms");
    // A bound holds to the last bit: the next double above the maximum is
    // rejected, not rounded down while parsing (found by schemathesis).
    let (s, v, _) = call(
        "PATCH",
        format!("{}/v1/policy", api.url),
        Some(&operator),
        Some(json!({"proactive_threshold_pct": 1000.0000000000001_f64})),
    )
    .await;
    assert_eq!(
        (s, v["field"].as_str()),
        (422, Some("proactive_threshold_pct")),
        "{v}"
    );
    let (s, v, _) = call(
        "POST",
        format!("{}/v1/servers/1/drain", api.url),
        Some(&operator),
        Some(json!({"targets": [1]})),
    )
    .await;
    assert_eq!((s, v["field"].as_str()), (422, Some("targets[0]")), "{v}");

    // Every mutation is in the audit log with the token name.
    let (_, v, _) = call(
        "GET",
        format!("{}/v1/audit?limit=100", api.url),
        Some(&viewer),
        None,
    )
    .await;
    let items = v["items"].as_array().unwrap();
    let summary: Vec<(String, String)> = items
        .iter()
        .map(|e| {
            (
                e["action"].as_str().unwrap().to_string(),
                e["actor"]
                    .as_str()
                    .unwrap()
                    .split(' ')
                    .next()
                    .unwrap()
                    .to_string(),
            )
        })
        .collect();
    assert_eq!(
        summary,
        vec![
            ("server.register".into(), "bob".into()),
            ("service.create".into(), "root".into())
        ]
    );
    assert!(items
        .iter()
        .all(|e| e["at_unix_ms"].as_u64().unwrap() > 1_600_000_000_000));
    api.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_survives_api_restart_and_completes() {
    let dir = tempfile::tempdir().unwrap();
    let api = start(dir.path()).await;
    let token = api.token("ops", Role::Operator);
    let id = register(&api, &token, "web1").await;
    register(&api, &token, "web2").await;
    let ops: Vec<FlowOp> = (1..=3)
        .map(|p| FlowOp::Put {
            key: flow(p),
            server: ServerId(id as u32),
        })
        .collect();
    api.store.apply_flows(&ops).await.unwrap();

    let (s, d, _) = call(
        "POST",
        format!("{}/v1/servers/{id}/drain", api.url),
        Some(&token),
        Some(json!({"deadline_seconds": 60})),
    )
    .await;
    assert_eq!(s, 202, "{d}");
    assert_eq!(
        (d["state"].as_str(), d["progress"]["flows_total"].as_u64()),
        (Some("running"), Some(3))
    );
    let (_, srv, _) = call(
        "GET",
        format!("{}/v1/servers/{id}", api.url),
        Some(&token),
        None,
    )
    .await;
    assert_eq!(srv["state"], "draining");
    assert_eq!(srv["stats"]["connections"], 3);
    let (s, _, _) = call(
        "POST",
        format!("{}/v1/servers/{id}/drain", api.url),
        Some(&token),
        Some(json!({})),
    )
    .await;
    assert_eq!(s, 409, "a second drain conflicts");
    api.stop().await;

    // A new API process over the same files resumes the drain.
    let api = start(dir.path()).await;
    let d = wait_drain(&api, &token, id, "running").await;
    assert_eq!(d["progress"]["flows_remaining"], 3);
    api.store
        .apply_flows(&[
            FlowOp::Delete { key: flow(1) },
            FlowOp::Delete { key: flow(2) },
        ])
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (_, d, _) = call(
            "GET",
            format!("{}/v1/servers/{id}/drain", api.url),
            Some(&token),
            None,
        )
        .await;
        if d["progress"]["flows_remaining"] == 1 {
            assert_eq!(d["progress"]["flows_closed"], 2);
            break;
        }
        assert!(Instant::now() < deadline, "progress not updated: {d}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The last flow moves to another server (what a migration does to the
    // store): counted as migrated, not closed.
    api.store
        .apply_flows(&[FlowOp::Put {
            key: flow(3),
            server: ServerId(id as u32 + 100),
        }])
        .await
        .unwrap();
    let d = wait_drain(&api, &token, id, "completed").await;
    assert_eq!(d["progress"]["flows_migrated"], 1, "{d}");
    assert_eq!(d["progress"]["flows_closed"], 2, "{d}");
    let (_, srv, _) = call(
        "GET",
        format!("{}/v1/servers/{id}", api.url),
        Some(&token),
        None,
    )
    .await;
    assert_eq!(srv["state"], "drained");
    api.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_deadline_reports_remaining_or_breaks_in_force_mode() {
    let dir = tempfile::tempdir().unwrap();
    let api = start(dir.path()).await;
    let token = api.token("ops", Role::Operator);
    let a = register(&api, &token, "a").await;
    let b = register(&api, &token, "b").await;
    api.store
        .apply_flows(&[
            FlowOp::Put {
                key: flow(10),
                server: ServerId(a as u32),
            },
            FlowOp::Put {
                key: flow(11),
                server: ServerId(a as u32),
            },
            FlowOp::Put {
                key: flow(20),
                server: ServerId(b as u32),
            },
        ])
        .await
        .unwrap();
    // migrate mode: nothing can move (no data plane), so the deadline
    // passes and the drain names exactly what is left, breaking nothing.
    let (s, _, _) = call(
        "POST",
        format!("{}/v1/servers/{a}/drain", api.url),
        Some(&token),
        Some(json!({"deadline_seconds": 1})),
    )
    .await;
    assert_eq!(s, 202);
    let d = wait_drain(&api, &token, a, "timed_out").await;
    assert_eq!(
        d["remaining"],
        json!(["192.0.2.1:10-10.0.0.100:80", "192.0.2.1:11-10.0.0.100:80"])
    );
    assert_eq!(
        api.store
            .list_flows_by_server(ServerId(a as u32))
            .await
            .unwrap()
            .len(),
        2
    );
    let (_, srv, _) = call(
        "GET",
        format!("{}/v1/servers/{a}", api.url),
        Some(&token),
        None,
    )
    .await;
    assert_eq!(srv["state"], "draining", "still takes no new connections");

    // force mode breaks what is left at the deadline and completes.
    let (s, _, _) = call(
        "POST",
        format!("{}/v1/servers/{b}/drain", api.url),
        Some(&token),
        Some(json!({"deadline_seconds": 1, "mode": "force"})),
    )
    .await;
    assert_eq!(s, 202);
    let d = wait_drain(&api, &token, b, "completed").await;
    assert_eq!(d["progress"]["flows_closed"], 1);
    assert!(api
        .store
        .list_flows_by_server(ServerId(b as u32))
        .await
        .unwrap()
        .is_empty());

    // undrain returns a timed-out server to active.
    let (s, srv, _) = call(
        "POST",
        format!("{}/v1/servers/{a}/undrain", api.url),
        Some(&token),
        None,
    )
    .await;
    assert_eq!((s, srv["state"].as_str()), (200, Some("active")));
    let (s, v, _) = call(
        "POST",
        format!(
            "{}/v1/connections/192.0.2.1:10-10.0.0.100:80/migrate",
            api.url
        ),
        Some(&token),
        None,
    )
    .await;
    assert_eq!(s, 503, "store-backed control plane cannot migrate: {v}");
    api.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_seventeenth_service_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let api = start(dir.path()).await;
    let admin = api.token("root", Role::Admin);
    // The data plane has 16 service slots: a 17th service is refused up
    // front (409 naming the limit) rather than stored and never served.
    for i in 1..=17u32 {
        let svc = json!({ "name": format!("s{i}"), "vip": format!("10.0.1.{i}"), "port": 80, "pool": [] });
        let (s, v, _) = call(
            "POST",
            format!("{}/v1/services", api.url),
            Some(&admin),
            Some(svc),
        )
        .await;
        if i <= 16 {
            assert_eq!(s, 201, "service {i}: {v}");
        } else {
            assert_eq!(s, 409, "{v}");
            assert!(
                v["detail"]
                    .as_str()
                    .unwrap_or("")
                    .contains("at most 16 services"),
                "{v}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn service_addresses_no_client_reaches_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let api = start(dir.path()).await;
    let admin = api.token("root", Role::Admin);
    let svc = |vip: &str| json!({ "name": "web", "vip": vip, "port": 80, "pool": [] });
    // As switchd's config refuses them: 422 naming `vip`, nothing stored.
    for vip in ["0.0.0.0", "255.255.255.255", "224.0.0.1"] {
        let (s, v, _) = call(
            "POST",
            format!("{}/v1/services", api.url),
            Some(&admin),
            Some(svc(vip)),
        )
        .await;
        assert_eq!(s, 422, "{vip}: {v}");
        assert_eq!(v["field"], "vip", "{v}");
        assert_eq!(
            v["detail"],
            format!("`vip`: must be a unicast address, got {vip}"),
            "{v}"
        );
    }
    let url = format!("{}/v1/services", api.url);
    let (s, v, _) = call("GET", url.clone(), Some(&admin), None).await;
    assert!(s == 200 && v["items"].as_array().unwrap().is_empty(), "{v}");
    let (s, v, _) = call("POST", url, Some(&admin), Some(svc("198.18.100.1"))).await;
    assert_eq!(s, 201, "{v}");
    let (s, v, _) = call(
        "PUT",
        format!("{}/v1/services/web", api.url),
        Some(&admin),
        Some(json!({ "vip": "0.0.0.0", "port": 80, "pool": [] })),
    )
    .await;
    assert!(s == 422 && v["field"] == "vip", "{v}");
    // A server's data address likewise (switchd forwards its connections
    // there): 422 naming `data_addr`, nothing stored.
    for addr in ["0.0.0.0", "255.255.255.255", "239.1.2.3"] {
        let (s, v, _) = call(
            "POST",
            format!("{}/v1/servers", api.url),
            Some(&admin),
            Some(json!({ "name": "web9", "mgmt_addr": "10.0.1.9:7000", "data_addr": addr })),
        )
        .await;
        assert_eq!(s, 422, "{addr}: {v}");
        assert_eq!(
            (&v["field"], &v["detail"]),
            (
                &json!("data_addr"),
                &json!(format!(
                    "`data_addr`: must be a unicast address, got {addr}"
                ))
            ),
            "{v}"
        );
    }
    let (s, v, _) = call("GET", format!("{}/v1/servers", api.url), Some(&admin), None).await;
    assert!(s == 200 && v["items"].as_array().unwrap().is_empty(), "{v}");
    // Loopback: no client reaches it through the switch.
    let url = format!("{}/v1/services", api.url);
    let (s, v, _) = call("POST", url.clone(), Some(&admin), Some(svc("127.0.0.1"))).await;
    assert!(s == 422 && v["field"] == "vip", "{v}");
    assert!(v["detail"].as_str().unwrap().contains("loopback"), "{v}");
    // A server's data address: the service would take that server's
    // traffic.
    let id = register(&api, &admin, "web1").await;
    let web1 = data_addr_of("web1");
    let (s, v, _) = call("POST", url, Some(&admin), Some(svc(&web1))).await;
    assert!(s == 422 && v["field"] == "vip", "{v}");
    assert!(
        v["detail"].as_str().unwrap().contains(&format!(
            "{web1} is the data address of server {id} (\"web1\")"
        )),
        "{v}"
    );
}

fn ctl(url: &str, token: &str, args: &[&str]) -> (i32, String, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_capybara-ctl"))
        .args(["--api", url, "--token", token])
        .args(args)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

/// `GET /v1/audit?order=desc` lists the newest entries first (what changed
/// just now; the default lists the oldest from `after`), `next_after` the
/// newest listed; a bad `order` is a 400 naming it. `capybara ctl audit
/// --limit N` prints the newest N, the newest last.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn audit_lists_the_newest_first_on_request() {
    let dir = tempfile::tempdir().unwrap();
    let api = start(dir.path()).await;
    let admin = api.token("root", Role::Admin);
    for name in ["web1", "web2", "web3"] {
        register(&api, &admin, name).await;
    }
    let get = |q: &'static str| {
        call(
            "GET",
            format!("{}/v1/audit{q}", api.url),
            Some(&admin),
            None,
        )
    };
    let (s, all, _) = get("?limit=100").await;
    assert_eq!(s, 200, "{all}");
    let all = all["items"].as_array().unwrap().clone();
    assert_eq!(all.len(), 3, "{all:?}");
    let (s, v, _) = get("?limit=2").await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["items"], json!(all[..2]), "{v}");
    let (s, v, _) = get("?limit=2&order=desc").await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["items"], json!([all[2], all[1]]), "{v}");
    assert_eq!(v["next_after"], all[2]["seq"], "{v}");
    let after = all[1]["seq"].as_i64().unwrap();
    let (_, v, _) = call(
        "GET",
        format!("{}/v1/audit?after={after}&order=desc", api.url),
        Some(&admin),
        None,
    )
    .await;
    assert_eq!(v["items"], json!([all[2]]), "{v}");
    let (s, v, _) = get("?order=sideways").await;
    assert_eq!((s, v["field"].as_str()), (400, Some("order")), "{v}");

    let (url, t) = (api.url.clone(), admin.clone());
    let (code, out, err) =
        tokio::task::spawn_blocking(move || ctl(&url, &t, &["audit", "--limit", "2"]))
            .await
            .unwrap();
    assert_eq!(code, 0, "{err}");
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 3, "{out}");
    assert!(
        lines[0].contains("SEQ") && lines[0].contains("ACTION"),
        "{out}"
    );
    for (line, e) in lines[1..].iter().zip([&all[1], &all[2]]) {
        let seq = e["seq"].to_string();
        assert!(line.trim_start().starts_with(&seq), "{out}");
        assert!(line.contains(e["action"].as_str().unwrap()), "{out}");
        assert!(line.contains(e["target"].as_str().unwrap()), "{out}");
    }
    let (url, t) = (api.url.clone(), admin.clone());
    let (code, _, err) =
        tokio::task::spawn_blocking(move || ctl(&url, &t, &["audit", "--limit", "0"]))
            .await
            .unwrap();
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--limit must be 1 to 10000"), "{err}");

    // More entries than the API reads from the store at once (1000): still
    // the newest.
    for i in 0..1100 {
        let rec = capybara_store::AuditRecord {
            actor: "test".into(),
            action: "test.fill".into(),
            target: format!("n{i}"),
            detail: json!({}),
        };
        api.store.append_audit(&rec).await.unwrap();
    }
    let (s, v, _) = get("?limit=2&order=desc").await;
    assert_eq!(s, 200, "{v}");
    let targets: Vec<&str> = v["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["target"].as_str().unwrap())
        .collect();
    assert_eq!(targets, ["n1099", "n1098"], "{v}");
    assert_eq!(
        v["next_after"],
        json!(all[2]["seq"].as_i64().unwrap() + 1100),
        "{v}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ctl_manages_services() {
    let dir = tempfile::tempdir().unwrap();
    let api = start(dir.path()).await;
    let admin = api.token("root", Role::Admin);
    register(&api, &admin, "web1").await;
    register(&api, &admin, "web2").await;
    let (url, t) = (api.url.clone(), admin.clone());
    let run = move |args: Vec<&'static str>| {
        let (url, t) = (url.clone(), t.clone());
        tokio::task::spawn_blocking(move || ctl(&url, &t, &args))
    };
    let (code, out, err) = run(vec!["service", "add", "api", "198.18.100.2:8080"])
        .await
        .unwrap();
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("198.18.100.2:8080, pool open"), "{out}");
    let (code, out, err) = run(vec![
        "service",
        "set",
        "api",
        "198.18.100.2:8081",
        "--pool",
        "s2,1",
    ])
    .await
    .unwrap();
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("198.18.100.2:8081, pool 2,1"), "{out}");
    // `set` without --pool keeps the pool.
    let (code, out, err) = run(vec!["service", "set", "api", "198.18.100.3:80"])
        .await
        .unwrap();
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("198.18.100.3:80, pool 2,1"), "{out}");
    let (code, out, _) = run(vec!["services"]).await.unwrap();
    assert!(
        code == 0 && out.contains("198.18.100.3:80") && out.contains("2,1"),
        "{out}"
    );
    // Mistakes: a clear usage error (2) or the API's refusal (1).
    let (code, _, err) = run(vec!["service", "add", "x", "198.18.100.4"])
        .await
        .unwrap();
    assert!(code == 2 && err.contains("VIP:PORT"), "{err}");
    let (code, _, err) = run(vec![
        "service",
        "add",
        "x",
        "198.18.100.4:80",
        "--pool",
        "9",
    ])
    .await
    .unwrap();
    assert!(
        code == 1 && (err.contains("pool[0]") || err.contains("not registered")),
        "{code} {err}"
    );
    let (code, _, err) = run(vec!["service", "add", "dup", "198.18.100.3:80"])
        .await
        .unwrap();
    assert!(code == 1 && err.contains("409"), "{code} {err}");
    let (code, _, err) = run(vec!["service", "remove", "api"]).await.unwrap();
    assert_eq!(code, 2, "{err}");
    let (code, out, err) = run(vec!["service", "delete", "api"]).await.unwrap();
    assert!(code == 0 && out.contains("deleted"), "{out} {err}");
    let (code, out, _) = run(vec!["services"]).await.unwrap();
    assert!(code == 0 && !out.contains("api "), "{out}");
    let (code, _, err) = run(vec!["service", "delete", "api"]).await.unwrap();
    assert!(code == 1 && err.contains("404"), "{code} {err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ctl_commands() {
    let dir = tempfile::tempdir().unwrap();
    let api = start(dir.path()).await;
    let token = api.token("ops", Role::Operator);
    register(&api, &token, "web1").await;
    let (url, t) = (api.url.clone(), token.clone());
    let run = move |args: Vec<&'static str>| {
        let (url, t) = (url.clone(), t.clone());
        tokio::task::spawn_blocking(move || ctl(&url, &t, &args))
    };
    let (code, out, _) = run(vec!["servers"]).await.unwrap();
    assert_eq!(code, 0);
    assert!(out.contains("web1") && out.contains("active"), "{out}");
    let (code, out, err) = run(vec!["drain", "1", "--deadline", "5s", "--wait"])
        .await
        .unwrap();
    assert_eq!(code, 0, "{err}");
    assert!(out.trim_end().ends_with("completed"), "{out}");
    assert!(
        err.contains("0/0") || err.contains("remaining"),
        "progress on stderr: {err}"
    );
    let (code, out, _) = run(vec!["servers"]).await.unwrap();
    assert!(code == 0 && out.contains("drained"), "{out}");
    let (code, out, _) = run(vec!["undrain", "s1"]).await.unwrap();
    assert!(code == 0 && out.contains("active"), "{out}");
    let (code, out, err) = run(vec![
        "policy",
        "set",
        "proactive_threshold_pct=20",
        "target_selection=least_loaded",
    ])
    .await
    .unwrap();
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("proactive_threshold_pct=20") && out.contains("target_selection=least_loaded"),
        "{out}"
    );
    let (code, _, err) = run(vec!["policy", "set", "hysteresis_pct=500"])
        .await
        .unwrap();
    assert_eq!(code, 1);
    assert!(
        err.contains("hysteresis_pct") && err.contains("422"),
        "{err}"
    );
    let (code, _, err) = run(vec!["policy", "set", "bogus=1"]).await.unwrap();
    assert_eq!(code, 2, "{err}");
    let (code, out, _) = run(vec!["policy", "get"]).await.unwrap();
    assert!(code == 0 && out.contains("placement=maglev"), "{out}");
    let (code, out, _) = run(vec!["services"]).await.unwrap();
    assert!(code == 0 && out.contains("VIP:PORT"), "{out}");
    let (code, out, _) = run(vec!["migrations", "--follow", "--for", "1s"])
        .await
        .unwrap();
    assert!(code == 0 && out.contains("OUTCOME"), "{out}");
    let (code, _, err) = run(vec![
        "migrate",
        "192.0.2.1:9-10.0.0.100:80",
        "--target",
        "1",
    ])
    .await
    .unwrap();
    assert_eq!(code, 1);
    assert!(err.contains("404"), "{err}");
    let (code, _, _) = run(vec!["frobnicate"]).await.unwrap();
    assert_eq!(code, 2);
    api.stop().await;
}

/// switchd writes `draining` into the store itself, asynchronously, once the
/// API's drain request reaches it; a server with no connection has completed
/// its drain by then. The server must end `drained`, not stay `draining`
/// (seen in `make demo`: drain of an already drained server).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_completed_before_switchd_records_draining_ends_drained() {
    let dir = tempfile::tempdir().unwrap();
    let api = start(dir.path()).await;
    let token = api.token("ops", Role::Operator);
    let a = register(&api, &token, "a").await;
    let (s, v, _) = call(
        "POST",
        format!("{}/v1/servers/{a}/drain", api.url),
        Some(&token),
        Some(json!({"deadline_seconds": 5})),
    )
    .await;
    assert_eq!(s, 202, "{v}");
    wait_drain(&api, &token, a, "completed").await;
    // What switchd's late store write does.
    api.store
        .set_server_state(ServerId(a as u32), capybara_store::ServerState::Draining)
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let (_, srv, _) = call(
            "GET",
            format!("{}/v1/servers/{a}", api.url),
            Some(&token),
            None,
        )
        .await;
        if srv["state"] == "drained" {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "server stayed {} after its drain completed",
            srv["state"]
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // A second drain while one runs is refused with a readable deadline.
    api.store
        .apply_flows(&[FlowOp::Put {
            key: flow(30),
            server: ServerId(a as u32),
        }])
        .await
        .unwrap();
    let url = format!("{}/v1/servers/{a}/drain", api.url);
    let (s, _, _) = call("POST", url.clone(), Some(&token), Some(json!({}))).await;
    assert_eq!(s, 202);
    let (s, v, _) = call(
        "POST",
        url,
        Some(&token),
        Some(json!({"deadline_seconds": 10})),
    )
    .await;
    assert_eq!(s, 409, "{v}");
    let detail = v["detail"].as_str().unwrap();
    assert!(
        detail.contains("already draining (deadline in ") && !detail.contains("since epoch"),
        "{detail}"
    );
    api.stop().await;
}

/// The mistakes operators make with `capybara ctl` get a usage error (exit
/// 2) naming the mistake, before anything is sent; `weight` and
/// `connections` cover what the dashboard shows and `migrate` needs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ctl_refuses_mistakes_and_lists_connections() {
    let dir = tempfile::tempdir().unwrap();
    let api = start(dir.path()).await;
    let token = api.token("ops", Role::Operator);
    let a = register(&api, &token, "web1").await;
    api.store
        .apply_flows(&[FlowOp::Put {
            key: flow(40),
            server: ServerId(a as u32),
        }])
        .await
        .unwrap();
    let (url, t) = (api.url.clone(), token.clone());
    let run = move |args: Vec<&'static str>| {
        let (url, t) = (url.clone(), t.clone());
        tokio::task::spawn_blocking(move || ctl(&url, &t, &args))
    };
    for (args, want) in [
        // A mistyped --force must not start a migrate drain.
        (
            vec!["drain", "1", "--forse"],
            "unknown flag --forse for `drain`",
        ),
        (
            vec!["drain", "1", "--force=false"],
            "--force takes no value",
        ),
        (
            vec!["servers", "--wait"],
            "unknown flag --wait for `servers`",
        ),
        (
            vec!["drain", "1", "--deadline", "500ms"],
            "whole seconds from 1s to 24h",
        ),
        (
            vec!["drain", "1", "--deadline", "99999999999s"],
            "whole seconds",
        ),
        (vec!["drain"], "`drain` takes one SERVER"),
        (vec!["weight", "1"], "`weight` takes SERVER and WEIGHT"),
        (vec!["weight", "1", "70000"], "WEIGHT must be 0 to 65535"),
        (vec!["policy"], "`policy get`"),
        (
            vec!["policy", "set", "proactive_threshold_pct=abc"],
            "proactive_threshold_pct",
        ),
        (
            vec!["connections", "--limit", "0"],
            "--limit must be 1 to 10000",
        ),
        (
            vec![
                "policy",
                "set",
                "proactive_threshold_pct=20",
                "proactive_threshold_pct=30",
            ],
            "proactive_threshold_pct is given twice",
        ),
        (
            vec!["migrations", "--for", "5s"],
            "--for goes with --follow",
        ),
    ] {
        let (code, _, err) = run(args.clone()).await.unwrap();
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(err.contains(want), "{args:?}: {err}");
    }
    // Nothing was started by the refused drains.
    let (_, srv, _) = call(
        "GET",
        format!("{}/v1/servers/{a}", api.url),
        Some(&token),
        None,
    )
    .await;
    assert_eq!(srv["state"], "active", "{srv}");
    let (code, out, _) = run(vec!["-h"]).await.unwrap();
    assert!(code == 0 && out.contains("connections"), "{out}");
    let (code, out, err) = run(vec!["weight", "1", "7"]).await.unwrap();
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("weight 7"), "{out}");
    let (code, out, err) = run(vec!["connections", "--server", "1"]).await.unwrap();
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("192.0.2.1:40-10.0.0.100:80"), "{out}");
    // OPERATIONS.md: exit status 3 when a waited-for drain does not
    // complete; what remains is named (no data plane here: nothing moves).
    let (code, out, err) = run(vec!["drain", "1", "--deadline", "1s", "--wait"])
        .await
        .unwrap();
    assert_eq!(code, 3, "{out} {err}");
    assert!(out.trim_end().ends_with("timed_out"), "{out}");
    assert!(
        err.contains("1 connection remains: 192.0.2.1:40-10.0.0.100:80"),
        "{err}"
    );
    // A wrong token says which setting to check.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_capybara-ctl"))
        .args(["--api", &api.url, "--token", "capy_00", "servers"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        err.contains("401") && err.contains("CAPYBARA_TOKEN"),
        "{err}"
    );
    // An --api without a scheme, and an API that is not running.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_capybara-ctl"))
        .args(["--api", api.url.trim_start_matches("http://"), "servers"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("must be a URL such as"));
    // https:// (this ctl has no TLS: it said "cannot reach the API ...
    // scheme is not http") and a URL ending in /v1 (every request then
    // went to /v1/v1/...: "no such route") are usage errors saying so.
    for (api_url, says) in [
        (
            api.url.replace("http://", "https://"),
            "speaks plain HTTP only",
        ),
        (format!("{}/v1", api.url), "without /v1"),
        (format!("{}/v1/", api.url), "without /v1"),
    ] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_capybara-ctl"))
            .args(["--api", &api_url, "--token", &token, "servers"])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{api_url}: {err}");
        assert!(err.contains(says), "{api_url}: {err}");
    }
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dead_url = format!("http://{}", dead.local_addr().unwrap());
    drop(dead);
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_capybara-ctl"))
        .args(["--api", &dead_url, "--token", &token, "servers"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        err.contains("cannot reach the API") && err.to_lowercase().contains("connection refused"),
        "{err}"
    );
    api.stop().await;
}

/// The API configured with a switchd that does not answer (restarting, or a
/// wrong URL): registering a server answers 201 (it did register; a 503 made
/// a retry fail with 409) and servers are listed from the store
/// (`data_source: store`) instead of every server read failing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn servers_are_listed_from_the_store_while_switchd_is_unreachable() {
    let dir = tempfile::tempdir().unwrap();
    let store: Arc<dyn Store> = Arc::new(
        SqliteStore::open(SqliteConfig {
            path: dir.path().join("store.db"),
            ..SqliteConfig::default()
        })
        .await
        .unwrap(),
    );
    let db = Arc::new(ApiDb::open(&dir.path().join("api.db")).unwrap());
    let inner = StoreControlPlane::new(store.clone(), db.clone())
        .await
        .unwrap();
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dead_url = format!("http://{}", dead.local_addr().unwrap());
    drop(dead);
    let cp =
        capybara_api::switchd::SwitchdControlPlane::new(inner.clone(), store.clone(), &dead_url)
            .unwrap();
    let running = capybara_api::start(ApiConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        store: store.clone(),
        control_plane: Arc::new(cp),
        db: db.clone(),
        static_dir: None,
        workers: 1,
        switch_addrs: capybara_api::server::fixed_switch_addrs(Vec::new()),
    })
    .await
    .unwrap();
    let url = format!("http://{}", running.addr);
    let token = db.create("ops", Role::Operator, "test").unwrap().1;
    let body = json!({ "name": "w1", "mgmt_addr": "10.0.1.11:7000", "data_addr": "10.0.2.11" });
    let (s, v, _) = call(
        "POST",
        format!("{url}/v1/servers"),
        Some(&token),
        Some(body),
    )
    .await;
    assert_eq!(s, 201, "{v}");
    assert_eq!(v["stats"]["data_source"], "store", "{v}");
    let (s, v, _) = call("GET", format!("{url}/v1/servers"), Some(&token), None).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["items"][0]["name"], "w1", "{v}");
    assert_eq!(v["items"][0]["stats"]["data_source"], "store", "{v}");
    // What needs the switch still says it is unreachable.
    let (s, v, _) = call(
        "POST",
        format!("{url}/v1/servers/1/drain"),
        Some(&token),
        Some(json!({})),
    )
    .await;
    assert_eq!(s, 503, "{v}");
    assert!(v["detail"].as_str().unwrap().contains("unreachable"), "{v}");
    inner.shutdown();
    running.stop().await;
}

/// The API on a fresh store whose control plane is switchd at `switchd_url`.
async fn start_with_switchd(
    dir: &Path,
    switchd_url: &str,
) -> (RunningApi, Arc<StoreControlPlane>, String) {
    let (running, inner, url, _) = start_with_switchd_db(dir, switchd_url).await;
    (running, inner, url)
}

/// `start_with_switchd`, and its token database.
async fn start_with_switchd_db(
    dir: &Path,
    switchd_url: &str,
) -> (RunningApi, Arc<StoreControlPlane>, String, Arc<ApiDb>) {
    let (store, db) = store_and_db(dir).await;
    let inner = StoreControlPlane::new(store.clone(), db.clone())
        .await
        .unwrap();
    let cp =
        capybara_api::switchd::SwitchdControlPlane::new(inner.clone(), store.clone(), switchd_url)
            .unwrap();
    let running = capybara_api::start(ApiConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        store,
        control_plane: Arc::new(cp),
        db: db.clone(),
        static_dir: None,
        workers: 1,
        switch_addrs: capybara_api::server::fixed_switch_addrs(Vec::new()),
    })
    .await
    .unwrap();
    let url = format!("http://{}", running.addr);
    (running, inner, url, db)
}

/// How a stand-in for switchd's HTTP endpoint behaves.
#[derive(Clone, Copy)]
enum Endpoint {
    /// Answers `GET /status` and `GET /migrations` as switchd's
    /// `metrics_listen` does (HTTP/1.1, `Connection: close`).
    Switchd,
    /// Accepts connections and never answers (a stuck switchd).
    Silent,
    /// Answers 200 with a page that is not a switchd status (a wrong URL).
    NotSwitchd,
    /// As `Switchd`, its `/status` serving `web` (198.18.100.1:80) and
    /// retiring two deleted services, as switchd writes them.
    Retiring,
}

/// The `services` of `Endpoint::Retiring`'s `/status` (switchd's fields).
fn retiring_status() -> Value {
    json!({
        "role": "active",
        "servers": [],
        "control_listen": "198.18.1.1:7692",
        "interface_addrs": [{"interface": "client", "addr": "198.18.0.1"},
                            {"interface": "server", "addr": "198.18.1.1"}],
        "services": [
            {"name": "web", "vip": "198.18.100.1:80", "index": 0, "placement": "maglev",
             "pool": [{"server": 1, "weight": 1}], "fail_open": false, "retiring": false,
             "retiring_for_ms": null, "retiring_flows": null, "backend_down": []},
            {"name": "old", "vip": "198.18.100.3:80", "index": 2, "placement": "none",
             "pool": [], "fail_open": false, "retiring": true,
             "retiring_for_ms": 400, "retiring_flows": null, "backend_down": []},
            {"name": "api", "vip": "198.18.100.2:8080", "index": 1, "placement": "none",
             "pool": [{"server": 1, "weight": 1}], "fail_open": false, "retiring": true,
             "retiring_for_ms": 64000, "retiring_flows": 3, "retiring_left_ms": 236000,
             "backend_down": []}
        ]
    })
}

/// A stand-in endpoint on 127.0.0.1 (free port): its URL, and the task to
/// abort when done.
async fn switchd_endpoint(kind: Endpoint) -> (String, tokio::task::JoinHandle<()>) {
    let status = match kind {
        Endpoint::Retiring => retiring_status(),
        _ => json!({ "role": "active", "servers": [] }),
    };
    stand_in(kind, status).await
}

/// [`switchd_endpoint`]'s server, its `/status` answering `status`.
async fn stand_in(kind: Endpoint, status: Value) -> (String, tokio::task::JoinHandle<()>) {
    stand_in_changing(kind, Arc::new(std::sync::Mutex::new(status))).await
}

/// [`stand_in`] whose `/status` answers what `status` holds at the time of
/// each request (a test changes it as switchd would).
async fn stand_in_changing(
    kind: Endpoint,
    status: Arc<std::sync::Mutex<Value>>,
) -> (String, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let task = tokio::spawn(async move {
        let mut held = Vec::new();
        loop {
            let Ok((mut c, _)) = listener.accept().await else {
                continue;
            };
            if let Endpoint::Silent = kind {
                held.push(c);
                continue;
            }
            let status = status.lock().unwrap().to_string();
            tokio::spawn(async move {
                let target = request_target(&mut c).await;
                let (code, body) = match (kind, target.split('?').next().unwrap_or("")) {
                    (Endpoint::NotSwitchd, _) => ("200 OK", "<html>welcome</html>".to_string()),
                    (_, "/status") => ("200 OK", status),
                    (_, "/migrations") => (
                        "200 OK",
                        json!({ "epoch": 1, "next": 1, "items": [] }).to_string(),
                    ),
                    _ => ("404 Not Found", "not found\n".to_string()),
                };
                respond(&mut c, code, &body).await;
            });
        }
    });
    (url, task)
}

/// The target ("/status?x=1") of the request a stand-in reads on `c`, up
/// to the end of its head (4 KiB at most); empty if there is none.
async fn request_target(c: &mut tokio::net::TcpStream) -> String {
    use tokio::io::AsyncReadExt;
    let mut buf = vec![0u8; 4096];
    let mut n = 0;
    while n < buf.len() {
        match c.read(&mut buf[n..]).await {
            Ok(0) | Err(_) => break,
            Ok(k) => {
                n += k;
                if buf[..n].windows(4).any(|w| w == b"\r\n\r\n") {
                    break;
                }
            }
        }
    }
    let head = String::from_utf8_lossy(&buf[..n]);
    head.split_whitespace().nth(1).unwrap_or("").to_string()
}

/// A stand-in's answer: `code` with the JSON `body`, as switchd's
/// `metrics_listen` sends it (HTTP/1.1, `Connection: close`).
async fn respond(c: &mut tokio::net::TcpStream, code: &str, body: &str) {
    use tokio::io::AsyncWriteExt;
    let _ = c
        .write_all(
            format!(
                "HTTP/1.1 {code}\r\nContent-Type: application/json\r\n\
                 Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            )
            .as_bytes(),
        )
        .await;
}

/// `GET /readyz`: (status, body, how long it took).
async fn readyz(url: &str) -> (u16, Value, Duration) {
    let started = Instant::now();
    let (s, v, _) = call("GET", format!("{url}/readyz"), None, None).await;
    (s, v, started.elapsed())
}

/// Readiness stays 200 while the store answers, whatever switchd does (the
/// API serves reads from the store meanwhile), and its body says whether
/// switchd's control endpoint answered: `not_configured` without switchd,
/// `unreachable` (with the reason) when nothing listens at its address,
/// when it accepts but never answers, or when something else answers
/// there, and `reachable` when it answers. Always within a second.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_says_whether_switchd_answers() {
    // Store-only control plane.
    let dir = tempfile::tempdir().unwrap();
    let api = start(dir.path()).await;
    let (s, v, _) = readyz(&api.url).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["switchd"], "not_configured", "{v}");
    assert_eq!(v["control_plane"], "store", "{v}");
    assert!(v.get("switchd_error").is_none(), "{v}");
    api.stop().await;

    // Nothing listens at switchd's address.
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dead_url = format!("http://{}", dead.local_addr().unwrap());
    drop(dead);
    let dir = tempfile::tempdir().unwrap();
    let (running, inner, url) = start_with_switchd(dir.path(), &dead_url).await;
    let (s, v, took) = readyz(&url).await;
    assert_eq!(s, 200, "the store answers: {v}");
    assert_eq!(v["status"], "ok", "{v}");
    assert_eq!(v["store"], "sqlite", "{v}");
    assert_eq!(v["control_plane"], "switchd", "{v}");
    assert_eq!(v["switchd"], "unreachable", "{v}");
    let err = v["switchd_error"].as_str().unwrap();
    assert!(
        err.contains(&dead_url) && err.to_lowercase().contains("connection refused"),
        "{v}"
    );
    assert!(took < Duration::from_secs(1), "readyz took {took:?}");
    // Operators see it in `capybara ctl ready` (exit 0: the API is ready).
    let (u, t) = (url.clone(), String::new());
    let (code, out, err) = tokio::task::spawn_blocking(move || ctl(&u, &t, &["ready"]))
        .await
        .unwrap();
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("store sqlite answers") && out.contains("switchd: unreachable"),
        "{out}"
    );
    assert!(out.contains(&dead_url), "{out}");
    inner.shutdown();
    running.stop().await;

    // switchd accepts but never answers: the probe gives up in time.
    let (silent_url, silent) = switchd_endpoint(Endpoint::Silent).await;
    let dir = tempfile::tempdir().unwrap();
    let (running, inner, url) = start_with_switchd(dir.path(), &silent_url).await;
    let (s, v, took) = readyz(&url).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["switchd"], "unreachable", "{v}");
    let err = v["switchd_error"].as_str().unwrap();
    assert!(err.contains(&silent_url), "{v}");
    assert!(took < Duration::from_secs(1), "readyz took {took:?}: {v}");
    inner.shutdown();
    running.stop().await;
    silent.abort();

    // Something other than switchd answers there (a wrong URL).
    let (other_url, other) = switchd_endpoint(Endpoint::NotSwitchd).await;
    let dir = tempfile::tempdir().unwrap();
    let (running, inner, url) = start_with_switchd(dir.path(), &other_url).await;
    let (s, v, _) = readyz(&url).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["switchd"], "unreachable", "{v}");
    assert!(
        v["switchd_error"]
            .as_str()
            .unwrap()
            .contains("not a JSON object"),
        "{v}"
    );
    inner.shutdown();
    running.stop().await;
    other.abort();

    // switchd's endpoint answers.
    let (live_url, live) = switchd_endpoint(Endpoint::Switchd).await;
    let dir = tempfile::tempdir().unwrap();
    let (running, inner, url) = start_with_switchd(dir.path(), &live_url).await;
    let (s, v, took) = readyz(&url).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["switchd"], "reachable", "{v}");
    assert!(v.get("switchd_error").is_none(), "{v}");
    assert!(took < Duration::from_secs(1), "readyz took {took:?}");
    let (u, t) = (url.clone(), String::new());
    let (code, out, err) = tokio::task::spawn_blocking(move || ctl(&u, &t, &["ready"]))
        .await
        .unwrap();
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("switchd: reachable"), "{out}");
    // switchd goes away: the next probe says so, readiness stays 200.
    live.abort();
    let _ = live.await;
    let (s, v, took) = readyz(&url).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["switchd"], "unreachable", "{v}");
    assert!(took < Duration::from_secs(1), "readyz took {took:?}");
    inner.shutdown();
    running.stop().await;
}

/// `GET /v1/services` lists the deleted services switchd still serves
/// connections of (`retiring`, from its `/status`) after the live ones;
/// `GET /v1/services/NAME` of a deleted name stays 404; `capybara ctl
/// services` shows them under RETIRING. Without an answering switchd the
/// field is absent (unknown), not empty.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retiring_services_are_listed_from_switchd() {
    let (status_url, endpoint) = switchd_endpoint(Endpoint::Retiring).await;
    let dir = tempfile::tempdir().unwrap();
    let (running, inner, url, db) = start_with_switchd_db(dir.path(), &status_url).await;
    let admin = db.create("root", Role::Admin, "test").unwrap().1;
    let viewer = db.create("look", Role::Viewer, "test").unwrap().1;
    let svc = json!({ "name": "web", "vip": "198.18.100.1", "port": 80, "pool": [] });
    let (s, v, _) = call(
        "POST",
        format!("{url}/v1/services"),
        Some(&admin),
        Some(svc),
    )
    .await;
    assert_eq!(s, 201, "{v}");

    let (s, v, _) = call("GET", format!("{url}/v1/services"), Some(&viewer), None).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["items"].as_array().unwrap().len(), 1, "{v}");
    assert_eq!(v["items"][0]["name"], "web", "{v}");
    assert_eq!(v["items"][0]["serving"]["served"], true, "{v}");
    assert_eq!(v["items"][0]["serving"]["members"], json!([1]), "{v}");
    // By name; `connections` absent before switchd's first flow-table pass.
    assert_eq!(
        v["retiring"],
        json!([
            {"name": "api", "vip": "198.18.100.2", "port": 8080, "retiring_for_ms": 64000,
             "connections": 3, "timeout_in_ms": 236000},
            {"name": "old", "vip": "198.18.100.3", "port": 80, "retiring_for_ms": 400}
        ]),
        "{v}"
    );
    // Deleted is deleted: the retiring name is not a service.
    let (s, v, _) = call("GET", format!("{url}/v1/services/api"), Some(&viewer), None).await;
    assert_eq!(s, 404, "{v}");

    let (u, t) = (url.clone(), viewer.clone());
    let (code, out, err) = tokio::task::spawn_blocking(move || ctl(&u, &t, &["services"]))
        .await
        .unwrap();
    assert_eq!(code, 0, "{err}");
    let lines: Vec<&str> = out.lines().collect();
    let web = lines
        .iter()
        .position(|l| l.starts_with("web "))
        .expect(&out);
    let head = lines
        .iter()
        .position(|l| l.starts_with("RETIRING"))
        .expect(&out);
    assert!(web < head, "live services first:\n{out}");
    let api = lines.iter().find(|l| l.starts_with("api ")).expect(&out);
    assert!(
        api.contains("198.18.100.2:8080")
            && api.contains(" 3  1m 04s ago")
            && api.ends_with("3m 56s"),
        "{out}"
    );
    let old = lines.iter().find(|l| l.starts_with("old ")).expect(&out);
    assert!(old.contains(" ?  0.4s ago"), "{out}");

    // Connections of retiring addresses are their service's: `api` moved to
    // 198.18.100.5:8080 (its old address retires), `old` was deleted.
    let svc = json!({ "name": "api", "vip": "198.18.100.5", "port": 8080, "pool": [] });
    let (s, v, _) = call(
        "POST",
        format!("{url}/v1/services"),
        Some(&admin),
        Some(svc),
    )
    .await;
    assert_eq!(s, 201, "{v}");
    let (store, _) = store_and_db(dir.path()).await;
    let at = |vip: [u8; 4], port: u16, client_port: u16| FlowOp::Put {
        key: FlowKey {
            client_ip: Ipv4Addr::new(192, 0, 2, 1),
            client_port,
            service_ip: Ipv4Addr::from(vip),
            service_port: port,
        },
        server: ServerId(1),
    };
    store
        .apply_flows(&[
            at([198, 18, 100, 1], 80, 1),
            at([198, 18, 100, 2], 8080, 2),
            at([198, 18, 100, 3], 80, 3),
            at([198, 18, 100, 5], 8080, 4),
        ])
        .await
        .unwrap();
    let names = |v: &Value| -> Vec<(u64, String)> {
        v["items"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| {
                (
                    c["client_port"].as_u64().unwrap(),
                    c["service"].as_str().unwrap_or("-").to_string(),
                )
            })
            .collect()
    };
    let get = |q: &str| {
        call(
            "GET",
            format!("{url}/v1/connections{q}"),
            Some(&viewer),
            None,
        )
    };
    let (s, v, _) = get("?service=api").await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(
        names(&v),
        [(2, "api".to_string()), (4, "api".to_string())],
        "{v}"
    );
    let (_, v, _) = get("?service=old").await;
    assert_eq!(names(&v), [(3, "old".to_string())], "{v}");
    let (_, v, _) = get("").await;
    let want: Vec<(u64, String)> = [(1, "web"), (2, "api"), (3, "old"), (4, "api")]
        .iter()
        .map(|(p, n)| (*p, n.to_string()))
        .collect();
    assert_eq!(names(&v), want, "{v}");
    let (s, v, _) = get("?service=nope").await;
    assert_eq!(s, 404, "{v}");
    inner.shutdown();
    running.stop().await;

    // switchd does not answer: which deleted services still retire is
    // unknown, so `retiring` is absent (and ctl prints no RETIRING table).
    endpoint.abort();
    let _ = endpoint.await;
    let dir = tempfile::tempdir().unwrap();
    let (running, inner, url, db) = start_with_switchd_db(dir.path(), &status_url).await;
    let viewer = db.create("look", Role::Viewer, "test").unwrap().1;
    let (s, v, _) = call("GET", format!("{url}/v1/services"), Some(&viewer), None).await;
    assert_eq!(s, 200, "{v}");
    assert!(v.get("retiring").is_none(), "{v}");
    let (u, t) = (url.clone(), viewer.clone());
    let (code, out, err) = tokio::task::spawn_blocking(move || ctl(&u, &t, &["services"]))
        .await
        .unwrap();
    assert_eq!(code, 0, "{err}");
    assert!(!out.contains("RETIRING"), "{out}");
    inner.shutdown();
    running.stop().await;

    // The store-only control plane (no switchd): absent too.
    let dir = tempfile::tempdir().unwrap();
    let api = start(dir.path()).await;
    let viewer = api.token("look", Role::Viewer);
    let (s, v, _) = call(
        "GET",
        format!("{}/v1/services", api.url),
        Some(&viewer),
        None,
    )
    .await;
    assert_eq!(s, 200, "{v}");
    assert!(v.get("retiring").is_none(), "{v}");
    api.stop().await;
}

/// With more migrations than a page, `GET /v1/migrations?order=desc` lists
/// the newest (the dashboard's feed opens on them) while the default order
/// stays oldest first for polling with `after`; `capybara ctl migrations`
/// prints the newest, the newest last; `capybara ctl migrations | head -1`
/// ends quietly (killed by SIGPIPE like other Unix tools, no panic).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_newest_migrations_are_listed_first_with_order_desc() {
    // A stand-in for switchd whose `GET /migrations` holds 1000 origin
    // reports (seq 1..=1000), as switchd's `metrics_listen` answers.
    const REPORTS: u64 = 1000;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let switchd_url = format!("http://{}", listener.local_addr().unwrap());
    let endpoint = tokio::spawn(async move {
        loop {
            let Ok((mut c, _)) = listener.accept().await else {
                continue;
            };
            tokio::spawn(async move {
                let target = request_target(&mut c).await;
                let (path, query) = target.split_once('?').unwrap_or((&target, ""));
                let param = |k: &str| {
                    query
                        .split('&')
                        .find_map(|kv| kv.strip_prefix(k)?.strip_prefix('='))
                        .and_then(|v| v.parse::<u64>().ok())
                };
                let body = match path {
                    "/migrations" => {
                        let after = param("after").unwrap_or(0);
                        let limit = param("limit").unwrap_or(1000);
                        let items: Vec<Value> = (after + 1..=REPORTS)
                            .take(limit as usize)
                            .map(|seq| {
                                json!({
                                    "seq": seq, "migration_id": 0xc612_020b_0000_0000u64 + seq,
                                    "reporter": 1 + seq % 3, "role": "origin", "peer": 1 + (seq + 1) % 3,
                                    "client": format!("198.18.0.11:{}", 30000 + seq),
                                    "service": "198.18.100.1:80", "outcome": "migrated_out",
                                    "trigger": "proactive", "reason": null,
                                    "finished_unix_ms": 1_700_000_000_000u64 + seq,
                                    "phases": {"prepare_us": 40, "export_us": 9, "transfer_us": 78,
                                               "import_us": null, "total_us": 2000}
                                })
                            })
                            .collect();
                        json!({ "epoch": 1, "next": REPORTS + 1, "items": items })
                    }
                    _ => json!({ "role": "active", "servers": [] }),
                }
                .to_string();
                respond(&mut c, "200 OK", &body).await;
            });
        }
    });
    let dir = tempfile::tempdir().unwrap();
    let (running, inner, url, db) = start_with_switchd_db(dir.path(), &switchd_url).await;
    let viewer = db.create("look", Role::Viewer, "test").unwrap().1;
    let ids = |v: &Value| -> Vec<u64> {
        v["items"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["id"].as_u64().unwrap())
            .collect()
    };
    // The API polls switchd every 200 ms: wait until it holds all of them.
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let (s, v, _) = call(
            "GET",
            format!("{url}/v1/migrations?limit=10000"),
            Some(&viewer),
            None,
        )
        .await;
        assert_eq!(s, 200, "{v}");
        if ids(&v).len() == REPORTS as usize {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the API never listed {REPORTS} migrations: {} listed",
            ids(&v).len()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let get = |q: &'static str| {
        let (url, viewer) = (url.clone(), viewer.clone());
        async move {
            call(
                "GET",
                format!("{url}/v1/migrations{q}"),
                Some(&viewer),
                None,
            )
            .await
        }
    };
    // The dashboard's listing: the newest 100, newest first.
    let (s, v, _) = get("?limit=100&order=desc").await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(ids(&v), (901..=1000).rev().collect::<Vec<u64>>());
    assert_eq!(
        v["items"][0]["connection"],
        "198.18.0.11:31000-198.18.100.1:80"
    );
    assert_eq!(v["items"][0]["trigger"], "proactive", "{v}");
    // Default: oldest first, for polling with `after` (unchanged).
    let (s, v, _) = get("?limit=100").await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(ids(&v), (1..=100).collect::<Vec<u64>>());
    let (_, v, _) = get("?limit=100&order=asc").await;
    assert_eq!(ids(&v), (1..=100).collect::<Vec<u64>>());
    let (_, v, _) = get("?after=990&limit=5").await;
    assert_eq!(ids(&v), vec![991, 992, 993, 994, 995]);
    // `after` and `order=desc`: the newest above `after`.
    let (_, v, _) = get("?after=990&limit=5&order=desc").await;
    assert_eq!(ids(&v), vec![1000, 999, 998, 997, 996]);
    let (_, v, _) = get("?after=995&order=desc").await;
    assert_eq!(ids(&v), vec![1000, 999, 998, 997, 996]);
    let (_, v, _) = get("?after=1000&order=desc").await;
    assert_eq!(ids(&v), Vec::<u64>::new());
    // A bad order: 400 naming the parameter.
    let (s, v, _) = get("?order=newest").await;
    assert_eq!(s, 400, "{v}");
    assert!(
        v["detail"].as_str().unwrap().contains("`asc` or `desc`"),
        "{v}"
    );

    // `capybara ctl migrations`: the newest, the newest last.
    let (u, t) = (url.clone(), viewer.clone());
    let (code, out, err) =
        tokio::task::spawn_blocking(move || ctl(&u, &t, &["migrations", "--limit", "3"]))
            .await
            .unwrap();
    assert_eq!(code, 0, "{err}");
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 4, "{out}");
    assert!(lines[0].trim_start().starts_with("ID"), "{out}");
    for (line, id) in lines[1..].iter().zip([998, 999, 1000]) {
        assert!(line.trim_start().starts_with(&format!("{id} ")), "{out}");
    }
    assert!(
        lines[3].contains("198.18.0.11:31000-198.18.100.1:80") && lines[3].contains("succeeded"),
        "{out}"
    );
    let (u, t) = (url.clone(), viewer.clone());
    let (code, out, err) = tokio::task::spawn_blocking(move || ctl(&u, &t, &["migrations"]))
        .await
        .unwrap();
    assert_eq!(code, 0, "{err}");
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(
        lines.len(),
        1 + REPORTS as usize,
        "header and every migration kept"
    );
    assert!(lines[1].trim_start().starts_with("1 "), "{}", lines[1]);
    assert!(
        lines[1000].trim_start().starts_with("1000 "),
        "{}",
        lines[1000]
    );
    let (u, t) = (url.clone(), viewer.clone());
    let (code, _, err) =
        tokio::task::spawn_blocking(move || ctl(&u, &t, &["migrations", "--limit", "0"]))
            .await
            .unwrap();
    assert!(
        code == 2 && err.contains("--limit must be 1 to 10000"),
        "{code} {err}"
    );

    // `capybara ctl migrations | head -1`: about 80 KB of output, more than
    // the pipe holds, so ctl writes after `head` is gone. It ends like `seq
    // 100000 | head -1`: killed by SIGPIPE (bash's status 141), nothing on
    // stderr (it panicked "failed printing to stdout: Broken pipe").
    let errfile = dir.path().join("ctl.stderr");
    let (u, t, e) = (url.clone(), viewer.clone(), errfile.clone());
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new("bash")
            .args([
                "-c",
                r#""$0" --api "$1" --token "$2" migrations 2>"$3" | head -1; exit "${PIPESTATUS[0]}""#,
                env!("CARGO_BIN_EXE_capybara-ctl"),
                &u,
                &t,
                e.to_str().unwrap(),
            ])
            .env("RUST_BACKTRACE", "1")
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = std::fs::read_to_string(&errfile).unwrap();
    assert!(
        stdout.trim_start().starts_with("ID") && stdout.lines().count() == 1,
        "{stdout}"
    );
    assert_eq!(stderr, "", "ctl's stderr after head exited");
    assert_eq!(
        out.status.code(),
        Some(128 + 13),
        "ctl killed by SIGPIPE; stderr: {stderr}"
    );
    inner.shutdown();
    running.stop().await;
    endpoint.abort();
}

/// An operator weight is cleared through the API (`DELETE
/// /v1/servers/{id}/weight`, 204) and `capybara ctl weight ID --clear`:
/// the record's weight goes back to what it was before the operator's
/// (the REGISTER's) and is no longer the operator's; a viewer may not, an
/// unknown server is 404, `--clear` with a WEIGHT is a usage error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_weights_are_cleared() {
    let dir = tempfile::tempdir().unwrap();
    let api = start(dir.path()).await;
    let ops = api.token("ops", Role::Operator);
    let viewer = api.token("eyes", Role::Viewer);
    let id = register(&api, &ops, "web1").await;
    let url = |p: &str| format!("{}/v1/servers/{id}{p}", api.url);
    let (s, v, _) = call(
        "PUT",
        url("/weight"),
        Some(&ops),
        Some(json!({"weight": 0})),
    )
    .await;
    assert_eq!((s, v["weight"].as_u64()), (200, Some(0)), "{v}");
    // Whose weight it is, and what clearing it brings back, are shown.
    assert_eq!(
        (&v["weight_source"], &v["register_weight"]),
        (&json!("operator"), &json!(100)),
        "{v}"
    );
    let (s, _, _) = call("DELETE", url("/weight"), Some(&viewer), None).await;
    assert_eq!(s, 403);
    let (s, v, _) = call("DELETE", url("/weight"), Some(&ops), None).await;
    assert_eq!(s, 204, "{v}");
    let rec = api
        .store
        .get_server(ServerId(id as u32))
        .await
        .unwrap()
        .unwrap();
    assert_eq!((rec.weight, rec.weight_set), (100, false), "{rec:?}");
    let (_, v, _) = call("GET", url(""), Some(&viewer), None).await;
    assert_eq!(v["weight"], 100, "{v}");
    assert_eq!(
        (&v["weight_source"], &v["register_weight"]),
        (&json!("register"), &json!(null)),
        "{v}"
    );
    // Again (nothing to clear): still 204.
    let (s, _, _) = call("DELETE", url("/weight"), Some(&ops), None).await;
    assert_eq!(s, 204);
    let (s, v, _) = call(
        "DELETE",
        format!("{}/v1/servers/99/weight", api.url),
        Some(&ops),
        None,
    )
    .await;
    assert_eq!(s, 404, "{v}");

    let (u, t) = (api.url.clone(), ops.clone());
    let run = move |args: Vec<&'static str>| {
        let (u, t) = (u.clone(), t.clone());
        tokio::task::spawn_blocking(move || ctl(&u, &t, &args))
    };
    let (code, _, err) = run(vec!["weight", "1", "7"]).await.unwrap();
    assert_eq!(code, 0, "{err}");
    let (code, out, err) = run(vec!["servers"]).await.unwrap();
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains(" 7* ")
            && out.contains("* weight set by an operator: server 1 (its REGISTER reports 100)"),
        "{out}"
    );
    let (code, out, err) = run(vec!["weight", "1", "--clear"]).await.unwrap();
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("operator weight cleared"), "{out}");
    let rec = api.store.get_server(ServerId(1)).await.unwrap().unwrap();
    assert_eq!((rec.weight, rec.weight_set), (100, false), "{rec:?}");
    let (_, out, _) = run(vec!["servers"]).await.unwrap();
    assert!(!out.contains('*'), "{out}");
    let (code, _, err) = run(vec!["weight", "1", "7", "--clear"]).await.unwrap();
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("takes no WEIGHT"), "{err}");
    let (code, _, err) = run(vec!["weight", "1", "--clear=yes"]).await.unwrap();
    assert_eq!(code, 2, "{err}");
    api.stop().await;
}

/// Two servers at one data address would get each other's connections:
/// the second registration is refused (409 naming `data_addr` and the
/// server that has it), as is a data address that is a service's VIP; a
/// failed attempt stores nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_data_address_belongs_to_one_server() {
    let dir = tempfile::tempdir().unwrap();
    let api = start(dir.path()).await;
    let admin = api.token("root", Role::Admin);
    let url = format!("{}/v1/servers", api.url);
    let id = register(&api, &admin, "web1").await;
    let taken = data_addr_of("web1");
    let body = json!({ "name": "web2", "mgmt_addr": "10.0.1.12:7000", "data_addr": taken });
    let (s, v, ct) = call("POST", url.clone(), Some(&admin), Some(body)).await;
    assert_eq!(s, 409, "{v}");
    assert_eq!(ct, "application/problem+json");
    assert_eq!(v["field"], "data_addr", "{v}");
    assert_eq!(
        v["detail"],
        format!("data address {taken} is already that of server {id} (\"web1\"); each server needs its own"),
        "{v}"
    );
    // A service's VIP.
    let svc = json!({ "name": "web", "vip": "198.18.100.1", "port": 80, "pool": [] });
    let (s, v, _) = call(
        "POST",
        format!("{}/v1/services", api.url),
        Some(&admin),
        Some(svc),
    )
    .await;
    assert_eq!(s, 201, "{v}");
    let body =
        json!({ "name": "web2", "mgmt_addr": "10.0.1.12:7000", "data_addr": "198.18.100.1" });
    let (s, v, _) = call("POST", url.clone(), Some(&admin), Some(body)).await;
    assert_eq!(s, 422, "{v}");
    assert_eq!(v["field"], "data_addr", "{v}");
    assert!(
        v["detail"]
            .as_str()
            .unwrap()
            .contains("198.18.100.1 is the address of service \"web\""),
        "{v}"
    );
    let (_, v, _) = call("GET", url.clone(), Some(&admin), None).await;
    assert_eq!(v["items"].as_array().unwrap().len(), 1, "{v}");
    // Another address is fine.
    let body = json!({ "name": "web2", "mgmt_addr": "10.0.1.12:7000", "data_addr": "10.9.9.9" });
    let (s, v, _) = call("POST", url, Some(&admin), Some(body)).await;
    assert_eq!(s, 201, "{v}");
    api.stop().await;
}

/// The switch's own addresses (here its control address, as the appliance
/// A separate API (`[api] switchd = [URL]`, no switchd config of its own)
/// refuses the addresses switchd's `/status` says are the switch's own
/// (`control_listen`, its interfaces' addresses) as a service VIP and as a
/// server's data address, naming what each is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_addresses_switchd_reports_as_its_own_are_refused() {
    let (status_url, endpoint) = switchd_endpoint(Endpoint::Retiring).await;
    let dir = tempfile::tempdir().unwrap();
    let (running, _inner, url, db) = start_with_switchd_db(dir.path(), &status_url).await;
    let admin = db.create("root", Role::Admin, "test").unwrap().1;
    let want = "`vip`: 198.18.0.1 is the switch's own address (an address of switchd's interface client); a service needs an address of its own";
    // The addresses are read from switchd in the background: bounded wait.
    let started = Instant::now();
    let (s, v) = loop {
        let (s, v, _) = call(
            "POST",
            format!("{url}/v1/services"),
            Some(&admin),
            Some(json!({ "name": "web", "vip": "198.18.0.1", "port": 80, "pool": [] })),
        )
        .await;
        if s != 201 || started.elapsed() > Duration::from_secs(5) {
            break (s, v);
        }
        let (d, dv, _) = call(
            "DELETE",
            format!("{url}/v1/services/web"),
            Some(&admin),
            None,
        )
        .await;
        assert!(d < 300, "{dv}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(s, 422, "{v}");
    assert_eq!(v["detail"], want, "{v}");
    let (s, v, _) = call(
        "POST",
        format!("{url}/v1/servers"),
        Some(&admin),
        Some(json!({"name": "s7", "mgmt_addr": "198.18.1.7:7000", "data_addr": "198.18.1.1"})),
    )
    .await;
    assert_eq!(s, 422, "{v}");
    assert_eq!(
        v["detail"],
        "`data_addr`: 198.18.1.1 is the switch's own address (switchd's control_listen), not a server's",
        "{v}"
    );
    running.stop().await;
    endpoint.abort();
}

/// The switch's own addresses (here one, as the appliance's in-process API
/// passes `switchd.control_listen`) are neither a service VIP (create or
/// update) nor a server's data address: 422 naming the field and what the
/// address is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_switchs_own_addresses_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let own = Ipv4Addr::new(198, 18, 1, 1);
    let api = start_with_switch_addrs(
        dir.path(),
        vec![(own, "switchd.control_listen".to_string())],
    )
    .await;
    let admin = api.token("root", Role::Admin);
    let svc = |vip: &str| json!({ "name": "web", "vip": vip, "port": 80, "pool": [] });
    let want = "`vip`: 198.18.1.1 is the switch's own address (switchd.control_listen); a service needs an address of its own";
    let (s, v, _) = call(
        "POST",
        format!("{}/v1/services", api.url),
        Some(&admin),
        Some(svc("198.18.1.1")),
    )
    .await;
    assert_eq!(
        (s, &v["field"], &v["detail"]),
        (422, &json!("vip"), &json!(want)),
        "{v}"
    );
    let (s, v, _) = call(
        "POST",
        format!("{}/v1/services", api.url),
        Some(&admin),
        Some(svc("198.18.100.1")),
    )
    .await;
    assert_eq!(s, 201, "{v}");
    let body = json!({ "vip": "198.18.1.1", "port": 80, "pool": [] });
    let (s, v, _) = call(
        "PUT",
        format!("{}/v1/services/web", api.url),
        Some(&admin),
        Some(body),
    )
    .await;
    assert_eq!(
        (s, &v["field"], &v["detail"]),
        (422, &json!("vip"), &json!(want)),
        "{v}"
    );
    let (_, v, _) = call(
        "GET",
        format!("{}/v1/services/web", api.url),
        Some(&admin),
        None,
    )
    .await;
    assert_eq!(v["vip"], "198.18.100.1", "{v}");
    let body = json!({ "name": "web1", "mgmt_addr": "10.0.1.11:7000", "data_addr": "198.18.1.1" });
    let (s, v, _) = call(
        "POST",
        format!("{}/v1/servers", api.url),
        Some(&admin),
        Some(body),
    )
    .await;
    assert_eq!(s, 422, "{v}");
    assert_eq!(
        v["detail"],
        "`data_addr`: 198.18.1.1 is the switch's own address (switchd.control_listen), not a server's",
        "{v}"
    );
    api.stop().await;
}

/// A connection filter naming a service or server that does not exist is a
/// 404 naming it (before: an empty list, so a typo read as "no
/// connections"); known ones with no connection are an empty list; `capybara
/// ctl connections` says so too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_filters_naming_unknown_things_are_404() {
    let dir = tempfile::tempdir().unwrap();
    let api = start(dir.path()).await;
    let admin = api.token("root", Role::Admin);
    let id = register(&api, &admin, "web1").await;
    let svc = json!({ "name": "web", "vip": "198.18.100.1", "port": 80, "pool": [] });
    let (s, v, _) = call(
        "POST",
        format!("{}/v1/services", api.url),
        Some(&admin),
        Some(svc),
    )
    .await;
    assert_eq!(s, 201, "{v}");
    let get = |q: String| {
        call(
            "GET",
            format!("{}/v1/connections?{q}", api.url),
            Some(&admin),
            None,
        )
    };
    let (s, v, ct) = get("service=NOPE".into()).await;
    assert_eq!((s, ct.as_str()), (404, "application/problem+json"), "{v}");
    assert_eq!(v["field"], "service", "{v}");
    assert!(
        v["detail"]
            .as_str()
            .unwrap()
            .contains("service \"NOPE\" not found"),
        "{v}"
    );
    let (s, v, _) = get("server=7".into()).await;
    assert_eq!(s, 404, "{v}");
    assert_eq!(v["field"], "server", "{v}");
    assert!(
        v["detail"].as_str().unwrap().contains("server 7 not found"),
        "{v}"
    );
    for q in [
        "service=web".to_string(),
        format!("server={id}"),
        format!("server={id}&service=web"),
    ] {
        let (s, v, _) = get(q.clone()).await;
        assert_eq!(s, 200, "{q}: {v}");
        assert_eq!(v["total"], 0, "{q}: {v}");
    }
    // A server deregistered while its connections linger (dead, within
    // switchd's grace): they are listed, not hidden behind a 404.
    api.store
        .apply_flows(&[FlowOp::Put {
            key: flow(41),
            server: ServerId(9),
        }])
        .await
        .unwrap();
    let (s, v, _) = get("server=9".into()).await;
    assert_eq!((s, &v["total"]), (200, &json!(1)), "{v}");
    let (url, t) = (api.url.clone(), admin.clone());
    let (code, out, err) =
        tokio::task::spawn_blocking(move || ctl(&url, &t, &["connections", "--service", "NOPE"]))
            .await
            .unwrap();
    assert_ne!(code, 0, "{out}");
    assert!(err.contains("service \"NOPE\" not found"), "{err}");
    api.stop().await;
}

/// `capybara ctl drain` of the last server a service can place on still
/// drains, and warns that the service now refuses new connections.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ctl_drain_warns_when_a_service_is_left_without_servers() {
    let dir = tempfile::tempdir().unwrap();
    let api = start(dir.path()).await;
    let admin = api.token("root", Role::Admin);
    let a = register(&api, &admin, "web1").await;
    let b = register(&api, &admin, "web2").await;
    // Both serve (a server no hostagent registered counts as unavailable).
    hostagent_registers(&api, a).await;
    hostagent_registers(&api, b).await;
    let svc = json!({ "name": "web", "vip": "198.18.100.1", "port": 80, "pool": [] });
    let (s, v, _) = call(
        "POST",
        format!("{}/v1/services", api.url),
        Some(&admin),
        Some(svc),
    )
    .await;
    assert_eq!(s, 201, "{v}");
    let run = |args: Vec<String>| {
        let (url, t) = (api.url.clone(), admin.clone());
        tokio::task::spawn_blocking(move || {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            ctl(&url, &t, &args)
        })
    };
    let (code, _, err) = run(vec!["drain".into(), a.to_string()]).await.unwrap();
    assert_eq!(code, 0, "{err}");
    assert!(!err.contains("warning"), "{err}");
    let (code, _, err) = run(vec!["drain".into(), b.to_string()]).await.unwrap();
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains("warning: service web has no other active server with a weight above 0: it refuses new connections"),
        "{err}"
    );
    let (_, v, _) = call(
        "GET",
        format!("{}/v1/servers/{b}", api.url),
        Some(&admin),
        None,
    )
    .await;
    assert_ne!(v["state"], "active", "{v}");
    api.stop().await;
}

/// The first admin token is shown once: a start that cannot bind its
/// address must not show (and so lose) it; the next start that listens
/// shows it.
#[test]
fn a_start_that_cannot_bind_shows_no_admin_token() {
    let dir = tempfile::tempdir().unwrap();
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let store = format!("sqlite:{}", dir.path().join("store.db").display());
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_capybara-api"))
        .args([
            "--store",
            &store,
            "--listen",
            &taken.local_addr().unwrap().to_string(),
        ])
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(!out.status.success(), "{stdout} {stderr}");
    assert!(stderr.contains("Address already in use"), "{stderr}");
    assert!(!stdout.contains("admin token"), "{stdout}");
    drop(taken);
    // Listening: the token is shown (and the server stopped here).
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_capybara-api"))
        .args(["--store", &store, "--listen", "127.0.0.1:0"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufRead::lines(std::io::BufReader::new(child.stdout.take().unwrap()));
    let first = lines.next().unwrap().unwrap();
    let second = lines.next().unwrap().unwrap();
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(
        first.starts_with("admin token (shown once): capy_"),
        "{first}"
    );
    assert!(
        second.starts_with("listening on http://127.0.0.1:"),
        "{second}"
    );
}

/// `capybara ctl server delete`: refused (exit 1, the API's reason) while
/// the server is active; once drained, it is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ctl_deletes_a_drained_server() {
    let dir = tempfile::tempdir().unwrap();
    let api = start(dir.path()).await;
    let admin = api.token("root", Role::Admin);
    let id = register(&api, &admin, "web1").await;
    let run = |args: Vec<String>| {
        let (url, t) = (api.url.clone(), admin.clone());
        tokio::task::spawn_blocking(move || {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            ctl(&url, &t, &args)
        })
    };
    let del = || vec!["server".to_string(), "delete".to_string(), format!("s{id}")];
    let (code, _, err) = run(del()).await.unwrap();
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("409") && err.contains("drain it"), "{err}");
    let (code, _, err) = run(vec!["drain".into(), id.to_string(), "--wait".into()])
        .await
        .unwrap();
    assert_eq!(code, 0, "{err}");
    let (code, out, err) = run(del()).await.unwrap();
    assert_eq!(code, 0, "{err}");
    assert_eq!(out.trim(), format!("server {id} deleted"));
    let (s, _, _) = call(
        "GET",
        format!("{}/v1/servers/{id}", api.url),
        Some(&admin),
        None,
    )
    .await;
    assert_eq!(s, 404);
    let (code, _, err) = run(vec!["server".into(), "remove".into(), "1".into()])
        .await
        .unwrap();
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("`server delete SERVER`"), "{err}");
    api.stop().await;
}

/// A server created through the API that no hostagent registers is shown
/// `never_seen` (REST and `ctl servers`), not as serving; its hostagent's
/// REGISTER (the record switchd writes) makes it `live`, a death switchd
/// writes `dead`; with switchd answering, its view of the server wins.
/// Before, such a server was `active` forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_no_hostagent_registered_is_shown_never_seen() {
    let dir = tempfile::tempdir().unwrap();
    let api = start(dir.path()).await;
    let ops = api.token("ops", Role::Operator);
    let id = register(&api, &ops, "ghost").await;
    let url = format!("{}/v1/servers/{id}", api.url);
    let (s, v, _) = call("GET", url.clone(), Some(&ops), None).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(
        (&v["state"], &v["liveness"]),
        (&json!("active"), &json!("never_seen")),
        "{v}"
    );
    let (_, v, _) = call("GET", format!("{}/v1/servers", api.url), Some(&ops), None).await;
    assert_eq!(v["items"][0]["liveness"], "never_seen", "{v}");
    let (u, t) = (api.url.clone(), ops.clone());
    let (code, out, err) = tokio::task::spawn_blocking(move || ctl(&u, &t, &["servers"]))
        .await
        .unwrap();
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("LIVENESS") && out.contains(" never_seen "),
        "{out}"
    );

    // Its hostagent registers: switchd writes the REGISTER's record.
    hostagent_registers(&api, id).await;
    let (_, v, _) = call("GET", url.clone(), Some(&ops), None).await;
    assert_eq!(
        (&v["state"], &v["liveness"]),
        (&json!("active"), &json!("live")),
        "{v}"
    );
    api.store
        .set_server_state(ServerId(id as u32), capybara_store::ServerState::Dead)
        .await
        .unwrap();
    let (_, v, _) = call("GET", url, Some(&ops), None).await;
    assert_eq!(v["liveness"], "dead", "{v}");
    api.stop().await;

    // switchd's view: it holds server 1 and says it is dead, while the
    // record still says active; server 2 it does not hold (never seen).
    let status = json!({ "role": "active", "servers": [
        {"id": 1, "index": 0, "data_addr": "10.0.2.11", "state": "dead", "load": 0},
    ]});
    let api = two_servers_behind(status).await;
    let (url, ops, store) = (&api.url, api.ops.as_str(), &api.store);
    let mut s1 = store.get_server(ServerId(1)).await.unwrap().unwrap();
    s1.data_mac = Some("02:00:00:00:00:01".into());
    store.put_registered_server(&s1).await.unwrap();
    let (_, v, _) = call("GET", format!("{url}/v1/servers"), Some(ops), None).await;
    let items = v["items"].as_array().unwrap();
    let of = |id: u64| items.iter().find(|s| s["id"] == id).unwrap().clone();
    assert_eq!(
        (&of(1)["state"], &of(1)["liveness"]),
        (&json!("active"), &json!("dead")),
        "{v}"
    );
    assert_eq!(of(1)["stats"]["data_source"], "switchd", "{v}");
    assert_eq!(of(2)["liveness"], "never_seen", "{v}");
    api.stop().await;
}

/// A server whose hostagent is stopping (switchd's `/status` `leaving`)
/// is shown `stopping` with the connections it has left, one whose
/// hostagent stopped cleanly (`stopped`, state `dead`) `stopped`, apart
/// from one that died (`dead`; this one's switchd lacks both fields, as an
/// older switchd does), in REST and `ctl servers`; a record no hostagent
/// registered stays `never_seen` whatever switchd says. Starting to stop
/// writes no record: the API announces it as a `server` event. A stopped
/// server whose hostagent registers again is `live`. Before, the stopping
/// server read `live` and the stopped one `dead`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopping_and_a_stopped_server_are_shown_apart_from_a_dead_one() {
    use capybara_store::ServerState;
    let status = Arc::new(std::sync::Mutex::new(
        json!({ "role": "active", "servers": [
            {"id": 1, "state": "live", "connections": 5, "load_pps": 10.0,
             "leaving": false, "stopped": false},
            {"id": 2, "state": "dead", "connections": 0},
            {"id": 3, "state": "dead", "connections": 0, "leaving": true, "stopped": true},
            {"id": 4, "state": "dead", "leaving": true, "stopped": true},
        ]}),
    ));
    let api = two_servers_behind_changing(status.clone()).await;
    let (url, ops, store) = (api.url.clone(), api.ops.clone(), &api.store);
    for (name, data) in [("s3", "10.0.2.13"), ("s4", "10.0.2.14")] {
        let body = json!({ "name": name, "mgmt_addr": "10.0.1.11:7000", "data_addr": data });
        let (s, v, _) = call("POST", format!("{url}/v1/servers"), Some(&ops), Some(body)).await;
        assert_eq!(s, 201, "{v}");
    }
    // What switchd writes: s1..s3 registered; s2 and s3 dead.
    for id in 1..=3u32 {
        let mut rec = store.get_server(ServerId(id)).await.unwrap().unwrap();
        rec.data_mac = Some(format!("02:00:00:00:00:{id:02x}"));
        store.put_registered_server(&rec).await.unwrap();
    }
    for id in [2, 3] {
        store
            .set_server_state(ServerId(id), ServerState::Dead)
            .await
            .unwrap();
    }
    let liveness = || {
        let (url, ops) = (url.clone(), ops.clone());
        async move {
            let (s, v, _) = call("GET", format!("{url}/v1/servers"), Some(&ops), None).await;
            assert_eq!(s, 200, "{v}");
            let items = v["items"].as_array().unwrap().clone();
            (1..=4u64)
                .map(|id| {
                    let s = items.iter().find(|s| s["id"] == id).unwrap();
                    format!(
                        "{} {}",
                        s["state"].as_str().unwrap(),
                        s["liveness"].as_str().unwrap()
                    )
                })
                .collect::<Vec<_>>()
        }
    };
    assert_eq!(
        liveness().await,
        [
            "active live",
            "dead dead",
            "dead stopped",
            "active never_seen"
        ]
    );

    // s1's hostagent starts stopping. A client of the event stream hears
    // of it within a second or two: wait for the stream's first `load`
    // sample (the API has read switchd's view once) before the change.
    let resp = reqwest::Client::new()
        .get(format!("{url}/v1/events?types=server,load"))
        .bearer_auth(&ops)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    let mut events = EventReader {
        resp,
        buf: String::new(),
    };
    events.next_of("load", Duration::from_secs(5)).await;
    {
        let mut st = status.lock().unwrap();
        st["servers"][0]["leaving"] = json!(true);
        st["servers"][0]["connections"] = json!(3);
    }
    let ev = loop {
        let ev = events.next_of("server", Duration::from_secs(5)).await;
        if ev["id"] == 1 {
            break ev;
        }
    };
    assert_eq!(ev["server"]["liveness"], "stopping", "{ev}");
    assert_eq!(ev["server"]["stats"]["connections"], 3, "{ev}");
    drop(events);
    let (_, v, _) = call("GET", format!("{url}/v1/servers/1"), Some(&ops), None).await;
    assert_eq!(
        (&v["state"], &v["liveness"], &v["stats"]["connections"]),
        (&json!("active"), &json!("stopping"), &json!(3)),
        "{v}"
    );
    assert_eq!(
        liveness().await,
        [
            "active stopping",
            "dead dead",
            "dead stopped",
            "active never_seen"
        ]
    );
    let (u, t) = (url.clone(), ops.clone());
    let (code, out, err) = tokio::task::spawn_blocking(move || ctl(&u, &t, &["servers"]))
        .await
        .unwrap();
    assert_eq!(code, 0, "{err}");
    let row = |name: &str| -> Vec<String> {
        out.lines()
            .map(|l| l.split_whitespace().map(str::to_string).collect::<Vec<_>>())
            .find(|w| w.get(1).map(String::as_str) == Some(name))
            .unwrap_or_else(|| panic!("no row of {name}: {out}"))
    };
    // ID NAME STATE LIVENESS WEIGHT CONNECTIONS ...
    assert_eq!(row("s1")[2..4], ["active", "stopping"], "{out}");
    assert_eq!(row("s1")[5], "3", "{out}");
    assert_eq!(row("s2")[2..4], ["dead", "dead"], "{out}");
    assert_eq!(row("s3")[2..4], ["dead", "stopped"], "{out}");
    assert_eq!(row("s4")[2..4], ["active", "never_seen"], "{out}");

    // s3's hostagent returns: switchd holds it live, no longer stopped.
    {
        let mut st = status.lock().unwrap();
        st["servers"][2] = json!({"id": 3, "state": "live", "connections": 0,
                                  "leaving": false, "stopped": false});
    }
    let mut rec = store.get_server(ServerId(3)).await.unwrap().unwrap();
    rec.state = ServerState::Active;
    store.put_registered_server(&rec).await.unwrap();
    let (_, v, _) = call("GET", format!("{url}/v1/servers/3"), Some(&ops), None).await;
    assert_eq!(
        (&v["state"], &v["liveness"]),
        (&json!("active"), &json!("live")),
        "{v}"
    );
    api.stop().await;
}

/// Reads server-sent events off a `/v1/events` response.
struct EventReader {
    resp: reqwest::Response,
    buf: String,
}

impl EventReader {
    /// The data of the next event named `name` (others are skipped),
    /// within `limit`.
    async fn next_of(&mut self, name: &str, limit: Duration) -> Value {
        let deadline = Instant::now() + limit;
        loop {
            while let Some(end) = self.buf.find("\n\n") {
                let frame: String = self.buf.drain(..end + 2).collect();
                let mut event = "";
                let mut data = "";
                for line in frame.lines() {
                    if let Some(e) = line.strip_prefix("event: ") {
                        event = e;
                    } else if let Some(d) = line.strip_prefix("data: ") {
                        data = d;
                    }
                }
                if event == name {
                    return serde_json::from_str(data).unwrap();
                }
            }
            let left = deadline.saturating_duration_since(Instant::now());
            assert!(!left.is_zero(), "no {name} event within {limit:?}");
            match tokio::time::timeout(left, self.resp.chunk()).await {
                Ok(Ok(Some(c))) => self.buf.push_str(&String::from_utf8_lossy(&c)),
                Ok(Ok(None)) => panic!("the event stream ended"),
                Ok(Err(e)) => panic!("reading the event stream: {e}"),
                Err(_) => panic!("no {name} event within {limit:?}"),
            }
        }
    }
}

/// The API in front of a stand-in switchd whose `/status` is `status`
/// ([`stand_in`] as `Endpoint::Switchd`), with servers s1 (data address 10.0.2.11)
/// and s2 (10.0.2.12) created by an operator.
struct StandInApi {
    running: RunningApi,
    inner: Arc<StoreControlPlane>,
    url: String,
    /// The operator's token.
    ops: String,
    /// The API's store, opened a second time (to write what switchd would).
    store: SqliteStore,
    endpoint: tokio::task::JoinHandle<()>,
    _dir: tempfile::TempDir,
}

async fn two_servers_behind(status: Value) -> StandInApi {
    two_servers_behind_changing(Arc::new(std::sync::Mutex::new(status))).await
}

/// [`two_servers_behind`] a stand-in whose `/status` is what `status`
/// holds at each request.
async fn two_servers_behind_changing(status: Arc<std::sync::Mutex<Value>>) -> StandInApi {
    let (sw_url, endpoint) = stand_in_changing(Endpoint::Switchd, status).await;
    let dir = tempfile::tempdir().unwrap();
    let (running, inner, url, db) = start_with_switchd_db(dir.path(), &sw_url).await;
    let ops = db.create("ops", Role::Operator, "test").unwrap().1;
    for (name, data) in [("s1", "10.0.2.11"), ("s2", "10.0.2.12")] {
        let body = json!({ "name": name, "mgmt_addr": "10.0.1.11:7000", "data_addr": data });
        let (s, v, _) = call("POST", format!("{url}/v1/servers"), Some(&ops), Some(body)).await;
        assert_eq!(s, 201, "{v}");
    }
    let store = SqliteStore::open(SqliteConfig {
        path: dir.path().join("store.db"),
        ..SqliteConfig::default()
    })
    .await
    .unwrap();
    StandInApi {
        running,
        inner,
        url,
        ops,
        store,
        endpoint,
        _dir: dir,
    }
}

impl StandInApi {
    async fn stop(self) {
        self.endpoint.abort();
        self.inner.shutdown();
        self.running.stop().await;
    }
}

/// A query parameter the endpoint does not take is a 400 naming it: a
/// misspelt filter (`?servr=`) listed every connection, as if it matched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_query_parameters_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let api = start(dir.path()).await;
    let admin = api.token("root", Role::Admin);
    let id = register(&api, &admin, "web1").await;
    api.store
        .apply_flows(&[FlowOp::Put {
            key: flow(42),
            server: ServerId(id as u32),
        }])
        .await
        .unwrap();
    for (path, bad, takes) in [
        ("connections", "servr=7", "`server`, `service`, `limit`"),
        ("migrations", "afer=3", "`after`, `limit`, `order`"),
        ("audit", "sort=desc", "`after`, `limit`, `order`"),
        ("events", "type=load", "`types`, `access_token`"),
    ] {
        let field = bad.split('=').next().unwrap();
        let (s, v, ct) = call(
            "GET",
            format!("{}/v1/{path}?{bad}&limit=5", api.url),
            Some(&admin),
            None,
        )
        .await;
        assert_eq!(
            (s, ct.as_str()),
            (400, "application/problem+json"),
            "{path}: {v}"
        );
        assert_eq!(v["field"], field, "{path}: {v}");
        let detail = v["detail"].as_str().unwrap();
        assert!(
            detail.contains(&format!("unknown query parameter `{field}`"))
                && detail.contains(takes),
            "{path}: {v}"
        );
    }
    // The parameters each endpoint takes still work.
    let (s, v, _) = call(
        "GET",
        format!("{}/v1/connections?server=7&limit=5", api.url),
        Some(&admin),
        None,
    )
    .await;
    assert_eq!((s, &v["field"]), (404, &json!("server")), "{v}");
    for q in [
        "connections?server=1&limit=5",
        "migrations?after=0&limit=5&order=desc",
        "audit?after=0&limit=5&order=asc",
    ] {
        let (s, v, _) = call("GET", format!("{}/v1/{q}", api.url), Some(&admin), None).await;
        assert_eq!(s, 200, "{q}: {v}");
    }
    let (s, v, _) = call(
        "GET",
        format!("{}/v1/connections?server={id}", api.url),
        Some(&admin),
        None,
    )
    .await;
    assert_eq!((s, &v["total"]), (200, &json!(1)), "{v}");
    api.stop().await;
}

/// Draining again is a retry, not a new drain: a drained server answers 200
/// with its completed drain (the real drain's progress kept, not a new 0/0
/// one), a running drain goes on with its start and deadline unchanged, and
/// a request asking a different deadline or mode of a running drain is a
/// 409 naming what differs. `capybara ctl drain` says so and exits 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn draining_again_keeps_the_drain_the_server_has() {
    let dir = tempfile::tempdir().unwrap();
    let api = start(dir.path()).await;
    let token = api.token("ops", Role::Operator);
    let a = register(&api, &token, "web1").await;
    register(&api, &token, "web2").await;
    api.store
        .apply_flows(&[
            FlowOp::Put {
                key: flow(1),
                server: ServerId(a as u32),
            },
            FlowOp::Put {
                key: flow(2),
                server: ServerId(a as u32),
            },
        ])
        .await
        .unwrap();
    let drain_url = format!("{}/v1/servers/{a}/drain", api.url);
    let body = json!({"deadline_seconds": 60});
    let (s, first, _) = call("POST", drain_url.clone(), Some(&token), Some(body.clone())).await;
    assert_eq!(s, 202, "{first}");

    // The same request again: the running drain, not restarted.
    let (s, again, _) = call("POST", drain_url.clone(), Some(&token), Some(body.clone())).await;
    assert_eq!(s, 200, "{again}");
    assert_eq!(again["state"], "running");
    assert_eq!(again["started_unix_ms"], first["started_unix_ms"]);
    assert_eq!(again["deadline_unix_ms"], first["deadline_unix_ms"]);
    let (code, out, err) = ctl(
        &api.url,
        &token,
        &["drain", &a.to_string(), "--deadline", "60s"],
    );
    assert_eq!((code, out.trim()), (0, "running"), "{err}");
    assert!(err.contains("already draining (not restarted)"), "{err}");

    // Asking something else of a running drain is refused, naming it.
    for (other, named) in [
        (
            json!({"deadline_seconds": 10}),
            "deadline_seconds 60 (not 10)",
        ),
        (
            json!({"deadline_seconds": 60, "mode": "force"}),
            "mode migrate (not force)",
        ),
    ] {
        let (s, v, _) = call("POST", drain_url.clone(), Some(&token), Some(other)).await;
        assert_eq!(s, 409, "{v}");
        assert!(v["detail"].as_str().unwrap().contains(named), "{v}");
    }
    let (_, d, _) = call("GET", drain_url.clone(), Some(&token), None).await;
    assert_eq!(d["deadline_unix_ms"], first["deadline_unix_ms"]);

    // The connections close: the drain completes with its real progress.
    api.store
        .apply_flows(&[
            FlowOp::Delete { key: flow(1) },
            FlowOp::Delete { key: flow(2) },
        ])
        .await
        .unwrap();
    let done = wait_drain(&api, &token, a, "completed").await;
    assert_eq!(done["progress"]["flows_closed"], 2, "{done}");

    // Draining the drained server again (any deadline or mode): that drain.
    for retry in [
        body.clone(),
        json!({"deadline_seconds": 5, "mode": "force"}),
    ] {
        let (s, v, _) = call("POST", drain_url.clone(), Some(&token), Some(retry)).await;
        assert_eq!(s, 200, "{v}");
        assert_eq!(v, done);
    }
    let (code, out, err) = ctl(&api.url, &token, &["drain", &a.to_string()]);
    assert_eq!((code, out.trim()), (0, "completed"), "{err}");
    assert!(
        err.contains(&format!("server {a} is already drained")),
        "{err}"
    );
    let (_, d, _) = call("GET", drain_url.clone(), Some(&token), None).await;
    assert_eq!(d, done, "the completed drain's record is kept");
    let (_, srv, _) = call(
        "GET",
        format!("{}/v1/servers/{a}", api.url),
        Some(&token),
        None,
    )
    .await;
    assert_eq!(srv["state"], "drained");
    api.stop().await;
}

/// With the dashboard served (`static_dir`), a method other than GET or
/// HEAD on a path no route has is a 404 problem document, as without it;
/// it was actix-files' text/plain 405 ("Request did not meet this
/// resource's requirements.") with no `Allow` header.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_routes_are_problem_documents_with_the_dashboard_served() {
    let dir = tempfile::tempdir().unwrap();
    let web = dir.path().join("dist");
    std::fs::create_dir(&web).unwrap();
    std::fs::write(web.join("index.html"), "<!doctype html><title>t</title>").unwrap();
    let (store, db) = store_and_db(dir.path()).await;
    let cp = StoreControlPlane::new(store.clone(), db.clone())
        .await
        .unwrap();
    let running = capybara_api::start(ApiConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        store,
        control_plane: Arc::new(cp.clone()),
        db: db.clone(),
        static_dir: Some(web),
        workers: 1,
        switch_addrs: capybara_api::server::fixed_switch_addrs(Vec::new()),
    })
    .await
    .unwrap();
    let url = format!("http://{}", running.addr);
    let admin = db.create("root", Role::Admin, "test").unwrap().1;
    let c = reqwest::Client::new();
    let r = c.get(format!("{url}/")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert!(r.text().await.unwrap().contains("<title>t</title>"));
    let r = c.head(format!("{url}/index.html")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    for (method, path) in [
        ("POST", "/nope"),
        ("DELETE", "/index.html"),
        ("POST", "/v1/tokens/"),
        ("POST", "/v1/servers/1/nope"),
        ("DELETE", "/v1/services/web/extra"),
        ("PUT", "/v1"),
    ] {
        let (s, v, ct) = call(method, format!("{url}{path}"), Some(&admin), None).await;
        assert_eq!(s, 404, "{method} {path}: {v}");
        assert_eq!(ct, "application/problem+json", "{method} {path}");
        assert_eq!(
            v["type"], "urn:capybara:problem:not-found",
            "{method} {path}"
        );
    }
    // A known route with a method it does not take is still a 405 naming
    // the methods.
    let (s, v, _) = call("PATCH", format!("{url}/v1/servers"), Some(&admin), None).await;
    assert_eq!(s, 405, "{v}");
    cp.shutdown();
    running.stop().await;
}

/// `POST /v1/connections/{id}/migrate` to a server whose hostagent lists
/// other services and not the connection's VIP:port (switchd's `/status`)
/// is a 422 naming `target`: it was accepted (202) and the migration then
/// ended `aborted`, `import failed` (seen in the demo: a connection of a
/// service only s3 serves, `ctl migrate CONN --target 1`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_migration_to_a_server_that_does_not_serve_the_vip_is_refused() {
    let status = json!({ "role": "active", "servers": [
        {"id": 1, "index": 0, "data_addr": "10.0.2.11", "state": "active", "load": 0,
         "backends": [{"service": "198.18.100.1:80", "up": true},
                      {"service": "198.18.100.1:8083", "up": true}]},
        {"id": 2, "index": 1, "data_addr": "10.0.2.12", "state": "active", "load": 0,
         "backends": [{"service": "198.18.100.1:80", "up": true}]},
    ]});
    let api = two_servers_behind(status).await;
    let (url, ops, store) = (&api.url, api.ops.as_str(), &api.store);
    let key = |port: u16| FlowKey {
        client_ip: Ipv4Addr::new(198, 18, 0, 11),
        client_port: 40000,
        service_ip: Ipv4Addr::new(198, 18, 100, 1),
        service_port: port,
    };
    for port in [80, 8083] {
        store
            .apply_flows(&[FlowOp::Put {
                key: key(port),
                server: ServerId(1),
            }])
            .await
            .unwrap();
    }
    let migrate = |port: u16| {
        call(
            "POST",
            format!("{url}/v1/connections/198.18.0.11:40000-198.18.100.1:{port}/migrate"),
            Some(ops),
            Some(json!({ "target": 2 })),
        )
    };
    let (s, v, ct) = migrate(8083).await;
    assert_eq!((s, v["field"].as_str()), (422, Some("target")), "{v}");
    assert_eq!(ct, "application/problem+json");
    assert!(
        v["detail"]
            .as_str()
            .unwrap()
            .contains("server 2 does not serve 198.18.100.1:8083"),
        "{v}"
    );
    // Server 2 serves port 80: the request goes on to switchd (whose
    // stand-in has no migrate endpoint): not refused for the target.
    let (_, v, _) = migrate(80).await;
    assert_ne!(v["field"].as_str(), Some("target"), "{v}");
    api.stop().await;
}

/// The operator's drain and switchd's liveness are two records: a drained
/// server that dies is shown `drained` with liveness `dead` (switchd's
/// `dead` does not undo the drain), back it is `drained` and `live` (a
/// REGISTER does not either), and undrained while dead it is `dead` (an
/// undrain of a dead server is answered as a live one's), `active` once
/// its hostagent registers again. A drain state a previous version wrote in the server record reads as a
/// drain until undrain.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_and_liveness_are_shown_apart() {
    use capybara_store::ServerState;
    let dir = tempfile::tempdir().unwrap();
    let api = start(dir.path()).await;
    let token = api.token("ops", Role::Operator);
    let a = register(&api, &token, "a").await;
    hostagent_registers(&api, a).await;
    let id = ServerId(a as u32);
    let url = format!("{}/v1/servers/{a}", api.url);
    let shown = || async {
        let (s, v, _) = call("GET", url.clone(), Some(&token), None).await;
        assert_eq!(s, 200, "{v}");
        (
            v["state"].as_str().unwrap_or("").to_string(),
            v["liveness"].as_str().unwrap_or("").to_string(),
        )
    };
    let (s, v, _) = call(
        "POST",
        format!("{url}/drain"),
        Some(&token),
        Some(json!({"deadline_seconds": 5})),
    )
    .await;
    assert_eq!(s, 202, "{v}");
    wait_drain(&api, &token, a, "completed").await;
    assert_eq!(shown().await, ("drained".into(), "live".into()));
    // switchd declares it dead: the record says so, the drain stays.
    api.store
        .set_server_state(id, ServerState::Dead)
        .await
        .unwrap();
    assert_eq!(shown().await, ("drained".into(), "dead".into()));
    // Its hostagent registers again: switchd writes the REGISTER's record.
    let mut rec = api.store.get_server(id).await.unwrap().unwrap();
    rec.state = ServerState::Active;
    api.store.put_registered_server(&rec).await.unwrap();
    assert_eq!(shown().await, ("drained".into(), "live".into()));
    // Dead again, then undrained: its liveness is what is left.
    api.store
        .set_server_state(id, ServerState::Dead)
        .await
        .unwrap();
    let (s, v, _) = call("POST", format!("{url}/undrain"), Some(&token), None).await;
    assert_eq!((s, &v["state"]), (200, &json!("dead")), "{v}");
    assert_eq!(wait_drain(&api, &token, a, "cancelled").await["server"], a);
    // Undrained again (automation retries), now that no drain holds the
    // dead server: answered as for a live one (before: 409 "re-register
    // it instead"), and ctl says what it means.
    let (s, v, _) = call("POST", format!("{url}/undrain"), Some(&token), None).await;
    assert_eq!((s, &v["state"]), (200, &json!("dead")), "{v}");
    let (code, out, err) = ctl(&api.url, &token, &["undrain", &a.to_string()]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains(&format!("server {a} (a) is undrained; it is dead"))
            && out.contains("once its hostagent registers again"),
        "{out}"
    );
    assert_eq!(wait_drain(&api, &token, a, "cancelled").await["server"], a);
    // A dead server has nothing to drain.
    let (s, v, _) = call(
        "POST",
        format!("{url}/drain"),
        Some(&token),
        Some(json!({"deadline_seconds": 5})),
    )
    .await;
    assert_eq!(s, 409, "{v}");
    // Its hostagent registers again: active, in placement (switchd's side:
    // tests/tests/drain_dead_lab.rs).
    let mut rec = api.store.get_server(id).await.unwrap().unwrap();
    rec.state = ServerState::Active;
    api.store.put_registered_server(&rec).await.unwrap();
    assert_eq!(shown().await, ("active".into(), "live".into()));

    // What a previous version wrote: the drain in the server record.
    api.store
        .set_server_state(id, ServerState::Drained)
        .await
        .unwrap();
    assert_eq!(shown().await, ("drained".into(), "live".into()));
    let (s, v, _) = call("POST", format!("{url}/undrain"), Some(&token), None).await;
    assert_eq!((s, &v["state"]), (200, &json!("active")), "{v}");
    api.stop().await;
}

/// An integer too large for 64 bits (JSON reads it as a float) is refused
/// with a 422 that says it is out of range, naming the field, instead of
/// "invalid type: floating point `1e+23`"; a weight of 70000 keeps the
/// API's own bound, and a fraction keeps serde's wording.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_huge_integer_is_out_of_range() {
    let dir = tempfile::tempdir().unwrap();
    let api = start(dir.path()).await;
    let ops = api.token("ops", Role::Operator);
    let id = register(&api, &ops, "web1").await;
    let send = |method: &'static str, path: String, body: &'static str| {
        let (url, ops) = (format!("{}{path}", api.url), ops.clone());
        async move {
            let resp = reqwest::Client::new()
                .request(method.parse().unwrap(), url)
                .bearer_auth(ops)
                .header("content-type", "application/json")
                .body(body)
                .timeout(Duration::from_secs(10))
                .send()
                .await
                .unwrap();
            let s = resp.status().as_u16();
            let v: Value = serde_json::from_str(&resp.text().await.unwrap()).unwrap();
            (s, v)
        }
    };
    let weight = format!("/v1/servers/{id}/weight");
    let (s, v) = send(
        "PUT",
        weight.clone(),
        r#"{"weight": 99999999999999999999999}"#,
    )
    .await;
    assert_eq!((s, &v["field"]), (422, &json!("weight")), "{v}");
    assert_eq!(
        v["detail"],
        "`weight`: 1e23 is out of range: expected an integer from 0 to 18446744073709551615",
        "{v}"
    );
    let body = r#"{"name": "web2", "mgmt_addr": "10.0.1.12:7000", "data_addr": "10.0.2.12", "weight": -99999999999999999999999}"#;
    let (s, v) = send("POST", "/v1/servers".into(), body).await;
    assert_eq!((s, &v["field"]), (422, &json!("weight")), "{v}");
    assert!(
        v["detail"]
            .as_str()
            .unwrap()
            .contains("-1e23 is out of range"),
        "{v}"
    );
    let (s, v) = send("PUT", weight.clone(), r#"{"weight": 70000}"#).await;
    assert_eq!(s, 422, "{v}");
    assert_eq!(
        v["detail"], "`weight`: must be in [0, 65535], got 70000",
        "{v}"
    );
    let (s, v) = send("PUT", weight.clone(), r#"{"weight": 1.5}"#).await;
    assert_eq!(s, 422, "{v}");
    assert!(
        v["detail"]
            .as_str()
            .unwrap()
            .contains("invalid type: floating point `1.5`"),
        "{v}"
    );
    // Nothing was changed or created.
    let rec = api
        .store
        .get_server(ServerId(id as u32))
        .await
        .unwrap()
        .unwrap();
    assert!(!rec.weight_set, "{rec:?}");
    let (s, v) = send("PUT", weight, r#"{"weight": 3}"#).await;
    assert_eq!((s, &v["weight"]), (200, &json!(3)), "{v}");
    api.stop().await;
}

/// SERVED BY (`ctl services`) and `serving.placing` (`GET /v1/services`)
/// name who takes new connections, as switchd's `/status` `placing` says,
/// not the pool (`members`), which keeps dead, drained and deleted
/// servers. From a switchd without `placing`: absent, and SERVED BY is
/// the pool as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn services_name_the_servers_that_take_new_connections() {
    let service = |placing: Option<Vec<u32>>| {
        let mut s = json!({"name": "web", "vip": "198.18.100.1:80", "index": 0,
            "placement": "maglev",
            "pool": [{"server": 1, "weight": 1}, {"server": 2, "weight": 1},
                     {"server": 3, "weight": 1}],
            "fail_open": false, "refusing": false, "retiring": false, "backend_down": []});
        if let Some(p) = placing {
            s["placing"] = json!(p);
        }
        s
    };
    let status = Arc::new(std::sync::Mutex::new(json!({
        "role": "active",
        "servers": [{"id": 1, "state": "live", "connections": 0},
                    {"id": 2, "state": "draining", "connections": 0},
                    {"id": 3, "state": "dead", "connections": 0}],
        "services": [service(Some(vec![1]))],
    })));
    let api = two_servers_behind_changing(status.clone()).await;
    let (url, ops) = (api.url.clone(), api.ops.clone());
    // An open pool (empty: every server), as the demo's `web`.
    api.store
        .put_service(&capybara_store::Service {
            name: "web".into(),
            vip: "198.18.100.1".parse().unwrap(),
            port: 80,
            pool: vec![],
        })
        .await
        .unwrap();
    let serving = || {
        let (url, ops) = (url.clone(), ops.clone());
        async move {
            let (s, v, _) = call("GET", format!("{url}/v1/services"), Some(&ops), None).await;
            assert_eq!(s, 200, "{v}");
            v["items"][0]["serving"].clone()
        }
    };
    let served_by = || {
        let (code, out, err) = ctl(&url, &ops, &["services"]);
        assert_eq!(code, 0, "{out}{err}");
        let line = out
            .lines()
            .find(|l| l.starts_with("web "))
            .unwrap()
            .to_string();
        // NAME, VIP:PORT and POOL ("every server"): columns of 20, 21 and
        // 16 characters, one space apart, then SERVED BY.
        assert_eq!(&line[43..60], "every server     ", "{out}");
        line[60..].to_string()
    };
    let v = serving().await;
    assert_eq!(v["members"], json!([1, 2, 3]), "{v}");
    assert_eq!(v["placing"], json!([1]), "{v}");
    assert_eq!(served_by(), "1");
    // Nobody takes new connections: said, with the pool.
    status.lock().unwrap()["services"][0] = service(Some(vec![]));
    assert_eq!(serving().await["placing"], json!([]));
    assert_eq!(served_by(), "none (pool 1,2,3)");
    // An older switchd says nothing of placing: absent, the pool shown.
    status.lock().unwrap()["services"][0] = service(None);
    let v = serving().await;
    assert!(v.get("placing").is_none(), "{v}");
    assert_eq!(v["members"], json!([1, 2, 3]), "{v}");
    assert_eq!(served_by(), "1,2,3");
    api.stop().await;
}

/// The operations of `openapi.yaml` (path, method) with the query
/// parameters each declares (`in: query`, also through
/// `#/components/parameters/...`), read from its layout: two-space path
/// keys under `paths:`, four-space methods.
fn openapi_operations() -> Vec<(String, String, Vec<String>)> {
    let yaml = capybara_api::OPENAPI_YAML;
    let indent = |l: &str| l.len() - l.trim_start().len();
    // `components.parameters`: ref name -> (name, in).
    let mut shared = std::collections::HashMap::new();
    let mut in_params = false;
    let mut cur: Option<(String, Option<String>)> = None;
    for l in yaml.lines() {
        if l == "  parameters:" {
            in_params = true;
            continue;
        }
        if in_params && !l.trim().is_empty() && indent(l) <= 2 {
            in_params = false;
        }
        if !in_params {
            continue;
        }
        if indent(l) == 4 {
            cur = Some((l.trim().trim_end_matches(':').to_string(), None));
        } else if let (Some((_, name)), Some(v)) = (cur.as_mut(), l.trim().strip_prefix("name: ")) {
            *name = Some(v.to_string());
        } else if let (Some((r, Some(name))), Some(v)) = (&cur, l.trim().strip_prefix("in: ")) {
            shared.insert(r.clone(), (name.clone(), v.to_string()));
        }
    }
    let mut ops: Vec<(String, String, Vec<String>)> = Vec::new();
    let (mut in_paths, mut path) = (false, None::<String>);
    let mut pending_name: Option<String> = None;
    for l in yaml.lines() {
        if l == "paths:" {
            in_paths = true;
            continue;
        }
        if in_paths && !l.trim().is_empty() && indent(l) == 0 {
            break;
        }
        if !in_paths || l.trim().is_empty() {
            continue;
        }
        let t = l.trim();
        match indent(l) {
            2 => path = Some(t.trim_end_matches(':').to_string()),
            4 => {
                let m = t.trim_end_matches(':');
                if ["get", "post", "put", "patch", "delete"].contains(&m) {
                    ops.push((path.clone().unwrap(), m.to_uppercase(), Vec::new()));
                } else {
                    // Path-level `parameters:` (path parameters only).
                    ops.push((String::new(), String::new(), Vec::new()));
                }
            }
            _ => {
                let Some(op) = ops.last_mut().filter(|o| !o.0.is_empty()) else {
                    continue;
                };
                if let Some(n) = t.strip_prefix("- name: ") {
                    pending_name = Some(n.to_string());
                } else if t == "in: query" {
                    op.2.extend(pending_name.take());
                } else if let Some(r) = t.strip_prefix("- $ref: '#/components/parameters/") {
                    if let Some((name, "query")) = shared
                        .get(r.trim_end_matches('\''))
                        .map(|(n, i)| (n.clone(), i.as_str()))
                    {
                        op.2.push(name);
                    }
                }
            }
        }
    }
    ops.retain(|o| !o.0.is_empty());
    ops
}

/// Every `/v1` operation of `openapi.yaml` refuses a query parameter it
/// does not take with a 400 naming it, and names the ones it takes (those
/// the contract lists): a misspelt parameter was ignored on most of them
/// (`GET /v1/servers?bogus=1` listed the servers). One it takes given twice
/// (`?limit=1&limit=2`) is a 400 naming it too. Walked from the spec, so
/// a new operation is covered by this test as it is added. The check comes
/// after authentication (401, 403 first), and the probes and `/metrics`
/// ignore the query.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_v1_operation_refuses_an_unknown_or_repeated_query_parameter() {
    let dir = tempfile::tempdir().unwrap();
    let api = start(dir.path()).await;
    let admin = api.token("root", Role::Admin);
    let viewer = api.token("eyes", Role::Viewer);
    let id = register(&api, &admin, "web1").await;
    let ops = openapi_operations();
    assert!(ops.len() >= 25, "read {} operations: {ops:?}", ops.len());
    let mut v1 = 0;
    for (path, method, declared) in &ops {
        if !path.starts_with("/v1/") {
            continue;
        }
        v1 += 1;
        // Path parameters do not matter: the query is checked before them.
        let mut p = path.clone();
        while let (Some(a), Some(b)) = (p.find('{'), p.find('}')) {
            p.replace_range(a..=b, &id.to_string());
        }
        let (s, v, ct) = call(
            method,
            format!("{}{p}?bogus=1", api.url),
            Some(&admin),
            None,
        )
        .await;
        assert_eq!(
            (s, ct.as_str(), &v["field"]),
            (400, "application/problem+json", &json!("bogus")),
            "{method} {path}: {v}"
        );
        let detail = v["detail"].as_str().unwrap();
        let takes: Vec<String> = match detail.split_once("this endpoint takes ") {
            Some((_, "no query parameters")) => Vec::new(),
            Some((_, list)) => list
                .split(", ")
                .map(|k| k.trim_matches('`').to_string())
                .collect(),
            None => panic!("{method} {path}: {detail}"),
        };
        assert!(
            detail.starts_with("unknown query parameter `bogus`"),
            "{method} {path}: {detail}"
        );
        // What it takes is what the contract lists (the event stream also
        // takes its token there: security scheme `accessTokenQuery`).
        let mut want = declared.clone();
        if path == "/v1/events" {
            want.push("access_token".into());
        }
        let (mut got, mut want) = (takes, want);
        got.sort();
        want.sort();
        assert_eq!(got, want, "{method} {path}");
        // A parameter it takes, given twice, is refused as well: it took
        // the last one silently (`?limit=1&limit=2` listed two).
        for k in &want {
            let (s, v, ct) = call(
                method,
                format!("{}{p}?{k}=1&{k}=2", api.url),
                Some(&admin),
                None,
            )
            .await;
            assert_eq!(
                (s, ct.as_str(), &v["field"], &v["detail"]),
                (
                    400,
                    "application/problem+json",
                    &json!(k),
                    &json!(format!("query parameter `{k}` given twice; give it once"))
                ),
                "{method} {path}?{k}=1&{k}=2: {v}"
            );
        }
    }
    assert!(v1 >= 20, "{v1} /v1 operations");
    // Authentication and the role come first.
    let (s, _, _) = call("GET", format!("{}/v1/servers?bogus=1", api.url), None, None).await;
    assert_eq!(s, 401);
    let (s, _, _) = call(
        "POST",
        format!("{}/v1/servers?bogus=1", api.url),
        Some(&viewer),
        Some(json!({})),
    )
    .await;
    assert_eq!(s, 403);
    // Nothing was changed by the refused requests.
    let (s, v, _) = call("GET", format!("{}/v1/servers", api.url), Some(&admin), None).await;
    assert_eq!((s, v["items"].as_array().unwrap().len()), (200, 1), "{v}");
    // Probes and the scraper ignore the query.
    for p in ["/healthz", "/readyz", "/metrics"] {
        let (s, _, _) = call("GET", format!("{}{p}?bogus=1", api.url), None, None).await;
        assert_eq!(s, 200, "{p}");
    }
    api.stop().await;
}

/// `POST /v1/servers/{id}/drain` without a body (no Content-Type, as
/// `curl -X POST` sends it) or with an empty one is a drain with the
/// defaults, since every field is optional: it was a 400 "a JSON request
/// body is required". A body that is not JSON is still a 400 saying so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_needs_no_body() {
    let dir = tempfile::tempdir().unwrap();
    let api = start(dir.path()).await;
    let ops = api.token("ops", Role::Operator);
    let a = register(&api, &ops, "web1").await;
    let b = register(&api, &ops, "web2").await;
    let c = register(&api, &ops, "web3").await;
    for id in [a, b] {
        api.store
            .apply_flows(&[FlowOp::Put {
                key: flow(id as u16),
                server: ServerId(id as u32),
            }])
            .await
            .unwrap();
    }
    let post = |id: u64, ct: Option<&'static str>, body: &'static str| {
        let (url, ops) = (format!("{}/v1/servers/{id}/drain", api.url), ops.clone());
        async move {
            let mut r = reqwest::Client::new().post(url).bearer_auth(ops);
            if let Some(ct) = ct {
                r = r.header("content-type", ct);
            }
            let resp = r
                .body(body)
                .timeout(Duration::from_secs(10))
                .send()
                .await
                .unwrap();
            let s = resp.status().as_u16();
            (s, resp.json::<Value>().await.unwrap())
        }
    };
    // No body and no Content-Type; an empty body with one.
    for (id, ct) in [(a, None), (b, Some("application/json"))] {
        let (s, v) = post(id, ct, "").await;
        assert_eq!(s, 202, "{v}");
        assert_eq!(
            (&v["state"], &v["mode"]),
            (&json!("running"), &json!("migrate"))
        );
        let secs = (v["deadline_unix_ms"].as_u64().unwrap()
            - v["started_unix_ms"].as_u64().unwrap())
            / 1000;
        assert_eq!(secs, 30, "the default deadline: {v}");
    }
    // Again without a body: the same drain (a retry).
    let (s, v) = post(a, None, "").await;
    assert_eq!(s, 200, "{v}");
    // Not JSON: a 400 that says so.
    let (s, v) = post(c, Some("application/json"), "{deadline_seconds: 5").await;
    assert_eq!(s, 400, "{v}");
    assert!(
        v["detail"]
            .as_str()
            .unwrap()
            .starts_with("body is not valid JSON"),
        "{v}"
    );
    let (s, v, _) = call(
        "GET",
        format!("{}/v1/servers/{c}/drain", api.url),
        Some(&ops),
        None,
    )
    .await;
    assert_eq!(s, 404, "no drain was started: {v}");
    api.stop().await;
}

/// `capybara ctl services` right after `service add`, before switchd has
/// read the service from the store (it does every 250 ms): SERVED BY says
/// it is pending, not "not served (see switchd's log)" as if it had
/// failed; once switchd's `/status` lists it, the servers it places on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_service_switchd_has_not_applied_yet_is_pending() {
    let status = Arc::new(std::sync::Mutex::new(
        json!({ "role": "active", "servers": [], "services": [] }),
    ));
    let (sw_url, endpoint) = stand_in_changing(Endpoint::Switchd, status.clone()).await;
    let dir = tempfile::tempdir().unwrap();
    let (running, inner, url, db) = start_with_switchd_db(dir.path(), &sw_url).await;
    let admin = db.create("root", Role::Admin, "test").unwrap().1;
    let (code, _, err) = ctl(
        &url,
        &admin,
        &["service", "add", "api", "198.18.100.2:8080"],
    );
    assert_eq!(code, 0, "{err}");
    let (code, out, err) = ctl(&url, &admin, &["services"]);
    assert_eq!(code, 0, "{err}");
    let line = out.lines().find(|l| l.starts_with("api ")).unwrap();
    assert!(
        line.ends_with(
            "pending: switchd applies it within 1 s (if it stays pending, see switchd's log)"
        ),
        "{out}"
    );
    assert!(!out.contains("not served"), "{out}");
    // switchd applied it.
    status.lock().unwrap()["services"] = json!([
        {"name": "api", "vip": "198.18.100.2:8080", "index": 0, "placement": "maglev",
         "pool": [{"server": 1, "weight": 1}], "placing": [1], "fail_open": false,
         "refusing": false, "retiring": false, "backend_down": []}
    ]);
    let (code, out, err) = ctl(&url, &admin, &["services"]);
    assert_eq!(code, 0, "{err}");
    let line = out.lines().find(|l| l.starts_with("api ")).unwrap();
    assert!(line.ends_with(" 1"), "{out}");
    endpoint.abort();
    inner.shutdown();
    running.stop().await;
}
