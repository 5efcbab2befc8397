//! The Internet checksum (RFC 1071) and its incremental update (RFC 1624).
//!
//! Used by every layer that writes IPv4, ICMP, UDP or TCP headers, and by the
//! switch when it rewrites an address. Pure functions over byte slices: no
//! allocation, no panics for any input length.

use std::net::Ipv4Addr;

/// Adds `data` to a running one's-complement sum (not yet complemented;
/// returned folded to 16 bits, so that callers may keep adding).
#[inline]
pub fn accumulate(sum: u32, data: &[u8]) -> u32 {
    // 64-bit words in native byte order, added with end-around carry: the
    // one's-complement sum of the 16-bit words they hold (2^16 = 1 modulo
    // 2^16 - 1), byte-swapped on a little-endian CPU, which the sum
    // commutes with (RFC 1071 section 2(B)); swapped back once at the end.
    // A quarter of the additions of 16-bit words, no swap per word (every
    // TCP segment received and sent is summed here). The tail is one more
    // word padded with zeros: a last odd byte is the high byte of its pair.
    let add = |acc: u64, v: u64| {
        let (s, carry) = acc.overflowing_add(v);
        s + u64::from(carry)
    };
    let mut acc = 0u64;
    let mut words = data.chunks_exact(8);
    for w in &mut words {
        acc = add(
            acc,
            u64::from_ne_bytes([w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7]]),
        );
    }
    let rest = words.remainder();
    if !rest.is_empty() {
        let mut last = [0u8; 8];
        last[..rest.len()].copy_from_slice(rest);
        acc = add(acc, u64::from_ne_bytes(last));
    }
    // Folds keep a non-zero sum non-zero: `finish` tells 0x0000 from
    // 0xffff as before.
    let fold = |mut x: u64| {
        while x > 0xffff {
            x = (x & 0xffff) + (x >> 16);
        }
        x
    };
    let native = fold((acc & 0xffff_ffff) + (acc >> 32)) as u16;
    fold(u64::from(sum) + u64::from(u16::from_be(native))) as u32
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

    /// RFC 1071's definition, 16-bit word by word.
    fn reference(mut sum: u32, data: &[u8]) -> u16 {
        for (i, b) in data.iter().enumerate() {
            sum += u32::from(*b) << if i % 2 == 0 { 8 } else { 0 };
        }
        finish(sum)
    }

    #[test]
    fn word_sums_match_the_16_bit_definition() {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let mut data = [0u8; 1600];
        for round in 0..4000 {
            let len = (next() % 1600) as usize;
            for b in &mut data[..len] {
                // All-0xff and all-zero runs as well as random bytes.
                *b = match round % 4 {
                    0 => 0xff,
                    1 => 0,
                    _ => next() as u8,
                };
            }
            let start = (next() % 0x2_0000) as u32 * u32::from(round % 3 != 0);
            let d = &data[..len];
            assert_eq!(
                finish(accumulate(start, d)),
                reference(start, d),
                "len {len}"
            );
            // Split anywhere (even offsets, as the pseudo-header does).
            let cut = (next() as usize % (len + 1)) & !1;
            let split = accumulate(accumulate(start, &d[..cut]), &d[cut..]);
            assert_eq!(finish(split), reference(start, d), "len {len} cut {cut}");
        }
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
