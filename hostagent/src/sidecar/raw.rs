//! The `raw` manager: any byte stream. Without request boundaries the only
//! safe point is an idle relay: no byte held by the sidecar and nothing
//! moved either way for a while (the application has answered what it was
//! given, as far as anyone can tell). A relay that never goes idle for long
//! enough does not migrate; the stack gives the wait up after its bound.

use std::time::{Duration, Instant};

#[derive(Debug)]
pub struct RawConn {
    last_activity: Instant,
}

impl RawConn {
    pub fn new() -> RawConn {
        RawConn {
            last_activity: Instant::now(),
        }
    }

    /// Bytes moved (either way).
    pub fn touch(&mut self) {
        self.last_activity = Instant::now();
    }

    /// Nothing moved for `quiet`.
    pub fn idle(&self, quiet: Duration) -> bool {
        self.last_activity.elapsed() >= quiet
    }
}

impl Default for RawConn {
    fn default() -> Self {
        RawConn::new()
    }
}
