//! `cargo +nightly fuzz run segment_handler`: the input is a sequence of
//! records driving an endpoint with a listener (segments, timer ticks, API
//! calls). No input may panic it, and TCB invariants must hold.
#![no_main]

use std::net::{Ipv4Addr, SocketAddrV4};

use capybara_proto::checksum;
use capybara_tcp::{Endpoint, Instant, TcpConfig};
use libfuzzer_sys::fuzz_target;

const PEER: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 11);
const DATA: Ipv4Addr = Ipv4Addr::new(198, 18, 1, 11);

fuzz_target!(|data: &[u8]| {
    let mut ep = Endpoint::new(TcpConfig { rx_buffer: 4096, tx_buffer: 4096, ..TcpConfig::default() });
    ep.listen(SocketAddrV4::new(Ipv4Addr::new(198, 18, 100, 1), 80)).unwrap();
    let mut now = Instant::ZERO;
    let mut out = [0u8; 1600];
    let mut rest = data;
    let mut ids = Vec::new();
    while let [op, len, tail @ ..] = rest {
        let n = (*len as usize).min(tail.len());
        let (chunk, next) = tail.split_at(n);
        rest = next;
        match op % 6 {
            0 | 1 => {
                // A segment to port 80 with a valid checksum.
                let mut seg = chunk.to_vec();
                if seg.len() >= 20 {
                    seg[2..4].copy_from_slice(&80u16.to_be_bytes());
                    seg[16..18].copy_from_slice(&[0, 0]);
                    let c = checksum::transport(PEER, DATA, 6, &seg);
                    seg[16..18].copy_from_slice(&c.to_be_bytes());
                }
                ep.handle_segment(now, PEER, DATA, &seg);
            }
            2 => {
                now += std::time::Duration::from_millis(u64::from(*len) * 10);
                ep.handle_timeout(now);
            }
            3 => {
                if let Some(&id) = ids.get(n % ids.len().max(1)) {
                    let _ = ep.send(id, chunk);
                    let _ = ep.recv(id, &mut out);
                }
            }
            4 => {
                if let Some(&id) = ids.get(n % ids.len().max(1)) {
                    let _ = match n % 3 {
                        0 => ep.shutdown(id),
                        1 => ep.close(id),
                        _ => ep.abort(id),
                    };
                }
            }
            _ => {}
        }
        while let Some(id) = ep.accept() {
            ids.push(id);
        }
        while ep.poll_transmit(now, &mut out).is_some() {}
        for (_, c) in ep.connections() {
            assert!(c.snd.una <= c.snd.nxt && c.snd.nxt <= c.snd.max);
            assert!(c.rx.len() <= c.rx.capacity());
        }
    }
});
