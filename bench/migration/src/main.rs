//! `make bench-migration` (issue #4): end-to-end TCPMig migration latency by
//! phase, and host CPU time per migration, over at least 10,000 migrations
//! in the namespace lab, through switchd's XDP data plane.
//!
//! The lab: the switch, two servers and a client. Each server runs the
//! hostagent (user-space stack, echo service on the VIP) with the churn
//! option: every `--churn-ms` it migrates each connection it serves to the
//! other server, so connections move back and forth; the load policies are
//! off so that the churn alone decides what migrates. The load client (this
//! binary, `client` subcommand, inside the client namespace) keeps
//! `--connections` long-lived connections busy with a steady echo load (one
//! 64-byte message per connection every `--interval-us`, each echo checked
//! byte for byte), so every migration moves a connection in use and the
//! target buffers and replays client segments that arrive meanwhile.
//!
//! Every hostagent writes the telemetry of each finished migration (phase
//! timestamps of its clock, host CPU by message) to a dump file
//! (`CAPYBARA_MIGRATION_TELEMETRY`, `hostagent/src/migration.rs`); the
//! bench joins the origin's and the target's lines of each migration, puts
//! them on one timeline (both clocks are related to CLOCK_MONOTONIC, which
//! all processes of the machine share) and prints per-phase percentiles,
//! the host CPU per migration, and a last line
//! `RESULT total_p50_us=... total_p99_us=... host_cpu_p50_us=... ...`.
//!
//! Needs root. Bounded: every wait has a limit, the migration phase stops
//! after `--max-s` seconds whatever the count, the client stops itself, and
//! the lab (namespaces, processes) is torn down on every exit path,
//! including SIGINT/SIGTERM.

use capybara_systests::bench_run::{sleep, stop_on_signals, wait_until, ClientGuard, STOP};
use capybara_systests::{
    deployment_key, hostagent_migrating_config, metric_sum, output_dir, switchd_config, Lab,
};
use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use std::time::{Duration, Instant};

const VIP: &str = "198.18.100.1";
const ECHO_PORT: u16 = 7;
const MESSAGE: usize = 64;
/// The client stops by itself after this long past `--max-s`.
const CLIENT_GRACE: Duration = Duration::from_secs(60);

struct Options {
    migrations: usize,
    connections: usize,
    churn_ms: u64,
    interval_us: u64,
    max_s: u64,
    busy: bool,
    /// `CAPYBARA_HOSTAGENT_SCHED` for the hostagents (`--sched SPEC`).
    sched: Option<String>,
    /// `[migration] reply_spin_us` of the hostagents (`--reply-spin-us N`;
    /// unset: the hostagent's default).
    reply_spin_us: Option<u64>,
    /// Pin server j's hostagent (all its threads) to CPU j-1 (`--pin`):
    /// each server's stack on a CPU of its own, as on separate machines
    /// (the peer's wake-up then never queues behind the waker).
    pin: bool,
}

fn usage() -> ! {
    eprintln!(
        "usage: bench-migration [--migrations N (10000)] [--connections N (4)] [--churn-ms N (10)] \
         [--interval-us N (1000)] [--max-s N (180)] [--busy] \
         [--sched inherit|slice=US|fifo=PRIO] [--reply-spin-us N (0-1000)] [--pin]"
    );
    std::process::exit(2)
}

fn options(args: &[String]) -> Options {
    let mut o = Options {
        migrations: 10_000,
        connections: 4,
        churn_ms: 10,
        interval_us: 1000,
        max_s: 180,
        busy: false,
        sched: None,
        reply_spin_us: None,
        pin: false,
    };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        if a == "--busy" {
            o.busy = true;
            continue;
        }
        if a == "--pin" {
            o.pin = true;
            continue;
        }
        if a == "--sched" {
            o.sched = Some(it.next().cloned().unwrap_or_else(|| usage()));
            continue;
        }
        let v: u64 = match it.next().and_then(|v| v.parse().ok()) {
            Some(v) => v,
            None => usage(),
        };
        match a.as_str() {
            "--migrations" if v >= 1 => o.migrations = v as usize,
            "--connections" if (1..=256).contains(&v) => o.connections = v as usize,
            "--churn-ms" if (1..=10_000).contains(&v) => o.churn_ms = v,
            "--interval-us" if (100..=1_000_000).contains(&v) => o.interval_us = v,
            "--max-s" if (1..=3600).contains(&v) => o.max_s = v,
            "--reply-spin-us" if v <= 1000 => o.reply_spin_us = Some(v),
            _ => usage(),
        }
    }
    o
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("client") {
        if let Err(e) = client(&args[2..]) {
            eprintln!("bench-migration client: {e}");
            std::process::exit(1);
        }
        return;
    }
    let opt = options(&args[1..]);
    stop_on_signals();
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("bench-migration: needs root (network namespaces)");
        std::process::exit(2);
    }
    let started = Instant::now();
    match run(&opt) {
        Ok(r) => {
            println!("total time {:.1} s", started.elapsed().as_secs_f64());
            println!("{}", r);
        }
        Err(e) => {
            eprintln!("bench-migration: {e}");
            std::process::exit(1);
        }
    }
}

fn run(opt: &Options) -> Result<String, String> {
    // One directory per run: several benches may share the machine.
    let dir = output_dir(&format!("bench-migration-{}", std::process::id()));
    eprintln!("bench-migration: output in {}", dir.display());
    // The hostagents inherit it: each writes DIR/telemetry-ADDR.log.
    std::env::set_var("CAPYBARA_MIGRATION_TELEMETRY", &dir);
    // No stdout line per migrated-away echo connection (the telemetry
    // dump has every migration).
    std::env::set_var("CAPYBARA_ECHO_QUIET", "1");
    // The hostagents' driver-thread scheduling (`DriverScheduling` in
    // hostagent/src/stack.rs); older hostagents ignore it.
    match &opt.sched {
        Some(s) => std::env::set_var("CAPYBARA_HOSTAGENT_SCHED", s),
        None => std::env::remove_var("CAPYBARA_HOSTAGENT_SCHED"),
    }
    let mut lab = Lab::up("bmig", 2);
    let key = deployment_key(&dir);
    let sw = switchd_config(&lab, &dir, 2, &key);
    lab.spawn_switchd(&sw, &dir.join("switchd.log"));
    let mut pids = Vec::new();
    for j in 1..=2u32 {
        // Each server hands its connections to the other one.
        let cfg = hostagent_migrating_config(&dir, j, &key, Some((opt.churn_ms, 3 - j)));
        let mut text = std::fs::read_to_string(&cfg).map_err(|e| e.to_string())?;
        if opt.busy {
            text = text.replacen(
                "[interface]\nname = \"eth0\"\n",
                "[interface]\nname = \"eth0\"\npoll = \"busy\"\n",
                1,
            );
        }
        if let Some(us) = opt.reply_spin_us {
            text = text.replacen(
                "[control]\n",
                &format!("reply_spin_us = {us}\n[control]\n"),
                1,
            );
        }
        text.push_str("[policy]\nenabled = false\n");
        std::fs::write(&cfg, text).map_err(|e| e.to_string())?;
        pids.push(lab.spawn_hostagent(j, &cfg, &dir.join(format!("hostagent-s{j}.log"))));
    }
    if opt.pin {
        for (cpu, pid) in pids.iter().enumerate() {
            capybara_systests::bench_run::pin_process(*pid, cpu)?;
        }
    }
    wait_until(
        "both servers to register with switchd",
        Duration::from_secs(30),
        || {
            let log = std::fs::read_to_string(dir.join("switchd.log")).unwrap_or_default();
            log.contains("registered s1") && log.contains("registered s2")
        },
    )?;
    wait_until("the VIP to answer", Duration::from_secs(30), || {
        lab.run(
            "c1",
            "curl",
            &[
                "-s",
                "-m",
                "1",
                "-o",
                "/dev/null",
                &format!("http://{VIP}/"),
            ],
            Duration::from_secs(5),
        )
        .status
        .success()
    })?;

    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let child = lab
        .command("c1", &exe)
        .args([
            "client",
            &format!("{VIP}:{ECHO_PORT}"),
            &opt.connections.to_string(),
            &opt.interval_us.to_string(),
            &(opt.max_s + CLIENT_GRACE.as_secs()).to_string(),
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

    // Migrate until enough have completed (counted on the origins' dumps).
    let phase_start = Instant::now();
    let cpu_start = process_cpu_s(&pids);
    let limit = Duration::from_secs(opt.max_s);
    let mut last_print = Instant::now();
    let mut ping: Option<Samples> = None;
    loop {
        sleep(Duration::from_millis(500))?;
        let done = count_migrated_out(&dir);
        if ping.is_none() && phase_start.elapsed() >= Duration::from_secs(2) {
            ping = Some(kernel_ping(&lab));
        }
        if last_print.elapsed() >= Duration::from_secs(5) {
            eprintln!(
                "bench-migration: {done} migrations completed after {:.0} s",
                phase_start.elapsed().as_secs_f64()
            );
            last_print = Instant::now();
        }
        // A margin for migrations whose target line is not written yet.
        if done >= opt.migrations + opt.migrations / 50 + 50 {
            break;
        }
        if phase_start.elapsed() > limit {
            eprintln!("bench-migration: time limit reached with {done} migrations");
            break;
        }
        if let Ok(l) = from_client.try_recv() {
            return Err(format!("the load client stopped early: {l}"));
        }
    }
    let migrate_secs = phase_start.elapsed().as_secs_f64();
    // The hostagents' CPU time over the migration phase (user + system,
    // both servers), in ms per second of run.
    let cpu_ms_per_s = (process_cpu_s(&pids) - cpu_start) * 1e3 / migrate_secs;
    send(&mut to_client, "stop")?;
    let stats = expect(&from_client, "stats", Duration::from_secs(15))?;
    let stat = |name: &str| -> u64 {
        stats
            .split_whitespace()
            .find_map(|kv| kv.strip_prefix(&format!("{name}=")))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    let scraped: Vec<String> = (1..=2).map(|j| lab.server_metrics(j)).collect();
    let resets: f64 = scraped
        .iter()
        .filter_map(|t| metric_sum(t, "capybara_tcp_resets_sent_total", ""))
        .sum();
    let metrics = tcp_counters(&scraped);
    let wake = wake_report(&scraped);
    // Two flushes of the dumps (100 ms each) write the last lines.
    sleep(Duration::from_millis(400))?;
    let hosts: Vec<Host> = (1..=2)
        .map(|j| Host::load(&dir.join(format!("telemetry-198.18.2.{}.log", 10 + j))))
        .collect::<Result<_, _>>()?;
    let report = analyze(&hosts, opt.migrations)?;
    report.print();
    println!(
        "client segments dropped silently by the servers' migration glue: {} for a frozen flow, {} for a gone flow",
        hosts.iter().map(|h| h.dropped.0).sum::<u64>(),
        hosts.iter().map(|h| h.dropped.1).sum::<u64>()
    );
    let ping = ping.unwrap_or_default();
    println!(
        "baseline under the same load: kernel ping s1 -> switch -> s1 (two veth crossings and an XDP pass, \
         like one TCPMig hop) RTT p50 {:.0} us, p99 {:.0} us ({} replies)",
        ping.p(50.0),
        ping.p(99.0),
        ping.0.len()
    );
    println!("{}", wake.text);
    println!(
        "load: {} connections, {} echoes checked ({} errors, max echo RTT {} us, p99 {} us); \
         resets sent by the servers {resets}; migrations started {:.0}/s; \
         timing is noisy: 2 shared cores, other jobs running",
        opt.connections,
        stat("echoes"),
        stat("errors"),
        stat("max_rtt_us"),
        stat("p99_rtt_us"),
        report.completed as f64 / migrate_secs,
    );
    let noted: Vec<String> = metrics
        .iter()
        .filter(|(k, v)| {
            **v > 0
                && (k.starts_with("capybara_tcp_segment_drops_total")
                    || k.starts_with("capybara_tcp_retransmits_total"))
        })
        .map(|(k, v)| format!("{k} {v}"))
        .collect();
    println!(
        "servers' TCP drops and retransmissions over the run (both servers): {}",
        if noted.is_empty() {
            "none".to_string()
        } else {
            noted.join(", ")
        }
    );
    if stat("errors") > 0 {
        return Err(format!("the load client saw errors: {stats}"));
    }
    Ok(format!(
        "RESULT total_p50_us={:.1} total_p99_us={:.1} host_cpu_p50_us={:.2} host_cpu_p99_us={:.2} \
         migrations={} resumed={} origin_cpu_p50_us={:.2} target_cpu_p50_us={:.2} connections={} churn_ms={} \
         client_errors={} resets={resets} busy_poll={} sched={} wake_delay_p50_us={} reply_spin_us={} pin={} \
         hostagent_cpu_ms_per_s={cpu_ms_per_s:.0} spin_ms_per_s={:.0} goal_total_p50_us=15 goal_host_cpu_p50_us=3",
        report.total.p(50.0),
        report.total.p(99.0),
        report.cpu.p(50.0),
        report.cpu.p(99.0),
        report.completed,
        report.resumed,
        report.cpu_origin.p(50.0),
        report.cpu_target.p(50.0),
        opt.connections,
        opt.churn_ms,
        stat("errors"),
        u8::from(opt.busy),
        opt.sched.as_deref().unwrap_or("inherit"),
        wake.p50_us,
        opt.reply_spin_us
            .map_or("default".to_string(), |v| v.to_string()),
        u8::from(opt.pin),
        wake.spin_s * 1e3 / migrate_secs,
    ))
}

/// User + system CPU seconds of these processes so far (`/proc/PID/stat`;
/// a process that is gone counts 0).
fn process_cpu_s(pids: &[u32]) -> f64 {
    // SAFETY: sysconf has no memory arguments.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    pids.iter()
        .filter_map(|p| std::fs::read_to_string(format!("/proc/{p}/stat")).ok())
        .filter_map(|stat| {
            // Fields after the command name (which may hold spaces): state
            // is the 3rd field, utime and stime the 14th and 15th.
            let rest = &stat[stat.rfind(')')? + 2..];
            let f: Vec<&str> = rest.split_whitespace().collect();
            let ticks = f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?;
            Some(ticks / hz)
        })
        .sum()
}

/// Completed migrations written so far by both origins.
fn count_migrated_out(dir: &Path) -> usize {
    (1..=2)
        .map(|j| {
            std::fs::read_to_string(dir.join(format!("telemetry-198.18.2.{}.log", 10 + j)))
                .unwrap_or_default()
                .matches("outcome=MigratedOut")
                .count()
        })
        .sum()
}

/// Round-trip times (us) of 200 kernel pings from server 1's management
/// address to the switch, sorted.
fn kernel_ping(lab: &Lab) -> Samples {
    let out = lab.run(
        "s1",
        "ping",
        &["-n", "-c", "200", "-i", "0.005", "-W", "1", "198.18.1.1"],
        Duration::from_secs(10),
    );
    let mut s = Samples::default();
    for l in String::from_utf8_lossy(&out.stdout).lines() {
        if let Some(ms) = l
            .split_whitespace()
            .find_map(|w| w.strip_prefix("time="))
            .and_then(|v| v.parse::<f64>().ok())
        {
            s.push(ms * 1000.0);
        }
    }
    s.sort();
    s
}

/// The hostagents' wake-up debug counters (`WakeStats` in
/// `hostagent/src/stack.rs`), from their metrics pages: one line per
/// server and the mean of the servers' wake-delay p50 (`-` for hostagents
/// that do not report it, e.g. older binaries in an A/B run).
struct WakeReport {
    text: String,
    p50_us: String,
    /// Both servers' reply spins (`capybara_driver_spin_seconds_total`).
    spin_s: f64,
}

fn wake_report(pages: &[String]) -> WakeReport {
    let us = |page: &str, name: &str, q: &str| {
        metric_sum(page, name, &format!("quantile=\"{q}\"")).map(|s| s * 1e6)
    };
    let fmt = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.1}"));
    let mut text = String::from(
        "hostagent wake-ups (kernel queued the frame -> driver handled it, us; whole run):",
    );
    let mut p50s = Vec::new();
    for (j, page) in pages.iter().enumerate() {
        // A counter's total over the label sets that contain `label`.
        let count = |name: &str, label: &str| {
            metric_sum(page, name, label).map_or("-".to_string(), |v| format!("{v:.0}"))
        };
        let wakes = |reason: &str| {
            count(
                "capybara_driver_wakeups_total",
                &format!("reason=\"{reason}\""),
            )
        };
        let spins = |outcome: &str| {
            count(
                "capybara_driver_spins_total",
                &format!("outcome=\"{outcome}\""),
            )
        };
        let wake = "capybara_driver_wake_delay_seconds";
        let ring = "capybara_rx_ring_delay_seconds";
        if let Some(p) = us(page, wake, "0.5") {
            p50s.push(p);
        }
        text.push_str(&format!(
            "\n  s{}: after a device wake-up p50 {} p90 {} p99 {} ({} wake-ups: {} device, {} timer, {} kick); \
             every receive batch p50 {} p99 {}; poll start -> transmit batch handed over p50 {} p99 {}, \
             of which the kick (sendto) p50 {} p99 {}; reply spins {} reply, {} other, {} expired, {} skipped, {} s",
            j + 1,
            fmt(us(page, wake, "0.5")),
            fmt(us(page, wake, "0.9")),
            fmt(us(page, wake, "0.99")),
            count("capybara_driver_wakeups_total", ""),
            wakes("device"),
            wakes("timer"),
            wakes("kick"),
            fmt(us(page, ring, "0.5")),
            fmt(us(page, ring, "0.99")),
            fmt(us(page, "capybara_driver_poll_to_tx_seconds", "0.5")),
            fmt(us(page, "capybara_driver_poll_to_tx_seconds", "0.99")),
            fmt(us(page, "capybara_tx_kick_seconds", "0.5")),
            fmt(us(page, "capybara_tx_kick_seconds", "0.99")),
            spins("reply"),
            spins("other"),
            spins("expired"),
            spins("skipped"),
            metric_sum(page, "capybara_driver_spin_seconds_total", "")
                .map_or("-".to_string(), |v| format!("{v:.3}")),
        ));
    }
    let p50_us = if p50s.is_empty() {
        "-".to_string()
    } else {
        format!("{:.1}", p50s.iter().sum::<f64>() / p50s.len() as f64)
    };
    let spin_s = pages
        .iter()
        .filter_map(|p| metric_sum(p, "capybara_driver_spin_seconds_total", ""))
        .sum();
    WakeReport {
        text,
        p50_us,
        spin_s,
    }
}

/// The servers' TCP counters (`capybara_tcp_*`) in their metrics pages
/// (`Lab::server_metrics`), summed over the servers, keyed by name and
/// labels other than `server`.
fn tcp_counters(pages: &[String]) -> std::collections::BTreeMap<String, u64> {
    let mut sums = std::collections::BTreeMap::new();
    for page in pages {
        for l in page.lines() {
            if !l.starts_with("capybara_tcp_") {
                continue;
            }
            let Some((name, value)) = l.rsplit_once(' ') else {
                continue;
            };
            let Ok(v) = value.parse::<u64>() else {
                continue;
            };
            // `name{server="s1",reason="x"}` -> `name{reason="x"}`.
            let key = match name.split_once('{') {
                Some((n, labels)) => {
                    let rest: Vec<&str> = labels
                        .trim_end_matches('}')
                        .split(',')
                        .filter(|l| !l.starts_with("server="))
                        .collect();
                    if rest.is_empty() {
                        n.to_string()
                    } else {
                        format!("{n}{{{}}}", rest.join(","))
                    }
                }
                None => name.to_string(),
            };
            *sums.entry(key).or_insert(0) += v;
        }
    }
    sums
}

// ---- the dump files ----

/// One `mig` line: its key=value pairs.
struct Line(HashMap<String, String>);

impl Line {
    fn get(&self, k: &str) -> Option<&str> {
        self.0.get(k).map(String::as_str)
    }
    /// A timestamp (microseconds of the host's clock), None if not reached.
    fn t(&self, k: &str) -> Option<i64> {
        self.get(k)?.parse().ok()
    }
    fn n(&self, k: &str) -> u64 {
        self.get(k).and_then(|v| v.parse().ok()).unwrap_or(0)
    }
    fn list(&self, k: &str) -> [u64; 5] {
        let mut out = [0u64; 5];
        for (o, v) in out.iter_mut().zip(self.get(k).unwrap_or("").split(',')) {
            *o = v.parse().unwrap_or(0);
        }
        out
    }
    fn cpu_ns(&self) -> u64 {
        self.n("cpu_start_ns")
            + self.list("cpu_rx_ns").iter().sum::<u64>()
            + self.list("cpu_tx_ns").iter().sum::<u64>()
    }
}

/// One host's dump: its clock offset to CLOCK_MONOTONIC and its lines by
/// migration id.
struct Host {
    /// mono_us - local_us, the smallest sample (each sample is late by the
    /// time between the driver reading its clock and the flush).
    offset_us: i64,
    out: HashMap<String, Line>,
    inn: HashMap<String, Line>,
    resumed: usize,
    /// The glue's silent drops of client segments (frozen flow, gone flow).
    dropped: (u64, u64),
}

impl Host {
    fn load(path: &Path) -> Result<Host, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("telemetry dump {}: {e}", path.display()))?;
        let mut h = Host {
            offset_us: i64::MAX,
            out: HashMap::new(),
            inn: HashMap::new(),
            resumed: 0,
            dropped: (0, 0),
        };
        for l in text.lines() {
            let mut words = l.split_whitespace();
            let kind = words.next();
            let kv: HashMap<String, String> = words
                .filter_map(|w| w.split_once('='))
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            let line = Line(kv);
            match kind {
                Some("clock") => {
                    if let (Some(l), Some(m)) = (line.t("local_us"), line.t("mono_us")) {
                        h.offset_us = h.offset_us.min(m - l);
                    }
                    h.dropped = (line.n("dropped_frozen"), line.n("dropped_gone"));
                }
                Some("mig") => {
                    let Some(id) = line.get("id").map(str::to_string) else {
                        continue;
                    };
                    match line.get("outcome") {
                        Some("MigratedOut") => {
                            h.out.insert(id, line);
                        }
                        Some("MigratedIn") => {
                            h.inn.insert(id, line);
                        }
                        Some(o) if o.starts_with("Resumed") => h.resumed += 1,
                        _ => {}
                    }
                }
                _ => {}
            }
        }
        if h.offset_us == i64::MAX {
            return Err(format!("{}: no clock line", path.display()));
        }
        Ok(h)
    }
}

// ---- statistics ----

#[derive(Default)]
struct Samples(Vec<f64>);

impl Samples {
    fn push(&mut self, v: f64) {
        self.0.push(v);
    }
    fn sort(&mut self) {
        self.0.sort_by(|a, b| a.total_cmp(b));
    }
    /// Nearest-rank percentile of sorted samples.
    fn p(&self, q: f64) -> f64 {
        if self.0.is_empty() {
            return f64::NAN;
        }
        let rank = ((q / 100.0) * self.0.len() as f64).ceil() as usize;
        self.0[rank.clamp(1, self.0.len()) - 1]
    }
    fn mean(&self) -> f64 {
        self.0.iter().sum::<f64>() / self.0.len().max(1) as f64
    }
}

/// The phases, in order; they add up to `total` (PREPARE sent to
/// CONN_STATE_ACK received, both on the origin's clock).
const PHASES: [(&str, &str); 7] = [
    ("prepare", "PREPARE: origin -> switch -> target"),
    (
        "prepare_ack",
        "target admits, PREPARE_ACK -> switch (entry pending) -> origin",
    ),
    ("export", "origin freezes + snapshots the connection"),
    (
        "state_send",
        "origin encodes + sends the CONN_STATE fragments",
    ),
    (
        "state_transfer",
        "last CONN_STATE fragment -> target, reassembled",
    ),
    ("import", "target imports + replays buffered segments"),
    (
        "state_ack",
        "CONN_STATE_ACK -> switch (entry final) -> origin",
    ),
];

/// Host CPU steps: (name, side, rx?, slot).
const CPU_STEPS: [(&str, bool, bool, usize); 9] = [
    ("origin migrate_out", true, false, usize::MAX),
    ("origin PREPARE encode", true, false, 0),
    ("target PREPARE admit", false, true, 0),
    ("target PREPARE_ACK encode", false, false, 1),
    ("origin PREPARE_ACK + export", true, true, 1),
    ("origin CONN_STATE encode", true, false, 2),
    ("target CONN_STATE + import/replay", false, true, 2),
    ("target CONN_STATE_ACK encode", false, false, 3),
    ("origin CONN_STATE_ACK + release", true, true, 3),
];

struct Report {
    completed: usize,
    resumed: usize,
    queue: Samples,
    total: Samples,
    phases: Vec<Samples>,
    cpu: Samples,
    cpu_origin: Samples,
    cpu_target: Samples,
    cpu_steps: Vec<Samples>,
    snapshot_bytes: Samples,
    fragments: Samples,
    buffered: Samples,
    buffer_drops: u64,
    retransmissions: u64,
    offsets: Vec<i64>,
}

fn analyze(hosts: &[Host], wanted: usize) -> Result<Report, String> {
    let mut r = Report {
        completed: 0,
        resumed: hosts.iter().map(|h| h.resumed).sum(),
        queue: Samples::default(),
        total: Samples::default(),
        phases: PHASES.iter().map(|_| Samples::default()).collect(),
        cpu: Samples::default(),
        cpu_origin: Samples::default(),
        cpu_target: Samples::default(),
        cpu_steps: CPU_STEPS.iter().map(|_| Samples::default()).collect(),
        snapshot_bytes: Samples::default(),
        fragments: Samples::default(),
        buffered: Samples::default(),
        buffer_drops: 0,
        retransmissions: 0,
        offsets: hosts.iter().map(|h| h.offset_us).collect(),
    };
    for (oi, origin) in hosts.iter().enumerate() {
        let target = &hosts[1 - oi];
        let (oo, ot) = (origin.offset_us, target.offset_us);
        for (id, o) in &origin.out {
            let Some(t) = target.inn.get(id) else {
                continue;
            };
            let (Some(st), Some(ps), Some(par), Some(ed), Some(ss), Some(sar)) = (
                o.t("started"),
                o.t("prepare_sent"),
                o.t("prepare_ack_received"),
                o.t("export_done"),
                o.t("state_sent"),
                o.t("state_ack_received"),
            ) else {
                continue;
            };
            let (Some(pr), Some(sr), Some(idn)) = (
                t.t("prepare_received"),
                t.t("state_received"),
                t.t("import_done"),
            ) else {
                continue;
            };
            // One timeline: CLOCK_MONOTONIC microseconds.
            let (ps_m, par_m, ss_m, sar_m) = (ps + oo, par + oo, ss + oo, sar + oo);
            let (pr_m, sr_m, id_m) = (pr + ot, sr + ot, idn + ot);
            let phases = [
                pr_m - ps_m,
                par_m - pr_m,
                ed - par,
                ss - ed,
                sr_m - ss_m,
                idn - sr,
                sar_m - id_m,
            ];
            for (s, v) in r.phases.iter_mut().zip(phases) {
                s.push(v as f64);
            }
            r.queue.push((ps - st) as f64);
            r.total.push((sar - ps) as f64);
            let (co, ct) = (o.cpu_ns(), t.cpu_ns());
            r.cpu.push((co + ct) as f64 / 1000.0);
            r.cpu_origin.push(co as f64 / 1000.0);
            r.cpu_target.push(ct as f64 / 1000.0);
            for (s, &(_, on_origin, rx, slot)) in r.cpu_steps.iter_mut().zip(CPU_STEPS.iter()) {
                let l = if on_origin { o } else { t };
                let ns = if slot == usize::MAX {
                    l.n("cpu_start_ns")
                } else if rx {
                    l.list("cpu_rx_ns")[slot]
                } else {
                    l.list("cpu_tx_ns")[slot]
                };
                s.push(ns as f64 / 1000.0);
            }
            r.snapshot_bytes.push(o.n("snapshot_bytes") as f64);
            r.fragments.push(o.n("fragments") as f64);
            r.buffered.push(t.n("segments_buffered") as f64);
            r.retransmissions += o.n("retransmissions");
            r.buffer_drops += t.n("segments_dropped");
            r.completed += 1;
        }
    }
    if r.completed == 0 {
        return Err("no completed migration found in the dumps".into());
    }
    for s in [
        &mut r.queue,
        &mut r.total,
        &mut r.cpu,
        &mut r.cpu_origin,
        &mut r.cpu_target,
        &mut r.snapshot_bytes,
        &mut r.fragments,
        &mut r.buffered,
    ] {
        s.sort();
    }
    for s in r.phases.iter_mut().chain(r.cpu_steps.iter_mut()) {
        s.sort();
    }
    if r.completed < wanted {
        eprintln!(
            "bench-migration: only {} completed migrations joined (wanted {wanted})",
            r.completed
        );
    }
    Ok(r)
}

impl Report {
    fn print(&self) {
        let row = |name: &str, s: &Samples, what: &str| {
            println!(
                "{name:<34} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>9.1}  {what}",
                s.p(50.0),
                s.p(90.0),
                s.p(99.0),
                s.0.last().copied().unwrap_or(f64::NAN),
                s.mean(),
            );
        };
        println!(
            "{} migrations completed (origin and target telemetry joined), {} resumed at the origin",
            self.completed, self.resumed
        );
        println!(
            "clock offsets to CLOCK_MONOTONIC (us): {:?}; cross-host phases carry up to a few us of offset error, \
             their sum does not",
            self.offsets
        );
        println!(
            "\n{:<34} {:>9} {:>9} {:>9} {:>9} {:>9}",
            "latency (us)", "p50", "p90", "p99", "max", "mean"
        );
        row(
            "(queued: migrate_out -> PREPARE)",
            &self.queue,
            "not in total",
        );
        for ((name, what), s) in PHASES.iter().zip(&self.phases) {
            row(name, s, what);
        }
        row(
            "total",
            &self.total,
            "PREPARE sent -> CONN_STATE_ACK at origin",
        );
        println!(
            "\n{:<34} {:>9} {:>9} {:>9} {:>9} {:>9}",
            "host CPU (us)", "p50", "p90", "p99", "max", "mean"
        );
        for ((name, ..), s) in CPU_STEPS.iter().zip(&self.cpu_steps) {
            row(name, s, "");
        }
        row("origin total", &self.cpu_origin, "");
        row("target total", &self.cpu_target, "");
        row("host CPU per migration", &self.cpu, "origin + target");
        println!(
            "\nsnapshot bytes p50 {:.0} (max {:.0}), fragments p50 {:.0}, segments buffered at the target mean {:.2} \
             (dropped {}), CONN_STATE/PREPARE retransmissions {}",
            self.snapshot_bytes.p(50.0),
            self.snapshot_bytes.0.last().copied().unwrap_or(0.0),
            self.fragments.p(50.0),
            self.buffered.mean(),
            self.buffer_drops,
            self.retransmissions
        );
    }
}

// ---- plumbing with the load client ----

use capybara_systests::{send_line as send, stdout_lines as lines};

fn expect(rx: &Receiver<String>, prefix: &str, limit: Duration) -> Result<String, String> {
    capybara_systests::expect_line(rx, prefix, limit, &STOP)
}

// ---- the load client (inside the client namespace) ----

/// `client ADDR CONNECTIONS INTERVAL_US MAX_S`: opens the connections, says
/// `ready`, then each connection sends a 64-byte message every INTERVAL_US
/// and checks its echo byte for byte, until `stop` on stdin or MAX_S; prints
/// `stats echoes=N errors=N max_rtt_us=N p99_rtt_us=N`.
fn client(args: &[String]) -> Result<(), String> {
    let [addr, conns, interval, max_s] = args else {
        return Err("usage: client ADDR CONNECTIONS INTERVAL_US MAX_S".into());
    };
    let conns: usize = conns.parse().map_err(|_| "bad CONNECTIONS")?;
    let interval = Duration::from_micros(interval.parse().map_err(|_| "bad INTERVAL_US")?);
    let max = Duration::from_secs(max_s.parse().map_err(|_| "bad MAX_S")?);
    let stop = Arc::new(AtomicBool::new(false));
    let errors = Arc::new(AtomicU64::new(0));
    let mut streams = Vec::with_capacity(conns);
    for _ in 0..conns {
        let s = TcpStream::connect(addr.as_str()).map_err(|e| format!("connect {addr}: {e}"))?;
        s.set_nodelay(true).map_err(|e| e.to_string())?;
        s.set_read_timeout(Some(Duration::from_secs(5)))
            .map_err(|e| e.to_string())?;
        streams.push(s);
    }
    let mut workers = Vec::with_capacity(conns);
    for (c, mut s) in streams.into_iter().enumerate() {
        let (stop, errors) = (stop.clone(), errors.clone());
        workers.push(std::thread::spawn(move || {
            let mut rtts = Vec::with_capacity(1 << 16);
            let mut msg = [0u8; MESSAGE];
            let mut back = [0u8; MESSAGE];
            let mut seq = 0u64;
            let mut next = Instant::now();
            while !stop.load(Ordering::Relaxed) {
                for (i, b) in msg.iter_mut().enumerate() {
                    *b = (seq as usize * 31 + c * 7 + i) as u8;
                }
                let t0 = Instant::now();
                let ok = s.write_all(&msg).is_ok() && s.read_exact(&mut back).is_ok();
                if !ok || back != msg {
                    errors.fetch_add(1, Ordering::Relaxed);
                    eprintln!("connection {c}: echo {seq} failed or differs");
                    break;
                }
                if rtts.len() < 1 << 22 {
                    rtts.push(t0.elapsed().as_micros() as u64);
                }
                seq += 1;
                next += interval;
                let now = Instant::now();
                if next > now {
                    std::thread::sleep(next - now);
                } else {
                    next = now;
                }
            }
            rtts
        }));
    }
    println!("ready");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut l = String::new();
        let _ = std::io::stdin().read_line(&mut l);
        let _ = tx.send(());
    });
    let _ = rx.recv_timeout(max);
    stop.store(true, Ordering::Relaxed);
    let mut rtts: Vec<u64> = Vec::new();
    for w in workers {
        rtts.extend(w.join().map_err(|_| "a connection thread panicked")?);
    }
    rtts.sort_unstable();
    let p99 = rtts
        .get((rtts.len() * 99 / 100).min(rtts.len().saturating_sub(1)))
        .copied()
        .unwrap_or(0);
    println!(
        "stats echoes={} errors={} max_rtt_us={} p99_rtt_us={p99}",
        rtts.len(),
        errors.load(Ordering::Relaxed),
        rtts.last().copied().unwrap_or(0)
    );
    Ok(())
}
