//! ARP (RFC 826) restricted to IPv4 over Ethernet: hardware type 1, protocol
//! type 0x0800, address lengths 6 and 4. Other combinations are reported as
//! `Unsupported` by `ArpRepr::parse`; the view itself only needs the fixed
//! 28 bytes.

use super::{be16, ipv4_at, put16, EthernetAddress, Result, WireError};
use std::net::Ipv4Addr;

mod field {
    use core::ops::Range;
    pub const HTYPE: usize = 0;
    pub const PTYPE: usize = 2;
    pub const HLEN: usize = 4;
    pub const PLEN: usize = 5;
    pub const OPER: usize = 6;
    pub const SHA: Range<usize> = 8..14;
    pub const SPA: usize = 14;
    pub const THA: Range<usize> = 18..24;
    pub const TPA: usize = 24;
}

/// Length of an IPv4-over-Ethernet ARP packet.
pub const PACKET_LEN: usize = 28;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ArpOperation {
    Request,
    Reply,
    Unknown(u16),
}

impl From<u16> for ArpOperation {
    fn from(v: u16) -> Self {
        match v {
            1 => ArpOperation::Request,
            2 => ArpOperation::Reply,
            o => ArpOperation::Unknown(o),
        }
    }
}
impl From<ArpOperation> for u16 {
    fn from(o: ArpOperation) -> u16 {
        match o {
            ArpOperation::Request => 1,
            ArpOperation::Reply => 2,
            ArpOperation::Unknown(v) => v,
        }
    }
}

/// A view of an ARP packet for IPv4 over Ethernet.
#[derive(Debug, Clone)]
pub struct ArpPacket<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> ArpPacket<T> {
    pub fn new_unchecked(buffer: T) -> Self {
        ArpPacket { buffer }
    }
    /// Validates the length of the fixed 28-byte layout.
    pub fn new_checked(buffer: T) -> Result<Self> {
        let len = buffer.as_ref().len();
        if len < PACKET_LEN {
            return Err(WireError::Truncated {
                layer: "arp",
                len,
                need: PACKET_LEN,
            });
        }
        Ok(ArpPacket { buffer })
    }
    fn b(&self) -> &[u8] {
        self.buffer.as_ref()
    }
    pub fn hardware_type(&self) -> u16 {
        be16(self.b(), field::HTYPE)
    }
    pub fn protocol_type(&self) -> u16 {
        be16(self.b(), field::PTYPE)
    }
    pub fn hardware_len(&self) -> u8 {
        self.b()[field::HLEN]
    }
    pub fn protocol_len(&self) -> u8 {
        self.b()[field::PLEN]
    }
    pub fn operation(&self) -> ArpOperation {
        be16(self.b(), field::OPER).into()
    }
    pub fn sender_hardware_addr(&self) -> EthernetAddress {
        let mut a = [0; 6];
        a.copy_from_slice(&self.b()[field::SHA]);
        EthernetAddress(a)
    }
    pub fn sender_protocol_addr(&self) -> Ipv4Addr {
        ipv4_at(self.b(), field::SPA)
    }
    pub fn target_hardware_addr(&self) -> EthernetAddress {
        let mut a = [0; 6];
        a.copy_from_slice(&self.b()[field::THA]);
        EthernetAddress(a)
    }
    pub fn target_protocol_addr(&self) -> Ipv4Addr {
        ipv4_at(self.b(), field::TPA)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> ArpPacket<T> {
    fn bm(&mut self) -> &mut [u8] {
        self.buffer.as_mut()
    }
    pub fn set_hardware_type(&mut self, v: u16) {
        put16(self.bm(), field::HTYPE, v)
    }
    pub fn set_protocol_type(&mut self, v: u16) {
        put16(self.bm(), field::PTYPE, v)
    }
    pub fn set_hardware_len(&mut self, v: u8) {
        self.bm()[field::HLEN] = v
    }
    pub fn set_protocol_len(&mut self, v: u8) {
        self.bm()[field::PLEN] = v
    }
    pub fn set_operation(&mut self, o: ArpOperation) {
        put16(self.bm(), field::OPER, o.into())
    }
    pub fn set_sender_hardware_addr(&mut self, a: EthernetAddress) {
        self.bm()[field::SHA].copy_from_slice(&a.0)
    }
    pub fn set_sender_protocol_addr(&mut self, a: Ipv4Addr) {
        self.bm()[field::SPA..field::SPA + 4].copy_from_slice(&a.octets())
    }
    pub fn set_target_hardware_addr(&mut self, a: EthernetAddress) {
        self.bm()[field::THA].copy_from_slice(&a.0)
    }
    pub fn set_target_protocol_addr(&mut self, a: Ipv4Addr) {
        self.bm()[field::TPA..field::TPA + 4].copy_from_slice(&a.octets())
    }
}

/// An ARP request or reply for IPv4 over Ethernet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ArpRepr {
    pub operation: ArpOperation,
    pub source_hardware_addr: EthernetAddress,
    pub source_protocol_addr: Ipv4Addr,
    pub target_hardware_addr: EthernetAddress,
    pub target_protocol_addr: Ipv4Addr,
}

impl ArpRepr {
    pub fn parse<T: AsRef<[u8]>>(p: &ArpPacket<T>) -> Result<Self> {
        if p.hardware_type() != 1 || p.hardware_len() != 6 {
            return Err(WireError::Unsupported {
                layer: "arp",
                what: "hardware is not ethernet",
            });
        }
        if p.protocol_type() != 0x0800 || p.protocol_len() != 4 {
            return Err(WireError::Unsupported {
                layer: "arp",
                what: "protocol is not ipv4",
            });
        }
        let operation = p.operation();
        if let ArpOperation::Unknown(_) = operation {
            return Err(WireError::Unsupported {
                layer: "arp",
                what: "operation is neither request nor reply",
            });
        }
        Ok(ArpRepr {
            operation,
            source_hardware_addr: p.sender_hardware_addr(),
            source_protocol_addr: p.sender_protocol_addr(),
            target_hardware_addr: p.target_hardware_addr(),
            target_protocol_addr: p.target_protocol_addr(),
        })
    }
    pub const fn buffer_len(&self) -> usize {
        PACKET_LEN
    }
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, p: &mut ArpPacket<T>) {
        p.set_hardware_type(1);
        p.set_protocol_type(0x0800);
        p.set_hardware_len(6);
        p.set_protocol_len(4);
        p.set_operation(self.operation);
        p.set_sender_hardware_addr(self.source_hardware_addr);
        p.set_sender_protocol_addr(self.source_protocol_addr);
        p.set_target_hardware_addr(self.target_hardware_addr);
        p.set_target_protocol_addr(self.target_protocol_addr);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // A request captured from Linux: who-has 198.18.2.11 tell 198.18.1.1.
    const REQUEST: [u8; 28] = [
        0x00, 0x01, 0x08, 0x00, 0x06, 0x04, 0x00, 0x01, 0x02, 0x00, 0x00, 0x00, 0x00, 0x01, 198,
        18, 1, 1, 0, 0, 0, 0, 0, 0, 198, 18, 2, 11,
    ];

    #[test]
    fn parse_request() {
        let r = ArpRepr::parse(&ArpPacket::new_checked(&REQUEST[..]).unwrap()).unwrap();
        assert_eq!(r.operation, ArpOperation::Request);
        assert_eq!(r.source_hardware_addr, EthernetAddress([2, 0, 0, 0, 0, 1]));
        assert_eq!(r.source_protocol_addr, Ipv4Addr::new(198, 18, 1, 1));
        assert_eq!(r.target_protocol_addr, Ipv4Addr::new(198, 18, 2, 11));
        let mut out = [0u8; 28];
        r.emit(&mut ArpPacket::new_unchecked(&mut out[..]));
        assert_eq!(out, REQUEST);
    }

    #[test]
    fn malformed() {
        assert!(ArpPacket::new_checked(&REQUEST[..27]).is_err());
        let mut b = REQUEST;
        b[1] = 6; // IEEE 802 hardware
        assert!(ArpRepr::parse(&ArpPacket::new_checked(&b[..]).unwrap()).is_err());
        let mut b = REQUEST;
        b[2] = 0x86; // IPv6
        assert!(ArpRepr::parse(&ArpPacket::new_checked(&b[..]).unwrap()).is_err());
        let mut b = REQUEST;
        b[7] = 3; // RARP
        assert!(ArpRepr::parse(&ArpPacket::new_checked(&b[..]).unwrap()).is_err());
        let mut b = REQUEST;
        b[5] = 16;
        assert!(ArpRepr::parse(&ArpPacket::new_checked(&b[..]).unwrap()).is_err());
    }
}
