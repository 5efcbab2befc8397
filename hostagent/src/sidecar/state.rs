//! The sidecar's per-connection state in a connection snapshot (the
//! application-state blob of `docs/SNAPSHOT.md`). Version 1, big-endian:
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 1 | version = 1 |
//! | 1 | 1 | protocol: 1 http1, 2 resp, 3 raw |
//! | 2 | 1 | flags: bit 0 database present, bit 1 TLS state present; other bits 0 |
//! | 3 | 4 | `n`: bytes of client plaintext read and not forwarded |
//! | 7 | n | those bytes (a partial request; complete ones if quiesced early) |
//! | | 4 | database index (if flag bit 0) |
//! | | 4 + m | TLS state length `m` and the `capybara-tls` snapshot (if flag bit 1) |
//!
//! Nothing may follow. The parser validates everything and names what was
//! wrong; it never panics (proptest below).

use crate::config::SidecarProtocol;

pub const VERSION: u8 = 1;
const FLAG_DB: u8 = 1;
const FLAG_TLS: u8 = 2;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnState<'a> {
    pub protocol: SidecarProtocol,
    pub inbuf: &'a [u8],
    pub db: Option<u32>,
    pub tls: Option<&'a [u8]>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StateError {
    #[error("sidecar state truncated in `{0}`")]
    Truncated(&'static str),
    #[error("sidecar state version {0} not supported (this build reads {VERSION})")]
    Version(u8),
    #[error("sidecar state field `{0}` is invalid: {1}")]
    Invalid(&'static str, &'static str),
    #[error("{0} bytes follow the sidecar state")]
    Trailing(usize),
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, field: &'static str) -> Result<&'a [u8], StateError> {
        if self.0.len() < n {
            return Err(StateError::Truncated(field));
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    fn u8(&mut self, field: &'static str) -> Result<u8, StateError> {
        Ok(self.take(1, field)?[0])
    }
    fn u32(&mut self, field: &'static str) -> Result<u32, StateError> {
        let b = self.take(4, field)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }
}

impl<'a> ConnState<'a> {
    pub fn parse(bytes: &'a [u8]) -> Result<ConnState<'a>, StateError> {
        let mut r = Reader(bytes);
        let v = r.u8("version")?;
        if v != VERSION {
            return Err(StateError::Version(v));
        }
        let protocol = match r.u8("protocol")? {
            1 => SidecarProtocol::Http1,
            2 => SidecarProtocol::Resp,
            3 => SidecarProtocol::Raw,
            _ => return Err(StateError::Invalid("protocol", "unknown protocol")),
        };
        let flags = r.u8("flags")?;
        if flags & !(FLAG_DB | FLAG_TLS) != 0 {
            return Err(StateError::Invalid("flags", "unknown bits set"));
        }
        let n = r.u32("inbuf length")? as usize;
        let inbuf = r.take(n, "inbuf")?;
        let db = if flags & FLAG_DB != 0 {
            if protocol != SidecarProtocol::Resp {
                return Err(StateError::Invalid("flags", "a database outside RESP"));
            }
            Some(r.u32("database")?)
        } else {
            None
        };
        let tls = if flags & FLAG_TLS != 0 {
            let m = r.u32("tls length")? as usize;
            Some(r.take(m, "tls state")?)
        } else {
            None
        };
        if !r.0.is_empty() {
            return Err(StateError::Trailing(r.0.len()));
        }
        Ok(ConnState {
            protocol,
            inbuf,
            db,
            tls,
        })
    }

    pub fn emit(&self, out: &mut Vec<u8>) {
        out.push(VERSION);
        out.push(match self.protocol {
            SidecarProtocol::Http1 => 1,
            SidecarProtocol::Resp => 2,
            SidecarProtocol::Raw => 3,
        });
        let mut flags = 0;
        if self.db.is_some() {
            flags |= FLAG_DB;
        }
        if self.tls.is_some() {
            flags |= FLAG_TLS;
        }
        out.push(flags);
        out.extend_from_slice(&(self.inbuf.len() as u32).to_be_bytes());
        out.extend_from_slice(self.inbuf);
        if let Some(db) = self.db {
            out.extend_from_slice(&db.to_be_bytes());
        }
        if let Some(t) = self.tls {
            out.extend_from_slice(&(t.len() as u32).to_be_bytes());
            out.extend_from_slice(t);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn proto() -> impl Strategy<Value = SidecarProtocol> {
        prop_oneof![
            Just(SidecarProtocol::Http1),
            Just(SidecarProtocol::Resp),
            Just(SidecarProtocol::Raw)
        ]
    }

    proptest! {
        #[test]
        fn round_trips(p in proto(), inbuf in proptest::collection::vec(any::<u8>(), 0..64),
                       db in any::<Option<u32>>(), tls in any::<Option<Vec<u8>>>()) {
            let db = if p == SidecarProtocol::Resp { db } else { None };
            let s = ConnState { protocol: p, inbuf: &inbuf, db, tls: tls.as_deref() };
            let mut out = Vec::new();
            s.emit(&mut out);
            prop_assert_eq!(ConnState::parse(&out), Ok(s.clone()));
            // Every truncation is an error, never a panic.
            for cut in 0..out.len() {
                prop_assert!(ConnState::parse(&out[..cut]).is_err());
            }
        }

        #[test]
        fn parser_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = ConnState::parse(&bytes);
        }
    }

    #[test]
    fn errors_name_the_field() {
        assert_eq!(ConnState::parse(&[2]), Err(StateError::Version(2)));
        assert_eq!(
            ConnState::parse(&[1, 9, 0, 0, 0, 0, 0]),
            Err(StateError::Invalid("protocol", "unknown protocol"))
        );
        assert_eq!(
            ConnState::parse(&[1, 1, 0, 0, 0, 0, 5, 1]),
            Err(StateError::Truncated("inbuf"))
        );
        assert_eq!(
            ConnState::parse(&[1, 1, 0, 0, 0, 0, 0, 7]),
            Err(StateError::Trailing(1))
        );
    }
}
