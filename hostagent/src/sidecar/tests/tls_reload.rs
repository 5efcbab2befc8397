//! Certificate rotation (`reload_tls`, what SIGHUP runs) over real stacks
//! on an in-memory link, a real rustls client on the client stack and a
//! real loopback echo application: new handshakes get the new
//! certificate, an established TLS connection goes on byte-exact, and
//! files that fail to load keep the certificate in service.

use super::*;
use capybara_tls_testcerts::{localhost_client, test_cert_named, TestCert};

/// A rustls client on the client stack's connection `id`.
struct TlsClient {
    id: capybara_tcp::ConnId,
    tls: rustls::ClientConnection,
    /// Ciphertext not yet taken by the TCP send queue.
    out: Vec<u8>,
    /// Plaintext received.
    got: Vec<u8>,
}

impl TlsClient {
    fn connect(
        client: &crate::stack::Stack,
        cip: std::net::Ipv4Addr,
        to: SocketAddrV4,
        trusted: &[&TestCert],
    ) -> TlsClient {
        let tls = localhost_client(trusted);
        let id = client_connect(client, cip, to);
        TlsClient {
            id,
            tls,
            out: Vec::new(),
            got: Vec::new(),
        }
    }

    /// Moves bytes both ways until `done` holds (true) or `limit` passes
    /// or the server closes (false).
    async fn pump(
        &mut self,
        client: &crate::stack::Stack,
        limit: Duration,
        done: impl Fn(&TlsClient) -> bool,
    ) -> bool {
        let end = tokio::time::Instant::now() + limit;
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            if done(self) {
                return true;
            }
            if tokio::time::Instant::now() >= end {
                return false;
            }
            while self.tls.wants_write() {
                self.tls.write_tls(&mut self.out).unwrap();
            }
            let mut incoming = Vec::new();
            let mut eof = false;
            client.with(|i| {
                if !self.out.is_empty() {
                    match i.transports.tcp.send(self.id, &self.out) {
                        Ok(n) => drop(self.out.drain(..n)),
                        Err(
                            capybara_tcp::TcpError::WouldBlock
                            | capybara_tcp::TcpError::NotConnected,
                        ) => {}
                        Err(e) => panic!("client send: {e:?}"),
                    }
                }
                loop {
                    match i.transports.tcp.recv(self.id, &mut buf) {
                        Ok(0) => {
                            eof = true;
                            break;
                        }
                        Ok(n) => incoming.extend_from_slice(&buf[..n]),
                        Err(capybara_tcp::TcpError::WouldBlock) => break,
                        Err(e) => panic!("client connection failed: {e:?}"),
                    }
                }
            });
            let mut rest = &incoming[..];
            while !rest.is_empty() {
                self.tls.read_tls(&mut rest).unwrap();
                self.tls
                    .process_new_packets()
                    .expect("the client accepts the server's records");
            }
            loop {
                match self.tls.reader().read(&mut buf) {
                    Ok(n) if n > 0 => self.got.extend_from_slice(&buf[..n]),
                    _ => break,
                }
            }
            if eof {
                return done(self);
            }
            if incoming.is_empty() {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
    }

    /// Completes the handshake; returns the leaf certificate presented.
    async fn handshake(&mut self, client: &crate::stack::Stack) -> Vec<u8> {
        let done = self
            .pump(client, Duration::from_secs(10), |c| !c.tls.is_handshaking())
            .await;
        assert!(done, "handshake within 10 s");
        self.tls.peer_certificates().expect("a certificate")[0].to_vec()
    }

    /// Sends `data` and waits for the echo application's copy (a piece at
    /// a time: rustls buffers a bounded amount of plaintext).
    async fn echo(&mut self, client: &crate::stack::Stack, data: &[u8]) {
        self.got.clear();
        let mut sent = 0;
        for piece in data.chunks(16 * 1024) {
            self.tls.writer().write_all(piece).unwrap();
            sent += piece.len();
            let done = self
                .pump(client, Duration::from_secs(10), |c| c.got.len() >= sent)
                .await;
            assert!(
                done,
                "echo of {sent} bytes within 10 s: got {}",
                self.got.len()
            );
        }
        assert!(self.got == data, "echo byte-exact ({} bytes)", data.len());
    }
}

/// A loopback application that echoes every connection.
async fn echo_app(listener: tokio::net::TcpListener) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    loop {
        let Ok((mut c, _)) = listener.accept().await else {
            return;
        };
        tokio::task::spawn_local(async move {
            let mut buf = vec![0u8; 16 * 1024];
            loop {
                match c.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => {
                        if c.write_all(&buf[..n]).await.is_err() {
                            return;
                        }
                    }
                }
            }
        });
    }
}

#[test]
fn a_reload_serves_the_new_certificate_and_keeps_established_sessions() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let local = tokio::task::LocalSet::new();
    local.block_on(&rt, async {
        let (client, server, cip, sip) = linked_stacks();
        let dir = std::env::temp_dir().join(format!(
            "capybara-tls-reload-{}-{:x}",
            std::process::id(),
            rand::random::<u32>()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let (cert_path, key_path) = (dir.join("cert.pem"), dir.join("key.pem"));
        let install = |c: &TestCert| {
            std::fs::write(&cert_path, &c.cert_pem).unwrap();
            std::fs::write(&key_path, &c.key_pem).unwrap();
        };
        let (a, b) = (test_cert_named("cert-a.example"), test_cert_named("cert-b.example"));
        install(&a);

        let app = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let backend = app.local_addr().unwrap();
        tokio::task::spawn_local(echo_app(app));
        let text = format!(
            "[interface]\nname = \"eth0\"\n[stack]\naddress = \"{sip}\"\ngateway = \"{cip}\"\n\
             [[service]]\nlisten = \"{sip}:443\"\napp = \"sidecar\"\nbackend = \"{backend}\"\n\
             protocol = \"raw\"\ntls_cert = {:?}\ntls_key = {:?}\n",
            cert_path.display().to_string(),
            key_path.display().to_string()
        );
        let cfg = Config::parse("t.toml", &text).unwrap();
        let svc = Rc::new(Service::from_config(&cfg.services[0]).unwrap());
        let listen = svc.listen;
        let listener = TcpListener::bind(&server, listen).unwrap();
        let serving = tokio::task::spawn_local(serve(listener, svc.clone()));

        // An established session with certificate A.
        let mut held = TlsClient::connect(&client, cip, listen, &[&a, &b]);
        assert!(held.handshake(&client).await == *a.cert_der, "certificate A at first");
        held.echo(&client, b"before the rotation").await;

        // Rotation: the files now hold B; the reload swaps them in.
        install(&b);
        let (ok_before, failed_before) = (
            TLS_RELOADS_OK.load(std::sync::atomic::Ordering::Relaxed),
            TLS_RELOADS_FAILED.load(std::sync::atomic::Ordering::Relaxed),
        );
        assert_eq!(reload_tls(std::slice::from_ref(&svc)), (1, 0));
        let info = svc.tls.as_ref().unwrap().current().certificate();
        assert_eq!(info.subject.as_deref(), Some("CN=cert-b.example"));

        let mut fresh = TlsClient::connect(&client, cip, listen, &[&a, &b]);
        assert!(
            fresh.handshake(&client).await == *b.cert_der,
            "a new handshake after the reload gets certificate B"
        );
        fresh.echo(&client, b"new session").await;
        // The session made before goes on, byte-exact, many records.
        let big: Vec<u8> = (0..100_000u32).map(|i| (i * 7 + i / 251) as u8).collect();
        held.echo(&client, &big).await;

        // Files that cannot be used: each reload fails, names the field
        // and file, and B stays in service.
        let c = test_cert_named("cert-c.example");
        let bad: [(&str, &str, &str); 4] = [
            (&b.cert_pem, "not a key\n", "tls_key = "),
            // A's key with B's certificate.
            (&b.cert_pem, &a.key_pem, "tls_cert = "),
            (
                &c.cert_pem,
                "-----BEGIN ENCRYPTED PRIVATE KEY-----\nAAAA\n-----END ENCRYPTED PRIVATE KEY-----\n",
                "encrypted",
            ),
            ("garbage", &c.key_pem, "no CERTIFICATE block"),
        ];
        for (cert_pem, key_pem, says) in bad {
            std::fs::write(&cert_path, cert_pem).unwrap();
            std::fs::write(&key_path, key_pem).unwrap();
            let e = svc.tls.as_ref().unwrap().reload().unwrap_err();
            assert!(e.contains(says), "{says}: {e}");
            assert!(
                e.contains(&*dir.display().to_string()),
                "names the file: {e}"
            );
            assert_eq!(reload_tls(std::slice::from_ref(&svc)), (0, 1));
            let mut after = TlsClient::connect(&client, cip, listen, &[&a, &b]);
            assert!(
                after.handshake(&client).await == *b.cert_der,
                "B still in service after a failed reload ({says})"
            );
        }
        std::fs::remove_file(&key_path).unwrap();
        let e = svc.tls.as_ref().unwrap().reload().unwrap_err();
        assert!(
            e.starts_with(&format!("tls_key = {:?}", key_path.display().to_string()))
                && e.contains("No such file"),
            "{e}"
        );
        held.echo(&client, b"after the failed reloads").await;
        assert!(
            TLS_RELOADS_OK.load(std::sync::atomic::Ordering::Relaxed) > ok_before
                && TLS_RELOADS_FAILED.load(std::sync::atomic::Ordering::Relaxed)
                    >= failed_before + 4
        );
        let mut text = String::new();
        render_metrics("server=\"s\"", &mut text);
        assert!(
            text.contains("capybara_tls_reloads_total{server=\"s\",outcome=\"failed\"}"),
            "{text}"
        );
        serving.abort();
        let _ = std::fs::remove_dir_all(&dir);
    });
}
