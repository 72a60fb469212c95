//! The native protocol on one connection: frames in, requests to the broker, responses out.
//!
//! A reader loop decodes frames and answers what needs no waiting at once, in order, into one
//! buffer per read (so a pipelined burst of requests costs one write back); a poll that must wait
//! for a message, or an offer that must wait for room, becomes a task of its own, so a
//! connection can pipeline many requests. Every buffer is bounded: at most
//! `max_in_flight_per_connection` waiting requests (the reader stops reading past that, and TCP
//! pushes back on the client), at most `max_queued_responses` chunks and
//! `max_queued_response_bytes` bytes of answers waiting to be written (`outbox.rs`).
//!
//! Pushes share the writer: each subscription has a task that turns the broker's deliveries into
//! DELIVER frames, and a connection that serves functions has one that turns invocations into
//! INVOKE frames. When the writer cannot keep up, their bounded channels fill: a subscriber is
//! then ended by the broker (SUBSCRIPTION_END), a call goes to another server or fails.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use petrel_broker::security::{Action, Kind, Principal};
use petrel_broker::{BrokerError, Called, ConnId, Ended, GroupReader, Invocation, SeekTo, Subscription};
use petrel_proto::{Delivery, FrameError, FrameKind, Push, Request, Response, StartFrom, Status, features, frame};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{Semaphore, mpsc, watch};

use crate::auth::{self, Authenticated, Peer};
use crate::input::Input;
use crate::outbox::{Outbox, TrySendError, outbox};
use crate::stats::add;
use crate::{Ctx, convert, now_ns};

/// Who is on this connection, and what the server has said about it.
struct Session {
    conn: ConnId,
    peer: Peer,
    /// Said HELLO: the connection is past its handshake (and its shorter timeout).
    greeted: bool,
    authenticated: Option<Authenticated>,
    denials: auth::Denials,
    /// Negotiated in HELLO: payloads of at least this many bytes go out zstd-compressed.
    compress: Option<usize>,
}

impl Session {
    fn principal(&self) -> Option<&Principal> {
        self.authenticated.as_ref().map(|a| &a.principal)
    }

    /// Asks the broker whether this connection may do one of `actions` to `kind`/`name`.
    fn authorize(&mut self, ctx: &Ctx, kind: Kind, name: &str, actions: &[Action]) -> Result<(), BrokerError> {
        let principal = self.authenticated.as_ref().map(|a| &a.principal);
        auth::authorize(ctx, self.conn, principal, &mut self.denials, kind, name, actions)
    }
}

/// What a request touches, for the ACL check: the destination and the actions any of which
/// allows it. `None`: nothing beyond an authenticated user (or this connection's own handles).
fn needs(request: &Request) -> Option<(Kind, &str, &'static [Action])> {
    use Action::*;
    Some(match request {
        Request::QueueCreate { config, .. } if config.temporary => return None,
        Request::QueueCreate { name, .. } | Request::QueueRemove { name } => (Kind::Queue, name, &[Manage]),
        Request::QueueStatus { name } => (Kind::Queue, name, &[Offer, Poll]),
        Request::Offer { queue, .. } => (Kind::Queue, queue, &[Offer]),
        Request::Poll { queue, .. } => (Kind::Queue, queue, &[Poll]),
        Request::TopicCreate { name, .. } | Request::TopicRemove { name } => (Kind::Topic, name, &[Manage]),
        Request::Publish { topic, .. } => (Kind::Topic, topic, &[Publish]),
        Request::Subscribe { topic, .. } => (Kind::Topic, topic, &[Subscribe]),
        Request::TopicStatus { name } => (Kind::Topic, name, &[Publish, Subscribe]),
        Request::Serve { function } => (Kind::Function, function, &[Serve]),
        Request::Call { function, .. } => (Kind::Function, function, &[Exec]),
        Request::Hello { .. }
        | Request::Ping
        | Request::Auth { .. }
        | Request::QueueList
        | Request::TopicList
        | Request::Ack { .. }
        | Request::Abort { .. }
        | Request::TopicAck { .. }
        | Request::Unsubscribe { .. }
        | Request::Unserve { .. }
        | Request::Return { .. } => return None,
    })
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
    let opcode = u16::from_be_bytes([buf[6], buf[7]]);
    let request_id = u64::from_be_bytes(buf[8..16].try_into().expect("8 bytes"));
    (len > buf.len()).then_some(Incomplete { len, opcode, request_id })
}

/// Serves one connection until the client closes it, a protocol error makes it unsafe to go on,
/// or the server shuts down (then requests in flight finish first).
pub(crate) async fn serve<S>(stream: S, ctx: Arc<Ctx>, conn: ConnId, mut shutdown: watch::Receiver<bool>, peer: Peer)
where
    S: AsyncRead + AsyncWrite + Send + 'static,
{
    let connection = crate::connections::Registry::open(&ctx, conn, &peer, "native");
    let _disconnect = crate::Disconnect { broker: Arc::clone(&ctx.broker), conn };
    let (mut rd, mut wr) = tokio::io::split(stream);
    let (tx, mut rx) = outbox(ctx.config.max_queued_responses, ctx.config.max_queued_response_bytes);
    let written = Arc::clone(&ctx);
    let written_by = Arc::clone(connection.entry());
    let writer = tokio::spawn(async move {
        let mut chunks: Vec<Vec<u8>> = Vec::new();
        while let Some(first) = rx.recv().await {
            // Whatever else is ready goes in the same (vectored) write, without copying it.
            let mut total = first.len();
            chunks.push(first);
            while total < 256 * 1024 && chunks.len() < 64 {
                match rx.try_recv() {
                    Some(more) => {
                        total += more.len();
                        chunks.push(more);
                    }
                    None => break,
                }
            }
            if write_all_vectored(&mut wr, &chunks).await.is_err() {
                break;
            }
            chunks.clear();
            add(&written.stats.bytes_written, total as u64);
            written_by.sent(total);
        }
        let _ = wr.shutdown().await;
    });
    let limit = ctx.config.max_in_flight_per_connection;
    let in_flight = Arc::new(Semaphore::new(limit));
    // Offers waiting for the disk count apart: polls waiting for messages must not hold every
    // permit while the offers that would make messages visible wait for one.
    let syncing = Arc::new(Semaphore::new(limit));
    let mut input = Input::new();
    // Answers to the requests of one read, sent to the writer together.
    let mut out = Vec::with_capacity(16 * 1024);
    let mut skip: u64 = 0;
    let mut pushes = Pushes::default();
    let mut session =
        Session { conn, peer, greeted: false, authenticated: None, denials: auth::Denials::default(), compress: None };
    if let Some(certified) = auth::with_certificate(&ctx, &session.peer, conn) {
        match certified {
            Ok(a) => {
                connection.set_user(&a.principal.user);
                session.authenticated = Some(a);
            }
            Err(reason) => tracing::info!(conn, reason, "client certificate not accepted; a password may follow"),
        }
    }
    let handshake_timeout = ctx.config.security.handshake_timeout().unwrap_or(Duration::from_secs(10));
    let idle_timeout = ctx.limits.idle_timeout();
    'read: loop {
        // Whole frames already buffered first.
        loop {
            if out.len() >= 64 * 1024 && !pushes.flush(&tx, &mut out).await {
                break 'read;
            }
            if skip > 0 {
                let n = skip.min(input.buf.len() as u64) as usize;
                let _ = input.buf.split_to(n);
                skip -= n as u64;
                if skip > 0 {
                    break;
                }
            }
            match frame::decode(&mut input.buf, ctx.config.max_frame_bytes) {
                Ok(None) => break,
                Ok(Some(f)) => {
                    connection.request();
                    ctx.stats.native_request(f.opcode);
                    if f.kind != FrameKind::Request {
                        let r = Response::error(Status::BadRequest, "clients send requests only");
                        r.encode(f.opcode, f.request_id, &mut out);
                        continue;
                    }
                    let request = match Request::decode(f.opcode, f.body) {
                        Ok(r) => r,
                        Err(petrel_proto::DecodeError::UnknownOpcode(op)) => {
                            let r = Response::error(Status::Unsupported, format!("unknown opcode {op:#06x}"));
                            r.encode(f.opcode, f.request_id, &mut out);
                            continue;
                        }
                        Err(e) => {
                            Response::error(Status::BadRequest, e.to_string()).encode(f.opcode, f.request_id, &mut out);
                            continue;
                        }
                    };
                    if let Request::Auth { user, password } = request {
                        // Answered before the requests pipelined behind it are read.
                        let answer = if !ctx.broker.auth_enabled() {
                            Response::Done
                        } else {
                            match auth::with_password(&ctx, &session.peer, conn, user, password).await {
                                Ok(a) => {
                                    connection.set_user(&a.principal.user);
                                    session.authenticated = Some(a);
                                    Response::Done
                                }
                                Err(reason) => Response::error(Status::Unauthorized, reason),
                            }
                        };
                        answer.encode(f.opcode, f.request_id, &mut out);
                        continue;
                    }
                    match handle(&ctx, &mut session, &mut pushes, &tx, request) {
                        Ok(response) => response.encode(f.opcode, f.request_id, &mut out),
                        Err(Waiting::Call { function, message, oneway, timeout }) => {
                            // A call in progress holds a permit, as a waiting poll does.
                            let Ok(permit) = Arc::clone(&in_flight).acquire_owned().await else { break 'read };
                            let reply = replier(tx.clone(), f.opcode, f.request_id, permit, session.compress);
                            match ctx.broker.call(conn, &function, *message, oneway, now_ns(), timeout, reply) {
                                Ok(Called::Replied(m)) => {
                                    Response::Reply { message: convert::outgoing(*m, session.compress) }
                                }
                                Ok(Called::Sent) => Response::Done,
                                Ok(Called::Pending { .. }) => continue,
                                Err(e) => error(e),
                            }
                            .encode(f.opcode, f.request_id, &mut out);
                        }
                        Err(Waiting::GroupBusy { request }) => {
                            // Give a subscription that is ending a moment to let its group go.
                            let mut answer = None;
                            for _ in 0..20 {
                                tokio::time::sleep(Duration::from_millis(10)).await;
                                match handle(&ctx, &mut session, &mut pushes, &tx, (*request).clone()) {
                                    Err(Waiting::GroupBusy { .. }) => {}
                                    Ok(r) => {
                                        answer = Some(r);
                                        break;
                                    }
                                    Err(_) => unreachable!("a subscribe answers at once"),
                                }
                            }
                            let busy = || Response::error(Status::Exists, "the group is subscribed already");
                            answer.unwrap_or_else(busy).encode(f.opcode, f.request_id, &mut out);
                        }
                        Err(waiting) => {
                            // Past the limit of waiting requests, stop reading: TCP pushes back.
                            let permits = if matches!(waiting, Waiting::Sync { .. }) { &syncing } else { &in_flight };
                            let Ok(permit) = Arc::clone(permits).acquire_owned().await else { break 'read };
                            let (ctx, tx, (op, id)) = (Arc::clone(&ctx), tx.clone(), (f.opcode, f.request_id));
                            tokio::spawn(async move {
                                let r = waiting.finish(&ctx, conn).await;
                                send(&tx, op, id, &r).await;
                                drop(permit);
                            });
                        }
                    }
                }
                Err(FrameError::TooLarge { len, max, request_id, opcode }) => {
                    if request_id.is_none() && input.buf.len() < 4 + frame::HEADER_LEN {
                        break; // read the header first, to know whom to answer
                    }
                    skip = 4 + len as u64;
                    let r =
                        Response::error(Status::TooLarge, format!("frame of {len} bytes exceeds the limit of {max}"));
                    r.encode(opcode.unwrap_or(0), request_id.unwrap_or(0), &mut out);
                }
                Err(FrameError::Unsupported { version, kind, request_id, opcode }) => {
                    let r =
                        Response::error(Status::Unsupported, format!("protocol version {version}, frame kind {kind}"));
                    r.encode(opcode, request_id, &mut out);
                }
                Err(e @ FrameError::Malformed(_)) => {
                    tracing::debug!(conn, error = %e, "closing connection");
                    break 'read;
                }
            }
        }
        if !out.is_empty() && !pushes.flush(&tx, &mut out).await {
            break;
        }
        let incomplete = if skip > 0 { None } else { incomplete_frame(&input.buf) };
        if input.prepare(incomplete.map(|f| f.len), &ctx.broker).is_err() {
            let f = incomplete.expect("only a large request is refused");
            skip = f.len as u64;
            let reason = format!(
                "a request of {} bytes does not fit in the server's memory budget (max_memory_bytes) now",
                f.len
            );
            Response::error(Status::LimitReached, reason).encode(f.opcode, f.request_id, &mut out);
            continue;
        }
        // Silent too long, with nothing under way: closed (before HELLO, sooner).
        let quiet_limit = if session.greeted { idle_timeout } else { Some(handshake_timeout) };
        tokio::select! {
            read = rd.read_buf(&mut input.buf) => match read {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    input.filled(n);
                    add(&ctx.stats.bytes_read, n as u64);
                    connection.received(n);
                }
            },
            _ = shutdown.changed() => break,
            _ = crate::sleep_or_never(quiet_limit) => {
                if in_flight.available_permits() == limit && syncing.available_permits() == limit && pushes.is_empty() {
                    add(&ctx.stats.idle_closed, 1);
                    tracing::debug!(conn, "closing an idle connection");
                    break;
                }
            }
        }
    }
    if !out.is_empty() {
        pushes.flush(&tx, &mut out).await;
    }
    pushes.stop();
    // Let requests in flight finish (bounded by the server's shutdown grace), then close.
    let grace = ctx.config.shutdown_grace().unwrap_or(Duration::from_secs(5));
    let _ = tokio::time::timeout(grace, async {
        let _ = in_flight.acquire_many(limit as u32).await;
        let _ = syncing.acquire_many(limit as u32).await;
    })
    .await;
    drop(tx);
    // Requests still waiting (a long call) hold the writer's channel: do not wait for them.
    let mut writer = writer;
    if tokio::time::timeout(grace, &mut writer).await.is_err() {
        writer.abort();
    }
}

/// Pushes hold at most 64 KiB of messages or one message (itself at most `max_message_bytes`,
/// well under a frame's 4 GiB), so this does not happen; if it did, the push is left out (its
/// buffer is empty) and said in the log, rather than sent with a wrong length.
fn not_sent_if_too_long(encoded: Result<(), petrel_proto::EncodeError>) {
    if let Err(e) = encoded {
        tracing::error!(error = %e, "a push was not sent");
    }
}

/// Writes every chunk, in order, with as few system calls as the socket allows.
async fn write_all_vectored<W: AsyncWrite + Unpin>(wr: &mut W, chunks: &[Vec<u8>]) -> std::io::Result<()> {
    let mut slices: Vec<std::io::IoSlice<'_>> = chunks.iter().map(|c| std::io::IoSlice::new(c)).collect();
    let mut rest = &mut slices[..];
    while !rest.is_empty() {
        let n = wr.write_vectored(rest).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        std::io::IoSlice::advance_slices(&mut rest, n);
    }
    Ok(())
}

/// The tasks that push to this connection: one per subscription, one for invocations.
#[derive(Default)]
struct Pushes {
    subscriptions: HashMap<u64, tokio::task::JoinHandle<()>>,
    invocations: Option<(mpsc::Sender<Invocation>, tokio::task::JoinHandle<()>)>,
    /// New subscriptions wait for these before their first push, so that the client has the
    /// SUBSCRIBE answer (still in the reader's buffer) before any delivery.
    answered: Vec<tokio::sync::oneshot::Sender<()>>,
    /// Group subscriptions of durable topics: each runs on a task of its own, which takes
    /// acknowledgements on this channel and stops when it closes.
    groups: HashMap<u64, (mpsc::Sender<GroupAck>, tokio::task::JoinHandle<()>)>,
}

/// Acknowledgements for a group subscription, and where to say how many counted.
type GroupAck = (Vec<u64>, tokio::sync::oneshot::Sender<u32>);

/// Runs `job` on a group reader as a short blocking call (the log's reads and acknowledgements
/// may touch the disk); the reader travels there and back.
async fn blocking<T: Send + 'static>(
    mut reader: GroupReader,
    job: impl FnOnce(&mut GroupReader) -> T + Send + 'static,
) -> (GroupReader, T) {
    tokio::task::spawn_blocking(move || {
        let out = job(&mut reader);
        (reader, out)
    })
    .await
    .expect("a group read or acknowledgement does not panic")
}

/// Applies a group subscription's acknowledgements and answers how many counted.
async fn apply_acks(reader: GroupReader, (ids, done): GroupAck) -> GroupReader {
    let (reader, counted) = blocking(reader, move |r| {
        r.ack(&ids).unwrap_or_else(|e| {
            tracing::error!(error = %e, "group acknowledgement failed");
            0
        })
    })
    .await;
    let _ = done.send(counted);
    reader
}

impl Pushes {
    /// Hands the answers in `out` to the writer, then lets new subscriptions push.
    async fn flush(&mut self, tx: &Outbox, out: &mut Vec<u8>) -> bool {
        let sent = tx.send(std::mem::take(out)).await.is_ok();
        for go in self.answered.drain(..) {
            let _ = go.send(());
        }
        sent
    }

    /// Nothing pushes to this connection: it may be closed for idleness.
    fn is_empty(&self) -> bool {
        self.subscriptions.is_empty() && self.groups.is_empty() && self.invocations.is_none()
    }

    fn stop(&mut self) {
        for (_, task) in self.subscriptions.drain() {
            task.abort();
        }
        self.groups.clear();
        if let Some((_, task)) = self.invocations.take() {
            task.abort();
        }
    }

    /// Forwards a subscription's messages as DELIVER pushes, several per frame when they queue up.
    fn subscribe(&mut self, mut sub: Subscription, tx: Outbox, compress: Option<usize>) {
        let id = sub.id;
        let (go, answered) = tokio::sync::oneshot::channel();
        self.answered.push(go);
        let task = tokio::spawn(async move {
            if answered.await.is_err() {
                return;
            }
            let mut batch = Vec::new();
            while let Some(first) = sub.recv().await {
                batch.push(first);
                // A frame of up to 256 messages or 64 KiB: the writer's queue is bounded in
                // frames, so a frame's size bounds its memory too.
                let mut bytes = batch[0].message.size();
                while batch.len() < 256 && bytes < 64 * 1024 {
                    match sub.try_recv() {
                        Some(m) => {
                            bytes += m.message.size();
                            batch.push(m);
                        }
                        None => break,
                    }
                }
                // Each message is encoded once, by whichever subscriber's task gets to it first
                // (one that goes out compressed, for this connection alone).
                let encoded: Vec<bytes::Bytes> = batch
                    .iter()
                    .map(|d| {
                        let encode = |compress| {
                            let mut out = Vec::with_capacity(d.message.payload.len() + 64);
                            convert::outgoing(d.message.clone(), compress).encode_to(&mut out);
                            bytes::Bytes::from(out)
                        };
                        match compress {
                            Some(min) if d.message.payload.len() >= min => encode(compress),
                            _ => d.encoded.get_or_init(|| encode(None)).clone(),
                        }
                    })
                    .collect();
                let mut out = Vec::with_capacity(encoded.iter().map(|e| e.len()).sum::<usize>() + 32);
                not_sent_if_too_long(Push::encode_deliver(id, &encoded, &mut out));
                drop(encoded);
                batch.clear();
                if tx.send(out).await.is_err() {
                    return;
                }
            }
            let end = match sub.ended.get() {
                Some(Ended::TooSlow(reason)) => {
                    Push::SubscriptionEnd { status: Status::SlowConsumer, reason: reason.clone() }
                }
                Some(Ended::TopicRemoved(reason)) => {
                    Push::SubscriptionEnd { status: Status::TopicNotFound, reason: reason.clone() }
                }
                None => return,
            };
            let mut out = Vec::new();
            not_sent_if_too_long(end.encode(id, &mut out));
            let _ = tx.send(out).await;
        });
        self.subscriptions.insert(id, task);
    }

    /// Delivers a consumer group's messages as DELIVER pushes, at most `max_pending`
    /// unacknowledged. An async task, not a thread: it waits for the topic's writer (an async
    /// wake-up) or an acknowledgement, and each read or acknowledgement of the log runs as a
    /// short blocking call, so thousands of idle group subscribers hold no thread.
    fn subscribe_group(
        &mut self,
        id: u64,
        reader: GroupReader,
        max_pending: usize,
        tx: Outbox,
        compress: Option<usize>,
    ) {
        let (acks_tx, mut acks) = mpsc::channel::<GroupAck>(1024);
        let (go, answered) = tokio::sync::oneshot::channel();
        self.answered.push(go);
        let appended = reader.appended();
        let mut reader = reader;
        let task = tokio::spawn(async move {
            if answered.await.is_err() {
                return;
            }
            loop {
                // Acknowledgements first: they make room.
                while let Ok(ack) = acks.try_recv() {
                    reader = apply_acks(reader, ack).await;
                }
                let pending = reader.pending();
                if pending >= max_pending {
                    // Nothing more until something is acknowledged.
                    match acks.recv().await {
                        Some(ack) => reader = apply_acks(reader, ack).await,
                        None => return,
                    }
                    continue;
                }
                // Registered before the read, so an append between the two still wakes us.
                let woken = appended.notified();
                tokio::pin!(woken);
                woken.as_mut().enable();
                let room = (max_pending - pending).min(256);
                let messages;
                (reader, messages) = blocking(reader, move |r| r.poll(room, Duration::ZERO)).await;
                let messages = match messages {
                    Ok(messages) => messages,
                    Err(e) => {
                        let mut out = Vec::new();
                        let end = Push::SubscriptionEnd { status: Status::ServerError, reason: e.to_string() };
                        not_sent_if_too_long(end.encode(id, &mut out));
                        let _ = tx.send(out).await;
                        return;
                    }
                };
                if messages.is_empty() {
                    tokio::select! {
                        _ = &mut woken => {}
                        ack = acks.recv() => match ack {
                            Some(ack) => reader = apply_acks(reader, ack).await,
                            None => return,
                        },
                        // A retention pass or a seek elsewhere wakes no one: look again now and then.
                        _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                    }
                    continue;
                }
                // Frames of at most 64 KiB of messages (or one bigger message).
                let mut frame: Vec<petrel_proto::Message> = Vec::new();
                let mut bytes = 0;
                let last = messages.len();
                for (i, m) in messages.into_iter().enumerate() {
                    bytes += m.size();
                    frame.push(convert::outgoing(m, compress));
                    if bytes >= 64 * 1024 || i + 1 == last {
                        let mut out = Vec::with_capacity(bytes as usize + 64 * frame.len());
                        not_sent_if_too_long(
                            Push::Deliver { messages: std::mem::take(&mut frame) }.encode(id, &mut out),
                        );
                        bytes = 0;
                        if tx.send(out).await.is_err() {
                            return;
                        }
                    }
                }
            }
        });
        self.groups.insert(id, (acks_tx, task));
    }

    /// The channel the broker sends this connection's invocations on (made at the first SERVE).
    fn invocations(&mut self, tx: &Outbox, capacity: usize, compress: Option<usize>) -> mpsc::Sender<Invocation> {
        let (sender, _) = self.invocations.get_or_insert_with(|| {
            let (sender, mut invocations) = mpsc::channel::<Invocation>(capacity);
            let tx = tx.clone();
            let task = tokio::spawn(async move {
                while let Some(inv) = invocations.recv().await {
                    let mut out = Vec::with_capacity(inv.message.size() as usize + 256);
                    let push = Push::Invoke {
                        function: inv.function,
                        message: Box::new(convert::outgoing(inv.message, compress)),
                    };
                    not_sent_if_too_long(push.encode(inv.call, &mut out));
                    if tx.send(out).await.is_err() {
                        return;
                    }
                }
            });
            (sender, task)
        });
        sender.clone()
    }
}

/// Where a call's outcome goes: straight to the caller's writer (a task only if its queue is
/// full); the permit is the call's place among the connection's waiting requests.
fn replier(
    tx: Outbox,
    op: u16,
    request_id: u64,
    permit: tokio::sync::OwnedSemaphorePermit,
    compress: Option<usize>,
) -> petrel_broker::Replier {
    Box::new(move |outcome| {
        let response = match outcome {
            Ok(message) => Response::Reply { message: convert::outgoing(message, compress) },
            Err(e) => error(e),
        };
        let mut out = Vec::with_capacity(64);
        response.encode(op, request_id, &mut out);
        if let Err(TrySendError::Full(out)) = tx.try_send(out) {
            tokio::spawn(async move {
                let _ = tx.send(out).await;
                drop(permit);
            });
        }
    })
}

async fn send(tx: &Outbox, op: u16, request_id: u64, response: &Response) {
    let mut out = Vec::with_capacity(64);
    response.encode(op, request_id, &mut out);
    let _ = tx.send(out).await;
}

fn error(e: BrokerError) -> Response {
    let status = match &e {
        BrokerError::NotFound(_) => Status::QueueNotFound,
        BrokerError::Full(_) => Status::QueueFull,
        BrokerError::Exists(_) => Status::Exists,
        BrokerError::BadRequest(_) => Status::BadRequest,
        BrokerError::TooLarge { .. } | BrokerError::NeverFits(_) => Status::TooLarge,
        BrokerError::Storage(_) | BrokerError::Definitions(_) | BrokerError::DataDirLocked(_) => Status::ServerError,
        BrokerError::TopicNotFound(_) => Status::TopicNotFound,
        BrokerError::FunctionNotFound(_) => Status::FunctionNotFound,
        BrokerError::Handler(_) => Status::HandlerError,
        BrokerError::Timeout(_) => Status::Timeout,
        BrokerError::Unauthorized(_) => Status::Unauthorized,
        BrokerError::Forbidden(_) => Status::Forbidden,
        BrokerError::Limit(_) => Status::LimitReached,
    };
    if status == Status::ServerError {
        tracing::error!(error = ?e, "request failed"); // with the paths the client is not shown
    }
    Response::error(status, e.to_string())
}

/// A request that must wait: for a message (poll), for room (offer), for a reply (call), for a
/// group subscription's thread to apply acknowledgements or to let its group go.
enum Waiting {
    GroupReleased {
        task: tokio::task::JoinHandle<()>,
    },
    /// The group is held by a subscription that is ending (a client that just reconnected).
    GroupBusy {
        request: Box<Request>,
    },
    GroupAck {
        counted: tokio::sync::oneshot::Receiver<u32>,
    },
    Offer {
        queue: String,
        messages: Vec<petrel_broker::Message>,
        timeout_ms: u32,
    },
    /// An offer stored and answered once on disk (a queue whose log syncs every offer).
    Sync {
        unsynced: petrel_broker::UnsyncedOffer,
        first_id: u64,
        count: u32,
    },
    Poll {
        queue: String,
        max: usize,
        visibility: Option<Duration>,
        timeout_ms: u32,
        compress: Option<usize>,
    },
    /// A call to a function served by a connection: made once the caller holds a permit, and
    /// answered by its replier (no task waits for it).
    Call {
        function: String,
        message: Box<petrel_broker::Message>,
        oneway: bool,
        timeout: Duration,
    },
}

/// How long a call waits for its reply when the caller gives no timeout.
const DEFAULT_CALL_TIMEOUT: Duration = Duration::from_secs(30);
/// Messages the server holds for a subscriber that gave no buffer size.
const DEFAULT_SUBSCRIBER_BUFFER: usize = 1024;
const MAX_SUBSCRIBER_BUFFER: usize = 1 << 20;

impl Waiting {
    async fn finish(self, ctx: &Ctx, conn: ConnId) -> Response {
        match self {
            Waiting::Offer { queue, messages, timeout_ms } => offer_waiting(ctx, &queue, messages, timeout_ms).await,
            Waiting::Sync { unsynced, first_id, count } => match crate::wait_durable(unsynced).await {
                Ok(()) => Response::Offered { first_id, count },
                Err(e) => error(e),
            },
            Waiting::Poll { queue, max, visibility, timeout_ms, compress } => {
                poll_waiting(ctx, conn, &queue, max, visibility, timeout_ms, compress).await
            }
            Waiting::GroupAck { counted } => match counted.await {
                Ok(count) => Response::Acked { count },
                Err(_) => Response::error(Status::ServerError, "the subscription ended"),
            },
            Waiting::GroupReleased { task } => {
                let _ = task.await;
                Response::Done
            }
            Waiting::Call { .. } | Waiting::GroupBusy { .. } => unreachable!("handled by the reader loop"),
        }
    }
}

/// Answers one request at once, or says what it must wait for.
fn handle(
    ctx: &Ctx,
    session: &mut Session,
    pushes: &mut Pushes,
    tx: &Outbox,
    request: Request,
) -> Result<Response, Waiting> {
    let broker = &ctx.broker;
    let conn = session.conn;
    if !matches!(request, Request::Hello { .. } | Request::Ping)
        && let Err(e) = broker.authenticated(session.principal())
    {
        return Ok(error(e));
    }
    if let Some((kind, name, actions)) = needs(&request)
        && let Err(denied) = session.authorize(ctx, kind, name, actions)
    {
        return Ok(error(denied));
    }
    // Compressed payloads are restored first: a request unfolds to at most a frame's worth.
    let mut request = request;
    let messages = petrel_proto::compression::request_messages(&mut request);
    if let Err(e) = petrel_proto::compression::decompress_all(messages, ctx.config.max_frame_bytes as usize) {
        return Ok(Response::error(Status::BadRequest, e.to_string()));
    }
    Ok(match request {
        Request::Hello { features: wanted, .. } => {
            session.greeted = true;
            let mut features = 0;
            if wanted & features::ZSTD != 0 && ctx.config.compress_min_bytes > 0 {
                session.compress = Some(ctx.config.compress_min_bytes);
                features |= features::ZSTD;
            }
            if broker.auth_enabled() && session.authenticated.is_none() {
                features |= features::AUTH_REQUIRED;
            }
            Response::Hello {
                server: format!("petrel/{}", env!("CARGO_PKG_VERSION")),
                max_frame: ctx.config.max_frame_bytes,
                features,
            }
        }
        Request::Ping => Response::Pong,
        Request::Auth { .. } => unreachable!("answered by the reader loop"),
        Request::QueueCreate { name, config } => {
            let owner = config.temporary.then_some(conn);
            match convert::config_in(config) {
                Ok(config) => broker
                    .create_queue_by(session.principal(), &name, config, owner)
                    .map_or_else(error, |_| Response::Done),
                Err(e) => Response::error(Status::BadRequest, e),
            }
        }
        Request::QueueRemove { name } => match broker.remove_queue(&name) {
            Ok(()) => Response::Done,
            Err(e) => error(e),
        },
        Request::QueueList => Response::QueueList {
            names: broker
                .queue_names()
                .into_iter()
                .filter(|n| broker.may(session.principal(), Kind::Queue, n, &[Action::Offer, Action::Poll]))
                .collect(),
        },
        Request::QueueStatus { name } => match broker.queue(&name) {
            Some(q) => Response::QueueStatus { stats: convert::stats_out(q.stats(), &q.config()) },
            None => error(BrokerError::NotFound(name)),
        },
        Request::Offer { queue, timeout_ms, messages } => {
            let mut messages: Vec<_> = messages.into_iter().map(convert::message_in).collect();
            let offered = broker.queue(&queue).ok_or_else(|| BrokerError::NotFound(queue.clone()));
            match offered.and_then(|q| broker.offer_unsynced(&q, &mut messages, now_ns())) {
                Err(BrokerError::Full(_)) if timeout_ms > 0 => {
                    return Err(Waiting::Offer { queue, messages, timeout_ms });
                }
                Ok((first_id, count, unsynced)) if !unsynced.is_durable() => {
                    return Err(Waiting::Sync { unsynced, first_id, count });
                }
                Ok((first_id, count, _)) => Response::Offered { first_id, count },
                Err(e) => error(e),
            }
        }
        Request::Poll { queue, max, timeout_ms, visibility_ms } => {
            let visibility = (visibility_ms > 0).then(|| Duration::from_millis(visibility_ms as u64));
            let max = (max as usize).clamp(1, 10_000);
            match broker.poll(&queue, max, visibility, conn, now_ns()) {
                Ok(d) if d.is_empty() && timeout_ms > 0 => {
                    return Err(Waiting::Poll { queue, max, visibility, timeout_ms, compress: session.compress });
                }
                Ok(d) => polled(d, session.compress),
                Err(e) => error(e),
            }
        }
        Request::Ack { queue, handles } => match broker.ack(&queue, &handles, conn) {
            Ok(count) => Response::Acked { count },
            Err(e) => error(e),
        },
        Request::Abort { queue, handles } => match broker.abort(&queue, &handles, conn) {
            Ok(count) => Response::Acked { count },
            Err(e) => error(e),
        },
        Request::TopicCreate { name, durable } => {
            broker.create_topic(&name, durable).map_or_else(error, |_| Response::Done)
        }
        Request::TopicRemove { name } => broker.remove_topic(&name).map_or_else(error, |()| Response::Done),
        Request::TopicList => Response::TopicList {
            names: broker
                .topic_names()
                .into_iter()
                .filter(|n| broker.may(session.principal(), Kind::Topic, n, &[Action::Publish, Action::Subscribe]))
                .collect(),
        },
        Request::TopicStatus { name } => match broker.topic(&name) {
            Some(t) => Response::TopicStatus { stats: convert::topic_stats_out(&t) },
            None => error(BrokerError::TopicNotFound(name)),
        },
        Request::Publish { topic, messages } => {
            let messages = messages.into_iter().map(convert::message_in).collect();
            broker
                .publish(&topic, messages, now_ns())
                .map_or_else(error, |subscribers| Response::Published { subscribers })
        }
        Request::Subscribe { topic, buffer, group, from } if !group.is_empty() => {
            let original_from = from;
            let Some(t) = broker.topic(&topic) else { return Ok(error(BrokerError::TopicNotFound(topic))) };
            let max_pending = match buffer {
                0 => DEFAULT_SUBSCRIBER_BUFFER,
                n => (n as usize).min(petrel_log::MAX_PENDING),
            };
            let from = match from {
                StartFrom::Resume => None,
                StartFrom::Oldest => Some(SeekTo::Oldest),
                StartFrom::Newest => Some(SeekTo::Newest),
                StartFrom::Offset(o) => Some(SeekTo::Offset(o)),
                StartFrom::Time(t) => Some(SeekTo::Time(t)),
            };
            match t.group(&group, from, max_pending) {
                Ok(reader) => {
                    let subscription = broker.next_id();
                    pushes.subscribe_group(subscription, reader, max_pending, tx.clone(), session.compress);
                    Response::Subscribed { subscription }
                }
                Err(BrokerError::Storage(petrel_log::Error::GroupInUse { .. })) => {
                    return Err(Waiting::GroupBusy {
                        request: Box::new(Request::Subscribe { topic, buffer, group, from: original_from }),
                    });
                }
                Err(e) => error(e),
            }
        }
        Request::Subscribe { topic, buffer, .. } => {
            let buffer = match buffer {
                0 => DEFAULT_SUBSCRIBER_BUFFER,
                n => (n as usize).min(MAX_SUBSCRIBER_BUFFER),
            };
            match broker.subscribe(&topic, conn, buffer) {
                Ok(sub) => {
                    let subscription = sub.id;
                    pushes.subscribe(sub, tx.clone(), session.compress);
                    Response::Subscribed { subscription }
                }
                Err(e) => error(e),
            }
        }
        Request::TopicAck { subscription, ids } => {
            let Some((acks, _)) = pushes.groups.get(&subscription) else {
                return Ok(Response::error(Status::BadRequest, format!("no group subscription {subscription}")));
            };
            let (done, counted) = tokio::sync::oneshot::channel();
            if acks.try_send((ids, done)).is_err() {
                return Ok(Response::error(Status::ServerError, "too many acknowledgements waiting; retry"));
            }
            return Err(Waiting::GroupAck { counted });
        }
        Request::Unsubscribe { subscription } => {
            broker.unsubscribe(subscription, conn);
            if let Some(task) = pushes.subscriptions.remove(&subscription) {
                task.abort();
            }
            if let Some((acks, task)) = pushes.groups.remove(&subscription) {
                // Answered once the group is free for its next subscriber.
                drop(acks);
                return Err(Waiting::GroupReleased { task });
            }
            Response::Done
        }
        Request::Serve { function } => match petrel_broker::check_name(&function) {
            Ok(()) => {
                let invocations = pushes.invocations(tx, ctx.config.max_in_flight_per_connection, session.compress);
                broker.serve(&function, conn, invocations);
                Response::Done
            }
            Err(e) => error(e),
        },
        Request::Unserve { function } => {
            broker.unserve(&function, conn);
            Response::Done
        }
        Request::Call { function, timeout_ms, oneway, message } => {
            let timeout = match timeout_ms {
                0 => DEFAULT_CALL_TIMEOUT,
                ms => Duration::from_millis(u64::from(ms)),
            };
            return Err(Waiting::Call { function, message: Box::new(convert::message_in(message)), oneway, timeout });
        }
        Request::Return { call, status, error: reason, message } => {
            let result = if status == Status::Ok { Ok(convert::message_in(message)) } else { Err(reason) };
            if broker.reply(call, conn, result) {
                Response::Done
            } else {
                Response::error(Status::Timeout, format!("call {call} is no longer waiting for a reply"))
            }
        }
    })
}

fn polled(deliveries: Vec<petrel_broker::Delivery>, compress: Option<usize>) -> Response {
    if deliveries.is_empty() {
        return Response::error(Status::QueueEmpty, "");
    }
    Response::Polled {
        deliveries: deliveries
            .into_iter()
            .map(|d| Delivery { handle: d.handle, message: convert::outgoing(d.message, compress) })
            .collect(),
    }
}

async fn poll_waiting(
    ctx: &Ctx,
    conn: ConnId,
    queue: &str,
    max: usize,
    visibility: Option<Duration>,
    timeout_ms: u32,
    compress: Option<usize>,
) -> Response {
    let deadline = Instant::now() + Duration::from_millis(timeout_ms as u64);
    loop {
        let Some(q) = ctx.broker.queue(queue) else { return error(BrokerError::NotFound(queue.to_owned())) };
        let notified = q.available.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        match ctx.broker.poll_from(&q, max, visibility, conn, now_ns()) {
            Ok(d) if d.is_empty() => {}
            other => return other.map_or_else(error, |d| polled(d, compress)),
        }
        let _waiting = q.waiting();
        if tokio::time::timeout_at(deadline.into(), notified).await.is_err() {
            return Response::error(Status::QueueEmpty, "");
        }
    }
}

async fn offer_waiting(ctx: &Ctx, queue: &str, mut messages: Vec<petrel_broker::Message>, timeout_ms: u32) -> Response {
    let deadline = Instant::now() + Duration::from_millis(timeout_ms as u64);
    loop {
        let Some(q) = ctx.broker.queue(queue) else { return error(BrokerError::NotFound(queue.to_owned())) };
        let notified = q.room.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        match ctx.broker.offer_unsynced(&q, &mut messages, now_ns()) {
            Err(BrokerError::Full(_)) => {}
            Ok((first_id, count, unsynced)) => {
                return match crate::wait_durable(unsynced).await {
                    Ok(()) => Response::Offered { first_id, count },
                    Err(e) => error(e),
                };
            }
            Err(e) => return error(e),
        }
        if tokio::time::timeout_at(deadline.into(), notified).await.is_err() {
            return error(BrokerError::Full(queue.to_owned()));
        }
    }
}
