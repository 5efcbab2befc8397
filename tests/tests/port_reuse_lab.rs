//! A client that resets a connection which had migrated and at once opens
//! a new one from the same port (Linux reuses a port right after a RST; a
//! load tool's connections do it all the time) gets a connection that
//! works and migrates like any other (lab, root; release binaries, or
//! `CAPYBARA_BIN_DIR`).
//!
//! Found in CI (sidecar_lab on 6cb2385): an HTTP client hung on a port wrk
//! had just reset. The client's reset removes the flow at the switch, so
//! the new SYN is placed by Maglev: on the server the old connection was
//! first placed on, which had migrated it out less than 5 s before and
//! forwarded the tuple's segments to the old target as late segments. The
//! new connection was established on the old target while the switch sent
//! its segments to the placement server: its data flowed only as long as
//! that server forwarded (5 s), and the switch refused every migration of
//! it (its PREPARE_ACK named an origin that was not the flow's owner). The
//! placement server now serves a SYN on a tuple that left itself.

use capybara_systests::{
    deployment_key, expect_line, hostagent_migrating_config, output_dir, send_line, stdout_lines,
    switchd_config, Lab,
};
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

/// The client, in c1: one connection to VIP:7 from an ephemeral port
/// (prints the port, then `ok` after an echo), then on each stdin line:
/// `reset` (RST the connection, open a new one from the same port at
/// once, echo), `echo` (echo on the current connection). Each answer is
/// `ok`, `reset`, `closed`, `differs` or `hang` (no echo within 3 s).
const CLIENT: &str = r#"
import socket, struct, sys
addr = sys.argv[1].rsplit(":", 1)
addr = (addr[0], int(addr[1]))
n = 0
def connect(port):
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port))
    s.settimeout(3)
    s.connect(addr)
    return s
def echo(s):
    global n
    n += 1
    msg = ("message %d from the client " % n).encode() * 20
    try:
        s.sendall(msg)
        got = b""
        while len(got) < len(msg):
            c = s.recv(65536)
            if not c:
                return "closed"
            got += c
        return "ok" if got == msg else "differs"
    except socket.timeout:
        return "hang"
    except ConnectionResetError:
        return "reset"
s = connect(0)
port = s.getsockname()[1]
print(port, flush=True)
print(echo(s), flush=True)
for line in sys.stdin:
    cmd = line.strip()
    if cmd == "reset":
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()
        try:
            s = connect(port)
        except OSError as e:
            print("connect-failed", e, flush=True)
            continue
        print(echo(s), flush=True)
    elif cmd == "echo":
        print(echo(s), flush=True)
    else:
        break
"#;

/// How many "migrated to" lines the servers' logs hold for client `port`.
fn migrations_of(dir: &std::path::Path, port: u16) -> usize {
    let peer = format!("peer=198.18.0.11:{port} ");
    (1..=2)
        .map(|j| {
            std::fs::read_to_string(dir.join(format!("hostagent-s{j}.log")))
                .unwrap_or_default()
                .lines()
                .filter(|l| l.contains(&peer) && l.contains(" migrated to "))
                .count()
        })
        .sum()
}

/// Moves the echo connection of client `port` to the other server: asks
/// server 1, then server 2 if nothing moved within 2 s (only the server
/// serving it acts; asking both at once moved it there and back); waits
/// for its migration number `nth` in the logs.
fn migrate(lab: &Lab, dir: &std::path::Path, port: u16, nth: usize) {
    for (server, target) in [(1, 2), (2, 1)] {
        let url = format!(
            "http://127.0.0.1:9102/migrate?server={server}&client=198.18.0.11:{port}\
             &service=198.18.100.1:7&target=198.18.2.{}",
            10 + target
        );
        let out = lab.run(
            "sw",
            "curl",
            &["-s", "-m", "2", "-X", "POST", &url],
            Duration::from_secs(5),
        );
        assert!(
            String::from_utf8_lossy(&out.stdout).contains("accepted"),
            "POST /migrate: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        let end = Instant::now() + Duration::from_secs(2);
        while Instant::now() < end {
            if migrations_of(dir, port) >= nth {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    panic!("the connection of client port {port} did not migrate (migration {nth})");
}

#[test]
fn a_port_reused_right_after_a_reset_of_a_migrated_connection_works() {
    let dir = output_dir("port_reuse_lab");
    let mut lab = Lab::up("pr", 2);
    let key = deployment_key(&dir);
    let sw = switchd_config(&lab, &dir, 2, &key);
    lab.spawn_switchd(&sw, &dir.join("switchd.log"));
    for j in 1..=2 {
        // No churn, no load policy: only the test's requests move anything.
        let cfg = hostagent_migrating_config(&dir, j, &key, None);
        capybara_systests::disable_policies(&cfg);
        lab.spawn_hostagent(j, &cfg, &dir.join(format!("hostagent-s{j}.log")));
    }
    lab.wait_registered(&dir.join("switchd.log"), 2);
    lab.wait_vip_http();

    let mut client = lab
        .command("c1", "python3")
        .args(["-c", CLIENT, "198.18.100.1:7"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::inherit())
        .spawn()
        .expect("start the client");
    let mut stdin = client.stdin.take().unwrap();
    let lines = stdout_lines(client.stdout.take().unwrap());
    let stop = AtomicBool::new(false);
    let answer = |stdin: &mut std::process::ChildStdin, cmd: Option<&str>| {
        if let Some(cmd) = cmd {
            send_line(stdin, cmd).unwrap();
        }
        expect_line(&lines, "", Duration::from_secs(20), &stop).unwrap()
    };
    let port: u16 = answer(&mut stdin, None).parse().expect("the client's port");
    assert_eq!(answer(&mut stdin, None), "ok", "first echo");

    // The old connection moves off its placement server, then the client
    // resets it and opens a new one from the same port at once.
    migrate(&lab, &dir, port, 1);
    assert_eq!(
        answer(&mut stdin, Some("echo")),
        "ok",
        "echo after the move"
    );
    assert_eq!(
        answer(&mut stdin, Some("reset")),
        "ok",
        "first echo of the new connection on port {port}"
    );
    // Past the 5 s during which the placement server treats the tuple's
    // segments as late ones of the old connection.
    std::thread::sleep(Duration::from_secs(6));
    assert_eq!(
        answer(&mut stdin, Some("echo")),
        "ok",
        "the new connection on port {port}, 6 s later"
    );
    // The new connection migrates like any other, and works after.
    migrate(&lab, &dir, port, 2);
    assert_eq!(
        answer(&mut stdin, Some("echo")),
        "ok",
        "the new connection after its migration"
    );
    send_line(&mut stdin, "quit").unwrap();
    let _ = client.wait();
    for j in 1..=2 {
        let _ = std::fs::write(dir.join(format!("metrics-s{j}.txt")), lab.server_metrics(j));
    }
    lab.assert_no_resets(1..=2);
}
