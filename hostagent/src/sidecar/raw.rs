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
//!
//! An answer can also come in pieces: the application writes part of it,
//! works, writes the rest. A relay that went idle between two pieces cut
//! the answer (the rest went to a closed loopback connection). Nothing in
//! the bytes says more is coming, so the relay learns it from the
//! connection: a pause of the application between two outputs, with no
//! byte written to it in between and its socket drained by the first
//! (the relay read less than it could take: a pause of the application,
//! not of the client's window), is a *piece gap*; from then on the relay
//! needs twice the longest piece gap seen of quiet after the application's
//! last output, at least `quiet` and at most `pieces_max` (a bound: a
//! stream of unsolicited output more frequent than that never goes quiet
//! for it, and would otherwise never migrate). So an application that
//! answers in pieces is cut at most once per connection (before its first
//! answer in pieces), and not when its pauses exceed `pieces_max / 2`.

use std::time::{Duration, Instant};

#[derive(Debug)]
pub struct RawConn {
    last_activity: Instant,
    /// When bytes went to the application with no output from it since
    /// (the application's turn), else `None`.
    unanswered_since: Option<Instant>,
    /// When the application's last output left its socket drained, with no
    /// byte written to it since: its next output is another piece of the
    /// same answer, after a pause of this long.
    drained_at: Option<Instant>,
    /// Longest pause seen between two pieces of an answer.
    piece_gap: Duration,
}

impl RawConn {
    pub fn new() -> RawConn {
        RawConn {
            last_activity: Instant::now(),
            unanswered_since: None,
            drained_at: None,
            piece_gap: Duration::ZERO,
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
        // The next output starts an answer (its delay is the unanswered
        // rule's business), it does not continue one.
        self.drained_at = None;
    }

    /// Bytes from the application (an answer, or a piece of one);
    /// `drained`: the relay read less than it could take (the application
    /// had nothing more at that moment). Returns how long the application
    /// took since the first byte it had not answered, if any.
    pub fn from_app(&mut self, drained: bool) -> Option<Duration> {
        self.from_app_at(Instant::now(), drained)
    }

    /// [`RawConn::from_app`] at `now`.
    pub fn from_app_at(&mut self, now: Instant, drained: bool) -> Option<Duration> {
        if let Some(t) = self.drained_at {
            self.piece_gap = self.piece_gap.max(now.saturating_duration_since(t));
        }
        self.drained_at = drained.then_some(now);
        self.last_activity = now;
        self.unanswered_since
            .take()
            .map(|t| now.saturating_duration_since(t))
    }

    /// The longest pause seen between two pieces of an answer.
    pub fn piece_gap(&self) -> Duration {
        self.piece_gap
    }

    /// Idle at `now`: nothing moved for `quiet` (or twice the longest
    /// piece gap seen, at most `pieces_max`) after the application's last
    /// output, or for `unanswered` after bytes it has not answered.
    pub fn idle_at(
        &self,
        now: Instant,
        quiet: Duration,
        unanswered: Duration,
        pieces_max: Duration,
    ) -> bool {
        let need = if self.unanswered_since.is_some() {
            unanswered
        } else {
            quiet.max((self.piece_gap * 2).min(pieces_max))
        };
        now.saturating_duration_since(self.last_activity) >= need
    }

    /// [`RawConn::idle_at`] now.
    pub fn idle(&self, quiet: Duration, unanswered: Duration, pieces_max: Duration) -> bool {
        self.idle_at(Instant::now(), quiet, unanswered, pieces_max)
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
    const PIECES: Duration = Duration::from_millis(250);

    /// Issue #8: a request written to the application and not answered
    /// within the idle window is not a safe point (the answer is owed and
    /// would be lost); it was, and under CPU load the client hung.
    #[test]
    fn an_unanswered_request_is_not_idle_after_the_quiet_window() {
        let mut r = RawConn::new();
        r.to_app();
        let t = r.last_activity;
        assert!(!r.idle_at(t + QUIET, QUIET, UNANSWERED, PIECES));
        assert!(!r.idle_at(t + Duration::from_millis(500), QUIET, UNANSWERED, PIECES));
        // An application that never answers (one-way stream) still
        // migrates once quiet for `unanswered`.
        assert!(r.idle_at(t + UNANSWERED, QUIET, UNANSWERED, PIECES));
    }

    #[test]
    fn answered_relay_is_idle_after_the_quiet_window() {
        let mut r = RawConn::new();
        r.from_client();
        r.to_app();
        let late = r.from_app(true);
        assert!(late.is_some());
        let t = r.last_activity;
        assert!(!r.idle_at(t + QUIET / 2, QUIET, UNANSWERED, PIECES));
        assert!(r.idle_at(t + QUIET, QUIET, UNANSWERED, PIECES));
        // Output the application sends on its own does not owe anything.
        assert_eq!(r.from_app(true), None);
        assert!(r.idle_at(r.last_activity + QUIET, QUIET, UNANSWERED, PIECES));
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
        assert!(f.idle_at(f.last_activity + QUIET, QUIET, UNANSWERED, PIECES));
    }

    /// An answer in two pieces 30 ms apart (longer than the quiet window):
    /// once seen, the relay waits twice that after the last output, so the
    /// next answer in pieces is not cut between them.
    #[test]
    fn a_pause_between_pieces_of_an_answer_lengthens_the_quiet_window() {
        let mut r = RawConn::new();
        let gap = Duration::from_millis(30);
        r.to_app();
        let t0 = r.last_activity;
        assert!(r.from_app_at(t0 + Duration::from_millis(1), true).is_some());
        // Still the old window: quiet after the first piece.
        assert!(r.idle_at(
            t0 + Duration::from_millis(1) + QUIET,
            QUIET,
            UNANSWERED,
            PIECES
        ));
        let t1 = t0 + Duration::from_millis(1) + gap;
        assert_eq!(r.from_app_at(t1, true), None);
        assert_eq!(r.piece_gap(), gap);
        // The next answer: its first piece, then as long a pause.
        r.to_app();
        let t2 = t1 + Duration::from_millis(100);
        r.last_activity = t2;
        r.unanswered_since = Some(t2);
        r.from_app_at(t2 + Duration::from_millis(1), true);
        let p = t2 + Duration::from_millis(1);
        assert!(!r.idle_at(p + QUIET, QUIET, UNANSWERED, PIECES), "cut");
        assert!(!r.idle_at(p + gap, QUIET, UNANSWERED, PIECES), "cut");
        assert!(r.idle_at(p + gap * 2, QUIET, UNANSWERED, PIECES));
    }

    #[test]
    fn only_pauses_of_the_application_count_as_piece_gaps() {
        // Output after bytes written to the application starts an answer:
        // the time in between is its delay, not a piece gap.
        let mut r = RawConn::new();
        let t0 = r.last_activity;
        r.from_app_at(t0, true);
        r.to_app();
        r.from_app_at(t0 + Duration::from_millis(50), false);
        assert_eq!(r.piece_gap(), Duration::ZERO);
        // Reads that took all the relay could take (the client's window,
        // not the application, limited them): the time to the next read is
        // no gap.
        r.from_app_at(t0 + Duration::from_millis(60), false);
        r.from_app_at(t0 + Duration::from_millis(90), true);
        assert_eq!(r.piece_gap(), Duration::ZERO);
        assert!(r.idle_at(
            t0 + Duration::from_millis(90) + QUIET,
            QUIET,
            UNANSWERED,
            PIECES
        ));
    }

    #[test]
    fn the_piece_wait_is_bounded() {
        // Unsolicited output every 2 s (a one-way stream after one
        // request): each looks like a piece, the wait stays at its bound,
        // and the relay migrates between them.
        let mut r = RawConn::new();
        r.to_app();
        let t0 = r.last_activity;
        r.from_app_at(t0, true);
        r.from_app_at(t0 + Duration::from_secs(2), true);
        assert_eq!(r.piece_gap(), Duration::from_secs(2));
        let last = t0 + Duration::from_secs(2);
        assert!(!r.idle_at(last + PIECES / 2, QUIET, UNANSWERED, PIECES));
        assert!(r.idle_at(last + PIECES, QUIET, UNANSWERED, PIECES));
    }
}
