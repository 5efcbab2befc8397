//! Stable-Rust fuzzing inside `cargo test`: random and mutated frames into
//! every parser and into `Interface::receive`. Bounded by iterations and
//! wall time (about a second or two). The cargo-fuzz targets in `fuzz/`
//! run the same entry points for longer.

use capybara_net::wire::*;
use capybara_net::{Interface, InterfaceConfig, NoTransport};
use capybara_proto::time::Instant;
use std::net::Ipv4Addr;

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

const MY_MAC: EthernetAddress = EthernetAddress([0x02, 0, 0, 0, 0, 0x11]);
const MY_IP: Ipv4Addr = Ipv4Addr::new(198, 18, 2, 11);

/// Valid frames the mutator starts from, so mutations reach deep layers.
fn seeds() -> Vec<Vec<u8>> {
    let peer = EthernetAddress([0x02, 0, 0, 0, 0, 1]);
    let mut arp = vec![0u8; 42];
    EthernetRepr {
        src_addr: peer,
        dst_addr: EthernetAddress::BROADCAST,
        ethertype: EtherType::Arp,
    }
    .emit(&mut EthernetFrame::new_unchecked(&mut arp[..]));
    ArpRepr {
        operation: ArpOperation::Request,
        source_hardware_addr: peer,
        source_protocol_addr: Ipv4Addr::new(198, 18, 1, 1),
        target_hardware_addr: EthernetAddress::ZERO,
        target_protocol_addr: MY_IP,
    }
    .emit(&mut ArpPacket::new_unchecked(&mut arp[14..]));
    let ip = |proto: Protocol, payload: &[u8]| {
        let mut b = vec![0u8; 34 + payload.len()];
        EthernetRepr {
            src_addr: peer,
            dst_addr: MY_MAC,
            ethertype: EtherType::Ipv4,
        }
        .emit(&mut EthernetFrame::new_unchecked(&mut b[..]));
        Ipv4Repr {
            src_addr: Ipv4Addr::new(198, 18, 0, 5),
            dst_addr: MY_IP,
            protocol: proto,
            payload_len: payload.len(),
            ttl: 64,
        }
        .emit(&mut Ipv4Packet::new_unchecked(&mut b[14..]), 7)
        .unwrap();
        b[34..].copy_from_slice(payload);
        b
    };
    let echo = Icmpv4Repr::EchoRequest {
        ident: 1,
        seq_no: 2,
        data: &[0xab; 40],
    };
    let mut icmp = vec![0u8; echo.buffer_len()];
    echo.emit(&mut Icmpv4Packet::new_unchecked(&mut icmp[..]));
    vec![
        arp,
        ip(Protocol::Icmp, &icmp),
        ip(Protocol::Tcp, &[0u8; 20]),
        ip(Protocol::Udp, &[1u8; 8]),
    ]
}

fn mutate(rng: &mut Rng, mut b: Vec<u8>) -> Vec<u8> {
    for _ in 0..1 + rng.below(4) {
        match rng.below(5) {
            0 if !b.is_empty() => {
                let i = rng.below(b.len());
                b[i] = rng.next() as u8;
            }
            1 if !b.is_empty() => {
                let i = rng.below(b.len());
                b[i] ^= 1 << rng.below(8);
            }
            2 => b.truncate(rng.below(b.len() + 1)),
            3 => b.extend((0..rng.below(64)).map(|_| rng.next() as u8)),
            _ => {
                // Interesting values in length-like fields.
                if b.len() > 20 {
                    let i = 14 + rng.below(6);
                    b[i] = [0, 1, 0x45, 0x4f, 0xff, 0x20][rng.below(6)];
                }
            }
        }
    }
    b
}

/// Every parser on arbitrary bytes: must not panic.
fn parse_everything(b: &[u8]) {
    if let Ok(f) = EthernetFrame::new_checked(b) {
        let _ = EthernetRepr::parse(&f);
        let _ = f.payload();
    }
    if let Ok(p) = ArpPacket::new_checked(b) {
        let _ = ArpRepr::parse(&p);
    }
    if let Ok(p) = Ipv4Packet::new_checked(b) {
        let _ = Ipv4Repr::parse(&p);
        let _ = (p.payload(), p.verify_checksum(), p.frag_offset());
    }
    if let Ok(p) = Icmpv4Packet::new_checked(b) {
        let _ = Icmpv4Repr::parse(&p);
    }
}

#[test]
fn random_and_mutated_frames_never_panic_and_are_all_accounted() {
    let seeds = seeds();
    let mut iface = Interface::new(InterfaceConfig::new(
        MY_MAC,
        MY_IP,
        Ipv4Addr::new(198, 18, 1, 1),
    ))
    .unwrap();
    let mut rng = Rng(0x5eed_cafe_f00d_0001);
    let mut tx = [0u8; 1514];
    let start = std::time::Instant::now();
    let mut n = 0u64;
    while n < 300_000 && start.elapsed() < std::time::Duration::from_secs(3) {
        let frame = if rng.below(4) == 0 {
            (0..rng.below(128)).map(|_| rng.next() as u8).collect()
        } else {
            let seed = seeds[rng.below(seeds.len())].clone();
            mutate(&mut rng, seed)
        };
        parse_everything(&frame);
        if frame.len() > 14 {
            parse_everything(&frame[14..]);
        }
        if frame.len() > 34 {
            parse_everything(&frame[34..]);
        }
        let now = Instant::from_micros(n);
        iface.receive(now, &frame, &mut NoTransport);
        // Drain so the control queue never fills: every frame then lands
        // in exactly one counter below.
        while let Some(len) = iface.transmit(now, &mut tx, &mut NoTransport) {
            assert!(len <= tx.len());
            let _ = EthernetFrame::new_checked(&tx[..len]).unwrap();
        }
        n += 1;
    }
    let c = iface.counters();
    assert_eq!(c.rx_frames, n);
    let accounted = c.total_drops()
        + c.arp_requests_rx
        + c.arp_replies_rx
        + c.icmp_echo_requests_rx
        + c.icmp_echo_replies_rx
        + c.ipv4_delivered;
    assert_eq!(accounted, n, "{c:?}");
    // The mutator must actually reach the upper layers.
    assert!(
        c.icmp_echo_replies_tx > 0 && c.arp_replies_tx > 0 && c.ipv4_delivered > 0,
        "{c:?}"
    );
    eprintln!("{n} frames in {:?}: {c:?}", start.elapsed());
}
