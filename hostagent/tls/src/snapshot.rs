//! The TLS session snapshot (version 1), byte layout in docs/TLS.md.
//!
//! It travels inside the connection snapshot's application state, i.e. over
//! the migration channel: the parser treats it as untrusted bytes, checks
//! every field and cross-field invariant, and never panics. It holds the
//! session keys: it is as secret as the session itself.

use crate::error::{SnapshotError, TlsError};
use crate::keys::{DirectionKeys, Protocol, Secret, Suite, IV_LEN};
use crate::record::{RecordHeader, APPLICATION_DATA, CHANGE_CIPHER_SPEC, HEADER_LEN, KEY_UPDATE};
use crate::server::{State, TlsServer, Traffic};

pub const VERSION: u8 = 1;

const FLAG_PEER_CLOSED: u8 = 1 << 0;
const FLAG_CLOSE_SENT: u8 = 1 << 1;
const FLAG_SECRETS: u8 = 1 << 2;
const FLAGS_KNOWN: u8 = FLAG_PEER_CLOSED | FLAG_CLOSE_SENT | FLAG_SECRETS;

/// Fixed part before the keys: version, flags, protocol, suite, 2 sequence numbers.
const FIXED_LEN: usize = 1 + 1 + 2 + 2 + 8 + 8;

impl TlsServer {
    /// Size of the snapshot `export` would append now (0 if not exportable).
    pub fn snapshot_len(&self) -> usize {
        let State::Traffic(t) = &self.state else {
            return 0;
        };
        let suite = t.rx.suite;
        let secrets = if t.rx.secret.is_some() {
            2 * suite.secret_len()
        } else {
            0
        };
        FIXED_LEN
            + 2 * (suite.key_len() + IV_LEN)
            + secrets
            + 2
            + self.inbound.len()
            + 1
            + self.hs_partial.len()
            + 4
            + self.plaintext_pending()
            + 4
            + self.outbound.len()
    }

    /// Appends the session snapshot to `out`. The session itself is left
    /// unchanged (drop it once the migration is committed; keep it to resume
    /// if the migration aborts).
    pub fn export(&self, out: &mut Vec<u8>) -> Result<(), TlsError> {
        let t = match &self.state {
            State::Traffic(t) => t,
            State::Handshaking(_) => {
                return Err(TlsError::NotExportable("the handshake is not complete"))
            }
            State::Failed(_) => return Err(TlsError::NotExportable("the session failed")),
        };
        let plaintext = &self.plaintext[self.plaintext_read..];
        if plaintext.len() > u32::MAX as usize || self.outbound.len() > u32::MAX as usize {
            return Err(TlsError::NotExportable("more than 4 GiB of buffered data"));
        }
        out.reserve(self.snapshot_len());
        let mut flags = 0;
        if self.peer_closed {
            flags |= FLAG_PEER_CLOSED;
        }
        if self.close_sent {
            flags |= FLAG_CLOSE_SENT;
        }
        let secrets = match (&t.rx.secret, &t.tx.secret) {
            (Some(r), Some(w)) => {
                flags |= FLAG_SECRETS;
                Some((r, w))
            }
            _ => None,
        };
        out.push(VERSION);
        out.push(flags);
        out.extend_from_slice(&t.protocol.code().to_be_bytes());
        out.extend_from_slice(&t.suite_code.to_be_bytes());
        out.extend_from_slice(&t.rx.seq.to_be_bytes());
        out.extend_from_slice(&t.tx.seq.to_be_bytes());
        out.extend_from_slice(t.rx.key());
        out.extend_from_slice(&t.rx.iv);
        out.extend_from_slice(t.tx.key());
        out.extend_from_slice(&t.tx.iv);
        if let Some((r, w)) = secrets {
            out.extend_from_slice(r.as_bytes());
            out.extend_from_slice(w.as_bytes());
        }
        // The invariants of TlsServer bound these (one incomplete record, < 5 bytes).
        out.extend_from_slice(&(self.inbound.len() as u16).to_be_bytes());
        out.extend_from_slice(&self.inbound);
        out.push(self.hs_partial.len() as u8);
        out.extend_from_slice(&self.hs_partial);
        out.extend_from_slice(&(plaintext.len() as u32).to_be_bytes());
        out.extend_from_slice(plaintext);
        out.extend_from_slice(&(self.outbound.len() as u32).to_be_bytes());
        out.extend_from_slice(&self.outbound);
        Ok(())
    }

    /// Rebuilds a session from a snapshot (on the migration target): it
    /// continues the byte stream where the exporter stopped, with no handshake.
    pub fn import(bytes: &[u8]) -> Result<TlsServer, SnapshotError> {
        let mut r = Reader { buf: bytes, at: 0 };
        let version = r.u8("version")?;
        if version != VERSION {
            return Err(SnapshotError::Version(version));
        }
        let flags = r.u8("flags")?;
        if flags & !FLAGS_KNOWN != 0 {
            return Err(invalid("flags", "reserved bits set"));
        }
        let protocol = match r.u16("protocol")? {
            0x0304 => Protocol::Tls13,
            0x0303 => Protocol::Tls12,
            _ => {
                return Err(invalid(
                    "protocol",
                    "not TLS 1.3 (0x0304) or TLS 1.2 (0x0303)",
                ))
            }
        };
        let suite_code = r.u16("suite")?;
        let suite = Suite::from_code(protocol, suite_code)
            .ok_or_else(|| invalid("suite", "not an AEAD suite of this protocol version"))?;
        if protocol == Protocol::Tls12 && flags & FLAG_SECRETS != 0 {
            return Err(invalid("flags", "TLS 1.2 has no traffic secrets"));
        }
        let rx_seq = r.u64("rx seq")?;
        let tx_seq = r.u64("tx seq")?;
        if rx_seq == u64::MAX || tx_seq == u64::MAX {
            return Err(invalid("seq", "sequence number space exhausted"));
        }
        let rx_key = r.take("rx key", suite.key_len())?;
        let rx_iv = r.take("rx iv", IV_LEN)?;
        let tx_key = r.take("tx key", suite.key_len())?;
        let tx_iv = r.take("tx iv", IV_LEN)?;
        let (rx_secret, tx_secret) = if flags & FLAG_SECRETS != 0 {
            // Checked against the keys when first used (KeyUpdate), not
            // here: four HKDF expansions would dominate the import.
            let rs = r.take("rx secret", suite.secret_len())?;
            let ts = r.take("tx secret", suite.secret_len())?;
            (Secret::new(rs), Secret::new(ts))
        } else {
            (None, None)
        };
        let inbound_len = usize::from(r.u16("partial record length")?);
        let inbound = r.take("partial record", inbound_len)?;
        let hs_len = usize::from(r.u8("partial KeyUpdate length")?);
        let hs_partial = r.take("partial KeyUpdate", hs_len)?;
        let pt_len = r.u32("plaintext length")? as usize;
        let plaintext = r.take("plaintext", pt_len)?;
        let out_len = r.u32("pending ciphertext length")? as usize;
        let outbound = r.take("pending ciphertext", out_len)?;
        if r.at != bytes.len() {
            return Err(SnapshotError::Trailing(bytes.len() - r.at));
        }

        let peer_closed = flags & FLAG_PEER_CLOSED != 0;
        check_partial_record(inbound, peer_closed, protocol)?;
        check_partial_key_update(hs_partial, peer_closed, protocol)?;

        let rx = DirectionKeys::new(suite, rx_key, rx_iv, rx_seq, rx_secret)
            .ok_or_else(|| invalid("rx key", "rejected by the AEAD"))?;
        let tx = DirectionKeys::new(suite, tx_key, tx_iv, tx_seq, tx_secret)
            .ok_or_else(|| invalid("tx key", "rejected by the AEAD"))?;
        let mut s = TlsServer::with_state(State::Traffic(Box::new(Traffic {
            protocol,
            suite_code,
            rx,
            tx,
        })));
        s.inbound = inbound.to_vec();
        s.hs_partial = hs_partial.to_vec();
        s.plaintext = plaintext.to_vec();
        s.outbound = outbound.to_vec();
        s.peer_closed = peer_closed;
        s.close_sent = flags & FLAG_CLOSE_SENT != 0;
        Ok(s)
    }
}

fn invalid(field: &'static str, why: &'static str) -> SnapshotError {
    SnapshotError::Invalid { field, why }
}

/// At most one incomplete protected record (complete ones are always
/// processed before an export is possible).
fn check_partial_record(
    inbound: &[u8],
    peer_closed: bool,
    protocol: Protocol,
) -> Result<(), SnapshotError> {
    if inbound.is_empty() {
        return Ok(());
    }
    if peer_closed {
        return Err(invalid(
            "partial record",
            "must be empty after close_notify",
        ));
    }
    match RecordHeader::parse(inbound) {
        Err(_) => Err(invalid(
            "partial record",
            "header is not a valid TLS record header",
        )),
        Ok(None) => Ok(()),
        Ok(Some(h))
            if (protocol == Protocol::Tls13 && h.content_type != APPLICATION_DATA)
                || h.content_type == CHANGE_CIPHER_SPEC =>
        {
            Err(invalid(
                "partial record",
                "content type not allowed after the handshake",
            ))
        }
        Ok(Some(h)) if inbound.len() >= HEADER_LEN + h.len => {
            Err(invalid("partial record", "holds a complete record"))
        }
        Ok(Some(_)) => Ok(()),
    }
}

fn check_partial_key_update(
    hs: &[u8],
    peer_closed: bool,
    protocol: Protocol,
) -> Result<(), SnapshotError> {
    if hs.is_empty() {
        return Ok(());
    }
    if protocol == Protocol::Tls12 {
        return Err(invalid("partial KeyUpdate", "TLS 1.2 has no KeyUpdate"));
    }
    if peer_closed {
        return Err(invalid(
            "partial KeyUpdate",
            "must be empty after close_notify",
        ));
    }
    let prefix = [KEY_UPDATE, 0, 0, 1];
    if hs.len() > prefix.len() || hs != &prefix[..hs.len()] {
        return Err(invalid(
            "partial KeyUpdate",
            "not a prefix of a KeyUpdate message",
        ));
    }
    Ok(())
}

struct Reader<'a> {
    buf: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, field: &'static str, n: usize) -> Result<&'a [u8], SnapshotError> {
        let have = self.buf.len() - self.at;
        if n > have {
            return Err(SnapshotError::Truncated {
                field,
                at: self.at,
                need: n,
                have,
            });
        }
        let s = &self.buf[self.at..self.at + n];
        self.at += n;
        Ok(s)
    }

    fn u8(&mut self, field: &'static str) -> Result<u8, SnapshotError> {
        Ok(self.take(field, 1)?[0])
    }

    fn u16(&mut self, field: &'static str) -> Result<u16, SnapshotError> {
        let b = self.take(field, 2)?;
        Ok(u16::from_be_bytes([b[0], b[1]]))
    }

    fn u32(&mut self, field: &'static str) -> Result<u32, SnapshotError> {
        let b = self.take(field, 4)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self, field: &'static str) -> Result<u64, SnapshotError> {
        let b = self.take(field, 8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_be_bytes(a))
    }
}
