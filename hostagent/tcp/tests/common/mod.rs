//! Test harness: two endpoints joined by an in-memory link with a virtual
//! clock (quinn's `Pair` idea). `step()` jumps the clock to the next packet
//! delivery or timer instead of sleeping, so every test is deterministic.
//!
//! The server side models the Capybara addressing: the client sends to the
//! VIP, the "switch" rewrites the destination to the server's data address
//! (updating the TCP checksum incrementally, as the real switch does), and
//! the server answers from the VIP.

#![allow(dead_code)]

use std::collections::VecDeque;
use std::net::{Ipv4Addr, SocketAddrV4};

use capybara_proto::checksum;
use capybara_tcp::{wire, ConnId, Duration, Endpoint, Event, Instant, TcpConfig, TcpRepr};

pub const CLIENT_IP: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 11);
pub const VIP: Ipv4Addr = Ipv4Addr::new(198, 18, 100, 1);
pub const SERVER_DATA_IP: Ipv4Addr = Ipv4Addr::new(198, 18, 1, 11);
pub const PORT: u16 = 80;

pub fn vip() -> SocketAddrV4 {
    SocketAddrV4::new(VIP, PORT)
}

/// Deterministic PRNG (splitmix64) so tests need no dependency.
#[derive(Debug, Clone)]
pub struct Rng(pub u64);
impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e3779b97f4a7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58476d1ce4e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d049bb133111eb);
        z ^ (z >> 31)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next_u64() % n
        }
    }
    pub fn chance(&mut self, p: f64) -> bool {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64 <= p && p > 0.0
    }
    pub fn fill(&mut self, buf: &mut [u8]) {
        for b in buf {
            *b = self.next_u64() as u8;
        }
    }
}

/// Impairments of one direction of the link.
#[derive(Debug, Clone, Copy)]
pub struct LinkConfig {
    pub latency: Duration,
    pub loss: f64,
    pub duplicate: f64,
    /// Probability that a packet is delayed by up to `reorder_extra` more.
    pub reorder: f64,
    pub reorder_extra: Duration,
}

impl Default for LinkConfig {
    fn default() -> Self {
        LinkConfig {
            latency: Duration::from_millis(5),
            loss: 0.0,
            duplicate: 0.0,
            reorder: 0.0,
            reorder_extra: Duration::from_millis(3),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dir {
    ToServer,
    ToClient,
}

struct InFlight {
    at: Instant,
    src: Ipv4Addr,
    dst: Ipv4Addr,
    bytes: Vec<u8>,
}

pub type DropFilter = Box<dyn FnMut(Dir, &TcpRepr) -> bool>;

pub struct Pair {
    pub client: Endpoint,
    pub server: Endpoint,
    pub now: Instant,
    pub link: LinkConfig,
    pub rng: Rng,
    to_server: VecDeque<InFlight>,
    to_client: VecDeque<InFlight>,
    /// Returns true to drop a specific segment (deterministic loss).
    pub drop_filter: Option<DropFilter>,
    pub delivered: u64,
    pub dropped: u64,
    /// When set, a copy of every segment put on the link (fuzzing corpus).
    pub capture: Option<Vec<(Dir, Vec<u8>)>>,
    /// The server host's clock runs this many µs ahead of the client's (each
    /// host has its own epoch; a migration target usually differs).
    pub server_clock: u64,
    /// Servers the connection was migrated away from (kept for inspection).
    pub retired: Vec<Endpoint>,
}

impl Pair {
    pub fn new(client_cfg: TcpConfig, server_cfg: TcpConfig, link: LinkConfig, seed: u64) -> Pair {
        let mut server = Endpoint::new(server_cfg);
        server.listen(vip()).unwrap();
        Pair {
            client: Endpoint::new(client_cfg),
            server,
            now: Instant::ZERO,
            link,
            rng: Rng(seed),
            to_server: VecDeque::new(),
            to_client: VecDeque::new(),
            drop_filter: None,
            delivered: 0,
            dropped: 0,
            capture: None,
            server_clock: 0,
            retired: Vec::new(),
        }
    }

    /// `now` on the server host's clock.
    pub fn srv_now(&self) -> Instant {
        self.now + Duration::from_micros(self.server_clock)
    }

    /// A server-clock instant on the pair's (client) timeline.
    pub fn srv_to_client(&self, t: Instant) -> Instant {
        Instant::from_micros(t.as_micros().saturating_sub(self.server_clock))
    }

    /// Migrates server connection `s` to a fresh server endpoint whose clock
    /// runs `target_clock` µs ahead of the client's, the way TCPMig does it:
    /// the switch already redirects (packets in flight to the origin are
    /// delivered to the target), the origin exports, the target imports.
    /// Returns the connection's id on the target (taken from `accept`), the
    /// snapshot and the application state the target received.
    pub fn migrate(
        &mut self,
        s: ConnId,
        app: &[u8],
        target_clock: u64,
    ) -> (ConnId, Vec<u8>, Vec<u8>) {
        let mut snap = Vec::new();
        self.server
            .export_to_vec(self.srv_now(), s, app, &mut snap)
            .expect("export");
        assert!(
            self.server.connection(s).is_none(),
            "export removes the connection"
        );
        let mut target = Endpoint::new(self.server.config().clone());
        target.listen(vip()).unwrap();
        self.server_clock = target_clock;
        let imported = target.import(self.srv_now(), &snap).expect("import");
        assert_eq!(
            target.accept(),
            Some(imported.id),
            "imported connections arrive through accept"
        );
        let app_state = snap[imported.app_state.clone()].to_vec();
        let origin = std::mem::replace(&mut self.server, target);
        self.retired.push(origin);
        (imported.id, snap, app_state)
    }

    pub fn default_pair() -> Pair {
        Pair::new(
            TcpConfig::default(),
            TcpConfig::default(),
            LinkConfig::default(),
            1,
        )
    }

    fn enqueue(&mut self, dir: Dir, src: Ipv4Addr, dst: Ipv4Addr, bytes: &[u8]) {
        if let Some(c) = self.capture.as_mut() {
            if c.len() < 4096 {
                c.push((dir, bytes.to_vec()));
            }
        }
        if let Some(f) = self.drop_filter.as_mut() {
            let repr = TcpRepr::parse_bytes(bytes).expect("endpoint emitted a bad segment");
            if f(dir, &repr) {
                self.dropped += 1;
                return;
            }
        }
        if self.rng.chance(self.link.loss) {
            self.dropped += 1;
            return;
        }
        let copies = if self.rng.chance(self.link.duplicate) {
            2
        } else {
            1
        };
        for _ in 0..copies {
            let mut at = self.now + self.link.latency;
            if self.rng.chance(self.link.reorder) {
                let extra = self
                    .rng
                    .below(self.link.reorder_extra.as_micros() as u64 + 1);
                at += Duration::from_micros(extra);
            }
            let p = InFlight {
                at,
                src,
                dst,
                bytes: bytes.to_vec(),
            };
            let q = match dir {
                Dir::ToServer => &mut self.to_server,
                Dir::ToClient => &mut self.to_client,
            };
            // Keep each queue sorted by delivery time (stable for equal times).
            let pos = q.iter().rposition(|x| x.at <= p.at).map_or(0, |i| i + 1);
            q.insert(pos, p);
        }
    }

    /// Moves everything both endpoints want to send onto the link.
    pub fn drive_transmit(&mut self) {
        let mut buf = [0u8; 1600];
        let mut guard = 0u32;
        while let Some(t) = self.client.poll_transmit(self.now, &mut buf) {
            guard += 1;
            if guard > 100_000 {
                let r = TcpRepr::parse_bytes(&buf[..t.len]).unwrap();
                panic!("client emits forever: {r:?}");
            }
            assert_eq!(t.src, CLIENT_IP, "client must send from its address");
            let seg = buf[..t.len].to_vec();
            // The switch rewrites the VIP to the server's data address and
            // patches the TCP checksum (pseudo-header changed).
            assert_eq!(t.dst, VIP);
            let mut seg = seg;
            let c = u16::from_be_bytes([seg[16], seg[17]]);
            let c = checksum::update32(c, u32::from(VIP), u32::from(SERVER_DATA_IP));
            seg[16..18].copy_from_slice(&c.to_be_bytes());
            self.enqueue(Dir::ToServer, t.src, SERVER_DATA_IP, &seg);
        }
        let srv_now = self.srv_now();
        while let Some(t) = self.server.poll_transmit(srv_now, &mut buf) {
            guard += 1;
            if guard > 200_000 {
                let r = TcpRepr::parse_bytes(&buf[..t.len]).unwrap();
                panic!("server emits forever: {r:?}");
            }
            assert_eq!(t.src, VIP, "server must answer from the VIP");
            let p = wire::TcpPacket::new_checked(&buf[..t.len]).unwrap();
            assert!(
                p.verify_checksum(t.src, t.dst),
                "server checksum must use the VIP"
            );
            let seg = buf[..t.len].to_vec();
            self.enqueue(Dir::ToClient, t.src, t.dst, &seg);
        }
    }

    /// Advances to the next event; false when nothing is pending at all.
    pub fn step(&mut self) -> bool {
        self.drive_transmit();
        let next = [
            self.to_server.front().map(|p| p.at),
            self.to_client.front().map(|p| p.at),
            self.client.poll_timeout(),
            self.server.poll_timeout().map(|t| self.srv_to_client(t)),
        ]
        .into_iter()
        .flatten()
        .min();
        let Some(next) = next else { return false };
        self.now = self.now.max(next);
        while self.to_server.front().is_some_and(|p| p.at <= self.now) {
            let p = self.to_server.pop_front().unwrap();
            let srv_now = self.srv_now();
            self.server.handle_segment(srv_now, p.src, p.dst, &p.bytes);
            self.delivered += 1;
        }
        while self.to_client.front().is_some_and(|p| p.at <= self.now) {
            let p = self.to_client.pop_front().unwrap();
            self.client.handle_segment(self.now, p.src, p.dst, &p.bytes);
            self.delivered += 1;
        }
        if self.client.poll_timeout().is_some_and(|t| t <= self.now) {
            self.client.handle_timeout(self.now);
        }
        let srv_now = self.srv_now();
        if self.server.poll_timeout().is_some_and(|t| t <= srv_now) {
            self.server.handle_timeout(srv_now);
        }
        self.drive_transmit();
        true
    }

    /// Steps until `done` holds or `limit` of virtual time passes.
    pub fn run_until(&mut self, limit: Duration, mut done: impl FnMut(&mut Pair) -> bool) -> bool {
        let end = self.now + limit;
        loop {
            if done(self) {
                return true;
            }
            if self.now > end || !self.step() {
                return done(self);
            }
        }
    }

    /// Connects the client to the VIP and accepts on the server.
    pub fn connect(&mut self) -> (ConnId, ConnId) {
        let c = self
            .client
            .connect(self.now, SocketAddrV4::new(CLIENT_IP, 0), vip())
            .unwrap();
        let mut s = None;
        let ok = self.run_until(Duration::from_secs(60), |p| {
            if s.is_none() {
                s = p.server.accept();
            }
            s.is_some() && p.client.state(c) == Some(capybara_tcp::State::Established)
        });
        assert!(
            ok,
            "handshake did not complete: client {:?} server {:?} {:?}",
            self.client.counters(),
            self.server.counters(),
            self.client.connection(c).map(|x| x.state)
        );
        (c, s.unwrap())
    }
}

/// Drains events of an endpoint.
pub fn events(ep: &mut Endpoint) -> Vec<Event> {
    std::iter::from_fn(|| ep.poll_event()).collect()
}

/// Pumps `data` from `from_client ? client : server` to the other side and
/// returns what the receiver read, driving the pair until all is received.
pub fn transfer(
    pair: &mut Pair,
    c: ConnId,
    s: ConnId,
    data: &[u8],
    to_server: bool,
    limit: Duration,
) -> Vec<u8> {
    let mut sent = 0;
    let mut got = Vec::with_capacity(data.len());
    let mut buf = vec![0u8; 64 * 1024];
    let ok = pair.run_until(limit, |p| {
        let (tx, txid, rx, rxid) = if to_server {
            (&mut p.client, c, &mut p.server, s)
        } else {
            (&mut p.server, s, &mut p.client, c)
        };
        while sent < data.len() {
            match tx.send(txid, &data[sent..]) {
                Ok(n) => sent += n,
                Err(_) => break,
            }
        }
        while let Ok(n) = rx.recv(rxid, &mut buf) {
            if n == 0 {
                break;
            }
            got.extend_from_slice(&buf[..n]);
        }
        got.len() >= data.len()
    });
    assert!(
        ok,
        "transfer stalled: sent {sent}, received {} of {}",
        got.len(),
        data.len()
    );
    got
}

/// Compares byte streams without printing megabytes on failure.
#[track_caller]
pub fn assert_same(got: &[u8], want: &[u8], what: &str) {
    if got != want {
        let i = got
            .iter()
            .zip(want)
            .position(|(a, b)| a != b)
            .unwrap_or(got.len().min(want.len()));
        panic!(
            "{what}: streams differ at byte {i} (got {} bytes, want {})",
            got.len(),
            want.len()
        );
    }
}
