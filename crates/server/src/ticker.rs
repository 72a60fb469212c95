//! The broker's tick (expiries, visibility deadlines, delayed messages coming due) on a thread
//! of its own. Not a runtime task: a tick may wait for the disk (delayed messages moved to their
//! levels are synced), and with delayed messages it runs every millisecond; as a task on the
//! blocking pool each tick woke two threads of the runtime (the ticker's and the pool's), and the
//! woken worker took connections from the busy one, so that two workers then fought over one
//! queue's lock (delayed offers, 10 per request over two connections, log durability `none`,
//! AMD EPYC 2 vCPU, first runs counted: 2.0–2.5 M msg/s that way, 2.6–2.8 M on a thread of its
//! own; docs/benchmarks.md).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use petrel_broker::{Broker, TickAlarm};

use crate::now_ns;

/// The running tick. Dropped without `stop` (the server's future cancelled), it is still told to
/// stop, so that it lets the broker go.
pub(crate) struct Ticker {
    /// What wakes the thread to see `stopping`.
    alarm: Arc<TickAlarm>,
    stopping: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Ticker {
    /// Ticks at least every `beat`, and when the broker's alarm says work comes due sooner.
    /// Called within the server's runtime.
    pub fn start(broker: Arc<Broker>, beat: Duration) -> std::io::Result<Ticker> {
        let stopping = Arc::new(AtomicBool::new(false));
        // What a tick calls may start a task (a timed-out call's answer, waiting for room in
        // its caller's outbox): in the runtime that started the ticker.
        let runtime = tokio::runtime::Handle::current();
        let alarm = broker.alarm();
        let thread = {
            let (alarm, stopping) = (Arc::clone(&alarm), Arc::clone(&stopping));
            std::thread::Builder::new().name("petrel-tick".into()).spawn(move || {
                let _in_runtime = runtime.enter();
                while !stopping.load(Ordering::Acquire) {
                    // From here on, work coming due lowers the alarm's time.
                    alarm.start_tick();
                    let next = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| broker.tick(now_ns())))
                        .unwrap_or_else(|_| {
                            tracing::error!("the broker's tick panicked; it ticks on");
                            u64::MAX
                        });
                    // Next: when a queue's work is due, else at the next beat; at least 1 ms on
                    // (sooner if work came due for sooner since the tick started).
                    let now = now_ns();
                    let wait = Duration::from_nanos(next.saturating_sub(now)).clamp(Duration::from_millis(1), beat);
                    alarm.wait_until(now + wait.as_nanos() as u64, now_ns);
                }
            })?
        };
        Ok(Ticker { alarm, stopping, thread: Some(thread) })
    }

    /// Stops ticking, once a tick under way (which may be syncing) has ended.
    pub async fn stop(mut self) {
        self.tell_to_stop();
        if let Some(thread) = self.thread.take() {
            let _ = tokio::task::spawn_blocking(move || thread.join()).await;
        }
    }

    fn tell_to_stop(&self) {
        self.stopping.store(true, Ordering::Release);
        self.alarm.ring();
    }
}

impl Drop for Ticker {
    fn drop(&mut self) {
        self.tell_to_stop();
    }
}
