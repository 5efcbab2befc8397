//! Sealed TLS snapshots (ChaCha20-Poly1305 under a key derived from the
//! deployment secret): a sealed session continues its streams on the
//! target; a wrong key, a modified byte, a truncation or random bytes are
//! refused with a clear error and never panic.

mod common;

use capybara_tls::{SealError, SealKey, TlsServer, SEAL_OVERHEAD};
use common::*;
use proptest::prelude::*;

const SECRET: &[u8] = b"0123456789abcdef-deployment-secret";

fn key() -> SealKey {
    SealKey::derive(SECRET).unwrap()
}

fn sealed(server: &TlsServer, key: &SealKey, nonce: [u8; 12]) -> Vec<u8> {
    let mut out = Vec::new();
    server.export_sealed(key, nonce, &mut out).unwrap();
    assert_eq!(out.len(), server.sealed_len());
    out
}

/// A session with a partial record, unread plaintext and pending ciphertext.
fn busy_pair() -> Pair {
    let (_cert, mut p) = handshake();
    let ct = client_send(&mut p.client, &[5u8; 9000]);
    p.server.feed_ciphertext(&ct[..ct.len() - 50]).unwrap();
    p.server.write_plaintext(b"+PONG\r\n").unwrap();
    p
}

#[test]
fn sealed_migration_continues_both_streams() {
    let (_cert, mut p) = handshake();
    let key = key();
    let request = b"*2\r\n$3\r\nGET\r\n$3\r\nkey\r\n".repeat(300);
    let ct = client_send(&mut p.client, &request);
    let cut = ct.len() / 2 + 3; // mid-record
    p.server.feed_ciphertext(&ct[..cut]).unwrap();
    let mut got = drain_plaintext(&mut p.server);
    p.server.write_plaintext(b"$5\r\nvalue\r\n").unwrap();

    let blob = sealed(&p.server, &key, [7; 12]);
    // The target derives the key from the same secret on another host.
    let target_key = SealKey::from_hex(&hex(SECRET)).unwrap();
    let mut server = TlsServer::import_sealed(&target_key, &blob).unwrap();
    server.feed_ciphertext(&ct[cut..]).unwrap();
    got.extend(drain_plaintext(&mut server));
    assert_eq!(got, request);

    server.write_plaintext(b"$3\r\nend\r\n").unwrap();
    let mut out = Vec::new();
    server.take_ciphertext_to_send(&mut out);
    let pt = client_receive(&mut p.client, &out);
    assert_eq!(pt, b"$5\r\nvalue\r\n$3\r\nend\r\n");
}

#[test]
fn sealed_blob_hides_the_snapshot_and_carries_the_nonce() {
    let p = busy_pair();
    let key = key();
    let mut plain = Vec::new();
    p.server.export(&mut plain).unwrap();
    let a = sealed(&p.server, &key, [1; 12]);
    let b = sealed(&p.server, &key, [2; 12]);
    assert_eq!(a.len(), plain.len() + SEAL_OVERHEAD);
    assert_eq!(&a[..5], b"CPYS\x01");
    assert_eq!(&a[5..17], &[1; 12]);
    assert_eq!(&b[5..17], &[2; 12]);
    assert_ne!(
        a[17..],
        b[17..],
        "a different nonce gives a different ciphertext"
    );
    // No 16-byte window of the plain snapshot (keys, IVs, plaintext) survives.
    for w in plain.windows(16) {
        assert!(!a.windows(16).any(|x| x == w), "plain bytes leaked");
    }
    for blob in [a, b] {
        let s = TlsServer::import_sealed(&key, &blob).unwrap();
        let mut again = Vec::new();
        s.export(&mut again).unwrap();
        assert_eq!(again, plain);
    }
}

#[test]
fn appends_after_existing_bytes() {
    let p = busy_pair();
    let key = key();
    let mut out = b"prefix".to_vec();
    p.server.export_sealed(&key, [3; 12], &mut out).unwrap();
    assert_eq!(&out[..6], b"prefix");
    TlsServer::import_sealed(&key, &out[6..]).unwrap();
}

#[test]
fn wrong_key_is_refused_as_authentication_failure() {
    let p = busy_pair();
    let blob = sealed(&p.server, &key(), [9; 12]);
    let other = SealKey::derive(b"another deployment secret!!").unwrap();
    let err = TlsServer::import_sealed(&other, &blob).unwrap_err();
    assert_eq!(err, SealError::Authentication);
    assert!(err.to_string().contains("wrong seal key"), "{err}");
}

#[test]
fn every_modified_byte_and_truncation_is_refused() {
    let p = busy_pair();
    let key = key();
    let blob = sealed(&p.server, &key, [4; 12]);
    for i in 0..blob.len() {
        for flip in [0x01u8, 0x80] {
            let mut bad = blob.clone();
            bad[i] ^= flip;
            let err = TlsServer::import_sealed(&key, &bad).unwrap_err();
            match i {
                0..=3 => assert!(matches!(err, SealError::Magic(_)), "{i}: {err}"),
                4 => assert!(matches!(err, SealError::Version(_)), "{i}: {err}"),
                _ => assert_eq!(err, SealError::Authentication, "byte {i}"),
            }
        }
    }
    for len in 0..blob.len() {
        let err = TlsServer::import_sealed(&key, &blob[..len]).unwrap_err();
        if len < SEAL_OVERHEAD {
            assert_eq!(err, SealError::Truncated(len));
        } else {
            assert_eq!(err, SealError::Authentication, "len {len}");
        }
    }
    let mut longer = blob.clone();
    longer.push(0);
    assert_eq!(
        TlsServer::import_sealed(&key, &longer).unwrap_err(),
        SealError::Authentication
    );
}

#[test]
fn unsealed_snapshot_is_not_accepted_as_sealed() {
    let p = busy_pair();
    let mut plain = Vec::new();
    p.server.export(&mut plain).unwrap();
    let err = TlsServer::import_sealed(&key(), &plain).unwrap_err();
    assert!(matches!(err, SealError::Magic(_)), "{err}");
    assert!(err.to_string().contains("not a sealed TLS snapshot"));
}

#[test]
fn handshaking_session_is_not_exported_and_out_is_untouched() {
    let cert = test_cert();
    let server = TlsServer::new(&server_config(&cert)).unwrap();
    let mut out = b"keep".to_vec();
    assert!(server.export_sealed(&key(), [0; 12], &mut out).is_err());
    assert_eq!(out, b"keep");
    assert_eq!(server.sealed_len(), 0);
}

#[test]
fn secret_rules() {
    assert_eq!(
        SealKey::derive(&[1; 15]).unwrap_err(),
        SealError::SecretTooShort { len: 15, min: 16 }
    );
    assert!(matches!(
        SealKey::from_hex("abc").unwrap_err(),
        SealError::SecretHex(_)
    ));
    assert!(matches!(
        SealKey::from_hex(&"zz".repeat(16)).unwrap_err(),
        SealError::SecretHex(_)
    ));
    assert!(matches!(
        SealKey::from_hex(&"ab".repeat(8)).unwrap_err(),
        SealError::SecretTooShort { len: 8, .. }
    ));
    assert_eq!(format!("{:?}", key()), "SealKey(<secret>)");
}

/// The derivation and layout documented in docs/TLS.md, re-implemented
/// independently with ring: it opens a real blob, and a blob sealed by hand
/// around an invalid snapshot is refused with the snapshot's own error.
fn documented_key() -> ring::aead::LessSafeKey {
    use ring::{aead, hkdf};
    let prk = hkdf::Salt::new(hkdf::HKDF_SHA256, b"capybara tls snapshot seal").extract(SECRET);
    let mut raw = [0u8; 32];
    prk.expand(
        &[b"capybara-tls v1 chacha20-poly1305 key"],
        &aead::CHACHA20_POLY1305,
    )
    .unwrap()
    .fill(&mut raw)
    .unwrap();
    aead::LessSafeKey::new(aead::UnboundKey::new(&aead::CHACHA20_POLY1305, &raw).unwrap())
}

fn seal_by_hand(plain: &[u8], nonce: [u8; 12]) -> Vec<u8> {
    use ring::aead::{Aad, Nonce};
    let mut blob = b"CPYS\x01".to_vec();
    blob.extend_from_slice(&nonce);
    let mut body = plain.to_vec();
    documented_key()
        .seal_in_place_append_tag(
            Nonce::assume_unique_for_key(nonce),
            Aad::from(&blob[..]),
            &mut body,
        )
        .unwrap();
    blob.extend_from_slice(&body);
    blob
}

#[test]
fn documented_derivation_and_layout_are_the_real_ones() {
    let p = busy_pair();
    let mut plain = Vec::new();
    p.server.export(&mut plain).unwrap();
    assert_eq!(
        seal_by_hand(&plain, [8; 12]),
        sealed(&p.server, &key(), [8; 12])
    );

    let mut bad = plain.clone();
    bad[0] = 9; // snapshot version
    let err = TlsServer::import_sealed(&key(), &seal_by_hand(&bad, [8; 12])).unwrap_err();
    assert_eq!(
        err,
        SealError::Snapshot(capybara_tls::SnapshotError::Version(9))
    );
    assert!(err.to_string().contains("content is invalid"), "{err}");
    let mut trailing = plain.clone();
    trailing.push(0);
    let err = TlsServer::import_sealed(&key(), &seal_by_hand(&trailing, [8; 12])).unwrap_err();
    assert_eq!(
        err,
        SealError::Snapshot(capybara_tls::SnapshotError::Trailing(1))
    );
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Random bytes, with or without a valid header, never panic the opener
    /// and are never accepted.
    #[test]
    fn random_bytes_are_refused(body in proptest::collection::vec(any::<u8>(), 0..400),
                                with_header in any::<bool>(),
                                nonce in any::<[u8; 12]>()) {
        let key = key();
        let mut blob = Vec::new();
        if with_header {
            blob.extend_from_slice(b"CPYS\x01");
            blob.extend_from_slice(&nonce);
        }
        blob.extend_from_slice(&body);
        prop_assert!(TlsServer::import_sealed(&key, &blob).is_err());
    }

    /// Any nonce round-trips; any single-bit flip or splice is refused.
    #[test]
    fn any_nonce_round_trips_and_any_bit_flip_is_refused(nonce in any::<[u8; 12]>(),
                                                          pos in any::<prop::sample::Index>(),
                                                          bit in 0u8..8) {
        let p = busy_pair();
        let key = key();
        let blob = sealed(&p.server, &key, nonce);
        prop_assert!(TlsServer::import_sealed(&key, &blob).is_ok());
        let mut bad = blob.clone();
        let i = pos.index(bad.len());
        bad[i] ^= 1 << bit;
        prop_assert!(TlsServer::import_sealed(&key, &bad).is_err());
    }
}
