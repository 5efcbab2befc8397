//! `cargo +nightly fuzz run snapshot_import`: arbitrary bytes as a TLS
//! session snapshot. Import must never panic; whatever imports re-exports to
//! the same bytes and survives the rest of the input as ciphertext.
#![no_main]

use capybara_tls::TlsServer;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let (snap, tail) = match data.split_first() {
        Some((&n, rest)) => rest.split_at((n as usize * 4).min(rest.len())),
        None => return,
    };
    if let Ok(mut s) = TlsServer::import(snap) {
        let mut again = Vec::new();
        s.export(&mut again).expect("an imported session is exportable");
        assert_eq!(again, snap, "canonical encoding");
        let _ = s.feed_ciphertext(tail);
        let mut buf = [0u8; 256];
        let _ = s.read_plaintext(&mut buf);
        let _ = s.write_plaintext(tail);
        let mut out = Vec::new();
        s.take_ciphertext_to_send(&mut out);
    }
});
