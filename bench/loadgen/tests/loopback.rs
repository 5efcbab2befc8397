//! End-to-end tests: the real load generator against the real test server
//! over loopback TCP. The tests take a global lock so that they do not
//! compete for the CPU with each other (the properties checked are about
//! the emulation and the schedule, not about timing goals).

use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use capybara_loadgen::{run_blocking, Config, Dist, Report, StepConfig, StepSubset};
use capybara_testserver::{run_listener, Core, ServerConfig, ServiceTime};

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// Start a test server on an ephemeral loopback port in its own thread.
fn start_server(id: &str, service: ServiceTime, body: usize) -> (SocketAddr, Arc<Core>) {
    let std_listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    std_listener.set_nonblocking(true).unwrap();
    let addr = std_listener.local_addr().unwrap();
    let core = Core::new(ServerConfig {
        id: id.into(),
        service,
        body_bytes: body,
        ..Default::default()
    });
    let c = core.clone();
    std::thread::spawn(move || {
        capybara_testserver::hrtime::set_fine_timer_slack();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let l = tokio::net::TcpListener::from_std(std_listener).unwrap();
            let _ = run_listener(l, c).await;
        });
    });
    (addr, core)
}

/// Start a raw TCP server that answers every request with `reply` and then
/// optionally closes.
fn start_raw_server(reply: &'static [u8], close: bool) -> SocketAddr {
    let std_listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    std_listener.set_nonblocking(true).unwrap();
    let addr = std_listener.local_addr().unwrap();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let l = tokio::net::TcpListener::from_std(std_listener).unwrap();
            loop {
                let (mut s, _) = l.accept().await.unwrap();
                tokio::spawn(async move {
                    let mut buf = [0u8; 4096];
                    loop {
                        match s.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(_) => {
                                if s.write_all(reply).await.is_err() || close {
                                    return;
                                }
                            }
                        }
                    }
                });
            }
        });
    });
    addr
}

fn cfg(addr: SocketAddr, rate: f64, secs: f64) -> Config {
    let mut c = Config::new(addr);
    c.rate = rate;
    c.duration = Duration::from_secs_f64(secs);
    c
}

fn run(c: Config) -> Report {
    let r = run_blocking(c).expect("load generator run");
    eprintln!("{}{}", r.human(), r.result_line());
    r
}

fn poisson_ok(got: f64, expected: f64, sds: f64) -> bool {
    (got - expected).abs() <= sds * expected.sqrt() + 1.0
}

// Capacity 2000 requests/s: slow enough for debug builds on a busy machine.
const SERVICE: ServiceTime = ServiceTime::Fixed(500_000);
const CAPACITY: f64 = 2000.0;

#[test]
fn half_capacity_has_no_errors_and_every_response_is_validated() {
    let _g = serial();
    let (addr, core) = start_server("t1", SERVICE, 128);
    let mut c = cfg(addr, 0.5 * CAPACITY, 1.5);
    c.conns = 10;
    c.short_rate = 0.2 * c.rate; // 20% of requests on short flows
    c.short_requests = 2;
    c.expect_body = Some(128);
    let r = run(c);
    assert_eq!(
        r.errors, 0,
        "errors: {:?} first: {:?}",
        r.errors_by_kind, r.first_error
    );
    assert_eq!(r.requests, r.sent, "every request answered");
    assert_eq!(r.validated, r.requests);
    assert!(poisson_ok(r.sent as f64, 1500.0, 5.0), "sent {}", r.sent);
    assert!(r.short_requests > 0 && r.long_requests > 0);
    assert_eq!(r.short_requests, 2 * r.short_conns_opened);
    assert_eq!(
        r.per_server.get("t1").copied(),
        Some(r.requests),
        "x-server counted"
    );
    let rows = &r.timeline.rows;
    assert!(rows.len() >= 15);
    assert_eq!(rows.iter().map(|x| x.completed).sum::<u64>(), r.requests);
    assert_eq!(rows.iter().map(|x| x.sent).sum::<u64>(), r.sent);
    let st = core.stats();
    assert_eq!(st.served, r.requests);
    assert!(
        st.busy_fraction > 0.2 && st.busy_fraction <= 1.0,
        "busy {}",
        st.busy_fraction
    );
    // Latency can never be below the service time: it is measured from the
    // scheduled send time and the server really waits.
    assert!(
        r.latency["all"].min_us >= 499.0,
        "min {}",
        r.latency["all"].min_us
    );
}

#[test]
fn latency_grows_when_over_capacity() {
    let _g = serial();
    let (a1, _) = start_server("u", SERVICE, 64);
    let mut c = cfg(a1, 0.5 * CAPACITY, 1.0);
    c.conns = 10;
    let under = run(c);
    let (a2, core2) = start_server("o", SERVICE, 64);
    let mut c = cfg(a2, 1.2 * CAPACITY, 1.0);
    c.conns = 10;
    c.timeout = Duration::from_secs(5);
    let over = run(c);
    assert_eq!(over.errors, 0, "{:?}", over.first_error);
    let (p_under, p_over) = (under.latency["all"].p99_us, over.latency["all"].p99_us);
    // At 120% the queue grows by ~400 requests/s x 0.5 ms: ~200 ms by the end.
    assert!(
        p_over > 3.0 * p_under,
        "p99 over {p_over} us vs under {p_under} us"
    );
    assert!(p_over > 50_000.0, "p99 over capacity {p_over} us");
    // Open loop: the sender kept its schedule although the server fell behind.
    assert!(
        poisson_ok(over.sent as f64, 2400.0, 5.0),
        "sent {}",
        over.sent
    );
    // The server never exceeds its capacity.
    let st = core2.stats();
    assert!(st.busy_fraction <= 1.0);
    let first_half: u64 = over.timeline.rows.iter().take(5).map(|r| r.completed).sum();
    assert!(
        (first_half as f64) < 0.5 * CAPACITY * 1.05 + 10.0,
        "served {first_half} in 0.5 s"
    );
}

#[test]
fn zipf_shares_follow_zipf() {
    let _g = serial();
    let (addr, _) = start_server("z", ServiceTime::Fixed(20_000), 16); // 50k rps capacity
    let mut c = cfg(addr, 3000.0, 1.0);
    c.conns = 20;
    c.dist = Dist::Zipf { alpha: 1.0 };
    let r = run(c);
    assert_eq!(r.errors, 0, "{:?}", r.first_error);
    let total = r.sent as f64;
    let mut weights: Vec<f64> = r.connections.iter().map(|c| c.weight).collect();
    // Weights are the Zipf(1.0) weights over 20 ranks, in a shuffled order.
    weights.sort_by(|a, b| b.partial_cmp(a).unwrap());
    let h: f64 = (1..=20).map(|k| 1.0 / k as f64).sum();
    for (k, w) in weights.iter().enumerate() {
        assert!((w - 1.0 / ((k + 1) as f64 * h)).abs() < 1e-12);
    }
    for c in &r.connections {
        let exp = c.weight * total;
        let sd = (exp * (1.0 - c.weight)).sqrt();
        assert!(
            (c.sent as f64 - exp).abs() <= 5.0 * sd + 2.0,
            "conn {} sent {} expected {exp:.0} (weight {:.4})",
            c.conn,
            c.sent,
            c.weight
        );
        assert_eq!(c.sent, c.completed);
    }
}

#[test]
fn arrivals_are_poisson_at_the_rate() {
    let _g = serial();
    let (addr, _) = start_server("p", ServiceTime::Fixed(20_000), 16);
    let mut c = cfg(addr, 2000.0, 1.0);
    c.conns = 4;
    c.interval = Duration::from_millis(10);
    let r = run(c);
    assert!(poisson_ok(r.sent as f64, 2000.0, 5.0), "sent {}", r.sent);
    // Counts per 10 ms interval: Poisson(20) has variance = mean. A fixed
    // schedule would have variance ~0, a bursty one far above.
    let counts: Vec<f64> = r
        .timeline
        .rows
        .iter()
        .take(100)
        .map(|x| x.sent as f64)
        .collect();
    assert_eq!(counts.len(), 100);
    let mean = counts.iter().sum::<f64>() / 100.0;
    let var = counts.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / 99.0;
    assert!((17.0..23.0).contains(&mean), "mean per interval {mean}");
    assert!(
        (0.6..1.6).contains(&(var / mean)),
        "dispersion {}",
        var / mean
    );
}

#[test]
fn step_load_rises_on_the_chosen_connections() {
    let _g = serial();
    let (addr, _) = start_server("s", ServiceTime::Fixed(20_000), 16);
    let mut c = cfg(addr, 500.0, 1.0);
    c.conns = 10;
    c.dist = Dist::Step;
    c.interval = Duration::from_millis(200);
    c.step = Some(StepConfig {
        subset: StepSubset::Conns(vec![0, 1, 2, 3, 4]),
        start: Duration::from_millis(200),
        interval: Duration::from_millis(200),
        step_rps: 500.0,
        max_steps: u64::MAX,
    });
    let r = run(c);
    assert_eq!(r.errors, 0, "{:?}", r.first_error);
    let subset: u64 = r.connections[..5].iter().map(|c| c.sent).sum();
    let rest: u64 = r.connections[5..].iter().map(|c| c.sent).sum();
    // Base 250 each side; the step adds 500 x 0.2 s x (1+2+3+4) = 1000.
    assert!(poisson_ok(subset as f64, 1250.0, 5.0), "subset {subset}");
    assert!(poisson_ok(rest as f64, 250.0, 5.0), "rest {rest}");
    let sent: Vec<u64> = r.timeline.rows.iter().take(5).map(|x| x.sent).collect();
    for (k, s) in sent.iter().enumerate() {
        let exp = 100.0 + 100.0 * k as f64;
        assert!(
            poisson_ok(*s as f64, exp, 5.0),
            "interval {k}: {s} vs {exp}"
        );
    }
}

#[test]
fn step_subset_by_server_id() {
    let _g = serial();
    let (addr, _) = start_server("only", ServiceTime::Fixed(20_000), 16);
    let mut c = cfg(addr, 200.0, 0.6);
    c.conns = 4;
    c.dist = Dist::Step;
    c.step = Some(StepConfig {
        subset: StepSubset::Server("only".into()),
        start: Duration::from_millis(200),
        interval: Duration::from_millis(200),
        step_rps: 400.0,
        max_steps: 1,
    });
    let r = run(c);
    assert_eq!(r.step_subset, Some(vec![0, 1, 2, 3]));
    assert!(
        poisson_ok(r.sent as f64, 120.0 + 160.0, 5.0),
        "sent {}",
        r.sent
    );
}

#[test]
fn errors_are_counted_by_kind() {
    let _g = serial();
    // Nothing listens: a clear error, no panic.
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let e = run_blocking(cfg(closed, 100.0, 0.2)).unwrap_err();
    assert!(e.contains(&closed.to_string()), "{e}");

    // Well-formed responses with the wrong status.
    let a = start_raw_server(b"HTTP/1.1 503 Busy\r\ncontent-length: 0\r\n\r\n", false);
    let r = run(cfg(a, 200.0, 0.3));
    assert_eq!(r.requests, 0);
    assert!(
        r.errors_by_kind["bad_status"] > 20,
        "{:?}",
        r.errors_by_kind
    );

    // Garbage instead of HTTP: bad_response, and the connections reconnect.
    let a = start_raw_server(b"SSH-2.0-OpenSSH_9.2\r\n", false);
    let r = run(cfg(a, 200.0, 0.3));
    assert_eq!(r.requests, 0);
    assert!(
        r.errors_by_kind["bad_response"] > 0,
        "{:?}",
        r.errors_by_kind
    );
    assert!(r.connections.iter().any(|c| c.reconnects > 0));

    // A body shorter than announced, then close.
    let a = start_raw_server(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nhello", true);
    let r = run(cfg(a, 200.0, 0.3));
    assert_eq!(r.requests, 0);
    assert!(r.errors_by_kind["closed"] > 0, "{:?}", r.errors_by_kind);

    // Right framing, wrong body length.
    let a = start_raw_server(b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\n\r\nabc", false);
    let mut c = cfg(a, 200.0, 0.3);
    c.expect_body = Some(256);
    let r = run(c);
    assert_eq!(r.requests, 0);
    assert!(
        r.errors_by_kind["bad_response"] > 20,
        "{:?}",
        r.errors_by_kind
    );
}

#[test]
fn outstanding_cap_bounds_pipelining() {
    let _g = serial();
    // A server far too slow: 20 ms per request, 50 rps capacity, offered 1000.
    let (addr, _) = start_server("slow", ServiceTime::Fixed(20_000_000), 16);
    let mut c = cfg(addr, 1000.0, 0.5);
    c.conns = 2;
    c.max_outstanding = 8;
    c.timeout = Duration::from_millis(300);
    let r = run(c);
    assert!(r.errors_by_kind["overflow"] > 300, "{:?}", r.errors_by_kind);
    assert!(r.sent <= 2 * 8 + 2 * 8 * 25, "sent {}", r.sent);
}
