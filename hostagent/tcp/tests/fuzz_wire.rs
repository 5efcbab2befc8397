//! Stable-Rust fuzzing of the TCP header parser: random and mutated inputs
//! must never panic, and whatever parses must re-emit to an equal repr.

mod common;

use std::net::Ipv4Addr;

use capybara_tcp::wire::{TcpOptions, TcpPacket, TcpRepr};
use capybara_tcp::SeqNum;
use common::Rng;

const A: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 1);
const B: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 2);

fn check(bytes: &[u8]) {
    let Ok(p) = TcpPacket::new_checked(bytes) else {
        return;
    };
    // Every accessor is safe after new_checked.
    let _ = (
        p.src_port(),
        p.dst_port(),
        p.seq_number(),
        p.ack_number(),
        p.flags(),
        p.window(),
    );
    let _ = (
        p.options(),
        p.payload(),
        p.segment_len(),
        p.verify_checksum(A, B),
        p.urgent(),
    );
    let Ok(r) = TcpRepr::parse_bytes(bytes) else {
        return;
    };
    let mut out = vec![0u8; r.buffer_len()];
    let n = r.emit(&mut out, A, B).expect("buffer_len is enough");
    assert_eq!(n, r.buffer_len());
    let back = TcpRepr::parse_bytes(&out[..n]).expect("our own output parses");
    // SACK blocks beyond what fits next to a timestamp are dropped on emit.
    let mut expect = r;
    expect
        .options
        .sack
        .truncate(if r.options.timestamp.is_some() { 3 } else { 4 });
    assert_eq!(back, expect);
    assert!(TcpPacket::new_checked(&out[..n])
        .unwrap()
        .verify_checksum(A, B));
}

fn seed_segments() -> Vec<Vec<u8>> {
    let mut v = Vec::new();
    let mut r = TcpRepr::new(1234, 80, SeqNum(1000));
    r.syn = true;
    r.options = TcpOptions {
        mss: Some(1460),
        window_scale: Some(7),
        sack_permitted: true,
        timestamp: Some((5, 0)),
        ..TcpOptions::default()
    };
    let mut buf = vec![0u8; 100];
    let n = r.emit(&mut buf, A, B).unwrap();
    v.push(buf[..n].to_vec());
    let mut r = TcpRepr::new(80, 1234, SeqNum(7));
    r.ack = Some(SeqNum(1001));
    r.options.timestamp = Some((9, 5));
    r.options.sack.push(SeqNum(2000), SeqNum(3000));
    r.options.sack.push(SeqNum(4000), SeqNum(5000));
    r.payload = b"hello world";
    let mut buf = vec![0u8; 200];
    let n = r.emit(&mut buf, A, B).unwrap();
    v.push(buf[..n].to_vec());
    v
}

#[test]
fn random_bytes_never_panic() {
    let mut rng = Rng(0xfeed);
    let mut buf = [0u8; 128];
    for _ in 0..200_000 {
        let len = rng.below(100) as usize;
        rng.fill(&mut buf[..len]);
        // Bias the data offset towards plausible values.
        if len > 12 && rng.chance(0.7) {
            buf[12] = ((5 + rng.below(11)) as u8) << 4;
        }
        check(&buf[..len]);
        let _ = TcpOptions::parse(&buf[..len.min(40)]);
    }
}

#[test]
fn mutated_segments_never_panic() {
    let mut rng = Rng(0xbeef);
    let seeds = seed_segments();
    for _ in 0..200_000 {
        let mut s = seeds[rng.below(seeds.len() as u64) as usize].clone();
        for _ in 0..1 + rng.below(4) {
            match rng.below(4) {
                0 if !s.is_empty() => {
                    let i = rng.below(s.len() as u64) as usize;
                    s[i] = rng.next_u64() as u8;
                }
                1 if !s.is_empty() => {
                    let i = rng.below(s.len() as u64) as usize;
                    s.truncate(i);
                }
                2 => s.push(rng.next_u64() as u8),
                _ if s.len() > 20 => {
                    // Mutate inside the option area specifically.
                    let i = 20 + rng.below((s.len() - 20) as u64) as usize;
                    s[i] = [0u8, 1, 2, 3, 4, 5, 8, 255][rng.below(8) as usize];
                }
                _ => {}
            }
        }
        check(&s);
    }
}
