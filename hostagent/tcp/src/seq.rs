//! TCP sequence numbers: 32-bit values compared modulo 2^32 (RFC 793 §3.3,
//! RFC 1982 serial arithmetic). Two numbers more than 2^31 apart have no
//! meaningful order; TCP windows are far smaller, so comparisons inside a
//! connection are always within range.

use std::cmp::Ordering;
use std::fmt;

/// A sequence (or acknowledgment) number.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct SeqNum(pub u32);

impl SeqNum {
    /// `self + n`, wrapping.
    #[inline]
    pub const fn add(self, n: u32) -> SeqNum {
        SeqNum(self.0.wrapping_add(n))
    }
    /// `self - n`, wrapping.
    #[inline]
    pub const fn sub(self, n: u32) -> SeqNum {
        SeqNum(self.0.wrapping_sub(n))
    }
    /// Signed distance `self - other` (positive when `self` is later).
    #[inline]
    pub const fn diff(self, other: SeqNum) -> i32 {
        self.0.wrapping_sub(other.0) as i32
    }
    /// Bytes from `earlier` to `self`, zero when `self` is not later.
    #[inline]
    pub const fn since(self, earlier: SeqNum) -> u32 {
        let d = self.diff(earlier);
        if d > 0 {
            d as u32
        } else {
            0
        }
    }
    #[inline]
    pub fn max(self, other: SeqNum) -> SeqNum {
        if self.diff(other) >= 0 {
            self
        } else {
            other
        }
    }
    #[inline]
    pub fn min(self, other: SeqNum) -> SeqNum {
        if self.diff(other) <= 0 {
            self
        } else {
            other
        }
    }
}

impl PartialOrd for SeqNum {
    #[inline]
    fn partial_cmp(&self, other: &SeqNum) -> Option<Ordering> {
        Some(self.diff(*other).cmp(&0))
    }
}

impl fmt::Debug for SeqNum {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

impl fmt::Display for SeqNum {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wraps_around() {
        let a = SeqNum(u32::MAX - 1);
        let b = a.add(4);
        assert_eq!(b, SeqNum(2));
        assert!(a < b);
        assert_eq!(b.since(a), 4);
        assert_eq!(a.since(b), 0);
        assert_eq!(a.max(b), b);
    }
}
