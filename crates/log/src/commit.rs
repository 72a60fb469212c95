//! Making records durable: the group commit, and poisoning when a sync fails.
//!
//! Whoever needs record `offset` durable calls `make_durable(offset)`. If no sync is running, it
//! syncs the active segment, which covers every record published before the sync started;
//! callers that arrive meanwhile wait for that sync and, if it did not cover them, the next one
//! (which one of them runs). When a sync ends, only the waiters it covered are woken, and one
//! that it did not, to run the next: never all at once (64 producers woken together on two cores
//! spend longer fighting for the lock than the disk takes to sync). A failed sync poisons the
//! log: the failure is never retried or ignored, and every later call reports it (the page cache
//! may have dropped the dirty pages).

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use crate::error::{Error, Result};
use crate::options::SyncObserver;
use crate::segment::Segment;

pub(crate) struct Commit {
    on_sync: SyncObserver,
    state: Mutex<CommitState>,
    /// The segment a sync must cover; changed by the writer only when it rolls (sealed segments
    /// were synced when they were sealed, unless they are in `unsynced`).
    active: Mutex<Arc<Segment>>,
    /// Segments sealed without a sync (durability `none`, and those found at open), and whether
    /// a new segment's name may not be on disk yet: a sync (`make_durable`) covers them first,
    /// before it calls anything below the active segment durable. Weak: retention may delete
    /// one meanwhile (its records are gone then, consumed), and it is not held open for this.
    unsynced: Mutex<(Vec<Weak<Segment>>, bool)>,
    /// Held across each sync of a segment and its poisoning on a failure: the writer sealing the
    /// active segment syncs it outside the group commit, and the kernel reports a writeback
    /// error to one of two syncs of a file only, so two at once could see one fail and the other
    /// succeed after the failure, before the log is poisoned.
    sync_file: Mutex<()>,
    /// Syncs done (group commit makes this smaller than the appends that waited for one).
    syncs: AtomicU64,
    poisoned: AtomicBool,
    poison_reason: Mutex<Option<String>>,
    #[cfg(any(test, feature = "fault-injection"))]
    pub fail_next_sync: AtomicBool,
}

struct CommitState {
    /// Records below this offset are durable.
    durable: u64,
    /// A thread is syncing right now; others wait for it rather than sync again.
    syncing: bool,
    /// Threads waiting for the sync in progress (at most one entry per thread: a thread waits in
    /// one `make_durable` at a time).
    waiters: Vec<Waiter>,
}

struct Waiter {
    /// The record the thread needs durable.
    offset: u64,
    /// What the thread that woke it found (`WAITING` until then): read without the lock, so a
    /// covered waiter returns without queueing for it behind the others.
    outcome: Arc<AtomicU8>,
    thread: std::thread::Thread,
}

const WAITING: u8 = 0;
/// The waiter's record is durable.
const COVERED: u8 = 1;
/// Not covered (or the sync failed): look at the state again, and run the next sync if none is.
const LOOK_AGAIN: u8 = 2;

impl Commit {
    /// `unsynced`: segments before `active` that a crash may have left unsynced; `names_unsynced`:
    /// so may the directory's entries be (both synced at the first `make_durable`).
    pub(crate) fn new(
        active: Arc<Segment>,
        unsynced: &[Arc<Segment>],
        names_unsynced: bool,
        on_sync: SyncObserver,
    ) -> Commit {
        Commit {
            on_sync,
            state: Mutex::new(CommitState { durable: 0, syncing: false, waiters: Vec::new() }),
            active: Mutex::new(active),
            unsynced: Mutex::new((unsynced.iter().map(Arc::downgrade).collect(), names_unsynced)),
            sync_file: Mutex::new(()),
            syncs: AtomicU64::new(0),
            poisoned: AtomicBool::new(false),
            poison_reason: Mutex::new(None),
            #[cfg(any(test, feature = "fault-injection"))]
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

    /// The writer made a segment without syncing its name (durability `none`), and sealed
    /// `sealed` without syncing it: the next `make_durable` syncs them first.
    pub(crate) fn made_without_sync(&self, sealed: Option<&Arc<Segment>>) {
        let mut unsynced = self.unsynced.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(sealed) = sealed {
            // Those retention deleted go: the list holds at most the log's segments.
            unsynced.0.retain(|s| s.strong_count() > 0);
            unsynced.0.push(Arc::downgrade(sealed));
        }
        unsynced.1 = true;
    }

    /// Syncs a segment being sealed, poisoning the log if that fails.
    pub(crate) fn sync_sealed(&self, dir: &Path, seg: &Segment) -> Result<()> {
        let _one_at_a_time = self.sync_file.lock().unwrap_or_else(|e| e.into_inner());
        if let Err(e) = self.on_sync.time(|| seg.sync()) {
            return Err(self.poison(dir, format!("fdatasync {}: {e}", seg.path.display())));
        }
        Ok(())
    }

    /// Returns once record `offset` is durable, syncing if no other thread is.
    pub(crate) fn make_durable(&self, dir: &Path, offset: u64) -> Result<()> {
        let mut state = self.lock();
        loop {
            if let Err(e) = self.check_poison() {
                // A waiter woken to run the next sync that finds the log poisoned (a sealed
                // segment's sync failed meanwhile) runs none: those still waiting would wait for
                // ever. They look again, and find the poison too.
                if !state.syncing {
                    let waiting = std::mem::take(&mut state.waiters);
                    drop(state);
                    for w in waiting {
                        w.outcome.store(LOOK_AGAIN, Ordering::Release);
                        w.thread.unpark();
                    }
                }
                return Err(e);
            }
            if state.durable > offset {
                return Ok(());
            }
            if state.syncing {
                let outcome = Arc::new(AtomicU8::new(WAITING));
                state.waiters.push(Waiter { offset, outcome: Arc::clone(&outcome), thread: std::thread::current() });
                drop(state);
                // The thread that ends the sync sets the outcome, then unparks this one (`park`
                // may also return early: look again).
                let seen = loop {
                    std::thread::park();
                    match outcome.load(Ordering::Acquire) {
                        WAITING => continue,
                        seen => break seen,
                    }
                };
                if seen == COVERED {
                    return Ok(());
                }
                state = self.lock();
                continue;
            }
            state.syncing = true;
            drop(state);
            // Let producers that are ready to run append first: the sync then covers them too.
            std::thread::yield_now();
            // The writer sealing this segment syncs it too, outside this flag (see `sync_file`):
            // a log poisoned meanwhile fails this sync as well (no other `make_durable` sync can
            // have run since).
            let result = self.sync_active(dir).and_then(|durable| self.check_poison().map(|()| durable));
            state = self.lock();
            state.syncing = false;
            if let Ok(durable) = result {
                // One sync at a time, each covering what the one before did and more.
                assert!(durable >= state.durable, "a sync went back: {durable} < {}", state.durable);
                state.durable = durable;
            }
            // Wake whom the sync covered (after a failure, everyone: the log is poisoned), and
            // the waiter it did not cover that needs the least, to run the next sync.
            let (durable, failed) = (state.durable, result.is_err());
            let mut woken = Vec::new();
            state.waiters.retain(|w| {
                let covered = !failed && w.offset < durable;
                if covered || failed {
                    w.outcome.store(if covered { COVERED } else { LOOK_AGAIN }, Ordering::Release);
                    woken.push(w.thread.clone());
                }
                !(covered || failed)
            });
            if let Some(next) = (0..state.waiters.len()).min_by_key(|&i| state.waiters[i].offset) {
                let next = state.waiters.swap_remove(next);
                next.outcome.store(LOOK_AGAIN, Ordering::Release);
                woken.push(next.thread);
            }
            drop(state);
            woken.into_iter().for_each(|t| t.unpark());
            result?;
            // Answered from this sync's own result: the next one, run by a waiter just woken,
            // may fail and poison the log before this thread looks again, and the record is
            // durable all the same.
            if durable > offset {
                return Ok(());
            }
            state = self.lock();
        }
    }

    /// Syncs the segments sealed without a sync, and the directory (the names of segments made
    /// since), so that what is below the active segment is durable too.
    fn sync_sealed_unsynced(&self, dir: &Path) -> Result<()> {
        let (sealed, names) = {
            let mut unsynced = self.unsynced.lock().unwrap_or_else(|e| e.into_inner());
            (std::mem::take(&mut unsynced.0), std::mem::take(&mut unsynced.1))
        };
        let put_back = |left: &[Weak<Segment>]| {
            let mut unsynced = self.unsynced.lock().unwrap_or_else(|e| e.into_inner());
            unsynced.0.splice(0..0, left.iter().cloned());
            unsynced.1 |= names;
        };
        for (i, seg) in sealed.iter().enumerate() {
            let Some(seg) = seg.upgrade() else { continue };
            if let Err(e) = self.sync_sealed(dir, &seg) {
                put_back(&sealed[i..]);
                return Err(e);
            }
        }
        if names && let Err(e) = crate::segment::sync_dir(dir) {
            put_back(&[]);
            return Err(self.poison(dir, format!("sync of the log's directory: {e}")));
        }
        Ok(())
    }

    /// Syncs the active segment and returns the offset below which everything is durable.
    fn sync_active(&self, dir: &Path) -> Result<u64> {
        // The active segment first: the writer lists a segment it seals unsynced before it makes
        // its successor active, so the list taken after holds every segment before this one.
        let seg = Arc::clone(&self.active.lock().unwrap_or_else(|e| e.into_inner()));
        self.sync_sealed_unsynced(dir)?;
        let (pos, records) = seg.tail();
        let _one_at_a_time = self.sync_file.lock().unwrap_or_else(|e| e.into_inner());
        #[cfg(any(test, feature = "fault-injection"))]
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// A sync ends covering neither of two waiters and wakes one to run the next; before it
    /// looks, a sealed segment's sync poisons the log. It runs no sync, and must wake the other
    /// (which waited for ever).
    #[test]
    fn waiters_are_woken_when_the_one_to_sync_next_finds_the_log_poisoned() {
        let dir = tempfile::tempdir().unwrap();
        let place = crate::segment::Place::New;
        let seg = Arc::new(Segment::create(dir.path(), 0, 1 << 20, 0, false, place).unwrap());
        let commit = Arc::new(Commit::new(seg, &[], false, SyncObserver::default()));
        commit.lock().syncing = true; // a sync under way
        let (tx, rx) = std::sync::mpsc::channel();
        for _ in 0..2 {
            let (commit, dir, tx) = (Arc::clone(&commit), dir.path().to_owned(), tx.clone());
            std::thread::spawn(move || tx.send(commit.make_durable(&dir, 5)).unwrap());
        }
        while commit.lock().waiters.len() < 2 {
            std::thread::yield_now();
        }
        let next = {
            let mut state = commit.lock();
            state.syncing = false;
            state.waiters.remove(0)
        };
        commit.poison(dir.path(), "injected".into());
        next.outcome.store(LOOK_AGAIN, Ordering::Release);
        next.thread.unpark();
        for _ in 0..2 {
            let result = rx.recv_timeout(Duration::from_secs(10)).expect("every waiter returns");
            assert!(matches!(result, Err(Error::Poisoned(_))), "{result:?}");
        }
    }
}
