//! What the server monitor and the policy engine cost with many
//! connections (docs/POLICIES.md, docs/BENCHMARKS.md).
//!
//! `cargo run --release -p capybara-hostagent --example monitor_bench [CONNS]`
//! (default 100,000). Builds CONNS real established connections between two
//! in-memory TCP endpoints (handshakes through the real state machine), binds
//! them to a monitor, then times: the per-segment update (random connection
//! order, so cache misses count), the refreshes after every connection
//! received a segment (each one bounded by the refresh budget; the pass over
//! all of them spans several) and, for comparison, the same pass in one
//! unbounded refresh, a refresh when none did, the policy's full scan, and
//! two policy decisions that have to select (the first one sizes the
//! candidate buffer), in thread CPU time. Last line: `RESULT conns=...
//! segment_ns=... refresh_max_us=... pass_us=... first_pass_us=... pass_refreshes=...
//! unbounded_us=... refresh_idle_us=... scan_us=... decide_us=...
//! decide_again_us=...`

use capybara_hostagent::monitor::Monitor;
use capybara_hostagent::policy::{PolicyEngine, Tunables};
use capybara_proto::load::LoadRepr;
use capybara_proto::time::{Duration, Instant};
use capybara_proto::{FlowKey, ServerId};
use capybara_tcp::{Endpoint, TcpConfig};
use std::net::{Ipv4Addr, SocketAddrV4};

/// A stopwatch of this thread's CPU time: the machine is shared, and wall
/// time would count other processes' turns on the cores.
struct Wall(u64);

impl Wall {
    fn now() -> Wall {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: valid pointer to a timespec; the clock always exists.
        unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
        Wall(ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64)
    }
    fn elapsed(&self) -> std::time::Duration {
        std::time::Duration::from_nanos(Wall::now().0.saturating_sub(self.0))
    }
}

fn endpoint() -> Endpoint {
    Endpoint::new(TcpConfig {
        rx_buffer: 4096,
        tx_buffer: 4096,
        syn_backlog: 4096,
        accept_backlog: 4096,
        ..TcpConfig::default()
    })
}

fn shuttle(now: Instant, from: &mut Endpoint, to: &mut Endpoint, buf: &mut [u8]) -> usize {
    let mut n = 0;
    while let Some(t) = from.poll_transmit(now, buf) {
        to.handle_segment(now, t.src, t.dst, &buf[..t.len]);
        n += 1;
    }
    n
}

fn main() {
    let conns: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(100_000);
    let vip = SocketAddrV4::new(Ipv4Addr::new(198, 18, 100, 1), 80);
    let mut server = endpoint();
    let mut client = endpoint();
    // The client picks ephemeral ports per remote address: one service port
    // per 10,000 connections.
    for p in 0..(conns / 10_000 + 1) {
        server
            .listen(SocketAddrV4::new(*vip.ip(), 80 + p as u16))
            .expect("listen");
    }
    let mut now = Instant::from_millis(1);
    let mut buf = vec![0u8; 2048];
    let t0 = Wall::now();
    let mut ids = Vec::with_capacity(conns);
    for i in 0..conns {
        let ip = Ipv4Addr::new(198, 18, 0, 10);
        let remote = SocketAddrV4::new(*vip.ip(), 80 + (i / 10_000) as u16);
        client
            .connect(now, SocketAddrV4::new(ip, 0), remote)
            .expect("connect");
        if i % 1000 == 999 {
            while shuttle(now, &mut client, &mut server, &mut buf)
                + shuttle(now, &mut server, &mut client, &mut buf)
                > 0
            {}
            while let Some(id) = server.accept() {
                ids.push(id);
            }
            now += Duration::from_micros(10);
        }
    }
    while shuttle(now, &mut client, &mut server, &mut buf)
        + shuttle(now, &mut server, &mut client, &mut buf)
        > 0
    {}
    while let Some(id) = server.accept() {
        ids.push(id);
    }
    eprintln!(
        "{} connections established in {:.1} s",
        ids.len(),
        t0.elapsed().as_secs_f64()
    );
    let mut monitor = Monitor::new(Duration::from_millis(50));
    let flows: Vec<FlowKey> = ids
        .iter()
        .map(|id| server.flow_key(*id).expect("flow"))
        .collect();
    for (id, f) in ids.iter().zip(&flows) {
        monitor.bind(now, *f, *id, false);
    }
    // Per segment: a pseudo-random walk over the connections.
    let segments = 20_000_000u64;
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let order: Vec<u32> = (0..1 << 20)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % flows.len() as u64) as u32
        })
        .collect();
    let t = Wall::now();
    for k in 0..segments {
        let f = &flows[order[(k as usize) & ((1 << 20) - 1)] as usize];
        // 1 µs of virtual time per segment: 1 Mpps.
        monitor.on_segment(now + Duration::from_micros(k / 1_000_000), f, 100);
    }
    let segment_ns = t.elapsed().as_nanos() as f64 / segments as f64;
    now += Duration::from_secs(20);
    // Every connection dirty: the pass over all of them, refresh by
    // refresh (each bounded by the budget), as the stack's 1 ms loop runs
    // it. Twice: the first pass follows the segment walk above (the
    // endpoint's connections are read for the first time since they were
    // set up), the second one a fresh round of segments.
    let pass = |monitor: &mut Monitor| {
        let passes = monitor.stats.passes;
        let (mut total, mut longest, mut refreshes) = (0u64, 0u64, 0u64);
        while monitor.stats.passes == passes {
            let t = Wall::now();
            monitor.refresh(&server);
            let ns = t.elapsed().as_nanos() as u64;
            total += ns;
            longest = longest.max(ns);
            refreshes += 1;
        }
        (total as f64 / 1e3, longest as f64 / 1e3, refreshes)
    };
    let (first_pass_us, first_max_us, _) = pass(&mut monitor);
    for f in &flows {
        monitor.on_segment(now, f, 100);
    }
    let (pass_us, second_max_us, pass_refreshes) = pass(&mut monitor);
    let refresh_max_us = first_max_us.max(second_max_us);
    // The same pass in one refresh (no budget: how every refresh ran
    // before the budget), for a side-by-side comparison.
    for f in &flows {
        monitor.on_segment(now, f, 100);
    }
    monitor.set_refresh_budget(usize::MAX);
    let t = Wall::now();
    monitor.refresh(&server);
    let unbounded_us = t.elapsed().as_nanos() as f64 / 1e3;
    monitor.set_refresh_budget(capybara_hostagent::monitor::REFRESH_BUDGET);
    // Refresh with none dirty (only the bounded sweep), averaged.
    let t = Wall::now();
    let rounds = 10_000;
    for _ in 0..rounds {
        monitor.refresh(&server);
    }
    let refresh_idle_us = t.elapsed().as_nanos() as f64 / 1e3 / f64::from(rounds);
    // The policy's scan of every connection.
    let t = Wall::now();
    let scanned = monitor.connections(now).filter(|c| c.pps > 0.0).count();
    let scan_us = t.elapsed().as_nanos() as f64 / 1e3;
    // One decision that must select (own load 30 % over the pool average).
    let mut engine = PolicyEngine::new(Tunables::default());
    for s in 1..=100u64 {
        engine.on_load(
            Instant::from_micros(now.as_micros() - (100 - s) * 1000),
            &LoadRepr {
                epoch: 1,
                sequence: s,
                interval_us: 1000,
                server_id: ServerId(1),
                own_load: 1300,
                pool_load: 2000,
                live_servers: 2,
                least_loaded: Ipv4Addr::new(198, 18, 2, 12),
                weights: None,
            },
        );
    }
    let when = now;
    let totals = monitor.totals(when);
    let mut orders = Vec::new();
    let t = Wall::now();
    engine.decide(when, &totals, monitor.connections(when), &mut orders);
    let decide_us = t.elapsed().as_nanos() as f64 / 1e3;
    // A second decision: its candidate buffer is already sized (the first
    // one grew it), as in a running server.
    let first_orders = orders.len();
    let t = Wall::now();
    engine.decide(when, &totals, monitor.connections(when), &mut orders);
    let decide_again_us = t.elapsed().as_nanos() as f64 / 1e3;
    eprintln!(
        "segment update {segment_ns:.1} ns; all {} dirty: a pass of {pass_refreshes} refreshes, \
         {pass_us:.0} us in all (the first pass after the segment walk {first_pass_us:.0} us) ({:.1} ns per connection), the longest refresh {refresh_max_us:.0} us; \
         the same pass in one unbounded refresh {unbounded_us:.0} us; idle refresh \
         {refresh_idle_us:.2} us; scan of {scanned} {scan_us:.0} us; decision ({first_orders} orders) \
         {decide_us:.0} us, the next one ({} orders) {decide_again_us:.0} us",
        flows.len(),
        pass_us * 1e3 / flows.len() as f64,
        orders.len() - first_orders
    );
    println!(
        "RESULT conns={} segment_ns={segment_ns:.1} refresh_max_us={refresh_max_us:.0} \
         pass_us={pass_us:.0} first_pass_us={first_pass_us:.0} pass_refreshes={pass_refreshes} unbounded_us={unbounded_us:.0} \
         refresh_idle_us={refresh_idle_us:.2} scan_us={scan_us:.0} decide_us={decide_us:.0} \
         decide_again_us={decide_again_us:.0}",
        flows.len()
    );
}
