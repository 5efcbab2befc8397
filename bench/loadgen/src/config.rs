//! Command-line flags and the validated run configuration.

use std::net::SocketAddr;
use std::time::Duration;

use capybara_testserver::hrtime::parse_duration;
use clap::Parser;
use serde::Serialize;

/// How the long-flow rate is spread over the long-lived connections.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum Dist {
    Uniform,
    Zipf {
        alpha: f64,
    },
    /// Uniform base load plus a rising step on a subset of connections.
    Step,
}

/// Which long connections the step load lands on.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum StepSubset {
    Conns(Vec<usize>),
    /// Connections whose first response carried this server id.
    Server(String),
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct StepConfig {
    pub subset: StepSubset,
    /// First step at this offset from the start.
    pub start: Duration,
    pub interval: Duration,
    /// Requests/s added to the subset at every step.
    pub step_rps: f64,
    pub max_steps: u64,
}

/// A validated run configuration.
#[derive(Clone, Debug, Serialize)]
pub struct Config {
    pub target: SocketAddr,
    pub duration: Duration,
    /// Total offered rate, requests/s (long + short flows).
    pub rate: f64,
    pub conns: usize,
    pub dist: Dist,
    /// Zipf ranks are assigned to connections in a seeded random order
    /// (true) or rank r = connection r (false).
    pub shuffle_ranks: bool,
    pub step: Option<StepConfig>,
    /// Requests/s carried by short flows (part of `rate`).
    pub short_rate: f64,
    pub short_requests: u32,
    pub max_short_inflight: usize,
    pub max_outstanding: usize,
    pub timeout: Duration,
    pub connect_timeout: Duration,
    pub interval: Duration,
    pub path: String,
    pub host: String,
    pub expect_status: u16,
    pub expect_body: Option<usize>,
    pub server_header: String,
    pub seed: u64,
    pub precise_timers: bool,
    /// Before the run, send one unrecorded request on every long connection
    /// to learn its server (always done with a step subset by server id).
    pub probe: bool,
    pub json: Option<String>,
}

impl Config {
    /// Defaults for tests and embedding: 10 uniform connections, 1000 rps, 1 s.
    pub fn new(target: SocketAddr) -> Config {
        Config {
            target,
            duration: Duration::from_secs(1),
            rate: 1000.0,
            conns: 10,
            dist: Dist::Uniform,
            shuffle_ranks: true,
            step: None,
            short_rate: 0.0,
            short_requests: 1,
            max_short_inflight: 1000,
            max_outstanding: 1024,
            timeout: Duration::from_secs(2),
            connect_timeout: Duration::from_secs(1),
            interval: Duration::from_millis(100),
            path: "/".into(),
            host: target.to_string(),
            expect_status: 200,
            expect_body: None,
            server_header: "x-server".into(),
            seed: 1,
            precise_timers: true,
            probe: false,
            json: None,
        }
    }

    pub fn long_rate(&self) -> f64 {
        self.rate - self.short_rate
    }
}

/// Open-loop HTTP/1.1 load generator (Poisson arrivals, skewed per-connection
/// rates, short flows, HDR latency from the scheduled send time).
#[derive(Parser, Debug, Clone)]
#[command(name = "capybara-loadgen", version)]
pub struct Args {
    /// Service address, IP:PORT (the VIP in the lab).
    #[arg(long)]
    pub target: String,
    /// Length of the measured run (e.g. 10s, 500ms).
    #[arg(long, default_value = "10s")]
    pub duration: String,
    /// Total offered load in requests/s (long + short flows).
    #[arg(long, conflicts_with = "util")]
    pub rate: Option<f64>,
    /// Offered load as a fraction of --capacity (e.g. 0.6).
    #[arg(long, requires = "capacity")]
    pub util: Option<f64>,
    /// Capacity of the server pool in requests/s (e.g. 4 servers x 10000).
    #[arg(long)]
    pub capacity: Option<f64>,
    /// Number of long-lived keep-alive connections.
    #[arg(long, default_value_t = 100)]
    pub conns: usize,
    /// Per-connection rate distribution: uniform, zipf, step.
    #[arg(long, default_value = "uniform")]
    pub dist: String,
    /// Zipf exponent for --dist zipf.
    #[arg(long, default_value_t = 1.0)]
    pub zipf_alpha: f64,
    /// Assign Zipf ranks to connections in order (rank r = connection r)
    /// instead of a seeded shuffle.
    #[arg(long)]
    pub ranks_in_order: bool,
    /// Step workload: connections that receive the step load (e.g. 0-49 or 0,2,4).
    #[arg(long)]
    pub step_conns: Option<String>,
    /// Step workload: the connections whose first response came from this server id.
    #[arg(long, conflicts_with = "step_conns")]
    pub step_server: Option<String>,
    /// Step workload: time between steps.
    #[arg(long, default_value = "20ms")]
    pub step_interval: String,
    /// Step workload: time of the first step (default: one --step-interval).
    #[arg(long)]
    pub step_start: Option<String>,
    /// Step workload: requests/s added per step.
    #[arg(long, conflicts_with = "step_util")]
    pub step_rps: Option<f64>,
    /// Step workload: load added per step as a fraction of --capacity.
    #[arg(long, requires = "capacity")]
    pub step_util: Option<f64>,
    /// Step workload: stop rising after this many steps.
    #[arg(long, default_value_t = u64::MAX)]
    pub step_max: u64,
    /// Fraction of requests carried by short-lived connections (0..1).
    #[arg(long, conflicts_with = "short_conns")]
    pub short_share: Option<f64>,
    /// Number of short-lived connections opened over the run (evenly, Poisson).
    #[arg(long)]
    pub short_conns: Option<u64>,
    /// Requests per short-lived connection (sent one after another).
    #[arg(long, default_value_t = 1)]
    pub short_requests: u32,
    /// Most short connections open at once; arrivals beyond are errors.
    #[arg(long, default_value_t = 1000)]
    pub max_short_inflight: usize,
    /// Hard cap of outstanding requests per long connection; arrivals beyond are errors.
    #[arg(long, default_value_t = 1024)]
    pub max_outstanding: usize,
    /// A response later than this counts as a timeout error.
    #[arg(long, default_value = "2s")]
    pub timeout: String,
    #[arg(long, default_value = "1s")]
    pub connect_timeout: String,
    /// Timeline resolution (e.g. 10ms).
    #[arg(long, default_value = "100ms")]
    pub interval: String,
    /// Request path.
    #[arg(long, default_value = "/")]
    pub path: String,
    /// Host header (default: the target).
    #[arg(long)]
    pub host: Option<String>,
    /// Status every response must have.
    #[arg(long, default_value_t = 200)]
    pub expect_status: u16,
    /// Body length every response must have (bytes).
    #[arg(long)]
    pub expect_body: Option<usize>,
    /// Response header that names the serving server.
    #[arg(long, default_value = "x-server")]
    pub server_header: String,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Use tokio's 1 ms timer instead of microsecond timerfd timers.
    #[arg(long)]
    pub coarse_timers: bool,
    /// Before the run, send one unrecorded request per long connection to
    /// learn which server it landed on (reported as first_server).
    #[arg(long)]
    pub probe: bool,
    /// Write the full report (histograms, timelines) as JSON to this file.
    #[arg(long)]
    pub json: Option<String>,
    /// Validate the flags, print the plan, and exit.
    #[arg(long)]
    pub check: bool,
}

fn dur(flag: &str, v: &str) -> Result<Duration, String> {
    parse_duration(v).map_err(|e| format!("--{flag}: {e}"))
}

fn positive(flag: &str, v: f64) -> Result<f64, String> {
    if v.is_finite() && v > 0.0 {
        Ok(v)
    } else {
        Err(format!("invalid --{flag} {v}: must be a positive number"))
    }
}

impl Args {
    pub fn to_config(&self) -> Result<Config, String> {
        let target: SocketAddr = self
            .target
            .parse()
            .map_err(|_| format!("invalid --target {:?}: expected IP:PORT", self.target))?;
        if target.port() == 0 {
            return Err(format!("invalid --target {:?}: port 0", self.target));
        }
        let mut c = Config::new(target);
        c.duration = dur("duration", &self.duration)?;
        if c.duration.is_zero() || c.duration > Duration::from_secs(24 * 3600) {
            return Err(format!(
                "invalid --duration {:?}: must be > 0 and at most 24h",
                self.duration
            ));
        }
        let capacity = self.capacity.map(|v| positive("capacity", v)).transpose()?;
        c.rate = match (self.rate, self.util) {
            (Some(r), None) => positive("rate", r)?,
            (None, Some(u)) => {
                let u = positive("util", u)?;
                if u > 100.0 {
                    return Err(format!(
                        "invalid --util {u}: a fraction of capacity (e.g. 0.6)"
                    ));
                }
                u * capacity.unwrap_or(0.0)
            }
            (None, None) => {
                return Err("missing load: give --rate RPS or --util U --capacity RPS".into())
            }
            (Some(_), Some(_)) => return Err("give either --rate or --util, not both".into()),
        };
        if c.rate > 10_000_000.0 {
            return Err(format!("invalid rate {}: at most 10M requests/s", c.rate));
        }
        c.conns = self.conns;
        if c.conns > 100_000 {
            return Err(format!("invalid --conns {}: at most 100000", c.conns));
        }
        c.dist = match self.dist.as_str() {
            "uniform" => Dist::Uniform,
            "zipf" => {
                let a = self.zipf_alpha;
                if !a.is_finite() || !(0.0..=10.0).contains(&a) {
                    return Err(format!("invalid --zipf-alpha {a}: must be in 0..=10"));
                }
                Dist::Zipf { alpha: a }
            }
            "step" => Dist::Step,
            other => {
                return Err(format!(
                    "invalid --dist {other:?}: expected uniform, zipf or step"
                ))
            }
        };
        c.shuffle_ranks = !self.ranks_in_order;
        let step_flags = self.step_conns.is_some()
            || self.step_server.is_some()
            || self.step_rps.is_some()
            || self.step_util.is_some()
            || self.step_start.is_some();
        if c.dist == Dist::Step {
            let subset = match (&self.step_conns, &self.step_server) {
                (Some(l), None) => StepSubset::Conns(
                    crate::schedule::parse_conn_list(l, c.conns)
                        .map_err(|e| format!("--step-conns: {e}"))?,
                ),
                (None, Some(s)) if !s.is_empty() => StepSubset::Server(s.clone()),
                (None, Some(_)) => return Err("invalid --step-server \"\": empty server id".into()),
                _ => return Err("--dist step needs --step-conns LIST or --step-server ID".into()),
            };
            let step_rps = match (self.step_rps, self.step_util) {
                (Some(r), None) => positive("step-rps", r)?,
                (None, Some(u)) => positive("step-util", u)? * capacity.unwrap_or(0.0),
                _ => {
                    return Err(
                        "--dist step needs --step-rps RPS or --step-util U (with --capacity)"
                            .into(),
                    )
                }
            };
            let interval = dur("step-interval", &self.step_interval)?;
            if interval < Duration::from_micros(100) {
                return Err(format!(
                    "invalid --step-interval {:?}: at least 100us",
                    self.step_interval
                ));
            }
            let start = match &self.step_start {
                Some(s) => dur("step-start", s)?,
                None => interval,
            };
            if self.step_max == 0 {
                return Err("invalid --step-max 0: at least 1".into());
            }
            c.step = Some(StepConfig {
                subset,
                start,
                interval,
                step_rps,
                max_steps: self.step_max,
            });
        } else if step_flags {
            return Err(format!(
                "step flags (--step-*) need --dist step, not --dist {}",
                self.dist
            ));
        }
        if self.short_requests == 0 || self.short_requests > 10_000 {
            return Err(format!(
                "invalid --short-requests {}: must be 1..=10000",
                self.short_requests
            ));
        }
        c.short_requests = self.short_requests;
        c.short_rate = match (self.short_share, self.short_conns) {
            (Some(s), None) => {
                if !s.is_finite() || !(0.0..=1.0).contains(&s) {
                    return Err(format!("invalid --short-share {s}: must be in 0..=1"));
                }
                s * c.rate
            }
            (None, Some(n)) => n as f64 * c.short_requests as f64 / c.duration.as_secs_f64(),
            (None, None) => 0.0,
            (Some(_), Some(_)) => {
                return Err("give either --short-share or --short-conns, not both".into())
            }
        };
        if c.short_rate > c.rate * (1.0 + 1e-9) {
            return Err(format!(
                "short flows need {:.0} requests/s, more than the total rate {:.0}: lower --short-conns or raise the rate",
                c.short_rate, c.rate
            ));
        }
        c.short_rate = c.short_rate.min(c.rate);
        if c.conns == 0 && c.long_rate() > 1e-9 {
            return Err("--conns 0 leaves no long connections for the long-flow load: use --short-share 1 or --conns N".into());
        }
        c.max_short_inflight = self.max_short_inflight;
        if c.max_short_inflight == 0 && c.short_rate > 0.0 {
            return Err("invalid --max-short-inflight 0 with short flows".into());
        }
        if self.max_outstanding == 0 || self.max_outstanding > 1 << 20 {
            return Err(format!(
                "invalid --max-outstanding {}: must be 1..=1048576",
                self.max_outstanding
            ));
        }
        c.max_outstanding = self.max_outstanding;
        c.timeout = dur("timeout", &self.timeout)?;
        c.connect_timeout = dur("connect-timeout", &self.connect_timeout)?;
        if c.timeout.is_zero() || c.connect_timeout.is_zero() {
            return Err("--timeout and --connect-timeout must be > 0".into());
        }
        c.interval = dur("interval", &self.interval)?;
        if c.interval < Duration::from_micros(100) {
            return Err(format!(
                "invalid --interval {:?}: at least 100us",
                self.interval
            ));
        }
        if c.duration.as_nanos() / c.interval.as_nanos() > 10_000_000 {
            return Err(format!(
                "invalid --interval {:?}: more than 10M timeline rows for --duration {:?}",
                self.interval, self.duration
            ));
        }
        if !self.path.starts_with('/') || self.path.bytes().any(|b| b <= b' ' || b >= 0x7f) {
            return Err(format!(
                "invalid --path {:?}: must start with / and contain no spaces or control bytes",
                self.path
            ));
        }
        c.path = self.path.clone();
        if let Some(h) = &self.host {
            if h.is_empty() || h.bytes().any(|b| b <= b' ' || b >= 0x7f) {
                return Err(format!("invalid --host {h:?}"));
            }
            c.host = h.clone();
        }
        if !(100..=599).contains(&self.expect_status) {
            return Err(format!(
                "invalid --expect-status {}: must be 100..=599",
                self.expect_status
            ));
        }
        c.expect_status = self.expect_status;
        c.expect_body = self.expect_body;
        let sh = self.server_header.to_ascii_lowercase();
        if sh.is_empty() || sh.bytes().any(|b| b <= b' ' || b >= 0x7f || b == b':') {
            return Err(format!("invalid --server-header {:?}", self.server_header));
        }
        c.server_header = sh;
        c.seed = self.seed;
        c.precise_timers = !self.coarse_timers;
        c.probe = self.probe;
        c.json = self.json.clone();
        Ok(c)
    }
}
