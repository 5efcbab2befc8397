//! The hostagent's side of the control channel: it registers with switchd
//! (data address, data-interface MAC, weight, services), sends heartbeats
//! with a counters summary, and carries out the switch's DRAIN and MIGRATE
//! requests. Runs on a kernel UDP socket bound to the management address;
//! every message is MAC'd with the deployment secret.
//!
//! After every REGISTER_ACK, and when the switch asks (FLOWS_ACK with
//! REQUEST), it reports the connections it owns in FLOWS batches (each
//! acknowledged, unacknowledged ones sent again; [`FlowReport`]), so that a
//! switch that lost its flow mappings, or went back to older ones, routes
//! every connection to the server that holds it. Meanwhile, and for
//! [`RESET_HOLD`] after such a sign, the stack drops non-SYN segments of
//! connections it does not know instead of resetting them
//! (`Endpoint::hold_resets_until`): they may belong to a connection another
//! server holds, whose report is on its way (docs/OPERATIONS.md, "Recovery").
//!
//! A MIGRATE it cannot start (no such connection here, a migration of it
//! under way, ...) is answered at once with a MIGRATION_REPORT of outcome
//! NOT_STARTED naming why, in a message of its own, so that the operator's
//! request ends as refused within a poll instead of waiting out the API's
//! store watch.
//!
//! A graceful stop ([`crate::drain::StopSignal`]): from its start every
//! heartbeat says LEAVING (the first at once), and at its end the channel
//! sends [`STOPPED_REPEATS`] heartbeats with STOPPED and ends. An operator's
//! undrain meanwhile does not end the stop's drain.

use crate::config::ControlConfig;
use crate::drain::StopPhase;
use crate::migration::{LineThrottle, Migrator};
use crate::policy::Tunables;
use crate::stack::Stack;
use capybara_proto::control::{
    ClaimList, ControlBody, ControlRepr, FlowClaim, Flows, Heartbeat, MigrationReport,
    MigrationTrigger, Register, ReportList, ServiceList, SetOwner, StartFailure, FLOWS_LAST,
    HEARTBEAT_DRAINING, MAX_FLOW_CLAIMS, MAX_REPORTS,
};
use capybara_proto::FlowKey;
use capybara_proto::{MigrationKey, ServerId};
use std::net::{Ipv4Addr, SocketAddrV4};
use std::time::Duration;

/// How often finished migrations are reported to the switch.
const REPORT_EVERY: Duration = Duration::from_millis(50);
/// MIGRATION_REPORTs sent per round at most (16 reports each): up to 2,560
/// reports a second per server; beyond that the migrator's bounded queue
/// drops the oldest and counts them.
const REPORT_BATCHES: usize = 8;
/// How long the stack holds resets of unknown connections after a sign
/// that the switch lost or rebuilds its flow mappings (it asked again for
/// a registration or for a FLOWS report, or acknowledged a registration):
/// long enough for every server's report to reach the switch (they report
/// within a heartbeat of the same sign), short enough that a segment of a
/// connection nobody holds is reset soon after. A client's retransmission
/// after the mapping is fixed reaches the right server.
pub const RESET_HOLD: Duration = Duration::from_secs(3);
/// FLOWS batches in flight (sent, not acknowledged) at most.
const FLOWS_WINDOW: usize = 32;
/// An unacknowledged FLOWS batch is sent again after this long.
const FLOWS_RESEND: Duration = Duration::from_millis(200);
/// Sends of one batch before the report is given up (the switch asks for
/// another while it lacks one: FLOWS_ACK with REQUEST).
const FLOWS_TRIES: u32 = 10;
/// STOPPED heartbeats a stopping process sends (datagrams: one may be
/// lost), [`STOPPED_SPACING`] apart.
pub const STOPPED_REPEATS: u32 = 3;
const STOPPED_SPACING: Duration = Duration::from_millis(1);

/// One FLOWS report in progress: the claims listed when it started, cut
/// into batches of [`MAX_FLOW_CLAIMS`] (at least one: an empty report is
/// one empty LAST batch), each sent until acknowledged, at most
/// [`FLOWS_WINDOW`] unacknowledged at once.
#[derive(Debug)]
pub struct FlowReport {
    pub id: u32,
    claims: Vec<FlowClaim>,
    acked: Vec<bool>,
    sent_at: Vec<Option<std::time::Instant>>,
    tries: Vec<u32>,
    unacked_sent: usize,
    pub started: std::time::Instant,
}

impl FlowReport {
    pub fn new(id: u32, claims: Vec<FlowClaim>, now: std::time::Instant) -> Self {
        let n = claims.len().div_ceil(MAX_FLOW_CLAIMS).max(1);
        FlowReport {
            id,
            claims,
            acked: vec![false; n],
            sent_at: vec![None; n],
            tries: vec![0; n],
            unacked_sent: 0,
            started: now,
        }
    }

    pub fn batches(&self) -> usize {
        self.acked.len()
    }

    pub fn claims(&self) -> usize {
        self.claims.len()
    }

    /// Batch `i` as a FLOWS body.
    pub fn batch(&self, i: usize) -> Flows<'_> {
        let from = (i * MAX_FLOW_CLAIMS).min(self.claims.len());
        let to = (from + MAX_FLOW_CLAIMS).min(self.claims.len());
        Flows {
            report_id: self.id,
            batch: i as u16,
            flags: if i + 1 == self.batches() {
                FLOWS_LAST
            } else {
                0
            },
            claims: ClaimList::Slice(&self.claims[from..to]),
        }
    }

    /// The next batch to send at `now`: a batch sent [`FLOWS_RESEND`] ago
    /// and not acknowledged, else the next never sent while fewer than
    /// [`FLOWS_WINDOW`] are in flight.
    pub fn next_due(&self, now: std::time::Instant) -> Option<usize> {
        let mut unsent = None;
        for i in 0..self.batches() {
            if self.acked[i] {
                continue;
            }
            match self.sent_at[i] {
                Some(t)
                    if now.saturating_duration_since(t) >= FLOWS_RESEND
                        && self.tries[i] < FLOWS_TRIES =>
                {
                    return Some(i)
                }
                None if unsent.is_none() && self.unacked_sent < FLOWS_WINDOW => unsent = Some(i),
                _ => {}
            }
        }
        unsent
    }

    pub fn sent(&mut self, i: usize, now: std::time::Instant) {
        if self.sent_at[i].is_none() {
            self.unacked_sent += 1;
        }
        self.sent_at[i] = Some(now);
        self.tries[i] += 1;
    }

    /// A FLOWS_ACK: true if it acknowledged a batch of this report not
    /// acknowledged before.
    pub fn ack(&mut self, report_id: u32, batch: u16) -> bool {
        let i = usize::from(batch);
        if report_id != self.id || i >= self.batches() || self.acked[i] {
            return false;
        }
        self.acked[i] = true;
        if self.sent_at[i].is_some() {
            self.unacked_sent -= 1;
        }
        true
    }

    pub fn done(&self) -> bool {
        self.acked.iter().all(|a| *a)
    }

    /// A batch went unacknowledged [`FLOWS_TRIES`] times.
    pub fn given_up(&self, now: std::time::Instant) -> bool {
        (0..self.batches()).any(|i| {
            !self.acked[i]
                && self.tries[i] >= FLOWS_TRIES
                && self.sent_at[i].is_some_and(|t| now.saturating_duration_since(t) >= FLOWS_RESEND)
        })
    }
}

/// Lists the connections `stack` owns as FLOWS claims.
fn list_claims(stack: &Stack) -> Vec<FlowClaim> {
    let mut out = Vec::new();
    stack.with(|i| {
        let now = i.clock.now();
        match i.transports.mig.as_ref() {
            Some(m) => m.claims(now, &mut out),
            // Without migration every connection was placed here: its age
            // is not kept (the oldest possible: any other claim is later).
            None => {
                let tcp = &i.transports.tcp;
                out.extend(tcp.connections().filter_map(|(id, _)| {
                    tcp.flow_key(id).map(|flow| FlowClaim {
                        flow,
                        epoch: 0,
                        owned_ms: u32::MAX,
                    })
                }));
            }
        }
    });
    out
}

/// Holds the stack's resets of unknown connections for [`RESET_HOLD`].
fn hold_resets(stack: &Stack) {
    stack.with(|i| {
        let until = i.clock.now() + RESET_HOLD;
        i.transports.tcp.hold_resets_until(until);
    });
}

/// Runs until a graceful stop ends (forever without one): registration
/// (retried every second until acknowledged), then heartbeats at the
/// interval the switch asked for. Told of a graceful stop by `stop`: LEAVING
/// heartbeats from its start; once it says [`StopPhase::Stopped`], the
/// STOPPED heartbeats, then `stop.stopped_sent` and the end.
#[allow(clippy::too_many_arguments)]
pub async fn run_with_stop(
    cfg: ControlConfig,
    key: MigrationKey,
    stack: Stack,
    data_addr: Ipv4Addr,
    data_mac: [u8; 6],
    services: Vec<SocketAddrV4>,
    health: std::rc::Rc<crate::health::Board>,
    stop: std::rc::Rc<crate::drain::StopSignal>,
) {
    let sock = match tokio::net::UdpSocket::bind(SocketAddrV4::new(cfg.management, 0)).await {
        Ok(s) => s,
        Err(e) => {
            eprintln!(
                "hostagent: control channel: cannot bind {}: {e}",
                cfg.management
            );
            // A stop waits for nothing from here.
            stop.stopped_sent.notify_one();
            return;
        }
    };
    let id = ServerId(cfg.server_id);
    // This process's instance id, in every REGISTER: the switch tells a
    // restart (new id: its connections are gone) from a stall (same id).
    let instance = new_instance();
    // From the clock, so that a restarted process continues above the seqs
    // of the one before it: the switch refuses a REGISTER with another
    // instance whose seq is not above the last it saw from this server (a
    // replayed old REGISTER must not pass for a restart).
    let mut seq = initial_seq();
    let mut buf = vec![0u8; 2048];
    let mut rx = vec![0u8; 2048];
    let mut registered = false;
    let mut draining = false;
    // REGISTERs sent since the last answer, messages from the switch's
    // address that failed verification, and the last send error: an agent
    // the switch never answers (wrong address, another deployment key)
    // says so instead of retrying in silence.
    let mut unanswered: u32 = 0;
    let mut unverified: u64 = 0;
    let mut send_error: Option<std::io::Error> = None;
    let send = |body: ControlBody<'_>, buf: &mut [u8], seq: &mut u64| -> Option<usize> {
        *seq += 1;
        ControlRepr {
            server_id: id,
            seq: *seq,
            body,
        }
        .emit_with_mac(buf, &key)
        .ok()
    };
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    // Finished migrations go to the switch in MIGRATION_REPORTs, off the
    // per-packet path: every REPORT_EVERY, at most REPORT_BATCHES messages.
    let mut report_tick = tokio::time::interval(REPORT_EVERY);
    report_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut reports: Vec<MigrationReport> = Vec::with_capacity(MAX_REPORTS);
    // Flows the switch still routes here after they migrated out (their
    // owner lost at the switch): SET_OWNER naming the owner, logged at
    // most once per REPAIR_LOG_EVERY with the count meanwhile.
    let mut repairs: Vec<(FlowKey, Ipv4Addr)> = Vec::new();
    let mut repair_log = LineThrottle::new(REPAIR_LOG_EVERY);
    // The FLOWS report in progress, and the next report's id.
    let mut flow_report: Option<FlowReport> = None;
    let mut next_report_id: u32 = rand::random::<u32>() | 1;
    loop {
        // FLOWS batches due now (new ones within the window, and
        // unacknowledged ones again), off the per-packet path.
        if let (Some(r), true) = (flow_report.as_mut(), registered) {
            let now = std::time::Instant::now();
            while let Some(b) = r.next_due(now) {
                let body = ControlBody::Flows(r.batch(b));
                if let Some(n) = send(body, &mut buf, &mut seq) {
                    let _ = sock.send_to(&buf[..n], cfg.switch).await;
                }
                r.sent(b, now);
            }
            if r.given_up(now) {
                eprintln!(
                    "hostagent: FLOWS report {} ({} connections) not acknowledged by the switch; given up until it asks again",
                    r.id,
                    r.claims()
                );
                flow_report = None;
            }
        }
        tokio::select! {
            _ = stop.changed.notified() => {
                match stop.phase() {
                    StopPhase::Serving => {}
                    StopPhase::Leaving => {
                        // Out of placement and targets now, not at the
                        // next tick.
                        if registered {
                            let body = heartbeat(&stack, draining, &health, &stop);
                            if let Some(n) = send(body, &mut buf, &mut seq) {
                                let _ = sock.send_to(&buf[..n], cfg.switch).await;
                            }
                        }
                    }
                    StopPhase::Stopped => {
                        if registered {
                            for k in 0..STOPPED_REPEATS {
                                if k > 0 {
                                    tokio::time::sleep(STOPPED_SPACING).await;
                                }
                                let body = heartbeat(&stack, draining, &health, &stop);
                                if let Some(n) = send(body, &mut buf, &mut seq) {
                                    let _ = sock.send_to(&buf[..n], cfg.switch).await;
                                }
                            }
                        }
                        stop.stopped_sent.notify_one();
                        return;
                    }
                }
            }
            _ = report_tick.tick(), if registered => {
                for _ in 0..REPORT_BATCHES {
                    reports.clear();
                    stack.with(|i| {
                        let now = i.clock.now();
                        if let Some(m) = i.transports.mig.as_mut() {
                            m.take_reports(now, MAX_REPORTS, &mut reports);
                        }
                    });
                    if reports.is_empty() {
                        break;
                    }
                    let body = ControlBody::MigrationReport(ReportList::Slice(&reports));
                    if let Some(n) = send(body, &mut buf, &mut seq) {
                        let _ = sock.send_to(&buf[..n], cfg.switch).await;
                    }
                }
                repairs.clear();
                let now = stack.with(|i| {
                    if let Some(m) = i.transports.mig.as_mut() {
                        m.take_owner_repairs(&mut repairs);
                    }
                    i.clock.now()
                });
                for &(flow, owner) in &repairs {
                    let body = ControlBody::SetOwner(SetOwner { flow, owner });
                    if let Some(n) = send(body, &mut buf, &mut seq) {
                        let _ = sock.send_to(&buf[..n], cfg.switch).await;
                    }
                    if let Some(more) = repair_log.admit(now) {
                        eprintln!(
                            "hostagent: the switch still sends connection {flow} here after it migrated to {owner}: \
                             telling it the owner (SET_OWNER){more}"
                        );
                    }
                }
            }
            _ = health.changed.notified(), if registered => {
                // A backend went down or came back: tell the switch now,
                // not at the next heartbeat.
                let body = heartbeat(&stack, draining, &health, &stop);
                if let Some(n) = send(body, &mut buf, &mut seq) {
                    let _ = sock.send_to(&buf[..n], cfg.switch).await;
                }
            }
            _ = tick.tick() => {
                let body = if !registered {
                    ControlBody::Register(Register {
                        mgmt_addr: cfg.management,
                        data_addr,
                        data_mac,
                        weight: cfg.weight,
                        services: ServiceList::Slice(&services),
                        instance,
                        reads_last_id: true,
                    })
                } else {
                    heartbeat(&stack, draining, &health, &stop)
                };
                if let Some(n) = send(body, &mut buf, &mut seq) {
                    match sock.send_to(&buf[..n], cfg.switch).await {
                        Ok(_) => send_error = None,
                        Err(e) => send_error = Some(e),
                    }
                }
                if !registered {
                    unanswered += 1;
                    if unanswered == UNANSWERED_WARN || unanswered % UNANSWERED_REPEAT == 0 {
                        eprintln!("{}", unanswered_warning(cfg.switch, unanswered, unverified, send_error.as_ref()));
                    }
                }
            }
            r = sock.recv_from(&mut rx) => {
                let Ok((n, from)) = r else { continue };
                if from != std::net::SocketAddr::V4(cfg.switch) {
                    continue;
                }
                let Ok(msg) = ControlRepr::parse_verified(&rx[..n], &key) else {
                    unverified += 1;
                    continue;
                };
                match msg.body {
                    ControlBody::RegisterAck(ack) => {
                        unanswered = 0;
                        // Every REGISTER_ACK: the first one lets migrations
                        // start; a later one (a re-registration) names this
                        // process's own ids, below its counter: no change.
                        let last = crate::migration::last_seen_counter(ack.last_migration_id, data_addr);
                        let seeded = stack.with(|i| i.transports.mig.as_mut().map(|m| {
                            let was = m.engine.counter_seeded();
                            let before = m.engine.next_migration_seq();
                            (was, before, m.engine.seed_migration_counter(last))
                        }));
                        if let Some((was, before, next)) = seeded {
                            if !was || next != before {
                                let known = match (ack.last_migration_id, last) {
                                    (None, _) => "the switch does not say its last id (it predates REGISTER_ACK's field)".to_string(),
                                    (Some(_), None) => "the switch knows no id from this address".to_string(),
                                    (Some(_), Some(c)) => format!("the switch's last id from this address has counter {c}"),
                                };
                                eprintln!("hostagent: migrations numbered from counter {next} ({known}; it was {before})");
                            }
                        }
                        if !registered {
                            eprintln!("hostagent: registered with switch {} as {id} (instance {instance:#018x})", cfg.switch);
                            // A (new) registration: the switch may know none
                            // of this server's connections. Hold resets of
                            // unknown ones and report the owned ones.
                            hold_resets(&stack);
                            let claims = list_claims(&stack);
                            let r = FlowReport::new(next_report_id, claims, std::time::Instant::now());
                            next_report_id = next_report_id.wrapping_add(1).max(1);
                            eprintln!("hostagent: reporting {} connections to the switch (FLOWS report {}, {} batches)", r.claims(), r.id, r.batches());
                            flow_report = Some(r);
                        }
                        registered = true;
                        tick = tokio::time::interval(Duration::from_millis(u64::from(ack.heartbeat_interval_ms.max(10))));
                    }
                    ControlBody::Drain(d) => {
                        draining = d.flags & capybara_proto::control::DRAIN_CANCEL == 0;
                        let deadline = Duration::from_millis(u64::from(d.deadline_ms));
                        let leaving = stop.phase() != StopPhase::Serving;
                        if !draining && leaving {
                            // The heartbeat's DRAINING flag follows the
                            // operator; the stop's drain goes on.
                            eprintln!("hostagent: drain cancelled by the operator; this process is stopping: its connections keep migrating away");
                        } else {
                            let queued = stack.with(|i| drain(i, draining, deadline));
                            eprintln!("hostagent: drain {} ({queued} connections queued)", if draining { "started" } else { "cancelled" });
                        }
                    }
                    ControlBody::Migrate(m) => {
                        let failed = stack.with(|i| {
                            let now = i.clock.now();
                            start_migration(i.transports.mig.as_mut(), now, m.flow, m.target)
                        });
                        if let Some((why, e)) = failed {
                            eprintln!("hostagent: migrate {}: {e}", m.flow);
                            if let Some(why) = why {
                                // At once and alone: a switch that predates
                                // NOT_STARTED drops only this message.
                                let r = MigrationReport::not_started(data_addr, m.flow, m.target, MigrationTrigger::Manual, why);
                                let body = ControlBody::MigrationReport(ReportList::Slice(std::slice::from_ref(&r)));
                                if let Some(n) = send(body, &mut buf, &mut seq) {
                                    let _ = sock.send_to(&buf[..n], cfg.switch).await;
                                }
                            }
                        }
                        stack.with(|i| i.kick());
                    }
                    ControlBody::Policy(p) => {
                        // Not replay-checked: a replayed (MAC'd, so genuine
                        // but old) POLICY shows up as another generation in
                        // the next heartbeat and the switch re-sends the
                        // current one.
                        match tunables_of(&p) {
                            Ok(t) => stack.with(|i| {
                                if let Some(pr) = i.transports.policy.as_mut() {
                                    if pr.engine.generation != p.generation {
                                        eprintln!("hostagent: policy generation {:#010x}: {t:?}", p.generation);
                                    }
                                    pr.engine.set_tunables(t, p.generation);
                                }
                            }),
                            Err(e) => eprintln!("hostagent: POLICY from the switch refused: {e}"),
                        }
                        // The migration engine's part applies with or
                        // without `[policy] enabled`: it is not a policy
                        // decision but how every migration runs.
                        let applied = stack.with(|i| apply_engine_policy(i.transports.mig.as_mut(), &p));
                        match applied {
                            Ok(Some(what)) => eprintln!("hostagent: policy generation {:#010x}: {what}", p.generation),
                            Ok(None) => {}
                            Err(e) => eprintln!("hostagent: POLICY from the switch: {e}"),
                        }
                    }
                    ControlBody::FlowsAck(a) if a.is_request() => {
                        // The switch lacks this server's report (it started
                        // from the store, or lost one): hold resets and
                        // report, unless a report is under way.
                        hold_resets(&stack);
                        if flow_report.is_none() {
                            let claims = list_claims(&stack);
                            let r = FlowReport::new(next_report_id, claims, std::time::Instant::now());
                            next_report_id = next_report_id.wrapping_add(1).max(1);
                            eprintln!("hostagent: the switch asks for this server's connections: reporting {} (FLOWS report {}, {} batches)", r.claims(), r.id, r.batches());
                            flow_report = Some(r);
                        }
                    }
                    ControlBody::FlowsAck(a) => {
                        let finished = flow_report.as_mut().is_some_and(|r| {
                            r.ack(a.report_id, a.batch);
                            r.done()
                        });
                        if a.flags & capybara_proto::control::FLOWS_REFUSED != 0 {
                            eprintln!("hostagent: the switch refused FLOWS batch {} of report {}", a.batch, a.report_id);
                        }
                        if finished {
                            if let Some(r) = flow_report.take() {
                                eprintln!(
                                    "hostagent: FLOWS report {} acknowledged: {} connections in {} batches, {:.1} ms",
                                    r.id,
                                    r.claims(),
                                    r.batches(),
                                    r.started.elapsed().as_secs_f64() * 1e3
                                );
                            }
                        }
                    }
                    ControlBody::Error(e) => {
                        eprintln!("hostagent: switch error: {}", e.text);
                        // The switch no longer knows this server (it declared
                        // it dead after missed heartbeats, or restarted
                        // without its store): register again on the next
                        // tick instead of heartbeating into the void.
                        if e.code == capybara_proto::control::ErrorCode::NotRegistered && registered {
                            eprintln!("hostagent: the switch does not know this server any more: registering again");
                            // It lost its state: segments of connections
                            // other servers hold may reach this one until
                            // their reports fix the switch's mappings.
                            hold_resets(&stack);
                            flow_report = None;
                            registered = false;
                            tick = tokio::time::interval(Duration::from_secs(1));
                        }
                    }
                    _ => {}
                }
            }
        }
    }
}

/// A HEARTBEAT with the counters summary, the drain flag, the backends'
/// health and the stop's flags (LEAVING, STOPPED).
fn heartbeat(
    stack: &Stack,
    draining: bool,
    health: &crate::health::Board,
    stop: &crate::drain::StopSignal,
) -> ControlBody<'static> {
    let (connections, in_flight, load, generation) = stack.with(|i| {
        let now = i.clock.now();
        let t = &mut i.transports;
        t.monitor.refresh(&t.tcp);
        let load = t.monitor.totals(now);
        let mig = t.mig.as_ref().map_or((0, 0), |m| m.engine.in_progress());
        let generation = t.policy.as_ref().map_or(0, |p| p.engine.generation);
        (
            t.tcp.connection_count() as u32,
            (mig.0 + mig.1) as u32,
            load,
            generation,
        )
    });
    let drain = if draining { HEARTBEAT_DRAINING } else { 0 };
    ControlBody::Heartbeat(Heartbeat {
        connections,
        migrations_in_flight: in_flight,
        load_pps: load.pps.round() as u64,
        rx_backlog_bytes: load.rx_backlog_bytes,
        flags: drain | health.heartbeat_flags() | stop.heartbeat_flags(),
        policy_generation: generation,
    })
}

/// A random, nonzero instance id for this process.
/// The first warning about unanswered REGISTERs comes after this many
/// (one a second), then one every `UNANSWERED_REPEAT`.
const UNANSWERED_WARN: u32 = 5;
const UNANSWERED_REPEAT: u32 = 60;

/// What an agent whose REGISTERs go unanswered prints: what it tried, and
/// the likely causes it can tell apart.
fn unanswered_warning(
    switch: std::net::SocketAddrV4,
    unanswered: u32,
    unverified: u64,
    send_error: Option<&std::io::Error>,
) -> String {
    let why = match (send_error, unverified) {
        (Some(e), _) => format!("sending to it fails: {e}"),
        (None, 0) => "nothing came back: check [control] switch (switchd's control address) and that switchd runs".to_string(),
        (None, n) => format!(
            "{n} answers from it failed verification: switchd and this agent use different deployment keys ([migration] key or key_file)"
        ),
    };
    format!("hostagent: the switch {switch} has not answered {unanswered} REGISTERs: {why}; still trying every second")
}

fn new_instance() -> u64 {
    loop {
        let id: u64 = rand::random();
        if id != 0 {
            return id;
        }
    }
}

/// The first control-channel seq: microseconds since the Unix epoch. A
/// process sends far fewer than a million messages a second, so the next
/// process starts above the last seq of this one (unless the clock went
/// back by more than this one's lifetime of messages).
fn initial_seq() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(0)
}

/// The "switch still routes a migrated connection here" log line: the
/// first at once, then at most one per this interval with how many more
/// were repaired meanwhile (a switch that lost many owners at once would
/// otherwise print a line per connection).
const REPAIR_LOG_EVERY: capybara_proto::time::Duration =
    capybara_proto::time::Duration::from_secs(1);

/// The tunables a POLICY message carries, validated (the error names the
/// field and value).
pub fn tunables_of(p: &capybara_proto::control::PolicyMsg) -> Result<Tunables, String> {
    use capybara_proto::control::{POLICY_PROACTIVE, POLICY_REACTIVE};
    let t = Tunables {
        proactive_enabled: p.flags & POLICY_PROACTIVE != 0,
        proactive_threshold_pct: f64::from(p.proactive_threshold_bp) / 100.0,
        reactive_enabled: p.flags & POLICY_REACTIVE != 0,
        reactive_backlog_threshold: p.reactive_backlog_packets,
        connection_cooldown: std::time::Duration::from_millis(u64::from(p.cooldown_ms)),
        max_migrations_per_sec: p.max_migrations_per_sec,
        hysteresis_pct: f64::from(p.hysteresis_bp) / 100.0,
    };
    t.validate()?;
    Ok(t)
}

/// Applies the migration-engine part of a POLICY: the origin deadline
/// (`migration_deadline_ms`, 0 = the engine's own, what an older switch
/// sends) and the buffer mode (`POLICY_BUFFER_DROP`; a `[migration]
/// drop_mode = true` keeps dropping). `Ok(Some(text))` when something
/// changed, naming what is in force now; the error names a refused value
/// (the previous settings stay).
pub fn apply_engine_policy(
    mig: Option<&mut Migrator>,
    p: &capybara_proto::control::PolicyMsg,
) -> Result<Option<String>, String> {
    use capybara_proto::control::POLICY_BUFFER_DROP;
    let Some(m) = mig else {
        return Ok(None);
    };
    let e = &mut m.engine;
    let before = (e.config().migration_deadline, e.config().buffer_mode);
    let deadline = (p.migration_deadline_ms != 0)
        .then(|| Duration::from_millis(u64::from(p.migration_deadline_ms)));
    let refused = e.set_migration_deadline(deadline).err().map(|err| {
        format!(
            "migration_deadline_ms = {} refused: {err}",
            p.migration_deadline_ms
        )
    });
    let mode = e.set_policy_buffer_mode(p.flags & POLICY_BUFFER_DROP != 0);
    if let Some(r) = refused {
        return Err(r);
    }
    let c = e.config();
    if (c.migration_deadline, mode) == before {
        return Ok(None);
    }
    Ok(Some(format!(
        "migration deadline {} ms (cap {} ms, target {} ms), buffer mode {}",
        c.migration_deadline.as_millis(),
        c.migration_deadline_max.as_millis(),
        c.target_deadline.as_millis(),
        match mode {
            capybara_tcpmig::BufferMode::Buffer => "buffer",
            capybara_tcpmig::BufferMode::Drop => "drop",
        }
    )))
}

/// Carries out a MIGRATE (trigger `manual`). `None`: started. Else the
/// error text and, when the migration will not start, why (for the
/// NOT_STARTED report); `(None, text)` when it waits for its connection
/// manager's safe point and starts later by itself.
fn start_migration(
    mig: Option<&mut Migrator>,
    now: capybara_proto::time::Instant,
    flow: FlowKey,
    target: Option<Ipv4Addr>,
) -> Option<(Option<StartFailure>, String)> {
    let Some(m) = mig else {
        return Some((
            Some(StartFailure::Disabled),
            "this server runs without migration".into(),
        ));
    };
    let e = m
        .migrate_as(now, flow, target, MigrationTrigger::Manual)
        .err()?;
    Some((e.start_failure(), e.to_string()))
}

/// Starts migrating every connection away (a bounded number at a time,
/// `crate::drain`) and refuses new migrations in, or cancels that. Returns
/// how many connections were queued (0 for a repeated DRAIN: the drain
/// under way keeps going, with the new deadline).
fn drain(i: &mut crate::stack::Inner, on: bool, deadline: Duration) -> usize {
    let now = i.clock.now();
    let Some(m) = i.transports.mig.as_mut() else {
        return 0;
    };
    m.engine.set_draining(on);
    let queued = if on {
        i.transports.drain.start(now, deadline, m)
    } else {
        i.transports.drain.cancel(now);
        0
    };
    i.kick();
    queued
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unanswered_registers_say_what_is_likely_wrong() {
        let sw = "198.18.1.1:7692".parse().unwrap();
        let silent = unanswered_warning(sw, 5, 0, None);
        assert!(
            silent.contains("198.18.1.1:7692 has not answered 5 REGISTERs"),
            "{silent}"
        );
        assert!(silent.contains("[control] switch"), "{silent}");
        let key = unanswered_warning(sw, 5, 3, None);
        assert!(
            key.contains("3 answers from it failed verification"),
            "{key}"
        );
        assert!(key.contains("deployment keys"), "{key}");
        let e = std::io::Error::from(std::io::ErrorKind::NetworkUnreachable);
        let send = unanswered_warning(sw, 65, 3, Some(&e));
        assert!(send.contains("sending to it fails"), "{send}");
    }
    use capybara_proto::control::{PolicyMsg, POLICY_PROACTIVE};

    /// A connection manager that always answers `prepare` with `answer`.
    struct Fixed(crate::socket::Readiness);
    impl crate::socket::ConnectionManager for Fixed {
        fn prepare(&mut self) -> crate::socket::Readiness {
            self.0
        }
        fn export_state(&mut self, _: &mut Vec<u8>) -> Result<(), String> {
            Ok(())
        }
        fn resume(&mut self) {}
    }

    #[test]
    fn a_migrate_that_cannot_start_names_why() {
        use crate::socket::Readiness;
        use capybara_tcp::ConnId;
        use capybara_tcpmig::{Engine, EngineConfig, MigrationKey};
        let local = Ipv4Addr::new(10, 0, 0, 1);
        let cfg = EngineConfig::new(local, Ipv4Addr::new(10, 0, 0, 254));
        let key = MigrationKey::from_bytes(&[7; 32]).expect("key");
        let mut m = Migrator::new(Engine::new(cfg, key).expect("engine"), local);
        let now = capybara_proto::time::Instant::from_millis(1);
        let flow = |port| FlowKey {
            client_ip: Ipv4Addr::new(10, 1, 0, 9),
            client_port: port,
            service_ip: Ipv4Addr::new(10, 9, 0, 1),
            service_port: 80,
        };
        let other = Some(Ipv4Addr::new(10, 0, 0, 2));
        let start = |m: &mut Migrator, port, target| {
            start_migration(Some(m), now, flow(port), target).map(|(why, _)| why)
        };
        assert_eq!(
            start(&mut m, 1, other),
            Some(Some(StartFailure::NoConnection))
        );
        m.track(flow(1), ConnId(11));
        assert_eq!(
            start(&mut m, 1, Some(local)),
            Some(Some(StartFailure::TargetIsSelf))
        );
        assert_eq!(start(&mut m, 1, other), None, "started");
        assert_eq!(start(&mut m, 1, other), Some(Some(StartFailure::Busy)));
        m.track(flow(2), ConnId(12));
        m.managers
            .set(ConnId(12), Box::new(Fixed(Readiness::Never)));
        assert_eq!(start(&mut m, 2, other), Some(Some(StartFailure::Refused)));
        // Waiting for the manager: not a failure, no report.
        m.track(flow(3), ConnId(13));
        m.managers
            .set(ConnId(13), Box::new(Fixed(Readiness::NotYet)));
        assert_eq!(start(&mut m, 3, other), Some(None));
        let (why, text) = start_migration(None, now, flow(4), None).unwrap();
        assert_eq!(why, Some(StartFailure::Disabled));
        assert!(text.contains("without migration"));
    }

    fn claim(port: u16) -> FlowClaim {
        FlowClaim {
            flow: FlowKey {
                client_ip: Ipv4Addr::new(198, 18, 0, 11),
                client_port: port,
                service_ip: Ipv4Addr::new(198, 18, 100, 1),
                service_port: 7,
            },
            epoch: 0,
            owned_ms: 5,
        }
    }

    #[test]
    fn a_flows_report_is_batched_windowed_acked_and_resent() {
        let t0 = std::time::Instant::now();
        // 100k connections: 1,786 batches of at most 56, the last flagged.
        let claims: Vec<FlowClaim> = (0..100_000u32)
            .map(|i| claim(1 + (i % 60_000) as u16))
            .collect();
        let mut r = FlowReport::new(7, claims, t0);
        assert_eq!(r.batches(), 100_000usize.div_ceil(MAX_FLOW_CLAIMS));
        assert_eq!(r.batch(0).claims.len(), MAX_FLOW_CLAIMS);
        assert_eq!(r.batch(0).flags, 0);
        let last = r.batches() - 1;
        assert_eq!(r.batch(last).flags, FLOWS_LAST);
        assert_eq!(r.batch(last).claims.len(), 100_000 - last * MAX_FLOW_CLAIMS);
        // Every batch fits one control message of one frame.
        let msg = ControlRepr {
            server_id: ServerId(1),
            seq: 1,
            body: ControlBody::Flows(r.batch(0)),
        };
        assert!(msg.buffer_len() <= 1472);
        // A window of 32 at first.
        let mut sent = Vec::new();
        while let Some(b) = r.next_due(t0) {
            r.sent(b, t0);
            sent.push(b);
        }
        assert_eq!(sent, (0..FLOWS_WINDOW).collect::<Vec<_>>());
        // An acknowledgement opens the window by one; a stale or foreign
        // one changes nothing.
        assert!(r.ack(7, 3));
        assert!(!r.ack(7, 3), "acknowledged twice");
        assert!(!r.ack(8, 4), "another report");
        assert!(!r.ack(7, u16::MAX), "no such batch");
        assert_eq!(r.next_due(t0), Some(FLOWS_WINDOW));
        r.sent(FLOWS_WINDOW, t0);
        assert_eq!(r.next_due(t0), None);
        // Unacknowledged batches are sent again after FLOWS_RESEND.
        let later = t0 + FLOWS_RESEND;
        assert_eq!(r.next_due(later), Some(0));
        // All acknowledged: done.
        for b in 0..r.batches() {
            r.ack(7, b as u16);
        }
        assert!(r.done());
        assert_eq!(r.next_due(later), None);
    }

    #[test]
    fn an_empty_report_is_one_last_batch_and_an_unanswered_one_is_given_up() {
        let t0 = std::time::Instant::now();
        let mut r = FlowReport::new(1, Vec::new(), t0);
        assert_eq!(r.batches(), 1);
        assert_eq!(r.batch(0).flags, FLOWS_LAST);
        assert!(r.batch(0).claims.is_empty());
        let mut t = t0;
        for _ in 0..FLOWS_TRIES {
            assert_eq!(r.next_due(t), Some(0));
            r.sent(0, t);
            assert!(!r.given_up(t));
            t += FLOWS_RESEND;
        }
        assert_eq!(r.next_due(t), None);
        assert!(r.given_up(t));
    }

    #[test]
    fn policy_messages_become_validated_tunables() {
        let m = PolicyMsg {
            generation: 9,
            flags: POLICY_PROACTIVE,
            proactive_threshold_bp: 1250,
            hysteresis_bp: 300,
            reactive_backlog_packets: 40,
            cooldown_ms: 500,
            max_migrations_per_sec: 100,
            migration_deadline_ms: 0,
        };
        let t = tunables_of(&m).unwrap();
        assert!(t.proactive_enabled && !t.reactive_enabled);
        assert_eq!(t.proactive_threshold_pct, 12.5);
        assert_eq!(t.hysteresis_pct, 3.0);
        assert_eq!(t.reactive_backlog_threshold, 40);
        assert_eq!(t.connection_cooldown, std::time::Duration::from_millis(500));
        assert_eq!(t.max_migrations_per_sec, 100);
        let bad = PolicyMsg {
            hysteresis_bp: 2000,
            ..m
        };
        assert!(tunables_of(&bad).unwrap_err().contains("hysteresis_pct"));
        let bad = PolicyMsg {
            max_migrations_per_sec: 0,
            ..m
        };
        assert!(tunables_of(&bad)
            .unwrap_err()
            .contains("max_migrations_per_sec"));
    }
    #[test]
    fn policy_sets_the_migration_deadline_and_buffer_mode_of_the_engine() {
        use capybara_proto::control::POLICY_BUFFER_DROP;
        use capybara_tcpmig::{BufferMode, Engine, EngineConfig, MigrationKey};
        let local = Ipv4Addr::new(10, 0, 0, 1);
        let key = MigrationKey::from_bytes(&[7; 32]).expect("key");
        let migrator = |mode| {
            let mut cfg = EngineConfig::new(local, Ipv4Addr::new(10, 0, 0, 254));
            cfg.buffer_mode = mode;
            Migrator::new(Engine::new(cfg, key.clone()).expect("engine"), local)
        };
        let msg = PolicyMsg {
            generation: 9,
            flags: POLICY_PROACTIVE | POLICY_BUFFER_DROP,
            proactive_threshold_bp: 1000,
            hysteresis_bp: 200,
            reactive_backlog_packets: 20,
            cooldown_ms: 1000,
            max_migrations_per_sec: 1000,
            migration_deadline_ms: 80,
        };
        let mut m = migrator(BufferMode::Buffer);
        let what = apply_engine_policy(Some(&mut m), &msg).unwrap().unwrap();
        assert!(
            what.contains("migration deadline 80 ms") && what.contains("buffer mode drop"),
            "{what}"
        );
        assert_eq!(
            m.engine.config().migration_deadline,
            Duration::from_millis(80)
        );
        assert_eq!(m.engine.config().buffer_mode, BufferMode::Drop);
        // The same again: nothing to say.
        assert_eq!(apply_engine_policy(Some(&mut m), &msg), Ok(None));
        // An older switch: reserved word 0, no drop bit: the engine's own.
        let old = PolicyMsg {
            flags: POLICY_PROACTIVE,
            migration_deadline_ms: 0,
            ..msg
        };
        apply_engine_policy(Some(&mut m), &old).unwrap();
        assert_eq!(
            m.engine.config().migration_deadline,
            Duration::from_millis(50)
        );
        assert_eq!(m.engine.config().buffer_mode, BufferMode::Buffer);
        // `[migration] drop_mode = true`: a buffer policy does not undo it.
        let mut d = migrator(BufferMode::Drop);
        apply_engine_policy(Some(&mut d), &old).unwrap();
        assert_eq!(d.engine.config().buffer_mode, BufferMode::Drop);
        // Without migration there is nothing to apply.
        assert_eq!(apply_engine_policy(None, &msg), Ok(None));
    }
}
