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
//! - every migration the servers finish (requested here, by a drain, by the
//!   proactive or reactive policy, by the hostagent's churn option) is
//!   reported by the origin (and the target) to switchd in MIGRATION_REPORT
//!   messages; a poller reads switchd's `GET /migrations?after=SEQ` every
//!   `REPORT_POLL` and merges them into the migration log with their
//!   trigger, outcome and phase timings (a requested migration's entry is
//!   completed by its report). Outcome counters and per-phase histograms
//!   for `/metrics` are cumulative, counted once per migration.
//!
//! An unreachable or failing switchd is a 503 problem naming the URL, never
//! a panic.

use std::collections::{BTreeMap, HashMap, VecDeque};
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
    connection_id, ApplyState, ConnectionFilter, ConnectionPage, ControlEvent, ControlPlane,
    DataSource, DrainSpec, DrainView, Histogram, MigrationMetrics, MigrationPhases, MigrationView,
    RefusedService, RetiringService, ServerStats, ServiceServing, ServicesStatus,
    StoreControlPlane, SwitchdLiveness, MIGRATION_OUTCOMES, MIGRATION_PHASES,
    PHASE_BUCKETS_SECONDS,
};
use crate::problem::Problem;

/// Time limit of one request to switchd.
const HTTP_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a requested migration is followed in the store.
const MIGRATION_WATCH: Duration = Duration::from_secs(5);
const MIGRATION_POLL: Duration = Duration::from_millis(100);
/// Migrations kept for `recent_migrations`.
const MIGRATION_LOG: usize = 1000;
/// How often switchd's reported migrations are polled.
const REPORT_POLL: Duration = Duration::from_millis(200);
/// Reports asked for per `/migrations` request.
const REPORT_PAGE: usize = 1000;
/// How often the switch's own addresses are read from switchd's `/status`.
const OWN_ADDRS_POLL: Duration = Duration::from_secs(2);
/// Target reports waiting for their origin's report (by migration id).
const PENDING_IMPORTS: usize = 4096;
/// Requested migrations waiting for their report.
const PENDING_MANUAL: usize = 1024;

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
    /// Its heartbeats report application health (switchd since 2026-11-23).
    #[serde(default)]
    pub health_reported: bool,
    #[serde(default)]
    pub backends: Vec<StatusBackend>,
    /// Its hostagent announced it is stopping (HEARTBEAT LEAVING); absent
    /// before switchd 2026-11-24, read as false.
    #[serde(default)]
    pub leaving: bool,
    /// Dead because its last hostagent said it stopped cleanly (HEARTBEAT
    /// STOPPED); false again once it registers. Absent before switchd
    /// 2026-11-24, read as false.
    #[serde(default)]
    pub stopped: bool,
}

impl StatusServer {
    /// switchd's liveness of the server; `None` when its `state` is
    /// missing. `state` is `live` or `draining` (a drain is the
    /// operator's, not liveness) or `dead`; a clean stop outranks a
    /// death, which outranks a stop in progress.
    pub fn liveness(&self) -> Option<SwitchdLiveness> {
        if self.state.is_empty() {
            return None;
        }
        Some(match (self.state == "dead", self.stopped, self.leaving) {
            (true, true, _) => SwitchdLiveness::Stopped,
            (true, false, _) => SwitchdLiveness::Dead,
            (false, _, true) => SwitchdLiveness::Stopping,
            (false, _, false) => SwitchdLiveness::Live,
        })
    }
}

/// One service of a server in switchd's `/status` (`servers[].backends`).
#[derive(Debug, Clone, Deserialize)]
pub struct StatusBackend {
    /// Whether its application is up (null: not reported).
    #[serde(default)]
    pub up: Option<bool>,
    /// The VIP:port its REGISTER lists (`0.0.0.0:PORT`: every VIP on PORT).
    #[serde(default)]
    pub service: Option<String>,
}

/// One served service of switchd's `/status` (`services[]`).
#[derive(Debug, Clone, Deserialize)]
pub struct StatusService {
    /// `VIP:port`.
    pub vip: String,
    #[serde(default)]
    pub pool: Vec<StatusPoolMember>,
    #[serde(default)]
    pub fail_open: bool,
    /// Every pool member is out for a lasting reason (drained, weight 0,
    /// dead past its grace): new connections are refused with a reset.
    #[serde(default)]
    pub refusing: bool,
    #[serde(default)]
    pub backend_down: Vec<u32>,
    /// The servers new connections are placed on right now (the members
    /// its placement tables are built from); absent from an older switchd.
    #[serde(default)]
    pub placing: Option<Vec<u32>>,
    /// Deleted, its open connections still served (none placed).
    #[serde(default)]
    pub retiring: bool,
    #[serde(default)]
    pub name: String,
    /// Retiring: since switchd saw the delete.
    #[serde(default)]
    pub retiring_for_ms: Option<u64>,
    /// Retiring: its flow entries at the last complete flow-table pass
    /// (null before the first).
    #[serde(default)]
    pub retiring_flows: Option<u64>,
    /// Retiring: left before `service_retire_timeout_ms` ends the rest
    /// (when this switchd reports it).
    #[serde(default)]
    pub retiring_left_ms: Option<u64>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct StatusPoolMember {
    pub server: u32,
}

#[derive(Debug, Clone, Deserialize)]
pub struct Status {
    #[serde(default)]
    pub servers: Vec<StatusServer>,
    #[serde(default)]
    pub services: Vec<StatusService>,
    /// Stored services it read and does not serve (absent from a switchd
    /// older than this field).
    #[serde(default)]
    pub refused_services: Vec<StatusRefusedService>,
}

/// One of switchd's `/status` `refused_services[]`.
#[derive(Debug, Clone, Deserialize)]
pub struct StatusRefusedService {
    pub name: String,
    /// `VIP:port`.
    pub vip: String,
    pub reason: String,
}

/// The switch's own addresses in switchd's `/status` (absent from a
/// switchd older than these fields: none).
#[derive(Debug, Clone, Deserialize)]
struct StatusOwnAddrs {
    #[serde(default)]
    control_listen: Option<String>,
    #[serde(default)]
    interface_addrs: Vec<StatusInterfaceAddr>,
}

#[derive(Debug, Clone, Deserialize)]
struct StatusInterfaceAddr {
    interface: String,
    addr: String,
}

/// Parses the switch's own addresses from switchd's `/status`: its
/// `control_listen` and its interfaces' IPv4 addresses, each with what it
/// is in the operator's words. Loopback and unspecified addresses are left
/// out (no VIP or data address can be one anyway).
pub fn parse_own_addrs(body: &str) -> Result<Vec<(Ipv4Addr, String)>, Problem> {
    let st: StatusOwnAddrs = serde_json::from_str(body).map_err(|e| {
        Problem::unavailable(format!("switchd returned an unreadable /status: {e}"))
    })?;
    let mut out: Vec<(Ipv4Addr, String)> = Vec::new();
    let mut add = |raw: &str, what: String| -> Result<(), Problem> {
        let a: Ipv4Addr = raw
            .parse()
            .or_else(|_| raw.parse::<std::net::SocketAddrV4>().map(|s| *s.ip()))
            .map_err(|_| {
                Problem::unavailable(format!(
                    "switchd's /status names {raw:?} as its own address: not an IPv4 address"
                ))
            })?;
        if !a.is_loopback() && !a.is_unspecified() && !out.iter().any(|(b, _)| *b == a) {
            out.push((a, what));
        }
        Ok(())
    };
    if let Some(c) = &st.control_listen {
        add(c, "switchd's control_listen".to_string())?;
    }
    for i in &st.interface_addrs {
        add(
            &i.addr,
            format!("an address of switchd's interface {}", i.interface),
        )?;
    }
    Ok(out)
}

/// Whether server `id`'s hostagent serves `vip` according to switchd's
/// `/status`: `Some(false)` when its REGISTER lists other services and not
/// this VIP:port (nor `0.0.0.0:PORT`): its stack has no listener there,
/// so a connection migrated to it cannot be imported. `None` when the
/// status does not say (unreadable, server absent, nothing listed).
pub fn server_serves(body: &str, id: u32, vip: std::net::SocketAddrV4) -> Option<bool> {
    let st: Status = serde_json::from_str(body).ok()?;
    let s = st.servers.iter().find(|s| s.id == id)?;
    let listed: Vec<std::net::SocketAddrV4> = s
        .backends
        .iter()
        .filter_map(|b| b.service.as_deref()?.parse().ok())
        .collect();
    if listed.is_empty() {
        return None;
    }
    Some(
        listed
            .iter()
            .any(|a| a.port() == vip.port() && (a.ip() == vip.ip() || a.ip().is_unspecified())),
    )
}

/// Parses the served services of switchd's `/status`, by VIP:port.
pub fn parse_status_services(
    body: &str,
) -> Result<HashMap<(Ipv4Addr, u16), ServiceServing>, Problem> {
    Ok(parse_services_status(body)?.serving)
}

/// Parses the services of switchd's `/status`: the served ones by VIP:port
/// and the retiring ones, ordered by name, then VIP:port.
pub fn parse_services_status(body: &str) -> Result<ServicesStatus, Problem> {
    let st: Status = serde_json::from_str(body).map_err(|e| {
        Problem::unavailable(format!("switchd returned an unreadable /status: {e}"))
    })?;
    let mut serving = HashMap::new();
    let mut retiring = Vec::new();
    // What each registered server's REGISTER lists (absent: it lists
    // nothing, so it serves every VIP, or switchd does not say).
    let listed: HashMap<u32, Vec<std::net::SocketAddrV4>> = st
        .servers
        .iter()
        .filter_map(|s| {
            let l: Vec<_> = s
                .backends
                .iter()
                .filter_map(|b| b.service.as_deref()?.parse().ok())
                .collect();
            (!l.is_empty()).then_some((s.id, l))
        })
        .collect();
    for s in st.services {
        let Ok(addr) = s.vip.parse::<std::net::SocketAddrV4>() else {
            continue;
        };
        if s.retiring {
            retiring.push(RetiringService {
                name: s.name,
                vip: addr.ip().to_string(),
                port: addr.port(),
                retiring_for_ms: s.retiring_for_ms.unwrap_or(0),
                connections: s.retiring_flows,
                timeout_in_ms: s.retiring_left_ms,
            });
            continue;
        }
        let serves = |l: &Vec<std::net::SocketAddrV4>| {
            l.iter().any(|a| {
                a.port() == addr.port() && (a.ip() == addr.ip() || a.ip().is_unspecified())
            })
        };
        let view = ServiceServing {
            served: true,
            members: s.pool.iter().map(|m| m.server).collect(),
            placing: s.placing,
            apps_down: s.backend_down,
            fail_open: s.fail_open,
            refusing: s.refusing,
            not_serving: s
                .pool
                .iter()
                .map(|m| m.server)
                .filter(|id| listed.get(id).is_some_and(|l| !serves(l)))
                .collect(),
            state: Some(ApplyState::Applied),
            refused_reason: None,
        };
        serving.insert((*addr.ip(), addr.port()), view);
    }
    retiring.sort_by(|a, b| {
        (&a.name, a.vip.parse::<Ipv4Addr>().ok(), a.port).cmp(&(
            &b.name,
            b.vip.parse::<Ipv4Addr>().ok(),
            b.port,
        ))
    });
    let refused = st
        .refused_services
        .into_iter()
        .filter_map(|r| {
            let addr = r.vip.parse::<std::net::SocketAddrV4>().ok()?;
            Some(RefusedService {
                name: r.name,
                vip: *addr.ip(),
                port: addr.port(),
                reason: r.reason,
            })
        })
        .collect();
    Ok(ServicesStatus {
        serving,
        retiring: Some(retiring),
        refused,
    })
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
                apps_down: s
                    .health_reported
                    .then(|| s.backends.iter().filter(|b| b.up == Some(false)).count() as u32),
                live: s.liveness(),
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

    /// Readiness probe: `GET /status`, all of it (connect included) within
    /// `limit`. `Ok` with switchd's `role` (`active`, `standby`,
    /// `starting`; empty when its status has none) once it answered a
    /// readable status; else a 503 problem saying why (the cause chain of a
    /// connection error, e.g. `Connection refused`).
    pub async fn probe(&self, limit: Duration) -> Result<String, Problem> {
        let what = "GET /status";
        let attempt = async {
            let resp = self
                .client
                .get(format!("{}/status", self.base))
                .timeout(limit)
                .send()
                .await
                .map_err(|e| self.unreachable(what, error_chain(&e)))?;
            let status = resp.status().as_u16();
            let body = resp
                .text()
                .await
                .map_err(|e| self.unreachable(what, error_chain(&e)))?;
            if !(200..300).contains(&status) {
                return Err(Problem::unavailable(format!(
                    "switchd at {} refused {what}: HTTP {status}",
                    self.base
                )));
            }
            match serde_json::from_str::<serde_json::Value>(&body) {
                Ok(serde_json::Value::Object(m)) => Ok(m
                    .get("role")
                    .and_then(|r| r.as_str())
                    .unwrap_or_default()
                    .to_string()),
                _ => Err(Problem::unavailable(format!(
                    "switchd at {} answered {what} with something other than a switchd \
                     status (not a JSON object)",
                    self.base
                ))),
            }
        };
        match tokio::time::timeout(limit, attempt).await {
            Ok(r) => r,
            Err(_) => Err(Problem::unavailable(format!(
                "switchd at {} did not answer {what} within {} ms",
                self.base,
                limit.as_millis()
            ))),
        }
    }
}

/// `e` and its causes, `: `-separated (reqwest's own text names the URL but
/// not why the request failed).
pub(crate) fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        let t = c.to_string();
        if !s.contains(&t) {
            s.push_str(": ");
            s.push_str(&t);
        }
        cause = c.source();
    }
    s
}

/// One entry of switchd's `GET /migrations` (a server's MIGRATION_REPORT).
#[derive(Debug, Clone, Deserialize)]
pub struct ReportedMigration {
    pub seq: u64,
    /// TCPMig migration id (origin data address << 32 | counter).
    pub migration_id: u64,
    /// Server that reported it.
    pub reporter: u32,
    /// `origin` or `target`.
    pub role: String,
    /// The other party's server id, when switchd knows it.
    #[serde(default)]
    pub peer: Option<u32>,
    /// `CLIENT_IP:PORT`.
    pub client: String,
    /// `VIP:PORT`.
    pub service: String,
    /// migrated_out | resumed | lost | not_started | migrated_in |
    /// aborted_in | import_failed
    pub outcome: String,
    /// manual | drain | proactive | reactive | churn | unknown
    pub trigger: String,
    #[serde(default)]
    pub reason: Option<String>,
    pub finished_unix_ms: u64,
    #[serde(default)]
    pub phases: ReportedPhases,
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct ReportedPhases {
    #[serde(default)]
    pub prepare_us: Option<u64>,
    #[serde(default)]
    pub export_us: Option<u64>,
    #[serde(default)]
    pub transfer_us: Option<u64>,
    #[serde(default)]
    pub import_us: Option<u64>,
    #[serde(default)]
    pub total_us: Option<u64>,
}

/// switchd's `GET /migrations` answer.
#[derive(Debug, Clone, Deserialize)]
pub struct ReportPage {
    /// A new epoch is a new switchd process: its `seq` restarts at 1.
    pub epoch: u32,
    /// The `seq` of switchd's next report.
    pub next: u64,
    #[serde(default)]
    pub items: Vec<ReportedMigration>,
}

/// Parses switchd's `/migrations` body.
pub fn parse_report_page(body: &str) -> Result<ReportPage, Problem> {
    serde_json::from_str(body).map_err(|e| {
        Problem::unavailable(format!("switchd returned an unreadable /migrations: {e}"))
    })
}

/// The API's outcome of a reported migration (and the reason, if any).
fn report_outcome(r: &ReportedMigration) -> (&'static str, Option<String>) {
    let reason = r.reason.clone();
    match r.outcome.as_str() {
        "migrated_out" | "migrated_in" => ("succeeded", None),
        "resumed" => match reason.as_deref() {
            Some("timeout") => ("timed_out", reason),
            // The target said no (capacity, draining, policy, duplicate).
            // switchd writes TCPMig reasons as words ("no capacity").
            Some(
                "no capacity" | "no_capacity" | "draining" | "policy" | "duplicate flow"
                | "duplicate_flow",
            ) => ("rejected", reason),
            _ => ("aborted", reason),
        },
        // The origin could not start it (a MIGRATE for a connection it does
        // not serve, one already migrating, ...): no TCPMig message left.
        "not_started" => (
            "rejected",
            Some(format!(
                "server {} did not start it: {}",
                r.reporter,
                reason.as_deref().unwrap_or("no reason given")
            )),
        ),
        "lost" => (
            "aborted",
            Some(format!(
                "connection lost: the target never confirmed ({})",
                reason.as_deref().unwrap_or("no reason given")
            )),
        ),
        "import_failed" => (
            "aborted",
            Some("the target could not import the connection".into()),
        ),
        _ => ("aborted", reason),
    }
}

fn report_trigger(t: &str) -> &'static str {
    match t {
        "manual" => "manual",
        "drain" => "drain",
        "proactive" => "proactive",
        "reactive" => "reactive",
        "churn" => "churn",
        _ => "unknown",
    }
}

fn empty_histogram() -> Histogram {
    Histogram {
        buckets: PHASE_BUCKETS_SECONDS.iter().map(|b| (*b, 0)).collect(),
        sum: 0.0,
        count: 0,
    }
}

struct LogEntry {
    view: MigrationView,
    /// TCPMig id, once a report named it.
    wire_id: Option<u64>,
    /// An origin report filled it (a requested migration's store watch
    /// must not overwrite it).
    reported: bool,
    /// Counted in `by_outcome`.
    counted: bool,
}

/// The API's migration ids (1, 2, ...). The endpoints of an active/standby
/// pair share one counter, so that the ids of the migrations the new active
/// reports after a takeover continue past those of the old one (a follower
/// asking for ids `after=N` sees them) and the two logs never reuse an id.
#[derive(Clone, Debug)]
pub struct MigrationIds(Arc<std::sync::atomic::AtomicU64>);

impl Default for MigrationIds {
    fn default() -> Self {
        MigrationIds(Arc::new(std::sync::atomic::AtomicU64::new(1)))
    }
}

impl MigrationIds {
    fn next(&self) -> u64 {
        self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    }
}

struct MigrationLog {
    /// Where ids come from: this log's own counter, or one shared by the
    /// endpoints of an active/standby pair ([`MigrationIds`]).
    ids: MigrationIds,
    items: VecDeque<LogEntry>,
    /// Cumulative (Prometheus counters never go down, whatever the log drops).
    by_outcome: BTreeMap<&'static str, u64>,
    phases: BTreeMap<&'static str, Histogram>,
    /// Target reports whose origin report has not come yet:
    /// (migration id, target, import_us).
    pending_imports: VecDeque<(u64, u32, Option<u64>)>,
    /// Requested migrations not reported yet: (connection, log id).
    pending_manual: VecDeque<(String, u64)>,
    /// switchd's epoch and the last `seq` read from it.
    epoch: Option<u32>,
    cursor: u64,
}

impl MigrationLog {
    #[cfg(test)]
    fn new() -> Self {
        Self::with_ids(MigrationIds::default())
    }

    fn with_ids(ids: MigrationIds) -> Self {
        MigrationLog {
            ids,
            items: VecDeque::new(),
            by_outcome: MIGRATION_OUTCOMES.iter().map(|o| (*o, 0)).collect(),
            phases: MIGRATION_PHASES
                .iter()
                .map(|p| (*p, empty_histogram()))
                .collect(),
            pending_imports: VecDeque::new(),
            pending_manual: VecDeque::new(),
            epoch: None,
            cursor: 0,
        }
    }

    fn alloc_id(&mut self) -> u64 {
        self.ids.next()
    }

    fn observe(&mut self, phase: &'static str, us: Option<u64>) {
        let (Some(us), Some(h)) = (us, self.phases.get_mut(phase)) else {
            return;
        };
        let s = us as f64 / 1e6;
        h.sum += s;
        h.count += 1;
        for (b, c) in h.buckets.iter_mut() {
            if s <= *b {
                *c += 1;
            }
        }
    }

    fn count_outcome(&mut self, i: usize) {
        let e = &mut self.items[i];
        if e.counted || e.view.outcome == "in_progress" {
            return;
        }
        e.counted = true;
        if let Some(n) = self.by_outcome.get_mut(e.view.outcome) {
            *n += 1;
        }
    }

    fn index_of(&self, id: u64) -> Option<usize> {
        self.items.iter().position(|e| e.view.id == id)
    }

    fn push(&mut self, e: LogEntry) -> usize {
        self.items.push_back(e);
        while self.items.len() > MIGRATION_LOG {
            self.items.pop_front();
        }
        self.items.len() - 1
    }

    /// Adds or updates an entry; returns where it is.
    fn upsert(&mut self, view: &MigrationView) -> usize {
        match self.index_of(view.id) {
            Some(i) => {
                self.items[i].view = view.clone();
                i
            }
            None => self.push(LogEntry {
                view: view.clone(),
                wire_id: None,
                reported: false,
                counted: false,
            }),
        }
    }

    /// Logs a requested migration (given its id) before it is sent; its
    /// origin's report (trigger `manual`) will complete this entry.
    fn begin_request(&mut self, view: &mut MigrationView) {
        view.id = self.alloc_id();
        if self.pending_manual.len() >= PENDING_MANUAL {
            self.pending_manual.pop_front();
        }
        self.pending_manual
            .push_back((view.connection.clone(), view.id));
        self.upsert(view);
    }

    /// Drops a requested migration that was never started.
    fn forget_request(&mut self, id: u64) {
        self.pending_manual.retain(|(_, i)| *i != id);
        if let Some(i) = self.index_of(id) {
            self.items.remove(i);
        }
    }

    /// A store watch's verdict on a requested migration, unless its report
    /// already told the real outcome. Returns the entry to publish.
    fn finish_watched(&mut self, view: &MigrationView) -> Option<MigrationView> {
        if let Some(i) = self.index_of(view.id) {
            if self.items[i].reported {
                return None;
            }
        }
        let i = self.upsert(view);
        self.count_outcome(i);
        Some(self.items[i].view.clone())
    }

    /// Merges one of switchd's reports; returns the entry to publish.
    fn apply_report(&mut self, r: &ReportedMigration) -> Option<MigrationView> {
        let connection = format!("{}-{}", r.client, r.service);
        if r.role != "origin" {
            // The target's side: the import phase and who the target is.
            let i = self
                .items
                .iter()
                .rposition(|e| e.wire_id == Some(r.migration_id));
            let Some(i) = i else {
                if self.pending_imports.len() >= PENDING_IMPORTS {
                    self.pending_imports.pop_front();
                }
                self.pending_imports
                    .push_back((r.migration_id, r.reporter, r.phases.import_us));
                return None;
            };
            self.items[i].view.target = Some(r.reporter);
            if self.items[i].view.phases.import_us.is_none() {
                self.items[i].view.phases.import_us = r.phases.import_us;
                self.observe("import", r.phases.import_us);
            }
            return Some(self.items[i].view.clone());
        }
        let (outcome, reason) = report_outcome(r);
        let total = r.phases.total_us;
        let started = r
            .finished_unix_ms
            .saturating_sub(total.map_or(0, |us| us / 1000));
        let mut phases = MigrationPhases {
            prepare_us: r.phases.prepare_us,
            export_us: r.phases.export_us,
            transfer_us: r.phases.transfer_us,
            import_us: None,
            total_us: total,
        };
        let mut target = r.peer;
        if let Some(k) = self
            .pending_imports
            .iter()
            .position(|(id, _, _)| *id == r.migration_id)
        {
            if let Some((_, t, import)) = self.pending_imports.remove(k) {
                target = Some(t);
                phases.import_us = import;
            }
        }
        for (p, us) in [
            ("prepare", phases.prepare_us),
            ("export", phases.export_us),
            ("transfer", phases.transfer_us),
            ("import", phases.import_us),
            ("total", phases.total_us),
        ] {
            self.observe(p, us);
        }
        // A migration requested through the API: complete its entry.
        let requested = if r.trigger == "manual" {
            self.pending_manual
                .iter()
                .position(|(c, _)| *c == connection)
                .and_then(|k| self.pending_manual.remove(k))
                .and_then(|(_, id)| self.index_of(id))
        } else {
            None
        };
        let i = match requested {
            Some(i) => {
                let v = &mut self.items[i].view;
                v.target = target.or(v.target);
                v.outcome = outcome;
                v.reason = reason;
                v.finished_unix_ms = Some(r.finished_unix_ms);
                v.phases = phases;
                i
            }
            None => {
                let id = self.alloc_id();
                self.push(LogEntry {
                    view: MigrationView {
                        id,
                        connection,
                        origin: r.reporter,
                        target,
                        outcome,
                        trigger: report_trigger(&r.trigger),
                        reason,
                        started_unix_ms: started,
                        finished_unix_ms: Some(r.finished_unix_ms),
                        phases,
                    },
                    wire_id: None,
                    reported: false,
                    counted: false,
                })
            }
        };
        self.items[i].wire_id = Some(r.migration_id);
        self.items[i].reported = true;
        self.count_outcome(i);
        Some(self.items[i].view.clone())
    }

    /// Merges a `/migrations` page; returns the entries to publish and
    /// whether more may be waiting.
    fn apply_page(&mut self, page: &ReportPage) -> (Vec<MigrationView>, bool) {
        if self.epoch != Some(page.epoch) || page.next <= self.cursor {
            // Another switchd process (takeover, restart): its seqs restart.
            let fresh = self.epoch.is_some() && self.epoch != Some(page.epoch);
            self.epoch = Some(page.epoch);
            if fresh || page.next <= self.cursor {
                self.cursor = 0;
                return (Vec::new(), true);
            }
        }
        let mut out = Vec::new();
        for r in &page.items {
            if r.seq <= self.cursor {
                continue;
            }
            self.cursor = r.seq;
            if let Some(v) = self.apply_report(r) {
                out.push(v);
            }
        }
        let more = page.items.len() >= REPORT_PAGE && self.cursor + 1 < page.next;
        (out, more)
    }
}

pub struct SwitchdControlPlane {
    inner: Arc<StoreControlPlane>,
    store: Arc<dyn Store>,
    http: SwitchdHttp,
    events: broadcast::Sender<ControlEvent>,
    log: Arc<Mutex<MigrationLog>>,
    /// The switch's own addresses from its last readable `/status`.
    own_addrs: Mutex<Vec<(Ipv4Addr, String)>>,
}

impl SwitchdControlPlane {
    pub fn new(
        inner: Arc<StoreControlPlane>,
        store: Arc<dyn Store>,
        switchd_url: &str,
    ) -> Result<Arc<Self>, Problem> {
        Self::with_migration_ids(inner, store, switchd_url, MigrationIds::default())
    }

    /// [`SwitchdControlPlane::new`] numbering its migrations from `ids`,
    /// shared by the endpoints of an active/standby pair.
    pub fn with_migration_ids(
        inner: Arc<StoreControlPlane>,
        store: Arc<dyn Store>,
        switchd_url: &str,
        ids: MigrationIds,
    ) -> Result<Arc<Self>, Problem> {
        let (events, _) = broadcast::channel(256);
        let cp = Arc::new(SwitchdControlPlane {
            inner,
            store,
            http: SwitchdHttp::new(switchd_url)?,
            events,
            log: Arc::new(Mutex::new(MigrationLog::with_ids(ids))),
            own_addrs: Mutex::new(Vec::new()),
        });
        cp.start_report_poller();
        Ok(cp)
    }

    /// The store's view of the servers (connections counted from the flow
    /// mappings, load unknown, `data_source: store`): what
    /// [`ControlPlane::server_stats`] answers while switchd does not, and
    /// what an active/standby pair's API answers while neither is active.
    pub async fn server_stats_from_store(&self) -> Result<HashMap<ServerId, ServerStats>, Problem> {
        self.inner.server_stats().await
    }

    pub fn http(&self) -> &SwitchdHttp {
        &self.http
    }

    /// Starts polling switchd's reported migrations (`GET /migrations`)
    /// into the log, until the control plane is dropped. Needs a tokio
    /// runtime (without one, e.g. in a plain unit test, nothing is polled).
    pub fn start_report_poller(self: &Arc<Self>) {
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let me = Arc::downgrade(self);
        rt.spawn(async move {
            let mut tick = tokio::time::interval(REPORT_POLL);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut failing = false;
            let mut next_addrs = tokio::time::Instant::now();
            loop {
                tick.tick().await;
                let Some(cp) = me.upgrade() else { break };
                if tokio::time::Instant::now() >= next_addrs {
                    next_addrs = tokio::time::Instant::now() + OWN_ADDRS_POLL;
                    cp.refresh_own_addrs().await;
                }
                // Bounded: a few pages per tick, the rest next tick.
                for _ in 0..8 {
                    match cp.poll_reports_once().await {
                        Ok(true) => continue,
                        Ok(false) => {
                            failing = false;
                            break;
                        }
                        Err(e) => {
                            if !failing {
                                tracing::debug!(error = %e, "polling switchd's reported migrations failed; retrying");
                            }
                            failing = true;
                            break;
                        }
                    }
                }
            }
        });
    }

    /// Reads the switch's own addresses from switchd's `/status` (kept as
    /// they were while switchd does not answer readably).
    pub async fn refresh_own_addrs(&self) {
        let parsed = match self.http.get("/status").await {
            Ok(body) => parse_own_addrs(&body),
            Err(e) => Err(e),
        };
        match parsed {
            Ok(addrs) => *self.own_addrs.lock().unwrap_or_else(|p| p.into_inner()) = addrs,
            Err(e) => tracing::debug!(error = %e, "reading switchd's own addresses failed"),
        }
    }

    /// Reads one page of switchd's reported migrations into the log and
    /// publishes the entries it changed. `Ok(true)` when more are waiting.
    pub async fn poll_reports_once(&self) -> Result<bool, Problem> {
        let cursor = self.log.lock().unwrap_or_else(|p| p.into_inner()).cursor;
        let body = self
            .http
            .get(&format!("/migrations?after={cursor}&limit={REPORT_PAGE}"))
            .await?;
        let page = parse_report_page(&body)?;
        let (changed, more) = self
            .log
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .apply_page(&page);
        for v in changed {
            let _ = self.events.send(ControlEvent::Migration(v));
        }
        Ok(more)
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
            let publish = me
                .log
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .finish_watched(&v);
            if let Some(v) = publish {
                let _ = me.events.send(ControlEvent::Migration(v));
            }
        });
    }
}

#[async_trait]
impl ControlPlane for Arc<SwitchdControlPlane> {
    fn name(&self) -> &'static str {
        "switchd"
    }

    fn switch_addrs(&self) -> Vec<(Ipv4Addr, String)> {
        self.own_addrs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Reachable once switchd answered a readable `/status`, whatever its
    /// role.
    async fn probe_switchd(&self, limit: Duration) -> Option<Result<(), Problem>> {
        Some(self.http.probe(limit).await.map(|_| ()))
    }
    fn data_source(&self) -> DataSource {
        DataSource::Switchd
    }

    /// switchd's `/status` has counts, not 4-tuples: the list comes from the
    /// flow mappings switchd persists in the store.
    async fn connections(&self, filter: &ConnectionFilter) -> Result<ConnectionPage, Problem> {
        self.inner.connections(filter).await
    }

    async fn service_serving(&self) -> Option<HashMap<(Ipv4Addr, u16), ServiceServing>> {
        let body = self.http.get("/status").await.ok()?;
        parse_status_services(&body).ok()
    }

    async fn services_status(&self) -> Option<ServicesStatus> {
        let body = self.http.get("/status").await.ok()?;
        parse_services_status(&body).ok()
    }

    async fn server_stats(&self) -> Result<HashMap<ServerId, ServerStats>, Problem> {
        let mut out = match self.http.server_stats().await {
            Ok(out) => out,
            Err(p) => {
                // switchd unreachable (restarting, failing over, a wrong
                // URL): servers are still listed and registered, with the
                // store's view of their connections (`data_source: store`,
                // load unknown), instead of every server read failing.
                tracing::debug!(error = %p, "switchd unreachable: server stats from the store");
                return self.inner.server_stats().await;
            }
        };
        for s in self.store.list_servers().await? {
            out.entry(s.id).or_insert(ServerStats {
                data_source: DataSource::Switchd,
                connections: 0,
                load_pps: None,
                apps_down: None,
                live: None,
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
                let shown = crate::control::server_shown_state(self.store.as_ref(), &ts).await?;
                if shown != ServerState::Active {
                    return Err(Problem::conflict(format!(
                        "target server {} is {}, not active",
                        t.0,
                        shown.as_str()
                    )));
                }
                // A target whose hostagent does not serve the VIP:port has
                // no listener for the connection: the migration was sent
                // and ended `aborted` (`import failed`). Unknown (switchd
                // does not answer): the request goes on as before.
                let vip = std::net::SocketAddrV4::new(conn.service_ip, conn.service_port);
                if let Ok(body) = self.http.get("/status").await {
                    if server_serves(&body, t.0, vip) == Some(false) {
                        return Err(Problem::invalid(
                            "target",
                            format!(
                                "server {} does not serve {vip} (its hostagent lists other services): the connection cannot be imported there",
                                t.0
                            ),
                        ));
                    }
                }
                Some(ts.data_addr)
            }
        };
        // The entry exists before the request is sent: the origin may
        // report the migration (trigger `manual`) within a millisecond, and
        // that report must complete this entry, not become another one.
        let mut view = MigrationView {
            id: 0,
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
        self.log
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .begin_request(&mut view);
        if let Err(p) = self.http.post(&migrate_path(owner, &conn, target_ip)).await {
            // Not started: leave no entry behind.
            self.log
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .forget_request(view.id);
            return Err(p);
        }
        // Publish what the log holds now (a report may have completed it).
        let current = {
            let log = self.log.lock().unwrap_or_else(|p| p.into_inner());
            log.index_of(view.id).map(|i| log.items[i].view.clone())
        };
        let current = current.unwrap_or_else(|| view.clone());
        let _ = self.events.send(ControlEvent::Migration(current.clone()));
        self.watch(conn, owner, view);
        Ok(current)
    }

    async fn recent_migrations(
        &self,
        after: u64,
        limit: usize,
    ) -> Result<Vec<MigrationView>, Problem> {
        let log = self.log.lock().unwrap_or_else(|p| p.into_inner());
        let mut v: Vec<MigrationView> = log
            .items
            .iter()
            .filter(|m| m.view.id > after)
            .map(|m| m.view.clone())
            .collect();
        v.sort_by_key(|m| m.id);
        v.truncate(limit);
        Ok(v)
    }

    async fn start_drain(&self, server: ServerId, spec: DrainSpec) -> Result<DrainView, Problem> {
        let deadline_ms = spec.deadline.as_millis().min(u32::MAX as u128);
        // Validates and records the drain (its `Drain` record, running).
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
        let log = self.log.lock().unwrap_or_else(|p| p.into_inner());
        MigrationMetrics {
            by_outcome: log.by_outcome.clone(),
            phase_histograms: log.phases.clone(),
        }
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

    /// switchd's `state`, `leaving` and `stopped` make one liveness: a
    /// clean stop over a death over a stop in progress (an operator's
    /// drain, `draining`, is not liveness); a switchd without the two
    /// fields (before 2026-11-24) reads as before; no `state`, no view.
    #[test]
    fn leaving_and_stopped_map_to_one_liveness() {
        use SwitchdLiveness::*;
        let body = r#"{"servers": [
          {"id": 1, "state": "live"},
          {"id": 2, "state": "live", "leaving": true, "stopped": false},
          {"id": 3, "state": "draining", "leaving": true},
          {"id": 4, "state": "draining", "leaving": false},
          {"id": 5, "state": "dead", "leaving": true, "stopped": false},
          {"id": 6, "state": "dead", "leaving": true, "stopped": true},
          {"id": 7, "state": "dead"},
          {"id": 8, "leaving": true, "stopped": true}
        ]}"#;
        let m = parse_status(body).unwrap();
        let got: Vec<_> = (1..=8).map(|id| m[&ServerId(id)].live).collect();
        assert_eq!(
            got,
            [
                Some(Live),
                Some(Stopping),
                Some(Stopping),
                Some(Live),
                Some(Dead),
                Some(Stopped),
                Some(Dead),
                None
            ]
        );
    }

    /// The switch's own addresses switchd publishes (control_listen and its
    /// interfaces' IPv4 addresses) are what the API refuses as a VIP, each
    /// named; loopback, unspecified and repeated ones are left out, a
    /// switchd without the fields reports none, a bad address is an error.
    #[test]
    fn status_names_the_switchs_own_addresses() {
        let got = parse_own_addrs(
            r#"{"role": "active", "control_listen": "198.18.1.1:7692",
                "interface_addrs": [
                  {"interface": "client", "addr": "198.18.0.1"},
                  {"interface": "server", "addr": "198.18.1.1"},
                  {"interface": "server", "addr": "198.18.3.1"},
                  {"interface": "lo", "addr": "127.0.0.1"}]}"#,
        )
        .unwrap();
        assert_eq!(
            got,
            vec![
                (
                    "198.18.1.1".parse().unwrap(),
                    "switchd's control_listen".to_string()
                ),
                (
                    "198.18.0.1".parse().unwrap(),
                    "an address of switchd's interface client".to_string()
                ),
                (
                    "198.18.3.1".parse().unwrap(),
                    "an address of switchd's interface server".to_string()
                ),
            ]
        );
        assert!(parse_own_addrs(r#"{"control_listen": "0.0.0.0:7692"}"#)
            .unwrap()
            .is_empty());
        assert!(parse_own_addrs(STATUS).unwrap().is_empty());
        let e = parse_own_addrs(r#"{"control_listen": "switch:7692"}"#).unwrap_err();
        assert!(e.detail.contains("\"switch:7692\""), "{}", e.detail);
        assert!(parse_own_addrs("[").is_err());
    }

    #[test]
    fn status_counts_the_applications_a_server_reports_down() {
        let m = parse_status(
            r#"{"servers": [
              {"id": 1, "health_reported": true, "backends": [
                {"service": "198.18.100.1:80", "up": false},
                {"service": "198.18.100.1:6379", "up": true}]},
              {"id": 2, "health_reported": false, "backends": [
                {"service": "198.18.100.1:80", "up": null}]},
              {"id": 3}
            ]}"#,
        )
        .unwrap();
        assert_eq!(m[&ServerId(1)].apps_down, Some(1));
        // A hostagent (or switchd) that predates health checks: unknown.
        assert_eq!(m[&ServerId(2)].apps_down, None);
        assert_eq!(m[&ServerId(3)].apps_down, None);
        assert_eq!(parse_status(STATUS).unwrap()[&ServerId(1)].apps_down, None);
    }

    #[test]
    fn a_refusing_service_is_shown_and_an_older_switchd_reads_as_not_refusing() {
        let m = parse_status_services(
            r#"{"services": [
              {"name": "web", "vip": "198.18.100.1:80", "pool": [{"server": 1}], "fail_open": false,
               "refusing": true},
              {"name": "api", "vip": "198.18.100.2:80", "pool": [{"server": 1}], "fail_open": false}
            ]}"#,
        )
        .unwrap();
        assert!(m[&(Ipv4Addr::new(198, 18, 100, 1), 80)].refusing);
        assert!(!m[&(Ipv4Addr::new(198, 18, 100, 2), 80)].refusing);
    }

    /// A pool member whose REGISTER lists other services (not this VIP:port,
    /// nor 0.0.0.0:PORT) is named: switchd places no new connection there
    /// (its stack would leave them unanswered). One
    /// that lists nothing, or that switchd says nothing about, is not.
    #[test]
    fn pool_members_that_do_not_serve_the_vip_are_named() {
        let m = parse_status_services(
            r#"{"servers": [
              {"id": 1, "backends": [{"service": "198.18.100.1:80", "up": true}]},
              {"id": 2, "backends": [{"service": "0.0.0.0:8080", "up": null}]},
              {"id": 3, "backends": []},
              {"id": 4, "backends": [{"service": "198.18.100.2:80"}, {"service": "bad"}]}
            ], "services": [
              {"name": "web", "vip": "198.18.100.1:80", "pool": [{"server": 1}, {"server": 4}]},
              {"name": "api", "vip": "198.18.100.2:8080",
               "pool": [{"server": 1}, {"server": 2}, {"server": 3}, {"server": 4}, {"server": 5}]}
            ]}"#,
        )
        .unwrap();
        assert_eq!(m[&(Ipv4Addr::new(198, 18, 100, 1), 80)].not_serving, [4]);
        assert_eq!(
            m[&(Ipv4Addr::new(198, 18, 100, 2), 8080)].not_serving,
            [1, 4]
        );
    }

    /// A migration target that lists other services (not the VIP:port,
    /// nor 0.0.0.0:PORT) cannot import the connection; one that lists
    /// nothing, or that the status does not name, is not known not to.
    #[test]
    fn whether_a_server_serves_a_vip() {
        let body = r#"{"servers": [
              {"id": 1, "backends": [{"service": "198.18.100.1:80", "up": true}]},
              {"id": 2, "backends": [{"service": "0.0.0.0:8083", "up": null}]},
              {"id": 3, "backends": []},
              {"id": 4, "backends": [{"service": "198.18.100.2:80"}, {"service": "bad"}]}
            ]}"#;
        let vip: std::net::SocketAddrV4 = "198.18.100.1:8083".parse().unwrap();
        assert_eq!(server_serves(body, 1, vip), Some(false));
        assert_eq!(server_serves(body, 2, vip), Some(true));
        assert_eq!(server_serves(body, 3, vip), None);
        assert_eq!(server_serves(body, 4, vip), Some(false));
        assert_eq!(server_serves(body, 5, vip), None);
        assert_eq!(
            server_serves(body, 1, "198.18.100.1:80".parse().unwrap()),
            Some(true)
        );
        assert_eq!(server_serves("not json", 1, vip), None);
    }

    #[test]
    fn a_retiring_service_is_not_served() {
        let m = parse_status_services(
            r#"{"services": [
              {"name": "web", "vip": "198.18.100.1:80", "pool": [{"server": 1}], "fail_open": false},
              {"name": "old", "vip": "198.18.100.2:80", "pool": [{"server": 1}], "retiring": true,
               "retiring_for_ms": 1200}
            ]}"#,
        )
        .unwrap();
        assert_eq!(m.len(), 1);
        assert!(m[&(Ipv4Addr::new(198, 18, 100, 1), 80)].served);
    }

    /// A stored service switchd refuses (`refused_services`) is shown
    /// refused with its reason, even at a VIP:port switchd serves (for
    /// another service: the one in its way); one it neither serves nor
    /// refuses is pending; a served one is applied.
    #[test]
    fn refused_services_are_refused_not_pending() {
        let st = parse_services_status(
            r#"{"services": [
              {"name": "echo", "vip": "198.18.100.1:7", "pool": [{"server": 1}]}
            ], "refused_services": [
              {"name": "dup", "vip": "198.18.100.1:7", "reason": "198.18.100.1:7 is already the address of service \"echo\""},
              {"name": "bad", "vip": "not an address", "reason": "x"}
            ]}"#,
        )
        .unwrap();
        let svc = |name: &str, vip: [u8; 4], port| capybara_store::Service {
            name: name.into(),
            vip: vip.into(),
            port,
            pool: Vec::new(),
        };
        let v = st.view_of(&svc("echo", [198, 18, 100, 1], 7));
        assert_eq!((v.served, v.state), (true, Some(ApplyState::Applied)));
        let v = st.view_of(&svc("dup", [198, 18, 100, 1], 7));
        assert_eq!((v.served, v.state), (false, Some(ApplyState::Refused)));
        assert_eq!(
            v.refused_reason.as_deref(),
            Some("198.18.100.1:7 is already the address of service \"echo\"")
        );
        // Moved since switchd refused it: not read yet, so pending.
        let v = st.view_of(&svc("dup", [198, 18, 100, 3], 7));
        assert_eq!((v.served, v.state), (false, Some(ApplyState::Pending)));
        assert_eq!(v.refused_reason, None);
        // A switchd without the field refuses nothing it says.
        let st = parse_services_status(r#"{"services": []}"#).unwrap();
        assert!(st.refused.is_empty());
        let v = st.view_of(&svc("dup", [198, 18, 100, 1], 7));
        assert_eq!(v.state, Some(ApplyState::Pending));
        // Serialized as the contract names them.
        let v = serde_json::to_value(ServiceServing {
            state: Some(ApplyState::Refused),
            refused_reason: Some("why".into()),
            ..ServiceServing::default()
        })
        .unwrap();
        assert_eq!(
            (&v["state"], &v["refused_reason"]),
            (&serde_json::json!("refused"), &serde_json::json!("why"))
        );
    }

    #[test]
    fn retiring_services_are_listed_with_their_connections() {
        let st = parse_services_status(
            r#"{"services": [
              {"name": "web", "vip": "198.18.100.1:80", "pool": [{"server": 1}], "fail_open": false,
               "retiring": false, "retiring_for_ms": null, "retiring_flows": null},
              {"name": "old", "vip": "198.18.100.3:80", "pool": [], "retiring": true,
               "retiring_for_ms": 1200, "retiring_flows": null},
              {"name": "api", "vip": "198.18.100.2:8080", "pool": [{"server": 2}], "retiring": true,
               "retiring_for_ms": 64000, "retiring_flows": 3, "retiring_left_ms": 236000},
              {"name": "bad", "vip": "not an address", "retiring": true, "retiring_for_ms": 5}
            ]}"#,
        )
        .unwrap();
        assert_eq!(st.serving.len(), 1);
        assert!(st.serving[&(Ipv4Addr::new(198, 18, 100, 1), 80)].served);
        let r = st.retiring.unwrap();
        assert_eq!(r.len(), 2, "{r:?}");
        // By name; connections unknown before switchd's first pass.
        assert_eq!(
            r[0],
            RetiringService {
                name: "api".into(),
                vip: "198.18.100.2".into(),
                port: 8080,
                retiring_for_ms: 64000,
                connections: Some(3),
                timeout_in_ms: Some(236000),
            }
        );
        assert_eq!(
            (r[1].name.as_str(), r[1].port, r[1].retiring_for_ms),
            ("old", 80, 1200)
        );
        assert_eq!((r[1].connections, r[1].timeout_in_ms), (None, None));
        let json = serde_json::to_value(&r[1]).unwrap();
        assert!(json.get("connections").is_none(), "{json}");
        // A switchd status without services: nothing retiring (not unknown).
        let st = parse_services_status(r#"{"servers": []}"#).unwrap();
        assert_eq!(st.retiring, Some(vec![]));
        assert_eq!(
            parse_services_status("not json")
                .unwrap_err()
                .status
                .as_u16(),
            503
        );
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

    fn report_json(seq: u64, id: u64, role: &str, outcome: &str, trigger: &str) -> String {
        format!(
            r#"{{"seq": {seq}, "migration_id": {id}, "reporter": {rep}, "role": "{role}",
                "peer": {peer}, "peer_addr": null, "client": "198.18.0.11:40000",
                "service": "198.18.100.1:80", "outcome": "{outcome}", "trigger": "{trigger}",
                "reason": {reason}, "finished_unix_ms": 10000,
                "phases": {{"prepare_us": 40, "export_us": 9, "transfer_us": 78,
                            "import_us": {import}, "total_us": {total}}},
                "fragments": 1, "snapshot_bytes": 900, "segments_buffered": 0, "bytes_buffered": 0}}"#,
            rep = if role == "origin" { 1 } else { 2 },
            peer = if role == "origin" { 2 } else { 1 },
            reason = if outcome == "resumed" {
                "\"timeout\""
            } else {
                "null"
            },
            import = if role == "origin" { "null" } else { "12" },
            total = if outcome == "resumed" { "null" } else { "2000" },
        )
    }

    fn page(epoch: u32, next: u64, items: &[String]) -> ReportPage {
        parse_report_page(&format!(
            r#"{{"epoch": {epoch}, "next": {next}, "oldest": 1, "received": 0, "overwritten": 0,
                "items": [{}]}}"#,
            items.join(",")
        ))
        .unwrap()
    }

    #[test]
    fn reported_migrations_merge_into_the_log_and_metrics() {
        let mut log = MigrationLog::new();
        // The target's report first, then its origin's: one entry.
        let (v, more) = log.apply_page(&page(
            7,
            4,
            &[
                report_json(1, 0xc612_020b_0000_0001, "target", "migrated_in", "unknown"),
                report_json(2, 0xc612_020b_0000_0001, "origin", "migrated_out", "drain"),
                report_json(3, 0xc612_020b_0000_0002, "origin", "resumed", "reactive"),
            ],
        ));
        assert!(!more);
        assert_eq!(v.len(), 2);
        let m = &v[0];
        assert_eq!(
            (m.trigger, m.outcome, m.origin, m.target),
            ("drain", "succeeded", 1, Some(2))
        );
        assert_eq!(m.phases.prepare_us, Some(40));
        assert_eq!(
            m.phases.import_us,
            Some(12),
            "merged from the target's report"
        );
        assert_eq!(m.phases.total_us, Some(2000));
        assert_eq!(m.started_unix_ms, 9998, "finished minus the 2 ms total");
        assert_eq!(m.connection, "198.18.0.11:40000-198.18.100.1:80");
        let r = &v[1];
        assert_eq!((r.trigger, r.outcome), ("reactive", "timed_out"));
        assert_eq!(r.reason.as_deref(), Some("timeout"));
        assert_eq!(r.phases.total_us, None);
        assert_eq!(log.cursor, 3);
        // The same page again (a retried poll) changes nothing.
        let before = log.items.len();
        log.apply_page(&page(
            7,
            4,
            &[report_json(3, 2, "origin", "migrated_out", "churn")],
        ));
        assert_eq!(log.items.len(), before);
        assert_eq!(log.by_outcome["succeeded"], 1);
        assert_eq!(log.by_outcome["timed_out"], 1);
        assert_eq!(log.phases["total"].count, 1);
        assert_eq!(log.phases["import"].count, 1);
        assert_eq!(log.phases["prepare"].count, 2);
        // 40 us lands in the 50 us bucket and above, not in 10 us.
        let prepare = &log.phases["prepare"];
        assert_eq!(prepare.buckets[2], (1e-5, 0));
        assert_eq!(prepare.buckets[3], (5e-5, 2));
        // A new switchd (takeover): its seqs restart, the cursor follows.
        let (v, more) = log.apply_page(&page(
            8,
            2,
            &[report_json(1, 9, "origin", "migrated_out", "churn")],
        ));
        assert!(v.is_empty() && more);
        assert_eq!(log.cursor, 0);
        let (v, _) = log.apply_page(&page(
            8,
            2,
            &[report_json(1, 9, "origin", "migrated_out", "churn")],
        ));
        assert_eq!(v[0].trigger, "churn");
        assert_eq!(log.by_outcome["succeeded"], 2);
    }

    /// The entry the API logs for `POST .../migrate` from server 1.
    fn manual_request() -> MigrationView {
        MigrationView {
            id: 0,
            connection: "198.18.0.11:40000-198.18.100.1:80".to_string(),
            origin: 1,
            target: None,
            outcome: "in_progress",
            trigger: "manual",
            reason: None,
            started_unix_ms: 9990,
            finished_unix_ms: None,
            phases: MigrationPhases::default(),
        }
    }

    #[test]
    fn a_requested_migration_is_completed_by_its_report() {
        let mut log = MigrationLog::new();
        let mut requested = manual_request();
        // Logged before the request is sent, so a report that comes back
        // before the API answers still completes this entry.
        log.begin_request(&mut requested);
        let id = requested.id;
        // A request switchd refused leaves nothing behind.
        let mut refused = requested.clone();
        log.begin_request(&mut refused);
        log.forget_request(refused.id);
        assert_eq!(log.pending_manual.len(), 1);
        let (v, _) = log.apply_page(&page(
            1,
            2,
            &[report_json(1, 5, "origin", "migrated_out", "manual")],
        ));
        assert_eq!(v.len(), 1);
        assert_eq!(
            (v[0].id, v[0].outcome, v[0].target),
            (id, "succeeded", Some(2))
        );
        assert_eq!(log.items.len(), 1);
        // The store watch finishing later does not overwrite the report.
        let mut watched = v[0].clone();
        watched.outcome = "timed_out";
        watched.phases = MigrationPhases::default();
        assert!(log.finish_watched(&watched).is_none());
        assert_eq!(log.items[0].view.outcome, "succeeded");
        assert_eq!(log.by_outcome["succeeded"], 1);
        assert_eq!(log.by_outcome["timed_out"], 0);
        assert!(parse_report_page("{}").is_err());
    }

    #[test]
    fn a_requested_migration_that_did_not_start_is_rejected_with_why() {
        let mut log = MigrationLog::new();
        let mut requested = manual_request();
        log.begin_request(&mut requested);
        // What switchd serves for a NOT_STARTED report (no phases).
        let report = report_json(1, 0xc612_020b_0000_0000, "origin", "not_started", "manual")
            .replace(
                r#""reason": null"#,
                r#""reason": "no such connection is served there""#,
            )
            .replace(
                r#""phases": {"prepare_us": 40, "export_us": 9, "transfer_us": 78,"#,
                r#""phases": {"prepare_us": null, "export_us": null, "transfer_us": null,"#,
            )
            .replace(r#""total_us": 2000"#, r#""total_us": null"#);
        let (v, _) = log.apply_page(&page(1, 2, &[report]));
        assert_eq!(v.len(), 1);
        assert_eq!((v[0].id, v[0].outcome), (requested.id, "rejected"));
        assert_eq!(
            v[0].reason.as_deref(),
            Some("server 1 did not start it: no such connection is served there")
        );
        assert_eq!(v[0].finished_unix_ms, Some(10000));
        assert_eq!(v[0].phases.total_us, None);
        assert_eq!(log.by_outcome["rejected"], 1);
        assert_eq!(log.phases["prepare"].count, 0, "no phase observed");
        // The store watch (5 s later) does not overwrite it.
        let mut watched = v[0].clone();
        watched.outcome = "timed_out";
        assert!(log.finish_watched(&watched).is_none());
        // A target's refusal, as switchd words it, is a rejection too.
        let resumed = report_json(2, 0xc612_020b_0000_0003, "origin", "resumed", "drain")
            .replace(r#""reason": "timeout""#, r#""reason": "no capacity""#);
        let (v, _) = log.apply_page(&page(1, 3, &[resumed]));
        assert_eq!(
            (v[0].outcome, v[0].reason.as_deref()),
            ("rejected", Some("no capacity"))
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
