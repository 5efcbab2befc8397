//! `hostagent --config FILE [--check]`: runs the user-space stack on one
//! interface and serves the configured services on it.
//!
//! SIGHUP reloads every TLS sidecar's certificate and key (`sidecar::reload_tls`).
//!
//! SIGTERM/SIGINT stop it gracefully (`[shutdown] drain_timeout_ms`): it
//! tells switchd it is leaving, migrates every connection away
//! (`drain::leave`) and exits once it serves nothing, or at the deadline; a
//! second signal exits at once (docs/OPERATIONS.md, "Stopping or
//! restarting a server").
//!
//! Exit status: 0 after a clean stop (SIGINT/SIGTERM), 1 when the device
//! fails, 2 for a bad command line or configuration (one line naming the bad
//! field and value).

use capybara_hostagent::config::{App, Backend, Config, Poll};
use capybara_hostagent::migration::Migrator;
use capybara_hostagent::stack::Transports;
use capybara_hostagent::{apps, control, metrics, Stack, TcpListener};
use capybara_net::device::{Device, PollMode};
use capybara_net::iface::{Interface, InterfaceConfig};
use capybara_proto::control::MigrationTrigger;
use capybara_tcp::{Endpoint, TcpConfig};
use capybara_tcpmig::{BufferMode, Engine, EngineConfig};
use std::process::ExitCode;
use std::rc::Rc;

const HELP: &str = "usage: hostagent --config FILE [--check] [--metrics ADDR:PORT]
The Capybara server agent: the user-space TCP/IP stack on one interface, the
configured services, live migration and the registration with switchd
(docs/HOSTAGENT.md, \"Configuration\").
  --config FILE        the configuration (TOML)
  --check              validate the configuration and the files it names (the
                       migration key, a sidecar's TLS certificate and key), then
                       exit: 0 valid, 2 not (one line naming the field)
  --metrics ADDR:PORT  serve Prometheus metrics over kernel TCP there (the
                       management address)
  -h, --help           this help
SIGHUP reloads the sidecars' TLS certificates and keys (new handshakes use
them; a file that fails to load keeps the old one, logged).
SIGTERM/SIGINT migrate every connection away through switchd, then exit
(within [shutdown] drain_timeout_ms, default 20000; 0: at once); a second
SIGTERM/SIGINT exits at once.
exit status: 0 after SIGINT/SIGTERM, 1 the device failed, 2 a bad command line
or configuration";

fn usage_error(msg: impl std::fmt::Display) -> ExitCode {
    eprintln!("hostagent: {msg}");
    ExitCode::from(2)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut config_path = None;
    let mut check = false;
    let mut metrics_addr: Option<String> = None;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        // A flag's value is the next argument; a flag given last has none
        // (before, `--metrics` then ran without metrics, silently).
        let mut value = |flag: &str, what: &str| match it.next() {
            Some(v) if !v.starts_with("--") => Ok(v.clone()),
            _ => Err(usage_error(format!("{flag} needs {what} (try --help)"))),
        };
        match a.as_str() {
            "--config" => match value("--config", "FILE") {
                Ok(v) => config_path = Some(v),
                Err(code) => return code,
            },
            "--check" => check = true,
            "--metrics" => match value("--metrics", "ADDR:PORT") {
                Ok(v) => metrics_addr = Some(v),
                Err(code) => return code,
            },
            "-h" | "--help" => {
                println!("{HELP}");
                return ExitCode::SUCCESS;
            }
            other => return usage_error(format!("unknown argument {other:?} (try --help)")),
        }
    }
    let Some(path) = config_path else {
        return usage_error("missing --config FILE");
    };
    let cfg = match Config::load(&path) {
        Ok(c) => c,
        Err(e) => return usage_error(e),
    };
    let metrics_addr = match metrics_addr.map(|a| a.parse::<std::net::SocketAddr>().map_err(|_| a))
    {
        Some(Ok(a)) => Some(a),
        Some(Err(a)) => return usage_error(format!("invalid --metrics address {a:?}")),
        None => None,
    };
    if check {
        // The sidecars' certificates and keys: a start would read them
        // first (and stop on a bad one), so the check reads them too.
        for (i, s) in cfg.services.iter().enumerate() {
            if s.app == App::Sidecar {
                if let Err(e) = capybara_hostagent::sidecar::load_tls(s) {
                    return usage_error(format!("{path}: service[{i}].{e}"));
                }
            }
        }
        if let Some(w) = cfg.migration.as_ref().and_then(|m| m.key_file_warning()) {
            eprintln!("hostagent: {w}");
        }
        println!(
            "{path}: configuration valid ({} on {}, {} service(s))",
            cfg.stack.address,
            cfg.interface.name,
            cfg.services.len()
        );
        return ExitCode::SUCCESS;
    }
    match run(cfg, metrics_addr) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("hostagent: {e}");
            ExitCode::from(1)
        }
    }
}

/// The most memory the import pool is pre-warmed with at startup (the
/// endpoint's pool of 16 entries is 8 MiB with the default 256 KiB queues).
const IMPORT_POOL_BYTES: usize = 64 << 20;

fn open_device(cfg: &Config) -> Result<Box<dyn Device>, String> {
    match cfg.interface.backend {
        Backend::AfPacket => {
            let mut c = capybara_net::device::af_packet::AfPacketConfig::new(&cfg.interface.name);
            // The kernel skips the frames of every address the stack owns
            // (after the AF_PACKET tap copied them): see docs/HOSTAGENT.md.
            c.kernel_drop.push(cfg.stack.address);
            for s in &cfg.services {
                if !c.kernel_drop.contains(s.listen.ip()) && !s.listen.ip().is_unspecified() {
                    c.kernel_drop.push(*s.listen.ip());
                }
            }
            let d =
                capybara_net::device::af_packet::AfPacket::open(&c).map_err(|e| e.to_string())?;
            if let Some(e) = d.kernel_drop_error() {
                eprintln!("hostagent: the kernel keeps processing the stack's frames: {e}");
            }
            Ok(Box::new(d) as Box<dyn Device>)
        }
        #[cfg(feature = "dpdk")]
        Backend::Dpdk => {
            let mut c = capybara_net::device::dpdk::DpdkConfig::lab(&cfg.interface.name);
            c.eal_args = cfg.interface.dpdk_args.clone();
            capybara_net::device::dpdk::Dpdk::open(&c)
                .map(|d| Box::new(d) as Box<dyn Device>)
                .map_err(|e| e.to_string())
        }
        #[cfg(not(feature = "dpdk"))]
        Backend::Dpdk => Err("this hostagent was built without the `dpdk` feature".into()),
    }
}

fn run(cfg: Config, metrics_addr: Option<std::net::SocketAddr>) -> Result<(), String> {
    let device = open_device(&cfg)?;
    let mac = device
        .mac()
        .ok_or_else(|| format!("interface {} has no MAC address", cfg.interface.name))?;
    let mut icfg = InterfaceConfig::new(mac, cfg.stack.address, cfg.stack.gateway);
    for s in &cfg.services {
        if *s.listen.ip() != cfg.stack.address && !icfg.extra_addresses.contains(s.listen.ip()) {
            icfg.extra_addresses.push(*s.listen.ip());
        }
    }
    let iface = Interface::new(icfg).map_err(|e| format!("interface configuration: {e}"))?;
    let mut tcp = Endpoint::new(TcpConfig {
        mss: cfg.stack.mss,
        rx_buffer: cfg.stack.recv_buffer,
        tx_buffer: cfg.stack.send_buffer,
        isn_key: rand::random(),
        // A connection migrated in keeps the keep-alive its origin gave it
        // (the snapshot carries it); this applies to connections accepted here.
        keepalive: cfg.tcp.keepalive(),
        ..TcpConfig::default()
    });
    if cfg.migration.is_some() {
        // Imports draw connection entries from the endpoint's pool: fill
        // it now, pages touched, so that a standby's first migrations in
        // (a drain onto it) neither allocate nor page-fault (issue #8).
        // The pool holds this much anyway once as many connections have
        // left; capped at IMPORT_POOL_BYTES for hosts with huge buffers.
        let per_entry = (cfg.stack.send_buffer + cfg.stack.recv_buffer).max(1);
        tcp.prewarm_spare_buffers(IMPORT_POOL_BYTES / per_entry);
    }
    let mode = match cfg.interface.poll {
        Poll::Busy => PollMode::BusyPoll,
        Poll::Sleep => PollMode::Sleep,
    };
    let mut transports = Transports::new(tcp, cfg.stack.address);
    for s in &cfg.services {
        transports.vips.insert(s.listen.port(), *s.listen.ip());
    }
    let mut key = None;
    if let Some(m) = &cfg.migration {
        let k = m.load_key("config").map_err(|e| e.to_string())?;
        if let Some(w) = m.key_file_warning() {
            eprintln!("hostagent: {w}");
        }
        let mut ec = EngineConfig::new(cfg.stack.address, m.switch);
        ec.first_migration_seq = match capybara_hostagent::migration::test_first_migration_seq() {
            Some(seq) => {
                eprintln!("hostagent: migration counter seeded at {seq} (CAPYBARA_TEST_FIRST_MIGRATION_SEQ, for tests only) instead of the clock");
                seq
            }
            None => capybara_hostagent::migration::first_migration_seq_now(),
        };
        // With a switch to register with, no migration starts before its
        // REGISTER_ACK: it names the last migration id it saw from this
        // data address (a previous process's), and the counter goes above
        // it (docs/MIGRATION.md, "Roles and messages").
        ec.hold_until_seeded = cfg.control.is_some();
        // A snapshot holds both queues and the application's state (a
        // sidecar's partial request); the target buffers up to a receive
        // window of client data.
        ec.max_snapshot_bytes = cfg.max_snapshot_bytes();
        ec.max_buffer_bytes = cfg.stack.recv_buffer;
        // An explicit local choice: the engine keeps dropping whatever the
        // store's `buffer_mode` (POLICY) says (`set_policy_buffer_mode`),
        // so the benchmarks' Prism ablation needs no policy.
        if m.drop_mode {
            ec.buffer_mode = BufferMode::Drop;
        }
        let engine = Engine::new(ec, k.clone()).map_err(|e| format!("migration: {e}"))?;
        transports.mig = Some(Migrator::new(engine, cfg.stack.address));
        transports.drain = capybara_hostagent::drain::Drainer::new(m.drain_max_in_flight);
        key = Some(k);
        if cfg.policy.enabled {
            // Tunables start at the store's defaults; switchd's POLICY
            // replaces them once registered.
            let mut p = capybara_hostagent::policy::PolicyRuntime::new(Default::default());
            p.server_id = cfg
                .control
                .as_ref()
                .map(|c| capybara_proto::ServerId(c.server_id));
            transports.policy = Some(p);
        }
    }
    transports.monitor = capybara_hostagent::monitor::Monitor::new(
        std::time::Duration::from_millis(cfg.policy.monitor_window_ms),
    );
    // Backend health checks, one per sidecar service, indexed like the
    // REGISTER's service list (the heartbeat's down bits).
    let checked: Vec<_> = cfg
        .services
        .iter()
        .map(|s| (s.listen, s.backend.filter(|_| s.app == App::Sidecar)))
        .collect();
    let board = Rc::new(capybara_hostagent::health::Board::new(
        &cfg.health,
        &checked,
    ));
    if let Some(c) = board
        .checks
        .iter()
        .find(|c| c.index >= capybara_proto::control::HEALTH_MAX_SERVICES)
    {
        eprintln!(
            "hostagent: health: service {} is beyond the first {} services: checked here, but the switch is not told",
            c.listen,
            capybara_proto::control::HEALTH_MAX_SERVICES
        );
    }
    transports.health = Some(board.clone());
    let stack = Stack::new(iface, transports, device, mode);
    if let Some(m) = &cfg.migration {
        // Reply spin (docs/HOSTAGENT.md, "Wake-ups"); used in `Sleep` mode.
        let spin = std::time::Duration::from_micros(m.reply_spin_us);
        stack.with(|i| i.reply_spin = spin);
    }
    let name: Rc<str> = Rc::from(cfg.name.as_str());

    // The driver's wake-up latency (docs/HOSTAGENT.md, "Wake-ups"): how
    // this thread asks the scheduler to run it promptly when frames arrive.
    if let Ok(spec) = std::env::var("CAPYBARA_HOSTAGENT_SCHED") {
        let sched = capybara_hostagent::stack::DriverScheduling::parse(&spec)
            .map_err(|e| format!("CAPYBARA_HOSTAGENT_SCHED={e}"))?;
        match sched.apply() {
            Ok(()) => eprintln!("hostagent: driver thread scheduling {sched:?}"),
            Err(e) => eprintln!("hostagent: cannot set the driver's scheduling {sched:?}: {e}"),
        }
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the runtime: {e}"))?;
    let local = tokio::task::LocalSet::new();
    local.block_on(&rt, async move {
        // Installed first: until then SIGHUP's default action would end the
        // process (docs/OPERATIONS.md, "Rotating TLS certificates").
        let mut hup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
            .map_err(|e| format!("cannot install the SIGHUP handler: {e}"))?;
        let mut tls_services = Vec::new();
        for s in &cfg.services {
            let l = TcpListener::bind(&stack, s.listen)
                .map_err(|e| format!("listen {}: {e}", s.listen))?;
            match s.app {
                App::Echo => tokio::task::spawn_local(apps::echo(l)),
                App::Http => tokio::task::spawn_local(apps::http(l, name.clone())),
                App::Testserver => {
                    let ts = s
                        .testserver(&cfg.name)
                        .map_err(|(f, v, why)| format!("service {}: {f} = {v}: {why}", s.listen))?;
                    capybara_testserver::hrtime::set_fine_timer_slack();
                    let core = capybara_testserver::Core::new(ts);
                    tokio::task::spawn_local(apps::testserver(l, stack.clone(), core))
                }
                App::Sidecar => {
                    let mut svc = capybara_hostagent::sidecar::Service::from_config(s)
                        .map_err(|e| format!("service {}: {e}", s.listen))?;
                    if svc.tls.is_some() {
                        if let Some(m) = &cfg.migration {
                            let hex = m.load_key_hex("config").map_err(|e| e.to_string())?;
                            let seal = capybara_tls::SealKey::from_hex(&hex)
                                .map_err(|e| format!("{}: {e}", m.key_field()))?;
                            svc.seal = Some(std::sync::Arc::new(seal));
                        }
                    }
                    svc.health = board.check_of(s.listen);
                    let svc = Rc::new(svc);
                    if svc.tls.is_some() {
                        tls_services.push(svc.clone());
                    }
                    tokio::task::spawn_local(capybara_hostagent::sidecar::serve(l, svc))
                }
            };
        }
        let stop = Rc::new(capybara_hostagent::drain::StopSignal::default());
        let has_control = cfg.control.is_some() && key.is_some();
        if let (Some(c), Some(k)) = (cfg.control.clone(), key.clone()) {
            let services = cfg.services.iter().map(|s| s.listen).collect();
            tokio::task::spawn_local(control::run_with_stop(
                c,
                k,
                stack.clone(),
                cfg.stack.address,
                mac.0,
                services,
                board.clone(),
                stop.clone(),
            ));
        }
        capybara_hostagent::health::spawn(stack.clone(), board.clone());
        // SIGHUP: new certificates for new handshakes. The signal handler
        // only flags and wakes the runtime; the reload runs here between two
        // turns of the driver, so the packet path takes no lock.
        tokio::task::spawn_local(async move {
            while hup.recv().await.is_some() {
                capybara_hostagent::sidecar::reload_tls(&tls_services);
            }
        });
        if let Some(m) = cfg.migration.as_ref().filter(|m| m.churn_every_ms > 0) {
            let (every, to) = (m.churn_every_ms, m.churn_to);
            tokio::task::spawn_local(churn(stack.clone(), every, to));
        }
        if let Some(addr) = metrics_addr {
            let l = tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|e| format!("metrics listener {addr}: {e}"))?;
            tokio::task::spawn_local(metrics::serve(l, stack.clone(), name.clone()));
        }
        eprintln!(
            "hostagent {}: {} on {} ({:?}), {} service(s)",
            name,
            cfg.stack.address,
            cfg.interface.name,
            cfg.interface.backend,
            cfg.services.len()
        );
        use tokio::signal::unix::{signal, SignalKind};
        let mut term = signal(SignalKind::terminate())
            .map_err(|e| format!("cannot install the SIGTERM handler: {e}"))?;
        let mut int = signal(SignalKind::interrupt())
            .map_err(|e| format!("cannot install the SIGINT handler: {e}"))?;
        // The driver runs on through the stop: the migrations need it.
        let drive = stack.clone().drive();
        tokio::pin!(drive);
        tokio::select! {
            r = &mut drive => return r.map_err(|e| format!("device: {e}")),
            _ = int.recv() => {}
            _ = term.recv() => {}
        }
        let timeout = std::time::Duration::from_millis(cfg.shutdown.drain_timeout_ms);
        let n = capybara_hostagent::drain::connections_served(&stack);
        let why_not = if timeout.is_zero() {
            Some("[shutdown] drain_timeout_ms = 0")
        } else if cfg.migration.is_none() {
            Some("no [migration]: connections cannot move")
        } else if !has_control {
            Some("no [control]: no switchd to move connections through")
        } else {
            None
        };
        if let Some(why) = why_not {
            eprintln!("hostagent: stopping at once ({why}): {n} connection(s) cut");
        } else {
            eprintln!(
                "hostagent: stopping: migrating {n} connection(s) away within {} ms (a second SIGTERM/SIGINT stops at once)",
                timeout.as_millis()
            );
            stop.set(capybara_hostagent::drain::StopPhase::Leaving);
            let begun = std::time::Instant::now();
            let leave = capybara_hostagent::drain::leave(&stack, timeout);
            tokio::pin!(leave);
            use capybara_hostagent::drain::LeaveOutcome;
            tokio::select! {
                r = &mut drive => return r.map_err(|e| format!("device: {e}")),
                o = &mut leave => match o {
                    LeaveOutcome::Empty => eprintln!(
                        "hostagent: stopping: every connection moved away in {} ms",
                        begun.elapsed().as_millis()
                    ),
                    LeaveOutcome::DeadlinePassed { left } => eprintln!(
                        "hostagent: stopping: deadline of {} ms passed: {left} connection(s) left, cut",
                        timeout.as_millis()
                    ),
                },
                _ = int.recv() => eprintln!(
                    "hostagent: second signal: stopping at once, {} connection(s) cut",
                    capybara_hostagent::drain::connections_served(&stack)
                ),
                _ = term.recv() => eprintln!(
                    "hostagent: second signal: stopping at once, {} connection(s) cut",
                    capybara_hostagent::drain::connections_served(&stack)
                ),
            }
        }
        if has_control {
            // The last heartbeats say STOPPED: switchd declares this
            // server dead now, not after dead_after. The driver runs while
            // they go out (bounded: the control task may be gone).
            stop.set(capybara_hostagent::drain::StopPhase::Stopped);
            tokio::select! {
                r = &mut drive => return r.map_err(|e| format!("device: {e}")),
                _ = stop.stopped_sent.notified() => {}
                _ = tokio::time::sleep(std::time::Duration::from_millis(200)) => {}
            }
        }
        Ok(())
    })
}

/// At most this many churn migrations out in flight: starting hundreds of
/// snapshot transfers (each up to both TCP buffers) at once only makes them
/// miss their deadline and abort; a bounded batch per tick finishes.
const CHURN_IN_FLIGHT: usize = 32;

/// Benchmarks and tests: every `every_ms`, start migrating each connection
/// served here (and not already migrating) to `to`, up to
/// `CHURN_IN_FLIGHT` at a time, those that completed fewest migrations
/// first (so that every connection gets its turn, not the same few back and
/// forth). Only completed migrations count: a connection whose migration
/// resumed here stays at the front and is retried at the next tick.
async fn churn(stack: Stack, every_ms: u64, to: Option<std::net::Ipv4Addr>) {
    use capybara_hostagent::migration::Outcome;
    let mut tick = tokio::time::interval(std::time::Duration::from_millis(every_ms));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut flows = Vec::new();
    let mut moved: std::collections::HashMap<capybara_proto::FlowKey, u32> =
        std::collections::HashMap::new();
    // Cursor into the migrator's finished migrations (`Migrator::recorded`):
    // each is counted once, without re-reading the whole recent list.
    let mut cursor = 0u64;
    loop {
        tick.tick().await;
        stack.with(|i| {
            let now = i.clock.now();
            if let Some(m) = i.transports.mig.as_mut() {
                for r in m.recent_since(cursor) {
                    if matches!(r.outcome, Outcome::MigratedIn | Outcome::MigratedOut) {
                        *moved.entry(r.flow).or_default() += 1;
                    }
                }
                cursor = m.recorded;
                flows.clear();
                flows.extend(m.flows().map(|(f, _)| *f));
                flows.sort_by_key(|f| moved.get(f).copied().unwrap_or(0));
                if moved.len() > 1 << 20 {
                    moved.clear();
                }
                for f in &flows {
                    if m.engine.in_progress().0 >= CHURN_IN_FLIGHT {
                        break;
                    }
                    let _ = m.migrate_as(now, *f, to, MigrationTrigger::Churn);
                }
            }
            i.kick();
        });
    }
}
