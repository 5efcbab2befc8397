//! Migratable TLS termination for the hostagent sidecar (seed 000 §6, App. A).
//!
//! A [`TlsServer`] is a sans-IO TLS 1.3 server session: it takes ciphertext
//! received on a TCP connection and yields ciphertext to send, plaintext for
//! the application, and nothing else (no sockets, no clock). rustls runs the
//! handshake; once it is complete, the session's record-layer state (suite,
//! keys, IVs, sequence numbers, and the traffic secrets for KeyUpdate) moves
//! into our own record layer, whose whole state can be exported at any byte
//! of either stream — mid-record included — and imported on another host
//! ([`TlsServer::export`], [`TlsServer::import`]) with no new handshake.
//!
//! The snapshot holds the session keys and TCPMig does not encrypt: send it
//! sealed ([`TlsServer::export_sealed`] / [`TlsServer::import_sealed`],
//! ChaCha20-Poly1305 under a [`SealKey`] derived from the deployment secret).
//!
//! TLS 1.3 and TLS 1.2 (AEAD suites) are offered; docs/TLS.md lists the limits.
//!
//! ```no_run
//! use capybara_tls::{TlsConfig, TlsServer};
//!
//! fn main() -> Result<(), Box<dyn std::error::Error>> {
//!     let cfg = TlsConfig::from_pem_files("cert.pem", "key.pem")?;
//!     let mut tls = TlsServer::new(&cfg)?;
//!     let from_tcp: Vec<u8> = Vec::new(); // bytes read from the TCP connection
//!     let mut to_tcp = Vec::new();
//!     tls.feed_ciphertext(&from_tcp)?; // handshake and records
//!     tls.take_ciphertext_to_send(&mut to_tcp); // always after feed/write
//!     let mut buf = [0u8; 4096];
//!     let _n = tls.read_plaintext(&mut buf);
//!     if tls.can_export() {
//!         tls.write_plaintext(b"response")?;
//!         // Migration. Origin:
//!         let mut snapshot = Vec::new();
//!         tls.export(&mut snapshot)?;
//!         // Target (another host): continues the stream, no handshake.
//!         let _tls = TlsServer::import(&snapshot)?;
//!     }
//!     Ok(())
//! }
//! ```

mod certinfo;
mod config;
mod error;
mod keys;
pub mod record;
mod seal;
mod server;
mod snapshot;

pub use certinfo::CertInfo;
pub use config::TlsConfig;
pub use error::{Alert, ConfigError, SnapshotError, TlsError};
pub use keys::{Protocol, Suite};
pub use seal::{SealError, SealKey, SEALED_VERSION, SEAL_OVERHEAD};
pub use server::TlsServer;
pub use snapshot::VERSION as SNAPSHOT_VERSION;

/// Re-exported so that callers can build certificate chains and keys
/// without naming the crate version themselves.
pub use rustls_pki_types::{CertificateDer, PrivateKeyDer};

/// Compile-time check: sessions move between tasks and threads; the config
/// is shared by all of a service's sessions.
const _: fn() = || {
    fn send<T: Send>() {}
    fn send_sync<T: Send + Sync>() {}
    send::<TlsServer>();
    send_sync::<TlsConfig>();
};
