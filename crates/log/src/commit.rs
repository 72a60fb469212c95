//! Making records durable: the group commit, and poisoning when a sync fails.
//!
//! Whoever needs record `offset` durable calls `make_durable(offset)`. If no sync is running, it
//! syncs the active segment, which covers every record published before the sync started;
//! callers that arrive meanwhile wait for that sync and, if it did not cover them, the next one
//! (which one of them runs). A failed sync poisons the log: the failure is never retried or
//! ignored, and every later call reports it (the page cache may have dropped the dirty pages).

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use crate::error::{Error, Result};
use crate::options::SyncObserver;
use crate::segment::Segment;

pub(crate) struct Commit {
    on_sync: SyncObserver,
    state: Mutex<CommitState>,
    synced: Condvar,
    /// The segment a sync must cover; changed by the writer only when it rolls (sealed segments
    /// were synced when they were sealed).
    active: Mutex<Arc<Segment>>,
    /// Syncs done (group commit makes this smaller than the appends that waited for one).
    syncs: AtomicU64,
    poisoned: AtomicBool,
    poison_reason: Mutex<Option<String>>,
    #[cfg(test)]
    pub fail_next_sync: AtomicBool,
}

struct CommitState {
    /// Records below this offset are durable.
    durable: u64,
    /// A thread is syncing right now; others wait for it rather than sync again.
    syncing: bool,
}

impl Commit {
    pub(crate) fn new(active: Arc<Segment>, on_sync: SyncObserver) -> Commit {
        Commit {
            on_sync,
            state: Mutex::new(CommitState { durable: 0, syncing: false }),
            synced: Condvar::new(),
            active: Mutex::new(active),
            syncs: AtomicU64::new(0),
            poisoned: AtomicBool::new(false),
            poison_reason: Mutex::new(None),
            #[cfg(test)]
            fail_next_sync: AtomicBool::new(false),
        }
    }

    pub(crate) fn check_poison(&self) -> Result<()> {
        if self.is_poisoned() {
            let reason = self.poison_reason.lock().unwrap_or_else(|e| e.into_inner());
            return Err(Error::Poisoned(reason.clone().unwrap_or_default()));
        }
        Ok(())
    }

    pub(crate) fn is_poisoned(&self) -> bool {
        self.poisoned.load(Ordering::Relaxed)
    }

    /// Poisons the log (the first reason stays); returns the error to report.
    pub(crate) fn poison(&self, dir: &Path, reason: String) -> Error {
        tracing::error!(dir = %dir.display(), %reason, "sync failed; log poisoned");
        let mut slot = self.poison_reason.lock().unwrap_or_else(|e| e.into_inner());
        slot.get_or_insert(reason.clone());
        self.poisoned.store(true, Ordering::Relaxed);
        Error::Poisoned(reason)
    }

    /// Told of every data sync of this log and its cursors.
    pub(crate) fn on_sync(&self) -> &SyncObserver {
        &self.on_sync
    }

    pub(crate) fn syncs(&self) -> u64 {
        self.syncs.load(Ordering::Relaxed)
    }

    fn lock(&self) -> MutexGuard<'_, CommitState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Called by the writer when it rolls, after syncing the segment it sealed.
    pub(crate) fn set_active(&self, seg: Arc<Segment>) {
        *self.active.lock().unwrap_or_else(|e| e.into_inner()) = seg;
    }

    /// Syncs a segment being sealed, poisoning the log if that fails.
    pub(crate) fn sync_sealed(&self, dir: &Path, seg: &Segment) -> Result<()> {
        if let Err(e) = self.on_sync.time(|| seg.sync()) {
            return Err(self.poison(dir, format!("fdatasync {}: {e}", seg.path.display())));
        }
        Ok(())
    }

    /// Returns once record `offset` is durable, syncing if no other thread is.
    pub(crate) fn make_durable(&self, dir: &Path, offset: u64) -> Result<()> {
        let mut state = self.lock();
        loop {
            self.check_poison()?;
            if state.durable > offset {
                return Ok(());
            }
            if state.syncing {
                state = self.synced.wait(state).unwrap_or_else(|e| e.into_inner());
                continue;
            }
            state.syncing = true;
            drop(state);
            // Let producers that are ready to run append first: the sync then covers them too.
            std::thread::yield_now();
            let result = self.sync_active(dir);
            state = self.lock();
            state.syncing = false;
            self.synced.notify_all();
            let durable = result?;
            // One sync at a time, each covering what the one before did and more.
            assert!(durable >= state.durable, "a sync went back: {durable} < {}", state.durable);
            state.durable = durable;
        }
    }

    /// Syncs the active segment and returns the offset below which everything is durable.
    fn sync_active(&self, dir: &Path) -> Result<u64> {
        let seg = Arc::clone(&self.active.lock().unwrap_or_else(|e| e.into_inner()));
        let (pos, records) = seg.tail();
        #[cfg(test)]
        if self.fail_next_sync.swap(false, Ordering::Relaxed) {
            return Err(self.poison(dir, format!("fdatasync {}: injected failure", seg.path.display())));
        }
        if let Err(e) = self.on_sync.time(|| seg.sync()) {
            return Err(self.poison(dir, format!("fdatasync {}: {e}", seg.path.display())));
        }
        self.syncs.fetch_add(1, Ordering::Relaxed);
        seg.write_checkpoint(pos as u64, seg.base + records);
        Ok(seg.base + records)
    }
}
