//! Bounded memory for mapped segments: a budget for the pages they may hold resident, shared by
//! every log opened with (a clone of) the same `PageBudget`, so a server with thousands of queue
//! logs bounds them together rather than each.
//!
//! Segments are counted at their whole mapped length (an upper bound on what can be resident;
//! the active one is prefaulted ahead of its writer) from the moment they are used, in
//! least-recently-used order: the writer uses its active segment when it starts it and every
//! `prefault::STEP` bytes, a reader a sealed segment when it enters it. Past the budget, the least
//! recently used segments give their pages back (`madvise(MADV_DONTNEED)`: for a shared file
//! mapping this drops only this process's page-table entries; dirty data stays in the page cache,
//! and the next access faults it back in). A sealed segment nobody reads drops its in-memory
//! indexes too. The segment being used is never released by its own use.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, Weak};

use crate::segment::Segment;

/// How a segment was last used.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Use {
    /// The writer's segment: its indexes belong to the writer and stay.
    Active,
    /// A sealed segment: when nobody is in it, its indexes go with its pages.
    Sealed,
}

/// Resident memory allowed for the pages of mapped segments, across the logs that share it.
#[derive(Clone)]
pub struct PageBudget {
    inner: Arc<Inner>,
}

struct Inner {
    max: u64,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// By use stamp: least recently used first. A segment's current stamp is in `Segment::lru_stamp`.
    lru: BTreeMap<u64, Entry>,
    next_stamp: u64,
    /// Sum of the entries' lengths.
    bytes: u64,
    /// Segments released to stay within the budget, since the budget was made.
    releases: u64,
}

struct Entry {
    segment: Weak<Segment>,
    len: u64,
    used: Use,
}

impl PageBudget {
    /// A budget of `max_bytes` (0: no limit) for the logs given it.
    pub fn new(max_bytes: u64) -> PageBudget {
        PageBudget { inner: Arc::new(Inner { max: max_bytes, state: Mutex::default() }) }
    }

    pub fn max_bytes(&self) -> u64 {
        self.inner.max
    }

    /// Mapped bytes counted now: an upper bound on the resident pages of the segments counted.
    pub fn counted_bytes(&self) -> u64 {
        self.lock().bytes
    }

    /// Segments that gave their pages back to keep within the budget.
    pub fn releases(&self) -> u64 {
        self.lock().releases
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.inner.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `seg` is being used: it becomes the most recently used, and the least recently used
    /// others give their pages back while the count is over the budget.
    pub(crate) fn touch(&self, seg: &Arc<Segment>, used: Use) {
        let mut state = self.lock();
        let state = &mut *state;
        let old = seg.lru_stamp.load(Ordering::Relaxed);
        if old == 0 || state.lru.remove(&old).is_none() {
            state.bytes += seg.map.len() as u64;
        }
        state.next_stamp += 1;
        let stamp = state.next_stamp;
        seg.lru_stamp.store(stamp, Ordering::Relaxed);
        state.lru.insert(stamp, Entry { segment: Arc::downgrade(seg), len: seg.map.len() as u64, used });
        while self.inner.max != 0 && state.bytes > self.inner.max {
            let Some((&oldest, _)) = state.lru.first_key_value() else { break };
            if oldest == stamp {
                // Only the segment in use is left: it is never released by its own use.
                break;
            }
            let entry = state.lru.remove(&oldest).expect("first key is present");
            state.bytes = state.bytes.checked_sub(entry.len).expect("resident bytes count every entry they lose");
            let Some(other) = entry.segment.upgrade() else { continue };
            other.lru_stamp.store(0, Ordering::Relaxed);
            state.releases += 1;
            if entry.used == Use::Sealed && other.users.load(Ordering::Acquire) == 0 {
                other.release();
            } else {
                // Readers or the writer are in it: their slices stay valid (the page cache holds
                // the data), only the pages go.
                other.map.release_pages();
            }
        }
    }

    /// `seg` is gone (its log closed, or retention deleted it): it no longer counts.
    pub(crate) fn forget(&self, seg: &Segment) {
        let stamp = seg.lru_stamp.swap(0, Ordering::Relaxed);
        if stamp != 0 {
            let mut state = self.lock();
            if let Some(entry) = state.lru.remove(&stamp) {
                state.bytes = state.bytes.checked_sub(entry.len).expect("resident bytes count every entry they lose");
            }
        }
    }
}

impl fmt::Debug for PageBudget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PageBudget")
            .field("max_bytes", &self.inner.max)
            .field("counted_bytes", &self.counted_bytes())
            .finish()
    }
}
