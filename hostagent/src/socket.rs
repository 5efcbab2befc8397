//! The socket-compatible API on the user-space stack: `TcpListener` and
//! `TcpStream`, with both a non-blocking call style (`try_read`,
//! `try_write`, errors as values) and tokio's `AsyncRead`/`AsyncWrite`, so
//! existing servers (hyper, tokio::io utilities) run on it unchanged.
//!
//! Errors map onto `std::io::ErrorKind` the way kernel sockets do: reset ->
//! `ConnectionReset`, timed out -> `TimedOut`, refused -> `ConnectionRefused`,
//! use after close -> `NotConnected`.

use crate::stack::{ConnWakers, Stack};
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

/// Listens on a service address of the stack.
pub struct TcpListener {
    stack: Stack,
    local: SocketAddrV4,
}

impl TcpListener {
    /// Starts listening on `local` (a VIP and port).
    pub fn bind(stack: &Stack, local: SocketAddrV4) -> io::Result<TcpListener> {
        stack.with(|i| i.transports.tcp.listen(local)).map_err(io_error)?;
        Ok(TcpListener { stack: stack.clone(), local })
    }

    pub fn local_addr(&self) -> SocketAddrV4 {
        self.local
    }

    /// Waits for the next established connection.
    pub async fn accept(&self) -> io::Result<(TcpStream, SocketAddrV4)> {
        std::future::poll_fn(|cx| self.poll_accept(cx)).await
    }

    pub fn poll_accept(&self, cx: &mut Context<'_>) -> Poll<io::Result<(TcpStream, SocketAddrV4)>> {
        let mut inner = self.stack.inner.borrow_mut();
        let port = self.local.port();
        if let Some(id) = inner.accepted.get_mut(&port).and_then(|q| q.pop_front()) {
            inner.wakers.insert(id, ConnWakers::default());
            let peer = inner.transports.tcp.remote_addr(id).unwrap_or(self.local);
            drop(inner);
            return Poll::Ready(Ok((TcpStream { stack: self.stack.clone(), id }, peer)));
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

/// A connection on the user-space stack.
pub struct TcpStream {
    stack: Stack,
    id: ConnId,
}

impl TcpStream {
    pub fn id(&self) -> ConnId {
        self.id
    }

    pub fn peer_addr(&self) -> io::Result<SocketAddrV4> {
        self.stack
            .with(|i| i.transports.tcp.remote_addr(self.id))
            .ok_or_else(|| io_error(TcpError::InvalidHandle))
    }

    pub fn local_addr(&self) -> io::Result<SocketAddrV4> {
        self.stack
            .with(|i| i.transports.tcp.local_addr(self.id))
            .ok_or_else(|| io_error(TcpError::InvalidHandle))
    }

    /// Non-blocking read: `Ok(0)` at end of stream, `WouldBlock` when empty.
    pub fn try_read(&self, buf: &mut [u8]) -> Result<usize, TcpError> {
        self.stack.with(|i| {
            let r = i.transports.tcp.recv(self.id, buf);
            if matches!(r, Ok(n) if n > 0) {
                // Reading opens the window: the driver may owe an update.
                i.kick();
            }
            r
        })
    }

    /// Non-blocking write: how many bytes fit, `WouldBlock` when none.
    pub fn try_write(&self, data: &[u8]) -> Result<usize, TcpError> {
        self.stack.with(|i| {
            let r = i.transports.tcp.send(self.id, data);
            if matches!(r, Ok(n) if n > 0) {
                i.kick();
            }
            r
        })
    }

    /// Sends FIN after queued data; reading stays possible.
    pub fn shutdown_write(&self) -> Result<(), TcpError> {
        self.stack.with(|i| {
            let r = i.transports.tcp.shutdown(self.id);
            i.kick();
            r
        })
    }
}

impl Drop for TcpStream {
    fn drop(&mut self) {
        let id = self.id;
        self.stack.with(|i| {
            let _ = i.transports.tcp.close(id);
            i.wakers.remove(&id);
            i.kick();
        });
    }
}

impl AsyncRead for TcpStream {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let id = self.id;
        let mut inner = self.stack.inner.borrow_mut();
        let r = inner.transports.tcp.recv(id, buf.initialize_unfilled());
        match r {
            Ok(n) => {
                buf.advance(n);
                if n > 0 {
                    inner.kick();
                }
                Poll::Ready(Ok(()))
            }
            Err(TcpError::WouldBlock) => {
                if let Some(w) = inner.wakers.get_mut(&id) {
                    w.read = Some(cx.waker().clone());
                }
                Poll::Pending
            }
            Err(e) => Poll::Ready(Err(io_error(e))),
        }
    }
}

impl AsyncWrite for TcpStream {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, data: &[u8]) -> Poll<io::Result<usize>> {
        if data.is_empty() {
            return Poll::Ready(Ok(0));
        }
        let id = self.id;
        let mut inner = self.stack.inner.borrow_mut();
        match inner.transports.tcp.send(id, data) {
            Ok(n) if n > 0 => {
                inner.kick();
                Poll::Ready(Ok(n))
            }
            Ok(_) | Err(TcpError::WouldBlock) => {
                if let Some(w) = inner.wakers.get_mut(&id) {
                    w.write = Some(cx.waker().clone());
                }
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
        Poll::Ready(self.shutdown_write().map_err(io_error))
    }
}
