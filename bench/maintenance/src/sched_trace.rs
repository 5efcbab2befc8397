//! Where the CPU goes, bin by bin (`CAPYBARA_BENCH_SCHED_TRACE=1`): an
//! investigation aid, off by default.
//!
//! A thread of the harness samples, every [`PERIOD`], each lab process's
//! scheduler statistics (`/proc/PID/task/*/schedstat`: time on a CPU, time
//! runnable but waiting for one, summed over the process's threads) and
//! each CPU's time split (`/proc/stat`: user, system, softirq, idle). The
//! samples are written as `sched.csv` next to `bins.csv`, with the time in
//! ms relative to the event, so that a slow bin can be matched with who ran
//! and who waited in it. Timestamps are CLOCK_MONOTONIC, the clock of the
//! client's bins.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Sampling period (the bins are 10 ms).
const PERIOD: Duration = Duration::from_millis(5);
/// At most this many samples (60 s at 5 ms).
const MAX_SAMPLES: usize = 12_000;

pub fn enabled() -> bool {
    std::env::var("CAPYBARA_BENCH_SCHED_TRACE").is_ok_and(|v| v != "0")
}

/// CLOCK_MONOTONIC in ns (the clock `std::time::Instant` reads on Linux).
pub use capybara_proto::time::monotonic_ns as mono_ns;

struct Sample {
    at_ns: u64,
    /// Per process: (on-CPU ns, runnable-waiting ns, minor page faults),
    /// cumulative.
    procs: Vec<(u64, u64, u64)>,
    /// Per CPU: (user+nice, system, softirq+irq, idle+iowait) in clock
    /// ticks (10 ms: sum several rows before reading them).
    cpus: Vec<[u64; 4]>,
    /// Runnable tasks on the machine at the sample (`procs_running`).
    running: u64,
}

pub struct SchedTrace {
    names: Vec<String>,
    stop: Arc<AtomicBool>,
    samples: Arc<Mutex<Vec<Sample>>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// A process's minor page faults so far, all threads (`/proc/PID/stat`
/// field 10; first touches of fresh memory are minor faults).
pub fn minor_faults(pid: u32) -> u64 {
    let Ok(s) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0;
    };
    // The command name (field 2) may hold spaces: count after its ')'.
    s.rsplit_once(')')
        .and_then(|(_, rest)| rest.split_whitespace().nth(7))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

fn proc_sched(pid: u32) -> (u64, u64, u64) {
    let (mut run, mut wait) = (0, 0);
    let faults = minor_faults(pid);
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return (0, 0, faults);
    };
    for t in dir.flatten() {
        let Ok(s) = std::fs::read_to_string(t.path().join("schedstat")) else {
            continue;
        };
        let mut it = s.split_whitespace().map(|v| v.parse::<u64>().unwrap_or(0));
        run += it.next().unwrap_or(0);
        wait += it.next().unwrap_or(0);
    }
    (run, wait, faults)
}

fn cpu_times() -> (Vec<[u64; 4]>, u64) {
    let text = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let running = text
        .lines()
        .find_map(|l| l.strip_prefix("procs_running "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    let cpus = text
        .lines()
        .filter(|l| l.starts_with("cpu") && l.as_bytes().get(3).is_some_and(u8::is_ascii_digit))
        .map(|l| {
            let v: Vec<u64> = l
                .split_whitespace()
                .skip(1)
                .map(|x| x.parse().unwrap_or(0))
                .collect();
            let g = |i: usize| v.get(i).copied().unwrap_or(0);
            // user nice system idle iowait irq softirq steal
            [g(0) + g(1), g(2), g(5) + g(6), g(3) + g(4)]
        })
        .collect();
    (cpus, running)
}

impl SchedTrace {
    /// Starts sampling the processes `procs` (name, pid).
    pub fn start(procs: Vec<(String, u32)>) -> SchedTrace {
        let stop = Arc::new(AtomicBool::new(false));
        let samples = Arc::new(Mutex::new(Vec::with_capacity(MAX_SAMPLES)));
        let names = procs.iter().map(|(n, _)| n.clone()).collect();
        let (st, sm) = (stop.clone(), samples.clone());
        let thread = std::thread::spawn(move || {
            let mut next = mono_ns();
            while !st.load(Ordering::Relaxed) {
                let at_ns = mono_ns();
                let procs = procs.iter().map(|(_, pid)| proc_sched(*pid)).collect();
                let (cpus, running) = cpu_times();
                let s = Sample {
                    at_ns,
                    procs,
                    cpus,
                    running,
                };
                {
                    let mut v = sm.lock().unwrap_or_else(|e| e.into_inner());
                    if v.len() >= MAX_SAMPLES {
                        break;
                    }
                    v.push(s);
                }
                next += PERIOD.as_nanos() as u64;
                let now = mono_ns();
                if next > now {
                    std::thread::sleep(Duration::from_nanos(next - now));
                } else {
                    next = now;
                }
            }
        });
        SchedTrace {
            names,
            stop,
            samples,
            thread: Some(thread),
        }
    }

    /// Stops sampling and writes `path`: one row per sample interval, the
    /// time (ms after `event_ns`), per process the ms on a CPU, the ms
    /// runnable but waiting and the minor page faults, the machine's runnable tasks, per CPU the
    /// clock ticks (10 ms) of user / system / irq+softirq / idle time.
    pub fn finish(mut self, path: &Path, event_ns: u64) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let v = self.samples.lock().unwrap_or_else(|e| e.into_inner());
        let mut out = String::from("ms,running");
        for n in &self.names {
            out.push_str(&format!(",{n}_run_ms,{n}_wait_ms,{n}_faults"));
        }
        let ncpu = v.first().map_or(0, |s| s.cpus.len());
        for c in 0..ncpu {
            out.push_str(&format!(",cpu{c}_user,cpu{c}_sys,cpu{c}_irq,cpu{c}_idle"));
        }
        out.push('\n');
        for w in v.windows(2) {
            let (a, b) = (&w[0], &w[1]);
            let t = (b.at_ns as i64 - event_ns as i64) as f64 / 1e6;
            out.push_str(&format!("{t:.1},{}", b.running));
            for (pa, pb) in a.procs.iter().zip(&b.procs) {
                out.push_str(&format!(
                    ",{:.2},{:.2},{}",
                    pb.0.saturating_sub(pa.0) as f64 / 1e6,
                    pb.1.saturating_sub(pa.1) as f64 / 1e6,
                    pb.2.saturating_sub(pa.2)
                ));
            }
            for (ca, cb) in a.cpus.iter().zip(&b.cpus) {
                for i in 0..4 {
                    out.push_str(&format!(",{}", cb[i].saturating_sub(ca[i])));
                }
            }
            out.push('\n');
        }
        let _ = std::fs::write(path, out);
    }
}

impl Drop for SchedTrace {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}
