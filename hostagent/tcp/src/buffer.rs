//! Pre-sized buffers for the per-packet path: nothing here allocates after
//! construction.
//!
//! - `RingBuffer`: byte ring of fixed capacity. The send queue holds bytes
//!   from SND.UNA on; the receive queue holds in-order bytes not yet read by
//!   the application, and out-of-order bytes are written into its free space
//!   at their offset from RCV.NXT before they become contiguous.
//! - `Assembler`: the out-of-order interval list (offsets from RCV.NXT), a
//!   fixed array; a segment that would need more intervals is dropped.
//! - `Scoreboard`: SACKed ranges the peer reported (RFC 6675 sender side).

use std::fmt;

use crate::seq::SeqNum;

/// A byte ring of fixed capacity.
#[derive(Clone)]
pub struct RingBuffer {
    storage: Vec<u8>,
    /// Index of the first readable byte.
    head: usize,
    /// Readable bytes.
    len: usize,
}

impl RingBuffer {
    /// Allocates the ring once. `vec![0; n]` maps zeroed pages lazily, so a
    /// large idle buffer costs little resident memory.
    pub fn new(capacity: usize) -> Self {
        RingBuffer {
            storage: vec![0; capacity],
            head: 0,
            len: 0,
        }
    }
    pub fn capacity(&self) -> usize {
        self.storage.len()
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn free(&self) -> usize {
        self.capacity() - self.len
    }
    pub fn is_full(&self) -> bool {
        self.free() == 0
    }

    /// Physical index of logical offset `off` from head (off < capacity).
    fn index(&self, off: usize) -> usize {
        let i = self.head + off;
        if i >= self.capacity() {
            i - self.capacity()
        } else {
            i
        }
    }

    /// Copies `data` into the ring at logical offset `off` (may be anywhere
    /// in `0..capacity`), clipping at capacity. Returns bytes written.
    fn write_at(&mut self, off: usize, data: &[u8]) -> usize {
        let cap = self.capacity();
        if off >= cap {
            return 0;
        }
        let n = data.len().min(cap - off);
        let start = self.index(off);
        let first = n.min(cap - start);
        self.storage[start..start + first].copy_from_slice(&data[..first]);
        self.storage[..n - first].copy_from_slice(&data[first..n]);
        n
    }

    /// Appends as much of `data` as fits; returns bytes taken.
    pub fn enqueue(&mut self, data: &[u8]) -> usize {
        let n = data.len().min(self.free());
        self.write_at(self.len, &data[..n]);
        self.len += n;
        n
    }

    /// Writes `data` into the free space `off` bytes past the readable end,
    /// without making it readable (out-of-order data). Clipped to free space.
    pub fn write_unallocated(&mut self, off: usize, data: &[u8]) -> usize {
        let free = self.free();
        if off >= free {
            return 0;
        }
        let n = data.len().min(free - off);
        self.write_at(self.len + off, &data[..n])
    }

    /// Makes `n` bytes written past the end readable.
    pub fn commit(&mut self, n: usize) {
        self.len += n.min(self.free());
    }

    /// Copies readable bytes starting at `off` into `out`; returns the count.
    pub fn read_at(&self, off: usize, out: &mut [u8]) -> usize {
        if off >= self.len {
            return 0;
        }
        let n = out.len().min(self.len - off);
        self.copy_raw(off, &mut out[..n]);
        n
    }

    /// Copies bytes at logical offset `off` regardless of readability (used
    /// to compare out-of-order bytes).
    fn copy_raw(&self, off: usize, out: &mut [u8]) {
        let cap = self.capacity();
        let start = self.index(off);
        let first = out.len().min(cap - start);
        out[..first].copy_from_slice(&self.storage[start..start + first]);
        let rest = out.len() - first;
        out[first..].copy_from_slice(&self.storage[..rest]);
    }

    /// Bytes at logical offsets `off..off + n` as at most two slices (the
    /// ring may wrap), regardless of readability: the snapshot exporter reads
    /// the send queue, the receive queue and out-of-order bytes through it.
    /// Clipped to the capacity.
    pub fn slices(&self, off: usize, n: usize) -> (&[u8], &[u8]) {
        let cap = self.capacity();
        if off >= cap {
            return (&[], &[]);
        }
        let n = n.min(cap - off);
        let start = self.index(off);
        let first = n.min(cap - start);
        (
            &self.storage[start..start + first],
            &self.storage[..n - first],
        )
    }

    /// Empties the ring for reuse by another connection. Stale bytes stay in
    /// storage but are never readable (nothing leaks between connections:
    /// only `len` bytes and committed out-of-order intervals are ever read).
    pub fn clear(&mut self) {
        self.head = 0;
        self.len = 0;
    }

    /// Empties the ring and writes every page of its storage, so that the
    /// kernel maps the pages now instead of at first use (`new` maps them
    /// lazily): for pooled buffers of a server that will import
    /// connections, whose first migrations in would otherwise take a page
    /// fault per 4 KiB of traffic (issue #8). Costs one write per page.
    pub fn prefault(&mut self) {
        self.clear();
        touch_pages(&mut self.storage);
    }

    /// Drops `n` readable bytes from the front.
    pub fn consume(&mut self, n: usize) -> usize {
        let n = n.min(self.len);
        self.head = self.index(n);
        // The head is never reset when the ring empties: out-of-order bytes
        // may already sit past the end, at offsets relative to it.
        self.len -= n;
        n
    }

    /// Reads and consumes up to `out.len()` bytes.
    pub fn dequeue(&mut self, out: &mut [u8]) -> usize {
        let n = self.read_at(0, out);
        self.consume(n)
    }

    /// Byte-wise equality of the logical range `off..off+n` of two rings.
    fn range_eq(&self, other: &RingBuffer, off: usize, n: usize) -> bool {
        let mut a = [0u8; 256];
        let mut b = [0u8; 256];
        let mut done = 0;
        while done < n {
            let k = (n - done).min(256);
            self.copy_raw(off + done, &mut a[..k]);
            other.copy_raw(off + done, &mut b[..k]);
            if a[..k] != b[..k] {
                return false;
            }
            done += k;
        }
        true
    }
}

/// Two rings are equal when capacity and readable bytes match (the physical
/// layout and stale bytes do not matter).
impl PartialEq for RingBuffer {
    fn eq(&self, other: &Self) -> bool {
        self.capacity() == other.capacity()
            && self.len == other.len
            && self.range_eq(other, 0, self.len)
    }
}
impl Eq for RingBuffer {}

impl fmt::Debug for RingBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RingBuffer")
            .field("len", &self.len)
            .field("capacity", &self.capacity())
            .finish()
    }
}

/// Maximum out-of-order intervals held by a receive queue.
pub const MAX_OOO_RANGES: usize = 16;

/// Out-of-order intervals `[start, end)` as offsets from RCV.NXT, sorted,
/// disjoint and not adjacent. Equality compares the live intervals only.
#[derive(Debug, Clone, Copy, Eq)]
pub struct Assembler {
    ranges: [(u32, u32); MAX_OOO_RANGES],
    len: usize,
}

impl PartialEq for Assembler {
    fn eq(&self, other: &Self) -> bool {
        self.ranges() == other.ranges()
    }
}

impl Default for Assembler {
    fn default() -> Self {
        Assembler {
            ranges: [(0, 0); MAX_OOO_RANGES],
            len: 0,
        }
    }
}

/// The interval list is full and the new range touches none of its intervals.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AssemblerFull;

impl Assembler {
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn ranges(&self) -> &[(u32, u32)] {
        &self.ranges[..self.len]
    }

    /// Adds `[start, end)`, merging with overlapping or adjacent intervals.
    pub fn add(&mut self, start: u32, end: u32) -> Result<(), AssemblerFull> {
        if start >= end {
            return Ok(());
        }
        // First interval that ends at or after `start` (could merge).
        let mut i = 0;
        while i < self.len && self.ranges[i].1 < start {
            i += 1;
        }
        // Intervals i..j overlap or touch [start, end).
        let mut j = i;
        while j < self.len && self.ranges[j].0 <= end {
            j += 1;
        }
        if i == j {
            // Disjoint: insert at i.
            if self.len == MAX_OOO_RANGES {
                return Err(AssemblerFull);
            }
            self.ranges.copy_within(i..self.len, i + 1);
            self.ranges[i] = (start, end);
            self.len += 1;
        } else {
            let s = start.min(self.ranges[i].0);
            let e = end.max(self.ranges[j - 1].1);
            self.ranges[i] = (s, e);
            self.ranges.copy_within(j..self.len, i + 1);
            self.len -= j - i - 1;
        }
        Ok(())
    }

    /// Empties the list (a pooled connection rebuilt by an import).
    pub fn clear(&mut self) {
        self.len = 0;
    }

    /// Appends `[start, end)` after the last interval, without the search
    /// and merge of `add` (snapshot import: ranges arrive sorted). Adds
    /// nothing and returns false unless `start < end`, `start` lies past the
    /// last interval's end without touching it and there is room.
    pub fn push_above(&mut self, start: u32, end: u32) -> bool {
        push_sorted(&mut self.ranges, &mut self.len, start, end)
    }

    /// Shifts every interval down by `n` (RCV.NXT advanced by `n`), dropping
    /// what falls below zero.
    pub fn advance(&mut self, n: u32) {
        let mut w = 0;
        for r in 0..self.len {
            let (s, e) = self.ranges[r];
            if e <= n {
                continue;
            }
            self.ranges[w] = (s.saturating_sub(n), e - n);
            w += 1;
        }
        self.len = w;
    }

    /// If an interval starts at offset 0, removes it and returns its length
    /// (bytes now contiguous with RCV.NXT); the rest shift down.
    pub fn take_front(&mut self) -> u32 {
        if self.len > 0 && self.ranges[0].0 == 0 {
            let n = self.ranges[0].1;
            self.advance(n);
            n
        } else {
            0
        }
    }
}

/// Maximum SACKed ranges remembered by a sender.
pub const MAX_SCOREBOARD: usize = 8;

/// SACKed sequence ranges above SND.UNA, sorted and merged. Equality
/// compares the live blocks only.
#[derive(Debug, Clone, Copy, Eq)]
pub struct Scoreboard {
    blocks: [(SeqNum, SeqNum); MAX_SCOREBOARD],
    len: usize,
}

impl PartialEq for Scoreboard {
    fn eq(&self, other: &Self) -> bool {
        self.blocks() == other.blocks()
    }
}

impl Default for Scoreboard {
    fn default() -> Self {
        Scoreboard {
            blocks: [(SeqNum(0), SeqNum(0)); MAX_SCOREBOARD],
            len: 0,
        }
    }
}

/// The `push_above` of [`Assembler`] and [`Scoreboard`]: appends `[l, r)`
/// to the first `len` intervals of `list` when `l < r`, `l` lies past the
/// last interval's end without touching it and there is room.
fn push_sorted<T: PartialOrd + Copy>(list: &mut [(T, T)], len: &mut usize, l: T, r: T) -> bool {
    let above = *len == 0 || l > list[*len - 1].1;
    if l >= r || !above || *len == list.len() {
        return false;
    }
    list[*len] = (l, r);
    *len += 1;
    true
}

impl Scoreboard {
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn blocks(&self) -> &[(SeqNum, SeqNum)] {
        &self.blocks[..self.len]
    }
    pub fn clear(&mut self) {
        self.len = 0;
    }

    /// Appends `[l, r)` after the last block, without the search and merge
    /// of `add` (snapshot import: blocks arrive sorted). Adds nothing and
    /// returns false unless `l < r`, `l` lies past the last block's end
    /// without touching it and there is room.
    pub fn push_above(&mut self, l: SeqNum, r: SeqNum) -> bool {
        push_sorted(&mut self.blocks, &mut self.len, l, r)
    }

    /// Records `[l, r)`. Returns true when it added SACKed bytes. When the
    /// board is full a disjoint block is ignored (the data will simply be
    /// retransmitted if needed).
    pub fn add(&mut self, l: SeqNum, r: SeqNum) -> bool {
        if l >= r {
            return false;
        }
        let before = self.sacked_bytes();
        let mut i = 0;
        while i < self.len && self.blocks[i].1 < l {
            i += 1;
        }
        let mut j = i;
        while j < self.len && self.blocks[j].0 <= r {
            j += 1;
        }
        if i == j {
            if self.len == MAX_SCOREBOARD {
                return false;
            }
            self.blocks.copy_within(i..self.len, i + 1);
            self.blocks[i] = (l, r);
            self.len += 1;
        } else {
            let s = l.min(self.blocks[i].0);
            let e = r.max(self.blocks[j - 1].1);
            self.blocks[i] = (s, e);
            self.blocks.copy_within(j..self.len, i + 1);
            self.len -= j - i - 1;
        }
        self.sacked_bytes() > before
    }

    /// Forgets everything below `una` (cumulatively acknowledged).
    pub fn trim(&mut self, una: SeqNum) {
        let mut w = 0;
        for k in 0..self.len {
            let (s, e) = self.blocks[k];
            if e <= una {
                continue;
            }
            self.blocks[w] = (s.max(una), e);
            w += 1;
        }
        self.len = w;
    }

    pub fn sacked_bytes(&self) -> u32 {
        self.blocks().iter().map(|(s, e)| e.since(*s)).sum()
    }

    /// SACKed bytes inside `[from, to)`.
    pub fn sacked_in(&self, from: SeqNum, to: SeqNum) -> u32 {
        self.blocks()
            .iter()
            .map(|(s, e)| {
                let a = s.max(from);
                let b = e.min(to);
                b.since(a)
            })
            .sum()
    }

    /// End of the highest SACKed block.
    pub fn highest(&self) -> Option<SeqNum> {
        self.blocks().last().map(|b| b.1)
    }

    /// The first un-SACKed byte at or after `seq`, and where the hole that
    /// starts there ends (start of the next SACKed block, if any).
    pub fn next_hole(&self, mut seq: SeqNum) -> (SeqNum, Option<SeqNum>) {
        for (s, e) in self.blocks() {
            if seq < *s {
                return (seq, Some(*s));
            }
            if seq < *e {
                seq = *e;
            }
        }
        (seq, None)
    }
}

/// Writes a zero into every 4 KiB page of `buf`, so that the kernel maps
/// its pages now instead of at first use (buffers allocated zeroed are
/// mapped lazily). For buffers whose contents do not matter yet: pooled
/// queue and relay buffers of a server about to take connections in.
pub fn touch_pages(buf: &mut [u8]) {
    const PAGE: usize = 4096;
    // Opaque to the optimizer: it cannot know the bytes are zero already
    // and drop the stores.
    let buf = std::hint::black_box(buf);
    for b in buf.iter_mut().step_by(PAGE) {
        *b = 0;
    }
    // The buffer need not start on a page: its last page may lie past the
    // last stepped byte.
    if let Some(b) = buf.last_mut() {
        *b = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// This thread's minor page faults so far (`/proc/thread-self/stat`
    /// field 10), or None where there is no procfs.
    fn thread_minor_faults() -> Option<u64> {
        let s = std::fs::read_to_string("/proc/thread-self/stat").ok()?;
        s.rsplit_once(')')?
            .1
            .split_whitespace()
            .nth(7)?
            .parse()
            .ok()
    }

    #[test]
    fn prefaulted_ring_takes_no_page_fault_when_first_filled() {
        const CAP: usize = 1 << 20;
        let chunk = [7u8; 4096];
        // (black_box: the optimizer may otherwise drop writes to a buffer
        // nobody reads, and the allocation with them.)
        let fill = |r: &mut RingBuffer| {
            let r = std::hint::black_box(r);
            while r.enqueue(&chunk) > 0 {}
            r.clear();
        };
        // Lazily mapped (`new`): allocating and filling faults about once
        // per page (in the allocator if it zeroes recycled memory, else at
        // first write).
        let Some(f0) = thread_minor_faults() else {
            return;
        };
        let mut lazy = RingBuffer::new(CAP);
        fill(&mut lazy);
        let lazy_faults = thread_minor_faults().unwrap() - f0;
        let mut warm = RingBuffer::new(CAP);
        warm.enqueue(b"gone");
        warm.prefault();
        assert!(warm.is_empty(), "prefault empties the ring");
        let f1 = thread_minor_faults().unwrap();
        fill(&mut warm);
        let warm_faults = thread_minor_faults().unwrap() - f1;
        eprintln!(
            "minor faults, 1 MiB ring: new + fill {lazy_faults}, fill after prefault {warm_faults}"
        );
        // (Where the kernel maps anonymous memory in large pages, neither
        // faults much and there is nothing to check.)
        assert!(
            lazy_faults < 16 || warm_faults < 8,
            "faults filling 1 MiB: new + fill {lazy_faults}, after prefault {warm_faults}"
        );
        // Still an ordinary ring.
        assert_eq!(warm.enqueue(b"abc"), 3);
        let mut out = [0u8; 3];
        assert_eq!(warm.dequeue(&mut out), 3);
        assert_eq!(&out, b"abc");
    }

    #[test]
    fn ring_wraps() {
        let mut r = RingBuffer::new(8);
        assert_eq!(r.enqueue(b"abcdef"), 6);
        let mut out = [0u8; 4];
        assert_eq!(r.dequeue(&mut out), 4);
        assert_eq!(&out, b"abcd");
        assert_eq!(r.enqueue(b"ghijklmn"), 6);
        let mut all = [0u8; 8];
        assert_eq!(r.read_at(0, &mut all), 8);
        assert_eq!(&all, b"efghijkl");
        assert!(r.is_full());
    }

    #[test]
    fn ring_out_of_order_write() {
        let mut r = RingBuffer::new(10);
        r.enqueue(b"ab");
        r.consume(1);
        assert_eq!(r.write_unallocated(2, b"EF"), 2);
        assert_eq!(r.write_unallocated(0, b"CD"), 2);
        r.commit(4);
        let mut out = [0u8; 5];
        assert_eq!(r.read_at(0, &mut out), 5);
        assert_eq!(&out, b"bCDEF");
        assert_eq!(r.write_unallocated(5, b"xyz"), 0);
    }

    #[test]
    fn assembler_merges() {
        let mut a = Assembler::default();
        a.add(10, 20).unwrap();
        a.add(30, 40).unwrap();
        a.add(20, 30).unwrap();
        assert_eq!(a.ranges(), &[(10, 40)]);
        a.add(0, 5).unwrap();
        assert_eq!(a.take_front(), 5);
        assert_eq!(a.ranges(), &[(5, 35)]);
        a.add(0, 5).unwrap();
        assert_eq!(a.take_front(), 35);
        assert!(a.is_empty());
    }

    #[test]
    fn assembler_bounded() {
        let mut a = Assembler::default();
        for i in 0..MAX_OOO_RANGES as u32 {
            a.add(10 * i + 1, 10 * i + 2).unwrap();
        }
        assert_eq!(a.add(1000, 1001), Err(AssemblerFull));
        // Merging into an existing interval still works when full.
        a.add(1, 5).unwrap();
    }

    #[test]
    fn scoreboard_holes() {
        let mut s = Scoreboard::default();
        assert!(s.add(SeqNum(200), SeqNum(300)));
        assert!(s.add(SeqNum(400), SeqNum(500)));
        assert!(!s.add(SeqNum(400), SeqNum(450)));
        assert_eq!(s.next_hole(SeqNum(100)), (SeqNum(100), Some(SeqNum(200))));
        assert_eq!(s.next_hole(SeqNum(250)), (SeqNum(300), Some(SeqNum(400))));
        assert_eq!(s.next_hole(SeqNum(450)), (SeqNum(500), None));
        assert_eq!(s.sacked_in(SeqNum(250), SeqNum(450)), 100);
        s.trim(SeqNum(250));
        assert_eq!(s.blocks()[0], (SeqNum(250), SeqNum(300)));
    }

    #[test]
    fn push_above_appends_sorted_ranges_like_add() {
        let mut a = Assembler::default();
        let mut b = Assembler::default();
        b.add(40, 50).unwrap();
        b.clear();
        assert!(b.is_empty());
        for i in 0..MAX_OOO_RANGES as u32 {
            a.add(10 * i + 1, 10 * i + 2).unwrap();
            assert!(b.push_above(10 * i + 1, 10 * i + 2));
        }
        assert_eq!(a, b);
        // Full, touching, overlapping, below or empty: refused, unchanged.
        assert!(!b.push_above(1000, 1001));
        let mut c = Assembler::default();
        assert!(c.push_above(5, 10));
        for (s, e) in [(10, 12), (7, 12), (1, 3), (20, 20), (21, 20)] {
            assert!(!c.push_above(s, e), "{s}..{e}");
        }
        assert_eq!(c.ranges(), &[(5, 10)]);

        let mut x = Scoreboard::default();
        let mut y = Scoreboard::default();
        for i in 0..MAX_SCOREBOARD as u32 {
            let l = SeqNum((u32::MAX - 50).wrapping_add(10 * i));
            let r = l.add(5);
            x.add(l, r);
            assert!(y.push_above(l, r), "{i}: sequence order across the wrap");
        }
        assert_eq!(x, y);
        assert!(!y.push_above(SeqNum(1000), SeqNum(1001)));
        let mut z = Scoreboard::default();
        assert!(z.push_above(SeqNum(5), SeqNum(10)));
        for (l, r) in [(10, 12), (7, 12), (1, 3), (20, 20)] {
            assert!(!z.push_above(SeqNum(l), SeqNum(r)), "{l}..{r}");
        }
        assert_eq!(z.blocks(), &[(SeqNum(5), SeqNum(10))]);
    }
}
