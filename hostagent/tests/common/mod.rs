//! Deterministic four-party harness for live TCP migration: a client, a
//! model of the switch, and two servers (each an origin or a target), all in
//! one process on a virtual clock that jumps to the next deadline.
//!
//! Every party runs the production sans-IO pieces: `capybara-net`'s
//! `Interface` (Ethernet/ARP/IPv4) and, above it, `stack::Transports` (the
//! TCP `Endpoint`, and on servers the TCPMig `Engine` with the `Migrator`
//! glue). Only the applications and the switch are written here.
//!
//! - [`Switch`] works on Ethernet frames as the eBPF/Tofino data plane does:
//!   new flows go to server 0 on SYN, established flows to the owner named by
//!   the migration table (destination IP rewritten, checksums fixed, MACs
//!   rewritten), responses from the VIP go to the client unchanged, and
//!   TCPMig datagrams update the migration table exactly as
//!   `docs/MIGRATION.md` § "What the switch must do" says. It answers ARP for
//!   the gateways and the VIP. TCPMig from the client side is dropped.
//! - [`Link`]s carry frames one way with latency, loss, duplication and
//!   reordering, separately for TCP and TCPMig frames, from a seeded RNG.
//! - Server applications never hold bytes outside the stack (see [`App`]),
//!   so a migration at any instant finds the whole application state in the
//!   TCP queues.
//!
//! Determinism: no wall clock, no thread, no `HashMap` iteration whose order
//! matters; the same seed replays the same run.
#![allow(dead_code)]

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::net::{Ipv4Addr, SocketAddrV4};

use capybara_hostagent::migration::{Migrator, Outcome};
use capybara_hostagent::stack::Transports;
use capybara_net::iface::{Interface, InterfaceConfig};
use capybara_net::wire::{
    ArpOperation, ArpPacket, ArpRepr, EtherType, EthernetAddress, EthernetFrame, EthernetRepr,
};
use capybara_proto::checksum;
use capybara_proto::tcpmig::{Kind, TcpMigRepr};
use capybara_proto::time::{Duration, Instant};
use capybara_proto::{FlowKey, MigrationKey};
use capybara_tcp::{ConnId, Endpoint, State, TcpConfig, TcpError};
use capybara_tcpmig::{Engine, EngineConfig, MigrationId};

// ------------------------------------------------------------------ address plan

pub const CLIENT: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 11);
/// The client's default gateway (a switch interface).
pub const CLIENT_GW: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 1);
/// The switch's address on the server side: servers' gateway, PREPARE dst.
pub const SWITCH: Ipv4Addr = Ipv4Addr::new(198, 18, 1, 1);
pub const VIP: Ipv4Addr = Ipv4Addr::new(198, 18, 100, 1);
pub const SERVICE_PORT: u16 = 7;
pub const SERVERS: [Ipv4Addr; 2] = [Ipv4Addr::new(198, 18, 2, 11), Ipv4Addr::new(198, 18, 2, 12)];
pub const SWITCH_MAC: EthernetAddress = EthernetAddress([0x02, 0, 0, 0, 0x01, 0x01]);
pub const CLIENT_MAC: EthernetAddress = EthernetAddress([0x02, 0, 0, 0, 0x00, 0x11]);
pub const TCPMIG_PORT: u16 = capybara_proto::ports::TCPMIG;

pub fn server_mac(i: usize) -> EthernetAddress {
    EthernetAddress([0x02, 0, 0, 0, 0x02, 0x11 + i as u8])
}

pub fn migration_key() -> MigrationKey {
    MigrationKey::from_bytes(&[0x42; 32]).expect("32-byte key")
}

const ETH: usize = 14;
const IPPROTO_TCP: u8 = 6;
const IPPROTO_UDP: u8 = 17;
const FRAME: usize = ETH + 1500;

// ------------------------------------------------------------------ randomness

/// SplitMix64: tiny, seedable, stable across toolchains and crate versions.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed ^ 0x9e37_79b9_7f4a_7c15)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    pub fn chance(&mut self, p: f64) -> bool {
        p > 0.0 && ((self.next_u64() >> 11) as f64 / (1u64 << 53) as f64) < p
    }
    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }
}

/// Byte `i` of the stream named `seed`: any position can be computed alone,
/// so an application can resume a stream knowing only its offset.
pub fn stream_byte(seed: u64, i: u64) -> u8 {
    let mut r = Rng::new(seed ^ i.wrapping_mul(0xd6e8_feb8_6659_fd93));
    r.next_u64() as u8
}

pub fn stream(seed: u64, len: usize) -> Vec<u8> {
    let mut r = Rng::new(seed);
    let mut v = Vec::with_capacity(len);
    while v.len() < len {
        let x = r.next_u64().to_le_bytes();
        let take = (len - v.len()).min(8);
        v.extend_from_slice(&x[..take]);
    }
    v
}

// ------------------------------------------------------------------ frames

/// What a frame carries, as far as fault knobs and logs care.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Class {
    Tcp,
    TcpMig(Kind),
    Other,
}

/// Offsets of an IPv4 frame: (IP header length, IP total length).
fn ipv4_bounds(frame: &[u8]) -> Option<(usize, usize)> {
    if frame.len() < ETH + 20 || frame[12..14] != [0x08, 0x00] {
        return None;
    }
    let ip = &frame[ETH..];
    let ihl = usize::from(ip[0] & 0x0f) * 4;
    let total = usize::from(u16::from_be_bytes([ip[2], ip[3]]));
    if ip[0] >> 4 != 4 || ihl < 20 || total < ihl || total > ip.len() {
        return None;
    }
    Some((ihl, total))
}

fn ip_src(frame: &[u8]) -> Ipv4Addr {
    Ipv4Addr::new(
        frame[ETH + 12],
        frame[ETH + 13],
        frame[ETH + 14],
        frame[ETH + 15],
    )
}
fn ip_dst(frame: &[u8]) -> Ipv4Addr {
    Ipv4Addr::new(
        frame[ETH + 16],
        frame[ETH + 17],
        frame[ETH + 18],
        frame[ETH + 19],
    )
}
fn ip_proto(frame: &[u8]) -> u8 {
    frame[ETH + 9]
}

/// The TCPMig message in a frame, if it is one (UDP to port 7690).
pub fn tcpmig_of(frame: &[u8]) -> Option<TcpMigRepr<'_>> {
    let (ihl, total) = ipv4_bounds(frame)?;
    if ip_proto(frame) != IPPROTO_UDP {
        return None;
    }
    let udp = &frame[ETH + ihl..ETH + total];
    if udp.len() < 8 || u16::from_be_bytes([udp[2], udp[3]]) != TCPMIG_PORT {
        return None;
    }
    let len = usize::from(u16::from_be_bytes([udp[4], udp[5]]));
    if len < 8 || len > udp.len() {
        return None;
    }
    TcpMigRepr::parse_bytes(&udp[8..len]).ok()
}

pub fn classify(frame: &[u8]) -> Class {
    match ipv4_bounds(frame) {
        Some(_) if ip_proto(frame) == IPPROTO_TCP => Class::Tcp,
        Some(_) => tcpmig_of(frame).map_or(Class::Other, |m| Class::TcpMig(m.kind)),
        None => Class::Other,
    }
}

/// TCP flags byte of a TCP frame.
fn tcp_flags(frame: &[u8]) -> Option<u8> {
    let (ihl, total) = ipv4_bounds(frame)?;
    let seg = &frame[ETH + ihl..ETH + total];
    (ip_proto(frame) == IPPROTO_TCP && seg.len() >= 20).then(|| seg[13])
}

fn ports(frame: &[u8]) -> Option<(u16, u16)> {
    let (ihl, total) = ipv4_bounds(frame)?;
    let seg = &frame[ETH + ihl..ETH + total];
    (seg.len() >= 4).then(|| {
        (
            u16::from_be_bytes([seg[0], seg[1]]),
            u16::from_be_bytes([seg[2], seg[3]]),
        )
    })
}

/// Rewrites the IPv4 destination and fixes the IPv4 and TCP/UDP checksums.
pub fn rewrite_dst(frame: &mut [u8], dst: Ipv4Addr) {
    let Some((ihl, total)) = ipv4_bounds(frame) else {
        return;
    };
    let proto = ip_proto(frame);
    frame[ETH + 16..ETH + 20].copy_from_slice(&dst.octets());
    let src = ip_src(frame);
    let seg = &mut frame[ETH + ihl..ETH + total];
    match proto {
        IPPROTO_TCP if seg.len() >= 20 => {
            seg[16..18].copy_from_slice(&[0, 0]);
            let sum = checksum::transport(src, dst, IPPROTO_TCP, seg);
            seg[16..18].copy_from_slice(&sum.to_be_bytes());
        }
        IPPROTO_UDP if seg.len() >= 8 && seg[6..8] != [0, 0] => {
            seg[6..8].copy_from_slice(&[0, 0]);
            let mut sum = checksum::transport(src, dst, IPPROTO_UDP, seg);
            if sum == 0 {
                sum = 0xffff;
            }
            seg[6..8].copy_from_slice(&sum.to_be_bytes());
        }
        _ => {}
    }
    let ip = &mut frame[ETH..ETH + ihl];
    ip[10..12].copy_from_slice(&[0, 0]);
    let sum = checksum::checksum(ip);
    ip[10..12].copy_from_slice(&sum.to_be_bytes());
}

fn set_macs(frame: &mut [u8], src: EthernetAddress, dst: EthernetAddress) {
    frame[0..6].copy_from_slice(dst.as_bytes());
    frame[6..12].copy_from_slice(src.as_bytes());
}

// ------------------------------------------------------------------ links

/// Fault probabilities for one class of frames on one link direction.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Faults {
    pub loss: f64,
    pub duplicate: f64,
    /// Probability that a frame is held back by up to the reorder delay.
    pub reorder: f64,
}

impl Faults {
    pub const NONE: Faults = Faults {
        loss: 0.0,
        duplicate: 0.0,
        reorder: 0.0,
    };
    pub fn all(p: f64) -> Faults {
        Faults {
            loss: p,
            duplicate: p,
            reorder: p,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LinkConfig {
    /// One-way delay of every frame (must be positive: the harness relies on
    /// output never being due in the instant it was sent).
    pub latency: Duration,
    pub reorder_delay: Duration,
    /// The same for TCPMig frames. Keep it below the duration of two
    /// migrations unless testing the switch's stale-PREPARE_ACK residual
    /// risk (see `stale_prepare_ack_from_two_migrations_ago` in
    /// live_migration.rs).
    pub tcpmig_reorder_delay: Duration,
    pub tcp: Faults,
    pub tcpmig: Faults,
}

impl Default for LinkConfig {
    fn default() -> Self {
        LinkConfig {
            latency: Duration::from_micros(10),
            reorder_delay: Duration::from_micros(100),
            tcpmig_reorder_delay: Duration::from_micros(100),
            tcp: Faults::NONE,
            tcpmig: Faults::NONE,
        }
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LinkStats {
    pub sent: u64,
    pub lost: u64,
    pub duplicated: u64,
    pub reordered: u64,
}

/// One direction of a cable.
pub struct Link {
    pub cfg: LinkConfig,
    queue: BinaryHeap<Reverse<(Instant, u64, Vec<u8>)>>,
    seq: u64,
    rng: Rng,
    pub stats: LinkStats,
}

impl Link {
    pub fn new(cfg: LinkConfig, seed: u64) -> Link {
        Link {
            cfg,
            queue: BinaryHeap::new(),
            seq: 0,
            rng: Rng::new(seed),
            stats: LinkStats::default(),
        }
    }

    pub fn send(&mut self, now: Instant, frame: Vec<u8>) {
        self.stats.sent += 1;
        let (f, delay) = match classify(&frame) {
            Class::Tcp => (self.cfg.tcp, self.cfg.reorder_delay),
            Class::TcpMig(_) => (self.cfg.tcpmig, self.cfg.tcpmig_reorder_delay),
            Class::Other => (Faults::NONE, Duration::ZERO),
        };
        if self.rng.chance(f.loss) {
            self.stats.lost += 1;
            return;
        }
        let copies = if self.rng.chance(f.duplicate) {
            self.stats.duplicated += 1;
            2
        } else {
            1
        };
        for _ in 0..copies {
            let mut at = now + self.cfg.latency;
            if self.rng.chance(f.reorder) {
                self.stats.reordered += 1;
                let extra = 1 + self.rng.below(delay.as_micros().max(1) as u64);
                at += Duration::from_micros(extra);
            }
            self.seq += 1;
            self.queue.push(Reverse((at, self.seq, frame.clone())));
        }
    }

    pub fn next_time(&self) -> Option<Instant> {
        self.queue.peek().map(|Reverse((t, _, _))| *t)
    }

    pub fn pop_due(&mut self, now: Instant) -> Option<Vec<u8>> {
        if self.next_time()? <= now {
            self.queue.pop().map(|Reverse((_, _, f))| f)
        } else {
            None
        }
    }

    pub fn in_flight(&self) -> usize {
        self.queue.len()
    }
}

// ------------------------------------------------------------------ switch

/// A port of the switch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Port {
    Client,
    Server(usize),
}

/// Migration-table value (docs/MIGRATION.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MigEntry {
    pub owner: Ipv4Addr,
    pub id: u64,
    pub pending: bool,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SwitchCounters {
    pub to_servers: u64,
    pub to_client: u64,
    /// RSTs from a server to the client: a migration must never cause one.
    pub resets_to_client: u64,
    pub tcpmig_from_client_dropped: u64,
    pub no_flow_dropped: u64,
    pub tcpmig_refused: u64,
    pub fault_dropped: u64,
    pub arp_replies: u64,
    /// Client segments a server sent on to another server.
    pub forwarded_between_servers: u64,
}

/// A scripted loss of TCPMig messages at the switch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KindDrop {
    pub kind: Kind,
    /// Drop the message after the switch has applied it to its table
    /// (otherwise it is lost on the way in and the switch never sees it).
    pub after_switch: bool,
    /// How many more messages of this kind to drop.
    pub remaining: u32,
}

/// The switch model: flow table, migration table, TCPMig steering.
pub struct Switch {
    /// Flow table: the server chosen at SYN time.
    pub flows: HashMap<FlowKey, usize>,
    pub migration: HashMap<FlowKey, MigEntry>,
    /// PREPARE steering choice per migration id (retransmissions of one
    /// migration reach the same target).
    pub choices: HashMap<u64, Ipv4Addr>,
    pub drops: Vec<KindDrop>,
    pub counters: SwitchCounters,
    /// Every change of a migration-table entry: (time, message kind, message
    /// id, entry before, entry after).
    pub table_log: Vec<(Instant, Kind, u64, Option<MigEntry>, Option<MigEntry>)>,
    /// RSTs from servers to the client: (time, server port).
    pub resets: Vec<(Instant, Port)>,
    /// Every TCPMig message seen: (time, kind, id, src, dst, forwarded to).
    pub mig_log: Vec<(Instant, Kind, u64, Ipv4Addr, Ipv4Addr, Option<Ipv4Addr>)>,
    /// switchd's rules for a closed 4-tuple: a client's RST removes the
    /// flow's entries once forwarded, and a SYN (no ACK) that finds a
    /// migration entry but no flow entry (a TCPMig message of a migration
    /// in flight at the reset re-created it) is a new connection: its own
    /// flow entry on the entry's owner if final, else placed anew (server 0
    /// here, as Maglev would). Off by default: the older scenarios were
    /// written without them.
    pub forget_on_client_reset: bool,
    /// Flows made for a client's SYN that no PREPARE has passed since
    /// (switchd's CAPY_FLOW_UNPREPARED): a PREPARE_ACK without entry is
    /// then a closed connection's (the 4-tuple reused) and is dropped.
    pub unprepared: std::collections::HashSet<FlowKey>,
    rr: usize,
}

impl Default for Switch {
    fn default() -> Self {
        Switch::new()
    }
}

impl Switch {
    pub fn new() -> Switch {
        Switch {
            flows: HashMap::new(),
            migration: HashMap::new(),
            choices: HashMap::new(),
            drops: Vec::new(),
            resets: Vec::new(),
            table_log: Vec::new(),
            counters: SwitchCounters::default(),
            mig_log: Vec::new(),
            forget_on_client_reset: false,
            unprepared: std::collections::HashSet::new(),
            rr: 0,
        }
    }

    /// Where packets of `flow` go now.
    pub fn owner(&self, flow: &FlowKey) -> Option<Ipv4Addr> {
        match self.migration.get(flow) {
            Some(e) => Some(e.owner),
            None => self.flows.get(flow).map(|&i| SERVERS[i]),
        }
    }

    /// A server declared dead by liveness checks: forget its entries.
    pub fn server_dead(&mut self, addr: Ipv4Addr) {
        self.migration.retain(|_, e| e.owner != addr);
    }

    fn port_of(addr: Ipv4Addr) -> Option<usize> {
        SERVERS.iter().position(|&s| s == addr)
    }

    /// Takes one frame arriving on `from`; returns the frames to send and
    /// their output ports.
    pub fn process(&mut self, now: Instant, from: Port, frame: &[u8]) -> Vec<(Port, Vec<u8>)> {
        let Ok(eth) = EthernetFrame::new_checked(frame) else {
            return Vec::new();
        };
        match eth.ethertype() {
            EtherType::Arp => self
                .arp(from, eth.src_addr(), eth.payload())
                .into_iter()
                .collect(),
            EtherType::Ipv4 => match from {
                Port::Client => self.from_client(frame),
                Port::Server(_) => self.from_server(now, from, frame),
            },
            _ => Vec::new(),
        }
    }

    fn arp(
        &mut self,
        from: Port,
        src_mac: EthernetAddress,
        bytes: &[u8],
    ) -> Option<(Port, Vec<u8>)> {
        let req = ArpPacket::new_checked(bytes)
            .and_then(|p| ArpRepr::parse(&p))
            .ok()?;
        if req.operation != ArpOperation::Request {
            return None;
        }
        let ours = match from {
            Port::Client => [CLIENT_GW, VIP].contains(&req.target_protocol_addr),
            Port::Server(_) => req.target_protocol_addr == SWITCH,
        };
        if !ours {
            return None;
        }
        let reply = ArpRepr {
            operation: ArpOperation::Reply,
            source_hardware_addr: SWITCH_MAC,
            source_protocol_addr: req.target_protocol_addr,
            target_hardware_addr: req.source_hardware_addr,
            target_protocol_addr: req.source_protocol_addr,
        };
        let mut out = vec![0u8; ETH + reply.buffer_len()];
        let mut f = EthernetFrame::new_unchecked(&mut out[..]);
        EthernetRepr {
            src_addr: SWITCH_MAC,
            dst_addr: src_mac,
            ethertype: EtherType::Arp,
        }
        .emit(&mut f);
        reply.emit(&mut ArpPacket::new_unchecked(f.payload_mut()));
        self.counters.arp_replies += 1;
        Some((from, out))
    }

    fn from_client(&mut self, frame: &[u8]) -> Vec<(Port, Vec<u8>)> {
        if ipv4_bounds(frame).is_none() {
            return Vec::new();
        }
        if tcpmig_of(frame).is_some()
            || ports(frame).is_some_and(|(s, d)| s == TCPMIG_PORT || d == TCPMIG_PORT)
        {
            // Only servers may move connections.
            self.counters.tcpmig_from_client_dropped += 1;
            return Vec::new();
        }
        let (Some(flags), Some((sport, dport))) = (tcp_flags(frame), ports(frame)) else {
            return Vec::new();
        };
        if ip_dst(frame) != VIP {
            return Vec::new();
        }
        let flow = FlowKey {
            client_ip: ip_src(frame),
            client_port: sport,
            service_ip: VIP,
            service_port: dport,
        };
        let syn_only = flags & 0x02 != 0 && flags & 0x10 == 0;
        if syn_only && self.forget_on_client_reset && !self.flows.contains_key(&flow) {
            if let Some(e) = self.migration.remove(&flow) {
                let last = Switch::port_of(e.owner).filter(|_| !e.pending);
                self.flows.insert(flow, last.unwrap_or(0));
                self.unprepared.insert(flow);
            }
        }
        if syn_only && !self.flows.contains_key(&flow) {
            self.flows.insert(flow, 0);
            self.unprepared.insert(flow);
        }
        let Some(owner) = self.owner(&flow) else {
            self.counters.no_flow_dropped += 1;
            return Vec::new();
        };
        let Some(port) = Switch::port_of(owner) else {
            return Vec::new();
        };
        if self.forget_on_client_reset && flags & 0x04 != 0 {
            self.flows.remove(&flow);
            self.migration.remove(&flow);
            self.unprepared.remove(&flow);
        }
        let mut out = frame.to_vec();
        rewrite_dst(&mut out, owner);
        set_macs(&mut out, SWITCH_MAC, server_mac(port));
        self.counters.to_servers += 1;
        vec![(Port::Server(port), out)]
    }

    fn from_server(&mut self, now: Instant, from: Port, frame: &[u8]) -> Vec<(Port, Vec<u8>)> {
        if ipv4_bounds(frame).is_none() {
            return Vec::new();
        }
        if ip_proto(frame) == IPPROTO_TCP && ip_src(frame) == VIP && ip_dst(frame) == CLIENT {
            if tcp_flags(frame).is_some_and(|f| f & 0x04 != 0) {
                self.counters.resets_to_client += 1;
                self.resets.push((now, from));
            }
            let mut out = frame.to_vec();
            set_macs(&mut out, SWITCH_MAC, CLIENT_MAC);
            self.counters.to_client += 1;
            return vec![(Port::Client, out)];
        }
        if ip_proto(frame) == IPPROTO_TCP {
            // A client segment a server sent on to another (its late
            // segments after a migration): routed by destination, as the
            // kernel does behind switchd's data plane.
            let Some(port) = Switch::port_of(ip_dst(frame)) else {
                return Vec::new();
            };
            let mut out = frame.to_vec();
            set_macs(&mut out, SWITCH_MAC, server_mac(port));
            self.counters.forwarded_between_servers += 1;
            return vec![(Port::Server(port), out)];
        }
        let Some(m) = tcpmig_of(frame) else {
            return Vec::new();
        };
        let (kind, id, src, dst) = (m.kind, m.migration_id, ip_src(frame), ip_dst(frame));
        if self.fault(kind, false) {
            self.mig_log.push((now, kind, id, src, dst, None));
            return Vec::new();
        }
        let before = self.migration.get(&m.flow).copied();
        let verdict = self.tcpmig(src, dst, &m);
        let after = self.migration.get(&m.flow).copied();
        if before != after {
            self.table_log.push((now, kind, id, before, after));
        }
        let verdict = if verdict.is_some() && self.fault(kind, true) {
            None
        } else {
            verdict
        };
        self.mig_log.push((now, kind, id, src, dst, verdict));
        let Some(to) = verdict else {
            return Vec::new();
        };
        let Some(port) = Switch::port_of(to) else {
            return Vec::new();
        };
        let mut out = frame.to_vec();
        if to != dst {
            rewrite_dst(&mut out, to);
        }
        set_macs(&mut out, SWITCH_MAC, server_mac(port));
        vec![(Port::Server(port), out)]
    }

    fn fault(&mut self, kind: Kind, after_switch: bool) -> bool {
        for d in &mut self.drops {
            if d.kind == kind && d.after_switch == after_switch && d.remaining > 0 {
                d.remaining -= 1;
                self.counters.fault_dropped += 1;
                return true;
            }
        }
        false
    }

    /// The migration-table rules of docs/MIGRATION.md; returns where to
    /// forward the message (None = drop).
    fn tcpmig(&mut self, src: Ipv4Addr, dst: Ipv4Addr, m: &TcpMigRepr<'_>) -> Option<Ipv4Addr> {
        let id = m.migration_id;
        if m.kind == Kind::Prepare {
            self.unprepared.remove(&m.flow);
        }
        let r = match m.kind {
            Kind::Prepare if dst == SWITCH => {
                if !m.target.is_unspecified() {
                    Some(m.target)
                } else {
                    let candidates: Vec<Ipv4Addr> =
                        SERVERS.iter().copied().filter(|&s| s != src).collect();
                    let rr = &mut self.rr;
                    Some(*self.choices.entry(id).or_insert_with(|| {
                        *rr += 1;
                        candidates[*rr % candidates.len()]
                    }))
                }
            }
            Kind::PrepareAck => {
                let e = self.migration.get(&m.flow).copied();
                let install = match e {
                    None => !self.unprepared.contains(&m.flow),
                    Some(e) => m.supersedes(e.owner, e.id, e.pending),
                };
                if install {
                    self.migration.insert(
                        m.flow,
                        MigEntry {
                            owner: m.target,
                            id,
                            pending: true,
                        },
                    );
                    Some(dst)
                } else if e.is_some_and(|e| e.id == id && e.owner == m.target) {
                    Some(dst)
                } else {
                    None
                }
            }
            Kind::ConnStateAck => {
                if let Some(e) = self.migration.get_mut(&m.flow) {
                    if e.id == id && e.owner == m.target {
                        e.pending = false;
                    }
                }
                Some(dst)
            }
            Kind::Abort if dst == m.origin => {
                match self.migration.get_mut(&m.flow) {
                    Some(e) if e.id == id && e.owner == m.target && e.pending => {
                        *e = MigEntry {
                            owner: m.origin,
                            id,
                            pending: false,
                        };
                    }
                    // TCPMig v2: the decision of a migration whose
                    // PREPARE_ACK never passed advances the final entry to
                    // its id, so that a late copy of that PREPARE_ACK is
                    // stale when it comes.
                    Some(e) if m.supersedes(e.owner, e.id, e.pending) => {
                        e.id = id;
                    }
                    Some(_) => {}
                    None => {
                        self.migration.insert(
                            m.flow,
                            MigEntry {
                                owner: m.origin,
                                id,
                                pending: false,
                            },
                        );
                    }
                }
                Some(dst)
            }
            Kind::Abort if dst == SWITCH => match self.migration.get(&m.flow) {
                Some(e) if e.id == id && e.pending => Some(e.owner),
                _ => None,
            },
            _ => Some(dst),
        };
        if r.is_none() {
            self.counters.tcpmig_refused += 1;
        }
        r
    }
}

// ------------------------------------------------------------------ parties

/// A server application. Both keep every byte inside the stack: echo reads
/// at most the free send-buffer space and writes it back at once; source
/// derives its write offset from the TCP send sequence (which travels in the
/// snapshot), so neither has state outside the connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum App {
    Echo,
    /// Reads (and records in [`World::server_rx`]) whatever the client
    /// sends, and independently sends `len` bytes of `stream(seed)`, then
    /// shuts down its side (possibly before the client does).
    Source {
        seed: u64,
        len: usize,
    },
}

pub struct Server {
    pub index: usize,
    pub addr: Ipv4Addr,
    pub iface: Interface,
    pub tr: Transports,
    /// A dead server is no longer driven: frames to it vanish, its timers
    /// never fire.
    pub alive: bool,
    pub app: App,
    /// Endpoint ids the application serves (accepted or migrated in).
    pub conns: Vec<ConnId>,
    /// Errors seen by the application (anything but WouldBlock).
    pub app_errors: Vec<TcpError>,
    /// The connection as it was exported, for every migration out.
    pub exports: Vec<Exported>,
    /// The application releases a connection once it is closed (reset,
    /// or both sides done), as a real one does (its socket dropped): the
    /// endpoint frees the tuple and the migrator stops serving the flow.
    /// Off by default: the older scenarios check the owner at the end.
    pub release_closed: bool,
    /// Late segments to send on (see [`Server::receive`]).
    forwarded: Vec<Vec<u8>>,
}

/// What an exported connection held (coverage of the property test).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Exported {
    pub state: State,
    /// Sent but unacknowledged bytes.
    pub unacked: u32,
    /// Queued bytes not sent yet.
    pub unsent: usize,
    /// In-order bytes the application has not read.
    pub unread: usize,
    /// Out-of-order data waiting for a hole to fill.
    pub out_of_order: bool,
}

impl Exported {
    fn of(c: &capybara_tcp::Connection) -> Exported {
        let unacked = c.snd.max.0.wrapping_sub(c.snd.una.0).min(c.tx.len() as u32);
        Exported {
            state: c.state,
            unacked,
            unsent: c.tx.len() - unacked as usize,
            unread: c.rx.len(),
            out_of_order: !c.ooo.is_empty(),
        }
    }
}

pub fn server_tcp_config(i: usize) -> TcpConfig {
    let mut c = TcpConfig::default();
    c.isn_key = [0x50 + i as u8; 16];
    c
}

/// Sized like the hostagent binary does: a snapshot holds both TCP queues,
/// and the target buffers up to one receive window of client segments.
pub fn server_mig_config(addr: Ipv4Addr) -> EngineConfig {
    let tcp = TcpConfig::default();
    let mut c = EngineConfig::new(addr, SWITCH);
    c.max_snapshot_bytes = tcp.tx_buffer + tcp.rx_buffer + 4096;
    c.max_buffer_bytes = tcp.rx_buffer;
    c
}

impl Server {
    pub fn new(index: usize, app: App, tcp: TcpConfig, mig: EngineConfig) -> Server {
        let addr = SERVERS[index];
        let mut ic = InterfaceConfig::new(server_mac(index), addr, SWITCH);
        ic.extra_addresses.push(VIP);
        let iface = Interface::new(ic).expect("server interface config");
        let mut endpoint = Endpoint::new(tcp);
        endpoint
            .listen(SocketAddrV4::new(VIP, SERVICE_PORT))
            .expect("listen");
        let mut tr = Transports::new(endpoint, addr);
        tr.vips.insert(SERVICE_PORT, VIP);
        let engine = Engine::new(mig, migration_key()).expect("engine config");
        tr.mig = Some(Migrator::new(engine, addr));
        Server {
            index,
            addr,
            iface,
            tr,
            alive: true,
            app,
            conns: Vec::new(),
            app_errors: Vec::new(),
            exports: Vec::new(),
            release_closed: false,
            forwarded: Vec::new(),
        }
    }

    pub fn migrator(&self) -> &Migrator {
        self.tr.mig.as_ref().expect("servers migrate")
    }
    pub fn migrator_mut(&mut self) -> &mut Migrator {
        self.tr.mig.as_mut().expect("servers migrate")
    }
    pub fn engine(&self) -> &Engine {
        &self.migrator().engine
    }

    /// Serves `flow` (holds its live connection).
    pub fn owns(&self, flow: &FlowKey) -> bool {
        self.migrator().flows().any(|(f, _)| f == flow)
    }

    pub fn migrating(&self) -> bool {
        self.engine().in_progress() != (0, 0)
    }

    /// The connection states the application serves now (to notice exports).
    fn conn_states(&self) -> Vec<(ConnId, Exported)> {
        self.conns
            .iter()
            .filter_map(|&id| Some((id, Exported::of(self.tr.tcp.connection(id)?))))
            .collect()
    }

    /// Records the connections of `before` that an export removed.
    fn note_exports(&mut self, before: Vec<(ConnId, Exported)>) {
        for (id, e) in before {
            if self.tr.tcp.connection(id).is_none() {
                self.exports.push(e);
            }
        }
    }

    /// One frame in. A TCPMig message may export a connection right here
    /// (the stack applies migration events before the next packet).
    fn receive(&mut self, now: Instant, frame: &[u8]) {
        let before = if tcpmig_of(frame).is_some() {
            self.conn_states()
        } else {
            Vec::new()
        };
        self.iface.receive(now, frame, &mut self.tr);
        self.note_exports(before);
        // A late segment sent on to the connection's target, as the
        // hostagent's device wrapper does (stack::Forwarder).
        let target = self.tr.forwarder.borrow_mut().take_pending();
        if let Some(target) = target {
            let mut out = frame.to_vec();
            rewrite_dst(&mut out, target);
            set_macs(&mut out, server_mac(self.index), SWITCH_MAC);
            self.forwarded.push(out);
        }
    }

    /// Events, application and transmission until quiescent at `now`.
    fn run(
        &mut self,
        now: Instant,
        link: &mut Link,
        server_rx: &mut Vec<u8>,
        buf: &mut [u8],
    ) -> bool {
        if !self.alive {
            return false;
        }
        let mut moved = false;
        for f in self.forwarded.drain(..) {
            link.send(now, f);
            moved = true;
        }
        if self.iface.poll_timeout(&self.tr).is_some_and(|t| t <= now) {
            let before = self.conn_states();
            self.iface.handle_timeout(now, &mut self.tr);
            self.note_exports(before);
        }
        for _ in 0..64 {
            let mut any = false;
            let mut woken = Vec::new();
            // Exports happen in `process_events`, on the state as it is now.
            let before = self.conn_states();
            let m = self.tr.mig.as_mut().expect("servers migrate");
            m.process_events(now, &mut self.tr.tcp, &mut woken);
            self.note_exports(before);
            any |= !woken.is_empty();
            while let Some(ev) = self.tr.tcp.poll_event() {
                any = true;
                if let capybara_tcp::Event::Accepted(_) = ev {
                    while let Some(id) = self.tr.tcp.accept() {
                        let m = self.tr.mig.as_mut().expect("servers migrate");
                        if m.take_resumed(id).is_none() {
                            if let Some(flow) = self.tr.tcp.flow_key(id) {
                                m.track(flow, id);
                            }
                        }
                        self.conns.push(id);
                    }
                }
            }
            any |= self.serve(server_rx, buf);
            moved |= any;
            if !any {
                break;
            }
        }
        while let Some(n) = self.iface.transmit(now, buf, &mut self.tr) {
            link.send(now, buf[..n].to_vec());
            moved = true;
        }
        moved
    }

    /// Runs the application on every connection; true if it moved bytes.
    fn serve(&mut self, server_rx: &mut Vec<u8>, buf: &mut [u8]) -> bool {
        let mut moved = false;
        let tcp = &mut self.tr.tcp;
        if self.release_closed {
            let mig = self.tr.mig.as_mut().expect("servers migrate");
            self.conns.retain(|&id| {
                if tcp.state(id) != Some(State::Closed) {
                    return true;
                }
                let flow = tcp.flow_key(id);
                let _ = tcp.close(id);
                mig.untrack(flow, id);
                false
            });
        }
        self.conns.retain(|&id| tcp.connection(id).is_some());
        for &id in &self.conns {
            let Some(c) = tcp.connection(id) else {
                continue;
            };
            let can_send = matches!(c.state, State::Established | State::CloseWait);
            match self.app {
                App::Echo => loop {
                    let Some(c) = tcp.connection(id) else { break };
                    let eof = c.rcv.fin_received && c.rx.is_empty();
                    if eof {
                        if can_send {
                            let _ = tcp.shutdown(id);
                            moved = true;
                        }
                        break;
                    }
                    let cap = if can_send {
                        c.tx.free().min(buf.len())
                    } else {
                        0
                    };
                    if cap == 0 {
                        break;
                    }
                    match tcp.recv(id, &mut buf[..cap]) {
                        Ok(0) => {
                            if can_send {
                                let _ = tcp.shutdown(id);
                            }
                            break;
                        }
                        Ok(n) => {
                            let w = tcp.send(id, &buf[..n]);
                            assert_eq!(
                                w,
                                Ok(n),
                                "echo: send capacity only grows between recv and send"
                            );
                            moved = true;
                        }
                        Err(TcpError::WouldBlock) => break,
                        Err(e) => {
                            self.app_errors.push(e);
                            break;
                        }
                    }
                },
                App::Source { seed, len } => {
                    loop {
                        match tcp.recv(id, buf) {
                            Ok(0) => break,
                            Ok(n) => {
                                server_rx.extend_from_slice(&buf[..n]);
                                moved = true;
                            }
                            Err(TcpError::WouldBlock) => break,
                            Err(e) => {
                                self.app_errors.push(e);
                                break;
                            }
                        }
                    }
                    let Some(c) = tcp.connection(id) else {
                        continue;
                    };
                    if !can_send {
                        continue;
                    }
                    // Bytes written so far = acknowledged + queued: all in the
                    // TCP state, so the target knows it after an import.
                    let acked = c.snd.una.0.wrapping_sub(c.snd.iss.0).wrapping_sub(1) as usize;
                    let written = acked + c.tx.len();
                    if written < len {
                        let n = (len - written).min(c.tx.free()).min(buf.len());
                        if n > 0 {
                            for (k, b) in buf[..n].iter_mut().enumerate() {
                                *b = stream_byte(seed, (written + k) as u64);
                            }
                            let w = tcp.send(id, &buf[..n]);
                            assert_eq!(w, Ok(n));
                            moved = true;
                        }
                    } else {
                        // Done writing: close our side whatever the client
                        // still sends (both directions are independent).
                        let _ = tcp.shutdown(id);
                        moved = true;
                    }
                }
            }
        }
        moved
    }
}

pub struct Client {
    pub iface: Interface,
    pub tr: Transports,
    pub conn: Option<ConnId>,
    pub to_send: Vec<u8>,
    pub sent: usize,
    pub received: Vec<u8>,
    pub eof: bool,
    pub error: Option<TcpError>,
    /// Keeps the connection open once everything was sent (more may be
    /// appended to `to_send`); otherwise the client shuts down its side.
    pub hold_open: bool,
    /// Local port of the next connection (0: an ephemeral one).
    pub port: u16,
    /// [`Client::reset_and_reconnect`] reset the connection: the next one
    /// opens once its RST left (the stack frees the tuple then).
    reconnecting: bool,
}

pub fn client_tcp_config() -> TcpConfig {
    let mut c = TcpConfig::default();
    c.isn_key = [0x11; 16];
    c
}

impl Client {
    pub fn new(tcp: TcpConfig, to_send: Vec<u8>) -> Client {
        let ic = InterfaceConfig::new(CLIENT_MAC, CLIENT, CLIENT_GW);
        let iface = Interface::new(ic).expect("client interface config");
        let tr = Transports::new(Endpoint::new(tcp), CLIENT);
        Client {
            iface,
            tr,
            conn: None,
            to_send,
            sent: 0,
            received: Vec::new(),
            eof: false,
            error: None,
            hold_open: false,
            port: 0,
            reconnecting: false,
        }
    }

    /// Resets the connection (RST) and opens a new one from the same local
    /// port at once, as Linux allows (`SO_LINGER` 0, then `bind` +
    /// `connect`), sending `to_send` on it.
    pub fn reset_and_reconnect(&mut self, to_send: Vec<u8>) {
        let id = self.conn.take().expect("connected");
        self.port = self.tr.tcp.local_addr(id).expect("local address").port();
        self.tr.tcp.abort(id).expect("abort");
        self.reconnecting = true;
        self.to_send = to_send;
        self.sent = 0;
        self.received.clear();
        self.eof = false;
        self.error = None;
    }

    pub fn flow(&self) -> Option<FlowKey> {
        let id = self.conn?;
        let local = self.tr.tcp.local_addr(id)?;
        Some(FlowKey {
            client_ip: *local.ip(),
            client_port: local.port(),
            service_ip: VIP,
            service_port: SERVICE_PORT,
        })
    }

    /// The connection failed, or both directions completed: the server's
    /// FIN was read and ours was acknowledged (so was all our data).
    pub fn done(&self) -> bool {
        let fin_acked = self
            .conn
            .and_then(|id| self.tr.tcp.state(id))
            .is_some_and(|s| matches!(s, State::FinWait2 | State::TimeWait | State::Closed));
        self.error.is_some() || (self.eof && fin_acked)
    }

    fn run(&mut self, now: Instant, link: &mut Link, buf: &mut [u8]) -> bool {
        let mut moved = false;
        if self.conn.is_none() {
            match self.tr.tcp.connect(
                now,
                SocketAddrV4::new(CLIENT, self.port),
                SocketAddrV4::new(VIP, SERVICE_PORT),
            ) {
                Ok(id) => {
                    self.conn = Some(id);
                    self.reconnecting = false;
                    moved = true;
                }
                // The reset connection holds the tuple until its RST left.
                Err(TcpError::AddrInUse) if self.reconnecting => {}
                Err(e) => panic!("connect: {e:?}"),
            }
        }
        if self.iface.poll_timeout(&self.tr).is_some_and(|t| t <= now) {
            self.iface.handle_timeout(now, &mut self.tr);
        }
        while self.tr.tcp.poll_event().is_some() {}
        // No connection while a reset one's RST waits to leave (below).
        while let Some(id) = self.conn {
            let mut any = false;
            let state = self.tr.tcp.state(id);
            if matches!(state, Some(State::Established | State::CloseWait)) {
                if self.sent < self.to_send.len() {
                    if let Ok(n) = self.tr.tcp.send(id, &self.to_send[self.sent..]) {
                        self.sent += n;
                        any |= n > 0;
                    }
                }
                if self.sent == self.to_send.len() && !self.hold_open {
                    let _ = self.tr.tcp.shutdown(id);
                }
            }
            if !self.eof && self.error.is_none() {
                match self.tr.tcp.recv(id, buf) {
                    Ok(0) => {
                        self.eof = true;
                        any = true;
                    }
                    Ok(n) => {
                        self.received.extend_from_slice(&buf[..n]);
                        any = true;
                    }
                    Err(TcpError::WouldBlock | TcpError::NotConnected) => {}
                    Err(e) => {
                        self.error = Some(e);
                        any = true;
                    }
                }
            }
            moved |= any;
            if !any {
                break;
            }
        }
        while let Some(n) = self.iface.transmit(now, buf, &mut self.tr) {
            link.send(now, buf[..n].to_vec());
            moved = true;
        }
        moved
    }
}

// ------------------------------------------------------------------ the world

/// Per-direction link settings of a world.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Net {
    pub client_up: LinkConfig,
    pub client_down: LinkConfig,
    pub server_up: LinkConfig,
    pub server_down: LinkConfig,
}

impl Net {
    /// The same link in every direction.
    pub fn every_way(l: LinkConfig) -> Net {
        Net {
            client_up: l,
            client_down: l,
            server_up: l,
            server_down: l,
        }
    }
    pub fn clean() -> Net {
        Net::every_way(LinkConfig::default())
    }
    /// The same TCP and TCPMig faults on every link direction.
    pub fn faulty(tcp: Faults, tcpmig: Faults) -> Net {
        Net::every_way(LinkConfig {
            tcp,
            tcpmig,
            ..LinkConfig::default()
        })
    }
}

pub struct World {
    pub now: Instant,
    pub client: Client,
    pub servers: Vec<Server>,
    pub switch: Switch,
    /// Toward the switch: `[client, server 0, server 1]`.
    pub up: Vec<Link>,
    /// From the switch: `[client, server 0, server 1]`.
    pub down: Vec<Link>,
    /// Everything the server applications read, in order (Source app).
    pub server_rx: Vec<u8>,
    /// Migrations started through [`World::migrate`].
    pub started: Vec<(Instant, usize, MigrationId)>,
    buf: Vec<u8>,
}

#[derive(Debug, Clone, Copy)]
pub struct Setup {
    pub seed: u64,
    pub app: App,
    pub net: Net,
}

impl World {
    pub fn new(setup: Setup, to_send: Vec<u8>) -> World {
        World::with(
            setup,
            to_send,
            client_tcp_config(),
            server_tcp_config,
            server_mig_config,
        )
    }

    pub fn with(
        setup: Setup,
        to_send: Vec<u8>,
        client_tcp: TcpConfig,
        server_tcp: impl Fn(usize) -> TcpConfig,
        server_mig: impl Fn(Ipv4Addr) -> EngineConfig,
    ) -> World {
        let servers = (0..SERVERS.len())
            .map(|i| Server::new(i, setup.app, server_tcp(i), server_mig(SERVERS[i])))
            .collect();
        let s = setup.seed.wrapping_mul(0x1000_0000_01b3);
        let n = setup.net;
        World {
            now: Instant::ZERO,
            client: Client::new(client_tcp, to_send),
            servers,
            switch: Switch::new(),
            up: vec![
                Link::new(n.client_up, s ^ 1),
                Link::new(n.server_up, s ^ 2),
                Link::new(n.server_up, s ^ 3),
            ],
            down: vec![
                Link::new(n.client_down, s ^ 4),
                Link::new(n.server_down, s ^ 5),
                Link::new(n.server_down, s ^ 6),
            ],
            server_rx: Vec::new(),
            started: Vec::new(),
            buf: vec![0u8; FRAME],
        }
    }

    pub fn flow(&self) -> Option<FlowKey> {
        self.client.flow()
    }

    /// Everything due at `now`, repeated until nothing moves.
    fn settle_instant(&mut self) {
        for _round in 0..10_000 {
            let mut moved = false;
            for i in 0..self.up.len() {
                while let Some(f) = self.up[i].pop_due(self.now) {
                    moved = true;
                    let from = if i == 0 {
                        Port::Client
                    } else {
                        Port::Server(i - 1)
                    };
                    for (port, out) in self.switch.process(self.now, from, &f) {
                        let j = match port {
                            Port::Client => 0,
                            Port::Server(k) => k + 1,
                        };
                        self.down[j].send(self.now, out);
                    }
                }
            }
            for i in 0..self.down.len() {
                while let Some(f) = self.down[i].pop_due(self.now) {
                    moved = true;
                    if i == 0 {
                        self.client.iface.receive(self.now, &f, &mut self.client.tr);
                    } else if self.servers[i - 1].alive {
                        self.servers[i - 1].receive(self.now, &f);
                    }
                }
            }
            moved |= self.client.run(self.now, &mut self.up[0], &mut self.buf);
            for (k, s) in self.servers.iter_mut().enumerate() {
                moved |= s.run(
                    self.now,
                    &mut self.up[k + 1],
                    &mut self.server_rx,
                    &mut self.buf,
                );
            }
            if !moved {
                return;
            }
        }
        panic!("no quiescence at {}", self.now);
    }

    fn next_deadline(&self) -> Option<Instant> {
        let links = self.up.iter().chain(&self.down).filter_map(Link::next_time);
        let client = self.client.iface.poll_timeout(&self.client.tr);
        let servers = self
            .servers
            .iter()
            .filter(|s| s.alive)
            .filter_map(|s| s.iface.poll_timeout(&s.tr));
        links.chain(client).chain(servers).min()
    }

    /// Runs until `stop` holds (checked after every instant) or virtual time
    /// would pass `limit`. Returns whether `stop` held.
    pub fn run_until(&mut self, limit: Instant, mut stop: impl FnMut(&World) -> bool) -> bool {
        loop {
            self.settle_instant();
            if stop(self) {
                return true;
            }
            let next = match self.next_deadline() {
                Some(t) => t.max(self.now + Duration::from_micros(1)),
                None => return false,
            };
            if next > limit {
                self.now = limit.max(self.now);
                return false;
            }
            self.now = next;
        }
    }

    /// Runs `d` of virtual time.
    pub fn run_for(&mut self, d: Duration) {
        let end = self.now + d;
        self.run_until(end, |_| false);
        self.now = end;
        self.settle_instant();
    }

    /// Index of the server that serves the flow now (not frozen).
    pub fn owners(&self) -> Vec<usize> {
        let Some(flow) = self.flow() else {
            return Vec::new();
        };
        self.servers
            .iter()
            .filter(|s| s.alive && s.owns(&flow))
            .map(|s| s.index)
            .collect()
    }

    pub fn any_migrating(&self) -> bool {
        self.servers.iter().any(|s| s.alive && s.migrating())
    }

    /// Whether a live server serves a connection in `state`.
    pub fn serving_in(&self, state: capybara_tcp::State) -> bool {
        self.servers
            .iter()
            .any(|s| s.alive && s.conns.iter().any(|&id| s.tr.tcp.state(id) == Some(state)))
    }

    /// Starts migrating the flow from its current owner to the other server
    /// (`explicit`: the PREPARE names it; else the switch picks).
    pub fn migrate(&mut self, explicit: bool) -> Result<MigrationId, String> {
        let flow = self.flow().ok_or("no connection yet")?;
        let owners = self.owners();
        let [from] = owners[..] else {
            return Err(format!("owners {owners:?}"));
        };
        let to = SERVERS[1 - from];
        let now = self.now;
        let id = self.servers[from]
            .migrator_mut()
            .migrate(now, flow, explicit.then_some(to))?;
        self.started.push((now, from, id));
        // Let the PREPARE leave now.
        self.settle_instant();
        Ok(id)
    }

    /// Outcomes recorded by every server's migrator.
    pub fn outcomes(&self) -> Vec<(usize, MigrationId, Outcome)> {
        let mut v = Vec::new();
        for s in &self.servers {
            for r in s.migrator().recent() {
                v.push((s.index, r.id, r.outcome));
            }
        }
        v
    }

    /// Runs until the client's stream ended and no migration is in
    /// progress, then a little longer so the closing handshake completes.
    pub fn finish(&mut self, limit: Instant) -> bool {
        let ok = self.run_until(limit, |w| w.client.done() && !w.any_migrating());
        if ok {
            self.run_for(Duration::from_millis(500));
        }
        ok
    }

    /// The invariants every run must end with: exactly one live server
    /// serves the flow, nothing is frozen, and the switch sends the flow to
    /// it with a final migration-table entry.
    pub fn assert_single_owner(&self) {
        let flow = self.flow().expect("connected");
        let owners = self.owners();
        assert_eq!(owners.len(), 1, "owners {owners:?}; {}", self.describe());
        let owner = SERVERS[owners[0]];
        assert_eq!(
            self.switch.owner(&flow),
            Some(owner),
            "switch disagrees; {}",
            self.describe()
        );
        // No stale copy anywhere: the other server holds no TCP state of it.
        for s in self.servers.iter().filter(|s| s.index != owners[0]) {
            let copies =
                s.tr.tcp
                    .connections()
                    .filter(|(_, c)| c.remote.port() == flow.client_port)
                    .count();
            assert_eq!(
                copies,
                0,
                "server {} still has the connection; {}",
                s.index,
                self.describe()
            );
        }
        if let Some(e) = self.switch.migration.get(&flow) {
            assert!(
                !e.pending,
                "entry still pending: {e:?}; {}",
                self.describe()
            );
        }
        assert!(
            !self.any_migrating(),
            "migration still in progress; {}",
            self.describe()
        );
    }

    /// One line of state for assertion messages.
    pub fn describe(&self) -> String {
        let flow = self.flow();
        format!(
            "t={} sent={}/{} rx={} eof={} err={:?} owners={:?} entry={:?} switch={:?} outcomes={:?} app_errors={:?} resets={:?} table(last 20)={:?} tcpmig(last 40)={:?}",
            self.now,
            self.client.sent,
            self.client.to_send.len(),
            self.client.received.len(),
            self.client.eof,
            self.client.error,
            self.owners(),
            flow.and_then(|f| self.switch.migration.get(&f).copied()),
            self.switch.counters,
            self.outcomes(),
            self.servers.iter().map(|s| s.app_errors.clone()).collect::<Vec<_>>(),
            self.switch.resets,
            last(&self.switch.table_log, 20).iter().map(|(t, k, id, b, a)| format!("{t} {k:?} {id:x}: {b:?} -> {a:?}")).collect::<Vec<_>>(),
            last(&self.switch.mig_log, 40).iter().map(|(t, k, id, s, d, to)| format!("{t} {k:?} {id:x} {s}->{d} => {to:?}")).collect::<Vec<_>>(),
        )
    }
}

fn last<T>(v: &[T], n: usize) -> &[T] {
    &v[v.len().saturating_sub(n)..]
}

/// The CPU-measuring tests' world: one client streaming a 256 MiB echo
/// (seed 5) with `queue`-byte TCP buffers on every side, 100 µs links.
#[allow(dead_code)] // not every test binary that includes `common` uses it
pub fn echo_world_with_queues(queue: usize) -> World {
    let sized = |mut c: TcpConfig| {
        c.rx_buffer = queue;
        c.tx_buffer = queue;
        c
    };
    let link = LinkConfig {
        latency: Duration::from_micros(100),
        ..LinkConfig::default()
    };
    let setup = Setup {
        seed: 5,
        app: App::Echo,
        net: Net::every_way(link),
    };
    World::with(
        setup,
        stream(5, 256 << 20),
        sized(client_tcp_config()),
        |i| sized(server_tcp_config(i)),
        server_mig_config,
    )
}
