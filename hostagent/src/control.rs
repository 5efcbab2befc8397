//! The hostagent's side of the control channel: it registers with switchd
//! (data address, data-interface MAC, weight, services), sends heartbeats
//! with a counters summary, and carries out the switch's DRAIN and MIGRATE
//! requests. Runs on a kernel UDP socket bound to the management address;
//! every message is MAC'd with the deployment secret.
//!
//! A MIGRATE it cannot start (no such connection here, a migration of it
//! under way, ...) is answered at once with a MIGRATION_REPORT of outcome
//! NOT_STARTED naming why, in a message of its own, so that the operator's
//! request ends as refused within a poll instead of waiting out the API's
//! store watch.

use crate::config::ControlConfig;
use crate::migration::Migrator;
use crate::policy::Tunables;
use crate::stack::Stack;
use capybara_proto::control::{
    ControlBody, ControlRepr, Heartbeat, MigrationReport, MigrationTrigger, Register, ReportList,
    ServiceList, StartFailure, HEARTBEAT_DRAINING, MAX_REPORTS,
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

/// Runs forever: registration (retried every second until acknowledged),
/// then heartbeats at the interval the switch asked for.
pub async fn run(
    cfg: ControlConfig,
    key: MigrationKey,
    stack: Stack,
    data_addr: Ipv4Addr,
    data_mac: [u8; 6],
    services: Vec<SocketAddrV4>,
    health: std::rc::Rc<crate::health::Board>,
) {
    let sock = match tokio::net::UdpSocket::bind(SocketAddrV4::new(cfg.management, 0)).await {
        Ok(s) => s,
        Err(e) => {
            eprintln!(
                "hostagent: control channel: cannot bind {}: {e}",
                cfg.management
            );
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
    loop {
        tokio::select! {
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
            }
            _ = health.changed.notified(), if registered => {
                // A backend went down or came back: tell the switch now,
                // not at the next heartbeat.
                let body = heartbeat(&stack, draining, &health);
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
                    })
                } else {
                    heartbeat(&stack, draining, &health)
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
                        if !registered {
                            eprintln!("hostagent: registered with switch {} as {id} (instance {instance:#018x})", cfg.switch);
                        }
                        registered = true;
                        tick = tokio::time::interval(Duration::from_millis(u64::from(ack.heartbeat_interval_ms.max(10))));
                    }
                    ControlBody::Drain(d) => {
                        draining = d.flags & capybara_proto::control::DRAIN_CANCEL == 0;
                        let deadline = Duration::from_millis(u64::from(d.deadline_ms));
                        let queued = stack.with(|i| drain(i, draining, deadline));
                        eprintln!("hostagent: drain {} ({queued} connections queued)", if draining { "started" } else { "cancelled" });
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
                    ControlBody::Error(e) => {
                        eprintln!("hostagent: switch error: {}", e.text);
                        // The switch no longer knows this server (it declared
                        // it dead after missed heartbeats, or restarted
                        // without its store): register again on the next
                        // tick instead of heartbeating into the void.
                        if e.code == capybara_proto::control::ErrorCode::NotRegistered && registered {
                            eprintln!("hostagent: the switch does not know this server any more: registering again");
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

/// A HEARTBEAT with the counters summary, the drain flag and the backends'
/// health.
fn heartbeat(stack: &Stack, draining: bool, health: &crate::health::Board) -> ControlBody<'static> {
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
        flags: drain | health.heartbeat_flags(),
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
