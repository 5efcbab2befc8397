//! `capybara`: the appliance binary.
//!
//! ```text
//! capybara run CONFIG          switchd + api + dashboard from one config file
//! capybara --config CONFIG     the same
//! capybara --check CONFIG      validate the config (and the key file), exit
//! capybara lab ...             the network-namespace lab
//! capybara ctl ...             operate a running appliance through its REST API
//! ```
//!
//! Every bad flag or config value ends in one line on stderr naming the
//! value, and exit status 2.

mod appliance;
mod lab;

use clap::{Args, Parser, Subcommand};
use lab::fault::{self, Direction, FaultSpec};
use lab::plan::{self, LabPlan, Node};
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "capybara",
    version,
    about = "Capybara: live TCP migration load balancer"
)]
struct Cli {
    /// Run the appliance from this config file (same as `capybara run CONFIG`).
    #[arg(long, value_name = "CONFIG", conflicts_with = "check")]
    config: Option<String>,
    /// Validate this appliance config file (and the deployment key), then exit.
    #[arg(long, value_name = "CONFIG")]
    check: Option<String>,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Run switchd, the REST API and the dashboard from one config file
    /// (docs/OPERATIONS.md); SIGTERM/SIGINT stops gracefully.
    Run {
        /// The appliance config (TOML).
        config: String,
    },
    /// Build, inspect and tear down the network-namespace lab.
    Lab {
        #[command(subcommand)]
        command: LabCommand,
    },
    /// Operate a running appliance through its REST API: `capybara ctl
    /// servers`, `drain SERVER --deadline 30s --wait`, `undrain`, `weight`,
    /// `connections`, `migrate`, `policy get|set`, `migrations --follow`,
    /// `services` (`ctl --help`).
    #[command(disable_help_flag = true)]
    Ctl {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
}

#[derive(Args)]
struct PrefixArg {
    /// Name prefix of every namespace of the lab (default: $CAPYBARA_LAB_PREFIX or "cpb").
    #[arg(long)]
    prefix: Option<String>,
}

#[derive(Subcommand)]
enum LabCommand {
    /// Create the lab (idempotent): clients, a switch and N servers.
    Up {
        #[command(flatten)]
        prefix: PrefixArg,
        /// Number of servers (1-200, default 3).
        #[arg(long)]
        servers: Option<String>,
        /// Number of clients (1-200, default 1).
        #[arg(long)]
        clients: Option<String>,
        /// A TOML file with `prefix`, `servers`, `clients`; flags override it.
        #[arg(long)]
        config: Option<String>,
    },
    /// Remove every namespace, interface, process and pinned object of the lab.
    Down {
        #[command(flatten)]
        prefix: PrefixArg,
    },
    /// Show the lab's nodes and addresses.
    Status {
        #[command(flatten)]
        prefix: PrefixArg,
    },
    /// Run a command inside a node: `capybara lab exec s1 -- ip addr`.
    Exec {
        #[command(flatten)]
        prefix: PrefixArg,
        /// sw, c1.., s1..
        node: String,
        #[arg(last = true, required = true)]
        cmd: Vec<String>,
    },
    /// Inject packet loss, duplication or delay on a node's interface (eBPF).
    Fault {
        #[command(flatten)]
        prefix: PrefixArg,
        /// sw, c1.., s1..
        node: String,
        /// Interface inside the node (default: eth0; in the switch: cl1.., sv1..).
        #[arg(long, default_value = "eth0")]
        iface: String,
        /// Fraction of packets to drop: 0.1 or 10%.
        #[arg(long)]
        drop: Option<String>,
        /// Fraction of packets to duplicate.
        #[arg(long)]
        duplicate: Option<String>,
        /// Delay in microseconds (needs the fq qdisc).
        #[arg(long)]
        delay_us: Option<String>,
        /// Fraction of packets to delay (default 1 when --delay-us is given).
        #[arg(long)]
        delay_fraction: Option<String>,
        /// Act on packets the node sends instead of those it receives. (Drops
        /// on egress are reported to local senders, who then retry: ingress,
        /// the default, behaves like a lossy wire.)
        #[arg(long)]
        egress: bool,
        /// Remove the injector.
        #[arg(long)]
        clear: bool,
        /// Print the injector's counters.
        #[arg(long)]
        stats: bool,
    },
}

/// One-line user error: printed as `capybara: ...`, exit status 2.
struct UsageError(String);

impl From<lab::LabError> for UsageError {
    fn from(e: lab::LabError) -> Self {
        UsageError(e.to_string())
    }
}

fn prefix_of(p: &PrefixArg) -> Result<String, UsageError> {
    let prefix = p
        .prefix
        .clone()
        .or_else(|| std::env::var("CAPYBARA_LAB_PREFIX").ok())
        .unwrap_or_else(|| "cpb".to_string());
    plan::validate_prefix(&prefix).map_err(UsageError)?;
    Ok(prefix)
}

fn parse_count(flag: &str, s: &str, max: u32) -> Result<u32, UsageError> {
    match s.trim().parse::<u32>() {
        Ok(n) if (1..=max).contains(&n) => Ok(n),
        _ => Err(UsageError(format!(
            "invalid {flag} value {s:?}: expected an integer from 1 to {max}"
        ))),
    }
}

#[derive(serde::Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct LabConfigFile {
    prefix: Option<String>,
    // A type error names the range `parse_count` holds them to.
    #[serde(
        default,
        deserialize_with = "lab_count::<_, { lab::plan::MAX_SERVERS as i128 }>"
    )]
    servers: Option<u32>,
    #[serde(
        default,
        deserialize_with = "lab_count::<_, { lab::plan::MAX_CLIENTS as i128 }>"
    )]
    clients: Option<u32>,
}

/// `servers` or `clients` of a lab config: 1 to `MAX`.
fn lab_count<'de, D: serde::Deserializer<'de>, const MAX: i128>(
    d: D,
) -> Result<Option<u32>, D::Error> {
    capybara_confkit::int_in::<_, u32, 1, MAX>(d).map(Some)
}

fn load_config(path: &str) -> Result<LabConfigFile, UsageError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| UsageError(format!("cannot read lab config {path}: {e}")))?;
    toml::from_str(&text).map_err(|e| {
        // toml's messages do not always name the key; quote the line instead.
        UsageError(format!(
            "invalid lab config {path}: {}",
            capybara_confkit::parse_error(e.message(), &text, e.span().map(|s| s.start))
        ))
    })
}

fn node_of(s: &str, plan_prefix: &str) -> Result<Node, UsageError> {
    Node::parse(s).ok_or_else(|| {
        UsageError(format!(
            "invalid node {s:?} for lab {plan_prefix}: expected sw, c1.. or s1.."
        ))
    })
}

fn lab_command(cmd: LabCommand) -> Result<ExitCode, UsageError> {
    match cmd {
        LabCommand::Up {
            prefix,
            servers,
            clients,
            config,
        } => {
            let file = match &config {
                Some(path) => load_config(path)?,
                None => LabConfigFile::default(),
            };
            let prefix = match (&prefix.prefix, file.prefix) {
                (None, Some(p)) => {
                    plan::validate_prefix(&p).map_err(UsageError)?;
                    p
                }
                _ => prefix_of(&prefix)?,
            };
            let servers = match servers {
                Some(s) => parse_count("--servers", &s, plan::MAX_SERVERS)?,
                None => {
                    let n = file.servers.unwrap_or(3);
                    parse_count("servers", &n.to_string(), plan::MAX_SERVERS)?
                }
            };
            let clients = match clients {
                Some(s) => parse_count("--clients", &s, plan::MAX_CLIENTS)?,
                None => {
                    let n = file.clients.unwrap_or(1);
                    parse_count("clients", &n.to_string(), plan::MAX_CLIENTS)?
                }
            };
            let p = LabPlan {
                prefix,
                clients,
                servers,
            };
            lab::up(&p)?;
            println!(
                "lab {} up: switch {}, {} client(s), {} server(s)",
                p.prefix,
                p.namespace(Node::Switch),
                clients,
                servers
            );
            Ok(ExitCode::SUCCESS)
        }
        LabCommand::Down { prefix } => {
            let prefix = prefix_of(&prefix)?;
            let removed = lab::down(&prefix)?;
            println!("lab {prefix} down: removed {} namespace(s)", removed.len());
            Ok(ExitCode::SUCCESS)
        }
        LabCommand::Status { prefix } => {
            print!("{}", lab::status(&prefix_of(&prefix)?)?);
            Ok(ExitCode::SUCCESS)
        }
        LabCommand::Exec { prefix, node, cmd } => {
            let prefix = prefix_of(&prefix)?;
            let node = node_of(&node, &prefix)?;
            let ns = format!("{prefix}-{}", node.short());
            if !lab::lab_namespaces(&prefix)?.contains(&ns) {
                return Err(UsageError(format!(
                    "no node {ns}: is the lab up? (capybara lab up)"
                )));
            }
            use std::os::unix::process::CommandExt;
            let err = std::process::Command::new("ip")
                .args(["netns", "exec", &ns])
                .args(&cmd)
                .exec();
            Err(UsageError(format!("cannot run ip netns exec: {err}")))
        }
        LabCommand::Fault {
            prefix,
            node,
            iface,
            drop,
            duplicate,
            delay_us,
            delay_fraction,
            egress,
            clear,
            stats,
        } => {
            let prefix = prefix_of(&prefix)?;
            let node = node_of(&node, &prefix)?;
            let ns = format!("{prefix}-{}", node.short());
            let pins = plan::pin_dir(&prefix);
            if clear {
                fault::clear(&pins, &ns, &iface)?;
                println!("fault injector removed from {ns}/{iface}");
                return Ok(ExitCode::SUCCESS);
            }
            if stats {
                let s = fault::stats(&pins, &ns, &iface)?;
                println!(
                    "seen={} dropped={} duplicated={} delayed={}",
                    s.seen, s.dropped, s.duplicated, s.delayed
                );
                return Ok(ExitCode::SUCCESS);
            }
            let frac = |what: &str, v: &Option<String>| -> Result<f64, UsageError> {
                v.as_deref().map_or(Ok(0.0), |s| {
                    fault::parse_fraction(what, s).map_err(UsageError)
                })
            };
            let delay_us = match delay_us {
                Some(s) => s
                    .trim()
                    .parse::<u32>()
                    .ok()
                    .filter(|v| *v <= 10_000_000)
                    .ok_or_else(|| {
                        UsageError(format!(
                            "invalid --delay-us value {s:?}: expected 0 to 10000000"
                        ))
                    })?,
                None => 0,
            };
            let spec = FaultSpec {
                drop: frac("--drop", &drop)?,
                duplicate: frac("--duplicate", &duplicate)?,
                delay_fraction: if delay_fraction.is_some() {
                    frac("--delay-fraction", &delay_fraction)?
                } else if delay_us > 0 {
                    1.0
                } else {
                    0.0
                },
                delay_us,
                direction: if egress {
                    Direction::Egress
                } else {
                    Direction::Ingress
                },
            };
            fault::apply(&pins, &ns, &iface, spec)?;
            println!(
                "fault injector on {ns}/{iface} ({}): drop={} duplicate={} delay={}us x {}",
                match spec.direction {
                    Direction::Ingress => "ingress",
                    Direction::Egress => "egress",
                },
                spec.drop,
                spec.duplicate,
                spec.delay_us,
                spec.delay_fraction
            );
            Ok(ExitCode::SUCCESS)
        }
    }
}

fn load_appliance(path: &str) -> Result<appliance::config::ApplianceConfig, UsageError> {
    appliance::config::ApplianceConfig::load(std::path::Path::new(path))
        .map_err(|e| UsageError(e.to_string()))
}

fn check_command(path: &str) -> Result<ExitCode, UsageError> {
    let cfg = load_appliance(path)?;
    cfg.check_files().map_err(|e| UsageError(e.to_string()))?;
    if let Some(w) = cfg.switchd.as_ref().and_then(|sw| sw.key_file_warning()) {
        eprintln!("capybara: {w}");
    }
    println!("capybara: config {path} OK: {}", cfg.summary());
    Ok(ExitCode::SUCCESS)
}

fn run_command(path: &str) -> Result<ExitCode, UsageError> {
    let cfg = load_appliance(path)?;
    cfg.check_files().map_err(|e| UsageError(e.to_string()))?;
    match appliance::run(cfg) {
        Ok(()) => Ok(ExitCode::SUCCESS),
        Err(e) => {
            eprintln!("capybara: {e:#}");
            Ok(ExitCode::from(1))
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match (cli.command, cli.check, cli.config) {
        (Some(_), Some(_), _) | (Some(_), _, Some(_)) => Err(UsageError(
            "--check/--config cannot be combined with a subcommand".into(),
        )),
        (None, Some(path), _) => check_command(&path),
        (None, None, Some(path)) => run_command(&path),
        (None, None, None) => Err(UsageError(
            "nothing to do: `capybara run CONFIG`, `capybara --check CONFIG`, `capybara lab ...` or `capybara ctl ...` (--help)".into(),
        )),
        (Some(Command::Run { config }), None, None) => run_command(&config),
        (Some(Command::Lab { command }), None, None) => lab_command(command),
        (Some(Command::Ctl { args }), None, None) => {
            let code = capybara_api::ctl::ctl_main(args);
            return ExitCode::from(u8::try_from(code).unwrap_or(1));
        }
    };
    match result {
        Ok(code) => code,
        Err(UsageError(msg)) => {
            eprintln!("capybara: {msg}");
            ExitCode::from(2)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A lab config's errors are one line naming the line, and a count of
    /// the wrong type names the range `--servers` and `--clients` take.
    #[test]
    fn lab_config_errors_name_the_line_and_the_range() {
        let path = std::env::temp_dir().join(format!("capybara-labcfg-{}", std::process::id()));
        let load = |text: &str| {
            std::fs::write(&path, text).unwrap();
            load_config(path.to_str().unwrap())
        };
        let c = load("prefix = \"cb\"\nservers = 5\n").unwrap_or_else(|e| panic!("{}", e.0));
        assert_eq!((c.servers, c.clients), (Some(5), None));
        let e = load("prefix = \"cb\"\nservers = \"5\"\n").err().unwrap().0;
        assert!(
            e.ends_with(": invalid type: string \"5\", expected an integer from 1 to 200 (line 2: servers = \"5\")"),
            "{e}"
        );
        // What fits the type and not the range: parse_count's words.
        assert!(load("clients = 0\n").is_ok());
        assert_eq!(
            parse_count("clients", "0", lab::plan::MAX_CLIENTS)
                .err()
                .unwrap()
                .0,
            "invalid clients value \"0\": expected an integer from 1 to 200"
        );
        let _ = std::fs::remove_file(&path);
    }
}
