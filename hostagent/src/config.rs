//! The hostagent's configuration file (TOML), validated before anything
//! starts. `hostagent --check CONFIG` validates and exits; every error names
//! the field and the bad value.

use serde::Deserialize;
use std::net::{Ipv4Addr, SocketAddrV4};

/// Which frame I/O backend runs the stack.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Backend {
    /// AF_PACKET with mmap'ed rings: works on any Linux interface.
    #[default]
    AfPacket,
    /// DPDK (cargo feature `dpdk`), e.g. `net_af_packet` in the lab.
    Dpdk,
}

/// Busy-poll a dedicated core, or sleep until frames arrive.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Poll {
    Busy,
    #[default]
    Sleep,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InterfaceConfig {
    /// The kernel interface the stack takes frames from (e.g. `eth0`).
    pub name: String,
    #[serde(default)]
    pub backend: Backend,
    #[serde(default)]
    pub poll: Poll,
    /// EAL arguments for the DPDK backend.
    #[serde(default)]
    pub dpdk_args: Vec<String>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StackConfig {
    /// The stack's own data address (not assigned to the kernel).
    pub address: Ipv4Addr,
    /// Next hop for everything (the switch).
    pub gateway: Ipv4Addr,
    // The ranges of `int_in` (named in type errors) are `validate`'s.
    #[serde(
        default = "default_mss",
        deserialize_with = "capybara_confkit::int_in::<_, _, 536, 9000>"
    )]
    pub mss: u16,
    #[serde(default = "default_buffer")]
    pub send_buffer: usize,
    #[serde(default = "default_buffer")]
    pub recv_buffer: usize,
}

fn default_mss() -> u16 {
    1460
}
fn default_buffer() -> usize {
    256 * 1024
}

/// What serves the connections of a service.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum App {
    /// Writes back every byte it reads.
    Echo,
    /// A small HTTP/1.1 server (hyper on the async socket API).
    Http,
    /// The benchmarks' emulated single-core server (`capybara-testserver`):
    /// one FIFO virtual core per service with a service time
    /// (`service_time`, `service_dist`), `body_bytes` per response.
    /// Migration-safe: requests stay in the receive queue until answered.
    Testserver,
    /// The sidecar proxy: relays to an unmodified local application
    /// (`backend`) with a per-`protocol` connection manager, optionally
    /// terminating TLS (`tls_cert`, `tls_key`). See docs/SIDECAR.md.
    Sidecar,
}

/// The application protocol a sidecar service relays (docs/SIDECAR.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SidecarProtocol {
    /// HTTP/1.1 with keep-alive and pipelining.
    Http1,
    /// The Redis protocol (RESP2/RESP3).
    Resp,
    /// Any byte stream: migrates only when idle both ways.
    Raw,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServiceConfig {
    /// The service address (VIP:port) the stack listens on.
    pub listen: SocketAddrV4,
    pub app: App,
    /// testserver: mean service time per request, with unit ("100us").
    #[serde(default)]
    pub service_time: Option<String>,
    /// testserver: "fixed" (default) or "exp" (exponential).
    #[serde(default)]
    pub service_dist: Option<String>,
    /// testserver: response body bytes (default 256).
    #[serde(default)]
    pub body_bytes: Option<usize>,
    /// testserver: seed of the service-time generator (default 1).
    #[serde(default)]
    pub seed: Option<u64>,
    /// sidecar: the local application's address (kernel loopback).
    #[serde(default)]
    pub backend: Option<SocketAddrV4>,
    /// sidecar: the protocol relayed.
    #[serde(default)]
    pub protocol: Option<SidecarProtocol>,
    /// sidecar: PEM certificate chain; with `tls_key`, TLS is terminated.
    #[serde(default)]
    pub tls_cert: Option<String>,
    /// sidecar: PEM private key of `tls_cert`.
    #[serde(default)]
    pub tls_key: Option<String>,
    /// sidecar: largest request buffered (default 1 MiB); larger ones get
    /// an error response and the connection is closed.
    #[serde(default)]
    pub max_request_bytes: Option<usize>,
}

impl ServiceConfig {
    /// The sidecar fields: required with `app = "sidecar"`, refused
    /// otherwise. The error names the field and value.
    pub fn check_sidecar(&self) -> Result<(), (&'static str, String, String)> {
        let sidecar = self.app == App::Sidecar;
        let set = |o: bool| if o { "(set)" } else { "(none)" }.to_string();
        if !sidecar {
            for (field, present) in [
                ("backend", self.backend.is_some()),
                ("protocol", self.protocol.is_some()),
                ("tls_cert", self.tls_cert.is_some()),
                ("tls_key", self.tls_key.is_some()),
                ("max_request_bytes", self.max_request_bytes.is_some()),
            ] {
                if present {
                    return Err((field, set(true), "only for app = \"sidecar\"".into()));
                }
            }
            return Ok(());
        }
        let Some(b) = self.backend else {
            return Err((
                "backend",
                set(false),
                "app = \"sidecar\" needs a backend address (e.g. \"127.0.0.1:8080\")".into(),
            ));
        };
        if b.port() == 0 || b.ip().is_unspecified() {
            return Err((
                "backend",
                b.to_string(),
                "needs an address and a port".into(),
            ));
        }
        if self.protocol.is_none() {
            return Err((
                "protocol",
                set(false),
                "app = \"sidecar\" needs protocol = \"http1\", \"resp\" or \"raw\"".into(),
            ));
        }
        match (&self.tls_cert, &self.tls_key) {
            (Some(_), None) => {
                return Err(("tls_key", set(false), "tls_cert needs tls_key".into()))
            }
            (None, Some(_)) => {
                return Err(("tls_cert", set(false), "tls_key needs tls_cert".into()))
            }
            _ => {}
        }
        if let Some(n) = self.max_request_bytes {
            if !(1024..=64 << 20).contains(&n) {
                return Err((
                    "max_request_bytes",
                    n.to_string(),
                    "must be 1 KiB to 64 MiB".into(),
                ));
            }
        }
        Ok(())
    }

    /// The emulated server of an `app = "testserver"` service, `id` naming
    /// it in the `x-server` header. The error names the field and value.
    pub fn testserver(
        &self,
        id: &str,
    ) -> Result<capybara_testserver::ServerConfig, (&'static str, String, String)> {
        use capybara_testserver::{hrtime::parse_duration, ServerConfig, ServiceTime};
        let st = self.service_time.as_deref().unwrap_or("100us");
        let d = parse_duration(st).map_err(|e| ("service_time", st.to_string(), e))?;
        let ns = d.as_nanos();
        if ns == 0 || ns > 10_000_000_000 {
            return Err((
                "service_time",
                st.to_string(),
                "must be between 1ns and 10s".into(),
            ));
        }
        let service = match self.service_dist.as_deref().unwrap_or("fixed") {
            "fixed" => ServiceTime::Fixed(ns as u64),
            "exp" | "exponential" => ServiceTime::Exponential(ns as u64),
            other => {
                return Err((
                    "service_dist",
                    other.to_string(),
                    "expected fixed or exp".into(),
                ))
            }
        };
        let body_bytes = self.body_bytes.unwrap_or(256);
        if body_bytes > 1 << 20 {
            return Err(("body_bytes", body_bytes.to_string(), "at most 1 MiB".into()));
        }
        Ok(ServerConfig {
            id: id.to_string(),
            service,
            body_bytes,
            seed: self.seed.unwrap_or(1),
            precise_timers: true,
            max_pipeline: 1024,
        })
    }
}

/// Live migration (TCPMig). Without this section the stack serves but
/// never migrates.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MigrationConfig {
    /// The deployment secret shared by servers and switch, hex (>= 16 bytes).
    #[serde(default)]
    pub key: Option<String>,
    /// A file holding the hex secret (instead of `key`).
    #[serde(default)]
    pub key_file: Option<String>,
    /// Where PREPAREs go (the switch's server-side address).
    pub switch: Ipv4Addr,
    /// Drop client packets that arrive mid-migration instead of buffering
    /// them (the Prism behaviour; an ablation for benchmarks only).
    #[serde(default)]
    pub drop_mode: bool,
    /// Benchmarks and tests: every `churn_every_ms`, migrate each connection
    /// served here to `churn_to` (0 = off).
    #[serde(default)]
    pub churn_every_ms: u64,
    #[serde(default)]
    pub churn_to: Option<Ipv4Addr>,
    /// A drain migrates at most this many connections at once (1 to 256),
    /// raised only when the drain's deadline needs it (docs/OPERATIONS.md,
    /// draining).
    #[serde(default = "default_drain_max_in_flight")]
    pub drain_max_in_flight: usize,
    /// `poll = "sleep"`: while a migration awaits the peer's next TCPMig
    /// message, the driver polls without sleeping for up to this many
    /// microseconds per message awaited, then sleeps (0 = never spin; at
    /// most 1000). docs/HOSTAGENT.md, "Wake-ups".
    #[serde(default = "default_reply_spin_us")]
    pub reply_spin_us: u64,
}

fn default_reply_spin_us() -> u64 {
    0
}

/// Upper bound of `reply_spin_us`: the engine's first retransmission
/// timer (1 ms); a reply later than that is better waited for asleep.
pub const MAX_REPLY_SPIN_US: u64 = 1000;

fn default_drain_max_in_flight() -> usize {
    crate::drain::DEFAULT_MAX_IN_FLIGHT
}

/// Registration and heartbeats with switchd over the control channel.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ControlConfig {
    /// switchd's control address (UDP, port 7692).
    pub switch: std::net::SocketAddrV4,
    /// This server's id in the pool (1 and up: 0 is reserved).
    #[serde(deserialize_with = "capybara_confkit::int_in::<_, _, 1, 4294967295>")]
    pub server_id: u32,
    /// The server's management (kernel) address, source of control messages.
    pub management: Ipv4Addr,
    #[serde(
        default = "default_weight",
        deserialize_with = "capybara_confkit::int_in::<_, _, 1, 65535>"
    )]
    pub weight: u16,
}

fn default_weight() -> u16 {
    1
}

/// Migration policies on this server (docs/POLICIES.md). Their tunables
/// live in the store and reach the server from switchd (POLICY messages);
/// this section only switches them off entirely (the LWRR baseline) and
/// sizes the server monitor.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PolicyConfig {
    /// false: never start a migration on a policy's decision, whatever the
    /// store says (drains and operator migrations still work).
    #[serde(default = "default_true")]
    pub enabled: bool,
    /// Sliding window of the per-connection packet rates, milliseconds.
    #[serde(default = "default_monitor_window_ms")]
    pub monitor_window_ms: u64,
}

impl Default for PolicyConfig {
    fn default() -> Self {
        PolicyConfig {
            enabled: true,
            monitor_window_ms: default_monitor_window_ms(),
        }
    }
}

fn default_true() -> bool {
    true
}
fn default_monitor_window_ms() -> u64 {
    50
}

/// Health checks of the applications behind sidecar services
/// (`crate::health`, docs/OPERATIONS.md "Application health checks").
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HealthConfig {
    /// false: no checks; every service counts as up (as before).
    #[serde(default = "default_true")]
    pub enabled: bool,
    /// Time between two probes of a service, milliseconds.
    #[serde(default = "default_health_interval_ms")]
    pub interval_ms: u64,
    /// A probe's connect not done within this is a failure, milliseconds.
    #[serde(default = "default_health_timeout_ms")]
    pub timeout_ms: u64,
    /// Consecutive failed checks (probes, or relays that could not
    /// connect) that take a service down.
    #[serde(
        default = "default_health_fall",
        deserialize_with = "capybara_confkit::int_in::<_, _, 1, 100>"
    )]
    pub fall: u32,
    /// Consecutive successful probes that bring it back up.
    #[serde(
        default = "default_health_rise",
        deserialize_with = "capybara_confkit::int_in::<_, _, 1, 100>"
    )]
    pub rise: u32,
}

impl Default for HealthConfig {
    fn default() -> Self {
        HealthConfig {
            enabled: true,
            interval_ms: default_health_interval_ms(),
            timeout_ms: default_health_timeout_ms(),
            fall: default_health_fall(),
            rise: default_health_rise(),
        }
    }
}

fn default_health_interval_ms() -> u64 {
    500
}
fn default_health_timeout_ms() -> u64 {
    250
}
fn default_health_fall() -> u32 {
    2
}
fn default_health_rise() -> u32 {
    2
}

/// TCP behaviour of the connections the stack terminates (`[tcp]`).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TcpSection {
    /// Probe idle connections and drop those whose client no longer
    /// answers (RFC 1122 §4.2.3.6). On by default: a client that vanished
    /// without FIN or RST would otherwise hold its connection, its buffers
    /// and its share of the server's reported load forever
    /// (docs/HOSTAGENT.md, "Keep-alive").
    #[serde(default = "default_true")]
    pub keepalive: bool,
    /// Idle time before the first probe, milliseconds.
    #[serde(default = "default_keepalive_idle_ms")]
    pub keepalive_idle_ms: u64,
    /// Time between unanswered probes, milliseconds.
    #[serde(default = "default_keepalive_interval_ms")]
    pub keepalive_interval_ms: u64,
    /// Unanswered probes before the connection is dropped.
    #[serde(
        default = "default_keepalive_probes",
        deserialize_with = "capybara_confkit::int_in::<_, _, 1, 100>"
    )]
    pub keepalive_probes: u32,
}

impl Default for TcpSection {
    fn default() -> Self {
        TcpSection {
            keepalive: true,
            keepalive_idle_ms: default_keepalive_idle_ms(),
            keepalive_interval_ms: default_keepalive_interval_ms(),
            keepalive_probes: default_keepalive_probes(),
        }
    }
}

impl TcpSection {
    /// The stack's keep-alive (`TcpConfig::keepalive`): `None` when off.
    pub fn keepalive(&self) -> Option<capybara_tcp::KeepAlive> {
        use capybara_proto::time::Duration;
        self.keepalive.then(|| capybara_tcp::KeepAlive {
            idle: Duration::from_millis(self.keepalive_idle_ms),
            interval: Duration::from_millis(self.keepalive_interval_ms),
            probes: self.keepalive_probes,
        })
    }
}

/// What SIGTERM/SIGINT does (`[shutdown]`, docs/OPERATIONS.md "Stopping
/// or restarting a server").
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShutdownConfig {
    /// How long a stop may take to migrate every connection away before it
    /// cuts the ones left and exits, milliseconds; 0: exit at once (the
    /// connections die).
    #[serde(default = "default_drain_timeout_ms")]
    pub drain_timeout_ms: u64,
}

impl Default for ShutdownConfig {
    fn default() -> Self {
        ShutdownConfig {
            drain_timeout_ms: default_drain_timeout_ms(),
        }
    }
}

/// Upper bound of `shutdown.drain_timeout_ms`: one hour (a stop that
/// takes longer is a stuck stop; systemd and compose would need as long).
pub const MAX_DRAIN_TIMEOUT_MS: u64 = 3_600_000;

fn default_drain_timeout_ms() -> u64 {
    20_000
}

fn default_keepalive_idle_ms() -> u64 {
    300_000
}
fn default_keepalive_interval_ms() -> u64 {
    30_000
}
fn default_keepalive_probes() -> u32 {
    5
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// A name for logs, counters and the `x-server` response header.
    #[serde(default = "default_name")]
    pub name: String,
    pub interface: InterfaceConfig,
    pub stack: StackConfig,
    #[serde(default, rename = "service")]
    pub services: Vec<ServiceConfig>,
    #[serde(default)]
    pub migration: Option<MigrationConfig>,
    #[serde(default)]
    pub control: Option<ControlConfig>,
    #[serde(default)]
    pub policy: PolicyConfig,
    #[serde(default)]
    pub health: HealthConfig,
    #[serde(default)]
    pub tcp: TcpSection,
    #[serde(default)]
    pub shutdown: ShutdownConfig,
}

impl MigrationConfig {
    /// The field an error about the secret names: the one the config
    /// gives (`key_file` alone: `migration.key_file`).
    pub fn key_field(&self) -> &'static str {
        if self.key.is_none() && self.key_file.is_some() {
            "migration.key_file"
        } else {
            "migration.key"
        }
    }

    /// The warning for a `key_file` group or others may read (logged at
    /// start and by `--check`; not refused, see confkit).
    pub fn key_file_warning(&self) -> Option<String> {
        capybara_confkit::key_file_mode_warning(std::path::Path::new(self.key_file.as_deref()?))
    }

    /// The deployment secret, from `key` or `key_file`.
    pub fn load_key(&self, origin: &str) -> Result<capybara_proto::MigrationKey, ConfigError> {
        let hex = self.load_key_hex(origin)?;
        capybara_proto::MigrationKey::from_hex(&hex).map_err(|e| ConfigError::Invalid {
            path: origin.into(),
            field: self.key_field().into(),
            // The file's path is no secret (and says which file to fix);
            // a key written in the config is not shown.
            value: match (&self.key, &self.key_file) {
                (None, Some(f)) => f.clone(),
                _ => "<secret>".into(),
            },
            why: e.to_string(),
        })
    }

    /// The deployment secret's hex text, from `key` or `key_file` (also
    /// the source of the key that seals TLS state in migrations).
    pub fn load_key_hex(&self, origin: &str) -> Result<String, ConfigError> {
        let bad = |value: String, why: String| ConfigError::Invalid {
            path: origin.into(),
            field: self.key_field().into(),
            value,
            why,
        };
        let hex = match (&self.key, &self.key_file) {
            (Some(k), None) => k.clone(),
            (None, Some(f)) => std::fs::read_to_string(f)
                .map_err(|e| bad(f.clone(), format!("cannot read the key file: {e}")))?
                .trim()
                .to_string(),
            (Some(_), Some(f)) => {
                return Err(bad(
                    format!("<secret>, key_file = {f}"),
                    "give exactly one of key or key_file, not both".into(),
                ))
            }
            (None, None) => {
                return Err(bad(
                    "(none)".into(),
                    "give exactly one of key or key_file".into(),
                ))
            }
        };
        Ok(hex)
    }
}

fn default_name() -> String {
    "hostagent".into()
}

/// A sidecar's `max_request_bytes` when the config gives none (1 MiB).
pub const DEFAULT_MAX_REQUEST_BYTES: usize = 1 << 20;

/// What a sidecar connection's migrating state may hold beyond its
/// `max_request_bytes` of client bytes not forwarded yet: the read that
/// crossed the limit (64 KiB), a TLS session (a partial record, plaintext
/// and ciphertext not taken yet, the seal) and the state's header.
pub const SIDECAR_STATE_SLACK: usize = 256 << 10;

impl Config {
    /// The largest connection snapshot this host sends and accepts
    /// (TCPMig's `max_snapshot_bytes`): both TCP queues, the largest
    /// application state a service's connection may carry (a sidecar's
    /// partially received request, up to its `max_request_bytes`) and
    /// room for the snapshot's headers. Sized from the queues alone, a
    /// connection in the middle of receiving a request of more than about
    /// the two queues could not migrate (the engine refused its snapshot as
    /// too large and the migration ended `cancelled`: docs/SIDECAR.md).
    pub fn max_snapshot_bytes(&self) -> usize {
        let app = self
            .services
            .iter()
            .filter(|s| s.app == App::Sidecar)
            .map(|s| s.max_request_bytes.unwrap_or(DEFAULT_MAX_REQUEST_BYTES) + SIDECAR_STATE_SLACK)
            .max()
            .unwrap_or(0);
        self.stack.send_buffer + self.stack.recv_buffer + app + 4096
    }
}

/// The keys of the file's top level (`Config`'s fields as spelled in TOML).
const TOP_LEVEL_KEYS: &[&str] = &[
    "name",
    "interface",
    "stack",
    "service",
    "migration",
    "control",
    "policy",
    "health",
    "tcp",
    "shutdown",
];

/// A configuration error, naming the field and the value.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Parse { path: String, message: String },
    #[error("{path}: {field} = {value}: {why}")]
    Invalid {
        path: String,
        field: String,
        value: String,
        why: String,
    },
}

impl Config {
    /// Reads and validates a configuration file.
    pub fn load(path: &str) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.into(),
            source,
        })?;
        let cfg = Config::parse(path, &text)?;
        cfg.validate(path)?;
        Ok(cfg)
    }

    /// Parses TOML text; `origin` names it in errors.
    pub fn parse(origin: &str, text: &str) -> Result<Config, ConfigError> {
        toml::from_str(text).map_err(|e| {
            // A top-level key written after a [section] is that section's.
            let hint = capybara_confkit::misplaced_key_hint(
                e.message(),
                TOP_LEVEL_KEYS,
                capybara_confkit::Level::TopLevel,
            )
            .map(|h| format!("; {h}"))
            .unwrap_or_default();
            // One line: the message in words (`expected usize` -> `expected
            // a non-negative integer`), the line it is about and a hint for
            // a known slip (`[service]` for `[[service]]`).
            let message =
                capybara_confkit::parse_error(e.message(), text, e.span().map(|s| s.start));
            ConfigError::Parse {
                path: origin.into(),
                message: format!("{message}{hint}"),
            }
        })
    }

    /// Checks values that parse but cannot work.
    pub fn validate(&self, origin: &str) -> Result<(), ConfigError> {
        let bad = |field: &str, value: String, why: &str| ConfigError::Invalid {
            path: origin.into(),
            field: field.into(),
            value,
            why: why.into(),
        };
        if self.interface.name.is_empty() || self.interface.name.len() > 15 {
            return Err(bad(
                "interface.name",
                format!("{:?}", self.interface.name),
                "must be 1 to 15 characters",
            ));
        }
        if self.interface.backend == Backend::Dpdk && self.interface.dpdk_args.is_empty() {
            return Err(bad(
                "interface.dpdk_args",
                "[]".into(),
                "the dpdk backend needs EAL arguments",
            ));
        }
        let s = &self.stack;
        if s.address.is_unspecified() || s.address.is_broadcast() || s.address.is_multicast() {
            return Err(bad(
                "stack.address",
                s.address.to_string(),
                "must be a unicast address",
            ));
        }
        if s.gateway.is_unspecified() || s.gateway == s.address {
            return Err(bad(
                "stack.gateway",
                s.gateway.to_string(),
                "must be another unicast address",
            ));
        }
        if !(536..=9000).contains(&s.mss) {
            return Err(bad("stack.mss", s.mss.to_string(), "must be 536 to 9000"));
        }
        for (field, v) in [
            ("stack.send_buffer", s.send_buffer),
            ("stack.recv_buffer", s.recv_buffer),
        ] {
            if !(4096..=64 << 20).contains(&v) {
                return Err(bad(field, v.to_string(), "must be 4 KiB to 64 MiB"));
            }
        }
        if let Some(m) = &self.migration {
            m.load_key(origin)?;
            if m.churn_every_ms > 0 && m.churn_to.is_none() {
                return Err(bad(
                    "migration.churn_to",
                    "(none)".into(),
                    "churn_every_ms needs churn_to",
                ));
            }
            if !(1..=crate::drain::MAX_IN_FLIGHT_LIMIT).contains(&m.drain_max_in_flight) {
                return Err(bad(
                    "migration.drain_max_in_flight",
                    m.drain_max_in_flight.to_string(),
                    "must be 1 to 256",
                ));
            }
            if m.reply_spin_us > MAX_REPLY_SPIN_US {
                return Err(bad(
                    "migration.reply_spin_us",
                    m.reply_spin_us.to_string(),
                    "must be 0 (off) to 1000",
                ));
            }
        }
        if let Some(c) = &self.control {
            // The control channel is signed with the deployment secret of
            // `[migration]`; without it the agent never registered, and
            // said nothing (the server just never appeared in switchd).
            if self.migration.is_none() {
                return Err(bad(
                    "migration",
                    "(none)".into(),
                    "[control] needs a [migration] section: its key (the deployment secret) signs the REGISTER and heartbeats",
                ));
            }
            if c.switch.port() == 0 {
                return Err(bad(
                    "control.switch",
                    c.switch.to_string(),
                    "needs a port (switchd's control_listen, usually 7692)",
                ));
            }
            if c.weight == 0 {
                return Err(bad("control.weight", "0".into(), "must be 1 to 65535"));
            }
            // switchd answers a REGISTER from server 0 with an error and the
            // server never joins: say so here, before anything starts.
            if c.server_id == 0 {
                return Err(bad(
                    "control.server_id",
                    "0".into(),
                    "must be 1 to 4294967295 (0 is reserved; switchd refuses it)",
                ));
            }
            // The kernel owns the management address and the stack the data
            // address; one address for both would have the kernel answer
            // (and reset) the stack's connections.
            if c.management == s.address {
                return Err(bad(
                    "control.management",
                    c.management.to_string(),
                    "must be the kernel's management address, not the stack's data address (stack.address)",
                ));
            }
            if c.management.is_unspecified()
                || c.management.is_broadcast()
                || c.management.is_multicast()
            {
                return Err(bad(
                    "control.management",
                    c.management.to_string(),
                    "must be a unicast address",
                ));
            }
        }
        let h = &self.health;
        for (field, v, range) in [
            ("health.interval_ms", h.interval_ms, 10..=60_000),
            ("health.timeout_ms", h.timeout_ms, 1..=60_000),
            ("health.fall", u64::from(h.fall), 1..=100),
            ("health.rise", u64::from(h.rise), 1..=100),
        ] {
            if !range.contains(&v) {
                let why = format!("must be {} to {}", range.start(), range.end());
                return Err(bad(field, v.to_string(), &why));
            }
        }
        // Checked whether keep-alive is on or off, so that switching it on
        // later cannot surface an error written long before. The bounds
        // are well inside what a snapshot accepts (12.7 days, 65536 probes),
        // so a migration never fails on them.
        let t = &self.tcp;
        for (field, v, range) in [
            (
                "tcp.keepalive_idle_ms",
                t.keepalive_idle_ms,
                100..=86_400_000,
            ),
            (
                "tcp.keepalive_interval_ms",
                t.keepalive_interval_ms,
                100..=3_600_000,
            ),
            (
                "tcp.keepalive_probes",
                u64::from(t.keepalive_probes),
                1..=100,
            ),
        ] {
            if !range.contains(&v) {
                let why = format!("must be {} to {}", range.start(), range.end());
                return Err(bad(field, v.to_string(), &why));
            }
        }
        if self.shutdown.drain_timeout_ms > MAX_DRAIN_TIMEOUT_MS {
            return Err(bad(
                "shutdown.drain_timeout_ms",
                self.shutdown.drain_timeout_ms.to_string(),
                "must be 0 (stop at once) to 3600000 (one hour)",
            ));
        }
        if !(1..=10_000).contains(&self.policy.monitor_window_ms) {
            return Err(bad(
                "policy.monitor_window_ms",
                self.policy.monitor_window_ms.to_string(),
                "must be 1 to 10000",
            ));
        }
        for (i, a) in self.services.iter().enumerate() {
            // The stack owns each listen address (the interface answers for
            // it), so it must be one unicast address: 0.0.0.0 passed here
            // and the start failed ("address 0.0.0.0 is not a unicast IPv4
            // address"). Ports are unique per server, so a wildcard would
            // stand for one VIP anyway.
            let ip = *a.listen.ip();
            if ip.is_unspecified() || ip.is_broadcast() || ip.is_multicast() {
                let why = if ip.is_unspecified() {
                    format!(
                        "the stack cannot listen on 0.0.0.0 (every address): list the service's VIP instead (listen = \"VIP:{}\", one [[service]] per VIP:port)",
                        a.listen.port()
                    )
                } else {
                    "must be a unicast address: the service's VIP".to_string()
                };
                return Err(bad(
                    &format!("service[{i}].listen"),
                    a.listen.to_string(),
                    &why,
                ));
            }
            if a.app == App::Testserver {
                if let Err((field, value, why)) = a.testserver(&self.name) {
                    return Err(bad(&format!("service[{i}].{field}"), value, &why));
                }
            } else if a.service_time.is_some()
                || a.service_dist.is_some()
                || a.body_bytes.is_some()
                || a.seed.is_some()
            {
                return Err(bad(
                    &format!("service[{i}].app"),
                    format!("{:?}", a.app).to_lowercase(),
                    "service_time, service_dist, body_bytes and seed are for app = \"testserver\"",
                ));
            }
            if let Err((field, value, why)) = a.check_sidecar() {
                return Err(bad(&format!("service[{i}].{field}"), value, &why));
            }
            // The sidecar reaches its application through the kernel; the
            // stack's data address and the service addresses belong to the
            // user-space stack (the kernel does not own them and drops
            // their frames), so a backend there is never answered.
            if let Some(b) = a.backend {
                let ours = if *b.ip() == s.address {
                    Some("the stack's data address (stack.address)".to_string())
                } else {
                    self.services
                        .iter()
                        .position(|o| o.listen.ip() == b.ip())
                        .map(|j| format!("a service address (service[{j}].listen)"))
                };
                if let Some(what) = ours {
                    return Err(bad(
                        &format!("service[{i}].backend"),
                        b.to_string(),
                        &format!(
                            "is {what}, served by the user-space stack, not the kernel: the application's address is the kernel's, e.g. 127.0.0.1:{}",
                            b.port()
                        ),
                    ));
                }
            }
            if a.listen.port() == 0 {
                return Err(bad(
                    &format!("service[{i}].listen"),
                    a.listen.to_string(),
                    "port 0",
                ));
            }
            // Incoming segments reach a listener by port (the switch rewrote
            // the VIP to our data address), so ports must be unique.
            if self.services[..i]
                .iter()
                .any(|b| b.listen.port() == a.listen.port())
            {
                return Err(bad(
                    &format!("service[{i}].listen"),
                    a.listen.to_string(),
                    "another service already uses this port",
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
name = "s1"
[interface]
name = "eth0"
[stack]
address = "198.18.2.11"
gateway = "198.18.1.1"
[[service]]
listen = "198.18.100.1:80"
app = "http"
[[service]]
listen = "198.18.100.1:7"
app = "echo"
"#;

    fn check(text: &str) -> Result<Config, String> {
        let c = Config::parse("t.toml", text).map_err(|e| e.to_string())?;
        c.validate("t.toml").map_err(|e| e.to_string())?;
        Ok(c)
    }

    #[test]
    fn good_config_parses_with_defaults() {
        let c = check(GOOD).unwrap();
        assert_eq!(c.stack.mss, 1460);
        assert_eq!(c.interface.backend, Backend::AfPacket);
        assert_eq!(c.services.len(), 2);
    }

    #[test]
    fn errors_name_the_field_and_value() {
        let e = check(&GOOD.replace("198.18.2.11", "198.18.2.300")).unwrap_err();
        assert!(e.contains("198.18.2.300"), "{e}");
        let e = check(&GOOD.replace("app = \"echo\"", "app = \"ftp\"")).unwrap_err();
        assert!(e.contains("ftp"), "{e}");
        let e = check(&GOOD.replace("198.18.100.1:7\"", "198.18.100.2:80\"")).unwrap_err();
        assert!(
            e.contains("service[1].listen") && e.contains("198.18.100.2:80"),
            "{e}"
        );
        let e = check(&GOOD.replace("[stack]", "[stack]\nmss = 20")).unwrap_err();
        assert!(e.contains("stack.mss = 20"), "{e}");
        let e = check(&GOOD.replace("name = \"eth0\"", "name = \"eth0\"\nspeed = 1")).unwrap_err();
        assert!(e.contains("speed"), "{e}");
    }

    #[test]
    fn key_errors_name_the_field_the_config_gives() {
        let with = |line: &str| {
            check(&format!(
                "{GOOD}[migration]\n{line}\nswitch = \"198.18.1.1\"\n"
            ))
            .unwrap_err()
        };
        let e = with("key_file = \"/nonexistent/capybara-key\"");
        assert!(e.contains("migration.key_file = /nonexistent"), "{e}");
        let e = with("key = \"zz\"");
        assert!(
            e.contains("migration.key = ") && !e.contains("key_file"),
            "{e}"
        );
        // A key file that holds too short a key: the file is named (its
        // path is no secret), the key is not shown.
        let f = std::env::temp_dir().join(format!("capybara-short-key-{}", std::process::id()));
        std::fs::write(&f, "deadbeef\n").unwrap();
        let e = with(&format!("key_file = \"{}\"", f.display()));
        std::fs::remove_file(&f).unwrap();
        assert!(
            e.contains(&format!("migration.key_file = {}: ", f.display()))
                && e.contains("too short")
                && !e.contains("deadbeef"),
            "{e}"
        );
    }

    /// Type errors say what kind of value is wanted, not a Rust type.
    #[test]
    fn type_errors_name_kinds_of_values() {
        let e = check(&format!(
            "{GOOD}[control]\nswitch = \"198.18.1.1:7692\"\nserver_id = \"1\"\nmanagement = \"198.18.1.11\"\n"
        ))
        .unwrap_err();
        assert!(
            e.ends_with(
                "invalid type: string \"1\", expected an integer from 1 to 4294967295 (line 16: server_id = \"1\")"
            ),
            "{e}"
        );
        // `[service]` (one table) for `[[service]]`: the fix is named.
        let one = GOOD
            .split("[[service]]\nlisten = \"198.18.100.1:7\"")
            .next()
            .unwrap();
        let e = check(&one.replace("[[service]]", "[service]")).unwrap_err();
        assert_eq!(
            e,
            "t.toml: invalid type: table, expected an array (line 8: [service]); \
             `service` is a list: write each entry as a [[service]] table, not one [service]"
        );
    }

    /// Where validation refuses part of an integer type's range (0 for
    /// `control.server_id`), the type error names the valid range, not the
    /// type's: both say the same numbers.
    #[test]
    fn type_errors_and_refusals_name_the_same_range() {
        let ctl = |id: &str, weight: &str| {
            format!(
                "{GOOD}{MIGRATION}[control]\nswitch = \"198.18.1.1:7692\"\nserver_id = {id}\nmanagement = \"198.18.1.13\"\nweight = {weight}\n"
            )
        };
        let stack =
            |k: &str, v: &str| GOOD.replacen("[[service]]", &format!("{k} = {v}\n[[service]]"), 1);
        let health = |k: &str, v: &str| format!("{GOOD}[health]\n{k} = {v}\n");
        let tcp = |k: &str, v: &str| format!("{GOOD}[tcp]\n{k} = {v}\n");
        for (field, bad_type, bad_value, range) in [
            (
                "control.server_id",
                ctl("\"1\"", "1"),
                ctl("0", "1"),
                "1 to 4294967295",
            ),
            (
                "control.server_id",
                ctl("-1", "1"),
                ctl("0", "1"),
                "1 to 4294967295",
            ),
            (
                "control.weight",
                ctl("1", "\"2\""),
                ctl("1", "0"),
                "1 to 65535",
            ),
            (
                "stack.mss",
                stack("mss", "\"1460\""),
                stack("mss", "100"),
                "536 to 9000",
            ),
            (
                "health.fall",
                health("fall", "1.5"),
                health("fall", "0"),
                "1 to 100",
            ),
            (
                "health.rise",
                health("rise", "-3"),
                health("rise", "101"),
                "1 to 100",
            ),
            (
                "tcp.keepalive_probes",
                tcp("keepalive_probes", "\"5\""),
                tcp("keepalive_probes", "0"),
                "1 to 100",
            ),
        ] {
            let e = check(&bad_type).unwrap_err();
            assert!(
                e.contains(&format!("expected an integer from {range} (line ")),
                "{field}: {e}"
            );
            let e = check(&bad_value).unwrap_err();
            assert!(
                e.contains(&format!("{field} = ")) && e.contains(&format!(": must be {range}")),
                "{field}: {e}"
            );
        }
        let e = check(&ctl("0", "1")).unwrap_err();
        assert!(
            e.ends_with("control.server_id = 0: must be 1 to 4294967295 (0 is reserved; switchd refuses it)"),
            "{e}"
        );
    }

    const MIGRATION: &str =
        "[migration]\nkey = \"00112233445566778899aabbccddeeff\"\nswitch = \"198.18.1.1\"\n";

    #[test]
    fn control_section_names_a_reserved_id_and_a_shared_address() {
        let ctl = |id: u32, mgmt: &str| {
            format!(
                "{GOOD}{MIGRATION}[control]\nswitch = \"198.18.1.1:7692\"\nserver_id = {id}\nmanagement = \"{mgmt}\"\n"
            )
        };
        assert_eq!(
            check(&ctl(3, "198.18.1.13"))
                .unwrap()
                .control
                .unwrap()
                .server_id,
            3
        );
        let e = check(&ctl(0, "198.18.1.13")).unwrap_err();
        assert!(
            e.contains("control.server_id = 0") && e.contains("reserved"),
            "{e}"
        );
        let e = check(&ctl(1, "198.18.2.11")).unwrap_err();
        assert!(
            e.contains("control.management = 198.18.2.11") && e.contains("stack.address"),
            "{e}"
        );
        let e = check(&ctl(1, "0.0.0.0")).unwrap_err();
        assert!(e.contains("control.management = 0.0.0.0"), "{e}");
    }

    /// `[control]` without `[migration]` was accepted, and the agent then
    /// never registered (the control channel needs the deployment key),
    /// silently; a control address without a port never reached switchd.
    #[test]
    fn control_needs_the_migration_key_and_a_port() {
        let ctl = "[control]\nswitch = \"198.18.1.1:7692\"\nserver_id = 3\nmanagement = \"198.18.1.13\"\n";
        let e = check(&format!("{GOOD}{ctl}")).unwrap_err();
        assert!(
            e.contains("migration = (none): [control] needs a [migration] section"),
            "{e}"
        );
        assert!(check(&format!("{GOOD}{MIGRATION}{ctl}")).is_ok());
        let e = check(&format!("{GOOD}{MIGRATION}{}", ctl.replace(":7692", ":0"))).unwrap_err();
        assert!(
            e.contains("control.switch = 198.18.1.1:0: needs a port"),
            "{e}"
        );
    }

    /// Both `key` and `key_file` were reported as `migration.key = (none)`.
    #[test]
    fn both_key_and_key_file_are_named() {
        let e = check(&format!(
            "{GOOD}[migration]\nkey = \"00112233445566778899aabbccddeeff\"\nkey_file = \"/k\"\nswitch = \"198.18.1.1\"\n"
        ))
        .unwrap_err();
        assert!(
            e.contains("migration.key = <secret>, key_file = /k: give exactly one of key or key_file, not both")
                && !e.contains("0011"),
            "{e}"
        );
    }

    /// `listen = "0.0.0.0:7"` passed --check and the start then failed
    /// ("address 0.0.0.0 is not a unicast IPv4 address"): refused here,
    /// naming the field and what to write instead.
    #[test]
    fn a_wildcard_listen_address_is_refused() {
        let e = check(&GOOD.replace("198.18.100.1:7", "0.0.0.0:7")).unwrap_err();
        assert!(
            e.contains("service[1].listen = 0.0.0.0:7: the stack cannot listen on 0.0.0.0")
                && e.contains("list the service's VIP instead (listen = \"VIP:7\""),
            "{e}"
        );
        for addr in ["255.255.255.255:7", "224.0.0.1:7"] {
            let e = check(&GOOD.replace("198.18.100.1:7", addr)).unwrap_err();
            assert!(
                e.contains(&format!(
                    "service[1].listen = {addr}: must be a unicast address"
                )),
                "{e}"
            );
        }
        // The stack's own data address stays allowed (clients connect directly).
        assert!(check(&GOOD.replace("198.18.100.1:7", "198.18.2.11:7")).is_ok());
    }

    /// A sidecar backend at the stack's own address or at a service
    /// address is the user-space stack's, never answered by the kernel's
    /// application: refused, naming the field (it was accepted).
    #[test]
    fn a_backend_the_stack_owns_is_refused() {
        let side = |backend: &str| {
            format!(
                "{GOOD}[[service]]\nlisten = \"198.18.100.1:443\"\napp = \"sidecar\"\nbackend = \"{backend}\"\nprotocol = \"raw\"\n"
            )
        };
        assert!(check(&side("127.0.0.1:8080")).is_ok());
        // Another host's application: allowed (the kernel routes it).
        assert!(check(&side("10.1.2.3:8080")).is_ok());
        let e = check(&side("198.18.2.11:8080")).unwrap_err();
        assert!(
            e.contains("service[2].backend = 198.18.2.11:8080: is the stack's data address (stack.address)")
                && e.contains("127.0.0.1:8080"),
            "{e}"
        );
        let e = check(&side("198.18.100.1:443")).unwrap_err();
        assert!(
            e.contains(
                "service[2].backend = 198.18.100.1:443: is a service address (service[0].listen)"
            ),
            "{e}"
        );
    }

    /// The snapshot limit covers both queues and, with a sidecar, the
    /// most client bytes a relay holds (its `max_request_bytes` and one
    /// read); without a sidecar it is the queues alone, as before.
    #[test]
    fn the_snapshot_limit_covers_a_sidecars_largest_request() {
        let queues = 2 * (256 << 10) + 4096;
        assert_eq!(check(GOOD).unwrap().max_snapshot_bytes(), queues);
        let side = |extra: &str| {
            format!(
                "{GOOD}[[service]]\nlisten = \"198.18.100.1:443\"\napp = \"sidecar\"\nbackend = \"127.0.0.1:8080\"\nprotocol = \"http1\"\n{extra}"
            )
        };
        let c = check(&side("")).unwrap();
        assert!(c.max_snapshot_bytes() >= queues + (1 << 20) + (64 << 10));
        let c = check(&side("max_request_bytes = 67108864\n")).unwrap();
        assert!(c.max_snapshot_bytes() >= queues + (64 << 20) + (64 << 10));
    }

    #[test]
    fn a_top_level_key_after_a_section_is_explained() {
        // `name` appended at the end lands in [[service]].
        let e = check(&format!("{GOOD}name = \"s9\"\n")).unwrap_err();
        assert!(
            e.contains("unknown field `name`")
                && e.contains("top-level key")
                && e.contains("move `name` above"),
            "{e}"
        );
        // A key unknown everywhere gets no such hint.
        let e = check(&format!("{GOOD}nme = \"s9\"\n")).unwrap_err();
        assert!(e.contains("nme") && !e.contains("top-level"), "{e}");
    }

    #[test]
    fn health_checks_default_on_and_are_bounded() {
        let h = check(GOOD).unwrap().health;
        assert_eq!(h, HealthConfig::default());
        assert!(h.enabled);
        assert_eq!(
            (h.interval_ms, h.timeout_ms, h.fall, h.rise),
            (500, 250, 2, 2)
        );
        let c = check(&format!(
            "{GOOD}[health]\nenabled = false\ninterval_ms = 100\nfall = 1\n"
        ))
        .unwrap();
        assert!(!c.health.enabled);
        assert_eq!(
            (c.health.interval_ms, c.health.fall, c.health.rise),
            (100, 1, 2)
        );
        let e = check(&format!("{GOOD}[health]\nfall = 0\n")).unwrap_err();
        assert!(e.contains("health.fall = 0: must be 1 to 100"), "{e}");
        let e = check(&format!("{GOOD}[health]\ninterval_ms = 5\n")).unwrap_err();
        assert!(e.contains("health.interval_ms = 5"), "{e}");
        let e = check(&format!("{GOOD}[health]\nintervl_ms = 5\n")).unwrap_err();
        assert!(e.contains("intervl_ms"), "{e}");
    }

    #[test]
    fn shutdown_drain_timeout_defaults_to_20_s_and_is_bounded() {
        assert_eq!(check(GOOD).unwrap().shutdown.drain_timeout_ms, 20_000);
        let c = check(&format!("{GOOD}[shutdown]\ndrain_timeout_ms = 0\n")).unwrap();
        assert_eq!(c.shutdown.drain_timeout_ms, 0);
        let c = check(&format!("{GOOD}[shutdown]\ndrain_timeout_ms = 1500\n")).unwrap();
        assert_eq!(c.shutdown.drain_timeout_ms, 1500);
        let e = check(&format!("{GOOD}[shutdown]\ndrain_timeout_ms = 3600001\n")).unwrap_err();
        assert!(
            e.contains("shutdown.drain_timeout_ms = 3600001: must be 0 (stop at once)"),
            "{e}"
        );
        let e = check(&format!("{GOOD}[shutdown]\ndrain_timeout_ms = -1\n")).unwrap_err();
        assert!(e.contains("drain_timeout_ms"), "{e}");
        let e = check(&format!("{GOOD}[shutdown]\ndrain_timeout = 5\n")).unwrap_err();
        assert!(e.contains("drain_timeout"), "{e}");
        let e = check(&format!("{GOOD}[shutdown]\ndrain_timeout_ms = \"20s\"\n")).unwrap_err();
        assert!(e.contains("drain_timeout_ms"), "{e}");
    }

    #[test]
    fn reply_spin_defaults_off_and_is_bounded() {
        let mig = |extra: &str| {
            format!(
                "{GOOD}[migration]\nkey = \"{}\"\nswitch = \"198.18.1.1\"\n{extra}",
                "ab".repeat(16)
            )
        };
        assert_eq!(check(&mig("")).unwrap().migration.unwrap().reply_spin_us, 0);
        let c = check(&mig("reply_spin_us = 100\n")).unwrap();
        assert_eq!(c.migration.unwrap().reply_spin_us, 100);
        let e = check(&mig("reply_spin_us = 1001\n")).unwrap_err();
        assert!(e.contains("migration.reply_spin_us = 1001"), "{e}");
    }

    #[test]
    fn keepalive_defaults_on_and_reaches_the_stack() {
        let c = check(GOOD).unwrap();
        assert_eq!(c.tcp, TcpSection::default());
        let ka = c.tcp.keepalive().expect("on by default");
        assert_eq!(ka.idle.as_millis(), 300_000);
        assert_eq!(ka.interval.as_millis(), 30_000);
        assert_eq!(ka.probes, 5);
        let c = check(&format!(
            "{GOOD}[tcp]\nkeepalive_idle_ms = 1000\nkeepalive_interval_ms = 300\nkeepalive_probes = 3\n"
        ))
        .unwrap();
        let ka = c.tcp.keepalive().unwrap();
        assert_eq!(
            (ka.idle.as_millis(), ka.interval.as_millis(), ka.probes),
            (1000, 300, 3)
        );
        let c = check(&format!("{GOOD}[tcp]\nkeepalive = false\n")).unwrap();
        assert_eq!(c.tcp.keepalive(), None);
    }

    #[test]
    fn keepalive_bounds_and_keys_are_checked() {
        let tcp = |line: &str| check(&format!("{GOOD}[tcp]\n{line}\n")).unwrap_err();
        let e = tcp("keepalive_idle_ms = 99");
        assert!(
            e.ends_with("tcp.keepalive_idle_ms = 99: must be 100 to 86400000"),
            "{e}"
        );
        let e = tcp("keepalive_interval_ms = 0");
        assert!(
            e.ends_with("tcp.keepalive_interval_ms = 0: must be 100 to 3600000"),
            "{e}"
        );
        let e = tcp("keepalive_probes = 0");
        assert!(
            e.ends_with("tcp.keepalive_probes = 0: must be 1 to 100"),
            "{e}"
        );
        let e = tcp("keepalive_probes = 101");
        assert!(e.contains("tcp.keepalive_probes = 101"), "{e}");
        // Off, the values are still checked.
        let e = tcp("keepalive = false\nkeepalive_probes = 0");
        assert!(e.contains("tcp.keepalive_probes = 0"), "{e}");
        let e = tcp("keepalive_idle = 1000");
        assert!(e.contains("unknown field `keepalive_idle`"), "{e}");
        let e = tcp("keepalive = \"yes\"");
        assert!(e.contains("keepalive = \"yes\""), "{e}");
        // The largest values fit what a snapshot carries across a migration.
        let c = check(&format!(
            "{GOOD}[tcp]\nkeepalive_idle_ms = 86400000\nkeepalive_interval_ms = 3600000\nkeepalive_probes = 100\n"
        ))
        .unwrap();
        let ka = c.tcp.keepalive().unwrap();
        assert!(ka.idle.as_micros() <= u128::from(capybara_tcp::snapshot::MAX_MICROS));
        assert!(ka.probes <= capybara_tcp::snapshot::MAX_COUNT);
    }
}
