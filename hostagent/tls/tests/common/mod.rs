//! Test harness: a real rustls client talking to our server in memory.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::sync::Arc;

use capybara_tls::{TlsConfig, TlsServer};
pub use capybara_tls_testcerts::{test_cert, TestCert};
use rustls::crypto::ring as provider;
use rustls::pki_types::ServerName;
use rustls::{ClientConfig, ClientConnection, RootCertStore, SupportedCipherSuite};

pub fn server_config(cert: &TestCert) -> TlsConfig {
    TlsConfig::from_pem(cert.cert_pem.as_bytes(), cert.key_pem.as_bytes()).expect("server config")
}

pub fn client_config(cert: &TestCert, suite: Option<SupportedCipherSuite>) -> Arc<ClientConfig> {
    let mut p = provider::default_provider();
    if let Some(s) = suite {
        p.cipher_suites = vec![s];
    }
    let mut roots = RootCertStore::empty();
    roots.add(cert.cert_der.clone()).unwrap();
    // A TLS 1.2 suite makes a TLS 1.2-only client.
    let versions: &[&rustls::SupportedProtocolVersion] = match suite {
        Some(SupportedCipherSuite::Tls12(_)) => &[&rustls::version::TLS12],
        _ => &[&rustls::version::TLS13],
    };
    Arc::new(
        ClientConfig::builder_with_provider(Arc::new(p))
            .with_protocol_versions(versions)
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth(),
    )
}

pub struct Pair {
    pub client: ClientConnection,
    pub server: TlsServer,
    pub cfg: TlsConfig,
}

/// Ciphertext the client wants to send.
pub fn client_flush(client: &mut ClientConnection) -> Vec<u8> {
    let mut out = Vec::new();
    while client.wants_write() {
        client.write_tls(&mut out).unwrap();
    }
    out
}

/// Gives ciphertext to the client; returns the plaintext it yields.
pub fn client_receive(client: &mut ClientConnection, mut ct: &[u8]) -> Vec<u8> {
    let mut pt = Vec::new();
    while !ct.is_empty() {
        client.read_tls(&mut ct).unwrap();
        client
            .process_new_packets()
            .expect("client rejected server records");
        read_client_plaintext(client, &mut pt);
    }
    pt
}

pub fn read_client_plaintext(client: &mut ClientConnection, pt: &mut Vec<u8>) {
    let mut buf = [0u8; 8192];
    loop {
        match client.reader().read(&mut buf) {
            Ok(0) => break,
            Ok(n) => pt.extend_from_slice(&buf[..n]),
            Err(_) => break,
        }
    }
}

pub fn client_send(client: &mut ClientConnection, data: &[u8]) -> Vec<u8> {
    client.writer().write_all(data).unwrap();
    client_flush(client)
}

pub fn handshake_with(
    cert: &TestCert,
    cfg: TlsConfig,
    suite: Option<SupportedCipherSuite>,
) -> Pair {
    let name = ServerName::try_from("localhost").unwrap();
    let mut client = ClientConnection::new(client_config(cert, suite), name).unwrap();
    let mut server = TlsServer::new(&cfg).unwrap();
    for _ in 0..10 {
        let ct = client_flush(&mut client);
        server.feed_ciphertext(&ct).expect("server handshake");
        let mut out = Vec::new();
        server.take_ciphertext_to_send(&mut out);
        let pt = client_receive(&mut client, &out);
        assert!(pt.is_empty());
        if !client.is_handshaking() && !server.is_handshaking() && !client.wants_write() {
            return Pair {
                client,
                server,
                cfg,
            };
        }
    }
    panic!("handshake did not complete");
}

pub fn handshake() -> (TestCert, Pair) {
    let cert = test_cert();
    let cfg = server_config(&cert);
    let pair = handshake_with(&cert, cfg, None);
    (cert, pair)
}

/// Moves a session to a "different host": export, drop, import.
pub fn migrate(server: TlsServer) -> TlsServer {
    let mut snap = Vec::new();
    server.export(&mut snap).expect("export");
    assert_eq!(snap.len(), server.snapshot_len());
    drop(server);
    TlsServer::import(&snap).expect("import")
}

pub fn drain_plaintext(server: &mut TlsServer) -> Vec<u8> {
    let mut out = Vec::new();
    let mut buf = [0u8; 7000];
    loop {
        let n = server.read_plaintext(&mut buf);
        if n == 0 {
            return out;
        }
        out.extend_from_slice(&buf[..n]);
    }
}

/// Deterministic pseudo-random bytes (xorshift), so failures reproduce.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
}
