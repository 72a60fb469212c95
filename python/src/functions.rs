//! Serving a function (request/reply) with Python code. The blocking client runs the handler, a
//! plain callable, on the runtime's blocking threads (a slow handler holds one thread, not the
//! connection). The asyncio client gets the calls as a stream of `IncomingCall`s
//! (`AsyncCalls.next`, completing through `Completions`), which `petrel.AsyncClient.serve` hands
//! to the handler on the event loop and answers with `reply`/`fail`; so a handler may be a
//! coroutine function there.

use std::sync::Arc;

use pyo3::IntoPyObjectExt;
use pyo3::prelude::*;
use pyo3::pybacked::PyBackedBytes;
use tokio::sync::{mpsc, oneshot};

use crate::client::{Message, runtime};
use crate::completions::{Inner, outcome, outcome_with};

/// What a handler's answer becomes: its bytes as the reply's payload (`None`: an empty reply),
/// or the handler error the caller gets.
pub(crate) type Reply = Result<petrel_client::Message, String>;

/// A handler's return value as a reply: bytes-like or `None`.
fn reply_from(value: &Bound<'_, PyAny>) -> Reply {
    if value.is_none() {
        return Ok(petrel_client::Message::default());
    }
    match value.extract::<PyBackedBytes>() {
        Ok(payload) => Ok(crate::client::message_of(payload)),
        Err(_) => Err(format!(
            "the handler returned {}, not bytes",
            value.get_type().name().map_or_else(|_| "an object".to_owned(), |n| n.to_string())
        )),
    }
}

/// Runs the blocking client's `handler` for one call on a blocking thread: its return value is
/// the reply, an exception it raised is the caller's `HANDLER_ERROR` ("ValueError: ...").
pub(crate) async fn run_handler(handler: Arc<Py<PyAny>>, request: petrel_client::Message) -> Reply {
    let ran = tokio::task::spawn_blocking(move || {
        Python::attach(|py| {
            let message = Message::new(py, 0, request);
            match handler.call1(py, (message,)) {
                Ok(value) => reply_from(value.bind(py)),
                Err(e) => Err(e.to_string()),
            }
        })
    })
    .await;
    ran.unwrap_or_else(|e| Err(format!("the handler did not finish: {e}")))
}

/// Calls of a function served from asyncio wait here until the event loop takes them; the Rust
/// client lets at most its own bound of calls wait for their replies at once.
pub(crate) const ASYNC_CALLS_BUFFER: usize = 1024;

/// Most calls one `AsyncCalls.next` takes.
const CALLS_PER_TAKE: usize = 256;

/// A call waiting for its reply; `None` once the reply is sent.
type Replier = std::sync::Mutex<Option<oneshot::Sender<Reply>>>;

/// A call as it waits for the event loop: the request, and where its reply goes.
type QueuedCall = (petrel_client::Message, oneshot::Sender<Reply>);

/// A call of a function served from asyncio: `message` is the request; answer it once with
/// `reply(payload)` or `fail(error)`. One dropped unanswered fails the call.
#[pyclass(module = "petrel", frozen)]
pub struct IncomingCall {
    #[pyo3(get)]
    message: Py<Message>,
    replier: Replier,
}

impl IncomingCall {
    fn answer(&self, reply: Reply) -> bool {
        let sender = self.replier.lock().unwrap_or_else(|e| e.into_inner()).take();
        sender.is_some_and(|s| s.send(reply).is_ok())
    }
}

#[pymethods]
impl IncomingCall {
    /// Replies with `payload` (bytes-like or `None`); returns False if it was answered before
    /// or the caller no longer waits.
    fn reply(&self, payload: &Bound<'_, PyAny>) -> bool {
        self.answer(reply_from(payload))
    }

    /// Fails the call: the caller gets `HANDLER_ERROR` with `error`.
    fn fail(&self, error: String) -> bool {
        self.answer(Err(error))
    }
}

/// The stream of calls of one function served from asyncio.
#[pyclass(module = "petrel", frozen)]
pub struct AsyncCalls {
    calls: Arc<tokio::sync::Mutex<mpsc::Receiver<QueuedCall>>>,
    completions: Arc<Inner>,
}

/// A boxed handler future, as `petrel_client::Client::serve` takes it.
pub(crate) type HandlerFuture = std::pin::Pin<Box<dyn Future<Output = Reply> + Send>>;

/// A handler for `petrel_client::Client::serve` that queues each call for the event loop, and the
/// stream the loop takes them from.
pub(crate) fn async_calls(
    completions: Arc<Inner>,
) -> (impl Fn(petrel_client::Message) -> HandlerFuture + Send + Sync + 'static, AsyncCalls) {
    let (tx, rx) = mpsc::channel(ASYNC_CALLS_BUFFER);
    let handler = move |request: petrel_client::Message| {
        let tx = tx.clone();
        Box::pin(async move {
            let (replier, reply) = oneshot::channel();
            tx.send((request, replier)).await.map_err(|_| "the function is no longer served".to_owned())?;
            reply.await.unwrap_or_else(|_| Err("the handler gave no reply".to_owned()))
        }) as HandlerFuture
    };
    (handler, AsyncCalls { calls: Arc::new(tokio::sync::Mutex::new(rx)), completions })
}

#[pymethods]
impl AsyncCalls {
    /// The outcome is a list of the calls waiting (at least one, at most `CALLS_PER_TAKE`), or
    /// `None` once the function is no longer served. Taken together: one wake-up of the event
    /// loop for every call that arrived meanwhile.
    fn next(&self, token: u64) {
        let calls = Arc::clone(&self.calls);
        self.completions.spawn(token, async move {
            let mut calls = calls.lock().await;
            let Some(first) = calls.recv().await else { return outcome(Ok(None::<()>)) };
            let mut taken = vec![first];
            while taken.len() < CALLS_PER_TAKE
                && let Ok(call) = calls.try_recv()
            {
                taken.push(call);
            }
            outcome_with(move |py| {
                let incoming = taken
                    .into_iter()
                    .map(|(request, replier)| {
                        let message = Py::new(py, Message::new(py, 0, request))?;
                        Ok(IncomingCall { message, replier: std::sync::Mutex::new(Some(replier)) })
                    })
                    .collect::<PyResult<Vec<_>>>()?;
                incoming.into_py_any(py)
            })
        });
    }

    /// Stops taking calls: `next()` gives `None` once those already queued are taken.
    fn close(&self) {
        let calls = Arc::clone(&self.calls);
        runtime().spawn(async move { calls.lock().await.close() });
    }
}
