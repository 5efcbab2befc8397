//! Live migration of one client connection between two servers through the
//! switch model, on the deterministic four-party harness (`common`): what a
//! client relies on is a byte-exact stream and no reset, and what operators
//! rely on is exactly one server owning the connection with the switch
//! agreeing.
//!
//! Run: `cargo test -p capybara-hostagent --test live_migration` (about
//! 10 s). Longer hunts: `PROPTEST_CASES=5000` (proptest replays the saved
//! failures in `live_migration.regressions` first); `HARNESS_VERBOSE=1
//! ... -- --nocapture` prints one line per case (migrations, outcomes).

mod common;

use capybara_hostagent::migration::Outcome;
use capybara_proto::tcpmig::{Kind, Reason};
use capybara_proto::time::{Duration, Instant};
use common::*;
use proptest::prelude::*;

const LIMIT: Instant = Instant::from_millis(120_000);

fn setup(seed: u64, app: App, net: Net) -> Setup {
    Setup { seed, app, net }
}

/// What the client must have received.
fn expected(w: &World) -> Vec<u8> {
    match w.servers[0].app {
        App::Echo => w.client.to_send.clone(),
        App::Source { seed, len } => (0..len as u64).map(|i| stream_byte(seed, i)).collect(),
    }
}

/// The client saw its whole stream, byte-exact, and no reset; the servers
/// read exactly what the client sent.
fn assert_stream_exact(w: &World) {
    assert_eq!(w.client.error, None, "client error; {}", w.describe());
    assert!(w.client.eof, "no end of stream; {}", w.describe());
    let want = expected(w);
    assert!(
        w.client.received == want,
        "stream differs: got {} bytes, want {}, first difference at {:?}; {}",
        w.client.received.len(),
        want.len(),
        w.client
            .received
            .iter()
            .zip(&want)
            .position(|(a, b)| a != b),
        w.describe()
    );
    if let App::Source { .. } = w.servers[0].app {
        assert!(
            w.server_rx == w.client.to_send,
            "servers read {} of {} bytes (or wrong ones); {}",
            w.server_rx.len(),
            w.client.to_send.len(),
            w.describe()
        );
    }
    assert_eq!(
        w.switch.counters.resets_to_client,
        0,
        "a server reset the client; {}",
        w.describe()
    );
    assert_eq!(
        w.client.tr.tcp.counters().resets_received,
        0,
        "{}",
        w.describe()
    );
    assert!(
        w.servers.iter().all(|s| s.app_errors.is_empty()),
        "{}",
        w.describe()
    );
}

fn count(w: &World, f: impl Fn(&Outcome) -> bool) -> usize {
    w.outcomes().iter().filter(|(_, _, o)| f(o)).count()
}

/// Runs until the client has received `n` bytes (or finished).
fn run_to_rx(w: &mut World, n: usize) {
    assert!(
        w.run_until(LIMIT, |w| w.client.received.len() >= n || w.client.done()),
        "{}",
        w.describe()
    );
}

#[test]
fn echo_without_migration() {
    let mut w = World::new(setup(1, App::Echo, Net::clean()), stream(1, 300_000));
    assert!(w.finish(LIMIT), "{}", w.describe());
    assert_stream_exact(&w);
    assert_eq!(w.owners(), vec![0]);
    assert!(
        w.switch.counters.arp_replies >= 3,
        "every party resolved its gateway through the switch"
    );
}

#[test]
fn one_migration_mid_stream_both_apps() {
    for app in [
        App::Echo,
        App::Source {
            seed: 7,
            len: 400_000,
        },
    ] {
        let mut w = World::new(setup(2, app, Net::clean()), stream(2, 300_000));
        run_to_rx(&mut w, 100_000);
        w.migrate(true).expect("migrate");
        assert!(w.finish(LIMIT), "{}", w.describe());
        assert_stream_exact(&w);
        w.assert_single_owner();
        assert_eq!(w.owners(), vec![1], "{}", w.describe());
        assert_eq!(count(&w, |o| *o == Outcome::MigratedOut), 1);
        assert_eq!(count(&w, |o| *o == Outcome::MigratedIn), 1);
    }
}

#[test]
fn switch_picks_the_target_when_prepare_names_none() {
    let mut w = World::new(setup(3, App::Echo, Net::clean()), stream(3, 100_000));
    run_to_rx(&mut w, 10_000);
    w.migrate(false).expect("migrate");
    assert!(w.finish(LIMIT), "{}", w.describe());
    assert_stream_exact(&w);
    w.assert_single_owner();
    assert_eq!(w.owners(), vec![1]);
}

#[test]
fn tcpmig_from_the_client_side_is_dropped() {
    let mut w = World::new(setup(4, App::Echo, Net::clean()), stream(4, 10_000));
    run_to_rx(&mut w, 1);
    // A client forging a PREPARE_ACK for its own flow to pull it elsewhere.
    let flow = w.flow().unwrap();
    let m = capybara_proto::tcpmig::TcpMigRepr {
        kind: Kind::PrepareAck,
        migration_id: 1,
        flow,
        origin: SERVERS[0],
        target: SERVERS[1],
        seq: 0,
        frag_index: 0,
        frag_count: 1,
        reason: Reason::None,
        epoch: 0,
        payload: &[],
    };
    let mut dgram = vec![0u8; 8 + m.buffer_len()];
    m.emit(&mut dgram[8..]).unwrap();
    let len = dgram.len() as u16;
    dgram[0..2].copy_from_slice(&TCPMIG_PORT.to_be_bytes());
    dgram[2..4].copy_from_slice(&TCPMIG_PORT.to_be_bytes());
    dgram[4..6].copy_from_slice(&len.to_be_bytes());
    let mut frame = vec![0u8; 14 + 20];
    frame[0..6].copy_from_slice(SWITCH_MAC.as_bytes());
    frame[6..12].copy_from_slice(CLIENT_MAC.as_bytes());
    frame[12..14].copy_from_slice(&[0x08, 0x00]);
    let ip = &mut frame[14..];
    ip[0] = 0x45;
    ip[2..4].copy_from_slice(&(20 + len).to_be_bytes());
    ip[8] = 64;
    ip[9] = 17;
    ip[12..16].copy_from_slice(&CLIENT.octets());
    ip[16..20].copy_from_slice(&SWITCH.octets());
    frame.extend_from_slice(&dgram);
    rewrite_dst(&mut frame, SWITCH);
    let out = w.switch.process(w.now, Port::Client, &frame);
    assert!(out.is_empty());
    assert_eq!(w.switch.counters.tcpmig_from_client_dropped, 1);
    assert!(w.switch.migration.is_empty());
    assert!(w.finish(LIMIT));
    assert_stream_exact(&w);
}

/// Every message kind of a successful migration lost once, before or after
/// the switch applied it: the migration still completes.
#[test]
fn every_tcpmig_kind_lost_once_migration_completes() {
    for kind in [
        Kind::Prepare,
        Kind::PrepareAck,
        Kind::ConnState,
        Kind::ConnStateAck,
    ] {
        for after_switch in [false, true] {
            for app in [
                App::Echo,
                App::Source {
                    seed: 9,
                    len: 200_000,
                },
            ] {
                let mut w = World::new(setup(5, app, Net::clean()), stream(5, 200_000));
                w.switch.drops.push(KindDrop {
                    kind,
                    after_switch,
                    remaining: 1,
                });
                run_to_rx(&mut w, 50_000);
                w.migrate(true).expect("migrate");
                let ctx = format!("{kind:?} after_switch={after_switch} {app:?}");
                assert!(w.finish(LIMIT), "{ctx}: {}", w.describe());
                assert_eq!(w.switch.counters.fault_dropped, 1, "{ctx}");
                assert_stream_exact(&w);
                w.assert_single_owner();
                assert_eq!(w.owners(), vec![1], "{ctx}: {}", w.describe());
                assert_eq!(
                    count(&w, |o| *o == Outcome::MigratedOut),
                    1,
                    "{ctx}: {}",
                    w.describe()
                );
            }
        }
    }
}

/// REJECT (target draining), also lost once: the origin keeps serving.
#[test]
fn reject_from_draining_target_origin_keeps_serving() {
    for drop_reject in [None, Some(false), Some(true)] {
        let mut w = World::new(setup(6, App::Echo, Net::clean()), stream(6, 200_000));
        w.servers[1].migrator_mut().engine.set_draining(true);
        if let Some(after_switch) = drop_reject {
            w.switch.drops.push(KindDrop {
                kind: Kind::Reject,
                after_switch,
                remaining: 1,
            });
        }
        run_to_rx(&mut w, 50_000);
        w.migrate(true).expect("migrate");
        assert!(w.finish(LIMIT), "{}", w.describe());
        assert_stream_exact(&w);
        w.assert_single_owner();
        assert_eq!(w.owners(), vec![0]);
        assert_eq!(
            count(&w, |o| *o == Outcome::Resumed(Reason::Draining)),
            1,
            "{}",
            w.describe()
        );
    }
}

/// The target never receives the state (every CONN_STATE lost): the origin
/// is in doubt, asks with ABORT (lost once, before or after the switch), the
/// target answers with its ABORT decision, and the origin resumes.
#[test]
fn abort_lost_once_origin_resumes() {
    for after_switch in [false, true] {
        let mut w = World::new(setup(7, App::Echo, Net::clean()), stream(7, 200_000));
        w.switch.drops.push(KindDrop {
            kind: Kind::ConnState,
            after_switch: false,
            remaining: u32::MAX,
        });
        w.switch.drops.push(KindDrop {
            kind: Kind::Abort,
            after_switch,
            remaining: 1,
        });
        run_to_rx(&mut w, 50_000);
        w.migrate(true).expect("migrate");
        assert!(w.finish(LIMIT), "{}", w.describe());
        assert_stream_exact(&w);
        w.assert_single_owner();
        assert_eq!(w.owners(), vec![0], "{}", w.describe());
        assert_eq!(
            count(&w, |o| matches!(o, Outcome::Resumed(_))),
            1,
            "{}",
            w.describe()
        );
    }
}

/// Every PREPARE_ACK is lost after the switch applied it: the switch sends
/// the client's segments to the target, which buffers them, while the
/// origin never learns that the target is ready. At the origin's deadline
/// the target aborts and discards them; segments still on their way to it
/// must be dropped silently (the client retransmits them to the origin),
/// never answered with a reset.
#[test]
fn target_that_aborts_never_resets_the_client() {
    for app in [
        App::Echo,
        App::Source {
            seed: 12,
            len: 2 << 20,
        },
    ] {
        let mut w = World::new(setup(12, app, Net::clean()), stream(12, 2 << 20));
        w.switch.drops.push(KindDrop {
            kind: Kind::PrepareAck,
            after_switch: true,
            remaining: u32::MAX,
        });
        run_to_rx(&mut w, 100_000);
        w.migrate(true).expect("migrate");
        assert!(w.finish(LIMIT), "{}", w.describe());
        assert_stream_exact(&w);
        w.assert_single_owner();
        assert_eq!(w.owners(), vec![0]);
        assert_eq!(
            count(&w, |o| *o == Outcome::AbortedIn),
            1,
            "{}",
            w.describe()
        );
    }
    // The target gives up on its own (short target deadline) while client
    // segments are still in flight to it.
    for deadline_us in (5..120).step_by(5) {
        let mig = |a| capybara_tcpmig::EngineConfig {
            target_deadline: Duration::from_micros(deadline_us),
            ..server_mig_config(a)
        };
        let mut w = World::with(
            setup(13, App::Echo, Net::clean()),
            stream(13, 2 << 20),
            client_tcp_config(),
            server_tcp_config,
            mig,
        );
        run_to_rx(&mut w, 100_000);
        w.migrate(true).expect("migrate");
        assert!(
            w.finish(LIMIT),
            "deadline {deadline_us} us: {}",
            w.describe()
        );
        assert_stream_exact(&w);
        w.assert_single_owner();
    }
}

/// An origin or target that dies at any point of a migration: the client
/// gets the complete stream (the target committed and serves) or an error
/// (timeout or reset, as for any host failure), never wrong bytes.
#[test]
fn server_dies_mid_migration_never_corrupts() {
    let mut outcomes = [0usize; 2];
    for victim in [0usize, 1] {
        for delay_us in (0..400).step_by(15) {
            let mut client = client_tcp_config();
            client.max_retries = 6;
            client.max_rto = Duration::from_secs(2);
            let mut w = World::with(
                setup(8 + delay_us, App::Echo, Net::clean()),
                stream(8, 200_000),
                client,
                server_tcp_config,
                server_mig_config,
            );
            run_to_rx(&mut w, 50_000);
            w.migrate(true).expect("migrate");
            w.run_for(Duration::from_micros(delay_us));
            w.servers[victim].alive = false;
            // Liveness detection removes the dead server's entries.
            w.switch.server_dead(SERVERS[victim]);
            assert!(
                w.run_until(LIMIT, |w| w.client.done()),
                "client neither finished nor failed; {}",
                w.describe()
            );
            let want = expected(&w);
            let got = &w.client.received;
            assert!(
                got.len() <= want.len() && got[..] == want[..got.len()],
                "corrupted stream; {}",
                w.describe()
            );
            if std::env::var_os("HARNESS_VERBOSE").is_some() {
                eprintln!(
                    "victim={victim} delay={delay_us}us error={:?} rx={} outcomes={:?}",
                    w.client.error,
                    got.len(),
                    w.outcomes()
                );
            }
            if w.client.error.is_none() {
                assert_eq!(got, &want, "{}", w.describe());
                outcomes[0] += 1;
            } else {
                outcomes[1] += 1;
            }
        }
    }
    // Both fates occur across the sweep (otherwise the sweep tests nothing).
    assert!(
        outcomes[0] > 0 && outcomes[1] > 0,
        "complete/failed: {outcomes:?}"
    );
}

/// Back and forth every millisecond of virtual time during a multi-MiB
/// transfer in both directions. A 400 us RTT and 64 KiB windows stretch the
/// transfer over tens of milliseconds, so it sees dozens of migrations, each
/// with data in flight both ways.
#[test]
fn back_and_forth_every_millisecond_multi_mib() {
    let small = |mut c: capybara_tcp::TcpConfig| {
        c.rx_buffer = 64 * 1024;
        c.tx_buffer = 64 * 1024;
        c
    };
    let link = LinkConfig {
        latency: Duration::from_micros(100),
        ..LinkConfig::default()
    };
    let net = Net::every_way(link);
    for app in [
        App::Echo,
        App::Source {
            seed: 11,
            len: 3 << 20,
        },
    ] {
        let mut w = World::with(
            setup(9, app, net),
            stream(9, 4 << 20),
            small(client_tcp_config()),
            |i| small(server_tcp_config(i)),
            server_mig_config,
        );
        let mut next = Instant::from_millis(1);
        loop {
            if w.run_until(next, |w| w.client.done()) {
                break;
            }
            assert!(w.now < LIMIT, "{}", w.describe());
            if !w.any_migrating() {
                let _ = w.migrate(w.started.len() % 2 == 0);
            }
            next = w.now + Duration::from_millis(1);
        }
        assert!(w.finish(LIMIT), "{}", w.describe());
        assert_stream_exact(&w);
        w.assert_single_owner();
        let moved = count(&w, |o| *o == Outcome::MigratedOut);
        assert!(moved >= 20, "only {moved} migrations; {}", w.describe());
        // No retransmission timeout was needed: migrations lose nothing.
        assert_eq!(
            w.client.tr.tcp.counters().retransmits_timeout,
            0,
            "{}",
            w.describe()
        );
    }
}

/// Regression (1,000-connection lab run, 2026-11-22): connections migrated
/// while closing. Deterministic sweep over both directions of FIN (echo:
/// the client closes first, the server follows from CLOSE-WAIT through
/// LAST-ACK; source: the server closes first and sits in FIN-WAIT-1/2 while
/// the client still sends), a migration at each closing state and then
/// back-to-back ones, with TCP and TCPMig loss: every stream finishes
/// byte-exact, nobody is reset, one owner remains.
#[test]
fn migration_in_every_closing_state_both_fin_directions_with_loss() {
    let loss = |l: f64| Faults {
        loss: l,
        duplicate: 0.01,
        reorder: 0.05,
    };
    let mut exported = std::collections::BTreeSet::new();
    for seed in 0..12u64 {
        for (source, triggers) in [
            // Client FIN first: migrate right after it, then in CLOSE-WAIT
            // (the echo still drains), then again as soon as possible
            // (LAST-ACK when the echo has closed).
            (
                None,
                vec![
                    (Trigger::ClientFin, true),
                    (Trigger::ServerCloseWait, false),
                    (Trigger::AfterIdle(0), true),
                    (Trigger::AfterIdle(50), false),
                ],
            ),
            // Server FIN first: a short server stream, a long client one.
            (
                Some(20_000),
                vec![
                    (Trigger::ServerFinWait1, true),
                    (Trigger::ClientRx(1000), true),
                    (Trigger::AfterIdle(0), false),
                    (Trigger::AfterIdle(100), true),
                    (Trigger::ClientFin, false),
                    (Trigger::AfterIdle(0), true),
                ],
            ),
        ] {
            let w = run_scenario(&Scenario {
                seed,
                source,
                up: 150_000,
                server_tx: 16 * 1024,
                tcp: loss(0.02),
                mig: loss(0.1),
                reorder_delay_us: 500,
                mig_reorder_delay_us: 50,
                triggers,
            });
            for e in w.servers.iter().flat_map(|s| s.exports.iter()) {
                exported.insert(format!("{:?}", e.state));
            }
        }
    }
    for st in ["CloseWait", "LastAck", "FinWait1", "FinWait2"] {
        assert!(exported.contains(st), "no export in {st}: {exported:?}");
    }
}

// ------------------------------------------------------------------ property

#[derive(Debug, Clone, Copy)]
enum Trigger {
    /// When the client has received this fraction (per mille) of its stream.
    ClientRx(u32),
    /// This long after the previous trigger.
    After(u32),
    /// Right after the client sent its FIN.
    ClientFin,
    /// When the serving connection has the client's FIN (CLOSE-WAIT).
    ServerCloseWait,
    /// When the serving connection has sent its FIN and it is not yet
    /// acknowledged (FIN-WAIT-1).
    ServerFinWait1,
    /// This long after no migration is in progress any more.
    AfterIdle(u32),
}

fn trigger() -> impl Strategy<Value = (Trigger, bool)> {
    (
        prop_oneof![
            4 => (0u32..1000).prop_map(Trigger::ClientRx),
            3 => (0u32..3000).prop_map(Trigger::After),
            1 => Just(Trigger::ClientFin),
            1 => Just(Trigger::ServerCloseWait),
        ],
        any::<bool>(),
    )
}

fn faults(max_loss: f64) -> impl Strategy<Value = Faults> {
    prop_oneof![
        1 => Just(Faults::NONE),
        3 => (0.0..max_loss, 0.0..0.05f64, 0.0..0.2f64).prop_map(|(loss, duplicate, reorder)| Faults { loss, duplicate, reorder }),
    ]
}

/// One run of the property.
#[derive(Debug, Clone)]
struct Scenario {
    seed: u64,
    /// Server app: echo (None) or an independent stream of this length.
    source: Option<usize>,
    /// Bytes the client sends.
    up: usize,
    /// The servers' send buffer (a small one keeps the echo's send queue
    /// full, so received data waits unread in the stack).
    server_tx: usize,
    tcp: Faults,
    mig: Faults,
    /// Longest extra delay of a reordered frame: long ones deliver stale
    /// TCPMig messages after later migrations of the flow.
    reorder_delay_us: u64,
    /// The same for TCPMig frames.
    mig_reorder_delay_us: u64,
    triggers: Vec<(Trigger, bool)>,
}

fn run_scenario(sc: &Scenario) -> World {
    let app = match sc.source {
        None => App::Echo,
        Some(len) => App::Source {
            seed: sc.seed ^ 0xabc,
            len,
        },
    };
    let server_tx = sc.server_tx;
    let server_tcp = |i| capybara_tcp::TcpConfig {
        tx_buffer: server_tx,
        ..server_tcp_config(i)
    };
    let mut net = Net::faulty(sc.tcp, sc.mig);
    for l in [
        &mut net.client_up,
        &mut net.client_down,
        &mut net.server_up,
        &mut net.server_down,
    ] {
        l.reorder_delay = Duration::from_micros(sc.reorder_delay_us);
        l.tcpmig_reorder_delay = Duration::from_micros(sc.mig_reorder_delay_us);
    }
    let mut w = World::with(
        setup(sc.seed, app, net),
        stream(sc.seed, sc.up),
        client_tcp_config(),
        server_tcp,
        server_mig_config,
    );
    let total = expected(&w).len();
    for &(t, explicit) in &sc.triggers {
        let ok = match t {
            Trigger::ClientRx(pm) => {
                let n = total * pm as usize / 1000;
                w.run_until(LIMIT, |w| w.client.received.len() >= n || w.client.done())
            }
            Trigger::After(us) => {
                let end = w.now + Duration::from_micros(u64::from(us));
                w.run_until(end, |w| w.client.done());
                true
            }
            Trigger::ClientFin => w.run_until(LIMIT, |w| {
                w.client.sent == w.client.to_send.len() || w.client.done()
            }),
            Trigger::AfterIdle(us) => {
                let idle = w.run_until(LIMIT, |w| w.client.done() || !w.any_migrating());
                let end = w.now + Duration::from_micros(u64::from(us));
                w.run_until(end, |w| w.client.done());
                idle
            }
            Trigger::ServerCloseWait => w.run_until(LIMIT, |w| {
                w.client.done() || w.serving_in(capybara_tcp::State::CloseWait)
            }),
            Trigger::ServerFinWait1 => w.run_until(LIMIT, |w| {
                w.client.done() || w.serving_in(capybara_tcp::State::FinWait1)
            }),
        };
        assert!(ok, "stalled; {}", w.describe());
        if w.client.done() {
            break;
        }
        // Refused while a previous migration of the flow is still in
        // progress: fine, that is the engine's rule.
        let _ = w.migrate(explicit);
    }
    assert!(w.finish(LIMIT), "did not finish; {}", w.describe());
    assert_stream_exact(&w);
    w.assert_single_owner();
    if std::env::var_os("HARNESS_VERBOSE").is_some() {
        eprintln!(
            "case: t={} up={} down={} started={} out={} resumed={} lost={} links_lost={} tcpmig_dropped={}",
            w.now,
            w.client.to_send.len(),
            total,
            w.started.len(),
            count(&w, |o| *o == Outcome::MigratedOut),
            count(&w, |o| matches!(o, Outcome::Resumed(_))),
            count(&w, |o| matches!(o, Outcome::Lost(_))),
            w.up.iter().chain(&w.down).map(|l| l.stats.lost).sum::<u64>(),
            w.switch.counters.tcpmig_refused,
        );
    }
    w
}

/// The property's generator reaches the states that make migration hard:
/// exports with unacknowledged and unsent data, unread and out-of-order
/// received data, and every state of the FIN exchange the server can be
/// in. (Deterministic sample of the same scenario space.)
#[test]
fn scenarios_export_every_interesting_connection_state() {
    use capybara_tcp::State;
    let mut r = common::Rng::new(0x5eed);
    let mut exports = Vec::new();
    for case in 0..300u64 {
        let f = |r: &mut common::Rng, max: f64| {
            let u = |r: &mut common::Rng| (r.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
            Faults {
                loss: u(r) * max,
                duplicate: u(r) * 0.05,
                reorder: u(r) * 0.2,
            }
        };
        let source = (r.below(2) == 0).then(|| r.below(300_000) as usize);
        let up = r.below(300_000) as usize;
        let server_tx = [4096, 16 * 1024, 256 * 1024][r.below(3) as usize];
        let (tcp, mig) = (f(&mut r, 0.05), f(&mut r, 0.3));
        let triggers: Vec<(Trigger, bool)> = (0..1 + r.below(4))
            .map(|_| {
                let t = match r.below(9) {
                    0..=3 => Trigger::ClientRx(r.below(1000) as u32),
                    4..=6 => Trigger::After(r.below(3000) as u32),
                    7 => Trigger::ClientFin,
                    _ => Trigger::ServerCloseWait,
                };
                (t, r.below(2) == 0)
            })
            .collect();
        let reorder_delay_us = [100, 1000, 20_000][r.below(3) as usize];
        let mig_reorder_delay_us = 1 + r.below(100);
        let w = run_scenario(&Scenario {
            seed: case,
            source,
            up,
            server_tx,
            tcp,
            mig,
            reorder_delay_us,
            mig_reorder_delay_us,
            triggers,
        });
        exports.extend(w.servers.iter().flat_map(|s| s.exports.iter().copied()));
    }
    let has = |f: &dyn Fn(&Exported) -> bool| exports.iter().any(f);
    assert!(has(&|e| e.unacked > 0), "unacked data");
    assert!(has(&|e| e.unsent > 0), "unsent data");
    assert!(has(&|e| e.unread > 0), "unread data");
    assert!(has(&|e| e.out_of_order), "out-of-order data");
    assert!(
        has(&|e| e.out_of_order && e.unacked > 0),
        "out-of-order and unacked data together"
    );
    for st in [
        State::Established,
        State::CloseWait,
        State::LastAck,
        State::FinWait1,
        State::FinWait2,
    ] {
        assert!(
            has(&|e| e.state == st),
            "export in {st:?}: {:?}",
            exports
                .iter()
                .map(|e| format!("{:?}", e.state))
                .collect::<std::collections::BTreeSet<_>>()
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 256,
        max_shrink_iters: 200,
        failure_persistence: Some(Box::new(proptest::test_runner::FileFailurePersistence::WithSource("regressions"))),
        .. ProptestConfig::default()
    })]

    /// Random streams both ways, migrations at random points, random loss,
    /// duplication and reordering of TCP and TCPMig frames: the client sees
    /// a byte-exact stream and never a reset, exactly one server owns the
    /// connection at the end, and the switch agrees.
    #[test]
    fn migration_is_invisible_to_the_client(
        seed in any::<u64>(),
        source in prop::option::of(0usize..300_000),
        up in 0usize..300_000,
        server_tx in prop_oneof![Just(4096usize), Just(16 * 1024), Just(256 * 1024)],
        tcp in faults(0.05),
        mig in faults(0.3),
        reorder_delay_us in prop_oneof![Just(100u64), 1u64..2000, 2000u64..50_000],
        mig_reorder_delay_us in 1u64..100,
        triggers in prop::collection::vec(trigger(), 1..5),
    ) {
        let _ = run_scenario(&Scenario { seed, source, up, server_tx, tcp, mig, reorder_delay_us, mig_reorder_delay_us, triggers });
    }
    /// Storms: many migrations back to back (each started as soon as the
    /// previous one let go of the flow) under heavy loss of TCPMig frames,
    /// so that migrations time out, abort, go in doubt and overlap with
    /// stale messages of earlier ones.
    #[test]
    fn migration_storms_under_heavy_tcpmig_loss(
        seed in any::<u64>(),
        source in prop::option::of(0usize..200_000),
        up in 0usize..200_000,
        tcp in faults(0.05),
        mig in faults(0.5),
        reorder_delay_us in prop_oneof![Just(100u64), 1u64..2000, 2000u64..50_000],
        mig_reorder_delay_us in 1u64..100,
        gaps in prop::collection::vec((0u32..500, any::<bool>()), 5..16),
    ) {
        let triggers = gaps.into_iter().map(|(us, explicit)| (Trigger::AfterIdle(us), explicit)).collect();
        let _ = run_scenario(&Scenario { seed, source, up, server_tx: 256 * 1024, tcp, mig, reorder_delay_us, mig_reorder_delay_us, triggers });
    }
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 64,
        max_shrink_iters: 200,
        failure_persistence: Some(Box::new(proptest::test_runner::FileFailurePersistence::WithSource("regressions"))),
        .. ProptestConfig::default()
    })]

    /// TCPMig v2 ownership epochs: the flow goes back and forth between the
    /// two servers many times (each migration as soon as the previous one
    /// let go, origin and target alternating), while TCPMig frames are
    /// duplicated and held back for longer than several migrations take,
    /// so stale PREPARE_ACKs, CONN_STATE_ACKs and ABORTs of earlier
    /// migrations (by either origin) reach the switch in every order. The
    /// client sees a byte-exact stream and never a reset, and exactly one
    /// server owns the flow with the switch agreeing.
    #[test]
    fn back_and_forth_with_delayed_and_duplicated_control_messages(
        seed in any::<u64>(),
        source in prop::option::of(50_000usize..300_000),
        up in 0usize..150_000,
        // TCP loss stretches the stream (retransmission timeouts) over
        // many migrations.
        tcp_loss in 0.01..0.05f64,
        mig_loss in 0.0..0.1f64,
        mig_duplicate in 0.02..0.3f64,
        mig_reorder in 0.05..0.4f64,
        mig_reorder_delay_us in 2_000u64..60_000,
        gaps in prop::collection::vec((0u32..400, any::<bool>()), 6..16),
    ) {
        let triggers = gaps.into_iter().map(|(us, explicit)| (Trigger::AfterIdle(us), explicit)).collect();
        let tcp = Faults { loss: tcp_loss, duplicate: 0.02, reorder: 0.0 };
        let mig = Faults { loss: mig_loss, duplicate: mig_duplicate, reorder: mig_reorder };
        let _ = run_scenario(&Scenario {
            seed, source, up, server_tx: 256 * 1024, tcp, mig,
            reorder_delay_us: 100, mig_reorder_delay_us, triggers,
        });
    }
}

/// Regression (TCPMig v1 bug, fixed by the v2 ownership epoch; see
/// docs/MIGRATION.md "Ownership epochs"): a duplicate PREPARE_ACK of
/// migration M (origin B -> target A) delayed past two later migrations
/// (A -> B by a *different* origin, then B -> A and A -> B again) arrived
/// when the entry was {owner B, id from origin A, final}: the v1 switch
/// rules could not compare ids of different origins, so it installed
/// {A, M, pending}; a delayed CONN_STATE_ACK(M) then made it final and the
/// flow was steered to A, which no longer had it (client blackholed, then
/// reset). The reordering delay needed was only that of two migrations
/// (here 21 ms). Now M's PREPARE_ACK names the epoch B had then, which the
/// entry has moved on from, and the switch drops it.
#[test]
fn stale_prepare_ack_from_two_migrations_ago() {
    let gaps = [
        (80, false),
        (371, false),
        (381, false),
        (313, false),
        (48, false),
        (476, true),
        (37, false),
        (212, true),
        (200, true),
        (267, false),
        (283, true),
        (17, true),
        (143, true),
        (111, false),
    ];
    let _ = run_scenario(&Scenario {
        seed: 15277485088012568009,
        source: Some(103369),
        up: 7241,
        server_tx: 256 * 1024,
        tcp: Faults {
            loss: 0.03222232426442903,
            duplicate: 0.04135896529304008,
            reorder: 0.0,
        },
        mig: Faults {
            loss: 0.0,
            duplicate: 0.016245746835177308,
            reorder: 0.11138158055592189,
        },
        reorder_delay_us: 27038,
        mig_reorder_delay_us: 27038,
        triggers: gaps
            .iter()
            .map(|&(us, e)| (Trigger::AfterIdle(us), e))
            .collect(),
    });
}

/// Regression (stuck-after-migration, bench-skew): the origin's migrations
/// of one connection abort twice in a row, then one completes. Each resume
/// re-imports the connection under a new endpoint id; the application's
/// handle must follow it every time. When the second export froze the
/// endpoint id instead of the handle, the handle kept pointing at an
/// exported endpoint: the application lost the connection while the stack
/// went on acknowledging the client's requests, which never got a response
/// (7 long-lived connections timed out in `run.py skew`).
#[test]
fn app_handle_follows_the_connection_across_repeated_resumes() {
    use capybara_hostagent::migration::HandleState;
    let mut w = World::new(setup(11, App::Echo, Net::clean()), stream(11, 300_000));
    run_to_rx(&mut w, 20_000);
    let app = w.servers[0].conns[0];
    for round in 0..2usize {
        w.switch.drops.push(KindDrop {
            kind: Kind::ConnState,
            after_switch: false,
            remaining: u32::MAX,
        });
        w.migrate(true).expect("migrate");
        assert!(
            w.run_until(LIMIT, |w| !w.any_migrating()),
            "round {round}: {}",
            w.describe()
        );
        w.switch.drops.clear();
        match w.servers[0].migrator().handle(app) {
            HandleState::Live(e) => assert!(
                w.servers[0].tr.tcp.connection(e).is_some(),
                "round {round}: handle {app:?} points at {e:?}, which the origin no longer holds; {}",
                w.describe()
            ),
            other => panic!("round {round}: handle {app:?} is {other:?}; {}", w.describe()),
        }
        run_to_rx(&mut w, 20_000 * (round + 2));
    }
    w.migrate(true).expect("migrate");
    assert!(w.finish(LIMIT), "{}", w.describe());
    assert_stream_exact(&w);
    w.assert_single_owner();
    assert_eq!(w.owners(), vec![1], "{}", w.describe());
    assert_eq!(
        count(&w, |o| matches!(o, Outcome::Resumed(_))),
        2,
        "{}",
        w.describe()
    );
    assert_eq!(
        w.servers[0].migrator().handle(app),
        HandleState::Moved(w.servers[1].addr),
        "{}",
        w.describe()
    );
}

/// The origin exports, its CONN_STATE never arrives and the target dies
/// (after its PREPARE_ACK passed the switch, which now sends the flow to
/// it): the origin is in doubt, gives the migration up as `Lost` after
/// `in_doubt_limit`, and resets the client at once. The client only
/// waits to receive (its own data and FIN were acknowledged before), so it
/// sends nothing that could find out: without the origin's RST it hangs
/// (no liveness removal here, no keepalive) until the limit.
#[test]
fn lost_migration_resets_a_client_that_only_receives() {
    let app = App::Source {
        seed: 21,
        len: 4_000_000,
    };
    let mut w = World::new(setup(21, app, Net::clean()), stream(21, 100));
    run_to_rx(&mut w, 50_000);
    assert_eq!(w.client.sent, 100, "{}", w.describe());
    w.switch.drops.push(KindDrop {
        kind: Kind::ConnState,
        after_switch: false,
        remaining: u32::MAX,
    });
    let id = w.migrate(true).expect("migrate");
    let sending = |w: &World| {
        matches!(
            w.servers[0].engine().phase(id),
            Some(capybara_tcpmig::Phase::Origin(
                capybara_tcpmig::OriginPhase::Sending
            ))
        )
    };
    assert!(w.run_until(LIMIT, sending), "{}", w.describe());
    w.servers[1].alive = false;
    let lost = |w: &World| count(w, |o| matches!(o, Outcome::Lost(_))) == 1;
    assert!(w.run_until(LIMIT, lost), "{}", w.describe());
    let lost_at = w.now;
    // Promptly: one trip through the switch, not a retransmission timeout.
    let prompt = lost_at + Duration::from_millis(10);
    assert!(
        w.run_until(prompt, |w| w.client.done()),
        "the client did not hear of its lost connection: {}",
        w.describe()
    );
    assert_eq!(
        w.client.error,
        Some(capybara_tcp::TcpError::Reset),
        "{}",
        w.describe()
    );
    assert!(
        w.switch
            .resets
            .iter()
            .all(|(_, from)| *from == Port::Server(0)),
        "{:?}",
        w.switch.resets
    );
    assert_eq!(w.servers[0].migrator().lost_resets, 1, "{}", w.describe());
    // Never wrong bytes: what arrived is a prefix of the stream.
    let want = expected(&w);
    let got = &w.client.received;
    assert!(got.len() < want.len() && got[..] == want[..got.len()]);
}

/// The other side of the origin's reset on `Lost`: a target that imported
/// and serves, all of whose answers to the origin are lost after the
/// switch made it the flow's owner (every CONN_STATE_ACK dropped after the
/// switch), leaves the origin in doubt until it gives up as `Lost` too. Its
/// RST then carries the sequence numbers of the frozen connection, behind
/// what the target sent since, so the client drops it (RFC 5961 §3.2) and
/// gets its whole stream (docs/TCPMIG.md §1.7 rule 8).
#[test]
fn lost_reset_never_ends_a_connection_the_target_serves_and_sent_on() {
    let app = App::Source {
        seed: 22,
        len: 40_000_000,
    };
    // Short deadline and doubt, so that the stream is still flowing when
    // the origin gives up (`linger` still outlasts both).
    let mut w = World::with(
        setup(22, app, Net::clean()),
        stream(22, 100),
        client_tcp_config(),
        server_tcp_config,
        |addr| {
            let mut c = server_mig_config(addr);
            c.in_doubt_limit = Duration::from_millis(1);
            c.migration_deadline = Duration::from_millis(5);
            c.migration_deadline_max = Duration::from_millis(5);
            c
        },
    );
    run_to_rx(&mut w, 50_000);
    w.switch.drops.push(KindDrop {
        kind: Kind::ConnStateAck,
        after_switch: true,
        remaining: u32::MAX,
    });
    w.migrate(true).expect("migrate");
    let lost = |w: &World| count(w, |o| matches!(o, Outcome::Lost(_))) == 1;
    assert!(w.run_until(LIMIT, lost), "{}", w.describe());
    assert_eq!(w.servers[0].migrator().lost_resets, 1, "{}", w.describe());
    assert!(
        !w.client.done() && w.client.received.len() < expected(&w).len(),
        "the stream should still flow; {}",
        w.describe()
    );
    assert!(w.finish(LIMIT), "{}", w.describe());
    assert_eq!(w.client.error, None, "{}", w.describe());
    assert_eq!(w.client.received, expected(&w), "{}", w.describe());
    assert_eq!(w.owners(), vec![1], "{}", w.describe());
    assert!(w.switch.counters.resets_to_client > 0, "{}", w.describe());
    assert_eq!(
        w.client.tr.tcp.counters().resets_received,
        0,
        "{}",
        w.describe()
    );
}

/// A connection whose queues alone are over the snapshot limit is refused
/// at `ExportNow` before anything is frozen: no export (the connection
/// never leaves the endpoint, its id stays), the outcome says `snapshot too
/// large` as a refusal after the export would, and the client's stream
/// goes on byte-exact without a reset.
#[test]
fn an_oversized_connection_is_never_frozen() {
    use capybara_hostagent::migration::HandleState;
    let app = App::Source {
        seed: 23,
        len: 2_000_000,
    };
    let mut w = World::with(
        setup(23, app, Net::clean()),
        stream(23, 50_000),
        client_tcp_config(),
        server_tcp_config,
        |addr| {
            let mut c = server_mig_config(addr);
            c.max_snapshot_bytes = 2048;
            c
        },
    );
    run_to_rx(&mut w, 50_000);
    let cid = w.servers[0].conns[0];
    w.migrate(true).expect("migrate");
    assert!(
        w.run_until(LIMIT, |w| !w.any_migrating() && !w.outcomes().is_empty()),
        "{}",
        w.describe()
    );
    let origin: Vec<_> = w.outcomes().into_iter().filter(|o| o.0 == 0).collect();
    assert_eq!(
        origin,
        vec![(
            0,
            w.started[0].2,
            Outcome::Resumed(Reason::SnapshotTooLarge)
        )],
        "{}",
        w.describe()
    );
    let m = w.servers[0].migrator();
    assert!(
        w.servers[0].exports.is_empty(),
        "exported: {:?}",
        w.servers[0].exports
    );
    assert_eq!(m.handle(cid), HandleState::Live(cid), "{}", w.describe());
    assert_eq!(m.too_large_before_export, 1, "{}", w.describe());
    assert!(w.servers[0].tr.tcp.connection(cid).is_some());
    assert!(w.finish(LIMIT), "{}", w.describe());
    assert_stream_exact(&w);
    w.assert_single_owner();
    assert_eq!(w.owners(), vec![0]);
}

/// A client resets its connection while the origin holds it frozen (the
/// snapshot sent, the outcome not known yet) and at once connects again
/// from the same port, as Linux allows: the switch forgot the flow at the
/// reset and places the new SYN anew, on the origin. The new connection
/// must be served where the switch sends it, and stay up. It was
/// forwarded to the target with the frozen connection's late segments and
/// established there while the switch sent its segments to the origin,
/// which forwarded them only for the 5 s a moved tuple's late segments are
/// forwarded, then reset the client.
#[test]
fn a_new_connection_on_the_tuple_of_a_frozen_one_is_served_where_the_switch_sends_it() {
    let mut w = reconnecting_world(41, Net::clean());
    let old = w.flow().expect("connected");
    // The target's first CONN_STATE_ACK is lost: the origin stays frozen
    // until it sends its state again.
    w.switch.drops.push(KindDrop {
        kind: Kind::ConnStateAck,
        after_switch: false,
        remaining: 1,
    });
    w.migrate(true).expect("migrate");
    let until = w.now + Duration::from_secs(1);
    assert!(
        w.run_until(until, |w| w.switch.counters.fault_dropped == 1),
        "{}",
        w.describe()
    );
    // The target imported the connection; the origin waits, frozen.
    assert_eq!(w.owners(), vec![1], "{}", w.describe());
    w.client.reset_and_reconnect(stream(42, 4_096));
    echo_past_gone_linger(&mut w, 43);
    assert_eq!(w.flow(), Some(old), "the same 4-tuple");
    assert_eq!(w.client.error, None, "{}", w.describe());
    assert!(
        w.client.received == w.client.to_send,
        "got {} of {} bytes; {}",
        w.client.received.len(),
        w.client.to_send.len(),
        w.describe()
    );
    assert_eq!(w.switch.counters.resets_to_client, 0, "{}", w.describe());
    assert!(w.servers[0].owns(&old), "{}", w.describe());
    assert_eq!(w.switch.owner(&old), Some(SERVERS[0]));
    // The client's reset ended the imported connection on the target.
    assert!(!w.servers[1].owns(&old), "{}", w.describe());
}

/// One run of [`reconnecting_during_a_migration_never_strands_the_new_connection`].
#[derive(Debug, Clone)]
struct Reconnect {
    seed: u64,
    explicit: bool,
    /// When the client resets and reconnects, after the migration started.
    reset_after_us: u64,
    /// A TCPMig message of this kind lost once on its way to the switch.
    lost: Option<Kind>,
    mig: Faults,
    tcp: Faults,
}

/// An echo world with switchd's closed-tuple rules, applications that
/// release closed connections, and a client that keeps its connection open
/// (more is sent on it later), once 4 KiB went both ways.
fn reconnecting_world(seed: u64, net: Net) -> World {
    let mut w = World::new(setup(seed, App::Echo, net), stream(seed, 4_096));
    w.client.hold_open = true;
    w.switch.forget_on_client_reset = true;
    for s in &mut w.servers {
        s.release_closed = true;
    }
    run_to_rx(&mut w, 4_096);
    w
}

/// After [`Client::reset_and_reconnect`] with 4 KiB: runs until the new
/// connection echoed them, then past the 5 s a moved tuple's late segments
/// are forwarded, and sends 4 KiB more (`stream(seed)`), until echoed or
/// the client fails (bounded in virtual time).
fn echo_past_gone_linger(w: &mut World, seed: u64) {
    let until = w.now + Duration::from_secs(20);
    w.run_until(until, |w| {
        w.client.received.len() >= 4_096 || w.client.error.is_some()
    });
    if w.client.received.len() >= 4_096 {
        w.run_for(Duration::from_secs(7));
        w.client.to_send.extend(stream(seed, 4_096));
        let until = w.now + Duration::from_secs(20);
        w.run_until(until, |w| {
            w.client.received.len() >= 8_192 || w.client.error.is_some()
        });
    }
}

fn run_reconnect(rc: &Reconnect) -> World {
    let mut w = reconnecting_world(rc.seed, Net::faulty(rc.tcp, rc.mig));
    if let Some(kind) = rc.lost {
        w.switch.drops.push(KindDrop {
            kind,
            after_switch: false,
            remaining: 1,
        });
    }
    w.migrate(rc.explicit).expect("migrate");
    w.run_for(Duration::from_micros(rc.reset_after_us));
    w.client.reset_and_reconnect(stream(rc.seed ^ 1, 4_096));
    echo_past_gone_linger(&mut w, rc.seed ^ 2);
    w
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(256),
        failure_persistence: Some(Box::new(proptest::test_runner::FileFailurePersistence::WithSource("regressions"))),
        ..ProptestConfig::default()
    })]

    /// A client that resets its connection at any moment of a migration of
    /// it and at once connects again from the same port (Linux allows it,
    /// load tools do it), with TCPMig messages lost, duplicated or
    /// reordered: the new connection works, byte-exact, past the time a
    /// moved tuple's late segments are forwarded, is served by the server
    /// the switch sends it to, and no server resets it.
    #[test]
    fn reconnecting_during_a_migration_never_strands_the_new_connection(
        seed in any::<u64>(),
        explicit in any::<bool>(),
        reset_after_us in 0u64..1_500,
        lost in prop_oneof![
            3 => Just(None),
            1 => Just(Some(Kind::Prepare)),
            1 => Just(Some(Kind::PrepareAck)),
            1 => Just(Some(Kind::ConnState)),
            1 => Just(Some(Kind::ConnStateAck)),
        ],
        mig in faults(0.3),
        // TCP segments lost only: the client's RST and its next SYN stay
        // in order (one path), and a duplicated RST after the new SYN
        // would end the new flow at the switch (the real one then places
        // it again by Maglev, this model does not).
        tcp_loss in prop_oneof![1 => Just(0.0), 2 => 0.0..0.02f64],
    ) {
        let tcp = Faults { loss: tcp_loss, ..Faults::NONE };
        let rc = Reconnect { seed, explicit, reset_after_us, lost, mig, tcp };
        let w = run_reconnect(&rc);
        prop_assert_eq!(w.client.error, None, "{:?}; {}", rc, w.describe());
        prop_assert!(
            w.client.received == w.client.to_send && w.client.to_send.len() == 8_192,
            "got {} of {} bytes; {:?}; {}",
            w.client.received.len(),
            w.client.to_send.len(),
            rc,
            w.describe()
        );
        prop_assert_eq!(w.switch.counters.resets_to_client, 0, "{:?}; {}", rc, w.describe());
        // Served where the switch sends it. (The old connection may live
        // on elsewhere, unreachable, when the client's RST was lost: as
        // with any TCP server, until it times out.)
        let flow = w.flow().expect("connected");
        let to = w.switch.owner(&flow).and_then(|a| SERVERS.iter().position(|&s| s == a));
        prop_assert!(
            to.is_some_and(|i| w.servers[i].owns(&flow)),
            "{:?}; {}",
            rc,
            w.describe()
        );
    }
}
