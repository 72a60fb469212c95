//! Petrel's server: listeners speaking the native protocol (TCP, Unix socket) and the memcache
//! protocol (TCP) over one broker, each TCP port in plaintext or TLS 1.3; users and ACLs
//! (`auth`, and the broker's `authorize`) apply to every listener alike.
//!
//! The map of the crate:
//! - `lib.rs`: `Server` — binding the listeners, accepting connections (with the limits on how
//!   many), shutdown; `Ctx`, what every connection shares; `ticker.rs`: the broker's tick;
//! - `config.rs`: `Config`, every limit with its unit and default, validated at startup;
//! - `reload.rs`: what a reload (SIGHUP) changes, and the limits that live with it;
//! - `native/`: the native protocol — `connection.rs` frames, `session.rs` who the client is,
//!   `queues.rs`/`topics.rs`/`functions.rs` the requests, `pushes.rs` the push tasks;
//! - `memcache/`: the memcache (Kestrel) protocol — `codec.rs` its commands, `mod.rs` a connection;
//! - `http/`: metrics, the admin API, the dashboard and their listener;
//! - `first_use.rs`: queues made when first named, off the runtime's threads;
//! - `auth.rs`: logins (passwords, certificates), their rate limit, ACL checks and refusals;
//! - `tls.rs`: rustls configuration; `input.rs`: read buffers within the memory budget;
//! - `outbox.rs`: a connection's bounded queue of bytes to write; `connections.rs`: the registry
//!   of open connections; `stats.rs`: server-wide counters.

#![forbid(unsafe_code)]

mod auth;
mod config;
mod connections;
mod first_use;
#[doc(hidden)]
pub mod fuzzing;
mod http;
mod input;
#[doc(hidden)]
pub mod memcache;
mod native;
mod outbox;
mod reload;
mod stats;
mod ticker;
mod tls;
mod window;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

pub use config::{
    AclConfig, Config, DEFAULT_HTTP_ADDR, DEFAULT_MEMCACHE_ADDR, DEFAULT_NATIVE_ADDR, SecurityConfig, listen_address,
    parse_listener,
};
use petrel_broker::{Broker, BrokerOptions};
pub use reload::{ReloadSummary, Reloader};
use tokio::net::{TcpListener, TcpStream, UnixListener};
use tokio::sync::{Notify, watch};
use tokio::task::JoinSet;

/// What every connection of every protocol shares.
pub(crate) struct Ctx {
    pub broker: Arc<Broker>,
    pub config: Config,
    pub stats: stats::ServerStats,
    /// Notified when a client asks the server to stop (memcache `shutdown`, if allowed).
    pub shutdown: Notify,
    /// TLS as configured (replaced on reload); `None`: plaintext only.
    pub tls: std::sync::RwLock<Option<Arc<tls::Tls>>>,
    pub auth_attempts: auth::AttemptLimiter,
    /// Password checks running at once (`auth::MAX_PASSWORD_CHECKS`): each takes ~19 MiB and
    /// tens of ms of a core, so many clients logging in at once wait for a turn rather than take
    /// the memory and the blocking threads (which durable publishes and group reads need too).
    pub password_checks: Arc<tokio::sync::Semaphore>,
    /// Authenticated connections per user.
    pub user_connections: std::sync::Mutex<std::collections::HashMap<String, usize>>,
    /// Open TCP connections per client address, for `max_connections_per_address`.
    pub address_connections: std::sync::Mutex<std::collections::HashMap<std::net::IpAddr, usize>>,
    /// Every open connection and what it has done.
    pub connections: connections::Registry,
    /// Latency histograms, recorded as syncs and calls happen.
    pub events: Arc<http::Events>,
    /// The last minutes, for the dashboard's charts.
    pub samples: http::Samples,
    /// The limits a reload changes (the rest of `config` stays as the server started).
    pub limits: reload::LiveLimits,
    pub reload: std::sync::Mutex<reload::ReloadState>,
    /// HTTP basic credentials verified lately.
    pub http_logins: http::Logins,
    /// What floods of `/readyz` and `/metrics` share.
    pub http_probes: http::Probes,
    /// Queues being made for a first use.
    pub first_use: first_use::FirstUse,
}

/// Holds one of an address's connections while it lives.
struct AddressSlot {
    ctx: Arc<Ctx>,
    ip: std::net::IpAddr,
}

impl AddressSlot {
    /// A slot for one more connection from `ip`, or why there is none.
    fn take(ctx: &Arc<Ctx>, ip: std::net::IpAddr) -> Result<AddressSlot, String> {
        let max = ctx.limits.max_connections_per_address();
        // (Each address on its own, an IPv6 one too: a /64 is often a whole network of hosts,
        // not one. Login attempts, which guess, count per /64: `auth::source`.)
        let mut counts = ctx.address_connections.lock().unwrap_or_else(|e| e.into_inner());
        let n = counts.entry(ip).or_insert(0);
        if max != 0 && *n >= max {
            return Err(format!("{ip} has {max} connections open already (max_connections_per_address)"));
        }
        *n += 1;
        Ok(AddressSlot { ctx: Arc::clone(ctx), ip })
    }
}

impl Drop for AddressSlot {
    fn drop(&mut self) {
        let mut counts = self.ctx.address_connections.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = counts.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                counts.remove(&self.ip);
            }
        }
    }
}

/// Logs a request that failed in the server (storage, definitions): with the error's whole
/// paths, which the client's answer leaves out. At most one line a second: a full disk fails
/// every request, and a line each flooded the log; the next line counts those left out.
pub(crate) fn log_request_failure(protocol: &'static str, e: &petrel_broker::BrokerError) {
    stats::count_request_failure(protocol);
    static LINES: std::sync::Mutex<FailureLines> = std::sync::Mutex::new(FailureLines { window: None, left_out: 0 });
    let Some(left_out) = LINES.lock().unwrap_or_else(|e| e.into_inner()).take(std::time::Instant::now()) else {
        return;
    };
    let error = match e {
        petrel_broker::BrokerError::Storage(inner) => inner.to_string(),
        other => other.to_string(),
    };
    match left_out {
        0 => tracing::error!(protocol, %error, "request failed"),
        n => tracing::error!(protocol, %error, left_out = n, "request failed (and {n} more since the last line)"),
    }
}

/// The window of the last request failure logged, and how many were left out since.
struct FailureLines {
    window: Option<window::FixedWindow>,
    left_out: u64,
}

impl FailureLines {
    /// Whether a failure at `now` is logged, and if so how many were left out before it.
    fn take(&mut self, now: std::time::Instant) -> Option<u64> {
        let window = self.window.get_or_insert(window::FixedWindow::new(now));
        if window.admit(now, Duration::from_secs(1), 1) {
            Some(std::mem::take(&mut self.left_out))
        } else {
            self.left_out += 1;
            None
        }
    }
}

/// Refusals answered at once, each on a short task of its own; past this many under way, an
/// excess connection is closed without a word (a flood gets no more of the server's time).
const MAX_REFUSALS_UNDER_WAY: usize = 64;

/// TLS handshakes made a second to answer refused connections inside TLS (`refuse`): past it, a
/// refusal is answered in plaintext, so that a flood of refused connections from one address
/// costs the server no more than this many handshakes a second.
const REFUSAL_HANDSHAKES_PER_SECOND: u32 = 16;

impl Ctx {
    fn tls(&self) -> Option<Arc<tls::Tls>> {
        self.tls.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// How long a new connection has for its TLS handshake, HELLO and a login, together
    /// (`security.handshake_timeout`, checked at start).
    pub(crate) fn handshake_timeout(&self) -> Duration {
        self.config.security.handshake_timeout().unwrap_or(Duration::from_secs(10))
    }

    /// The handshake's deadline for a connection starting now.
    pub(crate) fn handshake_deadline(&self) -> tokio::time::Instant {
        tokio::time::Instant::now() + self.handshake_timeout()
    }

    /// Whether a connection may send what it likes (within the server's limits): it logged in
    /// (`authenticated`), or the server has no users. Before that, requests are small
    /// (`input::UNTRUSTED_BYTES`) and the handshake timeout runs.
    pub(crate) fn trusts(&self, authenticated: bool) -> bool {
        authenticated || !self.broker.auth_enabled()
    }
}

/// The TLS settings of `config`, loaded from their files.
fn load_tls(config: &Config) -> Result<Option<Arc<tls::Tls>>, String> {
    let s = &config.security;
    match (&s.tls_cert, &s.tls_key) {
        (Some(cert), Some(key)) => Ok(Some(Arc::new(tls::load(cert, key, s.tls_client_ca.as_deref())?))),
        _ => Ok(None),
    }
}

/// Hands a connection's tentative reads, temporary queues, subscriptions and served functions
/// back to the broker when dropped: at the end of the connection, and also when its task panics
/// (the task's future is dropped while unwinding), so a bug in one request leaks nothing.
pub(crate) struct Disconnect {
    pub broker: Arc<Broker>,
    pub conn: petrel_broker::ConnId,
}

impl Drop for Disconnect {
    fn drop(&mut self) {
        self.broker.disconnect(self.conn, now_ns());
    }
}

/// A server with its listeners bound, ready to `run`.
pub struct Server {
    ctx: Arc<Ctx>,
    tcp: TcpListener,
    unix: Option<UnixListener>,
    memcache: Option<TcpListener>,
    http: Option<TcpListener>,
}

impl Server {
    /// Opens the broker's data and binds the listeners.
    pub async fn bind(config: Config) -> Result<Server, String> {
        config.validate()?;
        let events = Arc::new(http::Events::new());
        let options = BrokerOptions {
            durability: config.durability()?,
            segment_bytes: config.segment_bytes,
            max_message_bytes: config.max_message_bytes,
            // A poll's answer fits a frame: the header and the count take less than 1 KiB.
            max_poll_bytes: u64::from(config.max_frame_bytes) - 1024,
            queue_defaults: config.queue_defaults()?,
            queues: config.queues()?,
            topic_max_bytes: config.topic_max_bytes,
            topic_max_age: config.topic_max_age()?,
            security: config.security.load()?,
            max_queues_per_user: config.security.max_queues_per_user,
            max_queues: config.max_queues,
            max_topics: config.max_topics,
            max_memory_bytes: config.max_memory_bytes,
            memory_queue_max_bytes: config.memory_queue_max_bytes,
            max_subscriber_bytes: config.max_subscriber_bytes,
            max_resident_bytes: config.max_resident_bytes,
            // Recorded only where a scrape can read them (the HTTP listener's sampler folds them
            // into buckets every few seconds; without it they would pile up).
            on_sync: if config.http_addr.is_some() { events.sync_observer() } else { Default::default() },
            on_call: if config.http_addr.is_some() { events.call_observer() } else { Default::default() },
        };
        let tls = load_tls(&config)?;
        let listeners =
            [("native", Some(config.native_addr)), ("memcache", config.memcache_addr), ("http", config.http_addr)];
        for (name, addr) in listeners {
            if let Some(addr) = addr
                && !addr.ip().is_loopback()
                && options.security.is_none()
            {
                tracing::warn!(listener = name, %addr, "listening beyond loopback with authentication off: anyone who can reach this port may read, write and remove every queue");
            }
        }
        // The ports are taken first, and listened on only once the data directory is open and
        // recovered: a port in use ends the start before the directory is made or touched, and
        // until the server can answer, a connection is refused rather than left in a backlog.
        let tcp = reserve(config.native_addr)?;
        let memcache = config.memcache_addr.map(reserve).transpose()?;
        let http = config.http_addr.map(reserve).transpose()?;
        // Likewise a Unix socket a live server answers on (taken again below, under the lock).
        if let Some(path) = &config.unix_socket {
            unix_socket_free(path)?;
        }
        let broker = Broker::open(&config.data, options).map_err(|e| format!("{}: {e}", config.data.display()))?;
        let unix = match &config.unix_socket {
            Some(path) => Some(bind_unix(path)?),
            None => None,
        };
        let tcp = listen(tcp, config.native_addr)?;
        let memcache = memcache.zip(config.memcache_addr).map(|(s, addr)| listen(s, addr)).transpose()?;
        let http = http.zip(config.http_addr).map(|(s, addr)| listen(s, addr)).transpose()?;
        let limits = reload::LiveLimits::new(&config);
        let ctx = Ctx {
            broker: Arc::new(broker),
            config,
            stats: stats::ServerStats::new(),
            shutdown: Notify::new(),
            tls: std::sync::RwLock::new(tls),
            auth_attempts: auth::AttemptLimiter::new(),
            password_checks: Arc::new(tokio::sync::Semaphore::new(auth::max_password_checks())),
            user_connections: std::sync::Mutex::new(std::collections::HashMap::new()),
            address_connections: std::sync::Mutex::new(std::collections::HashMap::new()),
            connections: connections::Registry::default(),
            events,
            samples: http::Samples::default(),
            limits,
            reload: std::sync::Mutex::new(reload::ReloadState::default()),
            http_logins: http::Logins::default(),
            http_probes: http::Probes::default(),
            first_use: first_use::FirstUse::default(),
        };
        Ok(Server { ctx: Arc::new(ctx), tcp, unix, memcache, http })
    }

    pub fn native_addr(&self) -> SocketAddr {
        self.tcp.local_addr().expect("a bound listener has an address")
    }

    /// What reads `config_file` (the file the server started with) again while it runs.
    pub fn reloader(&self, config_file: Option<std::path::PathBuf>) -> Reloader {
        let reloader = Reloader { ctx: Arc::clone(&self.ctx), path: config_file };
        reloader.remember_file();
        reloader
    }

    pub fn http_addr(&self) -> Option<SocketAddr> {
        self.http.as_ref().map(|l| l.local_addr().expect("a bound listener has an address"))
    }

    pub fn memcache_addr(&self) -> Option<SocketAddr> {
        self.memcache.as_ref().map(|l| l.local_addr().expect("a bound listener has an address"))
    }

    /// Serves until `shutdown` completes; then stops accepting, lets requests in flight finish
    /// (up to the configured grace), and closes the broker (syncing durable queues).
    pub async fn run(mut self, shutdown: impl Future<Output = ()>) -> Result<(), String> {
        let (stop_tx, stop_rx) = watch::channel(false);
        let ctx = Arc::clone(&self.ctx);
        let http = self.http.take().map(|l| {
            tokio::spawn(http::sample(Arc::clone(&ctx), stop_rx.clone()));
            tokio::spawn(http::serve(l, Arc::clone(&ctx), stop_rx.clone()))
        });
        let ticker = ticker::Ticker::start(Arc::clone(&ctx.broker), Duration::from_millis(ctx.config.tick_ms))
            .map_err(|e| format!("cannot start the broker's tick thread: {e}"))?;
        let next_conn = AtomicU64::new(1);
        let mut connections = JoinSet::new();
        let mut refusals = JoinSet::new();
        // Refusal handshakes this second (`REFUSAL_HANDSHAKES_PER_SECOND`).
        let mut handshakes = window::FixedWindow::new(std::time::Instant::now());
        tokio::pin!(shutdown);
        loop {
            // Reap finished connections so the sets stay bounded by the live ones.
            while let Some(ended) = connections.try_join_next() {
                log_panic(ended);
            }
            while refusals.try_join_next().is_some() {}
            // Always accepting, also when full: an excess connection is told why and closed at
            // once, instead of waiting unanswered in the listen backlog.
            let (protocol, stream, peer) = tokio::select! {
                _ = &mut shutdown => break,
                _ = ctx.shutdown.notified() => break,
                accepted = accept_tcp(self.memcache.as_ref()) => match accepted {
                    Ok((stream, peer)) => (Protocol::Memcache, stream, peer),
                    Err(e) => {
                        tracing::warn!(error = %e, "accept failed");
                        continue;
                    }
                },
                accepted = accept_tcp(Some(&self.tcp)) => match accepted {
                    Ok((stream, peer)) => (Protocol::Native, stream, peer),
                    Err(e) => {
                        tracing::warn!(error = %e, "accept failed");
                        continue;
                    }
                },
                accepted = accept_unix(self.unix.as_ref()) => {
                    match accepted {
                        // Local and trusted as the file's permissions say: only the total counts.
                        Ok(stream) if connections.len() < ctx.limits.max_connections() => {
                            let conn = next_conn.fetch_add(1, Ordering::Relaxed);
                            let greet_by = ctx.handshake_deadline();
                            let peer = auth::Peer::unix(stream.peer_cred().ok().map(|c| c.uid()));
                            connections.spawn(native::serve(stream, Arc::clone(&ctx), conn, stop_rx.clone(), peer, greet_by));
                        }
                        Ok(stream) => {
                            stats::add(&ctx.stats.connections_refused, 1);
                            if refusals.len() < MAX_REFUSALS_UNDER_WAY {
                                let reason = format!("the server has {} connections (max_connections)", connections.len());
                                let status = petrel_proto::Status::LimitReached;
                                refusals.spawn(answer_refusal(stream, Protocol::Native, status, reason));
                            }
                        }
                        Err(e) => tracing::warn!(error = %e, "accept failed"),
                    }
                    continue;
                }
                Some(ended) = connections.join_next() => {
                    log_panic(ended);
                    continue;
                }
            };
            let slot = if connections.len() >= ctx.limits.max_connections() {
                Err(format!("the server has {} connections (max_connections)", connections.len()))
            } else {
                AddressSlot::take(&ctx, peer.ip())
            };
            match slot {
                Ok(slot) => {
                    let conn = next_conn.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(conn, %peer, "connected");
                    let ctx = Arc::clone(&ctx);
                    let stop = stop_rx.clone();
                    connections.spawn(async move {
                        let _slot = slot;
                        open(stream, peer, protocol, ctx, conn, stop).await;
                    });
                }
                Err(reason) => {
                    stats::add(&ctx.stats.connections_refused, 1);
                    tracing::debug!(%peer, reason, "connection refused");
                    if refusals.len() < MAX_REFUSALS_UNDER_WAY {
                        let tls = ctx.tls().filter(|_| {
                            let second = Duration::from_secs(1);
                            handshakes.admit(std::time::Instant::now(), second, REFUSAL_HANDSHAKES_PER_SECOND)
                        });
                        let refusal = refuse(stream, tls, protocol, petrel_proto::Status::LimitReached, reason);
                        refusals.spawn(refusal);
                    }
                }
            }
        }
        tracing::info!(connections = connections.len(), "shutting down");
        drop(self.tcp);
        drop(self.memcache);
        if let (Some(_), Some(path)) = (self.unix, &ctx.config.unix_socket) {
            let _ = std::fs::remove_file(path);
        }
        let _ = stop_tx.send(true);
        while connections.join_next().await.is_some() {}
        if let Some(http) = http {
            let _ = http.await;
        }
        ticker.stop().await;
        Ok(())
    }
}

/// Sleeps until `deadline`, or forever without one (a timeout that may be off, in a `select!`).
pub(crate) async fn sleep_until_or_never(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// A connection task that panicked has already been cleaned up (`Disconnect`); say so loudly.
fn log_panic(ended: Result<(), tokio::task::JoinError>) {
    if let Err(e) = ended
        && e.is_panic()
    {
        tracing::error!(error = %e, "a connection task panicked; its connection was closed and cleaned up");
    }
}

async fn accept_tcp(listener: Option<&TcpListener>) -> std::io::Result<(TcpStream, SocketAddr)> {
    match listener {
        Some(l) => {
            let (stream, peer) = l.accept().await?;
            let _ = stream.set_nodelay(true);
            // Probes after 30 s of silence: a client gone without a word (its host powered off,
            // a cut link) is noticed in about a minute, and what it held (open reads, a
            // subscription's backlog, served functions) goes back, even with no idle timeout.
            use rustix::net::sockopt;
            let _ = sockopt::set_socket_keepalive(&stream, true);
            let _ = sockopt::set_tcp_keepidle(&stream, Duration::from_secs(30));
            let _ = sockopt::set_tcp_keepintvl(&stream, Duration::from_secs(10));
            let _ = sockopt::set_tcp_keepcnt(&stream, 3);
            Ok((stream, peer))
        }
        None => std::future::pending().await,
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Protocol {
    Native,
    Memcache,
}

/// Starts a TCP connection: TLS if it opens with a handshake (and TLS is configured), plaintext
/// unless `require_tls`; then serves its protocol. Runs on the connection's own task, so a slow
/// handshake holds up no one else, and is bounded by `handshake_timeout`.
async fn open(
    stream: TcpStream,
    addr: SocketAddr,
    protocol: Protocol,
    ctx: Arc<Ctx>,
    conn: petrel_broker::ConnId,
    stop: watch::Receiver<bool>,
) {
    // Every step of the handshake (the first byte, TLS, HELLO and a login) within one timeout
    // of the connection's start: a client that spreads them out holds its place no longer.
    let greet_by = ctx.handshake_deadline();
    let tls = ctx.tls();
    if protocol == Protocol::Memcache && tls.is_none() && !ctx.config.security.require_tls {
        // No handshake to wait for: a memcache client may open its connections long before it
        // uses them (a pool, at its program's start), and its silence is the idle timeout's to
        // end (or, on a server with users, the login's deadline: `memcache::serve`).
        let peer = auth::Peer::tcp(addr, false, None);
        return memcache::serve(stream, ctx, conn, stop, peer, greet_by).await;
    }
    let mut first = [0u8; 1];
    match tokio::time::timeout_at(greet_by, stream.peek(&mut first)).await {
        Ok(Ok(1)) => {}
        _ => return, // closed, failed, or silent for too long
    }
    if let Some(tls) = tls.filter(|_| first[0] == tls::HANDSHAKE_RECORD) {
        let stream = match tokio::time::timeout_at(greet_by, tls.acceptor.accept(stream)).await {
            Ok(Ok(stream)) => stream,
            Ok(Err(e)) => {
                stats::add(&ctx.stats.tls_refused, 1);
                tracing::debug!(conn, %addr, error = %e, "TLS handshake failed");
                return;
            }
            Err(_) => {
                stats::add(&ctx.stats.tls_refused, 1);
                return;
            }
        };
        stats::add(&ctx.stats.tls_connections, 1);
        let peer = auth::Peer::tcp(addr, true, tls::certificate_user(stream.get_ref().1));
        return match protocol {
            Protocol::Native => native::serve(stream, ctx, conn, stop, peer, greet_by).await,
            Protocol::Memcache => memcache::serve(stream, ctx, conn, stop, peer, greet_by).await,
        };
    }
    if ctx.config.security.require_tls {
        stats::add(&ctx.stats.tls_refused, 1);
        let reason = "this server requires TLS".to_owned();
        return refuse(stream, None, protocol, petrel_proto::Status::Unauthorized, reason).await;
    }
    let peer = auth::Peer::tcp(addr, false, None);
    match protocol {
        Protocol::Native => native::serve(stream, ctx, conn, stop, peer, greet_by).await,
        Protocol::Memcache => memcache::serve(stream, ctx, conn, stop, peer, greet_by).await,
    }
}

/// Tells a client, in its own protocol, why it is not served; then closes. A client that opens
/// with a TLS handshake (and the server has TLS) is answered inside TLS, the only way it can
/// read the reason. Takes a few seconds at most; the refusals under way are bounded
/// (`MAX_REFUSALS_UNDER_WAY`), and their handshakes a second (`REFUSAL_HANDSHAKES_PER_SECOND`).
async fn refuse(
    stream: TcpStream,
    tls: Option<Arc<tls::Tls>>,
    protocol: Protocol,
    status: petrel_proto::Status,
    reason: String,
) {
    const PATIENCE: Duration = Duration::from_secs(2);
    let mut first = [0u8; 1];
    if let Some(tls) = tls
        && let Ok(Ok(1)) = tokio::time::timeout(PATIENCE, stream.peek(&mut first)).await
        && first[0] == tls::HANDSHAKE_RECORD
    {
        if let Ok(Ok(stream)) = tokio::time::timeout(PATIENCE, tls.acceptor.accept(stream)).await {
            answer_refusal(stream, protocol, status, reason).await;
        }
        return;
    }
    answer_refusal(stream, protocol, status, reason).await;
}

/// `refuse`'s answer: to whatever came first (a HELLO, for any client that follows the
/// protocol), or a memcache error line.
async fn answer_refusal<S>(mut stream: S, protocol: Protocol, status: petrel_proto::Status, reason: String)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut out = Vec::new();
    match protocol {
        Protocol::Native => {
            let mut head = [0u8; 16];
            let mut got = 0;
            let read_head = async {
                while got < head.len() {
                    match stream.read(&mut head[got..]).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => got += n,
                    }
                }
            };
            let _ = tokio::time::timeout(Duration::from_secs(1), read_head).await;
            let (opcode, request_id) = match got {
                16 => (u16::from_be_bytes([head[6], head[7]]), u64::from_be_bytes(head[8..16].try_into().unwrap())),
                _ => (petrel_proto::opcode::HELLO, 0),
            };
            petrel_proto::Response::error(status, reason).encode(opcode, request_id, &mut out);
        }
        Protocol::Memcache => out.extend_from_slice(format!("SERVER_ERROR {reason}\r\n").as_bytes()),
    }
    let _ = tokio::time::timeout(Duration::from_secs(1), stream.write_all(&out)).await;
    let _ = tokio::time::timeout(Duration::from_secs(1), stream.shutdown()).await;
    // Until the client closes: closed with its bytes unread, the socket would be reset, and a
    // reset can discard the answer before the client reads it.
    let mut rest = [0u8; 1024];
    let drain = async { while matches!(stream.read(&mut rest).await, Ok(n) if n > 0) {} };
    let _ = tokio::time::timeout(Duration::from_secs(1), drain).await;
}

async fn accept_unix(listener: Option<&UnixListener>) -> std::io::Result<tokio::net::UnixStream> {
    match listener {
        Some(l) => l.accept().await.map(|(s, _)| s),
        None => std::future::pending().await,
    }
}

/// Now, in ns since the Unix epoch: the broker's clock for expiry, deadlines and timestamps.
pub(crate) fn now_ns() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
}

/// Waits for an offer to reach the disk without holding up the runtime's threads: see
/// `DurableWaits`.
pub(crate) async fn wait_durable(unsynced: petrel_broker::UnsyncedOffer) -> Result<(), petrel_broker::BrokerError> {
    if unsynced.is_durable() {
        return Ok(());
    }
    let (answer, answered) = tokio::sync::oneshot::channel();
    DURABLE_WAITS.push(unsynced, answer);
    answered.await.unwrap_or_else(|_| {
        Err(petrel_broker::BrokerError::Timeout("the wait for the disk ended without an answer".into()))
    })
}

/// Offers waiting for the disk, handed per queue to a few blocking threads rather than one
/// thread each (64 connections offering with durability `always` would otherwise keep 64
/// threads parked, and wake each for every sync). A waiting thread takes every offer queued for
/// its queue, waits for the first (the sync that covers it covers every record appended before
/// it began: the rest of the batch too, usually), and answers each as soon as it is on disk. Two
/// threads per queue, so that one collects the offers for the next sync while the other waits
/// for the current one; different queues' syncs overlap as before.
struct DurableWaits {
    queues: std::sync::Mutex<std::collections::HashMap<usize, DurableQueue>>,
}

type DurableAnswer = tokio::sync::oneshot::Sender<Result<(), petrel_broker::BrokerError>>;

#[derive(Default)]
struct DurableQueue {
    offers: std::collections::VecDeque<(petrel_broker::UnsyncedOffer, DurableAnswer)>,
    /// Threads taking from `offers` (each stops when it finds it empty).
    threads: usize,
}

/// Threads waiting for one queue's syncs at once (measured: 64 connections offering to one
/// queue reach 33–37 k/s with 2, 31–35 k/s with 1, 27–28 k/s with 4).
const DURABLE_WAIT_THREADS: usize = 2;

/// One of a queue's waiting threads, counted in `DurableQueue::threads` until it stops. A
/// blocking task the runtime drops without running it (it is shutting down) stops uncounted by
/// its drop, so that the queue's entry does not stay behind: its offers, if any, are answered
/// with an error as their answers are dropped.
struct DrainThread {
    id: usize,
    counted: bool,
}

impl DrainThread {
    fn uncount(&mut self, queues: &mut std::collections::HashMap<usize, DurableQueue>) {
        if !std::mem::take(&mut self.counted) {
            return;
        }
        let queue = queues.get_mut(&self.id).expect("a queue with a counted thread stays listed");
        queue.threads -= 1;
        if queue.threads == 0 {
            queues.remove(&self.id);
        }
    }
}

impl Drop for DrainThread {
    fn drop(&mut self) {
        if self.counted {
            self.uncount(&mut DURABLE_WAITS.lock());
        }
    }
}

static DURABLE_WAITS: std::sync::LazyLock<DurableWaits> =
    std::sync::LazyLock::new(|| DurableWaits { queues: Default::default() });

impl DurableWaits {
    fn lock(&self) -> std::sync::MutexGuard<'_, std::collections::HashMap<usize, DurableQueue>> {
        self.queues.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn push(&'static self, unsynced: petrel_broker::UnsyncedOffer, answer: DurableAnswer) {
        let id = unsynced.queue_id();
        let mut queues = self.lock();
        let queue = queues.entry(id).or_default();
        queue.offers.push_back((unsynced, answer));
        if queue.threads < DURABLE_WAIT_THREADS {
            queue.threads += 1;
            drop(queues);
            let mut thread = DrainThread { id, counted: true };
            tokio::task::spawn_blocking(move || self.drain(&mut thread));
        }
    }

    fn drain(&self, thread: &mut DrainThread) {
        loop {
            let batch = {
                let mut queues = self.lock();
                let offers = std::mem::take(&mut queues.get_mut(&thread.id).expect("a counted thread's queue").offers);
                if offers.is_empty() {
                    // Under the lock `push` takes: an offer pushed after this starts a thread.
                    thread.uncount(&mut queues);
                    return;
                }
                offers
            };
            for (unsynced, answer) in batch {
                // A panic must not end this thread uncounted (the queue's offers would wait for
                // good): the offer's answer is dropped, which its connection reports.
                if let Ok(done) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| unsynced.wait())) {
                    let _ = answer.send(done);
                }
            }
        }
    }
}

/// Runs storage work that may wait for the disk on a blocking thread (the runtime's threads go
/// on serving other connections meanwhile).
pub(crate) async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> Result<T, petrel_broker::BrokerError> + Send + 'static,
) -> Result<T, petrel_broker::BrokerError> {
    match tokio::task::spawn_blocking(work).await {
        Ok(done) => done,
        Err(e) => match e.try_into_panic() {
            Ok(panic) => std::panic::resume_unwind(panic),
            // Not started before the runtime shut down: nobody will read the answer.
            Err(_) => Err(petrel_broker::BrokerError::Timeout("the server is shutting down".into())),
        },
    }
}

/// Takes the port of `addr` (as a listener would, address reuse included) without listening yet.
fn reserve(addr: SocketAddr) -> Result<tokio::net::TcpSocket, String> {
    let failed = |e: std::io::Error| format!("bind {addr}: {e}");
    let socket = match addr {
        SocketAddr::V4(_) => tokio::net::TcpSocket::new_v4(),
        SocketAddr::V6(_) => tokio::net::TcpSocket::new_v6(),
    }
    .map_err(failed)?;
    socket.set_reuseaddr(true).map_err(failed)?;
    socket.bind(addr).map_err(failed)?;
    Ok(socket)
}

/// Listens on a port `reserve` took.
fn listen(socket: tokio::net::TcpSocket, addr: SocketAddr) -> Result<TcpListener, String> {
    socket.listen(1024).map_err(|e| format!("listen {addr}: {e}"))
}

/// Whether `path` can be a new Unix socket: nothing there, or a socket file nobody answers on (a
/// server that is gone left it). Not a live server's socket, nor a file of another kind.
fn unix_socket_free(path: &std::path::Path) -> Result<(), String> {
    use std::os::unix::fs::FileTypeExt;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty() && !d.is_dir()) {
        return Err(format!("bind {}: no directory {}", path.display(), dir.display()));
    }
    match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(format!("bind {}: {e}", path.display())),
        Ok(m) if !m.file_type().is_socket() => {
            Err(format!("bind {}: a file that is not a socket is there", path.display()))
        }
        Ok(_) if std::os::unix::net::UnixStream::connect(path).is_ok() => {
            Err(format!("bind {}: another server listens on it", path.display()))
        }
        Ok(_) => Ok(()),
    }
}

/// Listens on the Unix socket `path`, replacing a socket file left by a server that is gone
/// (`unix_socket_free`).
fn bind_unix(path: &std::path::Path) -> Result<UnixListener, String> {
    unix_socket_free(path)?;
    let _ = std::fs::remove_file(path);
    UnixListener::bind(path).map_err(|e| format!("bind {}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_failures_are_logged_at_most_once_a_second_with_a_count_of_the_rest() {
        let start = std::time::Instant::now();
        let at = |ms| start + Duration::from_millis(ms);
        let mut lines = FailureLines { window: None, left_out: 0 };
        assert_eq!(lines.take(at(0)), Some(0));
        assert_eq!((0..500).filter_map(|i| lines.take(at(1 + i))).count(), 0);
        assert_eq!(lines.take(at(1000)), Some(500), "the line after says how many were left out");
        assert_eq!(lines.take(at(2500)), Some(0));
    }

    /// Both protocols flush their streams once an answer is written. A TLS stream's write
    /// returns once it took the bytes, not once it sent them; a stream that holds writes until
    /// flushed (`BufWriter`, as TLS holds records the socket could not take at once) shows
    /// whether the server sends what it holds, or leaves the client waiting for its answer.
    #[test]
    fn answers_are_flushed_through_a_stream_that_holds_writes() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt, BufWriter};
        let harness = crate::fuzzing::Harness::new();
        let ctx = Arc::clone(harness.ctx());
        let rt = tokio::runtime::Runtime::new().unwrap();
        rt.block_on(async move {
            for protocol in [Protocol::Native, Protocol::Memcache] {
                let (mut client, server) = tokio::io::duplex(1 << 20);
                let server = BufWriter::with_capacity(1 << 20, server);
                let (_stop, stop) = watch::channel(false);
                let peer = auth::Peer::tcp(([127, 0, 0, 1], 1).into(), false, Some("max".into()));
                let deadline = ctx.handshake_deadline();
                let serving = match protocol {
                    Protocol::Native => tokio::spawn(native::serve(server, Arc::clone(&ctx), 1, stop, peer, deadline)),
                    Protocol::Memcache => {
                        tokio::spawn(memcache::serve(server, Arc::clone(&ctx), 2, stop, peer, deadline))
                    }
                };
                let (request, answer_starts) = match protocol {
                    Protocol::Native => {
                        let mut frame = Vec::new();
                        petrel_proto::Request::Ping.encode(7, &mut frame).unwrap();
                        (frame, 4)
                    }
                    Protocol::Memcache => (b"version\r\n".to_vec(), 8),
                };
                client.write_all(&request).await.unwrap();
                let mut answer = vec![0u8; answer_starts];
                let read = tokio::time::timeout(Duration::from_secs(5), client.read_exact(&mut answer)).await;
                assert!(read.is_ok_and(|r| r.is_ok()), "{protocol:?}: no answer");
                drop(client);
                let _ = serving.await;
            }
        });
    }
}
