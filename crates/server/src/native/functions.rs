//! Function requests: serve and unserve a name, call one (answered by the reply, however long
//! it takes, without a task waiting for it), and return a reply to a call this connection was
//! handed (an INVOKE push).

use std::time::Duration;

use petrel_broker::{Called, Invocation};
use petrel_proto::{LARGE_PAYLOAD_BYTES, Push, Response, Status};
use tokio::sync::{OwnedSemaphorePermit, mpsc};

use super::pushes::{Pushes, not_sent_if_too_long};
use super::session::Session;
use super::{Answer, error, outgoing};
use crate::outbox::{Chunk, Outbox, TrySendError};
use crate::{Ctx, now_ns};

/// A call, ready to be made once the caller holds a permit.
pub(super) struct Call {
    function: String,
    message: Box<petrel_proto::Message>,
    oneway: bool,
    timeout: Duration,
}

/// Where a call's answer goes.
pub(super) struct ReplyTo {
    pub outbox: Outbox,
    pub opcode: u16,
    pub request_id: u64,
}

pub(super) fn prepare_call(
    ctx: &Ctx,
    function: String,
    timeout_ms: u32,
    oneway: bool,
    message: Box<petrel_proto::Message>,
) -> Answer {
    let timeout = match timeout_ms {
        0 => Duration::from_millis(ctx.config.default_call_timeout_ms),
        ms => Duration::from_millis(u64::from(ms)),
    };
    Answer::Call(Call { function, message, oneway, timeout })
}

/// Makes the call. `Some`: answered now (a local handler's reply, a oneway call sent, an
/// error); `None`: the replier answers when the reply comes or the call times out. The permit is
/// the call's place among the connection's waiting requests, given back with the answer.
pub(super) fn call(
    ctx: &Ctx,
    session: &Session,
    call: Call,
    reply_to: ReplyTo,
    permit: OwnedSemaphorePermit,
) -> Option<Response> {
    let Call { function, message, oneway, timeout } = call;
    let replier = replier(reply_to, permit, session.compress, std::sync::Arc::clone(&ctx.broker));
    match ctx.broker.call(session.conn, &function, *message, oneway, now_ns(), timeout, replier) {
        Ok(Called::Replied(m)) => Some(Response::Reply { message: Box::new(outgoing(*m, session.compress)) }),
        Ok(Called::Sent) => Some(Response::Done),
        Ok(Called::Pending { .. }) => None,
        Err(e) => Some(error(e)),
    }
}

/// Where a call's outcome goes: straight to the caller's outbox (through a task only if it is
/// full, a large reply counted in the memory budget while it waits there, as other answers are).
fn replier(
    to: ReplyTo,
    permit: OwnedSemaphorePermit,
    compress: Option<usize>,
    broker: std::sync::Arc<petrel_broker::Broker>,
) -> petrel_broker::Replier {
    Box::new(move |outcome| {
        let response = match outcome {
            Ok(message) => Response::Reply { message: Box::new(outgoing(message, compress)) },
            Err(e) => error(e),
        };
        let mut frames = Vec::with_capacity(64);
        let payload = response.encode_split(to.opcode, to.request_id, &mut frames).unwrap_or_default();
        if let Err(TrySendError::Full(out)) = to.outbox.try_send(Chunk { frames, payload }) {
            let bytes = out.frames.len() + out.payload.len();
            let held = super::hold_if_large(&broker, bytes);
            tokio::spawn(async move {
                let _held = held;
                let _ = to.outbox.send(out).await;
                drop(permit);
            });
        }
    })
}

pub(super) fn serve(ctx: &Ctx, session: &Session, pushes: &mut Pushes, outbox: &Outbox, function: &str) -> Response {
    if let Err(e) = petrel_broker::check_name(function) {
        return error(e);
    }
    // Each name served is an entry in the broker's table every call looks up, and a
    // disconnect walks: bounded per connection, as subscriptions are.
    let max = ctx.config.max_functions_per_connection;
    if !pushes.served.contains(function) && pushes.served.len() >= max {
        return Response::error(
            Status::LimitReached,
            format!("this connection serves {max} functions, its limit (max_functions_per_connection)"),
        );
    }
    pushes.served.insert(function.to_owned());
    let invocations = invocations(pushes, outbox, ctx.config.max_in_flight_per_connection, session.compress);
    ctx.broker.serve(function, session.conn, invocations);
    Response::Done
}

pub(super) fn unserve(ctx: &Ctx, session: &Session, pushes: &mut Pushes, function: &str) -> Response {
    pushes.served.remove(function);
    ctx.broker.unserve(function, session.conn);
    Response::Done
}

/// A reply (or a handler's error) to call `call`, handed to this connection earlier.
pub(super) fn give_back(
    ctx: &Ctx,
    session: &Session,
    call: u64,
    status: Status,
    reason: String,
    message: Box<petrel_proto::Message>,
) -> Response {
    if message.durable {
        // Refused, and the caller told at once (not left to its timeout).
        let why = "a reply is handed to its caller, never stored: it cannot be marked durable";
        ctx.broker.reply(call, session.conn, Err(why.into()));
        return Response::error(Status::BadRequest, why);
    }
    if status == Status::Ok
        && let Err(e) = ctx.broker.check_size(&message)
    {
        // Refused, and the caller told at once.
        ctx.broker.reply(call, session.conn, Err(format!("the function's reply was refused: {e}")));
        return error(e);
    }
    let result = if status == Status::Ok { Ok(*message) } else { Err(reason) };
    if ctx.broker.reply(call, session.conn, result) {
        Response::Done
    } else {
        Response::error(Status::Timeout, format!("call {call} is no longer waiting for a reply"))
    }
}

/// The channel the broker sends this connection's invocations on, and the task that turns
/// them into INVOKE pushes (made at the first SERVE).
fn invocations(
    pushes: &mut Pushes,
    outbox: &Outbox,
    capacity: usize,
    compress: Option<usize>,
) -> mpsc::Sender<Invocation> {
    let (sender, _) = pushes.invocations.get_or_insert_with(|| {
        let (sender, mut invocations) = mpsc::channel::<Invocation>(capacity);
        let outbox = outbox.clone();
        let task = tokio::spawn(async move {
            while let Some(inv) = invocations.recv().await {
                let message = outgoing(inv.message, compress);
                // The frame holds the payload (as sent: compressed or not) unless it is large
                // enough to go out after it.
                let left_out = if message.payload.len() < LARGE_PAYLOAD_BYTES { 0 } else { message.payload.len() };
                let mut frames = Vec::with_capacity(message.encoded_len() - left_out + 256);
                let push = Push::Invoke { function: inv.function, message: Box::new(message) };
                let payload = not_sent_if_too_long(push.encode_split(inv.call, &mut frames)).flatten();
                if outbox.send(Chunk { frames, payload: payload.unwrap_or_default() }).await.is_err() {
                    return;
                }
            }
        });
        (sender, task)
    });
    sender.clone()
}
