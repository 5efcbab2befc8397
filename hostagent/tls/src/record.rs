//! TLS record framing (RFC 8446 §5.1, §5.2): the 5-byte header and its limits.
//! A header is validated once by [`RecordHeader::parse`]; afterwards its
//! `len` can be used to slice the buffer without further checks.

use crate::error::TlsError;

pub const HEADER_LEN: usize = 5;
/// Longest plaintext fragment (2^14).
pub const MAX_PLAINTEXT: usize = 1 << 14;
/// Longest protected record body (2^14 + 256).
pub const MAX_CIPHERTEXT: usize = MAX_PLAINTEXT + 256;

pub const CHANGE_CIPHER_SPEC: u8 = 20;
pub const ALERT: u8 = 21;
pub const HANDSHAKE: u8 = 22;
pub const APPLICATION_DATA: u8 = 23;

/// Handshake message type of KeyUpdate (RFC 8446 §4).
pub const KEY_UPDATE: u8 = 24;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordHeader {
    pub content_type: u8,
    pub version: u16,
    /// Length of the record body that follows the header.
    pub len: usize,
}

impl RecordHeader {
    /// Parses the header at the start of `buf`: `Ok(None)` if fewer than 5
    /// bytes are present, an error if the header cannot start a valid record.
    pub fn parse(buf: &[u8]) -> Result<Option<RecordHeader>, TlsError> {
        let Some(h) = buf.get(..HEADER_LEN) else {
            return Ok(None);
        };
        let header = RecordHeader {
            content_type: h[0],
            version: u16::from_be_bytes([h[1], h[2]]),
            len: usize::from(u16::from_be_bytes([h[3], h[4]])),
        };
        if !(CHANGE_CIPHER_SPEC..=APPLICATION_DATA).contains(&header.content_type) {
            return Err(TlsError::UnexpectedMessage("unknown record content type"));
        }
        // legacy_record_version is 0x0301..0x0303 in practice; anything
        // outside 0x03xx is not TLS at all.
        if header.version >> 8 != 0x03 {
            return Err(TlsError::Decode("record version is not 3.x"));
        }
        if header.len > MAX_CIPHERTEXT {
            return Err(TlsError::RecordOverflow {
                len: header.len,
                limit: MAX_CIPHERTEXT,
            });
        }
        Ok(Some(header))
    }

    /// Header plus body.
    pub fn record_len(&self) -> usize {
        HEADER_LEN + self.len
    }

    pub fn to_bytes(&self) -> [u8; HEADER_LEN] {
        let v = self.version.to_be_bytes();
        let l = (self.len as u16).to_be_bytes();
        [self.content_type, v[0], v[1], l[0], l[1]]
    }
}
