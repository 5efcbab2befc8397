//! LOAD-NOTIFICATION parser (versions 1 and 2): no panic; accepted input
//! re-emits identically except the reserved flags byte.
#![no_main]

use capybara_proto::load::LoadRepr;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(repr) = LoadRepr::parse_bytes(data) {
        let mut out = [0u8; capybara_proto::load::MAX_LEN];
        let n = repr.emit(&mut out).unwrap();
        assert_eq!(n, data.len());
        assert_eq!(&out[..3], &data[..3]);
        assert_eq!(&out[4..n], &data[4..]);
        let _ = (repr.pool_average(), repr.own_pps());
    }
});
