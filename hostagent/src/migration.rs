//! The glue between the TCP endpoint and the TCPMig engine on one host.
//!
//! Sans-IO like both of them: [`Migrator`] reacts to engine events by
//! exporting, importing, freezing and forgetting connections, and decides
//! what happens to a TCP segment that arrives for a flow in migration.
//!
//! Invariants:
//! - a connection is in exactly one of: served here (`by_flow`), frozen
//!   (exported, the engine holds its snapshot until the target answers),
//!   gone (migrated out or lost), or unknown;
//! - a segment for a frozen or recently gone flow is dropped silently, never
//!   answered with a RST: the client retransmits and the switch sends the
//!   retransmission to the new owner;
//! - a frozen connection given up as lost (the target failed while the
//!   origin was in doubt) is reset toward its client at once, with the
//!   sequence numbers it was frozen with (docs/TCPMIG.md §1.7 rule 8);
//! - a segment for a flow being migrated in is buffered by the engine until
//!   the import, then replayed into the imported connection.

use capybara_proto::control::{
    MigrationReport as WireReport, MigrationTrigger, ReportOutcome, PHASE_NOT_REACHED,
};
use capybara_proto::time::{Duration, Instant};
use capybara_proto::FlowKey;
use capybara_tcp::{ConnId, Endpoint};
use capybara_tcpmig::{map, BufferVerdict, Engine, Event, Map, MigrationId, Reason, Telemetry};
use std::collections::VecDeque;
use std::net::Ipv4Addr;

/// How long segments of a migrated-out flow are dropped instead of reset.
const GONE_LINGER: Duration = Duration::from_secs(5);
/// A flow migrated out whose late segments still arrive this long after
/// the migration finished: the switch routes it here although the target
/// owns it (it lost the owner: a standby that took over from the store
/// while the CONN_STATE_ACK passed, a switchd restarted without its pinned
/// links). Segments in flight when the switch's entry turned final arrive
/// within a few ms; these do not stop. The origin, which knows the owner,
/// tells the switch (SET_OWNER naming the target, sent by the control task:
/// [`Migrator::take_owner_repairs`]); until then it forwards them, and
/// after `GONE_LINGER` it would reset the client.
const OWNER_REPAIR_AFTER: Duration = Duration::from_millis(200);
/// While late segments keep coming, a flow's repair is queued again at most
/// this often (a SET_OWNER lost, or the control channel down).
const OWNER_REPAIR_EVERY: Duration = Duration::from_millis(500);
/// Repairs waiting for the control task at most (pre-allocated: the
/// per-packet path queues without allocating); beyond, one waits for its
/// flow's next late segment after `OWNER_REPAIR_EVERY`.
const OWNER_REPAIRS_MAX: usize = 256;
/// Migrations remembered for the API and tests.
const RECENT: usize = 1024;
/// Finished migrations waiting to be reported to the switch
/// (MIGRATION_REPORT); beyond this the oldest is dropped and counted.
const REPORT_QUEUE: usize = 1024;
/// Triggers remembered for migrations that have not finished (a flow whose
/// migration never started leaves its entry until the next one overwrites it).
const TRIGGERS_MAX: usize = 65536;

/// The outcome of one migration, as reported to operators.
#[derive(Debug, Clone, Copy)]
pub struct MigrationRecord {
    pub id: MigrationId,
    pub flow: FlowKey,
    pub outcome: Outcome,
    pub peer: Ipv4Addr,
    pub telemetry: Option<Telemetry>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    MigratedOut,
    MigratedIn,
    Resumed(Reason),
    Lost(Reason),
    AbortedIn,
    ImportFailed,
}

/// What became of a connection handle the application holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HandleState {
    /// Served here under this (possibly new) id.
    Live(ConnId),
    /// Exported; the outcome is not known yet (calls would block).
    Frozen,
    /// Moved to another server; calls report it.
    Moved(Ipv4Addr),
    /// Lost with a failed target; calls report a reset.
    Lost,
}

/// Why [`Migrator::migrate`] started no migration.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MigrateError {
    #[error("no connection {0} served here")]
    NotServed(FlowKey),
    #[error("{0}: waiting for its connection manager")]
    Waiting(FlowKey),
    #[error("{0}: its connection manager refused")]
    Refused(FlowKey),
    #[error(transparent)]
    Engine(#[from] capybara_tcpmig::MigError),
}

impl MigrateError {
    /// What a NOT_STARTED report to the switch says; `None` when the
    /// migration is not refused for good (its connection manager has not
    /// reached a safe point yet: it starts when it does).
    pub fn start_failure(&self) -> Option<capybara_proto::control::StartFailure> {
        use capybara_proto::control::StartFailure;
        match self {
            MigrateError::NotServed(_) => Some(StartFailure::NoConnection),
            MigrateError::Waiting(_) => None,
            MigrateError::Refused(_) => Some(StartFailure::Refused),
            MigrateError::Engine(capybara_tcpmig::MigError::TargetIsSelf(_)) => {
                Some(StartFailure::TargetIsSelf)
            }
            // A migration of the flow in progress, too many migrations
            // out, its record table full, a snapshot that cannot travel.
            MigrateError::Engine(_) => Some(StartFailure::Busy),
        }
    }
}

impl From<MigrateError> for String {
    fn from(e: MigrateError) -> String {
        e.to_string()
    }
}

pub struct Migrator {
    pub engine: Engine,
    /// Connections served here, by flow (owned: accepted or imported).
    by_flow: Map<FlowKey, ConnId>,
    /// When this host took each connection it serves (accepted, imported):
    /// the age its FLOWS claims carry (`Migrator::claims`).
    owned_at: Map<FlowKey, Instant>,
    /// Flows frozen (exported, outcome unknown) or gone (migrated out
    /// recently), with where their late segments go: one entry per flow,
    /// one lookup for a segment or a migration step ([`Departed`]).
    departed: Map<FlowKey, Departed>,
    handles: Map<ConnId, HandleState>,
    /// Resumed connections come back through the endpoint's accept queue;
    /// these ids belong to existing handles, not to new connections.
    resumed: Map<ConnId, ConnId>,
    /// Endpoint id of a resumed connection -> the application's handle.
    aliases: Map<ConnId, ConnId>,
    recent: VecDeque<MigrationRecord>,
    local: Ipv4Addr,
    /// Applications' connection managers (`socket` module docs).
    pub managers: crate::socket::Managers,
    ready: Vec<(FlowKey, Option<Ipv4Addr>)>,
    /// Handles woken by events processed inside the receive path (see
    /// [`Migrator::handle_message`]), handed to the runtime by the next
    /// [`Migrator::process_events`].
    woken: Vec<ConnId>,
    /// Records appended to `recent` so far: a cursor for readers that must
    /// see each finished migration once (the drain, `crate::drain`).
    pub recorded: u64,
    /// What started the migration of each flow migrating out (for reports).
    triggers: Map<FlowKey, MigrationTrigger>,
    /// Finished migrations to report to the switch, with when they finished.
    reports: VecDeque<(Instant, WireReport)>,
    /// Reports dropped because the queue was full (switch unreachable).
    pub reports_dropped: u64,
    /// `now` of the event being processed (dates queued reports).
    report_now: Instant,
    /// The clock `now` comes from (the stack sets it): the end of an export
    /// or an import is stamped with a fresh reading. `now` is read once per
    /// poll, before the receive batch, so a PREPARE_ACK (or the last
    /// CONN_STATE) and the export (import) it triggers in the same poll had
    /// the same time and the reported export_us and import_us were always
    /// 0. `None` (tests with a hand-driven clock): `now`.
    pub clock: Option<capybara_net::driver::Clock>,
    /// Benchmarks: per-migration telemetry and host CPU written to a file
    /// (`CAPYBARA_MIGRATION_TELEMETRY`); `None` (the default) costs one
    /// branch per TCPMig message.
    pub dump: Option<TelemetryDump>,
    /// Client segments dropped silently because their flow was frozen
    /// (exported, outcome unknown) / gone (migrated out recently).
    pub dropped_frozen: u64,
    pub dropped_gone: u64,
    /// Flow and target of the authenticated PREPARE_ACK being handled.
    msg_target: Option<(FlowKey, Ipv4Addr)>,
    /// Late segments given a [`SegmentVerdict::Forward`] (frozen / gone).
    pub forwarded_frozen: u64,
    pub forwarded_gone: u64,
    /// Off: late segments are dropped as before (`CAPYBARA_FORWARD_LATE=0`).
    pub forward_late: bool,
    /// Rate limit of the "snapshot too large" log line.
    too_large_log: TooLargeLog,
    /// Migrations refused as too large before their connection was frozen
    /// (its queues and application state already over the limit).
    pub too_large_before_export: u64,
    /// Clients reset because their migration was lost (target failed with
    /// the connection in doubt; docs/TCPMIG.md §1.7 rule 8).
    pub lost_resets: u64,
    /// Flows the switch still routes here after they migrated out, with
    /// their owner: SET_OWNERs for the control task (`OWNER_REPAIR_AFTER`).
    owner_repairs: Vec<(FlowKey, Ipv4Addr)>,
    /// Repairs queued so far.
    pub owner_repairs_total: u64,
}

/// A log line for an event that can come in bursts: printed at most once
/// per `every`; the next printed line counts those held back meanwhile.
#[derive(Debug)]
pub(crate) struct LineThrottle {
    every: Duration,
    next_at: Option<Instant>,
    quiet: u64,
}

impl LineThrottle {
    pub(crate) fn new(every: Duration) -> LineThrottle {
        LineThrottle {
            every,
            next_at: None,
            quiet: 0,
        }
    }

    /// Whether a line may be printed at `now`: `Some` with the suffix to
    /// end it with (empty, or " (N more since the last such line)"); `None`
    /// (counted) within `every` of the last one printed.
    pub(crate) fn admit(&mut self, now: Instant) -> Option<String> {
        if self.next_at.is_some_and(|t| now < t) {
            self.quiet += 1;
            return None;
        }
        self.next_at = Some(now + self.every);
        Some(match std::mem::take(&mut self.quiet) {
            0 => String::new(),
            n => format!(" ({n} more since the last such line)"),
        })
    }
}

/// The origin's log line for a migration refused because the connection's
/// snapshot exceeds the snapshot limit (the report says `snapshot too
/// large`; the line names the connection and the sizes). At most one line
/// per [`TooLargeLog::EVERY`]; the next line counts those left out.
#[derive(Debug)]
struct TooLargeLog(LineThrottle);

impl Default for TooLargeLog {
    fn default() -> Self {
        TooLargeLog(LineThrottle::new(Self::EVERY))
    }
}

impl TooLargeLog {
    const EVERY: Duration = Duration::from_secs(10);

    fn note(&mut self, now: Instant, flow: FlowKey, len: usize, max: usize) -> Option<String> {
        let more = self.0.admit(now)?;
        Some(format!(
            "hostagent: connection {flow} not migrated: snapshot {len} bytes > limit {max} bytes \
             (reason snapshot too large; the connection stays here){more}"
        ))
    }
}

/// What the glue keeps of a flow that left this host or is leaving it
/// (`Migrator::departed`; an entry goes when all three are `None`).
#[derive(Debug, Default)]
struct Departed {
    /// Origin: exported by a migration whose outcome is not known yet.
    frozen: Option<Frozen>,
    /// Migrated out (or given up as a target): its late segments are
    /// forwarded or dropped silently until then, never reset.
    gone_until: Option<Instant>,
    /// The target of a frozen (after its PREPARE_ACK) or gone (migrated
    /// out) flow: its late segments are forwarded there instead of dropped
    /// (docs/MIGRATION.md "Late segments at the origin").
    target: Option<Ipv4Addr>,
    /// The client's initial sequence number on the connection that left
    /// (gone after `MigratedOut`): a SYN carrying it is a late duplicate
    /// of that connection's SYN, any other SYN a new connection reusing
    /// the 4-tuple ([`Migrator::segment_verdict`]).
    syn_seq: Option<u32>,
    /// Gone to `target`: from when a late segment makes the origin tell
    /// the switch who owns the flow (`OWNER_REPAIR_AFTER`).
    repair_at: Option<Instant>,
}

/// An exported connection.
#[derive(Debug)]
struct Frozen {
    id: MigrationId,
    /// The application's handle.
    handle: ConnId,
    /// The snapshot, if the engine refused it; otherwise the engine keeps
    /// it (`Engine::take_resumed_snapshot`) for resuming here.
    kept: Option<Vec<u8>>,
    /// How to reset the client if the migration is lost (captured before
    /// the export; `None` when the connection's abort sends no RST).
    reset: Option<capybara_tcp::PeerReset>,
    /// The client's initial sequence number (its SYN's).
    peer_isn: Option<u32>,
}

impl Departed {
    fn is_empty(&self) -> bool {
        self.frozen.is_none() && self.gone_until.is_none() && self.target.is_none()
    }
}

/// What to do with a TCP segment that arrived for this host
/// ([`Migrator::segment_verdict`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SegmentVerdict {
    /// Hand it to the TCP endpoint.
    Process,
    /// Consumed (buffered for an import) or dropped silently.
    Drop,
    /// A late segment of a flow that moved to this target (its data
    /// address): send it there, never answer it here.
    Forward(Ipv4Addr),
}

/// The first value of this process's migration counter
/// (`EngineConfig::first_migration_seq`, the low 32 bits of every
/// migration id): the wall clock in milliseconds, wrapping every ~49.7
/// days. Peers and the switch remember ids for a while (the targets'
/// finished migrations, the switch's PREPARE steering memory and its
/// migration entries), so a restarted hostagent must not number its
/// migrations from 1 again: the switch sent its first migrations to the
/// targets the previous process's migrations with the same ids went to,
/// whatever their weight, drain or health now. From the clock, a
/// restarted process continues above the ids of the one before as long
/// as that one averaged fewer than 1,000 migrations a second; the switch
/// compares ids of one origin in serial-number arithmetic (the wrap).
pub fn first_migration_seq_now() -> u32 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u32)
        .unwrap_or(1)
}

/// The counter of the last migration id a REGISTER_ACK says the switch saw
/// from `local` (`RegisterAck::last_migration_id`), for
/// `Engine::seed_migration_counter`: `None` when the switch sent none (it
/// predates the field), knows none (0: it started since), or names another
/// origin's id (not this host's data address: ignored).
pub fn last_seen_counter(last_migration_id: Option<u64>, local: Ipv4Addr) -> Option<u32> {
    let id = last_migration_id.filter(|&id| id != 0)?;
    ((id >> 32) as u32 == u32::from(local)).then_some(id as u32)
}

/// Test-only: `CAPYBARA_TEST_FIRST_MIGRATION_SEQ` replaces the clock seed
/// of the migration counter (a decimal u32), so that a lab test can make a
/// restarted process start exactly where its predecessor's ids are, as
/// one does that follows a predecessor which averaged over 1,000
/// migrations a second (tests/tests/restart_ids_lab.rs). `None`: unset or
/// not a number.
pub fn test_first_migration_seq() -> Option<u32> {
    std::env::var("CAPYBARA_TEST_FIRST_MIGRATION_SEQ")
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// Whether a TCP segment (its header first) opens a new connection: SYN
/// without ACK, with another sequence number than `old_syn` (the initial
/// sequence number of the connection that had the 4-tuple, if known: a
/// SYN carrying it is that connection's, duplicated or retransmitted).
fn is_new_connection(segment: &[u8], old_syn: Option<u32>) -> bool {
    const SYN: u8 = 0x02;
    const ACK: u8 = 0x10;
    let (Some(seq), Some(&flags)) = (segment.get(4..8), segment.get(13)) else {
        return false;
    };
    flags & (SYN | ACK) == SYN
        && old_syn != Some(u32::from_be_bytes([seq[0], seq[1], seq[2], seq[3]]))
}

impl Migrator {
    pub fn new(engine: Engine, local: Ipv4Addr) -> Migrator {
        Migrator {
            engine,
            by_flow: map(1024),
            owned_at: map(1024),
            departed: map(1024),
            handles: map(0),
            resumed: map(0),
            aliases: map(0),
            recent: VecDeque::with_capacity(RECENT),
            local,
            managers: Default::default(),
            ready: Vec::new(),
            woken: Vec::with_capacity(64),
            recorded: 0,
            triggers: map(1024),
            reports: VecDeque::with_capacity(REPORT_QUEUE),
            reports_dropped: 0,
            report_now: Instant::ZERO,
            clock: None,
            dump: TelemetryDump::from_env(local),
            dropped_frozen: 0,
            dropped_gone: 0,
            msg_target: None,
            forwarded_frozen: 0,
            forwarded_gone: 0,
            forward_late: std::env::var_os("CAPYBARA_FORWARD_LATE").is_none_or(|v| v != "0"),
            too_large_log: TooLargeLog::default(),
            too_large_before_export: 0,
            lost_resets: 0,
            owner_repairs: Vec::with_capacity(OWNER_REPAIRS_MAX),
            owner_repairs_total: 0,
        }
    }

    /// A connection accepted by the application (new or migrated in).
    pub fn track(&mut self, flow: FlowKey, id: ConnId) {
        self.by_flow.insert(flow, id);
        let now = self.fresh(self.report_now);
        self.owned_at.insert(flow, now);
        self.clear_gone(flow);
    }

    /// The connections served here as FLOWS claims (docs/TCPMIG.md §4.2):
    /// each with its ownership epoch (the migration that brought it here,
    /// 0 if placed here) and how long ago this host took it. Appended to
    /// `out` (off the per-packet path: the control task's buffer).
    pub fn claims(&self, now: Instant, out: &mut Vec<capybara_proto::control::FlowClaim>) {
        out.reserve(self.by_flow.len());
        for flow in self.by_flow.keys() {
            let owned_ms = self.owned_at.get(flow).map_or(u32::MAX, |t| {
                now.saturating_since(*t)
                    .as_millis()
                    .min(u64::from(u32::MAX) as u128) as u32
            });
            out.push(capybara_proto::control::FlowClaim {
                flow: *flow,
                epoch: self.engine.epoch(flow),
                owned_ms,
            });
        }
    }

    /// The flow is no longer gone (served here again): forget when its
    /// late segments stop being dropped, and where they went.
    fn clear_gone(&mut self, flow: FlowKey) {
        if let std::collections::hash_map::Entry::Occupied(mut o) = self.departed.entry(flow) {
            let d = o.get_mut();
            d.gone_until = None;
            d.target = None;
            d.syn_seq = None;
            d.repair_at = None;
            if d.is_empty() {
                o.remove();
            }
        }
    }

    /// The flow is gone (its late segments dropped silently until
    /// `until`), forwarded to `target` if known.
    fn set_gone(&mut self, flow: FlowKey, until: Instant, target: Option<Ipv4Addr>) {
        let d = self.departed.entry(flow).or_default();
        d.gone_until = Some(until);
        d.target = target;
        d.syn_seq = None;
        d.repair_at = None;
    }

    /// Takes the frozen connection of the migration `id` of `flow` (the
    /// flow's target is forgotten too unless `gone_target` names the new
    /// one, which makes it gone for `GONE_LINGER`).
    fn take_frozen(
        &mut self,
        now: Instant,
        flow: FlowKey,
        id: MigrationId,
        gone_target: Option<Ipv4Addr>,
    ) -> Option<Frozen> {
        let std::collections::hash_map::Entry::Occupied(mut o) = self.departed.entry(flow) else {
            return None;
        };
        let d = o.get_mut();
        match &d.frozen {
            Some(f) if f.id == id => {}
            _ => return None,
        }
        let f = d.frozen.take();
        match gone_target {
            Some(t) => {
                d.gone_until = Some(now + GONE_LINGER);
                d.target = Some(t);
                d.syn_seq = f.as_ref().and_then(|f| f.peer_isn);
                d.repair_at = Some(now + OWNER_REPAIR_AFTER);
            }
            None => d.target = None,
        }
        if d.is_empty() {
            o.remove();
        }
        f
    }

    /// The application released the handle.
    pub fn untrack(&mut self, flow: Option<FlowKey>, id: ConnId) {
        // After a resumed migration the endpoint id differs from the
        // application's handle; `by_flow` holds the endpoint id. Leaving it
        // there kept a released connection "served": the churn and the
        // policies went on exporting it in LAST-ACK, its final ACK was
        // dropped while frozen, and the client got a reset.
        let endpoint_id = match self.handles.remove(&id) {
            Some(HandleState::Live(e)) => {
                self.aliases.remove(&e);
                e
            }
            _ => id,
        };
        if let Some(f) = flow {
            if let Some(&cur) = self.by_flow.get(&f) {
                if cur == id || cur == endpoint_id {
                    self.by_flow.remove(&f);
                    self.owned_at.remove(&f);
                    // Closed here: its ownership epoch (TCPMig v2) goes too.
                    self.engine.forget_flow(&f);
                }
            }
        }
        self.managers.remove(id);
    }

    /// Whether `flow` is served here (and not migrating).
    pub fn serves(&self, flow: &FlowKey) -> bool {
        self.by_flow.contains_key(flow)
    }

    /// Flows served here and not migrating (for policies and test drivers).
    pub fn flows(&self) -> impl Iterator<Item = (&FlowKey, &ConnId)> {
        self.by_flow.iter()
    }

    /// While a migration of this host is unfinished (an origin before its
    /// CONN_STATE_ACK, a target before its import), a stamp that changes
    /// with every TCPMig message received or sent; `None` when none is.
    /// The driver's reply spin (`Stack::drive`) spins at most its window
    /// per stamp: per message awaited, not per wake-up.
    pub fn awaiting_peer(&self) -> Option<u64> {
        if self.engine.in_progress() == (0, 0) {
            return None;
        }
        let c = self.engine.counters();
        Some(c.rx.total().wrapping_add(c.tx.total()))
    }

    /// What a handle held by the application refers to now.
    pub fn handle(&self, id: ConnId) -> HandleState {
        self.handles
            .get(&id)
            .copied()
            .unwrap_or(HandleState::Live(id))
    }

    /// If `id` (just accepted from the endpoint) is a resumed connection,
    /// returns the application handle it belongs to.
    pub fn take_resumed(&mut self, id: ConnId) -> Option<ConnId> {
        let app = self.resumed.remove(&id)?;
        self.aliases.insert(id, app);
        Some(app)
    }

    /// The application handle an endpoint id belongs to.
    pub fn app_handle(&self, endpoint_id: ConnId) -> ConnId {
        self.aliases
            .get(&endpoint_id)
            .copied()
            .unwrap_or(endpoint_id)
    }

    pub fn recent(&self) -> impl Iterator<Item = &MigrationRecord> {
        self.recent.iter()
    }

    /// The records appended since `cursor` (a former value of
    /// [`Migrator::recorded`]), oldest first; those that already left the
    /// bounded recent list are skipped. Readers that must see each finished
    /// migration once keep `recorded` as their cursor.
    pub fn recent_since(&self, cursor: u64) -> impl Iterator<Item = &MigrationRecord> {
        let new = self
            .recorded
            .saturating_sub(cursor)
            .min(self.recent.len() as u64) as usize;
        self.recent.range(self.recent.len() - new..)
    }

    /// A migration finished: its report for the switch and its record.
    /// The telemetry (~200 bytes) is read in place from the engine, which
    /// keeps finished migrations as tombstones: one lookup, and one copy
    /// into the recent list for a completed migration (no copy otherwise).
    fn record(&mut self, id: MigrationId, flow: FlowKey, outcome: Outcome, peer: Ipv4Addr) {
        let tel = self.engine.telemetry(id);
        let mut report = wire_report(id, flow, outcome, peer, tel);
        if report.outcome.is_origin() {
            if let Some(t) = self.triggers.remove(&flow) {
                report.trigger = t;
            }
        }
        // Bounded, no allocation: the queue is pre-sized.
        if self.reports.len() >= REPORT_QUEUE {
            self.reports.pop_front();
            self.reports_dropped += 1;
        }
        self.reports.push_back((self.report_now, report));
        if self.recent.len() == RECENT {
            self.recent.pop_front();
        }
        self.recent.push_back(MigrationRecord {
            id,
            flow,
            outcome,
            peer,
            telemetry: None,
        });
        if matches!(outcome, Outcome::MigratedOut | Outcome::MigratedIn) {
            if let (Some(r), Some(t)) = (self.recent.back_mut(), tel) {
                r.telemetry = Some(*t);
            }
        }
        if let (Some(d), Some(r)) = (&mut self.dump, self.recent.back()) {
            d.finished.push(*r);
        }
        self.recorded += 1;
    }

    /// Decides the fate of a TCP segment before the endpoint sees it.
    /// Returns true when the endpoint should process it.
    pub fn filter_segment(&mut self, now: Instant, flow: FlowKey, segment: &[u8]) -> bool {
        let forward = std::mem::replace(&mut self.forward_late, false);
        let v = self.segment_verdict(now, flow, segment);
        self.forward_late = forward;
        v == SegmentVerdict::Process
    }

    /// [`Migrator::filter_segment`] with forwarding: a segment of a frozen
    /// flow whose target is known (its PREPARE_ACK arrived), or of a flow
    /// migrated out less than `GONE_LINGER` ago, is to be forwarded to the
    /// target instead of dropped (the switch sent it here before its entry
    /// flipped; dropping it stalled the client until its RTO). Without a
    /// known target it is dropped silently as before.
    pub fn segment_verdict(
        &mut self,
        now: Instant,
        flow: FlowKey,
        segment: &[u8],
    ) -> SegmentVerdict {
        // One lookup: most segments belong to no departed flow.
        let (frozen, gone_until, target, syn_seq, repair_at) = match self.departed.get(&flow) {
            Some(d) => (
                d.frozen.as_ref().map(|f| f.peer_isn),
                d.gone_until,
                d.target,
                d.syn_seq,
                d.repair_at,
            ),
            None => (None, None, None, None, None),
        };
        if let Some(old_isn) = frozen {
            // A new connection reusing the tuple (the client reset the
            // frozen one and connected again from the same port; the switch
            // forgot the flow at the reset and placed the new SYN here) is
            // dropped, never forwarded: on the target it would be
            // established while the switch sends its segments here (as for
            // a gone tuple below). The client retransmits its SYN (1 s);
            // by then the migration has its outcome: moved (the SYN is
            // served here) or resumed here (the old connection answers with
            // a challenge ACK, the client's reset ends it, its next SYN is
            // served).
            if let (true, Some(t)) = (self.forward_late, target) {
                if !is_new_connection(segment, old_isn) {
                    self.forwarded_frozen += 1;
                    return SegmentVerdict::Forward(t);
                }
            }
            self.dropped_frozen += 1;
            return SegmentVerdict::Drop;
        }
        // The engine first: a flow that left recently may be migrating back
        // in, and its segments must be buffered for the import, not dropped
        // as "gone" (that stalled the client until its RTO).
        if !matches!(
            self.engine.buffer_segment(now, flow, segment),
            BufferVerdict::NotMigrating
        ) {
            return SegmentVerdict::Drop;
        }
        if let Some(until) = gone_until {
            // A SYN (no ACK) on a tuple that left, other than a late
            // duplicate of the old connection's own SYN, is a new connection
            // reusing it (Linux reuses a port at once after a RST): the
            // switch forgot the old flow at the client's reset and placed
            // the new one here. Served here, never forwarded: forwarded, it
            // was established on the old target while the switch sent its
            // segments here, which forwarded them only until GONE_LINGER,
            // and the switch refused every migration of it (CI on 6cb2385:
            // an HTTP client hung on a port wrk had just reset).
            if until > now && !is_new_connection(segment, syn_seq) {
                if let (true, Some(t)) = (self.forward_late, target) {
                    self.forwarded_gone += 1;
                    if repair_at.is_some_and(|r| now >= r) {
                        self.queue_owner_repair(now, flow, t);
                    }
                    return SegmentVerdict::Forward(t);
                }
                self.dropped_gone += 1;
                return SegmentVerdict::Drop;
            }
            self.clear_gone(flow);
        }
        SegmentVerdict::Process
    }

    /// The switch still sends `flow`, migrated out to `target`, here:
    /// queue a SET_OWNER for the control task, and not again for
    /// `OWNER_REPAIR_EVERY`.
    fn queue_owner_repair(&mut self, now: Instant, flow: FlowKey, target: Ipv4Addr) {
        if let Some(d) = self.departed.get_mut(&flow) {
            d.repair_at = Some(now + OWNER_REPAIR_EVERY);
        }
        if self.owner_repairs.len() < OWNER_REPAIRS_MAX {
            self.owner_repairs.push((flow, target));
            self.owner_repairs_total += 1;
        }
    }

    /// Moves the queued owner repairs (flow, owner) into `out`, for
    /// SET_OWNER messages (the control task; off the per-packet path).
    pub fn take_owner_repairs(&mut self, out: &mut Vec<(FlowKey, Ipv4Addr)>) {
        out.append(&mut self.owner_repairs);
    }

    /// Starts migrating the connection of `flow` to `target` (or a target
    /// the switch picks).
    pub fn migrate(
        &mut self,
        now: Instant,
        flow: FlowKey,
        target: Option<Ipv4Addr>,
    ) -> Result<MigrationId, MigrateError> {
        let Some(&cid) = self.by_flow.get(&flow) else {
            return Err(MigrateError::NotServed(flow));
        };
        match self.managers.gate(now, flow, self.app_handle(cid), target) {
            crate::socket::Gate::Go => {}
            crate::socket::Gate::Wait => return Err(MigrateError::Waiting(flow)),
            crate::socket::Gate::Refused => return Err(MigrateError::Refused(flow)),
        }
        let t0 = self.dump.as_ref().map(|_| std::time::Instant::now());
        let started = self.engine.migrate_out(now, flow, target);
        if let (Some(d), Some(t0), Ok(id)) = (&mut self.dump, t0, &started) {
            d.cpu(id.0).start_ns += t0.elapsed().as_nanos() as u64;
        }
        if started.is_err() {
            self.managers.resume(self.app_handle(cid));
        }
        Ok(started?)
    }

    /// [`Migrator::migrate`], remembering what started the migration: the
    /// origin's report to the switch names it (the API's `trigger`).
    pub fn migrate_as(
        &mut self,
        now: Instant,
        flow: FlowKey,
        target: Option<Ipv4Addr>,
        trigger: MigrationTrigger,
    ) -> Result<MigrationId, MigrateError> {
        if self.triggers.len() >= TRIGGERS_MAX && !self.triggers.contains_key(&flow) {
            self.triggers.clear();
        }
        // Kept on error too: a migration its connection manager delays
        // starts later from `process_events` under the same trigger.
        self.triggers.insert(flow, trigger);
        self.migrate(now, flow, target)
    }

    /// Moves up to `max` finished migrations into `out` for a
    /// MIGRATION_REPORT, their `age_us` counted up to `now`. Off the
    /// per-packet path (the control task calls it).
    pub fn take_reports(&mut self, now: Instant, max: usize, out: &mut Vec<WireReport>) {
        while out.len() < max {
            let Some((finished, mut r)) = self.reports.pop_front() else {
                break;
            };
            r.age_us = now
                .saturating_since(finished)
                .as_micros()
                .min(u128::from(u32::MAX)) as u32;
            out.push(r);
        }
    }

    /// Finished migrations not reported yet.
    pub fn reports_pending(&self) -> usize {
        self.reports.len()
    }

    /// A TCPMig datagram arrived: the engine handles it, then its events are
    /// applied at once, before the next packet of the batch. A segment that
    /// follows an engine decision in the same batch must see its effect:
    /// after an ABORT the flow must already be "gone" (dropped, not reset),
    /// after a PREPARE_ACK already frozen, after the last CONN_STATE already
    /// imported. Applying events only after the batch reset clients.
    pub fn handle_message(
        &mut self,
        now: Instant,
        src: Ipv4Addr,
        datagram: &[u8],
        tcp: &mut Endpoint,
    ) -> Result<(), capybara_tcpmig::RxError> {
        let t0 = self.dump.as_ref().map(|_| std::time::Instant::now());
        let r = self.engine.handle_message(now, src, datagram);
        if r.is_ok() {
            self.msg_target = prepare_ack_target(datagram);
        }
        self.settle(now, tcp);
        self.msg_target = None;
        if let (Some(d), Some(t0)) = (&mut self.dump, t0) {
            d.add_message(datagram, t0.elapsed().as_nanos() as u64, true);
        }
        r
    }

    /// The engine's next datagram (see [`Engine::poll_transmit`]), timed
    /// for the telemetry dump when it is on.
    #[inline(never)]
    pub fn poll_transmit(
        &mut self,
        now: Instant,
        buf: &mut [u8],
    ) -> Option<capybara_tcpmig::Transmit> {
        // The driver asks before every frame and nearly always nothing is
        // queued: that answer costs a load and a branch, without the
        // frame's setup (which alone cost ~20 instructions per empty poll).
        // Not inlined: it stays one function for callgrind's
        // `--toggle-collect` (docs/BENCHMARKS.md, instruction counts).
        if !self.engine.has_transmit() {
            return None;
        }
        self.poll_transmit_queued(now, buf)
    }

    #[inline(never)]
    fn poll_transmit_queued(
        &mut self,
        now: Instant,
        buf: &mut [u8],
    ) -> Option<capybara_tcpmig::Transmit> {
        let Some(d) = &mut self.dump else {
            return self.engine.poll_transmit(now, buf);
        };
        let t0 = std::time::Instant::now();
        let t = self.engine.poll_transmit(now, buf)?;
        d.add_message(&buf[..t.len], t0.elapsed().as_nanos() as u64, false);
        Some(t)
    }

    /// The engine's timers, with their events applied at once (a target
    /// deadline abort must make the flow "gone" before its next segment).
    pub fn handle_timeout(&mut self, now: Instant, tcp: &mut Endpoint) {
        self.engine.handle_timeout(now);
        self.settle(now, tcp);
    }

    fn settle(&mut self, now: Instant, tcp: &mut Endpoint) {
        let mut woken = std::mem::take(&mut self.woken);
        self.process_events(now, tcp, &mut woken);
        self.woken = woken;
    }

    /// Handles the engine's events. `woken` collects application handles
    /// whose state changed, so that the runtime wakes their tasks.
    /// The time now: a fresh reading of the stack's clock (never before
    /// `now`), or `now` without one.
    fn fresh(&self, now: Instant) -> Instant {
        self.clock.map_or(now, |c| c.now().max(now))
    }

    pub fn process_events(&mut self, now: Instant, tcp: &mut Endpoint, woken: &mut Vec<ConnId>) {
        woken.append(&mut self.woken);
        self.report_now = now;
        if let Some(d) = &mut self.dump {
            d.drops = (self.dropped_frozen, self.dropped_gone);
            d.tick(now, &self.engine);
        }
        self.managers.poll_waiting(now, &mut self.ready);
        while let Some((flow, target)) = self.ready.pop() {
            if self.by_flow.contains_key(&flow)
                && self.engine.migrate_out(now, flow, target).is_err()
            {
                if let Some(&cid) = self.by_flow.get(&flow) {
                    self.managers.resume(self.app_handle(cid));
                }
            }
        }
        while let Some(ev) = self.engine.poll_event() {
            match ev {
                Event::ExportNow { id, flow } => {
                    let Some(&cid) = self.by_flow.get(&flow) else {
                        // The application closed it meanwhile: nothing to move.
                        let _ = self.engine.abort_out(now, id);
                        continue;
                    };
                    // Handles, managers and wake-ups are keyed by the
                    // application's handle (it differs from the endpoint id
                    // after a resumed migration).
                    let handle = self.app_handle(cid);
                    // Refused before anything is frozen when the queues
                    // alone (then with the application state) are over the
                    // limit: the connection is served on without a pause.
                    if self.refuse_too_large(now, tcp, id, flow, cid, 0) {
                        continue;
                    }
                    let mut app = Vec::new();
                    if self.managers.export(handle, &mut app).is_err() {
                        let _ = self.engine.abort_out(now, id);
                        continue;
                    }
                    if !app.is_empty() && self.refuse_too_large(now, tcp, id, flow, cid, app.len())
                    {
                        continue;
                    }
                    let reset = tcp.peer_reset(cid);
                    let peer_isn = tcp.peer_isn(cid).map(|s| s.0);
                    // `export_to_vec` reserves its cheap upper bound itself
                    // (no sizing walk of the connection), in a buffer the
                    // engine recycles from an earlier migration out.
                    let mut snap = self.engine.snapshot_buffer();
                    match tcp.export_to_vec(now, cid, &app, &mut snap) {
                        Ok(_) => {
                            self.by_flow.remove(&flow);
                            self.aliases.remove(&cid);
                            self.handles.insert(handle, HandleState::Frozen);
                            // The engine keeps the only copy; one it refuses
                            // comes back (the migration then resumes).
                            let done = self.fresh(now);
                            let back = self.engine.offer_snapshot(done, id, snap).err();
                            if let Some((
                                capybara_tcpmig::MigError::SnapshotTooLarge { len, max },
                                _,
                            )) = &back
                            {
                                if let Some(line) = self.too_large_log.note(done, flow, *len, *max)
                                {
                                    eprintln!("{line}");
                                }
                            }
                            let d = self.departed.entry(flow).or_default();
                            d.frozen = Some(Frozen {
                                id,
                                handle,
                                kept: back.map(|(_, s)| s),
                                reset,
                                peer_isn,
                            });
                            d.target = match self.msg_target {
                                Some((f, t)) if f == flow => Some(t),
                                _ => None,
                            };
                        }
                        Err(_) => {
                            self.managers.resume(handle);
                            let _ = self.engine.abort_out(now, id);
                        }
                    }
                }
                Event::MigratedOut { id, flow, target } => {
                    if let Some(Frozen { handle: cid, .. }) =
                        self.take_frozen(now, flow, id, Some(target))
                    {
                        self.owned_at.remove(&flow);
                        self.handles.insert(cid, HandleState::Moved(target));
                        self.managers.gone(cid);
                        woken.push(cid);
                    }
                    self.record(id, flow, Outcome::MigratedOut, target);
                }
                Event::Resumed { id, flow, reason } => {
                    if let Some(&cid) = self.by_flow.get(&flow) {
                        // Given up before the export: the manager resumes.
                        self.managers.resume(self.app_handle(cid));
                    }
                    if let Some(Frozen {
                        handle: cid, kept, ..
                    }) = self.take_frozen(now, flow, id, None)
                    {
                        let snap = kept
                            .or_else(|| self.engine.take_resumed_snapshot(id))
                            .unwrap_or_default();
                        match tcp.import(now, &snap) {
                            Ok(imp) => {
                                self.resumed.insert(imp.id, cid);
                                self.handles.insert(cid, HandleState::Live(imp.id));
                                self.by_flow.insert(flow, imp.id);
                            }
                            Err(_) => {
                                self.handles.insert(cid, HandleState::Lost);
                            }
                        }
                        self.managers.resume(cid);
                        woken.push(cid);
                    }
                    self.record(id, flow, Outcome::Resumed(reason), Ipv4Addr::UNSPECIFIED);
                }
                Event::Lost { id, flow, reason } => {
                    if let Some(Frozen {
                        handle: cid, reset, ..
                    }) = self.take_frozen(now, flow, id, None)
                    {
                        // The client is told now (docs/TCPMIG.md §1.7 rule
                        // 8), not at its next retransmission once the dead
                        // target's entries are gone, or never if it only
                        // waits to receive.
                        if let Some(r) = reset {
                            if tcp.reset_peer(&r) > 0 {
                                self.lost_resets += 1;
                            }
                        }
                        self.owned_at.remove(&flow);
                        self.handles.insert(cid, HandleState::Lost);
                        self.managers.gone(cid);
                        woken.push(cid);
                    }
                    self.record(id, flow, Outcome::Lost(reason), Ipv4Addr::UNSPECIFIED);
                }
                Event::ImportNow {
                    id, flow, origin, ..
                } => {
                    // Imported straight from the reassembly buffer (no copy).
                    let snap = self.engine.snapshot(id).unwrap_or(&[]);
                    let managers = &mut self.managers;
                    let imported = tcp.import(now, snap).and_then(|imp| {
                        let state = snap.get(imp.app_state.clone()).unwrap_or(&[]);
                        match managers.import(flow, imp.id, state) {
                            Ok(()) => Ok(imp),
                            Err(_) => {
                                // Refused by the application: undo silently.
                                tcp.detach(imp.id);
                                Err(capybara_tcp::SnapshotError::InvalidHandle)
                            }
                        }
                    });
                    match imported {
                        Ok(imp) => {
                            // The buffered segments straight into the
                            // imported connection (no flow lookup), its
                            // events and ACK scheduled once at the end.
                            let (local, cid) = (self.local, imp.id);
                            let done = self.fresh(now);
                            let _ = self.engine.import_done(done, id, |seg| {
                                tcp.replay_segment(now, cid, flow.client_ip, local, seg)
                            });
                            tcp.replay_done(cid);
                            self.by_flow.insert(flow, imp.id);
                            self.owned_at.insert(flow, done);
                            self.clear_gone(flow);
                        }
                        Err(_) => {
                            let _ = self.engine.import_failed(now, id);
                            // Like an abort: late segments (some forwarded
                            // by the origin) are dropped, never reset.
                            if !self.by_flow.contains_key(&flow) {
                                self.set_gone(flow, now + GONE_LINGER, None);
                            }
                            self.record(id, flow, Outcome::ImportFailed, origin);
                        }
                    }
                }
                Event::MigratedIn { id, flow, origin } => {
                    self.record(id, flow, Outcome::MigratedIn, origin);
                }
                Event::AbortedIn { id, flow, .. } => {
                    // The switch may still send us the flow's segments (the
                    // entry stays pending toward us until our ABORT decision
                    // passes it, and some are in flight): drop them
                    // silently like those of a gone flow. A RST here would
                    // kill the client's connection, which the origin serves.
                    if !self.by_flow.contains_key(&flow) {
                        self.set_gone(flow, now + GONE_LINGER, None);
                    }
                    self.record(id, flow, Outcome::AbortedIn, Ipv4Addr::UNSPECIFIED);
                }
            }
        }
    }
}

impl Migrator {
    /// At `ExportNow`: refuses the migration `id` (`Resumed{SnapshotTooLarge}`,
    /// logged like a refusal after the export) when the connection's
    /// snapshot with `app_len` bytes of application state is already over
    /// the engine's limit. Returns whether it was refused.
    fn refuse_too_large(
        &mut self,
        now: Instant,
        tcp: &Endpoint,
        id: MigrationId,
        flow: FlowKey,
        cid: ConnId,
        app_len: usize,
    ) -> bool {
        let max = self.engine.config().max_snapshot_bytes;
        let Some(len) = tcp.snapshot_len_over(now, cid, app_len, max) else {
            return false;
        };
        if !matches!(
            self.engine.refuse_snapshot_over_limit(now, id, len),
            Err(capybara_tcpmig::MigError::SnapshotTooLarge { .. })
        ) {
            return false;
        }
        self.too_large_before_export += 1;
        if let Some(line) = self.too_large_log.note(now, flow, len, max) {
            eprintln!("{line}");
        }
        true
    }
}

/// The switch's report of a finished migration, its trigger unknown.
/// `tel`: the engine's telemetry of the migration, read in place.
fn wire_report(
    id: MigrationId,
    flow: FlowKey,
    outcome: Outcome,
    peer: Ipv4Addr,
    tel: Option<&Telemetry>,
) -> WireReport {
    let (outcome, reason) = match outcome {
        Outcome::MigratedOut => (ReportOutcome::MigratedOut, Reason::None),
        Outcome::Resumed(x) => (ReportOutcome::Resumed, x),
        Outcome::Lost(x) => (ReportOutcome::Lost, x),
        Outcome::MigratedIn => (ReportOutcome::MigratedIn, Reason::None),
        Outcome::AbortedIn => (ReportOutcome::AbortedIn, Reason::Unspecified),
        Outcome::ImportFailed => (ReportOutcome::ImportFailed, Reason::ImportFailed),
    };
    let none;
    let t = match tel {
        Some(t) => t,
        None => {
            none = Telemetry::default();
            &none
        }
    };
    WireReport {
        id: id.0,
        flow,
        peer: (!peer.is_unspecified()).then_some(peer),
        outcome,
        trigger: MigrationTrigger::Unknown,
        reason,
        fragments: t.fragments,
        age_us: 0,
        phases_us: report_phases(t, outcome.is_origin()),
        snapshot_bytes: t.snapshot_bytes.min(u64::from(u32::MAX)) as u32,
        segments_buffered: t.segments_buffered,
        bytes_buffered: t.bytes_buffered,
    }
}

/// The flow and target named by a PREPARE_ACK (call only once the engine
/// accepted the message: it is authenticated then).
fn prepare_ack_target(msg: &[u8]) -> Option<(FlowKey, Ipv4Addr)> {
    use capybara_proto::tcpmig::{field, Kind};
    if msg.len() < field::PAYLOAD || Kind::from_u8(msg[field::KIND]) != Some(Kind::PrepareAck) {
        return None;
    }
    let ip = |r: std::ops::Range<usize>| {
        Ipv4Addr::new(
            msg[r.start],
            msg[r.start + 1],
            msg[r.start + 2],
            msg[r.start + 3],
        )
    };
    let port = |r: std::ops::Range<usize>| u16::from_be_bytes([msg[r.start], msg[r.start + 1]]);
    let target = ip(field::TARGET);
    if target.is_unspecified() {
        return None;
    }
    Some((
        FlowKey {
            client_ip: ip(field::CLIENT_IP),
            client_port: port(field::CLIENT_PORT),
            service_ip: ip(field::SERVICE_IP),
            service_port: port(field::SERVICE_PORT),
        },
        target,
    ))
}

/// Benchmarks (`make bench-migration`): every finished migration as one line
/// of `DIR/telemetry-ADDR.log` when `CAPYBARA_MIGRATION_TELEMETRY=DIR` is set
/// in the hostagent's environment. Format (docs/BENCHMARKS.md):
/// `clock local_us=N mono_us=N` lines relate this host's clock to
/// CLOCK_MONOTONIC (shared by every process on the machine, so a bench can
/// put both hosts' timestamps on one timeline), and `mig id=HEX role=out|in
/// outcome=.. flow=.. peer=..` lines carry the [`Telemetry`] and the
/// [`HostCpu`] of one migration on this host.
///
/// Off the per-packet path: every 100 ms the finished migrations' records
/// (plain values) go to a thread of their own, which formats and writes
/// the lines (formatting on the stack's thread showed in its profile and
/// in the CPU time of the message being handled); a migration is written one flush after it
/// finished, so that the messages it still sends (the target's
/// CONN_STATE_ACK) are counted in its CPU time.
pub struct TelemetryDump {
    cpu: Map<u64, capybara_tcpmig::HostCpu>,
    finished: Vec<MigrationRecord>,
    ready: Vec<MigrationRecord>,
    next_flush: Instant,
    tx: std::sync::mpsc::Sender<DumpBatch>,
    /// The glue's silent drops so far (frozen, gone), on `clock` lines.
    drops: (u64, u64),
}

impl TelemetryDump {
    const FLUSH_EVERY: Duration = Duration::from_millis(100);
    /// Entries of messages that belong to no live migration (duplicates
    /// after the end) are dropped beyond this many.
    const MAX_OPEN: usize = 4096;

    fn from_env(local: Ipv4Addr) -> Option<TelemetryDump> {
        let dir = std::env::var_os("CAPYBARA_MIGRATION_TELEMETRY")?;
        let path = std::path::Path::new(&dir).join(format!("telemetry-{local}.log"));
        let mut file = match std::fs::File::create(&path) {
            Ok(f) => f,
            Err(e) => {
                eprintln!("hostagent: telemetry dump {}: {e}", path.display());
                return None;
            }
        };
        let (tx, rx) = std::sync::mpsc::channel::<DumpBatch>();
        std::thread::Builder::new()
            .name("telemetry-dump".into())
            .spawn(move || {
                use std::io::Write;
                let mut out = String::new();
                for batch in rx {
                    out.clear();
                    batch.format(&mut out);
                    if file.write_all(out.as_bytes()).is_err() {
                        return;
                    }
                }
            })
            .ok()?;
        Some(TelemetryDump {
            cpu: map(256),
            finished: Vec::with_capacity(256),
            ready: Vec::with_capacity(256),
            next_flush: Instant::ZERO,
            tx,
            drops: (0, 0),
        })
    }

    fn cpu(&mut self, id: u64) -> &mut capybara_tcpmig::HostCpu {
        if self.cpu.len() >= Self::MAX_OPEN && !self.cpu.contains_key(&id) {
            self.cpu.clear();
        }
        self.cpu.entry(id).or_default()
    }

    /// Adds `ns` spent handling (`rx`) or encoding one TCPMig message.
    fn add_message(&mut self, msg: &[u8], ns: u64, rx: bool) {
        use capybara_proto::tcpmig::{field, Kind};
        let (Some(id), Some(&kind)) = (msg.get(field::MIGRATION_ID), msg.get(field::KIND)) else {
            return;
        };
        let mut b = [0u8; 8];
        b.copy_from_slice(id);
        let slot = capybara_tcpmig::HostCpu::slot(Kind::from_u8(kind));
        let c = self.cpu(u64::from_be_bytes(b));
        if rx {
            c.rx_ns[slot] += ns;
            c.rx_messages += 1;
        } else {
            c.tx_ns[slot] += ns;
            c.tx_messages += 1;
        }
    }

    fn tick(&mut self, now: Instant, engine: &Engine) {
        if now < self.next_flush {
            return;
        }
        self.next_flush = now + Self::FLUSH_EVERY;
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: clock_gettime writes the timespec we own.
        unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
        let mono = ts.tv_sec as u64 * 1_000_000 + ts.tv_nsec as u64 / 1000;
        let mut items = Vec::with_capacity(self.ready.len());
        for r in self.ready.drain(..) {
            let tel = engine.telemetry(r.id).copied().or(r.telemetry);
            let cpu = self.cpu.remove(&r.id.0).unwrap_or_default();
            items.push((r, tel.unwrap_or_default(), cpu));
        }
        std::mem::swap(&mut self.finished, &mut self.ready);
        let _ = self.tx.send(DumpBatch {
            local_us: now.as_micros(),
            mono_us: mono,
            drops: self.drops,
            items,
        });
    }
}

/// What [`TelemetryDump`] hands its writer thread every flush.
struct DumpBatch {
    local_us: u64,
    mono_us: u64,
    drops: (u64, u64),
    items: Vec<(MigrationRecord, Telemetry, capybara_tcpmig::HostCpu)>,
}

impl DumpBatch {
    fn format(&self, out: &mut String) {
        use std::fmt::Write;
        let _ = writeln!(
            out,
            "clock local_us={} mono_us={} dropped_frozen={} dropped_gone={}",
            self.local_us, self.mono_us, self.drops.0, self.drops.1
        );
        for (r, tel, cpu) in &self.items {
            let role = match r.outcome {
                Outcome::MigratedIn | Outcome::AbortedIn | Outcome::ImportFailed => "in",
                _ => "out",
            };
            let _ = write!(
                out,
                "mig id={:016x} role={role} outcome={:?} flow={} peer={}",
                r.id.0, r.outcome, r.flow, r.peer
            );
            tel.write_kv(out);
            cpu.write_kv(out);
            out.push('\n');
        }
    }
}

/// Phase durations of a report, in microseconds ([`PHASE_NOT_REACHED`] for
/// a phase this host did not see), in the order of
/// `capybara_proto::control::REPORT_PHASES`:
/// - prepare: PREPARE sent to PREPARE_ACK received (origin);
/// - export: PREPARE_ACK received to the snapshot handed over (origin);
/// - transfer: first CONN_STATE burst sent to CONN_STATE_ACK (origin);
/// - import: snapshot complete to imported and buffered segments replayed (target);
/// - total: `migrate_out` to CONN_STATE_ACK (origin), PREPARE to import done (target).
pub fn report_phases(t: &Telemetry, origin: bool) -> [u32; 5] {
    let us = |from: Option<Instant>, to: Option<Instant>| match (from, to) {
        (Some(a), Some(b)) => (b - a).as_micros().min(u128::from(PHASE_NOT_REACHED - 1)) as u32,
        _ => PHASE_NOT_REACHED,
    };
    let total = if origin {
        us(t.started, t.state_ack_received)
    } else {
        us(t.prepare_received, t.import_done)
    };
    [
        us(t.prepare_sent, t.prepare_ack_received),
        us(t.prepare_ack_received, t.export_done),
        us(t.state_sent, t.state_ack_received),
        us(t.state_received, t.replayed.or(t.import_done)),
        total,
    ]
}

#[cfg(test)]
mod report_tests {
    use super::*;

    #[test]
    fn phases_come_from_the_telemetry_timestamps() {
        let at = Instant::from_micros;
        let origin = Telemetry {
            started: Some(at(100)),
            prepare_sent: Some(at(101)),
            prepare_ack_received: Some(at(141)),
            export_done: Some(at(150)),
            state_sent: Some(at(152)),
            state_ack_received: Some(at(230)),
            ..Default::default()
        };
        assert_eq!(
            report_phases(&origin, true),
            [40, 9, 78, PHASE_NOT_REACHED, 130]
        );
        let target = Telemetry {
            prepare_received: Some(at(120)),
            state_received: Some(at(200)),
            import_done: Some(at(211)),
            replayed: Some(at(212)),
            ..Default::default()
        };
        let p = report_phases(&target, false);
        assert_eq!((p[0], p[3], p[4]), (PHASE_NOT_REACHED, 12, 91));
        // A resumed migration: only the phases reached.
        let resumed = Telemetry {
            started: Some(at(100)),
            prepare_sent: Some(at(101)),
            ..Default::default()
        };
        assert!(report_phases(&resumed, true)
            .iter()
            .all(|p| *p == PHASE_NOT_REACHED));
    }
}

#[cfg(test)]
mod late_segment_tests {
    use super::*;
    use capybara_tcpmig::{EngineConfig, MigrationKey};

    /// The frozen connection of migration 7 (handle 1), whose client's
    /// initial sequence number is `peer_isn`.
    fn frozen7(peer_isn: Option<u32>) -> Frozen {
        Frozen {
            id: MigrationId(7),
            handle: ConnId(1),
            kept: None,
            reset: None,
            peer_isn,
        }
    }

    fn migrator() -> Migrator {
        let local = Ipv4Addr::new(10, 0, 0, 1);
        let cfg = EngineConfig::new(local, Ipv4Addr::new(10, 0, 0, 254));
        let key = MigrationKey::from_bytes(&[7; 32]).expect("key");
        let mut m = Migrator::new(Engine::new(cfg, key).expect("engine"), local);
        m.forward_late = true;
        m
    }

    fn flow() -> FlowKey {
        FlowKey {
            client_ip: Ipv4Addr::new(10, 1, 0, 9),
            client_port: 40000,
            service_ip: Ipv4Addr::new(10, 9, 0, 1),
            service_port: 80,
        }
    }

    #[test]
    fn late_segments_go_to_the_known_target_only() {
        let mut m = migrator();
        let (f, target) = (flow(), Ipv4Addr::new(10, 0, 0, 2));
        let now = Instant::from_micros(1_000);
        let seg = [0u8; 20];
        assert_eq!(m.segment_verdict(now, f, &seg), SegmentVerdict::Process);
        // Frozen, target unknown (no PREPARE_ACK seen): dropped.
        m.departed.entry(f).or_default().frozen = Some(frozen7(None));
        assert_eq!(m.segment_verdict(now, f, &seg), SegmentVerdict::Drop);
        assert_eq!(m.dropped_frozen, 1);
        // Frozen after PREPARE_ACK: forwarded.
        m.departed.entry(f).or_default().target = Some(target);
        assert_eq!(
            m.segment_verdict(now, f, &seg),
            SegmentVerdict::Forward(target)
        );
        // The bool form never forwards.
        assert!(!m.filter_segment(now, f, &seg));
        // Gone (migrated out) within GONE_LINGER: forwarded; after: served.
        // (Another migration's outcome leaves it frozen.)
        assert!(m
            .take_frozen(now, f, MigrationId(8), Some(target))
            .is_none());
        assert!(m
            .take_frozen(now, f, MigrationId(7), Some(target))
            .is_some());
        assert_eq!(
            m.segment_verdict(now, f, &seg),
            SegmentVerdict::Forward(target)
        );
        assert_eq!((m.forwarded_frozen, m.forwarded_gone), (1, 1));
        let later = now + GONE_LINGER + Duration::from_millis(1);
        assert_eq!(m.segment_verdict(later, f, &seg), SegmentVerdict::Process);
        assert!(!m.departed.contains_key(&f));
        // Gone without a target (the target side after an abort): dropped.
        m.set_gone(f, later + GONE_LINGER, None);
        assert_eq!(m.segment_verdict(later, f, &seg), SegmentVerdict::Drop);
        // Switched off: dropped as before.
        m.departed.entry(f).or_default().target = Some(target);
        m.forward_late = false;
        assert_eq!(m.segment_verdict(later, f, &seg), SegmentVerdict::Drop);
    }

    #[test]
    fn late_segments_that_do_not_stop_make_the_origin_name_the_owner() {
        let mut m = migrator();
        let (f, target) = (flow(), Ipv4Addr::new(10, 0, 0, 2));
        let now = Instant::from_micros(1_000);
        let seg = [0u8; 20];
        m.departed.entry(f).or_default().frozen = Some(frozen7(None));
        assert!(m
            .take_frozen(now, f, MigrationId(7), Some(target))
            .is_some());
        let mut out = Vec::new();
        // Segments in flight when the switch flipped: forwarded, no repair.
        let soon = now + (OWNER_REPAIR_AFTER - Duration::from_millis(1));
        assert_eq!(
            m.segment_verdict(soon, f, &seg),
            SegmentVerdict::Forward(target)
        );
        m.take_owner_repairs(&mut out);
        assert!(out.is_empty());
        // Still coming after OWNER_REPAIR_AFTER: the switch routes the flow
        // here; one repair naming the target, not one per segment.
        let late = now + OWNER_REPAIR_AFTER;
        for k in 0..10 {
            let t = late + Duration::from_millis(k);
            assert_eq!(
                m.segment_verdict(t, f, &seg),
                SegmentVerdict::Forward(target)
            );
        }
        m.take_owner_repairs(&mut out);
        assert_eq!(out, vec![(f, target)]);
        assert_eq!(m.owner_repairs_total, 1);
        // Again after OWNER_REPAIR_EVERY if they still come (SET_OWNER lost).
        out.clear();
        let again = late + OWNER_REPAIR_EVERY;
        assert_eq!(
            m.segment_verdict(again, f, &seg),
            SegmentVerdict::Forward(target)
        );
        m.take_owner_repairs(&mut out);
        assert_eq!(out, vec![(f, target)]);
        // Served here again (migrated back): no repair.
        out.clear();
        m.clear_gone(f);
        assert_eq!(
            m.segment_verdict(again + OWNER_REPAIR_EVERY, f, &seg),
            SegmentVerdict::Process
        );
        m.take_owner_repairs(&mut out);
        assert!(out.is_empty());
        // Gone without a target (the target side of an abort): nothing to name.
        m.set_gone(f, again + GONE_LINGER, None);
        assert_eq!(
            m.segment_verdict(again + OWNER_REPAIR_EVERY, f, &seg),
            SegmentVerdict::Drop
        );
        m.take_owner_repairs(&mut out);
        assert!(out.is_empty());
    }

    /// Segments of [`flow`] with sequence number `seq` and each of `flags`
    /// are forwarded to `target`.
    fn assert_forwarded(m: &mut Migrator, now: Instant, seq: u32, flags: &[u8], target: Ipv4Addr) {
        let mut seg = [0u8; 20];
        seg[4..8].copy_from_slice(&seq.to_be_bytes());
        for &f in flags {
            seg[13] = f;
            assert_eq!(
                m.segment_verdict(now, flow(), &seg),
                SegmentVerdict::Forward(target),
                "flags {f:#x}"
            );
        }
    }

    #[test]
    fn a_new_connection_on_a_frozen_tuple_is_dropped_not_forwarded() {
        let mut m = migrator();
        let (f, target) = (flow(), Ipv4Addr::new(10, 0, 0, 2));
        let now = Instant::from_micros(1_000);
        let old_isn = 0x1234_5678u32;
        let d = m.departed.entry(f).or_default();
        d.frozen = Some(frozen7(Some(old_isn)));
        d.target = Some(target);
        // The frozen connection's segments (its own SYN too) go on to the
        // target it is moving to.
        assert_forwarded(&mut m, now, old_isn, &[0x10, 0x18, 0x04, 0x02], target);
        let mut seg = [0u8; 20];
        // A new connection's SYN (the client reset the frozen one and
        // reconnected from the same port): dropped, the client retries it
        // once the migration has its outcome; the frozen state stays.
        seg[4..8].copy_from_slice(&0x9000_0001u32.to_be_bytes());
        seg[13] = 0x02;
        assert_eq!(m.segment_verdict(now, f, &seg), SegmentVerdict::Drop);
        assert_eq!((m.forwarded_frozen, m.dropped_frozen), (4, 1));
        assert!(m.departed.get(&f).is_some_and(|d| d.frozen.is_some()));
        // Once gone (migrated out), that SYN is served here.
        assert!(m
            .take_frozen(now, f, MigrationId(7), Some(target))
            .is_some());
        assert_eq!(m.segment_verdict(now, f, &seg), SegmentVerdict::Process);
    }

    #[test]
    fn a_new_connection_on_a_tuple_that_left_is_served_here() {
        let mut m = migrator();
        let (f, target) = (flow(), Ipv4Addr::new(10, 0, 0, 2));
        let now = Instant::from_micros(1_000);
        let old_isn = 0x1234_5678u32;
        let mut seg = [0u8; 20];
        let gone = |m: &mut Migrator| {
            m.departed.entry(f).or_default().frozen = Some(frozen7(Some(old_isn)));
            assert!(m
                .take_frozen(now, f, MigrationId(7), Some(target))
                .is_some());
        };
        gone(&mut m);
        // The old connection's late segments (ACK, SYN+ACK, RST, and its
        // own SYN duplicated or retransmitted) go on to its target.
        assert_forwarded(
            &mut m,
            now,
            old_isn,
            &[0x10, 0x12, 0x04, 0x14, 0x02],
            target,
        );
        // A SYN with another sequence number reuses the tuple (the client
        // reset the old connection and the switch placed the new one
        // here): served here, and so is the rest of the new connection.
        seg[4..8].copy_from_slice(&0x9000_0001u32.to_be_bytes());
        seg[13] = 0x02;
        assert_eq!(m.segment_verdict(now, f, &seg), SegmentVerdict::Process);
        assert!(!m.departed.contains_key(&f));
        seg[13] = 0x10;
        assert_eq!(m.segment_verdict(now, f, &seg), SegmentVerdict::Process);
        // Gone without a known connection (the target side after an
        // abort: dropped): any SYN is a new connection.
        m.set_gone(f, now + GONE_LINGER, None);
        assert_eq!(m.segment_verdict(now, f, &seg), SegmentVerdict::Drop);
        seg[13] = 0x02;
        assert_eq!(m.segment_verdict(now, f, &seg), SegmentVerdict::Process);
        // A truncated segment is no SYN.
        m.set_gone(f, now + GONE_LINGER, None);
        assert_eq!(m.segment_verdict(now, f, &seg[..13]), SegmentVerdict::Drop);
        // A new departure forgets the older connection's SYN.
        gone(&mut m);
        m.set_gone(f, now + GONE_LINGER, None);
        seg[4..8].copy_from_slice(&old_isn.to_be_bytes());
        assert_eq!(m.segment_verdict(now, f, &seg), SegmentVerdict::Process);
    }

    #[test]
    fn prepare_ack_names_flow_and_target() {
        use capybara_proto::tcpmig::{field, Kind};
        let f = flow();
        let mut msg = [0u8; field::PAYLOAD];
        msg[field::KIND] = Kind::PrepareAck.to_u8();
        msg[field::CLIENT_IP].copy_from_slice(&f.client_ip.octets());
        msg[field::CLIENT_PORT].copy_from_slice(&f.client_port.to_be_bytes());
        msg[field::SERVICE_IP].copy_from_slice(&f.service_ip.octets());
        msg[field::SERVICE_PORT].copy_from_slice(&f.service_port.to_be_bytes());
        msg[field::TARGET].copy_from_slice(&[10, 0, 0, 2]);
        assert_eq!(
            prepare_ack_target(&msg),
            Some((f, Ipv4Addr::new(10, 0, 0, 2)))
        );
        assert_eq!(prepare_ack_target(&msg[..field::PAYLOAD - 1]), None);
        msg[field::KIND] = Kind::Prepare.to_u8();
        assert_eq!(prepare_ack_target(&msg), None);
    }
}

#[cfg(test)]
mod claim_tests {
    use super::*;
    use capybara_tcpmig::{EngineConfig, MigrationKey};

    #[test]
    fn claims_list_the_served_connections_with_their_age_and_epoch() {
        let local = Ipv4Addr::new(10, 0, 0, 1);
        let cfg = EngineConfig::new(local, Ipv4Addr::new(10, 0, 0, 254));
        let key = MigrationKey::from_bytes(&[7; 32]).expect("key");
        let mut m = Migrator::new(Engine::new(cfg, key).expect("engine"), local);
        let flow = |port| FlowKey {
            client_ip: Ipv4Addr::new(10, 1, 0, 9),
            client_port: port,
            service_ip: Ipv4Addr::new(10, 9, 0, 1),
            service_port: 80,
        };
        m.report_now = Instant::from_millis(1_000);
        m.track(flow(1), ConnId(1));
        m.report_now = Instant::from_millis(3_000);
        m.track(flow(2), ConnId(2));
        let mut out = Vec::new();
        m.claims(Instant::from_millis(5_000), &mut out);
        out.sort_by_key(|c| c.flow.client_port);
        let got: Vec<(u16, u64, u32)> = out
            .iter()
            .map(|c| (c.flow.client_port, c.epoch, c.owned_ms))
            .collect();
        // Placed here (epoch 0), taken 4 s and 2 s ago.
        assert_eq!(got, vec![(1, 0, 4_000), (2, 0, 2_000)]);
        // Closed: no longer claimed.
        m.untrack(Some(flow(1)), ConnId(1));
        out.clear();
        m.claims(Instant::from_millis(5_000), &mut out);
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].flow, flow(2));
        assert_eq!(m.owned_at.len(), 1, "its age is forgotten too");
    }
}

#[cfg(test)]
mod too_large_log_tests {
    use super::*;

    #[test]
    fn an_oversized_snapshot_is_logged_with_the_connection_and_sizes_rate_limited() {
        let flow = FlowKey {
            client_ip: Ipv4Addr::new(10, 1, 0, 9),
            client_port: 40000,
            service_ip: Ipv4Addr::new(10, 0, 0, 100),
            service_port: 80,
        };
        let mut log = TooLargeLog::default();
        let t0 = Instant::from_millis(5_000);
        let line = log.note(t0, flow, 300_000, 262_144).expect("first line");
        assert!(line.contains("10.1.0.9:40000->10.0.0.100:80"), "{line}");
        assert!(
            line.contains("snapshot 300000 bytes > limit 262144 bytes"),
            "{line}"
        );
        assert!(line.contains("snapshot too large"), "{line}");
        // Within the interval: counted, not printed.
        for _ in 0..3 {
            assert_eq!(log.note(t0 + Duration::from_secs(1), flow, 1, 0), None);
        }
        let line = log
            .note(t0 + TooLargeLog::EVERY, flow, 300_001, 262_144)
            .expect("after the interval");
        assert!(line.contains("(3 more since the last such line)"), "{line}");
        let line = log
            .note(t0 + TooLargeLog::EVERY * 3, flow, 300_001, 262_144)
            .expect("after another interval");
        assert!(!line.contains("more since"), "{line}");
    }
}
