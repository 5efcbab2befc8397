//! Failover benchmark (root): active and standby switchd in the lab's switch
//! namespace, N established connections (default 200, `FAILOVER_CONNS`),
//! SIGKILL of the active, `FAILOVER_ROUNDS` rounds (default 3),
//! `FAILOVER_MODE=fast` (default: interface-fenced same-box takeover) or
//! `lease` (wait for the lease, as a standby on another box does).
//!
//! Last line: `RESULT takeover_ms=<median> connections_lost=<sum> max_stall_ms=<median> rounds=<n>`.

fn main() -> anyhow::Result<()> {
    let n: usize = std::env::var("FAILOVER_CONNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200);
    let rounds: usize = std::env::var("FAILOVER_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3);
    // FAILOVER_MODE=lease: wait for the lease like a cross-box standby.
    let fast = std::env::var("FAILOVER_MODE")
        .map(|m| m != "lease")
        .unwrap_or(true);
    let me = std::env::current_exe()?;
    let switchd = std::env::var_os("SWITCHD_BIN")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| me.with_file_name("switchd"));
    anyhow::ensure!(
        switchd.exists(),
        "switchd binary not found at {} (set SWITCHD_BIN)",
        switchd.display()
    );
    let mut takeover = Vec::new();
    let mut stall = Vec::new();
    let mut lost = 0;
    for r in 0..rounds {
        let res = capybara_switchd::labkit::failover_run(&switchd, n, fast, |_| Ok((None, ())))?;
        println!(
            "round {r}: takeover_ms={:.0} attach_ms={:.1} max_stall_ms={:.0} connections_lost={} flows_restored={}",
            res.takeover_ms, res.attach_ms, res.max_stall_ms, res.connections_lost, res.flows_restored
        );
        takeover.push(res.takeover_ms);
        stall.push(res.max_stall_ms);
        lost += res.connections_lost;
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
        v[v.len() / 2]
    };
    println!(
        "RESULT takeover_ms={:.0} connections_lost={lost} max_stall_ms={:.0} rounds={rounds} connections={n}",
        median(&mut takeover),
        median(&mut stall)
    );
    Ok(())
}
