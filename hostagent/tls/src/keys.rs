//! Per-direction record protection (TLS 1.3: RFC 8446 §5.2, §5.3, §7.2,
//! §7.3; TLS 1.2: RFC 5246 §6.2.3.3): AEAD key, static IV, sequence number
//! and, when known (TLS 1.3), the traffic secret that KeyUpdate derives the
//! next generation from.

use ring::aead::{self, Aad, LessSafeKey, Nonce, UnboundKey};
use ring::hkdf;
use zeroize::Zeroize;

use crate::error::TlsError;

pub(crate) const IV_LEN: usize = 12;
pub(crate) const TAG_LEN: usize = 16;
/// Longest secret of a supported suite (SHA-384).
pub(crate) const MAX_SECRET_LEN: usize = 48;
pub(crate) const MAX_KEY_LEN: usize = 32;

/// Record-layer protocol version.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    /// TLS 1.2 with an AEAD suite (RFC 5246, 5288, 7905).
    Tls12,
    /// TLS 1.3 (RFC 8446).
    Tls13,
}

impl Protocol {
    pub fn code(self) -> u16 {
        match self {
            Protocol::Tls12 => 0x0303,
            Protocol::Tls13 => 0x0304,
        }
    }
}

/// The AEAD of a supported suite. For TLS 1.3 this is the whole suite; for
/// TLS 1.2 the key exchange and signature part of the suite do not matter to
/// the record layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Suite {
    /// TLS_AES_128_GCM_SHA256 (0x1301)
    Aes128GcmSha256,
    /// TLS_AES_256_GCM_SHA384 (0x1302)
    Aes256GcmSha384,
    /// TLS_CHACHA20_POLY1305_SHA256 (0x1303)
    Chacha20Poly1305Sha256,
}

impl Suite {
    /// The TLS 1.3 suite code.
    pub fn code(self) -> u16 {
        match self {
            Suite::Aes128GcmSha256 => 0x1301,
            Suite::Aes256GcmSha384 => 0x1302,
            Suite::Chacha20Poly1305Sha256 => 0x1303,
        }
    }

    /// The AEAD of IANA suite `code` under `protocol`.
    pub fn from_code(protocol: Protocol, code: u16) -> Option<Suite> {
        match (protocol, code) {
            (Protocol::Tls13, 0x1301) => Some(Suite::Aes128GcmSha256),
            (Protocol::Tls13, 0x1302) => Some(Suite::Aes256GcmSha384),
            (Protocol::Tls13, 0x1303) => Some(Suite::Chacha20Poly1305Sha256),
            // ECDHE_{ECDSA,RSA}_WITH_AES_128_GCM_SHA256
            (Protocol::Tls12, 0xc02b | 0xc02f) => Some(Suite::Aes128GcmSha256),
            // ECDHE_{ECDSA,RSA}_WITH_AES_256_GCM_SHA384
            (Protocol::Tls12, 0xc02c | 0xc030) => Some(Suite::Aes256GcmSha384),
            // ECDHE_{RSA,ECDSA}_WITH_CHACHA20_POLY1305_SHA256
            (Protocol::Tls12, 0xcca8 | 0xcca9) => Some(Suite::Chacha20Poly1305Sha256),
            _ => None,
        }
    }

    /// TLS 1.2 GCM records carry an 8-byte explicit nonce (RFC 5288 §3).
    pub(crate) fn tls12_explicit_nonce_len(self) -> usize {
        match self {
            Suite::Aes128GcmSha256 | Suite::Aes256GcmSha384 => 8,
            Suite::Chacha20Poly1305Sha256 => 0,
        }
    }

    pub fn key_len(self) -> usize {
        match self {
            Suite::Aes128GcmSha256 => 16,
            Suite::Aes256GcmSha384 | Suite::Chacha20Poly1305Sha256 => 32,
        }
    }

    /// Length of the hash, hence of the traffic secrets.
    pub fn secret_len(self) -> usize {
        match self {
            Suite::Aes256GcmSha384 => 48,
            Suite::Aes128GcmSha256 | Suite::Chacha20Poly1305Sha256 => 32,
        }
    }

    fn aead(self) -> &'static aead::Algorithm {
        match self {
            Suite::Aes128GcmSha256 => &aead::AES_128_GCM,
            Suite::Aes256GcmSha384 => &aead::AES_256_GCM,
            Suite::Chacha20Poly1305Sha256 => &aead::CHACHA20_POLY1305,
        }
    }

    fn hkdf(self) -> hkdf::Algorithm {
        match self {
            Suite::Aes256GcmSha384 => hkdf::HKDF_SHA384,
            Suite::Aes128GcmSha256 | Suite::Chacha20Poly1305Sha256 => hkdf::HKDF_SHA256,
        }
    }
}

/// A traffic secret, zeroed on drop.
#[derive(Clone)]
pub(crate) struct Secret {
    pub(crate) bytes: [u8; MAX_SECRET_LEN],
    pub(crate) len: usize,
}

impl Secret {
    pub(crate) fn new(bytes: &[u8]) -> Option<Secret> {
        if bytes.len() > MAX_SECRET_LEN {
            return None;
        }
        let mut s = Secret {
            bytes: [0; MAX_SECRET_LEN],
            len: bytes.len(),
        };
        s.bytes[..bytes.len()].copy_from_slice(bytes);
        Some(s)
    }

    pub(crate) fn as_bytes(&self) -> &[u8] {
        &self.bytes[..self.len]
    }
}

impl Drop for Secret {
    fn drop(&mut self) {
        self.bytes.zeroize();
    }
}

struct Len(usize);

impl hkdf::KeyType for Len {
    fn len(&self) -> usize {
        self.0
    }
}

/// HKDF-Expand-Label(secret, label, "", out.len()) (RFC 8446 §7.1), with
/// the secret already keyed into `prk`.
fn expand_label(prk: &hkdf::Prk, label: &[u8], out: &mut [u8]) {
    let len = (out.len() as u16).to_be_bytes();
    let label_len = [(6 + label.len()) as u8];
    let context_len = [0u8];
    let info: [&[u8]; 5] = [&len, &label_len, b"tls13 ", label, &context_len];
    // Lengths here are at most 48 bytes, far below HKDF's 255 * hash limit.
    prk.expand(&info, Len(out.len()))
        .and_then(|okm| okm.fill(out))
        .expect("HKDF-Expand-Label of at most 48 bytes cannot fail");
}

/// Key and IV derived from a traffic secret (RFC 8446 §7.3).
pub(crate) fn derive_key_iv(suite: Suite, secret: &[u8]) -> ([u8; MAX_KEY_LEN], [u8; IV_LEN]) {
    let prk = hkdf::Prk::new_less_safe(suite.hkdf(), secret);
    let mut key = [0u8; MAX_KEY_LEN];
    let mut iv = [0u8; IV_LEN];
    expand_label(&prk, b"key", &mut key[..suite.key_len()]);
    expand_label(&prk, b"iv", &mut iv);
    (key, iv)
}

/// The state of one direction of the record layer.
pub(crate) struct DirectionKeys {
    pub(crate) suite: Suite,
    key: LessSafeKey,
    pub(crate) key_bytes: [u8; MAX_KEY_LEN],
    pub(crate) iv: [u8; IV_LEN],
    /// Sequence number of the next record in this direction.
    pub(crate) seq: u64,
    pub(crate) secret: Option<Secret>,
}

impl Drop for DirectionKeys {
    fn drop(&mut self) {
        self.key_bytes.zeroize();
        self.iv.zeroize();
    }
}

impl DirectionKeys {
    /// `key` must be `suite.key_len()` bytes and `iv` 12 bytes (the snapshot
    /// parser and the secret extraction check this before calling).
    pub(crate) fn new(
        suite: Suite,
        key: &[u8],
        iv: &[u8],
        seq: u64,
        secret: Option<Secret>,
    ) -> Option<DirectionKeys> {
        if key.len() != suite.key_len() || iv.len() != IV_LEN {
            return None;
        }
        let unbound = UnboundKey::new(suite.aead(), key).ok()?;
        let mut key_bytes = [0u8; MAX_KEY_LEN];
        key_bytes[..key.len()].copy_from_slice(key);
        let mut iv_arr = [0u8; IV_LEN];
        iv_arr.copy_from_slice(iv);
        Some(DirectionKeys {
            suite,
            key: LessSafeKey::new(unbound),
            key_bytes,
            iv: iv_arr,
            seq,
            secret,
        })
    }

    pub(crate) fn key(&self) -> &[u8] {
        &self.key_bytes[..self.suite.key_len()]
    }

    /// Per-record nonce: the IV XOR the 64-bit sequence number, left-padded
    /// (TLS 1.3, TLS 1.2 ChaCha20-Poly1305, and the explicit nonce we choose
    /// for TLS 1.2 AES-GCM, as rustls does).
    pub(crate) fn seq_nonce(&self) -> [u8; IV_LEN] {
        let mut n = self.iv;
        for (b, s) in n[IV_LEN - 8..].iter_mut().zip(self.seq.to_be_bytes()) {
            *b ^= s;
        }
        n
    }

    fn advance(&mut self) -> Result<(), TlsError> {
        // RFC 8446 §5.3, RFC 5246 §6.1: the sequence number must not wrap.
        self.seq = self.seq.checked_add(1).ok_or(TlsError::SequenceExhausted)?;
        Ok(())
    }

    /// Seals `buf` in place with the sequence-number nonce; returns the tag
    /// for the caller to place after `buf`.
    pub(crate) fn seal(&mut self, aad: &[u8], buf: &mut [u8]) -> Result<[u8; TAG_LEN], TlsError> {
        if self.seq == u64::MAX {
            return Err(TlsError::SequenceExhausted);
        }
        let nonce = Nonce::assume_unique_for_key(self.seq_nonce());
        let tag = self
            .key
            .seal_in_place_separate_tag(nonce, Aad::from(aad), buf)
            .map_err(|_| TlsError::Failed("AEAD seal failed"))?;
        self.advance()?;
        let mut t = [0u8; TAG_LEN];
        t.copy_from_slice(tag.as_ref());
        Ok(t)
    }

    /// Opens `body` (ciphertext || tag) in place with `nonce` (or the
    /// sequence-number nonce); returns the plaintext length.
    pub(crate) fn open(
        &mut self,
        nonce: Option<[u8; IV_LEN]>,
        aad: &[u8],
        body: &mut [u8],
    ) -> Result<usize, TlsError> {
        if self.seq == u64::MAX {
            return Err(TlsError::SequenceExhausted);
        }
        let seq = self.seq;
        let nonce = Nonce::assume_unique_for_key(nonce.unwrap_or_else(|| self.seq_nonce()));
        let len = self
            .key
            .open_in_place(nonce, Aad::from(aad), body)
            .map_err(|_| TlsError::BadRecordMac { seq })?
            .len();
        self.advance()?;
        Ok(len)
    }

    /// KeyUpdate (RFC 8446 §4.6.3): next-generation secret, key and IV;
    /// the sequence number restarts at 0.
    pub(crate) fn update(&mut self) -> Result<(), TlsError> {
        let Some(secret) = &self.secret else {
            return Err(TlsError::KeyUpdateUnsupported);
        };
        let suite = self.suite;
        // A secret that does not derive the keys in use (a corrupted or
        // mismatched snapshot) would silently produce wrong keys.
        let (mut cur_key, mut cur_iv) = derive_key_iv(suite, secret.as_bytes());
        let matches = cur_key[..suite.key_len()] == *self.key() && cur_iv == self.iv;
        cur_key.zeroize();
        cur_iv.zeroize();
        if !matches {
            return Err(TlsError::SecretMismatch);
        }
        let mut next = [0u8; MAX_SECRET_LEN];
        let n = suite.secret_len();
        let prk = hkdf::Prk::new_less_safe(suite.hkdf(), secret.as_bytes());
        expand_label(&prk, b"traffic upd", &mut next[..n]);
        let next_secret = Secret::new(&next[..n]).ok_or(TlsError::Failed("secret length"))?;
        next.zeroize();
        let (mut key, mut iv) = derive_key_iv(suite, next_secret.as_bytes());
        let fresh = DirectionKeys::new(suite, &key[..suite.key_len()], &iv, 0, Some(next_secret))
            .ok_or(TlsError::Failed("derived key rejected"))?;
        key.zeroize();
        iv.zeroize();
        *self = fresh;
        Ok(())
    }
}
