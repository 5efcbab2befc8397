//! Stable-Rust fuzzing of every parser of untrusted bytes, bounded so that it
//! runs inside `cargo test` in about a second. Long runs use the cargo-fuzz
//! targets in `proto/fuzz/`. Set `CAPYBARA_FUZZ_ITERS` to run longer and
//! `CAPYBARA_FUZZ_SEED` to explore another sequence.
//!
//! Properties checked:
//! - no parser panics on random bytes, on mutations and truncations of
//!   valid encodings;
//! - valid encodings parse back to the value that was encoded;
//! - whatever a parser accepts re-encodes to something that parses to the
//!   same value (the Repr is a faithful model of the bytes it accepted);
//! - reassembly never panics on adversarial fragment streams, and any
//!   snapshot it yields fits its bound.

use std::net::{Ipv4Addr, SocketAddrV4};

use capybara_proto::control::{self, ControlBody, ControlRepr, ServiceList};
use capybara_proto::frag::{self, Progress, Reassembly};
use capybara_proto::load::{LoadPacket, LoadRepr};
use capybara_proto::tcpmig::{Kind, Reason, TcpMigPacket, TcpMigRepr};
use capybara_proto::{FlowKey, MigrationKey, ServerId};

/// xorshift64*: deterministic, dependency-free, good enough for fuzzing.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
    fn byte(&mut self) -> u8 {
        self.next() as u8
    }
    fn chance(&mut self, one_in: usize) -> bool {
        self.below(one_in) == 0
    }
    fn bytes(&mut self, out: &mut Vec<u8>, n: usize) {
        out.clear();
        out.extend((0..n).map(|_| self.byte()));
    }
    fn ip(&mut self) -> Ipv4Addr {
        Ipv4Addr::from(self.next() as u32)
    }
    fn u16(&mut self) -> u16 {
        self.next() as u16
    }
}

fn iterations() -> usize {
    std::env::var("CAPYBARA_FUZZ_ITERS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(50_000)
}

fn rng(salt: u64) -> Rng {
    let seed = std::env::var("CAPYBARA_FUZZ_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x5EED_CA9B_u64);
    Rng((seed ^ salt.wrapping_mul(0x9E37_79B9_7F4A_7C15)) | 1)
}

fn key() -> MigrationKey {
    MigrationKey::from_bytes(b"capybara-fuzz-key-0123456789").unwrap()
}

/// Random edits of a valid encoding: bit flips, byte overwrites,
/// truncation, extension; biased towards the header where the checks are.
fn mutate(rng: &mut Rng, buf: &mut Vec<u8>) {
    for _ in 0..1 + rng.below(4) {
        match rng.below(6) {
            0 if !buf.is_empty() => {
                let i = rng.below(buf.len().min(48));
                buf[i] ^= 1 << rng.below(8);
            }
            1 if !buf.is_empty() => {
                let i = rng.below(buf.len());
                buf[i] = rng.byte();
            }
            2 => {
                let n = rng.below(buf.len() + 1);
                buf.truncate(n);
            }
            3 => {
                for _ in 0..rng.below(20) {
                    buf.push(rng.byte());
                }
            }
            4 if buf.len() >= 2 => {
                // Interesting 16-bit values into a length/count field.
                let i = rng.below(buf.len() - 1);
                let v = [0u16, 1, 2, 0x7fff, 0xffff, buf.len() as u16][rng.below(6)];
                buf[i..i + 2].copy_from_slice(&v.to_be_bytes());
            }
            _ if !buf.is_empty() => {
                let i = rng.below(buf.len());
                buf[i] = buf[i].wrapping_add(1);
            }
            _ => {}
        }
    }
}

fn random_flow(rng: &mut Rng) -> FlowKey {
    FlowKey {
        client_ip: rng.ip(),
        client_port: rng.u16(),
        service_ip: rng.ip(),
        service_port: rng.u16(),
    }
}

fn random_tcpmig<'a>(rng: &mut Rng, payload: &'a [u8]) -> TcpMigRepr<'a> {
    let frag_count = 1 + rng.below(70) as u16;
    TcpMigRepr {
        kind: Kind::ALL[rng.below(Kind::ALL.len())],
        migration_id: rng.next(),
        flow: random_flow(rng),
        origin: rng.ip(),
        target: rng.ip(),
        seq: rng.next() as u32,
        frag_index: rng.below(frag_count as usize) as u16,
        frag_count,
        reason: Reason::from_u16(rng.u16()),
        epoch: rng.next(),
        payload,
    }
}

fn check_tcpmig(bytes: &[u8]) {
    let k = key();
    let _ = TcpMigRepr::parse_verified(bytes, &k);
    if let Ok(p) = TcpMigPacket::new_checked(bytes) {
        // Every accessor must be safe after new_checked.
        let _ = (
            p.kind(),
            p.migration_id(),
            p.flow(),
            p.origin(),
            p.target(),
            p.seq(),
        );
        let _ = (
            p.frag_index(),
            p.frag_count(),
            p.reason(),
            p.epoch(),
            p.payload(),
            p.mac(),
        );
        let _ = p.verify_mac(&k);
    }
    if let Ok(repr) = TcpMigRepr::parse_bytes(bytes) {
        let mut out = vec![0u8; repr.buffer_len()];
        let n = repr.emit(&mut out).expect("accepted message must re-emit");
        assert_eq!(n, bytes.len());
        // Identical except for the MAC, which emit() leaves zero.
        assert_eq!(&out[..n - 16], &bytes[..n - 16]);
        assert_eq!(TcpMigRepr::parse_bytes(&out).unwrap(), repr);
    }
}

fn check_load(bytes: &[u8]) {
    if let Ok(p) = LoadPacket::new_checked(bytes) {
        let r = LoadRepr::parse(&p).unwrap();
        let mut out = [0u8; capybara_proto::load::MAX_LEN];
        let n = r.emit(&mut out).unwrap();
        assert_eq!(n, bytes.len());
        assert_eq!(LoadRepr::parse_bytes(&out[..n]).unwrap(), r);
        let _ = (r.pool_average(), r.own_pps());
    }
}

fn check_control(bytes: &[u8]) {
    let _ = ControlRepr::parse_verified(bytes, &key());
    if let Ok(repr) = ControlRepr::parse(bytes) {
        let mut out = vec![0u8; repr.buffer_len()];
        let n = repr.emit(&mut out).expect("accepted message must re-emit");
        assert_eq!(n, bytes.len());
        assert_eq!(ControlRepr::parse(&out).unwrap(), repr);
    }
}

#[test]
fn random_bytes_never_panic() {
    let mut rng = rng(1);
    let mut buf = Vec::new();
    for i in 0..iterations() {
        let len = rng.below(if i % 8 == 0 { 2000 } else { 120 });
        rng.bytes(&mut buf, len);
        // Give random bytes a real chance of passing the magic/version gate.
        if buf.len() >= 4 && rng.chance(2) {
            let magic = [0xCA9Bu16, 0xCA9C, 0xCA9D][rng.below(3)];
            buf[..2].copy_from_slice(&magic.to_be_bytes());
            // TCPMig at its current version (older ones are refused); the others at 1.
            buf[2] = if magic == 0xCA9B {
                capybara_proto::tcpmig::VERSION
            } else {
                1
            };
        }
        check_tcpmig(&buf);
        check_load(&buf);
        check_control(&buf);
        let _ = MigrationKey::from_hex(&String::from_utf8_lossy(&buf));
    }
}

#[test]
fn tcpmig_valid_round_trips_and_mutations() {
    let mut rng = rng(2);
    let k = key();
    let mut payload = Vec::new();
    let mut out = vec![0u8; 4096];
    for _ in 0..iterations() {
        let len = rng.below(300);
        rng.bytes(&mut payload, len);
        let repr = random_tcpmig(&mut rng, &payload);
        let n = repr.emit_with_mac(&mut out, &k).unwrap();
        assert_eq!(n, repr.buffer_len());
        assert_eq!(TcpMigRepr::parse_verified(&out[..n], &k).unwrap(), repr);

        let mut m = out[..n].to_vec();
        mutate(&mut rng, &mut m);
        check_tcpmig(&m);
        // Any change of authenticated bytes must break the MAC.
        if m != out[..n] {
            if let Ok(p) = TcpMigPacket::new_checked(&m[..]) {
                if p.authenticated() != &out[..n - 16] || p.mac() != &out[n - 16..n] {
                    assert!(p.verify_mac(&k).is_err(), "mutation kept a valid MAC");
                }
            }
        }
    }
}

#[test]
fn load_valid_round_trips_and_mutations() {
    let mut rng = rng(3);
    for _ in 0..iterations() {
        let repr = LoadRepr {
            epoch: rng.next() as u32,
            sequence: rng.next(),
            interval_us: rng.next() as u32,
            server_id: ServerId(rng.next() as u32),
            own_load: rng.next(),
            pool_load: rng.next(),
            live_servers: rng.next() as u32,
            least_loaded: rng.ip(),
            weights: (rng.next() % 2 == 0).then(|| capybara_proto::load::LoadWeights {
                own: rng.next() as u32,
                pool: rng.next() as u32,
            }),
        };
        let mut out = [0u8; capybara_proto::load::MAX_LEN];
        let n = repr.emit(&mut out).unwrap();
        assert_eq!(LoadRepr::parse_bytes(&out[..n]).unwrap(), repr);
        let mut m = out[..n].to_vec();
        mutate(&mut rng, &mut m);
        check_load(&m);
    }
}

#[test]
fn control_valid_round_trips_and_mutations() {
    let mut rng = rng(4);
    let k = key();
    let mut out = vec![0u8; 4096];
    let mut text = String::new();
    for _ in 0..iterations() {
        let services: Vec<SocketAddrV4> = (0..rng.below(control::MAX_SERVICES + 1))
            .map(|_| SocketAddrV4::new(rng.ip(), rng.u16()))
            .collect();
        text.clear();
        for _ in 0..rng.below(60) {
            text.push(['a', 'é', '→', ' ', '0', '🦫'][rng.below(6)]);
        }
        let reports: Vec<control::MigrationReport> = (0..rng.below(control::MAX_REPORTS + 1))
            .map(|_| random_report(&mut rng))
            .collect();
        // FLOWS claims: ports and addresses never 0 (the parser refuses them).
        let claims: Vec<control::FlowClaim> = (0..rng.below(control::MAX_FLOW_CLAIMS + 1))
            .map(|_| control::FlowClaim {
                flow: capybara_proto::FlowKey {
                    client_ip: Ipv4Addr::from(rng.next() as u32 | 1),
                    client_port: rng.u16() | 1,
                    service_ip: Ipv4Addr::from(rng.next() as u32 | 1),
                    service_port: rng.u16() | 1,
                },
                epoch: if rng.chance(2) { 0 } else { rng.next() },
                owned_ms: rng.next() as u32,
            })
            .collect();
        let body = match rng.below(11) {
            9 => ControlBody::Flows(control::Flows {
                report_id: rng.next() as u32,
                batch: rng.u16(),
                flags: rng.u16(),
                claims: control::ClaimList::Slice(&claims),
            }),
            10 => ControlBody::FlowsAck(control::FlowsAck {
                report_id: rng.next() as u32,
                batch: rng.u16(),
                flags: rng.u16(),
                applied: rng.u16(),
                skipped: rng.u16(),
            }),
            0 => ControlBody::Register(control::Register {
                mgmt_addr: rng.ip(),
                data_addr: rng.ip(),
                data_mac: [
                    rng.byte(),
                    rng.byte(),
                    rng.byte(),
                    rng.byte(),
                    rng.byte(),
                    rng.byte(),
                ],
                weight: rng.u16(),
                services: ServiceList::Slice(&services),
                // Half without an instance id (servers that predate it).
                instance: if rng.below(2) == 0 { 0 } else { rng.next() | 1 },
                // Half of them read the long REGISTER_ACK.
                reads_last_id: rng.below(2) == 0,
            }),
            1 => ControlBody::RegisterAck(control::RegisterAck {
                switch_epoch: rng.next() as u32,
                load_interval_us: rng.next() as u32,
                heartbeat_interval_ms: rng.next() as u32,
                dead_after_ms: rng.next() as u32,
                // Half in the 16-byte form of switches that predate it.
                last_migration_id: (rng.below(2) == 0).then(|| rng.next()),
            }),
            2 => ControlBody::Heartbeat(control::Heartbeat {
                connections: rng.next() as u32,
                migrations_in_flight: rng.next() as u32,
                load_pps: rng.next(),
                rx_backlog_bytes: rng.next(),
                flags: rng.next() as u32,
                policy_generation: rng.next() as u32,
            }),
            3 => ControlBody::Drain(control::Drain {
                deadline_ms: rng.next() as u32,
                flags: rng.next() as u32,
            }),
            4 => ControlBody::Migrate(control::Migrate {
                flow: random_flow(&mut rng),
                target: rng
                    .chance(2)
                    .then(|| Ipv4Addr::from(1 + rng.below(u32::MAX as usize - 1) as u32)),
            }),
            5 => ControlBody::SetOwner(control::SetOwner {
                flow: random_flow(&mut rng),
                owner: rng.ip(),
            }),
            6 => ControlBody::Policy(control::PolicyMsg {
                generation: rng.next() as u32,
                flags: rng.next() as u32,
                proactive_threshold_bp: rng.next() as u32,
                hysteresis_bp: rng.next() as u32,
                reactive_backlog_packets: rng.next() as u32,
                cooldown_ms: rng.next() as u32,
                max_migrations_per_sec: rng.next() as u32,
                migration_deadline_ms: rng.next() as u32,
            }),
            7 => ControlBody::MigrationReport(control::ReportList::Slice(&reports)),
            _ => ControlBody::Error(control::ErrorMsg {
                code: control::ErrorCode::from_u16(rng.u16()),
                ref_kind: rng.byte(),
                ref_seq: rng.next(),
                text: &text,
            }),
        };
        let repr = ControlRepr {
            server_id: ServerId(rng.next() as u32),
            seq: rng.next(),
            body,
        };
        let n = repr.emit_with_mac(&mut out, &k).unwrap();
        assert_eq!(ControlRepr::parse_verified(&out[..n], &k).unwrap(), repr);
        let mut m = out[..n].to_vec();
        mutate(&mut rng, &mut m);
        check_control(&m);
    }
}

fn random_report(rng: &mut Rng) -> control::MigrationReport {
    let mut phases_us = [0u32; 5];
    for p in &mut phases_us {
        *p = if rng.chance(4) {
            control::PHASE_NOT_REACHED
        } else {
            rng.next() as u32
        };
    }
    let outcome = control::ReportOutcome::from_u8(1 + rng.below(7) as u8).unwrap();
    // NOT_STARTED carries a start-failure code (the parser refuses others).
    let reason = if outcome == control::ReportOutcome::NotStarted {
        let all = control::StartFailure::ALL;
        Reason::from_u16(all[rng.below(all.len())].to_u16())
    } else {
        Reason::from_u16(rng.u16())
    };
    control::MigrationReport {
        id: rng.next(),
        flow: random_flow(rng),
        peer: rng
            .chance(2)
            .then(|| Ipv4Addr::from(1 + rng.below(u32::MAX as usize - 1) as u32)),
        outcome,
        trigger: control::MigrationTrigger::from_u8(rng.below(6) as u8).unwrap(),
        reason,
        fragments: rng.u16(),
        age_us: rng.next() as u32,
        phases_us,
        snapshot_bytes: rng.next() as u32,
        segments_buffered: rng.next() as u32,
        bytes_buffered: rng.next(),
    }
}

#[test]
fn reassembly_survives_adversarial_streams() {
    let mut rng = rng(5);
    let mut snapshot = Vec::new();
    let mut junk = Vec::new();
    let mut r = Reassembly::new(4096);
    for _ in 0..iterations() / 10 {
        r.reset();
        let len = rng.below(5000);
        rng.bytes(&mut snapshot, len);
        let chunk = 1 + rng.below(1500);
        let frags: Vec<_> = frag::split_chunks(&snapshot, chunk).unwrap().collect();
        let count = frags.len();
        let mut complete = false;
        for _ in 0..count * 3 + 5 {
            let res = if rng.chance(5) {
                // Junk: random index/count/length.
                let jl = rng.below(1600);
                rng.bytes(&mut junk, jl);
                let c = if rng.chance(2) {
                    count as u16
                } else {
                    rng.u16()
                };
                r.accept(rng.u16() % c.max(1).saturating_add(1), c, &junk)
            } else {
                let f = frags[rng.below(count)];
                r.accept(f.index, f.count, f.payload)
            };
            if let Ok(Progress::Complete) = res {
                complete = true;
            }
            if let Some(s) = r.snapshot() {
                assert!(s.len() <= r.max_snapshot());
            }
        }
        // With no junk accepted, a fitting snapshot reassembles exactly.
        if complete && snapshot.len() <= 4096 {
            let got = r.snapshot().unwrap();
            assert!(got.len() <= 4096);
        }
    }
}

#[test]
fn reassembly_reorders_and_dedups_exactly() {
    let mut rng = rng(6);
    let mut snapshot = Vec::new();
    let mut r = Reassembly::new(8192);
    for _ in 0..iterations() / 20 {
        r.reset();
        let len = rng.below(8193);
        rng.bytes(&mut snapshot, len);
        let frags: Vec<_> = frag::split_chunks(&snapshot, 1 + rng.below(2000))
            .unwrap()
            .collect();
        let mut order: Vec<usize> = (0..frags.len()).collect();
        // Shuffle, then sprinkle duplicates.
        for i in (1..order.len()).rev() {
            order.swap(i, rng.below(i + 1));
        }
        for _ in 0..rng.below(5) {
            let d = order[rng.below(order.len())];
            order.insert(rng.below(order.len() + 1), d);
        }
        let mut done = false;
        for i in order {
            let f = frags[i];
            match r.accept(f.index, f.count, f.payload).unwrap() {
                Progress::Complete => done = true,
                Progress::Duplicate | Progress::Stored { .. } => {}
            }
        }
        assert!(done);
        assert_eq!(r.snapshot().unwrap(), &snapshot[..]);
    }
}
