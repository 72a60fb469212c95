//! The embedded API: `Log` (append, read by offset, time or key, iterate), `Group` (a named
//! consumer group: poll, ack, nack, seek) and `Queue` (put/get, shaped like `queue.Queue`), over
//! `petrel-log` in this process.
//!
//! Each object keeps its Rust value behind a mutex, taken out by `close()`; a closed object
//! raises `ClosedError`. Records cross into Python as copies (`bytes`): the log's mapping may be
//! unmapped when its segment is retired, so no view into it outlives the call.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use petrel_log::{ConsumerGroup, Durability, GroupOptions, Input, Options, OwnedRecord, SeekTo, SharedLog};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::pybacked::PyBackedBytes;
use pyo3::types::PyBytes;

use crate::{ClosedError, CorruptLogError, LockedError, PetrelError, PoisonedError, TooLargeError};

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Log>()?;
    m.add_class::<Record>()?;
    m.add_class::<Group>()?;
    m.add_class::<LogIterator>()?;
    m.add_class::<Queue>()?;
    Ok(())
}

/// The Python exception for a storage error, with the Rust error's message.
pub(crate) fn log_error(e: petrel_log::Error) -> PyErr {
    use petrel_log::Error as E;
    let text = e.to_string();
    match e {
        E::Corrupt { .. } => CorruptLogError::new_err(text),
        E::Locked { .. } => LockedError::new_err(text),
        E::Poisoned(_) => PoisonedError::new_err(text),
        E::RecordTooLarge { .. } => TooLargeError::new_err(text),
        // A record the log cannot hold as given (a key too long).
        E::InvalidRecord(_) => TooLargeError::new_err(text),
        E::Config(_) => PyValueError::new_err(text),
        _ => PetrelError::new_err(text),
    }
}

fn durability_from(text: &str) -> PyResult<Durability> {
    text.parse::<Durability>().map_err(|e| {
        PyValueError::new_err(format!("durability {text:?}: {e} (\"none\", \"always\" or \"interval:MS\")"))
    })
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Runs `step` (which waits at most the slice it is given) until it returns something, the
/// timeout passes (`None`: never), or Python has a signal to raise; the GIL is released while
/// `step` runs.
fn wait_for<T: Send>(
    py: Python<'_>,
    timeout: Option<Duration>,
    mut step: impl FnMut(Duration) -> PyResult<Option<T>> + Send,
) -> PyResult<Option<T>> {
    let deadline = timeout.map(|t| Instant::now() + t);
    loop {
        let slice = match deadline {
            Some(d) => d.saturating_duration_since(Instant::now()).min(crate::SIGNAL_CHECK),
            None => crate::SIGNAL_CHECK,
        };
        if let Some(found) = py.detach(|| step(slice))? {
            return Ok(Some(found));
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return Ok(None);
        }
        py.check_signals()?;
    }
}

/// One record of a log: its offset, time (ns since the Unix epoch), key, headers and payload.
#[pyclass(module = "petrel", frozen, get_all)]
pub struct Record {
    /// Its place in the log: 0, 1, 2, … with no gaps.
    offset: u64,
    /// When it was appended: nanoseconds since the Unix epoch.
    timestamp: u64,
    /// The key it was appended with, if any.
    key: Option<Py<PyBytes>>,
    /// Its bytes, copied out of the log's mapping.
    payload: Py<PyBytes>,
    /// Its headers: (name, value) pairs.
    headers: Vec<(String, Py<PyBytes>)>,
}

impl Record {
    fn from_owned(py: Python<'_>, r: OwnedRecord) -> Record {
        Record {
            offset: r.offset,
            timestamp: r.timestamp,
            key: r.key.map(|k| PyBytes::new(py, &k).unbind()),
            payload: PyBytes::new(py, &r.payload).unbind(),
            headers: r.headers.into_iter().map(|(n, v)| (n, PyBytes::new(py, &v).unbind())).collect(),
        }
    }
}

#[pymethods]
impl Record {
    fn __repr__(&self, py: Python<'_>) -> String {
        let len = self.payload.bind(py).as_bytes().len();
        format!("Record(offset={}, timestamp={}, payload=<{len} bytes>)", self.offset, self.timestamp)
    }
}

fn records(py: Python<'_>, owned: Vec<OwnedRecord>) -> Vec<Record> {
    owned.into_iter().map(|r| Record::from_owned(py, r)).collect()
}

/// An append-only log in a directory: records with dense offsets from 0, crash-safe.
#[pyclass(module = "petrel", frozen)]
pub struct Log {
    log: Mutex<Option<SharedLog>>,
    path: PathBuf,
}

impl Log {
    fn shared(&self) -> PyResult<SharedLog> {
        lock(&self.log)
            .clone()
            .ok_or_else(|| ClosedError::new_err(format!("the log at {} is closed", self.path.display())))
    }
}

#[pymethods]
impl Log {
    #[new]
    #[pyo3(signature = (path, durability = "none", segment_bytes = None, key_index = false))]
    fn new(
        py: Python<'_>,
        path: PathBuf,
        durability: &str,
        segment_bytes: Option<u64>,
        key_index: bool,
    ) -> PyResult<Log> {
        let mut options = Options { durability: durability_from(durability)?, key_index, ..Options::default() };
        if let Some(bytes) = segment_bytes {
            options.segment_bytes = bytes;
        }
        let log = py.detach(|| petrel_log::Log::open(&path, options)).map_err(log_error)?;
        Ok(Log { log: Mutex::new(Some(log.into_shared())), path })
    }

    /// Appends a record; returns its offset. Durable as the log's durability says when this
    /// returns (`"always"`: on disk).
    #[pyo3(signature = (payload, key = None))]
    fn append(&self, py: Python<'_>, payload: &[u8], key: Option<&[u8]>) -> PyResult<u64> {
        let log = self.shared()?;
        let input = Input { key, headers: &[], payload, timestamp: None };
        py.detach(move || log.append_with(&input)).map_err(log_error)
    }

    /// Appends records together (one sync under `"always"`); returns their offsets.
    fn append_batch(&self, py: Python<'_>, payloads: Vec<PyBackedBytes>) -> PyResult<Vec<u64>> {
        let log = self.shared()?;
        let range = py.detach(move || log.append_batch(&payloads)).map_err(log_error)?;
        Ok(range.collect())
    }

    /// Makes every record appended so far durable.
    fn flush(&self, py: Python<'_>) -> PyResult<()> {
        let log = self.shared()?;
        py.detach(move || log.sync()).map_err(log_error)
    }

    /// The record at `offset`, or `None` if there is none (not yet appended, or removed).
    fn get(&self, py: Python<'_>, offset: u64) -> PyResult<Option<Record>> {
        let log = self.shared()?;
        let found = py.detach(|| log.reader().get(offset).map(|r| r.map(|r| r.to_owned()))).map_err(log_error)?;
        Ok(found.map(|r| Record::from_owned(py, r)))
    }

    /// The records at `offsets`, in their order (`None` for one not in the log): many random
    /// lookups at once, their memory misses overlapped.
    fn get_many(&self, py: Python<'_>, offsets: Vec<u64>) -> PyResult<Vec<Option<Record>>> {
        let log = self.shared()?;
        let mut found: Vec<Option<OwnedRecord>> = vec![None; offsets.len()];
        py.detach(|| log.reader().get_many(&offsets, |i, r| found[i] = Some(r.to_owned()))).map_err(log_error)?;
        Ok(found.into_iter().map(|r| r.map(|r| Record::from_owned(py, r))).collect())
    }

    /// The first record written at or after `timestamp` (ns since the Unix epoch).
    fn get_by_time(&self, py: Python<'_>, timestamp: u64) -> PyResult<Option<Record>> {
        let log = self.shared()?;
        let found =
            py.detach(|| log.reader().get_by_time(timestamp).map(|r| r.map(|r| r.to_owned()))).map_err(log_error)?;
        Ok(found.map(|r| Record::from_owned(py, r)))
    }

    /// The last record with `key` (the log must be opened with `key_index=True`).
    fn get_by_key(&self, py: Python<'_>, key: &[u8]) -> PyResult<Option<Record>> {
        let log = self.shared()?;
        let found = py.detach(|| log.reader().get_by_key(key).map(|r| r.map(|r| r.to_owned()))).map_err(log_error)?;
        Ok(found.map(|r| Record::from_owned(py, r)))
    }

    /// Iterates over the records from `offset` (default: the oldest) to the end as it is now.
    #[pyo3(signature = (offset = None))]
    fn reader(&self, offset: Option<u64>) -> PyResult<LogIterator> {
        let log = self.shared()?;
        let mut reader = log.reader();
        let start = offset.unwrap_or_else(|| reader.first_offset());
        reader.seek(start);
        Ok(LogIterator { reader: Mutex::new(reader), end: log.next_offset(), batch: Mutex::new(VecDeque::new()) })
    }

    fn __iter__(&self) -> PyResult<LogIterator> {
        self.reader(None)
    }

    /// The offset the next record will get.
    #[getter]
    fn next_offset(&self) -> PyResult<u64> {
        Ok(self.shared()?.next_offset())
    }

    /// The oldest offset still in the log.
    #[getter]
    fn first_offset(&self) -> PyResult<u64> {
        Ok(self.shared()?.reader().first_offset())
    }

    /// Opens the consumer group `name`, creating it if new at the log's oldest record (it then
    /// reads everything the log holds; `seek("newest")` to read only what comes next). Its
    /// position is as durable as `durability` (default: the log's).
    #[pyo3(signature = (name, durability = None))]
    fn group(&self, py: Python<'_>, name: &str, durability: Option<&str>) -> PyResult<Group> {
        let log = self.shared()?;
        let durability = match durability {
            Some(d) => durability_from(d)?,
            None => log.durability(),
        };
        let options = GroupOptions { durability, ..GroupOptions::default() };
        let group = py.detach(|| log.group(name, options)).map_err(log_error)?;
        Ok(Group { group: Mutex::new(Some(group)), name: name.to_owned() })
    }

    /// Closes the log (what was appended stays, as durable as its durability says). Groups and
    /// iterators opened from it keep it open until they go.
    fn close(&self, py: Python<'_>) {
        let log = lock(&self.log).take();
        // The last handle's drop syncs the log and trims its segment: without the GIL.
        py.detach(|| drop(log));
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __exit__(&self, py: Python<'_>, _kind: Py<PyAny>, _value: Py<PyAny>, _traceback: Py<PyAny>) -> bool {
        self.close(py);
        false
    }

    fn __repr__(&self) -> String {
        format!("Log({:?})", self.path.display().to_string())
    }
}

/// Records of a log from an offset to the end it had when the iteration began.
#[pyclass(module = "petrel", frozen)]
pub struct LogIterator {
    reader: Mutex<petrel_log::Reader>,
    end: u64,
    batch: Mutex<VecDeque<OwnedRecord>>,
}

#[pymethods]
impl LogIterator {
    fn __iter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __next__(&self, py: Python<'_>) -> PyResult<Option<Record>> {
        if let Some(r) = lock(&self.batch).pop_front() {
            return Ok(Some(Record::from_owned(py, r)));
        }
        let end = self.end;
        let next: Vec<OwnedRecord> = py
            .detach(|| {
                let mut reader = lock(&self.reader);
                let room = end.saturating_sub(reader.position()).min(1024) as usize;
                if room == 0 {
                    return Ok(Vec::new());
                }
                reader.read_batch(room).map(|b| b.into_iter().map(|r| r.to_owned()).collect())
            })
            .map_err(log_error)?;
        let mut batch = lock(&self.batch);
        batch.extend(next);
        Ok(batch.pop_front().map(|r| Record::from_owned(py, r)))
    }
}

/// A named consumer group of a log: its own position, persisted; at-least-once delivery.
#[pyclass(module = "petrel", frozen)]
pub struct Group {
    group: Mutex<Option<ConsumerGroup>>,
    name: String,
}

impl Group {
    fn with<T>(&self, f: impl FnOnce(&mut ConsumerGroup) -> petrel_log::Result<T>) -> PyResult<T> {
        let mut group = lock(&self.group);
        let group = group.as_mut().ok_or_else(|| ClosedError::new_err(format!("group {:?} is closed", self.name)))?;
        f(group).map_err(log_error)
    }
}

#[pymethods]
impl Group {
    /// Up to `max` records not yet delivered to the group (returned ones first), waiting up to
    /// `timeout` seconds for the first (`None`: until one comes). Each is delivered again unless
    /// acknowledged with `ack` (after a restart too).
    #[pyo3(signature = (max = 1, timeout = None))]
    fn poll(&self, py: Python<'_>, max: usize, timeout: Option<f64>) -> PyResult<Vec<Record>> {
        let max = max.max(1);
        // The wait for records is made without the group's lock: another thread's `ack` or
        // `close` meanwhile goes at once.
        let appends = py.detach(|| self.with(|g| Ok(g.appends())))?;
        let found = wait_for(py, crate::timeout_from(timeout), |slice| {
            let end = appends.end();
            let batch = self.with(|g| {
                g.poll(max, Duration::ZERO).map(|b| b.into_iter().map(|r| r.to_owned()).collect::<Vec<_>>())
            })?;
            if batch.is_empty() {
                appends.wait_past(end, slice);
                return Ok(None);
            }
            Ok(Some(batch))
        })?;
        Ok(records(py, found.unwrap_or_default()))
    }

    /// Acknowledges a delivered record: the group never delivers it again.
    fn ack(&self, py: Python<'_>, offset: u64) -> PyResult<()> {
        py.detach(|| self.with(|g| g.ack(offset)))
    }

    /// Returns a delivered record, to be delivered again before newer ones.
    fn nack(&self, py: Python<'_>, offset: u64) -> PyResult<()> {
        py.detach(|| self.with(|g| g.nack(offset)))
    }

    /// Moves the group to `"oldest"`, `"newest"` or an offset (or, with `time=NS`, to the first
    /// record at or after that time); returns where it stands now.
    #[pyo3(signature = (to = None, *, time = None))]
    fn seek(&self, py: Python<'_>, to: Option<Bound<'_, PyAny>>, time: Option<u64>) -> PyResult<u64> {
        let target = match (to, time) {
            (None, Some(t)) => SeekTo::Time(t),
            (Some(to), None) => {
                if to.is_instance_of::<pyo3::types::PyInt>() {
                    // (An int that is no offset, negative or too large: its own OverflowError.)
                    SeekTo::Offset(to.extract::<u64>()?)
                } else {
                    match to.extract::<String>()?.as_str() {
                        "oldest" => SeekTo::Oldest,
                        "newest" => SeekTo::Newest,
                        other => {
                            return Err(PyValueError::new_err(format!(
                                "seek to {other:?}: \"oldest\", \"newest\" or an offset"
                            )));
                        }
                    }
                }
            }
            _ => return Err(PyValueError::new_err("seek takes a position or time=NS, not both")),
        };
        py.detach(|| self.with(|g| g.seek(target)))
    }

    /// The lowest offset the group has not acknowledged.
    #[getter]
    fn committed(&self, py: Python<'_>) -> PyResult<u64> {
        py.detach(|| self.with(|g| Ok(g.committed())))
    }

    /// Records not yet acknowledged (delivered or not): those from `committed` on, less those
    /// acknowledged out of order.
    #[getter]
    fn lag(&self, py: Python<'_>) -> PyResult<u64> {
        py.detach(|| self.with(|g| Ok(g.unacknowledged())))
    }

    /// The group's name.
    #[getter]
    fn name(&self) -> &str {
        &self.name
    }

    /// Lets the group go (its position is kept; another process may open it).
    fn close(&self, py: Python<'_>) {
        py.detach(|| drop(lock(&self.group).take()));
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __exit__(&self, py: Python<'_>, _kind: Py<PyAny>, _value: Py<PyAny>, _traceback: Py<PyAny>) -> bool {
        self.close(py);
        false
    }
}

/// Drops what a closing takes, without the GIL: a log's last handle syncs it, a group's cursor
/// syncs (a `Log`, `Group` or `Queue` released without `close()`, by the garbage collector, would
/// stall every Python thread for the disk).
fn drop_detached<T: Send>(held: Option<T>) {
    if held.is_some() {
        Python::attach(|py| py.detach(move || drop(held)));
    }
}

impl Drop for Log {
    fn drop(&mut self) {
        drop_detached(self.log.get_mut().unwrap_or_else(|e| e.into_inner()).take());
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        drop_detached(self.group.get_mut().unwrap_or_else(|e| e.into_inner()).take());
    }
}

impl Drop for Queue {
    fn drop(&mut self) {
        let head = self.head.get_mut().unwrap_or_else(|e| e.into_inner()).take();
        let log = self.log.get_mut().unwrap_or_else(|e| e.into_inner()).take();
        if head.is_some() || log.is_some() {
            drop_detached(Some((head, log)));
        }
    }
}

/// A persistent FIFO queue in a directory, shaped like `queue.Queue`: `put` at the tail, `get`
/// from the head. With `auto_ack=False`, a `get` is acknowledged by `task_done()` (the oldest
/// item the calling thread got and has not yet done), and items got but not done come back after
/// a crash or restart. Its disk is its backlog's: segments whose items are all done are deleted,
/// and the last one when a `get` finds the queue drained.
#[pyclass(module = "petrel", frozen)]
pub struct Queue {
    log: Mutex<Option<SharedLog>>,
    head: Mutex<Option<ConsumerGroup>>,
    auto_ack: bool,
    /// The items got and not yet done (auto_ack off), per thread that got them (`task_done` acknowledges the
    /// oldest of its own thread's: a worker pool's threads each finish their own).
    taken: Mutex<VecDeque<(std::thread::ThreadId, u64)>>,
    path: PathBuf,
}

impl Queue {
    fn closed(&self) -> PyErr {
        ClosedError::new_err(format!("the queue at {} is closed", self.path.display()))
    }

    fn log(&self) -> PyResult<SharedLog> {
        lock(&self.log).clone().ok_or_else(|| self.closed())
    }

    fn with_head<T>(&self, f: impl FnOnce(&mut ConsumerGroup) -> petrel_log::Result<T>) -> PyResult<T> {
        let mut head = lock(&self.head);
        f(head.as_mut().ok_or_else(|| self.closed())?).map_err(log_error)
    }
}

#[pymethods]
impl Queue {
    #[new]
    #[pyo3(signature = (path, durability = "none", auto_ack = true))]
    fn new(py: Python<'_>, path: PathBuf, durability: &str, auto_ack: bool) -> PyResult<Queue> {
        let durability = durability_from(durability)?;
        // Segments every item of which is done are deleted (at each new segment, and the last
        // one once the queue is drained: `get`): a queue's disk is its backlog's, not its past's.
        let retention = petrel_log::Retention { delete_consumed: true, ..petrel_log::Retention::default() };
        let options = Options { durability, retention, ..Options::default() };
        let (log, head) = py
            .detach(|| {
                let log = petrel_log::Log::open(&path, options)?.into_shared();
                let head =
                    log.group(petrel_log::QUEUE_GROUP, GroupOptions { durability, ..GroupOptions::default() })?;
                Ok::<_, petrel_log::Error>((log, head))
            })
            .map_err(log_error)?;
        Ok(Queue {
            log: Mutex::new(Some(log)),
            head: Mutex::new(Some(head)),
            auto_ack,
            taken: Mutex::new(VecDeque::new()),
            path,
        })
    }

    /// Adds an item at the tail; returns its offset.
    fn put(&self, py: Python<'_>, payload: &[u8]) -> PyResult<u64> {
        let log = self.log()?;
        py.detach(move || log.append(payload)).map_err(log_error)
    }

    /// Adds items at the tail together (one sync under `"always"`).
    fn put_many(&self, py: Python<'_>, items: Vec<PyBackedBytes>) -> PyResult<()> {
        let log = self.log()?;
        py.detach(move || log.append_batch(&items)).map_err(log_error)?;
        Ok(())
    }

    /// The item at the head, waiting up to `timeout` seconds for one (`None`: until one comes);
    /// `None` if none came.
    #[pyo3(signature = (timeout = None))]
    fn get(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Option<Py<PyBytes>>> {
        let auto_ack = self.auto_ack;
        // The wait for items is made without the head's lock (see `Group::poll`).
        let appends = py.detach(|| self.with_head(|head| Ok(head.appends())))?;
        let mut looked = false;
        let found = wait_for(py, crate::timeout_from(timeout), |slice| {
            let end = appends.end();
            let found = self.with_head(|head| {
                if auto_ack {
                    return Ok(head.take(Duration::ZERO)?.map(|r| r.payload.to_vec()));
                }
                let Some(record) = head.poll(1, Duration::ZERO)?.into_iter().next() else { return Ok(None) };
                // Remembered under the head's lock: `task_done` acknowledges in delivery order.
                lock(&self.taken).push_back((std::thread::current().id(), record.offset));
                Ok(Some(record.payload.to_vec()))
            })?;
            if found.is_none() {
                // Drained: its disk given back, once a call (a no-op unless it holds more than a
                // first segment's worth of done items). Best effort: the `get` found nothing, and
                // says so (a full disk is for `put` to report). The handle is taken and dropped
                // here, without the GIL: the last one, after a `close` meanwhile, syncs the log.
                if !std::mem::replace(&mut looked, true)
                    && let Ok(log) = self.log()
                {
                    let _ = log.give_back();
                }
                appends.wait_past(end, slice);
            }
            Ok(found)
        })?;
        Ok(found.map(|payload| PyBytes::new(py, &payload).unbind()))
    }

    /// Acknowledges the oldest item got and not yet done (with `auto_ack=False`; a no-op with
    /// `auto_ack=True`, where `get` acknowledges).
    fn task_done(&self, py: Python<'_>) -> PyResult<()> {
        if self.auto_ack {
            return Ok(());
        }
        let done = py.detach(|| {
            self.with_head(|head| {
                // The head's lock, then the list's, as in `get`.
                let mut taken = lock(&self.taken);
                // The oldest its own thread got (the list is in delivery order); else (an item
                // handed from the thread that got it to another, as `asyncio.to_thread(q.get)`
                // does) the oldest of all.
                let own = std::thread::current().id();
                let Some(i) = taken.iter().position(|(t, _)| *t == own).or((!taken.is_empty()).then_some(0)) else {
                    return Ok(false);
                };
                head.ack(taken[i].1)?;
                taken.remove(i);
                Ok(true)
            })
        })?;
        if done { Ok(()) } else { Err(PyValueError::new_err("task_done() called more times than get()")) }
    }

    /// Items waiting to be got.
    fn qsize(&self, py: Python<'_>) -> PyResult<u64> {
        py.detach(|| self.with_head(|head| Ok(head.unacknowledged().saturating_sub(lock(&self.taken).len() as u64))))
    }

    /// Whether `qsize()` is 0.
    fn empty(&self, py: Python<'_>) -> PyResult<bool> {
        Ok(self.qsize(py)? == 0)
    }

    fn __len__(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.qsize(py)? as usize)
    }

    /// Makes every item put so far durable.
    fn flush(&self, py: Python<'_>) -> PyResult<()> {
        let log = self.log()?;
        py.detach(move || log.sync()).map_err(log_error)
    }

    /// Closes the queue; items got and not done come back at the next open.
    fn close(&self, py: Python<'_>) {
        py.detach(|| {
            lock(&self.head).take();
            lock(&self.log).take();
        });
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __exit__(&self, py: Python<'_>, _kind: Py<PyAny>, _value: Py<PyAny>, _traceback: Py<PyAny>) -> bool {
        self.close(py);
        false
    }
}
