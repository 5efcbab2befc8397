//! Real TLS clients (curl, Python's ssl module, i.e. OpenSSL) against a tiny
//! HTTPS server on 127.0.0.1 built on `TlsServer`. The server moves its TLS
//! session to a fresh `TlsServer` (export -> import, as on another host)
//! after every socket read and between response chunks; reads are a few
//! bytes long so most moves happen mid-record. The clients must get
//! byte-exact responses over one connection with exactly one handshake.

mod common;

use std::io::{Read, Write};
use std::net::TcpListener;
use std::process::Command;
use std::thread;

use capybara_tls::{TlsConfig, TlsServer};
use common::*;

fn body_for(path: &str) -> Vec<u8> {
    let size = path
        .trim_start_matches('/')
        .parse::<usize>()
        .unwrap_or(1000);
    (0..size)
        .map(|i| b"abcdefghijklmnopqrstuvwxyz0123456789\n"[(i * 7 + size) % 37])
        .collect()
}

#[derive(Debug)]
struct Stats {
    migrations: usize,
    /// Moves with part of a client record received (mid-record).
    mid_record: usize,
    requests: usize,
    protocol: Option<capybara_tls::Protocol>,
}

/// Serves HTTP/1.1 keep-alive requests on one connection until the client
/// closes. Every request's response body is `body_for(path)`.
fn serve_one(listener: TcpListener, cfg: TlsConfig) -> Stats {
    let (mut sock, _) = listener.accept().unwrap();
    sock.set_read_timeout(Some(std::time::Duration::from_secs(20)))
        .unwrap();
    let mut tls = TlsServer::new(&cfg).unwrap();
    let mut stats = Stats {
        migrations: 0,
        mid_record: 0,
        requests: 0,
        protocol: None,
    };
    let mut rng = Rng(42);
    let mut req = Vec::new();
    let mut out = Vec::new();
    loop {
        let mut buf = vec![0u8; 1 + rng.below(97)];
        let n = match sock.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if let Err(e) = tls.feed_ciphertext(&buf[..n]) {
            panic!("server TLS error: {e}");
        }
        tls.take_ciphertext_to_send(&mut out);
        sock.write_all(&out).unwrap();
        out.clear();
        if tls.can_export() {
            stats.protocol = tls.protocol();
            stats.mid_record += usize::from(tls.partial_record_len() > 0);
            tls = migrate(tls);
            stats.migrations += 1;
        }
        req.extend(drain_plaintext(&mut tls));
        while let Some(end) = req.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&req[..end]).to_string();
            req.drain(..end + 4);
            let path = head.split(' ').nth(1).unwrap_or("/").to_string();
            let body = body_for(&path);
            let header = format!(
                "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nContent-Type: text/plain\r\n\r\n",
                body.len()
            );
            tls.write_plaintext(header.as_bytes()).unwrap();
            for chunk in body.chunks(1 + rng.below(3_000)) {
                tls.write_plaintext(chunk).unwrap();
                // Sometimes the ciphertext travels in the snapshot.
                if rng.below(2) == 0 {
                    tls.take_ciphertext_to_send(&mut out);
                    sock.write_all(&out).unwrap();
                    out.clear();
                }
                tls = migrate(tls);
                stats.migrations += 1;
            }
            tls.take_ciphertext_to_send(&mut out);
            sock.write_all(&out).unwrap();
            out.clear();
            stats.requests += 1;
        }
        if tls.is_eof() {
            tls.send_close_notify();
            tls.take_ciphertext_to_send(&mut out);
            let _ = sock.write_all(&out);
            break;
        }
    }
    stats
}

fn setup() -> (TestCert, TlsConfig, TcpListener, std::path::PathBuf) {
    let cert = test_cert();
    let cfg = server_config(&cert).with_alpn(vec![b"http/1.1".to_vec()]);
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let dir = std::env::temp_dir().join(format!(
        "capybara-tls-{}-{}",
        std::process::id(),
        listener.local_addr().unwrap().port()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("ca.pem"), &cert.cert_pem).unwrap();
    (cert, cfg, listener, dir)
}

#[test]
fn curl_keep_alive_over_a_migrating_session() {
    curl_over_a_migrating_session(None);
}

#[test]
fn curl_tls12_keep_alive_over_a_migrating_session() {
    curl_over_a_migrating_session(Some("1.2"));
}

fn curl_over_a_migrating_session(tls_max: Option<&str>) {
    let (_cert, cfg, listener, dir) = setup();
    let port = listener.local_addr().unwrap().port();
    let server = {
        let cfg = cfg.clone();
        thread::spawn(move || serve_one(listener, cfg))
    };
    let paths = ["/100", "/70000", "/1", "/250000", "/16384"];
    let mut cmd = Command::new("curl");
    cmd.args(["--silent", "--show-error", "--http1.1", "--max-time", "60"])
        .arg("--cacert")
        .arg(dir.join("ca.pem"))
        .arg("--resolve")
        .arg(format!("localhost:{port}:127.0.0.1"));
    if let Some(v) = tls_max {
        cmd.args(["--tls-max", v]);
    }
    let want = match tls_max {
        Some("1.2") => capybara_tls::Protocol::Tls12,
        _ => capybara_tls::Protocol::Tls13,
    };
    for p in paths {
        cmd.arg(format!("https://localhost:{port}{p}"));
    }
    let out = cmd
        .output()
        .expect("curl must be installed (scripts/setup.sh)");
    assert!(
        out.status.success(),
        "curl failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let expected: Vec<u8> = paths.iter().flat_map(|p| body_for(p)).collect();
    assert_eq!(out.stdout.len(), expected.len());
    assert!(out.stdout == expected, "byte-exact bodies");
    let stats = server.join().unwrap();
    assert_eq!(stats.protocol, Some(want), "negotiated version");
    assert_eq!(
        stats.requests,
        paths.len(),
        "one keep-alive connection served every request"
    );
    eprintln!("{stats:?}");
    assert!(
        stats.migrations >= 100,
        "only {} migrations",
        stats.migrations
    );
    assert!(stats.mid_record >= 3, "mid-record moves: {stats:?}");
    assert_eq!(
        cfg.handshakes_completed(),
        1,
        "no handshake after the first"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn python_ssl_client_over_a_migrating_session() {
    let (_cert, cfg, listener, dir) = setup();
    let port = listener.local_addr().unwrap().port();
    let server = {
        let cfg = cfg.clone();
        thread::spawn(move || serve_one(listener, cfg))
    };
    let script = r#"
import hashlib, http.client, ssl, sys
port, ca = int(sys.argv[1]), sys.argv[2]
ctx = ssl.create_default_context(cafile=ca)
ctx.minimum_version = ssl.TLSVersion.TLSv1_3
conn = http.client.HTTPSConnection("127.0.0.1", port, context=ctx, timeout=60)
for path in ["/5", "/123456", "/40000", "/3"]:
    conn.request("GET", path, headers={"Host": "localhost"})
    r = conn.getresponse()
    body = r.read()
    sys.stdout.write("%s %d %s\n" % (path, len(body), hashlib.sha256(body).hexdigest()))
conn.close()
"#;
    let out = Command::new("python3")
        .arg("-c")
        .arg(script)
        .arg(port.to_string())
        .arg(dir.join("ca.pem"))
        .output()
        .expect("python3 must be installed");
    assert!(
        out.status.success(),
        "python client failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8(out.stdout).unwrap();
    for (line, path) in stdout.lines().zip(["/5", "/123456", "/40000", "/3"]) {
        let body = body_for(path);
        let mut hasher = Sha256Hex::default();
        hasher.update(&body);
        assert_eq!(
            line,
            format!("{path} {} {}", body.len(), hasher.hex()),
            "byte-exact body"
        );
    }
    assert_eq!(stdout.lines().count(), 4);
    let stats = server.join().unwrap();
    assert_eq!(stats.requests, 4);
    eprintln!("{stats:?}");
    assert!(
        stats.migrations >= 100,
        "only {} migrations",
        stats.migrations
    );
    assert!(stats.mid_record >= 3, "mid-record moves: {stats:?}");
    assert_eq!(
        cfg.handshakes_completed(),
        1,
        "no handshake after the first"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// SHA-256 via ring (already a dependency) for comparing with Python.
#[derive(Default)]
struct Sha256Hex(Vec<u8>);

impl Sha256Hex {
    fn update(&mut self, b: &[u8]) {
        self.0.extend_from_slice(b);
    }
    fn hex(&self) -> String {
        let d = ring::digest::digest(&ring::digest::SHA256, &self.0);
        d.as_ref().iter().map(|b| format!("{b:02x}")).collect()
    }
}

/// A TLS 1.1-only client (OpenSSL) is refused during the handshake with an
/// alert, and the session reports a handshake error (docs/TLS.md, Limits).
#[test]
fn tls11_only_client_is_refused_cleanly() {
    let (_cert, cfg, listener, dir) = setup();
    let port = listener.local_addr().unwrap().port();
    let server = {
        let cfg = cfg.clone();
        thread::spawn(move || {
            let (mut sock, _) = listener.accept().unwrap();
            sock.set_read_timeout(Some(std::time::Duration::from_secs(20)))
                .unwrap();
            let mut tls = TlsServer::new(&cfg).unwrap();
            let mut buf = [0u8; 4096];
            loop {
                let n = match sock.read(&mut buf) {
                    Ok(0) | Err(_) => return None,
                    Ok(n) => n,
                };
                let r = tls.feed_ciphertext(&buf[..n]);
                let mut out = Vec::new();
                tls.take_ciphertext_to_send(&mut out);
                let _ = sock.write_all(&out);
                if let Err(e) = r {
                    return Some((e.to_string(), out.len()));
                }
            }
        })
    };
    let out = Command::new("openssl")
        .args([
            "s_client",
            "-tls1_1",
            "-cipher",
            "DEFAULT:@SECLEVEL=0",
            "-connect",
        ])
        .arg(format!("127.0.0.1:{port}"))
        .arg("-CAfile")
        .arg(dir.join("ca.pem"))
        .stdin(std::process::Stdio::null())
        .output()
        .expect("openssl must be installed");
    assert!(
        !out.status.success(),
        "a TLS 1.1-only client must not connect"
    );
    let (err, alert_len) = server.join().unwrap().expect("server saw the ClientHello");
    assert!(err.contains("handshake"), "{err}");
    assert_eq!(alert_len, 7, "one plaintext alert record sent");
    assert_eq!(cfg.handshakes_completed(), 0);
    std::fs::remove_dir_all(&dir).unwrap();
}
