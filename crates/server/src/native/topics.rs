//! Topic requests: create, remove, list, status, publish; subscribe (live, or through a durable
//! topic's consumer group), acknowledge a group's messages, unsubscribe. A subscription is a
//! task that turns what the broker hands it into DELIVER pushes.

use std::sync::Arc;
use std::time::Duration;

use petrel_broker::security::{Action, Kind};
use petrel_broker::{BrokerError, Ended, GroupFeed, SeekTo, Subscription};
use petrel_proto::{Push, Response, StartFrom, Status};
use tokio::sync::oneshot;

use super::pushes::{Pushes, not_sent_if_too_long};
use super::session::Session;
use super::{Answer, WaitsFor, error, outgoing};
use crate::outbox::Outbox;
use crate::{Ctx, now_ns};

/// Off the runtime's threads, as removal: a durable topic is a log on disk.
pub(super) async fn create(ctx: &Ctx, name: String, durable: bool) -> Response {
    let broker = Arc::clone(&ctx.broker);
    crate::blocking(move || broker.create_topic(&name, durable)).await.map_or_else(error, |_| Response::Done)
}

pub(super) async fn remove(ctx: &Ctx, name: String) -> Response {
    let broker = Arc::clone(&ctx.broker);
    crate::blocking(move || broker.remove_topic(&name)).await.map_or_else(error, |()| Response::Done)
}

/// The topics this connection may publish or subscribe to.
pub(super) fn list(ctx: &Ctx, session: &Session) -> Response {
    let broker = &ctx.broker;
    let may = |name: &String| broker.may(session.principal(), Kind::Topic, name, &[Action::Publish, Action::Subscribe]);
    Response::TopicList { names: broker.topic_names().into_iter().filter(may).collect() }
}

pub(super) fn status(ctx: &Ctx, name: String) -> Response {
    match ctx.broker.topic(&name) {
        Some(t) => Response::TopicStatus { stats: Box::new(t.status()) },
        None => error(ctx.broker.missing_topic(&name)),
    }
}

/// Publishes now to a live topic; to a durable one on a blocking thread, as its log may wait for
/// the disk, after this connection's publish to it before (stored in the order sent).
pub(super) fn publish(
    ctx: &Arc<Ctx>,
    session: &mut Session,
    topic: String,
    messages: Vec<petrel_proto::Message>,
) -> Answer {
    let published = |subscribers| Response::Published { subscribers };
    let Some(t) = ctx.broker.topic(&topic) else { return Answer::Now(error(ctx.broker.missing_topic(&topic))) };
    if !t.is_durable() {
        return Answer::Now(ctx.broker.publish_to(&t, messages, now_ns()).map_or_else(error, published));
    }
    let ctx = Arc::clone(ctx);
    let (before, stored) = session.durable_publishes.take_turn(&topic);
    // Counted in the memory budget while they wait for the publish before them: decompressed,
    // they may be far larger than the frame that brought them. (Not past it: the publish counts
    // them for each live subscriber itself.)
    let held = ctx.broker.hold_memory_anyway(messages.iter().map(|m| m.size()).sum());
    Answer::later(WaitsFor::Disk, async move {
        if let Some(before) = before {
            let _ = before.await; // (an error: it ended without storing, which is as good)
        }
        drop(held);
        let publish = move || ctx.broker.publish_to(&t, messages, now_ns());
        let answer = crate::blocking(publish).await.map_or_else(error, published);
        drop(stored);
        answer
    })
}

/// A live subscription: what is published from now on, while this connection keeps up.
pub(super) fn subscribe(
    ctx: &Ctx,
    session: &Session,
    pushes: &mut Pushes,
    outbox: &Outbox,
    topic: &str,
    buffer: u32,
) -> Response {
    if let Err(e) = room_for_a_subscription(ctx, pushes) {
        return error(e);
    }
    let buffer = match buffer {
        0 => ctx.config.default_subscriber_buffer_messages,
        n => (n as usize).min(ctx.config.max_subscriber_buffer_messages),
    };
    match ctx.broker.subscribe(topic, session.conn, buffer) {
        Ok(sub) => {
            let subscription = sub.id;
            let answered = pushes.after_answers();
            let push = PushFrame::of(ctx);
            let task = tokio::spawn(deliver_live(sub, answered, outbox.clone(), session.compress, push));
            pushes.subscriptions.insert(subscription, task);
            Response::Subscribed { subscription }
        }
        Err(e) => error(e),
    }
}

/// Whether this connection may hold one more subscription (`max_subscriptions_per_connection`).
fn room_for_a_subscription(ctx: &Ctx, pushes: &mut Pushes) -> Result<(), BrokerError> {
    // Those the server ended (a slow consumer, a removed topic) do not count.
    pushes.forget_ended();
    let (held, max) = (pushes.subscriptions.len() + pushes.groups.len(), ctx.config.max_subscriptions_per_connection);
    match held < max {
        true => Ok(()),
        false => Err(BrokerError::Limit(format!(
            "this connection holds {held} subscriptions, its limit (max_subscriptions_per_connection)"
        ))),
    }
}

/// A subscription through consumer group `group` of a durable topic, at most `buffer` messages
/// unacknowledged. If the group is still held by a subscription that is ending (a client that
/// reconnected at once), waits a moment for it to be let go.
#[allow(clippy::too_many_arguments)]
pub(super) async fn subscribe_group(
    ctx: &Ctx,
    session: &Session,
    pushes: &mut Pushes,
    outbox: &Outbox,
    topic: String,
    group: String,
    buffer: u32,
    from: StartFrom,
) -> Response {
    if let Err(e) = room_for_a_subscription(ctx, pushes) {
        return error(e);
    }
    let Some(t) = ctx.broker.topic(&topic) else { return error(ctx.broker.missing_topic(&topic)) };
    let max_pending = match buffer {
        0 => ctx.config.default_subscriber_buffer_messages.min(petrel_log::MAX_PENDING),
        n => (n as usize).min(petrel_log::MAX_PENDING),
    };
    let from = match from {
        StartFrom::Resume => None,
        StartFrom::Oldest => Some(SeekTo::Oldest),
        StartFrom::Newest => Some(SeekTo::Newest),
        StartFrom::Offset(o) => Some(SeekTo::Offset(o)),
        StartFrom::Time(ns) => Some(SeekTo::Time(ns)),
    };
    let released_within = tokio::time::sleep(Duration::from_millis(ctx.config.group_release_wait_ms));
    let blocking = |open: petrel_broker::OpenGroup| crate::blocking(open);
    let reader = match t.group_when_free(&group, from, max_pending, released_within, blocking).await {
        Ok(reader) => reader,
        Err(e) => return error(e),
    };
    let (feed, acks) = GroupFeed::new(reader, max_pending, ctx.config.max_group_acks_waiting);
    let subscription = ctx.broker.next_id();
    let answered = pushes.after_answers();
    let push = PushFrame::of(ctx);
    let broker = Arc::clone(&ctx.broker);
    let task =
        tokio::spawn(deliver_group(subscription, feed, broker, answered, outbox.clone(), session.compress, push));
    pushes.groups.insert(subscription, (acks, task));
    Response::Subscribed { subscription }
}

/// TOPIC_ACK batches of at most this many bytes of ids are held in the memory budget even past
/// it (`ack`).
const SMALL_ACK_BYTES: u64 = 64 << 10;

/// Acknowledges messages of a group subscription: answered once its task has applied them.
pub(super) fn ack(ctx: &Ctx, pushes: &Pushes, subscription: u64, ids: Vec<u64>) -> Answer {
    let Some((acks, _)) = pushes.groups.get(&subscription) else {
        return Answer::Now(Response::error(Status::BadRequest, format!("no group subscription {subscription}")));
    };
    // The ids wait for the subscription's task (which may wait for a client that does not read)
    // counted in the memory budget: a frame holds two million of them. A small batch is taken
    // even past the budget (in memory already, it is refused for nothing, and a group stops
    // at `buffer` unacknowledged); a large one that does not fit is refused.
    let bytes = (ids.capacity() * std::mem::size_of::<u64>()) as u64;
    let held = match bytes <= SMALL_ACK_BYTES {
        true => Some(ctx.broker.hold_memory_anyway(bytes)),
        false => ctx.broker.hold_memory(bytes),
    };
    let Some(held) = held else {
        let why =
            format!("{} acknowledgements do not fit in the server's memory budget (max_memory_bytes) now", ids.len());
        return Answer::Now(Response::error(Status::LimitReached, why));
    };
    match acks.send(ids, Some(held)) {
        Ok(counted) => Answer::later(WaitsFor::Other, async move {
            match counted.await {
                Ok(count) => Response::Acked { count },
                // (As when it had ended before the acknowledgement came: not to be retried.)
                Err(_) => Response::error(Status::BadRequest, "the subscription ended"),
            }
        }),
        Err(e) => Answer::Now(error(e)),
    }
}

/// Ends a subscription; a group subscription is answered once its group is free for the next.
pub(super) fn unsubscribe(ctx: &Ctx, session: &Session, pushes: &mut Pushes, subscription: u64) -> Answer {
    ctx.broker.unsubscribe(subscription, session.conn);
    if let Some(task) = pushes.subscriptions.remove(&subscription) {
        task.abort();
    }
    if let Some((acks, task)) = pushes.groups.remove(&subscription) {
        drop(acks); // ends the feed: its task returns, and lets the group go
        return Answer::later(WaitsFor::Other, async move {
            let _ = task.await;
            Response::Done
        });
    }
    Answer::Now(Response::Done)
}

/// How big a DELIVER push grows before it is sent: the writer's queue is bounded in frames, so
/// a frame's size bounds its memory too.
#[derive(Clone, Copy)]
struct PushFrame {
    max_messages: usize,
    max_bytes: u64,
}

impl PushFrame {
    fn of(ctx: &Ctx) -> PushFrame {
        PushFrame { max_messages: ctx.config.max_push_messages, max_bytes: ctx.config.max_push_bytes }
    }
}

/// Forwards a live subscription's messages as DELIVER pushes, several per frame when they
/// queue up, once the SUBSCRIBE answer has gone out; ends with SUBSCRIPTION_END if the broker
/// ended it.
async fn deliver_live(
    mut sub: Subscription,
    answered: oneshot::Receiver<()>,
    outbox: Outbox,
    compress: Option<usize>,
    push: PushFrame,
) {
    if answered.await.is_err() {
        return;
    }
    let id = sub.id;
    let mut batch = Vec::new();
    // A message taken that did not fit the last frame: the next one's first.
    let mut carried = None;
    loop {
        let first = match carried.take() {
            Some(m) => m,
            None => match sub.recv().await {
                Some(m) => m,
                None => break,
            },
        };
        let mut bytes = first.message.size();
        batch.push(first);
        // Others join while the frame stays within `max_push_bytes` (one message alone may be
        // larger: it fits the frame size the server advertises, which a client may hold it to).
        while batch.len() < push.max_messages {
            match sub.try_recv() {
                Some(m) if bytes + m.message.size() > push.max_bytes => {
                    carried = Some(m);
                    break;
                }
                Some(m) => {
                    bytes += m.message.size();
                    batch.push(m);
                }
                None => break,
            }
        }
        // Each message is encoded once, by whichever subscriber's task gets to it first (one
        // that goes out compressed, for this connection alone).
        let encoded: Vec<bytes::Bytes> = batch
            .iter()
            .map(|d| {
                let encode = |compress| {
                    let mut out = Vec::with_capacity(d.message.payload.len() + 64);
                    outgoing(d.message.clone(), compress).encode_to(&mut out);
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
        if outbox.send(out).await.is_err() {
            return;
        }
        match &carried {
            Some(kept) => sub.sent_but(kept),
            None => sub.sent(),
        }
    }
    let (status, reason) = match sub.ended.get() {
        Some(Ended::TooSlow(reason)) => (Status::SlowConsumer, reason.clone()),
        Some(Ended::TopicRemoved(reason)) => (Status::TopicNotFound, reason.clone()),
        None => return,
    };
    send_end(id, status, reason, &outbox).await;
}

/// Tells the client that subscription `id` has ended, and why (SUBSCRIPTION_END).
async fn send_end(id: u64, status: Status, reason: String, outbox: &Outbox) {
    let mut out = Vec::new();
    not_sent_if_too_long(Push::SubscriptionEnd { status, reason }.encode(id, &mut out));
    let _ = outbox.send(out).await;
}

/// Delivers what a group feed hands out as DELIVER pushes. An async task, not a thread: the
/// feed's waits are in memory, and each step (a read of the log, acknowledgements written to
/// the group's cursor) runs as a short blocking call, so idle group subscribers hold no thread.
/// What a step read (copied out of the log) counts in the memory budget until it is sent on.
async fn deliver_group(
    id: u64,
    mut feed: GroupFeed,
    broker: Arc<petrel_broker::Broker>,
    answered: oneshot::Receiver<()>,
    outbox: Outbox,
    compress: Option<usize>,
    push: PushFrame,
) {
    if answered.await.is_err() {
        return;
    }
    loop {
        let (max_batch, max_bytes) = (push.max_messages, push.max_bytes as usize);
        let stepped = tokio::task::spawn_blocking(move || {
            let step = feed.step(max_batch, max_bytes);
            (feed, step)
        })
        .await;
        let step;
        (feed, step) = match stepped {
            Ok(stepped) => stepped,
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            Err(_) => return, // the runtime is shutting down
        };
        match step {
            Ok(Some(messages)) => {
                let _held = broker.hold_memory_anyway(messages.iter().map(|m| m.size()).sum());
                if !send_group_messages(id, messages, &outbox, compress, push).await {
                    return;
                }
            }
            Ok(None) => {
                if !feed.wait().await {
                    return;
                }
            }
            // (TOPIC_NOT_FOUND for a topic removed, as a live subscription's end says.)
            Err(e) => return send_end(id, e.status(), e.to_string(), &outbox).await,
        }
    }
}

/// Sends `messages` in frames of at most `push.max_bytes` (or one bigger message). `false`:
/// the connection's writer has stopped.
async fn send_group_messages(
    id: u64,
    messages: Vec<petrel_proto::Message>,
    outbox: &Outbox,
    compress: Option<usize>,
    push: PushFrame,
) -> bool {
    let mut frame: Vec<petrel_proto::Message> = Vec::new();
    let mut bytes = 0;
    let mut messages = messages.into_iter().peekable();
    while let Some(m) = messages.next() {
        bytes += m.size();
        frame.push(outgoing(m, compress));
        // The next one joins while the frame stays within `max_push_bytes` (one message alone
        // may be larger: it fits the frame size the server advertises).
        let full = messages.peek().is_none_or(|next| bytes + next.size() > push.max_bytes);
        if full {
            let mut out = Vec::with_capacity(bytes as usize + 64 * frame.len());
            not_sent_if_too_long(Push::Deliver { messages: std::mem::take(&mut frame) }.encode(id, &mut out));
            bytes = 0;
            if outbox.send(out).await.is_err() {
                return false;
            }
        }
    }
    true
}
