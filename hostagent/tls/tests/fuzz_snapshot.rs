//! Stable-Rust fuzzing of the TLS snapshot parser (untrusted bytes from the
//! migration channel): truncated, mutated and random snapshots never panic
//! the importer, every refusal names a field, whatever imports re-exports to
//! the same bytes (the encoding is canonical), and an imported session
//! survives random ciphertext.

mod common;

use capybara_tls::{SnapshotError, TlsServer};
use common::*;
use proptest::prelude::*;

/// Valid snapshots from live sessions in assorted states: idle, with a
/// partial record, unread plaintext, pending ciphertext, a partial
/// KeyUpdate, closed.
fn corpus() -> Vec<Vec<u8>> {
    let (_cert, mut p) = handshake();
    let mut out = Vec::new();
    let snap = |s: &TlsServer| {
        let mut v = Vec::new();
        s.export(&mut v).unwrap();
        v
    };
    out.push(snap(&p.server));
    let ct = client_send(&mut p.client, &vec![7u8; 20_000]);
    p.server.feed_ciphertext(&ct[..ct.len() - 100]).unwrap();
    out.push(snap(&p.server));
    p.server.write_plaintext(b"pending response").unwrap();
    out.push(snap(&p.server));
    let mut client = p.server.testing_mirror().unwrap();
    p.server.feed_ciphertext(&ct[ct.len() - 100..]).unwrap();
    let _ = client; // keys of the mirror are now stale; build a fresh one
    client = p.server.testing_mirror().unwrap();
    client.testing_seal_raw(22, &[24, 0, 0]).unwrap();
    let mut ks = Vec::new();
    client.take_ciphertext_to_send(&mut ks);
    p.server.feed_ciphertext(&ks).unwrap();
    out.push(snap(&p.server));
    p.server.send_close_notify();
    out.push(snap(&p.server));
    // TLS 1.2 (GCM, explicit nonces), with a partial record.
    let cert = test_cert();
    let mut p = handshake_with(
        &cert,
        server_config(&cert),
        Some(rustls::crypto::ring::cipher_suite::TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384),
    );
    let ct = client_send(&mut p.client, &[9u8; 3000]);
    p.server.feed_ciphertext(&ct[..ct.len() - 7]).unwrap();
    out.push(snap(&p.server));
    out
}

#[test]
fn every_truncation_is_refused_with_the_field_named() {
    for snap in corpus() {
        assert!(TlsServer::import(&snap).is_ok());
        for len in 0..snap.len() {
            match TlsServer::import(&snap[..len]) {
                Err(SnapshotError::Truncated { field, .. }) => assert!(!field.is_empty()),
                Err(SnapshotError::Invalid { field, .. }) => {
                    // A shortened length field can make a partial record look complete.
                    assert!(field.starts_with("partial"), "len {len}: {field}")
                }
                other => panic!("prefix of {len} bytes: {other:?}"),
            }
        }
        let mut longer = snap.clone();
        longer.push(0);
        assert_eq!(
            TlsServer::import(&longer).unwrap_err(),
            SnapshotError::Trailing(1)
        );
    }
}

#[test]
fn every_single_byte_mutation_is_handled() {
    for snap in corpus() {
        for i in 0..snap.len().min(600) {
            for flip in [0x01u8, 0x80, 0xff] {
                let mut m = snap.clone();
                m[i] ^= flip;
                if let Ok(mut s) = TlsServer::import(&m) {
                    let mut again = Vec::new();
                    s.export(&mut again).unwrap();
                    assert_eq!(again, m, "canonical re-export after flipping byte {i}");
                    let _ = s.feed_ciphertext(&[0x17, 0x03, 0x03, 0x00, 0x20]);
                    let _ = s.feed_ciphertext(&[0u8; 32]);
                    let _ = s.write_plaintext(b"x");
                }
            }
        }
    }
}

#[test]
fn version_and_reserved_flags_are_checked() {
    let snap = corpus().remove(0);
    let mut m = snap.clone();
    m[0] = 2;
    assert_eq!(
        TlsServer::import(&m).unwrap_err(),
        SnapshotError::Version(2)
    );
    let mut m = snap.clone();
    m[1] |= 0x80;
    assert!(matches!(
        TlsServer::import(&m),
        Err(SnapshotError::Invalid { field: "flags", .. })
    ));
    let mut m = snap;
    m[4..6].copy_from_slice(&0x1304u16.to_be_bytes());
    assert!(matches!(
        TlsServer::import(&m),
        Err(SnapshotError::Invalid { field: "suite", .. })
    ));
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, .. ProptestConfig::default() })]

    #[test]
    fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..400)) {
        let _ = TlsServer::import(&bytes);
        // Also behind a plausible header.
        let mut b = vec![1u8, 4, 0x03, 0x04, 0x13, 0x01];
        b.extend_from_slice(&bytes);
        if let Ok(mut s) = TlsServer::import(&b) {
            let _ = s.feed_ciphertext(&bytes);
        }
    }

    #[test]
    fn mutated_snapshots_never_panic(
        which in 0usize..6,
        edits in proptest::collection::vec((any::<u16>(), any::<u8>()), 1..6),
        tail in proptest::collection::vec(any::<u8>(), 0..64),
    ) {
        thread_local!(static CORPUS: Vec<Vec<u8>> = corpus());
        let mut m = CORPUS.with(|c| c[which % c.len()].clone());
        for (at, v) in edits {
            let i = usize::from(at) % m.len();
            m[i] = v;
        }
        if let Ok(mut s) = TlsServer::import(&m) {
            let _ = s.feed_ciphertext(&tail);
            let mut buf = [0u8; 64];
            let _ = s.read_plaintext(&mut buf);
            let mut out = Vec::new();
            let _ = s.export(&mut out);
        }
    }
}

/// A snapshot written by hand from the byte layout in docs/TLS.md imports,
/// and a session exported from a live connection has exactly that layout.
#[test]
fn documented_layout_is_the_real_one() {
    let mut snap = vec![1u8, 0, 0x03, 0x04, 0x13, 0x01];
    snap.extend_from_slice(&5u64.to_be_bytes()); // rx seq
    snap.extend_from_slice(&9u64.to_be_bytes()); // tx seq
    snap.extend_from_slice(&[0x11; 16 + 12]); // rx key, rx iv
    snap.extend_from_slice(&[0x22; 16 + 12]); // tx key, tx iv
    snap.extend_from_slice(&3u16.to_be_bytes()); // partial record
    snap.extend_from_slice(&[0x17, 0x03, 0x03]);
    snap.extend_from_slice(&[2, 24, 0]); // partial KeyUpdate
    snap.extend_from_slice(&2u32.to_be_bytes()); // plaintext
    snap.extend_from_slice(b"hi");
    snap.extend_from_slice(&0u32.to_be_bytes()); // pending ciphertext
    assert_eq!(snap.len(), 89 + 3 + 2 + 2);
    let mut s = TlsServer::import(&snap).unwrap();
    assert_eq!(s.suite(), Some(capybara_tls::Suite::Aes128GcmSha256));
    assert!(!s.supports_key_update());
    assert_eq!(s.partial_record_len(), 3);
    let mut again = Vec::new();
    s.export(&mut again).unwrap();
    assert_eq!(again, snap);
    assert_eq!(drain_plaintext(&mut s), b"hi");

    // Live session, AES-128-GCM with secrets: 89 + 2 * 32 bytes when idle.
    let cert = test_cert();
    let p = handshake_with(
        &cert,
        server_config(&cert),
        Some(rustls::crypto::ring::cipher_suite::TLS13_AES_128_GCM_SHA256),
    );
    let mut live = Vec::new();
    p.server.export(&mut live).unwrap();
    assert_eq!(live.len(), 89 + 64);
    assert_eq!(live[0], 1);
    assert_eq!(live[1], 0b100, "flags: secrets present");
    assert_eq!(live[2..6], [0x03, 0x04, 0x13, 0x01]);
    assert_eq!(
        live[6..14],
        0u64.to_be_bytes(),
        "rx seq: no client record yet"
    );
    assert_eq!(live[14..22], 0u64.to_be_bytes(), "tx seq: tickets are off");
    assert_eq!(live[live.len() - 11..], [0u8; 11], "empty buffers");
}
