//! A connection exported right after its retransmission timeout fired, and
//! before the retransmission went out, must still retransmit on its target
//! (issue #8, the sidecar's pipelined RESP stall).
//!
//! When the RTO fires the timer stops and everything in flight is marked
//! lost in the loss hints; the retransmission that follows restarts the
//! timer. The hints are soft state that a snapshot does not carry, so a
//! connection exported in between arrived with data in flight, no timer,
//! and nothing it was allowed to send (the whole flight still counted
//! against its one-segment cwnd). A peer that only waits for data (a client
//! expecting replies) sends nothing, so the connection stalled for good: in
//! the lab the client timed out after 20 s; it moved on at its FIN.
//!
//! Run: `cargo test --release -p capybara-tcp --test imported_rto`.

mod common;

use capybara_tcp::{Duration, TcpConfig};
use common::*;

#[test]
fn connection_exported_between_rto_and_retransmission_retransmits_on_target() {
    let mut p = Pair::new(
        TcpConfig::default(),
        TcpConfig::default(),
        LinkConfig::default(),
        7,
    );
    p.server_clock = 123_456_789;
    let (c, s) = p.connect();

    // The client's ACKs are lost (in the lab: dropped while the connection
    // was frozen mid-migration), so the server's data stays in flight.
    p.drop_filter = Some(Box::new(|dir, _| matches!(dir, Dir::ToServer)));
    let reply: Vec<u8> = (0..40_000u32).map(|i| (i * 7 + 3) as u8).collect();
    let mut sent = 0;
    while sent < reply.len() {
        match p.server.send(s, &reply[sent..]) {
            Ok(n) if n > 0 => sent += n,
            _ => break,
        }
    }
    assert_eq!(sent, reply.len());
    p.drive_transmit();

    // Deliver the flight to the client (tail loss probes included); stop
    // when the server's next deadline is its retransmission timeout and the
    // client holds everything sent, then fire the RTO without letting the
    // server transmit again.
    let mut got = Vec::new();
    let mut buf = vec![0u8; 64 * 1024];
    let rto_at = loop {
        while let Ok(n) = p.client.recv(c, &mut buf) {
            if n == 0 {
                break;
            }
            got.extend_from_slice(&buf[..n]);
        }
        let conn = p.server.connection(s).expect("server connection");
        let sent_bytes = conn.snd.max.0.wrapping_sub(conn.snd.iss.0).wrapping_sub(1) as usize;
        let d = p.server.poll_timeout().expect("server timer");
        if conn.timers.retransmit == Some(d) && got.len() == sent_bytes {
            break d;
        }
        assert!(p.step(), "nothing pending before the RTO");
        assert!(p.now.as_micros() < 30_000_000, "no RTO within 30 s");
    };
    p.now = p.now.max(p.srv_to_client(rto_at));
    p.server.handle_timeout(rto_at);
    {
        let conn = p.server.connection(s).expect("server connection");
        assert!(conn.snd.max != conn.snd.una, "data in flight at the RTO");
        assert!(
            conn.timers.retransmit.is_none(),
            "the RTO fired: its timer stopped until the retransmission"
        );
    }

    // Exported in that instant: the target gets data in flight, no timer.
    let (s2, _, _) = p.migrate(s, &[], 9_000_000_000);
    // The client's last ACKs (window updates after its reads, its delayed
    // ACK) are lost too: run its timers out while the filter holds.
    p.run_until(Duration::from_secs(1), |p| {
        p.client.poll_timeout().is_none() && p.client.connection(c).is_some_and(|k| !k.ack.now)
    });
    p.drop_filter = None;
    // The client already holds everything sent; it has nothing to say
    // until the server sends again.
    let done = p.run_until(Duration::from_secs(20), |p| {
        while let Ok(n) = p.client.recv(c, &mut buf) {
            if n == 0 {
                break;
            }
            got.extend_from_slice(&buf[..n]);
        }
        let srv = p.server.connection(s2).expect("imported connection");
        got.len() == reply.len() && srv.snd.una == srv.snd.max && srv.tx.is_empty()
    });
    let srv = p.server.connection(s2).expect("imported connection");
    assert!(
        done,
        "stalled after the import: client has {} of {} bytes; server una={:?} max={:?} \
         timers={:?} cwnd={}",
        got.len(),
        reply.len(),
        srv.snd.una,
        srv.snd.max,
        srv.timers,
        srv.cc.cwnd
    );
    assert_same(&got, &reply, "reply stream");
}
