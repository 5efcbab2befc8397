//! The per-packet path allocates nothing: frames move device -> Interface
//! (Ethernet/ARP/IPv4) -> `Transports` (server monitor, TCP endpoint) and
//! back through `driver::poll`, exactly as the runtime drives them, and once
//! connections are established and buffers warm, thousands of segments in
//! both directions cause zero heap allocations. A counting global allocator
//! sees every allocation of the test process.
//!
//! The in-memory link stands in for the NIC (it recycles its frame buffers);
//! the application side reads and writes with `Endpoint::recv`/`send` into
//! fixed buffers, as the socket layer does. Both endpoints run the
//! hostagent's default `[tcp]` settings, keep-alive on (every segment
//! restarts its idle time).

use std::alloc::{GlobalAlloc, Layout, System};
use std::net::{Ipv4Addr, SocketAddrV4};
use std::sync::atomic::{AtomicU64, Ordering};

use capybara_hostagent::config::TcpSection;
use capybara_hostagent::stack::Transports;
use capybara_net::device::memory::{pair, LinkConfig};
use capybara_net::driver;
use capybara_net::wire::EthernetAddress;
use capybara_net::{Interface, InterfaceConfig};
use capybara_proto::time::{Duration, Instant};
use capybara_tcp::{ConnId, Endpoint, TcpConfig};

struct Counting;
static ALLOCS: AtomicU64 = AtomicU64::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        unsafe { System.realloc(p, l, n) }
    }
}

#[global_allocator]
static A: Counting = Counting;

const CLIENT: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 11);
const SERVER: Ipv4Addr = Ipv4Addr::new(198, 18, 2, 11);
const CONNS: usize = 8;

struct Node {
    iface: Interface,
    dev: capybara_net::device::memory::MemoryDevice,
    t: Transports,
}

impl Node {
    fn new(
        dev: capybara_net::device::memory::MemoryDevice,
        mac: u8,
        ip: Ipv4Addr,
        gw: Ipv4Addr,
        keepalive: bool,
    ) -> Node {
        let mac = EthernetAddress([2, 0, 0, 0, 0, mac]);
        let iface = Interface::new(InterfaceConfig::new(mac, ip, gw)).unwrap();
        Node {
            iface,
            dev: dev.with_mac(mac),
            t: Transports::new(
                Endpoint::new(TcpConfig {
                    keepalive: TcpSection::default().keepalive().filter(|_| keepalive),
                    ..TcpConfig::default()
                }),
                ip,
            ),
        }
    }
    fn poll(&mut self, now: Instant) -> usize {
        let r = driver::poll(now, &mut self.iface, &mut self.dev, &mut self.t, 32).unwrap();
        r.received + r.transmitted
    }
}

/// Echo traffic over `CONNS` connections: every round each client sends a
/// request, the server echoes what it reads, the client drains; both sides
/// poll their device, as the runtime does.
struct Echo {
    client: Node,
    server: Node,
    cids: Vec<ConnId>,
    sids: Vec<ConnId>,
    now: Instant,
    buf: [u8; 4096],
    /// Bytes the server and the client read.
    s_got: u64,
    c_got: u64,
}

impl Echo {
    /// `keepalive`: the hostagent's default keep-alive, else none.
    fn new(keepalive: bool) -> Echo {
        let (a, b) = pair(LinkConfig::default());
        let mut client = Node::new(a, 1, CLIENT, SERVER, keepalive);
        let mut server = Node::new(b, 2, SERVER, CLIENT, keepalive);
        let vip = SocketAddrV4::new(SERVER, 80);
        server.t.tcp.listen(vip).unwrap();
        let now = Instant::from_millis(1);
        let cids = (0..CONNS)
            .map(|_| {
                client
                    .t
                    .tcp
                    .connect(now, SocketAddrV4::new(CLIENT, 0), vip)
                    .unwrap()
            })
            .collect();
        let mut e = Echo {
            client,
            server,
            cids,
            sids: Vec::with_capacity(CONNS),
            now,
            buf: [0; 4096],
            s_got: 0,
            c_got: 0,
        };
        // Warm-up: handshakes, ARP, buffers and maps reach their sizes.
        for _ in 0..2000 {
            e.round();
        }
        assert_eq!(e.sids.len(), CONNS, "all connections accepted");
        e
    }

    /// One round 200 us after the last; returns the frames moved.
    fn round(&mut self) -> usize {
        const MSG: [u8; 700] = [0x5a; 700];
        self.now += Duration::from_micros(200);
        let now = self.now;
        let mut moved = 0;
        for &c in &self.cids {
            let _ = self.client.t.tcp.send(c, &MSG);
        }
        moved += self.client.poll(now) + self.server.poll(now);
        while let Some(s) = self.server.t.tcp.accept() {
            self.sids.push(s);
        }
        for &s in &self.sids {
            while let Ok(n) = self.server.t.tcp.recv(s, &mut self.buf) {
                if n == 0 {
                    break;
                }
                self.s_got += n as u64;
                let _ = self.server.t.tcp.send(s, &self.buf[..n]);
            }
        }
        moved += self.server.poll(now) + self.client.poll(now);
        for &c in &self.cids {
            while let Ok(n) = self.client.t.tcp.recv(c, &mut self.buf) {
                if n == 0 {
                    break;
                }
                self.c_got += n as u64;
            }
        }
        while self.client.t.tcp.poll_event().is_some() {}
        while self.server.t.tcp.poll_event().is_some() {}
        moved
    }
}

#[test]
fn steady_state_traffic_allocates_nothing() {
    let mut e = Echo::new(true);
    assert!(
        e.server.t.tcp.config().keepalive.is_some(),
        "keep-alive on, as the hostagent runs"
    );
    let (c0, s0) = (e.c_got, e.s_got);
    let before = ALLOCS.load(Ordering::Relaxed);
    let mut frames = 0;
    for _ in 0..5000 {
        frames += e.round();
    }
    let allocs = ALLOCS.load(Ordering::Relaxed) - before;
    let (c_bytes, s_bytes) = (e.c_got - c0, e.s_got - s0);
    eprintln!("{frames} frames, {s_bytes} B to the server, {c_bytes} B back: {allocs} allocations");
    eprintln!(
        "timer heap entries: client {}, server {} ({CONNS} connections each)",
        e.client.t.tcp.timer_heap_len(),
        e.server.t.tcp.timer_heap_len()
    );
    assert!(frames > 20_000, "traffic flowed: {frames} frames");
    assert!(
        s_bytes > 10_000_000 && c_bytes > 10_000_000,
        "{s_bytes} {c_bytes}"
    );
    assert_eq!(allocs, 0, "the per-packet path allocated");
}

/// The same traffic for counting the per-packet path's instructions with
/// callgrind (repeatable on a loaded machine); it measures, it checks
/// little. `CAPYBARA_INSTR_ROUNDS` rounds (default 5000) after the warm-up
/// (`CAPYBARA_INSTR_KEEPALIVE=0`: keep-alive off); count only
/// `driver::poll` (device in, interface, TCP, device out, timers), and
/// divide the difference from a run with 0 rounds (the warm-up alone) by
/// the frames printed:
///
/// ```text
/// valgrind --tool=callgrind --callgrind-out-file=/tmp/pkt.cg \
///   --toggle-collect='capybara_net::driver::poll' \
///   TEST_BINARY --ignored --exact per_packet_path_for_callgrind --nocapture
/// callgrind_annotate --inclusive=yes /tmp/pkt.cg | head -60
/// ```
///
/// (The name exactly: a pattern ending in `*` also matches `poll`'s
/// closures, and entering one toggles collection off.)
#[test]
#[ignore]
fn per_packet_path_for_callgrind() {
    let rounds = std::env::var("CAPYBARA_INSTR_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5000u32);
    let keepalive = std::env::var("CAPYBARA_INSTR_KEEPALIVE").map_or(true, |v| v != "0");
    let mut e = Echo::new(keepalive);
    let mut frames = 0;
    for _ in 0..rounds {
        frames += e.round();
    }
    eprintln!(
        "{rounds} rounds, {frames} frames, keep-alive {keepalive}, \
         timer heap entries: client {}, server {}",
        e.client.t.tcp.timer_heap_len(),
        e.server.t.tcp.timer_heap_len()
    );
}
