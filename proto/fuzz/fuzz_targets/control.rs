//! Control-channel parser: no panic; accepted input re-emits to bytes that
//! parse to the same Repr (reserved fields are normalised to zero). Covers
//! every kind, MIGRATION_REPORT's report list and FLOWS's claim list
//! included (their entries are validated in `parse` and re-read by
//! `ReportList::iter` / `ClaimList::iter`, exercised here through the Repr
//! comparison).
#![no_main]

use capybara_proto::control::ControlRepr;
use capybara_proto::MigrationKey;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let key = MigrationKey::from_bytes(b"capybara-fuzz-key-0123456789").unwrap();
    let _ = ControlRepr::parse_verified(data, &key);
    if let Ok(repr) = ControlRepr::parse(data) {
        let mut out = vec![0u8; repr.buffer_len()];
        let n = repr.emit(&mut out).unwrap();
        assert_eq!(n, data.len());
        assert_eq!(ControlRepr::parse(&out).unwrap(), repr);
    }
});
