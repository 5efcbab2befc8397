//! Sealed TLS snapshots: the session snapshot encrypted and authenticated
//! with ChaCha20-Poly1305 under a key derived from the deployment secret.
//!
//! TCPMig authenticates CONN-STATE with a MAC but does not encrypt it, and a
//! TLS snapshot holds the session keys: anyone who can read the migration
//! channel could decrypt the session. Sealing closes that hole. Layout
//! (docs/TLS.md, "Sealed snapshots"):
//!
//! ```text
//! "CPYS" (4) | version 1 (1) | nonce (12) | ChaCha20-Poly1305(snapshot) | tag (16)
//! ```
//!
//! The 17-byte header is the AEAD's associated data, so any change to the
//! magic, version, nonce, ciphertext or tag is refused as
//! [`SealError::Authentication`]. The nonce is the caller's (random per
//! export, or a per-key counter); it must never repeat under one key.

use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, CHACHA20_POLY1305};
use ring::hkdf;
use zeroize::Zeroize;

use crate::error::{SnapshotError, TlsError};
use crate::server::TlsServer;

/// First bytes of every sealed snapshot ("capybara sealed").
pub const SEALED_MAGIC: [u8; 4] = *b"CPYS";
/// Version of the sealed envelope (not of the snapshot inside it).
pub const SEALED_VERSION: u8 = 1;
/// Bytes a sealed snapshot adds to the plain one: header 17 + tag 16.
pub const SEAL_OVERHEAD: usize = HEADER_LEN + TAG_LEN;

const NONCE_LEN: usize = 12;
const TAG_LEN: usize = 16;
const HEADER_LEN: usize = 4 + 1 + NONCE_LEN;

/// HKDF-SHA256 salt and info: fixed labels so that the seal key differs from
/// every other key derived from the same deployment secret.
const HKDF_SALT: &[u8] = b"capybara tls snapshot seal";
const HKDF_INFO: &[u8] = b"capybara-tls v1 chacha20-poly1305 key";

/// Shortest deployment secret accepted (the same floor as the TCPMig MAC key).
pub const MIN_SECRET_LEN: usize = 16;

/// The key that seals and opens TLS snapshots. Derive it once per process
/// from the deployment secret; every server of the deployment derives the
/// same key.
pub struct SealKey {
    key: LessSafeKey,
}

impl std::fmt::Debug for SealKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SealKey(<secret>)")
    }
}

/// Why a seal key could not be made, or a sealed snapshot was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SealError {
    #[error(
        "deployment secret too short for the TLS seal key: {len} bytes, at least {min} needed"
    )]
    SecretTooShort { len: usize, min: usize },
    #[error("deployment secret is not hex: {0}")]
    SecretHex(&'static str),
    #[error("sealed TLS snapshot too short: {0} bytes, at least 33 (header and tag) needed")]
    Truncated(usize),
    #[error("not a sealed TLS snapshot (magic bytes {0:02x?}, expected \"CPYS\")")]
    Magic([u8; 4]),
    #[error("sealed TLS snapshot version {0} is not supported (this build reads version 1)")]
    Version(u8),
    #[error("sealed TLS snapshot failed authentication: wrong seal key (deployment secret differs between servers?) or the blob was modified")]
    Authentication,
    #[error("sealed TLS snapshot opened, but its content is invalid: {0}")]
    Snapshot(#[from] SnapshotError),
}

impl SealKey {
    /// Derives the seal key from the raw deployment secret bytes
    /// (HKDF-SHA256, fixed salt and info labels).
    pub fn derive(secret: &[u8]) -> Result<SealKey, SealError> {
        if secret.len() < MIN_SECRET_LEN {
            return Err(SealError::SecretTooShort {
                len: secret.len(),
                min: MIN_SECRET_LEN,
            });
        }
        let prk = hkdf::Salt::new(hkdf::HKDF_SHA256, HKDF_SALT).extract(secret);
        let mut raw = [0u8; 32];
        prk.expand(&[HKDF_INFO], &CHACHA20_POLY1305)
            .and_then(|okm| okm.fill(&mut raw))
            .unwrap_or_else(|_| unreachable!("32 bytes is a valid HKDF-SHA256 output length"));
        let unbound = UnboundKey::new(&CHACHA20_POLY1305, &raw)
            .unwrap_or_else(|_| unreachable!("32 bytes is the ChaCha20-Poly1305 key length"));
        raw.zeroize();
        Ok(SealKey {
            key: LessSafeKey::new(unbound),
        })
    }

    /// Derives the seal key from the deployment secret as hex text, the form
    /// of `[migration] key` / `key_file` in hostagent.toml. Surrounding
    /// whitespace is ignored.
    pub fn from_hex(text: &str) -> Result<SealKey, SealError> {
        let text = text.trim().as_bytes();
        if text.len() % 2 == 1 {
            return Err(SealError::SecretHex("odd number of hex digits"));
        }
        let mut secret = Vec::with_capacity(text.len() / 2);
        for pair in text.chunks_exact(2) {
            match (hex_value(pair[0]), hex_value(pair[1])) {
                (Some(h), Some(l)) => secret.push(h << 4 | l),
                _ => {
                    secret.zeroize();
                    return Err(SealError::SecretHex("non-hex character"));
                }
            }
        }
        let key = SealKey::derive(&secret);
        secret.zeroize();
        key
    }
}

fn hex_value(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    }
}

impl TlsServer {
    /// Size of the blob `export_sealed` would append now (0 if not exportable).
    pub fn sealed_len(&self) -> usize {
        match self.snapshot_len() {
            0 => 0,
            n => n + SEAL_OVERHEAD,
        }
    }

    /// Appends the sealed session snapshot to `out`. `nonce` must never repeat
    /// under one key: take it from a CSPRNG per export (96 random bits) or
    /// from a counter that is never reset. The plain snapshot only ever
    /// exists inside `out`, where it is encrypted in place.
    pub fn export_sealed(
        &self,
        key: &SealKey,
        nonce: [u8; 12],
        out: &mut Vec<u8>,
    ) -> Result<(), TlsError> {
        let start = out.len();
        out.reserve(self.sealed_len());
        out.extend_from_slice(&SEALED_MAGIC);
        out.push(SEALED_VERSION);
        out.extend_from_slice(&nonce);
        let body = out.len();
        if let Err(e) = self.export(out) {
            out.truncate(start);
            return Err(e);
        }
        let (header, plain) = out[start..].split_at_mut(HEADER_LEN);
        let tag = key
            .key
            .seal_in_place_separate_tag(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(&header[..]),
                plain,
            )
            .map_err(|_| {
                TlsError::NotExportable("the snapshot is too large for ChaCha20-Poly1305")
            });
        match tag {
            Ok(tag) => {
                out.extend_from_slice(tag.as_ref());
                Ok(())
            }
            Err(e) => {
                out[body..].zeroize();
                out.truncate(start);
                Err(e)
            }
        }
    }

    /// Opens a sealed snapshot (untrusted bytes from the migration channel)
    /// and rebuilds the session. A wrong key or any modified byte gives
    /// [`SealError::Authentication`]; the content is then checked like
    /// [`TlsServer::import`]'s input.
    pub fn import_sealed(key: &SealKey, bytes: &[u8]) -> Result<TlsServer, SealError> {
        if bytes.len() < SEAL_OVERHEAD {
            return Err(SealError::Truncated(bytes.len()));
        }
        let magic = [bytes[0], bytes[1], bytes[2], bytes[3]];
        if magic != SEALED_MAGIC {
            return Err(SealError::Magic(magic));
        }
        if bytes[4] != SEALED_VERSION {
            return Err(SealError::Version(bytes[4]));
        }
        let (header, sealed) = bytes.split_at(HEADER_LEN);
        let mut nonce = [0u8; NONCE_LEN];
        nonce.copy_from_slice(&header[5..]);
        let mut buf = sealed.to_vec();
        let result = match key.key.open_in_place(
            Nonce::assume_unique_for_key(nonce),
            Aad::from(header),
            &mut buf,
        ) {
            Ok(plain) => TlsServer::import(plain).map_err(SealError::from),
            Err(_) => Err(SealError::Authentication),
        };
        buf.zeroize();
        result
    }
}
