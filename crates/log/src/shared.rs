//! A cloneable handle for many producer threads, with group commit.

use std::ops::Range;
use std::sync::{Arc, Mutex, MutexGuard};

use crate::error::Result;
use crate::frame::Input;
use crate::log::Log;
use crate::options::Durability;
use crate::reader::Reader;
use crate::state::LogState;

/// A [`Log`] that many threads append to. Appends are serialized by a short lock (the frame
/// copy); under [`Durability::Always`] the wait for the disk happens outside that lock, and all
/// appends that arrive while one thread syncs are covered by the next single sync.
#[derive(Clone)]
pub struct SharedLog {
    log: Arc<Mutex<Log>>,
    shared: Arc<LogState>,
}

impl SharedLog {
    pub(crate) fn new(log: Log) -> SharedLog {
        let shared = Arc::clone(log.shared());
        SharedLog { log: Arc::new(Mutex::new(log)), shared }
    }

    fn lock(&self) -> MutexGuard<'_, Log> {
        self.log.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn durable(&self, last: u64) -> Result<()> {
        if self.shared.options().durability == Durability::Always {
            self.shared.make_durable(last)?;
        }
        Ok(())
    }

    pub fn append(&self, payload: &[u8]) -> Result<u64> {
        self.append_with(&Input::payload(payload))
    }

    pub fn append_with(&self, input: &Input<'_>) -> Result<u64> {
        let offset = self.lock().append_unsynced(input)?;
        self.durable(offset)?;
        Ok(offset)
    }

    pub fn append_batch<P: AsRef<[u8]>>(&self, payloads: &[P]) -> Result<Range<u64>> {
        let range = self.lock().batch_unsynced(payloads.len(), |i| Input::payload(payloads[i].as_ref()))?;
        if !range.is_empty() {
            self.durable(range.end - 1)?;
        }
        Ok(range)
    }

    pub fn append_batch_with(&self, inputs: &[Input<'_>]) -> Result<Range<u64>> {
        let range = self.append_batch_unsynced(inputs)?;
        if !range.is_empty() {
            self.durable(range.end - 1)?;
        }
        Ok(range)
    }

    /// Appends without waiting for the disk, whatever the durability: the records are readable
    /// at once, and under [`Durability::Always`] durable only once [`SharedLog::wait_durable`]
    /// for the last of them returns. For a caller that appends under a lock of its own and waits
    /// after letting it go, so that appends of other threads join the same sync.
    pub fn append_batch_unsynced(&self, inputs: &[Input<'_>]) -> Result<Range<u64>> {
        self.lock().batch_unsynced(inputs.len(), |i| inputs[i])
    }

    /// Under [`Durability::Always`], returns once record `offset` is durable (one sync covers
    /// every record appended before it starts: the group commit); under another durability at
    /// once, as the background sync or the page cache has it.
    pub fn wait_durable(&self, offset: u64) -> Result<()> {
        self.durable(offset)
    }

    /// Returns once record `offset` is durable, whatever the policy: under `none` or
    /// `interval` a sync now (joining one in progress), for a record that must be on disk
    /// before its producer is answered.
    pub fn make_durable(&self, offset: u64) -> Result<()> {
        self.shared.make_durable(offset)
    }

    /// The log's durability policy.
    pub fn durability(&self) -> Durability {
        self.shared.options().durability
    }

    /// The largest record the log takes (`Options::max_record_bytes`).
    pub fn max_record_bytes(&self) -> usize {
        self.shared.options().max_record_bytes
    }

    /// Makes the next sync of the active segment fail as a disk's would (poisoning the log),
    /// for the tests of what is built on the log.
    #[cfg(feature = "fault-injection")]
    #[doc(hidden)]
    pub fn fail_next_sync(&self) {
        self.shared.commit().fail_next_sync.store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// Makes every record appended so far durable.
    pub fn sync(&self) -> Result<()> {
        let next = self.next_offset();
        if next == 0 {
            return self.shared.check_poison();
        }
        self.shared.make_durable(next - 1)
    }

    pub fn next_offset(&self) -> u64 {
        self.shared.next_offset()
    }

    pub fn stats(&self) -> crate::LogStats {
        self.shared.stats()
    }

    /// Opens (creating if needed) the consumer group `name`.
    pub fn group(&self, name: &str, options: crate::GroupOptions) -> Result<crate::ConsumerGroup> {
        crate::ConsumerGroup::open(Arc::clone(&self.shared), name, options)
    }

    /// Deletes old segments as `Options::retention` allows (also done at every roll).
    pub fn apply_retention(&self) -> Result<crate::RetentionReport> {
        crate::retention::apply(&self.shared)
    }

    /// See `Log::give_back`.
    pub fn give_back(&self) -> Result<crate::RetentionReport> {
        self.lock().give_back()
    }

    pub fn groups(&self) -> Vec<crate::GroupInfo> {
        crate::group::infos(&self.shared)
    }

    pub fn copy_group(&self, from: &str, to: &str) -> Result<()> {
        crate::group::copy(&self.shared, from, to)
    }

    pub fn delete_group(&self, name: &str) -> Result<()> {
        crate::group::delete(&self.shared, name)
    }

    pub fn reader(&self) -> Reader {
        Reader::new(Arc::clone(&self.shared))
    }
}
