//! Initial sequence numbers per RFC 6528: ISN = M + F(4-tuple, key), with M a
//! 4 µs timer taken from the injected `now` and F SipHash-2-4 keyed with a
//! deployment secret. The key and the clock come from the caller, so tests
//! are deterministic.

use std::net::SocketAddrV4;

use capybara_proto::time::Instant;

use crate::seq::SeqNum;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IsnGenerator {
    k0: u64,
    k1: u64,
}

impl IsnGenerator {
    pub fn new(key: [u8; 16]) -> Self {
        let mut a = [0u8; 8];
        let mut b = [0u8; 8];
        a.copy_from_slice(&key[..8]);
        b.copy_from_slice(&key[8..]);
        IsnGenerator {
            k0: u64::from_le_bytes(a),
            k1: u64::from_le_bytes(b),
        }
    }

    pub fn isn(&self, now: Instant, local: SocketAddrV4, remote: SocketAddrV4) -> SeqNum {
        let mut msg = [0u8; 12];
        msg[..4].copy_from_slice(&local.ip().octets());
        msg[4..6].copy_from_slice(&local.port().to_be_bytes());
        msg[6..10].copy_from_slice(&remote.ip().octets());
        msg[10..12].copy_from_slice(&remote.port().to_be_bytes());
        let f = siphash24(self.k0, self.k1, &msg) as u32;
        let m = (now.as_micros() / 4) as u32;
        SeqNum(m.wrapping_add(f))
    }

    /// A keyed per-connection value (timestamp offsets).
    pub fn secret_u32(&self, salt: u32, local: SocketAddrV4, remote: SocketAddrV4) -> u32 {
        let mut msg = [0u8; 16];
        msg[..4].copy_from_slice(&salt.to_be_bytes());
        msg[4..8].copy_from_slice(&local.ip().octets());
        msg[8..10].copy_from_slice(&local.port().to_be_bytes());
        msg[10..14].copy_from_slice(&remote.ip().octets());
        msg[14..16].copy_from_slice(&remote.port().to_be_bytes());
        siphash24(self.k0, self.k1, &msg) as u32
    }
}

/// SipHash-2-4 (Aumasson & Bernstein) of a short message.
fn siphash24(k0: u64, k1: u64, msg: &[u8]) -> u64 {
    let mut v0 = k0 ^ 0x736f6d6570736575;
    let mut v1 = k1 ^ 0x646f72616e646f6d;
    let mut v2 = k0 ^ 0x6c7967656e657261;
    let mut v3 = k1 ^ 0x7465646279746573;
    macro_rules! round {
        () => {
            v0 = v0.wrapping_add(v1);
            v1 = v1.rotate_left(13);
            v1 ^= v0;
            v0 = v0.rotate_left(32);
            v2 = v2.wrapping_add(v3);
            v3 = v3.rotate_left(16);
            v3 ^= v2;
            v0 = v0.wrapping_add(v3);
            v3 = v3.rotate_left(21);
            v3 ^= v0;
            v2 = v2.wrapping_add(v1);
            v1 = v1.rotate_left(17);
            v1 ^= v2;
            v2 = v2.rotate_left(32);
        };
    }
    let mut chunks = msg.chunks_exact(8);
    for c in &mut chunks {
        let mut w = [0u8; 8];
        w.copy_from_slice(c);
        let m = u64::from_le_bytes(w);
        v3 ^= m;
        round!();
        round!();
        v0 ^= m;
    }
    let rem = chunks.remainder();
    let mut last = [0u8; 8];
    last[..rem.len()].copy_from_slice(rem);
    let m = u64::from_le_bytes(last) | ((msg.len() as u64 & 0xff) << 56);
    v3 ^= m;
    round!();
    round!();
    v0 ^= m;
    v2 ^= 0xff;
    round!();
    round!();
    round!();
    round!();
    v0 ^ v1 ^ v2 ^ v3
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn siphash_reference_vector() {
        // Reference vector from the SipHash paper: key 00..0f, message 00..0e.
        let key: Vec<u8> = (0..16).collect();
        let msg: Vec<u8> = (0..15).collect();
        let k0 = u64::from_le_bytes(key[..8].try_into().unwrap());
        let k1 = u64::from_le_bytes(key[8..].try_into().unwrap());
        assert_eq!(siphash24(k0, k1, &msg), 0xa129ca6149be45e5);
    }

    #[test]
    fn isn_depends_on_tuple_key_and_clock() {
        let g = IsnGenerator::new([7; 16]);
        let l: SocketAddrV4 = "10.0.0.1:80".parse().unwrap();
        let r: SocketAddrV4 = "10.0.0.2:5000".parse().unwrap();
        let r2: SocketAddrV4 = "10.0.0.2:5001".parse().unwrap();
        let a = g.isn(Instant::ZERO, l, r);
        assert_ne!(a, g.isn(Instant::ZERO, l, r2));
        assert_ne!(a, IsnGenerator::new([8; 16]).isn(Instant::ZERO, l, r));
        assert_eq!(g.isn(Instant::from_micros(400), l, r), a.add(100));
    }
}
