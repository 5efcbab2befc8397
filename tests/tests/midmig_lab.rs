//! A hostagent killed with SIGKILL in the middle of migrations (lab, root;
//! release binaries, or `CAPYBARA_BIN_DIR`): the real switchd with its XDP
//! data plane, three servers with real hostagents serving echo, a real
//! Linux client (issue #4: "a migration that cannot complete within a
//! deadline aborts to one consistent owner, and the switch entry is made to
//! agree"; the in-memory harness covers the protocol, this covers a host
//! death with the real stacks and data plane).
//!
//! s1 and s2 churn every connection they serve to each other every
//! [`CHURN_MS`] (policies off), so migrations both ways are always in
//! flight; s3 never migrates (its connections are the control group).
//! [`CONNECTIONS`] echo connections are held by one client process that
//! echoes on all of them at once, round after round
//! ([`EchoHolder::round_outcomes`]); one hostagent is killed (-9) during
//! the rounds:
//!
//! - `killing_the_target_mid_migrations_...`: s2, the target of s1's
//!   migrations in flight (and the origin of its own to s1);
//! - `killing_the_origin_mid_migrations_...`: s1, the origin of migrations
//!   in flight to s2 (and their target back).
//!
//! Asserted, per connection: it echoes byte-exact in every round, or it
//! ends with an error (reset, EOF, a socket error) and is never used
//! again; none hangs (no answer and no error within [`ROUND_LIMIT`], a
//! bound far above what a host failure costs: `dead_after_ms` 1 s plus the
//! lab's `dead_flow_grace_ms` [`GRACE_MS`] plus the client's retransmission
//! backoff); none receives wrong bytes (`differs`). Every connection of the
//! control group (on s3 before the kill, per the switch's tables) echoes
//! through. Once switchd declared the server dead and its grace ended, the
//! switch's tables (the migration and flow maps of the running XDP
//! program, read with bpftool) hold no entry that sends a flow to it, and
//! after further rounds still none (nothing installed one again). New
//! connections are placed on the live servers and echo.
//!
//! What happens to the connections in flight (docs/MIGRATION.md, "The
//! one-owner rule"): a migration not yet sending its snapshot resumes on
//! its origin (it echoes on); one whose target imported it lives on the
//! target; one whose snapshot was sent to the dead target is in doubt and
//! ends `Lost` after `in_doubt_limit`; the dead host's own connections
//! (including those it buffered as a target) end once switchd removes its
//! entries: the client's next retransmission reaches a live server, which
//! resets it. The counts are printed (`MIDMIG-LAB RESULT`).
//!
//! Bounded: every wait has a limit; a run takes ~20 s. Every process is
//! killed and the lab (namespaces, pins) removed on every exit path (the
//! [`Lab`] and [`EchoHolder`] guards).

use capybara_systests::{
    disable_policies, hostagent_migrating_config, http_get, metric_sum, switchd_lab,
    switchd_status_at, EchoHolder, EchoOutcome, Lab, SwitchMaps,
};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

const SERVERS: u32 = 3;
/// Echo connections held by the client.
const CONNECTIONS: usize = 60;
/// s1 and s2 hand every connection they serve to each other this often.
const CHURN_MS: u64 = 3;
/// The lab switchd's `dead_flow_grace_ms` (default 10 s): a dead server's
/// entries go this long after it is declared dead.
const GRACE_MS: u64 = 2000;
/// A round in which a connection neither echoed nor failed within this
/// is a hang: a dead server's connection fails after about `dead_after`
/// (1 s) + the grace (2 s) + the client's retransmission backoff (its
/// retransmissions at 3.0 s, 6.2 s, 12.6 s after the first loss).
const ROUND_LIMIT: Duration = Duration::from_secs(60);
/// Status port of the lab switchd (`switchd_config`'s `metrics_listen`).
const STATUS: u16 = 9102;
const VIP: &str = "198.18.100.1:7";

/// The two tests share the machine's 2 cores: one lab at a time, so that
/// no hostagent is starved into missing heartbeats.
static ONE_LAB: Mutex<()> = Mutex::new(());

/// A lab with switchd and three hostagents: s1 and s2 churning to each
/// other, s3 static.
struct Rig {
    lab: Lab,
    dir: std::path::PathBuf,
    /// Hostagent pids, index 0: s1.
    pids: Vec<u32>,
}

fn start(test: &str, tag: &str) -> Rig {
    let (mut lab, dir, key, sw) = switchd_lab(test, tag, SERVERS);
    let text = std::fs::read_to_string(&sw).expect("read switchd config");
    assert!(text.contains("dead_after_ms = 1000\n"), "{text}");
    let text = text.replace(
        "dead_after_ms = 1000\n",
        &format!("dead_after_ms = 1000\ndead_flow_grace_ms = {GRACE_MS}\n"),
    );
    std::fs::write(&sw, text).expect("write switchd config");
    lab.spawn_switchd(&sw, &dir.join("switchd.log"));
    let mut pids = Vec::new();
    for j in 1..=SERVERS {
        let churn = match j {
            1 => Some((CHURN_MS, 2)),
            2 => Some((CHURN_MS, 1)),
            _ => None,
        };
        let cfg = hostagent_migrating_config(&dir, j, &key, churn);
        disable_policies(&cfg);
        let log = dir.join(format!("hostagent-s{j}.log"));
        pids.push(lab.spawn_hostagent(j, &cfg, &log));
    }
    lab.wait_registered(&dir.join("switchd.log"), SERVERS);
    lab.wait_for("the VIP to answer", Duration::from_secs(30), || {
        capybara_systests::echo_once(&lab, VIP)
    });
    Rig { lab, dir, pids }
}

/// The switch's tables as the running XDP program holds them: per client
/// port (flows of the echo service from the client), the flow entry's
/// server index and the migration entry's (owner index, pending).
#[derive(Debug, Default)]
struct Tables {
    flows: BTreeMap<u16, u32>,
    migrations: BTreeMap<u16, (u32, bool)>,
}

impl Tables {
    /// The server index a flow's packets go to (its migration entry's
    /// owner, else its flow entry's server).
    fn owner(&self, port: u16) -> Option<u32> {
        self.migrations
            .get(&port)
            .map(|m| m.0)
            .or_else(|| self.flows.get(&port).copied())
    }

    /// Entries that send a flow to server index `idx`: migration entries
    /// owned by it, flow entries on it without a migration entry elsewhere.
    fn sending_to(&self, idx: u32) -> Vec<String> {
        let mut v: Vec<String> = self
            .migrations
            .iter()
            .filter(|(_, m)| m.0 == idx)
            .map(|(p, m)| format!("migration entry of port {p} (pending {})", m.1))
            .collect();
        v.extend(
            self.flows
                .iter()
                .filter(|(p, s)| **s == idx && !self.migrations.contains_key(p))
                .map(|(p, _)| format!("flow entry of port {p}")),
        );
        v
    }
}

/// Reads the flow and migration maps of the program attached through the
/// lab switchd's pinned links (`/status.pin_dir`).
fn tables(lab: &Lab) -> Tables {
    let maps = SwitchMaps::of(lab, STATUS);
    let dump = |name: &str| maps.dump(name);
    // struct capy_flow_key: client_ip, service_ip (network order), then
    // client_port, service_port (network order); values start with the
    // server index (host order, u32), then (migrations) `pending`.
    let port7 = 7u16.to_be_bytes();
    let echo_port =
        |k: &[u8]| (k.len() >= 12 && k[10..12] == port7).then(|| u16::from_be_bytes([k[8], k[9]]));
    let index = |v: &[u8]| u32::from_le_bytes([v[0], v[1], v[2], v[3]]);
    let mut t = Tables::default();
    for (k, v) in dump("flows") {
        if let Some(p) = echo_port(&k) {
            t.flows.insert(p, index(&v));
        }
    }
    for (k, v) in dump("migrations") {
        if let Some(p) = echo_port(&k) {
            t.migrations.insert(p, (index(&v), v[4] != 0));
        }
    }
    t
}

/// Server `id`'s index in the switch's tables, and its `/status` entry.
fn server_status(lab: &Lab, id: u32) -> serde_json::Value {
    switchd_status_at(lab, STATUS)
        .and_then(|st| {
            st["servers"]
                .as_array()?
                .iter()
                .find(|s| s["id"] == id)
                .cloned()
        })
        .unwrap_or_default()
}

/// Total of a hostagent's `capybara_tcpmig_events_total{event=..}`.
fn tcpmig(metrics: &str, event: &str) -> u64 {
    metric_sum(
        metrics,
        "capybara_tcpmig_events_total",
        &format!("event=\"{event}\""),
    )
    .unwrap_or(0.0) as u64
}

/// The migrations the servers reported to switchd (`GET /migrations`,
/// read as they come: the ring keeps the last 4,096): per client port, the
/// outcome of the last one the surviving server (`reporter`) reported.
struct Reports {
    reporter: u32,
    after: u64,
    /// Reports lost to the ring before they were read.
    missed: u64,
    last: BTreeMap<u16, (u64, String)>,
}

/// What a server's last report on a connection says about who owns it:
/// the server itself (its migration out resumed or never started, or it
/// imported the connection).
const OWNS: [&str; 3] = ["resumed", "not_started", "migrated_in"];

impl Reports {
    fn new(reporter: u32) -> Self {
        Reports {
            reporter,
            after: 0,
            missed: 0,
            last: BTreeMap::new(),
        }
    }

    /// Reads the reports switchd received since the last call.
    fn poll(&mut self, lab: &Lab) {
        let addr = std::net::SocketAddr::from(([127, 0, 0, 1], STATUS));
        // Bounded: the reporters add a few thousand a second at most.
        for _ in 0..100 {
            let path = format!("/migrations?after={}&limit=1000", self.after);
            let Some(body) = lab.in_netns("sw", || http_get(addr, &path, Duration::from_secs(5)))
            else {
                return;
            };
            let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
            let items = v["items"].as_array().cloned().unwrap_or_default();
            if items.is_empty() {
                return;
            }
            for m in items {
                let seq = m["seq"].as_u64().unwrap_or(0);
                // Those before the first read do not count.
                if self.after > 0 && seq > self.after + 1 {
                    self.missed += seq - self.after - 1;
                }
                self.after = seq;
                if m["reporter"] != self.reporter || m["service"] != VIP {
                    continue;
                }
                let Some(port) = m["client"]
                    .as_str()
                    .and_then(|c| c.rsplit_once(':'))
                    .and_then(|(_, p)| p.parse::<u16>().ok())
                else {
                    continue;
                };
                let outcome = m["outcome"].as_str().unwrap_or("").to_string();
                self.last.insert(port, (seq, outcome));
            }
        }
    }

    /// The last outcome reported for `port` ("none": no report read).
    fn last_of(&self, port: u16) -> &str {
        self.last.get(&port).map_or("none", |(_, o)| o.as_str())
    }
}

/// What became of each connection over all rounds.
#[derive(Debug, Default)]
struct Fates {
    /// Rounds echoed byte-exact, per port.
    ok_rounds: BTreeMap<u16, u32>,
    /// How (and after how many ms of its round) a connection ended.
    ended: BTreeMap<u16, EchoOutcome>,
    /// `hang` or `differs`: never acceptable.
    broken: Vec<String>,
    rounds: u32,
}

impl Fates {
    fn add(&mut self, round: BTreeMap<u16, EchoOutcome>) {
        self.rounds += 1;
        for (port, o) in round {
            assert!(
                !self.ended.contains_key(&port),
                "port {port} used after it ended"
            );
            match o.what.as_str() {
                "ok" => *self.ok_rounds.entry(port).or_default() += 1,
                "reset" | "closed" => {
                    self.ended.insert(port, o);
                }
                w if w.starts_with("error-") => {
                    self.ended.insert(port, o);
                }
                _ => {
                    self.broken.push(format!(
                        "port {port}: {} after {:.0} ms in round {}",
                        o.what, o.ms, self.rounds
                    ));
                    self.ended.insert(port, o);
                }
            }
        }
    }
}

/// The scenario: `victim` (1 or 2) is killed with SIGKILL while rounds of
/// echo run on every connection and migrations are in flight.
fn kill_mid_migrations(test: &str, tag: &str, victim: u32) {
    let _one = ONE_LAB.lock().unwrap_or_else(|e| e.into_inner());
    let t_start = Instant::now();
    let mut rig = start(test, tag);
    let (lab, dir) = (&rig.lab, rig.dir.clone());
    let mut idx: BTreeMap<u32, u32> = BTreeMap::new();
    lab.wait_for(
        "every server's index in switchd's /status",
        Duration::from_secs(20),
        || {
            for j in 1..=SERVERS {
                if let Some(i) = server_status(lab, j)["index"].as_u64() {
                    idx.insert(j, i as u32);
                }
            }
            idx.len() == SERVERS as usize
        },
    );
    let mut holder = EchoHolder::start_reporting(lab, VIP, CONNECTIONS);
    let mut fates = Fates::default();
    let first = holder.round_outcomes(ROUND_LIMIT);
    assert!(
        first.values().all(|o| o.what == "ok"),
        "before any kill: {first:?}"
    );
    fates.add(first);

    // Migrations under way both ways before the kill.
    let migrated_out = |j: u32| tcpmig(&lab.server_metrics(j), "migrated_out");
    lab.wait_for(
        "s1 and s2 migrating to each other",
        Duration::from_secs(20),
        || migrated_out(1) >= 20 && migrated_out(2) >= 20,
    );
    // The control group: on s3 (never migrated: s3 does not churn, and
    // s1 and s2 churn only to each other).
    let before = tables(lab);
    let control: BTreeSet<u16> = holder
        .ports
        .iter()
        .copied()
        .filter(|p| before.owner(*p) == Some(idx[&3]))
        .collect();
    assert!(
        control.iter().all(|p| !before.migrations.contains_key(p)),
        "a connection on s3 has a migration entry: {before:?}"
    );
    assert!(
        !control.is_empty() && control.len() < CONNECTIONS,
        "connections on s3: {} of {CONNECTIONS} ({before:?})",
        control.len()
    );

    // Rounds of echo on one thread; the kill on this one, in the middle.
    let victim_pid = rig.pids[victim as usize - 1];
    let other = 3 - victim;
    let reports = Mutex::new(Reports::new(other));
    let stop = AtomicBool::new(false);
    // Bounded: the main thread sets `stop` within ~45 s (its waits are
    // bounded), and should it panic first, the loops end by themselves.
    let until = Instant::now() + Duration::from_secs(90);
    let going = || !stop.load(Ordering::SeqCst) && Instant::now() < until;
    let (killed_at, declared_dead_after, grace_ended_after) = std::thread::scope(|s| {
        let rounds = s.spawn(|| {
            let mut all = Vec::new();
            // Each round ends within ROUND_LIMIT.
            while going() {
                all.push(holder.round_outcomes(ROUND_LIMIT));
            }
            all
        });
        s.spawn(|| {
            while going() {
                reports.lock().unwrap().poll(lab);
                std::thread::sleep(Duration::from_millis(100));
            }
        });
        std::thread::sleep(Duration::from_millis(700));
        let at = Instant::now();
        // SAFETY: a plain kill(2) of a child this test started (reaped by
        // `kill_and_wait` below).
        assert_eq!(unsafe { libc::kill(victim_pid as i32, libc::SIGKILL) }, 0);
        let mut dead = None;
        lab.wait_for(
            &format!("switchd to declare s{victim} dead"),
            Duration::from_secs(20),
            || {
                let ok = server_status(lab, victim)["state"] == "dead";
                if ok {
                    dead = Some(at.elapsed());
                }
                ok
            },
        );
        let mut grace = None;
        lab.wait_for(
            &format!("s{victim}'s grace to end (its entries removed)"),
            Duration::from_secs(20),
            || {
                let st = switchd_status_at(lab, STATUS).unwrap_or_default();
                let ok = st["liveness"]["grace_ended_total"].as_u64().unwrap_or(0) >= 1;
                if ok {
                    grace = Some(at.elapsed());
                }
                ok
            },
        );
        // The entries of the dead server are gone now; rounds go on for a
        // while (connections still ending, survivors echoing).
        let after_grace = tables(lab);
        let left = after_grace.sending_to(idx[&victim]);
        std::thread::sleep(Duration::from_secs(3));
        stop.store(true, Ordering::SeqCst);
        for r in rounds.join().expect("the rounds thread") {
            fates.add(r);
        }
        assert!(
            left.is_empty(),
            "switchd's tables still send flows to s{victim} after its grace ended: {left:?}"
        );
        (at, dead.unwrap(), grace.unwrap())
    });
    rig.lab.kill_and_wait(victim_pid);
    let lab = &rig.lab;

    // Survivors echo on in further rounds; nothing sends to the dead
    // server again.
    for _ in 0..3 {
        fates.add(holder.round_outcomes(ROUND_LIMIT));
    }
    let mut reports = reports.into_inner().unwrap();
    reports.poll(lab);
    let last = tables(lab);
    let left = last.sending_to(idx[&victim]);
    assert!(
        left.is_empty(),
        "switchd's tables send flows to s{victim} again at the end: {left:?}"
    );
    assert!(
        fates.broken.is_empty(),
        "connections hung or received wrong bytes (s{victim} killed {:.0} ms into the run): {:?}",
        killed_at.duration_since(t_start).as_secs_f64() * 1e3,
        fates.broken
    );
    let survivors: BTreeSet<u16> = holder
        .ports
        .iter()
        .copied()
        .filter(|p| !fates.ended.contains_key(p))
        .collect();
    let lost_control: Vec<_> = control
        .iter()
        .filter(|p| fates.ended.contains_key(p))
        .map(|p| (p, &fates.ended[p]))
        .collect();
    assert!(
        lost_control.is_empty(),
        "connections on s3 (no migration involved) ended: {lost_control:?}"
    );
    assert_eq!(survivors.len() + fates.ended.len(), CONNECTIONS);
    // One owner, and the switch agrees: a connection the surviving server
    // says it holds (its last migration of it resumed, or it imported it)
    // echoes on.
    let disowned: Vec<String> = fates
        .ended
        .iter()
        .filter(|(p, _)| OWNS.contains(&reports.last_of(**p)))
        .map(|(p, o)| {
            format!(
                "port {p}: s{other} reported {} last, the client saw {} after {:.0} ms",
                reports.last_of(*p),
                o.what,
                o.ms
            )
        })
        .collect();
    assert!(
        disowned.is_empty(),
        "connections that s{other} holds ended (s{victim} killed; {} reports missed): {disowned:?}",
        reports.missed
    );
    for p in &survivors {
        assert_eq!(
            fates.ok_rounds.get(p).copied().unwrap_or(0),
            fates.rounds,
            "port {p} survived but missed rounds"
        );
    }
    // New connections go to the live servers and echo.
    let mut fresh = EchoHolder::start(lab, 12);
    assert_eq!(fresh.round_trip(), "ok", "new connections after the kill");
    assert_eq!(fresh.close(), "closed");
    drop(fresh);

    // What happened, for the notes and docs: how the connections of the
    // s1/s2 pool ended or went on, by the surviving server's last report.
    let mut by_report: BTreeMap<String, (usize, usize)> = BTreeMap::new();
    for p in holder.ports.iter().filter(|p| !control.contains(p)) {
        let e = by_report
            .entry(reports.last_of(*p).to_string())
            .or_default();
        if fates.ended.contains_key(p) {
            e.1 += 1;
        } else {
            e.0 += 1;
        }
    }
    let m = lab.server_metrics(other);
    let _ = std::fs::write(dir.join(format!("metrics-s{other}.txt")), &m);
    let mut how: BTreeMap<String, usize> = BTreeMap::new();
    for o in fates.ended.values() {
        *how.entry(o.what.clone()).or_default() += 1;
    }
    let slowest = fates.ended.values().map(|o| o.ms).fold(0.0f64, f64::max);
    println!(
        "MIDMIG-LAB RESULT: s{victim} killed -9 mid-migrations: {CONNECTIONS} connections, {} \
         rounds; {} echo byte-exact throughout ({} on s3, {} of the s1/s2 pool), {} ended \
         {how:?} (the slowest {slowest:.0} ms into its round), 0 hung, 0 wrong bytes; switchd \
         declared s{victim} dead after {:.0} ms, its entries removed after {:.0} ms (grace \
         {GRACE_MS} ms), none left; s{other}'s TCPMig: {} resumed, {} lost, {} migrated out, {} \
         in; the pool by s{other}'s last report (echoing, ended): {by_report:?} ({} reports \
         missed); total {:.0} s",
        fates.rounds,
        survivors.len(),
        control.len(),
        survivors.len() - control.len(),
        fates.ended.len(),
        declared_dead_after.as_secs_f64() * 1e3,
        grace_ended_after.as_secs_f64() * 1e3,
        tcpmig(&m, "resumed"),
        tcpmig(&m, "lost"),
        tcpmig(&m, "migrated_out"),
        tcpmig(&m, "migrated_in"),
        reports.missed,
        t_start.elapsed().as_secs_f64()
    );
    drop(holder);
}

/// s2, the target of s1's migrations in flight, killed with SIGKILL.
#[test]
fn killing_the_target_mid_migrations_leaves_no_connection_hanging() {
    kill_mid_migrations("midmig_lab_target", "mmt", 2);
}

/// s1, the origin of migrations in flight to s2, killed with SIGKILL.
#[test]
fn killing_the_origin_mid_migrations_leaves_no_connection_hanging() {
    kill_mid_migrations("midmig_lab_origin", "mmo", 1);
}
