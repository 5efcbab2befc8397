//! Run control shared by the lab benchmarks (`bench/migration`,
//! `bench/maintenance`): SIGINT/SIGTERM end a run promptly (and let it tear
//! its lab down), waits are bounded, the load client dies with the run.

use std::process::Child;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// Set by SIGINT/SIGTERM once [`stop_on_signals`] ran.
pub static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, Ordering::SeqCst);
}

/// SIGINT and SIGTERM set [`STOP`] instead of killing the process.
pub fn stop_on_signals() {
    let handler = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
    // SAFETY: the handler only stores to an atomic (async-signal-safe).
    unsafe {
        libc::signal(libc::SIGINT, handler);
        libc::signal(libc::SIGTERM, handler);
    }
}

/// Sleeps in small steps; `Err` as soon as a signal asked to stop.
pub fn sleep(d: Duration) -> Result<(), String> {
    let end = Instant::now() + d;
    while Instant::now() < end {
        if STOP.load(Ordering::SeqCst) {
            return Err("interrupted".into());
        }
        std::thread::sleep(Duration::from_millis(5).min(end - Instant::now()));
    }
    Ok(())
}

/// Polls `cond` every 20 ms until it holds, for at most `limit`.
pub fn wait_until(
    what: &str,
    limit: Duration,
    mut cond: impl FnMut() -> bool,
) -> Result<(), String> {
    let start = Instant::now();
    while !cond() {
        if start.elapsed() > limit {
            return Err(format!("timed out after {limit:?} waiting for {what}"));
        }
        sleep(Duration::from_millis(20))?;
    }
    Ok(())
}

/// Kills the load client if the run ends early.
pub struct ClientGuard(pub Child);

impl Drop for ClientGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
