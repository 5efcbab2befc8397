//! An endpoint owning listeners and many connections behind a socket-like,
//! handle-based, sans-IO API.
//!
//! Addressing: the switch rewrites the VIP to this server's data address, so
//! an incoming segment is matched to a connection by (remote ip, remote port,
//! local port) and to a listener by local port, whatever its IPv4
//! destination; its checksum is verified against the destination it arrived
//! with. Outgoing segments carry the connection's bound local address (the
//! VIP) as source, and their checksum is computed with it.
//!
//! Per-packet work is two hash lookups and fixed-size copies; the event,
//! ready and RST queues are pre-sized (they grow only if a burst exceeds
//! their initial capacity).
//!
//! Timers: every connection has at most one live entry in a binary
//! min-heap keyed by (deadline, id), with lazy deletion: an entry is live
//! only while it equals the connection's `scheduled` instant. The entry is
//! armed no later than the connection's earliest deadline, and moves only
//! when that deadline comes earlier: a deadline pushed later (the keep-alive
//! idle timer and the retransmission timer restart on every segment, a
//! delayed ACK is cancelled when the ACK goes out) keeps the armed entry,
//! which then fires early and re-arms at the deadline of the moment, as
//! Linux's keep-alive timer does. So a busy connection costs one heap push
//! per timer period, not one per segment. Superseded entries are dropped
//! when they reach the top, so after every `&mut self` call the top is live
//! and `poll_timeout` is an O(1) peek; it can be earlier than any deadline
//! (a postponed one), where `handle_timeout` only re-arms. `handle_timeout`
//! pops only due entries: idle connections cost nothing per call. The heap
//! is compacted when stale entries outnumber live ones.
//!
//! Migration: `export` serializes a connection (`snapshot.rs`, layout in
//! `docs/SNAPSHOT.md`) and removes it silently; `import` validates a
//! snapshot completely before touching the endpoint, then recreates the
//! connection and delivers it through `accept` (and `Event::Accepted`).
//! Connections live in boxed entries, so the maps move pointers, never the
//! ~850-byte connection. The entries (with their queue buffers) of exported
//! or closed connections are kept in a small pool: an import restores the
//! snapshot in place into a pooled entry and normally allocates nothing.

use std::cmp::Reverse;
use std::collections::hash_map::Entry::Occupied;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};
use std::net::{Ipv4Addr, SocketAddrV4};
use std::ops::Range;

use capybara_proto::time::Instant;
use capybara_proto::FlowKey;

use crate::config::TcpConfig;
use crate::conn::{ConnParams, Connection, State};
use crate::counters::Counters;
use crate::error::{CloseReason, TcpError};
use crate::isn::IsnGenerator;
use crate::seq::SeqNum;
use crate::snapshot::{self, SnapshotError};
use crate::wire::{TcpPacket, TcpRepr};

/// Handle of a connection; never reused within an endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ConnId(pub u64);

/// Socket events for an async driver.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// A passive connection completed its handshake; `accept()` returns it.
    Accepted(ConnId),
    /// An active connection completed its handshake.
    Connected(ConnId),
    /// Data, end of stream, or an error is available to `recv`.
    Readable(ConnId),
    /// Send-buffer space freed after a short write.
    Writable(ConnId),
    /// The connection reached CLOSED; the handle stays valid until `close`.
    Closed { id: ConnId, reason: CloseReason },
}

/// A segment written by `poll_transmit`: `buf[..len]` is a complete TCP
/// segment (checksum filled) to wrap in an IPv4 header from `src` to `dst`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transmit {
    pub src: Ipv4Addr,
    pub dst: Ipv4Addr,
    pub len: usize,
}

/// A snapshot of one connection's transport metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnInfo {
    pub state: State,
    pub local: SocketAddrV4,
    pub remote: SocketAddrV4,
    pub srtt_us: u64,
    pub rttvar_us: u64,
    pub rto_us: u64,
    pub cwnd: u32,
    pub ssthresh: u32,
    pub snd_wnd: u32,
    pub rcv_wnd: u32,
    pub unacked: u32,
    pub send_queue: usize,
    pub recv_queue: usize,
    pub retransmits: u64,
    pub segments_in: u64,
    pub segments_out: u64,
}

/// Per-connection load, for the server monitor and migration policies:
/// cumulative counters (take differences between two reads for rates) and
/// current queue lengths. Reading it touches nothing but the connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnLoad {
    pub id: ConnId,
    pub state: State,
    /// Segments received on this connection (packets in).
    pub segments_in: u64,
    /// Segments sent on this connection (packets out).
    pub segments_out: u64,
    pub bytes_received: u64,
    pub bytes_acked: u64,
    /// In-order bytes the application has not read yet.
    pub recv_queue: usize,
    /// Bytes queued to send, unacknowledged included.
    pub send_queue: usize,
    /// The application owns the handle (accepted, connected or imported and
    /// accepted, not closed): a candidate for migration.
    pub owned: bool,
}

/// Result of a successful [`Endpoint::import`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Imported {
    /// The new connection; `accept()` returns it (and `Event::Accepted` is queued).
    pub id: ConnId,
    /// Where the application state lies in the imported bytes.
    pub app_state: Range<usize>,
}

/// Hasher for `ConnId`s and listener ports: ids are sequential numbers this
/// endpoint hands out and listener ports come from configuration (a peer can
/// look a port up but never insert one), so a multiplicative hash is safe
/// and much cheaper than SipHash. Flow keys, which peers choose, use the
/// keyed `FlowHasher` below.
#[derive(Default)]
struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = v.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
    fn write_u16(&mut self, v: u16) {
        self.write_u64(u64::from(v));
    }
}

type IdMap<V> = HashMap<ConnId, V, BuildHasherDefault<IdHasher>>;

/// Hasher of the flow map, whose keys (client address and port) come from
/// the network: keyed foldhash (`capybara_proto::hash` explains the
/// trade-off against SipHash).
type FlowHasher = capybara_proto::hash::KeyedHasher;

/// Lookup key: what identifies a connection whatever its IPv4 destination.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Key {
    remote_ip: Ipv4Addr,
    remote_port: u16,
    local_port: u16,
}

/// One 8-byte write: one folded multiply (`FlowHasher`) instead of three
/// short writes (the flow map is hashed on every segment and migration).
impl std::hash::Hash for Key {
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write_u64(
            u64::from(u32::from(self.remote_ip)) << 32
                | u64::from(self.remote_port) << 16
                | u64::from(self.local_port),
        );
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    /// Passive, handshake in progress: the application does not know it.
    HalfOpen,
    /// Passive, in the accept queue.
    Queued,
    /// Accepted, connected actively, or imported: owned by the application.
    Owned,
}

#[derive(Debug)]
struct Entry {
    conn: Connection,
    listener: Option<u16>,
    stage: Stage,
    /// The application called `close`; the entry goes when CLOSED.
    app_closed: bool,
    in_ready: bool,
    /// Instant of the live timer-heap entry: no later than the
    /// connection's earliest deadline (see the module doc).
    scheduled: Option<Instant>,
}

#[derive(Debug)]
struct Listener {
    addr: SocketAddrV4,
    half_open: usize,
    queued: usize,
}

/// Addresses and sequence numbers of a connection's RST, kept after the
/// connection left the endpoint ([`Endpoint::peer_reset`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerReset {
    /// Our address as the peer sees it (the service VIP).
    pub local: SocketAddrV4,
    pub remote: SocketAddrV4,
    pub snd_una: SeqNum,
    pub snd_max: SeqNum,
    pub rcv_nxt: SeqNum,
}

/// A RST for a segment that matched no connection (RFC 9293 §3.10.7.1), or
/// for a connection's peer ([`Endpoint::reset_peer`]).
#[derive(Debug, Clone, Copy)]
struct RstReply {
    local: SocketAddrV4,
    remote: SocketAddrV4,
    seq: SeqNum,
    ack: Option<SeqNum>,
}

const RST_QUEUE: usize = 64;
/// Default number of spare entries (with their queue buffers) kept for imports.
const SPARE_BUFFERS: usize = 16;

/// The TCP endpoint.
#[derive(Debug)]
pub struct Endpoint {
    cfg: TcpConfig,
    /// `ConnParams::from_config(&cfg)`, computed once for imports.
    params: ConnParams,
    isn: IsnGenerator,
    /// Boxed: inserting and removing move a pointer, not the entry.
    conns: IdMap<Box<Entry>>,
    flows: HashMap<Key, ConnId, FlowHasher>,
    listeners: HashMap<u16, Listener, BuildHasherDefault<IdHasher>>,
    accept_queue: VecDeque<ConnId>,
    events: VecDeque<Event>,
    ready: VecDeque<ConnId>,
    rsts: VecDeque<RstReply>,
    scratch: Vec<ConnId>,
    /// Min-heap of (deadline, connection), lazily deleted (see module doc).
    timers: BinaryHeap<Reverse<(Instant, ConnId)>>,
    /// Recycled entries of removed connections (queue buffers of this
    /// endpoint's capacities included), for imports. Boxed: an entry moves
    /// into and out of the connection table as one pointer.
    #[allow(clippy::vec_box)]
    spare: Vec<Box<Entry>>,
    spare_limit: usize,
    next_id: u64,
    next_port: u16,
    now: Instant,
    counters: Counters,
    /// Tuples of connections closed from LAST-ACK a moment ago, whose late
    /// segments are dropped rather than reset (`RecentlyClosed`).
    closed: RecentlyClosed,
    /// Until then a non-SYN segment for an unknown connection is dropped
    /// instead of answered with RST ([`Endpoint::hold_resets_until`]).
    hold_resets: Option<Instant>,
}

impl Endpoint {
    pub fn new(cfg: TcpConfig) -> Self {
        Endpoint {
            isn: IsnGenerator::new(cfg.isn_key),
            params: ConnParams::from_config(&cfg),
            cfg,
            conns: IdMap::with_capacity_and_hasher(1024, Default::default()),
            flows: capybara_proto::hash::keyed_map(1024),
            listeners: HashMap::default(),
            accept_queue: VecDeque::with_capacity(256),
            events: VecDeque::with_capacity(1024),
            ready: VecDeque::with_capacity(1024),
            rsts: VecDeque::with_capacity(RST_QUEUE),
            scratch: Vec::with_capacity(1024),
            timers: BinaryHeap::with_capacity(1024),
            spare: Vec::with_capacity(SPARE_BUFFERS),
            spare_limit: SPARE_BUFFERS,
            next_id: 1,
            next_port: 49152,
            now: Instant::ZERO,
            counters: Counters::default(),
            closed: RecentlyClosed::default(),
            hold_resets: None,
        }
    }

    /// Until `until`, non-SYN segments for connections this endpoint does
    /// not know are dropped silently (counted in `drops.reset_held`)
    /// instead of answered with RST: the switch lost its flow mappings and
    /// may send this host segments of connections another host serves
    /// until that host's report fixes the mapping; their clients
    /// retransmit. A later `until` extends the hold, an earlier one never
    /// shortens it.
    pub fn hold_resets_until(&mut self, until: Instant) {
        if self.hold_resets.is_none_or(|u| u < until) {
            self.hold_resets = Some(until);
        }
    }

    /// When the reset hold ends, if one is in force at `now`.
    pub fn resets_held_until(&self, now: Instant) -> Option<Instant> {
        self.hold_resets.filter(|u| *u > now)
    }

    pub fn config(&self) -> &TcpConfig {
        &self.cfg
    }
    pub fn counters(&self) -> &Counters {
        &self.counters
    }

    // ------------------------------------------------------------ socket API

    /// Accepts connections to `local` (the service VIP and port). Segments
    /// for the port are taken whatever their IPv4 destination.
    pub fn listen(&mut self, local: SocketAddrV4) -> Result<(), TcpError> {
        if self.listeners.contains_key(&local.port()) {
            return Err(TcpError::AddrInUse);
        }
        self.listeners.insert(
            local.port(),
            Listener {
                addr: local,
                half_open: 0,
                queued: 0,
            },
        );
        Ok(())
    }

    /// Stops listening; established connections are unaffected.
    pub fn unlisten(&mut self, port: u16) {
        self.listeners.remove(&port);
    }

    /// Next established passive connection.
    pub fn accept(&mut self) -> Option<ConnId> {
        while let Some(id) = self.accept_queue.pop_front() {
            if let Some(e) = self.conns.get_mut(&id) {
                if e.stage == Stage::Queued {
                    e.stage = Stage::Owned;
                    if let Some(l) = e.listener.and_then(|p| self.listeners.get_mut(&p)) {
                        l.queued = l.queued.saturating_sub(1);
                    }
                    return Some(id);
                }
            }
        }
        None
    }

    /// Active open from `local` (port 0 picks an ephemeral port) to `remote`.
    pub fn connect(
        &mut self,
        now: Instant,
        local: SocketAddrV4,
        remote: SocketAddrV4,
    ) -> Result<ConnId, TcpError> {
        self.now = now;
        let mut local = local;
        if local.port() == 0 {
            let mut found = None;
            for _ in 0..16384 {
                let p = self.next_port;
                self.next_port = if p == u16::MAX { 49152 } else { p + 1 };
                let k = Key {
                    remote_ip: *remote.ip(),
                    remote_port: remote.port(),
                    local_port: p,
                };
                if !self.flows.contains_key(&k) && !self.listeners.contains_key(&p) {
                    found = Some(p);
                    break;
                }
            }
            local.set_port(found.ok_or(TcpError::NoPorts)?);
        }
        let key = Key {
            remote_ip: *remote.ip(),
            remote_port: remote.port(),
            local_port: local.port(),
        };
        if self.flows.contains_key(&key) {
            return Err(TcpError::AddrInUse);
        }
        let iss = self.isn.isn(now, local, remote);
        let ts_offset = self.isn.secret_u32(1, local, remote);
        let conn = Connection::connect(&self.cfg, local, remote, iss, ts_offset);
        self.counters.connections_active += 1;
        let id = self.insert(conn, None, Stage::Owned);
        self.sync(id);
        Ok(id)
    }

    /// Reads in-order bytes. `Ok(0)` = end of stream (peer sent FIN);
    /// `WouldBlock` = nothing yet; `Reset`/`TimedOut`/... = the connection failed.
    pub fn recv(&mut self, id: ConnId, buf: &mut [u8]) -> Result<usize, TcpError> {
        let e = self.owned_mut(id)?;
        let r = e.conn.recv(buf);
        self.sync(id);
        r
    }

    /// Queues bytes; returns how many fit (partial writes when the send
    /// buffer is full, `WouldBlock` when none fit).
    pub fn send(&mut self, id: ConnId, data: &[u8]) -> Result<usize, TcpError> {
        let e = self.owned_mut(id)?;
        let r = e.conn.send(data);
        self.sync(id);
        r
    }

    /// Asks for `Event::Writable` once send-buffer space frees up, for
    /// applications that check free space before writing (and so never make
    /// the short write that would ask for it).
    pub fn notify_writable(&mut self, id: ConnId) -> Result<(), TcpError> {
        let e = self.owned_mut(id)?;
        e.conn.want_writable = true;
        Ok(())
    }

    /// Sends FIN after the queued data; reading stays possible.
    pub fn shutdown(&mut self, id: ConnId) -> Result<(), TcpError> {
        let now = self.now;
        let e = self.owned_mut(id)?;
        e.conn.shutdown(now);
        self.sync(id);
        Ok(())
    }

    /// Releases the handle: graceful close (FIN), or RST when unread data
    /// would be lost. The connection finishes its closing states alone.
    pub fn close(&mut self, id: ConnId) -> Result<(), TcpError> {
        let now = self.now;
        let e = self.owned_mut(id)?;
        e.app_closed = true;
        e.conn.close(now);
        self.sync(id);
        Ok(())
    }

    /// Resets the connection (RST) and releases the handle.
    pub fn abort(&mut self, id: ConnId) -> Result<(), TcpError> {
        let e = self.owned_mut(id)?;
        e.app_closed = true;
        e.conn.abort();
        self.sync(id);
        Ok(())
    }

    pub fn state(&self, id: ConnId) -> Option<State> {
        self.owned(id).map(|c| c.state)
    }
    pub fn is_readable(&self, id: ConnId) -> bool {
        self.owned(id).is_some_and(Connection::is_readable)
    }
    pub fn is_writable(&self, id: ConnId) -> bool {
        self.owned(id).is_some_and(Connection::is_writable)
    }
    pub fn is_closed(&self, id: ConnId) -> bool {
        self.owned(id).is_none_or(|c| c.state == State::Closed)
    }
    pub fn local_addr(&self, id: ConnId) -> Option<SocketAddrV4> {
        self.owned(id).map(|c| c.local)
    }
    pub fn remote_addr(&self, id: ConnId) -> Option<SocketAddrV4> {
        self.owned(id).map(|c| c.remote)
    }
    /// The flow as the switch and the store name it.
    pub fn flow_key(&self, id: ConnId) -> Option<FlowKey> {
        self.owned(id).map(|c| FlowKey {
            client_ip: *c.remote.ip(),
            client_port: c.remote.port(),
            service_ip: *c.local.ip(),
            service_port: c.local.port(),
        })
    }

    /// Read access to the whole connection state (tests, snapshots).
    pub fn connection(&self, id: ConnId) -> Option<&Connection> {
        self.conns.get(&id).map(|e| &e.conn)
    }

    pub fn info(&self, id: ConnId) -> Option<ConnInfo> {
        self.connection(id).map(info_of)
    }

    /// `ConnInfo` of every connection (half-open and orphaned included), in
    /// no particular order. O(connections), no allocation.
    pub fn infos(&self) -> impl Iterator<Item = (ConnId, ConnInfo)> + '_ {
        self.conns.iter().map(|(id, e)| (*id, info_of(&e.conn)))
    }

    /// Packets in/out and queue lengths of every connection: the cheap read
    /// the server monitor does each interval. O(connections), no allocation.
    pub fn loads(&self) -> impl Iterator<Item = ConnLoad> + '_ {
        self.conns.iter().map(|(id, e)| load_of(*id, e))
    }

    /// Load of one connection.
    pub fn load(&self, id: ConnId) -> Option<ConnLoad> {
        self.conns.get(&id).map(|e| load_of(id, e))
    }

    /// Connections per state (every state listed, zero included).
    pub fn connections_by_state(&self) -> [(State, usize); 10] {
        let mut out = State::ALL.map(|s| (s, 0));
        for e in self.conns.values() {
            if let Some(slot) = out.iter_mut().find(|(s, _)| *s == e.conn.state) {
                slot.1 += 1;
            }
        }
        out
    }

    /// Every connection (including half-open and orphaned ones).
    pub fn connections(&self) -> impl Iterator<Item = (ConnId, &Connection)> {
        self.conns.iter().map(|(id, e)| (*id, &e.conn))
    }

    pub fn connection_count(&self) -> usize {
        self.conns.len()
    }

    /// Tuples closed from LAST-ACK whose late segments are still dropped
    /// instead of reset ([`CLOSED_LINGER`], at most [`CLOSED_LINGER_MAX`]).
    pub fn recently_closed_count(&self) -> usize {
        self.closed.len()
    }

    /// Removes a connection without sending anything (migration export):
    /// returns its complete state.
    pub fn detach(&mut self, id: ConnId) -> Option<Connection> {
        self.take(id).map(|e| e.conn)
    }

    /// Removes a connection's entry from every map (nothing is sent).
    fn take(&mut self, id: ConnId) -> Option<Box<Entry>> {
        let e = self.conns.remove(&id)?;
        self.unlink(&e);
        Some(e)
    }

    /// What `take` does after removing `e` from the connection map: the
    /// listener's counts, the flow map and the timer heap.
    fn unlink(&mut self, e: &Entry) {
        // Owned connections no longer count against their listener.
        if e.stage != Stage::Owned {
            if let Some(l) = e.listener.and_then(|p| self.listeners.get_mut(&p)) {
                match e.stage {
                    Stage::HalfOpen => l.half_open = l.half_open.saturating_sub(1),
                    Stage::Queued => l.queued = l.queued.saturating_sub(1),
                    Stage::Owned => {}
                }
            }
        }
        self.flows.remove(&key_of(&e.conn));
        self.clean_timers();
    }

    /// Bytes `export` would write for this connection with `app_len` bytes
    /// of application state.
    pub fn snapshot_len(&self, now: Instant, id: ConnId, app_len: usize) -> Option<usize> {
        let c = &self.conns.get(&id)?.conn;
        // The application bytes only count by length.
        let n = snapshot::connection_len(c, now, &[]);
        // The application state's length field is fixed-width.
        Some(n + app_len)
    }

    /// [`Endpoint::snapshot_len`] when it exceeds `max`, else `None`: a
    /// cheap upper bound first, the exact sizing walk only when the bound
    /// is over `max` (the origin's check before it freezes a connection).
    pub fn snapshot_len_over(
        &self,
        now: Instant,
        id: ConnId,
        app_len: usize,
        max: usize,
    ) -> Option<usize> {
        let c = &self.conns.get(&id)?.conn;
        if snapshot::connection_max_len(c, now, &[]).saturating_add(app_len) <= max {
            return None;
        }
        let n = snapshot::connection_len(c, now, &[]).saturating_add(app_len);
        (n > max).then_some(n)
    }

    /// What a reset of the connection's peer needs once the connection is
    /// gone (exported, then lost with a failed target); `None` when its
    /// abort would send no RST (not synchronized yet, TIME-WAIT, closed).
    pub fn peer_reset(&self, id: ConnId) -> Option<PeerReset> {
        let c = &self.conns.get(&id)?.conn;
        if matches!(c.state, State::Closed | State::SynSent | State::TimeWait) {
            return None;
        }
        Some(PeerReset {
            local: c.local,
            remote: c.remote,
            snd_una: c.snd.una,
            snd_max: c.snd.max,
            rcv_nxt: c.rcv.nxt,
        })
    }

    /// The peer's initial sequence number (its SYN's) on connection `id`,
    /// if the endpoint holds it (kept across migrations in the snapshot).
    pub fn peer_isn(&self, id: ConnId) -> Option<SeqNum> {
        Some(self.conns.get(&id)?.conn.rcv.irs)
    }

    /// Resets the peer of a connection this endpoint no longer holds
    /// ([`Endpoint::peer_reset`], captured before the export): RST at
    /// `snd_max` with ACK, as the connection's own abort would send, and, if
    /// data was unacknowledged, a second one at `snd_una`. The peer accepts
    /// the one at its RCV.NXT (RFC 5961 §3.2), which lies between the two;
    /// the other falls below its window (dropped) or inside it (a challenge
    /// ACK). Not subject to `rst_unknown` or held resets: a deliberate reset
    /// of a known connection. Returns the RSTs queued.
    pub fn reset_peer(&mut self, r: &PeerReset) -> usize {
        let mut queued = 0;
        for seq in [
            Some(r.snd_max),
            (r.snd_una != r.snd_max).then_some(r.snd_una),
        ]
        .into_iter()
        .flatten()
        {
            if self.rsts.len() >= RST_QUEUE {
                self.counters.drops.rst_queue_full += 1;
                continue;
            }
            self.rsts.push_back(RstReply {
                local: r.local,
                remote: r.remote,
                seq,
                ack: Some(r.rcv_nxt),
            });
            queued += 1;
        }
        queued
    }

    /// Migration export: writes the connection's snapshot with `app_state`
    /// (the connection manager's bytes) into `out`, then removes the
    /// connection silently (nothing is sent, the handle becomes invalid, its
    /// buffers go to the import pool). Returns the snapshot length. On error
    /// (`InvalidHandle`, `BufferTooSmall`) the connection is untouched.
    /// Allocates nothing.
    pub fn export(
        &mut self,
        now: Instant,
        id: ConnId,
        app_state: &[u8],
        out: &mut [u8],
    ) -> Result<usize, SnapshotError> {
        // One lookup for the export and the removal.
        let Occupied(slot) = self.conns.entry(id) else {
            return Err(SnapshotError::InvalidHandle);
        };
        // Straight from the connection into `out` (no `Snapshot` copy).
        let n = snapshot::emit_connection(&slot.get().conn, now, app_state, out)?;
        let e = slot.remove();
        self.finish_export(e);
        Ok(n)
    }

    /// `export` appending to a `Vec` (which grows if its capacity is short:
    /// it reserves a cheap upper bound, 293 bytes plus queue and
    /// application bytes, then appends without a sizing pass).
    pub fn export_to_vec(
        &mut self,
        now: Instant,
        id: ConnId,
        app_state: &[u8],
        out: &mut Vec<u8>,
    ) -> Result<usize, SnapshotError> {
        let Occupied(slot) = self.conns.entry(id) else {
            return Err(SnapshotError::InvalidHandle);
        };
        let n = snapshot::append_connection(&slot.get().conn, now, app_state, out);
        let e = slot.remove();
        self.finish_export(e);
        Ok(n)
    }

    /// The rest of `remove` for an exported connection's entry, already
    /// out of the connection map.
    fn finish_export(&mut self, e: Box<Entry>) {
        self.unlink(&e);
        self.recycle(e);
    }

    /// Migration import: validates `bytes` completely (any error leaves the
    /// endpoint untouched), recreates the connection at `now` with timers
    /// and the timestamp clock re-based on this host, and delivers it
    /// through `accept()` and `Event::Accepted`, like a new passive
    /// connection. Queue capacities are this endpoint's `TcpConfig` ones;
    /// a snapshot holding more bytes is refused (`QueueTooLarge`). Returns
    /// the id and where the application state lies in `bytes`. Allocates
    /// nothing while the buffer pool has a spare pair (see
    /// `set_spare_buffers`).
    pub fn import(&mut self, now: Instant, bytes: &[u8]) -> Result<Imported, SnapshotError> {
        // A pooled entry: the snapshot is parsed straight into its
        // connection (no intermediate `Snapshot`), over its predecessor,
        // and the queues are copied into that one's buffers. On any error
        // the entry goes back to the pool and the endpoint is untouched.
        let mut e = match self.spare.pop() {
            Some(e) => e,
            None => blank_entry(&self.cfg),
        };
        let app_state = match snapshot::import_into(bytes, now, &self.params, &mut e.conn) {
            Ok(app) => app,
            Err(err) => {
                self.recycle(e);
                return Err(err);
            }
        };
        let key = key_of(&e.conn);
        // One hash of the flow key for the check and the insertion.
        let slot = match self.flows.entry(key) {
            std::collections::hash_map::Entry::Occupied(_) => None,
            std::collections::hash_map::Entry::Vacant(v) => Some(v),
        };
        let Some(slot) = slot else {
            self.recycle(e);
            return Err(SnapshotError::FlowExists);
        };
        self.now = self.now.max(now);
        let port = e.conn.local.port();
        let id = ConnId(self.next_id);
        self.next_id += 1;
        slot.insert(id);
        // What `queue_accepted` + `sync` do for a connection without
        // events, on the entry at hand instead of three map lookups.
        e.listener = Some(port);
        e.stage = Stage::Queued;
        e.app_closed = false;
        e.in_ready = true;
        self.ready.push_back(id);
        e.scheduled = e.conn.next_deadline();
        if let Some(t) = e.scheduled {
            self.timers.push(Reverse((t, id)));
        }
        self.conns.insert(id, e);
        self.accept_queue.push_back(id);
        self.events.push_back(Event::Accepted(id));
        if let Some(l) = self.listeners.get_mut(&port) {
            l.queued += 1;
        }
        // The heap's top was live and a live entry was pushed: the top is
        // still live, only the compaction check of `clean_timers` is left.
        if self.timers.len() > 2 * self.conns.len() + 64 {
            self.clean_timers();
        }
        Ok(Imported { id, app_state })
    }

    /// Keeps up to `limit` spare connection entries (each with a pair of
    /// queue buffers, `tx_buffer + rx_buffer` bytes) for imports and
    /// allocates them now (`prewarm_spare_buffers`).
    pub fn set_spare_buffers(&mut self, limit: usize) {
        self.spare_limit = limit;
        self.spare.truncate(limit);
        self.prewarm_spare_buffers(limit);
    }

    /// Fills the import pool up to `count` entries (at most its limit, 16
    /// unless `set_spare_buffers` changed it), their queue buffers' pages
    /// touched: a standby's first imports then neither allocate nor
    /// page-fault through fresh queue memory (a fault per 4 KiB of traffic
    /// through each new queue; issue #8).
    pub fn prewarm_spare_buffers(&mut self, count: usize) {
        let count = count.min(self.spare_limit);
        self.spare.reserve(count.saturating_sub(self.spare.len()));
        while self.spare.len() < count {
            let mut e = blank_entry(&self.cfg);
            e.conn.tx.prefault();
            e.conn.rx.prefault();
            self.spare.push(e);
        }
    }

    /// The import pool's limit and how many entries it holds now.
    pub fn spare_buffers(&self) -> (usize, usize) {
        (self.spare_limit, self.spare.len())
    }

    /// Returns a removed connection's entry (and buffers) to the import pool.
    fn recycle(&mut self, e: Box<Entry>) {
        if self.spare.len() < self.spare_limit
            && e.conn.tx.capacity() == self.cfg.tx_buffer
            && e.conn.rx.capacity() == self.cfg.rx_buffer
        {
            self.spare.push(e);
        }
    }

    /// Adds a connection built elsewhere (migration import). It is delivered
    /// through `accept` like a new passive connection.
    pub fn attach(&mut self, conn: Connection) -> Result<ConnId, TcpError> {
        if self.flows.contains_key(&key_of(&conn)) {
            return Err(TcpError::AddrInUse);
        }
        let port = conn.local.port();
        let id = self.insert(conn, Some(port), Stage::Queued);
        self.queue_accepted(id, port);
        Ok(id)
    }

    /// Delivers a just inserted, attached or imported connection through
    /// the accept queue and `Event::Accepted`.
    fn queue_accepted(&mut self, id: ConnId, port: u16) {
        self.accept_queue.push_back(id);
        self.events.push_back(Event::Accepted(id));
        if let Some(l) = self.listeners.get_mut(&port) {
            l.queued += 1;
        }
        self.sync(id);
    }

    pub fn poll_event(&mut self) -> Option<Event> {
        self.events.pop_front()
    }

    // ------------------------------------------------------------ packet I/O

    /// Takes one TCP segment (header + payload) that arrived in an IPv4
    /// packet from `src` to `dst`. Malformed input is counted and dropped.
    pub fn handle_segment(&mut self, now: Instant, src: Ipv4Addr, dst: Ipv4Addr, bytes: &[u8]) {
        self.now = now;
        self.counters.segments_in += 1;
        let Ok(packet) = TcpPacket::new_checked(bytes) else {
            self.counters.drops.malformed += 1;
            return;
        };
        if self.cfg.verify_checksum && !packet.verify_checksum(src, dst) {
            self.counters.drops.bad_checksum += 1;
            return;
        }
        let Ok(repr) = TcpRepr::parse(&packet) else {
            self.counters.drops.malformed += 1;
            return;
        };
        if repr.src_port == 0 || repr.dst_port == 0 {
            self.counters.drops.malformed += 1;
            return;
        }
        let key = Key {
            remote_ip: src,
            remote_port: repr.src_port,
            local_port: repr.dst_port,
        };
        if let Some(&id) = self.flows.get(&key) {
            let Some(e) = self.conns.get_mut(&id) else {
                self.flows.remove(&key);
                return;
            };
            let reuse = e.conn.state == State::TimeWait
                && repr.syn
                && repr.ack.is_none()
                && !repr.rst
                && repr.seq > e.conn.rcv.nxt;
            if !reuse {
                process_on(e, now, &repr, &mut self.counters, &mut self.closed);
                self.sync(id);
                return;
            }
            // A new SYN above the old sequence space ends TIME-WAIT early
            // (RFC 9293 §3.10.7.4 note, as Linux does for port reuse).
            self.remove(id);
        }

        if repr.syn {
            self.closed.forget(&key);
        } else if self.closed.contains(now, &key) {
            // A late segment of a connection this endpoint closed from
            // LAST-ACK: its peer closed too (it acknowledged our FIN) and
            // is in TIME-WAIT; a stale duplicate still queued (e.g. the
            // duplicate ACKs a late retransmission drew) is dropped, not
            // answered with a RST the peer would count as an abort.
            self.counters.drops.recently_closed += 1;
            return;
        }
        if repr.rst {
            // Never answer a RST (RFC 9293 §3.10.7.1).
            self.counters.drops.unexpected += 1;
            return;
        }
        let remote = SocketAddrV4::new(src, repr.src_port);
        let Some(l) = self.listeners.get_mut(&repr.dst_port) else {
            self.counters.drops.no_listener += 1;
            let local = SocketAddrV4::new(self.rst_source(dst), repr.dst_port);
            self.queue_rst(&repr, local, remote);
            return;
        };
        let local = if l.addr.ip().is_unspecified() {
            SocketAddrV4::new(dst, repr.dst_port)
        } else {
            l.addr
        };
        if !(repr.syn && repr.ack.is_none()) {
            // LISTEN: an ACK gets <SEQ=SEG.ACK><CTL=RST>; anything else is dropped.
            self.counters.drops.unexpected += 1;
            if repr.ack.is_some() {
                self.queue_rst(&repr, local, remote);
            }
            return;
        }
        if l.half_open >= self.cfg.syn_backlog || l.queued >= self.cfg.accept_backlog {
            self.counters.drops.backlog_full += 1;
            return;
        }
        l.half_open += 1;
        let iss = self.isn.isn(now, local, remote);
        let ts_offset = self.isn.secret_u32(1, local, remote);
        let conn = Connection::accept_syn(&self.cfg, now, local, remote, &repr, iss, ts_offset);
        self.counters.connections_passive += 1;
        let id = self.insert(conn, Some(repr.dst_port), Stage::HalfOpen);
        self.sync(id);
    }

    /// Migration import: feeds `bytes`, a client segment buffered while the
    /// connection `id` migrated here, to that connection. The checks of
    /// [`Endpoint::handle_segment`] (length, checksum, header) without its
    /// flow lookup; a segment that is not for `id`'s tuple, or for a
    /// connection in TIME-WAIT, or that fails a check takes the generic path
    /// (which counts and drops it). Events, transmission and timers of `id`
    /// are published once for the whole replay by [`Endpoint::replay_done`]:
    /// call it after the last segment.
    pub fn replay_segment(
        &mut self,
        now: Instant,
        id: ConnId,
        src: Ipv4Addr,
        dst: Ipv4Addr,
        bytes: &[u8],
    ) {
        let packet = TcpPacket::new_checked(bytes)
            .ok()
            .filter(|p| !self.cfg.verify_checksum || p.verify_checksum(src, dst));
        let repr = packet.as_ref().and_then(|p| TcpRepr::parse(p).ok());
        let e = self.conns.get_mut(&id);
        let (Some(repr), Some(e)) = (repr, e) else {
            return self.handle_segment(now, src, dst, bytes);
        };
        if *e.conn.remote.ip() != src
            || e.conn.remote.port() != repr.src_port
            || e.conn.local.port() != repr.dst_port
            || e.conn.state == State::TimeWait
        {
            return self.handle_segment(now, src, dst, bytes);
        }
        self.now = now;
        self.counters.segments_in += 1;
        process_on(e, now, &repr, &mut self.counters, &mut self.closed);
    }

    /// Ends a replay ([`Endpoint::replay_segment`]): publishes the
    /// connection's events and schedules its transmission and timers, as
    /// `handle_segment` does after each segment (a connection's events are
    /// flags, so one publication covers all the replayed segments).
    pub fn replay_done(&mut self, id: ConnId) {
        self.sync(id);
    }

    /// Writes the next segment to send into `buf` (size it for 60 + MSS
    /// bytes). Call until it returns `None`.
    pub fn poll_transmit(&mut self, now: Instant, buf: &mut [u8]) -> Option<Transmit> {
        self.now = now;
        while let Some(r) = self.rsts.pop_front() {
            let mut t = TcpRepr::new(r.local.port(), r.remote.port(), r.seq);
            t.rst = true;
            t.ack = r.ack;
            if let Ok(len) = t.emit(buf, *r.local.ip(), *r.remote.ip()) {
                self.counters.resets_sent += 1;
                self.counters.segments_out += 1;
                return Some(Transmit {
                    src: *r.local.ip(),
                    dst: *r.remote.ip(),
                    len,
                });
            }
        }
        while let Some(id) = self.ready.pop_front() {
            let Some(e) = self.conns.get_mut(&id) else {
                continue;
            };
            match e.conn.poll_segment(now, buf, &mut self.counters) {
                Some(len) => {
                    self.counters.segments_out += 1;
                    let t = Transmit {
                        src: *e.conn.local.ip(),
                        dst: *e.conn.remote.ip(),
                        len,
                    };
                    self.ready.push_back(id);
                    self.sync_events(id);
                    return Some(t);
                }
                None => {
                    e.in_ready = false;
                    self.sync_events(id);
                }
            }
        }
        None
    }

    /// Earliest timer deadline of any connection: O(1), the heap top is
    /// always live (see the module doc).
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.timers.peek().map(|Reverse((t, _))| *t)
    }

    /// Fires the timers due at `now`. Cost: O(due connections * log n).
    pub fn handle_timeout(&mut self, now: Instant) {
        self.now = now;
        let mut due = std::mem::take(&mut self.scratch);
        due.clear();
        while let Some(&Reverse((t, id))) = self.timers.peek() {
            if t > now {
                break;
            }
            self.timers.pop();
            if let Some(e) = self.conns.get_mut(&id) {
                if e.scheduled == Some(t) {
                    // Consumed: `sync` or `reschedule` registers whatever
                    // deadline follows.
                    e.scheduled = None;
                    due.push(id);
                }
            }
        }
        for &id in &due {
            if let Some(e) = self.conns.get_mut(&id) {
                if e.conn.next_deadline().is_some_and(|d| d <= now) {
                    e.conn.on_timeout(now, &mut self.counters);
                    self.sync(id);
                } else {
                    // Armed for a deadline since postponed (or cancelled):
                    // nothing fires, the entry re-arms at the current one.
                    self.reschedule(id);
                }
            }
        }
        self.clean_timers();
        self.scratch = due;
    }

    // ------------------------------------------------------------ internals

    fn owned(&self, id: ConnId) -> Option<&Connection> {
        self.conns
            .get(&id)
            .filter(|e| e.stage == Stage::Owned && !e.app_closed)
            .map(|e| &e.conn)
    }

    fn owned_mut(&mut self, id: ConnId) -> Result<&mut Entry, TcpError> {
        self.conns
            .get_mut(&id)
            .map(|e| &mut **e)
            .filter(|e| e.stage == Stage::Owned && !e.app_closed)
            .ok_or(TcpError::InvalidHandle)
    }

    fn insert(&mut self, conn: Connection, listener: Option<u16>, stage: Stage) -> ConnId {
        let id = ConnId(self.next_id);
        self.next_id += 1;
        self.flows.insert(key_of(&conn), id);
        self.conns.insert(
            id,
            Box::new(Entry {
                conn,
                listener,
                stage,
                app_closed: false,
                in_ready: false,
                scheduled: None,
            }),
        );
        id
    }

    fn remove(&mut self, id: ConnId) {
        if let Some(e) = self.take(id) {
            self.recycle(e);
        }
    }

    /// Keeps the connection's heap entry no later than its earliest
    /// deadline: pushes a new entry only when there is none or the deadline
    /// came earlier than it. A later or cancelled deadline keeps the armed
    /// entry (no heap work on the per-segment path); when it fires,
    /// `handle_timeout` finds nothing due and re-arms here.
    fn reschedule(&mut self, id: ConnId) {
        let Some(e) = self.conns.get_mut(&id) else {
            return;
        };
        if arm(e, id, &mut self.timers) {
            self.clean_timers();
        }
    }

    /// Entries in the timer heap, superseded ones included (diagnostics and
    /// tests: a connection whose deadlines only move later keeps one).
    pub fn timer_heap_len(&self) -> usize {
        self.timers.len()
    }

    /// Restores the heap invariant: the top entry is live. Compacts the
    /// heap when stale entries dominate.
    fn clean_timers(&mut self) {
        if self.timers.len() > 2 * self.conns.len() + 64 {
            let conns = &self.conns;
            self.timers
                .retain(|Reverse((t, id))| conns.get(id).is_some_and(|e| e.scheduled == Some(*t)));
        }
        while let Some(&Reverse((t, id))) = self.timers.peek() {
            if self.conns.get(&id).is_some_and(|e| e.scheduled == Some(t)) {
                break;
            }
            self.timers.pop();
        }
    }

    /// Source address of a RST for a port nobody listens on. The packet's
    /// destination is our data address (the switch rewrote the VIP), which
    /// the client would not recognise; when every listener is bound to the
    /// same VIP, that VIP is the address the client used. Otherwise (no
    /// listener, listeners on 0.0.0.0 or on several VIPs) the reset leaves
    /// from `dst` and switchd rewrites its source to the flow's VIP
    /// (bpf/switch.bpf.c `server_rst_from_vip`).
    fn rst_source(&self, dst: Ipv4Addr) -> Ipv4Addr {
        let mut vip = None;
        for l in self.listeners.values() {
            let ip = *l.addr.ip();
            if ip.is_unspecified() {
                continue;
            }
            match vip {
                None => vip = Some(ip),
                Some(v) if v != ip => return dst,
                Some(_) => {}
            }
        }
        vip.unwrap_or(dst)
    }

    fn queue_rst(&mut self, seg: &TcpRepr, local: SocketAddrV4, remote: SocketAddrV4) {
        if !self.cfg.rst_unknown {
            return;
        }
        if !seg.syn && self.hold_resets.is_some_and(|u| self.now < u) {
            self.counters.drops.reset_held += 1;
            return;
        }
        if self.rsts.len() >= RST_QUEUE {
            self.counters.drops.rst_queue_full += 1;
            return;
        }
        // RFC 9293 §3.10.7.1: ACK set -> <SEQ=SEG.ACK><CTL=RST>,
        // else <SEQ=0><ACK=SEG.SEQ+SEG.LEN><CTL=RST,ACK>.
        let (seq, ack) = match seg.ack {
            Some(a) => (a, None),
            None => (SeqNum(0), Some(seg.seq.add(seg.segment_len() as u32))),
        };
        self.rsts.push_back(RstReply {
            local,
            remote,
            seq,
            ack,
        });
    }

    /// After any activity on a connection: publish its events and schedule
    /// it for transmission.
    fn sync(&mut self, id: ConnId) {
        if let Some(e) = self.conns.get_mut(&id) {
            if !e.in_ready {
                e.in_ready = true;
                self.ready.push_back(id);
            }
        }
        self.sync_events(id);
    }

    fn sync_events(&mut self, id: ConnId) {
        let Some(e) = self.conns.get_mut(&id) else {
            return;
        };
        let ev = std::mem::take(&mut e.conn.events);
        if ev.established {
            match e.stage {
                Stage::HalfOpen => {
                    e.stage = Stage::Queued;
                    if let Some(l) = e.listener.and_then(|p| self.listeners.get_mut(&p)) {
                        l.half_open = l.half_open.saturating_sub(1);
                        l.queued += 1;
                    }
                    self.accept_queue.push_back(id);
                    self.events.push_back(Event::Accepted(id));
                }
                Stage::Owned if !e.app_closed => self.events.push_back(Event::Connected(id)),
                _ => {}
            }
        }
        let visible = e.stage != Stage::HalfOpen && !e.app_closed;
        if visible {
            if ev.readable && !ev.closed {
                self.events.push_back(Event::Readable(id));
            }
            if ev.writable && !ev.closed && !ev.established {
                self.events.push_back(Event::Writable(id));
            }
            if ev.closed {
                let reason = e.conn.close_reason.unwrap_or(CloseReason::Normal);
                self.events.push_back(Event::Closed { id, reason });
            }
        }
        if e.app_closed {
            e.conn.orphan_tick(self.now);
        }
        let done = e.conn.state == State::Closed
            && !e.conn.pending.rst
            && e.conn.pending.rst_reply.is_none()
            && (e.app_closed || e.stage == Stage::HalfOpen);
        if done {
            self.remove(id);
        } else if arm(e, id, &mut self.timers) {
            // (`reschedule` with the entry at hand: no second lookup.)
            self.clean_timers();
        }
    }
}

/// `reschedule`'s work on an entry: pushes a heap entry when the connection
/// has a deadline and none is armed or the deadline came earlier than the
/// armed one. True when it pushed (the superseded entry, if any, is stale:
/// the caller runs `clean_timers`).
fn arm(e: &mut Entry, id: ConnId, timers: &mut BinaryHeap<Reverse<(Instant, ConnId)>>) -> bool {
    match e.conn.next_deadline() {
        Some(d) if e.scheduled.is_none_or(|s| d < s) => {
            e.scheduled = Some(d);
            timers.push(Reverse((d, id)));
            true
        }
        _ => false,
    }
}

/// How long non-SYN segments of a tuple closed from LAST-ACK are dropped
/// silently instead of answered with a RST. The peer acknowledged our FIN,
/// so it has closed and waits in TIME-WAIT (60 s on Linux): whatever it
/// sent before that ACK and reaches us after it is a stale duplicate.
/// Dropping them costs the peer nothing; a RST would make it report an
/// error it never had. A SYN (a new connection on the tuple) is unaffected.
pub const CLOSED_LINGER: capybara_proto::time::Duration =
    capybara_proto::time::Duration::from_secs(2);
/// Tuples remembered at most; beyond, the oldest is forgotten early.
pub const CLOSED_LINGER_MAX: usize = 4096;

/// Tuples closed from LAST-ACK less than [`CLOSED_LINGER`] ago: a map to
/// each tuple's expiry plus the expiries in closing order. Bounded by
/// [`CLOSED_LINGER_MAX`]; sized on the first close (the map at twice the
/// bound, so its tombstones are rehashed in place), then nothing allocates.
/// Looked up only for segments that match no connection.
#[derive(Debug, Default)]
struct RecentlyClosed {
    until: HashMap<Key, Instant>,
    order: VecDeque<(Instant, Key)>,
}

impl RecentlyClosed {
    /// Forgets expired tuples, and the oldest ones beyond the bound.
    fn expire(&mut self, now: Instant) {
        while let Some(&(t, k)) = self.order.front() {
            if t > now && self.order.len() < CLOSED_LINGER_MAX {
                break;
            }
            self.order.pop_front();
            if self.until.get(&k) == Some(&t) {
                self.until.remove(&k);
            }
        }
    }

    fn insert(&mut self, now: Instant, key: Key) {
        if self.order.capacity() == 0 {
            self.until.reserve(2 * CLOSED_LINGER_MAX);
            self.order.reserve(CLOSED_LINGER_MAX);
        }
        self.expire(now);
        let t = now + CLOSED_LINGER;
        self.until.insert(key, t);
        self.order.push_back((t, key));
    }

    fn contains(&mut self, now: Instant, key: &Key) -> bool {
        if self.until.is_empty() {
            return false;
        }
        self.expire(now);
        self.until.contains_key(key)
    }

    fn forget(&mut self, key: &Key) {
        if !self.until.is_empty() {
            self.until.remove(key);
        }
    }

    fn len(&self) -> usize {
        self.until.len()
    }
}

/// A pool entry: a placeholder connection with queue buffers of `cfg`'s
/// capacities (an import, `snapshot::import_into`, overwrites every field).
fn blank_entry(cfg: &TcpConfig) -> Box<Entry> {
    let any = SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 0);
    Box::new(Entry {
        conn: Connection::connect(cfg, any, any, SeqNum(0), 0),
        listener: None,
        stage: Stage::Queued,
        app_closed: false,
        in_ready: false,
        scheduled: None,
    })
}

/// A segment for an existing connection entry: processed, and a close from
/// LAST-ACK remembered (late duplicates of its peer are then dropped, not
/// reset: `RecentlyClosed`). Fields passed apart so that the caller keeps
/// its borrow of the entry (no second lookup per segment).
fn process_on(
    e: &mut Entry,
    now: Instant,
    repr: &TcpRepr,
    counters: &mut Counters,
    closed: &mut RecentlyClosed,
) {
    let last_ack = e.conn.state == State::LastAck;
    e.conn.process(now, repr, counters);
    if last_ack && e.conn.state == State::Closed {
        closed.insert(now, key_of(&e.conn));
    }
}

fn key_of(c: &Connection) -> Key {
    Key {
        remote_ip: *c.remote.ip(),
        remote_port: c.remote.port(),
        local_port: c.local.port(),
    }
}

fn info_of(c: &Connection) -> ConnInfo {
    ConnInfo {
        state: c.state,
        local: c.local,
        remote: c.remote,
        srtt_us: c.rtt.srtt_us,
        rttvar_us: c.rtt.rttvar_us,
        rto_us: c.rtt.rto(&c.params).as_micros() as u64,
        cwnd: c.cc.cwnd,
        ssthresh: c.cc.ssthresh,
        snd_wnd: c.snd.wnd,
        rcv_wnd: c.rcv_wnd(),
        unacked: c.unacked(),
        send_queue: c.send_queue_len(),
        recv_queue: c.recv_queue_len(),
        retransmits: c.stats.retransmits,
        segments_in: c.stats.segments_in,
        segments_out: c.stats.segments_out,
    }
}

fn load_of(id: ConnId, e: &Entry) -> ConnLoad {
    let c = &e.conn;
    ConnLoad {
        id,
        state: c.state,
        segments_in: c.stats.segments_in,
        segments_out: c.stats.segments_out,
        bytes_received: c.stats.bytes_received,
        bytes_acked: c.stats.bytes_acked,
        recv_queue: c.rx.len(),
        send_queue: c.tx.len(),
        owned: e.stage == Stage::Owned && !e.app_closed,
    }
}

#[cfg(test)]
mod recently_closed_tests {
    use super::*;

    fn key(i: u32) -> Key {
        Key {
            remote_ip: Ipv4Addr::from(0x0a00_0000 + (i >> 16)),
            remote_port: i as u16,
            local_port: 80,
        }
    }

    #[test]
    fn tuples_expire_and_stay_bounded_without_growing() {
        let mut c = RecentlyClosed::default();
        let t0 = Instant::from_millis(1000);
        assert!(!c.contains(t0, &key(1)), "empty: nothing allocated");
        assert_eq!(c.order.capacity(), 0);
        c.insert(t0, key(1));
        let caps = (c.until.capacity(), c.order.capacity());
        assert!(c.contains(t0 + CLOSED_LINGER / 2, &key(1)));
        assert!(!c.contains(t0, &key(2)));
        assert!(!c.contains(t0 + CLOSED_LINGER, &key(1)), "expired");
        assert_eq!(c.len(), 0);
        // Forgotten on a new SYN; a re-closed tuple gets a fresh expiry.
        c.insert(t0, key(3));
        c.forget(&key(3));
        assert!(!c.contains(t0, &key(3)));
        c.insert(t0, key(4));
        c.insert(t0 + CLOSED_LINGER / 2, key(4));
        assert!(
            c.contains(t0 + CLOSED_LINGER, &key(4)),
            "the later close counts"
        );
        // A burst of closes well beyond the bound, repeated: the oldest go
        // first, and the tables never grow past their first sizing.
        let mut now = t0;
        for round in 0..4u32 {
            for i in 0..(3 * CLOSED_LINGER_MAX as u32) {
                c.insert(now, key(round * 100_000 + i));
                assert!(c.len() <= CLOSED_LINGER_MAX && c.order.len() <= CLOSED_LINGER_MAX);
            }
            now += capybara_proto::time::Duration::from_millis(1);
            // (The map's capacity() dips while tombstones wait for an
            // in-place rehash; a reallocation would double it.)
            assert!(c.until.capacity() <= caps.0 && c.order.capacity() == caps.1);
        }
        let last = 3 * 100_000 + 3 * CLOSED_LINGER_MAX as u32 - 1;
        assert!(c.contains(now, &key(last)));
        assert!(!c.contains(now, &key(3 * 100_000)), "oldest forgotten");
    }
}
