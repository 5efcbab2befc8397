//! `SwitchdControlPlane`: the `ControlPlane` backed by a running switchd.
//!
//! Persistence (drain records, their supervision, the stored flow mappings
//! used to list connections) is delegated to `StoreControlPlane`; live
//! operations go to switchd's HTTP endpoint (`metrics_listen`, e.g.
//! `http://127.0.0.1:9102`):
//! - per-server connection counts and load come from `GET /status`
//!   (`servers[].connections`, `servers[].load_pps`, reported by each
//!   server's heartbeats; `load` of the data plane when a server has not
//!   reported yet);
//! - drains are recorded in the store *and* sent to switchd with
//!   `POST /servers/<id>/drain?deadline_ms=N` (`/undrain` to stop);
//! - a migration is `POST /migrate?server=OWNER&client=IP:PORT&service=VIP:PORT[&target=IP]`
//!   to the connection's current owner (from the stored flow mapping); its
//!   outcome is followed from the store: `succeeded` once the mapping names
//!   another server, `timed_out` if it has not moved within
//!   `MIGRATION_WATCH`.
//!
//! An unreachable or failing switchd is a 503 problem naming the URL, never
//! a panic.

use std::collections::{HashMap, VecDeque};
use std::net::Ipv4Addr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use capybara_api_client::apis::configuration::Client;
use capybara_proto::flow::{FlowKey, ServerId};
use capybara_store::{unix_ms_now, ServerState, Store};
use serde::Deserialize;
use tokio::sync::broadcast;

use crate::control::{
    connection_id, ConnectionFilter, ConnectionPage, ControlEvent, ControlPlane, DataSource,
    DrainSpec, DrainView, Histogram, MigrationMetrics, MigrationPhases, MigrationView, ServerStats,
    StoreControlPlane, MIGRATION_OUTCOMES, MIGRATION_PHASES, PHASE_BUCKETS_SECONDS,
};
use crate::problem::Problem;

/// Time limit of one request to switchd.
const HTTP_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a requested migration is followed in the store.
const MIGRATION_WATCH: Duration = Duration::from_secs(5);
const MIGRATION_POLL: Duration = Duration::from_millis(100);
/// Migrations kept for `recent_migrations`.
const MIGRATION_LOG: usize = 1000;

/// One server of switchd's `/status` (only the fields the API uses).
#[derive(Debug, Clone, Deserialize)]
pub struct StatusServer {
    pub id: u32,
    #[serde(default)]
    pub state: String,
    /// Data-plane load of the last pool-monitor interval.
    #[serde(default)]
    pub load: Option<f64>,
    /// Reported by the server's heartbeats (null before the first one).
    #[serde(default)]
    pub connections: Option<u64>,
    #[serde(default)]
    pub load_pps: Option<f64>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct Status {
    #[serde(default)]
    pub servers: Vec<StatusServer>,
}

/// Parses switchd's `/status` body into per-server stats.
pub fn parse_status(body: &str) -> Result<HashMap<ServerId, ServerStats>, Problem> {
    let st: Status = serde_json::from_str(body).map_err(|e| {
        Problem::unavailable(format!("switchd returned an unreadable /status: {e}"))
    })?;
    Ok(st
        .servers
        .into_iter()
        .map(|s| {
            let stats = ServerStats {
                data_source: DataSource::Switchd,
                connections: s.connections.unwrap_or(0),
                load_pps: s.load_pps.or(s.load),
            };
            (ServerId(s.id), stats)
        })
        .collect())
}

/// The query of switchd's `POST /migrate`.
pub fn migrate_path(owner: ServerId, conn: &FlowKey, target: Option<Ipv4Addr>) -> String {
    let mut p = format!(
        "/migrate?server={}&client={}:{}&service={}:{}",
        owner.0, conn.client_ip, conn.client_port, conn.service_ip, conn.service_port
    );
    if let Some(t) = target {
        p.push_str(&format!("&target={t}"));
    }
    p
}

/// A minimal client of switchd's HTTP endpoint.
#[derive(Clone)]
pub struct SwitchdHttp {
    base: String,
    client: Client,
}

impl SwitchdHttp {
    /// `base`: `http://HOST:PORT` (a trailing `/` is ignored).
    pub fn new(base: &str) -> Result<Self, Problem> {
        let base = base.trim_end_matches('/').to_string();
        if !base.starts_with("http://") {
            return Err(Problem::internal(format!(
                "switchd URL must be http://HOST:PORT, got {base:?}"
            )));
        }
        let client = Client::builder()
            .timeout(HTTP_TIMEOUT)
            .connect_timeout(HTTP_TIMEOUT)
            .no_proxy()
            .build()
            .map_err(|e| Problem::internal(format!("building the switchd HTTP client: {e}")))?;
        Ok(SwitchdHttp { base, client })
    }

    pub fn base(&self) -> &str {
        &self.base
    }

    fn unreachable(&self, what: &str, e: impl std::fmt::Display) -> Problem {
        Problem::unavailable(format!(
            "switchd at {} is unreachable ({what}): {e}",
            self.base
        ))
    }

    async fn send(&self, post: bool, path: &str) -> Result<String, Problem> {
        let what = format!("{} {path}", if post { "POST" } else { "GET" });
        let url = format!("{}{path}", self.base);
        let req = if post {
            self.client.post(url)
        } else {
            self.client.get(url)
        };
        let resp = req.send().await.map_err(|e| self.unreachable(&what, e))?;
        let status = resp.status().as_u16();
        let body = resp.text().await.map_err(|e| self.unreachable(&what, e))?;
        if !(200..300).contains(&status) {
            return Err(Problem::unavailable(format!(
                "switchd at {} refused {what}: HTTP {status}: {}",
                self.base,
                body.trim()
            )));
        }
        Ok(body)
    }

    pub async fn get(&self, path: &str) -> Result<String, Problem> {
        self.send(false, path).await
    }

    pub async fn post(&self, path: &str) -> Result<String, Problem> {
        self.send(true, path).await
    }

    pub async fn server_stats(&self) -> Result<HashMap<ServerId, ServerStats>, Problem> {
        parse_status(&self.get("/status").await?)
    }
}

struct MigrationLog {
    next_id: u64,
    items: VecDeque<MigrationView>,
}

pub struct SwitchdControlPlane {
    inner: Arc<StoreControlPlane>,
    store: Arc<dyn Store>,
    http: SwitchdHttp,
    events: broadcast::Sender<ControlEvent>,
    log: Arc<Mutex<MigrationLog>>,
}

impl SwitchdControlPlane {
    pub fn new(
        inner: Arc<StoreControlPlane>,
        store: Arc<dyn Store>,
        switchd_url: &str,
    ) -> Result<Arc<Self>, Problem> {
        let (events, _) = broadcast::channel(256);
        Ok(Arc::new(SwitchdControlPlane {
            inner,
            store,
            http: SwitchdHttp::new(switchd_url)?,
            events,
            log: Arc::new(Mutex::new(MigrationLog {
                next_id: 1,
                items: VecDeque::new(),
            })),
        }))
    }

    pub fn http(&self) -> &SwitchdHttp {
        &self.http
    }

    fn record(&self, m: &MigrationView) {
        let mut log = self.log.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(old) = log.items.iter_mut().find(|x| x.id == m.id) {
            *old = m.clone();
        } else {
            log.items.push_back(m.clone());
            while log.items.len() > MIGRATION_LOG {
                log.items.pop_front();
            }
        }
        drop(log);
        let _ = self.events.send(ControlEvent::Migration(m.clone()));
    }

    /// Follows a requested migration in the store until the mapping moves.
    fn watch(self: &Arc<Self>, conn: FlowKey, owner: ServerId, view: MigrationView) {
        let me = Arc::clone(self);
        tokio::spawn(async move {
            let start = std::time::Instant::now();
            let mut v = view;
            loop {
                tokio::time::sleep(MIGRATION_POLL).await;
                match me.store.get_flow(&conn).await {
                    Ok(Some(s)) if s != owner => {
                        v.outcome = "succeeded";
                        v.target = Some(s.0);
                        break;
                    }
                    Ok(None) => {
                        v.outcome = "aborted";
                        v.reason = Some("the connection closed".into());
                        break;
                    }
                    _ => {}
                }
                if start.elapsed() >= MIGRATION_WATCH {
                    v.outcome = "timed_out";
                    v.reason = Some(format!(
                        "still on server {} after {:?}",
                        owner.0, MIGRATION_WATCH
                    ));
                    break;
                }
            }
            let now = unix_ms_now();
            v.finished_unix_ms = Some(now);
            v.phases.total_us = Some(now.saturating_sub(v.started_unix_ms) * 1000);
            me.record(&v);
        });
    }
}

#[async_trait]
impl ControlPlane for Arc<SwitchdControlPlane> {
    fn name(&self) -> &'static str {
        "switchd"
    }
    fn data_source(&self) -> DataSource {
        DataSource::Switchd
    }

    /// switchd's `/status` has counts, not 4-tuples: the list comes from the
    /// flow mappings switchd persists in the store.
    async fn connections(&self, filter: &ConnectionFilter) -> Result<ConnectionPage, Problem> {
        self.inner.connections(filter).await
    }

    async fn server_stats(&self) -> Result<HashMap<ServerId, ServerStats>, Problem> {
        let mut out = self.http.server_stats().await?;
        for s in self.store.list_servers().await? {
            out.entry(s.id).or_insert(ServerStats {
                data_source: DataSource::Switchd,
                connections: 0,
                load_pps: None,
            });
        }
        Ok(out)
    }

    async fn migrate(
        &self,
        conn: FlowKey,
        target: Option<ServerId>,
    ) -> Result<MigrationView, Problem> {
        let Some(owner) = self.store.get_flow(&conn).await? else {
            return Err(Problem::not_found(format!(
                "connection {} not found",
                connection_id(&conn)
            )));
        };
        let target_ip = match target {
            None => None,
            Some(t) => {
                let Some(ts) = self.store.get_server(t).await? else {
                    return Err(Problem::invalid(
                        "target",
                        format!("server {} is not registered", t.0),
                    ));
                };
                if t == owner {
                    return Err(Problem::conflict(format!(
                        "connection is already on server {}",
                        t.0
                    )));
                }
                if ts.state != ServerState::Active {
                    return Err(Problem::conflict(format!(
                        "target server {} is {}, not active",
                        t.0,
                        ts.state.as_str()
                    )));
                }
                Some(ts.data_addr)
            }
        };
        self.http
            .post(&migrate_path(owner, &conn, target_ip))
            .await?;
        let id = {
            let mut log = self.log.lock().unwrap_or_else(|p| p.into_inner());
            let id = log.next_id;
            log.next_id += 1;
            id
        };
        let view = MigrationView {
            id,
            connection: connection_id(&conn),
            origin: owner.0,
            target: target.map(|t| t.0),
            outcome: "in_progress",
            trigger: "manual",
            reason: None,
            started_unix_ms: unix_ms_now(),
            finished_unix_ms: None,
            phases: MigrationPhases::default(),
        };
        self.record(&view);
        self.watch(conn, owner, view.clone());
        Ok(view)
    }

    async fn recent_migrations(
        &self,
        after: u64,
        limit: usize,
    ) -> Result<Vec<MigrationView>, Problem> {
        let log = self.log.lock().unwrap_or_else(|p| p.into_inner());
        let mut v: Vec<MigrationView> =
            log.items.iter().filter(|m| m.id > after).cloned().collect();
        v.sort_by_key(|m| m.id);
        v.truncate(limit);
        Ok(v)
    }

    async fn start_drain(&self, server: ServerId, spec: DrainSpec) -> Result<DrainView, Problem> {
        let deadline_ms = spec.deadline.as_millis().min(u32::MAX as u128);
        // Validates and records the drain (the server is `draining` in the store).
        let view = self.inner.start_drain(server, spec).await?;
        if let Err(p) = self
            .http
            .post(&format!(
                "/servers/{}/drain?deadline_ms={deadline_ms}",
                server.0
            ))
            .await
        {
            // Not started on the data plane: do not leave a recorded drain behind.
            if let Err(e) = self.inner.stop_drain(server).await {
                tracing::warn!(server = %server, error = %e, "rolling back a drain switchd refused");
            }
            return Err(p);
        }
        Ok(view)
    }

    async fn stop_drain(&self, server: ServerId) -> Result<(), Problem> {
        self.inner.stop_drain(server).await?;
        self.http
            .post(&format!("/servers/{}/undrain", server.0))
            .await?;
        Ok(())
    }

    async fn drain_status(&self, server: ServerId) -> Result<Option<DrainView>, Problem> {
        self.inner.drain_status(server).await
    }

    fn subscribe(&self) -> broadcast::Receiver<ControlEvent> {
        self.events.subscribe()
    }

    fn migration_metrics(&self) -> MigrationMetrics {
        let mut m = MigrationMetrics::default();
        for o in MIGRATION_OUTCOMES {
            m.by_outcome.insert(o, 0);
        }
        let mut total = Histogram {
            buckets: PHASE_BUCKETS_SECONDS.iter().map(|b| (*b, 0)).collect(),
            sum: 0.0,
            count: 0,
        };
        for x in self
            .log
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .items
            .iter()
        {
            if let Some(n) = m.by_outcome.get_mut(x.outcome) {
                *n += 1;
            }
            if let Some(us) = x.phases.total_us {
                let s = us as f64 / 1e6;
                total.sum += s;
                total.count += 1;
                for (b, c) in total.buckets.iter_mut() {
                    if s <= *b {
                        *c += 1;
                    }
                }
            }
        }
        for p in MIGRATION_PHASES {
            let h = if p == "total" {
                total.clone()
            } else {
                Histogram {
                    buckets: PHASE_BUCKETS_SECONDS.iter().map(|b| (*b, 0)).collect(),
                    sum: 0.0,
                    count: 0,
                }
            };
            m.phase_histograms.insert(p, h);
        }
        m
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    const STATUS: &str = r#"{
      "role": "active", "epoch": 3,
      "servers": [
        {"id": 1, "index": 0, "data_addr": "198.18.2.11", "mac": "02:00:00:00:00:01", "weight": 1,
         "state": "alive", "load": 120, "mgmt_addr": "198.18.1.11:7692", "connections": 42,
         "load_pps": 9000, "migrations_in_flight": 0, "rx_backlog_bytes": 0, "draining_acked": false},
        {"id": 2, "index": 1, "data_addr": "198.18.2.12", "mac": "02:00:00:00:00:02", "weight": 1,
         "state": "alive", "load": 7, "mgmt_addr": null, "connections": null, "load_pps": null,
         "migrations_in_flight": null, "rx_backlog_bytes": null, "draining_acked": null}
      ],
      "flows": 42, "dataplane": {"fwd_prepare_ack": 0}
    }"#;

    #[test]
    fn status_maps_to_server_stats() {
        let m = parse_status(STATUS).unwrap();
        assert_eq!(m.len(), 2);
        let s1 = m[&ServerId(1)];
        assert_eq!(s1.connections, 42);
        assert_eq!(s1.load_pps, Some(9000.0));
        assert_eq!(s1.data_source, DataSource::Switchd);
        // Not reported by heartbeats yet: zero connections, data-plane load.
        let s2 = m[&ServerId(2)];
        assert_eq!(s2.connections, 0);
        assert_eq!(s2.load_pps, Some(7.0));
        assert!(parse_status(r#"{"servers": []}"#).unwrap().is_empty());
        assert!(parse_status("{}").unwrap().is_empty());
    }

    #[test]
    fn unreadable_status_is_a_503() {
        let p = parse_status("not json").unwrap_err();
        assert_eq!(p.status.as_u16(), 503);
        let p = parse_status(r#"{"servers": [{"id": "x"}]}"#).unwrap_err();
        assert_eq!(p.status.as_u16(), 503);
    }

    #[test]
    fn migrate_request_names_owner_flow_and_target() {
        let k = FlowKey {
            client_ip: Ipv4Addr::new(198, 18, 0, 11),
            client_port: 40000,
            service_ip: Ipv4Addr::new(198, 18, 100, 1),
            service_port: 80,
        };
        assert_eq!(
            migrate_path(ServerId(2), &k, None),
            "/migrate?server=2&client=198.18.0.11:40000&service=198.18.100.1:80"
        );
        assert_eq!(
            migrate_path(ServerId(2), &k, Some(Ipv4Addr::new(198, 18, 2, 13))),
            "/migrate?server=2&client=198.18.0.11:40000&service=198.18.100.1:80&target=198.18.2.13"
        );
    }

    #[test]
    fn bad_urls_are_refused() {
        assert!(SwitchdHttp::new("127.0.0.1:9102").is_err());
        assert_eq!(
            SwitchdHttp::new("http://127.0.0.1:9102/").unwrap().base(),
            "http://127.0.0.1:9102"
        );
    }

    #[tokio::test]
    async fn unreachable_switchd_is_a_503_problem() {
        // A port nobody listens on.
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        drop(l);
        let h = SwitchdHttp::new(&format!("http://127.0.0.1:{port}")).unwrap();
        let p = h.server_stats().await.unwrap_err();
        assert_eq!(p.status.as_u16(), 503);
        assert!(p.detail.contains("unreachable"), "{}", p.detail);
        let p = h.post("/servers/1/drain?deadline_ms=10").await.unwrap_err();
        assert_eq!(p.status.as_u16(), 503);
    }

    /// A fake switchd answering like the real one (HTTP/1.1, Connection: close).
    async fn fake_switchd(
        answers: Vec<(&'static str, String)>,
    ) -> (String, tokio::task::JoinHandle<Vec<String>>) {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", l.local_addr().unwrap());
        let h = tokio::spawn(async move {
            let mut seen = Vec::new();
            for (code, body) in answers {
                let (mut c, _) = l.accept().await.unwrap();
                let mut buf = vec![0u8; 4096];
                let mut n = 0;
                while !buf[..n].windows(4).any(|w| w == b"\r\n\r\n") {
                    let k = c.read(&mut buf[n..]).await.unwrap();
                    if k == 0 {
                        break;
                    }
                    n += k;
                }
                let head = String::from_utf8_lossy(&buf[..n]).to_string();
                seen.push(head.lines().next().unwrap_or("").to_string());
                let resp = format!(
                    "HTTP/1.1 {code}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
                c.write_all(resp.as_bytes()).await.unwrap();
            }
            seen
        });
        (url, h)
    }

    #[tokio::test]
    async fn talks_to_a_switchd_endpoint() {
        let (url, h) = fake_switchd(vec![
            ("200 OK", STATUS.to_string()),
            ("202 Accepted", "accepted\n".into()),
            ("400 Bad Request", "bad deadline_ms\n".into()),
        ])
        .await;
        let c = SwitchdHttp::new(&url).unwrap();
        let m = c.server_stats().await.unwrap();
        assert_eq!(m[&ServerId(1)].connections, 42);
        c.post("/servers/3/drain?deadline_ms=500").await.unwrap();
        let p = c.post("/servers/3/drain?deadline_ms=x").await.unwrap_err();
        assert_eq!(p.status.as_u16(), 503);
        assert!(
            p.detail.contains("HTTP 400") && p.detail.contains("bad deadline_ms"),
            "{}",
            p.detail
        );
        let seen = h.await.unwrap();
        assert_eq!(seen[0], "GET /status HTTP/1.1");
        assert_eq!(seen[1], "POST /servers/3/drain?deadline_ms=500 HTTP/1.1");
    }
}
