//! A helper thread that faults in the pages of the active segment ahead of the writer, so the
//! kernel's page-cache allocation and zeroing happen off the append path, on another core.
//!
//! The writer reports its position every `STEP` bytes; the thread keeps the pages up to
//! `WINDOW` bytes past it faulted in, a `CHUNK` per system call. The thread starts at the first
//! report, so a log that never writes `STEP` bytes (a small queue among thousands) costs none.

use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use crate::segment::Segment;

/// How often (in bytes written) the writer reports its position.
pub(crate) const STEP: usize = 1 << 20;
const WINDOW: usize = 32 << 20;
const CHUNK: usize = 2 << 20;

#[derive(Default)]
struct State {
    seg: Option<Arc<Segment>>,
    /// Pages of `seg` below this position are faulted in.
    done: usize,
    /// The thread works until `done` reaches this.
    want: usize,
    stop: bool,
}

#[derive(Default)]
pub(crate) struct Prefaulter {
    state: Arc<(Mutex<State>, Condvar)>,
    thread: Option<JoinHandle<()>>,
}

impl Prefaulter {
    /// The writer is at `pos` in `seg`.
    pub(crate) fn advance(&mut self, seg: &Arc<Segment>, pos: usize) {
        if self.thread.is_none() {
            let shared = Arc::clone(&self.state);
            match std::thread::Builder::new().name("petrel-log-prefault".into()).spawn(move || run(&shared)) {
                Ok(thread) => self.thread = Some(thread),
                // Prefaulting only saves the writer page faults; go on without it.
                Err(e) => tracing::warn!(error = %e, "no prefault thread"),
            }
        }
        let (lock, wake) = &*self.state;
        let mut state = lock.lock().unwrap_or_else(|e| e.into_inner());
        if !state.seg.as_ref().is_some_and(|s| Arc::ptr_eq(s, seg)) {
            state.seg = Some(Arc::clone(seg));
            state.done = pos;
        }
        state.done = state.done.max(pos);
        state.want = (pos + WINDOW).min(seg.map.len());
        wake.notify_one();
    }
}

fn run(state: &(Mutex<State>, Condvar)) {
    let (lock, wake) = state;
    let mut guard = lock.lock().unwrap_or_else(|e| e.into_inner());
    loop {
        if guard.stop {
            return;
        }
        let Some(seg) = guard.seg.clone().filter(|_| guard.done < guard.want) else {
            guard = wake.wait(guard).unwrap_or_else(|e| e.into_inner());
            continue;
        };
        let (from, to) = (guard.done, (guard.done + CHUNK).min(guard.want));
        drop(guard);
        seg.map.prefault_write(from, to);
        guard = lock.lock().unwrap_or_else(|e| e.into_inner());
        if guard.seg.as_ref().is_some_and(|s| Arc::ptr_eq(s, &seg)) {
            guard.done = guard.done.max(to);
        }
    }
}

impl Drop for Prefaulter {
    fn drop(&mut self) {
        let (lock, wake) = &*self.state;
        lock.lock().unwrap_or_else(|e| e.into_inner()).stop = true;
        wake.notify_one();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
