//! Stable-Rust fuzzing of the record parser and handshake intake: random
//! bytes, and valid client ciphertext with random corruption, cut into random
//! pieces, never panic the session; a failed session stays failed.

mod common;

use capybara_tls::{TlsError, TlsServer};
use common::*;
use proptest::prelude::*;

type Base = (Vec<u8>, Vec<u8>, Vec<u8>);

/// (snapshot of an established session, client ciphertext, its plaintext)
/// for TLS 1.3 (`[0]`) and TLS 1.2 AES-GCM (`[1]`).
fn established() -> [Base; 2] {
    [
        one(None),
        one(Some(
            rustls::crypto::ring::cipher_suite::TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256,
        )),
    ]
}

fn one(suite: Option<rustls::SupportedCipherSuite>) -> Base {
    let cert = test_cert();
    let mut p = handshake_with(&cert, server_config(&cert), suite);
    let mut snap = Vec::new();
    p.server.export(&mut snap).unwrap();
    let msg: Vec<u8> = (0..5000u32).map(|i| (i * 7) as u8).collect();
    let ct = client_send(&mut p.client, &msg);
    (snap, ct, msg)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1500, .. ProptestConfig::default() })]

    #[test]
    fn random_ciphertext_after_handshake(
        chunks in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..300), 1..8),
        header_like in any::<bool>(),
        tls12 in any::<bool>(),
    ) {
        thread_local!(static BASE: [Base; 2] = established());
        let snap = BASE.with(|b| b[usize::from(tls12)].0.clone());
        let mut s = TlsServer::import(&snap).unwrap();
        let mut failed = false;
        for mut c in chunks {
            if header_like && c.len() >= 5 {
                c[0] = 23; c[1] = 3; c[2] = 3;
            }
            match s.feed_ciphertext(&c) {
                Ok(()) => prop_assert!(!failed),
                Err(TlsError::Failed(_)) => prop_assert!(failed),
                Err(_) => { prop_assert!(!failed); failed = true; }
            }
        }
    }

    #[test]
    fn corrupted_valid_stream_in_random_pieces(
        flip_at in any::<u16>(),
        flip in 1u8..=255,
        cuts in proptest::collection::vec(any::<u16>(), 0..6),
        tls12 in any::<bool>(),
    ) {
        thread_local!(static BASE: [Base; 2] = established());
        let (snap, mut ct, msg) = BASE.with(|b| b[usize::from(tls12)].clone());
        let at = usize::from(flip_at) % ct.len();
        ct[at] ^= flip;
        let mut s = TlsServer::import(&snap).unwrap();
        let mut cuts: Vec<usize> = cuts.into_iter().map(|c| usize::from(c) % ct.len()).collect();
        cuts.push(0);
        cuts.push(ct.len());
        cuts.sort_unstable();
        let mut result = Ok(());
        for w in cuts.windows(2) {
            result = s.feed_ciphertext(&ct[w[0]..w[1]]);
            if result.is_err() { break; }
        }
        // Any flipped byte breaks authentication of its record or its
        // framing; a length made longer leaves a record that never completes.
        prop_assert!(
            result.is_err() || s.partial_record_len() > 0,
            "corruption at {} went unnoticed", at
        );
        let mut got = Vec::new();
        let mut buf = [0u8; 1024];
        loop { let n = s.read_plaintext(&mut buf); if n == 0 { break; } got.extend_from_slice(&buf[..n]); }
        prop_assert!(msg.starts_with(&got), "only authentic plaintext is delivered");
    }

    #[test]
    fn random_bytes_during_handshake(
        chunks in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..200), 1..5),
        hello in any::<bool>(),
    ) {
        thread_local!(static CFG: capybara_tls::TlsConfig = server_config(&test_cert()));
        let cfg = CFG.with(|c| c.clone());
        let mut s = TlsServer::new(&cfg).unwrap();
        for (i, mut c) in chunks.into_iter().enumerate() {
            if hello && i == 0 && c.len() >= 6 {
                c[0] = 22; c[1] = 3; c[2] = 1; c[5] = 1;
            }
            let _ = s.feed_ciphertext(&c);
            let mut out = Vec::new();
            s.take_ciphertext_to_send(&mut out);
        }
        prop_assert!(!s.can_export());
    }
}
