//! `capybara-loadgen` binary: see bench/README.md.

use std::process::ExitCode;

use capybara_loadgen::{long_weights, run_blocking, Args};
use clap::Parser;

fn main() -> ExitCode {
    let args = Args::parse();
    let cfg = match args.to_config() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("capybara-loadgen: {e}");
            return ExitCode::from(2);
        }
    };
    if args.check {
        let w = long_weights(&cfg);
        let top = w.iter().cloned().fold(0.0, f64::max);
        println!(
            "capybara-loadgen plan: target {} duration {:?} rate {:.0} rps (long {:.0}, short {:.0} in flows of {}), {} long conns, dist {:?}, heaviest conn {:.1}% of long load",
            cfg.target,
            cfg.duration,
            cfg.rate,
            cfg.long_rate(),
            cfg.short_rate,
            cfg.short_requests,
            cfg.conns,
            cfg.dist,
            top * 100.0
        );
        if let Some(s) = &cfg.step {
            let steps = capybara_loadgen::schedule::RateFn::Step {
                start_ns: s.start.as_nanos() as u64,
                interval_ns: s.interval.as_nanos() as u64,
                step: s.step_rps,
                max_steps: s.max_steps,
            };
            let (at_end, _) = steps.at(cfg.duration.as_nanos() as u64 - 1);
            let max = if s.max_steps == u64::MAX {
                "unbounded".to_string()
            } else {
                s.max_steps.to_string()
            };
            println!(
                "  step: +{:.0} rps every {:?} from {:?} (max steps {max}) on {:?}; step load at the end {:.0} rps, total offered at the end {:.0} rps",
                s.step_rps, s.interval, s.start, s.subset, at_end, cfg.rate + at_end
            );
        }
        println!("config ok");
        return ExitCode::SUCCESS;
    }
    if let Some(path) = &cfg.json {
        // Fail before the run, not after it.
        if let Err(e) = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(path)
        {
            eprintln!("capybara-loadgen: cannot write --json {path:?}: {e}");
            return ExitCode::from(2);
        }
    }
    let report = match run_blocking(cfg.clone()) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("capybara-loadgen: {e}");
            return ExitCode::FAILURE;
        }
    };
    print!("{}", report.human());
    if let Some(path) = &cfg.json {
        let text = match serde_json::to_string_pretty(&report) {
            Ok(t) => t,
            Err(e) => {
                eprintln!("capybara-loadgen: cannot encode the report: {e}");
                return ExitCode::FAILURE;
            }
        };
        if let Err(e) = std::fs::write(path, text) {
            eprintln!("capybara-loadgen: cannot write --json {path:?}: {e}");
            return ExitCode::FAILURE;
        }
        println!("  report written to {path}");
    }
    println!("{}", report.result_line());
    ExitCode::SUCCESS
}
