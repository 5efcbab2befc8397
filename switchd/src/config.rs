//! switchd's TOML configuration: serde with defaults, then [`Config::validate`],
//! which names the offending field and value. `switchd --check` runs exactly
//! this and exits.
//!
//! ```toml
//! control_listen = "198.18.1.1:7692"   # server-side address; PREPAREs go here too
//! key_file = "/etc/capybara/deployment.key"  # hex, >= 16 bytes
//! placement = "maglev"                 # or "lwrr"
//! target_selection = "round_robin"     # by pool weight; or "least_loaded" (per unit of weight)
//! load_interval_us = 1000
//! heartbeat_interval_ms = 100
//! dead_after_ms = 500
//! dead_flow_grace_ms = 10000           # a dead server's flows kept this long for it to come back
//! closed_linger_ms = 5000
//! service_retire_timeout_ms = 300000   # a deleted service's open connections kept at most this long
//! embryonic_timeout_ms = 10000         # SYN seen, never established: reaped after this
//! metrics_listen = "127.0.0.1:9102"
//! store = "sqlite:/var/lib/capybara/store.db"   # or "etcd:http://a:2379,http://b:2379"
//!
//! [[interfaces]]
//! name = "cl1"
//! role = "client"
//!
//! [[services]]
//! name = "web"
//! vip = "198.18.100.1:80"
//! pool = [{ server = 1, weight = 1 }]   # or [1, 2]; empty: every registered server
//!
//! [ha]
//! enabled = true
//! election = "switchd"
//! lease_ttl_ms = 1000
//! flow_sync_interval_ms = 500
//! ```

use std::collections::BTreeSet;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use crate::control::{Placement, TargetPolicy};

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config {path}: {err}")]
    Read { path: String, err: std::io::Error },
    #[error("config {path}: {err}")]
    Parse { path: String, err: String },
    #[error("config field `{field}` = {value}: {reason}")]
    Invalid {
        field: String,
        value: String,
        reason: String,
    },
}

/// A `ConfigError::Invalid` naming the field, the value and what is wrong.
pub fn invalid(
    field: impl Into<String>,
    value: impl std::fmt::Display,
    reason: impl Into<String>,
) -> ConfigError {
    ConfigError::Invalid {
        field: field.into(),
        value: value.to_string(),
        reason: reason.into(),
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    Client,
    Server,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InterfaceConfig {
    pub name: String,
    pub role: Role,
}

/// A pool member: `{ server = 1, weight = 2 }`, or a bare server id
/// (`pool = [1, 2]`, weight 1), the form the REST API and `capybara ctl
/// service add --pool 1,2` take (a bare id was refused with "expected a
/// table", which did not say what a member looks like).
#[derive(Debug, Clone, Copy)]
pub struct PoolMember {
    pub server: u32,
    pub weight: u32,
}

/// The ranges in the type errors (`expected an integer from 1 to 65535`)
/// are the ones `Config::validate` states.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PoolMemberTable {
    #[serde(deserialize_with = "capybara_confkit::int_in::<_, _, 1, 4294967295>")]
    server: u32,
    #[serde(
        default = "one",
        deserialize_with = "capybara_confkit::int_in::<_, _, 1, 65535>"
    )]
    weight: u32,
}

impl<'de> Deserialize<'de> for PoolMember {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Member;
        impl<'de> serde::de::Visitor<'de> for Member {
            type Value = PoolMember;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a server id or a table { server = ID, weight = W }")
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<PoolMember, E> {
                match u32::try_from(v) {
                    Ok(server) => Ok(PoolMember { server, weight: 1 }),
                    Err(_) => Err(E::invalid_value(serde::de::Unexpected::Signed(v), &self)),
                }
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<PoolMember, E> {
                match u32::try_from(v) {
                    Ok(server) => Ok(PoolMember { server, weight: 1 }),
                    Err(_) => Err(E::invalid_value(serde::de::Unexpected::Unsigned(v), &self)),
                }
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, m: A) -> Result<PoolMember, A::Error> {
                let t =
                    PoolMemberTable::deserialize(serde::de::value::MapAccessDeserializer::new(m))?;
                Ok(PoolMember {
                    server: t.server,
                    weight: t.weight,
                })
            }
        }
        d.deserialize_any(Member)
    }
}

fn one() -> u32 {
    1
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServiceConfig {
    pub name: String,
    /// `VIP:port`.
    pub vip: String,
    /// Servers and weights. Empty: every registered server, with the weight
    /// of its REGISTER. A server not listed also joins if its REGISTER names
    /// this VIP:port.
    #[serde(default)]
    pub pool: Vec<PoolMember>,
    /// Overrides the global placement for this service.
    pub placement: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HaConfig {
    pub enabled: bool,
    pub election: String,
    /// Name of this instance in the election (default: hostname-pid).
    pub candidate: Option<String>,
    pub lease_ttl_ms: u64,
    pub flow_sync_interval_ms: u64,
    /// Same-box standby: take over as soon as the active's XDP programs
    /// vanish from every interface, before its lease expires (the
    /// interfaces fence a live active out). Cross-box pairs never see each
    /// other's programs and always wait for the lease.
    pub fast_takeover: bool,
    /// On becoming active, send a gratuitous ARP for every VIP out of every
    /// client-side interface (claims the service addresses where clients
    /// share an L2 segment with the switch pair).
    pub claim_vips: bool,
    /// bpffs directory under which the XDP links are pinned, one directory
    /// per network namespace and election (`<pin_dir>/net<inode>-<election>`),
    /// so that the program keeps forwarding after its process dies and a
    /// successor (standby, or this switchd restarted) replaces it in place
    /// without a gap. Applies with HA off too (a restarted switchd). Empty:
    /// no pinning (links die with the process, as before 2026-11-24). Not on
    /// a bpffs mount in this mount namespace (e.g. under `ip netns exec`,
    /// which mounts a fresh /sys): logged, no pinning.
    pub pin_dir: String,
}

/// Default `ha.pin_dir`.
pub const DEFAULT_PIN_DIR: &str = "/sys/fs/bpf/capybara";

impl Default for HaConfig {
    fn default() -> Self {
        HaConfig {
            enabled: false,
            election: "switchd".into(),
            candidate: None,
            lease_ttl_ms: 1000,
            flow_sync_interval_ms: 500,
            fast_takeover: true,
            claim_vips: false,
            pin_dir: DEFAULT_PIN_DIR.into(),
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawConfig {
    pub control_listen: String,
    pub key_file: PathBuf,
    #[serde(default = "d_placement")]
    pub placement: String,
    #[serde(default = "d_target")]
    pub target_selection: String,
    #[serde(default = "d_load_interval")]
    pub load_interval_us: u64,
    #[serde(default = "d_heartbeat")]
    pub heartbeat_interval_ms: u64,
    #[serde(default = "d_dead_after")]
    pub dead_after_ms: u64,
    /// A DEAD server's flow entries are kept this long (0: removed at
    /// once): one that stalled and comes back within it loses no connection.
    #[serde(default = "d_dead_flow_grace")]
    pub dead_flow_grace_ms: u64,
    #[serde(default = "d_linger")]
    pub closed_linger_ms: u64,
    /// A service deleted from the store places no new connection; its open
    /// connections are kept until they end, at most this long (0: they end
    /// with it at once).
    #[serde(default = "d_retire")]
    pub service_retire_timeout_ms: u64,
    /// A flow that saw a SYN and no further client segment is removed (flow
    /// entry and store mapping) once this old.
    #[serde(default = "d_embryonic")]
    pub embryonic_timeout_ms: u64,
    #[serde(default = "d_metrics")]
    pub metrics_listen: String,
    #[serde(default)]
    pub store: Option<String>,
    /// The range in its type error is the one `validate` states.
    #[serde(
        default = "d_max_flows",
        deserialize_with = "capybara_confkit::int_in::<_, _, 1024, { crate::abi::MAX_FLOWS as i128 * 8 }>"
    )]
    pub max_flows: u32,
    /// `native` (default) or `generic` (SKB mode: needed where redirected
    /// frames must leave through veths whose peers run no XDP, e.g. docker).
    #[serde(default = "d_xdp_mode")]
    pub xdp_mode: String,
    #[serde(default)]
    pub interfaces: Vec<InterfaceConfig>,
    #[serde(default)]
    pub services: Vec<ServiceConfig>,
    #[serde(default)]
    pub ha: HaConfig,
}

fn d_placement() -> String {
    "maglev".into()
}
fn d_target() -> String {
    "round_robin".into()
}
fn d_load_interval() -> u64 {
    1000
}
fn d_heartbeat() -> u64 {
    100
}
fn d_dead_after() -> u64 {
    500
}
fn d_dead_flow_grace() -> u64 {
    crate::control::DEFAULT_DEAD_FLOW_GRACE.as_millis() as u64
}
fn d_linger() -> u64 {
    5000
}
fn d_retire() -> u64 {
    crate::control::DEFAULT_SERVICE_RETIRE_TIMEOUT.as_millis() as u64
}
fn d_embryonic() -> u64 {
    10_000
}
fn d_metrics() -> String {
    "127.0.0.1:9102".into()
}
fn d_xdp_mode() -> String {
    "native".into()
}
fn d_max_flows() -> u32 {
    crate::abi::MAX_FLOWS
}

/// The keys of a switchd config's top level (`RawConfig`'s fields).
pub const TOP_LEVEL_KEYS: &[&str] = &[
    "control_listen",
    "key_file",
    "placement",
    "target_selection",
    "load_interval_us",
    "heartbeat_interval_ms",
    "dead_after_ms",
    "dead_flow_grace_ms",
    "closed_linger_ms",
    "service_retire_timeout_ms",
    "embryonic_timeout_ms",
    "metrics_listen",
    "store",
    "max_flows",
    "xdp_mode",
    "interfaces",
    "services",
    "ha",
];

/// Where flow mappings, servers and the leader lease live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreSpec {
    Sqlite(PathBuf),
    Etcd(Vec<String>),
}

impl StoreSpec {
    pub fn parse(s: &str) -> Result<Self, ConfigError> {
        if let Some(p) = s.strip_prefix("sqlite:") {
            if p.is_empty() {
                return Err(invalid(
                    "store",
                    format!("{s:?}"),
                    "sqlite: needs a file path",
                ));
            }
            return Ok(StoreSpec::Sqlite(PathBuf::from(p)));
        }
        if let Some(list) = s.strip_prefix("etcd:") {
            let eps: Vec<String> = list
                .split(',')
                .map(|e| e.trim().to_string())
                .filter(|e| !e.is_empty())
                .collect();
            if eps.is_empty() {
                return Err(invalid(
                    "store",
                    format!("{s:?}"),
                    "etcd: needs at least one http:// endpoint",
                ));
            }
            for e in &eps {
                if !(e.starts_with("http://") || e.starts_with("https://")) {
                    return Err(invalid(
                        "store",
                        format!("{e:?}"),
                        "etcd endpoints start with http:// or https://",
                    ));
                }
            }
            return Ok(StoreSpec::Etcd(eps));
        }
        Err(invalid(
            "store",
            format!("{s:?}"),
            "expected `sqlite:PATH` or `etcd:http://a,http://b`",
        ))
    }

    pub fn to_store_config(&self) -> capybara_store::StoreConfig {
        match self {
            StoreSpec::Sqlite(p) => {
                capybara_store::StoreConfig::Sqlite(capybara_store::SqliteConfig {
                    watch_poll_interval_ms: 50,
                    ..capybara_store::SqliteConfig::at(p.clone())
                })
            }
            StoreSpec::Etcd(eps) => capybara_store::StoreConfig::Etcd(capybara_store::EtcdConfig {
                endpoints: eps.clone(),
                ..Default::default()
            }),
        }
    }
}

#[derive(Debug, Clone)]
pub struct Service {
    pub name: String,
    pub vip: SocketAddrV4,
    pub pool: Vec<PoolMember>,
    pub placement: Placement,
}

/// A validated configuration.
#[derive(Debug, Clone)]
pub struct Config {
    pub control_listen: SocketAddrV4,
    pub key_file: PathBuf,
    pub placement: Placement,
    pub target_policy: TargetPolicy,
    pub load_interval: Duration,
    pub heartbeat_interval: Duration,
    pub dead_after: Duration,
    pub dead_flow_grace: Duration,
    pub closed_linger: Duration,
    pub service_retire_timeout: Duration,
    pub embryonic_timeout: Duration,
    pub metrics_listen: SocketAddr,
    pub store: Option<StoreSpec>,
    pub max_flows: u32,
    /// Attach the XDP program in generic (SKB) mode.
    pub xdp_generic: bool,
    pub interfaces: Vec<InterfaceConfig>,
    pub services: Vec<Service>,
    pub ha: HaConfig,
}

fn parse_placement(field: &str, s: &str) -> Result<Placement, ConfigError> {
    match s {
        "maglev" => Ok(Placement::Maglev),
        "lwrr" => Ok(Placement::Lwrr),
        _ => Err(invalid(
            field,
            format!("{s:?}"),
            "expected \"maglev\" or \"lwrr\"",
        )),
    }
}

impl Config {
    pub fn load(path: &std::path::Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|err| ConfigError::Read {
            path: path.display().to_string(),
            err,
        })?;
        Self::from_toml(&text).map_err(|e| match e {
            ConfigError::Parse { err, .. } => ConfigError::Parse {
                path: path.display().to_string(),
                err,
            },
            e => e,
        })
    }

    /// One line for `switchd --check`: what this config runs, in the
    /// config's words (before: `placement Maglev, store
    /// Some(Sqlite("/x"))`).
    pub fn summary(&self) -> String {
        let store = match &self.store {
            None => "none".to_string(),
            Some(StoreSpec::Sqlite(p)) => format!("sqlite {}", p.display()),
            Some(StoreSpec::Etcd(eps)) => format!("etcd {}", eps.join(",")),
        };
        format!(
            "{} services, {} interfaces, placement {}, store {store}, HA {}",
            self.services.len(),
            self.interfaces.len(),
            format!("{:?}", self.placement).to_lowercase(),
            if self.ha.enabled { "on" } else { "off" }
        )
    }

    pub fn from_toml(text: &str) -> Result<Self, ConfigError> {
        let raw: RawConfig = toml::from_str(text).map_err(|e| {
            // One line, as hostagent's and the appliance's: the message in
            // words (`expected u64` -> `expected a non-negative integer`),
            // the line it is about, and a hint where the cause is a known
            // slip (`[services]` for `[[services]]`).
            let mut err =
                capybara_confkit::parse_error(e.message(), text, e.span().map(|s| s.start));
            // A top-level key written after a [section] or [[section]]
            // header is that section's: its error does not name the cause.
            if let Some(hint) = capybara_confkit::misplaced_key_hint(
                e.message(),
                TOP_LEVEL_KEYS,
                capybara_confkit::Level::TopLevel,
            ) {
                err.push_str(&format!("; {hint}"));
            }
            ConfigError::Parse {
                path: String::new(),
                err,
            }
        })?;
        Self::validate(raw)
    }

    /// Checks every field; the first problem is returned, naming the field.
    pub fn validate(raw: RawConfig) -> Result<Self, ConfigError> {
        let control_listen: SocketAddrV4 = raw.control_listen.parse().map_err(|_| {
            invalid(
                "control_listen",
                format!("{:?}", raw.control_listen),
                "expected IPv4:port",
            )
        })?;
        if control_listen.ip().is_unspecified() {
            // The address is also where servers send PREPAREs: it must be real.
            return Err(invalid(
                "control_listen",
                control_listen,
                "must be the switch's server-side address, not 0.0.0.0",
            ));
        }
        if raw.key_file.as_os_str().is_empty() {
            return Err(invalid(
                "key_file",
                "\"\"",
                "must name the deployment key file",
            ));
        }
        let placement = parse_placement("placement", &raw.placement)?;
        let target_policy = match raw.target_selection.as_str() {
            "round_robin" => TargetPolicy::RoundRobin,
            "least_loaded" => TargetPolicy::LeastLoaded,
            s => {
                return Err(invalid(
                    "target_selection",
                    format!("{s:?}"),
                    "expected \"round_robin\" or \"least_loaded\"",
                ))
            }
        };
        if !(100..=1_000_000).contains(&raw.load_interval_us) {
            return Err(invalid(
                "load_interval_us",
                raw.load_interval_us,
                "must be 100..=1000000",
            ));
        }
        if !(10..=60_000).contains(&raw.heartbeat_interval_ms) {
            return Err(invalid(
                "heartbeat_interval_ms",
                raw.heartbeat_interval_ms,
                "must be 10..=60000",
            ));
        }
        if raw.dead_after_ms < 2 * raw.heartbeat_interval_ms || raw.dead_after_ms > 600_000 {
            return Err(invalid(
                "dead_after_ms",
                raw.dead_after_ms,
                format!(
                    "must be at least 2 x heartbeat_interval_ms ({}) and at most 600000",
                    2 * raw.heartbeat_interval_ms
                ),
            ));
        }
        // At most 10 minutes: past that a Linux client has given up on an
        // unanswered connection anyway (tcp_retries2), and the entries of a
        // server that is really gone only occupy the flow table.
        if raw.dead_flow_grace_ms > 600_000 {
            return Err(invalid(
                "dead_flow_grace_ms",
                raw.dead_flow_grace_ms,
                "must be 0..=600000 (0: a dead server's flows are removed at once)",
            ));
        }
        // At most a day: a connection of a deleted service should not hold
        // its data-plane slot for good.
        if raw.service_retire_timeout_ms > 86_400_000 {
            return Err(invalid(
                "service_retire_timeout_ms",
                raw.service_retire_timeout_ms,
                "must be 0..=86400000 (0: a deleted service's connections end at once)",
            ));
        }
        if raw.closed_linger_ms > 3_600_000 {
            return Err(invalid(
                "closed_linger_ms",
                raw.closed_linger_ms,
                "must be at most 3600000",
            ));
        }
        // At least 1 s: a client's first SYN retransmission comes after 1 s,
        // and a handshake slower than that must not lose its entry.
        if !(1000..=600_000).contains(&raw.embryonic_timeout_ms) {
            return Err(invalid(
                "embryonic_timeout_ms",
                raw.embryonic_timeout_ms,
                "must be 1000..=600000",
            ));
        }
        let metrics_listen: SocketAddr = raw.metrics_listen.parse().map_err(|_| {
            invalid(
                "metrics_listen",
                format!("{:?}", raw.metrics_listen),
                "expected IP:port",
            )
        })?;
        let store = raw.store.as_deref().map(StoreSpec::parse).transpose()?;
        if !(1024..=crate::abi::MAX_FLOWS * 8).contains(&raw.max_flows) {
            return Err(invalid(
                "max_flows",
                raw.max_flows,
                format!("must be 1024..={}", crate::abi::MAX_FLOWS * 8),
            ));
        }
        if raw.interfaces.is_empty() {
            return Err(invalid(
                "interfaces",
                "[]",
                "at least one client and one server interface",
            ));
        }
        let mut names = BTreeSet::new();
        for (i, ifc) in raw.interfaces.iter().enumerate() {
            if ifc.name.is_empty() || ifc.name.len() > 15 || ifc.name.contains(['/', ' ']) {
                return Err(invalid(
                    format!("interfaces[{i}].name"),
                    format!("{:?}", ifc.name),
                    "not a Linux interface name",
                ));
            }
            if !names.insert(ifc.name.clone()) {
                return Err(invalid(
                    format!("interfaces[{i}].name"),
                    format!("{:?}", ifc.name),
                    "listed twice",
                ));
            }
        }
        for role in [Role::Client, Role::Server] {
            if !raw.interfaces.iter().any(|i| i.role == role) {
                let (n, word) = match raw.interfaces.len() {
                    1 => (1, "entry"),
                    n => (n, "entries"),
                };
                let role = match role {
                    Role::Client => "client",
                    Role::Server => "server",
                };
                return Err(invalid(
                    "interfaces",
                    format!("{n} {word}"),
                    format!("no interface with role = \"{role}\""),
                ));
            }
        }
        if raw.interfaces.len() > crate::abi::MAX_IFACES as usize {
            return Err(invalid(
                "interfaces",
                raw.interfaces.len(),
                format!("at most {}", crate::abi::MAX_IFACES),
            ));
        }
        if raw.services.is_empty() && raw.store.is_none() {
            // With a store, the store's services (the API's) are served.
            return Err(invalid(
                "services",
                "[]",
                "at least one service (or a `store`, whose services are served)",
            ));
        }
        if raw.services.len() > crate::abi::MAX_SERVICES as usize {
            return Err(invalid(
                "services",
                raw.services.len(),
                format!("at most {}", crate::abi::MAX_SERVICES),
            ));
        }
        let mut services = Vec::new();
        let mut seen = BTreeSet::new();
        let mut names = BTreeSet::new();
        for (i, s) in raw.services.iter().enumerate() {
            let f = |n: &str| format!("services[{i}].{n}");
            // At most 64: the REST API takes no longer name, so a longer
            // one seeded into the store could be neither edited nor deleted.
            if s.name.is_empty()
                || s.name.len() > 64
                || !s
                    .name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"_.-".contains(&b))
            {
                return Err(invalid(
                    f("name"),
                    format!("{:?}", s.name),
                    "1-64 characters of [A-Za-z0-9_.-] (the REST API's limit)",
                ));
            }
            let vip: SocketAddrV4 = s.vip.parse().map_err(|_| {
                invalid(f("vip"), format!("{:?}", s.vip), "expected VIP:port (IPv4)")
            })?;
            if vip.port() == 0
                || vip.ip().is_unspecified()
                || vip.ip().is_broadcast()
                || vip.ip().is_multicast()
                || vip.ip().is_loopback()
            {
                return Err(invalid(
                    f("vip"),
                    format!("{:?}", s.vip),
                    "needs a unicast, non-loopback address (clients reach it through the switch) and a non-zero port",
                ));
            }
            if !seen.insert(vip) {
                return Err(invalid(
                    f("vip"),
                    format!("{:?}", s.vip),
                    "another service has the same VIP:port",
                ));
            }
            // The switch answers its control channel there: client
            // connections to it would never reach a server.
            if vip.ip() == control_listen.ip() {
                return Err(invalid(
                    f("vip"),
                    format!("{:?}", s.vip),
                    "is switchd's own control_listen address (a VIP must be an address only clients use)",
                ));
            }
            if !names.insert(s.name.as_str()) {
                return Err(invalid(
                    f("name"),
                    format!("{:?}", s.name),
                    "another service has this name",
                ));
            }
            let mut ids = BTreeSet::new();
            for (k, m) in s.pool.iter().enumerate() {
                if m.server == 0 {
                    return Err(invalid(
                        format!("services[{i}].pool[{k}].server"),
                        0,
                        "must be 1..=4294967295 (server ids start at 1)",
                    ));
                }
                if !ids.insert(m.server) {
                    return Err(invalid(
                        format!("services[{i}].pool[{k}].server"),
                        m.server,
                        "listed twice",
                    ));
                }
                if m.weight == 0 || m.weight > 65535 {
                    return Err(invalid(
                        format!("services[{i}].pool[{k}].weight"),
                        m.weight,
                        "must be 1..=65535",
                    ));
                }
            }
            let placement = match &s.placement {
                Some(p) => parse_placement(&f("placement"), p)?,
                None => placement,
            };
            services.push(Service {
                name: s.name.clone(),
                vip,
                pool: s.pool.clone(),
                placement,
            });
        }
        if raw.ha.enabled {
            if store.is_none() {
                return Err(invalid(
                    "ha.enabled",
                    true,
                    "HA needs a `store` (the lease and flow table live there)",
                ));
            }
            let e = &raw.ha.election;
            if e.is_empty()
                || e.len() > 128
                || !e
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"_.-".contains(&b))
            {
                return Err(invalid(
                    "ha.election",
                    format!("{e:?}"),
                    "1-128 characters of [A-Za-z0-9_.-]",
                ));
            }
            if let Some(c) = &raw.ha.candidate {
                if c.is_empty() || c.len() > 256 {
                    return Err(invalid(
                        "ha.candidate",
                        format!("{c:?}"),
                        "must be 1-256 bytes",
                    ));
                }
            }
            if !(1000..=60_000).contains(&raw.ha.lease_ttl_ms) {
                return Err(invalid(
                    "ha.lease_ttl_ms",
                    raw.ha.lease_ttl_ms,
                    "must be 1000..=60000 (the store counts whole seconds)",
                ));
            }
            if !(50..=60_000).contains(&raw.ha.flow_sync_interval_ms) {
                return Err(invalid(
                    "ha.flow_sync_interval_ms",
                    raw.ha.flow_sync_interval_ms,
                    "must be 50..=60000",
                ));
            }
        }
        // Checked whether HA is on or not: pinning applies to a lone
        // switchd too (a restart takes over what a crash left forwarding).
        let pin = &raw.ha.pin_dir;
        if !pin.is_empty()
            && (!pin.starts_with('/') || pin.len() > 200 || pin.split('/').any(|c| c == ".."))
        {
            return Err(invalid(
                "ha.pin_dir",
                format!("{pin:?}"),
                "an absolute path of at most 200 bytes without `..` (or \"\" for no pinning)",
            ));
        }
        let xdp_generic = match raw.xdp_mode.as_str() {
            "native" => false,
            "generic" => true,
            other => {
                return Err(invalid(
                    "xdp_mode",
                    format!("{other:?}"),
                    "expected \"native\" or \"generic\"",
                ))
            }
        };
        Ok(Config {
            control_listen,
            key_file: raw.key_file,
            placement,
            target_policy,
            load_interval: Duration::from_micros(raw.load_interval_us),
            heartbeat_interval: Duration::from_millis(raw.heartbeat_interval_ms),
            dead_after: Duration::from_millis(raw.dead_after_ms),
            dead_flow_grace: Duration::from_millis(raw.dead_flow_grace_ms),
            closed_linger: Duration::from_millis(raw.closed_linger_ms),
            service_retire_timeout: Duration::from_millis(raw.service_retire_timeout_ms),
            embryonic_timeout: Duration::from_millis(raw.embryonic_timeout_ms),
            metrics_listen,
            store,
            max_flows: raw.max_flows,
            xdp_generic,
            interfaces: raw.interfaces,
            services,
            ha: raw.ha,
        })
    }

    /// The deployment key, from `key_file` (hex).
    pub fn load_key(&self) -> Result<capybara_proto::MigrationKey, ConfigError> {
        let text = std::fs::read_to_string(&self.key_file).map_err(|e| {
            invalid(
                "key_file",
                self.key_file.display(),
                format!("cannot read: {e}"),
            )
        })?;
        capybara_proto::MigrationKey::from_hex(&text)
            .map_err(|e| invalid("key_file", self.key_file.display(), e.to_string()))
    }

    /// The warning for a key file group or others may read (logged at
    /// start and by `--check`; not refused, see confkit).
    pub fn key_file_warning(&self) -> Option<String> {
        capybara_confkit::key_file_mode_warning(&self.key_file)
    }

    /// What `--check` verifies on disk beyond the key: a SQLite store's
    /// file must be creatable (its directory exists; switchd creates the
    /// file, not directories) and must not be a directory. Before, `--check`
    /// passed both and the daemon then failed to open the store.
    pub fn check_files(&self) -> Result<(), ConfigError> {
        let Some(StoreSpec::Sqlite(file)) = &self.store else {
            return Ok(());
        };
        let value = format!("\"sqlite:{}\"", file.display());
        if file.is_dir() {
            return Err(invalid("store", value, "is a directory, not a file"));
        }
        let dir = file
            .parent()
            .filter(|d| !d.as_os_str().is_empty())
            .unwrap_or(std::path::Path::new("."));
        match capybara_confkit::missing_dir_reason(dir) {
            None => Ok(()),
            Some(reason) => Err(invalid("store", value, reason)),
        }
    }

    /// The switch's address on the server side.
    pub fn switch_addr(&self) -> Ipv4Addr {
        *self.control_listen.ip()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const OK: &str = r#"
control_listen = "198.18.1.1:7692"
key_file = "/tmp/k"
store = "sqlite:/tmp/s.db"
[[interfaces]]
name = "cl1"
role = "client"
[[interfaces]]
name = "sv1"
role = "server"
[[services]]
name = "web"
vip = "198.18.100.1:80"
pool = [{ server = 1, weight = 2 }, { server = 2 }]
"#;

    fn err(text: &str) -> String {
        Config::from_toml(text).unwrap_err().to_string()
    }

    #[test]
    fn valid_config_has_defaults() {
        let c = Config::from_toml(OK).unwrap();
        assert_eq!(c.load_interval, Duration::from_millis(1));
        assert_eq!(c.placement, Placement::Maglev);
        assert_eq!(c.services[0].pool[1].weight, 1);
        assert_eq!(c.store, Some(StoreSpec::Sqlite("/tmp/s.db".into())));
        assert_eq!(c.embryonic_timeout, Duration::from_secs(10));
        assert_eq!(c.dead_flow_grace, Duration::from_secs(10));
        assert_eq!(c.service_retire_timeout, Duration::from_secs(300));
    }

    #[test]
    fn ha_pin_dir_is_validated() {
        assert_eq!(Config::from_toml(OK).unwrap().ha.pin_dir, DEFAULT_PIN_DIR);
        let with = |v: &str| format!("{OK}\n[ha]\npin_dir = {v:?}\n");
        assert_eq!(Config::from_toml(&with("")).unwrap().ha.pin_dir, "");
        for bad in ["relative/dir", "/sys/fs/bpf/../etc"] {
            let e = err(&with(bad));
            assert!(
                e.contains("`ha.pin_dir`") && e.contains("absolute path"),
                "{e}"
            );
        }
    }

    #[test]
    fn service_retire_timeout_is_validated() {
        let with = |v: &str| {
            OK.replace(
                "key_file",
                &format!("service_retire_timeout_ms = {v}\nkey_file"),
            )
        };
        assert_eq!(
            Config::from_toml(&with("0"))
                .unwrap()
                .service_retire_timeout,
            Duration::ZERO
        );
        let e = err(&with("86400001"));
        assert!(
            e.contains("`service_retire_timeout_ms`") && e.contains("0..=86400000"),
            "{e}"
        );
    }

    #[test]
    fn dead_flow_grace_is_validated() {
        let with = |v: &str| OK.replace("key_file", &format!("dead_flow_grace_ms = {v}\nkey_file"));
        assert_eq!(
            Config::from_toml(&with("0")).unwrap().dead_flow_grace,
            Duration::ZERO
        );
        assert_eq!(
            Config::from_toml(&with("600000")).unwrap().dead_flow_grace,
            Duration::from_secs(600)
        );
        let e = err(&with("600001"));
        assert!(
            e.contains("`dead_flow_grace_ms`") && e.contains("600001") && e.contains("0..=600000"),
            "{e}"
        );
        let e = err(&with("-1"));
        assert!(e.contains("dead_flow_grace_ms"), "{e}");
    }

    #[test]
    fn service_names_fit_the_api() {
        let named = |n: &str| OK.replace("name = \"web\"", &format!("name = \"{n}\""));
        assert!(Config::from_toml(&named(&"a".repeat(64))).is_ok());
        let e = err(&named(&"a".repeat(65)));
        assert!(
            e.contains("services[0].name") && e.contains("1-64 characters"),
            "{e}"
        );
        let e = err(&named("web site"));
        assert!(e.contains("services[0].name"), "{e}");
    }

    #[test]
    fn a_top_level_key_after_a_table_is_explained() {
        // Appended at the end, after [[services]]: TOML files it there.
        let e = err(&format!("{OK}dead_after_ms = 1000\n"));
        assert!(
            e.contains("unknown field `dead_after_ms`")
                && e.contains("top-level key")
                && e.contains("move `dead_after_ms` above"),
            "{e}"
        );
        // The same key at the top is fine, and a key unknown everywhere
        // gets no hint.
        assert!(Config::from_toml(&format!("dead_after_ms = 1000\n{OK}")).is_ok());
        let e = err(&format!("{OK}dead_aftr_ms = 1000\n"));
        assert!(
            e.contains("dead_aftr_ms") && !e.contains("top-level"),
            "{e}"
        );
    }

    #[test]
    fn top_level_keys_match_the_raw_config() {
        // serde lists every field of RawConfig in an unknown-field error.
        let e = err(&format!("zz_unknown = 1\n{OK}"));
        let listed: Vec<&str> = e
            .split("expected one of ")
            .nth(1)
            .unwrap_or("")
            .split(" (line ")
            .next()
            .unwrap_or("")
            .split(", ")
            .map(|k| k.trim_matches('`'))
            .collect();
        assert_eq!(listed, TOP_LEVEL_KEYS, "{e}");
    }

    #[test]
    fn shipped_lab_config_is_valid() {
        let c = Config::from_toml(include_str!("../config/lab.toml")).unwrap();
        assert_eq!(c.interfaces.len(), 4);
        assert!(c.services[0].pool.is_empty());
    }

    #[test]
    fn type_errors_name_kinds_of_values() {
        let e = err(&OK.replace(
            "control_listen = \"198.18.1.1:7692\"",
            "control_listen = \"198.18.1.1:7692\"\nload_interval_us = \"1ms\"",
        ));
        assert!(
            e.contains("invalid type: string \"1ms\", expected a non-negative integer"),
            "{e}"
        );
    }

    /// `[services]` (one table) where `[[services]]` (one table per
    /// service) is meant: the error is one line naming the line and the
    /// fix, not serde's "expected an array" alone.
    #[test]
    fn a_table_written_for_a_list_names_the_fix() {
        let e = err(&OK.replace("[[services]]", "[services]"));
        assert_eq!(
            e,
            "config : invalid type: table, expected an array (line 11: [services]); \
             `services` is a list: write each entry as a [[services]] table, not one [services]"
        );
        let e = err(&OK.replace(
            "[[interfaces]]\nname = \"cl1\"\nrole = \"client\"\n[[interfaces]]",
            "[interfaces]",
        ));
        assert!(
            e.contains("write each entry as a [[interfaces]] table"),
            "{e}"
        );
        let e = err(&OK.replace(
            "pool = [{ server = 1, weight = 2 }, { server = 2 }]",
            "pool = 1",
        ));
        assert!(
            e.ends_with(
                "(line 14: pool = 1); `pool` is a list: write its value in brackets, pool = [...]"
            ),
            "{e}"
        );
    }

    /// Where validation refuses part of an integer type's range, the type
    /// error names the valid range, not the type's (`expected u32` read
    /// "an integer from 0 to 4294967295", and 0 was then refused).
    #[test]
    fn type_errors_and_refusals_name_the_same_range() {
        let pool = "[{ server = 1, weight = 2 }, { server = 2 }]";
        for (bad_type, bad_value, range) in [
            (
                "[{ server = \"1\" }]",
                "[{ server = 0 }]",
                ("1 to 4294967295", "1..=4294967295"),
            ),
            (
                "[{ server = 1, weight = -1 }]",
                "[{ server = 1, weight = 0 }]",
                ("1 to 65535", "1..=65535"),
            ),
        ] {
            let e = err(&OK.replace(pool, bad_type));
            assert!(
                e.contains(&format!("expected an integer from {}", range.0)),
                "{e}"
            );
            let e = err(&OK.replace(pool, bad_value));
            assert!(e.contains(&format!("must be {}", range.1)), "{e}");
        }
        let flows = |v: &str| OK.replace("key_file", &format!("max_flows = {v}\nkey_file"));
        let max = crate::abi::MAX_FLOWS * 8;
        let e = err(&flows("\"lots\""));
        assert!(
            e.contains(&format!("invalid type: string \"lots\", expected an integer from 1024 to {max} (line 3: max_flows = \"lots\")")),
            "{e}"
        );
        let e = err(&flows("-1"));
        assert!(
            e.contains(&format!("expected an integer from 1024 to {max}")),
            "{e}"
        );
        let e = err(&flows("0"));
        assert!(
            e.contains(&format!("`max_flows` = 0: must be 1024..={max}")),
            "{e}"
        );
    }

    #[test]
    fn the_check_summary_reads_as_the_config() {
        let c = Config::from_toml(OK).unwrap();
        let s = c.summary();
        assert!(
            s.contains("placement maglev, store sqlite /tmp/s.db, HA off"),
            "{s}"
        );
    }

    #[test]
    fn check_refuses_a_sqlite_store_that_cannot_be_created() {
        let dir = std::env::temp_dir().join(format!("capybara-swcfg-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let with = |store: &str| {
            Config::from_toml(&OK.replace("sqlite:/tmp/s.db", &format!("sqlite:{store}")))
                .unwrap()
                .check_files()
        };
        assert!(with(&format!("{}/store.db", dir.display())).is_ok());
        let e = with(&format!("{}/missing/store.db", dir.display()))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("`store`") && e.contains("missing/store.db") && e.contains("does not exist"),
            "{e}"
        );
        let e = with(&dir.display().to_string()).unwrap_err().to_string();
        assert!(e.contains("is a directory"), "{e}");
        std::fs::write(dir.join("file"), "").unwrap();
        let e = with(&format!("{}/file/store.db", dir.display()))
            .unwrap_err()
            .to_string();
        assert!(e.contains("is not a directory"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn services_need_their_own_name_and_an_address_of_clients() {
        let e = err(&OK.replace("198.18.100.1:80", "198.18.1.1:80"));
        assert!(
            e.contains("services[0].vip") && e.contains("control_listen"),
            "{e}"
        );
        let two = format!("{OK}[[services]]\nname = \"web\"\nvip = \"198.18.100.7:80\"\n");
        let e = err(&two);
        assert!(
            e.contains("services[1].name") && e.contains("another service has this name"),
            "{e}"
        );
        let other = two.replace(
            "name = \"web\"\nvip = \"198.18.100.7",
            "name = \"api\"\nvip = \"198.18.100.7",
        );
        assert_eq!(Config::from_toml(&other).unwrap().services.len(), 2);
    }

    /// `pool = [1, 2]`, as the REST API and `ctl service add --pool 1,2`
    /// take it; a member that is neither an id nor a table says what a
    /// member looks like.
    #[test]
    fn pool_members_are_ids_or_tables() {
        let c = Config::from_toml(&OK.replace(
            "[{ server = 1, weight = 2 }, { server = 2 }]",
            "[3, { server = 1, weight = 2 }]",
        ))
        .unwrap();
        let pool: Vec<(u32, u32)> = c.services[0]
            .pool
            .iter()
            .map(|m| (m.server, m.weight))
            .collect();
        assert_eq!(pool, [(3, 1), (1, 2)]);
        for bad in ["[\"s1\"]", "[-1]", "[4294967296]", "[{ srv = 1 }]"] {
            let e = err(&OK.replace("[{ server = 1, weight = 2 }, { server = 2 }]", bad));
            assert!(e.contains(&format!("pool = {bad}")), "{bad}: {e}");
            if bad != "[{ srv = 1 }]" {
                assert!(
                    e.contains("a server id or a table { server = ID, weight = W }"),
                    "{bad}: {e}"
                );
            } else {
                assert!(e.contains("srv"), "{bad}: {e}");
            }
        }
    }

    #[test]
    fn errors_name_field_and_value() {
        let e = err(&OK
            .replace("\"maglev\"", "x")
            .replace("key_file", "placement = \"ring\"\nkey_file"));
        assert!(e.contains("`placement`") && e.contains("\"ring\""), "{e}");
        let e = err(&OK.replace("198.18.100.1:80", "198.18.100.1"));
        assert!(
            e.contains("services[0].vip") && e.contains("198.18.100.1"),
            "{e}"
        );
        let e = err(&OK.replace("198.18.100.1:80", "127.0.0.1:80"));
        assert!(
            e.contains("services[0].vip") && e.contains("non-loopback"),
            "{e}"
        );
        let e = err(&OK.replace("weight = 2", "weight = 0"));
        assert!(
            e.contains("services[0].pool[0].weight") && e.contains('0'),
            "{e}"
        );
        let e = err(&OK.replace("sqlite:/tmp/s.db", "mysql://x"));
        assert!(e.contains("`store`") && e.contains("mysql"), "{e}");
        let e = err(&OK.replace("role = \"server\"", "role = \"client\""));
        assert!(e.contains("no interface with role = \"server\""), "{e}");
        let e = err(&format!("{OK}\nbogus = 1\n"));
        assert!(e.contains("bogus"), "{e}");
        let e = err(&OK.replace("key_file", "embryonic_timeout_ms = 999\nkey_file"));
        assert!(
            e.contains("`embryonic_timeout_ms`")
                && e.contains("999")
                && e.contains("1000..=600000"),
            "{e}"
        );
        let e = err(&OK.replace("key_file", "embryonic_timeout_ms = 600001\nkey_file"));
        assert!(e.contains("`embryonic_timeout_ms`"), "{e}");
        let c = Config::from_toml(&OK.replace("key_file", "embryonic_timeout_ms = 2500\nkey_file"))
            .unwrap();
        assert_eq!(c.embryonic_timeout, Duration::from_millis(2500));
        let e = err(&OK.replace("key_file", "dead_after_ms = 50\nkey_file"));
        assert!(e.contains("dead_after_ms") && e.contains("50"), "{e}");
        assert_eq!(
            StoreSpec::parse("etcd:http://a:1, http://b:2").unwrap(),
            StoreSpec::Etcd(vec!["http://a:1".into(), "http://b:2".into()])
        );
    }
}
