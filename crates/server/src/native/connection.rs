//! Frames in, bytes out: the native protocol's connection, and nothing about what requests mean.
//!
//! Reading: whole frames are decoded from a buffer that grows only as far as the server's
//! memory budget allows (`input.rs`); a frame that is not a request, too large, of an unknown
//! version or opcode is answered here, and a malformed one ends the connection.
//!
//! Writing: answers to the requests of one read collect in `out` and go out together (a
//! pipelined burst costs one write back): written by the reading task itself when nothing waits
//! in the outbox (no hand-off to another task), else queued behind what does. Pushes and answers
//! that waited go to the writer task through the bounded `Outbox`, which writes whatever is ready
//! in one vectored write. The two share the socket's write half, one at a time.

use std::sync::Arc;

use petrel_proto::{DecodeError, FrameError, FrameKind, Request, Response, Status, frame};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadHalf, WriteHalf};
use tokio::task::JoinHandle;

use crate::Ctx;
use crate::connections::Registered;
use crate::input::Input;
use crate::outbox::{Outbox, outbox};
use crate::stats::add;
use petrel_broker::ConnId;

/// Answers of one read are sent once this many bytes, or this many answers, wait, mid-read.
/// The count is so that a client pipelining many small requests gets its first answers while
/// the server handles the rest of what it read, and sends its next requests meanwhile, instead
/// of both sides taking turns with a whole read's worth.
const FLUSH_ANSWERS_AT_BYTES: usize = 64 * 1024;
const FLUSH_ANSWERS_AT_COUNT: usize = 16;

/// Room for answers a connection starts with.
const ANSWERS_START_BYTES: usize = 16 * 1024;

/// A request, and the frame fields its answer must carry.
pub(super) struct Incoming {
    pub opcode: u16,
    pub request_id: u64,
    pub request: Request,
}

/// The connection cannot go on: the client closed it, or sent bytes that are not frames.
pub(super) struct Closed;

pub(super) struct Connection<S> {
    rd: ReadHalf<S>,
    input: Input,
    /// Bytes of a frame too large to take, still to be read past.
    skip: u64,
    /// Answers to the requests of the current read, handed to the writer together.
    out: Vec<u8>,
    /// How many answers `out` holds.
    answers: usize,
    /// How many answers make this read's next early send: doubles with each one.
    early_at: usize,
    outbox: Outbox,
    /// The socket's write half, shared with the writer task.
    wire: Wire<S>,
    writer: JoinHandle<()>,
    /// The task writing the rest of a frame half written by `flush`, if it has not ended.
    finishing: Option<JoinHandle<bool>>,
    ctx: Arc<Ctx>,
    /// The broker's name for this connection.
    conn: ConnId,
    entry: Arc<crate::connections::Connection>,
    /// The server's stop and its grace: how long a client that does not read is waited for.
    stop: Stop,
    /// When the last read took bytes from the socket (ns since the Unix epoch): the time every
    /// request it brought arrived by, one clock read per read rather than one per request.
    read_at_ns: u64,
}

type Stop = (tokio::sync::watch::Receiver<bool>, std::time::Duration);

type Wire<S> = Arc<tokio::sync::Mutex<WriteHalf<S>>>;

/// The opcode of the frame at `at` of `buf` (its header read).
fn opcode_at(buf: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([buf[at + 6], buf[at + 7]])
}

/// A frame whose header has arrived and the rest not: its whole length, whom to answer.
#[derive(Clone, Copy)]
struct Incomplete {
    len: usize,
    opcode: u16,
    request_id: u64,
}

fn incomplete_frame(buf: &[u8]) -> Option<Incomplete> {
    if buf.len() < 4 + frame::HEADER_LEN {
        return None;
    }
    let len = 4 + u32::from_be_bytes(buf[..4].try_into().expect("4 bytes")) as usize;
    let opcode = opcode_at(buf, 0);
    let request_id = u64::from_be_bytes(buf[8..16].try_into().expect("8 bytes"));
    (len > buf.len()).then_some(Incomplete { len, opcode, request_id })
}

impl<S: AsyncRead + AsyncWrite + Send + 'static> Connection<S> {
    /// Splits `stream` and starts its writer task.
    pub fn new(stream: S, ctx: &Arc<Ctx>, conn: ConnId, registered: &Registered, stop: Stop) -> Connection<S> {
        let (rd, wr) = tokio::io::split(stream);
        let (outbox, rx) = outbox(ctx.config.max_queued_responses, ctx.config.max_queued_response_bytes);
        let wire = Arc::new(tokio::sync::Mutex::new(wr));
        let entry = Arc::clone(registered.entry());
        let writer = tokio::spawn(write_until_closed(Arc::clone(&wire), rx, Arc::clone(ctx), Arc::clone(&entry)));
        Connection {
            rd,
            input: Input::new(),
            skip: 0,
            out: Vec::with_capacity(ANSWERS_START_BYTES),
            answers: 0,
            early_at: FLUSH_ANSWERS_AT_COUNT,
            outbox,
            wire,
            writer,
            finishing: None,
            ctx: Arc::clone(ctx),
            conn,
            entry,
            stop,
            read_at_ns: crate::now_ns(),
        }
    }

    /// When the requests now buffered had all arrived (see `read_at_ns`).
    pub fn read_at_ns(&self) -> u64 {
        self.read_at_ns
    }

    /// The answers of this read are worth sending before the rest of it is handled.
    pub fn answers_are_many(&self) -> bool {
        self.answers >= self.early_at || self.out.len() >= FLUSH_ANSWERS_AT_BYTES
    }

    /// Hands the answers waiting to the outbox, in the room reserved for them (they then go
    /// out after what it holds).
    pub fn queue_answers(&mut self, reserved: crate::outbox::Reserved<'_>) {
        self.answers = 0;
        self.early_at = self.early_at.saturating_mul(2);
        reserved.send(self.take_answers().into());
    }

    /// The answers waiting, for the outbox, `out` left empty with room for the next read's:
    /// likely as many, so no growing from empty each time (at most what a new connection starts
    /// with, which an idle one keeps).
    fn take_answers(&mut self) -> Vec<u8> {
        let room = self.out.len().clamp(1024, ANSWERS_START_BYTES);
        std::mem::replace(&mut self.out, Vec::with_capacity(room))
    }

    /// The bytes of the answers waiting.
    pub fn answers_len(&self) -> usize {
        self.out.len()
    }

    /// Adds `response` to the answers of this read.
    pub fn answer(&mut self, response: &Response, opcode: u16, request_id: u64) {
        response.encode(opcode, request_id, &mut self.out);
        self.answers += 1;
    }

    /// Takes the RETURN requests read whole out of the buffer, wherever they are among the
    /// other requests (which stay, in their order): a connection waiting for a permit handles
    /// them, as they need none. Each with its frame's request id, decoded or the answer that
    /// refuses it.
    pub fn take_returns(&mut self) -> Vec<(u64, Result<Request, Response>)> {
        let buf = &self.input.buf;
        let is_return = |at: usize| {
            buf[at + 4] == frame::PROTOCOL_VERSION
                && buf[at + 5] == 0
                && opcode_at(buf, at) == petrel_proto::opcode::RETURN
        };
        let found: Vec<_> = self.whole_frames().0.into_iter().filter(|f| is_return(f.start)).collect();
        if found.is_empty() {
            return Vec::new();
        }
        if found[0].start == 0 {
            // The frame at the front, which the memory budget may hold for: taken whole.
            self.input.taken();
        }
        let buf = &self.input.buf;
        let mut rest = bytes::BytesMut::with_capacity(buf.capacity());
        let mut returns = Vec::with_capacity(found.len());
        let mut from = 0;
        for frame in found {
            rest.extend_from_slice(&buf[from..frame.start]);
            let request_id = u64::from_be_bytes(buf[frame.start + 8..frame.start + 16].try_into().expect("8 bytes"));
            let body = bytes::Bytes::copy_from_slice(&buf[frame.start + 16..frame.end]);
            let call = Request::return_call(&body);
            let request = Request::decode(petrel_proto::opcode::RETURN, body).map_err(|e| self.refuse_return(call, e));
            returns.push((request_id, request));
            from = frame.end;
        }
        rest.extend_from_slice(&buf[from..]);
        self.input.buf = rest;
        for _ in &returns {
            self.entry.request();
            self.ctx.stats.native_request(petrel_proto::opcode::RETURN);
        }
        returns
    }

    /// The answer to a request that does not decode; for a RETURN, its caller's call (`call`,
    /// read from its first bytes) fails at once too, if this connection had it.
    fn refuse_return(&self, call: Option<u64>, e: DecodeError) -> Response {
        if let Some(call) = call {
            self.ctx.broker.reply(call, self.conn, Err(format!("the function's reply was refused: {e}")));
        }
        Response::error(Status::BadRequest, e.to_string())
    }

    /// Whether the first frame not read whole yet is a RETURN request (its header read).
    pub fn reading_a_return(&self) -> bool {
        self.whole_frames().1.is_some_and(|at| opcode_at(&self.input.buf, at) == petrel_proto::opcode::RETURN)
    }

    /// The frames read whole at the front of the buffer (up to one too large, or malformed,
    /// which is refused when decoded in turn), and where the next one starts if its header is
    /// read and the rest not yet.
    fn whole_frames(&self) -> (Vec<std::ops::Range<usize>>, Option<usize>) {
        let (buf, max) = (&self.input.buf, self.ctx.config.max_frame_bytes as usize);
        let (mut at, mut whole) = (0, Vec::new());
        while self.skip == 0 && buf.len() >= at + 4 + frame::HEADER_LEN {
            let len = u32::from_be_bytes(buf[at..at + 4].try_into().expect("4 bytes")) as usize;
            if !(frame::HEADER_LEN..=max).contains(&len) {
                break;
            }
            if at + 4 + len > buf.len() {
                return (whole, Some(at));
            }
            whole.push(at..at + 4 + len);
            at += 4 + len;
        }
        (whole, None)
    }

    /// Bytes read and not yet decoded.
    pub fn buffered(&self) -> usize {
        self.input.buf.len()
    }

    /// Where answers that wait, and pushes, are sent.
    pub fn outbox(&self) -> &Outbox {
        &self.outbox
    }

    /// The next whole request already buffered (`None`: none is), answering on the way the
    /// frames that are not requests the server can take.
    pub fn next_request(&mut self) -> Result<Option<Incoming>, Closed> {
        loop {
            if self.skip > 0 {
                let n = self.skip.min(self.input.buf.len() as u64) as usize;
                let _ = self.input.buf.split_to(n);
                self.skip -= n as u64;
                if self.skip > 0 {
                    return Ok(None);
                }
            }
            let f = match frame::decode(&mut self.input.buf, self.ctx.config.max_frame_bytes) {
                Ok(None) => return Ok(None),
                Ok(Some(f)) => f,
                Err(FrameError::TooLarge { len, max, request_id, opcode }) => {
                    if request_id.is_none() && self.input.buf.len() < 4 + frame::HEADER_LEN {
                        return Ok(None); // read the header first, to know whom to answer
                    }
                    self.skip = 4 + len as u64;
                    // Named by the settings a user can look up: a message that big never fits.
                    let limit = format!("max_frame_bytes {max}, for messages up to max_message_bytes and their fields");
                    let r =
                        Response::error(Status::TooLarge, format!("frame of {len} bytes exceeds the limit ({limit})"));
                    self.answer(&r, opcode.unwrap_or(0), request_id.unwrap_or(0));
                    continue;
                }
                Err(FrameError::Unsupported { version, kind, request_id, opcode }) => {
                    let r =
                        Response::error(Status::Unsupported, format!("protocol version {version}, frame kind {kind}"));
                    self.answer(&r, opcode, request_id);
                    continue;
                }
                Err(e @ FrameError::Malformed(_)) => {
                    tracing::debug!(error = %e, "closing connection");
                    return Err(Closed);
                }
            };
            self.input.taken();
            self.entry.request();
            self.ctx.stats.native_request(f.opcode);
            let refused = match f.kind {
                FrameKind::Request => {
                    let call =
                        (f.opcode == petrel_proto::opcode::RETURN).then(|| Request::return_call(&f.body)).flatten();
                    match Request::decode(f.opcode, f.body) {
                        Ok(request) => {
                            return Ok(Some(Incoming { opcode: f.opcode, request_id: f.request_id, request }));
                        }
                        Err(DecodeError::UnknownOpcode(op)) => {
                            Response::error(Status::Unsupported, format!("unknown opcode {op:#06x}"))
                        }
                        Err(e) => self.refuse_return(call, e),
                    }
                }
                _ => Response::error(Status::BadRequest, "clients send requests only"),
            };
            self.answer(&refused, f.opcode, f.request_id);
        }
    }

    /// Sends the answers in `out`: writes them if nothing waits in the outbox, else queues them
    /// behind it. `Err`: the connection cannot be written to.
    pub async fn flush(&mut self) -> Result<(), Closed> {
        if self.out.is_empty() {
            return Ok(());
        }
        self.answers = 0;
        self.early_at = self.early_at.saturating_mul(2);
        // Idle is checked holding the write half, so nothing queued can be written meanwhile.
        if let Ok(mut wr) = Arc::clone(&self.wire).try_lock_owned()
            && self.outbox.is_idle()
        {
            // What the socket takes now; the reader never waits for a client that does not read
            // (the outbox holds answers for it, bounded) unless a frame is half sent.
            let mut sent = 0;
            while sent < self.out.len() {
                let step =
                    std::future::poll_fn(|cx| match std::pin::Pin::new(&mut *wr).poll_write(cx, &self.out[sent..]) {
                        std::task::Poll::Pending => std::task::Poll::Ready(Ok(0)),
                        ready => ready,
                    });
                match step.await {
                    Ok(0) => break,
                    Ok(n) => sent += n,
                    Err(_) => return Err(Closed),
                }
            }
            if sent > 0 {
                add(&self.ctx.stats.bytes_written, sent as u64);
                self.entry.sent(sent);
                // A TLS stream may still hold the last records of what it took (its write
                // returns once it has the bytes): sent now if the socket takes them, else by the
                // task below, since nothing else would send them before the client's next
                // request, which waits for them.
                let flushed = sent == self.out.len()
                    && std::future::poll_fn(|cx| match std::pin::Pin::new(&mut *wr).poll_flush(cx) {
                        std::task::Poll::Pending => std::task::Poll::Ready(Ok(false)),
                        std::task::Poll::Ready(done) => std::task::Poll::Ready(done.map(|()| true)),
                    })
                    .await
                    .map_err(|_| Closed)?;
                if flushed {
                    self.out.clear();
                    return Ok(());
                }
                // The rest must follow at once: nothing may come between the halves of a frame.
                // A task of its own writes it, holding the write half, so that this flush given
                // up meanwhile (a stop, a client stalled) cannot leave half a frame on the wire
                // with other bytes after it: what is sent later waits in the outbox for the
                // write half, and goes out after the rest. The task ends once the rest is
                // written, or past the stop's grace, or when the connection closes (`close`);
                // a rest not written ends the stream where it is.
                let out = std::mem::replace(&mut self.out, Vec::with_capacity(ANSWERS_START_BYTES));
                let (mut stop, ctx, entry) = (self.stop.clone(), Arc::clone(&self.ctx), Arc::clone(&self.entry));
                let finishing = self.finishing.insert(tokio::spawn(async move {
                    let written = tokio::select! {
                        biased;
                        written = async { wr.write_all(&out[sent..]).await.and(wr.flush().await) } => written.is_ok(),
                        () = past_the_stop(&mut stop) => false,
                    };
                    match written {
                        true => {
                            add(&ctx.stats.bytes_written, (out.len() - sent) as u64);
                            entry.sent(out.len() - sent);
                        }
                        false => drop(tokio::time::timeout(stop.1, wr.shutdown()).await),
                    }
                    written
                }));
                let written = matches!(finishing.await, Ok(true));
                self.finishing = None;
                return if written { Ok(()) } else { Err(Closed) };
            }
        }
        let answers = self.take_answers();
        tokio::select! {
            biased;
            queued = self.outbox.send(answers) => queued.map_err(|_| Closed),
            // A full outbox waits for a client that may never read.
            () = past_the_stop(&mut self.stop) => Err(Closed),
        }
    }

    /// Reads more bytes. A frame too large for the server's memory budget now is refused
    /// (answered in `out`, and skipped) instead; `Err`: the client closed the connection.
    /// `trusted`: the client logged in (or needs not); before that, a request larger than
    /// `input::UNTRUSTED_BYTES` is refused and skipped unread, so that a client that did not log
    /// in holds no more than that of the server's memory.
    pub async fn read(&mut self, trusted: bool) -> Result<(), Closed> {
        self.early_at = FLUSH_ANSWERS_AT_COUNT;
        let incomplete = if self.skip > 0 { None } else { incomplete_frame(&self.input.buf) };
        if let Some(f) = incomplete.filter(|f| !trusted && f.len > crate::input::UNTRUSTED_BYTES) {
            self.skip = f.len as u64;
            let reason = format!("authenticate before sending a request of {} bytes", f.len);
            self.answer(&Response::error(Status::Unauthorized, reason), f.opcode, f.request_id);
            return Ok(());
        }
        // No room is made for a frame over the limit: it is refused once its header is decoded
        // (and skipped unread), which a read while a request waits for a permit comes before.
        let limit = 4 + self.ctx.config.max_frame_bytes as usize;
        let incomplete = incomplete.filter(|f| f.len <= limit);
        if self.input.prepare(incomplete.map(|f| f.len), &self.ctx.broker).is_err() {
            let f = incomplete.expect("only a large request is refused");
            self.skip = f.len as u64;
            let reason = format!(
                "a request of {} bytes does not fit in the server's memory budget (max_memory_bytes) now",
                f.len
            );
            self.answer(&Response::error(Status::LimitReached, reason), f.opcode, f.request_id);
            return Ok(());
        }
        match self.rd.read_buf(&mut self.input.buf).await {
            Ok(0) | Err(_) => Err(Closed),
            Ok(n) => {
                self.read_at_ns = crate::now_ns();
                self.input.filled(n);
                add(&self.ctx.stats.bytes_read, n as u64);
                self.entry.received(n);
                Ok(())
            }
        }
    }

    /// Stops taking answers; the rest of a frame half written and then what the writer holds are
    /// sent (for up to `grace`), then the connection closes.
    pub async fn close(self, grace: std::time::Duration) {
        let Connection { outbox, mut writer, mut finishing, .. } = self;
        drop(outbox);
        let sent = tokio::time::timeout(grace, async {
            if let Some(finishing) = &mut finishing {
                let _ = finishing.await;
            }
            let _ = (&mut writer).await;
        });
        if sent.await.is_err() {
            // Requests still waiting (a long call) hold the writer's channel: do not wait for
            // them. A half frame's rest not written ends the stream there: the writer, waiting
            // for the write half, ends too, so nothing follows the half frame.
            // (The writer first: it waits for the write half, which the finishing task lets go
            // of as it is aborted.)
            writer.abort();
            if let Some(finishing) = finishing {
                finishing.abort();
            }
        }
    }
}

/// Waits for the server's stop and then its grace: how long the connection waits for a client
/// to take its answers.
async fn past_the_stop((shutdown, grace): &mut Stop) {
    let _ = shutdown.wait_for(|stop| *stop).await;
    tokio::time::sleep(*grace).await;
}

/// The writer task: whatever is ready goes out in one vectored write, without copying it.
async fn write_until_closed<W: AsyncWrite>(
    wire: Wire<W>,
    mut rx: crate::outbox::Outgoing,
    ctx: Arc<Ctx>,
    entry: Arc<crate::connections::Connection>,
) {
    let max_bytes = ctx.config.max_write_batch_bytes;
    let max_chunks = ctx.config.max_write_batch_chunks;
    let mut chunks: Vec<crate::outbox::Chunk> = Vec::new();
    while let Some(first) = rx.recv().await {
        let mut total = first.len();
        chunks.push(first);
        while total < max_bytes && chunks.len() < max_chunks {
            match rx.try_recv() {
                Some(more) => {
                    total += more.len();
                    chunks.push(more);
                }
                None => break,
            }
        }
        let mut wr = wire.lock().await;
        if write_all_vectored(&mut *wr, &chunks).await.is_err() {
            break;
        }
        for chunk in chunks.drain(..) {
            rx.written(&chunk);
        }
        drop(wr);
        add(&ctx.stats.bytes_written, total as u64);
        entry.sent(total);
    }
    let _ = wire.lock().await.shutdown().await;
}

/// Writes every chunk, in order, with as few system calls as the socket allows.
async fn write_all_vectored<W: AsyncWrite + Unpin>(wr: &mut W, chunks: &[crate::outbox::Chunk]) -> std::io::Result<()> {
    let mut slices: Vec<std::io::IoSlice<'_>> = chunks
        .iter()
        .flat_map(|c| [&c.frames[..], &c.payload[..]])
        .filter(|part| !part.is_empty())
        .map(std::io::IoSlice::new)
        .collect();
    let mut rest = &mut slices[..];
    while !rest.is_empty() {
        let n = wr.write_vectored(rest).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        std::io::IoSlice::advance_slices(&mut rest, n);
    }
    // What a TLS stream took and still holds (see `Connection::flush`).
    wr.flush().await
}
