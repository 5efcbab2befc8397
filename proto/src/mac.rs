//! The deployment secret and the message authentication code it keys.
//!
//! TCPMig and control-channel messages change who owns a connection or what
//! the switch does, so each carries `HMAC-SHA256(key, covered bytes)`
//! truncated to [`MAC_LEN`] bytes. Every component of one deployment shares
//! the same [`MigrationKey`]; the switch data plane never needs it because it
//! never modifies MAC'd bytes.
//!
//! Invariants:
//! - a key is at least [`MigrationKey::MIN_LEN`] bytes (128 bits), so a
//!   truncated 128-bit tag is the weakest link, not the key;
//! - verification compares in constant time (`hmac`'s `verify_truncated_left`);
//! - the secret is never printed (`Debug` shows only its length);
//! - computing a MAC allocates nothing: the keyed inner/outer state is
//!   derived once in [`MigrationKey::from_bytes`] and cloned per message.

use hmac::{Hmac, Mac};
use sha2::Sha256;
use thiserror::Error;

/// Length of the truncated MAC on the wire.
pub const MAC_LEN: usize = 16;

/// Why a deployment secret was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum KeyError {
    #[error("migration key too short: {len} bytes, need at least {min} (32 hex digits)")]
    TooShort { len: usize, min: usize },
    #[error("migration key has an odd number of hex digits ({digits})")]
    OddHexLength { digits: usize },
    #[error("migration key has a non-hex character {found:?} at position {position}")]
    BadHexDigit { position: usize, found: char },
}

/// The deployment secret that keys TCPMig and control-channel MACs.
#[derive(Clone)]
pub struct MigrationKey {
    // Keyed state (ipad/opad already absorbed); cloned for every message.
    hmac: Hmac<Sha256>,
    len: usize,
}

impl MigrationKey {
    /// Shortest accepted secret, in bytes.
    pub const MIN_LEN: usize = 16;

    /// A key from raw secret bytes (at least [`Self::MIN_LEN`]).
    pub fn from_bytes(secret: &[u8]) -> Result<Self, KeyError> {
        if secret.len() < Self::MIN_LEN {
            return Err(KeyError::TooShort {
                len: secret.len(),
                min: Self::MIN_LEN,
            });
        }
        // HMAC accepts keys of any length; `new_from_slice` cannot fail.
        let hmac = <Hmac<Sha256> as Mac>::new_from_slice(secret)
            .unwrap_or_else(|_| unreachable!("HMAC takes keys of any length"));
        Ok(MigrationKey {
            hmac,
            len: secret.len(),
        })
    }

    /// A key from hex text, as written in configuration files and
    /// environment variables. Surrounding whitespace is ignored.
    pub fn from_hex(text: &str) -> Result<Self, KeyError> {
        let text = text.trim();
        // The alphabet first: a key written in another encoding (base64
        // from `openssl rand -base64 16`) is named as not hex, not as
        // "too short" by the count of its characters halved.
        if let Some(p) = text.bytes().position(|b| hex_value(b).is_none()) {
            return Err(bad_digit(text, p));
        }
        let digits = text.len();
        if digits & 1 == 1 {
            return Err(KeyError::OddHexLength { digits });
        }
        if digits / 2 < Self::MIN_LEN {
            return Err(KeyError::TooShort {
                len: digits / 2,
                min: Self::MIN_LEN,
            });
        }
        // Secrets are small (a config value); a stack buffer keeps
        // this allocation-free for every sane length.
        let mut buf = [0u8; 256];
        let mut heap;
        let out: &mut [u8] = if digits / 2 <= buf.len() {
            &mut buf[..digits / 2]
        } else {
            heap = vec![0u8; digits / 2];
            &mut heap[..]
        };
        let bytes = text.as_bytes();
        for (i, o) in out.iter_mut().enumerate() {
            let hi = hex_value(bytes[2 * i]).ok_or_else(|| bad_digit(text, 2 * i))?;
            let lo = hex_value(bytes[2 * i + 1]).ok_or_else(|| bad_digit(text, 2 * i + 1))?;
            *o = (hi << 4) | lo;
        }
        let key = Self::from_bytes(out);
        out.fill(0);
        key
    }

    /// Length of the secret in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: a key has at least [`Self::MIN_LEN`] bytes.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The truncated MAC of `parts` concatenated.
    pub fn compute(&self, parts: &[&[u8]]) -> [u8; MAC_LEN] {
        let mut m = self.hmac.clone();
        for p in parts {
            m.update(p);
        }
        let full = m.finalize().into_bytes();
        let mut tag = [0u8; MAC_LEN];
        tag.copy_from_slice(&full[..MAC_LEN]);
        tag
    }

    /// Whether `tag` is the MAC of `parts` concatenated, in constant time.
    pub fn verify(&self, parts: &[&[u8]], tag: &[u8]) -> bool {
        if tag.len() != MAC_LEN {
            return false;
        }
        let mut m = self.hmac.clone();
        for p in parts {
            m.update(p);
        }
        m.verify_truncated_left(tag).is_ok()
    }
}

impl std::fmt::Debug for MigrationKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "MigrationKey({} bytes, redacted)", self.len)
    }
}

impl std::str::FromStr for MigrationKey {
    type Err = KeyError;
    fn from_str(s: &str) -> Result<Self, KeyError> {
        Self::from_hex(s)
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

fn bad_digit(text: &str, position: usize) -> KeyError {
    // `position` may fall inside a multi-byte character; report the
    // character that contains it rather than a raw byte.
    let found = text
        .char_indices()
        .take_while(|(i, _)| *i <= position)
        .last()
        .map(|(_, c)| c)
        .unwrap_or('?');
    KeyError::BadHexDigit { position, found }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc4231_case_1_prefix() {
        // RFC 4231 test case 1 (its key is 20 bytes, above our minimum):
        // key = 0x0b * 20, data = "Hi There".
        let key = MigrationKey::from_bytes(&[0x0b; 20]).unwrap();
        let tag = key.compute(&[b"Hi There"]);
        let expected = [
            0xb0, 0x34, 0x4c, 0x61, 0xd8, 0xdb, 0x38, 0x53, 0x5c, 0xa8, 0xaf, 0xce, 0xaf, 0x0b,
            0xf1, 0x2b,
        ];
        assert_eq!(tag, expected);
        assert!(key.verify(&[b"Hi ", b"There"], &expected));
        let mut bad = expected;
        bad[15] ^= 1;
        assert!(!key.verify(&[b"Hi There"], &bad));
        assert!(!key.verify(&[b"Hi There"], &expected[..15]));
    }

    #[test]
    fn hex_parsing_errors_name_the_problem() {
        assert_eq!(
            MigrationKey::from_hex("abcd").unwrap_err(),
            KeyError::TooShort { len: 2, min: 16 }
        );
        assert_eq!(
            MigrationKey::from_hex("abc").unwrap_err(),
            KeyError::OddHexLength { digits: 3 }
        );
        let bad = format!("{}zz", "00".repeat(16));
        assert_eq!(
            MigrationKey::from_hex(&bad).unwrap_err(),
            KeyError::BadHexDigit {
                position: 32,
                found: 'z'
            }
        );
        // Not hex at all (base64 of 16 bytes: 24 characters): named as
        // such, not as a 12-byte key.
        assert_eq!(
            MigrationKey::from_hex("7dU8N1I2mORROZApahUlsg==").unwrap_err(),
            KeyError::BadHexDigit {
                position: 2,
                found: 'U'
            }
        );
        assert_eq!(
            MigrationKey::from_hex("zzzz").unwrap_err(),
            KeyError::BadHexDigit {
                position: 0,
                found: 'z'
            }
        );
        let ok: MigrationKey = format!(" {} \n", "0B".repeat(20)).parse().unwrap();
        assert_eq!(ok.compute(&[b"Hi There"])[0], 0xb0);
        assert!(!format!("{ok:?}").contains("0b"));
    }

    /// Micro-bench (`cargo test --release -p capybara-proto --lib
    /// mac_cost -- --ignored --nocapture`): ns per MAC of a TCPMig control
    /// message (52-byte header, empty payload) and of a 158-byte snapshot
    /// fragment, computed and verified.
    #[test]
    #[ignore]
    fn mac_cost() {
        let key = MigrationKey::from_bytes(&[0x5a; 32]).unwrap();
        for len in [52usize, 52 + 158] {
            let msg = vec![0x42u8; len];
            let n = 200_000u32;
            let t0 = std::time::Instant::now();
            let mut acc = 0u8;
            for i in 0..n {
                let tag = key.compute(&[&msg[..], &i.to_be_bytes()[..0]]);
                acc ^= tag[0];
            }
            let compute = t0.elapsed().as_nanos() as f64 / f64::from(n);
            let tag = key.compute(&[&msg]);
            let t0 = std::time::Instant::now();
            let mut ok = 0u32;
            for _ in 0..n {
                ok += u32::from(key.verify(&[&msg], &tag));
            }
            let verify = t0.elapsed().as_nanos() as f64 / f64::from(n);
            assert_eq!(ok, n);
            println!("mac_cost bytes={len} compute_ns={compute:.0} verify_ns={verify:.0} ({acc})");
        }
    }

    #[test]
    fn multibyte_garbage_does_not_panic() {
        let text = format!("{}é", "0".repeat(32));
        assert!(MigrationKey::from_hex(&text).is_err());
        let text = format!("é{}", "0".repeat(32));
        assert!(MigrationKey::from_hex(&text).is_err());
    }
}
