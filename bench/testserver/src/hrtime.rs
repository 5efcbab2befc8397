//! High-resolution time for the benchmark tools.
//!
//! tokio's timer wheel has a 1 ms resolution, far too coarse for service
//! times and inter-arrival gaps of tens of microseconds. [`Timer`] is a
//! `timerfd` (CLOCK_MONOTONIC, absolute deadlines) registered with tokio's
//! reactor, so a task sleeps with microsecond precision without burning CPU.
//! All timestamps are nanoseconds of CLOCK_MONOTONIC ([`now_ns`]).

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use tokio::io::unix::AsyncFd;

/// Nanoseconds of CLOCK_MONOTONIC.
pub use capybara_proto::time::monotonic_ns as now_ns;

/// Lower the calling thread's timer slack to 1 ns (default 50 µs), so that
/// timer wake-ups are not deferred by the kernel to batch them.
pub fn set_fine_timer_slack() {
    // SAFETY: prctl with PR_SET_TIMERSLACK takes an integer argument.
    unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong, 0, 0, 0) };
}

struct TimerFd(OwnedFd);

impl AsRawFd for TimerFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }
}

/// A one-shot high-resolution timer usable from a tokio task; falls back to
/// tokio's own timer when no timerfd can be created.
pub struct Timer {
    fd: Option<AsyncFd<TimerFd>>,
}

impl Timer {
    /// A timer on the current tokio runtime (must have I/O enabled for the
    /// precise path). `precise = false` forces tokio's 1 ms timer.
    pub fn new(precise: bool) -> Timer {
        if !precise {
            return Timer { fd: None };
        }
        // SAFETY: plain syscall; the result is checked.
        let raw = unsafe {
            libc::timerfd_create(
                libc::CLOCK_MONOTONIC,
                libc::TFD_NONBLOCK | libc::TFD_CLOEXEC,
            )
        };
        if raw < 0 {
            return Timer { fd: None };
        }
        // SAFETY: raw is a fresh fd we own.
        let owned = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: the fd is owned by the TimerFd we hand over and is neither
        // replaced nor closed while the AsyncFd holds it.
        match unsafe {
            AsyncFd::register_with_interest(TimerFd(owned), tokio::io::Interest::READABLE)
        } {
            Ok(fd) => Timer { fd: Some(fd) },
            Err(_) => Timer { fd: None },
        }
    }

    /// Whether this timer has microsecond precision.
    pub fn is_precise(&self) -> bool {
        self.fd.is_some()
    }

    /// Sleep until `deadline_ns` (CLOCK_MONOTONIC). Returns at once if it
    /// has passed. Cancel-safe: dropping the future leaves the timer armed,
    /// and the next call re-arms it.
    pub async fn sleep_until(&mut self, deadline_ns: u64) {
        if now_ns() >= deadline_ns {
            return;
        }
        let Some(afd) = self.fd.as_ref() else {
            let now = now_ns();
            let d = std::time::Duration::from_nanos(deadline_ns.saturating_sub(now));
            tokio::time::sleep(d).await;
            return;
        };
        let spec = libc::itimerspec {
            it_interval: libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            },
            it_value: libc::timespec {
                tv_sec: (deadline_ns / 1_000_000_000) as libc::time_t,
                tv_nsec: (deadline_ns % 1_000_000_000) as libc::c_long,
            },
        };
        // SAFETY: valid fd and itimerspec.
        let rc = unsafe {
            libc::timerfd_settime(
                afd.get_ref().as_raw_fd(),
                libc::TFD_TIMER_ABSTIME,
                &spec,
                std::ptr::null_mut(),
            )
        };
        if rc != 0 {
            let d = std::time::Duration::from_nanos(deadline_ns.saturating_sub(now_ns()));
            tokio::time::sleep(d).await;
            return;
        }
        // timerfd_settime resets the expiration count, so the fd is never
        // read: every arming produces a fresh readiness edge at expiry, and
        // readiness left over from an earlier (abandoned) sleep is cleared
        // and waited past. One syscall per sleep plus the reactor's wait.
        loop {
            let mut guard = match afd.readable().await {
                Ok(g) => g,
                Err(_) => return,
            };
            guard.clear_ready();
            if now_ns() >= deadline_ns {
                return;
            }
        }
    }
}

/// Parse a duration such as `250us`, `10ms`, `1.5s`, `2m`, `100ns`.
/// A bare number is rejected: the unit is part of the value.
pub fn parse_duration(s: &str) -> Result<std::time::Duration, String> {
    let t = s.trim();
    let split = t.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let v: f64 = num.parse().map_err(|_| {
        format!("invalid duration {s:?}: expected a number with a unit (ns, us, ms, s, m)")
    })?;
    let scale = match unit {
        "ns" => 1e-9,
        "us" | "µs" => 1e-6,
        "ms" => 1e-3,
        "s" => 1.0,
        "m" | "min" => 60.0,
        "" => {
            return Err(format!(
                "invalid duration {s:?}: missing unit (ns, us, ms, s, m)"
            ))
        }
        _ => {
            return Err(format!(
                "invalid duration {s:?}: unknown unit {unit:?} (ns, us, ms, s, m)"
            ))
        }
    };
    if !v.is_finite() || v < 0.0 {
        return Err(format!(
            "invalid duration {s:?}: must be a non-negative number"
        ));
    }
    let secs = v * scale;
    if secs > 1e9 {
        return Err(format!("invalid duration {s:?}: too large"));
    }
    Ok(std::time::Duration::from_secs_f64(secs))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("250us").unwrap().as_micros(), 250);
        assert_eq!(parse_duration("10ms").unwrap().as_millis(), 10);
        assert_eq!(parse_duration("1.5s").unwrap().as_millis(), 1500);
        assert!(parse_duration("10").is_err());
        assert!(parse_duration("-1s").is_err());
        assert!(parse_duration("3parsecs").is_err());
        assert!(parse_duration("abc").is_err());
    }

    #[test]
    fn precise_timer_sleeps_sub_millisecond() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let mut t = Timer::new(true);
            assert!(t.is_precise());
            let start = now_ns();
            for i in 1..=20u64 {
                t.sleep_until(start + i * 100_000).await;
                assert!(now_ns() >= start + i * 100_000);
            }
        });
    }
}
