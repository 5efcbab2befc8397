//! LOAD-NOTIFICATION, version 1: the pool monitor's per-interval report
//! (UDP port 7691, switch -> each server's data address).
//!
//! Every interval (default 1 ms) the switch tells each server how many
//! packets it forwarded to that server and to the whole pool; a server whose
//! share exceeds the pool average by a threshold sheds load (seed 000 §5.1).
//!
//! Wire layout: a fixed 48-byte message, every field naturally aligned
//! (docs/TCPMIG.md; C mirror `struct load_notification`).
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
}

/// What was wrong with a LOAD-NOTIFICATION.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum LoadError {
    #[error("load notification truncated: {len} bytes, need {LEN}")]
    Truncated { len: usize },
    #[error("not a load notification: magic {found:#06x}, expected {MAGIC:#06x}")]
    BadMagic { found: u16 },
    #[error("unsupported load notification version {found} (this node speaks {VERSION})")]
    UnsupportedVersion { found: u8 },
    #[error("load notification has {len} bytes, version 1 has exactly {LEN}")]
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
        if b[field::VERSION] != VERSION {
            return Err(LoadError::UnsupportedVersion {
                found: b[field::VERSION],
            });
        }
        if b.len() < LEN {
            return Err(LoadError::Truncated { len: b.len() });
        }
        if b.len() > LEN {
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
        })
    }

    /// Validates and parses raw bytes.
    pub fn parse_bytes(bytes: &[u8]) -> Result<Self, LoadError> {
        Self::parse(&LoadPacket::new_checked(bytes)?)
    }

    pub const fn buffer_len(&self) -> usize {
        LEN
    }

    /// Writes the notification into the first [`LEN`] bytes of `buf`.
    pub fn emit(&self, buf: &mut [u8]) -> Result<usize, LoadError> {
        if buf.len() < LEN {
            return Err(LoadError::BufferTooSmall { len: buf.len() });
        }
        let b = &mut buf[..LEN];
        b[field::MAGIC].copy_from_slice(&MAGIC.to_be_bytes());
        b[field::VERSION] = VERSION;
        b[field::FLAGS] = 0;
        b[field::EPOCH].copy_from_slice(&self.epoch.to_be_bytes());
        b[field::SEQUENCE].copy_from_slice(&self.sequence.to_be_bytes());
        b[field::INTERVAL_US].copy_from_slice(&self.interval_us.to_be_bytes());
        b[field::SERVER_ID].copy_from_slice(&self.server_id.0.to_be_bytes());
        b[field::OWN_LOAD].copy_from_slice(&self.own_load.to_be_bytes());
        b[field::POOL_LOAD].copy_from_slice(&self.pool_load.to_be_bytes());
        b[field::LIVE_SERVERS].copy_from_slice(&self.live_servers.to_be_bytes());
        b[field::LEAST_LOADED].copy_from_slice(&u32::from(self.least_loaded).to_be_bytes());
        Ok(LEN)
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
        buf[2] = 2;
        assert_eq!(
            LoadRepr::parse_bytes(&buf[..48]),
            Err(LoadError::UnsupportedVersion { found: 2 })
        );
        assert_eq!(
            LoadRepr::parse_bytes(&[0, 0, 0, 0]),
            Err(LoadError::BadMagic { found: 0 })
        );
        assert_eq!(per_second(u64::MAX, 1), u64::MAX);
        assert_eq!(per_second(5, 0), 0);
    }
}
