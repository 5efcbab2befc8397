//! TCPMig parser: no panic; whatever parses re-emits to identical bytes
//! (MAC aside) and parses back to the same Repr.
#![no_main]

use capybara_proto::tcpmig::{TcpMigPacket, TcpMigRepr};
use capybara_proto::{MigrationKey, MAC_LEN};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let key = MigrationKey::from_bytes(b"capybara-fuzz-key-0123456789").unwrap();
    let _ = TcpMigRepr::parse_verified(data, &key);
    if let Ok(p) = TcpMigPacket::new_checked(data) {
        let _ = (
            p.kind(),
            p.flow(),
            p.payload(),
            p.mac(),
            p.reason(),
            p.seq(),
            p.epoch(),
        );
    }
    if let Ok(repr) = TcpMigRepr::parse_bytes(data) {
        let mut out = vec![0u8; repr.buffer_len()];
        let n = repr.emit(&mut out).unwrap();
        assert_eq!(n, data.len());
        assert_eq!(&out[..n - MAC_LEN], &data[..n - MAC_LEN]);
        assert_eq!(TcpMigRepr::parse_bytes(&out).unwrap(), repr);
    }
});
