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

use crate::migration::HandleState;
use crate::stack::{Inner, Stack};
use capybara_tcp::{ConnId, TcpError};
use std::io;
use std::net::SocketAddrV4;
use std::pin::Pin;
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
        HandleState::Moved(t) => Target::Gone(io::Error::new(io::ErrorKind::Other, Moved(t))),
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
            drop(inner);
            return Poll::Ready(Ok((
                TcpStream {
                    stack: self.stack.clone(),
                    id,
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
        });
    }
}

/// A connection on the user-space stack. Its handle stays valid across an
/// aborted migration (the connection resumes here under the same handle).
pub struct TcpStream {
    stack: Stack,
    id: ConnId,
}

impl TcpStream {
    /// The application's handle of this connection.
    pub fn id(&self) -> ConnId {
        self.id
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
    match inner.transports.tcp.recv(id, buf.initialize_unfilled()) {
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
