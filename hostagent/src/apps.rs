//! The built-in services the hostagent can serve on the user-space stack:
//! an echo service and an HTTP/1.1 service (hyper, unchanged, on the async
//! socket API). Tests and benchmarks use them.

use crate::socket::{TcpListener, TcpStream};
use bytes::Bytes;
use http_body_util::Full;
use hyper::{Request, Response};
use sha2::{Digest, Sha256};
use std::collections::VecDeque;
use std::convert::Infallible;
use std::rc::Rc;
use tokio::io::AsyncWriteExt;

/// Echoes every connection; at the end of each it logs the byte count and
/// the SHA-256 of what it received, so tests can compare both ends. A
/// connection that migrates away logs "migrated to" (tests count them)
/// unless `CAPYBARA_ECHO_QUIET=1` (benchmarks: one stdout write per
/// migration was ~2% of a hostagent's CPU in `make bench-migration`).
pub async fn echo(listener: TcpListener) {
    let quiet = std::env::var_os("CAPYBARA_ECHO_QUIET").is_some_and(|v| v == "1");
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                eprintln!("hostagent: echo accept: {e}");
                continue;
            }
        };
        tokio::task::spawn_local(async move {
            match echo_one(stream).await {
                Ok((n, hash)) => println!("echo peer={peer} bytes={n} sha256={hash}"),
                Err(e) => match crate::socket::moved_to(&e) {
                    Some(_) if quiet => {}
                    Some(t) => println!("echo peer={peer} migrated to {t}"),
                    None => println!("echo peer={peer} error={e}"),
                },
            }
        });
    }
}

/// Echo that never holds a byte outside the stack: it reads only as much as
/// the send buffer can take right now and writes it back in the same step,
/// so a migration at any instant finds every byte in the TCP queues and the
/// target's echo continues exactly where this one stopped.
async fn echo_one(mut stream: TcpStream) -> std::io::Result<(u64, String)> {
    let mut buf = EchoBuf::take();
    let buf = &mut buf.0;
    let mut hash = Sha256::new();
    let mut total = 0u64;
    loop {
        let cap = std::future::poll_fn(|cx| stream.poll_send_capacity(cx)).await?;
        let want = cap.min(buf.len());
        let n = std::future::poll_fn(|cx| stream.poll_read_some(cx, &mut buf[..want])).await?;
        if n == 0 {
            break;
        }
        hash.update(&buf[..n]);
        total += n as u64;
        let written = stream.try_write(&buf[..n])?;
        debug_assert_eq!(written, n, "send capacity only grows between the two calls");
    }
    stream.shutdown().await?;
    let hex = hash.finalize().iter().map(|b| format!("{b:02x}")).collect();
    Ok((total, hex))
}

thread_local! {
    /// Buffers of finished echo connections, reused by the next ones: every
    /// migration in starts a new echo task, and allocating and zeroing
    /// 64 KiB for each showed in `make bench-migration`'s profile.
    static ECHO_BUFS: std::cell::RefCell<Vec<Vec<u8>>> = const { std::cell::RefCell::new(Vec::new()) };
}
const ECHO_BUF: usize = 64 * 1024;
/// Buffers kept for reuse at most.
const ECHO_POOL: usize = 64;

/// An echo buffer from the pool, returned to it when the task ends.
struct EchoBuf(Vec<u8>);

impl EchoBuf {
    fn take() -> EchoBuf {
        let reused = ECHO_BUFS.with(|p| p.borrow_mut().pop());
        EchoBuf(reused.unwrap_or_else(|| vec![0u8; ECHO_BUF]))
    }
}

impl Drop for EchoBuf {
    fn drop(&mut self) {
        let b = std::mem::take(&mut self.0);
        let _ = ECHO_BUFS.try_with(|p| {
            let mut p = p.borrow_mut();
            if p.len() < ECHO_POOL {
                p.push(b);
            }
        });
    }
}

/// Serves HTTP/1.1 with keep-alive: `GET /` answers a short greeting,
/// `GET /bytes/N` answers N bytes (at most 64 MiB). Every response carries
/// `x-server: NAME`.
pub async fn http(listener: TcpListener, name: Rc<str>) {
    loop {
        let (stream, _peer) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                eprintln!("hostagent: http accept: {e}");
                continue;
            }
        };
        tokio::task::spawn_local(serve_http_connection(stream, name.clone()));
    }
}

/// Serves one HTTP/1.1 connection on any byte stream: the user-space
/// stack's `TcpStream`, or a kernel socket for side-by-side benchmarks.
pub async fn serve_http_connection<S>(stream: S, name: Rc<str>)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + 'static,
{
    let service = hyper::service::service_fn(move |req| {
        let name = name.clone();
        async move { Ok::<_, Infallible>(respond(&name, req)) }
    });
    let io = hyper_util::rt::TokioIo::new(stream);
    let _ = hyper::server::conn::http1::Builder::new()
        .keep_alive(true)
        .pipeline_flush(true)
        .serve_connection(io, service)
        .await;
}

fn respond(name: &str, req: Request<hyper::body::Incoming>) -> Response<Full<Bytes>> {
    let path = req.uri().path();
    let (status, body) = if path == "/" {
        (200, Bytes::from(format!("hello from {name}\n")))
    } else if let Some(n) = path
        .strip_prefix("/bytes/")
        .and_then(|n| n.parse::<usize>().ok())
    {
        if n <= 64 << 20 {
            (200, Bytes::from(vec![b'x'; n]))
        } else {
            (400, Bytes::from_static(b"at most 67108864 bytes\n"))
        }
    } else {
        (404, Bytes::from_static(b"not found\n"))
    };
    Response::builder()
        .status(status)
        .header("x-server", name)
        .header("content-type", "text/plain")
        .body(Full::new(body))
        .expect("static response parts are valid")
}

/// The benchmarks' emulated single-core server (`capybara-testserver`) on
/// the user-space stack: every request of every connection of the service
/// queues, FIFO, on one virtual core with the configured service time, and
/// its response is written at the completion instant.
///
/// Unlike `capybara_testserver::serve_connection`, this server never takes
/// a request out of the receive queue before it answers it: it *peeks* at
/// the queue to admit requests to the core, and consumes a request's bytes
/// and writes its response in one synchronous step. So the application
/// holds no byte at any await point, a migration at any instant carries
/// every unanswered request in the connection snapshot, and the target's
/// testserver admits them to its own core. It also makes the receive queue
/// the server's real backlog, which is what the reactive policy watches.
///
/// Each connection attaches to the core (`Core::attach`); when the
/// connection migrates away (or closes) its task ends and the handle is
/// dropped, which takes its admitted-but-unanswered requests off this
/// server's core at once: they are served once, on the target.
pub async fn testserver(
    listener: TcpListener,
    stack: crate::Stack,
    core: std::sync::Arc<capybara_testserver::Core>,
) {
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                eprintln!("hostagent: testserver accept: {e}");
                continue;
            }
        };
        core.count_connection();
        let (stack, core) = (stack.clone(), core.clone());
        tokio::task::spawn_local(async move {
            let mut slot = core.attach();
            if let Err(e) = testserver_connection(&stack, &stream, &core, &mut slot).await {
                if crate::socket::moved_to(&e).is_none() {
                    eprintln!("hostagent: testserver peer={peer}: {e}");
                }
            }
        });
    }
}

/// A request admitted to the virtual core, still in the receive queue.
struct Admitted {
    /// Served once the connection's finished count on the core reaches it.
    need: u64,
    /// Bytes of the request (head and body) at the front of the queue.
    len: usize,
    stats: bool,
    close: bool,
}

/// Per-connection state of the testserver: timing only, never bytes.
struct TsConn {
    admitted: VecDeque<Admitted>,
    /// Receive-queue bytes covered by `admitted`.
    parsed: usize,
    peek: Vec<u8>,
    sink: Vec<u8>,
    out: Vec<u8>,
    closing: bool,
}

enum TsStep {
    /// Wait for data, a state change, or the core finishing a request.
    Wait { need: Option<u64>, want_write: bool },
    /// Finished (answered everything and the peer closed, or a close).
    Done,
}

async fn testserver_connection(
    stack: &crate::Stack,
    stream: &TcpStream,
    core: &capybara_testserver::Core,
    slot: &mut capybara_testserver::CoreConn,
) -> std::io::Result<()> {
    let mut st = TsConn {
        admitted: VecDeque::with_capacity(16),
        parsed: 0,
        peek: vec![0u8; capybara_testserver::MAX_REQUEST_HEAD + 1],
        sink: vec![0u8; 4096],
        out: Vec::with_capacity(4096),
        closing: false,
    };
    let app = stream.id();
    loop {
        let step = stack.with(|i| testserver_step(i, app, core, slot, &mut st))?;
        match step {
            TsStep::Done => return Ok(()),
            TsStep::Wait { need, want_write } => {
                let woken = WaitWake {
                    stack,
                    app,
                    want_write,
                    parked: false,
                };
                tokio::select! {
                    _ = woken => {}
                    _ = slot.wait_finished(need.unwrap_or(0)), if need.is_some() => {}
                }
            }
        }
    }
}

/// One synchronous step: admit the complete requests that arrived, answer
/// those whose service completed. Runs under the stack borrow, so no
/// migration can happen in the middle of it.
fn testserver_step(
    i: &mut crate::stack::Inner,
    app: capybara_tcp::ConnId,
    core: &capybara_testserver::Core,
    slot: &mut capybara_testserver::CoreConn,
    st: &mut TsConn,
) -> std::io::Result<TsStep> {
    use crate::migration::HandleState;
    let id = match i.resolve(app) {
        HandleState::Live(id) => id,
        HandleState::Frozen => {
            return Ok(TsStep::Wait {
                need: None,
                want_write: false,
            })
        }
        HandleState::Moved(t) => return Err(std::io::Error::other(crate::socket::Moved(t))),
        HandleState::Lost => return Err(std::io::ErrorKind::ConnectionReset.into()),
    };
    let mut moved = false;
    let r = testserver_io(&mut i.transports.tcp, id, core, slot, st, &mut moved);
    if moved {
        // Bytes consumed or queued: the driver owes a window update or data.
        i.kick();
    }
    r
}

fn testserver_io(
    tcp: &mut capybara_tcp::Endpoint,
    id: capybara_tcp::ConnId,
    core: &capybara_testserver::Core,
    slot: &mut capybara_testserver::CoreConn,
    st: &mut TsConn,
    moved: &mut bool,
) -> std::io::Result<TsStep> {
    use capybara_testserver::parse_request_head;
    let max_pipeline = core.config().max_pipeline.max(1);
    let Some(conn) = tcp.connection(id) else {
        return Err(std::io::ErrorKind::NotConnected.into());
    };
    let fin = conn.rcv.fin_received;
    let queued_rx = conn.rx.len();
    // Admit every complete request beyond those admitted already.
    let mut malformed = None;
    while !st.closing && st.admitted.len() < max_pipeline {
        let n = conn.rx.read_at(st.parsed, &mut st.peek);
        match parse_request_head(&st.peek[..n]) {
            Ok(Some(h)) => {
                let len = h.head_len + h.body_len;
                if queued_rx - st.parsed < len {
                    break; // the body is still on its way
                }
                let need = if h.is_stats {
                    slot.admitted()
                } else {
                    slot.admit()
                };
                st.admitted.push_back(Admitted {
                    need,
                    len,
                    stats: h.is_stats,
                    close: h.close,
                });
                st.parsed += len;
                st.closing = h.close;
            }
            Ok(None) => break,
            Err(why) => {
                malformed = Some(why);
                break;
            }
        }
    }
    if let Some(why) = malformed {
        // As the kernel testserver: answer 400 and close.
        let msg = format!(
            "HTTP/1.1 400 Bad Request\r\ncontent-length: {}\r\nx-server: {}\r\nconnection: close\r\n\r\n{}",
            why.len(),
            core.config().id,
            why
        );
        let _ = tcp.send(id, msg.as_bytes());
        let _ = tcp.shutdown(id);
        *moved = true;
        return Ok(TsStep::Done);
    }
    // Answer, in order, every request whose service completed.
    let finished = slot.finished();
    let cap = tcp.config().tx_buffer;
    while let Some(a) = st.admitted.front() {
        if a.need > finished {
            break;
        }
        let (len, stats, close) = (a.len, a.stats, a.close);
        st.out.clear();
        core.respond_into(stats, &mut st.out);
        let queued = tcp.info(id).map_or(cap, |c| c.send_queue);
        if cap.saturating_sub(queued) < st.out.len() {
            let _ = tcp.notify_writable(id);
            return Ok(TsStep::Wait {
                need: None,
                want_write: true,
            });
        }
        let mut left = len;
        while left > 0 {
            let k = left.min(st.sink.len());
            match tcp.recv(id, &mut st.sink[..k]) {
                Ok(0) | Err(_) => break,
                Ok(n) => left -= n,
            }
        }
        let written = tcp.send(id, &st.out).map_err(crate::socket::io_error)?;
        debug_assert_eq!(written, st.out.len(), "send capacity checked above");
        st.parsed -= len;
        st.admitted.pop_front();
        *moved = true;
        if close {
            let _ = tcp.shutdown(id);
            return Ok(TsStep::Done);
        }
    }
    if st.admitted.is_empty() && fin {
        // The peer is done and every complete request it sent is answered.
        let _ = tcp.shutdown(id);
        *moved = true;
        return Ok(TsStep::Done);
    }
    if tcp.is_closed(id) {
        return Err(std::io::ErrorKind::ConnectionReset.into());
    }
    Ok(TsStep::Wait {
        need: st.admitted.front().map(|a| a.need),
        want_write: false,
    })
}

/// Completes the second time it is polled: parks the connection's read
/// (and write) waker once, so the task wakes on data, a state change of
/// the connection (migration, close), or free send space.
struct WaitWake<'a> {
    stack: &'a crate::Stack,
    app: capybara_tcp::ConnId,
    want_write: bool,
    parked: bool,
}

impl std::future::Future for WaitWake<'_> {
    type Output = ();
    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<()> {
        if self.parked {
            return std::task::Poll::Ready(());
        }
        self.parked = true;
        let (app, want_write) = (self.app, self.want_write);
        self.stack.with(|i| {
            let w = i.wakers.entry(app).or_default();
            w.read = Some(cx.waker().clone());
            if want_write {
                w.write = Some(cx.waker().clone());
            }
        });
        std::task::Poll::Pending
    }
}
