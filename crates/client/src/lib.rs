//! Rust client for Petrel's native protocol.
//!
//! [`Client`] is async (tokio), cheap to clone, and pipelines: calls from many tasks share one
//! connection, each waiting only for its own response. [`blocking::Client`] wraps it for code
//! without a runtime.
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

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::BytesMut;
pub use petrel_proto::{Delivery, Message, MessageKind, QueueConfig, QueueStats, Request, Response, Status};
use petrel_proto::{FrameKind, frame};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::oneshot;

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

/// Requests encoded and not yet written are held up to this many bytes; past it, callers wait.
const MAX_OUTBOX: usize = 1 << 20;

/// The connection's shared state: requests waiting for their response, by request id (with
/// their opcode, to decode it), and the bytes of requests not yet written.
#[derive(Default)]
struct Pending {
    waiting: HashMap<u64, (u16, Reply), BuildIdHasher>,
    /// Encoded requests for the writer task, which sends all that gathered in one write.
    outbox: Vec<u8>,
    /// The connection is gone: new requests fail at once instead of waiting forever.
    closed: bool,
}

/// Request ids are a counter: a multiply spreads them well enough, far cheaper than SipHash.
#[derive(Default, Clone, Copy)]
struct BuildIdHasher;

struct IdHasher(u64);

impl std::hash::BuildHasher for BuildIdHasher {
    type Hasher = IdHasher;
    fn build_hasher(&self) -> IdHasher {
        IdHasher(0)
    }
}

impl std::hash::Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }
    fn write_u64(&mut self, id: u64) {
        self.0 = id.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

impl Pending {
    /// The connection is gone: every request waiting fails with `error()`, and so will new ones.
    fn close(&mut self, error: impl Fn() -> ClientError) {
        self.closed = true;
        self.outbox.clear();
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
    reader: tokio::task::JoinHandle<()>,
    writer: tokio::task::JoinHandle<()>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.reader.abort();
        self.writer.abort();
    }
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

impl Client {
    /// Connects over TCP and says hello.
    pub async fn connect(addr: impl tokio::net::ToSocketAddrs) -> Result<Client, ClientError> {
        let stream = tokio::net::TcpStream::connect(addr).await?;
        stream.set_nodelay(true)?;
        Client::over(stream).await
    }

    /// Connects over a Unix socket and says hello.
    pub async fn connect_unix(path: impl AsRef<std::path::Path>) -> Result<Client, ClientError> {
        Client::over(tokio::net::UnixStream::connect(path).await?).await
    }

    /// Speaks the protocol over any byte stream.
    pub async fn over<S: AsyncRead + AsyncWrite + Send + 'static>(stream: S) -> Result<Client, ClientError> {
        let (rd, wr) = tokio::io::split(stream);
        let pending: Arc<Mutex<Pending>> = Arc::default();
        let (written, room) = (Arc::new(tokio::sync::Notify::new()), Arc::new(tokio::sync::Notify::new()));
        let reader = tokio::spawn(read_responses(rd, Arc::clone(&pending)));
        let writer =
            tokio::spawn(write_requests(Box::new(wr), Arc::clone(&pending), Arc::clone(&written), Arc::clone(&room)));
        let inner = Inner { pending, written, room, next_id: AtomicU64::new(1), reader, writer };
        let client = Client { inner: Arc::new(inner) };
        client.hello().await?;
        Ok(client)
    }

    /// Sends requests back to back and waits for all their responses. Requests from all the
    /// tasks using this client that gather while a write is under way go out in the next one.
    pub async fn pipeline(&self, requests: &[Request]) -> Vec<Result<Response, ClientError>> {
        let mut waiting = Vec::with_capacity(requests.len());
        loop {
            let room = self.inner.room.notified();
            tokio::pin!(room);
            room.as_mut().enable();
            {
                let mut pending = self.inner.pending.lock().unwrap_or_else(|e| e.into_inner());
                if pending.outbox.len() < MAX_OUTBOX || pending.closed {
                    for r in requests {
                        if pending.closed {
                            waiting.push(Err(ClientError::Closed));
                            continue;
                        }
                        let id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
                        if let Err(e) = r.encode(id, &mut pending.outbox) {
                            waiting.push(Err(ClientError::Protocol(e.to_string())));
                            continue;
                        }
                        let (tx, rx) = oneshot::channel();
                        pending.waiting.insert(id, (r.opcode(), tx));
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

    async fn call(&self, request: Request) -> Result<Response, ClientError> {
        match self.pipeline(std::slice::from_ref(&request)).await.pop().expect("one result per request")? {
            Response::Error { status, message } => Err(ClientError::Status { status, message }),
            ok => Ok(ok),
        }
    }

    async fn hello(&self) -> Result<(), ClientError> {
        self.call(Request::Hello { client: format!("petrel-client/{}", env!("CARGO_PKG_VERSION")) }).await.map(|_| ())
    }

    pub async fn ping(&self) -> Result<(), ClientError> {
        self.call(Request::Ping).await.map(|_| ())
    }

    pub async fn create_queue(&self, name: &str, config: QueueConfig) -> Result<(), ClientError> {
        self.call(Request::QueueCreate { name: name.into(), config }).await.map(|_| ())
    }

    pub async fn remove_queue(&self, name: &str) -> Result<(), ClientError> {
        self.call(Request::QueueRemove { name: name.into() }).await.map(|_| ())
    }

    pub async fn list_queues(&self) -> Result<Vec<String>, ClientError> {
        match self.call(Request::QueueList).await? {
            Response::QueueList { names } => Ok(names),
            other => Err(unexpected(other)),
        }
    }

    pub async fn queue_status(&self, name: &str) -> Result<QueueStats, ClientError> {
        match self.call(Request::QueueStatus { name: name.into() }).await? {
            Response::QueueStatus { stats } => Ok(stats),
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
        let timeout_ms = timeout.map_or(0, |t| t.as_millis().min(u32::MAX as u128) as u32);
        match self.call(Request::Offer { queue: queue.into(), timeout_ms, messages }).await? {
            Response::Offered { first_id, .. } => Ok(first_id),
            other => Err(unexpected(other)),
        }
    }

    /// Polls; an empty queue (after the timeout) gives an empty vector.
    pub async fn poll(&self, queue: &str, options: PollOptions) -> Result<Vec<Delivery>, ClientError> {
        let request = Request::Poll {
            queue: queue.into(),
            max: options.max,
            timeout_ms: options.timeout.as_millis().min(u32::MAX as u128) as u32,
            visibility_ms: options.visibility.map_or(0, |v| v.as_millis().clamp(1, u32::MAX as u128) as u32),
        };
        match self.call(request).await {
            Ok(Response::Polled { deliveries }) => Ok(deliveries),
            Err(ClientError::Status { status: Status::QueueEmpty, .. }) => Ok(Vec::new()),
            Ok(other) => Err(unexpected(other)),
            Err(e) => Err(e),
        }
    }

    /// Acknowledges tentative deliveries; returns how many the server knew.
    pub async fn ack(&self, queue: &str, handles: &[u64]) -> Result<u32, ClientError> {
        match self.call(Request::Ack { queue: queue.into(), handles: handles.to_vec() }).await? {
            Response::Acked { count } => Ok(count),
            other => Err(unexpected(other)),
        }
    }

    /// Returns tentative deliveries to the head of the queue.
    pub async fn abort(&self, queue: &str, handles: &[u64]) -> Result<u32, ClientError> {
        match self.call(Request::Abort { queue: queue.into(), handles: handles.to_vec() }).await? {
            Response::Acked { count } => Ok(count),
            other => Err(unexpected(other)),
        }
    }
}

fn unexpected(r: Response) -> ClientError {
    ClientError::Protocol(format!("unexpected response {r:?}"))
}

/// Reads responses and hands each to the request waiting for it. When the connection ends,
/// every waiting request fails with `Closed`, and so does every later one.
async fn read_responses<R: AsyncRead + Unpin>(mut rd: R, pending: Arc<Mutex<Pending>>) {
    let mut buf = BytesMut::with_capacity(64 * 1024);
    'read: loop {
        loop {
            match frame::decode(&mut buf, u32::MAX) {
                Ok(Some(f)) if f.kind == FrameKind::Response => {
                    let waiter = pending.lock().unwrap_or_else(|e| e.into_inner()).waiting.remove(&f.request_id);
                    if let Some((opcode, tx)) = waiter {
                        let _ =
                            tx.send(Response::decode(opcode, f.body).map_err(|e| ClientError::Protocol(e.to_string())));
                    }
                }
                Ok(Some(_)) => {} // server pushes: none for queues yet
                Ok(None) => break,
                Err(_) => break 'read,
            }
        }
        match rd.read_buf(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
    }
    pending.lock().unwrap_or_else(|e| e.into_inner()).close(|| ClientError::Closed);
}

/// Writes what gathered in the outbox, all of it in one write, again and again. A failed write
/// fails every request waiting.
async fn write_requests(
    mut wr: Writer,
    pending: Arc<Mutex<Pending>>,
    written: Arc<tokio::sync::Notify>,
    room: Arc<tokio::sync::Notify>,
) {
    let mut batch = Vec::with_capacity(64 * 1024);
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
            let sent = match wr.write_all(&batch).await {
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
            if batch.capacity() > 4 * MAX_OUTBOX {
                batch = Vec::with_capacity(64 * 1024); // after one huge request
            }
        }
    }
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
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
            let inner = rt.block_on(super::Client::connect(addr.to_owned()))?;
            Ok(Client { rt, inner })
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
        pub fn poll(&self, queue: &str, options: PollOptions) -> Result<Vec<Delivery>, ClientError> {
            self.rt.block_on(self.inner.poll(queue, options))
        }
        pub fn ack(&self, queue: &str, handles: &[u64]) -> Result<u32, ClientError> {
            self.rt.block_on(self.inner.ack(queue, handles))
        }
        pub fn abort(&self, queue: &str, handles: &[u64]) -> Result<u32, ClientError> {
            self.rt.block_on(self.inner.abort(queue, handles))
        }
        pub fn ping(&self) -> Result<(), ClientError> {
            self.rt.block_on(self.inner.ping())
        }
    }
}
