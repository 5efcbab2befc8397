//! serve_connection over a generic stream (in-memory duplex) and over
//! kernel TCP.

use std::time::Duration;

use capybara_testserver::hrtime::now_ns;
use capybara_testserver::{
    run_listener, serve_connection, Core, CoreStats, ServerConfig, ServiceTime,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// Read until `n` complete responses (Content-Length framed) are in `buf`.
async fn read_responses<S: AsyncReadExt + Unpin>(s: &mut S, n: usize) -> Vec<(String, Vec<u8>)> {
    let mut buf = Vec::new();
    let mut out = Vec::new();
    let mut tmp = [0u8; 4096];
    while out.len() < n {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8(buf[..end].to_vec()).unwrap();
            let cl: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length: "))
                .unwrap()
                .parse()
                .unwrap();
            if buf.len() >= end + 4 + cl {
                let body = buf[end + 4..end + 4 + cl].to_vec();
                buf.drain(..end + 4 + cl);
                out.push((head, body));
                continue;
            }
        }
        let k = s.read(&mut tmp).await.unwrap();
        assert!(k > 0, "eof after {} responses", out.len());
        buf.extend_from_slice(&tmp[..k]);
    }
    out
}

#[test]
fn pipelined_requests_on_a_generic_stream_are_served_fifo() {
    rt().block_on(async {
        let core = Core::new(ServerConfig {
            id: "dup".into(),
            service: ServiceTime::Fixed(2_000_000),
            body_bytes: 10,
            ..Default::default()
        });
        let (mut client, server) = tokio::io::duplex(64 * 1024);
        let c = core.clone();
        let task = tokio::spawn(async move { serve_connection(server, c).await.unwrap() });
        let t = now_ns();
        client
            .write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\nGET /a HTTP/1.1\r\n\r\nPOST /b HTTP/1.1\r\nContent-Length: 3\r\n\r\nabcGET /stats HTTP/1.1\r\n\r\n")
            .await
            .unwrap();
        let r = read_responses(&mut client, 4).await;
        let took = now_ns() - t;
        // Three requests of 2 ms each, served one after another.
        assert!(took >= 6_000_000, "took {took} ns");
        for (head, body) in &r[..3] {
            assert!(head.starts_with("HTTP/1.1 200 OK"));
            assert!(head.contains("x-server: dup"));
            assert_eq!(body, b"xxxxxxxxxx");
        }
        let stats: CoreStats = serde_json::from_slice(&r[3].1).unwrap();
        assert_eq!((stats.id.as_str(), stats.admitted, stats.served), ("dup", 3, 3));
        assert_eq!(stats.queue_len, 0);
        assert!((stats.capacity_rps - 500.0).abs() < 1e-9);
        drop(client);
        let summary = task.await.unwrap();
        assert_eq!(summary.requests, 4);
    });
}

#[test]
fn malformed_request_gets_400_and_close() {
    rt().block_on(async {
        let core = Core::new(ServerConfig::default());
        let (mut client, server) = tokio::io::duplex(4096);
        let c = core.clone();
        let task = tokio::spawn(async move { serve_connection(server, c).await.unwrap() });
        client
            .write_all(b"GET / HTTP/1.1\r\n\r\nBLAH\r\n\r\n")
            .await
            .unwrap();
        let mut all = Vec::new();
        client.read_to_end(&mut all).await.unwrap();
        let text = String::from_utf8_lossy(&all);
        assert!(text.starts_with("HTTP/1.1 200 OK"), "{text}");
        assert!(text.contains("HTTP/1.1 400 Bad Request"), "{text}");
        assert!(task.await.unwrap().bad_request);
        assert_eq!(core.stats().bad_requests, 1);
    });
}

#[test]
fn connections_share_one_virtual_core() {
    rt().block_on(async {
        let core = Core::new(ServerConfig {
            id: "tcp".into(),
            service: ServiceTime::Fixed(5_000_000),
            body_bytes: 1,
            ..Default::default()
        });
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(run_listener(l, core.clone()));
        let t = now_ns();
        let mut clients = Vec::new();
        for _ in 0..4 {
            let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
            s.write_all(b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
            clients.push(s);
        }
        let mut done = Vec::new();
        for s in clients.iter_mut() {
            read_responses(s, 1).await;
            done.push(now_ns() - t);
        }
        // Four requests at once on four connections: 5, 10, 15, 20 ms.
        let last = *done.iter().max().unwrap();
        assert!(last >= 20_000_000, "last done after {last} ns");
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET /stats HTTP/1.1\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        let r = read_responses(&mut s, 1).await;
        let st: CoreStats = serde_json::from_slice(&r[0].1).unwrap();
        assert_eq!(st.served, 4);
        assert!(st.busy_fraction > 0.0);
        // Connection: close is honoured.
        let mut rest = Vec::new();
        tokio::time::timeout(Duration::from_secs(2), s.read_to_end(&mut rest))
            .await
            .unwrap()
            .unwrap();
    });
}
