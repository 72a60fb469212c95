//! One background thread per process that syncs every log and cursor whose durability is
//! `Interval`, each at its interval: a server with thousands of such queues has one sync
//! thread, not one per log and per consumer group. It starts at the first registration.
//!
//! Syncs run one after another, so an interval is a lower bound: a slow disk stretches every
//! log's interval by the syncs ahead of it. A log's writer and anyone calling `sync` still sync
//! themselves (group commit); this thread only bounds how long a record may stay unsynced.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Condvar, Mutex, MutexGuard, OnceLock, Weak};
use std::time::{Duration, Instant};

use crate::error::{Result, io_err};

/// Something the thread syncs: a log, or a consumer group's cursor.
pub(crate) trait IntervalSync: Send + Sync {
    /// Syncs what was written since the last sync. A failure is the target's to keep and report
    /// (a poisoned log, a cursor's sticky error): the thread goes on with the others.
    fn sync_now(&self);
}

struct Job {
    target: Weak<dyn IntervalSync>,
    every: Duration,
    due: Instant,
}

#[derive(Default)]
struct Jobs {
    next_id: u64,
    by_id: HashMap<u64, Job>,
    /// (due, id) of every job: the first is the next to run.
    queue: BTreeSet<(Instant, u64)>,
    /// The job whose sync runs now (outside the lock).
    running: Option<u64>,
}

struct Syncer {
    jobs: Mutex<Jobs>,
    /// Wakes the thread for an earlier job, and unregistering callers when a sync ends.
    changed: Condvar,
}

impl Syncer {
    fn lock(&self) -> MutexGuard<'_, Jobs> {
        self.jobs.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn run(&self) {
        let mut jobs = self.lock();
        loop {
            let Some(&(due, id)) = jobs.queue.first() else {
                jobs = self.changed.wait(jobs).unwrap_or_else(|e| e.into_inner());
                continue;
            };
            let now = Instant::now();
            if due > now {
                jobs = self.changed.wait_timeout(jobs, due - now).unwrap_or_else(|e| e.into_inner()).0;
                continue;
            }
            jobs.queue.pop_first();
            let job = jobs.by_id.get_mut(&id).expect("every queued job is registered");
            // The next sync is due one interval after this one starts.
            job.due = now + job.every;
            let Some(target) = job.target.upgrade() else { continue };
            let next = (job.due, id);
            jobs.queue.insert(next);
            jobs.running = Some(id);
            drop(jobs);
            target.sync_now();
            drop(target);
            jobs = self.lock();
            jobs.running = None;
            self.changed.notify_all();
        }
    }
}

/// The process's syncer, its thread started on first use (or, if that failed, on the next).
fn syncer() -> Result<&'static Syncer> {
    static SYNCER: OnceLock<Syncer> = OnceLock::new();
    static STARTED: Mutex<bool> = Mutex::new(false);
    let syncer: &'static Syncer =
        SYNCER.get_or_init(|| Syncer { jobs: Mutex::new(Jobs::default()), changed: Condvar::new() });
    let mut started = STARTED.lock().unwrap_or_else(|e| e.into_inner());
    if !*started {
        std::thread::Builder::new()
            .name("petrel-log-sync".into())
            .spawn(move || syncer.run())
            .map_err(io_err("spawn the sync thread", std::path::PathBuf::new()))?;
        *started = true;
    }
    Ok(syncer)
}

/// A target's place on the thread: dropping it stops the syncs, waiting for one that runs.
pub(crate) struct Registration {
    id: u64,
}

/// Syncs `target` every `every` until the registration is dropped or the target is.
pub(crate) fn register(target: Weak<dyn IntervalSync>, every: Duration) -> Result<Registration> {
    let syncer = syncer()?;
    let mut jobs = syncer.lock();
    let id = jobs.next_id;
    jobs.next_id += 1;
    let due = Instant::now() + every;
    jobs.by_id.insert(id, Job { target, every, due });
    jobs.queue.insert((due, id));
    syncer.changed.notify_all();
    Ok(Registration { id })
}

impl Drop for Registration {
    fn drop(&mut self) {
        let Ok(syncer) = syncer() else { return };
        let mut jobs = syncer.lock();
        if let Some(job) = jobs.by_id.remove(&self.id) {
            jobs.queue.remove(&(job.due, self.id));
        }
        // After this returns, the thread does not touch the target again.
        while jobs.running == Some(self.id) {
            jobs = syncer.changed.wait(jobs).unwrap_or_else(|e| e.into_inner());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU32, Ordering};

    struct Counter(AtomicU32);

    impl IntervalSync for Counter {
        fn sync_now(&self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn wait_for(what: impl Fn() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !what() {
            assert!(Instant::now() < deadline, "timed out");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn syncs_each_target_at_its_interval_until_unregistered() {
        let fast = Arc::new(Counter(AtomicU32::new(0)));
        let slow = Arc::new(Counter(AtomicU32::new(0)));
        let fast_dyn: Arc<dyn IntervalSync> = fast.clone();
        let slow_dyn: Arc<dyn IntervalSync> = slow.clone();
        let fast_reg = register(Arc::downgrade(&fast_dyn), Duration::from_millis(1)).unwrap();
        let _slow_reg = register(Arc::downgrade(&slow_dyn), Duration::from_secs(3600)).unwrap();
        wait_for(|| fast.0.load(Ordering::SeqCst) >= 5);
        assert_eq!(slow.0.load(Ordering::SeqCst), 0, "not due for an hour");
        drop(fast_reg);
        let after = fast.0.load(Ordering::SeqCst);
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(fast.0.load(Ordering::SeqCst), after, "no sync once unregistered");
    }

    #[test]
    fn a_dropped_target_is_skipped() {
        let gone: Arc<dyn IntervalSync> = Arc::new(Counter(AtomicU32::new(0)));
        let reg = register(Arc::downgrade(&gone), Duration::from_millis(1)).unwrap();
        drop(gone);
        let live = Arc::new(Counter(AtomicU32::new(0)));
        let live_dyn: Arc<dyn IntervalSync> = live.clone();
        let _live_reg = register(Arc::downgrade(&live_dyn), Duration::from_millis(1)).unwrap();
        wait_for(|| live.0.load(Ordering::SeqCst) >= 3);
        drop(reg);
    }
}
