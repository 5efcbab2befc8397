//! `capybara-testserver`: an HTTP/1.1 server that emulates a **single-core
//! server with a known service time**, so experiments control load and
//! capacity exactly (capacity = 1 / mean service time).
//!
//! Requests from all connections are served one at a time, in arrival
//! (FIFO) order, by one virtual core ([`Core`]): a per-request queue whose
//! front request is in service. One driver task per core sleeps on a
//! precise timer ([`hrtime::Timer`]) until the request in service ends,
//! finishes it, wakes its connection (which then writes the response) and
//! starts the next — no CPU is burnt, so several emulated servers can share
//! the lab's two cores.
//!
//! A request belongs to its connection until the core finishes it: a
//! connection attaches to the core ([`Core::attach`], a [`CoreConn`]) and
//! when it leaves — closed, or migrated to another server with its
//! unanswered requests — its unfinished requests leave the queue with it
//! ([`CoreConn::withdraw`], also on drop), so the old core is released at
//! once and the requests are served, once, wherever the connection went.
//! (Booking a request's service time at arrival instead would leave a
//! migrated connection's queued requests charged to the old core while the
//! new one serves them again.) A request withdrawn while in service is
//! abandoned: the part already served counts as busy time.
//!
//! [`serve_connection`] is generic over any `AsyncRead + AsyncWrite + Unpin`
//! stream, so the same logic runs over tokio's kernel TCP (the binary) or
//! over Capybara's user-space stack. Responses carry `x-server: <id>`;
//! `GET /stats` answers JSON with queue length, served count and busy
//! fraction (it bypasses the virtual core but keeps per-connection order).

pub mod hrtime;
pub mod rng;

use std::collections::{HashMap, VecDeque};
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};

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

/// One request on the virtual core: it belongs to the connection (`owner`)
/// until the core finishes it, so a connection that leaves takes its
/// unfinished requests with it.
struct Entry {
    owner: u64,
    svc_ns: u64,
    arrival_ns: u64,
}

/// A connection attached to the core.
#[derive(Default)]
struct Owner {
    /// Requests of this connection the core finished serving.
    finished: u64,
    /// The task to wake once `finished >= wake_at`.
    waker: Option<Waker>,
    wake_at: u64,
}

struct CoreState {
    /// FIFO of requests; the front one is in service since `head_start_ns`.
    queue: VecDeque<Entry>,
    head_start_ns: u64,
    /// Sum of the service times in `queue`.
    queued_svc_ns: u64,
    /// Service time spent on finished requests (and on the served part of
    /// withdrawn in-service ones).
    busy_ns: u64,
    admitted: u64,
    finished: u64,
    withdrawn: u64,
    rng: Rng,
    owners: HashMap<u64, Owner>,
    next_owner: u64,
    /// Bumped when the front of the queue changes other than by finishing
    /// (a request reaching an idle core, the in-service one withdrawn).
    generation: u64,
    driver: Option<Waker>,
    driver_started: bool,
}

impl CoreState {
    /// Finish, in order, every request whose service ended by `now`.
    fn advance(&mut self, now: u64) {
        while let Some(h) = self.queue.front() {
            let done = self.head_start_ns + h.svc_ns;
            if done > now {
                break;
            }
            let (owner, svc) = (h.owner, h.svc_ns);
            self.queue.pop_front();
            self.queued_svc_ns -= svc;
            self.busy_ns += svc;
            self.finished += 1;
            if let Some(o) = self.owners.get_mut(&owner) {
                o.finished += 1;
                if o.finished >= o.wake_at {
                    if let Some(w) = o.waker.take() {
                        w.wake();
                    }
                }
            }
            if let Some(n) = self.queue.front() {
                self.head_start_ns = done.max(n.arrival_ns);
            }
        }
    }

    fn head_due(&self) -> Option<u64> {
        self.queue.front().map(|h| self.head_start_ns + h.svc_ns)
    }

    fn front_changed(&mut self) {
        self.generation += 1;
        if let Some(w) = self.driver.take() {
            w.wake();
        }
    }
}

/// The shared virtual core: one request at a time, FIFO over all the
/// connections' requests, driven by one timer (see the module docs).
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
    /// Requests on the virtual core (waiting or in service).
    pub queue_len: u64,
    /// Responses written.
    pub served: u64,
    /// Requests admitted to the virtual core.
    pub admitted: u64,
    /// Requests that left the core unfinished with their connection
    /// (migrated away or closed).
    #[serde(default)]
    pub withdrawn: u64,
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
                queue: VecDeque::with_capacity(1024),
                head_start_ns: now,
                queued_svc_ns: 0,
                busy_ns: 0,
                admitted: 0,
                finished: 0,
                withdrawn: 0,
                rng: Rng::new(cfg.seed),
                owners: HashMap::new(),
                next_owner: 0,
                generation: 0,
                driver: None,
                driver_started: false,
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

    fn lock(&self) -> std::sync::MutexGuard<'_, CoreState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Attach a connection: its requests queue on this core through the
    /// returned handle, and leave the core unfinished when the handle is
    /// dropped or [`CoreConn::withdraw`] is called. Inside a tokio runtime
    /// the first attach starts the core's driver task (one timer per core).
    pub fn attach(self: &Arc<Self>) -> CoreConn {
        let (owner, start) = {
            let mut st = self.lock();
            let owner = st.next_owner;
            st.next_owner += 1;
            st.owners.insert(owner, Owner::default());
            let start = !st.driver_started && tokio::runtime::Handle::try_current().is_ok();
            st.driver_started |= start;
            (owner, start)
        };
        if start {
            tokio::spawn(drive(Arc::downgrade(self)));
        }
        CoreConn {
            core: self.clone(),
            owner,
            admitted: 0,
        }
    }

    /// Finish every request whose service ended by `now_ns` (the driver
    /// task does this on the real clock; tests call it with their own).
    pub fn advance_to(&self, now_ns: u64) {
        self.lock().advance(now_ns);
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
        self.stats_at(now_ns())
    }

    /// [`Core::stats`] on an explicit clock.
    pub fn stats_at(&self, now: u64) -> CoreStats {
        let (queue_len, in_service, queued, busy, admitted, withdrawn) = {
            let mut st = self.lock();
            st.advance(now);
            let in_service = if st.queue.is_empty() {
                0
            } else {
                now.saturating_sub(st.head_start_ns)
            };
            (
                st.queue.len() as u64,
                in_service,
                st.queued_svc_ns,
                st.busy_ns,
                st.admitted,
                st.withdrawn,
            )
        };
        let completed = self.completed.load(Ordering::Relaxed);
        let backlog = queued.saturating_sub(in_service);
        let elapsed = now.saturating_sub(self.started_ns).max(1);
        CoreStats {
            id: self.cfg.id.clone(),
            service: self.cfg.service.describe(),
            capacity_rps: self.cfg.service.capacity_rps(),
            queue_len,
            served: completed,
            admitted,
            withdrawn,
            backlog_us: backlog as f64 / 1e3,
            busy_fraction: ((busy + in_service) as f64 / elapsed as f64).min(1.0),
            uptime_s: elapsed as f64 / 1e9,
            connections: self.connections.load(Ordering::Relaxed),
            bad_requests: self.bad_requests.load(Ordering::Relaxed),
        }
    }
}

/// The driver of one core: sleeps on a precise timer until the in-service
/// request ends, finishes it (waking its connection) and starts the next;
/// idles without a timer while the core is empty.
async fn drive(core: std::sync::Weak<Core>) {
    let precise = match core.upgrade() {
        Some(c) => c.cfg.precise_timers,
        None => return,
    };
    let mut timer = Timer::new(precise);
    loop {
        let next = std::future::poll_fn(|cx| {
            let Some(core) = core.upgrade() else {
                return Poll::Ready(None);
            };
            let mut st = core.lock();
            st.advance(now_ns());
            match st.head_due() {
                Some(due) => Poll::Ready(Some((due, st.generation))),
                None => {
                    st.driver = Some(cx.waker().clone());
                    Poll::Pending
                }
            }
        })
        .await;
        let Some((due, generation)) = next else {
            return;
        };
        let changed = std::future::poll_fn(|cx| {
            let Some(core) = core.upgrade() else {
                return Poll::Ready(());
            };
            let mut st = core.lock();
            if st.generation != generation {
                Poll::Ready(())
            } else {
                st.driver = Some(cx.waker().clone());
                Poll::Pending
            }
        });
        tokio::select! {
            _ = timer.sleep_until(due) => {}
            _ = changed => {}
        }
    }
}

/// One connection's place on a [`Core`]: its requests, in order. Request
/// `k` (counting from 1) is served once [`CoreConn::finished`] reaches `k`.
/// Dropping the handle withdraws the connection's unfinished requests.
pub struct CoreConn {
    core: Arc<Core>,
    owner: u64,
    admitted: u64,
}

impl CoreConn {
    /// Queue one request arriving now; returns the value
    /// [`CoreConn::finished`] reaches when it is served.
    pub fn admit(&mut self) -> u64 {
        self.admit_at(now_ns())
    }

    /// [`CoreConn::admit`] on an explicit clock.
    pub fn admit_at(&mut self, now: u64) -> u64 {
        let core = &self.core;
        let mut st = core.lock();
        st.advance(now);
        let svc = match core.cfg.service {
            ServiceTime::Fixed(n) => n,
            ServiceTime::Exponential(mean) => st.rng.exp(mean as f64).round() as u64,
        };
        let idle = st.queue.is_empty();
        st.queue.push_back(Entry {
            owner: self.owner,
            svc_ns: svc,
            arrival_ns: now,
        });
        st.queued_svc_ns += svc;
        st.admitted += 1;
        if idle {
            st.head_start_ns = now;
            st.front_changed();
        }
        self.admitted += 1;
        self.admitted
    }

    /// Requests of this connection admitted since it attached (or since
    /// its last withdrawal).
    pub fn admitted(&self) -> u64 {
        self.admitted
    }

    /// Requests of this connection the core finished serving.
    pub fn finished(&self) -> u64 {
        let st = self.core.lock();
        st.owners.get(&self.owner).map_or(0, |o| o.finished)
    }

    /// Ready once [`CoreConn::finished`] reaches `target`; otherwise the
    /// task is woken when it does. Cancel-safe.
    pub fn poll_finished(&self, cx: &mut Context<'_>, target: u64) -> Poll<()> {
        let mut st = self.core.lock();
        let Some(o) = st.owners.get_mut(&self.owner) else {
            return Poll::Ready(());
        };
        if o.finished >= target {
            return Poll::Ready(());
        }
        o.wake_at = target;
        match &o.waker {
            Some(w) if w.will_wake(cx.waker()) => {}
            _ => o.waker = Some(cx.waker().clone()),
        }
        Poll::Pending
    }

    /// Wait until [`CoreConn::finished`] reaches `target`.
    pub async fn wait_finished(&self, target: u64) {
        std::future::poll_fn(|cx| self.poll_finished(cx, target)).await
    }

    /// Take every unfinished request of this connection off the core, the
    /// one in service included (its served part counts as busy time): the
    /// connection left, so the requests will be served wherever it went.
    /// Returns how many left; the counts restart from zero.
    pub fn withdraw(&mut self) -> u64 {
        self.withdraw_at(now_ns())
    }

    /// [`CoreConn::withdraw`] on an explicit clock.
    pub fn withdraw_at(&mut self, now: u64) -> u64 {
        let owner = self.owner;
        let mut st = self.core.lock();
        st.advance(now);
        let head_was_ours = st.queue.front().is_some_and(|h| h.owner == owner);
        if head_was_ours {
            let served = now.saturating_sub(st.head_start_ns);
            st.busy_ns += served;
        }
        let before = st.queue.len();
        let mut removed_svc = 0u64;
        st.queue.retain(|e| {
            if e.owner == owner {
                removed_svc += e.svc_ns;
                false
            } else {
                true
            }
        });
        let removed = (before - st.queue.len()) as u64;
        st.queued_svc_ns -= removed_svc;
        st.withdrawn += removed;
        if head_was_ours {
            if let Some(n) = st.queue.front() {
                st.head_start_ns = now.max(n.arrival_ns);
            }
            st.front_changed();
        }
        if let Some(o) = st.owners.get_mut(&owner) {
            *o = Owner::default();
        }
        self.admitted = 0;
        removed
    }
}

impl Drop for CoreConn {
    fn drop(&mut self) {
        self.withdraw();
        self.core.lock().owners.remove(&self.owner);
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
    let mut slot = core.attach();
    let mut buf = vec![0u8; 16 * 1024];
    let (mut start, mut end) = (0usize, 0usize);
    let mut skip_body = 0usize;
    // Each pending response waits for the connection's finished count to
    // reach its value (a `/stats` answer waits for the requests before it).
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
                    if h.is_stats {
                        pending.push_back((slot.admitted(), Pending::Stats));
                    } else {
                        pending.push_back((slot.admit(), Pending::Normal));
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
                    drain_all(&mut pending, &slot, &core, &mut out).await;
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
        let finished = slot.finished();
        while pending.front().is_some_and(|p| p.0 <= finished) {
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
            _ = slot.wait_finished(next_due.unwrap_or(0)), if next_due.is_some() => {}
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
    slot: &CoreConn,
    core: &Core,
    out: &mut Vec<u8>,
) {
    while let Some((need, kind)) = pending.pop_front() {
        slot.wait_finished(need).await;
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

    fn fixed(ns: u64) -> Arc<Core> {
        Core::new(ServerConfig {
            service: ServiceTime::Fixed(ns),
            ..Default::default()
        })
    }

    #[test]
    fn core_is_fifo_with_fixed_service_time() {
        let core = fixed(1000);
        let (mut a, mut b) = (core.attach(), core.attach());
        let t = now_ns() + 1_000_000;
        assert_eq!(a.admit_at(t), 1);
        assert_eq!(b.admit_at(t), 1); // queued behind a's
        assert_eq!(a.admit_at(t), 2); // behind b's
        core.advance_to(t + 999);
        assert_eq!((a.finished(), b.finished()), (0, 0));
        core.advance_to(t + 1000);
        assert_eq!((a.finished(), b.finished()), (1, 0));
        core.advance_to(t + 2000);
        assert_eq!((a.finished(), b.finished()), (1, 1));
        core.advance_to(t + 3000);
        assert_eq!((a.finished(), b.finished()), (2, 1));
        // An idle core starts a request at its arrival.
        assert_eq!(b.admit_at(t + 10_000), 2);
        core.advance_to(t + 10_999);
        assert_eq!(b.finished(), 1);
        core.advance_to(t + 11_000);
        assert_eq!(b.finished(), 2);
        let st = core.stats_at(t + 11_000);
        assert_eq!((st.admitted, st.queue_len, st.withdrawn), (4, 0, 0));
    }

    #[test]
    fn a_connection_that_leaves_takes_its_queued_requests_and_frees_the_core() {
        let core = fixed(1000);
        let (mut moved, mut stays) = (core.attach(), core.attach());
        let t = now_ns() + 1_000_000;
        for _ in 0..10 {
            moved.admit_at(t);
        }
        stays.admit_at(t + 100);
        let st = core.stats_at(t + 500);
        assert_eq!(st.queue_len, 11);
        // 11 x 1 us queued, 0.5 us of the first served.
        assert_eq!(st.backlog_us, 10.5);
        // The connection migrates away half-way through its first request:
        // all ten leave, and the other connection's request starts at once.
        assert_eq!(moved.withdraw_at(t + 500), 10);
        let st = core.stats_at(t + 500);
        assert_eq!((st.queue_len, st.withdrawn), (1, 10));
        assert_eq!(st.backlog_us, 1.0);
        core.advance_to(t + 1499);
        assert_eq!(stays.finished(), 0);
        core.advance_to(t + 1500);
        assert_eq!(stays.finished(), 1);
        // Dropping a handle withdraws too.
        stays.admit_at(t + 2000);
        stays.admit_at(t + 2000);
        drop(stays);
        let st = core.stats_at(t + 2000);
        assert_eq!((st.queue_len, st.withdrawn), (0, 12));
        assert_eq!(st.backlog_us, 0.0);
    }

    #[test]
    fn withdrawing_requests_behind_others_keeps_the_one_in_service() {
        let core = fixed(1000);
        let (mut a, mut b, mut c) = (core.attach(), core.attach(), core.attach());
        let t = now_ns() + 1_000_000;
        a.admit_at(t);
        b.admit_at(t);
        b.admit_at(t);
        c.admit_at(t);
        assert_eq!(b.withdraw_at(t + 500), 2);
        // a's request keeps its slot; c's moves up behind it.
        core.advance_to(t + 1000);
        assert_eq!(a.finished(), 1);
        core.advance_to(t + 1999);
        assert_eq!(c.finished(), 0);
        core.advance_to(t + 2000);
        assert_eq!(c.finished(), 1);
        assert_eq!(b.finished(), 0);
    }

    #[test]
    fn driver_task_serves_on_real_time() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let core = fixed(200_000);
            let mut a = core.attach();
            let mut b = core.attach();
            let start = now_ns();
            a.admit();
            let nb = b.admit();
            b.wait_finished(nb).await;
            assert!(now_ns() - start >= 400_000);
            assert_eq!(a.finished(), 1);
            // A connection leaving with queued requests frees the core now.
            for _ in 0..50 {
                a.admit();
            }
            let nb = b.admit();
            drop(a);
            let t = now_ns();
            b.wait_finished(nb).await;
            let took = now_ns() - t;
            assert!(took < 5_000_000, "took {took} ns");
        });
    }

    #[test]
    fn exponential_service_has_the_mean() {
        let core = Core::new(ServerConfig {
            service: ServiceTime::Exponential(10_000),
            ..Default::default()
        });
        let mut c = core.attach();
        let n = 20_000u64;
        let t = now_ns() + 1_000_000_000;
        for _ in 0..n {
            c.admit_at(t);
        }
        let st = core.stats_at(t);
        let mean = st.backlog_us * 1e3 / n as f64;
        assert!((mean - 10_000.0).abs() < 500.0, "mean {mean}");
        core.advance_to(u64::MAX / 2);
        assert_eq!(c.finished(), n);
    }
}
