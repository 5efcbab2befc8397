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

use crate::migration::{HandleState, Migrator, SegmentVerdict};
use capybara_net::device::{Device, DeviceError, PollMode};
use capybara_net::driver::{self, Clock};
use capybara_net::iface::{Interface, Ipv4Out, Transport};
use capybara_net::latency::LatencyHistogram;
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
    /// The server monitor (always on: heartbeats report its totals).
    pub monitor: crate::monitor::Monitor,
    /// The migration policies (with migration, unless switched off).
    pub policy: Option<crate::policy::PolicyRuntime>,
    /// The drain of this server (a bounded number of migrations at once).
    pub drain: crate::drain::Drainer,
    /// Connections of services whose application is down, migrating away
    /// (`crate::health`): a drain restricted to those services.
    pub health_drain: crate::drain::Drainer,
    /// The backend health checks (`crate::health`), for metrics.
    pub health: Option<Rc<crate::health::Board>>,
    /// Late segments forwarded to a migration's target (shared with the
    /// runtime's device wrapper, which copies and sends the frames).
    pub forwarder: Rc<RefCell<Forwarder>>,
}

impl Transports {
    pub fn new(tcp: Endpoint, local: Ipv4Addr) -> Transports {
        Transports {
            tcp,
            mig: None,
            vips: HashMap::new(),
            local,
            udp_drops: 0,
            monitor: crate::monitor::Monitor::new(capybara_proto::time::Duration::from_millis(50)),
            policy: None,
            drain: Default::default(),
            health_drain: crate::drain::Drainer::labelled(
                "health",
                crate::drain::DEFAULT_MAX_IN_FLIGHT,
            ),
            health: None,
            forwarder: Rc::new(RefCell::new(Forwarder::new(FORWARD_SLOTS))),
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
                // Invalid or unauthenticated messages are counted by the
                // engine; its events apply before the next packet.
                let _ = m.handle_message(now, src, &dgram[UDP_HEADER..len], &mut self.tcp);
            }
            (_, capybara_proto::ports::LOAD) => match &mut self.policy {
                // Malformed or stale notifications are counted by the policy.
                Some(p) => p.on_load_datagram(now, &dgram[UDP_HEADER..len]),
                None => self.udp_drops += 1,
            },
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
                // One flow key per segment, for the monitor and the migrator.
                let flow = self.flow_of(src, dst, payload);
                if let Some(flow) = &flow {
                    let data = crate::monitor::tcp_payload_len(payload);
                    self.monitor.on_segment(now, flow, data);
                }
                if let (Some(m), Some(flow)) = (self.mig.as_mut(), flow) {
                    match m.segment_verdict(now, flow, payload) {
                        SegmentVerdict::Process => {}
                        SegmentVerdict::Drop => return,
                        SegmentVerdict::Forward(target) => {
                            // The device wrapper copies the frame being
                            // received once this call returns.
                            self.forwarder.borrow_mut().pending = Some(target);
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
                if let Some(t) = m.poll_transmit(now, &mut buf[UDP_HEADER..]) {
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
        let mig = self.mig.as_ref().and_then(|m| {
            // Migrations waiting for a connection manager are re-checked too.
            match (m.engine.poll_timeout(), m.managers.poll_timeout()) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            }
        });
        let mig = match (mig, self.drain.poll_timeout()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        let mig = match (mig, self.health_drain.poll_timeout()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        match (tcp, mig) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    fn handle_timeout(&mut self, now: Instant) {
        self.tcp.handle_timeout(now);
        if let Some(m) = &mut self.mig {
            m.handle_timeout(now, &mut self.tcp);
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
    forwarder: Rc<RefCell<Forwarder>>,
    /// Why the driver woke up, and how late (debug counters, `/metrics`).
    pub wake: WakeStats,
    /// `Sleep` mode: while a migration awaits the peer's next TCPMig
    /// message, poll without sleeping for up to this long per message
    /// awaited (`[migration] reply_spin_us`; zero: never spin).
    pub reply_spin: std::time::Duration,
}

/// What ended the driver's sleeps in `Sleep` mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WakeReason {
    /// The device's descriptor became readable (frames in the ring).
    Device,
    /// The stack's next deadline.
    Timer,
    /// A socket call asked for a poll.
    Kick,
}

/// The driver's wake-ups: counts by reason, and for the device's wake-ups
/// the delay from the kernel queueing the first frame to the driver
/// handling it (from the device's frame timestamps). Recording is a few
/// integer operations per wake-up plus one clock reading per poll that
/// transmitted; nothing per packet, no allocation (fixed histograms).
#[derive(Debug, Default)]
pub struct WakeStats {
    pub by_device: u64,
    pub by_timer: u64,
    pub by_kick: u64,
    /// Frame queued by the kernel -> handled, first poll after a device
    /// wake-up only (the sleep-to-run path: kernel wake-up, scheduler,
    /// reactor, task).
    pub device_delay: LatencyHistogram,
    /// Poll start -> its transmit batch handed to the kernel, for polls
    /// that transmitted (what a frame's trip holds of its sender's poll;
    /// the driver's clock, 1 µs resolution).
    pub poll_to_tx: LatencyHistogram,
    /// Reply spins (`Inner::reply_spin`): time spent polling instead of
    /// sleeping, and how the spins ended: a TCPMig message arrived,
    /// something else moved (a frame, a timer, a socket call), or the
    /// window ran out.
    pub spin_ns: u64,
    pub spins_reply: u64,
    pub spins_other: u64,
    pub spins_expired: u64,
    /// Waits that did not spin because of the back-off.
    pub spins_skipped: u64,
    pending: Option<WakeReason>,
}

impl WakeStats {
    /// Prometheus text: wake-ups by reason, and as summaries (p50, p90,
    /// p99, in seconds) `capybara_driver_wake_delay_seconds` (after a device
    /// wake-up), `capybara_driver_poll_to_tx_seconds`, and the device's
    /// `capybara_rx_ring_delay_seconds` (every receive batch's first frame)
    /// and `capybara_tx_kick_seconds` when it measures them.
    pub fn render(
        &self,
        out: &mut String,
        labels: &str,
        ring: Option<&LatencyHistogram>,
        kick: Option<&LatencyHistogram>,
    ) {
        use std::fmt::Write;
        let _ = writeln!(out, "# TYPE capybara_driver_wakeups_total counter");
        for (reason, n) in [
            ("device", self.by_device),
            ("timer", self.by_timer),
            ("kick", self.by_kick),
        ] {
            let _ = writeln!(
                out,
                "capybara_driver_wakeups_total{{{labels},reason=\"{reason}\"}} {n}"
            );
        }
        let summary = |out: &mut String, name: &str, h: &LatencyHistogram| {
            let _ = writeln!(out, "# TYPE {name} summary");
            for q in ["0.5", "0.9", "0.99"] {
                if let Some(ns) = h.quantile_ns(q.parse().unwrap_or(0.5)) {
                    let _ = writeln!(
                        out,
                        "{name}{{{labels},quantile=\"{q}\"}} {:.7}",
                        ns as f64 / 1e9
                    );
                }
            }
            let _ = writeln!(out, "{name}_sum{{{labels}}} {:.6}", h.sum_ns() as f64 / 1e9);
            let _ = writeln!(out, "{name}_count{{{labels}}} {}", h.count());
        };
        summary(
            out,
            "capybara_driver_wake_delay_seconds",
            &self.device_delay,
        );
        summary(out, "capybara_driver_poll_to_tx_seconds", &self.poll_to_tx);
        let _ = writeln!(out, "# TYPE capybara_driver_spin_seconds_total counter");
        let _ = writeln!(
            out,
            "capybara_driver_spin_seconds_total{{{labels}}} {:.6}",
            self.spin_ns as f64 / 1e9
        );
        let _ = writeln!(out, "# TYPE capybara_driver_spins_total counter");
        for (outcome, n) in [
            ("reply", self.spins_reply),
            ("other", self.spins_other),
            ("expired", self.spins_expired),
            ("skipped", self.spins_skipped),
        ] {
            let _ = writeln!(
                out,
                "capybara_driver_spins_total{{{labels},outcome=\"{outcome}\"}} {n}"
            );
        }
        if let Some(h) = ring {
            summary(out, "capybara_rx_ring_delay_seconds", h);
        }
        if let Some(h) = kick {
            summary(out, "capybara_tx_kick_seconds", h);
        }
    }

    pub(crate) fn note(&mut self, reason: WakeReason) {
        match reason {
            WakeReason::Device => self.by_device += 1,
            WakeReason::Timer => self.by_timer += 1,
            WakeReason::Kick => self.by_kick += 1,
        }
        self.pending = Some(reason);
    }
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
        // Late segments leave through the gateway, like TCPMig messages.
        let gateway = self.iface.config().gateway;
        let mut device = ForwardingDevice {
            dev: &mut *self.device,
            fwd: &self.forwarder,
            mac: self.iface.mac().0,
            hop: NextHop {
                gateway_mac: self.iface.neighbor(gateway).map(|m| m.0),
                gateway,
                on_link: self.iface.config().on_link,
            },
        };
        let r = match driver::poll(
            now,
            &mut self.iface,
            &mut device,
            &mut self.transports,
            self.batch,
        ) {
            Ok(r) => r,
            Err(e) => {
                self.device_error = Some(e.to_string());
                return false;
            }
        };
        if r.transmitted > 0 {
            let ns = self.clock.now().saturating_since(now).as_nanos() as u64;
            self.wake.poll_to_tx.record_ns(ns);
        }
        if self.wake.pending.take() == Some(WakeReason::Device) && r.received > 0 {
            if let Some(ns) = self.device.rx_delay().map(|h| h.last_ns()) {
                self.wake.device_delay.record_ns(ns);
            }
        }
        let mut events = false;
        loop {
            let mut any = false;
            while let Some(ev) = self.transports.tcp.poll_event() {
                any = true;
                self.dispatch(ev);
            }
            if let Some(m) = &mut self.transports.mig {
                let mut woken = std::mem::take(&mut self.woken);
                let waited = m.managers.waited;
                m.clock = Some(self.clock);
                m.process_events(now, &mut self.transports.tcp, &mut woken);
                // A migration whose connection manager just became ready
                // queued its PREPARE: poll again now to send it, instead
                // of at the next packet or timer (an idle gap of up to the
                // engine's 1 ms retransmission timer per migration).
                any |= m.managers.waited != waited;
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
        if let (Some(p), Some(m)) = (&mut self.transports.policy, &mut self.transports.mig) {
            if p.due(now) {
                self.transports.monitor.refresh(&self.transports.tcp);
                if p.run(now, &self.transports.monitor, m) > 0 {
                    events = true;
                }
            }
        }
        if let Some(m) = &mut self.transports.mig {
            // The drain starts its next migrations as soon as earlier ones
            // finish (one branch when no drain is active).
            if self.transports.drain.poll(now, m) {
                events = true;
            }
            if self.transports.health_drain.poll(now, m) {
                events = true;
            }
        }
        // Forwarded frames beyond this batch go out in the next round.
        let forwarding = self.forwarder.borrow().queued > 0;
        r.received > 0 || r.transmitted > 0 || events || forwarding
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
                    let now = self.clock.now();
                    if let Some(m) = &mut self.transports.mig {
                        if let Some(app) = m.take_resumed(id) {
                            if let Some(flow) = self.transports.tcp.flow_key(id) {
                                self.transports.monitor.bind(now, flow, id, false);
                            }
                            self.wake_all(app);
                            continue;
                        }
                        if let Some(flow) = self.transports.tcp.flow_key(id) {
                            // Imported connections are served before accept.
                            let migrated_in = m.serves(&flow);
                            self.transports.monitor.bind(now, flow, id, migrated_in);
                            if let (true, Some(p)) = (migrated_in, &mut self.transports.policy) {
                                p.engine.note_moved(now, flow);
                            }
                            m.track(flow, id);
                        }
                    } else if let Some(flow) = self.transports.tcp.flow_key(id) {
                        self.transports.monitor.bind(now, flow, id, false);
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
        let forwarder = transports.forwarder.clone();
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
                forwarder,
                wake: WakeStats::default(),
                reply_spin: std::time::Duration::ZERO,
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
        let mut spin = SpinState::new();
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
                    if self.reply_spin(&mut spin).await? {
                        continue;
                    }
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
                    let reason = tokio::select! {
                        r = afd.readable() => {
                            if let Ok(mut g) = r {
                                g.clear_ready();
                            }
                            WakeReason::Device
                        }
                        _ = sleep => WakeReason::Timer,
                        _ = wait => WakeReason::Kick,
                    };
                    self.inner.borrow_mut().wake.note(reason);
                }
            }
        }
    }
}

/// The driver's reply spin: the message it spins for and the back-off
/// after spins the reply did not end.
struct SpinState {
    /// `Migrator::awaiting_peer` of the wait in progress.
    stamp: Option<u64>,
    /// When the first spin of that wait began.
    began: std::time::Instant,
    /// This wait spins (false: sat out by the back-off).
    spinning: bool,
    /// This wait's window ran out.
    expired: bool,
    /// Waits since the last reply that came during a spin (capped).
    misses: u32,
    /// Waits left to sit out.
    skip: u32,
}

/// At most 2^6 - 1 = 63 waits sat out after a run of expired spins.
const SPIN_BACKOFF_MAX: u32 = 6;

impl SpinState {
    fn new() -> SpinState {
        SpinState {
            stamp: None,
            began: std::time::Instant::now(),
            spinning: false,
            expired: false,
            misses: 0,
            skip: 0,
        }
    }

    /// A wait for `stamp` starts (the previous one, if any, ended with a
    /// TCPMig message): decides whether it spins.
    fn start(&mut self, stamp: u64, now: std::time::Instant) {
        self.stamp = Some(stamp);
        self.began = now;
        self.expired = false;
        if self.skip > 0 {
            self.skip -= 1;
            self.spinning = false;
        } else {
            self.spinning = true;
        }
    }

    /// A reply came during a spin: the back-off starts over.
    fn hit(&mut self) {
        self.misses = 0;
    }

    /// The window of a wait ran out: sit out the next 2^misses - 1 waits
    /// (a peer that answers late is often one that waits for this CPU).
    fn miss(&mut self) {
        self.expired = true;
        self.misses = (self.misses + 1).min(SPIN_BACKOFF_MAX);
        self.skip = (1 << self.misses) - 1;
    }
}

impl Stack {
    /// Before the driver sleeps: if a migration awaits the peer's next
    /// TCPMig message and `reply_spin` is set, polls the device without
    /// sleeping, letting the application tasks run between polls, until a
    /// poll moves something (`Ok(true)`: the driver polls on) or the
    /// window of the awaited message runs out (`Ok(false)`: it sleeps).
    /// The window counts from the first spin after the last TCPMig message
    /// sent or received, so one message awaited costs at most one window,
    /// and a host with no migration never spins. A window that runs out
    /// makes the next waits sleep at once (exponential back-off, reset by
    /// a reply that arrives during a spin): on a CPU the peer shares, the
    /// spin delays the very reply it waits for.
    async fn reply_spin(&self, st: &mut SpinState) -> Result<bool, String> {
        let (window, stamp) = {
            let inner = self.inner.borrow();
            if inner.reply_spin.is_zero() {
                return Ok(false);
            }
            let stamp = inner
                .transports
                .mig
                .as_ref()
                .and_then(Migrator::awaiting_peer);
            (inner.reply_spin, stamp)
        };
        let Some(stamp) = stamp else {
            st.stamp = None;
            return Ok(false);
        };
        let start = std::time::Instant::now();
        if st.stamp != Some(stamp) {
            st.start(stamp, start);
            if !st.spinning {
                self.inner.borrow_mut().wake.spins_skipped += 1;
            }
        }
        if !st.spinning || st.expired {
            return Ok(false);
        }
        let end = st.began + window;
        let outcome = loop {
            if std::time::Instant::now() >= end {
                break SpinEnd::Expired;
            }
            // The application tasks run here (and tokio looks at its
            // reactor without blocking).
            tokio::task::yield_now().await;
            let mut inner = self.inner.borrow_mut();
            let moved = inner.poll_once();
            if let Some(e) = inner.device_error.take() {
                return Err(e);
            }
            if moved {
                let now = inner
                    .transports
                    .mig
                    .as_ref()
                    .and_then(Migrator::awaiting_peer);
                break if now == Some(stamp) {
                    SpinEnd::Other
                } else {
                    SpinEnd::Reply
                };
            }
        };
        let mut inner = self.inner.borrow_mut();
        inner.wake.spin_ns += start.elapsed().as_nanos() as u64;
        match outcome {
            SpinEnd::Reply => {
                inner.wake.spins_reply += 1;
                st.hit();
            }
            SpinEnd::Other => inner.wake.spins_other += 1,
            SpinEnd::Expired => {
                inner.wake.spins_expired += 1;
                st.miss();
            }
        }
        Ok(outcome != SpinEnd::Expired)
    }
}

/// How a reply spin ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SpinEnd {
    /// A TCPMig message arrived (or a migration moved on).
    Reply,
    /// Something else moved (a frame, a timer, a socket call); the spin
    /// goes on after the driver has polled, within the same window.
    Other,
    /// The window ran out.
    Expired,
}

/// How the driver's thread asks the kernel's scheduler for prompt wake-ups
/// (`CAPYBARA_HOSTAGENT_SCHED`, read by the `hostagent` binary). A sleeping
/// driver is woken by the kernel when a frame lands in its ring; if the CPU
/// it is woken on runs another task (often the sender, still inside the
/// `sendto` that delivered the frame), the driver waits for that task's
/// slice to end. These settings shorten that wait without spinning.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DriverScheduling {
    /// Leave the thread as started.
    Inherit,
    /// SCHED_OTHER with a custom EEVDF slice (Linux >= 6.12; nanoseconds,
    /// the kernel clamps to 0.1-100 ms): an earlier virtual deadline, so a
    /// wake-up preempts a task with the default slice. Same CPU share, no
    /// privilege needed.
    Slice(u64),
    /// SCHED_FIFO at this priority (1-99; CAP_SYS_NICE): a wake-up preempts
    /// every normal task. The driver still sleeps when idle; the kernel's
    /// RT throttling (95% by default) bounds a runaway.
    Fifo(u8),
}

impl DriverScheduling {
    /// `inherit`, `slice=MICROSECONDS` or `fifo=PRIORITY`.
    pub fn parse(s: &str) -> Result<Self, String> {
        let bad = || {
            format!(
                "{s:?}: expected inherit, slice=MICROSECONDS (100-100000) or fifo=PRIORITY (1-99)"
            )
        };
        match s.split_once('=') {
            None if s == "inherit" => Ok(Self::Inherit),
            Some(("slice", v)) => match v.parse::<u64>() {
                Ok(us) if (100..=100_000).contains(&us) => Ok(Self::Slice(us * 1000)),
                _ => Err(bad()),
            },
            Some(("fifo", v)) => match v.parse::<u8>() {
                Ok(p) if (1..=99).contains(&p) => Ok(Self::Fifo(p)),
                _ => Err(bad()),
            },
            _ => Err(bad()),
        }
    }

    /// Applies the setting to the calling thread (threads it starts later
    /// inherit it).
    pub fn apply(self) -> std::io::Result<()> {
        /// `struct sched_attr` (SCHED_ATTR_SIZE_VER1).
        #[repr(C)]
        struct SchedAttr {
            size: u32,
            policy: u32,
            flags: u64,
            nice: i32,
            priority: u32,
            runtime: u64,
            deadline: u64,
            period: u64,
            util_min: u32,
            util_max: u32,
        }
        let (policy, priority, runtime) = match self {
            Self::Inherit => return Ok(()),
            Self::Slice(ns) => (libc::SCHED_OTHER as u32, 0, ns),
            Self::Fifo(p) => (libc::SCHED_FIFO as u32, u32::from(p), 0),
        };
        // SAFETY: getpriority has no memory arguments; errno is reset first
        // because -1 is also a valid nice value.
        let nice = unsafe {
            *libc::__errno_location() = 0;
            libc::getpriority(libc::PRIO_PROCESS, 0)
        };
        let attr = SchedAttr {
            size: std::mem::size_of::<SchedAttr>() as u32,
            policy,
            flags: 0,
            nice: if policy == libc::SCHED_OTHER as u32 {
                nice
            } else {
                0
            },
            priority,
            runtime,
            deadline: 0,
            period: 0,
            util_min: 0,
            util_max: 0,
        };
        // SAFETY: `attr` is a valid sched_attr of the size it declares; pid 0
        // is the calling thread.
        let r = unsafe { libc::syscall(libc::SYS_sched_setattr, 0, &attr as *const SchedAttr, 0) };
        if r == 0 {
            Ok(())
        } else {
            Err(std::io::Error::last_os_error())
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

/// Frames the forwarder holds at once (beyond: dropped and counted).
const FORWARD_SLOTS: usize = 32;
/// Bytes of one slot: a full 1500-byte IP packet and its Ethernet header.
const FORWARD_SLOT_LEN: usize = 1536;
const ETH_HEADER: usize = 14;

/// Late segments at the origin (docs/MIGRATION.md): the frames of segments
/// [`SegmentVerdict::Forward`]ed, rewritten for the migration's target and
/// queued for the next transmit batch. Slots are allocated once; the
/// per-packet path copies one frame and allocates nothing.
pub struct Forwarder {
    /// Set by [`Transports::handle_ipv4`] for the frame being received.
    pending: Option<Ipv4Addr>,
    frames: Vec<u8>,
    lens: Vec<usize>,
    head: usize,
    queued: usize,
    /// Segments sent on to a target.
    pub forwarded: u64,
    /// Not forwarded because their TTL would expire (a forwarding loop).
    pub ttl_drops: u64,
    /// Not forwarded: queue full, too long, malformed, or no gateway MAC.
    pub other_drops: u64,
}

impl Forwarder {
    fn new(slots: usize) -> Forwarder {
        Forwarder {
            pending: None,
            frames: vec![0; slots * FORWARD_SLOT_LEN],
            lens: vec![0; slots],
            head: 0,
            queued: 0,
            forwarded: 0,
            ttl_drops: 0,
            other_drops: 0,
        }
    }

    /// Copies `frame` (Ethernet + IPv4 + TCP, addressed to us) into a slot,
    /// rewritten for `target`: IPv4 destination (IP and TCP checksums
    /// updated incrementally), TTL decremented, Ethernet `src`/`dst`.
    fn push(&mut self, frame: &[u8], target: Ipv4Addr, src: [u8; 6], dst: Option<[u8; 6]>) {
        let Some(dst) = dst else {
            self.other_drops += 1;
            return;
        };
        let ip = match frame.get(ETH_HEADER..) {
            Some(ip) if ip.len() >= 20 && ip[0] >> 4 == 4 => ip,
            _ => {
                self.other_drops += 1;
                return;
            }
        };
        let ihl = usize::from(ip[0] & 0x0f) * 4;
        let total = usize::from(u16::from_be_bytes([ip[2], ip[3]]));
        if ihl < 20 || total < ihl + 20 || total > ip.len() || ETH_HEADER + total > FORWARD_SLOT_LEN
        {
            self.other_drops += 1;
            return;
        }
        if ip[8] <= 1 {
            self.ttl_drops += 1;
            return;
        }
        if self.queued == self.lens.len() {
            self.other_drops += 1;
            return;
        }
        let slot = (self.head + self.queued) % self.lens.len();
        let len = ETH_HEADER + total;
        let out = &mut self.frames[slot * FORWARD_SLOT_LEN..slot * FORWARD_SLOT_LEN + len];
        out.copy_from_slice(&frame[..len]);
        out[0..6].copy_from_slice(&dst);
        out[6..12].copy_from_slice(&src);
        let h = &mut out[ETH_HEADER..];
        let old_dst = u32::from_be_bytes([h[16], h[17], h[18], h[19]]);
        let new_dst = u32::from(target);
        // TTL (high byte of the TTL/protocol word) and destination.
        let old_word = u16::from_be_bytes([h[8], h[9]]);
        h[8] -= 1;
        let new_word = u16::from_be_bytes([h[8], h[9]]);
        let mut ip_sum = u16::from_be_bytes([h[10], h[11]]);
        ip_sum = checksum::update16(ip_sum, old_word, new_word);
        ip_sum = checksum::update32(ip_sum, old_dst, new_dst);
        h[10..12].copy_from_slice(&ip_sum.to_be_bytes());
        h[16..20].copy_from_slice(&target.octets());
        // The TCP checksum covers the destination through the pseudo-header.
        let tcp = &mut h[ihl..];
        let tcp_sum = u16::from_be_bytes([tcp[16], tcp[17]]);
        let tcp_sum = checksum::update32(tcp_sum, old_dst, new_dst);
        tcp[16..18].copy_from_slice(&tcp_sum.to_be_bytes());
        self.lens[slot] = len;
        self.queued += 1;
        self.forwarded += 1;
    }

    /// The target the transports asked the frame just received to be sent
    /// on to, taken (for a driver of [`Transports`] without the device
    /// wrapper, such as the migration test harness).
    pub fn take_pending(&mut self) -> Option<Ipv4Addr> {
        self.pending.take()
    }

    /// Moves the oldest queued frame into `buf`.
    fn pop_into(&mut self, buf: &mut [u8]) -> Option<usize> {
        if self.queued == 0 {
            return None;
        }
        let slot = self.head;
        let len = self.lens[slot];
        let out = buf.get_mut(..len)?;
        out.copy_from_slice(&self.frames[slot * FORWARD_SLOT_LEN..slot * FORWARD_SLOT_LEN + len]);
        self.head = (self.head + 1) % self.lens.len();
        self.queued -= 1;
        Some(len)
    }
}

/// The device as the driver sees it in [`Inner::poll_once`]: after each
/// received frame, copies it to the forwarder if the transports asked for
/// it; forwarded frames go first in the transmit batch (no extra syscall).
struct ForwardingDevice<'a> {
    dev: &'a mut dyn Device,
    fwd: &'a RefCell<Forwarder>,
    mac: [u8; 6],
    hop: NextHop,
}

/// What the interface's routing says about forwarded frames (copied before
/// the driver borrows the interface).
#[derive(Clone, Copy)]
struct NextHop {
    gateway_mac: Option<[u8; 6]>,
    gateway: Ipv4Addr,
    on_link: Option<(Ipv4Addr, u8)>,
}

impl NextHop {
    /// The Ethernet destination toward `target`: the gateway (the switch),
    /// as for TCPMig messages; an on-link target is not forwarded.
    fn mac_for(&self, target: Ipv4Addr) -> Option<[u8; 6]> {
        let on_link = match self.on_link {
            Some((_, 0)) => true,
            Some((net, len)) => {
                let mask = u32::MAX << (32 - u32::from(len.min(32)));
                u32::from(target) & mask == u32::from(net) & mask
            }
            None => false,
        };
        if on_link && target != self.gateway {
            return None;
        }
        self.gateway_mac
    }
}

impl Device for ForwardingDevice<'_> {
    fn receive(&mut self, max: usize, f: &mut dyn FnMut(&[u8])) -> Result<usize, DeviceError> {
        let (fwd, mac, hop) = (self.fwd, self.mac, self.hop);
        self.dev.receive(max, &mut |frame| {
            f(frame);
            let mut q = fwd.borrow_mut();
            if let Some(target) = q.pending.take() {
                q.push(frame, target, mac, hop.mac_for(target));
            }
        })
    }

    fn transmit(
        &mut self,
        max: usize,
        f: &mut dyn FnMut(&mut [u8]) -> Option<usize>,
    ) -> Result<usize, DeviceError> {
        let fwd = self.fwd;
        self.dev.transmit(max, &mut |buf| {
            let popped = fwd.borrow_mut().pop_into(buf);
            popped.or_else(|| f(buf))
        })
    }

    fn wait(&mut self, timeout: Option<capybara_proto::time::Duration>) -> Result<(), DeviceError> {
        self.dev.wait(timeout)
    }

    fn raw_fd(&self) -> Option<std::os::fd::RawFd> {
        self.dev.raw_fd()
    }

    fn mac(&self) -> Option<capybara_net::wire::EthernetAddress> {
        self.dev.mac()
    }

    fn rx_delay(&self) -> Option<&LatencyHistogram> {
        self.dev.rx_delay()
    }

    fn tx_kick(&self) -> Option<&LatencyHistogram> {
        self.dev.tx_kick()
    }

    fn max_frame_len(&self) -> usize {
        self.dev.max_frame_len()
    }
}

#[cfg(test)]
mod forward_tests {
    use super::*;

    /// An Ethernet + IPv4 + TCP frame from `src` to `dst`, checksums valid.
    fn frame(src: Ipv4Addr, dst: Ipv4Addr, ttl: u8) -> Vec<u8> {
        let payload = b"late";
        let total = 20 + 20 + payload.len();
        let mut f = vec![0u8; ETH_HEADER + total];
        f[12..14].copy_from_slice(&[0x08, 0x00]);
        let ip = &mut f[ETH_HEADER..];
        ip[0] = 0x45;
        ip[2..4].copy_from_slice(&(total as u16).to_be_bytes());
        ip[8] = ttl;
        ip[9] = IPPROTO_TCP;
        ip[12..16].copy_from_slice(&src.octets());
        ip[16..20].copy_from_slice(&dst.octets());
        let sum = checksum::checksum(&ip[..20]);
        ip[10..12].copy_from_slice(&sum.to_be_bytes());
        let tcp = &mut ip[20..];
        tcp[0..2].copy_from_slice(&40000u16.to_be_bytes());
        tcp[2..4].copy_from_slice(&80u16.to_be_bytes());
        tcp[12] = 5 << 4;
        tcp[13] = 0x18;
        tcp[20..].copy_from_slice(payload);
        let sum = checksum::transport(src, dst, IPPROTO_TCP, tcp);
        tcp[16..18].copy_from_slice(&sum.to_be_bytes());
        f
    }

    #[test]
    fn forwarded_frame_is_rewritten_with_valid_checksums() {
        let (client, origin, target) = (
            Ipv4Addr::new(10, 1, 0, 9),
            Ipv4Addr::new(10, 0, 0, 1),
            Ipv4Addr::new(10, 0, 0, 2),
        );
        let mut fw = Forwarder::new(2);
        let mut input = frame(client, origin, 63);
        input.extend_from_slice(&[0; 6]); // link padding is not forwarded
        fw.push(&input, target, [2; 6], Some([4; 6]));
        let mut buf = [0u8; 2048];
        let n = fw.pop_into(&mut buf).expect("queued");
        let out = &buf[..n];
        assert_eq!(n, input.len() - 6);
        assert_eq!((&out[0..6], &out[6..12]), (&[4u8; 6][..], &[2u8; 6][..]));
        let ip = &out[ETH_HEADER..];
        assert_eq!(ip[8], 62);
        assert_eq!(&ip[16..20], &target.octets());
        assert_eq!(checksum::checksum(&ip[..20]), 0);
        assert_eq!(
            checksum::transport(client, target, IPPROTO_TCP, &ip[20..]),
            0
        );
        assert_eq!(fw.forwarded, 1);
        assert!(fw.pop_into(&mut buf).is_none());
    }

    #[test]
    fn ttl_queue_and_route_bound_forwarding() {
        let (client, origin, target) = (
            Ipv4Addr::new(10, 1, 0, 9),
            Ipv4Addr::new(10, 0, 0, 1),
            Ipv4Addr::new(10, 0, 0, 2),
        );
        let mut fw = Forwarder::new(2);
        fw.push(&frame(client, origin, 1), target, [2; 6], Some([4; 6]));
        assert_eq!((fw.ttl_drops, fw.queued), (1, 0));
        fw.push(&frame(client, origin, 64), target, [2; 6], None);
        assert_eq!(fw.other_drops, 1);
        for _ in 0..3 {
            fw.push(&frame(client, origin, 64), target, [2; 6], Some([4; 6]));
        }
        assert_eq!((fw.queued, fw.forwarded, fw.other_drops), (2, 2, 2));
        fw.push(&[0u8; 20], target, [2; 6], Some([4; 6]));
        assert_eq!(fw.other_drops, 3);
        let hop = NextHop {
            gateway_mac: Some([4; 6]),
            gateway: Ipv4Addr::new(10, 0, 0, 254),
            on_link: None,
        };
        assert_eq!(hop.mac_for(target), Some([4; 6]));
        let on_link = NextHop {
            on_link: Some((Ipv4Addr::new(10, 0, 0, 0), 24)),
            ..hop
        };
        assert_eq!(on_link.mac_for(target), None);
    }
}

#[cfg(test)]
mod sched_tests {
    use super::{DriverScheduling, SpinState};

    #[test]
    fn driver_scheduling_parses_and_rejects() {
        assert_eq!(
            DriverScheduling::parse("inherit"),
            Ok(DriverScheduling::Inherit)
        );
        assert_eq!(
            DriverScheduling::parse("slice=100"),
            Ok(DriverScheduling::Slice(100_000))
        );
        assert_eq!(
            DriverScheduling::parse("fifo=10"),
            Ok(DriverScheduling::Fifo(10))
        );
        for bad in [
            "", "fifo", "fifo=0", "fifo=100", "slice=99", "slice=x", "rr=5",
        ] {
            assert!(DriverScheduling::parse(bad).is_err(), "{bad:?}");
        }
        // Inherit changes nothing and cannot fail.
        assert!(DriverScheduling::Inherit.apply().is_ok());
    }

    #[test]
    fn reply_spin_backs_off_after_expired_windows() {
        let now = std::time::Instant::now();
        let mut st = SpinState::new();
        st.start(1, now);
        assert!(st.spinning);
        // Expired windows: sit out 1, then 3, ... then 63 waits.
        let mut sat_out = Vec::new();
        for stamp in 2..9 {
            st.miss();
            let mut n = 0;
            let mut next = stamp * 100;
            loop {
                st.start(next, now);
                if st.spinning {
                    break;
                }
                n += 1;
                next += 1;
            }
            sat_out.push(n);
        }
        assert_eq!(sat_out, [1, 3, 7, 15, 31, 63, 63]);
        // A reply during a spin starts over: the next miss sits out one.
        st.hit();
        st.miss();
        st.start(10_000, now);
        assert!(!st.spinning);
        st.start(10_001, now);
        assert!(st.spinning && !st.expired);
    }
}
