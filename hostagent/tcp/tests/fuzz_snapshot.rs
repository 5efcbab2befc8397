//! Stable-Rust fuzzing of connection snapshots (untrusted bytes): random,
//! mutated and truncated snapshots must never panic the parser or the
//! importer; whatever parses re-emits to the same bytes (the encoding is
//! canonical); a failed import leaves the endpoint untouched; and a
//! connection imported from a mutated snapshot survives random segments,
//! socket calls and timers (overflow checks are on in test builds).

mod common;

use std::net::Ipv4Addr;

use capybara_tcp::snapshot::{Snapshot, SnapshotError};
use capybara_tcp::{Duration, Endpoint, Instant, SeqNum, TcpConfig, TcpRepr};
use common::*;

/// Valid snapshots from live connections in assorted states.
fn corpus() -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    let link = LinkConfig {
        loss: 0.05,
        reorder: 0.2,
        ..LinkConfig::default()
    };
    let mut p = Pair::new(TcpConfig::default(), TcpConfig::default(), link, 5);
    let (c, s) = p.connect();
    let mut payload = vec![0u8; 300_000];
    Rng(1).fill(&mut payload);
    let mut sent = (0, 0);
    let mut k = 0u32;
    p.run_until(Duration::from_secs(3), |p| {
        sent.0 += p.client.send(c, &payload[sent.0..]).unwrap_or(0);
        sent.1 += p.server.send(s, &payload[sent.1..]).unwrap_or(0);
        k += 1;
        if k.is_multiple_of(7) {
            let _ = p.client.recv(c, &mut [0u8; 5000]);
        }
        if k.is_multiple_of(25) {
            for (_, conn) in p.server.connections().chain(p.client.connections()) {
                let snap = Snapshot::capture(conn, p.now, b"app-state");
                let mut b = vec![0u8; snap.buffer_len()];
                snap.emit(&mut b).unwrap();
                out.push(b);
            }
        }
        out.len() >= 40
    });
    p.client.shutdown(c).unwrap();
    p.server.shutdown(s).unwrap();
    for _ in 0..4 {
        p.step();
        for (_, conn) in p.server.connections().chain(p.client.connections()) {
            let snap = Snapshot::capture(conn, p.now, b"");
            let mut b = vec![0u8; snap.buffer_len()];
            snap.emit(&mut b).unwrap();
            out.push(b);
        }
    }
    out
}

fn mutate(rng: &mut Rng, b: &mut Vec<u8>) {
    for _ in 0..1 + rng.below(3) {
        if b.is_empty() {
            b.push(1);
        }
        let i = rng.below(b.len() as u64) as usize;
        match rng.below(8) {
            0 => b[i] ^= 1 << rng.below(8),
            1 => b[i] = rng.next_u64() as u8,
            2 => b[i] = 0xff,
            3 => b[i] = 0,
            4 => {
                b.remove(i);
            }
            5 => b.insert(i, rng.next_u64() as u8),
            6 => b.truncate(i),
            // Header fields: flags and state, where cross-field checks live.
            _ => {
                let j = 1 + rng.below(5.min(b.len() as u64 - 1).max(1)) as usize;
                if j < b.len() {
                    b[j] ^= 1 << rng.below(8);
                }
            }
        }
    }
}

/// Drives an imported connection with random peer segments, socket calls
/// and timers.
fn exercise(rng: &mut Rng, ep: &mut Endpoint, now: Instant) {
    let Some(id) = ep.accept() else { return };
    let c = ep.connection(id).unwrap().clone();
    let mut t = now;
    let mut buf = vec![0u8; 2000];
    for _ in 0..30 {
        t += Duration::from_millis(rng.below(3000));
        match rng.below(6) {
            0 | 1 => {
                let seq = c.rcv.nxt.add(rng.below(4000) as u32).sub(1000);
                let mut r = TcpRepr::new(c.remote.port(), c.local.port(), seq);
                r.ack = Some(c.snd.una.add(rng.below(4000) as u32).sub(500));
                r.window = rng.next_u64() as u16;
                r.fin = rng.chance(0.1);
                r.rst = rng.chance(0.03);
                if rng.chance(0.5) {
                    r.options.timestamp = Some((
                        c.ts.recent.wrapping_add(rng.below(100) as u32),
                        rng.next_u64() as u32,
                    ));
                }
                if rng.chance(0.3) {
                    let l = c.snd.una.add(rng.below(3000) as u32);
                    r.options.sack.push(l, l.add(rng.below(3000) as u32));
                }
                let data = [7u8; 700];
                r.payload = &data[..rng.below(700) as usize];
                let n = r
                    .emit(&mut buf, *c.remote.ip(), Ipv4Addr::new(10, 9, 9, 9))
                    .unwrap();
                ep.handle_segment(t, *c.remote.ip(), Ipv4Addr::new(10, 9, 9, 9), &buf[..n]);
            }
            2 => {
                let _ = ep.send(id, &[1u8; 3000][..rng.below(3000) as usize]);
                let _ = ep.recv(id, &mut [0u8; 4000]);
            }
            3 => match rng.below(4) {
                0 => {
                    let _ = ep.shutdown(id);
                }
                1 => {
                    let _ = ep.close(id);
                }
                2 => {
                    let _ = ep.abort(id);
                }
                _ => {}
            },
            _ => {
                if let Some(d) = ep.poll_timeout() {
                    t = t.max(d);
                    ep.handle_timeout(t);
                }
            }
        }
        let mut k = 0;
        while ep.poll_transmit(t, &mut buf).is_some() {
            k += 1;
            assert!(k < 10_000, "endpoint emits forever");
        }
        while ep.poll_event().is_some() {}
    }
}

fn check(rng: &mut Rng, bytes: &[u8], exercise_it: bool) {
    match Snapshot::parse_bytes(bytes) {
        Ok(snap) => {
            let mut again = vec![0u8; snap.buffer_len()];
            assert_eq!(snap.emit(&mut again).unwrap(), bytes.len());
            assert_eq!(again, bytes, "parse -> emit is not the identity");
            // The no-walk bound holds, and emitting into it (no sizing
            // walk) writes the same bytes; one byte short is an error.
            assert!(snap.buffer_len() <= snap.max_len());
            let mut roomy = vec![0u8; snap.max_len()];
            assert_eq!(snap.emit(&mut roomy).unwrap(), bytes.len());
            assert_eq!(&roomy[..bytes.len()], bytes);
            assert!(matches!(
                snap.emit(&mut again[..bytes.len() - 1]),
                Err(SnapshotError::BufferTooSmall { .. })
            ));
            // Equality sees the same state whichever bytes back it.
            assert_eq!(Snapshot::parse_bytes(&roomy[..bytes.len()]).unwrap(), snap);
        }
        Err(e) => {
            let _ = e.to_string();
        }
    }
    let cfg = TcpConfig {
        rx_buffer: 64 * 1024 + rng.below(256 * 1024) as usize,
        ..TcpConfig::default()
    };
    let mut ep = Endpoint::new(cfg);
    let now = Instant::from_micros(rng.below(1 << 40));
    match ep.import(now, bytes) {
        Ok(imp) => {
            assert!(imp.app_state.end <= bytes.len());
            // Re-export at the same instant (straight from the connection
            // into the buffer) reproduces the snapshot, unless the timed
            // segment's age was clamped at this host's clock zero.
            let snap = Snapshot::parse_bytes(bytes).unwrap();
            let clamped = snap
                .rtt_timed
                .is_some_and(|(_, age)| age.as_micros() as u64 > now.as_micros());
            let app = &bytes[imp.app_state.clone()];
            let mut out = vec![0u8; bytes.len() + 64];
            let n = ep.export(now, imp.id, app, &mut out).unwrap();
            if !clamped {
                assert_eq!(&out[..n], bytes, "import -> export is not the identity");
            }
            let imp = ep.import(now, &out[..n]).expect("our own export imports");
            assert_eq!(ep.connection_count(), 1);
            let _ = imp;
            if exercise_it {
                exercise(rng, &mut ep, now);
            }
        }
        Err(e) => {
            // Import and `Snapshot::parse_bytes` share one parser: what
            // parses imports unless it does not fit this endpoint's buffers.
            if Snapshot::parse_bytes(bytes).is_ok() {
                assert!(
                    matches!(e, SnapshotError::QueueTooLarge { .. }),
                    "parses but does not import: {e}"
                );
            }
            assert_eq!(
                ep.connection_count(),
                0,
                "a failed import left a connection behind"
            );
            assert_eq!(ep.poll_event(), None);
            assert_eq!(ep.poll_timeout(), None);
        }
    }
}

#[test]
fn truncated_snapshots_are_rejected() {
    let corpus = corpus();
    assert!(corpus.len() >= 40);
    let mut rng = Rng(11);
    for snap in corpus.iter().step_by(3) {
        assert!(Snapshot::parse_bytes(snap).is_ok());
        for n in 0..snap.len().min(400) {
            assert!(
                Snapshot::parse_bytes(&snap[..n]).is_err(),
                "prefix {n} of {} parsed",
                snap.len()
            );
        }
        check(&mut rng, snap, true);
    }
}

#[test]
fn random_and_mutated_snapshots_never_panic() {
    let corpus = corpus();
    let mut rng = Rng(42);
    let mut imported = 0;
    for i in 0..30_000 {
        let mut b = if i % 10 == 0 {
            let mut v = vec![0u8; rng.below(200) as usize];
            rng.fill(&mut v);
            if !v.is_empty() {
                v[0] = 1;
            }
            v
        } else {
            corpus[rng.below(corpus.len() as u64) as usize].clone()
        };
        mutate(&mut rng, &mut b);
        if Snapshot::parse_bytes(&b).is_ok() {
            imported += 1;
        }
        check(&mut rng, &b, i % 4 == 0);
    }
    // The mutations must not all be trivially rejected.
    assert!(imported > 1500, "only {imported} mutated snapshots parsed");
    let _ = SeqNum(0);
}
