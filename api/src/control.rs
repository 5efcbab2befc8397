//! The API's seam to live operations: the `ControlPlane` trait, and
//! `StoreControlPlane`, the implementation that works from the store alone.
//!
//! What `StoreControlPlane` knows, honestly:
//! - connections are the flow-to-server mappings switchd persisted in the
//!   store (they lag the data plane by up to one flow-writer batch);
//! - load is unknown (`load_pps: null`), no migration ever happens, so the
//!   migration list is empty and `migrate` answers 503;
//! - drains are real state machines: the server's `Drain` record says it
//!   is drained (shown `draining`, then `drained`; switchd reads it when it
//!   syncs), apart from its liveness in the server record; progress is
//!   recomputed from the stored mappings, a drain completes when none is
//!   left, and at the deadline `force` mode deletes the remaining mappings
//!   (a switchd implementation resets those connections) while `migrate`
//!   mode stops with `timed_out`, leaving them untouched.
//!
//! The switchd-backed implementation replaces all of this with live data.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::Ipv4Addr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use capybara_proto::flow::{FlowKey, ServerId};
use capybara_store::{
    shown_state, unix_ms_now, Drain, DrainProgress, DrainState, FlowOp, Server, ServerState, Store,
};
use serde::Serialize;
use tokio::sync::broadcast;

use crate::apidb::{ApiDb, DrainMode};
use crate::problem::Problem;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DataSource {
    Switchd,
    Store,
}

/// `CLIENT_IP:PORT-VIP:PORT`.
pub fn connection_id(k: &FlowKey) -> String {
    format!(
        "{}:{}-{}:{}",
        k.client_ip, k.client_port, k.service_ip, k.service_port
    )
}

pub fn parse_connection_id(s: &str) -> Option<FlowKey> {
    let (c, v) = s.split_once('-')?;
    let (cip, cport) = c.rsplit_once(':')?;
    let (vip, vport) = v.rsplit_once(':')?;
    Some(FlowKey {
        client_ip: cip.parse::<Ipv4Addr>().ok()?,
        client_port: cport.parse().ok()?,
        service_ip: vip.parse::<Ipv4Addr>().ok()?,
        service_port: vport.parse().ok()?,
    })
}

#[derive(Debug, Clone, Serialize)]
pub struct ConnectionView {
    pub id: String,
    pub client_ip: String,
    pub client_port: u16,
    pub vip: String,
    pub port: u16,
    pub service: Option<String>,
    pub server: u32,
}

#[derive(Debug, Clone, Default)]
pub struct ConnectionFilter {
    pub server: Option<ServerId>,
    /// (vip, port) of the service to match: its address, and those it
    /// still retires (a deleted service, or one whose VIP or port changed).
    pub service: Option<Vec<(Ipv4Addr, u16)>>,
    pub limit: usize,
}

#[derive(Debug, Clone, Serialize)]
pub struct ConnectionPage {
    pub items: Vec<ConnectionView>,
    pub total: u64,
    pub truncated: bool,
    pub data_source: DataSource,
}

#[derive(Debug, Clone, Copy, Serialize)]
pub struct ServerStats {
    pub data_source: DataSource,
    pub connections: u64,
    pub load_pps: Option<f64>,
    /// Services of the server whose application its health checks report
    /// down (None: the server does not report application health, or the
    /// source does not know).
    pub apps_down: Option<u32>,
    /// switchd's liveness of the server; `None` when the source does not
    /// know (the store, or a server switchd does not hold). Shown as the
    /// server's `liveness`.
    #[serde(skip)]
    pub live: Option<SwitchdLiveness>,
}

/// How switchd hears a server's hostagent, from its `/status` (`state`,
/// `leaving`, `stopped`; `StatusServer::liveness` says which wins).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SwitchdLiveness {
    /// Registered and sending heartbeats (`live` or `draining`).
    Live,
    /// Heard, its hostagent is stopping: it migrates its connections away
    /// before it exits and takes no new one (`leaving`).
    Stopping,
    /// Missed its heartbeats (`dead`).
    Dead,
    /// Its hostagent stopped cleanly: its last heartbeat said so (`dead`
    /// and `stopped`).
    Stopped,
}

#[derive(Debug, Clone, Serialize, Default)]
pub struct MigrationPhases {
    pub prepare_us: Option<u64>,
    pub export_us: Option<u64>,
    pub transfer_us: Option<u64>,
    pub import_us: Option<u64>,
    pub total_us: Option<u64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct MigrationView {
    pub id: u64,
    pub connection: String,
    pub origin: u32,
    pub target: Option<u32>,
    /// in_progress | succeeded | rejected | aborted | timed_out
    pub outcome: &'static str,
    /// manual | drain | proactive | reactive | churn | unknown
    pub trigger: &'static str,
    pub reason: Option<String>,
    pub started_unix_ms: u64,
    pub finished_unix_ms: Option<u64>,
    pub phases: MigrationPhases,
}

#[derive(Debug, Clone, Serialize)]
pub struct DrainView {
    pub server: u32,
    pub state: DrainState,
    pub mode: DrainMode,
    pub targets: Vec<u32>,
    pub started_unix_ms: u64,
    pub deadline_unix_ms: u64,
    pub progress: DrainProgress,
    pub remaining: Vec<String>,
    pub remaining_truncated: bool,
}

#[derive(Debug, Clone)]
pub struct DrainSpec {
    pub deadline: Duration,
    pub mode: DrainMode,
    pub targets: Vec<ServerId>,
}

/// Counters for `/metrics`: migrations by outcome and per-phase latency
/// histograms (seconds; cumulative bucket counts, sum, count).
#[derive(Debug, Clone, Default)]
pub struct MigrationMetrics {
    pub by_outcome: BTreeMap<&'static str, u64>,
    pub phase_histograms: BTreeMap<&'static str, Histogram>,
}

#[derive(Debug, Clone, Default)]
pub struct Histogram {
    /// (upper bound in seconds, cumulative count)
    pub buckets: Vec<(f64, u64)>,
    pub sum: f64,
    pub count: u64,
}

pub const MIGRATION_OUTCOMES: [&str; 4] = ["succeeded", "rejected", "aborted", "timed_out"];
pub const MIGRATION_PHASES: [&str; 5] = ["prepare", "export", "transfer", "import", "total"];
pub const PHASE_BUCKETS_SECONDS: [f64; 10] =
    [1e-6, 5e-6, 1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 1e-2, 1e-1];

/// What the control plane pushes to event subscribers.
#[derive(Debug, Clone)]
pub enum ControlEvent {
    Migration(MigrationView),
}

/// Live operations the API needs from the switch control plane.
#[async_trait]
pub trait ControlPlane: Send + Sync + 'static {
    /// `store` or `switchd`.
    fn name(&self) -> &'static str;
    fn data_source(&self) -> DataSource;
    async fn connections(&self, filter: &ConnectionFilter) -> Result<ConnectionPage, Problem>;
    /// Per-server connection counts and load; servers without connections
    /// may be absent.
    async fn server_stats(&self) -> Result<HashMap<ServerId, ServerStats>, Problem>;
    /// Starts migrating `conn` to `target` (or a switch-picked target).
    async fn migrate(
        &self,
        conn: FlowKey,
        target: Option<ServerId>,
    ) -> Result<MigrationView, Problem>;
    /// Migrations with `id > after`, oldest first, at most `limit`.
    async fn recent_migrations(
        &self,
        after: u64,
        limit: usize,
    ) -> Result<Vec<MigrationView>, Problem>;
    /// Starts a drain: its record is `running` (the server shown
    /// `draining`) when this returns.
    async fn start_drain(&self, server: ServerId, spec: DrainSpec) -> Result<DrainView, Problem>;
    /// Cancels the server's drain (running, timed out or completed: it no
    /// longer holds the server) and clears a drain state a previous
    /// version wrote in the server record.
    async fn stop_drain(&self, server: ServerId) -> Result<(), Problem>;
    /// The current or last drain of the server.
    async fn drain_status(&self, server: ServerId) -> Result<Option<DrainView>, Problem>;
    fn subscribe(&self) -> broadcast::Receiver<ControlEvent>;
    fn migration_metrics(&self) -> MigrationMetrics;
    /// Readiness (`GET /readyz`): whether switchd's control endpoint
    /// answers, within about `limit` (never longer: a readiness probe must
    /// answer while switchd is down). `None`: this control plane has no
    /// switchd (the store-only one).
    async fn probe_switchd(&self, limit: Duration) -> Option<Result<(), Problem>> {
        let _ = limit;
        None
    }
    /// The switch's own addresses switchd last reported in `/status`
    /// (`control_listen`, its interfaces' IPv4 addresses), each with what
    /// it is: refused as a service VIP or server data address, with the
    /// API's configured `SwitchAddrs`. Empty: no switchd, or not heard yet.
    fn switch_addrs(&self) -> Vec<(Ipv4Addr, String)> {
        Vec::new()
    }
    /// What the data plane does with each service it serves, by VIP:port
    /// (switchd's `/status`). `None`: no switchd, or it did not answer.
    async fn service_serving(&self) -> Option<HashMap<(Ipv4Addr, u16), ServiceServing>> {
        None
    }
    /// What `GET /v1/services` shows from switchd: `service_serving` and
    /// the deleted services it still serves connections of, from one
    /// `/status`. `None`: no switchd, or it did not answer. The default
    /// (a control plane that only knows `service_serving`) lists no
    /// retiring services (`retiring: None`, absent in the answer).
    async fn services_status(&self) -> Option<ServicesStatus> {
        self.service_serving().await.map(|serving| ServicesStatus {
            serving,
            retiring: None,
            refused: Vec::new(),
        })
    }
}

/// switchd's view of the services: the served ones by VIP:port, and the
/// retiring ones (deleted, open connections still served).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ServicesStatus {
    pub serving: HashMap<(Ipv4Addr, u16), ServiceServing>,
    /// `None`: this control plane cannot tell.
    pub retiring: Option<Vec<RetiringService>>,
    /// Stored services switchd read and does not serve, and why
    /// (`refused_services` in its `/status`; empty from a switchd too old
    /// to say).
    pub refused: Vec<RefusedService>,
}

impl ServicesStatus {
    /// What switchd does with stored service `s`: refused (read, not
    /// served: the reason), applied (it serves its VIP:port), or pending
    /// (not read yet: switchd reads the store's services every 250 ms).
    /// A refusal wins over a VIP:port served under another name (a
    /// service refused because another one has its address).
    pub fn view_of(&self, s: &capybara_store::Service) -> ServiceServing {
        if let Some(r) = self
            .refused
            .iter()
            .find(|r| r.name == s.name && r.vip == s.vip && r.port == s.port)
        {
            return ServiceServing {
                state: Some(ApplyState::Refused),
                refused_reason: Some(r.reason.clone()),
                ..ServiceServing::default()
            };
        }
        match self.serving.get(&(s.vip, s.port)) {
            Some(v) => v.clone(),
            None => ServiceServing {
                state: Some(ApplyState::Pending),
                ..ServiceServing::default()
            },
        }
    }
}

/// A stored service switchd does not serve, and why (a VIP:port or name
/// used twice, no free service slot, the data plane did not take it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RefusedService {
    pub name: String,
    pub vip: Ipv4Addr,
    pub port: u16,
    pub reason: String,
}

/// Whether switchd applied a stored service (`ServiceServing.state`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ApplyState {
    /// It serves the service's VIP:port.
    Applied,
    /// It has not read it yet (within about a second of a change).
    Pending,
    /// It read it and does not serve it (`refused_reason`).
    Refused,
}

/// A deleted service switchd keeps retiring (`RetiringService` in the API).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RetiringService {
    pub name: String,
    pub vip: String,
    pub port: u16,
    /// Since switchd saw the delete.
    pub retiring_for_ms: u64,
    /// Its flows at switchd's last complete pass (absent before the first).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub connections: Option<u64>,
    /// Left before `service_retire_timeout_ms` ends the rest (absent when
    /// switchd does not report it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timeout_in_ms: Option<u64>,
}

/// switchd's view of one served service (`ServiceServing` in the API).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct ServiceServing {
    pub served: bool,
    /// The pool switchd resolved (dead, drained, weight-0 members included).
    pub members: Vec<u32>,
    /// Who takes new connections right now (switchd's placement tables);
    /// None from a switchd too old to say.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub placing: Option<Vec<u32>>,
    pub apps_down: Vec<u32>,
    pub fail_open: bool,
    pub refusing: bool,
    /// Members whose hostagent lists other services and not this VIP:port:
    /// placed on (named in the pool), they leave its new connections
    /// unanswered.
    pub not_serving: Vec<u32>,
    /// Applied, pending or refused ([`ServicesStatus::view_of`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub state: Option<ApplyState>,
    /// Why switchd refused it (with `state: refused` only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub refused_reason: Option<String>,
}

/// How often a drain supervisor re-reads the server's flows.
const DRAIN_POLL: Duration = Duration::from_millis(200);
const REMAINING_LISTED: usize = 1000;

/// The state `s` is shown in: its drain's while the operator's drain holds
/// it, else its record's liveness (`capybara_store::shown_state`).
pub async fn server_shown_state(store: &dyn Store, s: &Server) -> Result<ServerState, Problem> {
    let drain = store.get_drain(s.id).await?;
    Ok(shown_state(s, drain.map(|d| d.state)))
}

pub struct StoreControlPlane {
    store: Arc<dyn Store>,
    db: Arc<ApiDb>,
    events: broadcast::Sender<ControlEvent>,
    supervisors: Mutex<HashMap<ServerId, tokio::task::AbortHandle>>,
}

impl StoreControlPlane {
    /// Also resumes the supervision of drains left running by a previous
    /// process (their deadlines are wall-clock, so a restart loses nothing),
    /// after moving drains a previous version kept in the server records
    /// into drain records (`upgrade_legacy_drain_states`).
    pub async fn new(store: Arc<dyn Store>, db: Arc<ApiDb>) -> Result<Arc<Self>, Problem> {
        let moved = capybara_store::upgrade_legacy_drain_states(store.as_ref()).await?;
        if !moved.is_empty() {
            tracing::info!(servers = ?moved, "moved drains from server records to drain records");
        }
        let (events, _) = broadcast::channel(256);
        let cp = Arc::new(StoreControlPlane {
            store,
            db,
            events,
            supervisors: Mutex::new(HashMap::new()),
        });
        for d in cp.store.list_drains().await? {
            if d.state == DrainState::Running {
                cp.spawn_supervisor(d.server, d.started_unix_ms);
            }
        }
        Ok(cp)
    }

    /// Stops supervising drains in this process (they stay `running` in
    /// the store; the next `new` resumes them).
    pub fn shutdown(&self) {
        for (_, h) in self
            .supervisors
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .drain()
        {
            h.abort();
        }
    }

    fn spawn_supervisor(self: &Arc<Self>, server: ServerId, started: u64) {
        let me = Arc::clone(self);
        let handle = tokio::spawn(async move {
            // The server's flows at the previous step: a flow that left
            // since is `migrated` if the store maps it to another server
            // now, `closed` if it is gone.
            let mut prev: Option<HashSet<FlowKey>> = None;
            loop {
                match me.supervise_once(server, started, &mut prev).await {
                    Ok(true) => tokio::time::sleep(DRAIN_POLL).await,
                    Ok(false) => break,
                    Err(e) => {
                        tracing::warn!(server = %server, error = %e, "drain supervision step failed; retrying");
                        tokio::time::sleep(Duration::from_secs(1)).await;
                    }
                }
            }
        });
        if let Some(old) = self
            .supervisors
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(server, handle.abort_handle())
        {
            old.abort();
        }
    }

    /// One step of a drain; `Ok(false)` when the drain is over (or was
    /// cancelled or replaced).
    async fn supervise_once(
        &self,
        server: ServerId,
        started: u64,
        prev: &mut Option<HashSet<FlowKey>>,
    ) -> Result<bool, Problem> {
        let Some(d) = self.store.get_drain(server).await? else {
            return Ok(false);
        };
        if d.state != DrainState::Running || d.started_unix_ms != started {
            return Ok(false);
        }
        let flows = self.store.list_flows_by_server(server).await?;
        let remaining = flows.len() as u64;
        let mut progress = d.progress;
        progress.flows_remaining = remaining;
        let now_set: HashSet<FlowKey> = flows.iter().copied().collect();
        if let Some(before) = prev.as_ref() {
            for k in before.difference(&now_set) {
                match self.store.get_flow(k).await? {
                    Some(owner) if owner != server => progress.flows_migrated += 1,
                    _ => progress.flows_closed += 1,
                }
            }
        } else {
            // First step of this supervisor (drain start, or the API
            // restarted): flows that left while nobody watched are counted
            // as closed unless the persisted progress already has them.
            let accounted = remaining + progress.flows_migrated + progress.flows_closed;
            progress.flows_closed += progress.flows_total.saturating_sub(accounted);
        }
        *prev = Some(now_set);
        let now = unix_ms_now();
        if remaining == 0 {
            self.finish(server, progress, DrainState::Completed).await?;
            return Ok(false);
        }
        if now >= d.deadline_unix_ms {
            if self.db.drain_mode(server) == DrainMode::Force {
                // No data plane to reset them: forget the mappings, which
                // is what the switch does after it breaks the connections.
                let ops: Vec<FlowOp> = flows.iter().map(|k| FlowOp::Delete { key: *k }).collect();
                self.store.apply_flows(&ops).await?;
                progress.flows_closed += remaining;
                progress.flows_remaining = 0;
                self.finish(server, progress, DrainState::Completed).await?;
            } else {
                self.store
                    .update_drain(server, progress, DrainState::TimedOut)
                    .await?;
            }
            return Ok(false);
        }
        if progress != d.progress {
            self.store
                .update_drain(server, progress, DrainState::Running)
                .await?;
        }
        Ok(true)
    }

    async fn finish(
        &self,
        server: ServerId,
        progress: DrainProgress,
        state: DrainState,
    ) -> Result<(), Problem> {
        self.store.update_drain(server, progress, state).await?;
        Ok(())
    }

    async fn view(&self, d: Drain) -> Result<DrainView, Problem> {
        let (remaining, truncated) = if d.state == DrainState::TimedOut {
            let flows = self.store.list_flows_by_server(d.server).await?;
            let truncated = flows.len() > REMAINING_LISTED;
            (
                flows
                    .iter()
                    .take(REMAINING_LISTED)
                    .map(connection_id)
                    .collect(),
                truncated,
            )
        } else {
            (Vec::new(), false)
        };
        Ok(DrainView {
            server: d.server.0,
            state: d.state,
            mode: self.db.drain_mode(d.server),
            targets: d.targets.iter().map(|t| t.0).collect(),
            started_unix_ms: d.started_unix_ms,
            deadline_unix_ms: d.deadline_unix_ms,
            progress: d.progress,
            remaining,
            remaining_truncated: truncated,
        })
    }
}

#[async_trait]
impl ControlPlane for Arc<StoreControlPlane> {
    fn name(&self) -> &'static str {
        "store"
    }
    fn data_source(&self) -> DataSource {
        DataSource::Store
    }

    async fn connections(&self, filter: &ConnectionFilter) -> Result<ConnectionPage, Problem> {
        let services: HashMap<(Ipv4Addr, u16), String> = self
            .store
            .list_services()
            .await?
            .into_iter()
            .map(|s| ((s.vip, s.port), s.name))
            .collect();
        let flows: Vec<(FlowKey, ServerId)> = match filter.server {
            Some(s) => self
                .store
                .list_flows_by_server(s)
                .await?
                .into_iter()
                .map(|k| (k, s))
                .collect(),
            None => self
                .store
                .scan_flows()
                .await?
                .into_iter()
                .map(|m| (m.key, m.server))
                .collect(),
        };
        let matching: Vec<_> = flows
            .into_iter()
            .filter(|(k, _)| {
                filter
                    .service
                    .as_ref()
                    .is_none_or(|svc| svc.contains(&(k.service_ip, k.service_port)))
            })
            .collect();
        let total = matching.len() as u64;
        let items: Vec<_> = matching
            .into_iter()
            .take(filter.limit)
            .map(|(k, s)| ConnectionView {
                id: connection_id(&k),
                client_ip: k.client_ip.to_string(),
                client_port: k.client_port,
                vip: k.service_ip.to_string(),
                port: k.service_port,
                service: services.get(&(k.service_ip, k.service_port)).cloned(),
                server: s.0,
            })
            .collect();
        Ok(ConnectionPage {
            truncated: (items.len() as u64) < total,
            items,
            total,
            data_source: DataSource::Store,
        })
    }

    async fn server_stats(&self) -> Result<HashMap<ServerId, ServerStats>, Problem> {
        let mut out: HashMap<ServerId, ServerStats> = HashMap::new();
        for s in self.store.list_servers().await? {
            out.insert(
                s.id,
                ServerStats {
                    data_source: DataSource::Store,
                    connections: 0,
                    load_pps: None,
                    apps_down: None,
                    live: None,
                },
            );
        }
        for m in self.store.scan_flows().await? {
            out.entry(m.server)
                .or_insert(ServerStats {
                    data_source: DataSource::Store,
                    connections: 0,
                    load_pps: None,
                    apps_down: None,
                    live: None,
                })
                .connections += 1;
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
        if let Some(t) = target {
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
            let shown = server_shown_state(self.store.as_ref(), &ts).await?;
            if shown != ServerState::Active {
                return Err(Problem::conflict(format!(
                    "target server {} is {}, not active",
                    t.0,
                    shown.as_str()
                )));
            }
        }
        Err(Problem::unavailable(
            "no data plane is connected to this API (store-backed control plane): live connections cannot be migrated",
        ))
    }

    async fn recent_migrations(
        &self,
        _after: u64,
        _limit: usize,
    ) -> Result<Vec<MigrationView>, Problem> {
        Ok(Vec::new())
    }

    async fn start_drain(&self, server: ServerId, spec: DrainSpec) -> Result<DrainView, Problem> {
        let Some(s) = self.store.get_server(server).await? else {
            return Err(Problem::not_found(format!("server {} not found", server.0)));
        };
        // A dead server has nothing to drain; one drained before it died
        // may be drained again.
        if server_shown_state(self.store.as_ref(), &s).await? == ServerState::Dead {
            return Err(Problem::conflict(format!(
                "server {} is dead; it has no connections to drain",
                server.0
            )));
        }
        if let Some(d) = self.store.get_drain(server).await? {
            if d.state == DrainState::Running {
                let left_s = d
                    .deadline_unix_ms
                    .saturating_sub(unix_ms_now())
                    .div_ceil(1000);
                return Err(Problem::conflict(format!(
                    "server {} is already draining (deadline in {left_s} s); undrain it first",
                    server.0
                )));
            }
        }
        for (i, t) in spec.targets.iter().enumerate() {
            if *t == server {
                return Err(Problem::invalid(
                    format!("targets[{i}]"),
                    "a server cannot be its own drain target",
                ));
            }
            if self.store.get_server(*t).await?.is_none() {
                return Err(Problem::invalid(
                    format!("targets[{i}]"),
                    format!("server {} is not registered", t.0),
                ));
            }
        }
        // The drain record is the drain: no new connections from now on
        // (switchd is told by its caller, and reads it when it syncs).
        let total = self.store.list_flows_by_server(server).await?.len() as u64;
        let now = unix_ms_now();
        let drain = Drain {
            server,
            targets: spec.targets.clone(),
            started_unix_ms: now,
            deadline_unix_ms: now + spec.deadline.as_millis() as u64,
            state: DrainState::Running,
            progress: DrainProgress {
                flows_total: total,
                flows_migrated: 0,
                flows_closed: 0,
                flows_remaining: total,
            },
        };
        self.db
            .set_drain_mode(server, spec.mode)
            .map_err(|e| Problem::internal(e.to_string()))?;
        self.store.put_drain(&drain).await?;
        self.spawn_supervisor(server, now);
        self.view(drain).await
    }

    async fn stop_drain(&self, server: ServerId) -> Result<(), Problem> {
        let Some(s) = self.store.get_server(server).await? else {
            return Err(Problem::not_found(format!("server {} not found", server.0)));
        };
        // Whatever its liveness: an operator who finished the maintenance
        // of a dead server lifts its drain, and it re-enters placement
        // when its hostagent registers again (shown `dead` until then). A
        // dead server no drain holds has nothing to undo: answered as a
        // live one is (before, 409 "re-register it instead").
        if let Some(h) = self
            .supervisors
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&server)
        {
            h.abort();
        }
        // The drain (running, timed out or completed) no longer holds the
        // server: `cancelled`, kept as its last drain with its progress.
        if let Some(d) = self.store.get_drain(server).await? {
            if d.state != DrainState::Cancelled {
                self.store
                    .update_drain(server, d.progress, DrainState::Cancelled)
                    .await?;
            }
        }
        // A drain state a previous version wrote in the record (not moved
        // yet): the record goes back to liveness.
        if matches!(s.state, ServerState::Draining | ServerState::Drained) {
            self.store
                .set_server_state(server, ServerState::Active)
                .await?;
        }
        Ok(())
    }

    async fn drain_status(&self, server: ServerId) -> Result<Option<DrainView>, Problem> {
        match self.store.get_drain(server).await? {
            Some(d) => Ok(Some(self.view(d).await?)),
            None => Ok(None),
        }
    }

    fn subscribe(&self) -> broadcast::Receiver<ControlEvent> {
        self.events.subscribe()
    }

    fn migration_metrics(&self) -> MigrationMetrics {
        let mut m = MigrationMetrics::default();
        for o in MIGRATION_OUTCOMES {
            m.by_outcome.insert(o, 0);
        }
        for p in MIGRATION_PHASES {
            m.phase_histograms.insert(
                p,
                Histogram {
                    buckets: PHASE_BUCKETS_SECONDS.iter().map(|b| (*b, 0)).collect(),
                    sum: 0.0,
                    count: 0,
                },
            );
        }
        m
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connection_ids_round_trip() {
        let k = FlowKey {
            client_ip: Ipv4Addr::new(192, 0, 2, 10),
            client_port: 51000,
            service_ip: Ipv4Addr::new(10, 0, 0, 100),
            service_port: 80,
        };
        assert_eq!(connection_id(&k), "192.0.2.10:51000-10.0.0.100:80");
        assert_eq!(parse_connection_id(&connection_id(&k)), Some(k));
        assert_eq!(parse_connection_id("999.0.0.1:1-10.0.0.1:80"), None);
        assert_eq!(parse_connection_id("1.2.3.4:70000-10.0.0.1:80"), None);
    }
}
