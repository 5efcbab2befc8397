//! Every wire parser on arbitrary bytes: `new_checked` then all accessors
//! and `Repr::parse` must never panic.
#![no_main]

use capybara_net::wire::*;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(f) = EthernetFrame::new_checked(data) {
        let _ = EthernetRepr::parse(&f);
        let _ = (f.src_addr(), f.dst_addr(), f.payload());
    }
    if let Ok(p) = ArpPacket::new_checked(data) {
        let _ = ArpRepr::parse(&p);
    }
    if let Ok(p) = Ipv4Packet::new_checked(data) {
        let _ = Ipv4Repr::parse(&p);
        let _ = (p.payload(), p.verify_checksum(), p.frag_offset(), p.src_addr(), p.dst_addr());
    }
    if let Ok(p) = Icmpv4Packet::new_checked(data) {
        let _ = Icmpv4Repr::parse(&p);
        let _ = (p.data(), p.verify_checksum());
    }
});
