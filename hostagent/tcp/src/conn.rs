//! One TCP connection: the transmission control block and its state machine.
//!
//! Sans-IO: `process` takes a parsed segment and `now`; `poll_segment` writes
//! the next segment to send, if any; `next_deadline` / `on_timeout` drive the
//! timers. All state is in plain `pub` structs deriving `PartialEq`/`Debug`
//! so that a connection snapshot (export/import for migration) can be built
//! and compared field by field.
//!
//! RFC map: 9293 (state machine, segment arrival), 6298 (RTO), 5681/6582
//! (NewReno), 3042 (limited transmit), 2018/6675 (SACK; IsLost, SetPipe and
//! NextSeg rule 1), 8985 §7 (tail loss probe), 7323 (window scale,
//! timestamps, PAWS), 5961 (RST/SYN/ACK validation), 1122 (delayed ACK, SWS
//! avoidance, keep-alive), 6528 (ISN, in `isn.rs`).
//!
//! Loss recovery with SACK, beyond RFC 6675 (see `LossHints`): any ACK with
//! new SACK information counts, also one riding on data; a retransmission
//! is presumed lost once data sent after it is SACKed; a recovery without
//! progress for a probe timeout presumes every un-SACKed byte lost instead
//! of waiting for the RTO; an RTO keeps the scoreboard (forgotten on a
//! second timeout in a row, in case the peer reneged) and resends only the
//! holes, in slow start.

use std::net::SocketAddrV4;

use capybara_proto::time::{Duration, Instant};

use crate::buffer::{Assembler, RingBuffer, Scoreboard};
use crate::config::{KeepAlive, TcpConfig};
use crate::counters::Counters;
use crate::error::{CloseReason, TcpError};
use crate::seq::SeqNum;
use crate::wire::{SackBlocks, TcpOptions, TcpRepr, MAX_HEADER_LEN};

/// RFC 9293 connection states (LISTEN lives in the endpoint).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum State {
    Closed,
    SynSent,
    SynReceived,
    Established,
    FinWait1,
    FinWait2,
    CloseWait,
    Closing,
    LastAck,
    TimeWait,
}

impl State {
    pub const ALL: [State; 10] = [
        State::Closed,
        State::SynSent,
        State::SynReceived,
        State::Established,
        State::FinWait1,
        State::FinWait2,
        State::CloseWait,
        State::Closing,
        State::LastAck,
        State::TimeWait,
    ];
    /// Both SYNs have been exchanged.
    pub fn is_synchronized(self) -> bool {
        !matches!(self, State::Closed | State::SynSent | State::SynReceived)
    }
    /// States in which queued data or FIN may still be (re)transmitted.
    fn can_send(self) -> bool {
        matches!(
            self,
            State::Established
                | State::CloseWait
                | State::FinWait1
                | State::Closing
                | State::LastAck
        )
    }
    /// States in which incoming payload is accepted (before the peer's FIN).
    fn can_receive(self) -> bool {
        matches!(self, State::Established | State::FinWait1 | State::FinWait2)
    }
}

/// Per-connection parameters copied from the endpoint configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnParams {
    pub mss: u16,
    pub initial_rto: Duration,
    pub min_rto: Duration,
    pub max_rto: Duration,
    pub max_retries: u32,
    pub syn_retries: u32,
    pub synack_retries: u32,
    pub delayed_ack: Duration,
    pub time_wait: Duration,
    pub fin_wait2_timeout: Duration,
    pub keepalive: Option<KeepAlive>,
    pub initial_cwnd_segments: u32,
    pub window_scaling: bool,
    pub sack: bool,
    pub timestamps: bool,
}

impl ConnParams {
    pub fn from_config(c: &TcpConfig) -> Self {
        ConnParams {
            mss: c.mss.max(64),
            initial_rto: c.initial_rto,
            min_rto: c.min_rto,
            max_rto: c.max_rto,
            max_retries: c.max_retries,
            syn_retries: c.syn_retries,
            synack_retries: c.synack_retries,
            delayed_ack: c.delayed_ack,
            time_wait: c.time_wait,
            fin_wait2_timeout: c.fin_wait2_timeout,
            keepalive: c.keepalive,
            initial_cwnd_segments: c.initial_cwnd_segments.max(1),
            window_scaling: c.window_scaling,
            sack: c.sack,
            timestamps: c.timestamps,
        }
    }
}

/// Send sequence space (RFC 9293 §3.3.1) plus the highest sequence sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SendSeq {
    pub iss: SeqNum,
    pub una: SeqNum,
    /// Next sequence number to send; rewound to UNA by a timeout.
    pub nxt: SeqNum,
    /// Highest sequence number sent so far (SND.MAX).
    pub max: SeqNum,
    /// Peer's window in bytes (already scaled).
    pub wnd: u32,
    pub wl1: SeqNum,
    pub wl2: SeqNum,
    /// Largest window the peer ever offered.
    pub max_wnd: u32,
    /// Shift applied to the peer's window field.
    pub wscale: u8,
    /// Largest payload per segment (peer MSS, our MSS, minus option space).
    pub smss: u16,
}

/// Receive sequence space.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecvSeq {
    pub irs: SeqNum,
    pub nxt: SeqNum,
    /// Shift applied to the window we advertise.
    pub wscale: u8,
    /// Right edge of the last window we advertised (never moved left).
    pub adv_right: SeqNum,
    /// Sequence of the peer's FIN once it is known (may be ahead of NXT).
    pub fin_seq: Option<SeqNum>,
    /// The FIN has been consumed (RCV.NXT is past it).
    pub fin_received: bool,
    /// MSS the peer may send to us (ours).
    pub mss: u16,
}

/// Options both sides agreed on in the handshake.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Negotiated {
    pub sack: bool,
    pub timestamps: bool,
    pub window_scale: bool,
}

/// RFC 7323 timestamp state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Timestamps {
    /// TS.Recent: the peer's TSval to echo.
    pub recent: u32,
    /// Added to our millisecond clock (keeps TSval opaque per connection;
    /// an import on another host adjusts it to keep TSval monotonic).
    pub offset: u32,
}

/// RFC 6298 estimator (microseconds).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RttEstimator {
    pub srtt_us: u64,
    pub rttvar_us: u64,
    /// RTO before backoff.
    pub rto_us: u64,
    /// Exponential backoff shift (timeouts since the last new ACK).
    pub backoff: u32,
    pub has_sample: bool,
    /// Karn: one timed segment (end sequence, send time), cleared on retransmit.
    pub timed: Option<(SeqNum, Instant)>,
}

impl RttEstimator {
    fn new(p: &ConnParams) -> Self {
        RttEstimator {
            srtt_us: 0,
            rttvar_us: 0,
            rto_us: p.initial_rto.as_micros() as u64,
            backoff: 0,
            has_sample: false,
            timed: None,
        }
    }

    /// Folds in one measurement (RFC 6298 §2.2–2.3), clock granularity 1 ms.
    pub fn sample(&mut self, r: Duration, p: &ConnParams) {
        let r = r.as_micros() as u64;
        if !self.has_sample {
            self.srtt_us = r;
            self.rttvar_us = r / 2;
            self.has_sample = true;
        } else {
            let err = self.srtt_us.abs_diff(r);
            self.rttvar_us = (3 * self.rttvar_us + err) / 4;
            self.srtt_us = (7 * self.srtt_us + r) / 8;
        }
        let rto = self.srtt_us + (4 * self.rttvar_us).max(1000);
        self.rto_us = rto.clamp(p.min_rto.as_micros() as u64, p.max_rto.as_micros() as u64);
    }

    /// Current RTO including backoff, capped at the maximum.
    pub fn rto(&self, p: &ConnParams) -> Duration {
        let max = p.max_rto.as_micros() as u64;
        let shifted = if self.backoff >= 32 {
            max
        } else {
            self.rto_us.saturating_mul(1u64 << self.backoff)
        };
        Duration::from_micros(shifted.min(max))
    }
}

/// NewReno congestion control (RFC 5681, RFC 6582) with SACK-based loss
/// recovery (RFC 6675, simplified).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Congestion {
    pub cwnd: u32,
    pub ssthresh: u32,
    pub dup_acks: u32,
    /// RFC 6582 "recover": highest sequence sent when recovery started.
    pub recover: SeqNum,
    pub in_recovery: bool,
    /// Bytes acked in congestion avoidance since cwnd last grew.
    pub ca_acked: u32,
    /// Retransmit the segment at SND.UNA at the next opportunity.
    pub fast_retransmit: bool,
    /// SACK recovery: holes below this were already retransmitted.
    pub rexmit_next: SeqNum,
}

/// Loss-detection hints beyond RFC 6675's scoreboard: when un-SACKed data
/// is presumed lost without DupThresh evidence, when a retransmission is
/// itself lost, and the probe timer that keeps a stalled recovery or a lost
/// tail from waiting for the RTO.
///
/// Soft state: a connection snapshot does not carry it (an imported
/// connection starts without hints and at worst waits for its RTO once), so
/// it takes no part in `Connection` equality.
#[derive(Debug, Clone, Copy, Default)]
pub struct LossHints {
    /// Un-SACKed bytes below this are presumed lost: SND.MAX when an RTO or
    /// a probe found the flight unanswered (everything sent before had the
    /// time to be acknowledged), or the highest SACK when a tail probe's
    /// answer revealed holes.
    pub lost_mark: Option<SeqNum>,
    /// SND.MAX when the latest hole retransmission left. A SACK above it
    /// covers data sent after every retransmission of the round, so any of
    /// them still unacknowledged was lost too (the receiver sees segments
    /// in sending order): the round starts over without waiting for the RTO.
    pub rxt_mark: Option<SeqNum>,
    /// Probe timer (tail loss probe, RFC 8985 §7; in recovery: no progress
    /// for a probe timeout restarts the retransmission of every hole).
    pub probe: Option<Instant>,
    /// Probes sent since the last ACK that made progress.
    pub probes: u32,
    /// Send a tail loss probe at the next opportunity.
    pub tlp_pending: bool,
    /// The recovery in progress follows an RTO: cwnd grows by slow start.
    pub after_rto: bool,
}

impl PartialEq for LossHints {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}
impl Eq for LossHints {}

/// Probes without progress before the RTO is left to act alone.
const MAX_PROBES: u32 = 1;
/// Floor of the probe timeout: scheduling jitter on a loaded host must not
/// look like loss.
const MIN_PROBE_US: u64 = 10_000;
/// RFC 6675 DupThresh.
const DUP_THRESH: u32 = 3;

/// Our FIN.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct FinState {
    /// The application shut down the send side: FIN follows the queued data.
    pub queued: bool,
    /// The FIN has been sent at least once.
    pub sent: bool,
}

/// ACK generation (RFC 1122 §4.2.3.2, RFC 5681 §4.2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AckState {
    /// Send an ACK at the next poll.
    pub now: bool,
    /// Bytes received since the last ACK we sent.
    pub unacked_bytes: u32,
    /// RCV.NXT carried by the last ACK we sent (RFC 7323 Last.ACK.sent).
    pub last_sent: SeqNum,
    /// Most recent out-of-order block, reported first in SACK (RFC 2018 §4).
    pub last_ooo: Option<(SeqNum, SeqNum)>,
    /// Immediate ACKs still owed: one per out-of-order segment, even when a
    /// batch of them arrived before the next poll (the sender counts
    /// duplicate ACKs to detect loss).
    pub dup_pending: u32,
}

/// Timers, each the deadline it fires at.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Timers {
    pub retransmit: Option<Instant>,
    pub persist: Option<Instant>,
    pub delayed_ack: Option<Instant>,
    pub keepalive: Option<Instant>,
    /// TIME-WAIT expiry, or the FIN-WAIT-2 timeout of an orphan.
    pub close: Option<Instant>,
}

/// Control segments waiting for `poll_segment`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Pending {
    /// Send RST for an abort (SEQ = SND.MAX, ACK = RCV.NXT).
    pub rst: bool,
    /// Send a bare RST with this SEQ (answer to an unacceptable ACK, RFC 9293).
    pub rst_reply: Option<SeqNum>,
    /// Send a probe (SEQ = SND.UNA - 1): zero-window or keep-alive.
    pub probe: bool,
}

/// Retry counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Retries {
    /// Consecutive retransmission timeouts.
    pub rto: u32,
    /// Consecutive unanswered zero-window probes.
    pub persist: u32,
    /// Consecutive unanswered keep-alive probes.
    pub keepalive: u32,
}

/// Socket events a connection raised since the endpoint last looked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ConnEvents {
    pub established: bool,
    pub readable: bool,
    pub writable: bool,
    pub closed: bool,
}

/// Per-connection statistics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ConnStats {
    pub segments_in: u64,
    pub segments_out: u64,
    pub retransmits: u64,
    pub bytes_acked: u64,
    pub bytes_received: u64,
}

/// A TCP connection (the TCB).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Connection {
    pub state: State,
    /// Our address as the peer sees it (the service VIP).
    pub local: SocketAddrV4,
    pub remote: SocketAddrV4,
    pub params: ConnParams,
    pub snd: SendSeq,
    pub rcv: RecvSeq,
    pub opts: Negotiated,
    pub ts: Timestamps,
    pub rtt: RttEstimator,
    pub cc: Congestion,
    pub sack: Scoreboard,
    pub loss: LossHints,
    /// Send queue: bytes from SND.UNA (unacked, then unsent).
    pub tx: RingBuffer,
    /// Receive queue: in-order unread bytes, out-of-order bytes in its free space.
    pub rx: RingBuffer,
    /// Out-of-order intervals of `rx`, offsets from RCV.NXT.
    pub ooo: Assembler,
    pub fin: FinState,
    pub ack: AckState,
    pub timers: Timers,
    pub pending: Pending,
    pub retries: Retries,
    /// Set when the state becomes CLOSED.
    pub close_reason: Option<CloseReason>,
    /// The application asked to be told when send space frees up.
    pub want_writable: bool,
    pub events: ConnEvents,
    pub stats: ConnStats,
}

/// The earlier of two optional deadlines (`None` = not armed).
#[inline]
fn earliest(a: Option<Instant>, b: Option<Instant>) -> Option<Instant> {
    match (a, b) {
        (Some(x), Some(y)) => Some(x.min(y)),
        (x, None) => x,
        (None, y) => y,
    }
}

/// Window scale we announce: the smallest shift that lets the whole receive
/// buffer be advertised.
fn our_window_scale(rx_capacity: usize) -> u8 {
    let mut s = 0u8;
    while s < 14 && (rx_capacity >> s) > 0xffff {
        s += 1;
    }
    s
}

/// What `next_send` decided to transmit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SendKind {
    New,
    /// Go-back-N resend after a timeout (SND.NXT < SND.MAX).
    Resend,
    /// Fast retransmit of the segment at SND.UNA.
    Fast,
    /// SACK hole retransmission during recovery.
    Hole,
    /// Tail loss probe resending the last segment (RFC 8985 §7.3).
    Probe,
}

impl Connection {
    fn base(
        cfg: &TcpConfig,
        local: SocketAddrV4,
        remote: SocketAddrV4,
        iss: SeqNum,
        ts_offset: u32,
        state: State,
    ) -> Self {
        let params = ConnParams::from_config(cfg);
        let wscale = if cfg.window_scaling {
            our_window_scale(cfg.rx_buffer)
        } else {
            0
        };
        Connection {
            state,
            local,
            remote,
            params,
            snd: SendSeq {
                iss,
                una: iss,
                nxt: iss,
                max: iss,
                wnd: 0,
                wl1: SeqNum(0),
                wl2: iss,
                max_wnd: 0,
                wscale: 0,
                smss: 536,
            },
            rcv: RecvSeq {
                irs: SeqNum(0),
                nxt: SeqNum(0),
                wscale,
                adv_right: SeqNum(0),
                fin_seq: None,
                fin_received: false,
                mss: params.mss,
            },
            opts: Negotiated::default(),
            ts: Timestamps {
                recent: 0,
                offset: ts_offset,
            },
            rtt: RttEstimator::new(&params),
            cc: Congestion {
                cwnd: 0,
                ssthresh: u32::MAX,
                dup_acks: 0,
                recover: iss,
                in_recovery: false,
                ca_acked: 0,
                fast_retransmit: false,
                rexmit_next: iss,
            },
            sack: Scoreboard::default(),
            loss: LossHints::default(),
            tx: RingBuffer::new(cfg.tx_buffer),
            rx: RingBuffer::new(cfg.rx_buffer),
            ooo: Assembler::default(),
            fin: FinState::default(),
            ack: AckState::default(),
            timers: Timers::default(),
            pending: Pending::default(),
            retries: Retries::default(),
            close_reason: None,
            want_writable: false,
            events: ConnEvents::default(),
            stats: ConnStats::default(),
        }
    }

    /// Active open (RFC 9293 §3.10.1): SYN-SENT, the SYN goes out at the next poll.
    pub fn connect(
        cfg: &TcpConfig,
        local: SocketAddrV4,
        remote: SocketAddrV4,
        iss: SeqNum,
        ts_offset: u32,
    ) -> Self {
        Self::base(cfg, local, remote, iss, ts_offset, State::SynSent)
    }

    /// Passive open from a listener's SYN (RFC 9293 §3.10.7.2): SYN-RECEIVED,
    /// the SYN-ACK goes out at the next poll.
    pub fn accept_syn(
        cfg: &TcpConfig,
        now: Instant,
        local: SocketAddrV4,
        remote: SocketAddrV4,
        syn: &TcpRepr,
        iss: SeqNum,
        ts_offset: u32,
    ) -> Self {
        let mut c = Self::base(cfg, local, remote, iss, ts_offset, State::SynReceived);
        c.rcv.irs = syn.seq;
        c.rcv.nxt = syn.seq.add(1);
        c.rcv.adv_right = c.rcv.nxt;
        c.ack.last_sent = c.rcv.nxt;
        c.negotiate(&syn.options);
        c.snd.wnd = u32::from(syn.window); // never scaled in a SYN (RFC 7323 §2.2)
        c.snd.max_wnd = c.snd.wnd;
        c.snd.wl1 = syn.seq;
        c.last_activity(now);
        c
    }

    /// Applies the options of the peer's SYN.
    fn negotiate(&mut self, o: &TcpOptions) {
        let p = self.params;
        self.opts.sack = p.sack && o.sack_permitted;
        self.opts.timestamps = p.timestamps && o.timestamp.is_some();
        match (p.window_scaling, o.window_scale) {
            (true, Some(ws)) => {
                self.opts.window_scale = true;
                self.snd.wscale = ws;
            }
            _ => {
                self.opts.window_scale = false;
                self.snd.wscale = 0;
                self.rcv.wscale = 0;
            }
        }
        if let Some((tsval, _)) = o.timestamp {
            self.ts.recent = tsval;
        }
        // RFC 9293 §3.7.1: 536 when the peer sent no MSS option.
        let mss = o.mss.unwrap_or(536).min(p.mss).max(64);
        let overhead = if self.opts.timestamps { 12 } else { 0 };
        self.snd.smss = mss - overhead;
        let iw = p
            .initial_cwnd_segments
            .saturating_mul(u32::from(self.snd.smss));
        self.cc.cwnd = iw;
    }

    fn smss(&self) -> u32 {
        u32::from(self.snd.smss)
    }

    /// Our timestamp clock: milliseconds plus the per-connection offset.
    pub(crate) fn ts_now(&self, now: Instant) -> u32 {
        ((now.as_micros() / 1000) as u32).wrapping_add(self.ts.offset)
    }

    /// Receive window we can offer: free space of the receive queue.
    pub fn rcv_wnd(&self) -> u32 {
        let max = 0xffffu32 << self.rcv.wscale;
        (self.rx.free() as u32).min(max)
    }

    /// Bytes in flight per SND.NXT (before any SACK accounting).
    fn flight(&self) -> u32 {
        self.snd.max.since(self.snd.una)
    }

    /// Bytes sent and not acknowledged.
    pub fn unacked(&self) -> u32 {
        self.flight()
    }

    /// A sequence mark still meaningful: inside (SND.UNA, SND.MAX].
    fn live_mark(&self, m: Option<SeqNum>) -> Option<SeqNum> {
        m.filter(|&m| m > self.snd.una && m <= self.snd.max)
    }

    /// Un-SACKed bytes below the returned sequence are presumed lost:
    /// RFC 6675 IsLost (more than (DupThresh - 1) * SMSS bytes SACKed above),
    /// or everything below a timer's or a probe's mark.
    fn lost_edge(&self) -> SeqNum {
        let limit = (DUP_THRESH - 1) * self.smss();
        let mut above = 0u32;
        let mut edge = self.snd.una;
        for &(l, r) in self.sack.blocks().iter().rev() {
            above = above.saturating_add(r.since(l));
            if above > limit {
                edge = l;
                break;
            }
        }
        match self.live_mark(self.loss.lost_mark) {
            Some(m) if m > edge => m,
            _ => edge,
        }
    }

    /// RFC 6675 SetPipe: bytes in flight = sent - SACKed - presumed lost
    /// + retransmitted (below HighRxt) and not SACKed since.
    fn pipe(&self) -> u32 {
        let una = self.snd.una;
        let max = self.snd.max;
        let edge = self.lost_edge().max(una).min(max);
        let sacked = self.sack.sacked_in(una, max);
        let lost = edge
            .since(una)
            .saturating_sub(self.sack.sacked_in(una, edge));
        let hr = self.cc.rexmit_next.max(una).min(edge);
        let resent = hr.since(una).saturating_sub(self.sack.sacked_in(una, hr));
        max.since(una)
            .saturating_sub(sacked)
            .saturating_sub(lost)
            .saturating_add(resent)
    }

    /// Probe timeout (RFC 8985 §7.2): two smoothed RTTs, more for a single
    /// segment (the peer may delay its ACK). None before the first RTT
    /// sample, or after MAX_PROBES unanswered probes.
    fn probe_timeout(&self) -> Option<Duration> {
        if !self.rtt.has_sample || self.loss.probes >= MAX_PROBES {
            return None;
        }
        let mut us = (2 * self.rtt.srtt_us).max(MIN_PROBE_US);
        if self.flight() <= self.smss() {
            let delack = self.params.delayed_ack.as_micros() as u64;
            us = us.max(self.rtt.srtt_us + delack + MIN_PROBE_US);
        }
        Some(Duration::from_micros(us << self.loss.probes))
    }

    /// (Re)arms the probe timer while data is outstanding, when it fires
    /// before the RTO would.
    fn arm_probe(&mut self, now: Instant) {
        self.loss.probe = None;
        if self.snd.max == self.snd.una || !self.state.can_send() {
            return;
        }
        if let Some(pto) = self.probe_timeout() {
            let at = now + pto;
            if self.timers.retransmit.is_none_or(|rto| at < rto) {
                self.loss.probe = Some(at);
            }
        }
    }

    /// Enters loss recovery (RFC 6675 §5 / RFC 6582 §3.2 step 2).
    fn enter_fast_recovery(&mut self) {
        let smss = self.smss();
        let flight = self.flight();
        let sack = self.opts.sack;
        let cc = &mut self.cc;
        cc.ssthresh = (flight / 2).max(2 * smss);
        cc.recover = self.snd.max;
        cc.in_recovery = true;
        cc.fast_retransmit = true;
        cc.rexmit_next = self.snd.una;
        cc.cwnd = if sack {
            cc.ssthresh
        } else {
            cc.ssthresh + 3 * smss
        };
        self.loss.rxt_mark = None;
        self.loss.after_rto = false;
    }

    fn last_activity(&mut self, now: Instant) {
        self.retries.keepalive = 0;
        if let Some(ka) = self.params.keepalive {
            if self.state.is_synchronized() && self.state != State::TimeWait {
                self.timers.keepalive = Some(now + ka.idle);
            }
        }
    }

    fn enter_closed(&mut self, reason: CloseReason) {
        self.state = State::Closed;
        self.close_reason = Some(reason);
        self.timers = Timers::default();
        self.loss = LossHints::default();
        self.pending.probe = false;
        self.ack.now = false;
        self.events.closed = true;
        self.events.readable = true;
        self.events.writable = true;
    }

    fn enter_time_wait(&mut self, now: Instant) {
        self.state = State::TimeWait;
        self.loss = LossHints::default();
        self.timers = Timers {
            close: Some(now + self.params.time_wait),
            ..Timers::default()
        };
    }

    // ---------------------------------------------------------------- input

    /// Processes one segment addressed to this connection.
    pub fn process(&mut self, now: Instant, seg: &TcpRepr, ctr: &mut Counters) {
        self.stats.segments_in += 1;
        match self.state {
            State::Closed => return,
            State::SynSent => return self.process_syn_sent(now, seg, ctr),
            _ => {}
        }

        // RFC 5961 §3.2: RST is accepted only at exactly RCV.NXT; inside the
        // window it earns a challenge ACK; elsewhere it is dropped.
        if seg.rst {
            let wnd = self.rcv_wnd().max(1);
            if seg.seq == self.rcv.nxt {
                ctr.resets_received += 1;
                self.enter_closed(CloseReason::Reset);
            } else if seg.seq > self.rcv.nxt && seg.seq.since(self.rcv.nxt) < wnd {
                ctr.challenge_acks += 1;
                self.ack.now = true;
            } else {
                ctr.drops.out_of_window += 1;
            }
            return;
        }

        // RFC 7323 §5.3 PAWS (lite: no 24-day idle exception needed at our
        // time scales): a TSval older than TS.Recent marks an old duplicate.
        if self.opts.timestamps {
            if let Some((tsval, _)) = seg.options.timestamp {
                if (tsval.wrapping_sub(self.ts.recent) as i32) < 0 {
                    ctr.drops.paws += 1;
                    self.ack.now = true;
                    return;
                }
            }
        }

        if seg.syn {
            if self.state == State::SynReceived && seg.seq == self.rcv.irs && seg.ack.is_none() {
                // Our SYN-ACK was lost: the peer resent its SYN.
                self.snd.nxt = self.snd.iss;
                return;
            }
            // RFC 5961 §4.2: any SYN in a synchronized state gets a challenge ACK.
            ctr.challenge_acks += 1;
            self.ack.now = true;
            return;
        }

        self.last_activity(now);

        // RFC 9293 §3.10.7.4 first check: is the segment in the window?
        let seg_len = seg.payload.len() as u32 + u32::from(seg.fin);
        let wnd = self.rcv_wnd();
        let in_wnd = |s: SeqNum| s >= self.rcv.nxt && s.since(self.rcv.nxt) < wnd;
        let acceptable = match (seg_len, wnd) {
            (0, 0) => seg.seq == self.rcv.nxt,
            (0, _) => in_wnd(seg.seq),
            (_, 0) => false,
            (n, _) => {
                in_wnd(seg.seq)
                    || in_wnd(seg.seq.add(n - 1))
                    || (seg.seq < self.rcv.nxt && seg.seq.add(n) > self.rcv.nxt)
            }
        };
        let mut ack_only = false;
        if !acceptable {
            self.ack.now = true;
            if seg.seq.add(seg_len) <= self.rcv.nxt && seg_len > 0 {
                // Pure duplicate (our ACK was lost): re-ACK, not a drop.
            } else {
                ctr.drops.out_of_window += 1;
            }
            // Special allowance (RFC 9293): with a zero window still take the ACK.
            if !(seg.seq == self.rcv.nxt || (seg.seq.add(seg_len) <= self.rcv.nxt)) {
                return;
            }
            ack_only = true;
        }

        let Some(ack) = seg.ack else {
            // RFC 9293: "if the ACK bit is off drop the segment".
            ctr.drops.unexpected += 1;
            return;
        };

        // RFC 7323 §4.3: record TS.Recent when the segment covers Last.ACK.sent.
        if self.opts.timestamps {
            if let Some((tsval, _)) = seg.options.timestamp {
                if seg.seq <= self.ack.last_sent {
                    self.ts.recent = tsval;
                }
            }
        }

        if self.state == State::SynReceived {
            // RFC 9293: SYN-RECEIVED and SND.UNA < SEG.ACK =< SND.NXT -> ESTABLISHED.
            if ack > self.snd.una && ack <= self.snd.max {
                self.snd.una = ack;
                self.snd.nxt = self.snd.nxt.max(ack);
                self.snd.wnd = u32::from(seg.window) << self.snd.wscale;
                self.snd.max_wnd = self.snd.wnd;
                self.snd.wl1 = seg.seq;
                self.snd.wl2 = ack;
                self.timers.retransmit = None;
                self.retries.rto = 0;
                self.rtt_sample_on_ack(now, seg, ack);
                self.rtt.backoff = 0;
                self.cc.recover = ack;
                self.cc.rexmit_next = ack;
                self.state = State::Established;
                self.events.established = true;
                self.events.writable = true;
                self.last_activity(now);
            } else {
                // RFC 9293: unacceptable ACK in SYN-RECEIVED -> <SEQ=SEG.ACK><CTL=RST>.
                self.pending.rst_reply = Some(ack);
                ctr.drops.bad_ack += 1;
                return;
            }
        }

        if !self.process_ack(now, seg, ack, ctr) {
            return;
        }

        // Our FIN acknowledged? (SND.UNA is past it.)
        let fin_acked = self.fin.sent && self.tx.is_empty() && self.snd.una == self.snd.max;
        match self.state {
            // RFC 9293 FIN-WAIT-1: if our FIN is now acknowledged, enter FIN-WAIT-2.
            State::FinWait1 if fin_acked => {
                self.state = State::FinWait2;
                self.timers.retransmit = None;
            }
            // RFC 9293 CLOSING: if the ACK acknowledges our FIN, enter TIME-WAIT.
            State::Closing if fin_acked => {
                self.enter_time_wait(now);
                return;
            }
            // RFC 9293 LAST-ACK: the only thing that can arrive is the ACK of our FIN -> CLOSED.
            State::LastAck if fin_acked => {
                self.enter_closed(CloseReason::Normal);
                return;
            }
            // RFC 9293 TIME-WAIT: a retransmitted FIN is acknowledged and 2MSL restarts.
            State::TimeWait => {
                if seg.fin {
                    self.ack.now = true;
                    self.timers.close = Some(now + self.params.time_wait);
                }
                return;
            }
            _ => {}
        }
        if ack_only {
            return;
        }

        let mut fin_ok = seg.fin;
        if !seg.payload.is_empty() {
            if self.state.can_receive() {
                fin_ok &= self.receive_data(now, seg, ctr);
            } else {
                // Data after the peer's FIN: ignored (RFC 9293 "seventh").
                fin_ok = false;
            }
        }
        if fin_ok && self.rcv.fin_seq.is_none() && self.state.can_receive() {
            self.rcv.fin_seq = Some(seg.seq.add(seg.payload.len() as u32));
            if seg.payload.is_empty() && seg.seq != self.rcv.nxt {
                // FIN ahead of missing data: ACK at once so the peer fills the hole.
                self.ack.now = true;
            }
        } else if seg.fin && self.rcv.fin_received {
            // Retransmitted FIN (our ACK was lost).
            self.ack.now = true;
        }
        self.consume_fin(now);
        self.update_persist(now);
    }

    /// RFC 9293 §3.10.7.3 SYN-SENT.
    fn process_syn_sent(&mut self, now: Instant, seg: &TcpRepr, ctr: &mut Counters) {
        if let Some(ack) = seg.ack {
            // An ACK for something we never sent: <SEQ=SEG.ACK><CTL=RST> unless it is a RST.
            if ack <= self.snd.iss || ack > self.snd.max {
                if !seg.rst {
                    self.pending.rst_reply = Some(ack);
                }
                ctr.drops.bad_ack += 1;
                return;
            }
        }
        if seg.rst {
            // Acceptable only with an acceptable ACK: connection refused.
            if seg.ack.is_some() {
                ctr.resets_received += 1;
                self.enter_closed(CloseReason::Refused);
            }
            return;
        }
        if !seg.syn {
            ctr.drops.unexpected += 1;
            return;
        }
        self.rcv.irs = seg.seq;
        self.rcv.nxt = seg.seq.add(1);
        self.rcv.adv_right = self.rcv.nxt;
        self.negotiate(&seg.options);
        self.snd.wnd = u32::from(seg.window);
        self.snd.max_wnd = self.snd.wnd;
        self.snd.wl1 = seg.seq;
        self.ack.last_sent = self.rcv.nxt;
        match seg.ack {
            Some(ack) => {
                // Our SYN is acknowledged: ESTABLISHED, ACK the peer's SYN.
                self.snd.wl2 = ack;
                self.rtt_sample_on_ack(now, seg, ack);
                self.rtt.backoff = 0;
                self.snd.una = ack;
                self.cc.recover = ack;
                self.cc.rexmit_next = ack;
                self.timers.retransmit = None;
                self.retries.rto = 0;
                self.state = State::Established;
                self.events.established = true;
                self.events.writable = true;
                self.ack.now = true;
                self.last_activity(now);
            }
            None => {
                // Simultaneous open: SYN-RECEIVED, resend our SYN as SYN-ACK.
                self.state = State::SynReceived;
                self.snd.nxt = self.snd.iss;
            }
        }
    }

    /// Takes an RTT sample for an ACK that advances SND.UNA.
    fn rtt_sample_on_ack(&mut self, now: Instant, seg: &TcpRepr, ack: SeqNum) {
        let p = self.params;
        // RFC 7323 §4.1: TSecr gives a sample even for retransmitted data.
        if self.opts.timestamps {
            if let Some((_, tsecr)) = seg.options.timestamp {
                let ms = self.ts_now(now).wrapping_sub(tsecr);
                if tsecr != 0 && ms < 0x7fff_ffff {
                    self.rtt.sample(Duration::from_millis(u64::from(ms)), &p);
                    self.rtt.timed = None;
                    return;
                }
            }
        }
        // Karn: only a segment that was never retransmitted is timed.
        if let Some((end, sent)) = self.rtt.timed {
            if ack >= end {
                self.rtt.sample(now - sent, &p);
                self.rtt.timed = None;
            }
        }
    }

    /// ACK processing for synchronized states. Returns false when the
    /// segment must be dropped.
    fn process_ack(
        &mut self,
        now: Instant,
        seg: &TcpRepr,
        ack: SeqNum,
        ctr: &mut Counters,
    ) -> bool {
        // RFC 5961 §5.2: acceptable ACKs lie in [SND.UNA - MAX.SND.WND, SND.MAX].
        if ack > self.snd.max {
            ctr.drops.bad_ack += 1;
            self.ack.now = true;
            return false;
        }
        let window_back = self.snd.max_wnd.max(65535);
        if ack < self.snd.una.sub(window_back) {
            ctr.drops.bad_ack += 1;
            ctr.challenge_acks += 1;
            self.ack.now = true;
            return false;
        }
        let wnd = u32::from(seg.window) << self.snd.wscale;
        let smss = self.smss();

        // RFC 2018 / 6675: record SACK blocks that lie in (SND.UNA, SND.MAX].
        let mut new_sack = false;
        if self.opts.sack {
            for &(l, r) in seg.options.sack.as_slice() {
                if l >= self.snd.una && r <= self.snd.max && l < r {
                    new_sack |= self.sack.add(l, r);
                }
            }
        }

        let progress = new_sack || ack > self.snd.una;
        if ack > self.snd.una {
            let acked = ack.since(self.snd.una);
            let data = (acked as usize).min(self.tx.len());
            self.tx.consume(data);
            self.stats.bytes_acked += data as u64;
            self.rtt_sample_on_ack(now, seg, ack);
            let flight_before = self.flight();
            self.snd.una = ack;
            self.snd.nxt = self.snd.nxt.max(ack);
            self.sack.trim(ack);
            self.retries.rto = 0;
            self.retries.persist = 0;
            self.rtt.backoff = 0;
            self.on_new_ack(acked, ack, flight_before, smss);
            // RFC 6298 §5.2/5.3: stop the timer when all is acked, else restart it.
            self.timers.retransmit = if self.snd.una == self.snd.max {
                None
            } else {
                Some(now + self.rtt.rto(&self.params))
            };
            if data > 0 && self.want_writable {
                self.want_writable = false;
                self.events.writable = true;
            }
        } else if ack == self.snd.una
            && self.snd.max > self.snd.una
            && (new_sack || (seg.payload.is_empty() && !seg.fin && wnd == self.snd.wnd))
        {
            // RFC 5681 §2 duplicate ACK; with SACK, RFC 6675 §2 counts any
            // ACK carrying new SACK information, also one riding on data
            // (an echo or request-response peer acknowledges that way).
            self.on_dup_ack(smss);
        }
        self.detect_loss(now, new_sack, progress);

        // RFC 9293 window update rule: SND.WL1 < SEG.SEQ or (= and SND.WL2 =< SEG.ACK).
        if self.snd.wl1 < seg.seq || (self.snd.wl1 == seg.seq && self.snd.wl2 <= ack) {
            self.snd.wnd = wnd;
            self.snd.wl1 = seg.seq;
            self.snd.wl2 = ack;
            self.snd.max_wnd = self.snd.max_wnd.max(wnd);
        }
        true
    }

    /// Congestion response to an ACK of new data.
    fn on_new_ack(&mut self, acked: u32, ack: SeqNum, flight_before: u32, smss: u32) {
        let sack = self.opts.sack;
        let after_rto = self.loss.after_rto;
        let cc = &mut self.cc;
        cc.dup_acks = 0;
        if cc.in_recovery {
            if ack >= cc.recover {
                if !after_rto {
                    // RFC 6582 §3.2 step 3 (full ACK): deflate to
                    // min(ssthresh, FlightSize + SMSS).
                    let flight = flight_before.saturating_sub(acked);
                    cc.cwnd = cc.ssthresh.min(flight.max(smss) + smss);
                }
                // After an RTO cwnd keeps what slow start reached.
                cc.in_recovery = false;
                cc.fast_retransmit = false;
                self.loss.lost_mark = None;
                self.loss.rxt_mark = None;
                self.loss.after_rto = false;
            } else if !sack {
                // RFC 6582 step 4 (partial ACK): resend the first unacked
                // segment and deflate by the amount acked.
                cc.fast_retransmit = true;
                cc.rexmit_next = cc.rexmit_next.max(ack);
                cc.cwnd = cc.cwnd.saturating_sub(acked).saturating_add(smss).max(smss);
            } else {
                // RFC 6675: NextSeg picks the next hole; HighRxt never lags
                // SND.UNA. After an RTO the window grows by slow start.
                cc.rexmit_next = cc.rexmit_next.max(ack);
                if after_rto && cc.cwnd < cc.ssthresh {
                    cc.cwnd = cc.cwnd.saturating_add(acked.min(2 * smss));
                }
            }
        } else if cc.cwnd < cc.ssthresh {
            // RFC 5681 §3.1 slow start (RFC 3465 L = 2 SMSS).
            cc.cwnd = cc.cwnd.saturating_add(acked.min(2 * smss));
        } else {
            // Congestion avoidance: one SMSS per cwnd of acked bytes.
            cc.ca_acked = cc.ca_acked.saturating_add(acked);
            if cc.ca_acked >= cc.cwnd {
                cc.ca_acked -= cc.cwnd;
                cc.cwnd = cc.cwnd.saturating_add(smss);
            }
        }
    }

    fn on_dup_ack(&mut self, smss: u32) {
        let sack = self.opts.sack;
        let cc = &mut self.cc;
        cc.dup_acks = cc.dup_acks.saturating_add(1);
        if cc.in_recovery && !sack {
            // RFC 6582 step 3/RFC 5681 §3.2 step 4: inflate per extra dup
            // ACK (the SACK variant uses the pipe estimate instead).
            cc.cwnd = cc.cwnd.saturating_add(smss);
        }
    }

    /// After every acceptable ACK: recovery entry (duplicate ACKs, RFC 6675
    /// IsLost, a probe's answer) and lost retransmissions; an ACK that made
    /// progress (new data acknowledged or SACKed) re-arms the probe timer.
    fn detect_loss(&mut self, now: Instant, new_sack: bool, progress: bool) {
        let una = self.snd.una;
        if self.live_mark(self.loss.lost_mark).is_none() {
            self.loss.lost_mark = None;
        }
        if !self.cc.in_recovery && self.snd.max > una {
            // RFC 6582 §3.2 step 2: only past the last recovery point.
            let fresh = una > self.cc.recover.sub(1);
            let sack = self.opts.sack;
            let probed = self.loss.probes > 0 && new_sack;
            let lost = sack && self.lost_edge() > una;
            if fresh && (self.cc.dup_acks >= DUP_THRESH || lost || probed) {
                self.enter_fast_recovery();
                if probed {
                    // A probe sent a probe timeout after the rest arrived
                    // while the rest did not: presume the holes lost.
                    self.loss.lost_mark = self.sack.highest();
                }
            }
        } else if self.cc.in_recovery && self.opts.sack && new_sack {
            // A retransmission is lost when data sent after it was SACKed
            // while it was not acknowledged: retransmit the holes again.
            let resent = self.cc.rexmit_next.max(una);
            if let (Some(mark), Some(hi)) =
                (self.live_mark(self.loss.rxt_mark), self.sack.highest())
            {
                if hi > mark && self.sack.next_hole(una).0 < resent {
                    self.cc.rexmit_next = una;
                    self.loss.lost_mark = Some(mark);
                    self.loss.rxt_mark = None;
                }
            }
        }
        if progress {
            self.loss.probes = 0;
            self.loss.tlp_pending = false;
            self.arm_probe(now);
        }
    }

    /// Accepts in-window payload into the receive queue. Returns true when
    /// everything up to the segment's end was stored (so its FIN counts).
    fn receive_data(&mut self, now: Instant, seg: &TcpRepr, ctr: &mut Counters) -> bool {
        let mut seq = seg.seq;
        let mut data = seg.payload;
        if seq < self.rcv.nxt {
            let cut = self.rcv.nxt.since(seq) as usize;
            if cut >= data.len() {
                // Entirely old: our ACK was lost, re-ACK at once.
                self.ack.now = true;
                return true;
            }
            data = &data[cut..];
            seq = self.rcv.nxt;
        }
        let off = seq.since(self.rcv.nxt) as usize;
        let free = self.rx.free();
        if off >= free {
            self.ack.now = true;
            return false;
        }
        let complete = off + data.len() <= free;
        let data = &data[..data.len().min(free - off)];
        let had_ooo = !self.ooo.is_empty();
        self.rx.write_unallocated(off, data);
        if off == 0 {
            let n = data.len() as u32;
            self.rx.commit(data.len());
            self.ooo.advance(n);
            let more = self.ooo.take_front();
            self.rx.commit(more as usize);
            self.rcv.nxt = self.rcv.nxt.add(n + more);
            self.stats.bytes_received += u64::from(n + more);
            self.events.readable = true;
            if had_ooo {
                // RFC 5681 §4.2: ACK at once when a segment fills a hole.
                self.ack.now = true;
            } else {
                // RFC 1122 §4.2.3.2: ACK at least every second full segment,
                // otherwise within the delayed-ACK time.
                self.ack.unacked_bytes = self.ack.unacked_bytes.saturating_add(n);
                let full = u32::from(self.rcv.mss) - if self.opts.timestamps { 12 } else { 0 };
                if self.ack.unacked_bytes >= 2 * full {
                    self.ack.now = true;
                } else if self.timers.delayed_ack.is_none() {
                    self.timers.delayed_ack = Some(now + self.params.delayed_ack);
                }
            }
        } else {
            let end = off + data.len();
            if self.ooo.add(off as u32, end as u32).is_err() {
                ctr.drops.reassembly_full += 1;
            } else {
                self.ack.last_ooo = Some((seq, seq.add(data.len() as u32)));
            }
            // RFC 5681 §4.2: out-of-order data triggers an immediate (dup) ACK.
            self.ack.now = true;
            self.ack.dup_pending = (self.ack.dup_pending + 1).min(16);
        }
        complete
    }

    /// Consumes the peer's FIN once all data before it has arrived.
    fn consume_fin(&mut self, now: Instant) {
        let Some(f) = self.rcv.fin_seq else { return };
        if self.rcv.fin_received || f != self.rcv.nxt {
            return;
        }
        self.rcv.nxt = self.rcv.nxt.add(1);
        self.rcv.fin_received = true;
        self.ack.now = true;
        self.events.readable = true;
        match self.state {
            // RFC 9293 "eighth, check the FIN bit": ESTABLISHED -> CLOSE-WAIT.
            State::Established => self.state = State::CloseWait,
            // FIN-WAIT-1 with our FIN not yet acked: simultaneous close -> CLOSING.
            State::FinWait1 => self.state = State::Closing,
            // FIN-WAIT-2 -> TIME-WAIT.
            State::FinWait2 => self.enter_time_wait(now),
            _ => {}
        }
    }

    /// Arms or clears the persist timer (RFC 9293 §3.8.6.1).
    fn update_persist(&mut self, now: Instant) {
        let data_end = self.snd.una.add(self.tx.len() as u32);
        let blocked = self.state.can_send()
            && self.snd.wnd == 0
            && data_end > self.snd.nxt
            && self.snd.max == self.snd.una;
        if blocked {
            if self.timers.persist.is_none() {
                let base = self.rtt.rto(&self.params);
                let d = base
                    .saturating_mul(1u32 << self.retries.persist.min(16))
                    .min(self.params.max_rto);
                self.timers.persist = Some(now + d);
            }
        } else {
            self.timers.persist = None;
        }
    }

    // ---------------------------------------------------------------- timers

    /// Earliest timer deadline. Straight-line: it runs after every segment
    /// in and out (the endpoint's timer heap), and the iterator chain it
    /// replaced (`[..].into_iter().flatten().min()`) cost several times the
    /// instructions.
    pub fn next_deadline(&self) -> Option<Instant> {
        let t = &self.timers;
        let a = earliest(t.retransmit, t.persist);
        let b = earliest(t.delayed_ack, t.keepalive);
        let c = earliest(t.close, self.loss.probe);
        earliest(earliest(a, b), c)
    }

    /// Fires every timer whose deadline is at or before `now`.
    pub fn on_timeout(&mut self, now: Instant, ctr: &mut Counters) {
        let due = |t: Option<Instant>| t.is_some_and(|t| t <= now);
        if due(self.timers.close) {
            // TIME-WAIT 2MSL expiry, or the orphan FIN-WAIT-2 timeout.
            self.enter_closed(CloseReason::Normal);
            return;
        }
        if due(self.timers.retransmit) {
            self.timers.retransmit = None;
            self.loss.probe = None;
            self.on_retransmit_timeout(ctr);
            if self.state == State::Closed {
                return;
            }
        }
        if due(self.loss.probe) {
            self.loss.probe = None;
            self.on_probe_timeout(now);
        }
        if due(self.timers.persist) {
            self.timers.persist = None;
            self.retries.persist += 1;
            if self.retries.persist > self.params.max_retries {
                ctr.connections_timed_out += 1;
                self.enter_closed(CloseReason::TimedOut);
                return;
            }
            ctr.zero_window_probes += 1;
            self.pending.probe = true;
            self.update_persist(now);
        }
        if due(self.timers.delayed_ack) {
            self.timers.delayed_ack = None;
            self.ack.now = true;
        }
        if due(self.timers.keepalive) {
            if let Some(ka) = self.params.keepalive {
                if self.retries.keepalive >= ka.probes {
                    ctr.connections_timed_out += 1;
                    self.enter_closed(CloseReason::TimedOut);
                    return;
                }
                self.retries.keepalive += 1;
                ctr.keepalive_probes += 1;
                self.pending.probe = true;
                self.timers.keepalive = Some(now + ka.interval);
            } else {
                self.timers.keepalive = None;
            }
        }
    }

    /// RFC 6298 §5.4–5.7 plus RFC 5681 §3.1 loss response.
    fn on_retransmit_timeout(&mut self, ctr: &mut Counters) {
        match self.state {
            State::SynSent | State::SynReceived => {
                let limit = if self.state == State::SynSent {
                    self.params.syn_retries
                } else {
                    self.params.synack_retries
                };
                self.retries.rto += 1;
                if self.retries.rto > limit {
                    ctr.connections_timed_out += 1;
                    self.enter_closed(CloseReason::TimedOut);
                    return;
                }
                self.snd.nxt = self.snd.iss;
                self.rtt.backoff += 1;
                self.rtt.timed = None;
                ctr.retransmits_timeout += 1;
            }
            _ if self.snd.max == self.snd.una => {}
            _ => {
                self.retries.rto += 1;
                if self.retries.rto > self.params.max_retries {
                    ctr.connections_timed_out += 1;
                    self.enter_closed(CloseReason::TimedOut);
                    return;
                }
                let smss = self.smss();
                let flight = self.flight();
                let first = self.retries.rto == 1;
                let cc = &mut self.cc;
                // RFC 5681 §3.1 (5.5 of RFC 6298): ssthresh from the flight,
                // once per loss episode (not again on a backed-off timeout,
                // nor over a fast recovery that already reduced it).
                if first && !cc.in_recovery {
                    cc.ssthresh = (flight / 2).max(2 * smss);
                }
                cc.cwnd = smss;
                cc.dup_acks = 0;
                cc.ca_acked = 0;
                cc.recover = self.snd.max;
                cc.fast_retransmit = false;
                if self.opts.sack {
                    // RFC 6675 §5.1: everything not SACKed is presumed lost
                    // and resent in order as slow start allows, skipping
                    // what the peer holds. SACK information may be reneged
                    // (RFC 2018 §8): a second timeout in a row forgets it.
                    if !first {
                        self.sack.clear();
                    }
                    cc.in_recovery = true;
                    cc.rexmit_next = self.snd.una;
                    self.loss.lost_mark = Some(self.snd.max);
                    self.loss.rxt_mark = None;
                    self.loss.after_rto = true;
                } else {
                    // Go-back-N from SND.UNA.
                    cc.in_recovery = false;
                    self.sack.clear();
                    self.snd.nxt = self.snd.una;
                }
                // Probes stay spent until an ACK makes progress, so a dead
                // peer meets the RTO schedule alone.
                self.loss.tlp_pending = false;
                self.rtt.backoff += 1;
                self.rtt.timed = None;
                ctr.retransmits_timeout += 1;
            }
        }
    }

    /// The probe timer fired: no ACK made progress for a probe timeout.
    fn on_probe_timeout(&mut self, now: Instant) {
        if self.snd.max == self.snd.una || !self.state.can_send() {
            return;
        }
        self.loss.probes += 1;
        if self.cc.in_recovery && self.opts.sack {
            // The recovery stalled (a retransmission or its ACK was lost):
            // everything not SACKed is presumed lost, the first hole goes
            // out at once and the rest as the pipe allows.
            self.loss.lost_mark = Some(self.snd.max);
            self.loss.rxt_mark = None;
            self.cc.rexmit_next = self.snd.una;
            self.cc.fast_retransmit = true;
        } else {
            // RFC 8985 §7: a tail loss probe draws an ACK whose SACK
            // information reveals the losses.
            self.loss.tlp_pending = true;
        }
        // Unlike RFC 8985 §7.3 the RTO is not pushed back: a probe fires
        // well before it (the probe timer is only armed when it does), and
        // a dead peer is then given up on the RTO schedule alone.
        self.arm_probe(now);
    }

    // ---------------------------------------------------------------- output

    /// The options and header fields common to every segment we send.
    fn template(&self, now: Instant, seq: SeqNum) -> TcpRepr<'static> {
        let mut r = TcpRepr::new(self.local.port(), self.remote.port(), seq);
        r.ack = Some(self.rcv.nxt);
        r.window = self.window_field();
        if self.opts.timestamps {
            r.options.timestamp = Some((self.ts_now(now), self.ts.recent));
        }
        if self.opts.sack && !self.ooo.is_empty() {
            r.options.sack = self.sack_blocks();
        }
        r
    }

    /// SACK blocks: the most recent out-of-order block first (RFC 2018 §4).
    fn sack_blocks(&self) -> SackBlocks {
        let mut b = SackBlocks::new();
        let base = self.rcv.nxt;
        let ranges = self.ooo.ranges();
        let recent = self.ack.last_ooo.and_then(|(l, _)| {
            let off = l.since(base);
            ranges.iter().position(|&(s, e)| s <= off && off < e)
        });
        if let Some(i) = recent {
            let (s, e) = ranges[i];
            b.push(base.add(s), base.add(e));
        }
        // The other blocks in order; when they do not all fit (3 blocks
        // beside timestamps, 4 without), each segment starts the list at a
        // different one, so every block keeps being reported even when the
        // ACKs that carried it are lost (RFC 2018 §4 asks for repeating
        // blocks already reported; a sender whose scoreboard misses one
        // would resend data we hold).
        let room = if self.opts.timestamps { 3 } else { 4 };
        let others = ranges.len() - usize::from(recent.is_some());
        let first = if others > room - b.len() {
            (self.stats.segments_out % others as u64) as usize
        } else {
            0
        };
        let order = ranges
            .iter()
            .enumerate()
            .filter(|&(i, _)| Some(i) != recent)
            .map(|(_, r)| r);
        for &(s, e) in order.clone().skip(first).chain(order.take(first)) {
            b.push(base.add(s), base.add(e));
        }
        b
    }

    /// The window we advertise, with receiver-side SWS avoidance (RFC 1122
    /// §4.2.3.3): the right edge moves only by min(buffer/2, MSS) or more,
    /// and never moves left.
    fn advertised_window(&self) -> u32 {
        let wnd = self.rcv_wnd();
        let old = self.rcv.adv_right.since(self.rcv.nxt);
        let step = ((self.rx.capacity() / 2) as u32).min(u32::from(self.rcv.mss));
        if wnd > old && wnd - old < step {
            old
        } else {
            wnd.max(old.min(self.rx.free() as u32))
        }
    }

    fn window_field(&self) -> u16 {
        if matches!(self.state, State::SynSent | State::SynReceived) {
            // RFC 7323 §2.2: the window in a SYN is never scaled.
            return self.rcv_wnd().min(0xffff) as u16;
        }
        (self.advertised_window() >> self.rcv.wscale).min(0xffff) as u16
    }

    /// Bookkeeping after any segment carrying ACK = RCV.NXT left.
    fn on_ack_sent(&mut self, window_field: u16) {
        self.ack.now = false;
        self.ack.unacked_bytes = 0;
        self.ack.last_sent = self.rcv.nxt;
        self.timers.delayed_ack = None;
        let wnd = if matches!(self.state, State::SynSent | State::SynReceived) {
            u32::from(window_field)
        } else {
            u32::from(window_field) << self.rcv.wscale
        };
        // The right edge only moves right; a stale edge (behind RCV.NXT, or
        // never set) is simply replaced.
        let edge = self.rcv.nxt.add(wnd);
        if edge > self.rcv.adv_right || self.rcv.adv_right < self.rcv.nxt {
            self.rcv.adv_right = edge;
        }
    }

    /// Decides the next data/FIN segment: (start, payload length, FIN, kind).
    fn next_send(&self) -> Option<(SeqNum, u32, bool, SendKind)> {
        if !self.state.can_send() {
            return None;
        }
        let smss = self.smss();
        let una = self.snd.una;
        let data_end = una.add(self.tx.len() as u32);
        let fin_at = |end: SeqNum| self.fin.queued && end == data_end;

        let sack = self.opts.sack;
        // NewReno fast retransmit (RFC 5681 §3.2 step 2 / RFC 6582 partial
        // ACK) of the segment at SND.UNA, whatever the window.
        if !sack && self.cc.fast_retransmit && self.snd.max > una {
            let len = data_end.since(una).min(smss);
            let fin = fin_at(una.add(len)) && self.fin.sent;
            if len > 0 || fin {
                return Some((una, len, fin, SendKind::Fast));
            }
        }

        let pipe = if sack {
            self.pipe()
        } else {
            self.snd.nxt.since(una)
        };
        if sack && self.cc.in_recovery {
            // RFC 6675 NextSeg rule 1: the first un-SACKed byte above
            // HighRxt that is presumed lost. The first one after entering
            // recovery (or a probe) goes out whatever the pipe.
            let edge = self.lost_edge();
            let force = self.cc.fast_retransmit;
            if force || self.cc.cwnd.saturating_sub(pipe) >= smss {
                let (start, hole_end) = self.sack.next_hole(self.cc.rexmit_next.max(una));
                // Entered on duplicate ACKs without SACK evidence: the first
                // hole counts as lost all the same (RFC 6675 §5 step 4.3).
                let edge = if force {
                    edge.max(start.add(smss)).min(self.snd.max)
                } else {
                    edge
                };
                if start < edge {
                    let lim = hole_end.map_or(edge, |e| e.min(edge));
                    let len = lim.since(start).min(data_end.since(start)).min(smss);
                    let fin = self.fin.sent && fin_at(start.add(len));
                    if len > 0 || fin {
                        return Some((start, len, fin, SendKind::Hole));
                    }
                }
            }
        }

        if self.loss.tlp_pending && self.snd.max > una && self.snd.nxt == self.snd.max {
            // RFC 8985 §7.3: the probe is new data if the peer's window
            // allows, else the last segment sent again.
            let wnd_end = una.add(self.snd.wnd);
            let start = self.snd.max;
            let len = data_end.since(start).min(smss).min(wnd_end.since(start));
            if start <= data_end && len > 0 {
                let fin = fin_at(start.add(len)) && len == data_end.since(start);
                return Some((start, len, fin, SendKind::New));
            }
            let last_end = self.snd.max.min(data_end);
            let len = last_end.since(una).min(smss);
            let start = last_end.sub(len);
            let fin = self.fin.sent && fin_at(last_end);
            if len > 0 || fin {
                return Some((start, len, fin, SendKind::Probe));
            }
        }

        let start = self.snd.nxt;
        let resend = start < self.snd.max;
        let wnd_end = una.add(self.snd.wnd);
        let avail = data_end.since(start);
        // RFC 3042 limited transmit: each of the first two duplicate ACKs
        // lets one more new segment out.
        let limited = if !self.cc.in_recovery && !resend {
            self.cc.dup_acks.min(DUP_THRESH - 1) * smss
        } else {
            0
        };
        let cwnd_room = (self.cc.cwnd + limited).saturating_sub(pipe);
        let wnd_room = wnd_end.since(start);
        let len = avail.min(smss).min(cwnd_room).min(wnd_room);
        // RFC 1122 §4.2.3.4 sender SWS avoidance: no runt while more data is
        // waiting and something is in flight to clock the next send.
        if len < avail && len < smss && !resend && pipe > 0 && len < self.snd.max_wnd / 2 {
            return None;
        }
        let fin = fin_at(start.add(len)) && (len == avail);
        if len == 0 && !fin {
            return None;
        }
        Some((
            start,
            len,
            fin,
            if resend {
                SendKind::Resend
            } else {
                SendKind::New
            },
        ))
    }

    /// Writes the next segment this connection wants to send into `buf`
    /// (which should hold at least 60 bytes + MSS), returning its length.
    pub fn poll_segment(
        &mut self,
        now: Instant,
        buf: &mut [u8],
        ctr: &mut Counters,
    ) -> Option<usize> {
        if let Some(seq) = self.pending.rst_reply.take() {
            let mut r = TcpRepr::new(self.local.port(), self.remote.port(), seq);
            r.rst = true;
            ctr.resets_sent += 1;
            return self.emit(&r, &[], buf);
        }
        match self.state {
            State::Closed => {
                if !self.pending.rst {
                    return None;
                }
                // Abort (RFC 9293 ABORT call): <SEQ=SND.NXT><CTL=RST>, with ACK.
                self.pending.rst = false;
                let mut r = TcpRepr::new(self.local.port(), self.remote.port(), self.snd.max);
                r.rst = true;
                r.ack = Some(self.rcv.nxt);
                ctr.resets_sent += 1;
                return self.emit(&r, &[], buf);
            }
            State::SynSent | State::SynReceived => {
                if self.snd.nxt != self.snd.iss {
                    return None;
                }
                let mut r = TcpRepr::new(self.local.port(), self.remote.port(), self.snd.iss);
                r.syn = true;
                r.window = self.window_field();
                let p = self.params;
                r.options.mss = Some(p.mss);
                let active = self.state == State::SynSent;
                if active {
                    r.options.window_scale = p.window_scaling.then_some(self.rcv.wscale);
                    r.options.sack_permitted = p.sack;
                    r.options.timestamp = p.timestamps.then(|| (self.ts_now(now), 0));
                } else {
                    r.ack = Some(self.rcv.nxt);
                    r.options.window_scale = self.opts.window_scale.then_some(self.rcv.wscale);
                    r.options.sack_permitted = self.opts.sack;
                    r.options.timestamp = self
                        .opts
                        .timestamps
                        .then(|| (self.ts_now(now), self.ts.recent));
                }
                if self.rtt.timed.is_none() && self.retries.rto == 0 {
                    self.rtt.timed = Some((self.snd.iss.add(1), now));
                }
                self.snd.nxt = self.snd.iss.add(1);
                self.snd.max = self.snd.max.max(self.snd.nxt);
                if self.timers.retransmit.is_none() {
                    self.timers.retransmit = Some(now + self.rtt.rto(&self.params));
                }
                let wf = r.window;
                let n = self.emit(&r, &[], buf)?;
                if !active {
                    self.on_ack_sent(wf);
                }
                return Some(n);
            }
            _ => {}
        }

        if let Some((start, len, fin, kind)) = self.next_send() {
            let mut r = self.template(now, start);
            r.fin = fin;
            // Leave room for the header in `buf`.
            let room = buf.len().saturating_sub(r.header_len()) as u32;
            let len = len.min(room);
            let fin = fin && start.add(len) == self.snd.una.add(self.tx.len() as u32);
            r.fin = fin;
            r.psh = len > 0 && start.add(len) == self.snd.una.add(self.tx.len() as u32);
            let off = start.since(self.snd.una) as usize;
            let hl = r.header_len();
            let wf = r.window;
            if r.emit_header(buf, len as usize).is_err() {
                return None;
            }
            let copied = self.tx.read_at(off, &mut buf[hl..hl + len as usize]);
            debug_assert_eq!(copied, len as usize);
            let total = hl + len as usize;
            crate::wire::TcpPacket::new_unchecked(&mut buf[..total])
                .fill_checksum(*self.local.ip(), *self.remote.ip());
            let end = start.add(len + u32::from(fin));
            if kind != SendKind::New {
                // Karn: an ACK covering retransmitted data gives no sample.
                self.rtt.timed = None;
            }
            match kind {
                SendKind::Fast => {
                    self.cc.fast_retransmit = false;
                    self.cc.rexmit_next = self.cc.rexmit_next.max(end);
                    ctr.retransmits_fast += 1;
                    self.stats.retransmits += 1;
                }
                SendKind::Hole => {
                    self.cc.fast_retransmit = false;
                    self.cc.rexmit_next = end;
                    self.loss.rxt_mark = Some(self.snd.max.max(end));
                    ctr.retransmits_fast += 1;
                    self.stats.retransmits += 1;
                }
                SendKind::Probe => {
                    self.loss.tlp_pending = false;
                    ctr.retransmits_fast += 1;
                    self.stats.retransmits += 1;
                }
                SendKind::Resend | SendKind::New => {
                    self.loss.tlp_pending = false;
                    self.snd.nxt = self.snd.nxt.max(end);
                    if kind == SendKind::Resend {
                        self.stats.retransmits += 1;
                    } else if self.rtt.timed.is_none() && !self.opts.timestamps {
                        self.rtt.timed = Some((end, now));
                    }
                }
            }
            if end > self.snd.max {
                self.snd.max = end;
            }
            if fin {
                self.fin.sent = true;
            }
            if self.timers.retransmit.is_none() {
                self.timers.retransmit = Some(now + self.rtt.rto(&self.params));
            }
            if self.loss.probe.is_none() {
                self.arm_probe(now);
            }
            self.timers.persist = None;
            self.on_ack_sent(wf);
            self.stats.segments_out += 1;
            return Some(total);
        }

        if self.pending.probe {
            // Zero-window / keep-alive probe: SEG.SEQ = SND.UNA - 1, no data;
            // the peer answers with an ACK carrying its current window.
            self.pending.probe = false;
            let r = self.template(now, self.snd.una.sub(1));
            let wf = r.window;
            let n = self.emit(&r, &[], buf)?;
            self.on_ack_sent(wf);
            return Some(n);
        }

        if self.ack.now || self.ack.dup_pending > 0 || self.window_update_due() {
            let r = self.template(now, self.snd.nxt);
            let wf = r.window;
            let n = self.emit(&r, &[], buf)?;
            self.on_ack_sent(wf);
            self.ack.dup_pending = self.ack.dup_pending.saturating_sub(1);
            return Some(n);
        }
        // RFC 6298 §5.1: data in flight always has a running retransmission
        // timer. A connection exported between its RTO firing (timer
        // stopped, everything in flight marked lost in the loss hints) and
        // the retransmission that restarts the timer arrives on its target
        // with neither: the hints are soft state a snapshot does not carry.
        // With nothing it may send (the whole flight still counts against
        // cwnd) it waited for an ACK that a client expecting replies never
        // sends (the sidecar's pipelined RESP stall, issue #8). Restarting
        // the timer here makes it wait for one RTO at most.
        if self.timers.retransmit.is_none() && self.snd.max != self.snd.una && self.state.can_send()
        {
            self.timers.retransmit = Some(now + self.rtt.rto(&self.params));
        }
        None
    }

    /// After the application read, tell the peer if the window opened a lot
    /// (at least 2 MSS or half the buffer past the last advertised edge).
    fn window_update_due(&self) -> bool {
        if !self.state.can_receive() {
            return false;
        }
        let old = self.rcv.adv_right.since(self.rcv.nxt);
        let new = self.advertised_window();
        let step = ((self.rx.capacity() / 2) as u32).min(2 * u32::from(self.rcv.mss));
        new > old && new - old >= step
    }

    fn emit(&mut self, r: &TcpRepr, payload: &[u8], buf: &mut [u8]) -> Option<usize> {
        let mut r = *r;
        r.payload = payload;
        let n = r.emit(buf, *self.local.ip(), *self.remote.ip()).ok()?;
        self.stats.segments_out += 1;
        Some(n)
    }

    /// Largest buffer `poll_segment` may need.
    pub fn max_segment_len(&self) -> usize {
        MAX_HEADER_LEN + usize::from(self.params.mss)
    }

    // ---------------------------------------------------------------- socket calls

    /// Error for a closed connection, if it ended abnormally.
    fn closed_error(&self) -> TcpError {
        self.close_reason
            .and_then(CloseReason::error)
            .unwrap_or(TcpError::Closed)
    }

    /// Reads in-order data. `Ok(0)` means end of stream (the peer's FIN);
    /// `WouldBlock` means no data yet.
    pub fn recv(&mut self, out: &mut [u8]) -> Result<usize, TcpError> {
        if !self.rx.is_empty() {
            let n = self.rx.dequeue(out);
            return Ok(n);
        }
        if self.rcv.fin_received {
            return Ok(0);
        }
        match self.state {
            State::Closed => Err(self.closed_error()),
            State::SynSent | State::SynReceived => Err(TcpError::WouldBlock),
            _ => Err(TcpError::WouldBlock),
        }
    }

    /// Queues data to send; partial when the send buffer fills.
    pub fn send(&mut self, data: &[u8]) -> Result<usize, TcpError> {
        match self.state {
            State::Established | State::CloseWait if !self.fin.queued => {}
            State::SynSent | State::SynReceived => return Err(TcpError::NotConnected),
            State::Closed => return Err(self.closed_error()),
            _ => return Err(TcpError::Closed),
        }
        if data.is_empty() {
            return Ok(0);
        }
        let n = self.tx.enqueue(data);
        if n < data.len() {
            self.want_writable = true;
        }
        if n == 0 {
            return Err(TcpError::WouldBlock);
        }
        Ok(n)
    }

    /// Closes the send side: FIN after the queued data (RFC 9293 CLOSE call).
    pub fn shutdown(&mut self, now: Instant) {
        match self.state {
            // CLOSE in SYN-SENT: delete the TCB.
            State::SynSent => self.enter_closed(CloseReason::Normal),
            // CLOSE in SYN-RECEIVED / ESTABLISHED: queue FIN, FIN-WAIT-1.
            State::SynReceived | State::Established => {
                self.fin.queued = true;
                self.state = State::FinWait1;
            }
            // CLOSE in CLOSE-WAIT: queue FIN, LAST-ACK.
            State::CloseWait => {
                self.fin.queued = true;
                self.state = State::LastAck;
            }
            // Already closing or closed: nothing to do.
            State::FinWait1
            | State::FinWait2
            | State::Closing
            | State::LastAck
            | State::TimeWait
            | State::Closed => {}
        }
        self.update_persist(now);
    }

    /// Aborts with RST (RFC 9293 ABORT call).
    pub fn abort(&mut self) {
        // No RST from SYN-SENT (the peer knows nothing of us) or TIME-WAIT.
        let send_rst = !matches!(self.state, State::Closed | State::SynSent | State::TimeWait);
        if self.state != State::Closed {
            self.enter_closed(CloseReason::Aborted);
            self.pending.rst = send_rst;
        }
    }

    /// The application released the handle: FIN, or RST when unread data
    /// would be lost (RFC 2525 §2.17). Orphans in FIN-WAIT-2 get a timeout.
    pub fn close(&mut self, now: Instant) {
        if !self.rx.is_empty() || !self.ooo.is_empty() {
            self.abort();
            return;
        }
        self.shutdown(now);
        if self.state == State::FinWait2 {
            self.timers.close = Some(now + self.params.fin_wait2_timeout);
        }
    }

    /// Arms the orphan FIN-WAIT-2 timeout when a closed handle reaches it.
    pub fn orphan_tick(&mut self, now: Instant) {
        if self.state == State::FinWait2 && self.timers.close.is_none() {
            self.timers.close = Some(now + self.params.fin_wait2_timeout);
        }
    }

    pub fn is_readable(&self) -> bool {
        !self.rx.is_empty() || self.rcv.fin_received || self.state == State::Closed
    }
    pub fn is_writable(&self) -> bool {
        matches!(self.state, State::Established | State::CloseWait)
            && !self.fin.queued
            && !self.tx.is_full()
    }
    pub fn send_queue_len(&self) -> usize {
        self.tx.len()
    }
    pub fn recv_queue_len(&self) -> usize {
        self.rx.len()
    }
}
