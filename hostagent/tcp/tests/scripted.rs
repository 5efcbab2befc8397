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
    // One tail loss probe (RFC 8985): 2 SRTT, but at least SRTT + the
    // delayed-ACK time + 10 ms for a single segment.
    recv_nothing!(s, time 79);
    assert_eq!(recv!(s, time 80), d, "tail loss probe");
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
    recv_nothing!(s, time 89);
    assert_eq!(recv!(s, time 90), f, "tail loss probe");
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

// ------------------------------------------------------------ loss recovery

const MSS: u32 = 1460;

impl Script {
    /// Every segment the server sends at `time` ms.
    fn poll_all(&mut self, t: u64) -> Vec<Seg> {
        std::iter::from_fn(|| self.poll(Instant::from_millis(t))).collect()
    }
    /// The data segments the server sends at `time` ms (see `data_of`).
    fn sent_data(&mut self, t: u64) -> Vec<(u32, usize)> {
        let segs = self.poll_all(t);
        data_of(self, &segs)
    }
}

/// Data segments (payload or FIN) among `segs`, as (offset from the server's
/// first data byte, length).
fn data_of(s: &Script, segs: &[Seg]) -> Vec<(u32, usize)> {
    segs.iter()
        .filter(|g| !g.payload.is_empty() || g.fin)
        .map(|g| (g.seq.wrapping_sub(s.srv_iss + 1), g.payload.len()))
        .collect()
}

/// A server connection in ESTABLISHED with MSS 1460 and SACK permitted or
/// not (no timestamps, no window scaling: the peer offers 65535 bytes),
/// SRTT 10 ms.
fn socket_established_mss(sack: bool) -> (Script, ConnId) {
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
    syn.options.sack_permitted = sack;
    syn.options.mss = Some(MSS as u16);
    s.inject(Instant::ZERO, &syn);
    let sa = recv!(s, time 0);
    s.srv_iss = sa.seq;
    send!(s, time 10, seq PEER_ISS + 1, ack Some(sa.seq + 1), ; &[]);
    let id = s.ep.accept().unwrap();
    (s, id)
}

fn socket_established_sack() -> (Script, ConnId) {
    socket_established_mss(true)
}

/// Server sequence number of data offset `off`.
fn srv(s: &Script, off: u32) -> u32 {
    s.srv_iss.wrapping_add(1).wrapping_add(off)
}

#[test]
fn sack_on_data_segments_starts_recovery_and_a_lost_retransmission_is_resent_without_rto() {
    let (mut s, id) = socket_established_sack();
    let data = vec![7u8; 20 * MSS as usize];
    assert_eq!(s.ep.send(id, &data), Ok(data.len()));
    // Initial window: 10 segments.
    let first = s.poll_all(20);
    assert_eq!(data_of(&s, &first).len(), 10);
    // Segment 0 is lost. The peer (an echo) acknowledges with data: each of
    // its segments carries ACK = SND.UNA and a growing SACK block. None of
    // them is a duplicate ACK in the RFC 5681 sense.
    let mut pseq = PEER_ISS + 1;
    let una = Some(srv(&s, 0));
    for k in 1..=3u32 {
        send!(s, time 30, seq pseq, ack una, sack = [(srv(&s, MSS), srv(&s, (k + 1) * MSS))]; b"echo");
        pseq += 4;
    }
    // Three segments SACKed above it: segment 0 is lost (RFC 6675 IsLost).
    let out = s.poll_all(30);
    assert_eq!(
        data_of(&s, &out),
        vec![(0, MSS as usize)],
        "one retransmission"
    );
    let c = s.ep.connection(id).unwrap();
    assert!(c.cc.in_recovery);
    assert_eq!(c.cc.ssthresh, 5 * MSS, "half the flight");
    assert_eq!(c.rtt.timed, None, "Karn: no sample across a retransmission");
    // The retransmission is lost too. The rest of the flight is SACKed:
    // the pipe empties and new data goes out (sent after the retransmission).
    send!(s, time 40, seq pseq, ack una, sack = [(srv(&s, MSS), srv(&s, 10 * MSS))]; b"echo");
    pseq += 4;
    let out = s.poll_all(40);
    let new: Vec<_> = data_of(&s, &out);
    assert_eq!(new.first(), Some(&(10 * MSS, MSS as usize)), "{new:?}");
    assert!(new.iter().all(|&(o, _)| o >= 10 * MSS), "{new:?}");
    // New data sent after the retransmission arrives while segment 0 does
    // not: the retransmission was lost, resend it now (no RTO, no probe).
    send!(s, time 41, seq pseq, ack una, sack = [(srv(&s, MSS), srv(&s, 11 * MSS))]; b"echo");
    let out = s.poll_all(41);
    assert_eq!(
        data_of(&s, &out).first(),
        Some(&(0, MSS as usize)),
        "lost retransmission resent at once"
    );
    assert_eq!(s.ep.counters().retransmits_timeout, 0);
    // Segment 0 arrives: the ACK covers everything sent before recovery
    // began; recovery ends with cwnd <= ssthresh (RFC 6582 full ACK).
    let all = srv(&s, 11 * MSS);
    send!(s, time 45, seq pseq + 4, ack Some(all), ; &[]);
    let c = s.ep.connection(id).unwrap();
    assert!(!c.cc.in_recovery);
    assert!(c.cc.cwnd <= c.cc.ssthresh, "{:?}", c.cc);
}

#[test]
fn rto_keeps_the_scoreboard_and_resends_only_the_holes() {
    let (mut s, id) = socket_established_sack();
    let data = vec![9u8; 10 * MSS as usize];
    assert_eq!(s.ep.send(id, &data), Ok(data.len()));
    assert_eq!(s.sent_data(20).len(), 10);
    // Only segments 6 and 7 arrive: two segments SACKed is below DupThresh.
    let una = Some(srv(&s, 0));
    send!(s, time 30, seq PEER_ISS + 1, ack una, sack = [(srv(&s, 6 * MSS), srv(&s, 8 * MSS))]; &[]);
    assert!(s.poll_all(30).is_empty());
    // The tail loss probe (2 SRTT after the last progress) resends the last
    // segment; it is lost as well.
    recv_nothing!(s, time 49);
    assert_eq!(s.sent_data(50), vec![(9 * MSS, MSS as usize)]);
    // RTO (200 ms after the last send of new data): everything not SACKed
    // is lost; slow start from one segment resends the holes in order.
    recv_nothing!(s, time 219);
    assert_eq!(s.sent_data(220), vec![(0, MSS as usize)]);
    assert_eq!(s.ep.counters().retransmits_timeout, 1);
    let mut resent = vec![0u32];
    let mut t = 220;
    let mut acked = MSS;
    while acked < 10 * MSS {
        t += 10;
        let sack = [(srv(&s, 6 * MSS), srv(&s, 8 * MSS))];
        if acked < 6 * MSS {
            send!(s, time t, seq PEER_ISS + 1, ack Some(srv(&s, acked)), sack = sack; &[]);
        } else {
            send!(s, time t, seq PEER_ISS + 1, ack Some(srv(&s, acked)), ; &[]);
        }
        let out = s.sent_data(t);
        assert!(!out.is_empty(), "stalled at {acked}");
        for (o, len) in out {
            resent.push(o / MSS);
            acked = acked.max(o + len as u32);
        }
    }
    assert!(
        !resent.contains(&6) && !resent.contains(&7),
        "SACKed segments resent: {resent:?}"
    );
    assert_eq!(resent, vec![0, 1, 2, 3, 4, 5, 8, 9]);
    assert_eq!(s.ep.counters().retransmits_timeout, 1);
}

#[test]
fn limited_transmit_sends_one_new_segment_per_early_duplicate_ack() {
    // No SACK: plain RFC 5681 duplicate ACKs.
    let (mut s, id) = socket_established_mss(false);
    let data = vec![1u8; 20 * MSS as usize];
    s.ep.send(id, &data).unwrap();
    assert_eq!(s.sent_data(20).len(), 10);
    let una = Some(srv(&s, 0));
    send!(s, time 30, seq PEER_ISS + 1, ack una, ; &[]);
    assert_eq!(s.sent_data(30), vec![(10 * MSS, MSS as usize)]);
    send!(s, time 31, seq PEER_ISS + 1, ack una, ; &[]);
    assert_eq!(s.sent_data(31), vec![(11 * MSS, MSS as usize)]);
    // The third duplicate ACK: fast retransmit of SND.UNA.
    send!(s, time 32, seq PEER_ISS + 1, ack una, ; &[]);
    assert_eq!(s.sent_data(32).first(), Some(&(0, MSS as usize)));
    assert_eq!(s.ep.counters().retransmits_fast, 1);
}

#[test]
fn stalled_recovery_is_restarted_by_the_probe_timer_not_the_rto() {
    let (mut s, id) = socket_established_sack();
    // Exactly ten segments: nothing new can follow the retransmission.
    let data = vec![3u8; 10 * MSS as usize];
    s.ep.send(id, &data).unwrap();
    assert_eq!(s.sent_data(20).len(), 10);
    let una = Some(srv(&s, 0));
    send!(s, time 30, seq PEER_ISS + 1, ack una, sack = [(srv(&s, MSS), srv(&s, 10 * MSS))]; &[]);
    assert_eq!(s.sent_data(30), vec![(0, MSS as usize)]);
    // That retransmission is lost and nothing else is in flight: after a
    // probe timeout (2 SRTT) without progress it goes out again.
    recv_nothing!(s, time 49);
    assert_eq!(s.sent_data(50), vec![(0, MSS as usize)]);
    send!(s, time 55, seq PEER_ISS + 1, ack Some(srv(&s, 10 * MSS)), ; &[]);
    assert_eq!(s.ep.counters().retransmits_timeout, 0);
    assert_eq!(s.ep.connection(id).unwrap().timers.retransmit, None);
}

#[test]
fn sack_blocks_that_do_not_fit_are_rotated_so_each_keeps_being_reported() {
    let (mut s, _id) = socket_established_sack();
    let base = PEER_ISS + 1;
    let ack = Some(s.srv_iss + 1);
    // Six out-of-order blocks (every other 10-byte chunk after a hole):
    // the most recent plus five others, of which three fit beside it.
    for k in 0..6u32 {
        send!(s, time 20 + u64::from(k), seq base + 10 + 20 * k, ack ack, ; &[b'z'; 10]);
        let _ = s.poll_all(20 + u64::from(k));
    }
    let newest = (base + 110, base + 120);
    let mut seen = std::collections::BTreeSet::new();
    for t in 30..36u64 {
        // A duplicate of the newest block makes it the most recent again.
        send!(s, time t, seq newest.0, ack ack, ; &[b'z'; 10]);
        let segs = s.poll_all(t);
        let a = segs.last().expect("an immediate ACK");
        assert_eq!(a.ack, Some(base));
        assert_eq!(a.sack.len(), 4, "{:?}", a.sack);
        assert_eq!(a.sack[0], newest, "the most recent block first");
        seen.extend(a.sack[1..].iter().copied());
    }
    let all: std::collections::BTreeSet<_> = (0..5u32)
        .map(|k| (base + 10 + 20 * k, base + 20 + 20 * k))
        .collect();
    assert_eq!(seen, all, "every older block reported again");
}

#[test]
fn late_segments_of_a_connection_closed_from_last_ack_are_dropped_not_reset() {
    let (mut s, id) = socket_established(TcpConfig {
        timestamps: false,
        ..TcpConfig::default()
    });
    let base = PEER_ISS + 1;
    // The peer closes first; the server closes too and waits in LAST-ACK.
    send!(s, time 20, seq base, ack Some(s.srv_iss + 1), fin; &[]);
    recv!(s, time 20);
    assert_eq!(s.ep.recv(id, &mut [0u8; 4]), Ok(0));
    s.ep.close(id).unwrap();
    let f = recv!(s, time 21);
    assert!(f.fin);
    assert_eq!(s.ep.recently_closed_count(), 0);
    send!(s, time 30, seq base + 1, ack Some(s.srv_iss + 2), ; &[]);
    assert_eq!(s.ep.connection_count(), 0, "LAST-ACK -> CLOSED");
    assert_eq!(s.ep.recently_closed_count(), 1);
    // Stale duplicates of the peer's earlier segments, still queued: no RST.
    send!(s, time 31, seq base, ack Some(s.srv_iss + 1), ; &[]);
    send!(s, time 500, seq base + 1, ack Some(s.srv_iss + 2), ; &[]);
    recv_nothing!(s, time 500);
    assert_eq!(s.ep.counters().drops.recently_closed, 2);
    assert_eq!(s.ep.counters().resets_sent, 0);
    // After the linger the ordinary rule applies again.
    let after = 30 + capybara_tcp::endpoint::CLOSED_LINGER.as_millis() as u64;
    send!(s, time after, seq base + 1, ack Some(s.srv_iss + 2), ; &[]);
    let r = recv!(s, time after);
    assert!(r.rst && r.seq == s.srv_iss + 2);
    assert_eq!(s.ep.recently_closed_count(), 0);
}

#[test]
fn a_new_syn_on_a_recently_closed_tuple_is_a_new_connection() {
    let (mut s, id) = socket_established(TcpConfig {
        timestamps: false,
        ..TcpConfig::default()
    });
    let base = PEER_ISS + 1;
    send!(s, time 20, seq base, ack Some(s.srv_iss + 1), fin; &[]);
    recv!(s, time 20);
    s.ep.close(id).unwrap();
    recv!(s, time 21);
    send!(s, time 30, seq base + 1, ack Some(s.srv_iss + 2), ; &[]);
    assert_eq!(s.ep.recently_closed_count(), 1);
    send!(s, time 40, seq base + 100_000, ack None::<u32>, syn; &[]);
    let synack = recv!(s, time 40);
    assert!(synack.syn && synack.ack == Some(base + 100_001));
    assert_eq!(s.ep.recently_closed_count(), 0, "forgotten by the SYN");
    send!(s, time 50, seq base + 100_001, ack Some(synack.seq + 1), ; &[]);
    assert!(s.ep.accept().is_some(), "established");
    assert_eq!(s.ep.connection_count(), 1);
    assert_eq!(s.ep.counters().resets_sent, 0);
}

/// Keep-alive 10 s idle, a probe every 2 s, 3 probes.
fn keepalive_cfg() -> TcpConfig {
    TcpConfig {
        keepalive: Some(capybara_tcp::KeepAlive {
            idle: capybara_tcp::Duration::from_secs(10),
            interval: capybara_tcp::Duration::from_secs(2),
            probes: 3,
        }),
        ..TcpConfig::default()
    }
}

/// Every segment restarts the idle time, but only the armed timer entry
/// stays in the heap (it fires early and re-arms at the last segment +
/// idle, as Linux's keep-alive timer does); the probes then come at the
/// exact instants: idle after the last segment, then every interval, and
/// the connection times out one interval after the last probe.
#[test]
fn keepalive_counts_from_the_last_segment_with_one_timer_entry() {
    let (mut s, id) = socket_established(keepalive_cfg());
    // A second, idle connection established 2 ms later: its deadline is
    // the heap's top while the first one's moves on, so superseded
    // entries of the first would stay in the heap instead of being
    // popped at once.
    let mut syn = TcpRepr::new(PEER_PORT + 1, PORT, SeqNum(5000));
    syn.syn = true;
    syn.window = 65535;
    s.inject(Instant::from_millis(12), &syn);
    let synack = recv!(s, time 12);
    let mut ack = TcpRepr::new(PEER_PORT + 1, PORT, SeqNum(5001));
    ack.ack = Some(SeqNum(synack.seq + 1));
    ack.window = 65535;
    s.inject(Instant::from_millis(12), &ack);
    let idle = s.ep.accept().expect("second connection");
    assert_eq!(s.ep.timer_heap_len(), 2);
    // 1000 bare ACKs 5 ms apart on the first (t = 20 .. 5015 ms): each
    // moves its keep-alive deadline, none adds a heap entry (before: one
    // each, until the heap's compaction at 2 x 2 + 64 entries).
    for i in 0..1000u64 {
        let t = 20 + 5 * i;
        send!(s, time t, seq PEER_ISS + 1, ack Some(s.srv_iss + 1), ; &[]);
        recv_nothing!(s, time t);
        assert_eq!(s.ep.timer_heap_len(), 2, "after the ACK at {t} ms");
    }
    s.ep.abort(idle).unwrap();
    assert!(recv!(s, time 5016).rst);
    // The armed entry fired (early) and re-armed at 5015 + 10 000 ms.
    recv_nothing!(s, time 15014);
    assert_eq!(s.ep.poll_timeout(), Some(Instant::from_millis(15_015)));
    let probe = recv!(s, time 15_015);
    assert_eq!(
        (probe.seq, probe.ack, probe.payload.len()),
        (s.srv_iss, Some(PEER_ISS + 1), 0),
        "keep-alive probe: SND.UNA - 1, no data"
    );
    recv_nothing!(s, time 17_014);
    assert_eq!(
        recv!(s, time 17_015),
        probe,
        "second probe one interval later"
    );
    recv_nothing!(s, time 19_014);
    assert_eq!(recv!(s, time 19_015), probe, "third");
    recv_nothing!(s, time 21_014);
    assert_eq!(s.ep.state(id), Some(State::Established));
    let _ = s.poll(Instant::from_millis(21_015));
    assert_eq!(s.ep.state(id), Some(State::Closed), "3 probes unanswered");
    let mut buf = [0u8; 4];
    assert_eq!(s.ep.recv(id, &mut buf), Err(TcpError::TimedOut));
    assert_eq!(s.ep.counters().keepalive_probes, 3);
    assert_eq!(s.ep.counters().connections_timed_out, 1);
}

/// An answered probe restarts the idle time from the answer: the probe
/// interval's armed entry fires for nothing and re-arms.
#[test]
fn keepalive_answered_probe_restarts_the_idle_time() {
    let (mut s, id) = socket_established(keepalive_cfg());
    // Established by the ACK at 10 ms: first probe at 10 010 ms.
    recv_nothing!(s, time 10_009);
    let probe = recv!(s, time 10_010);
    assert_eq!(probe.seq, s.srv_iss);
    send!(s, time 10_020, seq PEER_ISS + 1, ack Some(s.srv_iss + 1), ; &[]);
    recv_nothing!(s, time 12_010);
    assert_eq!(s.ep.poll_timeout(), Some(Instant::from_millis(20_020)));
    recv_nothing!(s, time 20_019);
    assert_eq!(recv!(s, time 20_020), probe);
    assert_eq!(s.ep.counters().keepalive_probes, 2);
    assert_eq!(s.ep.state(id), Some(State::Established));
    assert_eq!(s.ep.timer_heap_len(), 1);
}
