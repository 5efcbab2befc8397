//! `capybara-testserver`: an HTTP/1.1 server that emulates a **single-core
//! server with a known service time**, so experiments control load and
//! capacity exactly (capacity = 1 / mean service time).
//!
//! Requests from all connections are served one at a time, in arrival
//! (FIFO) order, by one virtual core ([`Core`]): a request arriving at `a`
//! starts at `max(a, core free)` and completes one service time later. The
//! connection task sleeps until that completion instant on a precise timer
//! ([`hrtime::Timer`]) and then writes the response — no CPU is burnt, so
//! several emulated servers can share the lab's two cores.
//!
//! [`serve_connection`] is generic over any `AsyncRead + AsyncWrite + Unpin`
//! stream, so the same logic runs over tokio's kernel TCP (the binary) or
//! over Capybara's user-space stack. Responses carry `x-server: <id>`;
//! `GET /stats` answers JSON with queue length, served count and busy
//! fraction (it bypasses the virtual core but keeps per-connection order).

pub mod hrtime;
pub mod rng;

use std::collections::VecDeque;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use hrtime::{now_ns, Timer};
use rng::Rng;

/// Distribution of the per-request service time.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ServiceTime {
    /// Every request takes exactly this many nanoseconds.
    Fixed(u64),
    /// Exponentially distributed with this mean (nanoseconds).
    Exponential(u64),
}

impl ServiceTime {
    pub fn mean_ns(&self) -> u64 {
        match *self {
            ServiceTime::Fixed(n) | ServiceTime::Exponential(n) => n,
        }
    }

    /// Requests per second one virtual core sustains.
    pub fn capacity_rps(&self) -> f64 {
        1e9 / self.mean_ns() as f64
    }

    pub fn describe(&self) -> String {
        match *self {
            ServiceTime::Fixed(n) => format!("fixed:{}us", n as f64 / 1e3),
            ServiceTime::Exponential(n) => format!("exp:{}us", n as f64 / 1e3),
        }
    }
}

/// Configuration of one emulated server.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// Value of the `x-server` response header.
    pub id: String,
    pub service: ServiceTime,
    /// Size of each response body in bytes.
    pub body_bytes: usize,
    pub seed: u64,
    /// Use timerfd-based microsecond timers (default); `false` uses tokio's
    /// 1 ms timer wheel.
    pub precise_timers: bool,
    /// Most requests one connection may have queued before the server stops
    /// reading from it (TCP back-pressure then reaches the client).
    pub max_pipeline: usize,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            id: "s0".into(),
            service: ServiceTime::Fixed(100_000),
            body_bytes: 256,
            seed: 1,
            precise_timers: true,
            max_pipeline: 4096,
        }
    }
}

struct CoreState {
    free_at_ns: u64,
    busy_ns: u64,
    admitted: u64,
    rng: Rng,
}

/// The shared virtual core: FIFO, one request at a time.
pub struct Core {
    cfg: ServerConfig,
    state: Mutex<CoreState>,
    completed: AtomicU64,
    connections: AtomicU64,
    bad_requests: AtomicU64,
    started_ns: u64,
    response: Arc<[u8]>,
}

/// A snapshot of [`Core`] counters (what `GET /stats` returns).
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct CoreStats {
    pub id: String,
    pub service: String,
    pub capacity_rps: f64,
    /// Requests admitted whose response has not been written yet.
    pub queue_len: u64,
    /// Responses written.
    pub served: u64,
    pub admitted: u64,
    /// Work queued on the core beyond now, in microseconds.
    pub backlog_us: f64,
    /// Fraction of wall time since start the virtual core was busy.
    pub busy_fraction: f64,
    pub uptime_s: f64,
    pub connections: u64,
    pub bad_requests: u64,
}

impl Core {
    pub fn new(cfg: ServerConfig) -> Arc<Core> {
        let body = vec![b'x'; cfg.body_bytes];
        let mut response = format!(
            "HTTP/1.1 200 OK\r\ncontent-length: {}\r\nx-server: {}\r\ncontent-type: text/plain\r\n\r\n",
            cfg.body_bytes, cfg.id
        )
        .into_bytes();
        response.extend_from_slice(&body);
        let now = now_ns();
        Arc::new(Core {
            state: Mutex::new(CoreState {
                free_at_ns: now,
                busy_ns: 0,
                admitted: 0,
                rng: Rng::new(cfg.seed),
            }),
            cfg,
            completed: AtomicU64::new(0),
            connections: AtomicU64::new(0),
            bad_requests: AtomicU64::new(0),
            started_ns: now,
            response: response.into(),
        })
    }

    pub fn config(&self) -> &ServerConfig {
        &self.cfg
    }

    /// Admit a request that arrived at `arrival_ns`; returns its completion
    /// instant on the virtual core.
    pub fn admit(&self, arrival_ns: u64) -> u64 {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let svc = match self.cfg.service {
            ServiceTime::Fixed(n) => n,
            ServiceTime::Exponential(mean) => st.rng.exp(mean as f64).round() as u64,
        };
        let start = st.free_at_ns.max(arrival_ns);
        let done = start + svc;
        st.free_at_ns = done;
        st.busy_ns += svc;
        st.admitted += 1;
        done
    }

    /// Appends the response to one request (`GET /stats` or any other) to
    /// `out` and counts it as served: for servers that keep request bytes in
    /// the transport until they answer (Capybara's stack app, which must
    /// never hold bytes a migration could lose).
    pub fn respond_into(&self, stats: bool, out: &mut Vec<u8>) {
        let kind = if stats {
            Pending::Stats
        } else {
            Pending::Normal
        };
        push_response(self, kind, out);
    }

    /// Counts a connection served (`/stats` reports the total).
    pub fn count_connection(&self) {
        self.connections.fetch_add(1, Ordering::Relaxed);
    }

    pub fn stats(&self) -> CoreStats {
        let now = now_ns();
        let (free_at, busy, admitted) = {
            let st = self.state.lock().unwrap_or_else(|e| e.into_inner());
            (st.free_at_ns, st.busy_ns, st.admitted)
        };
        let completed = self.completed.load(Ordering::Relaxed);
        let backlog = free_at.saturating_sub(now);
        let elapsed = now.saturating_sub(self.started_ns).max(1);
        CoreStats {
            id: self.cfg.id.clone(),
            service: self.cfg.service.describe(),
            capacity_rps: self.cfg.service.capacity_rps(),
            queue_len: admitted.saturating_sub(completed),
            served: completed,
            admitted,
            backlog_us: backlog as f64 / 1e3,
            busy_fraction: (busy.saturating_sub(backlog) as f64 / elapsed as f64).min(1.0),
            uptime_s: elapsed as f64 / 1e9,
            connections: self.connections.load(Ordering::Relaxed),
            bad_requests: self.bad_requests.load(Ordering::Relaxed),
        }
    }
}

/// What a request head parse found.
#[derive(Debug, PartialEq, Eq)]
pub struct RequestHead {
    /// Bytes of the request line and headers, including the final CRLFCRLF.
    pub head_len: usize,
    pub is_stats: bool,
    pub body_len: usize,
    pub close: bool,
}

/// Largest request head accepted.
pub const MAX_REQUEST_HEAD: usize = 8192;

/// Parse one HTTP/1.1 request head at the start of `buf`. `Ok(None)`: need
/// more bytes. `Err`: malformed (the connection answers 400 and closes).
pub fn parse_request_head(buf: &[u8]) -> Result<Option<RequestHead>, &'static str> {
    let Some(end) = find_crlfcrlf(buf) else {
        if buf.len() >= MAX_REQUEST_HEAD {
            return Err("request head too large");
        }
        return Ok(None);
    };
    let head = &buf[..end];
    let mut lines = head
        .split(|&b| b == b'\n')
        .map(|l| l.strip_suffix(b"\r").unwrap_or(l));
    let line = lines.next().ok_or("empty request")?;
    let mut parts = line.split(|&b| b == b' ');
    let method = parts
        .next()
        .filter(|m| !m.is_empty())
        .ok_or("missing method")?;
    let path = parts
        .next()
        .filter(|p| !p.is_empty())
        .ok_or("missing path")?;
    let version = parts.next().ok_or("missing version")?;
    if parts.next().is_some() {
        return Err("malformed request line");
    }
    if !method.iter().all(|b| b.is_ascii_uppercase()) {
        return Err("malformed method");
    }
    let http10 = match version {
        b"HTTP/1.1" => false,
        b"HTTP/1.0" => true,
        _ => return Err("unsupported HTTP version"),
    };
    let mut body_len = 0usize;
    let mut close = http10;
    for l in lines {
        if l.is_empty() {
            continue;
        }
        let colon = l
            .iter()
            .position(|&b| b == b':')
            .ok_or("header without colon")?;
        let name = &l[..colon];
        let value = trim(&l[colon + 1..]);
        if name.eq_ignore_ascii_case(b"content-length") {
            body_len = parse_usize(value).ok_or("invalid content-length")?;
        } else if name.eq_ignore_ascii_case(b"transfer-encoding") {
            return Err("transfer-encoding not supported");
        } else if name.eq_ignore_ascii_case(b"connection") {
            if value.eq_ignore_ascii_case(b"close") {
                close = true;
            } else if value.eq_ignore_ascii_case(b"keep-alive") {
                close = false;
            }
        }
    }
    let path_only = path.split(|&b| b == b'?').next().unwrap_or(path);
    Ok(Some(RequestHead {
        head_len: end + 4,
        is_stats: method == b"GET" && path_only == b"/stats",
        body_len,
        close,
    }))
}

fn find_crlfcrlf(buf: &[u8]) -> Option<usize> {
    buf.windows(4).position(|w| w == b"\r\n\r\n")
}

fn trim(mut v: &[u8]) -> &[u8] {
    while let [b' ' | b'\t', rest @ ..] = v {
        v = rest;
    }
    while let [rest @ .., b' ' | b'\t'] = v {
        v = rest;
    }
    v
}

fn parse_usize(v: &[u8]) -> Option<usize> {
    if v.is_empty() || v.len() > 18 || !v.iter().all(u8::is_ascii_digit) {
        return None;
    }
    Some(v.iter().fold(0usize, |a, &d| a * 10 + (d - b'0') as usize))
}

enum Pending {
    Normal,
    Stats,
}

/// Counters of one served connection.
#[derive(Debug, Default, Clone)]
pub struct ConnSummary {
    pub requests: u64,
    pub bad_request: bool,
}

/// Serve one HTTP/1.1 connection (keep-alive, pipelining) on the shared
/// virtual core until the client closes it, sends `Connection: close`, or
/// sends a malformed request (answered with 400, then closed).
pub async fn serve_connection<S>(mut stream: S, core: Arc<Core>) -> io::Result<ConnSummary>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    core.connections.fetch_add(1, Ordering::Relaxed);
    let mut timer = Timer::new(core.cfg.precise_timers);
    let mut buf = vec![0u8; 16 * 1024];
    let (mut start, mut end) = (0usize, 0usize);
    let mut skip_body = 0usize;
    let mut pending: VecDeque<(u64, Pending)> = VecDeque::with_capacity(64);
    let mut out: Vec<u8> = Vec::with_capacity(4096);
    let mut eof = false;
    let mut close_after = false;
    let mut summary = ConnSummary::default();
    let max_pipeline = core.cfg.max_pipeline.max(1);

    loop {
        // Parse every complete request in the buffer.
        while !close_after && pending.len() < max_pipeline {
            if skip_body > 0 {
                let n = skip_body.min(end - start);
                start += n;
                skip_body -= n;
                if skip_body > 0 {
                    break;
                }
            }
            match parse_request_head(&buf[start..end]) {
                Ok(Some(h)) => {
                    start += h.head_len;
                    skip_body = h.body_len;
                    let now = now_ns();
                    if h.is_stats {
                        let at = pending.back().map_or(now, |p| p.0.max(now));
                        pending.push_back((at, Pending::Stats));
                    } else {
                        pending.push_back((core.admit(now), Pending::Normal));
                    }
                    summary.requests += 1;
                    if h.close {
                        close_after = true;
                    }
                }
                Ok(None) => break,
                Err(why) => {
                    core.bad_requests.fetch_add(1, Ordering::Relaxed);
                    summary.bad_request = true;
                    // Answer what was accepted before, then the 400, then close.
                    drain_all(&mut pending, &mut timer, &core, &mut out).await;
                    let msg = format!(
                        "HTTP/1.1 400 Bad Request\r\ncontent-length: {}\r\nx-server: {}\r\nconnection: close\r\n\r\n{}",
                        why.len(),
                        core.cfg.id,
                        why
                    );
                    out.extend_from_slice(msg.as_bytes());
                    stream.write_all(&out).await?;
                    let _ = stream.shutdown().await;
                    return Ok(summary);
                }
            }
        }
        if start == end {
            start = 0;
            end = 0;
        } else if start > buf.len() / 2 {
            buf.copy_within(start..end, 0);
            end -= start;
            start = 0;
        }

        // Write every response that is due.
        let now = now_ns();
        while pending.front().is_some_and(|p| p.0 <= now) {
            let (_, kind) = pending.pop_front().unwrap();
            push_response(&core, kind, &mut out);
        }
        if !out.is_empty() {
            stream.write_all(&out).await?;
            out.clear();
            continue;
        }
        if pending.is_empty() && (eof || close_after) {
            let _ = stream.shutdown().await;
            return Ok(summary);
        }

        let can_read = !eof && !close_after && pending.len() < max_pipeline && end < buf.len();
        let next_due = pending.front().map(|p| p.0);
        tokio::select! {
            r = stream.read(&mut buf[end..]), if can_read => {
                match r {
                    Ok(0) => eof = true,
                    Ok(n) => end += n,
                    Err(e) if pending.is_empty() => return Err(e),
                    Err(_) => eof = true,
                }
            }
            _ = timer.sleep_until(next_due.unwrap_or(0)), if next_due.is_some() => {}
            else => eof = true,
        }
    }
}

fn push_response(core: &Core, kind: Pending, out: &mut Vec<u8>) {
    match kind {
        Pending::Normal => out.extend_from_slice(&core.response),
        Pending::Stats => {
            let body = serde_json::to_string(&core.stats()).unwrap_or_default();
            out.extend_from_slice(
                format!(
                    "HTTP/1.1 200 OK\r\ncontent-length: {}\r\nx-server: {}\r\ncontent-type: application/json\r\n\r\n",
                    body.len(),
                    core.cfg.id
                )
                .as_bytes(),
            );
            out.extend_from_slice(body.as_bytes());
        }
    }
    core.completed.fetch_add(1, Ordering::Relaxed);
}

async fn drain_all(
    pending: &mut VecDeque<(u64, Pending)>,
    timer: &mut Timer,
    core: &Core,
    out: &mut Vec<u8>,
) {
    while let Some((due, kind)) = pending.pop_front() {
        timer.sleep_until(due).await;
        push_response(core, kind, out);
    }
}

/// Accept connections forever on a kernel TCP listener, serving each on its
/// own task (TCP_NODELAY set).
pub async fn run_listener(listener: tokio::net::TcpListener, core: Arc<Core>) -> io::Result<()> {
    loop {
        let (sock, _) = match listener.accept().await {
            Ok(x) => x,
            Err(e) if is_transient_accept_error(&e) => {
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
                continue;
            }
            Err(e) => return Err(e),
        };
        let _ = sock.set_nodelay(true);
        let core = core.clone();
        tokio::spawn(async move {
            let _ = serve_connection(sock, core).await;
        });
    }
}

fn is_transient_accept_error(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(
            libc::EMFILE
                | libc::ENFILE
                | libc::ENOBUFS
                | libc::ENOMEM
                | libc::ECONNABORTED
                | libc::EINTR
        )
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_requests() {
        let r = parse_request_head(b"GET / HTTP/1.1\r\nHost: a\r\n\r\nGET")
            .unwrap()
            .unwrap();
        assert_eq!(
            r,
            RequestHead {
                head_len: 27,
                is_stats: false,
                body_len: 0,
                close: false
            }
        );
        let r = parse_request_head(b"GET /stats?x=1 HTTP/1.1\r\n\r\n")
            .unwrap()
            .unwrap();
        assert!(r.is_stats);
        let r = parse_request_head(
            b"POST /x HTTP/1.1\r\nContent-Length: 5\r\nConnection: close\r\n\r\nhello",
        )
        .unwrap()
        .unwrap();
        assert_eq!((r.body_len, r.close), (5, true));
        assert!(
            parse_request_head(b"GET / HTTP/1.0\r\n\r\n")
                .unwrap()
                .unwrap()
                .close
        );
        assert_eq!(
            parse_request_head(b"GET / HTTP/1.1\r\nHost: a\r\n").unwrap(),
            None
        );
    }

    #[test]
    fn rejects_malformed_requests() {
        for bad in [
            &b"GET /\r\n\r\n"[..],
            b"GET / HTTP/2\r\n\r\n",
            b"get / HTTP/1.1\r\n\r\n",
            b"GET / HTTP/1.1 extra\r\n\r\n",
            b"GET / HTTP/1.1\r\nno colon here\r\n\r\n",
            b"GET / HTTP/1.1\r\nContent-Length: -1\r\n\r\n",
            b"GET / HTTP/1.1\r\nContent-Length: 12a\r\n\r\n",
            b"GET / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n",
        ] {
            assert!(
                parse_request_head(bad).is_err(),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
        assert!(parse_request_head(&vec![b'a'; MAX_REQUEST_HEAD]).is_err());
    }

    #[test]
    fn core_is_fifo_with_fixed_service_time() {
        let core = Core::new(ServerConfig {
            service: ServiceTime::Fixed(1000),
            ..Default::default()
        });
        let t = now_ns() + 1_000_000;
        assert_eq!(core.admit(t), t + 1000);
        assert_eq!(core.admit(t), t + 2000); // queued behind the first
        assert_eq!(core.admit(t + 10_000), t + 11_000); // idle core starts at once
        assert_eq!(core.stats().admitted, 3);
    }

    #[test]
    fn exponential_service_has_the_mean() {
        let core = Core::new(ServerConfig {
            service: ServiceTime::Exponential(10_000),
            ..Default::default()
        });
        let n = 20_000u64;
        let mut t = now_ns() + 1_000_000_000;
        let mut sum = 0u64;
        for _ in 0..n {
            let done = core.admit(t);
            sum += done - t;
            t = done + 1_000_000; // always idle at arrival
        }
        let mean = sum as f64 / n as f64;
        assert!((mean - 10_000.0).abs() < 500.0, "mean {mean}");
    }
}
