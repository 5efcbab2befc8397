//! Connection snapshot: the versioned binary form of one TCP connection that
//! travels in CONN_STATE from the origin to the target (seed 000 §4.1.2).
//! The byte layout is specified field by field in `docs/SNAPSHOT.md`.
//!
//! smoltcp style, in two layers:
//! - [`SnapshotView`] is a view of the fixed 34-byte header. After
//!   `new_checked` (length and version) no accessor can panic.
//! - [`Snapshot`] is the parsed representation (`parse` / `emit` /
//!   `buffer_len`). `parse` reads the variable part through a bounds-checked
//!   cursor and validates every field and cross-field invariant the state
//!   machine relies on, so a snapshot that parses can be imported without
//!   any arithmetic in `conn.rs` overflowing or indexing out of range. A bad
//!   snapshot is a [`SnapshotError`] naming the field, never a panic.
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
pub const VERSION: u8 = 1;

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

/// Most varints a snapshot holds, field by field as in docs/SNAPSHOT.md:
/// 24 for #1-#23 (#17 has two), two per SACK block (#24), 27 for #25-#35
/// (#27 has two, #28 up to five timers, #30 six counters, #31 three
/// keep-alive values, #32 five statistics), two per out-of-order range
/// (#36) and one for #37. A test pins it; `max_len` relies on its part
/// outside the two lists, `FIXED_VARINTS`.
#[cfg(test)]
const MAX_VARINTS: usize = FIXED_VARINTS + 2 * MAX_SCOREBOARD + 2 * MAX_OOO_RANGES;
/// Most varints outside the two lists (SACK blocks, out-of-order ranges).
const FIXED_VARINTS: usize = 24 + 27 + 1;

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
    /// Bits a version-1 reader rejects when set.
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

// ------------------------------------------------------------------ varints

/// LEB128 length of `v`.
#[inline]
pub(crate) fn var_len(v: u64) -> usize {
    // 1 + floor(bits / 7), with 0 taking one byte.
    let bits = 64 - (v | 1).leading_zeros() as usize;
    bits.div_ceil(7)
}

#[inline]
fn zz(v: i32) -> u64 {
    u64::from(((v << 1) ^ (v >> 31)) as u32)
}

#[inline]
fn unzz(v: u32) -> i32 {
    ((v >> 1) as i32) ^ -((v & 1) as i32)
}

/// Packs the low 7 bits of each of the 8 little-endian bytes of `x` into a
/// 56-bit value (LEB128 groups, continuation bits ignored).
#[inline(always)]
fn compact7(x: u64) -> u64 {
    let x = x & 0x7f7f_7f7f_7f7f_7f7f;
    let x = (x & 0x007f_007f_007f_007f) | ((x >> 1) & 0x3f80_3f80_3f80_3f80);
    let x = (x & 0x0000_3fff_0000_3fff) | ((x >> 2) & 0x0fff_c000_0fff_c000);
    (x & 0x0000_0000_0fff_ffff) | ((x >> 4) & 0x00ff_ffff_f000_0000)
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    #[inline(always)]
    fn var(&mut self, f: &'static str) -> Result<u64> {
        let rest = self.buf.get(self.pos..).unwrap_or(&[]);
        // Up to 8 bytes (56 bits) decoded from one load, without a loop.
        if let Some(word) = rest.first_chunk::<8>() {
            let x = u64::from_le_bytes(*word);
            // Most fields fit in one byte.
            if x & 0x80 == 0 {
                self.pos += 1;
                return Ok(x & 0x7f);
            }
            let stops = !x & 0x8080_8080_8080_8080;
            if stops != 0 {
                // Length 2..=8: the byte holding the first clear high bit.
                let bits = (stops.trailing_zeros() + 1) as usize; // 8 * len
                let x = x & (u64::MAX >> (64 - bits));
                // Canonical: the last group is not zero.
                if x >> (bits - 8) == 0 {
                    return Err(invalid(f, "non-canonical varint"));
                }
                self.pos += bits >> 3;
                return Ok(compact7(x));
            }
        } else if let Some(&b) = rest.first() {
            if b < 0x80 {
                self.pos += 1;
                return Ok(u64::from(b));
            }
        }
        // Not `&mut self`: the reader (its position, on every field's
        // critical path) stays in registers instead of going through memory.
        let (v, pos) = Self::var_slow(self.buf, self.pos, f)?;
        self.pos = pos;
        Ok(v)
    }

    /// Varints of 9-10 bytes or near the end: returns the value and the
    /// position after it.
    #[inline(never)]
    #[cold]
    fn var_slow(buf: &[u8], mut pos: usize, f: &'static str) -> Result<(u64, usize)> {
        let mut v: u64 = 0;
        let mut shift = 0u32;
        loop {
            let Some(&b) = buf.get(pos) else {
                return Err(SnapshotError::Truncated(f));
            };
            pos += 1;
            if shift == 63 && b > 1 {
                return Err(invalid(f, "varint overflows 64 bits"));
            }
            v |= u64::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                if b == 0 && shift > 0 {
                    return Err(invalid(f, "non-canonical varint"));
                }
                return Ok((v, pos));
            }
            shift += 7;
        }
    }
    #[inline(always)]
    fn var_max(&mut self, f: &'static str, max: u64) -> Result<u64> {
        let v = self.var(f)?;
        if v > max {
            return Err(invalid(f, "value out of range"));
        }
        Ok(v)
    }
    #[inline(always)]
    fn u32v(&mut self, f: &'static str) -> Result<u32> {
        Ok(self.var_max(f, u64::from(u32::MAX))? as u32)
    }
    #[inline]
    fn i32z(&mut self, f: &'static str) -> Result<i32> {
        Ok(unzz(self.u32v(f)?))
    }
    #[inline]
    fn micros(&mut self, f: &'static str) -> Result<Duration> {
        Ok(Duration::from_micros(self.var_max(f, MAX_MICROS)?))
    }
    /// A duration present only when its flag is set.
    #[inline(always)]
    fn opt_micros(&mut self, present: bool, f: &'static str) -> Result<Option<Duration>> {
        if present {
            Ok(Some(self.micros(f)?))
        } else {
            Ok(None)
        }
    }
    #[inline]
    fn count(&mut self, f: &'static str) -> Result<u32> {
        Ok(self.var_max(f, u64::from(MAX_COUNT))? as u32)
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

/// Receives the variable part in wire order (see `Snapshot::walk`).
trait Sink {
    fn var(&mut self, v: u64);
    fn raw(&mut self, b: &[u8]);
}

/// Counts the bytes a walk would write.
struct Counter(usize);

impl Sink for Counter {
    #[inline]
    fn var(&mut self, v: u64) {
        self.0 += var_len(v);
    }
    #[inline]
    fn raw(&mut self, b: &[u8]) {
        self.0 += b.len();
    }
}

/// Appends to a `Vec` (`Parts::append`, after reserving `max_len`).
impl Sink for Vec<u8> {
    #[inline]
    fn var(&mut self, mut v: u64) {
        while v >= 0x80 {
            self.push((v as u8) | 0x80);
            v >>= 7;
        }
        self.push(v as u8);
    }
    #[inline]
    fn raw(&mut self, b: &[u8]) {
        // In `COPY_PIECE`s, as `copy_queue_bytes`.
        for c in b.chunks(COPY_PIECE) {
            self.extend_from_slice(c);
        }
    }
}

impl Sink for Writer<'_> {
    #[inline]
    fn var(&mut self, v: u64) {
        Writer::var(self, v)
    }
    #[inline]
    fn raw(&mut self, b: &[u8]) {
        self.bytes(b)
    }
}

/// Writer over a buffer already checked to hold `buffer_len()` bytes.
struct Writer<'a> {
    buf: &'a mut [u8],
    pos: usize,
}

impl Writer<'_> {
    #[inline(always)]
    fn var(&mut self, v: u64) {
        // Most fields fit in one byte: one bounds check, one store.
        if v < 0x80 {
            self.buf[self.pos] = v as u8;
            self.pos += 1;
        } else {
            self.var_long(v);
        }
    }
    #[inline]
    fn var_long(&mut self, mut v: u64) {
        while v >= 0x80 {
            self.buf[self.pos] = (v as u8) | 0x80;
            self.pos += 1;
            v >>= 7;
        }
        self.buf[self.pos] = v as u8;
        self.pos += 1;
    }
    #[inline]
    fn bytes(&mut self, b: &[u8]) {
        copy_queue_bytes(&mut self.buf[self.pos..self.pos + b.len()], b);
        self.pos += b.len();
    }
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
    rtt_timed: Option<(SeqNum, Duration)>,
    cc: &'s Congestion,
    sack: &'s Scoreboard,
    fin: FinState,
    ack: &'s AckState,
    timers: TimerSnapshot,
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
    #[inline]
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
            rtt_timed: rtt_age(conn, now),
            cc: &conn.cc,
            sack: &conn.sack,
            fin: conn.fin,
            ack: &conn.ack,
            timers: TimerSnapshot {
                retransmit: remaining(t.retransmit, now),
                persist: remaining(t.persist, now),
                delayed_ack: remaining(t.delayed_ack, now),
                keepalive: remaining(t.keepalive, now),
                close: remaining(t.close, now),
            },
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

    fn flags(&self) -> u32 {
        let mut f = 0;
        let mut set = |bit: u32, on: bool| {
            if on {
                f |= bit
            }
        };
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
        set(flag::TIMER_RETRANSMIT, self.timers.retransmit.is_some());
        set(flag::TIMER_PERSIST, self.timers.persist.is_some());
        set(flag::TIMER_DELAYED_ACK, self.timers.delayed_ack.is_some());
        set(flag::TIMER_KEEPALIVE, self.timers.keepalive.is_some());
        set(flag::TIMER_CLOSE, self.timers.close.is_some());
        set(flag::HAS_COUNTERS, self.has_counters());
        f
    }

    /// Calls `put` with every variable-part integer in wire order, and
    /// `raw` with every byte run. `emit` and `buffer_len` share it so the
    /// two can never disagree.
    #[inline(always)]
    fn walk<S: Sink>(&self, out: &mut S) {
        let (snd, rcv) = (&self.snd, &self.rcv);
        let una = snd.una;
        out.var(u64::from(una.0.wrapping_sub(snd.iss.0)));
        out.var(u64::from(snd.nxt.0.wrapping_sub(una.0)));
        out.var(u64::from(snd.max.0.wrapping_sub(una.0)));
        out.var(u64::from(snd.wnd));
        out.var(u64::from(snd.max_wnd.wrapping_sub(snd.wnd)));
        out.var(zz(snd.wl1.diff(rcv.nxt)));
        out.var(zz(snd.wl2.diff(una)));
        out.var(u64::from((snd.wscale << 4) | (rcv.wscale & 0x0f)));
        out.var(u64::from(snd.smss));
        out.var(u64::from(rcv.mss));
        out.var(u64::from(rcv.nxt.0.wrapping_sub(rcv.irs.0)));
        out.var(zz(rcv.adv_right.diff(rcv.nxt)));
        if let Some(f) = rcv.fin_seq {
            out.var(zz(f.diff(rcv.nxt)));
        }
        out.var(self.rtt.srtt_us);
        out.var(self.rtt.rttvar_us);
        out.var(self.rtt.rto_us);
        if let Some((end, age)) = self.rtt_timed {
            out.var(zz(end.diff(una)));
            out.var(age.as_micros() as u64);
        }
        let cc = &self.cc;
        out.var(u64::from(cc.cwnd));
        if cc.ssthresh != u32::MAX {
            out.var(u64::from(cc.ssthresh));
        }
        out.var(zz(cc.recover.diff(una)));
        out.var(u64::from(cc.ca_acked));
        out.var(zz(cc.rexmit_next.diff(una)));
        let blocks = self.sack.blocks();
        out.var(blocks.len() as u64);
        let mut prev = una;
        for &(s, e) in blocks {
            out.var(u64::from(s.0.wrapping_sub(prev.0)));
            out.var(u64::from(e.0.wrapping_sub(s.0)));
            prev = e;
        }
        out.var(u64::from(self.ack.unacked_bytes));
        out.var(zz(self.ack.last_sent.diff(rcv.nxt)));
        if let Some((l, r)) = self.ack.last_ooo {
            out.var(zz(l.diff(rcv.nxt)));
            out.var(u64::from(r.0.wrapping_sub(l.0)));
        }
        let t = &self.timers;
        for d in [t.retransmit, t.persist, t.delayed_ack, t.keepalive, t.close]
            .into_iter()
            .flatten()
        {
            out.var(d.as_micros() as u64);
        }
        if let Some(seq) = self.pending.rst_reply {
            out.var(u64::from(seq.0));
        }
        if self.has_counters() {
            out.var(u64::from(self.rtt.backoff));
            out.var(u64::from(cc.dup_acks));
            out.var(u64::from(self.ack.dup_pending));
            out.var(u64::from(self.retries.rto));
            out.var(u64::from(self.retries.persist));
            out.var(u64::from(self.retries.keepalive));
        }
        if let Some(ka) = self.keepalive {
            out.var(ka.idle.as_micros() as u64);
            out.var(ka.interval.as_micros() as u64);
            out.var(u64::from(ka.probes));
        }
        let st = &self.stats;
        for v in [
            st.segments_in,
            st.segments_out,
            st.retransmits,
            st.bytes_acked,
            st.bytes_received,
        ] {
            out.var(v);
        }
        out.var(self.tx.len() as u64);
        out.raw(self.tx.0);
        out.raw(self.tx.1);
        out.var(self.rx.len() as u64);
        out.raw(self.rx.0);
        out.raw(self.rx.1);
        let ranges = self.ooo.ranges();
        out.var(ranges.len() as u64);
        let mut prev = 0u32;
        for (i, &(s, e)) in ranges.iter().enumerate() {
            out.var(u64::from(s - prev));
            out.var(u64::from(e - s));
            let d = self.ooo_chunk(i);
            out.raw(d.0);
            out.raw(d.1);
            prev = e;
        }
        out.var(self.app.len() as u64);
        out.raw(self.app);
    }

    /// Bytes `emit` writes.
    fn buffer_len(&self) -> usize {
        let mut c = Counter(HEADER_LEN);
        self.walk(&mut c);
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

    /// An upper bound of `buffer_len` that costs no walk: every varint
    /// present at its longest (10 bytes), the lists at their actual length.
    fn max_len(&self) -> usize {
        let lists = 2 * (self.sack.blocks().len() + self.ooo.ranges().len());
        HEADER_LEN + (FIXED_VARINTS + lists) * 10 + self.raw_len()
    }

    /// Writes the snapshot into `buf`; returns the bytes written. Only the
    /// first (returned) bytes of `buf` are written.
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
    fn write(&self, buf: &mut [u8]) -> usize {
        self.header(&mut buf[..HEADER_LEN]);
        let mut w = Writer {
            buf,
            pos: HEADER_LEN,
        };
        self.walk(&mut w);
        w.pos
    }

    /// Appends the snapshot to `out` (reserving the cheap `max_len` bound
    /// first, so it grows at most once); returns the bytes appended. No
    /// sizing walk and no zero-filling of the part written.
    fn append(&self, out: &mut Vec<u8>) -> usize {
        let start = out.len();
        out.reserve(self.max_len());
        let mut h = [0u8; HEADER_LEN];
        self.header(&mut h);
        out.extend_from_slice(&h);
        self.walk(out);
        out.len() - start
    }

    /// Writes the fixed header into `h` (`HEADER_LEN` bytes).
    #[inline(always)]
    fn header(&self, h: &mut [u8]) {
        let flags = self.flags();
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
    conn.rtt.timed.map(|(end, sent)| {
        (
            end,
            now.saturating_since(sent)
                .min(Duration::from_micros(MAX_MICROS)),
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
    t.map(|t| {
        t.saturating_since(now)
            .min(Duration::from_micros(MAX_MICROS))
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
            rtt_timed: self.rtt_timed,
            cc: &self.cc,
            sack: &self.sack,
            fin: self.fin,
            ack: &self.ack,
            timers: self.timers,
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

    /// An upper bound of `buffer_len` that costs no walk: every varint
    /// present at its longest (10 bytes), the lists at their actual length.
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

    /// `SnapshotView::new_checked` + `parse` in one call.
    pub fn parse_bytes(bytes: &'a [u8]) -> Result<Snapshot<'a>> {
        let view = SnapshotView::new_checked(bytes)?;
        if bytes.len() > u32::MAX as usize {
            return Err(invalid("snapshot", "longer than 4 GiB"));
        }
        let sb = view.state_byte();
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
        let f = view.flags();
        if f & flag::RESERVED != 0 {
            return Err(invalid("flags", "reserved bit set"));
        }
        let has = |bit: u32| f & bit != 0;
        let local = view.local();
        let remote = view.remote();
        if local.port() == 0 || remote.port() == 0 {
            return Err(invalid("local_port/remote_port", "port 0"));
        }
        let una = view.snd_una();
        let rcv_nxt = view.rcv_nxt();

        let mut r = Reader {
            buf: bytes,
            pos: HEADER_LEN,
        };
        let iss = una.sub(r.u32v("snd.una-iss")?);
        let nxt_off = r.u32v("snd.nxt-una")?;
        let max_off = r.u32v("snd.max-una")?;
        if nxt_off > max_off || max_off > i32::MAX as u32 {
            return Err(invalid(
                "snd.nxt-una",
                "SND.NXT must lie in [SND.UNA, SND.MAX]",
            ));
        }
        let wnd = r.u32v("snd.wnd")?;
        let max_wnd = wnd
            .checked_add(r.u32v("snd.max_wnd-wnd")?)
            .ok_or(invalid("snd.max_wnd-wnd", "overflow"))?;
        let wl1 = rcv_nxt.add(r.i32z("snd.wl1-rcv.nxt")? as u32);
        let wl2 = una.add(r.i32z("snd.wl2-una")? as u32);
        let ws = r.var_max("wscale", 0xff)? as u8;
        let (snd_ws, rcv_ws) = (ws >> 4, ws & 0x0f);
        if snd_ws > 14 || rcv_ws > 14 {
            return Err(invalid("wscale", "window scale above 14 (RFC 7323)"));
        }
        let smss = r.var_max("snd.smss", 0xffff)? as u16;
        if smss == 0 {
            return Err(invalid("snd.smss", "zero"));
        }
        let mss = r.var_max("rcv.mss", 0xffff)? as u16;
        if mss < 64 {
            return Err(invalid("rcv.mss", "below 64"));
        }
        let irs = rcv_nxt.sub(r.u32v("rcv.nxt-irs")?);
        let adv_right = rcv_nxt.add(r.i32z("rcv.adv_right-nxt")? as u32);
        let fin_seq = if has(flag::HAS_FIN_SEQ) {
            Some(rcv_nxt.add(r.i32z("rcv.fin_seq")? as u32))
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
        let snd = SendSeq {
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
        let rcv = RecvSeq {
            irs,
            nxt: rcv_nxt,
            wscale: rcv_ws,
            adv_right,
            fin_seq,
            fin_received,
            mss,
        };

        let srtt_us = r.var_max("rtt.srtt_us", MAX_MICROS)?;
        let rttvar_us = r.var_max("rtt.rttvar_us", MAX_MICROS)?;
        let rto_us = r.var_max("rtt.rto_us", MAX_MICROS)?;
        let rtt = RttEstimator {
            srtt_us,
            rttvar_us,
            rto_us,
            backoff: 0,
            has_sample: has(flag::RTT_HAS_SAMPLE),
            timed: None,
        };
        let rtt_timed = if has(flag::HAS_RTT_TIMED) {
            let end = una.add(r.i32z("rtt.timed.end")? as u32);
            Some((end, r.micros("rtt.timed.age")?))
        } else {
            None
        };

        let cwnd = r.u32v("cc.cwnd")?;
        if cwnd == 0 && state.is_synchronized() {
            return Err(invalid("cc.cwnd", "zero in a synchronized state"));
        }
        let ssthresh = if has(flag::SSTHRESH_INF) {
            u32::MAX
        } else {
            r.u32v("cc.ssthresh")?
        };
        let mut cc = Congestion {
            cwnd,
            ssthresh,
            dup_acks: 0,
            recover: una.add(r.i32z("cc.recover")? as u32),
            in_recovery: has(flag::IN_RECOVERY),
            ca_acked: r.u32v("cc.ca_acked")?,
            fast_retransmit: has(flag::FAST_RETRANSMIT),
            rexmit_next: una.add(r.i32z("cc.rexmit_next")? as u32),
        };

        let n = r.var_max("sack.count", MAX_SCOREBOARD as u64)? as usize;
        let mut sack = Scoreboard::default();
        let mut prev = 0u32; // offset from SND.UNA
        for i in 0..n {
            let gap = r.u32v("sack.block.gap")?;
            let len = r.u32v("sack.block.len")?;
            let s = prev
                .checked_add(gap)
                .ok_or(invalid("sack.block.gap", "overflow"))?;
            let e = s
                .checked_add(len)
                .ok_or(invalid("sack.block.len", "overflow"))?;
            if len == 0 || (i > 0 && gap == 0) || e > max_off {
                return Err(invalid(
                    "sack.block",
                    "blocks must be non-empty, disjoint and within [SND.UNA, SND.MAX]",
                ));
            }
            sack.add(una.add(s), una.add(e));
            prev = e;
        }

        let unacked_bytes = r.u32v("ack.unacked_bytes")?;
        let last_sent = rcv_nxt.add(r.i32z("ack.last_sent")? as u32);
        let last_ooo = if has(flag::HAS_LAST_OOO) {
            let l = rcv_nxt.add(r.i32z("ack.last_ooo.start")? as u32);
            let len = r.u32v("ack.last_ooo.len")?;
            if len == 0 || len > i32::MAX as u32 {
                return Err(invalid("ack.last_ooo.len", "out of range"));
            }
            Some((l, l.add(len)))
        } else {
            None
        };
        let mut ack = AckState {
            now: has(flag::ACK_NOW),
            unacked_bytes,
            last_sent,
            last_ooo,
            dup_pending: 0,
        };

        let timers = TimerSnapshot {
            retransmit: r.opt_micros(has(flag::TIMER_RETRANSMIT), "timers.retransmit")?,
            persist: r.opt_micros(has(flag::TIMER_PERSIST), "timers.persist")?,
            delayed_ack: r.opt_micros(has(flag::TIMER_DELAYED_ACK), "timers.delayed_ack")?,
            keepalive: r.opt_micros(has(flag::TIMER_KEEPALIVE), "timers.keepalive")?,
            close: r.opt_micros(has(flag::TIMER_CLOSE), "timers.close")?,
        };
        let rst_reply = if has(flag::HAS_RST_REPLY) {
            Some(SeqNum(r.u32v("pending.rst_reply")?))
        } else {
            None
        };
        let pending = Pending {
            rst: has(flag::PENDING_RST),
            rst_reply,
            probe: has(flag::PENDING_PROBE),
        };
        let mut rtt = rtt;
        let mut retries = Retries::default();
        if has(flag::HAS_COUNTERS) {
            rtt.backoff = r.count("rtt.backoff")?;
            cc.dup_acks = r.count("cc.dup_acks")?;
            ack.dup_pending = r.var_max("ack.dup_pending", 16)? as u32;
            retries.rto = r.count("retries.rto")?;
            retries.persist = r.count("retries.persist")?;
            retries.keepalive = r.count("retries.keepalive")?;
            let rt = &retries;
            if (rtt.backoff | cc.dup_acks | ack.dup_pending | rt.rto | rt.persist | rt.keepalive)
                == 0
            {
                return Err(invalid(
                    "counters",
                    "group present but all zero (non-canonical)",
                ));
            }
        }
        let keepalive = if has(flag::HAS_KEEPALIVE) {
            Some(KeepAlive {
                idle: r.micros("keepalive.idle")?,
                interval: r.micros("keepalive.interval")?,
                probes: r.count("keepalive.probes")?,
            })
        } else {
            None
        };
        let stats = ConnStats {
            segments_in: r.var_max("stats.segments_in", MAX_STAT)?,
            segments_out: r.var_max("stats.segments_out", MAX_STAT)?,
            retransmits: r.var_max("stats.retransmits", MAX_STAT)?,
            bytes_acked: r.var_max("stats.bytes_acked", MAX_STAT)?,
            bytes_received: r.var_max("stats.bytes_received", MAX_STAT)?,
        };

        let tx_len = r.var_max("tx.len", i32::MAX as u64)? as usize;
        let tx = Chunks(r.bytes(tx_len, "tx.bytes")?, &[]);
        let rx_len = r.var_max("rx.len", i32::MAX as u64)? as usize;
        let rx = Chunks(r.bytes(rx_len, "rx.bytes")?, &[]);
        let n = r.var_max("ooo.count", MAX_OOO_RANGES as u64)? as usize;
        let mut ooo = Assembler::default();
        let mut at = [0u32; MAX_OOO_RANGES];
        let mut prev = 0u32;
        for slot in at.iter_mut().take(n) {
            let gap = r.u32v("ooo.range.gap")?;
            let len = r.u32v("ooo.range.len")?;
            let s = prev
                .checked_add(gap)
                .filter(|&s| s <= i32::MAX as u32)
                .ok_or(invalid("ooo.range.gap", "overflow"))?;
            let e = s
                .checked_add(len)
                .filter(|&e| e <= i32::MAX as u32)
                .ok_or(invalid("ooo.range.len", "overflow"))?;
            if gap == 0 || len == 0 {
                return Err(invalid(
                    "ooo.range",
                    "ranges must be non-empty, start past RCV.NXT and not touch",
                ));
            }
            // Fits: snapshots longer than u32::MAX were refused above.
            *slot = r.pos as u32;
            r.bytes(len as usize, "ooo.range.bytes")?;
            // Cannot fail: at most MAX_OOO_RANGES disjoint, sorted ranges.
            ooo.add(s, e)
                .map_err(|_| invalid("ooo.count", "too many ranges"))?;
            prev = e;
        }
        let app_len = r.var_max("app.len", i32::MAX as u64)? as usize;
        let app = r.bytes(app_len, "app.bytes")?;
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

        Ok(Snapshot {
            state,
            close_reason,
            local,
            remote,
            snd,
            rcv,
            opts: Negotiated {
                sack: has(flag::SACK),
                timestamps: has(flag::TIMESTAMPS),
                window_scale: has(flag::WINDOW_SCALE),
            },
            tsval: view.tsval(),
            ts_recent: view.ts_recent(),
            rtt,
            rtt_timed,
            cc,
            sack,
            fin,
            ack,
            timers,
            pending,
            retries,
            want_writable: has(flag::WANT_WRITABLE),
            keepalive,
            stats,
            tx,
            rx,
            ooo,
            ooo_data: OooData::Wire { bytes, at },
            app,
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
        let mut params = ConnParams::from_config(cfg);
        params.keepalive = self.keepalive;
        params.mss = self.rcv.mss;
        let at = |d: Option<Duration>| d.map(|d| now + d);
        let t = &self.timers;
        let now_ms = (now.as_micros() / 1000) as u32;
        let mut rtt = self.rtt;
        rtt.timed = self.rtt_timed.map(|(end, age)| {
            (
                end,
                Instant::from_micros(now.as_micros().saturating_sub(age.as_micros() as u64)),
            )
        });
        Rebased {
            params,
            ts: Timestamps {
                recent: self.ts_recent,
                offset: self.tsval.wrapping_sub(now_ms),
            },
            rtt,
            timers: Timers {
                retransmit: at(t.retransmit),
                persist: at(t.persist),
                delayed_ack: at(t.delayed_ack),
                keepalive: at(t.keepalive),
                close: at(t.close),
            },
        }
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
    fn varint_lengths_and_zigzag() {
        for (v, n) in [
            (0u64, 1),
            (127, 1),
            (128, 2),
            (16383, 2),
            (16384, 3),
            (u64::from(u32::MAX), 5),
            (u64::MAX, 10),
        ] {
            assert_eq!(var_len(v), n, "{v}");
            let mut buf = [0u8; 10];
            let mut w = Writer {
                buf: &mut buf,
                pos: 0,
            };
            w.var(v);
            assert_eq!(w.pos, n);
            let mut r = Reader {
                buf: &buf[..n],
                pos: 0,
            };
            assert_eq!(r.var("x").unwrap(), v);
            // The one-load path (at least 8 bytes left), with junk after.
            let mut padded = [0xffu8; 20];
            padded[..n].copy_from_slice(&buf[..n]);
            let mut r = Reader {
                buf: &padded,
                pos: 0,
            };
            assert_eq!(r.var("x").unwrap(), v);
            assert_eq!(r.pos, n);
        }
        // Every length from 1 to 10 bytes, through both paths.
        for bits in 0..64 {
            let v = (1u64 << bits) | (0x5555_5555_5555_5555 & ((1u64 << bits) - 1));
            let mut buf = [0u8; 20];
            let mut w = Writer {
                buf: &mut buf,
                pos: 0,
            };
            w.var(v);
            let n = w.pos;
            for b in [&buf[..n], &buf[..]] {
                let mut r = Reader { buf: b, pos: 0 };
                assert_eq!((r.var("x").unwrap(), r.pos), (v, n), "{v:#x}");
            }
        }
        let mut r = Reader {
            buf: &[0x80, 0x80, 0x00, 1, 2, 3, 4, 5, 6],
            pos: 0,
        };
        assert!(matches!(
            r.var("x"),
            Err(SnapshotError::Invalid { field: "x", .. })
        ));
        for v in [0i32, 1, -1, 1000, -1000, i32::MAX, i32::MIN] {
            assert_eq!(unzz(zz(v) as u32), v);
        }
        // Overlong and non-canonical encodings are rejected.
        let mut r = Reader {
            buf: &[0x80, 0x00],
            pos: 0,
        };
        assert!(matches!(
            r.var("x"),
            Err(SnapshotError::Invalid { field: "x", .. })
        ));
        let mut r = Reader {
            buf: &[0xff; 11],
            pos: 0,
        };
        assert!(r.var("x").is_err());
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
        snap.restore_into(later, &cfg, &mut dirty);
        assert_eq!(dirty, fresh);
        assert!(dirty.tx.is_empty() && dirty.rx.is_empty());
    }

    /// Counts varints and checks `max_len` against the exact length.
    struct VarCount(usize);
    impl Sink for VarCount {
        fn var(&mut self, _: u64) {
            self.0 += 1;
        }
        fn raw(&mut self, _: &[u8]) {}
    }

    #[test]
    fn max_varints_is_the_most_a_snapshot_holds() {
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
        let mut n = VarCount(0);
        snap.parts().walk(&mut n);
        assert_eq!(snap.sack.blocks().len(), MAX_SCOREBOARD);
        assert_eq!(snap.ooo.ranges().len(), MAX_OOO_RANGES);
        assert_eq!(n.0, MAX_VARINTS);
        assert!(snap.buffer_len() <= snap.max_len());
    }
}
