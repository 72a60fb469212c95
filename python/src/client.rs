//! The client for `petrel serve` over the native protocol: `Client` (blocking; the GIL is
//! released while it waits) and `AsyncCore` (the asyncio side: each call returns an awaitable
//! resolved by a task on one shared tokio runtime; `petrel.AsyncClient` in Python wraps it).
//! Both pipeline: calls from many threads or coroutines share one connection, their requests in
//! flight together. Subscriptions are in `subscription.rs`, serving functions in `functions.rs`.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use petrel_client::{ClientOptions, Delivery, PollOptions, QueueConfig, TlsOptions};
use pyo3::IntoPyObjectExt;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::pybacked::PyBackedBytes;
use pyo3::types::{PyBytes, PyDict};

use crate::completions::{Completions, Inner, outcome, outcome_with};
use crate::functions::{AsyncCalls, IncomingCall};
use crate::subscription::{AsyncSubscriptionCore, Subscription, start_from};
use crate::{ClosedError, ConnectionError, ServerError};

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Message>()?;
    m.add_class::<Client>()?;
    m.add_class::<Subscription>()?;
    m.add_class::<AsyncCore>()?;
    m.add_class::<Completions>()?;
    m.add_class::<AsyncSubscriptionCore>()?;
    m.add_class::<AsyncCalls>()?;
    m.add_class::<IncomingCall>()?;
    m.add_function(wrap_pyfunction!(stop_serving, m)?)?;
    Ok(())
}

/// The runtime of this process. A child made by `fork` has none of its parent's threads, and
/// the runtime's worker threads are what drive its sockets and timers: with the parent's, every
/// call in the child would wait for ever, Ctrl-C included. So a forked child makes its own (the
/// parent's, copied into it, is left alone: dropping it would wait for threads that are not
/// there).
pub(crate) fn runtime() -> &'static tokio::runtime::Runtime {
    static STARTED_IN: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    type Forked = Option<(u32, &'static tokio::runtime::Runtime)>;
    static FORKED: std::sync::Mutex<Forked> = std::sync::Mutex::new(None);
    let pid = std::process::id();
    if *STARTED_IN.get_or_init(|| pid) == pid {
        return pyo3_async_runtimes::tokio::get_runtime();
    }
    let mut forked = FORKED.lock().unwrap_or_else(|e| e.into_inner());
    match *forked {
        Some((made_in, runtime)) if made_in == pid => runtime,
        _ => {
            let made = tokio::runtime::Builder::new_multi_thread().enable_all().build();
            let runtime: &'static tokio::runtime::Runtime = Box::leak(Box::new(made.expect("a runtime")));
            *forked = Some((pid, runtime));
            runtime
        }
    }
}

/// Runs `work` on the runtime until it is done, from any thread. A call made inside another's
/// wait (a Python signal handler runs inside the waiting call's `check_signals`, on a thread
/// that is running the runtime already) cannot block that thread on the runtime again: it runs
/// on a thread of its own while the handler waits for it.
pub(crate) fn block_on<F: Future + Send>(work: F) -> F::Output
where
    F::Output: Send,
{
    if tokio::runtime::Handle::try_current().is_err() {
        return runtime().block_on(work);
    }
    std::thread::scope(|scope| {
        let waited = scope.spawn(|| runtime().block_on(work)).join();
        waited.unwrap_or_else(|panic| std::panic::resume_unwind(panic))
    })
}

/// Blocking clients and clusters that serve a function: their handlers run on native threads,
/// which must not start Python code while the interpreter finalizes.
static SERVING: std::sync::Mutex<Vec<Stoppable>> = std::sync::Mutex::new(Vec::new());

/// Ends the connections of blocking clients that serve functions, so that no call starts a
/// handler after this (`petrel` calls it at exit); returns whether there were any.
#[pyfunction]
#[pyo3(name = "_stop_serving")]
fn stop_serving() -> bool {
    let serving = std::mem::take(&mut *SERVING.lock().unwrap_or_else(|e| e.into_inner()));
    serving.iter().for_each(Stoppable::stop);
    !serving.is_empty()
}

/// A blocking client or cluster that `petrel` ends at exit, so that no handler starts while the
/// interpreter finalizes.
pub(crate) enum Stoppable {
    Client(Arc<Connection>),
    Cluster(petrel_client::Cluster),
}

impl Stoppable {
    pub(crate) fn stop(&self) {
        match self {
            Stoppable::Client(c) => c.close(),
            Stoppable::Cluster(c) => c.close(),
        }
    }

    /// The same client (a client serving several functions is listed once).
    fn same(&self, other: &Stoppable) -> bool {
        match (self, other) {
            (Stoppable::Client(a), Stoppable::Client(b)) => Arc::ptr_eq(a, b),
            (Stoppable::Cluster(a), Stoppable::Cluster(b)) => a.is_same(b),
            _ => false,
        }
    }

    pub(crate) fn is_closed(&self) -> bool {
        match self {
            Stoppable::Client(c) => c.closed.load(std::sync::atomic::Ordering::Acquire),
            Stoppable::Cluster(c) => c.is_closed(),
        }
    }
}

/// Has `serving` closed at exit (see `stop_serving`).
pub(crate) fn stop_at_exit(serving: Stoppable) {
    let mut all = SERVING.lock().unwrap_or_else(|e| e.into_inner());
    // Bounded by the clients alive and the functions they serve: closed ones are dropped.
    all.retain(|c| !c.is_closed());
    if !all.iter().any(|c| c.same(&serving)) {
        all.push(serving);
    }
}

/// The Python exception for `e`. The server's refusals carry their status's name as `status`
/// (`"QUEUE_FULL"`), for code that handles one of them: made without the GIL (this runs on the
/// runtime's threads too), as the exception's second argument, which `status` reads (`lib.rs`).
pub(crate) fn client_error(e: petrel_client::ClientError) -> PyErr {
    match &e {
        petrel_client::ClientError::Status { status, .. } => ServerError::new_err((e.to_string(), status.name())),
        petrel_client::ClientError::Closed => ClosedError::new_err(e.to_string()),
        petrel_client::ClientError::Invalid(_) => PyValueError::new_err(e.to_string()),
        _ => ConnectionError::new_err(e.to_string()),
    }
}

/// How to connect: credentials (a password travels only inside TLS unless the server allows
/// plaintext on loopback), the CA that signed the server's certificate, and a client
/// certificate and key for mutual TLS (the certificate names the user).
pub(crate) struct Connect {
    address: String,
    pub(crate) options: ClientOptions,
}

pub(crate) fn connect_options(
    address: &str,
    user: Option<String>,
    password: Option<String>,
    tls_ca: Option<PathBuf>,
    tls_cert: Option<PathBuf>,
    tls_key: Option<PathBuf>,
) -> PyResult<Connect> {
    let tls = match (tls_ca, tls_cert, tls_key) {
        (Some(ca), cert, key) => Some(TlsOptions { ca, cert, key, server_name: None }),
        (None, None, None) => None,
        (None, ..) => return Err(PyValueError::new_err("a client certificate needs tls_ca, the server's CA")),
    };
    Ok(Connect {
        address: address.to_owned(),
        options: ClientOptions { user, password, tls, ..ClientOptions::default() },
    })
}

impl Connect {
    async fn connect(&self) -> PyResult<petrel_client::Client> {
        self.connect_client().await.map_err(client_error)
    }

    async fn connect_client(&self) -> Result<petrel_client::Client, petrel_client::ClientError> {
        petrel_client::Client::connect_with(&self.address, &self.options).await
    }
}

/// A client's connection to its server, made again by the first request after it was lost (the
/// server restarted, the network dropped it): the request that found it lost fails with
/// `ConnectionError` (what it sent may have arrived, so it is not sent again); the next one
/// connects first. Tentative takes and subscriptions belong to the connection they were made on
/// and end with it. Functions served belong to the client: while it serves any, a task of its own
/// (`keep_serving`) notices a loss, connects again (pausing longer after each failure, up to
/// `MAX_PAUSE`) and serves them all on the new connection. Never after `close`.
pub(crate) struct Connection {
    connect: Connect,
    /// Held while a lost connection is made again, so that one request does it; with the
    /// number of connections made before it (which connection a function was served on).
    current: tokio::sync::Mutex<(petrel_client::Client, u64)>,
    /// The process `current` was made in: a forked child makes a connection of its own (the
    /// parent's socket is the parent's, and its tasks are not in the child).
    made_in: std::sync::atomic::AtomicU32,
    closed: std::sync::atomic::AtomicBool,
    /// The functions served, and on which connection they all were last (held while serving, so
    /// that each connection serves each once).
    served: tokio::sync::Mutex<Served>,
}

/// A served function's handler, kept to serve it again on a new connection.
pub(crate) type Handler = Arc<dyn Fn(petrel_client::Message) -> crate::functions::HandlerFuture + Send + Sync>;

#[derive(Default)]
pub(crate) struct Served {
    functions: Vec<(String, Handler)>,
    /// The connection (its number) every function in `functions` is served on.
    on: u64,
    /// `keep_serving` runs.
    kept: bool,
}

/// The first pause before a lost connection that serves functions is made again, doubled after
/// each failure up to `MAX_PAUSE`.
const FIRST_PAUSE: Duration = Duration::from_millis(100);
const MAX_PAUSE: Duration = Duration::from_secs(5);

impl Connection {
    fn new(connect: Connect, client: petrel_client::Client) -> Arc<Connection> {
        Arc::new(Connection {
            connect,
            current: tokio::sync::Mutex::new((client, 0)),
            made_in: std::sync::atomic::AtomicU32::new(std::process::id()),
            closed: Default::default(),
            served: Default::default(),
        })
    }

    /// `e`, said as a lost connection (`ConnectionError` in Python) when the connection ended
    /// without `close`: the crate's `Closed` also says that the server closed it, and Python's
    /// `ClosedError` is for a client the program closed, which no retry mends.
    fn lost_unless_closed(&self, e: petrel_client::ClientError) -> petrel_client::ClientError {
        match e {
            petrel_client::ClientError::Closed if !self.closed.load(std::sync::atomic::Ordering::Acquire) => {
                std::io::Error::new(std::io::ErrorKind::ConnectionAborted, "the server closed the connection").into()
            }
            e => e,
        }
    }

    /// The connection, made again first if it was lost.
    async fn client(&self) -> Result<petrel_client::Client, petrel_client::ClientError> {
        self.numbered().await.map(|(client, _)| client)
    }

    /// `client`, and its number.
    async fn numbered(&self) -> Result<(petrel_client::Client, u64), petrel_client::ClientError> {
        let mut current = self.current.lock().await;
        let pid = std::process::id();
        let forked = self.made_in.load(std::sync::atomic::Ordering::Relaxed) != pid;
        if (forked || current.0.is_closed()) && !self.closed.load(std::sync::atomic::Ordering::Acquire) {
            *current = (self.connect.connect_client().await?, current.1 + 1);
            self.made_in.store(pid, std::sync::atomic::Ordering::Relaxed);
        }
        Ok(current.clone())
    }

    /// The connection as it is, unless one is being made again (then `None`: the one before
    /// is gone).
    fn now(&self) -> Option<petrel_client::Client> {
        self.current.try_lock().ok().map(|c| c.0.clone())
    }

    /// Serves `function` with `handler` on the connection, and on every later one.
    async fn serve(self: &Arc<Self>, function: &str, handler: Handler) -> Result<(), petrel_client::ClientError> {
        let mut served = self.served.lock().await;
        let (client, number) = self.numbered().await?;
        Self::serve_all_on(&client, number, &mut served).await;
        let h = Arc::clone(&handler);
        client.serve(function, move |m| h(m)).await?;
        served.functions.retain(|(f, _)| f != function);
        served.functions.push((function.to_owned(), handler));
        if !std::mem::replace(&mut served.kept, true) {
            runtime().spawn(keep_serving(Arc::downgrade(self)));
        }
        Ok(())
    }

    async fn unserve(&self, function: &str) -> Result<(), petrel_client::ClientError> {
        let mut served = self.served.lock().await;
        served.functions.retain(|(f, _)| f != function);
        self.client().await?.unserve(function).await
    }

    /// Serves every function of `served` on connection `number` unless they all are already.
    /// A refusal leaves that function unserved there and is told to the application as a
    /// warning of the `petrel` logger (`warn`); a lost connection is made again by
    /// `keep_serving`, which serves them again on the next.
    async fn serve_all_on(client: &petrel_client::Client, number: u64, served: &mut Served) {
        if served.on == number {
            return;
        }
        for (function, handler) in &served.functions {
            let h = Arc::clone(handler);
            if let Err(e @ petrel_client::ClientError::Status { .. }) = client.serve(function, move |m| h(m)).await {
                warn(format!(
                    "function {function:?} is not served any more: serving it again after a reconnection was \
                     refused ({e}); serve() it again once the server allows it"
                ));
            }
        }
        served.on = number;
    }

    /// Ends the connection for good. Called without the GIL (a thread waiting for a lock this
    /// waits for may need it); from inside the runtime (a signal handler run while a request
    /// waits) it is done on a task, as a runtime thread must not block.
    fn close(self: &Arc<Self>) {
        self.close_then(false);
    }

    /// `close`; `in_background`: done on a task even from outside the runtime (an event loop's
    /// thread must not wait for a reconnection under way, up to its connect timeout). The
    /// connection is marked closed at once either way: no request or reconnection starts after.
    fn close_then(self: &Arc<Self>, in_background: bool) {
        self.closed.store(true, std::sync::atomic::Ordering::Release);
        let conn = Arc::clone(self);
        let closing = async move {
            // Waits for a reconnection under way to end.
            conn.current.lock().await.0.close();
            // The handlers go: an asyncio client's streams of calls end.
            conn.served.lock().await.functions.clear();
        };
        match in_background || tokio::runtime::Handle::try_current().is_ok() {
            true => drop(runtime().spawn(closing)),
            false => runtime().block_on(closing),
        }
    }
}

/// Tells the application what it would not see otherwise, with Python's `logging`: a warning of
/// the `petrel` logger. On a blocking thread: a runtime thread must not wait for the GIL.
fn warn(message: String) {
    drop(tokio::task::spawn_blocking(move || {
        Python::attach(|py| {
            let logged = py
                .import("logging")
                .and_then(|logging| logging.call_method1("getLogger", ("petrel",)))
                .and_then(|logger| logger.call_method1("warning", (message,)));
            if let Err(e) = logged {
                e.print(py);
            }
        })
    }));
}

/// Serves a client's functions again on each new connection after a loss, until the client is
/// closed or gone. A server that refuses the login is tried again like one that is down, and
/// said once (`warn`) until a login succeeds.
async fn keep_serving(conn: std::sync::Weak<Connection>) {
    let mut pause = FIRST_PAUSE;
    let mut refused = false;
    loop {
        let Some(c) = conn.upgrade() else { return };
        if c.closed.load(std::sync::atomic::Ordering::Acquire) {
            return;
        }
        let client = {
            let mut served = c.served.lock().await;
            match c.numbered().await {
                Ok((client, number)) => {
                    Connection::serve_all_on(&client, number, &mut served).await;
                    (pause, refused) = (FIRST_PAUSE, false);
                    Some(client)
                }
                Err(e @ petrel_client::ClientError::Status { .. }) => {
                    if !std::mem::replace(&mut refused, true) {
                        let functions: Vec<&str> = served.functions.iter().map(|(f, _)| f.as_str()).collect();
                        warn(format!(
                            "functions {functions:?} are not served while the server refuses this client's \
                             connection ({e}); trying again every {} s at most",
                            MAX_PAUSE.as_secs()
                        ));
                    }
                    None
                }
                Err(_) => None,
            }
        };
        drop(c);
        match client {
            Some(client) => {
                client.closed().await;
                // A connection that ends as soon as it is made is not made again at once.
                tokio::time::sleep(FIRST_PAUSE).await;
            }
            None => {
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(MAX_PAUSE);
            }
        }
    }
}

/// The messages of an `offer_many`: at least one (an offer of none would store nothing and
/// still be answered with an id).
pub(crate) fn messages_of(payloads: Vec<PyBackedBytes>) -> PyResult<Vec<petrel_client::Message>> {
    if payloads.is_empty() {
        return Err(PyValueError::new_err("offer_many: no payloads to offer"));
    }
    Ok(payloads.into_iter().map(message_of).collect())
}

/// A message of `payload`, kept (not copied) until written.
pub(crate) fn message_of(payload: PyBackedBytes) -> petrel_client::Message {
    petrel_client::Message::new(bytes::Bytes::from_owner(payload))
}

/// An offered message with a priority, an idempotency key (`None`: none), and a delay
/// (seconds) or a time to be handed out at (seconds since the epoch, as `time.time()`).
pub(crate) fn offered(
    payload: PyBackedBytes,
    priority: i64,
    key: Option<String>,
    delay: Option<f64>,
    deliver_at: Option<f64>,
) -> PyResult<petrel_client::Message> {
    // Taken as any int, so that a wrong one is a ValueError that says why (not OverflowError).
    let priority = u8::try_from(priority).map_err(|_| {
        PyValueError::new_err(format!("priority {priority}: 0 to 255 (a queue of N levels files higher ones at N - 1)"))
    })?;
    if delay.is_some() && deliver_at.is_some() {
        return Err(PyValueError::new_err("give delay or deliver_at, not both"));
    }
    let delay_ms = millis(delay, "delay")?;
    let delay_ms = u32::try_from(delay_ms).map_err(|_| PyValueError::new_err("delay: at most 49 days"))?;
    let deliver_at = match deliver_at {
        Some(t) if t.is_finite() && t > 0.0 => (t * 1e9) as u64,
        Some(_) => return Err(PyValueError::new_err("deliver_at: seconds since the epoch, as time.time()")),
        None => 0,
    };
    Ok(petrel_client::Message {
        priority,
        idempotency_key: key.unwrap_or_default().into(),
        delay_ms,
        deliver_at,
        ..message_of(payload)
    })
}

/// Whole milliseconds of `seconds` (`None`: 0), rounded up so that a delay is never shorter than
/// asked.
pub(crate) fn millis(seconds: Option<f64>, what: &str) -> PyResult<u64> {
    match seconds {
        None => Ok(0),
        Some(s) if s.is_finite() && s >= 0.0 => Ok((s * 1000.0).ceil() as u64),
        Some(_) => Err(PyValueError::new_err(format!("{what}: seconds, at least 0"))),
    }
}

/// An outgoing message with an optional subject.
pub(crate) fn outgoing(payload: PyBackedBytes, subject: String) -> petrel_client::Message {
    petrel_client::Message { subject, ..message_of(payload) }
}

/// `create_queue`'s keyword settings (times in seconds; see the server's `QueueConfig` for each).
#[derive(Default)]
pub(crate) struct QueueOptions {
    dead_letter: Option<String>,
    max_deliveries: u32,
    priorities: u8,
    priority_share: u8,
    dedup_window: u32,
    dedup_window_time: Option<f64>,
    redelivery_delay: Option<f64>,
    redelivery_delay_max: Option<f64>,
}

impl QueueOptions {
    /// From keyword arguments; a name it does not know is an error (a typo configures nothing).
    pub(crate) fn from_kwargs(settings: Option<&Bound<'_, PyDict>>) -> PyResult<QueueOptions> {
        let mut o = QueueOptions::default();
        for (name, value) in settings.into_iter().flat_map(|d| d.iter()) {
            let name: String = name.extract()?;
            match name.as_str() {
                "dead_letter" => o.dead_letter = value.extract()?,
                "max_deliveries" => o.max_deliveries = value.extract()?,
                "priorities" => o.priorities = value.extract()?,
                "priority_share" => o.priority_share = value.extract()?,
                "dedup_window" => o.dedup_window = value.extract()?,
                "dedup_window_time" => o.dedup_window_time = value.extract()?,
                "redelivery_delay" => o.redelivery_delay = value.extract()?,
                "redelivery_delay_max" => o.redelivery_delay_max = value.extract()?,
                other => return Err(PyValueError::new_err(format!("create_queue: no setting named {other:?}"))),
            }
        }
        Ok(o)
    }
}

pub(crate) fn queue_config(
    durable: bool,
    max_items: u64,
    max_bytes: u64,
    ttl: Option<f64>,
    options: QueueOptions,
) -> PyResult<QueueConfig> {
    let ms32 = |seconds, what: &str| {
        u32::try_from(millis(seconds, what)?).map_err(|_| PyValueError::new_err(format!("{what}: at most 49 days")))
    };
    Ok(QueueConfig {
        durable,
        max_items,
        max_bytes,
        ttl_ms: millis(ttl, "ttl")?,
        dead_letter: options.dead_letter.unwrap_or_default(),
        max_deliveries: options.max_deliveries,
        priorities: options.priorities,
        priority_share: options.priority_share,
        dedup_window: options.dedup_window,
        dedup_window_ms: millis(options.dedup_window_time, "dedup_window_time")?,
        redelivery_delay_ms: ms32(options.redelivery_delay, "redelivery_delay")?,
        redelivery_delay_max_ms: ms32(options.redelivery_delay_max, "redelivery_delay_max")?,
        ..QueueConfig::default()
    })
}

/// A message from the server: its id in the queue, payload, subject and headers; `handle` is
/// what acknowledges or aborts a tentative take (0 when taken for good).
#[pyclass(module = "petrel", frozen, get_all)]
pub struct Message {
    /// Its id: in a queue, increasing in offer order within a priority level and unique in the
    /// queue (1, 2, … in a queue without levels or delays; a level or a delayed message sets
    /// high bits); in a durable topic, its offset + 1.
    id: u64,
    /// What acknowledges or aborts a tentative take (from a `Cluster`, a `ClusterHandle`); 0 when
    /// taken for good.
    handle: Py<PyAny>,
    /// The queue or topic it came from.
    queue: String,
    /// Its bytes.
    payload: Py<PyBytes>,
    /// The subject it was sent with ("" if none).
    subject: String,
    /// When the server took it: nanoseconds since the Unix epoch.
    timestamp: u64,
    /// From a queue: how many times it has been handed out, this time included (1 the first
    /// time; see the queue's `max_deliveries`). 0 from a topic.
    deliveries: u32,
    /// Its priority level in a queue with priorities (0 otherwise).
    priority: u8,
    /// The idempotency key it was offered with ("" if none).
    idempotency_key: String,
    /// A delayed message: when it was due, nanoseconds since the Unix epoch (0 if it was never
    /// delayed).
    deliver_at: u64,
    /// Its headers: (name, value) pairs.
    headers: Vec<(String, Py<PyBytes>)>,
}

impl Message {
    pub(crate) fn new(py: Python<'_>, handle: u64, m: petrel_client::Message) -> Message {
        let handle = handle.into_py_any(py).expect("an int converts");
        Message::with_handle(py, handle, m)
    }

    pub(crate) fn with_handle(py: Python<'_>, handle: Py<PyAny>, m: petrel_client::Message) -> Message {
        Message {
            id: m.id,
            handle,
            queue: m.destination,
            payload: PyBytes::new(py, &m.payload).unbind(),
            subject: m.subject,
            timestamp: m.timestamp,
            deliveries: m.deliveries,
            priority: m.priority,
            idempotency_key: m.idempotency_key.into(),
            deliver_at: m.deliver_at,
            headers: m.headers.into_iter().map(|(n, v)| (n, PyBytes::new(py, &v).unbind())).collect(),
        }
    }
}

#[pymethods]
impl Message {
    fn __repr__(&self, py: Python<'_>) -> String {
        let len = self.payload.bind(py).as_bytes().len();
        format!("Message(id={}, queue={:?}, payload=<{len} bytes>)", self.id, self.queue)
    }
}

/// Server-side waits are at most this long at a time, so that a wait for ever still looks at
/// Python's signals between them.
pub(crate) const LONG_POLL: Duration = Duration::from_secs(1);

/// `visibility` `None` takes for good; a number is seconds, at least a millisecond (0 would
/// otherwise mean "for good" on the wire).
pub(crate) fn poll_options(max: u32, wait: Duration, visibility: Option<f64>) -> PollOptions {
    // Whole milliseconds from 1 to the wire's u32 (~49 days); NaN is the least, infinity the most.
    let visibility = visibility.map(|v| Duration::from_millis((v * 1000.0).clamp(1.0, f64::from(u32::MAX)) as u64));
    PollOptions { max: max.max(1), timeout: wait, visibility }
}

/// Polls by `poll_once(wait)` until something comes or `timeout` seconds (`None`: for ever) pass,
/// in server-side waits of at most `LONG_POLL`, Python's signals looked at between them.
pub(crate) fn poll_in_waits<T>(
    py: Python<'_>,
    timeout: Option<f64>,
    mut poll_once: impl FnMut(Duration) -> PyResult<Vec<T>>,
) -> PyResult<Vec<T>> {
    let deadline = crate::timeout_from(timeout).map(|t| std::time::Instant::now() + t);
    loop {
        let wait = match deadline {
            Some(d) => d.saturating_duration_since(std::time::Instant::now()).min(LONG_POLL),
            None => LONG_POLL,
        };
        let delivered = poll_once(wait)?;
        if !delivered.is_empty() || deadline.is_some_and(|d| std::time::Instant::now() >= d) {
            return Ok(delivered);
        }
        py.check_signals()?;
    }
}

/// How often a blocking request looks at Python's signals (`Client::wait`).
const SIGNAL_CHECK: Duration = Duration::from_millis(100);

/// How long an asyncio poll that takes for good holds its messages tentatively before it
/// acknowledges them (they come back after it if the acknowledgement never comes).
const ASYNC_TAKE_VISIBILITY: Duration = Duration::from_secs(30);

/// A connection to `petrel serve` (the native protocol, default port 22134). Thread-safe: calls
/// from many threads share the connection, their requests in flight together.
#[pyclass(module = "petrel", frozen)]
pub struct Client {
    conn: Arc<Connection>,
}

impl Client {
    /// Runs `call` without the GIL, looking at Python's signals every `SIGNAL_CHECK` meanwhile:
    /// Ctrl-C interrupts a call, an offer waiting for room or any other long request (the
    /// request is given up; what the server does with it is as for a lost connection's).
    fn wait<T: Send>(
        &self,
        py: Python<'_>,
        call: impl Future<Output = Result<T, petrel_client::ClientError>> + Send,
    ) -> PyResult<T> {
        let conn = &self.conn;
        wait_with_signals(py, async move { call.await.map_err(|e| conn.lost_unless_closed(e)) })
    }
}

/// Runs `call` to its end without the GIL, looking for signals every `SIGNAL_CHECK` (Ctrl-C
/// raises `KeyboardInterrupt` and drops the call).
pub(crate) fn wait_with_signals<T: Send>(
    py: Python<'_>,
    call: impl Future<Output = Result<T, petrel_client::ClientError>> + Send,
) -> PyResult<T> {
    py.detach(|| {
        block_on(async {
            tokio::pin!(call);
            loop {
                tokio::select! {
                    result = &mut call => return result.map_err(client_error),
                    _ = tokio::time::sleep(SIGNAL_CHECK) => Python::attach(|py| py.check_signals())?,
                }
            }
        })
    })
}

impl Client {
    /// A poll that waits on the server, run as a task of its own: a signal that interrupts the
    /// wait (Ctrl-C, an alarm's handler raising) gives back what it takes when it comes, unseen,
    /// instead of losing it. So a poll for good is made tentatively (`ASYNC_TAKE_VISIBILITY`)
    /// and its messages acknowledged once they are in hand, before they are returned.
    fn poll_guarded(
        &self,
        py: Python<'_>,
        queue: &str,
        options: PollOptions,
    ) -> PyResult<Vec<petrel_client::Delivery>> {
        let client = self.wait(py, self.conn.client())?;
        let for_good = options.visibility.is_none();
        let delivered = py.detach(|| {
            crate::client::block_on(async {
                // Dropped by a signal, its answer is given back when it comes (`Taken`).
                let polling = poll_once(&self.conn, client.clone(), queue.to_owned(), options);
                tokio::pin!(polling);
                let taken = loop {
                    tokio::select! {
                        taken = &mut polling => break taken?,
                        _ = tokio::time::sleep(SIGNAL_CHECK) => Python::attach(|py| py.check_signals())?,
                    }
                };
                let mut delivered = taken.keep();
                if for_good && !delivered.is_empty() {
                    // Acknowledged before they are handed over: a close right after (or the
                    // interpreter's exit) would give them back to their queue, to be delivered
                    // twice. One that fails (the connection lost) comes back: at least once.
                    let handles: Vec<u64> = delivered.iter().map(|d| d.handle).collect();
                    let _ = client.ack(queue, &handles).await;
                    // Taken for good: no handle, as a poll for good has.
                    delivered.iter_mut().for_each(|d| d.handle = 0);
                }
                Ok::<_, PyErr>(delivered)
            })
        })?;
        Ok(delivered)
    }
}

#[pymethods]
impl Client {
    #[new]
    #[pyo3(signature = (address = "127.0.0.1:22134", user = None, password = None, tls_ca = None, tls_cert = None, tls_key = None))]
    fn new(
        py: Python<'_>,
        address: &str,
        user: Option<String>,
        password: Option<String>,
        tls_ca: Option<PathBuf>,
        tls_cert: Option<PathBuf>,
        tls_key: Option<PathBuf>,
    ) -> PyResult<Client> {
        let connect = connect_options(address, user, password, tls_ca, tls_cert, tls_key)?;
        let inner = py.detach(|| crate::client::block_on(connect.connect()))?;
        Ok(Client { conn: Connection::new(connect, inner) })
    }

    /// Creates a queue (nothing if it exists with this configuration): on disk unless
    /// `durable=False`, bounded by `max_items` and `max_bytes` if given; keyword settings (times
    /// in seconds): `dead_letter`, `max_deliveries`, `priorities`, `priority_share`,
    /// `dedup_window`, `dedup_window_time`, `redelivery_delay`, `redelivery_delay_max`.
    #[pyo3(signature = (name, durable = true, max_items = 0, max_bytes = 0, ttl = None, **settings))]
    #[allow(clippy::too_many_arguments)] // Python's signature, keyword arguments and all
    fn create_queue(
        &self,
        py: Python<'_>,
        name: &str,
        durable: bool,
        max_items: u64,
        max_bytes: u64,
        ttl: Option<f64>,
        settings: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<()> {
        let config = queue_config(durable, max_items, max_bytes, ttl, QueueOptions::from_kwargs(settings)?)?;
        self.wait(py, async { self.conn.client().await?.create_queue(name, config).await })
    }

    /// Removes a queue and the messages in it.
    fn remove_queue(&self, py: Python<'_>, name: &str) -> PyResult<()> {
        self.wait(py, async { self.conn.client().await?.remove_queue(name).await })
    }

    /// The names of the queues this user may see.
    fn list_queues(&self, py: Python<'_>) -> PyResult<Vec<String>> {
        self.wait(py, async { self.conn.client().await?.list_queues().await })
    }

    /// Adds a message at the queue's tail; returns its id. Waits up to `timeout` seconds for
    /// room in a full bounded queue (default: refused at once). `priority`: its level in a queue
    /// with priorities; `key`: an idempotency key — offered again with the same key (a retry),
    /// the message is not stored twice, and the original's id is returned; `delay` (seconds) or
    /// `deliver_at` (seconds since the epoch): handed out no earlier.
    #[pyo3(signature = (queue, payload, timeout = None, *, priority = 0, key = None, delay = None, deliver_at = None))]
    #[allow(clippy::too_many_arguments)]
    fn offer(
        &self,
        py: Python<'_>,
        queue: &str,
        payload: PyBackedBytes,
        timeout: Option<f64>,
        priority: i64,
        key: Option<String>,
        delay: Option<f64>,
        deliver_at: Option<f64>,
    ) -> PyResult<u64> {
        let message = offered(payload, priority, key, delay, deliver_at)?;
        self.wait(py, async {
            self.conn.client().await?.offer(queue, vec![message], crate::request_timeout_from(timeout)).await
        })
    }

    /// Adds messages at the tail together, all or none, across a crash of the server too
    /// (docs/protocol.md); returns the first id.
    #[pyo3(signature = (queue, payloads, timeout = None))]
    fn offer_many(
        &self,
        py: Python<'_>,
        queue: &str,
        payloads: Vec<PyBackedBytes>,
        timeout: Option<f64>,
    ) -> PyResult<u64> {
        let messages = messages_of(payloads)?;
        self.wait(py, async {
            self.conn.client().await?.offer(queue, messages, crate::request_timeout_from(timeout)).await
        })
    }

    /// Takes the message at the head for good, waiting up to `timeout` seconds (`None`: until one
    /// comes); `None` if none came.
    #[pyo3(signature = (queue, timeout = 0.0))]
    fn poll(&self, py: Python<'_>, queue: &str, timeout: Option<f64>) -> PyResult<Option<Message>> {
        Ok(self.poll_many(py, queue, 1, timeout, None)?.into_iter().next())
    }

    /// Takes up to `max` messages; with `visibility` (seconds) tentatively: each comes back to
    /// the queue unless acknowledged (`ack`) within it.
    #[pyo3(signature = (queue, max = 100, timeout = 0.0, visibility = None))]
    fn poll_many(
        &self,
        py: Python<'_>,
        queue: &str,
        max: u32,
        timeout: Option<f64>,
        visibility: Option<f64>,
    ) -> PyResult<Vec<Message>> {
        let delivered = poll_in_waits(py, timeout, |wait| {
            let options = poll_options(max, wait, visibility);
            match wait.is_zero() {
                // (Answered at once: nothing a signal could cut short.)
                true => self.wait(py, async { self.conn.client().await?.poll(queue, options).await }),
                false => self.poll_guarded(py, queue, options),
            }
        })?;
        Ok(delivered.into_iter().map(|d| Message::new(py, d.handle, d.message)).collect())
    }

    /// Takes the message at the head tentatively: gone once acknowledged, back at the head after
    /// `visibility` seconds, an `abort`, or this connection's end.
    #[pyo3(signature = (queue, visibility = 30.0, timeout = 0.0))]
    fn take(&self, py: Python<'_>, queue: &str, visibility: f64, timeout: Option<f64>) -> PyResult<Option<Message>> {
        Ok(self.poll_many(py, queue, 1, timeout, Some(visibility))?.into_iter().next())
    }

    /// Acknowledges tentative takes by handle; returns how many were still open.
    fn ack(&self, py: Python<'_>, queue: &str, handles: Vec<u64>) -> PyResult<u32> {
        self.wait(py, async { self.conn.client().await?.ack(queue, &handles).await })
    }

    /// Puts tentative takes back at the head, or, with `delay` (seconds), to be handed out again
    /// no earlier than that (else after the queue's redelivery delay); returns how many were
    /// still open.
    #[pyo3(signature = (queue, handles, delay = None))]
    fn abort(&self, py: Python<'_>, queue: &str, handles: Vec<u64>, delay: Option<f64>) -> PyResult<u32> {
        let delay = Duration::from_millis(millis(delay, "delay")?);
        self.wait(py, async { self.conn.client().await?.abort_delayed(queue, &handles, delay).await })
    }

    /// Creates a topic (nothing if it exists); a durable one keeps a log that consumer groups
    /// read and replay (`subscribe_group`).
    #[pyo3(signature = (name, durable = false))]
    fn create_topic(&self, py: Python<'_>, name: &str, durable: bool) -> PyResult<()> {
        self.wait(py, async { self.conn.client().await?.create_topic(name, durable).await })
    }

    /// Removes a topic; its subscriptions end.
    fn remove_topic(&self, py: Python<'_>, name: &str) -> PyResult<()> {
        self.wait(py, async { self.conn.client().await?.remove_topic(name).await })
    }

    /// Publishes to every current subscriber (and, for a durable topic, to its log); returns how
    /// many subscribers it reached.
    #[pyo3(signature = (topic, payload, subject = String::new()))]
    fn publish(&self, py: Python<'_>, topic: &str, payload: PyBackedBytes, subject: String) -> PyResult<u32> {
        self.wait(py, async { self.conn.client().await?.publish(topic, vec![outgoing(payload, subject)]).await })
    }

    /// Subscribes to the topic's messages from now on: iterate the returned `Subscription`.
    /// `buffer`: how many the server holds for this subscriber before it ends the subscription
    /// as too slow (0: the server's default).
    #[pyo3(signature = (topic, buffer = 0))]
    fn subscribe(&self, py: Python<'_>, topic: &str, buffer: u32) -> PyResult<Subscription> {
        let client = self.wait(py, self.conn.client())?;
        let sub = self.wait(py, client.subscribe(topic, buffer))?;
        Ok(Subscription::new(client, sub))
    }

    /// Reads a durable topic as consumer group `group`: from where the group stands (`start`
    /// `None`), `"oldest"`, `"newest"`, an offset, or `time=NS`. At most `max_unacked` messages
    /// (0: the server's default) are delivered and not yet acknowledged (`Subscription.ack`);
    /// those unacknowledged come again to the group's next subscriber.
    #[pyo3(signature = (topic, group, start = None, *, time = None, max_unacked = 0))]
    fn subscribe_group(
        &self,
        py: Python<'_>,
        topic: &str,
        group: &str,
        start: Option<Bound<'_, PyAny>>,
        time: Option<u64>,
        max_unacked: u32,
    ) -> PyResult<Subscription> {
        let from = start_from(start.as_ref(), time)?;
        let client = self.wait(py, self.conn.client())?;
        let sub = self.wait(py, client.subscribe_group(topic, group, from, max_unacked))?;
        Ok(Subscription::new(client, sub))
    }

    /// Calls `function` with `payload` and returns the reply, waiting up to `timeout` seconds
    /// (`None`: the server's default). `ServerError` names `TIMEOUT`, `FUNCTION_NOT_FOUND` or
    /// `HANDLER_ERROR` (with the handler's message).
    #[pyo3(signature = (function, payload, timeout = None, subject = String::new()))]
    fn call(
        &self,
        py: Python<'_>,
        function: &str,
        payload: PyBackedBytes,
        timeout: Option<f64>,
        subject: String,
    ) -> PyResult<Message> {
        let reply = self.wait(py, async {
            self.conn
                .client()
                .await?
                .call(function, outgoing(payload, subject), crate::request_timeout_from(timeout))
                .await
        })?;
        Ok(Message::new(py, 0, reply))
    }

    /// Calls `function` without waiting for a reply: done once the server has the call.
    #[pyo3(signature = (function, payload, subject = String::new()))]
    fn call_oneway(&self, py: Python<'_>, function: &str, payload: PyBackedBytes, subject: String) -> PyResult<()> {
        self.wait(py, async { self.conn.client().await?.call_oneway(function, outgoing(payload, subject)).await })
    }

    /// Serves `function` with `handler`, a callable taking the request `Message` and returning
    /// the reply's payload (bytes-like or `None`); an exception it raises is the caller's
    /// `HANDLER_ERROR`. Handlers run on native threads, several at once. Serving lasts until
    /// `unserve` or `close`: after a lost connection the client serves it again on a new one.
    fn serve(&self, py: Python<'_>, function: &str, handler: Py<PyAny>) -> PyResult<()> {
        if !handler.bind(py).is_callable() {
            return Err(pyo3::exceptions::PyTypeError::new_err("the handler must be callable"));
        }
        let handler = Arc::new(handler);
        let handler: Handler =
            Arc::new(move |request| Box::pin(crate::functions::run_handler(Arc::clone(&handler), request)));
        self.wait(py, self.conn.serve(function, handler))?;
        stop_at_exit(Stoppable::Client(Arc::clone(&self.conn)));
        Ok(())
    }

    /// Stops serving `function`; calls already running still reply.
    fn unserve(&self, py: Python<'_>, function: &str) -> PyResult<()> {
        self.wait(py, self.conn.unserve(function))
    }

    /// A round trip to the server.
    fn ping(&self, py: Python<'_>) -> PyResult<()> {
        self.wait(py, async { self.conn.client().await?.ping().await })
    }

    /// Ends the connection; tentative takes not acknowledged go back to their queues.
    fn close(&self, py: Python<'_>) {
        py.detach(|| self.conn.close());
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __exit__(&self, py: Python<'_>, _kind: Py<PyAny>, _value: Py<PyAny>, _traceback: Py<PyAny>) -> bool {
        self.close(py);
        false
    }
}

/// The asyncio client's native half. Each request method takes a token and returns at once;
/// the request runs on the runtime and its outcome reaches `petrel.AsyncClient` through its
/// `Completions` under that token (`completions.rs`).
#[pyclass(module = "petrel", frozen)]
pub struct AsyncCore {
    conn: Arc<Connection>,
    completions: Arc<Inner>,
}

/// The connection of `conn` (made again if it was lost), or the outcome that says why there is
/// none.
async fn connected(conn: &Connection) -> Result<petrel_client::Client, crate::completions::Outcome> {
    conn.client().await.map_err(|e| outcome::<()>(Err(client_error(e))))
}

/// Polls once on the server (it waits up to `wait`), on a task of its own: if the awaiting
/// coroutine is cancelled (a `wait_for` timeout) while the poll is on the server, the task still
/// gets the answer, and its messages go back to the queue at once. A take for good is made
/// tentatively for that reason too: the Python side acknowledges it once the messages are in the
/// awaiting coroutine's hands (`AsyncClient._acknowledge`).
async fn poll_once(
    conn: &Connection,
    client: petrel_client::Client,
    queue: String,
    mut options: PollOptions,
) -> PyResult<Taken> {
    if options.visibility.is_none() {
        options.visibility = Some(ASYNC_TAKE_VISIBILITY);
    }
    let (answer, answered) = tokio::sync::oneshot::channel();
    tokio::spawn(async move {
        let result = client.poll(&queue, options).await;
        // Not received (sent or not), it is dropped: given back.
        let _ = answer.send(result.map(|deliveries| Taken { client, queue, deliveries }));
    });
    let answer = answered.await.map_err(|_| ClosedError::new_err("the poll's task ended"))?;
    answer.map_err(|e| client_error(conn.lost_unless_closed(e)))
}

/// Messages a poll took tentatively, given back to the head of their queue when dropped before
/// they reach Python (`keep`): wherever a cancelled poll's answer ends — in a channel no one
/// reads, or an outcome no coroutine awaits.
struct Taken {
    client: petrel_client::Client,
    queue: String,
    deliveries: Vec<Delivery>,
}

impl Taken {
    fn keep(mut self) -> Vec<Delivery> {
        std::mem::take(&mut self.deliveries)
    }
}

impl Drop for Taken {
    fn drop(&mut self) {
        let handles: Vec<u64> = self.deliveries.iter().map(|d| d.handle).collect();
        if !handles.is_empty() {
            let (client, queue) = (self.client.clone(), std::mem::take(&mut self.queue));
            runtime().spawn(async move { give_back(&client, &queue, handles).await });
        }
    }
}

/// Puts tentative takes no one will see back at the head of `queue`, unseen: their delivery is
/// not counted (no redelivery delay, no step towards the delivery limit), on a server that
/// takes them so.
async fn give_back(client: &petrel_client::Client, queue: &str, handles: Vec<u64>) {
    if !handles.is_empty() {
        // Failed (the connection closed), they come back when their visibility ends.
        let _ = client.give_back_unseen(queue, &handles).await;
    }
}

fn into_messages(py: Python<'_>, delivered: Vec<(u64, petrel_client::Message)>) -> Vec<Message> {
    delivered.into_iter().map(|(handle, m)| Message::new(py, handle, m)).collect()
}

impl AsyncCore {
    /// Runs one request with a clone of the connection; its value, converted as it is, is the
    /// outcome for `token`.
    fn run<T, F>(&self, token: u64, request: impl FnOnce(petrel_client::Client) -> F + Send + 'static)
    where
        F: Future<Output = Result<T, petrel_client::ClientError>> + Send + 'static,
        T: for<'py> IntoPyObject<'py> + Send + 'static,
    {
        let conn = Arc::clone(&self.conn);
        self.completions.spawn(token, async move {
            let client = match connected(&conn).await {
                Ok(client) => client,
                Err(none) => return none,
            };
            outcome(request(client).await.map_err(client_error))
        });
    }
}

#[pymethods]
impl AsyncCore {
    /// Connects; the outcome is an `AsyncCore` whose requests complete through `completions`.
    #[staticmethod]
    #[pyo3(signature = (token, completions, address, user = None, password = None, tls_ca = None, tls_cert = None, tls_key = None))]
    #[allow(clippy::too_many_arguments)]
    fn connect(
        token: u64,
        completions: &Completions,
        address: String,
        user: Option<String>,
        password: Option<String>,
        tls_ca: Option<PathBuf>,
        tls_cert: Option<PathBuf>,
        tls_key: Option<PathBuf>,
    ) -> PyResult<()> {
        let connect = connect_options(&address, user, password, tls_ca, tls_cert, tls_key)?;
        let done = Arc::clone(&completions.inner);
        completions.inner.spawn(token, async move {
            let connected = connect.connect().await;
            outcome(connected.map(|client| AsyncCore { conn: Connection::new(connect, client), completions: done }))
        });
        Ok(())
    }

    #[pyo3(signature = (token, name, durable = true, max_items = 0, max_bytes = 0, ttl = None, **settings))]
    #[allow(clippy::too_many_arguments)]
    fn create_queue(
        &self,
        token: u64,
        name: String,
        durable: bool,
        max_items: u64,
        max_bytes: u64,
        ttl: Option<f64>,
        settings: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<()> {
        let config = queue_config(durable, max_items, max_bytes, ttl, QueueOptions::from_kwargs(settings)?)?;
        self.run(token, move |c| async move { c.create_queue(&name, config).await });
        Ok(())
    }

    fn remove_queue(&self, token: u64, name: String) {
        self.run(token, move |c| async move { c.remove_queue(&name).await });
    }

    #[pyo3(signature = (token, queue, payload, timeout = None, priority = 0, key = None, delay = None, deliver_at = None))]
    #[allow(clippy::too_many_arguments)]
    fn offer(
        &self,
        token: u64,
        queue: String,
        payload: PyBackedBytes,
        timeout: Option<f64>,
        priority: i64,
        key: Option<String>,
        delay: Option<f64>,
        deliver_at: Option<f64>,
    ) -> PyResult<()> {
        let (message, timeout) =
            (offered(payload, priority, key, delay, deliver_at)?, crate::request_timeout_from(timeout));
        self.run(token, move |c| async move { c.offer(&queue, vec![message], timeout).await });
        Ok(())
    }

    #[pyo3(signature = (token, queue, payloads, timeout = None))]
    fn offer_many(
        &self,
        token: u64,
        queue: String,
        payloads: Vec<PyBackedBytes>,
        timeout: Option<f64>,
    ) -> PyResult<()> {
        let messages = messages_of(payloads)?;
        let timeout = crate::request_timeout_from(timeout);
        self.run(token, move |c| async move { c.offer(&queue, messages, timeout).await });
        Ok(())
    }

    /// One server-side poll waiting up to `wait` seconds (at most about a second: the Python
    /// side loops for longer waits). The outcome is `(messages, handles)`: a take for good (no
    /// `visibility`) is tentative until the caller acknowledges `handles` (its messages show
    /// handle 0).
    #[pyo3(signature = (token, queue, max = 1, wait = 0.0, visibility = None))]
    fn poll_once(&self, token: u64, queue: String, max: u32, wait: f64, visibility: Option<f64>) {
        let conn = Arc::clone(&self.conn);
        let wait = crate::timeout_from(Some(wait)).unwrap_or(LONG_POLL).min(LONG_POLL);
        let options = poll_options(max, wait, visibility);
        let for_good = visibility.is_none();
        self.completions.spawn(token, async move {
            let client = match connected(&conn).await {
                Ok(client) => client,
                Err(none) => return none,
            };
            match poll_once(&conn, client, queue, options).await {
                Ok(taken) => outcome_with(move |py| {
                    let delivered = taken.keep();
                    let handles: Vec<u64> = delivered.iter().map(|d| d.handle).collect();
                    let shown = |d: &Delivery| if for_good { 0 } else { d.handle };
                    let delivered = delivered.into_iter().map(|d| (shown(&d), d.message)).collect();
                    (into_messages(py, delivered), handles).into_py_any(py)
                }),
                Err(e) => outcome::<()>(Err(e)),
            }
        });
    }

    /// Gives back tentative takes no one will see, without waiting (a poll whose coroutine was
    /// cancelled as its answer came).
    fn abort_detached(&self, queue: String, handles: Vec<u64>) {
        // On the connection that took them (if it was lost, the server gave them back).
        if let Some(client) = self.conn.now() {
            runtime().spawn(async move { give_back(&client, &queue, handles).await });
        }
    }

    fn ack(&self, token: u64, queue: String, handles: Vec<u64>) {
        self.run(token, move |c| async move { c.ack(&queue, &handles).await });
    }

    #[pyo3(signature = (token, queue, handles, delay = None))]
    fn abort(&self, token: u64, queue: String, handles: Vec<u64>, delay: Option<f64>) -> PyResult<()> {
        let delay = Duration::from_millis(millis(delay, "delay")?);
        self.run(token, move |c| async move { c.abort_delayed(&queue, &handles, delay).await });
        Ok(())
    }

    #[pyo3(signature = (token, name, durable = false))]
    fn create_topic(&self, token: u64, name: String, durable: bool) {
        self.run(token, move |c| async move { c.create_topic(&name, durable).await });
    }

    fn remove_topic(&self, token: u64, name: String) {
        self.run(token, move |c| async move { c.remove_topic(&name).await });
    }

    #[pyo3(signature = (token, topic, payload, subject = String::new()))]
    fn publish(&self, token: u64, topic: String, payload: PyBackedBytes, subject: String) {
        let message = outgoing(payload, subject);
        self.run(token, move |c| async move { c.publish(&topic, vec![message]).await });
    }

    /// Subscribes to a topic's live messages; the outcome is an `AsyncSubscriptionCore`.
    #[pyo3(signature = (token, topic, buffer = 0))]
    fn subscribe(&self, token: u64, topic: String, buffer: u32) {
        let conn = Arc::clone(&self.conn);
        let done = Arc::clone(&self.completions);
        self.completions.spawn(token, async move {
            let client = match connected(&conn).await {
                Ok(client) => client,
                Err(none) => return none,
            };
            let sub = client.subscribe(&topic, buffer).await.map_err(client_error);
            outcome(sub.map(|sub| AsyncSubscriptionCore::new(client, sub, done)))
        });
    }

    /// Reads a durable topic as a consumer group (see `Client.subscribe_group`); the outcome is
    /// an `AsyncSubscriptionCore`.
    #[pyo3(signature = (token, topic, group, start = None, *, time = None, max_unacked = 0))]
    #[allow(clippy::too_many_arguments)]
    fn subscribe_group(
        &self,
        token: u64,
        topic: String,
        group: String,
        start: Option<Bound<'_, PyAny>>,
        time: Option<u64>,
        max_unacked: u32,
    ) -> PyResult<()> {
        let from = start_from(start.as_ref(), time)?;
        let conn = Arc::clone(&self.conn);
        let done = Arc::clone(&self.completions);
        self.completions.spawn(token, async move {
            let client = match connected(&conn).await {
                Ok(client) => client,
                Err(none) => return none,
            };
            let sub = client.subscribe_group(&topic, &group, from, max_unacked).await.map_err(client_error);
            outcome(sub.map(|sub| AsyncSubscriptionCore::new(client, sub, done)))
        });
        Ok(())
    }

    /// Calls a function; the outcome is the reply `Message`.
    #[pyo3(signature = (token, function, payload, timeout = None, subject = String::new()))]
    fn call(&self, token: u64, function: String, payload: PyBackedBytes, timeout: Option<f64>, subject: String) {
        let conn = Arc::clone(&self.conn);
        let (message, timeout) = (outgoing(payload, subject), crate::request_timeout_from(timeout));
        self.completions.spawn(token, async move {
            let client = match connected(&conn).await {
                Ok(client) => client,
                Err(none) => return none,
            };
            match client.call(&function, message, timeout).await {
                Ok(reply) => outcome_with(move |py| Message::new(py, 0, reply).into_py_any(py)),
                Err(e) => outcome::<()>(Err(client_error(e))),
            }
        });
    }

    #[pyo3(signature = (token, function, payload, subject = String::new()))]
    fn call_oneway(&self, token: u64, function: String, payload: PyBackedBytes, subject: String) {
        let message = outgoing(payload, subject);
        self.run(token, move |c| async move { c.call_oneway(&function, message).await });
    }

    /// Serves `function`; the outcome is the `AsyncCalls` stream of its calls.
    fn serve(&self, token: u64, function: String) {
        let conn = Arc::clone(&self.conn);
        let done = Arc::clone(&self.completions);
        self.completions.spawn(token, async move {
            let (handler, calls) = crate::functions::async_calls(done);
            outcome(conn.serve(&function, Arc::new(handler)).await.map_err(client_error).map(|()| calls))
        });
    }

    fn unserve(&self, token: u64, function: String) {
        let conn = Arc::clone(&self.conn);
        self.completions.spawn(token, async move { outcome(conn.unserve(&function).await.map_err(client_error)) });
    }

    /// Closes on a task: called from the event loop's thread, which must not wait (a
    /// reconnection under way holds the connection's locks up to its connect timeout).
    fn close(&self, py: Python<'_>) {
        py.detach(|| self.conn.close_then(true));
    }
}
