//! Stable-Rust fuzzing of the segment handler: random sequences of API calls,
//! link impairments and mutated/forged segments against two endpoints. No
//! panic, and the TCB invariants hold after every step.

mod common;

use std::net::SocketAddrV4;

use capybara_proto::checksum;
use capybara_tcp::{Duration, Endpoint, State, TcpConfig};
use common::*;

fn check_invariants(ep: &Endpoint) {
    // No deadline is missed: the timer heap's top (the endpoint's wake-up)
    // is no later than any connection's earliest deadline (it may be
    // earlier: a postponed deadline's armed entry).
    if let Some(d) = ep
        .connections()
        .filter_map(|(_, c)| c.next_deadline())
        .min()
    {
        assert!(
            ep.poll_timeout().is_some_and(|t| t <= d),
            "wake-up {:?} after the earliest deadline {d:?}",
            ep.poll_timeout()
        );
    }
    for (id, c) in ep.connections() {
        let ctx = || format!("{id:?} {:?}", c.state);
        assert!(c.snd.una <= c.snd.nxt, "una <= nxt: {}", ctx());
        assert!(c.snd.nxt <= c.snd.max, "nxt <= max: {}", ctx());
        // Everything sent and unacked is in the send queue (+ SYN/FIN).
        assert!(
            c.snd.max.since(c.snd.una) as usize <= c.tx.len() + 2,
            "flight: {}",
            ctx()
        );
        assert!(
            c.rx.len() <= c.rx.capacity() && c.tx.len() <= c.tx.capacity(),
            "{}",
            ctx()
        );
        for &(s, e) in c.ooo.ranges() {
            assert!(
                0 < s && s < e && e as usize <= c.rx.free(),
                "ooo range {s}..{e}: {}",
                ctx()
            );
        }
        assert!(
            c.cc.cwnd > 0 || !c.state.is_synchronized(),
            "cwnd: {}",
            ctx()
        );
        if c.state == State::Closed {
            assert!(c.close_reason.is_some(), "{}", ctx());
        }
    }
}

fn mutate(rng: &mut Rng, seg: &mut Vec<u8>) {
    match rng.below(6) {
        0 => {
            // Shift SEQ by a small amount (in/out of window).
            let d = rng.below(200_000) as u32;
            let v = u32::from_be_bytes([seg[4], seg[5], seg[6], seg[7]])
                .wrapping_add(d.wrapping_sub(100_000));
            seg[4..8].copy_from_slice(&v.to_be_bytes());
        }
        1 => {
            let d = rng.below(200_000) as u32;
            let v = u32::from_be_bytes([seg[8], seg[9], seg[10], seg[11]])
                .wrapping_add(d.wrapping_sub(100_000));
            seg[8..12].copy_from_slice(&v.to_be_bytes());
        }
        2 => seg[13] ^= 1 << rng.below(6), // flip a flag (FIN/SYN/RST/PSH/ACK/URG)
        3 => {
            let i = rng.below(seg.len() as u64) as usize;
            seg[i] = rng.next_u64() as u8;
        }
        4 => seg[14..16].copy_from_slice(&(rng.below(4) as u16 * 100).to_be_bytes()), // tiny window
        _ => {
            let i = 20 + rng.below(seg.len().saturating_sub(20).max(1) as u64) as usize;
            seg.truncate(i.min(seg.len()));
        }
    }
}

fn run(seed: u64, steps: usize) {
    let mut rng = Rng(seed);
    let small = TcpConfig {
        rx_buffer: 8 * 1024 + rng.below(64 * 1024) as usize,
        tx_buffer: 8 * 1024 + rng.below(64 * 1024) as usize,
        sack: rng.chance(0.7),
        timestamps: rng.chance(0.7),
        window_scaling: rng.chance(0.7),
        max_retries: 4,
        time_wait: Duration::from_secs(2),
        keepalive: rng.chance(0.3).then(|| capybara_tcp::KeepAlive {
            idle: Duration::from_secs(1),
            interval: Duration::from_millis(500),
            probes: 2,
        }),
        ..TcpConfig::default()
    };
    let link = LinkConfig {
        latency: Duration::from_millis(1 + rng.below(5)),
        loss: rng.below(10) as f64 / 100.0,
        duplicate: rng.below(5) as f64 / 100.0,
        reorder: rng.below(10) as f64 / 100.0,
        reorder_extra: Duration::from_millis(4),
    };
    let mut p = Pair::new(small.clone(), small, link, seed);
    p.capture = Some(Vec::new());
    let mut clients = Vec::new();
    let mut servers = Vec::new();
    let mut buf = vec![0u8; 4096];
    let payload = vec![0x5au8; 20_000];
    for _ in 0..steps {
        match rng.below(14) {
            0 => {
                if let Ok(id) = p
                    .client
                    .connect(p.now, SocketAddrV4::new(CLIENT_IP, 0), vip())
                {
                    clients.push(id);
                }
            }
            1..=3 => {
                let all: Vec<_> = clients
                    .iter()
                    .map(|&c| (true, c))
                    .chain(servers.iter().map(|&s| (false, s)))
                    .collect();
                if let Some(&(is_client, id)) = all.get(rng.below(all.len().max(1) as u64) as usize)
                {
                    let ep = if is_client {
                        &mut p.client
                    } else {
                        &mut p.server
                    };
                    let n = rng.below(payload.len() as u64) as usize;
                    match rng.below(10) {
                        0..=3 => {
                            let _ = ep.send(id, &payload[..n]);
                        }
                        4..=6 => {
                            let _ = ep.recv(id, &mut buf);
                        }
                        7 => {
                            let _ = ep.shutdown(id);
                        }
                        8 => {
                            let _ = ep.close(id);
                        }
                        _ => {
                            let _ = ep.abort(id);
                        }
                    }
                }
            }
            4 => {
                // Inject a mutated copy of a segment seen on the link.
                let cap = p.capture.as_ref().unwrap();
                if !cap.is_empty() {
                    let (dir, mut seg) = cap[rng.below(cap.len() as u64) as usize].clone();
                    if seg.len() >= 20 {
                        mutate(&mut rng, &mut seg);
                        let fix = rng.chance(0.8);
                        let (src, dst, ep) = match dir {
                            Dir::ToServer => (CLIENT_IP, SERVER_DATA_IP, &mut p.server),
                            Dir::ToClient => (VIP, CLIENT_IP, &mut p.client),
                        };
                        if fix && seg.len() >= 20 {
                            seg[16..18].copy_from_slice(&[0, 0]);
                            let c = checksum::transport(src, dst, 6, &seg);
                            seg[16..18].copy_from_slice(&c.to_be_bytes());
                        }
                        ep.handle_segment(p.now, src, dst, &seg);
                    }
                }
            }
            5 => {
                // Pure garbage.
                let len = rng.below(80) as usize;
                let mut g = vec![0u8; len];
                rng.fill(&mut g);
                p.server
                    .handle_segment(p.now, CLIENT_IP, SERVER_DATA_IP, &g);
            }
            _ => {
                p.step();
            }
        }
        while let Some(id) = p.server.accept() {
            servers.push(id);
        }
        check_invariants(&p.client);
        check_invariants(&p.server);
    }
    // Let everything settle: timers must terminate eventually.
    p.drop_filter = None;
    for _ in 0..2000 {
        if !p.step() {
            break;
        }
        check_invariants(&p.client);
        check_invariants(&p.server);
    }
}

#[test]
fn random_operations_and_segments_keep_invariants() {
    for seed in 0..40 {
        run(seed, 2500);
    }
}
