//! The target's per-flow buffer of client TCP segments.
//!
//! Invariants: storage is allocated once when the buffer is created (at
//! PREPARE time, or reused from the engine's pool) and never grows; a
//! segment is stored whole or not at all; segments come back in arrival
//! order.

#[derive(Debug)]
pub(crate) struct SegmentBuffer {
    data: Vec<u8>,
    spans: Vec<(u32, u32)>,
    max_bytes: usize,
    max_segments: usize,
}

impl SegmentBuffer {
    pub(crate) fn new(max_bytes: usize, max_segments: usize) -> Self {
        SegmentBuffer {
            data: Vec::with_capacity(max_bytes),
            spans: Vec::with_capacity(max_segments),
            max_bytes,
            max_segments,
        }
    }

    /// Stores `seg` if it fits in both bounds.
    pub(crate) fn push(&mut self, seg: &[u8]) -> bool {
        if self.spans.len() >= self.max_segments
            || self.data.len() + seg.len() > self.max_bytes
            || u32::try_from(seg.len()).is_err()
        {
            return false;
        }
        let start = self.data.len() as u32;
        // Within capacity (checked above): no reallocation.
        self.data.extend_from_slice(seg);
        self.spans.push((start, seg.len() as u32));
        true
    }

    pub(crate) fn len(&self) -> usize {
        self.spans.len()
    }

    pub(crate) fn bytes(&self) -> usize {
        self.data.len()
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = &[u8]> {
        self.spans
            .iter()
            .map(|&(s, l)| &self.data[s as usize..(s + l) as usize])
    }

    pub(crate) fn clear(&mut self) {
        self.data.clear();
        self.spans.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounded_by_bytes_and_count() {
        let mut b = SegmentBuffer::new(10, 3);
        assert!(b.push(&[1; 4]));
        assert!(b.push(&[2; 6]));
        assert!(!b.push(&[3; 1]), "byte bound");
        b.clear();
        assert!(b.push(&[]));
        assert!(b.push(&[]));
        assert!(b.push(&[]));
        assert!(!b.push(&[]), "count bound");
        let cap = b.data.capacity();
        b.clear();
        assert!(b.push(&[7; 10]));
        assert_eq!(b.data.capacity(), cap);
        assert_eq!(b.iter().collect::<Vec<_>>(), vec![&[7u8; 10][..]]);
    }
}
