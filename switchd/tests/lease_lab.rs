//! HA lease robustness in the namespace lab (root, an etcd binary and the
//! `capybara` binary for `lab up`; skipped when not root), with the real etcd
//! the store tests start, inside the switch namespace:
//!
//! - the store goes away (etcd stopped, then restarted) while the only
//!   switchd is active: it keeps forwarding existing flows and placing new
//!   ones, and holds the lease again afterwards;
//! - the lease expires under it (the process frozen past the TTL) with no
//!   standby: it wins the lease back with a newer term and serves on;
//! - a standby wins the lease while the active is frozen: on waking, the
//!   active sees a newer term and steps down (detaches, exits), and the
//!   standby takes over; every connection survives;
//! - a fast takeover (no lease yet) meets a newer leader (another standby
//!   won the dead active's lease): it steps down and the leader serves.

use std::time::{Duration, Instant};

use capybara_switchd::labkit::{self, Lab};

fn skip() -> bool {
    if let Err(why) = labkit::lab_available() {
        eprintln!("skipped: {why}");
        return true;
    }
    assert!(
        std::path::Path::new("/usr/bin/etcd").exists() || std::env::var_os("ETCD_BIN").is_some(),
        "no etcd binary: `make setup` installs etcd-server (or set ETCD_BIN)"
    );
    false
}

fn switchd_bin() -> std::path::PathBuf {
    env!("CARGO_BIN_EXE_switchd").into()
}

enum EtcdCmd {
    Stop,
    Restart(std::sync::mpsc::Sender<anyhow::Result<()>>),
}

/// A one-member etcd owned by a thread inside the lab's switch namespace
/// (members are started from there, so they listen in it), stoppable and
/// restartable on the same data directory.
struct NsEtcd {
    endpoint: String,
    cmds: Option<std::sync::mpsc::Sender<EtcdCmd>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl NsEtcd {
    fn start(ns: &str) -> anyhow::Result<NsEtcd> {
        use std::os::fd::AsRawFd;
        let path = format!("/run/netns/{ns}");
        let (tx, rx) = std::sync::mpsc::channel::<anyhow::Result<String>>();
        let (cmd_tx, cmd_rx) = std::sync::mpsc::channel::<EtcdCmd>();
        let thread = std::thread::spawn(move || {
            let run = || -> anyhow::Result<capybara_store::testing::EtcdCluster> {
                let f = std::fs::File::open(&path)?;
                // SAFETY: plain syscall on a valid fd; this thread only.
                anyhow::ensure!(
                    unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) } == 0,
                    "setns {path}"
                );
                Ok(capybara_store::testing::EtcdCluster::start(1)?)
            };
            match run() {
                Ok(mut c) => {
                    let _ = tx.send(Ok(c.endpoints().join(",")));
                    // Ends when the test drops the sender.
                    while let Ok(cmd) = cmd_rx.recv() {
                        match cmd {
                            EtcdCmd::Stop => c.stop_member(0),
                            EtcdCmd::Restart(done) => {
                                let r = c.restart_member(0).map_err(anyhow::Error::from).and_then(
                                    |_| {
                                        c.wait_healthy(0, Duration::from_secs(20))
                                            .map_err(anyhow::Error::from)
                                    },
                                );
                                let _ = done.send(r);
                            }
                        }
                    }
                    drop(c);
                }
                Err(e) => {
                    let _ = tx.send(Err(e));
                }
            }
        });
        let endpoint = rx.recv_timeout(Duration::from_secs(30))??;
        Ok(NsEtcd {
            endpoint,
            cmds: Some(cmd_tx),
            thread: Some(thread),
        })
    }
    fn stop(&self) {
        if let Some(c) = &self.cmds {
            let _ = c.send(EtcdCmd::Stop);
        }
    }
    fn restart(&self) -> anyhow::Result<()> {
        let (tx, rx) = std::sync::mpsc::channel();
        self.cmds
            .as_ref()
            .ok_or_else(|| anyhow::anyhow!("etcd thread gone"))?
            .send(EtcdCmd::Restart(tx))?;
        rx.recv_timeout(Duration::from_secs(30))?
    }
}

impl Drop for NsEtcd {
    fn drop(&mut self) {
        drop(self.cmds.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn fail(lab: &Lab, e: anyhow::Error) -> ! {
    let logs: String = ["a.log", "b.log", "c.log"]
        .iter()
        .map(|n| (n, lab.log(n)))
        .filter(|(_, l)| !l.is_empty())
        .map(|(n, l)| format!("\n--- {n}\n{l}"))
        .collect();
    panic!("{e}{logs}")
}

/// What every test starts from.
struct Started {
    lab: Lab,
    etcd: NsEtcd,
    /// One config per switchd asked for, in order.
    configs: Vec<std::path::PathBuf>,
    /// The first switchd, active with the lease.
    active: usize,
    term: u64,
    held: Vec<(u16, u32, Option<std::net::TcpStream>)>,
    _agents: Vec<labkit::ServerAgent>,
}

/// A lab of 2 servers with etcd in its switch namespace and one switchd
/// config per `(name, status port, fast_takeover)`, the servers' liveness
/// relaxed (the tests freeze switchds for seconds; a server declared dead
/// is not what they test); the first switchd started and active with the
/// lease, both servers registered, 20 established connections held.
fn start(tag: &str, switchds: &[(&str, u16, bool)]) -> Started {
    let mut lab = Lab::up(tag, 2).expect("lab up");
    let etcd = NsEtcd::start(&lab.ns("sw")).expect("etcd in the switch namespace");
    lab.store = Some(format!("etcd:{}", etcd.endpoint));
    let configs: Vec<_> = switchds
        .iter()
        .map(|(name, port, fast)| {
            let ha = format!("[ha]\nenabled = true\nlease_ttl_ms = 1000\nflow_sync_interval_ms = 200\nfast_takeover = {fast}\n");
            let p = lab.switchd_config(name, 2, &[1, 1], *port, &ha).unwrap();
            let t = std::fs::read_to_string(&p).unwrap();
            std::fs::write(&p, t.replace("dead_after_ms = 500", "dead_after_ms = 10000")).unwrap();
            p
        })
        .collect();
    let (first, port) = (switchds[0].0, switchds[0].1);
    let active = lab
        .start_switchd(&switchd_bin(), &configs[0], &format!("{first}.log"))
        .unwrap();
    let (st, _) = lab
        .wait_status(
            port,
            Duration::from_secs(15),
            "active with the lease",
            |s| s["role"] == "active" && s["lease"]["held"] == true,
        )
        .unwrap_or_else(|e| fail(&lab, e));
    let term = st["lease_term"].as_u64().expect("term");
    let _agents: Vec<labkit::ServerAgent> = (1..=2)
        .map(|j| lab.register_server(j, 1))
        .collect::<anyhow::Result<_>>()
        .unwrap_or_else(|e| fail(&lab, e));
    let mut held = lab.connect_many(20, true).unwrap_or_else(|e| fail(&lab, e));
    assert_eq!(ping_all(&mut held, "before"), 0);
    Started {
        lab,
        etcd,
        configs,
        active,
        term,
        held,
        _agents,
    }
}

/// The switchd `frozen` (SIGSTOPped, logging to `frozen_log`) stays frozen
/// until the switchd logging to `winner_log` has won the lease; woken, it
/// must see the newer term and step down (exit), and the winner (status
/// port `winner_port`) serve with the lease. Returns the winner's term,
/// checked above `prev_term`.
fn newer_leader_takes_over(
    lab: &mut Lab,
    frozen: usize,
    frozen_log: &str,
    winner_log: &str,
    winner_port: u16,
    prev_term: u64,
) -> u64 {
    let t = Instant::now();
    // Bounded: 15 s.
    while !lab.log(winner_log).contains("won election") {
        if t.elapsed() > Duration::from_secs(15) {
            lab.kill(frozen, libc::SIGCONT);
            fail(lab, anyhow::anyhow!("{winner_log}: never won the lease"));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    lab.kill(frozen, libc::SIGCONT);
    if lab.wait(frozen, Duration::from_secs(5)).is_none() {
        fail(lab, anyhow::anyhow!("{frozen_log}: did not step down"));
    }
    assert!(
        lab.log(frozen_log).contains("stepping down"),
        "{}",
        lab.log(frozen_log)
    );
    let (st, _) = lab
        .wait_status(winner_port, Duration::from_secs(15), "winner active", |s| {
            s["role"] == "active" && s["lease"]["held"] == true
        })
        .unwrap_or_else(|e| fail(lab, e));
    let term = st["lease_term"].as_u64().expect("term");
    assert!(term > prev_term, "terms {prev_term} -> {term}");
    term
}

/// Echo on every held connection (each knows its server).
fn ping_all(held: &mut [(u16, u32, Option<std::net::TcpStream>)], tag: &str) -> usize {
    let mut lost = 0;
    for (port, s, c) in held.iter_mut() {
        if let Err(e) = labkit::ping(c.as_mut().expect("kept"), *s, tag) {
            eprintln!("{tag}: connection from port {port} to s{s} lost: {e}");
            lost += 1;
        }
    }
    lost
}

#[test]
fn active_survives_store_outage_and_lease_expiry_and_yields_only_to_a_newer_leader() {
    if skip() {
        return;
    }
    let Started {
        mut lab,
        etcd,
        configs,
        active: ia,
        term: term0,
        mut held,
        _agents,
    } = start("sgc", &[("a", 9102, false), ("b", 9103, false)]);
    let b = &configs[1];

    // 1. The store goes away for 3 s (three lease TTLs), then comes back.
    etcd.stop();
    std::thread::sleep(Duration::from_secs(3));
    let st = lab.status(9102).unwrap_or_else(|e| fail(&lab, e));
    assert_eq!(st["role"], "active", "stepped down in a store outage: {st}");
    assert!(
        !st["attached_ifindexes"].as_array().unwrap().is_empty(),
        "detached in a store outage"
    );
    assert_eq!(ping_all(&mut held, "outage"), 0, "existing flows forwarded");
    let fresh = lab
        .connect_many(10, false)
        .unwrap_or_else(|e| fail(&lab, e));
    assert_eq!(fresh.len(), 10, "new connections placed during the outage");
    etcd.restart().expect("etcd restart");
    lab.wait_status(
        9102,
        Duration::from_secs(20),
        "lease held after the outage",
        |s| s["lease"]["held"] == true && s["role"] == "active",
    )
    .unwrap_or_else(|e| fail(&lab, e));
    assert!(
        lab.wait(ia, Duration::from_millis(10)).is_none(),
        "a exited"
    );

    // 2. The lease expires under a frozen active (no standby): it wins it
    // back with a newer term instead of stepping down.
    lab.kill(ia, libc::SIGSTOP);
    std::thread::sleep(Duration::from_millis(3500));
    lab.kill(ia, libc::SIGCONT);
    let (st, _) = lab
        .wait_status(9102, Duration::from_secs(15), "lease won back", |s| {
            s["lease"]["regained"].as_u64().unwrap_or(0) >= 1 && s["lease"]["held"] == true
        })
        .unwrap_or_else(|e| fail(&lab, e));
    let term1 = st["lease_term"].as_u64().expect("term");
    assert!(term1 > term0, "terms {term0} -> {term1}");
    assert_eq!(st["role"], "active");
    assert!(
        lab.wait(ia, Duration::from_millis(10)).is_none(),
        "a exited"
    );
    assert_eq!(ping_all(&mut held, "regained"), 0);
    // The writer flushed what was held meanwhile.
    assert_eq!(st["lease"]["writes_fenced"], false);

    // 3. A standby wins the lease while the active is frozen: the active,
    // on waking, sees the newer term and steps down; the standby serves.
    lab.start_switchd(&switchd_bin(), b, "b.log").unwrap();
    lab.wait_status(9103, Duration::from_secs(15), "b standby and warm", |s| {
        s["role"] == "standby" && s["warm_flows"].as_u64().unwrap_or(0) >= 20
    })
    .unwrap_or_else(|e| fail(&lab, e));
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(
        lab.status(9103).unwrap()["role"],
        "standby",
        "b must wait while a holds the lease"
    );
    lab.kill(ia, libc::SIGSTOP);
    let term2 = newer_leader_takes_over(&mut lab, ia, "a.log", "b.log", 9103, term1);
    assert_eq!(ping_all(&mut held, "after step-down"), 0);
    eprintln!(
        "RESULT terms {term0} -> {term1} (won back) -> {term2} (standby); a: {}",
        lab.log("a.log")
            .lines()
            .filter(|l| l.contains("leader lease") || l.contains("stepping down"))
            .collect::<Vec<_>>()
            .join(" | ")
    );
    drop(lab);
    drop(etcd);
}

/// A fast takeover (same box) serves before it holds a lease. If another
/// candidate wins the lease meanwhile (here a standby with
/// `fast_takeover = false`, as on another box), the fast one sees a term
/// above its dead predecessor's and steps down; the lease holder serves
/// every connection.
#[test]
fn fast_takeover_steps_down_for_a_newer_leader() {
    if skip() {
        return;
    }
    let Started {
        mut lab,
        etcd,
        configs,
        active: ia,
        term: term0,
        mut held,
        _agents,
    } = start(
        "sgt",
        &[("a", 9102, false), ("b", 9103, true), ("c", 9104, false)],
    );
    let ib = lab
        .start_switchd(&switchd_bin(), &configs[1], "b.log")
        .unwrap();
    lab.start_switchd(&switchd_bin(), &configs[2], "c.log")
        .unwrap();
    for port in [9103, 9104] {
        lab.wait_status(port, Duration::from_secs(15), "standby and warm", |s| {
            s["role"] == "standby" && s["warm_flows"].as_u64().unwrap_or(0) >= 20
        })
        .unwrap_or_else(|e| fail(&lab, e));
    }

    // The active dies: b takes over at once, without a lease (the dead
    // one's has not expired), and holds its writes.
    lab.kill(ia, libc::SIGKILL);
    let (st, _) = lab
        .wait_status(9103, Duration::from_secs(10), "b took over fast", |s| {
            s["role"] == "active"
        })
        .unwrap_or_else(|e| fail(&lab, e));
    // Freeze b before the dead lease expires, so that c wins it.
    lab.kill(ib, libc::SIGSTOP);
    assert_eq!(st["fast_takeover"], true, "{st}");
    assert_eq!(
        st["lease"]["held"], false,
        "b won the lease before it could be frozen (the scenario needs c to win it): {st}"
    );
    newer_leader_takes_over(&mut lab, ib, "b.log", "c.log", 9104, term0);
    assert_eq!(ping_all(&mut held, "after step-down"), 0);
    let fresh = lab
        .connect_many(10, false)
        .unwrap_or_else(|e| fail(&lab, e));
    assert_eq!(fresh.len(), 10, "new connections placed by c");
    drop(lab);
    drop(etcd);
}

/// A standby that takes over reads the servers' application health as the
/// active did: s1 reports its application of VIP:80 down (a heartbeat
/// bit, a position in its REGISTER's service list); the new active, which
/// never saw that REGISTER, knows the list from the store's server record,
/// so it keeps s1 out of placement and new connections all go to s2.
#[test]
fn a_takeover_keeps_the_servers_application_health() {
    if skip() {
        return;
    }
    let Started {
        mut lab,
        etcd,
        configs,
        active: ia,
        mut held,
        _agents,
        ..
    } = start("sgh", &[("a", 9105, false), ("b", 9106, true)]);
    let down_on = |st: &serde_json::Value| st["services"][0]["backend_down"].clone();
    _agents[0].report_health(&[0]);
    lab.wait_status(9105, Duration::from_secs(10), "a sees s1 down", |s| {
        down_on(s) == serde_json::json!([1])
    })
    .unwrap_or_else(|e| fail(&lab, e));
    lab.start_switchd(&switchd_bin(), &configs[1], "b.log")
        .unwrap();
    lab.wait_status(9106, Duration::from_secs(15), "standby and warm", |s| {
        s["role"] == "standby" && s["warm_flows"].as_u64().unwrap_or(0) >= 20
    })
    .unwrap_or_else(|e| fail(&lab, e));
    lab.kill(ia, libc::SIGKILL);
    lab.wait_status(9106, Duration::from_secs(10), "b took over", |s| {
        s["role"] == "active"
    })
    .unwrap_or_else(|e| fail(&lab, e));
    lab.wait_status(9106, Duration::from_secs(5), "b sees s1 down", |s| {
        down_on(s) == serde_json::json!([1])
    })
    .unwrap_or_else(|e| fail(&lab, e));
    assert_eq!(ping_all(&mut held, "after the takeover"), 0);
    let fresh = lab
        .connect_many(10, false)
        .unwrap_or_else(|e| fail(&lab, e));
    assert!(
        fresh.iter().all(|(_, s, _)| *s == 2),
        "new connections avoid s1, whose application is down: {:?}",
        fresh.iter().map(|(_, s, _)| *s).collect::<Vec<_>>()
    );
    drop(lab);
    drop(etcd);
}
