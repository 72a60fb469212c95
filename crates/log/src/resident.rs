//! Bounded memory: sealed segments whose pages may be resident are kept in a least-recently-used
//! list, and when their total size passes the budget, the least recently used ones that no reader
//! is in give their pages and in-memory indexes back (`Segment::release`). The active segment is never counted or
//! released. Segments stay mapped (address space is cheap); only resident memory is bounded.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, Weak};

use crate::segment::Segment;

#[derive(Default)]
pub(crate) struct Resident {
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// Least recently used first.
    lru: VecDeque<Weak<Segment>>,
    bytes: u64,
}

impl Resident {
    /// `seg` is being read (or was just sealed): it may hold resident pages.
    pub(crate) fn touch(&self, seg: &Arc<Segment>, budget: u64) {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(i) = state.lru.iter().position(|w| w.as_ptr() == Arc::as_ptr(seg)) {
            let w = state.lru.remove(i).expect("index in range");
            state.lru.push_back(w);
        } else {
            state.lru.push_back(Arc::downgrade(seg));
            state.bytes += seg.map.len() as u64;
        }
        // Release from the least recently used end while over budget; skip segments in use.
        let mut i = 0;
        while state.bytes > budget && i < state.lru.len() {
            match state.lru[i].upgrade() {
                None => {
                    // Deleted by retention; its pages went with it.
                    state.lru.remove(i);
                    state.bytes = recount(&state.lru);
                }
                Some(s) if s.users.load(Ordering::Acquire) == 0 && !Arc::ptr_eq(&s, seg) => {
                    s.release();
                    state.bytes -= s.map.len() as u64;
                    state.lru.remove(i);
                }
                Some(_) => i += 1,
            }
        }
    }
}

fn recount(lru: &VecDeque<Weak<Segment>>) -> u64 {
    lru.iter().filter_map(Weak::upgrade).map(|s| s.map.len() as u64).sum()
}
