//! The network interface: Ethernet + ARP + IPv4 + ICMP echo, sans-IO.
//!
//! `Interface` takes received frames with `receive(now, frame, transport)` and
//! fills transmit buffers with `transmit(now, buf, transport)`; it never
//! reads a clock or touches a device. TCP and UDP payloads go to a
//! [`Transport`], which writes its segments straight into the device's
//! transmit buffer behind the room reserved for the Ethernet and IPv4
//! headers (the interface fills those in afterwards: zero copy).
//!
//! Invariants:
//! - No input frame can cause a panic; every frame that is not consumed is
//!   counted under exactly one [`DropReason`].
//! - The receive and transmit paths allocate nothing: the ARP cache, the
//!   control-frame queue (ARP and ICMP replies) and the slots for packets
//!   parked while their next hop is resolved are sized at construction.
//! - Every transmitted IPv4 packet has one of our addresses as its source
//!   (the data address or a configured extra address such as a VIP).
//! - The gateway always has an ARP cache entry; it is resolved eagerly (the
//!   first `transmit` call sends the request) and retried forever, because
//!   without it nothing leaves the host.

use crate::wire::{
    arp, ethernet, ipv4, ArpOperation, ArpPacket, ArpRepr, EtherType, EthernetAddress,
    EthernetFrame, EthernetRepr, Icmpv4Packet, Icmpv4Repr, Ipv4Packet, Ipv4Repr, Protocol,
    WireError,
};
use capybara_proto::time::{Duration, Instant};
use std::net::Ipv4Addr;

/// Bytes a transport must leave in front of its segment in a transmit
/// buffer: Ethernet and option-less IPv4 headers.
pub const HEADER_ROOM: usize = ethernet::HEADER_LEN + ipv4::HEADER_LEN;

/// The layer above IP: the TCP engine (through an adapter) or a UDP handler.
pub trait Transport {
    /// A verified, unfragmented IPv4 payload of protocol 6 or 17 addressed to
    /// one of our addresses. `payload` excludes the IPv4 header and any
    /// link padding; its transport checksum is not verified yet.
    fn handle_ipv4(
        &mut self,
        now: Instant,
        src: Ipv4Addr,
        dst: Ipv4Addr,
        protocol: u8,
        payload: &[u8],
    );
    /// Writes one IPv4 payload (a complete TCP or UDP segment, checksum
    /// included) at the start of `buf` and describes it; `None` if nothing
    /// is ready. `buf.len()` is the room left by the MTU.
    fn poll_ipv4(&mut self, now: Instant, buf: &mut [u8]) -> Option<Ipv4Out>;
    /// The earliest time `handle_timeout` should be called.
    fn poll_timeout(&self) -> Option<Instant>;
    fn handle_timeout(&mut self, now: Instant);
}

/// What a transport wrote in `poll_ipv4`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ipv4Out {
    pub src: Ipv4Addr,
    pub dst: Ipv4Addr,
    pub protocol: u8,
    /// Bytes written at the start of the buffer.
    pub len: usize,
}

/// A transport that accepts nothing and sends nothing: an interface that
/// only answers ARP and ping.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoTransport;

impl Transport for NoTransport {
    fn handle_ipv4(&mut self, _: Instant, _: Ipv4Addr, _: Ipv4Addr, _: u8, _: &[u8]) {}
    fn poll_ipv4(&mut self, _: Instant, _: &mut [u8]) -> Option<Ipv4Out> {
        None
    }
    fn poll_timeout(&self) -> Option<Instant> {
        None
    }
    fn handle_timeout(&mut self, _: Instant) {}
}

/// ARP cache and resolution settings.
#[derive(Debug, Clone)]
pub struct ArpConfig {
    /// Entries in the cache, the gateway's included (at least 1).
    pub cache_size: usize,
    /// How long a learned mapping is used without confirmation. A refresh
    /// request goes out at three quarters of it, while the mapping stays in use.
    pub reachable_time: Duration,
    /// Interval between requests for an unresolved address.
    pub retry_interval: Duration,
    /// Requests sent for an address other than the gateway before giving up.
    pub max_requests: u32,
    /// Outgoing packets held while their next hop is resolved (beyond this,
    /// they are dropped and counted).
    pub parked_slots: usize,
    /// How long a parked packet waits for resolution before being dropped.
    pub parked_timeout: Duration,
}

impl Default for ArpConfig {
    fn default() -> Self {
        ArpConfig {
            cache_size: 16,
            reachable_time: Duration::from_secs(60),
            retry_interval: Duration::from_secs(1),
            max_requests: 3,
            parked_slots: 8,
            parked_timeout: Duration::from_secs(3),
        }
    }
}

/// Static configuration of an interface.
#[derive(Debug, Clone)]
pub struct InterfaceConfig {
    pub mac: EthernetAddress,
    /// The data address, owned by this stack (never by the kernel).
    pub address: Ipv4Addr,
    /// Further addresses accepted as destination and usable as source
    /// (service VIPs: the stack answers clients from the VIP).
    pub extra_addresses: Vec<Ipv4Addr>,
    /// Answer ARP for `extra_addresses` too. Off by default: the switch owns
    /// the VIPs on the wire and rewrites them to our data address.
    pub answer_arp_for_extra: bool,
    /// Next hop for every destination outside `on_link`.
    pub gateway: Ipv4Addr,
    /// Prefix reached directly (ARP for the destination itself); `None`
    /// sends everything through the gateway.
    pub on_link: Option<(Ipv4Addr, u8)>,
    /// IP MTU (bytes of IPv4 header + payload per frame).
    pub mtu: usize,
    pub ttl: u8,
    /// Pre-built ARP and ICMP replies waiting for a transmit buffer.
    pub control_queue: usize,
    pub arp: ArpConfig,
}

impl InterfaceConfig {
    pub fn new(mac: EthernetAddress, address: Ipv4Addr, gateway: Ipv4Addr) -> Self {
        InterfaceConfig {
            mac,
            address,
            extra_addresses: Vec::new(),
            answer_arp_for_extra: false,
            gateway,
            on_link: None,
            mtu: 1500,
            ttl: 64,
            control_queue: 16,
            arp: ArpConfig::default(),
        }
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        if !self.mac.is_unicast() {
            return Err(ConfigError::Mac(self.mac));
        }
        for a in std::iter::once(&self.address).chain(&self.extra_addresses) {
            if !is_unicast_ip(*a) {
                return Err(ConfigError::Address(*a));
            }
        }
        if !is_unicast_ip(self.gateway) {
            return Err(ConfigError::Address(self.gateway));
        }
        if !(68..=9000).contains(&self.mtu) {
            return Err(ConfigError::Mtu(self.mtu));
        }
        if let Some((_, len)) = self.on_link {
            if len > 32 {
                return Err(ConfigError::Prefix(len));
            }
        }
        if self.ttl == 0 {
            return Err(ConfigError::Ttl);
        }
        if self.arp.cache_size == 0 || self.control_queue == 0 {
            return Err(ConfigError::ZeroCapacity);
        }
        Ok(())
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("interface MAC {0} is not a unicast address")]
    Mac(EthernetAddress),
    #[error("address {0} is not a unicast IPv4 address")]
    Address(Ipv4Addr),
    #[error("MTU {0} outside 68..=9000")]
    Mtu(usize),
    #[error("prefix length {0} above 32")]
    Prefix(u8),
    #[error("TTL must be at least 1")]
    Ttl,
    #[error("ARP cache and control queue need at least one slot")]
    ZeroCapacity,
}

fn is_unicast_ip(a: Ipv4Addr) -> bool {
    !(a.is_unspecified() || a.is_broadcast() || a.is_multicast())
}

/// Why a received frame or an outgoing packet was not delivered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(usize)]
pub enum DropReason {
    /// Shorter than an Ethernet header.
    EthernetTruncated,
    /// Destination MAC is neither ours nor broadcast.
    NotOurMac,
    /// Source MAC is multicast or zero.
    BadSourceMac,
    /// Neither IPv4 nor ARP (VLAN tags land here too).
    UnknownEthertype,
    /// ARP too short or not IPv4-over-Ethernet.
    ArpMalformed,
    /// IPv4 header lengths or version invalid.
    Ipv4Malformed,
    Ipv4Checksum,
    /// Fragments are not reassembled.
    Ipv4Fragment,
    /// Destination is not one of our addresses.
    NotOurAddress,
    /// Source is unspecified, broadcast or multicast.
    BadSourceAddress,
    /// IP protocol other than ICMP, TCP, UDP.
    UnknownProtocol,
    IcmpMalformed,
    IcmpChecksum,
    /// ICMP other than echo.
    IcmpUnsupported,
    /// No free slot for an ARP or ICMP reply.
    ControlQueueFull,
    /// Transport wrote a packet that does not fit or has an invalid length.
    TransportBadLength,
    /// Transport used a source address that is not ours.
    TransportBadSource,
    /// No slot to park a packet waiting for ARP resolution.
    ParkedFull,
    /// Parked packet waited longer than `parked_timeout`.
    ParkedTimeout,
    /// Next hop did not answer `max_requests` ARP requests.
    NeighborUnreachable,
    /// Transmit buffer smaller than the frame.
    TxBufferTooSmall,
}

impl DropReason {
    pub const COUNT: usize = 21;
    pub const ALL: [DropReason; Self::COUNT] = [
        DropReason::EthernetTruncated,
        DropReason::NotOurMac,
        DropReason::BadSourceMac,
        DropReason::UnknownEthertype,
        DropReason::ArpMalformed,
        DropReason::Ipv4Malformed,
        DropReason::Ipv4Checksum,
        DropReason::Ipv4Fragment,
        DropReason::NotOurAddress,
        DropReason::BadSourceAddress,
        DropReason::UnknownProtocol,
        DropReason::IcmpMalformed,
        DropReason::IcmpChecksum,
        DropReason::IcmpUnsupported,
        DropReason::ControlQueueFull,
        DropReason::TransportBadLength,
        DropReason::TransportBadSource,
        DropReason::ParkedFull,
        DropReason::ParkedTimeout,
        DropReason::NeighborUnreachable,
        DropReason::TxBufferTooSmall,
    ];

    /// Stable snake_case name for metrics labels.
    pub fn as_str(self) -> &'static str {
        match self {
            DropReason::EthernetTruncated => "ethernet_truncated",
            DropReason::NotOurMac => "not_our_mac",
            DropReason::BadSourceMac => "bad_source_mac",
            DropReason::UnknownEthertype => "unknown_ethertype",
            DropReason::ArpMalformed => "arp_malformed",
            DropReason::Ipv4Malformed => "ipv4_malformed",
            DropReason::Ipv4Checksum => "ipv4_checksum",
            DropReason::Ipv4Fragment => "ipv4_fragment",
            DropReason::NotOurAddress => "not_our_address",
            DropReason::BadSourceAddress => "bad_source_address",
            DropReason::UnknownProtocol => "unknown_protocol",
            DropReason::IcmpMalformed => "icmp_malformed",
            DropReason::IcmpChecksum => "icmp_checksum",
            DropReason::IcmpUnsupported => "icmp_unsupported",
            DropReason::ControlQueueFull => "control_queue_full",
            DropReason::TransportBadLength => "transport_bad_length",
            DropReason::TransportBadSource => "transport_bad_source",
            DropReason::ParkedFull => "parked_full",
            DropReason::ParkedTimeout => "parked_timeout",
            DropReason::NeighborUnreachable => "neighbor_unreachable",
            DropReason::TxBufferTooSmall => "tx_buffer_too_small",
        }
    }
}

/// Interface counters. Plain integers: one interface is driven by one thread.
#[derive(Debug, Clone, Default)]
pub struct Counters {
    pub rx_frames: u64,
    pub rx_bytes: u64,
    pub tx_frames: u64,
    pub tx_bytes: u64,
    pub arp_requests_rx: u64,
    pub arp_replies_rx: u64,
    pub arp_requests_tx: u64,
    pub arp_replies_tx: u64,
    /// ARP packets about other hosts (ignored, not an error).
    pub arp_ignored: u64,
    pub icmp_echo_requests_rx: u64,
    pub icmp_echo_replies_tx: u64,
    pub icmp_echo_replies_rx: u64,
    /// TCP/UDP payloads handed to the transport.
    pub ipv4_delivered: u64,
    /// Transport packets sent.
    pub ipv4_sent: u64,
    drops: [u64; DropReason::COUNT],
}

impl Counters {
    pub fn drops(&self, reason: DropReason) -> u64 {
        self.drops[reason as usize]
    }
    pub fn total_drops(&self) -> u64 {
        self.drops.iter().sum()
    }
    /// Every reason with its count, for metrics export.
    pub fn drop_counts(&self) -> impl Iterator<Item = (DropReason, u64)> + '_ {
        DropReason::ALL
            .iter()
            .map(move |r| (*r, self.drops[*r as usize]))
    }
    fn drop(&mut self, reason: DropReason) {
        self.drops[reason as usize] += 1;
    }
}

#[derive(Debug, Clone, Copy)]
enum NeighborState {
    /// Requests are out; `sent` so far.
    Incomplete { next_request_at: Instant, sent: u32 },
    /// Usable mapping. A refresh request goes out at `refresh_at`; the
    /// mapping turns `Incomplete` at `expires_at` unless confirmed.
    Reachable {
        mac: EthernetAddress,
        refresh_at: Instant,
        expires_at: Instant,
        refresh_sent: bool,
    },
}

#[derive(Debug, Clone, Copy)]
struct Neighbor {
    ip: Ipv4Addr,
    state: NeighborState,
    last_used: Instant,
}

/// A preallocated frame buffer (control replies, parked packets).
#[derive(Debug)]
struct Slot {
    buf: Box<[u8]>,
    len: usize,
    /// For parked packets: next hop and drop deadline.
    next_hop: Ipv4Addr,
    deadline: Instant,
}

/// See the module documentation.
#[derive(Debug)]
pub struct Interface {
    config: InterfaceConfig,
    neighbors: Vec<Neighbor>,
    /// Ring of ready frames (ARP/ICMP replies): `control[(head + i) % n]`
    /// for `i < control_len`.
    control: Vec<Slot>,
    control_head: usize,
    control_len: usize,
    /// Packets waiting for ARP; `len == 0` marks a free slot.
    parked: Vec<Slot>,
    parked_count: usize,
    next_ident: u16,
    counters: Counters,
}

impl Interface {
    pub fn new(config: InterfaceConfig) -> Result<Self, ConfigError> {
        config.validate()?;
        let frame_len = ethernet::HEADER_LEN + config.mtu;
        let slot = |_| Slot {
            buf: vec![0u8; frame_len].into_boxed_slice(),
            len: 0,
            next_hop: Ipv4Addr::UNSPECIFIED,
            deadline: Instant::ZERO,
        };
        let mut neighbors = Vec::with_capacity(config.arp.cache_size);
        neighbors.push(Neighbor {
            ip: config.gateway,
            state: NeighborState::Incomplete {
                next_request_at: Instant::ZERO,
                sent: 0,
            },
            last_used: Instant::ZERO,
        });
        Ok(Interface {
            control: (0..config.control_queue).map(slot).collect(),
            parked: (0..config.arp.parked_slots).map(slot).collect(),
            neighbors,
            control_head: 0,
            control_len: 0,
            parked_count: 0,
            next_ident: 0,
            counters: Counters::default(),
            config,
        })
    }

    pub fn config(&self) -> &InterfaceConfig {
        &self.config
    }
    pub fn counters(&self) -> &Counters {
        &self.counters
    }
    pub fn mac(&self) -> EthernetAddress {
        self.config.mac
    }

    /// Accepts `addr` as a local address (e.g. a VIP added at run time).
    /// Allocates; not for the packet path.
    pub fn add_address(&mut self, addr: Ipv4Addr) -> Result<(), ConfigError> {
        if !is_unicast_ip(addr) {
            return Err(ConfigError::Address(addr));
        }
        if !self.has_address(addr) {
            self.config.extra_addresses.push(addr);
        }
        Ok(())
    }
    pub fn remove_address(&mut self, addr: Ipv4Addr) {
        self.config.extra_addresses.retain(|a| *a != addr);
    }

    pub fn has_address(&self, addr: Ipv4Addr) -> bool {
        addr == self.config.address || self.config.extra_addresses.contains(&addr)
    }

    fn answers_arp_for(&self, addr: Ipv4Addr) -> bool {
        addr == self.config.address
            || (self.config.answer_arp_for_extra && self.config.extra_addresses.contains(&addr))
    }

    /// The resolved MAC of `ip`, if the cache has a usable mapping.
    pub fn neighbor(&self, ip: Ipv4Addr) -> Option<EthernetAddress> {
        self.neighbors
            .iter()
            .find(|n| n.ip == ip)
            .and_then(|n| match n.state {
                NeighborState::Reachable { mac, .. } => Some(mac),
                NeighborState::Incomplete { .. } => None,
            })
    }

    /// The next hop for `dst`: itself if on-link, else the gateway.
    pub fn route(&self, dst: Ipv4Addr) -> Ipv4Addr {
        match self.config.on_link {
            Some((net, len)) if len > 0 => {
                let mask = u32::MAX << (32 - u32::from(len));
                if u32::from(dst) & mask == u32::from(net) & mask {
                    dst
                } else {
                    self.config.gateway
                }
            }
            Some((_, 0)) => dst,
            _ => self.config.gateway,
        }
    }

    // ---------------------------------------------------------------- receive

    /// Processes one received frame (borrowed from the device's ring).
    pub fn receive<T: Transport + ?Sized>(
        &mut self,
        now: Instant,
        frame: &[u8],
        transport: &mut T,
    ) {
        self.counters.rx_frames += 1;
        self.counters.rx_bytes += frame.len() as u64;
        let eth = match EthernetFrame::new_checked(frame) {
            Ok(f) => f,
            Err(_) => return self.counters.drop(DropReason::EthernetTruncated),
        };
        let dst = eth.dst_addr();
        if dst != self.config.mac && !dst.is_broadcast() {
            return self.counters.drop(DropReason::NotOurMac);
        }
        let src_mac = eth.src_addr();
        if !src_mac.is_unicast() {
            return self.counters.drop(DropReason::BadSourceMac);
        }
        match eth.ethertype() {
            EtherType::Arp => self.receive_arp(now, eth.payload()),
            // IPv4 sent to the broadcast MAC is not for a unicast-only host.
            EtherType::Ipv4 if dst.is_broadcast() => self.counters.drop(DropReason::NotOurAddress),
            EtherType::Ipv4 => self.receive_ipv4(now, src_mac, eth.payload(), transport),
            EtherType::Unknown(_) => self.counters.drop(DropReason::UnknownEthertype),
        }
    }

    fn receive_arp(&mut self, now: Instant, bytes: &[u8]) {
        let repr = match ArpPacket::new_checked(bytes).and_then(|p| ArpRepr::parse(&p)) {
            Ok(r) => r,
            Err(_) => return self.counters.drop(DropReason::ArpMalformed),
        };
        match repr.operation {
            ArpOperation::Request => self.counters.arp_requests_rx += 1,
            _ => self.counters.arp_replies_rx += 1,
        }
        let sender_ok =
            repr.source_hardware_addr.is_unicast() && is_unicast_ip(repr.source_protocol_addr);
        // RFC 826 merge: refresh a mapping we already track (this is how an
        // outstanding request completes), whoever the packet was for.
        let merged = sender_ok
            && self.confirm_neighbor(now, repr.source_protocol_addr, repr.source_hardware_addr);
        if !self.answers_arp_for(repr.target_protocol_addr) {
            self.counters.arp_ignored += 1;
            return;
        }
        if sender_ok && !merged && repr.operation == ArpOperation::Request {
            // The sender is about to talk to us; learn it so the answer to
            // its first packet needs no request of our own. Unsolicited
            // replies create nothing (cheap protection against poisoning).
            self.insert_neighbor(now, repr.source_protocol_addr, repr.source_hardware_addr);
        }
        if repr.operation == ArpOperation::Request && sender_ok {
            let reply = ArpRepr {
                operation: ArpOperation::Reply,
                source_hardware_addr: self.config.mac,
                source_protocol_addr: repr.target_protocol_addr,
                target_hardware_addr: repr.source_hardware_addr,
                target_protocol_addr: repr.source_protocol_addr,
            };
            let mac = self.config.mac;
            if let Some(buf) = self.control_push() {
                let len = emit_arp(buf, mac, repr.source_hardware_addr, &reply);
                self.control_commit(len);
                self.counters.arp_replies_tx += 1;
            }
        }
    }

    fn receive_ipv4<T: Transport + ?Sized>(
        &mut self,
        now: Instant,
        src_mac: EthernetAddress,
        bytes: &[u8],
        transport: &mut T,
    ) {
        let packet = match Ipv4Packet::new_checked(bytes) {
            Ok(p) => p,
            Err(_) => return self.counters.drop(DropReason::Ipv4Malformed),
        };
        let repr = match Ipv4Repr::parse(&packet) {
            Ok(r) => r,
            Err(WireError::Checksum { .. }) => return self.counters.drop(DropReason::Ipv4Checksum),
            Err(_) => return self.counters.drop(DropReason::Ipv4Fragment),
        };
        if !self.has_address(repr.dst_addr) {
            return self.counters.drop(DropReason::NotOurAddress);
        }
        if !is_unicast_ip(repr.src_addr) {
            return self.counters.drop(DropReason::BadSourceAddress);
        }
        match repr.protocol {
            Protocol::Icmp => self.receive_icmp(src_mac, &repr, packet.payload()),
            Protocol::Tcp | Protocol::Udp => {
                self.counters.ipv4_delivered += 1;
                transport.handle_ipv4(
                    now,
                    repr.src_addr,
                    repr.dst_addr,
                    repr.protocol.into(),
                    packet.payload(),
                );
            }
            Protocol::Unknown(_) => self.counters.drop(DropReason::UnknownProtocol),
        }
    }

    fn receive_icmp(&mut self, src_mac: EthernetAddress, ip: &Ipv4Repr, bytes: &[u8]) {
        let packet = match Icmpv4Packet::new_checked(bytes) {
            Ok(p) => p,
            Err(_) => return self.counters.drop(DropReason::IcmpMalformed),
        };
        let (ident, seq_no, data) = match Icmpv4Repr::parse(&packet) {
            Ok(Icmpv4Repr::EchoRequest {
                ident,
                seq_no,
                data,
            }) => (ident, seq_no, data),
            Ok(Icmpv4Repr::EchoReply { .. }) => {
                self.counters.icmp_echo_replies_rx += 1;
                return;
            }
            Err(WireError::Checksum { .. }) => return self.counters.drop(DropReason::IcmpChecksum),
            Err(_) => return self.counters.drop(DropReason::IcmpUnsupported),
        };
        self.counters.icmp_echo_requests_rx += 1;
        let reply = Icmpv4Repr::EchoReply {
            ident,
            seq_no,
            data,
        };
        let ip_len = ipv4::HEADER_LEN + reply.buffer_len();
        if ip_len > self.config.mtu {
            // Only possible if the peer's MTU exceeds ours.
            return self.counters.drop(DropReason::TxBufferTooSmall);
        }
        let ip_reply = Ipv4Repr {
            src_addr: ip.dst_addr,
            dst_addr: ip.src_addr,
            protocol: Protocol::Icmp,
            payload_len: reply.buffer_len(),
            ttl: self.config.ttl,
        };
        let (mac, ident_ip) = (self.config.mac, self.take_ident());
        // The reply goes back to the MAC that delivered the request (the
        // switch): no ARP lookup, so it never waits on resolution.
        let Some(buf) = self.control_push() else {
            return;
        };
        let frame_len = ethernet::HEADER_LEN + ip_len;
        let frame = &mut buf[..frame_len];
        EthernetRepr {
            src_addr: mac,
            dst_addr: src_mac,
            ethertype: EtherType::Ipv4,
        }
        .emit(&mut EthernetFrame::new_unchecked(&mut *frame));
        let ip_bytes = &mut frame[ethernet::HEADER_LEN..];
        // Cannot fail: ip_len <= mtu <= 9000.
        let _ = ip_reply.emit(&mut Ipv4Packet::new_unchecked(&mut *ip_bytes), ident_ip);
        reply.emit(&mut Icmpv4Packet::new_unchecked(
            &mut ip_bytes[ipv4::HEADER_LEN..],
        ));
        self.control_commit(frame_len);
        self.counters.icmp_echo_replies_tx += 1;
    }

    // ---------------------------------------------------------------- transmit

    /// Fills `buf` (a device transmit buffer) with the next frame to send and
    /// returns its length, or `None` when there is nothing to send. Order:
    /// ARP/ICMP replies, due ARP requests, packets whose next hop just
    /// resolved, then the transport's segments.
    pub fn transmit<T: Transport + ?Sized>(
        &mut self,
        now: Instant,
        buf: &mut [u8],
        transport: &mut T,
    ) -> Option<usize> {
        let len = self.transmit_inner(now, buf, transport)?;
        self.counters.tx_frames += 1;
        self.counters.tx_bytes += len as u64;
        Some(len)
    }

    fn transmit_inner<T: Transport + ?Sized>(
        &mut self,
        now: Instant,
        buf: &mut [u8],
        transport: &mut T,
    ) -> Option<usize> {
        if let Some(len) = self.pop_control(buf) {
            return Some(len);
        }
        self.expire(now);
        if let Some(len) = self.arp_request_due(now, buf) {
            return Some(len);
        }
        if let Some(len) = self.pop_parked(buf) {
            return Some(len);
        }
        let cap = buf.len().min(ethernet::HEADER_LEN + self.config.mtu);
        if cap <= HEADER_ROOM {
            // Tell the caller nothing fits rather than losing a segment.
            return None;
        }
        // A transport packet that cannot go out now (unresolved next hop,
        // bad metadata) is dealt with and the transport is asked again; the
        // bound keeps a misbehaving transport from spinning us forever.
        for _ in 0..64 {
            let out = transport.poll_ipv4(now, &mut buf[HEADER_ROOM..cap])?;
            if out.len > cap - HEADER_ROOM {
                self.counters.drop(DropReason::TransportBadLength);
                continue;
            }
            if !self.has_address(out.src) {
                self.counters.drop(DropReason::TransportBadSource);
                continue;
            }
            if !is_unicast_ip(out.dst) {
                self.counters.drop(DropReason::BadSourceAddress);
                continue;
            }
            let repr = Ipv4Repr {
                src_addr: out.src,
                dst_addr: out.dst,
                protocol: out.protocol.into(),
                payload_len: out.len,
                ttl: self.config.ttl,
            };
            let ident = self.take_ident();
            let frame_len = HEADER_ROOM + out.len;
            // Cannot fail: out.len <= mtu.
            let _ = repr.emit(
                &mut Ipv4Packet::new_unchecked(&mut buf[ethernet::HEADER_LEN..frame_len]),
                ident,
            );
            let next_hop = self.route(out.dst);
            match self.lookup(now, next_hop) {
                Some(mac) => {
                    EthernetRepr {
                        src_addr: self.config.mac,
                        dst_addr: mac,
                        ethertype: EtherType::Ipv4,
                    }
                    .emit(&mut EthernetFrame::new_unchecked(&mut buf[..frame_len]));
                    self.counters.ipv4_sent += 1;
                    return Some(frame_len);
                }
                None => {
                    self.park(now, next_hop, &buf[..frame_len]);
                    // The packet is copied out; use the buffer for the
                    // request that resolves its next hop, without delay.
                    if let Some(len) = self.arp_request_due(now, buf) {
                        return Some(len);
                    }
                }
            }
        }
        None
    }

    /// Earliest time the interface or the transport needs attention;
    /// `Instant::ZERO` means "now" (frames are ready to transmit).
    pub fn poll_timeout<T: Transport + ?Sized>(&self, transport: &T) -> Option<Instant> {
        if self.control_len > 0 {
            return Some(Instant::ZERO);
        }
        let mut t = transport.poll_timeout();
        let mut earliest = |x: Instant| t = Some(t.map_or(x, |y| y.min(x)));
        for n in &self.neighbors {
            match n.state {
                NeighborState::Incomplete {
                    next_request_at, ..
                } => earliest(next_request_at),
                NeighborState::Reachable {
                    refresh_at,
                    expires_at,
                    refresh_sent,
                    ..
                } => earliest(if refresh_sent { expires_at } else { refresh_at }),
            }
        }
        for p in self.parked.iter().filter(|p| p.len > 0) {
            match self.neighbor(p.next_hop) {
                Some(_) => earliest(Instant::ZERO),
                None => earliest(p.deadline),
            }
        }
        t
    }

    /// Runs timers: ARP expiry, parked-packet timeouts, and the transport's
    /// own timer if due. Requests that became due go out on the next
    /// `transmit`.
    pub fn handle_timeout<T: Transport + ?Sized>(&mut self, now: Instant, transport: &mut T) {
        self.expire(now);
        if transport.poll_timeout().is_some_and(|t| t <= now) {
            transport.handle_timeout(now);
        }
    }

    // ---------------------------------------------------------------- internals

    fn take_ident(&mut self) -> u16 {
        self.next_ident = self.next_ident.wrapping_add(1);
        self.next_ident
    }

    /// Reserves the next control slot; counts a drop and returns `None` if full.
    fn control_push(&mut self) -> Option<&mut [u8]> {
        let n = self.control.len();
        if self.control_len == n {
            self.counters.drop(DropReason::ControlQueueFull);
            return None;
        }
        let idx = (self.control_head + self.control_len) % n;
        Some(&mut self.control[idx].buf)
    }
    fn control_commit(&mut self, len: usize) {
        let n = self.control.len();
        let idx = (self.control_head + self.control_len) % n;
        self.control[idx].len = len;
        self.control_len += 1;
    }
    fn pop_control(&mut self, buf: &mut [u8]) -> Option<usize> {
        if self.control_len == 0 {
            return None;
        }
        let slot = &self.control[self.control_head];
        let len = slot.len;
        let fits = len <= buf.len();
        if fits {
            buf[..len].copy_from_slice(&slot.buf[..len]);
        }
        self.control_head = (self.control_head + 1) % self.control.len();
        self.control_len -= 1;
        if fits {
            Some(len)
        } else {
            self.counters.drop(DropReason::TxBufferTooSmall);
            None
        }
    }

    /// Updates an existing entry for `ip`; false if there is none.
    fn confirm_neighbor(&mut self, now: Instant, ip: Ipv4Addr, mac: EthernetAddress) -> bool {
        let reach = self.config.arp.reachable_time;
        let Some(n) = self.neighbors.iter_mut().find(|n| n.ip == ip) else {
            return false;
        };
        n.state = NeighborState::Reachable {
            mac,
            refresh_at: now + reach * 3 / 4,
            expires_at: now + reach,
            refresh_sent: false,
        };
        true
    }

    /// Adds a mapping learned from a peer's ARP request.
    fn insert_neighbor(&mut self, now: Instant, ip: Ipv4Addr, mac: EthernetAddress) {
        if self.make_room() {
            self.neighbors.push(Neighbor {
                ip,
                state: NeighborState::Incomplete {
                    next_request_at: now,
                    sent: 0,
                },
                last_used: now,
            });
            self.confirm_neighbor(now, ip, mac);
        }
    }

    /// Frees a cache entry if the cache is full by evicting the least
    /// recently used entry other than the gateway (its parked packets are
    /// dropped). False if no room can be made (a cache of one holds only the
    /// gateway).
    fn make_room(&mut self) -> bool {
        if self.neighbors.len() < self.config.arp.cache_size {
            return true;
        }
        let gw = self.config.gateway;
        let victim = self
            .neighbors
            .iter()
            .enumerate()
            .filter(|(_, n)| n.ip != gw)
            .min_by_key(|(_, n)| n.last_used)
            .map(|(i, _)| i);
        match victim {
            Some(i) => {
                let old = self.neighbors.swap_remove(i).ip;
                self.drop_parked_for(old, DropReason::NeighborUnreachable);
                true
            }
            None => false,
        }
    }

    /// The MAC for `ip`, starting resolution if unknown.
    fn lookup(&mut self, now: Instant, ip: Ipv4Addr) -> Option<EthernetAddress> {
        if let Some(n) = self.neighbors.iter_mut().find(|n| n.ip == ip) {
            n.last_used = now;
            return match n.state {
                NeighborState::Reachable { mac, .. } => Some(mac),
                NeighborState::Incomplete { .. } => None,
            };
        }
        if !self.make_room() {
            return None;
        }
        self.neighbors.push(Neighbor {
            ip,
            state: NeighborState::Incomplete {
                next_request_at: now,
                sent: 0,
            },
            last_used: now,
        });
        None
    }

    /// Ages the ARP cache and parked packets.
    fn expire(&mut self, now: Instant) {
        let (gw, max) = (self.config.gateway, self.config.arp.max_requests);
        let reach = self.config.arp.reachable_time;
        let mut i = 0;
        while i < self.neighbors.len() {
            let n = &mut self.neighbors[i];
            match n.state {
                NeighborState::Reachable { expires_at, .. } if now >= expires_at => {
                    if n.ip == gw || now.saturating_since(n.last_used) < reach {
                        // In use but unconfirmed for a whole reachable time:
                        // resolve again.
                        n.state = NeighborState::Incomplete {
                            next_request_at: now,
                            sent: 0,
                        };
                    } else {
                        // Idle: forget it rather than keep asking.
                        self.neighbors.swap_remove(i);
                        continue;
                    }
                }
                NeighborState::Reachable {
                    refresh_at,
                    ref mut refresh_sent,
                    ..
                } if !*refresh_sent
                    && now >= refresh_at
                    && n.ip != gw
                    && now.saturating_since(n.last_used) >= reach =>
                {
                    // Idle mapping: skip the refresh (so `poll_timeout` moves
                    // on to the expiry) and let it age out.
                    *refresh_sent = true;
                }
                NeighborState::Incomplete {
                    next_request_at,
                    sent,
                } if n.ip != gw && sent >= max && now >= next_request_at => {
                    let ip = self.neighbors.swap_remove(i).ip;
                    self.drop_parked_for(ip, DropReason::NeighborUnreachable);
                    continue;
                }
                _ => {}
            }
            i += 1;
        }
        if self.parked_count > 0 {
            for p in self
                .parked
                .iter_mut()
                .filter(|p| p.len > 0 && now >= p.deadline)
            {
                p.len = 0;
                self.parked_count -= 1;
                self.counters.drop(DropReason::ParkedTimeout);
            }
        }
    }

    /// Emits one due ARP request (initial, retry or refresh) into `buf`.
    fn arp_request_due(&mut self, now: Instant, buf: &mut [u8]) -> Option<usize> {
        let (retry, reach, gw) = (
            self.config.arp.retry_interval,
            self.config.arp.reachable_time,
            self.config.gateway,
        );
        let (mac, src_ip) = (self.config.mac, self.config.address);
        let n = self.neighbors.iter_mut().find(|n| match n.state {
            NeighborState::Incomplete {
                next_request_at, ..
            } => now >= next_request_at,
            // Refresh only mappings in use, so idle ones age out quietly.
            NeighborState::Reachable {
                refresh_at,
                refresh_sent,
                ..
            } => {
                !refresh_sent
                    && now >= refresh_at
                    && (n.ip == gw || now.saturating_since(n.last_used) < reach)
            }
        })?;
        let target = n.ip;
        if buf.len() < ethernet::HEADER_LEN + arp::PACKET_LEN {
            self.counters.drop(DropReason::TxBufferTooSmall);
            return None;
        }
        match &mut n.state {
            NeighborState::Incomplete {
                next_request_at,
                sent,
            } => {
                *next_request_at = now + retry;
                *sent = sent.saturating_add(1);
            }
            NeighborState::Reachable { refresh_sent, .. } => *refresh_sent = true,
        }
        let req = ArpRepr {
            operation: ArpOperation::Request,
            source_hardware_addr: mac,
            source_protocol_addr: src_ip,
            target_hardware_addr: EthernetAddress::ZERO,
            target_protocol_addr: target,
        };
        self.counters.arp_requests_tx += 1;
        Some(emit_arp(buf, mac, EthernetAddress::BROADCAST, &req))
    }

    fn park(&mut self, now: Instant, next_hop: Ipv4Addr, frame: &[u8]) {
        let deadline = now + self.config.arp.parked_timeout;
        match self.parked.iter_mut().find(|p| p.len == 0) {
            Some(slot) if frame.len() <= slot.buf.len() => {
                slot.buf[..frame.len()].copy_from_slice(frame);
                slot.len = frame.len();
                slot.next_hop = next_hop;
                slot.deadline = deadline;
                self.parked_count += 1;
            }
            _ => self.counters.drop(DropReason::ParkedFull),
        }
    }

    fn pop_parked(&mut self, buf: &mut [u8]) -> Option<usize> {
        if self.parked_count == 0 {
            return None;
        }
        let my_mac = self.config.mac;
        // Oldest first keeps a flow's packets in order.
        let idx = self
            .parked
            .iter()
            .enumerate()
            .filter(|(_, p)| p.len > 0 && self.neighbor(p.next_hop).is_some())
            .min_by_key(|(_, p)| p.deadline)
            .map(|(i, _)| i)?;
        let mac = self.neighbor(self.parked[idx].next_hop)?;
        let slot = &mut self.parked[idx];
        let len = slot.len;
        slot.len = 0;
        self.parked_count -= 1;
        if len > buf.len() {
            self.counters.drop(DropReason::TxBufferTooSmall);
            return None;
        }
        buf[..len].copy_from_slice(&slot.buf[..len]);
        EthernetRepr {
            src_addr: my_mac,
            dst_addr: mac,
            ethertype: EtherType::Ipv4,
        }
        .emit(&mut EthernetFrame::new_unchecked(&mut buf[..len]));
        self.counters.ipv4_sent += 1;
        Some(len)
    }

    fn drop_parked_for(&mut self, ip: Ipv4Addr, reason: DropReason) {
        if self.parked_count == 0 {
            return;
        }
        for p in self
            .parked
            .iter_mut()
            .filter(|p| p.len > 0 && p.next_hop == ip)
        {
            p.len = 0;
            self.parked_count -= 1;
            self.counters.drops[reason as usize] += 1;
        }
    }
}

/// Writes an Ethernet frame carrying `repr` into `buf` (at least 42 bytes)
/// and returns its length.
fn emit_arp(buf: &mut [u8], src: EthernetAddress, dst: EthernetAddress, repr: &ArpRepr) -> usize {
    let len = ethernet::HEADER_LEN + repr.buffer_len();
    let mut frame = EthernetFrame::new_unchecked(&mut buf[..len]);
    EthernetRepr {
        src_addr: src,
        dst_addr: dst,
        ethertype: EtherType::Arp,
    }
    .emit(&mut frame);
    repr.emit(&mut ArpPacket::new_unchecked(frame.payload_mut()));
    len
}
