//! Arbitrary frames into the interface, followed by a transmit drain: no
//! panic, and every frame lands in exactly one counter.
#![no_main]

use capybara_net::wire::EthernetAddress;
use capybara_net::{Interface, InterfaceConfig, NoTransport};
use capybara_proto::time::Instant;
use libfuzzer_sys::fuzz_target;
use std::net::Ipv4Addr;

fuzz_target!(|data: &[u8]| {
    let mut iface = Interface::new(InterfaceConfig::new(
        EthernetAddress([0x02, 0, 0, 0, 0, 0x11]),
        Ipv4Addr::new(198, 18, 2, 11),
        Ipv4Addr::new(198, 18, 1, 1),
    ))
    .unwrap();
    // The input is a sequence of frames, each prefixed by a one-byte length.
    let mut rest = data;
    let mut now = 0;
    let mut tx = [0u8; 1514];
    while let Some((&len, tail)) = rest.split_first() {
        let len = usize::from(len).min(tail.len());
        let (frame, tail) = tail.split_at(len);
        rest = tail;
        now += 1000;
        iface.receive(Instant::from_micros(now), frame, &mut NoTransport);
        while iface.transmit(Instant::from_micros(now), &mut tx, &mut NoTransport).is_some() {}
    }
    let c = iface.counters();
    let accounted = c.total_drops() + c.arp_requests_rx + c.arp_replies_rx + c.icmp_echo_requests_rx
        + c.icmp_echo_replies_rx + c.ipv4_delivered;
    assert_eq!(accounted, c.rx_frames);
});
