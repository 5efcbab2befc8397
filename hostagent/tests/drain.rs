//! The drain (`hostagent/src/drain.rs`) on the deterministic four-party
//! harness (`common`): it moves what the server serves, reports it, retries
//! a migration the target refuses, and stops at its deadline saying what
//! remains. The client's stream stays byte-exact either way.
//!
//! Run: `cargo test -p capybara-hostagent --test drain`.

mod common;

use capybara_proto::time::{Duration, Instant};
use common::*;

const LIMIT: Instant = Instant::from_millis(120_000);

/// Drives server 0's drain (as the stack's poll does) in 100 µs steps of
/// virtual time until it is no longer active or `limit` passes.
fn drive_drain(w: &mut World, limit: Instant) -> bool {
    while w.now < limit {
        let now = w.now;
        let s = &mut w.servers[0];
        let m = s.tr.mig.as_mut().expect("servers migrate");
        s.tr.drain.poll(now, m);
        if !s.tr.drain.active() {
            return true;
        }
        w.run_for(Duration::from_micros(100));
    }
    false
}

fn start_drain(w: &mut World, deadline: Duration) -> usize {
    let now = w.now;
    let s = &mut w.servers[0];
    let m = s.tr.mig.as_mut().expect("servers migrate");
    m.engine.set_draining(true);
    s.tr.drain.start(now, deadline, m)
}

fn assert_stream_exact(w: &World) {
    assert_eq!(w.client.error, None, "{}", w.describe());
    assert!(
        w.client.received == w.client.to_send,
        "echo differs: got {} of {} bytes; {}",
        w.client.received.len(),
        w.client.to_send.len(),
        w.describe()
    );
    assert_eq!(w.switch.counters.resets_to_client, 0, "{}", w.describe());
}

#[test]
fn drain_moves_the_connection_and_reports_it() {
    let setup = Setup {
        seed: 21,
        app: App::Echo,
        net: Net::clean(),
    };
    let mut w = World::new(setup, stream(21, 300_000));
    assert!(w.run_until(LIMIT, |w| w.client.received.len() >= 50_000));
    assert_eq!(start_drain(&mut w, Duration::from_secs(2)), 1);
    // A repeated DRAIN (the switch resends until a heartbeat shows it)
    // queues nothing more.
    assert_eq!(start_drain(&mut w, Duration::from_secs(2)), 0);
    let until = w.now + Duration::from_secs(3);
    assert!(drive_drain(&mut w, until), "{}", w.describe());
    let p = w.servers[0].tr.drain.progress();
    assert!(!p.active);
    assert_eq!(
        (p.total, p.migrated, p.lost, p.remaining),
        (1, 1, 0, 0),
        "{p:?}"
    );
    assert!(w.finish(LIMIT), "{}", w.describe());
    assert_stream_exact(&w);
    w.assert_single_owner();
    assert_eq!(w.owners(), vec![1], "{}", w.describe());
}

#[test]
fn drain_retries_a_refused_migration_until_its_deadline() {
    let setup = Setup {
        seed: 22,
        app: App::Echo,
        net: Net::clean(),
    };
    let mut w = World::new(setup, stream(22, 300_000));
    // The only other server drains too: it refuses every PREPARE.
    w.servers[1].migrator_mut().engine.set_draining(true);
    assert!(w.run_until(LIMIT, |w| w.client.received.len() >= 50_000));
    let started = w.now;
    assert_eq!(start_drain(&mut w, Duration::from_millis(300)), 1);
    let until = w.now + Duration::from_secs(2);
    assert!(drive_drain(&mut w, until), "{}", w.describe());
    let ended = w.now;
    assert!(
        ended >= started + Duration::from_millis(300)
            && ended < started + Duration::from_millis(400),
        "the drain ends at its deadline: {started} -> {ended}"
    );
    let p = w.servers[0].tr.drain.progress();
    assert_eq!((p.total, p.migrated, p.remaining), (1, 0, 1), "{p:?}");
    assert!(p.retries >= 3, "retried with backoff: {p:?}");
    // The origin kept serving the whole time.
    assert!(w.finish(LIMIT), "{}", w.describe());
    assert_stream_exact(&w);
    assert_eq!(w.owners(), vec![0], "{}", w.describe());
}
