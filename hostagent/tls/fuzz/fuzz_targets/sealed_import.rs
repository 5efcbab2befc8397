//! `cargo +nightly fuzz run sealed_import`: arbitrary bytes offered as a
//! sealed TLS snapshot. Never panics; nothing unauthenticated is accepted
//! (random bytes never pass the Poly1305 tag).
#![no_main]

use capybara_tls::{SealKey, TlsServer};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let key = SealKey::derive(b"fuzzing deployment secret").expect("fixed secret");
    assert!(TlsServer::import_sealed(&key, data).is_err());
});
