//! `capybara ctl`: the operators' command line, on the generated Rust client
//! (`clients/rust`).
//!
//! ```text
//! capybara ctl [--api URL] [--token TOKEN] COMMAND
//!   servers                               list servers with state, weight, connections
//!   drain SERVER [--deadline 30s] [--force] [--wait]
//!   undrain SERVER
//!   migrate CONN [--target SERVER]
//!   policy get | policy set KEY=VALUE...
//!   migrations [--follow [--for 10s]]
//!   services
//! ```
//! `--api` and `--token` default to `CAPYBARA_API` and `CAPYBARA_TOKEN`.
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
  migrate CONN [--target SERVER]
  policy get
  policy set KEY=VALUE [KEY=VALUE...]
  migrations [--follow [--for DURATION]]
  services
environment: CAPYBARA_API (default http://127.0.0.1:8080), CAPYBARA_TOKEN";

#[derive(Debug)]
enum CtlError {
    Usage(String),
    Api(String),
    DrainIncomplete(String),
}

impl std::fmt::Display for CtlError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CtlError::Usage(m) => write!(f, "{m}\n{USAGE}"),
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
                .unwrap_or(r.content);
            CtlError::Api(format!("API error {}: {detail}", r.status.as_u16()))
        }
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
}

impl Args {
    /// Flags that take a value.
    const VALUED: [&'static str; 5] = ["--api", "--token", "--deadline", "--target", "--for"];

    fn parse(args: Vec<String>) -> Result<Self, CtlError> {
        let mut positional = Vec::new();
        let mut flags = Vec::new();
        let mut it = args.into_iter();
        while let Some(a) = it.next() {
            if let Some((k, v)) = a.split_once('=').filter(|(k, _)| k.starts_with("--")) {
                flags.push((k.to_string(), Some(v.to_string())));
            } else if Self::VALUED.contains(&a.as_str()) {
                let v = it
                    .next()
                    .ok_or_else(|| CtlError::Usage(format!("{a} needs a value")))?;
                flags.push((a, Some(v)));
            } else if a.starts_with("--") {
                flags.push((a, None));
            } else {
                positional.push(a);
            }
        }
        Ok(Args { positional, flags })
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
}

/// Runs `capybara ctl` with `args` (without the program name and `ctl`);
/// returns the process exit code.
pub fn ctl_main(args: Vec<String>) -> i32 {
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
                CtlError::Usage(_) => 2,
                CtlError::Api(_) => 1,
                CtlError::DrainIncomplete(_) => 3,
            }
        }
    }
}

fn server_id(s: &str) -> Result<i64, CtlError> {
    s.trim_start_matches('s')
        .parse::<i64>()
        .ok()
        .filter(|n| (1..=u32::MAX as i64).contains(n))
        .ok_or_else(|| {
            CtlError::Usage(format!(
                "SERVER must be a server id (e.g. 3 or s3), got {s:?}"
            ))
        })
}

async fn run(args: Vec<String>) -> Result<(), CtlError> {
    let a = Args::parse(args)?;
    if a.has("--help") || a.positional.is_empty() {
        return if a.has("--help") {
            println!("{USAGE}");
            Ok(())
        } else {
            Err(CtlError::Usage("no command given".into()))
        };
    }
    let mut cfg = Configuration::new();
    cfg.base_path = a
        .value("--api")
        .map(str::to_string)
        .or_else(|| std::env::var("CAPYBARA_API").ok())
        .unwrap_or_else(|| "http://127.0.0.1:8080".into())
        .trim_end_matches('/')
        .to_string();
    cfg.bearer_access_token = a
        .value("--token")
        .map(str::to_string)
        .or_else(|| std::env::var("CAPYBARA_TOKEN").ok());
    cfg.user_agent = Some("capybara-ctl".into());
    let pos: Vec<&str> = a.positional.iter().map(String::as_str).collect();
    match pos.as_slice() {
        ["servers"] => servers(&cfg).await,
        ["services"] => services(&cfg).await,
        ["drain", s] => drain(&cfg, server_id(s)?, &a).await,
        ["undrain", s] => {
            let srv = apis::servers_api::undrain_server(&cfg, server_id(s)?)
                .await
                .map_err(api_err)?;
            println!(
                "server {} ({}) is {}",
                srv.id,
                srv.name,
                state_str(srv.state)
            );
            Ok(())
        }
        ["migrate", conn] => {
            let target = a.value("--target").map(server_id).transpose()?;
            let req = models::MigrateRequest { target };
            let m = apis::connections_api::migrate_connection(&cfg, conn, Some(req))
                .await
                .map_err(api_err)?;
            println!(
                "migration {} of {} from server {} started ({:?})",
                m.id, m.connection, m.origin, m.outcome
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
        ["migrations"] => migrations(&cfg, &a).await,
        _ => Err(CtlError::Usage(format!(
            "unknown command {:?}",
            a.positional.join(" ")
        ))),
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
        "{:>5}  {:<16} {:<9} {:>6} {:>11} {:>10}  DATA_ADDR",
        "ID", "NAME", "STATE", "WEIGHT", "CONNECTIONS", "LOAD_PPS"
    );
    for s in list.items {
        let load = s
            .stats
            .load_pps
            .flatten()
            .map(|l| format!("{l:.0}"))
            .unwrap_or_else(|| "-".into());
        println!(
            "{:>5}  {:<16} {:<9} {:>6} {:>11} {:>10}  {}",
            s.id,
            s.name,
            state_str(s.state),
            s.weight,
            s.stats.connections,
            load,
            s.data_addr
        );
    }
    Ok(())
}

async fn services(cfg: &Configuration) -> Result<(), CtlError> {
    let list = apis::services_api::list_services(cfg)
        .await
        .map_err(api_err)?;
    println!("{:<20} {:<21} POOL", "NAME", "VIP:PORT");
    for s in list.items {
        let pool: Vec<String> = s.pool.iter().map(|p| p.to_string()).collect();
        println!(
            "{:<20} {:<21} {}",
            s.name,
            format!("{}:{}", s.vip, s.port),
            pool.join(",")
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
        patch.insert(k.to_string(), policy_value(v));
    }
    // Through the generated model, so an unknown key fails here with its name.
    let p: models::PolicyPatch = serde_json::from_value(Value::Object(patch.clone()))
        .map_err(|e| CtlError::Usage(format!("bad policy setting: {e}")))?;
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
        Some(d) => parse_duration(d).ok_or_else(|| {
            CtlError::Usage(format!("--deadline: bad duration {d:?} (e.g. 30s, 5m)"))
        })?,
        None => Duration::from_secs(30),
    };
    let secs = deadline.as_secs().max(1) as i32;
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
    let d = apis::servers_api::drain_server(cfg, id, req)
        .await
        .map_err(api_err)?;
    eprintln!(
        "draining server {id}: {} connections, deadline in {secs} s",
        d.progress.flows_total
    );
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
                    msg.push_str(&format!(
                        "; {} connections remain: {}",
                        d.remaining.len(),
                        d.remaining.join(" ")
                    ));
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

async fn migrations(cfg: &Configuration, a: &Args) -> Result<(), CtlError> {
    let follow = a.has("--follow");
    let stop_after = match a.value("--for") {
        Some(d) => Some(
            parse_duration(d)
                .ok_or_else(|| CtlError::Usage(format!("--for: bad duration {d:?}")))?,
        ),
        None => None,
    };
    let started = Instant::now();
    let mut after = 0i64;
    println!(
        "{:>8}  {:<34} {:>6} {:>6} {:<11} {:>10}",
        "ID", "CONNECTION", "FROM", "TO", "OUTCOME", "TOTAL_US"
    );
    loop {
        let list = apis::migrations_api::list_migrations(cfg, Some(after), Some(1000))
            .await
            .map_err(api_err)?;
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
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn policy_values() {
        assert_eq!(policy_value("true"), Value::Bool(true));
        assert_eq!(policy_value("12.5"), serde_json::json!(12.5));
        assert_eq!(
            policy_value("least_loaded"),
            Value::String("least_loaded".into())
        );
    }
}
