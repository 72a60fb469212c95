//! `petrel.Cluster`: a blocking, thread-safe client of several independent servers over
//! `petrel_client::Cluster` (docs/cluster.md). Offers go to the servers in turn, or by a routing
//! key to the server it ranks first; polls take from all of them; a tentative take's handle is a
//! `ClusterHandle` naming its server, so acknowledgements go back where the message came from.
//! A server that fails is routed around and reconnected in the background.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use petrel_client::ClusterOptions;
use pyo3::IntoPyObjectExt;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::pybacked::PyBackedBytes;
use pyo3::types::PyDict;

use crate::client::{
    Message, QueueOptions, Stoppable, client_error, connect_options, messages_of, millis, offered, outgoing,
    poll_in_waits, poll_options, queue_config, runtime,
};
use crate::subscription::{Next, wait_for_next};

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Cluster>()?;
    m.add_class::<ClusterHandle>()?;
    m.add_class::<ClusterSubscription>()?;
    Ok(())
}

/// What acknowledges or aborts a message taken tentatively from a cluster: the server it came
/// from (`server`, its address) and that server's handle. A handle of a connection since lost
/// counts for nothing (its message went back to its queue on that server).
#[pyclass(module = "petrel", frozen, eq, hash)]
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct ClusterHandle {
    inner: petrel_client::ClusterHandle,
    /// The address of the server the message came from.
    #[pyo3(get)]
    server: String,
}

#[pymethods]
impl ClusterHandle {
    /// The server's own handle.
    #[getter]
    fn handle(&self) -> u64 {
        self.inner.handle
    }

    fn __repr__(&self) -> String {
        format!("ClusterHandle(server={:?}, handle={})", self.server, self.inner.handle)
    }
}

/// A client of several independent `petrel serve` processes, each with its own queues (Kestrel's
/// model: no coordination between servers). Thread-safe; `with` closes it.
#[pyclass(module = "petrel", frozen)]
pub struct Cluster {
    inner: petrel_client::Cluster,
    /// The servers' addresses, in the order given (a handle's `server`).
    addrs: Vec<String>,
}

/// How long a poll for good waits, signals aside, for its acknowledgement.
const ACK_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

impl Cluster {
    fn wait<T: Send>(
        &self,
        py: Python<'_>,
        call: impl Future<Output = Result<T, petrel_client::ClientError>> + Send,
    ) -> PyResult<T> {
        // (Ctrl-C ends a wait, as on `Client`.)
        crate::client::wait_with_signals(py, call)
    }

    fn handles(handles: Vec<PyRef<'_, ClusterHandle>>) -> Vec<petrel_client::ClusterHandle> {
        handles.iter().map(|h| h.inner).collect()
    }
}

/// The servers of a cluster: a list of addresses, or one string of them separated by commas.
fn server_list(servers: &Bound<'_, PyAny>) -> PyResult<Vec<String>> {
    let list: Vec<String> = match servers.extract::<String>() {
        Ok(joined) => joined.split(',').map(|s| s.trim().to_owned()).collect(),
        Err(_) => servers.extract()?,
    };
    if list.is_empty() || list.iter().any(String::is_empty) {
        return Err(PyValueError::new_err("servers: one address or more, as a list or \"host:port,host:port\""));
    }
    Ok(list)
}

#[pymethods]
impl Cluster {
    /// Connects to every server at once; succeeds if one answers (the others are tried again in
    /// the background). The credentials and TLS settings are those of `Client`, the same for
    /// every server; `request_timeout` (seconds): a request unanswered this long past its own
    /// wait marks its server down.
    #[new]
    #[pyo3(signature = (servers, user = None, password = None, tls_ca = None, tls_cert = None, tls_key = None, request_timeout = 0.5))]
    #[allow(clippy::too_many_arguments)] // Python's signature
    fn new(
        py: Python<'_>,
        servers: &Bound<'_, PyAny>,
        user: Option<String>,
        password: Option<String>,
        tls_ca: Option<PathBuf>,
        tls_cert: Option<PathBuf>,
        tls_key: Option<PathBuf>,
        request_timeout: f64,
    ) -> PyResult<Cluster> {
        let addrs = server_list(servers)?;
        let client = connect_options(&addrs[0], user, password, tls_ca, tls_cert, tls_key)?.options;
        // (Infinity: a day, which no answer takes.)
        let request_timeout = crate::timeout_from(Some(request_timeout)).unwrap_or(Duration::from_secs(24 * 3600));
        if request_timeout.is_zero() {
            return Err(PyValueError::new_err("request_timeout: seconds, more than 0"));
        }
        // The cluster's connect timeout (its default), the flags' credentials and TLS, as the CLI.
        let defaults = ClusterOptions::default();
        let client = petrel_client::ClientOptions { connect_timeout: defaults.client.connect_timeout, ..client };
        let options = ClusterOptions { client, request_timeout, ..defaults };
        let inner = py.detach(|| crate::client::block_on(petrel_client::Cluster::connect(&addrs, options)));
        Ok(Cluster { inner: inner.map_err(client_error)?, addrs })
    }

    /// The servers' addresses, in the order given.
    #[getter]
    fn servers(&self) -> Vec<String> {
        self.addrs.clone()
    }

    /// Which servers are up and the cluster's own counts: a dict with `servers` (a list of dicts:
    /// `address`, `up`, `failures`, `last_error`, and `unserved`: the functions this client
    /// serves that the server refused to serve, each with its answer), `offers_retried` (offers sent again after
    /// their answer was lost) and `copies_dropped` (deliveries dropped as copies of a message
    /// already delivered from another server).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let stats = self.inner.stats();
        let servers = stats
            .servers
            .into_iter()
            .map(|s| {
                let d = PyDict::new(py);
                d.set_item("address", s.addr)?;
                d.set_item("up", s.up)?;
                d.set_item("failures", s.failures)?;
                d.set_item("last_error", s.last_error)?;
                d.set_item("unserved", s.unserved.into_iter().collect::<std::collections::HashMap<_, _>>())?;
                Ok(d)
            })
            .collect::<PyResult<Vec<_>>>()?;
        let d = PyDict::new(py);
        d.set_item("servers", servers)?;
        d.set_item("offers_retried", stats.offers_retried)?;
        d.set_item("copies_dropped", stats.copies_dropped)?;
        Ok(d)
    }

    /// Creates the queue on every server (settings as `Client.create_queue`).
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
        self.wait(py, self.inner.create_queue(name, config))
    }

    /// Removes the queue from every server.
    fn remove_queue(&self, py: Python<'_>, name: &str) -> PyResult<()> {
        self.wait(py, self.inner.remove_queue(name))
    }

    /// The queues of the servers that are up, each name once.
    fn list_queues(&self, py: Python<'_>) -> PyResult<Vec<String>> {
        self.wait(py, self.inner.list_queues())
    }

    /// Offers a message to the next server in turn (one that fails before answering passes it to
    /// the next; a full queue too) or, with `route` (str or bytes), to the server that `route`
    /// ranks first among those up, so one route's messages stay in order on one server. Returns
    /// `(server address, id)`. `priority`, `key` (an idempotency key: a retry is not stored
    /// twice), `delay` and `deliver_at` as for `Client.offer`.
    #[pyo3(signature = (queue, payload, timeout = None, *, route = None, priority = 0, key = None, delay = None, deliver_at = None))]
    #[allow(clippy::too_many_arguments)]
    fn offer(
        &self,
        py: Python<'_>,
        queue: &str,
        payload: PyBackedBytes,
        timeout: Option<f64>,
        route: Option<Route>,
        priority: i64,
        key: Option<String>,
        delay: Option<f64>,
        deliver_at: Option<f64>,
    ) -> PyResult<(String, u64)> {
        let message = offered(payload, priority, key, delay, deliver_at)?;
        self.offer_messages(py, queue, vec![message], timeout, route)
    }

    /// Offers messages together (all or none, to one server); returns `(server address, first
    /// id)`.
    #[pyo3(signature = (queue, payloads, timeout = None, *, route = None))]
    fn offer_many(
        &self,
        py: Python<'_>,
        queue: &str,
        payloads: Vec<PyBackedBytes>,
        timeout: Option<f64>,
        route: Option<Route>,
    ) -> PyResult<(String, u64)> {
        let messages = messages_of(payloads)?;
        self.offer_messages(py, queue, messages, timeout, route)
    }

    /// Takes the message at the head of any server's queue for good, waiting up to `timeout`
    /// seconds (`None`: until one comes); `None` if none came.
    #[pyo3(signature = (queue, timeout = 0.0))]
    fn poll(&self, py: Python<'_>, queue: &str, timeout: Option<f64>) -> PyResult<Option<Message>> {
        Ok(self.poll_many(py, queue, 1, timeout, None)?.into_iter().next())
    }

    /// Takes up to `max` messages from the servers; with `visibility` (seconds) tentatively, each
    /// with a `ClusterHandle` for `ack` or `abort`.
    #[pyo3(signature = (queue, max = 100, timeout = 0.0, visibility = None))]
    fn poll_many(
        &self,
        py: Python<'_>,
        queue: &str,
        max: u32,
        timeout: Option<f64>,
        visibility: Option<f64>,
    ) -> PyResult<Vec<Message>> {
        // For good: taken tentatively (a signal may end the wait: what it takes then comes back
        // after its visibility, not lost), then acknowledged with no signal cutting that short
        // (a cut acknowledgement lost its messages: acknowledged, never returned), for 10 s at
        // most (a server that does not answer gets its messages back after their visibility).
        let delivered = poll_in_waits(py, timeout, |wait| {
            let options = poll_options(max, wait, visibility);
            match visibility {
                Some(_) => self.wait(py, self.inner.poll(queue, options)),
                None => self.wait(py, self.inner.poll_for_good_unacknowledged(queue, options)),
            }
        })?;
        if visibility.is_none() && !delivered.is_empty() {
            let handles: Vec<_> = delivered.iter().map(|d| d.handle).collect();
            let acked = petrel_client::answer_within(ACK_WAIT, "the cluster", self.inner.ack(queue, &handles));
            // (Not acknowledged: back to its queue later, at least once, as the cluster's own
            // poll for good.)
            let _ = py.detach(|| crate::client::block_on(acked));
        }
        delivered
            .into_iter()
            .map(|d| {
                let handle = if visibility.is_some() {
                    let server = self.addrs[d.handle.server].clone();
                    Py::new(py, ClusterHandle { inner: d.handle, server })?.into_any()
                } else {
                    0u64.into_py_any(py)?
                };
                Ok(Message::with_handle(py, handle, d.message))
            })
            .collect()
    }

    /// Takes one message tentatively (see `Client.take`); its handle is a `ClusterHandle`.
    #[pyo3(signature = (queue, visibility = 30.0, timeout = 0.0))]
    fn take(&self, py: Python<'_>, queue: &str, visibility: f64, timeout: Option<f64>) -> PyResult<Option<Message>> {
        Ok(self.poll_many(py, queue, 1, timeout, Some(visibility))?.into_iter().next())
    }

    /// Acknowledges tentative takes, each on its server; returns how many counted.
    fn ack(&self, py: Python<'_>, queue: &str, handles: Vec<PyRef<'_, ClusterHandle>>) -> PyResult<u32> {
        let handles = Cluster::handles(handles);
        self.wait(py, self.inner.ack(queue, &handles))
    }

    /// Puts tentative takes back on their servers (after `delay` seconds if given); returns how
    /// many counted.
    #[pyo3(signature = (queue, handles, delay = None))]
    fn abort(
        &self,
        py: Python<'_>,
        queue: &str,
        handles: Vec<PyRef<'_, ClusterHandle>>,
        delay: Option<f64>,
    ) -> PyResult<u32> {
        let (handles, delay) = (Cluster::handles(handles), Duration::from_millis(millis(delay, "delay")?));
        self.wait(py, self.inner.abort(queue, &handles, delay))
    }

    /// Creates the topic on every server.
    #[pyo3(signature = (name, durable = false))]
    fn create_topic(&self, py: Python<'_>, name: &str, durable: bool) -> PyResult<()> {
        self.wait(py, self.inner.create_topic(name, durable))
    }

    /// Removes the topic from every server.
    fn remove_topic(&self, py: Python<'_>, name: &str) -> PyResult<()> {
        self.wait(py, self.inner.remove_topic(name))
    }

    /// The topics of the servers that are up, each name once.
    fn list_topics(&self, py: Python<'_>) -> PyResult<Vec<String>> {
        self.wait(py, self.inner.list_topics())
    }

    /// Publishes to one server (the next in turn); every cluster subscriber is subscribed there.
    /// Returns how many subscribers that server reached.
    #[pyo3(signature = (topic, payload, subject = String::new()))]
    fn publish(&self, py: Python<'_>, topic: &str, payload: PyBackedBytes, subject: String) -> PyResult<u32> {
        self.wait(py, self.inner.publish(topic, vec![outgoing(payload, subject)]))
    }

    /// Subscribes to the topic on every server (and again on each that comes back after a
    /// loss); iterate the returned `ClusterSubscription`.
    #[pyo3(signature = (topic, buffer = 0))]
    fn subscribe(&self, py: Python<'_>, topic: &str, buffer: u32) -> PyResult<ClusterSubscription> {
        let sub = self.wait(py, self.inner.subscribe(topic, buffer))?;
        Ok(ClusterSubscription { stream: std::sync::Mutex::new(Some(sub)), addrs: None, acks: None })
    }

    /// Reads a durable topic as consumer group `group` on every server (each server's log and
    /// position are its own; `start` as for `Client.subscribe_group`, an offset being each
    /// server's). A message's `handle` is a `ClusterHandle`: acknowledge with
    /// `ClusterSubscription.ack`. A server that comes back after a loss is read from where the
    /// group stands there (what was not acknowledged comes again).
    #[pyo3(signature = (topic, group, start = None, *, time = None, max_unacked = 0))]
    fn subscribe_group(
        &self,
        py: Python<'_>,
        topic: &str,
        group: &str,
        start: Option<Bound<'_, PyAny>>,
        time: Option<u64>,
        max_unacked: u32,
    ) -> PyResult<ClusterSubscription> {
        let from = crate::subscription::start_from(start.as_ref(), time)?;
        let sub = self.wait(py, self.inner.subscribe_group(topic, group, from, max_unacked))?;
        let acks = Some(sub.acks());
        Ok(ClusterSubscription { stream: std::sync::Mutex::new(Some(sub)), addrs: Some(self.addrs.clone()), acks })
    }

    /// Calls `function` on the next server that serves it (see `Client.call`). A call whose
    /// answer was lost with its server is made again on another, so it may run twice.
    #[pyo3(signature = (function, payload, timeout = None, subject = String::new()))]
    fn call(
        &self,
        py: Python<'_>,
        function: &str,
        payload: PyBackedBytes,
        timeout: Option<f64>,
        subject: String,
    ) -> PyResult<Message> {
        let message = outgoing(payload, subject);
        let reply = self.wait(py, self.inner.call(function, message, crate::request_timeout_from(timeout)))?;
        Ok(Message::new(py, 0, reply))
    }

    /// Calls `function` without waiting for its reply.
    #[pyo3(signature = (function, payload, subject = String::new()))]
    fn call_oneway(&self, py: Python<'_>, function: &str, payload: PyBackedBytes, subject: String) -> PyResult<()> {
        self.wait(py, self.inner.call_oneway(function, outgoing(payload, subject)))
    }

    /// Serves `function` with `handler` (as `Client.serve`) on every server, and again on each
    /// that comes back after a loss.
    fn serve(&self, py: Python<'_>, function: &str, handler: Py<PyAny>) -> PyResult<()> {
        if !handler.bind(py).is_callable() {
            return Err(pyo3::exceptions::PyTypeError::new_err("the handler must be callable"));
        }
        let handler = Arc::new(handler);
        let serving =
            self.inner.serve(function, move |request| crate::functions::run_handler(Arc::clone(&handler), request));
        // Before the wait: interrupted, it may serve on some servers already.
        crate::client::stop_at_exit(Stoppable::Cluster(self.inner.clone()));
        self.wait(py, serving)
    }

    /// Stops serving `function` on every server, and on those that come back (calls already
    /// running still reply), as `Client.unserve`.
    fn unserve(&self, py: Python<'_>, function: &str) -> PyResult<()> {
        self.wait(py, self.inner.unserve(function))
    }

    /// Ends every connection and the background work; tentative takes not acknowledged go back
    /// to their queues (those kept for later polls, never seen, as never handed out).
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let gave_back = match self.inner.is_closed() {
            true => Ok(()),
            false => self.wait(py, async {
                self.inner.give_back_kept().await;
                Ok::<(), petrel_client::ClientError>(())
            }),
        };
        // Closed whatever: a signal that cut the give-back short does not keep the connections.
        self.inner.close();
        gave_back
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __exit__(&self, py: Python<'_>, _kind: Py<PyAny>, _value: Py<PyAny>, _traceback: Py<PyAny>) -> PyResult<bool> {
        self.close(py)?;
        Ok(false)
    }

    fn __repr__(&self) -> String {
        format!("Cluster({})", self.addrs.join(","))
    }
}

impl Cluster {
    fn offer_messages(
        &self,
        py: Python<'_>,
        queue: &str,
        messages: Vec<petrel_client::Message>,
        timeout: Option<f64>,
        route: Option<Route>,
    ) -> PyResult<(String, u64)> {
        let timeout = crate::request_timeout_from(timeout);
        let offered = match route {
            Some(route) => self.wait(py, self.inner.offer_by_key(route.as_bytes(), queue, messages, timeout))?,
            None => self.wait(py, self.inner.offer(queue, messages, timeout))?,
        };
        Ok((self.addrs[offered.server].clone(), offered.first_id))
    }
}

/// A routing key from Python: its UTF-8 bytes, or bytes as they are.
#[derive(FromPyObject)]
enum Route {
    Text(String),
    Bytes(Vec<u8>),
}

impl Route {
    fn as_bytes(&self) -> &[u8] {
        match self {
            Route::Text(s) => s.as_bytes(),
            Route::Bytes(b) => b,
        }
    }
}

/// A topic subscription on every server of a cluster, for blocking code: `for message in
/// subscription`, or `get(timeout)`. Ends with `unsubscribe()` (or `with`).
#[pyclass(module = "petrel", frozen)]
pub struct ClusterSubscription {
    /// `None` once it ended. Locked by the reader for the whole of a wait.
    stream: std::sync::Mutex<Option<petrel_client::ClusterSubscription>>,
    /// A consumer group's: the servers' addresses, for its messages' handles.
    addrs: Option<Vec<String>>,
    /// What acknowledges its messages (apart from the stream, which a reader may hold).
    acks: Option<petrel_client::ClusterAcks>,
}

impl ClusterSubscription {
    fn next_within(&self, py: Python<'_>, wait: Duration) -> Next<petrel_client::ClusterDelivery> {
        py.detach(|| {
            let mut stream = self.stream.lock().unwrap_or_else(|e| e.into_inner());
            let Some(sub) = stream.as_mut() else { return Next::Ended };
            match crate::client::block_on(async { tokio::time::timeout(wait, sub.next_delivery()).await }) {
                Err(_elapsed) => Next::TimedOut,
                Ok(Some(Ok(d))) => Next::Message(d),
                // One server's part said something: it fell behind (messages missed there; it
                // is followed again at once), or it ended (the topic was removed there, or the
                // user's right to it): raised, as the Rust subscription yields it; the others
                // go on, and the next `get` reads on. (A lost connection says nothing: it is
                // followed again when it comes back.)
                Ok(Some(Err(e))) => Next::Failed(e),
                Ok(None) => {
                    drop_in_runtime(stream.take());
                    Next::Ended
                }
            }
        })
    }

    fn end(&self, py: Python<'_>) {
        py.detach(|| drop_in_runtime(self.stream.lock().unwrap_or_else(|e| e.into_inner()).take()));
    }
}

/// Drops a subscription inside the runtime (its tasks are aborted there).
fn drop_in_runtime(sub: Option<petrel_client::ClusterSubscription>) {
    let _entered = runtime().enter();
    drop(sub);
}

#[pymethods]
impl ClusterSubscription {
    /// The next message from any server, waiting up to `timeout` seconds (`None`: until one
    /// comes); `None` if none came in time or the subscription is over.
    #[pyo3(signature = (timeout = None))]
    fn get(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Option<Message>> {
        wait_for_next(
            py,
            timeout,
            |wait| self.next_within(py, wait),
            |d| match &self.addrs {
                Some(addrs) => {
                    let handle = ClusterHandle { inner: d.handle, server: addrs[d.handle.server].clone() };
                    Ok(Message::with_handle(py, Py::new(py, handle)?.into_any(), d.message))
                }
                None => Ok(Message::new(py, 0, d.message)),
            },
        )
    }

    /// Acknowledges a consumer group's messages by handle, each on its server; returns how many
    /// counted (those delivered on a connection since lost do not: they come again).
    fn ack(&self, py: Python<'_>, handles: Vec<PyRef<'_, ClusterHandle>>) -> PyResult<u32> {
        let handles = Cluster::handles(handles);
        let Some(acks) = &self.acks else { return Ok(0) };
        py.detach(|| crate::client::block_on(acks.ack(&handles))).map_err(client_error)
    }

    /// Whether messages may still come.
    #[getter]
    fn active(&self) -> bool {
        self.stream.try_lock().map_or(true, |s| s.is_some())
    }

    /// Ends the subscription on every server.
    fn unsubscribe(&self, py: Python<'_>) {
        self.end(py);
    }

    fn __iter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __next__(&self, py: Python<'_>) -> PyResult<Option<Message>> {
        self.get(py, None)
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __exit__(&self, py: Python<'_>, _kind: Py<PyAny>, _value: Py<PyAny>, _traceback: Py<PyAny>) -> bool {
        self.end(py);
        false
    }
}

impl Drop for ClusterSubscription {
    fn drop(&mut self) {
        drop_in_runtime(self.stream.get_mut().unwrap_or_else(|e| e.into_inner()).take());
    }
}
