//! The records the store holds. Persisted times are wall-clock milliseconds
//! since the Unix epoch (`*_unix_ms`): they must mean the same thing in every
//! process sharing the store, which the driver-relative `proto::time::Instant`
//! does not.

use std::net::{Ipv4Addr, SocketAddr};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use capybara_proto::flow::{FlowKey, ServerId};
use serde::{Deserialize, Serialize};

use crate::error::PolicyError;

/// Wall-clock now in Unix milliseconds.
pub fn unix_ms_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// serde for `ServerId` (a plain number), which lives in `proto` without serde.
pub mod server_id_serde {
    use super::*;
    use serde::{Deserializer, Serializer};
    pub fn serialize<S: Serializer>(id: &ServerId, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u32(id.0)
    }
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<ServerId, D::Error> {
        u32::deserialize(d).map(ServerId)
    }
}

/// serde for `Vec<ServerId>`.
pub mod server_ids_serde {
    use super::*;
    use serde::{Deserializer, Serializer};
    pub fn serialize<S: Serializer>(ids: &[ServerId], s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(ids.iter().map(|i| i.0))
    }
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<ServerId>, D::Error> {
        Vec::<u32>::deserialize(d).map(|v| v.into_iter().map(ServerId).collect())
    }
}

/// Lifecycle of a server in the pool, as shown (REST `state`, metrics,
/// `ctl`): [`shown_state`]. Stored in a server record (`Server::state`) it
/// is switchd's liveness only, `Active` or `Dead`; the operator's drain is
/// the server's [`Drain`] record. `Draining` and `Drained` in a server
/// record are what versions before the split wrote there: read as a drain
/// (running, completed) until [`crate::upgrade_legacy_drain_states`] moves
/// them into a `Drain` record, or `undrain` clears them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ServerState {
    /// Takes new connections and migrated-in connections.
    Active,
    /// No new connections; existing ones are being migrated off.
    Draining,
    /// Drained: holds no connections, may be taken down.
    Drained,
    /// Missed heartbeats for longer than `dead_after`; its flows are removed.
    Dead,
}

/// The state a server is shown in: its drain's when the operator's drain
/// holds it (running or timed out: `Draining`; completed: `Drained`),
/// else its record's `state` (switchd's liveness, or a drain state a
/// previous version wrote there). `drain`: the state of the server's
/// `Drain` record, if any. A drained server that dies is still shown
/// drained (its liveness is told apart: REST `liveness`).
pub fn shown_state(server: &Server, drain: Option<DrainState>) -> ServerState {
    match drain {
        Some(DrainState::Running | DrainState::TimedOut) => ServerState::Draining,
        Some(DrainState::Completed) => ServerState::Drained,
        Some(DrainState::Cancelled) | None => server.state,
    }
}

/// Whether the operator's drain keeps the server out of placement (no new
/// connections, whatever its liveness) until `undrain`.
pub fn out_of_placement(server: &Server, drain: Option<DrainState>) -> bool {
    matches!(
        shown_state(server, drain),
        ServerState::Draining | ServerState::Drained
    )
}

impl ServerState {
    pub fn as_str(self) -> &'static str {
        match self {
            ServerState::Active => "active",
            ServerState::Draining => "draining",
            ServerState::Drained => "drained",
            ServerState::Dead => "dead",
        }
    }
}

/// A registered server.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Server {
    #[serde(with = "server_id_serde")]
    pub id: ServerId,
    pub name: String,
    /// Kernel-owned address for the control channel, store and API.
    pub mgmt_addr: SocketAddr,
    /// Address owned by the server's user-space stack.
    pub data_addr: Ipv4Addr,
    /// switchd's liveness: `Active` (registered, heard) or `Dead` (missed
    /// its heartbeats). Not the operator's drain, which is the server's
    /// `Drain` record ([`shown_state`]); `Draining` / `Drained` here are
    /// from a previous version (see [`ServerState`]).
    pub state: ServerState,
    /// Relative weight for placement (Maglev / LWRR); 0 takes no new flows.
    pub weight: u32,
    /// `weight` was set by an operator (`set_server_weight`: REST, `ctl
    /// weight`, dashboard), not taken from the server's REGISTER: switchd
    /// applies it over the REGISTER's and a later REGISTER keeps it.
    /// `false` (absent): the REGISTER's weight, or a record that predates
    /// the field.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub weight_set: bool,
    /// While `weight_set`: the weight the server's REGISTER reports (or
    /// the record's before the operator set one), which
    /// `Store::clear_server_weight` brings back. `None` otherwise, or when
    /// not known (an operator weight given at `POST /v1/servers`, or a
    /// record that predates the field); absent when `None`, so records
    /// without an operator weight are written as before.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub register_weight: Option<u32>,
    pub registered_unix_ms: u64,
    pub updated_unix_ms: u64,
    /// The MAC address of the data interface as switchd learned it from
    /// the server's REGISTER ("aa:bb:cc:dd:ee:ff"), so that a standby
    /// switch can forward to the server before it registers again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_mac: Option<String>,
    /// The server process's instance id from that REGISTER (docs/TCPMIG.md
    /// §4.2), so that a standby switch that takes over tells a restarted
    /// process (another id: the old one's flows are dropped at once) from
    /// the same one registering again (its flows are kept). `None`: the
    /// server sent none, or the record predates the field.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instance: Option<u64>,
    /// The `seq` of that REGISTER (only with `instance`): a standby that
    /// takes over refuses control messages from the server whose `seq` is
    /// not above it, as the switch that took the REGISTER does, so that an
    /// old process's REGISTER replayed after a takeover cannot pass for a
    /// restart.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub register_seq: Option<u64>,
    /// The services (VIP:port) that REGISTER listed, in its order, so that
    /// a standby switch that takes over keeps the server in the pools it
    /// joined by them and reads its heartbeats' application-health bits
    /// (one per listed service, by position) before it registers again.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub services: Vec<std::net::SocketAddrV4>,
}

impl Server {
    pub fn new(
        id: ServerId,
        name: impl Into<String>,
        mgmt_addr: SocketAddr,
        data_addr: Ipv4Addr,
    ) -> Self {
        let now = unix_ms_now();
        Server {
            id,
            name: name.into(),
            mgmt_addr,
            data_addr,
            state: ServerState::Active,
            weight: 100,
            weight_set: false,
            register_weight: None,
            registered_unix_ms: now,
            updated_unix_ms: now,
            data_mac: None,
            instance: None,
            register_seq: None,
            services: Vec::new(),
        }
    }

    /// Whether a hostagent has ever registered this server with switchd.
    /// switchd writes the data interface's MAC address from every REGISTER
    /// (`data_mac`; records older than that field carried it in the name
    /// as `data_mac=...`); a record created through the API
    /// (`POST /v1/servers`) has none until its hostagent registers. Such a
    /// server is not in switchd's placement: no connection goes to it.
    pub fn hostagent_seen(&self) -> bool {
        self.data_mac.is_some()
            || self
                .name
                .split_whitespace()
                .any(|t| t.starts_with("data_mac="))
    }
}

/// The highest control-channel `seq` a switch accepted from one process of
/// a server (its REGISTER's instance id), written by the active switch every
/// few seconds so that a standby that takes over refuses messages of that
/// process at or below it (replays captured before the takeover), not only
/// those at or below the REGISTER's `seq` ([`Server::register_seq`]). Kept
/// apart from the server record: it changes with every heartbeat, and
/// watchers of servers must not see it as a change of the server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeqFloor {
    pub server: ServerId,
    /// The process (REGISTER instance id, never 0) the seq belongs to.
    pub instance: u64,
    pub seq: u64,
}

/// A service: a VIP:port and the pool of servers behind it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Service {
    /// Unique name; `[A-Za-z0-9_.-]{1,128}`.
    pub name: String,
    pub vip: Ipv4Addr,
    pub port: u16,
    #[serde(with = "server_ids_serde")]
    pub pool: Vec<ServerId>,
}

/// A retired service address whose open connections switchd still serves
/// (retiring, docs/SWITCHD.md): written in the same transaction as the
/// write that retires it, `Store::delete_service` (the service's address)
/// or a `Store::put_service` that moves the service to another VIP:port
/// (the old address), so that a switchd that restarts, or a standby that
/// takes over, keeps serving them, with the retire timeout counted from
/// `deleted_unix_ms`. One per name and address (`service.vip`,
/// `service.port`): a name may retire several addresses at once; a later
/// retire of the same name and address replaces the earlier record. The
/// active switchd forgets it (`Store::forget_retiring_service`) when that
/// address's retiring service has gone.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RetiringService {
    /// The service record as it was when deleted.
    pub service: Service,
    /// When it was deleted or moved away (wall clock).
    pub deleted_unix_ms: u64,
}

impl RetiringService {
    /// The retired address.
    pub fn addr(&self) -> std::net::SocketAddrV4 {
        std::net::SocketAddrV4::new(self.service.vip, self.service.port)
    }
}

/// The server record a REGISTER made (`new`), written over the stored one
/// (`old`): an operator weight stored there (`weight_set`) stays unless
/// `new` sets one itself, and `new`'s weight becomes the REGISTER weight it
/// keeps for `Store::clear_server_weight`. Both backends apply it inside
/// their read-modify-write (`Store::put_registered_server`). `new.state`
/// (switchd's liveness) is written as it is: an operator's drain is the
/// server's `Drain` record, which a REGISTER does not touch.
pub fn merge_registered_server(mut new: Server, old: Option<&Server>) -> Server {
    if let Some(old) = old {
        if old.weight_set && !new.weight_set {
            new.register_weight = Some(new.weight);
            new.weight = old.weight;
            new.weight_set = true;
        }
    }
    new
}

/// `server` with an operator weight `weight` (`Store::set_server_weight`):
/// the weight it had before is kept as the REGISTER weight unless it was
/// the operator's already.
pub(crate) fn with_operator_weight(server: &mut Server, weight: u32) {
    if !server.weight_set {
        server.register_weight = Some(server.weight);
    }
    server.weight = weight;
    server.weight_set = true;
}

/// `server` without an operator weight (`Store::clear_server_weight`): the
/// REGISTER weight it kept comes back (the weight stays when none is
/// known; the server's next REGISTER writes its own).
pub(crate) fn without_operator_weight(server: &mut Server) {
    if let Some(w) = server.register_weight.take() {
        server.weight = w;
    }
    server.weight_set = false;
}

/// Checks a name used inside keys (service names, election names).
pub(crate) fn check_name(what: &'static str, name: &str) -> Result<(), crate::StoreError> {
    let ok = !name.is_empty()
        && name.len() <= 128
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.');
    if ok {
        Ok(())
    } else {
        Err(crate::StoreError::Invalid {
            what,
            reason: format!("{name:?} must be 1-128 characters of [A-Za-z0-9_.-]"),
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TargetSelection {
    RoundRobin,
    LeastLoaded,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Placement {
    Maglev,
    Lwrr,
}

/// What the target does with client packets that arrive between PREPARE-ACK
/// and the import of the connection state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BufferMode {
    Buffer,
    Drop,
}

/// Every migration and placement tunable. Runtime-tunable through the API;
/// components watch `WatchKind::Policy` to pick up changes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Policy {
    /// Proactive migration: shed load when own load exceeds the pool average
    /// by more than `proactive_threshold_pct` percent.
    pub proactive_enabled: bool,
    pub proactive_threshold_pct: f64,
    /// Reactive migration: shed connections whose receive-queue backlog
    /// exceeds `reactive_backlog_threshold` packets.
    pub reactive_enabled: bool,
    pub reactive_backlog_threshold: u32,
    pub target_selection: TargetSelection,
    pub placement: Placement,
    /// A connection is not migrated again within this time.
    pub connection_cooldown_ms: u64,
    /// Global rate cap of outgoing migrations per server.
    pub max_migrations_per_sec_per_server: u32,
    /// Load must fall this many percentage points below the threshold before
    /// a server stops shedding (anti-thrash).
    pub hysteresis_pct: f64,
    /// Interval of the switch's load notifications, microseconds.
    pub load_notification_interval_us: u64,
    /// How often servers send HEARTBEAT (switchd tells them in every
    /// REGISTER_ACK). switchd seeds it from its config when the store holds
    /// no policy yet (`Store::put_policy_if_absent`), then applies the
    /// stored value.
    pub heartbeat_interval_ms: u64,
    /// A server that sent no heartbeat for this long is declared dead by
    /// switchd (seeded from its config, like `heartbeat_interval_ms`).
    pub dead_after_ms: u64,
    /// The origin's migration deadline for an empty snapshot: a migration
    /// not finished within it is given up (hostagents apply it, scaling
    /// their related deadlines; docs/POLICIES.md).
    pub migration_deadline_ms: u64,
    /// What a target does with a connection's client packets that arrive
    /// before its import; a hostagent whose own config says drop drops
    /// whatever this says.
    pub buffer_mode: BufferMode,
}

/// Bounds of `heartbeat_interval_ms`: switchd's own config bounds.
pub const HEARTBEAT_INTERVAL_MS: std::ops::RangeInclusive<u64> = 10..=60_000;
/// Upper bound of `dead_after_ms` (switchd's own config bound); the lower
/// one is twice the heartbeat interval.
pub const DEAD_AFTER_MAX_MS: u64 = 600_000;
/// Bounds of `migration_deadline_ms`: what a hostagent's migration engine
/// takes while keeping its invariants (its other deadlines and the time it
/// remembers finished migrations grow with it).
pub const MIGRATION_DEADLINE_MS: std::ops::RangeInclusive<u64> = 10..=10_000;

impl Default for Policy {
    fn default() -> Self {
        Policy {
            proactive_enabled: true,
            proactive_threshold_pct: 10.0,
            reactive_enabled: true,
            reactive_backlog_threshold: 20,
            target_selection: TargetSelection::RoundRobin,
            placement: Placement::Maglev,
            connection_cooldown_ms: 1_000,
            max_migrations_per_sec_per_server: 1_000,
            hysteresis_pct: 2.0,
            load_notification_interval_us: 1_000,
            // switchd's config defaults; a switchd seeds its own values
            // into a store that holds no policy.
            heartbeat_interval_ms: 100,
            dead_after_ms: 500,
            // What a hostagent's migration engine runs with by default.
            migration_deadline_ms: 50,
            buffer_mode: BufferMode::Buffer,
        }
    }
}

impl Policy {
    /// Checks every field; the error names the first bad one.
    pub fn validate(&self) -> Result<(), PolicyError> {
        fn bad(field: &'static str, reason: impl Into<String>) -> Result<(), PolicyError> {
            Err(PolicyError {
                field,
                reason: reason.into(),
            })
        }
        let p = self;
        if !p.proactive_threshold_pct.is_finite()
            || p.proactive_threshold_pct <= 0.0
            || p.proactive_threshold_pct > 1000.0
        {
            return bad(
                "proactive_threshold_pct",
                format!("must be in (0, 1000], got {}", p.proactive_threshold_pct),
            );
        }
        if p.reactive_backlog_threshold == 0 {
            return bad("reactive_backlog_threshold", "must be at least 1 packet");
        }
        if p.max_migrations_per_sec_per_server == 0 {
            return bad(
                "max_migrations_per_sec_per_server",
                "must be at least 1 (disable the policies instead)",
            );
        }
        if !p.hysteresis_pct.is_finite()
            || p.hysteresis_pct < 0.0
            || p.hysteresis_pct >= p.proactive_threshold_pct
        {
            return bad(
                "hysteresis_pct",
                format!(
                    "must be in [0, proactive_threshold_pct={}), got {}",
                    p.proactive_threshold_pct, p.hysteresis_pct
                ),
            );
        }
        if p.connection_cooldown_ms > 3_600_000 {
            return bad(
                "connection_cooldown_ms",
                format!(
                    "must be at most 1 hour, got {} ms",
                    p.connection_cooldown_ms
                ),
            );
        }
        // switchd's own bounds for its load interval (`load_interval_us`).
        if !(100..=1_000_000).contains(&p.load_notification_interval_us) {
            return bad(
                "load_notification_interval_us",
                format!(
                    "must be in [100 us, 1 s], got {} us",
                    p.load_notification_interval_us
                ),
            );
        }
        if !HEARTBEAT_INTERVAL_MS.contains(&p.heartbeat_interval_ms) {
            return bad(
                "heartbeat_interval_ms",
                format!(
                    "must be in [{}, {}] ms, got {}",
                    HEARTBEAT_INTERVAL_MS.start(),
                    HEARTBEAT_INTERVAL_MS.end(),
                    p.heartbeat_interval_ms
                ),
            );
        }
        if p.dead_after_ms < 2 * p.heartbeat_interval_ms {
            return bad(
                "dead_after_ms",
                format!(
                    "must be at least twice heartbeat_interval_ms={} (one lost heartbeat must not kill a server), got {}",
                    p.heartbeat_interval_ms, p.dead_after_ms
                ),
            );
        }
        if p.dead_after_ms > DEAD_AFTER_MAX_MS {
            return bad(
                "dead_after_ms",
                format!(
                    "must be at most {DEAD_AFTER_MAX_MS} ms, got {}",
                    p.dead_after_ms
                ),
            );
        }
        if !MIGRATION_DEADLINE_MS.contains(&p.migration_deadline_ms) {
            return bad(
                "migration_deadline_ms",
                format!(
                    "must be in [{}, {}] ms, got {}",
                    MIGRATION_DEADLINE_MS.start(),
                    MIGRATION_DEADLINE_MS.end(),
                    p.migration_deadline_ms
                ),
            );
        }
        Ok(())
    }
}

/// One write to the flow-to-server mappings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FlowOp {
    /// The flow is (now) owned by `server`.
    Put { key: FlowKey, server: ServerId },
    /// The flow ended.
    Delete { key: FlowKey },
}

impl FlowOp {
    pub fn key(&self) -> &FlowKey {
        match self {
            FlowOp::Put { key, .. } | FlowOp::Delete { key } => key,
        }
    }
}

/// A stored flow-to-server mapping.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FlowMapping {
    pub key: FlowKey,
    pub server: ServerId,
}

/// Reduces a batch to the last operation per flow, keeping the order of
/// those last operations. Applying the result equals applying the batch.
pub(crate) fn last_op_per_flow(ops: &[FlowOp]) -> Vec<FlowOp> {
    let mut seen = std::collections::HashSet::with_capacity(ops.len());
    let mut out: Vec<FlowOp> = ops
        .iter()
        .rev()
        .filter(|op| seen.insert(*op.key()))
        .copied()
        .collect();
    out.reverse();
    out
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DrainState {
    Running,
    Completed,
    Cancelled,
    /// The deadline passed with connections left on the server.
    TimedOut,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DrainProgress {
    /// Connections on the server when the drain started.
    pub flows_total: u64,
    pub flows_migrated: u64,
    /// Connections that closed by themselves during the drain.
    pub flows_closed: u64,
    pub flows_remaining: u64,
}

/// A drain of one server: the operator's, apart from the server's
/// liveness (`Server::state`). While it is running, timed out or completed
/// the server takes no new connections ([`out_of_placement`]); `undrain`
/// cancels it (the record stays, `Cancelled`, as the server's last drain).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Drain {
    /// The server being drained.
    #[serde(with = "server_id_serde")]
    pub server: ServerId,
    /// Servers to migrate to; empty means any active server of the pool.
    #[serde(with = "server_ids_serde")]
    pub targets: Vec<ServerId>,
    pub started_unix_ms: u64,
    pub deadline_unix_ms: u64,
    pub state: DrainState,
    pub progress: DrainProgress,
}

/// An operator action, as submitted.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AuditRecord {
    /// Who: API token name, `system`, ...
    pub actor: String,
    /// What: `server.drain`, `policy.update`, ...
    pub action: String,
    /// On what: `s3`, `service/web`, ...
    pub target: String,
    /// Free-form details (request body, old and new values).
    pub detail: serde_json::Value,
}

/// A stored audit entry; `seq` increases strictly in append order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AuditEntry {
    pub seq: u64,
    pub at_unix_ms: u64,
    pub record: AuditRecord,
}

/// Who leads an election.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LeaderInfo {
    pub election: String,
    pub candidate: String,
    /// Fencing token: strictly increases each time the leadership changes
    /// hands (or is re-won), so stale leaders can be told apart.
    pub term: u64,
    pub lease_id: i64,
}

/// Proof of leadership returned by a won campaign; pass it to `keep_alive`
/// and `resign`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaderLease {
    pub info: LeaderInfo,
    pub ttl: Duration,
}

/// Which changes a watcher wants.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WatchKind {
    Servers,
    Services,
    Policy,
    Drains,
    Audit,
    Leader,
}

impl WatchKind {
    pub const ALL: [WatchKind; 6] = [
        WatchKind::Servers,
        WatchKind::Services,
        WatchKind::Policy,
        WatchKind::Drains,
        WatchKind::Audit,
        WatchKind::Leader,
    ];
}

/// A typed change. Flow mappings are not watched: they change at packet
/// rate and a standby reads them with `scan_flows` when it takes over.
#[derive(Debug, Clone, PartialEq)]
pub enum Change {
    ServerPut(Server),
    ServerDeleted(ServerId),
    ServicePut(Service),
    ServiceDeleted(String),
    PolicyPut(Policy),
    DrainPut(Drain),
    DrainDeleted(ServerId),
    AuditAppended(AuditEntry),
    /// `leader` is `None` when the leader resigned or its lease expired.
    LeaderChanged {
        election: String,
        leader: Option<LeaderInfo>,
    },
}

impl Change {
    pub fn kind(&self) -> WatchKind {
        match self {
            Change::ServerPut(_) | Change::ServerDeleted(_) => WatchKind::Servers,
            Change::ServicePut(_) | Change::ServiceDeleted(_) => WatchKind::Services,
            Change::PolicyPut(_) => WatchKind::Policy,
            Change::DrainPut(_) | Change::DrainDeleted(_) => WatchKind::Drains,
            Change::AuditAppended(_) => WatchKind::Audit,
            Change::LeaderChanged { .. } => WatchKind::Leader,
        }
    }
}

/// A change with the store revision at which it happened (monotonic per
/// backend; not comparable across backends).
#[derive(Debug, Clone, PartialEq)]
pub struct WatchEvent {
    pub revision: u64,
    pub change: Change,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_registered_record_was_seen_by_a_hostagent() {
        let mgmt: SocketAddr = "10.0.1.11:7000".parse().unwrap();
        let data = Ipv4Addr::new(10, 0, 2, 11);
        // What `POST /v1/servers` stores.
        let api = Server::new(ServerId(1), "web1", mgmt, data);
        assert!(!api.hostagent_seen());
        // What switchd writes from the server's REGISTER, merged over it.
        let mut reg = Server::new(ServerId(1), "s1", mgmt, data);
        reg.data_mac = Some("02:00:00:00:00:01".into());
        assert!(merge_registered_server(reg, Some(&api)).hostagent_seen());
        // A record from before `data_mac` carried it in the name.
        let old = Server::new(ServerId(2), "s2 data_mac=02:00:00:00:00:02", mgmt, data);
        assert!(old.hostagent_seen());
    }

    /// The shown state is the drain's while it holds the server, whatever
    /// the record's liveness; the record's otherwise (a drain state a
    /// previous version wrote there included).
    #[test]
    fn a_drain_is_shown_over_liveness_and_undrain_gives_liveness_back() {
        let mgmt: SocketAddr = "10.0.1.11:7000".parse().unwrap();
        let mut s = Server::new(ServerId(1), "s1", mgmt, Ipv4Addr::new(10, 0, 2, 11));
        use DrainState::*;
        use ServerState::*;
        for (liveness, drain, shown) in [
            (Active, None, Active),
            (Dead, None, Dead),
            (Active, Some(Running), Draining),
            (Dead, Some(Running), Draining),
            (Active, Some(TimedOut), Draining),
            (Active, Some(Completed), Drained),
            (Dead, Some(Completed), Drained),
            (Active, Some(Cancelled), Active),
            (Dead, Some(Cancelled), Dead),
            // Written by a previous version: a drain until undrain.
            (Draining, None, Draining),
            (Drained, None, Drained),
            (Drained, Some(Cancelled), Drained),
            (Draining, Some(Completed), Drained),
        ] {
            s.state = liveness;
            assert_eq!(shown_state(&s, drain), shown, "{liveness:?} {drain:?}");
            assert_eq!(
                out_of_placement(&s, drain),
                matches!(shown, Draining | Drained),
                "{liveness:?} {drain:?}"
            );
        }
    }

    /// A REGISTER writes its liveness over any stored state: the drain is
    /// not in the server record.
    #[test]
    fn a_register_writes_its_own_state() {
        let mgmt: SocketAddr = "10.0.1.11:7000".parse().unwrap();
        let data = Ipv4Addr::new(10, 0, 2, 11);
        let reg = Server::new(ServerId(1), "s1", mgmt, data);
        for st in [
            ServerState::Dead,
            ServerState::Draining,
            ServerState::Drained,
        ] {
            let mut old = reg.clone();
            old.state = st;
            assert_eq!(
                merge_registered_server(reg.clone(), Some(&old)).state,
                ServerState::Active
            );
        }
    }
}
