//! Draining a server for maintenance: every connection it serves migrates
//! to other servers, a bounded number at a time, within the drain's
//! deadline.
//!
//! Why a bound: a migration pauses its connection for a few milliseconds
//! (the connection manager's quiesce, PREPARE, export, transfer, import on
//! the target, the target's new loopback connection to the application).
//! Started all at once, every client pauses at the same moment and the
//! server's throughput drops for every client together: `make
//! bench-maintenance` measured worst 10 ms bins of 0.36-0.70 of steady with
//! the 16 migrations of its drain started together. With at most
//! [`Drainer::max_in_flight`] migrations under way, the other connections
//! keep being served while one pauses.
//!
//! The bound gives way to the deadline: the limit in force is raised when
//! the connections left would not finish within half the time left before
//! the drain's deadline at the pace measured so far (mean duration of the
//! drain's migrations), so a drain of many connections still completes in
//! time, with more in flight.
//!
//! Outcomes are read from the migrator, never assumed: a finished
//! migration's record (migrated out, resumed here, lost), the connection's
//! handle (frozen, moved, closed), or the connection manager's wait. A
//! migration that does not happen (the target refused, the manager was not
//! ready within its wait, the engine's deadline) is retried after a backoff
//! until the drain's deadline; connections that arrive during the drain
//! (accepted just before the switch took the server out of placement) are
//! picked up when the queue runs dry. Progress is logged at most every
//! [`PROGRESS_EVERY`], and once at the end with per-phase timings.
//!
//! Runs from the stack's poll, and only while a drain is active (otherwise
//! one branch); it allocates when a drain starts and for its bounded timing
//! samples, never per packet.
//!
//! A graceful stop ([`leave`], SIGTERM/SIGINT with `[shutdown]
//! drain_timeout_ms`) uses the same drain: the engine refuses migrations
//! in, every connection is drained within the stop's deadline (which also
//! caps an operator's drain already running: the earlier one holds), and
//! connections that arrive meanwhile are drained too, until none is served
//! and no migration is in flight, or the deadline. It runs from a timer
//! task, not from the packet path. [`StopSignal`] tells the control channel
//! (HEARTBEAT LEAVING, then STOPPED).

use crate::migration::{HandleState, MigrateError, Migrator, Outcome};
use capybara_proto::control::MigrationTrigger;
use capybara_proto::time::{Duration, Instant};
use capybara_proto::FlowKey;
use capybara_tcp::ConnId;
use std::collections::VecDeque;
use std::net::SocketAddrV4;

/// Migrations a drain keeps under way at once, unless its deadline needs
/// more (`[migration] drain_max_in_flight`).
pub const DEFAULT_MAX_IN_FLIGHT: usize = 1;
/// Upper bound of `drain_max_in_flight` and of the deadline-driven raise
/// (the engine's default `max_concurrent_out`).
pub const MAX_IN_FLIGHT_LIMIT: usize = 256;
/// A drain without a deadline (0 in the DRAIN message) gets this one.
pub const DEFAULT_DEADLINE: Duration = Duration::from_secs(30);
/// How often an active drain re-checks its migrations without news.
const CHECK_EVERY: Duration = Duration::from_millis(1);
/// Progress lines, at most this often.
pub const PROGRESS_EVERY: Duration = Duration::from_millis(500);
/// First retry of a connection whose migration did not happen; doubles up
/// to `RETRY_MAX`.
const RETRY_FIRST: Duration = Duration::from_millis(5);
const RETRY_MAX: Duration = Duration::from_millis(200);
/// A picked connection still served here, not waiting for its manager and
/// without a finished record for this long was given up by its manager's
/// wait (100 ms at most) or the engine (its 50 ms deadline reports a
/// record): retry it.
const GIVEN_UP_AFTER: Duration = Duration::from_millis(200);
/// Pace assumed before the first migration of a drain finishes.
const INITIAL_ESTIMATE_US: f64 = 10_000.0;
/// Per-phase timing samples kept per drain.
const SAMPLES: usize = 4096;

struct Picked {
    flow: FlowKey,
    app: ConnId,
    picked: Instant,
    /// Last time the manager was seen still quiescing (or the pick).
    waiting: Instant,
    attempts: u32,
}

/// Per-migration phase durations (µs) of one drain.
#[derive(Default)]
struct Timings {
    /// Picked by the drain -> `migrate_out` (the connection manager's quiesce).
    quiesce: Vec<u32>,
    /// `migrate_out` -> PREPARE_ACK (PREPARE through the switch and back).
    prepare: Vec<u32>,
    /// PREPARE_ACK -> snapshot handed to the engine (freeze, export).
    export: Vec<u32>,
    /// Snapshot handed over -> CONN_STATE_ACK (transfer, import, replay).
    transfer: Vec<u32>,
    /// Picked -> CONN_STATE_ACK.
    total: Vec<u32>,
}

fn us(d: Duration) -> u32 {
    d.as_micros().min(u128::from(u32::MAX)) as u32
}

impl Timings {
    fn add(&mut self, picked: Instant, t: &capybara_tcpmig::Telemetry) {
        if self.total.len() >= SAMPLES {
            return;
        }
        let (Some(s), Some(a), Some(e), Some(k)) = (
            t.started,
            t.prepare_ack_received,
            t.export_done,
            t.state_ack_received,
        ) else {
            return;
        };
        self.quiesce.push(us(s - picked));
        self.prepare.push(us(a - s));
        self.export.push(us(e - a));
        self.transfer.push(us(k - e));
        self.total.push(us(k - picked));
    }

    fn describe(&mut self) -> String {
        let mut out = String::new();
        for (name, v) in [
            ("quiesce", &mut self.quiesce),
            ("prepare", &mut self.prepare),
            ("export", &mut self.export),
            ("transfer", &mut self.transfer),
            ("total", &mut self.total),
        ] {
            if v.is_empty() {
                continue;
            }
            v.sort_unstable();
            let ms = |x: u32| f64::from(x) / 1000.0;
            out.push_str(&format!(
                " {name}={:.2}/{:.2}/{:.2}",
                ms(v[v.len() / 2]),
                ms(v[(v.len() * 9 / 10).min(v.len() - 1)]),
                ms(v[v.len() - 1])
            ));
        }
        out
    }
}

struct Run {
    /// Only connections of these services (empty: every connection).
    only: Vec<SocketAddrV4>,
    started: Instant,
    deadline: Instant,
    queue: VecDeque<(FlowKey, ConnId, u32)>,
    /// Connections to try again: (when, flow, handle, attempts so far).
    retry: Vec<(Instant, FlowKey, ConnId, u32)>,
    in_flight: Vec<Picked>,
    /// `Migrator::recorded` already looked at.
    seen: u64,
    total: usize,
    migrated: usize,
    lost: usize,
    closed: usize,
    retries: u64,
    /// Most migrations under way at once.
    peak: usize,
    /// Mean duration of this drain's migrations (µs, moving average).
    pace_us: f64,
    timings: Timings,
    next_check: Instant,
    next_progress: Instant,
}

/// The migrations a drain keeps under way: `configured`, raised when `left`
/// connections at `pace_us` each would not finish within half of
/// `time_left` (the other half is slack for retries and slow migrations),
/// never above [`MAX_IN_FLIGHT_LIMIT`].
pub fn in_flight_limit(configured: usize, left: usize, pace_us: f64, time_left: Duration) -> usize {
    let budget_us = time_left.as_micros() as f64 / 2.0;
    let needed = if budget_us < 1.0 {
        MAX_IN_FLIGHT_LIMIT as f64
    } else {
        (left as f64 * pace_us / budget_us).ceil()
    };
    (needed as usize).clamp(
        configured.clamp(1, MAX_IN_FLIGHT_LIMIT),
        MAX_IN_FLIGHT_LIMIT,
    )
}

/// Counters of the drain under way (or the last one).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DrainProgress {
    pub active: bool,
    pub total: usize,
    pub migrated: usize,
    pub lost: usize,
    pub closed: usize,
    pub remaining: usize,
    pub in_flight: usize,
    pub retries: u64,
}

/// The drain of this server (one at a time).
pub struct Drainer {
    /// Migrations kept under way at once, unless the deadline needs more.
    pub max_in_flight: usize,
    /// Names it in log lines ("drain", "health drain").
    label: &'static str,
    run: Option<Run>,
    last: DrainProgress,
    /// "No connection to migrate" was logged for the drain in force.
    said_empty: bool,
    /// No drain runs past this (a graceful stop's deadline).
    cap: Option<Instant>,
}

impl Default for Drainer {
    fn default() -> Self {
        Drainer::new(DEFAULT_MAX_IN_FLIGHT)
    }
}

impl Drainer {
    pub fn new(max_in_flight: usize) -> Drainer {
        Drainer::labelled("", max_in_flight)
    }

    /// A drainer whose log lines say `<label> drain` (e.g. the health
    /// checks' migration of a down service's connections).
    pub fn labelled(label: &'static str, max_in_flight: usize) -> Drainer {
        Drainer {
            label,
            max_in_flight: max_in_flight.clamp(1, MAX_IN_FLIGHT_LIMIT),
            run: None,
            last: DrainProgress::default(),
            said_empty: false,
            cap: None,
        }
    }

    pub fn active(&self) -> bool {
        self.run.is_some()
    }

    /// No drain (the one under way, or a later one) runs past `at`: a
    /// graceful stop's deadline. A drain with an earlier deadline keeps it.
    pub fn cap_deadline(&mut self, at: Instant) {
        self.cap = Some(at);
        if let Some(r) = &mut self.run {
            r.deadline = r.deadline.min(at);
        }
    }

    /// Starts draining every connection `m` serves, to finish by
    /// `now + deadline` (zero: [`DEFAULT_DEADLINE`]). A drain already under
    /// way keeps going with the new deadline (the switch repeats DRAIN until
    /// a heartbeat shows it). Returns the connections queued.
    pub fn start(&mut self, now: Instant, deadline: Duration, m: &Migrator) -> usize {
        self.start_for(now, deadline, m, &[])
    }

    /// [`Drainer::start`] for the connections of the services `only` lists
    /// (empty: every connection). A run under way for other services is
    /// cancelled first (its migrations under way finish).
    pub fn start_for(
        &mut self,
        now: Instant,
        deadline: Duration,
        m: &Migrator,
        only: &[SocketAddrV4],
    ) -> usize {
        if self.run.as_ref().is_some_and(|r| r.only != only) {
            self.cancel(now);
        }
        let deadline = if deadline.is_zero() {
            DEFAULT_DEADLINE
        } else {
            deadline
        };
        let deadline = match self.cap {
            Some(cap) => deadline.min(cap.saturating_since(now)),
            None => deadline,
        };
        if let Some(r) = &mut self.run {
            r.deadline = now + deadline;
            return 0;
        }
        let queue: VecDeque<_> = m
            .flows()
            .filter(|(f, _)| wanted(only, f))
            .map(|(f, id)| (*f, m.app_handle(*id), 0))
            .collect();
        let total = queue.len();
        if total == 0 {
            // Nothing here (or a DRAIN repeated after the drain finished):
            // said once, until the drain is cancelled.
            if !self.said_empty {
                println!(
                    "hostagent: {}drain: no connection to migrate",
                    log_prefix(self.label)
                );
                self.said_empty = true;
            }
            return 0;
        }
        println!(
            "hostagent: {}drain: {total} connection(s), at most {} migration(s) at once, deadline {} ms",
            log_prefix(self.label),
            self.max_in_flight,
            deadline.as_millis()
        );
        self.run = Some(Run {
            only: only.to_vec(),
            started: now,
            deadline: now + deadline,
            queue,
            retry: Vec::new(),
            in_flight: Vec::with_capacity(self.max_in_flight),
            seen: m.recorded,
            total,
            migrated: 0,
            lost: 0,
            closed: 0,
            retries: 0,
            peak: 0,
            pace_us: INITIAL_ESTIMATE_US,
            timings: Timings::default(),
            next_check: now,
            next_progress: now + PROGRESS_EVERY,
        });
        self.last = self.progress();
        total
    }

    /// The drain was cancelled (undrain): migrations under way finish,
    /// nothing new starts.
    pub fn cancel(&mut self, now: Instant) {
        self.said_empty = false;
        if let Some(r) = self.run.take() {
            self.finish(now, r, "cancelled");
        }
    }

    /// Counters of the drain under way, or of the last one.
    pub fn progress(&self) -> DrainProgress {
        match &self.run {
            None => self.last,
            Some(r) => DrainProgress {
                active: true,
                total: r.total,
                migrated: r.migrated,
                lost: r.lost,
                closed: r.closed,
                remaining: r.queue.len() + r.retry.len() + r.in_flight.len(),
                in_flight: r.in_flight.len(),
                retries: r.retries,
            },
        }
    }

    /// When the stack should call [`Drainer::poll`] again.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.run.as_ref().map(|r| r.next_check)
    }

    /// Advances the drain: reads finished migrations, starts new ones up to
    /// the limit, logs progress. Returns whether a migration started.
    pub fn poll(&mut self, now: Instant, m: &mut Migrator) -> bool {
        let Some(r) = &mut self.run else {
            return false;
        };
        if now < r.next_check && m.recorded == r.seen {
            return false;
        }
        r.next_check = now + CHECK_EVERY;
        Self::read_records(r, now, m);
        Self::check_in_flight(r, now, m);
        let started = self.start_more(now, m);
        let Some(r) = &mut self.run else {
            return started;
        };
        let remaining = r.queue.len() + r.retry.len() + r.in_flight.len();
        if remaining == 0 {
            // Connections accepted after the drain started (the switch
            // stops placing new ones on a drained server, but some may
            // have been in flight), or resumed ones not yet queued.
            let known = |f: &FlowKey| r.in_flight.iter().any(|p| p.flow == *f);
            let late: Vec<_> = m
                .flows()
                .filter(|(f, _)| !known(f) && wanted(&r.only, f))
                .map(|(f, id)| (*f, m.app_handle(*id), 0))
                .collect();
            if late.is_empty() {
                let r = self.run.take().expect("checked above");
                self.finish(now, r, "done");
                return started;
            }
            r.total += late.len();
            r.queue.extend(late);
        } else if now >= r.deadline {
            let r = self.run.take().expect("checked above");
            self.finish(now, r, "deadline passed");
            return started;
        }
        if now >= r.next_progress {
            r.next_progress = now + PROGRESS_EVERY;
            println!(
                "hostagent: {}drain: {}/{} migrated, {} in flight, {} left, {} lost, {} closed, {} retried, {} ms",
                log_prefix(self.label),
                r.migrated,
                r.total,
                r.in_flight.len(),
                remaining,
                r.lost,
                r.closed,
                r.retries,
                (now - r.started).as_millis()
            );
        }
        started
    }

    /// Finished migrations of picked connections, from the migrator's
    /// records (each seen once, in the order they finished).
    fn read_records(r: &mut Run, now: Instant, m: &Migrator) {
        let new = m.recorded.saturating_sub(r.seen);
        r.seen = m.recorded;
        if new == 0 || r.in_flight.is_empty() {
            return;
        }
        let held = m.recent().count();
        let skip = held.saturating_sub(usize::try_from(new).unwrap_or(usize::MAX));
        for rec in m.recent().skip(skip) {
            let Some(i) = r.in_flight.iter().position(|p| p.flow == rec.flow) else {
                continue;
            };
            match rec.outcome {
                Outcome::MigratedOut => {
                    let p = r.in_flight.swap_remove(i);
                    r.migrated += 1;
                    if let Some(t) = &rec.telemetry {
                        r.timings.add(p.picked, t);
                    }
                    let took = (now - p.picked).as_micros() as f64;
                    r.pace_us = 0.8 * r.pace_us + 0.2 * took;
                }
                Outcome::Lost(_) => {
                    r.in_flight.swap_remove(i);
                    r.lost += 1;
                }
                Outcome::Resumed(_) => {
                    let p = r.in_flight.swap_remove(i);
                    Self::retry_later(r, now, p.flow, p.app, p.attempts + 1);
                }
                // Migrations in: not ours.
                Outcome::MigratedIn | Outcome::AbortedIn | Outcome::ImportFailed => {}
            }
        }
    }

    /// Picked connections without a record: still quiescing, frozen, gone
    /// (closed by their client), or given up by their manager's wait.
    fn check_in_flight(r: &mut Run, now: Instant, m: &Migrator) {
        let mut i = 0;
        while i < r.in_flight.len() {
            let p = &mut r.in_flight[i];
            if m.managers.is_waiting(&p.flow) {
                p.waiting = now;
                i += 1;
                continue;
            }
            match m.handle(p.app) {
                HandleState::Frozen => i += 1,
                HandleState::Moved(_) => {
                    r.in_flight.swap_remove(i);
                    r.migrated += 1;
                }
                HandleState::Lost => {
                    r.in_flight.swap_remove(i);
                    r.lost += 1;
                }
                HandleState::Live(_) if !m.serves(&p.flow) => {
                    r.in_flight.swap_remove(i);
                    r.closed += 1;
                }
                HandleState::Live(_) if now - p.waiting >= GIVEN_UP_AFTER => {
                    let p = r.in_flight.swap_remove(i);
                    Self::retry_later(r, now, p.flow, p.app, p.attempts + 1);
                }
                HandleState::Live(_) => i += 1,
            }
        }
    }

    fn retry_later(r: &mut Run, now: Instant, flow: FlowKey, app: ConnId, attempts: u32) {
        r.retries += 1;
        let backoff = RETRY_FIRST * 2u32.saturating_pow(attempts.saturating_sub(1).min(8));
        r.retry
            .push((now + backoff.min(RETRY_MAX), flow, app, attempts));
    }

    fn limit(&self, r: &Run, now: Instant) -> usize {
        in_flight_limit(
            self.max_in_flight,
            r.queue.len() + r.retry.len() + r.in_flight.len(),
            r.pace_us,
            r.deadline - now,
        )
    }

    fn start_more(&mut self, now: Instant, m: &mut Migrator) -> bool {
        let Some(r) = &self.run else {
            return false;
        };
        let limit = self.limit(r, now);
        let r = self.run.as_mut().expect("checked above");
        let mut started = false;
        while r.in_flight.len() < limit {
            let next = match r.retry.iter().position(|(at, ..)| *at <= now) {
                Some(i) => {
                    let (_, f, a, n) = r.retry.swap_remove(i);
                    Some((f, a, n))
                }
                None => r.queue.pop_front(),
            };
            let Some((flow, app, attempts)) = next else {
                break;
            };
            if !m.serves(&flow) {
                // Closed (or its handle released) since it was queued.
                r.closed += 1;
                continue;
            }
            let picked = Picked {
                flow,
                app,
                picked: now,
                waiting: now,
                attempts,
            };
            match m.migrate_as(now, flow, None, MigrationTrigger::Drain) {
                Ok(_) => {
                    started = true;
                    r.in_flight.push(picked);
                }
                // Quiescing: the migration starts when its manager is ready.
                Err(MigrateError::Waiting(_)) => r.in_flight.push(picked),
                Err(MigrateError::NotServed(_)) => r.closed += 1,
                Err(_) => Self::retry_later(r, now, flow, app, attempts + 1),
            }
        }
        r.peak = r.peak.max(r.in_flight.len());
        if let Some(at) = r.retry.iter().map(|(at, ..)| *at).min() {
            r.next_check = r.next_check.min(at.max(now));
        }
        started
    }

    fn finish(&mut self, now: Instant, mut r: Run, how: &str) {
        let remaining = r.queue.len() + r.retry.len() + r.in_flight.len();
        println!(
            "hostagent: {}drain {how} after {} ms: {}/{} migrated, {} lost, {} closed, {} left, {} retried, \
             at most {} at once; per migration p50/p90/max ms:{}",
            log_prefix(self.label),
            (now - r.started).as_millis(),
            r.migrated,
            r.total,
            r.lost,
            r.closed,
            remaining,
            r.retries,
            r.peak,
            r.timings.describe()
        );
        self.last = DrainProgress {
            active: false,
            total: r.total,
            migrated: r.migrated,
            lost: r.lost,
            closed: r.closed,
            remaining,
            in_flight: r.in_flight.len(),
            retries: r.retries,
        };
    }
}

/// Where a graceful stop is, shared by the stop task and the control
/// channel ([`StopSignal`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum StopPhase {
    /// Not stopping.
    Serving,
    /// Migrating its connections away: heartbeats say LEAVING.
    Leaving,
    /// Exits now: the control channel sends its STOPPED heartbeats.
    Stopped,
}

/// The graceful stop's phase, and its signals to the control channel
/// (single-threaded: the hostagent's tasks share one thread).
#[derive(Debug)]
pub struct StopSignal {
    phase: std::cell::Cell<StopPhase>,
    /// The phase changed (one waiter: the control channel).
    pub changed: tokio::sync::Notify,
    /// The control channel sent its STOPPED heartbeats (or had nobody to
    /// send them to).
    pub stopped_sent: tokio::sync::Notify,
}

impl Default for StopSignal {
    fn default() -> Self {
        StopSignal {
            phase: std::cell::Cell::new(StopPhase::Serving),
            changed: tokio::sync::Notify::new(),
            stopped_sent: tokio::sync::Notify::new(),
        }
    }
}

impl StopSignal {
    pub fn phase(&self) -> StopPhase {
        self.phase.get()
    }

    /// Moves on to `phase` (never back) and wakes the control channel.
    pub fn set(&self, phase: StopPhase) {
        if phase > self.phase.get() {
            self.phase.set(phase);
            self.changed.notify_one();
        }
    }

    /// The HEARTBEAT flags of the phase: LEAVING from the stop on, with
    /// STOPPED at the end.
    pub fn heartbeat_flags(&self) -> u32 {
        use capybara_proto::control::{HEARTBEAT_LEAVING, HEARTBEAT_STOPPED};
        match self.phase.get() {
            StopPhase::Serving => 0,
            StopPhase::Leaving => HEARTBEAT_LEAVING,
            StopPhase::Stopped => HEARTBEAT_LEAVING | HEARTBEAT_STOPPED,
        }
    }
}

/// How a graceful stop ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaveOutcome {
    /// Nothing served here any more, no migration in flight.
    Empty,
    /// The deadline passed with `left` connections still served here.
    DeadlinePassed { left: usize },
}

/// How often a graceful stop checks whether it is done.
const LEAVE_CHECK_EVERY: std::time::Duration = std::time::Duration::from_millis(5);

/// Connections served here and migrations in flight (out, in).
fn served(i: &crate::stack::Inner) -> (usize, usize) {
    i.transports
        .mig
        .as_ref()
        .map_or((i.transports.tcp.connection_count(), 0), |m| {
            let (o, n) = m.engine.in_progress();
            (m.flows().count(), o + n)
        })
}

/// Connections the stack serves now (what a stop has to move).
pub fn connections_served(stack: &crate::stack::Stack) -> usize {
    stack.with(|i| served(i).0)
}

/// The graceful stop's work, from a timer task: refuses migrations in
/// (PREPAREs are answered DRAINING), drains every connection within
/// `timeout` (an operator's drain under way keeps going, its deadline
/// capped by the stop's), drains the ones that arrive meanwhile, and
/// returns once nothing is served and no migration is in flight, or at the
/// deadline. The caller said LEAVING ([`StopSignal`]) before.
pub async fn leave(stack: &crate::stack::Stack, timeout: std::time::Duration) -> LeaveOutcome {
    let cap = stack.with(|i| {
        let now = i.clock.now();
        let cap = now + timeout;
        let left = served(i).0;
        let t = &mut i.transports;
        if let Some(m) = t.mig.as_mut() {
            m.engine.set_draining(true);
            t.drain.cap_deadline(cap);
            if !t.drain.active() && left > 0 {
                t.drain.start(now, timeout, m);
            }
        }
        i.kick();
        cap
    });
    let mut tick = tokio::time::interval(LEAVE_CHECK_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let done = stack.with(|i| {
            let now = i.clock.now();
            let (left, in_flight) = served(i);
            if left == 0 && in_flight == 0 {
                return Some(LeaveOutcome::Empty);
            }
            if now >= cap {
                return Some(LeaveOutcome::DeadlinePassed { left });
            }
            // Arrived since the drain finished (migrated in before the
            // switch saw LEAVING, or accepted just before): drain them too.
            let t = &mut i.transports;
            if let (Some(m), true) = (t.mig.as_mut(), left > 0 && !t.drain.active()) {
                t.drain.start(now, cap.saturating_since(now), m);
                i.kick();
            }
            None
        });
        if let Some(o) = done {
            return o;
        }
    }
}

/// `""` or `"<label> "`, before "drain" in a drainer's log lines.
fn log_prefix(label: &str) -> String {
    if label.is_empty() {
        String::new()
    } else {
        format!("{label} ")
    }
}

/// Whether a drain restricted to `only` (empty: none) takes `flow`.
fn wanted(only: &[SocketAddrV4], flow: &FlowKey) -> bool {
    only.is_empty()
        || only
            .iter()
            .any(|s| *s.ip() == flow.service_ip && s.port() == flow.service_port)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_restricted_drain_takes_only_its_services() {
        use std::net::Ipv4Addr;
        let flow = |port| FlowKey {
            client_ip: Ipv4Addr::new(10, 1, 0, 9),
            client_port: 4000,
            service_ip: Ipv4Addr::new(198, 18, 100, 1),
            service_port: port,
        };
        let web = SocketAddrV4::new(Ipv4Addr::new(198, 18, 100, 1), 80);
        assert!(wanted(&[], &flow(80)) && wanted(&[], &flow(6379)));
        assert!(wanted(&[web], &flow(80)));
        assert!(!wanted(&[web], &flow(6379)));
        let other_vip = SocketAddrV4::new(Ipv4Addr::new(198, 18, 100, 2), 80);
        assert!(!wanted(&[other_vip], &flow(80)));
    }

    #[test]
    fn the_stop_phase_only_moves_on_and_sets_the_heartbeat_flags() {
        use capybara_proto::control::{HEARTBEAT_LEAVING, HEARTBEAT_STOPPED};
        let s = StopSignal::default();
        assert_eq!((s.phase(), s.heartbeat_flags()), (StopPhase::Serving, 0));
        s.set(StopPhase::Leaving);
        assert_eq!(s.heartbeat_flags(), HEARTBEAT_LEAVING);
        s.set(StopPhase::Stopped);
        assert_eq!(s.heartbeat_flags(), HEARTBEAT_LEAVING | HEARTBEAT_STOPPED);
        s.set(StopPhase::Leaving);
        assert_eq!(s.phase(), StopPhase::Stopped);
    }

    #[test]
    fn the_limit_is_the_configured_one_while_the_deadline_is_far() {
        // 16 connections at 2 ms each, 2 s left: 32 ms of work, 1 at a time.
        assert_eq!(in_flight_limit(1, 16, 2_000.0, Duration::from_secs(2)), 1);
        assert_eq!(in_flight_limit(4, 16, 2_000.0, Duration::from_secs(2)), 4);
        assert_eq!(in_flight_limit(0, 16, 2_000.0, Duration::from_secs(2)), 1);
    }

    #[test]
    fn the_limit_rises_when_the_deadline_needs_it() {
        // 10,000 connections at 3 ms each in 30 s: 30 s of work for a 15 s
        // budget (half the time left): 2 at a time.
        assert_eq!(
            in_flight_limit(1, 10_000, 3_000.0, Duration::from_secs(30)),
            2
        );
        // 10 s left: 6 at a time.
        assert_eq!(
            in_flight_limit(1, 10_000, 3_000.0, Duration::from_secs(10)),
            6
        );
        // Deadline passed or nearly: everything left at once, capped.
        assert_eq!(
            in_flight_limit(1, 10_000, 3_000.0, Duration::ZERO),
            MAX_IN_FLIGHT_LIMIT
        );
        assert_eq!(
            in_flight_limit(1, 100_000, 10_000.0, Duration::from_secs(1)),
            MAX_IN_FLIGHT_LIMIT
        );
    }
}
