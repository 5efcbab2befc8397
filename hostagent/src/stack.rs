//! The stack assembled: interface (Ethernet/ARP/IPv4/ICMP) + transports (TCP
//! endpoint) over one device, driven on a single thread.
//!
//! [`Transports`] adapts the sans-IO TCP endpoint to the interface's
//! `Transport` trait. [`Stack`] is the single-threaded runtime: the stack
//! state lives in an `Rc<RefCell<..>>` shared by the driver task and the
//! application's socket futures on the same `LocalSet`, so the per-packet
//! path takes no lock and makes no syscall beyond the device's batch, and an
//! application call (`read`, `write`) is a plain function call into the
//! endpoint. Wake-ups go both ways through wakers: the driver wakes socket
//! futures on TCP events, and socket calls that produce output wake the
//! driver.

use capybara_net::device::{Device, PollMode};
use capybara_net::driver::{self, Clock};
use capybara_net::iface::{Interface, Ipv4Out, Transport};
use capybara_proto::time::Instant;
use capybara_tcp::{ConnId, Endpoint, Event};
use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::net::Ipv4Addr;
use std::rc::Rc;
use std::task::Waker;

const IPPROTO_TCP: u8 = 6;

/// Everything above IP.
pub struct Transports {
    pub tcp: Endpoint,
}

impl Transport for Transports {
    fn handle_ipv4(&mut self, now: Instant, src: Ipv4Addr, dst: Ipv4Addr, protocol: u8, payload: &[u8]) {
        if protocol == IPPROTO_TCP {
            self.tcp.handle_segment(now, src, dst, payload);
        }
    }

    fn poll_ipv4(&mut self, now: Instant, buf: &mut [u8]) -> Option<Ipv4Out> {
        self.tcp
            .poll_transmit(now, buf)
            .map(|t| Ipv4Out { src: t.src, dst: t.dst, protocol: IPPROTO_TCP, len: t.len })
    }

    fn poll_timeout(&self) -> Option<Instant> {
        self.tcp.poll_timeout()
    }

    fn handle_timeout(&mut self, now: Instant) {
        self.tcp.handle_timeout(now);
    }
}

#[derive(Default)]
pub(crate) struct ConnWakers {
    pub read: Option<Waker>,
    pub write: Option<Waker>,
}

/// The shared state of the runtime.
pub struct Inner {
    pub iface: Interface,
    pub transports: Transports,
    pub device: Box<dyn Device>,
    pub clock: Clock,
    pub batch: usize,
    pub mode: PollMode,
    pub(crate) wakers: HashMap<ConnId, ConnWakers>,
    /// Accepted connections by local port, waiting for their listener.
    pub(crate) accepted: HashMap<u16, VecDeque<ConnId>>,
    pub(crate) accept_wakers: HashMap<u16, Waker>,
    /// Set by socket calls that may have produced output or window updates.
    pub(crate) needs_poll: bool,
    pub(crate) driver_waker: Option<Waker>,
    pub(crate) device_error: Option<String>,
}

impl Inner {
    /// Asks the driver to run soon (after a socket call changed state).
    pub(crate) fn kick(&mut self) {
        self.needs_poll = true;
        if let Some(w) = self.driver_waker.take() {
            w.wake();
        }
    }

    /// One device round trip plus event dispatch. Returns whether anything
    /// moved.
    pub(crate) fn poll_once(&mut self) -> bool {
        let now = self.clock.now();
        self.needs_poll = false;
        let r = match driver::poll(now, &mut self.iface, &mut *self.device, &mut self.transports, self.batch) {
            Ok(r) => r,
            Err(e) => {
                self.device_error = Some(e.to_string());
                return false;
            }
        };
        let mut events = false;
        while let Some(ev) = self.transports.tcp.poll_event() {
            events = true;
            self.dispatch(ev);
        }
        r.received > 0 || r.transmitted > 0 || events
    }

    fn dispatch(&mut self, ev: Event) {
        let wake = |w: &mut Option<Waker>| {
            if let Some(w) = w.take() {
                w.wake()
            }
        };
        match ev {
            Event::Accepted(_) => {
                while let Some(id) = self.transports.tcp.accept() {
                    let port = self.transports.tcp.local_addr(id).map_or(0, |a| a.port());
                    self.accepted.entry(port).or_default().push_back(id);
                    if let Some(w) = self.accept_wakers.remove(&port) {
                        w.wake();
                    }
                }
            }
            Event::Readable(id) => {
                if let Some(w) = self.wakers.get_mut(&id) {
                    wake(&mut w.read);
                }
            }
            Event::Writable(id) | Event::Connected(id) => {
                if let Some(w) = self.wakers.get_mut(&id) {
                    wake(&mut w.write);
                }
            }
            Event::Closed { id, .. } => {
                if let Some(w) = self.wakers.get_mut(&id) {
                    wake(&mut w.read);
                    wake(&mut w.write);
                }
            }
        }
    }
}

/// A handle on the single-threaded stack runtime. Cheap to clone; all clones
/// must stay on the thread that created it.
#[derive(Clone)]
pub struct Stack {
    pub(crate) inner: Rc<RefCell<Inner>>,
}

impl Stack {
    pub fn new(iface: Interface, tcp: Endpoint, device: Box<dyn Device>, mode: PollMode) -> Stack {
        Stack {
            inner: Rc::new(RefCell::new(Inner {
                iface,
                transports: Transports { tcp },
                device,
                clock: Clock::new(),
                batch: 32,
                mode,
                wakers: HashMap::with_capacity(1024),
                accepted: HashMap::new(),
                accept_wakers: HashMap::new(),
                needs_poll: true,
                driver_waker: None,
                device_error: None,
            })),
        }
    }

    /// Runs `f` with the stack state (for counters and configuration).
    pub fn with<R>(&self, f: impl FnOnce(&mut Inner) -> R) -> R {
        f(&mut self.inner.borrow_mut())
    }

    /// The driver: polls the device, fires timers, transmits, and wakes
    /// sockets. Runs until the device fails. In `Sleep` mode it waits on the
    /// device's descriptor, the next TCP/ARP deadline, or a socket call; in
    /// `BusyPoll` mode it yields to the application tasks between polls.
    pub async fn drive(self) -> Result<(), String> {
        let fd = self.inner.borrow().device.raw_fd();
        let mode = self.inner.borrow().mode;
        let afd = match (mode, fd) {
            (PollMode::Sleep, Some(fd)) => Some(
                tokio::io::unix::AsyncFd::with_interest(fd, tokio::io::Interest::READABLE)
                    .map_err(|e| format!("cannot register the device with the reactor: {e}"))?,
            ),
            _ => None,
        };
        loop {
            // Run until quiescent: a batch limit or freshly queued output
            // means there may be more to do right away.
            let mut rounds = 0;
            loop {
                let moved = self.inner.borrow_mut().poll_once();
                if let Some(e) = self.inner.borrow_mut().device_error.take() {
                    return Err(e);
                }
                rounds += 1;
                if !moved || rounds >= 64 {
                    break;
                }
                if rounds % 8 == 0 {
                    // Let socket futures consume what arrived.
                    tokio::task::yield_now().await;
                }
            }
            match &afd {
                None => {
                    tokio::task::yield_now().await;
                    if mode == PollMode::Sleep {
                        // A backend without a descriptor: nap briefly.
                        tokio::time::sleep(std::time::Duration::from_micros(50)).await;
                    }
                }
                Some(afd) => {
                    let deadline = {
                        let inner = self.inner.borrow();
                        inner.iface.poll_timeout(&inner.transports).map(|t| {
                            let now = inner.clock.now();
                            tokio::time::Instant::now()
                                + std::time::Duration::from_micros(t.as_micros().saturating_sub(now.as_micros()))
                        })
                    };
                    let wait = WaitKick { stack: &self.inner };
                    let sleep = async {
                        match deadline {
                            Some(d) => tokio::time::sleep_until(d).await,
                            None => std::future::pending::<()>().await,
                        }
                    };
                    tokio::select! {
                        r = afd.readable() => {
                            if let Ok(mut g) = r {
                                g.clear_ready();
                            }
                        }
                        _ = sleep => {}
                        _ = wait => {}
                    }
                }
            }
        }
    }
}

/// Completes when a socket call asked the driver to run.
struct WaitKick<'a> {
    stack: &'a Rc<RefCell<Inner>>,
}

impl std::future::Future for WaitKick<'_> {
    type Output = ();
    fn poll(self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<()> {
        let mut inner = self.stack.borrow_mut();
        if inner.needs_poll {
            std::task::Poll::Ready(())
        } else {
            inner.driver_waker = Some(cx.waker().clone());
            std::task::Poll::Pending
        }
    }
}
