//! A scripted peer against a server endpoint, with explicit times, so
//! retransmission timing, backoff and ACK behaviour are asserted exactly.

mod common;

use capybara_tcp::{ConnId, Endpoint, Instant, SeqNum, State, TcpConfig, TcpError, TcpRepr};
use common::*;

const PEER_PORT: u16 = 40000;
const PEER_ISS: u32 = 1000;

#[derive(Debug, Clone, PartialEq, Eq)]
struct Seg {
    seq: u32,
    ack: Option<u32>,
    syn: bool,
    fin: bool,
    rst: bool,
    window: u16,
    sack: Vec<(u32, u32)>,
    tsval: Option<u32>,
    payload: Vec<u8>,
}

struct Script {
    ep: Endpoint,
    /// The server's ISS and last TSval, learnt from the SYN-ACK.
    srv_iss: u32,
    srv_ts: u32,
}

/// Injects a segment from the peer at `time` ms.
macro_rules! send {
    ($s:expr, time $t:expr, seq $seq:expr, ack $ack:expr, $($k:ident $(= $v:expr)?),* ; $payload:expr) => {{
        let mut r = TcpRepr::new(PEER_PORT, PORT, SeqNum($seq));
        r.ack = $ack.map(SeqNum);
        r.window = 65535;
        $( send!(@flag r, $k $(= $v)?); )*
        r.payload = $payload;
        $s.inject(Instant::from_millis($t), &r);
    }};
    (@flag $r:ident, syn) => { $r.syn = true; };
    (@flag $r:ident, fin) => { $r.fin = true; };
    (@flag $r:ident, rst) => { $r.rst = true; };
    (@flag $r:ident, window = $w:expr) => { $r.window = $w; };
    (@flag $r:ident, sack = $b:expr) => { for (l, rr) in $b { $r.options.sack.push(SeqNum(l), SeqNum(rr)); } };
}

/// Fires timers due at `time` ms and returns the next segment, if any.
macro_rules! recv {
    ($s:expr, time $t:expr) => {
        $s.poll(Instant::from_millis($t))
            .unwrap_or_else(|| panic!("nothing sent at {} ms", $t))
    };
}
macro_rules! recv_nothing {
    ($s:expr, time $t:expr) => {
        if let Some(seg) = $s.poll(Instant::from_millis($t)) {
            panic!("unexpected segment at {} ms: {seg:?}", $t);
        }
    };
}

impl Script {
    fn inject(&mut self, now: Instant, r: &TcpRepr) {
        let mut buf = vec![0u8; 2000];
        let n = r.emit(&mut buf, CLIENT_IP, SERVER_DATA_IP).unwrap();
        self.ep
            .handle_segment(now, CLIENT_IP, SERVER_DATA_IP, &buf[..n]);
    }
    fn poll(&mut self, now: Instant) -> Option<Seg> {
        if self.ep.poll_timeout().is_some_and(|t| t <= now) {
            self.ep.handle_timeout(now);
        }
        let mut buf = vec![0u8; 2000];
        let t = self.ep.poll_transmit(now, &mut buf)?;
        assert_eq!(t.src, VIP);
        let r = TcpRepr::parse_bytes(&buf[..t.len]).unwrap();
        if let Some((v, _)) = r.options.timestamp {
            self.srv_ts = v;
        }
        Some(Seg {
            seq: r.seq.0,
            ack: r.ack.map(|a| a.0),
            syn: r.syn,
            fin: r.fin,
            rst: r.rst,
            window: r.window,
            sack: r
                .options
                .sack
                .as_slice()
                .iter()
                .map(|(l, r)| (l.0, r.0))
                .collect(),
            tsval: r.options.timestamp.map(|t| t.0),
            payload: r.payload.to_vec(),
        })
    }
}

/// A server connection in ESTABLISHED after a plain handshake at t=0..10 ms
/// (no options, so the RTT sample comes from the timed SYN-ACK: 10 ms).
fn socket_established(cfg: TcpConfig) -> (Script, ConnId) {
    let mut ep = Endpoint::new(cfg);
    ep.listen(vip()).unwrap();
    let mut s = Script {
        ep,
        srv_iss: 0,
        srv_ts: 0,
    };
    send!(s, time 0, seq PEER_ISS, ack None::<u32>, syn; &[]);
    let synack = recv!(s, time 0);
    assert!(synack.syn && synack.ack == Some(PEER_ISS + 1));
    s.srv_iss = synack.seq;
    send!(s, time 10, seq PEER_ISS + 1, ack Some(synack.seq + 1), ; &[]);
    let id = s.ep.accept().expect("established");
    recv_nothing!(s, time 10);
    (s, id)
}

#[test]
fn syn_ack_is_retransmitted_with_backoff_then_given_up() {
    let cfg = TcpConfig {
        synack_retries: 2,
        ..TcpConfig::default()
    };
    let mut ep = Endpoint::new(cfg);
    ep.listen(vip()).unwrap();
    let mut s = Script {
        ep,
        srv_iss: 0,
        srv_ts: 0,
    };
    send!(s, time 0, seq PEER_ISS, ack None::<u32>, syn; &[]);
    let a = recv!(s, time 0);
    recv_nothing!(s, time 999);
    assert_eq!(recv!(s, time 1000), a, "initial RTO 1 s");
    recv_nothing!(s, time 2999);
    assert_eq!(recv!(s, time 3000), a, "doubled");
    recv_nothing!(s, time 6999);
    s.poll(Instant::from_millis(7000));
    assert_eq!(s.ep.connection_count(), 0, "half-open connection dropped");
}

#[test]
fn data_retransmission_timing_and_backoff() {
    let (mut s, id) = socket_established(TcpConfig {
        timestamps: false,
        ..TcpConfig::default()
    });
    assert_eq!(s.ep.info(id).unwrap().srtt_us, 10_000);
    s.ep.send(id, b"hello").unwrap();
    let d = recv!(s, time 20);
    assert_eq!(d.payload, b"hello");
    assert_eq!(d.seq, s.srv_iss + 1);
    recv_nothing!(s, time 219);
    assert_eq!(recv!(s, time 220), d, "RTO = max(200 ms, srtt + 4 rttvar)");
    recv_nothing!(s, time 619);
    assert_eq!(recv!(s, time 620), d, "backoff x2");
    recv_nothing!(s, time 1419);
    assert_eq!(recv!(s, time 1420), d, "backoff x4");
    // The ACK stops the timer and resets the backoff.
    send!(s, time 1430, seq PEER_ISS + 1, ack Some(s.srv_iss + 6), ; &[]);
    recv_nothing!(s, time 5000);
    assert_eq!(s.ep.connection(id).unwrap().rtt.backoff, 0);
}

#[test]
fn out_of_order_data_is_sacked_and_reassembled() {
    // The handshake needs SACK-permitted, so it is scripted here.
    let mut ep = Endpoint::new(TcpConfig {
        timestamps: false,
        ..TcpConfig::default()
    });
    ep.listen(vip()).unwrap();
    let mut s = Script {
        ep,
        srv_iss: 0,
        srv_ts: 0,
    };
    let mut syn = TcpRepr::new(PEER_PORT, PORT, SeqNum(PEER_ISS));
    syn.syn = true;
    syn.window = 65535;
    syn.options.sack_permitted = true;
    s.inject(Instant::ZERO, &syn);
    let sa = recv!(s, time 0);
    s.srv_iss = sa.seq;
    send!(s, time 10, seq PEER_ISS + 1, ack Some(sa.seq + 1), ; &[]);
    let id = s.ep.accept().unwrap();
    let base = PEER_ISS + 1;
    // Second and fourth chunks first.
    send!(s, time 20, seq base + 4, ack Some(sa.seq + 1), ; b"EFGH");
    let a1 = recv!(s, time 20);
    assert_eq!(a1.ack, Some(base), "immediate duplicate ACK");
    assert_eq!(a1.sack, vec![(base + 4, base + 8)]);
    send!(s, time 21, seq base + 12, ack Some(sa.seq + 1), ; b"MNOP");
    let a2 = recv!(s, time 21);
    assert_eq!(
        a2.sack,
        vec![(base + 12, base + 16), (base + 4, base + 8)],
        "most recent block first"
    );
    assert_eq!(s.ep.recv(id, &mut [0u8; 4]), Err(TcpError::WouldBlock));
    send!(s, time 22, seq base, ack Some(sa.seq + 1), ; b"ABCD");
    let a3 = recv!(s, time 22);
    assert_eq!(a3.ack, Some(base + 8), "hole filled: immediate ACK");
    assert_eq!(a3.sack, vec![(base + 12, base + 16)]);
    send!(s, time 23, seq base + 8, ack Some(sa.seq + 1), ; b"IJKL");
    assert_eq!(recv!(s, time 23).ack, Some(base + 16));
    let mut buf = [0u8; 32];
    assert_eq!(s.ep.recv(id, &mut buf), Ok(16));
    assert_eq!(&buf[..16], b"ABCDEFGHIJKLMNOP");
}

#[test]
fn delayed_ack_every_second_segment_or_after_40ms() {
    let (mut s, _id) = socket_established(TcpConfig {
        timestamps: false,
        ..TcpConfig::default()
    });
    let base = PEER_ISS + 1;
    let ack = Some(s.srv_iss + 1);
    send!(s, time 20, seq base, ack ack, ; &[b'x'; 100]);
    recv_nothing!(s, time 59);
    assert_eq!(recv!(s, time 60).ack, Some(base + 100), "40 ms delayed ACK");
    let full = [b'y'; 1460];
    send!(s, time 100, seq base + 100, ack ack, ; &full);
    recv_nothing!(s, time 100);
    send!(s, time 101, seq base + 1560, ack ack, ; &full);
    assert_eq!(
        recv!(s, time 101).ack,
        Some(base + 3020),
        "second full segment: ACK now"
    );
}

#[test]
fn rst_validation_rfc5961() {
    let (mut s, id) = socket_established(TcpConfig::default());
    let base = PEER_ISS + 1;
    // In window but not exact: challenge ACK, connection survives.
    send!(s, time 20, seq base + 100, ack None::<u32>, rst; &[]);
    let ch = recv!(s, time 20);
    assert_eq!(ch.ack, Some(base));
    assert!(!ch.rst);
    assert_eq!(s.ep.state(id), Some(State::Established));
    // Outside the window: silently dropped.
    send!(s, time 21, seq base.wrapping_sub(5000), ack None::<u32>, rst; &[]);
    recv_nothing!(s, time 21);
    // SYN on an established connection: challenge ACK (RFC 5961 §4).
    send!(s, time 22, seq base + 7, ack None::<u32>, syn; &[]);
    assert_eq!(recv!(s, time 22).ack, Some(base));
    // Exactly RCV.NXT: reset.
    send!(s, time 23, seq base, ack None::<u32>, rst; &[]);
    assert_eq!(s.ep.recv(id, &mut [0u8; 4]), Err(TcpError::Reset));
    assert_eq!(s.ep.counters().challenge_acks, 2);
}

#[test]
fn segment_for_unknown_connection_gets_rst() {
    let mut ep = Endpoint::new(TcpConfig::default());
    ep.listen(vip()).unwrap();
    let mut s = Script {
        ep,
        srv_iss: 0,
        srv_ts: 0,
    };
    // ACK with no connection: <SEQ=SEG.ACK><CTL=RST>.
    send!(s, time 0, seq 5, ack Some(777), ; b"data");
    let r = recv!(s, time 0);
    assert!(r.rst && r.seq == 777 && r.ack.is_none());
    // Non-ACK to a closed port: <SEQ=0><ACK=SEG.SEQ+SEG.LEN><CTL=RST,ACK>.
    let mut syn = TcpRepr::new(PEER_PORT, 9999, SeqNum(50));
    syn.syn = true;
    s.inject(Instant::ZERO, &syn);
    let r = recv!(s, time 0);
    assert!(r.rst && r.seq == 0 && r.ack == Some(51));
    assert_eq!(s.ep.counters().drops.no_listener, 1);
}

#[test]
fn passive_close_from_close_wait() {
    let (mut s, id) = socket_established(TcpConfig {
        timestamps: false,
        ..TcpConfig::default()
    });
    let base = PEER_ISS + 1;
    send!(s, time 20, seq base, ack Some(s.srv_iss + 1), fin; &[]);
    let a = recv!(s, time 20);
    assert_eq!(a.ack, Some(base + 1), "FIN acknowledged at once");
    assert_eq!(s.ep.state(id), Some(State::CloseWait));
    assert_eq!(s.ep.recv(id, &mut [0u8; 4]), Ok(0), "end of stream");
    s.ep.close(id).unwrap();
    let f = recv!(s, time 30);
    assert!(f.fin && f.seq == s.srv_iss + 1);
    recv_nothing!(s, time 229);
    assert_eq!(recv!(s, time 230), f, "FIN retransmitted after RTO");
    send!(s, time 240, seq base + 1, ack Some(s.srv_iss + 2), ; &[]);
    assert_eq!(s.ep.connection_count(), 0, "LAST-ACK -> CLOSED");
}

#[test]
fn handshake_negotiates_timestamps_and_scale_from_linux_style_syn() {
    let mut ep = Endpoint::new(TcpConfig::default());
    ep.listen(vip()).unwrap();
    let mut s = Script {
        ep,
        srv_iss: 0,
        srv_ts: 0,
    };
    let mut syn = TcpRepr::new(PEER_PORT, PORT, SeqNum(PEER_ISS));
    syn.syn = true;
    syn.window = 64240;
    syn.options.mss = Some(1460);
    syn.options.window_scale = Some(7);
    syn.options.sack_permitted = true;
    syn.options.timestamp = Some((4242, 0));
    s.inject(Instant::ZERO, &syn);
    let mut buf = vec![0u8; 200];
    let t = s.ep.poll_transmit(Instant::ZERO, &mut buf).unwrap();
    let r = TcpRepr::parse_bytes(&buf[..t.len]).unwrap();
    assert!(r.syn && r.ack == Some(SeqNum(PEER_ISS + 1)));
    assert_eq!(r.options.mss, Some(1460));
    assert_eq!(r.options.window_scale, Some(3));
    assert!(r.options.sack_permitted);
    assert_eq!(
        r.options.timestamp.map(|t| t.1),
        Some(4242),
        "TSecr echoes the SYN"
    );
    assert_eq!(r.window, 65535, "SYN-ACK window is unscaled");
}
