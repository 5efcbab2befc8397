//! The appliance's one configuration file: switchd, the API (+ dashboard)
//! and the store, validated together. Every error names the field, e.g.
//! `config field `switchd.services[0].vip` = ...` or `config field
//! `api.listen` = "x": expected IP:port`.
//!
//! ```toml
//! [store]                          # optional: SQLite at state_dir/store.db
//! sqlite = "/var/lib/capybara/store.db"
//! # etcd = ["http://etcd1:2379", "http://etcd2:2379", "http://etcd3:2379"]
//!
//! [api]                            # optional: no section, no API
//! listen = "0.0.0.0:8080"
//! static_dir = "/usr/share/capybara/web-ui"   # the dashboard
//! admin_token_file = "/var/lib/capybara/admin-token"
//! # db = "/var/lib/capybara/api.db"          # tokens (default: state_dir/api.db)
//! # switchd = ["http://127.0.0.1:9102", "http://127.0.0.1:9103"]
//!
//! [switchd]                        # optional: no section, no data plane
//! control_listen = "198.18.1.1:7692"
//! key_file = "/etc/capybara/deployment.key"
//! # ... every field of switchd.toml (docs/SWITCHD.md) except `store`
//! ```
//!
//! Invariants: the store is named once (`[store]`), and switchd gets it from
//! there; at least one of `[api]`, `[switchd]` is present.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use capybara_store::{EtcdConfig, SqliteConfig, StoreConfig};
use capybara_switchd::config::{Config as SwitchdConfig, ConfigError, RawConfig};
use serde::Deserialize;

/// Where state goes when a path is not configured.
pub const DEFAULT_STATE_DIR: &str = "/var/lib/capybara";

use capybara_switchd::config::invalid;
/// The appliance reports config errors exactly like switchd does (fields of
/// the `[switchd]` section are prefixed `switchd.`).
pub use capybara_switchd::config::ConfigError as ApplianceConfigError;

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawStore {
    sqlite: Option<PathBuf>,
    etcd: Option<Vec<String>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawApi {
    #[serde(default = "d_listen")]
    listen: String,
    static_dir: Option<PathBuf>,
    admin_token_file: Option<PathBuf>,
    db: Option<PathBuf>,
    #[serde(default = "d_workers")]
    workers: usize,
    switchd: Option<Vec<String>>,
}

fn d_listen() -> String {
    "127.0.0.1:8080".into()
}
fn d_workers() -> usize {
    2
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawAppliance {
    state_dir: Option<PathBuf>,
    #[serde(default)]
    store: RawStore,
    api: Option<RawApi>,
    /// Read with the rest of the file (not as a table re-read later), so
    /// that its errors name their line as the other sections' do.
    switchd: Option<RawConfig>,
}

/// The keys of the file's top level (`RawAppliance`'s fields).
const TOP_LEVEL_KEYS: &[&str] = &["state_dir", "store", "api", "switchd"];

/// The hint for a key TOML filed under the wrong header (a key belongs to
/// the last `[section]` or `[[section]]` written above it): a top-level key,
/// or a `[switchd]` key written after a `[[switchd.services]]`, `[api]` or
/// `[store]` header. Empty when the error is something else.
fn misplaced_key_hint(message: &str) -> String {
    use capybara_confkit::{misplaced_key_hint as hint, Level};
    hint(message, TOP_LEVEL_KEYS, Level::TopLevel)
        .or_else(|| {
            hint(
                message,
                capybara_switchd::config::TOP_LEVEL_KEYS,
                Level::Section("switchd"),
            )
        })
        .map(|h| format!("; {h}"))
        .unwrap_or_default()
}

/// The field of a `[switchd]` error as the file spells it from the top
/// (`switchd.services[1].vip`), from serde_path_to_error's path; `None`
/// for an error outside the section.
fn switchd_field(path: &serde_path_to_error::Path) -> Option<String> {
    match path.iter().next() {
        Some(serde_path_to_error::Segment::Map { key }) if key == "switchd" => {
            Some(format!("`{path}`"))
        }
        _ => None,
    }
}

/// `run` creates `state_dir` (and its parents) and nothing else: a file
/// the appliance creates (`api.admin_token_file`, `api.db`,
/// `store.sqlite`) needs a directory that exists, or that `run` creates.
fn check_parent_dir(field: &str, file: &Path, state_dir: &Path) -> Result<(), ConfigError> {
    let Some(dir) = file.parent().filter(|d| !d.as_os_str().is_empty()) else {
        return Ok(());
    };
    let value = format!("{:?}", file.display().to_string());
    if state_dir.starts_with(dir) {
        return Ok(());
    }
    let Some(mut reason) = capybara_confkit::missing_dir_reason(dir) else {
        return Ok(());
    };
    if !dir.exists() {
        reason.push_str(&format!(
            " (create it, or name a file in state_dir {})",
            state_dir.display()
        ));
    }
    Err(invalid(field, value, reason))
}

/// The store both components use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreChoice {
    Sqlite(PathBuf),
    Etcd(Vec<String>),
}

/// As an operator reads it: `sqlite /path` or `etcd URL,URL`.
impl std::fmt::Display for StoreChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StoreChoice::Sqlite(p) => write!(f, "sqlite {}", p.display()),
            StoreChoice::Etcd(eps) => write!(f, "etcd {}", eps.join(",")),
        }
    }
}

impl StoreChoice {
    /// switchd's `store` string.
    fn switchd_spec(&self) -> String {
        match self {
            StoreChoice::Sqlite(p) => format!("sqlite:{}", p.display()),
            StoreChoice::Etcd(eps) => format!("etcd:{}", eps.join(",")),
        }
    }

    pub fn store_config(&self) -> StoreConfig {
        match self {
            StoreChoice::Sqlite(p) => StoreConfig::Sqlite(SqliteConfig::at(p.clone())),
            StoreChoice::Etcd(eps) => StoreConfig::Etcd(EtcdConfig {
                endpoints: eps.clone(),
                ..EtcdConfig::default()
            }),
        }
    }
}

#[derive(Debug, Clone)]
pub struct ApiSettings {
    pub listen: SocketAddr,
    pub static_dir: Option<PathBuf>,
    pub admin_token_file: Option<PathBuf>,
    pub db: PathBuf,
    pub workers: usize,
    /// switchd HTTP endpoints; with several, calls go to the active one.
    pub switchd: Vec<String>,
}

#[derive(Debug, Clone)]
pub struct ApplianceConfig {
    pub state_dir: PathBuf,
    pub store: StoreChoice,
    pub api: Option<ApiSettings>,
    pub switchd: Option<SwitchdConfig>,
}

impl ApplianceConfig {
    pub fn load(path: &Path) -> Result<Self, ApplianceConfigError> {
        let text = std::fs::read_to_string(path).map_err(|err| ApplianceConfigError::Read {
            path: path.display().to_string(),
            err,
        })?;
        Self::from_toml(&text).map_err(|e| match e {
            ApplianceConfigError::Parse { err, .. } => ApplianceConfigError::Parse {
                path: path.display().to_string(),
                err,
            },
            e => e,
        })
    }

    pub fn from_toml(text: &str) -> Result<Self, ApplianceConfigError> {
        let raw: RawAppliance = serde_path_to_error::deserialize(toml::Deserializer::new(text))
            .map_err(|e| {
                // One line, as hostagent's and switchd's: the message in
                // words, the line it is about (toml's own text draws it
                // over several) and a hint for a known slip; an error in
                // [switchd] also names its field from the top, index and
                // all (`switchd.services[1].vip`).
                let field = switchd_field(e.path());
                let e = e.into_inner();
                let message =
                    capybara_confkit::parse_error(e.message(), text, e.span().map(|s| s.start));
                let hint = misplaced_key_hint(e.message());
                ApplianceConfigError::Parse {
                    path: String::new(),
                    err: match field {
                        Some(f) => format!("in [switchd]: {f}: {message}{hint}"),
                        None => format!("{message}{hint}"),
                    },
                }
            })?;
        Self::validate(raw)
    }

    fn validate(raw: RawAppliance) -> Result<Self, ApplianceConfigError> {
        let state_dir = raw
            .state_dir
            .unwrap_or_else(|| PathBuf::from(DEFAULT_STATE_DIR));
        if !state_dir.is_absolute() {
            return Err(invalid(
                "state_dir",
                format!("{:?}", state_dir.display().to_string()),
                "must be an absolute path",
            ));
        }
        // `run` would fail on these; `--check` says so first.
        if state_dir.exists() && !state_dir.is_dir() {
            return Err(invalid(
                "state_dir",
                format!("{:?}", state_dir.display().to_string()),
                "exists and is not a directory",
            ));
        }
        let store = match (raw.store.sqlite, raw.store.etcd) {
            (Some(_), Some(_)) => {
                return Err(invalid(
                    "store",
                    "sqlite and etcd",
                    "choose one backend: `sqlite = PATH` or `etcd = [URL, ...]`",
                ))
            }
            (_, Some(eps)) => {
                if eps.is_empty() {
                    return Err(invalid("store.etcd", "[]", "needs at least one endpoint"));
                }
                for (i, ep) in eps.iter().enumerate() {
                    let ok = ep
                        .strip_prefix("http://")
                        .or_else(|| ep.strip_prefix("https://"))
                        .is_some_and(|hp| !hp.is_empty() && !hp.contains([',', ' ', '/']));
                    if !ok {
                        return Err(invalid(
                            format!("store.etcd[{i}]"),
                            format!("{ep:?}"),
                            "expected http://HOST:PORT",
                        ));
                    }
                }
                StoreChoice::Etcd(eps)
            }
            (Some(p), None) => {
                if !p.is_absolute() {
                    return Err(invalid(
                        "store.sqlite",
                        format!("{:?}", p.display().to_string()),
                        "must be an absolute path",
                    ));
                }
                check_parent_dir("store.sqlite", &p, &state_dir)?;
                StoreChoice::Sqlite(p)
            }
            (None, None) => StoreChoice::Sqlite(state_dir.join("store.db")),
        };

        let switchd = match raw.switchd {
            None => None,
            Some(mut raw_sw) => {
                if let Some(s) = &raw_sw.store {
                    return Err(invalid(
                        "switchd.store",
                        format!("{s:?}"),
                        "set the store once, in the [store] section",
                    ));
                }
                raw_sw.store = Some(store.switchd_spec());
                Some(SwitchdConfig::validate(raw_sw).map_err(|e| match e {
                    ConfigError::Invalid {
                        field,
                        value,
                        reason,
                    } => invalid(format!("switchd.{field}"), value, reason),
                    other => ApplianceConfigError::Parse {
                        path: String::new(),
                        err: format!("in [switchd]: {other}"),
                    },
                })?)
            }
        };

        let api = match raw.api {
            None => None,
            Some(a) => {
                let listen: SocketAddr = a.listen.parse().map_err(|_| {
                    invalid("api.listen", format!("{:?}", a.listen), "expected IP:port")
                })?;
                if !(1..=64).contains(&a.workers) {
                    return Err(invalid("api.workers", a.workers, "must be 1..=64"));
                }
                // switchd's HTTP endpoint binds in the same process: `run`
                // would fail on the second bind.
                if let Some(m) = switchd.as_ref().map(|s| s.metrics_listen) {
                    let overlap = m.ip() == listen.ip()
                        || m.ip().is_unspecified()
                        || listen.ip().is_unspecified();
                    if listen.port() != 0 && m.port() == listen.port() && overlap {
                        return Err(invalid(
                            "api.listen",
                            format!("{:?}", a.listen),
                            format!(
                                "switchd.metrics_listen ({m}) takes that port too: give them different ports"
                            ),
                        ));
                    }
                }
                let switchd_urls = match a.switchd {
                    Some(urls) => {
                        for (i, u) in urls.iter().enumerate() {
                            if !u.starts_with("http://") || u.len() <= "http://".len() {
                                return Err(invalid(
                                    format!("api.switchd[{i}]"),
                                    format!("{u:?}"),
                                    "expected http://HOST:PORT",
                                ));
                            }
                        }
                        urls
                    }
                    // The switchd of this process, when there is one.
                    None => switchd
                        .as_ref()
                        .map(|s| {
                            let mut addr = s.metrics_listen;
                            if addr.ip().is_unspecified() {
                                addr.set_ip([127, 0, 0, 1].into());
                            }
                            vec![format!("http://{addr}")]
                        })
                        .unwrap_or_default(),
                };
                if let Some(dir) = &a.static_dir {
                    if !dir.join("index.html").is_file() {
                        return Err(invalid(
                            "api.static_dir",
                            format!("{:?}", dir.display().to_string()),
                            "no index.html there (build the dashboard: bash web-ui/build.sh)",
                        ));
                    }
                }
                if let Some(f) = a.admin_token_file.as_ref().filter(|f| f.is_dir()) {
                    return Err(invalid(
                        "api.admin_token_file",
                        format!("{:?}", f.display().to_string()),
                        "is a directory (name the file the admin token is written to)",
                    ));
                }
                if let Some(f) = &a.admin_token_file {
                    check_parent_dir("api.admin_token_file", f, &state_dir)?;
                }
                if let Some(db) = &a.db {
                    check_parent_dir("api.db", db, &state_dir)?;
                }
                Some(ApiSettings {
                    listen,
                    static_dir: a.static_dir,
                    admin_token_file: a.admin_token_file,
                    db: a.db.unwrap_or_else(|| state_dir.join("api.db")),
                    workers: a.workers,
                    switchd: switchd_urls,
                })
            }
        };
        if api.is_none() && switchd.is_none() {
            return Err(invalid(
                "api, switchd",
                "(both absent)",
                "configure at least one of the [api] and [switchd] sections",
            ));
        }
        Ok(ApplianceConfig {
            state_dir,
            store,
            api,
            switchd,
        })
    }

    /// What `--check` also verifies beyond the file itself: the deployment
    /// key is readable and valid.
    pub fn check_files(&self) -> Result<(), ApplianceConfigError> {
        if let Some(sw) = &self.switchd {
            sw.load_key().map_err(|e| match e {
                ConfigError::Invalid {
                    field,
                    value,
                    reason,
                } => invalid(format!("switchd.{field}"), value, reason),
                other => invalid(
                    "switchd.key_file",
                    format!("{:?}", sw.key_file.display().to_string()),
                    other.to_string(),
                ),
            })?;
        }
        Ok(())
    }

    /// One line for `--check` and the start banner.
    pub fn summary(&self) -> String {
        let store = &self.store;
        let sw = match &self.switchd {
            Some(s) => format!(
                "switchd on {} interface(s), {} service(s), HA {}",
                s.interfaces.len(),
                s.services.len(),
                if s.ha.enabled { "on" } else { "off" }
            ),
            None => "no switchd".into(),
        };
        let api = match &self.api {
            Some(a) => format!(
                "api on {}{}",
                a.listen,
                if a.static_dir.is_some() {
                    " with dashboard"
                } else {
                    ""
                }
            ),
            None => "no api".into(),
        };
        format!("{sw}; {api}; store {store}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SWITCHD: &str = r#"
[switchd]
control_listen = "198.18.1.1:7692"
key_file = "/tmp/k"
[[switchd.interfaces]]
name = "cl1"
role = "client"
[[switchd.interfaces]]
name = "sv1"
role = "server"
[[switchd.services]]
name = "web"
vip = "198.18.100.1:80"
pool = []
"#;

    fn err(text: &str) -> String {
        ApplianceConfig::from_toml(text).unwrap_err().to_string()
    }

    #[test]
    fn defaults_to_sqlite_in_the_state_dir_and_the_local_switchd() {
        let c = ApplianceConfig::from_toml(&format!("[api]\n{SWITCHD}")).unwrap();
        assert_eq!(
            c.store,
            StoreChoice::Sqlite(PathBuf::from("/var/lib/capybara/store.db"))
        );
        let sw = c.switchd.unwrap();
        assert_eq!(
            sw.store,
            Some(capybara_switchd::config::StoreSpec::Sqlite(
                "/var/lib/capybara/store.db".into()
            ))
        );
        // Messages name the store in words (`opening store ...`).
        assert_eq!(c.store.to_string(), "sqlite /var/lib/capybara/store.db");
        let api = c.api.unwrap();
        assert_eq!(api.switchd, vec!["http://127.0.0.1:9102".to_string()]);
        assert_eq!(api.db, PathBuf::from("/var/lib/capybara/api.db"));
    }

    #[test]
    fn etcd_endpoints_reach_switchd() {
        let c = ApplianceConfig::from_toml(&format!(
            "[store]\netcd = [\"http://e1:2379\", \"http://e2:2379\"]\n{SWITCHD}"
        ))
        .unwrap();
        assert!(c.api.is_none());
        assert!(matches!(
            c.switchd.unwrap().store,
            Some(capybara_switchd::config::StoreSpec::Etcd(ref e)) if e.len() == 2
        ));
    }

    #[test]
    fn errors_name_the_field() {
        let e = err("[api]\nlisten = \"nope\"\n");
        assert!(e.contains("`api.listen`") && e.contains("nope"), "{e}");
        let e = err(&SWITCHD.replace("198.18.100.1:80", "198.18.100.1"));
        assert!(e.contains("switchd.services[0].vip"), "{e}");
        let e = err(&SWITCHD.replace("[switchd]\n", "[switchd]\nstore = \"sqlite:/x\"\n"));
        assert!(e.contains("`switchd.store`"), "{e}");
        let e = err("[store]\netcd = [\"e1:2379\"]\n[api]\n");
        assert!(e.contains("`store.etcd[0]`"), "{e}");
        let e = err("[store]\nsqlite = \"/a\"\netcd = [\"http://e:1\"]\n[api]\n");
        assert!(e.contains("`store`"), "{e}");
        let e = err("state_dir = \"/x\"\n");
        assert!(e.contains("at least one"), "{e}");
        let e = err("[api]\nlisten = \"127.0.0.1:1\"\nbogus = 1\n");
        assert!(e.contains("bogus"), "{e}");
        let e = err("[api]\nstatic_dir = \"/nonexistent-capybara\"\n");
        assert!(e.contains("`api.static_dir`"), "{e}");
        let e = err(&SWITCHD.replace("[switchd]\n", "[switchd]\nxdp_mode = \"turbo\"\n"));
        assert!(e.contains("`switchd.xdp_mode`"), "{e}");
        let e = err(&format!("{SWITCHD}colour = 1\n"));
        assert!(e.contains("[switchd]") && e.contains("colour"), "{e}");
        // What `run` would trip over, said by `--check`.
        let e = err("state_dir = \"/proc/self/status\"\n[api]\n");
        assert!(
            e.contains("`state_dir`") && e.contains("not a directory"),
            "{e}"
        );
        let e = err("[api]\nadmin_token_file = \"/tmp\"\n");
        assert!(
            e.contains("`api.admin_token_file`") && e.contains("is a directory"),
            "{e}"
        );
    }

    /// `run` creates state_dir and nothing else: a file elsewhere in a
    /// directory that does not exist fails `run`, so `--check` refuses it.
    #[test]
    fn files_in_missing_directories_are_refused() {
        let tmp = std::env::temp_dir().join(format!("capybara-config-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&tmp);
        std::fs::create_dir_all(&tmp).unwrap();
        let t = tmp.display().to_string();
        let state = format!("state_dir = \"{t}/state\"\n");
        let e = err(&format!(
            "{state}[api]\nadmin_token_file = \"{t}/nope/admin-token\"\n"
        ));
        assert!(
            e.contains("`api.admin_token_file`")
                && e.contains(&format!("directory {t}/nope does not exist")),
            "{e}"
        );
        let e = err(&format!("{state}[api]\ndb = \"{t}/nope/api.db\"\n"));
        assert!(
            e.contains("`api.db`") && e.contains("does not exist"),
            "{e}"
        );
        let e = err(&format!(
            "{state}[store]\nsqlite = \"{t}/nope/store.db\"\n[api]\n"
        ));
        assert!(
            e.contains("`store.sqlite`") && e.contains("does not exist"),
            "{e}"
        );
        // A parent that is a file.
        std::fs::write(tmp.join("file"), "x").unwrap();
        let e = err(&format!(
            "{state}[api]\nadmin_token_file = \"{t}/file/admin-token\"\n"
        ));
        assert!(e.contains(&format!("{t}/file is not a directory")), "{e}");
        // What run creates is fine: state_dir (not there yet) and its
        // parents; and an existing directory.
        for f in [
            format!("{t}/state/admin-token"),
            format!("{t}/admin-token"),
            "admin-token".to_string(),
        ] {
            ApplianceConfig::from_toml(&format!(
                "{state}[store]\nsqlite = \"{t}/state/store.db\"\n[api]\nadmin_token_file = \"{f}\"\ndb = \"{t}/state/api.db\"\n"
            ))
            .unwrap_or_else(|e| panic!("{f}: {e}"));
        }
        std::fs::remove_dir_all(&tmp).unwrap();
    }

    /// `api.listen` on switchd's `metrics_listen` (default
    /// 127.0.0.1:9102) fails `run`'s second bind: `--check` says so.
    #[test]
    fn the_api_and_switchd_http_ports_differ() {
        let e = err(&format!("[api]\nlisten = \"127.0.0.1:9102\"\n{SWITCHD}"));
        assert!(
            e.contains("`api.listen` = \"127.0.0.1:9102\"")
                && e.contains("switchd.metrics_listen (127.0.0.1:9102)"),
            "{e}"
        );
        let e = err(&format!("[api]\nlisten = \"0.0.0.0:9102\"\n{SWITCHD}"));
        assert!(e.contains("`api.listen`"), "{e}");
        for ok in ["127.0.0.1:8080", "127.0.0.2:9102", "127.0.0.1:0"] {
            ApplianceConfig::from_toml(&format!("[api]\nlisten = \"{ok}\"\n{SWITCHD}"))
                .unwrap_or_else(|e| panic!("{ok}: {e}"));
        }
    }

    /// Parse errors are one line naming the line, in words, not Rust
    /// types or toml's drawing of the line.
    #[test]
    fn parse_errors_are_one_line_in_words() {
        let e = err("[api]\nworkers = \"4\"\n");
        assert_eq!(
            e,
            "config : invalid type: string \"4\", expected a non-negative integer (line 2: workers = \"4\")"
        );
        let e = err(&SWITCHD.replace("pool = []", "pool = [true]"));
        assert!(
            e.ends_with(
                "`switchd.services[0].pool[0]`: invalid type: boolean `true`, \
                 expected a server id or a table { server = ID, weight = W } (line 14: pool = [true])"
            ),
            "{e}"
        );
        let e = err("[API]\n");
        assert!(
            e.contains("unknown field `API`") && e.contains("(line 1: [API])") && !e.contains('|'),
            "{e}"
        );
    }

    #[test]
    fn switchd_section_errors_keep_the_array_index() {
        let second = format!(
            "{SWITCHD}[[switchd.services]]\nname = \"api\"\nvip = \"198.18.100.2:80\"\npool = []\n"
        );
        assert!(ApplianceConfig::from_toml(&second).is_ok());
        // A type error in the second service names it, index and all.
        let e = err(&second.replace("vip = \"198.18.100.2:80\"", "vip = 80"));
        assert!(
            e.contains("in [switchd]: `switchd.services[1].vip`: invalid type"),
            "{e}"
        );
        let e = err(&second.replace("pool = []\n", "pool = [\"one\"]\n"));
        assert!(e.contains("`switchd.services[0].pool[0]`"), "{e}");
        // What validation refuses names the index too.
        let e = err(&second.replace("198.18.100.2:80", "198.18.100.2"));
        assert!(e.contains("`switchd.services[1].vip`"), "{e}");
    }

    /// Errors in [switchd] name their line (and its text) as the other
    /// sections' do: the section was re-read from a table, which has no
    /// lines, and its errors named only the field.
    #[test]
    fn switchd_section_errors_name_their_line() {
        let e = err(&SWITCHD.replace("vip = \"198.18.100.1:80\"", "vip = 80"));
        assert_eq!(
            e,
            "config : in [switchd]: `switchd.services[0].vip`: invalid type: integer `80`, \
             expected a string (line 13: vip = 80)"
        );
        let e = err(&SWITCHD.replace("[switchd]\n", "[switchd]\nheartbeat_interval_ms = \"1s\"\n"));
        assert_eq!(
            e,
            "config : in [switchd]: `switchd.heartbeat_interval_ms`: invalid type: string \"1s\", \
             expected a non-negative integer (line 3: heartbeat_interval_ms = \"1s\")"
        );
        // A misplaced key: its line, then the hint.
        let e = err(&format!("{SWITCHD}dead_after_ms = 1000\n"));
        assert!(
            e.contains("unknown field `dead_after_ms`")
                && e.contains(
                    " (line 15: dead_after_ms = 1000); `dead_after_ms` is a key of [switchd]"
                ),
            "{e}"
        );
        // `[switchd.services]` for `[[switchd.services]]`: the fix is named.
        let e = err(&SWITCHD.replace("[[switchd.services]]", "[switchd.services]"));
        assert_eq!(
            e,
            "config : in [switchd]: `switchd.services`: invalid type: table, expected an array \
             (line 11: [switchd.services]); `switchd.services` is a list: write each entry as a \
             [[switchd.services]] table, not one [switchd.services]"
        );
        // A pool member's server id of the wrong type names the range
        // validation holds it to.
        let e = err(&SWITCHD.replace("pool = []", "pool = [{ server = \"1\" }]"));
        assert!(
            e.contains(
                "expected an integer from 1 to 4294967295 (line 14: pool = [{ server = \"1\" }])"
            ),
            "{e}"
        );
        // Outside [switchd], no section is named.
        let e = err("[api]\nlisten = 1\n");
        assert_eq!(
            e,
            "config : invalid type: integer `1`, expected a string (line 2: listen = 1)"
        );
    }

    #[test]
    fn misplaced_keys_are_explained() {
        // A [switchd] key written after [[switchd.services]] lands in the
        // last service.
        let e = err(&format!("{SWITCHD}dead_after_ms = 1000\n"));
        assert!(
            e.contains("switchd.services[0]")
                && e.contains("unknown field `dead_after_ms`")
                && e.contains("`dead_after_ms` is a key of [switchd]")
                && e.contains("move `dead_after_ms` into [switchd]"),
            "{e}"
        );
        // Written in [switchd] itself, it is fine.
        let up = SWITCHD.replace("[switchd]\n", "[switchd]\ndead_after_ms = 1000\n");
        assert!(ApplianceConfig::from_toml(&up).is_ok());
        // A top-level key after [switchd]'s tables, and after [api].
        let e = err(&format!("{SWITCHD}state_dir = \"/srv/capybara\"\n"));
        assert!(
            e.contains("`state_dir` is a top-level key") && e.contains("move `state_dir` above"),
            "{e}"
        );
        let e = err("[api]\nstate_dir = \"/srv/capybara\"\n");
        assert!(e.contains("`state_dir` is a top-level key"), "{e}");
        // A key unknown everywhere gets no hint.
        let e = err(&format!("{SWITCHD}dead_aftr_ms = 1000\n"));
        assert!(
            e.contains("dead_aftr_ms") && !e.contains("is a key of") && !e.contains("top-level"),
            "{e}"
        );
    }

    /// The example shipped with the docker deployment stays valid.
    #[test]
    fn docker_configs_are_valid() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docker/config");
        let Ok(entries) = std::fs::read_dir(&dir) else {
            return;
        };
        for e in entries.flatten() {
            let p = e.path();
            if p.extension().is_some_and(|x| x == "toml") {
                let text = std::fs::read_to_string(&p).unwrap();
                // static_dir exists only inside the image.
                let text = text
                    .lines()
                    .filter(|l| !l.trim_start().starts_with("static_dir"))
                    .collect::<Vec<_>>()
                    .join("\n");
                ApplianceConfig::from_toml(&text)
                    .unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            }
        }
    }
}
