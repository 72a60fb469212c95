//! The HTTP listener (axum, on the server's runtime): Prometheus metrics and health checks.
//!
//! With authentication on, every route but `/healthz` asks for HTTP basic authentication of a
//! user in the users file (over TLS, or plaintext on loopback when `allow_plaintext_auth` says so,
//! as the other listeners); `http_open_metrics = true` leaves `/metrics` open to scrapers.
//! Metrics are read from the broker and the server's counters at each scrape into a fresh
//! recorder (not a second set of counters to keep in step, and a removed queue's series go with
//! it), rendered in the Prometheus text format by `metrics-exporter-prometheus`.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::extract::{ConnectInfo, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use base64::Engine as _;
use metrics::{Key, KeyName, Label, Metadata, Recorder};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusRecorder};
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::Ctx;
use crate::auth::{self, Peer};
use crate::stats::get as read;

/// Serves HTTP on `listener` until `stop` turns true.
pub(crate) async fn serve(listener: TcpListener, ctx: Arc<Ctx>, mut stop: watch::Receiver<bool>) {
    let app = Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .with_state(ctx);
    let served = axum::serve(listener, app.into_make_service_with_connect_info::<SocketAddr>())
        .with_graceful_shutdown(async move {
            let _ = stop.wait_for(|s| *s).await;
        })
        .await;
    if let Err(e) = served {
        tracing::error!(error = %e, "the HTTP listener stopped");
    }
}

type Ctxt = State<Arc<Ctx>>;

/// A JSON error with its status and reason.
fn refusal(status: StatusCode, reason: impl Into<String>) -> Response {
    let body = serde_json::json!({ "status": status.as_u16(), "reason": reason.into() });
    (status, axum::Json(body)).into_response()
}

/// `Ok` if the request may go on: authentication off, or basic credentials of a known user.
async fn authenticate(ctx: &Arc<Ctx>, peer: SocketAddr, headers: &HeaderMap) -> Result<(), Response> {
    if !ctx.broker.auth_enabled() {
        return Ok(());
    }
    let ask = || {
        let mut r = refusal(StatusCode::UNAUTHORIZED, "authentication required (HTTP basic: a user of the server)");
        r.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Basic realm=\"petrel\""));
        r
    };
    let credentials = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Basic "))
        .and_then(|b64| base64::engine::general_purpose::STANDARD.decode(b64.trim()).ok())
        .and_then(|raw| String::from_utf8(raw).ok());
    let Some((user, password)) = credentials.as_deref().and_then(|c| c.split_once(':')) else { return Err(ask()) };
    let peer = Peer { addr: Some(peer), tls: false, certificate_user: None };
    match auth::with_password(ctx, &peer, 0, user.to_owned(), password.to_owned()).await {
        Ok(_) => Ok(()),
        Err(reason) => {
            let mut r = ask();
            *r.body_mut() = axum::body::Body::from(serde_json::json!({ "status": 401, "reason": reason }).to_string());
            Err(r)
        }
    }
}

async fn readyz(State(ctx): Ctxt, ConnectInfo(peer): ConnectInfo<SocketAddr>, headers: HeaderMap) -> Response {
    if let Err(r) = authenticate(&ctx, peer, &headers).await {
        return r;
    }
    // The data directory takes a new file: the disk is there, writable and not full.
    let probe = ctx.config.data.join(".petrel-ready");
    let written = tokio::task::spawn_blocking(move || {
        let result = std::fs::write(&probe, b"ready");
        let _ = std::fs::remove_file(&probe);
        result
    })
    .await;
    match written {
        Ok(Ok(())) => "ready\n".into_response(),
        Ok(Err(e)) => refusal(StatusCode::SERVICE_UNAVAILABLE, format!("the data directory does not take a file: {e}")),
        Err(e) => refusal(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
    }
}

async fn metrics(State(ctx): Ctxt, ConnectInfo(peer): ConnectInfo<SocketAddr>, headers: HeaderMap) -> Response {
    if !ctx.config.http_open_metrics
        && let Err(r) = authenticate(&ctx, peer, &headers).await
    {
        return r;
    }
    let scrape = Scrape::new();
    scrape.collect(&ctx);
    let kind = "text/plain; version=0.0.4; charset=utf-8";
    ([(header::CONTENT_TYPE, kind)], scrape.recorder.handle().render()).into_response()
}

/// One scrape: every figure read now into a recorder of its own.
struct Scrape {
    recorder: PrometheusRecorder,
}

static METADATA: Metadata<'static> = Metadata::new(module_path!(), metrics::Level::INFO, Some(module_path!()));

impl Scrape {
    fn new() -> Scrape {
        Scrape { recorder: PrometheusBuilder::new().build_recorder() }
    }

    fn gauge(&self, name: &'static str, help: &'static str, labels: Vec<Label>, value: u64) {
        self.recorder.describe_gauge(KeyName::from_const_str(name), None, help.into());
        self.recorder.register_gauge(&Key::from_parts(name, labels), &METADATA).set(value as f64);
    }

    fn counter(&self, name: &'static str, help: &'static str, labels: Vec<Label>, value: u64) {
        self.recorder.describe_counter(KeyName::from_const_str(name), None, help.into());
        self.recorder.register_counter(&Key::from_parts(name, labels), &METADATA).absolute(value);
    }

    fn collect(&self, ctx: &Ctx) {
        let s = &ctx.stats;
        let broker = &ctx.broker;
        let none = Vec::new;
        self.gauge("petrel_connections", "Open client connections.", none(), read(&s.curr_connections));
        self.counter("petrel_connections_accepted_total", "Connections accepted.", none(), read(&s.total_connections));
        let refused = read(&s.connections_refused);
        self.counter("petrel_connections_refused_total", "Connections refused at a limit.", none(), refused);
        self.counter("petrel_idle_closed_total", "Connections closed as idle.", none(), read(&s.idle_closed));
        self.counter("petrel_received_bytes_total", "Bytes read from clients.", none(), read(&s.bytes_read));
        self.counter("petrel_sent_bytes_total", "Bytes written to clients.", none(), read(&s.bytes_written));
        self.counter("petrel_auth_failures_total", "Failed authentications.", none(), read(&s.auth_failures));
        self.counter("petrel_acl_denials_total", "Requests an ACL refused.", none(), broker.denials());
        let (memory_used, memory_max) = broker.memory();
        self.gauge("petrel_memory_queued_bytes", "Bytes held against max_memory_bytes.", none(), memory_used);
        self.gauge("petrel_memory_budget_bytes", "max_memory_bytes (0: no limit).", none(), memory_max);
        let (resident, releases) = broker.resident_pages();
        let help = "Mapped segment bytes counted against max_resident_bytes.";
        self.gauge("petrel_resident_counted_bytes", help, none(), resident);
        self.counter("petrel_resident_releases_total", "Segments that gave their pages back.", none(), releases);
        if let Ok(fs) = rustix::fs::statvfs(&ctx.config.data) {
            self.gauge(
                "petrel_disk_free_bytes",
                "Free bytes for the data directory.",
                none(),
                fs.f_bavail * fs.f_frsize,
            );
            let total = fs.f_blocks * fs.f_frsize;
            self.gauge("petrel_disk_total_bytes", "Size of the data directory's file system.", none(), total);
        }
        let names = broker.queue_names();
        self.gauge("petrel_queues", "Queues.", none(), names.len() as u64);
        if !ctx.config.metrics_per_queue {
            return;
        }
        for name in &names {
            let Some(q) = broker.queue(name).map(|q| q.stats()) else { continue };
            let labels = || vec![Label::new("queue", name.clone())];
            self.gauge("petrel_queue_messages", "Messages waiting (not taken).", labels(), q.items);
            self.gauge("petrel_queue_bytes", "Bytes of messages waiting and in flight.", labels(), q.bytes);
            let help = "Messages taken tentatively, not yet acknowledged.";
            self.gauge("petrel_queue_open_reads", help, labels(), q.in_flight);
            self.gauge("petrel_queue_waiters", "Consumers waiting for a message.", labels(), q.waiters);
            self.counter("petrel_queue_offered_total", "Messages offered.", labels(), q.total_offered);
            self.counter("petrel_queue_delivered_total", "Messages taken by consumers.", labels(), q.total_polled);
            self.counter("petrel_queue_expired_total", "Messages that expired.", labels(), q.expired);
        }
    }
}
