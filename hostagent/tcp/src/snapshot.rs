//! Connection snapshot: the versioned binary form of one TCP connection that
//! travels in CONN_STATE from the origin to the target (seed 000 §4.1.2).
//! The byte layout is specified field by field in `docs/SNAPSHOT.md`.
//!
//! smoltcp style, in two layers:
//! - [`SnapshotView`] is a view of the fixed 34-byte header. After
//!   `new_checked` (length and version) no accessor can panic.
//! - [`Snapshot`] is the parsed representation (`parse` / `emit` /
//!   `buffer_len`). The one parser, `parse_into`, reads the fixed-width
//!   fields of the variable part through a bounds-checked cursor and
//!   validates every field and cross-field invariant the state machine
//!   relies on, so a snapshot that parses can be imported without any
//!   arithmetic in `conn.rs` overflowing or indexing out of range. A bad
//!   snapshot is a [`SnapshotError`] naming the field, never a panic. The
//!   endpoint's import runs it straight into a pooled connection
//!   (`import_into`); `Snapshot::parse_bytes` into a scratch one.
//!
//! Snapshots are untrusted bytes (they arrive over the network, MAC'd but
//! produced by another host's software). Queue and application bytes are
//! borrowed, not copied: parsing allocates nothing, and `emit` writes into a
//! caller-provided buffer. `Endpoint::export` writes straight from the live
//! connection (`emit_connection`, through the same `Parts` writer as
//! `Snapshot::emit`, so both give the same bytes): each queue byte is copied
//! once on export (ring -> buffer) and once on import (buffer -> ring).
//!
//! Time: absolute instants never travel. Timers travel as the time remaining
//! at export, the timed RTT segment as its age, and timestamps as the TSval
//! the connection would have sent at export; the importer re-bases all three
//! on its own clock ([`Snapshot::restore`]), so hosts need no common epoch
//! and the peer sees TSval continue without going backwards.
//!
//! Not in the snapshot (the importing host's policy, from its `TcpConfig`):
//! RTO bounds, retry limits, delayed-ACK and TIME-WAIT durations, initial
//! window, buffer capacities. Keep-alive settings and our MSS do travel.

use std::net::{Ipv4Addr, SocketAddrV4};

use capybara_proto::time::{Duration, Instant};

use crate::buffer::{Assembler, RingBuffer, Scoreboard, MAX_OOO_RANGES, MAX_SCOREBOARD};
use crate::config::{KeepAlive, TcpConfig};
use crate::conn::{
    AckState, Congestion, ConnEvents, ConnParams, ConnStats, Connection, FinState, Negotiated,
    Pending, RecvSeq, Retries, RttEstimator, SendSeq, State, Timers, Timestamps,
};
use crate::error::CloseReason;
use crate::seq::SeqNum;

/// Format version this build writes and reads.
/// Version 2 (2026-11-22): fixed-width fields instead of version 1's
/// varints (faster to read and write, ~2.3x larger); version 1 is refused.
pub const VERSION: u8 = 2;

/// Queue bytes are copied in pieces of at most this many bytes. glibc's
/// `memcpy` switches to `rep movsb` at 2112 bytes on this project's AMD EPYC
/// hosts (`ld.so --list-diagnostics`: rep_movsb_threshold=0x840), which
/// measured ~40% slower there than its vector loop for 4 KiB copies
/// (`bench/export-import`, copy floor 276 vs 167 ns); pieces below the
/// threshold keep every copy on the vector loop.
pub const COPY_PIECE: usize = 2048;

/// Copies `src` into `dst` (same length) in `COPY_PIECE` pieces.
#[inline]
pub fn copy_queue_bytes(dst: &mut [u8], src: &[u8]) {
    for (d, s) in dst.chunks_mut(COPY_PIECE).zip(src.chunks(COPY_PIECE)) {
        d.copy_from_slice(s);
    }
}

/// Length of the fixed header.
pub const HEADER_LEN: usize = field::VAR;

/// Largest duration (µs) accepted in a snapshot: about 12.7 days. Bounds RTT
/// estimator values, timers and keep-alive settings so that no arithmetic on
/// them can overflow.
pub const MAX_MICROS: u64 = 1 << 40;
/// Largest retry / backoff / duplicate-ACK count accepted.
pub const MAX_COUNT: u32 = 1 << 16;
/// Largest per-connection statistics counter accepted.
pub const MAX_STAT: u64 = 1 << 62;

/// Most bytes of the variable part outside the two lists and the byte runs,
/// field by field as in docs/SNAPSHOT.md (every optional field present):
/// 41 for #1-#12, 4 #13, 24 #14-#16, 12 #17, 4 #18, 4 #19, 12 #20-#22,
/// 1 #23, 8 #25-#26, 8 #27, 40 #28 (five timers), 4 #29, 24 #30, 20 #31,
/// 40 #32, 4 + 4 + 1 + 4 the lengths and count of #33-#35 and #37. A test
/// pins it; `max_len` adds `LIST_ITEM` per SACK block and out-of-order range.
const MAX_FIELDS: usize = 259;
/// Bytes per SACK block (#24) or out-of-order range (#36, without its bytes).
const LIST_ITEM: usize = 8;

/// Byte ranges of the fixed header (big-endian integers).
pub mod field {
    use std::ops::Range;
    pub const VERSION: usize = 0;
    /// Low nibble: state; high nibble: close reason (0 = none).
    pub const STATE: usize = 1;
    pub const FLAGS: Range<usize> = 2..6;
    pub const LOCAL_IP: Range<usize> = 6..10;
    pub const LOCAL_PORT: Range<usize> = 10..12;
    pub const REMOTE_IP: Range<usize> = 12..16;
    pub const REMOTE_PORT: Range<usize> = 16..18;
    pub const SND_UNA: Range<usize> = 18..22;
    pub const RCV_NXT: Range<usize> = 22..26;
    pub const TSVAL: Range<usize> = 26..30;
    pub const TS_RECENT: Range<usize> = 30..34;
    /// Start of the variable part.
    pub const VAR: usize = 34;
}

/// Bits of the FLAGS field.
pub mod flag {
    pub const SACK: u32 = 1 << 0;
    pub const TIMESTAMPS: u32 = 1 << 1;
    pub const WINDOW_SCALE: u32 = 1 << 2;
    pub const FIN_QUEUED: u32 = 1 << 3;
    pub const FIN_SENT: u32 = 1 << 4;
    pub const FIN_RECEIVED: u32 = 1 << 5;
    pub const RTT_HAS_SAMPLE: u32 = 1 << 6;
    pub const IN_RECOVERY: u32 = 1 << 7;
    pub const FAST_RETRANSMIT: u32 = 1 << 8;
    pub const ACK_NOW: u32 = 1 << 9;
    pub const PENDING_RST: u32 = 1 << 10;
    pub const PENDING_PROBE: u32 = 1 << 11;
    pub const WANT_WRITABLE: u32 = 1 << 12;
    /// SSTHRESH is "infinite" (u32::MAX) and not encoded.
    pub const SSTHRESH_INF: u32 = 1 << 13;
    pub const HAS_FIN_SEQ: u32 = 1 << 14;
    pub const HAS_RTT_TIMED: u32 = 1 << 15;
    pub const HAS_LAST_OOO: u32 = 1 << 16;
    pub const HAS_RST_REPLY: u32 = 1 << 17;
    pub const HAS_KEEPALIVE: u32 = 1 << 18;
    pub const TIMER_RETRANSMIT: u32 = 1 << 19;
    pub const TIMER_PERSIST: u32 = 1 << 20;
    pub const TIMER_DELAYED_ACK: u32 = 1 << 21;
    pub const TIMER_KEEPALIVE: u32 = 1 << 22;
    pub const TIMER_CLOSE: u32 = 1 << 23;
    /// The counters group (backoff, duplicate ACKs, owed dup ACKs, retry
    /// counts) is present; absent means all zero, as on an idle connection.
    pub const HAS_COUNTERS: u32 = 1 << 24;
    /// Bits a version-2 reader rejects when set.
    pub const RESERVED: u32 = !((1 << 25) - 1);
}

/// Why a snapshot could not be parsed, emitted, exported or imported.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum SnapshotError {
    #[error("snapshot truncated in field `{0}`")]
    Truncated(&'static str),
    #[error("unsupported snapshot version {0} (this build reads version {VERSION})")]
    Version(u8),
    #[error("snapshot field `{field}` is invalid: {why}")]
    Invalid {
        field: &'static str,
        why: &'static str,
    },
    #[error("{0} bytes follow the end of the snapshot")]
    Trailing(usize),
    #[error("buffer of {available} bytes is too small for a {needed}-byte snapshot")]
    BufferTooSmall { needed: usize, available: usize },
    #[error("snapshot field `{field}` needs {needed} bytes of queue but this endpoint's buffer holds {capacity}")]
    QueueTooLarge {
        field: &'static str,
        needed: usize,
        capacity: usize,
    },
    #[error("a connection with the snapshot's 4-tuple already exists")]
    FlowExists,
    #[error("no such connection handle")]
    InvalidHandle,
}

type Result<T> = core::result::Result<T, SnapshotError>;

fn invalid(field: &'static str, why: &'static str) -> SnapshotError {
    SnapshotError::Invalid { field, why }
}

/// A view of a snapshot's fixed header. No accessor panics after
/// [`SnapshotView::new_checked`].
#[derive(Debug, Clone, Copy)]
pub struct SnapshotView<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> SnapshotView<T> {
    /// Checks that the fixed header is present and the version is known.
    pub fn new_checked(buffer: T) -> Result<Self> {
        let b = buffer.as_ref();
        if b.is_empty() {
            return Err(SnapshotError::Truncated("version"));
        }
        if b[field::VERSION] != VERSION {
            return Err(SnapshotError::Version(b[field::VERSION]));
        }
        if b.len() < HEADER_LEN {
            return Err(SnapshotError::Truncated("header"));
        }
        Ok(SnapshotView { buffer })
    }
    pub fn into_inner(self) -> T {
        self.buffer
    }
    fn u16(&self, r: std::ops::Range<usize>) -> u16 {
        let b = &self.buffer.as_ref()[r];
        u16::from_be_bytes([b[0], b[1]])
    }
    fn u32(&self, r: std::ops::Range<usize>) -> u32 {
        let b = &self.buffer.as_ref()[r];
        u32::from_be_bytes([b[0], b[1], b[2], b[3]])
    }
    pub fn version(&self) -> u8 {
        self.buffer.as_ref()[field::VERSION]
    }
    pub fn state_byte(&self) -> u8 {
        self.buffer.as_ref()[field::STATE]
    }
    pub fn flags(&self) -> u32 {
        self.u32(field::FLAGS)
    }
    /// The connection's local address (the service VIP).
    pub fn local(&self) -> SocketAddrV4 {
        SocketAddrV4::new(
            Ipv4Addr::from(self.u32(field::LOCAL_IP)),
            self.u16(field::LOCAL_PORT),
        )
    }
    /// The client.
    pub fn remote(&self) -> SocketAddrV4 {
        SocketAddrV4::new(
            Ipv4Addr::from(self.u32(field::REMOTE_IP)),
            self.u16(field::REMOTE_PORT),
        )
    }
    pub fn snd_una(&self) -> SeqNum {
        SeqNum(self.u32(field::SND_UNA))
    }
    pub fn rcv_nxt(&self) -> SeqNum {
        SeqNum(self.u32(field::RCV_NXT))
    }
    pub fn tsval(&self) -> u32 {
        self.u32(field::TSVAL)
    }
    pub fn ts_recent(&self) -> u32 {
        self.u32(field::TS_RECENT)
    }
    /// Everything after the fixed header.
    pub fn variable(&self) -> &[u8] {
        &self.buffer.as_ref()[field::VAR..]
    }
}

/// Bytes that may be split in two by a ring buffer's wrap-around.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Chunks<'a>(pub &'a [u8], pub &'a [u8]);

impl<'a> Chunks<'a> {
    pub fn len(&self) -> usize {
        self.0.len() + self.1.len()
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Timers as the time remaining at export.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TimerSnapshot {
    pub retransmit: Option<Duration>,
    pub persist: Option<Duration>,
    pub delayed_ack: Option<Duration>,
    pub keepalive: Option<Duration>,
    pub close: Option<Duration>,
}

/// Remaining µs of each timer, in wire order (flags 19..23): what `Parts`
/// writes and `parse_into` reads (integers: no `Duration` arithmetic,
/// whose `as_micros` is a 128-bit division, on the export/import path).
type TimerMicros = [Option<u64>; 5];

impl TimerSnapshot {
    fn micros(&self) -> TimerMicros {
        let us = |d: Option<Duration>| d.map(|d| d.as_micros() as u64);
        [
            us(self.retransmit),
            us(self.persist),
            us(self.delayed_ack),
            us(self.keepalive),
            us(self.close),
        ]
    }
    fn from_micros(t: &TimerMicros) -> TimerSnapshot {
        let d = |us: Option<u64>| us.map(Duration::from_micros);
        TimerSnapshot {
            retransmit: d(t[0]),
            persist: d(t[1]),
            delayed_ack: d(t[2]),
            keepalive: d(t[3]),
            close: d(t[4]),
        }
    }
}

impl Chunks<'_> {
    /// Same bytes, wherever the ring split them.
    fn same_bytes(&self, o: &Chunks<'_>) -> bool {
        self.len() == o.len() && self.0.iter().chain(self.1).eq(o.0.iter().chain(o.1))
    }
}

/// Where a snapshot's out-of-order bytes are, without copying them: still
/// in the exporting connection's receive ring, or in the snapshot bytes
/// being parsed. [`Snapshot::ooo_chunk`] reads range `i`.
#[derive(Debug, Clone, Copy)]
pub enum OooData<'a> {
    /// Range `(s, e)` of `Snapshot::ooo` lies at ring offset `base + s`.
    Ring { ring: &'a RingBuffer, base: usize },
    /// Range `i` starts at byte `at[i]` of `bytes` (checked by `parse`).
    Wire {
        bytes: &'a [u8],
        at: [u32; MAX_OOO_RANGES],
    },
}

/// The parsed representation of a connection snapshot. Sequence-space
/// structs are the connection's own; time-dependent fields are relative.
/// Queue bytes are borrowed (from the connection's rings or from the
/// snapshot bytes), never copied into it.
#[derive(Debug, Clone)]
pub struct Snapshot<'a> {
    pub state: State,
    pub close_reason: Option<CloseReason>,
    pub local: SocketAddrV4,
    pub remote: SocketAddrV4,
    pub snd: SendSeq,
    pub rcv: RecvSeq,
    pub opts: Negotiated,
    /// The TSval the connection would have sent at export.
    pub tsval: u32,
    pub ts_recent: u32,
    /// RTT estimator; its `timed` is always `None` here (see `rtt_timed`).
    pub rtt: RttEstimator,
    /// The timed segment's end sequence and its age at export.
    pub rtt_timed: Option<(SeqNum, Duration)>,
    pub cc: Congestion,
    pub sack: Scoreboard,
    pub fin: FinState,
    pub ack: AckState,
    pub timers: TimerSnapshot,
    pub pending: Pending,
    pub retries: Retries,
    pub want_writable: bool,
    pub keepalive: Option<KeepAlive>,
    pub stats: ConnStats,
    /// Send queue from SND.UNA: unacknowledged, then unsent bytes.
    pub tx: Chunks<'a>,
    /// Receive queue: in-order bytes the application has not read.
    pub rx: Chunks<'a>,
    /// Out-of-order intervals (offsets from RCV.NXT) ...
    pub ooo: Assembler,
    /// ... and where their bytes are (see `ooo_chunk`).
    pub ooo_data: OooData<'a>,
    /// Opaque application state (connection manager, seed 000 §6).
    pub app: &'a [u8],
}

/// Equal when every field and every queued byte is (wherever the bytes
/// live and however a ring split them).
impl PartialEq for Snapshot<'_> {
    fn eq(&self, o: &Self) -> bool {
        // Destructured so that a new field cannot be forgotten here.
        let Snapshot {
            state,
            close_reason,
            local,
            remote,
            snd,
            rcv,
            opts,
            tsval,
            ts_recent,
            rtt,
            rtt_timed,
            cc,
            sack,
            fin,
            ack,
            timers,
            pending,
            retries,
            want_writable,
            keepalive,
            stats,
            tx,
            rx,
            ooo,
            ooo_data: _,
            app,
        } = self;
        (
            state,
            close_reason,
            local,
            remote,
            snd,
            rcv,
            opts,
            tsval,
            ts_recent,
        ) == (
            &o.state,
            &o.close_reason,
            &o.local,
            &o.remote,
            &o.snd,
            &o.rcv,
            &o.opts,
            &o.tsval,
            &o.ts_recent,
        ) && (rtt, rtt_timed, cc, sack, fin, ack, timers, pending, retries)
            == (
                &o.rtt,
                &o.rtt_timed,
                &o.cc,
                &o.sack,
                &o.fin,
                &o.ack,
                &o.timers,
                &o.pending,
                &o.retries,
            )
            && (want_writable, keepalive, stats, ooo, app)
                == (&o.want_writable, &o.keepalive, &o.stats, &o.ooo, &o.app)
            && tx.same_bytes(&o.tx)
            && rx.same_bytes(&o.rx)
            && (0..ooo.ranges().len()).all(|i| self.ooo_chunk(i).same_bytes(&o.ooo_chunk(i)))
    }
}
impl Eq for Snapshot<'_> {}

// ------------------------------------------------------- fixed-width fields

/// Reads the variable part: fixed-width big-endian fields, each behind one
/// bounds check (no varint decoding since version 2).
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    #[inline(always)]
    fn take<const N: usize>(&mut self, f: &'static str) -> Result<[u8; N]> {
        match self.buf.get(self.pos..).and_then(|r| r.first_chunk::<N>()) {
            Some(b) => {
                self.pos += N;
                Ok(*b)
            }
            None => Err(SnapshotError::Truncated(f)),
        }
    }
    #[inline(always)]
    fn u8(&mut self, f: &'static str) -> Result<u8> {
        Ok(self.take::<1>(f)?[0])
    }
    #[cfg(test)]
    fn u16(&mut self, f: &'static str) -> Result<u16> {
        Ok(u16::from_be_bytes(self.take(f)?))
    }
    #[inline(always)]
    fn u32(&mut self, f: &'static str) -> Result<u32> {
        Ok(u32::from_be_bytes(self.take(f)?))
    }
    #[inline(always)]
    fn u64(&mut self, f: &'static str) -> Result<u64> {
        Ok(u64::from_be_bytes(self.take(f)?))
    }
    #[inline(always)]
    fn u32_max(&mut self, f: &'static str, max: u32) -> Result<u32> {
        let v = self.u32(f)?;
        if v > max {
            return Err(invalid(f, "value out of range"));
        }
        Ok(v)
    }
    #[inline(always)]
    fn u64_max(&mut self, f: &'static str, max: u64) -> Result<u64> {
        let v = self.u64(f)?;
        if v > max {
            return Err(invalid(f, "value out of range"));
        }
        Ok(v)
    }
    /// A duration (µs) present only when its flag is set.
    #[inline(always)]
    fn opt_micros(&mut self, present: bool, f: &'static str) -> Result<Option<u64>> {
        if present {
            Ok(Some(self.u64_max(f, MAX_MICROS)?))
        } else {
            Ok(None)
        }
    }
    /// A length (u32, below 2^31) and that many bytes.
    #[inline(always)]
    fn len_bytes(&mut self, f: &'static str, bytes: &'static str) -> Result<&'a [u8]> {
        let n = self.u32_max(f, i32::MAX as u32)? as usize;
        self.bytes(n, bytes)
    }
    #[inline]
    fn bytes(&mut self, n: usize, f: &'static str) -> Result<&'a [u8]> {
        if self.buf.len() - self.pos < n {
            return Err(SnapshotError::Truncated(f));
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }
}

/// Big-endian integers at constant offsets of a block read with one
/// bounds check (`Reader::take`); inlined, the offsets need no check.
#[inline(always)]
fn be16<const N: usize>(b: &[u8; N], at: usize) -> u16 {
    u16::from_be_bytes([b[at], b[at + 1]])
}
#[inline(always)]
fn be32<const N: usize>(b: &[u8; N], at: usize) -> u32 {
    u32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}
#[inline(always)]
fn be64<const N: usize>(b: &[u8; N], at: usize) -> u64 {
    (u64::from(be32(b, at)) << 32) | u64::from(be32(b, at + 4))
}

/// `v` if at most `max`, else `Invalid` naming `f`.
#[inline(always)]
fn at_most<T: PartialOrd>(v: T, max: T, f: &'static str) -> Result<T> {
    if v > max {
        return Err(invalid(f, "value out of range"));
    }
    Ok(v)
}

/// Receives the variable part in wire order (see `Parts::walk`).
trait Sink {
    fn put<const N: usize>(&mut self, b: [u8; N]);
    fn raw(&mut self, b: &[u8]);
}

/// Counts the bytes a walk would write.
struct Counter(usize);

impl Sink for Counter {
    #[inline]
    fn put<const N: usize>(&mut self, _: [u8; N]) {
        self.0 += N;
    }
    #[inline]
    fn raw(&mut self, b: &[u8]) {
        self.0 += b.len();
    }
}

/// Appends to a `Vec` (`Parts::append`, after reserving `max_len`).
impl Sink for Vec<u8> {
    #[inline]
    fn put<const N: usize>(&mut self, b: [u8; N]) {
        self.extend_from_slice(&b);
    }
    #[inline]
    fn raw(&mut self, b: &[u8]) {
        // In `COPY_PIECE`s, as `copy_queue_bytes`.
        for c in b.chunks(COPY_PIECE) {
            self.extend_from_slice(c);
        }
    }
}

/// Writer over a buffer already checked to hold `buffer_len()` bytes.
struct Writer<'a> {
    buf: &'a mut [u8],
    pos: usize,
}

impl Sink for Writer<'_> {
    #[inline(always)]
    fn put<const N: usize>(&mut self, b: [u8; N]) {
        self.buf[self.pos..self.pos + N].copy_from_slice(&b);
        self.pos += N;
    }
    #[inline]
    fn raw(&mut self, b: &[u8]) {
        copy_queue_bytes(&mut self.buf[self.pos..self.pos + b.len()], b);
        self.pos += b.len();
    }
}

/// Big-endian bytes of a sequence-number difference (wrapping, so a
/// negative difference is its two's complement).
#[inline(always)]
fn off(a: SeqNum, from: SeqNum) -> [u8; 4] {
    a.0.wrapping_sub(from.0).to_be_bytes()
}

fn state_code(s: State) -> u8 {
    match s {
        State::Closed => 0,
        State::SynSent => 1,
        State::SynReceived => 2,
        State::Established => 3,
        State::FinWait1 => 4,
        State::FinWait2 => 5,
        State::CloseWait => 6,
        State::Closing => 7,
        State::LastAck => 8,
        State::TimeWait => 9,
    }
}

fn reason_code(r: Option<CloseReason>) -> u8 {
    match r {
        None => 0,
        Some(CloseReason::Normal) => 1,
        Some(CloseReason::Reset) => 2,
        Some(CloseReason::Refused) => 3,
        Some(CloseReason::TimedOut) => 4,
        Some(CloseReason::Aborted) => 5,
    }
}

fn reason_from(c: u8) -> Option<Option<CloseReason>> {
    Some(match c {
        0 => None,
        1 => Some(CloseReason::Normal),
        2 => Some(CloseReason::Reset),
        3 => Some(CloseReason::Refused),
        4 => Some(CloseReason::TimedOut),
        5 => Some(CloseReason::Aborted),
        _ => return None,
    })
}

/// What `emit` reads, by reference: a snapshot's fields, or a live
/// connection's in place (export copies no state into an intermediate
/// `Snapshot`, only the few values re-based on the clock at export).
struct Parts<'s> {
    state: State,
    close_reason: Option<CloseReason>,
    local: SocketAddrV4,
    remote: SocketAddrV4,
    snd: &'s SendSeq,
    rcv: &'s RecvSeq,
    opts: Negotiated,
    tsval: u32,
    ts_recent: u32,
    /// Only the estimator values and backoff are read (not `timed`).
    rtt: &'s RttEstimator,
    /// The timed segment's end and age (µs).
    rtt_timed: Option<(SeqNum, u64)>,
    cc: &'s Congestion,
    sack: &'s Scoreboard,
    fin: FinState,
    ack: &'s AckState,
    timers: TimerMicros,
    pending: &'s Pending,
    retries: &'s Retries,
    want_writable: bool,
    keepalive: Option<KeepAlive>,
    stats: &'s ConnStats,
    tx: Chunks<'s>,
    rx: Chunks<'s>,
    ooo: &'s Assembler,
    ooo_data: OooData<'s>,
    app: &'s [u8],
}

/// The bytes of out-of-order range `i` of `ooo` (empty past the last range).
fn ooo_chunk<'s>(ooo: &Assembler, data: OooData<'s>, i: usize) -> Chunks<'s> {
    let Some(&(s, e)) = ooo.ranges().get(i) else {
        return Chunks::default();
    };
    let len = (e - s) as usize;
    match data {
        OooData::Ring { ring, base } => {
            let (a, b) = ring.slices(base + s as usize, len);
            Chunks(a, b)
        }
        OooData::Wire { bytes, at } => {
            let at = at[i] as usize;
            Chunks(bytes.get(at..at + len).unwrap_or(&[]), &[])
        }
    }
}

impl<'s> Parts<'s> {
    /// `conn` at `now`, as `Snapshot::capture` sees it, without copying it.
    #[inline(always)]
    fn of_connection(conn: &'s Connection, now: Instant, app: &'s [u8]) -> Parts<'s> {
        let (ta, tb) = conn.tx.slices(0, conn.tx.len());
        let (ra, rb) = conn.rx.slices(0, conn.rx.len());
        let t = &conn.timers;
        Parts {
            state: conn.state,
            close_reason: conn.close_reason,
            local: conn.local,
            remote: conn.remote,
            snd: &conn.snd,
            rcv: &conn.rcv,
            opts: conn.opts,
            tsval: conn.ts_now(now),
            ts_recent: conn.ts.recent,
            rtt: &conn.rtt,
            rtt_timed: rtt_age_us(conn, now),
            cc: &conn.cc,
            sack: &conn.sack,
            fin: conn.fin,
            ack: &conn.ack,
            timers: [
                remaining_us(t.retransmit, now),
                remaining_us(t.persist, now),
                remaining_us(t.delayed_ack, now),
                remaining_us(t.keepalive, now),
                remaining_us(t.close, now),
            ],
            pending: &conn.pending,
            retries: &conn.retries,
            want_writable: conn.want_writable,
            keepalive: conn.params.keepalive,
            stats: &conn.stats,
            tx: Chunks(ta, tb),
            rx: Chunks(ra, rb),
            ooo: &conn.ooo,
            ooo_data: OooData::Ring {
                ring: &conn.rx,
                base: conn.rx.len(),
            },
            app,
        }
    }

    fn has_counters(&self) -> bool {
        let r = &self.retries;
        (self.rtt.backoff
            | self.cc.dup_acks
            | self.ack.dup_pending
            | r.rto
            | r.persist
            | r.keepalive)
            != 0
    }

    #[inline(always)]
    fn flags(&self) -> u32 {
        let mut f = 0;
        // Branch-free: every bit is `on` times its value.
        let mut set = |bit: u32, on: bool| f |= bit * u32::from(on);
        set(flag::SACK, self.opts.sack);
        set(flag::TIMESTAMPS, self.opts.timestamps);
        set(flag::WINDOW_SCALE, self.opts.window_scale);
        set(flag::FIN_QUEUED, self.fin.queued);
        set(flag::FIN_SENT, self.fin.sent);
        set(flag::FIN_RECEIVED, self.rcv.fin_received);
        set(flag::RTT_HAS_SAMPLE, self.rtt.has_sample);
        set(flag::IN_RECOVERY, self.cc.in_recovery);
        set(flag::FAST_RETRANSMIT, self.cc.fast_retransmit);
        set(flag::ACK_NOW, self.ack.now);
        set(flag::PENDING_RST, self.pending.rst);
        set(flag::PENDING_PROBE, self.pending.probe);
        set(flag::WANT_WRITABLE, self.want_writable);
        set(flag::SSTHRESH_INF, self.cc.ssthresh == u32::MAX);
        set(flag::HAS_FIN_SEQ, self.rcv.fin_seq.is_some());
        set(flag::HAS_RTT_TIMED, self.rtt_timed.is_some());
        set(flag::HAS_LAST_OOO, self.ack.last_ooo.is_some());
        set(flag::HAS_RST_REPLY, self.pending.rst_reply.is_some());
        set(flag::HAS_KEEPALIVE, self.keepalive.is_some());
        set(flag::TIMER_RETRANSMIT, self.timers[0].is_some());
        set(flag::TIMER_PERSIST, self.timers[1].is_some());
        set(flag::TIMER_DELAYED_ACK, self.timers[2].is_some());
        set(flag::TIMER_KEEPALIVE, self.timers[3].is_some());
        set(flag::TIMER_CLOSE, self.timers[4].is_some());
        set(flag::HAS_COUNTERS, self.has_counters());
        f
    }

    /// Calls `put` with every variable-part integer in wire order, and
    /// `raw` with every byte run. `emit` and `buffer_len` share it so the
    /// two can never disagree. `flags`: `self.flags()` (computed once per
    /// export, for the header and here).
    #[inline(always)]
    fn walk<S: Sink>(&self, flags: u32, out: &mut S) {
        let (snd, rcv) = (&self.snd, &self.rcv);
        let una = snd.una;
        // Runs of always-present fields go out as one block each (one
        // bounds check per block, as `parse_into` reads them).
        let mut a = [0u8; 41]; // #1-#12
        a[0..4].copy_from_slice(&off(una, snd.iss));
        a[4..8].copy_from_slice(&off(snd.nxt, una));
        a[8..12].copy_from_slice(&off(snd.max, una));
        a[12..16].copy_from_slice(&snd.wnd.to_be_bytes());
        a[16..20].copy_from_slice(&snd.max_wnd.to_be_bytes());
        a[20..24].copy_from_slice(&off(snd.wl1, rcv.nxt));
        a[24..28].copy_from_slice(&off(snd.wl2, una));
        a[28] = (snd.wscale << 4) | (rcv.wscale & 0x0f);
        a[29..31].copy_from_slice(&snd.smss.to_be_bytes());
        a[31..33].copy_from_slice(&rcv.mss.to_be_bytes());
        a[33..37].copy_from_slice(&off(rcv.nxt, rcv.irs));
        a[37..41].copy_from_slice(&off(rcv.adv_right, rcv.nxt));
        out.put(a);
        if let Some(f) = rcv.fin_seq {
            out.put(off(f, rcv.nxt));
        }
        let mut b = [0u8; 24]; // #14-#16
        b[0..8].copy_from_slice(&self.rtt.srtt_us.to_be_bytes());
        b[8..16].copy_from_slice(&self.rtt.rttvar_us.to_be_bytes());
        b[16..24].copy_from_slice(&self.rtt.rto_us.to_be_bytes());
        out.put(b);
        if let Some((end, age)) = self.rtt_timed {
            let mut t = [0u8; 12];
            t[0..4].copy_from_slice(&off(end, una));
            t[4..12].copy_from_slice(&age.to_be_bytes());
            out.put(t);
        }
        let cc = &self.cc;
        out.put(cc.cwnd.to_be_bytes());
        if cc.ssthresh != u32::MAX {
            out.put(cc.ssthresh.to_be_bytes());
        }
        let blocks = self.sack.blocks();
        let mut d = [0u8; 13]; // #20-#23
        d[0..4].copy_from_slice(&off(cc.recover, una));
        d[4..8].copy_from_slice(&cc.ca_acked.to_be_bytes());
        d[8..12].copy_from_slice(&off(cc.rexmit_next, una));
        d[12] = blocks.len() as u8;
        out.put(d);
        for &(s, e) in blocks {
            let mut k = [0u8; 8];
            k[0..4].copy_from_slice(&off(s, una));
            k[4..8].copy_from_slice(&off(e, s));
            out.put(k);
        }
        let mut e = [0u8; 8]; // #25-#26
        e[0..4].copy_from_slice(&self.ack.unacked_bytes.to_be_bytes());
        e[4..8].copy_from_slice(&off(self.ack.last_sent, rcv.nxt));
        out.put(e);
        if let Some((l, r)) = self.ack.last_ooo {
            let mut o = [0u8; 8];
            o[0..4].copy_from_slice(&off(l, rcv.nxt));
            o[4..8].copy_from_slice(&off(r, l));
            out.put(o);
        }
        for us in self.timers.into_iter().flatten() {
            out.put(us.to_be_bytes());
        }
        if let Some(seq) = self.pending.rst_reply {
            out.put(seq.0.to_be_bytes());
        }
        if flags & flag::HAS_COUNTERS != 0 {
            let r = &self.retries;
            let mut k = [0u8; 24];
            for (i, v) in [
                self.rtt.backoff,
                cc.dup_acks,
                self.ack.dup_pending,
                r.rto,
                r.persist,
                r.keepalive,
            ]
            .into_iter()
            .enumerate()
            {
                k[4 * i..4 * i + 4].copy_from_slice(&v.to_be_bytes());
            }
            out.put(k);
        }
        if let Some(ka) = self.keepalive {
            let mut k = [0u8; 20];
            k[0..8].copy_from_slice(&(ka.idle.as_micros() as u64).to_be_bytes());
            k[8..16].copy_from_slice(&(ka.interval.as_micros() as u64).to_be_bytes());
            k[16..20].copy_from_slice(&ka.probes.to_be_bytes());
            out.put(k);
        }
        let st = &self.stats;
        let mut g = [0u8; 44]; // #32 and the send queue's length
        for (i, v) in [
            st.segments_in,
            st.segments_out,
            st.retransmits,
            st.bytes_acked,
            st.bytes_received,
        ]
        .into_iter()
        .enumerate()
        {
            g[8 * i..8 * i + 8].copy_from_slice(&v.to_be_bytes());
        }
        g[40..44].copy_from_slice(&(self.tx.len() as u32).to_be_bytes());
        out.put(g);
        out.raw(self.tx.0);
        out.raw(self.tx.1);
        out.put((self.rx.len() as u32).to_be_bytes());
        out.raw(self.rx.0);
        out.raw(self.rx.1);
        let ranges = self.ooo.ranges();
        out.put([ranges.len() as u8]);
        for (i, &(s, e)) in ranges.iter().enumerate() {
            out.put(s.to_be_bytes());
            out.put((e - s).to_be_bytes());
            let d = self.ooo_chunk(i);
            out.raw(d.0);
            out.raw(d.1);
        }
        out.put((self.app.len() as u32).to_be_bytes());
        out.raw(self.app);
    }

    /// Bytes `emit` writes.
    fn buffer_len(&self) -> usize {
        let mut c = Counter(HEADER_LEN);
        self.walk(self.flags(), &mut c);
        c.0
    }

    fn ooo_chunk(&self, i: usize) -> Chunks<'s> {
        ooo_chunk(self.ooo, self.ooo_data, i)
    }

    /// Queue, out-of-order and application bytes (the raw runs of `walk`).
    fn raw_len(&self) -> usize {
        let ooo: usize = self
            .ooo
            .ranges()
            .iter()
            .map(|&(s, e)| (e - s) as usize)
            .sum();
        self.tx.len() + self.rx.len() + ooo + self.app.len()
    }

    /// An upper bound of `buffer_len` that costs no walk: every optional
    /// field present, the lists at their actual length.
    fn max_len(&self) -> usize {
        let lists = self.sack.blocks().len() + self.ooo.ranges().len();
        HEADER_LEN + MAX_FIELDS + lists * LIST_ITEM + self.raw_len()
    }

    /// Writes the snapshot into `buf`; returns the bytes written. Only the
    /// first (returned) bytes of `buf` are written. Inlined, so that the
    /// export reads the connection's fields in place instead of building
    /// `Parts` in memory first.
    #[inline(always)]
    fn emit(&self, buf: &mut [u8]) -> Result<usize> {
        // A buffer of `max_len` bytes needs no exact sizing walk first.
        if buf.len() < self.max_len() {
            let needed = self.buffer_len();
            if buf.len() < needed {
                return Err(SnapshotError::BufferTooSmall {
                    needed,
                    available: buf.len(),
                });
            }
        }
        Ok(self.write(buf))
    }

    /// `emit` into a buffer known to hold `buffer_len()` bytes.
    #[inline(always)]
    fn write(&self, buf: &mut [u8]) -> usize {
        let flags = self.flags();
        self.header(flags, &mut buf[..HEADER_LEN]);
        let mut w = Writer {
            buf,
            pos: HEADER_LEN,
        };
        self.walk(flags, &mut w);
        w.pos
    }

    /// Appends the snapshot to `out` (reserving the cheap `max_len` bound
    /// first, so it grows at most once); returns the bytes appended. No
    /// sizing walk and no zero-filling of the part written.
    fn append(&self, out: &mut Vec<u8>) -> usize {
        let start = out.len();
        out.reserve(self.max_len());
        let mut h = [0u8; HEADER_LEN];
        let flags = self.flags();
        self.header(flags, &mut h);
        out.extend_from_slice(&h);
        self.walk(flags, out);
        out.len() - start
    }

    /// Writes the fixed header into `h` (`HEADER_LEN` bytes).
    #[inline(always)]
    fn header(&self, flags: u32, h: &mut [u8]) {
        h[field::VERSION] = VERSION;
        h[field::STATE] = state_code(self.state) | (reason_code(self.close_reason) << 4);
        h[field::FLAGS].copy_from_slice(&flags.to_be_bytes());
        h[field::LOCAL_IP].copy_from_slice(&self.local.ip().octets());
        h[field::LOCAL_PORT].copy_from_slice(&self.local.port().to_be_bytes());
        h[field::REMOTE_IP].copy_from_slice(&self.remote.ip().octets());
        h[field::REMOTE_PORT].copy_from_slice(&self.remote.port().to_be_bytes());
        h[field::SND_UNA].copy_from_slice(&self.snd.una.0.to_be_bytes());
        h[field::RCV_NXT].copy_from_slice(&self.rcv.nxt.0.to_be_bytes());
        h[field::TSVAL].copy_from_slice(&self.tsval.to_be_bytes());
        h[field::TS_RECENT].copy_from_slice(&self.ts_recent.to_be_bytes());
    }
}

/// The timed RTT segment's end and age at `now`.
fn rtt_age(conn: &Connection, now: Instant) -> Option<(SeqNum, Duration)> {
    rtt_age_us(conn, now).map(|(end, us)| (end, Duration::from_micros(us)))
}

/// `rtt_age` in µs.
#[inline(always)]
fn rtt_age_us(conn: &Connection, now: Instant) -> Option<(SeqNum, u64)> {
    conn.rtt.timed.map(|(end, sent)| {
        (
            end,
            now.as_micros()
                .saturating_sub(sent.as_micros())
                .min(MAX_MICROS),
        )
    })
}

/// Export: writes `conn`'s snapshot at `now` straight from the connection
/// into `buf` (queue bytes copied once, from the rings into `buf`; no
/// `Snapshot` in between). Same bytes as `Snapshot::capture(..).emit(..)`.
pub(crate) fn emit_connection(
    conn: &Connection,
    now: Instant,
    app: &[u8],
    buf: &mut [u8],
) -> Result<usize> {
    Parts::of_connection(conn, now, app).emit(buf)
}

/// Exact length `emit_connection` writes.
pub(crate) fn connection_len(conn: &Connection, now: Instant, app: &[u8]) -> usize {
    Parts::of_connection(conn, now, app).buffer_len()
}

/// An upper bound of `connection_len` without its sizing walk (every
/// optional field counted present).
pub(crate) fn connection_max_len(conn: &Connection, now: Instant, app: &[u8]) -> usize {
    Parts::of_connection(conn, now, app).max_len()
}

/// `emit_connection` appending to `out`; returns the bytes appended.
pub(crate) fn append_connection(
    conn: &Connection,
    now: Instant,
    app: &[u8],
    out: &mut Vec<u8>,
) -> usize {
    Parts::of_connection(conn, now, app).append(out)
}

/// Remaining time of a timer at `now` (zero when already due).
fn remaining(t: Option<Instant>, now: Instant) -> Option<Duration> {
    remaining_us(t, now).map(Duration::from_micros)
}

/// `remaining` in µs.
#[inline(always)]
fn remaining_us(t: Option<Instant>, now: Instant) -> Option<u64> {
    t.map(|t| {
        t.as_micros()
            .saturating_sub(now.as_micros())
            .min(MAX_MICROS)
    })
}

impl<'a> Snapshot<'a> {
    /// Captures `conn` at `now` (borrowing its queues) with `app` as the
    /// application state.
    pub fn capture(conn: &'a Connection, now: Instant, app: &'a [u8]) -> Snapshot<'a> {
        let ooo_data = OooData::Ring {
            ring: &conn.rx,
            base: conn.rx.len(),
        };
        let (ta, tb) = conn.tx.slices(0, conn.tx.len());
        let (ra, rb) = conn.rx.slices(0, conn.rx.len());
        let mut rtt = conn.rtt;
        rtt.timed = None;
        let t = &conn.timers;
        Snapshot {
            state: conn.state,
            close_reason: conn.close_reason,
            local: conn.local,
            remote: conn.remote,
            snd: conn.snd,
            rcv: conn.rcv,
            opts: conn.opts,
            tsval: conn.ts_now(now),
            ts_recent: conn.ts.recent,
            rtt,
            rtt_timed: rtt_age(conn, now),
            cc: conn.cc,
            sack: conn.sack,
            fin: conn.fin,
            ack: conn.ack,
            timers: TimerSnapshot {
                retransmit: remaining(t.retransmit, now),
                persist: remaining(t.persist, now),
                delayed_ack: remaining(t.delayed_ack, now),
                keepalive: remaining(t.keepalive, now),
                close: remaining(t.close, now),
            },
            pending: conn.pending,
            retries: conn.retries,
            want_writable: conn.want_writable,
            keepalive: conn.params.keepalive,
            stats: conn.stats,
            tx: Chunks(ta, tb),
            rx: Chunks(ra, rb),
            ooo: conn.ooo,
            ooo_data,
            app,
        }
    }

    /// The bytes of out-of-order range `i` (empty past the last range).
    pub fn ooo_chunk(&self, i: usize) -> Chunks<'a> {
        ooo_chunk(&self.ooo, self.ooo_data, i)
    }

    /// What `emit` reads, by reference.
    fn parts(&self) -> Parts<'_> {
        Parts {
            state: self.state,
            close_reason: self.close_reason,
            local: self.local,
            remote: self.remote,
            snd: &self.snd,
            rcv: &self.rcv,
            opts: self.opts,
            tsval: self.tsval,
            ts_recent: self.ts_recent,
            rtt: &self.rtt,
            rtt_timed: self.rtt_timed.map(|(e, d)| (e, d.as_micros() as u64)),
            cc: &self.cc,
            sack: &self.sack,
            fin: self.fin,
            ack: &self.ack,
            timers: self.timers.micros(),
            pending: &self.pending,
            retries: &self.retries,
            want_writable: self.want_writable,
            keepalive: self.keepalive,
            stats: &self.stats,
            tx: self.tx,
            rx: self.rx,
            ooo: &self.ooo,
            ooo_data: self.ooo_data,
            app: self.app,
        }
    }

    /// Bytes `emit` writes.
    pub fn buffer_len(&self) -> usize {
        self.parts().buffer_len()
    }

    /// An upper bound of `buffer_len` that costs no walk: every optional
    /// field present, the lists at their actual length.
    pub fn max_len(&self) -> usize {
        self.parts().max_len()
    }

    /// Writes the snapshot into `buf`; returns the bytes written. Only the
    /// first (returned) bytes of `buf` are written.
    pub fn emit(&self, buf: &mut [u8]) -> Result<usize> {
        self.parts().emit(buf)
    }

    /// Parses and validates a snapshot. Queue and application bytes borrow
    /// from `view`'s buffer.
    pub fn parse<T: AsRef<[u8]> + ?Sized>(view: &SnapshotView<&'a T>) -> Result<Snapshot<'a>> {
        Self::parse_bytes(view.buffer.as_ref())
    }

    /// `SnapshotView::new_checked` + `parse` in one call. The same parser as
    /// `Endpoint::import` (`parse_into`), here into a scratch connection
    /// without queue buffers whose fields are then copied out.
    pub fn parse_bytes(bytes: &'a [u8]) -> Result<Snapshot<'a>> {
        let cfg = TcpConfig {
            tx_buffer: 0,
            rx_buffer: 0,
            ..TcpConfig::default()
        };
        let any = SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 0);
        let mut c = Connection::connect(&cfg, any, any, SeqNum(0), 0);
        let w = parse_into(bytes, &mut c)?;
        Ok(Snapshot {
            state: c.state,
            close_reason: c.close_reason,
            local: c.local,
            remote: c.remote,
            snd: c.snd,
            rcv: c.rcv,
            opts: c.opts,
            tsval: w.tsval,
            ts_recent: w.ts_recent,
            rtt: c.rtt,
            rtt_timed: w.rtt_timed.map(|(e, us)| (e, Duration::from_micros(us))),
            cc: c.cc,
            sack: c.sack,
            fin: c.fin,
            ack: c.ack,
            timers: TimerSnapshot::from_micros(&w.timers),
            pending: c.pending,
            retries: c.retries,
            want_writable: c.want_writable,
            keepalive: w.keepalive,
            stats: c.stats,
            tx: Chunks(w.tx, &[]),
            rx: Chunks(w.rx, &[]),
            ooo: c.ooo,
            ooo_data: OooData::Wire {
                bytes,
                at: w.ooo_at,
            },
            app: w.app,
        })
    }

    /// Checks that this snapshot fits buffers of the given capacities.
    pub fn check_capacity(&self, tx_capacity: usize, rx_capacity: usize) -> Result<()> {
        if self.tx.len() > tx_capacity {
            return Err(SnapshotError::QueueTooLarge {
                field: "tx.len",
                needed: self.tx.len(),
                capacity: tx_capacity,
            });
        }
        let ooo_end = self.ooo.ranges().last().map_or(0, |r| r.1 as usize);
        let needed = self.rx.len() + ooo_end;
        if needed > rx_capacity {
            return Err(SnapshotError::QueueTooLarge {
                field: "ooo.range",
                needed,
                capacity: rx_capacity,
            });
        }
        Ok(())
    }

    /// Rebuilds the connection on this host at `now`: parameters from `cfg`
    /// (plus the snapshot's keep-alive and MSS), queues copied into `tx` and
    /// `rx` (emptied first; call `check_capacity` before), timers re-based on
    /// `now`, and the timestamp offset chosen so that the first TSval sent
    /// here equals the exported one.
    pub fn restore(
        &self,
        now: Instant,
        cfg: &TcpConfig,
        mut tx: RingBuffer,
        mut rx: RingBuffer,
    ) -> Connection {
        self.fill_queues(&mut tx, &mut rx);
        let r = self.rebased(now, cfg);
        Connection {
            state: self.state,
            local: self.local,
            remote: self.remote,
            params: r.params,
            snd: self.snd,
            rcv: self.rcv,
            opts: self.opts,
            ts: r.ts,
            rtt: r.rtt,
            cc: self.cc,
            sack: self.sack,
            // Soft loss-recovery hints do not travel (conn.rs `LossHints`).
            loss: Default::default(),
            tx,
            rx,
            ooo: self.ooo,
            fin: self.fin,
            ack: self.ack,
            timers: r.timers,
            pending: self.pending,
            retries: self.retries,
            close_reason: self.close_reason,
            want_writable: self.want_writable,
            events: ConnEvents::default(),
            stats: self.stats,
        }
    }

    /// `restore` over an existing connection, in place: every field is
    /// overwritten and its queue buffers are reused (their capacities
    /// stay; call `check_capacity` with them before). Same result as
    /// `restore` with those buffers, without building the ~800-byte
    /// connection elsewhere and moving it (the endpoint's import path).
    pub fn restore_into(&self, now: Instant, cfg: &TcpConfig, conn: &mut Connection) {
        // Destructured so that a new field cannot be forgotten here.
        let Connection {
            state,
            local,
            remote,
            params,
            snd,
            rcv,
            opts,
            ts,
            rtt,
            cc,
            sack,
            loss,
            tx,
            rx,
            ooo,
            fin,
            ack,
            timers,
            pending,
            retries,
            close_reason,
            want_writable,
            events,
            stats,
        } = conn;
        self.fill_queues(tx, rx);
        let r = self.rebased(now, cfg);
        *state = self.state;
        *local = self.local;
        *remote = self.remote;
        *params = r.params;
        *snd = self.snd;
        *rcv = self.rcv;
        *opts = self.opts;
        *ts = r.ts;
        *rtt = r.rtt;
        *cc = self.cc;
        *sack = self.sack;
        *loss = Default::default();
        *ooo = self.ooo;
        *fin = self.fin;
        *ack = self.ack;
        *timers = r.timers;
        *pending = self.pending;
        *retries = self.retries;
        *close_reason = self.close_reason;
        *want_writable = self.want_writable;
        *events = ConnEvents::default();
        *stats = self.stats;
    }

    /// Empties `tx` and `rx` and copies the queues (and out-of-order bytes)
    /// into them, straight from the snapshot bytes, in `COPY_PIECE`s.
    #[inline(always)]
    fn fill_queues(&self, tx: &mut RingBuffer, rx: &mut RingBuffer) {
        tx.clear();
        for c in self
            .tx
            .0
            .chunks(COPY_PIECE)
            .chain(self.tx.1.chunks(COPY_PIECE))
        {
            tx.enqueue(c);
        }
        rx.clear();
        for c in self
            .rx
            .0
            .chunks(COPY_PIECE)
            .chain(self.rx.1.chunks(COPY_PIECE))
        {
            rx.enqueue(c);
        }
        for (i, &(s, _)) in self.ooo.ranges().iter().enumerate() {
            let d = self.ooo_chunk(i);
            let n = rx.write_unallocated(s as usize, d.0);
            rx.write_unallocated(s as usize + n, d.1);
        }
    }

    /// The fields re-based on this host: parameters, timestamp clock, the
    /// timed RTT segment and the timers.
    #[inline(always)]
    fn rebased(&self, now: Instant, cfg: &TcpConfig) -> Rebased {
        rebase(
            now,
            &ConnParams::from_config(cfg),
            self.keepalive,
            self.rcv.mss,
            self.rtt,
            self.rtt_timed.map(|(e, d)| (e, d.as_micros() as u64)),
            self.tsval,
            self.ts_recent,
            &self.timers.micros(),
        )
    }
}

/// What `parse_into` leaves outside the connection: the values the importer
/// re-bases on its clock and config, and where the bytes lie in the snapshot.
struct Wire<'a> {
    tsval: u32,
    ts_recent: u32,
    /// The timed segment's end and age (µs).
    rtt_timed: Option<(SeqNum, u64)>,
    timers: TimerMicros,
    keepalive: Option<KeepAlive>,
    tx: &'a [u8],
    rx: &'a [u8],
    /// Range `i` of the connection's `ooo` starts at byte `ooo_at[i]`.
    ooo_at: [u32; MAX_OOO_RANGES],
    app: &'a [u8],
}

/// Parses and validates `bytes` (every field and cross-field rule of
/// docs/SNAPSHOT.md), writing the connection's fields straight into `c`:
/// state, close reason, addresses, `snd`, `rcv`, `opts`, `rtt` (`timed`
/// cleared), `cc`, `sack`, `ooo`, `fin`, `ack`, `pending`, `retries`,
/// `want_writable` and `stats`. The rest (queues, parameters, timestamps,
/// timers, loss hints, events) is for the caller, from the returned `Wire`.
/// On error `c` holds a mix of old and new fields: callers parse into a
/// scratch or pooled connection, never into a live one.
#[inline(always)]
fn parse_into<'a>(bytes: &'a [u8], c: &mut Connection) -> Result<Wire<'a>> {
    SnapshotView::new_checked(bytes)?;
    if bytes.len() > u32::MAX as usize {
        return Err(invalid("snapshot", "longer than 4 GiB"));
    }
    // The fixed header as one block (`new_checked` checked its length).
    let h: &[u8; HEADER_LEN] = bytes
        .first_chunk()
        .ok_or(SnapshotError::Truncated("header"))?;
    let sb = h[field::STATE];
    let state = match sb & 0x0f {
        0 => State::Closed,
        1 => State::SynSent,
        2 => State::SynReceived,
        3 => State::Established,
        4 => State::FinWait1,
        5 => State::FinWait2,
        6 => State::CloseWait,
        7 => State::Closing,
        8 => State::LastAck,
        9 => State::TimeWait,
        _ => return Err(invalid("state", "unknown state")),
    };
    let close_reason =
        reason_from(sb >> 4).ok_or(invalid("close_reason", "unknown close reason"))?;
    if (state == State::Closed) != close_reason.is_some() {
        return Err(invalid(
            "close_reason",
            "present exactly when the state is CLOSED",
        ));
    }
    let f = be32(h, field::FLAGS.start);
    if f & flag::RESERVED != 0 {
        return Err(invalid("flags", "reserved bit set"));
    }
    let has = |bit: u32| f & bit != 0;
    let local = SocketAddrV4::new(
        Ipv4Addr::from(be32(h, field::LOCAL_IP.start)),
        be16(h, field::LOCAL_PORT.start),
    );
    let remote = SocketAddrV4::new(
        Ipv4Addr::from(be32(h, field::REMOTE_IP.start)),
        be16(h, field::REMOTE_PORT.start),
    );
    if local.port() == 0 || remote.port() == 0 {
        return Err(invalid("local_port/remote_port", "port 0"));
    }
    let una = SeqNum(be32(h, field::SND_UNA.start));
    let rcv_nxt = SeqNum(be32(h, field::RCV_NXT.start));

    let mut r = Reader {
        buf: bytes,
        pos: HEADER_LEN,
    };
    // #1-#12: always present, read as one block (one bounds check).
    let a: [u8; 41] = r.take("snd.una-iss..rcv.adv_right-nxt")?;
    let iss = una.sub(be32(&a, 0));
    let nxt_off = be32(&a, 4);
    let max_off = be32(&a, 8);
    if nxt_off > max_off || max_off > i32::MAX as u32 {
        return Err(invalid(
            "snd.nxt-una",
            "SND.NXT must lie in [SND.UNA, SND.MAX]",
        ));
    }
    let wnd = be32(&a, 12);
    let max_wnd = be32(&a, 16);
    if max_wnd < wnd {
        return Err(invalid("snd.max_wnd", "below snd.wnd"));
    }
    let wl1 = rcv_nxt.add(be32(&a, 20));
    let wl2 = una.add(be32(&a, 24));
    let ws = a[28];
    let (snd_ws, rcv_ws) = (ws >> 4, ws & 0x0f);
    if snd_ws > 14 || rcv_ws > 14 {
        return Err(invalid("wscale", "window scale above 14 (RFC 7323)"));
    }
    let smss = be16(&a, 29);
    if smss == 0 {
        return Err(invalid("snd.smss", "zero"));
    }
    let mss = be16(&a, 31);
    if mss < 64 {
        return Err(invalid("rcv.mss", "below 64"));
    }
    let irs = rcv_nxt.sub(be32(&a, 33));
    let adv_right = rcv_nxt.add(be32(&a, 37));
    let fin_seq = if has(flag::HAS_FIN_SEQ) {
        Some(rcv_nxt.add(r.u32("rcv.fin_seq")?))
    } else {
        None
    };
    let fin_received = has(flag::FIN_RECEIVED);
    if fin_received && fin_seq.map(|s| s.add(1)) != Some(rcv_nxt) {
        return Err(invalid(
            "rcv.fin_seq",
            "a received FIN must sit just below RCV.NXT",
        ));
    }
    c.snd = SendSeq {
        iss,
        una,
        nxt: una.add(nxt_off),
        max: una.add(max_off),
        wnd,
        wl1,
        wl2,
        max_wnd,
        wscale: snd_ws,
        smss,
    };
    c.rcv = RecvSeq {
        irs,
        nxt: rcv_nxt,
        wscale: rcv_ws,
        adv_right,
        fin_seq,
        fin_received,
        mss,
    };

    // #14-#16, then #18 (cwnd) right after unless #17 is present.
    let b: [u8; 24] = r.take("rtt.srtt_us..rtt.rto_us")?;
    c.rtt = RttEstimator {
        srtt_us: at_most(be64(&b, 0), MAX_MICROS, "rtt.srtt_us")?,
        rttvar_us: at_most(be64(&b, 8), MAX_MICROS, "rtt.rttvar_us")?,
        rto_us: at_most(be64(&b, 16), MAX_MICROS, "rtt.rto_us")?,
        backoff: 0,
        has_sample: has(flag::RTT_HAS_SAMPLE),
        timed: None,
    };
    let rtt_timed = if has(flag::HAS_RTT_TIMED) {
        let t: [u8; 12] = r.take("rtt.timed")?;
        let end = una.add(be32(&t, 0));
        Some((end, at_most(be64(&t, 4), MAX_MICROS, "rtt.timed.age")?))
    } else {
        None
    };

    let cwnd = r.u32("cc.cwnd")?;
    if cwnd == 0 && state.is_synchronized() {
        return Err(invalid("cc.cwnd", "zero in a synchronized state"));
    }
    let ssthresh = if has(flag::SSTHRESH_INF) {
        u32::MAX
    } else {
        r.u32("cc.ssthresh")?
    };
    // #20-#23 as one block.
    let d: [u8; 13] = r.take("cc.recover..sack.count")?;
    c.cc = Congestion {
        cwnd,
        ssthresh,
        dup_acks: 0,
        recover: una.add(be32(&d, 0)),
        in_recovery: has(flag::IN_RECOVERY),
        ca_acked: be32(&d, 4),
        fast_retransmit: has(flag::FAST_RETRANSMIT),
        rexmit_next: una.add(be32(&d, 8)),
    };

    let n = d[12] as usize;
    if n > MAX_SCOREBOARD {
        return Err(invalid("sack.count", "value out of range"));
    }
    c.sack.clear();
    let mut prev = 0u32; // end offset of the previous block from SND.UNA
    for i in 0..n {
        let blk: [u8; 8] = r.take("sack.block")?;
        let (s, len) = (be32(&blk, 0), be32(&blk, 4));
        let e = s
            .checked_add(len)
            .ok_or(invalid("sack.block.len", "overflow"))?;
        // Offsets below 2^31 (`max_off`): sequence order is offset order,
        // so a block that passes here is appended in place.
        if len == 0
            || (i > 0 && s <= prev)
            || e > max_off
            || !c.sack.push_above(una.add(s), una.add(e))
        {
            return Err(invalid(
                "sack.block",
                "blocks must be non-empty, disjoint and within [SND.UNA, SND.MAX]",
            ));
        }
        prev = e;
    }

    let e: [u8; 8] = r.take("ack.unacked_bytes..ack.last_sent")?;
    let unacked_bytes = be32(&e, 0);
    let last_sent = rcv_nxt.add(be32(&e, 4));
    let last_ooo = if has(flag::HAS_LAST_OOO) {
        let o: [u8; 8] = r.take("ack.last_ooo")?;
        let l = rcv_nxt.add(be32(&o, 0));
        let len = be32(&o, 4);
        if len == 0 || len > i32::MAX as u32 {
            return Err(invalid("ack.last_ooo.len", "out of range"));
        }
        Some((l, l.add(len)))
    } else {
        None
    };
    c.ack = AckState {
        now: has(flag::ACK_NOW),
        unacked_bytes,
        last_sent,
        last_ooo,
        dup_pending: 0,
    };

    let timers = [
        r.opt_micros(has(flag::TIMER_RETRANSMIT), "timers.retransmit")?,
        r.opt_micros(has(flag::TIMER_PERSIST), "timers.persist")?,
        r.opt_micros(has(flag::TIMER_DELAYED_ACK), "timers.delayed_ack")?,
        r.opt_micros(has(flag::TIMER_KEEPALIVE), "timers.keepalive")?,
        r.opt_micros(has(flag::TIMER_CLOSE), "timers.close")?,
    ];
    let rst_reply = if has(flag::HAS_RST_REPLY) {
        Some(SeqNum(r.u32("pending.rst_reply")?))
    } else {
        None
    };
    c.pending = Pending {
        rst: has(flag::PENDING_RST),
        rst_reply,
        probe: has(flag::PENDING_PROBE),
    };
    c.retries = Retries::default();
    if has(flag::HAS_COUNTERS) {
        let k: [u8; 24] = r.take("counters")?;
        c.rtt.backoff = at_most(be32(&k, 0), MAX_COUNT, "rtt.backoff")?;
        c.cc.dup_acks = at_most(be32(&k, 4), MAX_COUNT, "cc.dup_acks")?;
        c.ack.dup_pending = at_most(be32(&k, 8), 16, "ack.dup_pending")?;
        let rt = &mut c.retries;
        rt.rto = at_most(be32(&k, 12), MAX_COUNT, "retries.rto")?;
        rt.persist = at_most(be32(&k, 16), MAX_COUNT, "retries.persist")?;
        rt.keepalive = at_most(be32(&k, 20), MAX_COUNT, "retries.keepalive")?;
        if (c.rtt.backoff | c.cc.dup_acks | c.ack.dup_pending | rt.rto | rt.persist | rt.keepalive)
            == 0
        {
            return Err(invalid(
                "counters",
                "group present but all zero (non-canonical)",
            ));
        }
    }
    let keepalive = if has(flag::HAS_KEEPALIVE) {
        let k: [u8; 20] = r.take("keepalive")?;
        let us = |at, f| at_most(be64(&k, at), MAX_MICROS, f).map(Duration::from_micros);
        Some(KeepAlive {
            idle: us(0, "keepalive.idle")?,
            interval: us(8, "keepalive.interval")?,
            probes: at_most(be32(&k, 16), MAX_COUNT, "keepalive.probes")?,
        })
    } else {
        None
    };
    // #32 and the send queue's length (#33) as one block.
    let g: [u8; 44] = r.take("stats..tx.len")?;
    c.stats = ConnStats {
        segments_in: at_most(be64(&g, 0), MAX_STAT, "stats.segments_in")?,
        segments_out: at_most(be64(&g, 8), MAX_STAT, "stats.segments_out")?,
        retransmits: at_most(be64(&g, 16), MAX_STAT, "stats.retransmits")?,
        bytes_acked: at_most(be64(&g, 24), MAX_STAT, "stats.bytes_acked")?,
        bytes_received: at_most(be64(&g, 32), MAX_STAT, "stats.bytes_received")?,
    };

    let tx_n = at_most(be32(&g, 40), i32::MAX as u32, "tx.len")?;
    let tx = r.bytes(tx_n as usize, "tx.bytes")?;
    let tx_len = tx.len();
    let rx = r.len_bytes("rx.len", "rx.bytes")?;
    let rx_len = rx.len();
    let n = r.u8("ooo.count")? as usize;
    if n > MAX_OOO_RANGES {
        return Err(invalid("ooo.count", "value out of range"));
    }
    c.ooo.clear();
    let mut ooo_at = [0u32; MAX_OOO_RANGES];
    let mut prev = 0u32;
    for slot in ooo_at.iter_mut().take(n) {
        let s = r.u32_max("ooo.range.start", i32::MAX as u32)?;
        let len = r.u32("ooo.range.len")?;
        let e = s
            .checked_add(len)
            .filter(|&e| e <= i32::MAX as u32)
            .ok_or(invalid("ooo.range.len", "overflow"))?;
        if s <= prev || len == 0 {
            return Err(invalid(
                "ooo.range",
                "ranges must be non-empty, start past RCV.NXT and not touch",
            ));
        }
        // Fits: snapshots longer than u32::MAX were refused above.
        *slot = r.pos as u32;
        r.bytes(len as usize, "ooo.range.bytes")?;
        // Cannot fail: at most MAX_OOO_RANGES sorted ranges that do not touch.
        if !c.ooo.push_above(s, e) {
            return Err(invalid("ooo.count", "too many ranges"));
        }
        prev = e;
    }
    let app = r.len_bytes("app.len", "app.bytes")?;
    if r.pos != bytes.len() {
        return Err(SnapshotError::Trailing(bytes.len() - r.pos));
    }

    // Cross-field invariants the state machine relies on.
    let fin = FinState {
        queued: has(flag::FIN_QUEUED),
        sent: has(flag::FIN_SENT),
    };
    if fin.sent && !fin.queued {
        return Err(invalid("fin", "FIN sent but never queued"));
    }
    if fin.queued
        && matches!(
            state,
            State::SynSent | State::SynReceived | State::Established | State::CloseWait
        )
    {
        return Err(invalid("fin", "FIN queued in a state before CLOSE"));
    }
    if max_off as usize > tx_len + 2 {
        return Err(invalid(
            "snd.max-una",
            "more bytes in flight than in the send queue",
        ));
    }
    if !state.is_synchronized() && (tx_len > 0 || rx_len > 0 || n > 0) {
        return Err(invalid(
            "state",
            "queued data before the handshake completed",
        ));
    }
    if fin_received && n > 0 {
        return Err(invalid(
            "ooo.count",
            "out-of-order data after the peer's FIN",
        ));
    }

    c.state = state;
    c.close_reason = close_reason;
    c.local = local;
    c.remote = remote;
    c.opts = Negotiated {
        sack: has(flag::SACK),
        timestamps: has(flag::TIMESTAMPS),
        window_scale: has(flag::WINDOW_SCALE),
    };
    c.fin = fin;
    c.want_writable = has(flag::WANT_WRITABLE);
    Ok(Wire {
        tsval: be32(h, field::TSVAL.start),
        ts_recent: be32(h, field::TS_RECENT.start),
        rtt_timed,
        timers,
        keepalive,
        tx,
        rx,
        ooo_at,
        app,
    })
}

/// The endpoint's import: parses and validates `bytes` straight into `c`
/// (a pooled connection: every field is overwritten, its queue buffers are
/// reused), then copies the queues into its rings and re-bases it on this
/// host at `now` (as `Snapshot::restore_into`, without the intermediate
/// `Snapshot`). `params`: `ConnParams::from_config` of the importer's
/// `TcpConfig` (the endpoint computes it once). Returns where the application state lies in `bytes`. A
/// snapshot whose queues do not fit `c`'s rings is `QueueTooLarge`. On
/// error `c` is left half-written (still a valid pool entry).
pub(crate) fn import_into(
    bytes: &[u8],
    now: Instant,
    params: &ConnParams,
    c: &mut Connection,
) -> Result<std::ops::Range<usize>> {
    let w = parse_into(bytes, c)?;
    if w.tx.len() > c.tx.capacity() {
        return Err(SnapshotError::QueueTooLarge {
            field: "tx.len",
            needed: w.tx.len(),
            capacity: c.tx.capacity(),
        });
    }
    let ooo_end = c.ooo.ranges().last().map_or(0, |r| r.1 as usize);
    let needed = w.rx.len() + ooo_end;
    if needed > c.rx.capacity() {
        return Err(SnapshotError::QueueTooLarge {
            field: "ooo.range",
            needed,
            capacity: c.rx.capacity(),
        });
    }
    c.tx.clear();
    for p in w.tx.chunks(COPY_PIECE) {
        c.tx.enqueue(p);
    }
    c.rx.clear();
    for p in w.rx.chunks(COPY_PIECE) {
        c.rx.enqueue(p);
    }
    for (i, &(s, e)) in c.ooo.ranges().iter().enumerate() {
        let at = w.ooo_at[i] as usize;
        // In bounds: `parse_into` located every range inside `bytes`.
        if let Some(d) = bytes.get(at..at + (e - s) as usize) {
            c.rx.write_unallocated(s as usize, d);
        }
    }
    let r = rebase(
        now,
        params,
        w.keepalive,
        c.rcv.mss,
        c.rtt,
        w.rtt_timed,
        w.tsval,
        w.ts_recent,
        &w.timers,
    );
    c.params = r.params;
    c.ts = r.ts;
    c.rtt = r.rtt;
    c.timers = r.timers;
    c.loss = Default::default();
    c.events = ConnEvents::default();
    let app_start = w.app.as_ptr() as usize - bytes.as_ptr() as usize;
    Ok(app_start..app_start + w.app.len())
}

/// The fields re-based on this host at `now`: parameters (`cfg` plus the
/// snapshot's keep-alive and MSS), the timestamp clock, the timed RTT
/// segment and the timers.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn rebase(
    now: Instant,
    base: &ConnParams,
    keepalive: Option<KeepAlive>,
    mss: u16,
    mut rtt: RttEstimator,
    rtt_timed: Option<(SeqNum, u64)>,
    tsval: u32,
    ts_recent: u32,
    t: &TimerMicros,
) -> Rebased {
    let mut params = *base;
    params.keepalive = keepalive;
    params.mss = mss;
    let now_us = now.as_micros();
    // As `now + Duration::from_micros(us)`, in integers.
    let at = |us: Option<u64>| us.map(|us| Instant::from_micros(now_us.saturating_add(us)));
    let now_ms = (now_us / 1000) as u32;
    rtt.timed = rtt_timed.map(|(end, age)| (end, Instant::from_micros(now_us.saturating_sub(age))));
    Rebased {
        params,
        ts: Timestamps {
            recent: ts_recent,
            offset: tsval.wrapping_sub(now_ms),
        },
        rtt,
        timers: Timers {
            retransmit: at(t[0]),
            persist: at(t[1]),
            delayed_ack: at(t[2]),
            keepalive: at(t[3]),
            close: at(t[4]),
        },
    }
}

/// What `restore` computes from the importing host's clock and config.
struct Rebased {
    params: ConnParams,
    ts: Timestamps,
    rtt: RttEstimator,
    timers: Timers,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fixed_width_fields_round_trip_and_truncate() {
        let mut buf = [0u8; 15];
        let mut w = Writer {
            buf: &mut buf,
            pos: 0,
        };
        w.put([0xab]);
        w.put(0x1234u16.to_be_bytes());
        w.put(0x8000_0001u32.to_be_bytes());
        w.put(u64::MAX.to_be_bytes());
        assert_eq!(w.pos, 15);
        let mut r = Reader { buf: &buf, pos: 0 };
        assert_eq!(r.u8("a").unwrap(), 0xab);
        assert_eq!(r.u16("b").unwrap(), 0x1234);
        assert_eq!(r.u32_max("c", u32::MAX).unwrap(), 0x8000_0001);
        assert_eq!(r.pos, 7);
        assert!(matches!(
            Reader { buf: &buf, pos: 7 }.u64_max("d", MAX_STAT),
            Err(SnapshotError::Invalid { field: "d", .. })
        ));
        assert_eq!(r.u64("d").unwrap(), u64::MAX);
        assert_eq!(r.u8("e"), Err(SnapshotError::Truncated("e")));
        let mut r = Reader {
            buf: &buf[..10],
            pos: 7,
        };
        assert_eq!(r.u64("f"), Err(SnapshotError::Truncated("f")));
        assert_eq!(r.pos, 7);
        // A negative sequence difference is its two's complement.
        assert_eq!(off(SeqNum(5), SeqNum(7)), (-2i32 as u32).to_be_bytes());
        assert_eq!(
            SeqNum(7).add(u32::from_be_bytes(off(SeqNum(5), SeqNum(7)))),
            SeqNum(5)
        );
    }

    #[test]
    fn restore_into_overwrites_every_field_like_restore() {
        use crate::endpoint::Endpoint;
        let cfg = TcpConfig::default();
        let mut ep = Endpoint::new(cfg.clone());
        let now = Instant::from_millis(5);
        let addr = |a: u8, p: u16| SocketAddrV4::new(Ipv4Addr::new(10, 0, 0, a), p);
        let a = ep.connect(now, addr(1, 1000), addr(2, 80)).unwrap();
        let b = ep.connect(now, addr(3, 2000), addr(4, 81)).unwrap();
        let snap = Snapshot::capture(ep.connection(a).unwrap(), now, &[]);
        let later = now + Duration::from_millis(7);
        let fresh = snap.restore(
            later,
            &cfg,
            RingBuffer::new(cfg.tx_buffer),
            RingBuffer::new(cfg.rx_buffer),
        );
        // A pooled entry still holds another connection, with queued bytes.
        let mut dirty = ep.connection(b).unwrap().clone();
        dirty.tx.enqueue(b"stale send");
        dirty.rx.enqueue(b"stale receive");
        dirty.want_writable = true;
        let mut dirty2 = dirty.clone();
        snap.restore_into(later, &cfg, &mut dirty);
        assert_eq!(dirty, fresh);
        assert!(dirty.tx.is_empty() && dirty.rx.is_empty());
        // The endpoint's import path (parsed straight into the connection)
        // overwrites every field the same way, lists included.
        dirty2.sack.add(SeqNum(7), SeqNum(9));
        dirty2.ooo.add(3, 5).unwrap();
        dirty2.retries.rto = 3;
        dirty2.rtt.backoff = 2;
        let mut bytes = vec![0u8; snap.max_len()];
        let n = snap.emit(&mut bytes).unwrap();
        let params = ConnParams::from_config(&cfg);
        let app = import_into(&bytes[..n], later, &params, &mut dirty2).unwrap();
        assert_eq!(app, n..n);
        assert_eq!(dirty2, fresh);
        assert!(dirty2.tx.is_empty() && dirty2.rx.is_empty());
    }

    /// Counts the bytes of fixed-width fields (not the byte runs).
    struct FieldBytes(usize);
    impl Sink for FieldBytes {
        fn put<const N: usize>(&mut self, _: [u8; N]) {
            self.0 += N;
        }
        fn raw(&mut self, _: &[u8]) {}
    }

    #[test]
    fn max_fields_is_the_most_a_snapshot_holds() {
        use crate::endpoint::Endpoint;
        let mut ep = Endpoint::new(TcpConfig::default());
        let now = Instant::from_millis(5);
        let id = ep
            .connect(
                now,
                SocketAddrV4::new(Ipv4Addr::new(10, 0, 0, 1), 1000),
                SocketAddrV4::new(Ipv4Addr::new(10, 0, 0, 2), 80),
            )
            .unwrap();
        let conn = ep.connection(id).unwrap();
        let mut snap = Snapshot::capture(conn, now, &[]);
        assert_eq!(Snapshot::capture(conn, now, &[]).max_len(), snap.max_len());
        // Every optional field present, every list full.
        let una = snap.snd.una;
        snap.rcv.fin_seq = Some(snap.rcv.nxt);
        snap.rtt_timed = Some((una, Duration::from_micros(1)));
        snap.cc.ssthresh = 7;
        for i in 0..MAX_SCOREBOARD as u32 {
            snap.sack.add(una.add(10 * i + 1), una.add(10 * i + 2));
        }
        snap.ack.last_ooo = Some((snap.rcv.nxt, snap.rcv.nxt.add(1)));
        let d = Some(Duration::from_micros(u64::MAX >> 2));
        snap.timers = TimerSnapshot {
            retransmit: d,
            persist: d,
            delayed_ack: d,
            keepalive: d,
            close: d,
        };
        snap.pending.rst_reply = Some(una);
        snap.retries.rto = 1;
        snap.keepalive = Some(KeepAlive {
            idle: Duration::from_secs(1),
            interval: Duration::from_secs(1),
            probes: 1,
        });
        for i in 0..MAX_OOO_RANGES as u32 {
            snap.ooo.add(10 * i + 1, 10 * i + 2).unwrap();
        }
        snap.stats.bytes_acked = u64::MAX;
        let mut n = FieldBytes(0);
        let parts = snap.parts();
        parts.walk(parts.flags(), &mut n);
        assert_eq!(snap.sack.blocks().len(), MAX_SCOREBOARD);
        assert_eq!(snap.ooo.ranges().len(), MAX_OOO_RANGES);
        let lists = (MAX_SCOREBOARD + MAX_OOO_RANGES) * LIST_ITEM;
        assert_eq!(n.0, MAX_FIELDS + lists);
        // Every optional field present: the bound is exact.
        assert_eq!(snap.buffer_len(), snap.max_len());
    }
}
