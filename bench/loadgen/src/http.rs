//! Minimal HTTP/1.1 response-head parser for the load generator.
//!
//! Parses the status line and headers of one response at the start of a
//! buffer, without allocating. Only `Content-Length` framing is supported
//! (the test server and the Capybara sidecar both use it); a chunked or
//! unframed response is a bad response, as is anything malformed.

/// Largest response head accepted.
pub const MAX_HEAD: usize = 8192;

/// A parsed response head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResponseHead {
    /// Bytes of status line and headers including the final CRLFCRLF.
    pub head_len: usize,
    pub status: u16,
    pub content_length: usize,
    /// Byte range (within the parsed buffer) of the server-id header value.
    pub server: Option<(usize, usize)>,
    /// The server announced `Connection: close`.
    pub close: bool,
}

/// Why a response could not be parsed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParseError {
    HeadTooLarge,
    BadStatusLine,
    BadVersion,
    BadStatusCode,
    BadHeader,
    BadContentLength,
    ConflictingContentLength,
    MissingContentLength,
    ChunkedUnsupported,
}

impl ParseError {
    pub fn as_str(&self) -> &'static str {
        match self {
            ParseError::HeadTooLarge => "head too large",
            ParseError::BadStatusLine => "malformed status line",
            ParseError::BadVersion => "unsupported HTTP version",
            ParseError::BadStatusCode => "malformed status code",
            ParseError::BadHeader => "malformed header line",
            ParseError::BadContentLength => "invalid content-length",
            ParseError::ConflictingContentLength => "conflicting content-length headers",
            ParseError::MissingContentLength => "missing content-length",
            ParseError::ChunkedUnsupported => "transfer-encoding not supported",
        }
    }
}

impl std::fmt::Display for ParseError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[inline]
fn find_head_end(buf: &[u8]) -> Option<usize> {
    // Search for "\r\n\r\n" by jumping between '\n' bytes.
    let mut i = 3;
    while i < buf.len() {
        if buf[i] == b'\n' {
            if buf[i - 1] == b'\r' && buf[i - 2] == b'\n' && buf[i - 3] == b'\r' {
                return Some(i + 1);
            }
            i += 2;
        } else if buf[i] == b'\r' {
            i += 1;
        } else {
            i += 4;
        }
    }
    None
}

/// Parse one response head at the start of `buf`; `server_header` is the
/// lower-case name of the server-id header (e.g. `x-server`). `Ok(None)`:
/// the head is not complete yet.
pub fn parse_response_head(
    buf: &[u8],
    server_header: &[u8],
) -> Result<Option<ResponseHead>, ParseError> {
    let Some(head_len) = find_head_end(buf) else {
        if buf.len() >= MAX_HEAD {
            return Err(ParseError::HeadTooLarge);
        }
        // Fail fast on garbage instead of waiting for a full head.
        let n = buf.len().min(5);
        if buf[..n] != b"HTTP/"[..n] {
            return Err(ParseError::BadStatusLine);
        }
        return Ok(None);
    };
    if head_len > MAX_HEAD {
        return Err(ParseError::HeadTooLarge);
    }
    let head = &buf[..head_len - 2]; // keep the CRLF ending the last header line
    let line_end = head
        .iter()
        .position(|&b| b == b'\n')
        .ok_or(ParseError::BadStatusLine)?;
    if line_end == 0 || head[line_end - 1] != b'\r' {
        return Err(ParseError::BadStatusLine);
    }
    let line = &head[..line_end - 1];
    // "HTTP/1.1 200 OK" (reason phrase optional).
    if line.len() < 12 || &line[..5] != b"HTTP/" {
        return Err(ParseError::BadStatusLine);
    }
    match &line[5..8] {
        b"1.1" | b"1.0" => {}
        _ => return Err(ParseError::BadVersion),
    }
    if line[8] != b' ' {
        return Err(ParseError::BadStatusLine);
    }
    let code = &line[9..12];
    if !code.iter().all(u8::is_ascii_digit)
        || code[0] == b'0'
        || (line.len() > 12 && line[12] != b' ')
    {
        return Err(ParseError::BadStatusCode);
    }
    let status = code.iter().fold(0u16, |a, &d| a * 10 + (d - b'0') as u16);
    let http10 = &line[5..8] == b"1.0";

    let mut content_length: Option<usize> = None;
    let mut server = None;
    let mut close = http10;
    let mut pos = line_end + 1;
    while pos < head.len() {
        let rel = head[pos..]
            .iter()
            .position(|&b| b == b'\n')
            .ok_or(ParseError::BadHeader)?;
        let end = pos + rel;
        if rel == 0 || head[end - 1] != b'\r' {
            return Err(ParseError::BadHeader);
        }
        let l = &head[pos..end - 1];
        pos = end + 1;
        if l.is_empty() {
            break;
        }
        let colon = l
            .iter()
            .position(|&b| b == b':')
            .ok_or(ParseError::BadHeader)?;
        let name = &l[..colon];
        if name.is_empty() || name.iter().any(|&b| b <= b' ' || b >= 0x7f) {
            return Err(ParseError::BadHeader);
        }
        let (vs, ve) = trim_range(l, colon + 1);
        let value = &l[vs..ve];
        if name.eq_ignore_ascii_case(b"content-length") {
            let v = parse_len(value).ok_or(ParseError::BadContentLength)?;
            if content_length.is_some_and(|c| c != v) {
                return Err(ParseError::ConflictingContentLength);
            }
            content_length = Some(v);
        } else if name.eq_ignore_ascii_case(b"transfer-encoding") {
            return Err(ParseError::ChunkedUnsupported);
        } else if name.eq_ignore_ascii_case(server_header) {
            let base = end - 1 - l.len();
            server = Some((base + vs, base + ve));
        } else if name.eq_ignore_ascii_case(b"connection") {
            if value.eq_ignore_ascii_case(b"close") {
                close = true;
            } else if value.eq_ignore_ascii_case(b"keep-alive") {
                close = false;
            }
        }
    }
    // 1xx, 204 and 304 carry no body; everything else must be framed.
    let bodyless = (100..200).contains(&status) || status == 204 || status == 304;
    let content_length = match content_length {
        Some(c) => c,
        None if bodyless => 0,
        None => return Err(ParseError::MissingContentLength),
    };
    Ok(Some(ResponseHead {
        head_len,
        status,
        content_length,
        server,
        close,
    }))
}

fn trim_range(l: &[u8], mut s: usize) -> (usize, usize) {
    let mut e = l.len();
    while s < e && (l[s] == b' ' || l[s] == b'\t') {
        s += 1;
    }
    while e > s && (l[e - 1] == b' ' || l[e - 1] == b'\t') {
        e -= 1;
    }
    (s, e)
}

fn parse_len(v: &[u8]) -> Option<usize> {
    if v.is_empty() || v.len() > 15 || !v.iter().all(u8::is_ascii_digit) {
        return None;
    }
    Some(v.iter().fold(0usize, |a, &d| a * 10 + (d - b'0') as usize))
}

/// What [`ResponseReader::poll`] produced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// A complete response (head and whole body).
    Response {
        status: u16,
        body_len: usize,
        server: Option<u16>,
        close: bool,
    },
    /// More bytes are needed.
    NeedMore,
}

/// Incremental reader of a stream of responses on one connection: owns a
/// fixed receive buffer (no allocation after construction), skips bodies
/// without buffering them, and maps server ids to small integers through
/// the caller's interner.
pub struct ResponseReader {
    buf: Box<[u8]>,
    start: usize,
    end: usize,
    body_left: usize,
    pending: Option<(u16, usize, Option<u16>, bool)>,
}

impl ResponseReader {
    pub fn new(capacity: usize) -> ResponseReader {
        ResponseReader {
            buf: vec![0u8; capacity.max(2 * MAX_HEAD)].into_boxed_slice(),
            start: 0,
            end: 0,
            body_left: 0,
            pending: None,
        }
    }

    /// Forget any partial response (after a reconnect).
    pub fn reset(&mut self) {
        self.start = 0;
        self.end = 0;
        self.body_left = 0;
        self.pending = None;
    }

    /// Free space to read into; call [`ResponseReader::filled`] after.
    pub fn spare(&mut self) -> &mut [u8] {
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        } else if self.start > 0 && self.buf.len() - self.end < MAX_HEAD {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        &mut self.buf[self.end..]
    }

    pub fn filled(&mut self, n: usize) {
        self.end += n;
    }

    /// Next complete response, if any. `intern` maps a server-id header
    /// value to a small index.
    pub fn poll(
        &mut self,
        server_header: &[u8],
        intern: &mut dyn FnMut(&[u8]) -> u16,
    ) -> Result<Event, ParseError> {
        loop {
            if let Some((status, len, server, close)) = self.pending {
                let n = self.body_left.min(self.end - self.start);
                self.start += n;
                self.body_left -= n;
                if self.body_left > 0 {
                    return Ok(Event::NeedMore);
                }
                self.pending = None;
                return Ok(Event::Response {
                    status,
                    body_len: len,
                    server,
                    close,
                });
            }
            let avail = &self.buf[self.start..self.end];
            if avail.is_empty() {
                return Ok(Event::NeedMore);
            }
            match parse_response_head(avail, server_header)? {
                None => return Ok(Event::NeedMore),
                Some(h) => {
                    let server = h.server.map(|(s, e)| intern(&avail[s..e]));
                    self.start += h.head_len;
                    self.body_left = h.content_length;
                    self.pending = Some((h.status, h.content_length, server, h.close));
                }
            }
        }
    }

    /// Bytes received but not consumed by a complete response.
    pub fn buffered(&self) -> usize {
        self.end - self.start
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SH: &[u8] = b"x-server";

    fn ok(buf: &[u8]) -> ResponseHead {
        parse_response_head(buf, SH).unwrap().unwrap()
    }

    #[test]
    fn parses_valid_responses() {
        let r = b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\nx-server: s1\r\n\r\nhello";
        let h = ok(r);
        assert_eq!((h.status, h.content_length, h.close), (200, 5, false));
        assert_eq!(h.head_len, r.len() - 5);
        let (s, e) = h.server.unwrap();
        assert_eq!(&r[s..e], b"s1");
        let h = ok(b"HTTP/1.1 503\r\nContent-Length:0\r\nConnection: close\r\n\r\n");
        assert_eq!((h.status, h.content_length, h.close), (503, 0, true));
        assert_eq!(ok(b"HTTP/1.1 204 No Content\r\n\r\n").content_length, 0);
        let r = b"HTTP/1.1 200 OK\r\nX-Server:  \tb \r\nContent-Length: 1\r\n\r\n";
        let (s, e) = ok(r).server.unwrap();
        assert_eq!(&r[s..e], b"b");
        assert!(ok(b"HTTP/1.0 200 OK\r\nContent-Length: 1\r\n\r\n").close);
    }

    #[test]
    fn incomplete_heads_need_more() {
        let full = b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n";
        for cut in 0..full.len() {
            assert_eq!(
                parse_response_head(&full[..cut], SH),
                Ok(None),
                "cut at {cut}"
            );
        }
    }

    #[test]
    fn rejects_malformed_responses() {
        use ParseError::*;
        let cases: &[(&[u8], ParseError)] = &[
            (b"HTTP/1.1 200 OK\r\n\r\n", MissingContentLength),
            (
                b"HTTP/1.1 200 OK\r\ncontent-length: abc\r\n\r\n",
                BadContentLength,
            ),
            (
                b"HTTP/1.1 200 OK\r\ncontent-length: -1\r\n\r\n",
                BadContentLength,
            ),
            (
                b"HTTP/1.1 200 OK\r\ncontent-length: \r\n\r\n",
                BadContentLength,
            ),
            (
                b"HTTP/1.1 200 OK\r\ncontent-length: 99999999999999999999\r\n\r\n",
                BadContentLength,
            ),
            (
                b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\n",
                ConflictingContentLength,
            ),
            (
                b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n",
                ChunkedUnsupported,
            ),
            (b"HTTP/2.0 200 OK\r\ncontent-length: 0\r\n\r\n", BadVersion),
            (
                b"HTTP/1.1 2x0 OK\r\ncontent-length: 0\r\n\r\n",
                BadStatusCode,
            ),
            (
                b"HTTP/1.1 2000 OK\r\ncontent-length: 0\r\n\r\n",
                BadStatusCode,
            ),
            (
                b"HTTP/1.1 020 OK\r\ncontent-length: 0\r\n\r\n",
                BadStatusCode,
            ),
            (
                b"HTTP/1.1  200 OK\r\ncontent-length: 0\r\n\r\n",
                BadStatusCode,
            ),
            (b"HTTP/1.1 200 OK\r\nno-colon-here\r\n\r\n", BadHeader),
            (b"HTTP/1.1 200 OK\r\n: empty name\r\n\r\n", BadHeader),
            (b"HTTP/1.1 200 OK\r\nbad name: x\r\n\r\n", BadHeader),
            (b"HTTP/1.1 200 OK\nx: y\r\n\r\n", BadStatusLine),
            (b"HTTP/1.1 200 OK\r\nx: y\n\r\n\r\n", BadHeader),
            (b"SSH-2.0-OpenSSH\r\n", BadStatusLine),
            (b"garbage", BadStatusLine),
            (b"HTTP/1.1\r\n\r\n", BadStatusLine),
        ];
        for (buf, want) in cases {
            assert_eq!(
                parse_response_head(buf, SH),
                Err(*want),
                "{:?}",
                String::from_utf8_lossy(buf)
            );
        }
        let mut big = b"HTTP/1.1 200 OK\r\nx: ".to_vec();
        big.resize(MAX_HEAD + 10, b'a');
        assert_eq!(parse_response_head(&big, SH), Err(HeadTooLarge));
    }

    #[test]
    fn reader_frames_pipelined_responses_across_reads() {
        let one = b"HTTP/1.1 200 OK\r\ncontent-length: 300\r\nx-server: s2\r\n\r\n";
        let mut stream = Vec::new();
        for _ in 0..50 {
            stream.extend_from_slice(one);
            stream.extend_from_slice(&[b'z'; 300]);
        }
        let mut rd = ResponseReader::new(16 * 1024);
        let mut names: Vec<Vec<u8>> = Vec::new();
        let mut intern = |v: &[u8]| -> u16 {
            if let Some(i) = names.iter().position(|n| n == v) {
                return i as u16;
            }
            names.push(v.to_vec());
            (names.len() - 1) as u16
        };
        let mut got = 0;
        // Feed in awkward chunk sizes.
        for chunk in stream.chunks(37) {
            let spare = rd.spare();
            spare[..chunk.len()].copy_from_slice(chunk);
            rd.filled(chunk.len());
            while let Event::Response {
                status,
                body_len,
                server,
                close,
            } = rd.poll(b"x-server", &mut intern).unwrap()
            {
                assert_eq!(
                    (status, body_len, server, close),
                    (200, 300, Some(0), false)
                );
                got += 1;
            }
        }
        assert_eq!(got, 50);
        assert_eq!(rd.buffered(), 0);
        // Garbage after a valid response is reported.
        let spare = rd.spare();
        spare[..5].copy_from_slice(b"HTTP?");
        rd.filled(5);
        assert_eq!(
            rd.poll(b"x-server", &mut intern),
            Err(ParseError::BadStatusLine)
        );
    }
}
