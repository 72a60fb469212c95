//! The JSON admin API under `/api/v1/`: the server, queues, topics and their consumer groups,
//! connections, functions and the last minutes' samples; read and changed.
//!
//! Every answer is JSON; an error is `{"status": CODE, "reason": "…"}`. With authentication
//! on, a request carries basic credentials of a user (see `mod.rs`), and the user's ACLs decide
//! as on the other listeners: reading a queue, topic or function needs any right on it;
//! creating, removing or purging one, or moving a consumer group, needs `manage`; the list of
//! connections (peers and users) is an admin's.

use std::sync::Arc;

use axum::Json;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use petrel_broker::security::{Action, Kind, Principal};
use petrel_broker::{BrokerError, Queue, SeekTo, Topic};
use serde_json::{Value, json};

use super::{Caller, refusal};
use crate::Ctx;
use crate::stats::get as read;

type Ctxt = State<Arc<Ctx>>;

pub(super) const ANY_QUEUE_RIGHT: &[Action] = &[Action::Offer, Action::Poll, Action::Manage];
pub(super) const ANY_TOPIC_RIGHT: &[Action] = &[Action::Publish, Action::Subscribe, Action::Manage];
pub(super) const ANY_FUNCTION_RIGHT: &[Action] = &[Action::Exec, Action::Serve, Action::Manage];

/// The answer to a broker error: its HTTP status and its text.
fn broker_error(e: BrokerError) -> Response {
    let status = match &e {
        BrokerError::NotFound(_)
        | BrokerError::TopicNotFound(_)
        | BrokerError::GroupNotFound { .. }
        | BrokerError::FunctionNotFound(_) => StatusCode::NOT_FOUND,
        BrokerError::Exists(..) | BrokerError::TopicExists(..) | BrokerError::Held(_) => StatusCode::CONFLICT,
        BrokerError::BadRequest(_) => StatusCode::BAD_REQUEST,
        BrokerError::Limit(_) => StatusCode::TOO_MANY_REQUESTS,
        BrokerError::Unauthorized(_) => StatusCode::UNAUTHORIZED,
        BrokerError::Forbidden(_) => StatusCode::FORBIDDEN,
        BrokerError::Damaged { .. } => StatusCode::SERVICE_UNAVAILABLE,
        // (`crate::blocking` of a stopping server)
        BrokerError::Timeout(_) => StatusCode::SERVICE_UNAVAILABLE,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    };
    if status == StatusCode::INTERNAL_SERVER_ERROR {
        // The server's own failure (a disk that refuses, a definition that cannot be written):
        // logged and counted as the protocols' are, not only told to the one who asked.
        crate::log_request_failure("http", &e);
    }
    refusal(status, e.to_string())
}

/// Whether `who` may see `name` in a list (not a refusal: not counted).
fn may(ctx: &Ctx, who: Option<&Principal>, kind: Kind, name: &str, actions: &[Action]) -> bool {
    ctx.broker.may(who, kind, name, actions)
}

/// Whether the request may go on; a refusal is counted in `acl_denials`, as the protocols' are,
/// and logged at debug level (a script refused again and again would flood the log otherwise).
fn allowed(ctx: &Ctx, who: Option<&Principal>, kind: Kind, name: &str, actions: &[Action]) -> bool {
    match ctx.broker.authorize(who, kind, name, actions) {
        Ok(()) => true,
        Err(e) => {
            tracing::debug!(error = %e, "an HTTP request refused by the ACL");
            false
        }
    }
}

fn forbidden(what: &str) -> Response {
    refusal(StatusCode::FORBIDDEN, format!("this user may not {what}"))
}

fn queue_json(q: &Queue) -> Value {
    let (config, st) = (q.config(), q.counters());
    json!({
        "name": q.name,
        "config": *config,
        "follows_defaults": q.follows_defaults(),
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
        "dead_lettered": st.dead_lettered,
        "dead_letters_lost": st.dead_letters_lost,
        "deduplicated": st.deduplicated,
        "dedup_keys": st.dedup_keys,
        "delayed": st.delayed,
        "acked": st.acked,
        "flushes": st.flushes,
    })
}

fn topic_json(name: &str, t: &Topic) -> Value {
    let st = t.status();
    let groups: Vec<Value> = st
        .groups
        .iter()
        .map(|g| {
            json!({
                "name": g.name,
                "committed": g.committed,
                "next_offset": g.next_offset,
                "lag": g.lag,
                "open": g.open,
            })
        })
        .collect();
    json!({
        "name": name,
        "durable": t.is_durable(),
        "subscribers": st.subscribers,
        "published": st.published,
        "delivered": st.delivered,
        "slow_subscribers_ended": st.slow_subscribers_ended,
        "groups": groups,
    })
}

/// A JSON body, or `{}` when empty; the error is the reason for a `400`.
fn body_json<T: serde::de::DeserializeOwned + Default>(body: &[u8], what: &str) -> Result<T, String> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(T::default());
    }
    serde_json::from_slice(body).map_err(|e| format!("{what}: {e}"))
}

pub(super) async fn server(State(ctx): Ctxt, Caller(who): Caller) -> Response {
    let s = &ctx.stats;
    // Names a user may not see stay unseen here too: damaged ones are listed if the user may see
    // them, and the last reload (which names queues, topics and the configuration's path) is
    // shown to admins only.
    let who = who.as_ref();
    let admin = may(&ctx, who, Kind::Queue, "*", &[Action::Manage]);
    let visible = |kind: Kind, rights: &'static [Action]| {
        let ctx = &ctx;
        move |(name, _): &(String, String)| may(ctx, who, kind, name, rights)
    };
    let damaged_queues: Vec<_> =
        ctx.broker.damaged_queues().into_iter().filter(visible(Kind::Queue, ANY_QUEUE_RIGHT)).collect();
    let damaged_topics: Vec<_> =
        ctx.broker.damaged_topics().into_iter().filter(visible(Kind::Topic, ANY_TOPIC_RIGHT)).collect();
    let reload = match admin {
        true => json!(ctx.reload.lock().unwrap_or_else(|e| e.into_inner()).status.clone()),
        false => Value::Null,
    };
    let (memory, memory_max) = ctx.broker.memory();
    let (resident, _) = ctx.broker.resident_pages();
    let c = &ctx.config;
    Json(json!({
        "version": env!("CARGO_PKG_VERSION"),
        "uptime_secs": s.started.elapsed().as_secs(),
        "connections": read(&s.curr_connections),
        "queues": ctx.broker.queue_names().len(),
        "damaged_queues": damaged_json(damaged_queues),
        "damaged_topics": damaged_json(damaged_topics),
        "topics": ctx.broker.topic_names().len(),
        "authentication": ctx.broker.auth_enabled(),
        "memory": { "queued_bytes": memory, "max_memory_bytes": memory_max },
        "resident": { "counted_bytes": resident, "max_resident_bytes": c.max_resident_bytes },
        "reload": reload,
        "limits": {
            "max_connections": ctx.limits.max_connections(),
            "max_connections_per_address": ctx.limits.max_connections_per_address(),
            "max_connections_per_user": ctx.limits.max_connections_per_user(),
            "idle_timeout_ms": ctx.limits.idle_timeout().map_or(0, |d| d.as_millis() as u64),
            "max_queues": c.max_queues,
            "max_topics": c.max_topics,
            "max_queues_per_user": c.security.max_queues_per_user,
            "max_memory_bytes": memory_max,
            "max_resident_bytes": c.max_resident_bytes,
            "memory_queue_max_bytes": c.memory_queue_max_bytes,
            "max_subscriber_bytes": c.max_subscriber_bytes,
            "max_message_bytes": c.max_message_bytes,
            "max_frame_bytes": c.max_frame_bytes,
            "max_in_flight_per_connection": c.max_in_flight_per_connection,
            "max_queued_responses": c.max_queued_responses,
            "max_queued_response_bytes": c.max_queued_response_bytes,
            "max_subscriptions_per_connection": c.max_subscriptions_per_connection,
            "max_functions_per_connection": c.max_functions_per_connection,
            "auth_attempts_per_minute": c.security.auth_attempts_per_minute,
            "handshake_timeout_ms": ctx.handshake_timeout().as_millis() as u64,
        },
    }))
    .into_response()
}

/// A listing takes each destination's lock in turn (a queue may hold its own across a sync):
/// built on a blocking thread, not the runtime's.
async fn listed(build: impl FnOnce() -> Value + Send + 'static) -> Response {
    match tokio::task::spawn_blocking(build).await {
        Ok(list) => Json(list).into_response(),
        Err(e) => refusal(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    }
}

pub(super) async fn queues(State(ctx): Ctxt, Caller(who): Caller) -> Response {
    listed(move || {
        let list: Vec<Value> = ctx
            .broker
            .queue_names()
            .iter()
            .filter(|n| may(&ctx, who.as_ref(), Kind::Queue, n, ANY_QUEUE_RIGHT))
            .filter_map(|n| ctx.broker.queue(n))
            .map(|q| queue_json(&q))
            .collect();
        json!({ "queues": list })
    })
    .await
}

pub(super) async fn queue(State(ctx): Ctxt, Caller(who): Caller, Path(name): Path<String>) -> Response {
    if !allowed(&ctx, who.as_ref(), Kind::Queue, &name, ANY_QUEUE_RIGHT) {
        return forbidden("see this queue");
    }
    match ctx.broker.queue(&name) {
        // (The queue's lock, which it may hold across a sync: not on a runtime thread.)
        Some(q) => listed(move || queue_json(&q)).await,
        None => broker_error(ctx.broker.missing(&name)),
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
    if !allowed(&ctx, who.as_ref(), Kind::Queue, &name, &[Action::Manage]) {
        return forbidden("create this queue");
    }
    // What the body leaves out: what a queue of that name made by first use gets.
    let config = match crate::config::queue_over(&ctx.broker.config_for(&name), &body) {
        Ok(c) => c,
        Err(e) => return refusal(StatusCode::BAD_REQUEST, format!("queue configuration: {e}")),
    };
    if config.temporary {
        return refusal(StatusCode::BAD_REQUEST, "a temporary queue belongs to a connection; HTTP has none");
    }
    let existed = ctx.broker.queue(&name).is_some();
    // Off the runtime's threads: making a queue is file-system work (see `first_use`).
    let broker = Arc::clone(&ctx.broker);
    let made = crate::blocking(move || broker.create_queue_by(who.as_ref(), &name, config, None)).await;
    match made {
        Ok(q) => {
            let status = if existed { StatusCode::OK } else { StatusCode::CREATED };
            (status, Json(queue_json(&q))).into_response()
        }
        Err(e) => broker_error(e),
    }
}

pub(super) async fn remove_queue(State(ctx): Ctxt, Caller(who): Caller, Path(name): Path<String>) -> Response {
    if !allowed(&ctx, who.as_ref(), Kind::Queue, &name, &[Action::Manage]) {
        return forbidden("remove this queue");
    }
    // Off the runtime's threads: removing a queue deletes its files.
    let (broker, removing) = (Arc::clone(&ctx.broker), name.clone());
    match crate::blocking(move || broker.remove_queue(&removing)).await {
        Ok(()) => Json(json!({ "removed": name })).into_response(),
        Err(e) => broker_error(e),
    }
}

/// `POST /api/v1/queues/NAME/purge`: every waiting message goes; open reads stay open.
pub(super) async fn purge_queue(State(ctx): Ctxt, Caller(who): Caller, Path(name): Path<String>) -> Response {
    if !allowed(&ctx, who.as_ref(), Kind::Queue, &name, &[Action::Manage]) {
        return forbidden("purge this queue");
    }
    let Some(q) = ctx.broker.queue(&name) else { return broker_error(ctx.broker.missing(&name)) };
    let flushed = tokio::task::spawn_blocking(move || q.flush()).await;
    match flushed {
        Ok(Ok(n)) => Json(json!({ "purged": n })).into_response(),
        Ok(Err(e)) => broker_error(e),
        Err(e) => refusal(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    }
}

/// Damaged queues or topics as `/api/v1/server` lists them.
fn damaged_json(list: Vec<(String, String)>) -> Value {
    list.into_iter().map(|(name, reason)| json!({ "name": name, "reason": reason })).collect()
}

/// What a repair of one log did, as the repair endpoints answer it.
fn repair_json(log: &str, r: &petrel_log::verify::RepairReport) -> Value {
    json!({
        "log": log,
        "records_removed": r.records_removed,
        "records_replaced": r.records_replaced,
        "segments_removed": r.segments_removed,
        "cut_at": r.cut_at.as_ref().map(|(file, position)| json!({
            "file": file.file_name().map(|f| f.to_string_lossy().into_owned()),
            "position": position,
        })),
        "headers_rewritten": r.headers_rewritten,
        "groups_restarted": r.groups_restarted,
        "next_offset": r.next_offset,
    })
}

/// `POST /api/v1/queues/NAME/repair`: repairs a damaged queue's logs in place and serves it
/// again (`Broker::repair_damaged`); what each repair cut is in the answer and the log.
pub(super) async fn repair_queue(State(ctx): Ctxt, Caller(who): Caller, Path(name): Path<String>) -> Response {
    if !allowed(&ctx, who.as_ref(), Kind::Queue, &name, &[Action::Manage]) {
        return forbidden("repair this queue");
    }
    // Off the runtime's threads: a repair reads every record of the queue's logs.
    let broker = Arc::clone(&ctx.broker);
    let repairing = name.clone();
    match crate::blocking(move || broker.repair_damaged(&repairing)).await {
        Ok(logs) => {
            let logs: Vec<Value> = logs.iter().map(|(log, r)| repair_json(log, r)).collect();
            Json(json!({ "queue": name, "served": true, "logs": logs })).into_response()
        }
        Err(e) => broker_error(e),
    }
}

/// `POST /api/v1/topics/NAME/repair`: repairs a damaged durable topic's log in place and serves
/// it again (`Broker::repair_damaged_topic`).
pub(super) async fn repair_topic(State(ctx): Ctxt, Caller(who): Caller, Path(name): Path<String>) -> Response {
    if !allowed(&ctx, who.as_ref(), Kind::Topic, &name, &[Action::Manage]) {
        return forbidden("repair this topic");
    }
    let broker = Arc::clone(&ctx.broker);
    let repairing = name.clone();
    match crate::blocking(move || broker.repair_damaged_topic(&repairing)).await {
        Ok(r) => Json(json!({ "topic": name, "served": true, "logs": [repair_json("", &r)] })).into_response(),
        Err(e) => broker_error(e),
    }
}

/// Open reads listed at most (`?limit=` asks for fewer or more, up to this).
const MAX_LISTED_READS: usize = 10_000;

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ReadsQuery {
    limit: Option<usize>,
}

/// `GET /api/v1/queues/NAME/reads?limit=N`: the queue's open reliable reads, oldest first (100
/// unless `limit` says otherwise), with how many there are. Who holds each (peer and user) is
/// shown to admins, as in `/api/v1/connections`; others see the connection's id.
pub(super) async fn open_reads(
    State(ctx): Ctxt,
    Caller(who): Caller,
    Path(name): Path<String>,
    query: Result<axum::extract::Query<ReadsQuery>, axum::extract::rejection::QueryRejection>,
) -> Response {
    if !allowed(&ctx, who.as_ref(), Kind::Queue, &name, ANY_QUEUE_RIGHT) {
        return forbidden("see this queue");
    }
    let limit = match query {
        Ok(q) => q.limit.unwrap_or(100).min(MAX_LISTED_READS),
        Err(e) => return refusal(StatusCode::BAD_REQUEST, e.body_text()),
    };
    let Some(q) = ctx.broker.queue(&name) else { return broker_error(ctx.broker.missing(&name)) };
    let admin = may(&ctx, who.as_ref(), Kind::Queue, "*", &[Action::Manage]);
    let now = crate::now_ns();
    // (The queue's lock, which it may hold across a sync: not on a runtime thread.)
    let Ok((total, reads)) = tokio::task::spawn_blocking(move || q.open_reads(limit)).await else {
        return refusal(StatusCode::SERVICE_UNAVAILABLE, "the server is shutting down");
    };
    let list: Vec<Value> = reads
        .iter()
        .map(|r| {
            let mut read = json!({
                "handle": r.handle,
                "message_id": r.message_id,
                "bytes": r.bytes,
                "connection": r.consumer,
                "taken_at_ms": r.taken_at_ns / 1_000_000,
                "open_ms": now.saturating_sub(r.taken_at_ns) / 1_000_000,
                // None for a read without a visibility timeout (a memcache `/open`): it is held
                // until its consumer closes, aborts or goes.
                "returns_in_ms": (r.deadline_ns != u64::MAX).then(|| r.deadline_ns.saturating_sub(now) / 1_000_000),
            });
            if admin && let Some(c) = ctx.connections.get(r.consumer) {
                read["peer"] = json!(c.peer);
                read["user"] = json!(c.user());
                read["protocol"] = json!(c.protocol);
            }
            read
        })
        .collect();
    Json(json!({ "queue": name, "total": total, "reads": list })).into_response()
}

/// `DELETE /api/v1/queues/NAME/reads/HANDLE`: puts an open read back at the head of the queue,
/// whoever holds it (its consumer's acknowledgement then finds nothing).
pub(super) async fn return_read(
    State(ctx): Ctxt,
    Caller(who): Caller,
    Path((name, handle)): Path<(String, String)>,
) -> Response {
    if !allowed(&ctx, who.as_ref(), Kind::Queue, &name, &[Action::Manage]) {
        return forbidden("return this queue's open reads");
    }
    let Ok(handle) = handle.parse::<u64>() else {
        return refusal(StatusCode::BAD_REQUEST, format!("{handle:?} is not a read's handle (a number)"));
    };
    let Some(q) = ctx.broker.queue(&name) else { return broker_error(ctx.broker.missing(&name)) };
    // A return may sync (a redelivery delay), create a dead-letter queue and wait for its sync:
    // not on a runtime thread.
    let broker = Arc::clone(&ctx.broker);
    match crate::blocking(move || broker.return_read(&q, handle, crate::now_ns())).await {
        Ok(true) => Json(json!({ "returned": handle })).into_response(),
        Ok(false) => refusal(StatusCode::NOT_FOUND, format!("queue {name:?} has no open read {handle}")),
        Err(e) => broker_error(e),
    }
}

pub(super) async fn topics(State(ctx): Ctxt, Caller(who): Caller) -> Response {
    listed(move || {
        let list: Vec<Value> = ctx
            .broker
            .topic_names()
            .iter()
            .filter(|n| may(&ctx, who.as_ref(), Kind::Topic, n, ANY_TOPIC_RIGHT))
            .filter_map(|n| Some(topic_json(n, ctx.broker.topic(n)?.as_ref())))
            .collect();
        json!({ "topics": list })
    })
    .await
}

pub(super) async fn topic(State(ctx): Ctxt, Caller(who): Caller, Path(name): Path<String>) -> Response {
    if !allowed(&ctx, who.as_ref(), Kind::Topic, &name, ANY_TOPIC_RIGHT) {
        return forbidden("see this topic");
    }
    match ctx.broker.topic(&name) {
        Some(t) => Json(topic_json(&name, &t)).into_response(),
        None => broker_error(ctx.broker.missing_topic(&name)),
    }
}

#[derive(Default, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
struct TopicConfig {
    durable: bool,
}

/// `PUT /api/v1/topics/NAME` with `{"durable": true}` or `{}`: creates it (`201`); the same
/// again is `200`; a topic of the other kind by that name `409`.
pub(super) async fn create_topic(
    State(ctx): Ctxt,
    Caller(who): Caller,
    Path(name): Path<String>,
    body: axum::body::Bytes,
) -> Response {
    if !allowed(&ctx, who.as_ref(), Kind::Topic, &name, &[Action::Manage]) {
        return forbidden("create this topic");
    }
    let config: TopicConfig = match body_json(&body, "topic configuration") {
        Ok(c) => c,
        Err(reason) => return refusal(StatusCode::BAD_REQUEST, reason),
    };
    let existed = ctx.broker.topic(&name).is_some();
    let broker = Arc::clone(&ctx.broker);
    let created = {
        let name = name.clone();
        tokio::task::spawn_blocking(move || broker.create_topic(&name, config.durable)).await
    };
    match created {
        Ok(Ok(t)) => {
            let status = if existed { StatusCode::OK } else { StatusCode::CREATED };
            (status, Json(topic_json(&name, &t))).into_response()
        }
        Ok(Err(e)) => broker_error(e),
        Err(e) => refusal(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    }
}

pub(super) async fn remove_topic(State(ctx): Ctxt, Caller(who): Caller, Path(name): Path<String>) -> Response {
    if !allowed(&ctx, who.as_ref(), Kind::Topic, &name, &[Action::Manage]) {
        return forbidden("remove this topic");
    }
    // Off the runtime's threads: removing a durable topic deletes its files.
    let (broker, removing) = (Arc::clone(&ctx.broker), name.clone());
    match crate::blocking(move || broker.remove_topic(&removing)).await {
        Ok(()) => Json(json!({ "removed": name })).into_response(),
        Err(e) => broker_error(e),
    }
}

/// Where a consumer group is moved: `{"to": "oldest"}`, `{"to": "newest"}`, `{"offset": N}`
/// (a message's id is its offset + 1) or `{"time_ms": T}` (the first message at or after it).
#[derive(Default, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
struct GroupReset {
    to: Option<String>,
    offset: Option<u64>,
    time_ms: Option<u64>,
}

impl GroupReset {
    fn seek_to(&self) -> Result<SeekTo, String> {
        match (self.to.as_deref(), self.offset, self.time_ms) {
            (Some("oldest"), None, None) => Ok(SeekTo::Oldest),
            (Some("newest"), None, None) => Ok(SeekTo::Newest),
            (None, Some(offset), None) => Ok(SeekTo::Offset(offset)),
            (None, None, Some(ms)) => Ok(SeekTo::Time(ms.saturating_mul(1_000_000))),
            _ => Err(r#"say one of {"to": "oldest"}, {"to": "newest"}, {"offset": N}, {"time_ms": T}"#.into()),
        }
    }
}

/// `PUT /api/v1/topics/NAME/groups/GROUP/reset`: moves a group that nobody reads through now.
pub(super) async fn reset_group(
    State(ctx): Ctxt,
    Caller(who): Caller,
    Path((name, group)): Path<(String, String)>,
    body: axum::body::Bytes,
) -> Response {
    if !allowed(&ctx, who.as_ref(), Kind::Topic, &name, &[Action::Manage]) {
        return forbidden("move this topic's consumer groups");
    }
    let to = match body_json::<GroupReset>(&body, "group reset").and_then(|r| r.seek_to()) {
        Ok(to) => to,
        Err(reason) => return refusal(StatusCode::BAD_REQUEST, reason),
    };
    let Some(t) = ctx.broker.topic(&name) else { return broker_error(ctx.broker.missing_topic(&name)) };
    let moved = tokio::task::spawn_blocking(move || t.reset_group(&group, to).map(|_| t)).await;
    match moved {
        Ok(Ok(t)) => Json(topic_json(&name, &t)).into_response(),
        Ok(Err(e)) => broker_error(e),
        Err(e) => refusal(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    }
}

pub(super) async fn remove_group(
    State(ctx): Ctxt,
    Caller(who): Caller,
    Path((name, group)): Path<(String, String)>,
) -> Response {
    if !allowed(&ctx, who.as_ref(), Kind::Topic, &name, &[Action::Manage]) {
        return forbidden("remove this topic's consumer groups");
    }
    let Some(t) = ctx.broker.topic(&name) else { return broker_error(ctx.broker.missing_topic(&name)) };
    // (Its cursor file removed: not on a runtime thread.)
    let removing = group.clone();
    match crate::blocking(move || t.remove_group(&removing)).await {
        Ok(()) => Json(json!({ "removed": group })).into_response(),
        Err(e) => broker_error(e),
    }
}

/// `GET /api/v1/connections`: every open connection (an admin's view: peers and users).
pub(super) async fn connections(State(ctx): Ctxt, Caller(who): Caller) -> Response {
    // Not counted as an ACL denial: the dashboard asks every second for any user, and only an
    // admin's is answered.
    if !may(&ctx, who.as_ref(), Kind::Queue, "*", &[Action::Manage]) {
        return forbidden("list connections (an admin's)");
    }
    let list: Vec<Value> = ctx
        .connections
        .list()
        .iter()
        .map(|c| {
            json!({
                "id": c.id,
                "peer": c.peer,
                "user": c.user(),
                "protocol": c.protocol,
                "tls": c.tls,
                "requests": read(&c.requests),
                "received_bytes": read(&c.received_bytes),
                "sent_bytes": read(&c.sent_bytes),
                "connected_secs": c.opened.elapsed().as_secs(),
            })
        })
        .collect();
    Json(json!({ "connections": list })).into_response()
}

/// `GET /api/v1/functions`: every function served now, its servers (connection ids; `null` for
/// one in the server's process) and figures.
pub(super) async fn functions(State(ctx): Ctxt, Caller(who): Caller) -> Response {
    let list: Vec<Value> = ctx
        .broker
        .functions()
        .into_iter()
        .filter(|f| may(&ctx, who.as_ref(), Kind::Function, &f.name, ANY_FUNCTION_RIGHT))
        .map(|f| {
            json!({
                "name": f.name,
                "servers": f.servers,
                "waiting": f.waiting,
                "calls": f.stats.calls,
                "errors": f.stats.errors,
                "timeouts": f.stats.timeouts,
            })
        })
        .collect();
    Json(json!({ "functions": list })).into_response()
}

/// `GET /api/v1/samples`: the server once a second over the last ten minutes, oldest first.
pub(super) async fn samples(State(ctx): Ctxt, _: Caller) -> Response {
    let interval_ms = super::samples::SAMPLE_EVERY.as_millis() as u64;
    Json(json!({ "interval_ms": interval_ms, "samples": ctx.samples.list() })).into_response()
}

pub(super) async fn not_found() -> Response {
    refusal(StatusCode::NOT_FOUND, "no such route (docs/http.md lists them)")
}
