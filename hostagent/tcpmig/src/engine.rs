//! The migration engine: one table of migration records (origin and target
//! role), a bounded transmit queue and a bounded event queue.
//!
//! Record life cycle (details and diagrams in `docs/MIGRATION.md`):
//!
//! ```text
//! origin: Preparing -> Exporting -> Sending -> Done(migrated out)
//!            |  \          |           \-> InDoubt -> Done(migrated out | resumed | lost)
//!            |   \---------+-> AbortNotify -> Done      (deadline before any state was sent)
//!            \-> Done(resumed: REJECT or target's ABORT)
//! target: Buffering -> Importing -> Committed
//!            \-> Aborted (deadline, origin's request)   Importing -> Aborted (import failed)
//!         (PREPARE refused) Rejected
//! ```
//!
//! Invariants:
//! - a target record leaves `Committed` only by expiring; no ABORT is ever
//!   sent for a committed migration (this is what makes the switch entry
//!   converge to the owner);
//! - an origin record sends CONN_STATE only in `Sending`, and resumes the
//!   connection on its own only from `Preparing`/`Exporting`;
//! - `by_flow_in` holds exactly the target records in `Buffering` or
//!   `Importing`; `by_flow_out` the origin records not yet `Done`;
//! - queues never grow past their pre-sized capacity.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};

/// Hasher of the engine's tables: flow keys come from the network and
/// migration ids from peers, so keyed foldhash (`capybara_proto::hash`); a
/// migration does some 15 lookups here, each ~10 instructions instead of
/// SipHash-1-3's ~100.
pub use capybara_proto::hash::{keyed_map as map, KeyedHasher as Hasher, KeyedMap as Map};
use std::net::Ipv4Addr;

use capybara_proto::frag::{max_fragment_payload, split_chunks, Progress, Reassembly};
use capybara_proto::tcpmig::{Kind, Reason, TcpMigError, TcpMigRepr};
use capybara_proto::time::{Duration, Instant};
use capybara_proto::{FlowKey, MigrationKey};

use crate::config::{BufferMode, ConfigError, EngineConfig};
use crate::counters::Counters;
use crate::error::{MigError, RxError};
use crate::segbuf::SegmentBuffer;
use crate::telemetry::Telemetry;
use crate::MigrationId;

/// Something the stack (or the operator) must act on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// Origin: the target is ready and the switch redirects the flow. Freeze
    /// the connection (stop reading, sending and timers), serialise it with
    /// its application state and call [`Engine::provide_snapshot`]. Keep the
    /// frozen connection until `MigratedOut`, `Resumed` or `Lost`.
    ExportNow { id: MigrationId, flow: FlowKey },
    /// Origin: the target imported the connection. Destroy the local copy
    /// silently (no FIN, no RST); socket calls report "migrated". Its
    /// [`Engine::telemetry`] is final (the record stays as a tombstone):
    /// events carry no copy of it, which kept every event ~200 bytes.
    MigratedOut {
        id: MigrationId,
        flow: FlowKey,
        target: Ipv4Addr,
    },
    /// Origin: the migration did not happen; unfreeze and keep serving.
    Resumed {
        id: MigrationId,
        flow: FlowKey,
        reason: Reason,
    },
    /// Origin: the state was sent but the target never told the outcome
    /// within `in_doubt_limit` (target host failure). Neither copy can be
    /// trusted: close the connection (RST), as for any host failure.
    Lost {
        id: MigrationId,
        flow: FlowKey,
        reason: Reason,
    },
    /// Target: the whole snapshot is here; read it with
    /// [`Engine::snapshot`], import it, then call [`Engine::import_done`]
    /// (or [`Engine::import_failed`]). The imported connection must not
    /// send anything before `import_done` returns.
    ImportNow {
        id: MigrationId,
        flow: FlowKey,
        origin: Ipv4Addr,
        snapshot_len: usize,
    },
    /// Target: the connection is ours (emitted by `import_done`). Its
    /// [`Engine::telemetry`] is final (the record stays as a tombstone).
    MigratedIn {
        id: MigrationId,
        flow: FlowKey,
        origin: Ipv4Addr,
    },
    /// Target: a migration in was given up before import; its buffered
    /// segments were discarded (the client retransmits them to the origin).
    AbortedIn {
        id: MigrationId,
        flow: FlowKey,
        reason: Reason,
    },
}

/// A datagram written by [`Engine::poll_transmit`]: send `buf[..len]` as
/// the payload of a UDP datagram from the local data address, port 7690, to
/// `dst`, port 7690.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transmit {
    pub dst: Ipv4Addr,
    pub len: usize,
}

/// What happened to a client segment handed to [`Engine::buffer_segment`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BufferVerdict {
    /// Kept; it will be replayed after import.
    Buffered,
    /// Dropped as TCP drops a segment beyond the window: the client
    /// retransmits it, the connection is unaffected.
    Dropped(DropCause),
    /// The flow is not being migrated in: the stack handles the segment as
    /// usual (no connection: the stack's normal rules).
    NotMigrating,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DropCause {
    /// The per-flow bound (bytes or segments) is reached.
    BufferFull,
    /// `BufferMode::Drop` (ablation).
    DropMode,
}

/// What `import_done` replayed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ReplaySummary {
    pub segments: usize,
    pub bytes: usize,
}

/// Target-side accept hook: called for every new PREPARE that passed the
/// built-in checks (capacity, draining, duplicates); `Err(reason)` rejects.
pub type AcceptHook = Box<dyn FnMut(&FlowKey, Ipv4Addr) -> Result<(), Reason> + Send>;

/// Public view of a record's phase.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    Origin(OriginPhase),
    Target(TargetPhase),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OriginPhase {
    Preparing,
    Exporting,
    Sending,
    InDoubt,
    /// Resumed locally; still telling the target to let go.
    AbortNotify,
    Done,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TargetPhase {
    Buffering,
    Importing,
    Committed,
    Rejected(Reason),
    Aborted(Reason),
}

impl OriginPhase {
    fn name(self) -> &'static str {
        match self {
            OriginPhase::Preparing => "preparing",
            OriginPhase::Exporting => "exporting",
            OriginPhase::Sending => "sending state",
            OriginPhase::InDoubt => "in doubt",
            OriginPhase::AbortNotify => "aborted (notifying target)",
            OriginPhase::Done => "finished",
        }
    }
}

impl TargetPhase {
    fn name(self) -> &'static str {
        match self {
            TargetPhase::Buffering => "buffering",
            TargetPhase::Importing => "importing",
            TargetPhase::Committed => "committed",
            TargetPhase::Rejected(_) => "rejected",
            TargetPhase::Aborted(_) => "aborted",
        }
    }
}

struct OutMig {
    flow: FlowKey,
    /// Ownership epoch sent in every message (id of the migration that
    /// gave us the flow, 0 for its placement).
    epoch: u64,
    /// Unspecified until a PREPARE_ACK names it (unless explicit).
    target: Ipv4Addr,
    explicit: bool,
    phase: OriginPhase,
    /// Phase deadline: migration deadline, in-doubt limit, or expiry of
    /// the record once finished.
    deadline: Instant,
    retx_at: Option<Instant>,
    rto: Duration,
    abort_reason: Reason,
    /// In `Done`: whether the connection stayed here (resumed or lost).
    kept: bool,
    /// The retained copy of the snapshot (until CONN_STATE_ACK).
    snapshot: Vec<u8>,
    chunk: usize,
    frag_count: u16,
    /// Next fragment of the current burst.
    cursor: u16,
    seq: u32,
    queued: u8,
    /// The time of this record's live entry in `Engine::timers` (`None`:
    /// no live entry).
    armed: Option<Instant>,
    tel: Telemetry,
}

struct InBuffers {
    segments: SegmentBuffer,
    reassembly: Reassembly,
}

struct InMig {
    flow: FlowKey,
    origin: Ipv4Addr,
    /// The origin's ownership epoch from PREPARE, echoed in every answer.
    epoch: u64,
    phase: TargetPhase,
    deadline: Option<Instant>,
    bufs: Option<InBuffers>,
    retx_at: Option<Instant>,
    rto: Duration,
    repeats_left: u8,
    /// Rate limit of answers to duplicate CONN_STATE fragments.
    last_answer: Option<Instant>,
    seq: u32,
    queued: u8,
    /// The time of this record's live entry in `Engine::timers`.
    armed: Option<Instant>,
    tel: Telemetry,
}

enum Record {
    Out(OutMig),
    In(InMig),
}

/// One message waiting for `poll_transmit`. Control messages are complete
/// here (they may answer a migration we hold no record of); CONN_STATE
/// items refer to the origin record, which holds the snapshot and cursor.
#[derive(Debug, Clone, Copy)]
struct TxItem {
    dst: Ipv4Addr,
    kind: Kind,
    id: u64,
    flow: FlowKey,
    origin: Ipv4Addr,
    target: Ipv4Addr,
    reason: Reason,
    epoch: u64,
    /// Belongs to a record (dedup bit, seq, telemetry).
    recorded: bool,
}

impl TxItem {
    /// The message for this item. Every datagram the engine sends is built
    /// here (control messages and CONN_STATE fragments alike).
    fn repr<'p>(
        &self,
        seq: u32,
        frag_index: u16,
        frag_count: u16,
        payload: &'p [u8],
    ) -> TcpMigRepr<'p> {
        TcpMigRepr {
            kind: self.kind,
            migration_id: self.id,
            flow: self.flow,
            origin: self.origin,
            target: self.target,
            seq,
            frag_index,
            frag_count,
            reason: self.reason,
            epoch: self.epoch,
            payload,
        }
    }

    /// A stateless answer to `m` (no record): same migration, flow, origin
    /// and epoch.
    fn answer(
        m: &TcpMigRepr<'_>,
        dst: Ipv4Addr,
        kind: Kind,
        target: Ipv4Addr,
        reason: Reason,
    ) -> TxItem {
        TxItem {
            dst,
            kind,
            id: m.migration_id,
            flow: m.flow,
            origin: m.origin,
            target,
            reason,
            epoch: m.epoch,
            recorded: false,
        }
    }
}

fn kind_bit(k: Kind) -> u8 {
    1 << (k.to_u8() - 1)
}

/// How far above the last migration id the switch saw from this host a
/// seeded counter starts ([`Engine::seed_migration_counter`]): room for ids
/// the switch had not recorded when it answered (a concurrent update of its
/// per-origin record on another CPU may leave an id a few behind the
/// newest). About a minute of the clock seed; the counter's serial window
/// is 2^31.
pub const SEED_MARGIN: u32 = 1 << 16;

/// The migration engine of one host.
pub struct Engine {
    cfg: EngineConfig,
    /// The configuration the engine was created with: what
    /// [`Engine::set_migration_deadline`] scales from and what a `None`
    /// deadline or a `buffer` policy restores.
    created: EngineConfig,
    key: MigrationKey,
    chunk: usize,
    next_seq: u32,
    /// [`Engine::seed_migration_counter`] was called, or the configuration
    /// does not wait for it (`hold_until_seeded`).
    seeded: bool,
    draining: bool,
    hook: Option<AcceptHook>,
    records: Map<u64, Record>,
    by_flow_out: Map<FlowKey, u64>,
    by_flow_in: Map<FlowKey, u64>,
    /// Ownership epoch of flows this host received by migration (the id of
    /// that migration); absent = placement (epoch 0). Bounded by
    /// `max_epochs`, pre-sized: inserting never allocates.
    epochs: Map<FlowKey, u64>,
    tx: VecDeque<TxItem>,
    events: VecDeque<Event>,
    pool: Vec<InBuffers>,
    counters: Counters,
    /// Timer heap with lazy deletion: `(due, id)`, earliest first. A
    /// record's live entry is the one whose time equals its `armed`; every
    /// other entry of it is stale and skipped. Every public call that may
    /// change a record's timers re-arms that record (`rearm`) and then pops
    /// stale entries off the top, so `poll_timeout` is a peek. Scanning
    /// every record instead (thousands lingering at 500 migrations/s, several
    /// times per poll iteration) was half of a hostagent's CPU in
    /// `make bench-migration`. Pre-sized to `timer_cap`; when full it is
    /// rebuilt from the records' live entries (never grows).
    timers: BinaryHeap<Reverse<(Instant, u64)>>,
    /// The live entries of finished records (which only wait for their
    /// expiry, `linger` after they finished, rounded to `EXPIRY_GRAIN_US`)
    /// in time order, with the same lazy deletion: such expiries come in
    /// the order records finish, so a queue holds them without sifting,
    /// and the heap keeps only the few records in progress (with ~1,500
    /// lingering records per host in `make bench-migration`, each re-arm
    /// sifted through all of them). An expiry earlier than the queue's
    /// back goes to the heap. Pre-sized to `timer_cap`, never grown.
    expiries: VecDeque<(Instant, u64)>,
    timer_cap: usize,
    /// Ids whose entries `handle_timeout` popped (pre-sized like `timers`).
    due: Vec<u64>,
    /// Times the heap was full and rebuilt from the live entries.
    timer_rebuilds: u64,
    /// Buffers of delivered snapshots, for the next exports
    /// (`Engine::snapshot_buffer`): a migration out then allocates no
    /// snapshot buffer. Pre-sized to `SPARE_SNAPSHOTS`.
    spare_snapshots: Vec<Vec<u8>>,
}

/// Snapshot buffers kept for reuse, and the largest capacity kept (a
/// full-queue connection's buffer is freed rather than held).
const SPARE_SNAPSHOTS: usize = 8;
const SPARE_SNAPSHOT_MAX_BYTES: usize = 64 * 1024;

/// Expiry of finished records (`linger`) is rounded up to this grain in
/// the timer heap, so that they expire in batches (one `handle_timeout`
/// scan) instead of one wake-up each.
const EXPIRY_GRAIN_US: u64 = 100_000;

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("local_addr", &self.cfg.local_addr)
            .field("records", &self.records.len())
            .field("tx_queued", &self.tx.len())
            .field("events", &self.events.len())
            .finish()
    }
}

/// The parts of the engine a record handler may touch besides the record.
struct Ctx<'a> {
    cfg: &'a EngineConfig,
    tx: &'a mut VecDeque<TxItem>,
    events: &'a mut VecDeque<Event>,
    counters: &'a mut Counters,
    pool: &'a mut Vec<InBuffers>,
    by_flow_in: &'a mut Map<FlowKey, u64>,
    by_flow_out: &'a mut Map<FlowKey, u64>,
    epochs: &'a mut Map<FlowKey, u64>,
    spare_snapshots: &'a mut Vec<Vec<u8>>,
}

impl Ctx<'_> {
    /// Queues a message unless the queue is full (the peer's or our own
    /// retransmission recovers) or, for record messages, already queued.
    fn queue(&mut self, item: TxItem, queued: Option<&mut u8>) {
        if let Some(q) = queued {
            if *q & kind_bit(item.kind) != 0 {
                return;
            }
            if self.tx.len() >= self.cfg.max_tx_queue {
                self.counters.tx_queue_full += 1;
                return;
            }
            *q |= kind_bit(item.kind);
        } else if self.tx.len() >= self.cfg.max_tx_queue {
            self.counters.tx_queue_full += 1;
            return;
        }
        self.tx.push_back(item);
    }

    fn event(&mut self, e: Event) {
        // Pre-sized to the record limit times the few events a record can
        // produce between two polls; a driver that never polls events
        // would grow it, which is its bug, not a packet-path allocation.
        self.events.push_back(e);
    }

    fn release(&mut self, bufs: Option<InBuffers>) {
        if let Some(mut b) = bufs {
            if self.pool.len() < self.cfg.max_concurrent_in {
                b.segments.clear();
                b.reassembly.reset();
                self.pool.push(b);
            }
        }
    }

    /// Keeps the buffer of a delivered snapshot for a later export
    /// (bounded in number and size; others are freed).
    fn recycle_snapshot(&mut self, mut buf: Vec<u8>) {
        if self.spare_snapshots.len() < SPARE_SNAPSHOTS
            && buf.capacity() > 0
            && buf.capacity() <= SPARE_SNAPSHOT_MAX_BYTES
        {
            buf.clear();
            self.spare_snapshots.push(buf);
        }
    }

    fn backoff(&self, rto: Duration) -> Duration {
        (rto * 2).min(self.cfg.rto_max)
    }
}

fn out_item(id: u64, r: &OutMig, kind: Kind, dst: Ipv4Addr, local: Ipv4Addr) -> TxItem {
    TxItem {
        dst,
        kind,
        id,
        flow: r.flow,
        origin: local,
        target: r.target,
        reason: if kind == Kind::Abort {
            r.abort_reason
        } else {
            Reason::None
        },
        epoch: r.epoch,
        recorded: true,
    }
}

fn in_item(id: u64, r: &InMig, kind: Kind, reason: Reason, local: Ipv4Addr) -> TxItem {
    TxItem {
        dst: r.origin,
        kind,
        id,
        flow: r.flow,
        origin: r.origin,
        target: local,
        reason,
        epoch: r.epoch,
        recorded: true,
    }
}

/// Where an origin's ABORT request goes: to the target if known, otherwise
/// to the switch, which steers it along its pending entry for the flow.
fn abort_request_dst(r: &OutMig, cfg: &EngineConfig) -> Ipv4Addr {
    if r.target.is_unspecified() {
        cfg.switch_addr
    } else {
        r.target
    }
}

impl Engine {
    /// Creates an engine; allocates its queues and tables now.
    pub fn new(cfg: EngineConfig, key: MigrationKey) -> Result<Engine, ConfigError> {
        cfg.validate()?;
        let chunk = max_fragment_payload(cfg.path_mtu);
        let table = (cfg.max_concurrent_in + cfg.max_concurrent_out).min(cfg.max_records);
        // Live entries: one per record (at most `max_records` plus the
        // targets admitted past it); the rest of the room is for stale ones.
        let timer_cap = 2 * (cfg.max_records + cfg.max_concurrent_in) + 64;
        Ok(Engine {
            chunk,
            next_seq: cfg.first_migration_seq,
            seeded: !cfg.hold_until_seeded,
            draining: false,
            hook: None,
            records: map(table),
            by_flow_out: map(cfg.max_concurrent_out),
            by_flow_in: map(cfg.max_concurrent_in),
            epochs: map(cfg.max_epochs),
            tx: VecDeque::with_capacity(cfg.max_tx_queue),
            events: VecDeque::with_capacity(table * 2),
            pool: Vec::with_capacity(cfg.max_concurrent_in),
            counters: Counters::default(),
            timers: BinaryHeap::with_capacity(timer_cap),
            expiries: VecDeque::with_capacity(timer_cap),
            timer_cap,
            due: Vec::with_capacity(timer_cap),
            timer_rebuilds: 0,
            spare_snapshots: Vec::with_capacity(SPARE_SNAPSHOTS),
            key,
            created: cfg.clone(),
            cfg,
        })
    }

    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// Applies an origin migration deadline (the store's
    /// `migration_deadline_ms`, carried by POLICY) to the migrations started
    /// from now on; `None` restores the one the engine was created with.
    /// The bounds tied to it follow so that [`EngineConfig::validate`] keeps
    /// holding: the snapshot-scaled cap (`migration_deadline_max`) and the
    /// target's deadlines keep the margins they had over it at creation
    /// (never below their created values), and `linger` grows to outlast
    /// the longest deadline plus `in_doubt_limit` but never shrinks, since
    /// migrations started under a longer deadline may still be in doubt.
    /// A refused value (zero) changes nothing.
    pub fn set_migration_deadline(
        &mut self,
        deadline: Option<Duration>,
    ) -> Result<(), ConfigError> {
        let base = &self.created;
        let d = deadline.unwrap_or(base.migration_deadline);
        let grow = d.saturating_sub(base.migration_deadline);
        let mut next = self.cfg.clone();
        next.migration_deadline = d;
        next.migration_deadline_max = base.migration_deadline_max + grow;
        next.target_deadline = base.target_deadline + grow;
        next.target_deadline_max = base.target_deadline_max + grow;
        let needed = next.longest_deadline() + next.in_doubt_limit;
        if next.linger <= needed {
            next.linger = needed + Duration::from_secs(1);
        }
        next.validate()?;
        self.cfg = next;
        Ok(())
    }

    /// Applies the store's `buffer_mode` (POLICY): `drop` drops the client
    /// segments of flows being migrated in, `buffer` restores what the
    /// engine was created with, so that an engine created in `Drop` mode
    /// (the hostagent's `[migration] drop_mode`, an explicit ablation)
    /// keeps dropping whatever the policy says. Returns the mode in force.
    pub fn set_policy_buffer_mode(&mut self, drop: bool) -> BufferMode {
        self.cfg.buffer_mode = if drop {
            BufferMode::Drop
        } else {
            self.created.buffer_mode
        };
        self.cfg.buffer_mode
    }

    pub fn counters(&self) -> &Counters {
        &self.counters
    }

    /// Target policy: while draining, every PREPARE is rejected (DRAINING).
    pub fn set_draining(&mut self, draining: bool) {
        self.draining = draining;
    }

    /// Target policy hook, consulted after the built-in checks.
    pub fn set_accept_hook(&mut self, hook: Option<AcceptHook>) {
        self.hook = hook;
    }

    /// Phase of a migration this host remembers.
    pub fn phase(&self, id: MigrationId) -> Option<Phase> {
        Some(match self.records.get(&id.0)? {
            Record::Out(r) => Phase::Origin(r.phase),
            Record::In(r) => Phase::Target(r.phase),
        })
    }

    /// Telemetry of a migration this host remembers.
    pub fn telemetry(&self, id: MigrationId) -> Option<&Telemetry> {
        Some(match self.records.get(&id.0)? {
            Record::Out(r) => &r.tel,
            Record::In(r) => &r.tel,
        })
    }

    /// Migrations out not yet finished and migrations in not yet imported.
    pub fn in_progress(&self) -> (usize, usize) {
        (self.by_flow_out.len(), self.by_flow_in.len())
    }

    /// Records held (live and remembered).
    pub fn records(&self) -> usize {
        self.records.len()
    }

    /// Ownership epoch of `flow` here: the id of the migration that brought
    /// it to this host, 0 if it was placed here (or is not known).
    pub fn epoch(&self, flow: &FlowKey) -> u64 {
        self.epochs.get(flow).copied().unwrap_or(0)
    }

    /// The connection of `flow` is closed here: forget its ownership epoch
    /// (a later connection with the same addresses starts from placement).
    /// Migrations out and lost connections forget it on their own.
    pub fn forget_flow(&mut self, flow: &FlowKey) {
        self.epochs.remove(flow);
    }

    // ------------------------------------------------------------------
    // Origin API
    // ------------------------------------------------------------------

    /// The counter of the next migration started here (the low 32 bits of
    /// its id).
    pub fn next_migration_seq(&self) -> u32 {
        self.next_seq
    }

    /// Whether migrations may start ([`EngineConfig::hold_until_seeded`]).
    pub fn counter_seeded(&self) -> bool {
        self.seeded
    }

    /// Lets migrations start, numbered above `last_seen`: the counter of
    /// the last migration id the switch saw from this host (a previous
    /// process's, whose ids the switch's PREPARE steering memory and the
    /// targets' finished records may still hold). Unless the counter is
    /// already after it in serial-number arithmetic (RFC 1982, as the
    /// switch compares ids of one origin), it moves to `last_seen +`
    /// [`SEED_MARGIN`]; it never goes back. `None`: nothing known (an
    /// older switch, or one that started since): the counter stays (the
    /// driver's clock seed). Returns the counter of the next migration.
    pub fn seed_migration_counter(&mut self, last_seen: Option<u32>) -> u32 {
        if let Some(last) = last_seen {
            if (self.next_seq.wrapping_sub(last) as i32) <= 0 {
                self.next_seq = last.wrapping_add(SEED_MARGIN);
            }
        }
        self.seeded = true;
        self.next_seq
    }

    /// Starts moving `flow` (served by this host) to `explicit_target`, or
    /// to a target the switch chooses. The connection keeps running until
    /// `Event::ExportNow`.
    pub fn migrate_out(
        &mut self,
        now: Instant,
        flow: FlowKey,
        explicit_target: Option<Ipv4Addr>,
    ) -> Result<MigrationId, MigError> {
        let local = self.cfg.local_addr;
        if !self.seeded {
            return Err(MigError::CounterNotSeeded);
        }
        if let Some(t) = explicit_target {
            if t == local {
                return Err(MigError::TargetIsSelf(t));
            }
        }
        if self.by_flow_out.contains_key(&flow) || self.by_flow_in.contains_key(&flow) {
            return Err(MigError::FlowBusy(flow));
        }
        if self.by_flow_out.len() >= self.cfg.max_concurrent_out {
            return Err(MigError::TooManyMigrations {
                limit: self.cfg.max_concurrent_out,
            });
        }
        if self.records.len() >= self.cfg.max_records {
            return Err(MigError::RecordTableFull {
                limit: self.cfg.max_records,
            });
        }
        let id = loop {
            let id = (u64::from(u32::from(local)) << 32) | u64::from(self.next_seq);
            self.next_seq = self.next_seq.wrapping_add(1);
            if !self.records.contains_key(&id) {
                break id;
            }
        };
        let target = explicit_target.unwrap_or(Ipv4Addr::UNSPECIFIED);
        let mut r = OutMig {
            flow,
            epoch: self.epoch(&flow),
            target,
            explicit: explicit_target.is_some(),
            phase: OriginPhase::Preparing,
            deadline: now + self.cfg.migration_deadline,
            retx_at: Some(now + self.cfg.rto_initial),
            rto: self.cfg.rto_initial,
            abort_reason: Reason::Timeout,
            kept: false,
            snapshot: Vec::new(),
            chunk: self.chunk,
            frag_count: 0,
            cursor: 0,
            seq: 0,
            queued: 0,
            armed: None,
            tel: Telemetry {
                started: Some(now),
                ..Telemetry::default()
            },
        };
        let item = out_item(id, &r, Kind::Prepare, self.cfg.switch_addr, local);
        let mut cx = self.ctx_parts().1;
        cx.queue(item, Some(&mut r.queued));
        self.by_flow_out.insert(flow, id);
        // Armed before the insert: no lookup of the new record.
        let mut rec = Record::Out(r);
        let change = arm_change(&mut rec);
        self.records.insert(id, rec);
        self.apply_change(id, change);
        Ok(MigrationId(id))
    }

    /// Origin: the exported connection (TCP state + application state) for
    /// `id`, after `Event::ExportNow`. The engine keeps it until the target
    /// acknowledges the import. On error the migration is abandoned and a
    /// `Resumed` event follows.
    pub fn provide_snapshot(
        &mut self,
        now: Instant,
        id: MigrationId,
        snapshot: Vec<u8>,
    ) -> Result<(), MigError> {
        self.offer_snapshot(now, id, snapshot).map_err(|(e, _)| e)
    }

    /// [`Engine::provide_snapshot`] that hands the snapshot back on error,
    /// so that the caller can resume the connection from it without keeping
    /// a copy of its own. On success the engine holds the only copy: after
    /// a `Resumed` event [`Engine::take_resumed_snapshot`] returns it.
    pub fn offer_snapshot(
        &mut self,
        now: Instant,
        id: MigrationId,
        snapshot: Vec<u8>,
    ) -> Result<(), (MigError, Vec<u8>)> {
        match self.provide_snapshot_inner(now, id, snapshot) {
            Ok(change) => {
                self.apply_change(id.0, change);
                Ok(())
            }
            Err(e) => {
                self.rearm(id.0);
                Err(e)
            }
        }
    }

    /// Origin: the snapshot of a migration that ended `Resumed` after
    /// [`Engine::offer_snapshot`] (or `provide_snapshot`) took it, for
    /// re-importing the connection here; `None` if there is none (resumed
    /// before the export) or it was taken already. A record that expires
    /// drops it.
    pub fn take_resumed_snapshot(&mut self, id: MigrationId) -> Option<Vec<u8>> {
        match self.records.get_mut(&id.0)? {
            Record::Out(r) if r.kept && !r.snapshot.is_empty() => {
                Some(std::mem::take(&mut r.snapshot))
            }
            _ => None,
        }
    }

    /// An empty buffer for the next export (a snapshot buffer of an earlier
    /// migration out, recycled with its capacity, when one is spare), to be
    /// handed back through [`Engine::offer_snapshot`].
    pub fn snapshot_buffer(&mut self) -> Vec<u8> {
        self.spare_snapshots.pop().unwrap_or_default()
    }

    fn provide_snapshot_inner(
        &mut self,
        now: Instant,
        id: MigrationId,
        snapshot: Vec<u8>,
    ) -> Result<ArmChange, (MigError, Vec<u8>)> {
        let (records, mut cx) = self.ctx_parts();
        let r = match records.get_mut(&id.0) {
            Some(Record::Out(r)) => r,
            Some(Record::In(r)) => {
                return Err((
                    MigError::WrongState {
                        id,
                        state: r.phase.name(),
                        expected: "exporting (origin)",
                    },
                    snapshot,
                ))
            }
            None => return Err((MigError::UnknownMigration(id), snapshot)),
        };
        if r.phase != OriginPhase::Exporting {
            return Err((
                MigError::WrongState {
                    id,
                    state: r.phase.name(),
                    expected: OriginPhase::Exporting.name(),
                },
                snapshot,
            ));
        }
        let max = cx.cfg.max_snapshot_bytes;
        let count = if snapshot.len() > max {
            Err(MigError::SnapshotTooLarge {
                len: snapshot.len(),
                max,
            })
        } else {
            split_chunks(&snapshot, r.chunk)
                .map(|f| capybara_proto::frag::Fragments::count(&f))
                .map_err(MigError::from)
        };
        match count {
            Ok(count) => {
                // The deadline grows with the snapshot (hard-capped): a
                // full-queue connection must not lose to a fixed deadline.
                let started = r.tel.started.unwrap_or(now);
                r.deadline = r
                    .deadline
                    .max(started + cx.cfg.deadline_for(snapshot.len()));
                r.tel.export_done = Some(now);
                r.tel.snapshot_bytes = snapshot.len() as u64;
                r.tel.fragments = count;
                r.snapshot = snapshot;
                r.frag_count = count;
                r.cursor = 0;
                r.phase = OriginPhase::Sending;
                r.rto = cx.cfg.rto_initial;
                r.retx_at = Some(now + r.rto);
                let item = out_item(id.0, r, Kind::ConnState, r.target, cx.cfg.local_addr);
                cx.queue(item, Some(&mut r.queued));
                Ok(arm_change_out(r))
            }
            Err(e) => {
                // Nothing was sent: the target cannot commit, we may resume.
                // An oversized snapshot says so (the report's reason).
                let why = match e {
                    MigError::SnapshotTooLarge { .. } => Reason::SnapshotTooLarge,
                    _ => Reason::Cancelled,
                };
                origin_resume_unilaterally(id.0, r, &mut cx, now, why);
                Err((e, snapshot))
            }
        }
    }

    /// Origin: gives up a migration out (connection closed, operator). Before
    /// any state was sent the connection resumes at once (`Resumed`);
    /// afterwards the outcome is asked from the target like at the deadline.
    pub fn abort_out(&mut self, now: Instant, id: MigrationId) -> Result<(), MigError> {
        let res = self.abort_out_inner(now, id);
        self.rearm(id.0);
        res
    }

    /// Origin, at `Event::ExportNow`: the snapshot is known to need at
    /// least `len` bytes before the connection is frozen and exported
    /// (queue lengths, application state). Over `max_snapshot_bytes` the
    /// migration is given up at once as the snapshot's own check would
    /// after the export (`Resumed{SnapshotTooLarge}`, the same report),
    /// and `SnapshotTooLarge` is returned; within the limit nothing
    /// changes (`provide_snapshot`'s check stays the authority).
    pub fn refuse_snapshot_over_limit(
        &mut self,
        now: Instant,
        id: MigrationId,
        len: usize,
    ) -> Result<(), MigError> {
        let max = self.cfg.max_snapshot_bytes;
        if len <= max {
            return Ok(());
        }
        let (records, mut cx) = self.ctx_parts();
        match records.get_mut(&id.0) {
            Some(Record::Out(r)) if r.phase == OriginPhase::Exporting => {
                origin_resume_unilaterally(id.0, r, &mut cx, now, Reason::SnapshotTooLarge);
            }
            Some(Record::Out(r)) => {
                return Err(MigError::WrongState {
                    id,
                    state: r.phase.name(),
                    expected: OriginPhase::Exporting.name(),
                })
            }
            Some(Record::In(r)) => {
                return Err(MigError::WrongState {
                    id,
                    state: r.phase.name(),
                    expected: "exporting (origin)",
                })
            }
            None => return Err(MigError::UnknownMigration(id)),
        }
        self.rearm(id.0);
        Err(MigError::SnapshotTooLarge { len, max })
    }

    fn abort_out_inner(&mut self, now: Instant, id: MigrationId) -> Result<(), MigError> {
        let (records, mut cx) = self.ctx_parts();
        let r = match records.get_mut(&id.0) {
            Some(Record::Out(r)) => r,
            Some(Record::In(r)) => {
                return Err(MigError::WrongState {
                    id,
                    state: r.phase.name(),
                    expected: "an origin phase",
                })
            }
            None => return Err(MigError::UnknownMigration(id)),
        };
        match r.phase {
            OriginPhase::Preparing | OriginPhase::Exporting => {
                origin_resume_unilaterally(id.0, r, &mut cx, now, Reason::Cancelled);
                Ok(())
            }
            OriginPhase::Sending => {
                origin_enter_doubt(id.0, r, &mut cx, now, Reason::Cancelled);
                Ok(())
            }
            p => Err(MigError::WrongState {
                id,
                state: p.name(),
                expected: "preparing, exporting or sending state",
            }),
        }
    }

    // ------------------------------------------------------------------
    // Target API
    // ------------------------------------------------------------------

    /// Target: a client TCP segment (IP payload) of `flow` arrived. Call it
    /// for segments of flows the stack has no connection for; segments of
    /// flows being migrated in are kept (or dropped as TCP would).
    pub fn buffer_segment(
        &mut self,
        _now: Instant,
        flow: FlowKey,
        segment: &[u8],
    ) -> BufferVerdict {
        let Some(&id) = self.by_flow_in.get(&flow) else {
            return BufferVerdict::NotMigrating;
        };
        let Some(Record::In(r)) = self.records.get_mut(&id) else {
            return BufferVerdict::NotMigrating;
        };
        let Some(bufs) = r.bufs.as_mut() else {
            return BufferVerdict::NotMigrating;
        };
        let verdict = if self.cfg.buffer_mode == BufferMode::Drop {
            BufferVerdict::Dropped(DropCause::DropMode)
        } else if bufs.segments.push(segment) {
            BufferVerdict::Buffered
        } else {
            BufferVerdict::Dropped(DropCause::BufferFull)
        };
        if verdict == BufferVerdict::Buffered {
            self.counters.segments_buffered += 1;
            r.tel.segments_buffered += 1;
            r.tel.bytes_buffered += segment.len() as u64;
        } else {
            self.counters.segments_dropped += 1;
            r.tel.segments_dropped += 1;
        }
        verdict
    }

    /// Target: the complete snapshot of a migration in `Importing`.
    pub fn snapshot(&self, id: MigrationId) -> Option<&[u8]> {
        match self.records.get(&id.0)? {
            Record::In(r) if r.phase == TargetPhase::Importing => {
                r.bufs.as_ref()?.reassembly.snapshot()
            }
            _ => None,
        }
    }

    /// Target: the stack imported the connection. This is the commit point:
    /// from here the target owns the connection and never aborts. `replay`
    /// receives the buffered client segments in arrival order (feed them to
    /// the imported connection); then CONN_STATE_ACK is queued and
    /// `MigratedIn` emitted.
    pub fn import_done(
        &mut self,
        now: Instant,
        id: MigrationId,
        replay: impl FnMut(&[u8]),
    ) -> Result<ReplaySummary, MigError> {
        match self.import_done_inner(now, id, replay) {
            Ok((summary, change)) => {
                self.apply_change(id.0, change);
                Ok(summary)
            }
            Err(e) => {
                self.rearm(id.0);
                Err(e)
            }
        }
    }

    fn import_done_inner(
        &mut self,
        now: Instant,
        id: MigrationId,
        mut replay: impl FnMut(&[u8]),
    ) -> Result<(ReplaySummary, ArmChange), MigError> {
        let (records, mut cx) = self.ctx_parts();
        let r = target_record(records, id, TargetPhase::Importing)?;
        let mut summary = ReplaySummary::default();
        if let Some(bufs) = r.bufs.as_ref() {
            summary.segments = bufs.segments.len();
            summary.bytes = bufs.segments.bytes();
            for seg in bufs.segments.iter() {
                replay(seg);
            }
        }
        r.phase = TargetPhase::Committed;
        r.tel.import_done = Some(now);
        r.tel.replayed = Some(now);
        r.deadline = Some(now + cx.cfg.linger);
        let bufs = r.bufs.take();
        cx.release(bufs);
        cx.by_flow_in.remove(&r.flow);
        cx.counters.migrated_in += 1;
        // This migration is now the flow's ownership epoch here: our own
        // migrations of it name it, so that the switch can tell their
        // PREPARE_ACKs from stale ones. Without room the flow keeps epoch
        // 0, which the switch refuses over an entry: it then cannot move
        // again (safe), and the miss is counted.
        if cx.epochs.len() < cx.cfg.max_epochs || cx.epochs.contains_key(&r.flow) {
            cx.epochs.insert(r.flow, id.0);
        } else {
            cx.epochs.remove(&r.flow);
            cx.counters.epoch_table_full += 1;
        }
        let item = in_item(id.0, r, Kind::ConnStateAck, Reason::None, cx.cfg.local_addr);
        cx.queue(item, Some(&mut r.queued));
        cx.event(Event::MigratedIn {
            id,
            flow: r.flow,
            origin: r.origin,
        });
        Ok((summary, arm_change_in(r)))
    }

    /// Target: the snapshot could not be imported. Nothing was served, so
    /// the origin (which still holds its copy) keeps the connection: an
    /// ABORT naming the origin as owner is sent.
    pub fn import_failed(&mut self, now: Instant, id: MigrationId) -> Result<(), MigError> {
        let res = self.import_failed_inner(now, id);
        self.rearm(id.0);
        res
    }

    fn import_failed_inner(&mut self, now: Instant, id: MigrationId) -> Result<(), MigError> {
        let (records, mut cx) = self.ctx_parts();
        let r = target_record(records, id, TargetPhase::Importing)?;
        target_abort(id.0, r, &mut cx, now, Reason::ImportFailed, true);
        Ok(())
    }

    // ------------------------------------------------------------------
    // I/O
    // ------------------------------------------------------------------

    /// A TCPMig datagram (UDP payload) from `src` arrived. Invalid,
    /// unauthenticated or unexpected messages are counted and dropped; the
    /// error says why (for debug logs).
    pub fn handle_message(
        &mut self,
        now: Instant,
        src: Ipv4Addr,
        datagram: &[u8],
    ) -> Result<(), RxError> {
        let res = self.handle_message_inner(now, src, datagram);
        // The only record a message can touch is the one it names (a
        // message that did not parse touched none: re-arming is a no-op).
        // The usual messages re-armed it while their handler held it.
        if let Ok(Some((id, change))) = res {
            self.apply_change(id, change);
            return Ok(());
        }
        if let Some(id) = datagram.get(capybara_proto::tcpmig::field::MIGRATION_ID) {
            let mut b = [0u8; 8];
            b.copy_from_slice(id);
            self.rearm(u64::from_be_bytes(b));
        }
        res.map(|_| ())
    }

    fn handle_message_inner(
        &mut self,
        now: Instant,
        src: Ipv4Addr,
        datagram: &[u8],
    ) -> Result<Option<(u64, ArmChange)>, RxError> {
        let m = match TcpMigRepr::parse_verified(datagram, &self.key) {
            Ok(m) => m,
            Err(e) => {
                return Err(match e {
                    TcpMigError::UnsupportedVersion { .. } => {
                        self.counters.bad_version += 1;
                        RxError::BadVersion(e)
                    }
                    TcpMigError::BadMac => {
                        self.counters.bad_mac += 1;
                        RxError::BadMac
                    }
                    e => {
                        self.counters.malformed += 1;
                        RxError::Malformed(e)
                    }
                })
            }
        };
        self.counters.rx.bump(m.kind);
        let local = self.cfg.local_addr;
        // Only PREPARE and the origin's ABORT may leave the target open;
        // every message names a real origin and comes from a real host, so
        // no answer is ever addressed to 0.0.0.0.
        let target_optional = matches!(m.kind, Kind::Prepare | Kind::Abort);
        if src.is_unspecified()
            || m.origin.is_unspecified()
            || (!target_optional && m.target.is_unspecified())
        {
            self.counters.unexpected += 1;
            return Err(RxError::Unexpected {
                kind: m.kind,
                id: MigrationId(m.migration_id),
                src,
                why: "unspecified source, origin or target address",
            });
        }
        let res = match m.kind {
            Kind::Prepare => self.on_prepare(now, src, &m, datagram.len()),
            Kind::ConnState => self.on_conn_state(now, src, &m, datagram.len()),
            Kind::PrepareAck => self.on_prepare_ack(now, src, &m),
            Kind::Reject => self.on_reject(now, src, &m).map(|()| None),
            Kind::ConnStateAck => self.on_state_ack(now, src, &m),
            // Direction tells request from decision, as at the switch: an
            // ABORT addressed to the origin is the target's decision.
            Kind::Abort if m.origin == local => self.on_abort_decision(now, src, &m).map(|()| None),
            Kind::Abort => self.on_abort_request(now, src, &m).map(|()| None),
        };
        if let Err(RxError::Unexpected { .. }) = res {
            self.counters.unexpected += 1;
        }
        res
    }

    /// Writes the next datagram into `buf` (which must hold `path_mtu - 28`
    /// bytes). `None` when nothing is queued.
    pub fn poll_transmit(&mut self, now: Instant, buf: &mut [u8]) -> Option<Transmit> {
        // The driver asks before every transmit batch and frame; nearly
        // always nothing is queued: answer without the big frame's setup.
        if self.tx.is_empty() {
            return None;
        }
        self.poll_transmit_queued(now, buf)
    }

    /// Whether [`Engine::poll_transmit`] has a datagram to write.
    #[inline]
    pub fn has_transmit(&self) -> bool {
        !self.tx.is_empty()
    }

    #[inline(never)]
    fn poll_transmit_queued(&mut self, now: Instant, buf: &mut [u8]) -> Option<Transmit> {
        let local = self.cfg.local_addr;
        loop {
            let item = *self.tx.front()?;
            let rec = self.records.get_mut(&item.id);
            if item.kind == Kind::ConnState {
                let Some(Record::Out(r)) = rec else {
                    self.tx.pop_front();
                    continue;
                };
                if r.phase != OriginPhase::Sending || r.cursor >= r.frag_count {
                    self.tx.pop_front();
                    r.queued &= !kind_bit(Kind::ConnState);
                    continue;
                }
                let frag = split_chunks(&r.snapshot, r.chunk)
                    .ok()
                    .and_then(|f| f.get(r.cursor));
                let Some(frag) = frag else {
                    self.tx.pop_front();
                    r.queued &= !kind_bit(Kind::ConnState);
                    continue;
                };
                // Per-fragment sequence number: a retransmitted fragment
                // carries the same one, so receivers deduplicate by it.
                let repr = out_item(item.id, r, Kind::ConnState, item.dst, local).repr(
                    u32::from(frag.index),
                    frag.index,
                    frag.count,
                    frag.payload,
                );
                let Ok(n) = repr.emit_with_mac(buf, &self.key) else {
                    // Driver bug (buffer shorter than the MTU): skip rather
                    // than spin; the retransmission timer will not help
                    // either, so the migration will time out and resume.
                    self.tx.pop_front();
                    r.queued &= !kind_bit(Kind::ConnState);
                    self.counters.tx_queue_full += 1;
                    continue;
                };
                r.cursor += 1;
                let burst_done = r.cursor >= r.frag_count;
                if burst_done {
                    self.tx.pop_front();
                    r.queued &= !kind_bit(Kind::ConnState);
                    if r.tel.state_sent.is_none() {
                        r.tel.state_sent = Some(now);
                    }
                    // The retransmission timeout runs from the last fragment
                    // of the burst, not from its first: a snapshot of
                    // hundreds of fragments can take longer than one RTO to
                    // leave, and resending it all before the target could
                    // answer only doubles the load that delayed it.
                    r.retx_at = Some(now + r.rto);
                }
                r.tel.wire_bytes_sent += n as u64;
                // The retransmission timer moved: armed from this lookup.
                let change = if burst_done { arm_change_out(r) } else { None };
                self.counters.tx.bump(Kind::ConnState);
                self.apply_change(item.id, change);
                return Some(Transmit {
                    dst: item.dst,
                    len: n,
                });
            }
            self.tx.pop_front();
            let mut seq = 0;
            // The record's byte counter, from the same lookup.
            let mut sent: Option<&mut u64> = None;
            if item.recorded {
                // Stale items (the record moved on since) are not sent: a
                // PREPARE after resuming would make a target buffer for
                // nothing, an old PREPARE_ACK could confuse the origin.
                let wanted = match rec {
                    Some(Record::Out(r)) => {
                        r.queued &= !kind_bit(item.kind);
                        let ok = match item.kind {
                            Kind::Prepare => r.phase == OriginPhase::Preparing,
                            Kind::Abort => {
                                matches!(r.phase, OriginPhase::InDoubt | OriginPhase::AbortNotify)
                            }
                            _ => false,
                        };
                        if ok {
                            seq = r.seq;
                            r.seq = r.seq.wrapping_add(1);
                            if item.kind == Kind::Prepare && r.tel.prepare_sent.is_none() {
                                r.tel.prepare_sent = Some(now);
                            }
                            sent = Some(&mut r.tel.wire_bytes_sent);
                        }
                        ok
                    }
                    Some(Record::In(r)) => {
                        r.queued &= !kind_bit(item.kind);
                        let ok = match item.kind {
                            Kind::PrepareAck => {
                                matches!(r.phase, TargetPhase::Buffering | TargetPhase::Importing)
                            }
                            Kind::ConnStateAck => r.phase == TargetPhase::Committed,
                            Kind::Reject => matches!(r.phase, TargetPhase::Rejected(_)),
                            Kind::Abort => matches!(
                                r.phase,
                                TargetPhase::Aborted(_) | TargetPhase::Rejected(_)
                            ),
                            _ => false,
                        };
                        if ok {
                            seq = r.seq;
                            r.seq = r.seq.wrapping_add(1);
                            sent = Some(&mut r.tel.wire_bytes_sent);
                        }
                        ok
                    }
                    None => false,
                };
                if !wanted {
                    continue;
                }
            }
            let repr = item.repr(seq, 0, 1, &[]);
            let Ok(n) = repr.emit_with_mac(buf, &self.key) else {
                self.counters.tx_queue_full += 1;
                continue;
            };
            if let Some(sent) = sent {
                *sent += n as u64;
            }
            self.counters.tx.bump(item.kind);
            match item.kind {
                Kind::Reject => self.counters.rejects_sent += 1,
                Kind::Abort => self.counters.aborts_sent += 1,
                _ => {}
            }
            return Some(Transmit {
                dst: item.dst,
                len: n,
            });
        }
    }

    /// Next event for the stack.
    pub fn poll_event(&mut self) -> Option<Event> {
        self.events.pop_front()
    }

    /// Earliest time `handle_timeout` has work: the top of the timer
    /// heap or the front of the expiry queue, whichever is earlier (both
    /// are always live, see `Engine::timers`).
    pub fn poll_timeout(&self) -> Option<Instant> {
        let heap = self.timers.peek().map(|Reverse((t, _))| *t);
        let queue = self.expiries.front().map(|&(t, _)| t);
        match (heap, queue) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Runs every timer due at `now`: retransmissions, deadlines, expiry.
    /// Each record due runs its timers once per call, as a scan would.
    pub fn handle_timeout(&mut self, now: Instant) {
        let mut due = std::mem::take(&mut self.due);
        due.clear();
        while let Some(&Reverse((t, id))) = self.timers.peek() {
            if t > now || due.len() == due.capacity() {
                break;
            }
            self.timers.pop();
            // Disarmed when taken: a record with a live entry in both the
            // heap and the queue (after a rebuild) runs once.
            if self.take_armed(id, t) {
                due.push(id);
            }
        }
        while let Some(&(t, id)) = self.expiries.front() {
            if t > now || due.len() == due.capacity() {
                break;
            }
            self.expiries.pop_front();
            if self.take_armed(id, t) {
                due.push(id);
            }
        }
        for &id in &due {
            let (records, mut cx) = self.ctx_parts();
            let keep = match records.get_mut(&id) {
                Some(Record::Out(r)) => origin_timer(id, r, &mut cx, now),
                Some(Record::In(r)) => target_timer(id, r, &mut cx, now),
                None => continue,
            };
            if keep {
                self.rearm(id);
            } else {
                self.records.remove(&id);
            }
        }
        self.due = due;
        self.drop_stale_top();
    }

    /// When the record `id` next has timer work (`None`: never, or no such
    /// record). A finished record only waits to expire: its expiry is
    /// rounded up to `EXPIRY_GRAIN_US` (later is harmless), so that records
    /// expire in batches instead of one wake-up each.
    #[cfg(test)]
    fn due_of(&self, id: u64) -> Option<Instant> {
        self.records.get(&id).and_then(due_of_record)
    }

    fn armed(&self, id: u64) -> Option<Instant> {
        match self.records.get(&id)? {
            Record::Out(r) => r.armed,
            Record::In(r) => r.armed,
        }
    }

    /// If `(t, id)` is the record's live entry, disarms it (the caller
    /// runs its timers) and returns true.
    fn take_armed(&mut self, id: u64, t: Instant) -> bool {
        let slot = match self.records.get_mut(&id) {
            Some(Record::Out(r)) => &mut r.armed,
            Some(Record::In(r)) => &mut r.armed,
            None => return false,
        };
        if *slot == Some(t) {
            *slot = None;
            true
        } else {
            false
        }
    }

    /// Puts the record `id`'s timer in the heap (or, a finished record's
    /// expiry, in the expiry queue) if it changed (the old entry becomes
    /// stale), then drops stale entries off the top. One lookup of the
    /// record; the tops are checked only if one is `id`'s entry: before
    /// this call they were live, and no other record's timer changed.
    fn rearm(&mut self, id: u64) {
        let (push, lingering) = match self.records.get_mut(&id) {
            Some(rec) => match arm_change(rec) {
                Some(change) => change,
                None => return,
            },
            // Removed (its entries, if any, are stale now).
            None => (None, false),
        };
        self.apply_arm(id, push, lingering);
    }

    /// [`Engine::apply_arm`] when the armed time changed.
    fn apply_change(&mut self, id: u64, change: ArmChange) {
        if let Some((push, lingering)) = change {
            self.apply_arm(id, push, lingering);
        }
    }

    /// The rest of [`Engine::rearm`], for a caller that holds the record
    /// and took its [`arm_change`] (one lookup fewer): `push` is the
    /// record's new due time, `lingering` whether it is finished.
    // `is_none_or` needs Rust 1.82; the workspace allows 1.80.
    #[allow(clippy::unnecessary_map_or)]
    fn apply_arm(&mut self, id: u64, push: Option<Instant>, lingering: bool) {
        let top_is_id = matches!(self.timers.peek(), Some(&Reverse((_, top))) if top == id);
        let front_is_id = matches!(self.expiries.front(), Some(&(_, f)) if f == id);
        match push {
            // Finished: its expiry joins the queue when it is not earlier
            // than the queue's back (the usual case: records finish in
            // time order and linger alike).
            Some(t)
                if lingering
                    && self.expiries.len() < self.timer_cap
                    && self.expiries.back().map_or(true, |&(b, _)| b <= t) =>
            {
                self.expiries.push_back((t, id));
            }
            // The top is this record's live entry (the usual case with one
            // migration at a time): replace it in place, one sift down
            // instead of a push now and a pop of the stale entry later.
            Some(t) if top_is_id => {
                if let Some(mut top) = self.timers.peek_mut() {
                    *top = Reverse((t, id));
                }
            }
            Some(t) => {
                if self.timers.len() >= self.timer_cap {
                    self.rebuild_timers();
                    return;
                }
                self.timers.push(Reverse((t, id)));
            }
            None => {}
        }
        // Only a structure whose first entry was `id`'s can have a stale
        // one first now; `id`'s own entries are told live without a lookup.
        if top_is_id {
            self.drop_stale_heap_top(id, push);
        }
        if front_is_id {
            self.drop_stale_front(id, push);
        }
    }

    /// `drop_stale_top` for the heap, `known` being the record `id`'s live
    /// time (its entries are checked without a lookup).
    fn drop_stale_heap_top(&mut self, id: u64, known: Option<Instant>) {
        while let Some(&Reverse((t, top))) = self.timers.peek() {
            if self.entry_live(t, top, id, known) {
                break;
            }
            self.timers.pop();
        }
    }

    /// Whether the timer entry `(t, entry)` is its record's live one;
    /// record `id`'s live time is `known` (told without a lookup).
    fn entry_live(&self, t: Instant, entry: u64, id: u64, known: Option<Instant>) -> bool {
        if entry == id {
            known == Some(t)
        } else {
            self.armed(entry) == Some(t)
        }
    }

    /// `drop_stale_top` for the expiry queue (see `drop_stale_heap_top`).
    fn drop_stale_front(&mut self, id: u64, known: Option<Instant>) {
        while let Some(&(t, front)) = self.expiries.front() {
            if self.entry_live(t, front, id, known) {
                break;
            }
            self.expiries.pop_front();
        }
    }

    /// Pops entries off the top of the heap and the front of the expiry
    /// queue until both are live.
    fn drop_stale_top(&mut self) {
        while let Some(&Reverse((t, id))) = self.timers.peek() {
            if self.armed(id) == Some(t) {
                break;
            }
            self.timers.pop();
        }
        while let Some(&(t, id)) = self.expiries.front() {
            if self.armed(id) == Some(t) {
                break;
            }
            self.expiries.pop_front();
        }
    }

    /// The heap is full of stale entries: keep only the live ones (one per
    /// record, and records are fewer than half the capacity), the expiry
    /// queue's included (it starts again empty).
    fn rebuild_timers(&mut self) {
        self.timer_rebuilds += 1;
        let mut heap = std::mem::take(&mut self.timers).into_vec();
        heap.clear();
        self.expiries.clear();
        for (&id, rec) in &self.records {
            let armed = match rec {
                Record::Out(r) => r.armed,
                Record::In(r) => r.armed,
            };
            if let Some(t) = armed {
                heap.push(Reverse((t, id)));
            }
        }
        self.timers = BinaryHeap::from(heap);
    }

    // ------------------------------------------------------------------
    // Receive handlers
    // ------------------------------------------------------------------

    fn ctx_parts(&mut self) -> (&mut Map<u64, Record>, Ctx<'_>) {
        (
            &mut self.records,
            Ctx {
                cfg: &self.cfg,
                tx: &mut self.tx,
                events: &mut self.events,
                counters: &mut self.counters,
                pool: &mut self.pool,
                by_flow_in: &mut self.by_flow_in,
                by_flow_out: &mut self.by_flow_out,
                epochs: &mut self.epochs,
                spare_snapshots: &mut self.spare_snapshots,
            },
        )
    }

    fn on_prepare(
        &mut self,
        now: Instant,
        src: Ipv4Addr,
        m: &TcpMigRepr<'_>,
        wire: usize,
    ) -> Result<Option<(u64, ArmChange)>, RxError> {
        let id = m.migration_id;
        let unexpected = |why| RxError::Unexpected {
            kind: m.kind,
            id: MigrationId(id),
            src,
            why,
        };
        if src != m.origin {
            return Err(unexpected("PREPARE not sent by the origin it names"));
        }
        let local = self.cfg.local_addr;
        let admission = self.admit(m);
        let (records, mut cx) = self.ctx_parts();
        match records.get_mut(&id) {
            Some(Record::In(r)) => {
                if r.origin != m.origin || r.flow != m.flow || r.epoch != m.epoch {
                    return Err(unexpected(
                        "PREPARE reuses a migration id for another flow or epoch",
                    ));
                }
                cx.counters.duplicates += 1;
                r.tel.wire_bytes_received += wire as u64;
                // Answer a duplicate with the decision already taken: the
                // first answer was lost (or is late).
                let answer = match r.phase {
                    TargetPhase::Buffering | TargetPhase::Importing => {
                        Some((Kind::PrepareAck, Reason::None))
                    }
                    TargetPhase::Rejected(reason) => Some((Kind::Reject, reason)),
                    TargetPhase::Aborted(reason) => Some((Kind::Abort, reason)),
                    // Ancient duplicate: the origin already has the outcome.
                    TargetPhase::Committed => None,
                };
                if let Some((kind, reason)) = answer {
                    let item = in_item(id, r, kind, reason, local);
                    cx.queue(item, Some(&mut r.queued));
                }
                return Ok(None);
            }
            Some(Record::Out(_)) => {
                return Err(unexpected("PREPARE for a migration this host originates"))
            }
            None => {}
        }
        let mut r = InMig {
            flow: m.flow,
            origin: m.origin,
            epoch: m.epoch,
            phase: TargetPhase::Buffering,
            deadline: Some(now + cx.cfg.target_deadline),
            bufs: None,
            retx_at: None,
            rto: cx.cfg.rto_initial,
            repeats_left: 0,
            last_answer: None,
            seq: 0,
            queued: 0,
            armed: None,
            tel: Telemetry {
                started: Some(now),
                prepare_received: Some(now),
                wire_bytes_received: wire as u64,
                ..Telemetry::default()
            },
        };
        match admission {
            Err(reason) => {
                r.phase = TargetPhase::Rejected(reason);
                r.deadline = Some(now + cx.cfg.linger);
                if records.len() < cx.cfg.max_records {
                    let item = in_item(id, &r, Kind::Reject, reason, local);
                    cx.queue(item, Some(&mut r.queued));
                    records.insert(id, Record::In(r));
                } else {
                    // No room to remember the refusal: answer statelessly.
                    let mut item = in_item(id, &r, Kind::Reject, reason, local);
                    item.recorded = false;
                    cx.queue(item, None);
                }
            }
            Ok(()) => {
                let bufs = cx.pool.pop().unwrap_or_else(|| InBuffers {
                    segments: SegmentBuffer::new(cx.cfg.max_buffer_bytes, cx.cfg.buffer_segments()),
                    reassembly: Reassembly::new(cx.cfg.max_snapshot_bytes),
                });
                r.bufs = Some(bufs);
                let item = in_item(id, &r, Kind::PrepareAck, Reason::None, local);
                cx.queue(item, Some(&mut r.queued));
                cx.by_flow_in.insert(m.flow, id);
                // Armed before the insert: no lookup of the new record.
                let change = arm_change_in(&mut r);
                records.insert(id, Record::In(r));
                return Ok(Some((id, change)));
            }
        }
        Ok(None)
    }

    /// Target admission policy for a new PREPARE.
    fn admit(&mut self, m: &TcpMigRepr<'_>) -> Result<(), Reason> {
        let local = self.cfg.local_addr;
        if m.origin == local {
            return Err(Reason::Policy);
        }
        if !m.target.is_unspecified() && m.target != local {
            // Steered to us although it names another target.
            return Err(Reason::Policy);
        }
        if self.by_flow_in.contains_key(&m.flow) || self.by_flow_out.contains_key(&m.flow) {
            return Err(Reason::DuplicateFlow);
        }
        if self.draining {
            return Err(Reason::Draining);
        }
        if self.by_flow_in.len() >= self.cfg.max_concurrent_in
            || self.records.len() >= self.cfg.max_records
        {
            return Err(Reason::NoCapacity);
        }
        if let Some(hook) = self.hook.as_mut() {
            hook(&m.flow, m.origin)?;
        }
        Ok(())
    }

    fn on_conn_state(
        &mut self,
        now: Instant,
        src: Ipv4Addr,
        m: &TcpMigRepr<'_>,
        wire: usize,
    ) -> Result<Option<(u64, ArmChange)>, RxError> {
        let id = m.migration_id;
        let local = self.cfg.local_addr;
        let unexpected = |why| RxError::Unexpected {
            kind: m.kind,
            id: MigrationId(id),
            src,
            why,
        };
        let (records, mut cx) = self.ctx_parts();
        match records.get_mut(&id) {
            Some(Record::In(r)) => {
                if src != r.origin || m.origin != r.origin || m.flow != r.flow {
                    return Err(unexpected("CONN_STATE from a host that is not the origin"));
                }
                r.tel.wire_bytes_received += wire as u64;
                match r.phase {
                    TargetPhase::Buffering => {
                        let Some(bufs) = r.bufs.as_mut() else {
                            return Err(unexpected("no reassembly buffer"));
                        };
                        match bufs
                            .reassembly
                            .accept(m.frag_index, m.frag_count, m.payload)
                        {
                            Ok(Progress::Stored { .. }) => {
                                // Progress: the snapshot is arriving, give
                                // it `target_deadline` more (hard-capped).
                                let cap = r.tel.started.unwrap_or(now) + cx.cfg.target_deadline_max;
                                let next = (now + cx.cfg.target_deadline).min(cap);
                                r.deadline = r.deadline.map(|d| d.max(next));
                            }
                            Ok(Progress::Duplicate) => cx.counters.duplicates += 1,
                            Ok(Progress::Complete) => {
                                r.phase = TargetPhase::Importing;
                                // The stack imports synchronously; no
                                // deadline may cut a commit in progress.
                                r.deadline = None;
                                r.tel.state_received = Some(now);
                                r.tel.fragments = m.frag_count;
                                let len = bufs.reassembly.snapshot().map_or(0, <[u8]>::len);
                                r.tel.snapshot_bytes = len as u64;
                                cx.event(Event::ImportNow {
                                    id: MigrationId(id),
                                    flow: r.flow,
                                    origin: r.origin,
                                    snapshot_len: len,
                                });
                            }
                            Err(err) => {
                                cx.counters.malformed += 1;
                                return Err(RxError::BadFragment {
                                    kind: m.kind,
                                    id: MigrationId(id),
                                    err,
                                });
                            }
                        }
                    }
                    TargetPhase::Importing => cx.counters.duplicates += 1,
                    TargetPhase::Committed | TargetPhase::Aborted(_) | TargetPhase::Rejected(_) => {
                        // A retransmitted fragment means our answer was lost:
                        // repeat it, at most once per initial RTO per burst.
                        cx.counters.duplicates += 1;
                        // `is_none_or` needs Rust 1.82; the workspace allows 1.80.
                        #[allow(clippy::unnecessary_map_or)]
                        let due = r
                            .last_answer
                            .map_or(true, |t| now >= t + cx.cfg.rto_initial / 2);
                        if due {
                            r.last_answer = Some(now);
                            let (kind, reason) = match r.phase {
                                TargetPhase::Committed => (Kind::ConnStateAck, Reason::None),
                                TargetPhase::Aborted(x) | TargetPhase::Rejected(x) => {
                                    (Kind::Abort, x)
                                }
                                _ => unreachable!("matched above"),
                            };
                            let item = in_item(id, r, kind, reason, local);
                            cx.queue(item, Some(&mut r.queued));
                        }
                    }
                }
                Ok(Some((id, arm_change_in(r))))
            }
            Some(Record::Out(_)) => Err(unexpected(
                "CONN_STATE for a migration this host originates",
            )),
            None => {
                if src != m.origin || m.origin == local {
                    return Err(unexpected(
                        "CONN_STATE for an unknown migration from a host that is not its origin",
                    ));
                }
                // We never accepted (or long forgot) it: we are not the
                // owner, so the origin keeps the connection. One answer per
                // burst (fragment 0) is enough.
                if m.frag_index == 0 {
                    let item =
                        TxItem::answer(m, m.origin, Kind::Abort, local, Reason::UnknownMigration);
                    cx.queue(item, None);
                }
                Err(unexpected("CONN_STATE for an unknown migration"))
            }
        }
    }

    fn on_prepare_ack(
        &mut self,
        now: Instant,
        src: Ipv4Addr,
        m: &TcpMigRepr<'_>,
    ) -> Result<Option<(u64, ArmChange)>, RxError> {
        let id = m.migration_id;
        let local = self.cfg.local_addr;
        let unexpected = |why| RxError::Unexpected {
            kind: m.kind,
            id: MigrationId(id),
            src,
            why,
        };
        if m.origin != local || src != m.target || m.target.is_unspecified() || m.target == local {
            return Err(unexpected(
                "PREPARE_ACK whose origin/target do not match its path",
            ));
        }
        // A PREPARE_ACK we cannot use: ask that target to let go right away
        // instead of buffering until its deadline.
        // (`m.origin == local`, checked above.)
        let let_go = TxItem::answer(m, m.target, Kind::Abort, m.target, Reason::Cancelled);
        let (records, mut cx) = self.ctx_parts();
        match records.get_mut(&id) {
            Some(Record::Out(r)) => {
                if r.flow != m.flow {
                    return Err(unexpected(
                        "PREPARE_ACK reuses a migration id for another flow",
                    ));
                }
                if r.epoch != m.epoch {
                    // The target answers every PREPARE with its epoch; a
                    // different one was not an answer to ours.
                    return Err(unexpected("PREPARE_ACK echoes another ownership epoch"));
                }
                match r.phase {
                    OriginPhase::Preparing => {
                        if r.explicit && r.target != m.target {
                            cx.queue(let_go, None);
                            return Err(unexpected(
                                "PREPARE_ACK from a host other than the requested target",
                            ));
                        }
                        r.target = m.target;
                        r.phase = OriginPhase::Exporting;
                        r.retx_at = None;
                        r.tel.prepare_ack_received = Some(now);
                        cx.event(Event::ExportNow {
                            id: MigrationId(id),
                            flow: r.flow,
                        });
                        Ok(Some((id, arm_change_out(r))))
                    }
                    OriginPhase::AbortNotify if r.target.is_unspecified() => {
                        // Learned who holds the buffer: tell it directly.
                        r.target = m.target;
                        let item = out_item(id, r, Kind::Abort, m.target, local);
                        cx.queue(item, Some(&mut r.queued));
                        Ok(None)
                    }
                    _ if r.target != m.target => {
                        cx.queue(let_go, None);
                        Err(unexpected("PREPARE_ACK from a second target"))
                    }
                    OriginPhase::Done if r.kept => {
                        // A late PREPARE_ACK of a migration given up: it may
                        // have just redirected the flow at the switch. The
                        // target's answer to this ABORT resets the entry.
                        cx.counters.duplicates += 1;
                        cx.queue(let_go, None);
                        Ok(None)
                    }
                    _ => {
                        cx.counters.duplicates += 1;
                        Ok(None)
                    }
                }
            }
            Some(Record::In(_)) => Err(unexpected(
                "PREPARE_ACK for a migration this host is the target of",
            )),
            None => {
                cx.queue(let_go, None);
                Err(unexpected(
                    "PREPARE_ACK for a migration this host does not remember",
                ))
            }
        }
    }

    fn on_reject(
        &mut self,
        now: Instant,
        src: Ipv4Addr,
        m: &TcpMigRepr<'_>,
    ) -> Result<(), RxError> {
        let id = m.migration_id;
        let unexpected = |why| RxError::Unexpected {
            kind: m.kind,
            id: MigrationId(id),
            src,
            why,
        };
        if m.origin != self.cfg.local_addr || src != m.target {
            return Err(unexpected(
                "REJECT whose origin/target do not match its path",
            ));
        }
        let (records, mut cx) = self.ctx_parts();
        match records.get_mut(&id) {
            Some(Record::Out(r)) if r.flow == m.flow => {
                cx.counters.rejects_received += 1;
                match r.phase {
                    OriginPhase::Preparing if !r.explicit || r.target == m.target => {
                        r.target = m.target;
                        origin_finish(id, r, &mut cx, now, Outcome::Resumed(m.reason));
                        Ok(())
                    }
                    OriginPhase::Done | OriginPhase::AbortNotify => {
                        cx.counters.duplicates += 1;
                        Ok(())
                    }
                    _ => Err(unexpected("REJECT after the migration was accepted")),
                }
            }
            _ => Err(unexpected(
                "REJECT for a migration this host does not originate",
            )),
        }
    }

    fn on_state_ack(
        &mut self,
        now: Instant,
        src: Ipv4Addr,
        m: &TcpMigRepr<'_>,
    ) -> Result<Option<(u64, ArmChange)>, RxError> {
        let id = m.migration_id;
        let unexpected = |why| RxError::Unexpected {
            kind: m.kind,
            id: MigrationId(id),
            src,
            why,
        };
        let (records, mut cx) = self.ctx_parts();
        match records.get_mut(&id) {
            Some(Record::Out(r)) if r.flow == m.flow && src == r.target && m.target == r.target => {
                match r.phase {
                    OriginPhase::Sending | OriginPhase::InDoubt => {
                        r.tel.state_ack_received = Some(now);
                        origin_finish(id, r, &mut cx, now, Outcome::MigratedOut);
                        Ok(Some((id, arm_change_out(r))))
                    }
                    OriginPhase::Done => {
                        cx.counters.duplicates += 1;
                        Ok(None)
                    }
                    _ => Err(unexpected("CONN_STATE_ACK before any state was sent")),
                }
            }
            _ => Err(unexpected(
                "CONN_STATE_ACK that matches no migration out to its sender",
            )),
        }
    }

    fn on_abort_decision(
        &mut self,
        now: Instant,
        src: Ipv4Addr,
        m: &TcpMigRepr<'_>,
    ) -> Result<(), RxError> {
        let id = m.migration_id;
        let unexpected = |why| RxError::Unexpected {
            kind: m.kind,
            id: MigrationId(id),
            src,
            why,
        };
        if src != m.target {
            return Err(unexpected("ABORT decision not sent by the target it names"));
        }
        let (records, mut cx) = self.ctx_parts();
        let Some(Record::Out(r)) = records.get_mut(&id) else {
            return Err(unexpected(
                "ABORT for a migration this host does not originate",
            ));
        };
        if r.flow != m.flow || (!r.target.is_unspecified() && r.target != m.target) {
            return Err(unexpected(
                "ABORT from a host that is not this migration's target",
            ));
        }
        cx.counters.aborts_received += 1;
        match r.phase {
            OriginPhase::Preparing | OriginPhase::Exporting => {
                r.target = m.target;
                origin_finish(id, r, &mut cx, now, Outcome::Resumed(m.reason));
            }
            OriginPhase::Sending | OriginPhase::InDoubt => {
                // The target forgot the migration (restart, or the record
                // expired): it may have committed and served before, so our
                // copy could be stale. Treat like a target failure.
                let outcome = if m.reason == Reason::UnknownMigration {
                    Outcome::Lost(m.reason)
                } else {
                    Outcome::Resumed(m.reason)
                };
                origin_finish(id, r, &mut cx, now, outcome);
            }
            OriginPhase::AbortNotify => {
                // The target confirmed it let go; we resumed already.
                origin_finish(id, r, &mut cx, now, Outcome::Confirmed);
            }
            OriginPhase::Done => cx.counters.duplicates += 1,
        }
        Ok(())
    }

    fn on_abort_request(
        &mut self,
        now: Instant,
        src: Ipv4Addr,
        m: &TcpMigRepr<'_>,
    ) -> Result<(), RxError> {
        let id = m.migration_id;
        let local = self.cfg.local_addr;
        let unexpected = |why| RxError::Unexpected {
            kind: m.kind,
            id: MigrationId(id),
            src,
            why,
        };
        if src != m.origin || (!m.target.is_unspecified() && m.target != local) {
            return Err(unexpected(
                "ABORT request whose origin/target do not match its path",
            ));
        }
        let (records, mut cx) = self.ctx_parts();
        match records.get_mut(&id) {
            Some(Record::In(r)) => {
                if r.origin != m.origin || r.flow != m.flow {
                    return Err(unexpected(
                        "ABORT request from a host that is not the origin",
                    ));
                }
                cx.counters.aborts_received += 1;
                match r.phase {
                    TargetPhase::Buffering => {
                        let reason = if m.reason == Reason::None {
                            Reason::Cancelled
                        } else {
                            m.reason
                        };
                        target_abort(id, r, &mut cx, now, reason, false);
                    }
                    // Commit in progress in the local stack: the answer
                    // (ACK or ABORT) follows import; the origin asks again.
                    TargetPhase::Importing => {}
                    TargetPhase::Committed => {
                        cx.counters.duplicates += 1;
                        let item = in_item(id, r, Kind::ConnStateAck, Reason::None, local);
                        cx.queue(item, Some(&mut r.queued));
                    }
                    TargetPhase::Aborted(reason) | TargetPhase::Rejected(reason) => {
                        cx.counters.duplicates += 1;
                        let item = in_item(id, r, Kind::Abort, reason, local);
                        cx.queue(item, Some(&mut r.queued));
                    }
                }
                Ok(())
            }
            Some(Record::Out(_)) => Err(unexpected(
                "ABORT request for a migration this host originates",
            )),
            None => {
                cx.counters.aborts_received += 1;
                // Never accepted (or long forgotten): not the owner.
                let item =
                    TxItem::answer(m, m.origin, Kind::Abort, local, Reason::UnknownMigration);
                cx.queue(item, None);
                Ok(())
            }
        }
    }
}

fn target_record(
    records: &mut Map<u64, Record>,
    id: MigrationId,
    want: TargetPhase,
) -> Result<&mut InMig, MigError> {
    // Checked through a shared borrow first: returning the mutable one
    // from one match arm and erroring in another does not borrow-check.
    let state = match records.get(&id.0) {
        Some(Record::In(r)) if r.phase == want => None,
        Some(Record::In(r)) => Some(r.phase.name()),
        Some(Record::Out(r)) => Some(r.phase.name()),
        None => return Err(MigError::UnknownMigration(id)),
    };
    match (state, records.get_mut(&id.0)) {
        (None, Some(Record::In(r))) => Ok(r),
        (state, _) => Err(MigError::WrongState {
            id,
            state: state.unwrap_or("unknown"),
            expected: want.name(),
        }),
    }
}

#[derive(Clone, Copy)]
enum Outcome {
    MigratedOut,
    Resumed(Reason),
    Lost(Reason),
    /// AbortNotify confirmed; the `Resumed` event was emitted before.
    Confirmed,
}

/// Origin: the migration is over; keep a tombstone for duplicates.
fn origin_finish(id: u64, r: &mut OutMig, cx: &mut Ctx<'_>, now: Instant, outcome: Outcome) {
    let mid = MigrationId(id);
    match outcome {
        Outcome::MigratedOut => {
            cx.epochs.remove(&r.flow);
            cx.counters.migrated_out += 1;
            cx.event(Event::MigratedOut {
                id: mid,
                flow: r.flow,
                target: r.target,
            });
        }
        Outcome::Resumed(reason) => {
            cx.counters.resumed += 1;
            cx.event(Event::Resumed {
                id: mid,
                flow: r.flow,
                reason,
            });
        }
        Outcome::Lost(reason) => {
            cx.epochs.remove(&r.flow);
            cx.counters.lost += 1;
            cx.event(Event::Lost {
                id: mid,
                flow: r.flow,
                reason,
            });
        }
        Outcome::Confirmed => {}
    }
    r.kept = !matches!(outcome, Outcome::MigratedOut);
    r.phase = OriginPhase::Done;
    r.retx_at = None;
    r.deadline = now + cx.cfg.linger;
    match outcome {
        // Kept for `Engine::take_resumed_snapshot`: the stack re-imports
        // the connection from it (the record's expiry drops it otherwise).
        Outcome::Resumed(_) => {}
        // Delivered: its buffer serves a later export.
        Outcome::MigratedOut => cx.recycle_snapshot(std::mem::take(&mut r.snapshot)),
        Outcome::Lost(_) | Outcome::Confirmed => r.snapshot = Vec::new(),
    }
    if cx.by_flow_out.get(&r.flow) == Some(&id) {
        cx.by_flow_out.remove(&r.flow);
    }
}

/// Origin, before any CONN_STATE was sent: the target cannot commit, so
/// the origin keeps (resumes) the connection now and tells the target to
/// let go until it confirms (or the record expires).
fn origin_resume_unilaterally(
    id: u64,
    r: &mut OutMig,
    cx: &mut Ctx<'_>,
    now: Instant,
    reason: Reason,
) {
    cx.counters.resumed += 1;
    cx.event(Event::Resumed {
        id: MigrationId(id),
        flow: r.flow,
        reason,
    });
    r.phase = OriginPhase::AbortNotify;
    r.abort_reason = reason;
    r.deadline = now + cx.cfg.linger;
    r.rto = cx.cfg.rto_initial;
    r.retx_at = Some(now + r.rto);
    let item = out_item(
        id,
        r,
        Kind::Abort,
        abort_request_dst(r, cx.cfg),
        cx.cfg.local_addr,
    );
    cx.queue(item, Some(&mut r.queued));
}

/// Origin, after CONN_STATE went out: the target may commit at any moment,
/// so only the target can tell the outcome. Ask until it answers.
fn origin_enter_doubt(id: u64, r: &mut OutMig, cx: &mut Ctx<'_>, now: Instant, reason: Reason) {
    r.phase = OriginPhase::InDoubt;
    r.abort_reason = reason;
    r.deadline = now + cx.cfg.in_doubt_limit;
    r.rto = cx.cfg.rto_initial;
    r.retx_at = Some(now + r.rto);
    let item = out_item(id, r, Kind::Abort, r.target, cx.cfg.local_addr);
    cx.queue(item, Some(&mut r.queued));
}

/// Origin timers; returns false when the record expires.
fn origin_timer(id: u64, r: &mut OutMig, cx: &mut Ctx<'_>, now: Instant) -> bool {
    let local = cx.cfg.local_addr;
    if now >= r.deadline {
        match r.phase {
            OriginPhase::Preparing | OriginPhase::Exporting => {
                origin_resume_unilaterally(id, r, cx, now, Reason::Timeout);
            }
            OriginPhase::Sending => origin_enter_doubt(id, r, cx, now, Reason::Timeout),
            OriginPhase::InDoubt => origin_finish(id, r, cx, now, Outcome::Lost(Reason::Timeout)),
            OriginPhase::AbortNotify => {
                // Unconfirmed: the target is unreachable; its own deadline
                // or the switch's liveness check cleans up.
                origin_finish(id, r, cx, now, Outcome::Confirmed);
            }
            OriginPhase::Done => return false,
        }
        return true;
    }
    if r.retx_at.is_some_and(|t| now >= t) {
        let (kind, dst) = match r.phase {
            OriginPhase::Preparing => (Kind::Prepare, cx.cfg.switch_addr),
            OriginPhase::Sending => (Kind::ConnState, r.target),
            OriginPhase::InDoubt | OriginPhase::AbortNotify => {
                (Kind::Abort, abort_request_dst(r, cx.cfg))
            }
            OriginPhase::Exporting | OriginPhase::Done => {
                r.retx_at = None;
                return true;
            }
        };
        if kind == Kind::ConnState {
            if r.queued & kind_bit(Kind::ConnState) != 0 {
                // The burst is still leaving: nothing to resend yet; the
                // timer restarts from its last fragment (`poll_transmit`).
                r.retx_at = Some(now + r.rto);
                return true;
            }
            // No per-fragment acks in v1: resend the whole snapshot.
            r.cursor = 0;
            cx.counters.retransmissions += u64::from(r.frag_count);
            r.tel.retransmissions += u32::from(r.frag_count);
        } else {
            cx.counters.retransmissions += 1;
            r.tel.retransmissions += 1;
        }
        let item = out_item(id, r, kind, dst, local);
        cx.queue(item, Some(&mut r.queued));
        r.rto = cx.backoff(r.rto);
        r.retx_at = Some(now + r.rto);
    }
    true
}

/// When a record next has timer work (`None`: never). A finished record
/// only waits to expire: its expiry is rounded up to `EXPIRY_GRAIN_US`
/// (later is harmless), so that records expire in batches instead of one
/// wake-up each.
/// A record's new due time and whether it is lingering, when its armed
/// time changed (`None`: the armed entry is current).
type ArmChange = Option<(Option<Instant>, bool)>;

/// Records `rec`'s due time as armed; its change for [`Engine::apply_arm`].
fn arm_change(rec: &mut Record) -> ArmChange {
    match rec {
        Record::Out(r) => arm_change_out(r),
        Record::In(r) => arm_change_in(r),
    }
}

/// Records `due` in `armed`: the change to make, if it is one.
fn rearm(armed: &mut Option<Instant>, due: Option<Instant>, lingering: bool) -> ArmChange {
    if *armed == due {
        return None;
    }
    *armed = due;
    Some((due, lingering))
}

#[cfg(test)]
fn due_of_record(rec: &Record) -> Option<Instant> {
    match rec {
        Record::Out(r) => due_of_out(r),
        Record::In(r) => due_of_in(r),
    }
}

/// A finished record's expiry, rounded up to `EXPIRY_GRAIN_US`.
fn expiry(d: Instant) -> Instant {
    Instant::from_micros(d.as_micros().div_ceil(EXPIRY_GRAIN_US) * EXPIRY_GRAIN_US)
}

fn min_due(a: Option<Instant>, b: Option<Instant>) -> Option<Instant> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

fn due_of_out(r: &OutMig) -> Option<Instant> {
    min_due(
        r.retx_at,
        Some(if r.phase == OriginPhase::Done {
            expiry(r.deadline)
        } else {
            r.deadline
        }),
    )
}

fn due_of_in(r: &InMig) -> Option<Instant> {
    min_due(
        r.retx_at,
        match r.phase {
            TargetPhase::Buffering | TargetPhase::Importing => r.deadline,
            _ => r.deadline.map(expiry),
        },
    )
}

/// Whether the record's only timer is its expiry (finished, nothing to
/// retransmit): its entry may go to `Engine::expiries`.
fn is_lingering_in(r: &InMig) -> bool {
    !matches!(r.phase, TargetPhase::Buffering | TargetPhase::Importing) && r.retx_at.is_none()
}

/// [`arm_change`] for a migration in held without its `Record`.
fn arm_change_in(r: &mut InMig) -> ArmChange {
    let (due, lingering) = (due_of_in(r), is_lingering_in(r));
    rearm(&mut r.armed, due, lingering)
}

fn is_lingering_out(r: &OutMig) -> bool {
    r.phase == OriginPhase::Done && r.retx_at.is_none()
}

/// [`arm_change`] for a migration out held without its `Record`.
fn arm_change_out(r: &mut OutMig) -> ArmChange {
    let (due, lingering) = (due_of_out(r), is_lingering_out(r));
    rearm(&mut r.armed, due, lingering)
}

/// Target: give the migration up (never after commit). `unsolicited`
/// decisions are repeated a few times; solicited ones answer each request.
fn target_abort(
    id: u64,
    r: &mut InMig,
    cx: &mut Ctx<'_>,
    now: Instant,
    reason: Reason,
    unsolicited: bool,
) {
    debug_assert!(matches!(
        r.phase,
        TargetPhase::Buffering | TargetPhase::Importing
    ));
    r.phase = TargetPhase::Aborted(reason);
    r.deadline = Some(now + cx.cfg.linger);
    let bufs = r.bufs.take();
    cx.release(bufs);
    if cx.by_flow_in.get(&r.flow) == Some(&id) {
        cx.by_flow_in.remove(&r.flow);
    }
    cx.event(Event::AbortedIn {
        id: MigrationId(id),
        flow: r.flow,
        reason,
    });
    if unsolicited && cx.cfg.abort_repeats > 0 {
        r.repeats_left = cx.cfg.abort_repeats;
        r.rto = cx.cfg.rto_initial;
        r.retx_at = Some(now + r.rto);
    }
    let item = in_item(id, r, Kind::Abort, reason, cx.cfg.local_addr);
    cx.queue(item, Some(&mut r.queued));
}

/// Target timers; returns false when the record expires.
fn target_timer(id: u64, r: &mut InMig, cx: &mut Ctx<'_>, now: Instant) -> bool {
    if r.deadline.is_some_and(|d| now >= d) {
        match r.phase {
            TargetPhase::Buffering => {
                target_abort(id, r, cx, now, Reason::Timeout, true);
                return true;
            }
            TargetPhase::Importing => {
                r.deadline = None;
                return true;
            }
            TargetPhase::Committed | TargetPhase::Rejected(_) | TargetPhase::Aborted(_) => {
                return false
            }
        }
    }
    if r.retx_at.is_some_and(|t| now >= t) {
        match r.phase {
            TargetPhase::Aborted(reason) if r.repeats_left > 0 => {
                r.repeats_left -= 1;
                cx.counters.retransmissions += 1;
                r.tel.retransmissions += 1;
                let item = in_item(id, r, Kind::Abort, reason, cx.cfg.local_addr);
                cx.queue(item, Some(&mut r.queued));
                r.rto = cx.backoff(r.rto);
                r.retx_at = if r.repeats_left > 0 {
                    Some(now + r.rto)
                } else {
                    None
                };
            }
            _ => r.retx_at = None,
        }
    }
    true
}

#[cfg(test)]
mod timer_tests {
    use super::*;

    /// The timer heap against a scan: after every call, `poll_timeout` is
    /// the earliest timer of any record (never a stale, earlier one), the
    /// heap stays within its capacity (it is rebuilt, never grown), and
    /// records still expire.
    #[test]
    fn heap_matches_a_scan_and_stays_bounded() {
        let local = Ipv4Addr::new(10, 0, 0, 1);
        let mut cfg = EngineConfig::new(local, Ipv4Addr::new(10, 0, 0, 254));
        cfg.max_concurrent_in = 2;
        cfg.max_concurrent_out = 8;
        cfg.max_records = 16;
        let mut e = Engine::new(cfg, MigrationKey::from_bytes(&[9; 32]).unwrap()).unwrap();
        let cap = e.timer_cap;
        let flow = |i: u16| FlowKey {
            client_ip: Ipv4Addr::new(10, 1, 0, 9),
            client_port: 40_000 + i,
            service_ip: Ipv4Addr::new(10, 9, 0, 1),
            service_port: 80,
        };
        let scan = |e: &Engine| e.records.keys().filter_map(|&id| e.due_of(id)).min();
        let mut buf = vec![0u8; 1500];
        let mut now = Instant::from_micros(1_000_000);
        let mut queued_expiries = 0;
        for i in 0..20_000u32 {
            now += Duration::from_micros(u64::from(i % 5) * 37 + 1);
            let f = flow((i % 11) as u16);
            if let Ok(id) = e.migrate_out(now, f, None) {
                if i % 2 == 0 {
                    now += Duration::from_micros(3);
                    let _ = e.abort_out(now, id);
                }
            }
            while e.poll_transmit(now, &mut buf).is_some() {}
            if i % 7 == 0 {
                if let Some(t) = e.poll_timeout() {
                    now = now.max(t);
                    e.handle_timeout(now);
                }
            }
            while e.poll_event().is_some() {}
            assert_eq!(e.poll_timeout(), scan(&e), "step {i}");
            assert!(e.timers.len() <= cap, "heap grew past {cap}");
            assert!(e.expiries.len() <= cap, "expiry queue grew past {cap}");
            queued_expiries = queued_expiries.max(e.expiries.len());
        }
        assert!(queued_expiries > 0, "no expiry went to the queue");
        // Everything expires: the heap empties with the records.
        for _ in 0..10_000 {
            match e.poll_timeout() {
                Some(t) => {
                    now = now.max(t);
                    e.handle_timeout(now);
                    while e.poll_transmit(now, &mut buf).is_some() {}
                    while e.poll_event().is_some() {}
                }
                None => break,
            }
        }
        assert_eq!(e.records(), 0);
        assert!(e.timers.is_empty());
        assert!(e.expiries.is_empty());

        // Stale entries below a live top pile up until the heap is full:
        // it is rebuilt from the live entries, never grown.
        let a = e.migrate_out(now, flow(1), None).unwrap().0;
        let b = e.migrate_out(now, flow(2), None).unwrap().0;
        for k in 0..(3 * cap as u64) {
            if let Some(Record::Out(r)) = e.records.get_mut(&b) {
                r.retx_at = Some(now + Duration::from_millis(2) + Duration::from_micros(k));
            }
            e.rearm(b);
            assert!(e.timers.len() <= cap);
            assert_eq!(e.poll_timeout(), scan(&e));
        }
        assert!(e.timer_rebuilds > 0, "the rebuild path was not exercised");
        assert_eq!(e.armed(a), e.poll_timeout());
    }
}

#[cfg(test)]
mod policy_tests {
    use super::*;

    /// The counter a REGISTER_ACK seeds: no migration before it when the
    /// configuration holds them; above the switch's last id in serial
    /// arithmetic (across the wrap), never back.
    #[test]
    fn a_held_counter_starts_migrations_above_the_switchs_last_id() {
        let local = Ipv4Addr::new(198, 18, 2, 10);
        let flow = |port| FlowKey {
            client_ip: Ipv4Addr::new(198, 18, 0, 10),
            client_port: port,
            service_ip: Ipv4Addr::new(198, 18, 100, 1),
            service_port: 80,
        };
        let key = || MigrationKey::from_bytes(&[0x42; 32]).unwrap();
        let now = Instant::from_millis(1000);
        let mut c = EngineConfig::new(local, Ipv4Addr::new(198, 18, 1, 1));
        c.first_migration_seq = 1000;
        c.hold_until_seeded = true;
        let mut e = Engine::new(c.clone(), key()).unwrap();
        assert!(!e.counter_seeded());
        assert_eq!(
            e.migrate_out(now, flow(1), None),
            Err(MigError::CounterNotSeeded)
        );
        assert_eq!(e.records(), 0);
        // The previous process ran ahead of the clock seed.
        assert_eq!(e.seed_migration_counter(Some(5000)), 5000 + SEED_MARGIN);
        let id = e.migrate_out(now, flow(1), None).unwrap();
        assert_eq!(
            id.0,
            u64::from(u32::from(local)) << 32 | u64::from(5000 + SEED_MARGIN)
        );
        // Later REGISTER_ACKs name this process's own ids: no jump.
        assert_eq!(
            e.seed_migration_counter(Some(5000 + SEED_MARGIN)),
            5001 + SEED_MARGIN
        );
        assert_eq!(e.seed_migration_counter(None), 5001 + SEED_MARGIN);

        // The clock seed is already above: kept.
        let mut e = Engine::new(c.clone(), key()).unwrap();
        assert_eq!(e.seed_migration_counter(Some(999)), 1000);
        assert_eq!(e.seed_migration_counter(None), 1000);
        // Across the wrap: u32::MAX - 5 is behind 1000 in serial order...
        let mut e = Engine::new(c.clone(), key()).unwrap();
        assert_eq!(e.seed_migration_counter(Some(u32::MAX - 5)), 1000);
        // ...and 1000 behind a last id just past it.
        c.first_migration_seq = u32::MAX - 5;
        let mut e = Engine::new(c.clone(), key()).unwrap();
        assert_eq!(e.seed_migration_counter(Some(1000)), 1000 + SEED_MARGIN);
        // Equal: the last id itself is taken.
        c.first_migration_seq = 7;
        let mut e = Engine::new(c.clone(), key()).unwrap();
        assert_eq!(e.seed_migration_counter(Some(7)), 7 + SEED_MARGIN);

        // Without the hold (the default): migrations start at once.
        c.hold_until_seeded = false;
        let mut e = Engine::new(c, key()).unwrap();
        assert!(e.counter_seeded());
        assert!(e.migrate_out(now, flow(2), None).is_ok());
    }

    fn engine(drop: bool) -> Engine {
        let mut c = EngineConfig::new(Ipv4Addr::new(198, 18, 2, 10), Ipv4Addr::new(198, 18, 1, 1));
        if drop {
            c.buffer_mode = BufferMode::Drop;
        }
        Engine::new(c, MigrationKey::from_bytes(&[0x42; 32]).unwrap()).unwrap()
    }

    /// When an origin whose target never answers gives its migration up.
    fn gives_up_at(e: &mut Engine, client_port: u16) -> Duration {
        let flow = FlowKey {
            client_ip: Ipv4Addr::new(198, 18, 0, 10),
            client_port,
            service_ip: Ipv4Addr::new(198, 18, 100, 1),
            service_port: 80,
        };
        let t0 = Instant::from_millis(1000);
        e.migrate_out(t0, flow, Some(Ipv4Addr::new(198, 18, 2, 11)))
            .unwrap();
        let mut buf = vec![0u8; 1500];
        let mut t = t0;
        while t < t0 + Duration::from_secs(20) {
            while e.poll_transmit(t, &mut buf).is_some() {}
            if e.poll_timeout().is_some_and(|d| d <= t) {
                e.handle_timeout(t);
            }
            while let Some(ev) = e.poll_event() {
                if matches!(ev, Event::Resumed { .. }) {
                    return t - t0;
                }
            }
            t += Duration::from_millis(1);
        }
        panic!("never gave up");
    }

    #[test]
    fn a_policy_deadline_applies_to_new_migrations_and_keeps_the_invariants() {
        let mut e = engine(false);
        let created = e.config().clone();
        assert_eq!(gives_up_at(&mut e, 1), Duration::from_millis(50));
        // Longer: the cap and the target's deadlines keep their margins,
        // linger outlasts the longest deadline plus the in-doubt limit.
        e.set_migration_deadline(Some(Duration::from_millis(10_000)))
            .unwrap();
        let c = e.config().clone();
        assert_eq!(c.migration_deadline, Duration::from_millis(10_000));
        assert_eq!(c.migration_deadline_max, Duration::from_millis(10_200));
        assert_eq!(c.target_deadline, Duration::from_millis(10_050));
        assert_eq!(c.target_deadline_max, Duration::from_millis(10_250));
        assert!(c.linger > c.longest_deadline() + c.in_doubt_limit);
        c.validate().unwrap();
        // Shorter than created: nothing below the created bounds, linger
        // kept (migrations of the long deadline may still be in doubt).
        e.set_migration_deadline(Some(Duration::from_millis(10)))
            .unwrap();
        let s = e.config().clone();
        assert_eq!(s.migration_deadline, Duration::from_millis(10));
        assert_eq!(s.migration_deadline_max, created.migration_deadline_max);
        assert_eq!(s.target_deadline, created.target_deadline);
        assert_eq!(s.linger, c.linger);
        assert_eq!(gives_up_at(&mut e, 2), Duration::from_millis(10));
        // Refused: nothing changes.
        assert!(e.set_migration_deadline(Some(Duration::ZERO)).is_err());
        assert_eq!(e.config().migration_deadline, Duration::from_millis(10));
        // None: the created deadline again.
        e.set_migration_deadline(None).unwrap();
        assert_eq!(e.config().migration_deadline, created.migration_deadline);
    }

    #[test]
    fn a_buffer_policy_does_not_override_a_configured_drop_mode() {
        let mut e = engine(false);
        assert_eq!(e.set_policy_buffer_mode(true), BufferMode::Drop);
        assert_eq!(e.set_policy_buffer_mode(false), BufferMode::Buffer);
        let mut d = engine(true);
        assert_eq!(d.set_policy_buffer_mode(false), BufferMode::Drop);
        assert_eq!(d.set_policy_buffer_mode(true), BufferMode::Drop);
    }
}
