//! RESP (Redis serialization protocol) framing for the sidecar: where each
//! client command ends (untrusted bytes: arrays of bulk strings, or inline
//! commands), and where each server reply ends (RESP2 and RESP3 types), so
//! the manager knows when every forwarded command has been answered.
//!
//! No function here panics on any input.

/// Most arguments in one command.
pub const MAX_ARGS: usize = 1 << 20;
/// Longest inline command or type line.
pub const MAX_LINE: usize = 64 * 1024;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CommandError {
    #[error("Protocol error: {0}")]
    Malformed(&'static str),
    #[error("command larger than {0} bytes")]
    TooLarge(usize),
}

impl CommandError {
    /// The error reply the sidecar sends before closing the connection.
    pub fn reply(&self) -> Vec<u8> {
        format!("-ERR sidecar: {self}\r\n").into_bytes()
    }
}

/// A complete command at the start of a buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Command {
    pub len: usize,
    /// The command name, upper-cased (at most 16 bytes kept).
    pub name: String,
    /// The first argument, if short (SELECT's index, CLIENT's subcommand).
    pub arg1: Option<String>,
}

fn line(buf: &[u8], from: usize) -> Result<Option<(usize, &[u8])>, CommandError> {
    // Returns (index after CRLF, line without CRLF).
    let rest = &buf[from.min(buf.len())..];
    match rest.iter().position(|&b| b == b'\n') {
        Some(p) if p > 0 && rest[p - 1] == b'\r' => Ok(Some((from + p + 1, &rest[..p - 1]))),
        Some(_) => Err(CommandError::Malformed("line not terminated by CRLF")),
        None if rest.len() > MAX_LINE => Err(CommandError::Malformed("line too long")),
        None => Ok(None),
    }
}

fn int(s: &[u8]) -> Option<i64> {
    let s = std::str::from_utf8(s).ok()?;
    if s.is_empty() || s.len() > 19 {
        return None;
    }
    s.parse().ok()
}

fn short(b: &[u8]) -> Option<String> {
    (b.len() <= 16).then(|| String::from_utf8_lossy(b).to_ascii_uppercase())
}

/// Where the first command in `buf` ends: `Ok(None)` while incomplete.
pub fn parse_command(buf: &[u8], max_request: usize) -> Result<Option<Command>, CommandError> {
    let Some(&first) = buf.first() else {
        return Ok(None);
    };
    if first != b'*' {
        // Inline command: one line, arguments separated by spaces.
        let Some(p) = buf.iter().position(|&b| b == b'\n') else {
            if buf.len() > MAX_LINE.min(max_request) {
                return Err(CommandError::TooLarge(MAX_LINE.min(max_request)));
            }
            return Ok(None);
        };
        let text = buf[..p].strip_suffix(b"\r").unwrap_or(&buf[..p]);
        let mut words = text
            .split(|b| b.is_ascii_whitespace())
            .filter(|w| !w.is_empty());
        let name = words.next().and_then(short).unwrap_or_default();
        let arg1 = words.next().and_then(short);
        return Ok(Some(Command {
            len: p + 1,
            name,
            arg1,
        }));
    }
    let Some((mut at, l)) = line(buf, 1)? else {
        return Ok(None);
    };
    let n = int(l).ok_or(CommandError::Malformed("bad array length"))?;
    if !(0..=MAX_ARGS as i64).contains(&n) {
        return Err(CommandError::Malformed("array length out of range"));
    }
    let (mut name, mut arg1) = (String::new(), None);
    for i in 0..n {
        match buf.get(at) {
            None => return Ok(None),
            Some(b'$') => {}
            Some(_) => return Err(CommandError::Malformed("expected '$'")),
        }
        let Some((data, l)) = line(buf, at + 1)? else {
            return Ok(None);
        };
        let len = int(l).ok_or(CommandError::Malformed("bad bulk length"))?;
        if len < 0 {
            return Err(CommandError::Malformed("negative bulk length"));
        }
        let end = data.saturating_add(len as usize).saturating_add(2);
        if end > max_request {
            return Err(CommandError::TooLarge(max_request));
        }
        if buf.len() < end {
            return Ok(None);
        }
        if &buf[end - 2..end] != b"\r\n" {
            return Err(CommandError::Malformed(
                "bulk string not terminated by CRLF",
            ));
        }
        let arg = &buf[data..end - 2];
        match i {
            0 => name = short(arg).unwrap_or_default(),
            1 => arg1 = short(arg),
            _ => {}
        }
        at = end;
    }
    if at > max_request {
        return Err(CommandError::TooLarge(max_request));
    }
    Ok(Some(Command {
        len: at,
        name,
        arg1,
    }))
}

/// Follows the server's reply stream and counts complete top-level replies
/// (push messages `>` and attributes `|` do not count). Keeps at most one
/// line of bytes.
#[derive(Debug, Default)]
pub struct ReplyTracker {
    /// Elements still expected at each open aggregate level.
    stack: Vec<u64>,
    line: Vec<u8>,
    /// Bytes of bulk payload (plus CRLF) still to skip.
    skip: u64,
    /// The current top-level value is a push or attribute.
    oob: bool,
}

impl ReplyTracker {
    pub fn at_boundary(&self) -> bool {
        self.stack.is_empty() && self.line.is_empty() && self.skip == 0
    }

    /// Observes reply bytes; returns how many replies completed, or an
    /// error if the output is not RESP.
    pub fn observe(&mut self, mut bytes: &[u8]) -> Result<usize, String> {
        let mut done = 0;
        while !bytes.is_empty() {
            if self.skip > 0 {
                let take = (bytes.len() as u64).min(self.skip);
                self.skip -= take;
                bytes = &bytes[take as usize..];
                if self.skip == 0 {
                    done += self.value_done();
                }
                continue;
            }
            let Some(p) = bytes.iter().position(|&b| b == b'\n') else {
                self.line.extend_from_slice(bytes);
                if self.line.len() > MAX_LINE {
                    return Err("reply line too long".into());
                }
                break;
            };
            self.line.extend_from_slice(&bytes[..=p]);
            bytes = &bytes[p + 1..];
            let l = std::mem::take(&mut self.line);
            let body = l
                .strip_suffix(b"\r\n")
                .ok_or("reply line not terminated by CRLF")?;
            let (&kind, rest) = body.split_first().ok_or("empty reply line")?;
            let top = self.stack.is_empty();
            match kind {
                b'+' | b'-' | b':' | b'_' | b',' | b'#' | b'(' => done += self.value_done(),
                b'$' | b'!' | b'=' => {
                    let n = int(rest).ok_or("bad bulk length")?;
                    if n < 0 {
                        done += self.value_done();
                    } else {
                        self.skip = n as u64 + 2;
                    }
                }
                b'*' | b'~' | b'%' | b'>' | b'|' => {
                    if top && (kind == b'>' || kind == b'|') {
                        self.oob = true;
                    }
                    let n = int(rest).ok_or("bad aggregate length")?;
                    let n = if kind == b'%' || kind == b'|' {
                        n.saturating_mul(2)
                    } else {
                        n
                    };
                    if kind == b'|' {
                        // An attribute precedes the value it describes: the
                        // described value is one more element.
                        if n > 0 {
                            self.stack.push(n as u64);
                        }
                        continue;
                    }
                    if n <= 0 {
                        done += self.value_done();
                    } else {
                        self.stack.push(n as u64);
                    }
                }
                _ => return Err(format!("unknown reply type {:?}", kind as char)),
            }
            self.line = l;
            self.line.clear();
        }
        Ok(done)
    }

    /// One value ended: pops finished aggregates; returns 1 when a counted
    /// top-level reply completed.
    fn value_done(&mut self) -> usize {
        while let Some(top) = self.stack.last_mut() {
            *top -= 1;
            if *top > 0 {
                return 0;
            }
            self.stack.pop();
        }
        if std::mem::take(&mut self.oob) {
            0
        } else {
            1
        }
    }
}

/// The connection-scoped part of a relayed Redis connection.
#[derive(Debug, Default)]
pub struct RespConn {
    pub tracker: ReplyTracker,
    /// Commands forwarded and not answered yet.
    pub outstanding: usize,
    /// The database selected (SELECT), replayed on the target.
    pub db: Option<u32>,
    /// Inside MULTI..EXEC or after WATCH: the transaction is server-side
    /// state, so the connection waits for its end before migrating.
    pub in_transaction: bool,
}

impl RespConn {
    pub fn new(db: Option<u32>) -> RespConn {
        RespConn {
            db,
            ..Default::default()
        }
    }

    /// Every forwarded command answered, no transaction open.
    pub fn idle(&self) -> bool {
        self.outstanding == 0 && self.tracker.at_boundary() && !self.in_transaction
    }

    pub fn at_boundary(&self) -> bool {
        self.tracker.at_boundary()
    }

    /// A command is being forwarded. Returns why the connection must stay
    /// on this server from now on, for commands whose connection-scoped
    /// effect the manager cannot carry.
    pub fn forwarded(&mut self, c: &Command) -> Option<&'static str> {
        self.outstanding += 1;
        match c.name.as_str() {
            "SELECT" => {
                self.db = c.arg1.as_deref().and_then(|a| a.parse().ok()).or(self.db);
                None
            }
            "MULTI" | "WATCH" => {
                self.in_transaction = true;
                None
            }
            "EXEC" | "DISCARD" | "UNWATCH" => {
                self.in_transaction = false;
                None
            }
            "RESET" => {
                self.db = None;
                self.in_transaction = false;
                None
            }
            "SUBSCRIBE" | "PSUBSCRIBE" | "SSUBSCRIBE" | "MONITOR" => {
                Some("subscribed (pushed messages have no request)")
            }
            "AUTH" | "HELLO" => {
                Some("authenticated or protocol switched (not replayed on a target)")
            }
            "CLIENT" if matches!(c.arg1.as_deref(), Some("REPLY") | Some("TRACKING")) => {
                Some("CLIENT REPLY/TRACKING changes reply counting")
            }
            _ => None,
        }
    }

    /// Observes reply bytes.
    pub fn observe(&mut self, bytes: &[u8]) -> Result<(), String> {
        let n = self.tracker.observe(bytes)?;
        self.outstanding = self.outstanding.saturating_sub(n);
        Ok(())
    }
}

/// Target side: re-selects the connection's database on a fresh
/// application connection, before any client command.
pub async fn select_db(app: &mut tokio::net::TcpStream, db: u32) -> std::io::Result<()> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let d = db.to_string();
    let cmd = format!("*2\r\n$6\r\nSELECT\r\n${}\r\n{d}\r\n", d.len());
    app.write_all(cmd.as_bytes()).await?;
    let mut reply = Vec::new();
    let mut buf = [0u8; 256];
    loop {
        let n = app.read(&mut buf).await?;
        if n == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "application closed during SELECT",
            ));
        }
        reply.extend_from_slice(&buf[..n]);
        if reply.ends_with(b"\r\n") {
            break;
        }
        if reply.len() > 1024 {
            break;
        }
    }
    if reply.starts_with(b"+OK") {
        Ok(())
    } else {
        Err(std::io::Error::other(format!(
            "SELECT {db} on the target: {}",
            String::from_utf8_lossy(&reply).trim()
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn frames_commands() {
        let set = b"*3\r\n$3\r\nSET\r\n$3\r\nkey\r\n$5\r\nvalue\r\n";
        let c = parse_command(set, 1 << 20).unwrap().unwrap();
        assert_eq!(
            (c.len, c.name.as_str(), c.arg1.as_deref()),
            (set.len(), "SET", Some("KEY"))
        );
        for cut in 0..set.len() {
            assert_eq!(parse_command(&set[..cut], 1 << 20), Ok(None), "cut {cut}");
        }
        let inline = b"select 3\r\nPING\r\n";
        let c = parse_command(inline, 1 << 20).unwrap().unwrap();
        assert_eq!(
            (c.len, c.name.as_str(), c.arg1.as_deref()),
            (10, "SELECT", Some("3"))
        );
        assert_eq!(
            parse_command(b"*1\r\n$99999999\r\n", 1 << 20),
            Err(CommandError::TooLarge(1 << 20))
        );
        assert!(parse_command(b"*1\r\n+x\r\n", 1 << 20).is_err());
    }

    #[test]
    fn counts_replies_split_anywhere() {
        let stream: &[u8] = b"+OK\r\n$5\r\nhello\r\n$-1\r\n*2\r\n$1\r\na\r\n*1\r\n:1\r\n>2\r\n+p\r\n+q\r\n%1\r\n+k\r\n+v\r\n-ERR x\r\n*0\r\n";
        for cut in 0..stream.len() {
            let mut t = ReplyTracker::default();
            let n = t.observe(&stream[..cut]).unwrap() + t.observe(&stream[cut..]).unwrap();
            assert_eq!(n, 7, "cut {cut}");
            assert!(t.at_boundary());
        }
    }

    proptest! {
        #[test]
        fn command_parser_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = parse_command(&bytes, 128);
        }

        #[test]
        fn reply_tracker_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let mut t = ReplyTracker::default();
            let _ = t.observe(&bytes);
        }

        #[test]
        fn pipelined_commands_frame_exactly(args in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..20), 1..5), copies in 1usize..4) {
            let mut one = format!("*{}\r\n", args.len()).into_bytes();
            for a in &args {
                one.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
                one.extend_from_slice(a);
                one.extend_from_slice(b"\r\n");
            }
            let all = one.repeat(copies);
            let mut off = 0;
            for _ in 0..copies {
                let c = parse_command(&all[off..], 1 << 20).unwrap().unwrap();
                prop_assert_eq!(c.len, one.len());
                off += c.len;
            }
        }
    }
}
