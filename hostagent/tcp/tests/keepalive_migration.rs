//! A migrated connection keeps the keep-alive its origin gave it, whatever
//! the target's own `TcpConfig::keepalive` (the snapshot carries idle,
//! interval, probes, the running timer and the probes already sent): a
//! hostagent's `[tcp]` keep-alive settings apply to the connections it
//! accepts itself, and a migration neither switches keep-alive off nor
//! restarts it (docs/HOSTAGENT.md, "Keep-alive").
//!
//! Run: `cargo test --release -p capybara-tcp --test keepalive_migration`.

mod common;

use capybara_tcp::{Duration, Endpoint, KeepAlive, State, TcpConfig, TcpError};
use common::*;

const KA: KeepAlive = KeepAlive {
    idle: Duration::from_secs(10),
    interval: Duration::from_secs(2),
    probes: 3,
};

/// Moves server connection `s` to a fresh endpoint built with `target_cfg`
/// (as `Pair::migrate`, which reuses the origin's config); returns its id
/// there.
fn migrate_to(
    p: &mut Pair,
    s: capybara_tcp::ConnId,
    target_cfg: TcpConfig,
) -> capybara_tcp::ConnId {
    let mut snap = Vec::new();
    p.server
        .export_to_vec(p.srv_now(), s, &[], &mut snap)
        .expect("export");
    let mut target = Endpoint::new(target_cfg);
    target.listen(vip()).unwrap();
    p.server_clock = 5_000_000_000;
    let imported = target.import(p.srv_now(), &snap).expect("import");
    assert_eq!(target.accept(), Some(imported.id));
    let origin = std::mem::replace(&mut p.server, target);
    p.retired.push(origin);
    imported.id
}

/// Runs until the server's connection `s` closes; how long it took.
fn time_to_close(p: &mut Pair, s: capybara_tcp::ConnId) -> Duration {
    let start = p.now;
    assert!(
        p.run_until(Duration::from_secs(120), |p| p.server.state(s)
            == Some(State::Closed)),
        "the dead peer's connection never closed"
    );
    p.now - start
}

#[test]
fn target_without_keepalive_keeps_the_origins() {
    let origin = TcpConfig {
        keepalive: Some(KA),
        ..TcpConfig::default()
    };
    let mut p = Pair::new(TcpConfig::default(), origin, LinkConfig::default(), 3);
    let (_c, s) = p.connect();
    // Idle 4 s on the origin, then moved to a target whose own config has
    // keep-alive off.
    p.run_until(Duration::from_secs(4), |_| false);
    let s2 = migrate_to(&mut p, s, TcpConfig::default());
    assert_eq!(
        p.server.connection(s2).unwrap().params.keepalive,
        Some(KA),
        "the origin's keep-alive travels with the connection"
    );
    // The peer answers: probes on the target keep the connection up.
    assert!(!p.run_until(Duration::from_secs(40), |p| p.server.state(s2)
        != Some(State::Established)));
    assert!(p.server.counters().keepalive_probes >= 2);
    // The peer vanishes: the target drops it within idle + probes x interval.
    p.drop_filter = Some(Box::new(|_, _| true));
    let took = time_to_close(&mut p, s2);
    assert!(took <= KA.idle + KA.interval * KA.probes, "{took:?}");
    let mut buf = [0u8; 4];
    assert_eq!(p.server.recv(s2, &mut buf), Err(TcpError::TimedOut));
    assert_eq!(p.server.counters().connections_timed_out, 1);
}

#[test]
fn target_with_other_keepalive_keeps_the_origins_timer() {
    let origin = TcpConfig {
        keepalive: Some(KA),
        ..TcpConfig::default()
    };
    let mut p = Pair::new(TcpConfig::default(), origin, LinkConfig::default(), 4);
    let (_c, s) = p.connect();
    // The peer is already gone; the origin's idle timer runs 6 s of its
    // 10 before the migration.
    p.drop_filter = Some(Box::new(|_, _| true));
    let start = p.now;
    p.run_until(Duration::from_secs(6), |_| false);
    let target = TcpConfig {
        keepalive: Some(KeepAlive {
            idle: Duration::from_secs(3600),
            interval: Duration::from_secs(60),
            probes: 9,
        }),
        ..TcpConfig::default()
    };
    let s2 = migrate_to(&mut p, s, target);
    assert_eq!(p.server.connection(s2).unwrap().params.keepalive, Some(KA));
    time_to_close(&mut p, s2);
    // The remaining 4 s of idle, then 3 probes 2 s apart: 16 s from the
    // last activity, as if it had never moved (not 3600 s, nor a fresh 10).
    let took = p.now - start;
    assert!(
        took >= KA.idle + KA.interval * (KA.probes - 1)
            && took <= KA.idle + KA.interval * KA.probes,
        "{took:?}"
    );
}
