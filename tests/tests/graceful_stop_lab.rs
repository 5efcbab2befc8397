//! A hostagent stopped with SIGTERM loses no connection (lab, root; release
//! binaries, or `CAPYBARA_BIN_DIR`): the real switchd with its XDP data
//! plane, real hostagents, a real Linux client (docs/OPERATIONS.md,
//! "Stopping or restarting a server").
//!
//! - `sigterm_moves_every_connection_away_then_the_server_exits_and_comes_back`:
//!   two servers; a client holds [`HELD`] echo connections on s1 and keeps
//!   exchanging data on them; `kill -TERM` s1: every connection goes on
//!   byte-exact on s2 with no reset, s1 exits with status 0 long before its
//!   deadline, switchd says at once (not after `dead_after`) that s1
//!   stopped cleanly (`/status` `"stopped": true`, no "missed heartbeats").
//!   Started again, s1 registers (`"stopped": false`, live) and new
//!   connections land on it.
//! - `a_stop_with_nowhere_to_migrate_cuts_the_connections_at_the_deadline`:
//!   s1 serves echo, s2 only HTTP: s1's echo connections have no target.
//!   SIGTERM s1: while it leaves, switchd shows it `"leaving": true` (state
//!   still `live`: no operator drain) and every new HTTP connection goes to
//!   s2; at its deadline ([`SHORT_DEADLINE_MS`]) s1 logs how many
//!   connections it cut and exits with status 0; switchd removes their
//!   flows at once.
//! - `a_second_sigterm_stops_at_once`: a lone server whose connections have
//!   nowhere to go; a second SIGTERM during the stop ends it at once
//!   (status 0, the cut connections logged, switchd says `stopped`).
//! - `a_stop_while_connections_churn_between_both_servers_loses_nothing`:
//!   s1 and s2 migrate every connection they serve to each other every few
//!   ms (the churn option) while the client echoes on 16 connections; SIGTERM
//!   s1: every round stays byte-exact through the stop and for 6 s after it
//!   (s2's churn now finds no target), s1 exits with status 0 having moved
//!   everything away, no reset.
//! - `a_stop_during_an_operator_drain_ends_at_its_own_deadline_and_the_drain_holds`:
//!   as above (s2 HTTP only), the operator drains s1 through switchd
//!   (`POST /servers/1/drain?deadline_ms=60000`): the drain runs, nothing
//!   can move. SIGTERM s1: it exits with status 0 at its own deadline
//!   ([`SHORT_DEADLINE_MS`]), not the drain's, logging the connections it
//!   cut; switchd says `stopped`. Started again, s1 registers `draining`
//!   (the operator's drain holds; its hostagent is told to drain again), is
//!   in no `placing` list, and new connections go to s2.
//! - `an_operator_drain_during_a_stop_does_not_extend_it`: the reverse
//!   order: SIGTERM s1 first, then the operator's 60 s drain: the stop still
//!   ends at its own deadline.
//!
//! The first test fails with the hostagent before graceful stops (its
//! config has no `[shutdown]`, which an older hostagent would refuse):
//! SIGTERM ends it at once, so the held connections stop answering (the
//! first round trip after the signal fails).
//!
//! Bounded: every wait has a limit; each test takes a few seconds. Processes are
//! killed and the lab removed on every exit path ([`Lab`], [`Agent`],
//! [`EchoHolder`] guards).

use capybara_systests::{
    bin, disable_policies, echo_once, hostagent_migrating_config, log_of, switchd_lab,
    switchd_status_server, switchd_status_state, EchoHolder, Lab,
};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Echo connections the client holds on the server that is stopped.
const HELD: usize = 8;
/// s1's deadline where its connections can move: the default `[shutdown]
/// drain_timeout_ms` (the config has no `[shutdown]`, so an older
/// hostagent runs it too: see the module doc).
const DEADLINE_MS: u64 = 20_000;
/// s1's `[shutdown] drain_timeout_ms` where they cannot.
const SHORT_DEADLINE_MS: u64 = 1500;
/// The lab switchd's `dead_after_ms` (`switchd_config`).
const DEAD_AFTER: Duration = Duration::from_millis(1000);

/// One lab at a time: the machine's cores are shared, and a starved
/// hostagent would miss heartbeats.
static ONE_LAB: Mutex<()> = Mutex::new(());

/// A hostagent this test starts itself, to signal it and read its exit
/// status (the lab's own children are only killed). Killed on drop.
struct Agent {
    child: Child,
}

impl Agent {
    /// Starts server `j`'s hostagent with config `cfg` (metrics on its
    /// management address, as `Lab::spawn_hostagent` does), output to `log`.
    fn start(lab: &Lab, j: u32, cfg: &Path, log: &Path) -> Agent {
        let f = std::fs::File::create(log).expect("create log");
        let metrics = format!("198.18.1.{}:9100", 10 + j);
        let child = lab
            .command(&format!("s{j}"), bin("hostagent"))
            .args(["--config", cfg.to_str().unwrap(), "--metrics", &metrics])
            .stdout(f.try_clone().unwrap())
            .stderr(f)
            .spawn()
            .expect("start hostagent");
        Agent { child }
    }

    fn signal(&self, sig: &str) {
        let st = Command::new("kill")
            .args([sig, &self.child.id().to_string()])
            .status()
            .expect("run kill");
        assert!(st.success(), "kill {sig} failed");
    }

    fn exited(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().expect("wait for the hostagent")
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// s`j`'s migrating hostagent config (policies off) with `[shutdown]
/// drain_timeout_ms = deadline_ms` (no `[shutdown]` for the default).
fn agent_config(dir: &Path, key: &Path, j: u32, deadline_ms: u64) -> PathBuf {
    let cfg = hostagent_migrating_config(dir, j, key, None);
    disable_policies(&cfg);
    if deadline_ms == DEADLINE_MS {
        return cfg;
    }
    let mut t = std::fs::read_to_string(&cfg).unwrap();
    t.push_str(&format!("[shutdown]\ndrain_timeout_ms = {deadline_ms}\n"));
    std::fs::write(&cfg, t).unwrap();
    cfg
}

/// Which server answered an HTTP GET of the VIP from the client (`s1`,
/// `s2`), `None` if none did within 3 s.
fn http_server(lab: &Lab) -> Option<String> {
    let o = lab.try_run(
        "c1",
        "curl",
        &["-s", "-m", "3", "http://198.18.100.1/"],
        Duration::from_secs(5),
    )?;
    let body = String::from_utf8_lossy(&o.stdout);
    body.trim().strip_prefix("hello from ").map(str::to_string)
}

/// Waits (limit `limit`) for s`j`'s hostagent to exit: its status and how
/// long it took from `since`.
fn wait_exit(agent: &mut Agent, since: Instant, limit: Duration) -> (ExitStatus, Duration) {
    loop {
        if let Some(st) = agent.exited() {
            return (st, since.elapsed());
        }
        assert!(
            since.elapsed() < limit,
            "the hostagent still runs {limit:?} after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn status_bool(lab: &Lab, id: u32, field: &str) -> Option<bool> {
    switchd_status_server(lab, id)?[field].as_bool()
}

/// A stopped server in switchd's `/status` shows nothing served, not its
/// last heartbeat's connections and load (an operator walkthrough saw a
/// stopped server keep "16 connections, 255 pps").
fn assert_serves_nothing(st: &serde_json::Value) {
    for k in ["connections", "load_pps", "migrations_in_flight"] {
        assert_eq!(st[k], 0, "{k}: {st}");
    }
}

/// The number in switchd's "server sJ stopped cleanly: K flow entries
/// removed (...)".
fn flows_left_at_stop(switchd_log: &str, j: u32) -> Option<usize> {
    let at = format!("server s{j} stopped cleanly: ");
    let rest = &switchd_log[switchd_log.find(&at)? + at.len()..];
    rest.split_whitespace().next()?.parse().ok()
}

/// SIGTERM to `agent` while the client echoes round after round on every
/// held connection (each round byte-exact), until the hostagent exits
/// (bounded: its deadline plus 5 s): its exit status, how long it took and
/// the rounds echoed meanwhile.
fn stop_while_echoing(agent: &mut Agent, held: &mut EchoHolder) -> (ExitStatus, Duration, u32) {
    let t0 = Instant::now();
    agent.signal("-TERM");
    let mut rounds = 0;
    loop {
        assert_eq!(held.round_trip(), "ok", "round {rounds} after SIGTERM");
        rounds += 1;
        if let Some(st) = agent.exited() {
            return (st, t0.elapsed(), rounds);
        }
        assert!(
            t0.elapsed() < Duration::from_millis(DEADLINE_MS + 5000),
            "the hostagent still runs after its deadline"
        );
    }
}

#[test]
fn sigterm_moves_every_connection_away_then_the_server_exits_and_comes_back() {
    let _one = ONE_LAB.lock().unwrap_or_else(|e| e.into_inner());
    let (mut lab, dir, key, sw) = switchd_lab("graceful-stop-lab", "gsl", 2);
    let sw_log = dir.join("switchd.log");
    lab.spawn_switchd(&sw, &sw_log);
    let cfg1 = agent_config(&dir, &key, 1, DEADLINE_MS);
    let cfg2 = agent_config(&dir, &key, 2, DEADLINE_MS);
    let log1 = dir.join("hostagent-s1.log");
    let mut s1 = Agent::start(&lab, 1, &cfg1, &log1);
    lab.wait_registered(&sw_log, 1);
    lab.wait_for("the VIP to echo", Duration::from_secs(30), || {
        echo_once(&lab, "198.18.100.1:7")
    });
    // Every held connection on s1 (the only server yet), then s2 joins.
    let mut held = EchoHolder::start(&lab, HELD);
    let _s2 = Agent::start(&lab, 2, &cfg2, &dir.join("hostagent-s2.log"));
    lab.wait_registered(&sw_log, 2);
    assert_eq!(held.round_trip(), "ok");

    // SIGTERM s1 while the client keeps echoing on every connection.
    let t0 = Instant::now();
    let (st, took, rounds) = stop_while_echoing(&mut s1, &mut held);
    let l1 = log_of(&log1);
    assert!(st.success(), "s1 exited with {st}: {l1}");
    assert!(
        l1.contains(&format!(
            "stopping: migrating {HELD} connection(s) away within {DEADLINE_MS} ms"
        )),
        "{l1}"
    );
    assert!(l1.contains("every connection moved away"), "{l1}");
    assert!(
        took < Duration::from_millis(DEADLINE_MS),
        "s1 took {took:?} to stop"
    );
    // switchd: leaving, then stopped at once, not dead after dead_after.
    lab.wait_for("s1 stopped in /status", Duration::from_secs(5), || {
        status_bool(&lab, 1, "stopped") == Some(true)
    });
    let since_exit = t0.elapsed().saturating_sub(took);
    let st1 = switchd_status_server(&lab, 1).unwrap();
    assert_eq!(st1["state"], "dead", "{st1}");
    assert_eq!(st1["leaving"], false, "{st1}");
    assert_serves_nothing(&st1);
    let swl = log_of(&sw_log);
    assert!(swl.contains("server s1 is leaving"), "{swl}");
    assert!(flows_left_at_stop(&swl, 1).is_some(), "{swl}");
    // Past dead_after: had STOPPED not been heard, s1 would die now.
    std::thread::sleep(DEAD_AFTER.saturating_sub(since_exit) + Duration::from_millis(500));
    let swl = log_of(&sw_log);
    assert!(!swl.contains("server s1 missed heartbeats"), "{swl}");
    for _ in 0..3 {
        assert_eq!(held.round_trip(), "ok");
    }
    lab.assert_no_resets([2]);
    eprintln!(
        "GRACEFUL-STOP-LAB: s1 stopped in {:.0} ms, {rounds} echo rounds during the stop",
        took.as_secs_f64() * 1e3
    );

    // Started again: registered, no longer "stopped", placed again.
    let mut s1 = Agent::start(&lab, 1, &cfg1, &dir.join("hostagent-s1-2.log"));
    lab.wait_for("s1 live again", Duration::from_secs(30), || {
        switchd_status_server(&lab, 1)
            .is_some_and(|v| v["state"] == "live" && v["stopped"] == false)
    });
    let mut answered = Vec::new();
    for _ in 0..40 {
        let s = http_server(&lab);
        answered.push(s.clone());
        if s.as_deref() == Some("s1") {
            break;
        }
    }
    assert!(
        answered.last().unwrap().as_deref() == Some("s1"),
        "no new connection reached s1 again: {answered:?}"
    );
    assert!(answered.iter().all(|a| a.is_some()), "{answered:?}");
    assert_eq!(held.round_trip(), "ok");
    assert_eq!(held.close(), "closed");
    assert!(s1.exited().is_none(), "the restarted s1 exited");
}

#[test]
fn a_stop_with_nowhere_to_migrate_cuts_the_connections_at_the_deadline() {
    let _one = ONE_LAB.lock().unwrap_or_else(|e| e.into_inner());
    // s2 serves HTTP only: s1's echo connections have no target.
    let (lab, _dir, sw_log, _cfg1, log1, mut s1, _s2, _held) =
        nowhere_to_migrate_lab("graceful-stop-deadline-lab", "gsd", 4);

    let t0 = Instant::now();
    s1.signal("-TERM");
    lab.wait_for("s1 leaving in /status", Duration::from_secs(1), || {
        status_bool(&lab, 1, "leaving") == Some(true)
    });
    let st1 = switchd_status_server(&lab, 1).unwrap();
    assert_eq!(st1["state"], "live", "leaving is no operator drain: {st1}");
    assert_eq!(st1["stopped"], false, "{st1}");
    // New connections while it leaves: all to s2.
    let answered: Vec<Option<String>> = (0..6).map(|_| http_server(&lab)).collect();
    assert!(
        s1.exited().is_none(),
        "s1 exited before the new connections were made: the check proves nothing"
    );
    assert!(
        answered.iter().all(|a| a.as_deref() == Some("s2")),
        "new connections while s1 leaves: {answered:?}"
    );

    let (st, took) = wait_exit(&mut s1, t0, Duration::from_millis(SHORT_DEADLINE_MS + 5000));
    let l1 = log_of(&log1);
    assert!(st.success(), "s1 exited with {st}: {l1}");
    assert!(
        took >= Duration::from_millis(SHORT_DEADLINE_MS - 100),
        "s1 stopped after {took:?}, before its deadline: {l1}"
    );
    assert!(
        l1.contains(&format!(
            "deadline of {SHORT_DEADLINE_MS} ms passed: 4 connection(s) left, cut"
        )),
        "{l1}"
    );
    lab.wait_for("s1 stopped in /status", Duration::from_secs(5), || {
        status_bool(&lab, 1, "stopped") == Some(true)
    });
    assert_serves_nothing(&switchd_status_server(&lab, 1).unwrap());
    let swl = log_of(&sw_log);
    let left = flows_left_at_stop(&swl, 1);
    assert!(left.is_some_and(|k| k >= 4), "{left:?}: {swl}");
    eprintln!(
        "GRACEFUL-STOP-LAB: s1 cut 4 connections at its deadline after {:.0} ms",
        took.as_secs_f64() * 1e3
    );
}

#[test]
fn a_second_sigterm_stops_at_once() {
    let _one = ONE_LAB.lock().unwrap_or_else(|e| e.into_inner());
    let (mut lab, dir, key, sw) = switchd_lab("graceful-stop-twice-lab", "gst", 1);
    let sw_log = dir.join("switchd.log");
    lab.spawn_switchd(&sw, &sw_log);
    // A lone server: its connections have nowhere to go, so only the
    // second signal ends the stop before its (long) deadline.
    let cfg1 = agent_config(&dir, &key, 1, 10 * SHORT_DEADLINE_MS);
    let log1 = dir.join("hostagent-s1.log");
    let mut s1 = Agent::start(&lab, 1, &cfg1, &log1);
    lab.wait_registered(&sw_log, 1);
    lab.wait_for("the VIP to echo", Duration::from_secs(30), || {
        echo_once(&lab, "198.18.100.1:7")
    });
    let _held = EchoHolder::start(&lab, 3);
    let t0 = Instant::now();
    s1.signal("-TERM");
    lab.wait_for("s1 leaving in /status", Duration::from_secs(1), || {
        status_bool(&lab, 1, "leaving") == Some(true)
    });
    assert!(s1.exited().is_none(), "s1 exited after the first signal");
    let t1 = Instant::now();
    s1.signal("-TERM");
    let (st, took) = wait_exit(&mut s1, t1, Duration::from_secs(3));
    let l1 = log_of(&log1);
    assert!(st.success(), "s1 exited with {st}: {l1}");
    assert!(
        t0.elapsed() < Duration::from_millis(10 * SHORT_DEADLINE_MS),
        "{l1}"
    );
    assert!(
        l1.contains("second signal: stopping at once, 3 connection(s) cut"),
        "{l1}"
    );
    lab.wait_for("s1 stopped in /status", Duration::from_secs(5), || {
        status_bool(&lab, 1, "stopped") == Some(true)
    });
    eprintln!(
        "GRACEFUL-STOP-LAB: s1 exited {:.0} ms after the second SIGTERM",
        took.as_secs_f64() * 1e3
    );
}

/// The operator's drain deadline in the tests where one runs during a stop:
/// far past the stop's own ([`SHORT_DEADLINE_MS`]).
const OPERATOR_DRAIN_MS: u64 = 60_000;

/// Every how many ms the churning servers of
/// [`a_stop_while_connections_churn_between_both_servers_loses_nothing`]
/// migrate everything they serve to the other.
const CHURN_MS: u64 = 5;

#[test]
fn a_stop_while_connections_churn_between_both_servers_loses_nothing() {
    let _one = ONE_LAB.lock().unwrap_or_else(|e| e.into_inner());
    let (mut lab, dir, key, sw) = switchd_lab("graceful-stop-churn-lab", "gsc", 2);
    let sw_log = dir.join("switchd.log");
    lab.spawn_switchd(&sw, &sw_log);
    let cfg = |j: u32| {
        let cfg = hostagent_migrating_config(&dir, j, &key, Some((CHURN_MS, 3 - j)));
        disable_policies(&cfg);
        cfg
    };
    let log1 = dir.join("hostagent-s1.log");
    let mut s1 = Agent::start(&lab, 1, &cfg(1), &log1);
    let _s2 = Agent::start(&lab, 2, &cfg(2), &dir.join("hostagent-s2.log"));
    lab.wait_registered(&sw_log, 2);
    lab.wait_for("the VIP to echo", Duration::from_secs(30), || {
        echo_once(&lab, "198.18.100.1:7")
    });
    // The connections move between s1 and s2 every few ms, in both
    // directions, while the client echoes on them.
    let mut held = EchoHolder::start(&lab, 2 * HELD);
    for _ in 0..200 {
        assert_eq!(held.round_trip(), "ok");
    }

    // SIGTERM s1: it refuses s2's migrations in, moves what it holds (and
    // what arrives meanwhile) to s2, and exits.
    let (st, took, mut rounds) = stop_while_echoing(&mut s1, &mut held);
    let l1 = log_of(&log1);
    assert!(st.success(), "s1 exited with {st}: {l1}");
    assert!(l1.contains("every connection moved away"), "{l1}");
    assert!(
        took < Duration::from_millis(DEADLINE_MS),
        "s1 took {took:?} to stop"
    );
    // s2 goes on trying to churn to s1, which is gone: its connections stay
    // and keep echoing, past the origin's forwarding linger (5 s).
    let t1 = Instant::now();
    while t1.elapsed() < Duration::from_secs(6) {
        assert_eq!(held.round_trip(), "ok", "round {rounds} after s1 stopped");
        rounds += 1;
    }
    lab.assert_no_resets([2]);
    eprintln!(
        "GRACEFUL-STOP-CHURN: s1 stopped in {:.0} ms, {rounds} echo rounds during and after the stop",
        took.as_secs_f64() * 1e3
    );
    assert_eq!(held.close(), "closed");
}

/// Asks the lab switchd to drain server `id` (`POST
/// /servers/<id>/drain?deadline_ms=N` on its status port), checked to be
/// taken (200 applied, 202 accepted).
fn operator_drain(lab: &Lab, id: u32, deadline_ms: u64) {
    let url = format!("http://127.0.0.1:9102/servers/{id}/drain?deadline_ms={deadline_ms}");
    let o = lab
        .try_run(
            "sw",
            "curl",
            &[
                "-s",
                "-m",
                "3",
                "-o",
                "/dev/null",
                "-w",
                "%{http_code}",
                "-X",
                "POST",
                &url,
            ],
            Duration::from_secs(5),
        )
        .expect("POST the drain to switchd");
    let code = String::from_utf8_lossy(&o.stdout).trim().to_string();
    assert!(code == "200" || code == "202", "drain s{id}: HTTP {code}");
}

/// Service `vip`'s `placing` list in switchd's `/status`.
fn placing(lab: &Lab, vip: &str) -> Option<Vec<u64>> {
    let v = capybara_systests::switchd_status_at(lab, 9102)?;
    let svc = v["services"].as_array()?.iter().find(|s| s["vip"] == vip)?;
    Some(
        svc["placing"]
            .as_array()?
            .iter()
            .filter_map(|x| x.as_u64())
            .collect(),
    )
}

/// A lab where s1's echo connections have nowhere to go: s1 serves echo
/// and HTTP (its `[shutdown] drain_timeout_ms` [`SHORT_DEADLINE_MS`]), s2
/// only HTTP; both registered, the VIP echoes, and the client holds
/// `held` echo connections (all on s1). Returns the lab, its directory,
/// switchd's log, s1's config and log, s1 and s2.
#[allow(clippy::type_complexity)]
fn nowhere_to_migrate_lab(
    name: &str,
    tag: &str,
    held: usize,
) -> (
    Lab,
    PathBuf,
    PathBuf,
    PathBuf,
    PathBuf,
    Agent,
    Agent,
    EchoHolder,
) {
    let (mut lab, dir, key, sw) = switchd_lab(name, tag, 2);
    let sw_log = dir.join("switchd.log");
    lab.spawn_switchd(&sw, &sw_log);
    let cfg1 = agent_config(&dir, &key, 1, SHORT_DEADLINE_MS);
    let cfg2 = agent_config(&dir, &key, 2, SHORT_DEADLINE_MS);
    let t = std::fs::read_to_string(&cfg2).unwrap();
    let echo = "[[service]]\nlisten = \"198.18.100.1:7\"\napp = \"echo\"\n";
    assert!(t.contains(echo), "{t}");
    std::fs::write(&cfg2, t.replace(echo, "")).unwrap();
    let log1 = dir.join("hostagent-s1.log");
    let s1 = Agent::start(&lab, 1, &cfg1, &log1);
    let s2 = Agent::start(&lab, 2, &cfg2, &dir.join("hostagent-s2.log"));
    lab.wait_registered(&sw_log, 2);
    lab.wait_for("the VIP to echo", Duration::from_secs(30), || {
        echo_once(&lab, "198.18.100.1:7")
    });
    let holder = EchoHolder::start(&lab, held);
    (lab, dir, sw_log, cfg1, log1, s1, s2, holder)
}

/// Checks s1's stop ended at its own deadline (not the operator drain's):
/// exit status 0, the cut connections logged, switchd says `stopped`.
fn assert_stopped_at_own_deadline(
    lab: &Lab,
    s1: &mut Agent,
    t0: Instant,
    log1: &Path,
    held: usize,
) {
    let (st, took) = wait_exit(s1, t0, Duration::from_millis(SHORT_DEADLINE_MS + 5000));
    let l1 = log_of(log1);
    assert!(st.success(), "s1 exited with {st}: {l1}");
    assert!(
        took >= Duration::from_millis(SHORT_DEADLINE_MS - 100),
        "s1 stopped after {took:?}, before its deadline: {l1}"
    );
    assert!(
        took < Duration::from_millis(SHORT_DEADLINE_MS + 3000),
        "s1 stopped after {took:?}: {l1}"
    );
    assert!(
        l1.contains(&format!(
            "deadline of {SHORT_DEADLINE_MS} ms passed: {held} connection(s) left, cut"
        )),
        "{l1}"
    );
    lab.wait_for("s1 stopped in /status", Duration::from_secs(5), || {
        status_bool(lab, 1, "stopped") == Some(true)
    });
    eprintln!(
        "GRACEFUL-STOP-LAB: s1 stopped at its own deadline after {:.0} ms, an operator drain of {OPERATOR_DRAIN_MS} ms running",
        took.as_secs_f64() * 1e3
    );
}

#[test]
fn a_stop_during_an_operator_drain_ends_at_its_own_deadline_and_the_drain_holds() {
    let _one = ONE_LAB.lock().unwrap_or_else(|e| e.into_inner());
    let (lab, dir, sw_log, cfg1, log1, mut s1, _s2, _held) =
        nowhere_to_migrate_lab("graceful-stop-drain-lab", "gsr", 4);
    // The operator drains s1 for a minute: its echo connections cannot
    // move, so the drain keeps running.
    operator_drain(&lab, 1, OPERATOR_DRAIN_MS);
    lab.wait_for("s1 draining in /status", Duration::from_secs(5), || {
        switchd_status_state(&lab, 1).as_deref() == Some("draining")
    });
    lab.wait_for("s1's drain under way", Duration::from_secs(5), || {
        log_of(&log1).contains("drain: 4 connection(s)")
    });
    std::thread::sleep(Duration::from_millis(300));
    assert!(s1.exited().is_none(), "s1 exited during the drain");

    let t0 = Instant::now();
    s1.signal("-TERM");
    assert_stopped_at_own_deadline(&lab, &mut s1, t0, &log1, 4);
    let swl = log_of(&sw_log);
    assert!(swl.contains("server s1 is leaving"), "{swl}");

    // Started again: registered, and still drained by the operator:
    // nothing placed on it, new connections go to s2.
    let log1b = dir.join("hostagent-s1-2.log");
    let mut s1 = Agent::start(&lab, 1, &cfg1, &log1b);
    lab.wait_for("s1 back, draining", Duration::from_secs(30), || {
        switchd_status_server(&lab, 1)
            .is_some_and(|v| v["state"] == "draining" && v["stopped"] == false)
    });
    lab.wait_for(
        "the restarted s1 told to drain",
        Duration::from_secs(5),
        || log_of(&log1b).contains("drain started"),
    );
    assert_eq!(placing(&lab, "198.18.100.1:7"), Some(vec![]), "echo");
    assert_eq!(placing(&lab, "198.18.100.1:80"), Some(vec![2]), "http");
    let answered: Vec<Option<String>> = (0..6).map(|_| http_server(&lab)).collect();
    assert!(
        answered.iter().all(|a| a.as_deref() == Some("s2")),
        "new connections with s1 drained: {answered:?}"
    );
    let st1 = switchd_status_server(&lab, 1).unwrap();
    assert_eq!(st1["state"], "draining", "{st1}");
    assert!(s1.exited().is_none(), "the restarted s1 exited");
}

#[test]
fn an_operator_drain_during_a_stop_does_not_extend_it() {
    let _one = ONE_LAB.lock().unwrap_or_else(|e| e.into_inner());
    let (lab, _dir, _sw_log, _cfg1, log1, mut s1, _s2, _held) =
        nowhere_to_migrate_lab("graceful-stop-late-drain-lab", "gsv", 3);
    let t0 = Instant::now();
    s1.signal("-TERM");
    lab.wait_for("s1 leaving in /status", Duration::from_secs(1), || {
        status_bool(&lab, 1, "leaving") == Some(true)
    });
    // The operator drains it for a minute while it leaves.
    operator_drain(&lab, 1, OPERATOR_DRAIN_MS);
    lab.wait_for("s1 draining in /status", Duration::from_secs(1), || {
        switchd_status_state(&lab, 1).as_deref() == Some("draining")
    });
    assert!(
        s1.exited().is_none(),
        "s1 exited before the operator's drain reached it: the check proves nothing"
    );
    assert_stopped_at_own_deadline(&lab, &mut s1, t0, &log1, 3);
}
