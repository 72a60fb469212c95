//! Topic subscriptions, live or as a durable topic's consumer group: `Subscription` for blocking
//! code (an iterator; `get(timeout)`) and `AsyncSubscriptionCore` for asyncio (wrapped by
//! `petrel.AsyncSubscription`). Acknowledgements and unsubscribing go by the subscription's id
//! through the client, so one thread may ack or end a subscription another is reading.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use petrel_client::StartFrom;
use pyo3::IntoPyObjectExt;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::client::{LONG_POLL, Message, client_error, runtime};
use crate::completions::{Inner, outcome, outcome_with};

/// Where a group subscription starts: `None` (where the group stands), `"oldest"`, `"newest"`,
/// an offset (a message's id is its offset + 1), or `time=NS` (the first message published at
/// or after it).
pub(crate) fn start_from(start: Option<&Bound<'_, PyAny>>, time: Option<u64>) -> PyResult<StartFrom> {
    Ok(match (start, time) {
        (None, None) => StartFrom::Resume,
        (None, Some(t)) => StartFrom::Time(t),
        (Some(start), None) => {
            if start.is_instance_of::<pyo3::types::PyInt>() {
                // (An int that is no offset, negative or too large: its own OverflowError.)
                StartFrom::Offset(start.extract::<u64>()?)
            } else {
                match start.extract::<String>()?.as_str() {
                    "resume" => StartFrom::Resume,
                    "oldest" => StartFrom::Oldest,
                    "newest" => StartFrom::Newest,
                    other => {
                        return Err(PyValueError::new_err(format!(
                            "start at {other:?}: \"resume\", \"oldest\", \"newest\" or an offset"
                        )));
                    }
                }
            }
        }
        (Some(_), Some(_)) => return Err(PyValueError::new_err("start takes a position or time=NS, not both")),
    })
}

/// Drops a subscription inside the runtime, so that its `Drop` can send the unsubscribe (a
/// subscription dropped by Python's garbage collector is on a thread without one).
fn drop_in_runtime(sub: petrel_client::Subscription) {
    let _entered = runtime().enter();
    drop(sub);
}

/// A topic subscription for blocking code: `for message in subscription`, or `get(timeout)`.
/// Messages are pushed by the server and wait in a bounded buffer until read. Ends with
/// `unsubscribe()` (or `with`), the connection's end, or the server ending it (a consumer too
/// slow for a live topic: iteration then raises `ServerError` naming `SLOW_CONSUMER`).
#[pyclass(module = "petrel", frozen)]
pub struct Subscription {
    /// The server's number for it.
    #[pyo3(get)]
    id: u64,
    client: petrel_client::Client,
    /// `None` once it ended. Locked by the reader for the whole of a wait.
    stream: std::sync::Mutex<Option<petrel_client::Subscription>>,
}

/// What one wait for a subscription's next message (`T`) ended with.
pub(crate) enum Next<T = Box<petrel_client::Message>> {
    Message(T),
    TimedOut,
    Ended,
    Failed(petrel_client::ClientError),
}

/// Waits up to `timeout` seconds (`None`: until one comes) for the next message, in waits of at
/// most `LONG_POLL` by `next_within`, Python's signals looked at between them; `None` if none
/// came in time or the subscription ended.
pub(crate) fn wait_for_next<T>(
    py: Python<'_>,
    timeout: Option<f64>,
    next_within: impl Fn(Duration) -> Next<T>,
    message: impl FnOnce(T) -> PyResult<Message>,
) -> PyResult<Option<Message>> {
    let deadline = crate::timeout_from(timeout).map(|t| Instant::now() + t);
    loop {
        let wait = deadline.map_or(LONG_POLL, |d| d.saturating_duration_since(Instant::now()).min(LONG_POLL));
        match next_within(wait) {
            Next::Message(m) => return message(m).map(Some),
            Next::Failed(e) => return Err(client_error(e)),
            Next::Ended => return Ok(None),
            Next::TimedOut if deadline.is_some_and(|d| Instant::now() >= d) => return Ok(None),
            Next::TimedOut => py.check_signals()?,
        }
    }
}

impl Subscription {
    pub(crate) fn new(client: petrel_client::Client, sub: petrel_client::Subscription) -> Subscription {
        Subscription { id: sub.id, client, stream: std::sync::Mutex::new(Some(sub)) }
    }

    /// The next message, waiting at most `wait` (with the GIL released).
    fn next_within(&self, py: Python<'_>, wait: Duration) -> Next {
        py.detach(|| {
            let mut stream = self.stream.lock().unwrap_or_else(|e| e.into_inner());
            let Some(sub) = stream.as_mut() else { return Next::Ended };
            let next = match crate::client::block_on(async { tokio::time::timeout(wait, sub.next()).await }) {
                Err(_elapsed) => return Next::TimedOut,
                Ok(Some(Ok(m))) => return Next::Message(Box::new(m)),
                Ok(Some(Err(e))) => Next::Failed(e),
                Ok(None) => Next::Ended,
            };
            if let Some(sub) = stream.take() {
                drop_in_runtime(sub);
            }
            next
        })
    }
}

#[pymethods]
impl Subscription {
    /// The next message, waiting up to `timeout` seconds (`None`: until one comes); `None` if
    /// none came in time or the subscription is over (see `active`).
    #[pyo3(signature = (timeout = None))]
    fn get(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Option<Message>> {
        wait_for_next(py, timeout, |wait| self.next_within(py, wait), |m| Ok(Message::new(py, 0, *m)))
    }

    /// Whether messages may still come.
    #[getter]
    fn active(&self) -> bool {
        self.stream.try_lock().map_or(true, |s| s.is_some())
    }

    /// Acknowledges messages of a group subscription by id (`Message.id`); returns how many
    /// counted. The group's position moves past them once everything before is acknowledged.
    fn ack(&self, py: Python<'_>, ids: Vec<u64>) -> PyResult<u32> {
        // (Ctrl-C interrupts it, as any call waiting for a server that does not answer.)
        crate::client::wait_with_signals(py, self.client.ack_subscription(self.id, &ids))
    }

    /// Ends the subscription; a reader waiting in another thread gets `None` (or the end of its
    /// loop). Unacknowledged messages of a group come again to its next subscriber.
    fn unsubscribe(&self, py: Python<'_>) -> PyResult<()> {
        let unsubscribed = async {
            match self.client.unsubscribe(self.id).await {
                Err(e) if e.is_connection_lost() => Ok(()),
                other => other,
            }
        };
        crate::client::wait_with_signals(py, unsubscribed)
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

    fn __exit__(&self, py: Python<'_>, _kind: Py<PyAny>, _value: Py<PyAny>, _traceback: Py<PyAny>) -> PyResult<bool> {
        self.unsubscribe(py)?;
        Ok(false)
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        if let Some(sub) = self.stream.get_mut().unwrap_or_else(|e| e.into_inner()).take() {
            drop_in_runtime(sub);
        }
    }
}

/// The asyncio side of a subscription; its requests complete through the client's
/// `Completions`. Use `petrel.AsyncSubscription`, which wraps it.
#[pyclass(module = "petrel", frozen)]
pub struct AsyncSubscriptionCore {
    #[pyo3(get)]
    id: u64,
    client: petrel_client::Client,
    stream: Arc<tokio::sync::Mutex<Option<petrel_client::Subscription>>>,
    /// Messages a `next` received for a coroutine cancelled before it could take them (its
    /// outcome dropped unconverted): the next `next` returns them first, oldest first.
    kept: Arc<Mutex<VecDeque<petrel_client::Message>>>,
    completions: Arc<Inner>,
}

/// A received message on its way to Python: put back in `kept` if its outcome is dropped. It
/// holds the stream until then, so that the next `next` looks at `kept` only once this message is
/// taken or in it: let go as the task ended, a next read could take the message after it first.
struct Receiving {
    message: Option<petrel_client::Message>,
    kept: Arc<Mutex<VecDeque<petrel_client::Message>>>,
    stream: Option<tokio::sync::OwnedMutexGuard<Option<petrel_client::Subscription>>>,
}

impl Drop for Receiving {
    fn drop(&mut self) {
        if let Some(m) = self.message.take() {
            self.kept.lock().unwrap_or_else(|e| e.into_inner()).push_front(m);
        }
        // On the runtime (this may run on the event loop's thread): if the subscription's core
        // was dropped meanwhile, this guard holds the stream's last reference, and the
        // subscription it drops unsubscribes only from within a runtime.
        let _entered = runtime().enter();
        drop(self.stream.take());
    }
}

impl AsyncSubscriptionCore {
    pub(crate) fn new(
        client: petrel_client::Client,
        sub: petrel_client::Subscription,
        completions: Arc<Inner>,
    ) -> AsyncSubscriptionCore {
        let sub_id = sub.id;
        let stream = Arc::new(tokio::sync::Mutex::new(Some(sub)));
        AsyncSubscriptionCore { id: sub_id, client, stream, kept: Arc::default(), completions }
    }
}

#[pymethods]
impl AsyncSubscriptionCore {
    /// The outcome is the next message, or `None` after `timeout` seconds (`None`: no limit) or
    /// once the subscription ended. Timed here rather than by cancelling, so that a message
    /// arriving as the time runs out is never dropped; one received for a coroutine cancelled
    /// meanwhile is kept for the next.
    #[pyo3(signature = (token, timeout = None))]
    fn next(&self, token: u64, timeout: Option<f64>) {
        let (stream, kept) = (Arc::clone(&self.stream), Arc::clone(&self.kept));
        let timeout = crate::timeout_from(timeout);
        type Stream = tokio::sync::OwnedMutexGuard<Option<petrel_client::Subscription>>;
        let deliver =
            move |m: petrel_client::Message, kept: Arc<Mutex<VecDeque<petrel_client::Message>>>, stream: Stream| {
                let mut receiving = Receiving { message: Some(m), kept, stream: Some(stream) };
                outcome_with(move |py| {
                    let m = receiving.message.take().expect("converted once");
                    Message::new(py, 0, m).into_py_any(py)
                })
            };
        self.completions.spawn(token, async move {
            let mut stream = stream.lock_owned().await;
            let earlier = kept.lock().unwrap_or_else(|e| e.into_inner()).pop_front();
            if let Some(m) = earlier {
                return deliver(m, kept, stream);
            }
            let Some(sub) = stream.as_mut() else { return outcome(Ok(None::<()>)) };
            let next = match timeout {
                Some(t) => match tokio::time::timeout(t, sub.next()).await {
                    Ok(next) => next,
                    Err(_elapsed) => return outcome(Ok(None::<()>)),
                },
                None => sub.next().await,
            };
            match next {
                Some(Ok(m)) => deliver(m, kept, stream),
                Some(Err(e)) => {
                    stream.take();
                    outcome::<()>(Err(client_error(e)))
                }
                None => {
                    stream.take();
                    outcome(Ok(None::<()>))
                }
            }
        });
    }

    fn ack(&self, token: u64, ids: Vec<u64>) {
        let (client, id) = (self.client.clone(), self.id);
        self.completions
            .spawn(token, async move { outcome(client.ack_subscription(id, &ids).await.map_err(client_error)) });
    }

    fn unsubscribe(&self, token: u64) {
        let (client, id) = (self.client.clone(), self.id);
        self.completions.spawn(token, async move {
            outcome(match client.unsubscribe(id).await {
                Ok(()) => Ok(()),
                Err(e) if e.is_connection_lost() => Ok(()),
                Err(e) => Err(client_error(e)),
            })
        });
    }
}

impl Drop for AsyncSubscriptionCore {
    fn drop(&mut self) {
        // A `next` still pending, or its outcome not yet taken (`Receiving`), holds the stream
        // and drops it on the runtime when it ends.
        if let Ok(mut stream) = self.stream.try_lock()
            && let Some(sub) = stream.take()
        {
            drop_in_runtime(sub);
        }
    }
}
