//! The native protocol on one connection.
//!
//! - `connection.rs`: frames in, bytes out (the read buffer, the writer task, its bounded outbox);
//! - `session.rs`: who the client is (HELLO, AUTH) and the checks every request passes;
//! - `queues.rs`, `topics.rs`, `functions.rs`: one module per family of requests, each handler
//!   answering now or with a future (`Answer`);
//! - `pushes.rs`: the tasks that push to the client (subscriptions, invocations).
//!
//! This file is the loop that ties them: it answers what needs no waiting at once, in order,
//! into one buffer per read; a request that must wait (a poll for a message, an offer for room
//! or for the disk, a call for its reply) runs as a task of its own, so a connection can
//! pipeline many. Every buffer is bounded: at most `max_in_flight_per_connection` requests wait
//! (past that the loop stops reading, and TCP pushes back on the client), and the outbox holds
//! at most `max_queued_responses` chunks and `max_queued_response_bytes` bytes.

mod connection;
mod functions;
mod pushes;
mod queues;
mod session;
mod topics;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use petrel_broker::{BrokerError, ConnId};
use petrel_proto::{Request, Response, Status};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::{Semaphore, watch};

use crate::Ctx;
use crate::auth::Peer;
use crate::outbox::Outbox;
use connection::{Closed, Connection, Incoming};
use pushes::Pushes;
use session::Session;

/// What a handler says to a request.
enum Answer {
    /// The answer, now.
    Now(Response),
    /// The answer once something happens: run as a task of its own, holding one of the
    /// connection's permits for waiting requests.
    Later { waits_for: WaitsFor, answer: Pin<Box<dyn Future<Output = Response> + Send>> },
    /// A call to a function: made once the caller holds a permit, answered by its replier.
    Call(functions::Call),
}

/// Which of the connection's permits a waiting request holds.
#[derive(Clone, Copy, PartialEq, Eq)]
enum WaitsFor {
    /// The disk (an offer to a queue that syncs each one). Counted apart: polls waiting for
    /// messages must not hold every permit while the offers that would make messages visible
    /// wait for one.
    Disk,
    /// Anything else: a message, room in a queue, a group subscription's task.
    Other,
}

impl Answer {
    fn later(waits_for: WaitsFor, answer: impl Future<Output = Response> + Send + 'static) -> Answer {
        Answer::Later { waits_for, answer: Box::pin(answer) }
    }
}

/// The permits of one connection's waiting requests.
struct Permits {
    limit: usize,
    other: Arc<Semaphore>,
    disk: Arc<Semaphore>,
}

impl Permits {
    fn new(limit: usize) -> Permits {
        Permits { limit, other: Arc::new(Semaphore::new(limit)), disk: Arc::new(Semaphore::new(limit)) }
    }

    /// The semaphore a request that waits for `waits_for` draws from.
    fn semaphore(&self, waits_for: WaitsFor) -> Arc<Semaphore> {
        Arc::clone(if waits_for == WaitsFor::Disk { &self.disk } else { &self.other })
    }

    /// Waits for a permit (the reader stops reading meanwhile: TCP pushes back).
    async fn acquire(&self, waits_for: WaitsFor) -> Option<tokio::sync::OwnedSemaphorePermit> {
        self.semaphore(waits_for).acquire_owned().await.ok()
    }

    fn try_acquire(&self, waits_for: WaitsFor) -> Option<tokio::sync::OwnedSemaphorePermit> {
        self.semaphore(waits_for).try_acquire_owned().ok()
    }

    fn none_taken(&self) -> bool {
        self.other.available_permits() == self.limit && self.disk.available_permits() == self.limit
    }

    /// Waits until every waiting request has finished.
    async fn all_returned(&self) {
        let _ = self.other.acquire_many(self.limit as u32).await;
        let _ = self.disk.acquire_many(self.limit as u32).await;
    }
}

/// Serves one connection until the client closes it, a protocol error makes it unsafe to go on,
/// or the server shuts down (then requests in flight finish first). `greet_by`: the handshake's
/// deadline, counted from the connection's start (`Ctx::handshake_deadline`).
pub(crate) async fn serve<S>(
    stream: S,
    ctx: Arc<Ctx>,
    conn: ConnId,
    mut shutdown: watch::Receiver<bool>,
    peer: Peer,
    greet_by: tokio::time::Instant,
) where
    S: AsyncRead + AsyncWrite + Send + 'static,
{
    let registered = crate::connections::Registry::open(&ctx, conn, &peer, "native");
    let _disconnect = crate::Disconnect { broker: Arc::clone(&ctx.broker), conn };
    let grace = ctx.config.shutdown_grace().unwrap_or(Duration::from_secs(5));
    let mut connection = Connection::new(stream, &ctx, conn, &registered, (shutdown.clone(), grace));
    let (reading, closed) = watch::channel(());
    let mut session = Session::new(&ctx, conn, peer, &registered, closed);
    let mut pushes = Pushes::default();
    let permits = Permits::new(ctx.config.max_in_flight_per_connection);
    // HELLO (and AUTH, when the server has users) must come within the handshake timeout of the
    // connection's start (`greet_by`), however the client spreads its bytes.
    let idle_timeout = ctx.limits.idle_timeout();
    let mut rights = registered.entry().rights();
    // A client that does not read its answers holds the loop where it waits to hand them on (to
    // the writer, for a permit): it waits no longer than the client may be silent (before HELLO
    // and a login, the handshake's deadline), nor past a shutdown.
    let stall_deadline = |session: &Session| match session.greeted && session.trusted(&ctx) {
        true => idle_timeout.map(|d| tokio::time::Instant::now() + d),
        false => Some(greet_by),
    };
    // An answer on its way without a permit (see `Answer::Later` below): waited for at the end.
    let mut last_answer = None;
    'read: loop {
        let mut gave_back = false;
        // Whole frames already buffered first.
        loop {
            if connection.answers_are_many() {
                let deadline = stall_deadline(&session);
                match unless_stalled(&ctx, pushes.flush(&mut connection), &mut shutdown, deadline).await {
                    Some(Ok(())) => {}
                    Some(Err(Closed)) | None => break 'read,
                }
            }
            let Incoming { opcode, request_id, request } = match connection.next_request() {
                Ok(Some(incoming)) => incoming,
                Ok(None) => break,
                Err(Closed) => break 'read,
            };
            gave_back |= matches!(request, Request::Return { .. });
            let answer = match request {
                Request::Auth { user, password } => Answer::Now(session.auth(&ctx, &registered, user, password).await),
                request => {
                    let arrived_ns = connection.read_at_ns();
                    dispatch(&ctx, &mut session, &mut pushes, connection.outbox(), request, arrived_ns).await
                }
            };
            match answer {
                Answer::Now(response) => connection.answer(&response, opcode, request_id),
                Answer::Later { waits_for, mut answer } => {
                    let waiting = (&mut pushes, &mut connection, &mut shutdown);
                    let permit = permit_for(&ctx, &permits, waits_for, waiting, &mut session, &stall_deadline).await;
                    // Stopping (or a client stalled) with no permit: a request waiting only for
                    // the disk is done already (an offer stored, waiting for its sync) and is
                    // still answered, before the connection closes (its producer would retry
                    // it, and store it twice); one not begun (a poll, an offer waiting for
                    // room) is dropped, and takes or stores nothing.
                    let stopping = permit.is_none();
                    if stopping && waits_for != WaitsFor::Disk {
                        break 'read;
                    }
                    // Its first steps run here, in the order the requests came: a poll or an
                    // offer that waits joins its queue's line before the requests read after it
                    // do. Run first as a task, one spawned later could go first (the runtime runs
                    // the newest task next). (What waits for the disk is stored already, in
                    // order: looked at here, it would start its sync before more offers joined it.)
                    let mut first = std::task::Context::from_waker(std::task::Waker::noop());
                    let first_steps = waits_for == WaitsFor::Other;
                    if first_steps && let std::task::Poll::Ready(response) = answer.as_mut().poll(&mut first) {
                        connection.answer(&response, opcode, request_id);
                        drop(permit);
                        if stopping {
                            break 'read;
                        }
                        continue;
                    }
                    let outbox = connection.outbox().clone();
                    let broker = Arc::clone(&ctx.broker);
                    let answering = tokio::spawn(async move {
                        let response = answer.await;
                        let mut out = Vec::with_capacity(64);
                        response.encode(opcode, request_id, &mut out);
                        // A large answer (a waiting poll's messages) waiting for room in the
                        // outbox is counted in the memory budget meanwhile: its messages left
                        // their queue's count when they were taken.
                        let _held = hold_if_large(&broker, out.len());
                        let _ = outbox.send(out).await;
                        drop(permit);
                    });
                    if stopping {
                        last_answer = Some(answering);
                        break 'read;
                    }
                }
                Answer::Call(call) => {
                    let waiting = (&mut pushes, &mut connection, &mut shutdown);
                    let permit = permit_for(&ctx, &permits, WaitsFor::Other, waiting, &mut session, &stall_deadline);
                    let Some(permit) = permit.await else { break 'read };
                    let reply_to = functions::ReplyTo { outbox: connection.outbox().clone(), opcode, request_id };
                    if let Some(response) = functions::call(&ctx, &session, call, reply_to, permit) {
                        connection.answer(&response, opcode, request_id);
                    }
                }
            }
        }
        // A reply just handed to a waiting caller goes out first: its connection's writer, just
        // woken, runs before this one acknowledges the return, which the call does not wait for.
        if gave_back {
            tokio::task::yield_now().await;
        }
        let deadline = stall_deadline(&session);
        if !matches!(unless_stalled(&ctx, pushes.flush(&mut connection), &mut shutdown, deadline).await, Some(Ok(()))) {
            break;
        }
        // Silent too long, with nothing under way: closed (before HELLO, at the handshake
        // timeout whatever it sent).
        let settled = session.greeted && session.trusted(&ctx);
        let quiet_until = match settled {
            true => idle_timeout.map(|d| tokio::time::Instant::now() + d),
            false => Some(greet_by),
        };
        tokio::select! {
            read = connection.read(session.trusted(&ctx)) => if read.is_err() { break },
            _ = shutdown.changed() => break,
            _ = rights.changed() => {
                // Requests are decided by the new rules; what the old ones granted is not kept.
                if ctx.broker.authenticated(session.principal()).is_err() || pushes.holds_grants() {
                    tracing::info!(conn, "closing a connection whose user a reload removed or whose subscriptions or served functions its old rights granted");
                    break;
                }
            }
            _ = crate::sleep_until_or_never(quiet_until) => {
                // Before HELLO (and a login, when the server has users), closed at the deadline
                // whatever is under way (else a past deadline would wake this loop at once,
                // again and again).
                if !settled || (permits.none_taken() && pushes.is_empty()) {
                    crate::stats::add(&ctx.stats.idle_closed, 1);
                    tracing::debug!(conn, "closing an idle connection");
                    break;
                }
            }
        }
    }
    // Requests still waiting (a poll for a message, an offer for room) stop waiting.
    drop(reading);
    // One grace for the answers ready and the requests in flight together, one more for the
    // writer (`Connection::close`): two at most, as operations.md says.
    let finish_by = tokio::time::Instant::now() + grace;
    let _ = tokio::time::timeout_at(finish_by, pushes.flush(&mut connection)).await;
    // Its replies can no longer be read: calls handed to it fail now, not after the graces.
    if !pushes.served.is_empty() {
        ctx.broker.unserve_all(conn);
    }
    pushes.stop();
    // Let requests in flight finish (bounded by the server's shutdown grace), then close.
    let _ = tokio::time::timeout_at(finish_by, async {
        permits.all_returned().await;
        if let Some(answering) = last_answer {
            let _ = answering.await;
        }
    })
    .await;
    connection.close(grace).await;
}

/// An answer past this many bytes is counted in the memory budget while it waits for the outbox.
const LARGE_ANSWER: usize = 64 << 10;

/// The memory budget's hold for an answer of `bytes` waiting for the outbox, if it is large.
pub(super) fn hold_if_large(broker: &petrel_broker::Broker, bytes: usize) -> Option<petrel_broker::MemoryHold> {
    (bytes > LARGE_ANSWER).then(|| broker.hold_memory_anyway(bytes as u64))
}

/// A permit for a request answered later (`max_in_flight_per_connection`). When none is free,
/// the answers ready go out first (a client may wait for one of them before it sends what the
/// requests under way wait for), then the wait: requests under way are not idleness, so it ends
/// at a shutdown, or once the client has left answers unread for as long as it may be silent
/// (`stall_deadline`, looked at again each time it passes; before its login, the handshake's
/// deadline ends it whatever).
async fn permit_for<S>(
    ctx: &Arc<Ctx>,
    permits: &Permits,
    waits_for: WaitsFor,
    (pushes, connection, shutdown): (&mut Pushes, &mut Connection<S>, &mut watch::Receiver<bool>),
    session: &mut Session,
    stall_deadline: &impl Fn(&Session) -> Option<tokio::time::Instant>,
) -> Option<tokio::sync::OwnedSemaphorePermit>
where
    S: AsyncRead + AsyncWrite + Send + 'static,
{
    let settled = session.greeted && session.trusted(ctx);
    if let Some(permit) = permits.try_acquire(waits_for) {
        return Some(permit);
    }
    if !matches!(unless_stalled(ctx, pushes.flush(connection), shutdown, stall_deadline(session)).await, Some(Ok(()))) {
        return None;
    }
    let mut until = stall_deadline(session);
    let mut written = connection.outbox().chunks_written();
    loop {
        if *shutdown.borrow() {
            return None;
        }
        // RETURNs read need no permit, and the calls they answer may be what frees one (a
        // handler's own call routed back to this connection, which waited for its reply until
        // the call timed out): handled now, wherever they are among what was read (those read
        // with the waiting request too). Their answers go out early only into an idle outbox:
        // this wait must not wait on a client that does not read.
        for (request_id, request) in connection.take_returns() {
            let (outbox, arrived_ns) = (connection.outbox().clone(), connection.read_at_ns());
            let response = match request {
                Ok(request) => match dispatch(ctx, session, pushes, &outbox, request, arrived_ns).await {
                    Answer::Now(response) => response,
                    _ => unreachable!("a RETURN is answered at once"),
                },
                Err(refused) => refused,
            };
            connection.answer(&response, petrel_proto::opcode::RETURN, request_id);
        }
        if connection.answers_are_many() && connection.outbox().is_idle() {
            // (A frame half written waits for the client to read: no longer than it may be silent.)
            let deadline = stall_deadline(session);
            if !matches!(unless_stalled(ctx, connection.flush(), shutdown, deadline).await, Some(Ok(()))) {
                return None;
            }
        }
        // Reading on meanwhile (a little: what is read waits to be decoded) notices a client
        // that went away: its waiting requests then stop, as its connection ends. A RETURN
        // being read is read whole, however long (see above). But not while the RETURNs'
        // answers wait for room in the outbox (a client that does not read): read on, the
        // RETURNs of a client that sends and never reads would grow them without bound. They
        // wait for room in line with the pushes, and reading goes on once they have it (or the
        // writer is gone, and the connection ends).
        let piled = connection.answers_are_many();
        let reading = !piled && (connection.buffered() < READ_AHEAD_WHILE_WAITING || connection.reading_a_return());
        let (outbox, piled_bytes) = (connection.outbox().clone(), connection.answers_len());
        tokio::select! {
            permit = permits.acquire(waits_for) => return permit,
            _ = shutdown.changed() => return None,
            read = connection.read(session.trusted(ctx)), if reading => {
                if read.is_err() {
                    return None;
                }
            }
            reserved = outbox.reserve(piled_bytes), if piled => match reserved {
                Ok(reserved) => connection.queue_answers(reserved),
                Err(_) => return None, // the writer is gone: the client cannot be written to
            },
            _ = crate::sleep_until_or_never(until) => {
                // Stalled: answers waiting and none written since the last look. A client that
                // reads (or has read everything) waits on for its requests under way.
                let now_written = connection.outbox().chunks_written();
                let reads = connection.outbox().is_idle() || now_written != written;
                if settled && reads {
                    (until, written) = (stall_deadline(session), now_written);
                    continue;
                }
                crate::stats::add(&ctx.stats.idle_closed, 1);
                return None;
            }
        }
    }
}

/// What the reading takes in while a request waits for a permit (`permit_for`).
const READ_AHEAD_WHILE_WAITING: usize = 64 << 10;

/// `work`, unless the server shuts down or `deadline` passes first (`None` then): what holds a
/// connection's loop for a client that does not read.
async fn unless_stalled<T>(
    ctx: &Ctx,
    work: impl Future<Output = T>,
    shutdown: &mut watch::Receiver<bool>,
    deadline: Option<tokio::time::Instant>,
) -> Option<T> {
    if *shutdown.borrow() {
        return None;
    }
    tokio::select! {
        done = work => Some(done),
        _ = shutdown.changed() => None,
        _ = crate::sleep_until_or_never(deadline) => {
            // Closed for silence as the connection's loop closes it (`idle_closed`).
            crate::stats::add(&ctx.stats.idle_closed, 1);
            None
        }
    }
}

/// Answers one request (AUTH aside): at once, or with what it waits for. `arrived_ns`: when the
/// read that brought it ended, the time an offer's messages count from.
async fn dispatch(
    ctx: &Arc<Ctx>,
    session: &mut Session,
    pushes: &mut Pushes,
    outbox: &Outbox,
    request: Request,
    arrived_ns: u64,
) -> Answer {
    // A reply refused here is refused to its caller too, at once (not left to its timeout):
    // repliers do not send a reply again (the Rust client's are sent unanswered).
    let returned = match &request {
        Request::Return { call, .. } => Some(*call),
        _ => None,
    };
    let conn = session.conn;
    let refuse = |response: Response| {
        if let (Some(call), Response::Error { message, .. }) = (returned, &response) {
            ctx.broker.reply(call, conn, Err(format!("the function's reply was refused: {message}")));
        }
        Answer::Now(response)
    };
    if let Err(refused) = session.admit(ctx, &request) {
        return refuse(error(refused));
    }
    // Compressed payloads are restored first: a request unfolds to at most a frame's worth, and
    // only while the memory budget has room for what it grows by.
    let mut request = request;
    let messages = petrel_proto::compression::request_messages(&mut request);
    if messages.iter().any(|m| m.compressed) {
        let max = u64::from(ctx.config.max_frame_bytes);
        let grows_by = petrel_proto::compression::unfolded_growth(messages, max);
        let Some(hold) = ctx.broker.hold_memory(grows_by) else {
            let why = format!(
                "a request that unfolds by up to {grows_by} bytes does not fit in the server's memory budget (max_memory_bytes) now"
            );
            return refuse(Response::error(Status::LimitReached, why));
        };
        // Held while the payloads unfold, against others unfolding at the same time; then what
        // keeps the messages counts them (an in-memory queue, a waiting offer).
        let _unfolding = hold;
        if let Err(e) = petrel_proto::compression::decompress_all(messages.iter_mut(), max as usize) {
            return refuse(Response::error(Status::BadRequest, e.to_string()));
        }
    }
    let now = Answer::Now;
    match request {
        Request::Hello { features, .. } => now(session.hello(ctx, features)),
        Request::Ping => now(Response::Pong),
        Request::Auth { .. } => unreachable!("answered by the connection's loop"),
        Request::QueueCreate { name, config } => now(queues::create(ctx, session, name, *config).await),
        Request::QueueRemove { name } => now(queues::remove(ctx, name).await),
        Request::QueueList => now(queues::list(ctx, session)),
        Request::QueueStatus { name } => now(queues::status(ctx, session, name)),
        Request::Offer { queue, timeout_ms, messages } => {
            queues::offer(ctx, session, queue, timeout_ms, messages, arrived_ns)
        }
        Request::Poll { queue, max, timeout_ms, visibility_ms } => {
            queues::poll(ctx, session, queue, max, timeout_ms, visibility_ms)
        }
        Request::Ack { queue, handles } => now(queues::ack(ctx, session, &queue, &handles)),
        Request::Abort { queue, handles, delay_ms, unseen } => {
            now(queues::abort(ctx, session, &queue, &handles, delay_ms, unseen))
        }
        Request::TopicCreate { name, durable } => now(topics::create(ctx, name, durable).await),
        Request::TopicRemove { name } => now(topics::remove(ctx, name).await),
        Request::TopicList => now(topics::list(ctx, session)),
        Request::TopicStatus { name } => now(topics::status(ctx, name)),
        Request::Publish { topic, messages } => topics::publish(ctx, session, topic, messages),
        Request::Subscribe { topic, buffer, group, from } if !group.is_empty() => {
            now(topics::subscribe_group(ctx, session, pushes, outbox, topic, group, buffer, from).await)
        }
        Request::Subscribe { topic, buffer, .. } => {
            now(topics::subscribe(ctx, session, pushes, outbox, &topic, buffer))
        }
        Request::TopicAck { subscription, ids } => topics::ack(ctx, pushes, subscription, ids),
        Request::Unsubscribe { subscription } => topics::unsubscribe(ctx, session, pushes, subscription),
        Request::Serve { function } => now(functions::serve(ctx, session, pushes, outbox, &function)),
        Request::Unserve { function } => now(functions::unserve(ctx, session, pushes, &function)),
        Request::Call { function, timeout_ms, oneway, message } => {
            functions::prepare_call(ctx, function, timeout_ms, oneway, message)
        }
        Request::Return { call, status, error, message } => {
            now(functions::give_back(ctx, session, call, status, error, message))
        }
    }
}

/// A message on its way to this connection, its payload compressed if the connection negotiated
/// it (`Some(cutoff)`, see HELLO) and it is at least that big.
fn outgoing(mut m: petrel_proto::Message, compress: Option<usize>) -> petrel_proto::Message {
    if let Some(min_bytes) = compress {
        petrel_proto::compression::compress(&mut m, min_bytes);
    }
    m
}

/// A broker error as the protocol's answer.
fn error(e: BrokerError) -> Response {
    let status = e.status();
    if status == Status::ServerError {
        crate::log_request_failure("native", &e);
    }
    Response::error(status, e.to_string())
}
