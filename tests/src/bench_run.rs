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

/// Binds every thread of process `pid` to CPU `cpu` (benchmarks that model
/// separate machines on one host). The error names the thread and why.
pub fn pin_process(pid: u32, cpu: usize) -> Result<(), String> {
    let tasks =
        std::fs::read_dir(format!("/proc/{pid}/task")).map_err(|e| format!("pin {pid}: {e}"))?;
    for t in tasks.flatten() {
        let Some(tid) = t.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        // SAFETY: `set` is a plain bit set on the stack, passed with its
        // size; sched_setaffinity only reads it.
        let rc = unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(cpu, &mut set);
            libc::sched_setaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &set)
        };
        if rc != 0 {
            return Err(format!(
                "pin thread {tid} of process {pid} to CPU {cpu}: {}",
                std::io::Error::last_os_error()
            ));
        }
    }
    Ok(())
}
