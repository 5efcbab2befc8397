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

use crate::migration::{HandleState, Migrator};
use capybara_net::device::{Device, PollMode};
use capybara_net::driver::{self, Clock};
use capybara_net::iface::{Interface, Ipv4Out, Transport};
use capybara_proto::checksum;
use capybara_proto::time::Instant;
use capybara_proto::FlowKey;
use capybara_tcp::{ConnId, Endpoint, Event};
use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::net::Ipv4Addr;
use std::rc::Rc;
use std::task::Waker;

const IPPROTO_TCP: u8 = 6;
const IPPROTO_UDP: u8 = 17;
const UDP_HEADER: usize = 8;

/// Everything above IP: the TCP endpoint and, when migration is configured,
/// the TCPMig engine on UDP port 7690.
pub struct Transports {
    pub tcp: Endpoint,
    pub mig: Option<Migrator>,
    /// Service VIP by port: segments arrive addressed to our data address
    /// (the switch rewrote the VIP), but flows are named by the VIP.
    pub vips: HashMap<u16, Ipv4Addr>,
    /// Our data address (source of TCPMig datagrams).
    pub local: Ipv4Addr,
    /// UDP datagrams dropped: malformed, bad checksum, or no handler.
    pub udp_drops: u64,
}

impl Transports {
    pub fn new(tcp: Endpoint, local: Ipv4Addr) -> Transports {
        Transports {
            tcp,
            mig: None,
            vips: HashMap::new(),
            local,
            udp_drops: 0,
        }
    }

    /// The flow a TCP segment from `src` belongs to (None if too short).
    fn flow_of(&self, src: Ipv4Addr, dst: Ipv4Addr, segment: &[u8]) -> Option<FlowKey> {
        let h = segment.get(..4)?;
        let service_port = u16::from_be_bytes([h[2], h[3]]);
        Some(FlowKey {
            client_ip: src,
            client_port: u16::from_be_bytes([h[0], h[1]]),
            service_ip: self.vips.get(&service_port).copied().unwrap_or(dst),
            service_port,
        })
    }

    fn handle_udp(&mut self, now: Instant, src: Ipv4Addr, dst: Ipv4Addr, dgram: &[u8]) {
        let Some(h) = dgram.get(..UDP_HEADER) else {
            self.udp_drops += 1;
            return;
        };
        let len = usize::from(u16::from_be_bytes([h[4], h[5]]));
        let sum = u16::from_be_bytes([h[6], h[7]]);
        if len < UDP_HEADER
            || len > dgram.len()
            || (sum != 0 && checksum::transport(src, dst, IPPROTO_UDP, &dgram[..len]) != 0)
        {
            self.udp_drops += 1;
            return;
        }
        let port = u16::from_be_bytes([h[2], h[3]]);
        match (&mut self.mig, port) {
            (Some(m), capybara_proto::ports::TCPMIG) => {
                // Invalid or unauthenticated messages are counted by the engine.
                let _ = m.engine.handle_message(now, src, &dgram[UDP_HEADER..len]);
            }
            _ => self.udp_drops += 1,
        }
    }
}

impl Transport for Transports {
    fn handle_ipv4(
        &mut self,
        now: Instant,
        src: Ipv4Addr,
        dst: Ipv4Addr,
        protocol: u8,
        payload: &[u8],
    ) {
        match protocol {
            IPPROTO_TCP => {
                if self.mig.is_some() {
                    if let Some(flow) = self.flow_of(src, dst, payload) {
                        let m = self.mig.as_mut().expect("checked above");
                        if !m.filter_segment(now, flow, payload) {
                            return;
                        }
                    }
                }
                self.tcp.handle_segment(now, src, dst, payload);
            }
            IPPROTO_UDP => self.handle_udp(now, src, dst, payload),
            _ => {}
        }
    }

    fn poll_ipv4(&mut self, now: Instant, buf: &mut [u8]) -> Option<Ipv4Out> {
        // Migration messages first: they are few, small, and every
        // microsecond they wait is a microsecond of buffered client traffic.
        if let Some(m) = &mut self.mig {
            if buf.len() > UDP_HEADER {
                if let Some(t) = m.engine.poll_transmit(now, &mut buf[UDP_HEADER..]) {
                    let len = UDP_HEADER + t.len;
                    let port = capybara_proto::ports::TCPMIG.to_be_bytes();
                    buf[0..2].copy_from_slice(&port);
                    buf[2..4].copy_from_slice(&port);
                    buf[4..6].copy_from_slice(&(len as u16).to_be_bytes());
                    buf[6..8].copy_from_slice(&[0, 0]);
                    let mut sum = checksum::transport(self.local, t.dst, IPPROTO_UDP, &buf[..len]);
                    if sum == 0 {
                        sum = 0xffff;
                    }
                    buf[6..8].copy_from_slice(&sum.to_be_bytes());
                    return Some(Ipv4Out {
                        src: self.local,
                        dst: t.dst,
                        protocol: IPPROTO_UDP,
                        len,
                    });
                }
            }
        }
        self.tcp.poll_transmit(now, buf).map(|t| Ipv4Out {
            src: t.src,
            dst: t.dst,
            protocol: IPPROTO_TCP,
            len: t.len,
        })
    }

    fn poll_timeout(&self) -> Option<Instant> {
        let tcp = self.tcp.poll_timeout();
        let mig = self.mig.as_ref().and_then(|m| m.engine.poll_timeout());
        match (tcp, mig) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    fn handle_timeout(&mut self, now: Instant) {
        self.tcp.handle_timeout(now);
        if let Some(m) = &mut self.mig {
            m.engine.handle_timeout(now);
        }
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
    woken: Vec<ConnId>,
}

impl Inner {
    /// Asks the driver to run soon (after a socket call changed state).
    pub fn kick(&mut self) {
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
        let r = match driver::poll(
            now,
            &mut self.iface,
            &mut *self.device,
            &mut self.transports,
            self.batch,
        ) {
            Ok(r) => r,
            Err(e) => {
                self.device_error = Some(e.to_string());
                return false;
            }
        };
        let mut events = false;
        loop {
            let mut any = false;
            while let Some(ev) = self.transports.tcp.poll_event() {
                any = true;
                self.dispatch(ev);
            }
            if let Some(m) = &mut self.transports.mig {
                let mut woken = std::mem::take(&mut self.woken);
                m.process_events(now, &mut self.transports.tcp, &mut woken);
                for id in woken.drain(..) {
                    any = true;
                    self.wake_all(id);
                }
                self.woken = woken;
            }
            if !any {
                break;
            }
            events = true;
        }
        r.received > 0 || r.transmitted > 0 || events
    }

    fn wake_all(&mut self, app_id: ConnId) {
        if let Some(w) = self.wakers.get_mut(&app_id) {
            if let Some(w) = w.read.take() {
                w.wake();
            }
            if let Some(w) = w.write.take() {
                w.wake();
            }
        }
    }

    /// The application handle an endpoint id belongs to (they differ only
    /// for connections resumed after an aborted migration).
    fn app_id(&self, id: ConnId) -> ConnId {
        self.transports
            .mig
            .as_ref()
            .map_or(id, |m| m.app_handle(id))
    }

    /// The endpoint id behind an application handle, or why there is none.
    pub(crate) fn resolve(&self, app_id: ConnId) -> HandleState {
        self.transports
            .mig
            .as_ref()
            .map_or(HandleState::Live(app_id), |m| m.handle(app_id))
    }

    fn dispatch(&mut self, ev: Event) {
        match ev {
            Event::Accepted(_) => {
                while let Some(id) = self.transports.tcp.accept() {
                    if let Some(m) = &mut self.transports.mig {
                        if let Some(app) = m.take_resumed(id) {
                            self.wake_all(app);
                            continue;
                        }
                        if let Some(flow) = self.transports.tcp.flow_key(id) {
                            m.track(flow, id);
                        }
                    }
                    let port = self.transports.tcp.local_addr(id).map_or(0, |a| a.port());
                    self.accepted.entry(port).or_default().push_back(id);
                    if let Some(w) = self.accept_wakers.remove(&port) {
                        w.wake();
                    }
                }
            }
            Event::Readable(id) => {
                let app = self.app_id(id);
                if let Some(w) = self.wakers.get_mut(&app).and_then(|w| w.read.take()) {
                    w.wake();
                }
            }
            Event::Writable(id) | Event::Connected(id) => {
                let app = self.app_id(id);
                if let Some(w) = self.wakers.get_mut(&app).and_then(|w| w.write.take()) {
                    w.wake();
                }
            }
            Event::Closed { id, .. } => {
                let app = self.app_id(id);
                self.wake_all(app);
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
    pub fn new(
        iface: Interface,
        transports: Transports,
        device: Box<dyn Device>,
        mode: PollMode,
    ) -> Stack {
        Stack {
            inner: Rc::new(RefCell::new(Inner {
                iface,
                transports,
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
                woken: Vec::with_capacity(64),
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
                // SAFETY: the descriptor belongs to `self.inner.device`, which
                // lives as long as this driver (the stack is never dropped
                // while `drive` runs), so it stays open while registered.
                unsafe {
                    tokio::io::unix::AsyncFd::register_with_interest(
                        fd,
                        tokio::io::Interest::READABLE,
                    )
                }
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
                                + std::time::Duration::from_micros(
                                    t.as_micros().saturating_sub(now.as_micros()),
                                )
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
    fn poll(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<()> {
        let mut inner = self.stack.borrow_mut();
        if inner.needs_poll {
            std::task::Poll::Ready(())
        } else {
            inner.driver_waker = Some(cx.waker().clone());
            std::task::Poll::Pending
        }
    }
}
