//! The steady state allocates nothing per request: a run twice as long
//! (twice the requests) makes about the same number of heap allocations.
//! Counts every allocation of the process (load generator and test server).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use capybara_loadgen::{run_blocking, Config, Dist};
use capybara_testserver::{run_listener, Core, ServerConfig, ServiceTime};

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

#[test]
fn no_allocation_per_request_in_steady_state() {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.set_nonblocking(true).unwrap();
    let addr = l.local_addr().unwrap();
    let core = Core::new(ServerConfig {
        service: ServiceTime::Fixed(20_000),
        ..Default::default()
    });
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let _ = run_listener(tokio::net::TcpListener::from_std(l).unwrap(), core).await;
        });
    });
    let measure = |secs: f64| {
        let mut c = Config::new(addr);
        c.rate = 3000.0;
        c.conns = 10;
        c.dist = Dist::Zipf { alpha: 1.2 };
        c.duration = Duration::from_secs_f64(secs);
        c.interval = Duration::from_millis(100);
        let before = ALLOCS.load(Ordering::Relaxed);
        let r = run_blocking(c).unwrap();
        let n = ALLOCS.load(Ordering::Relaxed) - before;
        assert_eq!(r.errors, 0, "{:?}", r.first_error);
        (r.requests, n)
    };
    measure(0.3); // warm up lazily initialised runtime state
    let (req1, a1) = measure(0.5);
    let (req2, a2) = measure(1.0);
    let extra_requests = req2.saturating_sub(req1) as f64;
    let extra_allocs = a2.saturating_sub(a1) as f64;
    eprintln!("0.5 s: {req1} requests {a1} allocations; 1.0 s: {req2} requests {a2} allocations");
    // Per-interval timeline rows allocate a little (5 more rows); requests must not.
    assert!(extra_requests > 1000.0);
    assert!(
        extra_allocs < 0.05 * extra_requests,
        "{extra_allocs} allocations for {extra_requests} more requests"
    );
}
