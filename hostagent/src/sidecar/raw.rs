//! The `raw` manager: any byte stream. Without request boundaries the only
//! safe point is an idle relay: no byte held by the sidecar and nothing
//! moved either way for a while. A relay that never goes idle for long
//! enough does not migrate; the stack gives the wait up after its bound.
//!
//! "A while" depends on whose turn it is. `raw` serves request/response
//! protocols: once bytes went to the application and it has not sent
//! anything since, an answer is most likely owed, and a loaded machine can
//! delay it far beyond the idle window (issue #8: redis-server, descheduled
//! for more than 20 ms at load average 12-17, answered after the relay had
//! migrated; the answer went to a closed loopback connection and the client
//! waited for it forever). So the relay counts as idle only
//! [`RawConn::idle`]'s `quiet` after the application's last output, and
//! only `unanswered` (much longer) after bytes it has not answered yet:
//! a one-way stream (an application that never answers) still migrates
//! once it has been quiet that long.

use std::time::{Duration, Instant};

#[derive(Debug)]
pub struct RawConn {
    last_activity: Instant,
    /// When bytes went to the application with no output from it since
    /// (the application's turn), else `None`.
    unanswered_since: Option<Instant>,
}

impl RawConn {
    pub fn new() -> RawConn {
        RawConn {
            last_activity: Instant::now(),
            unanswered_since: None,
        }
    }

    /// Client bytes read (held by the relay until written).
    pub fn from_client(&mut self) {
        self.last_activity = Instant::now();
    }

    /// Bytes written to the application.
    pub fn to_app(&mut self) {
        let now = Instant::now();
        self.last_activity = now;
        self.unanswered_since.get_or_insert(now);
    }

    /// Bytes from the application (an answer). Returns how long the
    /// application took since the first byte it had not answered, if any.
    pub fn from_app(&mut self) -> Option<Duration> {
        let now = Instant::now();
        self.last_activity = now;
        self.unanswered_since
            .take()
            .map(|t| now.saturating_duration_since(t))
    }

    /// Idle at `now`: nothing moved for `quiet` after the application's
    /// last output, or for `unanswered` after bytes it has not answered.
    pub fn idle_at(&self, now: Instant, quiet: Duration, unanswered: Duration) -> bool {
        let need = if self.unanswered_since.is_some() {
            unanswered
        } else {
            quiet
        };
        now.saturating_duration_since(self.last_activity) >= need
    }

    /// [`RawConn::idle_at`] now.
    pub fn idle(&self, quiet: Duration, unanswered: Duration) -> bool {
        self.idle_at(Instant::now(), quiet, unanswered)
    }
}

impl Default for RawConn {
    fn default() -> Self {
        RawConn::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const QUIET: Duration = Duration::from_millis(20);
    const UNANSWERED: Duration = Duration::from_secs(1);

    /// Issue #8: a request written to the application and not answered
    /// within the idle window is not a safe point (the answer is owed and
    /// would be lost); it was, and under CPU load the client hung.
    #[test]
    fn an_unanswered_request_is_not_idle_after_the_quiet_window() {
        let mut r = RawConn::new();
        r.to_app();
        let t = r.last_activity;
        assert!(!r.idle_at(t + QUIET, QUIET, UNANSWERED));
        assert!(!r.idle_at(t + Duration::from_millis(500), QUIET, UNANSWERED));
        // An application that never answers (one-way stream) still
        // migrates once quiet for `unanswered`.
        assert!(r.idle_at(t + UNANSWERED, QUIET, UNANSWERED));
    }

    #[test]
    fn answered_relay_is_idle_after_the_quiet_window() {
        let mut r = RawConn::new();
        r.from_client();
        r.to_app();
        let late = r.from_app();
        assert!(late.is_some());
        let t = r.last_activity;
        assert!(!r.idle_at(t + QUIET / 2, QUIET, UNANSWERED));
        assert!(r.idle_at(t + QUIET, QUIET, UNANSWERED));
        // Output the application sends on its own does not owe anything.
        assert_eq!(r.from_app(), None);
        assert!(r.idle_at(r.last_activity + QUIET, QUIET, UNANSWERED));
    }

    #[test]
    fn the_wait_counts_from_the_first_unanswered_byte() {
        let mut r = RawConn::new();
        r.to_app();
        let first = r.unanswered_since.expect("owed");
        r.to_app();
        assert_eq!(r.unanswered_since, Some(first));
        // A fresh connection (or one just migrated in) owes nothing.
        let f = RawConn::new();
        assert!(f.idle_at(f.last_activity + QUIET, QUIET, UNANSWERED));
    }
}
