//! Deadlines that follow the work: the origin's grows with the snapshot
//! (hard-capped), the target's with each new CONN_STATE fragment
//! (hard-capped), and the snapshot's retransmission timer runs from the last
//! fragment of a burst. Two engines wired by hand on a virtual clock; the
//! switch only rewrites the PREPARE's destination, so it is left out.

use capybara_proto::tcpmig::TcpMigRepr;
use capybara_tcpmig::*;
use std::net::Ipv4Addr;

const SWITCH: Ipv4Addr = Ipv4Addr::new(198, 18, 1, 1);
const ORIGIN: Ipv4Addr = Ipv4Addr::new(198, 18, 2, 10);
const TARGET: Ipv4Addr = Ipv4Addr::new(198, 18, 2, 11);

fn key() -> MigrationKey {
    MigrationKey::from_bytes(&[0x42; 32]).unwrap()
}

fn flow() -> FlowKey {
    FlowKey {
        client_ip: Ipv4Addr::new(198, 18, 0, 10),
        client_port: 40000,
        service_ip: Ipv4Addr::new(198, 18, 100, 1),
        service_port: 80,
    }
}

fn config(addr: Ipv4Addr) -> EngineConfig {
    let mut c = EngineConfig::new(addr, SWITCH);
    c.max_snapshot_bytes = 1 << 20;
    c
}

fn ms(n: u64) -> Instant {
    Instant::from_micros(n * 1000)
}

/// Every datagram `e` wants to send now.
fn drain(e: &mut Engine, now: Instant) -> Vec<Vec<u8>> {
    let mut buf = vec![0u8; 1500];
    let mut out = Vec::new();
    while let Some(t) = e.poll_transmit(now, &mut buf) {
        out.push(buf[..t.len].to_vec());
    }
    out
}

fn kind_of(d: &[u8]) -> Kind {
    TcpMigRepr::parse_bytes(d).expect("valid TCPMig").kind
}

fn events(e: &mut Engine) -> Vec<Event> {
    std::iter::from_fn(|| e.poll_event()).collect()
}

/// Runs the engine's timers from `from` to `to` (inclusive), 100 us apart,
/// collecting what it sends.
fn tick(e: &mut Engine, from: Instant, to: Instant) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    let mut t = from;
    while t <= to {
        if e.poll_timeout().is_some_and(|d| d <= t) {
            e.handle_timeout(t);
        }
        out.extend(drain(e, t));
        t += Duration::from_micros(100);
    }
    out
}

/// PREPARE -> PREPARE_ACK -> ExportNow -> snapshot of `len` bytes, all at
/// `t0`; returns the engines, the id and the first CONN_STATE burst (not
/// delivered yet).
fn to_sending(len: usize, t0: Instant) -> (Engine, Engine, MigrationId, Vec<Vec<u8>>) {
    let mut o = Engine::new(config(ORIGIN), key()).unwrap();
    let mut t = Engine::new(config(TARGET), key()).unwrap();
    let id = o.migrate_out(t0, flow(), Some(TARGET)).unwrap();
    for d in drain(&mut o, t0) {
        t.handle_message(t0, ORIGIN, &d).unwrap();
    }
    for d in drain(&mut t, t0) {
        o.handle_message(t0, TARGET, &d).unwrap();
    }
    assert!(matches!(events(&mut o)[..], [Event::ExportNow { .. }]));
    o.provide_snapshot(t0, id, vec![7u8; len]).unwrap();
    let burst = drain(&mut o, t0);
    assert!(burst.iter().all(|d| kind_of(d) == Kind::ConnState));
    (o, t, id, burst)
}

/// Delivers `ds` to the target, imports if complete, and returns the
/// target's answers.
fn deliver(t: &mut Engine, now: Instant, ds: &[Vec<u8>]) -> Vec<Vec<u8>> {
    for d in ds {
        let _ = t.handle_message(now, ORIGIN, d);
    }
    for ev in events(t) {
        if let Event::ImportNow { id, .. } = ev {
            t.import_done(now, id, |_| {}).unwrap();
        }
    }
    drain(t, now)
}

#[test]
fn deadline_grows_with_the_snapshot_and_is_capped() {
    let c = EngineConfig::new(ORIGIN, SWITCH);
    assert_eq!(c.deadline_for(0), c.migration_deadline);
    // 512 KiB: 50 ms + 200 ms / 2.
    assert_eq!(c.deadline_for(512 * 1024), Duration::from_millis(150));
    assert_eq!(c.deadline_for(64 << 20), c.migration_deadline_max);
    let mut bad = c.clone();
    bad.linger = bad.migration_deadline_max + bad.in_doubt_limit;
    assert!(matches!(
        bad.validate(),
        Err(ConfigError::LingerTooShort { .. })
    ));
    let mut bad = c.clone();
    bad.migration_deadline_max = bad.migration_deadline / 2;
    assert!(bad.validate().is_err());
    let mut huge = c;
    huge.deadline_per_mib = Duration::MAX;
    assert_eq!(huge.deadline_for(1), huge.migration_deadline_max);
}

/// A 512 KiB snapshot whose state arrives 90 ms after the start: past the
/// base 50 ms, within the scaled 150 ms. It migrates; with one fixed
/// deadline it resumed (the origin asked the target to abort at 50 ms).
#[test]
fn big_snapshot_slower_than_the_base_deadline_still_migrates() {
    let (mut o, mut t, id, burst) = to_sending(512 * 1024, ms(0));
    // Everything the origin sends until 90 ms is lost (retransmissions too).
    let sent = tick(&mut o, ms(0), ms(90));
    assert!(
        sent.iter().all(|d| kind_of(d) == Kind::ConnState),
        "no ABORT request before the scaled deadline"
    );
    let answers = deliver(&mut t, ms(90), &burst);
    assert_eq!(answers.len(), 1);
    assert_eq!(kind_of(&answers[0]), Kind::ConnStateAck);
    o.handle_message(ms(90), TARGET, &answers[0]).unwrap();
    assert!(
        events(&mut o)
            .iter()
            .any(|e| matches!(e, Event::MigratedOut { id: i, .. } if *i == id)),
        "migrated out"
    );
}

/// The same transfer never completing: the origin gives up at the scaled
/// deadline (150 ms), not at 50 ms, and asks the target.
#[test]
fn origin_gives_up_at_the_scaled_deadline() {
    let (mut o, _t, _id, _burst) = to_sending(512 * 1024, ms(0));
    let before = tick(&mut o, ms(0), ms(149));
    assert!(before.iter().all(|d| kind_of(d) == Kind::ConnState));
    let after = tick(&mut o, ms(149), ms(152));
    assert!(after.iter().any(|d| kind_of(d) == Kind::Abort));
}

/// The snapshot is not resent while its first burst is still leaving: the
/// retransmission timer starts at the burst's last fragment.
#[test]
fn snapshot_retransmission_timer_starts_after_the_burst() {
    let mut o = Engine::new(config(ORIGIN), key()).unwrap();
    let mut t = Engine::new(config(TARGET), key()).unwrap();
    let id = o.migrate_out(ms(0), flow(), Some(TARGET)).unwrap();
    for d in drain(&mut o, ms(0)) {
        t.handle_message(ms(0), ORIGIN, &d).unwrap();
    }
    for d in drain(&mut t, ms(0)) {
        o.handle_message(ms(0), TARGET, &d).unwrap();
    }
    let _ = events(&mut o);
    o.provide_snapshot(ms(0), id, vec![1u8; 256 * 1024])
        .unwrap();
    // The driver is busy for 5 ms (several RTOs) before it sends anything.
    for now in [ms(1), ms(2), ms(4)] {
        if o.poll_timeout().is_some_and(|d| d <= now) {
            o.handle_timeout(now);
        }
    }
    assert_eq!(o.counters().retransmissions, 0);
    let first = drain(&mut o, ms(5));
    let frags = first.len();
    assert!(frags > 100, "{frags} fragments");
    // One RTO (1 ms) after the last fragment, not before.
    assert!(tick(&mut o, ms(5), Instant::from_micros(5_900)).is_empty());
    let again = tick(&mut o, Instant::from_micros(6_000), ms(6));
    assert_eq!(again.len(), frags, "the whole snapshot, once");
}

/// Target: fragments 60 ms apart keep the migration alive past the 100 ms
/// target deadline (each new one is progress); it commits.
#[test]
fn target_deadline_extends_while_fragments_arrive() {
    let (_o, mut t, _id, burst) = to_sending(5000, ms(0));
    assert_eq!(burst.len(), 4);
    let mut now = ms(0);
    let mut answers = Vec::new();
    for d in &burst {
        let before = now;
        now += Duration::from_millis(60);
        answers.extend(tick(&mut t, before, now));
        answers.extend(deliver(&mut t, now, std::slice::from_ref(d)));
    }
    assert_eq!(now, ms(240));
    let kinds: Vec<Kind> = answers.iter().map(|d| kind_of(d)).collect();
    assert_eq!(kinds, vec![Kind::ConnStateAck], "{kinds:?}");
}

/// Target: a transfer that stalls is given up `target_deadline` after its
/// last progress; one that crawls is given up at `target_deadline_max`.
#[test]
fn target_gives_up_after_a_stall_and_at_the_hard_cap() {
    let (_o, mut t, _id, burst) = to_sending(16 * 1024, ms(0));
    deliver(&mut t, ms(30), &burst[..1]);
    let quiet = tick(&mut t, ms(30), ms(129));
    assert!(quiet.is_empty());
    let gave_up = tick(&mut t, ms(129), ms(131));
    assert!(gave_up.iter().any(|d| kind_of(d) == Kind::Abort));

    let (_o, mut t, _id, burst) = to_sending(64 * 1024, ms(0));
    let cap = config(TARGET).target_deadline_max;
    let mut now = ms(0);
    let mut aborted_at = None;
    for d in &burst {
        let next = now + Duration::from_millis(80);
        if tick(&mut t, now, next)
            .iter()
            .any(|d| kind_of(d) == Kind::Abort)
        {
            aborted_at = Some(next);
            break;
        }
        now = next;
        deliver(&mut t, now, std::slice::from_ref(d));
    }
    let at = aborted_at.expect("gave up");
    assert!(at >= ms(0) + cap && at <= ms(0) + cap + Duration::from_millis(80));
}
