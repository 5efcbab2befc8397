//! `cargo +nightly fuzz run tcp_header`: the header/option parser must not
//! panic, and whatever parses must round-trip through emit.
#![no_main]

use std::net::Ipv4Addr;

use capybara_tcp::wire::{TcpPacket, TcpRepr};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let a = Ipv4Addr::new(10, 0, 0, 1);
    let b = Ipv4Addr::new(10, 0, 0, 2);
    if let Ok(p) = TcpPacket::new_checked(data) {
        let _ = p.verify_checksum(a, b);
    }
    if let Ok(r) = TcpRepr::parse_bytes(data) {
        let mut out = vec![0u8; r.buffer_len()];
        let n = r.emit(&mut out, a, b).unwrap();
        let back = TcpRepr::parse_bytes(&out[..n]).unwrap();
        assert_eq!(back.payload, r.payload);
        assert_eq!(back.seq, r.seq);
    }
});
