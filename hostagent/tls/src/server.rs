//! The sans-IO TLS server session.
//!
//! Invariants (they are what makes export possible at any byte):
//! - After the handshake, every complete record in `inbound` has been
//!   processed by the time `feed_ciphertext` returns: `inbound` holds at most
//!   one incomplete record.
//! - Plaintext written is sealed at once: no unsealed plaintext is ever held.
//! - `hs_partial` holds at most 4 bytes of a fragmented KeyUpdate message.
//! - After close_notify from the client, received bytes are discarded
//!   (RFC 8446 §6.1), so `inbound` and `hs_partial` are empty.

use std::io::{Read, Write};
use std::sync::atomic::Ordering;

use rustls::{ConnectionTrafficSecrets, ServerConnection};

use crate::config::TlsConfig;
use crate::error::{Alert, TlsError};
use crate::keys::{derive_key_iv, DirectionKeys, Protocol, Suite, TAG_LEN};
use crate::record::{
    RecordHeader, ALERT, APPLICATION_DATA, HANDSHAKE, HEADER_LEN, KEY_UPDATE, MAX_PLAINTEXT,
};

/// Length of the ClientHello prefix that holds the client random:
/// handshake header (4) + legacy_version (2) + random (32).
const HELLO_PREFIX: usize = 38;

pub(crate) struct Handshake {
    conn: ServerConnection,
    config: TlsConfig,
    hello: [u8; HELLO_PREFIX],
    hello_len: usize,
}

impl Handshake {
    /// Keeps the start of the ClientHello (first plaintext handshake bytes)
    /// to learn the client random, the key of our traffic secrets.
    fn capture_hello(&mut self, record: &[u8]) {
        if self.hello_len == HELLO_PREFIX || record.first() != Some(&HANDSHAKE) {
            return;
        }
        let body = &record[HEADER_LEN.min(record.len())..];
        let n = (HELLO_PREFIX - self.hello_len).min(body.len());
        self.hello[self.hello_len..self.hello_len + n].copy_from_slice(&body[..n]);
        self.hello_len += n;
    }

    fn client_random(&self) -> Option<[u8; 32]> {
        if self.hello_len == HELLO_PREFIX && self.hello[0] == 1 {
            self.hello[6..].try_into().ok()
        } else {
            None
        }
    }
}

pub(crate) struct Traffic {
    pub(crate) protocol: Protocol,
    /// IANA code of the negotiated suite (exported as is).
    pub(crate) suite_code: u16,
    pub(crate) rx: DirectionKeys,
    pub(crate) tx: DirectionKeys,
}

impl Traffic {
    /// Seals one record carrying `typ` content and appends it to `out`.
    pub(crate) fn seal(
        &mut self,
        out: &mut Vec<u8>,
        typ: u8,
        content: &[u8],
    ) -> Result<(), TlsError> {
        let start = out.len();
        let result = match self.protocol {
            // TLSInnerPlaintext = content || type, outer type application_data,
            // AAD = the record header (RFC 8446 §5.2).
            Protocol::Tls13 => {
                let header = RecordHeader {
                    content_type: APPLICATION_DATA,
                    version: 0x0303,
                    len: content.len() + 1 + TAG_LEN,
                }
                .to_bytes();
                out.extend_from_slice(&header);
                out.extend_from_slice(content);
                out.push(typ);
                self.tx.seal(&header, &mut out[start + HEADER_LEN..])
            }
            // Outer type is the real type; GCM bodies start with the
            // explicit nonce; AAD = seq || type || version || length
            // (RFC 5246 §6.2.3.3).
            Protocol::Tls12 => {
                let explicit = self.tx.suite.tls12_explicit_nonce_len();
                let header = RecordHeader {
                    content_type: typ,
                    version: 0x0303,
                    len: explicit + content.len() + TAG_LEN,
                }
                .to_bytes();
                out.extend_from_slice(&header);
                let nonce = self.tx.seq_nonce();
                out.extend_from_slice(&nonce[nonce.len() - explicit..]);
                out.extend_from_slice(content);
                let aad = tls12_aad(self.tx.seq, typ, 0x0303, content.len());
                self.tx
                    .seal(&aad, &mut out[start + HEADER_LEN + explicit..])
            }
        };
        match result {
            Ok(tag) => {
                out.extend_from_slice(&tag);
                Ok(())
            }
            Err(e) => {
                out.truncate(start);
                Err(e)
            }
        }
    }

    /// Opens one complete record (`record` = header + body) in place;
    /// returns the content type and the content's range in `record`.
    fn open(
        &mut self,
        header: RecordHeader,
        record: &mut [u8],
    ) -> Result<(u8, std::ops::Range<usize>), TlsError> {
        let mut head = [0u8; HEADER_LEN];
        head.copy_from_slice(&record[..HEADER_LEN]);
        match self.protocol {
            Protocol::Tls13 => {
                if header.content_type != APPLICATION_DATA {
                    // Includes change_cipher_spec, only allowed during the handshake.
                    return Err(TlsError::UnexpectedMessage(
                        "unprotected record after the handshake",
                    ));
                }
                if header.len < TAG_LEN + 1 {
                    return Err(TlsError::Decode(
                        "protected record shorter than its tag and content type",
                    ));
                }
                let n = self.rx.open(None, &head, &mut record[HEADER_LEN..])?;
                let inner = &record[HEADER_LEN..HEADER_LEN + n];
                // TLSInnerPlaintext: content || type || zero padding (RFC 8446 §5.4).
                let Some(type_pos) = inner.iter().rposition(|&b| b != 0) else {
                    return Err(TlsError::UnexpectedMessage(
                        "protected record without a content type",
                    ));
                };
                Ok((inner[type_pos], HEADER_LEN..HEADER_LEN + type_pos))
            }
            Protocol::Tls12 => {
                if !matches!(header.content_type, ALERT | HANDSHAKE | APPLICATION_DATA) {
                    return Err(TlsError::UnexpectedMessage(
                        "change_cipher_spec after the handshake",
                    ));
                }
                let explicit = self.rx.suite.tls12_explicit_nonce_len();
                if header.len < explicit + TAG_LEN {
                    return Err(TlsError::Decode(
                        "protected record shorter than its nonce and tag",
                    ));
                }
                let nonce = if explicit > 0 {
                    let mut n = self.rx.iv;
                    n[4..].copy_from_slice(&record[HEADER_LEN..HEADER_LEN + explicit]);
                    Some(n)
                } else {
                    None
                };
                let plain_len = header.len - explicit - TAG_LEN;
                let aad = tls12_aad(self.rx.seq, header.content_type, header.version, plain_len);
                let start = HEADER_LEN + explicit;
                let n = self.rx.open(nonce, &aad, &mut record[start..])?;
                Ok((header.content_type, start..start + n))
            }
        }
    }
}

fn tls12_aad(seq: u64, typ: u8, version: u16, len: usize) -> [u8; 13] {
    let mut aad = [0u8; 13];
    aad[..8].copy_from_slice(&seq.to_be_bytes());
    aad[8] = typ;
    aad[9..11].copy_from_slice(&version.to_be_bytes());
    aad[11..].copy_from_slice(&(len as u16).to_be_bytes());
    aad
}

pub(crate) enum State {
    Handshaking(Box<Handshake>),
    Traffic(Box<Traffic>),
    Failed(&'static str),
}

/// A TLS 1.3 / 1.2 server session: rustls runs the handshake, then our own record
/// layer takes over so that its whole state can be exported.
pub struct TlsServer {
    pub(crate) state: State,
    /// Received ciphertext not processed yet (after the handshake: at most
    /// one incomplete record).
    pub(crate) inbound: Vec<u8>,
    /// Decrypted application data the application has not read yet.
    pub(crate) plaintext: Vec<u8>,
    pub(crate) plaintext_read: usize,
    /// Ciphertext ready to be written to TCP.
    pub(crate) outbound: Vec<u8>,
    /// Prefix of a KeyUpdate message split across records.
    pub(crate) hs_partial: Vec<u8>,
    pub(crate) peer_closed: bool,
    pub(crate) close_sent: bool,
}

impl std::fmt::Debug for TlsServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = match &self.state {
            State::Handshaking(_) => "handshaking",
            State::Traffic(_) => "traffic",
            State::Failed(k) => k,
        };
        f.debug_struct("TlsServer")
            .field("state", &state)
            .field("inbound", &self.inbound.len())
            .field("plaintext_pending", &self.plaintext_pending())
            .field("outbound", &self.outbound.len())
            .field("peer_closed", &self.peer_closed)
            .field("close_sent", &self.close_sent)
            .finish()
    }
}

impl TlsServer {
    /// A new session that expects a ClientHello.
    pub fn new(config: &TlsConfig) -> Result<TlsServer, TlsError> {
        let conn = ServerConnection::new(config.server.clone()).map_err(TlsError::Handshake)?;
        Ok(TlsServer::with_state(State::Handshaking(Box::new(
            Handshake {
                conn,
                config: config.clone(),
                hello: [0; HELLO_PREFIX],
                hello_len: 0,
            },
        ))))
    }

    pub(crate) fn with_state(state: State) -> TlsServer {
        TlsServer {
            state,
            inbound: Vec::new(),
            plaintext: Vec::new(),
            plaintext_read: 0,
            outbound: Vec::new(),
            hs_partial: Vec::new(),
            peer_closed: false,
            close_sent: false,
        }
    }

    pub fn is_handshaking(&self) -> bool {
        matches!(self.state, State::Handshaking(_))
    }

    /// True once the handshake is complete and the session has not failed.
    pub fn can_export(&self) -> bool {
        matches!(self.state, State::Traffic(_))
    }

    /// The session failed (an error was returned); only the queued alert
    /// remains to be sent.
    pub fn is_failed(&self) -> bool {
        matches!(self.state, State::Failed(_))
    }

    /// The negotiated suite, once the handshake is complete.
    pub fn suite(&self) -> Option<Suite> {
        match &self.state {
            State::Traffic(t) => Some(t.rx.suite),
            _ => None,
        }
    }

    /// The negotiated protocol version, once the handshake is complete.
    pub fn protocol(&self) -> Option<Protocol> {
        match &self.state {
            State::Traffic(t) => Some(t.protocol),
            _ => None,
        }
    }

    /// Whether KeyUpdate can be honoured (the traffic secrets are known).
    pub fn supports_key_update(&self) -> bool {
        match &self.state {
            State::Traffic(t) => t.rx.secret.is_some() && t.tx.secret.is_some(),
            _ => false,
        }
    }

    /// The client sent close_notify: no more plaintext will arrive.
    pub fn peer_closed(&self) -> bool {
        self.peer_closed
    }

    /// The client closed and all its plaintext was read.
    pub fn is_eof(&self) -> bool {
        self.peer_closed && self.plaintext_pending() == 0
    }

    pub fn close_sent(&self) -> bool {
        self.close_sent
    }

    /// Decrypted bytes waiting for `read_plaintext`.
    pub fn plaintext_pending(&self) -> usize {
        self.plaintext.len() - self.plaintext_read
    }

    /// Ciphertext waiting for `take_ciphertext_to_send`.
    pub fn ciphertext_pending(&self) -> usize {
        self.outbound.len()
    }

    /// Bytes of an incomplete record received so far.
    pub fn partial_record_len(&self) -> usize {
        self.inbound.len()
    }

    /// Appends the ciphertext to send to the client (handshake messages,
    /// records, alerts) to `out`.
    pub fn take_ciphertext_to_send(&mut self, out: &mut Vec<u8>) {
        if out.is_empty() {
            std::mem::swap(out, &mut self.outbound);
        } else {
            out.extend_from_slice(&self.outbound);
        }
        self.outbound.clear();
    }

    /// Copies decrypted application data into `buf`; returns the count
    /// (0 when nothing is pending).
    pub fn read_plaintext(&mut self, buf: &mut [u8]) -> usize {
        let avail = &self.plaintext[self.plaintext_read..];
        let n = avail.len().min(buf.len());
        buf[..n].copy_from_slice(&avail[..n]);
        self.plaintext_read += n;
        if self.plaintext_read == self.plaintext.len() {
            self.plaintext.clear();
            self.plaintext_read = 0;
        }
        n
    }

    /// Takes ciphertext received from the client. On `Err` the session is
    /// dead; an alert for the client may be waiting in
    /// `take_ciphertext_to_send`.
    pub fn feed_ciphertext(&mut self, data: &[u8]) -> Result<(), TlsError> {
        if let State::Failed(k) = self.state {
            return Err(TlsError::Failed(k));
        }
        if self.peer_closed {
            return Ok(()); // RFC 8446 §6.1: data after close_notify is ignored
        }
        self.inbound.extend_from_slice(data);
        let mut inbound = std::mem::take(&mut self.inbound);
        let result = self.process(&mut inbound);
        match result {
            Ok(consumed) => {
                inbound.drain(..consumed);
                if self.peer_closed {
                    inbound.clear();
                    self.hs_partial.clear();
                }
                self.inbound = inbound;
                Ok(())
            }
            Err(e) => {
                self.inbound = inbound;
                self.fail(&e);
                Err(e)
            }
        }
    }

    /// Seals `data` into application-data records (at most 2^14 bytes each)
    /// ready in `take_ciphertext_to_send`.
    pub fn write_plaintext(&mut self, data: &[u8]) -> Result<(), TlsError> {
        if let State::Failed(k) = self.state {
            return Err(TlsError::Failed(k));
        }
        if self.close_sent {
            return Err(TlsError::WriteAfterClose);
        }
        let result = match &mut self.state {
            State::Failed(k) => return Err(TlsError::Failed(k)),
            State::Handshaking(_) => return Err(TlsError::Handshaking),
            State::Traffic(t) => data.chunks(MAX_PLAINTEXT).try_for_each(|chunk| {
                rekey_if_due(t, &mut self.outbound)?;
                t.seal(&mut self.outbound, APPLICATION_DATA, chunk)
            }),
        };
        if let Err(e) = &result {
            self.fail(e);
        }
        result
    }

    /// Queues close_notify (once); no data can be written afterwards.
    pub fn send_close_notify(&mut self) {
        if self.close_sent {
            return;
        }
        self.close_sent = true;
        match &mut self.state {
            State::Traffic(t) => {
                let _ = t.seal(&mut self.outbound, ALERT, &[1, Alert::CloseNotify.code()]);
            }
            State::Handshaking(h) => {
                h.conn.send_close_notify();
                let _ = flush_rustls(&mut h.conn, &mut self.outbound);
            }
            State::Failed(_) => {}
        }
    }

    /// Marks the session failed and queues the alert for `e`, if any.
    fn fail(&mut self, e: &TlsError) {
        if let (State::Traffic(t), Some(alert)) = (&mut self.state, e.alert()) {
            if !self.close_sent {
                let _ = t.seal(&mut self.outbound, ALERT, &[2, alert.code()]);
            }
        }
        self.close_sent = true;
        self.state = State::Failed(e.kind());
    }

    /// Processes complete records at the start of `inbound`; returns how
    /// many bytes were consumed.
    fn process(&mut self, inbound: &mut [u8]) -> Result<usize, TlsError> {
        let mut pos = 0;
        loop {
            if self.peer_closed {
                return Ok(inbound.len());
            }
            let header = match RecordHeader::parse(&inbound[pos..]) {
                Ok(Some(h)) => h,
                Ok(None) => return Ok(pos),
                Err(e) => {
                    if let State::Handshaking(h) = &mut self.state {
                        // Let rustls judge (and alert on) the garbage itself.
                        return Err(
                            rustls_reject(h, &inbound[pos..], &mut self.outbound).unwrap_or(e)
                        );
                    }
                    return Err(e);
                }
            };
            let end = pos + header.record_len();
            if end > inbound.len() {
                return Ok(pos);
            }
            match &mut self.state {
                State::Failed(k) => return Err(TlsError::Failed(k)),
                State::Handshaking(h) => {
                    h.capture_hello(&inbound[pos..end]);
                    let mut rd = &inbound[pos..end];
                    while !rd.is_empty() {
                        match h.conn.read_tls(&mut rd) {
                            Ok(0) => return Err(TlsError::Decode("handshake record not accepted")),
                            Ok(_) => {}
                            Err(_) => return Err(TlsError::Decode("handshake buffer full")),
                        }
                    }
                    pos = end;
                    if let Err(e) = h.conn.process_new_packets() {
                        let _ = flush_rustls(&mut h.conn, &mut self.outbound);
                        return Err(TlsError::Handshake(e));
                    }
                    flush_rustls(&mut h.conn, &mut self.outbound)?;
                    if !h.conn.is_handshaking() {
                        self.finish_handshake()?;
                    }
                }
                State::Traffic(_) => {
                    self.open_record(header, &mut inbound[pos..end])?;
                    pos = end;
                }
            }
        }
    }

    /// The handshake is complete: take the record-layer state out of rustls.
    fn finish_handshake(&mut self) -> Result<(), TlsError> {
        let State::Handshaking(mut h) =
            std::mem::replace(&mut self.state, State::Failed("handshake"))
        else {
            return Ok(());
        };
        flush_rustls(&mut h.conn, &mut self.outbound)?;
        // We feed one record at a time, so rustls normally holds no
        // application data; keep any it decrypted.
        let mut buf = [0u8; 4096];
        loop {
            match h.conn.reader().read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => self.plaintext.extend_from_slice(&buf[..n]),
            }
        }
        let protocol = match h.conn.protocol_version() {
            Some(rustls::ProtocolVersion::TLSv1_3) => Protocol::Tls13,
            Some(rustls::ProtocolVersion::TLSv1_2) => Protocol::Tls12,
            other => return Err(TlsError::UnsupportedSuite(format!("{other:?}"))),
        };
        let suite_code = h
            .conn
            .negotiated_cipher_suite()
            .map(|s| u16::from(s.suite()))
            .ok_or(TlsError::UnsupportedSuite("no suite negotiated".into()))?;
        let random = h.client_random();
        let config = h.config.clone();
        #[allow(deprecated)]
        let secrets = h
            .conn
            .dangerous_extract_secrets()
            .map_err(TlsError::SecretExtraction)?;
        let (rx_seq, rx) = secrets.rx;
        let (tx_seq, tx) = secrets.tx;
        // Traffic secrets (KeyUpdate) exist only in TLS 1.3.
        let random = random.filter(|_| protocol == Protocol::Tls13);
        let rx = direction(rx, rx_seq, random.as_ref(), &config, true)?;
        let tx = direction(tx, tx_seq, random.as_ref(), &config, false)?;
        if Suite::from_code(protocol, suite_code) != Some(rx.suite) || rx.suite != tx.suite {
            return Err(TlsError::UnsupportedSuite(
                "different suites per direction".into(),
            ));
        }
        // KeyUpdate is honoured only when both secrets are known.
        let (mut rx, mut tx) = (rx, tx);
        if rx.secret.is_none() || tx.secret.is_none() {
            rx.secret = None;
            tx.secret = None;
        }
        self.state = State::Traffic(Box::new(Traffic {
            protocol,
            suite_code,
            rx,
            tx,
        }));
        config.handshakes.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Opens one complete protected record (`record` = header + body).
    fn open_record(&mut self, header: RecordHeader, record: &mut [u8]) -> Result<(), TlsError> {
        let State::Traffic(t) = &mut self.state else {
            return Err(TlsError::Failed("not in traffic state"));
        };
        let protocol = t.protocol;
        let (typ, range) = t.open(header, record)?;
        let content = &record[range];
        if content.len() > MAX_PLAINTEXT {
            return Err(TlsError::RecordOverflow {
                len: content.len(),
                limit: MAX_PLAINTEXT,
            });
        }
        match typ {
            APPLICATION_DATA => {
                if !self.hs_partial.is_empty() {
                    return Err(TlsError::UnexpectedMessage(
                        "application data inside a fragmented KeyUpdate",
                    ));
                }
                self.plaintext.extend_from_slice(content);
            }
            ALERT => {
                if !self.hs_partial.is_empty() {
                    return Err(TlsError::UnexpectedMessage(
                        "alert inside a fragmented KeyUpdate",
                    ));
                }
                let [level, description] = content else {
                    return Err(TlsError::Decode("alert record must hold exactly one alert"));
                };
                match (Alert::from_code(*description), protocol, level) {
                    (Alert::CloseNotify, _, _) => self.peer_closed = true,
                    (Alert::UserCanceled, _, _) => {} // a close_notify follows
                    // TLS 1.2 warnings other than close_notify do not end
                    // the connection (RFC 5246 §7.2).
                    (_, Protocol::Tls12, 1) => {}
                    (other, _, _) => return Err(TlsError::PeerAlert(other)),
                }
            }
            HANDSHAKE if protocol == Protocol::Tls12 => {
                return Err(TlsError::UnexpectedMessage(
                    "TLS 1.2 renegotiation is not supported",
                ));
            }
            HANDSHAKE => {
                if content.is_empty() {
                    return Err(TlsError::Decode("empty handshake record"));
                }
                for &b in content {
                    let at = self.hs_partial.len();
                    match (at, b) {
                        (0, KEY_UPDATE) | (1, 0) | (2, 0) | (3, 1) | (4, 0 | 1) => {
                            self.hs_partial.push(b)
                        }
                        (0, _) => {
                            return Err(TlsError::UnexpectedMessage(
                                "post-handshake message other than KeyUpdate",
                            ))
                        }
                        (1..=3, _) => return Err(TlsError::Decode("KeyUpdate length must be 1")),
                        (4, _) => return Err(TlsError::Decode("KeyUpdate request must be 0 or 1")),
                        _ => {
                            return Err(TlsError::UnexpectedMessage(
                                "data after KeyUpdate in the same record",
                            ))
                        }
                    }
                }
                if self.hs_partial.len() == 5 {
                    let requested = self.hs_partial[4] == 1;
                    // RFC 8446 §4.6.3: new receive keys from the next record;
                    // if asked, answer with our own KeyUpdate (not requesting
                    // one back) under the old send keys, then switch.
                    t.rx.update()?;
                    if requested && !self.close_sent {
                        t.seal(&mut self.outbound, HANDSHAKE, &[KEY_UPDATE, 0, 0, 1, 0])?;
                        t.tx.update()?;
                    }
                    // hs_partial is cleared only after a successful update:
                    // a KeyUpdate must end its record, which the byte check
                    // above enforces.
                    self.hs_partial.clear();
                }
            }
            _ => {
                return Err(TlsError::UnexpectedMessage(
                    "unknown protected content type",
                ))
            }
        }
        Ok(())
    }
}

/// Records sealed under one AES-GCM key before we rotate it with KeyUpdate.
pub(crate) const REKEY_AFTER_RECORDS: u64 = 1 << 24;
/// RFC 8446 §5.5: at most 2^24.5 records per AES-GCM key.
const AES_GCM_RECORD_LIMIT: u64 = 23_726_566;

/// Rotates our sending key before the AES-GCM usage limit (RFC 8446 §5.5):
/// KeyUpdate(update_not_requested) under the old key, then the new key.
/// TLS 1.2 cannot rotate (no renegotiation): it stops at the limit.
fn rekey_if_due(t: &mut Traffic, out: &mut Vec<u8>) -> Result<(), TlsError> {
    if t.tx.seq < REKEY_AFTER_RECORDS || t.tx.suite == Suite::Chacha20Poly1305Sha256 {
        return Ok(());
    }
    if t.tx.secret.is_some() {
        t.seal(out, HANDSHAKE, &[KEY_UPDATE, 0, 0, 1, 0])?;
        t.tx.update()
    } else if t.tx.seq >= AES_GCM_RECORD_LIMIT {
        Err(TlsError::SequenceExhausted)
    } else {
        Ok(())
    }
}

fn flush_rustls(conn: &mut ServerConnection, out: &mut Vec<u8>) -> Result<(), TlsError> {
    while conn.wants_write() {
        match conn.write_tls(out) {
            Ok(0) | Err(_) => return Err(TlsError::Failed("could not flush handshake output")),
            Ok(_) => {}
        }
    }
    Ok(())
}

/// Hands bytes our framing rejected to rustls so that it fails the
/// handshake with its own error and alert.
fn rustls_reject(h: &mut Handshake, bytes: &[u8], out: &mut Vec<u8>) -> Option<TlsError> {
    let mut rd = bytes;
    let _ = h.conn.read_tls(&mut rd);
    match h.conn.process_new_packets() {
        Err(e) => {
            let _ = flush_rustls(&mut h.conn, out);
            Some(TlsError::Handshake(e))
        }
        Ok(_) => None,
    }
}

fn direction(
    secrets: ConnectionTrafficSecrets,
    seq: u64,
    client_random: Option<&[u8; 32]>,
    config: &TlsConfig,
    client: bool,
) -> Result<DirectionKeys, TlsError> {
    let (suite, key, iv) = match &secrets {
        ConnectionTrafficSecrets::Aes128Gcm { key, iv } => {
            (Suite::Aes128GcmSha256, key.as_ref(), iv.as_ref())
        }
        ConnectionTrafficSecrets::Aes256Gcm { key, iv } => {
            (Suite::Aes256GcmSha384, key.as_ref(), iv.as_ref())
        }
        ConnectionTrafficSecrets::Chacha20Poly1305 { key, iv } => {
            (Suite::Chacha20Poly1305Sha256, key.as_ref(), iv.as_ref())
        }
        _ => return Err(TlsError::UnsupportedSuite("a suite without AEAD".into())),
    };
    // Take the logged traffic secret only if it provably belongs to this
    // session: it must derive exactly the key and IV rustls extracted.
    let secret = client_random.and_then(|r| {
        config.secrets.take(r, client, |s| {
            s.len == suite.secret_len() && {
                let (k, i) = derive_key_iv(suite, s.as_bytes());
                k[..suite.key_len()] == *key && i[..] == *iv
            }
        })
    });
    DirectionKeys::new(suite, key, iv, seq, secret).ok_or_else(|| {
        TlsError::UnsupportedSuite(format!("{suite:?} with unexpected key or IV length"))
    })
}

impl Write for TlsServer {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.write_plaintext(buf)
            .map(|()| buf.len())
            .map_err(|e| std::io::Error::other(e.to_string()))
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Test support: lets tests play the client with our own record layer
/// (to craft records rustls would never send). Not for production use.
#[doc(hidden)]
pub mod testing {
    use super::*;

    impl TlsServer {
        /// A session with the directions swapped: it seals what this session
        /// opens and opens what it seals, i.e. the client's record layer.
        #[doc(hidden)]
        pub fn testing_mirror(&self) -> Option<TlsServer> {
            let State::Traffic(t) = &self.state else {
                return None;
            };
            let copy = |d: &DirectionKeys| {
                DirectionKeys::new(d.suite, d.key(), &d.iv, d.seq, d.secret.clone())
            };
            Some(TlsServer::with_state(State::Traffic(Box::new(Traffic {
                protocol: t.protocol,
                suite_code: t.suite_code,
                rx: copy(&t.tx)?,
                tx: copy(&t.rx)?,
            }))))
        }

        /// Seals `content` as one record of inner type `typ` (any value,
        /// unchecked length) into the outgoing ciphertext.
        #[doc(hidden)]
        pub fn testing_seal_raw(&mut self, typ: u8, content: &[u8]) -> Result<(), TlsError> {
            let State::Traffic(t) = &mut self.state else {
                return Err(TlsError::Handshaking);
            };
            t.seal(&mut self.outbound, typ, content)
        }
    }
}
