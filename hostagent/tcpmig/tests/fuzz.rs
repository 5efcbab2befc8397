//! Stable-Rust fuzzing of the engine: bounded random sequences of
//! well-authenticated but arbitrary messages, corrupted datagrams and local
//! API calls, on the virtual clock. Checks: no panic, bounds hold, every
//! datagram the engine writes is a valid authenticated TCPMig message, and
//! each migration out reports at most one outcome.

mod common;

use std::collections::HashMap;
use std::net::Ipv4Addr;

use capybara_proto::tcpmig::TcpMigRepr;
use capybara_tcpmig::*;
use common::*;

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn pick<T: Copy>(&mut self, xs: &[T]) -> T {
        xs[self.below(xs.len() as u64) as usize]
    }
}

fn flows() -> [FlowKey; 3] {
    let mut f = [flow(); 3];
    f[1].client_port += 1;
    f[2].client_ip = Ipv4Addr::new(198, 18, 0, 99);
    f
}

const ADDRS: [Ipv4Addr; 4] = [ORIGIN, TARGET, TARGET2, Ipv4Addr::UNSPECIFIED];

fn run(seed: u64, ops: usize) {
    let mut rng = Rng(seed | 1);
    let mut cfg = config(TARGET);
    cfg.max_concurrent_in = 2;
    cfg.max_concurrent_out = 2;
    cfg.max_records = 8;
    cfg.max_tx_queue = 16;
    let mut e = Engine::new(cfg.clone(), key()).unwrap();
    let k = key();
    let mut now = Instant::from_millis(5);
    let mut ids: Vec<u64> = vec![1, (u64::from(u32::from(ORIGIN)) << 32) | 1];
    let mut outcomes: HashMap<MigrationId, usize> = HashMap::new();
    let mut buf = vec![0u8; 2048];
    let mut payload = vec![0u8; 1200];
    for _ in 0..ops {
        match rng.below(12) {
            0..=4 => {
                // A well-formed, authenticated message with arbitrary fields.
                let kind = rng.pick(&Kind::ALL);
                let count = rng.pick(&[1u16, 1, 2, 3, 9, 200]);
                let len = rng.pick(&[0usize, 1, 17, 488, 1000]);
                for b in payload[..len].iter_mut() {
                    *b = rng.next() as u8;
                }
                let repr = TcpMigRepr {
                    kind,
                    migration_id: rng.pick(&ids),
                    flow: rng.pick(&flows()),
                    origin: rng.pick(&ADDRS),
                    target: rng.pick(&ADDRS),
                    seq: rng.next() as u32,
                    frag_index: (rng.below(u64::from(count) + 1)) as u16,
                    frag_count: count,
                    reason: Reason::from_u16(rng.below(10) as u16),
                    epoch: rng.pick(&ids),
                    payload: &payload[..len],
                };
                let Ok(n) = repr.emit_with_mac(&mut buf, &k) else {
                    continue;
                };
                let src = rng.pick(&ADDRS);
                let _ = e.handle_message(now, src, &buf[..n]);
            }
            5 => {
                // Garbage and bit flips.
                let n = rng.below(200) as usize;
                for b in buf[..n].iter_mut() {
                    *b = rng.next() as u8;
                }
                if n > 4 && rng.below(2) == 0 {
                    buf[0] = 0xCA;
                    buf[1] = 0x9B;
                    buf[2] = capybara_proto::tcpmig::VERSION;
                }
                assert!(e.handle_message(now, ORIGIN, &buf[..n]).is_err());
            }
            6 => {
                if let Ok(id) = e.migrate_out(
                    now,
                    rng.pick(&flows()),
                    if rng.below(2) == 0 {
                        None
                    } else {
                        Some(ORIGIN)
                    },
                ) {
                    ids.push(id.0);
                }
            }
            7 => {
                let id = MigrationId(rng.pick(&ids));
                let n = rng.pick(&[0usize, 10, 3000, 70_000]);
                let _ = e.provide_snapshot(now, id, vec![7; n]);
            }
            8 => {
                let id = MigrationId(rng.pick(&ids));
                if let Some(s) = e.snapshot(id) {
                    assert!(s.len() <= cfg.max_snapshot_bytes);
                }
                if rng.below(3) == 0 {
                    let _ = e.import_failed(now, id);
                } else {
                    let _ = e.import_done(now, id, |s| assert!(s.len() <= cfg.max_buffer_bytes));
                }
                let _ = e.abort_out(now, MigrationId(rng.pick(&ids)));
            }
            9 => {
                let seg_len = rng.below(2000) as usize;
                let _ = e.buffer_segment(
                    now,
                    rng.pick(&flows()),
                    &payload[..seg_len.min(payload.len())],
                );
            }
            _ => {
                now += Duration::from_micros(rng.below(60_000));
                if let Some(t) = e.poll_timeout() {
                    if rng.below(2) == 0 {
                        now = now.max(t);
                    }
                }
                e.handle_timeout(now);
            }
        }
        // Drain output; check it.
        let mut sent = 0;
        while let Some(t) = e.poll_transmit(now, &mut buf) {
            sent += 1;
            assert!(sent <= cfg.max_tx_queue + 200, "transmit queue unbounded");
            let m = TcpMigRepr::parse_verified(&buf[..t.len], &k)
                .expect("engine wrote an invalid message");
            assert!(!t.dst.is_unspecified());
            if m.kind == Kind::Prepare {
                assert_eq!(t.dst, SWITCH);
            }
        }
        while let Some(ev) = e.poll_event() {
            if let Event::MigratedOut { id, .. }
            | Event::Resumed { id, .. }
            | Event::Lost { id, .. } = ev
            {
                *outcomes.entry(id).or_default() += 1;
                assert_eq!(outcomes[&id], 1, "two outcomes for {id}");
            }
        }
        let (o, i) = e.in_progress();
        assert!(o <= cfg.max_concurrent_out && i <= cfg.max_concurrent_in);
        assert!(
            e.records() <= cfg.max_records + cfg.max_concurrent_in,
            "records {}",
            e.records()
        );
    }
}

#[test]
fn fuzz_engine_random_sequences() {
    for seed in 0..300u64 {
        run(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xDEAD_BEEF, 400);
    }
}
