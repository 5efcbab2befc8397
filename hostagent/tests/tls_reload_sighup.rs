//! Certificate rotation through the real signal on the real binary: a
//! `hostagent` on one end of a veth pair in a network namespace of its own
//! (AF_PACKET), a TLS sidecar in front of a loopback echo application, and
//! real kernel TCP clients with rustls on the other end. SIGHUP after the
//! files changed: new handshakes get the new certificate, the connection
//! held across it echoes byte-exact, a bad key is logged naming the file
//! and keeps the certificate in service, the metrics count both, and the
//! process never stops. Before SIGHUP was handled its default action ended
//! the hostagent and every connection with it.
//!
//! Needs root (network namespace, AF_PACKET); skipped otherwise. Run it
//! under `flock /work/notes/lab.lock` on a shared machine like the lab tests.

use capybara_tls_testcerts::{localhost_client, test_cert_named, TestCert};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn run(args: &[&str]) {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .unwrap_or_else(|e| panic!("{args:?}: {e}"));
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The namespace and the hostagent: removed and killed on drop, also when
/// an assertion fails.
struct Guard {
    ns: String,
    dir: std::path::PathBuf,
    child: Option<Child>,
}

impl Drop for Guard {
    fn drop(&mut self) {
        if let Some(c) = &mut self.child {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = Command::new("ip").args(["netns", "del", &self.ns]).status();
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

const STACK: &str = "198.18.2.11";

/// Waits until `log` holds `n` lines containing `what`, or panics after
/// 20 s (or when the hostagent has exited).
fn wait_log(log: &std::path::Path, child: &mut Child, what: &str, n: usize) -> String {
    let end = Instant::now() + Duration::from_secs(20);
    loop {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        let hits: Vec<&str> = text.lines().filter(|l| l.contains(what)).collect();
        if hits.len() >= n {
            return hits[n - 1].to_string();
        }
        if let Ok(Some(st)) = child.try_wait() {
            panic!("hostagent exited ({st}) before logging {what:?}:\n{text}");
        }
        assert!(Instant::now() < end, "no {what:?} within 20 s:\n{text}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn tls_connect(trusted: &[&TestCert]) -> rustls::StreamOwned<rustls::ClientConnection, TcpStream> {
    let addr: SocketAddr = format!("{STACK}:443").parse().unwrap();
    let end = Instant::now() + Duration::from_secs(20);
    let tcp = loop {
        // The stack answers once its listeners are up and ARP is done.
        match TcpStream::connect_timeout(&addr, Duration::from_secs(2)) {
            Ok(s) => break s,
            Err(e) => {
                assert!(Instant::now() < end, "connect {addr}: {e}");
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    };
    tcp.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    tcp.set_write_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut s = rustls::StreamOwned::new(localhost_client(trusted), tcp);
    while s.conn.is_handshaking() {
        s.conn
            .complete_io(&mut s.sock)
            .expect("TLS handshake with the sidecar");
    }
    s
}

fn peer_cert(s: &rustls::StreamOwned<rustls::ClientConnection, TcpStream>) -> Vec<u8> {
    s.conn.peer_certificates().expect("a certificate")[0].to_vec()
}

fn echo(s: &mut rustls::StreamOwned<rustls::ClientConnection, TcpStream>, data: &[u8]) {
    s.write_all(data).unwrap();
    s.flush().unwrap();
    let mut got = vec![0u8; data.len()];
    s.read_exact(&mut got).expect("the echo");
    assert!(got == data, "echo byte-exact ({} bytes)", data.len());
}

fn metrics(port: u16) -> String {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nhost: x\r\n\r\n")
        .unwrap();
    let mut text = String::new();
    let _ = s.read_to_string(&mut text);
    text
}

/// Replaces a file in one step, as an operator's `mv` does.
fn replace(path: &std::path::Path, text: &str) {
    let tmp = path.with_extension("new");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

#[test]
fn sighup_rotates_the_certificate_of_a_running_hostagent() {
    // SAFETY: plain syscall.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: needs root (network namespace, AF_PACKET)");
        return;
    }
    let ns = format!("cbtls{}", std::process::id());
    let dir = std::env::temp_dir().join(&ns);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let mut guard = Guard {
        ns: ns.clone(),
        dir: dir.clone(),
        child: None,
    };
    run(&["ip", "netns", "add", &ns]);
    run(&["ip", "-n", &ns, "link", "set", "lo", "up"]);
    run(&[
        "ip", "-n", &ns, "link", "add", "h0", "type", "veth", "peer", "name", "k0",
    ]);
    for dev in ["h0", "k0"] {
        // The stack reads raw frames: real checksums, MTU-sized frames.
        let _ = Command::new("ip")
            .args(["netns", "exec", &ns, "ethtool", "-K", dev])
            .args([
                "rx", "off", "tx", "off", "tso", "off", "gso", "off", "gro", "off",
            ])
            .output();
        run(&["ip", "-n", &ns, "link", "set", dev, "up"]);
    }
    run(&["ip", "-n", &ns, "addr", "add", "198.18.2.1/24", "dev", "k0"]);

    // Everything below runs inside the namespace: this thread's sockets,
    // the threads it starts and the hostagent it spawns.
    let path = format!("/run/netns/{ns}");
    let nsfile = std::fs::File::open(&path).unwrap();
    std::thread::scope(|sc| {
        let t = sc.spawn(|| {
            use std::os::fd::AsRawFd;
            // SAFETY: plain syscall on a valid descriptor; this thread only.
            let rc = unsafe { libc::setns(nsfile.as_raw_fd(), libc::CLONE_NEWNET) };
            assert_eq!(rc, 0, "setns: {}", std::io::Error::last_os_error());
            scenario(&dir, &mut guard);
        });
        if let Err(p) = t.join() {
            std::panic::resume_unwind(p);
        }
    });
}

fn scenario(dir: &std::path::Path, guard: &mut Guard) {
    // The application: echoes every connection.
    let app = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let backend = app.local_addr().unwrap();
    std::thread::spawn(move || {
        for c in app.incoming().take(64) {
            let Ok(mut c) = c else { continue };
            std::thread::spawn(move || {
                let mut buf = [0u8; 16 * 1024];
                while let Ok(n) = c.read(&mut buf) {
                    if n == 0 || c.write_all(&buf[..n]).is_err() {
                        return;
                    }
                }
            });
        }
    });
    let metrics_port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };

    let (a, b) = (
        test_cert_named("cert-a.example"),
        test_cert_named("cert-b.example"),
    );
    let (cert_path, key_path) = (dir.join("cert.pem"), dir.join("key.pem"));
    replace(&cert_path, &a.cert_pem);
    replace(&key_path, &a.key_pem);
    let cfg = dir.join("hostagent.toml");
    std::fs::write(
        &cfg,
        format!(
            "name = \"s1\"\n[interface]\nname = \"h0\"\n[stack]\naddress = \"{STACK}\"\n\
             gateway = \"198.18.2.1\"\n[[service]]\nlisten = \"{STACK}:443\"\napp = \"sidecar\"\n\
             backend = \"{backend}\"\nprotocol = \"raw\"\ntls_cert = {:?}\ntls_key = {:?}\n",
            cert_path.display().to_string(),
            key_path.display().to_string()
        ),
    )
    .unwrap();
    let log = dir.join("hostagent.log");
    let child = Command::new(env!("CARGO_BIN_EXE_hostagent"))
        .args(["--config", cfg.to_str().unwrap()])
        .args(["--metrics", &format!("127.0.0.1:{metrics_port}")])
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .expect("start hostagent");
    let pid = child.id() as libc::pid_t;
    guard.child = Some(child);
    let child = guard.child.as_mut().unwrap();
    wait_log(&log, child, "hostagent s1: ", 1);

    let mut held = tls_connect(&[&a, &b]);
    assert!(peer_cert(&held) == *a.cert_der, "certificate A at start");
    echo(&mut held, b"before the rotation");

    replace(&cert_path, &b.cert_pem);
    replace(&key_path, &b.key_pem);
    // SAFETY: plain syscall; `pid` is our child, not reaped yet.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGHUP) }, 0);
    let line = wait_log(&log, child, "TLS certificate reloaded", 1);
    assert!(line.contains("CN=cert-b.example"), "{line}");
    let mut fresh = tls_connect(&[&a, &b]);
    assert!(
        peer_cert(&fresh) == *b.cert_der,
        "a new handshake after SIGHUP gets B"
    );
    echo(&mut fresh, b"new session");
    let big: Vec<u8> = (0..200_000u32).map(|i| (i * 13 + i / 509) as u8).collect();
    echo(&mut held, &big);

    // A key that is not one: logged with the file, B stays.
    replace(&key_path, "not a key\n");
    // SAFETY: as above.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGHUP) }, 0);
    let line = wait_log(&log, child, "TLS reload failed", 1);
    assert!(
        line.contains(&format!("service {STACK}:443"))
            && line.contains(&format!("tls_key = {:?}", key_path.display().to_string()))
            && line.contains("no private key block"),
        "{line}"
    );
    let mut after = tls_connect(&[&a, &b]);
    assert!(
        peer_cert(&after) == *b.cert_der,
        "B still served after a failed reload"
    );
    echo(&mut after, b"still B");
    echo(&mut held, b"held through both reloads");
    echo(&mut fresh, b"and the second one");

    let m = metrics(metrics_port);
    for want in [
        "capybara_tls_reloads_total{server=\"s1\",outcome=\"ok\"} 1",
        "capybara_tls_reloads_total{server=\"s1\",outcome=\"failed\"} 1",
    ] {
        assert!(m.contains(want), "{want} in:\n{m}");
    }

    // Still running; SIGTERM stops it cleanly.
    assert!(child.try_wait().unwrap().is_none(), "hostagent still runs");
    // SAFETY: as above.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
    let end = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        assert!(Instant::now() < end, "hostagent did not stop on SIGTERM");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "{status}");
}
