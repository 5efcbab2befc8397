//! `make bench-maintenance` (issue #8, paper §8.4): planned maintenance of a
//! Redis server behind the sidecar, TLS on.
//!
//! A lab with the switch and two servers, each running redis-server on
//! 127.0.0.1:6379 and the hostagent's sidecar on VIP:6379 (TLS terminated in
//! the sidecar, `capybara-tls`). The load client (this binary, `client`
//! subcommand, inside the client namespace) opens 16 TLS connections while
//! only the primary (s1) is registered, so all of them land on it; then the
//! backup (s2) starts. Each connection runs closed-loop pipelined GETs
//! (depth 8) and every completed reply is counted in a 10 ms bin. The
//! load-balancing policies are off (`[policy] enabled = false`), so the
//! only migrations are the drain's.
//!
//! After a steady phase the primary goes away, in one of two ways:
//! - `capybara`: `POST /servers/1/drain` on switchd; the primary migrates
//!   every connection (TCP + sidecar + TLS state) to the backup;
//! - `reconnect` (the usual alternative): the primary's redis-server is
//!   killed, the sidecar closes the client connections (application health
//!   checks are off in this mode: with them the hostagent would migrate
//!   idle connections of the dead redis), and the clients
//!   reconnect (new TCP + TLS handshakes) until they reach a server that
//!   answers (the switch still has the primary in its pool, as a load
//!   balancer does until its health check notices, so a reconnect may land
//!   on the primary and be closed again).
//!
//! - `paced`: the `capybara` drain again, under an open-loop load: each
//!   connection sends its batch on a fixed schedule at
//!   `CAPYBARA_BENCH_PACE` (default 0.5) of the `capybara` run's steady
//!   rate, so the bins lose the closed loop's scheduling noise.
//!
//! Output: per-mode summary lines, the bins as CSV under
//! `test-output/bench-maintenance-<mode>/bins.csv`, and a last line
//! `RESULT capybara_min_bin_ratio=... reconnect_min_bin_ratio=...
//! reconnect_recovery_ms=... ...`. Needs root, redis-server and openssl.
//! Bounded: every wait has a limit, the client stops itself after 60 s, and
//! the lab (namespaces, processes) is torn down on every exit path,
//! including SIGINT/SIGTERM.

mod sched_trace;
mod stall_watch;

use capybara_systests::bench_run::{sleep, stop_on_signals, wait_until, ClientGuard, STOP};
use capybara_systests::{bin, deployment_key, output_dir, Lab};
use std::io::{BufRead, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use std::time::{Duration, Instant};

const VIP: &str = "198.18.100.1";
const PORT: u16 = 6379;
const CONNECTIONS: usize = 16;
const PIPELINE: usize = 8;
const BIN_MS: u64 = 10;
/// The client stops by itself after this long, whatever happens.
const CLIENT_MAX: Duration = Duration::from_secs(60);
const MAX_BINS: usize = (60_000 / BIN_MS) as usize + 1;
const STEADY: Duration = Duration::from_millis(1500);
/// Bins before the event that define steady throughput (1 s).
const STEADY_BINS: usize = 100;
const AFTER: Duration = Duration::from_millis(2500);
/// Bins after the event that are judged (2 s).
const JUDGED_BINS: usize = 200;
/// Recovery is judged on 50 ms windows.
const RECOVERY_BINS: usize = 5;
/// A connection that completes no reply for longer than this is paused
/// (the client records each pause: when, how long).
const STALL_US: u64 = 2_000;
const MAX_STALLS: usize = 4096;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("client") {
        if let Err(e) = client(&args[2..]) {
            eprintln!("bench-maintenance client: {e}");
            std::process::exit(1);
        }
        return;
    }
    stop_on_signals();
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("bench-maintenance: needs root (network namespaces)");
        std::process::exit(2);
    }
    let priority = SessionPriority::raise();
    let started = Instant::now();
    let mut results = Vec::new();
    // `CAPYBARA_BENCH_MODES=capybara` runs one mode (no RESULT line).
    let only = std::env::var("CAPYBARA_BENCH_MODES").unwrap_or_default();
    let pace: f64 = match std::env::var("CAPYBARA_BENCH_PACE") {
        Ok(v) => match v.trim().parse::<f64>() {
            Ok(f) if f > 0.0 && f <= 1.0 => f,
            _ => {
                eprintln!(
                    "bench-maintenance: CAPYBARA_BENCH_PACE={v:?}: want a fraction in (0, 1]"
                );
                std::process::exit(2);
            }
        },
        Err(_) => PACE,
    };
    for mode in [Mode::Capybara, Mode::Reconnect, Mode::Paced] {
        if !only.is_empty() && !only.split(',').any(|m| m == mode.name()) {
            continue;
        }
        // The paced run offers a fixed fraction of what the closed-loop
        // clients completed in the capybara run's steady phase.
        let rate = match mode {
            Mode::Paced => match results
                .iter()
                .find(|r: &&ModeResult| r.mode == Mode::Capybara)
            {
                Some(c) => c.steady_per_bin * 1000.0 / BIN_MS as f64 * pace,
                None => {
                    eprintln!("bench-maintenance: the paced mode needs the capybara mode's steady rate (CAPYBARA_BENCH_MODES=capybara,paced)");
                    std::process::exit(2);
                }
            },
            _ => 0.0,
        };
        // Each mode in its own lab; the lab guard tears it down on return,
        // error or panic.
        match run_mode(mode, rate) {
            Ok(r) => {
                r.print();
                results.push(r);
            }
            Err(e) => {
                eprintln!("bench-maintenance: {}: {e}", mode.name());
                drop(priority);
                std::process::exit(1);
            }
        }
    }
    if results.len() < 3 {
        return;
    }
    let (c, r, p) = (&results[0], &results[1], &results[2]);
    println!("total time {:.1} s", started.elapsed().as_secs_f64());
    println!(
        "RESULT capybara_min_bin_ratio={:.3} reconnect_min_bin_ratio={:.3} reconnect_recovery_ms={} \
         capybara_recovery_ms={} steady_min_bin_ratio={:.3} capybara_steady_gets_per_s={:.0} \
         reconnect_steady_gets_per_s={:.0} capybara_reconnects={} reconnect_reconnects={} \
         capybara_migrations={} paced_min_bin_ratio={:.3} paced_steady_min_bin_ratio={:.3} \
         paced_gets_per_s={:.0} paced_reconnects={} capybara_machine_stall_ms={:.1} \
         paced_machine_stall_ms={:.1} connections={CONNECTIONS} pipeline={PIPELINE} bin_ms={BIN_MS} tls=1",
        c.min_ratio,
        r.min_ratio,
        r.recovery_ms,
        c.recovery_ms,
        c.steady_min_ratio.min(r.steady_min_ratio),
        c.steady_per_bin * 1000.0 / BIN_MS as f64,
        r.steady_per_bin * 1000.0 / BIN_MS as f64,
        c.reconnects,
        r.reconnects,
        c.migrations,
        p.min_ratio,
        p.steady_min_ratio,
        p.steady_per_bin * 1000.0 / BIN_MS as f64,
        p.reconnects,
        c.machine.judged_ms,
        p.machine.judged_ms,
    );
}

/// The scheduling weight of this session (the autogroup that holds this
/// process and every process of the lab it starts), raised for the run and
/// restored after, as `bench/experiments` does (`--nice`): on a shared
/// 2-core machine, compilers in other sessions otherwise take the CPU from
/// the whole lab for tens to hundreds of milliseconds at a time.
/// `CAPYBARA_BENCH_NICE` (default -10; 0 leaves it alone).
struct SessionPriority(Option<String>);

impl SessionPriority {
    const PATH: &'static str = "/proc/self/autogroup";

    fn raise() -> SessionPriority {
        let nice: i32 = std::env::var("CAPYBARA_BENCH_NICE")
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(-10);
        // "/autogroup-16 nice 0"
        let old = std::fs::read_to_string(Self::PATH)
            .ok()
            .and_then(|t| t.split_whitespace().last().map(str::to_string));
        if nice == 0 || old.is_none() {
            return SessionPriority(None);
        }
        match std::fs::write(Self::PATH, nice.to_string()) {
            Ok(()) => {
                println!(
                    "session scheduling weight: nice {nice} for the run (CAPYBARA_BENCH_NICE)"
                );
                SessionPriority(old)
            }
            Err(e) => {
                println!("session scheduling weight unchanged ({}: {e})", Self::PATH);
                SessionPriority(None)
            }
        }
    }
}

impl Drop for SessionPriority {
    fn drop(&mut self) {
        if let Some(old) = &self.0 {
            let _ = std::fs::write(Self::PATH, old);
        }
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Mode {
    Capybara,
    Reconnect,
    /// Capybara's drain under an open-loop load (`PACE` of the capybara
    /// run's steady rate, on a fixed schedule per connection): a client
    /// below saturation, whose bins do not carry the closed loop's
    /// scheduling noise, so a pause the drain causes stands out.
    Paced,
}

/// Default offered load of the paced mode, as a fraction of the closed-loop
/// steady rate (`CAPYBARA_BENCH_PACE`).
const PACE: f64 = 0.5;

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Capybara => "capybara",
            Mode::Reconnect => "reconnect",
            Mode::Paced => "paced",
        }
    }
}

struct ModeResult {
    mode: Mode,
    steady_per_bin: f64,
    steady_min_ratio: f64,
    min_ratio: f64,
    recovery_ms: u64,
    reconnects: u64,
    errors: u64,
    migrations: usize,
    request_ms: u64,
    /// Per connection, its longest pause after the event / in the steady
    /// phase (ms, sorted).
    pause_judged: Vec<f64>,
    pause_steady: Vec<f64>,
    all_paused_judged_ms: u64,
    all_paused_steady_ms: u64,
    /// Minor page faults of each lab process (name, in the steady phase's
    /// last `STEADY`, from the event to the end of `AFTER`).
    faults: Vec<(String, u64, u64)>,
    machine: MachineStalls,
}

/// What `stall_watch` saw during a mode's windows.
struct MachineStalls {
    available: bool,
    judged_ms: f64,
    steady_ms: f64,
    longest_judged_ms: f64,
    /// Worst judged bin among those no machine stall overlapped (None:
    /// the watch could not run).
    clear_min_ratio: Option<f64>,
}

impl ModeResult {
    fn print(&self) {
        println!(
            "{:9} steady {:.0} GETs/s (median of {STEADY_BINS} bins), min bin after the event {:.3} of steady, \
             back at >= 90% (50 ms mean) {} ms after it, steady-phase min bin {:.3}, reconnects {}, errors {}, migrations {}",
            self.mode.name(),
            self.steady_per_bin * 1000.0 / BIN_MS as f64,
            self.min_ratio,
            self.recovery_ms,
            self.steady_min_ratio,
            self.reconnects,
            self.errors,
            self.migrations
        );
        let q = |v: &[f64], p: f64| {
            v.get(((v.len() as f64 - 1.0) * p) as usize)
                .copied()
                .unwrap_or(0.0)
        };
        println!(
            "{:9} per-connection longest pause after the event: p50 {:.1} ms, max {:.1} ms (steady phase: p50 {:.1}, max {:.1}); \
             all {CONNECTIONS} paused at once: {} ms after the event, {} ms in the steady phase; drain request {} ms",
            self.mode.name(),
            q(&self.pause_judged, 0.5),
            q(&self.pause_judged, 1.0),
            q(&self.pause_steady, 0.5),
            q(&self.pause_steady, 1.0),
            self.all_paused_judged_ms,
            self.all_paused_steady_ms,
            self.request_ms,
        );
        let m = &self.machine;
        if m.available {
            println!(
                "{:9} machine stalls (no CPU for a real-time thread for > 2 ms): {:.1} ms after the event (longest {:.1} ms), \
                 {:.1} ms in the steady phase; min bin after the event outside them {:.3}",
                self.mode.name(),
                m.judged_ms,
                m.longest_judged_ms,
                m.steady_ms,
                m.clear_min_ratio.unwrap_or(f64::NAN),
            );
        } else {
            println!(
                "{:9} machine stalls: unavailable (no SCHED_FIFO)",
                self.mode.name()
            );
        }
        let f: Vec<String> = self
            .faults
            .iter()
            .map(|(n, steady, after)| format!("{n} {steady}/{after}"))
            .collect();
        println!(
            "{:9} minor page faults, {} ms before the event / {} ms from it: {}",
            self.mode.name(),
            STEADY.as_millis(),
            AFTER.as_millis(),
            f.join(", ")
        );
    }
}

/// `rate`: GETs/s the client offers on a fixed schedule (0: closed loop).
fn run_mode(mode: Mode, rate: f64) -> Result<ModeResult, String> {
    let dir = output_dir(&format!("bench-maintenance-{}", mode.name()));
    let mut lab = Lab::up("bm", 2);
    let cert = make_cert(&dir)?;
    let key = deployment_key(&dir);
    let sw = switchd_config(&lab, &dir, &key);
    let switchd_pid = lab.spawn_logged(
        "sw",
        bin("switchd"),
        &["--config", sw.to_str().unwrap()],
        &dir.join("switchd.log"),
    );
    let mut redis_pid = [0u32; 3];
    for j in 1..=2u32 {
        let rdir = dir.join(format!("redis-s{j}"));
        std::fs::create_dir_all(&rdir).map_err(|e| e.to_string())?;
        redis_pid[j as usize] = lab.spawn_logged(
            &format!("s{j}"),
            "redis-server",
            &[
                "--port",
                "6379",
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--protected-mode",
                "no",
                "--dir",
                rdir.to_str().unwrap(),
            ],
            &rdir.join("redis.log"),
        );
    }
    let start_agent = |lab: &mut Lab, j: u32| {
        let cfg = hostagent_config(&dir, j, &key, &cert, mode);
        lab.spawn_logged(
            &format!("s{j}"),
            bin("hostagent"),
            &["--config", cfg.to_str().unwrap()],
            &dir.join(format!("hostagent-s{j}.log")),
        )
    };
    let registered = |j: u32| {
        let log = std::fs::read_to_string(dir.join("switchd.log")).unwrap_or_default();
        log.contains(&format!("registered s{j}"))
    };
    // Only the primary is in the pool while the clients connect.
    let agent1_pid = start_agent(&mut lab, 1);
    wait_until("the primary to register", Duration::from_secs(30), || {
        registered(1)
    })?;

    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let child = lab
        .command("c1", &exe)
        .args([
            "client",
            VIP,
            &PORT.to_string(),
            cert.to_str().unwrap(),
            &format!("{rate:.0}"),
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .map_err(|e| format!("spawn the load client: {e}"))?;
    let mut client = ClientGuard(child);
    let mut to_client = client.0.stdin.take().ok_or("client stdin")?;
    let from_client = lines(client.0.stdout.take().ok_or("client stdout")?);
    expect(&from_client, "ready", Duration::from_secs(30))?;

    let agent2_pid = start_agent(&mut lab, 2);
    wait_until("the backup to register", Duration::from_secs(30), || {
        registered(2)
    })?;
    let procs: Vec<(String, u32)> = vec![
        ("client".into(), client.0.id()),
        ("switchd".into(), switchd_pid),
        ("agent1".into(), agent1_pid),
        ("redis1".into(), redis_pid[1]),
        ("agent2".into(), agent2_pid),
        ("redis2".into(), redis_pid[2]),
    ];
    // For traces taken alongside (`perf sched record` and the like).
    let mut pids: Vec<String> = procs.iter().map(|(n, p)| format!("{n}={p}")).collect();
    pids.push(format!("harness={}", std::process::id()));
    let _ = std::fs::write(dir.join("pids"), pids.join(",") + "\n");
    if let Ok(spec) = std::env::var("CAPYBARA_BENCH_PIN") {
        pin(&spec, &procs)?;
    }
    let faults_of = |procs: &[(String, u32)]| -> Vec<u64> {
        procs
            .iter()
            .map(|(_, p)| sched_trace::minor_faults(*p))
            .collect()
    };
    let fault_names: Vec<String> = procs.iter().map(|(n, _)| n.clone()).collect();
    let fault_pids = procs.clone();
    let trace = sched_trace::enabled().then(|| sched_trace::SchedTrace::start(procs));
    // The drain request is made from this process (a thread inside the
    // switch's namespace, connected beforehand), not by spawning
    // `ip netns exec curl` in the measured window: on a loaded machine
    // that took up to seconds and its CPU burst landed in the judged bins.
    let drain = match mode {
        Mode::Capybara | Mode::Paced => Some(HttpInNetns::connect(
            &lab.namespace("sw"),
            "127.0.0.1:9102",
            "POST /servers/1/drain?deadline_ms=2000",
        )?),
        Mode::Reconnect => None,
    };
    let watch = stall_watch::StallWatch::start();
    let faults_start = faults_of(&fault_pids);
    sleep(STEADY)?;

    let faults_event = faults_of(&fault_pids);
    send(&mut to_client, "event")?;
    let ok = expect(&from_client, "event_bin", Duration::from_secs(5))?;
    let field = |line: &str, i: usize| -> Result<u64, String> {
        line.split_whitespace()
            .nth(i)
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| format!("bad client line {line:?}"))
    };
    let event_bin = field(&ok, 1)? as usize;
    let event_us = field(&ok, 2)?;
    let event_mono_ns = field(&ok, 3)?;
    // For traces taken alongside (e.g. `perf record -k CLOCK_MONOTONIC`).
    let _ = std::fs::write(dir.join("event_mono_ns"), format!("{event_mono_ns}\n"));
    // CLOCK_MONOTONIC at the start of the bin at ms 0 in `bins.csv` (the
    // event's bin), to cut traces into the same 10 ms bins.
    let bin0_mono_ns = event_mono_ns.saturating_sub(event_us % (BIN_MS * 1000) * 1000);
    let _ = std::fs::write(dir.join("bin0_mono_ns"), format!("{bin0_mono_ns}\n"));
    // The drain request's round trip (to switchd and back): the event is
    // marked before it, so the judged window starts early.
    let mut request_ms = 0;
    match (mode, drain) {
        (Mode::Capybara | Mode::Paced, Some(drain)) => {
            let body = drain.send(Duration::from_secs(5))?;
            // switchd answers 200 "applied" once its control loop applied
            // the drain, 202 "accepted" when that takes longer (the bench
            // expected "accepted" only and stopped here since switchd
            // answered "applied").
            let status = body.lines().next().unwrap_or("");
            if !(status.contains(" 200 ") || status.contains(" 202 ")) {
                return Err(format!("drain request refused: {body:?}"));
            }
            send(&mut to_client, "mark")?;
            let m = expect(&from_client, "mark_us", Duration::from_secs(5))?;
            request_ms = field(&m, 1)?.saturating_sub(event_us) / 1000;
        }
        (Mode::Capybara | Mode::Paced, None) => {
            unreachable!("the drain request is set up above")
        }
        (Mode::Reconnect, _) => {
            // SAFETY: plain kill(2) of the redis-server this run started.
            if unsafe { libc::kill(redis_pid[1] as libc::pid_t, libc::SIGKILL) } != 0 {
                return Err("cannot kill the primary's redis-server".into());
            }
        }
    }
    sleep(AFTER)?;
    let faults_end = faults_of(&fault_pids);
    let stalls = watch.finish();
    let faults = fault_names
        .into_iter()
        .zip(faults_start.iter().zip(&faults_event).zip(&faults_end))
        .map(|(n, ((a, b), c))| (n, b.saturating_sub(*a), c.saturating_sub(*b)))
        .collect();
    send(&mut to_client, "stop")?;
    let report = expect(&from_client, "bins", Duration::from_secs(10))?;
    let stalls_line = expect(&from_client, "stalls", Duration::from_secs(5))?;
    let conn_bins = expect(&from_client, "connbins", Duration::from_secs(5))?;
    let stats = expect(&from_client, "stats", Duration::from_secs(5))?;
    if let Some(t) = trace {
        t.finish(&dir.join("sched.csv"), event_mono_ns);
    }
    let pauses = Pauses::parse(&stalls_line);
    let bins: Vec<u64> = report
        .split_whitespace()
        .nth(1)
        .unwrap_or("")
        .split(',')
        .filter_map(|v| v.parse().ok())
        .collect();
    let stat = |name: &str| -> u64 {
        stats
            .split_whitespace()
            .find_map(|kv| kv.strip_prefix(&format!("{name}=")))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    let mut csv = String::from("ms,gets\n");
    for (i, b) in bins.iter().enumerate() {
        csv.push_str(&format!(
            "{},{b}\n",
            (i as i64 - event_bin as i64) * BIN_MS as i64
        ));
    }
    let _ = std::fs::write(dir.join("bins.csv"), csv);
    write_conn_bins(&dir.join("conn_bins.csv"), &conn_bins, event_bin);

    if event_bin < STEADY_BINS || bins.len() < event_bin + JUDGED_BINS {
        return Err(format!(
            "too few bins: {} (event at bin {event_bin})",
            bins.len()
        ));
    }
    let steady_window = &bins[event_bin - STEADY_BINS..event_bin];
    let steady = median(steady_window);
    if steady <= 0.0 {
        return Err("no GETs completed in the steady phase".into());
    }
    let judged = &bins[event_bin..event_bin + JUDGED_BINS];
    let ratio = |b: &u64| *b as f64 / steady;
    let min_ratio = judged.iter().map(ratio).fold(f64::INFINITY, f64::min);
    let steady_min_ratio = steady_window
        .iter()
        .map(ratio)
        .fold(f64::INFINITY, f64::min);
    // Recovered: the end of the first 50 ms window after the event whose
    // mean is back at 90% of steady (single noisy bins on the shared machine
    // do not count; `min_ratio` reports the worst bin).
    let recovery_ms = judged
        .windows(RECOVERY_BINS)
        .position(|w| w.iter().sum::<u64>() as f64 / RECOVERY_BINS as f64 >= 0.9 * steady)
        .map_or(JUDGED_BINS as u64 * BIN_MS, |i| {
            (i + RECOVERY_BINS) as u64 * BIN_MS
        });
    let ev_us = event_bin as u64 * BIN_MS * 1000;
    let judged_us = (ev_us, ev_us + JUDGED_BINS as u64 * BIN_MS * 1000);
    let steady_us = (ev_us - STEADY_BINS as u64 * BIN_MS * 1000, ev_us);
    // Machine stalls (stall_watch): time in the windows, and the worst
    // judged bin among those no stall touched.
    let bin_ns = BIN_MS * 1_000_000;
    let judged_mono = (bin0_mono_ns, bin0_mono_ns + JUDGED_BINS as u64 * bin_ns);
    let steady_mono = (
        bin0_mono_ns.saturating_sub(STEADY_BINS as u64 * bin_ns),
        bin0_mono_ns,
    );
    let clear_min_ratio = stalls.available.then(|| {
        judged
            .iter()
            .enumerate()
            .filter(|(i, _)| {
                let from = bin0_mono_ns + *i as u64 * bin_ns;
                stalls.overlap_ns(from, from + bin_ns) == 0
            })
            .map(|(_, b)| ratio(b))
            .fold(f64::INFINITY, f64::min)
    });
    let machine = MachineStalls {
        available: stalls.available,
        judged_ms: stalls.overlap_ns(judged_mono.0, judged_mono.1) as f64 / 1e6,
        steady_ms: stalls.overlap_ns(steady_mono.0, steady_mono.1) as f64 / 1e6,
        longest_judged_ms: stalls.longest_ns(judged_mono.0, judged_mono.1) as f64 / 1e6,
        clear_min_ratio,
    };
    let migrations = std::fs::read_to_string(dir.join("hostagent-s1.log"))
        .unwrap_or_default()
        .lines()
        .filter(|l| l.starts_with("sidecar ") && l.contains(" migrated to "))
        .count();
    Ok(ModeResult {
        mode,
        steady_per_bin: steady,
        steady_min_ratio,
        min_ratio,
        recovery_ms,
        reconnects: stat("reconnects"),
        errors: stat("errors"),
        migrations,
        request_ms,
        pause_judged: pauses.longest_per_connection(judged_us),
        pause_steady: pauses.longest_per_connection(steady_us),
        all_paused_judged_ms: pauses.all_paused_us(judged_us, CONNECTIONS) / 1000,
        all_paused_steady_ms: pauses.all_paused_us(steady_us, CONNECTIONS) / 1000,
        faults,
        machine,
    })
}

/// Each connection's bins (the client's `connbins` line: one
/// comma-separated list per connection, `;` between connections) as CSV
/// with the time relative to the event.
fn write_conn_bins(path: &Path, line: &str, event_bin: usize) {
    let per: Vec<Vec<&str>> = line
        .split_whitespace()
        .nth(1)
        .unwrap_or("")
        .split(';')
        .map(|c| c.split(',').collect())
        .collect();
    let n = per.iter().map(Vec::len).max().unwrap_or(0);
    let mut csv = String::from("ms");
    for i in 0..per.len() {
        csv.push_str(&format!(",c{i}"));
    }
    csv.push('\n');
    for b in 0..n {
        csv.push_str(&format!(
            "{}",
            (b as i64 - event_bin as i64) * BIN_MS as i64
        ));
        for c in &per {
            csv.push_str(&format!(",{}", c.get(b).copied().unwrap_or("")));
        }
        csv.push('\n');
    }
    let _ = std::fs::write(path, csv);
}

/// `CAPYBARA_BENCH_PIN=name:cpu,...` (investigations): binds every thread
/// of the named lab processes (`client`, `switchd`, `agent1`, `redis1`,
/// `agent2`, `redis2`) to one CPU each.
fn pin(spec: &str, procs: &[(String, u32)]) -> Result<(), String> {
    for item in spec.split(',').filter(|i| !i.is_empty()) {
        let (name, cpu) = item
            .split_once(':')
            .and_then(|(n, c)| Some((n, c.parse::<usize>().ok()?)))
            .ok_or_else(|| format!("CAPYBARA_BENCH_PIN: {item:?} is not name:cpu"))?;
        let pid = procs
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, p)| *p)
            .ok_or_else(|| format!("CAPYBARA_BENCH_PIN: no lab process {name:?}"))?;
        capybara_systests::bench_run::pin_process(pid, cpu)
            .map_err(|e| format!("CAPYBARA_BENCH_PIN {name}: {e}"))?;
    }
    Ok(())
}

/// The client's record of pauses: per connection, (start µs, length µs) of
/// every stretch without a completed reply longer than `STALL_US`.
struct Pauses(Vec<Vec<(u64, u64)>>);

impl Pauses {
    fn parse(line: &str) -> Pauses {
        let mut per = vec![Vec::new(); CONNECTIONS];
        for item in line.split_whitespace().nth(1).unwrap_or("").split(',') {
            let v: Vec<u64> = item.split(':').filter_map(|x| x.parse().ok()).collect();
            if let [c, at, len] = v[..] {
                if let Some(p) = per.get_mut(c as usize) {
                    p.push((at, len));
                }
            }
        }
        Pauses(per)
    }

    /// Each connection's longest pause (ms) overlapping `window`, sorted.
    fn longest_per_connection(&self, (from, to): (u64, u64)) -> Vec<f64> {
        let mut v: Vec<f64> = self
            .0
            .iter()
            .map(|p| {
                p.iter()
                    .filter(|(at, len)| at + len > from && *at < to)
                    .map(|(at, len)| ((at + len).min(to) - (*at).max(from)) as f64 / 1000.0)
                    .fold(0.0, f64::max)
            })
            .collect();
        v.sort_by(f64::total_cmp);
        v
    }

    /// Total time in `window` during which all `n` connections were paused
    /// at once (a stall of the whole lab: the machine, not a migration).
    fn all_paused_us(&self, (from, to): (u64, u64), n: usize) -> u64 {
        let mut edges: Vec<(u64, i32)> = Vec::new();
        for p in &self.0 {
            for &(at, len) in p {
                let (a, b) = (at.max(from), (at + len).min(to));
                if a < b {
                    edges.push((a, 1));
                    edges.push((b, -1));
                }
            }
        }
        edges.sort();
        let (mut depth, mut since, mut total) = (0i32, 0u64, 0u64);
        for (t, d) in edges {
            if depth as usize >= n {
                total += t - since;
            }
            depth += d;
            since = t;
        }
        total
    }
}

/// One HTTP request made from inside a network namespace: a thread enters
/// the namespace ahead of time (`setns` affects only the calling thread);
/// `send` has it connect, write the request and return the response.
struct HttpInNetns {
    go: std::sync::mpsc::Sender<()>,
    done: Receiver<Result<String, String>>,
}

impl HttpInNetns {
    fn connect(netns: &str, addr: &str, request_line: &str) -> Result<HttpInNetns, String> {
        let path = format!("/run/netns/{netns}");
        let (addr, request_line) = (addr.to_string(), request_line.to_string());
        let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel::<Result<(), String>>();
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let enter = || -> Result<SocketAddr, String> {
                let ns = std::fs::File::open(&path).map_err(|e| format!("{path}: {e}"))?;
                use std::os::fd::AsRawFd;
                // SAFETY: setns(2) on an open namespace descriptor; it
                // changes this thread's network namespace only.
                if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                    return Err(format!("setns {path}: {}", std::io::Error::last_os_error()));
                }
                addr.parse().map_err(|e| format!("{addr}: {e}"))
            };
            let a = match enter() {
                Ok(a) => {
                    let _ = ready_tx.send(Ok(()));
                    a
                }
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                    return;
                }
            };
            if go_rx.recv().is_err() {
                return;
            }
            // Connected only now: switchd's status endpoint serves one
            // connection at a time and gives an idle one 2 s.
            let req = format!(
                "{request_line} HTTP/1.1\r\nHost: switchd\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
            );
            let r = TcpStream::connect_timeout(&a, Duration::from_secs(5))
                .and_then(|mut s| {
                    s.set_read_timeout(Some(Duration::from_secs(5)))?;
                    s.write_all(req.as_bytes())?;
                    let mut body = String::new();
                    s.read_to_string(&mut body).map(|_| body)
                })
                .map_err(|e| format!("{request_line} to {a} in {path}: {e}"));
            let _ = done_tx.send(r);
        });
        ready_rx
            .recv_timeout(Duration::from_secs(10))
            .map_err(|_| "the request thread did not connect in time".to_string())??;
        Ok(HttpInNetns {
            go: go_tx,
            done: done_rx,
        })
    }

    fn send(self, limit: Duration) -> Result<String, String> {
        self.go
            .send(())
            .map_err(|_| "the request thread is gone".to_string())?;
        self.done
            .recv_timeout(limit)
            .map_err(|_| format!("no answer within {limit:?}"))?
    }
}

fn median(v: &[u64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_unstable();
    s[s.len() / 2] as f64
}

use capybara_systests::{send_line as send, stdout_lines as lines};

fn expect(rx: &Receiver<String>, prefix: &str, limit: Duration) -> Result<String, String> {
    capybara_systests::expect_line(rx, prefix, limit, &STOP)
}

fn make_cert(dir: &Path) -> Result<PathBuf, String> {
    let cert = dir.join("cert.pem");
    let out = std::process::Command::new("openssl")
        .args(["req", "-x509", "-newkey", "ec", "-pkeyopt"])
        .args(["ec_paramgen_curve:prime256v1", "-nodes", "-days", "1"])
        .args(["-subj", "/CN=capybara-bench-maintenance"])
        .args(["-addext", &format!("subjectAltName=IP:{VIP}")])
        // An end-entity certificate (webpki refuses a CA certificate as the server's).
        .args(["-addext", "basicConstraints=critical,CA:FALSE"])
        .arg("-keyout")
        .arg(dir.join("key.pem"))
        .arg("-out")
        .arg(&cert)
        .output()
        .map_err(|e| format!("run openssl: {e}"))?;
    if !out.status.success() {
        return Err(format!("openssl: {}", String::from_utf8_lossy(&out.stderr)));
    }
    Ok(cert)
}

/// switchd's config for `lab` (XDP links pinned in `Lab::pin_dir`).
fn switchd_config(lab: &Lab, dir: &Path, key: &Path) -> PathBuf {
    // `max_flows` (the flow table's capacity; switchd's default when unset).
    let max_flows = std::env::var("CAPYBARA_BENCH_MAX_FLOWS")
        .ok()
        .and_then(|v| v.parse::<u32>().ok())
        .map_or(String::new(), |n| format!("max_flows = {n}\n"));
    let t = format!(
        "control_listen = \"198.18.1.1:7692\"\nkey_file = \"{}\"\nplacement = \"maglev\"\n\
         target_selection = \"round_robin\"\nload_interval_us = 1000\nheartbeat_interval_ms = 100\n\
         dead_after_ms = 1000\nclosed_linger_ms = 5000\nmetrics_listen = \"127.0.0.1:9102\"\n\
         store = \"sqlite:{}\"\n{max_flows}[ha]\nenabled = false\npin_dir = {:?}\n[[interfaces]]\nname = \"cl1\"\nrole = \"client\"\n\
         [[interfaces]]\nname = \"sv1\"\nrole = \"server\"\n[[interfaces]]\nname = \"sv2\"\nrole = \"server\"\n\
         [[services]]\nname = \"redis\"\nvip = \"{VIP}:{PORT}\"\npool = []\n",
        key.display(),
        dir.join("store.db").display(),
        lab.pin_dir()
    );
    let path = dir.join("switchd.toml");
    std::fs::write(&path, t).expect("write switchd config");
    path
}

/// In `reconnect` mode the application health checks are off: that mode
/// is the usual alternative (a balancer that does not move connections),
/// and with them on, the hostagent would migrate the dead redis's idle
/// connections to the backup (docs/OPERATIONS.md, "Application health
/// checks"), which the baseline must not do.
fn hostagent_config(dir: &Path, j: u32, key: &Path, cert: &Path, mode: Mode) -> PathBuf {
    // `[migration] drain_max_in_flight` (the hostagent's default when unset).
    let in_flight = std::env::var("CAPYBARA_BENCH_DRAIN_IN_FLIGHT")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .map_or(String::new(), |n| format!("drain_max_in_flight = {n}\n"));
    let t = format!(
        "name = \"s{j}\"\n[interface]\nname = \"eth0\"\n[stack]\naddress = \"198.18.2.{data}\"\ngateway = \"198.18.1.1\"\n\
         [[service]]\nlisten = \"{VIP}:{PORT}\"\napp = \"sidecar\"\nbackend = \"127.0.0.1:6379\"\nprotocol = \"resp\"\n\
         tls_cert = \"{}\"\ntls_key = \"{}\"\n\
         [migration]\nkey_file = \"{}\"\nswitch = \"198.18.1.1\"\n{in_flight}\
         [control]\nswitch = \"198.18.1.1:7692\"\nserver_id = {j}\nmanagement = \"198.18.1.{data}\"\n\
         [policy]\nenabled = false\n{health}",
        cert.display(),
        cert.with_file_name("key.pem").display(),
        key.display(),
        data = 10 + j,
        health = match mode {
            Mode::Capybara | Mode::Paced => "",
            Mode::Reconnect => "[health]\nenabled = false\n",
        },
    );
    let path = dir.join(format!("hostagent-s{j}.toml"));
    std::fs::write(&path, t).expect("write hostagent config");
    path
}

// ---------------------------------------------------------------------------
// The load client (runs inside the client namespace).
// ---------------------------------------------------------------------------

#[derive(Default)]
struct Counters {
    reconnects: AtomicU64,
    errors: AtomicU64,
    handshakes: AtomicU64,
}

fn client(args: &[String]) -> Result<(), String> {
    let [vip, port, cert, rate] = args else {
        return Err(
            "usage: bench-maintenance client VIP PORT CERT.pem GETS_PER_S (0: closed loop)".into(),
        );
    };
    let rate: f64 = rate
        .parse()
        .ok()
        .filter(|r: &f64| r.is_finite() && *r >= 0.0)
        .ok_or_else(|| format!("GETs/s {rate:?}: want a number >= 0"))?;
    // Paced: each connection sends its batch of PIPELINE GETs every
    // `interval` on a fixed schedule (staggered across connections); a
    // connection behind schedule sends at once until it has caught up, so
    // a pause shows as a low bin followed by a high one.
    let interval =
        (rate > 0.0).then(|| Duration::from_secs_f64((CONNECTIONS * PIPELINE) as f64 / rate));
    let ip: std::net::IpAddr = vip.parse().map_err(|e| format!("VIP {vip}: {e}"))?;
    let port: u16 = port.parse().map_err(|e| format!("port {port}: {e}"))?;
    let addr = SocketAddr::new(ip, port);
    let tls = Arc::new(tls_config(Path::new(cert))?);
    let name = rustls_pki_types::ServerName::IpAddress(ip.into());
    let begin = Instant::now();
    let counters = Arc::new(Counters::default());

    // All connections first (to the primary), so that they exist before the
    // backup joins the pool.
    let mut conns = Vec::new();
    for i in 0..CONNECTIONS {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            match connect(addr, &tls, &name)
                .and_then(|mut c| get_batch(&mut c, 1, &mut Vec::new(), &mut |_| {}).map(|_| c))
            {
                Ok(c) => {
                    conns.push(c);
                    break;
                }
                Err(e) if Instant::now() > deadline => {
                    return Err(format!("connection {i}: {e}"));
                }
                Err(_) => std::thread::sleep(Duration::from_millis(50)),
            }
        }
    }
    let start = Instant::now();
    let mut workers = Vec::new();
    for (i, c) in conns.into_iter().enumerate() {
        let (tls, name, counters) = (tls.clone(), name.clone(), counters.clone());
        workers.push(std::thread::spawn(move || {
            let mut next = interval.map(|d| start + d * i as u32 / CONNECTIONS as u32);
            // A paced connection is idle between batches by design.
            let stall_us = interval.map_or(STALL_US, |d| STALL_US.max(2 * d.as_micros() as u64));
            let mut bins = vec![0u64; MAX_BINS];
            // Pauses of this connection: (start, length) in µs since
            // `start`, for pauses longer than STALL_US (bounded).
            let mut stalls: Vec<(u64, u64)> = Vec::with_capacity(MAX_STALLS);
            let mut last_us = start.elapsed().as_micros() as u64;
            let mut conn = Some(c);
            let mut buf = Vec::with_capacity(4096);
            while !STOP.load(Ordering::Relaxed) && begin.elapsed() < CLIENT_MAX {
                let Some(c) = conn.as_mut() else {
                    match connect(addr, &tls, &name) {
                        Ok(c) => {
                            counters.handshakes.fetch_add(1, Ordering::Relaxed);
                            conn = Some(c);
                        }
                        Err(_) => std::thread::sleep(Duration::from_millis(1)),
                    }
                    continue;
                };
                if let (Some(at), Some(d)) = (next.as_mut(), interval) {
                    let now = Instant::now();
                    if *at > now {
                        std::thread::sleep(*at - now);
                    }
                    *at += d;
                }
                let r = get_batch(c, PIPELINE, &mut buf, &mut |replies| {
                    let now_us = start.elapsed().as_micros() as u64;
                    let b = (now_us / 1000 / BIN_MS) as usize;
                    if b < MAX_BINS {
                        bins[b] += replies;
                    }
                    if now_us - last_us > stall_us && stalls.len() < MAX_STALLS {
                        stalls.push((last_us, now_us - last_us));
                    }
                    last_us = now_us;
                });
                match r {
                    Ok(0) => {}
                    Ok(errors) => {
                        counters.errors.fetch_add(errors, Ordering::Relaxed);
                    }
                    Err(_) => {
                        counters.reconnects.fetch_add(1, Ordering::Relaxed);
                        conn = None;
                    }
                }
            }
            (bins, stalls)
        }));
    }
    println!("ready");
    let _ = std::io::stdout().flush();

    let stdin = std::io::stdin();
    for line in stdin.lock().lines() {
        let Ok(line) = line else { break };
        match line.trim() {
            "event" => {
                let us = start.elapsed().as_micros() as u64;
                let mono = sched_trace::mono_ns();
                println!("event_bin {} {us} {mono}", us / 1000 / BIN_MS);
                let _ = std::io::stdout().flush();
            }
            "mark" => {
                println!("mark_us {}", start.elapsed().as_micros());
                let _ = std::io::stdout().flush();
            }
            "stop" => break,
            _ => {}
        }
    }
    let last = (start.elapsed().as_millis() as u64 / BIN_MS) as usize;
    STOP.store(true, Ordering::SeqCst);
    let mut total = vec![0u64; MAX_BINS];
    let mut stalls = Vec::new();
    let mut per_conn = Vec::new();
    for (i, w) in workers.into_iter().enumerate() {
        let (bins, s) = w.join().map_err(|_| "a load thread panicked")?;
        for (t, b) in total.iter_mut().zip(&bins) {
            *t += b;
        }
        let mine: Vec<String> = bins[..last.min(MAX_BINS)]
            .iter()
            .map(|b| b.to_string())
            .collect();
        per_conn.push(mine.join(","));
        stalls.extend(s.into_iter().map(|(at, len)| format!("{i}:{at}:{len}")));
    }
    total.truncate(last.min(MAX_BINS));
    let text: Vec<String> = total.iter().map(|b| b.to_string()).collect();
    println!("bins {}", text.join(","));
    println!("stalls {}", stalls.join(","));
    println!("connbins {}", per_conn.join(";"));
    println!(
        "stats reconnects={} errors={} handshakes={}",
        counters.reconnects.load(Ordering::Relaxed),
        counters.errors.load(Ordering::Relaxed),
        counters.handshakes.load(Ordering::Relaxed)
    );
    let _ = std::io::stdout().flush();
    Ok(())
}

type Conn = rustls::StreamOwned<rustls::ClientConnection, TcpStream>;

fn tls_config(cert: &Path) -> Result<rustls::ClientConfig, String> {
    use rustls_pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    for c in rustls_pki_types::CertificateDer::pem_file_iter(cert)
        .map_err(|e| format!("{}: {e}", cert.display()))?
    {
        let c = c.map_err(|e| format!("{}: {e}", cert.display()))?;
        roots
            .add(c)
            .map_err(|e| format!("{}: {e}", cert.display()))?;
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    Ok(rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots)
        .with_no_client_auth())
}

fn connect(
    addr: SocketAddr,
    tls: &Arc<rustls::ClientConfig>,
    name: &rustls_pki_types::ServerName<'static>,
) -> Result<Conn, String> {
    let tcp = TcpStream::connect_timeout(&addr, Duration::from_secs(1))
        .map_err(|e| format!("connect {addr}: {e}"))?;
    tcp.set_nodelay(true).map_err(|e| e.to_string())?;
    tcp.set_read_timeout(Some(Duration::from_secs(1)))
        .map_err(|e| e.to_string())?;
    tcp.set_write_timeout(Some(Duration::from_secs(1)))
        .map_err(|e| e.to_string())?;
    let conn = rustls::ClientConnection::new(tls.clone(), name.clone())
        .map_err(|e| format!("TLS: {e}"))?;
    let mut s = rustls::StreamOwned::new(conn, tcp);
    while s.conn.is_handshaking() {
        s.conn
            .complete_io(&mut s.sock)
            .map_err(|e| format!("TLS handshake: {e}"))?;
    }
    Ok(s)
}

/// Sends `n` pipelined GETs of a key that does not exist and reads the `n`
/// replies (`$-1\r\n`, one line each); `done(k)` is called as replies
/// complete. Returns the number of error replies.
fn get_batch(
    c: &mut Conn,
    n: usize,
    buf: &mut Vec<u8>,
    done: &mut dyn FnMut(u64),
) -> Result<u64, String> {
    const GET: &[u8] = b"*2\r\n$3\r\nGET\r\n$19\r\ncapybara:bench:none\r\n";
    let mut req = Vec::with_capacity(GET.len() * n);
    for _ in 0..n {
        req.extend_from_slice(GET);
    }
    c.write_all(&req).map_err(|e| format!("write: {e}"))?;
    let mut left = n;
    let mut errors = 0;
    let mut chunk = [0u8; 4096];
    buf.clear();
    while left > 0 {
        let k = c.read(&mut chunk).map_err(|e| format!("read: {e}"))?;
        if k == 0 {
            return Err("closed by the server".into());
        }
        buf.extend_from_slice(&chunk[..k]);
        let mut replies = 0;
        while let Some(p) = buf.iter().position(|&b| b == b'\n') {
            if buf[0] == b'-' {
                errors += 1;
            }
            buf.drain(..=p);
            replies += 1;
        }
        let replies = replies.min(left);
        left -= replies;
        if replies > 0 {
            done(replies as u64);
        }
    }
    Ok(errors)
}
