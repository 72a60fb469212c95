//! What a log's writer, its readers, its consumer groups and the sync thread share: the
//! segments, the published end, the group registry, the key index, the group commit, and the
//! wake-ups of readers waiting for a record. Fields are private; each concept has its owner
//! (`commit.rs`, `keys.rs`, `group.rs`), and this file only holds them together.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};

use crate::commit::Commit;
use crate::error::Result;
use crate::keys::KeyIndex;
use crate::mmap::SEGMENT_HEADER_LEN;
use crate::options::Options;
use crate::segment::Segment;

/// Figures about a log, cheap to read at any time.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LogStats {
    pub first_offset: u64,
    pub next_offset: u64,
    pub segments: usize,
    /// Bytes of the segment files: their lengths, more than the records take (`frame_bytes`).
    pub segment_bytes: u64,
    /// Bytes the records' frames take in the segments this handle wrote (padding included;
    /// segment headers and the zeroed room after the last frame not). A sealed segment opened
    /// from disk counts whole past its header: its end is not looked for.
    pub frame_bytes: u64,
    /// Data syncs (fdatasync) done since open.
    pub syncs: u64,
    /// Segments started since open because the active one was full (segment rolls).
    pub rolls: u64,
    /// Retention passes since open that deleted at least one segment.
    pub retention_removals: u64,
    /// Keys in the key index (`Options::key_index`; 0 without it): one entry, its bytes and an
    /// offset in memory each, for keys of records still in the log.
    pub keys_indexed: usize,
}

pub(crate) struct LogState {
    dir: PathBuf,
    options: Options,
    /// Every segment, oldest first. The last one is the active one when there is a writer.
    segments: RwLock<Vec<Arc<Segment>>>,
    /// One past the last published record.
    next_offset: AtomicU64,
    /// Base offset of the oldest segment (kept beside `segments` so readers need no lock).
    first_offset: AtomicU64,
    groups: crate::group::Registry,
    /// `Some` if `Options::key_index`.
    keys: Option<KeyIndex>,
    commit: Commit,
    /// Readers waiting for a new record sleep here; the writer wakes them only if any wait.
    append_waiters: AtomicUsize,
    append_lock: Mutex<()>,
    appended: Condvar,
    /// Segment rolls since open (`LogStats::rolls`).
    rolls: AtomicU64,
    /// Retention passes since open that deleted segments (`LogStats::retention_removals`).
    retention_removals: AtomicU64,
    /// The writer's lock on the directory (flock), when it takes one: the writer and each
    /// consumer group opened from it hold it (a group writes its cursor file), so that no
    /// second writer opens the directory, and its groups, while one of them lives. Readers
    /// write nothing and do not hold it.
    lock: std::sync::Weak<std::fs::File>,
}

impl LogState {
    pub(crate) fn new(
        dir: PathBuf,
        options: Options,
        segments: Vec<Arc<Segment>>,
        next_offset: u64,
        cursors: BTreeMap<String, crate::cursor::CursorState>,
        lock: Option<&Arc<std::fs::File>>,
    ) -> Arc<LogState> {
        let active = Arc::clone(segments.last().expect("a log has at least one segment"));
        let keys = options.key_index.then(|| KeyIndex::build(&segments));
        let first = segments.first().map_or(0, |s| s.base);
        Arc::new(LogState {
            dir,
            // Sealed segments and segment names may be unsynced whatever this open's policy: the
            // last session may have run under `none` (durability may change at a restart), or
            // crashed. The first sync covers them (a clean file's sync costs little).
            commit: Commit::new(active, &segments[..segments.len() - 1], true, options.on_sync.clone()),
            options,
            keys,
            segments: RwLock::new(segments),
            next_offset: AtomicU64::new(next_offset),
            first_offset: AtomicU64::new(first),
            groups: crate::group::registry(cursors),
            append_waiters: AtomicUsize::new(0),
            append_lock: Mutex::new(()),
            appended: Condvar::new(),
            rolls: AtomicU64::new(0),
            retention_removals: AtomicU64::new(0),
            lock: lock.map_or_else(std::sync::Weak::new, Arc::downgrade),
        })
    }

    /// The directory's lock, for a consumer group to hold (`None`: the log takes none, or its
    /// writer and groups are all gone).
    pub(crate) fn lock(&self) -> Option<Arc<std::fs::File>> {
        self.lock.upgrade()
    }

    pub(crate) fn dir(&self) -> &Path {
        &self.dir
    }

    pub(crate) fn options(&self) -> &Options {
        &self.options
    }

    pub(crate) fn keys(&self) -> Option<&KeyIndex> {
        self.keys.as_ref()
    }

    pub(crate) fn commit(&self) -> &Commit {
        &self.commit
    }

    pub(crate) fn check_poison(&self) -> Result<()> {
        self.commit.check_poison()
    }

    /// Returns once record `offset` is durable (the group commit, `commit.rs`).
    pub(crate) fn make_durable(&self, offset: u64) -> Result<()> {
        self.commit.make_durable(&self.dir, offset)
    }

    /// One past the last published record.
    pub(crate) fn next_offset(&self) -> u64 {
        self.next_offset.load(Ordering::Acquire)
    }

    pub(crate) fn first_offset(&self) -> u64 {
        self.first_offset.load(Ordering::Acquire)
    }

    pub(crate) fn set_first_offset(&self, first: u64) {
        assert!(first >= self.first_offset(), "the log's start only moves forward");
        self.first_offset.store(first, Ordering::Release);
    }

    /// Every segment, oldest first.
    pub(crate) fn segments(&self) -> RwLockReadGuard<'_, Vec<Arc<Segment>>> {
        self.segments.read().unwrap_or_else(|e| e.into_inner())
    }

    /// For the writer (a new segment) and retention (removing the oldest).
    pub(crate) fn segments_mut(&self) -> RwLockWriteGuard<'_, Vec<Arc<Segment>>> {
        self.segments.write().unwrap_or_else(|e| e.into_inner())
    }

    /// The segment holding `offset`, if it is in the log.
    pub(crate) fn segment_for(&self, offset: u64) -> Option<Arc<Segment>> {
        let segments = self.segments();
        let i = segments.partition_point(|s| s.base <= offset);
        (i > 0).then(|| Arc::clone(&segments[i - 1]))
    }

    /// The segment after the one starting at `base`.
    pub(crate) fn segment_after(&self, base: u64) -> Option<Arc<Segment>> {
        let segments = self.segments();
        let i = segments.partition_point(|s| s.base <= base);
        segments.get(i).cloned()
    }

    /// Every consumer group, open or not (`group.rs` owns what an entry means).
    pub(crate) fn groups(&self) -> MutexGuard<'_, BTreeMap<String, Arc<crate::group::GroupEntry>>> {
        self.groups.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn count_roll(&self) {
        self.rolls.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn count_retention_removal(&self) {
        self.retention_removals.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn stats(&self) -> LogStats {
        let segments = self.segments();
        LogStats {
            next_offset: self.next_offset(),
            first_offset: self.first_offset(),
            segments: segments.len(),
            segment_bytes: segments.iter().map(|s| s.map.len() as u64).sum(),
            frame_bytes: segments.iter().map(|s| (s.map.published_end() - SEGMENT_HEADER_LEN) as u64).sum(),
            syncs: self.commit.syncs(),
            rolls: self.rolls.load(Ordering::Relaxed),
            retention_removals: self.retention_removals.load(Ordering::Relaxed),
            keys_indexed: self.keys.as_ref().map_or(0, KeyIndex::len),
        }
    }

    /// Called by the writer: records below `next` are published. Wakes waiting readers, if
    /// there are any.
    #[inline]
    pub(crate) fn publish(&self, next: u64) {
        debug_assert!(next >= self.next_offset.load(Ordering::Relaxed), "the published end only moves forward");
        self.next_offset.store(next, Ordering::SeqCst);
        if self.append_waiters.load(Ordering::SeqCst) != 0 {
            let _guard = self.append_lock.lock().unwrap_or_else(|e| e.into_inner());
            self.appended.notify_all();
        }
    }

    /// Waits until a record at `offset` is published or `deadline` passes; `true` if it is.
    pub(crate) fn wait_for_append(&self, offset: u64, deadline: std::time::Instant) -> bool {
        // Dekker-style with `publish`: we announce ourselves, then look; the writer stores, then
        // looks for waiters. SeqCst on both sides means one of us sees the other.
        self.append_waiters.fetch_add(1, Ordering::SeqCst);
        let mut guard = self.append_lock.lock().unwrap_or_else(|e| e.into_inner());
        let published = loop {
            if self.next_offset.load(Ordering::SeqCst) > offset || self.commit.is_poisoned() {
                break true;
            }
            let now = std::time::Instant::now();
            if now >= deadline {
                break false;
            }
            guard = self.appended.wait_timeout(guard, deadline - now).unwrap_or_else(|e| e.into_inner()).0;
        };
        drop(guard);
        self.append_waiters.fetch_sub(1, Ordering::SeqCst);
        published
    }
}

/// The background sync of a log with `Durability::Interval` (`syncer.rs`).
impl crate::syncer::IntervalSync for LogState {
    fn sync_now(&self) {
        let next = self.next_offset();
        // A failure poisons the log, which every later call reports.
        if next > 0 {
            let _ = self.make_durable(next - 1);
        }
    }
}

impl Drop for LogState {
    fn drop(&mut self) {
        // The segments go with the last handle: they stop counting in a budget other logs share.
        for seg in self.segments.get_mut().unwrap_or_else(|e| e.into_inner()).iter() {
            self.options.page_budget.forget(seg);
        }
    }
}
