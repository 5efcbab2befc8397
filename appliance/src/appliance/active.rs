//! The API's view of an active/standby switchd pair: several switchd HTTP
//! endpoints, every live operation going to the one whose `/status` says
//! `"role": "active"`. The choice is re-probed at most once a second, and at
//! once after a call failed or a server listing came from the store (the
//! active died: the standby takes over within its takeover time, and the
//! next call finds it).

use std::collections::HashMap;
use std::net::Ipv4Addr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use capybara_api::control::{
    ConnectionFilter, ConnectionPage, ControlEvent, DataSource, DrainSpec, DrainView,
    MigrationMetrics, MigrationView, ServerStats, ServiceServing,
};
use capybara_api::problem::Problem;
use capybara_api::switchd::SwitchdControlPlane;
use capybara_api::ControlPlane;
use capybara_proto::flow::{FlowKey, ServerId};
use tokio::sync::broadcast;

const REPROBE: Duration = Duration::from_secs(1);

pub struct ActiveSwitchd {
    planes: Vec<Arc<SwitchdControlPlane>>,
    /// (index of the active, when it was probed).
    choice: Mutex<Option<(usize, Instant)>>,
    events: broadcast::Sender<ControlEvent>,
}

impl ActiveSwitchd {
    /// Must run inside a tokio runtime: it forwards every endpoint's events.
    pub fn new(planes: Vec<Arc<SwitchdControlPlane>>) -> Self {
        let (events, _) = broadcast::channel(256);
        for p in &planes {
            let mut rx = p.subscribe();
            let tx = events.clone();
            tokio::spawn(async move {
                loop {
                    match rx.recv().await {
                        Ok(ev) => {
                            let _ = tx.send(ev);
                        }
                        Err(broadcast::error::RecvError::Lagged(_)) => continue,
                        Err(broadcast::error::RecvError::Closed) => break,
                    }
                }
            });
        }
        ActiveSwitchd {
            planes,
            choice: Mutex::new(None),
            events,
        }
    }

    fn cached(&self) -> Option<usize> {
        let c = self.choice.lock().unwrap_or_else(|p| p.into_inner());
        c.filter(|(_, at)| at.elapsed() < REPROBE).map(|(i, _)| i)
    }

    fn forget(&self) {
        *self.choice.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }

    /// The active endpoint; a 503 naming every endpoint when none is.
    async fn active(&self) -> Result<&Arc<SwitchdControlPlane>, Problem> {
        if let Some(i) = self.cached() {
            return Ok(&self.planes[i]);
        }
        let mut seen = Vec::new();
        for (i, p) in self.planes.iter().enumerate() {
            match p.http().get("/status").await {
                Ok(body) => {
                    let role = serde_json::from_str::<serde_json::Value>(&body)
                        .ok()
                        .and_then(|v| v.get("role").and_then(|r| r.as_str()).map(String::from))
                        .unwrap_or_else(|| "unreadable /status".into());
                    if role == "active" {
                        *self.choice.lock().unwrap_or_else(|p| p.into_inner()) =
                            Some((i, Instant::now()));
                        return Ok(p);
                    }
                    seen.push(format!("{}: {role}", p.http().base()));
                }
                Err(e) => seen.push(format!("{}: {}", p.http().base(), e.detail)),
            }
        }
        Err(Problem::unavailable(format!(
            "no active switchd ({})",
            seen.join("; ")
        )))
    }

    /// Runs `f` on the active endpoint; after a failure, forgets the choice
    /// so that the next call probes again.
    async fn on_active<T, F>(&self, f: F) -> Result<T, Problem>
    where
        F: for<'a> FnOnce(
            &'a Arc<SwitchdControlPlane>,
        ) -> std::pin::Pin<
            Box<dyn std::future::Future<Output = Result<T, Problem>> + Send + 'a>,
        >,
    {
        let p = self.active().await?;
        let r = f(p).await;
        if r.as_ref().is_err_and(|e| e.status.is_server_error()) {
            self.forget();
        }
        r
    }
}

#[async_trait]
impl ControlPlane for ActiveSwitchd {
    fn name(&self) -> &'static str {
        "switchd"
    }
    fn data_source(&self) -> DataSource {
        DataSource::Switchd
    }
    async fn connections(&self, filter: &ConnectionFilter) -> Result<ConnectionPage, Problem> {
        // From the store: any endpoint answers the same.
        self.planes[0].connections(filter).await
    }
    async fn server_stats(&self) -> Result<HashMap<ServerId, ServerStats>, Problem> {
        if self.active().await.is_err() {
            // No endpoint is active (a takeover under way, or every switchd
            // down): the servers are still listed, from the store, as with
            // one switchd that does not answer (docs/OPERATIONS.md,
            // "Liveness and readiness of the API").
            return self.planes[0].server_stats_from_store().await;
        }
        let stats = self.on_active(|p| Box::pin(p.server_stats())).await?;
        if !stats.values().any(|s| s.data_source == DataSource::Store) {
            return Ok(stats);
        }
        // The endpoint chosen did not answer, and its plane answered from
        // the store instead of failing: it died since it was probed (a
        // takeover). Probe again now rather than at the next re-probe, up
        // to a second later, while the new active serves (before, the
        // servers were listed from the store for that second).
        self.forget();
        match self.active().await {
            Ok(p) => p.server_stats().await,
            Err(_) => self.planes[0].server_stats_from_store().await,
        }
    }
    async fn service_serving(&self) -> Option<HashMap<(Ipv4Addr, u16), ServiceServing>> {
        let p = self.active().await.ok()?;
        if let Some(v) = p.service_serving().await {
            return Some(v);
        }
        // The chosen endpoint did not answer: it may have died since it
        // was probed (a takeover). Probe again now, as server_stats does,
        // rather than show the services' data-plane view as unknown for up
        // to a second while the new active serves.
        self.forget();
        self.active().await.ok()?.service_serving().await
    }
    async fn services_status(&self) -> Option<capybara_api::control::ServicesStatus> {
        let p = self.active().await.ok()?;
        if let Some(v) = p.services_status().await {
            return Some(v);
        }
        self.forget();
        self.active().await.ok()?.services_status().await
    }
    async fn migrate(
        &self,
        conn: FlowKey,
        target: Option<ServerId>,
    ) -> Result<MigrationView, Problem> {
        self.on_active(move |p| Box::pin(p.migrate(conn, target)))
            .await
    }
    async fn recent_migrations(
        &self,
        after: u64,
        limit: usize,
    ) -> Result<Vec<MigrationView>, Problem> {
        // Every endpoint's log (kept by this API, whether its switchd is
        // up or not), merged: the endpoints share one id counter
        // (`MigrationIds`), so a takeover neither hides the old active's
        // migrations nor restarts the ids.
        let mut all = Vec::new();
        for p in &self.planes {
            all.extend(p.recent_migrations(after, limit).await?);
        }
        all.sort_by_key(|m| m.id);
        all.truncate(limit);
        Ok(all)
    }
    async fn start_drain(&self, server: ServerId, spec: DrainSpec) -> Result<DrainView, Problem> {
        self.on_active(move |p| Box::pin(p.start_drain(server, spec)))
            .await
    }
    async fn stop_drain(&self, server: ServerId) -> Result<(), Problem> {
        self.on_active(move |p| Box::pin(p.stop_drain(server)))
            .await
    }
    async fn drain_status(&self, server: ServerId) -> Result<Option<DrainView>, Problem> {
        self.planes[0].drain_status(server).await
    }
    fn subscribe(&self) -> broadcast::Receiver<ControlEvent> {
        self.events.subscribe()
    }
    fn migration_metrics(&self) -> MigrationMetrics {
        let idx = self.cached().unwrap_or(0);
        self.planes[idx].migration_metrics()
    }
    /// Every endpoint's own addresses (a standby's are the switch's too:
    /// it takes them over).
    fn switch_addrs(&self) -> Vec<(Ipv4Addr, String)> {
        let mut out: Vec<(Ipv4Addr, String)> = Vec::new();
        for (a, what) in self.planes.iter().flat_map(|p| p.switch_addrs()) {
            if !out.iter().any(|(b, _)| *b == a) {
                out.push((a, what));
            }
        }
        out
    }
    /// Reachable when an endpoint answers as the active one (live
    /// operations need it); every endpoint is probed at once, so the answer
    /// comes within `limit` however many are down.
    async fn probe_switchd(&self, limit: Duration) -> Option<Result<(), Problem>> {
        let probes: Vec<_> = self
            .planes
            .iter()
            .map(|p| {
                let http = p.http().clone();
                tokio::spawn(async move { http.probe(limit).await })
            })
            .collect();
        let mut seen = Vec::new();
        let mut active = false;
        for (p, probe) in self.planes.iter().zip(probes) {
            match probe.await {
                Ok(Ok(role)) if role == "active" => active = true,
                Ok(Ok(role)) => seen.push(format!("{}: {role}", p.http().base())),
                // The detail names the endpoint.
                Ok(Err(e)) => seen.push(e.detail),
                Err(e) => seen.push(format!("{}: probe failed: {e}", p.http().base())),
            }
        }
        Some(if active {
            Ok(())
        } else {
            Err(Problem::unavailable(format!(
                "no active switchd ({})",
                seen.join("; ")
            )))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use capybara_api::apidb::ApiDb;
    use capybara_api::control::StoreControlPlane;
    use capybara_store::{SqliteConfig, StoreConfig};

    /// A fresh SQLite store (and api.db) in a temp dir named `tag`, and
    /// the API's store-backed control plane over it.
    async fn store_plane(
        tag: &str,
    ) -> (
        std::path::PathBuf,
        Arc<dyn capybara_store::Store>,
        Arc<StoreControlPlane>,
    ) {
        let dir = std::env::temp_dir().join(format!("{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let store =
            capybara_store::open(&StoreConfig::Sqlite(SqliteConfig::at(dir.join("store.db"))))
                .await
                .unwrap();
        let db = Arc::new(ApiDb::open(&dir.join("api.db")).unwrap());
        let cp = StoreControlPlane::new(store.clone(), db).await.unwrap();
        (dir, store, cp)
    }

    /// With every endpoint down, GET /v1/servers still lists the servers
    /// (from the store) instead of failing with 503 `no active switchd`.
    #[tokio::test]
    async fn servers_are_listed_from_the_store_while_no_switchd_is_active() {
        let (dir, store, cp) = store_plane("capybara-active").await;
        let server: capybara_store::Server = serde_json::from_value(serde_json::json!({
            "id": 3, "name": "s3", "mgmt_addr": "198.18.1.13:7691", "data_addr": "198.18.2.13",
            "state": "active", "weight": 1, "registered_unix_ms": 1, "updated_unix_ms": 2
        }))
        .unwrap();
        store.put_server(&server).await.unwrap();
        // Nothing listens on port 1: both endpoints refuse at once.
        let planes = ["http://127.0.0.1:1", "http://127.0.0.2:1"]
            .iter()
            .map(|u| SwitchdControlPlane::new(cp.clone(), store.clone(), u).unwrap())
            .collect();
        let pair = ActiveSwitchd::new(planes);
        let stats = pair.server_stats().await.expect("servers from the store");
        let s3 = stats.get(&ServerId(3)).expect("server 3 listed");
        assert_eq!(s3.data_source, DataSource::Store);
        // Live operations still need an active switchd.
        let e = pair.stop_drain(ServerId(3)).await.unwrap_err();
        assert!(e.detail.contains("no active switchd"), "{}", e.detail);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A stand-in switchd's `GET /migrations`: one finished migration of
    /// `client`, reported by server `reporter` (every request gets the
    /// same page; at most 20 requests).
    fn fake_switchd(epoch: u32, reporter: u32, client: &str) -> String {
        fake_http(
            serde_json::json!({"epoch": epoch, "next": 2, "items": [{
                "seq": 1, "migration_id": (u64::from(reporter) << 32) | 1, "reporter": reporter,
                "role": "origin", "peer": 9, "client": client, "service": "198.18.100.1:7",
                "outcome": "migrated_out", "trigger": "manual", "finished_unix_ms": 1
            }]})
            .to_string(),
        )
    }

    /// A stand-in HTTP server answering `body` (JSON) to every request (at
    /// most 20); its URL.
    fn fake_http(body: String) -> String {
        use std::io::{Read, Write};
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", l.local_addr().unwrap());
        std::thread::spawn(move || {
            for _ in 0..20 {
                let Ok((mut s, _)) = l.accept() else { return };
                let mut buf = [0u8; 4096];
                let _ = s.read(&mut buf);
                let _ = write!(
                    s,
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
            }
        });
        url
    }

    /// The services' data-plane view (`serving` of GET /v1/services, the
    /// retiring list) follows a takeover at once: when the endpoint chosen
    /// as active stops answering, the pair probes again instead of showing
    /// the view as unknown until the next re-probe, up to a second later.
    #[tokio::test]
    async fn the_services_view_follows_a_takeover_at_once() {
        let (dir, store, cp) = store_plane("capybara-active-svc").await;
        let new_active = fake_http(
            serde_json::json!({"role": "active", "services": [
                {"name": "web", "vip": "198.18.100.1:80", "pool": [{"server": 1}],
                 "fail_open": false, "refusing": true}
            ]})
            .to_string(),
        );
        // The old active (nothing listens on port 1 any more) and the new.
        let planes = ["http://127.0.0.1:1", new_active.as_str()]
            .iter()
            .map(|u| SwitchdControlPlane::new(cp.clone(), store.clone(), u).unwrap())
            .collect();
        let pair = ActiveSwitchd::new(planes);
        let web = (Ipv4Addr::new(198, 18, 100, 1), 80);
        // Chosen as active just before it died.
        *pair.choice.lock().unwrap() = Some((0, Instant::now()));
        let v = pair.service_serving().await.expect("the new active's view");
        assert!(v[&web].served && v[&web].refusing, "{v:?}");
        *pair.choice.lock().unwrap() = Some((0, Instant::now()));
        let st = pair.services_status().await.expect("the new active's view");
        assert!(st.serving[&web].served);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// The endpoints of a pair share one id counter and the feed lists
    /// every endpoint's log: after a takeover the new active's migrations
    /// get ids above the old one's (a follower asking `after=N` sees
    /// them), and the old active's stay listed.
    #[tokio::test]
    async fn migration_ids_go_on_across_endpoints() {
        let (dir, store, cp) = store_plane("capybara-active-ids").await;
        let old_active = fake_switchd(1, 1, "198.18.0.11:40001");
        let new_active = fake_switchd(2, 2, "198.18.0.11:40002");
        let ids = capybara_api::switchd::MigrationIds::default();
        let planes: Vec<_> = [old_active, new_active]
            .iter()
            .map(|u| {
                SwitchdControlPlane::with_migration_ids(cp.clone(), store.clone(), u, ids.clone())
                    .unwrap()
            })
            .collect();
        // Each plane also polls in the background (which of the two
        // reports first is not up to the test): one counter numbers both
        // logs 1 and 2 (before, each endpoint's log started at 1), both are
        // listed, and a follower past the first id sees the second.
        planes[0].poll_reports_once().await.unwrap();
        planes[1].poll_reports_once().await.unwrap();
        let pair = ActiveSwitchd::new(planes);
        let all = pair.recent_migrations(0, 100).await.unwrap();
        let mut seen: Vec<(u64, String)> =
            all.iter().map(|m| (m.id, m.connection.clone())).collect();
        assert_eq!(
            seen.iter().map(|s| s.0).collect::<Vec<_>>(),
            vec![1, 2],
            "{seen:?}"
        );
        seen.sort_by(|a, b| a.1.cmp(&b.1));
        assert_eq!(
            seen.iter().map(|s| s.1.as_str()).collect::<Vec<_>>(),
            vec![
                "198.18.0.11:40001-198.18.100.1:7",
                "198.18.0.11:40002-198.18.100.1:7"
            ]
        );
        let after = pair.recent_migrations(1, 100).await.unwrap();
        assert_eq!(after.len(), 1, "{after:?}");
        assert_eq!(after[0].id, 2);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
