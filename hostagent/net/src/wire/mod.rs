//! Byte layouts of the link and network layers: Ethernet II, ARP (IPv4 over
//! Ethernet), IPv4 and ICMPv4 echo.
//!
//! Each format has a zero-copy view `Xxx<T: AsRef<[u8]>>` with a private
//! `mod field` of byte ranges, and a `XxxRepr` with `parse` / `emit` /
//! `buffer_len`.
//!
//! Invariant: a view built with `new_checked` has been length-validated once,
//! so none of its accessors can panic afterwards, whatever the bytes are.
//! `new_unchecked` exists for emitting into a buffer the caller already sized
//! with `buffer_len`; accessors on an unchecked view may panic if the buffer
//! is too short, which is a bug in the caller, never a reaction to input.

pub mod arp;
pub mod ethernet;
pub mod icmpv4;
pub mod ipv4;

pub use arp::{ArpOperation, ArpPacket, ArpRepr};
pub use ethernet::{EtherType, EthernetAddress, EthernetFrame, EthernetRepr};
pub use icmpv4::{Icmpv4Packet, Icmpv4Repr};
pub use ipv4::{Ipv4Packet, Ipv4Repr, Protocol};

/// Why bytes could not be read as a given format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// The buffer is shorter than the fixed header or than a length field says.
    #[error("truncated {layer}: {len} bytes, need {need}")]
    Truncated {
        layer: &'static str,
        len: usize,
        need: usize,
    },
    /// A field holds a value this implementation does not accept.
    #[error("malformed {layer}: {what}")]
    Malformed {
        layer: &'static str,
        what: &'static str,
    },
    /// The checksum does not verify.
    #[error("bad {layer} checksum")]
    Checksum { layer: &'static str },
    /// Well-formed but of a kind we do not handle (e.g. ARP for IPv6).
    #[error("unsupported {layer}: {what}")]
    Unsupported {
        layer: &'static str,
        what: &'static str,
    },
}

pub type Result<T> = core::result::Result<T, WireError>;

/// Reads a big-endian u16 at `at`. Callers guarantee the range is in bounds
/// (checked once by `new_checked`).
#[inline]
pub(crate) fn be16(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([b[at], b[at + 1]])
}

#[inline]
pub(crate) fn put16(b: &mut [u8], at: usize, v: u16) {
    b[at..at + 2].copy_from_slice(&v.to_be_bytes());
}

#[inline]
pub(crate) fn ipv4_at(b: &[u8], at: usize) -> std::net::Ipv4Addr {
    std::net::Ipv4Addr::new(b[at], b[at + 1], b[at + 2], b[at + 3])
}
