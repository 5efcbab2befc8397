//! The socket-compatible API on the user-space stack: `TcpListener` and
//! `TcpStream`, with both a non-blocking call style (`try_read`,
//! `try_write`) and tokio's `AsyncRead`/`AsyncWrite`, so existing servers
//! (hyper, tokio::io utilities) run on it unchanged.
//!
//! Errors map onto `std::io::ErrorKind` the way kernel sockets do: reset ->
//! `ConnectionReset`, timed out -> `TimedOut`, refused ->
//! `ConnectionRefused`, use after close -> `NotConnected`. A connection that
//! migrated to another server reports [`Moved`] (see [`moved_to`]); while
//! its migration is in progress, calls block.
//!
//! # Connection managers (seed 000 §6)
//!
//! An application that keeps per-connection state outside the TCP queues
//! (a partially received request, TLS record-layer state) registers a
//! [`ConnectionManager`] on each connection ([`TcpStream::set_manager`]) and
//! a [`StateImporter`] on its listener ([`TcpListener::set_importer`]):
//!
//! 1. a migration is requested (policy, drain, API): the stack calls
//!    [`ConnectionManager::prepare`]. From that call on the application
//!    starts no new work on the connection (it *quiesces*); when it is at a
//!    safe point it answers `Ready` and the migration starts (PREPARE).
//!    Until then the stack asks again on every poll, for at most
//!    [`Managers::wait_limit`]; past it the migration is given up and
//!    [`ConnectionManager::resume`] is called;
//! 2. on export (phase 2) [`ConnectionManager::export_state`] appends the
//!    state; it travels in the connection snapshot;
//! 3. on the target, [`StateImporter::import_state`] runs before the
//!    connection appears through `accept`; an error refuses the import and
//!    the origin keeps serving. The accepted stream then hands the imported
//!    value to the application ([`TcpStream::take_imported_state`]).
//!    Until the application registers the connection's manager, a further
//!    migration exports the state bytes the connection arrived with, as
//!    they are (it may still sit in the accept queue, or its task may not
//!    have run yet: the state must not be lost). So an application
//!    registers the manager before it reads from the stream;
//! 4. the migration did not happen: `resume`; it did (or the target host
//!    failed): [`ConnectionManager::gone`], and socket calls report
//!    [`Moved`].
//!
//! Callbacks run inside the stack's poll with the stack borrowed: they must
//! not call socket functions (they may update their own state and wake
//! tasks).

use crate::migration::HandleState;
use crate::stack::{Inner, Stack};
use capybara_proto::time::{Duration, Instant};
use capybara_proto::FlowKey;
use capybara_tcp::{ConnId, TcpError};
use std::any::Any;
use std::collections::HashMap;
use std::io;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Maps a stack error onto the kind a kernel socket would report.
pub fn io_error(e: TcpError) -> io::Error {
    let kind = match e {
        TcpError::WouldBlock => io::ErrorKind::WouldBlock,
        TcpError::Reset => io::ErrorKind::ConnectionReset,
        TcpError::Refused => io::ErrorKind::ConnectionRefused,
        TcpError::TimedOut => io::ErrorKind::TimedOut,
        TcpError::Aborted => io::ErrorKind::ConnectionAborted,
        TcpError::AddrInUse => io::ErrorKind::AddrInUse,
        TcpError::NotConnected | TcpError::Closed | TcpError::InvalidHandle => {
            io::ErrorKind::NotConnected
        }
        TcpError::NoPorts => io::ErrorKind::AddrNotAvailable,
    };
    io::Error::new(kind, e)
}

/// The error a socket call reports once its connection migrated to another
/// server (`io::ErrorKind::Other`; test with [`moved_to`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("connection migrated to {0}")]
pub struct Moved(pub std::net::Ipv4Addr);

/// The server a connection moved to, if `e` says it moved.
pub fn moved_to(e: &io::Error) -> Option<std::net::Ipv4Addr> {
    e.get_ref()
        .and_then(|i| i.downcast_ref::<Moved>())
        .map(|m| m.0)
}

/// A connection manager's answer to "may this connection be exported now?".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Readiness {
    /// At a safe point: export may happen now (the manager stays quiesced
    /// until `resume` or `gone`).
    Ready,
    /// Quiescing: ask again later.
    NotYet,
    /// This connection cannot migrate (e.g. a protocol mode the manager
    /// cannot serialize); the migration is given up at once.
    Never,
}

/// Per-connection application state that migrates with the connection.
pub trait ConnectionManager {
    /// A migration was requested: stop starting new work and say whether
    /// the connection is at a safe point. Called again until `Ready`.
    fn prepare(&mut self) -> Readiness;
    /// Appends the connection's application state (phase 2). An error
    /// gives the migration up (the origin keeps serving; `resume` follows).
    fn export_state(&mut self, out: &mut Vec<u8>) -> Result<(), String>;
    /// The migration will not happen: continue serving normally.
    fn resume(&mut self);
    /// The connection left this host (migrated out, or lost with a failed
    /// target): release resources; socket calls report it.
    fn gone(&mut self) {}
}

/// Rebuilds a migrated-in connection's application state on the target,
/// before the connection appears through `accept`.
pub trait StateImporter {
    /// `state` is what the origin's manager exported (empty if it had
    /// none). The value returned is handed to the application with the
    /// accepted stream; an error refuses the migration.
    fn import_state(&self, flow: FlowKey, state: &[u8]) -> Result<Box<dyn Any>, String>;
}

/// What the stack does with a requested migration (see [`Managers`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gate {
    /// No manager, or it is ready: migrate now.
    Go,
    /// Waiting for the manager (already or newly).
    Wait,
    /// The manager refused.
    Refused,
}

struct Waiting {
    flow: FlowKey,
    app: ConnId,
    target: Option<Ipv4Addr>,
    deadline: Instant,
}

/// The connection managers and importers of one host (kept by the
/// `Migrator`), and the migrations waiting for a manager to be ready.
pub struct Managers {
    conns: HashMap<ConnId, Box<dyn ConnectionManager>>,
    importers: HashMap<u16, Rc<dyn StateImporter>>,
    imported: HashMap<ConnId, Box<dyn Any>>,
    /// The state bytes each migrated-in connection arrived with, kept until
    /// the application registers the connection's manager: a migration in
    /// between (the connection still in the accept queue, or accepted and
    /// its task not run yet) must carry them on unchanged, not lose them.
    unclaimed: HashMap<ConnId, Vec<u8>>,
    waiting: Vec<Waiting>,
    /// How long a migration waits for its manager to reach a safe point.
    pub wait_limit: Duration,
    /// Migrations given up because the manager was not ready in time.
    pub wait_timeouts: u64,
    next_check: Option<Instant>,
    /// Migrations started after waiting for the manager.
    pub waited: u64,
}

impl Default for Managers {
    fn default() -> Self {
        Managers {
            conns: HashMap::new(),
            importers: HashMap::new(),
            imported: HashMap::new(),
            unclaimed: HashMap::new(),
            waiting: Vec::new(),
            wait_limit: Duration::from_millis(100),
            wait_timeouts: 0,
            next_check: None,
            waited: 0,
        }
    }
}

impl Managers {
    pub fn set(&mut self, app: ConnId, m: Box<dyn ConnectionManager>) {
        // From now on the manager exports the connection's state.
        self.unclaimed.remove(&app);
        self.conns.insert(app, m);
    }

    pub fn set_importer(&mut self, port: u16, i: Rc<dyn StateImporter>) {
        self.importers.insert(port, i);
    }

    pub fn remove_importer(&mut self, port: u16) {
        self.importers.remove(&port);
    }

    /// The application released the handle.
    pub fn remove(&mut self, app: ConnId) {
        self.conns.remove(&app);
        self.unclaimed.remove(&app);
        self.imported.remove(&app);
        self.waiting.retain(|w| w.app != app);
    }

    /// A migration of `flow` (application handle `app`) was requested.
    pub fn gate(
        &mut self,
        now: Instant,
        flow: FlowKey,
        app: ConnId,
        target: Option<Ipv4Addr>,
    ) -> Gate {
        if self.waiting.iter().any(|w| w.flow == flow) {
            return Gate::Wait;
        }
        let Some(m) = self.conns.get_mut(&app) else {
            return Gate::Go;
        };
        match m.prepare() {
            Readiness::Ready => Gate::Go,
            Readiness::Never => {
                m.resume();
                Gate::Refused
            }
            Readiness::NotYet => {
                self.waiting.push(Waiting {
                    flow,
                    app,
                    target,
                    deadline: now + self.wait_limit,
                });
                self.next_check = Some(now + Duration::from_millis(1));
                Gate::Wait
            }
        }
    }

    /// Whether a migration of `flow` waits for its manager's safe point.
    pub fn is_waiting(&self, flow: &FlowKey) -> bool {
        self.waiting.iter().any(|w| w.flow == *flow)
    }

    /// Migrations whose manager became ready since the last call, appended
    /// to `ready` as (flow, target). Expired waits are given up (`resume`).
    pub fn poll_waiting(&mut self, now: Instant, ready: &mut Vec<(FlowKey, Option<Ipv4Addr>)>) {
        if self.waiting.is_empty() {
            // The usual case, on every TCPMig message: nothing to check.
            self.next_check = None;
            return;
        }
        let mut i = 0;
        while i < self.waiting.len() {
            let w = &self.waiting[i];
            let verdict = match self.conns.get_mut(&w.app) {
                None => Some(Readiness::Never),
                Some(m) => match m.prepare() {
                    Readiness::NotYet if now >= w.deadline => {
                        self.wait_timeouts += 1;
                        m.resume();
                        Some(Readiness::Never)
                    }
                    Readiness::NotYet => None,
                    Readiness::Never => {
                        m.resume();
                        Some(Readiness::Never)
                    }
                    Readiness::Ready => Some(Readiness::Ready),
                },
            };
            match verdict {
                None => i += 1,
                Some(r) => {
                    let w = self.waiting.swap_remove(i);
                    if r == Readiness::Ready {
                        self.waited += 1;
                        ready.push((w.flow, w.target));
                    }
                }
            }
        }
        // Managers become ready on their own schedule (a response lands, a
        // relay goes idle): check often while any migration waits.
        self.next_check = (!self.waiting.is_empty()).then(|| now + Duration::from_millis(1));
    }

    /// When the stack should poll again for waiting migrations.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.next_check
    }

    /// Phase 2 export: the manager's state appended to `out`. Without a
    /// manager: the state the connection was imported with, if the
    /// application has not taken it over yet (nothing was read since), else
    /// nothing. An error gives the migration up.
    pub fn export(&mut self, app: ConnId, out: &mut Vec<u8>) -> Result<(), String> {
        let Some(m) = self.conns.get_mut(&app) else {
            if let Some(state) = self.unclaimed.get(&app) {
                out.extend_from_slice(state);
            }
            return Ok(());
        };
        match m.prepare() {
            Readiness::Ready => m.export_state(out),
            r => {
                m.resume();
                Err(format!("connection manager not ready at export ({r:?})"))
            }
        }
    }

    /// The migration did not happen.
    pub fn resume(&mut self, app: ConnId) {
        if let Some(m) = self.conns.get_mut(&app) {
            m.resume();
        }
    }

    /// The connection left this host.
    pub fn gone(&mut self, app: ConnId) {
        // (`remove` hashes even on an empty map, `get` does not: these
        // maps are often empty, and SipHash costs ~100 instructions.)
        if !self.unclaimed.is_empty() {
            self.unclaimed.remove(&app);
        }
        if self.conns.is_empty() {
            return;
        }
        if let Some(mut m) = self.conns.remove(&app) {
            m.gone();
        }
    }

    /// Target: rebuilds the application state of the connection just
    /// imported as endpoint id `id` on service port `port`.
    pub fn import(&mut self, flow: FlowKey, id: ConnId, state: &[u8]) -> Result<(), String> {
        match self.importers.get(&flow.service_port) {
            Some(i) => {
                let v = i.import_state(flow, state)?;
                self.imported.insert(id, v);
                if !state.is_empty() {
                    self.unclaimed.insert(id, state.to_vec());
                }
                Ok(())
            }
            None if state.is_empty() => Ok(()),
            None => Err(format!(
                "{} bytes of application state but no importer on port {}",
                state.len(),
                flow.service_port
            )),
        }
    }

    fn take_imported(&mut self, id: ConnId) -> Option<Box<dyn Any>> {
        self.imported.remove(&id)
    }
}

/// Where an application handle's calls go now.
enum Target {
    Live(ConnId),
    /// Exported, outcome pending: calls block.
    Frozen,
    Gone(io::Error),
}

fn target(inner: &Inner, app: ConnId) -> Target {
    match inner.resolve(app) {
        HandleState::Live(id) => Target::Live(id),
        HandleState::Frozen => Target::Frozen,
        HandleState::Moved(t) => Target::Gone(io::Error::other(Moved(t))),
        HandleState::Lost => Target::Gone(io_error(TcpError::Reset)),
    }
}

#[derive(Clone, Copy)]
enum Dir {
    Read,
    Write,
}

fn park(inner: &mut Inner, app: ConnId, cx: &Context<'_>, dir: Dir) {
    let w = inner.wakers.entry(app).or_default();
    match dir {
        Dir::Read => w.read = Some(cx.waker().clone()),
        Dir::Write => w.write = Some(cx.waker().clone()),
    }
}

/// The endpoint id behind `app`, or the poll result to return now (parked
/// for `dir` while the connection is frozen mid-migration).
fn live_or_park<T>(
    inner: &mut Inner,
    app: ConnId,
    cx: &Context<'_>,
    dir: Dir,
) -> Result<ConnId, Poll<io::Result<T>>> {
    match target(inner, app) {
        Target::Live(id) => Ok(id),
        Target::Frozen => {
            park(inner, app, cx, dir);
            Err(Poll::Pending)
        }
        Target::Gone(e) => Err(Poll::Ready(Err(e))),
    }
}

/// Listens on a service address of the stack.
pub struct TcpListener {
    stack: Stack,
    local: SocketAddrV4,
}

impl TcpListener {
    /// Starts listening on `local` (a VIP and port).
    pub fn bind(stack: &Stack, local: SocketAddrV4) -> io::Result<TcpListener> {
        stack
            .with(|i| i.transports.tcp.listen(local))
            .map_err(io_error)?;
        Ok(TcpListener {
            stack: stack.clone(),
            local,
        })
    }

    pub fn local_addr(&self) -> SocketAddrV4 {
        self.local
    }

    /// The stack this listener lives on.
    pub fn stack(&self) -> &Stack {
        &self.stack
    }

    /// Registers the importer of migrated-in connections' application state
    /// for this listener's port (no-op without migration).
    pub fn set_importer(&self, importer: Rc<dyn StateImporter>) {
        let port = self.local.port();
        self.stack.with(|i| {
            if let Some(m) = &mut i.transports.mig {
                m.managers.set_importer(port, importer);
            }
        });
    }

    /// Waits for the next established connection (new, or migrated in).
    pub async fn accept(&self) -> io::Result<(TcpStream, SocketAddrV4)> {
        std::future::poll_fn(|cx| self.poll_accept(cx)).await
    }

    pub fn poll_accept(&self, cx: &mut Context<'_>) -> Poll<io::Result<(TcpStream, SocketAddrV4)>> {
        let mut inner = self.stack.inner.borrow_mut();
        let port = self.local.port();
        if let Some(id) = inner.accepted.get_mut(&port).and_then(|q| q.pop_front()) {
            inner.wakers.insert(id, Default::default());
            let peer = inner.transports.tcp.remote_addr(id).unwrap_or(self.local);
            let imported = inner
                .transports
                .mig
                .as_mut()
                .and_then(|m| m.managers.take_imported(id));
            drop(inner);
            return Poll::Ready(Ok((
                TcpStream {
                    stack: self.stack.clone(),
                    id,
                    imported,
                },
                peer,
            )));
        }
        inner.accept_wakers.insert(port, cx.waker().clone());
        Poll::Pending
    }
}

impl Drop for TcpListener {
    fn drop(&mut self) {
        let port = self.local.port();
        self.stack.with(|i| {
            i.transports.tcp.unlisten(port);
            i.accept_wakers.remove(&port);
            if let Some(m) = &mut i.transports.mig {
                m.managers.remove_importer(port);
            }
        });
    }
}

/// A connection on the user-space stack. Its handle stays valid across an
/// aborted migration (the connection resumes here under the same handle).
pub struct TcpStream {
    stack: Stack,
    id: ConnId,
    imported: Option<Box<dyn Any>>,
}

impl TcpStream {
    /// The application's handle of this connection.
    pub fn id(&self) -> ConnId {
        self.id
    }

    /// Registers this connection's manager (replacing any earlier one). A
    /// no-op on a stack without migration.
    pub fn set_manager(&self, manager: Box<dyn ConnectionManager>) {
        let app = self.id;
        self.stack.with(|i| {
            if let Some(m) = &mut i.transports.mig {
                m.managers.set(app, manager);
            }
        });
    }

    /// For a migrated-in connection, what the listener's [`StateImporter`]
    /// built from the origin's state (once; `None` for new connections).
    pub fn take_imported_state(&mut self) -> Option<Box<dyn Any>> {
        self.imported.take()
    }

    /// The stack this connection lives on.
    pub fn stack(&self) -> &Stack {
        &self.stack
    }

    fn live<R>(&self, f: impl FnOnce(&mut Inner, ConnId) -> io::Result<R>) -> io::Result<R> {
        let mut inner = self.stack.inner.borrow_mut();
        match target(&inner, self.id) {
            Target::Live(id) => f(&mut inner, id),
            Target::Frozen => Err(io_error(TcpError::WouldBlock)),
            Target::Gone(e) => Err(e),
        }
    }

    pub fn peer_addr(&self) -> io::Result<SocketAddrV4> {
        self.live(|i, id| {
            i.transports
                .tcp
                .remote_addr(id)
                .ok_or_else(|| io_error(TcpError::InvalidHandle))
        })
    }

    pub fn local_addr(&self) -> io::Result<SocketAddrV4> {
        self.live(|i, id| {
            i.transports
                .tcp
                .local_addr(id)
                .ok_or_else(|| io_error(TcpError::InvalidHandle))
        })
    }

    /// Non-blocking read: `Ok(0)` at end of stream, `WouldBlock` when empty.
    pub fn try_read(&self, buf: &mut [u8]) -> io::Result<usize> {
        self.live(|i, id| {
            let n = i.transports.tcp.recv(id, buf).map_err(io_error)?;
            if n > 0 {
                // Reading opens the window: the driver may owe an update.
                i.kick();
            }
            Ok(n)
        })
    }

    /// Non-blocking write: how many bytes fit, `WouldBlock` when none.
    pub fn try_write(&self, data: &[u8]) -> io::Result<usize> {
        self.live(|i, id| {
            let n = i.transports.tcp.send(id, data).map_err(io_error)?;
            if n > 0 {
                i.kick();
            }
            Ok(n)
        })
    }

    /// Sends FIN after queued data; reading stays possible.
    pub fn shutdown_write(&self) -> io::Result<()> {
        self.live(|i, id| {
            i.transports.tcp.shutdown(id).map_err(io_error)?;
            i.kick();
            Ok(())
        })
    }

    /// Waits until the send buffer has room and returns how many bytes fit:
    /// a write of at most that many bytes right after never blocks. With
    /// [`TcpStream::poll_read_some`] it lets an application move bytes
    /// without ever holding any outside the stack, so that a migration at
    /// any instant carries all of them in the connection snapshot.
    pub fn poll_send_capacity(&self, cx: &mut Context<'_>) -> Poll<io::Result<usize>> {
        let app = self.id;
        let mut inner = self.stack.inner.borrow_mut();
        let id = match live_or_park(&mut inner, app, cx, Dir::Write) {
            Ok(id) => id,
            Err(p) => return p,
        };
        let cap = inner.transports.tcp.config().tx_buffer;
        match inner.transports.tcp.info(id) {
            Some(info) if info.send_queue < cap => Poll::Ready(Ok(cap - info.send_queue)),
            Some(_) => {
                // Full: no short write happened, so ask for the wake-up.
                let _ = inner.transports.tcp.notify_writable(id);
                park(&mut inner, app, cx, Dir::Write);
                Poll::Pending
            }
            None => Poll::Ready(Err(io_error(TcpError::InvalidHandle))),
        }
    }

    /// Reads what is available into `buf` (at least one byte, or 0 at end of
    /// stream), waiting if nothing is.
    pub fn poll_read_some(&self, cx: &mut Context<'_>, buf: &mut [u8]) -> Poll<io::Result<usize>> {
        let mut rb = ReadBuf::new(buf);
        match poll_read_inner(&self.stack, self.id, cx, &mut rb) {
            Poll::Ready(Ok(())) => Poll::Ready(Ok(rb.filled().len())),
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => Poll::Pending,
        }
    }
}

fn poll_read_inner(
    stack: &Stack,
    app: ConnId,
    cx: &mut Context<'_>,
    buf: &mut ReadBuf<'_>,
) -> Poll<io::Result<()>> {
    let mut inner = stack.inner.borrow_mut();
    let id = match live_or_park(&mut inner, app, cx, Dir::Read) {
        Ok(id) => id,
        Err(p) => return p,
    };
    // Zero only what this read can fill: `initialize_unfilled` would
    // memset the caller's whole spare buffer (8 KiB+ for hyper) every read.
    // At least one byte (so that EOF and errors still surface), at most what
    // the buffer has room for.
    let queued = inner.transports.tcp.load(id).map_or(0, |l| l.recv_queue);
    let want = queued.max(1).min(buf.remaining());
    match inner
        .transports
        .tcp
        .recv(id, buf.initialize_unfilled_to(want))
    {
        Ok(n) => {
            buf.advance(n);
            if n > 0 {
                inner.kick();
            }
            Poll::Ready(Ok(()))
        }
        Err(TcpError::WouldBlock) => {
            park(&mut inner, app, cx, Dir::Read);
            Poll::Pending
        }
        Err(e) => Poll::Ready(Err(io_error(e))),
    }
}

impl Drop for TcpStream {
    fn drop(&mut self) {
        let app = self.id;
        let mut inner = self.stack.inner.borrow_mut();
        if let Target::Live(id) = target(&inner, app) {
            let flow = inner.transports.tcp.flow_key(id);
            let _ = inner.transports.tcp.close(id);
            if let Some(m) = &mut inner.transports.mig {
                m.untrack(flow, app);
            }
        } else if let Some(m) = &mut inner.transports.mig {
            m.untrack(None, app);
        }
        if let Some(m) = &mut inner.transports.mig {
            m.managers.remove(app);
        }
        inner.wakers.remove(&app);
        inner.kick();
    }
}

impl AsyncRead for TcpStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        poll_read_inner(&self.stack, self.id, cx, buf)
    }
}

impl AsyncWrite for TcpStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        if data.is_empty() {
            return Poll::Ready(Ok(0));
        }
        let app = self.id;
        let mut inner = self.stack.inner.borrow_mut();
        let id = match live_or_park(&mut inner, app, cx, Dir::Write) {
            Ok(id) => id,
            Err(p) => return p,
        };
        match inner.transports.tcp.send(id, data) {
            Ok(n) if n > 0 => {
                inner.kick();
                Poll::Ready(Ok(n))
            }
            Ok(_) | Err(TcpError::WouldBlock) => {
                park(&mut inner, app, cx, Dir::Write);
                Poll::Pending
            }
            Err(e) => Poll::Ready(Err(io_error(e))),
        }
    }

    /// Bytes handed to `write` are in the stack's send buffer, as with a
    /// kernel socket; there is nothing more to flush.
    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(self.shutdown_write())
    }
}
