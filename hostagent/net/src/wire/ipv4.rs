//! IPv4 headers (RFC 791).
//!
//! `new_checked` validates version 4, IHL >= 5, and
//! `header_len <= total_len <= buffer length`, so `payload()` is always the
//! exact datagram payload with any Ethernet padding cut off. Options are
//! skipped (their bytes are covered by the header checksum, never
//! interpreted). Fragments are not reassembled: `Ipv4Repr::parse` rejects
//! them and the interface counts them under their own drop reason.

use super::{be16, ipv4_at, put16, Result, WireError};
use capybara_proto::checksum;
use std::net::Ipv4Addr;

mod field {
    pub const VER_IHL: usize = 0;
    pub const DSCP_ECN: usize = 1;
    pub const LENGTH: usize = 2;
    pub const IDENT: usize = 4;
    pub const FLG_OFF: usize = 6;
    pub const TTL: usize = 8;
    pub const PROTOCOL: usize = 9;
    pub const CHECKSUM: usize = 10;
    pub const SRC_ADDR: usize = 12;
    pub const DST_ADDR: usize = 16;
}

/// Length of a header without options.
pub const HEADER_LEN: usize = 20;
/// Don't-fragment flag in the flags/fragment-offset word.
const FLAG_DF: u16 = 0x4000;
/// More-fragments flag.
const FLAG_MF: u16 = 0x2000;
const OFFSET_MASK: u16 = 0x1fff;

/// IP protocol numbers the stack knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    Icmp,
    Tcp,
    Udp,
    Unknown(u8),
}

impl From<u8> for Protocol {
    fn from(v: u8) -> Self {
        match v {
            1 => Protocol::Icmp,
            6 => Protocol::Tcp,
            17 => Protocol::Udp,
            o => Protocol::Unknown(o),
        }
    }
}
impl From<Protocol> for u8 {
    fn from(p: Protocol) -> u8 {
        match p {
            Protocol::Icmp => 1,
            Protocol::Tcp => 6,
            Protocol::Udp => 17,
            Protocol::Unknown(v) => v,
        }
    }
}

/// A view of an IPv4 datagram.
#[derive(Debug, Clone)]
pub struct Ipv4Packet<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> Ipv4Packet<T> {
    pub fn new_unchecked(buffer: T) -> Self {
        Ipv4Packet { buffer }
    }

    /// Validates version and the three lengths (fixed header, IHL, total
    /// length) against the buffer. After this no accessor panics.
    pub fn new_checked(buffer: T) -> Result<Self> {
        let b = buffer.as_ref();
        let len = b.len();
        if len < HEADER_LEN {
            return Err(WireError::Truncated {
                layer: "ipv4",
                len,
                need: HEADER_LEN,
            });
        }
        if b[field::VER_IHL] >> 4 != 4 {
            return Err(WireError::Malformed {
                layer: "ipv4",
                what: "version is not 4",
            });
        }
        let header_len = usize::from(b[field::VER_IHL] & 0x0f) * 4;
        if header_len < HEADER_LEN {
            return Err(WireError::Malformed {
                layer: "ipv4",
                what: "header length below 20",
            });
        }
        let total = usize::from(be16(b, field::LENGTH));
        if total < header_len {
            return Err(WireError::Malformed {
                layer: "ipv4",
                what: "total length below header length",
            });
        }
        if total > len {
            return Err(WireError::Truncated {
                layer: "ipv4",
                len,
                need: total,
            });
        }
        Ok(Ipv4Packet { buffer })
    }

    pub fn into_inner(self) -> T {
        self.buffer
    }
    fn b(&self) -> &[u8] {
        self.buffer.as_ref()
    }
    pub fn version(&self) -> u8 {
        self.b()[field::VER_IHL] >> 4
    }
    pub fn header_len(&self) -> usize {
        usize::from(self.b()[field::VER_IHL] & 0x0f) * 4
    }
    pub fn dscp_ecn(&self) -> u8 {
        self.b()[field::DSCP_ECN]
    }
    pub fn total_len(&self) -> usize {
        usize::from(be16(self.b(), field::LENGTH))
    }
    pub fn ident(&self) -> u16 {
        be16(self.b(), field::IDENT)
    }
    pub fn dont_frag(&self) -> bool {
        be16(self.b(), field::FLG_OFF) & FLAG_DF != 0
    }
    pub fn more_frags(&self) -> bool {
        be16(self.b(), field::FLG_OFF) & FLAG_MF != 0
    }
    /// Fragment offset in bytes.
    pub fn frag_offset(&self) -> usize {
        usize::from(be16(self.b(), field::FLG_OFF) & OFFSET_MASK) * 8
    }
    /// True for any piece of a fragmented datagram (first, middle or last).
    pub fn is_fragment(&self) -> bool {
        self.more_frags() || self.frag_offset() != 0
    }
    pub fn ttl(&self) -> u8 {
        self.b()[field::TTL]
    }
    pub fn protocol(&self) -> Protocol {
        self.b()[field::PROTOCOL].into()
    }
    pub fn checksum(&self) -> u16 {
        be16(self.b(), field::CHECKSUM)
    }
    pub fn src_addr(&self) -> Ipv4Addr {
        ipv4_at(self.b(), field::SRC_ADDR)
    }
    pub fn dst_addr(&self) -> Ipv4Addr {
        ipv4_at(self.b(), field::DST_ADDR)
    }
    /// True if the header checksum (options included) verifies.
    pub fn verify_checksum(&self) -> bool {
        checksum::checksum(&self.b()[..self.header_len()]) == 0
    }
    /// The payload, bounded by the total-length field (link padding excluded).
    pub fn payload(&self) -> &[u8] {
        &self.b()[self.header_len()..self.total_len()]
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Ipv4Packet<T> {
    fn bm(&mut self) -> &mut [u8] {
        self.buffer.as_mut()
    }
    pub fn set_version_and_header_len(&mut self, header_len: usize) {
        self.bm()[field::VER_IHL] = 0x40 | ((header_len / 4) as u8 & 0x0f);
    }
    pub fn set_dscp_ecn(&mut self, v: u8) {
        self.bm()[field::DSCP_ECN] = v
    }
    pub fn set_total_len(&mut self, v: u16) {
        put16(self.bm(), field::LENGTH, v)
    }
    pub fn set_ident(&mut self, v: u16) {
        put16(self.bm(), field::IDENT, v)
    }
    /// Sets DF and clears MF and the fragment offset: we never fragment.
    pub fn set_unfragmented(&mut self, dont_frag: bool) {
        put16(
            self.bm(),
            field::FLG_OFF,
            if dont_frag { FLAG_DF } else { 0 },
        )
    }
    pub fn set_ttl(&mut self, v: u8) {
        self.bm()[field::TTL] = v
    }
    pub fn set_protocol(&mut self, p: Protocol) {
        self.bm()[field::PROTOCOL] = p.into()
    }
    pub fn set_checksum(&mut self, v: u16) {
        put16(self.bm(), field::CHECKSUM, v)
    }
    pub fn set_src_addr(&mut self, a: Ipv4Addr) {
        self.bm()[field::SRC_ADDR..field::SRC_ADDR + 4].copy_from_slice(&a.octets())
    }
    pub fn set_dst_addr(&mut self, a: Ipv4Addr) {
        self.bm()[field::DST_ADDR..field::DST_ADDR + 4].copy_from_slice(&a.octets())
    }
    /// Recomputes the header checksum over the current header bytes.
    pub fn fill_checksum(&mut self) {
        self.set_checksum(0);
        let hl = self.header_len();
        let c = checksum::checksum(&self.b()[..hl]);
        self.set_checksum(c);
    }
    pub fn payload_mut(&mut self) -> &mut [u8] {
        let (h, t) = (self.header_len(), self.total_len());
        &mut self.bm()[h..t]
    }
}

/// The fields of an unfragmented IPv4 header that the stack uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ipv4Repr {
    pub src_addr: Ipv4Addr,
    pub dst_addr: Ipv4Addr,
    pub protocol: Protocol,
    pub payload_len: usize,
    pub ttl: u8,
}

impl Ipv4Repr {
    /// Parses a checked view: verifies the header checksum and rejects
    /// fragments (not reassembled by this stack).
    pub fn parse<T: AsRef<[u8]>>(p: &Ipv4Packet<T>) -> Result<Self> {
        if !p.verify_checksum() {
            return Err(WireError::Checksum { layer: "ipv4" });
        }
        if p.is_fragment() {
            return Err(WireError::Unsupported {
                layer: "ipv4",
                what: "fragment",
            });
        }
        Ok(Ipv4Repr {
            src_addr: p.src_addr(),
            dst_addr: p.dst_addr(),
            protocol: p.protocol(),
            payload_len: p.total_len() - p.header_len(),
            ttl: p.ttl(),
        })
    }

    /// Header length emitted (no options).
    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN
    }

    /// Writes a 20-byte header with DF set and a valid checksum; `p` must
    /// hold at least `buffer_len()` bytes. Emitting fails only if the
    /// payload does not fit the 16-bit total-length field.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(
        &self,
        p: &mut Ipv4Packet<T>,
        ident: u16,
    ) -> Result<()> {
        let total =
            u16::try_from(HEADER_LEN + self.payload_len).map_err(|_| WireError::Malformed {
                layer: "ipv4",
                what: "payload longer than 65515 bytes",
            })?;
        p.set_version_and_header_len(HEADER_LEN);
        p.set_dscp_ecn(0);
        p.set_total_len(total);
        p.set_ident(ident);
        p.set_unfragmented(true);
        p.set_ttl(self.ttl);
        p.set_protocol(self.protocol);
        p.set_src_addr(self.src_addr);
        p.set_dst_addr(self.dst_addr);
        p.fill_checksum();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Vec<u8> {
        let repr = Ipv4Repr {
            src_addr: Ipv4Addr::new(198, 18, 1, 1),
            dst_addr: Ipv4Addr::new(198, 18, 2, 11),
            protocol: Protocol::Tcp,
            payload_len: 4,
            ttl: 64,
        };
        let mut buf = vec![0u8; 24];
        repr.emit(&mut Ipv4Packet::new_unchecked(&mut buf[..]), 0x1234)
            .unwrap();
        buf[20..].copy_from_slice(b"abcd");
        buf
    }

    #[test]
    fn round_trip() {
        let buf = sample();
        let p = Ipv4Packet::new_checked(&buf[..]).unwrap();
        assert!(p.verify_checksum());
        assert!(p.dont_frag() && !p.is_fragment());
        assert_eq!(p.ident(), 0x1234);
        let r = Ipv4Repr::parse(&p).unwrap();
        assert_eq!(r.payload_len, 4);
        assert_eq!(r.protocol, Protocol::Tcp);
        assert_eq!(p.payload(), b"abcd");
    }

    #[test]
    fn padding_is_trimmed_and_options_skipped() {
        // Header with 4 bytes of options (NOP NOP NOP EOL), 2 payload bytes,
        // then Ethernet padding.
        let mut b = vec![
            0x46, 0, 0, 26, 0, 0, 0, 0, 64, 17, 0, 0, 10, 0, 0, 1, 10, 0, 0, 2, 1, 1, 1, 0, 0xaa,
            0xbb,
        ];
        b.extend_from_slice(&[0; 20]);
        let c = checksum::checksum(&b[..24]);
        b[10..12].copy_from_slice(&c.to_be_bytes());
        let p = Ipv4Packet::new_checked(&b[..]).unwrap();
        assert_eq!(p.header_len(), 24);
        assert_eq!(p.payload(), &[0xaa, 0xbb]);
        assert_eq!(Ipv4Repr::parse(&p).unwrap().payload_len, 2);
    }

    #[test]
    fn malformed() {
        let good = sample();
        assert!(matches!(
            Ipv4Packet::new_checked(&good[..19]),
            Err(WireError::Truncated { .. })
        ));
        assert!(matches!(
            Ipv4Packet::new_checked(&good[..23]),
            Err(WireError::Truncated { .. })
        ));
        let mut b = good.clone();
        b[0] = 0x65;
        assert!(matches!(
            Ipv4Packet::new_checked(&b[..]),
            Err(WireError::Malformed { .. })
        ));
        let mut b = good.clone();
        b[0] = 0x44;
        assert!(matches!(
            Ipv4Packet::new_checked(&b[..]),
            Err(WireError::Malformed { .. })
        ));
        let mut b = good.clone();
        b[0] = 0x4f; // IHL 60 > buffer
        assert!(Ipv4Packet::new_checked(&b[..]).is_err());
        let mut b = good.clone();
        b[2..4].copy_from_slice(&19u16.to_be_bytes());
        assert!(matches!(
            Ipv4Packet::new_checked(&b[..]),
            Err(WireError::Malformed { .. })
        ));
        let mut b = good.clone();
        b[8] ^= 1; // TTL changed without checksum update
        let p = Ipv4Packet::new_checked(&b[..]).unwrap();
        assert_eq!(
            Ipv4Repr::parse(&p),
            Err(WireError::Checksum { layer: "ipv4" })
        );
    }

    #[test]
    fn fragments_rejected() {
        for flags in [0x2000u16, 0x0001, 0x2001] {
            let mut b = sample();
            b[6..8].copy_from_slice(&flags.to_be_bytes());
            let mut p = Ipv4Packet::new_unchecked(&mut b[..]);
            p.fill_checksum();
            let p = Ipv4Packet::new_checked(&b[..]).unwrap();
            assert!(p.is_fragment());
            assert!(matches!(
                Ipv4Repr::parse(&p),
                Err(WireError::Unsupported {
                    what: "fragment",
                    ..
                })
            ));
        }
    }
}
