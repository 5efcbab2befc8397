//! End-to-end tests in the network-namespace lab (root; skipped otherwise):
//! switchd in `P-sw`, kernel stand-ins for the servers (see
//! `capybara_switchd::labkit`), a real Linux TCP client.
//!
//! - placement: 3,000 connections land on the server that the Maglev table
//!   predicts for their 4-tuple, and the shares are within 5 percentage
//!   points of the weights (1:2:3);
//! - liveness: a server whose heartbeats stop is dead (out of placement)
//!   within 1 s, its flow entries are gone after its grace (1 s here),
//!   connections to the others keep working;
//! - persistence: flows are in the store; closed flows are reaped after the
//!   linger;
//! - HA: SIGKILL of the active switchd while the client holds established
//!   connections; the standby takes over and every connection still works.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use capybara_proto::FlowKey;
use capybara_switchd::labkit::{self, Lab, VIP};
use capybara_switchd::maglev::{self, Backend};

/// The lab tests share the 2-core machine: one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn skip() -> bool {
    if let Err(why) = labkit::lab_available() {
        eprintln!("skipped: {why}");
        return true;
    }
    false
}

fn switchd_bin() -> std::path::PathBuf {
    env!("CARGO_BIN_EXE_switchd").into()
}

#[test]
fn placement_liveness_and_persistence() {
    if skip() {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let mut lab = Lab::up("swl", 3).expect("lab up");
    let weights = [1u32, 2, 3];
    // A short grace: the liveness part waits for the dead server's entries
    // to go (tests/tests/server_liveness.rs covers coming back within it).
    let cfg = lab
        .switchd_config("a", 3, &weights, 9102, "dead_flow_grace_ms = 1000")
        .unwrap();
    let out = std::process::Command::new(switchd_bin())
        .arg("--config")
        .arg(&cfg)
        .arg("--check")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "--check: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    lab.start_switchd(&switchd_bin(), &cfg, "a.log").unwrap();
    lab.wait_status(9102, Duration::from_secs(10), "switchd active", |s| {
        s["role"] == "active"
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", lab.log("a.log")));
    let agents: Vec<_> = (1..=3)
        .map(|j| {
            lab.register_server(j, 1)
                .unwrap_or_else(|e| panic!("{e}\n{}", lab.log("a.log")))
        })
        .collect();
    let (status, _) = lab
        .wait_status(9102, Duration::from_secs(5), "3 live servers", |s| {
            s["servers"]
                .as_array()
                .map(|a| a.iter().filter(|x| x["state"] == "live").count() == 3)
                .unwrap_or(false)
        })
        .unwrap();

    // Load notifications reach the data address every interval.
    let ln = lab.load_listener(1).unwrap();
    let mut got = 0;
    let mut b = [0u8; 128];
    let t = Instant::now();
    while got < 50 && t.elapsed() < Duration::from_secs(2) {
        if let Ok((n, _)) = ln.recv_from(&mut b) {
            let r = capybara_proto::load::LoadRepr::parse_bytes(&b[..n])
                .expect("valid LOAD-NOTIFICATION");
            assert_eq!(r.server_id.0, 1);
            assert_eq!(r.live_servers, 3);
            got += 1;
        }
    }
    assert!(
        got >= 50,
        "only {got} load notifications in 2 s (1 ms interval)"
    );
    let load_rate = got as f64 / t.elapsed().as_secs_f64();

    // Placement: 3,000 connections, each where Maglev says.
    let index_of: BTreeMap<u32, u32> = status["servers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            (
                s["index"].as_u64().unwrap() as u32,
                s["id"].as_u64().unwrap() as u32,
            )
        })
        .collect();
    let backends: Vec<Backend> = index_of
        .iter()
        .map(|(idx, id)| Backend {
            id: *id,
            index: *idx,
            weight: weights[*id as usize - 1],
        })
        .collect();
    let table = maglev::build_table(&backends, capybara_switchd::abi::MAGLEV_SIZE);
    let t = Instant::now();
    let conns = lab
        .connect_many(3000, false)
        .unwrap_or_else(|e| panic!("{e}\n{}", lab.log("a.log")));
    let elapsed = t.elapsed();
    let mut counts = [0usize; 4];
    let mut mispredicted = 0;
    for (port, server, _) in &conns {
        counts[*server as usize] += 1;
        let k = FlowKey {
            client_ip: labkit::client_addr(1),
            client_port: *port,
            service_ip: VIP,
            service_port: 80,
        };
        let predicted =
            index_of[&table[(maglev::flow_hash(&k) % capybara_switchd::abi::MAGLEV_SIZE) as usize]];
        if predicted != *server {
            mispredicted += 1;
        }
    }
    let total_w: u32 = weights.iter().sum();
    eprintln!("placement of 3000 connections in {elapsed:?}: s1={} s2={} s3={} (weights 1:2:3), load notifications {load_rate:.0}/s", counts[1], counts[2], counts[3]);
    assert_eq!(mispredicted, 0, "connections not on their Maglev server");
    for j in 1..=3 {
        let share = counts[j] as f64 / 3000.0;
        let expected = weights[j - 1] as f64 / total_w as f64;
        assert!(
            (share - expected).abs() < 0.05,
            "s{j}: share {share:.3}, weight share {expected:.3}"
        );
    }

    // Persistence: the store saw the flows (and their deletion at close);
    // the closed flows' entries are reaped after the 1 s linger.
    let (s, _) = lab
        .wait_status(9102, Duration::from_secs(5), "store caught up", |s| {
            s["store"]["sink_puts"].as_u64().unwrap_or(0) >= 3000 && s["store"]["backlog"] == 0
        })
        .unwrap();
    assert!(
        s["store"]["sink_deletes"].as_u64().unwrap() >= 2900,
        "{}",
        s["store"]
    );
    lab.wait_status(9102, Duration::from_secs(6), "closed flows reaped", |s| {
        s["flows"] == 0 && s["reaped_total"].as_u64().unwrap_or(0) >= 2900
    })
    .unwrap();

    // Liveness: hold connections, stop s2's heartbeats.
    let mut held = lab.connect_many(60, true).unwrap();
    for (_, server, c) in held.iter_mut() {
        labkit::ping(c.as_mut().unwrap(), *server, "before").unwrap();
    }
    let on_s2 = held.iter().filter(|h| h.1 == 2).count();
    assert!(on_s2 > 0 && on_s2 < 60);
    lab.wait_status(9102, Duration::from_secs(3), "held flows counted", |s| {
        s["flows"] == 60
    })
    .unwrap();
    agents[1].stop();
    let stopped = Instant::now();
    let (_, _) = lab
        .wait_status(9102, Duration::from_secs(3), "s2 dead", |s| {
            s["servers"]
                .as_array()
                .map(|a| a.iter().any(|x| x["id"] == 2 && x["state"] == "dead"))
                .unwrap_or(false)
        })
        .unwrap();
    let detect = stopped.elapsed();
    eprintln!("dead server detected {detect:?} after its last heartbeat (dead_after 500 ms)");
    assert!(detect < Duration::from_secs(1), "detection took {detect:?}");
    lab.wait_status(9102, Duration::from_secs(3), "s2's entries removed", |s| {
        s["flows"].as_u64() == Some((60 - on_s2) as u64)
    })
    .unwrap();
    for (_, server, c) in held.iter_mut().filter(|h| h.1 != 2) {
        labkit::ping(c.as_mut().unwrap(), *server, "after").unwrap();
    }
    // New connections avoid the dead server.
    let fresh = lab.connect_many(200, false).unwrap();
    assert!(
        fresh.iter().all(|c| c.1 != 2),
        "a new connection went to the dead server"
    );
    let m = lab.fetch(9102, "/metrics").unwrap();
    assert!(
        m.contains("capybara_store_flow_writer_batch_size_bucket")
            && m.contains("capybara_switchd_dataplane_packets_total"),
        "{m}"
    );

    // Hostile control traffic is counted by reason and dropped; the
    // switch keeps serving.
    {
        let key = capybara_proto::MigrationKey::from_hex(labkit::KEY_HEX).unwrap();
        let wrong = capybara_proto::MigrationKey::from_hex(&"ab".repeat(32)).unwrap();
        let hb = |seq: u64, id: u32, k| labkit::idle_heartbeat(id, seq, k);
        let mut bad_version = hb(1 << 40, 1, &key);
        bad_version[2] = 9;
        let mut truncated = hb(1 << 40, 1, &key);
        truncated.truncate(30);
        let garbage: Vec<u8> = (0..200u32).map(|i| (i * 37 % 251) as u8).collect();
        lab.send_raw_control(
            1,
            vec![
                hb(1 << 40, 1, &wrong), // bad MAC
                bad_version,            // unknown version
                truncated,              // truncated
                garbage,                // not a control message
                hb(1, 1, &key),         // replayed sequence number
                hb(1 << 40, 77, &key),  // unregistered server
                vec![],                 // empty datagram
            ],
        )
        .unwrap();
        let (s, _) = lab
            .wait_status(
                9102,
                Duration::from_secs(3),
                "hostile datagrams counted",
                |s| {
                    let d = &s["control_drops"];
                    [
                        "bad_mac",
                        "unknown_version",
                        "truncated",
                        "bad_magic",
                        "replay",
                        "not_registered",
                    ]
                    .iter()
                    .all(|r| d[*r].as_u64().unwrap_or(0) >= 1)
                },
            )
            .unwrap();
        eprintln!("control drops: {}", s["control_drops"]);
        for (_, server, c) in held.iter_mut().filter(|h| h.1 != 2) {
            labkit::ping(c.as_mut().unwrap(), *server, "after-garbage").unwrap();
        }
    }

    // Drain: no new flows to s3, existing ones keep flowing, the server is told.
    // Answered once the control loop applied it (`200`; `202` only when
    // the loop does not take commands).
    let answer = lab.post(9102, "/servers/3/drain?deadline_ms=5000").unwrap();
    assert!(answer.contains(" 200 "), "{answer}");
    lab.wait_status(9102, Duration::from_secs(3), "s3 draining", |s| {
        s["servers"]
            .as_array()
            .map(|a| a.iter().any(|x| x["id"] == 3 && x["state"] == "draining"))
            .unwrap_or(false)
    })
    .unwrap();
    let fresh = lab.connect_many(100, false).unwrap();
    assert!(
        fresh.iter().all(|c| c.1 == 1),
        "new connections must all go to s1 (s2 dead, s3 draining)"
    );
    for (_, server, c) in held.iter_mut().filter(|h| h.1 == 3) {
        labkit::ping(c.as_mut().unwrap(), *server, "draining").unwrap();
    }
    let t = Instant::now();
    while agents[2]
        .drains_received
        .load(std::sync::atomic::Ordering::Relaxed)
        == 0
        && t.elapsed() < Duration::from_secs(3)
    {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        agents[2]
            .drains_received
            .load(std::sync::atomic::Ordering::Relaxed)
            >= 1,
        "s3 never received DRAIN"
    );

    // Clean shutdown: SIGTERM detaches every program.
    lab.kill(0, libc::SIGTERM);
    let st = lab
        .wait(0, Duration::from_secs(5))
        .expect("switchd exits on SIGTERM");
    assert!(st.success(), "exit status {st:?}\n{}", lab.log("a.log"));
    let links = std::process::Command::new("ip")
        .args(["-n", &lab.ns("sw"), "-o", "link", "show"])
        .output()
        .unwrap();
    let links = String::from_utf8_lossy(&links.stdout);
    assert!(
        !links.contains("xdp"),
        "XDP program left attached:\n{links}"
    );
    drop(agents);
}

/// A server's control messages captured before a switch restart (or a
/// takeover: the same restore from the store) cannot be replayed to the new
/// process to keep the server live after it stopped: its seq floor is the
/// last seq the old process stored (every 2 s), not only the server's
/// REGISTER. (While the server runs, its own next heartbeat raises the
/// floor anyway; the attack is on a server that went silent.)
#[test]
fn replayed_heartbeats_are_refused_after_a_restart() {
    if skip() {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let mut lab = Lab::up("swr", 1).expect("lab up");
    let cfg = lab.switchd_config("a", 1, &[1], 9102, "").unwrap();
    let a = lab.start_switchd(&switchd_bin(), &cfg, "a.log").unwrap();
    lab.wait_status(9102, Duration::from_secs(10), "switchd active", |s| {
        s["role"] == "active"
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", lab.log("a.log")));
    // Seqs as a hostagent's: from the clock at its start, one per message.
    let first = 1_763_800_000_000_000u64;
    let agent = lab
        .register_server_as(1, 1, 0x5eed, first)
        .unwrap_or_else(|e| panic!("{e}\n{}", lab.log("a.log")));
    // Heartbeats every 100 ms; floors are stored every 2 s: after 45
    // (4.5 s) the stored floor is above the first 20, which the attacker
    // captured (the last 2 s before the restart can still be replayed once
    // each: docs/SWITCHD.md).
    let t = Instant::now();
    while agent.heartbeats.load(std::sync::atomic::Ordering::Relaxed) < 45
        && t.elapsed() < Duration::from_secs(10)
    {
        std::thread::sleep(Duration::from_millis(50));
    }
    // The server goes silent; the switch restarts on its store.
    agent.stop();
    std::thread::sleep(Duration::from_millis(200));
    lab.kill(a, libc::SIGKILL);
    lab.wait(a, Duration::from_secs(5))
        .expect("killed switchd exits");
    lab.start_switchd(&switchd_bin(), &cfg, "b.log").unwrap();
    lab.wait_status(
        9102,
        Duration::from_secs(10),
        "restarted switchd active",
        |s| s["role"] == "active",
    )
    .unwrap_or_else(|e| panic!("{e}\n{}", lab.log("b.log")));

    let key = capybara_proto::MigrationKey::from_hex(labkit::KEY_HEX).unwrap();
    // Bounded: 20 captured heartbeats, 100 ms apart, as the attacker
    // would send them to keep the silent server live.
    for i in 0..20 {
        lab.send_raw_control(1, vec![labkit::idle_heartbeat(1, first + 1 + i, &key)])
            .unwrap();
        std::thread::sleep(Duration::from_millis(100));
    }
    let (s, _) = lab
        .wait_status(
            9102,
            Duration::from_secs(3),
            "the silent server dead",
            |s| {
                s["servers"]
                    .as_array()
                    .is_some_and(|a| a.iter().any(|x| x["id"] == 1 && x["state"] == "dead"))
            },
        )
        .unwrap_or_else(|e| panic!("{e}\n{}", lab.log("b.log")));
    eprintln!("control drops after the restart: {}", s["control_drops"]);
    assert_eq!(
        s["control_drops"]["replay"].as_u64(),
        Some(20),
        "captured heartbeats accepted after the restart: {}",
        s["control_drops"]
    );
}

fn check_failover(r: &labkit::FailoverResult, mode: &str) {
    eprintln!(
        "{mode}: RESULT takeover_ms={:.0} connections_lost={} max_stall_ms={:.0} attach_ms={:.1} flows_restored={}",
        r.takeover_ms, r.connections_lost, r.max_stall_ms, r.attach_ms, r.flows_restored
    );
    assert_eq!(r.connections_lost, 0, "connections lost in takeover");
    assert!(
        r.flows_restored >= 61,
        "standby restored {} flows",
        r.flows_restored
    );
    assert!(r.takeover_ms < 5000.0, "takeover took {} ms", r.takeover_ms);
    assert!(
        r.garp_seen,
        "the client never saw the new active's gratuitous ARP for the VIP"
    );
}

/// Same-box standby (SQLite store): takes over when the active's programs vanish.
#[test]
fn standby_takes_over_after_sigkill() {
    if skip() {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let r =
        labkit::failover_run(&switchd_bin(), 60, true, |_| Ok((None, ()))).expect("failover run");
    check_failover(&r, "fast takeover, sqlite");
}

/// Etcd store inside the switch namespace; the standby waits for the
/// dead active's lease to expire, as a standby on another box would.
#[test]
fn standby_takes_over_by_lease_with_etcd() {
    if skip() {
        return;
    }
    if !std::path::Path::new("/usr/bin/etcd").exists() && std::env::var_os("ETCD_BIN").is_none() {
        eprintln!("skipped: no etcd binary");
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let r = labkit::failover_run(&switchd_bin(), 60, false, |lab| {
        let etcd = NsEtcd::start(&lab.ns("sw"))?;
        Ok((Some(format!("etcd:{}", etcd.endpoint)), etcd))
    })
    .expect("failover run");
    check_failover(&r, "lease takeover, etcd");
    assert!(
        r.takeover_ms > 500.0,
        "a lease-only takeover cannot beat the lease ({} ms)",
        r.takeover_ms
    );
}

/// A one-member etcd started from a thread inside a lab namespace. The
/// thread stays alive for the cluster's lifetime: the harness sets
/// PR_SET_PDEATHSIG, which fires when the *thread* that forked exits.
struct NsEtcd {
    endpoint: String,
    stop: Option<std::sync::mpsc::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl NsEtcd {
    fn start(ns: &str) -> anyhow::Result<NsEtcd> {
        use std::os::fd::AsRawFd;
        let path = format!("/run/netns/{ns}");
        let (tx, rx) = std::sync::mpsc::channel::<anyhow::Result<String>>();
        let (stop_tx, stop_rx) = std::sync::mpsc::channel::<()>();
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
                Ok(c) => {
                    let _ = tx.send(Ok(c.endpoints().join(",")));
                    let _ = stop_rx.recv();
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
            stop: Some(stop_tx),
            thread: Some(thread),
        })
    }
}

impl Drop for NsEtcd {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
