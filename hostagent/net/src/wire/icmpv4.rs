//! ICMPv4 (RFC 792), echo request and echo reply only. Other message types
//! are visible through the view but `Icmpv4Repr::parse` reports them as
//! `Unsupported`.

use super::{be16, put16, Result, WireError};
use capybara_proto::checksum;

mod field {
    use core::ops::RangeFrom;
    pub const TYPE: usize = 0;
    pub const CODE: usize = 1;
    pub const CHECKSUM: usize = 2;
    pub const ECHO_IDENT: usize = 4;
    pub const ECHO_SEQNO: usize = 6;
    pub const ECHO_DATA: RangeFrom<usize> = 8..;
}

/// Length of the echo header (type, code, checksum, identifier, sequence).
pub const HEADER_LEN: usize = field::ECHO_DATA.start;
pub const TYPE_ECHO_REPLY: u8 = 0;
pub const TYPE_ECHO_REQUEST: u8 = 8;

/// A view of an ICMPv4 message (the whole IPv4 payload).
#[derive(Debug, Clone)]
pub struct Icmpv4Packet<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> Icmpv4Packet<T> {
    pub fn new_unchecked(buffer: T) -> Self {
        Icmpv4Packet { buffer }
    }
    /// Validates the 8-byte header; no accessor panics afterwards.
    pub fn new_checked(buffer: T) -> Result<Self> {
        let len = buffer.as_ref().len();
        if len < HEADER_LEN {
            return Err(WireError::Truncated {
                layer: "icmpv4",
                len,
                need: HEADER_LEN,
            });
        }
        Ok(Icmpv4Packet { buffer })
    }
    fn b(&self) -> &[u8] {
        self.buffer.as_ref()
    }
    pub fn msg_type(&self) -> u8 {
        self.b()[field::TYPE]
    }
    pub fn msg_code(&self) -> u8 {
        self.b()[field::CODE]
    }
    pub fn checksum(&self) -> u16 {
        be16(self.b(), field::CHECKSUM)
    }
    pub fn echo_ident(&self) -> u16 {
        be16(self.b(), field::ECHO_IDENT)
    }
    pub fn echo_seq_no(&self) -> u16 {
        be16(self.b(), field::ECHO_SEQNO)
    }
    pub fn data(&self) -> &[u8] {
        &self.b()[field::ECHO_DATA]
    }
    /// The checksum covers the whole message.
    pub fn verify_checksum(&self) -> bool {
        checksum::checksum(self.b()) == 0
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Icmpv4Packet<T> {
    fn bm(&mut self) -> &mut [u8] {
        self.buffer.as_mut()
    }
    pub fn set_msg_type(&mut self, v: u8) {
        self.bm()[field::TYPE] = v
    }
    pub fn set_msg_code(&mut self, v: u8) {
        self.bm()[field::CODE] = v
    }
    pub fn set_echo_ident(&mut self, v: u16) {
        put16(self.bm(), field::ECHO_IDENT, v)
    }
    pub fn set_echo_seq_no(&mut self, v: u16) {
        put16(self.bm(), field::ECHO_SEQNO, v)
    }
    pub fn data_mut(&mut self) -> &mut [u8] {
        &mut self.bm()[field::ECHO_DATA]
    }
    pub fn fill_checksum(&mut self) {
        put16(self.bm(), field::CHECKSUM, 0);
        let c = checksum::checksum(self.b());
        put16(self.bm(), field::CHECKSUM, c);
    }
}

/// An echo request or reply, borrowing its data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Icmpv4Repr<'a> {
    EchoRequest {
        ident: u16,
        seq_no: u16,
        data: &'a [u8],
    },
    EchoReply {
        ident: u16,
        seq_no: u16,
        data: &'a [u8],
    },
}

impl<'a> Icmpv4Repr<'a> {
    /// Verifies the checksum and accepts echo request/reply with code 0.
    pub fn parse<T: AsRef<[u8]> + ?Sized>(p: &'a Icmpv4Packet<&'a T>) -> Result<Self> {
        if !p.verify_checksum() {
            return Err(WireError::Checksum { layer: "icmpv4" });
        }
        if p.msg_code() != 0 {
            return Err(WireError::Unsupported {
                layer: "icmpv4",
                what: "non-zero code",
            });
        }
        let data = &p.buffer.as_ref()[field::ECHO_DATA];
        let (ident, seq_no) = (p.echo_ident(), p.echo_seq_no());
        match p.msg_type() {
            TYPE_ECHO_REQUEST => Ok(Icmpv4Repr::EchoRequest {
                ident,
                seq_no,
                data,
            }),
            TYPE_ECHO_REPLY => Ok(Icmpv4Repr::EchoReply {
                ident,
                seq_no,
                data,
            }),
            _ => Err(WireError::Unsupported {
                layer: "icmpv4",
                what: "type other than echo",
            }),
        }
    }

    pub fn buffer_len(&self) -> usize {
        match self {
            Icmpv4Repr::EchoRequest { data, .. } | Icmpv4Repr::EchoReply { data, .. } => {
                HEADER_LEN + data.len()
            }
        }
    }

    /// Writes the message and its checksum; `p` must be exactly
    /// `buffer_len()` bytes long (the checksum covers the whole buffer).
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, p: &mut Icmpv4Packet<T>) {
        let (ty, ident, seq_no, data) = match *self {
            Icmpv4Repr::EchoRequest {
                ident,
                seq_no,
                data,
            } => (TYPE_ECHO_REQUEST, ident, seq_no, data),
            Icmpv4Repr::EchoReply {
                ident,
                seq_no,
                data,
            } => (TYPE_ECHO_REPLY, ident, seq_no, data),
        };
        p.set_msg_type(ty);
        p.set_msg_code(0);
        p.set_echo_ident(ident);
        p.set_echo_seq_no(seq_no);
        p.data_mut()[..data.len()].copy_from_slice(data);
        p.fill_checksum();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let repr = Icmpv4Repr::EchoRequest {
            ident: 0x4242,
            seq_no: 7,
            data: b"ping data",
        };
        let mut buf = vec![0u8; repr.buffer_len()];
        repr.emit(&mut Icmpv4Packet::new_unchecked(&mut buf[..]));
        let p = Icmpv4Packet::new_checked(&buf[..]).unwrap();
        assert!(p.verify_checksum());
        assert_eq!(Icmpv4Repr::parse(&p).unwrap(), repr);
    }

    #[test]
    fn malformed() {
        assert!(Icmpv4Packet::new_checked(&[8u8, 0, 0, 0, 0, 0, 0][..]).is_err());
        let repr = Icmpv4Repr::EchoReply {
            ident: 1,
            seq_no: 2,
            data: b"x",
        };
        let mut buf = vec![0u8; repr.buffer_len()];
        repr.emit(&mut Icmpv4Packet::new_unchecked(&mut buf[..]));
        let mut bad = buf.clone();
        bad[8] ^= 0xff;
        assert_eq!(
            Icmpv4Repr::parse(&Icmpv4Packet::new_checked(&bad[..]).unwrap()),
            Err(WireError::Checksum { layer: "icmpv4" })
        );
        // Destination unreachable with a valid checksum: unsupported.
        let mut unreach = buf.clone();
        unreach[0] = 3;
        Icmpv4Packet::new_unchecked(&mut unreach[..]).fill_checksum();
        assert!(matches!(
            Icmpv4Repr::parse(&Icmpv4Packet::new_checked(&unreach[..]).unwrap()),
            Err(WireError::Unsupported { .. })
        ));
    }
}
