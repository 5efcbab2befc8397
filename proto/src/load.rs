//! LOAD-NOTIFICATION, versions 1 and 2: the pool monitor's per-interval
//! report (UDP port 7691, switch -> each server's data address).
//!
//! Every interval (default 1 ms) the switch tells each server how many
//! packets it forwarded to that server and to the whole pool; a server whose
//! load per unit of weight exceeds the pool's by a threshold sheds load (seed
//! 000 §5.1).
//!
//! Wire layout: a fixed 48-byte message, every field naturally aligned
//! (docs/TCPMIG.md; C mirror `struct load_notification`). Version 2 (56
//! bytes) is version 1 followed by the server's weight and the pool's total
//! weight; a switch sends it only while the pool's weights differ, so a
//! pool of equal weights still speaks version 1 (what older servers parse).
//!
//! Not MAC'd, on purpose: the notification is emitted once per server per
//! millisecond, possibly by the data plane itself (Tofino packet generator,
//! eBPF), which holds no key; it only steers a server's *decision* to start a
//! migration, which is itself MAC'd and which the target may refuse. A forged
//! notification can at worst make a server shed or keep load. Switches
//! should nevertheless drop port-7691 traffic arriving from the client side.
//! If a deployment needs it, a MAC'd variant can be added as a new version
//! or a flag bit without changing this layout's first 48 bytes.
//!
//! Invariants: after [`LoadPacket::new_checked`] no accessor panics; a
//! wrong version is [`LoadError::UnsupportedVersion`] (counted, dropped);
//! nothing allocates.

use std::net::Ipv4Addr;

use thiserror::Error;

use crate::flow::ServerId;

pub const MAGIC: u16 = 0xCA9C;
pub const VERSION: u8 = 1;
/// Length of a version-1 notification.
pub const LEN: usize = 48;
/// Version 1 and the weights ([`LoadWeights`]).
pub const VERSION_WEIGHTED: u8 = 2;
/// Length of a version-2 notification.
pub const LEN_WEIGHTED: usize = 56;
/// Longest notification (a buffer this long emits any of them).
pub const MAX_LEN: usize = LEN_WEIGHTED;

/// Byte ranges of the fields.
pub mod field {
    pub type Field = core::ops::Range<usize>;

    pub const MAGIC: Field = 0..2;
    pub const VERSION: usize = 2;
    pub const FLAGS: usize = 3;
    pub const EPOCH: Field = 4..8;
    pub const SEQUENCE: Field = 8..16;
    pub const INTERVAL_US: Field = 16..20;
    pub const SERVER_ID: Field = 20..24;
    pub const OWN_LOAD: Field = 24..32;
    pub const POOL_LOAD: Field = 32..40;
    pub const LIVE_SERVERS: Field = 40..44;
    pub const LEAST_LOADED: Field = 44..48;
    /// Version 2 only.
    pub const OWN_WEIGHT: Field = 48..52;
    pub const POOL_WEIGHT: Field = 52..56;
}

/// What was wrong with a LOAD-NOTIFICATION.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum LoadError {
    #[error("load notification truncated: {len} bytes, need {LEN}")]
    Truncated { len: usize },
    #[error("not a load notification: magic {found:#06x}, expected {MAGIC:#06x}")]
    BadMagic { found: u16 },
    #[error("unsupported load notification version {found} (this node speaks {VERSION} and {VERSION_WEIGHTED})")]
    UnsupportedVersion { found: u8 },
    #[error(
        "load notification has {len} bytes, version 1 has exactly {LEN}, version 2 {LEN_WEIGHTED}"
    )]
    TrailingBytes { len: usize },
    #[error("load notification buffer too small to emit: {len} bytes, need {LEN}")]
    BufferTooSmall { len: usize },
}

/// Zero-copy view of a LOAD-NOTIFICATION.
#[derive(Debug, Clone)]
pub struct LoadPacket<T: AsRef<[u8]>> {
    buffer: T,
}

fn rd<const N: usize>(b: &[u8], r: field::Field) -> [u8; N] {
    let mut a = [0u8; N];
    a.copy_from_slice(&b[r]);
    a
}

impl<T: AsRef<[u8]>> LoadPacket<T> {
    pub const fn new_unchecked(buffer: T) -> Self {
        LoadPacket { buffer }
    }

    pub fn new_checked(buffer: T) -> Result<Self, LoadError> {
        let p = LoadPacket { buffer };
        p.check()?;
        Ok(p)
    }

    pub fn check(&self) -> Result<(), LoadError> {
        let b = self.buffer.as_ref();
        // Magic and version first so that a future, longer version is
        // reported as a version problem, not as a length problem.
        if b.len() < 4 {
            return Err(LoadError::Truncated { len: b.len() });
        }
        let magic = u16::from_be_bytes(rd(b, field::MAGIC));
        if magic != MAGIC {
            return Err(LoadError::BadMagic { found: magic });
        }
        let len = match b[field::VERSION] {
            VERSION => LEN,
            VERSION_WEIGHTED => LEN_WEIGHTED,
            found => return Err(LoadError::UnsupportedVersion { found }),
        };
        if b.len() < len {
            return Err(LoadError::Truncated { len: b.len() });
        }
        if b.len() > len {
            return Err(LoadError::TrailingBytes { len: b.len() });
        }
        Ok(())
    }

    pub fn into_inner(self) -> T {
        self.buffer
    }
    pub fn version(&self) -> u8 {
        self.buffer.as_ref()[field::VERSION]
    }
    pub fn flags(&self) -> u8 {
        self.buffer.as_ref()[field::FLAGS]
    }
    pub fn epoch(&self) -> u32 {
        u32::from_be_bytes(rd(self.buffer.as_ref(), field::EPOCH))
    }
    pub fn sequence(&self) -> u64 {
        u64::from_be_bytes(rd(self.buffer.as_ref(), field::SEQUENCE))
    }
    pub fn interval_us(&self) -> u32 {
        u32::from_be_bytes(rd(self.buffer.as_ref(), field::INTERVAL_US))
    }
    pub fn server_id(&self) -> ServerId {
        ServerId(u32::from_be_bytes(rd(
            self.buffer.as_ref(),
            field::SERVER_ID,
        )))
    }
    pub fn own_load(&self) -> u64 {
        u64::from_be_bytes(rd(self.buffer.as_ref(), field::OWN_LOAD))
    }
    pub fn pool_load(&self) -> u64 {
        u64::from_be_bytes(rd(self.buffer.as_ref(), field::POOL_LOAD))
    }
    pub fn live_servers(&self) -> u32 {
        u32::from_be_bytes(rd(self.buffer.as_ref(), field::LIVE_SERVERS))
    }
    pub fn least_loaded(&self) -> Ipv4Addr {
        Ipv4Addr::from(u32::from_be_bytes(rd(
            self.buffer.as_ref(),
            field::LEAST_LOADED,
        )))
    }
    /// The weights of a version-2 notification (`None` for version 1).
    pub fn weights(&self) -> Option<LoadWeights> {
        let b = self.buffer.as_ref();
        (b[field::VERSION] == VERSION_WEIGHTED).then(|| LoadWeights {
            own: u32::from_be_bytes(rd(b, field::OWN_WEIGHT)),
            pool: u32::from_be_bytes(rd(b, field::POOL_WEIGHT)),
        })
    }
}

/// Placement weights (version 2): the server's, and the sum over the
/// servers in the pool (those `pool_load` counts). A server's fair share of
/// the pool's load is `pool_load * own / pool`. Version 1 means every
/// server in the pool has the same weight (a share of `1 / live_servers`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoadWeights {
    /// The receiving server's weight (0: it takes no new connections).
    pub own: u32,
    /// Sum of the weights of the servers in the pool.
    pub pool: u32,
}

/// A parsed LOAD-NOTIFICATION.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoadRepr {
    /// Switch epoch: changes when switchd restarts or a standby takes over,
    /// so a server resets its sequence tracking.
    pub epoch: u32,
    /// Notification number within the epoch; a server ignores a sequence
    /// not greater than the last it saw in the same epoch (reordering).
    pub sequence: u64,
    /// Length of the measured interval in microseconds.
    pub interval_us: u32,
    /// The server this report is for.
    pub server_id: ServerId,
    /// Request packets (client packets carrying TCP payload) forwarded to
    /// this server during the interval (before 2026-11-22: every packet).
    pub own_load: u64,
    /// Request packets forwarded to all live servers during the interval.
    pub pool_load: u64,
    /// Live servers in the pool (divisor of the pool average).
    pub live_servers: u32,
    /// Data address of the least-loaded server, for reference only: the
    /// switch still picks the target of a PREPARE.
    pub least_loaded: Ipv4Addr,
    /// The weights (version 2), when the pool's servers' weights differ;
    /// `None` (version 1): all equal.
    pub weights: Option<LoadWeights>,
}

impl LoadRepr {
    pub fn parse<T: AsRef<[u8]>>(packet: &LoadPacket<T>) -> Result<Self, LoadError> {
        packet.check()?;
        Ok(LoadRepr {
            epoch: packet.epoch(),
            sequence: packet.sequence(),
            interval_us: packet.interval_us(),
            server_id: packet.server_id(),
            own_load: packet.own_load(),
            pool_load: packet.pool_load(),
            live_servers: packet.live_servers(),
            least_loaded: packet.least_loaded(),
            weights: packet.weights(),
        })
    }

    /// Validates and parses raw bytes.
    pub fn parse_bytes(bytes: &[u8]) -> Result<Self, LoadError> {
        Self::parse(&LoadPacket::new_checked(bytes)?)
    }

    /// [`LEN`], or [`LEN_WEIGHTED`] with weights.
    pub const fn buffer_len(&self) -> usize {
        if self.weights.is_some() {
            LEN_WEIGHTED
        } else {
            LEN
        }
    }

    /// Writes the notification into the first [`Self::buffer_len`] bytes
    /// of `buf`: version 2 with weights, else version 1.
    pub fn emit(&self, buf: &mut [u8]) -> Result<usize, LoadError> {
        let len = self.buffer_len();
        if buf.len() < len {
            return Err(LoadError::BufferTooSmall { len: buf.len() });
        }
        let b = &mut buf[..len];
        b[field::MAGIC].copy_from_slice(&MAGIC.to_be_bytes());
        b[field::VERSION] = if self.weights.is_some() {
            VERSION_WEIGHTED
        } else {
            VERSION
        };
        b[field::FLAGS] = 0;
        b[field::EPOCH].copy_from_slice(&self.epoch.to_be_bytes());
        b[field::SEQUENCE].copy_from_slice(&self.sequence.to_be_bytes());
        b[field::INTERVAL_US].copy_from_slice(&self.interval_us.to_be_bytes());
        b[field::SERVER_ID].copy_from_slice(&self.server_id.0.to_be_bytes());
        b[field::OWN_LOAD].copy_from_slice(&self.own_load.to_be_bytes());
        b[field::POOL_LOAD].copy_from_slice(&self.pool_load.to_be_bytes());
        b[field::LIVE_SERVERS].copy_from_slice(&self.live_servers.to_be_bytes());
        b[field::LEAST_LOADED].copy_from_slice(&u32::from(self.least_loaded).to_be_bytes());
        if let Some(w) = self.weights {
            b[field::OWN_WEIGHT].copy_from_slice(&w.own.to_be_bytes());
            b[field::POOL_WEIGHT].copy_from_slice(&w.pool.to_be_bytes());
        }
        Ok(len)
    }

    /// The pool's average load per live server (0 with no live server).
    pub fn pool_average(&self) -> u64 {
        if self.live_servers == 0 {
            0
        } else {
            self.pool_load / u64::from(self.live_servers)
        }
    }

    /// Packets per second this server received, from the interval counter.
    pub fn own_pps(&self) -> u64 {
        per_second(self.own_load, self.interval_us)
    }
}

fn per_second(count: u64, interval_us: u32) -> u64 {
    if interval_us == 0 {
        return 0;
    }
    let pps = u128::from(count) * 1_000_000 / u128::from(interval_us);
    u64::try_from(pps).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> LoadRepr {
        LoadRepr {
            epoch: 3,
            sequence: 0x0102_0304_0506_0708,
            interval_us: 1000,
            server_id: ServerId(2),
            own_load: 150,
            pool_load: 400,
            live_servers: 4,
            least_loaded: Ipv4Addr::new(198, 18, 2, 13),
            weights: None,
        }
    }

    #[test]
    fn golden_bytes_and_round_trip() {
        let mut buf = [0xffu8; 48];
        assert_eq!(sample().emit(&mut buf).unwrap(), 48);
        let expected: [u8; 48] = [
            0xCA, 0x9C, 1, 0, 0, 0, 0, 3, 1, 2, 3, 4, 5, 6, 7, 8, 0, 0, 0x03, 0xE8, 0, 0, 0, 2, 0,
            0, 0, 0, 0, 0, 0, 150, 0, 0, 0, 0, 0, 0, 0x01, 0x90, 0, 0, 0, 4, 198, 18, 2, 13,
        ];
        assert_eq!(buf, expected);
        let r = LoadRepr::parse_bytes(&buf).unwrap();
        assert_eq!(r, sample());
        assert_eq!(r.pool_average(), 100);
        assert_eq!(r.own_pps(), 150_000);
    }

    /// Version 2: the first 48 bytes as version 1 (but the version), then
    /// the weights; version 1 still parses, as a pool of equal weights.
    #[test]
    fn weighted_golden_bytes_and_round_trip() {
        let w = LoadRepr {
            weights: Some(LoadWeights {
                own: 5,
                pool: 0x0102_0007,
            }),
            ..sample()
        };
        let mut buf = [0xffu8; 60];
        assert_eq!(w.emit(&mut buf).unwrap(), 56);
        let mut v1 = [0u8; 48];
        sample().emit(&mut v1).unwrap();
        assert_eq!(buf[2], 2);
        assert_eq!((&buf[..2], &buf[3..48]), (&v1[..2], &v1[3..48]));
        assert_eq!(&buf[48..56], &[0, 0, 0, 5, 1, 2, 0, 7]);
        assert_eq!(&buf[56..], &[0xff; 4]);
        assert_eq!(LoadRepr::parse_bytes(&buf[..56]).unwrap(), w);
        assert_eq!(LoadRepr::parse_bytes(&v1).unwrap().weights, None);
        assert_eq!(
            LoadRepr::parse_bytes(&buf[..48]),
            Err(LoadError::Truncated { len: 48 })
        );
        assert_eq!(
            LoadRepr::parse_bytes(&buf[..57]),
            Err(LoadError::TrailingBytes { len: 57 })
        );
        assert_eq!(
            w.emit(&mut [0u8; 48]),
            Err(LoadError::BufferTooSmall { len: 48 })
        );
    }

    #[test]
    fn errors() {
        let mut buf = [0u8; 49];
        sample().emit(&mut buf).unwrap();
        assert_eq!(
            LoadRepr::parse_bytes(&buf[..47]),
            Err(LoadError::Truncated { len: 47 })
        );
        assert_eq!(
            LoadRepr::parse_bytes(&buf),
            Err(LoadError::TrailingBytes { len: 49 })
        );
        buf[2] = 3;
        assert_eq!(
            LoadRepr::parse_bytes(&buf[..48]),
            Err(LoadError::UnsupportedVersion { found: 3 })
        );
        assert_eq!(
            LoadRepr::parse_bytes(&[0, 0, 0, 0]),
            Err(LoadError::BadMagic { found: 0 })
        );
        assert_eq!(per_second(u64::MAX, 1), u64::MAX);
        assert_eq!(per_second(5, 0), 0);
    }
}
