//! Certificate rotation (`TlsConfig::reload_pem_files`): new handshakes get
//! the new certificate; sessions made before (established, handshaking,
//! or exported and imported after the reload) go on; a reload that fails
//! leaves the configuration as it was.

mod common;

use capybara_tls::{TlsConfig, TlsServer};
use common::*;
use rustls::pki_types::ServerName;
use rustls::ClientConnection;

#[test]
fn reload_changes_new_handshakes_only() {
    let dir = std::env::temp_dir().join(format!("capybara-tls-reload-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (cert_path, key_path) = (dir.join("cert.pem"), dir.join("key.pem"));
    let install = |c: &TestCert| {
        std::fs::write(&cert_path, &c.cert_pem).unwrap();
        std::fs::write(&key_path, &c.key_pem).unwrap();
    };
    let (a, b) = (test_cert(), test_cert());
    install(&a);
    let cfg = TlsConfig::from_pem_files(&cert_path, &key_path).unwrap();

    // Established with A; another one half-way through its handshake.
    let mut held = handshake_with(&a, cfg.clone(), None);
    let name = ServerName::try_from("localhost").unwrap();
    let mut halfway_client = ClientConnection::new(client_config(&a, None), name).unwrap();
    let mut halfway = TlsServer::new(&cfg).unwrap();
    halfway
        .feed_ciphertext(&client_flush(&mut halfway_client))
        .unwrap();

    install(&b);
    let next = cfg.reload_pem_files(&cert_path, &key_path).unwrap();
    assert_eq!(next.certificate().sha256, ring_sha256(&b.cert_der));

    // A client that trusts only B completes a handshake with the new
    // configuration (it would fail with A).
    let fresh = handshake_with(&b, next.clone(), None);
    assert_eq!(
        fresh.client.peer_certificates().unwrap()[0].as_ref(),
        b.cert_der.as_ref()
    );
    // One counter for the service across the reload.
    assert_eq!(next.handshakes_completed(), 2);

    // The half-done handshake finishes with A.
    let mut out = Vec::new();
    halfway.take_ciphertext_to_send(&mut out);
    client_receive(&mut halfway_client, &out);
    halfway
        .feed_ciphertext(&client_flush(&mut halfway_client))
        .unwrap();
    assert!(!halfway.is_handshaking() && !halfway_client.is_handshaking());
    assert_eq!(
        halfway_client.peer_certificates().unwrap()[0].as_ref(),
        a.cert_der.as_ref()
    );

    // The session established with A moves to "another host" after the
    // reload and continues byte-exact.
    let mut moved = migrate(held.server);
    let ct = client_send(&mut held.client, b"after the reload");
    moved.feed_ciphertext(&ct).unwrap();
    assert_eq!(drain_plaintext(&mut moved), b"after the reload");
    moved.write_plaintext(b"still A's session").unwrap();
    let mut out = Vec::new();
    moved.take_ciphertext_to_send(&mut out);
    assert_eq!(client_receive(&mut held.client, &out), b"still A's session");

    // A failed reload changes nothing: `next` still serves B.
    std::fs::write(
        &key_path,
        "-----BEGIN ENCRYPTED PRIVATE KEY-----\nAA==\n-----END ENCRYPTED PRIVATE KEY-----\n",
    )
    .unwrap();
    let e = next.reload_pem_files(&cert_path, &key_path).unwrap_err();
    assert!(e.to_string().contains("encrypted"), "{e}");
    std::fs::write(&key_path, &a.key_pem).unwrap();
    let e = next.reload_pem_files(&cert_path, &key_path).unwrap_err();
    assert!(e.to_string().contains("rejected by rustls"), "{e}");
    let again = handshake_with(&b, next.clone(), None);
    assert_eq!(
        again.client.peer_certificates().unwrap()[0].as_ref(),
        b.cert_der.as_ref()
    );
    let _ = std::fs::remove_dir_all(&dir);
}

fn ring_sha256(der: &[u8]) -> String {
    use std::fmt::Write;
    let d = ring::digest::digest(&ring::digest::SHA256, der);
    d.as_ref().iter().fold(String::new(), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}
