//! Servers that stall or restart behind the switch (root; release binaries,
//! or `CAPYBARA_BIN_DIR`): switchd and real hostagents in the lab, real
//! Linux TCP clients (echo connections held by a Python client).
//!
//! - A hostagent frozen (SIGSTOP) past `dead_after_ms` but within
//!   `dead_flow_grace_ms` is out of placement while frozen (new
//!   connections go to the other server) and, woken, keeps every
//!   connection: no reset, the echo sent while it was frozen comes back.
//!   (Before, a hostagent starved of CPU for a second lost every
//!   connection: the switch removed its flows and the other server reset
//!   them.)
//! - Frozen past the grace too, its flows are removed; on waking it is told
//!   to register again, does, and takes new connections.
//! - Killed and restarted within the grace (a new instance): its old flows
//!   are removed at once, so its clients fail fast instead of waiting out
//!   the grace.
//! - The same after a takeover: a switchd started on the store (what a
//!   standby does when it takes over: servers, their instance ids and
//!   flows restored from the store) keeps every connection of hostagents
//!   that kept running (same instance), and drops the old flows of one
//!   restarted meanwhile (new instance) at its first REGISTER.

use capybara_systests::{
    bin, deployment_key, disable_policies, hostagent_migrating_config, metric_sum, output_dir,
    switchd_config, EchoHolder, Lab,
};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Sets a top-level switchd config field (before the first table).
fn switchd_field(cfg: &Path, line: &str) {
    let text = std::fs::read_to_string(cfg).expect("read switchd config");
    std::fs::write(cfg, format!("{line}\n{text}")).expect("write switchd config");
}

/// switchd plus hostagents s1..=s`servers` (policies off: nothing migrates
/// on its own), all registered. Returns the switchd log and the hostagent pids.
fn start(lab: &mut Lab, dir: &Path, servers: u32, switchd_extra: &str) -> (PathBuf, Vec<u32>) {
    let (swlog, _, pids) = start_with_switchd_pid(lab, dir, servers, switchd_extra);
    (swlog, pids)
}

/// [`start`], also returning switchd's pid.
fn start_with_switchd_pid(
    lab: &mut Lab,
    dir: &Path,
    servers: u32,
    switchd_extra: &str,
) -> (PathBuf, u32, Vec<u32>) {
    let key = deployment_key(dir);
    let sw = switchd_config(lab, dir, servers, &key);
    if !switchd_extra.is_empty() {
        switchd_field(&sw, switchd_extra);
    }
    let swlog = dir.join("switchd.log");
    let switchd = spawn_switchd(lab, dir, &swlog);
    let pids = (1..=servers)
        .map(|j| spawn_hostagent(lab, dir, &key, j, "hostagent"))
        .collect();
    for j in 1..=servers {
        lab.wait_for(
            &format!("s{j} to register"),
            Duration::from_secs(30),
            || log(&swlog).contains(&format!("switchd: registered s{j}:")),
        );
    }
    (swlog, switchd, pids)
}

/// switchd on the config (and store) `start` wrote into `dir`, logging to
/// `log`; returns its pid.
fn spawn_switchd(lab: &mut Lab, dir: &Path, log: &Path) -> u32 {
    let sw = dir.join("switchd.toml");
    lab.spawn_logged(
        "sw",
        bin("switchd"),
        &["--config", sw.to_str().unwrap()],
        log,
    )
}

fn spawn_hostagent(lab: &mut Lab, dir: &Path, key: &Path, j: u32, name: &str) -> u32 {
    let cfg = hostagent_migrating_config(dir, j, key, None);
    disable_policies(&cfg);
    lab.spawn_hostagent(j, &cfg, &dir.join(format!("{name}-s{j}.log")))
}

fn log(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

fn signal(pid: u32, sig: libc::c_int) {
    // SAFETY: signalling a hostagent this test started (`ip netns exec`
    // execs it, so the pid is the hostagent's).
    unsafe { libc::kill(pid as i32, sig) };
}

/// Connections server `j` has accepted so far.
fn accepted(lab: &Lab, j: u32) -> f64 {
    metric_sum(
        &lab.server_metrics(j),
        "capybara_tcp_connections_passive_total",
        "",
    )
    .unwrap_or(-1.0)
}

/// Runs `body` with `pid` stopped (SIGSTOP), and always continues it
/// (SIGCONT) before returning or unwinding.
fn while_stopped<T>(pid: u32, body: impl FnOnce() -> T) -> T {
    signal(pid, libc::SIGSTOP);
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(body));
    signal(pid, libc::SIGCONT);
    r.unwrap_or_else(|e| std::panic::resume_unwind(e))
}

/// Holds `n` echo connections, at least one of them on server 1. Maglev
/// places by the client's random port, so all `n` land on s2 now and then
/// (1 in 4,096 for 12 of them on two servers): such a set is closed and
/// another one opened, a bounded number of times.
fn hold_some_on_s1(lab: &Lab, n: usize) -> EchoHolder {
    for _ in 0..5 {
        let before = accepted(lab, 1);
        assert!(before >= 0.0, "s1's metrics are unreachable");
        let h = EchoHolder::start(lab, n);
        let on_s1 = accepted(lab, 1) - before;
        if on_s1 >= 1.0 {
            return h;
        }
    }
    panic!("none of 5 sets of {n} connections had one on s1");
}

#[test]
fn a_stalled_server_keeps_its_connections_within_the_grace() {
    let dir = output_dir("server_liveness_stall");
    let mut lab = Lab::up("sls", 2);
    // The default grace (10 s); dead after 1 s of silence.
    let (swlog, pids) = start(&mut lab, &dir, 2, "");
    let mut held = hold_some_on_s1(&lab, 12);
    assert_eq!(held.round_trip(), "ok");
    let s2_before = accepted(&lab, 2);

    let stopped = Instant::now();
    let echoed = std::thread::scope(|scope| {
        signal(pids[0], libc::SIGSTOP);
        // An echo over every held connection while s1 is frozen: those on
        // s1 are answered only after it wakes.
        let pending = scope.spawn(|| held.round_trip());
        let checks = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            lab.wait_for(
                "the switch to declare s1 dead",
                Duration::from_secs(10),
                || log(&swlog).contains("server s1 missed heartbeats"),
            );
            assert!(
                log(&swlog).contains("flow entries are kept"),
                "{}",
                log(&swlog)
            );
            // New connections while s1 is dead go to s2, and work.
            let mut fresh = EchoHolder::start(&lab, 6);
            assert_eq!(fresh.round_trip(), "ok");
            let to_s2 = accepted(&lab, 2) - s2_before;
            assert_eq!(
                to_s2, 6.0,
                "new connections during the stall went elsewhere"
            );
            // Frozen past dead_after (1 s), well within the grace (10 s).
            while stopped.elapsed() < Duration::from_secs(3) {
                std::thread::sleep(Duration::from_millis(50));
            }
        }));
        signal(pids[0], libc::SIGCONT);
        if let Err(e) = checks {
            std::panic::resume_unwind(e);
        }
        // Bounded by the echo client's 20 s socket timeout.
        pending.join().expect("the echo thread")
    });
    let frozen = stopped.elapsed();
    assert_eq!(
        echoed, "ok",
        "an echo sent during the stall was lost or reset"
    );
    lab.wait_for("s1 to be back", Duration::from_secs(10), || {
        log(&swlog).contains("server s1 heartbeats again")
    });
    assert_eq!(held.round_trip(), "ok");
    let l = log(&swlog);
    assert!(!l.contains("flow entries removed"), "{l}");
    assert_eq!(
        l.matches("switchd: registered s1:").count(),
        1,
        "back by its heartbeats, no REGISTER needed: {l}"
    );
    lab.assert_no_resets([1, 2]);
    eprintln!("s1 frozen {frozen:?}: every connection kept, no reset");
}

#[test]
fn a_server_dead_past_the_grace_registers_again_when_it_wakes() {
    let dir = output_dir("server_liveness_grace");
    let mut lab = Lab::up("slg", 1);
    let (swlog, pids) = start(&mut lab, &dir, 1, "dead_flow_grace_ms = 1000");
    let mut before = EchoHolder::start(&lab, 2);
    assert_eq!(before.round_trip(), "ok");

    while_stopped(pids[0], || {
        lab.wait_for("s1's grace to end", Duration::from_secs(15), || {
            log(&swlog).contains("server s1 did not come back within 1s:")
        })
    });
    lab.wait_for("s1 to register again", Duration::from_secs(15), || {
        log(&swlog).matches("switchd: registered s1:").count() >= 2
    });
    let ha = log(&dir.join("hostagent-s1.log"));
    assert!(ha.contains("registering again"), "{ha}");
    // New connections reach it again.
    let mut after = EchoHolder::start(&lab, 2);
    assert_eq!(after.round_trip(), "ok");
    drop(before);
}

#[test]
fn a_restarted_server_loses_its_old_flows_at_once() {
    let dir = output_dir("server_liveness_restart");
    let mut lab = Lab::up("slr", 2);
    let (swlog, pids) = start(&mut lab, &dir, 2, "");
    let mut held = hold_some_on_s1(&lab, 12);
    assert_eq!(held.round_trip(), "ok");

    // A crash and a restart, quicker than dead_after: only the instance id
    // tells the switch that the connections are gone.
    lab.kill_and_wait(pids[0]);
    let key = dir.join("deployment.key");
    spawn_hostagent(&mut lab, &dir, &key, 1, "restarted");
    restart_handled(&lab, &swlog, &dir, &mut held);
}

/// Waits for switchd (logging to `swlog`) to see s1 restarted, and checks
/// that the old process's flow entries went at once: the held connections
/// on s1 fail fast (a reset from whichever server the client's next segment
/// reaches), not after the grace, and the restarted server serves new
/// connections. Returns how many flow entries were removed.
fn restart_handled(lab: &Lab, swlog: &Path, dir: &Path, held: &mut EchoHolder) -> u32 {
    let t = Instant::now();
    while !log(swlog).contains("switchd: server s1 restarted") {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "timed out after 30 s waiting for s1 to register again; switchd:\n{}\nrestarted s1:\n{}",
            log(swlog),
            log(&dir.join("restarted-s1.log"))
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let l = log(swlog);
    assert!(
        l.contains("flow entries of the old process removed") && !l.contains("did not come back"),
        "{l}"
    );
    let removed: u32 = l
        .lines()
        .find(|x| x.contains("switchd: server s1 restarted"))
        .and_then(|x| x.split("): ").nth(1))
        .and_then(|x| x.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    let t = Instant::now();
    assert_ne!(held.round_trip(), "ok");
    assert!(
        t.elapsed() < Duration::from_secs(8),
        "the old connections took {:?} to fail",
        t.elapsed()
    );
    let mut fresh = EchoHolder::start(lab, 4);
    assert_eq!(fresh.round_trip(), "ok");
    removed
}

/// switchd killed and started again on its store: the takeover path (a
/// standby winning the lease runs the same restore). The first time both
/// hostagents keep running: restored with their instance ids, they keep
/// every connection. The second time s1 is restarted while no switchd
/// runs: its REGISTER names another instance than its stored record, so
/// the old process's flows are removed at once, as without a takeover
/// (before, the record had no instance id and they were kept).
#[test]
fn after_a_takeover_a_restarted_server_loses_its_old_flows_and_a_running_one_keeps_them() {
    let dir = output_dir("server_liveness_takeover");
    let mut lab = Lab::up("slt", 2);
    let (_, sw1, pids) = start_with_switchd_pid(&mut lab, &dir, 2, "");
    let mut held = hold_some_on_s1(&lab, 12);
    assert_eq!(held.round_trip(), "ok");
    // Flow mappings reach the store within milliseconds (FlowWriter linger).
    std::thread::sleep(Duration::from_millis(500));
    // Killed, and gone (its sockets and XDP links released) before the
    // next one starts, as under a supervisor.
    lab.kill_and_wait(sw1);

    // 1. Same instances: restored from the store, nothing restarted.
    let swlog2 = dir.join("switchd-2.log");
    let sw2 = spawn_switchd(&mut lab, &dir, &swlog2);
    lab.wait_for(
        "the second switchd to serve",
        Duration::from_secs(30),
        || log(&swlog2).contains("switchd: active"),
    );
    assert_eq!(held.round_trip(), "ok", "{}", log(&swlog2));
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(held.round_trip(), "ok");
    let l = log(&swlog2);
    assert!(
        !l.contains(" restarted (instance")
            && !l.contains("flow entries removed")
            && !l.contains("missed heartbeats"),
        "{l}"
    );
    lab.assert_no_resets([1, 2]);

    // 2. s1 restarted while no switchd runs: a new instance.
    lab.kill_and_wait(sw2);
    lab.kill_and_wait(pids[0]);
    let key = dir.join("deployment.key");
    spawn_hostagent(&mut lab, &dir, &key, 1, "restarted");
    let swlog3 = dir.join("switchd-3.log");
    spawn_switchd(&mut lab, &dir, &swlog3);
    let removed = restart_handled(&lab, &swlog3, &dir, &mut held);
    assert!(removed >= 1, "the old process's flows were not restored");
    eprintln!("after the takeover: kept every connection of running hostagents; a restarted one lost {removed} old flow entries at once");
}
