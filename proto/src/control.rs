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
//!   (service count vs length, UTF-8 of error text, report count vs length
//!   and each report's outcome and trigger codes, a NOT_STARTED report's
//!   start-failure code) and borrows variable
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
/// REGISTER flag: an 8-byte instance id follows the service list.
pub const REGISTER_INSTANCE: u16 = 1;
/// REGISTER flag: the server reads the 24-byte REGISTER_ACK, which carries
/// [`RegisterAck::last_migration_id`]; without it the switch answers the
/// 16-byte one (a server that predates the field refuses any other length).
pub const REGISTER_LAST_ID: u16 = 1 << 1;
/// Most reports one MIGRATION_REPORT may carry (20 + 4 + 16 * 72 + 16 =
/// 1,192 bytes of UDP payload: one Ethernet frame).
pub const MAX_REPORTS: usize = 16;
/// Most owned connections one FLOWS batch carries (20 + 12 + 56 * 24 + 16
/// = 1,392 bytes of UDP payload: one Ethernet frame).
pub const MAX_FLOW_CLAIMS: usize = 56;
/// FLOWS flag: the last batch of the report.
pub const FLOWS_LAST: u16 = 1 << 0;
/// FLOWS_ACK flag: not an acknowledgement but a request: the switch asks
/// the server for a full FLOWS report (`report_id` and `batch` are 0).
pub const FLOWS_REQUEST: u16 = 1 << 0;
/// FLOWS_ACK flag: the batch was refused (its sender is not registered, or
/// the switch could not apply it); nothing of it was applied.
pub const FLOWS_REFUSED: u16 = 1 << 1;
/// A phase duration that was not reached (wire value of
/// [`MigrationReport::phases_us`] entries).
pub const PHASE_NOT_REACHED: u32 = u32::MAX;
/// Phases of [`MigrationReport::phases_us`], in wire order (the API's
/// `MIGRATION_PHASES`).
pub const REPORT_PHASES: [&str; 5] = ["prepare", "export", "transfer", "import", "total"];

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
        /// [`crate::control::REGISTER_INSTANCE`],
        /// [`crate::control::REGISTER_LAST_ID`]; other bits reserved (sent
        /// 0, ignored). Was `reserved` (always 0) before instance ids.
        pub const FLAGS: Field = 18..20;
        pub const SERVICES: usize = 20;
        /// One service entry: VIP, port, reserved.
        pub const SERVICE_LEN: usize = 8;
        pub const SERVICE_IP: Field = 0..4;
        pub const SERVICE_PORT: Field = 4..6;
        /// After the services when the flag is set: the server process's
        /// instance id (u64, not 0).
        pub const INSTANCE_LEN: usize = 8;
    }

    /// REGISTER_ACK body (switch -> server).
    pub mod register_ack {
        use super::Field;
        pub const SWITCH_EPOCH: Field = 0..4;
        pub const LOAD_INTERVAL_US: Field = 4..8;
        pub const HEARTBEAT_INTERVAL_MS: Field = 8..12;
        pub const DEAD_AFTER_MS: Field = 12..16;
        /// The body of a switch that predates `last_migration_id`, and the
        /// one sent to a server whose REGISTER lacks
        /// [`crate::control::REGISTER_LAST_ID`].
        pub const LEN: usize = 16;
        /// Only in the long form: the last migration id the switch saw from
        /// the server's data address (0: none known).
        pub const LAST_MIGRATION_ID: Field = 16..24;
        pub const LEN_LAST_ID: usize = 24;
    }

    /// HEARTBEAT body (server -> switch).
    pub mod heartbeat {
        use super::Field;
        pub const CONNECTIONS: Field = 0..4;
        pub const MIGRATIONS_IN_FLIGHT: Field = 4..8;
        pub const LOAD_PPS: Field = 8..16;
        pub const RX_BACKLOG_BYTES: Field = 16..24;
        pub const FLAGS: Field = 24..28;
        /// Generation of the POLICY the server applies (0: none yet).
        /// Reserved (sent 0) before POLICY existed, so old servers report 0.
        pub const POLICY_GENERATION: Field = 28..32;
        pub const LEN: usize = 32;
    }

    /// POLICY body (switch -> server): the hostagent-side tunables.
    pub mod policy {
        use super::Field;
        pub const GENERATION: Field = 0..4;
        pub const FLAGS: Field = 4..8;
        /// Percent times 100 (basis points).
        pub const PROACTIVE_THRESHOLD_BP: Field = 8..12;
        pub const HYSTERESIS_BP: Field = 12..16;
        pub const REACTIVE_BACKLOG_PACKETS: Field = 16..20;
        pub const COOLDOWN_MS: Field = 20..24;
        pub const MAX_MIGRATIONS_PER_SEC: Field = 24..28;
        /// The origin's migration deadline, ms (0: keep the server's own).
        /// Reserved (sent 0) before it existed, so an older switch's POLICY
        /// leaves the server's deadline alone, and an older server ignores it.
        pub const MIGRATION_DEADLINE_MS: Field = 28..32;
        pub const LEN: usize = 32;
    }

    /// DRAIN body (switch -> server).
    pub mod drain {
        use super::Field;
        pub const DEADLINE_MS: Field = 0..4;
        pub const FLAGS: Field = 4..8;
        pub const LEN: usize = 8;
    }

    /// The flow key as the messages naming a connection carry it (offsets
    /// relative to where each message puts it; every message's own
    /// CLIENT_IP..SERVICE_IP below follow it, checked at compile time).
    pub mod flow_key {
        use super::Field;
        pub const CLIENT_IP: Field = 0..4;
        pub const CLIENT_PORT: Field = 4..6;
        pub const SERVICE_PORT: Field = 6..8;
        pub const SERVICE_IP: Field = 8..12;
        pub const LEN: usize = 12;
    }

    /// Whether a message's flow-key fields follow [`flow_key`]'s layout.
    const fn is_flow_key(ip: Field, cport: Field, sport: Field, sip: Field) -> bool {
        let at = ip.start;
        ip.end == at + flow_key::CLIENT_IP.end
            && cport.start == at + flow_key::CLIENT_PORT.start
            && cport.end == at + flow_key::CLIENT_PORT.end
            && sport.start == at + flow_key::SERVICE_PORT.start
            && sport.end == at + flow_key::SERVICE_PORT.end
            && sip.start == at + flow_key::SERVICE_IP.start
            && sip.end == at + flow_key::SERVICE_IP.end
    }
    const _: () = assert!(is_flow_key(
        migrate::CLIENT_IP,
        migrate::CLIENT_PORT,
        migrate::SERVICE_PORT,
        migrate::SERVICE_IP
    ));
    const _: () = assert!(is_flow_key(
        set_owner::CLIENT_IP,
        set_owner::CLIENT_PORT,
        set_owner::SERVICE_PORT,
        set_owner::SERVICE_IP
    ));
    const _: () = assert!(is_flow_key(
        migration_report::CLIENT_IP,
        migration_report::CLIENT_PORT,
        migration_report::SERVICE_PORT,
        migration_report::SERVICE_IP
    ));
    const _: () = assert!(is_flow_key(
        flows::CLIENT_IP,
        flows::CLIENT_PORT,
        flows::SERVICE_PORT,
        flows::SERVICE_IP
    ));

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

    /// MIGRATION_REPORT body (server -> switch): a count, then `count`
    /// fixed-size reports (offsets below are relative to one report).
    pub mod migration_report {
        use super::Field;
        pub const COUNT: Field = 0..2;
        pub const RESERVED: Field = 2..4;
        pub const REPORTS: usize = 4;
        pub const REPORT_LEN: usize = 72;
        pub const MIGRATION_ID: Field = 0..8;
        pub const CLIENT_IP: Field = 8..12;
        pub const CLIENT_PORT: Field = 12..14;
        pub const SERVICE_PORT: Field = 14..16;
        pub const SERVICE_IP: Field = 16..20;
        /// Target (origin reports) or origin (target reports) data address; 0: unknown.
        pub const PEER: Field = 20..24;
        pub const OUTCOME: usize = 24;
        pub const TRIGGER: usize = 25;
        pub const RESERVED_1: Field = 26..28;
        /// TCPMig reason code (0: none); for NOT_STARTED a
        /// [`super::super::StartFailure`] code.
        pub const REASON: Field = 28..30;
        pub const FRAGMENTS: Field = 30..32;
        /// Microseconds from the end of the migration to the emission of
        /// this message (the receiver dates the report with its own clock).
        pub const AGE_US: Field = 32..36;
        /// Five u32 durations in microseconds, [`super::super::REPORT_PHASES`] order.
        pub const PHASES_US: Field = 36..56;
        pub const SNAPSHOT_BYTES: Field = 56..60;
        pub const SEGMENTS_BUFFERED: Field = 60..64;
        pub const BYTES_BUFFERED: Field = 64..72;
    }

    /// FLOWS body (server -> switch): one batch of the connections the
    /// server owns; a header, then `count` fixed-size claims (offsets below
    /// the header's are relative to one claim).
    pub mod flows {
        use super::Field;
        pub const REPORT_ID: Field = 0..4;
        pub const BATCH: Field = 4..6;
        /// [`crate::control::FLOWS_LAST`]; other bits reserved (sent 0).
        pub const FLAGS: Field = 6..8;
        pub const COUNT: Field = 8..10;
        pub const RESERVED: Field = 10..12;
        pub const CLAIMS: usize = 12;
        pub const CLAIM_LEN: usize = 24;
        pub const CLIENT_IP: Field = 0..4;
        pub const CLIENT_PORT: Field = 4..6;
        pub const SERVICE_PORT: Field = 6..8;
        pub const SERVICE_IP: Field = 8..12;
        /// Ownership epoch: the id of the migration that brought the
        /// connection to the server (0: placed there).
        pub const EPOCH: Field = 12..20;
        /// Milliseconds since the server took the connection (accepted or
        /// imported), saturating.
        pub const OWNED_MS: Field = 20..24;
    }

    /// FLOWS_ACK body (switch -> server): acknowledges one FLOWS batch, or
    /// (flag REQUEST) asks for a report.
    pub mod flows_ack {
        use super::Field;
        pub const REPORT_ID: Field = 0..4;
        pub const BATCH: Field = 4..6;
        pub const FLAGS: Field = 6..8;
        pub const APPLIED: Field = 8..10;
        pub const SKIPPED: Field = 10..12;
        pub const LEN: usize = 12;
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
/// HEARTBEAT flag: the server health-checks the applications behind its
/// services, and bits [`HEARTBEAT_DOWN_SHIFT`].. carry the result. Without
/// it (servers that predate health checks, or checks switched off) every
/// service counts as up and the down bits are ignored.
pub const HEARTBEAT_HEALTH: u32 = 1 << 1;
/// HEARTBEAT flag: this process is stopping: it migrates its connections
/// away and will exit, so the switch takes it out of placement and of the
/// migration targets (its flows keep flowing). Not the operator's drain.
/// Sent in every heartbeat from the stop on. A switch that predates it
/// ignores it (and sees the server die after `dead_after`).
pub const HEARTBEAT_LEAVING: u32 = 1 << 2;
/// HEARTBEAT flag (with [`HEARTBEAT_LEAVING`]): the last heartbeats of a
/// process that exits now and serves nothing after them: the switch
/// declares it dead at once. Sent a few times (datagrams get lost).
pub const HEARTBEAT_STOPPED: u32 = 1 << 3;
// The stop bits sit below the health DOWN bits.
const _: () = assert!(HEARTBEAT_STOPPED < 1 << HEARTBEAT_DOWN_SHIFT);
/// HEARTBEAT: bit `HEARTBEAT_DOWN_SHIFT + i` set: the backend of service
/// `i` of the server's REGISTER list is down (with [`HEARTBEAT_HEALTH`]).
pub const HEARTBEAT_DOWN_SHIFT: u32 = 8;
/// Services whose health a HEARTBEAT carries: the first 24 of the
/// REGISTER list (a later one always counts as up at the switch).
pub const HEALTH_MAX_SERVICES: usize = (32 - HEARTBEAT_DOWN_SHIFT) as usize;
/// DRAIN flag: cancel a drain in progress (undrain).
pub const DRAIN_CANCEL: u32 = 1 << 0;
/// POLICY flag: the proactive policy is on.
pub const POLICY_PROACTIVE: u32 = 1 << 0;
/// POLICY flag: the reactive policy is on.
pub const POLICY_REACTIVE: u32 = 1 << 1;
/// POLICY flag: a target drops the client packets of a connection that
/// arrive before its import instead of buffering them (the store's
/// `buffer_mode = drop`). Clear: buffer. A server that predates the flag
/// ignores it (it reads only the bits it knows).
pub const POLICY_BUFFER_DROP: u32 = 1 << 2;

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
    Policy,
    MigrationReport,
    Flows,
    FlowsAck,
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
            ControlKind::Policy => 8,
            ControlKind::MigrationReport => 9,
            ControlKind::Flows => 10,
            ControlKind::FlowsAck => 11,
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
            8 => ControlKind::Policy,
            9 => ControlKind::MigrationReport,
            10 => ControlKind::Flows,
            11 => ControlKind::FlowsAck,
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
            ControlKind::Policy => "POLICY",
            ControlKind::MigrationReport => "MIGRATION_REPORT",
            ControlKind::Flows => "FLOWS",
            ControlKind::FlowsAck => "FLOWS_ACK",
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
    #[error("REGISTER flags an instance id of 0 (0 means none: leave the flag clear)")]
    ZeroInstance,
    #[error("ERROR text is {len} bytes, at most {MAX_ERROR_TEXT}")]
    ErrorTextTooLong { len: usize },
    #[error("ERROR text is not UTF-8 (valid up to byte {valid_up_to})")]
    ErrorTextNotUtf8 { valid_up_to: usize },
    #[error("MIGRATION_REPORT carries {count} reports, at most {MAX_REPORTS}")]
    TooManyReports { count: usize },
    #[error("MIGRATION_REPORT report {index}: unknown {field} code {code}")]
    BadReport {
        index: usize,
        field: &'static str,
        code: u16,
    },
    #[error("FLOWS carries {count} claims, at most {MAX_FLOW_CLAIMS}")]
    TooManyFlowClaims { count: usize },
    #[error("FLOWS claim {index}: {what}")]
    BadFlowClaim { index: usize, what: &'static str },
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

/// The 12-byte flow key every message naming a connection carries (MIGRATE,
/// SET_OWNER, each MIGRATION_REPORT report, each FLOWS claim), at offset
/// `at` of `b`: client address, client port, service port, service
/// address, big-endian (the layout of [`field::flow_key`]).
fn read_flow_key(b: &[u8], at: usize) -> FlowKey {
    use field::flow_key as k;
    let b = &b[at..at + k::LEN];
    FlowKey {
        client_ip: Ipv4Addr::from(rd32(b, k::CLIENT_IP)),
        client_port: rd16(b, k::CLIENT_PORT),
        service_ip: Ipv4Addr::from(rd32(b, k::SERVICE_IP)),
        service_port: rd16(b, k::SERVICE_PORT),
    }
}

/// Writes `key` at offset `at` of `b` ([`read_flow_key`]'s layout).
fn write_flow_key(b: &mut [u8], at: usize, key: &FlowKey) {
    use field::flow_key as k;
    let b = &mut b[at..at + k::LEN];
    b[k::CLIENT_IP].copy_from_slice(&key.client_ip.octets());
    b[k::CLIENT_PORT].copy_from_slice(&key.client_port.to_be_bytes());
    b[k::SERVICE_PORT].copy_from_slice(&key.service_port.to_be_bytes());
    b[k::SERVICE_IP].copy_from_slice(&key.service_ip.octets());
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
    /// Identifies the server process: drawn at random when it starts, the
    /// same in every REGISTER it sends. A REGISTER with another instance
    /// than the switch knows is a restarted server, whose connections are
    /// gone (the switch drops their entries at once); the same instance is
    /// a server that stalled and came back. 0: none sent (servers that
    /// predate it; the switch then cannot tell a restart from a stall).
    pub instance: u64,
    /// The server reads the long REGISTER_ACK ([`REGISTER_LAST_ID`]).
    pub reads_last_id: bool,
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
    /// The last migration id (`origin data addr << 32 | counter`, serial
    /// order on the counter) the switch saw in a PREPARE from the server's
    /// data address; `Some(0)`: it knows none (it started since). `None`:
    /// the 16-byte body (a switch that predates the field, or a REGISTER
    /// without [`REGISTER_LAST_ID`]). A restarted hostagent numbers its
    /// migrations above it: the switch and the targets still remember the
    /// previous process's ids (docs/MIGRATION.md).
    pub last_migration_id: Option<u64>,
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
    /// [`HEARTBEAT_DRAINING`], [`HEARTBEAT_HEALTH`], [`HEARTBEAT_LEAVING`],
    /// [`HEARTBEAT_STOPPED`] and the per-service down bits
    /// ([`Heartbeat::backend_down`]); other bits reserved (sent 0, ignored).
    pub flags: u32,
    /// Generation of the POLICY the server applies (0: none yet); the
    /// switch re-sends POLICY while it differs from the current one.
    pub policy_generation: u32,
}

impl Heartbeat {
    /// Flags reporting health: [`HEARTBEAT_HEALTH`] and a down bit for each
    /// index of `down` below [`HEALTH_MAX_SERVICES`] (others are left out:
    /// they cannot be carried).
    pub fn health_flags(down: impl IntoIterator<Item = usize>) -> u32 {
        down.into_iter()
            .filter(|&i| i < HEALTH_MAX_SERVICES)
            .fold(HEARTBEAT_HEALTH, |f, i| {
                f | 1 << (HEARTBEAT_DOWN_SHIFT + i as u32)
            })
    }

    /// Whether the heartbeat reports health at all ([`HEARTBEAT_HEALTH`]).
    pub fn reports_health(&self) -> bool {
        self.flags & HEARTBEAT_HEALTH != 0
    }

    /// Whether service `index` of the REGISTER list has its backend down:
    /// false without [`HEARTBEAT_HEALTH`] and beyond [`HEALTH_MAX_SERVICES`].
    pub fn backend_down(&self, index: usize) -> bool {
        self.reports_health()
            && index < HEALTH_MAX_SERVICES
            && self.flags & 1 << (HEARTBEAT_DOWN_SHIFT + index as u32) != 0
    }
}

/// POLICY: the migration-policy tunables a server applies (switch ->
/// server), from the store's `Policy`. Sent when the policy changes and
/// whenever a heartbeat reports another generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PolicyMsg {
    /// Identifies the values (a hash of them, never 0), so that a standby
    /// that takes over agrees with the servers on what they apply.
    pub generation: u32,
    /// [`POLICY_PROACTIVE`], [`POLICY_REACTIVE`], [`POLICY_BUFFER_DROP`];
    /// other bits reserved (sent 0, ignored).
    pub flags: u32,
    /// Proactive threshold above the pool average, basis points (1000 = 10 %).
    pub proactive_threshold_bp: u32,
    /// Hysteresis, basis points below the threshold.
    pub hysteresis_bp: u32,
    /// Reactive threshold: total receive-queue backlog, packets.
    pub reactive_backlog_packets: u32,
    /// Per-connection cooldown after a move, milliseconds.
    pub cooldown_ms: u32,
    /// Cap on migrations a server starts per second.
    pub max_migrations_per_sec: u32,
    /// The origin's migration deadline (empty snapshot), milliseconds;
    /// 0: the server keeps its own (what an older switch sends).
    pub migration_deadline_ms: u32,
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

/// How a migration a server reports ended, as that server saw it. Origin
/// reports carry MigratedOut, Resumed, Lost and NotStarted; target reports
/// MigratedIn, AbortedIn and ImportFailed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReportOutcome {
    /// 1 (origin): the target imported the connection.
    MigratedOut,
    /// 2 (origin): the migration did not happen; the origin kept serving.
    Resumed,
    /// 3 (origin): state sent, outcome never learnt; the connection was closed.
    Lost,
    /// 4 (target): imported and serving.
    MigratedIn,
    /// 5 (target): aborted before the import.
    AbortedIn,
    /// 6 (target): the snapshot could not be imported.
    ImportFailed,
    /// 7 (origin): a MIGRATE the server could not start (no TCPMig message
    /// was sent); `reason` is a [`StartFailure`] code, `migration_id` the
    /// server's data address `<< 32` (counter 0: no migration id was used).
    NotStarted,
}

impl ReportOutcome {
    pub const fn to_u8(self) -> u8 {
        match self {
            ReportOutcome::MigratedOut => 1,
            ReportOutcome::Resumed => 2,
            ReportOutcome::Lost => 3,
            ReportOutcome::MigratedIn => 4,
            ReportOutcome::AbortedIn => 5,
            ReportOutcome::ImportFailed => 6,
            ReportOutcome::NotStarted => 7,
        }
    }
    pub const fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            1 => ReportOutcome::MigratedOut,
            2 => ReportOutcome::Resumed,
            3 => ReportOutcome::Lost,
            4 => ReportOutcome::MigratedIn,
            5 => ReportOutcome::AbortedIn,
            6 => ReportOutcome::ImportFailed,
            7 => ReportOutcome::NotStarted,
            _ => return None,
        })
    }
    /// Whether the reporting server was the origin.
    pub const fn is_origin(self) -> bool {
        matches!(
            self,
            ReportOutcome::MigratedOut
                | ReportOutcome::Resumed
                | ReportOutcome::Lost
                | ReportOutcome::NotStarted
        )
    }
    pub const fn name(self) -> &'static str {
        match self {
            ReportOutcome::MigratedOut => "migrated_out",
            ReportOutcome::Resumed => "resumed",
            ReportOutcome::Lost => "lost",
            ReportOutcome::MigratedIn => "migrated_in",
            ReportOutcome::AbortedIn => "aborted_in",
            ReportOutcome::ImportFailed => "import_failed",
            ReportOutcome::NotStarted => "not_started",
        }
    }
}

/// Why a server did not start a migration it was asked for (the `reason`
/// of a [`ReportOutcome::NotStarted`] report). The codes start at 0x0101 so
/// that they never read as a TCPMig reason; the parser accepts only these.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StartFailure {
    /// 0x0101: the server serves no connection with this 4-tuple (closed,
    /// never there, or already leaving in another migration).
    NoConnection,
    /// 0x0102: a migration of this connection is already under way there,
    /// or the server's migration table is full.
    Busy,
    /// 0x0103: the requested target is the server itself.
    TargetIsSelf,
    /// 0x0104: the application's connection manager refused to move it.
    Refused,
    /// 0x0105: the server runs without migration.
    Disabled,
}

impl StartFailure {
    pub const ALL: [StartFailure; 5] = [
        StartFailure::NoConnection,
        StartFailure::Busy,
        StartFailure::TargetIsSelf,
        StartFailure::Refused,
        StartFailure::Disabled,
    ];
    pub const fn to_u16(self) -> u16 {
        match self {
            StartFailure::NoConnection => 0x0101,
            StartFailure::Busy => 0x0102,
            StartFailure::TargetIsSelf => 0x0103,
            StartFailure::Refused => 0x0104,
            StartFailure::Disabled => 0x0105,
        }
    }
    pub const fn from_u16(v: u16) -> Option<Self> {
        Some(match v {
            0x0101 => StartFailure::NoConnection,
            0x0102 => StartFailure::Busy,
            0x0103 => StartFailure::TargetIsSelf,
            0x0104 => StartFailure::Refused,
            0x0105 => StartFailure::Disabled,
            _ => return None,
        })
    }
    /// What operators read (switchd's `/migrations` `reason`).
    pub const fn text(self) -> &'static str {
        match self {
            StartFailure::NoConnection => "no such connection is served there",
            StartFailure::Busy => {
                "busy: a migration of it is under way, or the migration table is full"
            }
            StartFailure::TargetIsSelf => "the target is the server itself",
            StartFailure::Refused => "its connection manager refused",
            StartFailure::Disabled => "the server runs without migration",
        }
    }
}

/// What started a migration (known to the origin only; target reports say
/// [`MigrationTrigger::Unknown`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MigrationTrigger {
    /// 0: not known to the reporter.
    Unknown,
    /// 1: a MIGRATE from the switch (an operator's request).
    Manual,
    /// 2: a DRAIN.
    Drain,
    /// 3: the proactive policy (load above the pool average).
    Proactive,
    /// 4: the reactive policy (receive-queue backlog).
    Reactive,
    /// 5: the hostagent's churn option (benchmarks and tests).
    Churn,
}

impl MigrationTrigger {
    pub const fn to_u8(self) -> u8 {
        match self {
            MigrationTrigger::Unknown => 0,
            MigrationTrigger::Manual => 1,
            MigrationTrigger::Drain => 2,
            MigrationTrigger::Proactive => 3,
            MigrationTrigger::Reactive => 4,
            MigrationTrigger::Churn => 5,
        }
    }
    pub const fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            0 => MigrationTrigger::Unknown,
            1 => MigrationTrigger::Manual,
            2 => MigrationTrigger::Drain,
            3 => MigrationTrigger::Proactive,
            4 => MigrationTrigger::Reactive,
            5 => MigrationTrigger::Churn,
            _ => return None,
        })
    }
    pub const fn name(self) -> &'static str {
        match self {
            MigrationTrigger::Unknown => "unknown",
            MigrationTrigger::Manual => "manual",
            MigrationTrigger::Drain => "drain",
            MigrationTrigger::Proactive => "proactive",
            MigrationTrigger::Reactive => "reactive",
            MigrationTrigger::Churn => "churn",
        }
    }
}

/// One finished migration as one server saw it (a MIGRATION_REPORT entry).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MigrationReport {
    /// The TCPMig migration id (origin data address, per-origin counter).
    pub id: u64,
    pub flow: FlowKey,
    /// The other party's data address (target for an origin report, origin
    /// for a target report), when known.
    pub peer: Option<Ipv4Addr>,
    pub outcome: ReportOutcome,
    pub trigger: MigrationTrigger,
    /// Why it did not succeed ([`crate::tcpmig::Reason::None`] if it did);
    /// for [`ReportOutcome::NotStarted`] it holds a [`StartFailure`] code
    /// (read it with [`MigrationReport::start_failure`]).
    pub reason: crate::tcpmig::Reason,
    /// CONN_STATE fragments per copy of the snapshot.
    pub fragments: u16,
    /// Microseconds between the end of the migration and the message.
    pub age_us: u32,
    /// Phase durations in microseconds ([`REPORT_PHASES`] order);
    /// [`PHASE_NOT_REACHED`] for a phase this server did not see.
    pub phases_us: [u32; 5],
    pub snapshot_bytes: u32,
    pub segments_buffered: u32,
    pub bytes_buffered: u64,
}

impl MigrationReport {
    /// The report of a MIGRATE that `origin` (the reporter's data address)
    /// could not start.
    pub fn not_started(
        origin: Ipv4Addr,
        flow: FlowKey,
        target: Option<Ipv4Addr>,
        trigger: MigrationTrigger,
        why: StartFailure,
    ) -> Self {
        MigrationReport {
            id: u64::from(u32::from(origin)) << 32,
            flow,
            peer: target,
            outcome: ReportOutcome::NotStarted,
            trigger,
            reason: crate::tcpmig::Reason::from_u16(why.to_u16()),
            fragments: 0,
            age_us: 0,
            phases_us: [PHASE_NOT_REACHED; 5],
            snapshot_bytes: 0,
            segments_buffered: 0,
            bytes_buffered: 0,
        }
    }

    /// Why a [`ReportOutcome::NotStarted`] migration did not start.
    pub fn start_failure(&self) -> Option<StartFailure> {
        match self.outcome {
            ReportOutcome::NotStarted => StartFailure::from_u16(self.reason.to_u16()),
            _ => None,
        }
    }

    /// The reason as operators read it: the TCPMig reason, or for a
    /// migration that did not start, why; `None` when there is none.
    pub fn reason_text(&self) -> Option<String> {
        if let Some(f) = self.start_failure() {
            return Some(f.text().to_string());
        }
        (self.reason != crate::tcpmig::Reason::None).then(|| self.reason.to_string())
    }

    /// Phase `i` ([`REPORT_PHASES`] order), `None` when not reached.
    pub fn phase_us(&self, i: usize) -> Option<u32> {
        self.phases_us
            .get(i)
            .copied()
            .filter(|v| *v != PHASE_NOT_REACHED)
    }

    fn read(c: &[u8]) -> Result<Self, (&'static str, u16)> {
        use field::migration_report as f;
        let outcome =
            ReportOutcome::from_u8(c[f::OUTCOME]).ok_or(("outcome", u16::from(c[f::OUTCOME])))?;
        let trigger = MigrationTrigger::from_u8(c[f::TRIGGER])
            .ok_or(("trigger", u16::from(c[f::TRIGGER])))?;
        let reason = rd16(c, f::REASON);
        if outcome == ReportOutcome::NotStarted && StartFailure::from_u16(reason).is_none() {
            return Err(("start failure", reason));
        }
        let peer = Ipv4Addr::from(rd32(c, f::PEER));
        let mut phases_us = [0u32; 5];
        for (p, b) in phases_us.iter_mut().zip(c[f::PHASES_US].chunks_exact(4)) {
            *p = rd32(b, 0..4);
        }
        Ok(MigrationReport {
            id: rd64(c, f::MIGRATION_ID),
            flow: read_flow_key(c, f::CLIENT_IP.start),
            peer: (!peer.is_unspecified()).then_some(peer),
            outcome,
            trigger,
            reason: crate::tcpmig::Reason::from_u16(reason),
            fragments: rd16(c, f::FRAGMENTS),
            age_us: rd32(c, f::AGE_US),
            phases_us,
            snapshot_bytes: rd32(c, f::SNAPSHOT_BYTES),
            segments_buffered: rd32(c, f::SEGMENTS_BUFFERED),
            bytes_buffered: rd64(c, f::BYTES_BUFFERED),
        })
    }

    fn write(&self, c: &mut [u8]) {
        use field::migration_report as f;
        c[f::MIGRATION_ID].copy_from_slice(&self.id.to_be_bytes());
        write_flow_key(c, f::CLIENT_IP.start, &self.flow);
        let peer = self.peer.unwrap_or(Ipv4Addr::UNSPECIFIED);
        c[f::PEER].copy_from_slice(&peer.octets());
        c[f::OUTCOME] = self.outcome.to_u8();
        c[f::TRIGGER] = self.trigger.to_u8();
        c[f::REASON].copy_from_slice(&self.reason.to_u16().to_be_bytes());
        c[f::FRAGMENTS].copy_from_slice(&self.fragments.to_be_bytes());
        c[f::AGE_US].copy_from_slice(&self.age_us.to_be_bytes());
        for (b, p) in c[f::PHASES_US].chunks_exact_mut(4).zip(self.phases_us) {
            b.copy_from_slice(&p.to_be_bytes());
        }
        c[f::SNAPSHOT_BYTES].copy_from_slice(&self.snapshot_bytes.to_be_bytes());
        c[f::SEGMENTS_BUFFERED].copy_from_slice(&self.segments_buffered.to_be_bytes());
        c[f::BYTES_BUFFERED].copy_from_slice(&self.bytes_buffered.to_be_bytes());
    }
}

/// A fixed-size record of a message body that carries a list of them
/// (MIGRATION_REPORT's reports, FLOWS' claims).
pub trait WireRecord: Copy + 'static {
    /// Bytes of one record.
    const LEN: usize;
    /// Most records one message may carry.
    const MAX: usize;
    /// Record `index` of a list, in `c` (`LEN` bytes), or why it is
    /// invalid.
    fn read_at(c: &[u8], index: usize) -> Result<Self, ControlError>;
    /// The error for a message that announces `count` > `MAX` records.
    fn too_many(count: usize) -> ControlError;
}

/// The records of a list body of `kind`: a `header` of `header` bytes
/// whose `count` field announces the records that follow, each checked.
fn record_list<R: WireRecord>(
    kind: ControlKind,
    body: &[u8],
    header: usize,
    count: field::Field,
) -> Result<&[u8], ControlError> {
    let bad_len = |expected| ControlError::BadBodyLength {
        kind,
        len: body.len(),
        expected,
    };
    if body.len() < header {
        return Err(bad_len(header));
    }
    let count = usize::from(rd16(body, count));
    if count > R::MAX {
        return Err(R::too_many(count));
    }
    let expected = header + count * R::LEN;
    if body.len() != expected {
        return Err(bad_len(expected));
    }
    let records = &body[header..];
    for (index, c) in records.chunks_exact(R::LEN).enumerate() {
        R::read_at(c, index)?;
    }
    Ok(records)
}

/// The records of a list body: the validated wire bytes of a parsed
/// message or a slice to emit; both iterate the same way and compare equal
/// by content.
#[derive(Clone, Copy)]
pub enum RecordList<'a, R: WireRecord> {
    /// `n * R::LEN` bytes, every record checked by [`ControlRepr::parse`].
    Wire(&'a [u8]),
    /// Records to emit.
    Slice(&'a [R]),
}

/// The reports of a MIGRATION_REPORT.
pub type ReportList<'a> = RecordList<'a, MigrationReport>;
/// The claims of a FLOWS batch.
pub type ClaimList<'a> = RecordList<'a, FlowClaim>;

impl<'a, R: WireRecord> RecordList<'a, R> {
    pub fn len(&self) -> usize {
        match self {
            RecordList::Wire(b) => b.len() / R::LEN,
            RecordList::Slice(s) => s.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    pub fn iter(&self) -> impl Iterator<Item = R> + 'a {
        let (wire, slice): (&'a [u8], &'a [R]) = match *self {
            RecordList::Wire(b) => (b, &[]),
            RecordList::Slice(s) => (&[], s),
        };
        // Wire records were validated by `parse`: `read_at` cannot fail
        // here (a failure would only skip the record, never panic).
        wire.chunks_exact(R::LEN)
            .filter_map(|c| R::read_at(c, 0).ok())
            .chain(slice.iter().copied())
    }
}

impl<R: WireRecord + PartialEq> PartialEq for RecordList<'_, R> {
    fn eq(&self, other: &Self) -> bool {
        self.len() == other.len() && self.iter().eq(other.iter())
    }
}
impl<R: WireRecord + Eq> Eq for RecordList<'_, R> {}

impl<R: WireRecord + std::fmt::Debug> std::fmt::Debug for RecordList<'_, R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

impl WireRecord for MigrationReport {
    const LEN: usize = field::migration_report::REPORT_LEN;
    const MAX: usize = MAX_REPORTS;
    fn read_at(c: &[u8], index: usize) -> Result<Self, ControlError> {
        MigrationReport::read(c).map_err(|(field, code)| ControlError::BadReport {
            index,
            field,
            code,
        })
    }
    fn too_many(count: usize) -> ControlError {
        ControlError::TooManyReports { count }
    }
}

/// One connection a server owns, as a FLOWS batch claims it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FlowClaim {
    pub flow: FlowKey,
    /// Ownership epoch: the id of the TCPMig migration that brought the
    /// connection to the claimant (0: it was placed there). Its high 32
    /// bits are that migration's origin's data address.
    pub epoch: u64,
    /// Milliseconds since the claimant took the connection (accepted or
    /// imported), saturating at `u32::MAX`. The switch dates the claim with
    /// its own clock (clocks differ): the later owner of two claims is the
    /// one that took the connection more recently.
    pub owned_ms: u32,
}

impl FlowClaim {
    /// The data address of the origin of the migration that brought the
    /// connection to the claimant (`None` when it was placed there).
    pub fn epoch_origin(&self) -> Option<Ipv4Addr> {
        (self.epoch != 0).then(|| Ipv4Addr::from((self.epoch >> 32) as u32))
    }

    fn read(c: &[u8]) -> Result<Self, &'static str> {
        use field::flows as f;
        let claim = FlowClaim {
            flow: read_flow_key(c, f::CLIENT_IP.start),
            epoch: rd64(c, f::EPOCH),
            owned_ms: rd32(c, f::OWNED_MS),
        };
        if claim.flow.client_port == 0 || claim.flow.service_port == 0 {
            return Err("port 0");
        }
        if claim.flow.client_ip.is_unspecified() || claim.flow.service_ip.is_unspecified() {
            return Err("address 0.0.0.0");
        }
        Ok(claim)
    }

    fn write(&self, c: &mut [u8]) {
        use field::flows as f;
        write_flow_key(c, f::CLIENT_IP.start, &self.flow);
        c[f::EPOCH].copy_from_slice(&self.epoch.to_be_bytes());
        c[f::OWNED_MS].copy_from_slice(&self.owned_ms.to_be_bytes());
    }
}

impl WireRecord for FlowClaim {
    const LEN: usize = field::flows::CLAIM_LEN;
    const MAX: usize = MAX_FLOW_CLAIMS;
    fn read_at(c: &[u8], index: usize) -> Result<Self, ControlError> {
        FlowClaim::read(c).map_err(|what| ControlError::BadFlowClaim { index, what })
    }
    fn too_many(count: usize) -> ControlError {
        ControlError::TooManyFlowClaims { count }
    }
}

/// FLOWS: one batch of a report of the connections a server owns (server
/// -> switch), sent after every REGISTER_ACK and on the switch's request,
/// so that a switch that lost (or went back on) its flow mappings learns
/// them from the servers that hold the connections. The switch acknowledges
/// every batch (FLOWS_ACK); the server retransmits unacknowledged ones.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Flows<'a> {
    /// Identifies one report of the server (a new report restarts the
    /// batches).
    pub report_id: u32,
    /// This batch's index in the report, from 0.
    pub batch: u16,
    /// [`FLOWS_LAST`]; other bits reserved (sent 0, kept).
    pub flags: u16,
    /// At most [`MAX_FLOW_CLAIMS`].
    pub claims: ClaimList<'a>,
}

/// FLOWS_ACK: the switch took (or refused, [`FLOWS_REFUSED`]) one FLOWS
/// batch; or, with [`FLOWS_REQUEST`], asks the server for a report.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FlowsAck {
    pub report_id: u32,
    pub batch: u16,
    /// [`FLOWS_REQUEST`], [`FLOWS_REFUSED`]; other bits reserved.
    pub flags: u16,
    /// Claims of the batch that changed a mapping.
    pub applied: u16,
    /// Claims of the batch not applied (another claim is later, a migration
    /// of the flow is in progress, unknown service).
    pub skipped: u16,
}

impl FlowsAck {
    /// The switch's request for a report.
    pub const fn request() -> Self {
        FlowsAck {
            report_id: 0,
            batch: 0,
            flags: FLOWS_REQUEST,
            applied: 0,
            skipped: 0,
        }
    }
    pub const fn is_request(&self) -> bool {
        self.flags & FLOWS_REQUEST != 0
    }
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
    Policy(PolicyMsg),
    /// Finished migrations (server -> switch), at most [`MAX_REPORTS`].
    MigrationReport(ReportList<'a>),
    /// Owned connections (server -> switch), at most [`MAX_FLOW_CLAIMS`].
    Flows(Flows<'a>),
    FlowsAck(FlowsAck),
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
            ControlBody::Policy(_) => ControlKind::Policy,
            ControlBody::MigrationReport(_) => ControlKind::MigrationReport,
            ControlBody::Flows(_) => ControlKind::Flows,
            ControlBody::FlowsAck(_) => ControlKind::FlowsAck,
        }
    }

    fn len(&self) -> usize {
        match self {
            ControlBody::Register(r) => {
                field::register::SERVICES
                    + r.services.len() * field::register::SERVICE_LEN
                    + if r.instance != 0 {
                        field::register::INSTANCE_LEN
                    } else {
                        0
                    }
            }
            ControlBody::RegisterAck(a) => match a.last_migration_id {
                Some(_) => field::register_ack::LEN_LAST_ID,
                None => field::register_ack::LEN,
            },
            ControlBody::Heartbeat(_) => field::heartbeat::LEN,
            ControlBody::Drain(_) => field::drain::LEN,
            ControlBody::Migrate(_) => field::migrate::LEN,
            ControlBody::Error(e) => field::error::TEXT + e.text.len(),
            ControlBody::SetOwner(_) => field::set_owner::LEN,
            ControlBody::Policy(_) => field::policy::LEN,
            ControlBody::MigrationReport(r) => {
                field::migration_report::REPORTS + r.len() * field::migration_report::REPORT_LEN
            }
            ControlBody::Flows(f) => {
                field::flows::CLAIMS + f.claims.len() * field::flows::CLAIM_LEN
            }
            ControlBody::FlowsAck(_) => field::flows_ack::LEN,
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
                let end = f::SERVICES + count * f::SERVICE_LEN;
                let has_instance = rd16(body, f::FLAGS) & REGISTER_INSTANCE != 0;
                let instance = if has_instance {
                    exact(end + f::INSTANCE_LEN)?;
                    let id = rd64(body, end..end + f::INSTANCE_LEN);
                    if id == 0 {
                        return Err(ControlError::ZeroInstance);
                    }
                    id
                } else {
                    exact(end)?;
                    0
                };
                ControlBody::Register(Register {
                    mgmt_addr: Ipv4Addr::from(rd32(body, f::MGMT_ADDR)),
                    data_addr: Ipv4Addr::from(rd32(body, f::DATA_ADDR)),
                    data_mac: rd(body, f::DATA_MAC),
                    weight: rd16(body, f::WEIGHT),
                    services: ServiceList::Wire(&body[f::SERVICES..end]),
                    instance,
                    reads_last_id: rd16(body, f::FLAGS) & REGISTER_LAST_ID != 0,
                })
            }
            ControlKind::RegisterAck => {
                use field::register_ack as f;
                // Either form: the hostagent cannot know the switch's age.
                let last_migration_id = if body.len() == f::LEN_LAST_ID {
                    Some(rd64(body, f::LAST_MIGRATION_ID))
                } else {
                    exact(f::LEN)?;
                    None
                };
                ControlBody::RegisterAck(RegisterAck {
                    switch_epoch: rd32(body, f::SWITCH_EPOCH),
                    load_interval_us: rd32(body, f::LOAD_INTERVAL_US),
                    heartbeat_interval_ms: rd32(body, f::HEARTBEAT_INTERVAL_MS),
                    dead_after_ms: rd32(body, f::DEAD_AFTER_MS),
                    last_migration_id,
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
                    policy_generation: rd32(body, f::POLICY_GENERATION),
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
                    flow: read_flow_key(body, f::CLIENT_IP.start),
                    target: (!target.is_unspecified()).then_some(target),
                })
            }
            ControlKind::Policy => {
                use field::policy as f;
                exact(f::LEN)?;
                ControlBody::Policy(PolicyMsg {
                    generation: rd32(body, f::GENERATION),
                    flags: rd32(body, f::FLAGS),
                    proactive_threshold_bp: rd32(body, f::PROACTIVE_THRESHOLD_BP),
                    hysteresis_bp: rd32(body, f::HYSTERESIS_BP),
                    reactive_backlog_packets: rd32(body, f::REACTIVE_BACKLOG_PACKETS),
                    cooldown_ms: rd32(body, f::COOLDOWN_MS),
                    max_migrations_per_sec: rd32(body, f::MAX_MIGRATIONS_PER_SEC),
                    migration_deadline_ms: rd32(body, f::MIGRATION_DEADLINE_MS),
                })
            }
            ControlKind::SetOwner => {
                use field::set_owner as f;
                exact(f::LEN)?;
                ControlBody::SetOwner(SetOwner {
                    flow: read_flow_key(body, f::CLIENT_IP.start),
                    owner: Ipv4Addr::from(rd32(body, f::OWNER)),
                })
            }
            ControlKind::MigrationReport => {
                use field::migration_report as f;
                let reports = record_list::<MigrationReport>(kind, body, f::REPORTS, f::COUNT)?;
                ControlBody::MigrationReport(ReportList::Wire(reports))
            }
            ControlKind::Flows => {
                use field::flows as f;
                let claims = record_list::<FlowClaim>(kind, body, f::CLAIMS, f::COUNT)?;
                ControlBody::Flows(Flows {
                    report_id: rd32(body, f::REPORT_ID),
                    batch: rd16(body, f::BATCH),
                    flags: rd16(body, f::FLAGS),
                    claims: ClaimList::Wire(claims),
                })
            }
            ControlKind::FlowsAck => {
                use field::flows_ack as f;
                exact(f::LEN)?;
                ControlBody::FlowsAck(FlowsAck {
                    report_id: rd32(body, f::REPORT_ID),
                    batch: rd16(body, f::BATCH),
                    flags: rd16(body, f::FLAGS),
                    applied: rd16(body, f::APPLIED),
                    skipped: rd16(body, f::SKIPPED),
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
            ControlBody::MigrationReport(r) if r.len() > MAX_REPORTS => {
                return Err(ControlError::TooManyReports { count: r.len() });
            }
            ControlBody::Flows(f) if f.claims.len() > MAX_FLOW_CLAIMS => {
                return Err(ControlError::TooManyFlowClaims {
                    count: f.claims.len(),
                });
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
        // Bounded by MAX_SERVICES / MAX_ERROR_TEXT / MAX_REPORTS /
        // MAX_FLOW_CLAIMS above: fits in u16.
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
                let end = f::SERVICES + r.services.len() * f::SERVICE_LEN;
                for (chunk, s) in body[f::SERVICES..end]
                    .chunks_exact_mut(f::SERVICE_LEN)
                    .zip(r.services.iter())
                {
                    chunk[f::SERVICE_IP].copy_from_slice(&s.ip().octets());
                    chunk[f::SERVICE_PORT].copy_from_slice(&s.port().to_be_bytes());
                }
                let mut flags = 0;
                if r.instance != 0 {
                    flags |= REGISTER_INSTANCE;
                    body[end..end + f::INSTANCE_LEN].copy_from_slice(&r.instance.to_be_bytes());
                }
                if r.reads_last_id {
                    flags |= REGISTER_LAST_ID;
                }
                body[f::FLAGS].copy_from_slice(&flags.to_be_bytes());
            }
            ControlBody::RegisterAck(a) => {
                use field::register_ack as f;
                body[f::SWITCH_EPOCH].copy_from_slice(&a.switch_epoch.to_be_bytes());
                body[f::LOAD_INTERVAL_US].copy_from_slice(&a.load_interval_us.to_be_bytes());
                body[f::HEARTBEAT_INTERVAL_MS]
                    .copy_from_slice(&a.heartbeat_interval_ms.to_be_bytes());
                body[f::DEAD_AFTER_MS].copy_from_slice(&a.dead_after_ms.to_be_bytes());
                if let Some(id) = a.last_migration_id {
                    body[f::LAST_MIGRATION_ID].copy_from_slice(&id.to_be_bytes());
                }
            }
            ControlBody::Heartbeat(h) => {
                use field::heartbeat as f;
                body[f::CONNECTIONS].copy_from_slice(&h.connections.to_be_bytes());
                body[f::MIGRATIONS_IN_FLIGHT]
                    .copy_from_slice(&h.migrations_in_flight.to_be_bytes());
                body[f::LOAD_PPS].copy_from_slice(&h.load_pps.to_be_bytes());
                body[f::RX_BACKLOG_BYTES].copy_from_slice(&h.rx_backlog_bytes.to_be_bytes());
                body[f::FLAGS].copy_from_slice(&h.flags.to_be_bytes());
                body[f::POLICY_GENERATION].copy_from_slice(&h.policy_generation.to_be_bytes());
            }
            ControlBody::Policy(p) => {
                use field::policy as f;
                body[f::GENERATION].copy_from_slice(&p.generation.to_be_bytes());
                body[f::FLAGS].copy_from_slice(&p.flags.to_be_bytes());
                body[f::PROACTIVE_THRESHOLD_BP]
                    .copy_from_slice(&p.proactive_threshold_bp.to_be_bytes());
                body[f::HYSTERESIS_BP].copy_from_slice(&p.hysteresis_bp.to_be_bytes());
                body[f::REACTIVE_BACKLOG_PACKETS]
                    .copy_from_slice(&p.reactive_backlog_packets.to_be_bytes());
                body[f::COOLDOWN_MS].copy_from_slice(&p.cooldown_ms.to_be_bytes());
                body[f::MAX_MIGRATIONS_PER_SEC]
                    .copy_from_slice(&p.max_migrations_per_sec.to_be_bytes());
                body[f::MIGRATION_DEADLINE_MS]
                    .copy_from_slice(&p.migration_deadline_ms.to_be_bytes());
            }
            ControlBody::Drain(d) => {
                use field::drain as f;
                body[f::DEADLINE_MS].copy_from_slice(&d.deadline_ms.to_be_bytes());
                body[f::FLAGS].copy_from_slice(&d.flags.to_be_bytes());
            }
            ControlBody::Migrate(m) => {
                use field::migrate as f;
                write_flow_key(body, f::CLIENT_IP.start, &m.flow);
                let target = m.target.unwrap_or(Ipv4Addr::UNSPECIFIED);
                body[f::TARGET].copy_from_slice(&target.octets());
            }
            ControlBody::SetOwner(o) => {
                use field::set_owner as f;
                write_flow_key(body, f::CLIENT_IP.start, &o.flow);
                body[f::OWNER].copy_from_slice(&o.owner.octets());
            }
            ControlBody::MigrationReport(r) => {
                use field::migration_report as f;
                body[f::COUNT].copy_from_slice(&(r.len() as u16).to_be_bytes());
                for (chunk, rep) in body[f::REPORTS..]
                    .chunks_exact_mut(f::REPORT_LEN)
                    .zip(r.iter())
                {
                    rep.write(chunk);
                }
            }
            ControlBody::Flows(fl) => {
                use field::flows as f;
                body[f::REPORT_ID].copy_from_slice(&fl.report_id.to_be_bytes());
                body[f::BATCH].copy_from_slice(&fl.batch.to_be_bytes());
                body[f::FLAGS].copy_from_slice(&fl.flags.to_be_bytes());
                body[f::COUNT].copy_from_slice(&(fl.claims.len() as u16).to_be_bytes());
                for (chunk, c) in body[f::CLAIMS..]
                    .chunks_exact_mut(f::CLAIM_LEN)
                    .zip(fl.claims.iter())
                {
                    c.write(chunk);
                }
            }
            ControlBody::FlowsAck(a) => {
                use field::flows_ack as f;
                body[f::REPORT_ID].copy_from_slice(&a.report_id.to_be_bytes());
                body[f::BATCH].copy_from_slice(&a.batch.to_be_bytes());
                body[f::FLAGS].copy_from_slice(&a.flags.to_be_bytes());
                body[f::APPLIED].copy_from_slice(&a.applied.to_be_bytes());
                body[f::SKIPPED].copy_from_slice(&a.skipped.to_be_bytes());
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
    fn heartbeat_health_bits() {
        let hb = |flags| Heartbeat {
            connections: 0,
            migrations_in_flight: 0,
            load_pps: 0,
            rx_backlog_bytes: 0,
            flags,
            policy_generation: 0,
        };
        // An older server: no HEALTH flag, so nothing is down whatever
        // the (reserved, 0) bits say.
        let old = hb(HEARTBEAT_DRAINING | 1 << 9);
        assert!(!old.reports_health());
        assert!((0..64).all(|i| !old.backend_down(i)));
        let f = Heartbeat::health_flags([0, 3, 23, 24, 127]) | HEARTBEAT_DRAINING;
        assert_eq!(
            f,
            HEARTBEAT_DRAINING | HEARTBEAT_HEALTH | 1 << 8 | 1 << 11 | 1 << 31
        );
        let h = hb(f);
        let down: Vec<usize> = (0..200).filter(|&i| h.backend_down(i)).collect();
        assert_eq!(down, [0, 3, 23]);
        assert_eq!(Heartbeat::health_flags([]), HEARTBEAT_HEALTH);
        // LEAVING and STOPPED sit below the down bits and beside the
        // others: reading health is not disturbed by them.
        let stop = HEARTBEAT_LEAVING | HEARTBEAT_STOPPED | Heartbeat::health_flags([0]);
        assert_eq!(stop, 1 << 2 | 1 << 3 | HEARTBEAT_HEALTH | 1 << 8);
        let s = hb(stop);
        assert!(s.reports_health() && s.backend_down(0) && !s.backend_down(1));
        assert_eq!(
            [
                HEARTBEAT_DRAINING,
                HEARTBEAT_HEALTH,
                HEARTBEAT_LEAVING,
                HEARTBEAT_STOPPED
            ]
            .iter()
            .fold(0, |a, b| a | b)
            .count_ones(),
            4
        );
        // The bits survive the wire.
        let msg = ControlRepr {
            server_id: ServerId(4),
            seq: 9,
            body: ControlBody::Heartbeat(h),
        };
        let mut buf = [0u8; 128];
        let n = msg.emit_with_mac(&mut buf, &key()).unwrap();
        let back = ControlRepr::parse_verified(&buf[..n], &key()).unwrap();
        assert_eq!(back, msg);
        match back.body {
            ControlBody::Heartbeat(b) => assert!(b.backend_down(23) && !b.backend_down(1)),
            _ => panic!("not a heartbeat"),
        }
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
        let reports = [sample_report(flow), {
            let mut r = sample_report(flow);
            r.outcome = ReportOutcome::Resumed;
            r.trigger = MigrationTrigger::Reactive;
            r.reason = crate::tcpmig::Reason::Timeout;
            r.peer = None;
            r.phases_us[3] = PHASE_NOT_REACHED;
            r
        }];
        let claims = [FlowClaim {
            flow,
            epoch: 0xc612_020b_0000_0007,
            owned_ms: 1234,
        }];
        let bodies = [
            ControlBody::MigrationReport(ReportList::Slice(&reports)),
            ControlBody::MigrationReport(ReportList::Slice(&[])),
            ControlBody::Register(Register {
                mgmt_addr: Ipv4Addr::new(198, 18, 1, 10),
                data_addr: Ipv4Addr::new(198, 18, 2, 10),
                data_mac: [2, 0, 0, 0, 0, 1],
                weight: 100,
                services: ServiceList::Slice(&services),
                instance: 0x0123_4567_89ab_cdef,
                reads_last_id: true,
            }),
            ControlBody::Register(Register {
                mgmt_addr: Ipv4Addr::new(198, 18, 1, 10),
                data_addr: Ipv4Addr::new(198, 18, 2, 10),
                data_mac: [2, 0, 0, 0, 0, 1],
                weight: 100,
                services: ServiceList::Slice(&services),
                instance: 0,
                reads_last_id: false,
            }),
            ControlBody::RegisterAck(RegisterAck {
                switch_epoch: 9,
                load_interval_us: 1000,
                heartbeat_interval_ms: 100,
                dead_after_ms: 1000,
                last_migration_id: None,
            }),
            ControlBody::RegisterAck(RegisterAck {
                switch_epoch: 9,
                load_interval_us: 1000,
                heartbeat_interval_ms: 100,
                dead_after_ms: 1000,
                last_migration_id: Some(0xc612_020b_ffff_fff0),
            }),
            ControlBody::RegisterAck(RegisterAck {
                switch_epoch: 9,
                load_interval_us: 1000,
                heartbeat_interval_ms: 100,
                dead_after_ms: 1000,
                last_migration_id: Some(0),
            }),
            ControlBody::Heartbeat(Heartbeat {
                connections: 12,
                migrations_in_flight: 1,
                load_pps: 1 << 40,
                rx_backlog_bytes: 77,
                flags: HEARTBEAT_DRAINING | HEARTBEAT_LEAVING | HEARTBEAT_STOPPED,
                policy_generation: 0xdead_beef,
            }),
            ControlBody::Policy(PolicyMsg {
                generation: 7,
                flags: POLICY_PROACTIVE | POLICY_REACTIVE | POLICY_BUFFER_DROP,
                proactive_threshold_bp: 1000,
                hysteresis_bp: 200,
                reactive_backlog_packets: 20,
                cooldown_ms: 1000,
                max_migrations_per_sec: 1000,
                migration_deadline_ms: 50,
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
            ControlBody::Flows(Flows {
                report_id: 7,
                batch: 2,
                flags: FLOWS_LAST,
                claims: ClaimList::Slice(&claims),
            }),
            ControlBody::FlowsAck(FlowsAck {
                report_id: 7,
                batch: 2,
                flags: 0,
                applied: 1,
                skipped: 0,
            }),
            ControlBody::FlowsAck(FlowsAck::request()),
        ];
        for body in bodies {
            round_trip(ControlRepr {
                server_id: ServerId(3),
                seq: 42,
                body,
            });
        }
    }

    fn claims(n: usize) -> Vec<FlowClaim> {
        (0..n)
            .map(|i| FlowClaim {
                flow: FlowKey {
                    client_ip: Ipv4Addr::new(198, 18, 0, 11),
                    client_port: 40_000 + i as u16,
                    service_ip: Ipv4Addr::new(198, 18, 100, 1),
                    service_port: 7,
                },
                epoch: if i % 2 == 0 {
                    0
                } else {
                    0xc612_020c_0000_0000 | i as u64
                },
                owned_ms: i as u32 * 10,
            })
            .collect()
    }

    fn flows_msg(c: &[FlowClaim]) -> Vec<u8> {
        let repr = ControlRepr {
            server_id: ServerId(2),
            seq: 9,
            body: ControlBody::Flows(Flows {
                report_id: 1,
                batch: 0,
                flags: FLOWS_LAST,
                claims: ClaimList::Slice(c),
            }),
        };
        let mut buf = vec![0u8; repr.buffer_len()];
        repr.emit_with_mac(&mut buf, &key()).unwrap();
        buf
    }

    #[test]
    fn a_full_flows_batch_fits_one_frame_and_round_trips() {
        let c = claims(MAX_FLOW_CLAIMS);
        let buf = flows_msg(&c);
        assert_eq!(buf.len(), 20 + 12 + MAX_FLOW_CLAIMS * 24 + 16);
        assert!(buf.len() <= 1472, "one 1500-byte frame: {}", buf.len());
        let p = ControlRepr::parse_verified(&buf, &key()).unwrap();
        let ControlBody::Flows(f) = p.body else {
            panic!("{p:?}")
        };
        assert_eq!(f.claims.iter().collect::<Vec<_>>(), c);
        assert_eq!(f.flags, FLOWS_LAST);
        assert_eq!(c[1].epoch_origin(), Some(Ipv4Addr::new(198, 18, 2, 12)));
        assert_eq!(c[0].epoch_origin(), None);
        // The wire list and the slice compare equal by content.
        assert_eq!(f.claims, ClaimList::Slice(&c));
    }

    #[test]
    fn oversized_or_bad_flows_batches_are_refused_with_a_typed_error() {
        // One claim too many: refused when emitting and when parsing.
        let c = claims(MAX_FLOW_CLAIMS + 1);
        let repr = ControlRepr {
            server_id: ServerId(2),
            seq: 9,
            body: ControlBody::Flows(Flows {
                report_id: 1,
                batch: 0,
                flags: 0,
                claims: ClaimList::Slice(&c),
            }),
        };
        let mut buf = vec![0u8; 4096];
        assert_eq!(
            repr.emit(&mut buf),
            Err(ControlError::TooManyFlowClaims {
                count: MAX_FLOW_CLAIMS + 1
            })
        );
        let mut buf = flows_msg(&claims(2));
        let count = field::BODY + field::flows::COUNT.start;
        buf[count..count + 2].copy_from_slice(&(MAX_FLOW_CLAIMS as u16 + 1).to_be_bytes());
        assert_eq!(
            ControlRepr::parse(&buf),
            Err(ControlError::TooManyFlowClaims {
                count: MAX_FLOW_CLAIMS + 1
            })
        );
        // A count that disagrees with the length.
        buf[count..count + 2].copy_from_slice(&3u16.to_be_bytes());
        assert!(matches!(
            ControlRepr::parse(&buf),
            Err(ControlError::BadBodyLength {
                kind: ControlKind::Flows,
                ..
            })
        ));
        // A claim with port 0 or address 0.
        let mut bad = claims(2);
        bad[1].flow.client_port = 0;
        assert_eq!(
            ControlRepr::parse(&flows_msg(&bad)),
            Err(ControlError::BadFlowClaim {
                index: 1,
                what: "port 0"
            })
        );
        let mut bad = claims(2);
        bad[0].flow.service_ip = Ipv4Addr::UNSPECIFIED;
        assert_eq!(
            ControlRepr::parse(&flows_msg(&bad)),
            Err(ControlError::BadFlowClaim {
                index: 0,
                what: "address 0.0.0.0"
            })
        );
        // Shorter than its header, and a FLOWS_ACK of the wrong length.
        let full = flows_msg(&[]);
        let mut short = full[..field::BODY + 4].to_vec();
        short[field::BODY_LEN].copy_from_slice(&4u16.to_be_bytes());
        short.extend_from_slice(&[0; MAC_LEN]);
        assert_eq!(
            ControlRepr::parse(&short),
            Err(ControlError::BadBodyLength {
                kind: ControlKind::Flows,
                len: 4,
                expected: field::flows::CLAIMS
            })
        );
        let mut ack = flows_msg(&claims(1));
        ack[field::KIND] = ControlKind::FlowsAck.to_u8();
        assert!(matches!(
            ControlRepr::parse(&ack),
            Err(ControlError::BadBodyLength {
                kind: ControlKind::FlowsAck,
                ..
            })
        ));
        // A tampered batch fails the MAC.
        let mut buf = flows_msg(&claims(3));
        buf[field::BODY + field::flows::CLAIMS + 3] ^= 1;
        assert_eq!(
            ControlRepr::parse_verified(&buf, &key()),
            Err(ControlError::BadMac)
        );
        // An empty report (a server with no connection) is one LAST batch.
        let buf = flows_msg(&[]);
        assert_eq!(buf.len(), 20 + 12 + 16);
        assert!(ControlRepr::parse_verified(&buf, &key()).is_ok());
    }

    #[test]
    fn flows_ack_request_and_refusal_flags() {
        let r = FlowsAck::request();
        assert!(r.is_request());
        assert_eq!((r.report_id, r.batch), (0, 0));
        let a = FlowsAck {
            report_id: 5,
            batch: 1,
            flags: FLOWS_REFUSED,
            applied: 0,
            skipped: 0,
        };
        assert!(!a.is_request());
        let repr = ControlRepr {
            server_id: ServerId(1),
            seq: 3,
            body: ControlBody::FlowsAck(a),
        };
        let mut buf = vec![0u8; repr.buffer_len()];
        let n = repr.emit_with_mac(&mut buf, &key()).unwrap();
        assert_eq!(n, 20 + 12 + 16);
        assert_eq!(ControlRepr::parse_verified(&buf, &key()).unwrap(), repr);
    }

    fn sample_report(flow: FlowKey) -> MigrationReport {
        MigrationReport {
            id: 0xc612_020b_0000_0007,
            flow,
            peer: Some(Ipv4Addr::new(198, 18, 2, 12)),
            outcome: ReportOutcome::MigratedOut,
            trigger: MigrationTrigger::Drain,
            reason: crate::tcpmig::Reason::None,
            fragments: 2,
            age_us: 1500,
            phases_us: [40, 7, 55, PHASE_NOT_REACHED, 120],
            snapshot_bytes: 2900,
            segments_buffered: 3,
            bytes_buffered: 4096,
        }
    }

    #[test]
    fn not_started_reports_round_trip_with_their_failure() {
        let flow = FlowKey {
            client_ip: Ipv4Addr::new(198, 18, 0, 10),
            client_port: 5555,
            service_ip: Ipv4Addr::new(198, 18, 100, 1),
            service_port: 80,
        };
        let origin = Ipv4Addr::new(198, 18, 2, 11);
        let reports: Vec<MigrationReport> = StartFailure::ALL
            .iter()
            .map(|&f| MigrationReport::not_started(origin, flow, None, MigrationTrigger::Manual, f))
            .collect();
        let repr = ControlRepr {
            server_id: ServerId(1),
            seq: 3,
            body: ControlBody::MigrationReport(ReportList::Slice(&reports)),
        };
        let mut buf = [0u8; 2048];
        let n = repr.emit(&mut buf).unwrap();
        let ControlBody::MigrationReport(list) = ControlRepr::parse(&buf[..n]).unwrap().body else {
            panic!("not a report");
        };
        let got: Vec<MigrationReport> = list.iter().collect();
        assert_eq!(got, reports);
        for (r, f) in got.iter().zip(StartFailure::ALL) {
            assert!(r.outcome.is_origin());
            assert_eq!(r.outcome.name(), "not_started");
            assert_eq!(r.id >> 32, u64::from(u32::from(origin)));
            assert_eq!(r.start_failure(), Some(f));
            assert_eq!(r.reason_text().as_deref(), Some(f.text()));
            assert_eq!(StartFailure::from_u16(f.to_u16()), Some(f));
            assert_eq!(r.phase_us(4), None);
        }
        // Other outcomes keep their TCPMig reason; no start failure.
        let mut r = sample_report(flow);
        assert_eq!((r.start_failure(), r.reason_text()), (None, None));
        r.reason = crate::tcpmig::Reason::Timeout;
        assert_eq!(r.reason_text().as_deref(), Some("timeout"));
        // Codes around the range are refused.
        for v in [0, 1, 0x0100, 0x0106, 0xFFFF] {
            assert_eq!(StartFailure::from_u16(v), None, "{v:#x}");
        }
    }

    #[test]
    fn migration_reports_are_validated() {
        let flow = FlowKey {
            client_ip: Ipv4Addr::new(198, 18, 0, 10),
            client_port: 5555,
            service_ip: Ipv4Addr::new(198, 18, 100, 1),
            service_port: 80,
        };
        let reports = [sample_report(flow); 2];
        let repr = ControlRepr {
            server_id: ServerId(2),
            seq: 9,
            body: ControlBody::MigrationReport(ReportList::Slice(&reports)),
        };
        let mut buf = [0u8; 2048];
        let n = repr.emit(&mut buf).unwrap();
        assert_eq!(n, HEADER_LEN + 4 + 2 * 72 + MAC_LEN);
        let ControlBody::MigrationReport(list) = ControlRepr::parse(&buf[..n]).unwrap().body else {
            panic!("not a report");
        };
        let got: Vec<MigrationReport> = list.iter().collect();
        assert_eq!(got, reports);
        assert_eq!(got[0].phase_us(3), None);
        assert_eq!(got[0].phase_us(4), Some(120));
        // A TCPMig reason this version does not know is kept, not refused
        // (a newer hostagent's report to an older switchd).
        for (code, text) in [(9u16, "snapshot too large"), (10, "unknown reason 10")] {
            let mut r = sample_report(flow);
            r.outcome = ReportOutcome::Resumed;
            r.reason = crate::tcpmig::Reason::from_u16(code);
            let one = [r];
            let repr = ControlRepr {
                server_id: ServerId(2),
                seq: 10,
                body: ControlBody::MigrationReport(ReportList::Slice(&one)),
            };
            let mut b = [0u8; 256];
            let m = repr.emit(&mut b).unwrap();
            let ControlBody::MigrationReport(list) = ControlRepr::parse(&b[..m]).unwrap().body
            else {
                panic!("not a report");
            };
            let got: Vec<MigrationReport> = list.iter().collect();
            assert_eq!(got, one);
            assert_eq!(got[0].reason_text().as_deref(), Some(text));
        }
        // An unknown trigger in the second report.
        let mut bad = buf;
        let off = HEADER_LEN + field::migration_report::REPORTS + 72;
        bad[off + field::migration_report::TRIGGER] = 77;
        assert_eq!(
            ControlRepr::parse(&bad[..n]),
            Err(ControlError::BadReport {
                index: 1,
                field: "trigger",
                code: 77
            })
        );
        let mut bad = buf;
        bad[off + field::migration_report::OUTCOME] = 0;
        assert!(matches!(
            ControlRepr::parse(&bad[..n]),
            Err(ControlError::BadReport {
                field: "outcome",
                ..
            })
        ));
        // NOT_STARTED needs a start-failure code, not a TCPMig reason.
        let mut bad = buf;
        bad[off + field::migration_report::OUTCOME] = 7;
        assert_eq!(
            ControlRepr::parse(&bad[..n]),
            Err(ControlError::BadReport {
                index: 1,
                field: "start failure",
                code: 0
            })
        );
        bad[off + field::migration_report::REASON.start + 1] = 1;
        assert!(ControlRepr::parse(&bad[..n]).is_err(), "TCPMig reason 1");
        // Count and length disagree.
        let mut bad = buf;
        bad[HEADER_LEN + 1] = 3;
        assert!(matches!(
            ControlRepr::parse(&bad[..n]),
            Err(ControlError::BadBodyLength { .. })
        ));
        bad[HEADER_LEN + 1] = (MAX_REPORTS + 1) as u8;
        assert_eq!(
            ControlRepr::parse(&bad[..n]),
            Err(ControlError::TooManyReports {
                count: MAX_REPORTS + 1
            })
        );
        let many = [sample_report(flow); MAX_REPORTS + 1];
        let too_many = ControlRepr {
            body: ControlBody::MigrationReport(ReportList::Slice(&many)),
            ..repr
        };
        assert!(matches!(
            too_many.emit(&mut buf),
            Err(ControlError::TooManyReports { .. })
        ));
        // A full message fits one Ethernet frame.
        let full = [sample_report(flow); MAX_REPORTS];
        let full = ControlRepr {
            body: ControlBody::MigrationReport(ReportList::Slice(&full)),
            ..repr
        };
        assert!(full.buffer_len() <= 1472, "{}", full.buffer_len());
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

    /// The services of [`register`]'s REGISTER.
    const REG_SERVICES: [SocketAddrV4; 1] = [SocketAddrV4::new(Ipv4Addr::new(198, 18, 100, 1), 80)];

    /// REGISTER of server 3 (one service) with `instance` and `reads_last_id`.
    fn register(instance: u64, reads_last_id: bool) -> ControlRepr<'static> {
        ControlRepr {
            server_id: ServerId(3),
            seq: 9,
            body: ControlBody::Register(Register {
                mgmt_addr: Ipv4Addr::new(198, 18, 1, 13),
                data_addr: Ipv4Addr::new(198, 18, 2, 13),
                data_mac: [2, 0, 0, 0, 0, 3],
                weight: 1,
                services: ServiceList::Slice(&REG_SERVICES),
                instance,
                reads_last_id,
            }),
        }
    }

    #[test]
    fn register_instance_is_optional_and_never_zero() {
        let reg = |instance| register(instance, false);
        let mut old = [0u8; 128];
        let n_old = reg(0).emit(&mut old).unwrap();
        // The layout of servers that predate instance ids: flags 0, no id.
        assert_eq!(n_old, HEADER_LEN + 20 + 8 + MAC_LEN);
        assert_eq!(&old[HEADER_LEN + 18..HEADER_LEN + 20], &[0, 0]);
        assert_eq!(ControlRepr::parse(&old[..n_old]).unwrap(), reg(0));
        let mut new = [0u8; 128];
        let n = reg(0xfeed).emit(&mut new).unwrap();
        assert_eq!(n, n_old + 8);
        assert_eq!(&new[HEADER_LEN + 18..HEADER_LEN + 20], &[0, 1]);
        let parsed = ControlRepr::parse(&new[..n]).unwrap();
        assert_eq!(parsed, reg(0xfeed));
        match parsed.body {
            ControlBody::Register(r) => {
                assert_eq!(r.services.iter().collect::<Vec<_>>(), REG_SERVICES);
                assert_eq!(r.instance, 0xfeed);
            }
            other => panic!("{other:?}"),
        }
        // Flagged, but the id is 0: refused (0 means "none").
        let mut zero = new;
        zero[n - MAC_LEN - 8..n - MAC_LEN].fill(0);
        assert_eq!(
            ControlRepr::parse(&zero[..n]),
            Err(ControlError::ZeroInstance)
        );
        // Flagged without the id, and an id without the flag: wrong length.
        let mut flagged = old;
        flagged[HEADER_LEN + 19] = 1;
        assert!(matches!(
            ControlRepr::parse(&flagged[..n_old]),
            Err(ControlError::BadBodyLength { expected: 36, .. })
        ));
        let mut unflagged = new;
        unflagged[HEADER_LEN + 19] = 0;
        assert!(matches!(
            ControlRepr::parse(&unflagged[..n]),
            Err(ControlError::BadBodyLength { expected: 28, .. })
        ));
        // Unknown flag bits are ignored (reserved, sent 0).
        let mut other_bits = new;
        other_bits[HEADER_LEN + 18] = 0x80;
        assert_eq!(ControlRepr::parse(&other_bits[..n]).unwrap(), reg(0xfeed));
    }

    /// REGISTER_ACK's `last_migration_id` (docs/TCPMIG.md §4.2): the 16-byte
    /// body of an older switch still parses (no id: the hostagent seeds its
    /// counter from the clock), the 24-byte one carries the id, any other
    /// length is refused; REGISTER's LAST_ID flag (bit 1) asks for the long
    /// form and sits beside INSTANCE without moving the instance id.
    #[test]
    fn register_ack_last_migration_id_is_optional() {
        let ack = |last_migration_id| ControlRepr {
            server_id: ServerId(3),
            seq: 11,
            body: ControlBody::RegisterAck(RegisterAck {
                switch_epoch: 0x0102_0304,
                load_interval_us: 1000,
                heartbeat_interval_ms: 100,
                dead_after_ms: 1000,
                last_migration_id,
            }),
        };
        // The bytes of a switch that predates the field, written by hand.
        let mut old = Vec::new();
        old.extend_from_slice(&MAGIC.to_be_bytes());
        old.extend_from_slice(&[VERSION, 2, 0, 0, 0, 3]);
        old.extend_from_slice(&11u64.to_be_bytes());
        old.extend_from_slice(&16u16.to_be_bytes());
        old.extend_from_slice(&[0, 0]);
        for v in [0x0102_0304u32, 1000, 100, 1000] {
            old.extend_from_slice(&v.to_be_bytes());
        }
        old.extend_from_slice(&[0; MAC_LEN]);
        assert_eq!(ControlRepr::parse(&old).unwrap(), ack(None));
        let mut emitted = [0u8; 128];
        let n = ack(None).emit(&mut emitted).unwrap();
        assert_eq!(&emitted[..n - MAC_LEN], &old[..old.len() - MAC_LEN]);

        let id = 0xc612_020b_8000_0001u64;
        let mut long = [0u8; 128];
        let n = ack(Some(id)).emit(&mut long).unwrap();
        assert_eq!(n, old.len() + 8);
        assert_eq!(&long[16..18], &24u16.to_be_bytes());
        assert_eq!(&long[..HEADER_LEN + 16][20..], &old[20..HEADER_LEN + 16]);
        assert_eq!(&long[HEADER_LEN + 16..HEADER_LEN + 24], &id.to_be_bytes());
        assert_eq!(ControlRepr::parse(&long[..n]).unwrap(), ack(Some(id)));
        // 0: the switch knows no id of this server (it started since).
        let n0 = ack(Some(0)).emit(&mut long).unwrap();
        assert_eq!(ControlRepr::parse(&long[..n0]).unwrap(), ack(Some(0)));
        // Any other length: refused, naming the short form.
        for len in [12u16, 20, 28] {
            let mut b = vec![0u8; HEADER_LEN + usize::from(len) + MAC_LEN];
            b[..HEADER_LEN].copy_from_slice(&old[..HEADER_LEN]);
            b[16..18].copy_from_slice(&len.to_be_bytes());
            assert_eq!(
                ControlRepr::parse(&b),
                Err(ControlError::BadBodyLength {
                    kind: ControlKind::RegisterAck,
                    len: usize::from(len),
                    expected: 16
                }),
                "body of {len} bytes"
            );
        }

        let reg = register;
        for (instance, flags, len) in [(0, [0, 2], 28), (0xfeed, [0, 3], 36)] {
            let mut b = [0u8; 128];
            let n = reg(instance, true).emit(&mut b).unwrap();
            assert_eq!(n, HEADER_LEN + len + MAC_LEN);
            assert_eq!(&b[HEADER_LEN + 18..HEADER_LEN + 20], &flags);
            assert_eq!(ControlRepr::parse(&b[..n]).unwrap(), reg(instance, true));
            // Without the bit (an older hostagent): the short ACK for it.
            b[HEADER_LEN + 19] &= !2;
            assert_eq!(ControlRepr::parse(&b[..n]).unwrap(), reg(instance, false));
        }
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
    #[test]
    fn policy_carries_the_migration_deadline_and_buffer_drop_compatibly() {
        let msg = PolicyMsg {
            generation: 0x0102_0304,
            flags: POLICY_REACTIVE | POLICY_BUFFER_DROP,
            proactive_threshold_bp: 1000,
            hysteresis_bp: 200,
            reactive_backlog_packets: 20,
            cooldown_ms: 1000,
            max_migrations_per_sec: 1000,
            migration_deadline_ms: 80,
        };
        let repr = ControlRepr {
            server_id: ServerId(3),
            seq: 9,
            body: ControlBody::Policy(msg),
        };
        let mut buf = [0u8; 128];
        let n = repr.emit(&mut buf).unwrap();
        // Same 32-byte body as before: an older server parses it (exact
        // length) and reads the flag bits it knows.
        assert_eq!(n, HEADER_LEN + 32 + 16, "header, body, MAC");
        let body = &buf[HEADER_LEN..HEADER_LEN + 32];
        assert_eq!(
            &body[28..32],
            &80u32.to_be_bytes(),
            "the former reserved word"
        );
        assert_eq!(&body[4..8], &(0b110u32).to_be_bytes());
        assert_eq!(ControlRepr::parse(&buf[..n]).unwrap(), repr);
        // An older switch sends the reserved word 0 and no drop bit: the
        // server keeps its own deadline and buffers.
        buf[HEADER_LEN + 28..HEADER_LEN + 32].fill(0);
        buf[HEADER_LEN + 7] = POLICY_REACTIVE as u8;
        let ControlBody::Policy(old) = ControlRepr::parse(&buf[..n]).unwrap().body else {
            panic!("not a POLICY");
        };
        assert_eq!(old.migration_deadline_ms, 0);
        assert_eq!(old.flags & POLICY_BUFFER_DROP, 0);
    }
}
