//! The memcache text protocol, as Kestrel spoke it for queues: request lines (and the data block
//! of a storage command) in, commands out. Pure: no I/O, no broker; `decode` is what the fuzz
//! target and the property tests drive.
//!
//! Lines end in LF (CR before it is dropped); tokens are separated by runs of spaces or tabs; the
//! command word is case-insensitive. A line longer than `MAX_LINE` closes the connection. A data
//! block longer than the limit is refused as soon as its line is read, and thrown away as it
//! comes, so the connection stays in step with the client.

use bytes::{Buf, Bytes, BytesMut};

/// Longest request line (memcache keys are at most 250 bytes; options add a little).
pub const MAX_LINE: usize = 2048;
/// Longest key, as memcached.
pub const MAX_KEY: usize = 250;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Command {
    /// `get`/`gets`: `key` is the key as sent (`VALUE` echoes it), `queue` the part before `/`;
    /// `gets` answers with a cas number too (the item's id), as memcache clients expect.
    Get {
        key: Bytes,
        queue: String,
        options: GetOptions,
        cas: bool,
    },
    Set {
        queue: String,
        flags: u32,
        exptime: i64,
        data: Bytes,
        noreply: bool,
    },
    /// `add`, `replace`, `append`, `prepend`, `cas`: framed (their data consumed), not supported.
    OtherStorage {
        verb: String,
        noreply: bool,
    },
    Delete {
        queue: String,
        noreply: bool,
    },
    Flush {
        queue: String,
        noreply: bool,
    },
    /// `memcached_style`: the client sent a delay argument (`flush_all 0`) and expects `OK`.
    FlushAll {
        memcached_style: bool,
        noreply: bool,
    },
    FlushExpired {
        queue: String,
    },
    FlushAllExpired,
    Version,
    Shutdown,
    Quit,
    Stats,
    DumpStats {
        queues: Vec<String>,
    },
    Unknown {
        verb: String,
        /// Its last word was `noreply`: the client reads no `ERROR` for it either.
        noreply: bool,
    },
}

impl Command {
    /// Whether the request said `noreply`: it reads no answer, not even an error.
    pub fn noreply(&self) -> bool {
        match self {
            Command::Set { noreply, .. }
            | Command::OtherStorage { noreply, .. }
            | Command::Delete { noreply, .. }
            | Command::Flush { noreply, .. }
            | Command::FlushAll { noreply, .. }
            | Command::Unknown { noreply, .. } => *noreply,
            _ => false,
        }
    }

    /// The command's name, as `petrel_requests_total` counts it (`other` for the unsupported).
    pub fn name(&self) -> &'static str {
        match self {
            Command::Get { .. } => "get",
            Command::Set { .. } => "set",
            Command::OtherStorage { .. } | Command::Unknown { .. } => "other",
            Command::Delete { .. } => "delete",
            Command::Flush { .. } => "flush",
            Command::FlushAll { .. } => "flush_all",
            Command::FlushExpired { .. } => "flush_expired",
            Command::FlushAllExpired => "flush_all_expired",
            Command::Version => "version",
            Command::Shutdown => "shutdown",
            Command::Quit => "quit",
            Command::Stats => "stats",
            Command::DumpStats { .. } => "dump_stats",
        }
    }
}

/// The options after a `get` key's queue name: `/t=MS`, `/open`, `/close`, `/abort`, `/peek`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GetOptions {
    /// Wait up to this long for an item (0: do not wait).
    pub timeout_ms: u32,
    pub open: bool,
    pub close: bool,
    pub abort: bool,
    pub peek: bool,
}

/// A request the server answers with an error line; `close` when the stream cannot be trusted.
/// `noreply`: the request said so, and the line is not sent (as memcached, which keeps silent on
/// an error of a request whose line it could read: a client that sent `noreply` reads no
/// answer, and an unexpected line would be taken as the next request's), unless it closes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reject {
    pub reply: String,
    pub close: bool,
    pub noreply: bool,
    /// The refusal of a `set` (its item is not stored): counted as the server's refusals are.
    pub set: bool,
}

impl Reject {
    pub(crate) fn keep(reply: impl Into<String>) -> Reject {
        Reject { reply: reply.into(), close: false, noreply: false, set: false }
    }
    fn close(reply: impl Into<String>) -> Reject {
        Reject { reply: reply.into(), close: true, noreply: false, set: false }
    }

    /// Whether the client is to read this reject's line.
    pub fn answered(&self) -> bool {
        self.close || !self.noreply
    }
}

/// The refusal of a request that is no text-protocol command: the connection ends, as what
/// follows cannot be trusted to be lines (a binary request's value could read as `delete jobs`).
fn not_text() -> Reject {
    Reject::close("CLIENT_ERROR not a text-protocol command (binary protocol is not served here)")
}

/// The longest data block thrown away after a refusal (a frame's 32-bit length, as memcached's
/// limit): a longer one is a broken stream, and the connection is closed.
const MAX_SKIPPED: usize = u32::MAX as usize;

/// The decoder's state between calls: a storage command waiting for its data block, or a
/// refused data block still being thrown away.
#[derive(Debug)]
pub struct Decoder {
    max_data: usize,
    pending: Option<(String, StorageLine)>,
    skipping: usize,
    after_skip: Option<Reject>,
}

impl Decoder {
    /// `max_data`: the largest data block kept; bigger ones are discarded and refused.
    pub fn new(max_data: usize) -> Decoder {
        Decoder { max_data, pending: None, skipping: 0, after_skip: None }
    }

    /// The next request in `buf`, consuming its bytes; `None` when more bytes are needed.
    pub fn decode(&mut self, buf: &mut BytesMut) -> Option<Result<Command, Reject>> {
        if self.skipping > 0 {
            let n = self.skipping.min(buf.len());
            buf.advance(n);
            self.skipping -= n;
            if self.skipping > 0 {
                return None;
            }
            if let Some(reject) = self.after_skip.take() {
                return Some(Err(reject));
            }
        }
        if let Some((verb, line)) = self.pending.take() {
            return self.data_block(buf, verb, line);
        }
        let Some(end) = buf.iter().take(MAX_LINE + 1).position(|&b| b == b'\n') else {
            // A line that cannot start a command is refused as it comes, not once its end does:
            // a binary-protocol request (0x80 first) may never hold a newline, and its client
            // waits for an answer.
            let first = buf.iter().find(|&&b| b != b' ' && b != b'\t');
            if first.is_some_and(|&b| !b.is_ascii_graphic() && b != b'\r') {
                buf.clear();
                return Some(Err(not_text()));
            }
            return (buf.len() > MAX_LINE).then(|| Err(Reject::close("CLIENT_ERROR line too long")));
        };
        let line_len = end + 1;
        let line = &buf[..end];
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let tokens: Vec<&[u8]> = line.split(|b| *b == b' ' || *b == b'\t').filter(|t| !t.is_empty()).collect();
        let Some(verb) = tokens.first() else {
            buf.advance(line_len);
            return Some(Err(Reject::keep("ERROR")));
        };
        // Not a text command: a binary-protocol client (its requests start with 0x80), or junk.
        // What follows cannot be trusted to be lines either (a binary request's value could read
        // as `delete jobs`), so the connection ends rather than parse on.
        if !verb.iter().all(|b| b.is_ascii_graphic()) {
            buf.advance(line_len);
            return Some(Err(not_text()));
        }
        let verb = String::from_utf8_lossy(verb).to_ascii_lowercase();
        if matches!(verb.as_str(), "set" | "add" | "replace" | "append" | "prepend" | "cas") {
            let line = storage_line(&verb, &tokens, self.max_data);
            buf.advance(line_len);
            return match line {
                Ok(line) => self.data_block(buf, verb, line),
                Err(StorageError { reject, skip: None }) => Some(Err(reject)),
                Err(StorageError { reject, skip: Some(len) }) => {
                    // Answered at once (as memcached does: a client that waits for the answer
                    // before it sends a large block is told), and the data block thrown away as
                    // it comes, so the next line is read as a line.
                    self.skipping = len.saturating_add(2);
                    Some(Err(reject))
                }
            };
        }
        if matches!(verb.as_str(), "ms" | "mg" | "md" | "ma" | "mn" | "me") {
            // memcached's meta commands: refused, and a meta set's data block (`ms KEY LEN …`)
            // thrown away, so that it is never read as commands.
            let len = tokens.get(2).and_then(|t| number::<u64>(t)).and_then(|n| usize::try_from(n).ok());
            buf.advance(line_len);
            let reject = Reject::keep("CLIENT_ERROR meta commands are not supported: use set and get");
            if verb != "ms" {
                return Some(Err(reject));
            }
            let Some(len) = len.filter(|&len| len <= MAX_SKIPPED) else {
                return Some(Err(Reject::close("CLIENT_ERROR bad data chunk")));
            };
            self.skipping = len.saturating_add(2);
            return Some(Err(reject));
        }
        let result = command(&verb, &tokens, line.last().is_some_and(|b| *b == b' ' || *b == b'\t'));
        buf.advance(line_len);
        Some(result)
    }

    /// The bytes the data block being waited for takes in all, when the `buffered` bytes do not
    /// hold it yet.
    pub fn incomplete(&self, buffered: usize) -> Option<usize> {
        let (_, line) = self.pending.as_ref()?;
        (line.len + 2 > buffered).then_some(line.len + 2)
    }

    /// Refuses the data block being waited for: its bytes are skipped as they come, then `reject`.
    pub fn refuse_incomplete(&mut self, reject: Reject) {
        if let Some((verb, line)) = self.pending.take() {
            self.skipping = line.len + 2;
            self.after_skip = Some(Reject { noreply: line.noreply, set: verb == "set", ..reject });
        }
    }

    /// The data block of a storage command whose line (already consumed) said `line`; until it
    /// has all arrived, the line waits in `pending`.
    fn data_block(&mut self, buf: &mut BytesMut, verb: String, line: StorageLine) -> Option<Result<Command, Reject>> {
        let len = line.len;
        if buf.len() < len + 2 {
            // The connection's input makes room for it (within the memory budget).
            self.pending = Some((verb, line));
            return None;
        }
        if &buf[len..len + 2] != b"\r\n" {
            buf.advance(len + 2);
            return Some(Err(Reject::close("CLIENT_ERROR bad data chunk")));
        }
        let data = buf.split_to(len).freeze();
        buf.advance(2);
        let StorageLine { queue, flags, exptime, noreply, .. } = line;
        Some(Ok(match verb.as_str() {
            "set" => Command::Set { queue, flags, exptime, data, noreply },
            _ => Command::OtherStorage { verb, noreply },
        }))
    }
}

/// What a storage command's line says.
#[derive(Debug)]
struct StorageLine {
    queue: String,
    flags: u32,
    exptime: i64,
    len: usize,
    noreply: bool,
}

/// A storage line refused; `skip`: the length of its data block, if the line gave one.
struct StorageError {
    reject: Reject,
    skip: Option<usize>,
}

fn storage_line(verb: &str, tokens: &[&[u8]], max_data: usize) -> Result<StorageLine, StorageError> {
    let min_tokens = if verb == "cas" { 6 } else { 5 };
    if tokens.len() < min_tokens {
        return Err(StorageError { reject: Reject::close("CLIENT_ERROR bad command line format"), skip: None });
    }
    // A length past what any data block may be is no length: the stream cannot be followed.
    let Some(len) = number::<u64>(tokens[4]).and_then(|n| usize::try_from(n).ok()).filter(|&n| n <= MAX_SKIPPED) else {
        return Err(StorageError { reject: Reject::close("CLIENT_ERROR bad data chunk"), skip: None });
    };
    let flags = number::<i64>(tokens[2]).filter(|f| (i64::from(i32::MIN)..=i64::from(u32::MAX)).contains(f));
    let exptime = number::<i64>(tokens[3]);
    let noreply = tokens.get(min_tokens).is_some_and(|t| t.eq_ignore_ascii_case(b"noreply"));
    let set = verb == "set";
    let refuse =
        |reply: &str| Err(StorageError { reject: Reject { noreply, set, ..Reject::keep(reply) }, skip: Some(len) });
    if len > max_data {
        return refuse("SERVER_ERROR object too large for cache");
    }
    if tokens[1].len() > MAX_KEY {
        return refuse("CLIENT_ERROR key too long");
    }
    let Some(flags) = flags else { return refuse("CLIENT_ERROR bad flags") };
    let Some(exptime) = exptime else { return refuse("CLIENT_ERROR bad exptime") };
    Ok(StorageLine {
        queue: String::from_utf8_lossy(tokens[1]).into_owned(),
        flags: flags as u32,
        exptime,
        len,
        noreply,
    })
}

/// A command without a data block.
/// `spaced`: the line ends in a space or tab after its last token.
fn command(verb: &str, tokens: &[&[u8]], spaced: bool) -> Result<Command, Reject> {
    let text = |t: &[u8]| String::from_utf8_lossy(t).into_owned();
    let noreply = tokens.last().is_some_and(|t| t.eq_ignore_ascii_case(b"noreply")) && tokens.len() > 1;
    let queue_arg = || match tokens.get(1) {
        Some(q) if !q.eq_ignore_ascii_case(b"noreply") => Ok(text(q)),
        _ => Err(Reject::keep(format!("CLIENT_ERROR {verb} needs a queue name"))),
    };
    Ok(match verb {
        "get" | "gets" => {
            let Some(key) = tokens.get(1) else { return Err(Reject::keep("CLIENT_ERROR get needs a key")) };
            if key.len() > MAX_KEY {
                return Err(Reject::keep("CLIENT_ERROR key too long"));
            }
            let (queue, options) = get_key(key)?;
            Command::Get { key: Bytes::copy_from_slice(key), queue, options, cas: verb == "gets" }
        }
        "delete" => Command::Delete { queue: queue_arg()?, noreply },
        "flush" => Command::Flush { queue: queue_arg()?, noreply },
        // memcached's answer for a delay argument, and for libmemcached's `flush_all \r\n` (it
        // reads no other); Kestrel's sentence for a bare `flush_all`.
        "flush_all" => Command::FlushAll {
            memcached_style: (tokens.len() > 1 && !(noreply && tokens.len() == 2)) || spaced,
            noreply,
        },
        "flush_expired" => Command::FlushExpired { queue: queue_arg()? },
        "flush_all_expired" => Command::FlushAllExpired,
        "version" => Command::Version,
        "shutdown" => Command::Shutdown,
        "quit" => Command::Quit,
        "stats" => Command::Stats,
        "dump_stats" => Command::DumpStats { queues: tokens[1..].iter().map(|t| text(t)).collect() },
        _ => Command::Unknown { verb: verb.to_owned(), noreply },
    })
}

/// Splits `queue/opt/opt…` and checks the combination, as Kestrel does.
fn get_key(key: &[u8]) -> Result<(String, GetOptions), Reject> {
    let mut parts = key.split(|b| *b == b'/');
    let queue = String::from_utf8_lossy(parts.next().unwrap_or_default()).into_owned();
    if queue.is_empty() {
        return Err(Reject::close("CLIENT_ERROR empty queue name"));
    }
    let mut o = GetOptions::default();
    for part in parts {
        match part {
            b"open" => o.open = true,
            b"close" => o.close = true,
            b"abort" => o.abort = true,
            b"peek" => o.peek = true,
            b"" => {}
            _ => match part.strip_prefix(b"t=") {
                Some(ms) => match number::<i64>(ms) {
                    Some(ms) => o.timeout_ms = ms.clamp(0, i64::from(u32::MAX)) as u32,
                    None => return Err(Reject::close("CLIENT_ERROR bad timeout")),
                },
                // Kestrel ignored unknown options; a misspelt `/open` would then take the item
                // for good, so it is refused.
                None => {
                    return Err(Reject::keep(format!(
                        "CLIENT_ERROR unknown option {:?}",
                        String::from_utf8_lossy(part)
                    )));
                }
            },
        }
    }
    if (o.peek && (o.open || o.close || o.abort)) || (o.abort && (o.open || o.close)) {
        return Err(Reject::close("CLIENT_ERROR conflicting options"));
    }
    Ok((queue, o))
}

fn number<T: std::str::FromStr>(token: &[u8]) -> Option<T> {
    std::str::from_utf8(token).ok()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode_all(input: &[u8], max_data: usize) -> Vec<Result<Command, Reject>> {
        let mut d = Decoder::new(max_data);
        let mut buf = BytesMut::from(input);
        let mut out = Vec::new();
        while let Some(r) = d.decode(&mut buf) {
            let close = matches!(r, Err(Reject { close: true, .. }));
            out.push(r);
            if close {
                break; // the server stops reading here
            }
        }
        out
    }

    #[test]
    fn set_and_get_with_options() {
        let got = decode_all(b"set work 7 0 5\r\nhello\r\nGET work/t=250/open\r\ngets   work/close/open \n", 100);
        assert_eq!(
            got[0],
            Ok(Command::Set { queue: "work".into(), flags: 7, exptime: 0, data: Bytes::from("hello"), noreply: false })
        );
        let Ok(Command::Get { key, queue, options, cas: false }) = &got[1] else { panic!("{got:?}") };
        assert_eq!((&key[..], queue.as_str()), (&b"work/t=250/open"[..], "work"));
        assert_eq!(*options, GetOptions { timeout_ms: 250, open: true, ..GetOptions::default() });
        let Ok(Command::Get { options, cas: true, .. }) = &got[2] else { panic!("{got:?}") };
        assert!(options.open && options.close);
        assert_eq!(got.len(), 3);
    }

    #[test]
    fn a_split_request_waits_for_its_bytes() {
        let whole = b"set q 0 0 3 noreply\r\nabc\r\n";
        for cut in 0..whole.len() {
            let mut d = Decoder::new(100);
            let mut buf = BytesMut::from(&whole[..cut]);
            assert_eq!(d.decode(&mut buf), None, "cut at {cut}");
            buf.extend_from_slice(&whole[cut..]);
            let Some(Ok(Command::Set { noreply: true, data, .. })) = d.decode(&mut buf) else { panic!("cut {cut}") };
            assert_eq!(&data[..], b"abc");
            assert!(buf.is_empty());
        }
    }

    #[test]
    fn malformed_input_gets_error_replies() {
        let close = |r: &str| Err(Reject::close(r));
        let keep = |r: &str| Err(Reject::keep(r));
        // A set refused as it is read says so (it counts among the sets not stored).
        let set_refused = |r: &str| Err(Reject { set: true, ..Reject::keep(r) });
        assert_eq!(decode_all(b"set q 0 0\r\n", 100), vec![close("CLIENT_ERROR bad command line format")]);
        assert_eq!(decode_all(b"set q 0 0 x\r\n", 100), vec![close("CLIENT_ERROR bad data chunk")]);
        assert_eq!(decode_all(b"set q 0 0 -1\r\n", 100), vec![close("CLIENT_ERROR bad data chunk")]);
        assert_eq!(decode_all(b"set q 0 0 2\r\nabcd\r\n", 100), vec![close("CLIENT_ERROR bad data chunk")]);
        // A bad flags or exptime token: the data block is skipped and the connection kept.
        let got = decode_all(b"set q x 0 2\r\nab\r\nset q 0 y 1\r\na\r\nversion\r\n", 100);
        let bad = [set_refused("CLIENT_ERROR bad flags"), set_refused("CLIENT_ERROR bad exptime")];
        assert_eq!(got, [bad[0].clone(), bad[1].clone(), Ok(Command::Version)]);
        // Too big: skipped, refused, in step for the next command.
        let mut big = b"set q 0 0 300\r\n".to_vec();
        big.extend(vec![b'x'; 300]);
        big.extend_from_slice(b"\r\nversion\r\n");
        let got = decode_all(&big, 100);
        assert_eq!(got, vec![set_refused("SERVER_ERROR object too large for cache"), Ok(Command::Version)]);
        // Refused as soon as its line is read, not once the whole block came (a client that
        // waits for the answer first got none); an impossible length closes.
        let mut d = Decoder::new(100);
        let mut buf = BytesMut::from(&b"set q 0 0 300\r\nxx"[..]);
        assert_eq!(d.decode(&mut buf), Some(set_refused("SERVER_ERROR object too large for cache")));
        assert_eq!(d.decode(&mut buf), None, "the rest of the block is awaited and thrown away");
        buf.extend_from_slice(&[b'x'; 298]);
        buf.extend_from_slice(b"\r\nversion\r\n");
        assert_eq!(d.decode(&mut buf), Some(Ok(Command::Version)));
        assert_eq!(decode_all(b"set q 0 0 99999999999\r\n", 100), vec![close("CLIENT_ERROR bad data chunk")]);
        assert_eq!(decode_all(b"get /open\r\n", 100), vec![close("CLIENT_ERROR empty queue name")]);
        assert_eq!(decode_all(b"get q/peek/open\r\n", 100), vec![close("CLIENT_ERROR conflicting options")]);
        assert_eq!(decode_all(b"get q/abort/close\r\n", 100), vec![close("CLIENT_ERROR conflicting options")]);
        assert_eq!(decode_all(b"get q/t=soon\r\n", 100), vec![close("CLIENT_ERROR bad timeout")]);
        assert_eq!(decode_all(b"get q/opne\r\n", 100), vec![keep("CLIENT_ERROR unknown option \"opne\"")]);
        assert_eq!(decode_all(b"get\r\n", 100), vec![keep("CLIENT_ERROR get needs a key")]);
        assert_eq!(decode_all(b"\r\n", 100), vec![keep("ERROR")]);
        assert_eq!(
            decode_all(b"frobnicate q\r\n", 100),
            vec![Ok(Command::Unknown { verb: "frobnicate".into(), noreply: false })]
        );
        // A command this server does not know, sent with `noreply` (pymemcache's `touch`):
        // the client reads no answer, so none is sent.
        assert_eq!(
            decode_all(b"touch q 10 noreply\r\n", 100),
            vec![Ok(Command::Unknown { verb: "touch".into(), noreply: true })]
        );
        // memcached's meta commands are refused; a meta set's data block is skipped, never read
        // as commands (it was: `ms q 11 T0` then `delete jobs` deleted the queue).
        let meta = "CLIENT_ERROR meta commands are not supported: use set and get";
        let got = decode_all(b"ms q 11 T0\r\ndelete jobs\r\nmg q v\r\nversion\r\n", 100);
        assert_eq!(got, vec![keep(meta), keep(meta), Ok(Command::Version)]);
        assert_eq!(decode_all(b"ms q\r\n", 100), vec![close("CLIENT_ERROR bad data chunk")]);
        // A binary-protocol set of key `k` to `x\r\ndelete jobs\r\n`: its header is no command,
        // and its value is never read as commands.
        let mut binary = vec![0x80, 0x01, 0x00, 0x01, 0x08, 0, 0, 0, 0, 0, 0, 0x11];
        binary.extend_from_slice(&[0; 12]);
        binary.extend_from_slice(b"kx\r\ndelete jobs\r\n");
        let not_text = "CLIENT_ERROR not a text-protocol command (binary protocol is not served here)";
        assert_eq!(decode_all(&binary, 100), vec![close(not_text)]);
        assert_eq!(decode_all(b"g\x01et q\r\n", 100), vec![close(not_text)]);
        // A binary request without a newline in it (VERSION) is refused at once, as are leading
        // bytes no command starts with; a line still arriving that may be one is waited for.
        let mut version = vec![0x80, 0x0b];
        version.extend_from_slice(&[0; 22]);
        assert_eq!(decode_all(&version, 100), vec![close(not_text)]);
        assert_eq!(decode_all(b" \x00get", 100), vec![close(not_text)]);
        assert_eq!(decode_all(b" \tget q", 100), vec![]);
        assert_eq!(decode_all(b"\r", 100), vec![]);
        assert_eq!(decode_all(&[b'g'; MAX_LINE + 1], 100), vec![close("CLIENT_ERROR line too long")]);
        assert_eq!(decode_all(&[b'g'; MAX_LINE], 100), vec![], "not too long yet: wait for the end");
    }

    #[test]
    fn flush_all_answers_as_the_client_expects() {
        let got =
            decode_all(b"flush_all\r\nflush_all 0\r\nflush_all noreply\r\nflush_all 0 noreply\r\nflush_all \r\n", 10);
        let style: Vec<_> = got
            .into_iter()
            .map(|c| match c {
                Ok(Command::FlushAll { memcached_style, noreply }) => (memcached_style, noreply),
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(style, vec![(false, false), (true, false), (false, true), (true, true), (true, false)]);
    }

    proptest::proptest! {
        /// Any bytes, in any chunks: the decoder never panics, never loops, and always consumes.
        #[test]
        fn arbitrary_bytes_never_panic(input: Vec<u8>, cut in 0usize..64) {
            let mut d = Decoder::new(64);
            let mut buf = BytesMut::new();
            for chunk in input.chunks(cut.max(1)) {
                buf.extend_from_slice(chunk);
                let mut guard = 0;
                while let Some(r) = d.decode(&mut buf) {
                    guard += 1;
                    proptest::prop_assert!(guard <= input.len() + 1);
                    if matches!(r, Err(Reject { close: true, .. })) {
                        return Ok(());
                    }
                }
            }
        }

        /// What a client writes with valid values decodes to the same values.
        #[test]
        fn sets_round_trip(queue in "[a-z][a-z0-9_+-]{0,20}", flags: u32, exptime in -1000i64..2_000_000,
                           data in proptest::collection::vec(proptest::num::u8::ANY, 0..200)) {
            let mut wire = format!("set {queue} {flags} {exptime} {}\r\n", data.len()).into_bytes();
            wire.extend_from_slice(&data);
            wire.extend_from_slice(b"\r\n");
            let got = decode_all(&wire, 1000);
            proptest::prop_assert_eq!(got, vec![Ok(Command::Set {
                queue, flags, exptime, data: Bytes::from(data), noreply: false })]);
        }
    }
}
