//! Ethernet II frames (no 802.1Q tags: a VLAN-tagged frame shows its TPID as
//! the EtherType and is dropped by the interface as an unknown type).

use super::{be16, put16, Result, WireError};
use core::fmt;

/// A 48-bit MAC address.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default, PartialOrd, Ord)]
pub struct EthernetAddress(pub [u8; 6]);

impl EthernetAddress {
    pub const BROADCAST: EthernetAddress = EthernetAddress([0xff; 6]);
    pub const ZERO: EthernetAddress = EthernetAddress([0; 6]);

    pub fn from_bytes(b: &[u8]) -> Option<Self> {
        b.try_into().ok().map(EthernetAddress)
    }
    pub fn as_bytes(&self) -> &[u8; 6] {
        &self.0
    }
    pub fn is_broadcast(&self) -> bool {
        *self == Self::BROADCAST
    }
    /// Group bit set: multicast or broadcast.
    pub fn is_multicast(&self) -> bool {
        self.0[0] & 1 != 0
    }
    /// A unicast address other than all-zero: the only kind a host may use as
    /// its own or learn as a neighbour's.
    pub fn is_unicast(&self) -> bool {
        !self.is_multicast() && *self != Self::ZERO
    }
}

impl fmt::Display for EthernetAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = self.0;
        write!(
            f,
            "{:02x}:{:02x}:{:02x}:{:02x}:{:02x}:{:02x}",
            b[0], b[1], b[2], b[3], b[4], b[5]
        )
    }
}

impl fmt::Debug for EthernetAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl core::str::FromStr for EthernetAddress {
    type Err = WireError;
    fn from_str(s: &str) -> Result<Self> {
        const BAD: WireError = WireError::Malformed {
            layer: "mac address",
            what: "expected aa:bb:cc:dd:ee:ff",
        };
        let mut out = [0u8; 6];
        let mut parts = s.split(':');
        for o in out.iter_mut() {
            let p = parts.next().ok_or(BAD)?;
            if p.len() != 2 {
                return Err(BAD);
            }
            *o = u8::from_str_radix(p, 16).map_err(|_| BAD)?;
        }
        if parts.next().is_some() {
            return Err(BAD);
        }
        Ok(EthernetAddress(out))
    }
}

/// EtherType values the stack knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EtherType {
    Ipv4,
    Arp,
    Unknown(u16),
}

impl From<u16> for EtherType {
    fn from(v: u16) -> Self {
        match v {
            0x0800 => EtherType::Ipv4,
            0x0806 => EtherType::Arp,
            other => EtherType::Unknown(other),
        }
    }
}

impl From<EtherType> for u16 {
    fn from(t: EtherType) -> u16 {
        match t {
            EtherType::Ipv4 => 0x0800,
            EtherType::Arp => 0x0806,
            EtherType::Unknown(v) => v,
        }
    }
}

mod field {
    use core::ops::{Range, RangeFrom};
    pub const DESTINATION: Range<usize> = 0..6;
    pub const SOURCE: Range<usize> = 6..12;
    pub const ETHERTYPE: usize = 12;
    pub const PAYLOAD: RangeFrom<usize> = 14..;
}

/// Length of the Ethernet II header.
pub const HEADER_LEN: usize = field::PAYLOAD.start;

/// A view of an Ethernet II frame (without FCS, as devices deliver it).
#[derive(Debug, Clone)]
pub struct EthernetFrame<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> EthernetFrame<T> {
    pub fn new_unchecked(buffer: T) -> Self {
        EthernetFrame { buffer }
    }

    /// Validates that the header fits; after this no accessor panics.
    pub fn new_checked(buffer: T) -> Result<Self> {
        let len = buffer.as_ref().len();
        if len < HEADER_LEN {
            return Err(WireError::Truncated {
                layer: "ethernet",
                len,
                need: HEADER_LEN,
            });
        }
        Ok(EthernetFrame { buffer })
    }

    pub fn into_inner(self) -> T {
        self.buffer
    }
    pub fn dst_addr(&self) -> EthernetAddress {
        let mut a = [0; 6];
        a.copy_from_slice(&self.buffer.as_ref()[field::DESTINATION]);
        EthernetAddress(a)
    }
    pub fn src_addr(&self) -> EthernetAddress {
        let mut a = [0; 6];
        a.copy_from_slice(&self.buffer.as_ref()[field::SOURCE]);
        EthernetAddress(a)
    }
    pub fn ethertype(&self) -> EtherType {
        be16(self.buffer.as_ref(), field::ETHERTYPE).into()
    }
    /// Everything after the header, including any link-layer padding (the
    /// network layer trims padding using its own length field).
    pub fn payload(&self) -> &[u8] {
        &self.buffer.as_ref()[field::PAYLOAD]
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> EthernetFrame<T> {
    pub fn set_dst_addr(&mut self, a: EthernetAddress) {
        self.buffer.as_mut()[field::DESTINATION].copy_from_slice(&a.0);
    }
    pub fn set_src_addr(&mut self, a: EthernetAddress) {
        self.buffer.as_mut()[field::SOURCE].copy_from_slice(&a.0);
    }
    pub fn set_ethertype(&mut self, t: EtherType) {
        put16(self.buffer.as_mut(), field::ETHERTYPE, t.into());
    }
    pub fn payload_mut(&mut self) -> &mut [u8] {
        &mut self.buffer.as_mut()[field::PAYLOAD]
    }
}

/// The header fields of an Ethernet II frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EthernetRepr {
    pub src_addr: EthernetAddress,
    pub dst_addr: EthernetAddress,
    pub ethertype: EtherType,
}

impl EthernetRepr {
    pub fn parse<T: AsRef<[u8]>>(frame: &EthernetFrame<T>) -> Result<Self> {
        Ok(EthernetRepr {
            src_addr: frame.src_addr(),
            dst_addr: frame.dst_addr(),
            ethertype: frame.ethertype(),
        })
    }
    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN
    }
    /// Writes the header; `frame` must hold at least `buffer_len()` bytes.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, frame: &mut EthernetFrame<T>) {
        frame.set_dst_addr(self.dst_addr);
        frame.set_src_addr(self.src_addr);
        frame.set_ethertype(self.ethertype);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let repr = EthernetRepr {
            src_addr: EthernetAddress([2, 0, 0, 0, 0, 1]),
            dst_addr: EthernetAddress::BROADCAST,
            ethertype: EtherType::Arp,
        };
        let mut buf = [0u8; 20];
        repr.emit(&mut EthernetFrame::new_unchecked(&mut buf[..]));
        let f = EthernetFrame::new_checked(&buf[..]).unwrap();
        assert_eq!(EthernetRepr::parse(&f).unwrap(), repr);
        assert_eq!(f.payload().len(), 6);
        assert_eq!(&buf[12..14], &[0x08, 0x06]);
    }

    #[test]
    fn truncated() {
        for n in 0..HEADER_LEN {
            assert!(matches!(
                EthernetFrame::new_checked(&[0u8; 14][..n]),
                Err(WireError::Truncated { .. })
            ));
        }
    }

    #[test]
    fn mac_parse_display() {
        let m: EthernetAddress = "02:aa:bb:cc:dd:0f".parse().unwrap();
        assert_eq!(m.to_string(), "02:aa:bb:cc:dd:0f");
        assert!(m.is_unicast());
        assert!("02:aa:bb:cc:dd".parse::<EthernetAddress>().is_err());
        assert!("02:aa:bb:cc:dd:0f:00".parse::<EthernetAddress>().is_err());
        assert!("02:aa:bb:cc:dd:zz".parse::<EthernetAddress>().is_err());
        assert!(EthernetAddress::BROADCAST.is_multicast());
        assert!(!EthernetAddress::ZERO.is_unicast());
    }
}
