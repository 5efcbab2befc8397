//! Deterministic virtual-clock harness: an origin and one or more targets,
//! each an `Engine` plus a fake stack that exports/imports a byte blob, and
//! a model of the switch (steers PREPARE, keeps the migration table exactly
//! as docs/MIGRATION.md tells the switch to) with fault knobs on every
//! TCPMig datagram. A client can send segments of the flow; the switch
//! routes them to the current owner.
#![allow(dead_code)]

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::net::Ipv4Addr;

use capybara_proto::tcpmig::TcpMigRepr;
use capybara_tcpmig::*;

pub const SWITCH: Ipv4Addr = Ipv4Addr::new(198, 18, 1, 1);
pub const ORIGIN: Ipv4Addr = Ipv4Addr::new(198, 18, 2, 10);
pub const TARGET: Ipv4Addr = Ipv4Addr::new(198, 18, 2, 11);
pub const TARGET2: Ipv4Addr = Ipv4Addr::new(198, 18, 2, 12);
/// One-way latency host <-> switch.
pub const HOP_US: u64 = 5;

pub fn key() -> MigrationKey {
    MigrationKey::from_bytes(&[0x42; 32]).unwrap()
}

pub fn flow() -> FlowKey {
    FlowKey {
        client_ip: Ipv4Addr::new(198, 18, 0, 10),
        client_port: 40000,
        service_ip: Ipv4Addr::new(198, 18, 100, 1),
        service_port: 80,
    }
}

pub fn blob(n: usize) -> Vec<u8> {
    (0..n).map(|i| (i * 31 + i / 7) as u8).collect()
}

pub fn config(addr: Ipv4Addr) -> EngineConfig {
    let mut c = EngineConfig::new(addr, SWITCH);
    // A small MTU makes even small snapshots span several fragments.
    c.path_mtu = 576;
    c.max_snapshot_bytes = 64 * 1024;
    c.max_buffer_bytes = 4096;
    c
}

/// What happens to one datagram.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fate {
    Deliver,
    /// Lost between the sender and the switch (the switch never sees it).
    DropBeforeSwitch,
    /// Lost after the switch processed it (the switch table changed).
    DropAfterSwitch,
    Duplicate,
    /// Delivered late by this many microseconds (reordering).
    Delay(u64),
}

/// Decides the fate of the n-th TCPMig datagram sent (any host).
pub trait FaultPlan {
    fn fate(&mut self, n: usize, kind: Kind, from: Ipv4Addr) -> Fate;
}

pub struct NoFaults;
impl FaultPlan for NoFaults {
    fn fate(&mut self, _: usize, _: Kind, _: Ipv4Addr) -> Fate {
        Fate::Deliver
    }
}

/// Applies `fate` to the `nth` (0-based) datagram of `kind`.
pub struct OnKind {
    pub kind: Kind,
    pub nth: usize,
    pub fate: Fate,
    seen: usize,
}
impl OnKind {
    pub fn new(kind: Kind, nth: usize, fate: Fate) -> Self {
        OnKind {
            kind,
            nth,
            fate,
            seen: 0,
        }
    }
}
impl FaultPlan for OnKind {
    fn fate(&mut self, _: usize, kind: Kind, _: Ipv4Addr) -> Fate {
        if kind != self.kind {
            return Fate::Deliver;
        }
        self.seen += 1;
        if self.seen - 1 == self.nth {
            self.fate
        } else {
            Fate::Deliver
        }
    }
}

/// Every datagram of `kind` (optionally only from `from`) gets `fate`.
pub struct AllOfKind(pub Kind, pub Option<Ipv4Addr>, pub Fate);
impl FaultPlan for AllOfKind {
    fn fate(&mut self, _: usize, kind: Kind, from: Ipv4Addr) -> Fate {
        if kind == self.0 && (self.1.is_none() || self.1 == Some(from)) {
            self.2
        } else {
            Fate::Deliver
        }
    }
}

/// Fates by global datagram index; `Deliver` after the script ends.
pub struct Scripted(pub Vec<Fate>);
impl FaultPlan for Scripted {
    fn fate(&mut self, n: usize, _: Kind, _: Ipv4Addr) -> Fate {
        self.0.get(n).copied().unwrap_or(Fate::Deliver)
    }
}

/// The switch's migration-table entry (docs/MIGRATION.md, "The switch").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry {
    pub owner: Ipv4Addr,
    pub id: u64,
    pub pending: bool,
}

/// Model of the switch's TCPMig handling.
pub struct SwitchModel {
    pub entries: HashMap<FlowKey, Entry>,
    /// Where flows go without an entry (their flow-table server).
    pub home: Ipv4Addr,
    pub candidates: Vec<Ipv4Addr>,
    /// Steering choice per migration id, so retransmitted PREPAREs reach
    /// the same target.
    pub choices: HashMap<u64, Ipv4Addr>,
    rr: usize,
}

impl SwitchModel {
    pub fn route(&self, flow: &FlowKey) -> Ipv4Addr {
        self.entries.get(flow).map_or(self.home, |e| e.owner)
    }

    /// Processes a TCPMig datagram from `src` to `dst`; returns where to
    /// forward it, or None to drop it.
    pub fn process(&mut self, src: Ipv4Addr, dst: Ipv4Addr, bytes: &[u8]) -> Option<Ipv4Addr> {
        // The switch has no key: it parses but cannot verify.
        let m = TcpMigRepr::parse_bytes(bytes).ok()?;
        let id = m.migration_id;
        match m.kind {
            Kind::Prepare => {
                if dst != SWITCH {
                    return Some(dst);
                }
                if !m.target.is_unspecified() {
                    return Some(m.target);
                }
                let candidates: Vec<_> = self
                    .candidates
                    .iter()
                    .copied()
                    .filter(|&c| c != src)
                    .collect();
                if candidates.is_empty() {
                    return None;
                }
                let rr = &mut self.rr;
                let t = *self.choices.entry(id).or_insert_with(|| {
                    *rr += 1;
                    candidates[*rr % candidates.len()]
                });
                Some(t)
            }
            Kind::PrepareAck => {
                let e = self.entries.get(&m.flow).copied();
                let install = match e {
                    None => true,
                    Some(e) => m.supersedes(e.owner, e.id, e.pending),
                };
                if install {
                    self.entries.insert(
                        m.flow,
                        Entry {
                            owner: m.target,
                            id,
                            pending: true,
                        },
                    );
                    Some(dst)
                } else if e.is_some_and(|e| e.id == id && e.owner == m.target) {
                    Some(dst)
                } else {
                    None
                }
            }
            Kind::ConnStateAck => {
                if let Some(e) = self.entries.get_mut(&m.flow) {
                    if e.id == id && e.owner == m.target {
                        e.pending = false;
                    }
                }
                Some(dst)
            }
            Kind::Abort if dst == m.origin => {
                // The target's decision: the origin owns the flow.
                // With no entry it still records the final outcome, so that
                // a late PREPARE_ACK of this migration cannot install one.
                match self.entries.get_mut(&m.flow) {
                    Some(e) if e.id == id && e.owner == m.target && e.pending => {
                        *e = Entry {
                            owner: m.origin,
                            id,
                            pending: false,
                        };
                    }
                    // TCPMig v2: the decision of a migration whose
                    // PREPARE_ACK never passed advances the final entry to
                    // its id, so that a late copy of that PREPARE_ACK is
                    // stale when it comes.
                    Some(e) if m.supersedes(e.owner, e.id, e.pending) => {
                        e.id = id;
                    }
                    Some(_) => {}
                    None => {
                        self.entries.insert(
                            m.flow,
                            Entry {
                                owner: m.origin,
                                id,
                                pending: false,
                            },
                        );
                    }
                }
                Some(dst)
            }
            Kind::Abort if dst == SWITCH => {
                // The origin's request with the target unknown: follow the
                // pending entry of that migration.
                match self.entries.get(&m.flow) {
                    Some(e) if e.id == id && e.pending => Some(e.owner),
                    _ => None,
                }
            }
            _ => Some(dst),
        }
    }

    /// Liveness check failed for `addr`: forget its entries.
    pub fn server_dead(&mut self, addr: Ipv4Addr) {
        self.entries.retain(|_, e| e.owner != addr);
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConnState {
    Active,
    Frozen,
}

#[derive(Debug, Clone)]
pub struct Conn {
    pub state: ConnState,
    pub blob: Vec<u8>,
    /// Client segments this connection processed, in order.
    pub received: Vec<Vec<u8>>,
}

/// The TCP stack stand-in: a connection is a blob.
#[derive(Default)]
pub struct FakeStack {
    pub conns: HashMap<FlowKey, Conn>,
    pub manual_export: bool,
    pub manual_import: bool,
    pub fail_import: bool,
    pub pending_exports: Vec<(MigrationId, FlowKey)>,
    pub pending_imports: Vec<(MigrationId, FlowKey)>,
    pub events: Vec<Event>,
    /// The engine's telemetry of each migration finished here, read when
    /// its `MigratedOut` / `MigratedIn` event is polled (as the hostagent
    /// does: events carry none, the record expires later).
    pub telemetry: Vec<(MigrationId, Telemetry)>,
    pub imported: Vec<Vec<u8>>,
    /// Client segments arriving at a host that neither serves nor buffers
    /// the flow: a real stack would answer them with RST.
    pub strays: usize,
    pub dropped_frozen: usize,
    pub buffer_drops: usize,
}

impl FakeStack {
    pub fn owns(&self, flow: &FlowKey) -> bool {
        self.conns
            .get(flow)
            .is_some_and(|c| c.state == ConnState::Active)
    }
}

pub struct Host {
    pub addr: Ipv4Addr,
    pub engine: Engine,
    pub stack: FakeStack,
    pub alive: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum Stage {
    ToSwitch,
    ToHost,
}

#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct InFlight {
    stage: Stage,
    src: Ipv4Addr,
    dst: Ipv4Addr,
    /// None: a client segment (payload in `bytes`).
    tcpmig: bool,
    fate_after: bool,
    bytes: Vec<u8>,
}

pub struct World {
    pub now: Instant,
    pub hosts: Vec<Host>,
    pub switch: SwitchModel,
    pub plan: Box<dyn FaultPlan>,
    net: BinaryHeap<Reverse<(Instant, u64, InFlight)>>,
    seqno: u64,
    sent: usize,
    /// (kind, from) of every TCPMig datagram sent, in order.
    pub log: Vec<(Kind, Ipv4Addr)>,
    pub max_owners_seen: usize,
}

impl World {
    pub fn new(targets: &[Ipv4Addr], plan: Box<dyn FaultPlan>) -> World {
        Self::with_config(targets, plan, config)
    }

    pub fn with_config(
        targets: &[Ipv4Addr],
        plan: Box<dyn FaultPlan>,
        cfg: impl Fn(Ipv4Addr) -> EngineConfig,
    ) -> World {
        let mut hosts = Vec::new();
        for &a in std::iter::once(&ORIGIN).chain(targets) {
            hosts.push(Host {
                addr: a,
                engine: Engine::new(cfg(a), key()).unwrap(),
                stack: FakeStack::default(),
                alive: true,
            });
        }
        World {
            now: Instant::from_millis(1000),
            hosts,
            switch: SwitchModel {
                entries: HashMap::new(),
                home: ORIGIN,
                candidates: targets.to_vec(),
                choices: HashMap::new(),
                rr: 0,
            },
            plan,
            net: BinaryHeap::new(),
            seqno: 0,
            sent: 0,
            log: Vec::new(),
            max_owners_seen: 0,
        }
    }

    /// A world where the origin serves `flow()` with a blob of `n` bytes.
    pub fn serving(n: usize, targets: &[Ipv4Addr], plan: Box<dyn FaultPlan>) -> World {
        let mut w = World::new(targets, plan);
        w.hosts[0].stack.conns.insert(
            flow(),
            Conn {
                state: ConnState::Active,
                blob: blob(n),
                received: Vec::new(),
            },
        );
        w
    }

    pub fn host(&mut self, a: Ipv4Addr) -> &mut Host {
        self.hosts.iter_mut().find(|h| h.addr == a).expect("host")
    }

    pub fn origin(&mut self) -> &mut Host {
        &mut self.hosts[0]
    }

    pub fn migrate(&mut self, target: Option<Ipv4Addr>) -> MigrationId {
        let now = self.now;
        let id = self.hosts[0]
            .engine
            .migrate_out(now, flow(), target)
            .unwrap();
        self.flush();
        id
    }

    pub fn kill(&mut self, a: Ipv4Addr) {
        self.host(a).alive = false;
    }

    /// The client sends one segment of the flow now.
    pub fn client_send(&mut self, payload: &[u8]) {
        let at = self.now + Duration::from_micros(HOP_US);
        self.push(
            at,
            InFlight {
                stage: Stage::ToSwitch,
                src: flow().client_ip,
                dst: flow().service_ip,
                tcpmig: false,
                fate_after: false,
                bytes: payload.to_vec(),
            },
        );
    }

    fn push(&mut self, at: Instant, p: InFlight) {
        self.seqno += 1;
        self.net.push(Reverse((at, self.seqno, p)));
    }

    /// Moves every queued datagram of every live host into the network
    /// and runs the fake stacks on pending events.
    pub fn flush(&mut self) {
        let mut buf = vec![0u8; 2048];
        loop {
            let mut progress = false;
            for i in 0..self.hosts.len() {
                if !self.hosts[i].alive {
                    continue;
                }
                progress |= self.run_stack(i);
                while let Some(t) = self.hosts[i].engine.poll_transmit(self.now, &mut buf) {
                    progress = true;
                    let bytes = buf[..t.len].to_vec();
                    let kind = TcpMigRepr::parse_bytes(&bytes).unwrap().kind;
                    let src = self.hosts[i].addr;
                    self.log.push((kind, src));
                    let fate = self.plan.fate(self.sent, kind, src);
                    self.sent += 1;
                    let p = InFlight {
                        stage: Stage::ToSwitch,
                        src,
                        dst: t.dst,
                        tcpmig: true,
                        fate_after: false,
                        bytes,
                    };
                    let at = self.now + Duration::from_micros(HOP_US);
                    match fate {
                        Fate::Deliver => self.push(at, p),
                        Fate::DropBeforeSwitch => {}
                        Fate::DropAfterSwitch => self.push(
                            at,
                            InFlight {
                                fate_after: true,
                                ..p
                            },
                        ),
                        Fate::Duplicate => {
                            self.push(at, p.clone());
                            self.push(at + Duration::from_micros(1), p);
                        }
                        Fate::Delay(d) => self.push(at + Duration::from_micros(d), p),
                    }
                }
            }
            self.check_owners();
            if !progress {
                break;
            }
        }
    }

    fn run_stack(&mut self, i: usize) -> bool {
        let now = self.now;
        let h = &mut self.hosts[i];
        let mut progress = false;
        while let Some(ev) = h.engine.poll_event() {
            progress = true;
            h.stack.events.push(ev);
            if let Event::MigratedOut { id, .. } | Event::MigratedIn { id, .. } = ev {
                if let Some(t) = h.engine.telemetry(id) {
                    h.stack.telemetry.push((id, *t));
                }
            }
            match ev {
                Event::ExportNow { id, flow } => {
                    if let Some(c) = h.stack.conns.get_mut(&flow) {
                        c.state = ConnState::Frozen;
                    }
                    h.stack.pending_exports.push((id, flow));
                }
                Event::MigratedOut { flow, .. } | Event::Lost { flow, .. } => {
                    h.stack.conns.remove(&flow);
                }
                Event::Resumed { flow, .. } => {
                    if let Some(c) = h.stack.conns.get_mut(&flow) {
                        c.state = ConnState::Active;
                    }
                }
                Event::ImportNow { id, flow, .. } => h.stack.pending_imports.push((id, flow)),
                Event::MigratedIn { .. } | Event::AbortedIn { .. } => {}
            }
        }
        if !h.stack.manual_export {
            for (id, flow) in std::mem::take(&mut h.stack.pending_exports) {
                let snap = h
                    .stack
                    .conns
                    .get(&flow)
                    .map(|c| c.blob.clone())
                    .unwrap_or_default();
                // May fail if the migration was aborted meanwhile.
                let _ = h.engine.provide_snapshot(now, id, snap);
                progress = true;
            }
        }
        if !h.stack.manual_import {
            for (id, flow) in std::mem::take(&mut h.stack.pending_imports) {
                progress = true;
                Self::import(h, now, id, flow);
            }
        }
        progress
    }

    pub fn import(h: &mut Host, now: Instant, id: MigrationId, flow: FlowKey) {
        let Some(snap) = h.engine.snapshot(id).map(<[u8]>::to_vec) else {
            return;
        };
        if h.stack.fail_import {
            h.engine.import_failed(now, id).unwrap();
            return;
        }
        let mut replayed = Vec::new();
        h.engine
            .import_done(now, id, |s| replayed.push(s.to_vec()))
            .unwrap();
        h.stack.imported.push(snap.clone());
        h.stack.conns.insert(
            flow,
            Conn {
                state: ConnState::Active,
                blob: snap,
                received: replayed,
            },
        );
    }

    fn check_owners(&mut self) {
        let owners = self
            .hosts
            .iter()
            .filter(|h| h.alive && h.stack.owns(&flow()))
            .count();
        self.max_owners_seen = self.max_owners_seen.max(owners);
        assert!(owners <= 1, "two owners at {}", self.now);
    }

    fn next_time(&self) -> Option<Instant> {
        let mut t = self.net.peek().map(|Reverse((t, _, _))| *t);
        for h in self.hosts.iter().filter(|h| h.alive) {
            if let Some(x) = h.engine.poll_timeout() {
                t = Some(t.map_or(x, |t| t.min(x)));
            }
        }
        t
    }

    /// Advances to the next network delivery or timer, if before `limit`.
    pub fn step(&mut self, limit: Instant) -> bool {
        let Some(t) = self.next_time() else {
            return false;
        };
        if t > limit {
            return false;
        }
        self.now = self.now.max(t);
        while self
            .net
            .peek()
            .is_some_and(|Reverse((t, _, _))| *t <= self.now)
        {
            let Reverse((_, _, p)) = self.net.pop().unwrap();
            self.deliver(p);
        }
        let now = self.now;
        for h in self.hosts.iter_mut().filter(|h| h.alive) {
            if h.engine.poll_timeout().is_some_and(|x| x <= now) {
                h.engine.handle_timeout(now);
            }
        }
        self.flush();
        true
    }

    fn deliver(&mut self, p: InFlight) {
        let now = self.now;
        let at = now + Duration::from_micros(HOP_US);
        match p.stage {
            Stage::ToSwitch => {
                if self.hosts.iter().any(|h| h.addr == p.src && !h.alive) {
                    // Sent just before the host died: keep it (it left).
                }
                let dst = if p.tcpmig {
                    match self.switch.process(p.src, p.dst, &p.bytes) {
                        Some(d) => d,
                        None => return,
                    }
                } else {
                    self.switch.route(&flow())
                };
                if p.fate_after {
                    return;
                }
                self.push(
                    at,
                    InFlight {
                        stage: Stage::ToHost,
                        dst,
                        ..p
                    },
                );
            }
            Stage::ToHost => {
                let Some(h) = self.hosts.iter_mut().find(|h| h.addr == p.dst && h.alive) else {
                    return;
                };
                if p.tcpmig {
                    let _ = h.engine.handle_message(now, p.src, &p.bytes);
                } else if let Some(c) = h.stack.conns.get_mut(&flow()) {
                    match c.state {
                        ConnState::Active => c.received.push(p.bytes),
                        ConnState::Frozen => h.stack.dropped_frozen += 1,
                    }
                } else {
                    match h.engine.buffer_segment(now, flow(), &p.bytes) {
                        BufferVerdict::Buffered => {}
                        BufferVerdict::Dropped(_) => h.stack.buffer_drops += 1,
                        BufferVerdict::NotMigrating => h.stack.strays += 1,
                    }
                }
            }
        }
    }

    /// Runs until nothing is scheduled before `now + d`.
    pub fn run_for(&mut self, d: Duration) {
        let limit = self.now + d;
        let mut steps = 0;
        while self.step(limit) {
            steps += 1;
            assert!(steps < 200_000, "no quiescence");
        }
        self.now = self.now.max(limit);
    }

    /// Runs long enough for every record to expire (linger).
    pub fn settle(&mut self) {
        self.run_for(Duration::from_secs(20));
    }

    pub fn owners(&self) -> Vec<Ipv4Addr> {
        self.hosts
            .iter()
            .filter(|h| h.alive && h.stack.owns(&flow()))
            .map(|h| h.addr)
            .collect()
    }

    /// The one-owner invariant: with every host alive exactly one owns the
    /// flow; with a dead host at most one; and the switch routes the flow
    /// to the owner.
    pub fn assert_one_owner(&self) {
        let owners = self.owners();
        if self.hosts.iter().all(|h| h.alive) {
            assert_eq!(owners.len(), 1, "owners {owners:?} at {}", self.now);
        } else {
            assert!(owners.len() <= 1, "owners {owners:?}");
        }
        if let [o] = owners[..] {
            assert_eq!(
                self.switch.route(&flow()),
                o,
                "switch disagrees with owner {o}; entries {:?}",
                self.switch.entries
            );
        }
    }

    pub fn events(&self, a: Ipv4Addr) -> &[Event] {
        &self
            .hosts
            .iter()
            .find(|h| h.addr == a)
            .unwrap()
            .stack
            .events
    }

    pub fn sent_kinds(&self, kind: Kind) -> usize {
        self.log.iter().filter(|(k, _)| *k == kind).count()
    }
}

/// Applies `fate` to the first `k` datagrams of `kind`.
pub struct FirstK {
    pub kind: Kind,
    pub k: usize,
    pub fate: Fate,
    seen: usize,
}
impl FirstK {
    pub fn new(kind: Kind, k: usize, fate: Fate) -> Self {
        FirstK {
            kind,
            k,
            fate,
            seen: 0,
        }
    }
}
impl FaultPlan for FirstK {
    fn fate(&mut self, _: usize, kind: Kind, _: Ipv4Addr) -> Fate {
        if kind != self.kind {
            return Fate::Deliver;
        }
        self.seen += 1;
        if self.seen <= self.k {
            self.fate
        } else {
            Fate::Deliver
        }
    }
}
