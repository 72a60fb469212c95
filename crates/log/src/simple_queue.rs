//! The simple case: a persistent FIFO queue with one default consumer, on top of the log and a
//! consumer group.

use std::path::Path;
use std::time::Duration;

use crate::error::Result;
use crate::frame::Record;
use crate::group::{ConsumerGroup, GroupInfo, GroupOptions};
use crate::log::Log;
use crate::options::Options;

/// Name of the consumer group a [`SimpleQueue`] dequeues through.
pub const QUEUE_GROUP: &str = "queue";

/// A persistent queue: `enqueue` at the tail, `dequeue` from the head, surviving crashes.
/// A dequeued record is acknowledged before it is returned (at-most-once); for at-least-once,
/// open a [`ConsumerGroup`] with [`SimpleQueue::group`] and `poll`/`ack`.
///
/// ```
/// let dir = tempfile::tempdir()?;
/// let mut q = petrel_log::SimpleQueue::open(dir.path(), petrel_log::Options::default())?;
/// q.enqueue(b"first")?;
/// q.enqueue(b"second")?;
/// assert_eq!(q.len(), 2);
/// assert_eq!(q.dequeue()?.unwrap().payload, b"first");
/// assert_eq!(q.peek()?.unwrap().payload, b"second");
/// assert_eq!(q.len(), 1);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct SimpleQueue {
    // Dropped before the log: its cursor is synced first.
    head: ConsumerGroup,
    log: Log,
}

impl SimpleQueue {
    /// Opens the queue in `dir`; its dequeue position is as durable as `options.durability`.
    pub fn open(dir: impl AsRef<Path>, options: Options) -> Result<SimpleQueue> {
        let durability = options.durability;
        let log = Log::open(dir, options)?;
        let head = log.group(QUEUE_GROUP, GroupOptions { durability, ..GroupOptions::default() })?;
        Ok(SimpleQueue { head, log })
    }

    /// Adds a record at the tail; returns its offset.
    pub fn enqueue(&mut self, payload: &[u8]) -> Result<u64> {
        self.log.append(payload)
    }

    pub fn enqueue_batch<P: AsRef<[u8]>>(&mut self, payloads: &[P]) -> Result<std::ops::Range<u64>> {
        self.log.append_batch(payloads)
    }

    /// Removes and returns the record at the head, or `None` if the queue is empty.
    pub fn dequeue(&mut self) -> Result<Option<Record<'_>>> {
        self.head.take(Duration::ZERO)
    }

    /// Like `dequeue`, waiting up to `timeout` for a record.
    pub fn dequeue_timeout(&mut self, timeout: Duration) -> Result<Option<Record<'_>>> {
        self.head.take(timeout)
    }

    /// The record at the head, left in place.
    pub fn peek(&mut self) -> Result<Option<Record<'_>>> {
        self.head.peek()
    }

    /// Records enqueued and not dequeued.
    pub fn len(&self) -> u64 {
        self.head.unacknowledged()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Another named consumer of the same records, with its own position (seed 001's
    /// `NewConsumer`).
    pub fn group(&self, name: &str, options: GroupOptions) -> Result<ConsumerGroup> {
        self.log.group(name, options)
    }

    /// A new consumer starting where `from` stands (seed 001's `FromConsumer`).
    pub fn copy_group(&self, from: &str, to: &str) -> Result<()> {
        self.log.copy_group(from, to)
    }

    pub fn groups(&self) -> Vec<GroupInfo> {
        self.log.groups()
    }

    pub fn log(&self) -> &Log {
        &self.log
    }

    pub fn log_mut(&mut self) -> &mut Log {
        &mut self.log
    }
}
