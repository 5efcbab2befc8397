//! TCPMig, the connection-migration protocol, version 2 (UDP port 7690).
//!
//! Wire layout (all integers big-endian; docs/TCPMIG.md has the full table):
//! a 52-byte header, `payload_len` bytes of payload, then a 16-byte
//! truncated HMAC-SHA256 over header + payload. The C mirror is
//! `proto/include/capybara_proto.h` (`struct tcpmig_hdr`), checked against
//! [`field`] by `tests/c_header.rs`.
//!
//! Invariants:
//! - after [`TcpMigPacket::new_checked`] succeeds, no accessor panics: the
//!   buffer holds exactly header + `payload_len` + MAC bytes, the magic is
//!   right, the version is [`VERSION`] and the kind is known;
//! - a wrong version and an unknown kind are distinct errors
//!   ([`TcpMigError::UnsupportedVersion`], [`TcpMigError::UnknownKind`]) so
//!   that receivers can count them before dropping;
//! - parsing never verifies the MAC (the switch has no key); receivers that
//!   act on a message call [`TcpMigPacket::verify_mac`] (or
//!   [`TcpMigRepr::parse_verified`]) first;
//! - nothing here allocates.
//!
//! Version 2 adds the 8-byte ownership `epoch` after `reason` (the id of
//! the migration that gave the origin the flow, 0 for its placement), so
//! that the switch can tell a stale PREPARE_ACK from a current one
//! (docs/MIGRATION.md). Version 1 datagrams are refused with
//! [`TcpMigError::UnsupportedVersion`] before any other field is read.

use std::net::Ipv4Addr;

use thiserror::Error;

use crate::flow::FlowKey;
use crate::mac::{MigrationKey, MAC_LEN};

/// First two bytes of every TCPMig datagram.
pub const MAGIC: u16 = 0xCA9B;
/// The only version this code speaks (v1 had no `epoch` field).
pub const VERSION: u8 = 2;
/// Header length (the payload starts here).
pub const HEADER_LEN: usize = field::PAYLOAD;
/// Smallest valid datagram: header, empty payload, MAC.
pub const MIN_LEN: usize = HEADER_LEN + MAC_LEN;
/// Largest payload a header can announce.
pub const MAX_PAYLOAD_LEN: usize = u16::MAX as usize;

/// Byte ranges of the header fields.
pub mod field {
    #![allow(missing_docs)]
    pub type Field = core::ops::Range<usize>;

    pub const MAGIC: Field = 0..2;
    pub const VERSION: usize = 2;
    pub const KIND: usize = 3;
    pub const MIGRATION_ID: Field = 4..12;
    pub const CLIENT_IP: Field = 12..16;
    pub const CLIENT_PORT: Field = 16..18;
    pub const SERVICE_PORT: Field = 18..20;
    pub const SERVICE_IP: Field = 20..24;
    pub const ORIGIN: Field = 24..28;
    pub const TARGET: Field = 28..32;
    pub const SEQ: Field = 32..36;
    pub const FRAG_INDEX: Field = 36..38;
    pub const FRAG_COUNT: Field = 38..40;
    pub const PAYLOAD_LEN: Field = 40..42;
    pub const REASON: Field = 42..44;
    /// v2: ownership epoch of the origin (see [`super::TcpMigRepr::epoch`]).
    pub const EPOCH: Field = 44..52;
    /// Start of the payload (= header length).
    pub const PAYLOAD: usize = 52;
}

/// Message kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    /// origin -> switch -> target: reserve a buffer for this flow.
    Prepare,
    /// target -> switch -> origin: buffer ready; the switch redirects the flow.
    PrepareAck,
    /// origin -> target: one fragment of the connection snapshot.
    ConnState,
    /// target -> origin: snapshot imported, target now serves the flow.
    ConnStateAck,
    /// target -> origin: the target refuses (see `reason`); origin keeps serving.
    Reject,
    /// either side: give up this migration (see `reason`).
    Abort,
}

impl Kind {
    pub const fn to_u8(self) -> u8 {
        match self {
            Kind::Prepare => 1,
            Kind::PrepareAck => 2,
            Kind::ConnState => 3,
            Kind::ConnStateAck => 4,
            Kind::Reject => 5,
            Kind::Abort => 6,
        }
    }

    pub const fn from_u8(v: u8) -> Option<Kind> {
        Some(match v {
            1 => Kind::Prepare,
            2 => Kind::PrepareAck,
            3 => Kind::ConnState,
            4 => Kind::ConnStateAck,
            5 => Kind::Reject,
            6 => Kind::Abort,
            _ => return None,
        })
    }

    pub const ALL: [Kind; 6] = [
        Kind::Prepare,
        Kind::PrepareAck,
        Kind::ConnState,
        Kind::ConnStateAck,
        Kind::Reject,
        Kind::Abort,
    ];
}

impl std::fmt::Display for Kind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Kind::Prepare => "PREPARE",
            Kind::PrepareAck => "PREPARE_ACK",
            Kind::ConnState => "CONN_STATE",
            Kind::ConnStateAck => "CONN_STATE_ACK",
            Kind::Reject => "REJECT",
            Kind::Abort => "ABORT",
        })
    }
}

/// Why a migration was rejected or aborted. Codes unknown to this version
/// are kept as [`Reason::Unknown`] (never an error), so that newer peers can
/// add reasons without breaking older ones.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Reason {
    /// 0: not a REJECT/ABORT.
    None,
    /// 1: the target has no room (buffers, connection slots).
    NoCapacity,
    /// 2: the target is draining.
    Draining,
    /// 3: refused by policy (anti-thrash cooldown, rate cap, operator rule).
    Policy,
    /// 4: a phase timed out.
    Timeout,
    /// 5: the message refers to a migration the receiver does not know.
    UnknownMigration,
    /// 6: the snapshot could not be imported (bad version, corrupt).
    ImportFailed,
    /// 7: the target already holds or is receiving this flow.
    DuplicateFlow,
    /// 8: the origin gave up (connection closed, operator cancel).
    Cancelled,
    /// 9: the origin's snapshot of the connection exceeds its snapshot
    /// size limit (nothing was sent; the origin keeps the connection).
    SnapshotTooLarge,
    /// 0xFFFF: unspecified.
    Unspecified,
    /// Any other code.
    Unknown(u16),
}

impl Reason {
    pub const fn to_u16(self) -> u16 {
        match self {
            Reason::None => 0,
            Reason::NoCapacity => 1,
            Reason::Draining => 2,
            Reason::Policy => 3,
            Reason::Timeout => 4,
            Reason::UnknownMigration => 5,
            Reason::ImportFailed => 6,
            Reason::DuplicateFlow => 7,
            Reason::Cancelled => 8,
            Reason::SnapshotTooLarge => 9,
            Reason::Unspecified => 0xFFFF,
            Reason::Unknown(v) => v,
        }
    }

    pub const fn from_u16(v: u16) -> Reason {
        match v {
            0 => Reason::None,
            1 => Reason::NoCapacity,
            2 => Reason::Draining,
            3 => Reason::Policy,
            4 => Reason::Timeout,
            5 => Reason::UnknownMigration,
            6 => Reason::ImportFailed,
            7 => Reason::DuplicateFlow,
            8 => Reason::Cancelled,
            9 => Reason::SnapshotTooLarge,
            0xFFFF => Reason::Unspecified,
            v => Reason::Unknown(v),
        }
    }
}

impl From<u16> for Reason {
    fn from(v: u16) -> Self {
        Reason::from_u16(v)
    }
}

impl From<Reason> for u16 {
    fn from(r: Reason) -> Self {
        r.to_u16()
    }
}

impl std::fmt::Display for Reason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Reason::None => f.write_str("none"),
            Reason::NoCapacity => f.write_str("no capacity"),
            Reason::Draining => f.write_str("draining"),
            Reason::Policy => f.write_str("policy"),
            Reason::Timeout => f.write_str("timeout"),
            Reason::UnknownMigration => f.write_str("unknown migration"),
            Reason::ImportFailed => f.write_str("import failed"),
            Reason::DuplicateFlow => f.write_str("duplicate flow"),
            Reason::Cancelled => f.write_str("cancelled"),
            Reason::SnapshotTooLarge => f.write_str("snapshot too large"),
            Reason::Unspecified => f.write_str("unspecified"),
            Reason::Unknown(v) => write!(f, "unknown reason {v}"),
        }
    }
}

/// What was wrong with a TCPMig datagram.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum TcpMigError {
    #[error("TCPMig datagram truncated: {len} bytes, need at least {min}")]
    Truncated { len: usize, min: usize },
    #[error("not a TCPMig datagram: magic {found:#06x}, expected {MAGIC:#06x}")]
    BadMagic { found: u16 },
    #[error("unsupported TCPMig version {found} (this node speaks {VERSION})")]
    UnsupportedVersion { found: u8 },
    #[error("unknown TCPMig kind {found}")]
    UnknownKind { found: u8 },
    #[error("TCPMig length mismatch: datagram is {len} bytes, header announces {expected} (payload_len {payload_len})")]
    LengthMismatch {
        len: usize,
        expected: usize,
        payload_len: u16,
    },
    #[error("TCPMig fragment {index} of {count} is invalid")]
    BadFragment { index: u16, count: u16 },
    #[error("TCPMig MAC verification failed")]
    BadMac,
    #[error("TCPMig buffer too small to emit: {len} bytes, need {needed}")]
    BufferTooSmall { len: usize, needed: usize },
    #[error("TCPMig payload too long: {len} bytes, at most {MAX_PAYLOAD_LEN}")]
    PayloadTooLong { len: usize },
}

/// A zero-copy view of a TCPMig datagram (the UDP payload).
#[derive(Debug, Clone)]
pub struct TcpMigPacket<T: AsRef<[u8]>> {
    buffer: T,
}

#[inline]
fn be16(b: &[u8], r: field::Field) -> u16 {
    u16::from_be_bytes([b[r.start], b[r.start + 1]])
}

#[inline]
fn be64(b: &[u8], r: field::Field) -> u64 {
    let mut v = [0u8; 8];
    v.copy_from_slice(&b[r]);
    u64::from_be_bytes(v)
}

#[inline]
fn be32(b: &[u8], r: field::Field) -> u32 {
    u32::from_be_bytes([b[r.start], b[r.start + 1], b[r.start + 2], b[r.start + 3]])
}

impl<T: AsRef<[u8]>> TcpMigPacket<T> {
    /// Wraps a buffer without checking it. Accessors may panic on a short
    /// buffer: use only on bytes this process just emitted.
    pub const fn new_unchecked(buffer: T) -> Self {
        TcpMigPacket { buffer }
    }

    /// Wraps and validates untrusted bytes; see the module invariants.
    pub fn new_checked(buffer: T) -> Result<Self, TcpMigError> {
        let p = TcpMigPacket { buffer };
        p.check()?;
        Ok(p)
    }

    /// Validates in the order a receiver wants to count failures: length of
    /// the fixed header, magic (not ours at all), version (ours, another
    /// version), kind, then total length against `payload_len`.
    pub fn check(&self) -> Result<(), TcpMigError> {
        let b = self.buffer.as_ref();
        if b.len() < HEADER_LEN {
            return Err(TcpMigError::Truncated {
                len: b.len(),
                min: MIN_LEN,
            });
        }
        let magic = be16(b, field::MAGIC);
        if magic != MAGIC {
            return Err(TcpMigError::BadMagic { found: magic });
        }
        // A different version may have a different layout after the first
        // four bytes, so nothing beyond them is interpreted.
        if b[field::VERSION] != VERSION {
            return Err(TcpMigError::UnsupportedVersion {
                found: b[field::VERSION],
            });
        }
        if Kind::from_u8(b[field::KIND]).is_none() {
            return Err(TcpMigError::UnknownKind {
                found: b[field::KIND],
            });
        }
        let payload_len = be16(b, field::PAYLOAD_LEN);
        let expected = HEADER_LEN + usize::from(payload_len) + MAC_LEN;
        // Exact, not "at least": UDP already delimits the datagram, and
        // trailing bytes outside the MAC would be unauthenticated.
        if b.len() != expected {
            return Err(TcpMigError::LengthMismatch {
                len: b.len(),
                expected,
                payload_len,
            });
        }
        Ok(())
    }

    pub fn into_inner(self) -> T {
        self.buffer
    }

    pub fn magic(&self) -> u16 {
        be16(self.buffer.as_ref(), field::MAGIC)
    }
    pub fn version(&self) -> u8 {
        self.buffer.as_ref()[field::VERSION]
    }
    /// The kind (known after `new_checked`; an unknown byte reads as `None`).
    pub fn kind(&self) -> Option<Kind> {
        Kind::from_u8(self.buffer.as_ref()[field::KIND])
    }
    pub fn migration_id(&self) -> u64 {
        be64(self.buffer.as_ref(), field::MIGRATION_ID)
    }
    /// The ownership epoch (v2).
    pub fn epoch(&self) -> u64 {
        be64(self.buffer.as_ref(), field::EPOCH)
    }
    pub fn flow(&self) -> FlowKey {
        let b = self.buffer.as_ref();
        FlowKey {
            client_ip: Ipv4Addr::from(be32(b, field::CLIENT_IP)),
            client_port: be16(b, field::CLIENT_PORT),
            service_ip: Ipv4Addr::from(be32(b, field::SERVICE_IP)),
            service_port: be16(b, field::SERVICE_PORT),
        }
    }
    pub fn origin(&self) -> Ipv4Addr {
        Ipv4Addr::from(be32(self.buffer.as_ref(), field::ORIGIN))
    }
    pub fn target(&self) -> Ipv4Addr {
        Ipv4Addr::from(be32(self.buffer.as_ref(), field::TARGET))
    }
    pub fn seq(&self) -> u32 {
        be32(self.buffer.as_ref(), field::SEQ)
    }
    pub fn frag_index(&self) -> u16 {
        be16(self.buffer.as_ref(), field::FRAG_INDEX)
    }
    pub fn frag_count(&self) -> u16 {
        be16(self.buffer.as_ref(), field::FRAG_COUNT)
    }
    pub fn payload_len(&self) -> u16 {
        be16(self.buffer.as_ref(), field::PAYLOAD_LEN)
    }
    pub fn reason(&self) -> Reason {
        Reason::from_u16(be16(self.buffer.as_ref(), field::REASON))
    }
    /// The payload (a snapshot fragment for CONN_STATE).
    pub fn payload(&self) -> &[u8] {
        let b = self.buffer.as_ref();
        let end = field::PAYLOAD + usize::from(self.payload_len());
        &b[field::PAYLOAD..end]
    }
    /// The bytes the MAC covers: header and payload.
    pub fn authenticated(&self) -> &[u8] {
        let b = self.buffer.as_ref();
        &b[..b.len() - MAC_LEN]
    }
    /// The 16-byte MAC at the end.
    pub fn mac(&self) -> &[u8] {
        let b = self.buffer.as_ref();
        &b[b.len() - MAC_LEN..]
    }

    /// Checks the MAC in constant time.
    pub fn verify_mac(&self, key: &MigrationKey) -> Result<(), TcpMigError> {
        if key.verify(&[self.authenticated()], self.mac()) {
            Ok(())
        } else {
            Err(TcpMigError::BadMac)
        }
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> TcpMigPacket<T> {
    fn put16(&mut self, r: field::Field, v: u16) {
        self.buffer.as_mut()[r].copy_from_slice(&v.to_be_bytes());
    }
    fn put32(&mut self, r: field::Field, v: u32) {
        self.buffer.as_mut()[r].copy_from_slice(&v.to_be_bytes());
    }
    pub fn set_magic(&mut self, v: u16) {
        self.put16(field::MAGIC, v)
    }
    pub fn set_version(&mut self, v: u8) {
        self.buffer.as_mut()[field::VERSION] = v
    }
    pub fn set_kind(&mut self, v: Kind) {
        self.buffer.as_mut()[field::KIND] = v.to_u8()
    }
    pub fn set_migration_id(&mut self, v: u64) {
        self.buffer.as_mut()[field::MIGRATION_ID].copy_from_slice(&v.to_be_bytes())
    }
    pub fn set_epoch(&mut self, v: u64) {
        self.buffer.as_mut()[field::EPOCH].copy_from_slice(&v.to_be_bytes())
    }
    pub fn set_flow(&mut self, f: FlowKey) {
        self.put32(field::CLIENT_IP, u32::from(f.client_ip));
        self.put16(field::CLIENT_PORT, f.client_port);
        self.put16(field::SERVICE_PORT, f.service_port);
        self.put32(field::SERVICE_IP, u32::from(f.service_ip));
    }
    pub fn set_origin(&mut self, v: Ipv4Addr) {
        self.put32(field::ORIGIN, u32::from(v))
    }
    pub fn set_target(&mut self, v: Ipv4Addr) {
        self.put32(field::TARGET, u32::from(v))
    }
    pub fn set_seq(&mut self, v: u32) {
        self.put32(field::SEQ, v)
    }
    pub fn set_frag_index(&mut self, v: u16) {
        self.put16(field::FRAG_INDEX, v)
    }
    pub fn set_frag_count(&mut self, v: u16) {
        self.put16(field::FRAG_COUNT, v)
    }
    pub fn set_payload_len(&mut self, v: u16) {
        self.put16(field::PAYLOAD_LEN, v)
    }
    pub fn set_reason(&mut self, v: Reason) {
        self.put16(field::REASON, v.to_u16())
    }
    pub fn payload_mut(&mut self) -> &mut [u8] {
        let end = field::PAYLOAD + usize::from(self.payload_len());
        &mut self.buffer.as_mut()[field::PAYLOAD..end]
    }
    /// Computes and writes the MAC over header + payload.
    pub fn fill_mac(&mut self, key: &MigrationKey) {
        let tag = key.compute(&[self.authenticated()]);
        let b = self.buffer.as_mut();
        let n = b.len();
        b[n - MAC_LEN..].copy_from_slice(&tag);
    }
}

/// Whether migration id `a` is newer than `b`, ids of one origin: serial-
/// number arithmetic (RFC 1982) on the low 32 bits, the origin's counter
/// (seeded from the clock or the switch's memory, it wraps every ~49.7
/// days). The switch's program compares ids the same way in C.
pub fn migration_id_newer(a: u64, b: u64) -> bool {
    (a as u32).wrapping_sub(b as u32) as i32 > 0
}

/// A parsed TCPMig message. `payload` borrows from the datagram.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TcpMigRepr<'a> {
    pub kind: Kind,
    pub migration_id: u64,
    /// The flow as the client sees it.
    pub flow: FlowKey,
    /// Data address of the origin server.
    pub origin: Ipv4Addr,
    /// Data address of the target; `0.0.0.0` in PREPARE lets the switch choose.
    pub target: Ipv4Addr,
    /// Per-migration, per-sender message sequence number.
    pub seq: u32,
    /// CONN_STATE fragment index (0 otherwise).
    pub frag_index: u16,
    /// CONN_STATE fragment count (1 otherwise).
    pub frag_count: u16,
    /// REJECT/ABORT reason, [`Reason::None`] otherwise.
    pub reason: Reason,
    /// Ownership epoch (v2): the id of the migration that gave the origin
    /// the flow, 0 if the origin has it from its placement. Set by the
    /// origin in every message of a migration and echoed by the target;
    /// the switch installs a PREPARE_ACK over a final entry only if the
    /// entry's id is this epoch (or an older id of the same origin).
    pub epoch: u64,
    /// CONN_STATE: a snapshot fragment. REJECT/ABORT: optional UTF-8
    /// diagnostic. Other kinds: empty in v1 (receivers ignore it).
    pub payload: &'a [u8],
}

impl TcpMigRepr<'_> {
    /// The switch's rule (docs/MIGRATION.md, "What the switch must do"):
    /// whether this migration (origin `o`, ownership epoch `E`) may take
    /// over a flow whose migration-table entry is `{owner, id, pending}`.
    /// The entry is final, on `o`, of another migration, and its id is `E`
    /// (the migration that gave `o` the flow) or an older id of `o` itself
    /// (its own aborted migrations since); or the entry is still pending
    /// toward `o` for `E` itself (`o` owns the flow through it: it
    /// committed, its CONN_STATE_ACK has not passed the switch yet).
    pub fn supersedes(&self, owner: Ipv4Addr, id: u64, pending: bool) -> bool {
        if owner != self.origin || id == self.migration_id {
            return false;
        }
        if pending {
            return id == self.epoch;
        }
        id == self.epoch
            || (id >> 32 == self.migration_id >> 32 && migration_id_newer(self.migration_id, id))
    }
}

impl<'a> TcpMigRepr<'a> {
    /// Parses a validated packet (MAC not checked: see [`Self::parse_verified`]).
    pub fn parse<T: AsRef<[u8]> + ?Sized>(
        packet: &TcpMigPacket<&'a T>,
    ) -> Result<Self, TcpMigError> {
        let buffer: &'a T = packet.buffer;
        Self::parse_bytes(buffer.as_ref())
    }

    /// Validates and parses raw datagram bytes (MAC not checked).
    pub fn parse_bytes(bytes: &'a [u8]) -> Result<Self, TcpMigError> {
        let p = TcpMigPacket::new_checked(bytes)?;
        let frag_index = p.frag_index();
        let frag_count = p.frag_count();
        if frag_count == 0 || frag_index >= frag_count {
            return Err(TcpMigError::BadFragment {
                index: frag_index,
                count: frag_count,
            });
        }
        let kind = p.kind().ok_or(TcpMigError::UnknownKind {
            found: p.buffer[field::KIND],
        })?;
        let end = field::PAYLOAD + usize::from(p.payload_len());
        Ok(TcpMigRepr {
            kind,
            migration_id: p.migration_id(),
            flow: p.flow(),
            origin: p.origin(),
            target: p.target(),
            seq: p.seq(),
            frag_index,
            frag_count,
            reason: p.reason(),
            epoch: p.epoch(),
            payload: &bytes[field::PAYLOAD..end],
        })
    }

    /// Validates, checks the MAC, then parses. What every host-side receiver
    /// should call.
    pub fn parse_verified(bytes: &'a [u8], key: &MigrationKey) -> Result<Self, TcpMigError> {
        let p = TcpMigPacket::new_checked(bytes)?;
        p.verify_mac(key)?;
        Self::parse_bytes(bytes)
    }

    /// Datagram length: header + payload + MAC.
    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN + self.payload.len() + MAC_LEN
    }

    /// Writes the message into the first [`Self::buffer_len`] bytes of
    /// `buf` with a zero MAC (use [`Self::emit_with_mac`] to send).
    /// Returns the number of bytes written.
    pub fn emit(&self, buf: &mut [u8]) -> Result<usize, TcpMigError> {
        if self.payload.len() > MAX_PAYLOAD_LEN {
            return Err(TcpMigError::PayloadTooLong {
                len: self.payload.len(),
            });
        }
        if self.frag_count == 0 || self.frag_index >= self.frag_count {
            return Err(TcpMigError::BadFragment {
                index: self.frag_index,
                count: self.frag_count,
            });
        }
        let n = self.buffer_len();
        if buf.len() < n {
            return Err(TcpMigError::BufferTooSmall {
                len: buf.len(),
                needed: n,
            });
        }
        let mut p = TcpMigPacket::new_unchecked(&mut buf[..n]);
        p.set_magic(MAGIC);
        p.set_version(VERSION);
        p.set_kind(self.kind);
        p.set_migration_id(self.migration_id);
        p.set_flow(self.flow);
        p.set_origin(self.origin);
        p.set_target(self.target);
        p.set_seq(self.seq);
        p.set_frag_index(self.frag_index);
        p.set_frag_count(self.frag_count);
        // Checked above: fits in u16.
        p.set_payload_len(self.payload.len() as u16);
        p.set_reason(self.reason);
        p.set_epoch(self.epoch);
        p.payload_mut().copy_from_slice(self.payload);
        let b = p.into_inner();
        b[n - MAC_LEN..].fill(0);
        Ok(n)
    }

    /// Writes the message and its MAC; returns the number of bytes written.
    pub fn emit_with_mac(&self, buf: &mut [u8], key: &MigrationKey) -> Result<usize, TcpMigError> {
        let n = self.emit(buf)?;
        TcpMigPacket::new_unchecked(&mut buf[..n]).fill_mac(key);
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> MigrationKey {
        MigrationKey::from_bytes(&[7u8; 32]).unwrap()
    }

    /// The switch's takeover rule, one row per case of docs/MIGRATION.md.
    #[test]
    fn supersedes_follows_the_switch_rule() {
        let o = Ipv4Addr::new(198, 18, 2, 11);
        let t = Ipv4Addr::new(198, 18, 2, 12);
        let id_of = |a: Ipv4Addr, n: u32| (u64::from(u32::from(a)) << 32) | u64::from(n);
        let (e, m) = (id_of(t, 7), id_of(o, 20));
        let mig = TcpMigRepr {
            kind: Kind::PrepareAck,
            migration_id: m,
            origin: o,
            target: t,
            epoch: e,
            ..prepare()
        };
        for (owner, id, pending, want, what) in [
            (o, e, false, true, "final, epoch"),
            (o, id_of(o, 19), false, true, "final, older id"),
            (o, id_of(o, u32::MAX - 3), false, true, "across the wrap"),
            (o, id_of(o, 21), false, false, "final, newer id"),
            (o, m, false, false, "duplicate"),
            (t, e, false, false, "final elsewhere"),
            (o, id_of(t, 3), false, false, "not o's id"),
            (o, e, true, true, "pending, epoch"),
            (o, id_of(o, 19), true, false, "pending, no epoch"),
            (t, e, true, false, "pending elsewhere"),
        ] {
            assert_eq!(mig.supersedes(owner, id, pending), want, "{what}");
        }
        assert!(migration_id_newer(id_of(o, 2), id_of(o, u32::MAX)));
        assert!(!migration_id_newer(id_of(o, u32::MAX), id_of(o, 2)));
    }

    fn prepare() -> TcpMigRepr<'static> {
        TcpMigRepr {
            kind: Kind::Prepare,
            migration_id: 0x0102_0304_0506_0708,
            flow: FlowKey {
                client_ip: Ipv4Addr::new(198, 18, 0, 10),
                client_port: 40000,
                service_ip: Ipv4Addr::new(198, 18, 100, 1),
                service_port: 80,
            },
            origin: Ipv4Addr::new(198, 18, 2, 10),
            target: Ipv4Addr::UNSPECIFIED,
            seq: 0,
            frag_index: 0,
            frag_count: 1,
            reason: Reason::None,
            epoch: 0xC612_020B_0000_0003,
            payload: &[],
        }
    }

    #[test]
    fn golden_prepare_bytes() {
        let mut buf = [0u8; 68];
        assert_eq!(prepare().emit(&mut buf).unwrap(), 68);
        let expected_header: [u8; 52] = [
            0xCA, 0x9B, 2, 1, 1, 2, 3, 4, 5, 6, 7, 8, // magic, version, kind, id
            198, 18, 0, 10, 0x9c, 0x40, 0, 80, // client ip, client port, service port
            198, 18, 100, 1, 198, 18, 2, 10, 0, 0, 0, 0, // vip, origin, target
            0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, // seq, frag idx/count, len, reason
            198, 18, 2, 11, 0, 0, 0, 3, // epoch (migration 3 of 198.18.2.11)
        ];
        assert_eq!(&buf[..52], &expected_header);
        assert_eq!(&buf[52..], &[0u8; 16]);
    }

    #[test]
    fn version_1_is_refused_before_its_layout_is_read() {
        let mut buf = [0u8; 68];
        prepare().emit_with_mac(&mut buf, &key()).unwrap();
        // A v1 PREPARE: 44-byte header, no epoch, 60 bytes in all.
        let mut v1 = [0u8; 60];
        v1[..44].copy_from_slice(&buf[..44]);
        v1[2] = 1;
        assert_eq!(
            TcpMigPacket::new_checked(&v1[..]).unwrap_err(),
            TcpMigError::UnsupportedVersion { found: 1 }
        );
        assert_eq!(
            TcpMigRepr::parse_verified(&v1[..], &key()).unwrap_err(),
            TcpMigError::UnsupportedVersion { found: 1 }
        );
        assert_eq!(
            TcpMigError::UnsupportedVersion { found: 1 }.to_string(),
            "unsupported TCPMig version 1 (this node speaks 2)"
        );
    }

    #[test]
    fn mac_covers_the_epoch() {
        let mut buf = [0u8; 68];
        let n = prepare().emit_with_mac(&mut buf, &key()).unwrap();
        assert_eq!(
            TcpMigRepr::parse_verified(&buf[..n], &key()).unwrap().epoch,
            prepare().epoch
        );
        for i in field::EPOCH {
            let mut b = buf;
            b[i] ^= 0x80;
            assert_eq!(
                TcpMigRepr::parse_verified(&b[..n], &key()),
                Err(TcpMigError::BadMac),
                "epoch byte {i}"
            );
        }
    }

    #[test]
    fn round_trip_with_mac() {
        let snap = [0xAAu8; 100];
        let repr = TcpMigRepr {
            kind: Kind::ConnState,
            seq: 5,
            frag_index: 2,
            frag_count: 3,
            target: Ipv4Addr::new(198, 18, 2, 11),
            payload: &snap,
            ..prepare()
        };
        let mut buf = [0u8; 200];
        let n = repr.emit_with_mac(&mut buf, &key()).unwrap();
        assert_eq!(n, 168);
        let parsed = TcpMigRepr::parse_verified(&buf[..n], &key()).unwrap();
        assert_eq!(parsed, repr);
        let other = MigrationKey::from_bytes(&[8u8; 32]).unwrap();
        assert_eq!(
            TcpMigRepr::parse_verified(&buf[..n], &other),
            Err(TcpMigError::BadMac)
        );
        buf[50] ^= 1;
        assert_eq!(
            TcpMigRepr::parse_verified(&buf[..n], &key()),
            Err(TcpMigError::BadMac)
        );
    }

    #[test]
    fn errors_are_distinct_and_ordered() {
        let mut buf = [0u8; 68];
        prepare().emit(&mut buf).unwrap();
        assert_eq!(
            TcpMigPacket::new_checked(&buf[..51]).unwrap_err(),
            TcpMigError::Truncated {
                len: 51,
                min: MIN_LEN
            }
        );
        let mut v = buf;
        v[2] = 3;
        v[3] = 99; // version is checked before kind
        assert_eq!(
            TcpMigPacket::new_checked(&v[..]).unwrap_err(),
            TcpMigError::UnsupportedVersion { found: 3 }
        );
        let mut k = buf;
        k[3] = 7;
        assert_eq!(
            TcpMigPacket::new_checked(&k[..]).unwrap_err(),
            TcpMigError::UnknownKind { found: 7 }
        );
        let mut m = buf;
        m[0] = 0;
        assert!(matches!(
            TcpMigPacket::new_checked(&m[..]),
            Err(TcpMigError::BadMagic { .. })
        ));
        assert_eq!(
            TcpMigPacket::new_checked(&buf[..67]).unwrap_err(),
            TcpMigError::LengthMismatch {
                len: 67,
                expected: 68,
                payload_len: 0
            }
        );
        let mut f = buf;
        f[39] = 0; // frag_count 0
        assert_eq!(
            TcpMigRepr::parse_bytes(&f[..]).unwrap_err(),
            TcpMigError::BadFragment { index: 0, count: 0 }
        );
    }

    #[test]
    fn reasons_round_trip() {
        for v in [0u16, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1000, 0xFFFE, 0xFFFF] {
            assert_eq!(Reason::from_u16(v).to_u16(), v);
        }
        assert_eq!(Reason::from(9), Reason::SnapshotTooLarge);
        assert_eq!(Reason::from(10), Reason::Unknown(10));
    }
}
