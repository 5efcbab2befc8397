//! CONN_STATE fragmentation and reassembly.
//!
//! A connection snapshot (TCP control block, queues, application state) can
//! exceed one datagram (seed 000 §8.2.3: up to 128 KB of TLS state), so the
//! origin splits it into `frag_count` CONN_STATE messages. The wire rule that
//! makes zero-copy reassembly possible without knowing the sender's MTU:
//!
//! **every fragment except the last carries exactly the same number of bytes
//! (the chunk size, > 0); the last carries 1..=chunk bytes** (an empty
//! snapshot is one fragment with an empty payload). Fragment `i` therefore
//! starts at `i * chunk`.
//!
//! [`Reassembly`] invariants:
//! - its buffer is allocated once, at construction, with the configured
//!   maximum snapshot size; accepting fragments never allocates;
//! - fragments are accepted in any order and any number of times; a
//!   duplicate changes nothing;
//! - a fragment that contradicts what was accepted before (count, chunk
//!   size) or would push the snapshot past the maximum is refused with a
//!   typed error and leaves the state unchanged;
//! - the snapshot is exposed only when every fragment has arrived.

use thiserror::Error;

use crate::mac::MAC_LEN;
use crate::tcpmig::{HEADER_LEN, MAX_PAYLOAD_LEN};

/// IPv4 header without options plus UDP header.
const IPV4_UDP_OVERHEAD: usize = 20 + 8;

/// Most snapshot bytes one CONN_STATE can carry on a link with IP MTU
/// `mtu` (e.g. 1500): MTU minus IPv4, UDP, TCPMig header and MAC.
pub const fn max_fragment_payload(mtu: usize) -> usize {
    let p = mtu.saturating_sub(IPV4_UDP_OVERHEAD + HEADER_LEN + MAC_LEN);
    if p > MAX_PAYLOAD_LEN {
        MAX_PAYLOAD_LEN
    } else {
        p
    }
}

/// Why a snapshot cannot be split.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum SplitError {
    #[error("MTU {mtu} leaves no room for snapshot bytes in a CONN_STATE")]
    MtuTooSmall { mtu: usize },
    #[error("snapshot of {len} bytes needs more than 65535 fragments at {chunk} bytes each")]
    TooManyFragments { len: usize, chunk: usize },
}

/// One CONN_STATE fragment to send.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fragment<'a> {
    pub index: u16,
    pub count: u16,
    pub payload: &'a [u8],
}

/// The fragments of a snapshot, in order; borrows the snapshot.
#[derive(Debug, Clone)]
pub struct Fragments<'a> {
    snapshot: &'a [u8],
    chunk: usize,
    next: u16,
    count: u16,
}

impl<'a> Fragments<'a> {
    pub fn count(&self) -> u16 {
        self.count
    }
    pub fn chunk_size(&self) -> usize {
        self.chunk
    }
    /// Fragment `index` (for retransmission), `None` if out of range.
    pub fn get(&self, index: u16) -> Option<Fragment<'a>> {
        if index >= self.count {
            return None;
        }
        let start = usize::from(index) * self.chunk;
        let end = (start + self.chunk).min(self.snapshot.len());
        Some(Fragment {
            index,
            count: self.count,
            payload: &self.snapshot[start..end],
        })
    }
}

impl<'a> Iterator for Fragments<'a> {
    type Item = Fragment<'a>;
    fn next(&mut self) -> Option<Fragment<'a>> {
        let f = self.get(self.next)?;
        self.next += 1;
        Some(f)
    }
    fn size_hint(&self) -> (usize, Option<usize>) {
        let n = usize::from(self.count - self.next);
        (n, Some(n))
    }
}

impl ExactSizeIterator for Fragments<'_> {}

/// Splits `snapshot` into fragments that fit IP MTU `mtu`.
pub fn split(snapshot: &[u8], mtu: usize) -> Result<Fragments<'_>, SplitError> {
    split_chunks(snapshot, max_fragment_payload(mtu)).map_err(|e| match e {
        SplitError::MtuTooSmall { .. } => SplitError::MtuTooSmall { mtu },
        e => e,
    })
}

/// Splits `snapshot` into fragments of `chunk` bytes (the last shorter).
pub fn split_chunks(snapshot: &[u8], chunk: usize) -> Result<Fragments<'_>, SplitError> {
    if chunk == 0 {
        return Err(SplitError::MtuTooSmall { mtu: 0 });
    }
    let chunk = chunk.min(MAX_PAYLOAD_LEN);
    let count = snapshot.len().div_ceil(chunk).max(1);
    let count = u16::try_from(count).map_err(|_| SplitError::TooManyFragments {
        len: snapshot.len(),
        chunk,
    })?;
    Ok(Fragments {
        snapshot,
        chunk,
        next: 0,
        count,
    })
}

/// Why a fragment was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum ReassemblyError {
    #[error("fragment index {index} is not below fragment count {count}")]
    IndexOutOfRange { index: u16, count: u16 },
    #[error("fragment count changed from {expected} to {found}")]
    CountMismatch { expected: u16, found: u16 },
    #[error("fragment {index} has {len} bytes, other fragments have {chunk}")]
    ChunkMismatch {
        index: u16,
        len: usize,
        chunk: usize,
    },
    #[error("last fragment {index} has {len} bytes, must be 1..={chunk}")]
    BadLastFragment {
        index: u16,
        len: usize,
        chunk: usize,
    },
    #[error("fragment {index} of {count} is empty")]
    EmptyFragment { index: u16, count: u16 },
    #[error("snapshot would be at least {at_least} bytes, limit is {max}")]
    TooLarge { at_least: usize, max: usize },
}

/// What accepting a fragment did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Progress {
    /// New fragment stored; `received` of `count` present.
    Stored { received: u16, count: u16 },
    /// Already had it (retransmission); nothing changed.
    Duplicate,
    /// This fragment completed the snapshot: read it with
    /// [`Reassembly::snapshot`].
    Complete,
}

/// Bounded reassembly of one snapshot.
#[derive(Debug)]
pub struct Reassembly {
    buf: Box<[u8]>,
    // One bit per fragment index; sized for the most fragments a header can
    // announce (u16) so that it never grows.
    have: Box<[u64; 1024]>,
    count: Option<u16>,
    chunk: Option<usize>,
    received: u16,
    // Length of the last fragment if it arrived before the chunk size was
    // known; it is then parked at the end of `buf` (see `accept`).
    parked_last: Option<usize>,
    last_len: Option<usize>,
}

impl Reassembly {
    /// A reassembler for snapshots of at most `max_snapshot` bytes; allocates
    /// `max_snapshot` bytes + 8 KiB now and never again.
    pub fn new(max_snapshot: usize) -> Self {
        Reassembly {
            buf: vec![0u8; max_snapshot].into_boxed_slice(),
            have: Box::new([0u64; 1024]),
            count: None,
            chunk: None,
            received: 0,
            parked_last: None,
            last_len: None,
        }
    }

    /// Forgets everything, keeping the buffers, for the next migration.
    pub fn reset(&mut self) {
        // Bits are set only below `count` (set before the first mark):
        // clear those words, not all 8 KiB, on every migration.
        let words = self.count.map_or(0, |c| usize::from(c).div_ceil(64));
        self.have[..words].fill(0);
        self.count = None;
        self.chunk = None;
        self.received = 0;
        self.parked_last = None;
        self.last_len = None;
    }

    pub fn max_snapshot(&self) -> usize {
        self.buf.len()
    }

    pub fn is_complete(&self) -> bool {
        self.count == Some(self.received) && self.received > 0
    }

    /// The whole snapshot, once every fragment is in.
    pub fn snapshot(&self) -> Option<&[u8]> {
        if !self.is_complete() {
            return None;
        }
        let count = usize::from(self.count?);
        let len = match (self.chunk, self.last_len) {
            (Some(chunk), Some(last)) => (count - 1) * chunk + last,
            // A single fragment: the snapshot is the last fragment.
            (None, Some(last)) => last,
            _ => return None,
        };
        Some(&self.buf[..len])
    }

    fn has(&self, i: u16) -> bool {
        self.have[usize::from(i / 64)] & (1 << (i % 64)) != 0
    }

    fn mark(&mut self, i: u16) {
        self.have[usize::from(i / 64)] |= 1 << (i % 64);
    }

    /// Accepts one CONN_STATE fragment.
    pub fn accept(
        &mut self,
        index: u16,
        count: u16,
        payload: &[u8],
    ) -> Result<Progress, ReassemblyError> {
        let max = self.buf.len();
        if index >= count {
            return Err(ReassemblyError::IndexOutOfRange { index, count });
        }
        if let Some(expected) = self.count {
            if expected != count {
                return Err(ReassemblyError::CountMismatch {
                    expected,
                    found: count,
                });
            }
        }
        // Each fragment but the last holds >= 1 byte: a count alone bounds
        // the size from below.
        let min_total = usize::from(count - 1) + 1;
        if count > 1 && min_total > max {
            return Err(ReassemblyError::TooLarge {
                at_least: min_total,
                max,
            });
        }
        if self.has(index) {
            return Ok(Progress::Duplicate);
        }
        let is_last = index == count - 1;
        let len = payload.len();

        // Work out the chunk size this fragment implies or must match,
        // without touching state until every check has passed.
        let chunk = if is_last {
            if count > 1 && len == 0 {
                return Err(ReassemblyError::EmptyFragment { index, count });
            }
            if let Some(chunk) = self.chunk {
                if len > chunk {
                    return Err(ReassemblyError::BadLastFragment { index, len, chunk });
                }
            }
            self.chunk
        } else {
            if len == 0 {
                return Err(ReassemblyError::EmptyFragment { index, count });
            }
            match self.chunk {
                Some(chunk) if chunk != len => {
                    return Err(ReassemblyError::ChunkMismatch { index, len, chunk });
                }
                _ => {}
            }
            if let Some(last) = self.parked_last {
                if last > len {
                    return Err(ReassemblyError::BadLastFragment {
                        index: count - 1,
                        len: last,
                        chunk: len,
                    });
                }
            }
            Some(len)
        };

        // Size check: with a chunk size the total is known once the last
        // length is known; otherwise bound it from below.
        let last_len = if is_last { Some(len) } else { self.last_len };
        let total = match chunk {
            Some(c) => usize::from(count - 1)
                .saturating_mul(c)
                .saturating_add(last_len.unwrap_or(1)),
            // Only the last fragment is known so far, and every other
            // fragment is at least as long as it.
            None => usize::from(count).saturating_mul(len),
        };
        if total > max {
            return Err(ReassemblyError::TooLarge {
                at_least: total,
                max,
            });
        }

        // Commit.
        self.count = Some(count);
        match chunk {
            Some(c) => {
                let first_time = self.chunk.is_none();
                self.chunk = Some(c);
                if first_time {
                    // Move a parked last fragment to its place. Parked at
                    // [max - last, max) and destined for
                    // [(count-1)*c, (count-1)*c + last): the total check
                    // above guarantees the destination ends by `max` and
                    // that no non-last fragment's slot overlaps the park.
                    if let Some(last) = self.parked_last.take() {
                        let dst = usize::from(count - 1) * c;
                        self.buf.copy_within(max - last..max, dst);
                    }
                }
                let start = usize::from(index) * c;
                self.buf[start..start + len].copy_from_slice(payload);
            }
            None => {
                // Last fragment before any other: its offset is unknown.
                // Park it at the very end of the buffer (see invariants).
                if count == 1 {
                    self.buf[..len].copy_from_slice(payload);
                } else {
                    self.buf[max - len..].copy_from_slice(payload);
                    self.parked_last = Some(len);
                }
            }
        }
        if is_last {
            self.last_len = Some(len);
        }
        self.mark(index);
        self.received += 1;
        if self.received == count {
            Ok(Progress::Complete)
        } else {
            Ok(Progress::Stored {
                received: self.received,
                count,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snapshot(n: usize) -> Vec<u8> {
        (0..n).map(|i| (i * 7 + i / 251) as u8).collect()
    }

    #[test]
    fn mtu_arithmetic() {
        assert_eq!(max_fragment_payload(1500), 1500 - 28 - 52 - 16);
        assert_eq!(max_fragment_payload(96), 0);
        assert_eq!(max_fragment_payload(1 << 20), 65535);
        assert_eq!(
            split(&[1, 2, 3], 96).unwrap_err(),
            SplitError::MtuTooSmall { mtu: 96 }
        );
        assert_eq!(
            split_chunks(&[0; 70000], 1).unwrap_err(),
            SplitError::TooManyFragments {
                len: 70000,
                chunk: 1
            }
        );
    }

    #[test]
    fn split_shapes() {
        let s = snapshot(3000);
        let f: Vec<_> = split(&s, 1500).unwrap().collect();
        assert_eq!(f.len(), 3);
        assert!(f.iter().all(|x| x.count == 3 && !x.payload.is_empty()));
        assert_eq!(f[0].payload.len(), 1404);
        assert_eq!(f[2].payload.len(), 3000 - 2 * 1404);
        let empty: Vec<_> = split(&[], 1500).unwrap().collect();
        assert_eq!(
            empty,
            vec![Fragment {
                index: 0,
                count: 1,
                payload: &[]
            }]
        );
        let exact: Vec<_> = split_chunks(&s, 1000).unwrap().collect();
        assert_eq!(exact.len(), 3);
        assert_eq!(exact[2].payload.len(), 1000);
    }

    fn reassemble(order: &[usize], s: &[u8], chunk: usize, max: usize) -> Vec<u8> {
        let frags: Vec<_> = split_chunks(s, chunk).unwrap().collect();
        let mut r = Reassembly::new(max);
        for (n, &i) in order.iter().enumerate() {
            let f = frags[i];
            let p = r.accept(f.index, f.count, f.payload).unwrap();
            if n + 1 == order.len() {
                assert_eq!(p, Progress::Complete);
            }
        }
        r.snapshot().unwrap().to_vec()
    }

    #[test]
    fn any_order_with_duplicates() {
        let s = snapshot(1000);
        for order in [
            vec![0, 1, 2, 3],
            vec![3, 2, 1, 0],
            vec![3, 0, 2, 1],
            vec![1, 3, 0, 2],
        ] {
            assert_eq!(reassemble(&order, &s, 300, 1000), s, "order {order:?}");
        }
        let frags: Vec<_> = split_chunks(&s, 300).unwrap().collect();
        let mut r = Reassembly::new(1000);
        r.accept(3, 4, frags[3].payload).unwrap();
        assert_eq!(r.accept(3, 4, frags[3].payload), Ok(Progress::Duplicate));
        assert_eq!(
            r.accept(0, 4, frags[0].payload),
            Ok(Progress::Stored {
                received: 2,
                count: 4
            })
        );
        assert_eq!(r.accept(0, 4, frags[0].payload), Ok(Progress::Duplicate));
        assert!(r.snapshot().is_none());
        r.accept(1, 4, frags[1].payload).unwrap();
        assert_eq!(r.accept(2, 4, frags[2].payload), Ok(Progress::Complete));
        assert_eq!(r.snapshot().unwrap(), &s[..]);
        r.reset();
        assert!(r.snapshot().is_none());
        assert_eq!(reassemble(&[0], &[], 10, 0), Vec::<u8>::new());
    }

    #[test]
    fn exactly_at_limit_with_last_first() {
        // The park region and the other fragments' slots touch but never
        // overlap when the total is exactly the limit.
        let s = snapshot(1000);
        assert_eq!(reassemble(&[3, 1, 0, 2], &s, 300, 1000), s);
        assert_eq!(reassemble(&[3, 2, 1, 0], &s, 250, 1000), s);
    }

    #[test]
    fn refusals_are_typed_and_harmless() {
        let mut r = Reassembly::new(1000);
        assert_eq!(
            r.accept(4, 4, &[1]),
            Err(ReassemblyError::IndexOutOfRange { index: 4, count: 4 })
        );
        r.accept(0, 4, &[0; 300]).unwrap();
        assert_eq!(
            r.accept(1, 5, &[0; 300]),
            Err(ReassemblyError::CountMismatch {
                expected: 4,
                found: 5
            })
        );
        assert_eq!(
            r.accept(1, 4, &[0; 299]),
            Err(ReassemblyError::ChunkMismatch {
                index: 1,
                len: 299,
                chunk: 300
            })
        );
        assert_eq!(
            r.accept(3, 4, &[0; 301]),
            Err(ReassemblyError::BadLastFragment {
                index: 3,
                len: 301,
                chunk: 300
            })
        );
        assert_eq!(
            r.accept(3, 4, &[0; 101]),
            Err(ReassemblyError::TooLarge {
                at_least: 1001,
                max: 1000
            })
        );
        assert_eq!(
            r.accept(3, 4, &[]),
            Err(ReassemblyError::EmptyFragment { index: 3, count: 4 })
        );
        assert_eq!(
            r.accept(1, 4, &[0; 300]),
            Ok(Progress::Stored {
                received: 2,
                count: 4
            })
        );

        let mut r = Reassembly::new(1000);
        assert_eq!(
            r.accept(0, 1, &[0; 1001]),
            Err(ReassemblyError::TooLarge {
                at_least: 1001,
                max: 1000
            })
        );
        assert_eq!(
            r.accept(0, 2000, &[0; 1]),
            Err(ReassemblyError::TooLarge {
                at_least: 2000,
                max: 1000
            })
        );
        // A parked last fragment longer than the chunk that shows up later.
        r.accept(2, 3, &[0; 200]).unwrap();
        assert_eq!(
            r.accept(0, 3, &[0; 100]),
            Err(ReassemblyError::BadLastFragment {
                index: 2,
                len: 200,
                chunk: 100
            })
        );
        // Chunk 500 with the parked last of 200: 1200 > 1000.
        assert_eq!(
            r.accept(0, 3, &[0; 500]),
            Err(ReassemblyError::TooLarge {
                at_least: 1200,
                max: 1000
            })
        );
        assert_eq!(
            r.accept(0, 3, &[0; 400]),
            Ok(Progress::Stored {
                received: 2,
                count: 3
            })
        );
    }
}
