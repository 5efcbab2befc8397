//! Control-channel messages, version 1 (UDP port 7692, between a server's
//! management address and the switch's management address).
//!
//! Every message changes switch or server state (registration, drains,
//! forced migrations), so every message carries the same truncated
//! HMAC-SHA256 as TCPMig, keyed with the deployment's [`MigrationKey`].
//! The magic is covered by the MAC, so a TCPMig tag can never be replayed as
//! a control tag or vice versa.
//!
//! Wire layout: a 20-byte header, `body_len` bytes of body (layout depends
//! on `kind`), a 16-byte MAC over header + body (docs/TCPMIG.md).
//!
//! Invariants:
//! - after [`ControlPacket::new_checked`] the buffer is exactly header +
//!   body + MAC, magic/version/kind are known; no accessor panics;
//! - [`ControlRepr::parse`] checks each body's exact length and content
//!   (service count vs length, UTF-8 of error text) and borrows variable
//!   parts from the datagram: parsing allocates nothing;
//! - parsing does not verify the MAC; [`ControlRepr::parse_verified`] does.

use std::net::{Ipv4Addr, SocketAddrV4};

use thiserror::Error;

use crate::flow::{FlowKey, ServerId};
use crate::mac::{MigrationKey, MAC_LEN};

pub const MAGIC: u16 = 0xCA9D;
pub const VERSION: u8 = 1;
pub const HEADER_LEN: usize = field::BODY;
pub const MIN_LEN: usize = HEADER_LEN + MAC_LEN;
/// Most services one REGISTER may list (keeps a REGISTER within one
/// 1500-byte Ethernet frame: 20 + 20 + 128 * 8 + 16 bytes of UDP payload).
pub const MAX_SERVICES: usize = 128;
/// Longest ERROR text, in bytes.
pub const MAX_ERROR_TEXT: usize = 512;

/// Byte ranges of the header fields and of each body (body offsets are
/// relative to the start of the body).
pub mod field {
    pub type Field = core::ops::Range<usize>;

    pub const MAGIC: Field = 0..2;
    pub const VERSION: usize = 2;
    pub const KIND: usize = 3;
    pub const SERVER_ID: Field = 4..8;
    pub const SEQ: Field = 8..16;
    pub const BODY_LEN: Field = 16..18;
    pub const FLAGS: Field = 18..20;
    pub const BODY: usize = 20;

    /// REGISTER body (server -> switch).
    pub mod register {
        use super::Field;
        pub const MGMT_ADDR: Field = 0..4;
        pub const DATA_ADDR: Field = 4..8;
        pub const DATA_MAC: Field = 8..14;
        pub const WEIGHT: Field = 14..16;
        pub const SERVICE_COUNT: Field = 16..18;
        pub const RESERVED: Field = 18..20;
        pub const SERVICES: usize = 20;
        /// One service entry: VIP, port, reserved.
        pub const SERVICE_LEN: usize = 8;
        pub const SERVICE_IP: Field = 0..4;
        pub const SERVICE_PORT: Field = 4..6;
    }

    /// REGISTER_ACK body (switch -> server).
    pub mod register_ack {
        use super::Field;
        pub const SWITCH_EPOCH: Field = 0..4;
        pub const LOAD_INTERVAL_US: Field = 4..8;
        pub const HEARTBEAT_INTERVAL_MS: Field = 8..12;
        pub const DEAD_AFTER_MS: Field = 12..16;
        pub const LEN: usize = 16;
    }

    /// HEARTBEAT body (server -> switch).
    pub mod heartbeat {
        use super::Field;
        pub const CONNECTIONS: Field = 0..4;
        pub const MIGRATIONS_IN_FLIGHT: Field = 4..8;
        pub const LOAD_PPS: Field = 8..16;
        pub const RX_BACKLOG_BYTES: Field = 16..24;
        pub const FLAGS: Field = 24..28;
        pub const RESERVED: Field = 28..32;
        pub const LEN: usize = 32;
    }

    /// DRAIN body (switch -> server).
    pub mod drain {
        use super::Field;
        pub const DEADLINE_MS: Field = 0..4;
        pub const FLAGS: Field = 4..8;
        pub const LEN: usize = 8;
    }

    /// MIGRATE body (switch/api -> server).
    pub mod migrate {
        use super::Field;
        pub const CLIENT_IP: Field = 0..4;
        pub const CLIENT_PORT: Field = 4..6;
        pub const SERVICE_PORT: Field = 6..8;
        pub const SERVICE_IP: Field = 8..12;
        pub const TARGET: Field = 12..16;
        pub const LEN: usize = 16;
    }

    /// SET_OWNER body (server -> switch).
    pub mod set_owner {
        use super::Field;
        pub const CLIENT_IP: Field = 0..4;
        pub const CLIENT_PORT: Field = 4..6;
        pub const SERVICE_PORT: Field = 6..8;
        pub const SERVICE_IP: Field = 8..12;
        pub const OWNER: Field = 12..16;
        pub const LEN: usize = 16;
    }

    /// ERROR body (either direction).
    pub mod error {
        use super::Field;
        pub const CODE: Field = 0..2;
        pub const REF_KIND: usize = 2;
        pub const RESERVED: usize = 3;
        pub const REF_SEQ: Field = 4..12;
        pub const TEXT: usize = 12;
    }
}

/// HEARTBEAT flag: the server is draining (acknowledges a DRAIN).
pub const HEARTBEAT_DRAINING: u32 = 1 << 0;
/// DRAIN flag: cancel a drain in progress (undrain).
pub const DRAIN_CANCEL: u32 = 1 << 0;

/// Control message kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ControlKind {
    Register,
    RegisterAck,
    Heartbeat,
    Drain,
    Migrate,
    Error,
    SetOwner,
}

impl ControlKind {
    pub const fn to_u8(self) -> u8 {
        match self {
            ControlKind::Register => 1,
            ControlKind::RegisterAck => 2,
            ControlKind::Heartbeat => 3,
            ControlKind::Drain => 4,
            ControlKind::Migrate => 5,
            ControlKind::Error => 6,
            ControlKind::SetOwner => 7,
        }
    }
    pub const fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            1 => ControlKind::Register,
            2 => ControlKind::RegisterAck,
            3 => ControlKind::Heartbeat,
            4 => ControlKind::Drain,
            5 => ControlKind::Migrate,
            6 => ControlKind::Error,
            7 => ControlKind::SetOwner,
            _ => return None,
        })
    }
}

impl std::fmt::Display for ControlKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ControlKind::Register => "REGISTER",
            ControlKind::RegisterAck => "REGISTER_ACK",
            ControlKind::Heartbeat => "HEARTBEAT",
            ControlKind::Drain => "DRAIN",
            ControlKind::Migrate => "MIGRATE",
            ControlKind::Error => "ERROR",
            ControlKind::SetOwner => "SET_OWNER",
        })
    }
}

/// What was wrong with a control message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum ControlError {
    #[error("control message truncated: {len} bytes, need at least {min}")]
    Truncated { len: usize, min: usize },
    #[error("not a control message: magic {found:#06x}, expected {MAGIC:#06x}")]
    BadMagic { found: u16 },
    #[error("unsupported control message version {found} (this node speaks {VERSION})")]
    UnsupportedVersion { found: u8 },
    #[error("unknown control message kind {found}")]
    UnknownKind { found: u8 },
    #[error("control message length mismatch: {len} bytes, header announces {expected}")]
    LengthMismatch { len: usize, expected: usize },
    #[error("{kind} body is {len} bytes, expected {expected}")]
    BadBodyLength {
        kind: ControlKind,
        len: usize,
        expected: usize,
    },
    #[error("REGISTER lists {count} services, at most {MAX_SERVICES}")]
    TooManyServices { count: usize },
    #[error("ERROR text is {len} bytes, at most {MAX_ERROR_TEXT}")]
    ErrorTextTooLong { len: usize },
    #[error("ERROR text is not UTF-8 (valid up to byte {valid_up_to})")]
    ErrorTextNotUtf8 { valid_up_to: usize },
    #[error("control message MAC verification failed")]
    BadMac,
    #[error("control buffer too small to emit: {len} bytes, need {needed}")]
    BufferTooSmall { len: usize, needed: usize },
}

fn rd<const N: usize>(b: &[u8], r: field::Field) -> [u8; N] {
    let mut a = [0u8; N];
    a.copy_from_slice(&b[r]);
    a
}
fn rd16(b: &[u8], r: field::Field) -> u16 {
    u16::from_be_bytes(rd(b, r))
}
fn rd32(b: &[u8], r: field::Field) -> u32 {
    u32::from_be_bytes(rd(b, r))
}
fn rd64(b: &[u8], r: field::Field) -> u64 {
    u64::from_be_bytes(rd(b, r))
}

/// Zero-copy view of a control message.
#[derive(Debug, Clone)]
pub struct ControlPacket<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> ControlPacket<T> {
    pub const fn new_unchecked(buffer: T) -> Self {
        ControlPacket { buffer }
    }

    pub fn new_checked(buffer: T) -> Result<Self, ControlError> {
        let p = ControlPacket { buffer };
        p.check()?;
        Ok(p)
    }

    pub fn check(&self) -> Result<(), ControlError> {
        let b = self.buffer.as_ref();
        if b.len() < HEADER_LEN {
            return Err(ControlError::Truncated {
                len: b.len(),
                min: MIN_LEN,
            });
        }
        let magic = rd16(b, field::MAGIC);
        if magic != MAGIC {
            return Err(ControlError::BadMagic { found: magic });
        }
        if b[field::VERSION] != VERSION {
            return Err(ControlError::UnsupportedVersion {
                found: b[field::VERSION],
            });
        }
        if ControlKind::from_u8(b[field::KIND]).is_none() {
            return Err(ControlError::UnknownKind {
                found: b[field::KIND],
            });
        }
        let expected = HEADER_LEN + usize::from(rd16(b, field::BODY_LEN)) + MAC_LEN;
        if b.len() != expected {
            return Err(ControlError::LengthMismatch {
                len: b.len(),
                expected,
            });
        }
        Ok(())
    }

    pub fn into_inner(self) -> T {
        self.buffer
    }
    pub fn kind(&self) -> Option<ControlKind> {
        ControlKind::from_u8(self.buffer.as_ref()[field::KIND])
    }
    pub fn server_id(&self) -> ServerId {
        ServerId(rd32(self.buffer.as_ref(), field::SERVER_ID))
    }
    pub fn seq(&self) -> u64 {
        rd64(self.buffer.as_ref(), field::SEQ)
    }
    pub fn body_len(&self) -> u16 {
        rd16(self.buffer.as_ref(), field::BODY_LEN)
    }
    pub fn flags(&self) -> u16 {
        rd16(self.buffer.as_ref(), field::FLAGS)
    }
    pub fn body(&self) -> &[u8] {
        let end = field::BODY + usize::from(self.body_len());
        &self.buffer.as_ref()[field::BODY..end]
    }
    pub fn authenticated(&self) -> &[u8] {
        let b = self.buffer.as_ref();
        &b[..b.len() - MAC_LEN]
    }
    pub fn mac(&self) -> &[u8] {
        let b = self.buffer.as_ref();
        &b[b.len() - MAC_LEN..]
    }
    /// Checks the MAC in constant time.
    pub fn verify_mac(&self, key: &MigrationKey) -> Result<(), ControlError> {
        if key.verify(&[self.authenticated()], self.mac()) {
            Ok(())
        } else {
            Err(ControlError::BadMac)
        }
    }
}

/// The services a server offers, as listed in REGISTER. Either the
/// validated wire bytes of a parsed message or a slice to emit; both
/// iterate the same way and compare equal by content.
#[derive(Clone, Copy)]
pub enum ServiceList<'a> {
    /// `n * SERVICE_LEN` bytes, checked by [`ControlRepr::parse`].
    Wire(&'a [u8]),
    /// Services to emit.
    Slice(&'a [SocketAddrV4]),
}

impl<'a> ServiceList<'a> {
    pub fn len(&self) -> usize {
        match self {
            ServiceList::Wire(b) => b.len() / field::register::SERVICE_LEN,
            ServiceList::Slice(s) => s.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    pub fn iter(&self) -> impl Iterator<Item = SocketAddrV4> + 'a {
        let (wire, slice): (&'a [u8], &'a [SocketAddrV4]) = match *self {
            ServiceList::Wire(b) => (b, &[]),
            ServiceList::Slice(s) => (&[], s),
        };
        use field::register::{SERVICE_IP, SERVICE_LEN, SERVICE_PORT};
        wire.chunks_exact(SERVICE_LEN)
            .map(|c| SocketAddrV4::new(Ipv4Addr::from(rd32(c, SERVICE_IP)), rd16(c, SERVICE_PORT)))
            .chain(slice.iter().copied())
    }
}

impl PartialEq for ServiceList<'_> {
    fn eq(&self, other: &Self) -> bool {
        self.len() == other.len() && self.iter().eq(other.iter())
    }
}
impl Eq for ServiceList<'_> {}

impl std::fmt::Debug for ServiceList<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

/// REGISTER: a server announces itself (server -> switch). The header's
/// server id is the server's configured id; the switch confirms it in
/// REGISTER_ACK or answers ERROR (e.g. [`ErrorCode::IdConflict`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Register<'a> {
    /// Management address (kernel-owned): control channel, store, API.
    pub mgmt_addr: Ipv4Addr,
    /// Data address (owned by the user-space stack).
    pub data_addr: Ipv4Addr,
    /// Ethernet address of the data interface, for the switch's rewrites.
    pub data_mac: [u8; 6],
    /// Relative weight for new-connection assignment (Maglev / LWRR).
    pub weight: u16,
    /// Services (VIP:port) this server serves.
    pub services: ServiceList<'a>,
}

/// REGISTER_ACK: the switch accepted a registration (switch -> server).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegisterAck {
    /// The switch's epoch, echoed by its LOAD-NOTIFICATIONs.
    pub switch_epoch: u32,
    /// Interval of LOAD-NOTIFICATIONs.
    pub load_interval_us: u32,
    /// How often the server must send HEARTBEAT.
    pub heartbeat_interval_ms: u32,
    /// After this long without a heartbeat the switch declares the server
    /// dead and removes its entries.
    pub dead_after_ms: u32,
}

/// HEARTBEAT: liveness and a counters summary (server -> switch).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Heartbeat {
    /// Established connections the server owns.
    pub connections: u32,
    /// Migrations in progress (as origin or target).
    pub migrations_in_flight: u32,
    /// Packets per second the server's stack received.
    pub load_pps: u64,
    /// Bytes waiting in receive queues (reactive policy's signal).
    pub rx_backlog_bytes: u64,
    /// [`HEARTBEAT_DRAINING`], other bits reserved (sent 0, ignored).
    pub flags: u32,
}

/// DRAIN: migrate every connection away (switch -> server).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Drain {
    /// Time budget in milliseconds from receipt. Relative, because the
    /// switch's and the server's clocks are not synchronised.
    pub deadline_ms: u32,
    /// [`DRAIN_CANCEL`], other bits reserved.
    pub flags: u32,
}

/// MIGRATE: migrate one connection (switch/api -> server).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Migrate {
    pub flow: FlowKey,
    /// Data address of the desired target; `None` lets the switch choose.
    pub target: Option<Ipv4Addr>,
}

/// SET_OWNER: route a flow to `owner` (server -> switch). Used by an
/// origin that aborts a migration after PREPARE_ACK redirected the flow: it
/// still holds the connection and takes the flow back. The switch control
/// plane accepts it only from the flow's current origin or target.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SetOwner {
    pub flow: FlowKey,
    /// Data address of the server that owns the connection.
    pub owner: Ipv4Addr,
}

/// Error codes of ERROR messages. Unknown codes are kept, never an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorCode {
    /// 1: the sender is not registered (re-register).
    NotRegistered,
    /// 2: the request was malformed or inconsistent.
    BadRequest,
    /// 3: MIGRATE named a flow the server does not own.
    UnknownFlow,
    /// 4: the receiver cannot act now (migration cap reached, ...).
    Busy,
    /// 5: REGISTER with an id held by another live server.
    IdConflict,
    /// 6: internal failure.
    Internal,
    Unknown(u16),
}

impl ErrorCode {
    pub const fn to_u16(self) -> u16 {
        match self {
            ErrorCode::NotRegistered => 1,
            ErrorCode::BadRequest => 2,
            ErrorCode::UnknownFlow => 3,
            ErrorCode::Busy => 4,
            ErrorCode::IdConflict => 5,
            ErrorCode::Internal => 6,
            ErrorCode::Unknown(v) => v,
        }
    }
    pub const fn from_u16(v: u16) -> Self {
        match v {
            1 => ErrorCode::NotRegistered,
            2 => ErrorCode::BadRequest,
            3 => ErrorCode::UnknownFlow,
            4 => ErrorCode::Busy,
            5 => ErrorCode::IdConflict,
            6 => ErrorCode::Internal,
            v => ErrorCode::Unknown(v),
        }
    }
}

/// ERROR: a request failed (either direction).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ErrorMsg<'a> {
    pub code: ErrorCode,
    /// Kind byte of the failed request (kept raw: it may be a kind this
    /// node does not know).
    pub ref_kind: u8,
    /// `seq` of the failed request.
    pub ref_seq: u64,
    /// Human-readable detail, UTF-8, at most [`MAX_ERROR_TEXT`] bytes.
    pub text: &'a str,
}

/// The body of a control message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ControlBody<'a> {
    Register(Register<'a>),
    RegisterAck(RegisterAck),
    Heartbeat(Heartbeat),
    Drain(Drain),
    Migrate(Migrate),
    Error(ErrorMsg<'a>),
    SetOwner(SetOwner),
}

impl ControlBody<'_> {
    pub fn kind(&self) -> ControlKind {
        match self {
            ControlBody::Register(_) => ControlKind::Register,
            ControlBody::RegisterAck(_) => ControlKind::RegisterAck,
            ControlBody::Heartbeat(_) => ControlKind::Heartbeat,
            ControlBody::Drain(_) => ControlKind::Drain,
            ControlBody::Migrate(_) => ControlKind::Migrate,
            ControlBody::Error(_) => ControlKind::Error,
            ControlBody::SetOwner(_) => ControlKind::SetOwner,
        }
    }

    fn len(&self) -> usize {
        match self {
            ControlBody::Register(r) => {
                field::register::SERVICES + r.services.len() * field::register::SERVICE_LEN
            }
            ControlBody::RegisterAck(_) => field::register_ack::LEN,
            ControlBody::Heartbeat(_) => field::heartbeat::LEN,
            ControlBody::Drain(_) => field::drain::LEN,
            ControlBody::Migrate(_) => field::migrate::LEN,
            ControlBody::Error(e) => field::error::TEXT + e.text.len(),
            ControlBody::SetOwner(_) => field::set_owner::LEN,
        }
    }
}

/// A parsed control message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ControlRepr<'a> {
    /// The server the message is from (server -> switch) or for.
    pub server_id: ServerId,
    /// Sender's sequence number: strictly increasing per sender, so
    /// receivers drop replays and correlate replies (ERROR.ref_seq).
    pub seq: u64,
    pub body: ControlBody<'a>,
}

impl<'a> ControlRepr<'a> {
    /// Validates and parses raw bytes (MAC not checked).
    pub fn parse(bytes: &'a [u8]) -> Result<Self, ControlError> {
        let p = ControlPacket::new_checked(bytes)?;
        let kind = p.kind().ok_or(ControlError::UnknownKind {
            found: bytes[field::KIND],
        })?;
        let end = field::BODY + usize::from(p.body_len());
        let body = &bytes[field::BODY..end];
        let exact = |expected: usize| {
            if body.len() == expected {
                Ok(())
            } else {
                Err(ControlError::BadBodyLength {
                    kind,
                    len: body.len(),
                    expected,
                })
            }
        };
        let parsed = match kind {
            ControlKind::Register => {
                use field::register as f;
                if body.len() < f::SERVICES {
                    return Err(ControlError::BadBodyLength {
                        kind,
                        len: body.len(),
                        expected: f::SERVICES,
                    });
                }
                let count = usize::from(rd16(body, f::SERVICE_COUNT));
                if count > MAX_SERVICES {
                    return Err(ControlError::TooManyServices { count });
                }
                exact(f::SERVICES + count * f::SERVICE_LEN)?;
                ControlBody::Register(Register {
                    mgmt_addr: Ipv4Addr::from(rd32(body, f::MGMT_ADDR)),
                    data_addr: Ipv4Addr::from(rd32(body, f::DATA_ADDR)),
                    data_mac: rd(body, f::DATA_MAC),
                    weight: rd16(body, f::WEIGHT),
                    services: ServiceList::Wire(&body[f::SERVICES..]),
                })
            }
            ControlKind::RegisterAck => {
                use field::register_ack as f;
                exact(f::LEN)?;
                ControlBody::RegisterAck(RegisterAck {
                    switch_epoch: rd32(body, f::SWITCH_EPOCH),
                    load_interval_us: rd32(body, f::LOAD_INTERVAL_US),
                    heartbeat_interval_ms: rd32(body, f::HEARTBEAT_INTERVAL_MS),
                    dead_after_ms: rd32(body, f::DEAD_AFTER_MS),
                })
            }
            ControlKind::Heartbeat => {
                use field::heartbeat as f;
                exact(f::LEN)?;
                ControlBody::Heartbeat(Heartbeat {
                    connections: rd32(body, f::CONNECTIONS),
                    migrations_in_flight: rd32(body, f::MIGRATIONS_IN_FLIGHT),
                    load_pps: rd64(body, f::LOAD_PPS),
                    rx_backlog_bytes: rd64(body, f::RX_BACKLOG_BYTES),
                    flags: rd32(body, f::FLAGS),
                })
            }
            ControlKind::Drain => {
                use field::drain as f;
                exact(f::LEN)?;
                ControlBody::Drain(Drain {
                    deadline_ms: rd32(body, f::DEADLINE_MS),
                    flags: rd32(body, f::FLAGS),
                })
            }
            ControlKind::Migrate => {
                use field::migrate as f;
                exact(f::LEN)?;
                let target = Ipv4Addr::from(rd32(body, f::TARGET));
                ControlBody::Migrate(Migrate {
                    flow: FlowKey {
                        client_ip: Ipv4Addr::from(rd32(body, f::CLIENT_IP)),
                        client_port: rd16(body, f::CLIENT_PORT),
                        service_ip: Ipv4Addr::from(rd32(body, f::SERVICE_IP)),
                        service_port: rd16(body, f::SERVICE_PORT),
                    },
                    target: (!target.is_unspecified()).then_some(target),
                })
            }
            ControlKind::SetOwner => {
                use field::set_owner as f;
                exact(f::LEN)?;
                ControlBody::SetOwner(SetOwner {
                    flow: FlowKey {
                        client_ip: Ipv4Addr::from(rd32(body, f::CLIENT_IP)),
                        client_port: rd16(body, f::CLIENT_PORT),
                        service_ip: Ipv4Addr::from(rd32(body, f::SERVICE_IP)),
                        service_port: rd16(body, f::SERVICE_PORT),
                    },
                    owner: Ipv4Addr::from(rd32(body, f::OWNER)),
                })
            }
            ControlKind::Error => {
                use field::error as f;
                if body.len() < f::TEXT {
                    return Err(ControlError::BadBodyLength {
                        kind,
                        len: body.len(),
                        expected: f::TEXT,
                    });
                }
                let text = &body[f::TEXT..];
                if text.len() > MAX_ERROR_TEXT {
                    return Err(ControlError::ErrorTextTooLong { len: text.len() });
                }
                let text =
                    std::str::from_utf8(text).map_err(|e| ControlError::ErrorTextNotUtf8 {
                        valid_up_to: e.valid_up_to(),
                    })?;
                ControlBody::Error(ErrorMsg {
                    code: ErrorCode::from_u16(rd16(body, f::CODE)),
                    ref_kind: body[f::REF_KIND],
                    ref_seq: rd64(body, f::REF_SEQ),
                    text,
                })
            }
        };
        Ok(ControlRepr {
            server_id: p.server_id(),
            seq: p.seq(),
            body: parsed,
        })
    }

    /// Validates, checks the MAC, then parses. What receivers should call.
    pub fn parse_verified(bytes: &'a [u8], key: &MigrationKey) -> Result<Self, ControlError> {
        ControlPacket::new_checked(bytes)?.verify_mac(key)?;
        Self::parse(bytes)
    }

    pub fn buffer_len(&self) -> usize {
        HEADER_LEN + self.body.len() + MAC_LEN
    }

    /// Writes the message with a zero MAC; returns the bytes written.
    pub fn emit(&self, buf: &mut [u8]) -> Result<usize, ControlError> {
        match &self.body {
            ControlBody::Register(r) if r.services.len() > MAX_SERVICES => {
                return Err(ControlError::TooManyServices {
                    count: r.services.len(),
                });
            }
            ControlBody::Error(e) if e.text.len() > MAX_ERROR_TEXT => {
                return Err(ControlError::ErrorTextTooLong { len: e.text.len() });
            }
            _ => {}
        }
        let n = self.buffer_len();
        if buf.len() < n {
            return Err(ControlError::BufferTooSmall {
                len: buf.len(),
                needed: n,
            });
        }
        let b = &mut buf[..n];
        b.fill(0);
        b[field::MAGIC].copy_from_slice(&MAGIC.to_be_bytes());
        b[field::VERSION] = VERSION;
        b[field::KIND] = self.body.kind().to_u8();
        b[field::SERVER_ID].copy_from_slice(&self.server_id.0.to_be_bytes());
        b[field::SEQ].copy_from_slice(&self.seq.to_be_bytes());
        // Bounded by MAX_SERVICES / MAX_ERROR_TEXT above: fits in u16.
        b[field::BODY_LEN].copy_from_slice(&(self.body.len() as u16).to_be_bytes());
        let body = &mut b[field::BODY..n - MAC_LEN];
        match &self.body {
            ControlBody::Register(r) => {
                use field::register as f;
                body[f::MGMT_ADDR].copy_from_slice(&r.mgmt_addr.octets());
                body[f::DATA_ADDR].copy_from_slice(&r.data_addr.octets());
                body[f::DATA_MAC].copy_from_slice(&r.data_mac);
                body[f::WEIGHT].copy_from_slice(&r.weight.to_be_bytes());
                body[f::SERVICE_COUNT].copy_from_slice(&(r.services.len() as u16).to_be_bytes());
                for (chunk, s) in body[f::SERVICES..]
                    .chunks_exact_mut(f::SERVICE_LEN)
                    .zip(r.services.iter())
                {
                    chunk[f::SERVICE_IP].copy_from_slice(&s.ip().octets());
                    chunk[f::SERVICE_PORT].copy_from_slice(&s.port().to_be_bytes());
                }
            }
            ControlBody::RegisterAck(a) => {
                use field::register_ack as f;
                body[f::SWITCH_EPOCH].copy_from_slice(&a.switch_epoch.to_be_bytes());
                body[f::LOAD_INTERVAL_US].copy_from_slice(&a.load_interval_us.to_be_bytes());
                body[f::HEARTBEAT_INTERVAL_MS]
                    .copy_from_slice(&a.heartbeat_interval_ms.to_be_bytes());
                body[f::DEAD_AFTER_MS].copy_from_slice(&a.dead_after_ms.to_be_bytes());
            }
            ControlBody::Heartbeat(h) => {
                use field::heartbeat as f;
                body[f::CONNECTIONS].copy_from_slice(&h.connections.to_be_bytes());
                body[f::MIGRATIONS_IN_FLIGHT]
                    .copy_from_slice(&h.migrations_in_flight.to_be_bytes());
                body[f::LOAD_PPS].copy_from_slice(&h.load_pps.to_be_bytes());
                body[f::RX_BACKLOG_BYTES].copy_from_slice(&h.rx_backlog_bytes.to_be_bytes());
                body[f::FLAGS].copy_from_slice(&h.flags.to_be_bytes());
            }
            ControlBody::Drain(d) => {
                use field::drain as f;
                body[f::DEADLINE_MS].copy_from_slice(&d.deadline_ms.to_be_bytes());
                body[f::FLAGS].copy_from_slice(&d.flags.to_be_bytes());
            }
            ControlBody::Migrate(m) => {
                use field::migrate as f;
                body[f::CLIENT_IP].copy_from_slice(&m.flow.client_ip.octets());
                body[f::CLIENT_PORT].copy_from_slice(&m.flow.client_port.to_be_bytes());
                body[f::SERVICE_PORT].copy_from_slice(&m.flow.service_port.to_be_bytes());
                body[f::SERVICE_IP].copy_from_slice(&m.flow.service_ip.octets());
                let target = m.target.unwrap_or(Ipv4Addr::UNSPECIFIED);
                body[f::TARGET].copy_from_slice(&target.octets());
            }
            ControlBody::SetOwner(o) => {
                use field::set_owner as f;
                body[f::CLIENT_IP].copy_from_slice(&o.flow.client_ip.octets());
                body[f::CLIENT_PORT].copy_from_slice(&o.flow.client_port.to_be_bytes());
                body[f::SERVICE_PORT].copy_from_slice(&o.flow.service_port.to_be_bytes());
                body[f::SERVICE_IP].copy_from_slice(&o.flow.service_ip.octets());
                body[f::OWNER].copy_from_slice(&o.owner.octets());
            }
            ControlBody::Error(e) => {
                use field::error as f;
                body[f::CODE].copy_from_slice(&e.code.to_u16().to_be_bytes());
                body[f::REF_KIND] = e.ref_kind;
                body[f::REF_SEQ].copy_from_slice(&e.ref_seq.to_be_bytes());
                body[f::TEXT..].copy_from_slice(e.text.as_bytes());
            }
        }
        Ok(n)
    }

    /// Writes the message and its MAC; returns the bytes written.
    pub fn emit_with_mac(&self, buf: &mut [u8], key: &MigrationKey) -> Result<usize, ControlError> {
        let n = self.emit(buf)?;
        let tag = key.compute(&[&buf[..n - MAC_LEN]]);
        buf[n - MAC_LEN..n].copy_from_slice(&tag);
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> MigrationKey {
        MigrationKey::from_bytes(b"0123456789abcdef").unwrap()
    }

    fn round_trip(repr: ControlRepr<'_>) {
        let mut buf = [0u8; 2048];
        let n = repr.emit_with_mac(&mut buf, &key()).unwrap();
        assert_eq!(n, repr.buffer_len());
        let parsed = ControlRepr::parse_verified(&buf[..n], &key()).unwrap();
        assert_eq!(parsed, repr);
        buf[n - 1] ^= 0x80;
        assert_eq!(
            ControlRepr::parse_verified(&buf[..n], &key()),
            Err(ControlError::BadMac)
        );
    }

    #[test]
    fn every_kind_round_trips() {
        let services = [
            SocketAddrV4::new(Ipv4Addr::new(198, 18, 100, 1), 80),
            SocketAddrV4::new(Ipv4Addr::new(198, 18, 100, 2), 6379),
        ];
        let flow = FlowKey {
            client_ip: Ipv4Addr::new(198, 18, 0, 10),
            client_port: 5555,
            service_ip: Ipv4Addr::new(198, 18, 100, 1),
            service_port: 80,
        };
        let bodies = [
            ControlBody::Register(Register {
                mgmt_addr: Ipv4Addr::new(198, 18, 1, 10),
                data_addr: Ipv4Addr::new(198, 18, 2, 10),
                data_mac: [2, 0, 0, 0, 0, 1],
                weight: 100,
                services: ServiceList::Slice(&services),
            }),
            ControlBody::RegisterAck(RegisterAck {
                switch_epoch: 9,
                load_interval_us: 1000,
                heartbeat_interval_ms: 100,
                dead_after_ms: 1000,
            }),
            ControlBody::Heartbeat(Heartbeat {
                connections: 12,
                migrations_in_flight: 1,
                load_pps: 1 << 40,
                rx_backlog_bytes: 77,
                flags: HEARTBEAT_DRAINING,
            }),
            ControlBody::Drain(Drain {
                deadline_ms: 30_000,
                flags: 0,
            }),
            ControlBody::Migrate(Migrate { flow, target: None }),
            ControlBody::Migrate(Migrate {
                flow,
                target: Some(Ipv4Addr::new(198, 18, 2, 11)),
            }),
            ControlBody::Error(ErrorMsg {
                code: ErrorCode::UnknownFlow,
                ref_kind: 5,
                ref_seq: 41,
                text: "no such flow: 198.18.0.10:5555",
            }),
            ControlBody::SetOwner(SetOwner {
                flow,
                owner: Ipv4Addr::new(198, 18, 2, 10),
            }),
        ];
        for body in bodies {
            round_trip(ControlRepr {
                server_id: ServerId(3),
                seq: 42,
                body,
            });
        }
    }

    #[test]
    fn body_errors_are_typed() {
        let repr = ControlRepr {
            server_id: ServerId(1),
            seq: 1,
            body: ControlBody::Drain(Drain {
                deadline_ms: 1,
                flags: 0,
            }),
        };
        let mut buf = [0u8; 64];
        let n = repr.emit(&mut buf).unwrap();
        // Claim a one-byte-longer body and supply it.
        let mut longer = [0u8; 64];
        longer[..n - MAC_LEN].copy_from_slice(&buf[..n - MAC_LEN]);
        longer[17] += 1;
        assert_eq!(
            ControlRepr::parse(&longer[..n + 1]),
            Err(ControlError::BadBodyLength {
                kind: ControlKind::Drain,
                len: 9,
                expected: 8
            })
        );
        let mut bad_kind = buf;
        bad_kind[3] = 0;
        assert_eq!(
            ControlRepr::parse(&bad_kind[..n]),
            Err(ControlError::UnknownKind { found: 0 })
        );
    }

    #[test]
    fn error_text_must_be_utf8() {
        let repr = ControlRepr {
            server_id: ServerId(1),
            seq: 1,
            body: ControlBody::Error(ErrorMsg {
                code: ErrorCode::Unknown(99),
                ref_kind: 200,
                ref_seq: 0,
                text: "ab",
            }),
        };
        let mut buf = [0u8; 64];
        let n = repr.emit(&mut buf).unwrap();
        assert_eq!(ControlRepr::parse(&buf[..n]).unwrap(), repr);
        buf[HEADER_LEN + field::error::TEXT + 1] = 0xff;
        assert_eq!(
            ControlRepr::parse(&buf[..n]),
            Err(ControlError::ErrorTextNotUtf8 { valid_up_to: 1 })
        );
    }
}
