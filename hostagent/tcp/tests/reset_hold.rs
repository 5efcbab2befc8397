//! `Endpoint::hold_resets_until`: while the switch rebuilds its flow
//! mappings (docs/OPERATIONS.md, "Recovery"), a segment of a connection this
//! endpoint does not know is dropped (counted), never reset; SYNs are served
//! as always; after the hold, unknown segments are reset again.

mod common;

use capybara_tcp::{Endpoint, Instant, SeqNum, TcpConfig, TcpRepr};
use common::*;

fn inject(ep: &mut Endpoint, now: Instant, r: &TcpRepr) {
    let mut buf = vec![0u8; 2000];
    let n = r.emit(&mut buf, CLIENT_IP, SERVER_DATA_IP).unwrap();
    ep.handle_segment(now, CLIENT_IP, SERVER_DATA_IP, &buf[..n]);
}

fn sent(ep: &mut Endpoint, now: Instant) -> Option<TcpRepr<'static>> {
    let mut buf = vec![0u8; 2000];
    let t = ep.poll_transmit(now, &mut buf)?;
    let r = TcpRepr::parse_bytes(&buf[..t.len]).unwrap();
    let mut out = TcpRepr::new(r.src_port, r.dst_port, r.seq);
    out.ack = r.ack;
    out.syn = r.syn;
    out.rst = r.rst;
    Some(out)
}

fn data(port: u16) -> TcpRepr<'static> {
    let mut r = TcpRepr::new(port, PORT, SeqNum(5));
    r.ack = Some(SeqNum(777));
    r.window = 65535;
    r.payload = b"data";
    r
}

#[test]
fn unknown_segments_are_dropped_not_reset_while_resets_are_held() {
    let mut ep = Endpoint::new(TcpConfig::default());
    ep.listen(vip()).unwrap();
    let t0 = Instant::from_millis(1_000);
    let until = Instant::from_millis(4_000);
    ep.hold_resets_until(until);
    // An earlier end never shortens the hold.
    ep.hold_resets_until(Instant::from_millis(2_000));
    assert_eq!(ep.resets_held_until(t0), Some(until));

    // A segment of a connection another server holds: dropped, counted.
    inject(&mut ep, t0, &data(40_001));
    assert!(sent(&mut ep, t0).is_none(), "no reset while held");
    // Also toward a port nobody listens on.
    let mut other = data(40_002);
    other.dst_port = 9999;
    inject(&mut ep, t0, &other);
    assert!(sent(&mut ep, t0).is_none());
    assert_eq!(ep.counters().drops.reset_held, 2);

    // A SYN is served as always.
    let mut syn = TcpRepr::new(40_003, PORT, SeqNum(50));
    syn.syn = true;
    syn.window = 65535;
    inject(&mut ep, t0, &syn);
    let sa = sent(&mut ep, t0).expect("SYN-ACK");
    assert!(sa.syn && sa.ack == Some(SeqNum(51)) && !sa.rst);

    // After the hold: reset as before.
    assert_eq!(ep.resets_held_until(until), None);
    inject(&mut ep, until, &data(40_004));
    let r = sent(&mut ep, until).expect("RST");
    assert!(r.rst && r.seq == SeqNum(777));
    assert_eq!(ep.counters().drops.reset_held, 2);
}
