//! The Internet checksum (RFC 1071) and its incremental update (RFC 1624).
//!
//! Used by every layer that writes IPv4, ICMP, UDP or TCP headers, and by the
//! switch when it rewrites an address. Pure functions over byte slices: no
//! allocation, no panics for any input length.

use std::net::Ipv4Addr;

/// Adds `data` to a running one's-complement sum (not yet folded).
#[inline]
pub fn accumulate(mut sum: u32, data: &[u8]) -> u32 {
    let mut chunks = data.chunks_exact(2);
    for c in &mut chunks {
        sum = sum.wrapping_add(u32::from(u16::from_be_bytes([c[0], c[1]])));
    }
    if let [last] = chunks.remainder() {
        sum = sum.wrapping_add(u32::from(*last) << 8);
    }
    sum
}

/// Folds a running sum into 16 bits and complements it.
#[inline]
pub fn finish(mut sum: u32) -> u16 {
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// Checksum of `data` alone (IPv4 header, ICMP message).
#[inline]
pub fn checksum(data: &[u8]) -> u16 {
    finish(accumulate(0, data))
}

/// Sum of the IPv4 pseudo-header used by TCP and UDP.
#[inline]
pub fn pseudo_header(src: Ipv4Addr, dst: Ipv4Addr, protocol: u8, length: u16) -> u32 {
    let mut sum = accumulate(0, &src.octets());
    sum = accumulate(sum, &dst.octets());
    sum = sum.wrapping_add(u32::from(protocol));
    sum.wrapping_add(u32::from(length))
}

/// Checksum of a TCP or UDP segment (`segment` includes its header, with the
/// checksum field either zeroed, when computing, or in place, when verifying:
/// a valid segment then yields 0).
#[inline]
pub fn transport(src: Ipv4Addr, dst: Ipv4Addr, protocol: u8, segment: &[u8]) -> u16 {
    let len = u16::try_from(segment.len()).unwrap_or(u16::MAX);
    finish(accumulate(pseudo_header(src, dst, protocol, len), segment))
}

/// Incrementally updates checksum `old_csum` after a 16-bit field changed
/// from `old` to `new` (RFC 1624, eqn. 3).
#[inline]
pub fn update16(old_csum: u16, old: u16, new: u16) -> u16 {
    let sum = u32::from(!old_csum) + u32::from(!old) + u32::from(new);
    finish(sum)
}

/// Incrementally updates a checksum after a 32-bit field (an IPv4 address)
/// changed from `old` to `new`.
#[inline]
pub fn update32(old_csum: u16, old: u32, new: u32) -> u16 {
    let c = update16(old_csum, (old >> 16) as u16, (new >> 16) as u16);
    update16(c, old as u16, new as u16)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc1071_example() {
        // Example from RFC 1071 §3: 0001 f203 f4f5 f6f7 sums to 0xddf2.
        let data = [0x00, 0x01, 0xf2, 0x03, 0xf4, 0xf5, 0xf6, 0xf7];
        assert_eq!(checksum(&data), !0xddf2);
    }

    #[test]
    fn odd_length_pads_with_zero() {
        assert_eq!(checksum(&[0xab]), checksum(&[0xab, 0x00]));
    }

    #[test]
    fn incremental_matches_full_recompute() {
        let mut hdr = [
            0x45u8, 0, 0, 0x54, 0x12, 0x34, 0x40, 0, 64, 6, 0, 0, 198, 18, 0, 11, 198, 18, 100, 1,
        ];
        let c = checksum(&hdr);
        hdr[10..12].copy_from_slice(&c.to_be_bytes());
        let old = u32::from_be_bytes([hdr[16], hdr[17], hdr[18], hdr[19]]);
        let new = u32::from(Ipv4Addr::new(198, 18, 2, 11));
        hdr[16..20].copy_from_slice(&new.to_be_bytes());
        let inc = update32(c, old, new);
        hdr[10..12].copy_from_slice(&[0, 0]);
        assert_eq!(inc, checksum(&hdr));
    }
}
