//! The native protocol on one connection: frames in, requests to the broker, responses out.
//!
//! A reader loop decodes frames and answers what needs no waiting at once, in order, into one
//! buffer per read (so a pipelined burst of requests costs one write back); a poll that must wait
//! for a message, or an offer that must wait for room, becomes a task of its own, so a
//! connection can pipeline many requests. Every buffer is bounded: at most
//! `max_in_flight_per_connection` waiting requests (the reader stops reading past that, and TCP
//! pushes back on the client), at most `max_queued_responses` chunks of answers waiting to be
//! written.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use petrel_broker::{BrokerError, ConnId};
use petrel_proto::{Delivery, FrameError, FrameKind, Request, Response, Status, frame};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{Semaphore, mpsc, watch};

use crate::stats::add;
use crate::{Ctx, convert};

/// Serves one connection until the client closes it, a protocol error makes it unsafe to go on,
/// or the server shuts down (then requests in flight finish first).
pub(crate) async fn serve<S>(stream: S, ctx: Arc<Ctx>, conn: ConnId, mut shutdown: watch::Receiver<bool>)
where
    S: AsyncRead + AsyncWrite + Send + 'static,
{
    let counted = Arc::clone(&ctx);
    let _connection = counted.stats.connection();
    let (mut rd, mut wr) = tokio::io::split(stream);
    let (tx, mut rx) = mpsc::channel::<Vec<u8>>(ctx.config.max_queued_responses);
    let written = Arc::clone(&ctx);
    let writer = tokio::spawn(async move {
        while let Some(mut buf) = rx.recv().await {
            // Batch whatever else is ready into one write.
            while buf.len() < 64 * 1024 {
                match rx.try_recv() {
                    Ok(more) => buf.extend_from_slice(&more),
                    Err(_) => break,
                }
            }
            if wr.write_all(&buf).await.is_err() {
                break;
            }
            add(&written.stats.bytes_written, buf.len() as u64);
        }
        let _ = wr.shutdown().await;
    });
    let limit = ctx.config.max_in_flight_per_connection;
    let in_flight = Arc::new(Semaphore::new(limit));
    let mut buf = BytesMut::with_capacity(64 * 1024);
    // Answers to the requests of one read, sent to the writer together.
    let mut out = Vec::with_capacity(16 * 1024);
    let mut skip: u64 = 0;
    'read: loop {
        // Whole frames already buffered first.
        loop {
            if out.len() >= 64 * 1024 && tx.send(std::mem::take(&mut out)).await.is_err() {
                break 'read;
            }
            if skip > 0 {
                let n = skip.min(buf.len() as u64) as usize;
                let _ = buf.split_to(n);
                skip -= n as u64;
                if skip > 0 {
                    break;
                }
            }
            match frame::decode(&mut buf, ctx.config.max_frame_bytes) {
                Ok(None) => break,
                Ok(Some(f)) => {
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
                    match handle(&ctx, conn, request) {
                        Ok(response) => response.encode(f.opcode, f.request_id, &mut out),
                        Err(waiting) => {
                            // Past the limit of waiting requests, stop reading: TCP pushes back.
                            let Ok(permit) = Arc::clone(&in_flight).acquire_owned().await else { break 'read };
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
                    if request_id.is_none() && buf.len() < 4 + frame::HEADER_LEN {
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
        if !out.is_empty() && tx.send(std::mem::take(&mut out)).await.is_err() {
            break;
        }
        tokio::select! {
            read = rd.read_buf(&mut buf) => match read {
                Ok(0) | Err(_) => break,
                Ok(n) => add(&ctx.stats.bytes_read, n as u64),
            },
            _ = shutdown.changed() => break,
        }
    }
    if !out.is_empty() {
        let _ = tx.send(out).await;
    }
    // Let requests in flight finish (bounded by the server's shutdown grace), then close.
    let grace = ctx.config.shutdown_grace().unwrap_or(Duration::from_secs(5));
    let _ = tokio::time::timeout(grace, in_flight.acquire_many(limit as u32)).await;
    drop(tx);
    let _ = writer.await;
    ctx.broker.disconnect(conn);
}

async fn send(tx: &mpsc::Sender<Vec<u8>>, op: u16, request_id: u64, response: &Response) {
    let mut out = Vec::with_capacity(64);
    response.encode(op, request_id, &mut out);
    let _ = tx.send(out).await;
}

fn now_ns() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
}

fn error(e: BrokerError) -> Response {
    let status = match &e {
        BrokerError::NotFound(_) => Status::QueueNotFound,
        BrokerError::Full(_) => Status::QueueFull,
        BrokerError::Exists(_) => Status::Exists,
        BrokerError::BadRequest(_) => Status::BadRequest,
        BrokerError::TooLarge { .. } => Status::TooLarge,
        BrokerError::Storage(_) | BrokerError::Definitions(_) => Status::ServerError,
    };
    if status == Status::ServerError {
        tracing::error!(error = %e, "request failed");
    }
    Response::error(status, e.to_string())
}

/// A request that must wait: for a message (poll) or for room (offer).
enum Waiting {
    Offer { queue: String, messages: Vec<petrel_broker::Message>, timeout_ms: u32 },
    Poll { queue: String, max: usize, visibility: Option<Duration>, timeout_ms: u32 },
}

impl Waiting {
    async fn finish(self, ctx: &Ctx, conn: ConnId) -> Response {
        match self {
            Waiting::Offer { queue, messages, timeout_ms } => offer_waiting(ctx, &queue, messages, timeout_ms).await,
            Waiting::Poll { queue, max, visibility, timeout_ms } => {
                poll_waiting(ctx, conn, &queue, max, visibility, timeout_ms).await
            }
        }
    }
}

/// Answers one request at once, or says what it must wait for.
fn handle(ctx: &Ctx, conn: ConnId, request: Request) -> Result<Response, Waiting> {
    let broker = &ctx.broker;
    Ok(match request {
        Request::Hello { .. } => Response::Hello {
            server: format!("petrel/{}", env!("CARGO_PKG_VERSION")),
            max_frame: ctx.config.max_frame_bytes,
        },
        Request::Ping => Response::Pong,
        Request::QueueCreate { name, config } => {
            let owner = config.temporary.then_some(conn);
            match broker.create_queue(&name, convert::config_in(config), owner) {
                Ok(_) => Response::Done,
                Err(e) => error(e),
            }
        }
        Request::QueueRemove { name } => match broker.remove_queue(&name) {
            Ok(()) => Response::Done,
            Err(e) => error(e),
        },
        Request::QueueList => Response::QueueList { names: broker.queue_names() },
        Request::QueueStatus { name } => match broker.queue(&name) {
            Some(q) => Response::QueueStatus { stats: convert::stats_out(q.stats(), &q.config) },
            None => error(BrokerError::NotFound(name)),
        },
        Request::Offer { queue, timeout_ms, messages } => {
            let mut messages: Vec<_> = messages.into_iter().map(convert::message_in).collect();
            let offered = broker.queue(&queue).ok_or_else(|| BrokerError::NotFound(queue.clone()));
            match offered.and_then(|q| broker.offer_to(&q, &mut messages, now_ns())) {
                Err(BrokerError::Full(_)) if timeout_ms > 0 => {
                    return Err(Waiting::Offer { queue, messages, timeout_ms });
                }
                Ok((first_id, count)) => Response::Offered { first_id, count },
                Err(e) => error(e),
            }
        }
        Request::Poll { queue, max, timeout_ms, visibility_ms } => {
            let visibility = (visibility_ms > 0).then(|| Duration::from_millis(visibility_ms as u64));
            let max = (max as usize).clamp(1, 10_000);
            match broker.poll(&queue, max, visibility, conn, now_ns()) {
                Ok(d) if d.is_empty() && timeout_ms > 0 => {
                    return Err(Waiting::Poll { queue, max, visibility, timeout_ms });
                }
                Ok(d) => polled(d),
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
    })
}

fn polled(deliveries: Vec<petrel_broker::Delivery>) -> Response {
    if deliveries.is_empty() {
        return Response::error(Status::QueueEmpty, "");
    }
    Response::Polled {
        deliveries: deliveries
            .into_iter()
            .map(|d| Delivery { handle: d.handle, message: convert::message_out(d.message) })
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
) -> Response {
    let deadline = Instant::now() + Duration::from_millis(timeout_ms as u64);
    loop {
        let Some(q) = ctx.broker.queue(queue) else { return error(BrokerError::NotFound(queue.to_owned())) };
        let notified = q.available.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        match ctx.broker.poll(queue, max, visibility, conn, now_ns()) {
            Ok(d) if d.is_empty() => {}
            other => return other.map_or_else(error, polled),
        }
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
        match ctx.broker.offer_to(&q, &mut messages, now_ns()) {
            Err(BrokerError::Full(_)) => {}
            Ok((first_id, count)) => return Response::Offered { first_id, count },
            Err(e) => return error(e),
        }
        if tokio::time::timeout_at(deadline.into(), notified).await.is_err() {
            return error(BrokerError::Full(queue.to_owned()));
        }
    }
}
