//! A helper thread that faults in the pages of the active segment just ahead of the writer, so
//! the kernel's page allocation and zeroing happen off the append path.

use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use crate::segment::Segment;

#[derive(Default)]
struct Request {
    next: Option<(Arc<Segment>, usize, usize)>,
    stop: bool,
}

pub(crate) struct Prefaulter {
    state: Arc<(Mutex<Request>, Condvar)>,
    thread: Option<JoinHandle<()>>,
}

impl Prefaulter {
    pub(crate) fn start() -> std::io::Result<Prefaulter> {
        let state = Arc::new((Mutex::new(Request::default()), Condvar::new()));
        let thread_state = Arc::clone(&state);
        let thread = std::thread::Builder::new().name("petrel-log-prefault".into()).spawn(move || {
            let (lock, wake) = &*thread_state;
            loop {
                let (seg, from, to) = {
                    let mut req = lock.lock().unwrap_or_else(|e| e.into_inner());
                    loop {
                        if req.stop {
                            return;
                        }
                        if let Some(next) = req.next.take() {
                            break next;
                        }
                        req = wake.wait(req).unwrap_or_else(|e| e.into_inner());
                    }
                };
                seg.map.prefault_write(from, to);
            }
        })?;
        Ok(Prefaulter { state, thread: Some(thread) })
    }

    /// Asks for `[from, to)` of `seg` to be faulted in; replaces a request not yet started.
    pub(crate) fn request(&self, seg: &Arc<Segment>, from: usize, to: usize) {
        let (lock, wake) = &*self.state;
        lock.lock().unwrap_or_else(|e| e.into_inner()).next = Some((Arc::clone(seg), from, to));
        wake.notify_one();
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
