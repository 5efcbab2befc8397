//! `capybara-testserver`: see the library docs and bench/README.md.

use std::net::SocketAddr;
use std::process::ExitCode;

use capybara_testserver::hrtime::{parse_duration, set_fine_timer_slack};
use capybara_testserver::{run_listener, Core, ServerConfig, ServiceTime};
use clap::Parser;

/// HTTP/1.1 test server emulating one single-core server with a given
/// service time (FIFO virtual core, timers instead of CPU burn).
#[derive(Parser, Debug)]
#[command(name = "capybara-testserver", version)]
struct Args {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:8080")]
    listen: String,
    /// Server id, sent in every response as `x-server: <id>`.
    #[arg(long, default_value = "s0")]
    id: String,
    /// Mean service time per request, with unit (e.g. 100us, 1ms).
    #[arg(long, default_value = "100us")]
    service_time: String,
    /// Service-time distribution: fixed or exp.
    #[arg(long, default_value = "fixed")]
    service_dist: String,
    /// Response body size in bytes.
    #[arg(long, default_value_t = 256)]
    body_bytes: usize,
    /// Seed of the service-time generator.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Most queued requests per connection before the server stops reading it.
    #[arg(long, default_value_t = 4096)]
    max_pipeline: usize,
    /// Use tokio's 1 ms timer wheel instead of microsecond timerfd timers.
    #[arg(long)]
    coarse_timers: bool,
    /// Validate the flags, print the configuration, and exit.
    #[arg(long)]
    check: bool,
}

fn config(a: &Args) -> Result<(SocketAddr, ServerConfig), String> {
    let addr: SocketAddr = a
        .listen
        .parse()
        .map_err(|_| format!("invalid --listen {:?}: expected IP:PORT", a.listen))?;
    if a.id.is_empty() || a.id.len() > 64 || !a.id.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(format!(
            "invalid --id {:?}: 1-64 printable ASCII characters without spaces",
            a.id
        ));
    }
    let st = parse_duration(&a.service_time).map_err(|e| format!("--service-time: {e}"))?;
    let ns = st.as_nanos();
    if ns == 0 || ns > 10_000_000_000 {
        return Err(format!(
            "invalid --service-time {:?}: must be between 1ns and 10s",
            a.service_time
        ));
    }
    let service = match a.service_dist.as_str() {
        "fixed" => ServiceTime::Fixed(ns as u64),
        "exp" | "exponential" => ServiceTime::Exponential(ns as u64),
        other => {
            return Err(format!(
                "invalid --service-dist {other:?}: expected fixed or exp"
            ))
        }
    };
    if a.body_bytes > 64 << 20 {
        return Err(format!(
            "invalid --body-bytes {}: at most 64 MiB",
            a.body_bytes
        ));
    }
    if a.max_pipeline == 0 || a.max_pipeline > 1 << 20 {
        return Err(format!(
            "invalid --max-pipeline {}: must be 1..=1048576",
            a.max_pipeline
        ));
    }
    Ok((
        addr,
        ServerConfig {
            id: a.id.clone(),
            service,
            body_bytes: a.body_bytes,
            seed: a.seed,
            precise_timers: !a.coarse_timers,
            max_pipeline: a.max_pipeline,
        },
    ))
}

fn main() -> ExitCode {
    let args = Args::parse();
    let (addr, cfg) = match config(&args) {
        Ok(x) => x,
        Err(e) => {
            eprintln!("capybara-testserver: {e}");
            return ExitCode::from(2);
        }
    };
    let summary = format!(
        "capybara-testserver id={} listen={} service={} capacity_rps={:.0} body_bytes={}",
        cfg.id,
        addr,
        cfg.service.describe(),
        cfg.service.capacity_rps(),
        cfg.body_bytes
    );
    if args.check {
        println!("{summary}");
        println!("config ok");
        return ExitCode::SUCCESS;
    }
    set_fine_timer_slack();
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("capybara-testserver: cannot start runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    rt.block_on(async move {
        let listener = match tokio::net::TcpListener::bind(addr).await {
            Ok(l) => l,
            Err(e) => {
                eprintln!("capybara-testserver: cannot listen on {addr}: {e}");
                return ExitCode::FAILURE;
            }
        };
        println!("{summary}");
        let core = Core::new(cfg);
        tokio::select! {
            r = run_listener(listener, core.clone()) => {
                if let Err(e) = r {
                    eprintln!("capybara-testserver: accept failed: {e}");
                    return ExitCode::FAILURE;
                }
                ExitCode::SUCCESS
            }
            _ = tokio::signal::ctrl_c() => {
                let s = core.stats();
                println!("capybara-testserver: stopping; served={} busy_fraction={:.3}", s.served, s.busy_fraction);
                ExitCode::SUCCESS
            }
        }
    })
}
