//! One helper thread per process that faults in the pages of active segments ahead of their
//! writers, so the kernel's page-cache allocation and zeroing happen off the append path, on
//! another core.
//!
//! Each writer reports its position every `STEP` bytes (and at the start of each segment); the
//! thread keeps the pages up to `WINDOW` bytes past it faulted in, a `CHUNK` per system call,
//! taking the logs with work in turn. One thread serves every log: a server with thousands of
//! queue logs has one prefault thread, not one each. It starts at the first report, so a process
//! whose logs never report has none.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};

use crate::segment::Segment;

/// How often (in bytes written) the writer reports its position.
pub(crate) const STEP: usize = 1 << 20;
pub(crate) const WINDOW: usize = 32 << 20;
const CHUNK: usize = 2 << 20;

/// One log's prefaulting: its active segment and how far the pages are in.
struct Work {
    seg: Arc<Segment>,
    /// Pages of `seg` below this position are faulted in.
    done: usize,
    /// The thread works until `done` reaches this.
    want: usize,
}

/// Work of every open log that reported, by log; an entry is removed when its log closes, so
/// this holds at most one entry per open log.
struct Shared {
    work: Mutex<BTreeMap<u64, Work>>,
    wake: Condvar,
    /// The log whose pages the thread is faulting in now, outside `work`'s lock.
    busy: Mutex<Option<u64>>,
    /// Signalled when the thread finishes a chunk.
    chunk_done: Condvar,
}

fn shared() -> &'static Shared {
    static SHARED: OnceLock<Shared> = OnceLock::new();
    SHARED.get_or_init(|| {
        if let Err(e) = std::thread::Builder::new().name("petrel-log-prefault".into()).spawn(run) {
            // Prefaulting only saves writers page faults; go on without it.
            tracing::warn!(error = %e, "no prefault thread");
        }
        Shared {
            work: Mutex::new(BTreeMap::new()),
            wake: Condvar::new(),
            busy: Mutex::new(None),
            chunk_done: Condvar::new(),
        }
    })
}

/// A log's handle on the prefault thread.
pub(crate) struct Prefaulter {
    id: u64,
    /// It has work in the shared map (to remove when the log closes).
    reported: bool,
}

impl Default for Prefaulter {
    fn default() -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        Prefaulter { id: NEXT.fetch_add(1, Ordering::Relaxed), reported: false }
    }
}

impl Prefaulter {
    /// The writer is at `pos` in `seg`.
    pub(crate) fn advance(&mut self, seg: &Arc<Segment>, pos: usize) {
        let shared = shared();
        self.reported = true;
        let mut work = shared.work.lock().unwrap_or_else(|e| e.into_inner());
        let want = (pos + WINDOW).min(seg.map.len());
        match work.get_mut(&self.id) {
            Some(w) if Arc::ptr_eq(&w.seg, seg) => {
                w.done = w.done.max(pos);
                w.want = want;
            }
            _ => drop(work.insert(self.id, Work { seg: Arc::clone(seg), done: pos, want })),
        }
        shared.wake.notify_one();
    }

    /// Takes this log off the thread's work and waits until no page of it is being faulted in:
    /// after this, the log may give back blocks past its end (a fault there would take them
    /// again).
    pub(crate) fn stop(&mut self) {
        if !self.reported {
            return;
        }
        self.reported = false;
        let shared = shared();
        shared.work.lock().unwrap_or_else(|e| e.into_inner()).remove(&self.id);
        let mut busy = shared.busy.lock().unwrap_or_else(|e| e.into_inner());
        while *busy == Some(self.id) {
            busy = shared.chunk_done.wait(busy).unwrap_or_else(|e| e.into_inner());
        }
    }
}

impl Drop for Prefaulter {
    fn drop(&mut self) {
        if self.reported {
            shared().work.lock().unwrap_or_else(|e| e.into_inner()).remove(&self.id);
        }
    }
}

/// The thread: a chunk for one log with work, then the next log after it, round robin.
fn run() {
    let shared = shared();
    let mut last = 0u64;
    let mut work = shared.work.lock().unwrap_or_else(|e| e.into_inner());
    loop {
        let pending = |(_, w): &(&u64, &Work)| w.done < w.want;
        let next = work.range(last + 1..).find(pending).or_else(|| work.range(..=last).find(pending));
        let Some((&id, w)) = next else {
            work = shared.wake.wait(work).unwrap_or_else(|e| e.into_inner());
            continue;
        };
        let (seg, from, to) = (Arc::clone(&w.seg), w.done, (w.done + CHUNK).min(w.want));
        *shared.busy.lock().unwrap_or_else(|e| e.into_inner()) = Some(id);
        drop(work);
        // A segment whose pages the page budget took back is not faulted in again ahead of its
        // writer (it counts again at its next write, and faults in as it is written).
        let given_back = seg.lru_stamp.load(Ordering::Relaxed) == 0;
        if !given_back {
            seg.map.prefault_write(from, to);
        }
        last = id;
        *shared.busy.lock().unwrap_or_else(|e| e.into_inner()) = None;
        shared.chunk_done.notify_all();
        work = shared.work.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(w) = work.get_mut(&id).filter(|w| Arc::ptr_eq(&w.seg, &seg)) {
            w.done = if given_back { w.want } else { w.done.max(to) };
        }
    }
}
