//! A real rustls client against our server, in memory: handshake, data both
//! ways, migration (export -> import on a fresh session, i.e. another host)
//! at every byte offset of a multi-record stream, KeyUpdate, alerts and
//! corrupt records.

mod common;

use capybara_tls::{Alert, Suite, TlsError, TlsServer};
use common::*;
use rustls::crypto::ring::cipher_suite;

#[test]
fn handshake_and_data_both_ways_for_every_suite() {
    let cert = test_cert();
    let cfg = server_config(&cert);
    for (suite, expect) in [
        (
            cipher_suite::TLS13_AES_128_GCM_SHA256,
            Suite::Aes128GcmSha256,
        ),
        (
            cipher_suite::TLS13_AES_256_GCM_SHA384,
            Suite::Aes256GcmSha384,
        ),
        (
            cipher_suite::TLS13_CHACHA20_POLY1305_SHA256,
            Suite::Chacha20Poly1305Sha256,
        ),
    ] {
        let mut p = handshake_with(&cert, cfg.clone(), Some(suite));
        assert_eq!(p.server.suite(), Some(expect));
        assert!(p.server.supports_key_update(), "traffic secrets collected");
        let ct = client_send(&mut p.client, b"GET / HTTP/1.1\r\n\r\n");
        p.server.feed_ciphertext(&ct).unwrap();
        assert_eq!(drain_plaintext(&mut p.server), b"GET / HTTP/1.1\r\n\r\n");
        let big: Vec<u8> = (0..40_000u32).map(|i| i as u8).collect();
        p.server.write_plaintext(&big).unwrap();
        let mut out = Vec::new();
        p.server.take_ciphertext_to_send(&mut out);
        assert_eq!(client_receive(&mut p.client, &out), big);
    }
    assert_eq!(cfg.handshakes_completed(), 3);
}

/// The client's stream (several records, one larger than a record, and a
/// KeyUpdate) is cut
/// at every byte offset; the origin exports there and a fresh session
/// imports and continues. The plaintext is byte-exact in every case.
#[test]
fn migrate_at_every_byte_offset_of_client_stream() {
    let (_cert, mut p) = handshake();
    let mut msg = Vec::new();
    let mut ct = Vec::new();
    for (i, len) in [1usize, 300, 17_000, 5, 2_000].into_iter().enumerate() {
        let part: Vec<u8> = (0..len).map(|j| (i * 31 + j) as u8).collect();
        ct.extend(client_send(&mut p.client, &part));
        msg.extend(part);
        if i == 2 {
            // A KeyUpdate record in the middle: cut at each of its bytes too.
            p.client.refresh_traffic_keys().unwrap();
            ct.extend(client_flush(&mut p.client));
        }
    }
    let mut base = Vec::new();
    p.server.export(&mut base).unwrap();
    for k in 0..=ct.len() {
        let mut origin = TlsServer::import(&base).unwrap();
        origin.feed_ciphertext(&ct[..k]).unwrap();
        // Read some of what arrived before the move; the rest travels as
        // undelivered plaintext.
        let mut got = vec![0u8; k % 977];
        let n = origin.read_plaintext(&mut got);
        got.truncate(n);
        let mut target = migrate(origin);
        target.feed_ciphertext(&ct[k..]).unwrap();
        got.extend(drain_plaintext(&mut target));
        assert_eq!(got, msg, "cut at byte {k}");
    }
}

/// A long-lived connection migrated after every operation (hundreds of
/// times), with client bytes delivered in pieces that split records, data
/// in both directions, pending ciphertext travelling in the snapshot, and
/// KeyUpdates in the middle. No second handshake.
#[test]
fn hundreds_of_migrations_mid_record_both_directions() {
    let (_cert, mut p) = handshake();
    let mut rng = Rng(0x5eed);
    let mut server = p.server;
    let (mut sent_up, mut got_up) = (Vec::new(), Vec::new());
    let (mut sent_down, mut got_down) = (Vec::new(), Vec::new());
    let mut in_flight: Vec<u8> = Vec::new(); // client ciphertext not yet delivered
    let mut migrations = 0;
    for round in 0..600 {
        // Client writes (sometimes several records at once).
        if rng.below(3) != 0 {
            let len = 1 + rng.below(if round % 50 == 0 { 40_000 } else { 3_000 });
            let data = rng.bytes(len);
            in_flight.extend(client_send(&mut p.client, &data));
            sent_up.extend(data);
        }
        if round % 97 == 13 {
            p.client.refresh_traffic_keys().unwrap();
            in_flight.extend(client_flush(&mut p.client));
        }
        // Deliver an arbitrary prefix: usually cuts a record.
        let n = rng.below(in_flight.len() + 1);
        server.feed_ciphertext(&in_flight[..n]).unwrap();
        in_flight.drain(..n);
        let mut buf = vec![0u8; rng.below(5_000)];
        let r = server.read_plaintext(&mut buf);
        got_up.extend_from_slice(&buf[..r]);
        // Server writes; sometimes the ciphertext is taken before the move,
        // sometimes it travels in the snapshot.
        if rng.below(2) == 0 {
            let len = rng.below(20_000);
            let data = rng.bytes(len);
            server.write_plaintext(&data).unwrap();
            sent_down.extend(data);
        }
        if rng.below(2) == 0 {
            let mut out = Vec::new();
            server.take_ciphertext_to_send(&mut out);
            got_down.extend(client_receive(&mut p.client, &out));
        }
        server = migrate(server);
        migrations += 1;
    }
    server.feed_ciphertext(&in_flight).unwrap();
    got_up.extend(drain_plaintext(&mut server));
    let mut out = Vec::new();
    server.take_ciphertext_to_send(&mut out);
    got_down.extend(client_receive(&mut p.client, &out));
    assert_eq!(got_up, sent_up);
    assert_eq!(got_down, sent_down);
    assert!(migrations >= 600);
    assert_eq!(
        p.cfg.handshakes_completed(),
        1,
        "no handshake after the first"
    );
}

#[test]
fn close_notify_from_client_is_a_clean_eof() {
    let (_cert, mut p) = handshake();
    let mut ct = client_send(&mut p.client, b"last words");
    p.client.send_close_notify();
    ct.extend(client_flush(&mut p.client));
    // Migrate between the data and the close.
    p.server.feed_ciphertext(&ct[..ct.len() - 3]).unwrap();
    let mut s = migrate(p.server);
    s.feed_ciphertext(&ct[ct.len() - 3..]).unwrap();
    assert!(s.peer_closed());
    assert!(!s.is_eof());
    assert_eq!(drain_plaintext(&mut s), b"last words");
    assert!(s.is_eof());
    // Bytes after close_notify are ignored, not an error.
    s.feed_ciphertext(b"\x17\x03\x03\x00\x10garbage").unwrap();
    // Our close_notify reaches the client as a clean close.
    s.write_plaintext(b"bye").unwrap();
    s.send_close_notify();
    assert!(matches!(
        s.write_plaintext(b"more"),
        Err(TlsError::WriteAfterClose)
    ));
    let s = migrate(s);
    assert!(s.close_sent() && s.peer_closed());
    let mut s = s;
    let mut out = Vec::new();
    s.take_ciphertext_to_send(&mut out);
    let pt = client_receive(&mut p.client, &out);
    assert_eq!(pt, b"bye");
    let mut buf = [0u8; 8];
    assert_eq!(
        std::io::Read::read(&mut p.client.reader(), &mut buf).unwrap(),
        0,
        "clean EOF"
    );
}

fn expect_fatal(server: &mut TlsServer, ct: &[u8], want_alert: Alert) -> TlsError {
    // The client's view of the keys, to open the alert we send.
    let mut client_view = server.testing_mirror().unwrap();
    let err = server.feed_ciphertext(ct).expect_err("must fail");
    assert!(server.is_failed());
    assert!(!server.can_export());
    let mut out = Vec::new();
    server.take_ciphertext_to_send(&mut out);
    assert_eq!(out.len(), 5 + 2 + 1 + 16, "exactly one alert record queued");
    match client_view.feed_ciphertext(&out) {
        Err(TlsError::PeerAlert(a)) => assert_eq!(a, want_alert, "for {err}"),
        other => panic!("expected alert {want_alert:?}, got {other:?} for {err}"),
    }
    // Further use reports the earlier failure.
    assert!(matches!(
        server.feed_ciphertext(b"x"),
        Err(TlsError::Failed(_))
    ));
    assert!(matches!(
        server.write_plaintext(b"x"),
        Err(TlsError::Failed(_))
    ));
    err
}

#[test]
fn corrupted_record_is_bad_record_mac() {
    let (_cert, mut p) = handshake();
    let mut ct = client_send(&mut p.client, b"hello there");
    let last = ct.len() - 1;
    ct[last] ^= 1;
    let e = expect_fatal(&mut p.server, &ct, Alert::BadRecordMac);
    assert!(matches!(e, TlsError::BadRecordMac { seq: 0 }), "{e}");
}

#[test]
fn client_alert_record_is_decrypted_and_reported() {
    let (_cert, mut p) = handshake();
    let mut client = p.server.testing_mirror().unwrap();
    // Unknown fatal alert (handshake_failure) from the client.
    client.testing_seal_raw(21, &[2, 40]).unwrap();
    let mut ct = Vec::new();
    client.take_ciphertext_to_send(&mut ct);
    let e = p.server.feed_ciphertext(&ct).unwrap_err();
    assert!(
        matches!(e, TlsError::PeerAlert(Alert::HandshakeFailure)),
        "{e}"
    );
    let mut out = Vec::new();
    p.server.take_ciphertext_to_send(&mut out);
    assert!(out.is_empty(), "no alert answers an alert");
}

/// Records with a valid MAC but illegal content, crafted with the client's
/// keys: each fails with a clear error and an alert, never a panic.
#[test]
fn illegal_protected_content_is_rejected_with_an_alert() {
    let cases: Vec<(u8, Vec<u8>, Alert, &str)> = vec![
        (
            21,
            vec![1],
            Alert::DecodeError,
            "alert record must hold exactly one alert",
        ),
        (
            21,
            vec![1, 0, 1, 0],
            Alert::DecodeError,
            "alert record must hold exactly one alert",
        ),
        (
            22,
            vec![4, 0, 0, 0],
            Alert::UnexpectedMessage,
            "post-handshake message other than KeyUpdate",
        ),
        (
            22,
            vec![24, 0, 0, 2, 0, 0],
            Alert::DecodeError,
            "KeyUpdate length must be 1",
        ),
        (
            22,
            vec![24, 0, 0, 1, 7],
            Alert::DecodeError,
            "KeyUpdate request must be 0 or 1",
        ),
        (
            22,
            vec![24, 0, 0, 1, 0, 24],
            Alert::UnexpectedMessage,
            "data after KeyUpdate",
        ),
        (22, vec![], Alert::DecodeError, "empty handshake record"),
        (
            20,
            vec![1],
            Alert::UnexpectedMessage,
            "unknown protected content type",
        ),
        (
            99,
            vec![1],
            Alert::UnexpectedMessage,
            "unknown protected content type",
        ),
        (
            0,
            vec![],
            Alert::UnexpectedMessage,
            "without a content type",
        ),
        (
            23,
            vec![0xaa; (1 << 14) + 1],
            Alert::RecordOverflow,
            "record of 16385 bytes",
        ),
    ];
    let (_cert, p) = handshake();
    let mut base = Vec::new();
    p.server.export(&mut base).unwrap();
    for (typ, content, alert, msg) in cases {
        let mut server = TlsServer::import(&base).unwrap();
        let mut client = server.testing_mirror().unwrap();
        client.testing_seal_raw(typ, &content).unwrap();
        let mut ct = Vec::new();
        client.take_ciphertext_to_send(&mut ct);
        let e = expect_fatal(&mut server, &ct, alert);
        assert!(
            e.to_string().contains(msg),
            "type {typ}: got {e}, want {msg}"
        );
    }
}

#[test]
fn malformed_record_headers_are_rejected() {
    let (_cert, p) = handshake();
    let mut base = Vec::new();
    p.server.export(&mut base).unwrap();
    for (bytes, alert) in [
        (&b"\x16\x03\x03\x00\x05hello"[..], Alert::UnexpectedMessage), // plaintext handshake
        (&b"\x14\x03\x03\x00\x01\x01"[..], Alert::UnexpectedMessage),  // late CCS
        (&b"\x30\x03\x03\x00\x01\x01"[..], Alert::UnexpectedMessage),  // unknown type
        (&b"\x17\x04\x03\x00\x01\x01"[..], Alert::DecodeError),        // not TLS
        (&b"\x17\x03\x03\x41\x01"[..], Alert::RecordOverflow),         // 16641 > 2^14+256
        (&b"\x17\x03\x03\x00\x05hello"[..], Alert::DecodeError),       // shorter than a tag
    ] {
        let mut server = TlsServer::import(&base).unwrap();
        expect_fatal(&mut server, bytes, alert);
    }
}

#[test]
fn key_update_from_client_split_across_records_and_migrations() {
    let (_cert, mut p) = handshake();
    let mut client = p.server.testing_mirror().unwrap();
    // KeyUpdate(update_requested) fragmented over two records, with a
    // migration in between (the partial message travels in the snapshot).
    client.testing_seal_raw(22, &[24, 0]).unwrap();
    let mut ct = Vec::new();
    client.take_ciphertext_to_send(&mut ct);
    p.server.feed_ciphertext(&ct).unwrap();
    let mut server = migrate(p.server);
    client.testing_seal_raw(22, &[0, 1, 1]).unwrap();
    let mut ct = Vec::new();
    client.take_ciphertext_to_send(&mut ct);
    server.feed_ciphertext(&ct).unwrap();
    // The server answered with its own KeyUpdate; the mirror must follow it.
    let mut out = Vec::new();
    server.take_ciphertext_to_send(&mut out);
    assert!(!out.is_empty());
    // The client view has not updated its keys: do it the way a client does.
    // (Our mirror has no "client" logic, so rebuild it from the server.)
    let mut client2 = server.testing_mirror().unwrap();
    client2.write_plaintext(b"after update").unwrap();
    let mut ct = Vec::new();
    client2.take_ciphertext_to_send(&mut ct);
    let mut server = migrate(server);
    server.feed_ciphertext(&ct).unwrap();
    assert_eq!(drain_plaintext(&mut server), b"after update");
    // A real client after a real KeyUpdate is covered in
    // hundreds_of_migrations_mid_record_both_directions.
    let _ = p.client;
}

#[test]
fn export_refused_during_handshake_and_after_failure() {
    let cert = test_cert();
    let cfg = server_config(&cert);
    let s = TlsServer::new(&cfg).unwrap();
    let mut out = Vec::new();
    assert!(matches!(
        s.export(&mut out),
        Err(TlsError::NotExportable(_))
    ));
    assert!(out.is_empty());
    let mut s = s;
    assert!(matches!(
        s.write_plaintext(b"early"),
        Err(TlsError::Handshaking)
    ));
    // Garbage instead of a ClientHello: rustls rejects it and alerts.
    let e = s
        .feed_ciphertext(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap_err();
    assert!(matches!(e, TlsError::Handshake(_)), "{e}");
    assert!(s.is_failed());
    assert!(matches!(
        s.export(&mut out),
        Err(TlsError::NotExportable(_))
    ));
    assert_eq!(cfg.handshakes_completed(), 0);
}

#[test]
fn pem_loading_errors_name_the_problem() {
    use capybara_tls::{ConfigError, TlsConfig};
    let cert = test_cert();
    let e = TlsConfig::from_pem_files("/nonexistent/cert.pem", "/nonexistent/key.pem").unwrap_err();
    assert!(
        matches!(
            e,
            ConfigError::Io {
                what: "certificate",
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("/nonexistent/cert.pem"));
    let e = TlsConfig::from_pem(b"", cert.key_pem.as_bytes()).unwrap_err();
    assert!(matches!(e, ConfigError::NoCertificate(_)), "{e}");
    let e = TlsConfig::from_pem(cert.cert_pem.as_bytes(), cert.cert_pem.as_bytes()).unwrap_err();
    assert!(matches!(e, ConfigError::NoKey(_)), "{e}");
    // Passphrase-protected keys (PKCS#8 and legacy OpenSSL) are named as
    // such (they were "no private key block found").
    for key in [
        "-----BEGIN ENCRYPTED PRIVATE KEY-----\nMIIFHDBOBgkqhkiG9w0BBQ0wQTApBgkqhkiG9w0BBQwwHAQI\n-----END ENCRYPTED PRIVATE KEY-----\n",
        "-----BEGIN RSA PRIVATE KEY-----\nProc-Type: 4,ENCRYPTED\nDEK-Info: AES-256-CBC,00112233445566778899AABBCCDDEEFF\n\nMIIEpAIBAAKCAQEA\n-----END RSA PRIVATE KEY-----\n",
    ] {
        let e = TlsConfig::from_pem(cert.cert_pem.as_bytes(), key.as_bytes()).unwrap_err();
        assert!(matches!(e, ConfigError::EncryptedKey(_)), "{e}");
        assert!(
            e.to_string()
                .starts_with("private key PEM: the private key is encrypted"),
            "{e}"
        );
    }
    let other = test_cert();
    let e = TlsConfig::from_pem(cert.cert_pem.as_bytes(), other.key_pem.as_bytes()).unwrap_err();
    assert!(matches!(e, ConfigError::Rustls(_)), "mismatched key: {e}");
    let dir = std::env::temp_dir().join(format!("capybara-tls-pem-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("c.pem"), &cert.cert_pem).unwrap();
    std::fs::write(dir.join("k.pem"), &cert.key_pem).unwrap();
    TlsConfig::from_pem_files(dir.join("c.pem"), dir.join("k.pem")).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Before the AES-GCM record limit (RFC 8446 §5.5) the server rotates its
/// sending key with KeyUpdate; the client side follows it. The sequence
/// number is moved near the limit by editing the snapshot (bytes 14..22).
#[test]
fn server_rotates_its_key_before_the_aes_gcm_limit() {
    let (_cert, p) = handshake();
    let mut snap = Vec::new();
    p.server.export(&mut snap).unwrap();
    snap[14..22].copy_from_slice(&((1u64 << 24) - 2).to_be_bytes());
    let mut server = TlsServer::import(&snap).unwrap();
    let mut client = server.testing_mirror().unwrap();
    let data: Vec<u8> = (0..50_000u32).map(|i| (i % 251) as u8).collect();
    server.write_plaintext(&data).unwrap();
    let mut ct = Vec::new();
    server.take_ciphertext_to_send(&mut ct);
    client.feed_ciphertext(&ct).unwrap();
    assert_eq!(drain_plaintext(&mut client), data);
    let mut after = Vec::new();
    server.export(&mut after).unwrap();
    let tx_seq = u64::from_be_bytes(after[14..22].try_into().unwrap());
    assert!(tx_seq < 10, "key rotated, sequence restarted: {tx_seq}");
    let kl = server.suite().unwrap().key_len();
    let tx_key = 22 + kl + 12..22 + 2 * kl + 12;
    assert_ne!(after[tx_key.clone()], snap[tx_key], "new tx key");
    let rx_key = 22..22 + kl;
    assert_eq!(after[rx_key.clone()], snap[rx_key], "receive key unchanged");
}

/// A snapshot whose traffic secret does not belong to its keys imports (the
/// check is deferred to keep import cheap) but the first KeyUpdate fails
/// with a clear error and an alert instead of switching to wrong keys.
#[test]
fn mismatched_secret_is_caught_at_key_update() {
    let cert = test_cert();
    let p = handshake_with(
        &cert,
        server_config(&cert),
        Some(cipher_suite::TLS13_AES_128_GCM_SHA256),
    );
    let mut snap = Vec::new();
    p.server.export(&mut snap).unwrap();
    assert_eq!(snap[1] & 0b100, 0b100, "secrets present");
    snap[22 + 2 * (16 + 12)] ^= 1; // first byte of the rx secret
    let mut server = TlsServer::import(&snap).unwrap();
    let mut client = server.testing_mirror().unwrap();
    client.testing_seal_raw(22, &[24, 0, 0, 1, 0]).unwrap();
    let mut ct = Vec::new();
    client.take_ciphertext_to_send(&mut ct);
    let e = expect_fatal(&mut server, &ct, Alert::InternalError);
    assert!(matches!(e, TlsError::SecretMismatch), "{e}");
}

/// TLS 1.2 (AEAD suites: AES-GCM with explicit nonces, ChaCha20-Poly1305):
/// handshake with a rustls TLS 1.2-only client, data both ways, migration
/// at every byte offset of the client stream and after every operation.
#[test]
fn tls12_suites_migrate_at_every_byte_offset() {
    use capybara_tls::Protocol;
    let cert = test_cert();
    let cfg = server_config(&cert);
    for (suite, expect) in [
        (
            cipher_suite::TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256,
            Suite::Aes128GcmSha256,
        ),
        (
            cipher_suite::TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384,
            Suite::Aes256GcmSha384,
        ),
        (
            cipher_suite::TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256,
            Suite::Chacha20Poly1305Sha256,
        ),
    ] {
        let mut p = handshake_with(&cert, cfg.clone(), Some(suite));
        assert_eq!(p.server.protocol(), Some(Protocol::Tls12));
        assert_eq!(p.server.suite(), Some(expect));
        assert!(!p.server.supports_key_update());
        let mut msg = Vec::new();
        let mut ct = Vec::new();
        for (i, len) in [1usize, 300, 17_000, 5].into_iter().enumerate() {
            let part: Vec<u8> = (0..len).map(|j| (i * 31 + j) as u8).collect();
            ct.extend(client_send(&mut p.client, &part));
            msg.extend(part);
        }
        let mut base = Vec::new();
        p.server.export(&mut base).unwrap();
        assert_eq!(base[2..4], [0x03, 0x03], "protocol in the snapshot");
        for k in 0..=ct.len() {
            let mut origin = TlsServer::import(&base).unwrap();
            origin.feed_ciphertext(&ct[..k]).unwrap();
            let mut target = migrate(origin);
            target.feed_ciphertext(&ct[k..]).unwrap();
            assert_eq!(
                drain_plaintext(&mut target),
                msg,
                "{expect:?} cut at byte {k}"
            );
        }
        // Continue the live session: the server answers after moves.
        let mut server = migrate(p.server);
        server.feed_ciphertext(&ct[..ct.len() / 2]).unwrap();
        let mut server = migrate(server);
        server.feed_ciphertext(&ct[ct.len() / 2..]).unwrap();
        assert_eq!(drain_plaintext(&mut server), msg);
        let big: Vec<u8> = (0..40_000u32).map(|i| (i * 3) as u8).collect();
        server.write_plaintext(&big[..10_000]).unwrap();
        let mut server = migrate(server);
        server.write_plaintext(&big[10_000..]).unwrap();
        let mut out = Vec::new();
        server.take_ciphertext_to_send(&mut out);
        assert_eq!(client_receive(&mut p.client, &out), big);
        // close_notify (a warning-level alert in TLS 1.2).
        p.client.send_close_notify();
        let ct = client_flush(&mut p.client);
        server.feed_ciphertext(&ct).unwrap();
        assert!(server.is_eof());
    }
    assert_eq!(cfg.handshakes_completed(), 3);
}

/// TLS 1.2 specifics: warning alerts other than close_notify are ignored,
/// renegotiation is refused with an alert, bad MACs are caught.
#[test]
fn tls12_alerts_renegotiation_and_bad_mac() {
    let cert = test_cert();
    let p = handshake_with(
        &cert,
        server_config(&cert),
        Some(cipher_suite::TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256),
    );
    let mut base = Vec::new();
    p.server.export(&mut base).unwrap();
    // Warning alert (no_renegotiation) then data: fine.
    let mut server = TlsServer::import(&base).unwrap();
    let mut client = server.testing_mirror().unwrap();
    client.testing_seal_raw(21, &[1, 100]).unwrap();
    client.write_plaintext(b"still here").unwrap();
    let mut ct = Vec::new();
    client.take_ciphertext_to_send(&mut ct);
    server.feed_ciphertext(&ct).unwrap();
    assert_eq!(drain_plaintext(&mut server), b"still here");
    // Fatal alert.
    let mut server = TlsServer::import(&base).unwrap();
    let mut client = server.testing_mirror().unwrap();
    client.testing_seal_raw(21, &[2, 40]).unwrap();
    let mut ct = Vec::new();
    client.take_ciphertext_to_send(&mut ct);
    assert!(matches!(
        server.feed_ciphertext(&ct),
        Err(TlsError::PeerAlert(Alert::HandshakeFailure))
    ));
    // Renegotiation attempt (a ClientHello under the session keys).
    let mut server = TlsServer::import(&base).unwrap();
    let mut client = server.testing_mirror().unwrap();
    client.testing_seal_raw(22, &[1, 0, 0, 2, 3, 3]).unwrap();
    let mut ct = Vec::new();
    client.take_ciphertext_to_send(&mut ct);
    let e = expect_fatal_tls12(&mut server, &ct, Alert::UnexpectedMessage);
    assert!(e.to_string().contains("renegotiation"), "{e}");
    // Bad MAC.
    let mut server = TlsServer::import(&base).unwrap();
    let mut client = server.testing_mirror().unwrap();
    client.write_plaintext(b"payload").unwrap();
    let mut ct = Vec::new();
    client.take_ciphertext_to_send(&mut ct);
    let last = ct.len() - 1;
    ct[last] ^= 0x40;
    let e = expect_fatal_tls12(&mut server, &ct, Alert::BadRecordMac);
    // In TLS 1.2 the client's Finished was record 0 under these keys.
    assert!(matches!(e, TlsError::BadRecordMac { seq: 1 }), "{e}");
    // Late change_cipher_spec.
    let mut server = TlsServer::import(&base).unwrap();
    expect_fatal_tls12(
        &mut server,
        b"\x14\x03\x03\x00\x01\x01",
        Alert::UnexpectedMessage,
    );
}

/// Like `expect_fatal`, for TLS 1.2 alert framing (explicit nonce for GCM).
fn expect_fatal_tls12(server: &mut TlsServer, ct: &[u8], want_alert: Alert) -> TlsError {
    let mut client_view = server.testing_mirror().unwrap();
    let err = server.feed_ciphertext(ct).expect_err("must fail");
    assert!(server.is_failed());
    let mut out = Vec::new();
    server.take_ciphertext_to_send(&mut out);
    assert_eq!(out[0], 21, "TLS 1.2 alert records carry their real type");
    match client_view.feed_ciphertext(&out) {
        Err(TlsError::PeerAlert(a)) => assert_eq!(a, want_alert, "for {err}"),
        other => panic!("expected alert {want_alert:?}, got {other:?} for {err}"),
    }
    err
}

/// The server's stream cut at every byte offset: the client has received
/// that much when the session moves (the rest of the origin's ciphertext
/// reaches it from the TCP send queue, which travels with TCP); the target
/// keeps writing. The client side here is our record layer with the
/// client's keys (the rustls client checks the same path in
/// `hundreds_of_migrations_mid_record_both_directions`).
#[test]
fn migrate_at_every_byte_offset_of_server_stream() {
    let (_cert, p) = handshake();
    let mut base = Vec::new();
    p.server.export(&mut base).unwrap();
    let first: Vec<u8> = (0..20_000u32).map(|i| (i % 253) as u8).collect();
    let second = b"written by the target after the move".to_vec();
    let expected: Vec<u8> = first.iter().chain(second.iter()).copied().collect();
    // The origin's output is the same in every round (same keys and
    // sequence numbers): its length bounds the cut.
    let origin_output = |base: &[u8]| {
        let mut origin = TlsServer::import(base).unwrap();
        origin.write_plaintext(&first[..300]).unwrap();
        origin.write_plaintext(&first[300..]).unwrap();
        let mut ct = Vec::new();
        origin.take_ciphertext_to_send(&mut ct);
        (origin, ct)
    };
    let total = origin_output(&base).1.len();
    assert!(total > 20_000);
    for k in 0..=total {
        let (origin, mut ct) = origin_output(&base);
        let mut client = TlsServer::import(&base).unwrap().testing_mirror().unwrap();
        client.feed_ciphertext(&ct[..k]).unwrap();
        let mut got = drain_plaintext(&mut client);
        let mut target = migrate(origin);
        target.write_plaintext(&second).unwrap();
        target.take_ciphertext_to_send(&mut ct);
        client.feed_ciphertext(&ct[k..]).unwrap();
        got.extend(drain_plaintext(&mut client));
        assert_eq!(got, expected, "server stream cut at byte {k}");
    }
}
