//! The last minutes of the server, one sample a second in a bounded ring: what the dashboard's
//! charts draw (`GET /api/v1/samples`).

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::Duration;

use serde::Serialize;

use crate::Ctx;
use crate::stats::get as read;

pub(crate) const SAMPLE_EVERY: Duration = Duration::from_secs(1);
/// Ten minutes of samples.
pub(crate) const SAMPLES_KEPT: usize = 600;

/// The server at one moment. Counters are totals since start that never go back (a removed
/// queue's counts stay in them), so a rate is the difference of two samples over their time.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub(crate) struct Sample {
    /// Unix time, ms.
    pub at_ms: u64,
    /// Messages waiting in every queue, and their bytes (with open reads').
    pub messages: u64,
    pub bytes: u64,
    pub offered: u64,
    pub delivered: u64,
    pub connections: u64,
    pub received_bytes: u64,
    pub sent_bytes: u64,
}

#[derive(Default)]
struct Ring {
    samples: VecDeque<Sample>,
}

#[derive(Default)]
pub(crate) struct Samples {
    ring: Mutex<Ring>,
}

impl Samples {
    /// Takes a sample of the server now (reads every queue's figures: run it off the runtime).
    pub fn take(&self, ctx: &Ctx) {
        // Removed queues' counts stay in the totals; read before the live queues', so that one
        // removed meanwhile is missed for a sample (the totals are kept from going back) rather
        // than counted twice: a total raised by a whole queue's count would stand still, the
        // chart at 0, until the real totals caught up with it.
        let (removed_offered, removed_delivered) = ctx.broker.removed_queues_totals();
        let (mut messages, mut bytes, mut offered, mut delivered) = (0, 0, 0, 0);
        for name in ctx.broker.queue_names() {
            if let Some(q) = ctx.broker.queue(&name) {
                let st = q.counters();
                messages += st.items;
                bytes += st.bytes;
                offered += st.total_offered;
                delivered += st.total_polled;
            }
        }
        let mut ring = self.ring.lock().unwrap_or_else(|e| e.into_inner());
        let last = ring.samples.back().copied().unwrap_or_default();
        let sample = Sample {
            at_ms: crate::now_ns() / 1_000_000,
            messages,
            bytes,
            // Never back, even past such a sample.
            offered: (offered + removed_offered).max(last.offered),
            delivered: (delivered + removed_delivered).max(last.delivered),
            connections: read(&ctx.stats.curr_connections),
            received_bytes: read(&ctx.stats.bytes_read),
            sent_bytes: read(&ctx.stats.bytes_written),
        };
        if ring.samples.len() == SAMPLES_KEPT {
            ring.samples.pop_front();
        }
        ring.samples.push_back(sample);
    }

    /// Every sample kept, oldest first.
    pub fn list(&self) -> Vec<Sample> {
        self.ring.lock().unwrap_or_else(|e| e.into_inner()).samples.iter().copied().collect()
    }
}
