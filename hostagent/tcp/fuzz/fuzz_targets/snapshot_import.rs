//! `cargo +nightly fuzz run snapshot_import`: connection snapshots are
//! untrusted bytes. Parsing must not panic, whatever parses must re-emit to
//! the same bytes (also into a `max_len` buffer, without the sizing pass,
//! and fail one byte short), an import either succeeds or leaves the
//! endpoint untouched, an imported connection re-exports (straight from the
//! connection) to the same bytes at the same instant, and it must survive
//! its timers.
#![no_main]

use capybara_tcp::snapshot::{Snapshot, SnapshotError};
use capybara_tcp::{Duration, Endpoint, Instant, TcpConfig};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(snap) = Snapshot::parse_bytes(data) {
        let mut out = vec![0u8; snap.buffer_len()];
        let n = snap.emit(&mut out).unwrap();
        assert_eq!(&out[..n], data);
        assert!(snap.buffer_len() <= snap.max_len());
        let mut roomy = vec![0u8; snap.max_len()];
        assert_eq!(snap.emit(&mut roomy).unwrap(), n);
        assert_eq!(&roomy[..n], data);
        assert!(matches!(
            snap.emit(&mut out[..n - 1]),
            Err(SnapshotError::BufferTooSmall { .. })
        ));
    }
    let mut ep = Endpoint::new(TcpConfig {
        rx_buffer: 64 * 1024,
        tx_buffer: 64 * 1024,
        ..TcpConfig::default()
    });
    let now = Instant::from_millis(1_000_000);
    match ep.import(now, data) {
        Ok(imp) => {
            // The timed segment's age is clamped at this host's clock zero.
            let age_fits = Snapshot::parse_bytes(data)
                .unwrap()
                .rtt_timed
                .is_none_or(|(_, age)| age.as_micros() as u64 <= now.as_micros());
            let app = data[imp.app_state.clone()].to_vec();
            let mut out = vec![0u8; data.len() + 64];
            let n = ep.export(now, imp.id, &app, &mut out).unwrap();
            if age_fits {
                assert_eq!(&out[..n], data, "import -> export is not the identity");
            }
            ep.import(now, &out[..n]).expect("our own export imports");
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
