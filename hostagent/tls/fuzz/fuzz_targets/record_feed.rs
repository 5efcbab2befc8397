//! `cargo +nightly fuzz run record_feed`: arbitrary ciphertext, in arbitrary
//! pieces, fed to an established session (fixed keys from a built-in
//! snapshot). Never panics; a failed session stays failed.
#![no_main]

use capybara_tls::{TlsError, TlsServer};
use libfuzzer_sys::fuzz_target;

/// An established AES-128-GCM session without traffic secrets, sequence 0.
fn session() -> TlsServer {
    let mut snap = vec![1u8, 0, 0x03, 0x04, 0x13, 0x01];
    snap.extend_from_slice(&[0; 16]); // rx seq, tx seq
    snap.extend_from_slice(&[0x11; 16 + 12]); // rx key, iv
    snap.extend_from_slice(&[0x22; 16 + 12]); // tx key, iv
    snap.extend_from_slice(&[0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]); // empty buffers
    TlsServer::import(&snap).expect("built-in snapshot")
}

fuzz_target!(|data: &[u8]| {
    let mut s = session();
    let mut failed = false;
    let mut rest = data;
    while let [len, tail @ ..] = rest {
        let n = (*len as usize).min(tail.len());
        let (chunk, next) = tail.split_at(n);
        rest = next;
        match s.feed_ciphertext(chunk) {
            Ok(()) => assert!(!failed),
            Err(TlsError::Failed(_)) => assert!(failed),
            Err(_) => failed = true,
        }
    }
});
