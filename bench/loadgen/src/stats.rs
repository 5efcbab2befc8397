//! Latency recording (HDR histograms), per-interval timelines, error
//! counters, and the report (human summary, JSON, RESULT line).

use std::collections::BTreeMap;

use hdrhistogram::Histogram;
use serde::Serialize;

/// Error kinds counted by the load generator.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorKind {
    /// A connection could not be established (refused, unreachable, timed out).
    Connect,
    /// The connection was reset (ECONNRESET, EPIPE) with requests outstanding.
    Reset,
    /// The server closed the connection with requests outstanding.
    Closed,
    /// No response within --timeout (late, or never).
    Timeout,
    /// Unparseable response, wrong framing or wrong body length.
    BadResponse,
    /// Well-formed response with an unexpected status.
    BadStatus,
    /// Not sent: the long connection already had --max-outstanding requests.
    Overflow,
    /// Not sent: the long connection was down (reconnecting).
    ConnDown,
    /// Not started: --max-short-inflight short connections already open.
    ShortOverflow,
}

pub const ERROR_KINDS: [ErrorKind; 9] = [
    ErrorKind::Connect,
    ErrorKind::Reset,
    ErrorKind::Closed,
    ErrorKind::Timeout,
    ErrorKind::BadResponse,
    ErrorKind::BadStatus,
    ErrorKind::Overflow,
    ErrorKind::ConnDown,
    ErrorKind::ShortOverflow,
];

impl ErrorKind {
    pub fn name(self) -> &'static str {
        match self {
            ErrorKind::Connect => "connect",
            ErrorKind::Reset => "reset",
            ErrorKind::Closed => "closed",
            ErrorKind::Timeout => "timeout",
            ErrorKind::BadResponse => "bad_response",
            ErrorKind::BadStatus => "bad_status",
            ErrorKind::Overflow => "overflow",
            ErrorKind::ConnDown => "conn_down",
            ErrorKind::ShortOverflow => "short_overflow",
        }
    }
}

/// Flow class of a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flow {
    Long,
    Short,
}

const HIST_MAX_NS: u64 = 3_600_000_000_000;

fn new_hist() -> Histogram<u64> {
    Histogram::new_with_bounds(1, HIST_MAX_NS, 3).expect("static histogram bounds")
}

/// One row of the timeline (by completion time, or send time for `sent`).
#[derive(Clone, Debug, Serialize, Default)]
pub struct IntervalRow {
    /// Start of the interval, ms from the start of the run.
    pub t_ms: f64,
    /// Requests scheduled in this interval.
    pub sent: u64,
    /// Valid responses completed in this interval.
    pub completed: u64,
    pub errors: u64,
    pub p50_us: f64,
    pub p99_us: f64,
    pub max_us: f64,
    /// Completed responses per server (same order as `Timeline::servers`).
    pub per_server: Vec<u64>,
}

/// The recorder every task reports to (single-threaded).
pub struct Recorder {
    t0_ns: u64,
    interval_ns: u64,
    pub all: Histogram<u64>,
    pub long: Histogram<u64>,
    pub short: Histogram<u64>,
    cur: Histogram<u64>,
    cur_idx: u64,
    cur_completed: u64,
    cur_per_server: Vec<u64>,
    rows: Vec<IntervalRow>,
    sent_per_interval: Vec<u64>,
    errors_per_interval: Vec<u64>,
    pub servers: Vec<String>,
    pub per_server_total: Vec<u64>,
    pub errors: [u64; ERROR_KINDS.len()],
    pub completed: u64,
    pub completed_long: u64,
    pub completed_short: u64,
    pub sent: u64,
    pub validated: u64,
    pub short_conns_opened: u64,
    pub first_error: Option<String>,
}

impl Recorder {
    pub fn new(t0_ns: u64, interval_ns: u64, expected_rows: usize) -> Recorder {
        Recorder {
            t0_ns,
            interval_ns,
            all: new_hist(),
            long: new_hist(),
            short: new_hist(),
            cur: new_hist(),
            cur_idx: 0,
            cur_completed: 0,
            cur_per_server: Vec::new(),
            rows: Vec::with_capacity(expected_rows + 16),
            sent_per_interval: vec![0; expected_rows + 1],
            errors_per_interval: vec![0; expected_rows + 1],
            servers: Vec::new(),
            per_server_total: Vec::new(),
            errors: [0; ERROR_KINDS.len()],
            completed: 0,
            completed_long: 0,
            completed_short: 0,
            sent: 0,
            validated: 0,
            short_conns_opened: 0,
            first_error: None,
        }
    }

    pub fn t0_ns(&self) -> u64 {
        self.t0_ns
    }

    fn idx(&self, t_ns: u64) -> usize {
        (t_ns.saturating_sub(self.t0_ns) / self.interval_ns) as usize
    }

    /// Map a server id to a small index (allocates once per new server).
    pub fn intern(&mut self, id: &[u8]) -> u16 {
        if let Some(i) = self.servers.iter().position(|s| s.as_bytes() == id) {
            return i as u16;
        }
        if self.servers.len() >= 1024 {
            return 1023; // absurd number of servers: lump the rest together
        }
        self.servers.push(String::from_utf8_lossy(id).into_owned());
        self.per_server_total.push(0);
        (self.servers.len() - 1) as u16
    }

    pub fn on_sent(&mut self, sched_ns: u64) {
        self.sent += 1;
        let i = self.idx(sched_ns);
        if i >= self.sent_per_interval.len() {
            self.sent_per_interval.resize(i + 1, 0);
        }
        self.sent_per_interval[i] += 1;
    }

    pub fn on_error(&mut self, kind: ErrorKind, at_ns: u64, detail: impl FnOnce() -> String) {
        self.errors[ERROR_KINDS.iter().position(|k| *k == kind).unwrap_or(0)] += 1;
        let i = self.idx(at_ns);
        if i >= self.errors_per_interval.len() {
            self.errors_per_interval.resize(i + 1, 0);
        }
        self.errors_per_interval[i] += 1;
        if self.first_error.is_none() {
            self.first_error = Some(format!("{}: {}", kind.name(), detail()));
        }
    }

    /// A validated response that completed at `now_ns`.
    pub fn on_response(&mut self, flow: Flow, sched_ns: u64, now_ns: u64, server: Option<u16>) {
        let lat = now_ns.saturating_sub(sched_ns).max(1);
        let i = self.idx(now_ns) as u64;
        if i != self.cur_idx {
            self.roll_to(i);
        }
        self.all.saturating_record(lat);
        match flow {
            Flow::Long => {
                self.long.saturating_record(lat);
                self.completed_long += 1;
            }
            Flow::Short => {
                self.short.saturating_record(lat);
                self.completed_short += 1;
            }
        }
        self.cur.saturating_record(lat);
        self.cur_completed += 1;
        self.completed += 1;
        self.validated += 1;
        if let Some(s) = server {
            let s = s as usize;
            if s >= self.cur_per_server.len() {
                self.cur_per_server.resize(self.servers.len().max(s + 1), 0);
            }
            self.cur_per_server[s] += 1;
            if s < self.per_server_total.len() {
                self.per_server_total[s] += 1;
            }
        }
    }

    fn roll_to(&mut self, idx: u64) {
        while self.cur_idx < idx {
            let mut row = IntervalRow {
                t_ms: self.cur_idx as f64 * self.interval_ns as f64 / 1e6,
                completed: self.cur_completed,
                ..Default::default()
            };
            if self.cur_completed > 0 {
                row.p50_us = self.cur.value_at_quantile(0.5) as f64 / 1e3;
                row.p99_us = self.cur.value_at_quantile(0.99) as f64 / 1e3;
                row.max_us = self.cur.max() as f64 / 1e3;
                self.cur.reset();
            }
            row.per_server = std::mem::take(&mut self.cur_per_server);
            self.cur_per_server = Vec::with_capacity(self.servers.len());
            self.cur_completed = 0;
            self.rows.push(row);
            self.cur_idx += 1;
        }
    }

    pub fn error_total(&self) -> u64 {
        self.errors.iter().sum()
    }

    /// Close the timeline at `end_ns` and build the timeline rows.
    pub fn finish_timeline(&mut self, end_ns: u64) -> Timeline {
        let last = self.idx(end_ns) as u64 + 1;
        self.roll_to(last.max(self.cur_idx + 1));
        let mut rows = std::mem::take(&mut self.rows);
        let n = self.servers.len();
        for (i, r) in rows.iter_mut().enumerate() {
            r.sent = self.sent_per_interval.get(i).copied().unwrap_or(0);
            r.errors = self.errors_per_interval.get(i).copied().unwrap_or(0);
            r.per_server.resize(n, 0);
        }
        Timeline {
            interval_ms: self.interval_ns as f64 / 1e6,
            servers: self.servers.clone(),
            rows,
        }
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct Timeline {
    pub interval_ms: f64,
    pub servers: Vec<String>,
    pub rows: Vec<IntervalRow>,
}

/// Summary of one latency histogram, in microseconds.
#[derive(Clone, Debug, Serialize, Default)]
pub struct LatencySummary {
    pub count: u64,
    pub mean_us: f64,
    pub min_us: f64,
    pub p50_us: f64,
    pub p90_us: f64,
    pub p99_us: f64,
    pub p999_us: f64,
    pub p9999_us: f64,
    pub max_us: f64,
    /// (quantile, latency_us) pairs for CDF plots.
    pub cdf: Vec<(f64, f64)>,
}

const CDF_QUANTILES: [f64; 17] = [
    0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.98, 0.99, 0.995, 0.999, 0.9999, 1.0,
];

pub fn summarize(h: &Histogram<u64>) -> LatencySummary {
    if h.is_empty() {
        return LatencySummary::default();
    }
    let q = |x: f64| h.value_at_quantile(x) as f64 / 1e3;
    LatencySummary {
        count: h.len(),
        mean_us: h.mean() / 1e3,
        min_us: h.min() as f64 / 1e3,
        p50_us: q(0.5),
        p90_us: q(0.9),
        p99_us: q(0.99),
        p999_us: q(0.999),
        p9999_us: q(0.9999),
        max_us: h.max() as f64 / 1e3,
        cdf: CDF_QUANTILES.iter().map(|&x| (x, q(x))).collect(),
    }
}

/// Per long connection.
#[derive(Clone, Debug, Serialize)]
pub struct ConnReport {
    pub conn: usize,
    /// Share of the long-flow base rate given to this connection.
    pub weight: f64,
    pub sent: u64,
    pub completed: u64,
    pub errors: u64,
    pub first_server: Option<String>,
    pub last_server: Option<String>,
    pub reconnects: u64,
}

/// The full report (`--json`).
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    pub config: crate::Config,
    pub duration_s: f64,
    pub offered_rps: f64,
    pub achieved_rps: f64,
    pub sent: u64,
    /// Valid responses (status and body length checked).
    pub requests: u64,
    pub validated: u64,
    pub long_requests: u64,
    pub short_requests: u64,
    pub short_conns_opened: u64,
    pub errors: u64,
    pub errors_by_kind: BTreeMap<&'static str, u64>,
    pub first_error: Option<String>,
    pub latency: BTreeMap<&'static str, LatencySummary>,
    pub per_server: BTreeMap<String, u64>,
    pub step_subset: Option<Vec<usize>>,
    pub timeline: Timeline,
    pub connections: Vec<ConnReport>,
    pub precise_timers: bool,
}

impl Report {
    pub fn result_line(&self) -> String {
        let l = |k: &str| self.latency.get(k).cloned().unwrap_or_default();
        format!(
            "RESULT requests={} errors={} p50_us={:.1} p99_us={:.1} p999_us={:.1} short_p99_us={:.1} long_p99_us={:.1} achieved_rps={:.1}",
            self.requests,
            self.errors,
            l("all").p50_us,
            l("all").p99_us,
            l("all").p999_us,
            l("short").p99_us,
            l("long").p99_us,
            self.achieved_rps
        )
    }

    pub fn human(&self) -> String {
        let mut s = String::new();
        let c = &self.config;
        s += &format!(
            "capybara-loadgen: target {} for {:.3}s, offered {:.0} rps ({} long conns, dist {:?}, short flows {:.0} rps)\n",
            c.target, self.duration_s, self.offered_rps, c.conns, c.dist, c.short_rate
        );
        s += &format!(
            "  sent {}  valid responses {}  achieved {:.0} rps  short conns {}\n",
            self.sent, self.requests, self.achieved_rps, self.short_conns_opened
        );
        s += &format!("  errors {}", self.errors);
        for (k, v) in &self.errors_by_kind {
            if *v > 0 {
                s += &format!("  {k}={v}");
            }
        }
        s += "\n";
        if let Some(e) = &self.first_error {
            s += &format!("  first error: {e}\n");
        }
        s += "  latency (us)      count       p50       p90       p99     p99.9       max\n";
        for k in ["all", "long", "short"] {
            if let Some(l) = self.latency.get(k) {
                s += &format!(
                    "  {:<10} {:>12} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>9.1}\n",
                    k, l.count, l.p50_us, l.p90_us, l.p99_us, l.p999_us, l.max_us
                );
            }
        }
        if !self.per_server.is_empty() {
            s += "  per server:";
            for (k, v) in &self.per_server {
                s += &format!(" {k}={v}");
            }
            s += "\n";
        }
        if !self.precise_timers {
            s += "  note: coarse (1 ms) timers in use; latencies include up to 1 ms of timer slack\n";
        }
        s
    }
}
