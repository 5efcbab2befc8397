//! Builders of Ethernet/IPv4/TCP/UDP frames with correct checksums, for
//! the data-plane tests and the benchmark (the switch itself builds no
//! packet but the reset a retiring service answers with, in its XDP
//! program: [`tcp_reset_frame`] is what it must emit).

use std::net::Ipv4Addr;

use capybara_proto::checksum;

pub type Mac = [u8; 6];

pub const TCP_FIN: u8 = 0x01;
pub const TCP_SYN: u8 = 0x02;
pub const TCP_RST: u8 = 0x04;
pub const TCP_PSH: u8 = 0x08;
pub const TCP_ACK: u8 = 0x10;

/// Ethernet + IPv4 (no options, DF) around `l4`; checksum of the IP header
/// computed, the L4 checksum left to the caller.
pub fn ipv4_frame(
    dst_mac: Mac,
    src_mac: Mac,
    src: Ipv4Addr,
    dst: Ipv4Addr,
    proto: u8,
    l4: &[u8],
) -> Vec<u8> {
    let mut f = Vec::with_capacity(34 + l4.len());
    f.extend_from_slice(&dst_mac);
    f.extend_from_slice(&src_mac);
    f.extend_from_slice(&0x0800u16.to_be_bytes());
    let tot = (20 + l4.len()) as u16;
    let mut ip = [0u8; 20];
    ip[0] = 0x45;
    ip[2..4].copy_from_slice(&tot.to_be_bytes());
    ip[4..6].copy_from_slice(&0x1234u16.to_be_bytes());
    ip[6] = 0x40; // DF
    ip[8] = 64;
    ip[9] = proto;
    ip[12..16].copy_from_slice(&src.octets());
    ip[16..20].copy_from_slice(&dst.octets());
    let c = checksum::checksum(&ip);
    ip[10..12].copy_from_slice(&c.to_be_bytes());
    f.extend_from_slice(&ip);
    f.extend_from_slice(l4);
    f
}

/// A TCP segment (20-byte header) with its checksum.
#[allow(clippy::too_many_arguments)]
pub fn tcp_frame(
    dst_mac: Mac,
    src_mac: Mac,
    src: Ipv4Addr,
    sport: u16,
    dst: Ipv4Addr,
    dport: u16,
    flags: u8,
    payload: &[u8],
) -> Vec<u8> {
    let ack = if flags & TCP_ACK != 0 { 2000 } else { 0 };
    let mut t = tcp_header(sport, dport, 1000, ack, flags, 65535);
    t.extend_from_slice(payload);
    let c = checksum::transport(src, dst, 6, &t);
    t[16..18].copy_from_slice(&c.to_be_bytes());
    ipv4_frame(dst_mac, src_mac, src, dst, 6, &t)
}

/// A bare TCP reset (20-byte header, no payload) from `src`, with IP id 0,
/// DF, TTL 64: `seq`, and `ack` with the ACK flag when `Some`.
#[allow(clippy::too_many_arguments)]
pub fn tcp_reset_frame(
    dst_mac: Mac,
    src_mac: Mac,
    src: Ipv4Addr,
    sport: u16,
    dst: Ipv4Addr,
    dport: u16,
    seq: u32,
    ack: Option<u32>,
) -> Vec<u8> {
    let flags = TCP_RST | if ack.is_some() { TCP_ACK } else { 0 };
    let mut t = tcp_header(sport, dport, seq, ack.unwrap_or(0), flags, 0);
    let c = checksum::transport(src, dst, 6, &t);
    t[16..18].copy_from_slice(&c.to_be_bytes());
    let mut f = ipv4_frame(dst_mac, src_mac, src, dst, 6, &t);
    // IP id 0, as a host's reset; the header checksum again.
    f[18..20].copy_from_slice(&[0, 0]);
    f[24..26].copy_from_slice(&[0, 0]);
    let c = checksum::checksum(&f[14..34]);
    f[24..26].copy_from_slice(&c.to_be_bytes());
    f
}

/// A 20-byte TCP header, checksum 0.
fn tcp_header(sport: u16, dport: u16, seq: u32, ack: u32, flags: u8, window: u16) -> Vec<u8> {
    let mut t = vec![0u8; 20];
    t[0..2].copy_from_slice(&sport.to_be_bytes());
    t[2..4].copy_from_slice(&dport.to_be_bytes());
    t[4..8].copy_from_slice(&seq.to_be_bytes());
    t[8..12].copy_from_slice(&ack.to_be_bytes());
    t[12] = 5 << 4;
    t[13] = flags;
    t[14..16].copy_from_slice(&window.to_be_bytes());
    t
}

/// A UDP datagram with its checksum (0xffff if it computes to 0).
pub fn udp_frame(
    dst_mac: Mac,
    src_mac: Mac,
    src: Ipv4Addr,
    sport: u16,
    dst: Ipv4Addr,
    dport: u16,
    payload: &[u8],
) -> Vec<u8> {
    let mut u = vec![0u8; 8];
    u[0..2].copy_from_slice(&sport.to_be_bytes());
    u[2..4].copy_from_slice(&dport.to_be_bytes());
    u[4..6].copy_from_slice(&((8 + payload.len()) as u16).to_be_bytes());
    u.extend_from_slice(payload);
    let c = match checksum::transport(src, dst, 17, &u) {
        0 => 0xffff,
        c => c,
    };
    u[6..8].copy_from_slice(&c.to_be_bytes());
    ipv4_frame(dst_mac, src_mac, src, dst, 17, &u)
}
