//! The JSON admin API under `/api/v1/`: the server, queues and topics, read and changed.
//!
//! Every answer is JSON; an error is `{"status": CODE, "reason": "…"}`. With authentication
//! on, a request carries basic credentials of a user (see `mod.rs`), and the user's ACLs decide
//! as on the other listeners: reading a queue or topic needs any right on it, creating,
//! removing or purging one needs `manage`.

use std::sync::Arc;

use axum::Json;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use petrel_broker::security::{Action, Kind, Principal};
use petrel_broker::{BrokerError, QueueConfig, QueueStats};
use serde_json::{Value, json};

use super::{Caller, refusal};
use crate::Ctx;
use crate::stats::get as read;

type Ctxt = State<Arc<Ctx>>;

const ANY_QUEUE_RIGHT: &[Action] = &[Action::Offer, Action::Poll, Action::Manage];
const ANY_TOPIC_RIGHT: &[Action] = &[Action::Publish, Action::Subscribe, Action::Manage];

/// The answer to a broker error: its HTTP status and its text.
fn broker_error(e: BrokerError) -> Response {
    let status = match &e {
        BrokerError::NotFound(_) | BrokerError::TopicNotFound(_) | BrokerError::FunctionNotFound(_) => {
            StatusCode::NOT_FOUND
        }
        BrokerError::Exists(_) => StatusCode::CONFLICT,
        BrokerError::BadRequest(_) => StatusCode::BAD_REQUEST,
        BrokerError::Limit(_) => StatusCode::TOO_MANY_REQUESTS,
        BrokerError::Unauthorized(_) => StatusCode::UNAUTHORIZED,
        BrokerError::Forbidden(_) => StatusCode::FORBIDDEN,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    };
    refusal(status, e.to_string())
}

fn may(ctx: &Ctx, who: Option<&Principal>, kind: Kind, name: &str, actions: &[Action]) -> bool {
    ctx.broker.may(who, kind, name, actions)
}

fn forbidden(what: &str) -> Response {
    refusal(StatusCode::FORBIDDEN, format!("this user may not {what}"))
}

fn queue_json(name: &str, config: &QueueConfig, st: &QueueStats) -> Value {
    json!({
        "name": name,
        "config": config,
        "messages": st.items,
        "bytes": st.bytes,
        "open_reads": st.in_flight,
        "open_read_bytes": st.in_flight_bytes,
        "waiters": st.waiters,
        "offered": st.total_offered,
        "delivered": st.total_polled,
        "expired": st.expired,
        "dropped": st.dropped,
        "aborted": st.aborted,
        "flushes": st.flushes,
    })
}

pub(super) async fn server(State(ctx): Ctxt, _: Caller) -> Response {
    let s = &ctx.stats;
    let (memory, memory_max) = ctx.broker.memory();
    let (resident, _) = ctx.broker.resident_pages();
    let c = &ctx.config;
    Json(json!({
        "version": env!("CARGO_PKG_VERSION"),
        "uptime_secs": s.started.elapsed().as_secs(),
        "connections": read(&s.curr_connections),
        "queues": ctx.broker.queue_names().len(),
        "topics": ctx.broker.topic_names().len(),
        "authentication": ctx.broker.auth_enabled(),
        "memory": { "queued_bytes": memory, "max_memory_bytes": memory_max },
        "resident": { "counted_bytes": resident, "max_resident_bytes": c.max_resident_bytes },
        "limits": {
            "max_connections": c.max_connections,
            "max_connections_per_address": c.max_connections_per_address,
            "max_queues": c.max_queues,
            "max_message_bytes": c.max_message_bytes,
            "max_frame_bytes": c.max_frame_bytes,
        },
    }))
    .into_response()
}

pub(super) async fn queues(State(ctx): Ctxt, Caller(who): Caller) -> Response {
    let list: Vec<Value> = ctx
        .broker
        .queue_names()
        .iter()
        .filter(|n| may(&ctx, who.as_ref(), Kind::Queue, n, ANY_QUEUE_RIGHT))
        .filter_map(|n| ctx.broker.queue(n))
        .map(|q| queue_json(&q.name, &q.config, &q.stats()))
        .collect();
    Json(json!({ "queues": list })).into_response()
}

pub(super) async fn queue(State(ctx): Ctxt, Caller(who): Caller, Path(name): Path<String>) -> Response {
    if !may(&ctx, who.as_ref(), Kind::Queue, &name, ANY_QUEUE_RIGHT) {
        return forbidden("see this queue");
    }
    match ctx.broker.queue(&name) {
        Some(q) => Json(queue_json(&q.name, &q.config, &q.stats())).into_response(),
        None => broker_error(BrokerError::NotFound(name)),
    }
}

/// `PUT /api/v1/queues/NAME` with a queue configuration (`docs/configuration.md`; `{}` for the
/// defaults): creates it (`201`); the same configuration again is `200`, another one `409`.
pub(super) async fn create_queue(
    State(ctx): Ctxt,
    Caller(who): Caller,
    Path(name): Path<String>,
    body: axum::body::Bytes,
) -> Response {
    if !may(&ctx, who.as_ref(), Kind::Queue, &name, &[Action::Manage]) {
        return forbidden("create this queue");
    }
    let config: QueueConfig = if body.iter().all(u8::is_ascii_whitespace) {
        QueueConfig::default()
    } else {
        match serde_json::from_slice(&body) {
            Ok(c) => c,
            Err(e) => return refusal(StatusCode::BAD_REQUEST, format!("queue configuration: {e}")),
        }
    };
    if config.temporary {
        return refusal(StatusCode::BAD_REQUEST, "a temporary queue belongs to a connection; HTTP has none");
    }
    let existed = ctx.broker.queue(&name).is_some();
    match ctx.broker.create_queue_by(who.as_ref(), &name, config, None) {
        Ok(q) => {
            let status = if existed { StatusCode::OK } else { StatusCode::CREATED };
            (status, Json(queue_json(&q.name, &q.config, &q.stats()))).into_response()
        }
        Err(e) => broker_error(e),
    }
}

pub(super) async fn remove_queue(State(ctx): Ctxt, Caller(who): Caller, Path(name): Path<String>) -> Response {
    if !may(&ctx, who.as_ref(), Kind::Queue, &name, &[Action::Manage]) {
        return forbidden("remove this queue");
    }
    match ctx.broker.remove_queue(&name) {
        Ok(()) => Json(json!({ "removed": name })).into_response(),
        Err(e) => broker_error(e),
    }
}

/// `POST /api/v1/queues/NAME/purge`: every waiting message goes; open reads stay open.
pub(super) async fn purge_queue(State(ctx): Ctxt, Caller(who): Caller, Path(name): Path<String>) -> Response {
    if !may(&ctx, who.as_ref(), Kind::Queue, &name, &[Action::Manage]) {
        return forbidden("purge this queue");
    }
    let Some(q) = ctx.broker.queue(&name) else { return broker_error(BrokerError::NotFound(name)) };
    let flushed = tokio::task::spawn_blocking(move || q.flush()).await;
    match flushed {
        Ok(Ok(n)) => Json(json!({ "purged": n })).into_response(),
        Ok(Err(e)) => broker_error(e),
        Err(e) => refusal(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    }
}

pub(super) async fn topics(State(ctx): Ctxt, Caller(who): Caller) -> Response {
    let list: Vec<Value> = ctx
        .broker
        .topic_names()
        .iter()
        .filter(|n| may(&ctx, who.as_ref(), Kind::Topic, n, ANY_TOPIC_RIGHT))
        .filter_map(|n| Some((n.clone(), ctx.broker.topic(n)?)))
        .map(|(name, t)| {
            let st = t.stats();
            json!({
                "name": name,
                "durable": t.is_durable(),
                "subscribers": st.subscribers,
                "published": st.published,
                "delivered": st.delivered,
                "slow_subscribers_ended": st.slow_subscribers_ended,
            })
        })
        .collect();
    Json(json!({ "topics": list })).into_response()
}

pub(super) async fn not_found() -> Response {
    refusal(StatusCode::NOT_FOUND, "no such route (docs/http.md lists them)")
}
