//! The load-generation engine: one current-thread tokio runtime, one
//! scheduler task that owns the send schedule, one task per long-lived
//! connection (reads responses, flushes writes the socket did not take at
//! once, reconnects after failures), one task per short-lived flow.
//!
//! Open loop: the scheduler never waits for responses. A request is written
//! at its scheduled instant whatever the number of requests outstanding on
//! its connection (pipelining, up to `--max-outstanding`), and its latency
//! is measured from the scheduled instant, so a slow server cannot hide
//! queueing by slowing the sender (no coordinated omission).

use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, VecDeque};
use std::io;
use std::rc::Rc;
use std::time::Duration;

use capybara_testserver::hrtime::{now_ns, set_fine_timer_slack, Timer};
use capybara_testserver::rng::Rng;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::Notify;
use tokio::task::JoinHandle;

use crate::config::{Config, Dist, StepSubset};
use crate::http::{Event, ResponseReader};
use crate::schedule::{zipf_weights, AliasTable, Poisson, RateFn};
use crate::stats::{summarize, ConnReport, ErrorKind, Flow, Recorder, Report, ERROR_KINDS};

struct Shared {
    cfg: Config,
    rec: RefCell<Recorder>,
    stopping: Cell<bool>,
    short_inflight: Cell<usize>,
    server_header: Vec<u8>,
    short_request: Vec<u8>,
    short_request_last: Vec<u8>,
}

struct LongConn {
    idx: usize,
    weight: f64,
    stream: RefCell<Option<Rc<TcpStream>>>,
    /// Scheduled send instants of the requests awaiting a response.
    outq: RefCell<VecDeque<u64>>,
    /// Request bytes the socket has not accepted yet.
    wbuf: RefCell<Vec<u8>>,
    wake: Notify,
    request: Box<[u8]>,
    sent: Cell<u64>,
    completed: Cell<u64>,
    errors: Cell<u64>,
    reconnects: Cell<u64>,
    first_server: Cell<Option<u16>>,
    last_server: Cell<Option<u16>>,
}

fn request_bytes(cfg: &Config, tag: &str, close: bool) -> Vec<u8> {
    format!(
        "GET {} HTTP/1.1\r\nHost: {}\r\nx-conn: {}\r\n{}\r\n",
        cfg.path,
        cfg.host,
        tag,
        if close { "Connection: close\r\n" } else { "" }
    )
    .into_bytes()
}

fn io_kind(e: &io::Error) -> ErrorKind {
    match e.kind() {
        io::ErrorKind::UnexpectedEof => ErrorKind::Closed,
        io::ErrorKind::TimedOut => ErrorKind::Timeout,
        _ => ErrorKind::Reset,
    }
}

async fn connect(cfg: &Config) -> io::Result<TcpStream> {
    let s = tokio::time::timeout(cfg.connect_timeout, TcpStream::connect(cfg.target))
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "connect timed out"))??;
    s.set_nodelay(true)?;
    Ok(s)
}

/// Long-flow weights per connection (sum 1).
pub fn long_weights(cfg: &Config) -> Vec<f64> {
    let n = cfg.conns;
    if n == 0 {
        return Vec::new();
    }
    match cfg.dist {
        Dist::Uniform | Dist::Step => vec![1.0 / n as f64; n],
        Dist::Zipf { alpha } => {
            let by_rank = zipf_weights(n, alpha);
            let mut perm: Vec<usize> = (0..n).collect();
            if cfg.shuffle_ranks {
                let mut rng = Rng::new(cfg.seed).fork(99);
                for i in (1..n).rev() {
                    perm.swap(i, rng.below(i as u64 + 1) as usize);
                }
            }
            let mut w = vec![0.0; n];
            for (rank, &conn) in perm.iter().enumerate() {
                w[conn] = by_rank[rank];
            }
            w
        }
    }
}

fn dispatch_long(sh: &Shared, c: &LongConn, sched: u64) {
    let mut rec = sh.rec.borrow_mut();
    let stream = c.stream.borrow();
    let Some(s) = stream.as_ref() else {
        c.errors.set(c.errors.get() + 1);
        rec.on_error(ErrorKind::ConnDown, sched, || {
            format!("long connection {} is down", c.idx)
        });
        return;
    };
    let mut q = c.outq.borrow_mut();
    if q.len() >= sh.cfg.max_outstanding {
        c.errors.set(c.errors.get() + 1);
        rec.on_error(ErrorKind::Overflow, sched, || {
            format!(
                "long connection {} has {} requests outstanding",
                c.idx, sh.cfg.max_outstanding
            )
        });
        return;
    }
    q.push_back(sched);
    rec.on_sent(sched);
    c.sent.set(c.sent.get() + 1);
    let mut w = c.wbuf.borrow_mut();
    if w.is_empty() {
        match s.try_write(&c.request) {
            Ok(n) if n == c.request.len() => return,
            Ok(n) => w.extend_from_slice(&c.request[n..]),
            Err(_) => w.extend_from_slice(&c.request),
        }
    } else {
        w.extend_from_slice(&c.request);
    }
    c.wake.notify_one();
}

/// Handle every complete response in the reader.
fn process_long(
    sh: &Shared,
    c: &LongConn,
    reader: &mut ResponseReader,
    now: u64,
) -> Result<(), (ErrorKind, String)> {
    let mut rec = sh.rec.borrow_mut();
    loop {
        let ev = reader.poll(&sh.server_header, &mut |v| rec.intern(v));
        match ev {
            Err(e) => {
                return Err((
                    ErrorKind::BadResponse,
                    format!("long connection {}: {e}", c.idx),
                ))
            }
            Ok(Event::NeedMore) => return Ok(()),
            Ok(Event::Response {
                status,
                body_len,
                server,
                close,
            }) => {
                let Some(sched) = c.outq.borrow_mut().pop_front() else {
                    return Err((
                        ErrorKind::BadResponse,
                        format!("long connection {}: response without a request", c.idx),
                    ));
                };
                if c.first_server.get().is_none() {
                    c.first_server.set(server);
                }
                c.last_server.set(server);
                let bad = validate(sh, status, body_len, sched, now);
                if let Some((kind, why)) = bad {
                    c.errors.set(c.errors.get() + 1);
                    rec.on_error(kind, now, || format!("long connection {}: {why}", c.idx));
                } else {
                    c.completed.set(c.completed.get() + 1);
                    rec.on_response(Flow::Long, sched, now, server);
                }
                if close {
                    return Err((
                        ErrorKind::Closed,
                        format!("long connection {}: server sent connection: close", c.idx),
                    ));
                }
            }
        }
    }
}

fn validate(
    sh: &Shared,
    status: u16,
    body_len: usize,
    sched: u64,
    now: u64,
) -> Option<(ErrorKind, String)> {
    if status != sh.cfg.expect_status {
        return Some((
            ErrorKind::BadStatus,
            format!("status {status}, expected {}", sh.cfg.expect_status),
        ));
    }
    if let Some(want) = sh.cfg.expect_body {
        if body_len != want {
            return Some((
                ErrorKind::BadResponse,
                format!("body of {body_len} bytes, expected {want}"),
            ));
        }
    }
    let lat = now.saturating_sub(sched);
    if lat > sh.cfg.timeout.as_nanos() as u64 {
        return Some((
            ErrorKind::Timeout,
            format!("response after {:.1} ms", lat as f64 / 1e6),
        ));
    }
    None
}

/// Serve one established long connection until it fails (Err) or the run
/// is stopping and nothing is outstanding (Ok).
async fn drive(
    sh: &Shared,
    c: &LongConn,
    s: &TcpStream,
    reader: &mut ResponseReader,
) -> Result<(), (ErrorKind, String)> {
    loop {
        if sh.stopping.get() && c.outq.borrow().is_empty() {
            return Ok(());
        }
        let want_write = !c.wbuf.borrow().is_empty();
        tokio::select! {
            biased;
            r = s.readable() => {
                r.map_err(|e| (io_kind(&e), format!("long connection {}: {e}", c.idx)))?;
                loop {
                    let spare = reader.spare();
                    let room = spare.len();
                    match s.try_read(spare) {
                        Ok(0) => return Err((ErrorKind::Closed, format!("long connection {}: closed by the server", c.idx))),
                        Ok(n) => {
                            reader.filled(n);
                            process_long(sh, c, reader, now_ns())?;
                            if n < room {
                                break;
                            }
                        }
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                        Err(e) => return Err((io_kind(&e), format!("long connection {}: {e}", c.idx))),
                    }
                }
            }
            r = s.writable(), if want_write => {
                r.map_err(|e| (io_kind(&e), format!("long connection {}: {e}", c.idx)))?;
                let mut w = c.wbuf.borrow_mut();
                match s.try_write(&w) {
                    Ok(n) => { w.drain(..n); }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                    Err(e) => return Err((io_kind(&e), format!("long connection {}: {e}", c.idx))),
                }
            }
            _ = c.wake.notified(), if !want_write => {}
        }
    }
}

async fn long_conn_task(sh: Rc<Shared>, c: Rc<LongConn>) {
    let mut reader = ResponseReader::new(64 * 1024);
    // The initial stream (if the first connect worked) is already installed.
    let mut initial = c.stream.borrow().clone();
    loop {
        let s = match initial.take() {
            Some(s) => s,
            None => {
                if sh.stopping.get() {
                    return;
                }
                match connect(&sh.cfg).await {
                    Ok(s) => Rc::new(s),
                    Err(e) => {
                        c.errors.set(c.errors.get() + 1);
                        sh.rec
                            .borrow_mut()
                            .on_error(ErrorKind::Connect, now_ns(), || {
                                format!("long connection {}: {e}", c.idx)
                            });
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                }
            }
        };
        *c.stream.borrow_mut() = Some(s.clone());
        reader.reset();
        let res = drive(&sh, &c, &s, &mut reader).await;
        *c.stream.borrow_mut() = None;
        drop(s);
        match res {
            Ok(()) => return,
            Err((kind, why)) => {
                let lost = c.outq.borrow().len() as u64;
                c.outq.borrow_mut().clear();
                c.wbuf.borrow_mut().clear();
                // A connection lost with nothing outstanding still counts once
                // (clients see resets), unless the run is over.
                let n = if sh.stopping.get() { lost } else { lost.max(1) };
                let now = now_ns();
                {
                    let mut rec = sh.rec.borrow_mut();
                    for _ in 0..n {
                        rec.on_error(kind, now, || why.clone());
                    }
                }
                c.errors.set(c.errors.get() + n);
                c.reconnects.set(c.reconnects.get() + 1);
                if sh.stopping.get() {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    }
}

/// Send one request on a fresh connection and return the server id of the
/// response (not recorded: it only learns where the connection landed).
async fn probe(cfg: &Config, s: &mut TcpStream) -> io::Result<Option<Vec<u8>>> {
    s.write_all(&request_bytes(cfg, "probe", false)).await?;
    let mut reader = ResponseReader::new(0);
    let header = cfg.server_header.as_bytes();
    let mut name: Option<Vec<u8>> = None;
    let work = async {
        loop {
            let ev = reader.poll(header, &mut |v| {
                name = Some(v.to_vec());
                0
            });
            match ev {
                Ok(Event::Response { .. }) => return Ok(()),
                Ok(Event::NeedMore) => {}
                Err(e) => {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!("probe response: {e}"),
                    ))
                }
            }
            let n = s.read(reader.spare()).await?;
            if n == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "probe: connection closed",
                ));
            }
            reader.filled(n);
        }
    };
    tokio::time::timeout(cfg.timeout, work)
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "probe: no response"))??;
    Ok(name)
}

async fn short_flow(sh: Rc<Shared>, sched: u64) {
    let cfg = &sh.cfg;
    let k = cfg.short_requests;
    let mut done = 0u32;
    let res: Result<(), (ErrorKind, String)> = async {
        let mut s = connect(cfg)
            .await
            .map_err(|e| (ErrorKind::Connect, format!("short connection: {e}")))?;
        sh.rec.borrow_mut().short_conns_opened += 1;
        let mut reader = ResponseReader::new(0);
        for i in 0..k {
            let issue = if i == 0 { sched } else { now_ns() };
            sh.rec.borrow_mut().on_sent(issue);
            let req = if i + 1 == k {
                &sh.short_request_last
            } else {
                &sh.short_request
            };
            s.write_all(req)
                .await
                .map_err(|e| (io_kind(&e), format!("short connection: {e}")))?;
            let deadline = tokio::time::Instant::now()
                + cfg
                    .timeout
                    .saturating_sub(Duration::from_nanos(now_ns().saturating_sub(issue)));
            loop {
                let ev = {
                    let mut rec = sh.rec.borrow_mut();
                    reader
                        .poll(&sh.server_header, &mut |v| rec.intern(v))
                        .map_err(|e| (ErrorKind::BadResponse, format!("short connection: {e}")))?
                };
                if let Event::Response {
                    status,
                    body_len,
                    server,
                    close,
                } = ev
                {
                    let now = now_ns();
                    done += 1;
                    let mut rec = sh.rec.borrow_mut();
                    match validate(&sh, status, body_len, issue, now) {
                        Some((kind, why)) => {
                            rec.on_error(kind, now, || format!("short connection: {why}"))
                        }
                        None => rec.on_response(Flow::Short, issue, now, server),
                    }
                    if close && i + 1 < k {
                        return Err((
                            ErrorKind::Closed,
                            "short connection: server sent connection: close early".into(),
                        ));
                    }
                    break;
                }
                let n = tokio::time::timeout_at(deadline, s.read(reader.spare()))
                    .await
                    .map_err(|_| {
                        (
                            ErrorKind::Timeout,
                            "short connection: no response".to_string(),
                        )
                    })?
                    .map_err(|e| (io_kind(&e), format!("short connection: {e}")))?;
                if n == 0 {
                    return Err((
                        ErrorKind::Closed,
                        "short connection: closed by the server".into(),
                    ));
                }
                reader.filled(n);
            }
        }
        Ok(())
    }
    .await;
    if let Err((kind, why)) = res {
        let now = now_ns();
        let mut rec = sh.rec.borrow_mut();
        // Every request of the flow that got no valid answer is an error.
        let lost = if kind == ErrorKind::Connect {
            1
        } else {
            (k - done).max(1)
        };
        for _ in 0..lost {
            rec.on_error(kind, now, || why.clone());
        }
    }
    sh.short_inflight.set(sh.short_inflight.get() - 1);
}

async fn scheduler(sh: Rc<Shared>, conns: Vec<Rc<LongConn>>, t0: u64) -> Option<Vec<usize>> {
    let cfg = &sh.cfg;
    let dur_ns = cfg.duration.as_nanos() as u64;
    // The send loop never runs longer than the schedule plus --timeout.
    let hard_stop_ns = dur_ns + cfg.timeout.as_nanos() as u64;
    let root = Rng::new(cfg.seed);
    let long_rate = cfg.long_rate();
    let mut base = (long_rate > 0.0 && !conns.is_empty())
        .then(|| Poisson::new(RateFn::Const(long_rate), root.fork(1)));
    let alias = (!conns.is_empty())
        .then(|| AliasTable::new(&conns.iter().map(|c| c.weight).collect::<Vec<_>>()));
    let mut step = cfg.step.as_ref().map(|s| {
        Poisson::new(
            RateFn::Step {
                start_ns: s.start.as_nanos() as u64,
                interval_ns: s.interval.as_nanos() as u64,
                step: s.step_rps,
                max_steps: s.max_steps,
            },
            root.fork(2),
        )
    });
    let mut subset: Option<Vec<usize>> = match cfg.step.as_ref().map(|s| &s.subset) {
        Some(StepSubset::Conns(l)) => Some(l.clone()),
        _ => None,
    };
    let mut short = (cfg.short_rate > 0.0).then(|| {
        Poisson::new(
            RateFn::Const(cfg.short_rate / cfg.short_requests as f64),
            root.fork(3),
        )
    });
    let mut pick = root.fork(4);
    let mut timer = Timer::new(cfg.precise_timers);
    let mut burst = 0u32;
    loop {
        let tb = base.as_ref().map_or(u64::MAX, |p| p.peek());
        let ts = step.as_ref().map_or(u64::MAX, |p| p.peek());
        let tf = short.as_ref().map_or(u64::MAX, |p| p.peek());
        let t = tb.min(ts).min(tf);
        if t >= dur_ns {
            break;
        }
        let at = t0 + t;
        if at > now_ns() {
            timer.sleep_until(at).await;
            burst = 0;
        } else {
            // Behind schedule: send, but let the readers run now and then.
            if now_ns() > t0 + hard_stop_ns {
                eprintln!(
                    "capybara-loadgen: warning: the sender fell more than --timeout behind schedule; stopping the send loop at {:.3}s of schedule",
                    t as f64 / 1e9
                );
                break;
            }
            burst += 1;
            if burst >= 32 {
                burst = 0;
                tokio::task::yield_now().await;
            }
        }
        if t == tb {
            base.as_mut().unwrap().advance();
            let i = alias.as_ref().unwrap().sample(&mut pick);
            dispatch_long(&sh, &conns[i], at);
        } else if t == ts {
            step.as_mut().unwrap().advance();
            if subset.is_none() {
                if let Some(StepSubset::Server(id)) = cfg.step.as_ref().map(|s| &s.subset) {
                    let idx = sh.rec.borrow_mut().intern(id.as_bytes());
                    let l: Vec<usize> = conns
                        .iter()
                        .filter(|c| c.first_server.get() == Some(idx))
                        .map(|c| c.idx)
                        .collect();
                    if l.is_empty() {
                        eprintln!("capybara-loadgen: warning: no long connection has been served by {id:?}; the step load is not sent");
                    }
                    subset = Some(l);
                }
            }
            let l = subset.as_ref().unwrap();
            if !l.is_empty() {
                let i = l[pick.below(l.len() as u64) as usize];
                dispatch_long(&sh, &conns[i], at);
            }
        } else {
            short.as_mut().unwrap().advance();
            if sh.short_inflight.get() >= cfg.max_short_inflight {
                let mut rec = sh.rec.borrow_mut();
                for _ in 0..cfg.short_requests {
                    rec.on_error(ErrorKind::ShortOverflow, at, || {
                        format!("{} short connections already open", cfg.max_short_inflight)
                    });
                }
            } else {
                sh.short_inflight.set(sh.short_inflight.get() + 1);
                tokio::task::spawn_local(short_flow(sh.clone(), at));
            }
        }
    }
    sh.stopping.set(true);
    for c in &conns {
        c.wake.notify_one();
    }
    subset
}

/// Run one load test. Must be called inside a `tokio::task::LocalSet` on a
/// runtime with I/O and time enabled (see [`run_blocking`]).
pub async fn run(cfg: Config) -> Result<Report, String> {
    set_fine_timer_slack();
    let weights = long_weights(&cfg);
    // Open the long-lived connections first (concurrently); with probing,
    // one unrecorded request on each tells which server it landed on.
    let probing = cfg.probe
        || matches!(
            cfg.step.as_ref().map(|s| &s.subset),
            Some(StepSubset::Server(_))
        );
    type Opened = io::Result<(TcpStream, Option<Vec<u8>>)>;
    let handles: Vec<JoinHandle<Opened>> = (0..cfg.conns)
        .map(|_| {
            let cfg = cfg.clone();
            tokio::task::spawn_local(async move {
                let mut s = connect(&cfg).await?;
                let server = if probing {
                    probe(&cfg, &mut s).await?
                } else {
                    None
                };
                Ok((s, server))
            })
        })
        .collect();
    let mut initial = Vec::with_capacity(cfg.conns);
    let mut probed = Vec::with_capacity(cfg.conns);
    let mut first_connect_error = None;
    for h in handles {
        let r = h
            .await
            .unwrap_or_else(|e| Err(io::Error::other(e.to_string())));
        match r {
            Ok((s, server)) => {
                initial.push(Some(s));
                probed.push(server);
            }
            Err(e) => {
                first_connect_error.get_or_insert_with(|| e.to_string());
                initial.push(None);
                probed.push(None);
            }
        }
    }
    if cfg.conns > 0 && initial.iter().all(Option::is_none) {
        return Err(format!(
            "cannot connect to --target {}: {}",
            cfg.target,
            first_connect_error.unwrap_or_default()
        ));
    }
    let interval_ns = cfg.interval.as_nanos() as u64;
    let rows = (cfg.duration.as_nanos() as u64 / interval_ns) as usize + 1;
    let t0 = now_ns() + 1_000_000;
    let mut rec = Recorder::new(t0, interval_ns, rows);
    for (i, s) in initial.iter().enumerate() {
        if s.is_none() {
            rec.on_error(ErrorKind::Connect, t0, || {
                format!(
                    "long connection {i}: {}",
                    first_connect_error.clone().unwrap_or_default()
                )
            });
        }
    }
    let probed: Vec<Option<u16>> = probed
        .iter()
        .map(|p| p.as_ref().map(|id| rec.intern(id)))
        .collect();
    let sh = Rc::new(Shared {
        server_header: cfg.server_header.as_bytes().to_vec(),
        short_request: request_bytes(&cfg, "short", false),
        short_request_last: request_bytes(&cfg, "short", true),
        rec: RefCell::new(rec),
        stopping: Cell::new(false),
        short_inflight: Cell::new(0),
        cfg: cfg.clone(),
    });
    let conns: Vec<Rc<LongConn>> = (0..cfg.conns)
        .map(|i| {
            let stream = initial[i].take().map(Rc::new);
            let failed = stream.is_none();
            Rc::new(LongConn {
                idx: i,
                weight: weights[i],
                stream: RefCell::new(stream),
                outq: RefCell::new(VecDeque::with_capacity(cfg.max_outstanding.min(4096))),
                wbuf: RefCell::new(Vec::with_capacity(4096)),
                wake: Notify::new(),
                request: request_bytes(&cfg, &i.to_string(), false).into_boxed_slice(),
                sent: Cell::new(0),
                completed: Cell::new(0),
                errors: Cell::new(failed as u64),
                reconnects: Cell::new(0),
                first_server: Cell::new(probed[i]),
                last_server: Cell::new(None),
            })
        })
        .collect();
    let mut tasks = Vec::with_capacity(conns.len());
    for c in &conns {
        tasks.push(tokio::task::spawn_local(long_conn_task(
            sh.clone(),
            c.clone(),
        )));
    }

    let subset = scheduler(sh.clone(), conns.clone(), t0).await;

    // Drain: wait for outstanding responses, at most --timeout.
    let deadline = now_ns() + cfg.timeout.as_nanos() as u64;
    loop {
        let outstanding: usize = conns.iter().map(|c| c.outq.borrow().len()).sum();
        if outstanding == 0 && sh.short_inflight.get() == 0 {
            break;
        }
        if now_ns() >= deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    for t in &tasks {
        t.abort();
    }
    let end = now_ns();
    {
        let mut rec = sh.rec.borrow_mut();
        for c in &conns {
            let n = c.outq.borrow().len();
            for _ in 0..n {
                rec.on_error(ErrorKind::Timeout, end, || {
                    format!(
                        "long connection {}: no response by the end of the drain",
                        c.idx
                    )
                });
            }
            c.errors.set(c.errors.get() + n as u64);
        }
        for _ in 0..sh.short_inflight.get() {
            rec.on_error(ErrorKind::Timeout, end, || {
                "short connection: no response by the end of the drain".into()
            });
        }
    }
    for t in tasks {
        let _ = t.await;
    }

    let mut rec = sh.rec.borrow_mut();
    let timeline = rec.finish_timeline(end);
    let name = |s: Option<u16>| s.and_then(|i| rec.servers.get(i as usize).cloned());
    let connections = conns
        .iter()
        .map(|c| ConnReport {
            conn: c.idx,
            weight: c.weight,
            sent: c.sent.get(),
            completed: c.completed.get(),
            errors: c.errors.get(),
            first_server: name(c.first_server.get()),
            last_server: name(c.last_server.get()),
            reconnects: c.reconnects.get(),
        })
        .collect();
    let dur_s = cfg.duration.as_secs_f64();
    let mut latency = BTreeMap::new();
    latency.insert("all", summarize(&rec.all));
    latency.insert("long", summarize(&rec.long));
    latency.insert("short", summarize(&rec.short));
    let errors_by_kind = ERROR_KINDS
        .iter()
        .zip(rec.errors.iter())
        .map(|(k, v)| (k.name(), *v))
        .collect();
    let per_server = rec
        .servers
        .iter()
        .cloned()
        .zip(rec.per_server_total.iter().copied())
        .collect();
    Ok(Report {
        duration_s: dur_s,
        offered_rps: cfg.rate,
        achieved_rps: rec.completed as f64 / dur_s,
        sent: rec.sent,
        requests: rec.completed,
        validated: rec.validated,
        long_requests: rec.completed_long,
        short_requests: rec.completed_short,
        short_conns_opened: rec.short_conns_opened,
        errors: rec.error_total(),
        errors_by_kind,
        first_error: rec.first_error.clone(),
        latency,
        per_server,
        step_subset: subset,
        timeline,
        connections,
        precise_timers: cfg.precise_timers && Timer::new(true).is_precise(),
        config: cfg,
    })
}

/// Build a current-thread runtime and run one load test on it.
pub fn run_blocking(cfg: Config) -> Result<Report, String> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the runtime: {e}"))?;
    let local = tokio::task::LocalSet::new();
    local.block_on(&rt, run(cfg))
}
