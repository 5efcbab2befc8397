//! The server monitor (seed 000 §3.3, §5): per-connection packets per
//! second over a sliding window, receive- and send-queue lengths, and the
//! server's totals, for the migration policies and the heartbeat.
//!
//! A connection's rate counts *request packets*: segments that carry data
//! (the switch's pool monitor counts the same, docs/POLICIES.md "Load").
//! Bare ACKs are left out: a busy request/response connection piggybacks
//! its ACKs on the next request (about one packet per request) while a
//! light one sends a separate ACK per response (two), so counting every
//! packet made light connections look up to twice as heavy as busy ones
//! and a server holding the busy ones look less loaded than it was.
//!
//! Costs, by design:
//! - per received TCP segment ([`Monitor::on_segment`]): one hash lookup by
//!   flow and a few additions; no allocation (slots and the dirty list are
//!   sized when a connection is bound, never on the packet path);
//! - per refresh ([`Monitor::refresh`]): at most [`REFRESH_BUDGET`] slots
//!   of the current *pass* plus a bounded sweep of [`SWEEP_PER_REFRESH`]
//!   slots, whatever the number of connections, and no allocation. A pass
//!   re-reads the connections that received a segment or had a non-empty
//!   receive queue when it started; when more are active than one refresh
//!   may look at, the pass is spread over several refreshes (the cadence
//!   adapts: totals then lag by `active / REFRESH_BUDGET` refreshes instead
//!   of one refresh stalling the stack). Idle connections cost nothing, so
//!   100,000 mostly idle connections are cheap to watch;
//! - per policy decision ([`Monitor::connections`]): O(connections).
//!
//! Rates use a two-bucket sliding window: the count of the current bucket
//! plus the previous bucket's count weighted by how much of it still lies
//! in the window. O(1) to update and to read, 16 bytes per connection.
//!
//! Receive-queue backlog is reported in bytes and in *packets*: the paper's
//! RQLEN. A stream has no packet boundaries once queued, so packets are
//! estimated per connection as `ceil(queued bytes / mean data-segment
//! payload)` of that connection (a request per segment gives the number of
//! queued requests).
//!
//! Invariants: a slot is bound to one flow and one endpoint connection; the
//! totals equal the sum of the slots' last refreshed values (mid-pass some
//! slots are one pass older than others); a slot whose
//! connection left the endpoint (closed, exported) is released at the next
//! refresh that looks at it.

use capybara_proto::time::{Duration, Instant};
use capybara_proto::FlowKey;
use capybara_tcp::{ConnId, Endpoint};
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// Slots checked for staleness per refresh, whatever their activity.
pub const SWEEP_PER_REFRESH: usize = 64;

/// Most active slots one refresh re-reads (default of
/// [`Monitor::set_refresh_budget`]). A re-read costs ~100 ns when the
/// connection is in cache and ~300 ns when it is not (a lookup in the
/// endpoint and the connection's queue lengths): 2,048 keeps one refresh
/// under ~0.6 ms, while a pool of up to 2,048 active connections is still
/// re-read in full at every refresh.
pub const REFRESH_BUDGET: usize = 2048;

/// A two-bucket sliding-window counter.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Window {
    bucket: u64,
    cur: u32,
    prev: u32,
}

impl Window {
    /// Counts `n` events at `now_us`, buckets `width_us` wide.
    #[inline]
    pub fn add(&mut self, now_us: u64, width_us: u64, n: u32) {
        let b = now_us / width_us;
        if b != self.bucket {
            self.prev = if b == self.bucket + 1 { self.cur } else { 0 };
            self.cur = 0;
            self.bucket = b;
        }
        self.cur = self.cur.saturating_add(n);
    }

    /// Events per second over the last window ending at `now_us`.
    pub fn rate(&self, now_us: u64, width_us: u64) -> f64 {
        let b = now_us / width_us;
        let (cur, prev) = if b == self.bucket {
            (self.cur, self.prev)
        } else if b == self.bucket + 1 {
            (0, self.cur)
        } else {
            (0, 0)
        };
        let into = (now_us % width_us) as f64 / width_us as f64;
        let count = f64::from(cur) + f64::from(prev) * (1.0 - into);
        count * 1e6 / width_us as f64
    }
}

/// One watched connection.
#[derive(Debug, Clone)]
struct Slot {
    flow: FlowKey,
    conn: ConnId,
    used: bool,
    /// In the dirty list iff equal to the monitor's `dirty_epoch` (a
    /// segment arrived since the current pass started). An epoch, not a
    /// flag, so that starting a pass unlists every slot in O(1) and a slot
    /// is never listed twice (which would break the lists' sizing).
    dirty_epoch: u64,
    pps: Window,
    data_segments: u64,
    data_bytes: u64,
    /// `data_bytes` at the last re-read (what arrived since is new).
    seen_bytes: u64,
    rq_bytes: u32,
    rq_packets: u32,
    tq_bytes: u32,
    bound_at: Instant,
    migrated_in: bool,
}

/// One connection as the policies see it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ConnSample {
    pub flow: FlowKey,
    /// Request packets (segments carrying data) per second received over
    /// the window.
    pub pps: f64,
    /// Receive-queue backlog, estimated packets and bytes.
    pub rq_packets: u32,
    pub rq_bytes: u32,
    /// Send queue (unacknowledged included), bytes.
    pub tq_bytes: u32,
    /// How long the connection has been served here.
    pub age: Duration,
    /// It arrived here by migration (not by a handshake).
    pub migrated_in: bool,
}

/// The server's totals.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ServerLoad {
    /// Every TCP segment the stack received, per second, over the window.
    pub pps: f64,
    pub connections: usize,
    pub rx_backlog_packets: u64,
    pub rx_backlog_bytes: u64,
    pub tx_queue_bytes: u64,
    /// Since the monitor started: data packets received on watched
    /// connections, and the application's consumption of receive queues in
    /// packets (bytes consumed over the mean data-segment payload). Backlog
    /// that arrived with a migrated-in connection is neither (the policy
    /// tells a server that drains its backlog from one that cannot keep
    /// up by their rates).
    pub rx_arrived_packets: u64,
    pub rx_drained_packets: u64,
}

/// Counters of the monitor's own work.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MonitorStats {
    pub segments: u64,
    pub refreshes: u64,
    /// Slots looked at by refreshes (dirty, backlogged, swept).
    pub refreshed_slots: u64,
    pub released: u64,
    /// Passes completed (every active slot re-read once).
    pub passes: u64,
    /// Refreshes the last completed pass took (1 while the active
    /// connections fit the budget).
    pub last_pass_refreshes: u64,
}

/// A fast hasher for flow keys (FxHash's multiply-rotate): flow keys are
/// chosen by clients, but a collision only costs a longer probe here, and
/// the map is bounded by connections the endpoint accepted.
#[derive(Default, Clone, Copy)]
pub struct FlowHasher(u64);

impl Hasher for FlowHasher {
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut b = [0u8; 8];
            b[..chunk.len()].copy_from_slice(chunk);
            self.write_u64(u64::from_le_bytes(b));
        }
    }
    #[inline]
    fn write_u64(&mut self, v: u64) {
        self.0 = (self.0.rotate_left(5) ^ v).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }
    #[inline]
    fn write_u32(&mut self, v: u32) {
        self.write_u64(u64::from(v));
    }
    #[inline]
    fn write_u16(&mut self, v: u16) {
        self.write_u64(u64::from(v));
    }
    #[inline]
    fn write_u8(&mut self, v: u8) {
        self.write_u64(u64::from(v));
    }
    #[inline]
    fn finish(&self) -> u64 {
        self.0
    }
}

type FlowMap<V> = HashMap<FlowKey, V, BuildHasherDefault<FlowHasher>>;

pub struct Monitor {
    width_us: u64,
    index: FlowMap<u32>,
    slots: Vec<Slot>,
    free: Vec<u32>,
    dirty: Vec<u32>,
    dirty_epoch: u64,
    backlogged: Vec<u32>,
    /// The current pass: slots to re-read, `pass[cursor..]` still to do.
    pass: Vec<u32>,
    cursor: usize,
    pass_refreshes: u64,
    budget: usize,
    sweep: usize,
    total: Window,
    rx_backlog_packets: u64,
    rx_backlog_bytes: u64,
    tx_queue_bytes: u64,
    /// Data segments and payload bytes received on watched connections,
    /// and receive-queue bytes the application consumed (see
    /// [`ServerLoad::rx_drained_packets`]).
    data_segments: u64,
    data_bytes: u64,
    drained_bytes: u64,
    pub stats: MonitorStats,
}

impl Monitor {
    /// A monitor whose rates cover `window` (split into two buckets).
    pub fn new(window: Duration) -> Monitor {
        let width_us = (window.as_micros() as u64 / 2).max(1);
        Monitor {
            width_us,
            index: FlowMap::with_capacity_and_hasher(1024, Default::default()),
            slots: Vec::with_capacity(1024),
            free: Vec::new(),
            dirty: Vec::with_capacity(1024),
            dirty_epoch: 1,
            backlogged: Vec::with_capacity(1024),
            pass: Vec::with_capacity(1024),
            cursor: 0,
            pass_refreshes: 0,
            budget: REFRESH_BUDGET,
            sweep: 0,
            total: Window::default(),
            rx_backlog_packets: 0,
            rx_backlog_bytes: 0,
            tx_queue_bytes: 0,
            data_segments: 0,
            data_bytes: 0,
            drained_bytes: 0,
            stats: MonitorStats::default(),
        }
    }

    /// Most active slots one [`refresh`](Monitor::refresh) re-reads (at
    /// least 1).
    pub fn set_refresh_budget(&mut self, slots: usize) {
        self.budget = slots.max(1);
    }

    /// Watched connections.
    pub fn len(&self) -> usize {
        self.index.len()
    }

    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    /// A connection is served here from now on (accepted, imported, or
    /// resumed under a new endpoint id). Allocates only when the number of
    /// connections reaches a new high.
    pub fn bind(&mut self, now: Instant, flow: FlowKey, conn: ConnId, migrated_in: bool) {
        if let Some(&i) = self.index.get(&flow) {
            let s = &mut self.slots[i as usize];
            s.conn = conn;
            s.migrated_in = migrated_in;
            s.bound_at = now;
            return;
        }
        let mut slot = Slot {
            flow,
            conn,
            used: true,
            dirty_epoch: 0,
            pps: Window::default(),
            data_segments: 0,
            data_bytes: 0,
            seen_bytes: 0,
            rq_bytes: 0,
            rq_packets: 0,
            tq_bytes: 0,
            bound_at: now,
            migrated_in,
        };
        let i = match self.free.pop() {
            Some(i) => {
                // A released slot may still be listed: keep its mark.
                slot.dirty_epoch = self.slots[i as usize].dirty_epoch;
                self.slots[i as usize] = slot;
                i
            }
            None => {
                self.slots.push(slot);
                (self.slots.len() - 1) as u32
            }
        };
        self.index.insert(flow, i);
        // Each slot is listed at most once in each list: reserving to the
        // slot count keeps pushes on the packet path allocation-free.
        let n = self.slots.len();
        for v in [&mut self.dirty, &mut self.backlogged, &mut self.pass] {
            if v.capacity() < n {
                v.reserve(n - v.len());
            }
        }
    }

    /// One received TCP segment (`payload` bytes of data). O(1), no
    /// allocation.
    #[inline]
    pub fn on_segment(&mut self, now: Instant, flow: &FlowKey, payload: usize) {
        let now_us = now.as_micros();
        self.stats.segments += 1;
        // The server's load is request packets, as a connection's rate and
        // the switch's pool monitor count (bare ACKs and handshakes are
        // not load): what the heartbeat reports as `load_pps`.
        if payload > 0 {
            self.total.add(now_us, self.width_us, 1);
        }
        let Some(&i) = self.index.get(flow) else {
            return; // data of a connection not watched: in the total only
        };
        let s = &mut self.slots[i as usize];
        if payload > 0 {
            s.pps.add(now_us, self.width_us, 1);
            s.data_segments += 1;
            s.data_bytes += payload as u64;
            self.data_segments += 1;
            self.data_bytes += payload as u64;
        }
        if s.dirty_epoch != self.dirty_epoch {
            s.dirty_epoch = self.dirty_epoch;
            self.dirty.push(i);
        }
    }

    fn release(&mut self, i: u32) {
        let s = &mut self.slots[i as usize];
        if !s.used {
            return;
        }
        s.used = false;
        self.rx_backlog_bytes -= u64::from(s.rq_bytes);
        self.rx_backlog_packets -= u64::from(s.rq_packets);
        self.tx_queue_bytes -= u64::from(s.tq_bytes);
        s.rq_bytes = 0;
        s.rq_packets = 0;
        s.tq_bytes = 0;
        let flow = s.flow;
        self.index.remove(&flow);
        self.free.push(i);
        self.stats.released += 1;
    }

    /// Re-reads the queues of slot `i`; false if its connection is gone.
    fn update(&mut self, i: u32, tcp: &Endpoint) -> bool {
        let s = &mut self.slots[i as usize];
        if !s.used {
            return false;
        }
        let Some(load) = tcp.load(s.conn) else {
            self.release(i);
            return false;
        };
        let rq = u32::try_from(load.recv_queue).unwrap_or(u32::MAX);
        let tq = u32::try_from(load.send_queue).unwrap_or(u32::MAX);
        let mean = s
            .data_bytes
            .checked_div(s.data_segments)
            .map_or(1460, |m| m.max(1));
        let rqp = u32::try_from(u64::from(rq).div_ceil(mean)).unwrap_or(u32::MAX);
        self.rx_backlog_bytes = self.rx_backlog_bytes - u64::from(s.rq_bytes) + u64::from(rq);
        self.rx_backlog_packets =
            self.rx_backlog_packets - u64::from(s.rq_packets) + u64::from(rqp);
        self.tx_queue_bytes = self.tx_queue_bytes - u64::from(s.tq_bytes) + u64::from(tq);
        // Consumed since the last re-read: what was queued plus what
        // arrived, less what is queued now. A migrated-in connection's
        // first re-read finds its imported queue (nothing arrived): no
        // consumption, and its queue is the baseline from then on.
        let arrived = s.data_bytes - s.seen_bytes;
        s.seen_bytes = s.data_bytes;
        self.drained_bytes += (u64::from(s.rq_bytes) + arrived).saturating_sub(u64::from(rq));
        s.rq_bytes = rq;
        s.rq_packets = rqp;
        s.tq_bytes = tq;
        true
    }

    /// Brings queue lengths and totals up to date: continues the current
    /// pass (or starts one over the connections that received segments or
    /// had a backlog) for at most the refresh budget, plus a bounded sweep
    /// for closed ones. No allocation: every list is sized to the slots.
    pub fn refresh(&mut self, tcp: &Endpoint) {
        self.stats.refreshes += 1;
        if self.cursor >= self.pass.len() {
            // A new pass: what was dirtied or backlogged during the last one.
            self.pass.clear();
            self.pass.append(&mut self.dirty);
            let (slots, listed) = (&self.slots, self.dirty_epoch);
            self.pass.extend(
                self.backlogged
                    .drain(..)
                    .filter(|&i| slots[i as usize].dirty_epoch != listed),
            );
            // Unlists every slot: a segment from now on lists it for the
            // next pass.
            self.dirty_epoch += 1;
            self.cursor = 0;
            self.pass_refreshes = 0;
        }
        self.pass_refreshes += 1;
        let end = self.pass.len().min(self.cursor + self.budget);
        self.stats.refreshed_slots += (end - self.cursor) as u64;
        for k in self.cursor..end {
            let i = self.pass[k];
            if self.update(i, tcp) && self.slots[i as usize].rq_bytes > 0 {
                self.backlogged.push(i);
            }
        }
        self.cursor = end;
        if self.cursor >= self.pass.len() {
            self.stats.passes += 1;
            self.stats.last_pass_refreshes = self.pass_refreshes;
        }
        // Sweep: slots of connections that left without a last segment.
        let n = self.slots.len().min(SWEEP_PER_REFRESH);
        for _ in 0..n {
            self.sweep = (self.sweep + 1) % self.slots.len();
            let i = self.sweep as u32;
            let s = &self.slots[i as usize];
            if s.used && tcp.load(s.conn).is_none() {
                self.release(i);
            }
        }
        self.stats.refreshed_slots += n as u64;
    }

    /// Refreshes until the current pass is complete (tests, benchmarks).
    pub fn refresh_pass(&mut self, tcp: &Endpoint) {
        self.refresh(tcp);
        while self.cursor < self.pass.len() {
            self.refresh(tcp);
        }
    }

    /// The server's totals as of the last refresh (rates as of `now`).
    pub fn totals(&self, now: Instant) -> ServerLoad {
        ServerLoad {
            pps: self.total.rate(now.as_micros(), self.width_us),
            connections: self.index.len(),
            rx_backlog_packets: self.rx_backlog_packets,
            rx_backlog_bytes: self.rx_backlog_bytes,
            tx_queue_bytes: self.tx_queue_bytes,
            rx_arrived_packets: self.data_segments,
            rx_drained_packets: if self.data_bytes == 0 {
                0
            } else {
                (self.drained_bytes as f64 * self.data_segments as f64 / self.data_bytes as f64)
                    as u64
            },
        }
    }

    /// Every watched connection, as of the last refresh. O(connections).
    pub fn connections(&self, now: Instant) -> impl Iterator<Item = ConnSample> + '_ {
        let now_us = now.as_micros();
        self.slots
            .iter()
            .filter(|s| s.used)
            .map(move |s| ConnSample {
                flow: s.flow,
                pps: s.pps.rate(now_us, self.width_us),
                rq_packets: s.rq_packets,
                rq_bytes: s.rq_bytes,
                tq_bytes: s.tq_bytes,
                age: now.saturating_since(s.bound_at),
                migrated_in: s.migrated_in,
            })
    }

    /// One connection's sample.
    pub fn connection(&self, now: Instant, flow: &FlowKey) -> Option<ConnSample> {
        let s = &self.slots[*self.index.get(flow)? as usize];
        Some(ConnSample {
            flow: s.flow,
            pps: s.pps.rate(now.as_micros(), self.width_us),
            rq_packets: s.rq_packets,
            rq_bytes: s.rq_bytes,
            tq_bytes: s.tq_bytes,
            age: now.saturating_since(s.bound_at),
            migrated_in: s.migrated_in,
        })
    }
}

/// Payload bytes of a TCP segment (0 if the header is malformed: the
/// endpoint drops such segments anyway).
#[inline]
pub fn tcp_payload_len(segment: &[u8]) -> usize {
    match segment.get(12) {
        Some(b) => segment.len().saturating_sub(usize::from(b >> 4) * 4),
        None => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;

    fn flow(port: u16) -> FlowKey {
        FlowKey {
            client_ip: Ipv4Addr::new(198, 18, 0, 11),
            client_port: port,
            service_ip: Ipv4Addr::new(198, 18, 100, 1),
            service_port: 80,
        }
    }

    #[test]
    fn window_rate_is_steady_for_a_steady_stream() {
        let mut w = Window::default();
        let width = 10_000; // 10 ms buckets
                            // 1 event per ms for 100 ms: 1000 per second.
        for t in 0..100u64 {
            w.add(t * 1000, width, 1);
        }
        let r = w.rate(99_500, width);
        assert!((r - 1000.0).abs() < 100.0, "{r}");
        // Silence empties it within two buckets.
        assert_eq!(w.rate(130_000, width), 0.0);
    }

    #[test]
    fn per_connection_and_total_rates() {
        let mut m = Monitor::new(Duration::from_millis(20));
        let t0 = Instant::from_micros(1_000_000);
        m.bind(t0, flow(1), ConnId(1), false);
        m.bind(t0, flow(2), ConnId(2), true);
        for k in 0..200u64 {
            let now = t0 + Duration::from_micros(k * 100); // 10,000 pps
            m.on_segment(now, &flow(1), 100);
            if k % 4 == 0 {
                m.on_segment(now, &flow(2), 10); // 2,500 pps
                m.on_segment(now, &flow(1), 0); // a bare ACK: not a request
            }
            m.on_segment(now, &flow(9), 0); // a handshake: not load
        }
        let now = t0 + Duration::from_micros(20_000);
        let c: Vec<ConnSample> = {
            let mut v: Vec<_> = m.connections(now).collect();
            v.sort_by_key(|c| c.flow.client_port);
            v
        };
        assert!((c[0].pps - 10_000.0).abs() < 1_000.0, "{}", c[0].pps);
        assert!((c[1].pps - 2_500.0).abs() < 500.0, "{}", c[1].pps);
        assert!(c[1].migrated_in && !c[0].migrated_in);
        let t = m.totals(now);
        // The total counts request packets, as the connections' rates do
        // (before: every segment, 25,000 here, so `load_pps` read about
        // twice the load of light request/response connections).
        assert!((t.pps - 12_500.0).abs() < 1_250.0, "{}", t.pps);
        assert_eq!(m.stats.segments, 200 * 2 + 50 * 2);
        assert_eq!(t.connections, 2);
    }

    /// Two in-memory endpoints with `n` established connections, each
    /// with `queued` unread bytes at the server.
    fn endpoints(n: usize, queued: usize) -> (Endpoint, Vec<(ConnId, FlowKey)>) {
        use capybara_tcp::TcpConfig;
        use std::net::SocketAddrV4;
        let vip = SocketAddrV4::new(Ipv4Addr::new(198, 18, 100, 1), 80);
        let mut server = Endpoint::new(TcpConfig::default());
        let mut client = Endpoint::new(TcpConfig::default());
        server.listen(vip).unwrap();
        let now = Instant::from_millis(1);
        let mut buf = vec![0u8; 2048];
        let mut shuttle = |a: &mut Endpoint, b: &mut Endpoint| {
            let mut k = 0;
            while let Some(t) = a.poll_transmit(now, &mut buf) {
                b.handle_segment(now, t.src, t.dst, &buf[..t.len]);
                k += 1;
            }
            k
        };
        let ids: Vec<ConnId> = (0..n)
            .map(|_| {
                let local = SocketAddrV4::new(Ipv4Addr::new(198, 18, 0, 11), 0);
                client.connect(now, local, vip).unwrap()
            })
            .collect();
        while shuttle(&mut client, &mut server) + shuttle(&mut server, &mut client) > 0 {}
        for id in &ids {
            client.send(*id, &vec![b'x'; queued]).unwrap();
        }
        while shuttle(&mut client, &mut server) + shuttle(&mut server, &mut client) > 0 {}
        let mut out = Vec::new();
        while let Some(id) = server.accept() {
            out.push((id, server.flow_key(id).unwrap()));
        }
        assert_eq!(out.len(), n);
        (server, out)
    }

    #[test]
    fn a_pass_larger_than_the_budget_spans_refreshes() {
        let (server, conns) = endpoints(5, 100);
        let mut m = Monitor::new(Duration::from_millis(20));
        m.set_refresh_budget(2);
        let t0 = Instant::from_millis(2);
        for (id, f) in &conns {
            m.bind(t0, *f, *id, false);
            m.on_segment(t0, f, 100);
        }
        // 5 listed slots, 2 per refresh: the pass ends at the third.
        m.refresh(&server);
        assert_eq!(m.totals(t0).rx_backlog_bytes, 200);
        // A segment on an already re-read slot lists it for the next pass
        // once, however many segments arrive.
        for _ in 0..3 {
            m.on_segment(t0, &conns[0].1, 100);
        }
        m.refresh(&server);
        assert_eq!(m.totals(t0).rx_backlog_bytes, 400);
        assert_eq!(m.stats.passes, 0);
        m.refresh(&server);
        assert_eq!(m.totals(t0).rx_backlog_bytes, 500);
        assert_eq!(m.totals(t0).rx_backlog_packets, 5);
        assert_eq!((m.stats.passes, m.stats.last_pass_refreshes), (1, 3));
        // Next pass: the 5 backlogged slots, conns[0] listed once (dirty,
        // so not twice through the backlogged list).
        assert_eq!(m.dirty.len(), 1);
        let before = m.stats.refreshed_slots;
        m.refresh_pass(&server);
        let looked = m.stats.refreshed_slots - before;
        assert_eq!(looked, 5 + 5 * 3, "5 slots re-read, 5 swept per refresh");
        assert_eq!(m.totals(t0).rx_backlog_bytes, 500);
    }

    #[test]
    fn the_default_budget_rereads_every_active_connection_per_refresh() {
        let (server, conns) = endpoints(40, 10);
        let mut m = Monitor::new(Duration::from_millis(20));
        let t0 = Instant::from_millis(2);
        for (id, f) in &conns {
            m.bind(t0, *f, *id, false);
            m.on_segment(t0, f, 10);
        }
        m.refresh(&server);
        assert_eq!(m.totals(t0).rx_backlog_bytes, 400);
        assert_eq!((m.stats.passes, m.stats.last_pass_refreshes), (1, 1));
    }

    #[test]
    fn arrivals_and_drain_count_own_traffic_not_imported_queues() {
        let (mut server, conns) = endpoints(2, 100);
        let mut m = Monitor::new(Duration::from_millis(20));
        let t0 = Instant::from_millis(2);
        // conns[0]: 100 bytes arrived as one 100-byte segment. conns[1]:
        // its 100 bytes came with it (migrated in): not an arrival.
        m.bind(t0, conns[0].1, conns[0].0, false);
        m.on_segment(t0, &conns[0].1, 100);
        m.bind(t0, conns[1].1, conns[1].0, true);
        m.on_segment(t0, &conns[1].1, 0);
        m.refresh(&server);
        let l = m.totals(t0);
        assert_eq!((l.rx_arrived_packets, l.rx_drained_packets), (1, 0));
        assert_eq!(l.rx_backlog_packets, 2);
        // The application reads both queues: two packets drained.
        let mut buf = [0u8; 100];
        for (id, f) in &conns {
            assert_eq!(server.recv(*id, &mut buf).unwrap(), 100);
            m.on_segment(t0, f, 0); // lists the slot (an ack, say)
        }
        m.refresh(&server);
        let l = m.totals(t0);
        assert_eq!((l.rx_arrived_packets, l.rx_drained_packets), (1, 2));
        assert_eq!(l.rx_backlog_packets, 0);
    }

    #[test]
    fn payload_length_from_the_data_offset() {
        let mut seg = [0u8; 60];
        seg[12] = 5 << 4;
        assert_eq!(tcp_payload_len(&seg), 40);
        seg[12] = 15 << 4;
        assert_eq!(tcp_payload_len(&seg), 0);
        assert_eq!(tcp_payload_len(&seg[..5]), 0);
    }
}
