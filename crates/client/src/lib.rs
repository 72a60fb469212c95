//! Rust client for Petrel's native protocol.
//!
//! [`Client`] is async (tokio), cheap to clone, and pipelines: calls from many tasks share one
//! connection, each waiting only for its own response. [`blocking::Client`] wraps it for code
//! without a runtime. [`Follower`] reads a queue or a topic across server restarts: it connects
//! again with backoff and repeats what is safe to repeat (polls, group subscriptions).
//!
//! ```no_run
//! # async fn demo() -> Result<(), petrel_client::ClientError> {
//! use petrel_client::{Client, Message, PollOptions, QueueConfig};
//! let client = Client::connect("127.0.0.1:22134").await?;
//! client.create_queue("jobs", QueueConfig { durable: true, ..Default::default() }).await?;
//! client.offer("jobs", vec![Message::new(&b"build"[..])], None).await?;
//! for d in client.poll("jobs", PollOptions { max: 10, visibility: Some(std::time::Duration::from_secs(30)), ..Default::default() }).await? {
//!     client.ack("jobs", &[d.handle]).await?;
//! }
//! # Ok(()) }
//! ```
//!
//! [`Cluster`] spreads work over N independent servers and routes around one that fails
//! (`docs/cluster.md`).
//!
//! The map of the crate: `lib.rs` holds the connection (a writer and a reader task, requests
//! matched to answers by id), the async `Client` and `blocking`; `follow.rs` the `Follower`;
//! `cluster.rs` the `Cluster`.

#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
pub use petrel_proto::{
    CompactString, Delivery, GroupStats, Message, MessageKind, QueueConfig, QueueStats, Request, Response, StartFrom,
    Status, TopicStats, compression,
};
use petrel_proto::{FrameKind, Push, frame};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{mpsc, oneshot};

mod cluster;
mod follow;
pub use cluster::{
    Cluster, ClusterAcks, ClusterDelivery, ClusterHandle, ClusterOptions, ClusterStats, ClusterSubscription, Offered,
    ServerState,
};
pub use follow::{ConnectionEvent, EventHandler, FollowedSubscription, Follower, Reconnect};

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The server answered with a status other than OK.
    #[error("{status}: {message}")]
    Status { status: Status, message: String },
    #[error("connection: {0}")]
    Io(#[from] std::io::Error),
    #[error("protocol: {0}")]
    Protocol(String),
    #[error("connection closed")]
    Closed,
    #[error("TLS: {0}")]
    Tls(String),
    /// A server of a cluster could not take the request (each one's reason is in the text, and
    /// for a request to every server, those that did it).
    #[error("unavailable: {0}")]
    Unavailable(String),
    /// The request cannot be sent as it is (a text field longer than the protocol carries), or
    /// the client was given a bad argument: nothing was sent.
    #[error("invalid request: {0}")]
    Invalid(String),
}

/// The path of the Unix socket `addr` names (`unix:PATH`, or a path that starts with `/`, `./`
/// or `../`), if it names one rather than a TCP address.
pub fn unix_socket_path(addr: &str) -> Option<&str> {
    let a_path = addr.starts_with('/') || addr.starts_with("./") || addr.starts_with("../");
    addr.strip_prefix("unix:").or_else(|| a_path.then_some(addr))
}

/// `connecting`, given up after `timeout`; its error names `addr`.
async fn connect_within<S>(
    addr: &str,
    timeout: Duration,
    connecting: impl std::future::Future<Output = std::io::Result<S>>,
) -> Result<S, ClientError> {
    let failed = |e: std::io::Error| ClientError::Io(std::io::Error::new(e.kind(), format!("connect to {addr}: {e}")));
    match tokio::time::timeout(timeout, connecting).await {
        Ok(connected) => connected.map_err(failed),
        Err(_) => Err(failed(std::io::ErrorKind::TimedOut.into())),
    }
}

/// `request`'s answer, or a `TimedOut` error naming `from` once `limit` passes: for a caller that
/// must not wait on a server that stopped answering (stopped, hung, a cut link).
pub async fn answer_within<T>(
    limit: Duration,
    from: &str,
    request: impl std::future::Future<Output = Result<T, ClientError>>,
) -> Result<T, ClientError> {
    tokio::time::timeout(limit, request).await.unwrap_or_else(|_| {
        let why = format!("no answer from {from} within {limit:?}");
        Err(ClientError::Io(std::io::Error::new(std::io::ErrorKind::TimedOut, why)))
    })
}

/// How to reach a server: TLS, credentials, patience.
#[derive(Clone, Debug)]
pub struct ClientOptions {
    /// Authenticate as this user (AUTH after HELLO).
    pub user: Option<String>,
    pub password: Option<String>,
    /// Speak TLS 1.3 (required for a password unless the server allows plaintext on loopback).
    pub tls: Option<TlsOptions>,
    /// For the TCP connection, the TLS handshake and HELLO, each.
    pub connect_timeout: Duration,
    /// For the answer to AUTH: longer than the others, since a server checks a few passwords at
    /// a time (each a slow hash, a failure answered after a delay), so a login may wait its turn.
    pub auth_timeout: Duration,
    /// Ask for zstd-compressed payloads: if the server agrees, payloads of at least this many
    /// bytes go compressed both ways (the server uses its own cutoff). `None`: never.
    pub compress_min_bytes: Option<usize>,
}

impl Default for ClientOptions {
    fn default() -> Self {
        ClientOptions {
            user: None,
            password: None,
            tls: None,
            connect_timeout: Duration::from_secs(5),
            auth_timeout: Duration::from_secs(10),
            compress_min_bytes: None,
        }
    }
}

/// TLS settings: the CA that signed the server's certificate, and a client certificate for
/// mutual TLS.
#[derive(Clone, Debug, Default)]
pub struct TlsOptions {
    /// PEM file of the CA certificates the server's certificate must chain to.
    pub ca: std::path::PathBuf,
    /// PEM files of a client certificate and its key (mutual TLS: the certificate names the user).
    pub cert: Option<std::path::PathBuf>,
    pub key: Option<std::path::PathBuf>,
    /// The name the server's certificate must carry (default: the host of the address).
    pub server_name: Option<String>,
}

impl TlsOptions {
    fn connector(&self) -> Result<tokio_rustls::TlsConnector, ClientError> {
        use rustls::pki_types::pem::PemObject;
        use rustls::pki_types::{CertificateDer, PrivateKeyDer};
        let bad =
            |path: &std::path::Path, e: &dyn std::fmt::Display| ClientError::Tls(format!("{}: {e}", path.display()));
        let mut roots = rustls::RootCertStore::empty();
        for cert in CertificateDer::pem_file_iter(&self.ca).map_err(|e| bad(&self.ca, &e))? {
            roots.add(cert.map_err(|e| bad(&self.ca, &e))?).map_err(|e| bad(&self.ca, &e))?;
        }
        // AES-128-GCM first (as the server prefers it): a third cheaper per byte than AES-256.
        let mut provider = rustls::crypto::ring::default_provider();
        provider.cipher_suites.sort_by_key(|s| s.suite() != rustls::CipherSuite::TLS13_AES_128_GCM_SHA256);
        let builder = rustls::ClientConfig::builder_with_provider(Arc::new(provider))
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| ClientError::Tls(e.to_string()))?
            .with_root_certificates(roots);
        let config = match (&self.cert, &self.key) {
            (Some(cert), Some(key)) => {
                let chain = CertificateDer::pem_file_iter(cert)
                    .map_err(|e| bad(cert, &e))?
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|e| bad(cert, &e))?;
                let key_der = PrivateKeyDer::from_pem_file(key).map_err(|e| bad(key, &e))?;
                builder.with_client_auth_cert(chain, key_der).map_err(|e| bad(cert, &e))?
            }
            (None, None) => builder.with_no_client_auth(),
            _ => return Err(ClientError::Tls("a client certificate needs its key, and a key its certificate".into())),
        };
        Ok(tokio_rustls::TlsConnector::from(Arc::new(config)))
    }
}

impl ClientError {
    /// The response status, if the server gave one.
    pub fn status(&self) -> Option<Status> {
        match self {
            ClientError::Status { status, .. } => Some(*status),
            _ => None,
        }
    }
}

type Reply = oneshot::Sender<Result<Response, ClientError>>;
type Writer = Box<dyn AsyncWrite + Send + Unpin>;

/// Largest frame the client reads from a server; a longer one ends the connection (a peer that
/// is not a Petrel server, or a broken one). Generous: a poll may return many large messages.
const MAX_INCOMING_FRAME: u32 = 1 << 30;
/// Bytes of a large incoming frame that must have arrived before room for all of it is made.
const EXACT_ROOM_AFTER: usize = 64 << 10;

/// Requests encoded and not yet written are held up to this many bytes; past it, callers wait.
const MAX_OUTBOX: usize = 1 << 20;

/// The connection's shared state: requests waiting for their response, by request id (with
/// their opcode, to decode it), and the bytes of requests not yet written.
struct Pending {
    waiting: HashMap<u64, (u16, Reply), BuildIdHasher>,
    /// Where each subscription's deliveries go, by subscription id.
    subscriptions: HashMap<u64, mpsc::Sender<Result<Message, ClientError>>>,
    /// SUBSCRIBE requests in flight, by request id: the reader registers the subscription when
    /// it reads the answer, before it reads any delivery that follows.
    subscribing: HashMap<u64, mpsc::Sender<Result<Message, ClientError>>>,
    /// Where calls of each function this client serves go: (call id, request).
    functions: HashMap<String, mpsc::Sender<(u64, Message)>>,
    /// Encoded requests for the writer task, which sends all that gathered in one write.
    outbox: Outbox,
    /// The connection is gone: new requests fail at once instead of waiting forever.
    closed: bool,
    /// Told `true` when `closed` is set (`Client::closed`).
    ended: tokio::sync::watch::Sender<bool>,
    /// Ids of requests no caller waits for the answer of (the client's own, and those sent
    /// unanswered): counted down from the top, apart from callers' (counted up from 1).
    own_ids: u64,
    /// Bytes the compressed payloads of one answer or push may unfold to: the server's largest
    /// frame, as its HELLO says (a server's answers and pushes hold at most that much).
    max_unfold: usize,
}

impl Default for Pending {
    fn default() -> Pending {
        Pending {
            waiting: HashMap::default(),
            subscriptions: HashMap::new(),
            subscribing: HashMap::new(),
            functions: HashMap::new(),
            outbox: Outbox::default(),
            closed: false,
            ended: tokio::sync::watch::Sender::new(false),
            own_ids: u64::MAX,
            max_unfold: petrel_proto::DEFAULT_MAX_FRAME as usize,
        }
    }
}

/// Encoded requests waiting for the writer: their bytes, and the large payloads of calls and
/// returns left out of them (`Request::encode_split`), each to be written after `bytes[..at]`, so
/// that a large payload goes from the caller's buffer to the socket without a copy.
#[derive(Default)]
struct Outbox {
    bytes: Vec<u8>,
    payloads: Vec<(usize, Bytes)>,
    payload_bytes: usize,
}

impl Outbox {
    fn push(&mut self, request: &Request, id: u64) -> Result<(), petrel_proto::EncodeError> {
        if let Some(payload) = request.encode_split(id, &mut self.bytes)? {
            self.payload_bytes += payload.len();
            self.payloads.push((self.bytes.len(), payload));
        }
        Ok(())
    }

    fn len(&self) -> usize {
        self.bytes.len() + self.payload_bytes
    }

    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn clear(&mut self) {
        self.bytes.clear();
        self.payloads.clear();
        self.payload_bytes = 0;
    }

    /// Everything in the order it goes on the wire.
    fn slices(&self) -> Vec<std::io::IoSlice<'_>> {
        let mut slices = Vec::with_capacity(2 * self.payloads.len() + 1);
        let mut from = 0;
        for (at, payload) in &self.payloads {
            slices.push(std::io::IoSlice::new(&self.bytes[from..*at]));
            slices.push(std::io::IoSlice::new(payload));
            from = *at;
        }
        slices.push(std::io::IoSlice::new(&self.bytes[from..]));
        slices.retain(|s| !s.is_empty());
        slices
    }
}

/// Request ids are a counter: a multiplicative hash spreads them well, far cheaper than SipHash.
type BuildIdHasher = rustc_hash::FxBuildHasher;

impl Pending {
    /// Queues a request no caller waits for the answer of (the writer is to be woken).
    fn send_own(&mut self, request: &Request) {
        if self.closed {
            return;
        }
        let id = self.own_ids;
        self.own_ids -= 1;
        let _ = self.outbox.push(request, id);
    }

    /// The connection is gone: every request waiting fails with `error()`, and so will new ones.
    fn close(&mut self, error: impl Fn() -> ClientError) {
        self.closed = true;
        self.ended.send_replace(true);
        self.outbox.clear();
        // A subscription's last item says why it ended (unless its buffer is full).
        for (_, tx) in self.subscriptions.drain() {
            let _ = tx.try_send(Err(error()));
        }
        self.subscribing.clear();
        self.functions.clear();
        for (_, (_, tx)) in self.waiting.drain() {
            let _ = tx.send(Err(error()));
        }
    }
}

struct Inner {
    pending: Arc<Mutex<Pending>>,
    /// Wakes the writer task: the outbox has bytes.
    written: Arc<tokio::sync::Notify>,
    /// Wakes callers waiting for room in the outbox.
    room: Arc<tokio::sync::Notify>,
    next_id: AtomicU64,
    /// Payloads of at least this many bytes are sent compressed; 0: not negotiated.
    compress_min_bytes: std::sync::atomic::AtomicUsize,
    /// The server takes deliveries given back unseen (`features::RETURN_UNSEEN`).
    returns_unseen: std::sync::atomic::AtomicBool,
    /// This connection must log in (`features::AUTH_REQUIRED` in HELLO's answer).
    auth_required: std::sync::atomic::AtomicBool,
    reader: tokio::task::JoinHandle<()>,
    writer: tokio::task::JoinHandle<()>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.reader.abort();
        self.writer.abort();
    }
}

/// What a queue stored of an offer (`Client::offer_stored`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stored {
    /// The first message's id; for an offer of repeats only, the first original's.
    pub first_id: u64,
    /// Messages not stored because they repeat an idempotency key the queue remembers (or one
    /// earlier in the offer): the others were stored.
    pub repeats: u32,
}

/// How to poll.
#[derive(Clone, Copy, Debug)]
pub struct PollOptions {
    pub max: u32,
    /// Wait this long for a first message (zero: answer at once).
    pub timeout: Duration,
    /// Take tentatively: unacknowledged after this long, the messages go back to the queue.
    pub visibility: Option<Duration>,
}

impl Default for PollOptions {
    fn default() -> Self {
        PollOptions { max: 1, timeout: Duration::ZERO, visibility: None }
    }
}

#[derive(Clone)]
pub struct Client {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client").finish_non_exhaustive()
    }
}

/// Sets up a new TCP connection: no delay for small writes, and keepalive probes after 30 s
/// of silence, so that a server gone without a word (its host powered off, a cut link) is
/// noticed in about a minute instead of never: a subscriber or a follower waits on a connection
/// that carries nothing for long, and only then reconnects.
fn tcp_ready(stream: &tokio::net::TcpStream) -> std::io::Result<()> {
    use rustix::net::sockopt;
    stream.set_nodelay(true)?;
    // (A system that refuses these keeps the connection without them.)
    let _ = sockopt::set_socket_keepalive(stream, true);
    let _ = sockopt::set_tcp_keepidle(stream, Duration::from_secs(30));
    let _ = sockopt::set_tcp_keepintvl(stream, Duration::from_secs(10));
    let _ = sockopt::set_tcp_keepcnt(stream, 3);
    Ok(())
}

impl Client {
    /// Connects over TCP and says hello.
    pub async fn connect(addr: impl tokio::net::ToSocketAddrs) -> Result<Client, ClientError> {
        let stream = tokio::net::TcpStream::connect(addr).await?;
        tcp_ready(&stream)?;
        Client::over(stream).await
    }

    /// Connects to `addr` with `options`: TLS if `options.tls` is set, then HELLO, then AUTH if
    /// `options.user` is set. `addr` is `host:port`, or a Unix socket's path (`unix_socket_path`),
    /// where TLS is refused: the server speaks it on TCP only. Errors name the address.
    pub async fn connect_with(addr: &str, options: &ClientOptions) -> Result<Client, ClientError> {
        if let Some(path) = unix_socket_path(addr) {
            if options.tls.is_some() {
                return Err(ClientError::Tls(format!(
                    "{addr}: a Unix socket is local; the server speaks TLS on TCP only"
                )));
            }
            let connecting = tokio::net::UnixStream::connect(path);
            let stream = connect_within(addr, options.connect_timeout, connecting).await?;
            return Client::start(stream, addr, options).await?.log_in(addr, options).await;
        }
        let connecting = tokio::net::TcpStream::connect(addr);
        let stream = connect_within(addr, options.connect_timeout, connecting).await?;
        tcp_ready(&stream)?;
        let client = match &options.tls {
            Some(tls) => {
                let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h).trim_start_matches('[').trim_end_matches(']');
                let connector = tls.connector()?;
                let name = tls.server_name.as_deref().unwrap_or(host);
                let name = rustls::pki_types::ServerName::try_from(name.to_owned())
                    .map_err(|e| ClientError::Tls(format!("server name {name:?}: {e}")))?;
                let handshake = tokio::time::timeout(options.connect_timeout, connector.connect(name, stream)).await;
                let stream = match handshake {
                    Ok(done) => done.map_err(|e| ClientError::Tls(format!("handshake with {addr}: {e}")))?,
                    // No answer is a server that cannot be reached (stopped, hung, overloaded):
                    // a cluster goes on with the others; a refused handshake is `Tls`.
                    Err(_) => {
                        return Err(ClientError::Io(std::io::Error::new(
                            std::io::ErrorKind::TimedOut,
                            format!("TLS handshake with {addr}: no answer within {:?}", options.connect_timeout),
                        )));
                    }
                };
                Client::start(stream, addr, options).await?
            }
            None => Client::start(stream, addr, options).await?,
        };
        client.log_in(addr, options).await
    }

    /// AUTH as `options.user`, if it names one, within `auth_timeout`: a server that answered
    /// HELLO and then stopped is a server down, not a connect that never returns (a cluster's
    /// connect waits for every server).
    async fn log_in(self, addr: &str, options: &ClientOptions) -> Result<Client, ClientError> {
        if let Some(user) = &options.user {
            let password = options.password.clone().unwrap_or_default();
            let auth = self.call_op(Request::Auth { user: user.clone(), password });
            answer_within(options.auth_timeout, addr, auth).await?;
        }
        Ok(self)
    }

    /// Connects over a Unix socket and says hello.
    pub async fn connect_unix(path: impl AsRef<std::path::Path>) -> Result<Client, ClientError> {
        Client::over(tokio::net::UnixStream::connect(path).await?).await
    }

    /// Speaks the protocol over any byte stream.
    pub async fn over<S: AsyncRead + AsyncWrite + Send + 'static>(stream: S) -> Result<Client, ClientError> {
        Client::start(stream, "the server", &ClientOptions::default()).await
    }

    /// Starts the reader and writer and says HELLO, within the connect timeout: a peer that does
    /// not answer like a Petrel server gets an error that says so.
    async fn start<S: AsyncRead + AsyncWrite + Send + 'static>(
        stream: S,
        addr: &str,
        options: &ClientOptions,
    ) -> Result<Client, ClientError> {
        let (rd, wr) = tokio::io::split(stream);
        let pending: Arc<Mutex<Pending>> = Arc::default();
        let (written, room) = (Arc::new(tokio::sync::Notify::new()), Arc::new(tokio::sync::Notify::new()));
        let reader = tokio::spawn(read_responses(rd, Arc::clone(&pending), (Arc::clone(&written), Arc::clone(&room))));
        let writer =
            tokio::spawn(write_requests(Box::new(wr), Arc::clone(&pending), Arc::clone(&written), Arc::clone(&room)));
        let inner = Inner {
            pending,
            written,
            room,
            next_id: AtomicU64::new(1),
            compress_min_bytes: std::sync::atomic::AtomicUsize::new(0),
            returns_unseen: std::sync::atomic::AtomicBool::new(false),
            auth_required: std::sync::atomic::AtomicBool::new(false),
            reader,
            writer,
        };
        let client = Client { inner: Arc::new(inner) };
        let not_petrel = |what: &str| {
            ClientError::Protocol(format!(
                "{addr} {what}: it does not speak the Petrel protocol (is it the memcache port, or another service?)"
            ))
        };
        let client_cert = options.tls.as_ref().is_some_and(|tls| tls.cert.is_some());
        match tokio::time::timeout(options.connect_timeout, client.hello(options.compress_min_bytes)).await {
            // Silence: a server stopped, hung or overloaded more often than another service (which
            // answers something else, or closes); a connection not made, for whoever retries.
            Err(_) => Err(ClientError::Io(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!(
                    "{addr} did not answer HELLO within {:?}: is it a Petrel native port (not the memcache port or another service), and is its server running normally (not stopped or overloaded)?",
                    options.connect_timeout
                ),
            ))),
            // TLS 1.3 checks a client certificate after the client's side of the handshake is
            // done: a refusal arrives as an alert on the first read, the HELLO's answer, or (when
            // the connection's reset overtakes the alert) as the connection's end.
            Ok(Err(e @ (ClientError::Io(_) | ClientError::Closed | ClientError::Protocol(_)))) if client_cert => {
                Err(ClientError::Tls(format!(
                    "{addr} ended the connection at HELLO ({e}): it refused the client certificate (is the certificate's CA in its tls_client_ca?), or it is not a Petrel native port"
                )))
            }
            Ok(Err(ClientError::Closed | ClientError::Protocol(_))) => {
                Err(not_petrel("closed the connection at HELLO"))
            }
            Ok(Err(e)) => Err(e),
            Ok(Ok(())) => Ok(client),
        }
    }
    /// Closes the connection now: requests waiting fail with `Closed`, subscriptions end, and
    /// functions this client serves stop (their calls in progress fail at their callers).
    pub fn close(&self) {
        self.inner.reader.abort();
        self.inner.writer.abort();
        self.inner.pending.lock().unwrap_or_else(|e| e.into_inner()).close(|| ClientError::Closed);
        // Callers waiting for room in the outbox learn that it is closed.
        self.inner.room.notify_waiters();
    }

    /// The connection is gone (closed here, by the server, or lost).
    pub fn is_closed(&self) -> bool {
        self.inner.pending.lock().unwrap_or_else(|e| e.into_inner()).closed
    }

    /// Waits until the connection is gone (`is_closed`): what a client that only serves
    /// functions or holds subscriptions, and so sends nothing, learns a loss from.
    pub async fn closed(&self) {
        let mut ended = self.inner.pending.lock().unwrap_or_else(|e| e.into_inner()).ended.subscribe();
        // An error: the sender is gone with the connection's state, so the connection too.
        let _ = ended.wait_for(|ended| *ended).await;
    }

    /// Sends a request without waiting for (or keeping) its answer.
    fn send_unanswered(&self, request: &Request) {
        let compressed = compressed(request, self.inner.compress_min_bytes.load(Ordering::Relaxed));
        self.inner.pending.lock().unwrap_or_else(|e| e.into_inner()).send_own(compressed.as_ref().unwrap_or(request));
        self.inner.written.notify_one();
    }

    /// Sends requests back to back and waits for all their responses. Requests from all the
    /// tasks using this client that gather while a write is under way go out in the next one.
    pub async fn pipeline(&self, requests: &[Request]) -> Vec<Result<Response, ClientError>> {
        self.pipeline_with(requests, None).await
    }

    /// `pipeline`, with the channel for the subscription a (single) SUBSCRIBE request makes.
    async fn pipeline_with(
        &self,
        requests: &[Request],
        mut subscribing: Option<mpsc::Sender<Result<Message, ClientError>>>,
    ) -> Vec<Result<Response, ClientError>> {
        let mut waiting = Vec::with_capacity(requests.len());
        // Compressed before the lock, which every task sending on this connection (and its
        // reader) needs: a large payload takes milliseconds. (Nothing made unless negotiated.)
        let min_bytes = self.inner.compress_min_bytes.load(Ordering::Relaxed);
        let compressed: Vec<Option<Request>> = match min_bytes {
            0 => Vec::new(),
            _ => requests.iter().map(|r| compressed(r, min_bytes)).collect(),
        };
        loop {
            let room = self.inner.room.notified();
            tokio::pin!(room);
            room.as_mut().enable();
            {
                let mut pending = self.inner.pending.lock().unwrap_or_else(|e| e.into_inner());
                if pending.outbox.len() < MAX_OUTBOX || pending.closed {
                    for (i, r) in requests.iter().enumerate() {
                        if pending.closed {
                            waiting.push(Err(ClientError::Closed));
                            continue;
                        }
                        let id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
                        let sent = compressed.get(i).and_then(Option::as_ref).unwrap_or(r);
                        if let Err(e) = pending.outbox.push(sent, id) {
                            waiting.push(Err(ClientError::Invalid(e.to_string())));
                            continue;
                        }
                        let (tx, rx) = oneshot::channel();
                        pending.waiting.insert(id, (r.opcode(), tx));
                        if let Some(sub) = subscribing.take() {
                            pending.subscribing.insert(id, sub);
                        }
                        waiting.push(Ok(rx));
                    }
                    break;
                }
            }
            room.await;
        }
        self.inner.written.notify_one();
        let mut results = Vec::with_capacity(waiting.len());
        for w in waiting {
            results.push(match w {
                Err(e) => Err(e),
                Ok(rx) => rx.await.unwrap_or(Err(ClientError::Closed)),
            });
        }
        results
    }

    async fn call_op(&self, request: Request) -> Result<Response, ClientError> {
        self.request(&request).await
    }

    /// Sends one request and waits for its answer; an error status is an `Err`. The request is
    /// borrowed, so a caller may send it again elsewhere (the cluster's failover).
    pub(crate) async fn request(&self, request: &Request) -> Result<Response, ClientError> {
        match self.pipeline(std::slice::from_ref(request)).await.pop().expect("one result per request")? {
            Response::Error { status, message } => Err(ClientError::Status { status, message }),
            ok => Ok(ok),
        }
    }

    /// Says HELLO, asking for compressed payloads if `compress_min_bytes` is set.
    async fn hello(&self, compress_min_bytes: Option<usize>) -> Result<(), ClientError> {
        use petrel_proto::features::{OFFER_REPEATS, QUEUE_FIGURES, RETURN_UNSEEN, ZSTD};
        let wanted =
            if compress_min_bytes.is_some() { ZSTD } else { 0 } | OFFER_REPEATS | QUEUE_FIGURES | RETURN_UNSEEN;
        let client = format!("petrel-client/{}", env!("CARGO_PKG_VERSION"));
        let answer = self.call_op(Request::Hello { client, features: wanted }).await?;
        if let Response::Hello { max_frame, features, .. } = &answer {
            self.inner.pending.lock().unwrap_or_else(|e| e.into_inner()).max_unfold = *max_frame as usize;
            self.inner.returns_unseen.store(features & RETURN_UNSEEN != 0, Ordering::Relaxed);
            let auth_required = features & petrel_proto::features::AUTH_REQUIRED != 0;
            self.inner.auth_required.store(auth_required, Ordering::Relaxed);
        }
        if let (Response::Hello { features, .. }, Some(min)) = (answer, compress_min_bytes)
            && features & petrel_proto::features::ZSTD != 0
        {
            self.inner.compress_min_bytes.store(min.max(1), Ordering::Relaxed);
        }
        Ok(())
    }

    /// This connection must log in (HELLO's `AUTH_REQUIRED`): the server has users, and no
    /// client certificate logged the connection in. When the server has no users, a user and
    /// password given are accepted unchecked.
    pub fn auth_required(&self) -> bool {
        self.inner.auth_required.load(Ordering::Relaxed)
    }

    pub async fn ping(&self) -> Result<(), ClientError> {
        self.call_op(Request::Ping).await.map(|_| ())
    }

    pub async fn create_queue(&self, name: &str, config: QueueConfig) -> Result<(), ClientError> {
        self.call_op(Request::QueueCreate { name: name.into(), config: Box::new(config) }).await.map(|_| ())
    }

    pub async fn remove_queue(&self, name: &str) -> Result<(), ClientError> {
        self.call_op(Request::QueueRemove { name: name.into() }).await.map(|_| ())
    }

    pub async fn list_queues(&self) -> Result<Vec<String>, ClientError> {
        match self.call_op(Request::QueueList).await? {
            Response::QueueList { names } => Ok(names),
            other => Err(unexpected(other)),
        }
    }

    pub async fn queue_status(&self, name: &str) -> Result<QueueStats, ClientError> {
        match self.call_op(Request::QueueStatus { name: name.into() }).await? {
            Response::QueueStatus { stats } => Ok(*stats),
            other => Err(unexpected(other)),
        }
    }

    /// Offers messages (all or none); with a timeout, waits that long for room in a full queue.
    /// Returns the id of the first accepted message.
    pub async fn offer(
        &self,
        queue: &str,
        messages: Vec<Message>,
        timeout: Option<Duration>,
    ) -> Result<u64, ClientError> {
        self.offer_stored(queue, messages, timeout).await.map(|stored| stored.first_id)
    }

    /// `offer`, saying what the queue stored of it: which messages repeat an idempotency key it
    /// remembers, and so were not stored again.
    pub async fn offer_stored(
        &self,
        queue: &str,
        messages: Vec<Message>,
        timeout: Option<Duration>,
    ) -> Result<Stored, ClientError> {
        let timeout_ms = timeout.map_or(0, |t| t.as_millis().min(u32::MAX as u128) as u32);
        match self.call_op(Request::Offer { queue: queue.into(), timeout_ms, messages }).await? {
            Response::Offered { first_id, repeats, .. } => Ok(Stored { first_id, repeats }),
            other => Err(unexpected(other)),
        }
    }

    /// Polls; an empty queue (after the timeout) gives an empty vector.
    ///
    /// Cancel safety: without a visibility timeout the server takes the messages for good as it
    /// answers, so a poll dropped after its request went out (its future given up in a
    /// `select!` or a `timeout`) loses what was taken for it. With one, what a dropped poll took
    /// goes back to the queue when the visibility timeout passes or the connection closes: poll
    /// with a visibility timeout and `ack` where a poll may be given up.
    pub async fn poll(&self, queue: &str, options: PollOptions) -> Result<Vec<Delivery>, ClientError> {
        let request = Request::Poll {
            queue: queue.into(),
            max: options.max,
            timeout_ms: options.timeout.as_millis().min(u32::MAX as u128) as u32,
            visibility_ms: options.visibility.map_or(0, |v| v.as_millis().clamp(1, u32::MAX as u128) as u32),
        };
        match self.call_op(request).await {
            Ok(Response::Polled { deliveries }) => Ok(deliveries),
            Err(ClientError::Status { status: Status::QueueEmpty, .. }) => Ok(Vec::new()),
            Ok(other) => Err(unexpected(other)),
            Err(e) => Err(e),
        }
    }

    /// Acknowledges tentative deliveries; returns how many the server knew.
    pub async fn ack(&self, queue: &str, handles: &[u64]) -> Result<u32, ClientError> {
        match self.call_op(Request::Ack { queue: queue.into(), handles: handles.to_vec() }).await? {
            Response::Acked { count } => Ok(count),
            other => Err(unexpected(other)),
        }
    }

    /// Returns tentative deliveries to the head of the queue (after the queue's redelivery
    /// delay, if it has one).
    pub async fn abort(&self, queue: &str, handles: &[u64]) -> Result<u32, ClientError> {
        self.abort_delayed(queue, handles, Duration::ZERO).await
    }

    /// Returns tentative deliveries to be handed out again no earlier than `delay` from now (a
    /// retry that should wait); rounded down to ms, at most `u32::MAX` ms.
    pub async fn abort_delayed(&self, queue: &str, handles: &[u64], delay: Duration) -> Result<u32, ClientError> {
        let delay_ms = delay.as_millis().min(u32::MAX as u128) as u32;
        self.settle_abort(Request::Abort { queue: queue.into(), handles: handles.to_vec(), delay_ms, unseen: false })
            .await
    }

    /// Gives back tentative deliveries the application never saw (a poll whose caller stopped
    /// waiting while its answer came): they go back to the head as if never handed out, their
    /// delivery not counted, on a server that takes them so; on an older server, as `abort`.
    pub async fn give_back_unseen(&self, queue: &str, handles: &[u64]) -> Result<u32, ClientError> {
        let unseen = self.returns_unseen();
        self.settle_abort(Request::Abort { queue: queue.into(), handles: handles.to_vec(), delay_ms: 0, unseen }).await
    }

    /// Whether the server takes deliveries back as unseen (`give_back_unseen`).
    pub(crate) fn returns_unseen(&self) -> bool {
        self.inner.returns_unseen.load(Ordering::Relaxed)
    }

    async fn settle_abort(&self, abort: Request) -> Result<u32, ClientError> {
        match self.call_op(abort).await? {
            Response::Acked { count } => Ok(count),
            other => Err(unexpected(other)),
        }
    }
}

impl Client {
    /// Creates a topic; a durable one keeps a log that consumer groups read (`subscribe_group`).
    pub async fn create_topic(&self, name: &str, durable: bool) -> Result<(), ClientError> {
        self.call_op(Request::TopicCreate { name: name.into(), durable }).await.map(|_| ())
    }

    pub async fn remove_topic(&self, name: &str) -> Result<(), ClientError> {
        self.call_op(Request::TopicRemove { name: name.into() }).await.map(|_| ())
    }

    pub async fn list_topics(&self) -> Result<Vec<String>, ClientError> {
        match self.call_op(Request::TopicList).await? {
            Response::TopicList { names } => Ok(names),
            other => Err(unexpected(other)),
        }
    }

    /// A topic's figures and, for a durable topic, where each consumer group stands (its lag).
    pub async fn topic_status(&self, name: &str) -> Result<TopicStats, ClientError> {
        match self.call_op(Request::TopicStatus { name: name.into() }).await? {
            Response::TopicStatus { stats } => Ok(*stats),
            other => Err(unexpected(other)),
        }
    }

    /// Publishes to every current subscriber of `topic`; returns how many it reached.
    pub async fn publish(&self, topic: &str, messages: Vec<Message>) -> Result<u32, ClientError> {
        match self.call_op(Request::Publish { topic: topic.into(), messages }).await? {
            Response::Published { subscribers } => Ok(subscribers),
            other => Err(unexpected(other)),
        }
    }

    /// Subscribes to `topic`: its messages arrive on the returned stream, pushed by the server.
    /// `buffer`: how many messages the server may hold for this subscriber (0: its default);
    /// fall further behind and the server ends the subscription (the stream's last item is then
    /// a `SLOW_CONSUMER` error).
    pub async fn subscribe(&self, topic: &str, buffer: u32) -> Result<Subscription, ClientError> {
        self.subscribe_with(Request::Subscribe {
            topic: topic.into(),
            buffer,
            group: String::new(),
            from: StartFrom::Resume,
        })
        .await
    }

    /// Reads a durable topic as consumer group `group`, from `from` (`Resume`: where the group
    /// stands). At most `max_unacked` messages are delivered and not yet acknowledged
    /// (`Subscription::ack` with their ids); unacknowledged ones come again after a reconnect.
    pub async fn subscribe_group(
        &self,
        topic: &str,
        group: &str,
        from: StartFrom,
        max_unacked: u32,
    ) -> Result<Subscription, ClientError> {
        self.subscribe_with(Request::Subscribe { topic: topic.into(), buffer: max_unacked, group: group.into(), from })
            .await
    }

    async fn subscribe_with(&self, request: Request) -> Result<Subscription, ClientError> {
        let deliveries = match &request {
            Request::Subscribe { group, .. } if !group.is_empty() => MAX_UNACKED,
            Request::Subscribe { buffer: 0, .. } => 2 * SUBSCRIPTION_BUFFER,
            Request::Subscribe { buffer, .. } => *buffer as usize + SUBSCRIPTION_BUFFER,
            _ => SUBSCRIPTION_BUFFER,
        };
        // One more slot: the notice that ends the subscription always fits.
        let (tx, rx) = mpsc::channel(deliveries + 1);
        let answer = self.pipeline_with(std::slice::from_ref(&request), Some(tx)).await.pop();
        match answer.expect("one result per request")? {
            Response::Subscribed { subscription } => {
                Ok(Subscription { id: subscription, rx, client: self.clone(), done: false })
            }
            Response::Error { status, message } => Err(ClientError::Status { status, message }),
            other => Err(unexpected(other)),
        }
    }

    /// Serves calls of `function` with `handler` until `unserve`,
    /// `close` or the end of the connection; serving keeps the connection open meanwhile. Calls
    /// run concurrently on one task: a handler with heavy work to do should spawn it. A lost
    /// connection is not made again here (`closed` says when it ends); `Cluster`, of one server
    /// or more, connects again and serves its functions again by itself.
    pub async fn serve<F, Fut>(&self, function: &str, handler: F) -> Result<(), ClientError>
    where
        F: Fn(Message) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = Result<Message, String>> + Send + 'static,
    {
        let (tx, mut rx) = mpsc::channel::<(u64, Message)>(SUBSCRIPTION_BUFFER);
        let before =
            self.inner.pending.lock().unwrap_or_else(|e| e.into_inner()).functions.insert(function.to_owned(), tx);
        let client = self.clone();
        tokio::spawn(async move {
            // Handlers run concurrently within this one task (no task per call), at most
            // MAX_RUNNING at a time; past that, calls wait in the channel and then at the server.
            let mut running = futures_util::stream::FuturesUnordered::new();
            loop {
                tokio::select! {
                    next = rx.recv(), if running.len() < MAX_RUNNING => {
                        let Some((call, message)) = next else { break };
                        // A handler that panics fails its own call (HANDLER_ERROR), not this task:
                        // its end would leave the calls running unanswered and the function
                        // served here by nobody while the connection lives.
                        use futures_util::FutureExt;
                        let reply = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| handler(message)));
                        running.push(async move {
                            let replied = match reply {
                                Ok(reply) => std::panic::AssertUnwindSafe(reply).catch_unwind().await,
                                Err(panic) => Err(panic),
                            };
                            match replied {
                                Ok(Ok(m)) => Request::Return { call, status: Status::Ok, error: String::new(), message: Box::new(m) },
                                Ok(Err(error)) => {
                                    Request::Return { call, status: Status::HandlerError, error, message: Box::default() }
                                }
                                Err(_) => {
                                    let error = "the function's handler panicked".to_owned();
                                    Request::Return { call, status: Status::HandlerError, error, message: Box::default() }
                                }
                            }
                        });
                    }
                    Some(ret) = futures_util::StreamExt::next(&mut running), if !running.is_empty() => {
                        // Its answer is not waited for: a reply to a call that timed out is
                        // refused, and there is nothing to do about it.
                        client.send_unanswered(&ret);
                    }
                }
            }
            while let Some(ret) = futures_util::StreamExt::next(&mut running).await {
                client.send_unanswered(&ret);
            }
        });
        let served = self.call_op(Request::Serve { function: function.into() }).await.map(|_| ());
        if served.is_err() {
            // Refused (a limit, the ACL): the server goes on as before, and so do the handlers
            // here (this one's task ends with its channel).
            let mut pending = self.inner.pending.lock().unwrap_or_else(|e| e.into_inner());
            match before {
                Some(before) => pending.functions.insert(function.to_owned(), before),
                None => pending.functions.remove(function),
            };
        }
        served
    }

    pub async fn unserve(&self, function: &str) -> Result<(), ClientError> {
        self.inner.pending.lock().unwrap_or_else(|e| e.into_inner()).functions.remove(function);
        self.call_op(Request::Unserve { function: function.into() }).await.map(|_| ())
    }

    /// Calls `function` and waits for its reply (up to `timeout`, else the server's default);
    /// `TIMEOUT`, `FUNCTION_NOT_FOUND` and `HANDLER_ERROR` come back as `ClientError::Status`.
    /// The returned future can be spawned or joined with others: calls are pipelined.
    pub async fn call(
        &self,
        function: &str,
        message: Message,
        timeout: Option<Duration>,
    ) -> Result<Message, ClientError> {
        let timeout_ms = timeout.map_or(0, |t| t.as_millis().clamp(1, u32::MAX as u128) as u32);
        match self
            .call_op(Request::Call { function: function.into(), timeout_ms, oneway: false, message: Box::new(message) })
            .await?
        {
            Response::Reply { message } => Ok(*message),
            other => Err(unexpected(other)),
        }
    }

    /// Calls `function` without waiting for a reply: done once a server has the call.
    pub async fn call_oneway(&self, function: &str, message: Message) -> Result<(), ClientError> {
        self.call_op(Request::Call {
            function: function.into(),
            timeout_ms: 0,
            oneway: true,
            message: Box::new(message),
        })
        .await
        .map(|_| ())
    }

    /// Ends subscription `subscription` (a [`Subscription::id`]): its stream ends at once, and
    /// the server confirms. For code that reads a subscription in one place and ends it in
    /// another; otherwise [`Subscription::unsubscribe`].
    pub async fn unsubscribe(&self, subscription: u64) -> Result<(), ClientError> {
        self.inner.pending.lock().unwrap_or_else(|e| e.into_inner()).subscriptions.remove(&subscription);
        self.call_op(Request::Unsubscribe { subscription }).await.map(|_| ())
    }

    /// Acknowledges messages of group subscription `subscription` by id, while another task may
    /// be reading it; otherwise [`Subscription::ack`]. Returns how many counted.
    pub async fn ack_subscription(&self, subscription: u64, ids: &[u64]) -> Result<u32, ClientError> {
        match self.call_op(Request::TopicAck { subscription, ids: ids.to_vec() }).await? {
            Response::Acked { count } => Ok(count),
            other => Err(unexpected(other)),
        }
    }
}

/// Deliveries a live subscription's reader may fall behind by, beyond the buffer it asked the
/// server for (the server's default, 1024, when it asked for none); one more ends it
/// (`SLOW_CONSUMER`), rather than stop reading the connection, whose other answers (the
/// subscriber's own acknowledgements and offers among them) would then wait for ever. The
/// client reads every push as it comes, so this is what the server's buffer was before.
const SUBSCRIPTION_BUFFER: usize = 1024;
/// A group subscription's buffer holds every message the server may deliver unacknowledged
/// (a cursor holds at most this many): it never fills.
const MAX_UNACKED: usize = 8192;
/// Calls of one served function whose handlers run at once.
const MAX_RUNNING: usize = 1024;

/// A topic subscription: a `Stream` of messages, pushed by the server. Its last item is an error
/// if the server ended it; dropping it unsubscribes.
pub struct Subscription {
    pub id: u64,
    rx: mpsc::Receiver<Result<Message, ClientError>>,
    client: Client,
    done: bool,
}

impl std::fmt::Debug for Subscription {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Subscription").field("id", &self.id).finish_non_exhaustive()
    }
}

impl Subscription {
    /// The next message; `None` once the subscription is over.
    pub async fn next(&mut self) -> Option<Result<Message, ClientError>> {
        std::future::poll_fn(|cx| self.rx.poll_recv(cx)).await
    }

    /// Acknowledges messages of a group subscription by id; returns how many counted.
    pub async fn ack(&self, ids: &[u64]) -> Result<u32, ClientError> {
        self.client.ack_subscription(self.id, ids).await
    }

    /// Ends the subscription, waiting for the server to confirm.
    pub async fn unsubscribe(mut self) -> Result<(), ClientError> {
        self.done = true;
        self.client.unsubscribe(self.id).await
    }
}

impl futures_core::Stream for Subscription {
    type Item = Result<Message, ClientError>;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        self.rx.poll_recv(cx)
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        if !self.done {
            // Without waiting for the answer, so from any thread (a runtime's or not): the
            // server stops pushing, and a group is free for its next reader.
            self.client.inner.pending.lock().unwrap_or_else(|e| e.into_inner()).subscriptions.remove(&self.id);
            self.client.send_unanswered(&Request::Unsubscribe { subscription: self.id });
        }
    }
}

/// `r` with its large payloads compressed, if compression was negotiated (`min_bytes` > 0) and
/// any payload is that large; `None` to send `r` as it is.
fn compressed(r: &Request, min_bytes: usize) -> Option<Request> {
    let large = |m: &Message| min_bytes > 0 && !m.compressed && m.payload.len() >= min_bytes;
    let carries_large = match r {
        Request::Offer { messages, .. } | Request::Publish { messages, .. } => messages.iter().any(large),
        Request::Call { message, .. } | Request::Return { message, .. } => large(message),
        _ => false,
    };
    if !carries_large {
        return None;
    }
    let mut r = r.clone();
    for m in petrel_proto::compression::request_messages(&mut r) {
        petrel_proto::compression::compress(m, min_bytes);
    }
    Some(r)
}

fn unexpected(r: Response) -> ClientError {
    ClientError::Protocol(format!("unexpected response {r:?}"))
}

/// Reads responses and hands each to the request waiting for it. When the connection ends,
/// every waiting request fails (`Closed` at the stream's end, `Io` with the reason for a failed
/// read: a reset, a TLS alert), and so does every later one.
async fn read_responses<R: AsyncRead + Unpin>(
    mut rd: R,
    pending: Arc<Mutex<Pending>>,
    (written, room): (Arc<tokio::sync::Notify>, Arc<tokio::sync::Notify>),
) {
    let mut buf = BytesMut::with_capacity(64 * 1024);
    let mut answered = Vec::new();
    'read: loop {
        loop {
            let mut sent_own = false;
            let next = take_responses(&mut buf, &pending, &mut answered, &mut sent_own);
            if sent_own {
                written.notify_one();
            }
            // Answered before what follows them is handled, in the order they came; unfolded
            // here, without the lock (a large payload takes milliseconds).
            for (tx, response, max_unfold) in answered.drain(..) {
                let response = response.and_then(|mut r| {
                    petrel_proto::compression::decompress_response(&mut r, max_unfold)
                        .map_err(|e| ClientError::Protocol(e.to_string()))?;
                    Ok(r)
                });
                let _ = tx.send(response);
            }
            match next {
                Ok(Some((request_id, push))) => {
                    if route(&pending, request_id, push) {
                        written.notify_one();
                    }
                }
                Ok(None) => break,
                Err(()) => break 'read,
            }
        }
        // A large frame coming: room for all of it at once, rather than growth by doubling (each
        // growth a copy of what came so far). Only once a streaming read's worth of it is here
        // and only up to a default frame (16 MiB and a bit): a peer that announces a larger one,
        // or sends little of it, gets `frame::decode`'s room a step at a time.
        if let Some(len) = buf.get(..4).map(|b| 4 + u32::from_be_bytes(b.try_into().expect("4 bytes")) as usize)
            && len > buf.capacity()
            && len <= 4 + petrel_proto::DEFAULT_MAX_FRAME as usize
            && buf.len() >= EXACT_ROOM_AFTER
        {
            buf.reserve(len - buf.len());
        }
        match rd.read_buf(&mut buf).await {
            Ok(0) => break,
            Ok(_) => {}
            Err(e) => {
                // Why, for whoever waits: a TLS alert (a client certificate the server refused)
                // or a reset says more than "closed".
                let (kind, why) = (e.kind(), e.to_string());
                pending
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .close(|| std::io::Error::new(kind, why.clone()).into());
                room.notify_waiters();
                return;
            }
        }
    }
    pending.lock().unwrap_or_else(|e| e.into_inner()).close(|| ClientError::Closed);
    room.notify_waiters();
}

/// Takes the responses at the front of `buf`, all under one hold of the lock, into `answered`;
/// stops at a push (returned, with its request id), at an incomplete frame (`None`), or at
/// bytes that are not a frame (`Err`: the connection cannot go on).
/// `sent_own`: set when it queued a request of the client's own (the writer is to be woken).
fn take_responses(
    buf: &mut BytesMut,
    pending: &Mutex<Pending>,
    answered: &mut Vec<(Reply, Result<Response, ClientError>, usize)>,
    sent_own: &mut bool,
) -> Result<Option<(u64, Push)>, ()> {
    let mut p = None;
    loop {
        match frame::decode(buf, MAX_INCOMING_FRAME) {
            Ok(Some(f)) if f.kind == FrameKind::Response => {
                let p = p.get_or_insert_with(|| pending.lock().unwrap_or_else(|e| e.into_inner()));
                let Some((opcode, tx)) = p.waiting.remove(&f.request_id) else { continue };
                let response = Response::decode(opcode, f.body).map_err(|e| ClientError::Protocol(e.to_string()));
                // (Looked for only while a SUBSCRIBE is in flight: hashing each answer's id
                // would cost a pipelined client's every answer.)
                if !p.subscribing.is_empty()
                    && let Some(sub) = p.subscribing.remove(&f.request_id)
                    && let Ok(Response::Subscribed { subscription }) = &response
                {
                    if sub.is_closed() {
                        // Its caller gave up before the answer: nobody will read it.
                        p.send_own(&Request::Unsubscribe { subscription: *subscription });
                        *sent_own = true;
                    } else {
                        p.subscriptions.insert(*subscription, sub);
                    }
                }
                answered.push((tx, response, p.max_unfold));
            }
            Ok(Some(f)) if f.kind == FrameKind::Push => {
                // Decoded (and decompressed) without the lock, which callers need to send.
                let max_unfold = match p.take() {
                    Some(p) => p.max_unfold,
                    None => pending.lock().unwrap_or_else(|e| e.into_inner()).max_unfold,
                };
                // A push this client cannot read (a newer server's, or one that would unfold past
                // the server's own frame) is skipped.
                if let Ok(mut push) = Push::decode(f.opcode, f.body)
                    && petrel_proto::compression::decompress_push(&mut push, max_unfold).is_ok()
                {
                    return Ok(Some((f.request_id, push)));
                }
            }
            Ok(Some(_)) => {}
            Ok(None) => return Ok(None),
            Err(_) => return Err(()),
        }
    }
}

/// Hands a push to the subscription or function it is for. A subscription whose buffer is full
/// (its reader fell behind) is ended here with `SLOW_CONSUMER` rather than waited for: waiting
/// would stop the connection's reading, and with it the answers its reader may be waiting for.
/// (Dropping the `Subscription` then unsubscribes.) A function's call that finds its handlers'
/// queue full (they run `MAX_RUNNING` at a time, and as many calls more wait for them), or its
/// function no longer served here, is answered HANDLER_ERROR at once: waiting would stop the
/// reading too, and a handler that uses this client would wait for an answer never read.
/// Returns whether it queued an answer of its own to send.
fn route(pending: &Mutex<Pending>, id: u64, push: Push) -> bool {
    match push {
        Push::Deliver { messages } => {
            let Some(tx) = pending.lock().unwrap_or_else(|e| e.into_inner()).subscriptions.get(&id).cloned() else {
                return false;
            };
            if tx.is_closed() {
                // Nobody reads it (its `Subscription` was never made, its caller gone meanwhile):
                // the server is told, or it would push to this connection for its whole life
                // (and hold a group).
                let mut pending = pending.lock().unwrap_or_else(|e| e.into_inner());
                pending.subscriptions.remove(&id);
                pending.send_own(&Request::Unsubscribe { subscription: id });
                return true;
            }
            for m in messages {
                let sent = match tx.capacity() {
                    0 | 1 => Err(()),
                    _ => tx.try_send(Ok(m)).map_err(drop),
                };
                if sent.is_err() {
                    pending.lock().unwrap_or_else(|e| e.into_inner()).subscriptions.remove(&id);
                    let behind = format!("the client's buffer of {} deliveries is full", tx.max_capacity() - 1);
                    let _ = tx.try_send(Err(ClientError::Status { status: Status::SlowConsumer, message: behind }));
                    return false;
                }
            }
            false
        }
        Push::SubscriptionEnd { status, reason } => {
            let tx = pending.lock().unwrap_or_else(|e| e.into_inner()).subscriptions.remove(&id);
            if let Some(tx) = tx {
                let _ = tx.try_send(Err(ClientError::Status { status, message: reason }));
            }
            false
        }
        Push::Invoke { function, message } => {
            let mut pending = pending.lock().unwrap_or_else(|e| e.into_inner());
            let error = match pending.functions.get(&function).map(|tx| tx.try_reserve()) {
                Some(Ok(place)) => {
                    place.send((id, *message));
                    return false;
                }
                Some(Err(mpsc::error::TrySendError::Full(()))) => {
                    format!("{function}: every handler of the serving client is busy and its queue of calls is full")
                }
                _ => format!("{function} is no longer served by this connection"),
            };
            pending.send_own(&Request::Return {
                call: id,
                status: Status::HandlerError,
                error,
                message: Box::default(),
            });
            true
        }
    }
}

/// Writes what gathered in the outbox, all of it in one write, again and again. A failed write
/// fails every request waiting.
async fn write_requests(
    mut wr: Writer,
    pending: Arc<Mutex<Pending>>,
    written: Arc<tokio::sync::Notify>,
    room: Arc<tokio::sync::Notify>,
) {
    let mut batch = Outbox::default();
    loop {
        written.notified().await;
        loop {
            {
                let mut p = pending.lock().unwrap_or_else(|e| e.into_inner());
                if p.outbox.is_empty() {
                    break;
                }
                std::mem::swap(&mut p.outbox, &mut batch);
            }
            room.notify_waiters();
            let sent = match write_all_vectored(&mut wr, &mut batch.slices()).await {
                Ok(()) => wr.flush().await,
                Err(e) => Err(e),
            };
            if let Err(e) = sent {
                let error = || ClientError::Io(std::io::Error::new(e.kind(), e.to_string()));
                pending.lock().unwrap_or_else(|e| e.into_inner()).close(error);
                room.notify_waiters();
                return;
            }
            batch.clear();
            if batch.bytes.capacity() > 4 * MAX_OUTBOX {
                batch = Outbox::default(); // after one huge request
            }
        }
    }
}

/// Writes every slice, in order, with as few system calls as the connection allows.
async fn write_all_vectored(wr: &mut Writer, mut rest: &mut [std::io::IoSlice<'_>]) -> std::io::Result<()> {
    while !rest.is_empty() {
        let n = wr.write_vectored(rest).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        std::io::IoSlice::advance_slices(&mut rest, n);
    }
    Ok(())
}

pub mod blocking {
    //! A blocking client: the async one on a private single-threaded runtime.

    use super::*;

    pub struct Client {
        rt: tokio::runtime::Runtime,
        inner: super::Client,
    }

    impl Client {
        pub fn connect(addr: &str) -> Result<Client, ClientError> {
            Client::connect_with(addr, &ClientOptions::default())
        }

        /// `connect` with TLS, credentials and timeouts (see the async `Client::connect_with`).
        pub fn connect_with(addr: &str, options: &ClientOptions) -> Result<Client, ClientError> {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
            let inner = rt.block_on(super::Client::connect_with(addr, options))?;
            Ok(Client { rt, inner })
        }
        /// The async client, for use on this one's runtime ([`Client::block_on`]): to bound a
        /// few requests by one timeout, say.
        pub fn inner(&self) -> &super::Client {
            &self.inner
        }
        pub fn block_on<F: std::future::Future>(&self, f: F) -> F::Output {
            self.rt.block_on(f)
        }

        pub fn create_queue(&self, name: &str, config: QueueConfig) -> Result<(), ClientError> {
            self.rt.block_on(self.inner.create_queue(name, config))
        }
        pub fn remove_queue(&self, name: &str) -> Result<(), ClientError> {
            self.rt.block_on(self.inner.remove_queue(name))
        }
        pub fn list_queues(&self) -> Result<Vec<String>, ClientError> {
            self.rt.block_on(self.inner.list_queues())
        }
        pub fn queue_status(&self, name: &str) -> Result<QueueStats, ClientError> {
            self.rt.block_on(self.inner.queue_status(name))
        }
        pub fn offer(
            &self,
            queue: &str,
            messages: Vec<Message>,
            timeout: Option<Duration>,
        ) -> Result<u64, ClientError> {
            self.rt.block_on(self.inner.offer(queue, messages, timeout))
        }
        pub fn offer_stored(
            &self,
            queue: &str,
            messages: Vec<Message>,
            timeout: Option<Duration>,
        ) -> Result<Stored, ClientError> {
            self.rt.block_on(self.inner.offer_stored(queue, messages, timeout))
        }
        pub fn poll(&self, queue: &str, options: PollOptions) -> Result<Vec<Delivery>, ClientError> {
            self.rt.block_on(self.inner.poll(queue, options))
        }
        pub fn ack(&self, queue: &str, handles: &[u64]) -> Result<u32, ClientError> {
            self.rt.block_on(self.inner.ack(queue, handles))
        }
        pub fn abort(&self, queue: &str, handles: &[u64]) -> Result<u32, ClientError> {
            self.rt.block_on(self.inner.abort(queue, handles))
        }
        pub fn abort_delayed(&self, queue: &str, handles: &[u64], delay: Duration) -> Result<u32, ClientError> {
            self.rt.block_on(self.inner.abort_delayed(queue, handles, delay))
        }
        /// See the async `Client::give_back_unseen`.
        pub fn give_back_unseen(&self, queue: &str, handles: &[u64]) -> Result<u32, ClientError> {
            self.rt.block_on(self.inner.give_back_unseen(queue, handles))
        }
        pub fn ping(&self) -> Result<(), ClientError> {
            self.rt.block_on(self.inner.ping())
        }
        /// See the async `Client::auth_required`.
        pub fn auth_required(&self) -> bool {
            self.inner.auth_required()
        }
        pub fn create_topic(&self, name: &str, durable: bool) -> Result<(), ClientError> {
            self.rt.block_on(self.inner.create_topic(name, durable))
        }
        pub fn remove_topic(&self, name: &str) -> Result<(), ClientError> {
            self.rt.block_on(self.inner.remove_topic(name))
        }
        pub fn list_topics(&self) -> Result<Vec<String>, ClientError> {
            self.rt.block_on(self.inner.list_topics())
        }
        pub fn topic_status(&self, name: &str) -> Result<TopicStats, ClientError> {
            self.rt.block_on(self.inner.topic_status(name))
        }
        pub fn publish(&self, topic: &str, messages: Vec<Message>) -> Result<u32, ClientError> {
            self.rt.block_on(self.inner.publish(topic, messages))
        }
        /// A subscription as an iterator; each `next` waits for the server's next push.
        pub fn subscribe(&self, topic: &str, buffer: u32) -> Result<Subscription<'_>, ClientError> {
            let inner = self.rt.block_on(self.inner.subscribe(topic, buffer))?;
            Ok(Subscription { rt: &self.rt, inner })
        }
        pub fn subscribe_group(
            &self,
            topic: &str,
            group: &str,
            from: StartFrom,
            max_unacked: u32,
        ) -> Result<Subscription<'_>, ClientError> {
            let inner = self.rt.block_on(self.inner.subscribe_group(topic, group, from, max_unacked))?;
            Ok(Subscription { rt: &self.rt, inner })
        }
        pub fn call(
            &self,
            function: &str,
            message: Message,
            timeout: Option<Duration>,
        ) -> Result<Message, ClientError> {
            self.rt.block_on(self.inner.call(function, message, timeout))
        }
        pub fn call_oneway(&self, function: &str, message: Message) -> Result<(), ClientError> {
            self.rt.block_on(self.inner.call_oneway(function, message))
        }
    }

    /// A [`super::Cluster`] on a private runtime with a worker thread of its own, so that
    /// reconnects and waiting polls go on between calls.
    pub struct Cluster {
        rt: tokio::runtime::Runtime,
        inner: super::Cluster,
    }

    /// What polls kept for later goes back unseen (`Cluster::give_back_kept`) before the
    /// connections close.
    impl Drop for Cluster {
        fn drop(&mut self) {
            // (Not from within a runtime, where `block_on` panics, nor while a panic unwinds:
            // those connections close as they are, their kept messages counted as delivered.)
            if !self.inner.is_closed() && tokio::runtime::Handle::try_current().is_err() && !std::thread::panicking() {
                self.rt.block_on(self.inner.give_back_kept());
            }
        }
    }

    impl Cluster {
        pub fn connect(servers: &[impl AsRef<str>], options: ClusterOptions) -> Result<Cluster, ClientError> {
            let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build()?;
            let inner = rt.block_on(super::Cluster::connect(servers, options))?;
            Ok(Cluster { rt, inner })
        }
        /// The async cluster, for use on this one's runtime ([`Cluster::block_on`]).
        pub fn inner(&self) -> &super::Cluster {
            &self.inner
        }
        pub fn block_on<F: std::future::Future>(&self, f: F) -> F::Output {
            self.rt.block_on(f)
        }
        pub fn stats(&self) -> ClusterStats {
            self.inner.stats()
        }
        pub fn offer(
            &self,
            queue: &str,
            messages: Vec<Message>,
            timeout: Option<Duration>,
        ) -> Result<Offered, ClientError> {
            self.rt.block_on(self.inner.offer(queue, messages, timeout))
        }
        pub fn offer_by_key(
            &self,
            key: &[u8],
            queue: &str,
            messages: Vec<Message>,
            timeout: Option<Duration>,
        ) -> Result<Offered, ClientError> {
            self.rt.block_on(self.inner.offer_by_key(key, queue, messages, timeout))
        }
        pub fn poll(&self, queue: &str, options: PollOptions) -> Result<Vec<ClusterDelivery>, ClientError> {
            self.rt.block_on(self.inner.poll(queue, options))
        }
        pub fn ack(&self, queue: &str, handles: &[ClusterHandle]) -> Result<u32, ClientError> {
            self.rt.block_on(self.inner.ack(queue, handles))
        }
        pub fn abort(&self, queue: &str, handles: &[ClusterHandle], delay: Duration) -> Result<u32, ClientError> {
            self.rt.block_on(self.inner.abort(queue, handles, delay))
        }
        /// See the async `Cluster::give_back_unseen`.
        pub fn give_back_unseen(&self, queue: &str, handles: &[ClusterHandle]) -> Result<u32, ClientError> {
            self.rt.block_on(self.inner.give_back_unseen(queue, handles))
        }
        pub fn create_queue(&self, name: &str, config: QueueConfig) -> Result<(), ClientError> {
            self.rt.block_on(self.inner.create_queue(name, config))
        }
        pub fn remove_queue(&self, name: &str) -> Result<(), ClientError> {
            self.rt.block_on(self.inner.remove_queue(name))
        }
        pub fn list_queues(&self) -> Result<Vec<String>, ClientError> {
            self.rt.block_on(self.inner.list_queues())
        }
        pub fn queue_status(&self, name: &str) -> Vec<(String, Result<QueueStats, ClientError>)> {
            self.rt.block_on(self.inner.queue_status(name))
        }
        pub fn create_topic(&self, name: &str, durable: bool) -> Result<(), ClientError> {
            self.rt.block_on(self.inner.create_topic(name, durable))
        }
        pub fn remove_topic(&self, name: &str) -> Result<(), ClientError> {
            self.rt.block_on(self.inner.remove_topic(name))
        }
        pub fn list_topics(&self) -> Result<Vec<String>, ClientError> {
            self.rt.block_on(self.inner.list_topics())
        }
        pub fn publish(&self, topic: &str, messages: Vec<Message>) -> Result<u32, ClientError> {
            self.rt.block_on(self.inner.publish(topic, messages))
        }
        /// A subscription on every server as an iterator.
        pub fn subscribe(&self, topic: &str, buffer: u32) -> Result<ClusterSubscription<'_>, ClientError> {
            let inner = self.rt.block_on(self.inner.subscribe(topic, buffer))?;
            Ok(ClusterSubscription { rt: &self.rt, inner })
        }
        /// A consumer group on every server ([`super::Cluster::subscribe_group`]).
        pub fn subscribe_group(
            &self,
            topic: &str,
            group: &str,
            from: StartFrom,
            max_unacked: u32,
        ) -> Result<ClusterSubscription<'_>, ClientError> {
            let inner = self.rt.block_on(self.inner.subscribe_group(topic, group, from, max_unacked))?;
            Ok(ClusterSubscription { rt: &self.rt, inner })
        }
        pub fn call(
            &self,
            function: &str,
            message: Message,
            timeout: Option<Duration>,
        ) -> Result<Message, ClientError> {
            self.rt.block_on(self.inner.call(function, message, timeout))
        }
        pub fn call_oneway(&self, function: &str, message: Message) -> Result<(), ClientError> {
            self.rt.block_on(self.inner.call_oneway(function, message))
        }
    }

    /// A blocking [`super::ClusterSubscription`].
    pub struct ClusterSubscription<'a> {
        rt: &'a tokio::runtime::Runtime,
        inner: super::ClusterSubscription,
    }

    impl ClusterSubscription<'_> {
        pub fn next_delivery(&mut self) -> Option<Result<ClusterDelivery, ClientError>> {
            self.rt.block_on(self.inner.next_delivery())
        }
        pub fn ack(&self, handles: &[ClusterHandle]) -> Result<u32, ClientError> {
            self.rt.block_on(self.inner.ack(handles))
        }
    }

    impl Iterator for ClusterSubscription<'_> {
        type Item = Result<Message, ClientError>;

        fn next(&mut self) -> Option<Self::Item> {
            self.rt.block_on(self.inner.next())
        }
    }

    /// A blocking subscription: an iterator of the topic's messages.
    pub struct Subscription<'a> {
        rt: &'a tokio::runtime::Runtime,
        inner: super::Subscription,
    }

    impl Subscription<'_> {
        /// Acknowledges messages of a group subscription by id.
        pub fn ack(&self, ids: &[u64]) -> Result<u32, ClientError> {
            self.rt.block_on(self.inner.ack(ids))
        }
    }

    impl Iterator for Subscription<'_> {
        type Item = Result<Message, ClientError>;

        fn next(&mut self) -> Option<Self::Item> {
            self.rt.block_on(self.inner.next())
        }
    }

    /// A [`super::Follower`] on a private runtime: polls and subscriptions that outlive their
    /// connection.
    pub struct Follower {
        rt: tokio::runtime::Runtime,
        inner: super::Follower,
    }

    impl Follower {
        pub fn connect(server: &str, options: ClientOptions, reconnect: Reconnect) -> Result<Follower, ClientError> {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
            let inner = rt.block_on(super::Follower::connect(server, options, reconnect))?;
            Ok(Follower { rt, inner })
        }
        pub fn poll(&mut self, queue: &str, options: PollOptions) -> Result<Vec<Delivery>, ClientError> {
            self.rt.block_on(self.inner.poll(queue, options))
        }
        pub fn ack(&mut self, queue: &str, handles: &[u64]) -> Result<u32, ClientError> {
            self.rt.block_on(self.inner.ack(queue, handles))
        }
        /// See the async `Follower::give_back_unseen`.
        pub fn give_back_unseen(&mut self, queue: &str, handles: &[u64]) -> Result<u32, ClientError> {
            self.rt.block_on(self.inner.give_back_unseen(queue, handles))
        }
        pub fn subscribe(self, topic: &str, buffer: u32) -> Result<FollowedSubscription, ClientError> {
            let inner = self.rt.block_on(self.inner.subscribe(topic, buffer))?;
            Ok(FollowedSubscription { rt: self.rt, inner })
        }
        pub fn subscribe_group(
            self,
            topic: &str,
            group: &str,
            from: StartFrom,
            max_unacked: u32,
        ) -> Result<FollowedSubscription, ClientError> {
            let inner = self.rt.block_on(self.inner.subscribe_group(topic, group, from, max_unacked))?;
            Ok(FollowedSubscription { rt: self.rt, inner })
        }
    }

    /// A blocking [`super::FollowedSubscription`]: an iterator that subscribes again after a
    /// reconnect.
    pub struct FollowedSubscription {
        rt: tokio::runtime::Runtime,
        inner: super::FollowedSubscription,
    }

    impl FollowedSubscription {
        /// Acknowledges group messages by id (0 after a lost connection: they come again).
        pub fn ack(&mut self, ids: &[u64]) -> Result<u32, ClientError> {
            self.rt.block_on(self.inner.ack(ids))
        }
    }

    impl Iterator for FollowedSubscription {
        type Item = Result<Message, ClientError>;

        fn next(&mut self) -> Option<Self::Item> {
            self.rt.block_on(self.inner.next())
        }
    }

    impl Drop for FollowedSubscription {
        fn drop(&mut self) {
            if let Some(subscription) = self.inner.subscription.take() {
                let _ = self.rt.block_on(subscription.unsubscribe());
            }
        }
    }

    impl Drop for Subscription<'_> {
        fn drop(&mut self) {
            // Waits for the answer (the async subscription's drop does not): a group is free for
            // its next reader once this returns.
            self.inner.done = true;
            let _ = self.rt.block_on(self.inner.client.unsubscribe(self.inner.id));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// Reads one request frame: its opcode and request id.
    async fn read_request(s: &mut tokio::net::TcpStream) -> (u16, u64) {
        let mut len = [0u8; 4];
        s.read_exact(&mut len).await.unwrap();
        let mut frame = vec![0u8; u32::from_be_bytes(len) as usize];
        s.read_exact(&mut frame).await.unwrap();
        (u16::from_be_bytes([frame[2], frame[3]]), u64::from_be_bytes(frame[4..12].try_into().unwrap()))
    }

    /// `closed` ends when the server hangs up, with nothing sent meanwhile (a client that only
    /// serves learns a loss so), and at once on a client already closed.
    #[tokio::test]
    async fn closed_ends_when_the_server_hangs_up() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (hang_up, hung_up) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let (opcode, id) = read_request(&mut s).await;
            let mut out = Vec::new();
            Response::Hello { server: "fake".into(), max_frame: 64 << 10, features: 0 }.encode(opcode, id, &mut out);
            s.write_all(&out).await.unwrap();
            let _ = hung_up.await;
        });
        let client = Client::connect(addr).await.unwrap();
        let waiting = tokio::time::timeout(Duration::from_millis(100), client.closed()).await;
        assert!(waiting.is_err() && !client.is_closed(), "open while the server is");
        drop(hang_up);
        tokio::time::timeout(Duration::from_secs(10), client.closed()).await.expect("closed once hung up");
        assert!(client.is_closed());
        tokio::time::timeout(Duration::from_secs(1), client.closed()).await.expect("and at once after");
    }

    /// A server that answers HELLO and never AUTH: the connect fails after `auth_timeout` as a
    /// server that cannot be reached (a cluster goes on with the others), instead of waiting on.
    #[tokio::test]
    async fn a_server_that_never_answers_auth_is_given_up_on() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let server = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let (opcode, id) = read_request(&mut s).await;
            let mut out = Vec::new();
            Response::Hello { server: "fake".into(), max_frame: 64 << 10, features: 1 }.encode(opcode, id, &mut out);
            s.write_all(&out).await.unwrap();
            read_request(&mut s).await; // AUTH, never answered
            s
        });
        let options = ClientOptions {
            user: Some("max".into()),
            password: Some("secret".into()),
            auth_timeout: Duration::from_millis(300),
            ..ClientOptions::default()
        };
        let connecting = Client::connect_with(&addr, &options);
        let connected = tokio::time::timeout(Duration::from_secs(5), connecting).await.expect("gave up on AUTH");
        assert!(connected.as_ref().is_err_and(ClientError::is_connection_lost), "{connected:?}");
        drop(server.await.unwrap());
    }

    /// A server that says its frames hold 64 KiB, then answers a poll with a compressed payload
    /// that unfolds to 4 MiB: the client refuses it rather than unfold it.
    #[tokio::test]
    async fn a_payload_that_unfolds_past_the_servers_own_frames_is_refused() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let (opcode, id) = read_request(&mut s).await;
            let mut out = Vec::new();
            let hello = Response::Hello { server: "fake".into(), max_frame: 64 << 10, features: 0 };
            hello.encode(opcode, id, &mut out);
            s.write_all(&out).await.unwrap();
            let (opcode, id) = read_request(&mut s).await;
            let mut message = Message::new(vec![0u8; 4 << 20]);
            petrel_proto::compression::compress(&mut message, 1);
            assert!(message.compressed && message.payload.len() < 64 << 10);
            let mut out = Vec::new();
            Response::Polled { deliveries: vec![petrel_proto::Delivery { handle: 1, message }] }
                .encode(opcode, id, &mut out);
            s.write_all(&out).await.unwrap();
            s // kept open until the client is done
        });
        let client = Client::connect(addr).await.unwrap();
        let polled = client.poll("q", PollOptions { max: 1, timeout: Duration::ZERO, visibility: None }).await;
        assert!(matches!(polled, Err(ClientError::Protocol(_))), "{:?}", polled.map(|d| d[0].message.payload.len()));
        drop(server.await.unwrap());
    }
}
