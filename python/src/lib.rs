//! The native half of the `petrel` Python package (`petrel._petrel`): the embedded log, its
//! consumer groups and a queue over `petrel-log` (`embedded.rs`), and a client for the server
//! over `petrel-client`, blocking and asyncio (`client.rs`) and of a cluster of servers
//! (`cluster.rs`), with its topic subscriptions
//! (`subscription.rs`) and functions served by Python code (`functions.rs`). The GIL is released around every
//! call that touches the disk or the network or waits. Waits for records wake every 100 ms and
//! the blocking client's polls every second to let Python handle signals (Ctrl-C); an offer
//! waiting for room in a full queue does not, for at most the timeout it was given.

#![forbid(unsafe_code)]

mod client;
mod cluster;
mod completions;
mod embedded;
mod functions;
mod subscription;

use std::time::Duration;

use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;

create_exception!(petrel, PetrelError, PyException, "Base class of Petrel's errors.");
create_exception!(petrel, CorruptLogError, PetrelError, "A log's files failed their checks.");
create_exception!(petrel, LockedError, PetrelError, "Another process has the log open.");
create_exception!(petrel, PoisonedError, PetrelError, "A sync to disk failed; the log takes no more writes.");
create_exception!(petrel, TooLargeError, PetrelError, "A record or message is larger than allowed.");
create_exception!(petrel, ClosedError, PetrelError, "The log, group, queue or client was closed.");
create_exception!(petrel, ServerError, PetrelError, "The server answered with an error status.");
create_exception!(petrel, ConnectionError, PetrelError, "The server could not be reached or went away.");

/// How long a blocking wait sleeps between looks at Python's signals.
pub(crate) const SIGNAL_CHECK: Duration = Duration::from_millis(100);

/// A timeout from Python: `None` waits for ever, a number is seconds (negative or NaN is zero;
/// infinity, or more than a century, is for ever too: a deadline that far cannot be computed).
pub(crate) fn timeout_from(seconds: Option<f64>) -> Option<Duration> {
    const FOR_EVER: f64 = 100.0 * 365.0 * 24.0 * 3600.0;
    match seconds {
        None => None,
        Some(s) if s > FOR_EVER => None,
        Some(s) if s > 0.0 => Some(Duration::from_secs_f64(s)),
        Some(_) => Some(Duration::ZERO),
    }
}

/// A request's own timeout from Python (an offer's wait for room, a call's deadline): `None`
/// is none (the server's default: no wait for an offer); infinity, or more than the wire's
/// 32-bit milliseconds, is the longest the wire carries (~49.7 days), not none.
pub(crate) fn request_timeout_from(seconds: Option<f64>) -> Option<Duration> {
    let longest = Duration::from_millis(u64::from(u32::MAX));
    seconds.map(|s| timeout_from(Some(s)).map_or(longest, |t| t.min(longest)))
}

#[pymodule]
fn _petrel(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("PetrelError", py.get_type::<PetrelError>())?;
    m.add("CorruptLogError", py.get_type::<CorruptLogError>())?;
    m.add("LockedError", py.get_type::<LockedError>())?;
    m.add("PoisonedError", py.get_type::<PoisonedError>())?;
    m.add("TooLargeError", py.get_type::<TooLargeError>())?;
    m.add("ClosedError", py.get_type::<ClosedError>())?;
    m.add("ServerError", py.get_type::<ServerError>())?;
    m.add("ConnectionError", py.get_type::<ConnectionError>())?;
    // A server's refusal is `ServerError(text, status name)` (`client::client_error`): it reads
    // as its text, and `status` is the name (None for one made with the text alone).
    let server_error = py.get_type::<ServerError>();
    let locals = pyo3::types::PyDict::new(py);
    locals.set_item("ServerError", &server_error)?;
    py.run(
        c"ServerError.status = property(lambda e: e.args[1] if len(e.args) > 1 else None, doc='The status name, as \"QUEUE_FULL\".')\nServerError.__str__ = lambda e: str(e.args[0]) if e.args else ''",
        None,
        Some(&locals),
    )?;
    embedded::register(m)?;
    client::register(m)?;
    cluster::register(m)?;
    Ok(())
}
