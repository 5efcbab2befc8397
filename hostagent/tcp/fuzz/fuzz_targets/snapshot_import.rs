//! `cargo +nightly fuzz run snapshot_import`: connection snapshots are
//! untrusted bytes. Parsing must not panic, whatever parses must re-emit to
//! the same bytes, and an import either succeeds or leaves the endpoint
//! untouched; an imported connection must survive its timers.
#![no_main]

use capybara_tcp::snapshot::Snapshot;
use capybara_tcp::{Duration, Endpoint, Instant, TcpConfig};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(snap) = Snapshot::parse_bytes(data) {
        let mut out = vec![0u8; snap.buffer_len()];
        let n = snap.emit(&mut out).unwrap();
        assert_eq!(&out[..n], data);
    }
    let mut ep = Endpoint::new(TcpConfig { rx_buffer: 64 * 1024, tx_buffer: 64 * 1024, ..TcpConfig::default() });
    let now = Instant::from_millis(1_000_000);
    match ep.import(now, data) {
        Ok(_) => {
            let mut buf = [0u8; 1600];
            let mut t = now;
            for _ in 0..8 {
                while ep.poll_transmit(t, &mut buf).is_some() {}
                match ep.poll_timeout() {
                    Some(d) => {
                        t = d.max(t) + Duration::from_millis(1);
                        ep.handle_timeout(t);
                    }
                    None => break,
                }
            }
        }
        Err(_) => assert_eq!(ep.connection_count(), 0),
    }
});
