//! A SYN that reaches a server whose stack does not listen on its port is
//! refused at once, as by any host: the client's connect() fails with
//! "connection refused" (lab, root; release binaries, or
//! `CAPYBARA_BIN_DIR`).
//!
//! The switch rewrites a connection's destination from the VIP to the
//! server's data address, so a stack that has no listener on the port
//! cannot always tell which VIP the client used: with no listener at all
//! (here: a hostagent that lists no service, so switchd places every
//! service's connections on it), or with listeners bound to 0.0.0.0 or to
//! several VIPs, its reset left from its data address. The client's
//! kernel ignores a reset from an address it did not connect to, and
//! connect() hung until its SYN retries timed out. switchd now sends such
//! a reset on from the flow's VIP (bpf/switch.bpf.c `server_rst_from_vip`;
//! resets only, no cost for other packets). Without it this test fails:
//! the connect times out and curl exits 28 instead of 7.
//!
//! Root only (namespaces, XDP). About 10 s.

use capybara_systests::{switchd_lab, Lab};
use std::path::Path;
use std::time::Duration;

const ECHO: &str = "198.18.100.1:7";

/// Server 1 behind the switch with migration and the control channel on,
/// and no `[[service]]`: it listens on no port.
fn hostagent_without_services(dir: &Path, key: &Path) -> std::path::PathBuf {
    let t = format!(
        "name = \"s1\"\n[interface]\nname = \"eth0\"\n[stack]\naddress = \"198.18.2.11\"\ngateway = \"198.18.1.1\"\n\
         [migration]\nkey_file = \"{}\"\nswitch = \"198.18.1.1\"\n\
         [control]\nswitch = \"198.18.1.1:7692\"\nserver_id = 1\nmanagement = \"198.18.1.11\"\n",
        key.display(),
    );
    let path = dir.join("hostagent-s1.toml");
    std::fs::write(&path, t).expect("write hostagent config");
    path
}

/// One TCP connect from client c1 to `addr`: `ok`, `refused`, `timeout`,
/// or the error ([`Lab::connect_outcome`]).
fn connect_once(lab: &Lab, addr: &str) -> String {
    lab.connect_outcome("c1", addr).0
}

#[test]
fn a_syn_for_a_port_the_server_does_not_listen_on_is_refused() {
    let (mut lab, dir, key, sw) = switchd_lab("unlistened_port_lab", "ul", 1);
    lab.spawn_switchd(&sw, &dir.join("switchd.log"));
    let cfg = hostagent_without_services(&dir, &key);
    lab.spawn_hostagent(1, &cfg, &dir.join("hostagent-s1.log"));
    lab.wait_registered(&dir.join("switchd.log"), 1);
    // s1 lists no service: it is in the echo service's pool (every
    // registered server), the only server there, and has no listener: its
    // stack answers every SYN with a reset. A first connect may still
    // race s1's entry into the tables (the switch drops a SYN while the
    // service has no member): up to 3 tries for a first answer.
    let mut first = String::new();
    for _ in 0..3 {
        first = connect_once(&lab, ECHO);
        if first != "timeout" {
            break;
        }
    }
    assert_eq!(
        first, "refused",
        "connect to {ECHO} (timeout: the client ignored a reset that left from s1's data address)"
    );
    for i in 0..3 {
        assert_eq!(connect_once(&lab, ECHO), "refused", "connect {i} to {ECHO}");
    }
    // curl: exit 7, "Couldn't connect to server" (a timeout is 28).
    let out = lab.run(
        "c1",
        "curl",
        &["-sS", "-m", "5", &format!("http://{ECHO}/")],
        Duration::from_secs(15),
    );
    assert_eq!(
        out.status.code(),
        Some(7),
        "curl: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The resets came from s1's stack, not from the switch (the service
    // has a usable member: the switch places every SYN).
    let drops = capybara_systests::metric_sum(
        &lab.server_metrics(1),
        "capybara_tcp_segment_drops_total",
        "reason=\"no_listener\"",
    )
    .unwrap_or(0.0);
    assert!(drops >= 5.0, "s1's no_listener drops: {drops}");
}
