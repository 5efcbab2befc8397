//! HTTP/1.1 framing for the sidecar: where each client request ends
//! (untrusted bytes), and where each application response ends (so the
//! manager knows when every forwarded request has been answered).
//!
//! Requests: a head (request line and headers, at most
//! [`MAX_HEAD`] bytes and [`MAX_HEADERS`] headers) and a body framed by
//! `Transfer-Encoding: chunked` or `Content-Length` (RFC 9112 §6). A request
//! with both, with a bad length, or with a transfer coding other than a
//! final `chunked` is malformed (they are the request-smuggling cases).
//! No framing function panics on any input.

use std::collections::VecDeque;

/// Largest request or response head accepted.
pub const MAX_HEAD: usize = 64 * 1024;
/// Most header fields in one head.
pub const MAX_HEADERS: usize = 100;

/// Why a client's bytes are not a valid request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    #[error("malformed request: {0}")]
    Malformed(String),
    #[error("request head larger than {MAX_HEAD} bytes or more than {MAX_HEADERS} headers")]
    HeadTooLarge,
    #[error("request larger than {0} bytes")]
    TooLarge(usize),
}

impl RequestError {
    /// The response the sidecar sends before closing the connection.
    pub fn response(&self) -> Vec<u8> {
        let (status, reason) = match self {
            RequestError::Malformed(_) => (400, "Bad Request"),
            RequestError::HeadTooLarge => (431, "Request Header Fields Too Large"),
            RequestError::TooLarge(_) => (413, "Content Too Large"),
        };
        error_response(status, reason, &format!("sidecar: {self}\n"))
    }
}

/// A complete response with `Connection: close`.
pub fn error_response(status: u16, reason: &str, body: &str) -> Vec<u8> {
    format!(
        "HTTP/1.1 {status} {reason}\r\ncontent-type: text/plain\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// A complete request at the start of a buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// Bytes of head and body.
    pub len: usize,
    /// HEAD: the response has no body whatever its headers say.
    pub head_method: bool,
    /// CONNECT or an `Upgrade` request: the connection may leave HTTP.
    pub upgrade: bool,
}

/// The interim response a client that sent `Expect: 100-continue` waits
/// for before sending the body.
pub const CONTINUE: &[u8] = b"HTTP/1.1 100 Continue\r\n\r\n";

/// Whether `buf` starts with the complete head of an HTTP/1.1 request
/// that has a body and `Expect: 100-continue` (RFC 9110 §10.1.1): its
/// client may wait for `100 Continue` before sending the body. Call it for
/// a request [`parse_request`] found incomplete.
pub fn expects_continue(buf: &[u8]) -> bool {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut headers);
    if !matches!(req.parse(buf), Ok(httparse::Status::Complete(_))) || req.version != Some(1) {
        return false;
    }
    let mut expect = false;
    let mut body = false;
    for h in req.headers.iter() {
        if h.name.eq_ignore_ascii_case("expect") {
            expect = h.value.trim_ascii().eq_ignore_ascii_case(b"100-continue");
        } else if h.name.eq_ignore_ascii_case("transfer-encoding") {
            body = true;
        } else if h.name.eq_ignore_ascii_case("content-length") {
            body |= parse_length(h.value).is_some_and(|n| n > 0);
        }
    }
    expect && body
}

/// Where the first request in `buf` ends: `Ok(None)` while incomplete.
/// `max_request` bounds head plus body.
pub fn parse_request(buf: &[u8], max_request: usize) -> Result<Option<Request>, RequestError> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut headers);
    let head_len = match req.parse(buf) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => {
            if buf.len() > MAX_HEAD {
                return Err(RequestError::HeadTooLarge);
            }
            return Ok(None);
        }
        Err(httparse::Error::TooManyHeaders) => return Err(RequestError::HeadTooLarge),
        Err(e) => return Err(RequestError::Malformed(e.to_string())),
    };
    if head_len > MAX_HEAD {
        return Err(RequestError::HeadTooLarge);
    }
    let method = req.method.unwrap_or("");
    let mut body = Body::None;
    let mut upgrade = method.eq_ignore_ascii_case("CONNECT");
    for h in req.headers.iter() {
        if h.name.eq_ignore_ascii_case("content-length") {
            let n = parse_length(h.value)
                .ok_or_else(|| RequestError::Malformed("bad content-length".into()))?;
            body = match body {
                Body::None => Body::Length(n),
                Body::Length(m) if m == n => Body::Length(n),
                _ => {
                    return Err(RequestError::Malformed(
                        "conflicting content-length / transfer-encoding".into(),
                    ))
                }
            };
        } else if h.name.eq_ignore_ascii_case("transfer-encoding") {
            if !matches!(body, Body::None) || !final_chunked(h.value) {
                return Err(RequestError::Malformed(
                    "unsupported or conflicting transfer-encoding".into(),
                ));
            }
            body = Body::Chunked;
        } else if h.name.eq_ignore_ascii_case("upgrade") {
            upgrade = true;
        }
    }
    let total = match body {
        Body::None => Some(head_len),
        Body::Length(n) => {
            let total = head_len.saturating_add(usize::try_from(n).unwrap_or(usize::MAX));
            if total > max_request {
                return Err(RequestError::TooLarge(max_request));
            }
            (buf.len() >= total).then_some(total)
        }
        Body::Chunked => {
            let mut c = Chunked::default();
            let rest = &buf[head_len..];
            match c.feed(rest) {
                Ok(Some(n)) => Some(head_len + n),
                Ok(None) => None,
                Err(e) => return Err(RequestError::Malformed(e.into())),
            }
        }
    };
    match total {
        Some(len) if len > max_request => Err(RequestError::TooLarge(max_request)),
        Some(len) => Ok(Some(Request {
            len,
            head_method: method.eq_ignore_ascii_case("HEAD"),
            upgrade,
        })),
        None if buf.len() > max_request => Err(RequestError::TooLarge(max_request)),
        None => Ok(None),
    }
}

enum Body {
    None,
    Length(u64),
    Chunked,
}

fn parse_length(v: &[u8]) -> Option<u64> {
    let s = std::str::from_utf8(v).ok()?.trim();
    if s.is_empty() || s.len() > 18 || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok()
}

fn final_chunked(v: &[u8]) -> bool {
    std::str::from_utf8(v)
        .ok()
        .and_then(|s| s.rsplit(',').next())
        .is_some_and(|last| last.trim().eq_ignore_ascii_case("chunked"))
        && std::str::from_utf8(v)
            .map(|s| s.split(',').count() == 1)
            .unwrap_or(false)
}

/// Incremental chunked-body scanner (RFC 9112 §7.1): consumes bytes and
/// says where the body (with its trailer section) ends.
#[derive(Debug, Clone, Default)]
pub struct Chunked {
    state: ChunkState,
    /// Bytes of the current size or trailer line seen so far.
    line: usize,
    size: u64,
    digits: bool,
    in_ext: bool,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
enum ChunkState {
    #[default]
    Size,
    SizeLf,
    Data(u64),
    DataCr,
    DataLf,
    Trailer,
    TrailerLf,
    Done,
}

const MAX_CHUNK_LINE: usize = 4096;

impl Chunked {
    /// Consumes `bytes`; returns how many of them complete the body, or
    /// `None` if all were consumed and the body goes on.
    pub fn feed(&mut self, bytes: &[u8]) -> Result<Option<usize>, &'static str> {
        let mut i = 0;
        while i < bytes.len() {
            let b = bytes[i];
            match self.state {
                ChunkState::Size => {
                    self.line += 1;
                    if self.line > MAX_CHUNK_LINE {
                        return Err("chunk size line too long");
                    }
                    match b {
                        b'\r' => self.state = ChunkState::SizeLf,
                        _ if self.in_ext => {}
                        b';' | b' ' | b'\t' => self.in_ext = true,
                        _ => {
                            let d = (b as char).to_digit(16).ok_or("bad chunk size")?;
                            if self.size >> 56 != 0 {
                                return Err("chunk size too large");
                            }
                            self.size = self.size * 16 + u64::from(d);
                            self.digits = true;
                        }
                    }
                }
                ChunkState::SizeLf => {
                    if b != b'\n' || !self.digits {
                        return Err("bad chunk size line");
                    }
                    self.state = if self.size == 0 {
                        self.line = 0;
                        ChunkState::Trailer
                    } else {
                        ChunkState::Data(self.size)
                    };
                }
                ChunkState::Data(n) => {
                    let take = (bytes.len() - i).min(usize::try_from(n).unwrap_or(usize::MAX));
                    let left = n - take as u64;
                    i += take;
                    self.state = if left == 0 {
                        ChunkState::DataCr
                    } else {
                        ChunkState::Data(left)
                    };
                    continue;
                }
                ChunkState::DataCr => {
                    if b != b'\r' {
                        return Err("chunk data not followed by CRLF");
                    }
                    self.state = ChunkState::DataLf;
                }
                ChunkState::DataLf => {
                    if b != b'\n' {
                        return Err("chunk data not followed by CRLF");
                    }
                    *self = Chunked::default();
                }
                ChunkState::Trailer => {
                    if b == b'\r' {
                        self.state = ChunkState::TrailerLf;
                    } else {
                        self.line += 1;
                        if self.line > MAX_HEAD {
                            return Err("trailer section too large");
                        }
                    }
                }
                ChunkState::TrailerLf => {
                    if b != b'\n' {
                        return Err("bad trailer line");
                    }
                    if self.line == 0 {
                        self.state = ChunkState::Done;
                        return Ok(Some(i + 1));
                    }
                    self.line = 0;
                    self.state = ChunkState::Trailer;
                }
                ChunkState::Done => return Ok(Some(i)),
            }
            i += 1;
        }
        Ok(None)
    }
}

/// Follows the application's response stream and counts complete
/// responses. It sees every byte exactly once, in order, without keeping
/// more than a response head.
#[derive(Debug, Default)]
pub struct ResponseTracker {
    /// Per forwarded request, whether it was a HEAD (the response has no body).
    expect_head: VecDeque<bool>,
    head: Vec<u8>,
    body: RespBody,
    /// The application switched protocols (101): framing ends here.
    pub upgraded: bool,
}

#[derive(Debug, Default)]
enum RespBody {
    /// Reading a head.
    #[default]
    Head,
    Length(u64),
    Chunked(Chunked),
    /// Body delimited by the application closing the connection.
    UntilClose,
}

impl ResponseTracker {
    /// A request was forwarded to the application.
    pub fn expect(&mut self, head_method: bool) {
        self.expect_head.push_back(head_method);
    }

    /// Requests forwarded and not completely answered.
    pub fn outstanding(&self) -> usize {
        self.expect_head.len()
    }

    /// Between two responses (no response partially relayed).
    pub fn at_boundary(&self) -> bool {
        matches!(self.body, RespBody::Head) && self.head.is_empty() && !self.upgraded
    }

    /// Observes response bytes; returns how many responses completed, or an
    /// error if the application's output is not HTTP.
    pub fn observe(&mut self, mut bytes: &[u8]) -> Result<usize, String> {
        let mut done = 0;
        while !bytes.is_empty() && !self.upgraded {
            match &mut self.body {
                RespBody::Head => {
                    // Only the head's bytes are kept, and only until parsed.
                    let start = self.head.len();
                    self.head.extend_from_slice(bytes);
                    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
                    let mut r = httparse::Response::new(&mut headers);
                    match r.parse(&self.head) {
                        Ok(httparse::Status::Partial) => {
                            if self.head.len() > MAX_HEAD {
                                return Err("response head too large".into());
                            }
                            return Ok(done);
                        }
                        Err(e) => return Err(format!("malformed response: {e}")),
                        Ok(httparse::Status::Complete(n)) => {
                            let code = r.code.unwrap_or(0);
                            let mut body = RespBody::UntilClose;
                            let mut length = None;
                            let mut chunked = false;
                            for h in r.headers.iter() {
                                if h.name.eq_ignore_ascii_case("content-length") {
                                    length = parse_length(h.value);
                                } else if h.name.eq_ignore_ascii_case("transfer-encoding") {
                                    chunked = final_chunked(h.value);
                                }
                            }
                            if chunked {
                                body = RespBody::Chunked(Chunked::default());
                            } else if let Some(n) = length {
                                body = RespBody::Length(n);
                            }
                            let consumed = n - start;
                            bytes = &bytes[consumed..];
                            self.head.clear();
                            if code == 101 {
                                self.upgraded = true;
                                self.expect_head.pop_front();
                                return Ok(done + 1);
                            }
                            if (100..200).contains(&code) {
                                continue; // interim response
                            }
                            let is_head = self.expect_head.front().copied().unwrap_or(false);
                            if is_head || code == 204 || code == 304 {
                                body = RespBody::Length(0);
                            }
                            self.body = body;
                            if let RespBody::Length(0) = self.body {
                                self.body = RespBody::Head;
                                self.expect_head.pop_front();
                                done += 1;
                            }
                        }
                    }
                }
                RespBody::Length(n) => {
                    let take = (bytes.len() as u64).min(*n);
                    *n -= take;
                    bytes = &bytes[take as usize..];
                    if *n == 0 {
                        self.body = RespBody::Head;
                        self.expect_head.pop_front();
                        done += 1;
                    }
                }
                RespBody::Chunked(c) => match c.feed(bytes)? {
                    Some(n) => {
                        bytes = &bytes[n..];
                        self.body = RespBody::Head;
                        self.expect_head.pop_front();
                        done += 1;
                    }
                    None => bytes = &[],
                },
                RespBody::UntilClose => bytes = &[],
            }
        }
        Ok(done)
    }

    /// The application closed its side: a body delimited by the close is
    /// complete. Returns how many responses that completed.
    pub fn app_closed(&mut self) -> usize {
        if let RespBody::UntilClose = self.body {
            self.body = RespBody::Head;
            self.expect_head.pop_front();
            1
        } else {
            0
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn expect_100_continue_is_recognised_on_a_complete_head_with_a_body() {
        let r = |t: &str| expects_continue(t.as_bytes());
        assert!(r(
            "PUT / HTTP/1.1\r\nContent-Length: 9\r\nExpect: 100-continue\r\n\r\n"
        ));
        assert!(r("POST / HTTP/1.1\r\nexpect:  100-Continue \r\nTransfer-Encoding: chunked\r\n\r\n3\r\nab"));
        // Head not complete yet, no body, HTTP/1.0, another expectation,
        // no expectation.
        assert!(!r(
            "PUT / HTTP/1.1\r\nContent-Length: 9\r\nExpect: 100-continue\r\n"
        ));
        assert!(!r("GET / HTTP/1.1\r\nExpect: 100-continue\r\n\r\n"));
        assert!(!r(
            "PUT / HTTP/1.1\r\nContent-Length: 0\r\nExpect: 100-continue\r\n\r\n"
        ));
        assert!(!r(
            "PUT / HTTP/1.0\r\nContent-Length: 9\r\nExpect: 100-continue\r\n\r\n"
        ));
        assert!(!r(
            "PUT / HTTP/1.1\r\nContent-Length: 9\r\nExpect: something\r\n\r\n"
        ));
        assert!(!r("PUT / HTTP/1.1\r\nContent-Length: 9\r\n\r\n"));
        assert!(!r("\x00\x01garbage"));
    }

    use super::*;
    use proptest::prelude::*;

    const MAX: usize = 1 << 20;

    #[test]
    fn frames_pipelined_requests() {
        let a = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n";
        let b = b"POST /p HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello";
        let c = b"PUT /c HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n5;x=y\r\nhello\r\n0\r\nT: 1\r\n\r\n";
        let mut all = Vec::new();
        all.extend_from_slice(a);
        all.extend_from_slice(b);
        all.extend_from_slice(c);
        let mut off = 0;
        for want in [a.len(), b.len(), c.len()] {
            let r = parse_request(&all[off..], MAX).unwrap().unwrap();
            assert_eq!(r.len, want);
            off += r.len;
        }
        assert_eq!(off, all.len());
        // Every strict prefix of a request is incomplete, never an error.
        for cut in 0..c.len() {
            assert_eq!(parse_request(&c[..cut], MAX), Ok(None), "cut {cut}");
        }
    }

    #[test]
    fn rejects_smuggling_and_oversize() {
        let both = b"POST / HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n";
        assert!(matches!(
            parse_request(both, MAX),
            Err(RequestError::Malformed(_))
        ));
        let two = b"POST / HTTP/1.1\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\n";
        assert!(matches!(
            parse_request(two, MAX),
            Err(RequestError::Malformed(_))
        ));
        let gz = b"POST / HTTP/1.1\r\nTransfer-Encoding: gzip, chunked\r\n\r\n";
        assert!(matches!(
            parse_request(gz, MAX),
            Err(RequestError::Malformed(_))
        ));
        let big = b"POST / HTTP/1.1\r\nContent-Length: 99999999\r\n\r\n";
        assert_eq!(parse_request(big, MAX), Err(RequestError::TooLarge(MAX)));
        let long = vec![b'a'; MAX_HEAD + 10];
        assert!(parse_request(&long, MAX).is_err());
        assert!(String::from_utf8(RequestError::TooLarge(MAX).response())
            .unwrap()
            .starts_with("HTTP/1.1 413"));
    }

    #[test]
    fn tracks_responses_split_anywhere() {
        let stream: &[u8] =
            b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nabc\
HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n\
HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n\
HTTP/1.1 204 No Content\r\n\r\n";
        for cut in 0..stream.len() {
            let mut t = ResponseTracker::default();
            for head in [false, false, true, false] {
                t.expect(head);
            }
            let n = t.observe(&stream[..cut]).unwrap() + t.observe(&stream[cut..]).unwrap();
            assert_eq!(n, 4, "cut {cut}");
            assert!(t.at_boundary());
            assert_eq!(t.outstanding(), 0);
        }
    }

    proptest! {
        #[test]
        fn request_parser_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = parse_request(&bytes, 256);
        }

        #[test]
        fn response_tracker_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let mut t = ResponseTracker::default();
            t.expect(false);
            let _ = t.observe(&bytes);
            let _ = t.app_closed();
        }

        #[test]
        fn chunked_bodies_frame_exactly(chunks in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 1..40), 0..6)) {
            let mut body = Vec::new();
            for c in &chunks {
                body.extend_from_slice(format!("{:x}\r\n", c.len()).as_bytes());
                body.extend_from_slice(c);
                body.extend_from_slice(b"\r\n");
            }
            body.extend_from_slice(b"0\r\n\r\n");
            let mut req = b"POST / HTTP/1.1\r\ntransfer-encoding: chunked\r\n\r\n".to_vec();
            req.extend_from_slice(&body);
            let total = req.len();
            req.extend_from_slice(b"GET / HTTP/1.1\r\n\r\n");
            let r = parse_request(&req, MAX).unwrap().unwrap();
            prop_assert_eq!(r.len, total);
        }
    }
}
