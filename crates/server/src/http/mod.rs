//! The HTTP listener (axum, on the server's runtime): Prometheus metrics (`metrics.rs`), the JSON
//! admin API (`api.rs`) and health checks. Routes and examples: docs/http.md.
//!
//! With authentication on, every route but `/healthz` asks for HTTP basic authentication of a
//! user in the users file (over TLS, or plaintext on loopback when `allow_plaintext_auth` says so,
//! as the other listeners), and that user's ACLs decide what the API shows and changes;
//! `http_open_metrics = true` leaves `/metrics` open to scrapers.

mod api;
mod dashboard;
mod listener;
mod metrics;
mod samples;

pub(crate) use metrics::Events;
pub(crate) use samples::Samples;

use std::sync::Arc;

use axum::Router;
use axum::extract::{ConnectInfo, FromRequestParts, State};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use base64::Engine as _;
use petrel_broker::security::Principal;
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::Ctx;
use crate::auth::{self, Peer};

/// Serves HTTP (and HTTPS, as the other listeners) on `listener` until `stop` turns true.
pub(crate) async fn serve(listener: TcpListener, ctx: Arc<Ctx>, mut stop: watch::Receiver<bool>) {
    let listener = match listener::HttpListener::start(listener, Arc::clone(&ctx), stop.clone()) {
        Ok(l) => l,
        Err(e) => return tracing::error!(error = %e, "the HTTP listener could not start"),
    };
    let metrics = if ctx.config.http_open_metrics {
        get(|ctx: Ctxt| metrics::scrape(ctx, metrics::Names::All))
    } else {
        get(|Caller(who): Caller, ctx: Ctxt| metrics::scrape(ctx, metrics::Names::SeenBy(who)))
    };
    let app = Router::new()
        .route("/metrics", metrics)
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/api/v1/server", get(api::server))
        .route("/api/v1/queues", get(api::queues))
        .route("/api/v1/queues/{name}", get(api::queue).put(api::create_queue).delete(api::remove_queue))
        .route("/api/v1/queues/{name}/purge", post(api::purge_queue))
        .route("/api/v1/queues/{name}/repair", post(api::repair_queue))
        .route("/api/v1/queues/{name}/reads", get(api::open_reads))
        .route("/api/v1/queues/{name}/reads/{handle}", axum::routing::delete(api::return_read))
        .route("/api/v1/topics", get(api::topics))
        .route("/api/v1/topics/{name}", get(api::topic).put(api::create_topic).delete(api::remove_topic))
        .route("/api/v1/topics/{name}/repair", post(api::repair_topic))
        .route("/api/v1/topics/{name}/groups/{group}", axum::routing::delete(api::remove_group))
        .route("/api/v1/topics/{name}/groups/{group}/reset", put(api::reset_group).post(api::reset_group))
        .route("/api/v1/connections", get(api::connections))
        .route("/api/v1/functions", get(api::functions))
        .route("/api/v1/samples", get(api::samples))
        .route("/", get(dashboard::page))
        .route("/dashboard.js", get(dashboard::script))
        .route("/dashboard.css", get(dashboard::style))
        .fallback(api::not_found)
        .layer(axum::middleware::from_fn(at_work))
        .layer(axum::extract::DefaultBodyLimit::max(MAX_BODY_BYTES))
        .layer(axum::middleware::map_response(json_errors))
        .layer(axum::middleware::from_fn_with_state(Arc::clone(&ctx), from_this_site))
        .with_state(ctx);
    let served = axum::serve(listener, app.into_make_service_with_connect_info::<listener::Remote>())
        .with_graceful_shutdown(async move {
            let _ = stop.wait_for(|s| *s).await;
        })
        .await;
    if let Err(e) = served {
        tracing::error!(error = %e, "the HTTP listener stopped");
    }
}

type Ctxt = State<Arc<Ctx>>;

/// Refuses what a web page of another site can make a browser send here. A request that
/// changes something (any method but GET and HEAD) and that the browser says comes from
/// another site (`Sec-Fetch-Site`, or an `Origin` that is not this server's `Host`) is refused:
/// a form's POST or a fetch cannot purge a queue (cross-site request forgery). `curl` and other
/// clients that are not browsers send neither header.
///
/// With authentication off, a page whose own name was made to resolve to this server (DNS
/// rebinding) is a page of the same origin to the browser: it must reach nothing through that
/// name. On a loopback listener every request must name a loopback host (`Host`); on any other,
/// the admin API and the dashboard answer only a `Host` that is an address, `localhost`, or a
/// name in `http_allowed_hosts` (`/metrics` and the health checks answer any, for scrapers and
/// probes that use the server's name).
async fn from_this_site(State(ctx): Ctxt, request: axum::extract::Request, next: axum::middleware::Next) -> Response {
    let headers = request.headers();
    let text = |name: header::HeaderName| headers.get(name).and_then(|v| v.to_str().ok());
    let host = text(header::HOST);
    let changes = !matches!(*request.method(), axum::http::Method::GET | axum::http::Method::HEAD);
    if changes {
        let fetch_site = text(header::HeaderName::from_static("sec-fetch-site"));
        let other_site = fetch_site.is_some_and(|site| site != "same-origin" && site != "none");
        let other_origin =
            text(header::ORIGIN).is_some_and(|origin| origin.split_once("://").map(|(_, authority)| authority) != host);
        if other_site || other_origin {
            return refusal(StatusCode::FORBIDDEN, "a change sent by a page of another site is refused");
        }
    }
    if !ctx.broker.auth_enabled()
        && let Some(host) = host
    {
        let loopback_listener = ctx.config.http_addr.is_some_and(|a| a.ip().is_loopback());
        let path = request.uri().path();
        if let Some(why) = unsafe_host(host, path, loopback_listener, &ctx.config.http_allowed_hosts) {
            return refusal(StatusCode::FORBIDDEN, why);
        }
    }
    next.run(request).await
}

/// Why a request naming `host` for `path` is refused with authentication off (DNS rebinding,
/// `from_this_site`), if it is.
fn unsafe_host(host: &str, path: &str, loopback_listener: bool, allowed: &[String]) -> Option<&'static str> {
    if loopback_listener && !names_loopback(host) {
        return Some("with authentication off, this listener answers only requests to a loopback host");
    }
    let name = host_name(host);
    let probe = matches!(path, "/metrics" | "/healthz" | "/readyz");
    let safe = name.eq_ignore_ascii_case("localhost")
        || name.parse::<std::net::IpAddr>().is_ok()
        || allowed.iter().any(|allowed| allowed.eq_ignore_ascii_case(name));
    (!probe && !safe).then_some(
        "with authentication off, the admin API and the dashboard answer only requests that name this server by an address, localhost, or a name in http_allowed_hosts (a web page whose own name was made to resolve here must reach nothing)",
    )
}

/// The name (or address) a `Host` header names, without its port or an IPv6 address's brackets.
fn host_name(host: &str) -> &str {
    match host.strip_prefix('[') {
        Some(v6) => v6.split(']').next().unwrap_or_default(),
        None => host.rsplit_once(':').map_or(host, |(name, _)| name),
    }
}

/// Reads a request's body within `listener::REQUEST` of now (`408` past it, `413` past
/// `MAX_BODY_BYTES`), then counts the request at work while its handler runs, so that a long
/// one (a repair, the removal of a large queue) is not cut by the connection's time limits.
async fn at_work(request: axum::extract::Request, next: axum::middleware::Next) -> Response {
    let Some(remote) = request.extensions().get::<ConnectInfo<listener::Remote>>().map(|c| c.0.clone()) else {
        return next.run(request).await;
    };
    let (parts, body) = request.into_parts();
    let late = || refusal(StatusCode::REQUEST_TIMEOUT, "the request's body did not come in time");
    let body = match tokio::time::timeout(listener::REQUEST, axum::body::to_bytes(body, MAX_BODY_BYTES)).await {
        Ok(Ok(body)) => body,
        Ok(Err(e)) => {
            return match e.into_inner().is::<http_body_util::LengthLimitError>() {
                true => {
                    refusal(StatusCode::PAYLOAD_TOO_LARGE, format!("a request body is at most {MAX_BODY_BYTES} bytes"))
                }
                // Cut by the connection's own limit on a request's time (from its first byte).
                false => late(),
            };
        }
        Err(_) => return late(),
    };
    let _working = listener::Working::start(&remote);
    next.run(axum::extract::Request::from_parts(parts, axum::body::Body::from(body))).await
}

/// Whether a `Host` header names this machine's loopback: `localhost` or a loopback address,
/// with or without a port.
fn names_loopback(host: &str) -> bool {
    let name = host_name(host);
    name.eq_ignore_ascii_case("localhost") || name.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// Samples the server every second for the dashboard, and folds the latency histograms'
/// samples into their buckets every few seconds, until `stop`.
pub(crate) async fn sample(ctx: Arc<Ctx>, mut stop: watch::Receiver<bool>) {
    let mut every = tokio::time::interval(samples::SAMPLE_EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    for tick in 0u64.. {
        tokio::select! {
            _ = every.tick() => {}
            _ = stop.changed() => return,
        }
        let ctx = Arc::clone(&ctx);
        let _ = tokio::task::spawn_blocking(move || {
            ctx.samples.take(&ctx);
            if tick % 5 == 0 {
                ctx.events.upkeep();
            }
        })
        .await;
    }
}

/// Largest request body the API reads (a queue's configuration, a group's reset: a few hundred
/// bytes); a larger one is `413`.
const MAX_BODY_BYTES: usize = 64 * 1024;

/// Errors are JSON, the API's own and axum's alike: a body over `MAX_BODY_BYTES`, a path that
/// does not decode, a body that is not the JSON asked for were plain text.
async fn json_errors(response: Response) -> Response {
    let status = response.status();
    let is_json =
        response.headers().get(header::CONTENT_TYPE).is_some_and(|t| t.as_bytes().starts_with(b"application/json"));
    if is_json || !(status.is_client_error() || status.is_server_error()) {
        return response;
    }
    let (parts, body) = response.into_parts();
    let text = axum::body::to_bytes(body, 4096).await.map(|b| String::from_utf8_lossy(&b).trim().to_owned());
    let reason =
        text.ok().filter(|t| !t.is_empty()).unwrap_or_else(|| status.canonical_reason().unwrap_or("error").into());
    let mut json = refusal(status, reason);
    for (name, value) in &parts.headers {
        if name != header::CONTENT_TYPE && name != header::CONTENT_LENGTH {
            json.headers_mut().insert(name, value.clone());
        }
    }
    json
}

/// A JSON error with its status and reason.
fn refusal(status: StatusCode, reason: impl Into<String>) -> Response {
    let body = serde_json::json!({ "status": status.as_u16(), "reason": reason.into() });
    (status, axum::Json(body)).into_response()
}

/// Who makes a request: `None` with authentication off; a request without valid credentials is
/// answered `401` before its handler runs.
pub(crate) struct Caller(pub Option<Principal>);

impl FromRequestParts<Arc<Ctx>> for Caller {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, ctx: &Arc<Ctx>) -> Result<Caller, Response> {
        let remote = parts.extensions.get::<ConnectInfo<listener::Remote>>().map(|c| c.0.clone());
        authenticate(ctx, remote, &parts.headers).await.map(Caller)
    }
}

async fn authenticate(
    ctx: &Arc<Ctx>,
    remote: Option<listener::Remote>,
    headers: &HeaderMap,
) -> Result<Option<Principal>, Response> {
    if !ctx.broker.auth_enabled() {
        return Ok(None);
    }
    let ask = |reason: &str| {
        let mut r = refusal(StatusCode::UNAUTHORIZED, reason);
        r.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Basic realm=\"petrel\""));
        r
    };
    let peer = match &remote {
        Some(r) => Peer::tcp(r.addr, r.tls, None),
        None => Peer::unix(None),
    };
    let transport_allows = peer.tls || (ctx.config.security.allow_plaintext_auth && peer.is_local());
    if !transport_allows {
        // No password is asked for where none is taken: a browser would prompt for it again
        // and again, and send it in the clear each time.
        return Err(refusal(
            StatusCode::FORBIDDEN,
            "this server takes a password over TLS only (https:// on this same port; allow_plaintext_auth permits plain HTTP on loopback)",
        ));
    }
    let credentials = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Basic "))
        .and_then(|b64| base64::engine::general_purpose::STANDARD.decode(b64.trim()).ok())
        .and_then(|raw| String::from_utf8(raw).ok());
    let Some((user, password)) = credentials.as_deref().and_then(|c| c.split_once(':')) else {
        return Err(ask("authentication required (HTTP basic: a user of the server)"));
    };
    if let Some(user) = ctx.http_logins.get(credentials.as_deref().unwrap_or_default()) {
        return Ok(Some(Principal { user, conn: 0 }));
    }
    // One check at a time for the same credentials: a dashboard's requests that come together
    // once its login was forgotten wait for the first one's check, not pay one each (each a
    // slow hash, and an attempt against auth_attempts_per_minute).
    let key = credentials.as_deref().unwrap_or_default();
    let turn = ctx.http_logins.turn(key);
    let checked = {
        let _turn = turn.mutex().lock().await;
        match ctx.http_logins.get(key) {
            Some(user) => Ok(Some(Principal { user, conn: 0 })),
            None => check_password(ctx, &peer, user, password, key).await,
        }
    };
    checked.map_err(|reason| match reason == auth::RATE_LIMITED {
        true => refusal(StatusCode::TOO_MANY_REQUESTS, &reason),
        false => ask(&reason),
    })
}

/// Checks `user`'s `password` (given as `credentials`), and keeps them verified for a minute.
async fn check_password(
    ctx: &Arc<Ctx>,
    peer: &Peer,
    user: &str,
    password: &str,
    credentials: &str,
) -> Result<Option<Principal>, String> {
    // A reload during the check (users changed) forgets what the check concludes.
    let generation = ctx.http_logins.generation();
    match auth::verify_password(ctx, peer, 0, user, password.to_owned()).await {
        Ok(()) => {
            crate::stats::add(&ctx.stats.auth_successes, 1);
            ctx.http_logins.insert(credentials, user, generation);
            Ok(Some(Principal { user: user.to_owned(), conn: 0 }))
        }
        Err(reason) => Err(reason),
    }
}

/// Credentials verified in the last minute. HTTP has no session: without this, a dashboard
/// reading the API every second would pay a password hash (tens of ms of a core) per request
/// and run into `auth_attempts_per_minute`. Bounded, and emptied by a reload (users change).
#[derive(Default)]
pub(crate) struct Logins {
    verified: std::sync::Mutex<std::collections::HashMap<String, (String, std::time::Instant)>>,
    /// Reloads so far: a check begun before one is not kept.
    generation: std::sync::atomic::AtomicU64,
    /// A turn per credentials being checked now (as many as requests under way, at most).
    checking: std::sync::Mutex<std::collections::HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

const LOGIN_KEPT: std::time::Duration = std::time::Duration::from_secs(60);
const LOGINS_KEPT: usize = 1024;

impl Logins {
    fn get(&self, credentials: &str) -> Option<String> {
        let verified = self.verified.lock().unwrap_or_else(|e| e.into_inner());
        let (user, at) = verified.get(credentials)?;
        (at.elapsed() < LOGIN_KEPT).then(|| user.clone())
    }

    /// The turn to take to check `credentials` (shared by the requests that bring them now).
    fn turn(&self, credentials: &str) -> CheckTurn<'_> {
        let mut checking = self.checking.lock().unwrap_or_else(|e| e.into_inner());
        let mutex = Arc::clone(checking.entry(credentials.to_owned()).or_default());
        CheckTurn { logins: self, credentials: credentials.to_owned(), mutex: Some(mutex) }
    }

    fn generation(&self) -> u64 {
        self.generation.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Keeps credentials verified by a check begun at `generation` (unless a reload came since).
    fn insert(&self, credentials: &str, user: &str, generation: u64) {
        let mut verified = self.verified.lock().unwrap_or_else(|e| e.into_inner());
        if self.generation() != generation {
            return;
        }
        verified.retain(|_, (_, at)| at.elapsed() < LOGIN_KEPT);
        if verified.len() >= LOGINS_KEPT {
            verified.clear();
        }
        verified.insert(credentials.to_owned(), (user.to_owned(), std::time::Instant::now()));
    }

    pub fn clear(&self) {
        let mut verified = self.verified.lock().unwrap_or_else(|e| e.into_inner());
        self.generation.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        verified.clear();
    }
}

/// A request's share of the turn to check its credentials (`Logins::turn`); forgotten with the
/// last request that holds it, also one given up midway.
struct CheckTurn<'a> {
    logins: &'a Logins,
    credentials: String,
    /// (`None` only in `drop`.)
    mutex: Option<Arc<tokio::sync::Mutex<()>>>,
}

impl CheckTurn<'_> {
    fn mutex(&self) -> &tokio::sync::Mutex<()> {
        self.mutex.as_ref().expect("a turn is held until dropped")
    }
}

impl Drop for CheckTurn<'_> {
    fn drop(&mut self) {
        let mut checking = self.logins.checking.lock().unwrap_or_else(|e| e.into_inner());
        // Let go of under the lock that shares turns out: the map's own is then the last one
        // exactly when no request holds it (two requests ending at once both see it so).
        drop(self.mutex.take());
        if checking.get(&self.credentials).is_some_and(|m| Arc::strong_count(m) == 1) {
            checking.remove(&self.credentials);
        }
    }
}

/// What the open probes share, so that a flood of them costs what one does.
pub(crate) struct Probes {
    /// `/readyz`'s last answer, and when it was found: given again for a second.
    ready: tokio::sync::Mutex<Option<(std::time::Instant, Result<(), String>)>>,
    /// `/metrics` scrapes under way (`metrics::SCRAPES_AT_ONCE`).
    scrapes: std::sync::Arc<tokio::sync::Semaphore>,
}

impl Default for Probes {
    fn default() -> Probes {
        let scrapes = std::sync::Arc::new(tokio::sync::Semaphore::new(metrics::SCRAPES_AT_ONCE));
        Probes { ready: Default::default(), scrapes }
    }
}

/// How long `/readyz` gives the answer it last found.
const READY_FOR: std::time::Duration = std::time::Duration::from_secs(1);

/// Open as `/healthz` is (an orchestrator's probe has no password): it tells only whether the
/// data directory takes a file. Looked at once a second at most, one probe at a time (a file
/// written and removed each time, on the blocking threads: probes at once would race on it).
async fn readyz(State(ctx): Ctxt) -> Response {
    let mut last = ctx.http_probes.ready.lock().await;
    let fresh = last.as_ref().filter(|(at, _)| at.elapsed() < READY_FOR).map(|(_, ready)| ready.clone());
    let ready = match fresh {
        Some(ready) => ready,
        None => {
            // The data directory takes a new file: the disk is there, writable and not full.
            let probe = ctx.config.data.join(".petrel-ready");
            let written = tokio::task::spawn_blocking(move || {
                let result = std::fs::write(&probe, b"ready");
                let _ = std::fs::remove_file(&probe);
                result
            })
            .await;
            let ready = match written {
                Ok(Ok(())) => Ok(()),
                Ok(Err(e)) => Err(format!("the data directory does not take a file: {e}")),
                Err(e) => Err(e.to_string()),
            };
            *last = Some((std::time::Instant::now(), ready.clone()));
            ready
        }
    };
    match ready {
        Ok(()) => "ready\n".into_response(),
        Err(why) => refusal(StatusCode::SERVICE_UNAVAILABLE, why),
    }
}

#[cfg(test)]
mod tests {
    use super::unsafe_host;

    /// With authentication off, a browser may reach the admin API and the dashboard only by an
    /// address, localhost or a listed name: any other name may be a rebinding page's own.
    /// `/metrics` and the health checks answer any name (scrapers and probes by DNS name).
    #[test]
    fn a_name_that_could_be_a_rebinding_page_s_reaches_no_admin_route() {
        let allowed = ["petrel.internal".to_owned()];
        for (host, path, loopback_listener, refused) in [
            ("evil.example:22135", "/api/v1/queues", false, true),
            ("evil.example:22135", "/", false, true),
            ("evil.example:22135", "/metrics", false, false),
            ("evil.example:22135", "/readyz", false, false),
            ("evil.example:22135", "/metrics", true, true),
            ("10.1.2.3:22135", "/api/v1/queues", false, false),
            ("[2001:db8::1]:22135", "/api/v1/queues", false, false),
            ("localhost:22135", "/api/v1/queues", false, false),
            ("127.0.0.1:22135", "/api/v1/queues", true, false),
            ("10.1.2.3:22135", "/api/v1/queues", true, true),
            ("PETREL.internal:22135", "/api/v1/queues", false, false),
            ("petrel.internal", "/", false, false),
            ("petrel.internal.evil.example", "/", false, true),
        ] {
            let answer = unsafe_host(host, path, loopback_listener, &allowed);
            assert_eq!(answer.is_some(), refused, "{host} {path} loopback listener {loopback_listener}: {answer:?}");
        }
    }
}
