//! The per-packet path allocates nothing: frames move device -> Interface
//! (Ethernet/ARP/IPv4) -> `Transports` (server monitor, TCP endpoint) and
//! back through `driver::poll`, exactly as the runtime drives them, and once
//! connections are established and buffers warm, thousands of segments in
//! both directions cause zero heap allocations. A counting global allocator
//! sees every allocation of the test process.
//!
//! The in-memory link stands in for the NIC (it recycles its frame buffers);
//! the application side reads and writes with `Endpoint::recv`/`send` into
//! fixed buffers, as the socket layer does.

use std::alloc::{GlobalAlloc, Layout, System};
use std::net::{Ipv4Addr, SocketAddrV4};
use std::sync::atomic::{AtomicU64, Ordering};

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
    ) -> Node {
        let mac = EthernetAddress([2, 0, 0, 0, 0, mac]);
        let iface = Interface::new(InterfaceConfig::new(mac, ip, gw)).unwrap();
        Node {
            iface,
            dev: dev.with_mac(mac),
            t: Transports::new(Endpoint::new(TcpConfig::default()), ip),
        }
    }
    fn poll(&mut self, now: Instant) -> usize {
        let r = driver::poll(now, &mut self.iface, &mut self.dev, &mut self.t, 32).unwrap();
        r.received + r.transmitted
    }
}

#[test]
fn steady_state_traffic_allocates_nothing() {
    let (a, b) = pair(LinkConfig::default());
    let mut client = Node::new(a, 1, CLIENT, SERVER);
    let mut server = Node::new(b, 2, SERVER, CLIENT);
    let vip = SocketAddrV4::new(SERVER, 80);
    server.t.tcp.listen(vip).unwrap();
    let mut now = Instant::from_millis(1);
    let mut cids: Vec<ConnId> = (0..CONNS)
        .map(|_| {
            client
                .t
                .tcp
                .connect(now, SocketAddrV4::new(CLIENT, 0), vip)
                .unwrap()
        })
        .collect();
    let mut sids: Vec<ConnId> = Vec::with_capacity(CONNS);
    let msg = [0x5au8; 700];
    let mut buf = [0u8; 4096];
    let (c_got, s_got) = (std::cell::Cell::new(0u64), std::cell::Cell::new(0u64));
    // One round: every client sends a request, the server echoes what it
    // reads, the client drains; both sides poll their device.
    let mut round = |now: Instant,
                     client: &mut Node,
                     server: &mut Node,
                     cids: &mut Vec<ConnId>,
                     sids: &mut Vec<ConnId>|
     -> usize {
        let mut moved = 0;
        for &c in cids.iter() {
            let _ = client.t.tcp.send(c, &msg);
        }
        moved += client.poll(now) + server.poll(now);
        while let Some(s) = server.t.tcp.accept() {
            sids.push(s);
        }
        for &s in sids.iter() {
            while let Ok(n) = server.t.tcp.recv(s, &mut buf) {
                if n == 0 {
                    break;
                }
                s_got.set(s_got.get() + n as u64);
                let _ = server.t.tcp.send(s, &buf[..n]);
            }
        }
        moved += server.poll(now) + client.poll(now);
        for &c in cids.iter() {
            while let Ok(n) = client.t.tcp.recv(c, &mut buf) {
                if n == 0 {
                    break;
                }
                c_got.set(c_got.get() + n as u64);
            }
        }
        while client.t.tcp.poll_event().is_some() {}
        while server.t.tcp.poll_event().is_some() {}
        moved
    };
    // Warm-up: handshakes, ARP, buffers and maps reach their sizes.
    for _ in 0..2000 {
        now += Duration::from_micros(200);
        round(now, &mut client, &mut server, &mut cids, &mut sids);
    }
    assert_eq!(sids.len(), CONNS, "all connections accepted");
    let (c0, s0) = (c_got.get(), s_got.get());
    let before = ALLOCS.load(Ordering::Relaxed);
    let mut frames = 0;
    for _ in 0..5000 {
        now += Duration::from_micros(200);
        frames += round(now, &mut client, &mut server, &mut cids, &mut sids);
    }
    let allocs = ALLOCS.load(Ordering::Relaxed) - before;
    let (c_bytes, s_bytes) = (c_got.get() - c0, s_got.get() - s0);
    eprintln!("{frames} frames, {s_bytes} B to the server, {c_bytes} B back: {allocs} allocations");
    assert!(frames > 20_000, "traffic flowed: {frames} frames");
    assert!(
        s_bytes > 10_000_000 && c_bytes > 10_000_000,
        "{s_bytes} {c_bytes}"
    );
    assert_eq!(allocs, 0, "the per-packet path allocated");
}
