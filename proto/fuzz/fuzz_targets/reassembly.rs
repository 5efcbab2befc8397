//! Reassembly: the input is a stream of fragments
//! `index:u16 count:u16 len:u16 bytes[len]`; no panic, and a yielded
//! snapshot always fits the bound.
#![no_main]

use capybara_proto::frag::Reassembly;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut r = Reassembly::new(2048);
    let mut rest = data;
    while rest.len() >= 6 {
        let index = u16::from_be_bytes([rest[0], rest[1]]);
        let count = u16::from_be_bytes([rest[2], rest[3]]);
        let len = usize::from(u16::from_be_bytes([rest[4], rest[5]]));
        rest = &rest[6..];
        let take = len.min(rest.len());
        let _ = r.accept(index, count, &rest[..take]);
        rest = &rest[take..];
        if let Some(s) = r.snapshot() {
            assert!(s.len() <= 2048);
        }
    }
});
