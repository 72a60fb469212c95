//! How the asyncio client learns that a request finished, without a native thread touching
//! Python: each request runs as a task on the shared tokio runtime and, when it ends, leaves its
//! outcome in a queue and (if the queue was empty) one byte on a socket pair. The event loop
//! watches the socket (`loop.add_reader`) and, on its own thread with the GIL it already holds,
//! drains the queue, turns each outcome into a Python value and resolves the request's future.
//!
//! Handing each result to the loop from a runtime thread (`call_soon_threadsafe`) needs the GIL
//! there, which the busy loop thread gives up only at its switch interval: measured at ~8,000
//! offers/s with 100 in flight. One wake-up per batch of outcomes and no GIL off the loop thread
//! is the fix; it also means no native thread is inside Python when the interpreter exits.

use std::collections::{HashMap, HashSet};
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use pyo3::IntoPyObjectExt;
use pyo3::prelude::*;

use crate::client::runtime;

/// What a request ended with, made into a Python value on the loop's thread. One dropped
/// unconverted (its request was cancelled as it ended) drops what it holds: a poll's messages
/// are given back then (`client::Taken`).
pub(crate) type Outcome = Box<dyn FnOnce(Python<'_>) -> PyResult<Py<PyAny>> + Send>;

/// The outcome of a request whose value `convert` makes on the loop's thread.
pub(crate) fn outcome_with(convert: impl FnOnce(Python<'_>) -> PyResult<Py<PyAny>> + Send + 'static) -> Outcome {
    Box::new(convert)
}

/// The outcome of a request whose value converts as it is.
pub(crate) fn outcome<T>(result: PyResult<T>) -> Outcome
where
    T: for<'py> IntoPyObject<'py> + Send + 'static,
{
    Box::new(move |py| result.and_then(|value| value.into_py_any(py)))
}

pub(crate) struct Inner {
    /// Outcomes not yet taken by the loop, with their request's token.
    done: Mutex<Vec<(u64, Outcome)>>,
    /// Requests still running, to abort one whose awaiting coroutine was cancelled.
    running: Mutex<HashMap<u64, tokio::task::AbortHandle>>,
    /// Requests cancelled whose outcome may still come (an abort lands only at the task's next
    /// await; or it ended and is not drained yet): that outcome is dropped, not handed over. An
    /// entry goes with its outcome, or when its task ends without one (`Forget`).
    cancelled: Mutex<HashSet<u64>>,
    /// A byte is (or will be) on `wake` for the outcomes in `done`.
    signalled: AtomicBool,
    wake: UnixStream,
    woken: UnixStream,
}

impl Inner {
    /// Runs `request` on the runtime; its outcome goes to the loop under `token`.
    pub(crate) fn spawn(self: &Arc<Self>, token: u64, request: impl Future<Output = Outcome> + Send + 'static) {
        let inner = Arc::clone(self);
        // Under the lock, so that a request ending at once removes its entry after it is made.
        let mut running = self.running.lock().unwrap_or_else(|e| e.into_inner());
        // Made outside the task, so that it drops with a task aborted before it first ran.
        let mut forget = Forget { inner: Arc::clone(&inner), token, armed: true };
        let task = runtime().spawn(async move {
            let outcome = request.await;
            // From here `complete`, or `drain` after it, owns a cancellation's entry.
            forget.armed = false;
            inner.running.lock().unwrap_or_else(|e| e.into_inner()).remove(&token);
            inner.complete(token, outcome);
            drop(forget);
        });
        running.insert(token, task.abort_handle());
    }

    fn complete(&self, token: u64, outcome: Outcome) {
        if self.cancelled.lock().unwrap_or_else(|e| e.into_inner()).remove(&token) {
            drop(outcome); // no coroutine awaits it
            return;
        }
        self.done.lock().unwrap_or_else(|e| e.into_inner()).push((token, outcome));
        if !self.signalled.swap(true, Ordering::SeqCst) {
            // The socket is non-blocking: a full buffer already holds a wake-up.
            let _ = (&self.wake).write(&[1]);
        }
    }
}

/// Takes a request's token out of the cancelled ones when its task ends without an outcome
/// (aborted, its future dropped, whether it ran or not); disarmed once the outcome exists.
struct Forget {
    inner: Arc<Inner>,
    token: u64,
    armed: bool,
}

impl Drop for Forget {
    fn drop(&mut self) {
        if self.armed {
            self.inner.cancelled.lock().unwrap_or_else(|e| e.into_inner()).remove(&self.token);
        }
    }
}

/// The queue of finished requests of one `AsyncClient`, and the socket that says it has some.
#[pyclass(module = "petrel", frozen)]
pub struct Completions {
    pub(crate) inner: Arc<Inner>,
}

#[pymethods]
impl Completions {
    #[new]
    fn new() -> PyResult<Completions> {
        let (wake, woken) = UnixStream::pair()?;
        wake.set_nonblocking(true)?;
        woken.set_nonblocking(true)?;
        let inner = Inner {
            done: Mutex::new(Vec::new()),
            running: Mutex::new(HashMap::new()),
            cancelled: Mutex::new(HashSet::new()),
            signalled: AtomicBool::new(false),
            wake,
            woken,
        };
        Ok(Completions { inner: Arc::new(inner) })
    }

    /// The descriptor the event loop watches for reading.
    fn fileno(&self) -> i32 {
        self.inner.woken.as_raw_fd()
    }

    /// The finished requests: (token, succeeded, value or exception).
    fn drain(&self, py: Python<'_>) -> Vec<(u64, bool, Py<PyAny>)> {
        // The wake-up bytes are read first, then the flag is cleared, then the queue taken: an
        // outcome whose producer found the flag set is in the queue by the time it is taken, and
        // one added later finds the flag clear and writes a byte for the next drain. (Clearing
        // before reading could eat that byte and leave the flag set with nobody to wake.)
        let mut sink = [0u8; 64];
        while matches!((&self.inner.woken).read(&mut sink), Ok(n) if n > 0) {}
        self.inner.signalled.store(false, Ordering::SeqCst);
        let done = std::mem::take(&mut *self.inner.done.lock().unwrap_or_else(|e| e.into_inner()));
        done.into_iter()
            // Cancelled after it ended: no coroutine awaits it (dropped).
            .filter(|(token, _)| !self.inner.cancelled.lock().unwrap_or_else(|e| e.into_inner()).remove(token))
            .map(|(token, outcome)| match outcome(py) {
                Ok(value) => (token, true, value),
                Err(e) => (token, false, e.into_value(py).into_any()),
            })
            .collect()
    }

    /// Aborts request `token`, whose coroutine was cancelled before its outcome was drained:
    /// its outcome never comes. One that ends all the same (past its last wait already, or
    /// ended and not drained yet) is dropped, which gives back what it took.
    fn cancel(&self, token: u64) {
        let mut running = self.inner.running.lock().unwrap_or_else(|e| e.into_inner());
        self.inner.cancelled.lock().unwrap_or_else(|e| e.into_inner()).insert(token);
        if let Some(task) = running.remove(&token) {
            task.abort();
        }
    }
}
