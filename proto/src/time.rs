//! Time as seen by the sans-IO cores.
//!
//! Protocol state machines never read a clock: drivers pass `now` in. An
//! `Instant` is a count of microseconds since an arbitrary epoch chosen by the
//! driver (a monotonic clock in production, a virtual clock in tests), so the
//! same code runs at wall speed or on a simulated timeline.
//!
//! [`monotonic_ns`] is for the drivers and tools around them (and the data
//! plane's timestamps), never for a protocol core.

use std::ops::{Add, AddAssign, Sub};
pub use std::time::Duration;

/// CLOCK_MONOTONIC now, in nanoseconds: the clock of the data plane's
/// timestamps (`bpf_ktime_get_ns`, e.g. a flow's `created_ns`), of timerfd
/// deadlines, and of `std::time::Instant` on Linux.
#[inline]
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec through a valid pointer;
    // CLOCK_MONOTONIC always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// A point in time, microseconds since the driver's epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Instant(u64);

impl Instant {
    pub const ZERO: Instant = Instant(0);

    pub const fn from_micros(us: u64) -> Self {
        Instant(us)
    }
    pub const fn from_millis(ms: u64) -> Self {
        Instant(ms * 1000)
    }
    pub const fn as_micros(self) -> u64 {
        self.0
    }
    /// Time elapsed from `earlier` to `self`, zero if `earlier` is later.
    pub fn saturating_since(self, earlier: Instant) -> Duration {
        Duration::from_micros(self.0.saturating_sub(earlier.0))
    }
}

impl Add<Duration> for Instant {
    type Output = Instant;
    fn add(self, d: Duration) -> Instant {
        // `as_micros` in u64 arithmetic (saturating alike): no u128
        // multiply on the timer paths that add a timeout to `now`.
        let us = d
            .as_secs()
            .saturating_mul(1_000_000)
            .saturating_add(u64::from(d.subsec_micros()));
        Instant(self.0.saturating_add(us))
    }
}

impl AddAssign<Duration> for Instant {
    fn add_assign(&mut self, d: Duration) {
        *self = *self + d;
    }
}

impl Sub<Instant> for Instant {
    type Output = Duration;
    fn sub(self, rhs: Instant) -> Duration {
        self.saturating_since(rhs)
    }
}

impl std::fmt::Display for Instant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{:06}s", self.0 / 1_000_000, self.0 % 1_000_000)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adding_a_duration_counts_whole_microseconds_and_saturates() {
        let t = Instant::from_micros(5);
        assert_eq!(t + Duration::from_nanos(1_999), Instant::from_micros(6));
        assert_eq!(
            t + Duration::new(3, 250_000_000),
            Instant::from_micros(3_250_005)
        );
        for d in [Duration::MAX, Duration::from_secs(u64::MAX / 1_000_000 + 1)] {
            assert_eq!((t + d).as_micros(), u64::MAX);
        }
        let near = Instant::from_micros(u64::MAX - 1);
        assert_eq!((near + Duration::from_micros(7)).as_micros(), u64::MAX);
    }
}
