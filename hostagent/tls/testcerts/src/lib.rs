//! Certificates for tests: a fresh self-signed certificate per call, so no
//! private key is stored in the repository. The one copy for capybara-tls's
//! tests and the hostagent's sidecar tests; a crate of its own, used only
//! as a dev-dependency, so that no release build carries it or rcgen (and
//! a test build compiles capybara-tls with the same features as a release
//! build).

use rustls_pki_types::CertificateDer;
use std::sync::Arc;

/// A self-signed certificate and its key: the PEM files a service reads
/// and the DER a client trusts (and compares the peer's certificate with).
pub struct TestCert {
    pub cert_pem: String,
    pub key_pem: String,
    pub cert_der: CertificateDer<'static>,
}

/// A fresh self-signed certificate for `localhost` and 127.0.0.1, subject
/// `CN=capybara test`.
pub fn test_cert() -> TestCert {
    test_cert_named("capybara test")
}

/// [`test_cert`] with subject `CN=cn`, to tell certificates apart (a
/// rotation's log line, capybara-tls's `CertInfo`).
pub fn test_cert_named(cn: &str) -> TestCert {
    let key = rcgen::KeyPair::generate().expect("rcgen key pair");
    let mut p =
        rcgen::CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".to_string()])
            .expect("rcgen certificate parameters");
    p.distinguished_name = rcgen::DistinguishedName::new();
    p.distinguished_name.push(rcgen::DnType::CommonName, cn);
    let c = p.self_signed(&key).expect("rcgen self-signed certificate");
    TestCert {
        cert_pem: c.pem(),
        key_pem: key.serialize_pem(),
        cert_der: c.der().clone(),
    }
}

/// A rustls client connection to `localhost` (ring provider, TLS 1.3 and
/// 1.2) that trusts only `trusted`: a handshake with any other certificate
/// fails.
pub fn localhost_client(trusted: &[&TestCert]) -> rustls::ClientConnection {
    let mut roots = rustls::RootCertStore::empty();
    for c in trusted {
        roots
            .add(c.cert_der.clone())
            .expect("a test certificate as a root");
    }
    let cfg = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .expect("ring's default protocol versions")
    .with_root_certificates(roots)
    .with_no_client_auth();
    let name = rustls_pki_types::ServerName::try_from("localhost").expect("localhost");
    rustls::ClientConnection::new(Arc::new(cfg), name).expect("a rustls client connection")
}
