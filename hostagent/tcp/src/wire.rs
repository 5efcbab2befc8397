//! TCP header layout (RFC 9293 §3.1) and options (RFC 9293 MSS, RFC 7323
//! window scale and timestamps, RFC 2018 SACK).
//!
//! `TcpPacket<T>` is a zero-copy view over a segment (header + payload).
//! Invariant: after `TcpPacket::new_checked` succeeds, no accessor panics: the
//! buffer holds at least 20 bytes and the data offset points inside it.
//! `TcpRepr` is the parsed, owned-ish form (`payload` borrows the buffer) with
//! `parse` / `emit` / `buffer_len`. Unknown options are skipped; known options
//! with a wrong length are ignored (Linux does the same), a length byte that
//! runs past the header makes the segment malformed.

use std::net::Ipv4Addr;

use capybara_proto::checksum;

use crate::seq::SeqNum;

/// IP protocol number of TCP.
pub const IPPROTO_TCP: u8 = 6;
/// Fixed header length without options.
pub const HEADER_LEN: usize = 20;
/// Largest header (data offset 15 words).
pub const MAX_HEADER_LEN: usize = 60;
/// SACK blocks that fit in the option space (RFC 2018: 4, or 3 next to a timestamp).
pub const MAX_SACK_BLOCKS: usize = 4;

/// Named byte ranges of the fixed header.
pub mod field {
    pub type Field = core::ops::Range<usize>;
    pub const SRC_PORT: Field = 0..2;
    pub const DST_PORT: Field = 2..4;
    pub const SEQ_NUM: Field = 4..8;
    pub const ACK_NUM: Field = 8..12;
    /// Data offset (high nibble of byte 12) and the flag bits.
    pub const FLAGS: Field = 12..14;
    pub const WINDOW: Field = 14..16;
    pub const CHECKSUM: Field = 16..18;
    pub const URGENT: Field = 18..20;
    pub const OPTIONS_START: usize = 20;
}

/// Flag bits in the low 9 bits of `field::FLAGS`.
pub mod flags {
    pub const FIN: u16 = 0x001;
    pub const SYN: u16 = 0x002;
    pub const RST: u16 = 0x004;
    pub const PSH: u16 = 0x008;
    pub const ACK: u16 = 0x010;
    pub const URG: u16 = 0x020;
    pub const ECE: u16 = 0x040;
    pub const CWR: u16 = 0x080;
}

/// Option kinds.
mod kind {
    pub const EOL: u8 = 0;
    pub const NOP: u8 = 1;
    pub const MSS: u8 = 2;
    pub const WSCALE: u8 = 3;
    pub const SACK_PERMITTED: u8 = 4;
    pub const SACK: u8 = 5;
    pub const TIMESTAMP: u8 = 8;
}

/// Why a segment could not be parsed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    #[error("segment shorter than the 20-byte TCP header ({0} bytes)")]
    Truncated(usize),
    #[error("data offset {offset} bytes is invalid for a {len}-byte segment")]
    BadDataOffset { offset: usize, len: usize },
    #[error("option at byte {0} runs past the header")]
    BadOption(usize),
    #[error("buffer of {have} bytes is too small for a {need}-byte segment")]
    BufferTooSmall { need: usize, have: usize },
}

/// Zero-copy view of a TCP segment.
#[derive(Debug, Clone)]
pub struct TcpPacket<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> TcpPacket<T> {
    /// Wraps `buffer` without validation; accessors may panic on short input.
    /// Use only on buffers this crate sized itself.
    pub const fn new_unchecked(buffer: T) -> Self {
        TcpPacket { buffer }
    }

    /// Wraps `buffer` after checking that the fixed header and the options
    /// announced by the data offset are inside it.
    pub fn new_checked(buffer: T) -> Result<Self, WireError> {
        let p = Self::new_unchecked(buffer);
        p.check_len()?;
        Ok(p)
    }

    fn check_len(&self) -> Result<(), WireError> {
        let len = self.buffer.as_ref().len();
        if len < HEADER_LEN {
            return Err(WireError::Truncated(len));
        }
        let offset = self.header_len();
        if offset < HEADER_LEN || offset > len {
            return Err(WireError::BadDataOffset { offset, len });
        }
        Ok(())
    }

    pub fn into_inner(self) -> T {
        self.buffer
    }

    fn u16_at(&self, f: field::Field) -> u16 {
        let b = &self.buffer.as_ref()[f];
        u16::from_be_bytes([b[0], b[1]])
    }
    fn u32_at(&self, f: field::Field) -> u32 {
        let b = &self.buffer.as_ref()[f];
        u32::from_be_bytes([b[0], b[1], b[2], b[3]])
    }

    pub fn src_port(&self) -> u16 {
        self.u16_at(field::SRC_PORT)
    }
    pub fn dst_port(&self) -> u16 {
        self.u16_at(field::DST_PORT)
    }
    pub fn seq_number(&self) -> SeqNum {
        SeqNum(self.u32_at(field::SEQ_NUM))
    }
    pub fn ack_number(&self) -> SeqNum {
        SeqNum(self.u32_at(field::ACK_NUM))
    }
    /// Header length in bytes, from the data offset.
    pub fn header_len(&self) -> usize {
        usize::from(self.buffer.as_ref()[field::FLAGS.start] >> 4) * 4
    }
    pub fn flags(&self) -> u16 {
        self.u16_at(field::FLAGS) & 0x01ff
    }
    pub fn has(&self, flag: u16) -> bool {
        self.flags() & flag != 0
    }
    pub fn window(&self) -> u16 {
        self.u16_at(field::WINDOW)
    }
    pub fn checksum(&self) -> u16 {
        self.u16_at(field::CHECKSUM)
    }
    pub fn urgent(&self) -> u16 {
        self.u16_at(field::URGENT)
    }
    pub fn options(&self) -> &[u8] {
        &self.buffer.as_ref()[field::OPTIONS_START..self.header_len()]
    }
    pub fn payload(&self) -> &[u8] {
        &self.buffer.as_ref()[self.header_len()..]
    }
    /// Sequence space the segment occupies: payload plus SYN and FIN.
    pub fn segment_len(&self) -> usize {
        self.payload().len() + usize::from(self.has(flags::SYN)) + usize::from(self.has(flags::FIN))
    }

    /// Verifies the checksum against the IPv4 pseudo-header of the addresses
    /// the segment arrived with.
    pub fn verify_checksum(&self, src: Ipv4Addr, dst: Ipv4Addr) -> bool {
        checksum::transport(src, dst, IPPROTO_TCP, self.buffer.as_ref()) == 0
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> TcpPacket<T> {
    fn set_u16(&mut self, f: field::Field, v: u16) {
        self.buffer.as_mut()[f].copy_from_slice(&v.to_be_bytes());
    }
    fn set_u32(&mut self, f: field::Field, v: u32) {
        self.buffer.as_mut()[f].copy_from_slice(&v.to_be_bytes());
    }
    pub fn set_src_port(&mut self, v: u16) {
        self.set_u16(field::SRC_PORT, v)
    }
    pub fn set_dst_port(&mut self, v: u16) {
        self.set_u16(field::DST_PORT, v)
    }
    pub fn set_seq_number(&mut self, v: SeqNum) {
        self.set_u32(field::SEQ_NUM, v.0)
    }
    pub fn set_ack_number(&mut self, v: SeqNum) {
        self.set_u32(field::ACK_NUM, v.0)
    }
    /// Sets the data offset (`header_len` must be a multiple of 4, 20..=60)
    /// and the flag bits.
    pub fn set_header_len_and_flags(&mut self, header_len: usize, flag_bits: u16) {
        let v = ((header_len as u16 / 4) << 12) | (flag_bits & 0x01ff);
        self.set_u16(field::FLAGS, v)
    }
    pub fn set_window(&mut self, v: u16) {
        self.set_u16(field::WINDOW, v)
    }
    pub fn set_checksum(&mut self, v: u16) {
        self.set_u16(field::CHECKSUM, v)
    }
    pub fn set_urgent(&mut self, v: u16) {
        self.set_u16(field::URGENT, v)
    }
    pub fn options_mut(&mut self) -> &mut [u8] {
        let end = self.header_len();
        &mut self.buffer.as_mut()[field::OPTIONS_START..end]
    }
    pub fn payload_mut(&mut self) -> &mut [u8] {
        let start = self.header_len();
        &mut self.buffer.as_mut()[start..]
    }
    /// Computes and stores the checksum over the whole buffer.
    pub fn fill_checksum(&mut self, src: Ipv4Addr, dst: Ipv4Addr) {
        self.set_checksum(0);
        let c = checksum::transport(src, dst, IPPROTO_TCP, self.buffer.as_ref());
        self.set_checksum(c);
    }
}

/// Up to four SACK blocks `[left, right)` (RFC 2018), stored inline.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SackBlocks {
    blocks: [(SeqNum, SeqNum); MAX_SACK_BLOCKS],
    len: u8,
}

impl SackBlocks {
    pub const fn new() -> Self {
        SackBlocks {
            blocks: [(SeqNum(0), SeqNum(0)); MAX_SACK_BLOCKS],
            len: 0,
        }
    }
    /// Appends a block; ignored once four are held.
    pub fn push(&mut self, left: SeqNum, right: SeqNum) {
        if usize::from(self.len) < MAX_SACK_BLOCKS {
            self.blocks[usize::from(self.len)] = (left, right);
            self.len += 1;
        }
    }
    pub fn len(&self) -> usize {
        usize::from(self.len)
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn as_slice(&self) -> &[(SeqNum, SeqNum)] {
        &self.blocks[..usize::from(self.len)]
    }
    pub fn truncate(&mut self, n: usize) {
        self.len = self.len.min(n as u8);
    }
}

/// TCP options carried by a segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TcpOptions {
    pub mss: Option<u16>,
    /// Window scale shift; values above 14 are clamped to 14 (RFC 7323 §2.3).
    pub window_scale: Option<u8>,
    pub sack_permitted: bool,
    pub sack: SackBlocks,
    /// (TSval, TSecr).
    pub timestamp: Option<(u32, u32)>,
}

impl TcpOptions {
    /// Parses the option bytes of a header.
    pub fn parse(opts: &[u8]) -> Result<TcpOptions, WireError> {
        let mut out = TcpOptions::default();
        let mut i = 0;
        while i < opts.len() {
            let k = opts[i];
            match k {
                kind::EOL => break,
                kind::NOP => {
                    i += 1;
                    continue;
                }
                _ => {}
            }
            let Some(&len) = opts.get(i + 1) else {
                return Err(WireError::BadOption(i));
            };
            let len = usize::from(len);
            if len < 2 || i + len > opts.len() {
                return Err(WireError::BadOption(i));
            }
            let body = &opts[i + 2..i + len];
            match (k, body.len()) {
                (kind::MSS, 2) => out.mss = Some(u16::from_be_bytes([body[0], body[1]])),
                (kind::WSCALE, 1) => out.window_scale = Some(body[0].min(14)),
                (kind::SACK_PERMITTED, 0) => out.sack_permitted = true,
                (kind::SACK, n) if n > 0 && n % 8 == 0 => {
                    for b in body.chunks_exact(8) {
                        let l = u32::from_be_bytes([b[0], b[1], b[2], b[3]]);
                        let r = u32::from_be_bytes([b[4], b[5], b[6], b[7]]);
                        out.sack.push(SeqNum(l), SeqNum(r));
                    }
                }
                (kind::TIMESTAMP, 8) => {
                    let v = u32::from_be_bytes([body[0], body[1], body[2], body[3]]);
                    let e = u32::from_be_bytes([body[4], body[5], body[6], body[7]]);
                    out.timestamp = Some((v, e));
                }
                // Unknown kinds and known kinds with a wrong length: skipped.
                _ => {}
            }
            i += len;
        }
        Ok(out)
    }

    /// SACK blocks that fit next to the other options (RFC 2018 §3).
    fn sack_blocks_emitted(&self) -> usize {
        let max = if self.timestamp.is_some() { 3 } else { 4 };
        self.sack.len().min(max)
    }

    /// Bytes the options take when emitted (always a multiple of 4).
    pub fn buffer_len(&self) -> usize {
        let mut n = 0;
        if self.mss.is_some() {
            n += 4;
        }
        if self.window_scale.is_some() {
            n += 4; // NOP + 3
        }
        if self.sack_permitted {
            n += 4; // NOP NOP + 2
        }
        if self.timestamp.is_some() {
            n += 12; // NOP NOP + 10
        }
        let s = self.sack_blocks_emitted();
        if s > 0 {
            n += 4 + 8 * s; // NOP NOP + 2 + 8n
        }
        n
    }

    /// Writes the options into `out`, which must be `buffer_len()` long.
    pub fn emit(&self, out: &mut [u8]) {
        let mut i = 0;
        let mut put = |bytes: &[u8], i: &mut usize| {
            out[*i..*i + bytes.len()].copy_from_slice(bytes);
            *i += bytes.len();
        };
        if let Some(mss) = self.mss {
            let m = mss.to_be_bytes();
            put(&[kind::MSS, 4, m[0], m[1]], &mut i);
        }
        if let Some(ws) = self.window_scale {
            put(&[kind::NOP, kind::WSCALE, 3, ws.min(14)], &mut i);
        }
        if self.sack_permitted {
            put(&[kind::NOP, kind::NOP, kind::SACK_PERMITTED, 2], &mut i);
        }
        if let Some((v, e)) = self.timestamp {
            put(&[kind::NOP, kind::NOP, kind::TIMESTAMP, 10], &mut i);
            put(&v.to_be_bytes(), &mut i);
            put(&e.to_be_bytes(), &mut i);
        }
        let s = self.sack_blocks_emitted();
        if s > 0 {
            put(
                &[kind::NOP, kind::NOP, kind::SACK, (2 + 8 * s) as u8],
                &mut i,
            );
            for (l, r) in &self.sack.as_slice()[..s] {
                put(&l.0.to_be_bytes(), &mut i);
                put(&r.0.to_be_bytes(), &mut i);
            }
        }
    }
}

/// A parsed TCP segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TcpRepr<'a> {
    pub src_port: u16,
    pub dst_port: u16,
    pub seq: SeqNum,
    /// The acknowledgment number when the ACK flag is set.
    pub ack: Option<SeqNum>,
    pub syn: bool,
    pub fin: bool,
    pub rst: bool,
    pub psh: bool,
    /// Raw (unscaled) window field.
    pub window: u16,
    pub options: TcpOptions,
    pub payload: &'a [u8],
}

impl<'a> TcpRepr<'a> {
    /// A segment with no flags, options or payload.
    pub fn new(src_port: u16, dst_port: u16, seq: SeqNum) -> Self {
        TcpRepr {
            src_port,
            dst_port,
            seq,
            ack: None,
            syn: false,
            fin: false,
            rst: false,
            psh: false,
            window: 0,
            options: TcpOptions::default(),
            payload: &[],
        }
    }

    /// Parses a validated packet. The checksum is not checked here (the
    /// caller knows the pseudo-header).
    pub fn parse<T: AsRef<[u8]> + ?Sized>(packet: &'a TcpPacket<&'a T>) -> Result<Self, WireError> {
        let options = TcpOptions::parse(packet.options())?;
        Ok(TcpRepr {
            src_port: packet.src_port(),
            dst_port: packet.dst_port(),
            seq: packet.seq_number(),
            ack: packet.has(flags::ACK).then(|| packet.ack_number()),
            syn: packet.has(flags::SYN),
            fin: packet.has(flags::FIN),
            rst: packet.has(flags::RST),
            psh: packet.has(flags::PSH),
            window: packet.window(),
            options,
            payload: packet.payload(),
        })
    }

    /// Parses raw bytes (validates lengths first).
    pub fn parse_bytes(bytes: &'a [u8]) -> Result<Self, WireError> {
        let packet = TcpPacket::new_checked(bytes)?;
        let options = TcpOptions::parse(packet.options())?;
        let payload = &bytes[packet.header_len()..];
        Ok(TcpRepr {
            src_port: packet.src_port(),
            dst_port: packet.dst_port(),
            seq: packet.seq_number(),
            ack: packet.has(flags::ACK).then(|| packet.ack_number()),
            syn: packet.has(flags::SYN),
            fin: packet.has(flags::FIN),
            rst: packet.has(flags::RST),
            psh: packet.has(flags::PSH),
            window: packet.window(),
            options,
            payload,
        })
    }

    /// Sequence space occupied: payload + SYN + FIN.
    pub fn segment_len(&self) -> usize {
        self.payload.len() + usize::from(self.syn) + usize::from(self.fin)
    }

    pub fn header_len(&self) -> usize {
        HEADER_LEN + self.options.buffer_len()
    }

    /// Bytes needed to emit the whole segment.
    pub fn buffer_len(&self) -> usize {
        self.header_len() + self.payload.len()
    }

    fn flag_bits(&self) -> u16 {
        let mut f = 0;
        if self.fin {
            f |= flags::FIN;
        }
        if self.syn {
            f |= flags::SYN;
        }
        if self.rst {
            f |= flags::RST;
        }
        if self.psh {
            f |= flags::PSH;
        }
        if self.ack.is_some() {
            f |= flags::ACK;
        }
        f
    }

    /// Writes the header (not the payload, not the checksum) for a segment
    /// that will carry `payload_len` bytes, returning the header length.
    pub fn emit_header(&self, buf: &mut [u8], payload_len: usize) -> Result<usize, WireError> {
        let hl = self.header_len();
        if buf.len() < hl + payload_len {
            return Err(WireError::BufferTooSmall {
                need: hl + payload_len,
                have: buf.len(),
            });
        }
        let mut p = TcpPacket::new_unchecked(&mut buf[..hl + payload_len]);
        p.set_src_port(self.src_port);
        p.set_dst_port(self.dst_port);
        p.set_seq_number(self.seq);
        p.set_ack_number(self.ack.unwrap_or_default());
        p.set_header_len_and_flags(hl, self.flag_bits());
        p.set_window(self.window);
        p.set_checksum(0);
        p.set_urgent(0);
        self.options.emit(p.options_mut());
        Ok(hl)
    }

    /// Writes the complete segment (header, options, payload, checksum
    /// computed with `src`/`dst`) and returns its length.
    pub fn emit(&self, buf: &mut [u8], src: Ipv4Addr, dst: Ipv4Addr) -> Result<usize, WireError> {
        let hl = self.emit_header(buf, self.payload.len())?;
        let total = hl + self.payload.len();
        buf[hl..total].copy_from_slice(self.payload);
        TcpPacket::new_unchecked(&mut buf[..total]).fill_checksum(src, dst);
        Ok(total)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SRC: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 1);
    const DST: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 2);

    #[test]
    fn syn_with_all_options_roundtrips() {
        let mut r = TcpRepr::new(40000, 80, SeqNum(123456));
        r.syn = true;
        r.window = 64240;
        r.options.mss = Some(1460);
        r.options.window_scale = Some(7);
        r.options.sack_permitted = true;
        r.options.timestamp = Some((111, 0));
        let mut buf = [0u8; 100];
        let n = r.emit(&mut buf, SRC, DST).unwrap();
        assert_eq!(n, 44);
        let p = TcpPacket::new_checked(&buf[..n]).unwrap();
        assert!(p.verify_checksum(SRC, DST));
        assert!(!p.verify_checksum(SRC, Ipv4Addr::new(10, 0, 0, 3)));
        assert_eq!(TcpRepr::parse_bytes(&buf[..n]).unwrap(), r);
    }

    #[test]
    fn sack_blocks_limited_by_timestamp() {
        let mut r = TcpRepr::new(1, 2, SeqNum(5));
        r.ack = Some(SeqNum(9));
        r.options.timestamp = Some((1, 2));
        for i in 0..4 {
            r.options.sack.push(SeqNum(100 * i), SeqNum(100 * i + 50));
        }
        r.payload = b"hello";
        let mut buf = [0u8; 200];
        let n = r.emit(&mut buf, SRC, DST).unwrap();
        assert_eq!(n, HEADER_LEN + 12 + 4 + 24 + 5);
        let back = TcpRepr::parse_bytes(&buf[..n]).unwrap();
        assert_eq!(back.options.sack.len(), 3);
        assert_eq!(back.payload, b"hello");
    }

    /// A capture of a Linux 6.x SYN (curl to port 80).
    #[test]
    fn parses_linux_syn() {
        let syn: [u8; 40] = [
            0xa4, 0x3e, 0x00, 0x50, 0x6e, 0x1c, 0x4a, 0x8b, 0x00, 0x00, 0x00, 0x00, 0xa0, 0x02,
            0xfa, 0xf0, 0x00, 0x00, 0x00, 0x00, 0x02, 0x04, 0x05, 0xb4, 0x04, 0x02, 0x08, 0x0a,
            0x9c, 0x2f, 0x3b, 0x1a, 0x00, 0x00, 0x00, 0x00, 0x01, 0x03, 0x03, 0x07,
        ];
        let r = TcpRepr::parse_bytes(&syn).unwrap();
        assert!(r.syn && r.ack.is_none());
        assert_eq!(r.dst_port, 80);
        assert_eq!(r.options.mss, Some(1460));
        assert!(r.options.sack_permitted);
        assert_eq!(r.options.window_scale, Some(7));
        assert_eq!(r.options.timestamp, Some((0x9c2f3b1a, 0)));
    }

    #[test]
    fn rejects_bad_lengths() {
        assert_eq!(
            TcpPacket::new_checked(&[0u8; 19][..]).unwrap_err(),
            WireError::Truncated(19)
        );
        let mut h = [0u8; 20];
        h[12] = 0x60; // 24-byte header in a 20-byte buffer
        assert!(TcpPacket::new_checked(&h[..]).is_err());
        h[12] = 0x40; // 16 bytes: below minimum
        assert!(TcpPacket::new_checked(&h[..]).is_err());
        // Option length running past the header.
        assert_eq!(
            TcpOptions::parse(&[2, 8, 0, 0]),
            Err(WireError::BadOption(0))
        );
        assert_eq!(TcpOptions::parse(&[1, 1, 5]), Err(WireError::BadOption(2)));
        assert_eq!(TcpOptions::parse(&[9, 0]), Err(WireError::BadOption(0)));
        // Unknown option skipped, EOL stops.
        let o = TcpOptions::parse(&[30, 3, 0, 3, 3, 20, 0, 0xff]).unwrap();
        assert_eq!(o.window_scale, Some(14));
    }
}
