//! `capybara ctl`: the operators' command line, on the generated Rust client
//! (`clients/rust`).
//!
//! ```text
//! capybara ctl [--api URL] [--token TOKEN] COMMAND
//!   servers                               list servers with state, weight, connections
//!   drain SERVER [--deadline 30s] [--force] [--wait]
//!   undrain SERVER
//!   weight SERVER WEIGHT | weight SERVER --clear
//!   connections [--server SERVER] [--service NAME] [--limit N]
//!   migrate CONN [--target SERVER]
//!   policy get | policy set KEY=VALUE...
//!   migrations [--limit N] [--follow [--for 10s]]   the newest N (1000), oldest of them first
//!   audit [--limit N]                     the newest N (20) audit entries, oldest of them first
//!   services                              live services, then the retiring (deleted) ones
//!   service add NAME VIP:PORT [--pool 1,2]   create (empty pool: every server)
//!   service set NAME VIP:PORT [--pool 1,2]   change address (and pool)
//!   service delete NAME                      no new connections; open ones kept until they end
//!   server delete SERVER                  forget a drained or dead server (admin)
//!   ready                                 readiness: the store answers; switchd reachable?
//! ```
//! `--api` and `--token` default to `CAPYBARA_API` and `CAPYBARA_TOKEN`.
//! `capybara ctl COMMAND --help` (or `-h`, or `help COMMAND`) prints that
//! command's usage, arguments, flags and an example ([`COMMAND_HELP`]).
//! A flag the command does not take, or one given twice, is a usage error
//! (a mistyped `--force` must not start a `migrate` drain) that points at
//! the command's help.
//! Exit codes: 0 success, 1 the API refused or failed, 2 usage error,
//! 3 a waited-for drain ended without completing.

use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

use capybara_api_client::apis::configuration::Configuration;
use capybara_api_client::apis::{self, Error as ClientError};
use capybara_api_client::models;
use serde_json::Value;

const USAGE: &str = "usage: capybara ctl [--api URL] [--token TOKEN] COMMAND
commands:
  servers
  drain SERVER [--deadline 30s] [--force] [--wait]
  undrain SERVER
  weight SERVER WEIGHT
  weight SERVER --clear
  connections [--server SERVER] [--service NAME] [--limit N]
  migrate CONN [--target SERVER]
  policy get
  policy set KEY=VALUE [KEY=VALUE...]
  migrations [--limit N] [--follow [--for DURATION]]
  audit [--limit N]
  services
  service add NAME VIP:PORT [--pool 1,2]
  service set NAME VIP:PORT [--pool 1,2]
  service delete NAME
  server delete SERVER
  ready
environment: CAPYBARA_API (default http://127.0.0.1:8080), CAPYBARA_TOKEN
`capybara ctl COMMAND --help`: a command's arguments, flags and an example";

/// Printed at the end of every command's `--help`.
const GLOBAL_FLAGS: &str = "global flags:
  --api URL            the API (CAPYBARA_API; default http://127.0.0.1:8080)
  --token TOKEN        a bearer token (CAPYBARA_TOKEN)
  -h, --help           this help
exit status: 0 success, 1 the API refused or failed, 2 usage error, 3 a drain
waited for (--wait) ended without completing";

/// Each command's `--help`: its usage line first (also printed under a
/// usage error of that command), what it does, its arguments and flags,
/// an example. `policy` and `service` have one for the group and one per
/// subcommand.
const COMMAND_HELP: &[(&str, &str)] = &[
    (
        "servers",
        "usage: capybara ctl servers
Lists the registered servers: id, name, state (active, draining, drained,
dead), liveness (live; stopping: its hostagent migrates its connections
away before it exits, CONNECTIONS are those left; stopped: its hostagent
stopped cleanly, placed again when it returns; dead: missed its
heartbeats; never_seen: created through the API and no hostagent
registered it, so it takes no connection), weight, open connections, load
in packets/s (- while switchd does not answer) and data address.
example:
  capybara ctl servers",
    ),
    (
        "drain",
        "usage: capybara ctl drain SERVER [--deadline DURATION] [--force] [--wait]
Takes SERVER out of placement at once (no new connections) and migrates its
open connections to the other servers; the drain completes when it holds
none. Prints the drain's state (running) unless --wait. Draining a server
again is a no-op: a drained server stays drained (prints completed), a
running drain goes on unchanged (a different --deadline or --force is
refused: undrain first).
arguments:
  SERVER               the server's id: 3 or s3 (see `servers`)
flags:
  --deadline DURATION  whole seconds from 1s to 24h: 30, 30s, 5m (default 30s)
  --force              at the deadline, break the connections that remain
                       (without it they are reported and kept)
  --wait               show the progress on stderr until the drain ends;
                       exit status 3 when it ends without completing
example:
  capybara ctl drain 2 --deadline 60s --wait",
    ),
    (
        "undrain",
        "usage: capybara ctl undrain SERVER
Returns SERVER to placement (it takes new connections again) and ends a
running drain of it.
arguments:
  SERVER               the server's id: 3 or s3 (see `servers`)
example:
  capybara ctl undrain 2",
    ),
    (
        "weight",
        "usage: capybara ctl weight SERVER WEIGHT | weight SERVER --clear
Sets SERVER's placement weight (an operator's weight, kept across
re-registrations); switchd applies it within a second.
arguments:
  SERVER               the server's id: 3 or s3 (see `servers`)
  WEIGHT               0 to 65535; 0: no new connections (open ones stay)
flags:
  --clear              clears the operator's weight instead: back to the
                       weight the server's REGISTER reports
example:
  capybara ctl weight 3 2
  capybara ctl weight 3 --clear",
    ),
    (
        "connections",
        "usage: capybara ctl connections [--server SERVER] [--service NAME] [--limit N]
Lists open connections: the id (CLIENT_IP:PORT-VIP:PORT, what `migrate`
takes), the server holding it and its service; says on stderr when the list
was cut at N.
flags:
  --server SERVER      only the connections of this server (3 or s3)
  --service NAME       only the connections of this service
  --limit N            at most N, 1 to 10000 (default 100)
example:
  capybara ctl connections --server 2 --limit 10",
    ),
    (
        "migrate",
        "usage: capybara ctl migrate CONN [--target SERVER]
Starts a live migration of one connection; follow it with `migrations
--follow`.
arguments:
  CONN                 the connection's id, CLIENT_IP:PORT-VIP:PORT (see
                       `connections`)
flags:
  --target SERVER      the server to move it to (3 or s3); without it the
                       switch picks one (policy target_selection)
example:
  capybara ctl migrate 192.0.2.10:51000-198.18.100.1:80 --target 3",
    ),
    (
        "policy",
        "usage: capybara ctl policy get | policy set KEY=VALUE [KEY=VALUE...]
Shows or changes the migration policy (docs/POLICIES.md).
  policy get           prints every setting, one KEY=VALUE a line
  policy set           changes the settings named, the others stay
examples:
  capybara ctl policy get
  capybara ctl policy set proactive_threshold_pct=15",
    ),
    (
        "policy get",
        "usage: capybara ctl policy get
Prints the migration policy, one KEY=VALUE a line (the keys `policy set`
takes).
example:
  capybara ctl policy get",
    ),
    (
        "policy set",
        "usage: capybara ctl policy set KEY=VALUE [KEY=VALUE...]
Changes the settings named (the others stay) and prints them as the API
stored them; an unknown key or a bad value is refused before anything is
sent.
arguments:
  KEY=VALUE            a key of `policy get`; true/false and numbers are
                       sent as such, anything else as text
example:
  capybara ctl policy set proactive_threshold_pct=15 target_selection=least_loaded",
    ),
    (
        "migrations",
        "usage: capybara ctl migrations [--limit N] [--follow [--for DURATION]]
Lists the newest N migrations, the newest last: id, connection, origin
server, target server, outcome and total time in microseconds.
flags:
  --limit N            how many, 1 to 10000 (default 1000)
  --follow             then print each new migration as it is reported,
                       until interrupted
  --for DURATION       with --follow: stop after DURATION (500ms, 10s, 2m, 1h)
example:
  capybara ctl migrations --limit 20 --follow --for 1m",
    ),
    (
        "audit",
        "usage: capybara ctl audit [--limit N]
Lists the newest N entries of the audit log (every change made through the
API), the newest last: sequence number, time (UTC), who, action, target and
the details as JSON.
flags:
  --limit N            how many, 1 to 10000 (default 20)
example:
  capybara ctl audit --limit 5",
    ),
    (
        "services",
        "usage: capybara ctl services
Lists the services: name, VIP:PORT, pool (server ids; every server when
empty) and SERVED BY, the servers switchd places new connections on now
(`none (pool ...)` when none does; `pending` for a service switchd has not
applied yet, within a second of a change; `refused: REASON` for one it
read and will not serve, e.g. its VIP:PORT is another stored service's);
then the retiring ones (deleted,
still serving their open connections): connections left, time since the
delete, time left before the timeout.
example:
  capybara ctl services",
    ),
    (
        "service",
        "usage: capybara ctl service add|set NAME VIP:PORT [--pool 1,2] | service delete NAME
Creates, changes or deletes a service (an admin token's work); switchd
applies it within a second.
  service add          creates NAME at VIP:PORT
  service set          changes NAME's address (and pool)
  service delete       stops new connections to NAME; open ones are kept
                       until they end
examples:
  capybara ctl service add api 198.18.100.2:8080 --pool 1,2
  capybara ctl service delete api",
    ),
    (
        "service add",
        "usage: capybara ctl service add NAME VIP:PORT [--pool 1,2]
Creates a service; switchd serves it within a second.
arguments:
  NAME                 1 to 64 characters
  VIP:PORT             the virtual IPv4 address and port, e.g. 198.18.100.2:8080
flags:
  --pool SERVERS       server ids, comma-separated (1,2 or s1,s2); without it
                       (or empty) every registered server serves it
example:
  capybara ctl service add api 198.18.100.2:8080 --pool 1,2",
    ),
    (
        "service set",
        "usage: capybara ctl service set NAME VIP:PORT [--pool 1,2]
Changes a service's address and, with --pool, its pool; switchd applies it
within a second.
arguments:
  NAME                 the service (see `services`)
  VIP:PORT             the virtual IPv4 address and port, e.g. 198.18.100.2:8081
flags:
  --pool SERVERS       server ids, comma-separated (1,2 or s1,s2); empty: every
                       registered server; without it the pool stays
example:
  capybara ctl service set api 198.18.100.2:8081 --pool 2",
    ),
    (
        "service delete",
        "usage: capybara ctl service delete NAME
Deletes a service: switchd takes no new connection to it within a second;
its open connections are served until they end (at most
service_retire_timeout_ms, 5 minutes by default; `services` lists them as
retiring).
arguments:
  NAME                 the service (see `services`)
example:
  capybara ctl service delete api",
    ),
    (
        "server",
        "usage: capybara ctl server delete SERVER
Forgets a server (an admin token's work): refused while it is active or
draining or a service's pool names it. Drain it and stop its hostagent
first: a hostagent still running registers it again.
  server delete        deletes SERVER's record from the API and the store
example:
  capybara ctl server delete 3",
    ),
    (
        "server delete",
        "usage: capybara ctl server delete SERVER
Forgets a server (an admin token's work): refused while it is active or
draining or a service's pool names it (docs/OPERATIONS.md, \"Removing a
server\": drain it, stop its hostagent, take it out of the pools first).
arguments:
  SERVER               the server id (3 or s3)
example:
  capybara ctl server delete 3",
    ),
    (
        "ready",
        "usage: capybara ctl ready
Asks the API whether it is ready: exit 0 when its store answers, 1 when it
does not; also says whether switchd's control endpoint answers.
example:
  capybara ctl ready",
    ),
];

/// The help of the command `pos` names: its subcommand's (`service add`)
/// when there is one, else the command's.
fn command_help(pos: &[String]) -> Option<(&'static str, &'static str)> {
    let first = pos.first()?;
    let two = pos.get(1).map(|s| format!("{first} {s}"));
    let find = |k: &str| COMMAND_HELP.iter().find(|(n, _)| *n == k).copied();
    two.as_deref().and_then(find).or_else(|| find(first))
}

#[derive(Debug)]
enum CtlError {
    /// A usage error before a command is known: printed with [`USAGE`].
    Usage(String),
    /// A usage error of a known command (a `COMMAND_HELP` key): printed
    /// with that command's usage line and where its help is.
    CommandUsage(&'static str, String),
    Api(String),
    DrainIncomplete(String),
}

impl std::fmt::Display for CtlError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CtlError::Usage(m) => write!(f, "{m}\n{USAGE}"),
            CtlError::CommandUsage(cmd, m) => {
                let line = COMMAND_HELP
                    .iter()
                    .find(|(n, _)| n == cmd)
                    .and_then(|(_, h)| h.lines().next())
                    .unwrap_or("");
                write!(f, "{m}\n{line}\n(`capybara ctl {cmd} --help` for details)")
            }
            CtlError::Api(m) | CtlError::DrainIncomplete(m) => f.write_str(m),
        }
    }
}

/// Turns a client error into one line: the problem's detail when the API
/// answered with one.
fn api_err<T: std::fmt::Debug>(e: ClientError<T>) -> CtlError {
    match e {
        ClientError::ResponseError(r) => {
            let detail = serde_json::from_str::<Value>(&r.content)
                .ok()
                .and_then(|v| v.get("detail").and_then(|d| d.as_str()).map(str::to_string))
                .unwrap_or_else(|| {
                    // Not a problem document: not the Capybara API (or a
                    // proxy in front of it) answered.
                    let body: String = r.content.trim().chars().take(200).collect();
                    format!("{body:?}: not an answer of the Capybara API (is --api right?)")
                });
            let hint = if r.status.as_u16() == 401 {
                " (check --token or CAPYBARA_TOKEN)"
            } else {
                ""
            };
            CtlError::Api(format!("API error {}: {detail}{hint}", r.status.as_u16()))
        }
        ClientError::Reqwest(e) => {
            // reqwest's own message stops at "error sending request"; the
            // cause (connection refused, timed out, no such host) is in
            // its sources.
            let msg = crate::switchd::error_chain(&e);
            if e.is_connect() || e.is_timeout() {
                CtlError::Api(format!(
                    "cannot reach the API: {msg} (is the appliance running? --api URL or CAPYBARA_API)"
                ))
            } else {
                CtlError::Api(format!("request failed: {msg}"))
            }
        }
        ClientError::Serde(e) => CtlError::Api(format!(
            "the answer is not the Capybara API's ({e}): is --api the API's URL?"
        )),
        other => CtlError::Api(format!("request failed: {other}")),
    }
}

/// `30s`, `2m`, `1h`, `500ms` or plain seconds.
pub fn parse_duration(s: &str) -> Option<Duration> {
    let s = s.trim();
    let (num, unit) = s
        .find(|c: char| !c.is_ascii_digit())
        .map(|i| s.split_at(i))
        .unwrap_or((s, "s"));
    let n: u64 = num.parse().ok()?;
    match unit {
        "ms" => Some(Duration::from_millis(n)),
        "s" | "" => Some(Duration::from_secs(n)),
        "m" => n.checked_mul(60).map(Duration::from_secs),
        "h" => n.checked_mul(3600).map(Duration::from_secs),
        _ => None,
    }
}

struct Args {
    positional: Vec<String>,
    flags: Vec<(String, Option<String>)>,
    /// A flag that takes a value given last, without one (`drain 1
    /// --deadline`): a usage error once the command is known, so that it
    /// points at that command's usage rather than listing every command.
    missing_value: Option<String>,
}

impl Args {
    /// Flags that take a value.
    const VALUED: [&'static str; 9] = [
        "--pool",
        "--api",
        "--token",
        "--deadline",
        "--target",
        "--for",
        "--server",
        "--service",
        "--limit",
    ];
    /// Flags every command takes.
    const GLOBAL: [&'static str; 3] = ["--api", "--token", "--help"];

    fn parse(args: Vec<String>) -> Result<Self, CtlError> {
        let mut positional = Vec::new();
        let mut flags = Vec::new();
        let mut missing_value = None;
        let mut it = args.into_iter();
        while let Some(a) = it.next() {
            if let Some((k, v)) = a.split_once('=').filter(|(k, _)| k.starts_with("--")) {
                flags.push((k.to_string(), Some(v.to_string())));
            } else if Self::VALUED.contains(&a.as_str()) {
                let v = it.next();
                if v.is_none() {
                    missing_value = Some(a.clone());
                }
                flags.push((a, v));
            } else if a.starts_with("--") {
                flags.push((a, None));
            } else if a == "-h" {
                flags.push(("--help".into(), None));
            } else {
                positional.push(a);
            }
        }
        Ok(Args {
            positional,
            flags,
            missing_value,
        })
    }

    /// The usage error of a valued flag given without its value.
    fn check_values(&self) -> Result<(), CtlError> {
        match &self.missing_value {
            Some(f) => Err(CtlError::Usage(format!("{f} needs a value"))),
            None => Ok(()),
        }
    }
    fn value(&self, k: &str) -> Option<&str> {
        self.flags
            .iter()
            .rev()
            .find(|(f, _)| f == k)
            .and_then(|(_, v)| v.as_deref())
    }
    fn has(&self, k: &str) -> bool {
        self.flags.iter().any(|(f, _)| f == k)
    }

    /// Refuses a flag `cmd` does not take, a value on a switch
    /// (`--force=false` would otherwise force), and a flag given twice.
    fn check_flags(&self, cmd: &str) -> Result<(), CtlError> {
        let own = command_flags(cmd);
        for (f, v) in &self.flags {
            if !Self::GLOBAL.contains(&f.as_str()) && !own.contains(&f.as_str()) {
                let takes = if own.is_empty() {
                    "no flags".to_string()
                } else {
                    own.join(", ")
                };
                return Err(CtlError::Usage(format!(
                    "unknown flag {f} for `{cmd}` (it takes {takes})"
                )));
            }
            if v.is_some() && !Self::VALUED.contains(&f.as_str()) {
                return Err(CtlError::Usage(format!("{f} takes no value")));
            }
        }
        // `--deadline 5 --deadline 6` took the last one, silently: which
        // one was meant is the operator's to say.
        for (i, (f, v)) in self.flags.iter().enumerate() {
            if let Some((_, again)) = self.flags[i + 1..].iter().find(|(g, _)| g == f) {
                let values = match (v, again) {
                    (Some(a), Some(b)) => format!(" ({a}, then {b})"),
                    _ => String::new(),
                };
                return Err(CtlError::Usage(format!(
                    "{f} given twice{values}: give it once"
                )));
            }
        }
        Ok(())
    }
}

/// The flags of each command, besides `--api`, `--token` and `--help`.
fn command_flags(cmd: &str) -> &'static [&'static str] {
    match cmd {
        "drain" => &["--deadline", "--force", "--wait"],
        "migrate" => &["--target"],
        "migrations" => &["--limit", "--follow", "--for"],
        "audit" => &["--limit"],
        "connections" => &["--server", "--service", "--limit"],
        "service" => &["--pool"],
        "weight" => &["--clear"],
        _ => &[],
    }
}

/// Runs `capybara ctl` with `args` (without the program name and `ctl`);
/// returns the process exit code.
pub fn ctl_main(args: Vec<String>) -> i32 {
    default_sigpipe();
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: starting the runtime: {e}");
            return 1;
        }
    };
    match rt.block_on(run(args)) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("error: {e}");
            match e {
                CtlError::Usage(_) | CtlError::CommandUsage(..) => 2,
                CtlError::Api(_) => 1,
                CtlError::DrainIncomplete(_) => 3,
            }
        }
    }
}

/// Restores SIGPIPE's default action (Rust starts programs with it ignored),
/// so that `capybara ctl ... | head` ends quietly when `head` exits, like
/// other Unix tools, instead of panicking on the failed write to stdout.
fn default_sigpipe() {
    #[cfg(target_os = "linux")]
    {
        use std::os::raw::c_int;
        extern "C" {
            fn signal(signum: c_int, handler: usize) -> usize;
        }
        const SIGPIPE: c_int = 13;
        const SIG_DFL: usize = 0;
        // SAFETY: sets a signal's disposition to the default action; no
        // handler code runs in this process.
        unsafe {
            signal(SIGPIPE, SIG_DFL);
        }
    }
}

fn server_id(s: &str) -> Result<i64, CtlError> {
    // One optional `s` and digits only (`ss3` and `+3` were taken as 3).
    let digits = s.strip_prefix('s').unwrap_or(s);
    Some(digits)
        .filter(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()))
        .and_then(|d| d.parse::<i64>().ok())
        .filter(|n| (1..=u32::MAX as i64).contains(n))
        .ok_or_else(|| {
            CtlError::Usage(format!(
                "SERVER must be a server id (e.g. 3 or s3), got {s:?}"
            ))
        })
}

async fn run(args: Vec<String>) -> Result<(), CtlError> {
    let mut a = Args::parse(args)?;
    // `help COMMAND` is `COMMAND --help`.
    if a.positional.first().is_some_and(|p| p == "help") {
        a.positional.remove(0);
        a.flags.push(("--help".into(), None));
    }
    if a.has("--help") {
        if a.positional.is_empty() {
            println!("{USAGE}");
            return Ok(());
        }
        return match command_help(&a.positional) {
            Some((_, help)) => {
                println!("{help}\n{GLOBAL_FLAGS}");
                Ok(())
            }
            None => Err(CtlError::Usage(format!(
                "unknown command {:?}",
                a.positional.join(" ")
            ))),
        };
    }
    if a.positional.is_empty() {
        a.check_values()?;
        return Err(CtlError::Usage("no command given".into()));
    }
    // From here on a usage error belongs to a command: it points at that
    // command's help instead of listing every command.
    match command_help(&a.positional) {
        Some((cmd, _)) => dispatch(&a).await.map_err(|e| match e {
            CtlError::Usage(m) => CtlError::CommandUsage(cmd, m),
            e => e,
        }),
        None => Err(CtlError::Usage(format!(
            "unknown command {:?}",
            a.positional.join(" ")
        ))),
    }
}

/// Runs the command `a` names (a known one: see [`command_help`]).
async fn dispatch(a: &Args) -> Result<(), CtlError> {
    if let Some(cmd) = a.positional.first() {
        a.check_flags(cmd)?;
    }
    a.check_values()?;
    let mut cfg = Configuration::new();
    cfg.base_path = a
        .value("--api")
        .map(str::to_string)
        .or_else(|| std::env::var("CAPYBARA_API").ok())
        .unwrap_or_else(|| "http://127.0.0.1:8080".into())
        .trim_end_matches('/')
        .to_string();
    // An empty CAPYBARA_TOKEN (`export CAPYBARA_TOKEN=$(cat FILE)` of a
    // missing file) is no token: the API then says the token is missing.
    cfg.bearer_access_token = a
        .value("--token")
        .map(str::to_string)
        .or_else(|| std::env::var("CAPYBARA_TOKEN").ok())
        .filter(|t| !t.trim().is_empty());
    cfg.user_agent = Some("capybara-ctl".into());
    // Bounded: a wrong --api (a filtered port, an address nobody answers)
    // fails in seconds instead of hanging.
    cfg.client = capybara_api_client::apis::configuration::Client::builder()
        .connect_timeout(Duration::from_secs(5))
        .timeout(Duration::from_secs(30))
        .build()
        .map_err(|e| CtlError::Api(format!("building the HTTP client: {e}")))?;
    if cfg.base_path.starts_with("https://") {
        // The client is built without TLS: reqwest's own "invalid URL,
        // scheme is not http" came out as "cannot reach the API".
        return Err(CtlError::Usage(format!(
            "--api (or CAPYBARA_API): this capybara ctl speaks plain HTTP only, as the API serves it (http://...); got {:?}",
            cfg.base_path
        )));
    }
    if !cfg.base_path.starts_with("http://") {
        return Err(CtlError::Usage(format!(
            "--api (or CAPYBARA_API) must be a URL such as http://127.0.0.1:8080, got {:?}",
            cfg.base_path
        )));
    }
    if cfg.base_path.ends_with("/v1") {
        // Every path already starts with /v1: `.../v1/v1/servers` was a 404
        // "no such route".
        return Err(CtlError::Usage(format!(
            "--api (or CAPYBARA_API) is the API's base URL, without /v1 (e.g. http://127.0.0.1:8080), got {:?}",
            cfg.base_path
        )));
    }
    let pos: Vec<&str> = a.positional.iter().map(String::as_str).collect();
    match pos.as_slice() {
        ["servers"] => servers(&cfg).await,
        ["services"] => services(&cfg).await,
        ["service", "add", name, addr] => service_put(&cfg, name, addr, a, true).await,
        ["service", "set", name, addr] => service_put(&cfg, name, addr, a, false).await,
        ["service", "delete", name] => {
            apis::services_api::delete_service(&cfg, name)
                .await
                .map_err(api_err)?;
            println!("service {name} deleted: switchd takes no new connection to it within a second; its open connections are kept until they end (at most service_retire_timeout_ms, 5 minutes by default)");
            Ok(())
        }
        ["service", ..] => Err(CtlError::Usage(
            "`service add NAME VIP:PORT [--pool 1,2]`, `service set NAME VIP:PORT [--pool 1,2]` or `service delete NAME`".into(),
        )),
        ["server", "delete", s] => {
            let id = server_id(s)?;
            apis::servers_api::deregister_server(&cfg, id)
                .await
                .map_err(api_err)?;
            println!("server {id} deleted");
            Ok(())
        }
        ["server", ..] => Err(CtlError::Usage("`server delete SERVER`".into())),
        ["ready"] => ready(&cfg).await,
        ["connections"] => connections(&cfg, a).await,
        ["weight", s] if a.has("--clear") => {
            let id = server_id(s)?;
            apis::servers_api::clear_server_weight(&cfg, id)
                .await
                .map_err(api_err)?;
            println!("server {id}: operator weight cleared; the weight its REGISTER reports applies within a second");
            Ok(())
        }
        ["weight", _, _] if a.has("--clear") => Err(CtlError::Usage(
            "`weight SERVER --clear` takes no WEIGHT".into(),
        )),
        ["weight", s, w] => {
            let weight = w
                .parse::<u16>()
                .map_err(|_| CtlError::Usage(format!("WEIGHT must be 0 to 65535, got {w:?}")))?;
            let srv = apis::servers_api::set_server_weight(
                &cfg,
                server_id(s)?,
                models::WeightUpdate {
                    weight: weight.into(),
                },
            )
            .await
            .map_err(api_err)?;
            println!("server {} ({}) has weight {}", srv.id, srv.name, srv.weight);
            Ok(())
        }
        ["drain", s] => drain(&cfg, server_id(s)?, a).await,
        ["undrain", s] => {
            let srv = apis::servers_api::undrain_server(&cfg, server_id(s)?)
                .await
                .map_err(api_err)?;
            if srv.liveness == models::ServerLiveness::Stopped {
                println!(
                    "server {} ({}) is undrained; its hostagent stopped cleanly: it takes new connections once its hostagent registers again",
                    srv.id, srv.name
                );
            } else if srv.state == models::ServerState::Dead {
                // Not "is dead" alone, which reads as a refusal.
                println!(
                    "server {} ({}) is undrained; it is dead (its hostagent is not heard): it takes new connections once its hostagent registers again",
                    srv.id, srv.name
                );
            } else {
                println!(
                    "server {} ({}) is {}",
                    srv.id,
                    srv.name,
                    state_str(srv.state)
                );
            }
            Ok(())
        }
        ["migrate", conn] => {
            let target = a.value("--target").map(server_id).transpose()?;
            let req = models::MigrateRequest { target };
            let m = apis::connections_api::migrate_connection(&cfg, conn, Some(req))
                .await
                .map_err(api_err)?;
            println!(
                "migration {} of {} from server {} started ({}; follow it with `migrations --follow`)",
                m.id,
                m.connection,
                m.origin,
                outcome_str(m.outcome)
            );
            Ok(())
        }
        ["policy", "get"] => {
            let p = apis::policy_api::get_policy(&cfg).await.map_err(api_err)?;
            let v = serde_json::to_value(&p).map_err(|e| CtlError::Api(e.to_string()))?;
            if let Value::Object(m) = v {
                for (k, v) in m {
                    println!(
                        "{k}={}",
                        v.as_str()
                            .map(str::to_string)
                            .unwrap_or_else(|| v.to_string())
                    );
                }
            }
            Ok(())
        }
        ["policy", "set", kvs @ ..] if !kvs.is_empty() => policy_set(&cfg, kvs).await,
        ["migrations"] => migrations(&cfg, a).await,
        ["audit"] => audit(&cfg, a).await,
        [cmd @ ("drain" | "undrain"), ..] => Err(CtlError::Usage(format!(
            "`{cmd}` takes one SERVER, got {}",
            args_text(&pos[1..])
        ))),
        ["weight", ..] => Err(CtlError::Usage(format!(
            "`weight` takes SERVER and WEIGHT (or SERVER --clear), got {}",
            args_text(&pos[1..])
        ))),
        ["migrate", ..] => Err(CtlError::Usage(format!(
            "`migrate` takes one CONN (CLIENT_IP:PORT-VIP:PORT, see `connections`), got {}",
            args_text(&pos[1..])
        ))),
        ["policy", ..] => Err(CtlError::Usage(
            "`policy get`, or `policy set KEY=VALUE...`".into(),
        )),
        [cmd, rest @ ..] => Err(CtlError::Usage(format!(
            "`{cmd}` takes no arguments, got {}",
            args_text(rest)
        ))),
        [] => Err(CtlError::Usage("no command given".into())),
    }
}

/// The arguments a command was given, for a usage error: `none`, or how
/// many and what they were as typed (`2 arguments: 1 2`).
fn args_text(args: &[&str]) -> String {
    match args {
        [] => "none".into(),
        [one] => format!("1 argument: {one}"),
        many => format!("{} arguments: {}", many.len(), many.join(" ")),
    }
}

/// `GET /readyz`: exit 0 when the API is ready (its store answers), 1 with
/// the API's 503 when it is not; a ready API also says whether switchd's
/// control endpoint answered.
async fn ready(cfg: &Configuration) -> Result<(), CtlError> {
    let r = apis::health_api::readyz(cfg).await.map_err(api_err)?;
    println!(
        "ready: store {} answers; control plane {}",
        r.store, r.control_plane
    );
    match r.switchd {
        models::SwitchdReachability::Reachable => println!("switchd: reachable"),
        models::SwitchdReachability::Unreachable => println!(
            "switchd: unreachable: {} (reads come from the store; drains and migrations fail)",
            r.switchd_error.as_deref().unwrap_or("no reason given")
        ),
        models::SwitchdReachability::NotConfigured => {
            println!("switchd: not configured (the API runs from the store alone)")
        }
    }
    Ok(())
}

fn liveness_str(l: models::ServerLiveness) -> &'static str {
    match l {
        models::ServerLiveness::Live => "live",
        models::ServerLiveness::Stopping => "stopping",
        models::ServerLiveness::Stopped => "stopped",
        models::ServerLiveness::Dead => "dead",
        models::ServerLiveness::NeverSeen => "never_seen",
    }
}

fn state_str(s: models::ServerState) -> &'static str {
    match s {
        models::ServerState::Active => "active",
        models::ServerState::Draining => "draining",
        models::ServerState::Drained => "drained",
        models::ServerState::Dead => "dead",
    }
}

async fn servers(cfg: &Configuration) -> Result<(), CtlError> {
    let list = apis::servers_api::list_servers(cfg)
        .await
        .map_err(api_err)?;
    println!(
        "{:>5}  {:<16} {:<9} {:<10} {:>6} {:>11} {:>10}  DATA_ADDR",
        "ID", "NAME", "STATE", "LIVENESS", "WEIGHT", "CONNECTIONS", "LOAD_PPS"
    );
    let mut operator_weights = Vec::new();
    for s in list.items {
        let load = s
            .stats
            .load_pps
            .flatten()
            .map(|l| format!("{l:.0}"))
            .unwrap_or_else(|| "-".into());
        let weight = if s.weight_source == models::server::WeightSource::Operator {
            operator_weights.push(match s.register_weight.flatten() {
                Some(r) => format!("{} (its REGISTER reports {r})", s.id),
                None => s.id.to_string(),
            });
            format!("{}*", s.weight)
        } else {
            s.weight.to_string()
        };
        println!(
            "{:>5}  {:<16} {:<9} {:<10} {:>6} {:>11} {:>10}  {}",
            s.id,
            s.name,
            state_str(s.state),
            liveness_str(s.liveness),
            weight,
            s.stats.connections,
            load,
            s.data_addr
        );
    }
    if !operator_weights.is_empty() {
        println!(
            "* weight set by an operator: server {}; `ctl weight ID --clear` returns to the REGISTER's",
            operator_weights.join(", ")
        );
    }
    Ok(())
}

async fn services(cfg: &Configuration) -> Result<(), CtlError> {
    let list = apis::services_api::list_services(cfg)
        .await
        .map_err(api_err)?;
    println!("{:<20} {:<21} {:<16} SERVED BY", "NAME", "VIP:PORT", "POOL");
    for s in list.items {
        let ids = |v: &[i64]| {
            v.iter()
                .map(|p| p.to_string())
                .collect::<Vec<_>>()
                .join(",")
        };
        let pool = if s.pool.is_empty() {
            "every server".to_string()
        } else {
            ids(&s.pool)
        };
        let served = served_by(s.serving.as_ref());
        println!(
            "{:<20} {:<21} {:<16} {}",
            s.name,
            format!("{}:{}", s.vip, s.port),
            pool,
            served
        );
    }
    // Deleted services whose open connections switchd still serves.
    if let Some(retiring) = list.retiring.filter(|r| !r.is_empty()) {
        println!();
        println!("RETIRING (deleted, or moved to another VIP:PORT: no new connections at this address; the open ones are served until they end, at most service_retire_timeout_ms)");
        println!(
            "{:<20} {:<21} {:>11}  {:<14} TIMEOUT IN",
            "NAME", "VIP:PORT", "CONNECTIONS", "DELETED"
        );
        for r in retiring {
            println!("{}", retiring_line(&r));
        }
    }
    Ok(())
}

/// `services`' SERVED BY for a stored service switchd has not read yet.
const SERVICE_PENDING: &str =
    "pending: switchd applies it within 1 s (if it stays pending, see switchd's log)";

/// `services`' SERVED BY: switchd's view, the servers it places new
/// connections on (`serving.placing`); from a switchd too old to say,
/// its pool (`serving.members`) as before.
fn served_by(serving: Option<&models::ServiceServing>) -> String {
    let ids = |v: &[i64]| {
        v.iter()
            .map(|p| p.to_string())
            .collect::<Vec<_>>()
            .join(",")
    };
    match serving {
        None => "- (switchd did not answer)".to_string(),
        // switchd read it and will not serve it (a VIP:port or name another
        // stored service has, no free slot: written past the API's checks,
        // e.g. by two API processes at once): it stays so until changed.
        Some(v) if v.state == Some(models::service_serving::State::Refused) => format!(
            "refused: {}",
            v.refused_reason
                .as_deref()
                .unwrap_or("(switchd gave no reason)")
        ),
        // switchd reads the store's services every 250 ms: a service just
        // added or moved is not in its `/status` yet.
        Some(v) if !v.served => SERVICE_PENDING.to_string(),
        Some(v) => {
            // Served, but by no server: none registered that serves this
            // VIP:port (or the pool's are all out of placement). Was blank.
            let mut t = match v.placing.as_deref() {
                _ if v.members.is_empty() => "none (no server serves it)".to_string(),
                // Nobody takes new connections: say so, and name the pool.
                Some([]) => format!("none (pool {})", ids(&v.members)),
                Some(p) => ids(p),
                None => ids(&v.members),
            };
            if !v.apps_down.is_empty() {
                t.push_str(&format!(" (app down on {})", ids(&v.apps_down)));
            }
            if let Some(n) = v.not_serving.as_deref().filter(|n| !n.is_empty()) {
                let (who, does) = match n.len() {
                    1 => ("server", "does"),
                    _ => ("servers", "do"),
                };
                t.push_str(&format!(
                    " ({who} {} {does} not serve it: no new connections go there)",
                    ids(n)
                ));
            }
            if v.refusing {
                t.push_str(
                    " (refusing new connections: every server drained, at weight 0, dead or not serving it)",
                );
            }
            t
        }
    }
}

/// One line of `services`' RETIRING table.
fn retiring_line(r: &models::RetiringService) -> String {
    let conns = r
        .connections
        .map(|c| c.to_string())
        .unwrap_or_else(|| "?".into());
    let left = r
        .timeout_in_ms
        .map(|ms| fmt_ms(ms.max(0) as u64))
        .unwrap_or_else(|| "- (not reported)".into());
    format!(
        "{:<20} {:<21} {:>11}  {:<14} {}",
        r.name,
        format!("{}:{}", r.vip, r.port),
        conns,
        format!("{} ago", fmt_ms(r.retiring_for_ms.max(0) as u64)),
        left
    )
}

/// `1m 04s`, `4.2s`, `2h 05m`.
fn fmt_ms(ms: u64) -> String {
    let s = ms / 1000;
    if s < 60 {
        format!("{}.{}s", s, (ms % 1000) / 100)
    } else if s < 3600 {
        format!("{}m {:02}s", s / 60, s % 60)
    } else {
        format!("{}h {:02}m", s / 3600, (s % 3600) / 60)
    }
}

/// `service add|set NAME VIP:PORT [--pool 1,2]`: `--pool` lists server
/// ids (`s2` works too); without it `add` creates an open pool (every
/// registered server) and `set` keeps the current pool.
async fn service_put(
    cfg: &Configuration,
    name: &str,
    addr: &str,
    a: &Args,
    create: bool,
) -> Result<(), CtlError> {
    let sa: std::net::SocketAddrV4 = addr.parse().map_err(|_| {
        CtlError::Usage(format!(
            "VIP:PORT must be an IPv4 address and a port, e.g. 198.18.100.2:8080, got {addr:?}"
        ))
    })?;
    let pool = match a.value("--pool") {
        Some("") => Some(Vec::new()),
        Some(p) => Some(
            p.split(',')
                .map(|s| server_id(s.trim()))
                .collect::<Result<Vec<i64>, _>>()?,
        ),
        None => None,
    };
    let (vip, port) = (sa.ip().to_string(), i32::from(sa.port()));
    let s = if create {
        let body = models::Service::new(name.to_string(), vip, port, pool.unwrap_or_default());
        apis::services_api::create_service(cfg, body)
            .await
            .map_err(api_err)?
    } else {
        let pool = match pool {
            Some(p) => p,
            None => {
                apis::services_api::get_service(cfg, name)
                    .await
                    .map_err(api_err)?
                    .pool
            }
        };
        let body = models::ServiceUpdate::new(vip, port, pool);
        apis::services_api::update_service(cfg, name, body)
            .await
            .map_err(api_err)?
    };
    let pool: Vec<String> = s.pool.iter().map(|p| p.to_string()).collect();
    println!(
        "service {} at {}:{}, pool {} (switchd applies it within a second)",
        s.name,
        s.vip,
        s.port,
        if pool.is_empty() {
            "open (every registered server that serves it)".to_string()
        } else {
            pool.join(",")
        }
    );
    Ok(())
}

async fn connections(cfg: &Configuration, a: &Args) -> Result<(), CtlError> {
    let server = a.value("--server").map(server_id).transpose()?;
    let limit = match a.value("--limit") {
        None => None,
        Some(l) => Some(
            l.parse::<i32>()
                .ok()
                .filter(|n| (1..=10_000).contains(n))
                .ok_or_else(|| CtlError::Usage(format!("--limit must be 1 to 10000, got {l:?}")))?,
        ),
    };
    let list = apis::connections_api::list_connections(cfg, server, a.value("--service"), limit)
        .await
        .map_err(api_err)?;
    println!("{:<44} {:>6}  SERVICE", "ID", "SERVER");
    for c in &list.items {
        println!(
            "{:<44} {:>6}  {}",
            c.id,
            c.server,
            c.service.clone().flatten().unwrap_or_else(|| "-".into())
        );
    }
    if list.truncated {
        eprintln!(
            "{} of {} connections shown (--limit, --server, --service)",
            list.items.len(),
            list.total
        );
    }
    Ok(())
}

/// Parses `KEY=VALUE` into a JSON value: booleans and numbers as such,
/// anything else as a string; the API validates and names a bad key.
fn policy_value(v: &str) -> Value {
    serde_json::from_str::<Value>(v)
        .ok()
        .filter(|j| j.is_boolean() || j.is_number())
        .unwrap_or_else(|| Value::String(v.to_string()))
}

async fn policy_set(cfg: &Configuration, kvs: &[&str]) -> Result<(), CtlError> {
    let mut patch = serde_json::Map::new();
    for kv in kvs {
        let (k, v) = kv
            .split_once('=')
            .ok_or_else(|| CtlError::Usage(format!("expected KEY=VALUE, got {kv:?}")))?;
        // Which one was meant? (The last silently won.)
        if patch.insert(k.to_string(), policy_value(v)).is_some() {
            return Err(CtlError::Usage(format!("{k} is given twice")));
        }
    }
    // Through the generated model, so an unknown key fails here with its name.
    let p: models::PolicyPatch = serde_path_to_error::deserialize(Value::Object(patch.clone()))
        .map_err(|e| {
            CtlError::Usage(format!(
                "bad policy setting {}: {} (see `policy get`)",
                e.path(),
                capybara_confkit::plain_types(&e.inner().to_string(), "an object")
            ))
        })?;
    let known = serde_json::to_value(&p).unwrap_or_default();
    if let Some(k) = patch.keys().find(|k| known.get(k.as_str()).is_none()) {
        return Err(CtlError::Usage(format!(
            "unknown policy key {k:?} (see `policy get`)"
        )));
    }
    let p = apis::policy_api::patch_policy(cfg, p)
        .await
        .map_err(api_err)?;
    let v = serde_json::to_value(&p).unwrap_or_default();
    for k in patch.keys() {
        println!(
            "{k}={}",
            v.get(k)
                .map(|x| x
                    .as_str()
                    .map(str::to_string)
                    .unwrap_or_else(|| x.to_string()))
                .unwrap_or_default()
        );
    }
    Ok(())
}

/// The services that draining `id` leaves with no server to place new
/// connections on (every other member drained, draining, stopping,
/// stopped, dead, never seen or at weight 0; an empty pool counts every
/// registered server). `None` when the API does not answer: the drain goes
/// on, only the warning is lost.
async fn services_left_without(cfg: &Configuration, id: i64) -> Option<Vec<String>> {
    let servers = apis::servers_api::list_servers(cfg).await.ok()?.items;
    let services = apis::services_api::list_services(cfg).await.ok()?.items;
    let available: Vec<(i64, bool)> = servers
        .iter()
        .map(|s| {
            let live = s.liveness == models::ServerLiveness::Live;
            (
                s.id,
                live && s.state == models::ServerState::Active && s.weight > 0,
            )
        })
        .collect();
    let all: Vec<i64> = available.iter().map(|(s, _)| *s).collect();
    // Who can take the service's connections: switchd's resolved pool
    // (`serving.members`) without the members whose hostagent does not
    // serve the VIP:port (`not_serving`); the store's pool (empty: every
    // server) while switchd does not answer. The store's pool alone named
    // no service that only the drained server's hostagent serves. With
    // `serving.placing` (a switchd that reports it), who takes new
    // connections is switchd's word, not the API's server list.
    let pools: Vec<ServicePool> = services
        .iter()
        .map(|s| ServicePool {
            name: s.name.clone(),
            members: service_members(s, &all),
            placing: s.serving.as_ref().and_then(|v| v.placing.clone()),
        })
        .collect();
    Some(left_without(id, &available, &pools))
}

/// A service as [`left_without`] weighs it.
struct ServicePool {
    name: String,
    /// The servers that can take its connections ([`service_members`]).
    members: Vec<i64>,
    /// switchd's `serving.placing`: the servers new connections are placed
    /// on right now; `None` when switchd is too old to say or did not
    /// answer.
    placing: Option<Vec<i64>>,
}

/// The servers that can take `s`'s connections: switchd's resolved pool
/// without the members whose hostagent does not serve the VIP:port; the
/// store's pool (empty: `all`) while switchd does not answer.
fn service_members(s: &models::ServiceView, all: &[i64]) -> Vec<i64> {
    match &s.serving {
        Some(v) => {
            let not = v.not_serving.as_deref().unwrap_or_default();
            v.members
                .iter()
                .copied()
                .filter(|m| !not.contains(m))
                .collect()
        }
        None if s.pool.is_empty() => all.to_vec(),
        None => s.pool.clone(),
    }
}

/// `services_left_without` on plain data: `servers` is (id, available).
/// A service `id` takes part in (a member, or placed on) is left without
/// servers when no other server takes its new connections: by switchd's
/// `placing` when present (`[id]`, or already empty: switchd may have
/// taken `id` out of placement by the time it is read), else by the
/// members' availability in `servers`.
fn left_without(id: i64, servers: &[(i64, bool)], pools: &[ServicePool]) -> Vec<String> {
    pools
        .iter()
        .filter(|p| {
            let placing = p.placing.as_deref();
            if !p.members.contains(&id) && !placing.is_some_and(|pl| pl.contains(&id)) {
                return false;
            }
            match placing {
                Some(pl) => pl.iter().all(|m| *m == id),
                None => !p
                    .members
                    .iter()
                    .any(|m| *m != id && servers.iter().any(|(s, ok)| s == m && *ok)),
            }
        })
        .map(|p| p.name.clone())
        .collect()
}

/// How many connections a drain left and the first few (a hundred ids on
/// one line hid the message).
fn remaining_text(id: i64, remaining: &[String], left: usize) -> String {
    const SHOWN: usize = 5;
    let mut t = format!(
        "; {left} {}: {}",
        if left == 1 {
            "connection remains"
        } else {
            "connections remain"
        },
        remaining[..remaining.len().min(SHOWN)].join(" ")
    );
    if left > SHOWN.min(remaining.len()) {
        t.push_str(&format!(
            " and {} more (`capybara ctl connections --server {id}` lists them)",
            left - SHOWN.min(remaining.len())
        ));
    }
    t
}

fn drain_state_str(s: models::DrainState) -> &'static str {
    match s {
        models::DrainState::Running => "running",
        models::DrainState::Completed => "completed",
        models::DrainState::Cancelled => "cancelled",
        models::DrainState::TimedOut => "timed_out",
    }
}

fn progress_line(d: &models::Drain) -> String {
    let p = &d.progress;
    let done = p.flows_total - p.flows_remaining.min(p.flows_total);
    let width = 30usize;
    let filled = if p.flows_total == 0 {
        width
    } else {
        (done as usize * width) / p.flows_total as usize
    };
    format!(
        "[{}{}] {done}/{} moved or closed, {} remaining ({})",
        "#".repeat(filled),
        "-".repeat(width - filled),
        p.flows_total,
        p.flows_remaining,
        drain_state_str(d.state)
    )
}

async fn drain(cfg: &Configuration, id: i64, a: &Args) -> Result<(), CtlError> {
    let deadline = match a.value("--deadline") {
        Some(d) => parse_duration(d)
            .filter(|t| t.subsec_nanos() == 0 && (1..=86_400).contains(&t.as_secs()))
            .ok_or_else(|| {
                CtlError::Usage(format!(
                    "--deadline: expected whole seconds from 1s to 24h (e.g. 30s, 5m), got {d:?}"
                ))
            })?,
        None => Duration::from_secs(30),
    };
    // In [1, 86400] (checked above): fits.
    let secs = deadline.as_secs() as i32;
    let mode = if a.has("--force") {
        models::DrainMode::Force
    } else {
        models::DrainMode::Migrate
    };
    let req = models::DrainRequest {
        deadline_seconds: Some(secs),
        mode: Some(mode),
        targets: None,
    };
    // The API answers a retried drain with the drain the server already has;
    // the drain running before the request tells a retry from a new start
    // (its start time, not this host's clock).
    let running_before = apis::servers_api::get_drain(cfg, id)
        .await
        .ok()
        .filter(|d| d.state == models::DrainState::Running)
        .map(|d| d.started_unix_ms);
    let d = apis::servers_api::drain_server(cfg, id, Some(req))
        .await
        .map_err(api_err)?;
    // A new drain always starts `running`: `completed` is the earlier drain.
    if d.state == models::DrainState::Completed {
        let p = &d.progress;
        eprintln!(
            "server {id} is already drained: its drain completed ({} migrated, {} closed of {}); nothing to do (`capybara ctl undrain {id}` returns it to service)",
            p.flows_migrated, p.flows_closed, p.flows_total
        );
        println!("{}", drain_state_str(d.state));
        return Ok(());
    }
    if running_before == Some(d.started_unix_ms) {
        eprintln!(
            "server {id} is already draining (not restarted): {} of {} connections remain, deadline {} s after its start",
            d.progress.flows_remaining,
            d.progress.flows_total,
            (d.deadline_unix_ms - d.started_unix_ms) / 1000
        );
    } else {
        eprintln!(
            "draining server {id}: {} connections, deadline in {secs} s",
            d.progress.flows_total
        );
    }
    // Accepted, but worth saying: a service left with no server to place
    // on refuses every new connection until one comes back.
    if let Some(left) = services_left_without(cfg, id).await {
        for name in left {
            eprintln!(
                "warning: service {name} has no other active server with a weight above 0: it refuses new connections until one is back (`capybara ctl undrain {id}`)"
            );
        }
    }
    if !a.has("--wait") {
        println!("{}", drain_state_str(d.state));
        return Ok(());
    }
    let tty = std::io::stderr().is_terminal();
    // Bounded: the server ends every drain at its deadline; allow slack.
    let give_up = Instant::now() + deadline + Duration::from_secs(30);
    let mut last = String::new();
    loop {
        let d = apis::servers_api::get_drain(cfg, id)
            .await
            .map_err(api_err)?;
        let line = progress_line(&d);
        if line != last {
            if tty {
                eprint!("\r{line}");
            } else {
                eprintln!("{line}");
            }
            std::io::stderr().flush().ok();
            last = line;
        }
        match d.state {
            models::DrainState::Running => {}
            models::DrainState::Completed => {
                if tty {
                    eprintln!();
                }
                println!("completed");
                return Ok(());
            }
            other => {
                if tty {
                    eprintln!();
                }
                let mut msg = format!("drain of server {id} ended {}", drain_state_str(other));
                if !d.remaining.is_empty() {
                    let left = (d.progress.flows_remaining as usize).max(d.remaining.len());
                    msg.push_str(&remaining_text(id, &d.remaining, left));
                }
                println!("{}", drain_state_str(other));
                return Err(CtlError::DrainIncomplete(msg));
            }
        }
        if Instant::now() > give_up {
            return Err(CtlError::DrainIncomplete(format!(
                "drain of server {id} still running after its deadline"
            )));
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

fn outcome_str(o: models::MigrationOutcome) -> &'static str {
    match o {
        models::MigrationOutcome::InProgress => "in_progress",
        models::MigrationOutcome::Succeeded => "succeeded",
        models::MigrationOutcome::Rejected => "rejected",
        models::MigrationOutcome::Aborted => "aborted",
        models::MigrationOutcome::TimedOut => "timed_out",
    }
}

/// `audit`: the newest `--limit` entries (`order=desc`), printed oldest
/// first so that the newest is the last line.
async fn audit(cfg: &Configuration, a: &Args) -> Result<(), CtlError> {
    let limit = match a.value("--limit") {
        None => 20,
        Some(l) => l
            .parse::<i32>()
            .ok()
            .filter(|n| (1..=10_000).contains(n))
            .ok_or_else(|| CtlError::Usage(format!("--limit must be 1 to 10000, got {l:?}")))?,
    };
    let mut list = apis::audit_api::list_audit(cfg, None, Some(limit), Some("desc"))
        .await
        .map_err(api_err)?;
    list.items.reverse();
    println!(
        "{:>6}  {:<24} {:<12} {:<18} {:<16} DETAIL",
        "SEQ", "TIME", "ACTOR", "ACTION", "TARGET"
    );
    for e in &list.items {
        let detail: std::collections::BTreeMap<_, _> = e.detail.iter().collect();
        println!(
            "{:>6}  {:<24} {:<12} {:<18} {:<16} {}",
            e.seq,
            utc_ms(e.at_unix_ms),
            e.actor,
            e.action,
            e.target,
            serde_json::to_string(&detail).unwrap_or_default()
        );
    }
    Ok(())
}

/// `ms` since the Unix epoch as `YYYY-MM-DDTHH:MM:SS.mmmZ` (UTC).
fn utc_ms(ms: i64) -> String {
    let (days, in_day) = (ms.div_euclid(86_400_000), ms.rem_euclid(86_400_000));
    // Civil date from days since 1970-01-01 (proleptic Gregorian): eras of
    // 400 years (146097 days) starting on March 1st.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{:03}Z",
        in_day / 3_600_000,
        in_day / 60_000 % 60,
        in_day / 1000 % 60,
        in_day % 1000
    )
}

async fn migrations(cfg: &Configuration, a: &Args) -> Result<(), CtlError> {
    let follow = a.has("--follow");
    let stop_after = match a.value("--for") {
        Some(d) => Some(
            parse_duration(d)
                .ok_or_else(|| CtlError::Usage(format!("--for: bad duration {d:?}")))?,
        ),
        None => None,
    };
    if stop_after.is_some() && !follow {
        return Err(CtlError::Usage("--for goes with --follow".into()));
    }
    let limit = match a.value("--limit") {
        None => 1000,
        Some(l) => l
            .parse::<i32>()
            .ok()
            .filter(|n| (1..=10_000).contains(n))
            .ok_or_else(|| CtlError::Usage(format!("--limit must be 1 to 10000, got {l:?}")))?,
    };
    let started = Instant::now();
    println!(
        "{:>8}  {:<34} {:>6} {:>6} {:<11} {:>10}",
        "ID", "CONNECTION", "FROM", "TO", "OUTCOME", "TOTAL_US"
    );
    // The newest `limit` (the API's default order is oldest first), printed
    // oldest first so that the newest is the last line; then, with
    // --follow, what comes after them.
    let mut list = apis::migrations_api::list_migrations(cfg, None, Some(limit), Some("desc"))
        .await
        .map_err(api_err)?;
    list.items.reverse();
    let mut after = 0i64;
    loop {
        for m in &list.items {
            let total = m
                .phases
                .total_us
                .flatten()
                .map(|t| t.to_string())
                .unwrap_or_else(|| "-".into());
            let to = m
                .target
                .flatten()
                .map(|t| t.to_string())
                .unwrap_or_else(|| "-".into());
            println!(
                "{:>8}  {:<34} {:>6} {:>6} {:<11} {:>10}",
                m.id,
                m.connection,
                m.origin,
                to,
                outcome_str(m.outcome),
                total
            );
            after = after.max(m.id);
        }
        std::io::stdout().flush().ok();
        if !follow || stop_after.is_some_and(|d| started.elapsed() >= d) {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        list = apis::migrations_api::list_migrations(cfg, Some(after), Some(1000), None)
            .await
            .map_err(api_err)?;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `ctl audit`'s times: UTC, milliseconds, leap days and before 1970.
    #[test]
    fn audit_times_are_utc() {
        assert_eq!(utc_ms(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(utc_ms(1_700_000_000_123), "2023-11-14T22:13:20.123Z");
        assert_eq!(utc_ms(951_782_400_000), "2000-02-29T00:00:00.000Z");
        assert_eq!(utc_ms(-1), "1969-12-31T23:59:59.999Z");
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("30s"), Some(Duration::from_secs(30)));
        assert_eq!(parse_duration("2m"), Some(Duration::from_secs(120)));
        assert_eq!(parse_duration("45"), Some(Duration::from_secs(45)));
        assert_eq!(parse_duration("500ms"), Some(Duration::from_millis(500)));
        assert_eq!(parse_duration("x"), None);
        assert_eq!(parse_duration("3d"), None);
    }

    #[test]
    fn retiring_services_are_one_line_each() {
        let mut r = models::RetiringService::new("api".into(), "198.18.100.2".into(), 8080, 64_000);
        r.connections = Some(3);
        r.timeout_in_ms = Some(236_000);
        let line = retiring_line(&r);
        assert!(line.starts_with("api "), "{line}");
        assert!(line.contains("198.18.100.2:8080"), "{line}");
        assert!(line.contains(" 3  1m 04s ago"), "{line}");
        assert!(line.ends_with("3m 56s"), "{line}");
        let r = models::RetiringService::new("old".into(), "198.18.100.3".into(), 80, 1_250);
        let line = retiring_line(&r);
        assert!(line.contains(" ?  1.2s ago"), "{line}");
        assert!(line.ends_with("- (not reported)"), "{line}");
        assert_eq!(fmt_ms(7_500_000), "2h 05m");
    }

    #[test]
    fn every_command_has_a_help_naming_its_flags() {
        for (key, help) in COMMAND_HELP {
            let first = help.lines().next().unwrap();
            assert!(
                first.starts_with(&format!("usage: capybara ctl {key}")),
                "{key}: {first}"
            );
            assert!(help.contains("\nexample"), "{key}: no example");
            // A command's flags (`service` takes `--pool` for all its
            // subcommands, though only `add` and `set` use it).
            if !key.contains(' ') {
                for flag in command_flags(key) {
                    assert!(help.contains(flag), "{key}: {flag} not explained");
                }
            }
        }
        let pos = |s: &str| s.split(' ').map(String::from).collect::<Vec<_>>();
        for cmd in [
            "servers",
            "drain",
            "undrain",
            "weight",
            "connections",
            "migrate",
            "policy",
            "migrations",
            "audit",
            "services",
            "service",
            "server",
            "server delete",
            "ready",
        ] {
            assert_eq!(command_help(&pos(cmd)).map(|(k, _)| k), Some(cmd));
        }
        assert_eq!(
            command_help(&pos("service add api 198.18.100.2:80")).map(|(k, _)| k),
            Some("service add")
        );
        assert_eq!(
            command_help(&pos("service frob")).map(|(k, _)| k),
            Some("service")
        );
        assert_eq!(command_help(&pos("frob")), None);
    }

    /// A service's members are switchd's (its resolved pool without the
    /// servers that do not serve it) when it answers, the store's pool
    /// otherwise. Draining s3 of a service with an open pool that only
    /// s3's hostagent serves (switchd: members [3]) named nothing: the
    /// store's empty pool counted every server (seen in the demo).
    #[test]
    fn members_come_from_switchd_when_it_answers() {
        let all = [1, 2, 3];
        let mut s = models::ServiceView::new("redis".into(), "198.18.100.1".into(), 6379, vec![]);
        assert_eq!(service_members(&s, &all), [1, 2, 3]);
        s.serving = Some(models::ServiceServing::new(
            true,
            vec![3],
            vec![],
            false,
            false,
        ));
        assert_eq!(service_members(&s, &all), [3]);
        let pools = [pool("redis", &service_members(&s, &all))];
        let servers = [(1, true), (2, true), (3, true)];
        assert_eq!(left_without(3, &servers, &pools), ["redis"]);
        assert!(left_without(1, &servers, &pools).is_empty());
        // Named pool members whose hostagent lists other services.
        s.pool = vec![2, 3];
        let mut v = models::ServiceServing::new(true, vec![2, 3], vec![], false, false);
        v.not_serving = Some(vec![2]);
        s.serving = Some(v);
        assert_eq!(service_members(&s, &all), [3]);
        s.serving = None;
        assert_eq!(service_members(&s, &all), [2, 3]);
    }

    #[test]
    fn server_ids_are_a_number_with_one_optional_s() {
        assert_eq!(server_id("3").unwrap(), 3);
        assert_eq!(server_id("s3").unwrap(), 3);
        assert_eq!(server_id("4294967295").unwrap(), 4294967295);
        for bad in [
            "ss3",
            "+3",
            "s",
            "",
            "0",
            "s0",
            "-1",
            "3s",
            "4294967296",
            "s 3",
        ] {
            assert!(server_id(bad).is_err(), "{bad:?}");
        }
    }

    /// A service as `left_without` weighs it, from a switchd too old to
    /// report `placing`.
    fn pool(name: &str, members: &[i64]) -> ServicePool {
        ServicePool {
            name: name.to_string(),
            members: members.to_vec(),
            placing: None,
        }
    }

    /// Draining the last server a service can place on is named; other
    /// services, or one with another available member, are not.
    #[test]
    fn drains_that_leave_a_service_without_servers_are_named() {
        let servers = [(1, true), (2, false), (3, true)];
        let pools = [
            pool("all", &[1, 2, 3]),
            pool("one", &[1]),
            pool("one_and_drained", &[1, 2]),
            pool("other", &[3]),
        ];
        assert_eq!(
            left_without(1, &servers, &pools),
            ["one", "one_and_drained"]
        );
        assert_eq!(left_without(3, &servers, &pools), ["other"]);
        assert_eq!(
            left_without(3, &[(1, false), (3, true)], &pools),
            ["all", "other"]
        );
        assert!(left_without(2, &servers, &pools).is_empty());
    }

    /// With switchd's `placing`, who takes new connections is its word:
    /// the API's server list is not read. A drain is named when it leaves
    /// `placing` empty, whether switchd still places on the drained server
    /// (`[1]`) or already took it out (`[]`); a service the drained server
    /// takes no part in is not.
    #[test]
    fn drains_that_leave_placing_empty_are_named() {
        // The API thinks every server is available: it does not count.
        let servers = [(1, true), (2, true), (3, true)];
        let with = |name: &str, members: &[i64], placing: &[i64]| ServicePool {
            placing: Some(placing.to_vec()),
            ..pool(name, members)
        };
        let pools = [
            // switchd places only on 1 (2 and 3 drained, dead, ...).
            with("only_1", &[1, 2, 3], &[1]),
            // switchd already took 1 out: nobody left.
            with("1_taken_out", &[1, 2], &[]),
            with("1_and_3", &[1, 2, 3], &[1, 3]),
            // 1 takes no part in it: not its drain's doing.
            with("2_and_3", &[2, 3], &[2]),
            // An older switchd: the old computation, servers 2 and 3 count.
            pool("old_switchd", &[1, 2]),
        ];
        assert_eq!(left_without(1, &servers, &pools), ["only_1", "1_taken_out"]);
        assert_eq!(
            left_without(2, &servers, &pools),
            ["1_taken_out", "2_and_3"]
        );
        assert!(left_without(3, &servers, &pools).is_empty());
        // Placed on though not in the members (a pool that changed between
        // switchd's two reads): named.
        assert_eq!(left_without(3, &servers, &[with("s", &[1], &[3])]), ["s"]);
        // Absent `placing` falls back: 2 unavailable leaves 1 alone.
        let old = [pool("old_switchd", &[1, 2])];
        assert_eq!(
            left_without(1, &[(1, true), (2, false)], &old),
            ["old_switchd"]
        );
        assert!(left_without(1, &servers, &old).is_empty());
    }

    #[test]
    fn a_drains_remaining_connections_are_counted_and_the_first_named() {
        let ids: Vec<String> = (1..=7).map(|i| format!("c{i}")).collect();
        assert_eq!(
            remaining_text(2, &ids[..1], 1),
            "; 1 connection remains: c1"
        );
        assert_eq!(
            remaining_text(2, &ids[..5], 5),
            "; 5 connections remain: c1 c2 c3 c4 c5"
        );
        assert_eq!(
            remaining_text(2, &ids, 100),
            "; 100 connections remain: c1 c2 c3 c4 c5 and 95 more (`capybara ctl connections --server 2` lists them)"
        );
    }

    #[test]
    fn served_by_is_never_blank() {
        let v = |members: Vec<i64>, down: Vec<i64>| {
            models::ServiceServing::new(true, members, down, false, false)
        };
        assert_eq!(
            served_by(Some(&v(vec![], vec![]))),
            "none (no server serves it)"
        );
        assert_eq!(served_by(Some(&v(vec![1, 3], vec![]))), "1,3");
        assert_eq!(
            served_by(Some(&v(vec![1, 3], vec![3]))),
            "1,3 (app down on 3)"
        );
        assert_eq!(served_by(None), "- (switchd did not answer)");
        let mut unserved = v(vec![1, 3], vec![]);
        unserved.not_serving = Some(vec![3]);
        assert_eq!(
            served_by(Some(&unserved)),
            "1,3 (server 3 does not serve it: no new connections go there)"
        );
        unserved.not_serving = Some(vec![1, 3]);
        assert_eq!(
            served_by(Some(&unserved)),
            "1,3 (servers 1,3 do not serve it: no new connections go there)"
        );
        let refusing = models::ServiceServing::new(true, vec![1, 2], vec![], false, true);
        assert_eq!(
            served_by(Some(&refusing)),
            "1,2 (refusing new connections: every server drained, at weight 0, dead or not serving it)"
        );
        // Refusing with no member (every server drained): both said.
        let none = models::ServiceServing::new(true, vec![], vec![], false, true);
        assert_eq!(
            served_by(Some(&none)),
            "none (no server serves it) (refusing new connections: every server drained, at weight 0, dead or not serving it)"
        );
        // SERVED BY is who takes new connections (`placing`), not the pool.
        let mut p = v(vec![1, 2, 3], vec![]);
        p.placing = Some(vec![1, 2]);
        assert_eq!(served_by(Some(&p)), "1,2");
        p.placing = Some(vec![]);
        assert_eq!(served_by(Some(&p)), "none (pool 1,2,3)");
        p.placing = None;
        assert_eq!(served_by(Some(&p)), "1,2,3", "an older switchd: its pool");
        // Not read yet, or read and refused (with switchd's reason): was
        // "pending" for both, forever for a refused one.
        use models::service_serving::State;
        let mut n = models::ServiceServing::new(false, vec![], vec![], false, false);
        n.state = Some(State::Pending);
        assert_eq!(served_by(Some(&n)), SERVICE_PENDING);
        n.state = Some(State::Refused);
        n.refused_reason = Some("198.18.100.1:7 is already the address of service \"echo\"".into());
        assert_eq!(
            served_by(Some(&n)),
            "refused: 198.18.100.1:7 is already the address of service \"echo\""
        );
    }

    #[test]
    fn usage_errors_list_the_arguments_as_typed() {
        assert_eq!(args_text(&[]), "none");
        assert_eq!(args_text(&["1"]), "1 argument: 1");
        assert_eq!(args_text(&["1", "s2"]), "2 arguments: 1 s2");
    }

    #[test]
    fn policy_values() {
        assert_eq!(policy_value("true"), Value::Bool(true));
        assert_eq!(policy_value("12.5"), serde_json::json!(12.5));
        assert_eq!(
            policy_value("least_loaded"),
            Value::String("least_loaded".into())
        );
    }
}
