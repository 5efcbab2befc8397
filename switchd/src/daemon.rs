//! The switchd daemon: one control thread owns the [`ControlPlane`] over the
//! XDP data plane and runs, without ever waiting for the store:
//! - the control channel (UDP, MAC'd): REGISTER -> server entry in the data
//!   plane and REGISTER_ACK; HEARTBEAT; SET_OWNER; ERROR; DRAIN / MIGRATE
//!   sent to servers on operator request;
//! - the pool monitor: every `load_interval`, a LOAD-NOTIFICATION to each
//!   live server's data address, liveness checks, target-ring refresh;
//! - flow events to the store's batching writer, closed-flow reaping;
//! - a status snapshot for the HTTP endpoint (`/status`, `/metrics`).
//!
//! Store work (server records, leases, flow scans) runs on a small tokio
//! runtime; the control thread only spawns onto it or reads results that
//! are already there. HA: with `[ha] enabled`, the process first waits as a
//! standby (data plane loaded, not attached, flow table kept warm from the
//! store), then attaches when it wins the lease (see docs/SWITCHD.md).
//!
//! Untrusted input: every datagram is parsed with `parse_verified`; bad MAC,
//! unknown version or kind, malformed bodies, replays and requests from
//! unregistered servers are counted by reason and dropped (answered with
//! ERROR where the sender is authenticated).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpListener, UdpSocket};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant as StdInstant};

use anyhow::Context;
use capybara_proto::control::{
    self as ctl, ControlBody, ControlError as WireError, ControlKind, ControlRepr, ErrorCode,
    ErrorMsg, RegisterAck,
};
use capybara_proto::load::LoadRepr;
use capybara_proto::{ports, FlowKey, Instant, MigrationKey, ServerId};
use capybara_store::{FlowWriter, FlowWriterConfig, LeaderLease, ServerState, Store, WriteFence};
use serde_json::json;

use crate::abi::*;
use crate::bpf::{Attached, BpfDataPlane, BpfOptions, LinkPins};
use crate::config::{Config, Role};
use crate::control::{
    ControlConfig, ControlPlane, FlowsRemovedWhy, HealthEvent, Liveness, LivenessEvent,
    Registration,
};
use crate::dataplane::DataPlane;
use crate::persist::StoreSink;
use crate::sys;

static SHUTDOWN: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    SHUTDOWN.store(true, Ordering::SeqCst);
}

fn install_signal_handlers() {
    // SAFETY: the handler only stores to an atomic (async-signal-safe).
    unsafe {
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
    }
}

/// For embedders (the `capybara` appliance runs [`run`] on a thread): installs
/// the SIGTERM/SIGINT handlers that [`run`] installs, before anything else
/// starts, so that an early signal is a graceful stop.
pub fn install_shutdown_signals() {
    install_signal_handlers();
}

/// True once SIGTERM/SIGINT arrived or [`request_shutdown`] was called.
pub fn shutdown_requested() -> bool {
    SHUTDOWN.load(Ordering::SeqCst)
}

/// Makes a running [`run`] stop as on SIGTERM (detach, flush flow
/// mappings, resign the lease).
pub fn request_shutdown() {
    SHUTDOWN.store(true, Ordering::SeqCst);
}

/// Operator requests from the HTTP endpoint to the control thread.
#[derive(Debug)]
pub enum Command {
    Drain {
        server: ServerId,
        deadline_ms: u32,
        cancel: bool,
        /// Told once the control loop applied it (the HTTP answer waits
        /// for it: a connection opened after the answer is placed without
        /// the drained server).
        applied: Option<mpsc::Sender<()>>,
    },
    Migrate {
        server: ServerId,
        flow: FlowKey,
        target: Option<Ipv4Addr>,
    },
}

/// A store read of the operator's drains: the drain commands applied
/// before it, the drains it found ([`op_drains_of`]) and the servers that
/// have a record and a drain record (held or not).
struct StoredDrains {
    cmds_before: u64,
    held: HashMap<ServerId, Option<u64>>,
    recorded: HashSet<ServerId>,
    /// Every server with a record.
    servers: HashSet<ServerId>,
}

/// What the HTTP thread serves; refreshed by the control thread.
#[derive(Default)]
struct Published {
    status: String,
    metrics: String,
    /// Migrations the servers reported (MIGRATION_REPORT), for `GET /migrations`.
    migrations: crate::control::MigrationRing,
    /// The switch epoch (`/migrations` names it: a new epoch restarts `seq`).
    epoch: u32,
    /// `standby` while this switchd stands by (HA): its control loop takes
    /// no commands then, so drains and undrains are refused at once.
    role: &'static str,
}

/// How often the flow and migration counts of `/status` and `/metrics`
/// are taken. From the kernel's element counters (`BpfDataPlane::
/// table_counts`, Linux 6.6 and later): one system call of a few
/// microseconds whatever the tables hold, before each publication. On a
/// kernel without them the fallback walks both tables, which costs in
/// proportion to their buckets (~3.5-7.5 ms holding a CPU for the default
/// 2M-bucket flow table: this kernel does not preempt a system call), so
/// it runs only every [`WALK_COUNT_EVERY`] (docs/BENCHMARKS.md: walking
/// every 1.75-3.75 s set the worst 10 ms bins of bench-maintenance).
const EXACT_COUNT_EVERY: Duration = Duration::from_millis(200);
/// See [`EXACT_COUNT_EVERY`].
const WALK_COUNT_EVERY: Duration = Duration::from_secs(10);

/// How often the active switch stores each server's last accepted
/// control-channel seq (`Switch::write_seq_floors`): after a takeover or a
/// restart, messages captured in the last interval before it can still be
/// replayed once each; older ones are refused.
const SEQ_FLOOR_INTERVAL: Duration = Duration::from_secs(2);

/// Per-server facts the data plane does not hold.
#[derive(Debug, Clone)]
struct Peer {
    mgmt: SocketAddr,
    last_seq: u64,
    connections: u32,
    migrations_in_flight: u32,
    load_pps: u64,
    rx_backlog_bytes: u64,
    draining_acked: bool,
    /// A DRAIN still to (re)send: (deadline_ms, cancel, retries left).
    pending_drain: Option<(u32, bool, u32)>,
    /// POLICY generation the server reports applying.
    policy_generation: u32,
    /// The REGISTER's service list: a HEARTBEAT's health bit `i` is about
    /// service `i` of it.
    services: Vec<SocketAddrV4>,
    /// REGISTER_ACKs still to re-send after the heartbeat interval changed
    /// (answering its heartbeats, not before `ack_resend_at`), in case the
    /// one sent at the change was lost.
    ack_resends: u8,
    ack_resend_at: Instant,
    /// Its FLOWS report (the connections it holds) arrived complete since
    /// this switchd knows it (REGISTER, or restored from the store).
    flows_reported: bool,
    /// FLOWS requests (FLOWS_ACK with REQUEST) still to send while it has
    /// not reported, answering its heartbeats, not before `flow_request_at`.
    flow_requests_left: u8,
    flow_request_at: Instant,
    /// Claims of its current report so far: (claims, applied, skipped).
    flow_claims: (u64, u64, u64),
    /// Its data address when its REGISTER asked for the long REGISTER_ACK
    /// (`REGISTER_LAST_ID`): every REGISTER_ACK to it then names the last
    /// migration id the data plane saw from that address. `None`: the
    /// 16-byte form (a hostagent that predates the field refuses others).
    last_id_of: Option<Ipv4Addr>,
}

/// The hostagent-side tunables of a policy as a POLICY message; the
/// generation is a hash of the values (never 0), so two switches holding the
/// same policy send the same generation.
/// The store spec as an operator reads it: `sqlite /path` or `etcd URL,URL`.
fn store_spec_text(spec: &crate::config::StoreSpec) -> String {
    match spec {
        crate::config::StoreSpec::Sqlite(p) => format!("sqlite {}", p.display()),
        crate::config::StoreSpec::Etcd(eps) => format!("etcd {}", eps.join(",")),
    }
}

/// Why an active steps down: another candidate holds the lease.
fn lease_lost_text(holder: &str, term: u64, ours: Option<u64>) -> String {
    let ours = ours.map_or_else(
        || "we held none".to_string(),
        |t| format!("ours was term {t}"),
    );
    format!(
        "{holder:?} holds the leader lease with term {term} ({ours}): stepping down (handing the pinned XDP links over to a standby on this box, else detaching) so that the new leader owns the interfaces"
    )
}

/// The policy key's value (`target_selection`, docs/POLICIES.md).
fn target_policy_name(tp: crate::control::TargetPolicy) -> &'static str {
    match tp {
        crate::control::TargetPolicy::RoundRobin => "round_robin",
        crate::control::TargetPolicy::LeastLoaded => "least_loaded",
    }
}

/// A POLICY message in the store's units, for the log.
fn policy_message_text(m: &ctl::PolicyMsg) -> String {
    let on = |bit| if m.flags & bit != 0 { "on" } else { "off" };
    format!(
        "proactive {} (threshold {}%, hysteresis {}%), reactive {} (backlog {} packets), cooldown {} ms, at most {} migrations/s per server, deadline {} ms, buffer mode {}",
        on(ctl::POLICY_PROACTIVE),
        f64::from(m.proactive_threshold_bp) / 100.0,
        f64::from(m.hysteresis_bp) / 100.0,
        on(ctl::POLICY_REACTIVE),
        m.reactive_backlog_packets,
        m.cooldown_ms,
        m.max_migrations_per_sec,
        m.migration_deadline_ms,
        if m.flags & ctl::POLICY_BUFFER_DROP != 0 { "drop" } else { "buffer" },
    )
}

pub fn policy_message(p: &capybara_store::Policy) -> ctl::PolicyMsg {
    let mut m = ctl::PolicyMsg {
        generation: 0,
        flags: if p.proactive_enabled {
            ctl::POLICY_PROACTIVE
        } else {
            0
        } | if p.reactive_enabled {
            ctl::POLICY_REACTIVE
        } else {
            0
        } | if p.buffer_mode == capybara_store::BufferMode::Drop {
            ctl::POLICY_BUFFER_DROP
        } else {
            0
        },
        proactive_threshold_bp: (p.proactive_threshold_pct * 100.0).round() as u32,
        hysteresis_bp: (p.hysteresis_pct * 100.0).round() as u32,
        reactive_backlog_packets: p.reactive_backlog_threshold,
        cooldown_ms: p.connection_cooldown_ms.min(u64::from(u32::MAX)) as u32,
        max_migrations_per_sec: p.max_migrations_per_sec_per_server,
        // Within the API's bounds (10 ms to 10 s): never 0, which would
        // mean "keep your own".
        migration_deadline_ms: p.migration_deadline_ms.clamp(10, 10_000) as u32,
    };
    // FNV-1a over the values.
    let mut h: u32 = 0x811c_9dc5;
    for v in [
        m.flags,
        m.proactive_threshold_bp,
        m.hysteresis_bp,
        m.reactive_backlog_packets,
        m.cooldown_ms,
        m.max_migrations_per_sec,
        m.migration_deadline_ms,
    ] {
        for b in v.to_be_bytes() {
            h = (h ^ u32::from(b)).wrapping_mul(0x0100_0193);
        }
    }
    m.generation = h.max(1);
    m
}

/// What switchd writes to a store that holds no policy yet
/// (`Store::put_policy_if_absent`): the defaults, with its config's
/// liveness timing, so that a deployment (or a lab) that never set a policy
/// keeps the heartbeat interval and `dead_after` its switchd config names;
/// from then on the stored values apply.
pub fn seed_policy(heartbeat_interval: Duration, dead_after: Duration) -> capybara_store::Policy {
    capybara_store::Policy {
        heartbeat_interval_ms: heartbeat_interval.as_millis() as u64,
        dead_after_ms: dead_after.as_millis() as u64,
        ..Default::default()
    }
}

/// A stored policy with the keys that were inert before brought within
/// the bounds they are applied with (the API enforces them since; one
/// stored before must not make switchd ignore the whole policy): heartbeat
/// 10 ms to 60 s, `dead_after` twice that to 600 s, migration deadline
/// 10 ms to 10 s.
pub fn policy_within_bounds(mut p: capybara_store::Policy) -> capybara_store::Policy {
    use capybara_store::model::{DEAD_AFTER_MAX_MS, HEARTBEAT_INTERVAL_MS, MIGRATION_DEADLINE_MS};
    p.heartbeat_interval_ms = p
        .heartbeat_interval_ms
        .clamp(*HEARTBEAT_INTERVAL_MS.start(), *HEARTBEAT_INTERVAL_MS.end());
    p.dead_after_ms = p
        .dead_after_ms
        .clamp(2 * p.heartbeat_interval_ms, DEAD_AFTER_MAX_MS);
    p.migration_deadline_ms = p
        .migration_deadline_ms
        .clamp(*MIGRATION_DEADLINE_MS.start(), *MIGRATION_DEADLINE_MS.end());
    p
}

fn clock(start: StdInstant) -> Instant {
    Instant::from_micros(start.elapsed().as_micros() as u64)
}

/// Entry point of the daemon.
pub fn run(cfg: Config) -> anyhow::Result<()> {
    install_signal_handlers();
    let key = cfg.load_key()?;
    if let Some(w) = cfg.key_file_warning() {
        eprintln!("switchd: {w}");
    }
    // Resolve interfaces before anything else: a typo should fail fast.
    let mut ifaces = Vec::new();
    for (i, ifc) in cfg.interfaces.iter().enumerate() {
        let idx = sys::ifindex(&ifc.name)
            .with_context(|| format!("config field `interfaces[{i}].name` = {:?}", ifc.name))?;
        let mac = sys::iface_mac(&ifc.name)
            .with_context(|| format!("config field `interfaces[{i}].name` = {:?}", ifc.name))?;
        ifaces.push((idx, ifc.role, mac));
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .thread_name("switchd-store")
        .build()?;
    let store: Option<Arc<dyn Store>> = match &cfg.store {
        Some(spec) => Some(
            rt.block_on(capybara_store::open(&spec.to_store_config()))
                .with_context(|| format!("opening store {}", store_spec_text(spec)))?,
        ),
        None => None,
    };
    let published = Arc::new(Mutex::new(Published::default()));
    let (cmd_tx, cmd_rx) = mpsc::channel();
    start_http(cfg.metrics_listen, published.clone(), cmd_tx)?;

    let mut dp = BpfDataPlane::load(BpfOptions {
        max_flows: cfg.max_flows,
        ..Default::default()
    })
    .context("loading the XDP data plane (needs root / CAP_BPF)")?;
    dp.set_generic_xdp(cfg.xdp_generic);
    let mut sw = Switch::new(
        cfg,
        key,
        dp,
        ifaces,
        store,
        rt.handle().clone(),
        published,
        cmd_rx,
    )?;
    sw.pins = link_pins(&sw.cfg);
    let result = sw.main();
    sw.shutdown(&rt);
    drop(sw);
    rt.shutdown_timeout(Duration::from_secs(2));
    eprintln!("switchd: stopped");
    result
}

/// The pin directory of this namespace and election, or `None` with the
/// reason logged (see `ha.pin_dir`).
fn link_pins(cfg: &Config) -> Option<LinkPins> {
    if cfg.ha.pin_dir.is_empty() {
        eprintln!("switchd: XDP links not pinned (ha.pin_dir = \"\"): a takeover or restart attaches only after this process's links are gone");
        return None;
    }
    match LinkPins::open(std::path::Path::new(&cfg.ha.pin_dir), &cfg.ha.election) {
        Ok(p) => {
            eprintln!("switchd: XDP links pinned in {}", p.dir().display());
            Some(p)
        }
        Err(why) => {
            eprintln!(
                "switchd: XDP links not pinned ({why}; `ip netns exec` mounts a fresh /sys without it: enter only the network namespace, e.g. `nsenter --net=/run/netns/NAME`): a takeover or restart attaches only after this process's links are gone, a gap of tens of ms"
            );
            None
        }
    }
}

struct Switch {
    cfg: Config,
    key: MigrationKey,
    cp: ControlPlane<BpfDataPlane>,
    ifaces: Vec<(u32, Role, [u8; 6])>,
    store: Option<Arc<dyn Store>>,
    rt: tokio::runtime::Handle,
    sink: Option<StoreSink>,
    published: Arc<Mutex<Published>>,
    cmd_rx: mpsc::Receiver<Command>,
    start: StdInstant,
    epoch: u32,
    seq: u64,
    load_seq: u64,
    peers: BTreeMap<ServerId, Peer>,
    drops: BTreeMap<&'static str, u64>,
    accepted: BTreeMap<&'static str, u64>,
    role: &'static str,
    candidate: String,
    lease: Option<LeaderLease>,
    lease_lost: Arc<AtomicBool>,
    takeover_ms: Option<f64>,
    restored_flows: usize,
    tick_overruns: u64,
    ticks: u64,
    load_sent: u64,
    flow_counts: (usize, usize),
    /// `flow_counts` are exact (the kernel's element counters), not a
    /// walk capped at `TABLE_COUNT_CAP` entries per table.
    counts_exact: bool,
    /// Standby: flows loaded from the store, to apply deltas.
    warm: HashMap<FlowKey, ServerId>,
    warm_syncs: u64,
    /// Took over on the interfaces' evidence, before holding the lease.
    fast_takeover: bool,
    /// Where the XDP links are pinned, and the owner lock that fences them
    /// (`None`: no bpffs or `ha.pin_dir = ""`, links die with the process).
    pins: Option<LinkPins>,
    /// Interfaces whose pinned link a predecessor left was taken over in
    /// place (no gap) at the last attach.
    links_taken_over: usize,
    garp_sent: u64,
    campaign_pending: Arc<AtomicBool>,
    won_lease: Arc<Mutex<Option<LeaderLease>>>,
    /// The migration policy in force (the store's, or defaults with the
    /// config's target selection and interval when there is no store).
    policy: capybara_store::Policy,
    /// Its hostagent-side tunables as sent in POLICY messages.
    policy_msg: ctl::PolicyMsg,
    /// Written by the store poller, taken by the control thread.
    policy_slot: Arc<Mutex<Option<capybara_store::Policy>>>,
    policy_changes: u64,
    policy_sent: u64,
    policy_rejected: u64,
    /// REGISTER_ACKs sent to registered servers because the heartbeat
    /// interval changed.
    register_acks_resent: u64,
    /// FLOWS requests sent, FLOWS batches taken.
    flow_requests_sent: u64,
    flow_batches: u64,
    /// What a store without a policy is seeded with: the config's liveness
    /// timing (`self.cfg`'s follows the store once read).
    policy_seed: capybara_store::Policy,
    /// The store's services as the poller last read them (taken by the
    /// control thread).
    services_slot: Arc<Mutex<Option<StoredServices>>>,
    /// The operator weights of the store's server records as the weights
    /// poller last read them (taken by the control thread).
    weights_slot: Arc<Mutex<Option<BTreeMap<ServerId, u32>>>>,
    /// The operator's drains as the weights poller last read them from the
    /// store ([`op_drains_of`]), with the count of drain commands applied
    /// before the read began (taken by the control thread:
    /// [`Switch::take_drains`]).
    drains_slot: Arc<Mutex<Option<StoredDrains>>>,
    /// Servers whose operator drain switchd holds (`op_drains`) but whose
    /// record the store no longer has: the API deleted them. A new
    /// instance that registers is a server put back, not a drained one.
    deleted_drained: HashSet<ServerId>,
    /// Drain and undrain commands applied so far: a store read begun before
    /// the last one may predate its record, and is not applied.
    drain_cmds: Arc<AtomicU64>,
    /// The store's retiring records as last read.
    retiring_records: Vec<capybara_store::RetiringService>,
    /// Retiring records (name, address, deleted_unix_ms) whose retiring
    /// service this switchd ended or could not serve: not restored again;
    /// the active forgets them in the store.
    ended_records: std::collections::HashSet<(String, SocketAddrV4, u64)>,
    /// The poller hands over its next read even if unchanged (a forget
    /// failed or was held: tried again).
    records_resync: Arc<AtomicBool>,
    /// Services added, updated or removed from the store's records.
    service_changes: u64,
    /// Stored services that could not be served (see `apply_services`).
    service_rejections: u64,
    /// The stored services the last read of the store's services left
    /// unserved, and why (`refused_services` in `/status`): so that the
    /// API tells "refused" from "not read yet". Replaced at every apply.
    refused_services: Vec<crate::services::RefusedService>,
    /// Retiring services removed: their connections had ended, or the
    /// retire timeout ended them.
    services_retired: u64,
    service_retire_timeouts: u64,
    /// Reaps flows that saw a SYN and nothing after (docs/SWITCHD.md).
    embryonic: crate::embryonic::EmbryonicReaper,
    /// HA fencing: the term of the last lease this switchd held (`None`
    /// after a fast takeover until it wins one). A leader with a higher term
    /// is newer: then, and only then, this switchd steps down.
    held_term: Option<u64>,
    /// Lease id of the last NotLeader answer (with `lease_lost`).
    lost_lease_id: Arc<std::sync::atomic::AtomicI64>,
    /// Set by the background campaign when a newer leader holds the lease.
    newer_leader: Arc<Mutex<Option<capybara_store::LeaderInfo>>>,
    /// Flow updates held while serving without the lease (not written).
    held: crate::persist::HeldUpdates,
    /// Server record writes held while serving without the lease.
    held_servers: HeldServerWrites,
    /// The seq floors last handed to the store, by server.
    floors_written: HashMap<ServerId, capybara_store::SeqFloor>,
    /// The operator's drains as this switchd knows them (the API's drain
    /// and undrain requests; the store's `Drain` records when it syncs):
    /// the server stays out of placement, also across its REGISTERs. The
    /// value is the drain's deadline (wall clock, Unix ms) while it runs,
    /// `None` once it is over (completed, timed out: the API says so in
    /// the store, read every 250 ms, [`Switch::take_drains`]): a hostagent
    /// that registers while it runs is sent DRAIN again.
    op_drains: HashMap<ServerId, Option<u64>>,
    lease_losses: u64,
    lease_regained: u64,
    /// HA: the lease the flow writer writes under (`apply_flows_fenced`):
    /// set while this switchd holds a lease, cleared when it loses it.
    fence: Arc<WriteFence>,
    /// Flow writes the store refused because our lease no longer held.
    fence_refusals: u64,
    /// Term of the leader seen while standing by (the predecessor). After a
    /// fast takeover, before this switchd holds a lease of its own, a leader
    /// with a higher term is newer and makes it step down.
    predecessor_term: Option<u64>,
}

/// The store's services and retiring records as one poll read them
/// (records first: see [`Switch::apply_store_services`]); `retiring` is
/// `None` when they could not be read.
type StoredServices = (
    Vec<capybara_store::Service>,
    Option<Vec<capybara_store::RetiringService>>,
);

/// A server record write held while serving without the lease.
#[derive(Debug, Clone)]
enum ServerWrite {
    Put(capybara_store::Server),
    State(ServerId, ServerState),
}

/// Server record writes held back without the lease, replayed in order
/// when it is won. Bounded (servers are few; beyond `CAP` the oldest go).
#[derive(Debug, Default)]
struct HeldServerWrites {
    writes: std::collections::VecDeque<ServerWrite>,
    dropped: u64,
}

impl HeldServerWrites {
    const CAP: usize = 4096;
    fn push(&mut self, w: ServerWrite) {
        if self.writes.len() >= Self::CAP {
            self.writes.pop_front();
            self.dropped += 1;
        }
        self.writes.push_back(w);
    }
}

impl Switch {
    #[allow(clippy::too_many_arguments)]
    fn new(
        cfg: Config,
        key: MigrationKey,
        dp: BpfDataPlane,
        ifaces: Vec<(u32, Role, [u8; 6])>,
        store: Option<Arc<dyn Store>>,
        rt: tokio::runtime::Handle,
        published: Arc<Mutex<Published>>,
        cmd_rx: mpsc::Receiver<Command>,
    ) -> anyhow::Result<Self> {
        let mut ccfg = ControlConfig::new(cfg.dead_after, cfg.target_policy);
        ccfg.closed_linger = cfg.closed_linger;
        ccfg.dead_flow_grace = cfg.dead_flow_grace;
        ccfg.service_retire_timeout = cfg.service_retire_timeout;
        let mut cp = ControlPlane::new(dp, ccfg);
        cp.dp.set_config(CConfig::new(cfg.switch_addr()))?;
        for (idx, role, mac) in &ifaces {
            let r = match role {
                Role::Client => IFACE_CLIENT,
                Role::Server => IFACE_SERVER,
            };
            cp.dp.set_iface(
                *idx,
                CIface {
                    role: r,
                    mac: *mac,
                    pad: 0,
                },
            )?;
            cp.dp.add_tx_port(*idx)?;
        }
        // The config's services until the store's are read (with a store,
        // its records are what is served: crate::services).
        let ch = cp.apply_services(Instant::ZERO, &crate::services::config_specs(&cfg), false)?;
        if let Some((name, why)) = ch.rejected.first() {
            anyhow::bail!("service {name:?}: {why}");
        }
        // Until the store confirms them: one it does not list (deleted
        // through the API) goes at once at the first read, not retiring.
        cp.mark_provisional();
        // HA: flow writes are fenced by the lease in the store itself, so a
        // switchd that lost its lease (paused, cut off) cannot overwrite what
        // a newer leader wrote, even with batches it queued before.
        let fence = WriteFence::new();
        let sink = store.as_ref().map(|st| {
            let _g = rt.enter();
            let writer = if cfg.ha.enabled {
                FlowWriter::spawn_fenced(st.clone(), FlowWriterConfig::default(), fence.clone())
            } else {
                FlowWriter::spawn(st.clone(), FlowWriterConfig::default())
            };
            StoreSink::new(Arc::new(writer))
        });
        let now_s = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        let epoch = (now_s.as_secs() as u32) ^ (std::process::id() << 16) ^ now_s.subsec_nanos();
        let initial = capybara_store::Policy {
            target_selection: match cfg.target_policy {
                crate::control::TargetPolicy::RoundRobin => {
                    capybara_store::TargetSelection::RoundRobin
                }
                crate::control::TargetPolicy::LeastLoaded => {
                    capybara_store::TargetSelection::LeastLoaded
                }
            },
            load_notification_interval_us: cfg.load_interval.as_micros() as u64,
            // What runs until the store is read: the config's placement (a
            // stored one that differs then applies, as target selection does).
            placement: match cfg.placement {
                crate::control::Placement::Maglev => capybara_store::Placement::Maglev,
                crate::control::Placement::Lwrr => capybara_store::Placement::Lwrr,
            },
            // The config's liveness timing until the store is read.
            heartbeat_interval_ms: cfg.heartbeat_interval.as_millis() as u64,
            dead_after_ms: cfg.dead_after.as_millis() as u64,
            ..Default::default()
        };
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
        let candidate = cfg
            .ha
            .candidate
            .clone()
            .unwrap_or_else(|| format!("{}-{}", host.trim(), std::process::id()));
        // 4,096 entries (one syscall) per 25 ms step: a full 2M-entry table
        // in ~13 s; a step that reaps all it reads costs ~3 syscalls per
        // entry (~10 ms), so pool-monitor ticks are delayed, not skipped.
        let embryonic = crate::embryonic::EmbryonicReaper::new(cfg.embryonic_timeout, 4096);
        let policy_seed = seed_policy(cfg.heartbeat_interval, cfg.dead_after);
        Ok(Switch {
            cfg,
            key,
            cp,
            ifaces,
            store,
            rt,
            sink,
            published,
            cmd_rx,
            start: StdInstant::now(),
            epoch,
            seq: 0,
            load_seq: 0,
            peers: BTreeMap::new(),
            drops: BTreeMap::new(),
            accepted: BTreeMap::new(),
            role: "starting",
            candidate,
            lease: None,
            lease_lost: Arc::new(AtomicBool::new(false)),
            takeover_ms: None,
            restored_flows: 0,
            tick_overruns: 0,
            ticks: 0,
            load_sent: 0,
            flow_counts: (0, 0),
            counts_exact: false,
            warm: HashMap::new(),
            warm_syncs: 0,
            fast_takeover: false,
            pins: None,
            links_taken_over: 0,
            garp_sent: 0,
            campaign_pending: Arc::new(AtomicBool::new(false)),
            won_lease: Arc::new(Mutex::new(None)),
            policy: initial.clone(),
            policy_msg: policy_message(&initial),
            policy_slot: Arc::new(Mutex::new(None)),
            policy_changes: 0,
            policy_sent: 0,
            policy_rejected: 0,
            register_acks_resent: 0,
            flow_requests_sent: 0,
            flow_batches: 0,
            policy_seed,
            services_slot: Arc::new(Mutex::new(None)),
            weights_slot: Arc::new(Mutex::new(None)),
            drains_slot: Arc::new(Mutex::new(None)),
            deleted_drained: HashSet::new(),
            drain_cmds: Arc::new(AtomicU64::new(0)),
            retiring_records: Vec::new(),
            ended_records: std::collections::HashSet::new(),
            records_resync: Arc::new(AtomicBool::new(false)),
            service_changes: 0,
            service_rejections: 0,
            refused_services: Vec::new(),
            services_retired: 0,
            service_retire_timeouts: 0,
            embryonic,
            held_term: None,
            lost_lease_id: Arc::new(std::sync::atomic::AtomicI64::new(0)),
            newer_leader: Arc::new(Mutex::new(None)),
            held: crate::persist::HeldUpdates::new(1 << 20),
            held_servers: HeldServerWrites::default(),
            floors_written: HashMap::new(),
            op_drains: HashMap::new(),
            lease_losses: 0,
            lease_regained: 0,
            fence,
            fence_refusals: 0,
            predecessor_term: None,
        })
    }

    fn now(&self) -> Instant {
        clock(self.start)
    }

    /// HA: this switchd does not hold the lease (lost it and has not won
    /// it back, or serves after a fast takeover before winning it), so it
    /// must not write to the store: writes are held until it wins the lease.
    fn writes_fenced(&self) -> bool {
        self.cfg.ha.enabled && self.lease.is_none()
    }

    /// Holds or takes the lease: the flow writer's fence follows.
    fn set_lease(&mut self, lease: Option<LeaderLease>) {
        self.fence.set(lease.as_ref().map(|l| &l.info));
        self.lease = lease;
    }

    /// Writes a server record now, or holds it while writes are fenced.
    fn store_server_write(&mut self, w: ServerWrite) {
        if self.writes_fenced() {
            self.held_servers.push(w);
            return;
        }
        if let Some(store) = self.store.clone() {
            self.rt.spawn(write_server(store, w));
        }
    }

    /// Sets the role `/status` shows, and the HTTP thread's (which answers
    /// a standby's drain requests at once).
    fn set_role(&mut self, role: &'static str) {
        self.role = role;
        if let Ok(mut pb) = self.published.lock() {
            pb.role = role;
        }
    }

    fn main(&mut self) -> anyhow::Result<()> {
        if self.cfg.ha.enabled {
            self.set_role("standby");
            if !self.wait_for_lease()? {
                return Ok(());
            }
        }
        let t0 = StdInstant::now();
        // What the standby ended by its own (store-fed) view is judged
        // again now that this switchd holds the flows.
        self.ended_records.clear();
        self.sync_from_store(true)?;
        // Restored servers were loaded while standing by: their liveness
        // clock starts now, and their next heartbeats keep them live (dead
        // ones restored with flows get a full grace from now).
        let now = self.now();
        self.cp.restart_liveness_clocks(now);
        // No service refuses a connection before the servers have had
        // `dead_after` to be heard from (REGISTER, heartbeats): until then
        // a SYN without a usable server is dropped, and its retransmission
        // may be placed.
        self.cp.allow_refusals_from(now + self.cp.dead_after(now));
        // What the standby's syncs noted is not news.
        self.cp.take_liveness_events();
        self.attach_all()?;
        if self.cfg.ha.claim_vips {
            self.claim_vips();
        }
        self.set_role("active");
        let ms = t0.elapsed().as_secs_f64() * 1e3;
        self.takeover_ms = Some(ms);
        eprintln!(
            "switchd: active (epoch {:#x}); attached to {} interfaces, {} servers and {} flows from the store, in {ms:.1} ms",
            self.epoch,
            self.ifaces.len(),
            self.cp.servers().count(),
            self.restored_flows
        );
        self.serve()
    }

    /// Attaches to every interface. With pins: takes the owner lock first
    /// (the fence: a predecessor still alive, e.g. stepping down for a newer
    /// leader, holds it until it exits; waited for up to 2 s), then replaces
    /// the program of each link the predecessor left pinned in place (no
    /// gap), or attaches and pins a new one. Without: a dead predecessor's
    /// links vanish with its process; one still alive holds the interface,
    /// so retry for a bounded time.
    fn attach_all(&mut self) -> anyhow::Result<()> {
        if let Some(p) = self.pins.as_mut() {
            match p.own_within(Duration::from_secs(2), || SHUTDOWN.load(Ordering::SeqCst)) {
                Ok(true) => p.end_standby(),
                Ok(false) => anyhow::bail!(
                    "the XDP links pinned in {} belong to another switchd that is still running (it holds their owner lock): not attaching",
                    p.dir().display()
                ),
                Err(e) => {
                    eprintln!(
                        "switchd: owner lock on {}: {e}; attaching without pins",
                        p.dir().display()
                    );
                    self.pins = None;
                }
            }
        }
        let ifs: Vec<u32> = self.ifaces.iter().map(|i| i.0).collect();
        let (mut replaced, mut pinned, mut unpinned) = (0, 0, 0);
        for idx in ifs {
            let mut tries = 0;
            loop {
                let r = match self.pins.as_ref() {
                    Some(p) => self.cp.dp.attach_pinned(idx, &p.link_path(idx)),
                    None => self
                        .cp
                        .dp
                        .attach(idx)
                        .map(|()| Attached::New { pinned: false }),
                };
                match r {
                    Ok(Attached::Replaced { .. }) => replaced += 1,
                    Ok(Attached::New { pinned: true }) => pinned += 1,
                    Ok(Attached::New { pinned: false }) => unpinned += 1,
                    Err(e) if tries < 100 && !SHUTDOWN.load(Ordering::SeqCst) => {
                        if tries == 0 {
                            eprintln!("switchd: attach to ifindex {idx} failed ({e}); retrying");
                        }
                        tries += 1;
                        std::thread::sleep(Duration::from_millis(20));
                        continue;
                    }
                    Err(e) => return Err(e.into()),
                }
                break;
            }
        }
        self.links_taken_over = replaced;
        // Every link runs this program now: what the predecessor's changed
        // after the copy, and its owners the store lacks (bpf.rs `adopt`).
        let a = match self.cp.dp.finish_adoption() {
            Ok(a) => a,
            Err(e) => {
                eprintln!("switchd: finishing the adoption of the predecessor's tables: {e}");
                self.cp.dp.adopted()
            }
        };
        if let Some(p) = &self.pins {
            eprintln!(
                "switchd: XDP links in {}: {replaced} taken over in place from the predecessor (no gap), {pinned} new and pinned, {unpinned} not pinned; {} flows newer than the store copied from the predecessor's table ({} of unknown servers or services skipped); {} migration entries copied ({} pending, {} of unknown servers skipped, {} changed there before the switch), {} owners the store lacked sent to it; FINs of {} flows merged, {} closed flows queued for the reaper",
                p.dir().display(),
                a.flows,
                a.flows_skipped,
                a.migrations,
                a.migrations_pending,
                a.migrations_skipped,
                a.settled_late,
                a.owner_events,
                a.fins_merged,
                a.closed
            );
        }
        Ok(())
    }

    /// Standby: campaign every 100 ms, keep the flow table warm. Returns
    /// false on shutdown.
    fn wait_for_lease(&mut self) -> anyhow::Result<bool> {
        let store = self.store.clone().context("HA needs a store")?;
        let ttl = Duration::from_millis(self.cfg.ha.lease_ttl_ms);
        let sync_every = Duration::from_millis(self.cfg.ha.flow_sync_interval_ms);
        let mut next_sync = StdInstant::now();
        eprintln!(
            "switchd: standby as {:?} in election {:?}",
            self.candidate, self.cfg.ha.election
        );
        // Same-box standby: once the active's program has been seen on our
        // interfaces, its disappearance from all of them means the active
        // is gone (a process's bpf_links die with it). Attaching is then
        // safe without waiting for the lease to expire: an XDP link is
        // exclusive per interface, so the interfaces themselves fence a
        // live active out. The lease is still taken before serving HA
        // duties that need it (renewal, fencing token).
        //
        // With pinned links the programs no longer vanish when the active
        // dies (they forward on until replaced): its death shows as its
        // owner lock on the pin directory coming free (the kernel releases
        // a flock with the process), polled every 2 ms. The lock is the
        // fence then: held by the active for its whole life. This standby
        // also marks itself (shared lock), so that an active stopping
        // cleanly hands its links over instead of detaching them.
        let ifs: Vec<u32> = self.ifaces.iter().map(|i| i.0).collect();
        let mut seen_active_program = false;
        let mut seen_owner = false;
        let mut attached = 0;
        if let Some(p) = self.pins.as_mut() {
            if let Err(e) = p.stand_by() {
                eprintln!(
                    "switchd: cannot mark this standby in {} ({e}): an active stopping cleanly will detach instead of handing over",
                    p.dir().display()
                );
            }
        }
        let poll = Duration::from_millis(if self.pins.is_some() { 2 } else { 10 });
        let mut next_campaign = StdInstant::now();
        let mut next_prog_check = StdInstant::now();
        // Bounded by SHUTDOWN or winning; each round sleeps `poll`.
        loop {
            if SHUTDOWN.load(Ordering::SeqCst) {
                return Ok(false);
            }
            if StdInstant::now() >= next_prog_check {
                attached = ifs
                    .iter()
                    .filter(|i| {
                        self.cp
                            .dp
                            .attached_prog_id(**i)
                            .map(|id| id != 0)
                            .unwrap_or(false)
                    })
                    .count();
                seen_active_program |= attached > 0;
                next_prog_check = StdInstant::now() + Duration::from_millis(10);
            }
            // An active without pins (none possible on its side) still
            // shows its death as its programs vanishing.
            let programs_gone = seen_active_program && attached == 0;
            if let Some(p) = self.pins.as_mut() {
                match p.try_own() {
                    Ok(true) if (seen_owner || programs_gone) && self.cfg.ha.fast_takeover => {
                        eprintln!(
                            "switchd: the active's owner lock on {} came free (it is gone): taking over its pinned XDP links before the lease expires",
                            p.dir().display()
                        );
                        self.fast_takeover = true;
                        return Ok(true);
                    }
                    // Nobody was active: not ours to take without the lease.
                    Ok(true) => p.disown(),
                    Ok(false) => seen_owner = true,
                    Err(e) => {
                        eprintln!(
                            "switchd: owner lock on {}: {e}; watching the interfaces instead",
                            p.dir().display()
                        );
                        self.pins = None;
                    }
                }
            } else if programs_gone && self.cfg.ha.fast_takeover {
                eprintln!("switchd: the active's XDP programs are gone from every interface: taking over before the lease expires");
                self.fast_takeover = true;
                return Ok(true);
            }
            if StdInstant::now() < next_campaign {
                std::thread::sleep(poll);
                continue;
            }
            next_campaign = StdInstant::now() + Duration::from_millis(100);
            let won = self.rt.block_on(async {
                tokio::time::timeout(
                    Duration::from_secs(2),
                    store.campaign(&self.cfg.ha.election, &self.candidate, ttl),
                )
                .await
            });
            match won {
                Ok(Ok(Some(lease))) => {
                    eprintln!(
                        "switchd: won election {:?} (term {})",
                        lease.info.election, lease.info.term
                    );
                    self.held_term = Some(lease.info.term);
                    self.set_lease(Some(lease));
                    return Ok(true);
                }
                Ok(Ok(None)) => {
                    // Remember the holder's term: after a fast takeover it
                    // is the dead predecessor, and only a higher term is a
                    // newer leader.
                    let leader = self.rt.block_on(async {
                        tokio::time::timeout(
                            Duration::from_secs(1),
                            store.leader(&self.cfg.ha.election),
                        )
                        .await
                    });
                    if let Ok(Ok(Some(l))) = leader {
                        if l.candidate != self.candidate {
                            self.predecessor_term = Some(l.term);
                        }
                    }
                }
                Ok(Err(e)) => eprintln!("switchd: campaign: {e}"),
                Err(_) => eprintln!("switchd: campaign timed out"),
            }
            if StdInstant::now() >= next_sync {
                if let Err(e) = self.sync_from_store(false) {
                    eprintln!("switchd: standby flow sync: {e:#}");
                }
                self.end_retired(false);
                self.warm_syncs += 1;
                next_sync = StdInstant::now() + sync_every;
                self.publish();
            }
        }
    }

    /// Gratuitous ARP for every VIP on every client-side interface.
    fn claim_vips(&mut self) {
        let mut vips: Vec<Ipv4Addr> = self.cp.services().iter().map(|s| s.vip).collect();
        vips.sort();
        vips.dedup();
        for (idx, role, mac) in &self.ifaces {
            if *role == Role::Client {
                match sys::send_garp(*idx, *mac, &vips) {
                    Ok(n) => self.garp_sent += n as u64,
                    Err(e) => eprintln!("switchd: gratuitous ARP on ifindex {idx}: {e}"),
                }
            }
        }
    }

    /// After a fast takeover: win the lease as soon as it expires (the
    /// dead active cannot renew it). Non-blocking: polled from `serve`.
    fn campaign_in_background(&mut self) {
        let (Some(store), true) = (self.store.clone(), self.lease.is_none()) else {
            return;
        };
        if self.campaign_pending.load(Ordering::SeqCst) {
            return;
        }
        self.campaign_pending.store(true, Ordering::SeqCst);
        let slot = self.won_lease.clone();
        let pending = self.campaign_pending.clone();
        // Fencing reference: the last term we held, or after a fast
        // takeover (no lease yet) the predecessor's term seen as standby.
        let (held_term, newer) = (
            self.held_term.or(self.predecessor_term),
            self.newer_leader.clone(),
        );
        let (election, candidate, ttl) = (
            self.cfg.ha.election.clone(),
            self.candidate.clone(),
            Duration::from_millis(self.cfg.ha.lease_ttl_ms),
        );
        self.rt.spawn(async move {
            match tokio::time::timeout(
                Duration::from_secs(2),
                store.campaign(&election, &candidate, ttl),
            )
            .await
            {
                Ok(Ok(Some(lease))) => {
                    eprintln!(
                        "switchd: won election {:?} (term {})",
                        lease.info.election, lease.info.term
                    );
                    if let Ok(mut s) = slot.lock() {
                        *s = Some(lease);
                    }
                }
                Ok(Ok(None)) => {
                    // Someone holds it. Fencing by term: only a leader newer
                    // than our last lease makes us step down. After a fast
                    // takeover (no lease held yet) the reference is the
                    // predecessor's term: the dead predecessor's lease just
                    // expires, a higher term is a newer leader (another
                    // standby won). Our own name is an orphan lease of a
                    // campaign that timed out: it expires.
                    if let (Some(t), Ok(Ok(Some(l)))) = (
                        held_term,
                        tokio::time::timeout(Duration::from_secs(2), store.leader(&election)).await,
                    ) {
                        if l.term > t && l.candidate != candidate {
                            if let Ok(mut n) = newer.lock() {
                                *n = Some(l);
                            }
                        }
                    }
                }
                Ok(Err(e)) => eprintln!("switchd: campaign: {e}"),
                Err(_) => eprintln!("switchd: campaign timed out"),
            }
            pending.store(false, Ordering::SeqCst);
        });
    }

    /// The stored control-channel seq floors by server. Without them a
    /// takeover still works (floors from the REGISTERs only): an error is
    /// logged, not returned.
    fn read_seq_floors(
        &self,
        store: &Arc<dyn Store>,
    ) -> HashMap<ServerId, capybara_store::SeqFloor> {
        let read = self.rt.block_on(async {
            tokio::time::timeout(Duration::from_secs(2), store.seq_floors()).await
        });
        match read {
            Ok(Ok(floors)) => floors.into_iter().map(|f| (f.server, f)).collect(),
            Ok(Err(e)) => {
                eprintln!(
                    "switchd: store: seq floors: {e}; judging replays by the stored REGISTERs only"
                );
                HashMap::new()
            }
            Err(_) => {
                eprintln!("switchd: store: seq floors: no answer within 2 s; judging replays by the stored REGISTERs only");
                HashMap::new()
            }
        }
    }

    /// Stores each registered server's last accepted control-channel seq
    /// (with its instance id), so that a switch that takes over, or this
    /// one restarted, refuses replays of messages older than
    /// [`SEQ_FLOOR_INTERVAL`] before that. Only the lease holder writes;
    /// writes are max-merged per process, so a late one never lowers a
    /// floor.
    fn write_seq_floors(&mut self) {
        let Some(store) = self.store.clone() else {
            return;
        };
        if self.writes_fenced() {
            return;
        }
        let floors: Vec<capybara_store::SeqFloor> = self
            .peers
            .iter()
            .filter_map(|(id, p)| {
                let instance = self.cp.server(*id)?.reg.instance;
                let f = capybara_store::SeqFloor {
                    server: *id,
                    instance,
                    seq: p.last_seq,
                };
                (instance != 0 && self.floors_written.get(id) != Some(&f)).then_some(f)
            })
            .collect();
        if floors.is_empty() {
            return;
        }
        for f in &floors {
            self.floors_written.insert(f.server, *f);
        }
        self.rt.spawn(async move {
            match tokio::time::timeout(Duration::from_secs(2), store.raise_seq_floors(&floors))
                .await
            {
                Ok(Ok(())) => {}
                Ok(Err(e)) => eprintln!("switchd: store: seq floors: {e}"),
                Err(_) => eprintln!("switchd: store: seq floors: no answer within 2 s"),
            }
        });
    }

    /// Reads servers, services and flows from the store into the (attached
    /// or not) data plane, flows as a delta against what was loaded
    /// before: at start and at a takeover (`active`: also seeds the store
    /// with the config's services never seeded before, `services::seed`),
    /// and periodically on a standby.
    fn sync_from_store(&mut self, active: bool) -> anyhow::Result<()> {
        let Some(store) = self.store.clone() else {
            return Ok(());
        };
        let seed_cfg = &self.cfg;
        let policy_seed = self.policy_seed.clone();
        let (records, servers, services, flows, policy, drains) = self
            .rt
            .block_on(async {
                tokio::time::timeout(Duration::from_secs(5), async {
                    if active {
                        // Drains a previous version kept in the server
                        // records move to `Drain` records before this
                        // switchd writes a record (a REGISTER's would
                        // write liveness over them).
                        let moved = capybara_store::upgrade_legacy_drain_states(store.as_ref()).await?;
                        if !moved.is_empty() {
                            eprintln!("switchd: moved the drains of servers {moved:?} from their server records to drain records");
                        }
                    }
                    // Records before services: a record read is of a delete
                    // the services read then shows (`apply_store_services`).
                    // One that does not decode costs the retiring services,
                    // not the start.
                    let records = match store.list_retiring_services().await {
                        Ok(r) => Some(r),
                        Err(e) => {
                            eprintln!("switchd: store: retiring services: {e}; deleted services' open connections are not restored");
                            None
                        }
                    };
                    let mut services = store.list_services().await?;
                    if active {
                        // Records first, then their marks: a stop between
                        // the two leaves a held record without a mark,
                        // which the next start marks.
                        let seeded = store.seeded_services().await?;
                        let seeding = crate::services::seed(&services, &seeded, seed_cfg);
                        for n in seeding.notes {
                            eprintln!("switchd: {n}");
                        }
                        for s in seeding.put {
                            store.put_service(&s).await?;
                            eprintln!(
                                "switchd: wrote configured service {:?} ({}:{}) to the store",
                                s.name, s.vip, s.port
                            );
                            services.push(s);
                        }
                        store.mark_seeded(&seeding.mark).await?;
                    }
                    // The liveness timing servers were told by the switch
                    // before this one (same store), in force before their
                    // liveness clocks restart; a store without a policy
                    // takes this config's. A failure costs only that: the
                    // poller seeds and reads it again.
                    let policy = if active {
                        match store.put_policy_if_absent(&policy_seed).await {
                            Ok(written) => {
                                if written {
                                    eprintln!("switchd: the store held no policy: wrote the defaults with this config's heartbeat_interval_ms = {} and dead_after_ms = {}", policy_seed.heartbeat_interval_ms, policy_seed.dead_after_ms);
                                }
                                match store.get_policy().await {
                                    Ok(p) => Some(p),
                                    Err(e) => {
                                        eprintln!("switchd: store: reading the policy: {e}");
                                        None
                                    }
                                }
                            }
                            Err(e) => {
                                eprintln!("switchd: store: seeding the policy: {e}");
                                None
                            }
                        }
                    } else {
                        None
                    };
                    let drains: HashMap<ServerId, capybara_store::Drain> = store
                        .list_drains()
                        .await?
                        .into_iter()
                        .map(|d| (d.server, d))
                        .collect();
                    Ok::<_, capybara_store::StoreError>((
                        records,
                        store.list_servers().await?,
                        services,
                        store.scan_flows().await?,
                        policy,
                        drains,
                    ))
                })
                .await
            })
            .context("store did not answer within 5 s")??;
        let floors = self.read_seq_floors(&store);
        let now = self.now();
        if let Some(p) = policy.map(policy_within_bounds) {
            if p.validate().is_ok() {
                self.apply_liveness(now, &p, None);
            }
        }
        // A dead server that still owns stored flows died within its grace
        // at the previous active: restored DEAD with them (after the live
        // ones, whose addresses win), so that it can still come back, and
        // otherwise its flows leave the data plane and the store together.
        let owners: std::collections::HashSet<ServerId> = flows.iter().map(|m| m.server).collect();
        let weights = crate::persist::operator_weights(&servers);
        let mut servers = servers;
        servers.sort_by_key(|s| s.state == ServerState::Dead);
        // The operator's drains: the store's `Drain` records (and drain
        // states a previous version left in server records).
        self.op_drains = op_drains_of(&servers, &drains);
        for s in servers {
            // Known from an earlier sync: follow its record (the active
            // registered it since, and judged any restart), so that a
            // REGISTER after the takeover is judged against it.
            self.cp.follow_instance(s.id, s.instance.unwrap_or(0));
            let seq_floor = crate::persist::restored_seq_floor(&s, floors.get(&s.id));
            if let Some(p) = self.peers.get_mut(&s.id) {
                p.last_seq = p.last_seq.max(seq_floor);
            }
            let dead_with_flows = s.state == ServerState::Dead && owners.contains(&s.id);
            if s.state == ServerState::Dead && !dead_with_flows {
                continue;
            }
            // An operator's drain (running, timed out or completed) keeps
            // the server out of placement here too, until `undrain`; a
            // drained server is restored like a draining one.
            let drained = self.op_drains.contains_key(&s.id);
            if dead_with_flows
                && (self.cp.server(s.id).is_some() || self.cp.server_by_addr(s.data_addr).is_some())
            {
                continue;
            }
            if let Some(known) = self
                .cp
                .server(s.id)
                .filter(|x| x.reg.data_ip == s.data_addr && x.liveness != Liveness::Dead)
            {
                // Known from an earlier sync: follow the record's drain
                // state (a drain or an undrain the active did since).
                if (known.liveness == Liveness::Draining) != drained {
                    self.cp.set_draining(s.id, drained)?;
                }
                continue;
            }
            // Records written before `data_mac` existed carried it in the name.
            let Some(mac) = s
                .data_mac
                .as_deref()
                .or_else(|| {
                    s.name
                        .split_whitespace()
                        .find_map(|t| t.strip_prefix("data_mac="))
                })
                .and_then(sys::parse_mac)
            else {
                eprintln!("switchd: stored server {} has no data_mac in its record; waiting for its REGISTER", s.id);
                continue;
            };
            let (dev, ifindex) = match sys::route_dev(s.data_addr) {
                Ok(r) => r,
                Err(e) => {
                    eprintln!("switchd: stored server {}: {e}", s.id);
                    continue;
                }
            };
            let src_mac = sys::iface_mac(&dev)?;
            let reg = crate::persist::restored_registration(&s, mac, ifindex, src_mac);
            if dead_with_flows {
                if let Err(e) = self.cp.restore_dead(now, &reg) {
                    eprintln!("switchd: stored dead server {}: {e}", s.id);
                    continue;
                }
            } else {
                // The services its REGISTER listed: the pools it joined by
                // them, and how its heartbeats' health bits read.
                self.cp.register_as(now, &reg, &s.services)?;
            }
            if drained {
                self.cp.set_draining(s.id, true)?;
            }
            if let SocketAddr::V4(_) = s.mgmt_addr {
                let p = self
                    .peers
                    .entry(s.id)
                    .or_insert_with(|| new_peer(s.mgmt_addr));
                p.last_seq = p.last_seq.max(seq_floor);
                if !s.services.is_empty() {
                    p.services = s.services.clone();
                }
            }
        }
        // Operator weights (`weight_set`) over the REGISTERs' (restored
        // ones included), before the services build their pools.
        self.apply_operator_weights(weights);
        // Services (and retiring ones) before flows: a stored flow of a
        // service not served would be skipped.
        self.apply_store_services(&services, records.as_deref(), active);
        let fresh: HashMap<FlowKey, ServerId> = flows.iter().map(|m| (m.key, m.server)).collect();
        let changed: Vec<(FlowKey, ServerId)> = fresh
            .iter()
            .filter(|(k, s)| self.warm.get(k) != Some(s))
            .map(|(k, s)| (*k, *s))
            .collect();
        let gone: Vec<FlowKey> = self
            .warm
            .keys()
            .filter(|k| !fresh.contains_key(k))
            .copied()
            .collect();
        let (loaded, _skipped) = self.cp.load_flows(&changed)?;
        self.cp.unload_flows(&gone)?;
        self.restored_flows = fresh.len();
        let _ = loaded;
        self.warm = fresh;
        Ok(())
    }

    fn serve(&mut self) -> anyhow::Result<()> {
        let sock = UdpSocket::bind(self.cfg.control_listen).with_context(|| {
            format!(
                "binding the control channel on {} (config field `control_listen`)",
                self.cfg.control_listen
            )
        })?;
        let load_sock = UdpSocket::bind(SocketAddrV4::new(self.cfg.switch_addr(), 0))
            .context("binding the load-notification socket")?;
        load_sock.set_nonblocking(true)?;
        sock.set_nonblocking(true)?;
        // The servers restored from the store report the connections they
        // hold: the store may be older than the data plane it was written
        // from (a backup). Asked at once, so that they hold resets of
        // connections they do not know before the data plane sends them
        // stale ones (docs/OPERATIONS.md, "Recovery").
        self.request_flow_reports(&sock);
        self.warm.clear();
        self.start_policy_poller();
        self.start_weights_poller();
        let mut next_tick = self.now() + self.cfg.load_interval;
        let mut next_flush = self.now();
        let mut next_status = self.now();
        let mut next_count = self.now();
        let mut next_renew = self.now();
        let mut next_embryonic = self.now();
        let mut next_floors = self.now() + SEQ_FLOOR_INTERVAL;
        let mut next_retire = self.now();
        let mut buf = vec![0u8; 2048];
        // Bounded by SHUTDOWN; each iteration waits at most one interval.
        while !SHUTDOWN.load(Ordering::SeqCst) {
            // A late answer about an earlier lease (renewals overlap) is not
            // about the one held now.
            let lost_id = self.lost_lease_id.load(Ordering::SeqCst);
            if self.lease_lost.swap(false, Ordering::SeqCst)
                && self.lease.as_ref().map(|l| l.info.lease_id) == Some(lost_id)
            {
                // Expired (a store outage longer than the TTL) or taken
                // over. Keep forwarding and placing: the data plane stays
                // up; win the lease back unless a newer leader holds it
                // (the campaign below finds out). Store writes wait.
                self.set_lease(None);
                self.lease_losses += 1;
                eprintln!("switchd: lost the leader lease; serving on, flow writes held, campaigning to win it back");
            }
            // The store refused a flow write: the lease we write under no
            // longer holds (it lapsed, e.g. while this process was paused,
            // or another switchd took over) even if no renewal said so yet.
            if let Some(id) = self.fence.take_refused() {
                self.fence_refusals += 1;
                if self.lease.as_ref().map(|l| l.info.lease_id) == Some(id) {
                    self.set_lease(None);
                    self.lease_losses += 1;
                    eprintln!("switchd: the store refused a flow write: lease {id} no longer holds the election; serving on, flow writes held, campaigning to win it back");
                }
            }
            if let Some(l) = self.newer_leader.lock().ok().and_then(|mut l| l.take()) {
                // Nothing more from us reaches the store: held updates are
                // dropped and the writer is not flushed on the way out.
                self.held.updates.clear();
                self.held_servers.writes.clear();
                self.set_lease(None);
                self.sink = None;
                anyhow::bail!("{}", lease_lost_text(&l.candidate, l.term, self.held_term));
            }
            let now = self.now();
            self.take_policy(&sock);
            self.take_services();
            self.take_weights();
            self.take_drains(&sock);
            let interval = self.cfg.load_interval;
            if now >= next_tick {
                self.ticks += 1;
                let reports = self.cp.tick(now)?;
                self.after_tick(now);
                for r in reports {
                    self.load_seq += 1;
                    let repr = LoadRepr {
                        epoch: self.epoch,
                        sequence: self.load_seq,
                        interval_us: interval.as_micros() as u32,
                        server_id: r.server,
                        own_load: r.own_load,
                        pool_load: r.pool_load,
                        live_servers: r.live_servers,
                        least_loaded: r.least_loaded,
                        weights: r.weights,
                    };
                    let mut b = [0u8; capybara_proto::load::MAX_LEN];
                    let n = repr.emit(&mut b).unwrap_or(0);
                    if n > 0
                        && load_sock
                            .send_to(&b[..n], SocketAddrV4::new(r.data_ip, ports::LOAD))
                            .is_ok()
                    {
                        self.load_sent += 1;
                    }
                }
                next_tick += interval;
                if next_tick < now {
                    self.tick_overruns += 1;
                    next_tick = now + interval;
                }
            }
            if now >= next_flush {
                if self.writes_fenced() {
                    self.cp.flush_events(now, &mut self.held)?;
                } else if let Some(sink) = self.sink.as_mut() {
                    self.cp.flush_events(now, sink)?;
                } else {
                    let mut devnull = crate::control::VecSink::default();
                    self.cp.flush_events(now, &mut devnull)?;
                }
                next_flush = now + Duration::from_millis(2);
            }
            if now >= next_embryonic {
                let ns = crate::embryonic::monotonic_ns();
                let fenced = self.writes_fenced();
                let r = match self.sink.as_mut() {
                    _ if fenced => self.embryonic.tick(&mut self.cp.dp, ns, &mut self.held),
                    Some(sink) => self.embryonic.tick(&mut self.cp.dp, ns, sink),
                    None => {
                        let mut devnull = crate::control::VecSink::default();
                        self.embryonic.tick(&mut self.cp.dp, ns, &mut devnull)
                    }
                };
                if let Err(e) = r {
                    eprintln!("switchd: embryonic flow scan: {e}");
                }
                next_embryonic = now + Duration::from_millis(25);
            }
            if now >= next_count {
                let c = self.cp.dp.table_counts()?;
                self.flow_counts = (c.flows, c.migrations);
                self.counts_exact = c.exact;
                next_count = now
                    + if c.exact {
                        EXACT_COUNT_EVERY
                    } else {
                        WALK_COUNT_EVERY
                    };
                // Published with the counts just taken.
                next_status = now;
            }
            if now >= next_retire {
                self.end_retired(true);
                next_retire = now + Duration::from_millis(250);
            }
            if now >= next_status {
                self.publish();
                next_status = now + Duration::from_millis(200);
            }
            if self.cfg.ha.enabled && self.lease.is_none() && now >= next_renew {
                let won = self.won_lease.lock().ok().and_then(|mut l| l.take());
                if let Some(l) = won {
                    if self.held_term.is_some() {
                        self.lease_regained += 1;
                        eprintln!("switchd: won the leader lease back (term {})", l.info.term);
                    }
                    self.held_term = Some(l.info.term);
                    self.set_lease(Some(l));
                    if let Some(sink) = self.sink.as_mut() {
                        self.held.replay(sink);
                    }
                    let servers: Vec<ServerWrite> = self.held_servers.writes.drain(..).collect();
                    if let (Some(store), false) = (self.store.clone(), servers.is_empty()) {
                        self.rt.spawn(async move {
                            for w in servers {
                                write_server(store.clone(), w).await;
                            }
                        });
                    }
                } else {
                    self.campaign_in_background();
                    next_renew = now + Duration::from_millis(100);
                }
            }
            if self.lease.is_some() && now >= next_renew {
                self.renew_lease();
                next_renew = now + Duration::from_millis(self.cfg.ha.lease_ttl_ms.max(1000) / 4);
            }
            if now >= next_floors {
                self.write_seq_floors();
                next_floors = now + SEQ_FLOOR_INTERVAL;
            }
            while let Ok(cmd) = self.cmd_rx.try_recv() {
                self.command(&sock, cmd);
            }
            // ppoll, not SO_RCVTIMEO: the latter rounds up to jiffies (4 ms
            // at HZ=250), far coarser than the 1 ms pool-monitor interval.
            let wait = next_tick.saturating_since(self.now());
            wait_readable(&sock, wait);
            // Everything queued, without waiting (bounded per round).
            for _ in 0..256 {
                match sock.recv_from(&mut buf) {
                    Ok((n, from)) => {
                        let now = self.now();
                        if let Some(reply) = self.handle_control(now, from, &buf[..n]) {
                            let _ = sock.send_to(&reply, from);
                        }
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                    Err(e) => {
                        eprintln!("switchd: control channel: {e}");
                        break;
                    }
                }
            }
        }
        Ok(())
    }

    /// Liveness side effects of the last tick.
    fn after_tick(&mut self, _now: Instant) {
        self.note_liveness();
        self.note_health();
    }

    /// Logs application-health changes (HEARTBEAT health bits) and the
    /// services that fail open.
    fn note_health(&mut self) {
        for e in self.cp.take_health_events() {
            match e {
                HealthEvent::Backend {
                    id,
                    service,
                    down: true,
                } => eprintln!(
                    "switchd: server {id} reports the application of {service} down: out of {service}'s placement and migration targets (its flows stay)"
                ),
                HealthEvent::Backend {
                    id,
                    service,
                    down: false,
                } => eprintln!(
                    "switchd: server {id} reports the application of {service} up: back in {service}'s placement"
                ),
                HealthEvent::FailOpen { service, on: true } => eprintln!(
                    "switchd: every live server of {service} reports its application down: placement keeps them all (fail open)"
                ),
                HealthEvent::FailOpen { service, on: false } => eprintln!(
                    "switchd: {service} has a server with its application up again: fail open ended"
                ),
                HealthEvent::Refusing { service, on: true } => eprintln!(
                    "switchd: every server of {service} is drained, weighted 0 or dead past its grace: new connections to {service} are refused (reset; counter reset_no_server)"
                ),
                HealthEvent::Refusing { service, on: false } => eprintln!(
                    "switchd: {service} no longer refuses new connections"
                ),
            }
        }
    }

    /// Logs liveness transitions and records them in the store. A dead
    /// server keeps its peer entry (so its heartbeats are heard) while its
    /// flows are kept; once they are removed its next heartbeat is answered
    /// "register first".
    fn note_liveness(&mut self) {
        let grace = self.cfg.dead_flow_grace;
        for e in self.cp.take_liveness_events() {
            match e {
                LivenessEvent::Died {
                    id,
                    flows_kept_until,
                } => {
                    if flows_kept_until.is_some() {
                        eprintln!(
                            "switchd: server {id} missed heartbeats for {:?}: dead, out of placement; its flow entries are kept for {grace:?} (dead_flow_grace_ms) for it to come back",
                            self.cfg.dead_after
                        );
                    } else {
                        eprintln!(
                            "switchd: server {id} missed heartbeats for {:?}: dead, out of placement",
                            self.cfg.dead_after
                        );
                    }
                    self.store_state(id, ServerState::Dead);
                }
                LivenessEvent::Returned {
                    id,
                    dead_for,
                    by_register,
                } => {
                    let how = if by_register {
                        "registered again (same instance)"
                    } else {
                        "heartbeats again"
                    };
                    eprintln!(
                        "switchd: server {id} {how} after {:.0} ms dead, within the grace: back in placement, every flow kept",
                        dead_for.as_secs_f64() * 1e3
                    );
                    // A REGISTER writes the whole record itself. The record
                    // holds liveness only (a drain is its `Drain` record).
                    if !by_register {
                        self.store_state(id, ServerState::Active);
                    }
                }
                LivenessEvent::FlowsRemoved { id, flows, why } => {
                    match why {
                        FlowsRemovedWhy::DeadNoGrace => {
                            eprintln!("switchd: server {id} dead: {flows} flow entries removed")
                        }
                        FlowsRemovedWhy::GraceEnded => eprintln!(
                            "switchd: server {id} did not come back within {grace:?}: {flows} flow entries removed"
                        ),
                        FlowsRemovedWhy::Restarted { old, new } => eprintln!(
                            "switchd: server {id} restarted (instance {old:#018x} -> {new:#018x}): {flows} flow entries of the old process removed"
                        ),
                        FlowsRemovedWhy::AddressReused => eprintln!(
                            "switchd: dead server {id}'s data address registered by another server: {flows} flow entries removed"
                        ),
                        // Logged with its `Stopped` event.
                        FlowsRemovedWhy::Stopped => {}
                    }
                    if matches!(
                        why,
                        FlowsRemovedWhy::DeadNoGrace | FlowsRemovedWhy::GraceEnded
                    ) {
                        self.peers.remove(&id);
                    }
                }
                LivenessEvent::Leaving { id, on: true } => eprintln!(
                    "switchd: server {id} is leaving (its process is stopping): out of placement and migration targets, its flows keep flowing"
                ),
                LivenessEvent::Leaving { id, on: false } => {
                    eprintln!("switchd: server {id} is no longer leaving")
                }
                LivenessEvent::Stopped { id, flows } => {
                    // The entries count closing flows the reaper had not
                    // removed yet: the hostagent logs the connections it
                    // cut (none after a complete stop).
                    eprintln!("switchd: server {id} stopped cleanly: {flows} flow entries removed (closing ones included; its hostagent logs the connections it cut)")
                }
            }
        }
    }

    fn store_state(&mut self, id: ServerId, state: ServerState) {
        self.store_server_write(ServerWrite::State(id, state));
    }

    fn renew_lease(&mut self) {
        let (Some(store), Some(lease)) = (self.store.clone(), self.lease.clone()) else {
            return;
        };
        let lost = self.lease_lost.clone();
        let lost_id = self.lost_lease_id.clone();
        self.rt.spawn(async move {
            match tokio::time::timeout(lease.ttl / 2, store.keep_alive(&lease)).await {
                Ok(Ok(())) => {}
                Ok(Err(capybara_store::StoreError::NotLeader { .. })) => {
                    lost_id.store(lease.info.lease_id, Ordering::SeqCst);
                    lost.store(true, Ordering::SeqCst)
                }
                Ok(Err(e)) => eprintln!("switchd: lease keep-alive: {e}"),
                Err(_) => eprintln!("switchd: lease keep-alive timed out"),
            }
        });
    }

    fn drop_msg(&mut self, reason: &'static str) -> Option<Vec<u8>> {
        *self.drops.entry(reason).or_default() += 1;
        None
    }

    /// The REGISTER_ACK of this switch: the heartbeat interval and
    /// `dead_after` in it are the stored policy's once read (else the
    /// config's).
    fn register_ack(&self) -> RegisterAck {
        RegisterAck {
            switch_epoch: self.epoch,
            load_interval_us: self.cfg.load_interval.as_micros() as u32,
            heartbeat_interval_ms: self.cfg.heartbeat_interval.as_millis() as u32,
            dead_after_ms: self.cfg.dead_after.as_millis() as u32,
            last_migration_id: None,
        }
    }

    /// [`Self::register_ack`] for server `id`: with the last migration id
    /// the data plane saw from its data address (0: none) when its REGISTER
    /// asked for it. A restarted hostagent numbers its migrations above it:
    /// this program's PREPARE steering memory and the targets may still
    /// hold the previous process's ids (docs/MIGRATION.md, "Roles and messages").
    fn register_ack_for(&mut self, id: ServerId) -> RegisterAck {
        let mut ack = self.register_ack();
        if let Some(addr) = self.peers.get(&id).and_then(|p| p.last_id_of) {
            let last = self.cp.dp.last_migration_id(addr).unwrap_or_else(|e| {
                eprintln!("switchd: server {id}: reading its last migration id: {e}");
                None
            });
            ack.last_migration_id = Some(last.unwrap_or(0));
        }
        ack
    }

    /// Applies the liveness timing of a (bounded) stored policy: the
    /// heartbeat interval goes into every REGISTER_ACK, and on a change to
    /// every registered server at once (a hostagent takes a REGISTER_ACK at
    /// any time and restarts its heartbeat tick with it) and again on two
    /// of its heartbeats, at least the longer of the two intervals apart,
    /// in case one is lost; `dead_after` goes to the control plane, which
    /// holds a lowered one off for two periods of the previous value
    /// (`ControlPlane::set_dead_after`): a server still beating at the old
    /// interval is not declared dead.
    fn apply_liveness(
        &mut self,
        now: Instant,
        p: &capybara_store::Policy,
        sock: Option<&UdpSocket>,
    ) {
        let hb = Duration::from_millis(p.heartbeat_interval_ms);
        let dead = Duration::from_millis(p.dead_after_ms);
        let old_hb = self.cfg.heartbeat_interval;
        if hb == old_hb && dead == self.cfg.dead_after {
            return;
        }
        self.cfg.heartbeat_interval = hb;
        self.cfg.dead_after = dead;
        let until = self.cp.set_dead_after(now, dead);
        let held = if until > now {
            format!(
                " ({:?} holds for another {:?}: servers may still beat at {old_hb:?})",
                self.cp.dead_after(now),
                until.saturating_since(now)
            )
        } else {
            String::new()
        };
        eprintln!(
            "switchd: liveness from the store's policy: heartbeat interval {hb:?}, dead after {dead:?}{held}"
        );
        if hb == old_hb {
            return;
        }
        let spacing = old_hb.max(hb);
        let peers: Vec<(ServerId, SocketAddr)> =
            self.peers.iter().map(|(id, p)| (*id, p.mgmt)).collect();
        for (id, mgmt) in peers {
            if let Some(p) = self.peers.get_mut(&id) {
                p.ack_resends = 2;
                p.ack_resend_at = now + spacing;
            }
            let ack = self.register_ack_for(id);
            if let (Some(sock), Some(m)) = (sock, self.reply(id, ControlBody::RegisterAck(ack))) {
                if sock.send_to(&m, mgmt).is_ok() {
                    self.register_acks_resent += 1;
                }
            }
        }
    }

    fn reply(&mut self, id: ServerId, body: ControlBody<'_>) -> Option<Vec<u8>> {
        self.seq += 1;
        let repr = ControlRepr {
            server_id: id,
            seq: self.seq,
            body,
        };
        let mut out = vec![0u8; repr.buffer_len()];
        repr.emit_with_mac(&mut out, &self.key).ok()?;
        Some(out)
    }

    fn error_reply(
        &mut self,
        id: ServerId,
        code: ErrorCode,
        kind: ControlKind,
        seq: u64,
        text: &str,
    ) -> Option<Vec<u8>> {
        let text = &text[..text.len().min(ctl::MAX_ERROR_TEXT)];
        self.reply(
            id,
            ControlBody::Error(ErrorMsg {
                code,
                ref_kind: kind.to_u8(),
                ref_seq: seq,
                text,
            }),
        )
    }

    /// One control datagram. Returns the reply, if any.
    fn handle_control(&mut self, now: Instant, from: SocketAddr, bytes: &[u8]) -> Option<Vec<u8>> {
        let repr = match ControlRepr::parse_verified(bytes, &self.key) {
            Ok(r) => r,
            Err(e) => {
                return self.drop_msg(match e {
                    WireError::BadMac => "bad_mac",
                    WireError::UnsupportedVersion { .. } => "unknown_version",
                    WireError::BadMagic { .. } => "bad_magic",
                    WireError::UnknownKind { .. } => "unknown_kind",
                    WireError::Truncated { .. } | WireError::LengthMismatch { .. } => "truncated",
                    _ => "malformed",
                })
            }
        };
        let id = repr.server_id;
        let kind = repr.body.kind();
        // Replays: every sender's seq strictly increases, except that a
        // REGISTER starts a new sequence (a restarted server).
        if kind != ControlKind::Register {
            match self.peers.get(&id) {
                Some(p) if repr.seq <= p.last_seq => return self.drop_msg("replay"),
                Some(_) => {}
                None => {
                    *self.drops.entry("not_registered").or_default() += 1;
                    if matches!(
                        kind,
                        ControlKind::Heartbeat | ControlKind::SetOwner | ControlKind::Flows
                    ) {
                        return self.error_reply(
                            id,
                            ErrorCode::NotRegistered,
                            kind,
                            repr.seq,
                            "register first",
                        );
                    }
                    return None;
                }
            }
        }
        *self.accepted.entry(kind_name(kind)).or_default() += 1;
        match repr.body {
            ControlBody::Register(r) => {
                // A REGISTER with an instance id comes from a hostagent whose
                // seqs continue across restarts (clock-based): one whose seq
                // is not above the last heard from this server is a replay,
                // and an old process's REGISTER replayed must not pass for a
                // restart (which drops the server's flows).
                if r.instance != 0 && self.peers.get(&id).is_some_and(|p| repr.seq <= p.last_seq) {
                    return self.drop_msg("replay");
                }
                if id.0 == 0 {
                    return self.error_reply(
                        id,
                        ErrorCode::BadRequest,
                        kind,
                        repr.seq,
                        "server id 0 is reserved",
                    );
                }
                let (dev, ifindex) = match sys::route_dev(r.data_addr) {
                    Ok(x) => x,
                    Err(e) => {
                        return self.error_reply(
                            id,
                            ErrorCode::BadRequest,
                            kind,
                            repr.seq,
                            &format!("data address: {e}"),
                        )
                    }
                };
                if !self
                    .ifaces
                    .iter()
                    .any(|(i, role, _)| *i == ifindex && *role == Role::Server)
                {
                    let t = format!(
                        "data address {} is routed via {dev}, not a server-side interface",
                        r.data_addr
                    );
                    return self.error_reply(id, ErrorCode::BadRequest, kind, repr.seq, &t);
                }
                let src_mac = self
                    .ifaces
                    .iter()
                    .find(|(i, _, _)| *i == ifindex)
                    .map(|x| x.2)
                    .unwrap_or_default();
                let wanted: Vec<SocketAddrV4> = r.services.iter().collect();
                let reg = Registration {
                    id,
                    data_ip: r.data_addr,
                    mac: r.data_mac,
                    ifindex,
                    src_mac,
                    weight: u32::from(r.weight).max(1),
                    instance: r.instance,
                };
                // A server the API deleted after its drain, started again:
                // the drain went with the deletion (the API lists it
                // `active`; switchd kept it out of placement until an
                // undrain).
                let fresh = self
                    .cp
                    .server(id)
                    .is_none_or(|s| s.reg.instance != r.instance);
                if fresh && self.deleted_drained.remove(&id) && self.op_drains.remove(&id).is_some()
                {
                    if let Err(e) = self.cp.set_draining(id, false) {
                        eprintln!(
                            "switchd: server {id}: lifting the drain of its deleted record: {e}"
                        );
                    }
                    eprintln!("switchd: server {id} registers again after the API deleted it: the drain it had no longer holds");
                }
                // A restarted process (or one back after dying) of a server
                // the operator drained stays out of placement: the drain
                // is the operator's, not the process's (before, the REGISTER
                // placed it again while the API said `drained`).
                let was_draining = self.cp.server(id).is_some_and(|s| s.draining())
                    || self.op_drains.contains_key(&id);
                let mut registered = self.cp.register_as(now, &reg, &wanted);
                if let (Ok(n), true) = (&registered, was_draining) {
                    let n = *n;
                    registered = self.cp.set_draining(id, true).map(|()| n);
                }
                self.note_liveness();
                if let Err(e) = registered {
                    let code = if matches!(e, crate::control::ControlError::AddressInUse { .. }) {
                        ErrorCode::IdConflict
                    } else {
                        ErrorCode::Internal
                    };
                    return self.error_reply(id, code, kind, repr.seq, &e.to_string());
                }
                let mut peer = new_peer(from);
                peer.last_seq = repr.seq;
                peer.services = wanted.clone();
                peer.last_id_of = r.reads_last_id.then_some(r.data_addr);
                // Its drain still runs: the process may not know (a new
                // one does not), so DRAIN goes again with the time left,
                // answering its heartbeats until their flag says draining.
                peer.pending_drain = drain_to_resend(
                    self.op_drains.get(&id).copied(),
                    capybara_store::unix_ms_now(),
                )
                .map(|left_ms| (left_ms, false, 10));
                // It reports its connections after the REGISTER_ACK.
                peer.flow_request_at = now + FLOW_REQUEST_AFTER_REGISTER;
                self.peers.insert(id, peer);
                eprintln!(
                    "switchd: registered {id}: data {} mac {} via {dev}, weight {}, instance {:#018x}",
                    r.data_addr,
                    sys::format_mac(&r.data_mac),
                    r.weight,
                    r.instance
                );
                if self.store.is_some() {
                    let rec = crate::persist::server_record(&reg, from, repr.seq, &wanted);
                    self.store_server_write(ServerWrite::Put(rec));
                }
                let ack = self.register_ack_for(id);
                if let Some(last) = ack.last_migration_id.filter(|&l| l != 0) {
                    eprintln!(
                        "switchd: server {id}: last migration id seen from {}: {last:#018x} (told in REGISTER_ACK)",
                        r.data_addr
                    );
                }
                self.reply(id, ControlBody::RegisterAck(ack))
            }
            ControlBody::Heartbeat(h) if h.flags & ctl::HEARTBEAT_STOPPED != 0 => {
                // Its last heartbeats: the process exits now. Dead at once
                // (the repeats find it so and change nothing); its next
                // REGISTER, a new instance, places it again. The peer stays
                // so that the repeats are not answered "register first".
                if let Some(p) = self.peers.get_mut(&id) {
                    p.last_seq = repr.seq;
                }
                match self.cp.stopped(now, id) {
                    Ok(Some(_)) => {
                        // Its last heartbeat's figures are the process's,
                        // which is gone: nothing is served there now.
                        if let Some(p) = self.peers.get_mut(&id) {
                            p.connections = 0;
                            p.load_pps = 0;
                            p.migrations_in_flight = 0;
                            p.rx_backlog_bytes = 0;
                        }
                        self.note_liveness();
                        self.store_state(id, ServerState::Dead);
                    }
                    Ok(None) => {}
                    Err(e) => eprintln!("switchd: server {id} stopped: {e}"),
                }
                None
            }
            ControlBody::Heartbeat(h) => {
                let alive = self.cp.heartbeat(now, id).is_ok()
                    && self
                        .cp
                        .server(id)
                        .is_some_and(|s| s.liveness != Liveness::Dead);
                self.note_liveness();
                if !alive {
                    // Dead and its flows gone: only a REGISTER brings it back.
                    self.peers.remove(&id);
                    return self.error_reply(
                        id,
                        ErrorCode::NotRegistered,
                        kind,
                        repr.seq,
                        "register first",
                    );
                }
                // Application health: the services of the REGISTER list
                // whose bit is set (none without the HEALTH flag: an older
                // hostagent, or checks switched off).
                let down: Vec<SocketAddrV4> = self.peers.get(&id).map_or(Vec::new(), |p| {
                    p.services
                        .iter()
                        .enumerate()
                        .filter(|(i, _)| h.backend_down(*i))
                        .map(|(_, s)| *s)
                        .collect()
                });
                if let Err(e) = self
                    .cp
                    .set_backend_health(now, id, h.reports_health(), &down)
                {
                    eprintln!("switchd: server {id}: applying its health report: {e}");
                }
                self.note_health();
                // Its process is stopping (or, a successor switchd learns,
                // still is): out of placement and targets, not a drain.
                let leaving = h.flags & ctl::HEARTBEAT_LEAVING != 0;
                if let Err(e) = self.cp.set_leaving(id, leaving) {
                    eprintln!("switchd: server {id}: applying its LEAVING flag: {e}");
                }
                self.note_liveness();
                let mut resend = None;
                let mut resend_ack = false;
                let ack_spacing = self.cfg.heartbeat_interval;
                let stale_policy = h.policy_generation != self.policy_msg.generation;
                if let Some(p) = self.peers.get_mut(&id) {
                    if p.ack_resends > 0 && now >= p.ack_resend_at {
                        p.ack_resends -= 1;
                        p.ack_resend_at = now + ack_spacing.max(Duration::from_millis(10));
                        resend_ack = true;
                    }
                    p.last_seq = repr.seq;
                    p.mgmt = from;
                    p.connections = h.connections;
                    p.migrations_in_flight = h.migrations_in_flight;
                    p.load_pps = h.load_pps;
                    p.rx_backlog_bytes = h.rx_backlog_bytes;
                    p.policy_generation = h.policy_generation;
                    p.draining_acked = h.flags & ctl::HEARTBEAT_DRAINING != 0;
                    if let Some((deadline, cancel, left)) = p.pending_drain {
                        if p.draining_acked != cancel || left == 0 {
                            p.pending_drain = None;
                        } else {
                            p.pending_drain = Some((deadline, cancel, left - 1));
                            resend = Some((deadline, cancel));
                        }
                    }
                }
                if let Some((deadline_ms, cancel)) = resend {
                    let flags = if cancel { ctl::DRAIN_CANCEL } else { 0 };
                    return self.reply(id, ControlBody::Drain(ctl::Drain { deadline_ms, flags }));
                }
                if resend_ack {
                    // The heartbeat interval changed: in case the
                    // REGISTER_ACK sent then was lost.
                    self.register_acks_resent += 1;
                    let ack = self.register_ack_for(id);
                    return self.reply(id, ControlBody::RegisterAck(ack));
                }
                if stale_policy {
                    // Lost, replayed, or from before a takeover: resend.
                    self.policy_sent += 1;
                    return self.reply(id, ControlBody::Policy(self.policy_msg));
                }
                if let Some(p) = self.peers.get_mut(&id).filter(|p| {
                    !p.flows_reported && p.flow_requests_left > 0 && now >= p.flow_request_at
                }) {
                    // No complete FLOWS report yet: ask for one.
                    p.flow_requests_left -= 1;
                    p.flow_request_at = now + Duration::from_secs(1);
                    self.flow_requests_sent += 1;
                    return self.reply(id, ControlBody::FlowsAck(ctl::FlowsAck::request()));
                }
                None
            }
            ControlBody::Flows(f) => {
                if let Some(p) = self.peers.get_mut(&id) {
                    p.last_seq = repr.seq;
                }
                self.take_flows(now, id, f)
            }
            ControlBody::SetOwner(s) => {
                if let Some(p) = self.peers.get_mut(&id) {
                    p.last_seq = repr.seq;
                }
                let owner = match self.cp.server_by_addr(s.owner) {
                    Some(o) => o.reg.id,
                    None => {
                        return self.error_reply(
                            id,
                            ErrorCode::BadRequest,
                            kind,
                            repr.seq,
                            "owner is not a registered data address",
                        )
                    }
                };
                match self.cp.set_owner(id, s.flow, owner) {
                    Ok(()) => None,
                    Err(e) => {
                        *self.drops.entry("set_owner_refused").or_default() += 1;
                        self.error_reply(id, ErrorCode::UnknownFlow, kind, repr.seq, &e.to_string())
                    }
                }
            }
            ControlBody::MigrationReport(list) => {
                if let Some(p) = self.peers.get_mut(&id) {
                    p.last_seq = repr.seq;
                }
                self.take_reports(id, list);
                None
            }
            ControlBody::Error(e) => {
                if let Some(p) = self.peers.get_mut(&id) {
                    p.last_seq = repr.seq;
                }
                eprintln!(
                    "switchd: {id} reports error {:?} for kind {} seq {}: {}",
                    e.code, e.ref_kind, e.ref_seq, e.text
                );
                None
            }
            // Switch -> server kinds arriving at the switch.
            ControlBody::RegisterAck(_)
            | ControlBody::Drain(_)
            | ControlBody::Migrate(_)
            | ControlBody::Policy(_)
            | ControlBody::FlowsAck(_) => self.drop_msg("unexpected_kind"),
        }
    }

    /// A FLOWS batch from `id`: each claim judged by the control plane
    /// (`ControlPlane::claim_flow`: the data plane and, through flow
    /// events, the store follow), then acknowledged (FLOWS_ACK with the
    /// numbers). A batch the control plane cannot take (the sender is not
    /// a live server, a data-plane failure) is acknowledged REFUSED and
    /// counted (`control_drops.flows_refused`); a malformed one never gets
    /// here (`control_drops.malformed`, not acknowledged: sent again).
    fn take_flows(&mut self, now: Instant, id: ServerId, f: ctl::Flows<'_>) -> Option<Vec<u8>> {
        let (mut applied, mut skipped) = (0u16, 0u16);
        let mut refused = None;
        for c in f.claims.iter() {
            match self.cp.claim_flow(now, id, &c) {
                Ok(crate::control::ClaimOutcome::Applied) => applied += 1,
                Ok(crate::control::ClaimOutcome::Agreed) => {}
                Ok(_) => skipped += 1,
                Err(e) => {
                    refused = Some(e);
                    break;
                }
            }
        }
        self.flow_batches += 1;
        if let Some(e) = &refused {
            *self.drops.entry("flows_refused").or_default() += 1;
            eprintln!(
                "switchd: {id}: FLOWS batch {} of report {} refused: {e}",
                f.batch, f.report_id
            );
        }
        if let Some(p) = self.peers.get_mut(&id) {
            let c = &mut p.flow_claims;
            c.0 += f.claims.len() as u64;
            c.1 += u64::from(applied);
            c.2 += u64::from(skipped);
            if f.flags & ctl::FLOWS_LAST != 0 && refused.is_none() {
                let was = p.flows_reported;
                p.flows_reported = true;
                if !was {
                    eprintln!(
                        "switchd: {id} reported its connections (FLOWS report {}, {} batches): {} claims, {} applied, {} skipped",
                        f.report_id,
                        u32::from(f.batch) + 1,
                        c.0,
                        c.1,
                        c.2
                    );
                }
                p.flow_claims = (0, 0, 0);
            }
        }
        let flags = if refused.is_some() {
            ctl::FLOWS_REFUSED
        } else {
            0
        };
        self.reply(
            id,
            ControlBody::FlowsAck(ctl::FlowsAck {
                report_id: f.report_id,
                batch: f.batch,
                flags,
                applied,
                skipped,
            }),
        )
    }

    /// Asks every known server that has not reported its connections for a
    /// FLOWS report (FLOWS_ACK with REQUEST), at its management address.
    fn request_flow_reports(&mut self, sock: &UdpSocket) {
        let ids: Vec<(ServerId, SocketAddr)> = self
            .peers
            .iter()
            .filter(|(_, p)| !p.flows_reported)
            .map(|(id, p)| (*id, p.mgmt))
            .collect();
        for (id, mgmt) in ids {
            if let Some(m) = self.reply(id, ControlBody::FlowsAck(ctl::FlowsAck::request())) {
                if sock.send_to(&m, mgmt).is_ok() {
                    self.flow_requests_sent += 1;
                }
            }
        }
    }

    /// MIGRATION_REPORT from `id`: each report goes to the ring `GET
    /// /migrations` serves. An origin report must come from the origin its
    /// migration id names (the id's high 32 bits are the origin's data
    /// address); others are counted (`report_mismatch`) and dropped.
    fn take_reports(&mut self, id: ServerId, list: ctl::ReportList<'_>) {
        let reporter_addr = self.cp.server(id).map(|s| s.reg.data_ip);
        let now_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0);
        let mut mismatched = 0u64;
        let Ok(mut pb) = self.published.lock() else {
            return;
        };
        for r in list.iter() {
            let origin_addr = Ipv4Addr::from((r.id >> 32) as u32);
            if r.outcome.is_origin() && reporter_addr != Some(origin_addr) {
                mismatched += 1;
                continue;
            }
            let peer = r
                .peer
                .and_then(|a| self.cp.server_by_addr(a))
                .map(|s| s.reg.id);
            let finished = now_ms.saturating_sub(u64::from(r.age_us) / 1000);
            pb.migrations.push(id, peer, r, finished);
        }
        drop(pb);
        if mismatched > 0 {
            *self.drops.entry("report_mismatch").or_default() += mismatched;
        }
    }

    /// Polls the store's services and policy every 250 ms on the store
    /// runtime (a change applies within a second, never waiting on the
    /// control thread).
    fn start_policy_poller(&mut self) {
        let Some(store) = self.store.clone() else {
            return;
        };
        let slot = self.policy_slot.clone();
        let services_slot = self.services_slot.clone();
        let resync = self.records_resync.clone();
        let seed = self.policy_seed.clone();
        self.rt.spawn(async move {
            let mut last: Option<capybara_store::Policy> = None;
            // Until the seed is written or found (normally at the start,
            // `sync_from_store`), the policy is not read: `get_policy`
            // answers the defaults for an absent one, whose liveness timing
            // is not this config's.
            let mut seeded = false;
            let mut last_services: Option<StoredServices> = None;
            let mut last_records_error = String::new();
            while !SHUTDOWN.load(Ordering::SeqCst) {
                // Records first (see `apply_store_services`).
                let records = match tokio::time::timeout(
                    Duration::from_secs(2),
                    store.list_retiring_services(),
                )
                .await
                {
                    Ok(Ok(r)) => {
                        last_records_error.clear();
                        Some(r)
                    }
                    Ok(Err(e)) => {
                        let e = e.to_string();
                        if e != last_records_error {
                            eprintln!("switchd: store: reading the retiring services: {e}");
                            last_records_error = e;
                        }
                        None
                    }
                    Err(_) => None,
                };
                match tokio::time::timeout(Duration::from_secs(2), store.list_services()).await {
                    Ok(Ok(s)) => {
                        let read = (s, records);
                        if last_services.as_ref() != Some(&read)
                            || resync.swap(false, Ordering::SeqCst)
                        {
                            last_services = Some(read.clone());
                            if let Ok(mut slot) = services_slot.lock() {
                                *slot = Some(read);
                            }
                        }
                    }
                    Ok(Err(e)) => eprintln!("switchd: store: reading the services: {e}"),
                    Err(_) => eprintln!("switchd: store: reading the services timed out"),
                }
                if !seeded {
                    match tokio::time::timeout(Duration::from_secs(2), store.put_policy_if_absent(&seed)).await {
                        Ok(Ok(written)) => {
                            seeded = true;
                            if written {
                                eprintln!("switchd: the store held no policy: wrote the defaults with this config's heartbeat_interval_ms = {} and dead_after_ms = {}", seed.heartbeat_interval_ms, seed.dead_after_ms);
                            }
                        }
                        Ok(Err(e)) => eprintln!("switchd: store: seeding the policy: {e}"),
                        Err(_) => eprintln!("switchd: store: seeding the policy timed out"),
                    }
                }
                let read = if seeded {
                    Some(tokio::time::timeout(Duration::from_secs(2), store.get_policy()).await)
                } else {
                    None
                };
                match read {
                    Some(Ok(Ok(p))) if last.as_ref() != Some(&p) => {
                        last = Some(p.clone());
                        if let Ok(mut s) = slot.lock() {
                            *s = Some(p);
                        }
                    }
                    None | Some(Ok(Ok(_))) => {}
                    Some(Ok(Err(e))) => eprintln!("switchd: store: reading the policy: {e}"),
                    Some(Err(_)) => eprintln!("switchd: store: reading the policy timed out"),
                }
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        });
    }

    /// Reads the operator weights of the store's server records every
    /// 250 ms (as the services: a `ctl weight` applies within a second);
    /// hands over only a change.
    fn start_weights_poller(&mut self) {
        let Some(store) = self.store.clone() else {
            return;
        };
        let slot = self.weights_slot.clone();
        let drains_slot = self.drains_slot.clone();
        let drain_cmds = self.drain_cmds.clone();
        self.rt.spawn(async move {
            let mut last: Option<BTreeMap<ServerId, u32>> = None;
            let mut last_error = String::new();
            while !SHUTDOWN.load(Ordering::SeqCst) {
                // Before the reads: a drain command applied after this
                // count may have a record these reads do not show.
                let cmds_before = drain_cmds.load(Ordering::SeqCst);
                match tokio::time::timeout(Duration::from_secs(2), store.list_servers()).await {
                    Ok(Ok(servers)) => {
                        last_error.clear();
                        let w = crate::persist::operator_weights(&servers);
                        if last.as_ref() != Some(&w) {
                            last = Some(w.clone());
                            if let Ok(mut s) = slot.lock() {
                                *s = Some(w);
                            }
                        }
                        // The drains, handed over at every read (the
                        // control thread skips a read a command overtook).
                        if let Ok(Ok(drains)) =
                            tokio::time::timeout(Duration::from_secs(2), store.list_drains()).await
                        {
                            let drains: HashMap<ServerId, capybara_store::Drain> =
                                drains.into_iter().map(|d| (d.server, d)).collect();
                            let held = op_drains_of(&servers, &drains);
                            let recorded = servers
                                .iter()
                                .filter(|s| drains.contains_key(&s.id))
                                .map(|s| s.id)
                                .collect();
                            let all = servers.iter().map(|s| s.id).collect();
                            if let Ok(mut s) = drains_slot.lock() {
                                *s = Some(StoredDrains {
                                    cmds_before,
                                    held,
                                    recorded,
                                    servers: all,
                                });
                            }
                        }
                    }
                    Ok(Err(e)) => {
                        let e = e.to_string();
                        if e != last_error {
                            eprintln!("switchd: store: reading the server weights: {e}");
                            last_error = e;
                        }
                    }
                    Err(_) => {}
                }
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        });
    }

    /// Follows the operator's drains the poller read from the store (the
    /// API records a drain or an undrain before it asks switchd over HTTP,
    /// and the request may never arrive: switchd unreachable or slow for a
    /// moment, the API stopped in between, a timeout after the send):
    /// a drain the API ended (completed, timed out) keeps its server out of
    /// placement but is no longer sent to a hostagent that registers; a
    /// drain switchd was not told of takes its server out of placement and
    /// is sent to its hostagent; an undrain it was not told of puts the
    /// server back. A read that a drain command overtook is skipped (the
    /// next one, 250 ms later, is not).
    fn take_drains(&mut self, sock: &UdpSocket) {
        let Some(stored) = self.drains_slot.try_lock().ok().and_then(|mut s| s.take()) else {
            return;
        };
        if stored.cmds_before != self.drain_cmds.load(Ordering::SeqCst) {
            return;
        }
        // A drained server the API deleted: its drain holds while its
        // hostagent runs, not for a new instance that registers later.
        self.deleted_drained = self
            .op_drains
            .keys()
            .filter(|id| !stored.servers.contains(id))
            .copied()
            .collect();
        let now_ms = capybara_store::unix_ms_now();
        for change in follow_stored_drains(&mut self.op_drains, &stored.held, &stored.recorded) {
            match change {
                StoredDrainChange::Ended(id) => eprintln!("switchd: the drain of {id} is over (the store says so): it stays out of placement until undrain; a hostagent that registers is not sent DRAIN again"),
                StoredDrainChange::Started(id, deadline) => {
                    let resend = drain_to_resend(Some(deadline), now_ms);
                    eprintln!(
                        "switchd: the store holds a drain of {id} this switchd was not told of (the API's request did not arrive): out of placement now{}",
                        match resend {
                            Some(ms) => format!(", DRAIN sent with {ms} ms left"),
                            None => ", its drain is over (nothing sent)".to_string(),
                        }
                    );
                    self.drain_now(sock, id, resend, false);
                }
                StoredDrainChange::Lifted(id) => {
                    eprintln!("switchd: the store no longer holds the drain of {id} (an undrain this switchd was not told of): back in placement");
                    self.drain_now(sock, id, Some(0), true);
                }
            }
        }
    }

    /// Applies a drain (or, `cancel`, an undrain) to the data plane and
    /// sends DRAIN to the server's hostagent (`deadline_ms`; `None`: a drain
    /// that is over, nothing to send), resent with heartbeats until its
    /// flag agrees. A server not registered (yet) is placed as its drain
    /// says when it registers.
    fn drain_now(
        &mut self,
        sock: &UdpSocket,
        server: ServerId,
        deadline_ms: Option<u32>,
        cancel: bool,
    ) {
        match self.cp.set_draining(server, !cancel) {
            Ok(()) => {}
            Err(crate::control::ControlError::UnknownServer(_)) => return,
            Err(e) => {
                eprintln!("switchd: drain {server}: {e}");
                return;
            }
        }
        let (Some(deadline_ms), Some(mgmt)) =
            (deadline_ms, self.peers.get(&server).map(|p| p.mgmt))
        else {
            return;
        };
        let flags = if cancel { ctl::DRAIN_CANCEL } else { 0 };
        if let Some(msg) = self.reply(
            server,
            ControlBody::Drain(ctl::Drain { deadline_ms, flags }),
        ) {
            let _ = sock.send_to(&msg, mgmt);
        }
        if let Some(p) = self.peers.get_mut(&server) {
            p.pending_drain = Some((deadline_ms, cancel, 10));
        }
    }

    /// Applies the operator weights the poller read.
    fn take_weights(&mut self) {
        let Some(w) = self.weights_slot.try_lock().ok().and_then(|mut s| s.take()) else {
            return;
        };
        self.apply_operator_weights(w);
    }

    /// Makes `weights` the operator weights in force (placement rebuilt
    /// when they change), logging each change.
    fn apply_operator_weights(&mut self, weights: BTreeMap<ServerId, u32>) {
        let old = self.cp.operator_weights().clone();
        let changes: Vec<String> = weights
            .iter()
            .filter(|(id, w)| old.get(id) != Some(w))
            .map(|(id, w)| format!("{id} -> {w}"))
            .chain(
                old.keys()
                    .filter(|id| !weights.contains_key(id))
                    .map(|id| format!("{id} -> its REGISTER's")),
            )
            .collect();
        let zero = weights.values().any(|w| *w == 0) && changes.iter().any(|c| c.ends_with("-> 0"));
        match self.cp.set_operator_weights(weights) {
            Ok(true) => eprintln!(
                "switchd: operator weights from the store: {}{}",
                changes.join(", "),
                if zero { " (0: no new connections)" } else { "" }
            ),
            Ok(false) => {}
            Err(e) => eprintln!("switchd: applying the store's server weights: {e}"),
        }
    }

    /// Applies the services the poller read.
    fn take_services(&mut self) {
        let Some((list, records)) = self
            .services_slot
            .try_lock()
            .ok()
            .and_then(|mut s| s.take())
        else {
            return;
        };
        self.apply_store_services(&list, records.as_deref(), true);
    }

    /// Serves exactly the store's services (`crate::services`), and keeps
    /// serving, as retiring, the deleted ones the store records as
    /// retiring (`records`, read before `stored`, so a record's service is
    /// absent from `stored` unless it was created again since) that this
    /// switchd does not know (restart, takeover, a delete it did not see),
    /// with the retire clock counted from the delete. `active`: flows of a
    /// removed service are reported closed and records of services gone
    /// are forgotten (a standby writes nothing). Announces new VIPs when
    /// configured to claim them.
    fn apply_store_services(
        &mut self,
        stored: &[capybara_store::Service],
        records: Option<&[capybara_store::RetiringService]>,
        active: bool,
    ) {
        let global = match self.policy.placement {
            capybara_store::Placement::Maglev => crate::control::Placement::Maglev,
            capybara_store::Placement::Lwrr => crate::control::Placement::Lwrr,
        };
        let specs = crate::services::store_specs(stored, &self.cfg, global);
        let now = self.now();
        let ch = match self.cp.apply_services(now, &specs, active) {
            Ok(ch) => ch,
            Err(e) => {
                eprintln!("switchd: applying the store's services: {e}");
                // What it serves stays; the rest was not applied.
                let why = format!("the data plane did not take the change: {e}");
                self.refused_services =
                    crate::services::refused(&specs, self.cp.services(), |_| Some(why.clone()));
                return;
            }
        };
        self.refused_services =
            crate::services::refused(&specs, self.cp.services(), |name| ch.why_rejected(name));
        let role = if active { "" } else { " (standby)" };
        for name in &ch.added {
            if let Some(s) = self
                .cp
                .services()
                .iter()
                .find(|s| &s.name == name && s.retiring.is_none())
            {
                eprintln!(
                    "switchd{role}: serving service {name:?} at {}:{} ({} pool members{})",
                    s.vip,
                    s.port,
                    s.pool.len(),
                    if s.open { ", open pool" } else { "" }
                );
            }
        }
        for name in &ch.updated {
            eprintln!("switchd{role}: service {name:?} updated from the store");
        }
        for (name, flows) in &ch.removed {
            eprintln!("switchd{role}: service {name:?} removed (not in the store); {flows} flow entries removed with it");
        }
        for name in &ch.retiring {
            eprintln!(
                "switchd{role}: service {name:?} deleted from the store: retiring (no new connections; open ones kept until they end, at most {:?}: service_retire_timeout_ms)",
                self.cfg.service_retire_timeout
            );
        }
        for (name, why) in &ch.rejected {
            eprintln!("switchd{role}: stored service {name:?} not served: {why}");
        }
        self.service_changes +=
            (ch.added.len() + ch.updated.len() + ch.removed.len() + ch.retiring.len()) as u64;
        self.service_rejections += ch.rejected.len() as u64;
        if active && !ch.added.is_empty() && self.cfg.ha.claim_vips && self.role == "active" {
            self.claim_vips();
        }
        if let Some(records) = records {
            self.restore_retiring(records, global, active);
        }
    }

    /// Restores the retiring records not served here (see
    /// `ControlPlane::restore_retiring`), then settles which records still
    /// stand ([`Self::settle_retiring_records`]).
    fn restore_retiring(
        &mut self,
        records: &[capybara_store::RetiringService],
        global: crate::control::Placement,
        active: bool,
    ) {
        self.retiring_records = records.to_vec();
        self.ended_records.retain(|(n, a, t)| {
            records
                .iter()
                .any(|r| &r.service.name == n && r.addr() == *a && r.deleted_unix_ms == *t)
        });
        let wall = capybara_store::unix_ms_now();
        let todo: Vec<&capybara_store::RetiringService> = records
            .iter()
            .filter(|r| {
                !self
                    .ended_records
                    .contains(&(r.service.name.clone(), r.addr(), r.deleted_unix_ms))
            })
            .collect();
        let services: Vec<capybara_store::Service> =
            todo.iter().map(|r| r.service.clone()).collect();
        let specs = crate::services::store_specs(&services, &self.cfg, global);
        let wanted: Vec<crate::control::RetiringSpec> = specs
            .into_iter()
            .filter_map(|spec| {
                // One record per name and address: a name may retire
                // several addresses (moved, then deleted).
                let r = todo
                    .iter()
                    .find(|r| r.service.name == spec.name && r.addr() == spec.addr)?;
                Some(crate::control::RetiringSpec {
                    spec,
                    retired_for: Duration::from_millis(wall.saturating_sub(r.deleted_unix_ms)),
                })
            })
            .collect();
        let now = self.now();
        let role = if active { "" } else { " (standby)" };
        let served_before: Vec<SocketAddrV4> =
            self.cp.services().iter().map(|s| s.addr()).collect();
        match self.cp.restore_retiring(now, &wanted) {
            Ok(r) => {
                // A name may have several records (addresses): the
                // restored ones are those not served before and retiring now.
                let restored = wanted.iter().filter(|w| {
                    r.restored.contains(&w.spec.name)
                        && !served_before.contains(&w.spec.addr)
                        && self
                            .cp
                            .retiring()
                            .any(|s| s.name == w.spec.name && s.addr() == w.spec.addr)
                });
                for w in restored {
                    let (name, addr, age) = (&w.spec.name, w.spec.addr, w.retired_for);
                    eprintln!(
                        "switchd{role}: restored retiring service {name:?} ({addr}) from the store: retired (deleted or moved away) {} ms ago; its open connections are kept until they end, at most {:?} from the delete: service_retire_timeout_ms",
                        age.as_millis(),
                        self.cfg.service_retire_timeout
                    );
                }
                for (name, why) in &r.skipped {
                    eprintln!(
                        "switchd{role}: retiring service {name:?} in the store not restored: {why}"
                    );
                }
            }
            Err(e) => eprintln!("switchd: restoring retiring services: {e}"),
        }
        self.settle_retiring_records(active);
    }

    /// The retiring records whose service no longer retires here (ended,
    /// timed out, created again, its slot taken, not restorable) are done
    /// with: not restored again, and the active forgets them in the store
    /// (that exact record: a newer delete of the name stays). A forget that
    /// fails, or is held while writes are fenced, is tried at the next poll.
    fn settle_retiring_records(&mut self, active: bool) {
        let done: Vec<(String, SocketAddrV4, u64)> = self
            .retiring_records
            .iter()
            .filter(|r| {
                !self
                    .cp
                    .retiring()
                    .any(|s| s.name == r.service.name && s.addr() == r.addr())
            })
            .map(|r| (r.service.name.clone(), r.addr(), r.deleted_unix_ms))
            .collect();
        if done.is_empty() {
            return;
        }
        self.ended_records.extend(done.iter().cloned());
        if !active {
            return;
        }
        let Some(store) = self.store.clone() else {
            return;
        };
        if self.writes_fenced() {
            self.records_resync.store(true, Ordering::SeqCst);
            return;
        }
        let resync = self.records_resync.clone();
        self.rt.spawn(async move {
            for (name, addr, at) in done {
                match tokio::time::timeout(
                    Duration::from_secs(2),
                    store.forget_retiring_service(&name, addr, at),
                )
                .await
                {
                    Ok(Ok(true)) => eprintln!(
                        "switchd: forgot the retiring record of service {name:?} at {addr} (retired at {at} ms): its retiring service is gone"
                    ),
                    Ok(Ok(false)) => {}
                    Ok(Err(e)) => {
                        eprintln!("switchd: store: forgetting retiring service {name:?}: {e}");
                        resync.store(true, Ordering::SeqCst);
                    }
                    Err(_) => {
                        eprintln!("switchd: store: forgetting retiring service {name:?}: no answer within 2 s");
                        resync.store(true, Ordering::SeqCst);
                    }
                }
            }
        });
    }

    /// Removes the retiring services whose connections have all ended, or
    /// whose `service_retire_timeout` passed (`active`: the flows that ends
    /// are reported closed; a standby writes nothing).
    fn end_retired(&mut self, active: bool) {
        let now = self.now();
        let ended = match self.cp.end_retired(now, active) {
            Ok(e) => e,
            Err(e) => {
                eprintln!("switchd: retiring services: {e}");
                return;
            }
        };
        let role = if active { "" } else { " (standby)" };
        let any = !ended.is_empty();
        for r in ended {
            self.services_retired += 1;
            if r.timed_out {
                self.service_retire_timeouts += 1;
                eprintln!(
                    "switchd{role}: retired service {:?} ({}) removed: service_retire_timeout_ms passed; its {} remaining connections end",
                    r.name, r.addr, r.flows
                );
            } else {
                eprintln!(
                    "switchd{role}: retired service {:?} ({}) removed: its last connection ended",
                    r.name, r.addr
                );
            }
        }
        if any {
            self.settle_retiring_records(active);
        }
    }

    /// Applies a policy the poller read: target selection and the
    /// load-notification interval here, the rest on every server (POLICY).
    fn take_policy(&mut self, sock: &UdpSocket) {
        let Some(p) = self.policy_slot.try_lock().ok().and_then(|mut s| s.take()) else {
            return;
        };
        let p = policy_within_bounds(p);
        if p == self.policy {
            return;
        }
        if let Err(e) = p.validate() {
            self.policy_rejected += 1;
            eprintln!("switchd: stored policy ignored: {e}");
            return;
        }
        let now = self.now();
        self.apply_liveness(now, &p, Some(sock));
        let tp = match p.target_selection {
            capybara_store::TargetSelection::RoundRobin => crate::control::TargetPolicy::RoundRobin,
            capybara_store::TargetSelection::LeastLoaded => {
                crate::control::TargetPolicy::LeastLoaded
            }
        };
        if let Err(e) = self.cp.set_target_policy(tp) {
            eprintln!("switchd: target selection {}: {e}", target_policy_name(tp));
        }
        // Placement of new connections: the store's value applies to every
        // service that follows the global `placement` of the config (a
        // service whose config names another placement keeps it).
        let placement = match p.placement {
            capybara_store::Placement::Maglev => crate::control::Placement::Maglev,
            capybara_store::Placement::Lwrr => crate::control::Placement::Lwrr,
        };
        let follow: Vec<u32> = self
            .cp
            .services()
            .iter()
            .filter(|s| s.follows_global)
            .map(|s| s.index)
            .collect();
        for index in follow {
            if let Err(e) = self.cp.set_placement(index, placement) {
                eprintln!(
                    "switchd: placement {} of service {index}: {e}",
                    format!("{placement:?}").to_lowercase()
                );
            }
        }
        // Within switchd's own bounds (`load_interval_us`): a policy stored
        // before the API enforced them may hold 10 us, which would send a
        // LOAD-NOTIFICATION burst every poll.
        self.cfg.load_interval =
            Duration::from_micros(p.load_notification_interval_us.clamp(100, 1_000_000));
        let msg = policy_message(&p);
        self.policy = p;
        self.policy_changes += 1;
        if msg != self.policy_msg {
            self.policy_msg = msg;
            eprintln!(
                "switchd: policy generation {:#010x}: {}",
                msg.generation,
                policy_message_text(&msg)
            );
            let peers: Vec<(ServerId, SocketAddr)> =
                self.peers.iter().map(|(id, p)| (*id, p.mgmt)).collect();
            for (id, mgmt) in peers {
                if let Some(m) = self.reply(id, ControlBody::Policy(msg)) {
                    if sock.send_to(&m, mgmt).is_ok() {
                        self.policy_sent += 1;
                    }
                }
            }
        }
    }

    fn command(&mut self, sock: &UdpSocket, cmd: Command) {
        match cmd {
            Command::Drain {
                server,
                deadline_ms,
                cancel,
                applied,
            } => {
                // The API recorded the drain (its `Drain` record) before it
                // asked: switchd keeps it for the server's REGISTERs and
                // writes nothing (the record holds liveness only).
                self.drain_cmds.fetch_add(1, Ordering::SeqCst);
                if cancel {
                    self.op_drains.remove(&server);
                } else {
                    let deadline = capybara_store::unix_ms_now() + u64::from(deadline_ms);
                    self.op_drains.insert(server, Some(deadline));
                }
                self.drain_now(sock, server, Some(deadline_ms), cancel);
                if let Some(tx) = applied {
                    let _ = tx.send(());
                }
            }
            Command::Migrate {
                server,
                flow,
                target,
            } => {
                let Some(mgmt) = self.peers.get(&server).map(|p| p.mgmt) else {
                    return;
                };
                if let Some(msg) =
                    self.reply(server, ControlBody::Migrate(ctl::Migrate { flow, target }))
                {
                    let _ = sock.send_to(&msg, mgmt);
                }
            }
        }
    }

    fn publish(&mut self) {
        let stats = self.cp.dp.stats().unwrap_or_default();
        let now = self.now();
        let servers: Vec<serde_json::Value> = self
            .cp
            .servers()
            .map(|s| {
                let p = self.peers.get(&s.reg.id);
                let mut v = json!({
                    "id": s.reg.id.0, "index": s.index, "data_addr": s.reg.data_ip.to_string(),
                    "mac": sys::format_mac(&s.reg.mac), "weight": self.cp.weight_of(s),
                    "register_weight": s.reg.weight,
                    "state": format!("{:?}", s.liveness).to_lowercase(), "load": s.load,
                    "mgmt_addr": p.map(|p| p.mgmt.to_string()),
                    "connections": p.map(|p| p.connections), "load_pps": p.map(|p| p.load_pps),
                    "migrations_in_flight": p.map(|p| p.migrations_in_flight),
                    "rx_backlog_bytes": p.map(|p| p.rx_backlog_bytes),
                    "draining_acked": p.map(|p| p.draining_acked),
                    "policy_generation": p.map(|p| p.policy_generation),
                });
                // Its process is stopping / said it stopped (HEARTBEAT
                // LEAVING / STOPPED); "state" stays the operator's view.
                v["leaving"] = json!(s.leaving);
                v["stopped"] = json!(s.stopped);
                // Dead: for how long, and how much longer its flows are kept.
                v["instance"] = json!(format!("{:#018x}", s.reg.instance));
                v["dead_ms"] = json!(s
                    .dead_since
                    .map(|t| now.saturating_since(t).as_millis() as u64));
                v["flows_kept_ms"] = json!(s
                    .flows_kept_until
                    .map(|t| t.saturating_since(now).as_millis() as u64));
                // Application health per registered service ("up": null
                // when its heartbeats do not report health).
                v["health_reported"] = json!(s.health_reported);
                v["backends"] = json!(p.map_or(Vec::new(), |p| p
                    .services
                    .iter()
                    .map(|svc| json!({
                        "service": svc.to_string(),
                        "up": s.health_reported.then(|| !s.backend_down.contains(svc)),
                    }))
                    .collect::<Vec<_>>()));
                v
            })
            .collect();
        let services: Vec<serde_json::Value> = self
            .cp
            .services()
            .iter()
            .enumerate()
            .map(|(i, s)| json!({"name": s.name, "vip": format!("{}:{}", s.vip, s.port), "index": s.index, "placement": format!("{:?}", s.placement).to_lowercase(),
                 "pool": s.pool.iter().map(|(id, w)| json!({"server": id.0, "weight": w})).collect::<Vec<_>>(),
                 // Who takes new connections: the members the placement tables are built from.
                 "placing": self.cp.placing(i),
                 "fail_open": s.fail_open,
                 "refusing": s.refusing,
                 "retiring": s.retiring.is_some(),
                 "retiring_for_ms": s.retiring_for(now).map(|d| d.as_millis() as u64),
                 "retiring_left_ms": s.retiring_for(now).map(|d| self.cfg.service_retire_timeout.saturating_sub(d).as_millis() as u64),
                 "retiring_flows": s.retiring.and_then(|_| self.cp.retiring_flows(SocketAddrV4::new(s.vip, s.port))),
                 "backend_down": self.cp.servers().filter(|v| v.backend_is_down(s.vip, s.port)).map(|v| v.reg.id.0).collect::<Vec<_>>()}))
            .collect();
        // Stored services switchd read and does not serve, and why (a
        // stored service in neither list is not read yet).
        let refused: Vec<serde_json::Value> = self
            .refused_services
            .iter()
            .map(|r| json!({"name": r.name, "vip": r.addr.to_string(), "reason": r.reason}))
            .collect();
        let dp_counters: serde_json::Map<String, serde_json::Value> = STAT_NAMES
            .iter()
            .zip(stats.iter().chain(std::iter::repeat(&0)))
            .map(|(n, v)| (n.to_string(), json!(v)))
            .collect();
        let writer = self.sink.as_ref().map(|s| s.writer().metrics());
        let sinkm = self
            .sink
            .as_ref()
            .map(|s| s.metrics.clone())
            .unwrap_or_default();
        // Built apart: one json! with everything exceeds the macro's recursion limit.
        let embryonic_status = json!({
            "timeout_ms": self.embryonic.timeout.as_millis() as u64,
            "scanned_total": self.embryonic.metrics.scanned_total,
            "reaped_total": self.embryonic.metrics.reaped_total,
            "spared_total": self.embryonic.metrics.spared_total,
            "passes_total": self.embryonic.metrics.passes_total,
            "embryonic_last_pass": self.embryonic.metrics.embryonic_last_pass,
        });
        let lease_status = json!({
            "held": self.lease.is_some(),
            "last_term": self.held_term,
            "losses": self.lease_losses,
            "regained": self.lease_regained,
            "writes_fenced": self.writes_fenced(),
            "held_updates": self.held.updates.len(),
            "held_updates_dropped": self.held.dropped,
            "held_server_writes": self.held_servers.writes.len(),
            "held_server_writes_dropped": self.held_servers.dropped,
            "fence_refusals": self.fence_refusals,
            "predecessor_term": self.predecessor_term,
        });
        let status = json!({
            "role": self.role,
            "candidate": self.candidate,
            "epoch": self.epoch,
            "lease_term": self.lease.as_ref().map(|l| l.info.term),
            "takeover_ms": self.takeover_ms,
            "fast_takeover": self.fast_takeover,
            "garp_sent": self.garp_sent,
            "attached_ifindexes": self.cp.dp.attached(),
            "servers": servers,
            "services": services,
            "flows": self.flow_counts.0,
            "migrations": self.flow_counts.1,
            "counts_exact": self.counts_exact,
            "closing_lingering": self.cp.closing_len(),
            "reaped_total": self.cp.reaped_total,
            "restored_flows": self.restored_flows,
            "warm_flows": self.warm.len(),
            "warm_syncs": self.warm_syncs,
            "dataplane": dp_counters,
            "control_drops": self.drops,
            "control_accepted": self.accepted,
            "ticks": self.ticks,
            "tick_overruns": self.tick_overruns,
            "load_notifications_sent": self.load_sent,
            "policy": {
                "generation": self.policy_msg.generation,
                "target_selection": target_policy_name(self.cp.target_policy()),
                "load_interval_us": self.cfg.load_interval.as_micros() as u64,
                "proactive_enabled": self.policy.proactive_enabled,
                "proactive_threshold_pct": self.policy.proactive_threshold_pct,
                "reactive_enabled": self.policy.reactive_enabled,
                "reactive_backlog_threshold": self.policy.reactive_backlog_threshold,
                "migration_deadline_ms": self.policy_msg.migration_deadline_ms,
                "buffer_mode": if self.policy_msg.flags & ctl::POLICY_BUFFER_DROP != 0 { "drop" } else { "buffer" },
                "changes": self.policy_changes, "sent": self.policy_sent, "rejected": self.policy_rejected,
            },
            "store": writer.as_ref().map(|m| json!({
                "backlog": m.backlog, "written_total": m.written_total, "batches_total": m.batches_total,
                "batch_size_buckets": m.batch_size_buckets, "overflow_total": m.overflow_total,
                "lag_ms": m.lag.as_secs_f64() * 1e3, "last_batch_lag_ms": m.last_batch_lag.as_secs_f64() * 1e3,
                "flush_errors_total": m.flush_errors_total, "last_error": m.last_error,
                "sink_puts": sinkm.puts, "sink_deletes": sinkm.deletes, "sink_overflow": sinkm.overflow,
                "sink_batches": sinkm.batches, "sink_max_batch": sinkm.max_batch,
            })),
        });
        let mut status = status;
        status["refused_services"] = json!(refused);
        // FLOWS reports (docs/SWITCHD.md, "Control channel").
        let cc = self.cp.claim_counters;
        status["flow_claims"] = json!({
            "requests_sent": self.flow_requests_sent,
            "batches": self.flow_batches,
            "applied": cc.applied,
            "agreed": cc.agreed,
            "in_progress": cc.in_progress,
            "later_claim": cc.later_claim,
            "moved_since": cc.moved_since,
            "unknown_service": cc.unknown_service,
            "remembered": self.cp.claims_remembered(),
        });
        let lv = self.cp.liveness;
        status["liveness"] = json!({
            // The stored policy's (the config's until it is read); while a
            // lowered one is held off, the one in force and for how long.
            "heartbeat_interval_ms": self.cfg.heartbeat_interval.as_millis() as u64,
            "dead_after_ms": self.cfg.dead_after.as_millis() as u64,
            "dead_after_in_force_ms": self.cp.dead_after(self.now()).as_millis() as u64,
            "dead_after_held_ms": self.cp.dead_after_held_until(self.now()).map(|t| t.saturating_since(self.now()).as_millis() as u64),
            "register_acks_resent": self.register_acks_resent,
            "dead_flow_grace_ms": self.cfg.dead_flow_grace.as_millis() as u64,
            "died_total": lv.died_total,
            "returned_total": lv.returned_total,
            "grace_ended_total": lv.grace_ended_total,
            "dead_flows_removed_total": lv.dead_flows_removed_total,
            "restarts_total": lv.restarts_total,
            "restart_flows_removed_total": lv.restart_flows_removed_total,
            "stopped_total": lv.stopped_total,
            "stopped_flows_removed_total": lv.stopped_flows_removed_total,
        });
        status["health"] = json!({
            "changes_total": self.cp.health_changes_total,
            "table_pushes_total": self.cp.health_pushes_total,
            "fail_open": self.cp.services().iter().filter(|s| s.fail_open).map(|s| format!("{}:{}", s.vip, s.port)).collect::<Vec<_>>(),
        });
        status["embryonic"] = embryonic_status;
        status["lease"] = lease_status;
        // HA: where the XDP links are pinned (null: not pinned) and how many
        // a predecessor left that this switchd took over in place.
        status["pin_dir"] = json!(self.pins.as_ref().map(|p| p.dir().display().to_string()));
        status["links_taken_over"] = json!(self.links_taken_over);
        status["flows_adopted"] = json!(self.cp.dp.adopted_flows().0);
        let a = self.cp.dp.adopted();
        status["migrations_adopted"] = json!({
            "copied": a.migrations,
            "pending": a.migrations_pending,
            "skipped": a.migrations_skipped,
            "prepare_targets": a.prepare_targets,
            "origin_ids": a.origin_ids,
            "changed_before_switch": a.settled_late,
            "owner_events": a.owner_events,
            "fins_merged": a.fins_merged,
            "closed": a.closed,
        });
        // The switch's own addresses, which an API refuses as a service VIP
        // or a server data address: control_listen and the IPv4 addresses
        // its configured interfaces have now.
        status["control_listen"] = json!(self.cfg.control_listen.to_string());
        status["interface_addrs"] = json!(own_interface_addrs(&self.cfg.interfaces)
            .into_iter()
            .map(|(name, a)| json!({"interface": name, "addr": a.to_string()}))
            .collect::<Vec<_>>());
        if let (Some(m), Some(st)) = (writer.as_ref(), status["store"].as_object_mut()) {
            st.insert("fenced_total".into(), json!(m.fenced_total));
            st.insert("abandoned_total".into(), json!(m.abandoned_total));
            st.insert("waiting_for_lease".into(), json!(m.waiting_for_lease));
        }
        let mut m = String::new();
        let p = "capybara_switchd";
        m += &format!("{p}_role{{role=\"{}\"}} 1\n", self.role);
        for s in self.cp.servers() {
            m += &format!(
                "{p}_server_load{{server=\"{}\",state=\"{}\"}} {}\n",
                s.reg.id.0,
                format!("{:?}", s.liveness).to_lowercase(),
                s.load
            );
        }
        m += &format!(
            "{p}_flows {}\n{p}_migrations {}\n{p}_table_counts_exact {}\n",
            self.flow_counts.0,
            self.flow_counts.1,
            u8::from(self.counts_exact)
        );
        for (n, v) in STAT_NAMES.iter().zip(stats.iter()) {
            m += &format!("{p}_dataplane_packets_total{{reason=\"{n}\"}} {v}\n");
        }
        for (n, v) in &self.drops {
            m += &format!("{p}_control_drops_total{{reason=\"{n}\"}} {v}\n");
        }
        m += &format!(
            "{p}_tick_overruns_total {}\n{p}_load_notifications_total {}\n",
            self.tick_overruns, self.load_sent
        );
        m += &format!("{p}_reaped_total {}\n", self.cp.reaped_total);
        for s in self.cp.servers() {
            let Some(peer) = self.peers.get(&s.reg.id) else {
                continue;
            };
            if !s.health_reported {
                continue;
            }
            for svc in &peer.services {
                m += &format!(
                    "{p}_backend_up{{server=\"{}\",service=\"{svc}\"}} {}\n",
                    s.reg.id.0,
                    u8::from(!s.backend_down.contains(svc))
                );
            }
        }
        for s in self.cp.services() {
            m += &format!(
                "{p}_service_fail_open{{service=\"{}:{}\"}} {}\n{p}_service_refusing{{service=\"{}:{}\"}} {}\n",
                s.vip,
                s.port,
                u8::from(s.fail_open),
                s.vip,
                s.port,
                u8::from(s.refusing)
            );
        }
        m += &format!(
            "{p}_services {}\n{p}_services_retiring {}\n{p}_services_retired_total {}\n{p}_service_retire_timeouts_total {}\n{p}_service_changes_total {}\n{p}_service_rejections_total {}\n{p}_services_refused {}\n",
            self.cp.services().len(),
            self.cp.retiring().count(),
            self.services_retired,
            self.service_retire_timeouts,
            self.service_changes,
            self.service_rejections,
            self.refused_services.len()
        );
        m += &format!(
            "{p}_health_changes_total {}\n{p}_health_table_pushes_total {}\n",
            self.cp.health_changes_total, self.cp.health_pushes_total
        );
        m += &format!(
            "{p}_servers_died_total {}\n{p}_servers_returned_total {}\n{p}_dead_grace_ended_total {}\n{p}_dead_flows_removed_total {}\n{p}_server_restarts_total {}\n{p}_restart_flows_removed_total {}\n{p}_servers_stopped_total {}\n{p}_stopped_flows_removed_total {}\n{p}_servers_leaving {}\n",
            lv.died_total,
            lv.returned_total,
            lv.grace_ended_total,
            lv.dead_flows_removed_total,
            lv.restarts_total,
            lv.restart_flows_removed_total,
            lv.stopped_total,
            lv.stopped_flows_removed_total,
            self.cp.servers().filter(|s| s.leaving).count()
        );
        m += &format!(
            "{p}_embryonic_reaped_total {}\n{p}_embryonic_scanned_total {}\n{p}_embryonic_scan_passes_total {}\n{p}_embryonic_flows {}\n",
            self.embryonic.metrics.reaped_total,
            self.embryonic.metrics.scanned_total,
            self.embryonic.metrics.passes_total,
            self.embryonic.metrics.embryonic_last_pass
        );
        if let Some(w) = &writer {
            m += &w.to_prometheus();
        }
        if let Ok(mut pb) = self.published.lock() {
            pb.status = serde_json::to_string_pretty(&status).unwrap_or_default();
            pb.metrics = m;
            pb.epoch = self.epoch;
            let ring = format!(
                "{p}_migration_reports_total {}\n{p}_migration_reports_overwritten_total {}\n",
                pb.migrations.received, pb.migrations.overwritten
            );
            pb.metrics += &ring;
        }
    }

    /// Stops serving. The XDP links: with HA on, pinned, and a standby of
    /// this namespace and election waiting (its mark held), they are handed
    /// over: left attached, running this program on its maps, until the
    /// standby (which gets the owner lock released last, after the flow
    /// writer's flush and the lease's resignation) replaces the program in
    /// place, so an upgrade or a step-down for a newer leader on this box
    /// loses no packet. Otherwise detached and unpinned: a switchd stopped
    /// with nobody to take over leaves no program on the interfaces.
    fn shutdown(&mut self, rt: &tokio::runtime::Runtime) {
        let hand_over = self.cfg.ha.enabled
            && self
                .pins
                .as_ref()
                .is_some_and(|p| p.owned() && p.standby_waiting());
        if !hand_over {
            self.cp.dp.detach_all();
            if let Some(p) = self.pins.as_mut() {
                if p.owned() {
                    p.disown();
                    p.remove_if_unused();
                }
            }
        }
        if let Some(sink) = self.sink.take() {
            let w = sink.writer().clone();
            if let Err(e) = rt.block_on(w.close(Duration::from_secs(2))) {
                eprintln!("switchd: {e}");
            }
        }
        if let (Some(store), Some(lease)) = (self.store.clone(), self.lease.take()) {
            let _ = rt.block_on(async {
                tokio::time::timeout(Duration::from_secs(1), store.resign(&lease)).await
            });
        }
        if hand_over {
            let n = self.cp.dp.release_links();
            if let Some(p) = self.pins.as_mut() {
                p.disown();
                eprintln!(
                    "switchd: handed {n} pinned XDP links in {} over to the standby (they forward with this program until it replaces it)",
                    p.dir().display()
                );
            }
        }
    }
}

/// One server record write; failures are logged (the next REGISTER or
/// liveness change writes the record again).
async fn write_server(store: Arc<dyn Store>, w: ServerWrite) {
    match w {
        ServerWrite::Put(rec) => {
            // A REGISTER's record keeps the operator's weight, merged in
            // the store's own read-modify-write: one set between a read
            // here and the write would be lost.
            if let Err(e) = store.put_registered_server(&rec).await {
                eprintln!("switchd: store: put server {}: {e}", rec.id);
            }
        }
        ServerWrite::State(id, state) => {
            // Liveness only (`active`, `dead`): the operator's drain is
            // the server's `Drain` record, which this never touches.
            // Writes that change nothing are skipped (no watch event).
            if let Ok(Some(rec)) = store.get_server(id).await {
                if rec.state == state {
                    return;
                }
            }
            if let Err(e) = store.set_server_state(id, state).await {
                eprintln!("switchd: store: server {id} -> {}: {e}", state.as_str());
            }
        }
    }
}

/// The operator's drains as switchd keeps them (`Switch::op_drains`), from
/// the store's server records and `Drain` records: every server its drain
/// holds out of placement (`capybara_store::out_of_placement`: running,
/// timed out, completed, or a drain state a previous version left in the
/// record), with the drain's deadline while it runs.
fn op_drains_of(
    servers: &[capybara_store::Server],
    drains: &HashMap<ServerId, capybara_store::Drain>,
) -> HashMap<ServerId, Option<u64>> {
    servers
        .iter()
        .filter_map(|s| {
            let d = drains.get(&s.id);
            capybara_store::out_of_placement(s, d.map(|d| d.state)).then(|| {
                let running = d.filter(|d| d.state == capybara_store::DrainState::Running);
                (s.id, running.map(|d| d.deadline_unix_ms))
            })
        })
        .collect()
}

/// How the operator's drains in the store differ from switchd's
/// (`Switch::op_drains`), as [`follow_stored_drains`] applied them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum StoredDrainChange {
    /// The running drain is over (completed or timed out): the server
    /// stays out of placement, its hostagent is not sent DRAIN again.
    Ended(ServerId),
    /// A drain switchd was not told of (its deadline while it runs).
    Started(ServerId, Option<u64>),
    /// An undrain switchd was not told of.
    Lifted(ServerId),
}

/// Makes `op_drains` follow the store's drains (`stored`, from
/// [`op_drains_of`]; `recorded`: the servers with a record and a drain
/// record in the same read), returning the changes for the caller to apply
/// (placement, DRAIN to the hostagent), in server order. Only a drain
/// record that no longer holds (cancelled) lifts switchd's drain: a server
/// without a record keeps it (the API deleted a drained server whose
/// hostagent still runs: out of placement until that hostagent stops), and
/// so does one without a drain record (a drain sent straight to switchd's
/// HTTP endpoint, switchd without the API).
fn follow_stored_drains(
    op_drains: &mut HashMap<ServerId, Option<u64>>,
    stored: &HashMap<ServerId, Option<u64>>,
    recorded: &HashSet<ServerId>,
) -> Vec<StoredDrainChange> {
    let mut changes = Vec::new();
    for (id, deadline) in op_drains.iter_mut() {
        match stored.get(id) {
            Some(None) if deadline.is_some() => {
                *deadline = None;
                changes.push(StoredDrainChange::Ended(*id));
            }
            None if recorded.contains(id) => changes.push(StoredDrainChange::Lifted(*id)),
            _ => {}
        }
    }
    for (id, deadline) in stored {
        if !op_drains.contains_key(id) {
            changes.push(StoredDrainChange::Started(*id, *deadline));
        }
    }
    for c in &changes {
        match *c {
            StoredDrainChange::Started(id, deadline) => {
                op_drains.insert(id, deadline);
            }
            StoredDrainChange::Lifted(id) => {
                op_drains.remove(&id);
            }
            StoredDrainChange::Ended(_) => {}
        }
    }
    changes.sort_by_key(|c| match *c {
        StoredDrainChange::Ended(id)
        | StoredDrainChange::Started(id, _)
        | StoredDrainChange::Lifted(id) => id.0,
    });
    changes
}

/// The DRAIN deadline (ms left) to send a server that registers, given
/// its operator's drain as switchd knows it (`Switch::op_drains`): while
/// the drain runs (its deadline ahead), the time left; nothing when there
/// is no drain, or it is over (completed or timed out: the server is out
/// of placement, and has nothing left to migrate).
fn drain_to_resend(drain: Option<Option<u64>>, now_unix_ms: u64) -> Option<u32> {
    let deadline = drain??;
    let left = deadline.checked_sub(now_unix_ms).filter(|l| *l > 0)?;
    Some(left.min(u64::from(u32::MAX)) as u32)
}

/// Waits until `sock` is readable or `timeout` passed (nanosecond timer).
fn wait_readable(sock: &UdpSocket, timeout: Duration) {
    use std::os::fd::AsRawFd;
    let mut pfd = libc::pollfd {
        fd: sock.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: one valid pollfd, valid timespec, no signal mask.
    unsafe { libc::ppoll(&mut pfd, 1, &ts, std::ptr::null()) };
}

fn new_peer(mgmt: SocketAddr) -> Peer {
    Peer {
        mgmt,
        last_seq: 0,
        connections: 0,
        migrations_in_flight: 0,
        load_pps: 0,
        rx_backlog_bytes: 0,
        draining_acked: false,
        pending_drain: None,
        policy_generation: 0,
        services: Vec::new(),
        ack_resends: 0,
        ack_resend_at: Instant::ZERO,
        flows_reported: false,
        flow_requests_left: FLOW_REQUESTS,
        flow_request_at: Instant::ZERO,
        flow_claims: (0, 0, 0),
        last_id_of: None,
    }
}

/// FLOWS requests sent to a server that has not reported its connections
/// (one per heartbeat at most, a second apart): a hostagent that predates
/// FLOWS drops them, so they stop.
const FLOW_REQUESTS: u8 = 5;
/// How long a server that just registered has to send its FLOWS report on
/// its own (it does after every REGISTER_ACK) before it is asked.
const FLOW_REQUEST_AFTER_REGISTER: Duration = Duration::from_secs(1);

fn kind_name(k: ControlKind) -> &'static str {
    match k {
        ControlKind::Register => "register",
        ControlKind::RegisterAck => "register_ack",
        ControlKind::Heartbeat => "heartbeat",
        ControlKind::Drain => "drain",
        ControlKind::Migrate => "migrate",
        ControlKind::Error => "error",
        ControlKind::SetOwner => "set_owner",
        ControlKind::Policy => "policy",
        ControlKind::MigrationReport => "migration_report",
        ControlKind::Flows => "flows",
        ControlKind::FlowsAck => "flows_ack",
    }
}

// ---------------------------------------------------------------------------
// HTTP: GET /status (JSON), GET /metrics (Prometheus text),
// POST /servers/<id>/drain?deadline_ms=N, POST /servers/<id>/undrain,
// POST /migrate?server=ID&client=IP:PORT&service=VIP:PORT[&target=IP].
// Loopback or management side only; one request per connection.
// ---------------------------------------------------------------------------

fn start_http(
    addr: SocketAddr,
    published: Arc<Mutex<Published>>,
    cmds: mpsc::Sender<Command>,
) -> anyhow::Result<()> {
    let listener = TcpListener::bind(addr).with_context(|| {
        format!("binding the status endpoint (config field `metrics_listen` = {addr})")
    })?;
    static REQUESTS: AtomicU64 = AtomicU64::new(0);
    std::thread::Builder::new().name("switchd-http".into()).spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut c) = conn else { continue };
            REQUESTS.fetch_add(1, Ordering::Relaxed);
            let _ = c.set_read_timeout(Some(Duration::from_secs(2)));
            let mut buf = [0u8; 4096];
            let mut n = 0;
            // Bounded: at most 4 KiB of request head.
            while n < buf.len() {
                match c.read(&mut buf[n..]) {
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
            let mut parts = head.split_whitespace();
            let (method, target) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
            let (code, ctype, body) = route(method, target, &published, &cmds);
            let _ = write!(c, "HTTP/1.1 {code}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len());
        }
    })?;
    Ok(())
}

/// How long `POST /servers/<id>/drain|undrain` waits for the control loop
/// to apply it before answering `202 Accepted` (under the API's 2 s).
const DRAIN_APPLY_WAIT: Duration = Duration::from_millis(1500);

fn route(
    method: &str,
    target: &str,
    published: &Mutex<Published>,
    cmds: &mpsc::Sender<Command>,
) -> (&'static str, &'static str, String) {
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    let get = |f: fn(&Published) -> String| published.lock().map(|p| f(&p)).unwrap_or_default();
    match (method, path) {
        ("GET", "/status") => ("200 OK", "application/json", get(|p| p.status.clone())),
        ("GET", "/metrics") => (
            "200 OK",
            "text/plain; version=0.0.4",
            get(|p| p.metrics.clone()),
        ),
        ("GET", "/migrations") => {
            // /migrations[?after=SEQ][&limit=N]: reported migrations, oldest first.
            let arg = |k: &str| {
                query
                    .split('&')
                    .find_map(|kv| kv.strip_prefix(k).and_then(|v| v.strip_prefix('=')))
            };
            let after = arg("after").map(|v| v.parse::<u64>()).unwrap_or(Ok(0));
            let limit = arg("limit").map(|v| v.parse::<usize>()).unwrap_or(Ok(100));
            let (Ok(after), Ok(limit)) = (after, limit) else {
                return (
                    "400 Bad Request",
                    "text/plain",
                    "need after=SEQ and limit=N as unsigned integers\n".into(),
                );
            };
            let body = published
                .lock()
                .map(|p| p.migrations.page_json(p.epoch, after, limit).to_string())
                .unwrap_or_default();
            ("200 OK", "application/json", body)
        }
        ("POST", "/migrate") => {
            // /migrate?server=ID&client=IP:PORT&service=VIP:PORT[&target=IP]
            let arg = |k: &str| {
                query
                    .split('&')
                    .find_map(|kv| kv.strip_prefix(k).and_then(|v| v.strip_prefix('=')))
            };
            let server = arg("server").and_then(|v| v.parse::<u32>().ok());
            let client = arg("client").and_then(|v| v.parse::<SocketAddrV4>().ok());
            let service = arg("service").and_then(|v| v.parse::<SocketAddrV4>().ok());
            let target = match arg("target").map(|v| v.parse::<Ipv4Addr>()) {
                None => None,
                Some(Ok(t)) => Some(t),
                Some(Err(_)) => {
                    return (
                        "400 Bad Request",
                        "text/plain",
                        "bad target (an IPv4 data address)\n".into(),
                    )
                }
            };
            let (Some(server), Some(client), Some(service)) = (server, client, service) else {
                return (
                    "400 Bad Request",
                    "text/plain",
                    "need server=ID&client=IP:PORT&service=VIP:PORT[&target=IP]\n".into(),
                );
            };
            // A standby's loop takes no commands until it takes over: queued,
            // the request would move a connection at some later moment,
            // long after the caller gave up on it. The API asks the active.
            if published.lock().is_ok_and(|p| p.role == "standby") {
                return (
                    "503 Service Unavailable",
                    "text/plain",
                    format!("this switchd is a standby: ask the active switchd to migrate {client} (server {server})\n"),
                );
            }
            let flow = FlowKey {
                client_ip: *client.ip(),
                client_port: client.port(),
                service_ip: *service.ip(),
                service_port: service.port(),
            };
            let _ = cmds.send(Command::Migrate {
                server: ServerId(server),
                flow,
                target,
            });
            ("202 Accepted", "text/plain", "accepted\n".into())
        }
        ("POST", p) if p.starts_with("/servers/") => {
            let rest = &p["/servers/".len()..];
            let (id, action) = rest.split_once('/').unwrap_or((rest, ""));
            let Ok(id) = id.parse::<u32>() else {
                return (
                    "400 Bad Request",
                    "text/plain",
                    format!("bad server id {id:?}\n"),
                );
            };
            let deadline_ms = query
                .split('&')
                .find_map(|kv| kv.strip_prefix("deadline_ms="))
                .map(|v| v.parse::<u32>())
                .unwrap_or(Ok(30_000));
            let Ok(deadline_ms) = deadline_ms else {
                return ("400 Bad Request", "text/plain", "bad deadline_ms\n".into());
            };
            let cancel = match action {
                "drain" => false,
                "undrain" => true,
                _ => {
                    return (
                        "404 Not Found",
                        "text/plain",
                        format!("unknown action {action:?}\n"),
                    )
                }
            };
            // A standby's loop takes no commands until it takes over, and
            // then reads the drains from the store: queued now, this one
            // would be applied after whatever the store says by then (an
            // undrain since included). Refused at once, not after
            // DRAIN_APPLY_WAIT: the API asks the active one.
            if published.lock().is_ok_and(|p| p.role == "standby") {
                return (
                    "503 Service Unavailable",
                    "text/plain",
                    format!("this switchd is a standby: {action} server {id} on the active switchd (a standby reads the drains from the store when it takes over)\n"),
                );
            }
            let (applied, done) = mpsc::channel();
            let _ = cmds.send(Command::Drain {
                server: ServerId(id),
                deadline_ms,
                cancel,
                applied: Some(applied),
            });
            // Answered once the control loop applied it (a connection
            // opened after the answer misses a drained server); a loop
            // that does not take commands yet (starting) applies it when
            // it does: answered after DRAIN_APPLY_WAIT all the same.
            match done.recv_timeout(DRAIN_APPLY_WAIT) {
                Ok(()) => ("200 OK", "text/plain", "applied\n".into()),
                Err(_) => ("202 Accepted", "text/plain", "accepted\n".into()),
            }
        }
        _ => (
            "404 Not Found",
            "text/plain",
            "GET /status, GET /metrics, GET /migrations, POST /servers/<id>/drain|undrain, POST /migrate\n".into(),
        ),
    }
}

/// The IPv4 addresses of `interfaces` (in their order), for `/status`'s
/// `interface_addrs`; empty when the system cannot list them.
fn own_interface_addrs(interfaces: &[crate::config::InterfaceConfig]) -> Vec<(String, Ipv4Addr)> {
    let mut out: Vec<(usize, String, Ipv4Addr)> = crate::sys::interface_addrs()
        .into_iter()
        .filter_map(|(name, a)| {
            let i = interfaces.iter().position(|c| c.name == name)?;
            Some((i, name, a))
        })
        .collect();
    out.sort_by_key(|(i, _, _)| *i);
    out.into_iter().map(|(_, n, a)| (n, a)).collect()
}

/// `switchd --dump`: fetches `/status` (or another path) from a running switchd.
pub fn fetch(addr: SocketAddr, path: &str) -> anyhow::Result<String> {
    let mut c = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(2))
        .with_context(|| format!("connecting to switchd at {addr}"))?;
    c.set_read_timeout(Some(Duration::from_secs(5)))?;
    write!(
        c,
        "GET {path} HTTP/1.1\r\nHost: switchd\r\nConnection: close\r\n\r\n"
    )?;
    let mut s = String::new();
    c.read_to_string(&mut s)?;
    let body = s
        .split_once("\r\n\r\n")
        .map(|x| x.1)
        .unwrap_or("")
        .to_string();
    Ok(body)
}

#[cfg(test)]
mod tests {
    /// `/status`'s `interface_addrs`: the IPv4 addresses of the configured
    /// interfaces only (`lo`, which every namespace has, here), named.
    #[test]
    fn interface_addrs_are_the_configured_interfaces() {
        use crate::config::{InterfaceConfig, Role};
        let lo = InterfaceConfig {
            name: "lo".into(),
            role: Role::Server,
        };
        let got = super::own_interface_addrs(&[lo]);
        assert!(
            got.contains(&("lo".to_string(), std::net::Ipv4Addr::LOCALHOST)),
            "{got:?}"
        );
        assert!(got.iter().all(|(n, _)| n == "lo"), "{got:?}");
        assert!(super::own_interface_addrs(&[]).is_empty());
    }

    /// switchd writes liveness over whatever the record says (a drain
    /// state a previous version wrote there included: the drain is a
    /// `Drain` record, moved there before switchd writes), and skips a
    /// write that changes nothing; real SQLite store.
    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn liveness_writes_are_written_as_they_are() {
        use super::*;
        let dir = std::env::temp_dir().join(format!("capybara-liveness-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let store: Arc<dyn Store> = Arc::new(
            capybara_store::SqliteStore::open(capybara_store::SqliteConfig::at(dir.join("s.db")))
                .await
                .unwrap(),
        );
        let id = ServerId(4);
        let rec = capybara_store::Server::new(
            id,
            "s4",
            "198.18.1.14:40000".parse().unwrap(),
            Ipv4Addr::new(198, 18, 2, 14),
        );
        store.put_server(&rec).await.unwrap();
        let get = || async { store.get_server(id).await.unwrap().unwrap() };
        for s in [ServerState::Dead, ServerState::Active, ServerState::Dead] {
            write_server(store.clone(), ServerWrite::State(id, s)).await;
            assert_eq!(get().await.state, s);
        }
        let before = get().await;
        write_server(store.clone(), ServerWrite::State(id, ServerState::Dead)).await;
        assert_eq!(get().await, before, "an unchanged state is not written");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A server that registers while its drain runs is sent DRAIN again
    /// with the time left; not once the drain is over, nor without one.
    #[test]
    fn a_register_during_a_running_drain_gets_drain_again() {
        let now = 1_700_000_000_000u64;
        assert_eq!(
            super::drain_to_resend(Some(Some(now + 12_345)), now),
            Some(12_345)
        );
        assert_eq!(
            super::drain_to_resend(Some(Some(now)), now),
            None,
            "deadline reached"
        );
        assert_eq!(
            super::drain_to_resend(Some(Some(now - 1)), now),
            None,
            "past"
        );
        assert_eq!(super::drain_to_resend(Some(None), now), None, "completed");
        assert_eq!(super::drain_to_resend(None, now), None, "no drain");
        assert_eq!(
            super::drain_to_resend(Some(Some(now + (1 << 40))), now),
            Some(u32::MAX),
            "clamped"
        );
    }

    /// A drain the API ended before its deadline (its record in the store
    /// says completed or timed out) is learned: a hostagent that registers
    /// then is not sent DRAIN again, and the server stays out of placement
    /// (in `op_drains`). A running drain is still sent. A drain or an
    /// undrain the API recorded but switchd was not told of is followed; a
    /// server without a record keeps its drain.
    #[test]
    fn the_active_follows_the_operators_drains_in_the_store() {
        use capybara_store::{Drain, DrainProgress, DrainState};
        let now = 1_700_000_000_000u64;
        let server = |id: u32, state: &str| -> capybara_store::Server {
            serde_json::from_value(serde_json::json!({
                "id": id, "name": format!("s{id}"), "mgmt_addr": format!("198.18.1.{id}:7691"),
                "data_addr": format!("198.18.2.{id}"), "state": state, "weight": 1,
                "registered_unix_ms": 1, "updated_unix_ms": 2
            }))
            .unwrap()
        };
        let drain = |id: u32, state| Drain {
            server: ServerId(id),
            targets: Vec::new(),
            started_unix_ms: now - 1_000,
            deadline_unix_ms: now + 60_000,
            state,
            progress: DrainProgress::default(),
        };
        let servers = [
            server(1, "active"),
            server(2, "active"),
            server(3, "active"),
            server(4, "dead"),
            server(5, "drained"),
            server(7, "active"),
        ];
        let drains: HashMap<ServerId, Drain> = [
            drain(1, DrainState::Completed),
            drain(2, DrainState::Running),
            drain(3, DrainState::Cancelled),
            drain(4, DrainState::TimedOut),
        ]
        .into_iter()
        .map(|d| (d.server, d))
        .collect();
        let stored = super::op_drains_of(&servers, &drains);
        assert_eq!(
            stored,
            HashMap::from([
                (ServerId(1), None),
                (ServerId(2), Some(now + 60_000)),
                (ServerId(4), None),
                // A drain state a previous version wrote in the record.
                (ServerId(5), None),
            ])
        );
        // As the API's drain commands left them (deadlines on switchd's clock).
        let mut op: HashMap<ServerId, Option<u64>> =
            (1..=4).map(|i| (ServerId(i), Some(now + 59_990))).collect();
        assert_eq!(
            super::drain_to_resend(op.get(&ServerId(1)).copied(), now),
            Some(59_990),
            "before the store is read, a completed drain is still sent"
        );
        // s6: a drained server the API deleted while its hostagent runs;
        // s7: drained straight through switchd's HTTP endpoint (no API, no
        // drain record).
        op.insert(ServerId(6), Some(now + 59_990));
        op.insert(ServerId(7), Some(now + 59_990));
        let recorded: HashSet<ServerId> = servers
            .iter()
            .filter(|s| drains.contains_key(&s.id))
            .map(|s| s.id)
            .collect();
        assert!(!recorded.contains(&ServerId(7)) && servers.iter().any(|s| s.id == ServerId(7)));
        use super::StoredDrainChange::*;
        assert_eq!(
            super::follow_stored_drains(&mut op, &stored, &recorded),
            vec![
                Ended(ServerId(1)),
                Lifted(ServerId(3)),
                Ended(ServerId(4)),
                Started(ServerId(5), None)
            ]
        );
        for (id, resend) in [
            (1, None),
            (2, Some(59_990)),
            (4, None),
            (5, None),
            (6, Some(59_990)),
            (7, Some(59_990)),
        ] {
            assert!(
                op.contains_key(&ServerId(id)),
                "s{id} stays out of placement"
            );
            assert_eq!(
                super::drain_to_resend(op.get(&ServerId(id)).copied(), now),
                resend,
                "s{id}"
            );
        }
        assert!(!op.contains_key(&ServerId(3)), "s3 was undrained");
        // Learned once.
        assert!(super::follow_stored_drains(&mut op, &stored, &recorded).is_empty());
        // A running drain switchd was not told of is sent with the store's
        // deadline.
        let mut op = HashMap::new();
        let running = HashMap::from([(ServerId(2), Some(now + 60_000))]);
        assert_eq!(
            super::follow_stored_drains(&mut op, &running, &recorded),
            vec![Started(ServerId(2), Some(now + 60_000))]
        );
        assert_eq!(
            super::drain_to_resend(op.get(&ServerId(2)).copied(), now),
            Some(60_000)
        );
    }

    use super::*;

    #[test]
    fn policy_messages_carry_the_store_values_under_a_value_hash() {
        let p = capybara_store::Policy::default();
        let m = policy_message(&p);
        assert_eq!(m.flags, ctl::POLICY_PROACTIVE | ctl::POLICY_REACTIVE);
        assert_eq!((m.proactive_threshold_bp, m.hysteresis_bp), (1000, 200));
        assert_eq!((m.reactive_backlog_packets, m.cooldown_ms), (20, 1000));
        assert_eq!(m.max_migrations_per_sec, 1000);
        assert_ne!(m.generation, 0);
        // Same values, same generation (an active and a standby agree);
        // switchd-only fields do not change it; any server-side value does.
        let mut q = p.clone();
        q.load_notification_interval_us = 500;
        assert_eq!(policy_message(&q).generation, m.generation);
        q.proactive_enabled = false;
        let off = policy_message(&q);
        assert_eq!(off.flags, ctl::POLICY_REACTIVE);
        assert_ne!(off.generation, m.generation);
        q.proactive_enabled = true;
        q.proactive_threshold_pct = 12.5;
        assert_eq!(policy_message(&q).proactive_threshold_bp, 1250);
        assert_ne!(policy_message(&q).generation, m.generation);
    }

    #[test]
    fn policy_messages_carry_the_migration_deadline_and_buffer_mode() {
        let p = capybara_store::Policy::default();
        let m = policy_message(&p);
        // The store's default is what a hostagent's engine runs with.
        assert_eq!(m.migration_deadline_ms, 50);
        assert_eq!(m.flags & ctl::POLICY_BUFFER_DROP, 0);
        let mut q = p.clone();
        q.migration_deadline_ms = 80;
        let d = policy_message(&q);
        assert_eq!(d.migration_deadline_ms, 80);
        assert_ne!(d.generation, m.generation);
        q.migration_deadline_ms = 50;
        q.buffer_mode = capybara_store::BufferMode::Drop;
        let drop = policy_message(&q);
        assert_eq!(
            drop.flags,
            ctl::POLICY_PROACTIVE | ctl::POLICY_REACTIVE | ctl::POLICY_BUFFER_DROP
        );
        assert_ne!(drop.generation, m.generation);
        // Liveness timing is switchd's: not in the message.
        q.buffer_mode = capybara_store::BufferMode::Buffer;
        q.heartbeat_interval_ms = 50;
        q.dead_after_ms = 200;
        assert_eq!(policy_message(&q), m);
    }

    #[test]
    fn the_seed_takes_the_config_liveness_and_old_policies_are_bounded() {
        let s = seed_policy(Duration::from_millis(20), Duration::from_millis(150));
        assert_eq!((s.heartbeat_interval_ms, s.dead_after_ms), (20, 150));
        assert_eq!(
            capybara_store::Policy {
                heartbeat_interval_ms: 100,
                dead_after_ms: 500,
                ..s.clone()
            },
            capybara_store::Policy::default()
        );
        s.validate().unwrap();
        // Stored while these keys were inert (looser bounds): brought
        // within, not the whole policy ignored.
        let old = capybara_store::Policy {
            heartbeat_interval_ms: 1,
            dead_after_ms: 5,
            migration_deadline_ms: 600_000,
            ..Default::default()
        };
        let b = policy_within_bounds(old);
        assert_eq!(
            (
                b.heartbeat_interval_ms,
                b.dead_after_ms,
                b.migration_deadline_ms
            ),
            (10, 20, 10_000)
        );
        b.validate().unwrap();
        let long = policy_within_bounds(capybara_store::Policy {
            dead_after_ms: 86_400_000,
            ..Default::default()
        });
        assert_eq!(long.dead_after_ms, 600_000);
    }

    #[test]
    fn http_routes_parse_requests_and_refuse_bad_ones() {
        let published = Mutex::new(Published {
            status: "{}".into(),
            metrics: "m 1\n".into(),
            ..Default::default()
        });
        let (tx, rx) = mpsc::channel();
        assert_eq!(route("GET", "/status", &published, &tx).0, "200 OK");
        let page = route("GET", "/migrations?after=0&limit=5", &published, &tx);
        assert_eq!(page.0, "200 OK");
        let v: serde_json::Value = serde_json::from_str(&page.2).unwrap();
        assert_eq!(
            (v["next"].as_u64(), v["items"].as_array().map(|a| a.len())),
            (Some(1), Some(0))
        );
        assert_eq!(
            route("GET", "/migrations?after=x", &published, &tx).0,
            "400 Bad Request"
        );
        assert_eq!(route("GET", "/metrics", &published, &tx).2, "m 1\n");
        assert_eq!(route("GET", "/nope", &published, &tx).0, "404 Not Found");
        assert_eq!(
            route("POST", "/servers/x/drain", &published, &tx).0,
            "400 Bad Request"
        );
        assert_eq!(
            route("POST", "/servers/3/drain?deadline_ms=abc", &published, &tx).0,
            "400 Bad Request"
        );
        // Answered once the control loop applied it.
        let applier = std::thread::spawn(move || {
            let cmd = rx.recv().unwrap();
            let Command::Drain {
                server,
                deadline_ms,
                cancel,
                applied,
            } = cmd
            else {
                panic!("{cmd:?}")
            };
            assert_eq!((server, deadline_ms, cancel), (ServerId(3), 500, false));
            applied.unwrap().send(()).unwrap();
            rx
        });
        assert_eq!(
            route("POST", "/servers/3/drain?deadline_ms=500", &published, &tx).0,
            "200 OK"
        );
        let rx = applier.join().unwrap();
        // Not applied in time (a standby's loop takes no commands): accepted.
        assert_eq!(
            route("POST", "/servers/3/undrain", &published, &tx).0,
            "202 Accepted"
        );
        assert!(matches!(
            rx.try_recv(),
            Ok(Command::Drain {
                server: ServerId(3),
                cancel: true,
                ..
            })
        ));
        // A standby answers at once, and queues nothing its loop would
        // apply after the store's drains at a takeover.
        published.lock().unwrap().role = "standby";
        for (req, action) in [
            ("/servers/3/drain?deadline_ms=500", "drain"),
            ("/servers/3/undrain", "undrain"),
        ] {
            let (code, _, body) = route("POST", req, &published, &tx);
            assert_eq!(code, "503 Service Unavailable", "{body}");
            assert!(
                body.contains("standby")
                    && body.contains(&format!("{action} server 3 on the active switchd")),
                "{body}"
            );
        }
        let (code, _, body) = route(
            "POST",
            "/migrate?server=1&client=198.18.0.11:4000&service=198.18.100.1:80",
            &published,
            &tx,
        );
        assert_eq!(code, "503 Service Unavailable", "{body}");
        assert!(
            body.contains("standby") && body.contains("198.18.0.11:4000"),
            "{body}"
        );
        assert!(rx.try_recv().is_err(), "nothing queued on a standby");
        // Bad input is still named as such.
        assert_eq!(
            route("POST", "/servers/3/drain?deadline_ms=abc", &published, &tx).0,
            "400 Bad Request"
        );
        published.lock().unwrap().role = "active";
        assert_eq!(
            route(
                "POST",
                "/migrate?server=1&client=198.18.0.11:4000",
                &published,
                &tx
            )
            .0,
            "400 Bad Request"
        );
        let r = route(
            "POST",
            "/migrate?server=1&client=198.18.0.11:4000&service=198.18.100.1:80&target=198.18.2.12",
            &published,
            &tx,
        );
        assert_eq!(r.0, "202 Accepted");
        match rx.try_recv() {
            Ok(Command::Migrate {
                server,
                flow,
                target,
            }) => {
                assert_eq!(
                    (server, flow.client_port, target),
                    (ServerId(1), 4000, Some(Ipv4Addr::new(198, 18, 2, 12)))
                );
            }
            other => panic!("{other:?}"),
        }
    }

    /// Operator-facing log lines read as sentences, not Rust values
    /// (`Some(2)`, `Sqlite("...")`, `PolicyMsg { .. }`, `RoundRobin`).
    #[test]
    fn log_texts_hold_no_debug_values() {
        let t = lease_lost_text("sw-b", 3, Some(2));
        assert!(t.contains("term 3 (ours was term 2)"), "{t}");
        assert!(lease_lost_text("sw-b", 3, None).contains("(we held none)"));
        let spec = crate::config::StoreSpec::Sqlite("/var/lib/capybara/store.db".into());
        assert_eq!(store_spec_text(&spec), "sqlite /var/lib/capybara/store.db");
        let spec =
            crate::config::StoreSpec::Etcd(vec!["http://a:2379".into(), "http://b:2379".into()]);
        assert_eq!(store_spec_text(&spec), "etcd http://a:2379,http://b:2379");
        assert_eq!(
            target_policy_name(crate::control::TargetPolicy::LeastLoaded),
            "least_loaded"
        );
        let m = policy_message(&capybara_store::Policy::default());
        let t = policy_message_text(&m);
        assert!(
            t.starts_with("proactive on (threshold 10%, hysteresis 2%), reactive on (backlog 20 packets), cooldown 1000 ms,")
                && t.ends_with("deadline 50 ms, buffer mode buffer"),
            "{t}"
        );
    }
}
