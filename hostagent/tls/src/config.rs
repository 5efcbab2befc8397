//! Server configuration: a rustls `ServerConfig` restricted to what the
//! migratable record layer implements, plus the hook that hands each
//! session its traffic secrets (for KeyUpdate after a migration).

use std::collections::VecDeque;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use rustls::crypto::ring as provider;
use rustls::ServerConfig;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

use crate::error::ConfigError;
use crate::keys::Secret;

/// Secrets logged but not collected yet. Bounded: abandoned handshakes
/// cannot grow it (oldest entries go first).
const MAX_PENDING_SECRETS: usize = 4096;

/// rustls reports the application traffic secrets through the `KeyLog`
/// interface, keyed by the ClientHello random; each `TlsServer` collects
/// its own (it reads the random from the ClientHello it was fed). The
/// random is public, so several handshakes may claim one: a session takes
/// only the secrets that derive the keys rustls handed it, never another
/// session's.
#[derive(Default)]
pub(crate) struct SecretLog {
    inner: Mutex<VecDeque<Logged>>,
}

struct Logged {
    random: [u8; 32],
    client: bool,
    secret: Secret,
}

impl std::fmt::Debug for SecretLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SecretLog")
    }
}

impl SecretLog {
    /// Removes and returns the secret logged for `client_random` in the
    /// given direction that satisfies `belongs` (derives this session's keys).
    pub(crate) fn take(
        &self,
        client_random: &[u8; 32],
        client: bool,
        belongs: impl Fn(&Secret) -> bool,
    ) -> Option<Secret> {
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let at = inner
            .iter()
            .position(|l| l.random == *client_random && l.client == client && belongs(&l.secret))?;
        inner.remove(at).map(|l| l.secret)
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.inner.lock().unwrap().len()
    }
}

impl rustls::KeyLog for SecretLog {
    fn will_log(&self, label: &str) -> bool {
        matches!(label, "CLIENT_TRAFFIC_SECRET_0" | "SERVER_TRAFFIC_SECRET_0")
    }

    fn log(&self, label: &str, client_random: &[u8], secret: &[u8]) {
        let client = match label {
            "CLIENT_TRAFFIC_SECRET_0" => true,
            "SERVER_TRAFFIC_SECRET_0" => false,
            _ => return,
        };
        let (Ok(random), Some(secret)) = (<[u8; 32]>::try_from(client_random), Secret::new(secret))
        else {
            return;
        };
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        while inner.len() >= MAX_PENDING_SECRETS {
            inner.pop_front();
        }
        inner.push_back(Logged {
            random,
            client,
            secret,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustls::KeyLog;

    #[test]
    fn secret_log_is_bounded_and_matches_by_key() {
        let log = SecretLog::default();
        let r = [7u8; 32];
        for i in 0..(MAX_PENDING_SECRETS + 10) {
            log.log("CLIENT_TRAFFIC_SECRET_0", &r, &[i as u8; 32]);
        }
        assert_eq!(log.len(), MAX_PENDING_SECRETS);
        log.log("CLIENT_HANDSHAKE_TRAFFIC_SECRET", &r, &[1; 32]);
        assert_eq!(log.len(), MAX_PENDING_SECRETS);
        // Same random, several secrets: only the one that belongs is taken.
        let got = log.take(&r, true, |s| s.as_bytes()[0] == 200).unwrap();
        assert_eq!(got.as_bytes(), &[200u8; 32]);
        assert!(log.take(&r, false, |_| true).is_none());
        assert!(log.take(&[8u8; 32], true, |_| true).is_none());
    }
}

/// Shared per-service TLS configuration; cheap to clone.
#[derive(Clone, Debug)]
pub struct TlsConfig {
    pub(crate) server: Arc<ServerConfig>,
    pub(crate) secrets: Arc<SecretLog>,
    pub(crate) handshakes: Arc<AtomicU64>,
    /// The leaf certificate (for [`certificate`](Self::certificate)).
    leaf: CertificateDer<'static>,
}

impl TlsConfig {
    /// Loads a PEM certificate chain (leaf first) and a PEM private key.
    pub fn from_pem_files(
        cert_path: impl AsRef<Path>,
        key_path: impl AsRef<Path>,
    ) -> Result<TlsConfig, ConfigError> {
        let read = |what: &'static str, path: &Path| {
            std::fs::read(path).map_err(|source| ConfigError::Io {
                what,
                path: path.to_path_buf(),
                source,
            })
        };
        let cert = read("certificate", cert_path.as_ref())?;
        let key = read("private key", key_path.as_ref())?;
        Self::from_pem_named(
            &cert,
            &cert_path.as_ref().display().to_string(),
            &key,
            &key_path.as_ref().display().to_string(),
        )
    }

    /// Same as [`from_pem_files`](Self::from_pem_files) from bytes in memory.
    pub fn from_pem(cert_pem: &[u8], key_pem: &[u8]) -> Result<TlsConfig, ConfigError> {
        Self::from_pem_named(cert_pem, "certificate PEM", key_pem, "private key PEM")
    }

    fn from_pem_named(
        cert_pem: &[u8],
        cert_name: &str,
        key_pem: &[u8],
        key_name: &str,
    ) -> Result<TlsConfig, ConfigError> {
        let certs = CertificateDer::pem_slice_iter(cert_pem)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| ConfigError::Pem {
                what: cert_name.to_string(),
                why: e.to_string(),
            })?;
        if certs.is_empty() {
            return Err(ConfigError::NoCertificate(cert_name.to_string()));
        }
        // Said before parsing: an encrypted block is no key block to the
        // parser ("no private key block found" sent people looking for a
        // missing key).
        let has = |needle: &[u8]| key_pem.windows(needle.len()).any(|w| w == needle);
        if has(b"-----BEGIN ENCRYPTED PRIVATE KEY-----") || has(b"Proc-Type: 4,ENCRYPTED") {
            return Err(ConfigError::EncryptedKey(key_name.to_string()));
        }
        let key = PrivateKeyDer::from_pem_slice(key_pem).map_err(|e| match e {
            rustls_pki_types::pem::Error::NoItemsFound => ConfigError::NoKey(key_name.to_string()),
            e => ConfigError::Pem {
                what: key_name.to_string(),
                why: e.to_string(),
            },
        })?;
        Self::from_chain(certs, key)
    }

    /// Builds from a parsed chain and key.
    pub fn from_chain(
        certs: Vec<CertificateDer<'static>>,
        key: PrivateKeyDer<'static>,
    ) -> Result<TlsConfig, ConfigError> {
        Self::build(
            certs,
            key,
            Arc::new(SecretLog::default()),
            Arc::new(AtomicU64::new(0)),
        )
    }

    /// A configuration with the certificate chain and key now in these
    /// files and everything else of this one (ALPN, the handshake counter,
    /// the secret log): what a certificate rotation swaps in for new
    /// handshakes. Sessions made from `self` are unaffected (each holds its
    /// own configuration), and `self` stays usable when this fails.
    pub fn reload_pem_files(
        &self,
        cert_path: impl AsRef<Path>,
        key_path: impl AsRef<Path>,
    ) -> Result<TlsConfig, ConfigError> {
        let fresh = Self::from_pem_files(cert_path, key_path)?;
        let certs = fresh.server.cert_resolver.clone();
        let mut server = (*self.server).clone();
        server.cert_resolver = certs;
        Ok(TlsConfig {
            server: Arc::new(server),
            secrets: self.secrets.clone(),
            handshakes: self.handshakes.clone(),
            leaf: fresh.leaf,
        })
    }

    /// The leaf certificate new handshakes present: subject, expiry and
    /// fingerprint, for logs.
    pub fn certificate(&self) -> crate::certinfo::CertInfo {
        crate::certinfo::CertInfo::of(&self.leaf)
    }

    fn build(
        certs: Vec<CertificateDer<'static>>,
        key: PrivateKeyDer<'static>,
        secrets: Arc<SecretLog>,
        handshakes: Arc<AtomicU64>,
    ) -> Result<TlsConfig, ConfigError> {
        let leaf = certs
            .first()
            .cloned()
            .ok_or_else(|| ConfigError::NoCertificate("certificate chain".into()))?;
        let mut server =
            ServerConfig::builder_with_provider(Arc::new(provider::default_provider()))
                // The migratable record layer implements both (AEAD suites
                // only, which is all rustls offers).
                .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
                .map_err(ConfigError::Rustls)?
                .with_no_client_auth()
                .with_single_cert(certs, key)
                .map_err(ConfigError::Rustls)?;
        server.enable_secret_extraction = true;
        server.key_log = secrets.clone();
        // Tickets would name the origin's in-memory session cache, useless
        // after a migration; resumption with them is host-local anyway.
        server.send_tls13_tickets = 0;
        server.max_early_data_size = 0;
        Ok(TlsConfig {
            server: Arc::new(server),
            secrets,
            handshakes,
            leaf,
        })
    }

    /// Sets the ALPN protocols to select from (default none: the client's
    /// default applies, HTTP/1.1 for curl). E.g. `vec![b"http/1.1".to_vec()]`.
    pub fn with_alpn(mut self, protocols: Vec<Vec<u8>>) -> TlsConfig {
        let mut server = (*self.server).clone();
        server.alpn_protocols = protocols;
        self.server = Arc::new(server);
        self
    }

    /// Full handshakes completed with this configuration (migrations do not
    /// count: an imported session never handshakes).
    pub fn handshakes_completed(&self) -> u64 {
        self.handshakes.load(Ordering::Relaxed)
    }
}
