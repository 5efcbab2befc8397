//! Rust mirror of `bpf/capybara_maps.h`: the structs and constants shared
//! with the XDP program.
//!
//! Invariants: every struct is `#[repr(C)]` with no padding (checked by
//! `tests/abi_layout.rs` against the C compiler's sizeof/offsetof), so
//! [`Pod::as_bytes`] exposes no uninitialised memory. Fields documented as
//! "network order" hold the wire bytes reinterpreted with `from_ne_bytes`.

use std::net::Ipv4Addr;

use capybara_proto::FlowKey;

pub const MAX_SERVERS: u32 = 256;
pub const MAX_SERVICES: u32 = 16;
pub const MAGLEV_SIZE: u32 = 65537;
pub const MAX_FLOWS: u32 = 2_097_152;
pub const MAX_MIGRATIONS: u32 = 524_288;
pub const RING_SIZE: usize = 256;
pub const MAX_IFACES: u32 = 64;
pub const HASH_SEED: u32 = 0x9E37_79B9;

pub const SERVER_EMPTY: u8 = 0;
pub const SERVER_LIVE: u8 = 1;
pub const SERVER_DRAINING: u8 = 2;
pub const SERVER_DEAD: u8 = 3;

pub const IFACE_CLIENT: u32 = 1;
pub const IFACE_SERVER: u32 = 2;

pub const PLACE_MAGLEV: u32 = 0;
pub const PLACE_RING: u32 = 1;
/// A retiring (deleted) service: established flows are forwarded, no new
/// flow is placed (a segment without a flow is answered with a reset).
pub const PLACE_NONE: u32 = 2;

/// `capy_service.flags`: every pool member is out for a lasting reason
/// (operator drain or weight 0, dead past its grace): a SYN that finds no
/// usable server is answered with a reset (`reset_no_server`) instead of
/// being dropped (`drop_no_server`). Set by the control plane
/// (`ControlPlane::refusing`).
pub const SVC_REFUSE: u32 = 0x1;

pub const FLOW_MIGRATED: u16 = 0x1;
pub const FLOW_CLOSING: u16 = 0x2;
pub const FLOW_FIN_CLIENT: u16 = 0x4;
pub const FLOW_FIN_SERVER: u16 = 0x8;
/// The client sent a non-SYN segment: no longer embryonic.
pub const FLOW_ESTABLISHED: u16 = 0x10;
/// Made by the program for a client's SYN; no PREPARE of the flow passed
/// since (a PREPARE_ACK without migration entry is refused then).
pub const FLOW_UNPREPARED: u16 = 0x20;

pub const MIG_FINAL: u8 = 0;
pub const MIG_PENDING: u8 = 1;
pub const PREPARE_MEMORY: u32 = 8192;
/// Origins whose last migration id the program remembers (`origin_ids`).
pub const ORIGIN_IDS: u32 = 1024;
/// Outcomes of migrations whose entry the program did not hold
/// (`unmatched_outcomes`, read at a takeover's end).
pub const UNMATCHED_OUTCOMES: u32 = 1024;

pub const EV_NEW: u32 = 1;
pub const EV_MIGRATED: u32 = 2;
pub const EV_RETURNED: u32 = 3;
pub const EV_CLOSED: u32 = 4;

pub const RING_PLACEMENT: u32 = 0;
pub const RING_TARGET: u32 = 1;
pub const RING_KINDS: u32 = 2;

pub const RING_ROTATE: u32 = 0;
pub const RING_FIRST: u32 = 1;
/// Pairs (target, alternate) in `servers`: the next pair at each use, its
/// alternate when the target must be skipped (weighted round-robin
/// migration targets, `control::weighted_target_ring`).
pub const RING_PAIRED: u32 = 2;

/// Sentinel server index in a Maglev slot or ring: nobody (no live server).
pub const NO_SERVER: u32 = u32::MAX;

/// `enum capy_stat`, in order. Index = counter slot in the `stats` map.
pub const STAT_NAMES: [&str; 27] = [
    "pass_not_ipv4",
    "pass_not_service",
    "pass_unknown_iface",
    "fwd_new_flow",
    "fwd_established",
    "fwd_migrated",
    "fwd_recovered",
    "fwd_prepare",
    "fwd_prepare_ack",
    "fwd_tcpmig",
    "drop_short_eth",
    "drop_bad_ipv4",
    "drop_ip_fragment",
    "drop_short_l4",
    "drop_no_server",
    "drop_no_flow",
    "drop_server_down",
    "drop_tcpmig_from_client",
    "drop_tcpmig_malformed",
    "drop_tcpmig_unknown",
    "drop_tcpmig_no_target",
    "drop_migration_full",
    "drop_prepare_ack_stale",
    "drop_abort_unmatched",
    "event_lost",
    "reset_retired",
    "reset_no_server",
];
pub const STAT_MAX: u32 = STAT_NAMES.len() as u32;

/// A stat counter, by name (panics only on a typo in our own code).
pub fn stat(name: &str) -> usize {
    STAT_NAMES
        .iter()
        .position(|n| *n == name)
        .unwrap_or_else(|| panic!("unknown stat {name}"))
}

/// Plain old data: `#[repr(C)]`, no padding, every bit pattern valid.
///
/// # Safety
/// Implement only for such types.
pub unsafe trait Pod: Copy + Sized {
    fn as_bytes(&self) -> &[u8] {
        // SAFETY: Pod types have no padding, so every byte is initialised.
        unsafe {
            std::slice::from_raw_parts(
                self as *const Self as *const u8,
                std::mem::size_of::<Self>(),
            )
        }
    }
    /// Reads `Self` from the first `size_of::<Self>()` bytes; `None` if short.
    fn from_bytes(bytes: &[u8]) -> Option<Self> {
        if bytes.len() < std::mem::size_of::<Self>() {
            return None;
        }
        // SAFETY: length checked; every bit pattern is a valid Pod.
        Some(unsafe { std::ptr::read_unaligned(bytes.as_ptr() as *const Self) })
    }
}

fn be_ip(ip: Ipv4Addr) -> u32 {
    u32::from_ne_bytes(ip.octets())
}
fn ip_of(v: u32) -> Ipv4Addr {
    Ipv4Addr::from(v.to_ne_bytes())
}
fn be_port(p: u16) -> u16 {
    u16::from_ne_bytes(p.to_be_bytes())
}
fn port_of(v: u16) -> u16 {
    u16::from_be_bytes(v.to_ne_bytes())
}

/// `struct capy_flow_key` (network order).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct CFlowKey {
    pub client_ip: u32,
    pub service_ip: u32,
    pub client_port: u16,
    pub service_port: u16,
}
unsafe impl Pod for CFlowKey {}

impl From<FlowKey> for CFlowKey {
    fn from(k: FlowKey) -> Self {
        CFlowKey {
            client_ip: be_ip(k.client_ip),
            service_ip: be_ip(k.service_ip),
            client_port: be_port(k.client_port),
            service_port: be_port(k.service_port),
        }
    }
}
impl From<CFlowKey> for FlowKey {
    fn from(k: CFlowKey) -> Self {
        FlowKey {
            client_ip: ip_of(k.client_ip),
            client_port: port_of(k.client_port),
            service_ip: ip_of(k.service_ip),
            service_port: port_of(k.service_port),
        }
    }
}

/// `struct capy_flow`: where a connection was placed at SYN time.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CFlow {
    pub server: u32,
    pub service: u16,
    pub flags: u16,
    /// CLOCK_MONOTONIC ns when the data plane made the entry (0: made by
    /// the control plane, e.g. restored from the store).
    pub created_ns: u64,
}
unsafe impl Pod for CFlow {}

/// `struct capy_migration`: `{owner, migration_id, pending}` of a flow
/// (docs/MIGRATION.md). `pending`: [`MIG_PENDING`] from PREPARE_ACK (owner =
/// the target) until CONN_STATE_ACK or the target's ABORT decision makes it
/// [`MIG_FINAL`]. `migration_id` in host order.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CMigration {
    pub server: u32,
    pub pending: u8,
    pub pad: [u8; 3],
    pub migration_id: u64,
}
unsafe impl Pod for CMigration {}

impl CMigration {
    /// A final entry: `server` owns the flow.
    pub fn owner(server: u32, migration_id: u64) -> Self {
        CMigration {
            server,
            pending: MIG_FINAL,
            pad: [0; 3],
            migration_id,
        }
    }
    /// A pending entry toward the target `server` of `migration_id`.
    pub fn pending(server: u32, migration_id: u64) -> Self {
        CMigration {
            server,
            pending: MIG_PENDING,
            pad: [0; 3],
            migration_id,
        }
    }
    pub fn is_pending(&self) -> bool {
        self.pending != MIG_FINAL
    }
}

/// `struct capy_server`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CServer {
    /// Network order.
    pub data_ip: u32,
    pub ifindex: u32,
    pub mac: [u8; 6],
    pub src_mac: [u8; 6],
    pub state: u8,
    pub flags: u8,
    pub weight: u16,
}
unsafe impl Pod for CServer {}

impl CServer {
    pub fn data_addr(&self) -> Ipv4Addr {
        ip_of(self.data_ip)
    }
    pub fn set_data_addr(&mut self, ip: Ipv4Addr) {
        self.data_ip = be_ip(ip);
    }
}

/// `struct capy_service_key` (network order).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct CServiceKey {
    pub vip: u32,
    pub port: u16,
    pub proto: u8,
    pub pad: u8,
}
unsafe impl Pod for CServiceKey {}

impl CServiceKey {
    pub fn tcp(vip: Ipv4Addr, port: u16) -> Self {
        CServiceKey {
            vip: be_ip(vip),
            port: be_port(port),
            proto: 6,
            pad: 0,
        }
    }
}

/// `struct capy_service`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CService {
    pub index: u32,
    pub placement: u32,
    /// `SVC_*`.
    pub flags: u32,
}
unsafe impl Pod for CService {}

/// `struct capy_ring`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CRing {
    pub len: u32,
    pub mode: u32,
    pub servers: [u32; RING_SIZE],
}
unsafe impl Pod for CRing {}

impl CRing {
    /// A ring from a sequence, truncated to [`RING_SIZE`].
    pub fn from_slice(mode: u32, servers: &[u32]) -> Self {
        let mut r = CRing {
            len: 0,
            mode,
            servers: [NO_SERVER; RING_SIZE],
        };
        let n = servers.len().min(RING_SIZE);
        r.servers[..n].copy_from_slice(&servers[..n]);
        r.len = n as u32;
        r
    }
    pub fn as_slice(&self) -> &[u32] {
        &self.servers[..(self.len as usize).min(RING_SIZE)]
    }
}

/// `struct capy_iface`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CIface {
    pub role: u32,
    pub mac: [u8; 6],
    pub pad: u16,
}
unsafe impl Pod for CIface {}

/// `struct capy_config`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CConfig {
    /// Network order.
    pub switch_server_ip: u32,
    pub flags: u32,
}
unsafe impl Pod for CConfig {}

impl CConfig {
    pub fn new(switch_server_ip: Ipv4Addr) -> Self {
        CConfig {
            switch_server_ip: be_ip(switch_server_ip),
            flags: 0,
        }
    }
}

/// `struct capy_server_stats`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CServerStats {
    pub packets: u64,
    pub bytes: u64,
    /// Packets carrying TCP payload (the pool monitor's load).
    pub requests: u64,
}
unsafe impl Pod for CServerStats {}

/// `struct capy_flow_event`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CFlowEvent {
    pub key: CFlowKey,
    pub kind: u32,
    pub server: u32,
    pub prev_server: u32,
    pub ts_ns: u64,
}
unsafe impl Pod for CFlowEvent {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flow_key_round_trips_and_is_network_order() {
        let k = FlowKey {
            client_ip: Ipv4Addr::new(198, 18, 0, 11),
            client_port: 40000,
            service_ip: Ipv4Addr::new(198, 18, 100, 1),
            service_port: 80,
        };
        let c = CFlowKey::from(k);
        assert_eq!(&c.as_bytes()[0..4], &[198, 18, 0, 11]);
        assert_eq!(&c.as_bytes()[8..10], &40000u16.to_be_bytes());
        assert_eq!(FlowKey::from(c), k);
        assert_eq!(CFlowKey::from_bytes(c.as_bytes()), Some(c));
        assert_eq!(CFlowKey::from_bytes(&[0u8; 3]), None);
    }
}
