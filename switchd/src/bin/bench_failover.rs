//! Failover benchmark (root): active and standby switchd in the lab's switch
//! namespace, N established connections (default 200, `FAILOVER_CONNS`),
//! the active stopped, `FAILOVER_ROUNDS` rounds (default 3),
//! `FAILOVER_MODE=fast` (default: same-box takeover) or `lease` (wait for
//! the lease, as a standby on another box does), `FAILOVER_STOP=kill`
//! (default: SIGKILL, a crash) or `term` (SIGTERM, a clean stop handing
//! over to the standby, as for an upgrade), `FAILOVER_PINS=on` (default:
//! XDP links pinned in bpffs, replaced in place) or `off` (`ha.pin_dir =
//! ""`, the behaviour before 2026-11-24), `FAILOVER_PING_MS` (default 2:
//! the stall probe's interval, below any gap).
//!
//! Last line: `RESULT takeover_ms=<median> connections_lost=<sum>
//! max_stall_ms=<median> rounds=<n> connections=<n> worst_stall_ms=<max>
//! rto_rounds=<rounds with a stall >= 150 ms> tcp_retransmits=<segments
//! TCP retransmitted in the lab's client and server namespaces across the
//! stops> pins=<on|off> stop=<kill|term>`.

use std::time::Duration;

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> anyhow::Result<T> {
    match std::env::var(name) {
        Ok(v) => v
            .parse()
            .map_err(|_| anyhow::anyhow!("{name}={v:?}: not a valid value")),
        Err(_) => Ok(default),
    }
}

fn env_choice(name: &str, choices: [&str; 2]) -> anyhow::Result<bool> {
    match std::env::var(name) {
        Ok(v) if v == choices[0] => Ok(true),
        Ok(v) if v == choices[1] => Ok(false),
        Ok(v) => anyhow::bail!(
            "{name}={v:?}: expected {:?} or {:?}",
            choices[0],
            choices[1]
        ),
        Err(_) => Ok(true),
    }
}

fn main() -> anyhow::Result<()> {
    let n: usize = env_or("FAILOVER_CONNS", 200)?;
    let rounds: usize = env_or("FAILOVER_ROUNDS", 3)?;
    anyhow::ensure!(rounds >= 1, "FAILOVER_ROUNDS must be at least 1");
    let ping_ms: u64 = env_or("FAILOVER_PING_MS", 2)?;
    let fast = env_choice("FAILOVER_MODE", ["fast", "lease"])?;
    let kill = env_choice("FAILOVER_STOP", ["kill", "term"])?;
    let pins = env_choice("FAILOVER_PINS", ["on", "off"])?;
    let me = std::env::current_exe()?;
    let switchd = std::env::var_os("SWITCHD_BIN")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| me.with_file_name("switchd"));
    anyhow::ensure!(
        switchd.exists(),
        "switchd binary not found at {} (set SWITCHD_BIN)",
        switchd.display()
    );
    let opts = capybara_switchd::labkit::FailoverOptions {
        connections: n,
        fast_takeover: fast,
        pins,
        signal: if kill { libc::SIGKILL } else { libc::SIGTERM },
        ping_every: Duration::from_millis(ping_ms),
    };
    let mut takeover = Vec::new();
    let mut stall = Vec::new();
    let mut lost = 0;
    let mut retransmits = 0;
    for r in 0..rounds {
        let res = capybara_switchd::labkit::failover_run_with(&switchd, &opts, |_| Ok((None, ())))?;
        println!(
            "round {r}: takeover_ms={:.0} attach_ms={:.1} max_stall_ms={:.0} connections_lost={} flows_restored={} links_taken_over={} tcp_retransmits={}",
            res.takeover_ms, res.attach_ms, res.max_stall_ms, res.connections_lost, res.flows_restored, res.links_taken_over, res.tcp_retransmits
        );
        takeover.push(res.takeover_ms);
        stall.push(res.max_stall_ms);
        lost += res.connections_lost;
        retransmits += res.tcp_retransmits;
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
        v[v.len() / 2]
    };
    let worst = stall.iter().copied().fold(0.0f64, f64::max);
    let rto_rounds = stall.iter().filter(|s| s.is_nan() || **s >= 150.0).count();
    println!(
        "RESULT takeover_ms={:.0} connections_lost={lost} max_stall_ms={:.0} rounds={rounds} connections={n} worst_stall_ms={worst:.0} rto_rounds={rto_rounds} tcp_retransmits={retransmits} pins={} stop={}",
        median(&mut takeover),
        median(&mut stall),
        if pins { "on" } else { "off" },
        if kill { "kill" } else { "term" },
    );
    Ok(())
}
