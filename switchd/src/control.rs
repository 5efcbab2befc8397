//! The switch control plane, sans-IO: it is driven with `now` and talks to
//! the packet path only through a [`DataPlane`]. It registers servers,
//! tracks their heartbeats, computes placement (weighted Maglev, or LWRR
//! rings) and migration-target rings, pushes them as deltas, runs the pool
//! monitor, and hands flow events to a [`FlowEventSink`] in batches.
//!
//! Invariants:
//! - Only LIVE servers appear in Maglev tables, LWRR rings and target rings;
//!   DRAINING servers keep their flows.
//! - A DEAD server (no heartbeat for `dead_after`) is out of placement at
//!   once, but its flow entries stay for `dead_flow_grace` (the data plane
//!   drops their packets meanwhile, so clients retransmit): a server that
//!   stalled (GC pause, CPU starvation, network blip) and heartbeats or
//!   re-registers as the same instance within the grace gets them back
//!   untouched. At the end of the grace, or at once when it re-registers as
//!   another instance (a restart: its connections are gone), they are
//!   removed and reported closed, so the store forgets a flow exactly when
//!   the data plane does.
//! - The shadow copy of every Maglev table is what the data plane holds, so
//!   a change pushes only the slots that differ.
//! - A LIVE server that reports its application down for a service (HEARTBEAT
//!   health bits) leaves that service's placement and target rings, and only
//!   those: its state stays LIVE, its flows keep their entries. When every
//!   live member of a service is down, placement keeps them all (fail open:
//!   some errors rather than none served), targets keep none. Health changes
//!   rewrite tables at most once per [`HEALTH_PUSH_EVERY`].
//! - A service refuses new connections (`SVC_REFUSE`: the data plane answers
//!   a SYN that finds no usable server with a reset, "connection refused",
//!   instead of dropping it) only when it has members and every one is out
//!   for a lasting reason: drained or draining by the operator, operator
//!   weight 0, or dead past its `dead_flow_grace` (see
//!   [`ControlPlane::refusing`]); and not before [`ControlPlane::allow_refusals_from`]
//!   (an active switchd: `dead_after` after it became active). No member
//!   known, or a member dead within its grace (it may come back): the SYN is
//!   dropped, and the client's retransmission may be placed.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::net::{Ipv4Addr, SocketAddrV4};

use capybara_proto::{FlowKey, Instant, ServerId};

use crate::abi::*;
use crate::dataplane::{DataPlane, FlowEvent, Result};
use crate::maglev::{self, Backend};

/// How PREPAREs without an explicit target are steered (seed §5.3).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TargetPolicy {
    RoundRobin,
    LeastLoaded,
}

/// How new flows are placed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    Maglev,
    /// Load-aware weighted round robin (the baseline).
    Lwrr,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Liveness {
    Live,
    Draining,
    Dead,
}

#[derive(Debug, Clone)]
pub struct Server {
    /// What it registered with (its weight at least 1).
    pub reg: Registration,
    pub index: u32,
    pub liveness: Liveness,
    pub last_heartbeat: Instant,
    /// When it was declared DEAD (`None` while not dead).
    pub dead_since: Option<Instant>,
    /// DEAD with its flow entries kept until this instant (`None`: not
    /// dead, or its entries are gone).
    pub flows_kept_until: Option<Instant>,
    /// What it returns as within the grace (LIVE or DRAINING).
    revive_as: Liveness,
    /// Packets in the last pool-monitor interval.
    pub load: u64,
    /// Packets per second, exponentially smoothed over [`LOAD_SMOOTHING`]:
    /// what least-loaded target selection ranks by (one interval holds a
    /// handful of packets, too noisy to rank on).
    pub load_pps: f64,
    last_counter: u64,
    /// Services whose application this server reports down (HEARTBEAT
    /// health bits): out of their placement and targets.
    pub backend_down: BTreeSet<SocketAddrV4>,
    /// Its heartbeats report application health at all (a hostagent that
    /// predates health checks, or runs without them, does not).
    pub health_reported: bool,
    /// The services its REGISTER listed: it joins them (also ones added
    /// later) whatever their configured pool.
    pub wanted: Vec<SocketAddrV4>,
    /// Its process is stopping (HEARTBEAT LEAVING): out of placement and
    /// targets like a drain, flows kept, but not the operator's drain
    /// (`liveness` and [`Server::draining`] do not show it). Follows the
    /// latest heartbeat.
    pub leaving: bool,
    /// DEAD because its last instance said it stopped (HEARTBEAT STOPPED);
    /// false again once it registers.
    pub stopped: bool,
}

impl Server {
    /// Draining by the operator: DRAINING, or DEAD and to come back
    /// DRAINING.
    pub fn draining(&self) -> bool {
        self.liveness == Liveness::Draining
            || (self.liveness == Liveness::Dead && self.revive_as == Liveness::Draining)
    }

    /// LIVE and not leaving: takes new connections and migrations.
    pub fn placeable(&self) -> bool {
        self.liveness == Liveness::Live && !self.leaving
    }

    /// Whether it reports the application of service `vip:port` down.
    pub fn backend_is_down(&self, vip: Ipv4Addr, port: u16) -> bool {
        self.backend_down.contains(&SocketAddrV4::new(vip, port))
    }

    /// Whether its REGISTER lists services and not `addr`: its stack
    /// leaves a connection to `addr` unanswered, so it takes none of
    /// them, even where a pool names it.
    pub fn serves_not(&self, addr: SocketAddrV4) -> bool {
        !self.wanted.is_empty() && !self.lists(addr)
    }

    /// Whether its REGISTER lists service `addr` (a listed 0.0.0.0:port
    /// stands for every VIP on that port: the stack matches by port).
    fn lists(&self, addr: SocketAddrV4) -> bool {
        self.wanted
            .iter()
            .any(|w| *w == addr || (w.ip().is_unspecified() && w.port() == addr.port()))
    }
}

/// What a server needs to register (REGISTER, or a record from the store).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Registration {
    pub id: ServerId,
    pub data_ip: Ipv4Addr,
    pub mac: [u8; 6],
    pub ifindex: u32,
    pub src_mac: [u8; 6],
    pub weight: u32,
    /// The server process's instance id from its REGISTER (0: not sent, or
    /// restored from a record that predates it).
    pub instance: u64,
}

/// Why a server's flow entries were removed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FlowsRemovedWhy {
    /// Declared dead with `dead_flow_grace` 0.
    DeadNoGrace,
    /// Dead for the whole grace.
    GraceEnded,
    /// It registered as another instance: a restarted process.
    Restarted { old: u64, new: u64 },
    /// Another server id registered with its (dead) data address.
    AddressReused,
    /// Its process said it stopped (HEARTBEAT STOPPED): nothing serves
    /// them any more.
    Stopped,
}

/// A liveness transition, for logs, metrics and the store (see
/// [`ControlPlane::take_liveness_events`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LivenessEvent {
    /// Missed heartbeats for `dead_after`: out of placement. Its flows are
    /// kept until `flows_kept_until` (`None`: no grace, removed at once).
    Died {
        id: ServerId,
        flows_kept_until: Option<Instant>,
    },
    /// Heartbeat (`by_register` false) or same-instance REGISTER within the
    /// grace: back in placement with every flow it had.
    Returned {
        id: ServerId,
        dead_for: std::time::Duration,
        by_register: bool,
    },
    /// Its flow entries were removed (and reported closed).
    FlowsRemoved {
        id: ServerId,
        flows: usize,
        why: FlowsRemovedWhy,
    },
    /// Its heartbeats started (`on`) or stopped saying LEAVING: its process
    /// is stopping, out of placement and targets, flows kept.
    Leaving { id: ServerId, on: bool },
    /// Its process said it stopped (HEARTBEAT STOPPED): DEAD at once, no
    /// `dead_after` wait, no grace; `flows` entries were left and removed.
    Stopped { id: ServerId, flows: usize },
}

/// Liveness counters (`/status.liveness`, `/metrics`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LivenessCounters {
    pub died_total: u64,
    /// Came back within the grace (flows kept).
    pub returned_total: u64,
    pub grace_ended_total: u64,
    /// Flow entries removed at the end of a grace (or at death, no grace).
    pub dead_flows_removed_total: u64,
    /// REGISTERs as another instance while the old one had flows.
    pub restarts_total: u64,
    pub restart_flows_removed_total: u64,
    /// HEARTBEAT STOPPED from a server that was not dead yet.
    pub stopped_total: u64,
    /// Flow entries removed because their server stopped.
    pub stopped_flows_removed_total: u64,
}

/// Default `dead_flow_grace`: longer than the stalls seen in practice (GC
/// pauses, CPU starvation under load, VM live migration, a short network
/// blip: up to a few seconds), short enough that the clients of a server
/// that is really gone learn it on their next retransmission after it
/// (TCP backoff puts that within seconds), not after the ~15 minutes a
/// Linux client retransmits into silence.
pub const DEFAULT_DEAD_FLOW_GRACE: std::time::Duration = std::time::Duration::from_secs(10);

/// Time constant of the smoothed server loads.
pub const LOAD_SMOOTHING: std::time::Duration = std::time::Duration::from_millis(20);

/// Health changes rewrite the tables at most this often (a burst of
/// changes within it is applied together at the end); the hostagents'
/// fall/rise thresholds already damp a flapping application.
pub const HEALTH_PUSH_EVERY: std::time::Duration = std::time::Duration::from_millis(200);

/// An application-health change, for logs and counters (see
/// [`ControlPlane::take_health_events`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HealthEvent {
    /// Server `id` reports the application of `service` down (`down`) or
    /// back up.
    Backend {
        id: ServerId,
        service: SocketAddrV4,
        down: bool,
    },
    /// Every live member of `service` is down: placement keeps them all
    /// (`on`), or a member is up again (`!on`).
    FailOpen { service: SocketAddrV4, on: bool },
    /// Every member of `service` is out for a lasting reason: new
    /// connections are refused (`on`), or a member can take them again, or
    /// the service has no member, or is retiring (`!on`).
    Refusing { service: SocketAddrV4, on: bool },
}

#[derive(Debug, Clone)]
pub struct Service {
    /// The operators' name (the store's record, or the config's).
    pub name: String,
    /// Follows the policy's global placement (the config names none of
    /// its own for it).
    pub follows_global: bool,
    pub vip: Ipv4Addr,
    pub port: u16,
    pub index: u32,
    pub placement: Placement,
    /// Members and their weights. Only LIVE members are placed on.
    pub pool: BTreeMap<ServerId, u32>,
    /// Members named by the configuration (their weight is the configured one).
    configured: BTreeMap<ServerId, u32>,
    /// Every registered server joins (configured with an empty pool).
    pub open: bool,
    maglev_shadow: Vec<u32>,
    /// Every live member reports its application down: placement keeps them
    /// all (fail open).
    pub fail_open: bool,
    /// New connections are refused (`SVC_REFUSE`, see
    /// [`ControlPlane::refusing`]).
    pub refusing: bool,
    /// Deleted (no longer in the store) at this time: its established
    /// connections are still forwarded and migrated, nothing new is placed
    /// on it; it goes when none is left, or after
    /// [`ControlConfig::service_retire_timeout`] (see
    /// [`ControlPlane::end_retired`]).
    pub retiring: Option<Instant>,
    /// How long it had been retiring before this control plane took it
    /// over ([`ControlPlane::restore_retiring`]: deleted while another
    /// switchd, or this one before a restart, served it): counts towards
    /// the retire timeout.
    retired_before: std::time::Duration,
    /// From the config at start, not yet confirmed by the store
    /// ([`ControlPlane::mark_provisional`]): if the store does not list it,
    /// it goes at once (nothing was ever placed on it).
    provisional: bool,
}

impl Service {
    /// How long it has been retiring at `now` (since its delete, also
    /// when that was seen by another switchd); `None`: it does not retire.
    pub fn retiring_for(&self, now: Instant) -> Option<std::time::Duration> {
        self.retiring
            .map(|t| now.saturating_since(t) + self.retired_before)
    }

    pub fn addr(&self) -> SocketAddrV4 {
        SocketAddrV4::new(self.vip, self.port)
    }
}

/// A deleted service the store still records as retiring
/// (`capybara_store::RetiringService`), for
/// [`ControlPlane::restore_retiring`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetiringSpec {
    pub spec: ServiceSpec,
    /// How long ago it was deleted (wall clock, from the record).
    pub retired_for: std::time::Duration,
}

/// What [`ControlPlane::restore_retiring`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RetiringRestores {
    /// Restored as retiring (not served before).
    pub restored: Vec<String>,
    /// Not restored, and why (its VIP:port is served again, no free slot,
    /// retiring is off).
    pub skipped: Vec<(String, String)>,
}

/// How a service's pool is formed (see `config::ServiceConfig`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PoolSpec {
    /// Configured members and weights (0: the weight of its REGISTER).
    pub members: Vec<(ServerId, u32)>,
    /// Every registered server joins (with its REGISTER weight).
    pub open: bool,
}

/// A service as the store (or the config) describes it: what
/// [`ControlPlane::apply_services`] makes the data plane serve.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServiceSpec {
    pub name: String,
    pub addr: SocketAddrV4,
    pub placement: Placement,
    /// Follows the policy's global placement when it changes.
    pub follows_global: bool,
    pub pool: PoolSpec,
}

/// What [`ControlPlane::apply_services`] changed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ServiceChanges {
    pub added: Vec<String>,
    pub updated: Vec<String>,
    /// Removed services and how many flow entries went with them.
    pub removed: Vec<(String, usize)>,
    /// Deleted services whose open connections are kept until they end
    /// (retiring; removed later by [`ControlPlane::end_retired`]).
    pub retiring: Vec<String>,
    /// Specs not applied, and why (a VIP:port or name used twice, no free
    /// service slot).
    pub rejected: Vec<(String, String)>,
}

impl ServiceChanges {
    /// Why the spec named `name` was not applied (`None`: it was).
    pub fn why_rejected(&self, name: &str) -> Option<String> {
        self.rejected
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, why)| why.clone())
    }

    pub fn is_empty(&self) -> bool {
        self.added.is_empty()
            && self.updated.is_empty()
            && self.removed.is_empty()
            && self.retiring.is_empty()
            && self.rejected.is_empty()
    }
}

/// One LOAD-NOTIFICATION to send (the driver encodes it with
/// `capybara_proto::load::LoadRepr`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoadReport {
    pub server: ServerId,
    pub data_ip: Ipv4Addr,
    pub own_load: u64,
    pub pool_load: u64,
    pub live_servers: u32,
    pub least_loaded: Ipv4Addr,
    /// This server's weight and the pool's total weight, when the pool's
    /// weights differ (LOAD-NOTIFICATION version 2); `None`: all equal.
    pub weights: Option<capybara_proto::load::LoadWeights>,
}

/// A flow event with server indexes resolved to server ids, as the store
/// wants it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FlowUpdate {
    pub event: FlowEvent,
    pub key: FlowKey,
    /// Owner after the event (`None`: index not (or no longer) registered).
    pub owner: Option<ServerId>,
}

/// Where flow events go (the store). Called off the packet path, in batches.
pub trait FlowEventSink {
    fn write_batch(&mut self, events: &[FlowUpdate]);
}

/// A sink that keeps everything (tests).
#[derive(Debug, Default)]
pub struct VecSink(pub Vec<FlowEvent>);
impl FlowEventSink for VecSink {
    fn write_batch(&mut self, events: &[FlowUpdate]) {
        self.0.extend(events.iter().map(|u| u.event));
    }
}

#[derive(Debug, Clone)]
pub struct ControlConfig {
    pub dead_after: std::time::Duration,
    pub target_policy: TargetPolicy,
    /// How long the entries of a closed flow stay (last ACKs, TIME-WAIT
    /// retransmissions) before the control plane reaps them.
    pub closed_linger: std::time::Duration,
    /// How long a DEAD server's flow entries are kept for it to come back
    /// (0: removed at once).
    pub dead_flow_grace: std::time::Duration,
    /// How long a deleted service's open connections are kept (retiring)
    /// before they are ended (0: ended at once, with the service).
    pub service_retire_timeout: std::time::Duration,
}

/// Default `service_retire_timeout`: as long as the connection draining of
/// common load balancers (5 minutes): long enough for requests and
/// downloads in progress, short enough that a forgotten connection does not
/// hold a service slot for good.
pub const DEFAULT_SERVICE_RETIRE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(300);

/// A retiring service whose flow table holds none of its connections in
/// this many consecutive complete scans is removed (a scan of a table that
/// changes under it may miss an entry once; twice in a row it would have to
/// miss it in two independent passes).
const RETIRE_EMPTY_SCANS: u32 = 2;

/// Flow entries read per [`ControlPlane::end_retired`] call.
const RETIRE_SCAN_BUDGET: usize = 16 * 1024;

/// A service that [`ControlPlane::end_retired`] removed, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetiredService {
    pub name: String,
    pub addr: SocketAddrV4,
    /// Flow entries removed with it (connections ended: 0 when its last
    /// connection had closed).
    pub flows: usize,
    /// The retire timeout ended it (else: no connection was left).
    pub timed_out: bool,
}

/// The flow-table pass that tells whether retiring services still have
/// connections.
#[derive(Debug, Default)]
struct RetireScan {
    cursor: crate::dataplane::FlowScanCursor,
    /// When the pass in progress started (services retired later are not
    /// judged by it).
    started: Option<Instant>,
    /// Flow entries seen so far in this pass, by service address.
    seen: BTreeMap<SocketAddrV4, usize>,
    /// Consecutive complete passes without a connection, by service.
    empty_passes: BTreeMap<SocketAddrV4, u32>,
    /// Flow entries of each retiring service at the last complete pass.
    last_counts: BTreeMap<SocketAddrV4, usize>,
    buf: Vec<(CFlowKey, CFlow)>,
}

impl ControlConfig {
    pub fn new(dead_after: std::time::Duration, target_policy: TargetPolicy) -> Self {
        ControlConfig {
            dead_after,
            target_policy,
            closed_linger: std::time::Duration::from_secs(5),
            dead_flow_grace: DEFAULT_DEAD_FLOW_GRACE,
            service_retire_timeout: DEFAULT_SERVICE_RETIRE_TIMEOUT,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error(transparent)]
    DataPlane(#[from] crate::dataplane::DataPlaneError),
    #[error("no free server slot (max {MAX_SERVERS})")]
    ServersFull,
    #[error("no free service slot (max {MAX_SERVICES})")]
    ServicesFull,
    #[error("unknown server {0}")]
    UnknownServer(ServerId),
    #[error("data address {addr} is already used by server {owner}")]
    AddressInUse { addr: Ipv4Addr, owner: ServerId },
    #[error("SET_OWNER from {sender} for {key}: {reason}")]
    SetOwnerRefused {
        sender: ServerId,
        key: FlowKey,
        reason: &'static str,
    },
}

/// How long the control plane remembers the FLOWS claims it judged, to
/// settle a conflicting claim of another server (reports of one recovery
/// arrive within seconds of each other).
pub const CLAIM_MEMORY: std::time::Duration = std::time::Duration::from_secs(60);

/// A FLOWS claim the control plane judged ([`ControlPlane::claim_flow`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct JudgedClaim {
    server: ServerId,
    epoch: u64,
    /// When the claimant took the connection, on this switch's clock
    /// (arrival minus the claim's age).
    owned_since: Instant,
    /// When the claim arrived.
    at: Instant,
}

/// What became of one FLOWS claim ([`ControlPlane::claim_flow`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClaimOutcome {
    /// The flow now goes to the claimant (it had no mapping, or another
    /// server's, from the store, a placement or an earlier claim).
    Applied,
    /// The flow already went to the claimant.
    Agreed,
    /// A migration of the flow is in progress (pending entry): the data
    /// plane settles its owner, the claim is not applied.
    InProgress,
    /// Another server claimed the flow with a later ownership: it keeps it.
    LaterClaim,
    /// The data plane moved the flow by a live migration in the last
    /// [`LIVE_MOVE_MEMORY`]: the claim was built before it (a report
    /// batch in flight, or sent again, while the connection migrated
    /// away), so the data plane's owner stands.
    MovedSince,
    /// The flow's service is not served here.
    UnknownService,
}

/// FLOWS claims by outcome (`/status` `flow_claims`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ClaimCounters {
    pub applied: u64,
    pub agreed: u64,
    pub in_progress: u64,
    pub later_claim: u64,
    pub moved_since: u64,
    pub unknown_service: u64,
}

/// How long a live migration seen in the data plane's events outranks FLOWS
/// claims of the flow ([`ClaimOutcome::MovedSince`]): longer than a report
/// batch lives (a hostagent sends one at most 10 times, 200 ms apart), so a
/// claim built before the migration cannot undo it. A claim built after it
/// comes from the new owner (the origin no longer holds the connection)
/// and agrees.
pub const LIVE_MOVE_MEMORY: std::time::Duration = std::time::Duration::from_secs(10);

pub struct ControlPlane<D: DataPlane> {
    pub dp: D,
    /// FLOWS claims judged in the last [`CLAIM_MEMORY`], by flow.
    claims: std::collections::HashMap<FlowKey, JudgedClaim>,
    /// Flows the data plane moved by a live migration (its events) in the
    /// last [`LIVE_MOVE_MEMORY`], when seen.
    live_moves: std::collections::HashMap<FlowKey, Instant>,
    last_move_prune: Instant,
    last_claim_prune: Instant,
    pub claim_counters: ClaimCounters,
    cfg: ControlConfig,
    /// While a lowered `dead_after` is not yet in force (the store's policy
    /// lowered it): until when, and the value that holds until then.
    dead_after_held: Option<(Instant, std::time::Duration)>,
    servers: BTreeMap<ServerId, Server>,
    services: Vec<Service>,
    events: Vec<FlowEvent>,
    /// Flows reported closed, oldest first: reaped after `closed_linger`.
    closing: VecDeque<(Instant, CFlowKey)>,
    /// Entries removed by the closed-flow reaper so far.
    pub reaped_total: u64,
    last_tick: Option<Instant>,
    liveness_events: Vec<LivenessEvent>,
    pub liveness: LivenessCounters,
    health_events: Vec<HealthEvent>,
    /// Health changes not yet in the tables (rate limit).
    health_dirty: bool,
    last_health_push: Option<Instant>,
    /// Application-health changes reported by servers.
    pub health_changes_total: u64,
    /// Table rewrites for health changes.
    pub health_pushes_total: u64,
    retire_scan: RetireScan,
    /// Weights an operator set in the store (`Server::weight_set`), by
    /// server: they replace the REGISTER's; 0 takes the server out of
    /// placement and migration targets (its connections stay).
    operator_weights: BTreeMap<ServerId, u32>,
    /// From when services may refuse new connections
    /// ([`Self::allow_refusals_from`]; `None`: never, e.g. a standby).
    refuse_from: Option<Instant>,
    /// `refuse_from` has passed (seen by [`Self::tick`]).
    refusals_on: bool,
}

impl<D: DataPlane> ControlPlane<D> {
    pub fn new(dp: D, cfg: ControlConfig) -> Self {
        ControlPlane {
            dp,
            claims: std::collections::HashMap::new(),
            live_moves: std::collections::HashMap::new(),
            last_move_prune: Instant::ZERO,
            last_claim_prune: Instant::ZERO,
            claim_counters: ClaimCounters::default(),
            cfg,
            dead_after_held: None,
            servers: BTreeMap::new(),
            services: Vec::new(),
            events: Vec::new(),
            closing: VecDeque::new(),
            reaped_total: 0,
            last_tick: None,
            liveness_events: Vec::new(),
            liveness: LivenessCounters::default(),
            health_events: Vec::new(),
            health_dirty: false,
            last_health_push: None,
            health_changes_total: 0,
            health_pushes_total: 0,
            retire_scan: RetireScan::default(),
            operator_weights: BTreeMap::new(),
            refuse_from: None,
            refusals_on: false,
        }
    }

    /// Services may refuse new connections from `at` on (the first
    /// [`Self::tick`] at or after it turns refusals on). Until then a SYN
    /// that finds no usable server is dropped whatever the reason: an
    /// active switchd passes `dead_after` after it became active, so that
    /// the servers restored from the store have been heard from (REGISTER,
    /// heartbeats) before their state can refuse a client.
    pub fn allow_refusals_from(&mut self, at: Instant) {
        self.refuse_from = Some(at);
        self.refusals_on = false;
    }

    /// Whether server `s` is out of placement for a lasting reason: drained
    /// or draining by the operator (also dead and to come back draining),
    /// operator weight 0, or dead past its `dead_flow_grace` (its flows are
    /// gone; a heartbeat alone does not bring it back). A server dead
    /// within its grace is not: it may heartbeat again any moment.
    fn out_for_good(&self, s: &Server) -> bool {
        self.operator_weights.get(&s.reg.id) == Some(&0)
            || s.draining()
            || (s.liveness == Liveness::Dead && s.flows_kept_until.is_none())
    }

    /// Whether service `i` refuses new connections: refusals are on
    /// ([`Self::allow_refusals_from`]), it is not retiring (that resets
    /// anyway), it has members, and every member is out for a lasting
    /// reason ([`Self::out_for_good`]). An empty pool does not refuse: no
    /// server registered for it (yet), and one may any moment.
    pub fn refusing(&self, i: usize) -> bool {
        let svc = &self.services[i];
        let addr = svc.addr();
        self.refusals_on
            && svc.retiring.is_none()
            && !svc.pool.is_empty()
            && svc.pool.keys().all(|id| {
                self.servers
                    .get(id)
                    .is_some_and(|s| self.out_for_good(s) || s.serves_not(addr))
            })
    }

    /// Brings every service's `SVC_REFUSE` flag up to date (written only
    /// where it changes), after the tables: a service starts refusing once
    /// its tables name no server, and the data plane refuses only a SYN
    /// that its own lookup finds no usable server for.
    fn refresh_refusals(&mut self) -> Result<()> {
        for i in 0..self.services.len() {
            let on = self.refusing(i);
            if self.services[i].refusing == on {
                continue;
            }
            self.services[i].refusing = on;
            self.health_events.push(HealthEvent::Refusing {
                service: self.services[i].addr(),
                on,
            });
            self.write_service_key(i)?;
        }
        Ok(())
    }

    /// Server `s`'s weight: the operator's if one is set, else its
    /// REGISTER's.
    pub fn weight_of(&self, s: &Server) -> u32 {
        self.operator_weights
            .get(&s.reg.id)
            .copied()
            .unwrap_or(s.reg.weight)
    }

    /// The operator weights in force.
    pub fn operator_weights(&self) -> &BTreeMap<ServerId, u32> {
        &self.operator_weights
    }

    /// Makes the operator weights exactly `weights` (the store's records
    /// with `weight_set`; servers not named go back to their REGISTER's
    /// weight) and rebuilds pools and tables if that changes anything.
    /// Weights of servers not registered yet apply when they register.
    /// Returns whether anything changed.
    pub fn set_operator_weights(&mut self, weights: BTreeMap<ServerId, u32>) -> Result<bool> {
        if weights == self.operator_weights {
            return Ok(false);
        }
        let old = std::mem::replace(&mut self.operator_weights, weights);
        for i in 0..self.services.len() {
            let pool = self.pool_of(&self.services[i]);
            self.services[i].pool = pool;
        }
        let ids: Vec<ServerId> = self.servers.keys().copied().collect();
        for id in ids {
            if old.get(&id) != self.operator_weights.get(&id) {
                self.push_server(id)?;
            }
        }
        self.push_tables()?;
        Ok(true)
    }

    /// Application-health changes since the last call, oldest first.
    pub fn take_health_events(&mut self) -> Vec<HealthEvent> {
        std::mem::take(&mut self.health_events)
    }

    /// What server `id`'s heartbeat says of its applications: `reported`
    /// false (no health bits: every service up), else the services whose
    /// application is down. A change leaves (or rejoins) those services'
    /// placement and targets: at once, or at the end of
    /// [`HEALTH_PUSH_EVERY`] after the previous health rewrite (see
    /// [`Self::tick`]). Unknown server: nothing to do.
    pub fn set_backend_health(
        &mut self,
        now: Instant,
        id: ServerId,
        reported: bool,
        down: &[SocketAddrV4],
    ) -> Result<()> {
        let Some(s) = self.servers.get_mut(&id) else {
            return Ok(());
        };
        s.health_reported = reported;
        let new: BTreeSet<SocketAddrV4> = if reported {
            down.iter().copied().collect()
        } else {
            BTreeSet::new()
        };
        if new == s.backend_down {
            return Ok(());
        }
        for svc in s.backend_down.symmetric_difference(&new) {
            self.health_changes_total += 1;
            self.health_events.push(HealthEvent::Backend {
                id,
                service: *svc,
                down: new.contains(svc),
            });
        }
        s.backend_down = new;
        self.health_dirty = true;
        self.apply_health(now)
    }

    /// Pushes pending health changes unless the last health rewrite was
    /// less than [`HEALTH_PUSH_EVERY`] ago.
    fn apply_health(&mut self, now: Instant) -> Result<()> {
        if !self.health_dirty
            || self
                .last_health_push
                .is_some_and(|t| now.saturating_since(t) < HEALTH_PUSH_EVERY)
        {
            return Ok(());
        }
        self.health_dirty = false;
        self.last_health_push = Some(now);
        self.health_pushes_total += 1;
        // Only the per-service tables change: the server stays LIVE in the
        // data plane (its other services, its flows), so no slot ever names
        // a server the data plane would drop a SYN for.
        self.push_tables()
    }

    /// Liveness transitions since the last call, oldest first.
    pub fn take_liveness_events(&mut self) -> Vec<LivenessEvent> {
        std::mem::take(&mut self.liveness_events)
    }

    pub fn dead_flow_grace(&self) -> std::time::Duration {
        self.cfg.dead_flow_grace
    }

    /// The heartbeat silence after which a server is declared dead, in
    /// force at `now`: the configured one, or during the hold of a
    /// decrease ([`ControlPlane::set_dead_after`]) the larger one before it.
    pub fn dead_after(&self, now: Instant) -> std::time::Duration {
        match self.dead_after_held {
            Some((until, held)) if now < until => held.max(self.cfg.dead_after),
            _ => self.cfg.dead_after,
        }
    }

    /// When a lowered `dead_after` comes fully into force (`None`: it is).
    pub fn dead_after_held_until(&self, now: Instant) -> Option<Instant> {
        self.dead_after_held
            .filter(|(until, held)| now < *until && *held > self.cfg.dead_after)
            .map(|(until, _)| until)
    }

    /// Changes `dead_after` at run time (the store's policy). An increase
    /// applies at once. A decrease applies after twice the value in force
    /// before it, which holds until then: servers heartbeat at the interval
    /// that went with the old value until the REGISTER_ACK that carries the
    /// new interval reaches them (the switch re-sends it), and a change must
    /// not make a live server look dead. Returns when the new value is in
    /// force.
    pub fn set_dead_after(&mut self, now: Instant, dead_after: std::time::Duration) -> Instant {
        let before = self.dead_after(now);
        self.cfg.dead_after = dead_after;
        if dead_after < before {
            let until = now + before * 2;
            self.dead_after_held = Some((until, before));
            until
        } else {
            self.dead_after_held = None;
            now
        }
    }

    pub fn target_policy(&self) -> TargetPolicy {
        self.cfg.target_policy
    }

    /// Switches PREPARE steering at run time (the store's policy changed).
    pub fn set_target_policy(&mut self, policy: TargetPolicy) -> Result<()> {
        if self.cfg.target_policy != policy {
            self.cfg.target_policy = policy;
            self.push(false)?;
        }
        Ok(())
    }

    pub fn services(&self) -> &[Service] {
        &self.services
    }

    /// Switches how service `index` places new connections (the store's
    /// policy changed). Established flows keep their server: they are in
    /// the flow table. Maglev tables and LWRR rings are kept for every
    /// service whatever it uses, so this only flips the data plane's
    /// selector. Unknown index: nothing to do.
    pub fn set_placement(&mut self, index: u32, placement: Placement) -> Result<()> {
        let Some(i) = self.services.iter().position(|s| s.index == index) else {
            return Ok(());
        };
        if self.services[i].placement == placement {
            return Ok(());
        }
        self.services[i].placement = placement;
        // A retiring service keeps placing nothing (it places this way if
        // it is created again).
        self.write_service_key(i)?;
        // LWRR rings follow the load of every interval once one service
        // uses them (see `tick`): bring them up to date now.
        self.push(false)
    }

    /// Flows waiting for the closed-flow reaper.
    pub fn closing_len(&self) -> usize {
        self.closing.len()
    }

    fn server_by_index(&self, index: u32) -> Option<&Server> {
        self.servers.values().find(|s| s.index == index)
    }

    /// The server that owns data address `addr`.
    pub fn server_by_addr(&self, addr: Ipv4Addr) -> Option<&Server> {
        self.servers.values().find(|s| s.reg.data_ip == addr)
    }

    pub fn servers(&self) -> impl Iterator<Item = &Server> {
        self.servers.values()
    }
    pub fn server(&self, id: ServerId) -> Option<&Server> {
        self.servers.get(&id)
    }

    /// A service whose pool is every registered server.
    pub fn add_service(
        &mut self,
        vip: Ipv4Addr,
        port: u16,
        placement: Placement,
    ) -> std::result::Result<u32, ControlError> {
        self.add_service_with_pool(
            vip,
            port,
            placement,
            PoolSpec {
                members: Vec::new(),
                open: true,
            },
        )
    }

    pub fn add_service_with_pool(
        &mut self,
        vip: Ipv4Addr,
        port: u16,
        placement: Placement,
        spec: PoolSpec,
    ) -> std::result::Result<u32, ControlError> {
        let index = self.add_service_unpushed(
            &ServiceSpec {
                name: format!("{vip}:{port}"),
                addr: SocketAddrV4::new(vip, port),
                placement,
                follows_global: true,
                pool: spec,
            },
            None,
        )?;
        self.push_tables()?;
        Ok(index)
    }

    /// Adds a service in the lowest free slot (retiring since `retiring`
    /// and for the duration before it: it places nothing from the first
    /// packet); the caller pushes tables.
    fn add_service_unpushed(
        &mut self,
        spec: &ServiceSpec,
        retiring: Option<(Instant, std::time::Duration)>,
    ) -> std::result::Result<u32, ControlError> {
        let index = (0..MAX_SERVICES)
            .find(|i| !self.services.iter().any(|s| s.index == *i))
            .ok_or(ControlError::ServicesFull)?;
        let (vip, port) = (*spec.addr.ip(), spec.addr.port());
        self.dp.set_service(
            CServiceKey::tcp(vip, port),
            CService {
                index,
                placement: if retiring.is_some() {
                    PLACE_NONE
                } else {
                    place_code(spec.placement)
                },
                // Refusing, if it does, once its tables are pushed.
                flags: 0,
            },
        )?;
        let mut svc = Service {
            name: spec.name.clone(),
            follows_global: spec.follows_global,
            vip,
            port,
            index,
            placement: spec.placement,
            pool: BTreeMap::new(),
            configured: spec.pool.members.iter().copied().collect(),
            open: spec.pool.open,
            maglev_shadow: Vec::new(),
            fail_open: false,
            refusing: false,
            retiring: retiring.map(|(t, _)| t),
            retired_before: retiring.map_or(std::time::Duration::ZERO, |(_, d)| d),
            provisional: false,
        };
        svc.pool = self.pool_of(&svc);
        self.services.push(svc);
        Ok(index)
    }

    /// The members of `svc` among the known servers: configured ones (with
    /// the configured weight, 0 meaning the REGISTER's), then, with their
    /// REGISTER weight, those whose REGISTER lists the service and, if the
    /// pool is open, every server whose REGISTER lists no service at all (a
    /// server that lists others does not serve this one: its stack would
    /// leave the connections unanswered). A configured member that lists
    /// others stays a member but takes no new connection
    /// ([`Server::serves_not`]).
    fn pool_of(&self, svc: &Service) -> BTreeMap<ServerId, u32> {
        let addr = SocketAddrV4::new(svc.vip, svc.port);
        self.servers
            .values()
            .filter_map(|s| match svc.configured.get(&s.reg.id) {
                Some(w) if *w > 0 => Some((s.reg.id, *w)),
                Some(_) => Some((s.reg.id, self.weight_of(s))),
                None if s.lists(addr) || (svc.open && s.wanted.is_empty()) => {
                    Some((s.reg.id, self.weight_of(s)))
                }
                None => None,
            })
            .collect()
    }

    /// Makes the served services exactly `specs` (the store's services,
    /// read again): adds new VIP:ports, updates the name, pool and
    /// placement of known ones, and retires the rest: a deleted service
    /// places no new connection from `now` on (its VIP:port is answered as
    /// no service), while its open connections are still forwarded and
    /// migrated until they end, at most `service_retire_timeout`
    /// ([`Self::end_retired`] removes it then). With a zero timeout it is
    /// removed at once with its flow entries (reported closed: those
    /// connections end). A spec naming a retiring service's VIP:port
    /// revives it, connections and all. A VIP:port or name listed twice
    /// keeps its first entry; what finds no free slot ends the oldest
    /// retiring service to take its slot, or is rejected. Tables are pushed
    /// once, only if anything changed. A standby following the store passes
    /// `report_closed` false: the active reports those flows, and a standby
    /// writes nothing.
    pub fn apply_services(
        &mut self,
        now: Instant,
        specs: &[ServiceSpec],
        report_closed: bool,
    ) -> std::result::Result<ServiceChanges, ControlError> {
        let mut ch = ServiceChanges::default();
        let mut wanted: Vec<&ServiceSpec> = Vec::new();
        for spec in specs {
            if let Some(first) = wanted
                .iter()
                .find(|w| w.addr == spec.addr || w.name == spec.name)
            {
                let why = if first.addr == spec.addr {
                    format!(
                        "{} is already the address of service {:?}",
                        spec.addr, first.name
                    )
                } else {
                    format!(
                        "a service named {:?} is already at {}",
                        first.name, first.addr
                    )
                };
                ch.rejected.push((spec.name.clone(), why));
                continue;
            }
            wanted.push(spec);
        }
        let gone: Vec<usize> = (0..self.services.len())
            .rev()
            .filter(|i| {
                let s = &self.services[*i];
                s.retiring.is_none()
                    && !wanted
                        .iter()
                        .any(|w| w.addr == SocketAddrV4::new(s.vip, s.port))
            })
            .collect();
        let retire = !self.cfg.service_retire_timeout.is_zero();
        for i in gone {
            let name = self.services[i].name.clone();
            if retire && !self.services[i].provisional {
                self.retire_service_at(now, i)?;
                ch.retiring.push(name);
            } else {
                let flows = self.remove_service_at(i, report_closed)?;
                ch.removed.push((name, flows));
            }
        }
        for spec in wanted {
            let pos = self
                .services
                .iter()
                .position(|s| SocketAddrV4::new(s.vip, s.port) == spec.addr);
            let Some(i) = pos else {
                let added = loop {
                    match self.add_service_unpushed(spec, None) {
                        Err(ControlError::ServicesFull) => {}
                        other => break other,
                    }
                    // The oldest retiring service gives up its slot.
                    let Some(i) = (0..self.services.len())
                        .filter(|i| self.services[*i].retiring.is_some())
                        .max_by_key(|i| self.services[*i].retiring_for(now))
                    else {
                        break Err(ControlError::ServicesFull);
                    };
                    let name = self.services[i].name.clone();
                    let flows = self.remove_service_at(i, report_closed)?;
                    ch.removed.push((name, flows));
                };
                match added {
                    Ok(_) => ch.added.push(spec.name.clone()),
                    Err(ControlError::ServicesFull) => ch.rejected.push((
                        spec.name.clone(),
                        format!("no free service slot (at most {MAX_SERVICES} services)"),
                    )),
                    Err(e) => return Err(e),
                }
                continue;
            };
            let configured: BTreeMap<ServerId, u32> = spec.pool.members.iter().copied().collect();
            let svc = &mut self.services[i];
            svc.provisional = false;
            let revived = svc.retiring.take().is_some();
            svc.retired_before = std::time::Duration::ZERO;
            let changed = revived
                || svc.name != spec.name
                || svc.follows_global != spec.follows_global
                || svc.placement != spec.placement
                || svc.configured != configured
                || svc.open != spec.pool.open;
            if !changed {
                continue;
            }
            svc.name = spec.name.clone();
            svc.follows_global = spec.follows_global;
            svc.configured = configured;
            svc.open = spec.pool.open;
            if revived || svc.placement != spec.placement {
                svc.placement = spec.placement;
                self.write_service_key(i)?;
            }
            let pool = self.pool_of(&self.services[i]);
            self.services[i].pool = pool;
            ch.updated.push(spec.name.clone());
        }
        if !(ch.added.is_empty()
            && ch.updated.is_empty()
            && ch.removed.is_empty()
            && ch.retiring.is_empty())
        {
            self.push_tables()?;
        }
        Ok(ch)
    }

    /// Marks every service served now as provisional: the config's, before
    /// the store is read. One that the store's list does not name is then
    /// removed at once instead of retiring: the data plane was not attached
    /// yet, so it has no connection to keep (and an operator deleted it).
    pub fn mark_provisional(&mut self) {
        for s in &mut self.services {
            s.provisional = true;
        }
    }

    /// Service `i` stops placing new connections; its flows stay.
    fn retire_service_at(&mut self, now: Instant, i: usize) -> Result<()> {
        self.services[i].retiring = Some(now);
        self.services[i].retired_before = std::time::Duration::ZERO;
        self.write_service_key(i)
    }

    /// Serves again, as retiring, the deleted services the store records
    /// as retiring (a restart, or a takeover: the switchd that saw the
    /// delete kept them only in memory), so that their open connections,
    /// whose flows are loaded next, go on; call it after
    /// [`Self::apply_services`] and before the flows. A record is restored
    /// only if no service holds its VIP:port (one that does was created
    /// again, or is retiring here already: then its retire clock goes back
    /// to the delete if that is earlier) and a slot is free (live services
    /// come first; no retiring service is evicted for it). Its retire clock
    /// counts from the delete (`retired_for` ago), so the timeout is not
    /// restarted. With a zero `service_retire_timeout` nothing retires.
    pub fn restore_retiring(
        &mut self,
        now: Instant,
        records: &[RetiringSpec],
    ) -> std::result::Result<RetiringRestores, ControlError> {
        let mut out = RetiringRestores::default();
        for r in records {
            let name = r.spec.name.clone();
            if self.cfg.service_retire_timeout.is_zero() {
                out.skipped
                    .push((name, "service_retire_timeout_ms is 0".into()));
                continue;
            }
            if let Some(s) = self.services.iter_mut().find(|s| s.addr() == r.spec.addr) {
                match s.retiring_for(now) {
                    Some(age) if s.name == r.spec.name => {
                        if r.retired_for > age {
                            s.retired_before += r.retired_for - age;
                        }
                        continue;
                    }
                    Some(_) => out.skipped.push((
                        name,
                        format!("{} is retiring service {:?}", r.spec.addr, s.name),
                    )),
                    None => out.skipped.push((
                        name,
                        format!("{} is served by service {:?}", r.spec.addr, s.name),
                    )),
                }
                continue;
            }
            match self.add_service_unpushed(&r.spec, Some((now, r.retired_for))) {
                Ok(_) => out.restored.push(name),
                Err(ControlError::ServicesFull) => out.skipped.push((
                    name,
                    format!("no free service slot (at most {MAX_SERVICES} services)"),
                )),
                Err(e) => return Err(e),
            }
        }
        if !out.restored.is_empty() {
            self.push_tables()?;
        }
        Ok(out)
    }

    /// Writes service `i`'s data-plane key: its slot, how it places new
    /// connections (nothing while it retires) and whether it refuses them.
    fn write_service_key(&mut self, i: usize) -> Result<()> {
        let svc = &self.services[i];
        let placement = if svc.retiring.is_some() {
            PLACE_NONE
        } else {
            place_code(svc.placement)
        };
        let flags = if svc.refusing && svc.retiring.is_none() {
            SVC_REFUSE
        } else {
            0
        };
        self.dp.set_service(
            CServiceKey::tcp(svc.vip, svc.port),
            CService {
                index: svc.index,
                placement,
                flags,
            },
        )
    }

    /// The retiring services (deleted, their open connections still served).
    pub fn retiring(&self) -> impl Iterator<Item = &Service> {
        self.services.iter().filter(|s| s.retiring.is_some())
    }

    /// How many flow entries retiring service `addr` had at the last
    /// complete pass of [`Self::end_retired`] (its open connections, and
    /// closed ones not yet reaped); `None` before the first pass.
    pub fn retiring_flows(&self, addr: SocketAddrV4) -> Option<usize> {
        self.retire_scan.last_counts.get(&addr).copied()
    }

    /// Removes the retiring services whose connections have all ended
    /// (their flow entries gone in [`RETIRE_EMPTY_SCANS`] consecutive passes
    /// over the flow table, read [`RETIRE_SCAN_BUDGET`] entries per call)
    /// and those retiring for `service_retire_timeout` (their flow entries
    /// go with them, reported closed with `report`). Call it periodically,
    /// off the packet path; it does nothing while no service retires.
    pub fn end_retired(
        &mut self,
        now: Instant,
        report: bool,
    ) -> std::result::Result<Vec<RetiredService>, ControlError> {
        let mut ended = Vec::new();
        if !self.services.iter().any(|s| s.retiring.is_some()) {
            self.retire_scan = RetireScan::default();
            return Ok(ended);
        }
        let timeout = self.cfg.service_retire_timeout;
        while let Some(i) = self
            .services
            .iter()
            .position(|s| s.retiring_for(now).is_some_and(|age| age >= timeout))
        {
            let (name, addr) = (
                self.services[i].name.clone(),
                SocketAddrV4::new(self.services[i].vip, self.services[i].port),
            );
            let flows = self.remove_service_at(i, report)?;
            self.retire_scan.empty_passes.remove(&addr);
            self.retire_scan.last_counts.remove(&addr);
            ended.push(RetiredService {
                name,
                addr,
                flows,
                timed_out: true,
            });
        }
        let scan = &mut self.retire_scan;
        let started = *scan.started.get_or_insert(now);
        scan.buf.clear();
        let done = self
            .dp
            .scan_flows(&mut scan.cursor, RETIRE_SCAN_BUDGET, &mut scan.buf)?;
        for (k, _) in &scan.buf {
            let k = FlowKey::from(*k);
            *scan
                .seen
                .entry(SocketAddrV4::new(k.service_ip, k.service_port))
                .or_insert(0) += 1;
        }
        if done {
            let seen = std::mem::take(&mut scan.seen);
            scan.started = None;
            let mut empty = Vec::new();
            for s in self.services.iter().filter(|s| s.retiring.is_some()) {
                let addr = SocketAddrV4::new(s.vip, s.port);
                let passes = scan.empty_passes.entry(addr).or_insert(0);
                // Judged only by passes that started after it retired.
                let n = seen.get(&addr).copied().unwrap_or(0);
                scan.last_counts.insert(addr, n);
                if n > 0 || s.retiring.is_some_and(|t| t > started) {
                    *passes = 0;
                    continue;
                }
                *passes += 1;
                if *passes >= RETIRE_EMPTY_SCANS {
                    empty.push(addr);
                }
            }
            let retiring = |a: &SocketAddrV4| {
                self.services
                    .iter()
                    .any(|s| s.retiring.is_some() && SocketAddrV4::new(s.vip, s.port) == *a)
            };
            scan.empty_passes.retain(|a, _| retiring(a));
            scan.last_counts.retain(|a, _| retiring(a));
            for addr in empty {
                self.retire_scan.empty_passes.remove(&addr);
                self.retire_scan.last_counts.remove(&addr);
                let Some(i) = self
                    .services
                    .iter()
                    .position(|s| SocketAddrV4::new(s.vip, s.port) == addr)
                else {
                    continue;
                };
                let name = self.services[i].name.clone();
                let flows = self.remove_service_at(i, report)?;
                ended.push(RetiredService {
                    name,
                    addr,
                    flows,
                    timed_out: false,
                });
            }
        }
        if !ended.is_empty() {
            self.push_tables()?;
        }
        Ok(ended)
    }

    /// Removes service `i`: no new connection is placed on it, and its flow
    /// and migration entries go (reported closed with `report`, so the
    /// store forgets them too). Returns how many flow entries went.
    fn remove_service_at(&mut self, i: usize, report: bool) -> Result<usize> {
        let svc = self.services.remove(i);
        let key = CServiceKey::tcp(svc.vip, svc.port);
        self.dp.remove_service(key)?;
        let removed = self.dp.remove_flows_of_service(key)?;
        let n = removed.len();
        for (key, server) in removed.into_iter().filter(|_| report) {
            self.events.push(CFlowEvent {
                key,
                kind: EV_CLOSED,
                server,
                prev_server: server,
                ts_ns: 0,
            });
        }
        // The slot's rings empty (no stale target for a PREPARE); its Maglev
        // table is rewritten whole when the slot is used again.
        let empty = CRing::from_slice(RING_ROTATE, &[]);
        self.dp.write_ring(svc.index, RING_PLACEMENT, &empty)?;
        self.dp.write_ring(svc.index, RING_TARGET, &empty)?;
        Ok(n)
    }

    /// Registers (or re-registers) a server; it becomes LIVE and joins the
    /// services whose pools are open or name it.
    #[allow(clippy::too_many_arguments)]
    pub fn register(
        &mut self,
        now: Instant,
        id: ServerId,
        data_ip: Ipv4Addr,
        mac: [u8; 6],
        ifindex: u32,
        src_mac: [u8; 6],
        weight: u32,
    ) -> std::result::Result<u32, ControlError> {
        self.register_for(now, id, data_ip, mac, ifindex, src_mac, weight, &[])
    }

    /// [`Self::register`], also joining the services `wanted` lists.
    #[allow(clippy::too_many_arguments)]
    pub fn register_for(
        &mut self,
        now: Instant,
        id: ServerId,
        data_ip: Ipv4Addr,
        mac: [u8; 6],
        ifindex: u32,
        src_mac: [u8; 6],
        weight: u32,
        wanted: &[SocketAddrV4],
    ) -> std::result::Result<u32, ControlError> {
        let reg = Registration {
            id,
            data_ip,
            mac,
            ifindex,
            src_mac,
            weight,
            instance: 0,
        };
        self.register_as(now, &reg, wanted)
    }

    /// Registers (or re-registers) a server; it becomes LIVE and joins the
    /// services whose pools are open or name it, or `wanted` lists. A
    /// server DEAD within its grace keeps its flows (it stalled and came
    /// back), unless it registers as another instance than before (it
    /// restarted: the old process's flows are removed at once, also while
    /// it was live). An instance id of 0 on either side cannot tell a
    /// restart from a stall: the flows are kept.
    pub fn register_as(
        &mut self,
        now: Instant,
        reg: &Registration,
        wanted: &[SocketAddrV4],
    ) -> std::result::Result<u32, ControlError> {
        let Registration {
            id,
            data_ip,
            instance,
            ..
        } = *reg;
        if let Some(other) = self
            .servers
            .values()
            .find(|s| s.reg.data_ip == data_ip && s.reg.id != id && s.liveness != Liveness::Dead)
        {
            return Err(ControlError::AddressInUse {
                addr: data_ip,
                owner: other.reg.id,
            });
        }
        if let Some(stale) = self
            .servers
            .values()
            .find(|s| s.reg.data_ip == data_ip && s.reg.id != id)
            .map(|s| s.reg.id)
        {
            // A dead server's address taken over by a new id: forget the old
            // one, and with it any flows its grace still kept.
            if self.servers[&stale].flows_kept_until.is_some() {
                self.remove_flows(stale, FlowsRemovedWhy::AddressReused)?;
            }
            self.forget(stale)?;
        }
        if let Some((old_instance, dead_since, kept, was_dead)) = self.servers.get(&id).map(|old| {
            (
                old.reg.instance,
                old.dead_since,
                old.flows_kept_until.is_some(),
                old.liveness == Liveness::Dead,
            )
        }) {
            if old_instance != 0 && instance != 0 && old_instance != instance {
                // A restarted process: the old one's connections are gone.
                // (After its grace there is nothing left to remove.)
                if !was_dead || kept {
                    self.liveness.restarts_total += 1;
                    self.remove_flows(
                        id,
                        FlowsRemovedWhy::Restarted {
                            old: old_instance,
                            new: instance,
                        },
                    )?;
                }
            } else if kept {
                self.liveness.returned_total += 1;
                self.liveness_events.push(LivenessEvent::Returned {
                    id,
                    dead_for: now.saturating_since(dead_since.unwrap_or(now)),
                    by_register: true,
                });
            }
        }
        let index = match self.servers.get(&id) {
            Some(s) => s.index,
            None => (0..MAX_SERVERS)
                .find(|i| !self.servers.values().any(|s| s.index == *i))
                .ok_or(ControlError::ServersFull)?,
        };
        if let Some(old) = self.servers.get(&id) {
            if old.reg.data_ip != data_ip {
                self.dp
                    .clear_server(old.index, u32::from_ne_bytes(old.reg.data_ip.octets()))?;
            }
        }
        let s = Server {
            reg: Registration {
                weight: reg.weight.max(1),
                ..*reg
            },
            index,
            liveness: Liveness::Live,
            last_heartbeat: now,
            dead_since: None,
            flows_kept_until: None,
            revive_as: Liveness::Live,
            load: 0,
            load_pps: 0.0,
            last_counter: self.servers.get(&id).map(|s| s.last_counter).unwrap_or(0),
            // The same process re-registering keeps what it reported; a
            // new one reports again with its first heartbeat.
            backend_down: self
                .servers
                .get(&id)
                .filter(|o| o.reg.instance != 0 && o.reg.instance == instance)
                .map(|o| o.backend_down.clone())
                .unwrap_or_default(),
            health_reported: self.servers.get(&id).is_some_and(|o| {
                o.reg.instance != 0 && o.reg.instance == instance && o.health_reported
            }),
            // A record from the store lists no services: the same process
            // keeps what its REGISTER listed.
            wanted: match self.servers.get(&id) {
                Some(o) if wanted.is_empty() && o.reg.instance == instance => o.wanted.clone(),
                _ => wanted.to_vec(),
            },
            // The same process (alive) is still stopping; a new one is not.
            leaving: self.servers.get(&id).is_some_and(|o| {
                o.reg.instance != 0
                    && o.reg.instance == instance
                    && o.leaving
                    && o.liveness != Liveness::Dead
            }),
            stopped: false,
        };
        self.servers.insert(id, s);
        for i in 0..self.services.len() {
            let pool = self.pool_of(&self.services[i]);
            self.services[i].pool = pool;
        }
        self.push_server(id)?;
        self.push_tables()?;
        Ok(index)
    }

    /// A server restored from the store while it was DEAD with flows (a
    /// standby taking over during its grace): DEAD, out of placement, pool
    /// member as registered, its flows kept for a full grace from `now` (the
    /// store does not say when it died), then removed like any dead
    /// server's. Its data address must not belong to a server that is not
    /// dead.
    pub fn restore_dead(
        &mut self,
        now: Instant,
        reg: &Registration,
    ) -> std::result::Result<u32, ControlError> {
        let index = self.register_as(now, reg, &[])?;
        let grace = self.cfg.dead_flow_grace;
        if let Some(s) = self.servers.get_mut(&reg.id) {
            s.liveness = Liveness::Dead;
            s.dead_since = Some(now);
            s.flows_kept_until = Some(now + grace);
        }
        self.push_server(reg.id)?;
        self.push_tables()?;
        Ok(index)
    }

    /// Takes the instance id of known server `id` from its store record (a
    /// standby following the active's records): the active registered it
    /// since and judged any restart, so nothing else changes here. 0 (a
    /// record without one) changes nothing.
    pub fn follow_instance(&mut self, id: ServerId, instance: u64) {
        if let (Some(s), true) = (self.servers.get_mut(&id), instance != 0) {
            s.reg.instance = instance;
        }
    }

    /// Restarts every liveness clock at `now` (a standby that just took
    /// over): live servers have `dead_after` to heartbeat, dead ones with
    /// flows a full grace to come back.
    pub fn restart_liveness_clocks(&mut self, now: Instant) {
        let grace = self.cfg.dead_flow_grace;
        for s in self.servers.values_mut() {
            if s.liveness != Liveness::Dead {
                s.last_heartbeat = now;
            } else if s.flows_kept_until.is_some() {
                s.dead_since = Some(now);
                s.flows_kept_until = Some(now + grace);
            }
        }
    }

    /// Removes every flow entry of server `id` (placed on it, or migrated
    /// to it) and reports them closed.
    fn remove_flows(&mut self, id: ServerId, why: FlowsRemovedWhy) -> Result<usize> {
        let Some(s) = self.servers.get_mut(&id) else {
            return Ok(0);
        };
        s.flows_kept_until = None;
        let idx = s.index;
        self.prune_claims(Instant::ZERO, Some(id));
        let removed = self.dp.remove_flows_of(idx)?;
        let n = removed.len();
        for key in removed {
            self.events.push(CFlowEvent {
                key,
                kind: EV_CLOSED,
                server: idx,
                prev_server: idx,
                ts_ns: 0,
            });
        }
        match why {
            FlowsRemovedWhy::Restarted { .. } => {
                self.liveness.restart_flows_removed_total += n as u64
            }
            FlowsRemovedWhy::Stopped => self.liveness.stopped_flows_removed_total += n as u64,
            _ => self.liveness.dead_flows_removed_total += n as u64,
        }
        self.liveness_events
            .push(LivenessEvent::FlowsRemoved { id, flows: n, why });
        Ok(n)
    }

    /// Removes a server entirely (slot freed). Its flows must already be gone.
    fn forget(&mut self, id: ServerId) -> Result<()> {
        if let Some(s) = self.servers.remove(&id) {
            self.dp
                .clear_server(s.index, u32::from_ne_bytes(s.reg.data_ip.octets()))?;
            for svc in &mut self.services {
                svc.pool.remove(&id);
            }
        }
        Ok(())
    }

    /// SET_OWNER: `sender` says the flow is owned by `owner` (an origin
    /// taking a flow back after an aborted migration). Accepted only from the
    /// flow's current owner or from the named owner itself, and never while
    /// a migration of the flow is pending in the data plane: then only
    /// CONN_STATE_ACK or the target's ABORT decision may settle the owner
    /// (docs/MIGRATION.md), and a SET_OWNER (possibly delayed behind a later
    /// migration) would create a second owner. The result is a final entry
    /// that keeps the last migration id, so the data plane's stale
    /// PREPARE_ACK checks keep working; an entry back on the original server
    /// is kept final (not deleted) for the same reason.
    pub fn set_owner(
        &mut self,
        sender: ServerId,
        key: FlowKey,
        owner: ServerId,
    ) -> std::result::Result<(), ControlError> {
        let refuse = |reason| ControlError::SetOwnerRefused {
            sender,
            key,
            reason,
        };
        let sidx = self
            .servers
            .get(&sender)
            .filter(|s| s.liveness != Liveness::Dead)
            .ok_or(refuse("sender not registered"))?
            .index;
        let oidx = self
            .servers
            .get(&owner)
            .filter(|s| s.liveness != Liveness::Dead)
            .ok_or(refuse("owner not registered"))?
            .index;
        let ck = CFlowKey::from(key);
        let flow = self.dp.lookup_flow(ck)?.ok_or(refuse("unknown flow"))?;
        let entry = self.dp.lookup_migration(ck)?;
        if entry.is_some_and(|m| m.is_pending()) {
            return Err(refuse("a migration of the flow is pending"));
        }
        let current = entry.map(|m| m.server).unwrap_or(flow.server);
        if sidx != current && sidx != oidx {
            return Err(refuse(
                "sender neither owns the flow nor is the named owner",
            ));
        }
        if entry.is_some() || oidx != flow.server {
            let id = entry.map(|m| m.migration_id).unwrap_or(0);
            self.dp.insert_migration(ck, CMigration::owner(oidx, id))?;
        }
        if current != oidx {
            let kind = if oidx == flow.server {
                EV_RETURNED
            } else {
                EV_MIGRATED
            };
            self.events.push(CFlowEvent {
                key: ck,
                kind,
                server: oidx,
                prev_server: current,
                ts_ns: 0,
            });
        }
        Ok(())
    }

    /// A FLOWS claim from `sender`: it holds the connection of `claim.flow`,
    /// brought to it by migration `claim.epoch` (0: placed there),
    /// `claim.owned_ms` ago. The server that holds an established
    /// connection is the truth, so the claim replaces what the data plane
    /// had (a mapping from the store, maybe an older backup's; a Maglev
    /// placement of a segment that found no entry; nothing), and the store
    /// follows (NEW or MIGRATED event), except:
    /// - a migration of the flow in progress (pending entry): the data
    ///   plane settles its owner (CONN_STATE_ACK or the target's ABORT);
    /// - another server claimed the flow in the last [`CLAIM_MEMORY`] with
    ///   a later ownership ([`claim_is_later`]): the later migration wins.
    ///
    /// A claim that moves the flow writes a final migration entry naming
    /// the claimant and its epoch when the flow had one (so that the
    /// claimant's next PREPARE_ACK, which carries that epoch, supersedes
    /// it), else the flow entry's server. Errors: `sender` not registered
    /// (or dead), data plane failures.
    pub fn claim_flow(
        &mut self,
        now: Instant,
        sender: ServerId,
        claim: &capybara_proto::control::FlowClaim,
    ) -> std::result::Result<ClaimOutcome, ControlError> {
        let s = self
            .servers
            .get(&sender)
            .filter(|s| s.liveness != Liveness::Dead)
            .ok_or(ControlError::UnknownServer(sender))?;
        let (sidx, sender_ip) = (s.index, s.reg.data_ip);
        let key = claim.flow;
        let Some(svc) = self
            .services
            .iter()
            .find(|v| v.vip == key.service_ip && v.port == key.service_port)
            .map(|v| v.index)
        else {
            self.claim_counters.unknown_service += 1;
            return Ok(ClaimOutcome::UnknownService);
        };
        let new = JudgedClaim {
            server: sender,
            epoch: claim.epoch,
            owned_since: Instant::from_micros(
                now.as_micros()
                    .saturating_sub(u64::from(claim.owned_ms) * 1000),
            ),
            at: now,
        };
        if let Some(old) = self
            .claims
            .get(&key)
            .filter(|o| o.server != sender && now.saturating_since(o.at) < CLAIM_MEMORY)
        {
            let old_ip = self.servers.get(&old.server).map(|s| s.reg.data_ip);
            if !claim_is_later(&new, sender_ip, old, old_ip) {
                self.claim_counters.later_claim += 1;
                return Ok(ClaimOutcome::LaterClaim);
            }
        }
        let ck = CFlowKey::from(key);
        // The moves the data plane made since the last flush (every 2 ms):
        // a claim built before a migration that finished a moment ago must
        // not undo it (takeover_churn_lab: a FLOWS report in flight while
        // connections migrated every 5 ms sent 10 of 24 back to the server
        // they had left, whose buffering for the next migration back then
        // starved them).
        self.take_dp_events(now)?;
        let entry = self.dp.lookup_migration(ck)?;
        if entry.is_some_and(|m| m.is_pending()) {
            self.claim_counters.in_progress += 1;
            return Ok(ClaimOutcome::InProgress);
        }
        let flow = self.dp.lookup_flow(ck)?;
        let current = entry.map(|m| m.server).or(flow.map(|f| f.server));
        if current != Some(sidx) && entry.is_some() {
            // A migration that finished between the take above and the
            // lookup: its event follows its entry within the same run of
            // the program.
            self.take_dp_events(now)?;
        }
        if current != Some(sidx)
            && entry.is_some()
            && self
                .live_moves
                .get(&key)
                .is_some_and(|t| now.saturating_since(*t) < LIVE_MOVE_MEMORY)
        {
            self.claim_counters.moved_since += 1;
            return Ok(ClaimOutcome::MovedSince);
        }
        self.claims.insert(key, new);
        if current == Some(sidx) {
            self.claim_counters.agreed += 1;
            return Ok(ClaimOutcome::Agreed);
        }
        match (entry, flow) {
            (Some(_), Some(_)) => {
                self.dp
                    .insert_migration(ck, CMigration::owner(sidx, claim.epoch))?;
            }
            (_, Some(f)) => {
                self.dp.insert_flow(ck, CFlow { server: sidx, ..f })?;
            }
            (_, None) => {
                // Established: it carried data before the switch lost it.
                let f = CFlow {
                    server: sidx,
                    service: svc as u16,
                    flags: FLOW_ESTABLISHED,
                    created_ns: 0,
                };
                self.dp.insert_flow(ck, f)?;
                if entry.is_some() {
                    self.dp.delete_migration(ck)?;
                }
            }
        }
        self.events.push(CFlowEvent {
            key: ck,
            kind: if current.is_some() {
                EV_MIGRATED
            } else {
                EV_NEW
            },
            server: sidx,
            prev_server: current.unwrap_or(sidx),
            ts_ns: 0,
        });
        self.claim_counters.applied += 1;
        Ok(ClaimOutcome::Applied)
    }

    /// Forgets judged claims older than [`CLAIM_MEMORY`] (at most once a
    /// second), and those of `gone` (a server whose flows were removed).
    fn prune_claims(&mut self, now: Instant, gone: Option<ServerId>) {
        if !self.live_moves.is_empty()
            && now.saturating_since(self.last_move_prune) >= std::time::Duration::from_secs(1)
        {
            self.last_move_prune = now;
            self.live_moves
                .retain(|_, t| now.saturating_since(*t) < LIVE_MOVE_MEMORY);
        }
        if self.claims.is_empty() {
            return;
        }
        if let Some(id) = gone {
            self.claims.retain(|_, c| c.server != id);
        } else if now.saturating_since(self.last_claim_prune) >= std::time::Duration::from_secs(1) {
            self.last_claim_prune = now;
            self.claims
                .retain(|_, c| now.saturating_since(c.at) < CLAIM_MEMORY);
        }
    }

    /// Judged FLOWS claims remembered (`/status`).
    pub fn claims_remembered(&self) -> usize {
        self.claims.len()
    }

    /// Loads flow mappings (a standby taking over): each flow is routed to
    /// its stored owner. Unknown owners or services are skipped and counted.
    pub fn load_flows(
        &mut self,
        flows: &[(FlowKey, ServerId)],
    ) -> std::result::Result<(usize, usize), ControlError> {
        let mut batch = Vec::with_capacity(flows.len());
        let mut skipped = 0;
        for (key, owner) in flows {
            let svc = self
                .services
                .iter()
                .find(|s| s.vip == key.service_ip && s.port == key.service_port);
            match (self.servers.get(owner), svc) {
                (Some(s), Some(svc)) => batch.push((
                    CFlowKey::from(*key),
                    CFlow {
                        server: s.index,
                        service: svc.index as u16,
                        // The store does not say whether the connection
                        // completed its handshake: never reap it as embryonic.
                        flags: FLOW_ESTABLISHED,
                        created_ns: 0,
                    },
                )),
                _ => skipped += 1,
            }
        }
        self.dp.insert_flows(&batch)?;
        Ok((batch.len(), skipped))
    }

    /// Removes flow entries (a standby's warm copy, after the store dropped them).
    pub fn unload_flows(&mut self, keys: &[FlowKey]) -> std::result::Result<(), ControlError> {
        for k in keys {
            self.dp.delete_flow(CFlowKey::from(*k))?;
        }
        Ok(())
    }

    pub fn heartbeat(
        &mut self,
        now: Instant,
        id: ServerId,
    ) -> std::result::Result<(), ControlError> {
        let s = self
            .servers
            .get_mut(&id)
            .ok_or(ControlError::UnknownServer(id))?;
        s.last_heartbeat = now;
        if s.liveness == Liveness::Dead && s.flows_kept_until.is_some() {
            // It stalled and came back within the grace: as it was, flows
            // untouched.
            s.liveness = s.revive_as;
            s.flows_kept_until = None;
            let dead_for = now.saturating_since(s.dead_since.take().unwrap_or(now));
            self.liveness.returned_total += 1;
            self.liveness_events.push(LivenessEvent::Returned {
                id,
                dead_for,
                by_register: false,
            });
            self.push_server(id)?;
            self.push_tables()?;
        }
        Ok(())
    }

    /// HEARTBEAT LEAVING of a known server, as its latest heartbeat says
    /// (`leaving`): its process is stopping, so it leaves placement and the
    /// migration targets at once while its flows keep flowing (what
    /// [`Self::set_draining`] does in the data plane), but this is not the
    /// operator's drain: `liveness` and [`Server::draining`] are untouched,
    /// so either one ending leaves the other holding. A dead server only
    /// records it (a heartbeat brings it back first). Returns whether it
    /// changed.
    pub fn set_leaving(
        &mut self,
        id: ServerId,
        leaving: bool,
    ) -> std::result::Result<bool, ControlError> {
        let s = self
            .servers
            .get_mut(&id)
            .ok_or(ControlError::UnknownServer(id))?;
        if s.leaving == leaving {
            return Ok(false);
        }
        s.leaving = leaving;
        self.liveness_events
            .push(LivenessEvent::Leaving { id, on: leaving });
        // As for a drain: out of the tables before the data plane sees it
        // DRAINING; back, its state before the tables that name it.
        if leaving {
            self.push_tables()?;
            self.push_server(id)?;
        } else {
            self.push_server(id)?;
            self.push_tables()?;
        }
        Ok(true)
    }

    /// HEARTBEAT STOPPED: the process of server `id` exits and serves
    /// nothing any more. DEAD at once (no `dead_after` wait) and its flow
    /// entries, if any are left, removed at once (no grace: the process is
    /// gone, not stalled). An operator's drain still holds when it
    /// registers again. Nothing happens for a server already dead without
    /// flows (the repeated STOPPED datagrams). Returns the flows removed,
    /// `None` if it was already stopped.
    pub fn stopped(
        &mut self,
        now: Instant,
        id: ServerId,
    ) -> std::result::Result<Option<usize>, ControlError> {
        let s = self
            .servers
            .get_mut(&id)
            .ok_or(ControlError::UnknownServer(id))?;
        if s.liveness == Liveness::Dead && s.flows_kept_until.is_none() {
            // Already dead and its flows gone: nothing left to stop.
            s.stopped = true;
            return Ok(None);
        }
        if s.liveness != Liveness::Dead {
            s.revive_as = s.liveness;
            s.liveness = Liveness::Dead;
            s.dead_since = Some(now);
        }
        s.leaving = false;
        s.stopped = true;
        s.flows_kept_until = None;
        self.liveness.stopped_total += 1;
        // Out of placement first, then the entries.
        self.push_server(id)?;
        self.push_tables()?;
        let flows = self.remove_flows(id, FlowsRemovedWhy::Stopped)?;
        self.liveness_events
            .push(LivenessEvent::Stopped { id, flows });
        Ok(Some(flows))
    }

    /// Starts (or ends) a drain: no new flows nor migrations to the server;
    /// its existing flows keep flowing.
    pub fn set_draining(
        &mut self,
        id: ServerId,
        draining: bool,
    ) -> std::result::Result<(), ControlError> {
        let s = self
            .servers
            .get_mut(&id)
            .ok_or(ControlError::UnknownServer(id))?;
        if s.liveness == Liveness::Dead {
            // Back within the grace, it returns as the operator wants it.
            s.revive_as = if draining {
                Liveness::Draining
            } else {
                Liveness::Live
            };
            // Dead and to come back draining is out for good.
            self.refresh_refusals()?;
            return Ok(());
        }
        s.liveness = if draining {
            Liveness::Draining
        } else {
            Liveness::Live
        };
        // The data plane drops a SYN whose Maglev slot names a server that
        // is not LIVE: so no slot may name it while it is DRAINING there.
        // Draining: tables first (no slot names it), then its state;
        // back to LIVE: its state first, then the tables that name it.
        if draining {
            self.push_tables()?;
            self.push_server(id)?;
        } else {
            self.push_server(id)?;
            self.push_tables()?;
        }
        Ok(())
    }

    fn push_server(&mut self, id: ServerId) -> Result<()> {
        let s = &self.servers[&id];
        let mut c = CServer {
            ifindex: s.reg.ifindex,
            mac: s.reg.mac,
            src_mac: s.reg.src_mac,
            state: match s.liveness {
                // Leaving: what DRAINING does in the data plane (no new
                // flows, existing ones keep flowing).
                Liveness::Live if s.leaving => SERVER_DRAINING,
                Liveness::Live => SERVER_LIVE,
                Liveness::Draining => SERVER_DRAINING,
                Liveness::Dead => SERVER_DEAD,
            },
            weight: self.weight_of(s).min(u16::MAX as u32) as u16,
            ..Default::default()
        };
        c.set_data_addr(s.reg.data_ip);
        self.dp.set_server(s.index, c)
    }

    /// Recomputes Maglev tables (pushing only changed slots), LWRR rings and
    /// target rings from each service's live pool members.
    fn push_tables(&mut self) -> Result<()> {
        self.push(true)
    }

    /// Live, not weighted 0 by the operator, and a placement and migration
    /// target of at least one of its services (or in none): counted in the
    /// pool load of LOAD-NOTIFICATION. (A weight-0 server takes no new
    /// connection and no migration: counted, its load was the others' to
    /// share, and their fair share looked larger than it is.)
    fn takes_load(&self, s: &Server) -> bool {
        if !s.placeable() || self.weight_of(s) == 0 {
            return false;
        }
        let mut member = false;
        for svc in self
            .services
            .iter()
            .filter(|v| v.pool.iter().any(|(id, _)| *id == s.reg.id))
        {
            member = true;
            if !s.backend_is_down(svc.vip, svc.port) || svc.fail_open {
                return true;
            }
        }
        !member
    }

    /// Live members of service `i`, with their pool weights; a server the
    /// operator weighted 0 is none (no new connections, not a target), nor
    /// one whose REGISTER lists other services and not this one (a
    /// configured member whose stack would leave the connections
    /// unanswered).
    fn live_members(&self, i: usize) -> Vec<Server> {
        let addr = self.services[i].addr();
        self.services[i]
            .pool
            .iter()
            .filter_map(|(id, w)| {
                let s = self.servers.get(id)?;
                if self.operator_weights.get(id) == Some(&0) || s.serves_not(addr) {
                    return None;
                }
                s.placeable().then(|| Server {
                    reg: Registration {
                        weight: (*w).max(1),
                        ..s.reg
                    },
                    ..s.clone()
                })
            })
            .collect()
    }

    /// Service `i`'s members for placement and for migration targets: the
    /// live members whose application is up; when none is, placement fails
    /// open to every live member (targets stay empty: moving a connection
    /// to another down server helps nobody). Also whether it fails open.
    fn members(&self, i: usize) -> (Vec<Server>, Vec<Server>, bool) {
        let svc = &self.services[i];
        let live = self.live_members(i);
        let healthy: Vec<Server> = live
            .iter()
            .filter(|s| !s.backend_is_down(svc.vip, svc.port))
            .cloned()
            .collect();
        if healthy.is_empty() && !live.is_empty() {
            (live, healthy, true)
        } else {
            (healthy.clone(), healthy, false)
        }
    }

    /// The servers new connections of service `i` are placed on right now
    /// (ids, pool order): exactly the members the Maglev table and the LWRR
    /// ring are built from (live, not leaving, not drained, operator weight
    /// above 0, registered for the service, application up unless the
    /// service fails open). Empty for an index out of range.
    pub fn placing(&self, i: usize) -> Vec<u32> {
        if i >= self.services.len() {
            return Vec::new();
        }
        self.members(i).0.iter().map(|s| s.reg.id.0).collect()
    }

    /// Rings always; Maglev tables only with `maglev` (they depend on the
    /// pool, not on load, and cost a 65,537-slot rebuild each).
    fn push(&mut self, maglev: bool) -> Result<()> {
        for i in 0..self.services.len() {
            let (live, targets, fail_open) = self.members(i);
            let svc = &mut self.services[i];
            if svc.fail_open != fail_open {
                svc.fail_open = fail_open;
                self.health_events.push(HealthEvent::FailOpen {
                    service: SocketAddrV4::new(svc.vip, svc.port),
                    on: fail_open,
                });
            }
            let svc_index = self.services[i].index;
            if maglev {
                let backends: Vec<Backend> = live
                    .iter()
                    .map(|s| Backend {
                        id: s.reg.id.0,
                        index: s.index,
                        weight: s.reg.weight,
                    })
                    .collect();
                let table = maglev::build_table(&backends, MAGLEV_SIZE);
                let delta = maglev::diff(&self.services[i].maglev_shadow, &table);
                if !delta.is_empty() {
                    self.dp.write_maglev(svc_index, &delta)?;
                    self.services[i].maglev_shadow = table;
                }
            }
            let lwrr = CRing::from_slice(RING_ROTATE, &lwrr_ring(&live));
            let target = target_ring(&targets, self.cfg.target_policy);
            self.dp.write_ring(svc_index, RING_PLACEMENT, &lwrr)?;
            self.dp.write_ring(svc_index, RING_TARGET, &target)?;
        }
        self.refresh_refusals()
    }

    /// One pool-monitor interval plus liveness checks. Returns the load
    /// notifications to send. Servers that missed heartbeats for
    /// `dead_after` become DEAD: out of placement at once; their flows are
    /// removed (and reported as closed to the sink) when `dead_flow_grace`
    /// has passed without a heartbeat or REGISTER.
    pub fn tick(&mut self, now: Instant) -> std::result::Result<Vec<LoadReport>, ControlError> {
        self.prune_claims(now, None);
        self.reap_closed(now)?;
        self.apply_health(now)?;
        let grace_over: Vec<ServerId> = self
            .servers
            .values()
            .filter(|s| s.flows_kept_until.is_some_and(|t| now >= t))
            .map(|s| s.reg.id)
            .collect();
        for id in grace_over {
            self.liveness.grace_ended_total += 1;
            self.remove_flows(id, FlowsRemovedWhy::GraceEnded)?;
        }
        let dead_after = self.dead_after(now);
        let newly_dead: Vec<ServerId> = self
            .servers
            .values()
            .filter(|s| {
                s.liveness != Liveness::Dead && now.saturating_since(s.last_heartbeat) > dead_after
            })
            .map(|s| s.reg.id)
            .collect();
        let grace = self.cfg.dead_flow_grace;
        for id in &newly_dead {
            if let Some(s) = self.servers.get_mut(id) {
                s.revive_as = s.liveness;
                s.liveness = Liveness::Dead;
                s.dead_since = Some(now);
                s.flows_kept_until = (!grace.is_zero()).then(|| now + grace);
                self.liveness.died_total += 1;
                self.liveness_events.push(LivenessEvent::Died {
                    id: *id,
                    flows_kept_until: s.flows_kept_until,
                });
            }
            self.push_server(*id)?;
        }
        if !newly_dead.is_empty() {
            // Out of placement first, then (without a grace) the entries.
            self.push_tables()?;
            if grace.is_zero() {
                for id in newly_dead {
                    self.remove_flows(id, FlowsRemovedWhy::DeadNoGrace)?;
                }
            }
        }
        // Pool monitor: counters (request packets, which carry payload) are
        // monotonic; the load is the delta.
        let counters = self.dp.server_request_packets()?;
        // The first interval starts at the control plane's time zero.
        let (dt, alpha) = match self.last_tick {
            Some(t) => {
                let dt = now.saturating_since(t);
                let a = 1.0 - (-dt.as_secs_f64() / LOAD_SMOOTHING.as_secs_f64()).exp();
                (dt, a)
            }
            None => (now.saturating_since(Instant::ZERO), 1.0),
        };
        self.last_tick = Some(now);
        for s in self.servers.values_mut() {
            let c = counters.get(s.index as usize).copied().unwrap_or(0);
            s.load = c.saturating_sub(s.last_counter);
            s.last_counter = c;
            if dt > std::time::Duration::ZERO {
                let pps = s.load as f64 / dt.as_secs_f64();
                s.load_pps += alpha * (pps - s.load_pps);
            }
        }
        // The pool the policies balance: servers that take connections.
        // A draining (or drained) server, or one whose every service's
        // application is down, carries no new load and takes no migration:
        // counted in the average, it dragged it down and every other server
        // looked busier than the pool for good (they shed connections to
        // each other for the whole maintenance, ~48 migrations/s in the
        // demo). It still gets its own report.
        let in_pool: Vec<&Server> = self
            .servers
            .values()
            .filter(|s| self.takes_load(s))
            .collect();
        let pool_load: u64 = in_pool.iter().map(|s| s.load).sum();
        // The policies compare load per unit of weight (an operator's
        // weight 5 is five times the load of a weight 1, not an excess to
        // shed): the weights go along while they differ.
        let least = in_pool
            .iter()
            .min_by(|a, b| {
                let per_weight = |s: &Server| s.load_pps / f64::from(self.weight_of(s).max(1));
                per_weight(a)
                    .total_cmp(&per_weight(b))
                    .then(a.index.cmp(&b.index))
            })
            .map(|s| s.reg.data_ip)
            .unwrap_or(Ipv4Addr::UNSPECIFIED);
        let live_servers = in_pool.len() as u32;
        let pool_weight: u64 = in_pool.iter().map(|s| u64::from(self.weight_of(s))).sum();
        let first_weight = in_pool.first().map(|s| self.weight_of(s));
        let equal = in_pool
            .iter()
            .all(|s| Some(self.weight_of(s)) == first_weight);
        let reports = self
            .servers
            .values()
            .filter(|s| s.liveness != Liveness::Dead)
            .map(|s| {
                let own = self.weight_of(s);
                let weights = (!equal || first_weight.is_some_and(|w| w != own)).then(|| {
                    capybara_proto::load::LoadWeights {
                        own,
                        pool: pool_weight.min(u64::from(u32::MAX)) as u32,
                    }
                });
                LoadReport {
                    server: s.reg.id,
                    data_ip: s.reg.data_ip,
                    own_load: s.load,
                    pool_load,
                    live_servers,
                    least_loaded: least,
                    weights,
                }
            })
            .collect();
        if self.cfg.target_policy == TargetPolicy::LeastLoaded
            || self.services.iter().any(|s| s.placement == Placement::Lwrr)
        {
            // Least-loaded order and LWRR rings follow the load of every
            // interval; Maglev tables do not.
            self.push(false)?;
        }
        // Time alone turns refusals on, and ends a dead server's grace.
        if !self.refusals_on && self.refuse_from.is_some_and(|t| now >= t) {
            self.refusals_on = true;
        }
        self.refresh_refusals()?;
        Ok(reports)
    }

    /// Removes the entries of flows closed more than `closed_linger` ago,
    /// unless the 4-tuple was reused since (no CLOSING flag any more).
    fn reap_closed(&mut self, now: Instant) -> std::result::Result<(), ControlError> {
        // Bounded: at most the queue's length, and stops at the first young entry.
        while let Some((t, key)) = self.closing.front().copied() {
            if now.saturating_since(t) < self.cfg.closed_linger {
                break;
            }
            self.closing.pop_front();
            match self.dp.lookup_flow(key)? {
                Some(f) if f.flags & FLOW_CLOSING == 0 => continue,
                Some(_) => {
                    self.dp.delete_migration(key)?;
                    self.dp.delete_flow(key)?;
                    self.reaped_total += 1;
                }
                None => {
                    if self.dp.lookup_migration(key)?.is_some() {
                        self.dp.delete_migration(key)?;
                        self.reaped_total += 1;
                    }
                }
            }
        }
        Ok(())
    }

    /// Takes the data plane's flow events into the batch for the sink
    /// (flushed by [`Self::flush_events`]): closed flows start their
    /// linger, and live moves are noted at once, so that a FLOWS claim
    /// judged right after a migration finished sees it (the events are
    /// taken before every claim, not only at the next flush).
    fn take_dp_events(&mut self, now: Instant) -> std::result::Result<(), ControlError> {
        let from = self.events.len();
        self.dp.drain_events(&mut self.events)?;
        for e in &self.events[from..] {
            if e.kind == EV_CLOSED {
                self.closing.push_back((now, e.key));
            }
            // A migration the data plane finished (or an origin took
            // back): newer than any FLOWS claim built before it.
            if e.kind == EV_MIGRATED || e.kind == EV_RETURNED {
                self.live_moves.insert(FlowKey::from(e.key), now);
            }
        }
        Ok(())
    }

    /// Moves flow events from the data plane (and liveness) to the sink in
    /// one batch. Returns how many. Closed flows start their linger.
    pub fn flush_events(
        &mut self,
        now: Instant,
        sink: &mut dyn FlowEventSink,
    ) -> std::result::Result<usize, ControlError> {
        self.take_dp_events(now)?;
        let n = self.events.len();
        if n > 0 {
            let updates: Vec<FlowUpdate> = self
                .events
                .iter()
                .map(|e| FlowUpdate {
                    event: *e,
                    key: FlowKey::from(e.key),
                    owner: self.server_by_index(e.server).map(|s| s.reg.id),
                })
                .collect();
            sink.write_batch(&updates);
            self.events.clear();
        }
        Ok(n)
    }
}

/// One finished migration as a server reported it (MIGRATION_REPORT), kept
/// by the switch for the API: server ids resolved, dated with the switch's
/// wall clock.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReportedMigration {
    /// Switch-local, increasing from 1 (the `after` cursor of `/migrations`).
    pub seq: u64,
    /// The server that sent the report (origin or target, per the outcome).
    pub reporter: ServerId,
    /// The other party, when its data address is a registered server.
    pub peer: Option<ServerId>,
    pub report: capybara_proto::control::MigrationReport,
    /// The end of the migration: receipt time minus the report's age.
    pub finished_unix_ms: u64,
}

/// The switch's bounded ring of reported migrations, served as `GET
/// /migrations?after=SEQ&limit=N`. Pushing overwrites the oldest entry when
/// full (counted); readers that fall behind see a gap in `seq`.
#[derive(Debug, Clone)]
pub struct MigrationRing {
    items: VecDeque<ReportedMigration>,
    cap: usize,
    next_seq: u64,
    /// Reports accepted into the ring.
    pub received: u64,
    /// Entries pushed out of a full ring.
    pub overwritten: u64,
}

/// Entries a switch keeps by default (about 0.5 MB).
pub const MIGRATION_RING: usize = 4096;
/// Most entries one `/migrations` answer lists.
pub const MIGRATION_PAGE_MAX: usize = 1000;

impl Default for MigrationRing {
    fn default() -> Self {
        MigrationRing::new(MIGRATION_RING)
    }
}

impl MigrationRing {
    pub fn new(cap: usize) -> Self {
        let cap = cap.max(1);
        MigrationRing {
            items: VecDeque::with_capacity(cap),
            cap,
            next_seq: 1,
            received: 0,
            overwritten: 0,
        }
    }

    pub fn len(&self) -> usize {
        self.items.len()
    }
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }
    /// The `seq` the next entry will get.
    pub fn next_seq(&self) -> u64 {
        self.next_seq
    }

    /// Adds one report; returns its `seq`.
    pub fn push(
        &mut self,
        reporter: ServerId,
        peer: Option<ServerId>,
        report: capybara_proto::control::MigrationReport,
        finished_unix_ms: u64,
    ) -> u64 {
        if self.items.len() >= self.cap {
            self.items.pop_front();
            self.overwritten += 1;
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        self.received += 1;
        self.items.push_back(ReportedMigration {
            seq,
            reporter,
            peer,
            report,
            finished_unix_ms,
        });
        seq
    }

    /// Entries with `seq > after`, oldest first, at most `limit`.
    pub fn after(&self, after: u64, limit: usize) -> impl Iterator<Item = &ReportedMigration> {
        // Seqs are consecutive in the ring: skip straight to the first wanted.
        let first = self.items.front().map_or(0, |m| m.seq);
        let skip = after.saturating_add(1).saturating_sub(first);
        self.items
            .iter()
            .skip(usize::try_from(skip).unwrap_or(usize::MAX))
            .take(limit)
    }

    /// The `/migrations` answer: `{"epoch", "next", "oldest", "received",
    /// "overwritten", "items": [...]}` (docs/SWITCHD.md).
    pub fn page_json(&self, epoch: u32, after: u64, limit: usize) -> serde_json::Value {
        use capybara_proto::control::REPORT_PHASES;
        let items: Vec<serde_json::Value> = self
            .after(after, limit.min(MIGRATION_PAGE_MAX))
            .map(|m| {
                let r = &m.report;
                let phases: serde_json::Map<String, serde_json::Value> = REPORT_PHASES
                    .iter()
                    .enumerate()
                    .map(|(i, p)| (format!("{p}_us"), serde_json::json!(r.phase_us(i))))
                    .collect();
                serde_json::json!({
                    "seq": m.seq,
                    "migration_id": r.id,
                    "reporter": m.reporter.0,
                    "role": if r.outcome.is_origin() { "origin" } else { "target" },
                    "peer": m.peer.map(|p| p.0),
                    "peer_addr": r.peer.map(|a| a.to_string()),
                    "client": format!("{}:{}", r.flow.client_ip, r.flow.client_port),
                    "service": format!("{}:{}", r.flow.service_ip, r.flow.service_port),
                    "outcome": r.outcome.name(),
                    "trigger": r.trigger.name(),
                    "reason": r.reason_text(),
                    "finished_unix_ms": m.finished_unix_ms,
                    "phases": phases,
                    "fragments": r.fragments,
                    "snapshot_bytes": r.snapshot_bytes,
                    "segments_buffered": r.segments_buffered,
                    "bytes_buffered": r.bytes_buffered,
                })
            })
            .collect();
        serde_json::json!({
            "epoch": epoch,
            "next": self.next_seq,
            "oldest": self.items.front().map_or(self.next_seq, |m| m.seq),
            "received": self.received,
            "overwritten": self.overwritten,
            "items": items,
        })
    }
}

/// LWRR placement ring: weights scaled down by measured load per weight
/// unit (busier servers get fewer new flows), interleaved by smooth
/// weighted round robin so consecutive SYNs spread out.
fn place_code(p: Placement) -> u32 {
    match p {
        Placement::Maglev => PLACE_MAGLEV,
        Placement::Lwrr => PLACE_RING,
    }
}

/// Whether claim `new` (from the server at `new_ip`) holds a later
/// ownership of its flow than `old` (from the server at `old_ip`, `None`
/// if it is gone): the later migration wins.
/// - causality first: a claim whose epoch (the migration that brought the
///   connection) came from the other claimant is later (that claimant
///   handed the connection over; migration ids of two hosts do not
///   compare, their counters are per host);
/// - otherwise the claimant that took its connection more recently (on
///   the switch's clock: arrival minus the claim's age; this also settles
///   a 4-tuple reused by a new connection, which the client uses, over an
///   old connection a server still holds);
/// - a tie keeps `old`.
fn claim_is_later(
    new: &JudgedClaim,
    new_ip: Ipv4Addr,
    old: &JudgedClaim,
    old_ip: Option<Ipv4Addr>,
) -> bool {
    let origin = |epoch: u64| (epoch != 0).then(|| Ipv4Addr::from((epoch >> 32) as u32));
    if old_ip.is_some() && origin(new.epoch) == old_ip {
        return true;
    }
    if origin(old.epoch) == Some(new_ip) {
        return false;
    }
    new.owned_since > old.owned_since
}

pub fn lwrr_ring(live: &[Server]) -> Vec<u32> {
    if live.is_empty() {
        return Vec::new();
    }
    let per_w: Vec<f64> = live
        .iter()
        .map(|s| s.load as f64 / s.reg.weight as f64)
        .collect();
    let mean = per_w.iter().sum::<f64>() / per_w.len() as f64;
    let eff: Vec<i64> = live
        .iter()
        .zip(&per_w)
        .map(|(s, l)| {
            ((s.reg.weight as f64 * 16.0 * (mean + 1.0) / (l + 1.0)).round() as i64)
                .clamp(1, 1 << 20)
        })
        .collect();
    let total: i64 = eff.iter().sum();
    let mut current = vec![0i64; live.len()];
    let mut ring = Vec::with_capacity(RING_SIZE);
    for _ in 0..RING_SIZE {
        for (c, e) in current.iter_mut().zip(&eff) {
            *c += e;
        }
        let best = (0..live.len())
            .max_by_key(|i| (current[*i], std::cmp::Reverse(*i)))
            .unwrap_or(0);
        current[best] -= total;
        ring.push(live[best].index);
    }
    ring
}

/// Target ring: round robin over the live servers by weight, or the two
/// least loaded per unit of weight, first-fit (the second covers the case
/// where the first is the origin). The weight is a service's pool weight
/// (its configured weight, else the server's), as placement uses. `live`
/// holds no server of weight 0 ([`ControlPlane::live_members`]).
///
/// Round robin with equal weights is every live server once, in index
/// order ([`RING_ROTATE`]: the data plane skips the origin by taking the
/// next entry, never the same server). With unequal weights each server
/// appears in proportion to its weight, interleaved by smooth weighted
/// round robin ([`weighted_target_ring`], [`RING_PAIRED`]).
pub fn target_ring(live: &[Server], policy: TargetPolicy) -> CRing {
    match policy {
        TargetPolicy::RoundRobin => {
            let mut v: Vec<(u32, u32)> = live
                .iter()
                .map(|s| (s.index, s.reg.weight.max(1)))
                .collect();
            v.sort_unstable();
            let idx: Vec<u32> = v.iter().map(|(i, _)| *i).collect();
            let weights: Vec<u32> = v.iter().map(|(_, w)| *w).collect();
            match weighted_target_ring(&idx, &weights) {
                Some(pairs) => CRing::from_slice(RING_PAIRED, &pairs),
                None => CRing::from_slice(RING_ROTATE, &idx),
            }
        }
        TargetPolicy::LeastLoaded => {
            let mut v: Vec<&Server> = live.iter().collect();
            let per_weight = |s: &Server| s.load_pps / f64::from(s.reg.weight.max(1));
            v.sort_by(|a, b| {
                per_weight(a)
                    .total_cmp(&per_weight(b))
                    .then(a.index.cmp(&b.index))
            });
            let idx: Vec<u32> = v.iter().take(2).map(|s| s.index).collect();
            CRing::from_slice(RING_FIRST, &idx)
        }
    }
}

/// Pairs a [`RING_PAIRED`] ring holds at most.
pub const TARGET_RING_PAIRS: usize = RING_SIZE / 2;

/// `weights` (each at least 1) made as small as they go while keeping
/// their ratios, and summing to at most `cap` (>= `weights.len()`):
/// divided by their greatest common divisor, then, if still above `cap`,
/// scaled down proportionally (each kept at least 1: the ratios are then
/// approximate).
pub fn ring_weights(weights: &[u32], cap: usize) -> Vec<u32> {
    fn gcd(a: u64, b: u64) -> u64 {
        if b == 0 {
            a
        } else {
            gcd(b, a % b)
        }
    }
    let reduce = |w: Vec<u64>| -> Vec<u64> {
        let g = w.iter().fold(0, |g, x| gcd(g, *x)).max(1);
        w.into_iter().map(|x| x / g).collect()
    };
    let mut w = reduce(weights.iter().map(|x| u64::from((*x).max(1))).collect());
    let cap = cap as u64;
    let total: u64 = w.iter().sum();
    if total > cap {
        // floor(w * c / total), at least 1: sums to at most c + n, so some
        // c in (cap - n ..= cap] fits; the largest that does is taken.
        let orig = w.clone();
        let mut c = cap;
        loop {
            w = orig.iter().map(|x| (x * c / total).max(1)).collect();
            if w.iter().sum::<u64>() <= cap || c <= 1 {
                break;
            }
            c -= 1;
        }
        w = reduce(w);
    }
    w.into_iter().map(|x| x as u32).collect()
}

/// A [`RING_PAIRED`] target ring for servers `idx` (ascending indexes) of
/// weights `weights`: pairs (target, alternate), flattened. The targets
/// are smooth weighted round robin over every server (each in proportion
/// to its weight, spread out: a weight 3 of 5 comes as A B A B A, not A A
/// A B B), the weights reduced by [`ring_weights`] and the cycle repeated
/// as often as [`TARGET_RING_PAIRS`] allows. The alternate of a pair is
/// the target to use when the first is the migration's origin: for the
/// pairs whose target is X, a smooth weighted round robin over the other
/// servers, so the migrations of X too go out in proportion to the
/// others' weights. An alternate is never its pair's target.
///
/// `None` when a plain round robin in index order is the same ring (fewer
/// than two servers, or equal weights once reduced), or when the servers
/// do not fit (more than [`TARGET_RING_PAIRS`]: round robin unweighted).
pub fn weighted_target_ring(idx: &[u32], weights: &[u32]) -> Option<Vec<u32>> {
    let n = idx.len();
    if n < 2 || n > TARGET_RING_PAIRS || weights.len() != n {
        return None;
    }
    let w: Vec<i64> = ring_weights(weights, TARGET_RING_PAIRS)
        .into_iter()
        .map(i64::from)
        .collect();
    if w.iter().all(|x| *x == w[0]) {
        return None;
    }
    let total: i64 = w.iter().sum();
    let cycles = TARGET_RING_PAIRS / total as usize;
    let mut current = vec![0i64; n];
    // One alternate sequence per server, over the others.
    let mut alt_current = vec![vec![0i64; n]; n];
    let mut ring = Vec::with_capacity(2 * cycles * total as usize);
    for _ in 0..cycles * total as usize {
        let t = swrr_step(&mut current, &w, None);
        let a = swrr_step(&mut alt_current[t], &w, Some(t));
        ring.push(idx[t]);
        ring.push(idx[a]);
    }
    Some(ring)
}

/// One step of smooth weighted round robin (as nginx's): every entry but
/// `skip` gains its weight, the largest (the lowest position on a tie) is
/// chosen and loses the sum of the weights. `weights` has at least one
/// entry besides `skip`.
fn swrr_step(current: &mut [i64], weights: &[i64], skip: Option<usize>) -> usize {
    let mut sum = 0;
    let mut best: Option<usize> = None;
    for i in 0..current.len() {
        if Some(i) == skip {
            continue;
        }
        current[i] += weights[i];
        sum += weights[i];
    }
    for i in 0..current.len() {
        if Some(i) != skip && best.is_none_or(|b| current[i] > current[b]) {
            best = Some(i);
        }
    }
    let best = best.unwrap_or(0);
    current[best] -= sum;
    best
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::dataplane::MemDataPlane;
    use capybara_proto::FlowKey;
    use std::time::Duration;

    const VIP: Ipv4Addr = Ipv4Addr::new(198, 18, 100, 1);

    fn cp(policy: TargetPolicy) -> ControlPlane<MemDataPlane> {
        let mut c = ControlPlane::new(
            MemDataPlane::new(),
            ControlConfig::new(Duration::from_millis(300), policy),
        );
        c.add_service(VIP, 80, Placement::Maglev).unwrap();
        for j in 1..=3u32 {
            c.register(
                Instant::ZERO,
                ServerId(j),
                Ipv4Addr::new(198, 18, 2, 10 + j as u8),
                [2, 0, 0, 0, 1, j as u8],
                5,
                [2; 6],
                1,
            )
            .unwrap();
        }
        c
    }

    fn key(port: u16) -> CFlowKey {
        CFlowKey::from(FlowKey {
            client_ip: Ipv4Addr::new(198, 18, 0, 11),
            client_port: port,
            service_ip: VIP,
            service_port: 80,
        })
    }

    #[test]
    fn registration_pushes_servers_and_full_maglev_table() {
        let c = cp(TargetPolicy::RoundRobin);
        assert_eq!(c.dp.servers.len(), 3);
        let t = &c.dp.maglev[&0];
        assert!(t.iter().all(|v| *v < 3));
        assert_eq!(c.dp.rings[&(0, RING_TARGET)].as_slice(), &[0, 1, 2]);
        assert_eq!(
            c.dp.server_by_addr[&u32::from_ne_bytes([198, 18, 2, 12])],
            1
        );
    }

    /// `placing` names exactly the servers the Maglev table names, through
    /// a drain, an operator weight 0 and a leaving server.
    #[test]
    fn placing_is_the_servers_the_maglev_table_names() {
        let mut c = cp(TargetPolicy::RoundRobin);
        let in_table = |c: &ControlPlane<MemDataPlane>| {
            let idx: std::collections::BTreeSet<u32> = c.dp.maglev[&0].iter().copied().collect();
            let mut ids: Vec<u32> = c
                .servers()
                .filter(|s| idx.contains(&s.index))
                .map(|s| s.reg.id.0)
                .collect();
            ids.sort();
            ids
        };
        let check = |c: &ControlPlane<MemDataPlane>, want: &[u32]| {
            let mut p = c.placing(0);
            p.sort();
            assert_eq!(p, want);
            assert_eq!(in_table(c), want, "the Maglev table");
        };
        check(&c, &[1, 2, 3]);
        c.set_draining(ServerId(3), true).unwrap();
        check(&c, &[1, 2]);
        c.set_operator_weights([(ServerId(1), 0)].into()).unwrap();
        check(&c, &[2]);
        c.set_leaving(ServerId(2), true).unwrap();
        // Nobody left: the table names no server, and `placing` is empty.
        check(&c, &[]);
        c.set_leaving(ServerId(2), false).unwrap();
        c.set_draining(ServerId(3), false).unwrap();
        c.set_operator_weights(BTreeMap::new()).unwrap();
        check(&c, &[1, 2, 3]);
        assert!(c.placing(7).is_empty(), "no such service");
    }

    #[test]
    fn drain_removes_server_from_placement_and_targets_only() {
        let mut c = cp(TargetPolicy::RoundRobin);
        c.dp.place_flow(key(1), 1, 0);
        let writes_before = c.dp.maglev_writes;
        c.set_draining(ServerId(2), true).unwrap();
        assert!(c.dp.maglev[&0].iter().all(|v| *v != 1));
        // A delta, not a rewrite of the whole table.
        let delta = c.dp.maglev_writes - writes_before;
        assert!(delta > 0 && delta < (MAGLEV_SIZE as u64) / 2, "{delta}");
        assert_eq!(c.dp.rings[&(0, RING_TARGET)].as_slice(), &[0, 2]);
        assert_eq!(c.dp.servers[&1].state, SERVER_DRAINING);
        assert_eq!(
            c.dp.current_owner(key(1)),
            Some(1),
            "existing flow untouched"
        );
        c.set_draining(ServerId(2), false).unwrap();
        assert_eq!(c.dp.rings[&(0, RING_TARGET)].as_slice(), &[0, 1, 2]);
        assert_eq!(
            c.dp.draining_while_placed, 0,
            "a slot named the server while the data plane saw it DRAINING (its SYNs dropped)"
        );
    }

    #[test]
    fn operator_weights_replace_register_weights_and_zero_takes_no_new_flows() {
        let mut c = cp(TargetPolicy::RoundRobin);
        c.add_service(VIP, 6379, Placement::Lwrr).unwrap();
        c.dp.place_flow(key(1), 1, 0);
        let share = |c: &ControlPlane<MemDataPlane>, index: u32| {
            c.dp.maglev[&0].iter().filter(|v| **v == index).count() as f64 / MAGLEV_SIZE as f64
        };
        assert!((share(&c, 1) - 1.0 / 3.0).abs() < 0.01);
        // Weight 0 on server 2 (index 1): in no Maglev slot, LWRR ring or
        // target ring; still LIVE, its connection kept.
        let zero: BTreeMap<ServerId, u32> = [(ServerId(2), 0)].into();
        assert!(c.set_operator_weights(zero.clone()).unwrap());
        assert!(!c.set_operator_weights(zero).unwrap(), "no change");
        assert_eq!(share(&c, 1), 0.0);
        assert!(!c.dp.rings[&(1, RING_PLACEMENT)].as_slice().contains(&1));
        assert_eq!(c.dp.rings[&(0, RING_TARGET)].as_slice(), &[0, 2]);
        assert_eq!(c.dp.servers[&1].state, SERVER_LIVE);
        assert_eq!(c.dp.servers[&1].weight, 0);
        assert_eq!(c.dp.current_owner(key(1)), Some(1), "existing flow kept");
        let s2 = c.server(ServerId(2)).unwrap().clone();
        assert_eq!((s2.reg.weight, c.weight_of(&s2)), (1, 0));
        // Its REGISTER again (hostagent restart, config weight 1): still 0.
        c.register(
            Instant::ZERO,
            ServerId(2),
            Ipv4Addr::new(198, 18, 2, 12),
            [2, 0, 0, 0, 1, 2],
            5,
            [2; 6],
            1,
        )
        .unwrap();
        assert_eq!(share(&c, 1), 0.0, "a REGISTER keeps the operator's 0");
        assert!(!c.dp.rings[&(1, RING_PLACEMENT)].as_slice().contains(&1));
        // Weight 3: three fifths of the slots (1 + 3 + 1).
        c.set_operator_weights([(ServerId(2), 3)].into()).unwrap();
        assert!((share(&c, 1) - 0.6).abs() < 0.01, "{}", share(&c, 1));
        // Migration targets by weight too: 1:3:1 (pairs of target and
        // alternate, weighted_target_ring).
        let ring = c.dp.rings[&(0, RING_TARGET)];
        assert_eq!(ring.mode, RING_PAIRED);
        let targets: Vec<u32> = ring.as_slice().chunks(2).map(|p| p[0]).collect();
        assert_eq!(
            (0..3).map(|i| count_of(&targets, i)).collect::<Vec<_>>(),
            [25, 75, 25]
        );
        // No operator weight any more: the REGISTER's again.
        c.set_operator_weights(BTreeMap::new()).unwrap();
        assert!((share(&c, 1) - 1.0 / 3.0).abs() < 0.01);
        assert_eq!(c.dp.servers[&1].weight, 1);
        assert_eq!(
            c.dp.draining_while_placed, 0,
            "a slot named a server the data plane saw not LIVE"
        );
    }

    #[test]
    fn a_down_backend_leaves_its_service_placement_only() {
        let mut c = cp(TargetPolicy::RoundRobin);
        let web = SocketAddrV4::new(VIP, 80);
        c.add_service(VIP, 6379, Placement::Lwrr).unwrap();
        let redis = SocketAddrV4::new(VIP, 6379);
        c.dp.place_flow(key(1), 1, 0);
        let t0 = Instant::from_millis(1000);
        c.set_backend_health(t0, ServerId(2), true, &[web]).unwrap();
        assert_eq!(
            c.take_health_events(),
            vec![HealthEvent::Backend {
                id: ServerId(2),
                service: web,
                down: true
            }]
        );
        assert!(
            c.dp.maglev[&0].iter().all(|v| *v != 1),
            "out of web's placement"
        );
        assert_eq!(c.dp.rings[&(0, RING_TARGET)].as_slice(), &[0, 2]);
        assert!(c.dp.maglev[&1].contains(&1), "still in redis's");
        assert_eq!(c.dp.rings[&(1, RING_TARGET)].as_slice(), &[0, 1, 2]);
        assert_eq!(
            c.dp.servers[&1].state, SERVER_LIVE,
            "its state is untouched"
        );
        assert_eq!(
            c.dp.current_owner(key(1)),
            Some(1),
            "existing flow untouched"
        );
        assert!(!c.services()[0].fail_open);
        // The same report again: nothing to do.
        let pushes = c.health_pushes_total;
        c.set_backend_health(t0, ServerId(2), true, &[web]).unwrap();
        assert_eq!(c.health_pushes_total, pushes);
        // Back up within HEALTH_PUSH_EVERY: applied at the end of it (tick).
        let t1 = t0 + Duration::from_millis(50);
        c.set_backend_health(t1, ServerId(2), true, &[]).unwrap();
        assert!(c.dp.maglev[&0].iter().all(|v| *v != 1), "rate-limited");
        // (Heartbeats keep the servers alive through the ticks.)
        let tick = |c: &mut ControlPlane<MemDataPlane>, t: Instant| {
            for j in 1..=3 {
                c.heartbeat(t, ServerId(j)).unwrap();
            }
            c.tick(t).unwrap();
        };
        tick(&mut c, t1 + Duration::from_millis(10));
        assert!(c.dp.maglev[&0].iter().all(|v| *v != 1), "rate-limited");
        tick(&mut c, t0 + HEALTH_PUSH_EVERY);
        assert!(c.dp.maglev[&0].contains(&1), "back in web's placement");
        assert_eq!(c.dp.rings[&(0, RING_TARGET)].as_slice(), &[0, 1, 2]);
        assert_eq!(c.health_pushes_total, pushes + 1);
        // A heartbeat without health bits (an older hostagent): all up.
        let t2 = t0 + Duration::from_secs(1);
        c.set_backend_health(t2, ServerId(3), true, &[redis])
            .unwrap();
        assert!(c.dp.maglev[&1].iter().all(|v| *v != 2));
        c.set_backend_health(t2 + HEALTH_PUSH_EVERY, ServerId(3), false, &[redis])
            .unwrap();
        assert!(c.dp.maglev[&1].contains(&2));
        assert!(!c.server(ServerId(3)).unwrap().health_reported);
        assert_eq!(c.dp.draining_while_placed, 0);
    }

    #[test]
    fn when_every_backend_is_down_placement_fails_open() {
        let mut c = cp(TargetPolicy::RoundRobin);
        let web = SocketAddrV4::new(VIP, 80);
        let mut t = Instant::from_millis(1000);
        for j in 1..=3 {
            c.set_backend_health(t, ServerId(j), true, &[web]).unwrap();
            t += HEALTH_PUSH_EVERY;
        }
        let events = c.take_health_events();
        assert_eq!(
            events.last(),
            Some(&HealthEvent::FailOpen {
                service: web,
                on: true
            })
        );
        assert!(c.services()[0].fail_open);
        // Placement keeps everybody, no migration target is left.
        for j in 0..3 {
            assert!(c.dp.maglev[&0].contains(&j));
        }
        assert!(c.dp.rings[&(0, RING_TARGET)].as_slice().is_empty());
        // One comes back: only it is placed on.
        c.set_backend_health(t, ServerId(2), true, &[]).unwrap();
        assert!(c.dp.maglev[&0].iter().all(|v| *v == 1));
        assert_eq!(c.dp.rings[&(0, RING_TARGET)].as_slice(), &[1]);
        assert!(!c.services()[0].fail_open);
        assert!(c.take_health_events().contains(&HealthEvent::FailOpen {
            service: web,
            on: false
        }));
    }

    #[test]
    fn pool_monitor_reports_interval_loads_and_least_loaded() {
        let mut c = cp(TargetPolicy::LeastLoaded);
        c.dp.count_packets(0, 100);
        c.dp.count_packets(1, 10);
        c.dp.count_packets(2, 50);
        let maglev_writes = c.dp.maglev_writes;
        let r = c.tick(Instant::from_millis(1)).unwrap();
        assert_eq!(
            c.dp.maglev_writes, maglev_writes,
            "a load change must not rewrite Maglev tables"
        );
        assert_eq!(r.len(), 3);
        assert!(r.iter().all(|x| x.pool_load == 160 && x.live_servers == 3));
        assert_eq!(r[0].own_load, 100);
        assert_eq!(r[0].least_loaded, Ipv4Addr::new(198, 18, 2, 12));
        let ring = c.dp.rings[&(0, RING_TARGET)];
        assert_eq!((ring.mode, ring.as_slice()), (RING_FIRST, &[1u32, 2][..]));
        // Next interval counts only new packets.
        c.dp.count_packets(0, 5);
        let r = c.tick(Instant::from_millis(2)).unwrap();
        assert_eq!((r[0].own_load, r[0].pool_load), (5, 5));
        assert!(
            r.iter().all(|x| x.weights.is_none()),
            "equal weights: version 1"
        );
    }

    /// Operator weights reach the policies: while the pool's weights
    /// differ every report carries this server's and the pool's (a weight-0
    /// server is out of the pool, as it takes no new connection and no
    /// migration), and the least-loaded target is least loaded per unit of
    /// weight.
    #[test]
    fn load_reports_carry_weights_and_targets_are_least_loaded_per_weight() {
        use capybara_proto::load::LoadWeights;
        let mut c = cp(TargetPolicy::LeastLoaded);
        c.set_operator_weights([(ServerId(3), 5)].into()).unwrap();
        // s1 10, s2 20, s3 30 per interval: per unit of weight s3 (6) is
        // the least loaded, then s1.
        for (i, n) in [(0, 10), (1, 20), (2, 30)] {
            c.dp.count_packets(i, n);
        }
        let r = c.tick(Instant::from_millis(1)).unwrap();
        assert!(r.iter().all(|x| x.pool_load == 60 && x.live_servers == 3));
        let w: Vec<_> = r.iter().map(|x| x.weights).collect();
        assert_eq!(
            w,
            [1, 1, 5].map(|own| Some(LoadWeights { own, pool: 7 })),
            "{r:?}"
        );
        assert_eq!(r[0].least_loaded, Ipv4Addr::new(198, 18, 2, 13));
        let ring = c.dp.rings[&(0, RING_TARGET)];
        assert_eq!((ring.mode, ring.as_slice()), (RING_FIRST, &[2u32, 0][..]));
        // Weight 0: no target, not in the pool, and told its weight.
        c.set_operator_weights([(ServerId(3), 5), (ServerId(1), 0)].into())
            .unwrap();
        for (i, n) in [(0, 10), (1, 20), (2, 30)] {
            c.dp.count_packets(i, n);
        }
        let r = c.tick(Instant::from_millis(2)).unwrap();
        assert!(r.iter().all(|x| x.pool_load == 50 && x.live_servers == 2));
        let w: Vec<_> = r.iter().map(|x| x.weights).collect();
        assert_eq!(
            w,
            [0, 1, 5].map(|own| Some(LoadWeights { own, pool: 6 })),
            "{r:?}"
        );
        let ring = c.dp.rings[&(0, RING_TARGET)];
        assert_eq!(ring.as_slice(), &[2u32, 1][..]);
        // Equal weights again: version 1.
        c.set_operator_weights(BTreeMap::new()).unwrap();
        let r = c.tick(Instant::from_millis(3)).unwrap();
        assert!(r.iter().all(|x| x.weights.is_none()), "{r:?}");
    }

    /// A draining server, and one whose only service's application is
    /// down, are out of the pool the load notifications average over: with
    /// them in, the two others each looked busier than the pool for good
    /// and shed connections to each other for the whole maintenance. They
    /// still get their own report.
    #[test]
    fn pool_load_counts_only_servers_that_take_load() {
        let mut c = cp(TargetPolicy::LeastLoaded);
        c.set_draining(ServerId(2), true).unwrap();
        c.dp.count_packets(0, 100);
        c.dp.count_packets(1, 0);
        c.dp.count_packets(2, 60);
        let r = c.tick(Instant::from_millis(1)).unwrap();
        assert_eq!(r.len(), 3, "the draining server is still told its load");
        assert!(
            r.iter().all(|x| x.pool_load == 160 && x.live_servers == 2),
            "{r:?}"
        );
        assert_eq!(r[0].least_loaded, Ipv4Addr::new(198, 18, 2, 13));
        let web = SocketAddrV4::new(c.services()[0].vip, c.services()[0].port);
        c.set_backend_health(Instant::from_millis(1), ServerId(3), true, &[web])
            .unwrap();
        c.dp.count_packets(0, 10);
        let r = c.tick(Instant::from_millis(2)).unwrap();
        assert!(
            r.iter().all(|x| x.pool_load == 10 && x.live_servers == 1),
            "{r:?}"
        );
        assert_eq!(r[0].least_loaded, Ipv4Addr::new(198, 18, 2, 11));
        // Back in: counted again.
        c.set_draining(ServerId(2), false).unwrap();
        c.set_backend_health(Instant::from_millis(3), ServerId(3), true, &[])
            .unwrap();
        let r = c.tick(Instant::from_millis(3)).unwrap();
        assert!(r.iter().all(|x| x.live_servers == 3), "{r:?}");
    }

    /// Three servers (s2 with instance 7, the others none), grace `grace`;
    /// flows: 1 on s1; 2 on s2; 3 placed on s2, migrated to s3; 4 placed
    /// on s1, migrated to s2. Events flushed.
    fn world(grace: Duration) -> ControlPlane<MemDataPlane> {
        let mut cfg = ControlConfig::new(Duration::from_millis(300), TargetPolicy::RoundRobin);
        cfg.dead_flow_grace = grace;
        let mut c = ControlPlane::new(MemDataPlane::new(), cfg);
        c.add_service(VIP, 80, Placement::Maglev).unwrap();
        for j in 1..=3u32 {
            c.register_as(Instant::ZERO, &reg(j, if j == 2 { 7 } else { 0 }), &[])
                .unwrap();
        }
        c.dp.place_flow(key(1), 0, 0);
        c.dp.place_flow(key(2), 1, 0);
        c.dp.place_flow(key(3), 1, 0);
        c.dp.migrate_flow(key(3), 2);
        c.dp.place_flow(key(4), 0, 0);
        c.dp.migrate_flow(key(4), 1);
        let mut sink = VecSink::default();
        c.flush_events(Instant::ZERO, &mut sink).unwrap();
        assert_eq!(sink.0.len(), 6);
        c
    }

    pub(crate) fn reg(j: u32, instance: u64) -> Registration {
        Registration {
            id: ServerId(j),
            data_ip: Ipv4Addr::new(198, 18, 2, 10 + j as u8),
            mac: [2, 0, 0, 0, 1, j as u8],
            ifindex: 5,
            src_mac: [2; 6],
            weight: 1,
            instance,
        }
    }

    /// Heartbeats from s1 and s3 (not s2) and a tick, every 100 ms in
    /// `from_ms..=to_ms`.
    fn run_without_s2(c: &mut ControlPlane<MemDataPlane>, from_ms: u64, to_ms: u64) {
        for t in (from_ms..=to_ms).step_by(100) {
            let now = Instant::from_millis(t);
            c.heartbeat(now, ServerId(1)).unwrap();
            c.heartbeat(now, ServerId(3)).unwrap();
            c.tick(now).unwrap();
        }
    }

    fn closed_ports(c: &mut ControlPlane<MemDataPlane>) -> Vec<u16> {
        let mut sink = VecSink::default();
        c.flush_events(Instant::ZERO, &mut sink).unwrap();
        let mut closed: Vec<u16> = sink
            .0
            .iter()
            .filter(|e| e.kind == EV_CLOSED)
            .map(|e| FlowKey::from(e.key).client_port)
            .collect();
        closed.sort();
        closed
    }

    fn owners(c: &ControlPlane<MemDataPlane>) -> Vec<Option<u32>> {
        (1..=4).map(|p| c.dp.current_owner(key(p))).collect()
    }

    #[test]
    fn dead_server_keeps_its_flows_for_the_grace_then_loses_only_those() {
        let mut c = world(Duration::from_secs(2));
        run_without_s2(&mut c, 100, 500);
        let s2 = c.server(ServerId(2)).unwrap();
        assert_eq!(s2.liveness, Liveness::Dead);
        assert_eq!(s2.flows_kept_until, Some(Instant::from_millis(2400)));
        assert_eq!(c.server(ServerId(1)).unwrap().liveness, Liveness::Live);
        // Out of placement at once (data plane: its packets are dropped)...
        assert!(c.dp.maglev[&0].iter().all(|v| *v != 1));
        assert_eq!(c.dp.rings[&(0, RING_TARGET)].as_slice(), &[0, 2]);
        assert_eq!(c.dp.servers[&1].state, SERVER_DEAD);
        // ...but every flow entry stays during the grace, none reported closed.
        assert_eq!(owners(&c), vec![Some(0), Some(1), Some(2), Some(1)]);
        assert!(closed_ports(&mut c).is_empty());
        assert_eq!(
            c.take_liveness_events(),
            vec![LivenessEvent::Died {
                id: ServerId(2),
                flows_kept_until: Some(Instant::from_millis(2400)),
            }]
        );
        // A dead server is not reported to by the pool monitor.
        let r = c.tick(Instant::from_millis(600)).unwrap();
        assert!(r.iter().all(|x| x.server != ServerId(2)) && r.iter().all(|x| x.live_servers == 2));
        run_without_s2(&mut c, 700, 2300);
        assert_eq!(owners(&c)[1], Some(1), "still within the grace");
        // Grace over: the flows on s2 (placed or migrated in) go, the others stay.
        run_without_s2(&mut c, 2400, 2400);
        assert_eq!(owners(&c), vec![Some(0), None, Some(2), None]);
        assert_eq!(closed_ports(&mut c), vec![2, 4]);
        assert_eq!(
            c.take_liveness_events(),
            vec![LivenessEvent::FlowsRemoved {
                id: ServerId(2),
                flows: 2,
                why: FlowsRemovedWhy::GraceEnded,
            }]
        );
        assert_eq!(c.server(ServerId(2)).unwrap().flows_kept_until, None);
        assert_eq!(
            (
                c.liveness.died_total,
                c.liveness.grace_ended_total,
                c.liveness.dead_flows_removed_total,
                c.liveness.returned_total
            ),
            (1, 1, 2, 0)
        );
        // After the grace a heartbeat alone does not revive it: it must
        // register again (the daemon answers "register first").
        c.heartbeat(Instant::from_millis(2500), ServerId(2))
            .unwrap();
        assert_eq!(c.server(ServerId(2)).unwrap().liveness, Liveness::Dead);
        c.register_as(Instant::from_millis(2600), &reg(2, 7), &[])
            .unwrap();
        assert_eq!(c.server(ServerId(2)).unwrap().liveness, Liveness::Live);
        assert!(closed_ports(&mut c).is_empty());
        assert!(c.take_liveness_events().is_empty());
    }

    #[test]
    fn dead_server_back_within_grace_keeps_its_flows() {
        let mut c = world(Duration::from_secs(2));
        let table = c.dp.maglev[&0].clone();
        run_without_s2(&mut c, 100, 1000);
        assert_eq!(c.server(ServerId(2)).unwrap().liveness, Liveness::Dead);
        c.take_liveness_events();
        // A heartbeat (the stall is over): back as it was.
        c.heartbeat(Instant::from_millis(1050), ServerId(2))
            .unwrap();
        let s2 = c.server(ServerId(2)).unwrap();
        assert_eq!((s2.liveness, s2.flows_kept_until), (Liveness::Live, None));
        assert_eq!(c.dp.servers[&1].state, SERVER_LIVE);
        assert_eq!(c.dp.maglev[&0], table, "same placement as before the stall");
        assert_eq!(c.dp.rings[&(0, RING_TARGET)].as_slice(), &[0, 1, 2]);
        assert_eq!(
            c.take_liveness_events(),
            vec![LivenessEvent::Returned {
                id: ServerId(2),
                dead_for: Duration::from_millis(650),
                by_register: false,
            }]
        );
        // Long past the old grace's end: nothing removed, nothing closed.
        for t in (1100..=4000u64).step_by(100) {
            let now = Instant::from_millis(t);
            for j in 1..=3 {
                c.heartbeat(now, ServerId(j)).unwrap();
            }
            c.tick(now).unwrap();
        }
        assert_eq!(owners(&c), vec![Some(0), Some(1), Some(2), Some(1)]);
        assert!(closed_ports(&mut c).is_empty());
        assert!(c.take_liveness_events().is_empty());

        // Dead again, back by a REGISTER of the same instance (the switch
        // had told it to register again): flows kept too.
        run_without_s2(&mut c, 4100, 4500);
        assert_eq!(c.server(ServerId(2)).unwrap().liveness, Liveness::Dead);
        c.take_liveness_events();
        c.register_as(Instant::from_millis(4600), &reg(2, 7), &[])
            .unwrap();
        assert_eq!(c.server(ServerId(2)).unwrap().liveness, Liveness::Live);
        assert_eq!(c.dp.maglev[&0], table);
        assert_eq!(owners(&c), vec![Some(0), Some(1), Some(2), Some(1)]);
        assert!(closed_ports(&mut c).is_empty());
        assert!(matches!(
            c.take_liveness_events()[..],
            [LivenessEvent::Returned {
                id: ServerId(2),
                by_register: true,
                ..
            }]
        ));
        run_without_s2(&mut c, 4700, 4700);
        assert_eq!(c.liveness.returned_total, 2);
        assert_eq!(c.liveness.dead_flows_removed_total, 0);

        // A server that was draining comes back draining.
        c.set_draining(ServerId(2), true).unwrap();
        run_without_s2(&mut c, 4800, 5200);
        assert_eq!(c.server(ServerId(2)).unwrap().liveness, Liveness::Dead);
        c.heartbeat(Instant::from_millis(5300), ServerId(2))
            .unwrap();
        assert_eq!(c.server(ServerId(2)).unwrap().liveness, Liveness::Draining);
        assert_eq!(c.dp.servers[&1].state, SERVER_DRAINING);
    }

    #[test]
    fn restarted_server_loses_the_old_process_flows_at_once() {
        let mut c = world(Duration::from_secs(10));
        run_without_s2(&mut c, 100, 500);
        assert_eq!(c.server(ServerId(2)).unwrap().liveness, Liveness::Dead);
        c.take_liveness_events();
        // Within the grace, but another instance: a restarted hostagent.
        c.register_as(Instant::from_millis(600), &reg(2, 8), &[])
            .unwrap();
        let s2 = c.server(ServerId(2)).unwrap();
        assert_eq!((s2.liveness, s2.reg.instance), (Liveness::Live, 8));
        assert_eq!(owners(&c), vec![Some(0), None, Some(2), None]);
        assert_eq!(closed_ports(&mut c), vec![2, 4]);
        assert_eq!(
            c.take_liveness_events(),
            vec![LivenessEvent::FlowsRemoved {
                id: ServerId(2),
                flows: 2,
                why: FlowsRemovedWhy::Restarted { old: 7, new: 8 },
            }]
        );
        assert_eq!(
            (
                c.liveness.restarts_total,
                c.liveness.restart_flows_removed_total
            ),
            (1, 2)
        );
        // Nothing left for the old grace to remove.
        c.heartbeat(Instant::from_millis(700), ServerId(2)).unwrap();
        run_without_s2(&mut c, 700, 700);
        assert!(c.take_liveness_events().is_empty());

        // A restart faster than dead_after (never declared dead) too.
        c.dp.place_flow(key(5), 1, 0);
        c.flush_events(Instant::ZERO, &mut VecSink::default())
            .unwrap();
        c.register_as(Instant::from_millis(750), &reg(2, 9), &[])
            .unwrap();
        assert_eq!(c.dp.current_owner(key(5)), None);
        assert_eq!(closed_ports(&mut c), vec![5]);
        // The same instance registering again (lost REGISTER_ACK) keeps them.
        c.dp.place_flow(key(6), 1, 0);
        c.register_as(Instant::from_millis(800), &reg(2, 9), &[])
            .unwrap();
        assert_eq!(c.dp.current_owner(key(6)), Some(1));
        // Without an instance id (an older hostagent) a restart cannot be
        // told from a stall: kept.
        c.register_as(Instant::from_millis(850), &reg(2, 0), &[])
            .unwrap();
        assert_eq!(c.dp.current_owner(key(6)), Some(1));
    }

    #[test]
    fn a_lowered_dead_after_holds_the_old_one_for_two_of_its_periods() {
        // dead_after 300 ms; s1 heartbeats every 250 ms (its old interval).
        let mut c = world(Duration::from_secs(10));
        let beat = |c: &mut ControlPlane<MemDataPlane>, from: u64, to: u64, every: u64| {
            for t in (from..=to).step_by(10) {
                let now = Instant::from_millis(t);
                if t % every == 0 {
                    for j in 1..=3 {
                        c.heartbeat(now, ServerId(j)).unwrap();
                    }
                }
                c.tick(now).unwrap();
            }
        };
        beat(&mut c, 0, 1000, 250);
        assert!(c.take_liveness_events().is_empty());
        // Lowered to 100 ms at 1000: the servers still beat every 250 ms
        // (their REGISTER_ACK may not have arrived): 300 ms holds until
        // 1000 + 2 x 300.
        let until = c.set_dead_after(Instant::from_millis(1000), Duration::from_millis(100));
        assert_eq!(until, Instant::from_millis(1600));
        assert_eq!(
            c.dead_after(Instant::from_millis(1599)),
            Duration::from_millis(300)
        );
        assert_eq!(
            c.dead_after_held_until(Instant::from_millis(1200)),
            Some(until)
        );
        beat(&mut c, 1010, 1590, 250);
        assert!(
            c.take_liveness_events().is_empty(),
            "a live server looked dead"
        );
        // From then on 100 ms applies: the servers now beat every 40 ms.
        assert_eq!(
            c.dead_after(Instant::from_millis(1600)),
            Duration::from_millis(100)
        );
        assert_eq!(c.dead_after_held_until(Instant::from_millis(1600)), None);
        beat(&mut c, 1600, 2000, 40);
        assert!(c.take_liveness_events().is_empty());
        // and a server silent for more than 100 ms is dead.
        for t in (2010..=2200).step_by(10) {
            let now = Instant::from_millis(t);
            if t % 40 == 0 {
                c.heartbeat(now, ServerId(1)).unwrap();
                c.heartbeat(now, ServerId(3)).unwrap();
            }
            c.tick(now).unwrap();
        }
        assert_eq!(c.server(ServerId(2)).unwrap().liveness, Liveness::Dead);
        // An increase applies at once; a lower one during a hold keeps the
        // larger value in force.
        assert_eq!(
            c.set_dead_after(Instant::from_millis(3000), Duration::from_millis(800)),
            Instant::from_millis(3000)
        );
        assert_eq!(
            c.dead_after(Instant::from_millis(3000)),
            Duration::from_millis(800)
        );
        c.set_dead_after(Instant::from_millis(3000), Duration::from_millis(400));
        c.set_dead_after(Instant::from_millis(3100), Duration::from_millis(200));
        assert_eq!(
            c.dead_after(Instant::from_millis(3100)),
            Duration::from_millis(800)
        );
        assert_eq!(
            c.dead_after(Instant::from_millis(4699)),
            Duration::from_millis(800)
        );
        assert_eq!(
            c.dead_after(Instant::from_millis(4700)),
            Duration::from_millis(200)
        );
    }

    #[test]
    fn without_grace_a_dead_server_loses_its_flows_at_once() {
        let mut c = world(Duration::ZERO);
        run_without_s2(&mut c, 100, 500);
        assert_eq!(c.server(ServerId(2)).unwrap().liveness, Liveness::Dead);
        assert_eq!(owners(&c), vec![Some(0), None, Some(2), None]);
        assert_eq!(closed_ports(&mut c), vec![2, 4]);
        assert!(matches!(
            c.take_liveness_events()[..],
            [
                LivenessEvent::Died {
                    flows_kept_until: None,
                    ..
                },
                LivenessEvent::FlowsRemoved {
                    flows: 2,
                    why: FlowsRemovedWhy::DeadNoGrace,
                    ..
                }
            ]
        ));
        // No grace: a heartbeat does not revive it.
        c.heartbeat(Instant::from_millis(600), ServerId(2)).unwrap();
        assert_eq!(c.server(ServerId(2)).unwrap().liveness, Liveness::Dead);
    }

    #[test]
    fn a_dead_address_taken_by_another_id_loses_the_kept_flows() {
        let mut c = world(Duration::from_secs(10));
        run_without_s2(&mut c, 100, 500);
        c.take_liveness_events();
        // Server 9 takes s2's data address during s2's grace.
        let r = Registration {
            id: ServerId(9),
            ..reg(2, 0)
        };
        c.register_as(Instant::from_millis(600), &r, &[]).unwrap();
        assert!(c.server(ServerId(2)).is_none());
        assert_eq!(owners(&c), vec![Some(0), None, Some(2), None]);
        assert_eq!(closed_ports(&mut c), vec![2, 4]);
        assert!(matches!(
            c.take_liveness_events()[..],
            [LivenessEvent::FlowsRemoved {
                why: FlowsRemovedWhy::AddressReused,
                ..
            }]
        ));
    }

    #[test]
    fn a_takeover_restores_a_dead_server_with_its_flows_for_a_grace() {
        let mut cfg = ControlConfig::new(Duration::from_millis(300), TargetPolicy::RoundRobin);
        cfg.dead_flow_grace = Duration::from_secs(2);
        let mut c = ControlPlane::new(MemDataPlane::new(), cfg);
        c.add_service(VIP, 80, Placement::Maglev).unwrap();
        c.register_as(Instant::ZERO, &reg(1, 0), &[]).unwrap();
        c.restore_dead(Instant::ZERO, &reg(2, 0)).unwrap();
        assert_eq!(c.server(ServerId(2)).unwrap().liveness, Liveness::Dead);
        assert!(c.dp.maglev[&0].iter().all(|v| *v == 0));
        let flow = |p| FlowKey::from(key(p));
        let (loaded, skipped) = c
            .load_flows(&[(flow(1), ServerId(1)), (flow(2), ServerId(2))])
            .unwrap();
        assert_eq!((loaded, skipped), (2, 0));
        // Taking over at 5 s: the grace counts from then.
        c.restart_liveness_clocks(Instant::from_millis(5000));
        c.heartbeat(Instant::from_millis(6900), ServerId(1))
            .unwrap();
        c.tick(Instant::from_millis(6900)).unwrap();
        assert_eq!(c.dp.current_owner(key(2)), Some(1));
        c.heartbeat(Instant::from_millis(7000), ServerId(1))
            .unwrap();
        c.tick(Instant::from_millis(7000)).unwrap();
        assert_eq!(c.dp.current_owner(key(2)), None);
        assert_eq!(closed_ports(&mut c), vec![2], "the store forgets it too");
        assert_eq!(c.dp.current_owner(key(1)), Some(0));
    }

    /// After a takeover the restored instance ids decide as on the live
    /// path: a REGISTER of another instance drops the old process's flows at
    /// once (live or dead within its grace), the same instance keeps them.
    #[test]
    fn after_a_takeover_the_restored_instance_tells_a_restart_from_a_stall() {
        let flow = |p| FlowKey::from(key(p));
        let standby = || {
            let mut cfg = ControlConfig::new(Duration::from_millis(300), TargetPolicy::RoundRobin);
            cfg.dead_flow_grace = Duration::from_secs(2);
            let mut c = ControlPlane::new(MemDataPlane::new(), cfg);
            c.add_service(VIP, 80, Placement::Maglev).unwrap();
            // Restored from the store: s1 live, s2 dead with flows.
            c.register_as(Instant::ZERO, &reg(1, 7), &[]).unwrap();
            c.restore_dead(Instant::ZERO, &reg(2, 8)).unwrap();
            c.load_flows(&[(flow(1), ServerId(1)), (flow(2), ServerId(2))])
                .unwrap();
            c.restart_liveness_clocks(Instant::from_millis(100));
            c.take_liveness_events();
            c
        };

        let mut c = standby();
        c.register_as(Instant::from_millis(200), &reg(1, 17), &[])
            .unwrap();
        c.register_as(Instant::from_millis(200), &reg(2, 18), &[])
            .unwrap();
        assert_eq!(c.dp.current_owner(key(1)), None);
        assert_eq!(c.dp.current_owner(key(2)), None);
        assert_eq!(closed_ports(&mut c), vec![1, 2]);
        assert_eq!(c.liveness.restarts_total, 2);

        let mut c = standby();
        c.register_as(Instant::from_millis(200), &reg(1, 7), &[])
            .unwrap();
        c.register_as(Instant::from_millis(200), &reg(2, 8), &[])
            .unwrap();
        assert_eq!(c.dp.current_owner(key(1)), Some(0));
        assert_eq!(c.dp.current_owner(key(2)), Some(1));
        assert_eq!(c.server(ServerId(2)).unwrap().liveness, Liveness::Live);
        assert_eq!(c.liveness.restarts_total, 0);

        // A standby following the records takes a newer instance without
        // judging it (the active did): the flows stay, and that instance
        // registering again after the takeover keeps them too.
        let mut c = standby();
        c.follow_instance(ServerId(1), 27);
        c.follow_instance(ServerId(1), 0);
        assert_eq!(c.server(ServerId(1)).unwrap().reg.instance, 27);
        assert_eq!(c.dp.current_owner(key(1)), Some(0));
        c.register_as(Instant::from_millis(200), &reg(1, 27), &[])
            .unwrap();
        assert_eq!(c.dp.current_owner(key(1)), Some(0));
        assert_eq!(c.liveness.restarts_total, 0);
    }

    #[test]
    fn lwrr_favours_idle_servers_and_respects_weights() {
        let mk = |index, weight, load| Server {
            reg: Registration {
                id: ServerId(index),
                data_ip: Ipv4Addr::UNSPECIFIED,
                mac: [0; 6],
                ifindex: 0,
                src_mac: [0; 6],
                weight,
                instance: 0,
            },
            index,
            liveness: Liveness::Live,
            last_heartbeat: Instant::ZERO,
            dead_since: None,
            flows_kept_until: None,
            revive_as: Liveness::Live,
            load,
            load_pps: load as f64 * 1000.0,
            last_counter: 0,
            backend_down: Default::default(),
            health_reported: false,
            wanted: Vec::new(),
            leaving: false,
            stopped: false,
        };
        let count = |r: &[u32], i: u32| r.iter().filter(|v| **v == i).count();
        let r = lwrr_ring(&[mk(0, 1, 0), mk(1, 3, 0)]);
        assert_eq!(r.len(), RING_SIZE);
        assert_eq!((count(&r, 0), count(&r, 1)), (64, 192));
        let r = lwrr_ring(&[mk(0, 1, 1000), mk(1, 1, 0)]);
        assert!(
            count(&r, 1) > 4 * count(&r, 0),
            "{} {}",
            count(&r, 0),
            count(&r, 1)
        );
        assert!(lwrr_ring(&[]).is_empty());
    }

    #[test]
    fn set_owner_only_from_owner_or_named_owner() {
        let mut c = cp(TargetPolicy::RoundRobin);
        let k = FlowKey {
            client_ip: Ipv4Addr::new(198, 18, 0, 11),
            client_port: 7,
            service_ip: VIP,
            service_port: 80,
        };
        c.dp.place_flow(CFlowKey::from(k), 0, 0);
        c.dp.migrate_flow(CFlowKey::from(k), 1);
        c.flush_events(Instant::ZERO, &mut VecSink::default())
            .unwrap();
        // s3 neither owns the flow nor names itself: refused.
        assert!(matches!(
            c.set_owner(ServerId(3), k, ServerId(1)),
            Err(ControlError::SetOwnerRefused { .. })
        ));
        assert!(
            c.set_owner(
                ServerId(1),
                FlowKey {
                    client_port: 8,
                    ..k
                },
                ServerId(1)
            )
            .is_err(),
            "unknown flow"
        );
        // The origin (s1) takes its flow back after an aborted migration.
        c.set_owner(ServerId(1), k, ServerId(1)).unwrap();
        assert_eq!(c.dp.current_owner(CFlowKey::from(k)), Some(0));
        assert_eq!(
            c.dp.migrations
                .get(&CFlowKey::from(k))
                .map(|m| (m.server, m.is_pending())),
            Some((0, false)),
            "kept final on the original server"
        );
        // The current owner hands it to s3.
        c.set_owner(ServerId(1), k, ServerId(3)).unwrap();
        assert_eq!(c.dp.current_owner(CFlowKey::from(k)), Some(2));
        let mut sink = VecSink::default();
        c.flush_events(Instant::ZERO, &mut sink).unwrap();
        let kinds: Vec<u32> = sink.0.iter().map(|e| e.kind).collect();
        assert_eq!(kinds, vec![EV_RETURNED, EV_MIGRATED]);
        // While a migration is pending the data plane decides: refused.
        c.dp.migrations
            .insert(CFlowKey::from(k), CMigration::pending(1, 7));
        assert!(matches!(
            c.set_owner(ServerId(3), k, ServerId(3)),
            Err(ControlError::SetOwnerRefused { .. })
        ));
        assert_eq!(c.dp.current_owner(CFlowKey::from(k)), Some(1));
    }

    fn claim(port: u16, epoch: u64, owned_ms: u32) -> capybara_proto::control::FlowClaim {
        capybara_proto::control::FlowClaim {
            flow: FlowKey::from(key(port)),
            epoch,
            owned_ms,
        }
    }

    /// A migration id of the server at 198.18.2.(10 + j).
    fn mid(j: u8, counter: u32) -> u64 {
        u64::from(u32::from(Ipv4Addr::new(198, 18, 2, 10 + j))) << 32 | u64::from(counter)
    }

    fn owners_in_store(c: &mut ControlPlane<MemDataPlane>) -> Vec<(u16, u32, Option<u32>)> {
        let mut sink = Sinked::default();
        c.flush_events(Instant::ZERO, &mut sink).unwrap();
        sink.0
    }

    /// (client port, event kind, owner id) of every update.
    #[derive(Default)]
    struct Sinked(Vec<(u16, u32, Option<u32>)>);
    impl FlowEventSink for Sinked {
        fn write_batch(&mut self, events: &[FlowUpdate]) {
            self.0.extend(
                events
                    .iter()
                    .map(|u| (u.key.client_port, u.event.kind, u.owner.map(|o| o.0))),
            );
        }
    }

    #[test]
    fn claims_rebuild_lost_and_stale_mappings_and_the_store_follows() {
        let mut c = cp(TargetPolicy::RoundRobin);
        let now = Instant::from_millis(10_000);
        let mut store = Sinked::default();
        // Lost: no entry at all. The claimant gets an established flow.
        assert_eq!(
            c.claim_flow(now, ServerId(2), &claim(1, mid(1, 5), 300))
                .unwrap(),
            ClaimOutcome::Applied
        );
        let f = c.dp.flows[&key(1)];
        assert_eq!((f.server, f.service, f.flags), (1, 0, FLOW_ESTABLISHED));
        // Stale: the store (an older backup) or a Maglev placement says s1.
        c.dp.place_flow(key(2), 0, 0);
        c.flush_events(now, &mut store).unwrap();
        assert_eq!(
            c.claim_flow(now, ServerId(3), &claim(2, mid(1, 9), 300))
                .unwrap(),
            ClaimOutcome::Applied
        );
        assert_eq!(c.dp.current_owner(key(2)), Some(2));
        assert!(
            c.dp.migrations.get(&key(2)).is_none(),
            "the flow entry moved"
        );
        // A final entry (a migration passed) on s1: the claim of s2 replaces
        // it with one naming s2's epoch, which s2's next PREPARE_ACK carries.
        // (Seen long before the claim: a backup's state, not a live move.)
        c.dp.place_flow(key(3), 2, 0);
        c.dp.migrate_flow(key(3), 0);
        c.flush_events(Instant::ZERO, &mut store).unwrap();
        assert_eq!(
            c.claim_flow(now, ServerId(2), &claim(3, mid(1, 11), 300))
                .unwrap(),
            ClaimOutcome::Applied
        );
        let m = c.dp.migrations[&key(3)];
        assert_eq!(
            (m.server, m.migration_id, m.is_pending()),
            (1, mid(1, 11), false)
        );
        // Already right: agreed, nothing written.
        assert_eq!(
            c.claim_flow(now, ServerId(3), &claim(2, mid(1, 9), 300))
                .unwrap(),
            ClaimOutcome::Agreed
        );
        c.flush_events(now, &mut store).unwrap();
        assert_eq!(
            store.0,
            vec![
                (1, EV_NEW, Some(2)),
                // Placed on s1 (the stale mapping), then claimed by s3.
                (2, EV_NEW, Some(1)),
                (2, EV_MIGRATED, Some(3)),
                // Placed on s3, migrated to s1, then claimed by s2.
                (3, EV_NEW, Some(3)),
                (3, EV_MIGRATED, Some(1)),
                (3, EV_MIGRATED, Some(2)),
            ]
        );
        assert_eq!(
            c.claim_counters,
            ClaimCounters {
                applied: 3,
                agreed: 1,
                ..Default::default()
            }
        );
    }

    #[test]
    fn a_migration_in_progress_is_not_overridden_by_a_claim() {
        let mut c = cp(TargetPolicy::RoundRobin);
        let now = Instant::from_millis(10_000);
        c.dp.place_flow(key(4), 0, 0);
        c.dp.migrations
            .insert(key(4), CMigration::pending(1, mid(1, 3)));
        c.flush_events(now, &mut VecSink::default()).unwrap();
        assert_eq!(
            c.claim_flow(now, ServerId(1), &claim(4, 0, 900)).unwrap(),
            ClaimOutcome::InProgress
        );
        assert_eq!(
            c.claim_flow(now, ServerId(3), &claim(4, 0, 1)).unwrap(),
            ClaimOutcome::InProgress
        );
        assert_eq!(c.dp.migrations[&key(4)], CMigration::pending(1, mid(1, 3)));
        assert!(owners_in_store(&mut c).is_empty());
        assert_eq!(c.claim_counters.in_progress, 2);
    }

    #[test]
    fn of_two_claims_the_later_migration_wins_in_either_order() {
        let now = Instant::from_millis(100_000);
        // s1 placed the connection 50 s ago and handed it to s2 (migration
        // id of s1) 2 s ago; s1 still claims it (a stale holder).
        let s1 = claim(5, 0, 50_000);
        let s2 = claim(5, mid(1, 7), 2_000);
        for first_s1 in [true, false] {
            let mut c = cp(TargetPolicy::RoundRobin);
            let (a, b) = if first_s1 {
                ((1, s1), (2, s2))
            } else {
                ((2, s2), (1, s1))
            };
            c.claim_flow(now, ServerId(a.0), &a.1).unwrap();
            let second = c.claim_flow(now, ServerId(b.0), &b.1).unwrap();
            assert_eq!(
                c.dp.current_owner(key(5)),
                Some(1),
                "s2 holds it (s1 first: {first_s1})"
            );
            let want = if first_s1 {
                ClaimOutcome::Applied
            } else {
                ClaimOutcome::LaterClaim
            };
            assert_eq!(second, want);
        }
        // Causality beats age: s3 got it from s2 (s2's id), even if s2's
        // claim says it took the connection later.
        let mut c = cp(TargetPolicy::RoundRobin);
        c.claim_flow(now, ServerId(3), &claim(6, mid(2, 1), 4_000))
            .unwrap();
        assert_eq!(
            c.claim_flow(now, ServerId(2), &claim(6, mid(1, 1), 1_000))
                .unwrap(),
            ClaimOutcome::LaterClaim
        );
        assert_eq!(c.dp.current_owner(key(6)), Some(2));
        // Unrelated claimants (a 4-tuple reused by a new connection): the
        // more recent ownership wins; a tie keeps the first.
        let mut c = cp(TargetPolicy::RoundRobin);
        c.claim_flow(now, ServerId(1), &claim(7, 0, 30_000))
            .unwrap();
        assert_eq!(
            c.claim_flow(now, ServerId(3), &claim(7, 0, 400)).unwrap(),
            ClaimOutcome::Applied
        );
        assert_eq!(
            c.claim_flow(now, ServerId(1), &claim(7, 0, 30_000))
                .unwrap(),
            ClaimOutcome::LaterClaim
        );
        assert_eq!(
            c.claim_flow(now, ServerId(2), &claim(7, 0, 400)).unwrap(),
            ClaimOutcome::LaterClaim,
            "a tie keeps the current claimant"
        );
        assert_eq!(c.dp.current_owner(key(7)), Some(2));
        // Claims are forgotten after CLAIM_MEMORY: then the data plane's
        // mapping is all there is, and the claimant is the truth.
        let later = now + CLAIM_MEMORY;
        c.prune_claims(later, None);
        assert_eq!(c.claims_remembered(), 0);
        assert_eq!(
            c.claim_flow(later, ServerId(1), &claim(7, 0, 30_000))
                .unwrap(),
            ClaimOutcome::Applied
        );
    }

    #[test]
    fn a_claim_built_before_a_live_migration_does_not_undo_it() {
        let mut c = cp(TargetPolicy::RoundRobin);
        let now = Instant::from_millis(10_000);
        let mut store = Sinked::default();
        // s1 holds the connection and reports it; the report is in flight
        // (or sent again) while the data plane migrates it to s2.
        c.dp.place_flow(key(7), 0, 0);
        c.dp.migrate_flow(key(7), 1);
        c.flush_events(now, &mut store).unwrap();
        let stale = claim(7, 0, 5_000);
        assert_eq!(
            c.claim_flow(now + Duration::from_millis(200), ServerId(1), &stale)
                .unwrap(),
            ClaimOutcome::MovedSince
        );
        assert_eq!(c.dp.current_owner(key(7)), Some(1), "still s2");
        assert_eq!(c.claim_counters.moved_since, 1);
        // The new owner's claim agrees.
        assert_eq!(
            c.claim_flow(now, ServerId(2), &claim(7, mid(1, 1), 0))
                .unwrap(),
            ClaimOutcome::Agreed
        );
        // Past the memory (a report much later, e.g. the origin holds a
        // connection again that a switch restart left wrong), claims apply.
        let later = now + LIVE_MOVE_MEMORY + Duration::from_secs(1);
        for j in 1..=3 {
            c.heartbeat(later, ServerId(j)).unwrap();
        }
        c.tick(later).unwrap();
        assert_eq!(
            c.claim_flow(later, ServerId(1), &claim(7, mid(2, 4), 100))
                .unwrap(),
            ClaimOutcome::Applied
        );
        assert_eq!(c.dp.current_owner(key(7)), Some(0));
    }

    /// The data plane finished the migration a moment ago and its event is
    /// still in the ring (the daemon flushes every 2 ms): the claim built
    /// before it must not undo it either.
    #[test]
    fn a_claim_judged_before_the_next_event_flush_does_not_undo_a_migration() {
        let mut c = cp(TargetPolicy::RoundRobin);
        let now = Instant::from_millis(10_000);
        c.dp.place_flow(key(9), 0, 0);
        c.dp.migrate_flow(key(9), 1);
        assert_eq!(
            c.claim_flow(now, ServerId(1), &claim(9, 0, 5_000)).unwrap(),
            ClaimOutcome::MovedSince
        );
        assert_eq!(c.dp.current_owner(key(9)), Some(1), "still s2");
        // The events still reach the store at the flush.
        let mut store = Sinked::default();
        assert!(c.flush_events(now, &mut store).unwrap() >= 1);
    }

    #[test]
    fn claims_of_unknown_services_or_unregistered_servers_are_refused() {
        let mut c = cp(TargetPolicy::RoundRobin);
        let now = Instant::from_millis(1_000);
        let mut other = claim(8, 0, 1);
        other.flow.service_port = 81;
        assert_eq!(
            c.claim_flow(now, ServerId(1), &other).unwrap(),
            ClaimOutcome::UnknownService
        );
        assert!(matches!(
            c.claim_flow(now, ServerId(9), &claim(8, 0, 1)),
            Err(ControlError::UnknownServer(ServerId(9)))
        ));
        assert!(c.dp.flows.get(&key(8)).is_none());
        assert_eq!(c.claim_counters.unknown_service, 1);
    }

    fn spec(name: &str, addr: SocketAddrV4, members: &[u32], open: bool) -> ServiceSpec {
        ServiceSpec {
            name: name.into(),
            addr,
            placement: Placement::Maglev,
            follows_global: true,
            pool: PoolSpec {
                members: members.iter().map(|j| (ServerId(*j), 0)).collect(),
                open,
            },
        }
    }

    #[test]
    fn services_follow_the_store_at_run_time() {
        let mut c = cp(TargetPolicy::RoundRobin);
        // Deleted services end at once (retiring: the next test).
        c.cfg.service_retire_timeout = Duration::ZERO;
        let web = SocketAddrV4::new(VIP, 80);
        let api = SocketAddrV4::new(Ipv4Addr::new(198, 18, 100, 3), 8080);
        let api_key = |port: u16| {
            CFlowKey::from(FlowKey {
                client_ip: Ipv4Addr::new(198, 18, 0, 11),
                client_port: port,
                service_ip: *api.ip(),
                service_port: api.port(),
            })
        };
        // Added: a slot, a Maglev table and rings of its one member.
        let ch = c
            .apply_services(
                Instant::ZERO,
                &[spec("web", web, &[], true), spec("api", api, &[2], false)],
                true,
            )
            .unwrap();
        assert_eq!(ch.added, ["api"]);
        assert_eq!(ch.updated, ["web"], "the name came with the store");
        let akey = CServiceKey::tcp(*api.ip(), api.port());
        assert_eq!(c.dp.services[&akey].index, 1);
        assert!(c.dp.maglev[&1].iter().all(|v| *v == 1));
        assert_eq!(c.dp.rings[&(1, RING_TARGET)].as_slice(), &[1]);
        // The same list again changes nothing.
        let same = [spec("web", web, &[], true), spec("api", api, &[2], false)];
        assert!(c
            .apply_services(Instant::ZERO, &same, true)
            .unwrap()
            .is_empty());
        // Pool edited: the table follows.
        let ch = c
            .apply_services(
                Instant::ZERO,
                &[
                    spec("web", web, &[], true),
                    spec("api", api, &[2, 3], false),
                ],
                true,
            )
            .unwrap();
        assert_eq!(ch.updated, ["api"]);
        let mut members: Vec<u32> = c.dp.maglev[&1].clone();
        members.sort();
        members.dedup();
        assert_eq!(members, [1, 2]);
        // Removed: the key goes, its flows and migrations with it (reported
        // closed), web's stay.
        c.dp.place_flow(api_key(1), 1, 1);
        c.dp.place_flow(api_key(2), 2, 1);
        c.dp.place_flow(key(3), 0, 0);
        let ch = c
            .apply_services(Instant::ZERO, &[spec("web", web, &[], true)], true)
            .unwrap();
        assert_eq!(ch.removed, [("api".to_string(), 2)]);
        assert!(!c.dp.services.contains_key(&akey));
        assert_eq!(c.dp.current_owner(api_key(1)), None);
        assert_eq!(c.dp.current_owner(key(3)), Some(0));
        assert!(c.dp.rings[&(1, RING_TARGET)].as_slice().is_empty());
        let mut sink = VecSink::default();
        c.flush_events(Instant::ZERO, &mut sink).unwrap();
        let mut closed: Vec<(u16, u32)> = sink
            .0
            .iter()
            .filter(|e| e.kind == EV_CLOSED)
            .map(|e| (FlowKey::from(e.key).client_port, e.server))
            .collect();
        closed.sort();
        assert_eq!(closed, [(1, 1), (2, 2)]);
        // A new service takes the free slot, with a whole table.
        let cache = SocketAddrV4::new(Ipv4Addr::new(198, 18, 100, 4), 6379);
        let ch = c
            .apply_services(
                Instant::ZERO,
                &[
                    spec("web", web, &[], true),
                    spec("cache", cache, &[1], false),
                ],
                true,
            )
            .unwrap();
        assert_eq!(ch.added, ["cache"]);
        assert!(c.dp.maglev[&1].iter().all(|v| *v == 0));
        // A standby removes without reporting.
        c.dp.place_flow(key(4), 0, 0);
        let ch = c
            .apply_services(Instant::ZERO, &[spec("cache", cache, &[1], false)], false)
            .unwrap();
        assert_eq!(ch.removed, [("web".to_string(), 2)]);
        let mut sink = VecSink::default();
        c.flush_events(Instant::ZERO, &mut sink).unwrap();
        assert!(sink.0.iter().all(|e| e.kind != EV_CLOSED), "{:?}", sink.0);
    }

    #[test]
    fn a_deleted_service_keeps_its_connections_until_they_end() {
        let mut c = cp(TargetPolicy::RoundRobin);
        let web = SocketAddrV4::new(VIP, 80);
        let api = SocketAddrV4::new(Ipv4Addr::new(198, 18, 100, 3), 8080);
        let akey = CServiceKey::tcp(*api.ip(), api.port());
        let api_key = |port: u16| {
            CFlowKey::from(FlowKey {
                client_ip: Ipv4Addr::new(198, 18, 0, 11),
                client_port: port,
                service_ip: *api.ip(),
                service_port: api.port(),
            })
        };
        let both = [
            spec("web", web, &[], true),
            spec("api", api, &[2, 3], false),
        ];
        let only_web = [spec("web", web, &[], true)];
        c.apply_services(Instant::ZERO, &both, true).unwrap();
        c.dp.place_flow(api_key(1), 1, 1);
        c.dp.place_flow(api_key(2), 2, 1);
        c.dp.place_flow(key(3), 0, 0);
        // Deleted: nothing new is placed, the connections stay, migrations
        // still find targets.
        let t0 = Instant::ZERO + Duration::from_secs(10);
        let ch = c.apply_services(t0, &only_web, true).unwrap();
        assert_eq!(ch.retiring, ["api"]);
        assert!(ch.removed.is_empty());
        assert_eq!(c.dp.services[&akey].placement, PLACE_NONE);
        assert_eq!(c.dp.current_owner(api_key(1)), Some(1));
        assert_eq!(c.dp.rings[&(1, RING_TARGET)].as_slice().len(), 2);
        assert_eq!(c.retiring().count(), 1);
        // Listed again: nothing more to do; the store's placement does not
        // make it place again.
        assert!(c.apply_services(t0, &only_web, true).unwrap().is_empty());
        c.set_placement(1, Placement::Lwrr).unwrap();
        assert_eq!(c.dp.services[&akey].placement, PLACE_NONE);
        // Connections open: it stays, however many passes.
        assert_eq!(c.retiring_flows(api), None, "before a pass");
        for _ in 0..4 {
            assert!(c.end_retired(t0, true).unwrap().is_empty());
        }
        assert_eq!(c.retiring_flows(api), Some(2));
        // Restored (the operator created it again): placing, flows kept.
        let ch = c.apply_services(t0, &both, true).unwrap();
        assert_eq!(ch.updated, ["api"]);
        assert_eq!(c.services()[1].placement, Placement::Maglev);
        assert_eq!(
            c.dp.services[&akey].placement,
            place_code(Placement::Maglev)
        );
        assert_eq!(c.retiring().count(), 0);
        // Deleted again; its last connections end: it goes after two
        // empty passes, nothing reported closed (they closed themselves).
        c.apply_services(t0, &only_web, true).unwrap();
        c.dp.flows.remove(&api_key(1));
        c.dp.flows.remove(&api_key(2));
        let t1 = t0 + Duration::from_secs(1);
        assert!(c.end_retired(t1, true).unwrap().is_empty());
        let ended = c.end_retired(t1, true).unwrap();
        assert_eq!(
            ended,
            [RetiredService {
                name: "api".into(),
                addr: api,
                flows: 0,
                timed_out: false
            }]
        );
        assert!(!c.dp.services.contains_key(&akey));
        assert_eq!(c.dp.current_owner(key(3)), Some(0), "web's flows stay");
        assert!(c.dp.rings[&(1, RING_TARGET)].as_slice().is_empty());
        // The timeout ends what is left, reported closed.
        c.apply_services(t1, &both, true).unwrap();
        c.dp.place_flow(api_key(5), 1, 1);
        c.apply_services(t1, &only_web, true).unwrap();
        let mut sink = VecSink::default();
        c.flush_events(t1, &mut sink).unwrap();
        let late = t1 + (DEFAULT_SERVICE_RETIRE_TIMEOUT - Duration::from_millis(1));
        assert!(c.end_retired(late, true).unwrap().is_empty());
        let ended = c
            .end_retired(t1 + DEFAULT_SERVICE_RETIRE_TIMEOUT, true)
            .unwrap();
        assert_eq!(ended.len(), 1);
        assert!(ended[0].timed_out);
        assert_eq!(ended[0].flows, 1);
        assert_eq!(c.dp.current_owner(api_key(5)), None);
        let mut sink = VecSink::default();
        c.flush_events(t1, &mut sink).unwrap();
        assert_eq!(
            sink.0.iter().filter(|e| e.kind == EV_CLOSED).count(),
            1,
            "{:?}",
            sink.0
        );
        // Nothing retires: the scan stays idle.
        assert!(c.end_retired(late, true).unwrap().is_empty());
    }

    /// A restart or takeover: a service deleted before it (its retiring
    /// record in the store) is served again as retiring, before its flows
    /// load, with its retire clock counted from the delete.
    #[test]
    fn a_retiring_service_from_the_store_keeps_its_connections_and_clock() {
        let mut c = cp(TargetPolicy::RoundRobin);
        let web = SocketAddrV4::new(VIP, 80);
        let api = SocketAddrV4::new(Ipv4Addr::new(198, 18, 100, 3), 8080);
        let akey = CServiceKey::tcp(*api.ip(), api.port());
        let api_flow = |port: u16| FlowKey {
            client_ip: Ipv4Addr::new(198, 18, 0, 11),
            client_port: port,
            service_ip: *api.ip(),
            service_port: api.port(),
        };
        let only_web = [spec("web", web, &[], true)];
        let t0 = Instant::ZERO + Duration::from_secs(1);
        c.apply_services(t0, &only_web, true).unwrap();
        // Deleted 200 s ago, seen by another switchd (or this one before it
        // restarted).
        let record = RetiringSpec {
            spec: spec("api", api, &[2, 3], false),
            retired_for: Duration::from_secs(200),
        };
        // Without it the flows of the deleted service are skipped (their
        // connections would be reset).
        let flows = [(api_flow(1), ServerId(2)), (api_flow(2), ServerId(3))];
        assert_eq!(c.load_flows(&flows).unwrap(), (0, 2));
        let r = c
            .restore_retiring(t0, std::slice::from_ref(&record))
            .unwrap();
        assert_eq!(r.restored, ["api"]);
        assert!(r.skipped.is_empty());
        assert_eq!(c.dp.services[&akey].placement, PLACE_NONE, "places nothing");
        assert_eq!(c.dp.services[&akey].index, 1);
        assert_eq!(
            c.dp.rings[&(1, RING_TARGET)].as_slice().len(),
            2,
            "migrates"
        );
        assert_eq!(c.load_flows(&flows).unwrap(), (2, 0));
        assert_eq!(c.dp.current_owner(CFlowKey::from(api_flow(1))), Some(1));
        let svc = c.retiring().next().unwrap();
        assert_eq!(svc.retiring_for(t0), Some(Duration::from_secs(200)));
        // Known now: the same record again changes nothing; an older record
        // of it (this switchd retired it later than the delete) moves its
        // clock back to the delete.
        let older = RetiringSpec {
            retired_for: Duration::from_secs(250),
            ..record.clone()
        };
        let t1 = t0 + Duration::from_secs(10);
        let r = c.restore_retiring(t1, &[older]).unwrap();
        assert_eq!(r, RetiringRestores::default());
        assert_eq!(
            c.retiring().next().unwrap().retiring_for(t1),
            Some(Duration::from_secs(250))
        );
        // The timeout counts from the delete: it ends 300 s after it, its
        // connections reported closed.
        for _ in 0..3 {
            assert!(c.end_retired(t1, true).unwrap().is_empty());
        }
        assert_eq!(c.retiring_flows(api), Some(2));
        let end = t1 + Duration::from_secs(50);
        assert!(c
            .end_retired(t1 + Duration::from_millis(49_999), true)
            .unwrap()
            .is_empty());
        let ended = c.end_retired(end, true).unwrap();
        assert_eq!(
            ended,
            [RetiredService {
                name: "api".into(),
                addr: api,
                flows: 2,
                timed_out: true
            }]
        );
        assert!(!c.dp.services.contains_key(&akey));

        // A record whose VIP:port is served again (created again) is not
        // restored; nor one with no free slot (live services come first).
        let mut c = cp(TargetPolicy::RoundRobin);
        c.apply_services(t0, &[spec("api2", api, &[], true)], true)
            .unwrap();
        let r = c
            .restore_retiring(t0, std::slice::from_ref(&record))
            .unwrap();
        assert!(r.restored.is_empty());
        assert_eq!(r.skipped.len(), 1);
        assert!(
            r.skipped[0].1.contains("served by service \"api2\""),
            "{r:?}"
        );
        let full: Vec<ServiceSpec> = (0..MAX_SERVICES)
            .map(|i| {
                spec(
                    &format!("s{i}"),
                    SocketAddrV4::new(Ipv4Addr::new(198, 18, 101, i as u8), 80),
                    &[],
                    true,
                )
            })
            .collect();
        c.apply_services(t0, &full, true).unwrap();
        let r = c
            .restore_retiring(t0, std::slice::from_ref(&record))
            .unwrap();
        assert!(r.skipped[0].1.contains("no free service slot"), "{r:?}");
        // Retiring off: nothing retires.
        let mut c = cp(TargetPolicy::RoundRobin);
        c.cfg.service_retire_timeout = Duration::ZERO;
        let r = c.restore_retiring(t0, &[record]).unwrap();
        assert!(r.restored.is_empty() && r.skipped.len() == 1, "{r:?}");
    }

    /// A restored retiring service is revived by a service created again
    /// at its VIP:port (connections and all), and is the oldest when a new
    /// service needs its slot.
    #[test]
    fn a_restored_retiring_service_is_revived_or_gives_up_its_slot_by_age() {
        let mut c = cp(TargetPolicy::RoundRobin);
        let web = SocketAddrV4::new(VIP, 80);
        let api = SocketAddrV4::new(Ipv4Addr::new(198, 18, 100, 3), 8080);
        let akey = CServiceKey::tcp(*api.ip(), api.port());
        let t0 = Instant::ZERO + Duration::from_secs(1);
        c.apply_services(t0, &[spec("web", web, &[], true)], true)
            .unwrap();
        let record = RetiringSpec {
            spec: spec("api", api, &[], true),
            retired_for: Duration::from_secs(100),
        };
        c.restore_retiring(t0, std::slice::from_ref(&record))
            .unwrap();
        c.dp.place_flow(
            CFlowKey::from(FlowKey {
                client_ip: Ipv4Addr::new(198, 18, 0, 11),
                client_port: 1,
                service_ip: *api.ip(),
                service_port: api.port(),
            }),
            1,
            1,
        );
        let ch = c
            .apply_services(
                t0,
                &[spec("web", web, &[], true), spec("api", api, &[], true)],
                true,
            )
            .unwrap();
        assert_eq!(ch.updated, ["api"]);
        assert_eq!(c.retiring().count(), 0);
        assert_eq!(
            c.dp.services[&akey].placement,
            place_code(Placement::Maglev)
        );
        assert_eq!(c.services()[1].retiring_for(t0), None);
        // Deleted here later than the restored one was: the restored one
        // is older and gives up its slot first.
        let mut c = cp(TargetPolicy::RoundRobin);
        let live: Vec<ServiceSpec> = (1..MAX_SERVICES - 1)
            .map(|i| {
                spec(
                    &format!("s{i}"),
                    SocketAddrV4::new(Ipv4Addr::new(198, 18, 101, i as u8), 80),
                    &[],
                    true,
                )
            })
            .collect();
        let mut with_web = live.clone();
        with_web.push(spec("web", web, &[], true));
        c.apply_services(t0, &with_web, true).unwrap();
        c.restore_retiring(t0, &[record]).unwrap();
        let t1 = t0 + Duration::from_secs(5);
        c.apply_services(t1, &live, true).unwrap();
        assert_eq!(c.retiring().count(), 2);
        let mut more = live.clone();
        more.push(spec(
            "new",
            SocketAddrV4::new(Ipv4Addr::new(198, 18, 102, 1), 80),
            &[],
            true,
        ));
        let ch = c.apply_services(t1, &more, true).unwrap();
        assert_eq!(ch.added, ["new"]);
        assert_eq!(ch.removed, [("api".to_string(), 0)]);
        let retiring: Vec<&str> = c.retiring().map(|s| s.name.as_str()).collect();
        assert_eq!(retiring, ["web"]);
    }

    #[test]
    fn a_configured_service_the_store_does_not_list_goes_at_once() {
        let mut c = cp(TargetPolicy::RoundRobin);
        let web = SocketAddrV4::new(VIP, 80);
        let api = SocketAddrV4::new(Ipv4Addr::new(198, 18, 100, 3), 8080);
        let both = [spec("web", web, &[], true), spec("api", api, &[], true)];
        c.apply_services(Instant::ZERO, &both, false).unwrap();
        c.mark_provisional();
        // The store lists web only (api was deleted through the API).
        let ch = c.apply_services(Instant::ZERO, &both[..1], true).unwrap();
        assert_eq!(ch.removed, [("api".to_string(), 0)]);
        assert!(ch.retiring.is_empty());
        // web was confirmed: deleted later, it retires.
        let ch = c.apply_services(Instant::ZERO, &[], true).unwrap();
        assert_eq!(ch.retiring, ["web"]);
    }

    #[test]
    fn a_new_service_takes_the_slot_of_the_oldest_retiring_one() {
        let mut c = cp(TargetPolicy::RoundRobin);
        let addr = |i: u8| SocketAddrV4::new(Ipv4Addr::new(198, 18, 100, i), 80);
        let mut specs: Vec<ServiceSpec> = (0..MAX_SERVICES as u8)
            .map(|i| spec(&format!("s{i}"), addr(10 + i), &[], true))
            .collect();
        c.apply_services(Instant::ZERO, &specs, true).unwrap();
        // s3 then s5 deleted, with a connection each.
        for (i, at) in [(3u8, 1u64), (5, 2)] {
            c.dp.place_flow(
                CFlowKey::from(FlowKey {
                    client_ip: Ipv4Addr::new(198, 18, 0, 11),
                    client_port: 1000,
                    service_ip: *addr(10 + i).ip(),
                    service_port: 80,
                }),
                0,
                i as u16,
            );
            specs.retain(|s| s.name != format!("s{i}"));
            let ch = c
                .apply_services(Instant::ZERO + Duration::from_secs(at), &specs, true)
                .unwrap();
            assert_eq!(ch.retiring, [format!("s{i}")]);
        }
        // A new service: s3, the oldest, gives its slot (its connection
        // ends, reported closed); s5 keeps retiring.
        specs.push(spec("new", addr(99), &[], true));
        let ch = c
            .apply_services(Instant::ZERO + Duration::from_secs(3), &specs, true)
            .unwrap();
        assert_eq!(ch.added, ["new"]);
        assert_eq!(ch.removed, [("s3".to_string(), 1)]);
        assert!(ch.rejected.is_empty(), "{:?}", ch.rejected);
        let retiring: Vec<&str> = c.retiring().map(|s| s.name.as_str()).collect();
        assert_eq!(retiring, ["s5"]);
        // One more takes s5's; then there is no slot left.
        specs.push(spec("new2", addr(98), &[], true));
        specs.push(spec("new3", addr(97), &[], true));
        let ch = c
            .apply_services(Instant::ZERO + Duration::from_secs(4), &specs, true)
            .unwrap();
        assert_eq!(ch.added, ["new2"]);
        assert_eq!(ch.removed, [("s5".to_string(), 1)]);
        assert_eq!(ch.rejected.len(), 1);
        assert_eq!(ch.rejected[0].0, "new3");
    }

    #[test]
    fn services_listed_twice_or_beyond_the_slots_are_rejected() {
        let mut c = cp(TargetPolicy::RoundRobin);
        let addr = |i: u8| SocketAddrV4::new(Ipv4Addr::new(198, 18, 100, i), 80);
        let mut specs = vec![
            spec("a", addr(1), &[], true),
            spec("b", addr(1), &[], true),
            spec("a", addr(2), &[], true),
        ];
        for i in 0..MAX_SERVICES as u8 {
            specs.push(spec(&format!("s{i}"), addr(10 + i), &[], true));
        }
        let ch = c.apply_services(Instant::ZERO, &specs, true).unwrap();
        let rejected: Vec<&str> = ch.rejected.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(rejected, ["b", "a", "s15"], "{:?}", ch.rejected);
        assert!(ch.rejected[0]
            .1
            .contains("already the address of service \"a\""));
        assert!(ch.rejected[2].1.contains("no free service slot"));
        assert_eq!(c.services().len(), MAX_SERVICES as usize);
        // What `/status` `refused_services` says: each refused spec at its
        // own address with its reason; the served "a" is not refused,
        // though its name is rejected at another address.
        let refused = crate::services::refused(&specs, c.services(), |name| ch.why_rejected(name));
        let got: Vec<(&str, SocketAddrV4, &str)> = refused
            .iter()
            .map(|r| (r.name.as_str(), r.addr, r.reason.as_str()))
            .collect();
        assert_eq!(
            got,
            [
                (
                    "b",
                    addr(1),
                    "198.18.100.1:80 is already the address of service \"a\""
                ),
                (
                    "a",
                    addr(2),
                    "a service named \"a\" is already at 198.18.100.1:80"
                ),
                (
                    "s15",
                    addr(25),
                    "no free service slot (at most 16 services)"
                ),
            ]
        );
    }

    #[test]
    fn a_service_added_later_takes_the_servers_that_registered_for_it() {
        let mut c = cp(TargetPolicy::RoundRobin);
        let api = SocketAddrV4::new(Ipv4Addr::new(198, 18, 100, 3), 8080);
        c.register_for(
            Instant::ZERO,
            ServerId(4),
            Ipv4Addr::new(198, 18, 2, 14),
            [2, 0, 0, 0, 1, 4],
            5,
            [2; 6],
            1,
            &[api],
        )
        .unwrap();
        // Pool [1]: server 1 by the pool, server 4 by its REGISTER.
        c.apply_services(
            Instant::ZERO,
            &[
                spec("web", SocketAddrV4::new(VIP, 80), &[], true),
                spec("api", api, &[1], false),
            ],
            true,
        )
        .unwrap();
        let pool: Vec<u32> = c.services()[1].pool.keys().map(|k| k.0).collect();
        assert_eq!(pool, [1, 4]);
        // A store record (no list) of the same process keeps the list.
        let r = c.server(ServerId(4)).unwrap().reg;
        c.register_as(Instant::ZERO, &r, &[]).unwrap();
        assert_eq!(c.server(ServerId(4)).unwrap().wanted, [api]);
    }

    #[test]
    fn an_open_pool_leaves_out_servers_that_list_only_other_services() {
        let mut c = ControlPlane::new(
            MemDataPlane::new(),
            ControlConfig::new(Duration::from_millis(300), TargetPolicy::RoundRobin),
        );
        let web = SocketAddrV4::new(VIP, 80);
        let cache = SocketAddrV4::new(VIP, 6379);
        c.apply_services(
            Instant::ZERO,
            &[spec("web", web, &[], true), spec("cache", cache, &[], true)],
            true,
        )
        .unwrap();
        let any_cache = SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 6379);
        for (j, wanted) in [(1u32, vec![]), (2, vec![web]), (3, vec![any_cache])] {
            c.register_as(Instant::ZERO, &reg(j, 0), &wanted).unwrap();
        }
        let pool = |c: &ControlPlane<MemDataPlane>, i: usize| -> Vec<u32> {
            c.services()[i].pool.keys().map(|k| k.0).collect()
        };
        // s1 lists nothing (it may serve anything): in both; s2 serves web
        // only; s3 every VIP on the cache's port.
        assert_eq!(pool(&c, 0), [1, 2]);
        assert_eq!(pool(&c, 1), [1, 3]);
        // A configured member stays whatever it lists.
        c.apply_services(
            Instant::ZERO,
            &[
                spec("web", web, &[3], false),
                spec("cache", cache, &[], true),
            ],
            true,
        )
        .unwrap();
        assert_eq!(pool(&c, 0), [2, 3]);
        // ... but its stack leaves web's connections unanswered: it is in
        // no placement table and no target ring of web.
        let index = |j: u32| c.server(ServerId(j)).unwrap().index;
        let web_index = c.services()[0].index;
        let table = &c.dp.maglev[&web_index];
        assert!(table.contains(&index(2)) && !table.contains(&index(3)));
        assert!(!c.services()[0].refusing);
        // Nobody left who serves web: refused at once (a lasting reason),
        // not a hang on a server that never answers.
        c.allow_refusals_from(Instant::ZERO);
        c.tick(Instant::ZERO).unwrap();
        c.apply_services(
            Instant::ZERO,
            &[
                spec("web", web, &[3], false),
                spec("cache", cache, &[], true),
            ],
            true,
        )
        .unwrap();
        c.set_operator_weights(BTreeMap::from([(ServerId(2), 0)]))
            .unwrap();
        assert!(c.services()[0].refusing);
        assert!(c.dp.maglev[&web_index].iter().all(|v| *v == NO_SERVER));
    }

    #[test]
    fn per_service_pools_follow_config_and_register() {
        let mut c = ControlPlane::new(
            MemDataPlane::new(),
            ControlConfig::new(Duration::from_millis(300), TargetPolicy::RoundRobin),
        );
        let vip2 = Ipv4Addr::new(198, 18, 100, 2);
        c.add_service_with_pool(
            VIP,
            80,
            Placement::Maglev,
            PoolSpec {
                members: vec![(ServerId(1), 3)],
                open: false,
            },
        )
        .unwrap();
        c.add_service_with_pool(vip2, 80, Placement::Maglev, PoolSpec::default())
            .unwrap();
        let reg = |c: &mut ControlPlane<MemDataPlane>, j: u32, wanted: &[SocketAddrV4]| {
            c.register_for(
                Instant::ZERO,
                ServerId(j),
                Ipv4Addr::new(198, 18, 2, 10 + j as u8),
                [2, 0, 0, 0, 1, j as u8],
                5,
                [2; 6],
                1,
                wanted,
            )
            .unwrap()
        };
        reg(&mut c, 1, &[]);
        reg(&mut c, 2, &[SocketAddrV4::new(vip2, 80)]);
        reg(&mut c, 3, &[]);
        assert_eq!(
            c.services()[0]
                .pool
                .iter()
                .map(|(k, v)| (k.0, *v))
                .collect::<Vec<_>>(),
            vec![(1, 3)]
        );
        assert_eq!(
            c.services()[1].pool.keys().map(|k| k.0).collect::<Vec<_>>(),
            vec![2]
        );
        assert!(c.dp.maglev[&0].iter().all(|v| *v == 0));
        assert!(c.dp.maglev[&1].iter().all(|v| *v == 1));
        // A second server can't claim a live server's data address.
        let e = c.register(
            Instant::ZERO,
            ServerId(9),
            Ipv4Addr::new(198, 18, 2, 11),
            [0; 6],
            5,
            [2; 6],
            1,
        );
        assert!(matches!(e, Err(ControlError::AddressInUse { .. })));
    }

    #[test]
    fn migration_ring_is_bounded_and_pages_by_seq() {
        use capybara_proto::control::{
            MigrationReport, MigrationTrigger, ReportOutcome, PHASE_NOT_REACHED,
        };
        let report = |port: u16| MigrationReport {
            id: 7,
            flow: FlowKey {
                client_ip: Ipv4Addr::new(198, 18, 0, 11),
                client_port: port,
                service_ip: VIP,
                service_port: 80,
            },
            peer: Some(Ipv4Addr::new(198, 18, 2, 12)),
            outcome: ReportOutcome::MigratedOut,
            trigger: MigrationTrigger::Churn,
            reason: capybara_proto::tcpmig::Reason::None,
            fragments: 1,
            age_us: 0,
            phases_us: [10, 2, 30, PHASE_NOT_REACHED, 50],
            snapshot_bytes: 900,
            segments_buffered: 0,
            bytes_buffered: 0,
        };
        let mut ring = MigrationRing::new(3);
        for port in 1..=5 {
            ring.push(
                ServerId(1),
                Some(ServerId(2)),
                report(port),
                1000 + u64::from(port),
            );
        }
        assert_eq!((ring.len(), ring.overwritten, ring.received), (3, 2, 5));
        let seqs = |after, limit| ring.after(after, limit).map(|m| m.seq).collect::<Vec<_>>();
        assert_eq!(seqs(0, 10), vec![3, 4, 5], "oldest kept first");
        assert_eq!(seqs(3, 10), vec![4, 5]);
        assert_eq!(seqs(4, 1), vec![5]);
        assert!(seqs(5, 10).is_empty() && seqs(u64::MAX, 10).is_empty());
        let page = ring.page_json(9, 3, 1);
        assert_eq!(page["next"], 6);
        assert_eq!(page["oldest"], 3);
        let item = &page["items"][0];
        assert_eq!(item["seq"], 4);
        assert_eq!(item["client"], "198.18.0.11:4");
        assert_eq!(
            (item["role"].as_str(), item["trigger"].as_str()),
            (Some("origin"), Some("churn"))
        );
        assert_eq!(item["phases"]["prepare_us"], 10);
        assert!(item["phases"]["import_us"].is_null());
        assert_eq!(
            (item["peer"].as_u64(), item["reporter"].as_u64()),
            (Some(2), Some(1))
        );
        assert!(item["reason"].is_null());
        // A MIGRATE the server could not start: an origin report whose
        // reason says why.
        let mut r = MigrationReport::not_started(
            Ipv4Addr::new(198, 18, 2, 11),
            report(6).flow,
            None,
            MigrationTrigger::Manual,
            capybara_proto::control::StartFailure::NoConnection,
        );
        r.age_us = 0;
        let seq = ring.push(ServerId(1), None, r, 2000);
        let page = ring.page_json(9, seq - 1, 1);
        let item = &page["items"][0];
        assert_eq!(
            (item["role"].as_str(), item["outcome"].as_str()),
            (Some("origin"), Some("not_started"))
        );
        assert_eq!(item["reason"], "no such connection is served there");
        assert_eq!(item["trigger"], "manual");
        assert!(item["phases"]["total_us"].is_null());
    }

    #[test]
    fn round_robin_target_ring_is_live_only() {
        let mut c = cp(TargetPolicy::RoundRobin);
        for t in 1..=4u64 {
            c.heartbeat(Instant::from_millis(t * 100), ServerId(2))
                .unwrap();
            c.tick(Instant::from_millis(t * 100)).unwrap();
        }
        assert_eq!(c.dp.rings[&(0, RING_TARGET)].as_slice(), &[1]);
        assert!(c.heartbeat(Instant::ZERO, ServerId(9)).is_err());
    }

    /// A live server of index `index` and (pool) weight `weight`.
    fn weighted(index: u32, weight: u32) -> Server {
        Server {
            reg: Registration {
                weight,
                ..reg(index, 0)
            },
            index,
            liveness: Liveness::Live,
            last_heartbeat: Instant::ZERO,
            dead_since: None,
            flows_kept_until: None,
            revive_as: Liveness::Live,
            load: 0,
            load_pps: 0.0,
            last_counter: 0,
            backend_down: Default::default(),
            health_reported: false,
            wanted: Vec::new(),
            leaving: false,
            stopped: false,
        }
    }

    /// What the data plane picks from target ring `r` for a PREPARE of
    /// `origin` at each cursor position of one full turn (switch.bpf.c
    /// `ring_pick`, two tries); `None`: dropped (no target).
    fn targets_over_a_turn(r: &CRing, origin: u32) -> Vec<Option<u32>> {
        let s = r.as_slice();
        match r.mode {
            RING_PAIRED => s
                .chunks(2)
                .map(|p| {
                    let t = if p[0] != origin { p[0] } else { p[1] };
                    (t != origin).then_some(t)
                })
                .collect(),
            _ => (0..s.len())
                .map(|c| {
                    let t = if s[c] != origin {
                        s[c]
                    } else {
                        s[(c + 1) % s.len()]
                    };
                    (t != origin).then_some(t)
                })
                .collect(),
        }
    }

    fn count_of<T: PartialEq>(v: &[T], x: T) -> usize {
        v.iter().filter(|y| **y == x).count()
    }

    #[test]
    fn round_robin_targets_follow_weights_over_a_full_ring() {
        // Indexes 3, 0, 7 at weights 1, 5, 1 (given out of order).
        let live = [weighted(3, 1), weighted(0, 5), weighted(7, 1)];
        let r = target_ring(&live, TargetPolicy::RoundRobin);
        assert_eq!(r.mode, RING_PAIRED);
        let s = r.as_slice();
        assert!(s.len() <= RING_SIZE && s.len() % 2 == 0, "{}", s.len());
        // 128 / 7 = 18 turns of the 7-entry cycle.
        assert_eq!(s.len(), 2 * 18 * 7);
        let targets: Vec<u32> = s.chunks(2).map(|p| p[0]).collect();
        assert_eq!(
            (
                count_of(&targets, 0),
                count_of(&targets, 3),
                count_of(&targets, 7)
            ),
            (5 * 18, 18, 18)
        );
        // An alternate is never its pair's target.
        assert!(s.chunks(2).all(|p| p[0] != p[1]), "{s:?}");
        // Interleaved (smooth weighted round robin), not five in a row.
        assert_eq!(&targets[..7], &[0, 0, 3, 0, 7, 0, 0]);
        assert_eq!(&targets[7..14], &targets[..7]);
        // Whatever the origin, every PREPARE finds a target, and the
        // others get them by weight: origin 0 splits 1:1 between 3 and 7;
        // origin 3 sends 5:1 to 0 and 7.
        let from0 = targets_over_a_turn(&r, 0);
        assert_eq!(
            (count_of(&from0, Some(3)), count_of(&from0, Some(7))),
            (63, 63)
        );
        let from3 = targets_over_a_turn(&r, 3);
        assert_eq!(
            (count_of(&from3, Some(0)), count_of(&from3, Some(7))),
            (105, 21)
        );
        assert_eq!(count_of(&from3, None), 0);
        // Two servers 1:3: the heavier one gets three quarters.
        let r = target_ring(&[weighted(1, 1), weighted(2, 3)], TargetPolicy::RoundRobin);
        let t: Vec<u32> = r.as_slice().chunks(2).map(|p| p[0]).collect();
        assert_eq!(3 * count_of(&t, 1), count_of(&t, 2));
        assert_eq!(&t[..4], &[2, 1, 2, 2]);
        assert_eq!(targets_over_a_turn(&r, 2), vec![Some(1); t.len()]);
        assert_eq!(targets_over_a_turn(&r, 1), vec![Some(2); t.len()]);
    }

    #[test]
    fn round_robin_targets_with_equal_weights_stay_in_index_order() {
        for w in [1, 1000] {
            let live = [weighted(4, w), weighted(1, w), weighted(2, w)];
            let r = target_ring(&live, TargetPolicy::RoundRobin);
            assert_eq!((r.mode, r.as_slice()), (RING_ROTATE, &[1u32, 2, 4][..]));
        }
        let r = target_ring(&[weighted(5, 3)], TargetPolicy::RoundRobin);
        assert_eq!((r.mode, r.as_slice()), (RING_ROTATE, &[5u32][..]));
        let r = target_ring(&[], TargetPolicy::RoundRobin);
        assert!(r.as_slice().is_empty());
    }

    #[test]
    fn round_robin_target_weights_are_reduced_by_their_gcd() {
        assert_eq!(ring_weights(&[10, 20, 30], 128), vec![1, 2, 3]);
        assert_eq!(ring_weights(&[4, 6], 128), vec![2, 3]);
        let small = target_ring(
            &[weighted(0, 1), weighted(1, 2), weighted(2, 3)],
            TargetPolicy::RoundRobin,
        );
        let big = target_ring(
            &[weighted(0, 100), weighted(1, 200), weighted(2, 300)],
            TargetPolicy::RoundRobin,
        );
        assert_eq!(small, big);
        assert_eq!(small.as_slice().len(), 2 * 126);
    }

    #[test]
    fn round_robin_target_ring_stays_within_its_capacity() {
        // Weights that do not reduce: scaled down to fit 128 pairs, every
        // server kept, the ratios close.
        assert_eq!(ring_weights(&[1000, 1, 1], 128), vec![126, 1, 1]);
        let w = ring_weights(&[997, 500, 3], 128);
        assert!(w.iter().sum::<u32>() <= 128, "{w:?}");
        assert_eq!(w, vec![85, 42, 1]);
        let r = target_ring(
            &[weighted(0, 1000), weighted(1, 1), weighted(2, 1)],
            TargetPolicy::RoundRobin,
        );
        assert_eq!(r.as_slice().len(), RING_SIZE);
        let t: Vec<u32> = r.as_slice().chunks(2).map(|p| p[0]).collect();
        assert_eq!(
            (count_of(&t, 0), count_of(&t, 1), count_of(&t, 2)),
            (126, 1, 1)
        );
        let from0 = targets_over_a_turn(&r, 0);
        assert_eq!(
            (count_of(&from0, Some(1)), count_of(&from0, Some(2))),
            (64, 64)
        );
        // 128 servers of weights 1..=128 scale down to weight 1 each:
        // every server once, in index order.
        let many: Vec<Server> = (0..128).map(|i| weighted(i, i + 1)).collect();
        let r = target_ring(&many, TargetPolicy::RoundRobin);
        assert_eq!(r.mode, RING_ROTATE);
        assert_eq!(r.as_slice(), &(0..128).collect::<Vec<u32>>()[..]);
        // More servers than pairs: unweighted round robin, as before.
        let more: Vec<Server> = (0..200).map(|i| weighted(i, i % 3 + 1)).collect();
        let r = target_ring(&more, TargetPolicy::RoundRobin);
        assert_eq!(r.mode, RING_ROTATE);
        assert_eq!(r.as_slice(), &(0..200).collect::<Vec<u32>>()[..]);
        // Capacity for any mix (a property over deterministic weights).
        let mut x: u64 = 7;
        for n in 2..40u32 {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let live: Vec<Server> = (0..n)
                .map(|i| weighted(i, 1 + ((x >> (i % 32)) % 1000) as u32))
                .collect();
            let r = target_ring(&live, TargetPolicy::RoundRobin);
            assert!(r.as_slice().len() <= RING_SIZE);
            for o in 0..n {
                assert!(targets_over_a_turn(&r, o).iter().all(|t| t.is_some()));
            }
        }
    }

    #[test]
    fn placement_switches_at_run_time() {
        let mut c = cp(TargetPolicy::RoundRobin);
        let key = CServiceKey::tcp(VIP, 80);
        assert_eq!(c.dp.services[&key].placement, PLACE_MAGLEV);
        c.set_placement(0, Placement::Lwrr).unwrap();
        assert_eq!(c.dp.services[&key].placement, PLACE_RING);
        assert_eq!(c.services()[0].placement, Placement::Lwrr);
        assert!(!c.dp.rings[&(0, RING_PLACEMENT)].as_slice().is_empty());
        c.set_placement(0, Placement::Maglev).unwrap();
        assert_eq!(c.dp.services[&key].placement, PLACE_MAGLEV);
        c.set_placement(7, Placement::Lwrr).unwrap(); // no such service
    }

    /// The data plane's flags of the service at `VIP:80`.
    fn refuse_flag(c: &ControlPlane<MemDataPlane>) -> bool {
        c.dp.services[&CServiceKey::tcp(VIP, 80)].flags & SVC_REFUSE != 0
    }

    fn refusing_events(c: &mut ControlPlane<MemDataPlane>) -> Vec<bool> {
        c.take_health_events()
            .into_iter()
            .filter_map(|e| match e {
                HealthEvent::Refusing { on, .. } => Some(on),
                _ => None,
            })
            .collect()
    }

    /// Heartbeats from every server, then a tick, at `t` ms.
    fn beat_and_tick(c: &mut ControlPlane<MemDataPlane>, t: u64) {
        let now = Instant::from_millis(t);
        for j in 1..=3 {
            c.heartbeat(now, ServerId(j)).unwrap();
        }
        c.tick(now).unwrap();
    }

    #[test]
    fn a_service_refuses_only_when_every_member_is_out_by_the_operator() {
        let mut c = cp(TargetPolicy::RoundRobin);
        // Every server drained before refusals are allowed (a switchd that
        // just started, servers restored drained from the store): SYNs are
        // dropped, not refused.
        for j in 1..=3 {
            c.set_draining(ServerId(j), true).unwrap();
        }
        beat_and_tick(&mut c, 100);
        assert!(!refuse_flag(&c) && !c.services()[0].refusing);
        // Allowed from 1 s (the daemon: dead_after after becoming active).
        c.allow_refusals_from(Instant::from_millis(1000));
        beat_and_tick(&mut c, 900);
        assert!(!refuse_flag(&c), "before the start-up grace");
        beat_and_tick(&mut c, 1000);
        assert!(refuse_flag(&c) && c.services()[0].refusing);
        assert_eq!(refusing_events(&mut c), [true]);
        assert!(c.dp.maglev[&0].iter().all(|v| *v == NO_SERVER));
        // One undrained: placeable again, no longer refusing, at once.
        c.set_draining(ServerId(2), false).unwrap();
        assert!(!refuse_flag(&c));
        assert!(c.dp.maglev[&0].contains(&1));
        assert_eq!(refusing_events(&mut c), [false]);
        // Weight 0 on the last placeable one: refusing; weighted again: not.
        c.set_operator_weights(BTreeMap::from([(ServerId(2), 0)]))
            .unwrap();
        assert!(refuse_flag(&c));
        c.set_operator_weights(BTreeMap::from([(ServerId(2), 3)]))
            .unwrap();
        assert!(!refuse_flag(&c));
        // Every server at weight 0, none drained: refusing.
        for j in 1..=3 {
            c.set_draining(ServerId(j), false).unwrap();
        }
        let zero: BTreeMap<ServerId, u32> = (1..=3).map(|j| (ServerId(j), 0)).collect();
        c.set_operator_weights(zero).unwrap();
        assert!(refuse_flag(&c));
        // The flag follows the placement switch (LWRR: an empty ring).
        c.set_placement(0, Placement::Lwrr).unwrap();
        let svc = c.dp.services[&CServiceKey::tcp(VIP, 80)];
        assert_eq!((svc.placement, svc.flags), (PLACE_RING, SVC_REFUSE));
        assert!(c.dp.rings[&(0, RING_PLACEMENT)].as_slice().is_empty());
        c.set_operator_weights(BTreeMap::new()).unwrap();
        assert!(!refuse_flag(&c));
        assert!(!c.dp.rings[&(0, RING_PLACEMENT)].as_slice().is_empty());
        assert_eq!(
            c.dp.refuse_while_placeable, 0,
            "the refuse flag was set while a table placed new flows"
        );
        assert_eq!(c.dp.draining_while_placed, 0);
    }

    #[test]
    fn dead_servers_refuse_only_after_their_grace() {
        let mut c = world(Duration::from_secs(2));
        let ms = Instant::from_millis;
        c.allow_refusals_from(Instant::ZERO);
        c.tick(ms(100)).unwrap();
        assert!(!refuse_flag(&c));
        // Every server silent: dead at 400 ms, flows kept until 2.4 s. It
        // may be a stall (GC pause, CPU starvation): a SYN is dropped, and
        // its retransmission reaches a server that came back.
        c.tick(ms(400)).unwrap();
        assert!(c.servers().all(|s| s.liveness == Liveness::Dead));
        c.tick(ms(2300)).unwrap();
        assert!(
            !refuse_flag(&c),
            "dead within the grace: dropped, not refused"
        );
        // s1 drained while dead: it would come back draining (out for
        // good); s2 and s3 may still come back live.
        c.set_draining(ServerId(1), true).unwrap();
        assert!(!refuse_flag(&c));
        // The grace ends: gone for good, refused.
        c.tick(ms(2400)).unwrap();
        assert!(refuse_flag(&c));
        // s3 registers again (restarted): placeable, not refusing.
        c.register_as(ms(2500), &reg(3, 9), &[]).unwrap();
        assert!(!refuse_flag(&c));
        assert!(c.dp.maglev[&0].contains(&2));
        assert_eq!(c.dp.refuse_while_placeable, 0);

        // A dead server within its grace among drained ones: not refusing
        // until its grace ends.
        let mut c = world(Duration::from_secs(2));
        c.allow_refusals_from(Instant::ZERO);
        c.set_draining(ServerId(1), true).unwrap();
        c.set_draining(ServerId(2), true).unwrap();
        for t in (100..=400).step_by(100) {
            c.heartbeat(ms(t), ServerId(1)).unwrap();
            c.heartbeat(ms(t), ServerId(2)).unwrap();
            c.tick(ms(t)).unwrap();
        }
        assert_eq!(c.server(ServerId(3)).unwrap().liveness, Liveness::Dead);
        assert!(!refuse_flag(&c));
        // It heartbeats within the grace: back, live, placed on.
        c.heartbeat(ms(500), ServerId(3)).unwrap();
        assert!(!refuse_flag(&c) && c.dp.maglev[&0].contains(&2));
    }

    #[test]
    fn an_empty_pool_or_a_retiring_service_does_not_refuse() {
        let mut c = cp(TargetPolicy::RoundRobin);
        c.allow_refusals_from(Instant::ZERO);
        // A pool naming only a server that never registered: nobody known
        // yet (it may register any moment), dropped.
        let other = Ipv4Addr::new(198, 18, 100, 2);
        c.add_service_with_pool(
            other,
            80,
            Placement::Maglev,
            PoolSpec {
                members: vec![(ServerId(9), 1)],
                open: false,
            },
        )
        .unwrap();
        for j in 1..=3 {
            c.set_draining(ServerId(j), true).unwrap();
        }
        c.tick(Instant::from_millis(100)).unwrap();
        assert!(refuse_flag(&c));
        let okey = CServiceKey::tcp(other, 80);
        assert!(c.services()[1].pool.is_empty());
        assert_eq!(c.dp.services[&okey].flags, 0, "empty pool: not refusing");
        // Deleted (retiring): PLACE_NONE resets anyway, the flag goes.
        let keep = ServiceSpec {
            name: "other".into(),
            addr: SocketAddrV4::new(other, 80),
            placement: Placement::Maglev,
            follows_global: true,
            pool: PoolSpec {
                members: vec![(ServerId(9), 1)],
                open: false,
            },
        };
        let ch = c
            .apply_services(Instant::from_millis(200), &[keep], true)
            .unwrap();
        assert_eq!(ch.retiring.len(), 1, "{ch:?}");
        let svc = c.dp.services[&CServiceKey::tcp(VIP, 80)];
        assert_eq!((svc.placement, svc.flags), (PLACE_NONE, 0));
        assert!(!c.services().iter().any(|s| s.refusing));
    }

    /// s2 (index 1) out of every Maglev slot and target ring, and DRAINING
    /// in the data plane; or back in them, LIVE.
    fn s2_placed(c: &ControlPlane<MemDataPlane>) -> bool {
        let in_slots = c.dp.maglev[&0].contains(&1);
        let in_targets = c.dp.rings[&(0, RING_TARGET)].as_slice().contains(&1);
        assert_eq!(in_slots, in_targets, "slots and targets disagree");
        in_slots
    }

    #[test]
    fn a_leaving_server_leaves_placement_and_targets_and_keeps_its_flows() {
        let mut c = world(Duration::from_secs(2));
        assert!(s2_placed(&c));
        assert!(c.set_leaving(ServerId(2), true).unwrap());
        assert!(!c.set_leaving(ServerId(2), true).unwrap(), "no change");
        assert!(!s2_placed(&c));
        assert_eq!(c.dp.rings[&(0, RING_TARGET)].as_slice(), &[0, 2]);
        assert_eq!(c.dp.servers[&1].state, SERVER_DRAINING);
        assert_eq!(c.dp.draining_while_placed, 0);
        // Not the operator's drain: the API's state stays "live".
        let s2 = c.server(ServerId(2)).unwrap();
        assert_eq!(
            (s2.liveness, s2.draining(), s2.leaving),
            (Liveness::Live, false, true)
        );
        // Every flow on it (placed or migrated in) keeps flowing.
        assert_eq!(owners(&c), vec![Some(0), Some(1), Some(2), Some(1)]);
        assert!(closed_ports(&mut c).is_empty());
        // Heartbeats keep it alive; the pool monitor leaves it out.
        c.heartbeat(Instant::from_millis(100), ServerId(2)).unwrap();
        let r = c.tick(Instant::from_millis(100)).unwrap();
        assert!(r.iter().all(|x| x.live_servers == 2), "{r:?}");
        assert_eq!(
            c.take_liveness_events(),
            vec![LivenessEvent::Leaving {
                id: ServerId(2),
                on: true
            }]
        );
        // A heartbeat without the flag (it stopped stopping): back.
        assert!(c.set_leaving(ServerId(2), false).unwrap());
        assert!(s2_placed(&c));
        assert_eq!(c.dp.servers[&1].state, SERVER_LIVE);
        assert_eq!(c.dp.draining_while_placed, 0);
    }

    #[test]
    fn leaving_and_the_operators_drain_hold_apart() {
        let mut c = world(Duration::from_secs(2));
        // Leaving, then drained: both hold; the drain's end leaves it out.
        c.set_leaving(ServerId(2), true).unwrap();
        c.set_draining(ServerId(2), true).unwrap();
        assert!(!s2_placed(&c));
        c.set_draining(ServerId(2), false).unwrap();
        assert!(!s2_placed(&c), "still leaving");
        assert_eq!(c.dp.servers[&1].state, SERVER_DRAINING);
        assert_eq!(c.server(ServerId(2)).unwrap().liveness, Liveness::Live);
        // Drained, then leaving ends: the drain still holds.
        c.set_draining(ServerId(2), true).unwrap();
        c.set_leaving(ServerId(2), false).unwrap();
        assert!(!s2_placed(&c), "still drained");
        assert_eq!(c.dp.servers[&1].state, SERVER_DRAINING);
        assert!(c.server(ServerId(2)).unwrap().draining());
        // Stopped while drained, then a new instance registers: DRAINING
        // as the operator wants (what the daemon does with `draining()`).
        c.set_leaving(ServerId(2), true).unwrap();
        assert_eq!(
            c.stopped(Instant::from_millis(50), ServerId(2)).unwrap(),
            Some(2)
        );
        assert!(c.server(ServerId(2)).unwrap().draining());
        c.register_as(Instant::from_millis(60), &reg(2, 8), &[])
            .unwrap();
        c.set_draining(ServerId(2), true).unwrap();
        let s2 = c.server(ServerId(2)).unwrap();
        assert_eq!(
            (s2.liveness, s2.leaving, s2.stopped),
            (Liveness::Draining, false, false)
        );
        assert!(!s2_placed(&c));
        // Undrained: placed again.
        c.set_draining(ServerId(2), false).unwrap();
        assert!(s2_placed(&c));
        // The same (live) instance registering again stays leaving; a
        // new one does not.
        c.set_leaving(ServerId(2), true).unwrap();
        c.register_as(Instant::from_millis(70), &reg(2, 8), &[])
            .unwrap();
        assert!(c.server(ServerId(2)).unwrap().leaving);
        assert!(!s2_placed(&c));
        c.register_as(Instant::from_millis(80), &reg(2, 9), &[])
            .unwrap();
        assert!(!c.server(ServerId(2)).unwrap().leaving);
        assert!(s2_placed(&c));
        assert_eq!(c.dp.draining_while_placed, 0);
    }

    #[test]
    fn a_stopped_server_is_dead_at_once_and_a_new_instance_is_placed_again() {
        let mut c = world(Duration::from_secs(2));
        c.set_leaving(ServerId(2), true).unwrap();
        c.take_liveness_events();
        // STOPPED with two flows left (2 placed on it, 4 migrated to it):
        // dead now, no dead_after wait, no grace; the flows removed.
        assert_eq!(
            c.stopped(Instant::from_millis(10), ServerId(2)).unwrap(),
            Some(2)
        );
        let s2 = c.server(ServerId(2)).unwrap();
        assert_eq!(
            (s2.liveness, s2.stopped, s2.leaving, s2.flows_kept_until),
            (Liveness::Dead, true, false, None)
        );
        assert_eq!(c.dp.servers[&1].state, SERVER_DEAD);
        assert!(!s2_placed(&c));
        assert_eq!(owners(&c), vec![Some(0), None, Some(2), None]);
        assert_eq!(closed_ports(&mut c), vec![2, 4]);
        assert_eq!(
            c.take_liveness_events(),
            vec![
                LivenessEvent::FlowsRemoved {
                    id: ServerId(2),
                    flows: 2,
                    why: FlowsRemovedWhy::Stopped,
                },
                LivenessEvent::Stopped {
                    id: ServerId(2),
                    flows: 2
                }
            ]
        );
        assert_eq!(
            (
                c.liveness.stopped_total,
                c.liveness.stopped_flows_removed_total,
                c.liveness.died_total
            ),
            (1, 2, 0)
        );
        // The repeated STOPPED datagrams change nothing; nor does a tick
        // (it is not "dead" twice).
        assert_eq!(
            c.stopped(Instant::from_millis(11), ServerId(2)).unwrap(),
            None
        );
        run_without_s2(&mut c, 100, 1000);
        assert!(c.take_liveness_events().is_empty());
        assert_eq!((c.liveness.stopped_total, c.liveness.died_total), (1, 0));
        // Its restart registers (a new instance): LIVE, placed again,
        // "stopped" false.
        c.register_as(Instant::from_millis(1100), &reg(2, 8), &[])
            .unwrap();
        let s2 = c.server(ServerId(2)).unwrap();
        assert_eq!(
            (s2.liveness, s2.stopped, s2.leaving),
            (Liveness::Live, false, false)
        );
        assert_eq!(c.dp.servers[&1].state, SERVER_LIVE);
        assert!(s2_placed(&c));
        assert!(c.take_liveness_events().is_empty());
        assert!(c.stopped(Instant::ZERO, ServerId(9)).is_err());
    }

    #[test]
    fn a_stop_within_the_dead_grace_removes_the_kept_flows() {
        // Declared dead after missed heartbeats (flows kept), then its
        // STOPPED arrives: the flows go now, not at the grace's end.
        let mut c = world(Duration::from_secs(2));
        run_without_s2(&mut c, 100, 500);
        c.take_liveness_events();
        assert_eq!(
            c.stopped(Instant::from_millis(600), ServerId(2)).unwrap(),
            Some(2)
        );
        let s2 = c.server(ServerId(2)).unwrap();
        assert_eq!(
            (s2.liveness, s2.stopped, s2.flows_kept_until),
            (Liveness::Dead, true, None)
        );
        assert_eq!(closed_ports(&mut c), vec![2, 4]);
    }
}
