//! A fixed-size latency histogram for debug counters on the packet path.
//!
//! Log-linear buckets (8 per power of two, 100 ns units below 1.6 µs are
//! exact), so a recorded value is known within 12.5%: enough to read a p50
//! of a wake-up delay without keeping samples. Recording is a few integer
//! operations on a preallocated array: no allocation, no lock, no syscall.

/// Nanoseconds per histogram unit.
const UNIT_NS: u64 = 100;
/// Sub-buckets per power of two (2^SUB_BITS).
const SUB_BITS: u32 = 3;
const SUB: u64 = 1 << SUB_BITS;
/// Values below this many units get a bucket each.
const LINEAR: u64 = 2 * SUB;
/// Enough buckets for ~3.4e10 units (~55 min); larger values go in the last.
const BUCKETS: usize = 256;

/// Latencies in nanoseconds: count, sum, max and log-linear buckets.
#[derive(Clone)]
pub struct LatencyHistogram {
    buckets: [u64; BUCKETS],
    count: u64,
    sum_ns: u64,
    max_ns: u64,
    last_ns: u64,
}

impl Default for LatencyHistogram {
    fn default() -> Self {
        LatencyHistogram {
            buckets: [0; BUCKETS],
            count: 0,
            sum_ns: 0,
            max_ns: 0,
            last_ns: 0,
        }
    }
}

impl std::fmt::Debug for LatencyHistogram {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LatencyHistogram")
            .field("count", &self.count)
            .field("p50_ns", &self.quantile_ns(0.5))
            .field("max_ns", &self.max_ns)
            .finish()
    }
}

fn index(units: u64) -> usize {
    if units < LINEAR {
        return units as usize;
    }
    let msb = 63 - units.leading_zeros(); // >= SUB_BITS + 1
    let shift = msb - SUB_BITS; // >= 1
    let mantissa = (units >> shift) & (SUB - 1);
    let i = LINEAR + u64::from(shift - 1) * SUB + mantissa;
    (i as usize).min(BUCKETS - 1)
}

/// The smallest value (units) of bucket `i` and the bucket's width.
fn bounds(i: usize) -> (u64, u64) {
    let i = i as u64;
    if i < LINEAR {
        return (i, 1);
    }
    let k = i - LINEAR;
    let shift = k / SUB + 1;
    ((SUB + k % SUB) << shift, 1 << shift)
}

impl LatencyHistogram {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn record_ns(&mut self, ns: u64) {
        self.buckets[index(ns / UNIT_NS)] += 1;
        self.count += 1;
        self.sum_ns = self.sum_ns.saturating_add(ns);
        self.max_ns = self.max_ns.max(ns);
        self.last_ns = ns;
    }

    /// The value recorded last (0 before the first).
    pub fn last_ns(&self) -> u64 {
        self.last_ns
    }

    pub fn count(&self) -> u64 {
        self.count
    }

    pub fn sum_ns(&self) -> u64 {
        self.sum_ns
    }

    pub fn max_ns(&self) -> u64 {
        self.max_ns
    }

    /// The `q` quantile (0..=1), as the middle of the bucket holding it;
    /// None when empty.
    pub fn quantile_ns(&self, q: f64) -> Option<u64> {
        if self.count == 0 {
            return None;
        }
        let rank = ((q.clamp(0.0, 1.0) * self.count as f64).ceil() as u64).clamp(1, self.count);
        let mut seen = 0;
        for (i, &n) in self.buckets.iter().enumerate() {
            seen += n;
            if seen >= rank {
                let (low, width) = bounds(i);
                let mid = (low * UNIT_NS + width * UNIT_NS / 2).min(self.max_ns);
                return Some(mid);
            }
        }
        Some(self.max_ns)
    }

    /// Cumulative counts at upper bounds (ns), for Prometheus `_bucket`
    /// lines: only the non-empty buckets, in increasing order.
    pub fn cumulative(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        let mut seen = 0;
        self.buckets
            .iter()
            .enumerate()
            .filter(|(_, &n)| n > 0)
            .map(move |(i, &n)| {
                seen += n;
                let (low, width) = bounds(i);
                ((low + width) * UNIT_NS, seen)
            })
    }

    pub fn clear(&mut self) {
        *self = Self::default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_contiguous_and_hold_their_values() {
        let mut next = 0;
        for i in 0..BUCKETS - 1 {
            let (low, width) = bounds(i);
            assert_eq!(low, next, "bucket {i}");
            assert_eq!(index(low), i);
            assert_eq!(index(low + width - 1), i);
            next = low + width;
        }
        assert_eq!(index(u64::MAX / UNIT_NS), BUCKETS - 1);
    }

    #[test]
    fn quantiles_are_within_an_eighth() {
        let mut h = LatencyHistogram::new();
        assert_eq!(h.quantile_ns(0.5), None);
        for us in 1..=100u64 {
            h.record_ns(us * 1000);
        }
        let p50 = h.quantile_ns(0.5).unwrap() as f64;
        assert!((p50 - 50_000.0).abs() <= 50_000.0 / 8.0, "{p50}");
        let p99 = h.quantile_ns(0.99).unwrap() as f64;
        assert!((p99 - 99_000.0).abs() <= 99_000.0 / 8.0, "{p99}");
        assert!(h.quantile_ns(1.0).unwrap() <= 100_000);
        assert_eq!((h.count(), h.max_ns()), (100, 100_000));
        let last = h.cumulative().last().unwrap();
        assert_eq!(last.1, 100);
        assert!(last.0 >= 100_000);
    }
}
