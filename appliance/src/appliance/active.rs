//! The API's view of an active/standby switchd pair: several switchd HTTP
//! endpoints, every live operation going to the one whose `/status` says
//! `"role": "active"`. The choice is re-probed at most once a second, and at
//! once after a call failed (the active died: the standby takes over within
//! its takeover time, and the next call finds it).

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
        self.on_active(|p| Box::pin(p.server_stats())).await
    }
    async fn service_serving(&self) -> Option<HashMap<(Ipv4Addr, u16), ServiceServing>> {
        let p = self.active().await.ok()?;
        p.service_serving().await
    }
    async fn services_status(&self) -> Option<capybara_api::control::ServicesStatus> {
        let p = self.active().await.ok()?;
        p.services_status().await
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
        // Migration ids are per endpoint: the active one's log.
        self.on_active(move |p| Box::pin(p.recent_migrations(after, limit)))
            .await
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
