//! Queue requests: create, remove, list, status, offer, poll, ack, abort.

use std::sync::Arc;
use std::time::{Duration, Instant};

use petrel_broker::security::{Action, Kind};
use petrel_broker::{BrokerError, MemoryHold, Offered, Queue, WaitFor, Waited};
use petrel_proto::{Delivery, Message, Response, Status, features};

use super::session::Session;
use super::{Answer, WaitsFor, error, outgoing};
use crate::{Ctx, now_ns, wait_durable};

/// Off the runtime's threads: making a queue is file-system work (see `first_use`).
pub(super) async fn create(ctx: &Ctx, session: &Session, name: String, config: petrel_proto::QueueConfig) -> Response {
    let owner = config.temporary.then_some(session.conn);
    let (broker, who) = (Arc::clone(&ctx.broker), session.principal().cloned());
    crate::blocking(move || broker.create_queue_by(who.as_ref(), &name, config, owner))
        .await
        .map_or_else(error, |_| Response::Done)
}

/// Off the runtime's threads: removing a queue deletes its files.
pub(super) async fn remove(ctx: &Ctx, name: String) -> Response {
    let broker = Arc::clone(&ctx.broker);
    crate::blocking(move || broker.remove_queue(&name)).await.map_or_else(error, |()| Response::Done)
}

/// The queues this connection may offer to or poll.
pub(super) fn list(ctx: &Ctx, session: &Session) -> Response {
    let broker = &ctx.broker;
    let may = |name: &String| broker.may(session.principal(), Kind::Queue, name, &[Action::Offer, Action::Poll]);
    Response::QueueList { names: broker.queue_names().into_iter().filter(may).collect() }
}

pub(super) fn status(ctx: &Ctx, session: &Session, name: String) -> Response {
    let Some(q) = ctx.broker.queue(&name) else { return error(ctx.broker.missing(&name)) };
    let stats = match session.reads & features::QUEUE_FIGURES {
        0 => q.status().without_later_figures(),
        _ => q.status(),
    };
    Response::QueueStatus { stats: Box::new(stats) }
}

/// OFFERED for `offered`, with its repeats for a client that reads them.
fn offered(offered: &Offered, reads: u32) -> Response {
    let repeats = if reads & features::OFFER_REPEATS != 0 { offered.repeats } else { 0 };
    Response::Offered { first_id: offered.first_id, count: offered.count, repeats }
}

/// Offers `messages` now; a full queue is waited on for up to `timeout_ms`, and an offer to a
/// queue that syncs each one is answered once it is on disk. The messages arrived at
/// `arrived_ns`: their timestamps, expiry and due times count from it (a retry after waiting for
/// room reads the clock again).
pub(super) fn offer(
    ctx: &Arc<Ctx>,
    session: &mut Session,
    queue: String,
    timeout_ms: u32,
    mut messages: Vec<Message>,
    arrived_ns: u64,
) -> Answer {
    let broker = &ctx.broker;
    let Some(queue) = session.queue(ctx, &queue) else { return Answer::Now(error(ctx.broker.missing(&queue))) };
    let behind_own = timeout_ms > 0 && session.offers_waiting.busy(&queue.name);
    let offered_now = match behind_own {
        true => Err(BrokerError::Full(queue.name.clone())),
        false => broker.offer_unsynced(&queue, &mut messages, arrived_ns),
    };
    match offered_now {
        Err(BrokerError::Full(_)) if timeout_ms > 0 => {
            // What waits for room counts in the memory budget while it waits: the messages'
            // bytes, and the messages themselves (a few hundred bytes of fields each, most of
            // them empty: a frame of empty messages held ~300 times what it counted).
            let bytes = messages.iter().map(|m| m.size() + std::mem::size_of::<Message>() as u64).sum::<u64>();
            let Some(held) = broker.hold_memory(bytes) else {
                return Answer::Now(error(BrokerError::Limit(format!(
                    "an offer of {bytes} bytes cannot wait for room: it does not fit in the server's memory budget (max_memory_bytes) now"
                ))));
            };
            let (before, done) = session.offers_waiting.take_turn(&queue.name);
            let (ctx, reads, principal) = (Arc::clone(ctx), session.reads, session.principal().cloned());
            let gave_up = until_or_closed(timeout_ms, session.closed.clone());
            Answer::later(WaitsFor::Other, async move {
                let _done = done;
                let mut gave_up = std::pin::pin!(gave_up);
                if let Some(before) = before {
                    // (An error: it ended, which is as good.)
                    tokio::select! {
                        _ = before => {}
                        () = gave_up.as_mut() => return error(BrokerError::Full(queue.name.clone())),
                    }
                }
                offer_when_room(ctx, queue, principal, messages, (held, bytes), gave_up, reads).await
            })
        }
        Ok(mut done) if !done.unsynced.is_durable() => {
            let (unsynced, reads) = (std::mem::take(&mut done.unsynced), session.reads);
            Answer::later(WaitsFor::Disk, async move {
                match wait_durable(unsynced).await {
                    Ok(()) => offered(&done, reads),
                    Err(e) => error(e),
                }
            })
        }
        Ok(done) => Answer::Now(offered(&done, session.reads)),
        Err(e) => Answer::Now(error(e)),
    }
}

/// Ends after `timeout_ms`, or once the connection stops reading (`Session::closed`), whichever
/// comes first: what a request waiting for a queue gives up at.
fn until_or_closed(timeout_ms: u32, mut closed: tokio::sync::watch::Receiver<()>) -> impl Future<Output = ()> {
    let deadline = Instant::now() + Duration::from_millis(u64::from(timeout_ms));
    async move {
        tokio::select! {
            _ = tokio::time::sleep_until(deadline.into()) => {}
            _ = closed.changed() => {}
        }
    }
}

/// `held`: the memory budget's bytes for `messages` while they wait (`bytes` of them). Each
/// attempt asks again whether `principal` may offer: a reload may have taken the right away.
async fn offer_when_room(
    ctx: Arc<Ctx>,
    queue: Arc<Queue>,
    principal: Option<petrel_broker::security::Principal>,
    mut messages: Vec<Message>,
    (held, bytes): (MemoryHold, u64),
    gave_up: impl Future<Output = ()>,
    reads: u32,
) -> Response {
    let broker = &ctx.broker;
    let mut held = Some(held);
    let attempt = |q: &Arc<Queue>| {
        broker.authorize(principal.as_ref(), Kind::Queue, &q.name, &[Action::Offer])?;
        // Given back as the queue takes them: an in-memory queue counts them in the budget itself.
        held = None;
        match broker.offer_unsynced(q, &mut messages, now_ns()) {
            Err(BrokerError::Full(_)) => {
                held = Some(broker.hold_memory_anyway(bytes));
                Ok(None)
            }
            other => other.map(Some),
        }
    };
    let name = queue.name.clone();
    match broker.wait_on_queue(queue, WaitFor::Room, attempt, gave_up).await {
        Ok(Waited::Ready(mut done)) => match wait_durable(std::mem::take(&mut done.unsynced)).await {
            Ok(()) => offered(&done, reads),
            Err(e) => error(e),
        },
        Ok(Waited::Stopped(())) => error(BrokerError::Full(name)),
        Err(e) => error(e),
    }
}

/// Takes up to `max` messages now, or waits up to `timeout_ms` for the first.
pub(super) fn poll(
    ctx: &Arc<Ctx>,
    session: &mut Session,
    queue: String,
    max: u32,
    timeout_ms: u32,
    visibility_ms: u32,
) -> Answer {
    let visibility = (visibility_ms > 0).then(|| Duration::from_millis(u64::from(visibility_ms)));
    let max = (max as usize).clamp(1, ctx.config.max_poll_messages);
    let (conn, compress, principal) = (session.conn, session.compress, session.principal().cloned());
    let Some(queue) = session.queue(ctx, &queue) else { return Answer::Now(error(ctx.broker.missing(&queue))) };
    match ctx.broker.poll_from(&queue, max, visibility, conn, now_ns()) {
        Ok(d) if d.is_empty() && timeout_ms > 0 => {
            let ctx = Arc::clone(ctx);
            // A client gone meanwhile is not waited for: no message is taken for nobody.
            let gave_up = until_or_closed(timeout_ms, session.closed.clone());
            Answer::later(WaitsFor::Other, async move {
                let broker = &ctx.broker;
                let attempt = |q: &Arc<Queue>| {
                    // Asked again: a reload may have taken the right away while it waited.
                    broker.authorize(principal.as_ref(), Kind::Queue, &q.name, &[Action::Poll])?;
                    let taken = broker.poll_from(q, max, visibility, conn, now_ns())?;
                    Ok((!taken.is_empty()).then_some(taken))
                };
                match broker.wait_on_queue(queue, WaitFor::Messages, attempt, gave_up).await {
                    Ok(Waited::Ready(taken)) => polled(taken, compress),
                    Ok(Waited::Stopped(())) => polled(Vec::new(), compress),
                    Err(e) => error(e),
                }
            })
        }
        Ok(d) => Answer::Now(polled(d, compress)),
        Err(e) => Answer::Now(error(e)),
    }
}

fn polled(deliveries: Vec<Delivery>, compress: Option<usize>) -> Response {
    if deliveries.is_empty() {
        return Response::error(Status::QueueEmpty, "");
    }
    Response::Polled {
        deliveries: deliveries
            .into_iter()
            .map(|d| Delivery { handle: d.handle, message: outgoing(d.message, compress) })
            .collect(),
    }
}

pub(super) fn ack(ctx: &Ctx, session: &Session, queue: &str, handles: &[u64]) -> Response {
    ctx.broker.ack(queue, handles, session.conn).map_or_else(error, |count| Response::Acked { count })
}

/// ABORT: the deliveries come back (`delay_ms` as the broker's `abort`), or, `unseen`, as if
/// never handed out (`Broker::give_back_unseen`).
pub(super) fn abort(
    ctx: &Ctx,
    session: &Session,
    queue: &str,
    handles: &[u64],
    delay_ms: u32,
    unseen: bool,
) -> Response {
    let aborted = match unseen {
        true => ctx.broker.give_back_unseen(queue, handles, session.conn),
        false => ctx.broker.abort(queue, handles, session.conn, delay_ms, now_ns()),
    };
    aborted.map_or_else(error, |count| Response::Acked { count })
}
