//! Connection snapshot round trips: export -> import on a fresh endpoint
//! gives a field-by-field equal connection (re-based fields compared after
//! re-basing), and the migrated connection continues the byte stream with
//! the unaware peer: no reset, byte-exact data, TSval never going back.
//! Every TCP state, data in both queues, out-of-order and unacked data,
//! FIN sent and received.

mod common;

use std::net::SocketAddrV4;

use capybara_tcp::snapshot::{Snapshot, SnapshotError};
use capybara_tcp::{
    CloseReason, ConnId, Connection, Duration, Endpoint, Instant, State, TcpConfig, TcpError,
};
use common::*;

fn data(n: usize, seed: u64) -> Vec<u8> {
    let mut v = vec![0u8; n];
    Rng(seed).fill(&mut v);
    v
}

fn tsval(c: &Connection, now: Instant) -> u32 {
    ((now.as_micros() / 1000) as u32).wrapping_add(c.ts.offset)
}

/// Out-of-order bytes of the receive queue, per interval (`==` on a ring
/// compares only readable bytes).
fn ooo_bytes(c: &Connection) -> Vec<Vec<u8>> {
    c.ooo
        .ranges()
        .iter()
        .map(|&(s, e)| {
            let (a, b) = c.rx.slices(c.rx.len() + s as usize, (e - s) as usize);
            [a, b].concat()
        })
        .collect()
}

/// `before` (exported at `t_exp` on the origin's clock) as it must look
/// after import at `t_imp` on the target's clock.
fn rebased(before: &Connection, t_exp: Instant, t_imp: Instant) -> Connection {
    let mut want = before.clone();
    let shift = |t: Option<Instant>| t.map(|t| t_imp + t.saturating_since(t_exp));
    let t = &mut want.timers;
    t.retransmit = shift(t.retransmit);
    t.persist = shift(t.persist);
    t.delayed_ack = shift(t.delayed_ack);
    t.keepalive = shift(t.keepalive);
    t.close = shift(t.close);
    want.rtt.timed = want.rtt.timed.map(|(end, sent)| {
        let age = t_exp.saturating_since(sent).as_micros() as u64;
        (
            end,
            Instant::from_micros(t_imp.as_micros().saturating_sub(age)),
        )
    });
    // TSval continues from the exported one.
    let ms = (t_imp.as_micros() / 1000) as u32;
    want.ts.offset = tsval(before, t_exp).wrapping_sub(ms);
    want
}

/// The import equals the export after re-basing, and re-exporting the
/// imported connection reproduces the snapshot byte for byte.
#[track_caller]
fn check_round_trip(
    before: &Connection,
    t_exp: Instant,
    after: &Connection,
    t_imp: Instant,
    snap: &[u8],
    app: &[u8],
) {
    assert_eq!(
        after,
        &rebased(before, t_exp, t_imp),
        "imported connection differs"
    );
    assert_eq!(
        ooo_bytes(after),
        ooo_bytes(before),
        "out-of-order bytes differ"
    );
    assert_eq!(
        tsval(after, t_imp),
        tsval(before, t_exp),
        "TSval must continue from the exported one"
    );
    let again = Snapshot::capture(after, t_imp, app);
    let mut buf = vec![0u8; again.buffer_len()];
    again.emit(&mut buf).unwrap();
    assert_eq!(buf, snap, "re-export differs from the original snapshot");
    // The parsed snapshot (queue bytes in the wire buffer) equals the
    // captured ones (queue bytes in the rings), out-of-order bytes included.
    let parsed = Snapshot::parse_bytes(snap).unwrap();
    assert_eq!(parsed, Snapshot::capture(before, t_exp, app));
    assert_eq!(parsed, again);
    for i in 0..parsed.ooo.ranges().len() {
        let (w, r) = (parsed.ooo_chunk(i), again.ooo_chunk(i));
        assert_eq!([w.0, w.1].concat(), [r.0, r.1].concat(), "ooo range {i}");
    }
    assert!(parsed.buffer_len() <= parsed.max_len());
    assert!(matches!(
        parsed.emit(&mut buf[..snap.len() - 1]),
        Err(SnapshotError::BufferTooSmall { .. })
    ));
}

/// Migrates server connection `s` with a random app blob to a target whose
/// clock differs; checks the round trip; returns the new id.
fn migrate_checked(p: &mut Pair, s: ConnId, seed: u64) -> ConnId {
    let before = p
        .server
        .connection(s)
        .expect("connection to migrate")
        .clone();
    let t_exp = p.srv_now();
    let app = data((seed % 300) as usize, seed);
    // Alternate target clocks ahead of and behind the origin's.
    let target_clock = if seed.is_multiple_of(2) {
        5_000_000_000 + seed * 1_234
    } else {
        seed * 7
    };
    let (id, snap, got_app) = p.migrate(s, &app, target_clock);
    assert_eq!(got_app, app, "application state travels intact");
    let after = p.server.connection(id).unwrap();
    check_round_trip(&before, t_exp, after, p.srv_now(), &snap, &app);
    id
}

fn short_time_wait() -> TcpConfig {
    TcpConfig {
        time_wait: Duration::from_secs(2),
        ..TcpConfig::default()
    }
}

fn pair() -> Pair {
    let mut p = Pair::new(
        TcpConfig::default(),
        short_time_wait(),
        LinkConfig::default(),
        3,
    );
    p.server_clock = 777_000_123;
    p
}

fn server_conn_in(p: &Pair, state: State) -> Option<ConnId> {
    p.server
        .connections()
        .find(|(_, c)| c.state == state)
        .map(|(id, _)| id)
}

/// Reads everything the endpoint has for `id` (until WouldBlock or EOF).
fn drain(ep: &mut Endpoint, id: ConnId, out: &mut Vec<u8>) -> bool {
    let mut buf = [0u8; 8192];
    loop {
        match ep.recv(id, &mut buf) {
            Ok(0) => return true,
            Ok(n) => out.extend_from_slice(&buf[..n]),
            Err(_) => return false,
        }
    }
}

#[track_caller]
fn assert_no_resets(p: &Pair) {
    assert_eq!(p.client.counters().resets_received, 0, "client saw a RST");
    assert_eq!(p.client.counters().resets_sent, 0, "client sent a RST");
    assert_eq!(p.server.counters().resets_sent, 0, "target sent a RST");
}

#[test]
fn syn_sent_round_trips_and_completes() {
    let mut p = pair();
    let c = p
        .client
        .connect(p.now, SocketAddrV4::new(CLIENT_IP, 0), vip())
        .unwrap();
    p.drive_transmit(); // SYN on the wire
    let before = p.client.connection(c).unwrap().clone();
    assert_eq!(before.state, State::SynSent);
    let mut snap = vec![0u8; 256];
    let n = p.client.export(p.now, c, b"", &mut snap).unwrap();
    snap.truncate(n);
    let mut target = Endpoint::new(TcpConfig::default());
    let imp = target.import(p.now, &snap).unwrap();
    check_round_trip(
        &before,
        p.now,
        target.connection(imp.id).unwrap(),
        p.now,
        &snap,
        b"",
    );
    p.client = target;
    let c = p.client.accept().unwrap();
    let mut s = None;
    assert!(p.run_until(Duration::from_secs(5), |p| {
        s = s.or_else(|| p.server.accept());
        s.is_some() && p.client.state(c) == Some(State::Established)
    }));
    let d = data(50_000, 1);
    assert_same(
        &transfer(&mut p, c, s.unwrap(), &d, true, Duration::from_secs(10)),
        &d,
        "after import",
    );
}

#[test]
fn syn_received_round_trips_and_completes() {
    let mut p = pair();
    let c = p
        .client
        .connect(p.now, SocketAddrV4::new(CLIENT_IP, 0), vip())
        .unwrap();
    assert!(p.run_until(Duration::from_secs(1), |p| server_conn_in(
        p,
        State::SynReceived
    )
    .is_some()));
    let s = server_conn_in(&p, State::SynReceived).unwrap();
    let s = migrate_checked(&mut p, s, 2);
    assert!(p.run_until(Duration::from_secs(5), |p| p.client.state(c)
        == Some(State::Established)
        && p.server.state(s) == Some(State::Established)));
    let d = data(100_000, 2);
    assert_same(
        &transfer(&mut p, c, s, &d, true, Duration::from_secs(10)),
        &d,
        "to server",
    );
    assert_same(
        &transfer(&mut p, c, s, &d, false, Duration::from_secs(10)),
        &d,
        "to client",
    );
    assert_no_resets(&p);
}

#[test]
fn established_with_both_queues_round_trips_and_continues() {
    let mut p = pair();
    let (c, s) = p.connect();
    // Data queued both ways: the server does not read, and its send queue
    // holds unsent and unacknowledged bytes (migrate while segments fly).
    let up = data(30_000, 3);
    let down = data(200_000, 4);
    p.client.send(c, &up).unwrap();
    let sent = p.server.send(s, &down).unwrap();
    for _ in 0..3 {
        p.step();
    }
    let conn = p.server.connection(s).unwrap();
    assert!(!conn.rx.is_empty() && conn.unacked() > 0 && conn.tx.len() > conn.unacked() as usize);
    let s = migrate_checked(&mut p, s, 4);
    let mut got_up = Vec::new();
    let mut got_down = Vec::new();
    let mut sent = sent;
    assert!(p.run_until(Duration::from_secs(20), |p| {
        if sent < down.len() {
            sent += p.server.send(s, &down[sent..]).unwrap_or(0);
        }
        drain(&mut p.server, s, &mut got_up);
        drain(&mut p.client, c, &mut got_down);
        got_up.len() == up.len() && got_down.len() == down.len()
    }));
    assert_same(&got_up, &up, "client -> server");
    assert_same(&got_down, &down, "server -> client");
    assert_no_resets(&p);
}

/// The origin closes: FIN-WAIT-1 (FIN in flight), FIN-WAIT-2, TIME-WAIT.
#[test]
fn active_close_states_round_trip() {
    for (step, want) in [
        (0, State::FinWait1),
        (1, State::FinWait2),
        (2, State::TimeWait),
    ] {
        let mut p = pair();
        let (c, s) = p.connect();
        let tail = data(5_000, 5);
        p.server.send(s, &tail).unwrap();
        p.server.shutdown(s).unwrap();
        p.drive_transmit();
        if step >= 1 {
            assert!(p.run_until(Duration::from_secs(5), |p| p.server.state(s)
                == Some(State::FinWait2)));
        }
        if step >= 2 {
            p.client.shutdown(c).unwrap();
            assert!(p.run_until(Duration::from_secs(5), |p| p.server.state(s)
                == Some(State::TimeWait)));
        }
        assert_eq!(p.server.state(s), Some(want));
        let s = migrate_checked(&mut p, s, 10 + step);
        let mut got = Vec::new();
        let mut shut = step >= 2;
        assert!(
            p.run_until(Duration::from_secs(10), |p| {
                let eof = drain(&mut p.client, c, &mut got);
                if eof && !shut {
                    p.client.shutdown(c).unwrap();
                    shut = true;
                }
                p.client.state(c) == Some(State::Closed) && p.server.state(s) == Some(State::Closed)
            }),
            "{want:?}: server {:?} client {:?}",
            p.server.state(s),
            p.client.state(c)
        );
        assert_same(&got, &tail, "data before FIN");
        assert_eq!(
            p.server.connection(s).unwrap().close_reason,
            Some(CloseReason::Normal)
        );
        assert_no_resets(&p);
    }
}

/// The peer closes first: CLOSE-WAIT (FIN received), LAST-ACK, and the
/// simultaneous close through CLOSING.
#[test]
fn passive_and_simultaneous_close_states_round_trip() {
    for want in [State::CloseWait, State::LastAck, State::Closing] {
        let mut p = pair();
        let (c, s) = p.connect();
        let up = data(3_000, 6);
        p.client.send(c, &up).unwrap();
        if want == State::Closing {
            p.client.shutdown(c).unwrap();
            p.server.shutdown(s).unwrap();
            assert!(p.run_until(Duration::from_secs(5), |p| p.server.state(s)
                == Some(State::Closing)));
        } else {
            p.client.shutdown(c).unwrap();
            assert!(p.run_until(Duration::from_secs(5), |p| p.server.state(s)
                == Some(State::CloseWait)));
            if want == State::LastAck {
                p.server.shutdown(s).unwrap();
                p.drive_transmit();
            }
        }
        assert_eq!(p.server.state(s), Some(want));
        let s = migrate_checked(&mut p, s, 20);
        let mut got = Vec::new();
        assert!(
            p.run_until(Duration::from_secs(10), |p| {
                let eof = drain(&mut p.server, s, &mut got);
                if eof && p.server.state(s) == Some(State::CloseWait) {
                    p.server.shutdown(s).unwrap();
                }
                drain(&mut p.client, c, &mut Vec::new());
                p.client.state(c) == Some(State::Closed) && p.server.state(s) == Some(State::Closed)
            }),
            "{want:?}: server {:?} client {:?}",
            p.server.state(s),
            p.client.state(c)
        );
        assert_same(&got, &up, "data before the peer's FIN");
        assert_no_resets(&p);
    }
}

#[test]
fn closed_connection_round_trips_with_its_error() {
    let mut p = pair();
    let (c, s) = p.connect();
    p.client.abort(c).unwrap();
    assert!(p.run_until(Duration::from_secs(1), |p| p.server.state(s)
        == Some(State::Closed)));
    let s = migrate_checked(&mut p, s, 30);
    assert_eq!(p.server.recv(s, &mut [0u8; 10]), Err(TcpError::Reset));
}

/// The transfer of the title: both directions at once, a lossy and
/// reordering link (out-of-order data, retransmissions, SACK recovery in
/// progress), the application reading slowly, and a migration to a new host
/// every few hundred virtual milliseconds, ending with FINs both ways.
#[test]
fn repeated_migration_mid_transfer_is_invisible_to_the_peer() {
    let link = LinkConfig {
        loss: 0.02,
        reorder: 0.1,
        duplicate: 0.01,
        ..LinkConfig::default()
    };
    let mut p = Pair::new(TcpConfig::default(), short_time_wait(), link, 9);
    p.server_clock = 123_456_789;
    let (c, mut s) = p.connect();
    let up = data(1 << 20, 7);
    let down = data(1 << 20, 8);
    let (mut sent_up, mut sent_down) = (0, 0);
    let (mut got_up, mut got_down) = (Vec::new(), Vec::new());
    let mut migrations = 0u64;
    let mut saw = (false, false, false); // ooo, unacked, rx queue at a migration
    let mut last_ts_recent = None::<u32>;
    let mut next_migration = p.now + Duration::from_millis(150);
    let mut slow = 0u32;
    let mut fin = (false, false);
    let done = p.run_until(Duration::from_secs(120), |p| {
        if sent_up < up.len() {
            sent_up += p.client.send(c, &up[sent_up..]).unwrap_or(0);
        } else if !fin.0 {
            p.client.shutdown(c).unwrap();
            fin.0 = true;
        }
        if sent_down < down.len() {
            sent_down += p.server.send(s, &down[sent_down..]).unwrap_or(0);
        } else if !fin.1 {
            p.server.shutdown(s).unwrap();
            fin.1 = true;
        }
        slow += 1;
        if slow.is_multiple_of(3) {
            drain(&mut p.server, s, &mut got_up);
        }
        drain(&mut p.client, c, &mut got_down);
        // PAWS at the client would drop the target's segments if TSval went back.
        if let Some(cc) = p.client.connection(c) {
            if let Some(prev) = last_ts_recent {
                assert!(
                    cc.ts.recent.wrapping_sub(prev) as i32 >= 0,
                    "client TS.Recent went backwards"
                );
            }
            last_ts_recent = Some(cc.ts.recent);
        }
        if p.now >= next_migration
            && p.server
                .connection(s)
                .is_some_and(|x| x.state != State::Closed)
        {
            let x = p.server.connection(s).unwrap();
            saw.0 |= !x.ooo.is_empty();
            saw.1 |= x.unacked() > 0;
            saw.2 |= !x.rx.is_empty();
            migrations += 1;
            s = migrate_checked(p, s, 100 + migrations);
            next_migration = p.now + Duration::from_millis(100 + 37 * (migrations % 5));
        }
        got_up.len() == up.len()
            && got_down.len() == down.len()
            && p.client.state(c) == Some(State::Closed)
            && p.server.state(s) == Some(State::Closed)
    });
    assert!(
        done,
        "stalled: up {}/{} down {}/{} client {:?} server {:?}",
        got_up.len(),
        up.len(),
        got_down.len(),
        down.len(),
        p.client.state(c),
        p.server.state(s)
    );
    assert_same(&got_up, &up, "client -> server");
    assert_same(&got_down, &down, "server -> client");
    assert!(migrations >= 5, "only {migrations} migrations");
    assert!(
        saw.0 && saw.1 && saw.2,
        "migrations should have caught ooo/unacked/queued data: {saw:?}"
    );
    assert_eq!(p.client.counters().resets_received, 0);
    assert_eq!(p.server.counters().resets_sent, 0);
    assert!(p.retired.iter().all(|e| e.counters().resets_sent == 0));
}

#[test]
fn empty_established_snapshot_is_small() {
    let mut p = pair();
    let (_, s) = p.connect();
    let n = p.server.snapshot_len(p.srv_now(), s, 0).unwrap();
    let mut buf = [0u8; 512];
    let m = p.server.export(p.srv_now(), s, &[], &mut buf).unwrap();
    assert_eq!(n, m);
    eprintln!("empty established snapshot: {m} bytes");
    // Version 2: fixed-width fields (docs/SNAPSHOT.md, "Size"): 177 bytes
    // plus 8 per armed timer; still far below one packet.
    assert!(
        (177..=177 + 5 * 8).contains(&m) && (m - 177).is_multiple_of(8),
        "empty established snapshot is {m} bytes"
    );
}

/// A standby's pre-warmed import pool: imports take its entries (and the
/// connection continues byte-exact); the pool never exceeds its limit.
#[test]
fn imports_take_prewarmed_pool_entries() {
    let mut p = pair();
    let (c, s) = p.connect();
    p.server.send(s, &data(5_000, 3)).unwrap();
    p.drive_transmit();
    let mut snap = vec![0u8; 64 * 1024];
    let n = p.server.export(p.srv_now(), s, b"", &mut snap).unwrap();
    snap.truncate(n);
    let mut target = Endpoint::new(TcpConfig::default());
    assert_eq!(target.spare_buffers(), (16, 0), "empty until pre-warmed");
    target.prewarm_spare_buffers(100);
    assert_eq!(target.spare_buffers(), (16, 16), "capped at the limit");
    let imp = target.import(p.now, &snap).unwrap();
    assert_eq!(target.spare_buffers(), (16, 15), "a pooled entry was used");
    assert_eq!(target.connection(imp.id).unwrap().state, State::Established);
    assert!(p.client.connection(c).is_some());
    target.set_spare_buffers(4);
    assert_eq!(target.spare_buffers(), (4, 4));
}

#[test]
fn import_errors_leave_the_endpoint_untouched() {
    let mut p = pair();
    let (c, s) = p.connect();
    p.server.send(s, &data(10_000, 1)).unwrap();
    // Too small a buffer: typed error, connection still there.
    let mut small = [0u8; 40];
    assert!(matches!(
        p.server.export(p.srv_now(), s, b"", &mut small),
        Err(SnapshotError::BufferTooSmall { .. })
    ));
    assert!(p.server.connection(s).is_some());
    assert_eq!(
        p.server.export(p.srv_now(), ConnId(999), b"", &mut small),
        Err(SnapshotError::InvalidHandle)
    );
    let mut snap = Vec::new();
    p.server
        .export_to_vec(p.srv_now(), s, b"app", &mut snap)
        .unwrap();

    // A target with smaller buffers refuses; a duplicate flow is refused.
    let mut tiny = Endpoint::new(TcpConfig {
        tx_buffer: 4096,
        ..TcpConfig::default()
    });
    assert!(matches!(
        tiny.import(Instant::ZERO, &snap),
        Err(SnapshotError::QueueTooLarge {
            field: "tx.len",
            ..
        })
    ));
    assert_eq!(tiny.connection_count(), 0);
    let mut target = Endpoint::new(TcpConfig::default());
    target.import(Instant::ZERO, &snap).unwrap();
    assert_eq!(
        target.import(Instant::ZERO, &snap),
        Err(SnapshotError::FlowExists)
    );
    assert_eq!(target.connection_count(), 1);

    // Truncation, version, trailing bytes.
    let mut fresh = Endpoint::new(TcpConfig::default());
    assert_eq!(
        fresh.import(Instant::ZERO, &snap[..snap.len() - 1]),
        Err(SnapshotError::Truncated("app.bytes"))
    );
    assert_eq!(
        fresh.import(Instant::ZERO, &snap[..10]),
        Err(SnapshotError::Truncated("header"))
    );
    // Version 2 reads only version 2: version 1 (varints) and 3 are refused.
    for v in [1, 3] {
        let mut other = snap.clone();
        other[0] = v;
        assert_eq!(
            fresh.import(Instant::ZERO, &other),
            Err(SnapshotError::Version(v))
        );
    }
    let mut long = snap.clone();
    long.push(0);
    assert_eq!(
        fresh.import(Instant::ZERO, &long),
        Err(SnapshotError::Trailing(1))
    );
    let mut bad_state = snap.clone();
    bad_state[1] = 0x0c;
    assert_eq!(
        fresh.import(Instant::ZERO, &bad_state),
        Err(SnapshotError::Invalid {
            field: "state",
            why: "unknown state"
        })
    );
    assert_eq!(fresh.connection_count(), 0);
    assert_eq!(fresh.poll_timeout(), None);

    // An import parses straight into a pooled entry: one that failed late
    // (every field but the last written, from another connection with
    // unread data) goes back to the pool half written, and the next
    // import into it still overwrites every field.
    let mut other = Vec::new();
    p.client.send(c, b"unsent").unwrap();
    p.client
        .export_to_vec(p.now, c, b"other app", &mut other)
        .unwrap();
    let mut reused = Endpoint::new(TcpConfig::default());
    assert_eq!(
        reused.import(Instant::ZERO, &other[..other.len() - 1]),
        Err(SnapshotError::Truncated("app.bytes"))
    );
    let id = reused.import(Instant::ZERO, &snap).unwrap().id;
    let mut clean = Endpoint::new(TcpConfig::default());
    let cid = clean.import(Instant::ZERO, &snap).unwrap().id;
    assert_eq!(reused.connection(id), clean.connection(cid));
    assert_eq!(reused.poll_timeout(), clean.poll_timeout());
}

#[test]
fn metrics_iterators_report_packets_and_queues() {
    let mut p = pair();
    let (c, s) = p.connect();
    p.client.send(c, &data(5000, 1)).unwrap();
    assert!(p.run_until(Duration::from_secs(1), |p| p
        .server
        .load(s)
        .unwrap()
        .recv_queue
        == 5000));
    let loads: Vec<_> = p.server.loads().collect();
    assert_eq!(loads.len(), 1);
    let l = loads[0];
    assert_eq!(
        (l.id, l.recv_queue, l.send_queue, l.owned),
        (s, 5000, 0, true)
    );
    assert!(l.segments_in >= 5 && l.segments_out >= 2, "{l:?}");
    let infos: Vec<_> = p.server.infos().collect();
    assert_eq!(infos, vec![(s, p.server.info(s).unwrap())]);
}
